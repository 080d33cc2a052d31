"""Local training (``core/client.py``; tests/test_client.py has the step budgets,
empty clients and batching): its argument checks (training.lr, training.optimizer,
the proximal term's mu) and what passes unchecked (schedules, traced values);
gradient clipping of the local steps against a NumPy float64 reference, traced and
differentiated through rounds; and the engine's fast paths (the packed epoch order,
batches gathered before the step loop), which give the same batches and results as
the plain paths.

The federation is helpers.tiny_federation() (client 2 is empty); full-batch clients
(B = 12 >= every client's size) make each local step one gradient-descent step.
"""
from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from helpers import (ALG_MODEL as MODEL, ALG_PARAMS as PARAMS, ALG_TRAIN as TRAIN, ALG_N as N,
                     ALG_LR as LR, ALG_KEY as KEY, sequential as _seq,
                     ALG_FULL_BATCH as FULL_BATCH, ALG_EPOCHS as EPOCHS, ALG_MU as MU,
                     ALG_IDS as IDS, assert_logreg_close as _assert_logreg_close)
from fedjax_fair.algorithms import fedavg, fedprox
from fedjax_fair.core.client import ClientTraining, local_training


# ---------------------------------------------------------------------- argument checks


@pytest.mark.parametrize("value", [-1.0, 0.0, float("nan"), float("inf"), "0.1", True],
                         ids=repr)
def test_local_training_checks_a_concrete_client_lr(value):
    with pytest.raises(ValueError, match="^training.lr: "):
        local_training(MODEL, training=ClientTraining(lr=value, batch_size=4))


def test_local_training_refuses_an_optimizer_that_is_not_optax():
    with pytest.raises(TypeError, match="^training.optimizer: "):
        local_training(MODEL, training=ClientTraining(optimizer="adam", batch_size=4))


def test_local_training_lets_schedules_and_traced_rates_through():
    """A schedule and a JAX array pass unchecked (never a Python comparison on a
    tracer): the client update is differentiable in a traced training.lr."""
    from fedjax_fair.core.types import Broadcast
    # a schedule is evaluated per round
    local_training(MODEL, training=ClientTraining(lr=lambda t: -1.0, batch_size=4))
    local_training(MODEL, training=ClientTraining(lr=jnp.float32(-1.0), batch_size=4))
    data = helpers.client(TRAIN, 0)

    def loss_after(lr):
        update = local_training(MODEL, training=ClientTraining(lr=lr, batch_size=FULL_BATCH))
        out, _ = update(Broadcast(PARAMS, jnp.zeros((), jnp.int32), ()), (), data,
                        jnp.int32(2 ** 30), KEY)
        return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(out.delta))

    grad = jax.grad(loss_after)(jnp.float32(LR))
    assert np.isfinite(float(grad)) and float(grad) > 0.0


@pytest.mark.parametrize("value", [-1.0, -1e-9, float("nan"), "0.1", None], ids=repr)
def test_proximal_term_checks_a_concrete_mu(value):
    from fedjax_fair.core.client import proximal_term
    with pytest.raises(ValueError, match="^mu: "):
        proximal_term(value)


def test_proximal_term_is_differentiable_and_vmappable_in_a_traced_mu():
    """mu as a tracer skips the check: d/dmu (mu / 2) ||w - w^t||^2 = ||w - w^t||^2 / 2,
    under jax.grad and jax.vmap alike (mu = 0 is allowed, as FedAvg)."""
    from fedjax_fair.core.client import proximal_term
    from fedjax_fair.core.types import Broadcast
    proximal_term(0.0)
    proximal_term(np.float32(0.5))
    params = {"w": jnp.array([1.0, 2.0, 3.0])}
    broadcast = Broadcast({"w": jnp.array([0.0, 2.0, 5.0])}, jnp.zeros((), jnp.int32), ())
    term = lambda mu: proximal_term(mu)(params, broadcast, ())
    np.testing.assert_allclose(jax.grad(term)(jnp.float32(0.3)), 0.5 * (1.0 + 4.0))
    np.testing.assert_allclose(jax.vmap(term)(jnp.array([0.0, 1.0, 2.0])), [0.0, 2.5, 5.0])
    # Through a whole FedProx client update: the local model depends on mu.
    data = helpers.client(TRAIN, 0)

    def moved(mu):
        update = local_training(MODEL, training=ClientTraining(lr=LR, batch_size=FULL_BATCH,
                                                               num_epochs=EPOCHS),
                                regularizer=proximal_term(mu))
        out, _ = update(Broadcast(PARAMS, jnp.zeros((), jnp.int32), ()), (), data,
                        jnp.int32(2 ** 30), KEY)
        return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(out.delta))

    assert float(jax.grad(moved)(jnp.float32(MU))) < 0.0  # a stronger pull moves less


