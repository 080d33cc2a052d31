"""AAggFF-S / AAggFF-D mixing weights (Hahn, UNIST 2024 thesis, Ch. III;
arXiv:2405.20821): the response transforms (CDFs), the online solvers (simplex QP,
generalized projection, entropic FTRL), AAggFF-S's ONS and AAggFF-D's FTRL with the
doubly robust estimator, against literal NumPy float64 references
(tests/aaggff_common.py), the regret guarantees and a Monte-Carlo check of the
estimator. The rules' shared properties, end-to-end rounds and the API:
tests/test_aaggff.py."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_fair.solvers import online
from fedjax_fair.algorithms import aaggff as ag
from fedjax_fair.solvers.simplex import project_simplex
from aaggff_common import (ctx_of, np_ftrl_run, np_ons_run, np_project_simplex, np_qp_exact,
                           np_responses, outputs_of, run_rule)


# ------------------------------------------------------------------ response transforms


TABLE_3_3 = {"weibull": (0.05, 1.00, 0.19), "frechet": (0.01, 0.65, 0.11),
             "gumbel": (0.12, 0.76, 0.18), "exponential": (0.21, 0.90, 0.37),
             "logistic": (0.32, 0.79, 0.37), "normal": (0.22, 0.90, 0.29)}


def test_cdf_table_and_properties():
    f = np.array([0.01, 0.10, 0.02])
    losses = np.random.default_rng(0).gamma(2.0, 1.0, 9)

    @functools.partial(jax.jit, static_argnums=0)
    def responses(cdf, f, losses):
        return (ag.transform_responses(f, jnp.ones(3, bool), cdf),
                ag.transform_responses(losses, jnp.ones(9, bool), cdf, 0.1, 0.3),
                ag.transform_responses(7.5 * losses, jnp.ones(9, bool), cdf, 0.1, 0.3),
                ag.transform_responses(jnp.zeros(9), jnp.ones(9, bool), cdf, 0.0, 0.5))

    for name in ag.CDF_IDS:
        r, rr, scaled, zero = (np.asarray(x) for x in responses(name, f, losses))
        np.testing.assert_allclose(r, TABLE_3_3[name], atol=0.0101)
        np.testing.assert_allclose(r, np_responses(f, name, 0.0, 1.0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(rr, np_responses(losses, name, 0.1, 0.3), rtol=1e-5)
        assert rr.min() >= 0.1 and rr.max() <= 0.3
        assert np.all(np.diff(rr[np.argsort(losses)]) > 0)  # increasing in F_i
        np.testing.assert_allclose(scaled, rr, rtol=1e-5)  # invariant to scaling F
        # Degenerate inputs stay finite and in range (Fbar = 0, Frechet at 0).
        assert np.all(np.isfinite(zero)) and zero.min() >= 0 and zero.max() <= 0.5
        # The reference code's integer id selects the same CDF.
        assert ag.get_cdf(ag.CDF_IDS.index(name)) is ag.CDFS[name]


def test_transform_ignores_masked_rows():
    f = jnp.array([0.01, 0.10, 1e6, 0.02])
    mask = jnp.array([True, True, False, True])
    r = np.asarray(ag.transform_responses(f, mask, "gumbel"))
    np.testing.assert_allclose(r[[0, 1, 3]], np_responses([0.01, 0.10, 0.02], "gumbel", 0, 1),
                               rtol=1e-5)
    assert r[2] == 0.0


# The authors' code (src/server/aaggffserver.py, ``fair_const`` ids 0-5) on
# F = (0.01, 0.10, 0.02), x = F / mean(F) = (3/13, 30/13, 6/13), before scaling to
# [C1, C2]; computed by hand from its formulas in plain Python (math.exp, math.erfc):
#   0: 1 - exp(-x^2)   1: 1 - exp(-x)   2: exp(-1/x)   3: (1 + erfc((x - 1) / sqrt 2)) / 2
#   4: exp(-exp(-(x - 1)))   5: 1 / (1 + exp(-(x - 1))).
REFERENCE_CODE_RESPONSES = {
    0: (0.051861261, 0.995133809, 0.191858209),
    1: (0.206077342, 0.900509420, 0.369686813),
    2: (0.013123729, 0.648344341, 0.114558844),
    3: (1.279121836, 0.595488847, 1.204870774),
    4: (0.115543808, 0.763041059, 0.180257502),
    5: (0.316645530, 0.787126739, 0.368545540),
}


def np_reference_code_transform(fair_const, losses):
    """The authors' response transform of id ``fair_const`` in plain Python floats."""
    mean = sum(losses) / len(losses)
    fn = {0: lambda v: 1 - math.exp(-v ** 2), 1: lambda v: 1 - math.exp(-v),
          2: lambda v: math.exp(-1 / v),
          3: lambda v: 0.5 * (1 + math.erfc((v - 1) / 2 ** 0.5)),
          4: lambda v: math.exp(-math.exp(-(v - 1))),
          5: lambda v: 1 / (1 + math.exp(-(v - 1)))}[fair_const]
    return [fn(f / mean) for f in losses]


