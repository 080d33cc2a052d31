"""The driver fedjax_fair/drivers/runner.py: evaluation, compilation, resume, damaged
checkpoints, the non-finite stop, donation, and arguments refused before compute.

The federation is helpers.tiny_federation(): 6 clients, 10 features, 3 classes,
train sizes (7, 12, 0, 3, 9, 5) padded to M = 12, client 2 empty.
"""

from __future__ import annotations

import math
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from helpers import (ENGINE_MODEL as MODEL, ENGINE_PARAMS as PARAMS, ENGINE_DATA as DATA,
                     ENGINE_N as N, ENGINE_B as B, ENGINE_KEY as KEY, counting as _counting,
                     seq_fedavg as _seq_fedavg, engine_run as _run, _garbage, _cut_in_half,
                     _npy_not_npz, newest_file as _newest_file)
from fedjax_fair.drivers import checkpoint as ckpt
from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.algorithms import fedavg
from fedjax_fair.drivers.runner import NonFiniteError, run
from fedjax_fair.core.client import ClientTraining


def test_run_evaluates_all_clients_and_logs_history(reference_run):
    result, _, _ = reference_run
    assert int(result.state.round) == 5
    for name, values in result.client_metrics.items():
        assert np.asarray(values).shape == (N,), name
    np.testing.assert_array_equal(result.client_metrics["num_examples"], helpers.TEST_SIZES)
    assert [h["round"] for h in result.history] == [0, 2, 4, 5]
    assert result.round_metrics["train_loss"].shape == (5,)
    assert result.round_metrics["update_norm"].shape == (5,)

    # Per-client accuracy against NumPy on the final parameters.
    p = result.state.params["params"]["Dense_0"]
    w, b = np.asarray(p["kernel"], np.float64), np.asarray(p["bias"], np.float64)
    for k in range(N):
        n = helpers.TEST_SIZES[k]
        x = np.asarray(DATA.test.examples["x"][k, :n], np.float64)
        y = np.asarray(DATA.test.examples["y"][k, :n])
        expected = float(np.mean(np.argmax(x @ w + b, -1) == y)) if n else 0.0
        np.testing.assert_allclose(result.client_metrics["accuracy"][k], expected, atol=1e-6)
        if n:  # each client's calibration errors over its own test rows
            from fedjax_fair.metrics import calibration_errors
            ece, mce = calibration_errors(x @ w + b, y)
            np.testing.assert_allclose(
                [result.client_metrics["ece"][k], result.client_metrics["mce"][k]],
                [float(ece), float(mce)], atol=1e-5)
    assert np.all(np.isfinite(result.client_metrics["loss"]))
    has = np.asarray(helpers.TEST_SIZES) > 0
    np.testing.assert_allclose(result.history[-1]["ece"],
                               np.mean(result.client_metrics["ece"][has]), rtol=1e-6)


def test_run_compiles_one_chunk_program_on_a_cpu(reference_run):
    result, traces, _ = reference_run
    # chunks of 2, 2 and 1 rounds: on a CPU the first chunk's program runs all three
    # (the last stops after one round); an accelerator compiles lengths 2 and 1
    assert traces == (1 if jax.default_backend() == "cpu" else 2)
    assert result.compile_seconds > 0.0 and result.run_seconds > 0.0


def _union(spans):
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if b > end:
            total, end = total + b - max(a, end), b
    return total


