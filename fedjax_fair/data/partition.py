"""Partitioners: split one labelled pool of examples across clients.

Every partitioner is a pure function
``(labels, num_clients, seed, **params) -> list[np.ndarray]`` returning one sorted
int64 index array per client (client k = element k). Unless its docstring says
otherwise, the arrays are disjoint and together cover every index; the same arguments
always give the same partition (all randomness comes from
``np.random.default_rng(seed)``).

Disjoint and covering (``COVERING``):

- ``iid``: a uniformly random split into near-equal parts.
- ``dirichlet``: label skew. For every class c, client shares p_c ~ Dir(alpha 1_N)
  and the class's examples are cut in those proportions (the per-class form of
  Yurochkin et al. 2019 / Wang et al. 2020, "Federated Learning with Matched
  Averaging"; the concentration alpha plays the role of Hsu et al. 2019's alpha).
  Smaller alpha means more skew.
- ``shards``: the pathological split of McMahan et al. 2017 ("Communication-Efficient
  Learning of Deep Networks from Decentralized Data"): sort by label, cut into
  num_clients * shards_per_client shards, give every client shards_per_client
  random shards (or, ``assignment="modulo"``, shard s to client s mod N as in the
  SuPerFed reference code, github.com/vaseline555/SuPerFed).
- ``classes``: "#C=k" label skew (Li et al. 2022, "Federated Learning on Non-IID Data
  Silos", NIID-Bench): every client is given k classes and each class is cut evenly
  among the clients holding it. (Covers every index when num_clients * k >= the
  number of classes.)
- ``quantity``: label-IID examples, client sizes drawn from a log-normal or a
  power-law (Pareto) distribution.
- ``unbalanced_shards``: the NIID / TNIID split of Ben Mansour et al.
  (arXiv:2307.06283) §3.1: shards of a fixed size, one random shard per client, every other shard to a
  uniformly random client.

Partial or overlapping, by design:

- ``natural``: one client per writer / user id (LEAF-style natural partitions);
  with fewer clients than groups, a seeded subset of groups is kept and the rest
  dropped.
- ``handpick``: the alternative "hand-pick" split of
  Ben Mansour et al. (arXiv:2307.06283) §3.1 / Table 2: fixed class pairs shared by groups of
  clients, a fixed number of examples per class; the remaining examples are dropped.
- ``dirichlet_prior``: the per-client-prior Dirichlet split with pool refills of
  A-FedPD (arXiv:2409.18915) §5 and App. A.3: equal client sizes; clients may share examples.

``apportion`` (largest-remainder rounding) is shared with ``client_test.py``.
"""
from __future__ import annotations

import numpy as np
from fedjax_fair import hparams as H


