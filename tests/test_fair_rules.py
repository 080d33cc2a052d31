"""Loss-driven fair aggregation rules: q-FFL, AFL, TERM, PropFair, FedMax, FedMax(k),
FedSoftMax, and the simplex helpers they share.

Every rule is checked against a literal NumPy float64 transcription of its paper's
equation, plus properties the AAggFF thesis's rules must have (simplex
invariant, symmetry, monotone response, EG unification, one-hot aggregation) and
those of FedMax / FedSoftMax (arXiv:2307.06283; simplex under jit/vmap and extreme inputs,
reductions and limits, skew monotonicity, consensus, NaN on masked rows), the
reductions q = 0 (uniform averaging) and t -> 0 (FedAvg), and a short end-to-end
run on a skewed federation where the fair rules lower the worst client's loss.
"""
from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from fedjax_fair.cli import config as config_lib
from fedjax_fair.core.aggregators import weighted_mean
from fedjax_fair.algorithms import REGISTRY, method_hparams
from fedjax_fair.algorithms.afl import AFLState, afl, afl_ascent, afl_mixing
from fedjax_fair.algorithms.families.training import CLIENT_HPARAMS
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.algorithms.fedmax import (effective_k, fedmax, fedmax_k, fedmax_k_mixing,
                                           fedmax_k_weights, fedmax_mixing, fedmax_weights,
                                           fedsoftmax, fedsoftmax_mixing, fedsoftmax_weights)
from fedjax_fair.algorithms.propfair import (client_batch_loss, client_objective, propfair,
                                             propfair_mixing)
from fedjax_fair.algorithms.qffl import (prior_mixing, qffl, qffl_aggregator,
                                         qffl_coefficients, qffl_mixing, qffl_weights)
from fedjax_fair.algorithms.term import term, term_mixing, term_weights
from fedjax_fair.core.client import (batch_from_orders, data_loss, epoch_order, local_sgd,
                                     masked_mean)
from fedjax_fair.core.mixing import by_num_examples
from fedjax_fair.core.mixing import active_clients
from fedjax_fair.solvers.simplex import (exponentiated_gradient, masked_softmax,
                                         project_simplex, project_simplex_masked)
from fedjax_fair.core.types import ClientOutput, ServerContext


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def _out(losses, n=None, delta=()):
    losses = jnp.asarray(losses, jnp.float32)
    n = jnp.ones(losses.shape, jnp.int32) if n is None else jnp.asarray(n, jnp.int32)
    return ClientOutput(delta=delta, loss_before=losses, num_examples=n,
                        num_steps=jnp.zeros(losses.shape, jnp.int32), train_loss=losses)


def _ctx(client_ids, client_mask):
    """The round's ServerContext for a cohort (what mixing rules and aggregators read
    here: the ids and the mask)."""
    return ServerContext(params=(), round=jnp.zeros((), jnp.int32), key=jax.random.key(0),
                         client_ids=jnp.asarray(client_ids, jnp.int32),
                         client_mask=jnp.asarray(client_mask, bool))


def _full_ctx(k):
    return _ctx(jnp.arange(k, dtype=jnp.int32), jnp.ones((k,), bool))


def _weights(rule, losses, n=None):
    """(weights float64 [K], new state) of one round of ``rule`` over rows 0..K-1."""
    k = len(losses)
    w, state = rule.update(rule.init(k), _out(losses, n), _full_ctx(k))
    return np.asarray(w, np.float64), state


# ----------------------------------------------------------- NumPy float64 references


def np_project_simplex(v, radius=1.0):
    """Projection by bisection on tau: sum_i max(v_i - tau, 0) = radius."""
    v = np.asarray(v, np.float64)
    lo, hi = v.min() - radius, v.max()
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if np.maximum(v - mid, 0).sum() > radius:
            lo = mid
        else:
            hi = mid
    return np.maximum(v - 0.5 * (lo + hi), 0)


def np_term(losses, n, t):
    """TERM: w_k = n_k exp(t F_k) / sum_j n_j exp(t F_j)."""
    e = np.asarray(n, np.float64) * np.exp(t * np.asarray(losses, np.float64))
    return e / e.sum()


