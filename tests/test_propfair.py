"""PropFair (``algorithms/propfair.py``; Zhang et al. 2023): the mixing form
w_k ∝ n_k / max(M - F_k, eps) against a literal NumPy float64 transcription, and the
authors' client form (mode="client": -log(1 - l / M) per minibatch, l / M past the
switch): the batch loss, its gradients, the local steps, whole rounds against NumPy
and the derivative in the baseline M.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from helpers import (rule_weights as _weights, np_propfair, SKEWED_LR as LR,
                     SKEWED_EPOCHS as EPOCHS, SKEWED_KEY as KEY, ALL_IDS, SKEWED_TRAIN as TRAIN,
                     SKEWED_PARAMS as PARAMS, skewed_np_clients as _np_clients,
                     assert_skewed_step as _assert_step)
from fedjax_fair.algorithms import method_hparams
from fedjax_fair.algorithms.propfair import (client_batch_loss, client_objective, propfair,
                                             propfair_mixing)
from fedjax_fair.cli import config as config_lib
from fedjax_fair.core.client import (ClientTraining, batch_from_orders, epoch_order, local_sgd,
                                     masked_mean)


# ------------------------------------------------------------- NumPy float64 references


# ----------------------------------------------------------------------------- PropFair


def test_propfair_matches_reference_and_clips_losses_above_baseline(rng):
    for _ in range(5):
        f = rng.uniform(0, 1.7, size=6).astype(np.float32)
        n = rng.integers(1, 40, size=6)
        for m in (2.0, 3.0, 5.0):
            w, _ = _weights(propfair_mixing(m), f, n)
            np.testing.assert_allclose(w, np_propfair(f, n, m, 0.2), rtol=1e-5)
        w, _ = _weights(propfair_mixing(2.0, weight_by_size=False), f, n)
        np.testing.assert_allclose(w, np_propfair(f, np.ones(6), 2.0, 0.2), rtol=1e-5)
    # F >= M - eps: every such client has utility eps, so the same per-example weight.
    f = np.array([0.5, 1.9, 2.0, 7.0, 1e3], np.float32)
    n = np.array([2, 2, 2, 4, 2])
    w, _ = _weights(propfair_mixing(2.0, eps=0.2), f, n)
    assert np.all(np.isfinite(w))
    np.testing.assert_allclose(w, np_propfair(f, n, 2.0, 0.2), rtol=1e-6)
    np.testing.assert_allclose(w[[1, 2, 4]], w[1])
    np.testing.assert_allclose(w[3], 2 * w[1], rtol=1e-6)
    assert w[0] < w[1]
    # Losses far below M: weights -> the data weights.
    w, _ = _weights(propfair_mixing(1e6), f[:3], n[:3])
    np.testing.assert_allclose(w, n[:3] / n[:3].sum(), rtol=1e-5)
    with pytest.raises(ValueError, match=r"^baseline: "):
        propfair_mixing(0.0)
    # eps is checked by the Python-facing builders (propfair_weights may get traced
    # values and no longer validates).
    with pytest.raises(ValueError, match=r"^eps: "):
        propfair_mixing(2.0, eps=0.0)
    with pytest.raises(ValueError, match=r"^eps: "):
        propfair(helpers.logreg(), baseline=2.0, eps=0.0)


# The authors' client form (mode="client"): per minibatch with mean loss l,
# -log(1 - l / M), or l / M when M - l < eps. Values written out by hand.
PROPFAIR_CLIENT_LOSSES = [  # (l, M, eps, loss)
    (0.0, 2.0, 0.2, 0.0),
    (0.5, 2.0, 0.2, 0.28768207245178085),  # -log(3/4)
    (1.0, 2.0, 0.2, 0.6931471805599453),  # log 2
    (1.7, 2.0, 0.2, 1.8971199848858813),  # -log(0.15): M - l = 0.3, log side
    (1.9, 2.0, 0.2, 0.95),  # M - l = 0.1 < eps: l / M
    (3.0, 2.0, 0.2, 1.5),  # l > M: l / M
    (2.75, 3.0, 0.25, 2.4849066497880004),  # M - l = eps exactly: log side, log 12
    (2.875, 3.0, 0.25, 0.9583333333333334),  # M - l = 0.125 < eps
]


def np_propfair_batch_loss(l, m, eps=0.2):
    """The authors' rule, literally: l / M if M - l < eps else -log(1 - l / M)."""
    return l / m if m - l < eps else -np.log(1 - l / m)