def _check(labels, num_clients, seed) -> tuple[np.ndarray, int]:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise H.FieldError("labels", f"must be 1-D, got shape {labels.shape}")
    if labels.size and not np.issubdtype(labels.dtype, np.integer):
        raise H.FieldError("labels", f"must be integers, got dtype {labels.dtype}")
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)):
        raise H.FieldError("num_clients", f"must be an integer, got {num_clients!r}")
    if num_clients <= 0:
        raise H.FieldError("num_clients", f"must be > 0, got {num_clients}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise H.FieldError("seed", f"must be an integer >= 0, got {seed!r}")
    return labels, int(num_clients)


def _check_int(value, field: str, minimum: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or value < minimum:
        raise H.FieldError(field, f"must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_float(value, field: str, above: float) -> float:
    """A finite number strictly greater than ``above``."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise H.FieldError(field, f"must be a number > {above:g}, got {value!r}") from None
    if not (np.isfinite(value) and value > above):
        raise H.FieldError(field, f"must be a finite number > {above:g}, got {value!r}")
    return value


def _sorted_by_label(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """All indices sorted by label, in random order within a label (shuffle, stable sort)."""
    shuffled = rng.permutation(labels.size)
    return shuffled[np.argsort(labels[shuffled], kind="stable")]


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
        the SuPerFed code, github.com/vaseline555/SuPerFed), a client that already holds
        len(labels) / num_clients examples gets no share of later classes, which
        keeps client sizes closer to equal. Off by default (the paper's description).
      max_retries: bound on the number of draws.
    """
    labels, num_clients = _check(labels, num_clients, seed)
    try:
        alpha = float(alpha)
    except (TypeError, ValueError):
        raise H.FieldError("alpha", f"must be a number > 0, got {alpha!r}") from None
    if not alpha > 0:
        raise H.FieldError("alpha", f"must be > 0, got {alpha!r}")
    if isinstance(min_size, bool) or not isinstance(min_size, (int, np.integer)) or min_size < 0:
        raise H.FieldError("min_size", f"must be an integer >= 0, got {min_size!r}")
    if num_clients > labels.size and min_size > 0:
        raise H.FieldError("num_clients", f"{num_clients} clients cannot each hold min_size="
                                          f"{min_size} of the {labels.size} examples available")
    if num_clients * min_size > labels.size:
        raise H.FieldError("min_size", f"{num_clients} clients x min_size={min_size} exceeds the "
                                       f"{labels.size} examples available")
    if not isinstance(max_retries, (int, np.integer)) or max_retries < 1:
        raise H.FieldError("max_retries", f"must be an integer >= 1, got {max_retries!r}")
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
    raise H.FieldError(
        "min_size", f"no Dirichlet draw in max_retries={max_retries} gave every client at "
                      f"least min_size={min_size} examples (alpha={alpha}, "
                      f"num_clients={num_clients}, "
                      f"{labels.size} examples); lower min_size, raise alpha, use fewer clients or "
                      f"set balance=True")


def shards(labels: np.ndarray, num_clients: int, seed: int, shards_per_client: int = 2,
           assignment: str = "random") -> list[np.ndarray]:
    """McMahan et al. 2017's pathological non-IID split.

    Indices are shuffled, then stably sorted by label (so the order within a label is
    random), cut into S = num_clients * shards_per_client contiguous shards, and dealt
    shards_per_client per client. When S does not divide len(labels) the shard sizes
    differ by at most one (``np.array_split``), so every index is still used exactly
    once. When every shard lies inside one label, each client sees at most
    shards_per_client labels.

    Args:
      shards_per_client: shards per client (the paper's 2).
      assignment: how shards are dealt.
        ``"random"`` (default): a random permutation of the S shards, cut into rows of
        shards_per_client.
        ``"modulo"``: shard s goes to client ``s mod num_clients``, the SuPerFed
        reference code's deal (thesis Ch. II §4.1, Table 2.2): client k gets shards k, k + N,
        k + 2N, ... of the label-sorted pool, mostly two classes with 2 shards per
        client. The deal itself is fixed; the seed only orders examples within a label.
    """
    labels, num_clients = _check(labels, num_clients, seed)
    shards_per_client = _check_int(shards_per_client, "shards_per_client", 1)
    if assignment not in ("random", "modulo"):
        raise H.FieldError("assignment", f"must be 'random' or 'modulo', got {assignment!r}")
    num_shards = num_clients * shards_per_client
    if num_shards > labels.size:
        raise H.FieldError("shards_per_client", f"{num_clients} clients x {shards_per_client} "
                                                f"shards exceeds the {labels.size} examples "
                                                f"available")
    rng = np.random.default_rng(seed)
    pieces = np.array_split(_sorted_by_label(labels, rng), num_shards)
    if assignment == "random":
        deal = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    else:  # shard s -> client s mod N, i.e. row k holds shards k, k + N, ...
        deal = np.arange(num_shards).reshape(shards_per_client, num_clients).T
    return _finish([np.concatenate([pieces[s] for s in row]) for row in deal])


def unbalanced_shards(labels: np.ndarray, num_clients: int, seed: int, shard_size: int = 60
                      ) -> list[np.ndarray]:
    """Fixed-size shards dealt one per client, then at random: the NIID / TNIID split.

    Ben Mansour et al. (arXiv:2307.06283) §3.1 (the authors' ``split_dataset_noniid_old``):
    the pool is sorted by label (random order within a label) and cut into contiguous
    shards of ``shard_size`` examples (the last shard is shorter when shard_size does
    not divide len(labels)). Each client first receives one random shard; every
    remaining shard then goes to a uniformly random client. The whole pool is
    distributed, client sizes are unbalanced, and every client holds at least one
    shard. The paper uses shard_size = 60 (NIID) and 100 (TNIID, "very non-IID") on
    MNIST with N = 50 clients.

    Args:
      shard_size: examples per shard (>= 1); needs ceil(len(labels) / shard_size) >=
        num_clients.
    """
    labels, num_clients = _check(labels, num_clients, seed)
    shard_size = _check_int(shard_size, "shard_size", 1)
    num_shards = -(-labels.size // shard_size)
    if num_shards < num_clients:
        raise H.FieldError("shard_size", f"{labels.size} examples in shards of {shard_size} give "
                                         f"{num_shards} shards, fewer than "
                                         f"num_clients={num_clients}")
    rng = np.random.default_rng(seed)
    by_label = _sorted_by_label(labels, rng)
    pieces = [by_label[s:s + shard_size] for s in range(0, labels.size, shard_size)]
    order = rng.permutation(num_shards)
    owner = np.empty(num_shards, np.int64)
    owner[order[:num_clients]] = np.arange(num_clients)
    owner[order[num_clients:]] = rng.integers(0, num_clients, num_shards - num_clients)
    return _finish([np.concatenate([pieces[s] for s in np.flatnonzero(owner == k)])
                    for k in range(num_clients)])


def _deal_classes(num_classes: int, num_clients: int, k: int, rng: np.random.Generator
                  ) -> np.ndarray:
    """bool [N, C]: which of C classes each of N clients holds, k per client.

    First L = min(max(C, N), N k) classes are dealt round-robin (item t to client
    t mod N) from concatenated random permutations of the classes, so every class is
    dealt once when N k >= C and, when N >= C, every client's first class comes from a
    balanced deal. Each client then tops up to k with classes drawn uniformly without
    replacement from those it does not hold yet.
    """
    held = np.zeros((num_clients, num_classes), bool)
    first = min(max(num_classes, num_clients), num_clients * k)
    seq = np.concatenate([rng.permutation(num_classes)
                          for _ in range(-(-first // num_classes))])[:first]
    held[np.arange(first) % num_clients, seq] = True
    for i in range(num_clients):
        missing = k - int(held[i].sum())
        if missing > 0:
            held[i, rng.choice(np.flatnonzero(~held[i]), missing, replace=False)] = True
    return held


def classes_per_client(labels: np.ndarray, num_clients: int, seed: int,
                       classes_per_client: int = 2) -> list[np.ndarray]:
    """Label skew "#C=k": every client holds k classes, each class cut evenly.

    The quantity-based label imbalance of Li et al. 2022 ("Federated Learning on
    Non-IID Data Silos: An Experimental Study", NIID-Bench; also DQN-Fed's
    FEMNIST-skewed setup with 5 random classes per client, DQN-Fed §5.3).
    Class choice (``_deal_classes``): classes are first dealt round-robin from random
    permutations so that every class is used whenever num_clients * k >= C (C = the
    number of distinct labels), then each client is topped up to k distinct classes
    at random. Each class's examples, shuffled, are then cut into near-equal parts
    (``np.array_split``) among the clients holding it, in client order.

    With k = C every client gets an equal share of every class (a class-balanced IID
    split, e.g. A-FedPD's CIFAR-100 IID split of 5 examples per class per client when
    500 per class are cut among 100 clients).

    Drops examples: when num_clients * k < C, some classes are held by nobody and
    their examples are left out. A client has examples of all its k classes as long
    as every class has at least as many examples as clients holding it.

    Args:
      classes_per_client: k, the number of distinct classes per client, 1 <= k <= C.
    """
    labels, num_clients = _check(labels, num_clients, seed)
    k = _check_int(classes_per_client, "classes_per_client", 1)
    classes = np.unique(labels)
    if k > classes.size:
        raise H.FieldError("classes_per_client", f"{k} exceeds the {classes.size} classes present")
    rng = np.random.default_rng(seed)
    held = _deal_classes(classes.size, num_clients, k, rng)
    parts = [[] for _ in range(num_clients)]
    for c, label in enumerate(classes):
        holders = np.flatnonzero(held[:, c])
        idx = rng.permutation(np.flatnonzero(labels == label))
        if holders.size:
            for h, chunk in zip(holders, np.array_split(idx, holders.size)):
                parts[h].append(chunk)
    return _finish([np.concatenate(p) if p else [] for p in parts])


def apportion(weights, total: int) -> np.ndarray:
    """Integers proportional to ``weights`` that sum exactly to ``total``.

    Hamilton's largest-remainder rule: floor(total * w / sum w), then the leftover
    units go one each to the largest fractional parts (ties to the lower index).
    Non-negative weights with a positive sum; returns int64 of the same length.
    """
    w = np.asarray(weights, np.float64)
    if w.ndim != 1 or w.size == 0 or not np.all(np.isfinite(w)) or (w < 0).any() or w.sum() <= 0:
        raise H.FieldError("weights", f"must be a non-empty 1-D array of finite values >= 0 "
                                      f"with a positive sum, got {weights!r}")
    exact = total * w / w.sum()
    out = np.floor(exact).astype(np.int64)
    short = int(total - out.sum())
    if short > 0:
        out[np.argsort(-(exact - out), kind="stable")[:short]] += 1
    return out


def quantity_skew(labels: np.ndarray, num_clients: int, seed: int,
                  distribution: str = "lognormal", sigma: float = 1.0,
                  exponent: float = 3.0, min_size: int = 1) -> list[np.ndarray]:
    """Quantity skew: label-IID clients whose sizes follow a heavy-tailed law.

    Client weights w_k are drawn i.i.d. from

    - ``"lognormal"``: w_k = exp(sigma z_k), z_k ~ N(0, 1) (the LEAF / FedProx
      synthetic generators' log-normal client sizes; sigma is the log-scale spread);
    - ``"power"``: a Pareto law with density proportional to w^(-exponent) on
      [1, inf) (``rng.pareto(exponent - 1) + 1``), exponent > 1.

    Sizes are n_k = min_size + apportion(w, n - N min_size): every client has at
    least ``min_size`` examples and the sizes sum to n = len(labels). A random
    permutation of the pool is then cut at these sizes, so each client is an
    i.i.d. sample of the pool's labels.

    Args:
      distribution: "lognormal" or "power".
      sigma: log-normal spread (> 0); bigger means more unequal sizes.
      exponent: power-law tail exponent (> 1); smaller means more unequal sizes.
      min_size: smallest client (>= 0); needs num_clients * min_size <= len(labels).
    """
    labels, num_clients = _check(labels, num_clients, seed)
    min_size = _check_int(min_size, "min_size", 0)
    if num_clients * min_size > labels.size:
        raise H.FieldError("min_size", f"{num_clients} clients x min_size={min_size} exceeds the "
                                       f"{labels.size} examples available")
    rng = np.random.default_rng(seed)
    if distribution == "lognormal":
        sigma = _check_float(sigma, "sigma", 0.0)
        weights = rng.lognormal(0.0, sigma, num_clients)
    elif distribution == "power":
        exponent = _check_float(exponent, "exponent", 1.0)
        weights = rng.pareto(exponent - 1.0, num_clients) + 1.0
    else:
        raise H.FieldError("distribution", f"must be 'lognormal' or 'power', got {distribution!r}")
    sizes = min_size + apportion(weights, labels.size - num_clients * min_size)
    order = rng.permutation(labels.size)
    return _finish(np.split(order, np.cumsum(sizes)[:-1]))


def natural(labels: np.ndarray, num_clients: int | None, seed: int, groups=None,
            min_size: int = 1) -> list[np.ndarray]:
    """Natural partition: one client per writer / user / speaker id.

    LEAF's by-writer FEMNIST, by-role Shakespeare, by-user CelebA / Reddit, the
    by-speaker SpeechCommands of AAggFF (Hahn's PhD thesis Ch. III §6.1 and Ch. II
    §4.1; DQN-Fed §5.3-§5.4). ``groups[i]`` is the id of example i's writer; every
    distinct id with at least ``min_size`` examples is a candidate client, and the
    clients come in ascending id order (``np.unique``), so client k's id is
    ``groups[parts[k][0]]``.

    Drops examples: groups smaller than ``min_size`` are dropped (as AAggFF drops tiny
    speakers). With num_clients smaller than the number G of remaining groups, a
    seeded uniformly random subset of num_clients groups is kept (DQN-Fed's 500
    sampled FEMNIST writers) and the others' examples are dropped. With
    num_clients = None or = G every remaining group is kept and the seed is unused.

    Args:
      num_clients: number of groups to keep (<= G), or None for all of them.
      groups: array of len(labels) group ids (ints or strings). Required.
      min_size: smallest group kept (>= 1).
    """
    labels, _ = _check(labels, 1 if num_clients is None else num_clients, seed)
    if groups is None:
        raise H.FieldError("groups", "the natural partition needs one writer/user id per "
                                     "example (an array of len(labels)), got None")
    groups = np.asarray(groups)
    if groups.ndim != 1 or groups.shape[0] != labels.size:
        raise H.FieldError("groups", f"must be 1-D with one id per example ({labels.size}), "
                                     f"got shape {groups.shape}")
    min_size = _check_int(min_size, "min_size", 1)
    _, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    kept = np.flatnonzero(counts >= min_size)
    if num_clients is not None and num_clients > kept.size:
        raise H.FieldError("num_clients", f"{num_clients} exceeds the {kept.size} groups with at "
                                          f"least min_size={min_size} examples")
    if num_clients is not None and num_clients < kept.size:
        kept = np.sort(np.random.default_rng(seed).choice(kept, num_clients, replace=False))
    by_group = np.argsort(inverse, kind="stable")
    pieces = np.split(by_group, np.cumsum(counts)[:-1])
    return _finish([pieces[g] for g in kept])


def handpick(labels: np.ndarray, num_clients: int, seed: int, classes_per_client: int = 2,
             samples_per_class: int = 100) -> list[np.ndarray]:
    """The "hand-pick" split: groups of clients share fixed class blocks.

    Ben Mansour et al. (arXiv:2307.06283) §3.1, Table 2 (the alternative preset, "size of each
    client's dataset = 200"): the sorted classes are cut into B = C / k consecutive
    blocks ({0, 1}, {2, 3}, ... for k = 2), client i gets block ``i * B // N`` (so
    with N = 50 and B = 5, clients 0-9 share {0, 1}, 10-19 share {2, 3}, ...), and
    every client receives ``samples_per_class`` examples of each class of its block:
    k * samples_per_class examples in all.

    Deviation: the authors' code draws each client's samples independently, so clients
    may overlap; here the examples of a class are drawn without replacement across the
    clients sharing it, so clients are disjoint. Drops examples: everything not drawn
    is left out (the paper's 50 x 200 = 10,000 of MNIST's 60,000).

    Args:
      classes_per_client: k, must divide the number of classes C.
      samples_per_class: examples of each class per client (>= 1).
    """
    labels, num_clients = _check(labels, num_clients, seed)
    k = _check_int(classes_per_client, "classes_per_client", 1)
    per_class = _check_int(samples_per_class, "samples_per_class", 1)
    classes = np.unique(labels)
    if classes.size % k:
        raise H.FieldError("classes_per_client", f"must divide the {classes.size} classes, got {k}")
    num_blocks = classes.size // k
    block = np.arange(num_clients) * num_blocks // num_clients
    rng = np.random.default_rng(seed)
    parts = [[] for _ in range(num_clients)]
    for c, label in enumerate(classes):
        holders = np.flatnonzero(block == c // k)
        pool = np.flatnonzero(labels == label)
        if holders.size * per_class > pool.size:
            raise H.FieldError("samples_per_class", f"{holders.size} clients x {per_class} exceeds "
                                                    f"the {pool.size} examples of class {label}")
        drawn = rng.permutation(pool)[:holders.size * per_class]
        for h, chunk in zip(holders, np.split(drawn, holders.size) if holders.size else []):
            parts[h].append(chunk)
    return _finish([np.concatenate(p) if p else [] for p in parts])


def dirichlet_prior(labels: np.ndarray, num_clients: int, seed: int, alpha: float = 0.5,
                    client_size: int | None = None) -> list[np.ndarray]:
    """Per-client Dirichlet class priors, equal sizes, class pools refilled.

    The A-FedPD split (arXiv:2409.18915, App. A.3, "sampling with replacement"): client k draws
    a class prior q_k ~ Dir(alpha 1_C) and ``client_size`` (default
    len(labels) // num_clients, the paper's 500 on CIFAR) class draws from it, so its
    class counts are Multinomial(client_size, q_k). Each class's examples are handed
    out from a shuffled pool; when a pool runs out it is refilled with a fresh shuffle.

    Not disjoint: once a pool is refilled, its examples reappear, so two clients (or,
    rarely, one client twice) can hold the same index; arrays are sorted and may repeat
    an index. Examples are not guaranteed to be covered either.

    Deviation: the reference interleaves the clients' draws one sample at a time (a
    random non-full client draws the next example); here each class's drawn stream is
    given to its clients in a uniformly random order. Per-client class counts have the
    same law; which exact examples a client gets differ.

    Args:
      alpha: Dirichlet concentration (> 0); A-FedPD uses 1.0, 0.6 and 0.1.
      client_size: examples per client (>= 1), None for len(labels) // num_clients.
    """
    labels, num_clients = _check(labels, num_clients, seed)
    alpha = _check_float(alpha, "alpha", 0.0)
    if client_size is None:
        client_size = labels.size // num_clients
        if client_size < 1:
            raise H.FieldError("client_size", f"{labels.size} examples give fewer than one per "
                                              f"client for num_clients={num_clients}")
    client_size = _check_int(client_size, "client_size", 1)
    classes = np.unique(labels)
    rng = np.random.default_rng(seed)
    priors = rng.dirichlet(np.full(classes.size, alpha), num_clients)
    priors = priors / priors.sum(axis=1, keepdims=True)
    counts = rng.multinomial(client_size, priors)  # [N, C]
    parts = [[] for _ in range(num_clients)]
    for c, label in enumerate(classes):
        demand = int(counts[:, c].sum())
        if demand == 0:
            continue
        pool = np.flatnonzero(labels == label)
        stream = np.concatenate([rng.permutation(pool)
                                 for _ in range(-(-demand // pool.size))])[:demand]
        owner = rng.permutation(np.repeat(np.arange(num_clients), counts[:, c]))
        for k in np.unique(owner):
            parts[k].append(stream[owner == k])
    return _finish([np.concatenate(p) if p else [] for p in parts])


def by_class(labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
    """One client per class: client k holds every example of label k (the AFL
    protocol's Fashion-MNIST federation, Mohri, Sivek, Suresh, "Agnostic Federated
    Learning", arXiv:1902.00146, kept by q-FFL). Needs num_clients == the number of
    classes (1 + the largest label); ``seed`` is unused (the split is fixed)."""
    labels, num_clients = _check(labels, num_clients, seed)
    num_classes = int(labels.max()) + 1 if labels.size else 0
    if num_clients != num_classes:
        raise H.FieldError("num_clients", f"'by_class' gives one client per class, so it must "
                                          f"equal the {num_classes} classes, got {num_clients}")
    return _finish([np.flatnonzero(labels == k) for k in range(num_clients)])


PARTITIONERS = {"iid": iid, "dirichlet": dirichlet, "shards": shards,
                "classes": classes_per_client, "quantity": quantity_skew, "natural": natural,
                "unbalanced_shards": unbalanced_shards, "handpick": handpick,
                "dirichlet_prior": dirichlet_prior, "by_class": by_class}
"""Registered partitioners by short name (the ``partition`` dataset argument)."""

COVERING = ("iid", "dirichlet", "shards", "classes", "quantity", "unbalanced_shards")
"""Partitioners whose parts are disjoint and cover every index with their defaults
(``classes`` needs num_clients * classes_per_client >= the number of classes);
``natural``, ``handpick`` and ``dirichlet_prior`` may drop or share examples."""
