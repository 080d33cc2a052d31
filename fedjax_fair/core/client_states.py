"""Per-client state tables: one row per client of the federation, two storage forms.

Stateful methods keep a row per client across rounds: SCAFFOLD's control variate,
FedDyn's linear term, A-FedPD's dual, Ditto's personal model. A round gathers the
cohort's rows, the clients return new rows, and the table scatters them back.
Rows of masked-out cohort entries never write (their index is sent out of range and
dropped), so padded cohorts that repeat a client id cannot clobber its row.

Every form is a ``ClientTable`` of functions (optax style) over a NamedTuple state,
and they give the same rows (the dense and lazy forms pure):

* ``dense()``: ``DenseTable`` with leaves [N, ...], one row per client from the
  start. Simple and fast to gather; memory N x row.
* ``lazy(capacity)``: ``LazyTable`` stores rows only for clients seen so far, in
  ``capacity`` slots allocated at first write. A client never written reads the
  initial row. Memory capacity x row + 8 N bytes, so a federation of 10^5 clients of
  which a run samples 10^3 stores 10^3 rows.
* ``host()`` / ``disk()``: ``HostTable``, the lazy form's rows outside the device (host
  memory, or memory-mapped files), read and written by the compiled round through
  host callbacks (``core/row_store.py``); the device holds the cohort's rows only.
  For ``runner.run``, which checkpoints and restores the rows.

Rows of clients outside the cohort may move between their writes by a common
additive *drift* (A-FedPD's virtual dual update, lambda_i += rho (theta_bar - theta)
for every inactive client): ``drift(table, delta)`` adds ``delta`` to every row. The
dense form adds it to all N rows (then the cohort's new rows overwrite theirs); the
lazy form adds it to one offset D and stores rows as deviations ``row - D``, so a row
gathered ``s`` rounds after its last write is caught up in closed form,
``row_last + (D_now - D_last)``, without touching the other rows. Each table also
keeps the round every client was last written (``last_round``, -1 = never), for
staleness-aware methods and diagnostics.

``memory(table)`` reports the bytes of one row, of the rows stored and of the whole
table.

Storage precision: ``dense(dtype=jnp.bfloat16)`` / ``lazy(..., dtype=...)`` (text
"dense:bf16", "lazy:bf16", "lazy:500:bf16") store the rows' floating leaves in a
narrower type and gather them back as float32; the lazy form keeps its drift offset
and the initial row in full precision, so only each client's deviation from the
common drift is rounded, once per write. 16-bit types are held as their uint16 bits
(XLA:CPU scatters into a bfloat16 array by widening all of it to float32).
``benchmarks/primal_dual.py bf16`` measures the effect on A-FedPD.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from fedjax_fair.core.memory import tree_bytes  # bytes of every leaf (host-side)
from fedjax_fair import hparams as H


class ClientTable(NamedTuple):
    """init(row, num_clients) -> table; gather(table, client_ids) -> rows [K, ...];
    scatter(table, client_ids, rows, client_mask, round) -> table;
    drift(table, delta) -> table; memory(table) -> dict (host-side).
    capacity: the most clients it can hold (None: every client). where: "device", or
    "host" / "disk" for rows outside the device (``host``, ``disk``)."""

    init: Callable
    gather: Callable
    scatter: Callable
    drift: Callable
    memory: Callable
    name: str
    capacity: Optional[int] = None
    where: str = "device"  # where the rows live: "device", "host" or "disk"


def init_table(row, num_clients: int):
    """``num_clients`` copies of the pytree ``row`` (leaves [N, ...])."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_clients, *jnp.shape(x))), row)


def gather(rows, client_ids):
    """Rows at client_ids: leaves [K, ...] (a plain stacked pytree)."""
    return jax.tree.map(lambda t: t[client_ids], rows)


def _write_ids(client_ids, client_mask, size: int):
    return jnp.where(client_mask, client_ids, size)  # out of range: dropped


def scatter(rows, client_ids, new_rows, client_mask):
    """Writes ``new_rows`` [K, ...] at ``client_ids`` where ``client_mask`` is True."""
    leaves = jax.tree.leaves(rows)
    size = leaves[0].shape[0] if leaves else 0
    ids = _write_ids(client_ids, client_mask, size)
    return jax.tree.map(lambda t, r: t.at[ids].set(r, mode="drop"), rows, new_rows)


