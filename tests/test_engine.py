"""Engine tests: local training, execution strategies, rounds, the driver,
samplers, checkpoints (docs/architecture.md).

The federation is helpers.tiny_federation(): 6 clients, 10 features, 3 classes,
train sizes (7, 12, 0, 3, 9, 5) padded to M = 12, client 2 empty.
"""
from __future__ import annotations

import functools
import math
import os
import shutil
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from fedjax_fair.drivers import checkpoint as ckpt
from fedjax_fair.core import client as client_lib
from fedjax_fair.core import execution, sampling
from fedjax_fair.core.algorithm import FederatedAlgorithm, ServerState
from fedjax_fair.algorithms import ALGORITHMS, REGISTRY, fedavg
from fedjax_fair.core.client import (batch_at, local_training, masked_mean, max_local_steps,
                                     steps_per_epoch)
from fedjax_fair.core.execution import Execution
from fedjax_fair.drivers.runner import NonFiniteError, run
from fedjax_fair.drivers.simulate import make_cohort, simulate
from fedjax_fair.core.types import ClientData

MODEL = helpers.logreg()
PARAMS = helpers.init_params(MODEL, 0)
DATA = helpers.tiny_federation()
TRAIN = DATA.train
N = DATA.num_clients
SIZES = np.asarray(helpers.TRAIN_SIZES)
LR, B, E = 0.5, 4, 2
UNLIMITED = 2 ** 30
KEY = jax.random.key(42)
# A scrambled full cohort, so slot order != client id order.
IDS = (3, 0, 5, 2, 1, 4)


def _steps(n, b=B, e=E):
    return e * math.ceil(n / b)


def _fedavg(execution="vmap", chunk_size=None, **kwargs):
    kw = dict(client_lr=LR, batch_size=B, num_epochs=E)
    kw.update(kwargs)
    return helpers.bind_execution(fedavg(MODEL, **kw), Execution(execution, chunk_size))


def _one_round(alg, cohort, key=KEY, params=PARAMS):
    return jax.jit(alg.apply)(alg.init(params, N), cohort, key)


# XLA:CPU compiles dominate the run time of this file, so the jitted functions that
# several tests can share (same shapes, new values) are built once.


@functools.cache
def _vmap_apply():
    """The jitted vmapped FedAvg round, shared by every test using 6-client cohorts of
    the M = 12 federation: new values, same shapes, so it must trace exactly once."""
    alg = _fedavg()
    return alg, jax.jit(chex.assert_max_traces(alg.apply, n=1))


def _vmap_apply_on(cohort, key=KEY):
    alg, apply = _vmap_apply()
    return apply(alg.init(PARAMS, N), cohort, key)


@functools.cache
def _vmap_round():
    """FedAvg round over the scrambled full cohort, vmapped."""
    return _vmap_apply_on(helpers.cohort(TRAIN, IDS))


@functools.cache
def _single_client(**kwargs):
    kw = dict(batch_size=B, num_epochs=E)
    kw.update(kwargs)
    return jax.jit(helpers.with_params(local_training(MODEL, optimizer=optax.sgd(LR), **kw)))


# --------------------------------------------------------------------------------------
# Execution strategies: vmap == Python loop == chunked == sequential.


def test_vmap_round_equals_python_loop_over_single_client_updates():
    state, metrics = _vmap_round()
    client_update = _single_client()
    deltas, losses, steps = [], [], []
    for cid in IDS:
        out, cs = client_update(PARAMS, (), helpers.client(TRAIN, cid), jnp.int32(UNLIMITED),
                                jax.random.fold_in(KEY, cid))
        assert cs == ()
        deltas.append(out.delta)
        losses.append(float(out.loss_before))
        steps.append(int(out.num_steps))
    n = SIZES[list(IDS)].astype(np.float64)
    p = n / n.sum()
    expected = jax.tree.map(
        lambda w, *d: np.asarray(w, np.float64) - sum(pk * np.asarray(dk, np.float64)
                                                      for pk, dk in zip(p, d)),
        PARAMS, *deltas)
    helpers.assert_trees_close(state.params, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["weights"], p, rtol=1e-6)
    np.testing.assert_allclose(metrics["loss_before"], losses, rtol=1e-6)
    np.testing.assert_array_equal(metrics["num_steps"], steps)
    np.testing.assert_array_equal(metrics["num_steps"], [_steps(SIZES[c]) for c in IDS])
    np.testing.assert_array_equal(metrics["client_ids"], IDS)
    assert int(state.round) == 1


@functools.cache
def _strategy_round(strategy, chunk_size=None):
    return _one_round(_fedavg(execution=strategy, chunk_size=chunk_size),
                      helpers.cohort(TRAIN, IDS))


