"""Mixing rules (``core/mixing.py``) and the properties every loss-driven fair rule
must have (AAggFF thesis; arXiv:2307.06283 for FedMax / FedSoftMax), checked over all
of them at once: the simplex invariant under jit / vmap / scan and extreme inputs,
masked and empty rows, consensus, symmetry, reduction to FedAvg on equal losses, and
monotone response; ``active_clients`` and the uniform / data-size rules; and a short
end-to-end run on a skewed federation where the fair rules lower the worst client's
loss.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from helpers import (client_output as _out, server_context as _ctx, SKEWED_KW as KW,
                     SKEWED_TRAIN as TRAIN, skewed_rounds)
from fedjax_fair.algorithms.afl import AFLState, afl, afl_mixing
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.algorithms.fedmax import (fedmax, fedmax_k_mixing, fedmax_mixing, fedsoftmax,
                                           fedsoftmax_mixing)
from fedjax_fair.algorithms.propfair import propfair, propfair_mixing
from fedjax_fair.algorithms.qffl import prior_mixing, qffl, qffl_mixing
from fedjax_fair.algorithms.term import term, term_mixing
from fedjax_fair.core import mixing as mixing_lib
from fedjax_fair.core.aggregators import weighted_mean
from fedjax_fair.core.client import data_loss
from fedjax_fair.core.mixing import active_clients
from fedjax_fair.core.types import ClientOutput


# ------------------------------------------------ uniform, data-size and active clients


def test_uniform_mixing_weights():
    rule = mixing_lib.uniform()
    out = ClientOutput(delta=(), loss_before=jnp.array([3.0, 1.0, 2.0, 5.0]),
                       num_examples=jnp.array([1, 2, 3, 4]), num_steps=jnp.zeros(4, jnp.int32))
    w, _ = rule.update(rule.init(7), out, _ctx(jnp.arange(4), jnp.ones(4, bool)))
    np.testing.assert_allclose(w, np.full(4, 0.25))
    w, _ = rule.update(rule.init(7), out,
                       _ctx(jnp.arange(4), jnp.array([True, False, True, True])))
    np.testing.assert_allclose(w, [1 / 3, 0.0, 1 / 3, 1 / 3], rtol=1e-6)
    w, _ = mixing_lib.by_num_examples().update((), out, _ctx(jnp.arange(4), jnp.ones(4, bool)))
    np.testing.assert_allclose(w, np.array([1, 2, 3, 4]) / 10, rtol=1e-6)


def test_active_clients_drops_empty_clients_unless_none_has_data():
    out = _out([1.0, 0.0, 2.0], n=[3, 0, 4])
    np.testing.assert_array_equal(active_clients(out, jnp.array([True, True, False])),
                                  [True, False, False])
    out = _out([0.0, 0.0], n=[0, 0])
    np.testing.assert_array_equal(active_clients(out, jnp.array([True, False])),
                                  [True, False])


# ------------------------------------------------------------- all mixing rules at once
# Every rule is evaluated inside ONE jitted function (cohorts of K = 6 rows, N = 8
# clients), so the properties below cost one compilation, not one per rule.

K, N_CLIENTS = 6, 8
RULES = {
    "qffl_mixing": qffl_mixing(1.0),
    "qffl_prior": prior_mixing(False),
    "afl": afl_mixing(0.1),
    "term": term_mixing(1.0),
    "term_uniform": term_mixing(1.0, weight_by_size=False),
    "propfair": propfair_mixing(2.0),
    "fedmax": fedmax_mixing(),
    "fedmax_k": fedmax_k_mixing(0.5),
    "fedmax_k2": fedmax_k_mixing(2),
    "fedsoftmax": fedsoftmax_mixing(30.0),
    "fedsoftmax_uniform": fedsoftmax_mixing(30.0, weight_by_size=False),
}


@jax.jit
def _all_rules(losses, n, mask, ids):
    """{rule: weights [K]} of one round from each rule's initial state."""
    return {name: rule.update(rule.init(N_CLIENTS), _out(losses, n), _ctx(ids, mask))[0]
            for name, rule in RULES.items()}


def _all(losses, n=None, mask=None, ids=None):
    n = np.ones(K, np.int32) if n is None else np.asarray(n, np.int32)
    mask = np.ones(K, bool) if mask is None else np.asarray(mask, bool)
    ids = np.arange(K, dtype=np.int32) if ids is None else np.asarray(ids, np.int32)
    out = _all_rules(np.asarray(losses, np.float32), n, mask, ids)
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


