"""Federations of real datasets: a pool of examples -> partition -> per-client test.

``federate`` turns one labelled pool (plus an optional global test set) into a
``Dataset``, the same way for every source:

1. ``partition`` (partition.py) cuts the training pool across ``num_clients``
   clients, a pure function of the seed;
2. each client's test data is either a holdout fraction of its own examples
   (``test="holdout"``, stratified by label; AAggFF, FedEvg, SuPerFed) or a draw
   from the global test set matching its label proportions (``test="matched"``;
   DQN-Fed's protocol for label-skewed splits), see client_test.py;
3. optional label noise flips the clients' *training* labels only (SuPerFed's
   label-noise study, noise.py).

TFDS builders can also standardise inputs per channel (``normalize=True``; the
papers' CIFAR / MNIST statistics, else the training pool's). Per-batch augmentation
belongs to training, not to the data: ``augment.with_augmentation`` (``--augment``).

The registered builders below (``mnist``, ``cifar10``, ..., ``tfds``, ``femnist``,
``shakespeare``, ``leaf``) read their pool with tfds_source.py or leaf.py and call
``federate``; their keyword arguments are what ``fedjax-fair --dataset NAME
--dataset-arg KEY=VALUE`` accepts. The same arguments always give the same
federation.
"""
from __future__ import annotations

import inspect
import warnings
from typing import Optional

import numpy as np

from fedjax_fair.data import augment, client_test, leaf, noise, tfds_source
from fedjax_fair.data.federated import Dataset, _check_seed, from_client_arrays
from fedjax_fair.data.partition import PARTITIONERS
from fedjax_fair.hparams import FieldError

TEST_PROTOCOLS = ("holdout", "matched")

# Every partitioner keyword (but ``groups``, which comes from the data), with the
# partitioners' own defaults; None where two partitioners default differently
# (then each keeps its own).
_SKIP = {"groups", "max_retries"}


def _partition_defaults() -> dict:
    out: dict = {}
    for fn in PARTITIONERS.values():
        for p in list(inspect.signature(fn).parameters.values())[3:]:
            if p.name in _SKIP:
                continue
            out[p.name] = p.default if out.get(p.name, p.default) == p.default else None
    return out


PARTITION_ARGS = _partition_defaults()


def partition_args(partition: str, args: dict) -> dict:
    """The entries of ``args`` that partitioner ``partition`` takes (None dropped),
    text values (from the command line) converted to the type of its default."""
    if partition not in PARTITIONERS:
        raise FieldError("partition", f"unknown name {partition!r}; allowed: "
                                      f"{sorted(PARTITIONERS)}")
    accepted = inspect.signature(PARTITIONERS[partition]).parameters
    return {k: _like(v, accepted[k].default, k) for k, v in args.items()
            if k in accepted and v is not None}


def _like(value, default, field: str):
    if not isinstance(value, str) or isinstance(default, str):
        return value
    try:
        if isinstance(default, bool):
            return {"true": True, "false": False}[value.strip().lower()]
        return float(value) if isinstance(default, float) else int(value)
    except (KeyError, ValueError):
        raise FieldError(field, f"cannot read {value!r} as a "
                                f"{type(default or 0).__name__}") from None