def np_propfair(losses, n, m, eps):
    """PropFair: w_k = (n_k / max(M - F_k, eps)) / sum_j (...)."""
    s = np.asarray(n, np.float64) / np.maximum(m - np.asarray(losses, np.float64), eps)
    return s / s.sum()


def np_qffl_mixing(losses, n, q):
    """Thesis q-FFL: p_k = n_k F_k^q / sum_j n_j F_j^q."""
    s = np.asarray(n, np.float64) * np.asarray(losses, np.float64) ** q
    return s / s.sum()


def np_qfedavg(losses, deltas, q, lipschitz):
    """Li et al. 2020, Algorithm 2, literally (uniform sampling):
    Delta w_k = L (w^t - w_k); Delta_k = F_k^q Delta w_k;
    h_k = q F_k^{q-1} ||Delta w_k||^2 + L F_k^q;  w^t - w^{t+1} = sum Delta_k / sum h_k."""
    losses = np.asarray(losses, np.float64)
    dw = lipschitz * np.asarray(deltas, np.float64)  # [K, d]
    num = sum(f ** q * d for f, d in zip(losses, dw))
    h = sum(q * f ** (q - 1) * np.sum(d ** 2) + lipschitz * f ** q for f, d in zip(losses, dw))
    return num / h


def np_fedmax(losses):
    losses = np.asarray(losses, np.float64)
    sel = (losses == losses.max()).astype(np.float64)
    return sel / sel.sum()


def np_fedmax_k(losses, k):
    """Uniform over the k largest losses; ties by lower index (Python sort)."""
    order = sorted(range(len(losses)), key=lambda i: (-losses[i], i))[:k]
    w = np.zeros(len(losses))
    w[order] = 1.0 / k
    return w


def np_afl(lambdas, losses, ids, mask, lr):
    """lambda <- Proj(lambda + lr (N / m) F scattered at the participating ids)."""
    lambdas = np.asarray(lambdas, np.float64)
    g = np.zeros_like(lambdas)
    m = int(np.sum(mask))
    for i, f, a in zip(ids, losses, mask):
        if a:
            g[i] += len(lambdas) / m * f
    return np_project_simplex(lambdas + lr * g)


# --------------------------------------------------------------------- simplex helpers


_PROJECT = jax.jit(project_simplex, static_argnames="radius")
_PROJECT_MASKED = jax.jit(project_simplex_masked, static_argnames="radius")


def test_project_simplex_matches_bisection_reference(rng):
    for k in (1, 5, 17):
        for scale in (0.01, 1.0, 100.0):
            for _ in range(5):
                v = (rng.normal(size=k) * scale).astype(np.float32)
                p = np.asarray(_PROJECT(v))
                np.testing.assert_allclose(p, np_project_simplex(v), atol=2e-6 * max(1, scale))
                assert p.min() >= 0 and abs(p.sum() - 1) < 1e-5


def test_project_simplex_properties(rng):
    # A point of the simplex is its own projection; shifting v by c changes nothing.
    p = rng.dirichlet(np.ones(5)).astype(np.float32)
    np.testing.assert_allclose(_PROJECT(p), p, atol=1e-6)
    v = rng.normal(size=5).astype(np.float32)
    np.testing.assert_allclose(_PROJECT(v + 3.0), _PROJECT(v), atol=1e-6)
    np.testing.assert_allclose(_PROJECT(np.zeros(5, np.float32)), np.full(5, 0.2))
    np.testing.assert_allclose(_PROJECT(np.array([5.0, 0, -1, 0, 0], np.float32)), [1, 0, 0, 0, 0])
    np.testing.assert_allclose(_PROJECT(v, radius=2.0), np_project_simplex(v, 2.0), atol=1e-5)
    # vmap over a batch of vectors.
    batch = rng.normal(size=(8, 5)).astype(np.float32)
    out = jax.jit(jax.vmap(project_simplex))(batch)
    for row, ref in zip(np.asarray(out), batch):
        np.testing.assert_allclose(row, np_project_simplex(ref), atol=1e-6)


