"""The command line's participation and clock options (cli/config.py, cli/common.py's
``system_of``): ``--availability``, ``--dropout``, ``--speeds``, ``--bandwidth``,
``--latency``, ``--deadline``, ``--system-seed``."""
from __future__ import annotations

import json

import numpy as np
import pytest

import helpers
from fedjax_fair import cli
from fedjax_fair import reports as report

SYSTEM = ["--availability", "size:0.2:0.9", "--dropout", "0.1", "--speeds", "lognormal:20:1",
          "--bandwidth", "1e5", "--latency", "0.1", "--deadline", "3:partial"]


def test_run_on_a_virtual_clock_writes_time_participation_and_the_time_plot(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["run", *helpers.CLI_TINY, *SYSTEM, "--num-rounds", "6",
                     "--eval-every", "3", "-o", str(out)]) == 0
    history = report.read_jsonl(out / "metrics.jsonl")
    clock = [h["clock_seconds"] for h in history]
    assert clock[0] == 0.0 and clock[2] > clock[1] > 0
    rows = report.read_jsonl(out / "rounds.jsonl")
    assert len(rows) == 6
    np.testing.assert_allclose(clock[2], sum(r["system/round_seconds"] for r in rows),
                               rtol=1e-5)
    assert all(r["system/round_seconds"] <= 3.0 + 1e-6 for r in rows)
    assert all(len(r["client_ids"]) == r["system/reported"] for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    part = summary["participation"]
    reported = sum(r["system/reported"] for r in rows)
    assert sum(part["counts"]) == reported and len(part["counts"]) == 6
    assert part["clock_seconds"] == pytest.approx(clock[-1])
    assert set(part["time_to_accuracy_mean"]) == {"0.5", "0.8", "0.9"}
    assert "accuracy_time.png" in summary["plots"]
    helpers.png_ok(out / "accuracy_time.png")
    assert summary["config"]["availability"] == "size:0.2:0.9"


def test_a_run_without_system_options_draws_the_same_cohorts_as_before(tmp_path):
    plain, same = tmp_path / "plain", tmp_path / "same"
    base = ["run", *helpers.CLI_TINY, "--num-rounds", "2", "--eval-every", "2", "--no-plots"]
    assert cli.main([*base, "-o", str(plain)]) == 0
    assert cli.main([*base, "--availability", "always", "--dropout", "none", "-o",
                     str(same)]) == 0
    assert (plain / "clients.csv").read_text() == (same / "clients.csv").read_text()
    assert "clock_seconds" not in report.read_jsonl(plain / "metrics.jsonl")[-1]


def test_compare_on_a_clock_plots_against_simulated_time(tmp_path):
    out = tmp_path / "cmp"
    assert cli.main(["compare", *helpers.CLI_TINY, *SYSTEM, "--algorithms", "fedavg,qffl",
                     "--seeds", "0,1", "--num-rounds", "4", "--eval-every", "2",
                     "-o", str(out)]) == 0
    helpers.png_ok(out / "accuracy_time.png")
    for seed in (0, 1):
        history = report.read_jsonl(out / "qffl" / f"seed{seed}" / "metrics.jsonl")
        assert history[-1]["clock_seconds"] > 0


def test_compare_without_a_clock_draws_no_time_figure(tmp_path):
    """Only the asynchronous methods keep a clock of their own (one second per step)
    without --speeds: a figure against simulated time would show them alone."""
    out = tmp_path / "cmp"
    assert cli.main(["compare", *helpers.CLI_TINY, "--algorithms", "fedavg,fedbuff",
                     "--hp", "fedbuff.concurrency=3", "--seeds", "0", "--num-rounds", "2",
                     "--eval-every", "2", "-o", str(out)]) == 0
    assert (out / "accuracy.png").exists() and not (out / "accuracy_time.png").exists()
    assert report.read_jsonl(out / "fedbuff" / "seed0" / "metrics.jsonl")[-1]["clock_seconds"] > 0


@pytest.mark.parametrize("flags, field", [
    (["--availability", "independent:1.5"], "availability"),
    (["--availability", "sometimes"], "availability"),
    (["--availability", "markov:0.7:0.6"], "availability"),
    (["--availability", "trace:/nonexistent/trace.npy"], "availability"),
    (["--dropout", "-0.1"], "dropout"),
    (["--speeds", "lognormal:0:1"], "speeds"),
    (["--speeds", "classes:0.5@1+0.5"], "speeds"),
    (["--deadline", "5"], "speeds"),  # a deadline without a clock
    (["--speeds", "fixed:1", "--deadline", "0.5"], "deadline"),  # nobody can make it
    (["--speeds", "fixed:1", "--deadline", "2:wait"], "deadline"),
    (["--speeds", "fixed:10", "--latency", "-1"], "latency"),
    (["--dropout", "speed:0.5:0.0"], "dropout"),  # tied to speeds that are not given
    (["--availability", "classes:0.5@1.5+0.5@0.2"], "availability"),
])
def test_bad_system_options_are_one_line_before_anything_is_written(tmp_path, capsys, flags,
                                                                     field):
    out = tmp_path / "out"
    code = cli.main(["run", *helpers.CLI_TINY, *flags, "--num-rounds", "2", "-o", str(out)])
    assert code == cli.EXIT_CONFIG
    helpers.one_line_error(capsys.readouterr().err, field)
    assert not out.exists()


def test_a_trace_of_another_federation_is_refused(tmp_path, capsys):
    trace = tmp_path / "trace.npy"
    np.save(trace, np.ones((4, 7), bool))  # 7 clients; the federation has 6
    out = tmp_path / "out"
    assert cli.main(["run", *helpers.CLI_TINY, "--availability", f"trace:{trace}",
                     "--num-rounds", "2", "-o", str(out)]) == cli.EXIT_CONFIG
    helpers.one_line_error(capsys.readouterr().err, "availability")
    np.save(trace, np.eye(6, dtype=bool)[[0, 1, 2, 3]] | np.eye(6, dtype=bool)[[3, 4, 5, 0]])
    assert cli.main(["run", *helpers.CLI_TINY, "--availability", f"trace:{trace}",
                     "--num-rounds", "4", "--eval-every", "4", "--no-plots",
                     "-o", str(out)]) == 0
    rows = report.read_jsonl(out / "rounds.jsonl")
    table = np.load(trace)
    for r, row in enumerate(rows):
        assert set(row["client_ids"]) <= set(np.flatnonzero(table[r % 4]))


def test_list_names_the_system_options(capsys):
    assert cli.main(["list", "system"]) == 0
    text = capsys.readouterr().out
    for flag in ("--availability", "--dropout", "--speeds", "--bandwidth", "--deadline",
                 "markov:P_OFF:P_ON", "trace:FILE", "lognormal:MEDIAN:SIGMA"):
        assert flag in text
