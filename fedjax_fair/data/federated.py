"""The ``Dataset`` container and the host-side helpers that build one (docs/datasets.md).

A federation's split is stored as one padded block (``ClientData`` with a leading
client axis): client ``k``'s ``n_k`` real rows come first, then ``M - n_k`` zero rows,
where ``M = max_k n_k``. Everything here runs once on the host in NumPy, and a
``Dataset`` keeps its arrays there: ``runner.run`` plans memory and then either
moves the federation to the device or streams cohorts from the host (memory.py).
``info["padding"]`` records the padding bill of both splits, as one block and in
power-of-two size buckets.
"""
from __future__ import annotations

import dataclasses
import functools
import mmap
from typing import Sequence

import jax
import numpy as np

from fedjax_fair.hparams import FieldError, count
from fedjax_fair.core.memory import bucket_report
from fedjax_fair.core.generated import is_generated
from fedjax_fair.core.types import ClientData, FederatedData


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A federated dataset ready for simulation.

    name: registry name ("synthetic", "digits", ...).
    host_data: FederatedData of NumPy arrays in host memory; train and test are
      ClientData [N, M, ...], ``examples = {"x": [N, M, *input_shape], "y": int32
      [N, M]}`` (x float32, or int32 for token inputs such as Shakespeare's
      characters). Pass it to ``runner.run``, which plans memory before anything
      moves to the device (and streams cohorts from the host if it must).
    num_classes: labels lie in [0, num_classes).
    input_shape: per-example input shape, e.g. (60,) or (8, 8, 1).
    info: JSON-serialisable generation parameters; ``info["padding"]`` holds
      ``{"train": ..., "test": ...}``, each a ``padding_report`` plus
      ``"buckets"``, the ``memory.bucket_report`` of its client sizes.
    """

    name: str
    host_data: FederatedData
    num_classes: int
    input_shape: tuple
    info: dict

    @functools.cached_property
    def data(self) -> FederatedData:
        """The federation on the default device (moved on first access, then kept)."""
        with jax.ensure_compile_time_eval():  # first touched under jit: still concrete
            return jax.tree.map(_to_device, self.host_data)

    @property
    def num_clients(self) -> int:
        return self.host_data.num_clients


# --------------------------------------------------------------------------- checks


def require_stored(dataset, field: str, what: str) -> None:
    """``FieldError(field)`` when ``dataset``'s splits are generated: ``what`` (a
    re-split, a hold-out) needs every row in memory."""
    if is_generated(dataset.host_data.train):
        raise FieldError(field, f"{what} needs the federation's rows in memory; a procedural "
                                f"federation computes them per round (build it without "
                                f"procedural=True)")



def _check_seed(value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
        raise FieldError("seed", f"must be an integer >= 0, got {value!r}")
    if value >= 2 ** 32:  # numpy's legacy generators take 32 bits; the CLI's rule too
        raise FieldError("seed", f"must be an integer in [0, 2^32), got {value!r}")
    return int(value)


def _check_fraction(value, field: str) -> float:
    """A fraction strictly inside (0, 1)."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise FieldError(field, f"must be a number in (0, 1), got {value!r}") from None
    if not 0.0 < value < 1.0:
        raise FieldError(field, f"must lie in (0, 1), got {value}")
    return value


def _as_labels(y, field: str) -> np.ndarray:
    """y as a 1-D int32 array; floats are accepted only when every value is whole, and
    no label may lie outside int32 (2^31 would wrap to a negative label, or to a valid
    one, before the range check)."""
    y = np.asarray(y)
    if y.ndim != 1:
        raise FieldError(field, f"labels must be 1-D, got shape {y.shape}")
    whole = np.issubdtype(y.dtype, np.integer) or (
        np.issubdtype(y.dtype, np.floating) and np.all(np.isfinite(y))
        and np.all(y == np.round(y)))
    if not whole:
        raise FieldError(field, f"labels must be integers, got dtype {y.dtype}")
    info = np.iinfo(np.int32)
    if y.size and (y.min() < info.min or y.max() > info.max):
        raise FieldError(field, f"labels run from {y.min()} to {y.max()}, outside the int32 "
                                f"range the models index classes with")
    return y.astype(np.int32)