@pytest.mark.parametrize("strategy,chunk_size", [
    ("chunked", 2),  # divides K = 6
    ("chunked", 4),  # does not divide K = 6
    ("sequential", None),
    ("bucketed", 4),  # sorted by size, a partial last bucket
])
def test_strategies_equal_vmap(strategy, chunk_size):
    ref_state, ref_metrics = _vmap_round()
    state, metrics = _strategy_round(strategy, chunk_size)
    helpers.assert_trees_close(state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    for name in ("weights", "loss_before", "train_loss", "update_norm"):
        np.testing.assert_allclose(metrics[name], ref_metrics[name], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(metrics["num_steps"], ref_metrics["num_steps"])


def test_map_clients_chunked_matches_vmap_on_a_plain_function():
    fn = lambda shared, xs: (shared * xs[0] + xs[1], xs[1].sum())
    xs = (jnp.arange(7.0), jnp.arange(14.0).reshape(7, 2))
    ref = execution.map_clients(fn, "vmap", 7)(jnp.float32(2.0), xs)
    for strategy, c in (("chunked", 3), ("chunked", 7), ("sequential", None),
                        ("bucketed", 3), ("bucketed", None)):
        out = jax.jit(execution.map_clients(fn, Execution(strategy, c), 7))(jnp.float32(2.0), xs)
        chex.assert_trees_all_close(out, ref)
    # Buckets sort the clients by size; the outputs come back in cohort order.
    sizes = jnp.array([5, 1, 4, 1, 9, 2, 6])
    out = jax.jit(execution.map_clients(fn, Execution("bucketed", 2), 7))(jnp.float32(2.0), xs, sizes)
    chex.assert_trees_all_close(out, ref)


SUM = execution.Reduction(
    fold=lambda batch: jax.tree.map(lambda v: jnp.sum(v, axis=0), batch),
    empty=lambda shapes: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))


@pytest.mark.parametrize("strategy,chunk_size", [
    ("vmap", None), ("chunked", 3), ("chunked", 7), ("sequential", None),
    ("bucketed", 2), ("bucketed", None)])
def test_map_clients_folds_a_reduction_as_the_clients_finish(strategy, chunk_size):
    # fn returns (stacked output, part to fold): the fold over every strategy equals
    # the sum of the stacked parts, and the stacked outputs keep cohort order
    fn = lambda shared, xs: (shared * xs[0], {"v": xs[1] * shared, "n": xs[0]})
    xs = (jnp.arange(7.0), jnp.arange(14.0).reshape(7, 2))
    sizes = jnp.array([5, 1, 4, 1, 9, 2, 6])
    out, total = jax.jit(execution.map_clients(fn, Execution(strategy, chunk_size), 7,
                                               reduce=SUM))(jnp.float32(2.0), xs, sizes)
    np.testing.assert_allclose(out, 2.0 * np.arange(7.0))
    np.testing.assert_allclose(total["v"], 2.0 * np.arange(14.0).reshape(7, 2).sum(0))
    np.testing.assert_allclose(total["n"], np.arange(7.0).sum())


def _count_steps(strategy, counts, chunk_size=None):
    """Steps each client takes through client.skip_past, and the traced program."""
    def fn(shared, count):
        def body(c, t):
            return client_lib.skip_past(count, lambda c, t: c + 1, c, t), None
        return jax.lax.scan(body, shared, jnp.arange(10))[0]
    mapped = execution.map_clients(fn, Execution(strategy, chunk_size), len(counts))
    counts = jnp.asarray(counts)
    return (jax.jit(mapped)(jnp.int32(0), counts, counts),
            str(jax.make_jaxpr(mapped)(jnp.int32(0), counts, counts)))


@pytest.mark.parametrize("strategy,chunk_size", [("vmap", None), ("chunked", 2),
                                                 ("bucketed", 2), ("sequential", None)])
def test_skip_past_takes_each_clients_steps(strategy, chunk_size):
    steps, _ = _count_steps(strategy, [3, 0, 7, 2, 10], chunk_size)
    np.testing.assert_array_equal(steps, [3, 0, 7, 2, 10])


def test_skip_past_under_client_vmap_branches_on_the_group_max():
    # The predicate is the group's pmax (unbatched), so the step is a real cond that
    # XLA skips past the busiest client, not a select computing all 10 steps.
    _, jaxpr = _count_steps("vmap", [3, 1, 2])
    assert "pmax" in jaxpr and "cond[" in jaxpr
    # A plain user vmap (no named client axis) still gives the right counts.
    def fn(count):
        return jax.lax.scan(lambda c, t: (client_lib.skip_past(count, lambda c, t: c + 1, c, t),
                                          None), jnp.int32(0), jnp.arange(10))[0]
    np.testing.assert_array_equal(jax.vmap(fn)(jnp.array([3, 1, 2])), [3, 1, 2])


# --------------------------------------------------------------------------------------
# Invariances.


def test_padding_invariance():
    # Sequential execution (cheaper to compile); test_strategies_equal_vmap ties it
    # to vmap.
    ref_state, ref_metrics = _strategy_round("sequential")
    padded = helpers.repad(TRAIN, 19)  # not a multiple of B; the scan grows 6 -> 10 steps
    assert max_local_steps(19, B, E) > max_local_steps(12, B, E)
    state, metrics = _one_round(_fedavg(execution="sequential"), helpers.cohort(padded, IDS))
    helpers.assert_trees_close(state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(metrics["num_steps"], ref_metrics["num_steps"])
    np.testing.assert_allclose(metrics["loss_before"], ref_metrics["loss_before"], rtol=1e-6)


def test_cohort_order_invariance():
    ref_state, ref_metrics = _vmap_round()
    perm = np.array([4, 2, 0, 5, 1, 3])
    ids = np.asarray(IDS)[perm]
    state, metrics = _vmap_apply_on(helpers.cohort(TRAIN, ids))
    helpers.assert_trees_close(state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    for name in ("weights", "loss_before", "num_steps"):
        np.testing.assert_allclose(metrics[name], np.asarray(ref_metrics[name])[perm],
                                   rtol=1e-6)


# --------------------------------------------------------------------------------------
# Empty clients and step budgets.


def test_empty_client_update_is_zero_and_finite():
    empty = helpers.client(TRAIN, helpers.EMPTY_CLIENT)
    assert int(empty.num_examples) == 0
    out, _ = _single_client()(PARAMS, (), empty, jnp.int32(UNLIMITED), KEY)
    for leaf in jax.tree.leaves(out.delta):
        np.testing.assert_array_equal(leaf, np.zeros_like(leaf))
    assert float(out.loss_before) == 0.0
    assert int(out.num_steps) == 0
    assert int(out.num_examples) == 0
    assert helpers.tree_all_finite(out)


def test_round_of_only_the_empty_client_keeps_params():
    # Six copies of the empty client (same shapes as the shared cohort).
    state, metrics = _vmap_apply_on(helpers.cohort(TRAIN, [helpers.EMPTY_CLIENT] * N))
    chex.assert_trees_all_equal(state.params, PARAMS)
    # a cohort without training rows has no training loss: NaN (null in the logs), not 0
    assert np.isnan(float(metrics["train_loss"]))
    assert helpers.tree_all_finite({k: v for k, v in metrics.items() if k != "train_loss"})


def test_empty_client_gets_zero_weight_in_a_round():
    _, metrics = _vmap_round()
    slot = IDS.index(helpers.EMPTY_CLIENT)
    assert float(metrics["weights"][slot]) == 0.0
    assert float(metrics["loss_before"][slot]) == 0.0
    assert helpers.tree_all_finite(metrics)


def test_round_step_budgets_cap_num_steps():
    budgets = np.array([1, 3, 5, 0, 100, 2], np.int32)  # indexed by client id
    table = jnp.asarray(budgets)
    ids = jnp.arange(N, dtype=jnp.int32)
    cohort = make_cohort(DATA, ids, table)
    np.testing.assert_array_equal(cohort.local_steps, budgets)
    _, metrics = _vmap_apply_on(cohort)
    expected = [min(int(b), _steps(n)) for b, n in zip(budgets, SIZES)]
    assert expected == [1, 3, 0, 0, 6, 2]
    np.testing.assert_array_equal(metrics["num_steps"], expected)


CAP = 3  # static max_steps of the full-batch client below
FULL_EPOCHS = 5


def _full_batch_client():
    """A full-batch client (B = 12 >= n): every step sees all real rows, so k steps
    are k steps of plain gradient descent on F_k whatever the shuffling; 5 epochs,
    statically capped at 3 steps."""
    return _single_client(batch_size=12, num_epochs=FULL_EPOCHS, max_steps=CAP)


@pytest.mark.parametrize("cid,budget", [(1, 2), (0, 1), (4, 10), (3, UNLIMITED)])
def test_step_budget_equals_hand_gradient_descent(cid, budget):
    """b budgeted steps = min(b, E ceil(n/B), cap) steps of gradient descent, checked
    against a NumPy float64 reference."""
    out, _ = _full_batch_client()(PARAMS, (), helpers.client(TRAIN, cid), jnp.int32(budget),
                                  jax.random.fold_in(KEY, cid))
    taken = min(budget, FULL_EPOCHS, CAP)
    x, y = helpers.real_rows(TRAIN, [cid])
    w, b = helpers.logreg_gd_numpy(PARAMS, x, y, LR, taken)
    w0, b0 = helpers.logreg_to_numpy(PARAMS)
    dw, db = helpers.logreg_to_numpy(out.delta)
    np.testing.assert_allclose(dw, w0 - w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(db, b0 - b, rtol=1e-5, atol=1e-6)
    if budget < CAP:
        assert int(out.num_steps) == taken


@pytest.mark.parametrize("cid", [0, 1, 4])
def test_static_cap_reports_the_steps_actually_taken(cid):
    """ClientOutput.num_steps is "local steps actually taken": with a static cap
    ``max_steps`` the scan runs at most that many steps (the delta above is 3 GD
    steps), so num_steps must be capped too, not min(budget, E ceil(n/B)) = 5."""
    out, _ = _full_batch_client()(PARAMS, (), helpers.client(TRAIN, cid),
                                  jnp.int32(UNLIMITED), jax.random.fold_in(KEY, cid))
    assert int(out.num_steps) == min(CAP, FULL_EPOCHS)


def _logreg_loss_numpy(w, b, x, y):
    logits = np.asarray(x, np.float64) @ w + b
    logits -= logits.max(-1, keepdims=True)
    return float(np.mean(np.log(np.exp(logits).sum(-1)) - logits[np.arange(len(y)), y]))


@pytest.mark.parametrize("cid,budget", [(1, 2), (0, 1), (4, 10)])
def test_train_loss_is_the_last_epochs_mean_loss(cid, budget):
    """Full-batch epochs: the last epoch is the last step, taken at the iterate after
    taken - 1 gradient-descent steps; train_loss is its mean loss over the rows."""
    out, _ = _full_batch_client()(PARAMS, (), helpers.client(TRAIN, cid), jnp.int32(budget),
                                  jax.random.fold_in(KEY, cid))
    taken = min(budget, FULL_EPOCHS, CAP)
    x, y = helpers.real_rows(TRAIN, [cid])
    w, b = helpers.logreg_gd_numpy(PARAMS, x, y, LR, taken - 1)
    np.testing.assert_allclose(float(out.train_loss), _logreg_loss_numpy(w, b, x, y),
                               rtol=1e-5)


def test_train_loss_averages_every_batch_of_the_last_epoch():
    # Client 1 has 12 rows, B = 4: 3 batches per epoch, E = 2 -> steps 3, 4, 5 form the
    # last epoch and their 12 per-example losses are averaged (one budget cut: 4 steps
    # -> the last epoch is the single step 3, 4 rows).
    client = _single_client()
    full, _ = client(PARAMS, (), helpers.client(TRAIN, 1), jnp.int32(UNLIMITED), KEY)
    cut, _ = client(PARAMS, (), helpers.client(TRAIN, 1), jnp.int32(4), KEY)
    assert int(full.num_steps) == 6 and int(cut.num_steps) == 4
    assert 0 < float(full.train_loss) < float(full.loss_before)
    assert float(cut.train_loss) > 0
    empty, _ = client(PARAMS, (), helpers.client(TRAIN, helpers.EMPTY_CLIENT),
                      jnp.int32(UNLIMITED), KEY)
    assert float(empty.train_loss) == 0.0


def test_zero_budget_gives_zero_delta():
    out, _ = _single_client()(PARAMS, (), helpers.client(TRAIN, 1), jnp.int32(0), KEY)
    assert int(out.num_steps) == 0
    for leaf in jax.tree.leaves(out.delta):
        np.testing.assert_array_equal(leaf, np.zeros_like(leaf))
    assert float(out.loss_before) > 0.0  # the server model's loss is still measured


# --------------------------------------------------------------------------------------
# Tracing, carry shapes, determinism.


def test_apply_traces_once_for_new_values_of_same_shapes():
    alg, apply = _vmap_apply()  # wrapped in chex.assert_max_traces(n=1)
    _vmap_round()
    state = alg.init(PARAMS, N)
    for seed in range(1, 4):
        data = helpers.tiny_federation(seed=seed)
        ids = np.random.default_rng(seed).permutation(N)
        budgets = np.random.default_rng(seed).integers(0, 8, N)
        state, metrics = apply(state, helpers.cohort(data.train, ids, budgets),
                               jax.random.key(seed))
    assert int(state.round) == 3
    assert helpers.tree_all_finite(state.params)


@functools.cache
def _simulate_fn():
    """A jitted 3-round simulate of FedAvg, wrapped in chex.assert_max_traces(n=1)."""
    alg = _fedavg(execution="sequential")

    def run_sim(state, data, key):
        return simulate(alg, state, data, key, num_rounds=3, cohort_size=3)

    return alg, jax.jit(chex.assert_max_traces(run_sim, n=1))


def test_simulate_traces_once_for_new_values_of_same_shapes():
    alg, run_sim = _simulate_fn()
    state = alg.init(PARAMS, N)
    for seed in range(2):
        state, metrics = run_sim(state, helpers.tiny_federation(seed=seed), jax.random.key(seed))
    assert int(state.round) == 6
    assert bool(np.all(metrics["finite"]))


def _shape_structs(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype),
                                   bool(getattr(x, "weak_type", False))), tree)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_round_carry_shape_stability(name):
    # LG-FedAvg refuses to share the one layer of logistic regression (it would be
    # FedAvg): here it keeps that layer local.
    extra = {"shared_layers": ()} if name == "lg_fedavg" else {}
    alg = helpers.bind_execution(ALGORITHMS[name](MODEL, batch_size=B, num_epochs=E, **extra),
                                 "vmap")
    state = alg.init(PARAMS, N)
    # Full-participation rules (AAggFF-S) see every client; the others a cohort of 3.
    k = N if REGISTRY[name].participation == "full" else 3
    ids = list(range(N)) if k == N else [0, 1, 3]
    cohort = helpers.cohort(TRAIN, ids)
    new_state, metrics = jax.eval_shape(alg.apply, state, cohort, KEY)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    assert _shape_structs(new_state) == _shape_structs(jax.eval_shape(lambda s: s, state))
    for name_, value in metrics.items():
        assert value.shape in ((), (k,)), name_

    # simulate scans the round: it would fail to trace if the carry changed.
    rounds = 5
    _, sim_metrics = jax.eval_shape(
        lambda s, d, key: simulate(alg, s, d, key, num_rounds=rounds, cohort_size=k),
        state, DATA, KEY)
    for name_, value in sim_metrics.items():
        assert value.shape[0] == rounds, name_
    assert sim_metrics["client_ids"].shape == (rounds, k)


def test_simulate_determinism():
    alg, run_sim = _simulate_fn()
    state = alg.init(PARAMS, N)
    a, ma = run_sim(state, DATA, jax.random.key(7))
    b, mb = run_sim(state, DATA, jax.random.key(7))
    chex.assert_trees_all_equal(a, b)
    chex.assert_trees_all_equal(ma, mb)
    c, _ = run_sim(state, DATA, jax.random.key(8))
    assert any(not np.array_equal(x, y) for x, y in
               zip(jax.tree.leaves(a.params), jax.tree.leaves(c.params)))
    np.testing.assert_array_equal(ma["client_ids"].shape, (3, 3))


# --------------------------------------------------------------------------------------
# runner.run: evaluation, compilation, resume, non-finite stop.


def _counting(alg):
    """The same algorithm, counting how often its round function is traced."""
    count = [0]

    def apply(state, cohort, key, execution="auto"):
        count[0] += 1
        return alg.apply(state, cohort, key, execution)

    return FederatedAlgorithm(alg.init, apply), count


def _seq_fedavg():
    return _fedavg(execution="sequential")  # cheaper to compile than vmap


def _run(alg, **kwargs):
    kw = dict(model=MODEL, num_rounds=5, cohort_size=3, eval_every=2, progress=False)
    kw.update(kwargs)
    data = kw.pop("data", DATA)
    return run(alg, PARAMS, data, jax.random.key(5), **kw)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """An uninterrupted 5-round run in chunks of 2, 2, 1 with checkpoints.

    Returns (result, number of traces of the round function, a copy of the round-4
    checkpoint). The copy is taken from the ``on_eval`` callback, whichever of the
    callback and the save comes first.
    """
    alg, count = _counting(_seq_fedavg())
    directory = str(tmp_path_factory.mktemp("reference") / "ckpt")
    snapshot = str(tmp_path_factory.mktemp("snapshot") / "ckpt")
    template = alg.init(PARAMS, N)

    def on_eval(entry):
        if ckpt.exists(directory):
            restored, _ = ckpt.restore(directory, template)
            if int(restored.round) == 4 and not os.path.exists(snapshot):
                shutil.copytree(directory, snapshot)

    result = _run(alg, checkpoint_dir=directory, on_eval=on_eval)
    return result, count[0], snapshot


def test_run_evaluates_all_clients_and_logs_history(reference_run):
    result, _, _ = reference_run
    assert int(result.state.round) == 5
    for name, values in result.client_metrics.items():
        assert np.asarray(values).shape == (N,), name
    np.testing.assert_array_equal(result.client_metrics["num_examples"], helpers.TEST_SIZES)
    assert [h["round"] for h in result.history] == [0, 2, 4, 5]
    assert result.round_metrics["train_loss"].shape == (5,)
    assert result.round_metrics["update_norm"].shape == (5,)

    # Per-client accuracy against NumPy on the final parameters.
    p = result.state.params["params"]["Dense_0"]
    w, b = np.asarray(p["kernel"], np.float64), np.asarray(p["bias"], np.float64)
    for k in range(N):
        n = helpers.TEST_SIZES[k]
        x = np.asarray(DATA.test.examples["x"][k, :n], np.float64)
        y = np.asarray(DATA.test.examples["y"][k, :n])
        expected = float(np.mean(np.argmax(x @ w + b, -1) == y)) if n else 0.0
        np.testing.assert_allclose(result.client_metrics["accuracy"][k], expected, atol=1e-6)
        if n:  # each client's calibration errors over its own test rows
            from fedjax_fair.metrics import calibration_errors
            ece, mce = calibration_errors(x @ w + b, y)
            np.testing.assert_allclose(
                [result.client_metrics["ece"][k], result.client_metrics["mce"][k]],
                [float(ece), float(mce)], atol=1e-5)
    assert np.all(np.isfinite(result.client_metrics["loss"]))
    has = np.asarray(helpers.TEST_SIZES) > 0
    np.testing.assert_allclose(result.history[-1]["ece"],
                               np.mean(result.client_metrics["ece"][has]), rtol=1e-6)


def test_run_compiles_once_per_chunk_length(reference_run):
    result, traces, _ = reference_run
    assert traces == 2  # chunk lengths 2 and 1; the second chunk of 2 reuses the first
    assert result.compile_seconds > 0.0 and result.run_seconds > 0.0


def _union(spans):
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if b > end:
            total, end = total + b - max(a, end), b
    return total


def test_compile_seconds_counts_every_compile_of_the_run():
    """``compile_seconds`` covers every XLA compile during ``run`` (the chunk programs,
    the evaluator of a model not evaluated before, one-off ops), as jax reports them,
    and no more than the run's wall clock."""
    import time
    from fedjax_fair.drivers.runner import CompileClock
    spans = []

    def listener(event, start, end, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            spans.append((start, end))

    model = helpers.logreg()  # a fresh model: its evaluator compiles in this run
    alg = fedavg(model, client_lr=0.1, batch_size=4, num_epochs=1)
    jax.monitoring.register_event_time_span_listener(listener)
    try:
        t0 = time.time()
        result = run(alg, PARAMS, DATA, jax.random.key(3), model=model, num_rounds=3,
                     cohort_size=3, eval_every=2, progress=False)
        t1 = time.time()
    finally:
        jax.monitoring.unregister_event_time_span_listener(listener)
    # (a persistent compilation cache, which the command line turns on, may serve
    # some programs without a backend compile: then they have no span to count)
    assert result.compile_seconds > 0.0
    assert result.compile_seconds >= _union(spans) - 1e-6
    assert result.compile_seconds <= t1 - t0
    # the clock merges nested and concurrent spans: it counts no second twice
    clock = CompileClock()
    for a, b in ((0.0, 2.0), (1.0, 3.0), (0.5, 1.0), (5.0, 6.0)):
        clock.add(a, b)
    assert clock.seconds == pytest.approx(4.0)


def test_a_second_run_of_the_same_algorithm_reuses_its_programs():
    """Runs of one algorithm object on data of the same shapes (a compare's seeds)
    compile each chunk program once per process; another seed still gives its own
    result."""
    alg, count = _counting(_seq_fedavg())
    first = _run(alg, num_rounds=2, eval_every=2)
    traced = count[0]
    second = run(alg, PARAMS, DATA, jax.random.key(6), model=MODEL, num_rounds=2,
                 cohort_size=3, eval_every=2, progress=False)
    assert count[0] == traced  # no new trace, no new compile
    assert second.compile_seconds < first.compile_seconds
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first.state.params),
                                                        jax.tree.leaves(second.state.params)))