def federate(x_train: np.ndarray, y_train: np.ndarray, x_test: Optional[np.ndarray] = None,
             y_test: Optional[np.ndarray] = None, *, name: str, num_classes: int,
             num_clients: int, partition: str = "dirichlet", seed: int = 0,
             test: str = "holdout", test_fraction: float = 0.2, label_noise: str = "none",
             noise_rate: float = 0.0, groups: Optional[np.ndarray] = None,
             info: Optional[dict] = None, **partition_kwargs) -> Dataset:
    """Partitions a labelled pool across clients and builds the Dataset.

    Args:
      x_train, y_train: the training pool [n, ...], [n].
      x_test, y_test: the global test set (needed by ``test="matched"``).
      name, num_classes: of the Dataset.
      num_clients, partition, partition_kwargs: the partitioner (partition.py) and
        its keywords; keywords other partitioners take are ignored, None values too.
      seed: seeds the partition, the holdout / matched draw and the label noise.
      test: "holdout" (a stratified ``test_fraction`` of each client's own examples)
        or "matched" (global test examples in the client's training label
        proportions, as many as its share of the global test set).
      label_noise, noise_rate: "none", "symmetric" or "pair" flipping of the
        clients' training labels (noise.py); test labels stay clean.
      groups: writer / user id per training example, for ``partition="natural"``.
      info: extra JSON-serialisable provenance merged into ``Dataset.info``.
    """
    seed = _check_seed(seed)
    if test not in TEST_PROTOCOLS:
        raise FieldError("test", f"must be one of {list(TEST_PROTOCOLS)}, got {test!r}")
    if test == "matched" and (x_test is None or y_test is None):
        raise FieldError("test", f"'matched' needs a global test set; {name} has none "
                                 f"(use test='holdout')")
    y_train = np.asarray(y_train)
    kwargs = partition_args(partition, partition_kwargs)
    if partition == "natural":
        kwargs["groups"] = groups
    parts = PARTITIONERS[partition](y_train, num_clients, seed, **kwargs)
    if test == "holdout":
        train_parts, test_parts = client_test.holdout_split(parts, test_fraction, seed,
                                                            labels=y_train)
        test_x, test_y = x_train, y_train
        _warn_leaks(train_parts, test_parts, partition)
    else:
        train_parts = parts
        test_parts = client_test.matched_test(y_train, y_test, num_classes, seed, parts=parts)
        test_x, test_y = x_test, np.asarray(y_test)
    train_ys = [y_train[p] for p in train_parts]
    if label_noise != "none" or noise_rate:
        sizes = np.cumsum([len(y) for y in train_ys])[:-1]
        flat = np.concatenate(train_ys) if train_ys else np.zeros(0, np.int32)
        train_ys = np.split(noise.add_label_noise(flat, label_noise, noise_rate, num_classes,
                                                  seed), sizes)
    meta = {"num_clients": int(num_clients), "partition": partition,
            "partition_params": {k: v for k, v in kwargs.items() if k != "groups"},
            "test": test, "test_fraction": float(test_fraction) if test == "holdout" else None,
            "label_noise": label_noise, "noise_rate": float(noise_rate), "seed": seed,
            "client_sizes": [int(len(p)) for p in parts], **(info or {})}
    return from_client_arrays([x_train[p] for p in train_parts], train_ys,
                              [test_x[p] for p in test_parts], [test_y[p] for p in test_parts],
                              name=name, num_classes=num_classes, info=meta)


def _warn_leaks(train_parts, test_parts, partition: str) -> None:
    """A partition that repeats examples across clients (``dirichlet_prior`` refills
    its class pools) can put one client's held-out test example in another client's
    training rows: say how many, once, so no accuracy is read as clean by accident."""
    train = np.concatenate([np.asarray(p) for p in train_parts]) if train_parts else []
    test = np.concatenate([np.asarray(p) for p in test_parts]) if test_parts else []
    leaked = np.intersect1d(test, train).size
    if leaked:
        warnings.warn(f"partition={partition!r} with test='holdout': {leaked} of "
                      f"{np.unique(test).size} held-out test examples are also training "
                      f"examples (the partition reuses examples across clients); use "
                      f"test='matched' on a dataset with a global test set, a disjoint "
                      f"partition, or a smaller client_size", stacklevel=3)


# ------------------------------------------------------------------------ registered


def with_signature(fn, params: dict):
    """Gives ``fn(**kwargs)`` the explicit keyword signature ``params`` (name: default),
    so the CLI can list and type-check every argument."""
    fn.__signature__ = inspect.Signature(
        [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v)
         for k, v in params.items()])
    return fn


COMMON_ARGS = {"num_clients": 100, "partition": "dirichlet", **PARTITION_ARGS,
           "test": "holdout", "test_fraction": 0.2, "label_noise": "none",
           "noise_rate": 0.0, "seed": 0}


# Per-channel statistics used by the papers (augment.py cites their sources).
NORMALIZATION = {"cifar10": (augment.CIFAR10_MEAN, augment.CIFAR10_STD),
                 "cifar100": (augment.CIFAR100_MEAN, augment.CIFAR100_STD),
                 "mnist": (augment.MNIST_MEAN, augment.MNIST_STD)}


def standardize(x: np.ndarray, name: str, pool: np.ndarray) -> np.ndarray:
    """(x - mean) / std per channel: the dataset's published statistics when known
    (``NORMALIZATION``), else those of the training pool ``pool``."""
    if name in NORMALIZATION:
        mean, std = (np.asarray(v, np.float32) for v in NORMALIZATION[name])
    else:
        axes = tuple(range(pool.ndim - 1))
        mean, std = pool.mean(axis=axes), np.maximum(pool.std(axis=axes), 1e-6)
    return ((x - mean) / std).astype(np.float32)


