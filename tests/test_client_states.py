"""Per-client state tables (fedjax_fair/core/client_states.py): the dense and lazy forms,
and the host and disk forms (rows outside the device, core/row_store.py), which must
give the lazy form's rows to the bit.

Every table operation below runs under ``jax.jit`` (``_ops``), as it does inside
``compose``'s round. Rows are a small pytree with two float32 leaves of different
shapes and an int32 leaf, so dtypes and shapes are checked along with values.
"""
from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_fair.core import client_states as cs

N = 7  # clients in the federation
FORMS = {"dense": cs.dense, "lazy": cs.lazy, "host": cs.host, "disk": cs.disk}
OUTSIDE = ("host", "disk")


def _row(seed=None, lead=()):
    """A row pytree (or ``lead`` stacked rows) of random values; zeros-like shapes
    when ``seed`` is None."""
    rng = np.random.default_rng(seed)
    draw = (lambda *s: np.zeros(s, np.float32)) if seed is None else (
        lambda *s: rng.normal(size=s).astype(np.float32))
    return {"w": jnp.asarray(draw(*lead, 3, 2)), "b": jnp.asarray(draw(*lead, 2)),
            "n": jnp.asarray(rng.integers(-5, 5, size=lead) if seed is not None
                             else np.zeros(lead), jnp.int32)}


INITIAL = {"w": jnp.full((3, 2), 0.5, jnp.float32), "b": jnp.asarray([1.0, -2.0], jnp.float32),
           "n": jnp.asarray(7, jnp.int32)}
ROW_BYTES = (3 * 2 + 2) * 4 + 4  # float32 w and b, int32 n


@functools.cache
def _ops(form: str, capacity=None):
    """(ClientTable, jitted init, gather, scatter, drift) of one form."""
    table = FORMS[form]() if capacity is None else FORMS[form](capacity=capacity)
    # a host or disk table's init makes its store: called, not traced once and reused
    init = table.init if form in OUTSIDE else jax.jit(table.init, static_argnums=1)
    return (table, init, jax.jit(table.gather), jax.jit(table.scatter), jax.jit(table.drift))


def _np(tree):
    return jax.tree.map(np.asarray, tree)


def _row_of(rows, i):
    return jax.tree.map(lambda x: np.asarray(x)[i], rows)