def _encode(x, dtype):
    """A floating leaf in the storage ``dtype`` (None: as is). 16-bit floats are held as
    their uint16 bits: XLA:CPU scatters into a bfloat16 array by widening the whole
    array to float32 and back every round, an integer scatter touches the rows only."""
    if dtype is None or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    x = x.astype(dtype)
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if dtype.itemsize == 2 else x


def _decode(x, dtype):
    """A stored leaf read back: float32 where it was stored in ``dtype``."""
    if dtype is None:
        return x
    if dtype.itemsize == 2 and x.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(x, dtype).astype(jnp.float32)
    return x.astype(jnp.float32) if x.dtype == dtype else x


def _stored(row, dtype):
    """``row`` as stored in a table of storage ``dtype``."""
    if dtype is not None and dtype.itemsize == 2 and any(
            x.dtype == jnp.uint16 for x in jax.tree.leaves(row)):
        raise H.FieldError("dtype", "a 16-bit storage type holds floats as uint16 bits, so a row "
                                    "cannot have uint16 leaves of its own; store it in float32")
    return jax.tree.map(lambda x: _encode(jnp.asarray(x), dtype), row)


def _shifted(rows, offset, sign: int):
    """``rows`` [K, ...] plus (``sign`` 1) or minus (-1) the drift ``offset``; a boolean
    leaf (a flag in a row) does not drift."""
    if rows.dtype == bool:
        return rows
    return rows + offset[None] if sign > 0 else rows - offset[None]


def _caught_up(stored, seen, initial, offset, dtype):
    """The rows a lazy-form table gathers: each stored deviation (``seen``) or the
    initial row (never written), plus the drift since round 0 (``offset``)."""
    def row(s, init, off):
        pick = jnp.where(seen.reshape(seen.shape + (1,) * init.ndim),
                         _decode(s, dtype).astype(init.dtype), init[None])
        return _shifted(pick, off, 1)
    return jax.tree.map(row, stored, initial, offset)


def _widened(rows, dtype):
    """Rows read from storage of ``dtype``: those leaves back to float32."""
    return jax.tree.map(lambda x: _decode(x, dtype), rows)


# ------------------------------------------------------------------------------ dense


class DenseTable(NamedTuple):
    rows: object  # pytree, leaves [N, ...]
    last_round: jax.Array  # int32 [N], -1 = never written


def dense(dtype=None) -> ClientTable:
    """Every client's row stored, leaves [N, ...] (floating leaves in ``dtype`` when
    given, e.g. ``jnp.bfloat16``; gathered as float32)."""
    dtype = _check_dtype(dtype)

    def init(row, num_clients: int) -> DenseTable:
        return DenseTable(init_table(_stored(row, dtype), num_clients),
                          jnp.full((num_clients,), -1, jnp.int32))

    def gather_(table: DenseTable, client_ids):
        return _widened(gather(table.rows, client_ids), dtype)

    def scatter_(table: DenseTable, client_ids, new_rows, client_mask, round_):
        n = table.last_round.shape[0]
        ids = _write_ids(client_ids, client_mask, n)
        last = table.last_round.at[ids].set(jnp.asarray(round_, jnp.int32), mode="drop")
        new_rows = jax.tree.map(lambda t, r: _encode(r, dtype).astype(t.dtype), table.rows,
                                new_rows)
        return DenseTable(scatter(table.rows, client_ids, new_rows, client_mask), last)

    def drift(table: DenseTable, delta) -> DenseTable:
        # delta is row-shaped: add it to every row with an explicit leading axis (an
        # implicit rank promotion fails under jax_numpy_rank_promotion="raise").
        rows = jax.tree.map(lambda t, d: _encode(_decode(t, dtype) + jnp.asarray(d)[None],
                                                 dtype).astype(t.dtype), table.rows, delta)
        return table._replace(rows=rows)

    def memory(table: DenseTable) -> dict:
        n = int(table.last_round.shape[0])
        row = tree_bytes(table.rows) // max(n, 1)
        return {"form": "dense", "num_clients": n, "rows_stored": n,
                "bytes_per_row": row, "bytes": tree_bytes(table)}

    return ClientTable(init, gather_, scatter_, drift, memory, _name("dense", None, dtype))


