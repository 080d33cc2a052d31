"""Per-client test sets: a local holdout, or a label-matched draw from a global test set.

Personalised and fair FL report accuracy on each client's own test data. The specs
use two protocols:

- ``holdout_split``: hold out a fraction of each client's own examples (the 80/20
  split of AAggFF, FedEvg and SuPerFed, Hahn's PhD thesis Ch. III §6.1, Ch. IV §4.1,
  Ch. II §4.1; for DQN-Fed, whose paper leaves it open, our choice for natural
  partitions). Optionally stratified by label ("stratified where applicable",
  AAggFF).
- ``matched_test``: draw each client's test examples from the global test set so that
  their label proportions match the client's training label proportions (our choice
  for DQN-Fed's Dirichlet / shard splits, whose per-client test sets it leaves open).

Both work on index arrays (pure NumPy, seeded by ``np.random.default_rng(seed)``), so
the caller gathers inputs and labels; neither touches labels, so label noise
(``noise.py``) applied afterwards to the training side leaves test labels clean.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from fedjax_fair.data.federated import _check_fraction, _check_seed, _num_train
from fedjax_fair.data.partition import apportion
from fedjax_fair import hparams as H


def _as_index(part, k: int) -> np.ndarray:
    part = np.asarray(part)
    if part.ndim != 1 or (part.size and not np.issubdtype(part.dtype, np.integer)):
        raise H.FieldError("parts", f"client {k} must be a 1-D integer index array, got shape "
                                    f"{part.shape} and dtype {part.dtype}")
    return part.astype(np.int64)


def _check_labels(labels, field: str, num_classes: int | None = None) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or (labels.size and not np.issubdtype(labels.dtype, np.integer)):
        raise H.FieldError(field, f"must be 1-D integer labels, got shape {labels.shape} and "
                                  f"dtype {labels.dtype}")
    if num_classes is not None and labels.size and (labels.min() < 0
                                                    or labels.max() >= num_classes):
        raise H.FieldError(field, f"labels must lie in [0, num_classes={num_classes}), got "
                                  f"[{labels.min()}, {labels.max()}]")
    return labels


def holdout_split(parts: Sequence[np.ndarray], test_fraction: float, seed: int,
                  labels: np.ndarray | None = None
                  ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Splits every client's indices into a local train part and a local test part.

    The rounding rule is ``split_per_client``'s (federated.py, ``_num_train``): a client
    with n indices keeps ``max(1, floor((1 - test_fraction) n))`` for training and the
    rest for test, so a client with n >= 2 gets at least one test example and a client
    with n = 1 none. Which indices are held out is a seeded random choice.

    Args:
      parts: per-client index arrays (e.g. a partitioner's output).
      test_fraction: f in (0, 1), e.g. 0.2 for the specs' 80/20 split.
      seed: seeds the choice (one generator, clients in order).
      labels: optional labels of the pool the indices point into. When given the split
        is stratified: the rule above is applied to each (client, class) group
        separately, so each class keeps its share in both parts (a client's test size
        can then differ by a few examples from the unstratified rule).

    Returns:
      (train_parts, test_parts): lists of sorted int64 index arrays; for every client
      they are disjoint and their union is the client's indices.
    """
    test_fraction = _check_fraction(test_fraction, "test_fraction")
    rng = np.random.default_rng(_check_seed(seed))
    if labels is not None:
        labels = _check_labels(labels, "labels")
    train_parts, test_parts = [], []
    for k, part in enumerate(parts):
        part = _as_index(part, k)
        if labels is not None and part.size and (part.min() < 0 or part.max() >= labels.size):
            raise H.FieldError("parts", f"client {k} has indices outside [0, {labels.size})")
        groups = ([part] if labels is None
                  else [part[labels[part] == c] for c in np.unique(labels[part])])
        train, test = [], []
        for group in groups:
            order = rng.permutation(group)
            cut = _num_train(group.size, test_fraction)
            train.append(order[:cut])
            test.append(order[cut:])
        train_parts.append(np.sort(np.concatenate(train)) if train else np.zeros(0, np.int64))
        test_parts.append(np.sort(np.concatenate(test)) if test else np.zeros(0, np.int64))
    return train_parts, test_parts