def test_reference_variant_reproduces_the_authors_transform_ids():
    f = [0.01, 0.10, 0.02]
    losses = [float(v) for v in np.random.default_rng(3).gamma(2.0, 1.0, 7)]
    mask3, mask7 = jnp.ones(3, bool), jnp.ones(7, bool)
    for fair_const, expected in REFERENCE_CODE_RESPONSES.items():
        np.testing.assert_allclose(np_reference_code_transform(fair_const, f), expected,
                                   atol=1e-9)
        r = ag.transform_responses(jnp.asarray(f), mask3, fair_const, variant="reference")
        np.testing.assert_allclose(r, expected, rtol=1e-6, atol=1e-7)
        # The authors scale by 1/K at C = 1 and by C otherwise: C1 = 0, C2 = 1/K or C.
        r = ag.transform_responses(jnp.asarray(f), mask3, fair_const, 0.0, 1.0 / 3,
                                   variant="reference")
        np.testing.assert_allclose(r, np.asarray(expected) / 3, rtol=1e-6, atol=1e-7)
        r = ag.transform_responses(jnp.asarray(losses), mask7, fair_const, 0.0, 0.05,
                                   variant="reference")
        np.testing.assert_allclose(r, 0.05 * np.asarray(
            np_reference_code_transform(fair_const, losses)), rtol=1e-5, atol=1e-8)
        # Ids other than 3 compute the thesis CDFs; names and ids select the same.
        name = ag.CDF_IDS[fair_const]
        thesis = ag.transform_responses(jnp.asarray(losses), mask7, name)
        reference = ag.transform_responses(jnp.asarray(losses), mask7, name,
                                           variant="reference")
        if name != "normal":
            np.testing.assert_array_equal(reference, thesis)


def test_thesis_and_reference_normal_transforms_differ():
    """Thesis: Phi(x - 1), increasing in F_i, in [C1, C2]. Authors' code:
    1.5 - Phi(x - 1), decreasing, in C1 + (C2 - C1) (0.5, 1.35). They agree only where
    Phi(x - 1) = 3/4."""
    f = jnp.asarray([0.2, 0.5, 1.0, 1.5, 3.0, 1.8])  # mean 1.333...
    mask = jnp.ones(6, bool)
    thesis = np.asarray(ag.transform_responses(f, mask, "normal", 0.1, 0.3))
    reference = np.asarray(ag.transform_responses(f, mask, 3, 0.1, 0.3, variant="reference"))
    np.testing.assert_allclose(thesis, np_responses(f, "normal", 0.1, 0.3), rtol=1e-5)
    # r_ref - C1 = (C2 - C1) (1.5 - Phi) = 1.5 (C2 - C1) - (r_thesis - C1).
    np.testing.assert_allclose(reference, 0.1 + 1.5 * 0.2 - (thesis - 0.1), rtol=1e-5)
    assert np.all(np.diff(thesis[np.argsort(f)]) > 0)
    assert np.all(np.diff(reference[np.argsort(f)]) < 0)
    assert reference.max() > 0.3 and reference.min() > 0.1 + 0.5 * 0.2
    assert np.abs(thesis - reference).min() > 0.01
    # Equal losses (x = 1): 1/2 in the thesis, 1 in the authors' code.
    equal = jnp.full(4, 0.7)
    for variant, value in (("thesis", 0.5), ("reference", 1.0)):
        np.testing.assert_allclose(
            ag.transform_responses(equal, jnp.ones(4, bool), "normal", variant=variant),
            value, rtol=1e-6)
    # x = 1 + Phi^-1(3/4) = 1.6744898 (and 2 - x for the other client): equal at the
    # first client only.
    x = 1.0 + 0.6744897501960817
    pair = jnp.asarray([x, 2.0 - x])
    t, r = (np.asarray(ag.transform_responses(pair, jnp.ones(2, bool), "normal",
                                              variant=v)) for v in ag.VARIANTS)
    np.testing.assert_allclose([t[0], r[0]], 0.75, rtol=1e-5)
    assert abs(t[1] - r[1]) > 0.4
    with pytest.raises(ValueError, match=r"^variant: "):
        ag.get_transform("normal", "authors")


