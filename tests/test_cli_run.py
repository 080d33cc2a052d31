"""The ``run`` command (fedjax_fair/cli/run.py), run in-process: its outputs, its flags,
a resumed run's result, NaN, signals and a full disk.

Every simulation here is tiny (Synthetic with 6 clients of at most 100 examples,
logistic regression, 2-4 rounds); compilation dominates the run time.
"""

import csv
import json
import os

import numpy as np
import pytest

from fedjax_fair import cli
from fedjax_fair.cli import run as cli_run
from fedjax_fair import reports as report
from fedjax_fair.cli import config as C
from helpers import (CLI_TINY as TINY, CLI_DIGITS as DIGITS, png_ok as _png_ok,
                     one_line_error as _one_line_error, latest_step as _latest)


def _committed_round(meta) -> int:
    """The round of the newest committed save (-1 before the first; a step directory
    retention removes while it is read counts as none)."""
    try:
        return json.loads(open(meta()).read())["round"]
    except (OSError, ValueError):
        return -1


def test_run_writes_all_outputs(tmp_path, capsys):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("algorithm: fedprox\nhparams: {mu: 0.1}\nnum_rounds: 2\neval_every: 1\n"
                   "dataset_args: {num_clients: 6, max_examples: 100}\ncohort_size: 3\n")
    out = tmp_path / "out"
    # progress bars on (the default) to exercise them; the flag overrides the file.
    code = cli.main(["run", "--config", str(cfg), "--num-rounds", "3", "-o", str(out)])
    assert code == 0
    captured = capsys.readouterr()
    assert "fedprox" in captured.out and "Traceback" not in captured.err

    rows = report.read_jsonl(out / "metrics.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    for key in ("accuracy_mean", "accuracy_std", "accuracy_worst_10%", "accuracy_best_10%",
                "accuracy_gini", "test_loss"):
        assert all(np.isfinite(r[key]) for r in rows)
    assert all("train_loss" in r and "seconds" in r for r in rows[1:])

    with open(out / "clients.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == ["client_id", "client", "num_test_examples", "accuracy", "loss",
                              "ece", "mce", "model"]
    assert all(0.0 <= float(r["ece"]) <= float(r["mce"]) <= 1.0 for r in table)
    assert [r["client"] for r in table] == [str(i) for i in range(6)]  # no own ids
    assert {row["model"] for row in table} == {"global"}
    assert [int(r["client_id"]) for r in table] == list(range(6))
    assert all(0.0 <= float(r["accuracy"]) <= 1.0 for r in table)

    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok"
    assert summary["config"]["algorithm"] == "fedprox"
    assert summary["config"]["hparams"] == {"mu": 0.1}
    assert summary["config"]["num_rounds"] == 3  # flag over file
    assert summary["final"]["round"] == 3
    assert summary["final"] == {k: v for k, v in rows[-1].items() if k != "seconds"}
    for key in ("accuracy_mean", "accuracy_worst_10%", "accuracy_best_10%", "accuracy_gini"):
        assert key in summary["final"]
    assert summary["timings"]["compile_seconds"] > 0 and summary["timings"]["run_seconds"] > 0
    assert summary["improved_fraction_mean"] is None  # off by default in run (issue 50)
    assert not (out / "improved_clients.png").exists()
    assert summary["dataset"]["num_clients"] == 6
    for name in ("accuracy.png", "loss.png", "client_accuracy_hist.png"):
        _png_ok(out / name)
    assert os.path.isfile(os.path.join(_latest(out / "checkpoint"), "state.npz"))


