"""A split whose rows are computed from the client id (the core type of the procedural
federations of ``fedjax_fair/data/generated.py``, which builds them).

``GeneratedClients`` holds no rows: ``take(client_ids)`` computes the clients' rows
inside whatever program calls it (the round, the evaluation), so code that gathers a
cohort (``take``) or evaluates clients (``core/evaluation.py``) works on a stored
split and a generated one alike.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair.core.types import ClientData


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["num_examples", "shared", "key_data"],
                   meta_fields=["rows", "max_examples", "example_spec"])
@dataclasses.dataclass(frozen=True)
class GeneratedClients:
    """One split of a generated federation.

    num_examples: int32 [N], client k's real rows in this split.
    shared: the generator's arrays common to every client (a pytree).
    key_data: uint32 key data of the dataset's key (``jax.random.key_data``).
    rows: ``(shared, client_key, client_id) -> {name: [max_examples, ...]}``, every row
      a client could hold (rows past its ``num_examples`` are zeroed by ``take``); a
      hashable value (a frozen dataclass), so two builds of one dataset share their
      compiled programs.
    max_examples: M, the padded rows per client (the largest of ``num_examples``).
    example_spec: ``((name, shape of one example, dtype name), ...)``.

    It answers what code reads of a stored split's shapes: ``examples`` and ``mask``
    are ``jax.ShapeDtypeStruct``s [N, M, ...] (nothing is allocated).
    """

    num_examples: Any
    shared: Any
    key_data: Any
    rows: Callable
    max_examples: int
    example_spec: tuple

    @property
    def num_clients(self) -> int:
        return int(np.shape(self.num_examples)[0])

    @property
    def examples(self) -> dict:
        lead = (self.num_clients, self.max_examples)
        return {name: jax.ShapeDtypeStruct((*lead, *shape), np.dtype(dtype))
                for name, shape, dtype in self.example_spec}

    @property
    def mask(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.num_clients, self.max_examples), np.dtype(bool))

    def take(self, client_ids) -> ClientData:
        """The clients ``client_ids`` [K] as a ``ClientData`` [K, M, ...]: real rows
        first, then zero rows, as a stored federation holds them."""
        key = jax.random.wrap_key_data(jnp.asarray(self.key_data))
        client_ids = jnp.asarray(client_ids, jnp.int32)
        examples = jax.vmap(lambda k: self.rows(self.shared, jax.random.fold_in(key, k), k)
                            )(client_ids)
        sizes = jnp.asarray(self.num_examples)[client_ids]
        mask = jnp.arange(self.max_examples)[None, :] < sizes[:, None]
        examples = {name: jnp.where(mask.reshape(mask.shape + (1,) * (v.ndim - 2)), v,
                                    jnp.zeros((), v.dtype))
                    for name, v in examples.items()}
        return ClientData(examples=examples, mask=mask, num_examples=sizes)


def is_generated(split) -> bool:
    return isinstance(split, GeneratedClients)


def take(split, client_ids) -> ClientData:
    """Rows of ``client_ids`` of a stored split (a gather) or a generated one."""
    if is_generated(split):
        return split.take(client_ids)
    return jax.tree.map(lambda t: t[client_ids], split)


_MATERIALIZE_CLIENTS = 1024


@functools.lru_cache(maxsize=8)
def _take_program(rows: Callable, max_examples: int, example_spec: tuple) -> Callable:
    del rows, max_examples, example_spec  # the cache key: one program per generator
    return jax.jit(lambda split, ids: split.take(ids))


def materialize(split, client_ids=None) -> ClientData:
    """Host rows (NumPy) of ``client_ids`` (default: every client) of a generated split,
    computed ``_MATERIALIZE_CLIENTS`` clients per call; a stored split's rows as they are."""
    if not is_generated(split):
        ids = slice(None) if client_ids is None else np.asarray(client_ids)
        return jax.tree.map(lambda v: np.asarray(v)[ids], split)
    ids = (np.arange(split.num_clients, dtype=np.int32) if client_ids is None
           else np.asarray(client_ids, np.int32))
    fn = _take_program(split.rows, split.max_examples, split.example_spec)
    parts = []
    for start in range(0, len(ids), _MATERIALIZE_CLIENTS):
        part = ids[start:start + _MATERIALIZE_CLIENTS]
        padded = np.resize(part, _MATERIALIZE_CLIENTS) if len(part) else part
        out = jax.tree.map(np.asarray, fn(split, padded))
        parts.append(jax.tree.map(lambda v: v[:len(part)], out))
    return jax.tree.map(lambda *v: np.concatenate(v), *parts)


def client_blocks(split, size: int = _MATERIALIZE_CLIENTS):
    """``(ids, host rows)`` of a split's clients, ``size`` at a time (``materialize``):
    per-client statistics of a federation too large to hold."""
    n = int(np.shape(split.num_examples)[0])
    for start in range(0, n, size):
        ids = np.arange(start, min(start + size, n), dtype=np.int32)
        yield ids, materialize(split, ids)
