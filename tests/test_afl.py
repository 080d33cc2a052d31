"""AFL's mixing rule (``algorithms/afl.py``; Mohri et al. 2019): the projected
gradient ascent on lambda against a literal NumPy float64 transcription over many
rounds of partial participation, symmetry and monotone response under full
participation, and masked rows leaving the state unchanged.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


# ------------------------------------------- partial participation: the two lambda steps


def np_afl_sampled(lambdas, losses, ids, mask, lr):
    """The AAggFF authors' AFL server (src/server/aflserver.py), literally: the sampled
    coordinates p[S] = Proj_Delta(lambda[S] + lr F_S), the others kept."""
    lam = np.array(lambdas, np.float64)
    sel = [int(i) for i, a in zip(ids, mask) if a]
    if not sel:
        return lam
    f = np.array([float(v) for v, a in zip(losses, mask) if a], np.float64)
    lam[sel] = np_project_simplex(lam[sel] + lr * f)
    return lam


def test_afl_sampled_ascent_matches_the_authors_code_over_rounds(rng):
    num_clients, k, lr = 9, 4, 0.4
    rule = afl_mixing(lr, ascent="sampled")
    state = rule.init(num_clients)
    lam = np.full(num_clients, 1 / num_clients)
    update = jax.jit(rule.update)
    moved_outside = False
    for r in range(40):
        ids = rng.permutation(num_clients)[:k]
        mask = np.array([True, r % 4 != 1, True, r % 3 != 0])
        f = rng.uniform(0, 3, size=k).astype(np.float32)
        w, state = update(state, _out(f, rng.integers(1, 9, size=k)), _ctx(ids, mask))
        before = lam.copy()
        lam = np_afl_sampled(lam, f, ids, mask, lr)
        np.testing.assert_allclose(state.lambdas, lam, atol=3e-6)
        # the cohort's coordinates sum to 1; the others did not move
        np.testing.assert_allclose(lam[ids[mask]].sum(), 1.0, atol=1e-12)
        out = np.setdiff1d(np.arange(num_clients), ids[mask])
        np.testing.assert_array_equal(lam[out], before[out])
        np.testing.assert_allclose(w, np.where(mask, lam[ids], 0.0), atol=3e-6)
        moved_outside |= abs(lam.sum() - 1.0) > 1e-3
    assert moved_outside  # lambda leaves the simplex of all N clients


def test_afl_sampled_and_unbiased_steps_differ_in_partial_rounds_only(rng):
    num_clients, lr = 6, 0.3
    f = rng.uniform(0, 2, size=num_clients).astype(np.float32)
    lam0 = np_project_simplex(rng.uniform(size=num_clients))
    ids, full = np.arange(num_clients), np.ones(num_clients, bool)
    for ascent in ("unbiased", "sampled"):  # full participation: both are Proj(lambda + gF)
        got = afl_ascent(jnp.asarray(lam0, jnp.float32), f, ids, full, lr, ascent)
        np.testing.assert_allclose(got, np_project_simplex(lam0 + lr * f), atol=2e-6)
    ids, mask = np.array([4, 1, 2]), np.array([True, True, False])
    unbiased = afl_ascent(jnp.asarray(lam0, jnp.float32), f[:3], ids, mask, lr, "unbiased")
    sampled = afl_ascent(jnp.asarray(lam0, jnp.float32), f[:3], ids, mask, lr, "sampled")
    np.testing.assert_allclose(unbiased, np_afl(lam0, f[:3], ids, mask, lr), atol=2e-6)
    np.testing.assert_allclose(sampled, np_afl_sampled(lam0, f[:3], ids, mask, lr), atol=2e-6)
    assert np.abs(np.asarray(unbiased) - np.asarray(sampled)).max() > 1e-2
    # an all-masked cohort leaves lambda unchanged in both
    for ascent in ("unbiased", "sampled"):
        same = afl_ascent(jnp.asarray(lam0, jnp.float32), f[:3], ids, np.zeros(3, bool), 5.0,
                          ascent)
        np.testing.assert_array_equal(same, jnp.asarray(lam0, jnp.float32))


def test_afl_ascent_is_a_checked_keyword_of_the_factory():
    import helpers
    from fedjax_fair.algorithms import afl, build, method_hparams
    from fedjax_fair.algorithms.afl import ASCENTS
    from fedjax_fair.core.client import ClientTraining
    hp = method_hparams("afl")["ascent"]
    assert hp.default == "unbiased" and hp.annotation == "str" and not hp.python_only
    assert hp.range is None and ASCENTS == ("unbiased", "sampled")
    for bad in ("scaled", None):
        with pytest.raises(ValueError, match="^ascent: "):
            afl(helpers.logreg(), ascent=bad)
    # one round of the built method moves lambda as the authors' code does
    lr, ids, mask = 0.5, [4, 0, 3], [True, True, False]
    alg = helpers.bind_execution(build("afl", helpers.logreg(), ascent="sampled",
                                       lambda_lr=lr,
                                       training=ClientTraining(lr=0.1, batch_size=4)),
                                 "sequential")
    n = helpers.ENGINE_N
    state, m = jax.jit(alg.apply)(alg.init(helpers.ENGINE_PARAMS, n),
                                  helpers.cohort(helpers.ENGINE_TRAIN, ids, mask=mask),
                                  jax.random.key(0))
    lam = np_afl_sampled(np.full(n, 1 / n), np.asarray(m["loss_before"]), ids, mask, lr)
    np.testing.assert_allclose(state.mixing_state.lambdas, lam, atol=2e-6)
    np.testing.assert_allclose(m["weights"], np.where(mask, lam[ids], 0.0), atol=2e-6)