def test_run_resume_is_bitwise_identical(reference_run):
    full, _, snapshot = reference_run
    assert ckpt.exists(snapshot), "no round-4 checkpoint was written"
    alg, count = _counting(_seq_fedavg())
    resumed = _run(alg, checkpoint_dir=snapshot, resume=True)
    assert count[0] == 1  # only the last chunk (1 round) ran
    chex.assert_trees_all_equal(resumed.state, full.state)
    assert [h["round"] for h in resumed.history] == [0, 2, 4, 5]
    np.testing.assert_array_equal(resumed.round_metrics["train_loss"],
                                  full.round_metrics["train_loss"])
    for a, b in zip(resumed.history, full.history):
        assert a["accuracy_mean"] == b["accuracy_mean"]
    for name in full.client_metrics:
        np.testing.assert_array_equal(resumed.client_metrics[name], full.client_metrics[name])


def test_run_resume_without_checkpoint_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        _run(_seq_fedavg(), checkpoint_dir=str(tmp_path / "none"), resume=True)


# ---- bad arguments and damaged checkpoints: refused before compute, nothing written


@pytest.fixture
def no_compile(monkeypatch):
    """Compiling a program (how the runner compiles its chunk programs) fails the test:
    a refused input must be refused before compute. The runner's program cache starts
    empty, so a program compiled by an earlier test is not reused either."""
    from fedjax_fair.drivers import runner

    def refuse(*args, **kwargs):
        raise AssertionError("the input reached compilation")

    monkeypatch.setattr(jax.stages.Lowered, "compile", refuse)
    monkeypatch.setattr(runner, "_PROGRAMS", runner._ProgramCache())


