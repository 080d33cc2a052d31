"""The rows of a client table held outside the device: in host memory or on disk.

``client_states.host()`` / ``client_states.disk()`` keep a method's per-client rows
(SCAFFOLD's c_i, Ditto's personal models, ...) here, in a ``RowStore``, and only the
cohort's rows visit the device: the compiled round reads them with a host callback
(``jax.experimental.io_callback``) before the clients train and writes the new rows
back after. A table of a million clients then costs the device a cohort of rows and
two int32 [N] vectors, and the host (or the disk) the rows of the clients written so
far.

Rows are kept one slot per client written, allocated in the order of first write;
the store grows by doubling (host memory: NumPy arrays; disk: one raw file per leaf,
memory-mapped, in a scratch folder removed with the store).

**Versions.** A callback runs when XLA schedules it, not in program order. Every write
carries the table's version (an int32 in the table's device state) and returns the
next, so a write happens after the reads that produced its rows and before any read
of the state it produces (data dependence). A read carries the version of the state it
reads. A write puts its rows in fresh slots and journals the slots they replace,
which keep the old rows until ``settle`` frees them (no row is copied to keep it): a
read of an older version than the store's (the improvement log's "before" models,
read after the round wrote) reads those slots, and ``rollback`` undoes a chunk whose
rounds were not finite by pointing its clients back at them, so a diverging run keeps
its last good rows. A chunk therefore needs room for the rows it rewrites besides the
table's. A state's rows can be written once: writing from a state older than the
store's newest (a branch) raises.

**Checkpoints.** ``dirty()`` gives the clients written since the last ``clean()`` with
their rows, which the runner appends to the checkpoint as a log segment per commit;
``load`` replays those segments into a fresh store on resume.
"""
from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
import weakref
from typing import Optional

import numpy as np

_STORES: dict = {}  # handle -> RowStore (the handle is an int32 leaf of the table state)
_HANDLES = itertools.count(1)
_LOCK = threading.Lock()


def register(store: "RowStore") -> int:
    """A new handle for ``store`` (what the device state holds)."""
    with _LOCK:
        handle = next(_HANDLES)
        _STORES[handle] = store
    return handle


def get(handle) -> "RowStore":
    store = _STORES.get(int(handle))
    if store is None:
        raise RuntimeError(f"client table: host rows {int(handle)} are not in this process "
                           f"(a state restored without its rows; runner.run restores them "
                           f"from the checkpoint)")
    return store


def release(handle) -> None:
    """Frees the store of ``handle`` (its rows, its scratch folder)."""
    store = _STORES.pop(int(handle), None)
    if store is not None:
        store.close()


_PREFIX = "fedjax-fair-rows-"  # + the process id + a unique suffix
_IN_MEMORY = 64 << 20  # a disk store's dirty rows up to this size are gathered in memory


def _remove_orphans(parent: str) -> None:
    """Removes the folders of stores whose process is gone (a killed run's)."""
    for name in os.listdir(parent):
        pid = name[len(_PREFIX):].split("-")[0]
        if not name.startswith(_PREFIX) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        except PermissionError:  # another user's process
            pass