def test_reference_rules_use_the_authors_normal_transform():
    """One round of each mixing rule with ``variant="reference"`` and id 3 equals the
    literal reference update fed with the authors' responses (hand-written above)."""
    f = np.array([[0.01, 0.10, 0.02]])
    w, dec, _ = run_rule(ag.aaggff_s_mixing(cdf=3, variant="reference"), 3, f)
    resp = np.asarray(REFERENCE_CODE_RESPONSES[3])[None] / 3  # C2 = 1/K
    ref = np_ons_run(resp, *ag.ons_defaults(3), "reference")
    np.testing.assert_allclose(dec, ref, atol=2e-5)
    thesis_resp = np_responses(f[0], "normal", 0.0, 1.0 / 3)[None]
    assert np.abs(ref - np_ons_run(thesis_resp, *ag.ons_defaults(3), "reference")).max() > 1e-3
    # AAggFF-D: 3 of 6 clients (C = 1/2 = C2).
    ids = np.array([[1, 3, 4]])
    w, dec, _ = run_rule(ag.aaggff_d_mixing(cdf="normal", variant="reference"), 6, f, ids=ids)
    ref = np_ftrl_run([(ids[0], 0.5 * np.asarray(REFERENCE_CODE_RESPONSES[3]))], 6, "reference")
    np.testing.assert_allclose(dec, ref, atol=1e-6)
    # The authors' id 3 gives the LOWEST weight to the highest loss (client 3).
    assert dec[0, 3] < dec[0, [1, 4]].min()
    w_thesis, dec_thesis, _ = run_rule(ag.aaggff_d_mixing(cdf="normal"), 6, f, ids=ids)
    assert dec_thesis[0, 3] > dec_thesis[0, [1, 4]].max()


# ------------------------------------------------------------------ online solvers


def test_simplex_projection_matches_numpy():
    # online.py projects with solvers.simplex.project_simplex (its private copy is gone).
    assert online.project_simplex is project_simplex
    rng = np.random.default_rng(1)
    v = rng.normal(size=(20, 9)) * rng.choice([0.1, 1.0, 10.0], size=(20, 1))
    p = np.asarray(jax.jit(jax.vmap(project_simplex))(jnp.asarray(v, jnp.float32)))
    np.testing.assert_allclose(p, np.stack([np_project_simplex(x) for x in v]), atol=2e-6)


def _random_spd(rng, k, alpha):
    g = rng.normal(size=(k + 3, k))
    return alpha * np.eye(k) + g.T @ g / k


@functools.cache
def _batched_qp():
    return jax.jit(jax.vmap(lambda B, b, mu: online.simplex_qp(B, b, strong_convexity=mu,
                                                               num_iters=500)))


def test_simplex_qp_kkt_and_exact_reference():
    rng = np.random.default_rng(2)
    k, n = 6, 12
    alpha = 0.5
    Bs = np.stack([_random_spd(rng, k, alpha) for _ in range(n)])
    bs = rng.normal(size=(n, k)) * 2.0
    mus = np.full(n, alpha)
    mus[::2] = 0.0  # also the FISTA-with-restart path (unknown strong convexity)
    ps = np.asarray(_batched_qp()(jnp.asarray(Bs, jnp.float32), jnp.asarray(bs, jnp.float32),
                                  jnp.asarray(mus, jnp.float32)))
    for B, b, p in zip(Bs, bs, ps):
        assert p.min() >= 0 and abs(p.sum() - 1) <= 1e-5
        h = B @ p + b
        on = p > 1e-7
        assert h[on].max() - h[on].min() <= 1e-5
        assert np.all(h[~on] - h[on].mean() >= -1e-5)
        np.testing.assert_allclose(p, np_qp_exact(B, b), atol=1e-5)
        assert float(online.simplex_qp_kkt_residual(jnp.asarray(B, jnp.float32),
                                                    jnp.asarray(b, jnp.float32),
                                                    jnp.asarray(p))) <= 1e-5