def _assert_rows_equal(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        assert np.asarray(a).dtype == np.asarray(e).dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def _assert_rows_close(actual, expected, rtol=1e-6, atol=1e-6):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        assert np.asarray(a).dtype == np.asarray(e).dtype
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


def _all_rows(gather, table):
    return _np(gather(table, jnp.arange(N, dtype=jnp.int32)))


# --------------------------------------------------------------------------------------
# gather / scatter


@pytest.mark.parametrize("form", list(FORMS))
def test_init_gathers_the_initial_row_for_every_client(form):
    _, init, gather, _, _ = _ops(form)
    table = init(INITIAL, N)
    rows = _all_rows(gather, table)
    for i in range(N):
        _assert_rows_equal(_row_of(rows, i), _np(INITIAL))
    np.testing.assert_array_equal(table.last_round, np.full(N, -1))


@pytest.mark.parametrize("form", list(FORMS))
def test_scatter_then_gather_round_trips(form):
    _, init, gather, scatter, _ = _ops(form)
    table = init(INITIAL, N)
    ids = jnp.asarray([4, 0, 6], jnp.int32)
    new = _row(1, lead=(3,))
    table = scatter(table, ids, new, jnp.ones((3,), bool), 5)
    _assert_rows_equal(_np(gather(table, ids)), _np(new))
    # Any order, with repeats.
    got = _np(gather(table, jnp.asarray([6, 6, 4], jnp.int32)))
    _assert_rows_equal(got, jax.tree.map(lambda x: np.asarray(x)[[2, 2, 0]], new))
    # Second write of one client overwrites only its row.
    newer = _row(2, lead=(1,))
    table = scatter(table, jnp.asarray([0], jnp.int32), newer, jnp.ones((1,), bool), 9)
    rows = _all_rows(gather, table)
    _assert_rows_equal(_row_of(rows, 0), _row_of(_np(newer), 0))
    _assert_rows_equal(_row_of(rows, 4), _row_of(_np(new), 0))
    _assert_rows_equal(_row_of(rows, 6), _row_of(_np(new), 2))
    for i in (1, 2, 3, 5):
        _assert_rows_equal(_row_of(rows, i), _np(INITIAL))
    np.testing.assert_array_equal(table.last_round, [9, -1, -1, -1, 5, -1, 5])


@pytest.mark.parametrize("form", ["dense", "lazy"])
def test_masked_cohort_rows_never_write(form):
    """A padded cohort repeats client ids under a False mask: those rows carry other
    values and must not clobber the real row, whether they come before or after it."""
    _, init, gather, scatter, _ = _ops(form)
    table = init(INITIAL, N)
    ids = jnp.asarray([1, 3, 1, 1, 5, 3], jnp.int32)
    mask = jnp.asarray([False, True, True, False, False, False])
    new = _row(3, lead=(6,))
    table = scatter(table, ids, new, mask, 2)
    rows = _all_rows(gather, table)
    _assert_rows_equal(_row_of(rows, 1), _row_of(_np(new), 2))  # the unmasked occurrence
    _assert_rows_equal(_row_of(rows, 3), _row_of(_np(new), 1))
    _assert_rows_equal(_row_of(rows, 5), _np(INITIAL))  # only ever masked: never written
    np.testing.assert_array_equal(table.last_round, [-1, 2, -1, 2, -1, -1, -1])
    if form == "lazy":
        assert int(table.used) == 2  # masked rows take no slot
        assert np.asarray(table.slot)[5] == -1
        assert not bool(table.overflow)
    # An all-masked cohort changes nothing at all.
    again = scatter(table, ids, _row(4, lead=(6,)), jnp.zeros((6,), bool), 3)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(table)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_dense_rows_of_non_participants_are_unchanged():
    _, init, _, scatter, _ = _ops("dense")
    table = init(INITIAL, N)
    table = scatter(table, jnp.asarray([0, 1, 2, 3, 4, 5, 6], jnp.int32), _row(5, lead=(N,)),
                    jnp.ones((N,), bool), 0)
    before = _np(table.rows)
    ids = jnp.asarray([2, 5, 2], jnp.int32)
    table = scatter(table, ids, _row(6, lead=(3,)), jnp.asarray([True, True, False]), 1)
    after = _np(table.rows)
    untouched = [0, 1, 3, 4, 6]
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a[untouched], b[untouched])
        assert not np.array_equal(a[[2, 5]], b[[2, 5]])


def test_lazy_unwritten_clients_read_the_initial_row_and_store_nothing():
    _, init, gather, scatter, _ = _ops("lazy")
    table = init(INITIAL, N)
    table = scatter(table, jnp.asarray([6, 2], jnp.int32), _row(7, lead=(2,)),
                    jnp.ones((2,), bool), 0)
    assert int(table.used) == 2
    np.testing.assert_array_equal(np.asarray(table.slot) >= 0,
                                  [False, False, True, False, False, False, True])
    rows = _all_rows(gather, table)
    for i in (0, 1, 3, 4, 5):
        _assert_rows_equal(_row_of(rows, i), _np(INITIAL))


@pytest.mark.parametrize("form", list(FORMS))
def test_last_round_records_the_round_of_the_last_write(form):
    _, init, _, scatter, _ = _ops(form)
    table = init(INITIAL, N)
    expected = np.full(N, -1)
    rng = np.random.default_rng(0)
    for r in range(6):
        ids = rng.choice(N, size=3, replace=False)
        mask = rng.random(3) < 0.7
        table = scatter(table, jnp.asarray(ids, jnp.int32), _row(r, lead=(3,)),
                        jnp.asarray(mask), r)
        expected[ids[mask]] = r
        np.testing.assert_array_equal(table.last_round, expected)
    assert table.last_round.dtype == jnp.int32


# --------------------------------------------------------------------------------------
# drift


def _scaled(tree, s):
    return jax.tree.map(lambda x: (np.asarray(x) * s).astype(np.asarray(x).dtype), tree)


def test_dense_drift_adds_delta_to_every_row():
    _, init, gather, scatter, drift = _ops("dense")
    table = scatter(init(INITIAL, N), jnp.asarray([1, 4], jnp.int32), _row(8, lead=(2,)),
                    jnp.ones((2,), bool), 0)
    before = _all_rows(gather, table)
    delta = _row(9)
    after = _all_rows(gather, drift(table, delta))
    for i in range(N):
        expected = jax.tree.map(lambda a, d: a + np.asarray(d), _row_of(before, i), _np(delta))
        _assert_rows_equal(_row_of(after, i), expected)


