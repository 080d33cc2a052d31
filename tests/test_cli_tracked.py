"""``--tracker`` (fedjax_fair/cli/tracked.py): ``run`` logs every evaluation as it
happens and continues the same tracked run on ``--resume``; ``compare`` logs one
tracked run per algorithm and seed under its folder; a tracker asked for but not
installed is one line before compute. Read back with TensorBoard's own reader."""
import importlib.util
import json
import os

import pytest

from fedjax_fair import cli
from helpers import CLI_TINY as TINY

ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
pytest.importorskip("tensorboardX")


def _scalars(logdir, tag="accuracy_mean"):
    acc = ea.EventAccumulator(str(logdir), size_guidance={ea.SCALARS: 0, ea.HISTOGRAMS: 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}, acc.Tags()["histograms"]


def _history(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_run_logs_each_evaluation_and_resume_continues_the_same_run(tmp_path):
    out = tmp_path / "run"
    args = ["run", *TINY, "--eval-every", "2", "--tracker", "tensorboard", "-o", str(out)]
    assert cli.main([*args, "--num-rounds", "4"]) == 0
    logdir = out / "tensorboard" / "fedavg" / "seed0"
    values, histograms = _scalars(logdir)
    assert values == pytest.approx({h["round"]: h["accuracy_mean"] for h in _history(out)})
    assert sorted(values) == [0, 2, 4] and histograms == ["clients/accuracy"]
    worst, _ = _scalars(logdir, "accuracy_worst_10pct")  # '%' is not a valid tag character
    assert set(worst) == {0, 2, 4}
    assert cli.main(["run", "-o", str(out), "--resume", "--num-rounds", "8",
                     "--tracker", "tensorboard"]) == 0
    values, _ = _scalars(logdir)
    assert sorted(values) == [0, 2, 4, 6, 8]  # appended: each step once
    assert values == pytest.approx({h["round"]: h["accuracy_mean"] for h in _history(out)})


def test_compare_logs_one_tracked_run_per_algorithm_and_seed(tmp_path):
    out = tmp_path / "cmp"
    assert cli.main(["compare", *TINY, "--algorithms", "fedavg,qffl", "--seeds", "0,1",
                     "--num-rounds", "2", "--eval-every", "1", "--tracker", "tensorboard",
                     "--no-plots", "-o", str(out)]) == 0
    for name in ("fedavg", "qffl"):
        for seed in (0, 1):
            values, histograms = _scalars(out / "tensorboard" / name / f"seed{seed}")
            history = _history(out / name / f"seed{seed}")
            assert values == pytest.approx({h["round"]: h["accuracy_mean"] for h in history})
            assert histograms == ["clients/accuracy"]


def test_a_tracker_that_is_not_installed_is_refused_before_compute(tmp_path, monkeypatch,
                                                                    capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("mlflow") else real(name, *a))
    out = tmp_path / "run"
    assert cli.main(["run", *TINY, "--tracker", "tensorboard,mlflow", "-o", str(out)]) \
        == cli.EXIT_CONFIG
    assert cli.main(["run", *TINY, "--tracker", "visdom", "-o", str(out)]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("error: tracker:") for line in err)
    assert not out.exists()  # nothing written


def test_sweep_logs_one_tracked_run_per_grid_point_and_seed(tmp_path):
    out = tmp_path / "sweep"
    assert cli.main(["sweep", *TINY, "--algorithm", "qffl", "--grid", "q=0,1",
                     "--seeds", "0,1", "--num-rounds", "2", "--tracker", "tensorboard",
                     "--no-plots", "-o", str(out)]) == 0
    record = json.loads((out / "runs.json").read_text())
    for p, q in enumerate((0, 1)):
        for s, seed in enumerate((0, 1)):
            values, histograms = _scalars(out / "tensorboard" / f"q={q}" / f"seed{seed}")
            assert values == pytest.approx({2: record["summary"]["accuracy_mean"][p][s]})
            assert histograms == ["clients/accuracy"]


def test_overwrite_replaces_the_folders_tracked_runs(tmp_path):
    out = tmp_path / "run"
    args = ["run", *TINY, "--num-rounds", "2", "--tracker", "tensorboard", "-o", str(out)]
    assert cli.main(args) == 0
    assert cli.main([*args, "--algorithm", "qffl", "--overwrite"]) == 0
    # the dashboards hold the new run only, as the folder's other results do
    assert sorted(p.name for p in (out / "tensorboard").iterdir()) == ["qffl"]
    assert sorted(p.name for p in (out / "tracking").iterdir()) == ["qffl"]
    values, _ = _scalars(out / "tensorboard" / "qffl" / "seed0")
    assert values == pytest.approx({h["round"]: h["accuracy_mean"] for h in _history(out)})


def test_a_run_refused_before_its_first_write_leaves_the_tracked_runs(tmp_path, monkeypatch):
    from fedjax_fair.cli import config as C, run as run_command
    out = tmp_path / "run"
    args = ["run", *TINY, "--num-rounds", "2", "--tracker", "tensorboard", "-o", str(out)]
    assert cli.main(args) == 0
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))

    def refused(*a, **k):  # as the runner's memory plan refuses, before any round
        raise C.ConfigError("batch_size", "too large for this test")
    monkeypatch.setattr(run_command, "simulate_one", refused)
    assert cli.main([*args, "--algorithm", "qffl", "--overwrite"]) == cli.EXIT_CONFIG
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