def test_generalized_projection_kkt_residual():
    rng = np.random.default_rng(3)
    fn = jax.jit(online.generalized_projection)
    for _ in range(5):
        k = 7
        A = _random_spd(rng, k, 0.2)
        y = rng.normal(size=k)
        x = fn(jnp.asarray(A, jnp.float32), jnp.asarray(y, jnp.float32))
        res = float(online.projection_kkt_residual(jnp.asarray(A, jnp.float32),
                                                   jnp.asarray(y, jnp.float32), x))
        assert res <= 1e-5
        np.testing.assert_allclose(np.asarray(x), np_qp_exact(A, -A @ y), atol=1e-5)
        # The residual detects a wrong answer: the Euclidean projection is not the
        # A-norm projection for a non-isotropic A.
        wrong = jnp.asarray(np_project_simplex(y), jnp.float32)
        assert float(online.projection_kkt_residual(jnp.asarray(A, jnp.float32),
                                                    jnp.asarray(y, jnp.float32), wrong)) > 1e-3


def test_diagonal_water_filling_equals_qp():
    rng = np.random.default_rng(4)
    d = rng.uniform(0.2, 3.0, size=(12, 6))
    b = rng.normal(size=(12, 6))
    dj, bj = jnp.asarray(d, jnp.float32), jnp.asarray(b, jnp.float32)
    p = np.asarray(jax.jit(jax.vmap(online.diagonal_simplex_qp))(dj, bj))
    q = np.asarray(_batched_qp()(jax.vmap(jnp.diag)(dj), bj, jnp.asarray(d.min(1), jnp.float32)))
    np.testing.assert_allclose(p, q, atol=1e-5)
    for di, bi, pi in zip(d, b, p):
        np.testing.assert_allclose(pi, np_qp_exact(np.diag(di), bi), atol=1e-5)
    v = rng.normal(size=(12, 6))
    np.testing.assert_allclose(
        np.asarray(jax.jit(jax.vmap(online.diagonal_simplex_qp))(jnp.ones((12, 6)),
                                                                 -jnp.asarray(v, jnp.float32))),
        np.stack([np_project_simplex(x) for x in v]), atol=1e-6)


def test_entropic_ftrl_optimality():
    s = jnp.asarray(np.random.default_rng(5).normal(size=10) * 50, jnp.float32)
    zeta = 3.0
    p = online.entropic_ftrl(s, zeta)
    stat = np.log(np.asarray(p, np.float64)) + np.asarray(s, np.float64) / zeta
    assert stat.max() - stat.min() <= 1e-4
    np.testing.assert_allclose(np.asarray(online.entropic_ftrl(s + 123.0, zeta)), np.asarray(p),
                               atol=1e-6)


# ------------------------------------------------------------------ AAggFF-S (ONS)


def test_reference_variant_changes_the_ons_objective():
    """The two objectives (thesis eq. 3.7 / reference code) really differ (the module matches each:
    test_rule_properties[s_thesis] / [s_reference])."""
    k, t_max = 7, 12
    resp = np.random.default_rng(7).uniform(0, 1.0 / k, size=(t_max, k))
    alpha, beta = ag.ons_defaults(k)
    thesis, reference = np_ons_run(resp, alpha, beta), np_ons_run(resp, alpha, beta, "reference")
    assert np.abs(thesis - reference).max() > 1e-3
    # The reference code's first gradient uses p^(1) = 1_K, not 1/K.
    g_ref = -resp[0] / (1 + resp[0].sum())
    g_thesis = -resp[0] / (1 + resp[0].mean())
    assert not np.allclose(g_ref, g_thesis)
    assert not np.allclose(np_ons_run(resp[:1], alpha, beta, "reference"),
                           np_qp_exact(alpha * (1 + beta) * np.eye(k)
                                       + beta * np.outer(g_thesis, g_thesis), g_thesis))