def _check_label_range(y: np.ndarray, mask: np.ndarray, num_classes: int, field: str) -> None:
    """Every real label (mask True) of a padded block y [N, M] lies in [0, num_classes)."""
    bad = mask & ((y < 0) | (y >= num_classes))
    if bad.any():
        k = int(np.flatnonzero(bad.any(axis=1))[0])
        real = y[k][mask[k]]
        raise FieldError(field, f"client {k} has labels in [{real.min()}, {real.max()}], "
                                f"outside [0, num_classes={num_classes})")


def _check_finite_inputs(x: np.ndarray, mask: np.ndarray, field: str) -> None:
    """Real rows of float inputs x [N, M, ...] hold no NaN or inf: bad data is a data
    error naming the client, not a divergence found rounds later."""
    if not np.issubdtype(x.dtype, np.floating):
        return
    rows = x.reshape(*x.shape[:2], int(np.prod(x.shape[2:])))
    # A NaN or inf makes its row's sum non-finite, so only rows whose sum is not finite
    # (those, or finite values whose sum overflows) are looked at element by element:
    # no [N, M, ...] temporary the size of the inputs, which a federation's first
    # touch of fresh memory makes slow (0.4 s for FEMNIST-shaped data).
    with np.errstate(over="ignore", invalid="ignore"):
        suspect = mask & ~np.isfinite(rows.sum(axis=-1))
    bad = np.zeros_like(suspect)
    bad[suspect] = ~np.isfinite(rows[suspect]).all(axis=-1)
    if bad.any():
        k, i = (int(v[0]) for v in np.nonzero(bad))
        raise FieldError(field, f"client {k} has NaN or inf in its inputs (example {i} "
                                f"of {int(mask[k].sum())}); the data is at fault, not the "
                                f"training")


# --------------------------------------------------------------------------- stacking


_BLOCK_MIN_BYTES = 1 << 20


