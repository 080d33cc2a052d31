"""The ``compare`` command (fedjax_fair/cli/compare.py), run in-process: its table and
plots, the default list of methods, seeds as one program, interrupts, resume and
diverged runs.

Every simulation here is tiny (Synthetic with 6 clients of at most 100 examples,
logistic regression, 2-4 rounds); compilation dominates the run time.
"""

import csv
import json
import os

import numpy as np
import pytest

from fedjax_fair import cli
from fedjax_fair.cli import compare as cli_compare
from fedjax_fair import reports as report
from fedjax_fair.cli import config as C
from fedjax_fair.algorithms import ALGORITHMS
from helpers import (CLI_TINY as TINY, CLI_DIGITS as DIGITS, png_ok as _png_ok,
                     one_line_error as _one_line_error)


def test_compare_writes_table_and_plots(tmp_path, capsys):
    out = tmp_path / "cmp"
    code = cli.main(["compare", *TINY, "--algorithms", "fedavg,fedprox", "--seeds", "1",
                     "--hp", "fedprox.mu=0.5", "--num-rounds", "2", "--eval-every", "2",
                     "-o", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "fedavg" in printed and "fedprox" in printed

    md = (out / "comparison.md").read_text()
    body = [l for l in md.splitlines() if l.startswith("| fed")]
    # grouped by family, each table led by FedAvg, the shared reference
    assert [l.split("|")[1].strip() for l in body] == ["fedavg (reference)", "fedprox"]
    assert "### primal-dual and drift correction" in md
    for header in ("Average", "Std", "Worst 10%", "Best 10%", "Gini", "Run (s)", "Compile"):
        assert header in md
    with open(out / "comparison.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["algorithm"] for r in rows] == ["fedavg", "fedprox"]
    assert [r["family"] for r in rows] == ["reference", "primal_dual"]
    for key in ("accuracy_mean_percent", "accuracy_std_percent", "accuracy_worst_10%_percent",
                "accuracy_best_10%_percent", "accuracy_gini", "run_seconds", "compile_seconds",
                "accuracy_mean_percent_seed_std"):
        assert all(np.isfinite(float(r[key])) for r in rows)
    assert all(r["num_seeds"] == "1" for r in rows)
    # one unit in both tables: the Markdown cell is the CSV value rounded
    for line, row in zip(body, rows):
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert cells[1] == row["prior"] == "size"  # which FedAvg a row is read against
        assert cells[2] == f"{float(row['accuracy_mean_percent']):.2f}"
        assert cells[4] == f"{float(row['accuracy_worst_10%_percent']):.2f}"
    _png_ok(out / "accuracy.png")
    _png_ok(out / "client_accuracy_hist.png")
    _png_ok(out / "improved_clients.png")
    page = (out / "report.html").read_text()  # self-contained: the figures inline
    assert page.count("data:image/png;base64,") >= 5 and "<table>" in page
    # the improved-clients share is on by default in compare (off in run: issue 50)
    assert json.loads((out / "config.json").read_text())["improvement"] is True
    rounds = report.read_jsonl(out / "fedprox" / "seed1" / "rounds.jsonl")
    assert [r["round"] for r in rounds] == [1, 2] and "improved_fraction" in rounds[0]
    run_summary = json.loads((out / "fedprox" / "seed1" / "summary.json").read_text())
    assert run_summary["config"]["hparams"] == {"mu": 0.5}
    assert run_summary["config"]["seed"] == 1
    assert (out / "fedavg" / "seed1" / "clients.csv").is_file()


def test_compare_defaults_cover_every_algorithm(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default output runs/compare_synthetic: not the user's
    cfg = cli.config_from_args(cli.build_parser().parse_args(["compare"]), C.CompareConfig)
    C.validate_compare(cfg)
    # Every algorithm but the full-participation ones (AAggFF-S, FedPD), which need
    # --cohort-size N --sampler full, and the generative ones (FedEvg, FedCVAE), whose
    # product is a synthetic data set: they are compared when named.
    # Both references: FedAvg size-weighted and, right after it, uniform (issue 48).
    expected = [a for a in ALGORITHMS if a not in ("aaggff_s", "fedpd", "fedevg", "fedcvae")]
    assert cfg.algorithms == expected[:1] + [C.UNIFORM_FEDAVG] + expected[1:]
    assert C.split_compare_hparams(cfg, ALGORITHMS)[C.UNIFORM_FEDAVG] == {
        "weight_by_size": False}
    assert cfg.dataset == "synthetic" and cfg.model == "logreg" and cfg.seeds == [0, 1, 2]


def test_compare_leaves_out_methods_that_refuse_the_model(tmp_path, monkeypatch, capsys):
    """The default list (no --algorithms) leaves out, in one line each, a method whose
    factory refuses the model (LG-FedAvg on one-layer logistic regression would be
    FedAvg); named with --algorithms it is a one-line error before compute."""
    import fedjax_fair.algorithms as A
    monkeypatch.setattr(C, "needs_full_participation",  # keep the run small: 3 methods
                        lambda a: a not in ("fedavg", "fedavg@uniform", "lg_fedavg", "fedper"))
    out = tmp_path / "cmp"
    code = cli.main(["compare", *TINY, "--num-rounds", "1", "--eval-every", "1", "--seeds",
                     "0", "--no-plots", "--no-improvement", "-o", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert any(l.startswith("left out lg_fedavg") and "shared_layers" in l
               for l in captured.out.splitlines()), captured.out
    saved = json.loads((out / "config.json").read_text())
    assert saved["algorithms"] == ["fedavg", "fedavg@uniform", "fedper"]
    assert saved["improvement"] is False
    assert not (out / "lg_fedavg").exists()
    rounds = report.read_jsonl(out / "fedper" / "seed0" / "rounds.jsonl")
    assert "improved_fraction" not in rounds[0] and "loss_after" not in rounds[0]
    assert A.get_method("lg_fedavg")  # still registered: refused only for this model
    code = cli.main(["compare", *TINY, "--algorithms", "fedavg,lg_fedavg", "--num-rounds", "1",
                     "-o", str(tmp_path / "named")])
    assert code != 0
    _one_line_error(capsys.readouterr().err, "shared_layers")


@pytest.mark.slow
def test_compare_of_generative_methods_gives_each_seed_its_initial_set(tmp_path):
    out = tmp_path / "cmp"
    assert cli.main(["compare", *DIGITS, "--algorithms", "fedevg,fedcvae", "--seeds", "0,1",
                     "--num-rounds", "1", "--hp", "fedevg.local_iters=1",
                     "--hp", "fedcvae.max_steps=1", "-o", str(out)]) == 0
    for name in ("fedevg", "fedcvae"):
        x0, x1 = (np.load(out / name / f"seed{s}" / "synthetic.npz")["x"] for s in (0, 1))
        assert not np.allclose(x0, x1)
        second = json.loads((out / name / "seed1" / "summary.json").read_text())
        assert second["timings"]["compile_seconds"] < 1.0  # the first seed's program
        assert "downstream_accuracy" in second["method_report"]


def test_diverged_compare_run_keeps_its_metrics_and_is_marked(tmp_path, capsys):
    out = tmp_path / "div"
    code = cli.main(["compare", *TINY, "--algorithms", "fedavg,fedprox",
                     "--hp", "fedprox.mu=1e38", "--num-rounds", "2", "--eval-every",
                     "1", "-o", str(out)])
    assert code == cli.EXIT_NONFINITE
    rows = report.read_jsonl(out / "fedprox" / "seed0" / "metrics.jsonl")
    assert [r["round"] for r in rows][:1] == [0]  # the evaluations before it diverged
    summary = json.loads((out / "summary.json").read_text())
    assert summary["labels"]["fedprox"] == "fedprox (diverged)"
    assert summary["labels"]["fedavg"] == "fedavg"
    assert "diverged" in summary["notes"]["fedprox"]
    _png_ok(out / "accuracy.png")


@pytest.mark.slow
def test_memory_plan_prints_once_per_compare_and_no_progress_floods_in_logs(tmp_path,
                                                                             capsys):
    # capsys's stderr is not a terminal: no progress bars, hence no carriage returns.
    assert cli.main(["compare", *TINY[:-1], "--algorithms", "fedavg,fedprox,scaffold",
                     "--num-rounds", "2", "--no-plots", "-o", str(tmp_path / "cmp")]) == 0
    captured = capsys.readouterr()
    assert sum(line.startswith("memory:") for line in captured.out.splitlines()) == 1
    assert "\r" not in captured.err and "\r" not in captured.out


# ------------------------------------------------------- compare: seeds as one program


def _run_files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _, files in os.walk(root) for f in files)


@pytest.mark.slow  # heavy; the default run keeps test_sweep's run_seeds == runner.run per seed
def test_compare_seeds_as_one_program_equal_one_run_per_seed(tmp_path):
    """``compare --seeds 0,1`` runs each algorithm's seeds through sweep.run_seeds; its
    files and numbers equal one runner.run per seed (``--sweep-seeds false``), with a
    validation split, a personalised method and a diverged method."""
    args = [*TINY, "--algorithms", "fedavg,ditto,fedprox", "--hp", "fedprox.mu=1e38",
            "--seeds", "0,1", "--num-rounds", "3", "--eval-every", "2",
            "--resplit", "0.6,0.2,0.2", "--no-plots"]
    swept, runs = str(tmp_path / "swept"), str(tmp_path / "runs")
    assert cli.main(["compare", *args, "-o", swept]) == cli.EXIT_NONFINITE
    assert cli.main(["compare", *args, "--sweep-seeds", "false", "-o", runs]) == \
        cli.EXIT_NONFINITE
    assert _run_files(swept) == _run_files(runs)
    for alg in ("fedavg", "ditto", "fedprox"):
        for seed in (0, 1):
            a, b = (os.path.join(root, alg, f"seed{seed}") for root in (swept, runs))
            ha, hb = (report.read_jsonl(os.path.join(d, "metrics.jsonl")) for d in (a, b))
            assert [h["round"] for h in ha] == [h["round"] for h in hb]
            for x, y in zip(ha, hb):
                assert x.keys() == y.keys()
                for k in x:
                    if k != "seconds":
                        np.testing.assert_allclose(x[k], y[k], rtol=1e-5, atol=1e-6)
            ra, rb = (report.read_jsonl(os.path.join(d, "rounds.jsonl")) for d in (a, b))
            assert [r["client_ids"] for r in ra] == [r["client_ids"] for r in rb]
            sa, sb = (json.loads(open(os.path.join(d, "summary.json")).read()) for d in (a, b))
            assert sa.keys() == sb.keys() and sa["status"] == sb["status"]
            if alg == "fedprox":  # diverged: the same rounds, the same evaluations kept
                assert sa["status"] == "non_finite"
                assert (sa["non_finite_round"], sa["last_good_round"]) == (
                    sb["non_finite_round"], sb["last_good_round"])
                continue
            assert sa["evaluated"] == sb["evaluated"]
            ca, cb = (report.read_client_csv(os.path.join(d, "clients.csv")) for d in (a, b))
            np.testing.assert_allclose(ca["accuracy"], cb["accuracy"], atol=1e-6)
            np.testing.assert_allclose(ca["loss"], cb["loss"], rtol=1e-5)
            na, nb = (np.load(os.path.join(d, "clients_over_time.npz")) for d in (a, b))
            assert sorted(na.files) == sorted(nb.files)
            for k in na.files:
                np.testing.assert_allclose(na[k], nb[k], rtol=1e-5, atol=1e-6)
    strip = lambda path: [l.split("|")[1:7] for l in open(path).read().splitlines()
                          if l.startswith(("| fed", "| dit"))]
    assert strip(os.path.join(swept, "comparison.md")) == strip(
        os.path.join(runs, "comparison.md"))


@pytest.mark.slow
def test_compare_resume_runs_the_missing_seeds_as_one_program(tmp_path, monkeypatch):
    """A comparison interrupted after its first algorithm resumes with the missing
    seeds of the others run together; the table equals an uninterrupted one."""
    from fedjax_fair.drivers import runner
    out, fresh = str(tmp_path / "cmp"), str(tmp_path / "fresh")
    args = [*TINY, "--algorithms", "fedavg,qffl", "--seeds", "0,1", "--num-rounds", "2",
            "--no-plots"]
    real = cli_compare._compare_seeds
    calls = []

    def stop_after_first(*a, **k):  # as if Ctrl-C came during the first algorithm's seeds
        calls.append((a[0], list(a[2])))
        runner.request_stop()
        return real(*a, **k)

    monkeypatch.setattr(cli_compare, "_compare_seeds", stop_after_first)
    assert cli.main(["compare", *args, "-o", out]) == cli.EXIT_INTERRUPTED
    assert calls == [("fedavg", [0, 1])]
    assert not os.path.exists(os.path.join(out, "qffl"))
    calls.clear()
    monkeypatch.setattr(cli_compare, "_compare_seeds", lambda *a, **k: (calls.append(a[0]),
                                                                real(*a, **k))[1])
    assert cli.main(["compare", "-o", out, "--resume", "--no-progress"]) == 0
    assert calls == ["qffl"]
    assert cli.main(["compare", *args, "-o", fresh]) == 0
    strip = lambda path: [l.split("|")[1:7] for l in open(path).read().splitlines()
                          if l.startswith(("| fed", "| qff"))]
    assert strip(os.path.join(out, "comparison.md")) == strip(
        os.path.join(fresh, "comparison.md"))


# ---------------------------------------------------------- interrupts and resume


def test_sigterm_stops_compare_cleanly_with_finished_runs_on_disk(tmp_path):
    """A real SIGTERM during a comparison's second run: one line, exit 130, the first
    run's outputs and the table of finished runs on disk."""
    import signal
    import subprocess
    import sys
    import time
    out = str(tmp_path / "cmp")
    proc = subprocess.Popen([sys.executable, "-m", "fedjax_fair.cli", "compare", *TINY,
                             "--algorithms", "fedavg,fedprox", "--seeds", "0",
                             "--num-rounds", "3000", "--eval-every", "1", "--no-plots",
                             "-o", out], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    first = os.path.join(out, "fedavg", "seed0", "summary.json")
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None and not os.path.isfile(first):
        time.sleep(0.01)
    # into the second run, which writes nothing before it ends: its 3,000 rounds take
    # 1.5 s or more here even when its program comes from the compilation cache (with
    # 200 rounds, a cached second run once ended within the 1 s this test waited)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == cli.EXIT_INTERRUPTED
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: ") and "--resume" in err
    assert os.path.isfile(os.path.join(out, "fedavg", "seed0", "summary.json"))
    assert "| fedavg" in open(os.path.join(out, "comparison.md")).read()


@pytest.mark.slow  # heavy; the default run keeps the SIGTERM compare test
def test_interrupted_compare_keeps_finished_runs_and_resumes(tmp_path, capsys, monkeypatch):
    from fedjax_fair.drivers import runner
    out, fresh = str(tmp_path / "cmp"), str(tmp_path / "fresh")
    args = [*TINY, "--algorithms", "fedavg,fedprox,scaffold", "--num-rounds", "2",
            "--seeds", "0", "--no-plots"]
    real = cli_compare._compare_one
    calls = []

    def stop_after_first(*a, **k):  # as if Ctrl-C came during the second run
        calls.append(a[0])
        if len(calls) == 2:
            runner.request_stop()
        return real(*a, **k)

    monkeypatch.setattr(cli_compare, "_compare_one", stop_after_first)
    assert cli.main(["compare", *args, "-o", out]) == cli.EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert "2 of 3 runs finished" in err and "--resume" in err  # the second one ends its chunk
    assert os.path.isfile(os.path.join(out, "fedavg", "seed0", "summary.json"))
    assert not os.path.exists(os.path.join(out, "scaffold"))
    md = open(os.path.join(out, "comparison.md")).read()
    assert "| fedprox" in md and "| scaffold" not in md and "2 of 3 runs" in md

    calls.clear()
    monkeypatch.setattr(cli_compare, "_compare_one", real)
    assert cli.main(["compare", "-o", out, "--resume", "--no-progress"]) == 0
    assert cli.main(["compare", *args, "-o", fresh]) == 0
    strip = lambda path: [l.split("|")[1:7] for l in open(path).read().splitlines()
                          if l.startswith("| fed") or l.startswith("| sca")]
    assert strip(os.path.join(out, "comparison.md")) == strip(
        os.path.join(fresh, "comparison.md"))
    # --resume keeps the saved settings
    assert cli.main(["compare", "-o", out, "--resume", "--num-rounds", "3"]) == cli.EXIT_CONFIG