# -------------------------------------------------------------------- gradient clipping
# Gradient clipping of the local steps (client.local_sgd: clip_norm, clip_mode).

CLIP_MU, CLIP_WD, CLIP_STEPS = 2.0, 0.05, 4
CHEAP_COMPILE = ({"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
                 if jax.default_backend() == "cpu" else None)


def _clip_np(grads, c):
    """grads scaled by min(1, c / ||grads||), the norm over the (W, b) pair."""
    norm = np.sqrt(sum(np.sum(g ** 2) for g in grads))
    return tuple(g * min(1.0, c / norm) for g in grads), norm


def _clipped_numpy(start, anchor, x, y, lr, c, mode):
    """CLIP_STEPS full-batch steps on CE + (mu / 2) ||p - anchor||^2 with coupled weight
    decay wd: "step" p -= lr (clip(g + mu (p - anchor)) + wd p), "loss" p -= lr (clip(g)
    + mu (p - anchor) + wd p). Also returns the norms the clip saw."""
    p, seen = start, []
    for _ in range(CLIP_STEPS):
        g = helpers.logreg_grad_numpy(p[0], p[1], x, y)
        reg = tuple(CLIP_MU * (a - b) for a, b in zip(p, anchor))
        if mode == "step":
            g, norm = _clip_np(tuple(u + r for u, r in zip(g, reg)), c)
        else:
            g, norm = _clip_np(g, c)
            g = tuple(u + r for u, r in zip(g, reg))
        seen.append(norm)
        p = tuple(q - lr * (u + CLIP_WD * q) for q, u in zip(p, g))
    return p, seen


def _clipped_update(clip_norm, clip_mode, start_params):
    """One client's FedProx-style local training from ``start_params`` (not the
    broadcast, so the proximal term pulls from the first step)."""
    from fedjax_fair.core.client import proximal_term
    training = ClientTraining(lr=LR, batch_size=FULL_BATCH, num_epochs=CLIP_STEPS,
                              weight_decay=CLIP_WD, clip_norm=clip_norm, clip_mode=clip_mode)
    return local_training(MODEL, training=training, regularizer=proximal_term(CLIP_MU),
                          start=lambda broadcast, state: start_params)


@pytest.mark.parametrize("mode", ["step", "loss"])
def test_clipped_local_steps_equal_a_numpy_reference(mode):
    """Both clip forms against a literal float64 reference, the clip active at every
    step, the proximal term present (so the forms differ) and the weight decay added
    after the clip."""
    from fedjax_fair.core.types import Broadcast
    k = 1  # 12 rows: one full batch a step
    x, y = helpers.real_rows(TRAIN, [k])
    start = helpers.random_like(PARAMS, 5)
    anchor_np, start_np = helpers.logreg_to_numpy(PARAMS), helpers.logreg_to_numpy(start)
    g0 = helpers.logreg_grad_numpy(*start_np, x, y)
    clip = 0.3 * float(np.sqrt(sum(np.sum(g ** 2) for g in g0)))
    expected, norms = _clipped_numpy(start_np, anchor_np, x, y, LR, clip, mode)
    assert min(norms) > 1.2 * clip  # the clip is active at every step
    other, _ = _clipped_numpy(start_np, anchor_np, x, y, LR, clip,
                              "loss" if mode == "step" else "step")
    assert np.abs(expected[0] - other[0]).max() > 1e-3  # the two forms differ here

    broadcast = Broadcast(PARAMS, jnp.zeros((), jnp.int32), ())
    update = jax.jit(_clipped_update(clip, mode, start))
    out, _ = update(broadcast, (), helpers.client(TRAIN, k), jnp.int32(2 ** 30), KEY)
    assert int(out.num_steps) == CLIP_STEPS
    trained = jax.tree.map(jnp.subtract, PARAMS, out.delta)
    _assert_logreg_close(trained, expected, rtol=2e-5, atol=2e-6)


def test_clip_norm_none_builds_the_program_without_the_option():
    """clip_norm=None: the same compiled program as the local steps had before the
    option (weight decay joined to the regularizer), so the iterates are bit-identical;
    a clip that never binds gives the same iterates to float rounding."""
    from fedjax_fair.core.client import local_sgd, proximal_term, with_weight_decay
    prox = proximal_term(CLIP_MU)
    reg = lambda p, b: prox(p, b, ())
    data = helpers.client(TRAIN, 1)
    from fedjax_fair.core.types import Broadcast
    broadcast = Broadcast(PARAMS, jnp.zeros((), jnp.int32), ())
    start = helpers.random_like(PARAMS, 5)

    def program(train):
        fn = jax.jit(lambda p: train(p, optax.sgd(LR), data, jnp.int32(2 ** 30), KEY,
                                     (broadcast,)))
        return fn.lower(start).as_text(), fn(start)[0]

    kw = dict(batch_size=4, num_epochs=2)
    before = program(local_sgd(MODEL, regularizer=with_weight_decay(reg, CLIP_WD), **kw))
    now = program(local_sgd(MODEL, regularizer=reg, weight_decay=CLIP_WD, clip_norm=None, **kw))
    assert now[0] == before[0]
    chex.assert_trees_all_equal(now[1], before[1])
    loose = program(local_sgd(MODEL, regularizer=reg, weight_decay=CLIP_WD, clip_norm=1e6,
                              clip_mode="loss", **kw))
    assert loose[0] != before[0]
    helpers.assert_trees_close(loose[1], before[1], rtol=1e-6, atol=1e-7)


def test_clip_by_global_norm_matches_optax_and_is_finite_at_zero():
    """The rule of optax.clip_by_global_norm, but NaN-free in reverse mode through a
    zero gradient (an all-masked batch), with bfloat16 leaves and a traced bound."""
    from fedjax_fair.core.client import clip_by_global_norm
    tree = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([[12.0]])}  # norm 13
    for c in (1.0, 13.0, 20.0):
        mine = clip_by_global_norm(tree, c)
        ref, _ = optax.clip_by_global_norm(c).update(tree, None)
        helpers.assert_trees_close(mine, ref, rtol=1e-6, atol=0)
    chex.assert_trees_all_equal(clip_by_global_norm(tree, 20.0), tree)  # exactly 1 below c
    zero_grad = jax.grad(lambda x: jnp.sum(clip_by_global_norm({"a": 0.0 * x}, 1.0)["a"]))(
        jnp.ones(3))
    assert np.all(np.isfinite(zero_grad))
    half = jax.jit(clip_by_global_norm)(jax.tree.map(lambda v: v.astype(jnp.bfloat16), tree),
                                        jnp.float32(6.5))
    assert half["a"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(half["b"], np.float32), [[6.0]], rtol=1e-2)


