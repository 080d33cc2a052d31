"""Vectorised sweeps (fedjax_fair/drivers/sweeps.py): one program equals the separate runs,
axes are labelled, chunking changes nothing, bad inputs fail before compiling.

The federation is helpers.tiny_federation() (6 clients, client 2 empty) with a
validation split drawn like its test split; runs are 3 rounds, cohorts of 4, the
``sequential`` execution, compiled with XLA:CPU's cheaper pipeline. XLA compiles
dominate: the default tests share three programs (the product sweep in tiles of 4
grid points x 1 seed, the zipped sweep in one tile with its seeds vmapped, one
single run called per setting).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from fedjax_fair import algorithms
from fedjax_fair.drivers import runner
from fedjax_fair.scenarios import sampling
from fedjax_fair.drivers.sweeps import (SEED, Tiles, evaluate_state, final_state,
                                        summarise, sweep)
from fedjax_fair.core.types import FederatedData
from fedjax_fair.core.client import ClientTraining

MODEL = helpers.logreg()
_TINY = helpers.tiny_federation()
DATA = FederatedData(_TINY.train, _TINY.test, helpers.tiny_federation(seed=1).test)
N = DATA.num_clients
ROUNDS, COHORT, EXECUTION, B = 3, 4, "sequential", 4
QS, LRS, SEEDS = (0.0, 1.0, 5.0), (0.1, 0.3), (0, 3)
_CHEAP = ({"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
          if jax.default_backend() == "cpu" else None)
COMMON = dict(model=MODEL, data=DATA, num_rounds=ROUNDS, cohort_size=COHORT,
              execution=EXECUTION, compiler_options=_CHEAP)


def build(hp):
    return algorithms.qffl(MODEL, q=hp["q"], training=ClientTraining(lr=hp["client_lr"],
                                                                     batch_size=B))


@functools.cache
def product_sweep():
    """q x client_lr x seeds through the registry name, [3, 2, 2, N], in tiles of 4
    grid points x 1 seed (the last grid tile padded): 4 calls of one program."""
    return sweep("qffl", {"q": QS, "client_lr": LRS}, fixed={"batch_size": B}, seeds=SEEDS,
                 chunk_size=4, vmap_seeds=False, **COMMON)


@functools.cache
def single_run():
    """One jitted run taking the hyper-parameters and the seed as arguments."""
    def run(hp, seed, data):
        key = jax.random.key(seed)
        algorithm = build(hp)
        state = final_state(algorithm, MODEL.init(key), data, key, num_rounds=ROUNDS,
                            cohort_size=COHORT, sampler=sampling.uniform,
                            execution=EXECUTION)
        return (evaluate_state(MODEL, algorithm, state, data.test),
                evaluate_state(MODEL, algorithm, state, data.validation))

    return jax.jit(run, compiler_options=_CHEAP)


def test_axes_are_labelled():
    r = product_sweep()
    assert [a.name for a in r.axes] == ["q", "client_lr", SEED]
    np.testing.assert_allclose(r.axes[0].values["q"], QS)
    np.testing.assert_allclose(r.axes[1].values["client_lr"], LRS)
    np.testing.assert_array_equal(r.axes[2].values[SEED], SEEDS)
    assert r.shape == (3, 2, 2)
    for split in (r.test, r.validation):
        assert {"loss", "accuracy"} <= set(split)
        assert all(v.shape == (3, 2, 2, N) for v in split.values())
    assert all(v.shape == (3, 2, 2) for v in r.summary.values())
    assert {"accuracy_mean", "accuracy_std", "accuracy_worst_10%", "test_loss",
            "validation_accuracy_worst_10%", "validation_loss"} <= set(r.summary)
    np.testing.assert_array_equal(r.num_examples["test"], helpers.TEST_SIZES)
    grid = r.hparams()
    assert grid["q"].shape == grid["client_lr"].shape == (3, 2)
    assert grid["q"][2, 0] == 5.0 and grid["client_lr"][2, 1] == np.float32(0.3)
    assert r.states is None and r.compile_seconds > 0 and r.run_seconds > 0


def test_sweep_equals_separate_runs():
    r = product_sweep()
    run = single_run()
    for i, q in enumerate(QS):
        for j, lr in enumerate(LRS):
            for s, seed in enumerate(SEEDS):
                test, val = run({"q": jnp.float32(q), "client_lr": jnp.float32(lr)},
                                jnp.uint32(seed), DATA)
                for name in ("loss", "accuracy"):
                    np.testing.assert_allclose(r.test[name][i, j, s], test[name],
                                               rtol=1e-5, atol=1e-6)
                    np.testing.assert_allclose(r.validation[name][i, j, s], val[name],
                                               rtol=1e-5, atol=1e-6)
    # the settings and seeds reach the runs: no two give the same losses
    losses = r.test["loss"].reshape(-1, N)
    assert len({tuple(np.round(v, 6)) for v in losses}) == len(losses)


def test_summary_is_the_runners():
    """Each run's summary is ``runner.split_summary`` of its per-client metrics."""
    r = product_sweep()
    for index in [(0, 0, 0), (2, 1, 1)]:
        for split, per_client in (("test", r.test), ("validation", r.validation)):
            one = {k: v[index] for k, v in per_client.items()}
            one["num_examples"] = r.num_examples[split]
            expected = runner.split_summary(one, split)
            assert set(expected) <= set(r.summary)
            for key, value in expected.items():
                np.testing.assert_allclose(r.summary[key][index], value, rtol=1e-5,
                                           atol=1e-6, err_msg=key)


