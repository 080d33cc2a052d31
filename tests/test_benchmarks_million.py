"""The scaling benchmarks run end to end on a small federation (their figures are
docs/scaling.md's; here only that they run and print their tables)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(*args, cwd):
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", args[0]),
                           *args[1:]], cwd=cwd, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_million_clients_quick_prints_its_table(tmp_path):
    done = _bench("million_clients.py", "--quick", "--methods", "fedavg", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| fedavg")]
    assert len(rows) == 2 and "failed" not in done.stdout


@pytest.mark.slow
def test_million_clients_tables_prints_the_plan_and_the_peak(tmp_path):
    done = _bench("million_clients.py", "--tables", "--clients", "500", "--cohort", "20",
                  "--rounds", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines()
            if line.startswith(("| scaffold", "| mifa"))]
    assert len(rows) == 6
    assert {r.split("|")[2].strip() for r in rows} == {"lazy", "host", "disk"}
    assert "failed" not in done.stdout


@pytest.mark.slow
def test_prefetch_prints_the_hidden_share(tmp_path):
    done = _bench("prefetch.py", "--clients", "300", "--cohort", "20", "--rounds", "4",
                  "--pairs", "1", "--dir", str(tmp_path / "fed"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "medians:" in done.stdout and os.path.isdir(str(tmp_path / "fed") + "_300")
