"""AAggFF-S / AAggFF-D tests (Hahn, UNIST 2024 thesis, Ch. III; arXiv:2405.20821) against literal NumPy float64
references of the thesis's equations, the regret guarantees, a Monte-Carlo check of
the doubly robust estimator, and a few end-to-end rounds on helpers.tiny_federation().
"""
from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from fedjax_fair.core import mixing as mixing_lib
from fedjax_fair.core import sampling
from fedjax_fair.solvers import online
from fedjax_fair.algorithms import REGISTRY, method_hparams
from fedjax_fair.algorithms import aaggff as ag
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.core.client import ClientTraining, proximal_term
from fedjax_fair.drivers.simulate import simulate
from fedjax_fair.solvers.simplex import project_simplex
from fedjax_fair.core.types import ClientOutput, ServerContext

MODEL = helpers.logreg()
PARAMS = helpers.init_params(MODEL, 1)
KEY = jax.random.key(0)


# ------------------------------------------------------------------ NumPy references


def np_cdf(name, x):
    x = np.asarray(x, np.float64)
    return {
        "weibull": lambda: 1 - np.exp(-x ** 2),
        "exponential": lambda: 1 - np.exp(-x),
        "frechet": lambda: np.exp(-1 / np.maximum(x, 1e-12)),
        "normal": lambda: np.array([0.5 * (1 + math.erf((v - 1) / math.sqrt(2))) for v in x]),
        "gumbel": lambda: np.exp(-np.exp(-(x - 1))),
        "logistic": lambda: 1 / (1 + np.exp(-(x - 1))),
    }[name]()


def np_responses(losses, name, c1, c2):
    losses = np.asarray(losses, np.float64)
    return c1 + (c2 - c1) * np_cdf(name, losses / max(losses.mean(), 1e-12))


def np_project_simplex(v):
    v = np.asarray(v, np.float64)
    u = np.sort(v)[::-1]
    css = np.cumsum(u)
    rho = max(j for j in range(1, len(v) + 1) if u[j - 1] - (css[j - 1] - 1) / j > 0)
    return np.maximum(v - (css[rho - 1] - 1) / rho, 0.0)


def np_qp_exact(B, b):
    """argmin_{p in simplex} 1/2 p'Bp + b'p by enumerating supports (small K):
    on a support S solve B_SS p_S + b_S = nu 1, 1'p_S = 1, keep the feasible one."""
    B, b = np.asarray(B, np.float64), np.asarray(b, np.float64)
    k = len(b)
    best, best_val = None, np.inf
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
            s = list(support)
            kkt = np.zeros((size + 1, size + 1))
            kkt[:size, :size] = B[np.ix_(s, s)]
            kkt[:size, size] = -1.0
            kkt[size, :size] = 1.0
            rhs = np.concatenate([-b[s], [1.0]])
            try:
                sol = np.linalg.solve(kkt, rhs)
            except np.linalg.LinAlgError:
                continue
            p = np.zeros(k)
            p[s] = sol[:size]
            nu = sol[size]
            h = B @ p + b
            if p.min() >= -1e-12 and np.all(h >= nu - 1e-9):
                val = 0.5 * p @ B @ p + b @ p
                if val < best_val:
                    best, best_val = p, val
    return best


def np_ons_run(responses, alpha, beta, variant="thesis", diagonal=False):
    """Literal eq. 3.7 (thesis) / the authors' cvxpy objective (reference), float64;
    ``diagonal`` keeps only diag(B). Returns the decisions p^(2..T+1)."""
    t_max, k = responses.shape
    p = np.ones(k) if variant == "reference" else np.full(k, 1.0 / k)
    A, b = np.zeros((k, k)), np.zeros(k)
    out = []
    for r in responses:
        g = -r / (1 + p @ r)
        A += np.outer(g, g)
        if variant == "thesis":
            b += (1 - beta * (g @ p)) * g
            B = alpha * np.eye(k) + beta * A
        else:
            b += g
            B = alpha * np.eye(k) + beta * (alpha * np.eye(k) + A)  # cvxpy: hess_hist = alpha I + A
        if diagonal:
            B = np.diag(np.diag(B))
        p = np_qp_exact(B, b)
        out.append(p)
    return np.array(out)