def test_project_simplex_masked_projects_only_the_masked_coordinates(rng):
    v = rng.normal(size=5).astype(np.float32)
    mask = np.array([1, 0, 1, 1, 0], bool)
    p = np.asarray(_PROJECT_MASKED(v, mask))
    np.testing.assert_array_equal(p[~mask], 0.0)
    np.testing.assert_allclose(p[mask], np_project_simplex(v[mask]), atol=1e-6)
    # Masked-out values, even inf / NaN, do not matter.
    w = v.copy()
    w[~mask] = [np.inf, np.nan]
    np.testing.assert_array_equal(_PROJECT_MASKED(w, mask), p)
    np.testing.assert_array_equal(_PROJECT_MASKED(v, np.zeros(5, bool)), 0.0)
    # (radius is no longer validated here: the low-level solver may get traced values,
    # and no Python-facing builder takes a radius.)


def test_masked_softmax_is_stable_and_handles_empty_support():
    z = jnp.array([1e4, 1e4 - 1.0, -1e4, 3.0])
    w = np.asarray(masked_softmax(z, jnp.array([True, True, True, False])))
    e = np.exp([0.0, -1.0])
    np.testing.assert_allclose(w, [e[0] / e.sum(), e[1] / e.sum(), 0.0, 0.0], rtol=1e-6)
    w = masked_softmax(jnp.array([-jnp.inf, -jnp.inf, 2.0]), jnp.array([True, True, False]))
    np.testing.assert_allclose(w, [0.5, 0.5, 0.0])  # no finite logit: uniform over the mask
    np.testing.assert_array_equal(masked_softmax(jnp.zeros(3), jnp.zeros(3, bool)), 0.0)


def test_exponentiated_gradient_unifies_the_rules(rng):
    """Unification (AAggFF thesis, Remark 3.1 and appendix §8.1): EG with prior n / sum n reproduces FedAvg (r = 0), q-FFL
    (r = q log F, zeta = 1), TERM (r = F, zeta = 1 / lambda) and PropFair
    (r = -log(M - F), zeta = 1) to 1e-6 after normalisation."""
    mask = jnp.ones(6, bool)
    for _ in range(5):
        f = rng.uniform(0.05, 1.9, size=6)
        n = rng.integers(1, 50, size=6).astype(np.float64)
        fj, nj = jnp.asarray(f, jnp.float32), jnp.asarray(n, jnp.float32)
        q, lam, m = 2.0, 3.0, 2.0
        cases = [(jnp.zeros(6), 1.0, n / n.sum()),
                 (q * jnp.log(fj), 1.0, np_qffl_mixing(f, n, q)),
                 (fj, 1.0 / lam, np_term(f, n, lam)),
                 (-jnp.log(m - fj), 1.0, np_propfair(f, n, m, 1e-9))]
        for r, zeta, ref in cases:
            np.testing.assert_allclose(exponentiated_gradient(r, nj, mask, zeta), ref,
                                       rtol=1e-5, atol=1e-6)
    # (zeta is no longer validated here: the low-level step may get traced values, and
    # no Python-facing builder takes a zeta; the rules check their own arguments.)


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


# --------------------------------------------------------------------------- TERM


