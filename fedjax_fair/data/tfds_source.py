"""Image-classification datasets from TensorFlow Datasets, read into host NumPy arrays.

``load_tfds(name, split)`` opens an already prepared TFDS dataset with
``tfds.data_source`` (random access over ArrayRecord files: reading needs neither
TensorFlow nor the network) and returns every example of the split as one array,
``x`` float32 [n, H, W, C] and ``y`` int32 [n]. Partitioning into clients happens
afterwards (``fedjax_fair.data.partition``), on these host arrays.

Nothing is ever downloaded: the dataset must already be prepared in ArrayRecord
format under ``data_dir`` (default: ``$TFDS_DATA_DIR``, else
``~/tensorflow_datasets``). Otherwise ``DatasetNotPreparedError`` says where it looked
and how to prepare the data on a machine with internet access::

    tfds build mnist --data_dir DIR --file_format array_record

Names: the TFDS name of any image-classification dataset (``"mnist"``,
``"svhn_cropped"``, ``"emnist/balanced"``, ``"mnist:3.0.1"``, ...) or one of the
aliases in ``ALIASES`` (``"emnist_letters"`` -> ``"emnist/letters"``, ...).

EMNIST letters: TFDS stores its labels as they come in the EMNIST files, 1..26
(a..z), inside a 37-class ``ClassLabel``. They are shifted to 0..25 and
``num_classes`` is 26 (``LABEL_SHIFTS``). EMNIST images keep the TFDS orientation
(transposed with respect to MNIST, as in the EMNIST files).

Reading speed: about 1-2 thousand 28x28 PNG examples per second and core (the time
goes to protobuf parsing and PNG decoding inside TFDS), so MNIST's 60k training
images take tens of seconds; slice the split (``"train[:10%]"``) for quick runs.
"""
from __future__ import annotations

import contextlib
import os
import re
from typing import NamedTuple

import numpy as np
from fedjax_fair import hparams as H

# Short names accepted besides the TFDS names (which always work as they are).
ALIASES = {
    "emnist": "emnist/byclass",
    "emnist_byclass": "emnist/byclass",
    "emnist_letters": "emnist/letters",
    "emnist_digits": "emnist/digits",
    "emnist_balanced": "emnist/balanced",
}

# TFDS names whose stored labels start above 0: name -> (first label, number of labels).
# The labels first..first+count-1 become 0..count-1.
LABEL_SHIFTS = {"emnist/letters": (1, 26)}

READ_BATCH = 1024  # records fetched per ``__getitems__`` call


class DatasetNotPreparedError(ValueError):
    """The TFDS dataset is not prepared (in ArrayRecord format) under data_dir."""


class TfdsArrays(NamedTuple):
    """One split of a TFDS dataset as host arrays.

    x: float32 [n, H, W, C]; uint8 images are scaled to [0, 1] (divided by 255),
      other dtypes are cast to float32 unchanged.
    y: int32 [n], in [0, num_classes).
    num_classes: number of classes (after any label shift, see ``LABEL_SHIFTS``).
    input_shape: (H, W, C).
    name: the TFDS name that was read (aliases resolved).
    extras: the other integer scalar features, name -> int64 [n] (e.g. CIFAR-100's
      ``coarse_label``, writer ids where a dataset has them).
    """

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    input_shape: tuple
    name: str
    extras: dict


# --------------------------------------------------------------------------- names


def resolve_name(name: str) -> str:
    """The TFDS name for ``name``: an alias from ``ALIASES`` or the name itself."""
    if not isinstance(name, str) or not name.strip():
        raise H.FieldError("dataset", f"must be a non-empty TFDS name, got {name!r}")
    name = name.strip()
    return ALIASES.get(name.lower(), name)


def _base_name(tfds_name: str) -> str:
    """``"emnist/letters:3.1.0"`` -> ``"emnist/letters"`` (the version dropped)."""
    return tfds_name.split(":", 1)[0].lower()


