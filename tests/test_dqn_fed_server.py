"""DQN-Fed's server step (fedjax_fair/algorithms/dqn_fed.py): the properties its theorems
and update rules imply.

The closed-form combination (scaled Gram-Schmidt / quasi-Newton, eqs. 7-17) is checked
against the paper's literal equations written in NumPy (float64), the step cap of
Theorem 4.2 against the step actually taken on ill-conditioned cohorts, in float32 and
under x64. The client and the whole method: tests/test_dqn_fed.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_fair.core.types import ClientOutput, ServerContext
from dqn_fed_common import D, _combine, _flat, _tree, np_literal


def _random(k=5, d=10, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(k, d)), rng.uniform(0.2, 2.0, size=k)


# ------------------------------------------------------------------------ server


def test_every_participant_descends_by_its_decrement():
    G, dt = _random(6, 10)
    comb = _combine(_tree(G, 6), jnp.asarray(dt, jnp.float32), ridge=0.0)
    v = _flat(comb.v)
    np.testing.assert_allclose(G @ v, dt, rtol=1e-4)
    np.testing.assert_allclose(comb.realised, dt, rtol=1e-4)


def test_closed_form_equals_the_literal_equations_and_cholesky_identities():
    for seed in range(4):
        G, dt = _random(5, 10, seed)
        if seed == 3:
            G[1] = G[0] + 0.3 * G[1]  # correlated clients: some literal c_k go negative
        tilde, lam, S, d = np_literal(G, dt)
        comb = _combine(_tree(G, 5), jnp.asarray(dt, jnp.float32), ridge=0.0)
        v = _flat(comb.v)
        np.testing.assert_allclose(S * d, v, rtol=2e-3, atol=1e-5)
        np.testing.assert_allclose(float(comb.S), S, rtol=2e-3)
        np.testing.assert_allclose(S, dt @ np.linalg.solve(G @ G.T, dt), rtol=1e-8)
        np.testing.assert_allclose(v @ v, S, rtol=2e-3)
        np.testing.assert_allclose(d @ d, 1 / S, rtol=1e-8)
        assert np.all(lam > 0) and abs(lam.sum() - 1) < 1e-12
        np.testing.assert_allclose(comb.lam, lam, rtol=2e-3, atol=1e-6)
        # the jittable literal implementation agrees too
        g_t, lam_j, S_j, d_j = D.gram_schmidt(jnp.asarray(G, jnp.float32),
                                              jnp.asarray(dt, jnp.float32))
        np.testing.assert_allclose(float(S_j) * np.asarray(d_j), v, rtol=2e-3, atol=1e-5)
        np.testing.assert_allclose(lam_j, lam, rtol=2e-3, atol=1e-6)


def test_literal_vectors_are_orthogonal_and_span_the_gradients():
    G, dt = _random(4, 10, 1)
    tilde, _, _, _ = np.asarray(D.gram_schmidt(jnp.asarray(G), jnp.asarray(dt))[0],
                                np.float64), None, None, None
    for i in range(4):
        for j in range(i):
            assert abs(tilde[i] @ tilde[j]) <= 1e-4 * np.linalg.norm(tilde[i]) * np.linalg.norm(
                tilde[j])
    coeffs, *_ = np.linalg.lstsq(tilde.T, G.T, rcond=None)
    np.testing.assert_allclose(tilde.T @ coeffs, G.T, atol=1e-4)


def test_order_invariance_and_rescaling():
    G, dt = _random(5, 10, 2)
    base = _flat(_combine(_tree(G, 5), jnp.asarray(dt, jnp.float32)).v)
    perm = np.random.default_rng(0).permutation(5)
    permuted = _combine(_tree(G[perm], 5), jnp.asarray(dt[perm], jnp.float32))
    np.testing.assert_allclose(_flat(permuted.v), base, rtol=1e-4, atol=1e-6)
    c = np.array([0.5, 3.0, 1.0, 10.0, 0.1])
    scaled = _combine(_tree(G * c[:, None], 5), jnp.asarray(dt * c, jnp.float32))
    np.testing.assert_allclose(_flat(scaled.v), base, rtol=1e-3, atol=1e-6)


def test_single_and_orthogonal_clients():
    g = np.arange(1.0, 11.0)[None]
    one = _combine(_tree(g, 1), jnp.asarray([2.0]), ridge=0.0)
    np.testing.assert_allclose(_flat(one.v), g[0] * 2.0 / (g[0] @ g[0]), rtol=1e-5)
    ortho = np.eye(10)[:3] * np.array([[2.0], [0.5], [3.0]])
    dt = np.array([1.0, 2.0, 0.3])
    comb = _combine(_tree(ortho, 3), jnp.asarray(dt, jnp.float32), ridge=0.0)
    expected = sum(dt[k] / (ortho[k] @ ortho[k]) * ortho[k] for k in range(3))
    np.testing.assert_allclose(_flat(comb.v), expected, rtol=1e-5, atol=1e-7)


def test_newton_step_on_a_quadratic():
    """K = 1, f = a/2 ||theta||^2, exact H^-1: one step with eta_g = 1 reaches 0."""
    a, theta = 3.0, np.linspace(-1, 1, 10)
    g = a * theta
    dt = g @ g / a
    comb = _combine(_tree(g[None], 1), jnp.asarray([dt], jnp.float32), ridge=0.0)
    np.testing.assert_allclose(theta - _flat(comb.v), 0.0, atol=1e-5)


def test_duplicates_zero_rows_and_masked_rows_are_safe():
    G, dt = _random(3, 10, 3)
    base = _flat(_combine(_tree(G, 3), jnp.asarray(dt, jnp.float32)).v)
    dup = _combine(_tree(np.vstack([G, G[:1]]), 4),
                        jnp.asarray(np.append(dt, dt[0]), jnp.float32))
    np.testing.assert_allclose(_flat(dup.v), base, rtol=1e-3, atol=1e-5)
    g = G[0]
    exact = _combine(_tree(np.vstack([G[:1], G[:1]]), 2), jnp.asarray([1.0, 3.0]),
                          solver="eigh")
    np.testing.assert_allclose(_flat(exact.v), g * 2.0 / (g @ g), rtol=1e-4)
    # the ridge approaches that limit; float32 holds it to a few percent at 1e-6
    for ridge, tol in ((1e-6, 0.1), (1e-3, 2e-3)):
        same = _combine(_tree(np.vstack([G[:1], G[:1]]), 2), jnp.asarray([1.0, 3.0]),
                             ridge=ridge)
        assert np.all(np.isfinite(_flat(same.v)))
        np.testing.assert_allclose(_flat(same.v), g * 2.0 / (g @ g), rtol=tol)
    zero = _combine(_tree(np.vstack([G, np.zeros((1, 10))]), 4),
                         jnp.asarray(np.append(dt, 5.0), jnp.float32))
    np.testing.assert_allclose(_flat(zero.v), base, rtol=1e-3, atol=1e-5)
    assert not bool(zero.kept[3]) and float(zero.w[3]) == 0.0
    nothing = _combine(_tree(np.zeros((3, 10)), 3), jnp.ones(3))
    assert np.all(_flat(nothing.v) == 0) and np.isfinite(float(nothing.S))
    padded = _combine(_tree(np.vstack([G, 1e6 * np.ones((1, 10))]), 4),
                           jnp.asarray(np.append(dt, 1.0), jnp.float32),
                           jnp.asarray([True, True, True, False]))
    np.testing.assert_allclose(_flat(padded.v), base, rtol=1e-3, atol=1e-5)


def test_step_cap_uses_the_realised_decreases():
    G, dt = _random(4, 10, 4)
    comb = _combine(_tree(G, 4), jnp.asarray(dt, jnp.float32))
    gamma0 = jnp.asarray([0.5, 0.25, 1.0, 2.0])
    factor = D.step_factor(comb, gamma0, step_cap="thm42")
    lipschitz = 4.0
    expected = min(1.0, 2 * float(np.min(comb.realised)) / (lipschitz * float(comb.S)))
    np.testing.assert_allclose(float(factor), expected, rtol=1e-5)
    assert float(D.step_factor(comb, gamma0)) == 1.0
    bounded = D.step_factor(comb, gamma0, max_step_norm=0.01)
    np.testing.assert_allclose(float(bounded) * np.sqrt(float(comb.S)), 0.01, rtol=1e-5)


def test_gram_matrix_by_column_blocks_equals_the_whole():
    rng = np.random.default_rng(5)
    tree = {"a": jnp.asarray(rng.normal(size=(4, 3, 7)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)}
    whole = D.gram_matrix(tree, 4, block_size=None)
    flat = np.concatenate([np.asarray(tree["a"]).reshape(4, -1), np.asarray(tree["b"])], 1)
    np.testing.assert_allclose(whole, flat @ flat.T, rtol=1e-5)
    for block in (1, 4, 6, 21, 100):
        np.testing.assert_allclose(D.gram_matrix(tree, 4, block_size=block), whole, rtol=1e-5)


# -------------------------------------------------- the step actually taken (issue 26)
#
# Cohorts whose Gram M = G^T G is ill-conditioned or singular, each in float32 and under
# x64 (float64 client vectors). References in NumPy float64: the literal eqs. 7-17
# (np_literal) where G has full rank, else the min-norm least-squares solution of the
# row-normalised system (g_k / ||g_k||) . v = d~_k / ||g_k|| (the pseudo-inverse of the
# normalised Gram: it is G pinv(M) d~ whenever G^T v = d~ is solvable, or when the
# clashing rows have equal norms, as duplicates do). Client k is a quadratic
# f_k(theta) = 1/2 (theta - c_k)^T A_k (theta - c_k) with gradient g_k at theta = 0
# (c_k = -A_k^-1 g_k), exact decrement d~_k = g_k^T A_k^-1 g_k and
# gamma0_k = 1 / lambda_max(A_k), so L^ = max_k lambda_max(A_k) is Theorem 4.2's L.

WELL_POSED = ("generic", "colinear 1e-2", "zero row", "masked rows")
COHORTS = WELL_POSED + ("colinear 1e-3", "colinear 1e-4", "duplicates", "K > d")


def _colinear(theta, k=4, d=10, seed=0):
    """k gradients at about ``theta`` rad (0.5..1.5 theta) from one direction."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(d, k + 1)))
    angle = theta * rng.uniform(0.5, 1.5, size=k)
    G = np.cos(angle)[:, None] * q[:, 0] + np.sin(angle)[:, None] * q[:, 1:].T
    return G * rng.uniform(0.5, 2.0, size=(k, 1))


