"""q-FFL (``algorithms/qffl.py``; Li et al. 2020): the thesis's mixing form
p_k ∝ n_k F_k^q, the q-FedAvg aggregator (Algorithm 2) and its coefficients, each
against a literal NumPy float64 transcription; the reduction q = 0 (uniform or
prior-weighted averaging); whole q-FFL rounds against NumPy local models on a skewed
federation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import helpers
from helpers import (client_output as _out, full_context as _full_ctx, rule_weights as _weights,
                     np_qffl_mixing, SKEWED_LR as LR, SKEWED_KW as KW,
                     skewed_np_clients as _np_clients, assert_skewed_step as _assert_step,
                     skewed_rounds)
from fedjax_fair.algorithms.qffl import (qffl, qffl_aggregator, qffl_coefficients,
                                         qffl_mixing, qffl_weights)
from fedjax_fair.core.aggregators import weighted_mean
from fedjax_fair.core.mixing import by_num_examples


# ------------------------------------------------------------- NumPy float64 references


def np_qfedavg(losses, deltas, q, lipschitz):
    """Li et al. 2020, Algorithm 2, literally (uniform sampling):
    Delta w_k = L (w^t - w_k); Delta_k = F_k^q Delta w_k;
    h_k = q F_k^{q-1} ||Delta w_k||^2 + L F_k^q;  w^t - w^{t+1} = sum Delta_k / sum h_k."""
    losses = np.asarray(losses, np.float64)
    dw = lipschitz * np.asarray(deltas, np.float64)  # [K, d]
    num = sum(f ** q * d for f, d in zip(losses, dw))
    h = sum(q * f ** (q - 1) * np.sum(d ** 2) + lipschitz * f ** q for f, d in zip(losses, dw))
    return num / h


# -------------------------------------------------------------------------------- q-FFL


def test_qffl_mixing_form_matches_reference_and_reduces_to_fedavg(rng):
    for _ in range(5):
        f = rng.uniform(0.01, 3, size=6).astype(np.float32)
        n = rng.integers(1, 40, size=6)
        for q in (0.1, 1.0, 5.0):
            w, _ = _weights(qffl_mixing(q), f, n)
            np.testing.assert_allclose(w, np_qffl_mixing(f, n, q), rtol=2e-5)
        w, _ = _weights(qffl_mixing(0.0), f, n)
        fedavg_w, _ = _weights(by_num_examples(), f, n)
        np.testing.assert_allclose(w, fedavg_w, rtol=1e-6)
    # Zero losses: F^q = 0 (q > 0), F^0 = 1 (q = 0); all zero -> the prior.
    w = np.asarray(qffl_weights(jnp.array([0.0, 1.0, 3.0]), jnp.ones(3), jnp.ones(3, bool), 2.0))
    np.testing.assert_allclose(w, [0.0, 0.1, 0.9], rtol=1e-6)
    w = qffl_weights(jnp.array([0.0, 1.0]), jnp.ones(2), jnp.ones(2, bool), 0.0)
    np.testing.assert_allclose(w, [0.5, 0.5])
    w = qffl_weights(jnp.zeros(2), jnp.ones(2), jnp.ones(2, bool), 1.0)
    np.testing.assert_allclose(w, [0.5, 0.5])


def _tree_deltas(k, seed):
    rng = np.random.default_rng(seed)
    return {"a": jnp.asarray(rng.normal(size=(k, 3, 2)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(k, 4)) * 0.1, jnp.float32)}


def _flat(deltas):
    return np.concatenate([np.asarray(deltas["a"], np.float64).reshape(len(deltas["b"]), -1),
                           np.asarray(deltas["b"], np.float64)], axis=1)


def _unflat(vec):
    return {"a": vec[:6].reshape(3, 2), "b": vec[6:]}


def test_qffl_aggregator_matches_li_et_al_literally(rng):
    """With the uniform prior, the direction is exactly sum_k Delta_k / sum_k h_k of
    Li et al.'s Algorithm 2 (the 1/K factors cancel), for q in {0, 0.1, 1, 5} and
    L in {1, 10}."""
    k = 5
    for q in (0.0, 0.1, 1.0, 5.0):
        for lipschitz in (1.0, 10.0):
            deltas = _tree_deltas(k, seed=int(10 * q + lipschitz))
            losses = rng.uniform(0.2, 2.5, size=k).astype(np.float32)
            agg = qffl_aggregator(q, lipschitz)
            direction, _, _ = agg.aggregate(agg.init(None, k), _out(losses, delta=deltas),
                                            jnp.full((k,), 1.0 / k), _full_ctx(k))
            ref = _unflat(np_qfedavg(losses, _flat(deltas), q, lipschitz))
            helpers.assert_trees_close(direction, jax.tree.map(np.float32, ref), rtol=2e-5,
                                       atol=1e-7)


def test_qffl_with_q_zero_is_the_prior_weighted_mean():
    """q = 0: h_k = L, so the step is sum_k pi_k Delta_k (uniform averaging for the
    uniform prior, FedAvg for pi ∝ n) whatever the losses, zero losses included."""
    k = 6
    deltas = _tree_deltas(k, seed=3)
    losses = jnp.array([0.0, 1.0, 2.0, 0.3, 0.0, 9.0])
    for prior in (jnp.full((k,), 1.0 / k), jnp.array([0.1, 0.2, 0.0, 0.3, 0.15, 0.25])):
        outputs = _out(losses, delta=deltas)
        direction, _, _ = qffl_aggregator(0.0, 7.0).aggregate((), outputs, prior, _full_ctx(k))
        ref, _, _ = weighted_mean().aggregate((), outputs, prior, _full_ctx(k))
        helpers.assert_trees_close(direction, ref, rtol=1e-6, atol=1e-7)


def test_qffl_coefficients_guards_and_float32_range(rng):
    # Zero losses, masked rows, huge deltas on masked rows (NaN ones would leak
    # through the server step's single dot product, 0 * NaN = NaN; see weighted_sum).
    losses = jnp.array([0.0, 1.0, 2.0, 5.0])
    sq = jnp.array([1.0, 1.0, 4.0, 3.0])
    prior = jnp.array([1 / 3, 1 / 3, 1 / 3, 0.0])
    c = np.asarray(qffl_coefficients(losses, sq, prior, 1.0, 10.0))
    # client 0 (F = 0) contributes neither F^q nor h: c = (0, 10, 20, 0) / (110 + 420)
    np.testing.assert_allclose(c, [0.0, 10 / 530, 20 / 530, 0.0], rtol=1e-6)
    assert np.all(np.isfinite(np.asarray(qffl_coefficients(jnp.zeros(3), jnp.ones(3),
                                                           jnp.ones(3) / 3, 0.5, 1.0))))
    np.testing.assert_array_equal(qffl_coefficients(jnp.zeros(3), jnp.ones(3), jnp.ones(3) / 3,
                                                    0.5, 1.0), 0.0)
    deltas = _tree_deltas(4, seed=5)
    clean, _, _ = qffl_aggregator(1.0, 10.0).aggregate((), _out(losses, delta=deltas), prior,
                                                       _full_ctx(4))
    deltas = jax.tree.map(lambda x: x.at[3].set(1e30), deltas)
    direction, _, _ = qffl_aggregator(1.0, 10.0).aggregate((), _out(losses, delta=deltas),
                                                           prior, _full_ctx(4))
    helpers.assert_trees_close(direction, clean, rtol=0, atol=0)
    # Large q, losses and L: float32 F^q (120^20 ~ 4e41) would overflow, the shifted
    # form does not.
    losses = np.array([50.0, 80.0, 120.0], np.float32)
    sq = np.array([2.0, 1.0, 0.5], np.float32)
    c = np.asarray(qffl_coefficients(losses, sq, jnp.ones(3) / 3, 20.0, 1e4))
    assert np.all(np.isfinite(c))
    f, L = losses.astype(np.float64), 1e4
    h = 20 * f ** 19 * L ** 2 * sq + L * f ** 20
    np.testing.assert_allclose(c, L * f ** 20 / h.sum(), rtol=1e-5)
    assert c.sum() <= 1.0
    # The coefficients never exceed the prior mass (q >= 0): sum c <= 1.
    for _ in range(20):
        c = qffl_coefficients(jnp.asarray(rng.uniform(0, 3, 5), jnp.float32),
                              jnp.asarray(rng.uniform(0, 2, 5), jnp.float32),
                              jnp.ones(5) / 5, float(rng.uniform(0, 5)), 3.0)
        assert float(jnp.sum(c)) <= 1.0 + 1e-6 and float(jnp.min(c)) >= 0.0


# ------------------------------------------------------------------------- whole rounds
# The skewed federation of helpers.skewed_train (6 clients, M = 12): clients 0-3
# and client 4 are labelled by opposite linear teachers, client 5 is empty; clients
# train full-batch, so NumPy gradient descent reproduces every local model.
# helpers.skewed_rounds compiles each algorithm once for every test below.

MODEL = helpers.logreg()
FACTORIES = {
    "qffl0": lambda: qffl(MODEL, q=0.0, **KW),
    "qffl": lambda: qffl(MODEL, q=5.0, **KW),
}
_rounds = skewed_rounds(FACTORIES)


def test_qffl_round_equals_numpy_q_fedavg():
    """A q-FFL round (q = 5, L = 1 / eta_l) equals Li et al.'s Algorithm 2 computed
    literally from NumPy local models; the empty client takes no part."""
    state, metrics = _rounds("qffl")
    clients = _np_clients()
    deltas = np.stack([d for d, _ in clients.values()])
    losses = [f for _, f in clients.values()]
    np.testing.assert_allclose(np.asarray(metrics["loss_before"])[:5], losses, rtol=1e-5)
    _assert_step(state.params, np_qfedavg(losses, deltas, 5.0, 1.0 / LR))


def test_qffl_with_q_zero_is_a_uniform_average_round():
    """q = 0 reduces q-FedAvg to FedAvg with uniform weights over the cohort's
    clients (the empty client excluded); padding the cohort with masked rows, or
    dropping the empty client, changes nothing."""
    deltas = np.stack([d for d, _ in _np_clients().values()])
    step = deltas.mean(0)
    state, metrics = _rounds("qffl0")
    _assert_step(state.params, step)
    np.testing.assert_allclose(metrics["weights"], [0.2] * 5 + [0.0], rtol=1e-6)
    padded, metrics = _rounds("qffl0", ids=(3, 0, 4, 1, 2, 3), mask=[True] * 5 + [False])
    helpers.assert_trees_close(padded.params, state.params, rtol=1e-6, atol=1e-7)
    assert float(metrics["weights"][5]) == 0.0
