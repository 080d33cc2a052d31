"""The ``sweep`` command (fedjax_fair/cli/sweep.py), run in-process: its table equals
separate ``run``s, static hyper-parameters split the grid into programs, bad grids are
refused before compute, an interrupted sweep resumes to the same outputs, ``rebuild``
rewrites the same tables.

Every simulation is tiny (Synthetic with 6 clients of at most 100 examples, logistic
regression, 1-3 rounds); compilation dominates, and the test session's on-disk XLA
cache (tests/conftest.py) shares the programs of identical sweeps.
"""
from __future__ import annotations

import csv
import json
import os
import signal

import numpy as np
import pytest

from fedjax_fair import cli
from fedjax_fair.cli import config as C
from fedjax_fair import reports as report
from fedjax_fair.cli import sweep as cli_sweep
from helpers import CLI_TINY, one_line_error, png_ok
from reliability_common import ReachedCompute, _no_compute

RESPLIT = ["--resplit", "0.6,0.2,0.2"]  # a validation split: the selection has one
GRID = ["--algorithm", "qffl", "--grid", "q=0,1", "--grid", "client_lr=0.1"]
# calls of 2 runs (one seed's grid points) on every backend: the interrupt lands between two
SWEEP = ["sweep", *CLI_TINY, *RESPLIT, *GRID, "--seeds", "0,1", "--num-rounds", "3",
         "--tile-size", "2"]