def _random_run(form, rounds, with_drift, seed, capacity=None):
    """A random sequence of (drift, scatter of a random masked cohort, drift) on one
    form; returns the gathered rows of ALL clients and last_round after every round."""
    _, init, gather, scatter, drift = _ops(form, capacity)
    rng = np.random.default_rng(seed)
    table = init(INITIAL, N)
    history = []
    for r in range(rounds):
        if with_drift and rng.random() < 0.7:
            table = drift(table, _row(int(rng.integers(1 << 30))))
        k = 4
        ids = rng.integers(0, N, size=k)  # repeats allowed (a padded cohort)
        mask = rng.random(k) < 0.75
        # Repeated unmasked ids would make the written row ambiguous: mask all but one.
        for j in range(k):
            if mask[j] and np.any((ids[:j] == ids[j]) & mask[:j]):
                mask[j] = False
        table = scatter(table, jnp.asarray(ids, jnp.int32),
                        _row(int(rng.integers(1 << 30)), lead=(k,)), jnp.asarray(mask), r)
        if with_drift and rng.random() < 0.3:
            table = drift(table, _scaled(_row(int(rng.integers(1 << 30))), 0.5))
        history.append((_all_rows(gather, table), np.asarray(table.last_round)))
    return table, history


def test_lazy_matches_dense_exactly_without_drift():
    _, dense_hist = _random_run("dense", 30, False, seed=1)
    lazy_table, lazy_hist = _random_run("lazy", 30, False, seed=1)
    for (d_rows, d_last), (l_rows, l_last) in zip(dense_hist, lazy_hist):
        _assert_rows_equal(l_rows, d_rows)
        np.testing.assert_array_equal(l_last, d_last)
    assert not bool(lazy_table.overflow)


@pytest.mark.parametrize("form", OUTSIDE)
@pytest.mark.parametrize("seed", [1, 2])
def test_host_and_disk_tables_give_the_lazy_rows_to_the_bit(form, seed):
    """Rows outside the device are the lazy table's (deviations from the drift offset,
    caught up when gathered), every round, to the bit, with and without drift."""
    for with_drift in (False, True):
        _, lazy_hist = _random_run("lazy", 20, with_drift, seed=seed)
        table, hist = _random_run(form, 20, with_drift, seed=seed)
        for (l_rows, l_last), (h_rows, h_last) in zip(lazy_hist, hist):
            _assert_rows_equal(h_rows, l_rows)
            np.testing.assert_array_equal(h_last, l_last)
        report = FORMS[form]().memory(table)
        assert report["form"] == form and report["rows_stored"] == int((hist[-1][1] >= 0).sum())
        assert report["bytes"] < 1024  # the device holds no row


