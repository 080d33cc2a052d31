"""Saving and restoring a whole simulation state (no pickle).

A checkpoint is a directory holding ``state.npz`` (the leaves of the server state
and the run key, in tree order) and ``meta.json`` (round, history, anything
JSON-serialisable). Restoring needs a template with the same tree structure, e.g.
``algorithm.init(params, num_clients)``; shapes and dtypes are checked leaf by leaf.
Files are written to a temporary name and renamed, so a crash never leaves a
half-written checkpoint.

A file that is there but cannot be read (garbage, truncated, not the arrays or the
JSON object expected) raises ``ValueError("checkpoint: FILE in DIR is unreadable or
corrupt (...); ...")`` naming the file, never an exception from deep inside NumPy,
``zipfile`` or ``json``; a missing checkpoint raises ``FileNotFoundError``.
"""
from __future__ import annotations

import json
import os
import zipfile
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def save(directory: str, state: Any, meta: dict) -> None:
    os.makedirs(directory, exist_ok=True)
    leaves = jax.tree.leaves(state)
    arrays = {f"leaf_{i:05d}": _to_numpy(x) for i, x in enumerate(leaves)}
    tmp = os.path.join(directory, "state.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, os.path.join(directory, "state.npz"))
    tmp = os.path.join(directory, "meta.tmp.json")
    with open(tmp, "w") as f:
        json.dump(meta, f)
    os.replace(tmp, os.path.join(directory, "meta.json"))


def save_arrays(directory: str, name: str, arrays: dict) -> None:
    """Named host arrays beside a checkpoint (``name``, e.g. "client_history.npz"),
    written to a temporary file and renamed, like the state."""
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f"tmp.{name}")
    with open(tmp, "wb") as f:
        np.savez(f, **{k: np.asarray(v) for k, v in arrays.items()})
    os.replace(tmp, os.path.join(directory, name))


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


def load_arrays(directory: str, name: str) -> dict:
    """The arrays ``save_arrays`` wrote, or {} if there are none (a file that is there
    but unreadable raises ``ValueError("checkpoint: ...")``)."""
    if not os.path.isfile(os.path.join(directory, name)):
        return {}
    return _read_npz(directory, name)


def _saved_arrays(directory: str) -> list:
    """The names of the array files ``save_arrays`` wrote beside the checkpoint."""
    return sorted(n for n in os.listdir(directory) if n.endswith(".npz")
                  and n != "state.npz" and not n.startswith("tmp.") and ".tmp." not in n
                  and os.path.isfile(os.path.join(directory, n)))


def exists(directory: str) -> bool:
    """Whether ``directory`` holds a checkpoint (state.npz and meta.json; whether they
    are readable is ``verify``'s and ``restore``'s to say)."""
    return all(os.path.isfile(os.path.join(directory, n)) for n in ("state.npz", "meta.json"))


def verify(directory: str, template: Any) -> None:
    """Checks, from the file headers only (no array is loaded), that the checkpoint in
    ``directory`` has the leaves of ``template`` (arrays or ``jax.ShapeDtypeStruct``):
    the same count, shapes and dtypes; and that meta.json and every array file saved
    beside it (``save_arrays``) are readable. Raises ``ValueError("checkpoint: ...")``
    (``FileNotFoundError`` without a checkpoint)."""
    if not exists(directory):
        raise FileNotFoundError(f"checkpoint: no checkpoint in {directory!r}")
    leaves = jax.tree.leaves(template)
    headers = _npz_headers(directory, "state.npz")
    names = _leaf_names(headers, directory)
    if len(names) != len(leaves):
        raise ValueError(f"checkpoint: {directory!r} holds {len(names)} arrays, this run's "
                         f"state has {len(leaves)}; was it made by another config?")
    for i, (name, t) in enumerate(zip(names, leaves)):
        shape, dtype = headers[name]
        t = jax.eval_shape(jax.random.key_data, t) if _is_key(t) else t
        t_dtype, t_shape = np.dtype(t.dtype), tuple(np.shape(t))
        raw = dtype.kind == "V" and dtype.itemsize == t_dtype.itemsize  # bf16 as bytes
        if shape != t_shape or (dtype != t_dtype and not raw):
            raise ValueError(f"checkpoint: leaf {i} is {dtype}{shape}, this run expects "
                             f"{t_dtype}{t_shape}; was it made by another config?")
    read_meta(directory)
    for name in _saved_arrays(directory):
        _npz_headers(directory, name)


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
    """The checkpoint's meta (round history, timings) without its arrays: a JSON
    object, else ``ValueError("checkpoint: meta.json ...")``."""
    path = os.path.join(directory, "meta.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint: no meta.json in {directory!r}")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise _corrupt("meta.json", directory, e) from None
    if not isinstance(meta, dict):
        raise _corrupt("meta.json", directory, f"a JSON {type(meta).__name__}, not an object")
    return meta


def restore(directory: str, template: Any) -> tuple[Any, dict]:
    """Returns (state shaped like ``template``, meta)."""
    if not exists(directory):
        raise FileNotFoundError(f"checkpoint: no checkpoint in {directory!r}")
    leaves, treedef = jax.tree.flatten(template)
    meta = read_meta(directory)  # the small file first
    arrays = _read_npz(directory, "state.npz")
    stored = [arrays[name] for name in _leaf_names(arrays, directory)]
    if len(stored) != len(leaves):
        raise ValueError(f"checkpoint: {directory!r} holds {len(stored)} arrays, the "
                         f"algorithm's state has {len(leaves)}; was it made by another config?")
    restored = []
    for i, (x, t) in enumerate(zip(stored, leaves)):
        t_np = _to_numpy(t)
        if x.dtype.kind == "V" and x.dtype.itemsize == t_np.dtype.itemsize:
            x = x.view(t_np.dtype)  # npz stores ml_dtypes (bfloat16, ...) as raw bytes
        if x.shape != t_np.shape or x.dtype != t_np.dtype:
            raise ValueError(f"checkpoint: leaf {i} is {x.dtype}{x.shape}, expected "
                             f"{t_np.dtype}{t_np.shape}; was it made by another config?")
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