OUTPUTS = ("sweep.md", "sweep.csv", "runs.json")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 2 x 1 grid x 2 seeds: (its folder, what it printed)."""
    import contextlib
    import io
    out = tmp_path_factory.mktemp("sweep") / "ref"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = cli.main([*SWEEP, "-o", str(out)])
    assert code == 0
    return out, printed.getvalue()


def _md_rows(path) -> list:
    """The cells of the first table of sweep.md (the printed one), one list a row."""
    lines = path.read_text().split("\n\n")[1].splitlines()
    return [[c.strip() for c in line.split("|")[1:-1]] for line in lines[2:]]


def test_sweep_table_equals_separate_runs(reference, tmp_path):
    out, _ = reference
    record = json.loads((out / "runs.json").read_text())
    assert [a["name"] for a in record["axes"]] == ["q", "client_lr"]
    finals = {}
    for q in (0, 1):
        for seed in (0, 1):
            run = tmp_path / f"q{q}_seed{seed}"
            assert cli.main(["run", *CLI_TINY, *RESPLIT, "--algorithm", "qffl", "--hp",
                             f"q={q}", "--client-lr", "0.1", "--seed", str(seed),
                             "--num-rounds", "3", "--eval-every", "3", "--no-plots",
                             "--no-checkpoint", "-o", str(run)]) == 0
            finals[q, seed] = json.loads((run / "summary.json").read_text())["final"]
    shared = [k for k in record["keys"] if k in finals[0, 0]]
    assert {"accuracy_mean", "accuracy_worst_10%", "accuracy_gini", "test_loss",
            "validation_accuracy_mean"} <= set(shared)
    for p, q in enumerate((0, 1)):  # points in C order: (q=0, lr), (q=1, lr)
        for s, seed in enumerate((0, 1)):
            for key in shared:
                np.testing.assert_allclose(record["summary"][key][p][s],
                                           finals[q, seed][key], rtol=1e-5, atol=1e-6,
                                           err_msg=f"q={q} seed={seed} {key}")
    # the printed cells are the runs' mean ± std over seeds, to the digit
    rows = _md_rows(out / "sweep.md")
    for p, q in enumerate((0, 1)):
        agg = report.aggregate_runs([finals[q, 0], finals[q, 1]])
        mean, std = agg["accuracy_mean"]
        assert rows[p][:2] == [str(q), "0.1"]
        assert rows[p][2] == report._fmt(100 * mean, 100 * std, 2)
        mean, std = agg["accuracy_gini"]
        assert rows[p][6] == report._fmt(mean, std, 4)
    # the CSV holds the same numbers at full precision
    with open(out / "sweep.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    assert [(r["q"], r["client_lr"], r["num_seeds"]) for r in csv_rows] == [
        ("0.0", "0.1", "2"), ("1.0", "0.1", "2")]
    for p, q in enumerate((0, 1)):
        worst = [finals[q, s]["accuracy_worst_10%"] for s in (0, 1)]
        np.testing.assert_allclose(float(csv_rows[p]["accuracy_worst_10%_percent"]),
                                   100 * np.mean(worst), rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(float(csv_rows[p]["accuracy_worst_10%_percent_seed_std"]),
                                   100 * np.std(worst), rtol=1e-5, atol=1e-4)


def test_a_private_sweep_states_the_epsilon_it_spent(tmp_path, capsys):
    pytest.importorskip("dp_accounting")
    from fedjax_fair.scenarios import privacy
    out = tmp_path / "dp"
    assert cli.main(["sweep", *CLI_TINY, "--grid", "client_lr=0.01,0.1", "--seeds", "0",
                     "--num-rounds", "2", "--dp-noise", "1.5", "--dp-clip", "0.5",
                     "--no-plots", "-o", str(out)]) == 0
    spent = privacy.epsilon(1.5, 3 / 6, 2, 1e-5, sampling="fixed", population=6)
    record = json.loads((out / "runs.json").read_text())
    assert record["context"]["dp_epsilon"] == pytest.approx(spent, rel=1e-9)
    assert f"epsilon {spent:.3g}" in (out / "sweep.md").read_text().splitlines()[0]
    assert "client-level DP" in capsys.readouterr().out


def test_selection_is_by_validation_accuracy(reference):
    out, _ = reference
    record = json.loads((out / "runs.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    val = np.mean(record["summary"]["validation_accuracy_mean"], axis=1)
    best = int(np.argmax(val))
    assert summary["selected"]["point"] == best
    assert summary["selected"]["hparams"] == {"q": [0.0, 1.0][best], "client_lr": 0.1}
    np.testing.assert_allclose(summary["selected"]["test"]["accuracy_mean"]["mean"],
                               np.mean(record["summary"]["accuracy_mean"][best]))
    assert summary["runs"] == 4 and summary["grid_points"] == 2
    assert summary["config"]["grid"] == {"q": [0.0, 1.0], "client_lr": [0.1]}


def test_rebuild_writes_identical_tables(reference, capsys):
    out, printed = reference
    before = {name: (out / name).read_bytes() for name in OUTPUTS}
    for name in ("sweep.md", "sweep.csv", "heatmap.png"):
        (out / name).unlink()
    cli_sweep.rebuild(str(out))
    assert {name: (out / name).read_bytes() for name in OUTPUTS} == before
    png_ok(out / "heatmap.png")
    again = capsys.readouterr().out
    table = [line for line in printed.splitlines() if line.startswith("|")]
    assert len(table) == 4 and all(line in again.splitlines() for line in table)


def test_rebuild_of_an_unfinished_folder_is_refused(tmp_path):
    with pytest.raises(C.ConfigError) as e:
        cli_sweep.rebuild(str(tmp_path))
    assert e.value.field == "output_dir"


def _interrupt_after_first_part(monkeypatch, how: str) -> list:
    """Makes ``save_part`` interrupt the sweep once its first call is saved: a SIGINT
    (the stop request of ``stop_on_signals``) or a KeyboardInterrupt (a second
    Ctrl-C). Returns the list of saved paths."""
    saved = []
    original = cli_sweep.save_part

    def save_then_interrupt(path, *args):
        original(path, *args)
        saved.append(path)
        if len(saved) == 1:
            if how == "signal":
                os.kill(os.getpid(), signal.SIGINT)
            else:
                raise KeyboardInterrupt

    monkeypatch.setattr(cli_sweep, "save_part", save_then_interrupt)
    return saved


@pytest.mark.parametrize("how", ["signal", "keyboard"])
def test_resume_after_an_interrupt_gives_identical_outputs(reference, tmp_path, monkeypatch,
                                                           capsys, how):
    ref, _ = reference
    out = tmp_path / "stopped"
    saved = _interrupt_after_first_part(monkeypatch, how)
    assert cli.main([*SWEEP, "-o", str(out)]) == cli.EXIT_INTERRUPTED
    assert "--resume" in capsys.readouterr().err
    assert len(saved) == 1 and os.path.isfile(saved[0])
    assert not any((out / name).exists() for name in (*OUTPUTS, "summary.json"))
    monkeypatch.undo()
    calls = []
    original = cli_sweep.save_part
    monkeypatch.setattr(cli_sweep, "save_part", lambda path, *a: (calls.append(path),
                                                                  original(path, *a)))
    assert cli.main(["sweep", "-o", str(out), "--resume"]) == 0
    assert len(calls) == 1 and calls[0] != saved[0]  # only the call not saved ran
    for name in OUTPUTS:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["programs"][0]["calls_loaded"] == 1


def test_static_hyperparameters_split_the_grid_into_programs(tmp_path):
    out = tmp_path / "static"
    assert cli.main(["sweep", *CLI_TINY, "--algorithm", "fedavg", "--grid",
                     "batch_size=5,10", "--grid", "client_lr=0.05,0.1", "--seeds", "0",
                     "--num-rounds", "1", "--no-plots", "-o", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [p["static"] for p in summary["programs"]] == [{"batch_size": 5},
                                                          {"batch_size": 10}]
    assert sorted(os.listdir(out / "parts")) == ["program0", "program1"]
    with open(out / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["batch_size"], r["client_lr"]) for r in rows] == [
        ("5", "0.05"), ("5", "0.1"), ("10", "0.05"), ("10", "0.1")]
    losses = [float(r["test_loss"]) for r in rows]
    assert len(set(losses)) == 4  # each grid point ran its own setting
    assert not (out / "heatmap.png").exists()
    # no validation split: nothing is selected, the test split's best is only shown
    assert summary["selected"] is None and summary["best_on_test"]["hparams"]


def test_a_diverged_run_reads_nan_and_is_never_chosen(tmp_path):
    out = tmp_path / "diverged"
    assert cli.main(["sweep", *CLI_TINY, "--algorithm", "fedprox", "--grid", "mu=0,1e38",
                     "--seeds", "0", "--num-rounds", "2", "--no-plots", "-o", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["diverged_runs"] == 1
    assert summary["best_on_test"]["hparams"] == {"mu": 0.0}
    with open(out / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["num_diverged"] for r in rows] == ["0", "1"]
    assert np.isfinite(float(rows[0]["accuracy_mean_percent"]))
    # a NaN model still predicts a class: its accuracy is no measurement
    assert np.isnan(float(rows[1]["accuracy_mean_percent"]))


@pytest.mark.parametrize("grid", [["--grid", "nope=1,2"], ["--grid", "q=-1,1"],
                                  ["--grid", "q=abc"], ["--grid", "q=0,0"],
                                  ["--grid", "mode=faithful,bogus"], ["--grid", "q"],
                                  []])
def test_bad_grid_is_refused_before_compute(tmp_path, capsys, grid):
    out = tmp_path / "bad"
    with _no_compute():
        try:
            code = cli.main(["sweep", *CLI_TINY, "--algorithm", "qffl", *grid,
                             "--num-rounds", "1", "-o", str(out)])
        except ReachedCompute:
            pytest.fail("reached compute")
    assert code == cli.EXIT_CONFIG
    one_line_error(capsys.readouterr().err, "grid")
    assert not out.exists()


@pytest.mark.parametrize("flags,field", [
    (["--placement", "host"], "placement"), (["--devices", "2"], "devices"),
    (["--availability", "independent:0.5"], "availability"),
    (["--metric", "nope"], "metric"), (["--seeds", "2-1"], "seeds"),
    (["--algorithm", "fedevg"], "algorithm")])
def test_what_a_sweep_cannot_honour_is_refused(tmp_path, capsys, flags, field):
    out = tmp_path / "bad"
    with _no_compute():
        code = cli.main(["sweep", *CLI_TINY, "--algorithm", "qffl", "--grid", "q=0,1",
                         "--num-rounds", "1", *flags, "-o", str(out)])
    assert code == cli.EXIT_CONFIG
    one_line_error(capsys.readouterr().err, field)
    assert not out.exists()


def test_seeds_and_grid_syntax(tmp_path):
    assert C.coerce("seeds", "0-2,5", "seeds") == [0, 1, 2, 5]
    assert C.coerce("seeds", [1, "3-4"], "seeds") == [1, 3, 4]
    assert C.coerce("grid", ["q=0,0.5", "mode=faithful"], "grid") == {
        "q": [0, 0.5], "mode": ["faithful"]}
    # a config file's grid and the flags' are merged name by name, flags last
    path = tmp_path / "job.yaml"
    path.write_text("algorithm: qffl\ngrid:\n  q: [0, 1]\n  client_lr: 0.1\n")
    args = cli.build_parser().parse_args(["sweep", "--config", str(path), "--grid",
                                          "client_lr=0.01,0.03", "-o", str(tmp_path / "o")])
    cfg = cli_sweep.sweep_config(args)
    C.validate_sweep(cfg)
    assert cfg.grid == {"q": [0.0, 1.0], "client_lr": [0.01, 0.03]}
    assert cli_sweep.split_grid("qffl", {"batch_size": [5], "q": [0.0]}) == (["batch_size"],
                                                                            ["q"])
