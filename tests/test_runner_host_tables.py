"""``runner.run`` with client tables outside the device (``client_states.host`` /
``disk``; fedjax_fair/drivers/runner.py): every registered method's table given as
"host" or "disk" runs the lazy table's run to the bit; resume replays the rows from the
checkpoint; a diverging chunk's rows are undone; what cannot continue one run refuses
before compute."""
from __future__ import annotations

import inspect
import os

import jax
import numpy as np
import pytest

from fedjax_fair import runner
from fedjax_fair.algorithms import REGISTRY, build, get_method
from fedjax_fair.core import memory as mem
from fedjax_fair.core import client_states as cs
from fedjax_fair.core.algorithm import with_improvement
from fedjax_fair.data import synthetic
from fedjax_fair.drivers import sweeps
from fedjax_fair.hparams import FieldError
from fedjax_fair.scenarios import sampling
from fedjax_fair.models import get_model

DATA = synthetic(num_clients=12, max_examples=60, seed=3).host_data
MODEL = get_model("mlp", (60,), 10, hidden=(4,))
PARAMS = MODEL.init(jax.random.key(0))


def _table_args(name: str) -> list:
    """The factory arguments of method ``name`` that take a client table (their
    default is a table's name)."""
    out = []
    for p in inspect.signature(get_method(name).factory).parameters.values():
        if isinstance(p.default, str):
            try:
                cs.get_table(p.default)
            except ValueError:
                continue
            out.append(p.name)
    return out


WITH_TABLES = [n for n in sorted(REGISTRY) if _table_args(n)]
FAST = ("scaffold", "ditto", "mifa", "afedpd")


def _run(name: str, table: str, **kw):
    alg = with_improvement(build(name, MODEL, **{a: table for a in _table_args(name)}), MODEL)
    full = get_method(name).participation == "full"
    kw = {"num_rounds": 4, "eval_every": 2, **kw}
    return runner.run(alg, PARAMS, DATA, jax.random.key(1), model=MODEL,
                      cohort_size=12 if full else 5, progress=False, **kw)


def _assert_same_run(a, b, exact=False):
    """The same parameters, client metrics and round metrics: to the bit (``exact``,
    one program against itself), else to float rounding. (A table outside the device
    compiles another round program: with XLA's default flags every method came out
    bit-identical to the lazy table; under this suite's fast-compile flags,
    tests/conftest.py, XLA fuses A-FedPD's round differently, 1 ulp in one entry.)"""
    same = (np.testing.assert_array_equal if exact else
            lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-6, atol=1e-7))
    for x, y in zip(jax.tree.leaves(a.state.params), jax.tree.leaves(b.state.params)):
        same(np.asarray(x), np.asarray(y))
    for k in a.client_metrics:
        same(a.client_metrics[k], b.client_metrics[k])
    assert set(a.round_metrics) == set(b.round_metrics)
    for k in a.round_metrics:
        same(a.round_metrics[k], b.round_metrics[k])


def test_the_registry_has_methods_with_tables():
    assert set(FAST) <= set(WITH_TABLES) and len(WITH_TABLES) >= 15


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow)
                                  for n in WITH_TABLES])
def test_every_method_with_a_table_runs_the_lazy_run_with_rows_outside(name):
    """Four rounds, evaluated every two (personal models read from the host for the
    personalised methods), with the improvement log (which reads the rows of the state
    before each round after the round wrote): the host and disk tables give the lazy
    table's parameters, client metrics and round metrics to the bit."""
    lazy = _run(name, "lazy")
    for table in ("host", "disk"):
        outside = _run(name, table)
        _assert_same_run(outside, lazy)
        if outside.client_table is not None:  # a table of the method's clients
            assert outside.client_table["form"] == table
            assert outside.client_table["rows_stored"] == lazy.client_table["rows_stored"]


@pytest.mark.parametrize("table", ["host", "disk"])
def test_resume_replays_the_rows_from_the_checkpoint(table, tmp_path):
    """Three rounds, then a resume to seven in a fresh store (the rows come from the
    checkpoint's log, a segment per commit), equals seven rounds at once."""
    whole = _run("ditto", table, num_rounds=7, eval_every=1)
    ck = str(tmp_path / "ck")
    _run("ditto", table, num_rounds=3, eval_every=1, checkpoint_dir=ck)
    resumed = _run("ditto", table, num_rounds=7, eval_every=1, checkpoint_dir=ck, resume=True)
    _assert_same_run(resumed, whole, exact=True)
    assert len(os.listdir(os.path.join(ck, sorted(os.listdir(ck))[-1],
                                       f"{runner.CLIENT_ROWS}_0"))) > 1  # never merged


def test_a_diverging_chunk_leaves_the_rows_of_the_last_good_state():
    """A run that diverges keeps the rows of its last good evaluation: the state on
    the error reads the rows of a run stopped there."""
    alg = build("scaffold", MODEL, client_table="host", client_lr=1e12)
    run = lambda rounds: runner.run(alg, PARAMS, DATA, jax.random.key(1), model=MODEL,
                                    num_rounds=rounds, cohort_size=5, eval_every=1,
                                    progress=False)
    with pytest.raises(runner.NonFiniteError) as caught:
        run(20)
    good = caught.value.last_good_round
    assert good >= 1
    ids = np.arange(DATA.num_clients, dtype=np.int32)
    rows = alg.client_rows(caught.value.last_good_state, ids)
    expected = run(good).state
    for x, y in zip(jax.tree.leaves(rows), jax.tree.leaves(alg.client_rows(expected, ids))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_what_cannot_continue_one_run_refuses_before_compute(monkeypatch):
    alg = build("scaffold", MODEL, client_table="host")
    with pytest.raises(FieldError, match="client_table"):
        sweeps.run_seeds(alg, MODEL, DATA, [0, 1], num_rounds=2, cohort_size=4)
    with pytest.raises(FieldError, match="client_table"):
        sweeps.final_state(alg, PARAMS, DATA, jax.random.key(0), num_rounds=1,
                           cohort_size=4, sampler=sampling.uniform)
    monkeypatch.setattr(mem, "host_available", lambda: 1000)  # the bill does not fit
    with pytest.raises(FieldError, match="client_table"):
        runner.run(alg, PARAMS, DATA, jax.random.key(1), model=MODEL, num_rounds=2,
                   cohort_size=4, progress=False)