@pytest.mark.parametrize("seed", [2, 3])
def test_lazy_matches_dense_under_drift(seed):
    """Lazy stores deviations from the drift offset and catches a row up when it is
    gathered; every round, every client's row must equal the dense table's."""
    _, dense_hist = _random_run("dense", 30, True, seed=seed)
    _, lazy_hist = _random_run("lazy", 30, True, seed=seed)
    moved = False
    for r, ((d_rows, d_last), (l_rows, l_last)) in enumerate(zip(dense_hist, lazy_hist)):
        _assert_rows_close(l_rows, d_rows, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(l_last, d_last)
        moved |= not np.array_equal(d_rows["b"], dense_hist[0][0]["b"])
    assert moved
    # Drift reached the never-written rows as well (they are not the initial row).
    never = np.flatnonzero(dense_hist[-1][1] < 0)
    for i in never:
        assert not np.array_equal(_row_of(dense_hist[-1][0], i)["w"], np.asarray(INITIAL["w"]))


def test_lazy_gathered_row_after_drift_is_last_write_plus_drift_since():
    _, init, gather, scatter, drift = _ops("lazy")
    table = init(INITIAL, N)
    d1, d2, d3 = _row(11), _row(12), _row(13)
    new = _row(14, lead=(1,))
    table = drift(table, d1)
    table = scatter(table, jnp.asarray([3], jnp.int32), new, jnp.ones((1,), bool), 0)
    table = drift(drift(table, d2), d3)
    rows = _all_rows(gather, table)
    expected3 = jax.tree.map(lambda r, a, b: np.asarray(r)[0] + np.asarray(a) + np.asarray(b),
                             new, d2, d3)
    _assert_rows_close(_row_of(rows, 3), expected3)
    expected0 = jax.tree.map(lambda i, a, b, c: np.asarray(i) + np.asarray(a) + np.asarray(b)
                             + np.asarray(c), INITIAL, d1, d2, d3)
    _assert_rows_close(_row_of(rows, 0), expected0)


# --------------------------------------------------------------------------------------
# capacity, overflow, memory


def test_lazy_overflow_when_capacity_is_too_small():
    _, init, gather, scatter, _ = _ops("lazy", 3)
    table = init(INITIAL, N)
    first = _row(20, lead=(3,))
    table = scatter(table, jnp.asarray([5, 1, 0], jnp.int32), first, jnp.ones((3,), bool), 0)
    assert not bool(table.overflow)
    # Rewriting clients that hold a slot needs no new slot.
    table = scatter(table, jnp.asarray([1, 5, 1], jnp.int32), _row(21, lead=(3,)),
                    jnp.asarray([True, False, False]), 1)
    assert not bool(table.overflow) and int(table.used) == 3
    # A fourth distinct client finds no slot.
    table = scatter(table, jnp.asarray([2, 0], jnp.int32), _row(22, lead=(2,)),
                    jnp.ones((2,), bool), 2)
    assert bool(table.overflow)
    assert int(table.used) == 3
    rows = _all_rows(gather, table)
    _assert_rows_equal(_row_of(rows, 2), _np(INITIAL))  # its write was dropped
    assert np.asarray(table.last_round)[2] == -1
    _assert_rows_equal(_row_of(rows, 0), _row_of(_np(_row(22, lead=(2,))), 1))
    _assert_rows_equal(_row_of(rows, 5), _row_of(_np(first), 0))
    # Overflow is sticky.
    table = scatter(table, jnp.asarray([0], jnp.int32), _row(23, lead=(1,)),
                    jnp.ones((1,), bool), 3)
    assert bool(table.overflow)


def test_lazy_overflow_within_one_cohort():
    _, init, _, scatter, _ = _ops("lazy", 2)
    table = scatter(init(INITIAL, N), jnp.asarray([0, 1, 2], jnp.int32), _row(24, lead=(3,)),
                    jnp.ones((3,), bool), 0)
    assert bool(table.overflow)


def test_lazy_repeated_new_client_takes_one_slot():
    """A new client appearing twice unmasked in one cohort gets a single slot."""
    same = {"w": jnp.ones((2, 3, 2)), "b": jnp.ones((2, 2)), "n": jnp.ones((2,), jnp.int32)}
    for capacity in (None, 1):
        _, init, gather, scatter, _ = _ops("lazy", capacity)
        table = scatter(init(INITIAL, N), jnp.asarray([3, 3], jnp.int32), same,
                        jnp.ones((2,), bool), 0)
        assert not bool(table.overflow)
        assert int(table.used) == 1
        _assert_rows_equal(_row_of(_all_rows(gather, table), 3), _row_of(_np(same), 0))


def test_lazy_capacity_that_suffices_never_overflows():
    """Capacity 4 for 4 distinct clients written over many rounds (with repeats and
    masked padding of other ids), matching the dense table."""
    _, init, gather, scatter, _ = _ops("lazy", 4)
    _, dinit, dgather, dscatter, _ = _ops("dense")
    table, dtable = init(INITIAL, N), dinit(INITIAL, N)
    rng = np.random.default_rng(5)
    pool = np.asarray([6, 2, 3, 0])
    for r in range(10):
        ids = rng.choice(pool, size=3, replace=False)
        ids = np.concatenate([ids, [1]])  # client 1 only ever appears masked
        mask = np.asarray([True, rng.random() < 0.5, True, False])
        new = _row(100 + r, lead=(4,))
        table = scatter(table, jnp.asarray(ids, jnp.int32), new, jnp.asarray(mask), r)
        dtable = dscatter(dtable, jnp.asarray(ids, jnp.int32), new, jnp.asarray(mask), r)
    assert not bool(table.overflow)
    assert int(table.used) == 4
    _assert_rows_equal(_all_rows(gather, table), _all_rows(dgather, dtable))


def test_memory_reports_match_a_hand_computation():
    dense, dinit = _ops("dense")[:2]
    report = dense.memory(dinit(INITIAL, N))
    assert report["form"] == "dense"
    assert report["num_clients"] == N and report["rows_stored"] == N
    assert report["bytes_per_row"] == ROW_BYTES == 36
    assert report["bytes"] == N * ROW_BYTES + 4 * N  # rows + int32 last_round

    for capacity, cap in ((None, N), (3, 3), (50, N)):
        lazy, linit, _, lscatter, _ = _ops("lazy", capacity)
        table = linit(INITIAL, N)
        report = lazy.memory(table)
        assert report["form"] == "lazy"
        assert report["num_clients"] == N and report["capacity"] == cap
        assert report["rows_stored"] == 0
        assert report["bytes_per_row"] == ROW_BYTES
        # slots + initial row + drift offset + int32 slot and last_round [N]
        # + int32 used + bool overflow.
        assert report["bytes"] == cap * ROW_BYTES + 2 * ROW_BYTES + 8 * N + 4 + 1
        table = lscatter(table, jnp.asarray([4, 1], jnp.int32), _row(30, lead=(2,)),
                         jnp.ones((2,), bool), 0)
        assert lazy.memory(table)["rows_stored"] == 2
    assert cs.table_memory(cs.dense(), ()) is None


@pytest.mark.parametrize("capacity", [0, -3, 2.5, True])
def test_lazy_rejects_a_capacity_that_is_not_a_positive_integer(capacity):
    with pytest.raises(ValueError):
        cs.lazy(capacity)


def test_get_table_resolves_names_and_rejects_unknown_ones():
    assert cs.get_table("dense").name == "dense"
    assert cs.get_table("lazy").name == "lazy"
    assert cs.get_table("lazy:7").name == "lazy(7)"
    table = cs.lazy(5)
    assert cs.get_table(table) is table
    assert cs.get_table("host").where == "host" and cs.get_table("disk:9").name == "disk(9)"
    assert cs.get_table("host:bf16").name == "host(bfloat16)"
    for bad in ("sparse", "lazy:0", "lazy:x", "dense:3", "host:0", "disk:x"):
        with pytest.raises(ValueError):
            cs.get_table(bad)


def test_tables_work_inside_one_jitted_round():
    """init, gather, drift and scatter composed in one jitted function (as in a
    ``lax.scan`` over rounds), for both forms, give the same rows."""

    def rounds(form):
        table_fn = FORMS[form]()

        @jax.jit
        def run(ids, new_rows, masks, deltas):
            def body(table, xs):
                i, r, m, d, t = xs
                old = table_fn.gather(table, i)
                table = table_fn.drift(table, d)
                table = table_fn.scatter(table, i, jax.tree.map(jnp.add, old, r), m, t)
                return table, table_fn.gather(table, jnp.arange(N))
            return jax.lax.scan(body, table_fn.init(INITIAL, N),
                                (ids, new_rows, masks, deltas, jnp.arange(ids.shape[0])))

        rng = np.random.default_rng(7)
        r = 8
        ids = jnp.asarray(np.stack([rng.choice(N, 3, replace=False) for _ in range(r)]),
                          jnp.int32)
        masks = jnp.asarray(rng.random((r, 3)) < 0.8)
        return run(ids, _row(40, lead=(r, 3)), masks, _row(41, lead=(r,)))

    dense_table, dense_rows = rounds("dense")
    lazy_table, lazy_rows = rounds("lazy")
    _assert_rows_close(_np(lazy_rows), _np(dense_rows), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(lazy_table.last_round, dense_table.last_round)
    for form in OUTSIDE:  # the rows read and written by host callbacks inside the scan
        table, rows = rounds(form)
        _assert_rows_equal(_np(rows), _np(lazy_rows))
        np.testing.assert_array_equal(table.last_round, lazy_table.last_round)


# Plain stacked-row helpers (gather / scatter of a pytree with a leading client axis).


def test_client_table_gather_scatter():
    row = {"a": jnp.zeros((2,), jnp.float32), "b": jnp.zeros((), jnp.int32)}
    start = {"a": jnp.asarray(np.repeat(np.arange(5.0, dtype=np.float32)[:, None], 2, 1)),
             "b": jnp.arange(5, dtype=jnp.int32)}
    rows = {"a": jnp.asarray(100.0 + np.repeat(np.arange(4.0, dtype=np.float32)[:, None], 2, 1)),
            "b": jnp.array([10, 30, 11, 40], jnp.int32)}

    @jax.jit
    def run(start, rows):
        table = cs.init_table(row, 5)
        fresh = table
        table = jax.tree.map(jnp.add, table, start)
        ids = jnp.array([1, 3, 1, 4], jnp.int32)
        got = cs.gather(table, ids)
        # Slot 2 repeats client 1 but is masked; slot 3 (client 4) is masked.
        new = cs.scatter(table, ids, rows, jnp.array([True, True, False, False]))
        # A masked duplicate placed BEFORE the real write must not clobber it either.
        dup = cs.scatter(table, jnp.array([2, 2]),
                        jax.tree.map(lambda r: r[2:], rows), jnp.array([False, True]))
        none = cs.scatter(table, ids, rows, jnp.zeros((4,), bool))
        return fresh, table, got, new, dup, none

    fresh, table, got, new, dup, none = run(start, rows)
    assert fresh["a"].shape == (5, 2) and fresh["b"].shape == (5,)
    np.testing.assert_array_equal(got["b"], [1, 3, 1, 4])
    np.testing.assert_array_equal(new["b"], [0, 10, 2, 30, 4])
    np.testing.assert_array_equal(new["a"], [[0, 0], [100, 100], [2, 2], [101, 101], [4, 4]])
    np.testing.assert_array_equal(dup["b"], [0, 1, 40, 3, 4])
    chex.assert_trees_all_equal(none, table)


# ------------------------------------------------------------------ storage precision


def test_get_table_parses_a_storage_type():
    assert cs.get_table("dense:bf16").name == "dense(bfloat16)"
    assert cs.get_table("lazy:bf16").name == "lazy(bfloat16)"
    assert cs.get_table("lazy:7:bf16").name == "lazy(7, bfloat16)"
    assert cs.get_table("lazy:7:f32").name == "lazy(7)"  # float32 is the default
    for bad in ("dense:bf17", "dense:3:bf16", "lazy:bf16:7", "lazy:int8"):
        with pytest.raises(ValueError):
            cs.get_table(bad)
    with pytest.raises(ValueError):
        cs.dense(dtype=jnp.int32)


@pytest.mark.parametrize("form", ["dense", "lazy"])
def test_bf16_storage_keeps_float32_rows_out_and_int_leaves_exact(form):
    table_fn = cs.get_table(f"{form}:bf16")
    table = table_fn.init(INITIAL, N)
    stored = table.rows
    # bfloat16 values held as their 16 bits (an integer scatter on every backend)
    assert stored["w"].dtype == jnp.uint16 and stored["n"].dtype == jnp.int32
    if form == "dense":  # every row starts as the initial one (lazy: empty slots)
        np.testing.assert_array_equal(
            jax.lax.bitcast_convert_type(stored["w"][0], jnp.bfloat16).astype(jnp.float32),
            INITIAL["w"])
    with pytest.raises(ValueError, match="dtype"):
        table_fn.init({"u": jnp.zeros((2,), jnp.uint16)}, N)
    ids = jnp.asarray([2, 5], jnp.int32)
    new = _row(3, lead=(2,))
    table = table_fn.scatter(table, ids, new, jnp.ones((2,), bool), 0)
    got = table_fn.gather(table, ids)
    assert got["w"].dtype == jnp.float32
    np.testing.assert_array_equal(got["n"], new["n"])
    np.testing.assert_allclose(got["w"], new["w"], rtol=2 ** -8)  # one bf16 rounding


def test_lazy_bf16_rounds_each_deviation_once_while_dense_bf16_rerounds_every_drift():
    """Many small drifts (A-FedPD's virtual update every round): the lazy form keeps
    the drift in float32 and the stored deviation untouched, the dense form adds the
    drift to bf16 rows and rounds them again every time."""
    exact, lazy_fn, dense_fn = cs.dense(), cs.get_table("lazy:bf16"), cs.get_table("dense:bf16")
    row = {"w": jnp.asarray([[100.0, -3.0]])}
    tables = [f.init(row, 2) for f in (exact, lazy_fn, dense_fn)]
    delta = {"w": jnp.asarray([[1e-3, 1e-3]])}
    for _ in range(200):
        tables = [f.drift(t, delta) for f, t in zip((exact, lazy_fn, dense_fn), tables)]
    rows = [np.asarray(f.gather(t, jnp.asarray([0]))["w"], np.float64)
            for f, t in zip((exact, lazy_fn, dense_fn), tables)]
    want = np.asarray([[100.0, -3.0]]) + 200 * 1e-3
    f32_err, lazy_err, dense_err = (np.abs(r - want).max() for r in rows)
    assert lazy_err < 1e-5 < f32_err  # one float32 add (even better than 200 of them)
    assert dense_err > 0.1  # 100 + 1e-3 rounds back to 100 in bf16: the drift is lost
