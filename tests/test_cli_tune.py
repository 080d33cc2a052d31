"""``fedjax-fair compare --tune`` (cli/tune.py): each method searched on a validation
split with its own seeds, then compared at its selection on the test split."""
from __future__ import annotations

import csv
import dataclasses
import json

import numpy as np
import pytest

from fedjax_fair import cli
from fedjax_fair.cli import common, sweep as cli_sweep
from helpers import CLI_TINY as TINY, one_line_error

TUNED = ["compare", *TINY, "--tune", "--algorithms", "fedavg,qffl", "--seeds", "0,1",
         "--tune-seeds", "7,8", "--num-rounds", "3", "--eval-every", "3",
         "--grid", "qffl.q=0.1,5", "--grid", "qffl.client_lr=0.02,0.2"]


def _table(out) -> dict:
    """comparison.csv without the timing columns."""
    with open(out / "comparison.csv") as f:
        return {row["algorithm"]: {k: v for k, v in row.items() if "seconds" not in k}
                for row in csv.DictReader(f)}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune") / "cmp"
    assert cli.main([*TUNED, "-o", str(out)]) == 0
    return out


def test_each_method_is_searched_then_compared_at_its_selection(tuned):
    """tuning.json holds each method's space, selection and score; the searches are
    sweep folders on the tuning seeds; the table carries the selected setting, its
    score and the grid; the selected setting scores at least its default on
    validation when the default is a grid point."""
    record = json.loads((tuned / "tuning.json").read_text())
    assert record["seeds"] == [7, 8] and record["select"] == "accuracy_mean"
    methods = record["methods"]
    assert methods["qffl"]["space"] == {"q": [0.1, 5.0], "client_lr": [0.02, 0.2]}
    assert methods["fedavg"]["space"] == {"client_lr": [0.01, 0.02, 0.04, 0.08]}
    for name, r in methods.items():
        search = json.loads((tuned / "tune" / name / "summary.json").read_text())
        assert search["seeds"] == [7, 8] and search["selected"]["hparams"] == r["hparams"]
        assert r["key"] == "validation_accuracy_mean"
        if r["default"] is not None:
            assert r["score"]["mean"] >= r["default_score"]["mean"], name
    assert methods["qffl"]["default"] == {"q": 0.1, "client_lr": 0.02}
    config = json.loads((tuned / "config.json").read_text())
    assert not set(config["seeds"]) & set(record["seeds"])
    table = _table(tuned)
    assert json.loads(table["qffl"]["tuned_setting"]) == methods["qffl"]["hparams"]
    assert json.loads(table["qffl"]["grid"]) == methods["qffl"]["space"]
    assert float(table["qffl"]["validation_score"]) == methods["qffl"]["score"]["mean"]
    md = (tuned / "comparison.md").read_text()
    assert "Selected setting" in md and "At its defaults" in md


def test_the_tuned_rows_are_the_untuned_comparison_at_the_selected_setting(tuned, tmp_path):
    """The comparison's runs are ``compare`` at the selected values, bit for bit."""
    methods = json.loads((tuned / "tuning.json").read_text())["methods"]
    q, lr = methods["qffl"]["hparams"]["q"], methods["qffl"]["hparams"]["client_lr"]
    out = tmp_path / "plain"
    assert cli.main(["compare", *TINY, "--algorithms", "qffl", "--seeds", "0,1",
                     "--num-rounds", "3", "--eval-every", "3", "--hp", f"q={q}",
                     "--client-lr", str(lr), "-o", str(out)]) == 0
    plain, tuned_rows = _table(out)["qffl"], _table(tuned)["qffl"]
    for key, value in plain.items():
        if key not in ("family",):
            assert tuned_rows[key] == value, key