def _cohort(name, seed=0):
    """(G [K, 10], mask or None, A [K, 10, 10], d~ [K], gamma0 [K])."""
    rng = np.random.default_rng(seed)
    generic = rng.normal(size=(6, 10)) * rng.uniform(0.5, 2.0, size=(6, 1))
    mask = None
    if name == "generic":
        G = generic
    elif name.startswith("colinear"):
        G = _colinear(float(name.split()[1]))
    elif name == "duplicates":  # same g, different curvature: different decrements
        G = np.vstack([generic[:3], generic[0], generic[1], generic[0]])
    elif name == "K > d":
        G = rng.normal(size=(13, 10)) * rng.uniform(0.5, 2.0, size=(13, 1))
    elif name == "zero row":
        G = np.vstack([generic[:4], np.zeros((1, 10)), generic[4:]])
    else:  # masked rows hold finite junk
        G = np.vstack([generic[:4], 1e3 * rng.normal(size=(2, 10))])
        mask = np.array([True] * 4 + [False] * 2)
    k = len(G)
    q = np.linalg.qr(rng.normal(size=(k, 10, 10)))[0]
    eig = rng.uniform(0.5, 3.0, size=(k, 10))
    A = np.einsum("kij,kj,klj->kil", q, eig, q)
    dt = np.einsum("ki,ki->k", G, np.linalg.solve(A, G[..., None])[..., 0])
    if name == "zero row":
        dt[4] = 5.0
    return G, mask, A, dt, 1.0 / eig.max(axis=1)