def test_propfair_client_batch_loss_is_the_reference_formula():
    for l, m, eps, expected in PROPFAIR_CLIENT_LOSSES:
        np.testing.assert_allclose(np_propfair_batch_loss(l, m, eps), expected, rtol=1e-12)
        np.testing.assert_allclose(client_batch_loss(l, m, eps), expected,
                                   rtol=1e-6, atol=1e-7)
    # d/dl = 1 / (M - l) on the log side, 1 / M on the linear side; d/dM finite on
    # both sides (-l / (M (M - l)) and -l / M^2), even past l = M.
    dl = jax.grad(client_batch_loss, argnums=0)
    dm = jax.grad(client_batch_loss, argnums=1)
    np.testing.assert_allclose(dl(0.5, 2.0, 0.2), 1 / 1.5, rtol=1e-6)
    np.testing.assert_allclose(dl(1.9, 2.0, 0.2), 0.5, rtol=1e-6)
    np.testing.assert_allclose(dl(3.0, 2.0, 0.2), 0.5, rtol=1e-6)
    np.testing.assert_allclose(dm(0.5, 2.0, 0.2), -0.5 / (2.0 * 1.5), rtol=1e-6)
    np.testing.assert_allclose(dm(1.9, 2.0, 0.2), -1.9 / 4.0, rtol=1e-6)
    np.testing.assert_allclose(dm(3.0, 2.0, 0.2), -3.0 / 4.0, rtol=1e-6)
    # M traced (vmapped), as in a sweep over the baseline.
    ms = jnp.array([2.0, 3.0, 5.0])
    np.testing.assert_allclose(jax.vmap(lambda m: client_batch_loss(0.5, m))(ms),
                               -np.log1p(-0.5 / np.array([2.0, 3.0, 5.0])), rtol=1e-6)


def _masked_batch(model, seed=0):
    """6 rows of one client, the last two masked out (and absurd)."""
    (x, y), = helpers.client_arrays([6], seed=seed)
    x[4:] = 1e3
    batch = {"x": jnp.asarray(x), "y": jnp.asarray(y)}
    return batch, jnp.asarray([True] * 4 + [False] * 2)


def test_propfair_client_objective_loss_and_gradient_on_a_masked_batch():
    """Local SGD's batch objective is the batch's PropFair loss with gradient
    grad l / (M - l) (grad l / M past the switch), l the mean raw loss over the real
    rows only, as ``local_sgd`` calls it (masked rows zeroed)."""
    model = helpers.logreg()
    params = helpers.init_params(model, 3)
    batch, mask = _masked_batch(model)

    def raw(p):
        return masked_mean(model.per_example_loss(p, batch), mask)

    def trained(p, m, eps=0.2):
        per_example = jnp.where(mask, model.per_example_loss(p, batch), 0.0)
        return client_objective(m, eps)(per_example, mask)

    l = float(raw(params))
    g = jax.grad(raw)(params)
    for m, scale in ((l + 1.0, 1.0 / 1.0), (l + 0.1, 1.0 / (l + 0.1))):  # log, linear side
        np.testing.assert_allclose(trained(params, m), np_propfair_batch_loss(l, m), rtol=1e-5)
        helpers.assert_trees_close(jax.grad(trained)(params, m),
                                   jax.tree.map(lambda v: scale * v, g), rtol=1e-5, atol=1e-7)


