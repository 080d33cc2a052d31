"""Federations on disk: prepared once, memory-mapped by every run (docs/scaling.md,
"A million clients").

``write(dataset, directory)`` (``fedjax-fair prepare``) stores every split of a
``Dataset`` (held in memory, or procedural: computed a block of clients at a time, so
a federation larger than memory can be prepared) as NumPy ``.npy`` files, one per
array, each a padded block [N, M, ...] in which a client's rows are contiguous:

    DIR/federation.json        what follows, written last
    DIR/train_x.npy            [N, M, ...] inputs, real rows first, zero padding
    DIR/train_y.npy            [N, M] int32 labels
    DIR/train_mask.npy         [N, M] bool
    DIR/train_num_examples.npy [N] int32
    DIR/test_*.npy, DIR/validation_*.npy (when the data has one)

``read(directory)`` (``--dataset disk --dataset-arg path=DIR``) opens them with
``np.load(mmap_mode="r")``: nothing is read until a run gathers a cohort's rows (the
runner keeps such a federation on the host and streams each chunk's cohorts, the
next chunk's read in the background while the current chunk computes: runner.py).

Why ``.npy``: a cohort is K scattered clients, and a memory-mapped block reads each
one as one contiguous range, with no decoding, through the page cache; the file is
NumPy's own format (``np.lib.format``), readable without this library. A record
format (ArrayRecord, TFRecord) would add a decode per client and an index for random
access, for nothing a fixed-shape block needs.

A crash while preparing leaves nothing a run would read: the files are written into
``DIR.partial-PID`` and the folder is renamed to ``DIR`` once ``federation.json`` is
in it. ``read`` refuses, with one line naming the file, a folder without
``federation.json``, one prepared in another format version, a missing array file
and one whose size is not its header's shape (truncated).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Callable, Optional

import numpy as np

from fedjax_fair.core.types import ClientData, FederatedData
from fedjax_fair.data import generated
from fedjax_fair.hparams import FieldError

FORMAT = "fedjax_fair.federation"
VERSION = 1
MANIFEST = "federation.json"
SPLITS = ("train", "test", "validation")
_BLOCK = 1024  # clients written at a time


def _library_version() -> str:
    try:
        from importlib.metadata import version
        return version("fedjax-fair")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "unknown"


def _arrays(split) -> dict:
    """{name: (shape, dtype)} of a split's arrays as written."""
    out = {f"{k}": (tuple(v.shape), np.dtype(v.dtype)) for k, v in split.examples.items()}
    out["mask"] = (tuple(split.mask.shape), np.dtype(bool))
    out["num_examples"] = ((int(np.shape(split.num_examples)[0]),), np.dtype(np.int32))
    return out


def _write_split(split, prefix: str, progress: Optional[Callable]) -> dict:
    """Writes one split's arrays at ``prefix + name + ".npy"``, ``_BLOCK`` clients at a
    time, hashing each file's bytes as they are written (its header, then its blocks
    in file order); {name: its manifest entry}."""
    arrays = _arrays(split)
    files, digests = {}, {}
    for name, (shape, dtype) in arrays.items():
        path = f"{prefix}{name}.npy"
        files[name] = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
        with open(path, "rb") as f:  # the header open_memmap wrote
            digests[name] = hashlib.sha256(f.read(files[name].offset))
    n = arrays["num_examples"][0][0]
    for start in range(0, n, _BLOCK):
        ids = np.arange(start, min(start + _BLOCK, n))
        rows = generated.materialize(split, ids)
        block = {**rows.examples, "mask": rows.mask, "num_examples": rows.num_examples}
        for name, v in block.items():
            part = np.ascontiguousarray(v, dtype=arrays[name][1])
            files[name][start:start + len(ids)] = part
            digests[name].update(part)
        if progress is not None:
            progress(len(ids))
    out = {}
    for name, f in files.items():
        f.flush()
        del f
        out[name] = {"file": os.path.basename(f"{prefix}{name}.npy"),
                     "shape": list(arrays[name][0]), "dtype": arrays[name][1].str,
                     "sha256": "sha256:" + digests[name].hexdigest()}
    return out