def select_classes(x: np.ndarray, y: np.ndarray, classes, num_classes: int):
    """The examples whose label is in ``classes``, relabelled by position in it
    (``classes=[0, 2, 6]``: labels 0, 2, 6 become 0, 1, 2, as in the AFL / q-FFL
    Fashion-MNIST data); None keeps every class."""
    if classes is None:
        return x, y, num_classes
    wanted = list(classes) if isinstance(classes, (list, tuple, np.ndarray)) else None
    if (not wanted or any(isinstance(c, bool) or not isinstance(c, (int, np.integer))
                          for c in wanted) or len(set(wanted)) != len(wanted)
            or min(wanted) < 0 or max(wanted) >= num_classes):
        raise FieldError("classes", f"must be a list of distinct labels in [0, {num_classes}), "
                                      f"got {classes!r}")
    relabel = np.full(num_classes, -1, np.int64)
    relabel[wanted] = np.arange(len(wanted))
    keep = relabel[np.asarray(y)] >= 0
    return x[keep], relabel[np.asarray(y)[keep]].astype(np.int32), len(wanted)


def _tfds_builder(tfds_name: Optional[str]):
    params = {**({"tfds_name": ""} if tfds_name is None else {}), **COMMON_ARGS,
              "classes": None, "normalize": False, "data_dir": "", "cache_dir": "", "train_split": "train",
              "test_split": "test"}

    def build(**kwargs) -> Dataset:
        args = {**params, **kwargs}
        source = tfds_name or args.pop("tfds_name")
        if not source:
            raise FieldError("tfds_name", "give the TFDS dataset name, e.g. "
                                          "tfds_name=svhn_cropped")
        where = {"data_dir": args.pop("data_dir") or None,
                 "cache_dir": args.pop("cache_dir") or None}
        train = tfds_source.load_tfds(source, args.pop("train_split"), **where)
        test_split = args.pop("test_split")
        test = (tfds_source.load_tfds(source, test_split, **where)
                if args["test"] == "matched" else None)
        classes = args.pop("classes")
        x_train, y_train, num_classes = select_classes(train.x, train.y, classes,
                                                       train.num_classes)
        x_test, y_test = (None, None) if test is None else select_classes(
            test.x, test.y, classes, train.num_classes)[:2]
        if _like(args.pop("normalize"), False, "normalize"):
            x_train, x_test = (None if x is None else standardize(x, train.name, x_train)
                               for x in (x_train, x_test))
        return federate(x_train, y_train, x_test, y_test,
                        name=train.name,
                        num_classes=num_classes,
                        info={"source": f"tfds:{train.name}", "data_dir": where["data_dir"]},
                        **args)

    build.__name__ = build.__qualname__ = (tfds_name or "tfds").replace("/", "_")
    build.__doc__ = (f"TFDS {tfds_name or '<tfds_name>'} partitioned across clients "
                     f"(data/builders.py: federate).")
    return with_signature(build, params)


def _leaf_builder(kind: str):
    params = {"path": "", "num_clients": 0, "min_size": 1, "seed": 0}

    def build(**kwargs) -> Dataset:
        args = {**params, **kwargs}
        if not args["path"]:
            raise FieldError("path", "give the LEAF data directory (holding train/ and test/)")
        fed = leaf.load_leaf(args["path"], kind=kind)
        sizes = np.array([len(y) for y in fed.train_ys])
        keep = np.flatnonzero(sizes >= args["min_size"])
        n = int(args["num_clients"]) or keep.size
        if n > keep.size:
            raise FieldError("num_clients", f"{n} requested but only {keep.size} LEAF users hold "
                                            f"at least min_size={args['min_size']} training "
                                            f"examples")
        seed = _check_seed(args["seed"])
        if n < keep.size:  # a seeded subset of users, kept in the file's user order
            keep = np.sort(np.random.default_rng(seed).choice(keep, n, replace=False))
        pick = lambda xs: [xs[i] for i in keep]
        return from_client_arrays(
            pick(fed.train_xs), pick(fed.train_ys), pick(fed.test_xs), pick(fed.test_ys),
            name=kind if kind != "auto" else f"leaf_{fed.kind}", num_classes=fed.num_classes,
            info={"source": f"leaf:{args['path']}", "partition": "natural",
                  "users": [fed.user_ids[i] for i in keep], "seed": seed,
                  "vocab": fed.vocab})

    build.__name__ = build.__qualname__ = {"images": "femnist"}.get(kind, kind)
    build.__doc__ = f"LEAF {kind} data in its natural per-user partition (data/leaf.py)."
    return with_signature(build, params)


TFDS_DATASETS = {name.replace("/", "_"): _tfds_builder(name) for name in
                 ("mnist", "fashion_mnist", "emnist/byclass", "emnist/letters",
                  "emnist/digits", "cifar10", "cifar100")}
TFDS_DATASETS["tfds"] = _tfds_builder(None)
LEAF_DATASETS = {"femnist": _leaf_builder("images"), "shakespeare": _leaf_builder("shakespeare"),
                 "leaf": _leaf_builder("auto")}