def test_zipped_sweep_with_vmapped_seeds_equals_the_chunked_product_sweep():
    """The six settings zipped, every run in one tile (6 points x 2 seeds vmapped),
    from a builder function, with the final states kept."""
    full = product_sweep()
    q = np.repeat(QS, len(LRS))
    lr = np.tile(LRS, len(QS))
    r = sweep(build, {"q": q, "client_lr": lr}, product=False, seeds=SEEDS,
              vmap_seeds=True, keep_states=True, **COMMON)
    assert [a.name for a in r.axes] == ["config", SEED] and r.shape == (6, 2)
    np.testing.assert_allclose(r.axes[0].values["q"], q)
    for per_client, reference in ((r.test, full.test), (r.validation, full.validation)):
        for name, v in per_client.items():
            np.testing.assert_allclose(v, reference[name].reshape(v.shape), rtol=1e-5,
                                       atol=1e-6)
    for key, v in r.summary.items():
        np.testing.assert_allclose(v, full.summary[key].reshape(v.shape), rtol=1e-5,
                                   atol=1e-6, err_msg=key)
    assert all(leaf.shape[:2] == (6, 2) for leaf in jax.tree.leaves(r.states))
    np.testing.assert_array_equal(r.states.round, ROUNDS)


def test_tiles_cover_the_runs_once():
    assert Tiles.of(6, 2, None)[2:] == (6, 2) and Tiles.of(6, 2, None, False)[2:] == (6, 1)
    assert Tiles.of(1, 16, 5)[2:] == (1, 5) and Tiles.of(2, 16, 5)[2:] == (2, 2)
    tiles = Tiles.of(num_points=5, num_seeds=3, chunk_size=4)
    assert (tiles.g, tiles.s, tiles.shape) == (4, 1, (2, 3))
    flat = {"a": np.arange(5.0)}
    hp, seeds, positions = tiles.split(flat, np.asarray([10, 11, 12]))
    assert hp["a"].shape == (6, 4) and seeds.shape == positions.shape == (6, 1)
    np.testing.assert_array_equal(seeds, positions + 10)
    # a run's output is (point value, seed): merged back to [points, seeds]
    out = np.stack([np.stack(np.broadcast_arrays(hp["a"][t][None, :], seeds[t][:, None]),
                             -1) for t in range(tiles.count)])
    merged = tiles.merge(out)
    assert merged.shape == (5, 3, 2)
    np.testing.assert_array_equal(merged[..., 0], np.arange(5.0)[:, None] + 0 * merged[..., 1])
    np.testing.assert_array_equal(merged[..., 1], np.broadcast_to([10, 11, 12], (5, 3)))


