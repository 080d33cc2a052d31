"""Saving and restoring a whole simulation state (no pickle), one commit per save.

A checkpoint directory holds committed *step directories* ``step-00000001``,
``step-00000002``, ... (the last ``KEEP`` of them). Each ``save`` writes one step
directory under a temporary name (``tmp.step-...``) and renames it, which is the
single commit: after a crash at any instant the checkpoint reads as the last
committed save, never a mix of two. A step directory holds ``state.npz`` (the
leaves of the server state and the run key, in tree order), ``meta.json`` (round,
history, anything JSON-serialisable, plus ``"checkpoint_format"``) and the named
array files given to ``save`` (the runner's ``client_history.npz`` and
``rounds.npz``). Every reader (``exists``, ``verify``, ``read_meta``, ``restore``,
``load_arrays``) reads the newest committed step directory (``latest``).
Restoring needs a template with the same tree structure, e.g.
``algorithm.init(params, num_clients)``; shapes and dtypes are checked leaf by leaf.

A file that is there but cannot be read (garbage, truncated, not the arrays or the
JSON object expected) raises ``ValueError("checkpoint: FILE in DIR is unreadable or
corrupt (...); ...")`` naming the file, never an exception from deep inside NumPy,
``zipfile`` or ``json``; a missing checkpoint raises ``FileNotFoundError``. A
checkpoint written before step directories (``state.npz`` and ``meta.json`` directly
in the directory, several renames without a commit point) raises
``ValueError("checkpoint: ... older format ...")``: it cannot be trusted to be one
consistent save.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
import zlib
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from fedjax_fair import hparams as H

FORMAT = 2  # meta.json's "checkpoint_format"
KEEP = 2  # committed step directories kept
_STEP = re.compile(r"step-(\d{8,})")
_OLDER_FORMAT = ("state.npz", "meta.json", "client_history.npz")  # flat, before steps


def _fault(point: str) -> None:
    """Called before every write, rename and removal of ``save`` (and between the two
    halves of each file's bytes); a no-op that tests replace to simulate a kill at
    that instant."""


class _TornOnce:
    """A file whose first write is followed by the ``inside NAME`` fault point, so a
    simulated kill leaves a partly written file; npz data is streamed straight into it
    (no second copy of a state in memory)."""

    def __init__(self, f, name: str):
        self._f, self._name, self._torn = f, name, False

    def write(self, data):
        n = self._f.write(data)
        if not self._torn:
            self._torn = True
            self._f.flush()
            _fault(f"inside {self._name}")
        return n

    def __getattr__(self, attr):  # seek / tell / flush for zipfile
        return getattr(self._f, attr)


def _write_file(path: str, write, name: Optional[str] = None) -> None:
    """``write(f)`` into a new file at ``path``, fsynced; the fault points ``open NAME``
    before and ``inside NAME`` after its first bytes (NAME: the file's name)."""
    name = name or os.path.basename(path)
    _fault(f"open {name}")
    with open(path, "wb") as f:
        write(_TornOnce(f, name))
        f.flush()
        os.fsync(f.fileno())


def _npz(arrays: dict):
    return lambda f: np.savez(f, **arrays)


def check_directory(directory, field: str = "checkpoint_dir"):
    """``directory`` (a path: ``str`` or ``os.PathLike``; None passes) can hold a
    checkpoint: a directory, or a path whose nearest existing parent is a directory
    (``save`` creates the rest). Else ``FieldError`` / ``FieldTypeError`` naming
    ``field``, before anything is compiled or written. Returns ``directory``."""
    if directory is None:
        return None
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise H.FieldTypeError(field, f"must be a directory path (a str), got "
                                      f"{type(directory).__name__} {directory!r}")
    path = os.path.abspath(os.fspath(directory))
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise H.FieldError(field, f"{os.fspath(directory)!r} exists and is not a "
                                      f"directory; give a directory for the checkpoints")
        return directory
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise H.FieldError(field, f"cannot create {os.fspath(directory)!r}: {parent!r} is "
                                  f"a file, not a directory")
    return directory


def steps(directory: str) -> list:
    """The committed step directories' numbers, oldest first."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(m.group(1)) for m in map(_STEP.fullmatch, names) if m
                  and os.path.isdir(os.path.join(directory, m.group(0))))


def roll_back(directory: str, round_: int) -> bool:
    """Makes the committed save of round ``round_`` the newest of checkpoint
    ``directory`` by retiring the saves after it (each renamed out of the committed
    names first, so a crash leaves either it or a leftover that the next save clears);
    True if that save exists (or ``round_`` is 0: a run started afresh replaces the
    directory), False and nothing changed otherwise. ``compare --resume`` rolls a seed
    that committed ahead of the others back to their round, so that the seeds run on
    as one program, bit for bit the uninterrupted comparison."""
    if round_ == 0:
        return True
    found = steps(directory)
    rounds = {}
    for step in found:
        try:
            meta = _read_json(os.path.join(directory, f"step-{step:08d}"), "meta.json")
            rounds[step] = int(meta["round"])
        except (ValueError, KeyError, TypeError, OSError):
            continue
    target = [s for s, r in rounds.items() if r == round_]
    if not target:
        return False
    for step in [s for s in found if s > target[-1]]:
        name = os.path.join(directory, f"step-{step:08d}")
        retired = os.path.join(directory, f"tmp.retired-{step:08d}")
        os.rename(name, retired)  # out of the committed names: atomic
        _fsync_dir(directory)
        shutil.rmtree(retired, ignore_errors=True)
    return True


def latest(directory: str) -> Optional[str]:
    """The newest committed step directory of checkpoint ``directory``, or None."""
    found = steps(directory)
    return os.path.join(directory, f"step-{found[-1]:08d}") if found else None


def save(directory: str, state: Any, meta: dict, arrays: Optional[dict] = None,
         fresh: bool = False, logs: Optional[dict] = None, unmerged: tuple = ()) -> str:
    """Commits ``state``, ``meta``, ``arrays`` ({file name: {array name: array}}) and
    the new rows of ``logs`` ({log name: {array name: rows [n, ...]}} or a list of
    JSON values) as one new step directory; keeps the last ``KEEP`` (``fresh``: this
    one alone, the first save of a new run into a directory an earlier run used,
    whose logs it does not continue). The logs named in ``unmerged`` keep one segment
    per save, never merged (``log_segments`` reads them one at a time: a client
    table's rows, which may not fit in memory twice). Returns the step directory."""
    os.makedirs(directory, exist_ok=True)
    found = steps(directory)
    step = (found[-1] + 1) if found else 1
    name = f"step-{step:08d}"
    tmp = os.path.join(directory, f"tmp.{name}")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    _fault("mkdir")
    os.makedirs(tmp)
    previous = None if fresh or not found else os.path.join(directory,
                                                            f"step-{found[-1]:08d}")
    logs = dict(logs or {})
    if previous is not None:  # a log this save does not add to is carried over whole
        for log in sorted(os.listdir(previous)):
            if os.path.isdir(os.path.join(previous, log)) and log not in logs:
                logs[log] = [] if all(seg.endswith(".json")
                                      for seg in _segments(previous, log)) else {}
    for log, rows in logs.items():
        _fault(f"link {log}")
        os.makedirs(os.path.join(tmp, log))
        earlier = _segments(previous, log) if previous is not None else []
        saves = 1
        if rows and log not in unmerged:
            rows, saves = _merge_tail(previous, log, earlier, rows)
        for seg in earlier:  # the segments this save does not merge, linked
            _link(os.path.join(previous, log, seg), os.path.join(tmp, log, seg))
        if rows:
            ext = "npz" if isinstance(rows, dict) else "json"
            write = (_npz({k: np.asarray(v) for k, v in rows.items()}) if ext == "npz"
                     else lambda f, t=json.dumps(list(rows)).encode(): f.write(t))
            _write_file(os.path.join(tmp, log, f"seg-{step:08d}-{saves:06d}.{ext}"), write,
                        f"{log} segment")
        _fsync_dir(os.path.join(tmp, log))
    leaves = jax.tree.leaves(state)
    _write_file(os.path.join(tmp, "state.npz"),
                _npz({f"leaf_{i:05d}": _to_numpy(x) for i, x in enumerate(leaves)}))
    for file, named in (arrays or {}).items():
        _write_file(os.path.join(tmp, file), _npz({k: np.asarray(v) for k, v in named.items()}))
    json_logs = [log for log, rows in logs.items() if not isinstance(rows, dict)]
    text = json.dumps({**meta, "checkpoint_format": FORMAT,
                       **({"json_logs": json_logs} if json_logs else {})}).encode()
    _write_file(os.path.join(tmp, "meta.json"), lambda f: f.write(text))
    _fsync_dir(tmp)  # its entries reach the disk before the rename that commits them
    _fault("commit")
    os.rename(tmp, os.path.join(directory, name))  # the commit
    _fsync_dir(directory)
    for old in (found if fresh else found[:max(0, len(found) + 1 - KEEP)]):
        _fault("retention")
        shutil.rmtree(os.path.join(directory, f"step-{old:08d}"), ignore_errors=True)
    for other in os.listdir(directory):  # a crashed save's leftovers
        if other.startswith(("tmp.step-", "tmp.retired-")):
            shutil.rmtree(os.path.join(directory, other), ignore_errors=True)
        elif fresh and other in _OLDER_FORMAT:
            os.remove(os.path.join(directory, other))
    return os.path.join(directory, name)


_SEGMENT = re.compile(r"seg-(\d{8,})-(\d{6,})\.(npz|json)")


def _merge_tail(previous: Optional[str], log: str, earlier: list, rows):
    """(rows, saves) of this save's segment of ``log``: its new ``rows``, merged with
    the trailing segments of ``earlier`` (removed from it) that hold as few saves or
    fewer, as a binary counter carries. A log of E saves then has at most log2(E) + 1
    segments, and each row is rewritten at most log2(E) times: a commit links
    O(log E) files and writes O(log E) rows amortised, never the whole log."""
    saves = 1
    while earlier:
        match = _SEGMENT.fullmatch(earlier[-1])
        if match is None or int(match.group(2)) > saves:
            break
        seg = earlier.pop()
        older = (_read_npz(os.path.join(previous, log), seg) if seg.endswith(".npz")
                 else _read_json(os.path.join(previous, log), seg))
        saves += int(match.group(2))
        if isinstance(rows, dict):
            if set(older) != set(rows):
                raise H.FieldError("checkpoint", f"log {log!r} of this save has arrays "
                                                 f"{sorted(rows)}, its earlier rows "
                                                 f"{sorted(older)}; a log "
                                                 f"keeps one set of arrays")
            rows = {k: np.concatenate([older[k], np.asarray(v)]) for k, v in rows.items()}
        else:
            rows = list(older) + list(rows)
    return rows, saves


def _link(src: str, dst: str) -> None:
    """``dst`` as a hard link to the committed (never rewritten) file ``src``; a copy
    where the file system refuses links."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# What reading a damaged .npz / .json file raises (json's JSONDecodeError and a
# UnicodeDecodeError are ValueErrors; zipfile.BadZipFile, zlib.error are not).
_READ_ERRORS = (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error)


def _corrupt(name: str, directory: str, why) -> ValueError:
    """The error for a checkpoint file that is there but cannot be used."""
    if isinstance(why, BaseException):
        first = (str(why).strip().splitlines() or [""])[0]
        why = f"{type(why).__name__}: {first}" if first else type(why).__name__
    return ValueError(f"checkpoint: {name} in {directory!r} is unreadable or corrupt ({why}); "
                      f"the run cannot resume from it (start it again)")


def _read_npz(directory: str, name: str) -> dict:
    """Every array of the .npz file ``name``, or ``_corrupt``'s ValueError."""
    try:
        f = np.load(os.path.join(directory, name), allow_pickle=False)
    except _READ_ERRORS as e:
        raise _corrupt(name, directory, e) from None
    if not isinstance(f, np.lib.npyio.NpzFile):
        raise _corrupt(name, directory, "not an .npz archive")
    with f:
        try:
            return {k: f[k] for k in f.files}
        except _READ_ERRORS as e:
            raise _corrupt(name, directory, e) from None


def _npz_headers(directory: str, name: str) -> dict:
    """{array name: (shape, dtype)} of an .npz file, read from the headers alone (no
    array is loaded), or ``_corrupt``'s ValueError."""
    out = {}
    try:
        with zipfile.ZipFile(os.path.join(directory, name)) as z:
            for member in z.namelist():
                with z.open(member) as f:
                    major, _ = np.lib.format.read_magic(f)
                    read = (np.lib.format.read_array_header_1_0 if major == 1
                            else np.lib.format.read_array_header_2_0)
                    shape, _, dtype = read(f)
                out[member[:-len(".npy")] if member.endswith(".npy") else member] = (shape,
                                                                                     dtype)
    except _READ_ERRORS as e:
        raise _corrupt(name, directory, e) from None
    return out


def _step_dir(directory: str) -> str:
    """The newest committed step directory; ``FileNotFoundError`` without one, and
    ``ValueError("checkpoint: ...")`` for a checkpoint of the older format."""
    found = latest(directory)
    if found is not None:
        return found
    if any(os.path.isfile(os.path.join(directory, n)) for n in ("state.npz", "meta.json")):
        raise H.FieldError("checkpoint", f"{directory!r} holds a checkpoint of an older format "
                                         f"(state.npz / meta.json without a committed step "
                                         f"directory), "
                                         f"which may mix two saves; the run cannot resume from it "
                                         f"(start "
                                         f"it again)")
    raise FileNotFoundError(f"checkpoint: no checkpoint in {directory!r}")


def load_arrays(directory: str, name: str) -> dict:
    """The arrays saved as ``name`` with the newest committed save (a log's segments
    concatenated), or {} if it has none (a file that is there but unreadable raises
    ``ValueError("checkpoint: ...")``)."""
    step = _step_dir(directory)
    if os.path.isdir(os.path.join(step, name)):
        return load_log(directory, name)
    if not os.path.isfile(os.path.join(step, name)):
        return {}
    return _read_npz(step, name)


def _segments(step: str, name: str) -> list:
    """The segment files of log ``name`` in step directory ``step``, oldest first (by
    their save number, then name)."""
    folder = os.path.join(step, name)
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []

    def order(seg):
        match = _SEGMENT.fullmatch(seg)
        return (int(match.group(1)) if match else -1, seg)
    return sorted(names, key=order)


def load_log(directory: str, name: str):
    """The log ``name`` of the newest save: its array segments concatenated ({array:
    rows}), or its JSON segments' values in one list; {} / [] without one. A segment
    that is unreadable, or arrays that do not line up, raise
    ``ValueError("checkpoint: ...")``."""
    step = _step_dir(directory)
    return _read_log(step, name)


def log_segments(directory: str, name: str, rows: int = 4096):
    """The array segments of log ``name`` of the newest save, oldest first, read
    ``rows`` rows at a time: a generator of ``{array: rows [<= rows, ...]}`` (a segment
    larger than memory is never held whole). An unreadable segment raises
    ``ValueError("checkpoint: ...")``."""
    step = _step_dir(directory)
    folder = os.path.join(step, name)
    for seg in _segments(step, name):
        yield from _npz_blocks(folder, seg, rows)


def _npz_blocks(directory: str, name: str, rows: int):
    """The arrays of the .npz file ``name`` (one leading length), ``rows`` rows at a
    time, read from their members' streams; or ``_corrupt``'s ValueError."""
    headers = _npz_headers(directory, name)
    lengths = {shape[0] if shape else None for shape, _ in headers.values()}
    if len(lengths) != 1 or None in lengths:
        raise _corrupt(name, directory, "its arrays differ in length")
    n = lengths.pop()
    try:
        with zipfile.ZipFile(os.path.join(directory, name)) as z:
            streams = {}
            for member in z.namelist():
                f = z.open(member)
                major, _ = np.lib.format.read_magic(f)
                (np.lib.format.read_array_header_1_0 if major == 1
                 else np.lib.format.read_array_header_2_0)(f)
                streams[member[:-len(".npy")] if member.endswith(".npy") else member] = f
            for start in range(0, n, rows):
                m = min(rows, n - start)
                block = {}
                for key, f in streams.items():
                    shape, dtype = headers[key]
                    size = m * int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
                    data = f.read(size)
                    if len(data) != size:
                        raise EOFError(f"{key} ends early")
                    block[key] = np.frombuffer(data, dtype).reshape(m, *shape[1:])
                yield block
    except _READ_ERRORS as e:
        raise _corrupt(name, directory, e) from None


def _read_log(step: str, name: str):
    segments = _segments(step, name)
    folder = os.path.join(step, name)
    if segments and all(seg.endswith(".json") for seg in segments):
        out = []
        for seg in segments:
            value = _read_json(folder, seg)
            if not isinstance(value, list):
                raise _corrupt(f"{name}/{seg}", step, "not a JSON list")
            out.extend(value)
        return out
    parts = [_read_npz(folder, seg) for seg in segments]
    if not parts:
        return {}
    keys = set(parts[0])
    for seg, part in zip(segments, parts):
        if set(part) != keys:
            raise _corrupt(f"{name}/{seg}", step, "its arrays differ from the first "
                                                  "segment's")
    try:
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    except ValueError as e:
        raise _corrupt(name, step, e) from None


def _read_json(directory: str, name: str):
    try:
        with open(os.path.join(directory, name), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise _corrupt(name, directory, e) from None


def read_leaf(directory: str, index: int) -> np.ndarray:
    """Leaf ``index`` of the newest save's state, read alone."""
    step = _step_dir(directory)
    name = f"leaf_{index:05d}"
    try:
        with np.load(os.path.join(step, "state.npz"), allow_pickle=False) as f:
            return f[name]
    except _READ_ERRORS as e:
        raise _corrupt("state.npz", step, e) from None


def exists(directory: str) -> bool:
    """Whether ``directory`` holds a checkpoint: a committed step directory with
    state.npz and meta.json, or a checkpoint of the older format (which the readers
    refuse); whether they are readable is ``verify``'s and ``restore``'s to say."""
    step = latest(directory)
    if step is None:
        return any(os.path.isfile(os.path.join(directory, n))
                   for n in ("state.npz", "meta.json"))
    return all(os.path.isfile(os.path.join(step, n)) for n in ("state.npz", "meta.json"))


def verify(directory: str, template: Any) -> None:
    """Checks, from the file headers only (no array is loaded), that the newest save in
    ``directory`` has the leaves of ``template`` (arrays or ``jax.ShapeDtypeStruct``):
    the same count, shapes and dtypes; and that its meta.json and every array file
    saved with it are readable. Raises ``ValueError("checkpoint: ...")``
    (``FileNotFoundError`` without a checkpoint)."""
    if not exists(directory):
        raise FileNotFoundError(f"checkpoint: no checkpoint in {directory!r}")
    step = _step_dir(directory)
    leaves = jax.tree.leaves(template)
    headers = _npz_headers(step, "state.npz")
    names = _leaf_names(headers, step)
    if len(names) != len(leaves):
        raise H.FieldError("checkpoint", f"{step!r} holds {len(names)} arrays, this run's "
                                         f"state has {len(leaves)}; was it made by another config?")
    for i, (name, t) in enumerate(zip(names, leaves)):
        shape, dtype = headers[name]
        t = jax.eval_shape(jax.random.key_data, t) if _is_key(t) else t
        t_dtype, t_shape = np.dtype(t.dtype), tuple(np.shape(t))
        raw = dtype.kind == "V" and dtype.itemsize == t_dtype.itemsize  # bf16 as bytes
        if shape != t_shape or (dtype != t_dtype and not raw):
            raise H.FieldError("checkpoint", f"leaf {i} is {dtype}{shape}, this run expects "
                                             f"{t_dtype}{t_shape}; was it made by another config?")
    read_meta(directory)
    for name in sorted(os.listdir(step)):
        if name.endswith(".npz") and name != "state.npz":
            _npz_headers(step, name)
        elif os.path.isdir(os.path.join(step, name)):
            for seg in _segments(step, name):
                if seg.endswith(".npz"):
                    _npz_headers(os.path.join(step, name), seg)


def _leaf_names(names, directory: str) -> list:
    """state.npz's arrays are leaf_00000, leaf_00001, ...: their names in order, or
    ``_corrupt``'s ValueError."""
    names = sorted(names)
    if names != [f"leaf_{i:05d}" for i in range(len(names))]:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise _corrupt("state.npz", directory, f"holds arrays named {shown or 'nothing'}, "
                                               f"not leaf_00000, leaf_00001, ...")
    return names


def _is_key(x) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def read_meta(directory: str) -> dict:
    """The newest save's meta (round, timings) without its arrays: a JSON object, with
    its JSON logs (the runner's evaluation ``history``) read in under their names;
    else ``ValueError("checkpoint: meta.json ...")``."""
    step = _step_dir(directory)
    path = os.path.join(step, "meta.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint: no meta.json in {step!r}")
    meta = _read_json(step, "meta.json")
    if not isinstance(meta, dict):
        raise _corrupt("meta.json", step, f"a JSON {type(meta).__name__}, not an object")
    meta.pop("checkpoint_format", None)
    for name in meta.pop("json_logs", []):
        meta[name] = _read_log(step, name) or []
    return meta


def restore(directory: str, template: Any) -> tuple[Any, dict]:
    """Returns (state shaped like ``template``, meta) of the newest save."""
    if not exists(directory):
        raise FileNotFoundError(f"checkpoint: no checkpoint in {directory!r}")
    step = _step_dir(directory)
    leaves, treedef = jax.tree.flatten(template)
    meta = read_meta(directory)  # the small file first
    arrays = _read_npz(step, "state.npz")
    stored = [arrays[name] for name in _leaf_names(arrays, step)]
    if len(stored) != len(leaves):
        raise H.FieldError("checkpoint", f"{step!r} holds {len(stored)} arrays, the "
                                         f"algorithm's state has {len(leaves)}; was it made by "
                                         f"another config?")
    restored = []
    for i, (x, t) in enumerate(zip(stored, leaves)):
        t_np = _to_numpy(t)
        if x.dtype.kind == "V" and x.dtype.itemsize == t_np.dtype.itemsize:
            x = x.view(t_np.dtype)  # npz stores ml_dtypes (bfloat16, ...) as raw bytes
        if x.shape != t_np.shape or x.dtype != t_np.dtype:
            raise H.FieldError("checkpoint", f"leaf {i} is {x.dtype}{x.shape}, expected "
                                             f"{t_np.dtype}{t_np.shape}; was it made by another "
                                             f"config?")
        restored.append(_from_numpy(x, t))
    return jax.tree.unflatten(treedef, restored), meta


def _to_numpy(x):
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def _from_numpy(x, template):
    if isinstance(template, jax.Array) and jnp.issubdtype(template.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(jnp.asarray(x), impl=jax.random.key_impl(template))
    return jnp.asarray(x)