def test_term_matches_reference_and_reduces_to_fedavg(rng):
    for _ in range(5):
        f = rng.uniform(0, 3, size=K).astype(np.float32)
        n = rng.integers(1, 40, size=K)
        for t in (0.1, 1.0, 5.0, -2.0):
            w, _ = _weights(term_mixing(t), f, n)
            np.testing.assert_allclose(w, np_term(f, n, t), rtol=1e-5)
            w, _ = _weights(term_mixing(t, weight_by_size=False), f, n)
            np.testing.assert_allclose(w, np_term(f, np.ones(K), t), rtol=1e-5)
        # t -> 0: FedAvg's data weights (exact at t = 0).
        w, _ = _weights(term_mixing(1e-8), f, n)
        np.testing.assert_allclose(w, n / n.sum(), rtol=1e-6)
        w, _ = _weights(term_mixing(0.0), f, n)
        fedavg_w, _ = _weights(by_num_examples(), f, n)
        np.testing.assert_allclose(w, fedavg_w, rtol=1e-6)
    # Shift invariance and log-sum-exp stability at huge tilts / losses.
    f = np.array([1e3, 999.0, 5.0], np.float32)
    w = np.asarray(term_weights(f, np.ones(3), jnp.ones(3, bool), 50.0))
    np.testing.assert_allclose(w, [1 / (1 + np.exp(-50.0)), np.exp(-50.0) / (1 + np.exp(-50.0)),
                                   0.0], rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(term_weights(f + 7.0, np.ones(3), jnp.ones(3, bool), 0.5),
                               term_weights(f, np.ones(3), jnp.ones(3, bool), 0.5), rtol=1e-5)


# ----------------------------------------------------------------------- PropFair


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


# ---------------------------------------------------------------------------- q-FFL


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


# ------------------------------------------------------------------------------ AFL


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


# --------------------------------------------------------- FedMax / FedMax(k) / FedSoftMax


def test_fedmax_family_matches_reference(rng):
    for _ in range(10):
        f = rng.uniform(0, 3, size=K).astype(np.float32)
        n = rng.integers(1, 40, size=K)
        mask = jnp.ones(K, bool)
        np.testing.assert_allclose(fedmax_weights(f, mask), np_fedmax(f))
        for k in (1, 2, 4, K):
            w = np.asarray(fedmax_k_weights(f, mask, k))
            np.testing.assert_allclose(w, np_fedmax_k(f, k), rtol=1e-7)
            assert np.sum(w > 0) == k and np.all(w[w > 0] == np.float32(1 / k))
        for beta in (0.0, 5.0, 30.0):
            p = n * np.exp(beta * (f.astype(np.float64) - f.max()))
            np.testing.assert_allclose(fedsoftmax_weights(f, n, mask, beta), p / p.sum(),
                                       rtol=2e-5, atol=1e-30)
    # Ties: FedMax shares, FedMax(k) takes the lower row.
    f = np.array([1.0, 3.0, 2.0, 3.0], np.float32)
    np.testing.assert_allclose(fedmax_weights(f, jnp.ones(4, bool)), [0, 0.5, 0, 0.5])
    np.testing.assert_allclose(fedmax_k_weights(f, jnp.ones(4, bool), 1), [0, 1, 0, 0])
    np.testing.assert_allclose(fedmax_k_weights(f, jnp.ones(4, bool), 3), [0, 1 / 3, 1 / 3, 1 / 3])


def test_fedmax_limits_and_reductions():
    """FedSoftMax (arXiv:2307.06283): beta = 0 and equal losses give FedAvg;
    a common shift changes nothing; beta = 1e4 with gaps >= 0.01 equals FedMax;
    FedMax(1) = FedMax; FedMax(M) = uniform."""
    mask = jnp.ones(6, bool)
    n = np.array([3, 9, 4, 1, 7, 5])
    gaps = np.array([0.31, 0.52, 0.12, 0.53, 0.41, 0.05], np.float32)
    np.testing.assert_allclose(fedsoftmax_weights(gaps, n, mask, 0.0), n / n.sum(), rtol=1e-6)
    np.testing.assert_allclose(fedsoftmax_weights(gaps, n, mask, 1e4), np_fedmax(gaps),
                               atol=1e-6)
    np.testing.assert_allclose(fedsoftmax_weights(gaps + 4.0, n, mask, 5.0),
                               fedsoftmax_weights(gaps, n, mask, 5.0), rtol=1e-5)
    np.testing.assert_allclose(fedmax_k_weights(gaps, mask, 1), fedmax_weights(gaps, mask))
    np.testing.assert_allclose(fedmax_k_weights(gaps, mask, 6), np.full(6, 1 / 6), rtol=1e-6)
    np.testing.assert_allclose(fedmax_k_weights(gaps, mask, 0.5), [0, 1 / 3, 0, 1 / 3, 1 / 3, 0],
                               rtol=1e-6)  # floor(0.5 * 6) = 3 largest gaps


def test_fedmax_k_fraction_counts_only_active_rows():
    assert int(effective_k(0.1, 10)) == 1 and int(effective_k(0.25, 10)) == 2
    assert int(effective_k(0.1, 3)) == 1 and int(effective_k(5, 3)) == 3
    assert int(effective_k(2.0, 10)) == 2
    f = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2], np.float32)
    mask = np.array([False, True, True, True, True, False, False, False])
    w = np.asarray(jax.jit(lambda f, m: fedmax_k_weights(f, m, 0.5))(f, mask))
    np.testing.assert_allclose(w, [0, 0.5, 0.5, 0, 0, 0, 0, 0])  # floor(0.5 * 4) = 2
    with pytest.raises(ValueError, match=r"^k: "):
        fedmax_k_mixing(0.0)
    with pytest.raises(ValueError, match=r"^k: "):
        fedmax_k_mixing(2.5)


