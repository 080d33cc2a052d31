"""benchmarks/short_run.py (the short job against fedjax 0.0.17): the fedjax column is
its process's wall clock from launch to exit, not the time its script reports, and
each column's seconds are split into their medians (the rest: what the parts leave of
each run's wall clock)."""
import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import short_run as S  # noqa: E402


def test_fedjax_column_is_the_wall_clock_with_start_and_exit(tmp_path, monkeypatch):
    # a stand-in reference: reports 0.01 s of its own, then takes 0.5 s to exit
    (tmp_path / "references").mkdir()
    (tmp_path / "references" / "fedjax_short_run.py").write_text("import json, time\n"
                      "print(json.dumps({'seconds': 0.01, 'setup_seconds': 0.004,\n"
                      "                  'rounds_seconds': 0.005, 'eval_seconds': 0.001}))\n"
                      "time.sleep(0.5)\n")
    monkeypatch.setattr(S, "HERE", str(tmp_path))
    r = S.theirs(sys.executable, rounds=2, eval_every=1)
    assert r["script_seconds"] == pytest.approx(0.01)
    assert r["seconds"] >= 0.5
    assert S.split([{"who": "fedjax", **r}])["fedjax"]["rest"] >= 0.49


def test_split_gives_the_medians_of_each_columns_parts():
    runs = [{"who": "ours", "seconds": 8.0, "compile_seconds": 3.0, "run_seconds": 3.0},
            {"who": "ours", "seconds": 9.0, "compile_seconds": 3.5, "run_seconds": 3.1},
            {"who": "ours", "seconds": 8.5, "compile_seconds": 2.5, "run_seconds": 3.2},
            {"who": "fedjax", "seconds": 10.0, "setup_seconds": 2.0, "rounds_seconds": 7.0,
             "eval_seconds": 0.6}]
    parts = S.split(runs)
    assert set(parts) == {"ours", "fedjax"}  # no warm runs: no warm column
    assert parts["ours"] == pytest.approx({"compile": 3.0, "run": 3.1, "rest": 2.4})
    assert parts["fedjax"] == pytest.approx({"setup": 2.0, "rounds": 7.0, "eval": 0.6,
                                             "rest": 0.4})
    json.dumps(parts)  # what --json and the printout read