def test_compile_seconds_counts_every_compile_of_the_run():
    """``compile_seconds`` covers every XLA compile during ``run`` (the chunk programs,
    the evaluator of a model not evaluated before, one-off ops), as jax reports them,
    and no more than the run's wall clock."""
    import time
    from fedjax_fair.drivers.runner import CompileClock
    spans = []

    def listener(event, start, end, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            spans.append((start, end))

    model = helpers.logreg()  # a fresh model: its evaluator compiles in this run
    alg = fedavg(model, training=ClientTraining(lr=0.1, batch_size=4, num_epochs=1))
    jax.monitoring.register_event_time_span_listener(listener)
    try:
        t0 = time.time()
        result = run(alg, PARAMS, DATA, jax.random.key(3), model=model, num_rounds=3,
                     cohort_size=3, eval_every=2, progress=False)
        t1 = time.time()
    finally:
        jax.monitoring.unregister_event_time_span_listener(listener)
    # (a persistent compilation cache, which the command line turns on, may serve
    # some programs without a backend compile: then they have no span to count)
    assert result.compile_seconds > 0.0
    assert result.compile_seconds >= _union(spans) - 1e-6
    assert result.compile_seconds <= t1 - t0
    # per program: the fresh model's evaluator (compiled in the background) and the
    # chunk program (this algorithm object is new: not in the process's program cache)
    assert {"chunk_program", "evaluate_clients"} <= set(result.compile_programs)
    assert all(v > 0.0 for v in result.compile_programs.values())
    # the clock merges nested and concurrent spans: it counts no second twice
    clock = CompileClock()
    for a, b in ((0.0, 2.0), (1.0, 3.0), (0.5, 1.0), (5.0, 6.0)):
        clock.add(a, b)
    assert clock.seconds == pytest.approx(4.0)


def test_a_second_run_of_the_same_algorithm_reuses_its_programs():
    """Runs of one algorithm object on data of the same shapes (a compare's seeds)
    compile each chunk program once per process; another seed still gives its own
    result."""
    alg, count = _counting(_seq_fedavg())
    first = _run(alg, num_rounds=2, eval_every=2)
    traced = count[0]
    second = run(alg, PARAMS, DATA, jax.random.key(6), model=MODEL, num_rounds=2,
                 cohort_size=3, eval_every=2, progress=False)
    assert count[0] == traced  # no new trace, no new compile
    assert second.compile_seconds < first.compile_seconds
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first.state.params),
                                                        jax.tree.leaves(second.state.params)))


def test_work_queued_while_compiling_runs_once_in_the_compile_thread():
    """``programs.while_compiling``: a queued function runs once, in the thread that
    compiles the evaluators, during the next run (not in the caller's); one that
    raises leaves the run as it was."""
    import threading
    from fedjax_fair.drivers import programs
    calls = []
    programs.while_compiling(lambda: calls.append(threading.current_thread().name))
    programs.while_compiling(lambda: 1 / 0)
    assert calls == []  # nothing runs before a run starts
    result = _run(_seq_fedavg(), num_rounds=2, eval_every=2)
    programs._compiler().submit(lambda: None).result()  # the thread's queue, drained
    assert calls == ["fedjax-fair-compile_0"]
    assert len(result.history) == 2
    _run(_seq_fedavg(), num_rounds=2, eval_every=2)  # a later run runs it no more
    programs._compiler().submit(lambda: None).result()
    assert len(calls) == 1


def test_run_resume_is_bitwise_identical(reference_run):
    full, _, snapshot = reference_run
    assert ckpt.exists(snapshot), "no round-4 checkpoint was written"
    alg, count = _counting(_seq_fedavg())
    resumed = _run(alg, checkpoint_dir=snapshot, resume=True)
    assert count[0] == 1  # only the last chunk (1 round) ran
    chex.assert_trees_all_equal(resumed.state, full.state)
    assert [h["round"] for h in resumed.history] == [0, 2, 4, 5]
    np.testing.assert_array_equal(resumed.round_metrics["train_loss"],
                                  full.round_metrics["train_loss"])
    for a, b in zip(resumed.history, full.history):
        assert a["accuracy_mean"] == b["accuracy_mean"]
    for name in full.client_metrics:
        np.testing.assert_array_equal(resumed.client_metrics[name], full.client_metrics[name])


def test_run_resume_without_checkpoint_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        _run(_seq_fedavg(), checkpoint_dir=str(tmp_path / "none"), resume=True)


# ---- bad arguments and damaged checkpoints: refused before compute, nothing written


@pytest.fixture
def no_compile(monkeypatch):
    """Compiling a program (how the runner compiles its chunk programs) fails the test:
    a refused input must be refused before compute. The runner's program cache starts
    empty, so a program compiled by an earlier test is not reused either."""
    from fedjax_fair.drivers import runner

    def refuse(*args, **kwargs):
        raise AssertionError("the input reached compilation")

    monkeypatch.setattr(jax.stages.Lowered, "compile", refuse)
    monkeypatch.setattr(runner, "_PROGRAMS", runner._ProgramCache())


