"""AFL's mixing rule (``algorithms/afl.py``; Mohri et al. 2019): the projected
gradient ascent on lambda against a literal NumPy float64 transcription over many
rounds of partial participation, symmetry and monotone response under full
participation, and masked rows leaving the state unchanged.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair.algorithms.afl import afl_ascent, afl_mixing
from helpers import client_output as _out, server_context as _ctx, np_project_simplex


# ------------------------------------------------------------- NumPy float64 references


def np_afl(lambdas, losses, ids, mask, lr):
    """lambda <- Proj(lambda + lr (N / m) F scattered at the participating ids)."""
    lambdas = np.asarray(lambdas, np.float64)
    g = np.zeros_like(lambdas)
    m = int(np.sum(mask))
    for i, f, a in zip(ids, losses, mask):
        if a:
            g[i] += len(lambdas) / m * f
    return np_project_simplex(lambdas + lr * g)


# ---------------------------------------------------------------------------------- AFL


def test_afl_ascent_matches_reference_over_rounds(rng):
    num_clients, k = 7, 4
    rule = afl_mixing(0.3)
    state = rule.init(num_clients)
    lam = np.full(num_clients, 1 / num_clients)
    update = jax.jit(rule.update)
    for r in range(30):
        ids = rng.permutation(num_clients)[:k]
        mask = np.array([True, True, r % 3 != 0, True])
        f = rng.uniform(0, 2, size=k).astype(np.float32)
        n = rng.integers(1, 9, size=k)
        w, state = update(state, _out(f, n), _ctx(ids, mask))
        lam = np_afl(lam, f, ids, mask, 0.3)
        np.testing.assert_allclose(state.lambdas, lam, atol=2e-6)
        sub = np.where(mask, lam[ids], 0.0)
        if sub.sum() > 0:
            np.testing.assert_allclose(w, sub / sub.sum(), atol=2e-6)


def test_afl_full_participation_symmetry_and_monotone_response():
    num_clients = 5
    rule = afl_mixing(0.5)
    ids = jnp.arange(num_clients, dtype=jnp.int32)
    state = rule.init(num_clients)
    np.testing.assert_allclose(state.lambdas, np.full(5, 0.2))
    update = jax.jit(rule.update)
    for _ in range(50):  # equal losses: lambda stays uniform
        w, state = update(state, _out(np.full(5, 1.7)), _ctx(ids, jnp.ones(5, bool)))
    np.testing.assert_allclose(state.lambdas, np.full(5, 0.2), atol=1e-6)
    np.testing.assert_allclose(w, np.full(5, 0.2), atol=1e-6)
    # One round where client 3 has the strictly largest loss: it gets the strict max.
    f = np.array([0.5, 0.7, 0.6, 0.9, 0.2], np.float32)
    _, state = rule.update(rule.init(num_clients), _out(f), _ctx(ids, jnp.ones(5, bool)))
    lam = np.asarray(state.lambdas)
    assert np.argmax(lam) == 3 and np.sum(lam == lam.max()) == 1
    # gamma = 0: lambda never moves, the weights are uniform over the cohort.
    w, state = afl_mixing(0.0).update(rule.init(num_clients), _out(f[:3]),
                                      _ctx(ids[:3], jnp.ones(3, bool)))
    np.testing.assert_allclose(w, np.full(3, 1 / 3), rtol=1e-6)
    np.testing.assert_allclose(state.lambdas, np.full(5, 0.2))


def test_afl_masked_rows_do_not_change_the_state():
    rule = afl_mixing(0.2)
    state = rule.init(6)
    f = jnp.array([0.4, 1.5, 0.9])
    w, s1 = rule.update(state, _out(f), _ctx(jnp.array([4, 1, 2]), jnp.ones(3, bool)))
    # The same cohort padded with masked repeats of client 4 carrying huge losses.
    w2, s2 = rule.update(state, _out(jnp.array([0.4, 1.5, 0.9, 1e6, jnp.nan])),
                         _ctx(jnp.array([4, 1, 2, 4, 4]),
                              jnp.array([True, True, True, False, False])))
    np.testing.assert_allclose(s2.lambdas, s1.lambdas, atol=1e-7)
    np.testing.assert_allclose(w2[:3], w, atol=1e-7)
    np.testing.assert_array_equal(w2[3:], 0.0)
    # A fully masked cohort leaves lambda unchanged.
    lam = afl_ascent(s1.lambdas, f, jnp.array([0, 1, 2]), jnp.zeros(3, bool), 5.0)
    np.testing.assert_array_equal(lam, s1.lambdas)
