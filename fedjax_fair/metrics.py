"""Fairness metrics over per-client values (DQN-Fed, TMLR, OpenReview KbteA50cni, Sec. 5;
AAggFF, arXiv:2405.20821).

Every metric takes per-client values ``a`` of shape ``[N]`` (test accuracy, AUROC, loss,
...) and returns a 0-d array. The metric functions use ``jax.numpy`` only, so they accept
NumPy or JAX arrays and can be called inside ``jax.jit``; arguments that decide shapes
(``fraction`` in :func:`worst_k`, :func:`best_k`, :func:`parity_gap`) must be Python
numbers (static under ``jit``).

Values may be in ``[0, 1]`` or in percent: :func:`gini`, :func:`angle_to_uniform`,
:func:`kl_to_uniform` and :func:`improved_fraction` are scale-invariant; the others
(``mean``, ``std``, ``worst_k``, ...) are returned in the units of ``a``.

Integer or boolean inputs are cast to the default float dtype. ``NaN`` entries propagate;
drop them (or clients without test data) with :func:`apply_mask` / the ``mask`` argument
of :func:`fairness_summary`.

:func:`fairness_summary` gathers the reported metrics into a ``dict[str, float]`` of
Python floats (JSON-ready); it is a host-side helper, not jittable. :data:`METRICS` maps
each metric name to a one-line description with its formula.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from fedjax_fair import hparams as H

Array = jax.Array

__all__ = [
    "METRICS",
    "mean",
    "weighted_mean",
    "std",
    "variance",
    "num_selected",
    "worst_k",
    "best_k",
    "parity_gap",
    "gini",
    "angle_to_uniform",
    "kl_to_uniform",
    "improved_fraction",
    "apply_mask",
    "fairness_summary",
    "rounds_to_reach",
    "smoothness",
    "tail_mean",
    "select_evaluation",
    "confidence_interval",
    "weight_drift",
    "participation_counts",
    "participation_summary",
    "time_to_reach",
]

# Tolerance used when flooring fraction * N, so that e.g. 0.29 * 100 = 28.999999999999996
# selects 29 clients, not 28.
_FLOOR_TOL = 1e-9

METRICS: dict[str, str] = {
    "mean": "unweighted mean over clients: (1/N) sum_i a_i",
    "weighted_mean": "sample-weighted mean: sum_i n_i a_i / sum_i n_i (unweighted mean if sum n_i "
                     "= 0)",
    "std": "population std: sqrt((1/N) sum_i (a_i - mean)^2)",
    "variance": "population variance: (1/N) sum_i (a_i - mean)^2",
    "worst_x%": "mean of the k = max(1, floor(x*N)) lowest a_i (weighted by n_i if weights given)",
    "best_x%": "mean of the k = max(1, floor(x*N)) highest a_i (weighted by n_i if weights given)",
    "parity_gap_x%": "accuracy-parity gap: best_x% - worst_x%",
    "gini": "Gini: sum_j (2j-N-1) a_(j) / (N sum_j a_j), a sorted ascending; 1 if sum a = 0",
    "angle": "angle to uniform (degrees): arccos(a.1 / (||a|| sqrt N)); 0 if all a_i equal",
    "kl_to_uniform": "KL(p||uniform) = sum_k p_k ln(N p_k), p_k = a_k / sum_j a_j, 0 ln 0 = 0",
    "improved_fraction": "fraction of participants with loss_after <= loss_before (ties improve)",
    "R90": "rounds to reach 90% accuracy: min{r : a_r >= 0.9}, a_0 the initial model; inf if never",
    "smoothness": "stability of a curve: std(diff(a)) / |mean(diff(a))| (ddof 0); higher = less "
                  "smooth",
    "weight_drift": "mean_i |alpha_i^r - p_i| per round (aggregation weights vs data weights)",
    "tail_mean": "mean of a curve over its last k evaluations (the papers' tail averages)",
    "select_evaluation": "the evaluation with the best validation metric (model selection)",
    "participation": "rounds each client reported in (counts, shares of the rounds), their "
                     "Gini, and the Pearson correlation of participation with final accuracy",
    "T90": "simulated time to reach 90% accuracy: the first evaluation's clock_seconds with "
           "a >= 0.9 (R90 on the virtual clock); inf if never",
}


# ---------------------------------------------------------------------------- helpers


def _as_vector(a, name: str = "a") -> Array:
    """``a`` as a float JAX array of rank 1 (ints/bools are cast to the default float)."""
    x = jnp.asarray(a)
    if x.ndim != 1:
        raise ValueError(f"{name} must have shape [N], got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.result_type(float))
    return x


def _as_weights(w, a: Array) -> Array:
    x = _as_vector(w, "weights")
    if x.shape != a.shape:
        raise ValueError(f"weights must have shape {a.shape}, got {x.shape}")
    return x.astype(jnp.result_type(a.dtype, x.dtype))


def _check_nonempty(a: Array, fn: str) -> None:
    if a.shape[0] == 0:
        raise ValueError(f"{fn} needs at least one client, got an empty array")


@jax.jit
def _safe_weighted_mean(a: Array, w: Array) -> Array:
    """sum(w a) / sum(w); the unweighted mean of ``a`` where sum(w) == 0."""
    total = jnp.sum(w)
    zero = total == 0
    weighted = jnp.sum(w * a) / jnp.where(zero, 1, total)
    return jnp.where(zero, jnp.mean(a), weighted)


# ------------------------------------------------------------------ location / spread
# The public functions validate and cast on the Python side, then call small jitted
# kernels (one compilation per shape and dtype instead of one per primitive; inlined when
# the caller is itself under jit).


@jax.jit
def _mean_kernel(a: Array) -> Array:
    return jnp.mean(a)


@jax.jit
def _variance_kernel(a: Array) -> Array:
    d = a - jnp.mean(a)
    return jnp.mean(d * d)


@jax.jit
def _std_kernel(a: Array) -> Array:
    return jnp.sqrt(_variance_kernel(a))



def mean(a) -> Array:
    """Unweighted mean over clients: ``mean = (1/N) * sum_i a_i``.

    This is the DQN-Fed ``ā`` (every client counts once).
    """
    return _mean_kernel(_as_vector(a))


def weighted_mean(a, w) -> Array:
    """Sample-weighted mean: ``sum_i w_i a_i / sum_i w_i``.

    ``w`` are non-negative per-client weights, normally the test sizes ``n_i`` (the AAggFF
    "Avg." of the reference code). If ``sum_i w_i == 0`` (no client has any weight) the
    result is defined as the unweighted :func:`mean` of ``a``.
    """
    a = _as_vector(a)
    return _safe_weighted_mean(a, _as_weights(w, a))


def variance(a) -> Array:
    """Population variance: ``var = (1/N) * sum_i (a_i - mean)^2``."""
    return _variance_kernel(_as_vector(a))


def std(a) -> Array:
    """Population standard deviation (``1/N``, not ``1/(N-1)``): ``sqrt(variance(a))``.

    ``sigma_a = sqrt((1/N) * sum_i (a_i - mean)^2)`` (DQN-Fed ``σ_a``).
    """
    return _std_kernel(_as_vector(a))


# ------------------------------------------------------------------ worst / best k


def num_selected(n: int, fraction: float) -> int:
    """Number of clients in a worst/best group: ``k = max(1, floor(fraction * n))``.

    The floor rule (DQN-Fed does not state it; also AAggFF's ``max(1, floor(0.1 N))``): with 15
    clients and ``fraction=0.1``, ``k = 1``; with 25 clients, ``k = 2``. The product is
    floored with a 1e-9 tolerance so that floating-point error cannot drop a client
    (``0.29 * 100`` gives 29). ``fraction`` must lie in ``[0, 1]`` and ``n >= 1``.
    """
    fraction = float(fraction)
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    n = int(n)
    if n < 1:
        raise ValueError(f"need at least one client, got n={n}")
    k = int(math.floor(fraction * n + _FLOOR_TOL))
    return min(n, max(1, k))


@functools.partial(jax.jit, static_argnames=("k", "descending"))
def _group_kernel(a: Array, w: Optional[Array], k: int, descending: bool) -> Array:
    # Stable sort: among equal values the client with the lower index is taken first.
    order = jnp.argsort(a, stable=True, descending=descending)[:k]
    sel = a[order]
    if w is None:
        return jnp.mean(sel)
    return _safe_weighted_mean(sel, w[order])


def _group_mean(a, fraction: float, weights, descending: bool, fn: str) -> Array:
    a = _as_vector(a)
    _check_nonempty(a, fn)
    k = num_selected(a.shape[0], fraction)
    w = None if weights is None else _as_weights(weights, a)
    return _group_kernel(a, w, k=k, descending=descending)


def worst_k(a, fraction: float, weights=None) -> Array:
    """Mean of the ``k`` lowest values ("Worst x%"), ``k = max(1, floor(fraction * N))``.

    Without ``weights``: ``(1/k) * sum_{i in W} a_i``, where ``W`` are the ``k`` clients
    with the lowest ``a_i``. With ``weights`` (test sizes ``n_i``; AAggFF reference code):
    ``sum_{i in W} n_i a_i / sum_{i in W} n_i`` -- the group is still chosen by value
    only, the weights just average it (unweighted mean of the group if its weights sum to
    0). See :func:`num_selected` for the rounding rule. Ties are broken by a stable sort:
    among equal values, lower client indices are selected first. ``fraction`` must be a
    Python number (static under ``jit``).
    """
    return _group_mean(a, fraction, weights, descending=False, fn="worst_k")


def best_k(a, fraction: float, weights=None) -> Array:
    """Mean of the ``k`` highest values ("Best x%"), ``k = max(1, floor(fraction * N))``.

    Without ``weights``: ``(1/k) * sum_{i in B} a_i``, where ``B`` are the ``k`` clients
    with the highest ``a_i``; with ``weights``: ``sum_{i in B} n_i a_i / sum_{i in B} n_i``
    (unweighted mean of the group if its weights sum to 0). Same rounding rule as
    :func:`worst_k`; ties are broken stably: among equal values, lower client indices are
    selected first.
    """
    return _group_mean(a, fraction, weights, descending=True, fn="best_k")


def parity_gap(a, fraction: float, weights=None) -> Array:
    """Accuracy-parity gap ``ΔAG = best_k(a, fraction, weights) - worst_k(a, fraction, weights)``."""
    return best_k(a, fraction, weights) - worst_k(a, fraction, weights)


# -------------------------------------------------------------- inequality indices


def gini(a) -> Array:
    """Gini coefficient of non-negative values.

    With ``a_(1) <= ... <= a_(N)`` sorted ascending (``j`` 1-based)::

        G = sum_j (2j - N - 1) a_(j) / (N * sum_j a_(j))
          = sum_{i,j} |a_i - a_j| / (2 N^2 mean(a))

    ``G = 0`` when all values are equal, ``(N-1)/N`` when a single client holds
    everything. Defined as ``G = 1`` when ``sum_j a_j == 0`` (our convention). Scale-invariant;
    AAggFF tables report ``100 * G``.
    """
    a = _as_vector(a)
    _check_nonempty(a, "gini")
    return _gini_kernel(a)


@jax.jit
def _gini_kernel(a: Array) -> Array:
    n = a.shape[0]
    s = jnp.sort(a)
    coef = (2 * jnp.arange(1, n + 1) - n - 1).astype(a.dtype)
    total = jnp.sum(s)
    zero = total == 0
    g = jnp.sum(coef * s) / (n * jnp.where(zero, 1, total))
    return jnp.where(zero, jnp.ones_like(g), g)


def _np_gini_sorted(s: np.ndarray, total: float) -> float:
    """:func:`gini` in NumPy of the ascending float64 values ``s`` summing to ``total``
    (host summaries: nothing compiled)."""
    n = s.shape[0]
    coef = 2.0 * np.arange(1, n + 1) - n - 1
    return 1.0 if total == 0 else float(np.dot(coef, s) / (n * total))


def angle_to_uniform(a) -> Array:
    """Angle in degrees between ``a`` and the all-ones vector (DQN-Fed "Angle").

    ``angle = arccos(a . 1 / (||a|| * sqrt N)) * 180 / pi``.

    Computed with the equivalent, numerically stable form
    ``atan2(sqrt(N) * std(a), sqrt(N) * mean(a))`` (``a = mean * 1 + r`` with ``r`` orthogonal
    to ``1``, ``||r|| = sqrt(N) * std``), i.e. ``atan(std / mean)`` for positive mean.
    Exactly 0 when all entries are equal; the all-zero vector (undefined ``arccos``) is
    defined as 0 too. Scale-invariant; in ``[0, 180]``.
    """
    a = _as_vector(a)
    _check_nonempty(a, "angle_to_uniform")
    return _angle_kernel(a)


@jax.jit
def _angle_kernel(a: Array) -> Array:
    m = jnp.mean(a)
    d = a - m
    perp = jnp.sqrt(jnp.sum(d * d))  # ||a - mean * 1||
    along = m * jnp.sqrt(jnp.asarray(a.shape[0], a.dtype))  # a . 1 / sqrt N
    ang = jnp.degrees(jnp.arctan2(perp, along))
    all_equal = jnp.max(a) == jnp.min(a)
    return jnp.where(all_equal, jnp.zeros_like(ang), ang)


def kl_to_uniform(a) -> Array:
    """KL divergence of the normalised values from uniform (DQN-Fed "KL(a||u)").

    With ``p_k = a_k / sum_j a_j``: ``KL = sum_k p_k ln(N p_k)`` (natural log), using
    ``0 ln 0 = 0``. Requires ``a >= 0``. Exactly 0 when all entries are equal (including
    the all-zero vector, for which ``p`` is undefined and the result is defined as 0).
    Scale-invariant; at most ``ln N``.
    """
    a = _as_vector(a)
    _check_nonempty(a, "kl_to_uniform")
    return _kl_kernel(a)


@jax.jit
def _kl_kernel(a: Array) -> Array:
    n = a.shape[0]
    total = jnp.sum(a)
    p = a / jnp.where(total == 0, 1, total)
    pos = p > 0
    terms = jnp.where(pos, p * jnp.log(jnp.where(pos, n * p, 1)), 0)
    kl = jnp.sum(terms)
    all_equal = jnp.max(a) == jnp.min(a)
    return jnp.where(all_equal, jnp.zeros_like(kl), kl)


# ---------------------------------------------------------------- improved clients


def improved_fraction(loss_before, loss_after, mask=None) -> Array:
    """Fraction of participating clients whose loss did not increase (DQN-Fed eq. 29).

    ``rho = (1/|S|) * sum_{k in S} 1{loss_after_k <= loss_before_k}``, where ``S`` is the
    set of clients with ``mask`` True (all clients if ``mask`` is None). Ties count as
    improved; a ``NaN`` loss counts as not improved. If no client participates
    (``|S| = 0``) the result is defined as 0.
    """
    before = _as_vector(loss_before, "loss_before")
    after = _as_vector(loss_after, "loss_after")
    if before.shape != after.shape:
        raise ValueError(f"loss shapes differ: {before.shape} vs {after.shape}")
    if mask is None:
        m = jnp.ones(before.shape, bool)
    else:
        m = jnp.asarray(mask).astype(bool)
        if m.shape != before.shape:
            raise ValueError(f"mask must have shape {before.shape}, got {m.shape}")
    dtype = jnp.result_type(before.dtype, after.dtype)
    return _improved_kernel(before.astype(dtype), after.astype(dtype), m)


@jax.jit
def _improved_kernel(before: Array, after: Array, m: Array) -> Array:
    improved = after <= before
    count = jnp.sum(m).astype(before.dtype)
    hits = jnp.sum(improved & m).astype(before.dtype)
    return jnp.where(count == 0, 0, hits / jnp.where(count == 0, 1, count))


def calibration_errors(logits, labels, mask=None, num_bins: int = 15) -> tuple[Array, Array]:
    """(ECE, MCE) of one client's predictions (Guo, Pleiss, Sun, Weinberger, "On
    Calibration of Modern Neural Networks", ICML 2017, arXiv:1706.04599).

    Confidence is the max softmax probability of each row of ``logits`` [n, C]; rows
    fall into ``num_bins`` equal-width bins of (0, 1] (15 in the SuPerFed thesis's
    calibration study, Hahn, UNIST 2024, Ch. II), and with acc_b / conf_b the accuracy and mean confidence of bin b,

        ECE = sum_b (|B_b| / n) |acc_b - conf_b|,   MCE = max_b |acc_b - conf_b|

    over the rows with ``mask`` True (padded rows never count); empty bins do not
    enter either. No real rows: (0, 0). Jittable and vmappable over clients.
    """
    probs = jax.nn.softmax(jnp.asarray(logits), axis=-1)
    correct = jnp.argmax(probs, axis=-1) == jnp.asarray(labels)
    return binned_calibration(jnp.max(probs, axis=-1), correct, mask, num_bins)


def binned_calibration(confidence, correct, mask=None, num_bins: int = 15
                       ) -> tuple[Array, Array]:
    """(ECE, MCE) of ``calibration_errors`` from per-row confidences [n] (the max
    softmax probability) and hits [n] (1 where the prediction is right), as
    ``Model.per_example_metrics`` gives them ("confidence", "accuracy")."""
    conf = jnp.asarray(confidence)
    m = jnp.ones(conf.shape, bool) if mask is None else jnp.asarray(mask, bool)
    # padded rows are selected away, so NaN on them cannot leak in
    conf = jnp.where(m, conf, 0)
    correct = jnp.where(m, jnp.asarray(correct), 0).astype(conf.dtype)
    # bin b holds confidences in (b / B, (b + 1) / B]
    bins = jnp.clip(jnp.ceil(conf * num_bins).astype(jnp.int32) - 1, 0, num_bins - 1)
    w = m.astype(conf.dtype)
    count = jax.ops.segment_sum(w, bins, num_segments=num_bins)
    acc_sum = jax.ops.segment_sum(w * correct, bins, num_segments=num_bins)
    conf_sum = jax.ops.segment_sum(w * conf, bins, num_segments=num_bins)
    gap = jnp.abs(acc_sum - conf_sum) / jnp.maximum(count, 1)
    n = jnp.maximum(jnp.sum(w), 1)
    ece = jnp.sum(count * gap) / n
    mce = jnp.max(jnp.where(count > 0, gap, 0.0))
    return ece, mce


# ------------------------------------------------------------------- host helpers


def apply_mask(a, mask, weights=None):
    """Keep only the clients where ``mask`` is True (NumPy side, not jittable).

    Returns ``a[mask]`` as a NumPy array, or ``(a[mask], weights[mask])`` if ``weights``
    is given. Use it to summarise a subset of clients, e.g. those with at least one test
    example: ``apply_mask(acc, n_test > 0, n_test)``.
    """
    a = np.asarray(a)
    m = np.asarray(mask).astype(bool)
    if a.ndim != 1 or m.shape != a.shape:
        raise ValueError(f"a and mask must both have shape [N]; got {a.shape}, {m.shape}")
    if weights is None:
        return a[m]
    w = np.asarray(weights)
    if w.shape != a.shape:
        raise ValueError(f"weights must have shape {a.shape}, got {w.shape}")
    return a[m], w[m]


def _pct(fraction: float) -> str:
    return f"{round(float(fraction) * 100, 6):g}%"


def fairness_summary(
    a,
    weights=None,
    fractions: Sequence[float] = (0.05, 0.1),
    mask=None,
) -> dict[str, float]:
    """The reported fairness metrics of per-client values ``a`` as Python floats.

    Keys: ``"mean"`` (unweighted), ``"weighted_mean"`` (only if ``weights``), ``"std"``,
    ``"variance"``, then for each fraction ``x`` in ``fractions`` (e.g. 0.05 -> ``"5%"``):
    ``"worst_x%"``, ``"best_x%"``, ``"parity_gap_x%"``; then ``"gini"``, ``"angle"``
    (degrees) and ``"kl_to_uniform"``. With ``weights`` (test sizes ``n_i``) the
    worst/best groups are averaged with weights ``n_i`` (AAggFF), otherwise unweighted
    (DQN-Fed, q-FFL); with weights, the unweighted group means are given too, as
    ``"worst_x%_unweighted"`` and ``"best_x%_unweighted"``. If ``mask`` is given, only clients with ``mask`` True are summarised (see
    :func:`apply_mask`). Raises ``ValueError`` if no client is left.

    Computed on the host with NumPy in float64 (the same formulas, groups and tie
    rule as the jittable metrics above, which agree with it to float32 rounding): a
    summary between chunks of a run costs microseconds and compiles nothing.
    """
    if mask is not None:
        if weights is None:
            a = apply_mask(a, mask)
        else:
            a, weights = apply_mask(a, mask, weights)
    a = np.asarray(a)
    if a.ndim != 1:
        raise ValueError(f"a must have shape [N], got shape {a.shape}")
    if a.shape[0] == 0:
        raise ValueError("fairness_summary needs at least one client, got an empty array")
    x = a.astype(np.float64)
    w = None
    if weights is not None:
        w = np.asarray(weights)
        if w.ndim != 1 or w.shape != a.shape:
            raise ValueError(f"weights must have shape {a.shape}, got {w.shape}")
        w = w.astype(np.float64)
    n = x.shape[0]
    ascending = np.argsort(x, kind="stable")
    # descending, lower index first among ties (NaN first, as jnp.argsort descending)
    descending = n - 1 - np.argsort(x[::-1], kind="stable")[::-1]

    def group(order, k, weighted):
        sel = x[order[:k]]
        if not weighted:
            return float(sel.mean())
        return _np_weighted_mean(sel, w[order[:k]])

    m = float(x.mean())
    var = float(np.mean((x - m) ** 2))
    out: dict[str, float] = {"mean": m}
    if w is not None:
        out["weighted_mean"] = _np_weighted_mean(x, w)
    out["std"] = math.sqrt(var) if var >= 0 else float("nan")
    out["variance"] = var
    for f in fractions:
        tag = _pct(f)
        k = num_selected(n, f)
        lo, hi = group(ascending, k, w is not None), group(descending, k, w is not None)
        out[f"worst_{tag}"] = lo
        out[f"best_{tag}"] = hi
        out[f"parity_gap_{tag}"] = hi - lo
        if w is not None:
            out[f"worst_{tag}_unweighted"] = group(ascending, k, False)
            out[f"best_{tag}_unweighted"] = group(descending, k, False)
    s = x[ascending]
    total = float(s.sum())
    out["gini"] = _np_gini_sorted(s, total)
    all_equal = bool(x.max() == x.min())
    perp = math.sqrt(float(np.sum((x - m) ** 2)))
    out["angle"] = 0.0 if all_equal else math.degrees(math.atan2(perp, m * math.sqrt(n)))
    p = x / (1.0 if total == 0 else total)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log(np.where(p > 0, n * p, 1.0)), 0.0)
    out["kl_to_uniform"] = 0.0 if all_equal else float(terms.sum())
    return out


def _np_weighted_mean(a: np.ndarray, w: np.ndarray) -> float:
    """NumPy twin of ``_safe_weighted_mean``: sum(w a) / sum(w), the plain mean when
    the weights sum to 0."""
    total = float(w.sum())
    return float(a.mean()) if total == 0 else float(np.dot(w, a) / total)


# ----------------------------------------------------------------- curves over rounds
# Host-side (NumPy) metrics of per-round curves (R_p and smoothness of Ben Mansour et al.,
# arXiv:2307.06283, Tables 3-4).


def rounds_to_reach(curve, level: float = 0.9) -> float:
    """R_p = min{r : a_r >= level}, where ``curve[0]`` is the accuracy of the initial
    model and r counts completed rounds; +inf when the level is never reached."""
    a = np.asarray(curve, np.float64)
    if a.ndim != 1 or a.size == 0:
        raise H.FieldError("curve", f"must be a non-empty 1-D sequence, got shape {a.shape}")
    hit = np.flatnonzero(a >= level)
    return float(hit[0]) if hit.size else math.inf


def smoothness(curve) -> float:
    """S = std(Delta) / |mean(Delta)|, Delta_r = a_{r+1} - a_r, population std: 0 for
    a straight line, invariant to scaling the curve, higher = less smooth."""
    d = np.diff(np.asarray(curve, np.float64))
    if d.size == 0:
        raise H.FieldError("curve", "needs at least two points")
    m = abs(d.mean())
    return float(d.std() / m) if m > 0 else (0.0 if d.std() == 0 else math.inf)


def tail_mean(curve, k: int) -> float:
    """Mean of the last ``k`` points of a curve (all of it if shorter): the "final"
    numbers of papers that average the last evaluations instead of taking the last
    one. ``curve`` may be values or a run's history with ``key`` picked by the caller,
    e.g. ``tail_mean([h["accuracy_worst_10%"] for h in result.history], 5)``."""
    a = np.asarray(curve, np.float64)
    if a.ndim != 1 or a.size == 0:
        raise H.FieldError("curve", f"must be a non-empty 1-D sequence, got shape {a.shape}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise H.FieldError("k", f"must be a positive integer, got {k!r}")
    return float(a[-k:].mean())


def select_evaluation(history, key: str = "validation_accuracy_mean",
                      mode: str = "max") -> Optional[dict]:
    """Model selection on a run's history: the first evaluation with the largest
    (``mode="max"``) or smallest (``"min"``) finite ``key``, e.g. the round whose
    validation accuracy is best, with its test metrics beside it. None when no
    evaluation has a finite ``key`` (a run without a validation split)."""
    if mode not in ("max", "min"):
        raise H.FieldError("mode", f"must be 'max' or 'min', got {mode!r}")
    best = None
    for entry in history:
        v = entry.get(key)
        if v is None or not math.isfinite(v):
            continue
        if best is None or (v > best[key] if mode == "max" else v < best[key]):
            best = entry
    return None if best is None else dict(best)


def confidence_interval(samples, z: float = 1.96) -> tuple[float, float]:
    """mean -/+ z * sigma / sqrt(n) with the population sigma (ddof 0), as the
    computational-heterogeneity code reports R90. Infinite samples (runs that never
    reached the level) must be dropped and counted separately by the caller."""
    x = np.asarray(samples, np.float64)
    if x.ndim != 1 or x.size == 0 or not np.all(np.isfinite(x)):
        raise H.FieldError("samples", "must be a non-empty 1-D sequence of finite values")
    half = z * x.std() / math.sqrt(x.size)
    return float(x.mean() - half), float(x.mean() + half)


def weight_drift(weights, data_weights) -> np.ndarray:
    """mean_i |alpha_i^r - p_i| for every round r: ``weights`` and ``data_weights``
    are [R, K] (the rounds' aggregation weights and data weights n_k / sum n)."""
    a, p = np.asarray(weights, np.float64), np.asarray(data_weights, np.float64)
    if a.shape != p.shape or a.ndim != 2:
        raise H.FieldError("weights", f"must match data_weights as [R, K], got {a.shape} "
                                      f"and {p.shape}")
    return np.abs(a - p).mean(axis=1)


def participation_counts(client_ids, client_mask, num_clients: int) -> np.ndarray:
    """How many rounds each of the N clients reported in: the round log's cohorts
    ``client_ids`` [R, K] counted where ``client_mask`` [R, K] is True (unavailable,
    dropped and late clients do not count); int64 [N]."""
    ids = np.asarray(client_ids).reshape(-1)
    mask = np.asarray(client_mask, bool).reshape(-1)
    if ids.shape != mask.shape:
        raise H.FieldError("client_mask", f"has {mask.size} entries, client_ids {ids.size}")
    return np.bincount(ids[mask], minlength=num_clients).astype(np.int64)


def participation_summary(counts, num_rounds: int, accuracy=None, has_test=None) -> dict:
    """Participation over a run: the share of the ``num_rounds`` rounds each client
    reported in (mean, min, max), the clients that never took part, the Gini of the
    counts (0: everyone equally often), and, given the final per-client ``accuracy``
    [N] (over the clients with ``has_test``), the Pearson correlation of participation
    with accuracy (None when either is constant: it does not exist)."""
    c = np.asarray(counts, np.float64)
    share = c / max(int(num_rounds), 1)
    out = {"rounds": int(num_rounds), "share_mean": float(share.mean()),
           "share_min": float(share.min()), "share_max": float(share.max()),
           "never": int(np.sum(c == 0)),
           "gini": _np_gini_sorted(np.sort(c), float(c.sum())) if c.sum() > 0 else 0.0}
    if accuracy is not None:
        keep = np.ones(c.shape, bool) if has_test is None else np.asarray(has_test, bool)
        a, p = np.asarray(accuracy, np.float64)[keep], c[keep]
        ok = a.size > 1 and np.std(a) > 0 and np.std(p) > 0
        out["corr_accuracy"] = float(np.corrcoef(p, a)[0, 1]) if ok else None
    return out


def time_to_reach(history, level: float = 0.9, key: str = "accuracy_mean",
                  clock: str = "clock_seconds") -> float:
    """The simulated time at which ``key`` first reaches ``level``: the ``clock``
    seconds of the first evaluation of ``history`` (a run's evaluations, in order)
    with ``key >= level``; +inf when never reached (R_p of ``rounds_to_reach`` on the
    virtual clock)."""
    rows = [h for h in history if key in h and clock in h]
    if not rows:
        raise H.FieldError("history", f"has no evaluation with both {key!r} and {clock!r}")
    for h in rows:
        if h[key] >= level:
            return float(h[clock])
    return math.inf
