"""Partitioners: split one labelled pool of examples across clients.

Every partitioner is a pure function
``(labels, num_clients, seed, **params) -> list[np.ndarray]`` returning one sorted
int64 index array per client. The arrays are disjoint and together cover every index,
and the same arguments always give the same partition (all randomness comes from
``np.random.default_rng(seed)``).

- ``iid``: a uniformly random split into near-equal parts.
- ``dirichlet``: label skew. For every class c, client shares p_c ~ Dir(alpha 1_N)
  and the class's examples are cut in those proportions (the per-class form of
  Yurochkin et al. 2019 / Wang et al. 2020, "Federated Learning with Matched
  Averaging"; the concentration alpha plays the role of Hsu et al. 2019's alpha).
  Smaller alpha means more skew.
- ``shards``: the pathological split of McMahan et al. 2017 ("Communication-Efficient
  Learning of Deep Networks from Decentralized Data"): sort by label, cut into
  num_clients * shards_per_client shards, give every client shards_per_client
  random shards.
"""
from __future__ import annotations

import numpy as np


def _check(labels, num_clients, seed) -> tuple[np.ndarray, int]:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels: must be 1-D, got shape {labels.shape}")
    if labels.size and not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels: must be integers, got dtype {labels.dtype}")
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)):
        raise ValueError(f"num_clients: must be an integer, got {num_clients!r}")
    if num_clients <= 0:
        raise ValueError(f"num_clients: must be > 0, got {num_clients}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed: must be an integer >= 0, got {seed!r}")
    return labels, int(num_clients)


def _finish(parts) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, np.int64)) for p in parts]


def iid(labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
    """Shuffles all indices and cuts them into num_clients parts of near-equal size.

    Sizes differ by at most one (the first n mod num_clients clients get one more);
    with more clients than examples the last clients are empty.
    """
    labels, num_clients = _check(labels, num_clients, seed)
    order = np.random.default_rng(seed).permutation(labels.size)
    return _finish(np.array_split(order, num_clients))


def dirichlet(labels: np.ndarray, num_clients: int, seed: int, alpha: float = 0.5,
              min_size: int = 10, balance: bool = False, max_retries: int = 1000
              ) -> list[np.ndarray]:
    """Label-skewed split: per class c, client proportions p_c ~ Dir(alpha * 1_N).

    The examples of class c (shuffled) are cut at the cumulative proportions,
    ``floor(cumsum(p_c) * n_c)``. The whole draw is repeated (from the same
    generator, so still a function of ``seed``) until every client holds at least
    ``min_size`` examples, at most ``max_retries`` times; then a ValueError says
    which knob to turn.

    Args:
      alpha: Dirichlet concentration (> 0); small alpha -> each client sees few classes.
      min_size: smallest acceptable client (0 accepts any draw). Needs
        num_clients * min_size <= len(labels).
      balance: if True, as in the reference code of Wang et al. 2020 (also used by
        the SuPerFed code, see spec/superfed.md), a client that already holds
        len(labels) / num_clients examples gets no share of later classes, which
        keeps client sizes closer to equal. Off by default (the paper's description).
      max_retries: bound on the number of draws.
    """
    labels, num_clients = _check(labels, num_clients, seed)
    try:
        alpha = float(alpha)
    except (TypeError, ValueError):
        raise ValueError(f"alpha: must be a number > 0, got {alpha!r}") from None
    if not alpha > 0:
        raise ValueError(f"alpha: must be > 0, got {alpha!r}")
    if isinstance(min_size, bool) or not isinstance(min_size, (int, np.integer)) or min_size < 0:
        raise ValueError(f"min_size: must be an integer >= 0, got {min_size!r}")
    if num_clients * min_size > labels.size:
        raise ValueError(f"min_size: {num_clients} clients x min_size={min_size} exceeds the "
                         f"{labels.size} examples available")
    if not isinstance(max_retries, (int, np.integer)) or max_retries < 1:
        raise ValueError(f"max_retries: must be an integer >= 1, got {max_retries!r}")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    target = labels.size / num_clients
    for _ in range(max_retries):
        parts = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, np.int64)
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            p = rng.dirichlet(np.full(num_clients, alpha))
            if balance:
                p = np.where(sizes < target, p, 0.0)
                p = p / p.sum() if p.sum() > 0 else np.full(num_clients, 1.0 / num_clients)
            cuts = (np.cumsum(p)[:-1] * idx.size).astype(np.int64)
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].append(chunk)
                sizes[k] += chunk.size
        if sizes.min() >= min_size:
            return _finish([np.concatenate(p) if p else [] for p in parts])
    raise ValueError(
        f"min_size: no Dirichlet draw in max_retries={max_retries} gave every client at "
        f"least min_size={min_size} examples (alpha={alpha}, num_clients={num_clients}, "
        f"{labels.size} examples); lower min_size, raise alpha, use fewer clients or "
        f"set balance=True")


def shards(labels: np.ndarray, num_clients: int, seed: int, shards_per_client: int = 2
           ) -> list[np.ndarray]:
    """McMahan et al. 2017's pathological non-IID split.

    Indices are shuffled, then stably sorted by label (so the order within a label is
    random), cut into S = num_clients * shards_per_client contiguous shards, and a
    random permutation of the shards deals shards_per_client of them to each client.
    When S does not divide len(labels) the shard sizes differ by at most one
    (``np.array_split``), so every index is still used exactly once. When every
    shard lies inside one label, each client sees at most shards_per_client labels.
    """
    labels, num_clients = _check(labels, num_clients, seed)
    if (isinstance(shards_per_client, bool) or not isinstance(shards_per_client, (int, np.integer))
            or shards_per_client < 1):
        raise ValueError(f"shards_per_client: must be an integer >= 1, got {shards_per_client!r}")
    num_shards = num_clients * shards_per_client
    if num_shards > labels.size:
        raise ValueError(f"shards_per_client: {num_clients} clients x {shards_per_client} "
                         f"shards exceeds the {labels.size} examples available")
    rng = np.random.default_rng(seed)
    shuffled = rng.permutation(labels.size)
    by_label = shuffled[np.argsort(labels[shuffled], kind="stable")]
    pieces = np.array_split(by_label, num_shards)
    deal = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    return _finish([np.concatenate([pieces[s] for s in row]) for row in deal])


PARTITIONERS = {"iid": iid, "dirichlet": dirichlet, "shards": shards}