def np_ftrl_run(rounds, n, variant="thesis"):
    """Literal Algorithm 3.2 (thesis) / the authors' update (reference), float64.
    ``rounds``: list of (client_ids, responses) of the sampled clients."""
    p = np.full(n, 1.0 / n)
    s = np.zeros(n)
    out = []
    for t, (ids, r) in enumerate(rounds, start=1):
        m = len(ids)
        c = m / n
        rbar = r.mean()
        if variant == "reference" and t == 1:
            p = np.full(n, c)
        rb = np.full(n, rbar)
        for i, ri in zip(ids, r):
            rb[i] = (rbar + (ri - rbar) / c) if variant == "thesis" else (ri - rbar) / c
        denom = 1 + rbar * p.sum()
        g = -rb / denom + rbar * (p @ rb - rbar * p.sum()) / denom ** 2
        s += g
        if variant == "thesis":
            lip = c if m == n else c + 2  # C2 = C, C1 = 0
        else:
            lip = 2 + c
        z = -s * math.sqrt(math.log(n)) / (lip * math.sqrt(t + 1))
        p = np.exp(z - z.max())
        p /= p.sum()
        out.append(p)
    return np.array(out)


def ctx_of(client_ids, client_mask):
    """The round's ServerContext for a cohort (what mixing rules read: ids and mask)."""
    return ServerContext(params=(), round=jnp.zeros((), jnp.int32), key=KEY,
                         client_ids=jnp.asarray(client_ids, jnp.int32),
                         client_mask=jnp.asarray(client_mask, bool))


def outputs_of(losses):
    k = len(losses)
    return ClientOutput(delta=(), loss_before=jnp.asarray(losses, jnp.float32),
                        num_examples=jnp.full((k,), 5, jnp.int32),
                        num_steps=jnp.ones((k,), jnp.int32))


def run_rule(rule, n, losses, ids=None, masks=None):
    """Runs ``rule`` for R rounds under one jitted lax.scan (vmapped over a leading
    batch axis when ``losses`` is [B, R, K]). Returns (weights [.., R, K], decisions
    [.., R, N], final state)."""
    losses = jnp.asarray(losses, jnp.float32)
    k = losses.shape[-1]
    ids = (jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), losses.shape) if ids is None
           else jnp.asarray(ids, jnp.int32))
    masks = jnp.ones(losses.shape, bool) if masks is None else jnp.asarray(masks, bool)

    def body(state, xs):
        loss, i, msk = xs
        w, state = rule.update(state, outputs_of(loss), ctx_of(i, msk))
        return state, (w, state.decision)

    def run(xs):
        return jax.lax.scan(body, rule.init(n), xs)

    if losses.ndim == 3:
        run = jax.vmap(run)
    state, (w, dec) = jax.jit(run)((losses, ids, masks))
    return np.asarray(w), np.asarray(dec), state


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


# ------------------------------------------------------------------ shared properties


RULES = {  # name -> (rule kwargs, cdf)
    "s_thesis": (dict(), "normal"),
    "s_reference": (dict(variant="reference"), "weibull"),
    "s_diagonal": (dict(solver="diagonal"), "frechet"),
    "d_thesis": (dict(), "gumbel"),
    "d_reference": (dict(variant="reference"), "logistic"),
}


def _scenarios(partial, n, k, rounds, rng):
    """Loss sequences [4, R, K + 1], cohorts and masks: 0 random incl. zero / equal /
    huge losses, 1 equal losses, 2 client 3 the worst in round 1, 3 = 0 with the
    clients relabelled by ``perm`` (full participation only). Every cohort carries one
    extra masked-out row that repeats a client id with a wild loss (padding)."""
    random = rng.gamma(1.0, 1.0, size=(rounds, k))
    random[::7] = 0.0
    random[3::7] = 2.5
    random[5::7, 0] = 1e6
    equal = np.repeat(rng.gamma(2.0, 1.0, size=(rounds, 1)), k, axis=1)
    worst = rng.gamma(2.0, 0.2, size=(rounds, k))
    if k == 6:
        worst[0] = [0.5, 0.7, 0.6, 2.0, 0.4, 0.55]
    perm = rng.permutation(n)
    if partial:
        ids = np.stack([np.stack([np.sort(rng.choice(n, k, replace=False))
                                  for _ in range(rounds)]) for _ in range(4)])
        permuted = random
    else:
        ids = np.broadcast_to(np.arange(n), (4, rounds, n))
        permuted = random[:, perm]
    losses = np.stack([random, equal, worst, permuted])
    losses = np.concatenate([losses, np.full((4, rounds, 1), 1e9)], axis=-1)
    ids = np.concatenate([ids, ids[..., :1]], axis=-1)
    masks = np.ones(losses.shape, bool)
    masks[..., k] = False
    return losses, ids, masks, perm