def test_summarise_leaves_out_clients_without_examples():
    acc = np.asarray([[0.5, 1.0, 0.0, 0.25]], np.float32)
    n = np.asarray([2, 4, 0, 4])
    s = summarise({"accuracy": acc, "loss": acc}, n)
    np.testing.assert_allclose(s["accuracy_mean"], [1.75 / 3], rtol=1e-6)
    np.testing.assert_allclose(s["accuracy_worst_10%_unweighted"], [0.25])
    np.testing.assert_allclose(s["test_loss"], [(1 + 4 + 1) / 10], rtol=1e-6)


# ------------------------------------------------------------------ bad inputs

BAD = [
    (dict(grid={"batch_size": [10, 20]}), ValueError, "grid: 'batch_size' of 'qffl' is not continuous"),
    (dict(grid={"mode": [1.0]}), ValueError, "grid: 'mode' of 'qffl' is not continuous"),
    (dict(grid={"foo": [1.0]}), ValueError, "grid: 'foo' is not a hyper-parameter of 'qffl'"),
    (dict(grid={"q": [0.1, -1.0]}), ValueError, "grid: 'q': must be in"),
    (dict(grid={"q": 0.1}), ValueError, "grid: 'q' must be a sequence"),
    (dict(grid={"q": []}), ValueError, "grid: 'q' has no values"),
    (dict(grid={"q": [0.1, math.nan]}), ValueError, "grid: 'q' has a non-finite value"),
    (dict(grid={"q": [[0.1, 0.2], [0.3]]}), ValueError, "grid: 'q' must be a sequence of numbers"),
    (dict(grid={"q": ["a"]}), ValueError, "grid: 'q' must be a sequence of numbers"),
    (dict(grid={"q": [0.1, 0.2], "client_lr": [0.1]}, product=False), ValueError,
     "grid: a zipped grid"),
    (dict(grid={"seed": [1.0]}), ValueError, "grid: 'seed' is not a hyper-parameter"),
    (dict(grid=[("q", [0.1])]), TypeError, "grid: must be a mapping"),
    (dict(seeds=[]), ValueError, "seeds: needs at least one seed"),
    (dict(seeds=[-1]), ValueError, "seeds: must lie in"),
    (dict(seeds=[0.5]), TypeError, "seeds: must be integers"),
    (dict(seeds=None), TypeError, "seeds: must be a sequence"),
    (dict(num_rounds=0), ValueError, "num_rounds: "),
    (dict(num_rounds=2.0), TypeError, "num_rounds: "),
    (dict(cohort_size=N + 1), ValueError, "cohort_size: "),
    (dict(chunk_size=0), ValueError, "chunk_size: "),
    (dict(builder="aaggff_s", grid={"beta": [1.0]}), ValueError,
     "cohort_size: the 'full' sampler"),
    (dict(chunk_loop="python"), ValueError, "chunk_loop: "),
    (dict(builder="nope"), ValueError, "builder: unknown method 'nope'"),
    (dict(builder=3), TypeError, "builder: "),
    (dict(builder=lambda hp: "fedavg"), TypeError, "builder: must return a FederatedAlgorithm"),
    (dict(builder=build, fixed={"batch_size": 4}), ValueError, "fixed: only for"),
    (dict(fixed={"nope": 1}), ValueError, "fixed: 'nope' is not a hyper-parameter"),
    (dict(fixed={"q": 1.0}), ValueError, "fixed: 'q' is also in the grid"),
    (dict(model=None), ValueError, "model: "),
    (dict(data=DATA.train), TypeError, "data: "),
    (dict(execution="fast"), ValueError, "execution: "),
]


@pytest.mark.parametrize("kwargs,error,message", BAD, ids=[b[2][:40] for b in BAD])
def test_bad_inputs_fail_before_compiling(kwargs, error, message, monkeypatch):
    def no_compile(*args, **kw):
        raise AssertionError("compiled before checking the arguments")

    monkeypatch.setattr(jax, "jit", no_compile)
    args = dict(builder="qffl", grid={"q": [0.1, 1.0]}, seeds=(0,), **COMMON)
    args.update(kwargs)
    builder, grid = args.pop("builder"), args.pop("grid")
    with pytest.raises(error, match="^" + message.replace("(", r"\(")):
        sweep(builder, grid, **args)


