"""A run's settings as one value (fedjax_fair/drivers/spec.py): ``run`` / ``run_seeds``
with ``spec=RunSpec(...)`` equal the same calls with keywords, bit for bit; a spec's
bad field is refused as the keyword is, before compute; a spec and a settings keyword
together are a TypeError naming the keyword.

The federation is helpers.tiny_federation(): 6 clients, train sizes (7, 12, 0, 3, 9, 5).
"""

from __future__ import annotations

import chex
import jax
import numpy as np
import pytest

from helpers import (ENGINE_MODEL as MODEL, ENGINE_PARAMS as PARAMS, ENGINE_DATA as DATA,
                     ENGINE_N as N, seq_fedavg)
from fedjax_fair.drivers import RunSpec, make_programs, runner
from fedjax_fair.drivers.sweeps import run_seeds, sweep

KEY = jax.random.key(5)
SETTINGS = dict(num_rounds=3, cohort_size=3, eval_every=2)
ALG = seq_fedavg()  # one algorithm object: the runs share their compiled programs


def _without_seconds(history):
    return [{k: v for k, v in h.items() if k != "seconds"} for h in history]


def _assert_same_run(a, b):
    chex.assert_trees_all_equal(a.state, b.state)
    assert _without_seconds(a.history) == _without_seconds(b.history)
    chex.assert_trees_all_equal(a.client_metrics, b.client_metrics)
    chex.assert_trees_all_equal(a.rounds, b.rounds)
    chex.assert_trees_all_equal(a.client_history, b.client_history)
    assert a.memory._replace(capacity=None) == b.memory._replace(capacity=None)  # (free memory)


def test_run_with_a_spec_equals_run_with_the_keywords(tmp_path):
    keep = np.array([True, False, True, True, True, False])
    kw = dict(SETTINGS, summary_clients=keep, stream_layout="padded")
    by_keywords = runner.run(ALG, PARAMS, DATA, KEY, model=MODEL, progress=False,
                             checkpoint_dir=str(tmp_path / "a"), **kw)
    spec = RunSpec(**kw, checkpoint_dir=str(tmp_path / "b"))
    by_spec = runner.run(ALG, PARAMS, DATA, KEY, model=MODEL, progress=False, spec=spec)
    _assert_same_run(by_spec, by_keywords)
    # the same settings hit the process's program cache: no chunk program compiled again
    assert "chunk_program" not in by_spec.compile_programs
    # resume is not a setting: a spec resumes as keywords do
    resumed = runner.run(ALG, PARAMS, DATA, KEY, model=MODEL, progress=False,
                         spec=spec._replace(num_rounds=4), resume=True)
    assert [h["round"] for h in resumed.history] == [0, 2, 3, 4]


def test_run_seeds_with_a_spec_equals_run_seeds_with_the_keywords():
    by_keywords = run_seeds(ALG, MODEL, DATA, (1, 2), **SETTINGS)
    by_spec = run_seeds(ALG, MODEL, DATA, (1, 2), spec=RunSpec(**SETTINGS))
    assert by_spec.non_finite == by_keywords.non_finite == [None, None]
    for a, b in zip(by_spec.results, by_keywords.results):
        _assert_same_run(a, b)