def test_propfair_client_mode_trains_on_the_batch_objective():
    """One local step of ``mode="client"`` on a client with a partial last batch is
    SGD on -log(1 - l / M) of that batch (against jax.grad of the literal objective),
    and ``train_loss`` stays the model's own mean loss."""
    model = helpers.logreg()
    params = helpers.init_params(model, 1)
    train = helpers.tiny_federation(padded_size=13).train
    data = helpers.client(train, 0)  # n = 7
    m = 3.0
    sgd = local_sgd(model, batch_size=5, max_steps=1,
                    batch_loss=client_objective(m, 0.2))
    new, steps, train_loss = sgd(params, optax.sgd(0.5), data, 100, jax.random.key(0))
    plain = local_sgd(model, batch_size=5, max_steps=1)
    _, _, plain_loss = plain(params, optax.sgd(0.5), data, 100, jax.random.key(0))
    assert int(steps) == 1
    np.testing.assert_allclose(train_loss, plain_loss, rtol=1e-6)
    moved = jax.tree.map(lambda a, b: (a - b) / -0.5, new, params)  # the gradient taken
    # the batch local_sgd drew: its shuffle key is the first half of the client key
    orders = epoch_order(data, jax.random.split(jax.random.key(0))[0], 0, 5)[None]
    batch, batch_mask = batch_from_orders(data, orders, 0, 5)
    expect = jax.grad(lambda p: client_batch_loss(
        masked_mean(model.per_example_loss(p, batch), batch_mask), m))(params)
    helpers.assert_trees_close(moved, expect, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------- whole rounds
# The skewed federation of helpers.skewed_train (6 clients, M = 12): clients 0-3
# and client 4 are labelled by opposite linear teachers, client 5 is empty; clients
# train full-batch, so NumPy gradient descent reproduces every local model.

MODEL = helpers.logreg()


def np_propfair_client(x, y, m, eps, lr, steps):
    """The authors' PropFair client, full batch: ``steps`` SGD steps on
    -log(1 - l / M) (l / M when M - l < eps); (W, b, M - l at every step)."""
    w, b = helpers.logreg_to_numpy(PARAMS)
    margins = []
    for _ in range(steps):
        logits = x.astype(np.float64) @ w + b
        logits -= logits.max(-1, keepdims=True)
        l = np.mean(np.log(np.exp(logits).sum(-1)) - logits[np.arange(len(y)), y])
        scale = 1.0 / m if m - l < eps else 1.0 / (m - l)
        gw, gb = helpers.logreg_grad_numpy(w, b, x, y)
        w, b = w - lr * scale * gw, b - lr * scale * gb
        margins.append(m - l)
    return w, b, margins


def test_propfair_client_mode_round_equals_numpy():
    """mode="client": every client trains on the per-minibatch PropFair loss (here
    full-batch, B = 16 > M = 12, so the data are padded and client 4's batch is
    partial) and the server averages with FedAvg's n_k weights (uniform with
    weight_by_size=False); F_k stays the raw loss."""
    m, eps = 1.6, 0.2  # client 3 starts past the switch (F = 1.47), the rest on the log side
    w0, b0 = helpers.logreg_to_numpy(PARAMS)
    step, margins = np.zeros(w0.size + b0.size), []
    n = np.asarray(TRAIN.num_examples, np.float64)
    for k in range(5):
        x, y = helpers.real_rows(TRAIN, [k])
        w, b, mk = np_propfair_client(x, y, m, eps, LR, EPOCHS)
        step += n[k] / n.sum() * np.concatenate([(w0 - w).ravel(), b0 - b])
        margins += mk
    margins = np.asarray(margins)
    assert np.any(margins < eps) and np.any(margins >= eps)
    assert np.abs(margins - eps).min() > 1e-3  # float32 takes the same branches
    for weight_by_size in (True, False):
        alg = helpers.bind_execution(
            propfair(MODEL, baseline=m, eps=eps, mode="client", weight_by_size=weight_by_size,
                     training=ClientTraining(lr=LR, batch_size=16, num_epochs=EPOCHS)),
            "sequential")
        state, metrics = jax.jit(alg.apply)(alg.init(PARAMS, 6),
                                            helpers.cohort(TRAIN, ALL_IDS), KEY)
        np.testing.assert_allclose(metrics["loss_before"][:5],
                                   [f for _, f in _np_clients().values()], rtol=1e-5)
        if weight_by_size:
            np.testing.assert_allclose(metrics["weights"], n / n.sum(), rtol=1e-6)
            _assert_step(state.params, step, rtol=1e-4, atol=1e-6)
        else:
            np.testing.assert_allclose(metrics["weights"], np.full(6, 1 / 6), rtol=1e-6)


def test_propfair_client_mode_is_differentiable_in_the_baseline():
    """d theta^(t+1) / dM through the client loss (traced M) matches central
    differences of the NumPy round."""
    cohort = helpers.cohort(TRAIN, ALL_IDS)

    def new_bias_sum(m):
        alg = helpers.bind_execution(
            propfair(MODEL, baseline=m, mode="client",
                     training=ClientTraining(lr=LR, batch_size=12, num_epochs=EPOCHS)),
            "sequential")
        state, _ = alg.apply(alg.init(PARAMS, 6), cohort, KEY)
        return jnp.sum(state.params["params"]["Dense_0"]["bias"])

    def np_bias_sum(m):
        n = np.asarray(TRAIN.num_examples, np.float64)
        _, b0 = helpers.logreg_to_numpy(PARAMS)
        total = b0.copy()
        for k in range(5):
            x, y = helpers.real_rows(TRAIN, [k])
            _, b, _ = np_propfair_client(x, y, m, 0.2, LR, EPOCHS)
            total -= n[k] / n.sum() * (b0 - b)
        return total.sum()

    m = 3.0  # every step on the log side
    grad = float(jax.jit(jax.grad(new_bias_sum))(jnp.float32(m)))
    h = 1e-4
    np.testing.assert_allclose(grad, (np_bias_sum(m + h) - np_bias_sum(m - h)) / (2 * h),
                               rtol=1e-3, atol=1e-6)


def test_propfair_mode_is_checked_and_reachable_from_a_config():
    with pytest.raises(ValueError, match=r"^mode: "):
        propfair(MODEL, mode="clients")
    assert config_lib.validate_hparams("propfair", {"mode": "client"}) == {"mode": "client"}
    assert method_hparams("propfair")["mode"].default == "mixing"