def _kept(G, mask):
    keep = np.linalg.norm(G, axis=1) > 0
    return keep if mask is None else keep & mask


def np_min_norm(G, dt):
    """Min-norm least squares of the row-normalised G^T v = d~ (float64)."""
    norm = np.linalg.norm(G, axis=1)
    return np.linalg.lstsq(G / norm[:, None], dt / norm, rcond=None)[0]


def np_truncated(G, dt, ridge):
    """The same with the normalised Gram's eigenvalues <= ridge * max dropped."""
    norm = np.linalg.norm(G, axis=1)
    Gn, dn = G / norm[:, None], dt / norm
    values, vectors = np.linalg.eigh(Gn @ Gn.T)
    inverse = np.where(values > ridge * values.max(), 1 / np.maximum(values, 1e-300), 0.0)
    return Gn.T @ (vectors @ (inverse * (vectors.T @ dn)))


def _combine_in(precision, G, dt, mask, **kwargs):
    """dqn_combine in float32, or under x64 on float64 vectors; results as float64."""
    dtype = jnp.float64 if precision == "x64" else jnp.float32
    with jax.enable_x64(precision == "x64"):
        comb = _combine(_tree(G, len(G), dtype), jnp.asarray(dt, dtype),
                        None if mask is None else jnp.asarray(mask), **kwargs)
        assert _flat(comb.v).dtype == np.float64 and comb.v["w"].dtype == dtype
        assert comb.S.dtype == comb.w.dtype == comb.realised.dtype == dtype
    return comb


