"""Byzantine-robust aggregators: each an ``aggregators.Aggregator`` whose direction is a
pseudo-gradient like ``weighted_mean``'s, theta^t minus a robust estimate of the
clients' models, i.e. a robust estimate of the deltas Delta_k (K cohort slots).

Participants. A slot k takes part when ``ctx.client_mask[k]`` and its mixing weight
p_k > 0 (masked slots and the clients a rule gives no weight, e.g. empty clients under
``by_num_examples``); m = their number (traced). Masked slots are never read into an
estimate (their values may be anything finite). The coordinate-wise rules and Krum use
the weights only to know who takes part; the weighted median, the geometric median
and the inner aggregator of ``norm_bounded`` use their values.

* ``coordinate_median()``: per coordinate, the median of the m participants' values
  (the mean of the two middle ones when m is even). ``weighted=True``: the lower
  weighted median, the smallest value x_(j) (sorted) whose cumulative weight
  sum_{i <= j} p_(i) reaches half the participants' total (Yin, Chen, Ramchandran,
  Bartlett, "Byzantine-Robust Distributed Learning: Towards Optimal Statistical
  Rates", ICML 2018, arXiv:1803.01498, Definition 1 "coordinate-wise median").
* ``trimmed_mean(trim)``: per coordinate, the mean of the m participants' values after
  dropping the b = floor(trim m) largest and b smallest (Yin et al. 2018, Definition 2,
  "coordinate-wise beta-trimmed mean", beta = ``trim``). b is exact for the decimal a
  concrete trim is written as (0.295 x 200 is 59), and for a traced one (a float t)
  floor(t m) corrected for t's rounding (``trimmed_count``); the rest is sorting + a mask
  of ranks b <= r < m - b, so ``trim`` can be vmapped.
* ``krum(num_byzantine, multi)``: Krum and Multi-Krum (Blanchard, El Mhamdi,
  Guerraoui, Stainer, "Machine Learning with Adversaries: Byzantine Tolerant Gradient
  Descent", NeurIPS 2017, arXiv:1703.02757, the Krum rule): client i's score s(i) =
  sum over its m - f - 2 nearest other participants j of ||Delta_i - Delta_j||^2
  (f = ``num_byzantine``;
  clipped to at least one neighbour when m < f + 3); Krum returns the lowest-scored
  participant's delta, Multi-Krum (same paper) the uniform mean of the
  ``multi`` lowest-scored. Distances come from the K x K Gram matrix summed over the
  leaves, ||a - b||^2 = <a, a> + <b, b> - 2 <a, b> (HIGHEST matmul precision), never a
  K x K x d tensor. ``info``: ``krum_scores`` [K] (NaN for non-participants) and
  ``selected`` [K] bool.
* ``geometric_median(iters, eps)``: RFA (Pillutla, Kakade, Harchaoui, "Robust
  Aggregation for Federated Learning", IEEE TSP 2022, arXiv:1912.13445, the smoothed
  Weiszfeld algorithm for the smoothed geometric median): from z^0 = sum_k alpha_k Delta_k,
      beta_k = alpha_k / max(nu, ||z^r - Delta_k||),  z^{r+1} = sum_k beta_k Delta_k / sum_k beta_k,
  R = ``iters`` rounds (a ``lax.fori_loop``), alpha = the mixing weights, nu = ``eps``.
  ``info``: ``weiszfeld_weights`` [K], the normalised beta of the last iteration
  (the direction is sum_k w_k Delta_k with them). Far outliers are shed
  geometrically, not at once: with 2 of 10 updates at 1e6 (tests/test_robust.py)
  the estimate is 2e5 off after 0 steps (the mean), 1e3 after 4, 3.8 after 8 and 0.04 (the
  geometric median itself) after 12; raise ``iters`` against huge attacks.
* ``norm_bounded(max_norm, inner)``: every client's delta clipped to L2 norm
  M = ``max_norm`` over the whole pytree, Delta_k min(1, M / ||Delta_k||), then the
  ``inner`` aggregator (Sun, Kairouz, Suresh, McMahan, "Can You Really Backdoor
  Federated Learning?", arXiv:1911.07963, the "norm thresholding of updates" defence).
  ``info``: the inner's plus ``clip_scale`` [K].

Streaming (aggregators.Stream): only ``norm_bounded`` over an inner aggregator with a
stream form streams (clipping is per client: its term clips, then the inner's term);
the median, trimmed mean, Krum and the geometric median need every update at once and
have ``stream=None`` (``compose`` stacks the K deltas for them).

``trim``, ``max_norm`` and ``eps`` may be traced (one program for every value, vmap); they are
checked at build time only when they are concrete Python / NumPy numbers.
"""
from __future__ import annotations