def zeros_block(shape, dtype) -> np.ndarray:
    """``np.zeros(shape, dtype)`` for a federation's padded block, in its own private
    anonymous mapping (blocks under 1 MiB: ``np.zeros``).

    Pages a builder never writes (the padding rows) are never materialised, and the
    ones it writes are faulted in as ordinary pages: NumPy asks for transparent huge
    pages for large arrays, which the kernel may stall to assemble (compaction) when it
    has none free. FEMNIST-shaped data (627 MB, 36% padding) was written in 0.7-1.9 s
    that way on a 2-core VM, 0.57-0.74 s in its own mapping, with 220 MB fewer pages
    resident. Anywhere without ``mmap.MAP_PRIVATE``: ``np.zeros``."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape, dtype=np.int64))
    flags = getattr(mmap, "MAP_PRIVATE", None)
    if size * dtype.itemsize < _BLOCK_MIN_BYTES or flags is None:
        return np.zeros(shape, dtype)
    buffer = mmap.mmap(-1, size * dtype.itemsize, flags=flags)  # zero-filled by the kernel
    return np.frombuffer(buffer, dtype, count=size).reshape(shape)


def _stack_host(xs: Sequence, ys: Sequence, pad_to: int | None,
                fields: tuple[str, str] = ("xs", "ys")) -> ClientData:
    """stack_clients on the host: the same ClientData with NumPy leaves.

    Inputs are stored as int32 when every non-empty client's x has an integer
    dtype (token ids such as Shakespeare's characters, which must stay exact), and
    as float32 otherwise. Padding rows are 0 either way. ``fields`` names the inputs
    and labels in error messages.
    """
    field, y_field = fields
    if len(xs) != len(ys):
        raise FieldError("num_clients", f"got {len(xs)} input arrays but {len(ys)} label arrays")
    if len(xs) == 0:
        raise FieldError("num_clients", "need at least one client, got 0")
    xs = [np.asarray(x) for x in xs]
    ys = [_as_labels(y, f"{y_field}: client {k}") for k, y in enumerate(ys)]
    feature_shape = xs[0].shape[1:]
    for k, (x, y) in enumerate(zip(xs, ys)):
        if x.ndim == 0 or x.shape[1:] != feature_shape:
            raise FieldError(field, f"client {k} has input shape {x.shape}, expected "
                                    f"(n, {', '.join(map(str, feature_shape))})")
        if x.shape[0] != y.shape[0]:
            raise FieldError(field, f"client {k} has {x.shape[0]} inputs but "
                                    f"{y.shape[0]} labels")
    sizes = np.array([y.shape[0] for y in ys], np.int32)
    m = int(sizes.max())
    if pad_to is not None:
        if isinstance(pad_to, bool) or not isinstance(pad_to, (int, np.integer)) or pad_to < m:
            raise FieldError("pad_to", f"must be an integer >= the largest client ({m}), "
                                       f"got {pad_to!r}")
        m = int(pad_to)
    n = len(xs)
    kinds = {x.dtype.kind for x in xs if x.size}
    x_dtype = np.int32 if kinds and kinds <= {"i", "u"} else np.float32
    if x_dtype == np.int32:
        info = np.iinfo(np.int32)
        for k, x in enumerate(xs):
            if x.size and (x.min() < info.min or x.max() > info.max):
                raise FieldError(field, f"client {k} has integer inputs outside the "
                                        f"int32 range")
    x_pad = zeros_block((n, m, *feature_shape), x_dtype)
    y_pad = np.zeros((n, m), np.int32)
    for k, (x, y) in enumerate(zip(xs, ys)):
        x_pad[k, :len(y)] = x
        y_pad[k, :len(y)] = y
    mask = np.arange(m)[None, :] < sizes[:, None]
    return ClientData(examples={"x": x_pad, "y": y_pad}, mask=mask, num_examples=sizes)


def _to_device(client_data: ClientData) -> ClientData:
    return jax.device_put(client_data)


def stack_clients(xs: Sequence[np.ndarray], ys: Sequence[np.ndarray],
                  pad_to: int | None = None) -> ClientData:
    """Stacks per-client arrays into one padded ClientData [N, M, ...] (jnp arrays).

    Args:
      xs: N arrays [n_k, *input_shape] (any real dtype; stored as float32). A client
        may have n_k = 0 (an array of shape (0, *input_shape)).
      ys: N integer label arrays [n_k] (whole-valued floats are accepted).
      pad_to: padded size M; defaults to max_k n_k and must not be smaller.

    Returns:
      ClientData with examples {"x": float32 (int32 for integer inputs) [N, M, ...],
      "y": int32 [N, M]}, mask
      bool [N, M] (True on the first n_k rows) and num_examples int32 [N]. Padding
      rows are all zero and come after the real rows.
    """
    return _to_device(_stack_host(xs, ys, pad_to))


def padding_report(client_data: ClientData) -> dict:
    """How much of a padded split is padding, and what it costs in memory.

    Returns a JSON-serialisable dict: num_clients N, padded_size M, num_examples
    (real rows), num_slots (N * M), padding_fraction (1 - real / slots; 0 for an
    empty block), min/median/max examples per client, and bytes (total over all
    leaves: inputs, labels, mask, num_examples).
    """
    sizes = np.asarray(client_data.num_examples)
    n, m = (int(d) for d in np.shape(client_data.mask))
    real, slots = int(sizes.sum()), n * m
    leaves = jax.tree.leaves(client_data)
    return {
        "num_clients": n,
        "padded_size": m,
        "num_examples": real,
        "num_slots": slots,
        "padding_fraction": 1.0 - real / slots if slots else 0.0,
        "min_examples": int(sizes.min()),
        "median_examples": float(np.median(sizes)),
        "max_examples": int(sizes.max()),
        "bytes": int(sum(int(np.prod(np.shape(a))) * np.dtype(a.dtype).itemsize
                         for a in leaves)),
    }


# --------------------------------------------------------------------------- splits


def _num_train(n: int, test_fraction: float) -> int:
    """Train rows of a client with n examples: floor((1 - f) n), at least 1 when n >= 1."""
    if n == 0:
        return 0
    # The tiny epsilon keeps e.g. (1 - 0.3) * 10 = 6.9999... from flooring to 6.
    return max(1, int(np.floor((1.0 - test_fraction) * n + 1e-9)))


def split_per_client(rng: np.random.Generator, xs: Sequence[np.ndarray],
                     ys: Sequence[np.ndarray], test_fraction: float
                     ) -> tuple[list, list, list, list]:
    """Splits every client's examples into a local train and test part.

    Each client's rows are shuffled with ``rng`` and the first
    ``n_train = max(1, floor((1 - test_fraction) * n))`` go to train, the remaining
    ``n - n_train`` to test (the rule of the FedProx / q-FFL generators,
    ``train_len = int(0.9 * n)``). So a client with n >= 1 examples keeps at least one
    training example, one with n >= 2 also gets at least one test example, and a
    client with n = 1 has no test example. Empty clients stay empty.

    Returns (train_xs, train_ys, test_xs, test_ys), lists of per-client arrays.
    """
    test_fraction = _check_fraction(test_fraction, "test_fraction")
    if len(xs) != len(ys):
        raise FieldError("num_clients", f"got {len(xs)} input arrays but {len(ys)} label arrays")
    train_xs, train_ys, test_xs, test_ys = [], [], [], []
    for k, (x, y) in enumerate(zip(xs, ys)):
        x, y = np.asarray(x), np.asarray(y)
        if len(x) != len(y):
            raise FieldError("xs", f"client {k} has {len(x)} inputs but {len(y)} labels")
        order = rng.permutation(len(y))
        cut = _num_train(len(y), test_fraction)
        train_xs.append(x[order[:cut]])
        train_ys.append(y[order[:cut]])
        test_xs.append(x[order[cut:]])
        test_ys.append(y[order[cut:]])
    return train_xs, train_ys, test_xs, test_ys


# --------------------------------------------------------------------------- builder


def from_padded(train: ClientData, test: ClientData, *, name: str, num_classes: int,
                info: dict | None = None, validation: ClientData | None = None) -> Dataset:
    """Builds a Dataset from already padded host splits (ClientData of NumPy arrays).

    For generators that write straight into the padded block (femnist_like). The
    splits must follow the layout of ``stack_clients``: examples {"x", "y"} with
    leading axes [N, M], real rows first. Checks labels and shapes (and that some
    client has training and some client test data: ``runner.run`` trains on the
    first and evaluates on the second; the validation split may be empty) and
    records the padding reports in ``info["padding"]``. The arrays stay in host memory:
    ``runner.run`` places them (on the device, or streamed from the host when the
    device cannot hold them; memory.py).
    """
    num_classes = count(num_classes, "num_classes")
    n = train.mask.shape[0]
    splits = {"train": train, "test": test}
    if validation is not None:
        splits["validation"] = validation
    for field, split in splits.items():
        x, y = split.examples["x"], split.examples["y"]
        if split.mask.shape[0] != n:
            raise FieldError("num_clients", f"train has {n} clients, {field} has "
                                            f"{split.mask.shape[0]}")
        if y.shape != split.mask.shape or x.shape[:2] != split.mask.shape:
            raise FieldError(field, f"x {x.shape}, y {y.shape} and mask "
                                    f"{split.mask.shape} disagree on [N, M]")
        if not np.array_equal(split.mask.sum(axis=1), split.num_examples):
            raise FieldError(field, "num_examples differs from the mask's row counts")
        _check_label_range(np.asarray(y), np.asarray(split.mask), num_classes, f"{field}_ys")
        _check_finite_inputs(np.asarray(x), np.asarray(split.mask), f"{field}_xs")
    for field in ("train", "test"):  # a validation split may be empty
        if not np.asarray(splits[field].num_examples).sum() > 0:
            raise ValueError(f"{field}_xs: every one of the {n} clients has an empty "
                             f"{field} split; a federation needs at least one "
                             f"{'training' if field == 'train' else 'test'} example "
                             f"({'local training' if field == 'train' else 'evaluation'}"
                             f" needs rows)")
    for field, split in splits.items():
        if split.examples["x"].shape[2:] != train.examples["x"].shape[2:]:
            raise ValueError(f"{field}_xs: input shape {split.examples['x'].shape[2:]} "
                             f"differs from train_xs {train.examples['x'].shape[2:]}")
    info = dict(info or {})
    info["padding"] = {field: {**padding_report(d), "buckets": bucket_report(d.num_examples)}
                       for field, d in splits.items()}
    return Dataset(name=name, host_data=FederatedData(train=train, test=test,
                                                      validation=validation),
                   num_classes=num_classes, input_shape=tuple(train.examples["x"].shape[2:]),
                   info=info)


def from_client_arrays(train_xs: Sequence[np.ndarray], train_ys: Sequence[np.ndarray],
                       test_xs: Sequence[np.ndarray], test_ys: Sequence[np.ndarray], *,
                       name: str, num_classes: int, info: dict | None = None) -> Dataset:
    """Builds a Dataset from per-client train and test arrays (client k = row k).

    Validates shapes and labels (every label in [0, num_classes)), pads both splits
    independently (each to its own M), records their padding reports in
    ``info["padding"]`` and only then moves the arrays to the device. Clients may be
    empty in either split, but not all of them: ``ValueError`` naming ``train_xs``
    (nothing to train on) or ``test_xs`` (nothing to evaluate on).
    """
    num_classes = count(num_classes, "num_classes")
    if len(train_xs) != len(test_xs):
        raise FieldError("num_clients", f"train has {len(train_xs)} clients, "
                                        f"test has {len(test_xs)}")
    train = _stack_host(train_xs, train_ys, None, ("train_xs", "train_ys"))
    test = _stack_host(test_xs, test_ys, None, ("test_xs", "test_ys"))
    return from_padded(train, test, name=name, num_classes=num_classes, info=info)


# --------------------------------------------------------------------------- re-split


def _check_fractions(fractions) -> tuple[float, float, float]:
    try:
        values = tuple(float(f) for f in fractions)
    except (TypeError, ValueError):
        raise FieldError("fractions", f"must be three numbers TRAIN, VALIDATION, TEST, got "
                                      f"{fractions!r}") from None
    if len(values) != 3 or not all(np.isfinite(values)) or min(values) < 0 \
            or values[0] <= 0 or abs(sum(values) - 1.0) > 1e-6:
        raise FieldError("fractions", f"must be three numbers TRAIN > 0, VALIDATION >= 0, "
                                      f"TEST >= 0 that sum to 1, got {fractions!r}")
    return values


def split_sizes(n: int, fractions) -> tuple[int, int, int]:
    """(train, validation, test) rows of a client with n examples: the cut points are
    ``floor(c n)`` at the cumulative fractions c, as in q-FFL's code
    (``x[:int(0.8 n)]``, ``x[int(0.8 n):int(0.9 n)]``, ``x[int(0.9 n):]``)."""
    f_train, f_val, _ = _check_fractions(fractions)
    # The tiny epsilon keeps e.g. 0.8 * 10 = 7.999... from flooring to 7.
    a = int(np.floor(f_train * n + 1e-9))
    b = int(np.floor((f_train + f_val) * n + 1e-9))
    return a, b - a, n - b


def resplit(dataset: Dataset, fractions=(0.8, 0.1, 0.1), seed: int = 0) -> Dataset:
    """Every client's examples pooled and split anew into train / validation / test.

    The q-FFL protocol (Li et al., "Fair Resource Allocation in Federated Learning",
    arXiv:1905.10497; its code's ``data_partition_seed``): concatenate each client's
    train and test examples (and validation, if any) in that order, shuffle them with
    ``np.random.default_rng(seed)`` (one generator, clients in order), and cut at
    ``split_sizes``. Works for any Dataset, LEAF's natural partitions included;
    client order and identifiers are kept. A validation fraction of 0 leaves the
    dataset without a validation split.

    Args:
      dataset: any Dataset.
      fractions: (train, validation, test), train > 0, summing to 1.
      seed: the partition seed (different seeds give the q-FFL paper's repeated
        partitions).
    """
    fractions = _check_fractions(fractions)
    require_stored(dataset, "resplit", "pooling and re-splitting every client's rows")
    rng = np.random.default_rng(_check_seed(seed))
    host = dataset.host_data
    pools = [s for s in (host.train, host.test, host.validation) if s is not None]
    parts: dict[str, tuple[list, list]] = {"train": ([], []), "validation": ([], []),
                                            "test": ([], [])}
    for k in range(host.num_clients):
        x = np.concatenate([np.asarray(s.examples["x"][k])[np.asarray(s.mask[k])]
                            for s in pools])
        y = np.concatenate([np.asarray(s.examples["y"][k])[np.asarray(s.mask[k])]
                            for s in pools])
        order = rng.permutation(len(y))
        a, b, _ = split_sizes(len(y), fractions)
        for name, rows in (("train", order[:a]), ("validation", order[a:a + b]),
                           ("test", order[a + b:])):
            parts[name][0].append(x[rows])
            parts[name][1].append(y[rows])
    stacked = {name: _stack_host(xs, ys, None, (f"{name}_xs", f"{name}_ys"))
               for name, (xs, ys) in parts.items()}
    for name, fraction in zip(("train", "validation", "test"), fractions):
        # e.g. a test fraction of 0, or clients too small for a validation row
        if (name != "validation" or fraction > 0) and not stacked[name].num_examples.sum() > 0:
            raise FieldError("fractions", f"{list(fractions)} leaves no client a {name} "
                                          f"example; give a larger {name} fraction")
    info = {k: v for k, v in dataset.info.items() if k != "padding"}
    info["resplit"] = {"fractions": list(fractions), "seed": int(seed)}
    return from_padded(stacked["train"], stacked["test"], name=dataset.name,
                       num_classes=dataset.num_classes, info=info,
                       validation=stacked["validation"] if fractions[1] > 0 else None)


def hold_out_validation(dataset: Dataset, fraction: float = 0.1, seed: int = 0) -> Dataset:
    """``dataset`` with a validation split held out of each client's *training* rows:
    floor(``fraction`` n_k) of client k's n_k training examples, drawn with
    ``np.random.default_rng(seed)`` (one generator, clients in order), the test split
    untouched, so a selection made on the validation split never reads test data
    (``compare --tune``). A dataset that already has a validation split is returned as
    it is. A client too small for a validation row keeps all its rows for training.

    Args:
      dataset: any Dataset.
      fraction: in (0, 1): the share of each client's training rows held out.
      seed: the draw's seed.
    """
    fraction = _check_fraction(fraction, "fraction")
    if not 0 < fraction < 1:
        raise FieldError("fraction", f"must lie in (0, 1), got {fraction}")
    require_stored(dataset, "validation_fraction", "holding out validation rows")
    host = dataset.host_data
    if host.validation is not None:
        return dataset
    rng = np.random.default_rng(_check_seed(seed))
    parts: dict[str, tuple[list, list]] = {"train": ([], []), "validation": ([], [])}
    t = host.train
    for k in range(host.num_clients):
        keep = np.asarray(t.mask[k])
        x, y = np.asarray(t.examples["x"][k])[keep], np.asarray(t.examples["y"][k])[keep]
        order = rng.permutation(len(y))
        b = int(np.floor(fraction * len(y) + 1e-9))
        for name, rows in (("train", np.sort(order[b:])), ("validation", np.sort(order[:b]))):
            parts[name][0].append(x[rows])
            parts[name][1].append(y[rows])
    stacked = {name: _stack_host(xs, ys, None, (f"{name}_xs", f"{name}_ys"))
               for name, (xs, ys) in parts.items()}
    if not stacked["validation"].num_examples.sum() > 0:
        raise FieldError("fraction", f"{fraction} holds out no client's example; give a "
                                     f"larger fraction")
    info = {k: v for k, v in dataset.info.items() if k != "padding"}
    info["validation_held_out"] = {"fraction": fraction, "seed": int(seed)}
    return from_padded(stacked["train"], host.test, name=dataset.name,
                       num_classes=dataset.num_classes, info=info,
                       validation=stacked["validation"])
