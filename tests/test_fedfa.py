"""FedFa (``algorithms/fedfa.py``; Huang et al., arXiv:2012.10069): the accuracy /
frequency weights against a literal NumPy float64 transcription of their equations;
whole rounds (momentum local GD, participation counts, server momentum) against a
NumPy reference; a masked cohort row is an absent client; no momentum and alpha = 0
under full participation is FedAvg with the simple average; vmap over alpha and grad
in alpha, gamma and the server momentum rate through ``simulate``; the accuracy term
helps the client the model fits worst.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from fedjax_fair.algorithms import fedavg
from fedjax_fair.algorithms.fedfa import fedfa, fedfa_weights
from fedjax_fair.core.client import ClientTraining, data_loss
from fedjax_fair.core.mixing import exponentiated
from fedjax_fair.core.types import FederatedData
from fedjax_fair.drivers.simulate import simulate

MODEL = helpers.logreg()
TRAIN = helpers.SKEWED_TRAIN  # clients 0-3 and 4 labelled by opposite teachers, 5 empty
PARAMS = helpers.SKEWED_PARAMS
N = 6
LR, EPOCHS = 0.2, 2
TRAINING = ClientTraining(lr=LR, batch_size=12, num_epochs=EPOCHS)  # full batch


# ------------------------------------------------------------- NumPy float64 reference


def np_fedfa_weights(acc, freq, alpha, beta):
    """The information-quantity weights of the clients given (all active)."""
    acc, freq = np.asarray(acc, np.float64), np.asarray(freq, np.float64)
    share = acc / acc.sum() if acc.sum() > 0 else np.full(len(acc), 1 / len(acc))
    acc_info = np.maximum(-np.log2(share + 1e-6), 0.0)
    acc_info = acc_info / acc_info.sum()
    freq_info = np.maximum(-np.log2(1 - freq / freq.sum() + 1e-5), 0.0)
    freq_info = freq_info / freq_info.sum()
    return (alpha * acc_info + beta * freq_info) / (alpha + beta)


_weights = jax.jit(fedfa_weights)  # alpha and beta traced: one program per shape


def test_weights_equal_the_formula(rng):
    k = 7
    for _ in range(10):
        acc = rng.uniform(0, 1, size=k)
        freq = rng.integers(1, 9, size=k).astype(np.float64)
        active = rng.uniform(size=k) > 0.3
        active[0] = True
        for alpha, beta in ((0.5, 0.5), (1.0, 0.0), (0.0, 1.0), (0.2, 0.6)):
            w = np.asarray(_weights(jnp.asarray(acc, jnp.float32),
                                    jnp.asarray(freq, jnp.float32), jnp.asarray(active),
                                    jnp.float32(alpha), jnp.float32(beta)), np.float64)
            expected = np.zeros(k)
            expected[active] = np_fedfa_weights(acc[active], freq[active], alpha, beta)
            np.testing.assert_allclose(w, expected, rtol=1e-5, atol=1e-7)
    # a lower accuracy share and a larger participation share weigh more
    w = np.asarray(fedfa_weights(jnp.asarray([0.2, 0.8]), jnp.asarray([3.0, 3.0]),
                                 jnp.ones(2, bool), 1.0, 0.0))
    assert w[0] > w[1]
    w = np.asarray(fedfa_weights(jnp.asarray([0.5, 0.5]), jnp.asarray([1.0, 5.0]),
                                 jnp.ones(2, bool), 0.0, 1.0))
    assert w[1] > w[0]
    # all accuracies 0: that term is uniform; one active client: weight 1, finite
    w = fedfa_weights(jnp.zeros(3), jnp.asarray([1.0, 2.0, 4.0]), jnp.ones(3, bool), 1.0, 0.0)
    np.testing.assert_allclose(w, [1 / 3] * 3, rtol=1e-6)
    w = fedfa_weights(jnp.asarray([0.7, 0.1]), jnp.asarray([2.0, 5.0]),
                      jnp.asarray([True, False]), 0.5, 0.5)
    np.testing.assert_allclose(w, [1.0, 0.0], rtol=1e-6)
    # alpha + beta = 0 (only reachable traced): the uniform weights
    w = _weights(jnp.asarray([0.2, 0.8]), jnp.asarray([1.0, 2.0]), jnp.ones(2, bool),
                 jnp.float32(0.0), jnp.float32(0.0))
    np.testing.assert_allclose(w, [0.5, 0.5])


def test_bad_values_are_refused_when_built():
    for kw, field in ((dict(alpha=-1.0), "alpha"), (dict(beta=float("nan")), "beta"),
                      (dict(gamma=1.0), "gamma"), (dict(server_momentum=1.5), "server_momentum"),
                      (dict(momentum_lr=-0.1), "momentum_lr"), (dict(alpha=0.0, beta=0.0), "beta")):
        with pytest.raises(ValueError, match=f"^{field}: "):
            fedfa(MODEL, **kw)


# ----------------------------------------------------------------------- whole rounds

# (ids, mask) of four rounds of 6 rows (the full cohort's shape: one compiled round for
# every test here): partial cohorts padded with masked rows, the empty client 5 and
# the minority client 4 in and out
ROUNDS = [([0, 1, 4, 2, 0, 3], [True, True, True, True, False, False]),
          ([3, 5, 0, 1, 4, 4], [True, True, True, False, False, False]),
          ([4, 2, 3, 0, 1, 2], [True, True, True, True, False, False]),
          ([1, 3, 5, 2, 0, 0], [True, True, True, True, False, False])]
EVERYONE = (list(range(N)), [True] * N)
HP = dict(alpha=0.3, beta=0.7, gamma=0.5, server_momentum=0.6, momentum_lr=0.4)


def _build(hp):
    return fedfa(MODEL, training=TRAINING, **hp)


@functools.cache
def _round():
    """One jitted round with every hyper-parameter a traced argument."""
    def apply(state, cohort, key, hp):
        return helpers.bind_execution(_build(hp), "sequential").apply(state, cohort, key)
    return jax.jit(apply)


def _run(hp, rounds, params=PARAMS):
    hp = {k: jnp.float32(v) for k, v in hp.items()}
    state = _build(hp).init(params, N)
    weights = []
    for r, (ids, mask) in enumerate(rounds):
        state, metrics = _round()(state, helpers.cohort(TRAIN, ids, mask=mask),
                                  jax.random.fold_in(helpers.SKEWED_KEY, r), hp)
        weights.append(np.asarray(metrics["weights"]))
    return state, weights


def _np_client(w0, b0, k, gamma):
    """(update, training accuracy of (w0, b0)) of client k: EPOCHS full-batch steps of
    heavy-ball GD (v <- gamma v + grad, w <- w - lr v) from (w0, b0)."""
    x, y = helpers.real_rows(TRAIN, [k])
    if not len(y):
        return np.zeros(w0.size + b0.size), 0.0
    acc = np.mean(np.argmax(x.astype(np.float64) @ w0 + b0, -1) == y)
    w, b, vw, vb = w0.copy(), b0.copy(), np.zeros_like(w0), np.zeros_like(b0)
    for _ in range(EPOCHS):
        gw, gb = helpers.logreg_grad_numpy(w, b, x, y)
        vw, vb = gamma * vw + gw, gamma * vb + gb
        w, b = w - LR * vw, b - LR * vb
    return np.concatenate([(w0 - w).ravel(), b0 - b]), acc


def np_fedfa_rounds(hp, rounds):
    """The rounds literally: counts of participations, weights over the participants
    holding data, m <- mu m + (1 - mu) Delta, theta <- theta - Delta - eta m."""
    w0, b0 = helpers.logreg_to_numpy(PARAMS)
    theta = np.concatenate([w0.ravel(), b0])
    counts, momentum, weights = np.zeros(N), np.zeros_like(theta), []
    sizes = np.asarray(TRAIN.num_examples)
    for ids, mask in rounds:
        w, b = theta[:-3].reshape(10, 3), theta[-3:]
        for k, m in zip(ids, mask):
            counts[k] += m
        rows = [i for i, (k, m) in enumerate(zip(ids, mask)) if m and sizes[k] > 0]
        local = {i: _np_client(w, b, ids[i], hp["gamma"]) for i in rows}
        p = np_fedfa_weights([local[i][1] for i in rows], [counts[ids[i]] for i in rows],
                             hp["alpha"], hp["beta"])
        round_weights = np.zeros(len(ids))
        round_weights[rows] = p
        weights.append(round_weights)
        delta = sum(pi * local[i][0] for pi, i in zip(p, rows))
        momentum = hp["server_momentum"] * momentum + (1 - hp["server_momentum"]) * delta
        theta = theta - delta - hp["momentum_lr"] * momentum
    return theta, weights


def test_rounds_equal_a_numpy_reference():
    state, weights = _run(HP, ROUNDS)
    theta, expected = np_fedfa_rounds(HP, ROUNDS)
    w, b = helpers.logreg_to_numpy(state.params)
    np.testing.assert_allclose(np.concatenate([w.ravel(), b]), theta, rtol=1e-4, atol=1e-5)
    for got, want in zip(weights, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    # participation counts: masked rows are not participations
    np.testing.assert_array_equal(state.mixing_state.counts, [3, 2, 3, 3, 2, 2])


def test_a_masked_row_is_an_absent_client():
    """A masked row, whatever client sits in it, changes nothing in the whole server
    state (counts and momentum included) and gets weight 0."""
    hp = {k: jnp.float32(v) for k, v in HP.items()}
    state = _build(hp).init(PARAMS, N)
    state, _ = _round()(state, helpers.cohort(TRAIN, ROUNDS[0][0], mask=ROUNDS[0][1]), helpers.SKEWED_KEY, hp)
    mask = [True, False, True, True, False, True]
    a, ma = _round()(state, helpers.cohort(TRAIN, [1, 4, 0, 3, 2, 5], mask=mask),
                     helpers.SKEWED_KEY, hp)
    b, mb = _round()(state, helpers.cohort(TRAIN, [1, 2, 0, 3, 4, 5], mask=mask),
                     helpers.SKEWED_KEY, hp)
    helpers.assert_trees_close(b, a, rtol=0, atol=0)
    np.testing.assert_array_equal(np.asarray(ma["weights"])[~np.asarray(mask)], 0.0)
    np.testing.assert_array_equal(a.mixing_state.counts, [2, 2, 1, 1, 1, 1])


def test_no_momentum_and_alpha_zero_under_full_participation_is_the_simple_average():
    """gamma = 0 (plain local SGD), eta = 0 (no server momentum step) and alpha = 0: all
    clients take part every round, so their frequencies are equal, and so are the
    weights: FedAvg with the simple average over the clients holding data."""
    hp = dict(alpha=0.0, beta=1.0, gamma=0.0, server_momentum=0.9, momentum_lr=0.0)
    state, weights = _run(hp, [EVERYONE] * 3)
    alg = helpers.bind_execution(fedavg(MODEL, training=TRAINING,
                                        mixing=exponentiated(lambda out: 0.0, False)),
                                 "sequential")
    ref = alg.init(PARAMS, N)
    apply = jax.jit(alg.apply)
    for r in range(3):
        ref, metrics = apply(ref, helpers.cohort(TRAIN, EVERYONE[0], mask=EVERYONE[1]),
                             jax.random.fold_in(helpers.SKEWED_KEY, r))
        np.testing.assert_allclose(weights[r], metrics["weights"], rtol=1e-6)
    helpers.assert_trees_close(state.params, ref.params, rtol=1e-5, atol=1e-7)


# ---------------------------------------- traced hyper-parameters: vmap and grad

DATA = FederatedData(train=TRAIN, test=helpers.skewed_train(seed=1))


def _test_loss(alpha, gamma, momentum_lr):
    alg = fedfa(MODEL, alpha=alpha, beta=1.0 - alpha, gamma=gamma, momentum_lr=momentum_lr,
                training=ClientTraining(lr=0.1, batch_size=12))
    state, _ = simulate(alg, alg.init(PARAMS, N), DATA, jax.random.key(0), num_rounds=3,
                        cohort_size=4, execution="sequential")
    losses = jax.vmap(lambda d: data_loss(MODEL, state.params, d))(DATA.test)
    return jnp.mean(losses[:5])


def test_vmap_over_alpha_and_grad_in_alpha_gamma_and_the_momentum_rate():
    """One program: the test loss after 3 rounds and its gradient in (alpha, gamma,
    eta) vmapped over 7 points, the centre and +/- h along each argument; every
    gradient equals the central difference of the vmapped losses, and alpha reaches
    the run."""
    centre, h = np.asarray([0.4, 0.5, 0.3]), 1e-2
    points = [centre] + [centre + s * h * np.eye(3)[i] for i in range(3) for s in (-1, 1)]
    args = jnp.asarray(np.stack(points), jnp.float32)
    values, grads = jax.jit(jax.vmap(jax.value_and_grad(_test_loss, argnums=(0, 1, 2))))(
        args[:, 0], args[:, 1], args[:, 2])
    values = np.asarray(values, np.float64)
    grads = np.stack([np.asarray(g, np.float64) for g in grads], axis=1)
    assert np.all(np.isfinite(values)) and np.all(np.isfinite(grads))
    for i in range(3):
        fd = (values[2 + 2 * i] - values[1 + 2 * i]) / (2 * h)
        assert abs(fd) > 1e-4, i
        np.testing.assert_allclose(grads[0, i], fd, rtol=5e-2, atol=1e-4)


# ------------------------------------------------------------- the paper's claim, small


def test_the_accuracy_term_helps_the_client_the_model_fits_worst():
    """Client 4's labels oppose clients 0-3's: the simple average (alpha = 0 under full
    participation) leaves it with the largest loss. Weighting by the information of the
    accuracy share (beta = 0) gives it more weight and, after 20 rounds, a clearly
    smaller worst-client loss at a similar mean."""
    losses, last_weights = {}, {}
    for name, hp in (("accuracy", dict(alpha=1.0, beta=0.0)), ("average", dict(alpha=0.0,
                                                                               beta=1.0))):
        state, weights = _run(dict(hp, gamma=0.0, server_momentum=0.9, momentum_lr=0.0),
                              [EVERYONE] * 20)
        losses[name] = np.asarray(jax.vmap(lambda d: data_loss(MODEL, state.params, d))(
            TRAIN))[:5]
        last_weights[name] = weights[-1]
    assert np.argmax(losses["average"]) == 4
    assert last_weights["accuracy"][4] > last_weights["average"][4]
    assert losses["accuracy"].max() < 0.9 * losses["average"].max()
    assert losses["accuracy"].mean() < 1.1 * losses["average"].mean()