import numbers
from fractions import Fraction
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair import hparams as H
from fedjax_fair.core.aggregators import (Aggregator, Stream, scale_rows, stateless,
                                          weighted_mean, weighted_sum)

_HIGHEST = jax.lax.Precision.HIGHEST


# ------------------------------------------------------------------ shared pieces


def participants(weights, ctx):
    """bool [K]: the slots in the cohort whose mixing weight is positive."""
    return ctx.client_mask & (weights > 0)


def _rows(x):
    """A stacked leaf [K, ...] as [K, n]."""
    return x.reshape(x.shape[0], -1)


def _sorted_with_absent_last(x, present):
    """Leaf [K, ...] sorted along the cohort axis, absent slots as +inf (last)."""
    shape = (-1,) + (1,) * (x.ndim - 1)
    return jnp.sort(jnp.where(present.reshape(shape), x, jnp.inf), axis=0)


def client_sq_norms(tree):
    """[K]: sum over every leaf of each client's squared entries."""
    return sum(jnp.sum(jnp.square(_rows(x)), axis=1) for x in jax.tree.leaves(tree))


def gram(tree):
    """[K, K]: <Delta_i, Delta_j> over the concatenated leaves, one matmul per leaf."""
    return sum(jnp.matmul(_rows(x), _rows(x).T, precision=_HIGHEST)
               for x in jax.tree.leaves(tree))


def pairwise_sq_distances(tree):
    """[K, K]: ||Delta_i - Delta_j||^2 from the Gram matrix (clamped at 0)."""
    g = gram(tree)
    diag = jnp.diagonal(g)
    return jnp.maximum(diag[:, None] + diag[None, :] - 2.0 * g, 0.0)


def _concrete_in(value, field, low, high, low_open=False, high_open=True):
    """Checks a concrete number against (low, high); traced values pass unchecked."""
    if not H.is_concrete(value):
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise H.FieldTypeError(field, f"must be a number, got {type(value).__name__} "
                                      f"{value!r}")
    v = float(value)
    ok_low = v > low if low_open else v >= low
    ok_high = v < high if high_open else v <= high
    if not (ok_low and ok_high):
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise H.FieldError(field, f"must lie in {lo}{low}, {high}{hi}, got {value}")


# ------------------------------------------------------------------ coordinate median


