"""Online convex optimisation on the probability simplex: the generic solvers.

The server-side rules of AAggFF (Hahn, "Algorithms for Collaborative Machine
Learning under Statistical Heterogeneity", PhD thesis, UNIST 2024, Ch. III;
"Pursuing Overall Welfare in Federated Learning via Sequential Decision Making",
ICML 2024) treat the mixing vector p in the simplex Delta_{K-1} as an online
decision. This module holds the method-independent pieces, all pure and jittable
with fixed iteration counts (AAggFF-S / -D, thesis eqs. 3.7 and 3.10-3.12):

* ``simplex_qp``: argmin_{p in Delta} 1/2 p^T B p + b^T p for a PSD ``B``, by
  accelerated projected gradient (FISTA; constant momentum when a strong-convexity
  constant is known, otherwise the t_k sequence with gradient restart) with the
  step 1 / L, L a cheap upper bound on lambda_max(B). This is the QP of the Online
  Newton Step (Hazan, Agarwal, Kale, "Logarithmic regret algorithms for online
  convex optimization", Machine Learning 2007) in its FTRL form (thesis eq. 3.7).
* ``generalized_projection``: ONS's projection in the A-norm,
  argmin_{x in Delta} (x - y)^T A (x - y) = ``simplex_qp(A, -A y)``, and
  ``projection_kkt_residual`` / ``simplex_qp_kkt_residual`` to check a solution.
* ``diagonal_simplex_qp``: the exact O(K log K) water-filling solution for a
  diagonal B (a diagonal approximation; loses the O(K log T) guarantee).
* ``entropic_ftrl``: FTRL with the negative-entropy regulariser,
  argmin_{p in Delta} <s, p> + zeta sum_i p_i log p_i = softmax(-s / zeta)
  (thesis eq. 3.12).

The Euclidean simplex projection used inside is ``solvers.simplex.project_simplex``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from fedjax_fair.core.sharding import replicated_here
from fedjax_fair.solvers.simplex import project_simplex
from fedjax_fair import hparams as H

_TINY = 1e-30


def psd_lipschitz_bound(B):
    """An upper bound on lambda_max(B) for a symmetric PSD ``B`` [K, K]:
    min(trace(B), max_i sum_j |B_ij|) (trace >= lambda_max for PSD matrices;
    the row-sum bound is Gershgorin's)."""
    return jnp.minimum(jnp.trace(B), jnp.max(jnp.sum(jnp.abs(B), axis=1)))


def simplex_qp(B, b, init=None, *, num_iters: int = 300, strong_convexity=0.0,
               lipschitz=None):
    """argmin_{p in Delta_{K-1}} 1/2 p^T B p + b^T p by accelerated projected gradient.

    Parameters
    ----------
    B : [K, K] symmetric positive semi-definite matrix (thesis B_t = alpha I + beta A_t).
    b : [K] linear term (thesis b_t).
    init : [K] warm start (projected onto the simplex first); None starts from 1/K.
    num_iters : fixed number of iterations (``lax.fori_loop``).
    strong_convexity : a lower bound mu on lambda_min(B) (thesis: mu = alpha). With
        mu > 0 the momentum is the constant (sqrt(L) - sqrt(mu)) / (sqrt(L) + sqrt(mu))
        (linear rate (1 - sqrt(mu / L))^k); with mu = 0 the FISTA t_k sequence with
        gradient-based adaptive restart (O'Donoghue & Candes 2015) is used.
    lipschitz : an upper bound L on lambda_max(B); None uses ``psd_lipschitz_bound``.

    Returns
    -------
    p : [K] on the simplex (every iterate is a Euclidean projection).
    """
    if num_iters < 1:  # a static count, never traced
        raise H.FieldError("num_iters", f"must be >= 1, got {num_iters}")
    b = jnp.asarray(b)
    dtype = b.dtype
    k = b.shape[0]
    B, b, init = replicated_here((jnp.asarray(B, dtype), b, init))
    x0 = (jnp.full((k,), 1.0 / k, dtype) if init is None
          else project_simplex(jnp.asarray(init, dtype)))
    lip = psd_lipschitz_bound(B) if lipschitz is None else jnp.asarray(lipschitz, dtype)
    lip = jnp.maximum(lip, _TINY)
    mu = jnp.clip(jnp.asarray(strong_convexity, dtype), 0.0, lip)
    q = jnp.sqrt(mu / lip)
    constant_momentum = (1.0 - q) / (1.0 + q)

    def body(_, carry):
        x, y, t = carry
        grad = B @ y + b
        x_new = project_simplex(y - grad / lip)
        t_new = 0.5 * (1.0 + jnp.sqrt(1.0 + 4.0 * t * t))
        # Restart when the step goes against the momentum direction.
        restart = jnp.vdot(y - x_new, x_new - x) > 0
        momentum = jnp.where(mu > 0, constant_momentum, (t - 1.0) / t_new)
        momentum = jnp.where(restart, 0.0, momentum)
        t_new = jnp.where(restart & (mu <= 0), jnp.ones_like(t_new), t_new)
        y_new = x_new + momentum * (x_new - x)
        return x_new, y_new, t_new

    x, _, _ = lax.fori_loop(0, num_iters, body, (x0, x0, jnp.ones((), dtype)))
    return replicated_here(x)  # pinned at both ends: the loop stays on every device


def simplex_qp_kkt_residual(B, b, p):
    """KKT residual of ``p`` for argmin_{p in Delta} 1/2 p^T B p + b^T p.

    With h = B p + b the optimality conditions are: p in Delta, h_i = nu on
    {p_i > 0} and h_i >= nu elsewhere. The residual is

        (<p, h> - min_i h_i) + |sum_i p_i - 1| + max(0, -min_i p_i),

    whose first term is the Frank-Wolfe duality gap max_{q in Delta} <h, p - q>
    (>= f(p) - f*, zero exactly when every unit of mass sits on argmin h). Zero
    iff ``p`` is the solution.
    """
    h = B @ p + b
    gap = jnp.vdot(p, h) - jnp.min(h)
    infeasible = jnp.abs(jnp.sum(p) - 1.0) + jnp.maximum(0.0, -jnp.min(p))
    return gap + infeasible


def generalized_projection(A, y, init=None, *, num_iters: int = 500, strong_convexity=0.0):
    """ONS's generalised projection argmin_{x in Delta} (x - y)^T A (x - y).

    Expanding, the objective is 1/2 x^T A x - (A y)^T x + const, i.e.
    ``simplex_qp(A, -A y)``. ``A`` [K, K] symmetric PSD (positive definite for a
    unique solution), ``y`` [K]; ``strong_convexity`` a lower bound on
    lambda_min(A) if known (faster), else 0.
    """
    return simplex_qp(A, -(A @ y), init, num_iters=num_iters,
                      strong_convexity=strong_convexity)


def projection_kkt_residual(A, y, x):
    """KKT residual of ``x`` for ``generalized_projection(A, y)`` (see
    ``simplex_qp_kkt_residual``); near zero at the solution."""
    return simplex_qp_kkt_residual(A, -(A @ y), x)


def diagonal_simplex_qp(d, b):
    """Exact argmin_{p in Delta} 1/2 sum_i d_i p_i^2 + b_i p_i for d > 0 (water-filling).

    The solution is p_i = max(0, (nu - b_i) / d_i) with the scalar nu such that
    sum_i p_i = 1. The support is a prefix of the clients sorted by increasing b_i:
    for the first j of them nu_j = (1 + sum_{i<=j} b_i / d_i) / sum_{i<=j} 1 / d_i,
    and the support is the largest j with nu_j > b_(j). O(K log K). With d = 1 and
    b = -v this is the Euclidean projection of v.
    """
    order = jnp.argsort(b)
    bs, ws = b[order], 1.0 / d[order]
    nus = (1.0 + jnp.cumsum(bs * ws)) / jnp.cumsum(ws)
    k = b.shape[0]
    last = jnp.max(jnp.where(nus > bs, jnp.arange(k), 0))
    nu = nus[last]
    return jnp.maximum(0.0, (nu - b) / d)


def entropic_ftrl(s, zeta):
    """argmin_{p in Delta} <s, p> + zeta sum_i p_i log p_i = softmax(-s / zeta).

    ``s`` [K] cumulative (linearised) losses, ``zeta`` > 0 the regularisation
    strength; computed with max-subtraction (``jax.nn.softmax``)."""
    return jax.nn.softmax(-s / zeta)


def frank_wolfe_gap(grad, p):
    """max_{q in Delta} <grad, p - q> = <grad, p> - min_i grad_i (>= 0 on the simplex)."""
    return jnp.vdot(grad, p) - jnp.min(grad)


__all__ = ["diagonal_simplex_qp", "entropic_ftrl", "frank_wolfe_gap", "generalized_projection",
           "projection_kkt_residual", "psd_lipschitz_bound", "simplex_qp",
           "simplex_qp_kkt_residual"]