def test_skew_is_monotone_in_beta():
    """Skew (arXiv:2307.06283, Section 1.3): heterogeneous 1-D quadratics
    F_i(w) = a_i (w - c_i)^2 / 2 (F_i* = 0): rho(FedAvg) = 1,
    rho(FedMax) = max gap / sum p gap, and rho(FedSoftMax(beta)) is non-decreasing in
    beta and lies between the two."""
    a = np.array([1.0, 2.0, 0.5, 3.0, 1.5])
    c = np.array([-1.0, 0.5, 2.0, 1.0, -0.3])
    n = np.array([10, 20, 5, 8, 12])
    p = n / n.sum()
    mask = jnp.ones(5, bool)
    for w in (-0.5, 0.3, 1.7):
        gap = (a * (w - c) ** 2 / 2).astype(np.float32)
        rho = lambda alpha: float(np.dot(alpha, gap) / np.dot(p, gap))
        assert rho(np.asarray(fedsoftmax_weights(gap, n, mask, 0.0))) == pytest.approx(1.0, 1e-6)
        rho_max = rho(np.asarray(fedmax_weights(gap, mask)))
        assert rho_max == pytest.approx(gap.max() / np.dot(p, gap), rel=1e-6) and rho_max >= 1
        rhos = [rho(np.asarray(fedsoftmax_weights(gap, n, mask, b)))
                for b in np.linspace(0, 40, 41)]
        assert np.all(np.diff(rhos) >= -1e-6)
        assert 1 - 1e-6 <= min(rhos) and max(rhos) <= rho_max + 1e-5


# ----------------------------------------------------------------- arguments, registry


def test_invalid_arguments_name_their_field():
    model = helpers.logreg()
    with pytest.raises(ValueError, match=r"^q: "):
        qffl(model, q=-1.0)
    with pytest.raises(ValueError, match=r"^mode: "):
        qffl(model, mode="newton")
    with pytest.raises(ValueError, match=r"^lipschitz: "):
        qffl(model, lipschitz=0.0)
    with pytest.raises(ValueError, match=r"^lipschitz: "):
        qffl(model, mode="mixing", lipschitz=3.0)
    with pytest.raises(ValueError, match=r"^client_lr: "):
        qffl(model, client_lr=0.0)
    with pytest.raises(ValueError, match=r"^weight_by_size: "):
        qffl(model, weight_by_size="false")
    with pytest.raises(ValueError, match=r"^lambda_lr: "):
        afl(model, lambda_lr=-0.1)
    with pytest.raises(ValueError, match=r"^tilt: "):
        term(model, tilt=float("inf"))
    with pytest.raises(ValueError, match=r"^beta: "):
        fedsoftmax(model, beta=float("nan"))
    with pytest.raises(ValueError, match=r"^k: "):
        fedmax_k(model, k=-1)
    # Loss-driven rules always track the pre-round loss: loss tracking cannot be
    # switched off (no factory takes a track_loss argument any more).
    for name, factory in (("qffl", qffl), ("afl", afl), ("term", term), ("propfair", propfair),
                          ("fedmax", fedmax), ("fedmax_k", fedmax_k),
                          ("fedsoftmax", fedsoftmax)):
        assert "track_loss" not in method_hparams(name), name
        with pytest.raises(TypeError, match="track_loss"):
            factory(model, track_loss=False)