def write(dataset, directory: str, *, overwrite: bool = False,
          progress: Optional[Callable[[int, int], None]] = None) -> str:
    """Prepares ``dataset`` (a ``Dataset``, stored or procedural) in ``directory``;
    returns the directory. ``progress(done, total)`` after each block of clients
    (counted over every split). An existing ``directory`` is refused unless
    ``overwrite`` (then replaced once the new one is complete)."""
    directory = os.path.abspath(os.path.expanduser(directory))
    if os.path.exists(directory) and not overwrite:
        raise FieldError("output_dir", f"{directory} exists; give another folder or "
                                       f"--overwrite to replace it")
    host = dataset.host_data
    splits = {name: getattr(host, name) for name in SPLITS if getattr(host, name) is not None}
    total = sum(int(np.shape(s.num_examples)[0]) for s in splits.values())
    done = 0

    def step(count: int) -> None:
        nonlocal done
        done += count
        if progress is not None:
            progress(done, total)

    _remove_stale(directory)
    partial = f"{directory}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        entries = {name: {"num_clients": int(np.shape(s.num_examples)[0]),
                          "padded_size": int(s.mask.shape[1]),
                          "arrays": _write_split(s, os.path.join(partial, f"{name}_"), step)}
                   for name, s in splits.items()}
        manifest = {"format": FORMAT, "version": VERSION, "library": _library_version(),
                    "name": dataset.name, "num_classes": int(dataset.num_classes),
                    "input_shape": list(dataset.input_shape),
                    "info": json.loads(json.dumps(dataset.info, default=str)),
                    "splits": entries}
        with open(os.path.join(partial, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(directory):  # overwrite: the old one goes once the new is whole
            old = f"{directory}.old-{os.getpid()}"
            os.replace(directory, old)
            os.replace(partial, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(partial, directory)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return directory


def _remove_stale(directory: str) -> None:
    """Removes the ``DIR.partial-PID`` folders of prepares of ``directory`` that were
    killed (their process is gone)."""
    import glob
    for path in glob.glob(glob.escape(directory) + ".partial-*"):
        pid = path.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def _check_file(path: str, entry: dict, where: str) -> np.ndarray:
    """The array at ``path``, memory-mapped, after checking it exists and holds the
    bytes its header promises with the manifest's shape and dtype."""
    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise FieldError("path", f"{where}: {name} is missing; prepare the federation again")
    with open(path, "rb") as f:
        try:
            major, _ = np.lib.format.read_magic(f)
            shape, fortran, dtype = (np.lib.format.read_array_header_1_0(f) if major == 1
                                     else np.lib.format.read_array_header_2_0(f))
        except ValueError:
            raise FieldError("path", f"{where}: {name} is not a NumPy array file (truncated "
                                     f"or overwritten); prepare the federation again") from None
        offset = f.tell()
    if list(shape) != entry["shape"] or dtype.str != entry["dtype"] or fortran:
        raise FieldError("path", f"{where}: {name} holds {dtype.str} {tuple(shape)}, "
                                 f"{MANIFEST} says {entry['dtype']} {tuple(entry['shape'])}; "
                                 f"prepare the federation again")
    expected = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    size = os.path.getsize(path)
    if size != expected:
        raise FieldError("path", f"{where}: {name} has {size:,} bytes, its header promises "
                                 f"{expected:,} (truncated); prepare the federation again")
    return np.load(path, mmap_mode="r")


def read_manifest(directory: str) -> dict:
    """``federation.json`` of a prepared federation, checked for its format and version."""
    directory = os.path.expanduser(directory)
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise FieldError("path", f"{directory} has no {MANIFEST}: not a prepared federation "
                                 f"(fedjax-fair prepare writes one; an interrupted prepare "
                                 f"leaves none)")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise FieldError("path", f"{path} cannot be read: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise FieldError("path", f"{path} is not a prepared federation's {MANIFEST}")
    if manifest.get("version") != VERSION:
        raise FieldError("path", f"{directory} was prepared in format version "
                                 f"{manifest.get('version')} (fedjax_fair "
                                 f"{manifest.get('library', '?')}); this fedjax_fair reads "
                                 f"version {VERSION}: prepare it again")
    return manifest


def read(directory: str):
    """The prepared federation in ``directory`` as a ``Dataset`` whose arrays are
    memory-mapped (read-only) from its files."""
    from fedjax_fair.data.federated import Dataset
    manifest = read_manifest(directory)
    splits = {}
    for name, entry in manifest["splits"].items():
        arrays = {key: _check_file(os.path.join(directory, e["file"]), e, directory)
                  for key, e in entry["arrays"].items()}
        examples = {k: v for k, v in arrays.items() if k not in ("mask", "num_examples")}
        splits[name] = ClientData(examples=examples, mask=arrays["mask"],
                                  num_examples=arrays["num_examples"])
    if "train" not in splits or "test" not in splits:
        raise FieldError("path", f"{directory}: {MANIFEST} lists no train or test split")
    from fedjax_fair.data.federated import padding_report
    info = {**{k: v for k, v in manifest["info"].items() if k != "procedural"},
            "prepared": os.path.abspath(directory),
            "padding": {name: {**padding_report(split), "on_disk": True}
                        for name, split in splits.items()}}
    return Dataset(name=manifest["name"],
                   host_data=FederatedData(train=splits["train"], test=splits["test"],
                                           validation=splits.get("validation")),
                   num_classes=int(manifest["num_classes"]),
                   input_shape=tuple(manifest["input_shape"]), info=info)


def disk_federation(path: str = ""):
    """The federation ``fedjax-fair prepare`` wrote to ``path`` (``read``)."""
    if not isinstance(path, str) or not path:
        raise FieldError("path", "give the prepared federation's folder: --dataset-arg "
                                 "path=DIR (fedjax-fair prepare -o DIR writes one)")
    return read(path)


def is_on_disk(data) -> bool:
    """Whether ``data``'s arrays are memory-mapped files (``read``'s)."""
    import jax
    return any(isinstance(x, np.memmap) for x in jax.tree.leaves(data))


def _mapping(array):
    """``(mmap, offset of array's first byte in it)`` when ``array`` is a whole
    memory-mapped array (``read``'s, or a plain view of one), else None."""
    import mmap as _mm
    base = array
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
    if base is None or getattr(base, "_mmap", None) is None:
        return None
    if array.__array_interface__["data"][0] != base.__array_interface__["data"][0]:
        return None
    return base._mmap, base.offset % _mm.ALLOCATIONGRANULARITY


def will_need(split, client_ids) -> None:
    """Asks the kernel to start reading the rows of ``client_ids`` of a memory-mapped
    split (``madvise(MADV_WILLNEED)`` per client: asynchronous, many reads in flight),
    so the gather that follows copies from the page cache instead of faulting its
    pages in one at a time. Nothing for arrays in memory, or where ``madvise`` is
    missing."""
    import mmap as _mm
    if not hasattr(_mm, "MADV_WILLNEED"):
        return
    ids = np.unique(np.asarray(client_ids).ravel())
    page = _mm.PAGESIZE
    for array in [*split.examples.values(), split.mask]:
        found = _mapping(array)
        if found is None:
            continue
        mapping, start = found
        stride = array.strides[0]
        for k in ids:
            first = start + int(k) * stride
            aligned = first - first % page
            try:
                mapping.madvise(_mm.MADV_WILLNEED, aligned, first + stride - aligned)
            except (OSError, ValueError):
                return