@pytest.mark.parametrize("field,value,error", [
    ("cohort_size", 0, ValueError), ("cohort_size", -1, ValueError),
    ("cohort_size", N + 1, ValueError), ("cohort_size", 2.5, TypeError),
    ("cohort_size", True, TypeError), ("cohort_size", "3", TypeError),
    ("num_rounds", 0, ValueError), ("num_rounds", 2.0, TypeError),
    ("eval_every", 0, ValueError), ("eval_every", -2, ValueError),
    ("eval_every", None, TypeError),
    ("key", 0, TypeError), ("key", "seed", TypeError),
    ("key", jax.random.split(jax.random.key(0)), ValueError),  # a batch of keys
    ("key", np.zeros(2, np.int32), TypeError),  # raw key data of the wrong dtype
    ("key", np.zeros(3, np.uint32), TypeError),  # ... or the wrong shape
    ("step_budgets", "fixed:2", TypeError), ("step_budgets", 3, TypeError),
    ("step_budgets", np.full(N, 2.0), TypeError), ("step_budgets", np.ones(N, bool), TypeError),
    ("step_budgets", np.ones(N + 1, np.int32), ValueError),
    ("step_budgets", np.array([1, 2, -1, 0, 3, 4]), ValueError)])
def test_run_refuses_bad_arguments_before_compute(tmp_path, no_compile, field, value, error):
    directory = tmp_path / "ckpt"
    kw = dict(model=MODEL, num_rounds=2, cohort_size=3, eval_every=1, progress=False,
              checkpoint_dir=str(directory))
    key = jax.random.key(0)
    if field == "key":
        key = value
    else:
        kw[field] = value
    with pytest.raises(error, match=f"^{field}: "):
        run(_seq_fedavg(), PARAMS, DATA, key, **kw)
    assert not directory.exists()


def test_run_refuses_a_federation_without_test_data(no_compile):
    data = DATA._replace(test=DATA.test._replace(
        mask=np.zeros_like(DATA.test.mask), num_examples=np.zeros_like(DATA.test.num_examples)))
    with pytest.raises(ValueError, match="^data: "):
        run(_seq_fedavg(), PARAMS, data, KEY, model=MODEL, num_rounds=1, cohort_size=3,
            progress=False)


def test_run_skips_a_validation_split_without_examples():
    """A validation block in which no client has a row (even of padded size 0, which
    the model cannot take) is not evaluated: no ``validation_`` keys."""
    from fedjax_fair.data import federated as fd
    empty = jax.tree.map(np.asarray, fd.stack_clients([np.zeros((0, 10), np.float32)] * N,
                                                      [np.zeros(0, np.int32)] * N))
    assert empty.mask.shape == (N, 0)
    result = _run(_seq_fedavg(), num_rounds=1, eval_every=1,
                  data=DATA._replace(validation=empty))
    assert not any(k.startswith("validation_") for h in result.history for k in h)
    assert "accuracy_mean" in result.history[-1]


def test_run_takes_legacy_uint32_keys_and_budget_tables_as_lists():
    """A legacy ``jax.random.PRNGKey(seed)`` (raw uint32 data, also as a NumPy array)
    is the same key as ``jax.random.key(seed)``: the same run, bit for bit. A budget
    table may be a list of ints."""
    alg = _seq_fedavg()
    kw = dict(model=MODEL, num_rounds=2, cohort_size=3, eval_every=2, progress=False)
    typed = run(alg, PARAMS, DATA, jax.random.key(5), **kw)
    for legacy in (jax.random.PRNGKey(5), np.asarray(jax.random.PRNGKey(5))):
        chex.assert_trees_all_equal(run(alg, PARAMS, DATA, legacy, **kw).state, typed.state)
    budgets = [1, 2, 0, 1, 3, 2]
    listed = run(alg, PARAMS, DATA, jax.random.key(5), step_budgets=budgets, **kw)
    table = run(alg, PARAMS, DATA, jax.random.key(5), step_budgets=np.asarray(budgets), **kw)
    chex.assert_trees_all_equal(listed.state, table.state)


def test_run_refuses_a_lazy_table_too_small_before_compute():
    from fedjax_fair.algorithms import feddyn
    alg = feddyn(MODEL, training=ClientTraining(batch_size=B), client_table="lazy:2")
    with pytest.raises(ValueError, match="^client_table: "):
        run(alg, PARAMS, DATA, KEY, model=MODEL, num_rounds=2, cohort_size=3,
            progress=False)
    # min(N, K R) = min(6, 3 x 1) = 3 slots suffice for one round of 3 clients.
    result = run(feddyn(MODEL, training=ClientTraining(batch_size=B), client_table="lazy:3"),
                 PARAMS, DATA, KEY,
                 model=MODEL, num_rounds=1, cohort_size=3, progress=False)
    assert result.client_table["rows_stored"] == 3