def test_clip_norm_is_differentiable_and_vmappable_through_rounds():
    """A traced clip_norm: jax.vmap over it equals separate runs, and jax.grad of the
    squared norm of the model after a FedProx round (vmap execution: clients past
    their step count take masked steps with a zero loss gradient; "loss" form) is
    finite and matches central differences (float64)."""
    with jax.enable_x64(True):
        train, params = helpers.in_default_float(TRAIN, PARAMS)
        cohort = helpers.cohort(train, (0, 1, 3, 2), (2 ** 30, 2, 2 ** 30, 2 ** 30))

        def final_norm(c):
            alg = helpers.bind_execution(
                fedprox(MODEL, mu=MU, training=ClientTraining(
                    lr=LR, batch_size=4, num_epochs=2, clip_norm=c, clip_mode="loss")),
                "vmap")
            state, _ = alg.apply(alg.init(params, N), cohort, KEY)
            return sum(jnp.sum(jnp.square(v)) for v in jax.tree.leaves(state.params))

        values = jnp.array([0.05, 0.2, 1e3])
        cheap = functools.partial(jax.jit, compiler_options=CHEAP_COMPILE)
        value_and_grad = cheap(jax.value_and_grad(final_norm))
        swept = cheap(jax.vmap(final_norm))(values)
        separate = [value_and_grad(v) for v in values]
        np.testing.assert_allclose(swept, [float(v) for v, _ in separate], rtol=1e-12)
        assert abs(float(separate[0][0]) - float(separate[2][0])) > 1e-3  # the clip binds
        step = 1e-6
        for c, (_, g) in zip(values[:2], separate[:2]):
            assert np.isfinite(float(g)) and abs(float(g)) > 1e-3
            up, down = value_and_grad(c + step)[0], value_and_grad(c - step)[0]
            np.testing.assert_allclose(float(g), (float(up) - float(down)) / (2 * step),
                                       rtol=1e-6)
        assert float(separate[2][1]) == 0.0  # a clip that never binds: no dependence