def test_factories_state_fedavg_arguments_for_the_cli():
    """Every registered method's signature states FedAvg's local-training arguments
    (with FedAvg's ranges) and takes no **kwargs; the fair rules' own
    hyper-parameters are settable from the command line."""
    expected = {"qffl": {"q", "mode", "lipschitz"}, "afl": {"lambda_lr"},
                "term": {"tilt", "weight_by_size"}, "propfair": {"baseline", "eps"},
                "fedmax": set(), "fedmax_k": {"k"}, "fedsoftmax": {"beta", "weight_by_size"}}
    for name, method in REGISTRY.items():
        params = inspect.signature(method.factory).parameters.values()
        assert not any(p.kind is p.VAR_KEYWORD for p in params), name
        hparams = method_hparams(name)
        for arg, value_range in CLIENT_HPARAMS.items():
            if name == "fedevg" and arg in ("max_steps", "clip_norm"):
                # FedEvg counts its local work in local_iters (Algorithm 4.2 of the thesis counts iterations) and
                # clips its gradients with its own grad_clip / max_grad_norm
                continue
            assert arg in hparams, (name, arg)
            assert hparams[arg].range == value_range, (name, arg)
    for name, own in expected.items():
        assert own <= set(config_lib.algorithm_hparams(name)), name
        assert own | {"client_lr", "batch_size", "num_epochs"} <= set(method_hparams(name)), name


# ------------------------------------------------------------------- whole rounds
# One skewed federation with the shapes of helpers.tiny_federation (6 clients,
# M = 12, 10 features, 3 classes): clients 0-3 (12 examples) are labelled by a
# linear teacher, client 4 (4 examples) by the opposite teacher, client 5 is
# empty. No linear model fits both groups and FedAvg's data weights favour the
# majority. Clients train full-batch (B = 12 >= n_k), so NumPy gradient descent
# reproduces every local model. Each algorithm is compiled once (one round) and
# reused by every test below.

MODEL = helpers.logreg()
LR, EPOCHS = 0.3, 2
KW = dict(client_lr=LR, batch_size=12, num_epochs=EPOCHS)
KEY = jax.random.key(7)
ALL_IDS = tuple(range(6))


def _skewed_train(seed=0, sizes=(12, 12, 12, 12, 4, 0)):
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(helpers.NUM_FEATURES, helpers.NUM_CLASSES))
    arrays = []
    for k, n in enumerate(sizes):
        x = rng.normal(size=(n, helpers.NUM_FEATURES)).astype(np.float32)
        arrays.append((x, np.argmax(x @ (teacher if k < 4 else -teacher), -1).astype(np.int32)))
    return helpers.pack(arrays)


TRAIN = _skewed_train()
PARAMS = helpers.init_params(MODEL, 0)
FACTORIES = {
    "fedavg": lambda: fedavg(MODEL, **KW),
    "qffl0": lambda: qffl(MODEL, q=0.0, **KW),
    "qffl": lambda: qffl(MODEL, q=5.0, **KW),
    "term": lambda: term(MODEL, tilt=10.0, **KW),
    "afl": lambda: afl(MODEL, lambda_lr=1.0, **KW),
    # slow tests only
    "fedmax": lambda: fedmax(MODEL, loss_source="pre_round", **KW),
    "fedsoftmax": lambda: fedsoftmax(MODEL, beta=10.0, loss_source="pre_round", **KW),
    "propfair": lambda: propfair(MODEL, baseline=2.0, **KW),
    "agg_mean": lambda: fedavg(MODEL, aggregator=weighted_mean(), **KW),
}


@functools.cache
def _compiled(name):
    alg = helpers.bind_execution(FACTORIES[name](), "sequential")
    return alg, jax.jit(alg.apply)


def _rounds(name, num_rounds=1, ids=ALL_IDS, mask=None):
    """(state, metrics of the last round) after ``num_rounds`` rounds from PARAMS."""
    alg, apply = _compiled(name)
    state, cohort = alg.init(PARAMS, 6), helpers.cohort(TRAIN, ids, mask=mask)
    for r in range(num_rounds):
        state, metrics = apply(state, cohort, jax.random.fold_in(KEY, r))
    return state, metrics


