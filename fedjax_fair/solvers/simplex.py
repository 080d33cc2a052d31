"""The probability simplex: projection, masked softmax, exponentiated gradient.

* ``project_simplex(v)``: the Euclidean projection onto
  Delta = {p : p_i >= 0, sum_i p_i = r} by the sort-and-threshold algorithm
  (Held, Wolfe, Crowder 1974; Duchi, Shalev-Shwartz, Singer, Chandra, "Efficient
  Projections onto the l1-Ball for Learning in High Dimensions", ICML 2008, Fig. 1):
  with u sorted in decreasing order and c_j = sum_{i<=j} u_i,

      rho = max{ j : u_j - (c_j - r) / j > 0 },  tau = (c_rho - r) / rho,
      p_i = max(v_i - tau, 0).

  ``project_simplex_masked(v, mask)`` projects the coordinates where ``mask`` is
  True and sets the others to 0 (cohorts with padded rows). Both are jittable:
  one sort and one cumulative sum, no data-dependent loops.
  Not ``optax.projections.projection_simplex`` (checked against optax 0.2.8,
  tests/test_optax_reuse.py): it has no mask (padded cohorts would need -inf
  fillers, NaN intermediates and a division by zero on an empty mask), and its
  ``scale`` projects v / scale then multiplies back, two extra roundings: at a
  radius of 2.5 on float32 inputs near 1e3 the two differ by up to 2e-4, ours the
  closer to the float64 projection. At radius 1 they agree to 1.9e-7 (float32,
  unit-scale inputs) and 2.8e-16 (float64), gradients included. Known limit of
  ours (optax's form avoids it): once the radius is lost in rounding against |v|,
  e.g. [1e30, 1e30, 0] in float32, the result is all zeros (optax: [0.5, 0.5, 0]).
* ``masked_softmax(logits, mask)``: softmax over the masked coordinates with the
  log-sum-exp shift; -inf logits give weight 0; if every unmasked logit is -inf
  the result is uniform over the mask.
* ``exponentiated_gradient(response, prior, mask, zeta)``: one exponentiated-gradient
  step from the prior, p_i ∝ prior_i exp(r_i / zeta) (AAggFF thesis, Hahn, UNIST
  2024, Remark 3.1 and appendix §8.1); FedAvg, q-FFL, TERM and PropFair are instances of it.
"""
from __future__ import annotations

import jax.numpy as jnp
from fedjax_fair import hparams as H



def project_simplex(v, radius: float = 1.0):
    """Euclidean projection of the vector ``v`` [K] onto {p >= 0, sum p = radius}.

    Parameters
    ----------
    v : array [K]
        The point to project (any real values).
    radius : float
        r > 0, the simplex's total mass (1 for probability vectors).

    Returns
    -------
    array [K]
        argmin_{p in Delta_r} ||p - v||_2 (Duchi et al. 2008, Fig. 1).
    """
    v = jnp.asarray(v)
    return project_simplex_masked(v, jnp.ones(v.shape, bool), radius)


def project_simplex_masked(v, mask, radius: float = 1.0):
    """Projection of v's masked coordinates onto the simplex; zeros elsewhere.

    The coordinates with ``mask`` False do not influence the result and get 0;
    the others are ``project_simplex(v[mask], radius)``. An all-False mask gives
    all zeros.

    Parameters
    ----------
    v : array [K]
    mask : bool array [K]
    radius : float
        r > 0, the total mass of the projected coordinates.
    """
    v = jnp.asarray(v)
    if v.ndim != 1:
        raise H.FieldError("v", f"must be a vector, got shape {v.shape}")
    dtype = v.dtype if jnp.issubdtype(v.dtype, jnp.floating) else jnp.float32
    v = v.astype(dtype)
    mask = jnp.asarray(mask, bool)
    k = v.shape[0]
    count = jnp.sum(mask)
    # u: the masked values in decreasing order, then the masked-out rows (-inf).
    u = -jnp.sort(-jnp.where(mask, v, -jnp.inf))
    real = jnp.arange(k) < count
    u = jnp.where(real, u, 0.0)
    cumsum = jnp.cumsum(u)
    j = jnp.arange(1, k + 1, dtype=dtype)
    # u_j - (c_j - r) / j > 0, written without the division.
    support = real & (u * j > cumsum - radius)
    rho = jnp.maximum(jnp.max(jnp.where(support, jnp.arange(1, k + 1), 0)), 1)
    tau = (cumsum[rho - 1] - radius) / rho.astype(dtype)
    return jnp.where(mask, jnp.maximum(v - tau, 0.0), 0.0)


def masked_softmax(logits, mask):
    """exp(z_i - max z) / sum_j exp(z_j - max z) over ``mask``; 0 where mask is False.

    Logits equal to -inf (e.g. log 0 of a zero prior) get weight 0. If no
    unmasked logit is finite the weights are uniform over the mask (all zeros if
    the mask is empty), so the result is on the simplex whenever any row is
    active. Never produces NaN for finite or -inf inputs.

    Parameters
    ----------
    logits : float array [K]
    mask : bool array [K]
    """
    logits = jnp.asarray(logits)
    mask = jnp.asarray(mask, bool)
    valid = mask & (logits > -jnp.inf)
    top = jnp.max(jnp.where(valid, logits, -jnp.inf))
    shift = jnp.where(jnp.isfinite(top), top, 0.0)
    e = jnp.where(valid, jnp.exp(jnp.where(valid, logits - shift, 0.0)), 0.0)
    total = jnp.sum(e)
    uniform = mask / jnp.maximum(jnp.sum(mask), 1)
    return jnp.where(total > 0, e / jnp.where(total > 0, total, 1.0),
                     uniform.astype(e.dtype))


def exponentiated_gradient(response, prior, mask, zeta: float = 1.0):
    """One EG step from ``prior`` with a linear decision loss -<p, r>:

        p_i = prior_i exp(r_i / zeta) / sum_{j in mask} prior_j exp(r_j / zeta),

    computed as ``masked_softmax(log prior + r / zeta)`` (AAggFF thesis,
    Remark 3.1: FedAvg r = 0; q-FFL r = q log F, zeta = 1; TERM r = F,
    zeta = 1 / lambda; PropFair r = -log(M - F), zeta = 1).

    Parameters
    ----------
    response : float array [K]
        r, the per-client response.
    prior : float array [K]
        p-hat >= 0, the previous decision (n_i / n in the unification).
    mask : bool array [K]
        Participating rows; the others get 0.
    zeta : float
        The step-size denominator zeta > 0.
    """
    prior = jnp.asarray(prior, jnp.float32)
    log_prior = jnp.where(prior > 0, jnp.log(jnp.where(prior > 0, prior, 1.0)), -jnp.inf)
    return masked_softmax(log_prior + jnp.asarray(response, jnp.float32) / zeta, mask)