def _prepare_hint(tfds_name: str, data_dir: str) -> str:
    """One line (the CLI prints errors as one line): how to prepare the data offline."""
    return (f"prepare it on a machine with internet access (building most datasets "
            f"needs TensorFlow there) with `tfds build {tfds_name} --data_dir {data_dir} "
            f"--file_format array_record` (or in Python: `tfds.builder('{tfds_name}', "
            f"data_dir='{data_dir}', file_format='array_record').download_and_prepare()`), "
            f"then copy {data_dir}/{_base_name(tfds_name).split('/')[0]} to this machine's "
            f"data_dir (or set $TFDS_DATA_DIR)")


# --------------------------------------------------------------------------- opening


def _import_tfds():
    try:
        import tensorflow_datasets as tfds
    except ImportError as err:  # pragma: no cover - tfds is a declared dependency
        raise H.FieldError("dataset", "reading TFDS datasets needs tensorflow-datasets "
                                      "(pip install tensorflow-datasets array_record)") from err
    return tfds


def _builder(tfds, tfds_name: str, data_dir):
    """``tfds.builder`` with its errors turned into ``dataset: ...`` ValueErrors."""
    try:
        return tfds.builder(tfds_name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError:
        raise H.FieldError(
            "dataset", f"unknown TFDS dataset {tfds_name!r} (not registered in "
                         f"tensorflow-datasets and not found under data_dir={data_dir!r}); "
                         f"aliases: {sorted(ALIASES)}") from None
    except (ValueError, AssertionError, KeyError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
        raise H.FieldError("dataset", f"cannot open TFDS dataset {tfds_name!r}: "
                                      f"{first_line}") from None


@contextlib.contextmanager
def _quiet_absl():
    """absl (TFDS's logger) at ERROR level for the duration."""
    from absl import logging as absl_logging
    before = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        yield
    finally:
        absl_logging.set_verbosity(before)


def open_source(name: str, split: str = "train", *, data_dir: str | None = None):
    """Opens a prepared split without downloading anything.

    Returns (tfds_name, builder, source): the resolved name, its DatasetBuilder
    (``builder.info.features`` describes the records) and a random-access sequence
    of decoded examples (dicts of NumPy values).

    Raises DatasetNotPreparedError when the dataset is not prepared under
    ``data_dir``, and ``ValueError("dataset: ...")`` / ``ValueError("split: ...")``
    for unknown names, non-random-access file formats and unknown splits.
    """
    tfds_name = resolve_name(name)
    if not isinstance(split, str) or not split.strip():
        raise H.FieldError("split", f"must be a non-empty split name such as 'train' or "
                                    f"'train[:10%]', got {split!r}")
    if data_dir is not None:
        data_dir = os.fspath(os.path.expanduser(data_dir))
    tfds = _import_tfds()
    with _quiet_absl():  # TFDS logs a warning per folder it probes; the error says all
        builder = _builder(tfds, tfds_name, data_dir)
    try:
        with _quiet_absl():
            source = tfds.data_source(tfds_name, split=split, data_dir=data_dir,
                                      download=False)
    except Exception as err:  # diagnosed below; nothing was downloaded
        with _quiet_absl():
            prepared = builder.is_prepared()
        if not prepared:
            root = str(builder.data_dir_root)
            raise DatasetNotPreparedError(
                f"dataset: {tfds_name!r} is not prepared under data_dir={root} (looked "
                f"for {builder.data_dir}); nothing is downloaded here. "
                f"{_prepare_hint(tfds_name, root)}") from err
        if isinstance(err, NotImplementedError):
            raise H.FieldError(
                "dataset", f"{tfds_name!r} is prepared at {builder.data_dir} in a format "
                             f"without random access ({builder.info.file_format}); convert it "
                             f"with\n"
                             f"    tfds convert_format --dataset_version_dir {builder.data_dir} "
                             f"--out_file_format array_record\nor rebuild it with "
                             f"--file_format array_record") from err
        raise H.FieldError("split", f"cannot read split {split!r} of {tfds_name!r} "
                                    f"(splits: {sorted(builder.info.splits)}): {err}") from err
    return tfds_name, builder, source


# --------------------------------------------------------------------------- features


def _image_spec(features, image_key: str) -> tuple[tuple, np.dtype]:
    """(shape, dtype) of the image feature; shape gets a channel axis if rank 2."""
    if image_key not in features:
        raise H.FieldError("image_key", f"no feature {image_key!r}; features: "
                                        f"{sorted(features.keys())}")
    feature = features[image_key]
    shape = tuple(feature.shape)
    if len(shape) not in (2, 3) or any(d is None for d in shape):
        raise H.FieldError("image_key", f"feature {image_key!r} has shape {shape}; need a "
                                        f"fixed (H, W) or (H, W, C) shape (resize variable-size "
                                        f"images first)")
    dtype = np.dtype(feature.np_dtype)
    if not (np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.floating)):
        raise H.FieldError("image_key", f"feature {image_key!r} has dtype {dtype}, "
                                        f"expected numbers")
    return (shape if len(shape) == 3 else (*shape, 1)), dtype


def _is_int_scalar(feature) -> bool:
    shape = tuple(getattr(feature, "shape", (None,)))
    try:
        dtype = np.dtype(feature.np_dtype)
    except (TypeError, AttributeError):
        return False
    return shape == () and np.issubdtype(dtype, np.integer)


def _label_classes(features, label_key: str) -> int | None:
    """num_classes of a ClassLabel feature, None for another integer scalar."""
    if label_key not in features:
        raise H.FieldError("label_key", f"no feature {label_key!r}; features: "
                                        f"{sorted(features.keys())}")
    feature = features[label_key]
    if not _is_int_scalar(feature):
        raise H.FieldError("label_key", f"feature {label_key!r} is not an integer scalar "
                                        f"(shape {getattr(feature, 'shape', None)}, dtype "
                                        f"{getattr(feature, 'np_dtype', None)})")
    return getattr(feature, "num_classes", None)


def _extra_keys(features, image_key: str, label_key: str) -> list[str]:
    return sorted(k for k in features.keys()
                  if k not in (image_key, label_key) and _is_int_scalar(features[k]))


# --------------------------------------------------------------------------- reading


def read_all(source, image_key: str, label_key: str, image_shape: tuple,
             image_dtype: np.dtype, extra_keys=(), batch: int = READ_BATCH
             ) -> tuple[np.ndarray, np.ndarray, dict]:
    """Reads every record of ``source`` into preallocated arrays.

    Records are fetched ``batch`` at a time with ``source.__getitems__`` (one
    ArrayRecord read per batch). Returns (images [n, *image_shape] of image_dtype,
    labels int64 [n], extras {key: int64 [n]}).
    """
    n = len(source)
    images = np.empty((n, *image_shape), image_dtype)
    labels = np.empty(n, np.int64)
    extras = {k: np.empty(n, np.int64) for k in extra_keys}
    for start in range(0, n, batch):
        stop = min(start + batch, n)
        records = source.__getitems__(list(range(start, stop)))
        for i, record in enumerate(records, start):
            image = np.asarray(record[image_key])
            if image.size != images[i].size:
                raise H.FieldError("image_key", f"record {i} has an image of shape "
                                                f"{image.shape}, expected {image_shape}")
            images[i] = image.reshape(image_shape)
            labels[i] = record[label_key]
            for k, values in extras.items():
                values[i] = record[k]
    return images, labels, extras


def _to_float(images: np.ndarray) -> np.ndarray:
    """uint8 -> float32 in [0, 1]; any other dtype -> float32 unchanged."""
    if images.dtype == np.uint8:
        out = images.astype(np.float32)
        out *= np.float32(1.0 / 255.0)
        return out
    return images.astype(np.float32)


def _shift_labels(tfds_name: str, labels: np.ndarray, num_classes: int | None
                  ) -> tuple[np.ndarray, int | None]:
    """Applies LABEL_SHIFTS (e.g. EMNIST letters 1..26 -> 0..25)."""
    shift = LABEL_SHIFTS.get(_base_name(tfds_name))
    if shift is None:
        return labels, num_classes
    first, count = shift
    if labels.size and (labels.min() < first or labels.max() >= first + count):
        raise H.FieldError("dataset", f"{tfds_name!r} labels should lie in "
                                      f"{first}..{first + count - 1}, found {labels.min()}.."
                                      f"{labels.max()}")
    return labels - first, count


def _cache_path(cache_dir, tfds_name, builder, split, image_key, label_key):
    if not cache_dir:
        return None
    key = "-".join([tfds_name, str(builder.info.version), split, image_key, label_key])
    return os.path.join(cache_dir, re.sub(r"[^A-Za-z0-9_.\-]+", "_", key) + ".npz")


def load_tfds(name: str, split: str = "train", *, data_dir: str | None = None,
              image_key: str = "image", label_key: str = "label",
              cache_dir: str | None = None) -> TfdsArrays:
    """One split of a prepared TFDS image-classification dataset as host arrays.

    Args:
      name: TFDS name (``"mnist"``, ``"fashion_mnist"``, ``"cifar10"``,
        ``"cifar100"``, ``"emnist/letters"``, any other image-classification
        dataset, optionally ``:version``) or an alias from ``ALIASES``.
      split: TFDS split, slicing allowed (``"test"``, ``"train[:5000]"``).
      data_dir: TFDS data directory holding the prepared dataset; None means the
        TFDS default ($TFDS_DATA_DIR, else ~/tensorflow_datasets).
      image_key, label_key: the features holding the image (fixed shape
        [H, W] or [H, W, C]) and the integer label.
      cache_dir: if given, the decoded split is kept there as one ``.npz`` (images in
        their stored dtype) keyed by name, version, split and features, and read
        from it next time: decoding TFDS's PNG records runs at about 1,400 images/s.

    Returns:
      TfdsArrays (x float32 [n, H, W, C], y int32 [n], num_classes, input_shape,
      name, extras). num_classes comes from the label's ``ClassLabel`` (else
      ``max(y) + 1``), after the shifts in ``LABEL_SHIFTS``.

    Raises:
      DatasetNotPreparedError: the dataset is not prepared under data_dir (the
        message says how to prepare it); nothing is downloaded.
      ValueError: unknown name or split, missing or unsuitable features.
    """
    tfds_name, builder, source = open_source(name, split, data_dir=data_dir)
    features = builder.info.features
    image_shape, image_dtype = _image_spec(features, image_key)
    num_classes = _label_classes(features, label_key)
    extra_keys = _extra_keys(features, image_key, label_key)
    if len(source) == 0:
        raise H.FieldError("split", f"split {split!r} of {tfds_name!r} has no examples")
    cached = _cache_path(cache_dir, tfds_name, builder, split, image_key, label_key)
    if cached and os.path.exists(cached):
        with np.load(cached) as f:
            images, labels = f["images"], f["labels"]
            extras = {k[len("extra_"):]: f[k] for k in f.files if k.startswith("extra_")}
    else:
        images, labels, extras = read_all(source, image_key, label_key, image_shape,
                                          image_dtype, extra_keys)
        if cached:
            os.makedirs(cache_dir, exist_ok=True)
            tmp = cached + ".tmp.npz"
            np.savez(tmp, images=images, labels=labels,
                     **{f"extra_{k}": v for k, v in extras.items()})
            os.replace(tmp, cached)
    labels, num_classes = _shift_labels(tfds_name, labels, num_classes)
    if labels.min() < 0:
        raise H.FieldError("label_key", f"{tfds_name!r} has negative labels "
                                        f"(min {labels.min()})")
    if num_classes is None:
        num_classes = int(labels.max()) + 1
    if labels.max() >= num_classes:
        raise H.FieldError("label_key", f"{tfds_name!r} has label {labels.max()} >= "
                                        f"num_classes={num_classes}")
    return TfdsArrays(x=_to_float(images), y=labels.astype(np.int32),
                      num_classes=int(num_classes), input_shape=tuple(image_shape),
                      name=tfds_name, extras=extras)
