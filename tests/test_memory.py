"""Large federations: size buckets, the memory plan, streamed (host) placement."""
from __future__ import annotations

import functools
import os

import jax
import numpy as np
import pytest

import helpers
from fedjax_fair.core import memory as mem
from fedjax_fair.algorithms import fedavg
from fedjax_fair.data import padding_report
from fedjax_fair.drivers.runner import run
from fedjax_fair.drivers.simulate import gather_cohorts, sample_client_ids
from fedjax_fair.core.types import FederatedData
from fedjax_fair.core.client import ClientTraining

# A skewed federation: one big client, many small ones, one empty.
SKEWED_TRAIN = (1, 3, 4, 5, 40, 0, 2, 2)
SKEWED_TEST = (1, 1, 2, 2, 8, 0, 1, 1)


def _skewed():
    train = helpers.pack(helpers.client_arrays(SKEWED_TRAIN, seed=0))
    test = helpers.pack(helpers.client_arrays(SKEWED_TEST, seed=1))
    return FederatedData(train=jax.tree.map(np.asarray, train),
                         test=jax.tree.map(np.asarray, test))


def test_size_bucket_is_the_next_power_of_two_capped_at_m():
    assert [mem.size_bucket(n, 40) for n in (0, 1, 2, 3, 4, 5, 17, 32, 33, 40)] == \
        [1, 1, 2, 4, 4, 8, 32, 32, 40, 40]


def test_bucket_report_matches_a_hand_count():
    report = mem.bucket_report(SKEWED_TRAIN)
    # Hand count. Real rows: 1+3+4+5+40+0+2+2 = 57. One block: 8 clients x 40 = 320.
    # Buckets: {0, 1} -> bound 1 (2 slots), {2, 2} -> 2 (4), {3, 4} -> 4 (8),
    # {5} -> 8 (8), {40} -> 40 (64 capped at M = 40): 2 + 4 + 8 + 8 + 40 = 62 slots.
    assert report["num_examples"] == 57
    assert report["block_slots"] == 320
    assert report["bucketed_slots"] == 62
    assert report["block_padding_fraction"] == pytest.approx(1 - 57 / 320)
    assert report["bucketed_padding_fraction"] == pytest.approx(1 - 57 / 62)
    assert report["buckets"] == [
        {"bound": 1, "clients": 2, "num_examples": 1, "slots": 2},
        {"bound": 2, "clients": 2, "num_examples": 4, "slots": 4},
        {"bound": 4, "clients": 2, "num_examples": 7, "slots": 8},
        {"bound": 8, "clients": 1, "num_examples": 5, "slots": 8},
        {"bound": 40, "clients": 1, "num_examples": 40, "slots": 40},
    ]


def test_padding_report_bytes_match_a_hand_count():
    report = padding_report(_skewed().train)
    n, m, d = 8, 40, helpers.NUM_FEATURES
    # x float32 [N, M, d] + y int32 [N, M] + mask bool [N, M] + num_examples int32 [N]
    assert report["bytes"] == n * m * d * 4 + n * m * 4 + n * m * 1 + n * 4
    assert report["padding_fraction"] == pytest.approx(1 - 57 / 320)
    assert mem.tree_bytes(_skewed().train) == report["bytes"]


def test_gather_cohorts_cuts_padding_and_keeps_every_real_row():
    train = _skewed().train
    ids = np.array([[0, 3], [6, 1]])
    cohorts = gather_cohorts(train, ids, None, padded_size=8)
    assert cohorts.data.examples["x"].shape == (2, 2, 8, helpers.NUM_FEATURES)
    for r in range(2):
        for j in range(2):
            k, n = ids[r, j], SKEWED_TRAIN[ids[r, j]]
            np.testing.assert_array_equal(cohorts.data.examples["x"][r, j, :n],
                                          train.examples["x"][k, :n])
            assert cohorts.data.num_examples[r, j] == n
            assert cohorts.data.mask[r, j].sum() == n
    with pytest.raises(ValueError, match="padded_size"):
        gather_cohorts(train, np.array([[4]]), None, padded_size=8)  # client 4 has 40


def test_sampled_ids_are_the_cohorts_simulate_draws():
    key = jax.random.key(3)
    ids = sample_client_ids(key, 5, 3, 8, 4)
    from fedjax_fair.drivers.simulate import round_keys
    from fedjax_fair.scenarios.sampling import uniform
    for r in range(3):
        np.testing.assert_array_equal(ids[r], uniform(round_keys(key, 5 + r)[0], 8, 4))