@pytest.mark.parametrize("name", sorted(RULES))
def test_rule_properties(name):
    """NumPy references of the updates, the simplex invariant over 200 rounds,
    symmetry, permutation equivariance and the monotone response,
    one compiled scan per rule."""
    n, rounds = 6, 200
    partial = name.startswith("d")
    k = 3 if partial else n
    rng = np.random.default_rng(16)
    losses, ids, masks, perm = _scenarios(partial, n, k, rounds, rng)
    kwargs, cdf = RULES[name]
    factory = ag.aaggff_d_mixing if partial else ag.aaggff_s_mixing
    w, dec, _ = run_rule(factory(cdf=cdf, **kwargs), n, losses, ids=ids, masks=masks)
    assert np.all(w[..., k] == 0)  # the padding row
    w, losses, ids = w[..., :k], losses[..., :k], ids[..., :k]
    # Literal NumPy references of the first rounds of scenario 0 (includes all-zero,
    # equal and huge losses).
    head = 12
    variant = kwargs.get("variant", "thesis")
    if partial:
        c = k / n
        ref = np_ftrl_run([(i, np_responses(l, cdf, 0.0, c))
                           for i, l in zip(ids[0, :head], losses[0, :head])], n, variant)
        np.testing.assert_allclose(dec[0, :head], ref, atol=1e-6)
        sel = ref[np.arange(head)[:, None], ids[0, :head]]
        np.testing.assert_allclose(w[0, :head], sel / sel.sum(1, keepdims=True), atol=1e-6)
    else:
        assert ag.ons_defaults(n) == (4.0, n / 4)
        resp = np.stack([np_responses(l, cdf, 0.0, 1.0 / n) for l in losses[0, :head]])
        ref = np_ons_run(resp, *ag.ons_defaults(n), variant,
                         diagonal=kwargs.get("solver") == "diagonal")
        np.testing.assert_allclose(dec[0, :head], ref, atol=2e-5)
        np.testing.assert_allclose(w[0, :head], ref, atol=2e-5)  # full cohort: ptilde = p
    assert np.all(np.isfinite(dec)) and np.all(np.isfinite(w))
    assert dec.min() >= -1e-6 and np.abs(dec.sum(-1) - 1).max() <= 1e-5
    assert w.min() >= 0 and np.abs(w.sum(-1) - 1).max() <= 1e-5
    if name == "d_reference":
        # The reference code's DR value (r_i - rbar) / C drops rbar for participants
        # (it drops rbar): even equal losses move weight away from the sampled clients.
        first = dec[1, 0]
        assert np.all(first[ids[1, 0]] < np.delete(first, ids[1, 0]).min() - 1e-3)
    else:
        np.testing.assert_allclose(dec[1], 1.0 / n, atol=1e-6)
        np.testing.assert_allclose(w[1], 1.0 / k, atol=1e-6)
    if not partial:
        np.testing.assert_allclose(dec[3], dec[0][:, perm], atol=2e-6)
        assert dec[2, 0, 3] > np.delete(dec[2, 0], 3).max()
        assert w[2, 0, 3] > np.delete(w[2, 0], 3).max()


def test_d_full_participation_follows_the_largest_loss():
    n = 6
    losses = np.array([[0.5, 0.7, 0.6, 2.0, 0.4, 0.55]])
    w, dec, _ = run_rule(ag.aaggff_d_mixing(), n, losses)  # C = 1: exact responses
    assert dec[0, 3] > np.delete(dec[0], 3).max()
    np.testing.assert_allclose(w[0], dec[0], atol=1e-7)


def test_collapsed_response_range_gives_fedavg_weights():
    """C1 = C2: every response is the same constant, the decision stays 1/N, and the
    weights are FedAvg's uniform weights (= its n_k weights for equal sizes), whatever
    the losses."""
    n = 6
    losses = np.random.default_rng(19).gamma(1.0, 1.0, size=(1, 30, n))
    for rule in (ag.aaggff_s_mixing(response_range=(0.1, 0.1)),
                 ag.aaggff_d_mixing(response_range=(0.2, 0.2))):
        w, dec, _ = run_rule(rule, n, losses)
        np.testing.assert_allclose(dec, 1.0 / n, atol=1e-6)
        uniform, _ = mixing_lib.uniform().update((), outputs_of(losses[0, 0]),
                                                 ctx_of(jnp.arange(n), jnp.ones(n, bool)))
        np.testing.assert_allclose(w[0], np.broadcast_to(np.asarray(uniform), (30, n)),
                                   atol=1e-6)