# ------------------------------------------------------------------------------- lazy


class LazyTable(NamedTuple):
    rows: object  # pytree, leaves [capacity, ...]: row - offset at the time of writing
    initial: object  # pytree: the row of a client never written (before drift)
    offset: object  # pytree: D, the drift accumulated since round 0
    slot: jax.Array  # int32 [N]: the client's slot, -1 = never written
    last_round: jax.Array  # int32 [N], -1 = never written
    used: jax.Array  # int32 []: slots allocated
    overflow: jax.Array  # bool []: a write found no free slot (and was dropped)


def lazy(capacity: Optional[int] = None, dtype=None) -> ClientTable:
    """Rows stored only for clients written so far, in ``capacity`` slots.

    ``capacity`` None: one slot per client (same memory as ``dense`` plus 8 N bytes,
    but no work for unwritten rows). A run that samples cohorts of K clients for R
    rounds needs at most min(N, K R) slots; ``fedjax_fair.drivers.runner.run`` refuses a smaller
    capacity before compute. A write past the capacity is dropped and sets
    ``overflow``, which the runner also turns into an error.

    ``dtype`` (e.g. ``jnp.bfloat16``): storage type of the slots' floating leaves; the
    initial row and the drift offset stay in the row's own precision.
    """
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                 or capacity < 1):
        raise H.FieldError("capacity", f"must be a positive integer or None, got {capacity!r}")
    dtype = _check_dtype(dtype)

    def init(row, num_clients: int) -> LazyTable:
        cap = num_clients if capacity is None else min(capacity, num_clients)
        row = jax.tree.map(jnp.asarray, row)
        return LazyTable(rows=jax.tree.map(lambda x: jnp.zeros((cap, *x.shape), x.dtype),
                                           _stored(row, dtype)),
                         initial=row, offset=jax.tree.map(jnp.zeros_like, row),
                         slot=jnp.full((num_clients,), -1, jnp.int32),
                         last_round=jnp.full((num_clients,), -1, jnp.int32),
                         used=jnp.zeros((), jnp.int32), overflow=jnp.zeros((), bool))

    def gather_(table: LazyTable, client_ids):
        slot = table.slot[client_ids]
        seen = slot >= 0
        stored = gather(table.rows, jnp.maximum(slot, 0))
        return _caught_up(stored, seen, table.initial, table.offset, dtype)

    def scatter_(table: LazyTable, client_ids, new_rows, client_mask, round_):
        n = table.slot.shape[0]
        cap = jax.tree.leaves(table.rows)[0].shape[0]
        client_mask = jnp.asarray(client_mask, bool)
        # A padded cohort may repeat a client id; only unmasked rows write, and a
        # client new to the table gets one fresh slot per unmasked occurrence order.
        first = _first_occurrence(client_ids, client_mask)
        is_new = client_mask & first & (table.slot[client_ids] < 0)
        fresh = table.used + jnp.cumsum(is_new, dtype=jnp.int32) - 1  # int32 under x64 too
        slot_of_new = jnp.where(is_new & (fresh < cap), fresh, -1)
        ids = _write_ids(client_ids, is_new & (slot_of_new >= 0), n)
        slot = table.slot.at[ids].set(slot_of_new, mode="drop")
        rows_slot = slot[client_ids]
        writable = client_mask & (rows_slot >= 0)
        targets = jnp.where(writable, rows_slot, cap)
        rows = jax.tree.map(lambda t, r, off: t.at[targets].set(
            _encode(_shifted(r, off, -1), dtype).astype(t.dtype), mode="drop"), table.rows, new_rows,
            table.offset)
        last = table.last_round.at[_write_ids(client_ids, writable, n)].set(
            jnp.asarray(round_, jnp.int32), mode="drop")
        overflow = table.overflow | jnp.any(client_mask & (rows_slot < 0))
        return table._replace(rows=rows, slot=slot, last_round=last,
                              used=jnp.minimum(table.used + jnp.sum(is_new, dtype=jnp.int32), cap),
                              overflow=overflow)

    def drift(table: LazyTable, delta) -> LazyTable:
        return table._replace(offset=jax.tree.map(lambda o, d: o + d.astype(o.dtype),
                                                  table.offset, delta))

    def memory(table: LazyTable) -> dict:
        cap = int(jax.tree.leaves(table.rows)[0].shape[0])
        return {"form": "lazy", "num_clients": int(table.slot.shape[0]),
                "capacity": cap, "rows_stored": int(table.used),
                "bytes_per_row": tree_bytes(table.rows) // max(cap, 1),
                "bytes": tree_bytes(table)}

    return ClientTable(init, gather_, scatter_, drift, memory,
                       _name("lazy", capacity, dtype), capacity)


