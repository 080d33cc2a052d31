"""benchmarks/gpu_targets.py --large-cohort (issue 50: a 100,000-client round, chunked
and streamed, against 100 x the 1,000-client one) runs end to end at tiny sizes on this
CPU and prints its table (the figure itself is an accelerator's: docs/performance.md)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_large_cohort_prints_its_table(tmp_path):
    out = tmp_path / "large.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_targets.py"), "--large-cohort",
         "--quick", "--cohorts", "20,200", "--steps", "2", "--batch", "4", "--chunk-sizes", "4",
         "--reps", "2", "--json", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "streamed aggregation: True" in done.stdout
    # K, execution, rows, s/round, min s, us/client, x linear, compile s, XLA, plan, peak
    table = [[c.strip() for c in line.strip("|").split("|")]
             for line in done.stdout.splitlines() if line.startswith(("| 20 |", "| 200 |"))]
    assert [row[:3] for row in table] == [["20", "chunked (4)", "generated"],
                                          ["200", "chunked (4)", "generated"],
                                          ["20", "chunked (4)", "held"]]
    for row in table:
        assert all(math.isfinite(float(v)) and float(v) > 0 for v in row[3:6] + row[7:10])
        assert row[10] == "n/a"  # no memory statistics on a CPU
    assert [row[6] for row in table] == ["1.00", table[1][6], ""]
    assert math.isfinite(float(table[1][6]))

    data = json.loads(out.read_text())
    rows = data["large"]
    assert [(r["cohort"], r["rows"]) for r in rows] == [(20, "generated"), (200, "generated"),
                                                      (20, "held")]
    assert all(len(r["s_all"]) == 2 and r["plan_bytes"] > 0 for r in rows)
    assert rows[1]["x_linear"] == pytest.approx(
        rows[1]["s_median"] / (10 * rows[0]["s_median"]))
    target, memory = data["targets"]
    assert target["target"].startswith("K = 200, chunked (4): within 1.2x of 10 x")
    assert target["status"] in ("met", "missed") and math.isfinite(target["value"])
    assert memory["status"].startswith("n/a")