# -------------------------------------------------------------------- engine fast paths
# Engine fast paths (benchmarks/step_overhead.py): the same batches and the same
# results as the plain paths.


def _argsort_epoch_order(data, shuffle_key, epoch, batch_size):
    """The epoch order's definition: the stable argsort of the scores, padded rows 2."""
    padded = data.mask.shape[0]
    scores = jax.random.uniform(jax.random.fold_in(shuffle_key, epoch), (padded,))
    order = jnp.argsort(jnp.where(data.mask, scores, 2.0), stable=True)
    return jnp.pad(order, (0, -(-padded // batch_size) * batch_size - padded))


@pytest.mark.parametrize("padded", [1, 7, 200, 256, 300])  # 300: the argsort itself
def test_epoch_order_is_the_stable_argsort_of_the_scores(padded):
    """``epoch_order`` (one packed uint32 sort for M <= 256) equals the stable argsort
    of the uniform scores for every client size, empty and full clients included,
    under vmap; 400 clients of 256 rows also meet a few tied scores on average."""
    from fedjax_fair.core import client as client_lib
    from fedjax_fair.core.types import ClientData
    num = 400
    n = jnp.asarray(np.random.default_rng(padded).integers(0, padded + 1, num), jnp.int32)
    n = n.at[:2].set(jnp.asarray([0, padded], jnp.int32))
    data = ClientData({}, jnp.arange(padded)[None] < n[:, None], n)
    keys = jax.random.split(jax.random.key(padded), num)
    for fn_epoch in (0, 3):
        got = jax.jit(jax.vmap(lambda d, k: client_lib.epoch_order(d, k, fn_epoch, 20)))(
            data, keys)
        want = jax.jit(jax.vmap(lambda d, k: _argsort_epoch_order(d, k, fn_epoch, 20)))(
            data, keys)
        np.testing.assert_array_equal(got, want)


def test_epoch_order_breaks_tied_scores_by_row(monkeypatch):
    """Tied scores keep their rows in order (a stable sort), in the packed sort too."""
    from fedjax_fair.core import client as client_lib
    from fedjax_fair.core.types import ClientData
    tied = lambda key, shape: (jnp.arange(shape[0]) * 7 % 5).astype(jnp.float32) / 8
    monkeypatch.setattr(jax.random, "uniform", tied)
    for padded, n in ((12, 9), (256, 200), (300, 250)):
        data = ClientData({}, jnp.arange(padded) < n, jnp.int32(n))
        got = client_lib.epoch_order(data, jax.random.key(0), 0, 4)
        want = _argsort_epoch_order(data, jax.random.key(0), 0, 4)
        np.testing.assert_array_equal(got, want)
        assert sorted(np.asarray(got[:n]).tolist()) == list(range(n))


@pytest.mark.parametrize("image", [False, True], ids=["rows", "image_rows"])
def test_batches_gathered_before_the_loop_give_the_same_round(image, monkeypatch):
    """A lone client whose batches fit in its rows gathers them before its step loop
    (``client.PREGATHER``), from a [M, -1] view of image-shaped examples: the round
    (parameters, metrics, train losses) and its gradient in the client learning rate
    equal the in-loop gather's exactly, with step budgets and an empty client."""
    from fedjax_fair.core import client as client_lib
    train = TRAIN
    if image:  # [N, M, d] -> [N, M, 2, d / 2, 1]: the model flattens its input
        x = train.examples["x"]
        train = train._replace(examples={**train.examples, "x": x.reshape(
            *x.shape[:2], 2, x.shape[-1] // 2, 1)})
    cohort = helpers.cohort(train, IDS, budgets=[3, 2, 0, 1, 3, 3])

    def run(lr):
        alg = _seq(fedavg(MODEL, training=ClientTraining(lr=lr, batch_size=2, num_epochs=2,
                                                         max_steps=3)))
        state, metrics = alg.apply(alg.init(PARAMS, N), cohort, KEY)
        return state.params, metrics

    def loss_after(lr):
        params, _ = run(lr)
        return sum(jnp.sum(jnp.square(v)) for v in jax.tree.leaves(params))

    assert 3 * 2 <= train.mask.shape[1]  # the batches fit: the pregathered path runs
    fast = jax.jit(run)(jnp.float32(LR)), jax.grad(loss_after)(jnp.float32(LR))
    monkeypatch.setattr(client_lib, "PREGATHER", False)
    plain = jax.jit(run)(jnp.float32(LR)), jax.grad(loss_after)(jnp.float32(LR))
    chex.assert_trees_all_equal(fast, plain)