@pytest.mark.parametrize("field,value,error", [
    ("cohort_size", 0, ValueError), ("cohort_size", -1, ValueError),
    ("cohort_size", N + 1, ValueError), ("cohort_size", 2.5, TypeError),
    ("cohort_size", True, TypeError), ("cohort_size", "3", TypeError),
    ("num_rounds", 0, ValueError), ("num_rounds", 2.0, TypeError),
    ("eval_every", 0, ValueError), ("eval_every", -2, ValueError),
    ("eval_every", None, TypeError),
    ("key", 0, TypeError), ("key", "seed", TypeError),
    ("key", jax.random.split(jax.random.key(0)), ValueError),  # a batch of keys
    ("key", np.zeros(2, np.int32), TypeError),  # raw key data of the wrong dtype
    ("key", np.zeros(3, np.uint32), TypeError),  # ... or the wrong shape
    ("step_budgets", "fixed:2", TypeError), ("step_budgets", 3, TypeError),
    ("step_budgets", np.full(N, 2.0), TypeError), ("step_budgets", np.ones(N, bool), TypeError),
    ("step_budgets", np.ones(N + 1, np.int32), ValueError),
    ("step_budgets", np.array([1, 2, -1, 0, 3, 4]), ValueError)])
def test_run_refuses_bad_arguments_before_compute(tmp_path, no_compile, field, value, error):
    directory = tmp_path / "ckpt"
    kw = dict(model=MODEL, num_rounds=2, cohort_size=3, eval_every=1, progress=False,
              checkpoint_dir=str(directory))
    key = jax.random.key(0)
    if field == "key":
        key = value
    else:
        kw[field] = value
    with pytest.raises(error, match=f"^{field}: "):
        run(_seq_fedavg(), PARAMS, DATA, key, **kw)
    assert not directory.exists()