# ----------------------------------------------------------------- host and disk


class HostTable(NamedTuple):
    """A client table whose rows live outside the device (``core/row_store.py``): on
    the device, only what every round reads whole."""

    initial: object  # pytree: the row of a client never written (before drift)
    offset: object  # pytree: D, the drift accumulated since round 0
    last_round: jax.Array  # int32 [N], -1 = never written
    store: jax.Array  # int32 []: the handle of the rows' RowStore
    version: jax.Array  # int32 []: the rows' version this state reads (row_store.py)


def host(capacity: Optional[int] = None, dtype=None) -> ClientTable:
    """Rows in host memory (``row_store.RowStore``), the cohort's rows read and written
    by the compiled round through host callbacks: the device holds a cohort of rows
    and two int32 [N] vectors. The same rows as ``lazy`` (rows stored as deviations
    from the common drift), for a federation whose table outgrows the device. A state
    can be continued once (no branches: ``runner.run`` and the CLI, not ``vmap`` over
    seeds or ``jax.grad``)."""
    return _outside("host", None, capacity, dtype)


def disk(directory: Optional[str] = None, capacity: Optional[int] = None,
         dtype=None) -> ClientTable:
    """``host`` with the rows in memory-mapped files, in a folder of their own made in
    ``directory`` (None: the system's temporary directory, ``$TMPDIR``) and removed
    with the rows: a table larger than the host's memory, paged by the kernel.
    Checkpoints keep their own copy of the rows (``runner.run``)."""
    return _outside("disk", "" if directory is None else str(directory), capacity, dtype)


def _outside(form: str, directory, capacity, dtype) -> ClientTable:
    from fedjax_fair.core import row_store
    from jax.experimental import io_callback
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                 or capacity < 1):
        raise H.FieldError("capacity", f"must be a positive integer or None, got {capacity!r}")
    dtype = _check_dtype(dtype)

    def init(row, num_clients: int) -> HostTable:
        row = jax.tree.map(jnp.asarray, row)
        stored = jax.tree.leaves(_stored(row, dtype))
        rows = row_store.RowStore([(x.shape, x.dtype) for x in stored], num_clients,
                                  capacity, directory)
        return HostTable(initial=row, offset=jax.tree.map(jnp.zeros_like, row),
                         last_round=jnp.full((num_clients,), -1, jnp.int32),
                         store=jnp.asarray(row_store.register(rows), jnp.int32),
                         version=jnp.zeros((), jnp.int32))

    def stored_shapes(table: HostTable, k: int):
        leaves, tree = jax.tree.flatten(_stored(table.initial, dtype))
        return [jax.ShapeDtypeStruct((k, *x.shape), x.dtype) for x in leaves], tree

    def gather_(table: HostTable, client_ids):
        client_ids = jnp.asarray(client_ids, jnp.int32)
        shapes, tree = stored_shapes(table, client_ids.shape[0])
        seen, leaves = io_callback(
            lambda h, ids, v: row_store.get(h).read(ids, v),
            (jax.ShapeDtypeStruct(client_ids.shape, bool), shapes),
            table.store, client_ids, table.version)
        return _caught_up(jax.tree.unflatten(tree, leaves), seen, table.initial, table.offset,
                          dtype)

    def scatter_(table: HostTable, client_ids, new_rows, client_mask, round_):
        client_ids = jnp.asarray(client_ids, jnp.int32)
        client_mask = jnp.broadcast_to(jnp.asarray(client_mask, bool), client_ids.shape)
        encoded = jax.tree.map(lambda r, off, init: _encode(
            _shifted(r, off, -1).astype(init.dtype), dtype), new_rows, table.offset, table.initial)
        version = io_callback(
            lambda h, ids, leaves, mask, v: row_store.get(h).write(ids, leaves, mask, v),
            jax.ShapeDtypeStruct((), jnp.int32), table.store, client_ids,
            jax.tree.leaves(encoded), client_mask, table.version)
        n = table.last_round.shape[0]
        last = table.last_round.at[_write_ids(client_ids, client_mask, n)].set(
            jnp.asarray(round_, jnp.int32), mode="drop")
        return table._replace(last_round=last, version=version)

    def drift(table: HostTable, delta) -> HostTable:
        return table._replace(offset=jax.tree.map(lambda o, d: o + d.astype(o.dtype),
                                                  table.offset, delta))

    def memory(table: HostTable) -> dict:
        held = row_store.get(table.store).memory()
        return {"form": form, "num_clients": int(table.last_round.shape[0]),
                **({"capacity": capacity} if capacity is not None else {}), **held,
                "bytes": tree_bytes(table)}

    return ClientTable(init, gather_, scatter_, drift, memory,
                       _name(form, capacity, dtype), capacity, where=form)