def _random_rounds(num_rounds, seed):
    """Losses mixing zero, equal, huge (up to 1e3) and ordinary values; random sizes
    (some empty), masks with at least one active row, and distinct ids."""
    rng = np.random.default_rng(seed)
    kinds = rng.integers(0, 4, size=num_rounds)
    losses = rng.uniform(0, 5, size=(num_rounds, K))
    losses[kinds == 0] = 0.0
    losses[kinds == 1] = rng.uniform(0, 5, size=(np.sum(kinds == 1), 1))
    losses[kinds == 2] = rng.uniform(0, 1e3, size=(np.sum(kinds == 2), K))
    n = rng.integers(0, 30, size=(num_rounds, K))
    mask = rng.random((num_rounds, K)) < 0.7
    mask[np.arange(num_rounds), rng.integers(0, K, num_rounds)] = True
    ids = np.stack([rng.permutation(N_CLIENTS)[:K] for _ in range(num_rounds)])
    return (losses.astype(np.float32), n.astype(np.int32), mask, ids.astype(np.int32))


@jax.jit
def _scan_of_vmaps(losses, n, mask, ids):
    """Per rule: weights [R, B, K] and final states of B independent federations
    (jax.vmap) run for R consecutive rounds each (lax.scan, state carried)."""
    out = {}
    for name, rule in RULES.items():
        update = jax.vmap(lambda st, f, nn, m, i, rule=rule: rule.update(st, _out(f, nn),
                                                                          _ctx(i, m)))

        def one(states, xs, update=update):
            weights, states = update(states, *xs)
            return states, weights

        batch = losses.shape[1]
        init = jax.vmap(lambda _, rule=rule: rule.init(N_CLIENTS))(jnp.arange(batch))
        states, weights = jax.lax.scan(one, init, (losses, n, mask, ids))
        out[name] = (weights, states)
    return out


def test_weights_stay_on_the_simplex_under_jit_vmap_and_scan():
    """Simplex invariant: 200 random
    rounds (4 federations x 50 rounds, vmapped and scanned under jit) incl. zero /
    equal / huge losses: weights >= 0, zero on masked rows, sum to 1; AFL's state
    stays on the simplex."""
    losses, n, mask, ids = (x.reshape(50, 4, *x.shape[1:]) for x in _random_rounds(200, seed=1))
    for name, (weights, states) in _scan_of_vmaps(losses, n, mask, ids).items():
        w = np.asarray(weights, np.float64)
        assert np.all(np.isfinite(w)), name
        assert w.min() >= -1e-6, name
        np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5, err_msg=name)
        np.testing.assert_array_equal(w[~mask], 0.0, err_msg=name)
        if isinstance(states, AFLState):
            lam = np.asarray(states.lambdas)
            assert lam.min() >= -1e-6 and np.all(np.abs(lam.sum(-1) - 1) < 1e-5)


def test_masked_and_empty_rows_get_zero_weight_and_do_not_matter():
    """Masked rows (even with NaN losses) and empty clients get weight 0, and what
    they hold does not change the other weights."""
    losses = np.array([0.7, 1.3, 0.2, 0.9, 2.0, 0.4], np.float32)
    n = np.array([5, 8, 0, 3, 9, 4])
    mask = np.array([True, True, True, True, False, True])
    other = losses.copy()
    other[4] = np.nan
    other[2] = 50.0  # an empty client's loss is ignored
    first, second = _all(losses, n, mask), _all(other, np.where(mask, n, 1000), mask)
    for name, w in first.items():
        assert w[4] == 0.0 and w[2] == 0.0, name
        np.testing.assert_allclose(w.sum(), 1.0, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(second[name], w, atol=1e-7, err_msg=name)


def test_identical_client_models_are_returned_unchanged():
    """Consensus: the weights sum to one, so
    identical client deltas aggregate to that delta under every rule."""
    delta = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(4, np.float32)}
    stacked = jax.tree.map(lambda x: np.broadcast_to(x, (K, *x.shape)), delta)
    mask = np.array([True, True, False, True, True, True])
    outputs = _out(np.ones(K), delta=stacked)
    for name, w in _all(np.linspace(0.1, 2.0, K), np.arange(1, K + 1), mask).items():
        out, _, _ = weighted_mean().aggregate((), outputs, jnp.asarray(w, jnp.float32),
                                              _ctx(jnp.arange(K), mask))
        helpers.assert_trees_close(out, delta, rtol=1e-6, atol=1e-6)


def test_permuting_the_cohort_permutes_the_weights():
    """Symmetry: permuting the clients permutes p (distinct losses)."""
    losses = np.array([0.7, 1.3, 0.2, 0.9, 2.0, 0.5], np.float32)
    n = np.array([5, 8, 2, 3, 9, 6])
    perm = np.array([3, 0, 4, 1, 5, 2])
    first, second = _all(losses, n), _all(losses[perm], n[perm], ids=perm)
    for name, w in first.items():
        np.testing.assert_allclose(second[name], w[perm], rtol=1e-5, atol=1e-7, err_msg=name)