# ------------------------------------------------------------------ slow


@pytest.mark.slow
def test_lax_map_chunks_and_seeds_only_and_runner():
    """``chunk_loop="map"`` equals the host loop; a grid of {} sweeps seeds only; a
    sweep's run equals ``runner.run`` from ``model.init(key(seed))`` with
    ``key(seed)`` (the command line's seeding)."""
    full = product_sweep()
    mapped = sweep("qffl", {"q": QS, "client_lr": LRS}, fixed={"batch_size": B},
                   seeds=SEEDS, chunk_size=5, vmap_seeds=True, chunk_loop="map", **COMMON)
    for name, v in mapped.test.items():
        np.testing.assert_allclose(v, full.test[name], rtol=1e-5, atol=1e-6)

    algorithm = algorithms.qffl(MODEL, q=1.0, training=ClientTraining(lr=0.3, batch_size=B))
    seeds_only = sweep(lambda hp: algorithm, {}, seeds=SEEDS, vmap_seeds=True, **COMMON)
    assert [a.name for a in seeds_only.axes] == [SEED] and seeds_only.shape == (2,)
    np.testing.assert_allclose(seeds_only.test["loss"], full.test["loss"][1, 1], rtol=1e-5,
                               atol=1e-6)
    key = jax.random.key(SEEDS[1])
    result = runner.run(algorithm, jax.jit(MODEL.init)(key), DATA, key, model=MODEL,
                        num_rounds=ROUNDS, cohort_size=COHORT, eval_every=ROUNDS,
                        progress=False, execution=EXECUTION)
    np.testing.assert_allclose(result.client_metrics["loss"], full.test["loss"][1, 1, 1],
                               rtol=1e-5, atol=1e-6)
    final = result.history[-1]
    np.testing.assert_allclose(full.summary["accuracy_worst_10%"][1, 1, 1],
                               final["accuracy_worst_10%"], rtol=1e-5)
    np.testing.assert_allclose(full.summary["validation_loss"][1, 1, 1],
                               final["validation_loss"], rtol=1e-5)


@pytest.mark.parametrize("vmap_seeds", [True, False], ids=["vmapped", "host_loop"])
def test_run_seeds_equals_runner_run_per_seed(vmap_seeds):
    """``run_seeds`` (compare's seeds as one program) gives each seed runner.run's
    history, per-client metrics, per-round metrics and client history."""
    from fedjax_fair.drivers.sweeps import run_seeds
    algorithm = algorithms.qffl(MODEL, q=1.0, training=ClientTraining(lr=0.3, batch_size=B))
    runs = run_seeds(algorithm, MODEL, DATA, SEEDS, num_rounds=5, cohort_size=COHORT,
                     eval_every=2, execution=EXECUTION, vmap_seeds=vmap_seeds)
    assert runs.non_finite == [None, None]
    for seed, got, rounds in zip(SEEDS, runs.results, runs.rounds):
        key = jax.random.key(seed)
        want = runner.run(algorithm, MODEL.init(key), DATA, key, model=MODEL, num_rounds=5,
                          cohort_size=COHORT, eval_every=2, execution=EXECUTION,
                          progress=False)
        assert [h["round"] for h in got.history] == [0, 2, 4, 5]
        for a, b in zip(got.history, want.history):
            assert a.keys() == b.keys()
            for k in a:
                if k != "seconds":
                    np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)
        for k in want.client_metrics:
            np.testing.assert_allclose(got.client_metrics[k], want.client_metrics[k],
                                       rtol=1e-5, atol=1e-6)
        for k in want.round_metrics:
            np.testing.assert_allclose(got.round_metrics[k], want.round_metrics[k], rtol=1e-5)
        assert got.client_history.keys() == want.client_history.keys()
        np.testing.assert_array_equal(got.client_history["round"], [0, 2, 4, 5])
        np.testing.assert_allclose(got.client_history["accuracy"],
                                   want.client_history["accuracy"], atol=1e-6)
        assert rounds["weights"].shape[0] == 5 and got.evaluated == want.evaluated
