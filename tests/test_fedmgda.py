"""FedMGDA+ (Hu et al., IEEE TNSE 2022) and the box-capped-simplex QP solver.

References are literal float64 NumPy: the projection by 200-step bisection on its
definition, the QP by enumerating every face of the box (each coordinate at lo, at
hi or free; solve the KKT system of the face; keep the feasible point with the
smallest objective), and FedMGDA+ as normalise -> Gram -> box -> that QP. Problems
have a fixed size so every jitted solver compiles once.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from fedjax_fair.core import mixing as mixing_lib
from fedjax_fair.solvers import qp
from fedjax_fair.algorithms import method_hparams
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.algorithms.fedmgda import (fedmgda_plus, fedmgda_plus_aggregator,
                                            fedmgda_plus_direction, fedmgda_plus_lambdas,
                                            mgda_box, normalized_gram, server_schedule)
from fedjax_fair.core.client import ClientTraining, proximal_term
from fedjax_fair.core.types import ClientOutput, ServerContext

K = 5  # problem size of the QP tests (one compile per solver configuration)
BATCH = 16
QP_ITERS = 300


# ------------------------------------------------------------------ NumPy references


def project_reference(v, lo, hi):
    """clip(v - tau, lo, hi) with sum = 1, tau by 200 float64 bisection steps."""
    v, lo, hi = (np.asarray(a, np.float64) for a in (v, lo, hi))
    a, b = np.min(v - hi), np.max(v - lo)
    for _ in range(200):
        mid = 0.5 * (a + b)
        if np.clip(v - mid, lo, hi).sum() >= 1.0:
            a = mid
        else:
            b = mid
    return np.clip(v - 0.5 * (a + b), lo, hi)


def qp_reference(q, c, lo, hi):
    """argmin 0.5 x'Qx + c'x over {sum x = 1, lo <= x <= hi} by enumerating faces."""
    q, c, lo, hi = (np.asarray(a, np.float64) for a in (q, c, lo, hi))
    k = len(c)
    pinned = lo == hi
    best, best_f = None, np.inf
    choices = [(0,) if pinned[i] else (0, 1, 2) for i in range(k)]  # lo, free, hi
    for status in itertools.product(*choices):
        status = np.asarray(status)
        x = np.where(status == 2, hi, lo).copy()
        free = status == 1
        rest = 1.0 - x[~free].sum()
        nf = int(free.sum())
        if nf:
            # Q_FF x_F + nu 1 = -(c_F + Q_FB x_B),  1'x_F = rest
            a = np.zeros((nf + 1, nf + 1))
            a[:nf, :nf] = q[np.ix_(free, free)]
            a[:nf, nf] = 1.0
            a[nf, :nf] = 1.0
            rhs = np.concatenate([-(c[free] + q[np.ix_(free, ~free)] @ x[~free]), [rest]])
            x[free] = np.linalg.lstsq(a, rhs, rcond=None)[0][:nf]
        if (np.all(x >= lo - 1e-10) and np.all(x <= hi + 1e-10)
                and abs(x.sum() - 1.0) < 1e-6):
            f = 0.5 * x @ q @ x + c @ x
            if f < best_f - 1e-15:
                best, best_f = x, f
    return best


def fedmgda_reference(deltas, center, eps):
    """Literal FedMGDA+: g_k = Delta_k / ||Delta_k||, lambda* of the boxed min-norm QP,
    d = sum lambda*_k g_k. ``deltas`` [K, D] float64; rows with center 0 are out."""
    deltas = np.asarray(deltas, np.float64)
    center = np.asarray(center, np.float64)
    norms = np.linalg.norm(deltas, axis=1)
    active = (center > 0) & (norms > 0)
    g = np.where(active[:, None], deltas / np.where(norms > 0, norms, 1.0)[:, None], 0.0)
    lo = np.where(center > 0, np.maximum(center - eps, 0.0), 0.0)
    hi = np.where(center > 0, np.minimum(center + eps, 1.0), 0.0)
    lam = qp_reference(g @ g.T, np.zeros(len(center)), lo, hi)
    return lam, lam @ g


# ------------------------------------------------------------------ random problems


def random_box(rng, k=K, eps=None, masked=0):
    """A simplex point p (``masked`` zero entries), eps and its box."""
    p = rng.dirichlet(np.ones(k - masked))
    p = np.concatenate([p, np.zeros(masked)])
    rng.shuffle(p)
    eps = rng.choice([0.02, 0.1, 0.3, 1.0]) if eps is None else eps
    lo = np.where(p > 0, np.maximum(p - eps, 0), 0)
    hi = np.where(p > 0, np.minimum(p + eps, 1), 0)
    return p, lo, hi


def random_qp(rng, k=K):
    a = rng.normal(size=(k, k + 2))
    q = a @ a.T / (k + 2) + 0.05 * np.eye(k)  # positive definite
    c = rng.normal(size=k) * rng.choice([0.0, 0.3])
    return q, c


def stack32(items):
    return tuple(jnp.asarray(np.stack(col), jnp.float32) for col in zip(*items))


def solver(method="sort", num_iters=QP_ITERS):
    return jax.jit(jax.vmap(lambda q, c, lo, hi, x0: qp.solve_box_simplex_qp(
        q, c, lo, hi, num_iters=num_iters, x0=x0, method=method)))


SOLVE = solver()
KKT = jax.jit(jax.vmap(qp.kkt_residual))
SOLVE_ONE = jax.jit(lambda q, c, lo, hi, x0: qp.solve_box_simplex_qp(q, c, lo, hi,
                                                                     num_iters=QP_ITERS, x0=x0))


# ------------------------------------------------------------------ projection


@pytest.mark.parametrize("method", ["sort", "bisect"])
def test_projection_matches_bisection_reference(method):
    rng = np.random.default_rng(0)
    cases = []
    for i in range(64):
        p, lo, hi = random_box(rng, masked=i % 3)
        v = rng.normal(size=K) * rng.choice([0.1, 1.0, 5.0])
        if i % 8 == 0:  # a point already inside: projection is the identity
            v = p
        cases.append((v, lo, hi))
    v, lo, hi = stack32(cases)
    x = np.asarray(jax.jit(jax.vmap(lambda *a: qp.project_box_simplex(*a, method=method)))(
        v, lo, hi))
    ref = np.stack([project_reference(*case) for case in cases])
    np.testing.assert_allclose(x, ref, atol=5e-6)
    np.testing.assert_allclose(x.sum(1), 1.0, atol=2e-6)
    assert np.all(x >= np.asarray(lo)) and np.all(x <= np.asarray(hi))
    # and it is the QP argmin 0.5||x||^2 - v'x (the projection's definition)
    for case, xi in list(zip(cases, x))[:6]:
        np.testing.assert_allclose(xi, qp_reference(np.eye(K), -case[0], case[1], case[2]),
                                   atol=5e-6)


@pytest.mark.parametrize("method", ["sort", "bisect"])
def test_projection_infeasible_box_returns_nearest_corner(method):
    project = jax.jit(jax.vmap(lambda *a: qp.project_box_simplex(*a, method=method)))
    v = np.asarray([0.3, -1.0, 2.0, 0.0, 0.7], np.float32)
    zeros, ones = np.zeros(K, np.float32), np.ones(K, np.float32)
    hi = np.asarray([0.1, 0.2, 0.3, 0.0, 0.1], np.float32)  # sum hi = 0.7 < 1
    lo = np.asarray([0.5, 0.4, 0.3, 0.0, 0.0], np.float32)  # sum lo = 1.2 > 1
    pin_lo = np.asarray([0.2, 0, 0, 0, 0], np.float32)  # lo = hi pins x_0 = 0.2, x_3 = 0
    pin_hi = np.asarray([0.2, 1, 1, 0, 1], np.float32)
    x = np.asarray(project(jnp.asarray(np.stack([v, v, v])),
                           jnp.asarray(np.stack([zeros, lo, pin_lo])),
                           jnp.asarray(np.stack([hi, ones, pin_hi]))))
    np.testing.assert_array_equal(x[0], hi)
    np.testing.assert_array_equal(x[1], lo)
    assert x[2, 0] == pytest.approx(0.2) and x[2, 3] == 0.0
    assert x[2].sum() == pytest.approx(1.0, abs=1e-6)
    np.testing.assert_allclose(x[2], project_reference(v, pin_lo, pin_hi), atol=1e-6)
    if method == "sort":  # kkt_residual reports the violated sum constraint
        res = KKT(jnp.asarray(np.stack([np.eye(K)] * 2), jnp.float32), jnp.zeros((2, K)),
                  jnp.asarray(x[:2]), jnp.asarray(np.stack([zeros, lo])),
                  jnp.asarray(np.stack([hi, ones])))
        assert np.all(np.asarray(res) >= [0.3 - 1e-6, 0.2 - 1e-6])


# ------------------------------------------------------------------ QP solver


def _qp_batch(seed):
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(BATCH):
        q, c = random_qp(rng)
        p, lo, hi = random_box(rng, masked=i % 2)
        cases.append((q, c, lo, hi, p))
    return cases


def test_qp_matches_enumeration_reference_and_kkt():
    """Matches a float64 reference; KKT residual ~ 0."""
    cases = _qp_batch(1)
    q, c, lo, hi, p = stack32(cases)
    x = np.asarray(SOLVE(q, c, lo, hi, p))
    ref = np.stack([qp_reference(*case[:4]) for case in cases])
    np.testing.assert_allclose(x, ref, atol=1e-4)
    f = lambda qq, cc, xx: 0.5 * xx @ qq @ xx + cc @ xx
    for (qq, cc, *_), xi, ri in zip(cases, x, ref):
        assert f(qq, cc, xi.astype(np.float64)) <= f(qq, cc, ri) + 1e-6
    assert np.all(np.asarray(KKT(q, c, jnp.asarray(x), lo, hi)) < 1e-4)
    assert np.all(x >= np.asarray(lo) - 1e-7) and np.all(x <= np.asarray(hi) + 1e-7)
    np.testing.assert_allclose(x.sum(1), 1.0, atol=1e-5)
    # KKT residual detects a non-optimal feasible point (the start p) and infeasibility
    kkt_start = np.asarray(KKT(q, c, p, lo, hi))
    moved = np.abs(ref - np.asarray(p)).max(1) > 1e-2
    assert moved.any() and np.all(kkt_start[moved] > 1e-3)
    bad = np.asarray(KKT(q, c, jnp.asarray(ref, jnp.float32) + 0.01, lo, hi))
    assert np.all(bad > 0.04)


def test_qp_vmap_equals_loop_and_jit():
    cases = _qp_batch(3)
    args = stack32(cases)
    batched = np.asarray(SOLVE(*args))
    for i in range(4):
        np.testing.assert_allclose(np.asarray(SOLVE_ONE(*(a[i] for a in args))), batched[i],
                                   atol=1e-6)


def test_qp_gradient_envelope_theorem():
    """d/dc min_x f(x; c) = x*(c): reverse mode through the unrolled iterations."""
    rng = np.random.default_rng(4)
    q, c = random_qp(rng)
    p, lo, hi = random_box(rng, eps=0.3)
    q, c, lo, hi, p = (jnp.asarray(a, jnp.float32) for a in (q, c, lo, hi, p))

    def value(c):
        x = qp.solve_box_simplex_qp(q, c, lo, hi, num_iters=150, x0=p)
        return qp.qp_objective(q, c, x), x

    grad, x = jax.jit(jax.grad(value, has_aux=True))(c)
    grad, x = np.asarray(grad), np.asarray(x)
    assert np.all(np.isfinite(grad))
    np.testing.assert_allclose(grad, x, atol=2e-3)


def test_qp_linear_objective_and_argument_checks():
    # Q = 0: the LP puts as much mass as the box allows on the smallest c_k
    c = jnp.asarray([0.3, -0.2, 0.1, 0.0, 0.2], jnp.float32)
    lo = jnp.zeros(K)
    hi = jnp.full((K,), 0.6)
    x = SOLVE_ONE(jnp.zeros((K, K)), c, lo, hi, jnp.full((K,), 1.0 / K))
    np.testing.assert_allclose(np.asarray(x), [0, 0.6, 0, 0.4, 0], atol=1e-6)
    with pytest.raises(ValueError, match="^num_iters: "):
        qp.solve_box_simplex_qp(jnp.eye(K), c, lo, hi, num_iters=-1)
    with pytest.raises(ValueError, match="^method: "):
        qp.project_box_simplex(c, lo, hi, method="newton")


# ------------------------------------------------------------------ FedMGDA+ rule


def _deltas(rng, k=K, masked=0, scales=None):
    """A two-leaf delta pytree [K, ...] and its flat float64 view [K, 30]."""
    w = rng.normal(size=(k, 4, 6))
    b = rng.normal(size=(k, 6))
    if scales is not None:
        w, b = w * scales[:, None, None], b * scales[:, None]
    flat = np.concatenate([w.reshape(k, -1), b], axis=1)
    return {"w": jnp.asarray(w, jnp.float32), "b": jnp.asarray(b, jnp.float32)}, flat


def _flatten(direction):
    return np.concatenate([np.asarray(direction["w"]).reshape(-1), np.asarray(direction["b"])])


DIRECTION = jax.jit(lambda d, p, eps: fedmgda_plus_direction(d, p, eps, qp_iters=QP_ITERS))


def test_epsilon_zero_gives_data_weights_exactly():
    rng = np.random.default_rng(5)
    deltas, flat = _deltas(rng, scales=rng.uniform(0.01, 10, size=K))
    p = jnp.asarray(rng.dirichlet(np.ones(K)), jnp.float32)
    direction, lam = DIRECTION(deltas, p, 0.0)
    np.testing.assert_array_equal(np.asarray(lam), np.asarray(p))
    g = flat / np.linalg.norm(flat, axis=1, keepdims=True)
    np.testing.assert_allclose(_flatten(direction), np.asarray(p, np.float64) @ g, atol=1e-6)


def test_epsilon_one_two_clients_closed_form():
    """Plain MGDA: min_{a in [0,1]} ||a g1 + (1-a) g2||^2 has
    a* = clip((g2 - g1).g2 / ||g1 - g2||^2, 0, 1); the centre does not matter."""
    rng = np.random.default_rng(6)
    for trial in range(6):
        deltas, flat = _deltas(rng, k=2, scales=rng.uniform(0.1, 3, size=2))
        if trial == 5:  # nearly opposite updates: an interior a*
            flat[1] = -flat[0] * 2.0 + 0.1 * rng.normal(size=flat.shape[1])
            deltas = {"w": jnp.asarray(flat[:, :24].reshape(2, 4, 6), jnp.float32),
                      "b": jnp.asarray(flat[:, 24:], jnp.float32)}
        g = flat / np.linalg.norm(flat, axis=1, keepdims=True)
        a = np.clip((g[1] - g[0]) @ g[1] / np.sum((g[0] - g[1]) ** 2), 0, 1)
        for centre in ([0.5, 0.5], [0.9, 0.1]):
            direction, lam = DIRECTION(deltas, jnp.asarray(centre, jnp.float32), 1.0)
            np.testing.assert_allclose(np.asarray(lam), [a, 1 - a], atol=1e-5)
            np.testing.assert_allclose(_flatten(direction), a * g[0] + (1 - a) * g[1],
                                       atol=1e-5)


def test_matches_literal_reference_and_constraints():
    """lambda* and d against the float64 literal FedMGDA+, for several eps, with
    masked rows; lambda* on the simplex and inside the box."""
    rng = np.random.default_rng(7)
    for i, eps in enumerate([0.02, 0.1, 0.3, 0.5, 1.0, 1.0]):
        deltas, flat = _deltas(rng, scales=rng.uniform(0.05, 5, size=K))
        if i == 5:  # correlated updates: MGDA moves far from the centre
            flat = flat + 3.0 * rng.normal(size=(1, flat.shape[1]))
            deltas = {"w": jnp.asarray(flat[:, :24].reshape(K, 4, 6), jnp.float32),
                      "b": jnp.asarray(flat[:, 24:], jnp.float32)}
        p, lo, hi = random_box(rng, eps=eps, masked=i % 3)
        direction, lam = DIRECTION(deltas, jnp.asarray(p, jnp.float32), eps)
        lam = np.asarray(lam)
        ref_lam, ref_d = fedmgda_reference(flat, p, eps)
        np.testing.assert_allclose(lam, ref_lam, atol=2e-4)
        np.testing.assert_allclose(_flatten(direction), ref_d, atol=2e-4)
        assert abs(lam.sum() - 1) <= 1e-5 and lam.min() >= -1e-6
        assert np.all(lam >= lo - 1e-6) and np.all(lam <= hi + 1e-6)
        assert np.all(lam[p == 0] == 0)
        assert np.linalg.norm(_flatten(direction)) <= 1 + 1e-5  # hull of unit vectors


def test_mgda_direction_is_a_common_descent_direction():
    """eps = 1: KKT of the min-norm point gives g_k . d >= ||d||^2 for every client."""
    rng = np.random.default_rng(8)
    for _ in range(4):
        deltas, flat = _deltas(rng)
        flat = flat + 2.0 * rng.normal(size=(1, flat.shape[1]))  # a shared component
        deltas = {"w": jnp.asarray(flat[:, :24].reshape(K, 4, 6), jnp.float32),
                  "b": jnp.asarray(flat[:, 24:], jnp.float32)}
        direction, _ = DIRECTION(deltas, jnp.full((K,), 1.0 / K, jnp.float32), 1.0)
        d = _flatten(direction)
        g = flat / np.linalg.norm(flat, axis=1, keepdims=True)
        assert np.linalg.norm(d) > 1e-3
        assert np.all(g @ d >= d @ d - 1e-4)


def test_identical_normalised_updates_give_that_direction():
    rng = np.random.default_rng(9)
    base, flat = _deltas(rng, k=1)
    scales = np.asarray([0.01, 1.0, 7.0, 0.5, 100.0], np.float32)
    deltas = jax.tree.map(lambda x: jnp.asarray(scales.reshape((K,) + (1,) * (x.ndim - 1))
                                                * np.asarray(x)[0:1]), base)
    g = flat[0] / np.linalg.norm(flat[0])
    for eps in (0.0, 0.1, 1.0):
        p = jnp.asarray(rng.dirichlet(np.ones(K)), jnp.float32)
        direction, lam = DIRECTION(deltas, p, eps)
        np.testing.assert_allclose(_flatten(direction), g, atol=1e-5)
        assert float(jnp.sum(lam)) == pytest.approx(1.0, abs=1e-5)


def test_masked_zero_and_empty_rows():
    rng = np.random.default_rng(10)
    deltas, flat = _deltas(rng)
    p = jnp.asarray([0.4, 0.0, 0.35, 0.25, 0.0], jnp.float32)  # rows 1 and 4 out
    d1, lam1 = DIRECTION(deltas, p, 0.5)
    big = np.asarray([1, 1e6, 1, 1, 1e6], np.float32)
    garbage = jax.tree.map(lambda x: jnp.asarray(big.reshape((K,) + (1,) * (x.ndim - 1))
                                                 * np.asarray(x)), deltas)
    d2, lam2 = DIRECTION(garbage, p, 0.5)
    np.testing.assert_array_equal(np.asarray(lam1)[[1, 4]], 0.0)
    np.testing.assert_allclose(np.asarray(lam2), np.asarray(lam1), atol=1e-7)
    np.testing.assert_allclose(_flatten(d2), _flatten(d1), atol=1e-6)
    # a participant with a zero update: guarded, finite; MGDA then stalls (d = 0)
    first = np.asarray([0, 1, 1, 1, 1], np.float32)
    zero = jax.tree.map(lambda x: jnp.asarray(first.reshape((K,) + (1,) * (x.ndim - 1))
                                              * np.asarray(x)), deltas)
    d3, lam3 = DIRECTION(zero, jnp.full((K,), 1.0 / K, jnp.float32), 1.0)
    assert helpers.tree_all_finite((d3, lam3))
    assert float(lam3[0]) == pytest.approx(1.0, abs=1e-4)
    assert np.linalg.norm(_flatten(d3)) < 1e-3
    # nobody active: zero weights, zero direction
    d4, lam4 = DIRECTION(deltas, jnp.zeros((K,), jnp.float32), 0.5)
    np.testing.assert_array_equal(np.asarray(lam4), 0.0)
    np.testing.assert_array_equal(_flatten(d4), 0.0)


def test_normalized_gram_and_box():
    rng = np.random.default_rng(11)
    deltas, flat = _deltas(rng)
    gram, inv_norm = jax.jit(normalized_gram)(deltas)
    g = flat / np.linalg.norm(flat, axis=1, keepdims=True)
    np.testing.assert_allclose(np.asarray(gram), g @ g.T, atol=1e-6)
    np.testing.assert_allclose(np.asarray(inv_norm), 1 / np.linalg.norm(flat, axis=1),
                               rtol=1e-5)
    lo, hi = jax.jit(mgda_box)(jnp.asarray([0.7, 0.3, 0.0]), 0.5)
    np.testing.assert_allclose(np.asarray(lo), [0.2, 0.0, 0.0], atol=1e-7)
    np.testing.assert_allclose(np.asarray(hi), [1.0, 0.8, 0.0], atol=1e-7)


def test_vmap_over_epsilon():
    """The rule is a pure function of eps: one vmapped solve over the grid."""
    rng = np.random.default_rng(12)
    deltas, flat = _deltas(rng)
    gram, _ = jax.jit(normalized_gram)(deltas)
    p = jnp.asarray(rng.dirichlet(np.ones(K)), jnp.float32)
    grid = jnp.asarray([0.0, 0.1, 0.5, 1.0], jnp.float32)
    lams = jax.jit(jax.vmap(lambda e: fedmgda_plus_lambdas(gram, p, e, qp_iters=QP_ITERS)))(
        grid)
    for e, lam in zip(np.asarray(grid), np.asarray(lams)):
        ref, _ = fedmgda_reference(flat, np.asarray(p), float(e))
        np.testing.assert_allclose(lam, ref, atol=2e-4)
    # ||d(eps)||^2 is non-increasing in eps (a larger box, a smaller minimum)
    norms = [float(l @ np.asarray(gram) @ l) for l in np.asarray(lams)]
    assert all(a >= b - 1e-6 for a, b in zip(norms, norms[1:]))


# ------------------------------------------------------------------ algorithm


MODEL = helpers.logreg()
PARAMS = helpers.init_params(MODEL, 1)
DATA = helpers.tiny_federation()


def _numpy_round(params, ids, mask, lr, epochs, mu):
    """Deltas of full-batch GD clients (B >= n_k: one step per epoch) in NumPy."""
    w0, b0 = helpers.logreg_to_numpy(params)
    flat, sizes = [], []
    for k, m in zip(ids, mask):
        x, y = helpers.real_rows(DATA.train, [k])
        w, b = helpers.logreg_gd_numpy(params, x, y, lr, epochs if len(y) else 0, mu)
        flat.append(np.concatenate([b0 - b, (w0 - w).ravel()]))  # tree order: bias, kernel
        sizes.append(len(y) if m else 0)
    sizes = np.asarray(sizes, np.float64)
    return np.stack(flat), sizes / sizes.sum()


def _fedmgda_with_proximal_clients(mu, *, epsilon, server_lr, server_lr_decay, decay_every,
                                   qp_iters, training):
    """FedMGDA+ with FedProx clients: the factory's pieces (data-weight centre, the
    FedMGDA+ aggregator, the sgd(eta_t) server step) on FedAvg clients that add
    (mu / 2) ||w - w^t||^2 (the factory takes no regularizer)."""
    return fedavg(MODEL, training=training,
                  regularizer=proximal_term(mu), mixing=mixing_lib.by_num_examples(),
                  aggregator=fedmgda_plus_aggregator(epsilon, qp_iters=qp_iters),
                  server_optimizer=optax.sgd(server_schedule(server_lr, server_lr_decay,
                                                             decay_every)))


@pytest.mark.parametrize("mu", [0.0, 0.05])
def test_end_to_end_rounds_and_server_schedule(mu):
    """A few rounds on the tiny federation (a padded cohort with a masked row, the
    empty client 2): round 0 against the literal NumPy FedMGDA+,
    eta_t = eta phi^floor(t / s) times ||d|| <= 1, finite params, loss goes down.
    mu = 0: the ``fedmgda_plus`` factory (FedAvg clients); mu > 0: the same pieces
    with FedProx clients."""
    lr, epochs, eps, eta = 0.3, 2, 0.5, 0.8
    kw = dict(epsilon=eps, server_lr=eta, server_lr_decay=0.5, decay_every=2,
              qp_iters=QP_ITERS,
              training=ClientTraining(lr=lr, batch_size=12, num_epochs=epochs))
    alg = (fedmgda_plus(MODEL, **kw) if mu == 0.0
           else _fedmgda_with_proximal_clients(mu, **kw))
    alg = helpers.bind_execution(alg, "sequential")
    apply = jax.jit(alg.apply)
    state = alg.init(PARAMS, DATA.num_clients)
    ids = [(0, 1, 2, 3), (4, 5, 1, 0), (3, 0, 4, 5), (1, 5, 3, 4), (0, 1, 4, 5)]
    losses = []
    for t, cohort_ids in enumerate(ids):
        before = state.params
        mask = [True, True, True, t % 2 == 1]
        state, metrics = apply(state, helpers.cohort(DATA.train, cohort_ids, mask=mask),
                               jax.random.key(t))
        step = helpers.tree_norm(helpers.tree_sub(before, state.params))
        norm = float(metrics["update_norm"])
        assert 0 < norm <= 1 + 1e-5
        assert step == pytest.approx(eta * 0.5 ** (t // 2) * norm, rel=1e-4)
        if t == 0:
            deltas, centre = _numpy_round(before, cohort_ids, mask, lr, epochs, mu)
            _, d = fedmgda_reference(deltas, centre, eps)
            got = np.concatenate([np.ravel(x) for x in jax.tree.leaves(
                helpers.tree_sub(before, state.params))])
            np.testing.assert_allclose(got, eta * d, atol=1e-5)
        losses.append(float(metrics["train_loss"]))
    assert helpers.tree_all_finite(state.params)
    assert int(state.round) == len(ids)
    assert losses[-1] < losses[0]


def test_aggregator_interface_with_uniform_center():
    """``fedmgda_plus_aggregator`` as a plain Aggregator: eps = 0 with uniform centre
    weights gives the mean of the normalised deltas (no state)."""
    rng = np.random.default_rng(13)
    deltas, flat = _deltas(rng)
    agg = fedmgda_plus_aggregator(0.0, qp_iters=5)
    state = agg.init(PARAMS, K)
    outputs = ClientOutput(delta=deltas, loss_before=jnp.zeros(K), num_examples=jnp.ones(K),
                           num_steps=jnp.ones(K, jnp.int32))
    ctx = ServerContext(params=PARAMS, round=jnp.zeros((), jnp.int32), key=jax.random.key(0),
                        client_ids=jnp.arange(K, dtype=jnp.int32),
                        client_mask=jnp.ones((K,), bool))
    direction, new_state, info = jax.jit(agg.aggregate)(
        state, outputs, jnp.full((K,), 1.0 / K, jnp.float32), ctx)
    g = flat / np.linalg.norm(flat, axis=1, keepdims=True)
    np.testing.assert_allclose(_flatten(direction), g.mean(0), atol=1e-6)
    assert new_state == state
    # eps = 0 pins lambda* at the centre, logged as info["lambdas"].
    np.testing.assert_allclose(np.asarray(info["lambdas"]), np.full(K, 1.0 / K), rtol=1e-6)


def test_factory_argument_errors():
    with pytest.raises(ValueError, match="^epsilon: "):
        fedmgda_plus(MODEL, epsilon=-0.1)
    with pytest.raises(ValueError, match="^epsilon: "):
        fedmgda_plus_aggregator("wide")
    with pytest.raises(ValueError, match="^qp_iters: "):
        fedmgda_plus(MODEL, qp_iters=-1)
    with pytest.raises(ValueError, match="^server_lr: "):
        fedmgda_plus(MODEL, server_lr=0.0)
    with pytest.raises(ValueError, match="^server_lr_decay: "):
        fedmgda_plus(MODEL, server_lr_decay=-1.0)
    with pytest.raises(ValueError, match="^decay_every: "):
        fedmgda_plus(MODEL, decay_every=0)
    with pytest.raises(ValueError, match="^center: "):
        fedmgda_plus(MODEL, center="median")
    with pytest.raises(ValueError, match="^center: "):
        fedmgda_plus(MODEL, center="uniform", mixing=mixing_lib.uniform())
    with pytest.raises(ValueError, match="^server_optimizer: "):
        fedmgda_plus(MODEL, server_lr=0.5, server_optimizer=optax.adam(0.1))
    with pytest.raises(TypeError):
        fedmgda_plus(MODEL, tilt=1.0)
    # The factory states FedAvg's local-training arguments (with FedAvg's ranges).
    hparams = method_hparams("fedmgda_plus")
    for name in ("client_lr", "batch_size", "num_epochs", "max_steps", "client_optimizer"):
        assert name in hparams, name
        assert hparams[name].range == method_hparams("fedavg")[name].range
    fedmgda_plus(MODEL, server_optimizer=optax.adam(0.1), center="uniform")  # accepted