def test_the_selection_never_reads_the_test_split(tuned, tmp_path, monkeypatch):
    """A federation whose test labels are permuted selects the same settings with the
    same validation scores: the search reads only the training and validation rows."""
    build = common.build_dataset

    def permuted(cfg):
        ds = build(cfg)
        test = ds.host_data.test
        y = np.asarray(test.examples["y"])
        rng = np.random.default_rng(0)
        shuffled = test._replace(examples={**test.examples,
                                           "y": rng.permutation(y.reshape(-1)).reshape(y.shape)})
        return dataclasses.replace(ds, host_data=ds.host_data._replace(test=shuffled))

    monkeypatch.setattr(common, "build_dataset", permuted)
    monkeypatch.setattr(cli_sweep, "build_dataset", permuted)
    out = tmp_path / "permuted"
    assert cli.main([*TUNED, "-o", str(out)]) == 0
    a = json.loads((tuned / "tuning.json").read_text())["methods"]
    b = json.loads((out / "tuning.json").read_text())["methods"]
    for name in a:
        assert a[name]["hparams"] == b[name]["hparams"]
        assert a[name]["score"] == b[name]["score"]


def test_an_interrupted_search_resumes_to_the_same_comparison(tuned, tmp_path, monkeypatch,
                                                              capsys):
    """A stop during the second method's search keeps the finished calls; --resume
    continues and gives the uninterrupted comparison's tuning and table."""
    real = cli_sweep.execute
    calls = []

    def stop_at_second(cfg, **kw):
        calls.append(cfg.algorithm)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(cfg, **kw)

    out = tmp_path / "cmp"
    monkeypatch.setattr(cli_sweep, "execute", stop_at_second)
    capsys.readouterr()
    assert cli.main([*TUNED, "-o", str(out)]) == 130
    one_line_error(capsys.readouterr().err, "tun")
    monkeypatch.setattr(cli_sweep, "execute", real)
    assert cli.main(["compare", "-o", str(out), "--resume"]) == 0
    want = json.loads((tuned / "tuning.json").read_text())["methods"]
    got = json.loads((out / "tuning.json").read_text())["methods"]
    for name in want:
        assert got[name]["hparams"] == want[name]["hparams"]
        assert got[name]["score"] == want[name]["score"]
    assert _table(out) == _table(tuned)


@pytest.mark.parametrize("flags, field", [
    (["--grid", "qffl.q=1"], "grid"),  # no --tune
    (["--tune", "--grid", "nope.q=1"], "grid"),  # not a compared method
    (["--tune", "--grid", "q=1"], "grid"),  # no method prefix
    (["--tune", "--grid", "qffl.zz=1"], "grid"),  # not a hyper-parameter
    (["--tune", "--grid", "qffl.q=-1,1"], "grid"),  # out of its range
    (["--tune", "--hp", "q=1", "--client-lr", "0.1"], "grid"),  # nothing left to search
    (["--tune", "--select", "nope"], "select"),
    (["--tune", "--tune-seeds", "0,9"], "tune_seeds"),  # shared with --seeds
    (["--tune-budget", "4"], "tune_budget"),  # no --tune
    (["--tune", "--tune-budget", "0"], "tune_budget"),
])
def test_bad_tuning_options_are_refused_before_anything_is_written(flags, field, tmp_path,
                                                                    capsys):
    out = tmp_path / "cmp"
    code = cli.main(["compare", *TINY, "--algorithms", "qffl", "--num-rounds", "2", *flags,
                     "-o", str(out)])
    assert code == 2
    one_line_error(capsys.readouterr().err, field)
    assert not out.exists()


def test_the_sensitivity_figure_draws_each_search_along_the_client_rate(tuned, tmp_path):
    """tuning.png's curves: the selection summary along the client rate at the selected
    values of the other names, its mean over seeds the search's own numbers, the
    selected point's score the selection's; the figure is a readable PNG."""
    from fedjax_fair import reports
    from fedjax_fair.reports import compare as comparison
    from helpers import png_ok
    record = json.loads((tuned / "tuning.json").read_text())
    curves = comparison.sensitivity_curves(str(tuned), record)
    assert set(curves) == {"fedavg", "qffl"}
    q = curves["qffl"]
    assert q["x"] == [0.02, 0.2]
    chosen = record["methods"]["qffl"]
    i = q["x"].index(chosen["hparams"]["client_lr"])
    assert q["mean"][i] == pytest.approx(chosen["score"]["mean"])
    assert q["selected"] == (chosen["hparams"]["client_lr"], chosen["score"]["mean"])
    fig = reports.plot_sensitivity(curves, reference=["fedavg"])
    reports.save_figure(fig, str(tmp_path / "tuning.png"))
    png_ok(tmp_path / "tuning.png")