@pytest.mark.parametrize("solver", ["eigh", "cholesky"])
@pytest.mark.parametrize("precision", ["float32", "x64"])
def test_logged_statistics_and_the_cap_come_from_the_step_taken(precision, solver):
    """S = ||v||^2 and r = G^T v of the returned step, 0 / lambda 0 / w 0 for dropped
    rows, the cap recomputed from those, and Theorem 4.2's guarantee: no kept client's
    linearised or actual (quadratic) loss rises under the capped step."""
    rtol = 1e-5 if precision == "float32" else 1e-11
    for name in COHORTS:
        G, mask, A, dt, gamma0 = _cohort(name)
        keep = _kept(G, mask)
        comb = _combine_in(precision, G, dt, mask, solver=solver)
        v = _flat(comb.v)
        S, r = v @ v, G @ v
        np.testing.assert_allclose(float(comb.S), S, rtol=rtol, err_msg=name)
        scale = np.linalg.norm(G, axis=1) * np.linalg.norm(v)
        assert np.all(np.abs(np.asarray(comb.realised)[keep] - r[keep])
                      <= rtol * scale[keep]), name
        np.testing.assert_array_equal(np.asarray(comb.kept), keep)
        for dropped in (comb.realised, comb.w, comb.lam):
            assert np.all(np.asarray(dropped)[~keep] == 0.0), name
        lam = np.asarray(comb.lam, np.float64)
        assert np.all(lam >= 0) and abs(lam.sum() - 1.0) < 1e-5, name
        with jax.enable_x64(precision == "x64"):
            t = float(D.step_factor(comb, jnp.asarray(gamma0), step_cap="thm42"))
        lipschitz, low = np.max(1 / gamma0[keep]), np.min(r[keep])
        expected = min(1.0, 2 * low / (lipschitz * S)) if low > 0 and S > 0 else 0.0
        np.testing.assert_allclose(t, expected, rtol=1e-4, atol=1e-12, err_msg=name)
        if name in WELL_POSED:
            assert t > 0, name  # the guarantee below is not met by standing still
        linear = t * r[keep]
        quadratic = -t * r + 0.5 * t * t * np.einsum("i,kij,j->k", v, A, v)
        tol = 1e-4 * (np.abs(linear) + t * t * lipschitz * S) + 1e-12
        assert np.all(linear >= -tol), name
        assert np.all(quadratic[keep] <= tol), name