@functools.lru_cache(maxsize=None)
def _logged_run(placement):
    """(result, log lines) of runs shared by several tests (same arguments, same result)."""
    lines = []
    return _run(placement, log=lines.append), lines


def _plain_run(placement):
    return _logged_run(placement)[0]


@functools.lru_cache(maxsize=None)
def _alg():  # one algorithm object: runs of the same placement reuse its programs
    model = helpers.logreg()
    return model, fedavg(model, training=ClientTraining(lr=0.1, batch_size=2, num_epochs=1))


def _run(placement, memory_limit=None, **kwargs):
    model, alg = _alg()
    return run(alg, helpers.init_params(model), _skewed(), jax.random.key(0), model=model,
               num_rounds=4, cohort_size=3, eval_every=2, progress=False,
               placement=placement, memory_limit=memory_limit, **kwargs)


def test_streamed_run_matches_the_resident_run():
    (device, device_log), (host, host_log) = _logged_run("device"), _logged_run("host")
    lines = device_log + host_log
    assert host.memory.placement == "host"
    helpers.assert_trees_close(host.state.params, device.state.params, rtol=1e-5, atol=1e-6)
    for name in ("accuracy", "loss", "num_examples"):
        np.testing.assert_allclose(host.client_metrics[name], device.client_metrics[name],
                                   rtol=1e-5, atol=1e-6)
    assert lines[0].startswith("memory: ") and "on the device" in lines[0]
    assert "streamed" in lines[1]


def test_auto_placement_streams_when_the_federation_does_not_fit():
    # without the next chunk's cohorts (prefetch), which outweigh this tiny federation
    device, host = _plain_run("device"), _run("host", prefetch=False)
    assert host.memory.total < device.memory.total  # small cohorts, one big client
    limit = (host.memory.total + device.memory.total) // 2
    assert _run("auto", memory_limit=limit, prefetch=False).memory.placement == "host"
    streamed = _plain_run("host").memory  # prefetching: one chunk's cohorts more
    assert streamed.resident_bytes > 0 and streamed.program_bytes == host.memory.program_bytes
    assert _plain_run("auto").memory.placement == "device"  # no limit: the device fits
    with pytest.raises(mem.MemoryBudgetError, match="placement: .*placement='host'"):
        _run("device", memory_limit=limit)


def test_a_plan_that_cannot_fit_stops_before_anything_runs(tmp_path):
    out = str(tmp_path / "ckpt")
    with pytest.raises(mem.MemoryBudgetError, match=r"placement: memory: .* does not fit"):
        _run("auto", memory_limit=1024, checkpoint_dir=out)
    assert not os.path.exists(out)  # nothing was evaluated or saved
    with pytest.raises(ValueError, match="placement"):
        _run("gpu")


def test_compact_chunk_holds_only_real_rows_and_views_equal_the_padded_cohorts():
    data = _skewed()
    ids = np.array([[4, 0, 6], [1, 5, 3]], np.int32)  # a big client, an empty one
    m = mem.size_bucket(np.asarray(data.train.num_examples)[ids].max(),
                        data.train.mask.shape[1])
    padded = gather_cohorts(data.train, ids, None, m)
    chunk = mem.compact_chunk(data.train.examples, data.train.num_examples, ids,
                              padded.local_steps, m)
    real = int(np.asarray(data.train.num_examples)[ids].sum())
    assert chunk.rows["x"].shape[0] == mem.row_bucket(real + m) < ids.size * m * 2
    for r in range(ids.shape[0]):
        views = jax.jit(lambda o, s: mem.compact_views(chunk.rows, o, s, m))(
            chunk.offsets[r], chunk.sizes[r])
        for a, b in zip(jax.tree.leaves(views), jax.tree.leaves(
                jax.tree.map(lambda v: v[r], padded.data))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_streamed_compact_layout_equals_the_padded_layout():
    """Both streamed layouts give the same run (and the resident run's)."""
    compact, padded = _plain_run("host"), _run("host", stream_layout="padded")
    helpers.assert_trees_close(compact.state.params, padded.state.params, rtol=1e-6,
                               atol=1e-7)
    for name in ("accuracy", "loss"):
        np.testing.assert_allclose(compact.client_metrics[name], padded.client_metrics[name],
                                   rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(compact.round_metrics["train_loss"],
                               padded.round_metrics["train_loss"], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="stream_layout"):
        _run("host", stream_layout="ragged")