def outside_tables(state) -> list:
    """The ``HostTable`` nodes of a state (a method may keep more than one), in tree
    order."""
    return [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, HostTable))
            if isinstance(x, HostTable)]


DTYPES = {"bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "f16": jnp.float16,
          "float16": jnp.float16, "f32": jnp.float32, "float32": jnp.float32}


def _check_dtype(dtype):
    if dtype is None:
        return None
    try:
        dtype = jnp.dtype(DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise H.FieldError("dtype", f"the storage type of a client table must be a floating "
                                    f"type such as bf16 or float32, got {dtype!r}")
    return None if dtype == jnp.float32 else dtype


def _name(form: str, capacity, dtype) -> str:
    args = [str(a) for a in (capacity, None if dtype is None else jnp.dtype(dtype).name)
            if a is not None]
    return f"{form}({', '.join(args)})" if args else form


def _first_occurrence(client_ids, client_mask):
    """True on the first unmasked row of each distinct client id ([K])."""
    k = client_ids.shape[0]
    same = (client_ids[:, None] == client_ids[None, :]) & client_mask[None, :]
    earlier = jnp.tril(jnp.ones((k, k), bool), -1)
    return ~jnp.any(same & earlier, axis=1)


TABLES = {"dense": dense, "lazy": lazy, "host": host, "disk": disk}


def get_table(table) -> ClientTable:
    """A ``ClientTable`` from itself, or text: "dense", "lazy", "lazy:CAPACITY",
    "host", "host:CAPACITY", "disk", "disk:CAPACITY", each optionally followed by
    ":DTYPE" (storage precision, e.g. "dense:bf16", "lazy:500:bf16"). "disk" keeps
    its rows in a scratch folder of ``$TMPDIR`` (``disk(directory=...)`` for another)."""
    if isinstance(table, ClientTable):
        return table
    name, *args = str(table).split(":")
    dtype = args.pop() if args and args[-1] in DTYPES else None
    if name not in TABLES or len(args) > (name != "dense"):
        raise H.FieldError("client_table", f"must be dense, lazy, lazy:CAPACITY, host, "
                                           f"host:CAPACITY, disk or disk:CAPACITY (each "
                                           f"optionally with :bf16 or another storage type) or "
                                           f"a ClientTable, got {table!r}")
    if not args:
        return TABLES[name](dtype=dtype)
    try:
        return TABLES[name](capacity=int(args[0]), dtype=dtype)
    except ValueError:
        raise H.FieldError("client_table", f"the capacity of {name}:CAPACITY must be a positive "
                                           f"integer, got {table!r}") from None


def table_memory(table_fn: ClientTable, table) -> Optional[dict]:
    """``table_fn.memory(table)``, or None for a stateless method (table ``()``)."""
    if not jax.tree.leaves(table):
        return None
    return table_fn.memory(table)