def _copy_rows(dst, dst_rows, src, src_rows, block_bytes: int = 4 << 20) -> None:
    """``dst[dst_rows] = src[src_rows]`` about ``block_bytes`` at a time: no temporary
    copy of every row (``np.take(..., out=)`` and a whole fancy index measured 2-15x
    slower for rows of 0.8 MB)."""
    row = max(1, dst[0:1].nbytes)
    block = max(1, block_bytes // row)
    for i in range(0, len(dst_rows), block):
        dst[dst_rows[i:i + block]] = src[src_rows[i:i + block]]


class _Rows:
    """Growable storage of rows of one leaf: ``[capacity, *shape]``, in memory or in a
    memory-mapped raw file ``path`` (grown with ``ftruncate``: unwritten pages cost
    nothing)."""

    def __init__(self, shape: tuple, dtype, path=None):
        # path: None (host memory) or () -> the file's path (made at the first row)
        self.shape, self.dtype, self.path = tuple(shape), np.dtype(dtype), path
        self.data = np.zeros((0, *self.shape), self.dtype)

    def reserve(self, rows: int) -> None:
        have = self.data.shape[0]
        if rows <= have:
            return
        size = max(rows, 2 * have, 16)
        if self.path is None:
            grown = np.zeros((size, *self.shape), self.dtype)
            grown[:have] = self.data
            self.data = grown
            return
        if not isinstance(self.path, str):
            self.path = self.path()
        with open(self.path, "ab") as f:
            f.truncate(size * int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize)
        self.data = np.memmap(self.path, self.dtype, "r+", shape=(size, *self.shape))

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class RowStore:
    """Rows of a client table outside the device (module doc). ``leaves``: the (shape,
    dtype) of each leaf of one stored row; ``capacity``: the most clients it may hold
    (None: every one); ``directory``: None (host memory), or the folder in which the
    store makes a scratch folder of its own for its memory-mapped files at its first
    row, removed with the store ("": the system's temporary directory, ``$TMPDIR``)."""

    def __init__(self, leaves: list, num_clients: int, capacity: Optional[int] = None,
                 directory: Optional[str] = None):
        self.num_clients = int(num_clients)
        self.capacity = self.num_clients if capacity is None else min(capacity, num_clients)
        self.disk = directory is not None
        self.parent = (directory or tempfile.gettempdir()) if self.disk else None
        self.directory = None  # the store's own folder, made at the first row
        self.rows = [_Rows(s, d, self._path(f"leaf_{i:03d}.raw"))
                     for i, (s, d) in enumerate(leaves)]
        self._slot = None  # int64 [N] once a row is read or written: the client's slot
        self.used = 0  # clients with a row
        self._top = 0  # slots ever handed out (the storage's high-water mark)
        self._free: list = []  # slots to hand out again
        self.version = 0
        # the journal: per write since the last settle, (version, clients, their slots
        # before it (-1: none)); a write puts its rows in fresh slots, so the old ones
        # hold the rows as they were until ``settle`` frees them
        self._journal: list = []
        self._settled = 0  # the oldest version the journal can answer
        self._dirty: set = set()
        self._lock = threading.Lock()
        self._buffers = threading.local()  # ``_scratch``'s, per thread

    def _path(self, name: str):
        """``() -> path`` of a file of the store on disk (None in host memory); a scratch
        folder is made at the first call."""
        if not self.disk:
            return None

        def path():
            if self.directory is None:  # made now, removed with the store
                os.makedirs(self.parent, exist_ok=True)
                _remove_orphans(self.parent)
                self.directory = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-",
                                                  dir=self.parent)
                weakref.finalize(self, shutil.rmtree, self.directory, True)
            return os.path.join(self.directory, name)
        return path

    @property
    def slot(self) -> np.ndarray:
        if self._slot is None:
            self._slot = np.full(self.num_clients, -1, np.int64)
        return self._slot

    # --------------------------------------------------------------- the callbacks

    def read(self, client_ids, version) -> tuple:
        """``(seen [K] bool, leaves [K, ...])`` of ``client_ids`` as they were at
        ``version`` (unwritten clients: seen False, rows zero)."""
        ids = np.asarray(client_ids, np.int64)
        version = int(version)
        with self._lock:
            if version > self.version or version < self._settled:
                raise RuntimeError(f"client table: rows of version {version} are not held "
                                   f"(the store holds {self._settled}..{self.version})")
            slot = self.slot[ids]
            if version < self.version:
                slot = self._as_of(ids, version, slot)
            seen = slot >= 0
            take = np.where(seen, slot, 0)
            out = [self._scratch(i, len(ids)) for i in range(len(self.rows))]
            for r, leaf in zip(self.rows, out):
                if r.data.shape[0]:
                    _copy_rows(leaf, np.arange(len(take)), r.data, take)
        for leaf in out:
            leaf[~seen] = 0
        return seen, out

    def _scratch(self, leaf: int, k: int) -> np.ndarray:
        """This thread's buffer for ``k`` rows of leaf ``leaf``, reused from read to read
        (XLA copies a callback's result out before the next call): a fresh array of a
        cohort's rows a round would be taken from the system every time."""
        held = self._buffers.__dict__.setdefault("rows", {})
        r = self.rows[leaf]
        if leaf not in held or held[leaf].shape[0] != k:
            held[leaf] = np.zeros((k, *r.shape), r.dtype)
        return held[leaf]

    def write(self, client_ids, leaves, mask, version):
        """Writes the rows of the unmasked ``client_ids`` (the last of a repeated id)
        and returns the next version."""
        version = int(version)
        ids = np.asarray(client_ids, np.int64)
        mask = np.asarray(mask, bool)
        with self._lock:
            if version != self.version:
                raise RuntimeError(f"client table: a state of version {version} writes to "
                                   f"rows at version {self.version}; a state with host rows "
                                   f"can be continued once (no branches)")
            # the last unmasked occurrence of each client
            order = np.nonzero(mask)[0][::-1]
            clients, first = np.unique(ids[order], return_index=True)
            rows_at = order[first]
            old = self.slot[clients]
            new = int((old < 0).sum())
            if self.used + new > self.capacity:
                raise RuntimeError(f"client table: more than its capacity of {self.capacity} "
                                   f"clients written")
            slot = self._take(len(clients))
            self._journal.append((version, clients, old))
            self.used += new
            self.slot[clients] = slot
            for r, leaf in zip(self.rows, leaves):
                _copy_rows(r.data, slot, np.asarray(leaf), rows_at)
            self._dirty.update(clients.tolist())
            self.version = version + 1
        return np.asarray(self.version, np.int32)

    # ------------------------------------------------------------------- journal

    def _take(self, n: int) -> np.ndarray:
        """``n`` free slots (freed ones first), the storage grown to hold them."""
        reuse = [self._free.pop() for _ in range(min(n, len(self._free)))]
        fresh = np.arange(self._top, self._top + n - len(reuse))
        self._top += len(fresh)
        for r in self.rows:
            r.reserve(self._top)
        return np.concatenate([np.asarray(reuse, np.int64), fresh]).astype(np.int64)

    def _as_of(self, ids, version: int, slot) -> np.ndarray:
        """The slots of ``ids`` at ``version`` (``slot``: now): the oldest journal entry
        at or after it holds the slot each had then (its row is still there)."""
        later = [e for e in self._journal if e[0] >= version]
        if not later:
            return slot
        clients = np.concatenate([e[1] for e in later])
        before = np.concatenate([e[2] for e in later])
        first, where = np.unique(clients, return_index=True)  # oldest entry per client
        pos = np.minimum(np.searchsorted(first, ids), len(first) - 1)
        hit = first[pos] == ids
        return np.where(hit, before[where[pos]], slot)

    def expect(self, rows: int, journal: int) -> None:
        """Reserves room for ``rows`` rows and ``journal`` rows rewritten in a chunk (the
        run's bill: ``runner.check_outside``), so the store never grows by copying.
        Host memory is taken from the system as rows are first written; a file is
        sparse until then."""
        with self._lock:
            for r in self.rows:
                r.reserve(min(rows, self.capacity) + journal)

    def settle(self) -> None:
        """Forgets the journal, freeing the slots of the rows it kept: the rows as they
        are now are the oldest a read asks for."""
        with self._lock:
            for _, _, old in self._journal:
                self._free.extend(old[old >= 0].tolist())
            self._journal, self._settled = [], self.version

    def rollback(self, version: int) -> None:
        """Undoes every write at or after ``version`` (a chunk that was not finite)."""
        with self._lock:
            if version < self._settled:
                raise RuntimeError(f"client table: cannot roll back to version {version}, "
                                   f"settled at {self._settled}")
            while self._journal and self._journal[-1][0] >= version:
                _, clients, old = self._journal.pop()
                self._free.extend(self.slot[clients].tolist())
                self.slot[clients] = old
                self.used -= int((old < 0).sum())
            self.version = min(self.version, version)

    # --------------------------------------------------------------- checkpoints

    def dirty(self) -> dict:
        """``{"client": ids [n], "leaf_000": rows [n, ...], ...}`` of the clients written
        since the last ``clean`` (rows as stored), clients without a row left out. On
        disk, rows past ``_IN_MEMORY`` bytes are gathered into a memory-mapped file of
        the store's folder (a checkpoint streams them from there)."""
        with self._lock:
            ids = np.asarray(sorted(c for c in self._dirty if self.slot[c] >= 0), np.int64)
            slot = self.slot[ids]
            return {"client": ids.astype(np.int32),
                    **{f"leaf_{i:03d}": self._gathered(i, r, slot)
                       for i, r in enumerate(self.rows)}}

    def _gathered(self, i: int, rows: _Rows, slot) -> np.ndarray:
        if not self.disk or len(slot) * self.row_bytes <= _IN_MEMORY:
            return np.asarray(rows.data[slot])
        out = np.memmap(os.path.join(self.directory, f"dirty_{i:03d}.raw"), rows.dtype, "w+",
                        shape=(len(slot), *rows.shape))
        for start in range(0, len(slot), 1024):
            out[start:start + 1024] = rows.data[slot[start:start + 1024]]
        return out

    def clean(self) -> None:
        with self._lock:
            self._dirty = set()

    def load(self, segment: dict) -> None:
        """Replays a ``dirty()`` segment (resume): its rows overwrite, no journal."""
        ids = np.asarray(segment["client"], np.int64)
        with self._lock:
            slot = self.slot[ids]
            new = slot < 0
            slot[new] = self._take(int(new.sum()))
            self.used += int(new.sum())
            self.slot[ids] = slot
            for i, r in enumerate(self.rows):
                _copy_rows(r.data, slot, np.asarray(segment[f"leaf_{i:03d}"]),
                           np.arange(len(slot)))

    def set_version(self, version: int) -> None:
        with self._lock:
            self.version = self._settled = int(version)

    # -------------------------------------------------------------------- memory

    @property
    def row_bytes(self) -> int:
        return sum(int(np.prod(r.shape, dtype=np.int64)) * r.dtype.itemsize for r in self.rows)

    def memory(self) -> dict:
        return {"rows_stored": int(self.used), "bytes_per_row": self.row_bytes,
                "bytes_reserved": sum(r.nbytes for r in self.rows),
                "where": "disk" if self.disk else "host"}

    def close(self) -> None:
        self.rows = []
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