@pytest.mark.parametrize("precision", ["float32", "x64"])
def test_default_solver_reaches_the_float64_reference(precision):
    """Well posed: the literal eqs. 7-17 (about 1e-10 under x64). Duplicates and
    K > d: the min-norm least-squares limit. Colinear to 1e-3 / 1e-4 rad: the default
    ridge 1e-6 is the numerical rank (float32's Gram cannot resolve those angles);
    under x64 with ridge 0 the step is the literal one again."""
    for name in COHORTS:
        G, mask, _, dt, _ = _cohort(name)
        keep = _kept(G, mask)
        v = _flat(_combine_in(precision, G, dt, mask).v)
        if name in WELL_POSED:
            reference = np_literal(G[keep], dt[keep])[3] * np_literal(G[keep], dt[keep])[2]
            np.testing.assert_allclose(np_min_norm(G[keep], dt[keep]), reference,
                                       rtol=1e-9, atol=1e-12, err_msg=name)
        elif name.startswith("colinear"):
            reference = np_truncated(G, dt, 1e-6)
        else:
            reference = np_min_norm(G, dt)
        tol = {"float32": 2e-2 if name == "colinear 1e-2" else 1e-4,
               "x64": 1e-9 if name == "colinear 1e-2" else 1e-10}[precision]
        assert np.linalg.norm(v - reference) <= tol * np.linalg.norm(reference), name
    if precision == "x64":
        for name, tol in (("colinear 1e-3", 1e-7), ("colinear 1e-4", 1e-5)):
            G, _, _, dt, _ = _cohort(name)
            v = _flat(_combine_in("x64", G, dt, None, ridge=0.0).v)
            _, _, S, d = np_literal(G, dt)
            assert np.linalg.norm(v - S * d) <= tol * np.linalg.norm(S * d), name


def test_a_bad_S_never_switches_the_cap_off():
    """Non-finite or non-positive S, or min_k r_k <= 0: Theorem 4.2's factor is 0 and
    the norm bound is 0 on a non-finite S; all d~ = 0 gives v = 0 and finite logs."""
    G, _, _, dt, gamma0 = _cohort("generic")
    comb = _combine(_tree(G, 6), jnp.asarray(dt, jnp.float32))
    gamma0 = jnp.asarray(gamma0, jnp.float32)
    assert 0 < float(D.step_factor(comb, gamma0, step_cap="thm42")) <= 1
    for S in (-1834.0, 0.0, np.nan, np.inf):
        bad = comb._replace(S=jnp.float32(S))
        assert float(D.step_factor(bad, gamma0, step_cap="thm42")) == 0.0, S
        if not np.isfinite(S):
            assert float(D.step_factor(bad, gamma0, max_step_norm=1.0)) == 0.0, S
    for r in (-1e-3, 0.0, np.nan):
        bad = comb._replace(realised=comb.realised.at[2].set(r))
        assert float(D.step_factor(bad, gamma0, step_cap="thm42")) == 0.0, r
    still = _combine(_tree(G, 6), jnp.zeros(6))
    assert np.all(_flat(still.v) == 0) and float(still.S) == 0
    for kwargs in ({"step_cap": "thm42"}, {"max_step_norm": 1.0}, {}):
        assert np.isfinite(float(D.step_factor(still, gamma0, **kwargs)))