@functools.cache
def _np_clients():
    """Per client with data: (flat delta theta^t - theta_k, F_k(theta^t)) in float64."""
    w0, b0 = helpers.logreg_to_numpy(PARAMS)
    out = {}
    for k in range(6):
        x, y = helpers.real_rows(TRAIN, [k])
        if not len(y):
            continue
        logits = x.astype(np.float64) @ w0 + b0
        logits -= logits.max(-1, keepdims=True)
        loss = np.mean(np.log(np.exp(logits).sum(-1)) - logits[np.arange(len(y)), y])
        w, b = helpers.logreg_gd_numpy(PARAMS, x, y, LR, EPOCHS)
        out[k] = (np.concatenate([(w0 - w).ravel(), b0 - b]), loss)
    return out


def _assert_step(params, step, rtol=1e-5, atol=1e-6):
    """params == PARAMS - step (flat [W, b])."""
    w0, b0 = helpers.logreg_to_numpy(PARAMS)
    w, b = helpers.logreg_to_numpy(params)
    np.testing.assert_allclose(w, w0 - step[:w0.size].reshape(w0.shape), rtol=rtol, atol=atol)
    np.testing.assert_allclose(b, b0 - step[w0.size:], rtol=rtol, atol=atol)


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
                     client_lr=LR, batch_size=16, num_epochs=EPOCHS), "sequential")
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
            propfair(MODEL, baseline=m, mode="client", client_lr=LR, batch_size=12,
                     num_epochs=EPOCHS), "sequential")
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


@pytest.mark.slow
def test_fedmax_round_returns_the_worst_clients_model():
    """One-hot weights on j give theta' = theta_j (the aggregation of AAggFF thesis eq. 3.13)."""
    state, metrics = _rounds("fedmax")
    losses = np.asarray(metrics["loss_before"])
    j = int(np.argmax(losses))
    np.testing.assert_allclose(metrics["weights"], np_fedmax(losses))
    _assert_step(state.params, _np_clients()[j][0])


@pytest.mark.slow
def test_fedavg_with_the_weighted_mean_aggregator_equals_fedavg():
    ref, _ = _rounds("fedavg")
    state, _ = _rounds("agg_mean")
    helpers.assert_trees_close(state.params, ref.params, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_other_loss_driven_rules_lower_the_worst_client_loss():
    client_losses = jax.jit(jax.vmap(lambda p, d: data_loss(MODEL, p, d), in_axes=(None, 0)))
    worst = {}
    for name in ("fedavg", "fedmax", "fedsoftmax", "propfair"):
        state, _ = _rounds(name, num_rounds=20)
        worst[name] = np.asarray(client_losses(state.params, TRAIN))[:5].max()
    for name in ("fedmax", "fedsoftmax", "propfair"):
        assert worst[name] < 0.9 * worst["fedavg"], (name, worst)


def test_fedmax_family_reads_the_chosen_loss_statistic():
    """The default reads the paper's F_i(theta^t), the server model's pre-round loss
    (loss_before); "last_epoch" the authors' code's last-epoch running loss
    (train_loss)."""
    out = _out([0.1, 0.9, 0.5])._replace(train_loss=jnp.array([0.8, 0.2, 0.1]))
    ctx = _full_ctx(3)
    for rule, last_top, pre_top in ((fedmax_mixing, 0, 1),
                                    (lambda **kw: fedsoftmax_mixing(50.0, **kw), 0, 1),
                                    (lambda **kw: fedmax_k_mixing(1, **kw), 0, 1)):
        w_default, _ = rule().update(rule().init(3), out, ctx)
        w_last, _ = rule(loss_source="last_epoch").update((), out, ctx)
        assert int(jnp.argmax(w_default)) == pre_top
        assert int(jnp.argmax(w_last)) == last_top
    with pytest.raises(ValueError, match="^loss_source"):
        fedmax_mixing(loss_source="post_round")