def test_run_refuses_a_federation_without_test_data(no_compile):
    data = DATA._replace(test=DATA.test._replace(
        mask=np.zeros_like(DATA.test.mask), num_examples=np.zeros_like(DATA.test.num_examples)))
    with pytest.raises(ValueError, match="^data: "):
        run(_seq_fedavg(), PARAMS, data, KEY, model=MODEL, num_rounds=1, cohort_size=3,
            progress=False)


def test_run_skips_a_validation_split_without_examples():
    """A validation block in which no client has a row (even of padded size 0, which
    the model cannot take) is not evaluated: no ``validation_`` keys."""
    from fedjax_fair.data import federated as fd
    empty = jax.tree.map(np.asarray, fd.stack_clients([np.zeros((0, 10), np.float32)] * N,
                                                      [np.zeros(0, np.int32)] * N))
    assert empty.mask.shape == (N, 0)
    result = _run(_seq_fedavg(), num_rounds=1, eval_every=1,
                  data=DATA._replace(validation=empty))
    assert not any(k.startswith("validation_") for h in result.history for k in h)
    assert "accuracy_mean" in result.history[-1]


def test_run_takes_legacy_uint32_keys_and_budget_tables_as_lists():
    """A legacy ``jax.random.PRNGKey(seed)`` (raw uint32 data, also as a NumPy array)
    is the same key as ``jax.random.key(seed)``: the same run, bit for bit. A budget
    table may be a list of ints."""
    alg = _seq_fedavg()
    kw = dict(model=MODEL, num_rounds=2, cohort_size=3, eval_every=2, progress=False)
    typed = run(alg, PARAMS, DATA, jax.random.key(5), **kw)
    for legacy in (jax.random.PRNGKey(5), np.asarray(jax.random.PRNGKey(5))):
        chex.assert_trees_all_equal(run(alg, PARAMS, DATA, legacy, **kw).state, typed.state)
    budgets = [1, 2, 0, 1, 3, 2]
    listed = run(alg, PARAMS, DATA, jax.random.key(5), step_budgets=budgets, **kw)
    table = run(alg, PARAMS, DATA, jax.random.key(5), step_budgets=np.asarray(budgets), **kw)
    chex.assert_trees_all_equal(listed.state, table.state)


def _garbage(path):
    path.write_bytes(b"not a checkpoint file")


