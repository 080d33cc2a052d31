"""Rounds scanned by fedjax_fair/drivers/simulate.py: make_cohort's step budgets, one
trace for new values, the carry shapes of every algorithm, determinism.

The federation is helpers.tiny_federation(): 6 clients, 10 features, 3 classes,
train sizes (7, 12, 0, 3, 9, 5) padded to M = 12, client 2 empty.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from helpers import (ENGINE_MODEL as MODEL, ENGINE_PARAMS as PARAMS, ENGINE_DATA as DATA,
                     ENGINE_TRAIN as TRAIN, ENGINE_N as N, TRAIN_SIZES_ARRAY as SIZES,
                     ENGINE_B as B, ENGINE_E as E, ENGINE_KEY as KEY, engine_steps as _steps,
                     engine_fedavg as _fedavg, vmap_apply_on as _vmap_apply_on)
from fedjax_fair.algorithms import ALGORITHMS, REGISTRY
from fedjax_fair.drivers.simulate import make_cohort, simulate
from fedjax_fair.core.client import ClientTraining


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


def test_active_rounds_runs_the_first_rounds_of_one_program():
    """``active_rounds=n`` (traced: one program for every n) runs the first n of the
    scan's rounds, as a scan of n rounds does, and logs zeros for the rest."""
    alg, _ = _simulate_fn()
    state0, data, key = alg.init(PARAMS, N), helpers.tiny_federation(), jax.random.key(3)
    cut = jax.jit(chex.assert_max_traces(lambda s, n: simulate(
        alg, s, data, key, num_rounds=3, cohort_size=3, active_rounds=n), n=1))
    for n in (3, 1, 0):
        state, metrics = cut(state0, jnp.int32(n))
        assert int(state.round) == n
        if n:
            plain, expected = jax.jit(lambda s, n=n: simulate(
                alg, s, data, key, num_rounds=n, cohort_size=3))(state0)
            chex.assert_trees_all_close(state, plain, rtol=1e-6, atol=1e-7)
            chex.assert_trees_all_close(jax.tree.map(lambda m: m[:n], metrics), expected,
                                        rtol=1e-6, atol=1e-7)
        chex.assert_trees_all_equal(jax.tree.map(lambda m: m[n:], metrics),
                                    jax.tree.map(lambda m: jnp.zeros_like(m[n:]), metrics))


def _shape_structs(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype),
                                   bool(getattr(x, "weak_type", False))), tree)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_round_carry_shape_stability(name):
    # LG-FedAvg refuses to share the one layer of logistic regression (it would be
    # FedAvg): here it keeps that layer local.
    extra = {"shared_layers": ()} if name == "lg_fedavg" else {}
    alg = helpers.bind_execution(ALGORITHMS[name](MODEL, training=ClientTraining(batch_size=B,
                                                                                 num_epochs=E), **extra),
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