def test_resume_gives_the_uninterrupted_result(tmp_path, capsys):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    args = TINY + ["--eval-every", "2", "--seed", "3", "--no-plots"]
    assert cli.main(["run", *args, "--num-rounds", "4", "-o", full]) == 0
    assert cli.main(["run", *args, "--num-rounds", "2", "-o", part]) == 0  # "interrupted"
    with open(os.path.join(part, "rounds.jsonl"), "a") as f:  # a chunk cut off mid-way
        f.write(json.dumps({"round": 3, "client_ids": [0]}) + "\n")
    assert cli.main(["run", *args, "--num-rounds", "4", "-o", part, "--resume"]) == 0
    assert "warning" not in capsys.readouterr().err
    # Per-round diagnostics continue without the rows of the cut-off chunk.
    assert (report.read_jsonl(os.path.join(part, "rounds.jsonl"))
            == report.read_jsonl(os.path.join(full, "rounds.jsonl")))
    assert [r["round"] for r in report.read_jsonl(os.path.join(full, "rounds.jsonl"))] == [
        1, 2, 3, 4]

    with open(os.path.join(full, "clients.csv")) as a, open(os.path.join(part, "clients.csv")) as b:
        assert a.read() == b.read()
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]
    rows_full = report.read_jsonl(os.path.join(full, "metrics.jsonl"))
    rows_part = report.read_jsonl(os.path.join(part, "metrics.jsonl"))
    assert strip(rows_full) == strip(rows_part)
    seconds = [r["seconds"] for r in rows_part[1:]]
    assert seconds == sorted(seconds)  # cumulative across the resume
    s_full = json.loads(open(os.path.join(full, "summary.json")).read())
    s_part = json.loads(open(os.path.join(part, "summary.json")).read())
    assert s_full["final"] == s_part["final"]
    assert s_full["improved_fraction_mean"] == s_part["improved_fraction_mean"]
    assert s_part["resumed_from_round"] == 2
    assert not os.path.exists(os.path.join(part, "accuracy.png"))


def _printed(out: str) -> tuple:
    """(the lines ``run`` prints before its result line, those after it)."""
    lines = out.splitlines()
    result = next(i for i, l in enumerate(lines) if ", round " in l and "accuracy:" in l)
    return lines[:result], lines[result + 1:]


def _improvement_state(before: list) -> str:
    """"on" or "off": what the run's first lines say of the improvement share."""
    import re
    said = [l for l in before if "improvement" in l]
    assert len(said) == 1, before
    states = set(re.findall(r"\b(on|off)\b", said[0]))
    assert len(states) == 1, said
    return states.pop()


def test_run_logs_the_improvement_share_only_with_the_flag(tmp_path, capsys):
    """Issue 50: ``run`` leaves the per-round improved-clients share (DQN-Fed eq. 29) off
    unless ``--improvement``, says which before its rounds, and for a method whose paper
    reports the share (DQN-Fed) suggests the flag at its end, only when it is off."""
    args = [*TINY, "--num-rounds", "2", "--eval-every", "2"]
    off = tmp_path / "off"
    assert cli.main(["run", *args, "--algorithm", "dqn_fed", "--no-plots", "-o", str(off)]) == 0
    before, after = _printed(capsys.readouterr().out)
    assert _improvement_state(before) == "off"
    assert any("--improvement" in l for l in after), after  # DQN-Fed's paper reports it
    rounds = report.read_jsonl(off / "rounds.jsonl")
    assert [r["round"] for r in rounds] == [1, 2]
    assert not any("improved_fraction" in r or "loss_after" in r for r in rounds)
    saved = json.loads((off / "summary.json").read_text())
    assert saved["config"]["improvement"] is False and saved["improved_fraction_mean"] is None

    on = tmp_path / "on"
    assert cli.main(["run", *args, "--algorithm", "dqn_fed", "--improvement",
                     "-o", str(on)]) == 0
    before, after = _printed(capsys.readouterr().out)
    assert _improvement_state(before) == "on"
    assert not any("--improvement" in l for l in after), after
    rounds = report.read_jsonl(on / "rounds.jsonl")
    assert all(0.0 <= r["improved_fraction"] <= 1.0 for r in rounds)
    saved = json.loads((on / "summary.json").read_text())
    assert saved["config"]["improvement"] is True
    assert 0.0 <= saved["improved_fraction_mean"] <= 1.0
    _png_ok(on / "improved_clients.png")

    other = tmp_path / "fedavg"  # a method whose paper does not report it: no suggestion
    assert cli.main(["run", *args, "--no-plots", "-o", str(other)]) == 0
    before, after = _printed(capsys.readouterr().out)
    assert _improvement_state(before) == "off"
    assert not any("improvement" in l for l in after), after