def _cut_in_half(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _other_arrays(path):
    with open(path, "wb") as f:
        np.savez(f, something=np.zeros(3, np.float32))


def _npy_not_npz(path):
    with open(path, "wb") as f:
        np.save(f, np.zeros(3, np.float32))


def _newest_file(directory, name) -> Path:
    """The newest committed save's file ``name``, or its log ``name``'s newest segment
    (the one that save wrote)."""
    path = Path(ckpt.latest(str(directory))) / name
    return max(path.iterdir()) if path.is_dir() else path


@pytest.mark.parametrize("name,damage", [
    ("state.npz", _garbage), ("state.npz", _cut_in_half), ("state.npz", _other_arrays),
    ("state.npz", _npy_not_npz),
    ("meta.json", _garbage), ("meta.json", lambda p: p.write_text("[]")),
    ("meta.json", lambda p: p.write_text('{"history": []}')),
    ("meta.json", lambda p: p.write_text('{"history": [{"accuracy_mean": 0.5}]}')),
    ("meta.json", lambda p: p.write_bytes(b"\xff\xfe{")),
    ("client_history", _garbage), ("client_history", _cut_in_half),
    ("client_history", _other_arrays)], ids=lambda v: getattr(v, "__name__", v))
def test_resume_from_a_damaged_checkpoint_names_the_file(reference_run, tmp_path,
                                                         no_compile, name, damage):
    """run(resume=True) on a damaged checkpoint: ``ValueError("checkpoint: ...")``
    naming the file, raised before anything is compiled or written."""
    directory = tmp_path / "ckpt"
    shutil.copytree(reference_run[2], directory)
    damage(_newest_file(directory, name))
    before = {str(p): p.read_bytes() for p in directory.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="^checkpoint: ") as info:
        _run(_seq_fedavg(), checkpoint_dir=str(directory), resume=True)
    assert name in str(info.value)
    assert len(str(info.value).splitlines()) == 1
    assert {str(p): p.read_bytes() for p in directory.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("name,damage", [
    ("state.npz", _garbage), ("state.npz", _cut_in_half), ("state.npz", _npy_not_npz),
    ("meta.json", _garbage), ("meta.json", lambda p: p.write_text("[1, 2]")),
    ("client_history", _garbage), ("client_history", _cut_in_half)],
    ids=lambda v: getattr(v, "__name__", v))
def test_checkpoint_readers_name_the_damaged_file(reference_run, tmp_path, name, damage):
    """verify (headers only), restore, read_meta and load_arrays raise
    ``ValueError("checkpoint: ...")`` naming the file, not numpy / zipfile / json
    errors; exists only says whether the files are there."""
    directory = tmp_path / "ckpt"
    shutil.copytree(reference_run[2], directory)
    template = _seq_fedavg().init(PARAMS, N)
    ckpt.verify(str(directory), template)  # the intact copy passes
    damage(_newest_file(directory, name))
    assert ckpt.exists(str(directory))
    readers = {"state.npz": [lambda d: ckpt.restore(d, template)],
               "meta.json": [ckpt.read_meta, lambda d: ckpt.restore(d, template)],
               "client_history": [lambda d: ckpt.load_arrays(d, name)]}[name]
    for read in [lambda d: ckpt.verify(d, template), *readers]:
        with pytest.raises(ValueError, match="^checkpoint: ") as info:
            read(str(directory))
        assert name in str(info.value)


def test_checkpoint_without_meta_is_not_found(tmp_path):
    directory = tmp_path / "c"
    ckpt.save(str(directory), {"w": jnp.zeros(2)}, {})
    (Path(ckpt.latest(str(directory))) / "meta.json").unlink()
    assert not ckpt.exists(str(directory))
    with pytest.raises(FileNotFoundError):
        ckpt.read_meta(str(directory))
    with pytest.raises(FileNotFoundError):
        ckpt.verify(str(directory), {"w": jnp.zeros(2)})
    assert ckpt.load_arrays(str(directory), "absent.npz") == {}


def _nan_after(alg, good_rounds):
    """Makes the parameters NaN once more than ``good_rounds`` rounds are done."""

    def apply(state, cohort, key, execution="auto"):
        new, metrics = alg.apply(state, cohort, key, execution)
        bad = new.round > good_rounds
        params = jax.tree.map(lambda p: jnp.where(bad, jnp.nan, p), new.params)
        return new._replace(params=params), metrics

    return FederatedAlgorithm(alg.init, apply)


def test_run_stops_on_nan_at_first_bad_round_and_keeps_last_good_state(tmp_path):
    """Chunks of 2 rounds, NaN from round 4 on: the error names round 4 (inside the
    second chunk, not its start), and the checkpoint keeps round 2, the last state
    known good."""
    directory = str(tmp_path / "ckpt")
    alg = _nan_after(_seq_fedavg(), good_rounds=3)
    with pytest.raises(NonFiniteError) as info:
        _run(alg, num_rounds=6, eval_every=2, checkpoint_dir=directory)
    err = info.value
    assert err.round == 4
    assert err.last_good_round == 2
    assert int(err.last_good_state.round) == 2
    assert helpers.tree_all_finite(err.last_good_state.params)
    restored, meta = ckpt.restore(directory, alg.init(PARAMS, N))
    assert int(restored.round) == 2 < err.round
    assert helpers.tree_all_finite(restored.params)
    chex.assert_trees_all_equal(restored, err.last_good_state)
    assert [h["round"] for h in meta["history"]] == [0, 2]


def test_nan_in_the_server_state_beyond_the_parameters_stops_the_run():
    """A NaN in the aggregator's state (FedEvg's synthetic set, a generator, a
    history) stops the run at its round even while the parameters are still finite;
    integer and key leaves are not checked."""
    inner = _seq_fedavg()

    def init(params, num_clients):
        state = inner.init(params, num_clients)
        return state._replace(aggregator_state=(jnp.zeros((3,)), jnp.zeros((), jnp.int32),
                                                jax.random.key(0)))

    def apply(state, cohort, key, execution="auto"):
        new, metrics = inner.apply(state, cohort, key, execution)
        x, count, k = state.aggregator_state
        x = jnp.where(new.round > 3, jnp.nan, x)
        return new._replace(aggregator_state=(x, count + 1, k)), metrics

    with pytest.raises(NonFiniteError) as info:
        _run(FederatedAlgorithm(init, apply), num_rounds=6, eval_every=2)
    assert info.value.round == 4 and int(info.value.last_good_state.round) == 2
    assert helpers.tree_all_finite(info.value.last_good_state.params)


def test_run_without_checkpoint_keeps_last_good_state_in_memory():
    """Without a checkpoint the chunks are not donated, so the state before the bad
    chunk is still there to hand back."""
    alg = _nan_after(_seq_fedavg(), good_rounds=3)
    with pytest.raises(NonFiniteError) as info:
        _run(alg, num_rounds=6, eval_every=2)
    assert int(info.value.last_good_state.round) == 2
    assert helpers.tree_all_finite(info.value.last_good_state.params)
    with pytest.raises(ValueError, match="donate"):
        _run(_seq_fedavg(), num_rounds=2, donate=True)


def test_donated_chunks_give_the_same_run_and_leave_the_callers_arrays_alone(tmp_path):
    """Donating the state (the default with a checkpoint) changes no result, and the
    caller's initial parameters, which the state starts out sharing, stay usable."""
    plain = _run(_seq_fedavg(), num_rounds=4, eval_every=2, donate=False)
    donated = _run(_seq_fedavg(), num_rounds=4, eval_every=2,
                   checkpoint_dir=str(tmp_path / "ckpt"))
    chex.assert_trees_all_equal(donated.state.params, plain.state.params)
    assert not any(x.is_deleted() for x in jax.tree.leaves(PARAMS))


# --------------------------------------------------------------------------------------
# Samplers.


def test_uniform_sampler_gives_distinct_ids_in_range():
    sampler = jax.jit(sampling.uniform, static_argnums=(1, 2))
    ids = np.stack([sampler(jax.random.key(s), 9, 4) for s in range(32)])
    assert ids.shape == (32, 4) and ids.dtype == np.int32
    assert ids.min() >= 0 and ids.max() < 9
    assert all(len(set(row)) == 4 for row in ids)
    assert len(set(ids.ravel())) == 9  # every client turns up eventually


def test_full_sampler():
    np.testing.assert_array_equal(sampling.full(jax.random.key(0), 5, 5), np.arange(5))
    with pytest.raises(ValueError, match="cohort_size"):
        sampling.full(jax.random.key(0), 5, 3)


def test_weighted_sampler_never_picks_zero_probability_clients():
    sampler = sampling.weighted([0.0, 1.0, 2.0, 0.0, 1.0, 3.0])
    sampler = jax.jit(sampler, static_argnums=(1, 2))
    ids = np.stack([sampler(jax.random.key(s), 6, 3) for s in range(32)])
    assert set(ids.ravel()) <= {1, 2, 4, 5}
    assert all(len(set(row)) == 3 for row in ids)


# --------------------------------------------------------------------------------------
# Checkpoints.


def test_checkpoint_roundtrip_with_typed_key(tmp_path):
    key = jax.random.key(3)
    state = {"w": jnp.arange(6.0).reshape(2, 3), "step": jnp.int32(7),
             "mask": jnp.array([True, False]), "key": key,
             "nested": (jnp.ones((2,), jnp.float16), ())}
    directory = str(tmp_path / "c")
    ckpt.save(directory, state, {"round": 7, "history": [{"round": 0, "mean": 0.5}]})
    assert ckpt.exists(directory)
    template = jax.tree.map(jnp.zeros_like, {k: v for k, v in state.items() if k != "key"})
    template["key"] = jax.random.key(0)
    restored, meta = ckpt.restore(directory, template)
    assert meta == {"round": 7, "history": [{"round": 0, "mean": 0.5}]}
    assert jnp.issubdtype(restored["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(restored["key"]),
                                  jax.random.key_data(key))
    np.testing.assert_array_equal(jax.random.normal(restored["key"], (3,)),
                                  jax.random.normal(key, (3,)))
    for name in ("w", "step", "mask", "nested"):
        chex.assert_trees_all_equal(restored[name], state[name])
        chex.assert_trees_all_equal_dtypes(restored[name], state[name])


def test_checkpoint_verify_reads_shapes_from_headers(tmp_path):
    state = {"w": jnp.arange(6.0).reshape(2, 3), "key": jax.random.key(3),
             "h": jnp.ones((4,), jnp.bfloat16), "n": jnp.int32(2)}
    directory = str(tmp_path / "c")
    ckpt.save(directory, state, {"history": []})
    ckpt.verify(directory, jax.eval_shape(lambda: state))  # abstract template: passes
    ckpt.verify(directory, state)
    for bad in ({**state, "w": jnp.zeros((3, 2))}, {**state, "n": jnp.float32(2)},
                {**state, "extra": jnp.zeros(())}):
        with pytest.raises(ValueError, match="^checkpoint: "):
            ckpt.verify(directory, jax.eval_shape(lambda b=bad: b))


def test_checkpoint_roundtrip_with_bfloat16_leaf(tmp_path):
    """bf16 is the documented memory-aware form of per-client tables (docs/architecture.md),
    so a checkpoint must restore it. NumPy has no bfloat16: np.savez writes such a
    leaf as raw void bytes (|V2), which restore() then rejects as a dtype mismatch."""
    state = {"table": jnp.arange(6.0, dtype=jnp.bfloat16).reshape(3, 2)}
    directory = str(tmp_path / "bf16")
    ckpt.save(directory, state, {})
    restored, _ = ckpt.restore(directory, {"table": jnp.zeros((3, 2), jnp.bfloat16)})
    assert restored["table"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(restored["table"], np.float32),
                                  np.arange(6.0).reshape(3, 2))


def test_checkpoint_roundtrip_of_server_state(tmp_path):
    alg = helpers.bind_execution(ALGORITHMS["fedadam"](MODEL, batch_size=B), "vmap")
    template = alg.init(PARAMS, N)
    # A state with non-trivial values in every leaf (params, adam count / moments).
    state = jax.tree.map(lambda x: x + jnp.ones_like(x), template)
    state = state._replace(params=_vmap_round()[0].params)
    directory = str(tmp_path / "s")
    ckpt.save(directory, state, {})
    restored, _ = ckpt.restore(directory, alg.init(PARAMS, N))
    assert isinstance(restored, ServerState)
    chex.assert_trees_all_equal(restored, state)


def test_checkpoint_mismatched_template_raises(tmp_path):
    directory = str(tmp_path / "c")
    ckpt.save(directory, {"w": jnp.zeros((2, 3)), "b": jnp.zeros((3,))}, {})
    with pytest.raises(ValueError):
        ckpt.restore(directory, {"w": jnp.zeros((3, 2)), "b": jnp.zeros((3,))})
    with pytest.raises(ValueError):
        ckpt.restore(directory, {"w": jnp.zeros((2, 3), jnp.int32), "b": jnp.zeros((3,))})
    with pytest.raises(ValueError):
        ckpt.restore(directory, {"w": jnp.zeros((2, 3))})
    with pytest.raises(FileNotFoundError):
        ckpt.restore(str(tmp_path / "missing"), {"w": jnp.zeros((2, 3))})


# --------------------------------------------------------------------------------------
# execution.resolve.


def test_resolve_rejects_unknown_strategy():
    with pytest.raises(ValueError) as info:
        execution.resolve("pmap", 8)
    for allowed in ("auto", "vmap", "chunked", "sequential"):
        assert allowed in str(info.value)
    assert "pmap" in str(info.value)


def test_resolve_rules():
    assert execution.resolve("auto", 100, backend="gpu") == ("vmap", None)
    assert execution.resolve("auto", 100, backend="tpu") == ("vmap", None)
    # The CPU pick is a measured policy that may change; it must be concrete.
    strategy, chunk = execution.resolve("auto", 100, backend="cpu")
    assert strategy in ("vmap", "chunked", "sequential")
    assert (chunk is not None) == (strategy == "chunked")
    assert execution.resolve("chunked", 10, chunk_size=3) == ("chunked", 3)
    assert execution.resolve("chunked", 10, chunk_size=10) == ("vmap", None)
    assert execution.resolve("sequential", 10) == ("sequential", None)
    assert execution.resolve("vmap", 10) == ("vmap", None)
    with pytest.raises(ValueError):
        execution.resolve("chunked", 10, chunk_size=-2)


def test_auto_mesh_only_for_several_cpu_devices():
    """One device (the test process), accelerators, or a cohort of one: no mesh."""
    assert execution.auto_mesh(100, backend="gpu") is None
    assert execution.auto_mesh(1, backend="cpu") is None
    if len(jax.local_devices(backend="cpu")) == 1:
        assert execution.auto_mesh(100, backend="cpu") is None


_AUTO_MESH_CHECK = """
import jax, jax.numpy as jnp, numpy as np, optax
import helpers
from fedjax_fair.algorithms import fedavg
from fedjax_fair.core import execution
from fedjax_fair.core.execution import Execution
model, data = helpers.logreg(), helpers.tiny_federation()
params = helpers.init_params(model, 0)
cohort = helpers.cohort(data.train, (4, 0, 3, 1, 5))  # 5 clients over 2 devices: padded
assert execution.auto_mesh(5) is not None and execution.auto_mesh(5).devices.size == 2
# a federation to place: only devices that split it evenly (7 clients: none of 2)
assert execution.auto_mesh(5, num_clients=6).devices.size == 2
assert execution.auto_mesh(5, num_clients=7) is None
# local steps that busy one device's cores (execution.SPLIT_MAX_STEP_FLOPS): no split
assert execution.auto_mesh(5, step_flops=execution.SPLIT_MAX_STEP_FLOPS) is None
assert execution.auto_mesh(5, step_flops=1e6).devices.size == 2
# rounds whose local training is too small to pay for the mesh: no split
floor = execution.SPLIT_MIN_ROUND_FLOPS
assert execution.auto_mesh(5, step_flops=1e6, round_flops=floor / 2) is None
assert execution.auto_mesh(5, step_flops=1e6, round_flops=floor).devices.size == 2

def run(strategy, lr=0.5):
    alg = fedavg(model, batch_size=4, num_epochs=2, client_lr=lr)
    return alg.apply(alg.init(params, 6), cohort, jax.random.key(1),
                     execution=Execution(strategy))

seq, auto = jax.jit(lambda: run("sequential"))(), jax.jit(lambda: run("auto"))()
for a, b in zip(jax.tree.leaves((seq[0].params, seq[1]["loss_before"])),
                jax.tree.leaves((auto[0].params, auto[1]["loss_before"]))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
text = jax.jit(lambda: run("auto")).lower().compile().as_text()
assert "num_partitions=2" in text, text[:400]
# a traced hyper-parameter: vmap and grad through the sharded round
lrs = jnp.asarray([0.1, 0.5])
seqs = jax.vmap(lambda lr: run("sequential", lr)[0].params)(lrs)
autos = jax.jit(jax.vmap(lambda lr: run("auto", lr)[0].params))(lrs)
for a, b in zip(jax.tree.leaves(seqs), jax.tree.leaves(autos)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
loss = lambda strategy: lambda lr: sum(jnp.sum(v ** 2) for v in jax.tree.leaves(
    run(strategy, lr)[0].params))
np.testing.assert_allclose(jax.grad(loss("auto"))(0.3), jax.grad(loss("sequential"))(0.3),
                           rtol=1e-4)
print("OK")
"""


@pytest.mark.slow
def test_auto_splits_the_cohort_over_several_cpu_devices():
    """With two CPU devices, ``auto`` runs the cohort on both (a 2-partition program)
    and equals the one-device ``sequential`` round, also under vmap and grad."""
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                          + " --xla_force_host_platform_device_count=2").strip(),
               PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _AUTO_MESH_CHECK], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-4000:]


