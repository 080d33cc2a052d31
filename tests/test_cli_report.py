"""Tables and CSV files of fedjax_fair/reports/ (no simulation); its plots are
tested in tests/test_report.py."""

import csv

import numpy as np
import pytest

from fedjax_fair import reports as report


def test_comparison_table_mean_std():
    runs = [{"accuracy_mean": 0.8, "accuracy_std": 0.1, "accuracy_worst_10%": 0.5,
             "accuracy_best_10%": 1.0, "accuracy_gini": 0.1,
             "run_seconds": 1.0, "compile_seconds": 2.0},
            {"accuracy_mean": 0.6, "accuracy_std": 0.3, "accuracy_worst_10%": 0.3,
             "accuracy_best_10%": 0.9, "accuracy_gini": 0.2,
             "run_seconds": 3.0, "compile_seconds": 2.0}]
    agg = report.aggregate_runs(runs)
    assert agg["accuracy_mean"] == pytest.approx((0.7, 0.1))
    header, body = report.comparison_table({"a": agg}, num_seeds=2)
    assert body[0][:2] == ["a", "70.00 ± 10.00"]
    header, body = report.comparison_table({"a": report.aggregate_runs(runs[:1])}, num_seeds=1)
    assert body[0][1] == "80.00"
    md = report.markdown_table(header, body)
    assert md.splitlines()[0].startswith("| Algorithm")


def test_client_without_test_rows_is_empty_in_clients_csv(tmp_path):
    path = str(tmp_path / "clients.csv")
    report.write_client_csv(path, {"num_examples": np.array([3, 0]),
                                   "accuracy": np.array([0.5, 0.0]),
                                   "loss": np.array([1.2, 0.0])})
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["accuracy"] == "0.5" and rows[1]["accuracy"] == "" and rows[1]["loss"] == ""
    report.write_client_csv(path, {"num_examples": np.array([3, 0]),
                                   "accuracy": np.array([0.5, 0.0]),
                                   "loss": np.array([1.2, 0.0])}, names=["f_0007", "f_0123"])
    assert list(report.read_client_csv(path)["client"]) == ["f_0007", "f_0123"]
    back = report.read_client_csv(path)
    assert back["accuracy"][0] == 0.5 and np.isnan(back["accuracy"][1])