def test_ons_state_is_symmetric_psd_with_trace():
    k = 6
    resp = jnp.asarray(np.random.default_rng(8).uniform(0, 1.0 / k, size=(20, k)), jnp.float32)

    def body(state, r):
        g = ag.ons_gradient(state.decision, r)
        return ag.ons_step(state, r, alpha=4.0, beta=k / 4), jnp.vdot(g, g)

    state, sq = jax.jit(lambda r: jax.lax.scan(body, ag.ons_init(k), r))(resp)
    a = np.asarray(state.hessian, np.float64)
    np.testing.assert_allclose(a, a.T, atol=1e-7)
    assert np.linalg.eigvalsh(a).min() >= -1e-6
    np.testing.assert_allclose(np.trace(a), float(np.sum(sq)), rtol=1e-4)
    assert int(state.round) == 20


def test_beta_zero_is_ftrl_with_l2_regulariser():
    k = 6
    rng = np.random.default_rng(9)
    losses = rng.gamma(2.0, 1.0, size=(5, k))
    _, dec, _ = run_rule(ag.aaggff_s_mixing(beta=0.0, alpha=0.5), k, losses)
    p = np.full(k, 1.0 / k)
    total = np.zeros(k)
    for l, d in zip(losses, dec):
        r = np_responses(l, "normal", 0.0, 1.0 / k)
        total += -r / (1 + p @ r)
        p = np_project_simplex(-total / 0.5)  # lazy projected OGD
        np.testing.assert_allclose(d, p, atol=1e-5)


def _offline_best_losses(resp, horizons, iters=1500):
    """min_{p in simplex} sum_{t<=T} -log(1 + <p, r_t>) for every T in ``horizons``,
    from below: Cover's multiplicative updates (vectorised over the horizons), minus
    the Frank-Wolfe gap, an upper bound on the remaining suboptimality."""
    x = 1.0 + resp
    mask = (np.arange(len(resp))[None, :] < np.asarray(horizons)[:, None]).astype(np.float64)
    counts = mask.sum(1, keepdims=True)
    p = np.full((len(horizons), resp.shape[1]), 1.0 / resp.shape[1])
    for _ in range(iters):
        ratio = x[None] / (p @ x.T)[:, :, None]  # [H, T, K]
        p = p * np.einsum("ht,htk->hk", mask, ratio) / counts
    wealth = p @ x.T
    val = -(mask * np.log(wealth)).sum(1)
    grad = -np.einsum("ht,htk->hk", mask, x[None] / wealth[:, :, None])
    gap = (grad * p).sum(1) - grad.min(1)
    return dict(zip(horizons, val - gap))


@functools.cache
def _ons_decisions(k):
    """Jitted decision losses of AAggFF-S's ONS on response sequences [B, T, k]."""
    alpha, beta = ag.ons_defaults(k)

    def run(resp):
        def body(state, r):
            loss = ag.decision_loss(state.decision, r)
            return ag.ons_step(state, r, alpha=alpha, beta=beta), loss
        return jax.lax.scan(body, ag.ons_init(k), resp)[1]

    return jax.jit(jax.vmap(run))