@pytest.mark.slow
def test_collapsed_response_range_is_fedavg_end_to_end():
    data = helpers.tiny_federation(train_sizes=(6, 6, 6, 6), test_sizes=(2, 2, 2, 2))
    kw = dict(training=ClientTraining(lr=0.3, batch_size=6, num_epochs=1))

    def final(alg):
        state, _ = jax.jit(lambda s, key: simulate(
            alg, s, data, key, num_rounds=2, cohort_size=4, sampler=sampling.full,
            execution="sequential"))(
                alg.init(PARAMS, 4), KEY)
        return state.params

    base = final(fedavg(MODEL, **kw))
    helpers.assert_trees_close(final(ag.aaggff_s(MODEL, response_range=(0.1, 0.1), **kw)),
                               base, rtol=1e-5, atol=1e-6)
    helpers.assert_trees_close(final(ag.aaggff_d(MODEL, response_range=(0.2, 0.2), **kw)),
                               base, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ end to end


def test_aaggff_s_end_to_end_matches_reference_weights():
    data = helpers.tiny_federation()
    n = data.num_clients
    alg = ag.aaggff_s(MODEL, cdf="normal",
                      training=ClientTraining(lr=0.3, batch_size=12, num_epochs=1))
    state, metrics = jax.jit(lambda s, key: simulate(
        alg, s, data, key, num_rounds=4, cohort_size=n, sampler=sampling.full,
        execution="sequential"))(
            alg.init(PARAMS, n), KEY)
    assert helpers.tree_all_finite(state.params)
    losses = np.asarray(metrics["loss_before"], np.float64)
    resp = np.stack([np_responses(l, "normal", 0.0, 1.0 / n) for l in losses])
    ref = np_ons_run(resp, *ag.ons_defaults(n))
    np.testing.assert_allclose(np.asarray(metrics["weights"]), ref, atol=2e-5)
    np.testing.assert_allclose(np.asarray(state.mixing_state.decision), ref[-1], atol=2e-5)
    assert int(state.mixing_state.round) == 4
    # The global model improves on the clients' training data.
    assert losses[-1].mean() < losses[0].mean()


def test_aaggff_d_end_to_end_plug_and_play_with_fedprox():
    """AAggFF-D's rule on FedProx clients (one line), partial participation."""
    data = helpers.tiny_federation()
    n, rounds = data.num_clients, 5
    kw = dict(training=ClientTraining(lr=0.3, batch_size=12, num_epochs=1))
    # FedProx clients = FedAvg's local training with the proximal regulariser (the
    # fedprox factory fixes the mixing rule, so the pieces are plugged in directly).
    alg = fedavg(MODEL, regularizer=proximal_term(0.01),
                 mixing=ag.aaggff_d_mixing(cdf="exponential"), **kw)
    state, metrics = jax.jit(lambda s, key: simulate(
        alg, s, data, key, num_rounds=rounds, cohort_size=3, sampler=sampling.uniform,
        execution="sequential"))(
            alg.init(PARAMS, n), KEY)
    assert helpers.tree_all_finite(state.params)
    ids = np.asarray(metrics["client_ids"])
    assert len({tuple(sorted(i)) for i in ids}) > 1  # different cohorts
    losses = np.asarray(metrics["loss_before"], np.float64)
    rounds_ = [(i, np_responses(l, "exponential", 0.0, 3 / n)) for i, l in zip(ids, losses)]
    ref = np_ftrl_run(rounds_, n)
    sel = ref[np.arange(rounds)[:, None], ids]
    np.testing.assert_allclose(np.asarray(metrics["weights"]), sel / sel.sum(1, keepdims=True),
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.mixing_state.decision), ref[-1], atol=1e-6)
    assert int(state.mixing_state.round) == rounds
    # The factory builds the same thing on FedAvg clients.
    d_alg = ag.aaggff_d(MODEL, cdf="exponential", **kw)
    assert isinstance(d_alg.init(PARAMS, n).mixing_state, ag.FTRLState)


# ------------------------------------------------------------------ API


