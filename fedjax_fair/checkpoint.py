"""Saving and restoring a whole simulation state (no pickle).

A checkpoint is a directory holding ``state.npz`` (the leaves of the server state
and the run key, in tree order) and ``meta.json`` (round, history, anything
JSON-serialisable). Restoring needs a template with the same tree structure, e.g.
``algorithm.init(params, num_clients)``; shapes and dtypes are checked leaf by leaf.
Files are written to a temporary name and renamed, so a crash never leaves a
half-written checkpoint.
"""
from __future__ import annotations

import json
import os
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


def load_arrays(directory: str, name: str) -> dict:
    """The arrays ``save_arrays`` wrote, or {} if there are none."""
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return {}
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def exists(directory: str) -> bool:
    return all(os.path.exists(os.path.join(directory, n)) for n in ("state.npz", "meta.json"))


def verify(directory: str, template: Any) -> None:
    """Checks, from the file headers only (no array is loaded), that the checkpoint in
    ``directory`` has the leaves of ``template`` (arrays or ``jax.ShapeDtypeStruct``):
    the same count, shapes and dtypes. Raises ``ValueError("checkpoint: ...")``."""
    import zipfile
    leaves = jax.tree.leaves(template)
    with zipfile.ZipFile(os.path.join(directory, "state.npz")) as z:
        names = sorted(n for n in z.namelist() if n.startswith("leaf_"))
        if len(names) != len(leaves):
            raise ValueError(f"checkpoint: {directory!r} holds {len(names)} arrays, this run's "
                             f"state has {len(leaves)}; was it made by another config?")
        for i, (name, t) in enumerate(zip(names, leaves)):
            with z.open(name) as f:
                major, _ = np.lib.format.read_magic(f)
                read = (np.lib.format.read_array_header_1_0 if major == 1
                        else np.lib.format.read_array_header_2_0)
                shape, _, dtype = read(f)
            t = jax.eval_shape(jax.random.key_data, t) if _is_key(t) else t
            t_dtype, t_shape = np.dtype(t.dtype), tuple(np.shape(t))
            raw = dtype.kind == "V" and dtype.itemsize == t_dtype.itemsize  # bf16 as bytes
            if shape != t_shape or (dtype != t_dtype and not raw):
                raise ValueError(f"checkpoint: leaf {i} is {dtype}{shape}, this run expects "
                                 f"{t_dtype}{t_shape}; was it made by another config?")


def _is_key(x) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def read_meta(directory: str) -> dict:
    """The checkpoint's meta (round history, timings) without its arrays."""
    with open(os.path.join(directory, "meta.json")) as f:
        return json.load(f)


def restore(directory: str, template: Any) -> tuple[Any, dict]:
    """Returns (state shaped like ``template``, meta)."""
    if not exists(directory):
        raise FileNotFoundError(f"checkpoint: no checkpoint in {directory!r}")
    leaves, treedef = jax.tree.flatten(template)
    with np.load(os.path.join(directory, "state.npz")) as f:
        stored = [f[f"leaf_{i:05d}"] for i in range(len(f.files))]
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
    return jax.tree.unflatten(treedef, restored), read_meta(directory)


def _to_numpy(x):
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def _from_numpy(x, template):
    if isinstance(template, jax.Array) and jnp.issubdtype(template.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(jnp.asarray(x), impl=jax.random.key_impl(template))
    return jnp.asarray(x)
