"""Small dense QPs over the box-capped simplex, jittable with fixed iteration counts.

Solves

    min_x  f(x) = 0.5 x^T Q x + c^T x
    s.t.   sum_k x_k = 1,   lo_k <= x_k <= hi_k                       (P)

for a symmetric positive semi-definite Q [K, K] (a Gram matrix, e.g. the min-norm
problem of MGDA / FedMGDA+, arXiv:2006.11489) with
accelerated projected gradient (FISTA, Beck & Teboulle, "A Fast Iterative
Shrinkage-Thresholding Algorithm for Linear Inverse Problems", SIAM J. Imaging Sci.
2009) and the gradient-based adaptive restart of O'Donoghue & Candès ("Adaptive
Restart for Accelerated Gradient Schemes", FoCM 2015):

    x^{i+1} = Proj(y^i - (Q y^i + c) / L)
    t^{i+1} = (1 + sqrt(1 + 4 (t^i)^2)) / 2
    y^{i+1} = x^{i+1} + (t^i - 1) / t^{i+1} (x^{i+1} - x^i)
    restart (t <- 1, y <- x^{i+1}) when (y^i - x^{i+1}) . (x^{i+1} - x^i) > 0,

with step 1 / L, L = min(trace Q, max_k sum_j |Q_kj|) >= lambda_max(Q) (both bounds
hold for a PSD matrix), and a fixed number of iterations.

The projection onto C = {x : sum x = 1, lo <= x <= hi} is x = clip(v - tau, lo, hi)
with the shift tau solving s(tau) = sum_k clip(v_k - tau, lo_k, hi_k) = 1. s is
continuous, non-increasing and piecewise linear with breakpoints v_k - hi_k and
v_k - lo_k, so it is found exactly (no inner iterations): sort the 2K breakpoints,
accumulate s(t) = C(t) - n(t) t at each of them (C collects the clipped and free
values, n counts the free coordinates), and interpolate on the linear piece that
crosses 1 (``method="sort"``, O(K log K)). ``method="bisect"`` instead bisects tau
over [min(v - hi), max(v - lo)] for a fixed number of steps and finishes with the
same exact step on the piece it lands on (cheaper for large K on a CPU).

Infeasible boxes (sum lo > 1 or sum hi < 1, i.e. C is empty): the projection returns
the box corner closest to the hyperplane sum x = 1, x = hi (when sum hi < 1) or
x = lo (when sum lo > 1), and ``kkt_residual`` reports the violation. Callers that
centre the box on a point p of the simplex (lo = max(0, p - eps),
hi = min(1, p + eps), FedMGDA+) are feasible by construction, since p itself is in C.
Coordinates with lo_k = hi_k (e.g. masked clients, lo = hi = 0) are pinned.

Everything is pure jnp / lax: works under ``jax.jit``, ``jax.vmap`` (over independent
problems) and ``jax.grad`` (through the unrolled iterations), in float32.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from fedjax_fair.core.sharding import replicated_here
from fedjax_fair.hparams import FieldError

PROJECTIONS = ("sort", "bisect")


def _check_method(method: str) -> None:
    if method not in PROJECTIONS:
        raise FieldError("method", f"must be one of {PROJECTIONS}, got {method!r}")


def _exact_shift(v, lo, hi, tau):
    """The root of s on the linear piece of s that contains ``tau``.

    On that piece the free coordinates F = {k : v_k - hi_k < tau < v_k - lo_k} are
    fixed, s(t) = sum_{not F} clip + sum_F v_k - |F| t, and s(t) = 1 gives t. When no
    coordinate is free (a flat piece), ``tau`` is returned unchanged.
    """
    at_hi = v - hi >= tau
    at_lo = v - lo <= tau
    free = ~(at_hi | at_lo)
    n_free = jnp.sum(free)
    fixed = jnp.sum(jnp.where(at_hi, hi, 0.0) + jnp.where(at_lo & ~at_hi, lo, 0.0))
    free_sum = jnp.sum(jnp.where(free, v, 0.0))
    solved = (free_sum + fixed - 1.0) / jnp.maximum(n_free, 1).astype(v.dtype)
    return jnp.where(n_free > 0, solved, tau)


def _shift_sort(v, lo, hi):
    """tau with sum clip(v - tau, lo, hi) = 1, from the sorted breakpoints (exact)."""
    k = v.shape[0]
    # Event "enter" at t = v - hi: the coordinate leaves hi and becomes free
    # (C += v - hi, n += 1); event "leave" at t = v - lo: it reaches lo (C += lo - v, n -= 1).
    points = jnp.concatenate([v - hi, v - lo])
    d_const = jnp.concatenate([v - hi, lo - v])
    d_free = jnp.concatenate([jnp.ones((k,), v.dtype), -jnp.ones((k,), v.dtype)])
    order = jnp.argsort(points)
    t = points[order]
    const = jnp.sum(hi) + jnp.cumsum(d_const[order])  # C just after each event
    n_free = jnp.cumsum(d_free[order])
    s = const - n_free * t  # s(t_j); s is continuous, so ties can be applied in any order
    above = s >= 1.0
    # The last breakpoint with s >= 1 (robust to rounding making s not quite monotone).
    j = jnp.maximum(jnp.max(jnp.where(above, jnp.arange(2 * k), -1)), 0)
    t_lo, t_hi = t[j], t[jnp.minimum(j + 1, 2 * k - 1)]
    slope_ok = n_free[j] > 0.5
    tau = jnp.where(slope_ok, (const[j] - 1.0) / jnp.where(slope_ok, n_free[j], 1.0), t_lo)
    tau = jnp.clip(tau, t_lo, t_hi)
    # Infeasible: sum hi < 1 (no s >= 1) -> below every breakpoint (x = hi);
    # sum lo > 1 (s >= 1 everywhere) -> above every breakpoint (x = lo).
    tau = jnp.where(jnp.any(above), tau, t[0])
    return jnp.where(jnp.all(above), t[-1], tau)


def _shift_bisect(v, lo, hi, num_bisect: int):
    """tau by ``num_bisect`` bisection steps on [min(v - hi), max(v - lo)], then the
    exact root on the linear piece reached."""
    def total(tau):
        return jnp.sum(jnp.clip(v - tau, lo, hi))

    def step(_, bracket):
        a, b = bracket
        mid = 0.5 * (a + b)
        big = total(mid) >= 1.0  # root to the right of mid
        return jnp.where(big, mid, a), jnp.where(big, b, mid)

    a0, b0 = jnp.min(v - hi), jnp.max(v - lo)
    a, b = lax.fori_loop(0, num_bisect, step, (a0, b0))
    mid = 0.5 * (a + b)
    tau = jnp.clip(_exact_shift(v, lo, hi, mid), a, b)
    # Keep whichever of (midpoint, exact step) meets the constraint better.
    tau = jnp.where(jnp.abs(total(tau) - 1.0) <= jnp.abs(total(mid) - 1.0), tau, mid)
    tau = jnp.where(total(a0) < 1.0, a0, tau)  # sum hi < 1: x = hi
    return jnp.where(total(b0) > 1.0, b0, tau)  # sum lo > 1: x = lo


def project_box_simplex(v, lo, hi, *, method: str = "sort", num_bisect: int = 40):
    """Euclidean projection of v onto {x : sum x = 1, lo <= x <= hi}.

    Parameters
    ----------
    v, lo, hi : float arrays [K]
        The point and the box (lo <= hi). lo_k = hi_k pins coordinate k.
    method : {"sort", "bisect"}
        How the shift tau of x = clip(v - tau, lo, hi) is found (module docstring).
    num_bisect : int
        Bisection steps for ``method="bisect"``.

    Returns
    -------
    x : float array [K]
        The projection; for an empty set, hi (sum hi < 1) or lo (sum lo > 1).
    """
    _check_method(method)
    v = jnp.asarray(v)
    lo = jnp.asarray(lo, v.dtype)
    hi = jnp.asarray(hi, v.dtype)
    if method == "sort":
        tau = _shift_sort(v, lo, hi)
    else:
        tau = _shift_bisect(v, lo, hi, num_bisect)
    return jnp.clip(v - tau, lo, hi)


def lipschitz_bound(q):
    """An upper bound on lambda_max of a symmetric PSD matrix: min(trace, max row
    |.|-sum) (the trace sums the non-negative eigenvalues; the row sum is Gershgorin's)."""
    trace = jnp.trace(q)
    row = jnp.max(jnp.sum(jnp.abs(q), axis=1))
    return jnp.minimum(trace, row)


def solve_box_simplex_qp(q, c, lo, hi, *, num_iters: int = 200, x0=None,
                         lipschitz: Optional[jax.Array] = None, method: str = "sort",
                         num_bisect: int = 40, restart: bool = True):
    """argmin 0.5 x^T Q x + c^T x over {sum x = 1, lo <= x <= hi} by FISTA (module doc).

    Parameters
    ----------
    q : float array [K, K]
        Q, symmetric positive semi-definite.
    c : float array [K]
        Linear term c.
    lo, hi : float arrays [K]
        Box bounds (lo <= hi); lo_k = hi_k pins x_k.
    num_iters : int
        Fixed number of accelerated projected-gradient iterations (0 returns
        Proj(x0)).
    x0 : float array [K], optional
        Starting point (projected first); default Proj(midpoint of the box).
    lipschitz : scalar, optional
        L in the step 1 / L; default ``lipschitz_bound(q)``. It must be >= lambda_max(Q).
    method, num_bisect : see ``project_box_simplex``.
    restart : bool
        Gradient-based adaptive restart of the momentum.

    Returns
    -------
    x : float array [K]
        The last iterate (always feasible when the set is not empty).
    """
    _check_method(method)
    if isinstance(num_iters, bool) or not isinstance(num_iters, int) or num_iters < 0:
        raise FieldError("num_iters", f"must be an integer >= 0, got {num_iters!r}")
    q = jnp.asarray(q)
    dtype = q.dtype
    q, c, lo, hi, x0 = replicated_here((q, jnp.asarray(c, dtype), jnp.asarray(lo, dtype),
                                        jnp.asarray(hi, dtype), x0))
    proj = lambda v: project_box_simplex(v, lo, hi, method=method, num_bisect=num_bisect)
    lip = lipschitz_bound(q) if lipschitz is None else jnp.asarray(lipschitz, dtype)
    # Floor L so that a step moves at most ~10 units (a larger L is always safe): with
    # Q ~ 0 a step c / L >> 1 would lose the float32 precision of the projection.
    lip = jnp.maximum(lip, jnp.maximum(0.1 * jnp.max(jnp.abs(c)), jnp.finfo(dtype).tiny))
    x = proj(0.5 * (lo + hi) if x0 is None else jnp.asarray(x0, dtype))

    def body(_, carry):
        x, y, t = carry
        grad = jnp.matmul(q, y, precision=lax.Precision.HIGHEST) + c
        x_new = proj(y - grad / lip)
        t_new = 0.5 * (1.0 + jnp.sqrt(1.0 + 4.0 * t * t))
        beta = (t - 1.0) / t_new
        if restart:
            again = jnp.vdot(y - x_new, x_new - x) > 0
            t_new = jnp.where(again, jnp.ones_like(t_new), t_new)
            beta = jnp.where(again, jnp.zeros_like(beta), beta)
        y_new = x_new + beta * (x_new - x)
        return x_new, y_new, t_new

    x, _, _ = lax.fori_loop(0, num_iters, body, (x, x, jnp.ones((), dtype)))
    return replicated_here(x)  # pinned at both ends: the loop stays on every device


def kkt_residual(q, c, x, lo, hi, *, method: str = "sort", num_bisect: int = 40):
    """Optimality + feasibility residual of x for problem (P).

    ``|| x - Proj(x - (Q x + c)) ||_2`` (the projected-gradient map with unit step:
    zero exactly at the minimisers of the convex problem)
    ``+ |sum x - 1| + sum max(lo - x, 0) + sum max(x - hi, 0)`` (feasibility).

    Returns a float scalar; 0 iff x solves (P) (for a non-empty feasible set).
    """
    q = jnp.asarray(q)
    dtype = q.dtype
    x = jnp.asarray(x, dtype)
    lo = jnp.asarray(lo, dtype)
    hi = jnp.asarray(hi, dtype)
    grad = jnp.matmul(q, x, precision=lax.Precision.HIGHEST) + jnp.asarray(c, dtype)
    step = x - project_box_simplex(x - grad, lo, hi, method=method, num_bisect=num_bisect)
    stationarity = jnp.sqrt(jnp.sum(jnp.square(step)))
    feasibility = (jnp.abs(jnp.sum(x) - 1.0) + jnp.sum(jnp.maximum(lo - x, 0.0))
                   + jnp.sum(jnp.maximum(x - hi, 0.0)))
    return stationarity + feasibility


def qp_objective(q, c, x):
    """0.5 x^T Q x + c^T x."""
    qx = jnp.matmul(q, x, precision=lax.Precision.HIGHEST)
    return 0.5 * jnp.vdot(x, qx) + jnp.vdot(c, x)
