"""Rows of a client table outside the device (fedjax_fair/core/row_store.py): writes
and reads by version, the journal that answers reads of an older version and undoes a
chunk, the rows a checkpoint logs and replays, and the store on disk."""
from __future__ import annotations

import os

import numpy as np
import pytest

from fedjax_fair.core.row_store import RowStore

LEAVES = [((2,), np.float32), ((), np.int32)]


def _rows(values, ints):
    return [np.asarray(values, np.float32).reshape(-1, 2), np.asarray(ints, np.int32)]


def _store(directory=None, capacity=None) -> RowStore:
    return RowStore(LEAVES, num_clients=6, capacity=capacity, directory=directory)


def _read(store, ids, version):
    seen, (w, n) = store.read(np.asarray(ids), version)
    return seen.tolist(), w.tolist(), n.tolist()


@pytest.mark.parametrize("where", ["host", "disk"])
def test_writes_are_read_back_and_unwritten_clients_are_unseen(where, tmp_path):
    store = _store(str(tmp_path) if where == "disk" else None)
    assert _read(store, [0, 3], 0) == ([False, False], [[0, 0], [0, 0]], [0, 0])
    v = store.write([3, 1, 3], _rows([[1, 1], [2, 2], [3, 3]], [1, 2, 3]),
                    [True, True, False], 0)  # a masked repeat of client 3 never writes
    assert int(v) == 1
    assert _read(store, [1, 3, 4], 1) == ([True, True, False], [[2, 2], [1, 1], [0, 0]],
                                          [2, 1, 0])
    for i in range(40):  # the storage grows past its first reservation
        store.write([i % 6], _rows([[i, -i]], [i]), [True], 1 + i)
    assert _read(store, [5], 41) == ([True], [[35, -35]], [35])
    assert store.memory()["rows_stored"] == 6
    if where == "disk":
        assert os.listdir(tmp_path)  # its own folder, removed with the store
        store.close()
        assert not os.listdir(tmp_path)


def test_a_read_of_an_older_version_sees_the_rows_as_they_were():
    """The improvement log reads the "before" models after the round wrote: the
    journal answers with the rows of the version asked for."""
    store = _store()
    store.write([0, 1], _rows([[1, 1], [2, 2]], [1, 2]), [True, True], 0)
    store.settle()
    store.write([1, 2], _rows([[5, 5], [6, 6]], [5, 6]), [True, True], 1)
    store.write([1], _rows([[7, 7]], [7]), [True], 2)
    assert _read(store, [0, 1, 2], 3) == ([True, True, True], [[1, 1], [7, 7], [6, 6]],
                                          [1, 7, 6])
    assert _read(store, [1, 2, 1], 2) == ([True, True, True], [[5, 5], [6, 6], [5, 5]],
                                          [5, 6, 5])
    assert _read(store, [2, 1, 0], 1) == ([False, True, True], [[0, 0], [2, 2], [1, 1]],
                                          [0, 2, 1])
    with pytest.raises(RuntimeError):  # settled: version 0 is gone
        store.read(np.asarray([0]), 0)
    with pytest.raises(RuntimeError):  # a version the store has not reached
        store.read(np.asarray([0]), 4)


def test_rollback_undoes_a_chunk_and_a_state_is_continued_once():
    store = _store()
    store.write([0, 1], _rows([[1, 1], [2, 2]], [1, 2]), [True, True], 0)
    store.settle()
    store.write([1, 2], _rows([[5, 5], [6, 6]], [5, 6]), [True, True], 1)
    store.write([3, 1], _rows([[8, 8], [7, 7]], [8, 7]), [True, True], 2)
    store.rollback(1)
    assert store.version == 1 and store.memory()["rows_stored"] == 2
    assert _read(store, [0, 1, 2, 3], 1) == ([True, True, False, False],
                                             [[1, 1], [2, 2], [0, 0], [0, 0]], [1, 2, 0, 0])
    with pytest.raises(RuntimeError):  # a branch: version 0's state writes again
        store.write([0], _rows([[9, 9]], [9]), [True], 0)
    store.write([4], _rows([[4, 4]], [4]), [True], 1)  # the new slot reuses the freed one
    assert store.memory()["rows_stored"] == 3


def test_capacity_bounds_the_clients_written():
    store = _store(capacity=2)
    store.write([0, 1], _rows([[1, 1], [2, 2]], [1, 2]), [True, True], 0)
    with pytest.raises(RuntimeError):
        store.write([2], _rows([[3, 3]], [3]), [True], 1)


def test_the_dirty_rows_replay_into_a_fresh_store():
    """What a commit logs (``dirty``) and resume replays (``load``), segment by
    segment, gives the same rows; a rolled-back new client is not logged."""
    store = _store()
    store.write([0, 1], _rows([[1, 1], [2, 2]], [1, 2]), [True, True], 0)
    first = store.dirty()
    store.clean()
    store.settle()
    store.write([1, 4], _rows([[5, 5], [6, 6]], [5, 6]), [True, True], 1)
    store.settle()
    store.write([5], _rows([[9, 9]], [9]), [True], 2)
    store.rollback(2)
    second = store.dirty()
    assert second["client"].tolist() == [1, 4]
    fresh = _store()
    fresh.load(first)
    fresh.load(second)
    fresh.set_version(2)
    ids = list(range(6))
    assert _read(fresh, ids, 2) == _read(store, ids, 2)