def _other_arrays(path):
    with open(path, "wb") as f:
        np.savez(f, something=np.zeros(3, np.float32))


@pytest.mark.parametrize("name,damage", [
    ("state.npz", _garbage), ("state.npz", _cut_in_half), ("state.npz", _other_arrays),
    ("state.npz", _npy_not_npz),
    ("meta.json", _garbage), ("meta.json", lambda p: p.write_text("[]")),
    ("meta.json", lambda p: p.write_text('{"history": []}')),
    ("meta.json", lambda p: p.write_text('{"history": [{"accuracy_mean": 0.5}]}')),
    ("meta.json", lambda p: p.write_bytes(b"\xff\xfe{")),
    ("client_history", _garbage), ("client_history", _cut_in_half),
    ("client_history", _other_arrays)], ids=lambda v: getattr(v, "__name__", v))
def test_resume_from_a_damaged_checkpoint_names_the_file(reference_run, tmp_path,
                                                         no_compile, name, damage):
    """run(resume=True) on a damaged checkpoint: ``ValueError("checkpoint: ...")``
    naming the file, raised before anything is compiled or written."""
    directory = tmp_path / "ckpt"
    shutil.copytree(reference_run[2], directory)
    damage(_newest_file(directory, name))
    before = {str(p): p.read_bytes() for p in directory.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="^checkpoint: ") as info:
        _run(_seq_fedavg(), checkpoint_dir=str(directory), resume=True)
    assert name in str(info.value)
    assert len(str(info.value).splitlines()) == 1
    assert {str(p): p.read_bytes() for p in directory.rglob("*") if p.is_file()} == before


def _nan_after(alg, good_rounds):
    """Makes the parameters NaN once more than ``good_rounds`` rounds are done."""

    def apply(state, cohort, key, execution="auto"):
        new, metrics = alg.apply(state, cohort, key, execution)
        bad = new.round > good_rounds
        params = jax.tree.map(lambda p: jnp.where(bad, jnp.nan, p), new.params)
        return new._replace(params=params), metrics

    return FederatedAlgorithm(alg.init, apply)


def test_run_stops_on_nan_at_first_bad_round_and_keeps_last_good_state(tmp_path):
    """Chunks of 2 rounds, NaN from round 4 on: the error names round 4 (inside the
    second chunk, not its start), and the checkpoint keeps round 2, the last state
    known good."""
    directory = str(tmp_path / "ckpt")
    alg = _nan_after(_seq_fedavg(), good_rounds=3)
    with pytest.raises(NonFiniteError) as info:
        _run(alg, num_rounds=6, eval_every=2, checkpoint_dir=directory)
    err = info.value
    assert err.round == 4
    assert err.last_good_round == 2
    assert int(err.last_good_state.round) == 2
    assert helpers.tree_all_finite(err.last_good_state.params)
    restored, meta = ckpt.restore(directory, alg.init(PARAMS, N))
    assert int(restored.round) == 2 < err.round
    assert helpers.tree_all_finite(restored.params)
    chex.assert_trees_all_equal(restored, err.last_good_state)
    assert [h["round"] for h in meta["history"]] == [0, 2]


def test_nan_in_the_server_state_beyond_the_parameters_stops_the_run():
    """A NaN in the aggregator's state (FedEvg's synthetic set, a generator, a
    history) stops the run at its round even while the parameters are still finite;
    integer and key leaves are not checked."""
    inner = _seq_fedavg()

    def init(params, num_clients):
        state = inner.init(params, num_clients)
        return state._replace(aggregator_state=(jnp.zeros((3,)), jnp.zeros((), jnp.int32),
                                                jax.random.key(0)))

    def apply(state, cohort, key, execution="auto"):
        new, metrics = inner.apply(state, cohort, key, execution)
        x, count, k = state.aggregator_state
        x = jnp.where(new.round > 3, jnp.nan, x)
        return new._replace(aggregator_state=(x, count + 1, k)), metrics

    with pytest.raises(NonFiniteError) as info:
        _run(FederatedAlgorithm(init, apply), num_rounds=6, eval_every=2)
    assert info.value.round == 4 and int(info.value.last_good_state.round) == 2
    assert helpers.tree_all_finite(info.value.last_good_state.params)