# --------------------------------------------------------------------------------------
# masked_mean, batch_at.


def test_masked_mean_of_all_false_mask_is_zero():
    f = jax.jit(masked_mean)
    values = jnp.array([1.0, 2.0, 3.0])
    assert float(f(values, jnp.zeros((3,), bool))) == 0.0
    np.testing.assert_allclose(f(values, jnp.array([True, False, True])), 2.0)
    grad = jax.grad(lambda v: masked_mean(v, jnp.zeros((3,), bool)))(values)
    np.testing.assert_array_equal(grad, np.zeros(3))


def test_data_metrics_calibration_is_the_same_in_row_chunks():
    """ECE / MCE over a client of 700 padded rows (chunked by 256) equal the unchunked
    values, and padded rows never count."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(700, 10)).astype(np.float32)
    y = rng.integers(0, 3, size=700).astype(np.int32)
    data = ClientData({"x": jnp.asarray(x), "y": jnp.asarray(y)}, jnp.arange(700) < 650,
                      jnp.asarray(650))
    chunked = jax.jit(lambda p, d: client_lib.data_metrics(MODEL, p, d, chunk_size=256))(
        PARAMS, data)
    whole = client_lib.data_metrics(MODEL, PARAMS, data, chunk_size=1024)
    from fedjax_fair.metrics import calibration_errors
    logits = MODEL.apply(PARAMS, jnp.asarray(x[:650]))
    expected = [float(v) for v in calibration_errors(logits, jnp.asarray(y[:650]))]
    for m in (chunked, whole):
        np.testing.assert_allclose([float(m["ece"]), float(m["mce"])], expected, atol=1e-6)


def test_steps_per_epoch_and_scan_length():
    np.testing.assert_array_equal(steps_per_epoch(jnp.array([0, 1, 4, 5, 8]), 4),
                                  [0, 1, 1, 2, 2])
    assert max_local_steps(12, 4, 2) == 6
    assert max_local_steps(13, 4, 2) == 8
    assert max_local_steps(13, 4, 2, max_steps=5) == 5


@pytest.mark.parametrize("batch,sizes", [(3, (7, 1, 12, 0)), (5, (5, 9, 11, 3))])
def test_batch_at_covers_real_rows_once_per_epoch(batch, sizes):
    padded, epochs = 12, 3
    key = jax.random.key(11)
    num_steps = epochs * math.ceil(padded / batch)  # enough for every n <= 12

    @jax.jit
    def batches(n):
        data = ClientData(examples={"row": jnp.arange(padded, dtype=jnp.int32)},
                          mask=jnp.arange(padded) < n, num_examples=n)
        return jax.vmap(lambda t: batch_at(data, t, key, batch))(jnp.arange(num_steps))

    for n in sizes:
        spe = max(math.ceil(n / batch), 1)
        ex, bmask = batches(jnp.int32(n))
        rows = np.asarray(ex["row"])[:epochs * spe].reshape(epochs, spe, batch)
        bmask = np.asarray(bmask)[:epochs * spe].reshape(epochs, spe, batch)
        orders = []
        for e in range(epochs):
            assert np.all(rows[e][bmask[e]] < n)  # padded rows never appear unmasked
            seen = rows[e][bmask[e]].tolist()
            assert sorted(seen) == list(range(n))  # every real row exactly once per epoch
            if n:  # only the epoch's last batch may be partial
                np.testing.assert_array_equal(bmask[e].sum(-1)[:-1], batch)
            orders.append(seen)
        if n >= 5:
            assert orders[0] != orders[1] or orders[1] != orders[2]  # epochs reshuffle


def test_run_refuses_a_lazy_table_too_small_before_compute():
    from fedjax_fair.algorithms import feddyn
    alg = feddyn(MODEL, batch_size=B, client_table="lazy:2")
    with pytest.raises(ValueError, match="^client_table: "):
        run(alg, PARAMS, DATA, KEY, model=MODEL, num_rounds=2, cohort_size=3,
            progress=False)
    # min(N, K R) = min(6, 3 x 1) = 3 slots suffice for one round of 3 clients.
    result = run(feddyn(MODEL, batch_size=B, client_table="lazy:3"), PARAMS, DATA, KEY,
                 model=MODEL, num_rounds=1, cohort_size=3, progress=False)
    assert result.client_table["rows_stored"] == 3


@pytest.mark.parametrize("placement", ["device", pytest.param("host", marks=pytest.mark.slow)])
def test_run_evaluates_a_validation_split_under_its_own_names(placement):
    """A validation split is summarised with the test split's metric names prefixed
    ``validation_``; the test keys say what they measure (``accuracy_worst_10%``)."""
    from fedjax_fair.metrics import fairness_summary
    swapped = DATA._replace(validation=DATA.test, test=DATA.train)
    result = _run(_seq_fedavg(), data=swapped, placement=placement)
    final = result.history[-1]
    assert {"accuracy_mean", "accuracy_worst_10%", "accuracy_worst_10%_unweighted",
            "test_loss", "validation_accuracy_mean", "validation_accuracy_worst_10%",
            "validation_loss"} <= set(final)
    plain = _run(_seq_fedavg(), placement=placement).history[-1]  # DATA.test as test
    for key, value in plain.items():
        if key.startswith("accuracy_"):
            assert final["validation_" + key] == pytest.approx(value, abs=1e-6)
    # test metrics come from the split named test (here DATA.train)
    n = np.asarray(result.client_metrics["num_examples"])
    np.testing.assert_array_equal(n, np.asarray(DATA.train.num_examples))
    acc = np.asarray(result.client_metrics["accuracy"])[n > 0]
    expected = fairness_summary(acc, weights=n[n > 0])
    assert final["accuracy_worst_10%"] == pytest.approx(expected["worst_10%"], abs=1e-6)