def test_a_run_recorded_with_the_improvement_share_resumes_with_it(tmp_path, capsys):
    """A run directory whose config.json has ``improvement: true`` (every run before
    issue 50 made it the flag) resumes without the flag: the share stays on."""
    out = str(tmp_path / "old")
    args = [*TINY, "--eval-every", "1", "--no-plots", "-o", out]
    assert cli.main(["run", *args, "--num-rounds", "1", "--improvement"]) == 0
    capsys.readouterr()
    assert cli.main(["run", *args, "--num-rounds", "2", "--resume"]) == 0
    before, _ = _printed(capsys.readouterr().out)
    assert _improvement_state(before) == "on"
    rounds = report.read_jsonl(os.path.join(out, "rounds.jsonl"))
    assert [r["round"] for r in rounds] == [1, 2]
    assert all("improved_fraction" in r for r in rounds)
    assert json.loads(open(os.path.join(out, "config.json")).read())["improvement"] is True


def test_nan_exits_3_with_round_and_keeps_checkpoint(tmp_path, capsys):
    out = tmp_path / "nan"
    code = cli.main(["run", *TINY, "--num-rounds", "4", "--eval-every", "2",
                     "--client-lr", "1e38", "-o", str(out)])
    assert code == 3
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "round 1" in err and "checkpoint" in err
    assert os.path.isfile(os.path.join(_latest(out / "checkpoint"), "state.npz"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "non_finite" and summary["non_finite_round"] == 1
    assert [r["round"] for r in report.read_jsonl(out / "metrics.jsonl")] == [0]


def test_run_on_a_tfds_dataset_with_the_issue_flags(tmp_path, capsys, monkeypatch):
    # The issue's command shape on mocked CIFAR-10 (no files, no network).
    import helpers
    out = tmp_path / "cifar"
    with helpers.mock_tfds(monkeypatch, num_examples=120):
        code = cli.main(["run", "--dataset", "cifar10", "--partition", "dirichlet",
                         "--alpha", "0.1", "--num-clients", "4", "--dataset-arg", "min_size=5",
                         "--model", "cnn", "--model-arg", "channels=[4,8]",
                         "--model-arg", "dense=16", "--augment", "cifar", "--num-rounds", "2",
                         "--eval-every", "1", "--cohort-size", "2", "--batch-size", "8",
                         "--no-progress", "--no-plots", "-o", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "data: cifar10 train: 4 clients" in printed and "in size buckets" in printed
    assert "memory: " in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"]["name"] == "cifar10"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dataset_args"]["alpha"] == 0.1 and cfg["augment"] == "cifar"


def test_personal_run_and_round_diagnostics(tmp_path):
    out = tmp_path / "superfed"
    assert cli.main(["run", *TINY, "--algorithm", "superfed", "--num-rounds", "2",
                     "--eval-every", "1", "--no-plots", "-o", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["evaluated"] == "personal"
    grid = summary["method_report"]  # SuPerFed's lambda grid, thesis Ch. II §4.2
    assert grid["acc_oracle_per_client"] >= grid["acc_best_lambda_avg"] >= grid["acc_lambda0"]
    assert 0.0 <= grid["best_lambda"] <= 1.0
    assert summary["client_table"]["rows_stored"] == summary["dataset"]["num_clients"]
    with open(out / "clients.csv", newline="") as f:
        assert {row["model"] for row in csv.DictReader(f)} == {"personal"}
    out = tmp_path / "qffl"
    assert cli.main(["run", *TINY, "--algorithm", "qffl", "--num-rounds", "2",
                     "--client-lr-schedule", "step:0.5@1", "--no-plots", "-o", str(out)]) == 0
    rounds = report.read_jsonl(out / "rounds.jsonl")
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:  # q-FFL's effective coefficients, one per participant
        assert len(r["server/coefficients"]) == len(r["client_ids"]) == len(r["weights"])
        assert 0 < sum(r["server/coefficients"]) <= 1 + 1e-6


def test_generative_run_writes_its_synthetic_set_and_downstream_report(tmp_path, capsys):
    out = tmp_path / "fedevg"
    assert cli.main(["run", *DIGITS, "--algorithm", "fedevg", "--num-rounds", "2",
                     "--hp", "local_iters=2", "--client-lr", "0.001", "-o", str(out)]) == 0
    assert "synthetic set (100 samples" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    report_ = summary["method_report"]  # FedEvg's downstream utility, thesis Ch. IV §4.2
    assert 0.0 <= report_["downstream_accuracy"] <= 1.0 and report_["num_synth"] == 100
    saved = np.load(out / "synthetic.npz")
    assert saved["x"].shape == (100, 8, 8, 1) and saved["y"].shape == (100,)
    assert 0.0 <= saved["x"].min() and saved["x"].max() <= 1.0
    _png_ok(out / "synthetic_samples.png")


def test_progress_bar_on_a_terminal_says_compiling(tmp_path, monkeypatch):
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert cli.main(["run", *TINY[:-1], "--num-rounds", "2", "--no-plots",
                     "-o", str(tmp_path / "run")]) == 0
    assert "compiling" in term.getvalue() and "\r" in term.getvalue()


def test_per_client_metrics_at_every_evaluation_survive_a_resume(tmp_path):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    args = [*TINY, "--eval-every", "1", "--no-plots"]
    assert cli.main(["run", *args, "--num-rounds", "3", "-o", full]) == 0
    assert cli.main(["run", *args, "--num-rounds", "2", "-o", part]) == 0
    assert cli.main(["run", "-o", part, "--resume", "--num-rounds", "3"]) == 0
    with np.load(os.path.join(full, "clients_over_time.npz")) as a, \
            np.load(os.path.join(part, "clients_over_time.npz")) as b:
        assert list(a["round"]) == [0, 1, 2, 3] and a["accuracy"].shape == (4, 6)
        for k in ("round", "accuracy", "loss", "num_test_examples"):
            np.testing.assert_array_equal(a[k], b[k])
        final = report.read_client_csv(os.path.join(full, "clients.csv"))
        np.testing.assert_allclose(a["accuracy"][-1], final["accuracy"], rtol=1e-6)


def test_leaf_user_ids_reach_clients_csv(tmp_path):
    import helpers
    rng = np.random.default_rng(0)

    def user(n):
        return rng.normal(size=(n, 4)).tolist(), (np.arange(n) % 3).tolist()

    users = ["writer_b", "writer_a", "writer_c"]
    train = {u: user(12) for u in users}
    test = {u: user(4) for u in users}
    helpers.write_leaf(tmp_path / "leaf" / "train" / "t.json", users, train)
    helpers.write_leaf(tmp_path / "leaf" / "test" / "t.json", users, test)
    out = tmp_path / "out"
    assert cli.main(["run", "--dataset", "leaf", "--dataset-arg",
                     f"path={tmp_path / 'leaf'}", "--cohort-size", "2", "--num-rounds", "1",
                     "--no-plots", "--no-progress", "-o", str(out)]) == 0
    table = report.read_client_csv(out / "clients.csv")
    assert sorted(table["client"]) == sorted(users)  # the users' own ids, row by row


@pytest.mark.parametrize("algorithm,mixing", [
    ("fedavg", "uniform"),
    # slow: the same flags as fedavg's case, which asserts all it does and more
    pytest.param("fedmgda_plus", "uniform", marks=pytest.mark.slow),
    ("scaffold", "size")])
def test_size_sampler_and_mixing_flags_reach_every_round(tmp_path, algorithm, mixing):
    """q-FFL's protocol: clients drawn by size without replacement, averaged simply."""
    out = tmp_path / "run"
    code = cli.main(["run", "--algorithm", algorithm, "--sampler", "size", "--mixing", mixing,
                     "--num-rounds", "3", "--eval-every", "3", "-o", str(out), *TINY])
    assert code == 0
    rows = report.read_jsonl(out / "rounds.jsonl")
    for row in rows:
        assert len(set(row["client_ids"])) == 3
        if algorithm == "fedavg":  # exactly the simple average
            np.testing.assert_allclose(row["weights"], 1 / 3, rtol=1e-6)
    saved = json.loads((out / "config.json").read_text())
    assert (saved["sampler"], saved["mixing"]) == ("size", mixing)


def test_initializer_flag_sets_the_starting_model(tmp_path):
    out = tmp_path / "run"
    assert cli.main(["run", "--initializer", "zeros", "--num-rounds", "1", "-o", str(out),
                     *TINY]) == 0
    first = report.read_jsonl(out / "metrics.jsonl")[0]
    assert first["round"] == 0
    assert first["test_loss"] == pytest.approx(np.log(10), rel=1e-5)  # all logits zero
    assert json.loads((out / "config.json").read_text())["initializer"] == "zeros"


def test_resplit_gives_validation_metrics_and_a_selected_round(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["run", "--resplit", "0.6,0.2,0.2", "--resplit-seed", "1",
                     "--num-rounds", "4", "--eval-every", "2", "-o", str(out), *TINY]) == 0
    assert "selected by validation" in capsys.readouterr().out
    rows = report.read_jsonl(out / "metrics.jsonl")
    assert all("validation_accuracy_mean" in r and "accuracy_mean" in r for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    best = max(rows, key=lambda r: r["validation_accuracy_mean"])
    assert summary["selected"]["round"] == best["round"]
    assert summary["selected"]["accuracy_mean"] == best["accuracy_mean"]
    assert summary["dataset"]["info"]["resplit"] == {"fractions": [0.6, 0.2, 0.2], "seed": 1}
    # a resumed run must keep the partition
    code = cli.main(["run", "-o", str(out), "--resume", "--resplit", "0.8,0.1,0.1",
                     "--num-rounds", "6"])
    assert code == 2
    assert "resplit" in capsys.readouterr().err


def test_compensate_server_lr_scales_the_server_rate(tmp_path, capsys):
    """FedAvgM (momentum 0) steps by server_lr_t x direction: compensated, server_lr_t
    grows as 1 / client_lr_t, so round t's step is 2^t times the direction."""
    import jax
    from fedjax_fair.drivers.simulate import simulate
    cfg = C.build(C.RunConfig, None, {"algorithm": "fedavgm", "hparams": {"momentum": 0.0},
                                      "client_lr_schedule": "exponential:0.5",
                                      "compensate_server_lr": True, "num_rounds": 3,
                                      "dataset_args": {"num_clients": 6, "max_examples": 100}})
    # (0.5^t underflows float32 by round 150: with the default rounds it is refused)
    C.validate_run(cfg)
    ds = cli.build_dataset(cfg)
    model = cli.build_model(cfg, ds)
    alg = cli.build_algorithm("fedavgm", model, cfg, cfg.hparams)
    state = alg.init(model.init(jax.random.key(0)), ds.num_clients)
    one_round = jax.jit(lambda s, key: simulate(alg, s, ds.data, key, num_rounds=1,
                                                cohort_size=3))
    for t in range(3):
        new, metrics = one_round(state, jax.random.key(t))
        step = np.sqrt(sum(float(np.sum((np.asarray(a) - np.asarray(b)) ** 2)) for a, b in
                           zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params))))
        assert step == pytest.approx(2.0 ** t * float(metrics["update_norm"][0]), rel=1e-4)
        state = new
    capsys.readouterr()
    assert cli.main(["run", "--algorithm", "fedavgm", "--compensate-server-lr",
                     "-o", str(tmp_path / "x"), *TINY]) == 2
    _one_line_error(capsys.readouterr().err, "compensate_server_lr")
    assert cli.main(["run", "--algorithm", "fedprox", "--compensate-server-lr",
                     "--client-lr-schedule", "exponential:0.9", "-o", str(tmp_path / "y"),
                     *TINY]) == 2
    _one_line_error(capsys.readouterr().err, "compensate_server_lr")
    assert cli.main(["run", "--algorithm", "fedavgm", "--compensate-server-lr",
                     "--client-lr-schedule", "exponential:0.9", "--num-rounds", "2",
                     "-o", str(tmp_path / "z"), *TINY]) == 0
    assert json.loads((tmp_path / "z" / "config.json").read_text())["compensate_server_lr"]


def test_run_turns_on_the_persistent_compilation_cache_unless_off(tmp_path, monkeypatch):
    """``run`` points jax's compilation cache at $FEDJAX_FAIR_COMPILATION_CACHE; "off"
    leaves it off, and a directory the user gave jax is kept."""
    import jax
    saved = (jax.config.jax_compilation_cache_dir,
             jax.config.jax_persistent_cache_min_compile_time_secs)
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv(cli.COMPILATION_CACHE_ENV, "off")
        cli._persistent_compilation_cache()
        assert jax.config.jax_compilation_cache_dir is None
        monkeypatch.setenv(cli.COMPILATION_CACHE_ENV, str(tmp_path / "xla"))
        cli._persistent_compilation_cache()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
        cli._persistent_compilation_cache()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
    finally:
        jax.config.update("jax_compilation_cache_dir", saved[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])


# ------------------------------------------------------- resume, interrupts and a full disk


@pytest.mark.slow
def test_resume_may_change_the_evaluation_frequency(tmp_path):
    out = str(tmp_path / "run")
    assert cli.main(["run", *TINY, "--num-rounds", "2", "--eval-every", "1", "-o", out]) == 0
    assert cli.main(["run", "-o", out, "--resume", "--num-rounds", "6", "--eval-every", "2",
                     "--no-progress"]) == 0
    rows = report.read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["round"] for r in rows] == [0, 1, 2, 4, 6]


@pytest.mark.slow  # heavy; the default run keeps test_resume_gives_the_uninterrupted_result
def test_a_moved_run_directory_resumes_from_its_own_checkpoint(tmp_path):
    """config.json records where the run was; a copied or moved run resumes from the
    checkpoint beside it, and writes only there."""
    import shutil
    first, moved = str(tmp_path / "first"), str(tmp_path / "moved")
    assert cli.main(["run", *TINY, "--num-rounds", "2", "-o", first]) == 0
    shutil.move(first, moved)
    assert cli.main(["run", "-o", moved, "--resume", "--num-rounds", "3",
                     "--no-progress"]) == 0
    assert not os.path.exists(first)
    rows = report.read_jsonl(os.path.join(moved, "metrics.jsonl"))
    assert rows[-1]["round"] == 3
    saved = json.loads(open(os.path.join(moved, "config.json")).read())
    assert saved["checkpoint_dir"] == os.path.join(moved, "checkpoint")


@pytest.mark.parametrize("signal_name", ["SIGINT", pytest.param("SIGTERM", marks=pytest.mark.slow)])
def test_signal_stops_run_cleanly_and_resume_finishes_it(tmp_path, signal_name):
    """A real SIGINT (Ctrl-C) or SIGTERM mid-run: exit 130 with one line, the
    checkpoint of the last finished chunk kept; --resume then gives the uninterrupted
    result."""
    import signal
    import subprocess
    import sys
    import time
    out, full = str(tmp_path / "run"), str(tmp_path / "full")
    # one device, as in this process (the default, auto, would split the cohort over
    # the subprocess's CPU devices: equal to float rounding, not bit for bit)
    args = ["run", *TINY, "--num-rounds", "400", "--eval-every", "1", "--no-plots",
            "--devices", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "fedjax_fair.cli", *args, "-o", out],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    def meta():  # the newest committed save's meta.json (a step directory)
        step = _latest(os.path.join(out, "checkpoint"))
        return os.path.join(step, "meta.json") if step else ""
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if _committed_round(meta) >= 2:
            break
        time.sleep(0.1)
    proc.send_signal(getattr(signal, signal_name))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == cli.EXIT_INTERRUPTED
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith("error: interrupted after round ") and "--resume" in err
    done = _committed_round(meta)
    assert 2 <= done < 400
    # Finishing it: a short target keeps the test fast, compared with a fresh run.
    target = str(done + 2)
    assert cli.main(["run", "-o", out, "--resume", "--num-rounds", target, "--no-progress"]) == 0
    assert cli.main(["run", *TINY, "--num-rounds", target, "--eval-every", "1", "--no-plots",
                     "--devices", "1", "-o", full]) == 0
    with open(os.path.join(full, "clients.csv")) as a, open(os.path.join(out, "clients.csv")) as b:
        assert a.read() == b.read()


@pytest.mark.parametrize("where", ["build_dataset", "simulate_one"])
def test_interrupt_before_the_first_round_is_one_line_and_writes_nothing(
        tmp_path, capsys, monkeypatch, where):
    """Ctrl-C while the data is built (outside the runner's stop_on_signals) or as the
    runner starts (a second signal, before any round): one line, exit 130, the output
    directory not even created."""
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli_run, where, interrupt)  # as cmd_run calls it
    out = tmp_path / "out"
    code = cli.main(["run", *TINY, "--num-rounds", "2", "-o", str(out)])
    assert code == cli.EXIT_INTERRUPTED
    _one_line_error(capsys.readouterr().err, "interrupted")
    assert not out.exists()


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_interrupt_while_plotting_leaves_no_summary_and_resume_writes_it(
        tmp_path, capsys, monkeypatch, how):
    """A real SIGINT / SIGTERM while the plots of a finished run are drawn: one line,
    exit 130, no summary.json claiming outputs that are not there (the metrics and the
    checkpoint are); --resume then writes the outputs, and summary.json lists the plots."""
    import gc
    import signal
    out = tmp_path / "out"
    real = report.save_figure
    calls = []

    def save_figure(fig, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            # raise_signal delivers to this (the main) thread before it returns;
            # os.kill may hand the signal to another of the process's threads (XLA's),
            # and the run went on to exit 0 in long xdist workers. The handler then
            # runs at the interpreter's next check, kept in this frame: a garbage
            # collection in between could run it inside a finalizer, where CPython
            # reports the KeyboardInterrupt as "ignored" and drops it.
            gc.disable()
            try:
                signal.raise_signal(getattr(signal, how))
                for _ in range(3):  # a backward jump: the handler raises here
                    pass
            finally:
                gc.enable()
        return real(fig, path, *args, **kwargs)

    monkeypatch.setattr(report, "save_figure", save_figure)
    handler = signal.getsignal(getattr(signal, how))
    code = cli.main(["run", *TINY, "--num-rounds", "2", "--eval-every", "1", "-o", str(out)])
    assert code == cli.EXIT_INTERRUPTED, (calls, handler)
    _one_line_error(capsys.readouterr().err, "interrupted")
    assert not (out / "summary.json").exists()
    assert len(report.read_jsonl(out / "metrics.jsonl")) == 3
    monkeypatch.setattr(report, "save_figure", real)
    assert cli.main(["run", "-o", str(out), "--resume", "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["plots"]
    for name in summary["plots"]:
        _png_ok(out / name)


def test_full_disk_is_one_line_naming_the_output_directory(tmp_path, capsys, monkeypatch):
    """No space left while the results are written: one line naming output_dir, a
    non-zero exit that is not the bad-input 2, the checkpoint and metrics kept."""
    import errno
    out = tmp_path / "out"
    real = report.write_json

    def write_json(path, obj):
        if str(path).endswith("summary.json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, obj)

    monkeypatch.setattr(report, "write_json", write_json)
    code = cli.main(["run", *TINY, "--num-rounds", "2", "--eval-every", "1", "--no-plots",
                     "-o", str(out)])
    assert code == cli.EXIT_WRITE and code not in (0, cli.EXIT_CONFIG)
    _one_line_error(capsys.readouterr().err, "output_dir")
    assert not (out / "summary.json").exists()
    assert len(report.read_jsonl(out / "metrics.jsonl")) == 3
    assert _latest(out / "checkpoint")


def test_full_disk_while_the_run_streams_its_metrics_is_one_line(tmp_path, capsys,
                                                                 monkeypatch):
    """The disk filling mid-run, as an evaluation is appended to metrics.jsonl: one
    line naming output_dir, exit EXIT_WRITE, no traceback."""
    import errno
    from fedjax_fair.drivers import runner
    out = tmp_path / "out"
    real = runner.run

    def run(*args, **kwargs):
        def full(*a, **k):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        kwargs["on_eval"] = full
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "run", run)
    code = cli.main(["run", *TINY, "--num-rounds", "2", "--eval-every", "1", "--no-plots",
                     "-o", str(out)])
    assert code == cli.EXIT_WRITE
    _one_line_error(capsys.readouterr().err, "output_dir")


def test_a_signal_inside_a_gc_callback_is_delivered_again_not_lost(monkeypatch):
    """JAX registers a garbage-collector callback, and an exception raised inside one
    is swallowed ("Exception ignored"): the command's handler sees that and sends the
    signal again 50 ms later, so that a SIGTERM during the outputs' writing still stops
    the command; anywhere else it raises at once."""
    import gc
    import os
    import signal
    import sys
    import threading
    frames = []

    def callback(phase, info):
        if phase == "start" and not frames:
            frames.append(sys._getframe())

    gc.callbacks.append(callback)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(callback)
        inside = frames[0]
    gc.callbacks.append(callback)  # the frame's code is a gc callback's while registered
    try:
        assert cli._in_gc_callback(inside) and not cli._in_gc_callback(sys._getframe())
        timers = []
        monkeypatch.setattr(threading, "Timer",
                            lambda delay, fn, args: timers.append((delay, fn, args)) or
                            type("T", (), {"start": lambda self: None})())
        cli._interrupt(signal.SIGTERM, inside)  # no exception: it would be lost
        assert timers == [(0.05, os.kill, (os.getpid(), signal.SIGTERM))]
        with pytest.raises(KeyboardInterrupt):
            cli._interrupt(signal.SIGTERM, sys._getframe())
    finally:
        gc.callbacks.remove(callback)


def test_a_table_outside_the_device_is_billed_and_resumes(tmp_path, capsys):
    """``--hp client_table=disk``: the run prints where the rows go and their bill
    before compute, records the form in summary.json, and a resumed run (its rows
    replayed from the checkpoint) ends where one uninterrupted run ends."""
    args = ["run", "--algorithm", "ditto", "--hp", "client_table=disk", "--eval-every", "1",
            "--cohort-size", "3", "--dataset-arg", "num_clients=8", "--no-plots",
            "--no-progress"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert cli.main(args + ["--num-rounds", "4", "-o", str(whole)]) == 0
    assert "client rows in" in capsys.readouterr().out
    assert cli.main(args + ["--num-rounds", "2", "-o", str(part)]) == 0
    assert cli.main(["run", "-o", str(part), "--resume", "--num-rounds", "4",
                     "--no-progress"]) == 0
    assert (part / "clients.csv").read_bytes() == (whole / "clients.csv").read_bytes()
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["client_table"]["form"] == "disk"