def test_run_without_checkpoint_keeps_last_good_state_in_memory():
    """Without a checkpoint the chunks are not donated, so the state before the bad
    chunk is still there to hand back."""
    alg = _nan_after(_seq_fedavg(), good_rounds=3)
    with pytest.raises(NonFiniteError) as info:
        _run(alg, num_rounds=6, eval_every=2)
    assert int(info.value.last_good_state.round) == 2
    assert helpers.tree_all_finite(info.value.last_good_state.params)
    with pytest.raises(ValueError, match="donate"):
        _run(_seq_fedavg(), num_rounds=2, donate=True)


def test_donated_chunks_give_the_same_run_and_leave_the_callers_arrays_alone(tmp_path):
    """Donating the state (the default with a checkpoint) changes no result, and the
    caller's initial parameters, which the state starts out sharing, stay usable."""
    plain = _run(_seq_fedavg(), num_rounds=4, eval_every=2, donate=False)
    donated = _run(_seq_fedavg(), num_rounds=4, eval_every=2,
                   checkpoint_dir=str(tmp_path / "ckpt"))
    chex.assert_trees_all_equal(donated.state.params, plain.state.params)
    assert not any(x.is_deleted() for x in jax.tree.leaves(PARAMS))


@pytest.mark.parametrize("placement", ["device", pytest.param("host", marks=pytest.mark.slow)])
def test_run_evaluates_a_validation_split_under_its_own_names(placement):
    """A validation split is summarised with the test split's metric names prefixed
    ``validation_``; the test keys say what they measure (``accuracy_worst_10%``)."""
    from fedjax_fair.metrics import fairness_summary
    swapped = DATA._replace(validation=DATA.test, test=DATA.train)
    result = _run(_seq_fedavg(), data=swapped, placement=placement)
    final = result.history[-1]
    assert {"accuracy_mean", "accuracy_worst_10%", "accuracy_worst_10%_unweighted",
            "test_loss", "validation_accuracy_mean", "validation_accuracy_worst_10%",
            "validation_loss"} <= set(final)
    plain = _run(_seq_fedavg(), placement=placement).history[-1]  # DATA.test as test
    for key, value in plain.items():
        if key.startswith("accuracy_"):
            assert final["validation_" + key] == pytest.approx(value, abs=1e-6)
    # test metrics come from the split named test (here DATA.train)
    n = np.asarray(result.client_metrics["num_examples"])
    np.testing.assert_array_equal(n, np.asarray(DATA.train.num_examples))
    acc = np.asarray(result.client_metrics["accuracy"])[n > 0]
    expected = fairness_summary(acc, weights=n[n > 0])
    assert final["accuracy_worst_10%"] == pytest.approx(expected["worst_10%"], abs=1e-6)


@pytest.mark.parametrize("good_rounds", [0, 3])
def test_donated_run_diverging_before_its_first_commit_keeps_its_initial_state(
        tmp_path, good_rounds):
    """Donated chunks committed every ``commit_seconds`` (a comparison's runs): a run
    that diverges before its first commit stops with the bad round and its initial
    state (round 0, ``saved`` False, the message saying that no state was saved), not
    with a missing checkpoint; nothing stale is read from the directory; a run that
    had committed restores its commit."""
    directory = tmp_path / "ckpt"
    alg = _nan_after(_seq_fedavg(), good_rounds=good_rounds)
    with pytest.raises(NonFiniteError) as info:
        _run(alg, num_rounds=6, eval_every=2, checkpoint_dir=str(directory),
             commit_seconds=3600.0)
    err = info.value
    assert err.round == good_rounds + 1
    assert err.last_good_round == 0 and int(err.last_good_state.round) == 0
    assert not err.saved and "no state was saved" in str(err)
    assert len(str(err).splitlines()) == 1
    chex.assert_trees_all_equal(err.last_good_state, alg.init(PARAMS, N))
    assert [h["round"] for h in err.history] == [0, 2][:1 + good_rounds // 2]
    assert not ckpt.exists(str(directory))
    with pytest.raises(NonFiniteError) as info:  # committed every evaluation: restored
        _run(alg, num_rounds=6, eval_every=2, checkpoint_dir=str(directory))
    assert info.value.saved and info.value.last_good_round == 2 * (good_rounds // 2)