def _median_leaf(x, present, m):
    """Per coordinate, the median of the present rows of leaf [K, ...]."""
    s = _sorted_with_absent_last(x, present)
    lo = jnp.maximum((m - 1) // 2, 0)
    hi = jnp.maximum(m // 2, 0)
    mid = 0.5 * (jnp.take(s, lo, axis=0) + jnp.take(s, hi, axis=0))
    return jnp.where(m > 0, mid, jnp.zeros_like(mid))


def _weighted_median_leaf(x, present, weights):
    """Per coordinate, the lower weighted median of the present rows of leaf [K, ...]."""
    k = x.shape[0]
    flat = _rows(x)
    w = jnp.where(present, weights, 0.0).astype(flat.dtype)
    order = jnp.argsort(jnp.where(present[:, None], flat, jnp.inf), axis=0)
    values = jnp.take_along_axis(flat, order, axis=0)
    cum = jnp.cumsum(w[order], axis=0)
    total = jnp.sum(w)
    first = jnp.argmax(cum >= 0.5 * total, axis=0)  # first rank reaching half
    first = jnp.minimum(first, k - 1)
    med = jnp.take_along_axis(values, first[None, :], axis=0)[0]
    med = jnp.where(total > 0, med, jnp.zeros_like(med))
    return med.reshape(x.shape[1:])


def coordinate_median(weighted: bool = False) -> Aggregator:
    """The coordinate-wise median of the participants' deltas (Yin et al. 2018,
    arXiv:1803.01498); the weights only say who takes part unless ``weighted``
    (then the lower weighted median with the mixing weights). Needs the stack:
    ``stream=None``."""
    if not isinstance(weighted, (bool,)):
        raise H.FieldTypeError("weighted", f"must be true or false, got {weighted!r}")

    def direction(outputs, weights, ctx):
        present = participants(weights, ctx)
        if weighted:
            return jax.tree.map(lambda x: _weighted_median_leaf(x, present, weights),
                                outputs.delta), {}
        m = jnp.sum(present.astype(jnp.int32))
        return jax.tree.map(lambda x: _median_leaf(x, present, m), outputs.delta), {}

    return stateless(direction)


# ------------------------------------------------------------------ trimmed mean


def trimmed_count(trim, m, cohort_size: Optional[int] = None):
    """b = floor(trim m), traced int32, for m participants (traced int) out of
    ``cohort_size`` slots.

    Exact for the decimal a concrete ``trim`` is written as (0.295 x 200 is 59, as
    ``algorithms/fedfv.py``'s keep counts): from ``fractions.Fraction(str(trim))``, a
    table of b over m = 0..``cohort_size`` built in Python. A traced ``trim`` (vmap,
    grad, a sweep) is a float t of its dtype, within half an ulp of the decimal: p =
    fl(t m) is then within 2 eps p of trim m, so b = floor(p), plus one when
    floor(p) + 1 - p <= 2 eps p (p fell short of an integer by rounding alone). That
    is floor(trim m) for a trim of d decimals whenever 10^d m < 2^22 in float32 (2^51
    in float64): every trim of up to four decimals on cohorts of up to 400. floor(t m)
    alone in float32 is one short whenever trim m is an integer that t cannot hit
    (0.265 x 200 gave 52, 0.295 x 200 58, 0.42 x 150 62). No division: XLA rewrites
    x / broadcast(m) as x * (1 / m), which is not correctly rounded. Without
    ``cohort_size`` a concrete trim takes the traced rule."""
    m = jnp.asarray(m, jnp.int32)
    if H.is_concrete(trim) and cohort_size is not None:
        return jnp.asarray(_exact_counts(trim, cohort_size))[jnp.clip(m, 0, cohort_size)]
    t = jnp.asarray(trim)
    if not jnp.issubdtype(t.dtype, jnp.floating):
        t = t.astype(jax.dtypes.canonicalize_dtype(jnp.float64))
    t = jax.lax.stop_gradient(t)  # a count: no derivative in trim
    p = t * jnp.maximum(m, 0).astype(t.dtype)
    guess = jnp.floor(p)
    short = (guess + 1 - p) <= 2 * jnp.finfo(t.dtype).eps * p
    return jnp.maximum(guess.astype(jnp.int32) + short.astype(jnp.int32), 0)


def _exact_counts(trim, cohort_size: int) -> np.ndarray:
    """floor(trim m) for m = 0..cohort_size (int32 [cohort_size + 1]), exact for the
    decimal ``trim`` is written as (str: also for NumPy scalars, str(float32(0.1)) is
    "0.1")."""
    try:
        fraction = Fraction(str(trim))
    except ValueError:
        fraction = Fraction(float(trim))
    num, den = fraction.as_integer_ratio()
    return np.asarray([num * m // den for m in range(cohort_size + 1)], np.int32)


def _trimmed_leaf(x, present, m, b):
    """Per coordinate, the mean of ranks b <= r < m - b of the present rows."""
    s = _sorted_with_absent_last(x, present)
    ranks = jnp.arange(x.shape[0]).reshape((-1,) + (1,) * (x.ndim - 1))
    keep = (ranks >= b) & (ranks < m - b)
    kept = jnp.maximum(m - 2 * b, 1).astype(x.dtype)
    return jnp.sum(jnp.where(keep, s, 0.0), axis=0) / kept


def trimmed_mean(trim: float = 0.1) -> Aggregator:
    """The coordinate-wise trimmed mean (Yin et al. 2018, arXiv:1803.01498, Definition
    2, beta = ``trim``): per coordinate, the floor(trim m) largest and smallest of the
    m participants' values dropped, the rest averaged. ``trim`` may be traced (vmap);
    a concrete one must lie in [0, 0.5). Needs the stack: ``stream=None``."""
    _concrete_in(trim, "trim", 0.0, 0.5)

    def direction(outputs, weights, ctx):
        present = participants(weights, ctx)
        m = jnp.sum(present.astype(jnp.int32))
        b = trimmed_count(trim, m, present.shape[0])
        return (jax.tree.map(lambda x: _trimmed_leaf(x, present, m, b), outputs.delta),
                {"trimmed": b})

    return stateless(direction)


# ------------------------------------------------------------------ Krum


def krum_scores(sq_dist, present, num_byzantine: int):
    """[K]: each participant's sum of squared distances to its m - f - 2 nearest other
    participants (at least one, at most m - 1); +inf for non-participants."""
    k = sq_dist.shape[0]
    m = jnp.sum(present.astype(jnp.int32))
    neighbours = jnp.clip(m - num_byzantine - 2, 1, jnp.maximum(m - 1, 1))
    other = present[None, :] & ~jnp.eye(k, dtype=bool)
    nearest = jnp.sort(jnp.where(other, sq_dist, jnp.inf), axis=1)
    counted = jnp.arange(k)[None, :] < neighbours
    score = jnp.sum(jnp.where(counted & jnp.isfinite(nearest), nearest, 0.0), axis=1)
    return jnp.where(present, score, jnp.inf)


def krum_selection(scores, present, multi: int):
    """bool [K]: the ``multi`` lowest-scored participants (ties: lowest slot)."""
    rank = jnp.argsort(jnp.argsort(scores, stable=True), stable=True)
    m = jnp.sum(present.astype(jnp.int32))
    return present & (rank < jnp.minimum(multi, m))


def check_krum(num_byzantine: int, multi: int, cohort_size: int) -> None:
    """Krum's f and Multi-Krum's m against a cohort of K slots: f < K (at least one
    honest client: with f >= K the rule has no honest neighbour to count, and the scores
    would be sums over a single neighbour) and m <= K; else ``FieldError`` naming
    ``num_byzantine`` / ``multi``. Blanchard et al.'s guarantee (their Proposition 1)
    needs K > 2f + 2; between that and f < K the scores count one neighbour at least
    (``krum_scores``) and the rule runs without it. A static check (shapes and
    Python integers), never of a traced value."""
    k = H.count(cohort_size, "cohort_size")
    if num_byzantine >= k:
        raise H.FieldError("num_byzantine", f"{num_byzantine} Byzantine clients in a cohort "
                                            f"of {k}: Krum needs at least one honest "
                                            f"client, f < {k} (its guarantee: 2f + 2 < {k})")
    if multi > k:
        raise H.FieldError("multi", f"selects {multi} of a cohort of {k}: at most {k}")


def krum(num_byzantine: int = 1, multi: int = 1) -> Aggregator:
    """Krum (``multi=1``) and Multi-Krum (Blanchard et al., NeurIPS 2017): the uniform
    mean of the ``multi`` participants with the lowest Krum scores, f =
    ``num_byzantine``. Masked slots are never chosen nor counted as neighbours. Needs
    the stack: ``stream=None``. A cohort of K slots with f >= K (or ``multi`` > K) is
    refused when the round is traced (``check_krum``; the command line checks it
    before anything is built)."""
    f = H.count(num_byzantine, "num_byzantine", minimum=0)
    multi = H.count(multi, "multi", minimum=1)

    def direction(outputs, weights, ctx):
        present = participants(weights, ctx)
        check_krum(f, multi, present.shape[0])
        scores = krum_scores(pairwise_sq_distances(outputs.delta), present, f)
        selected = krum_selection(scores, present, multi)
        share = selected / jnp.maximum(jnp.sum(selected), 1)
        return weighted_sum(outputs.delta, share), {
            "krum_scores": jnp.where(present, scores, jnp.nan), "selected": selected}

    return stateless(direction)


# ------------------------------------------------------------------ geometric median


def _distances(tree, z):
    """[K]: ||Delta_k - z|| over the whole pytree."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(_rows(x - zl[None])), axis=1)
                        for x, zl in zip(jax.tree.leaves(tree), jax.tree.leaves(z))))


def weiszfeld(tree, alpha, iters: int, eps):
    """(z, w): ``iters`` smoothed Weiszfeld steps from the alpha-weighted mean (RFA,
    arXiv:1912.13445, Algorithm 3); w [K] the last step's normalised weights, so
    z = sum_k w_k Delta_k."""
    total = jnp.sum(alpha)
    w0 = alpha / jnp.where(total > 0, total, 1.0)

    def step(_, carry):
        z, _w = carry
        beta = alpha / jnp.maximum(eps, _distances(tree, z))
        s = jnp.sum(beta)
        w = beta / jnp.where(s > 0, s, 1.0)
        return weighted_sum(tree, w), w

    return jax.lax.fori_loop(0, iters, step, (weighted_sum(tree, w0), w0))


def geometric_median(iters: int = 8, eps: float = 1e-6) -> Aggregator:
    """RFA's geometric median (Pillutla et al., arXiv:1912.13445): ``iters`` smoothed
    Weiszfeld steps with alpha = the mixing weights and nu = ``eps`` (``eps`` may be
    traced; a concrete one must be > 0). Needs the stack: ``stream=None``."""
    iters = H.count(iters, "iters", minimum=0)
    _concrete_in(eps, "eps", 0.0, float("inf"), low_open=True)

    def direction(outputs, weights, ctx):
        alpha = jnp.where(participants(weights, ctx), weights, 0.0)
        z, w = weiszfeld(outputs.delta, alpha, iters, eps)
        return z, {"weiszfeld_weights": w}

    return stateless(direction)


# ------------------------------------------------------------------ norm bounding


def clip_scale(sq_norm, max_norm):
    """min(1, M / ||Delta||) (1 for a zero delta)."""
    norm = jnp.sqrt(sq_norm)
    return jnp.where(norm > max_norm, max_norm / jnp.where(norm > 0, norm, 1.0), 1.0)


def norm_bounded(max_norm: float, inner: Aggregator = weighted_mean()) -> Aggregator:
    """Norm thresholding (Sun et al., arXiv:1911.07963): every client's delta clipped
    to L2 norm ``max_norm`` (over the whole pytree), then ``inner``. ``max_norm`` may
    be traced; a concrete one must be > 0. Streams when ``inner`` streams (the clip
    is per client)."""
    _concrete_in(max_norm, "max_norm", 0.0, float("inf"), low_open=True)
    if not isinstance(inner, Aggregator):
        raise H.FieldTypeError("inner", f"must be an Aggregator, got {type(inner).__name__}")

    def aggregate(state, outputs, weights, ctx):
        scale = clip_scale(client_sq_norms(outputs.delta), max_norm)
        direction, state, info = inner.aggregate(
            state, outputs._replace(delta=scale_rows(outputs.delta, scale)), weights, ctx)
        return direction, state, {**info, "clip_scale": scale}

    stream = None
    if inner.stream is not None:
        def term(out, z, ctx):
            scale = clip_scale(client_sq_norms(jax.tree.map(lambda x: x[None], out.delta)),
                               max_norm)[0]
            z2, summands, stats = inner.stream.term(
                out._replace(delta=scale_rows(out.delta, scale)), z, ctx)
            return z2, summands, (stats, scale)

        def finish(state, sums, outputs, stats, weights, ctx):
            inner_stats, scale = stats
            direction, state, info = inner.stream.finish(state, sums, outputs, inner_stats,
                                                         weights, ctx)
            return direction, state, {**info, "clip_scale": scale}

        stream = Stream(term, finish)

    return Aggregator(inner.init, aggregate, stream)
