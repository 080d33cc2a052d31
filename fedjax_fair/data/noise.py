"""Label noise: class-transition matrices and seeded label flipping.

The SuPerFed label-noise study (Hahn's PhD thesis Ch. II §4.3, Table 2.6, "Label noise"):
with noise rate epsilon (``rate``) and N classes (``num_classes``),

- pair: ``T[i, i] = 1 - eps``, ``T[i, (i + 1) mod N] = eps``;
- symmetric: ``T[i, i] = 1 - eps``, ``T[i, j] = eps / (N - 1)`` for j != i;

and every label y is replaced by a draw from row ``T[y, :]``. The thesis's
definitions are followed; the reference code swaps the two generators (its "pair"
calls the symmetric noiser), which is not reproduced here.

Only training labels are noised: the caller applies ``add_label_noise`` to each
client's training split after the train/test split (the reference code noises
before the split; the thesis keeps test labels clean). Nothing here modifies its
input array.
"""
from __future__ import annotations

import numpy as np

from fedjax_fair.hparams import FieldError, probability

NOISE_KINDS = ("none", "symmetric", "pair")
"""Accepted values of ``add_label_noise(kind=...)`` (the ``label_noise`` field)."""


def _check_num_classes(num_classes) -> int:
    if (isinstance(num_classes, (bool, np.bool_)) or not isinstance(num_classes, (int, np.integer))
            or num_classes < 2):
        raise FieldError("num_classes", f"must be an integer >= 2, got {num_classes!r}")
    return int(num_classes)


def _check_rate(rate) -> float:
    return probability(rate, "noise_rate")


def symmetric_transition(num_classes: int, rate: float) -> np.ndarray:
    """T_sym [C, C]: keep a label with probability 1 - eps, else a uniform other class.

    ``T[i, i] = 1 - rate`` and ``T[i, j] = rate / (C - 1)`` for j != i, with
    C = ``num_classes`` >= 2 and eps = ``rate`` in [0, 1] (thesis values 0.2, 0.6).
    Rows sum to one (float64).
    """
    c, rate = _check_num_classes(num_classes), _check_rate(rate)
    t = np.full((c, c), rate / (c - 1))
    np.fill_diagonal(t, 1.0 - rate)
    return t


def pair_transition(num_classes: int, rate: float) -> np.ndarray:
    """T_pair [C, C]: label i becomes (i + 1) mod C with probability eps.

    ``T[i, i] = 1 - rate`` and ``T[i, (i + 1) mod C] = rate``, every other entry 0,
    with C = ``num_classes`` >= 2 and eps = ``rate`` in [0, 1] (thesis values 0.1, 0.4).
    Rows sum to one (float64).
    """
    c, rate = _check_num_classes(num_classes), _check_rate(rate)
    t = np.diag(np.full(c, 1.0 - rate))
    t[np.arange(c), (np.arange(c) + 1) % c] += rate
    return t


def flip_labels(labels, transition, seed: int) -> np.ndarray:
    """Replaces every label y by an independent draw from row ``transition[y]``.

    Args:
      labels: 1-D integer labels in [0, C).
      transition: row-stochastic [C, C] matrix T (entries >= 0, rows summing to 1
        within 1e-6); T[y, j] is the probability that y becomes j.
      seed: seeds ``np.random.default_rng``; the same arguments give the same labels.

    Returns:
      A new array with the dtype and shape of ``labels`` (the input is not modified).
      Draws use one uniform u per example and the inverse CDF of its row.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or (labels.size and not np.issubdtype(labels.dtype, np.integer)):
        raise FieldError("labels", f"must be 1-D integers, got shape {labels.shape} and "
                                   f"dtype {labels.dtype}")
    t = np.asarray(transition, np.float64)
    if t.ndim != 2 or t.shape[0] != t.shape[1] or t.shape[0] == 0:
        raise FieldError("transition", f"must be a square [C, C] matrix, got shape {t.shape}")
    if not np.all(np.isfinite(t)) or (t < 0).any() or not np.allclose(t.sum(1), 1.0, atol=1e-6):
        raise FieldError("transition", "entries must be finite and >= 0 with every row "
                                       "summing to 1")
    c = t.shape[0]
    if labels.size and (labels.min() < 0 or labels.max() >= c):
        raise FieldError("labels", f"must lie in [0, {c}) for a {c}x{c} transition, got "
                                     f"[{labels.min()}, {labels.max()}]")
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise FieldError("seed", f"must be an integer >= 0, got {seed!r}")
    u = np.random.default_rng(seed).random(labels.size)
    cdf = np.cumsum(t, axis=1)
    new = np.empty(labels.size, np.int64)
    for y in np.unique(labels):
        rows = labels == y
        new[rows] = np.searchsorted(cdf[y], u[rows], side="right")  # first j: u < cdf[y, j]
    return np.minimum(new, c - 1).astype(labels.dtype)  # guard against cdf[y, -1] < 1


def add_label_noise(labels, kind: str, rate: float, num_classes: int, seed: int
                    ) -> np.ndarray:
    """Noisy copy of ``labels`` under the thesis's pair or symmetric noise.

    Args:
      labels: 1-D integer training labels in [0, num_classes). Apply to training
        splits only; test labels stay clean (thesis Ch. II §4.3).
      kind: ``label_noise`` field: "none" (returns a copy), "symmetric" or "pair".
      rate: ``noise_rate`` field, eps in [0, 1].
      num_classes: C >= 2.
      seed: seeds the flips.

    Returns a new array; the expected fraction of changed labels is ``rate``.
    """
    if kind not in NOISE_KINDS:
        raise FieldError("label_noise", f"must be one of {list(NOISE_KINDS)}, got {kind!r}")
    rate = _check_rate(rate)
    if kind == "none":
        return np.array(labels, copy=True)
    make = symmetric_transition if kind == "symmetric" else pair_transition
    return flip_labels(labels, make(num_classes, rate), seed)