def _client_sizes(size, train_counts: np.ndarray, num_test: int) -> np.ndarray:
    """Test size of every client: the proportional default or the caller's int / list."""
    n_train = train_counts.sum(axis=1)
    num_clients = n_train.size
    if size is None:
        total = n_train.sum()
        if total == 0:
            return np.zeros(num_clients, np.int64)
        return np.rint(num_test * n_train / total).astype(np.int64)
    if isinstance(size, (int, np.integer)) and not isinstance(size, (bool, np.bool_)):
        sizes = np.full(num_clients, int(size), np.int64)
    else:
        sizes = np.asarray(size)
        if sizes.shape != (num_clients,) or not np.issubdtype(sizes.dtype, np.integer):
            raise H.FieldError("size", f"must be None, an integer or {num_clients} integers (one "
                                       f"per client), got {size!r}")
        sizes = sizes.astype(np.int64)
    if (sizes < 0).any():
        raise H.FieldError("size", f"test sizes must be >= 0, got {size!r}")
    return np.where(n_train > 0, sizes, 0)


def matched_test(train_labels, test_labels, num_classes: int, seed: int, *,
                 parts: Sequence[np.ndarray] | None = None, size=None,
                 replace: bool = False) -> list[np.ndarray]:
    """Per-client test sets drawn from the global test set with matched label mix.

    For client k with training label counts m_k[c] (n_k = sum_c m_k[c]) and test size
    s_k, the per-class test counts are ``t_k = apportion(m_k, s_k)`` (largest-remainder
    rounding of s_k m_k[c] / n_k, summing exactly to s_k), and t_k[c] indices of class
    c are drawn uniformly from the global test set. This is our choice for DQN-Fed's
    label-skewed setups (draw each client's test samples from the global test set with
    the client's label proportions); none of the papers fixes the size, so:

    - ``size=None`` (default): s_k = round(len(test_labels) n_k / sum_j n_j), i.e. the
      client's share of the global test set in proportion to its share of the
      training pool (for a disjoint partition of the whole training set the client
      test sets then have about as many examples in all as the global test set).
    - an int: the same s_k for every client; a sequence: one s_k per client.

    Draws are independent across clients, so two clients' test sets may share
    indices; within a client, ``replace=False`` (default) gives distinct indices and
    raises ``ValueError("size: ...")`` when a class is asked for more examples than the
    global test set has, ``replace=True`` samples with replacement. A client without
    training examples gets an empty test set.

    Args:
      train_labels: either a list of per-client training label arrays (parts=None), or
        the training pool's labels with ``parts`` the per-client index arrays into it.
      test_labels: labels of the global test set, 1-D in [0, num_classes).
      num_classes: C; every label must lie in [0, C).
      seed: seeds the draws (one generator, clients in order).
      parts: optional per-client indices into ``train_labels``.
      size: None, an int, or one int per client (see above).
      replace: sample with replacement within a class.

    Returns:
      One sorted int64 array of indices into the global test set per client.
    """
    if (isinstance(num_classes, (bool, np.bool_)) or not isinstance(num_classes, (int, np.integer))
            or num_classes < 1):
        raise H.FieldError("num_classes", f"must be an integer >= 1, got {num_classes!r}")
    rng = np.random.default_rng(_check_seed(seed))
    test_labels = _check_labels(test_labels, "test_labels", num_classes)
    if parts is not None:
        pool = _check_labels(train_labels, "train_labels", num_classes)
        per_client = []
        for k, part in enumerate(parts):
            part = _as_index(part, k)
            if part.size and (part.min() < 0 or part.max() >= pool.size):
                raise H.FieldError("parts", f"client {k} has indices outside [0, {pool.size})")
            per_client.append(pool[part])
    else:
        per_client = [_check_labels(y, f"train_labels: client {k}", num_classes)
                      for k, y in enumerate(train_labels)]
    counts = np.stack([np.bincount(y, minlength=num_classes) for y in per_client]
                      ) if per_client else np.zeros((0, num_classes), np.int64)
    sizes = _client_sizes(size, counts, test_labels.size)
    by_class = [np.flatnonzero(test_labels == c) for c in range(num_classes)]
    out = []
    for k in range(counts.shape[0]):
        if sizes[k] == 0:
            out.append(np.zeros(0, np.int64))
            continue
        want = apportion(counts[k], int(sizes[k]))
        drawn = []
        for c in np.flatnonzero(want):
            if by_class[c].size == 0:
                raise H.FieldError("test_labels", f"client {k} trains on class {c}, which the "
                                                  f"test set does not contain")
            if not replace and want[c] > by_class[c].size:
                raise H.FieldError("size", f"client {k} needs {want[c]} test examples of class {c} "
                                           f"but the test set has {by_class[c].size}; lower size "
                                           f"or "
                                           f"set replace=True")
            drawn.append(rng.choice(by_class[c], int(want[c]), replace=replace))
        out.append(np.sort(np.concatenate(drawn)).astype(np.int64))
    return out
