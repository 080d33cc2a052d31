"""``--unseen-clients``: ``run`` and ``compare`` hold clients out of training and
evaluate them at the end (summary.json's "unseen" block, clients_unseen.csv, run's
line); a bad fraction is refused before compute; the seen clients train exactly as a
federation built without the held-out ones."""
from __future__ import annotations

import csv
import json

import jax
import numpy as np
import pytest

import fedjax_fair as ff
from fedjax_fair import cli
from fedjax_fair.algorithms import build
from fedjax_fair import reports as report
from fedjax_fair.data import from_client_arrays, get_dataset
from fedjax_fair.models import get_model
from helpers import CLI_TINY as TINY, one_line_error

UNSEEN_KEYS = {"num_clients", "client_ids", "fraction", "seed", "evaluated", "adaptation",
               "final"}


def _seen_federation(ids):
    """Synthetic(num_clients=6, max_examples=100) built from the real rows of the
    clients ``ids`` alone (as a dataset without the others would be)."""
    ds = get_dataset("synthetic", num_clients=6, max_examples=100)
    h = ds.host_data

    def rows(split, key):
        return [np.asarray(split.examples[key])[k, :int(split.num_examples[k])] for k in ids]

    return from_client_arrays(rows(h.train, "x"), rows(h.train, "y"), rows(h.test, "x"),
                              rows(h.test, "y"), name="synthetic", num_classes=ds.num_classes)


def test_run_evaluates_the_held_out_clients_and_trains_only_the_others(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["run", *TINY, "--unseen-clients", "0.34", "--num-rounds", "2",
                     "--eval-every", "2", "--devices", "1", "--no-plots", "-o",
                     str(out)]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    block = summary["unseen"]
    assert set(block) == UNSEEN_KEYS
    assert block["num_clients"] == 2 and block["adaptation"] == "none"
    assert block["evaluated"] == "global" and block["fraction"] == 0.34
    ids = block["client_ids"]
    seen_ids = [k for k in range(6) if k not in ids]
    assert summary["dataset"]["num_clients"] == 4
    accuracy_keys = lambda d: {k for k in d if k.startswith("accuracy_")}
    assert accuracy_keys(block["final"]) == accuracy_keys(summary["final"])
    assert block["final"]["round"] == summary["final"]["round"] == 2
    unseen_table = report.read_client_csv(out / "clients_unseen.csv")
    assert list(unseen_table["client"]) == [str(k) for k in ids]
    assert np.isclose(np.mean(unseen_table["accuracy"]), block["final"]["accuracy_mean"])
    seen_table = report.read_client_csv(out / "clients.csv")
    assert list(seen_table["client"]) == [str(k) for k in seen_ids]
    line = next(l for l in printed.splitlines() if "never trained on (global" in l)
    assert f"{block['final']['accuracy_mean']:.4f}" in line
    assert f"{summary['final']['accuracy_mean']:.4f}" in line

    # the seen clients' training is that of a federation without the held-out clients
    ds = _seen_federation(seen_ids)
    model = get_model("logreg", ds.input_shape, ds.num_classes)
    result = ff.run(build("fedavg", model), model.init(jax.random.key(0)), ds.host_data,
                    jax.random.key(0), model=model, num_rounds=2, cohort_size=3,
                    eval_every=2, progress=False)
    history = report.read_jsonl(out / "metrics.jsonl")
    for got, want in zip(history, result.history):
        for key in ("round", "accuracy_mean", "accuracy_worst_10%", "test_loss"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=key)
    np.testing.assert_allclose(seen_table["accuracy"], result.client_metrics["accuracy"],
                               rtol=1e-6)


def test_compare_runs_hold_out_the_same_clients_and_adapt_personal_models(tmp_path):
    out = tmp_path / "cmp"
    assert cli.main(["compare", *TINY, "--algorithms", "fedavg,fedavg_ft", "--seeds", "0,1",
                     "--unseen-clients", "0.34", "--num-rounds", "2", "--eval-every", "2",
                     "--devices", "1", "--no-plots", "-o", str(out)]) == 0
    blocks = {}
    for name in ("fedavg", "fedavg_ft"):
        for seed in (0, 1):
            run_dir = out / name / f"seed{seed}"
            blocks[name, seed] = json.loads((run_dir / "summary.json").read_text())["unseen"]
            table = report.read_client_csv(run_dir / "clients_unseen.csv")
            assert len(table["client"]) == 2
    assert len({tuple(b["client_ids"]) for b in blocks.values()}) == 1  # one split for all
    assert blocks["fedavg", 0]["adaptation"] == "none"
    assert blocks["fedavg_ft", 0]["adaptation"] == "one round of the method's client procedure"
    assert blocks["fedavg_ft", 0]["evaluated"] == "personal"
    # the comparison shows seen and unseen side by side, mean over the seeds
    with open(out / "comparison.csv", newline="") as f:
        rows = {r["algorithm"]: r for r in csv.DictReader(f)}
    for name in ("fedavg", "fedavg_ft"):
        unseen = [blocks[name, s]["final"]["accuracy_mean"] for s in (0, 1)]
        assert float(rows[name]["unseen_accuracy_mean_percent"]) == pytest.approx(
            100 * np.mean(unseen))
    assert "Unseen avg (%)" in (out / "comparison.md").read_text()


@pytest.mark.parametrize("command,args", [
    ("run", ["--unseen-clients", "1.5"]),
    ("run", ["--unseen-clients", "-0.2"]),
    ("run", ["--unseen-clients", "nan"]),
    ("compare", ["--algorithms", "fedavg", "--unseen-clients", "1"]),
    # one client: nothing can be held out while one still trains
    ("run", ["--num-clients", "1", "--cohort-size", "1", "--unseen-clients", "0.5"])])
def test_bad_fractions_are_refused_before_compute(tmp_path, capsys, command, args):
    out = tmp_path / "out"
    assert cli.main([command, "--no-progress", *args, "-o", str(out)]) == 2
    one_line_error(capsys.readouterr().err, "unseen_clients")
    assert not out.exists()