def test_x64_accumulates_the_gram_and_the_weights_in_float64():
    """Float32 client vectors under x64: M equals the float64 products of the float32
    values (float32 accumulation is off by about 1e-7 at this width), column blocks
    included; r and S likewise; the aggregator logs float64 and keeps the params'
    dtype in its direction."""
    rng = np.random.default_rng(7)
    with jax.enable_x64(True):
        tree = {"a": jnp.asarray(rng.normal(size=(3, 40000)), jnp.float32),
                "b": jnp.asarray(rng.normal(size=(3, 5, 7)), jnp.float32)}
        flat = np.concatenate([np.asarray(tree["a"], np.float64),
                               np.asarray(tree["b"], np.float64).reshape(3, -1)], 1)
        for block in (None, 7000):
            gram = jax.jit(D.gram_matrix, static_argnums=(1, 2))(tree, 3, block)
            assert gram.dtype == jnp.float64
            np.testing.assert_allclose(gram, flat @ flat.T, rtol=1e-13)
        v = jax.tree.map(lambda x: x[0], tree)
        products = jax.jit(D.client_products, static_argnums=(2, 3))(tree, v, 3, 7000)
        np.testing.assert_allclose(products, flat @ flat[0], rtol=1e-13)
        np.testing.assert_allclose(jax.jit(D.sq_norm, static_argnums=1)(v, 7000),
                                   flat[0] @ flat[0], rtol=1e-13)
        comb = _combine(tree, jnp.asarray([1.0, 2.0, 0.5], jnp.float32))
        assert comb.w.dtype == comb.S.dtype == jnp.float64
        assert comb.v["a"].dtype == jnp.float32
        # the aggregator: float64 logs, the direction in the params' dtype, masked rows 0
        G, mask, _, dt, gamma0 = _cohort("masked rows")
        g = _tree(G, 6)
        outputs = ClientOutput(delta=g, loss_before=jnp.zeros(6), num_examples=jnp.ones(6),
                               num_steps=jnp.ones(6), train_loss=jnp.zeros(6),
                               extra={"g": g, "dtilde": jnp.asarray(dt, jnp.float32),
                                      "gamma0": jnp.asarray(gamma0, jnp.float32)})
        params = jax.tree.map(lambda x: x[0], g)
        ctx = ServerContext(params, jnp.int32(0), jax.random.key(0), jnp.arange(6),
                            jnp.asarray(mask))
        agg = D.dqn_aggregator(step_cap="thm42")
        direction, _, info = jax.jit(agg.aggregate)(agg.init(params, 6), outputs,
                                                    jnp.ones(6), ctx)
        assert direction["w"].dtype == jnp.float32
        assert info["S"].dtype == info["realised_decrease"].dtype == jnp.float64
        assert np.all(np.asarray(info["realised_decrease"])[~mask] == 0)
        assert np.all(np.asarray(info["lambda"])[~mask] == 0)
        assert 0 < float(info["step_factor"]) <= 1


def test_derivative_of_the_step_on_duplicated_and_masked_rows():
    """The pseudo-inverse is differentiated at fixed rank (no 1 / (lambda_i -
    lambda_j), so the repeated eigenvalues of duplicated or masked rows give no NaN):
    the JVP of v matches a central difference along a rank-preserving direction."""
    G, mask, _, dt, _ = _cohort("duplicates")
    G = np.vstack([G, np.ones((2, 10))])
    mask = np.array([True] * 6 + [False] * 2)
    rng = np.random.default_rng(3)
    dG = rng.normal(size=G.shape)
    dG[3], dG[4], dG[5] = dG[0], dG[1], dG[0]  # duplicates stay duplicates
    dd = rng.normal(size=len(dt) + 2)
    dt = np.append(dt, [1.0, 1.0])
    with jax.enable_x64(True):
        def flat_step(t):
            comb = D.dqn_combine(_tree(G + t * dG, len(G), jnp.float64),
                                 jnp.asarray(dt + t * dd), jnp.asarray(mask))
            return jnp.concatenate([comb.v["w"].reshape(-1), comb.v["b"].reshape(-1)])

        tangent = np.asarray(jax.jit(lambda t: jax.jvp(flat_step, (t,), (1.0,))[1])(0.0))
        grad = float(jax.jit(jax.grad(lambda t: jnp.sum(flat_step(t))))(0.0))
        h = 1e-6
        central = np.asarray(jax.jit(lambda t: (flat_step(t + h) - flat_step(t - h))
                                     / (2 * h))(0.0))
    assert np.all(np.isfinite(tangent))
    np.testing.assert_allclose(tangent, central, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(grad, central.sum(), rtol=1e-6)
