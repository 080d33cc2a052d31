"""Executes every notebook's code cells in one namespace (no Jupyter kernel needed) and
checks what each one shows: a behaviour, not its printed text.

Notebooks are stored without outputs; their plots go to ``FEDJAX_FAIR_NOTEBOOK_OUT``
(here a temporary directory) and are checked to be readable PNGs. Their settings are
small by default (each notebook has a commented line to scale up); together they take
about two minutes on a 2-core CPU.
"""
import json
import pathlib

import numpy as np
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
CHANCE = 0.1  # every federation here has 10 classes


def execute(path) -> dict:
    namespace: dict = {}
    notebook = json.loads(path.read_text())
    assert notebook["nbformat"] == 4
    cells = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert notebook["cells"][0]["cell_type"] == "markdown", "the command or config comes first"
    for i, cell in enumerate(cells):
        assert not cell.get("outputs") and cell.get("execution_count") is None, \
            f"{path.name}: stored with outputs"
        exec(compile("".join(cell["source"]), f"{path.name}[cell {i}]", "exec"), namespace)
    return namespace


def _png(path):
    import matplotlib.image
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0, path


def _check_00(ns, out):
    result = ns["result"]
    assert [h["round"] for h in result.history] == [0, 10, 20, 30]
    assert result.history[-1]["accuracy_mean"] > max(CHANCE, result.history[0]["accuracy_mean"])
    assert 0 <= ns["summary"]["gini"] <= 1
    assert ns["summary"]["worst_10%"] <= ns["summary"]["mean"] <= ns["summary"]["best_10%"]


def _check_01(ns, out):
    # The gradient through a whole federated run matches a finite difference.
    np.testing.assert_allclose(ns["grad"], ns["fd"], rtol=0.05)
    assert np.all(np.asarray(ns["accs"]) > CHANCE)


def _check_02(ns, out):
    plain, mixed = ns["afedpd_weights"], ns["mixed_weights"]
    np.testing.assert_allclose(mixed.sum(axis=1), 1.0, rtol=1e-5)  # weights over the cohort
    assert np.allclose(plain[-1], plain[-1].max())  # A-FedPD: the plain (uniform) average
    assert mixed[-1].max() > 1.1 * mixed[-1].min()  # AAggFF-D: learned, not uniform
    for name in ("afedpd_result", "mixed_result", "dqn_prox_result"):
        assert ns[name].history[-1]["accuracy_mean"] > 2 * CHANCE, name


def _check_03(ns, out):
    for name, r in ns["results"].items():
        assert len(r.history) == ns["ROUNDS"] // ns["EVAL_EVERY"] + 1, name
        assert r.history[-1]["accuracy_mean"] > CHANCE, name
    worst = {name: r.history[-1]["accuracy_worst_10%"] for name, r in ns["results"].items()}
    assert max(v for k, v in worst.items() if k != "FedAvg") > worst["FedAvg"]
    for png in ("fairness_distributions.png", "fairness_worst10.png", "fairness_ecdf.png"):
        _png(out / png)


def _check_04(ns, out):
    values = ns["result"].values
    assert values[-1] < values[0]  # the meta-optimiser improved the validation objective
    worst = ns["worst"]
    assert worst[1] >= worst[0]  # and held-out worst-10% accuracy did not drop
    _png(out / "meta_schedule.png")


def _check_05(ns, out):
    r = ns["result"]
    assert [a.name for a in r.axes] == ["q", "client_lr", "seed"]
    assert r.summary["accuracy_worst_10%"].shape == (len(ns["Q"]), len(ns["LR"]), 1)
    assert ns["worst"].shape == (len(ns["Q"]), len(ns["LR"]))
    assert ns["worst"].max() > CHANCE and ns["mean"].max() > 5 * CHANCE
    _png(out / "sweep_heatmap.png")


def _check_06(ns, out):
    seconds = np.asarray(list(ns["seconds"].values()))
    assert np.all(np.isfinite(seconds)) and np.all(seconds > 0)
    sequential = ns["finals"]["sequential", max(ns["COHORTS"])]
    for (name, k), final in ns["finals"].items():
        assert ns["largest_difference"](final, ns["finals"]["sequential", k]) < 1e-4, name
    assert ns["largest_difference"](sequential, ns["state0"].params) > 0  # it trained
    _png(out / "scaling.png")


def _check_07(ns, out):
    assert ns["personal_result"].evaluated == "personal"
    assert ns["global_result"].evaluated == "global"
    assert ns["acc_personal"].mean() > ns["acc_global"].mean()  # two classes per client
    x, y = ns["x"], ns["y"]
    assert x.shape == (80, 8, 8, 1) and np.all(np.bincount(y) == 8)
    assert ns["cvae_result"].history[-1]["accuracy_mean"] > 3 * CHANCE
    _png(out / "personal_vs_global.png")
    _png(out / "synthetic_samples.png")


CHECKS = {f"{i:02d}": check for i, check in enumerate(
    [_check_00, _check_01, _check_02, _check_03, _check_04, _check_05, _check_06, _check_07])}


def test_every_notebook_has_a_check():
    assert sorted(p.name[:2] for p in NOTEBOOKS) == sorted(CHECKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDJAX_FAIR_NOTEBOOK_OUT", str(tmp_path))
    namespace = execute(path)
    CHECKS[path.name[:2]](namespace, tmp_path)