@pytest.fixture
def no_compile(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the input reached compilation")

    monkeypatch.setattr(jax.stages.Lowered, "compile", refuse)
    monkeypatch.setattr(runner, "_PROGRAMS", runner._ProgramCache())


@pytest.mark.parametrize("field,value,error", [
    ("cohort_size", N + 1, ValueError), ("num_rounds", 2.0, TypeError),
    ("eval_every", 0, ValueError), ("placement", "gpu", ValueError),
    ("step_budgets", "fixed:2", TypeError), ("commit_seconds", -1.0, ValueError),
    ("donate", True, ValueError), ("execution", "fast", ValueError),
    ("summary_clients", np.zeros(N, bool), ValueError), ("system", 3, TypeError)])
def test_a_spec_with_a_bad_field_is_refused_as_the_keyword_is(no_compile, field, value, error):
    base = dict(num_rounds=2, cohort_size=3)
    with pytest.raises(error, match=f"^{field}: ") as by_keyword:
        runner.run(ALG, PARAMS, DATA, KEY, model=MODEL, progress=False, **{**base, field: value})
    with pytest.raises(error, match=f"^{field}: ") as by_spec:
        runner.run(ALG, PARAMS, DATA, KEY, model=MODEL, progress=False,
                   spec=RunSpec(**{**base, field: value}))
    assert str(by_spec.value) == str(by_keyword.value)
    with pytest.raises(error, match=f"^{field}: "):
        RunSpec(**{**base, field: value}).check(DATA, MODEL)


def test_check_normalises_a_spec_and_keeps_a_checked_one():
    spec = RunSpec(num_rounds=np.int64(4), cohort_size=3, step_budgets=[1, 2, 0, 1, 3, 2],
                   checkpoint_dir="somewhere")
    checked = spec.check(DATA)
    assert type(checked.num_rounds) is int and checked.donate is True
    assert checked.step_budgets.dtype == np.int32
    again = checked.check(DATA)
    assert again._replace(step_budgets=None) == checked._replace(step_budgets=None)
    np.testing.assert_array_equal(again.step_budgets, checked.step_budgets)


def test_a_sampler_may_be_given_by_its_command_line_name():
    """``sampler="uniform"`` / ``"full"`` / ``"size"`` are the samplers ``--sampler``
    names (the first two the same functions as ``scenarios.sampling``'s); "size" draws
    by the federation's training sizes. Before, a name failed deep in the round with
    "'str' object is not callable"."""
    from fedjax_fair.scenarios import sampling
    assert RunSpec(2, 3, sampler="uniform").check(DATA).sampler is sampling.uniform
    assert RunSpec(2, DATA.num_clients, sampler="full").check(DATA).sampler is sampling.full
    by_size = RunSpec(2, 3, sampler="size").check(DATA).sampler
    ids = np.asarray(by_size(jax.random.key(0), DATA.num_clients, 3))
    assert len(set(ids.tolist())) == 3
    sizes = np.asarray(DATA.train.num_examples)
    assert np.all(sizes[ids] > 0)  # an empty client (size 0) is never drawn by size


@pytest.mark.parametrize("call", ["run", "run_seeds", "sweep"])
def test_a_spec_and_a_settings_keyword_are_a_type_error_naming_it(no_compile, call):
    spec = RunSpec(num_rounds=2, cohort_size=3)
    with pytest.raises(TypeError, match=f"^cohort_size: given to {call}\\(\\) both"):
        if call == "run":
            runner.run(ALG, PARAMS, DATA, KEY, model=MODEL, spec=spec, cohort_size=3)
        elif call == "run_seeds":
            run_seeds(ALG, MODEL, DATA, (0,), spec=spec, cohort_size=3)
        else:
            sweep("qffl", {"q": [0.1]}, data=DATA, model=MODEL, spec=spec, cohort_size=3)
    with pytest.raises(TypeError, match="num_rounds"):
        runner.run(ALG, PARAMS, DATA, KEY, model=MODEL, cohort_size=3)


def test_drivers_refuse_spec_fields_they_do_not_take(no_compile):
    with pytest.raises(ValueError, match="^checkpoint_dir: run_seeds"):
        run_seeds(ALG, MODEL, DATA, (0,), spec=RunSpec(2, 3, checkpoint_dir="x"))
    with pytest.raises(ValueError, match="^system: sweep"):
        sweep("qffl", {"q": [0.1]}, data=DATA, model=MODEL,
              spec=RunSpec(2, 3, system=object()))
    with pytest.raises(TypeError, match="^spec: must be a RunSpec"):
        runner.run(ALG, PARAMS, DATA, KEY, model=MODEL, spec=dict(num_rounds=2))


def test_make_programs_builds_a_run_s_chunk_program_evaluator_and_plan():
    from fedjax_fair.drivers.spec import check_run
    spec, key, validate = check_run(ALG, PARAMS, DATA, KEY, MODEL, RunSpec(**SETTINGS))
    state = ALG.init(PARAMS, N)
    programs = make_programs(ALG, MODEL, DATA, spec, state=state, key=key, validate=validate)
    assert programs.plan.placement == "device" and programs.first == 2
    new_state, metrics = programs.chunk(programs.first)(state, programs.data, key,
                                                       programs.step_budgets, np.int32(2))
    per_client, summary = programs.evaluate(new_state)
    want = runner.run(ALG, PARAMS, DATA, KEY, model=MODEL, progress=False,
                      **dict(SETTINGS, num_rounds=2))
    chex.assert_trees_all_equal(new_state, want.state)
    assert summary["accuracy_mean"] == want.history[-1]["accuracy_mean"]
