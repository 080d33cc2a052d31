"""benchmarks/gpu_targets.py (issue 32's GPU benchmark): its zoo covers the model zoo
with the shapes auto's rule is tested on, the targets table reads the rows right, and
(slow) a --quick run and a spent budget on this CPU."""
import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import gpu_targets as G  # noqa: E402


def test_zoo_shapes_are_the_rule_tests_shapes():
    from fedjax_fair.models import MODELS
    from test_execution import ZOO_CHOICES
    assert sorted(G.ZOO_SHAPES) == sorted(MODELS)
    assert {name: shape for name, (shape, _) in ZOO_CHOICES.items()} == G.ZOO_SHAPES


def _row(model, k, contender, s):
    return {"model": model, "cohort": k, "contender": contender, "s_per_round": s,
            "show_peak": k == 1000, "peak_bytes": 3 * G.GiB if k == 1000 else None}


def test_targets_from_rows():
    run = G.Run(G.parse_args([]))
    run.rows = [_row("mlp", 1000, "torch loop", 3.0), _row("mlp", 1000, "auto -> vmap", 0.02),
                _row("cnn", 100, "torch loop", 0.08), _row("cnn", 100, "auto -> vmap", 0.04),
                _row("cnn", 1000, "auto -> chunked (100)", 0.16),
                _row("resnet18_gn", 10, "torch loop", "skipped: budget"),
                _row("resnet18_gn", 10, "auto -> sequential", 1.79)]
    got = {t["target"].split(":")[0]: t["status"] for t in G.evaluate_targets(run)}
    assert got == {"MLP, K = 1,000": "met", "LEAF CNN, K = 100": "missed",
                   "ResNet-18-GN, 10 clients x 50 steps x 50": "missed",
                   "(issue 14) LEAF CNN, K = 1,000": "met",
                   "GPU memory of a 1,000-client round reported": "reported"}
    run.rows = run.rows[1:]  # no torch loop at K = 1,000: not measured, not missed
    assert G.evaluate_targets(run)[0]["status"] == "not measured"
    # a ResNet-only run (its 10 clients are its largest cohort) reports no 1,000-client memory
    run.rows = [dict(_row("resnet18_gn", 10, "auto -> sequential", 1.49), show_peak=True,
                     peak_bytes=G.GiB, xla_bytes=G.GiB)]
    assert G.evaluate_targets(run)[-1]["status"] == "not measured"


def test_budget_estimate_grows_the_compile_with_the_clients_at_once():
    """A vmapped round compiles longer the more clients it holds (VGG-9 on an H200:
    5.4 s at 100 clients, 29 s at 1,000); the rounds scale with the cohort."""
    run = G.Run(G.parse_args(["--budget-s", "100"]))
    assert run.estimate("vgg9", "vmap", 1000, 3, 1000) == G.FIRST_COST_S
    run.history[("vgg9", "vmap")] = (100, 100, 5.4, 0.025)
    vmapped = run.estimate("vgg9", "vmap", 1000, 3, 1000)
    assert vmapped == pytest.approx(5.4 * 10 ** G.COMPILE_GROWTH + 4 * 0.25)
    assert 25 < vmapped < 35
    run.history[("vgg9", "chunked")] = (100, 8, 6.4, 0.05)  # the same 8 at once: not grown
    assert run.estimate("vgg9", "chunked", 1000, 3, 8) == pytest.approx(6.4 + 4 * 0.5)


@pytest.mark.slow
def test_quick_run_writes_every_row(tmp_path):
    out = tmp_path / "gpu.json"
    G.main(["--quick", "--jobs", "mlp", "--cohorts", "2", "--no-torch", "--strategies",
            "vmap,sequential", "--zoo", "--zoo-models", "logreg", "--zoo-cohorts", "2",
            "--json", str(out)])
    data = json.loads(out.read_text())
    assert [r["contender"] for r in data["rows"]] == ["floor", "auto -> sequential", "vmap"]
    assert all(isinstance(r["s_per_round"], float) for r in data["rows"])
    assert [r["contender"] for r in data["zoo"]] == ["auto -> sequential", "vmap"]
    assert data["targets"][-1]["status"].startswith("n/a")  # no memory statistics on a CPU


@pytest.mark.slow
def test_a_spent_budget_skips_the_rest(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    G.main(["--quick", "--no-torch", "--budget-s", "0", "--zoo", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["rows"] == [] and data["zoo"] == []
    assert capsys.readouterr().out.count("skipped: budget") == 5  # 3 jobs, 2 zoo models