def test_equal_losses_give_data_or_uniform_weights():
    """Symmetry and reduction to FedAvg: equal losses give the
    prior (n / sum n, or uniform); FedMax splits the weight over all (a tie) and
    FedMax(k) takes the first k rows (ties by the lower row)."""
    n = np.array([5, 8, 2, 3, 9, 6])
    data, unif = n / n.sum(), np.full(K, 1 / K)
    ref = {"qffl_mixing": data, "qffl_prior": unif, "afl": unif, "term": data,
           "term_uniform": unif, "propfair": data, "fedmax": unif, "fedsoftmax": data,
           "fedsoftmax_uniform": unif, "fedmax_k": [1 / 3] * 3 + [0] * 3,
           "fedmax_k2": [0.5, 0.5, 0, 0, 0, 0]}
    for name, w in _all(np.full(K, 0.8), n).items():
        np.testing.assert_allclose(w, ref[name], rtol=1e-6, err_msg=name)


def test_strictly_larger_loss_gets_strictly_larger_weight():
    """Monotone response: with equal n, a higher loss gets a
    strictly higher weight."""
    f = np.array([0.3, 1.1, 0.6, 0.9, 0.45, 0.7], np.float32)
    weights = _all(f, np.full(K, 4))
    for name in ("qffl_mixing", "afl", "term", "term_uniform", "propfair", "fedsoftmax"):
        w = weights[name]
        assert list(np.argsort(w)) == list(np.argsort(f)), (name, w)
        assert len(set(np.round(w, 9))) == K, name


# ------------------------------------------------------------------------- whole rounds
# The skewed federation of helpers.skewed_train (6 clients, M = 12): clients 0-3
# and client 4 are labelled by opposite linear teachers, client 5 is empty; clients
# train full-batch, so NumPy gradient descent reproduces every local model.
# helpers.skewed_rounds compiles each algorithm once for every test below.

MODEL = helpers.logreg()
FACTORIES = {
    "fedavg": lambda: fedavg(MODEL, **KW),
    "qffl0": lambda: qffl(MODEL, q=0.0, **KW),
    "qffl": lambda: qffl(MODEL, q=5.0, **KW),
    "term": lambda: term(MODEL, tilt=10.0, **KW),
    "afl": lambda: afl(MODEL, lambda_lr=1.0, **KW),
    "fedmax": lambda: fedmax(MODEL, loss_source="pre_round", **KW),
    "fedsoftmax": lambda: fedsoftmax(MODEL, beta=10.0, loss_source="pre_round", **KW),
    "propfair": lambda: propfair(MODEL, baseline=2.0, **KW),
}
_rounds = skewed_rounds(FACTORIES)


def test_fair_rules_lower_the_worst_client_loss_on_a_skewed_federation():
    """20 full-participation rounds: q-FFL (q = 5), TERM (t = 10) and AFL
    (gamma = 1) end with a lower worst-client loss (x0.8) and loss variance (x0.5)
    than FedAvg, and q-FFL's variance is below its q = 0 reduction's (x0.6).
    (Measured on 4 data seeds: worst 0.63-1.14 vs FedAvg 1.45-2.60; variance at
    least 10x lower; q-FFL/q=0 variance ratio <= 0.4.)"""
    client_losses = jax.jit(jax.vmap(lambda p, d: data_loss(MODEL, p, d), in_axes=(None, 0)))
    worst, spread = {}, {}
    for name in ("fedavg", "qffl0", "qffl", "term", "afl"):
        state, _ = _rounds(name, num_rounds=20)
        losses = np.asarray(client_losses(state.params, TRAIN))[:5]  # client 5 is empty
        worst[name], spread[name] = losses.max(), losses.var()
    for name in ("qffl", "term", "afl"):
        assert worst[name] < 0.8 * worst["fedavg"], (name, worst)
        assert spread[name] < 0.5 * spread["fedavg"], (name, spread)
    assert spread["qffl"] < 0.6 * spread["qffl0"], spread


@pytest.mark.slow
def test_other_loss_driven_rules_lower_the_worst_client_loss():
    client_losses = jax.jit(jax.vmap(lambda p, d: data_loss(MODEL, p, d), in_axes=(None, 0)))
    worst = {}
    for name in ("fedavg", "fedmax", "fedsoftmax", "propfair"):
        state, _ = _rounds(name, num_rounds=20)
        worst[name] = np.asarray(client_losses(state.params, TRAIN))[:5].max()
    for name in ("fedmax", "fedsoftmax", "propfair"):
        assert worst[name] < 0.9 * worst["fedavg"], (name, worst)