def test_argument_validation():
    with pytest.raises(ValueError, match="^cdf:"):
        ag.aaggff_s_mixing(cdf="cauchy")
    with pytest.raises(ValueError, match="^cdf:"):
        ag.aaggff_d_mixing(cdf=6)
    with pytest.raises(ValueError, match="^variant:"):
        ag.aaggff_s_mixing(variant="paper")
    with pytest.raises(ValueError, match="^alpha:"):
        ag.aaggff_s_mixing(alpha=0.0)
    with pytest.raises(ValueError, match="^beta:"):
        ag.aaggff_s_mixing(beta=-1.0)
    with pytest.raises(ValueError, match="^solver:"):
        ag.aaggff_s_mixing(solver="cvxpy")
    with pytest.raises(ValueError, match="^num_iters:"):
        ag.aaggff_s_mixing(num_iters=0)
    for bad in [(0.5, 0.1), (0.0, 0.0), (-0.1, 1.0), "x"]:
        with pytest.raises(ValueError, match="^response_range:"):
            ag.aaggff_d_mixing(response_range=bad)
    # The factory sets the mixing rule itself: its signature takes no ``mixing``.
    assert "mixing" not in method_hparams("aaggff_s")
    with pytest.raises(TypeError, match="mixing"):
        ag.aaggff_s(MODEL, mixing=mixing_lib.uniform())
    rule = ag.aaggff_s_mixing()
    with pytest.raises(ValueError, match="^cohort_size:"):
        rule.update(rule.init(6), outputs_of(jnp.ones(3)),
                    ctx_of(jnp.arange(3), jnp.ones(3, bool)))
    # Both factories state FedAvg's local-training arguments (with FedAvg's ranges).
    fedavg_hparams = method_hparams("fedavg")
    for name in ("aaggff_s", "aaggff_d"):
        hparams = method_hparams(name)
        for arg in ("client_lr", "batch_size", "num_epochs", "max_steps", "client_optimizer",
                    "server_optimizer"):
            assert arg in hparams, (name, arg)
            assert hparams[arg].range == fedavg_hparams[arg].range, (name, arg)
    assert REGISTRY["aaggff_s"].participation == "full"
    assert REGISTRY["aaggff_d"].participation == "partial"
    assert ag.cdf_name(3) == "normal" and set(ag.REFERENCE_CDFS.values()) <= set(ag.CDFS)


@pytest.mark.parametrize("mode", ["s", "d"])
def test_server_step_helper(mode):
    n = 40 if mode == "s" else 300
    step, (state, outputs, ctx) = ag.aaggff_server_step(n, mode=mode)
    ids = ctx.client_ids
    assert ids.shape == ((n,) if mode == "s" else (3,))
    losses = jnp.asarray(np.random.default_rng(20).gamma(2.0, 1.0, (25, ids.shape[0])),
                         jnp.float32)

    def body(st, loss):
        w, st = step(st, outputs._replace(loss_before=loss), ctx)
        return st, w

    state, w = jax.jit(lambda st, ls: jax.lax.scan(body, st, ls))(state, losses)
    assert np.abs(np.asarray(w).sum(1) - 1).max() <= 1e-5 and int(state.round) == 25
    if mode == "s":
        assert state.hessian.shape == (n, n)
        # After 25 rounds the warm-started QP is still solved to float32 precision.
        alpha, beta = ag.ons_defaults(n)
        B = alpha * jnp.eye(n) + beta * state.hessian
        assert float(online.simplex_qp_kkt_residual(B, state.linear, state.decision)) <= 1e-5
    else:
        assert state.decision.shape == (300,)


@pytest.mark.slow
def test_server_lr_scales_the_step_and_accepts_a_compensating_schedule():
    """AAggFF's reference code has a global rate eta_g (default 1, FedAvg's step);
    ``schedules.compensated`` grows it as the client rate decays (the reference code's choice)."""
    from fedjax_fair.data import get_dataset
    from fedjax_fair.models import logistic_regression
    from fedjax_fair.core.schedules import compensated, exponential
    from fedjax_fair.drivers.simulate import simulate
    ds = get_dataset("synthetic", num_clients=6, max_examples=40)
    model = logistic_regression(ds.input_shape, ds.num_classes)
    params = model.init(jax.random.key(0))

    def steps(server_lr, rounds):
        alg = ag.aaggff_d(model, server_lr=server_lr,
                          training=ClientTraining(lr=exponential(0.1, 0.5)))
        state, out = alg.init(params, 6), []
        for t in range(rounds):
            new, metrics = simulate(alg, state, ds.data, jax.random.key(t), num_rounds=1,
                                    cohort_size=3, execution="sequential")
            moved = np.sqrt(sum(float(np.sum((np.asarray(a) - np.asarray(b)) ** 2)) for a, b
                                in zip(jax.tree.leaves(new.params),
                                       jax.tree.leaves(state.params))))
            out.append(moved / float(metrics["update_norm"][0]))
            state = new
        return out

    assert steps(1.0, 1) == pytest.approx([1.0], rel=1e-4)
    assert steps(0.5, 1) == pytest.approx([0.5], rel=1e-4)
    # compensated: eta_g,t = 2 / 0.5^t while the client rate halves each round
    assert steps(compensated(2.0, exponential(0.1, 0.5)), 3) == pytest.approx([2, 4, 8],
                                                                              rel=1e-4)
    with pytest.raises(ValueError, match="server_lr"):
        ag.aaggff_s(model, server_lr=-1.0)