def test_ons_regret_grows_logarithmically():
    k, t_max = 7, 1600
    lip = 1.0 / k
    rng = np.random.default_rng(10)
    stochastic = rng.uniform(0, 1, size=(t_max, k)) / k
    stochastic[:, 0] = rng.uniform(0.5, 1.0, size=t_max) / k
    block = np.zeros((t_max, k))
    for t in range(t_max):  # alternating blocks favouring client 0, then client 1
        block[t, (t // 50) % 2] = 1.0 / k
        block[t, 2:] = 0.3 / k
    horizons = (100, 200, 400, 800, 1600)
    all_losses = np.asarray(_ons_decisions(k)(jnp.asarray(np.stack([stochastic, block]),
                                                          jnp.float32)), np.float64)
    for name, resp, losses in (("stochastic", stochastic, all_losses[0]),
                               ("block", block, all_losses[1])):
        best = _offline_best_losses(resp, horizons)
        regret = {t: losses[:t].sum() - best[t] for t in horizons}
        for t in horizons:
            bound = 2 * lip * k * (1 + math.log(1 + t / (16 * k)))
            assert regret[t] <= bound, (name, t, regret[t], bound)
            assert regret[t] / math.log(t) <= 2 * lip * k, (name, t)
        for t in (100, 200):  # regret(8T) - regret(T) small relative to T
            assert regret[8 * t] - regret[t] <= 0.02 * t, (name, t)
        if name == "stochastic":
            assert regret[1600] / 1600 <= 0.25 * regret[100] / 100


# ------------------------------------------------------------------ AAggFF-D (FTRL + DR)


def test_dr_estimator_monte_carlo():
    k, m, draws = 50, 5, 200_000
    rng = np.random.default_rng(11)
    r = rng.uniform(0.0, 0.1, size=k)
    ids = np.argpartition(rng.random((draws, k)), m, axis=1)[:, :m].astype(np.int32)
    c = m / k
    fixed = 0.07  # an imputation value independent of the sample

    @jax.jit
    def estimate(ids):
        def one(i):
            obs = jnp.asarray(r, jnp.float32)[i]
            rbar = jnp.mean(obs)
            mask = jnp.ones(m, bool)
            a = ag.doubly_robust_responses(obs, i, mask, k, c, fixed)
            b = ag.doubly_robust_responses(obs, i, mask, k, c, rbar)
            return a, b, rbar
        return jax.vmap(one)(ids)

    a, b, rbar = (np.asarray(x, np.float64) for x in estimate(jnp.asarray(ids)))
    se_a = a.std(0) / math.sqrt(draws)
    assert np.all(np.abs(a.mean(0) - r) <= 5 * se_a)  # (a) unbiased with fixed imputation
    bias = (k - m) / (m * (k - 1)) * (r.mean() - r)
    se_b = b.std(0) / math.sqrt(draws)
    assert np.all(np.abs(b.mean(0) - r - bias) <= 5 * se_b)  # (b) bias (K-m)/(m(K-1)) (rbar_pop - r_i)
    assert np.abs(bias).max() > 5 * se_b.max()  # ... which is measurably non-zero
    assert abs((b.mean(0) - r).mean()) <= 5 * se_b.mean() / math.sqrt(k)  # ~0 on average
    # (c) affinity: E[gbreve] = htilde(E rbreve) for a fixed expansion point r0.
    p = rng.dirichlet(np.ones(k))
    r0 = 0.05
    lin = jax.jit(jax.vmap(lambda x: ag.linearized_gradient(x, r0, jnp.asarray(p, jnp.float32))))
    g = np.asarray(lin(jnp.asarray(b[:20000], jnp.float32)), np.float64).mean(0)
    g_of_mean = np.asarray(ag.linearized_gradient(jnp.asarray(b[:20000].mean(0), jnp.float32),
                                                  r0, jnp.asarray(p, jnp.float32)))
    np.testing.assert_allclose(g, g_of_mean, atol=1e-5)


def test_linearization_and_gradient_bound():
    k = 12
    rng = np.random.default_rng(12)
    p = jnp.asarray(rng.dirichlet(np.ones(k)), jnp.float32)
    h = lambda r: -r / (1.0 + jnp.vdot(p, r))
    r0 = jnp.full((k,), 0.3)
    np.testing.assert_allclose(np.asarray(ag.linearized_gradient(r0, 0.3, p)),
                               np.asarray(h(r0)), rtol=1e-6)
    d = jnp.asarray(rng.uniform(-0.2, 0.2, k), jnp.float32)
    errs = [float(jnp.max(jnp.abs(ag.linearized_gradient(r0 + s * d, 0.3, p) - h(r0 + s * d))))
            for s in (1.0, 0.5)]
    assert 3.5 <= errs[0] / errs[1] <= 4.5  # second-order error
    # Lemma 3.5: ||gbreve||_inf <= C2/(1+C1) + 2 (C2-C1) / (C (1+C1)) for any sample.
    n, m = 30, 3
    c = m / n
    lbreve = float(ag.dr_lipschitz(c, 0.0, c))
    assert lbreve == pytest.approx(c + 2)
    draws = 200
    ids = jnp.asarray(np.stack([rng.choice(n, m, replace=False) for _ in range(draws)]),
                      jnp.int32)
    extreme = rng.choice([0.0, c], size=(draws, m))
    resp = np.where(rng.random((draws, 1)) < 0.5, extreme, rng.uniform(0, c, (draws, m)))
    pp = rng.dirichlet(np.ones(n) * 0.1, size=draws)

    def norm(i, r, p):
        rbar = jnp.mean(r)
        rb = ag.doubly_robust_responses(r, i, jnp.ones(m, bool), n, c, rbar)
        return jnp.max(jnp.abs(ag.linearized_gradient(rb, rbar, p)))

    norms = jax.jit(jax.vmap(norm))(ids, jnp.asarray(resp, jnp.float32),
                                    jnp.asarray(pp, jnp.float32))
    assert float(norms.max()) <= lbreve + 1e-6


def test_reference_variant_changes_the_dr_estimate():
    n, m = 10, 2
    resp = jnp.array([0.1, 0.15])
    ids = jnp.array([3, 7], jnp.int32)
    mask = jnp.ones(2, bool)
    thesis = np.asarray(ag.doubly_robust_responses(resp, ids, mask, n, m / n, 0.125))
    reference = np.asarray(ag.doubly_robust_responses(resp, ids, mask, n, m / n, 0.125,
                                                      variant="reference"))
    np.testing.assert_allclose(thesis[[3, 7]], [0.125 - 0.125, 0.125 + 0.125], atol=1e-6)
    np.testing.assert_allclose(reference[[3, 7]], [-0.125, 0.125], atol=1e-6)
    others = np.setdiff1d(np.arange(n), [3, 7])
    np.testing.assert_allclose(thesis[others], 0.125)
    np.testing.assert_allclose(reference[others], 0.125)
    assert float(ag.dr_lipschitz(1.0, 0.0, 1.0, full_participation=True)) == 1.0
    assert float(ag.dr_lipschitz(1.0, 0.0, 1.0, variant="reference")) == 3.0


def test_ftrl_regret_at_full_participation():
    k, t_max = 20, 1600
    lip = 1.0 / k
    rng = np.random.default_rng(14)
    resp = rng.uniform(0, 1, size=(t_max, k)) / k
    resp[:, 3] = rng.uniform(0.6, 1.0, size=t_max) / k

    def body(state, r):
        loss = ag.decision_loss(state.decision, r)
        state = ag.ftrl_step(state, r, jnp.arange(k, dtype=jnp.int32), jnp.ones(k, bool),
                             upper=1.0 / k)
        return state, loss

    losses = np.asarray(jax.jit(lambda r: jax.lax.scan(body, ag.ftrl_init(k), r)[1])(
        jnp.asarray(resp, jnp.float32)), np.float64)
    best = _offline_best_losses(resp, (100, 400, 1600))
    for t in (100, 400, 1600):
        regret = losses[:t].sum() - best[t]
        assert regret <= 2 * lip * math.sqrt(t * math.log(k)), (t, regret)


def test_masked_rows_do_not_write():
    n = 8
    rule = ag.aaggff_d_mixing()
    rule = rule._replace(update=jax.jit(rule.update))
    state = rule.init(n)
    loss = jnp.array([1.0, 2.0, 0.5])
    ids = jnp.array([1, 4, 6], jnp.int32)
    w_ref, s_ref = rule.update(state, outputs_of(loss), ctx_of(ids, jnp.ones(3, bool)))
    # The same cohort padded with masked rows that repeat ids and carry wild losses.
    w_pad, s_pad = rule.update(state, outputs_of(jnp.array([1.0, 9e9, 2.0, 0.5, 7.0])),
                               ctx_of(jnp.array([1, 1, 4, 6, 4], jnp.int32),
                                      jnp.array([True, False, True, True, False])))
    np.testing.assert_allclose(np.asarray(s_pad.grad_sum), np.asarray(s_ref.grad_sum), atol=1e-7)
    np.testing.assert_allclose(np.asarray(w_pad)[[0, 2, 3]], np.asarray(w_ref), atol=1e-7)
    assert np.asarray(w_pad)[[1, 4]].tolist() == [0.0, 0.0]
    # A round with nobody leaves the state as it was.
    w0, s0 = rule.update(s_ref, outputs_of(loss), ctx_of(ids, jnp.zeros(3, bool)))
    assert np.all(np.asarray(w0) == 0)
    for a, b in zip(s0, s_ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # (AAggFF-S cohorts padded with masked rows: test_rule_properties[s_*].)

