"""A tuned comparison against the untuned one, end to end (issue 48).

    python benchmarks/tuned_compare.py                  # the README's job, both commands
    python benchmarks/tuned_compare.py --algorithms fedavg,qffl --rounds 30   # quick
    python benchmarks/tuned_compare.py --cold           # every program compiled afresh

Expected runtime: about 15 minutes on an idle 2-core CPU (the README's job).

Runs ``fedjax-fair compare`` and ``fedjax-fair compare --tune`` with the same flags, one
after the other, each a fresh process timed by the wall clock from launch to exit, and
prints a table: the seconds of each, the ratio, and for the tuned one the seconds of the
searches and the number of grid points (from its ``tuning.json``). The issue's target:
the tuned comparison in at most 4x the untuned one's time. Record the figures and the
machine in docs/performance.md ("Tuned comparisons").

Both commands use jax's persistent compilation cache as ``fedjax-fair`` does
(``$FEDJAX_FAIR_COMPILATION_CACHE``), so programs compiled by an earlier run of the same
shapes are loaded, not compiled; ``--cold`` gives each command an empty cache of its
own (a user's first run), and the table says which.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _timed(args: list, cold: bool) -> float:
    env = dict(os.environ)
    if cold:
        env["FEDJAX_FAIR_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="xla_cache_")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fedjax_fair.cli", *args], check=True,
                   stdout=subprocess.DEVNULL, env=env)
    return time.perf_counter() - t0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", default=None, help="default: the README's list")
    parser.add_argument("--rounds", type=int, default=None, help="default: the README's 150")
    parser.add_argument("--out", default=None, help="a folder for both comparisons")
    parser.add_argument("--cold", action="store_true",
                        help="an empty compilation cache for each command")
    a = parser.parse_args(argv)
    out = a.out or tempfile.mkdtemp(prefix="tuned_compare_")
    flags = ["--no-progress"]
    if a.algorithms:
        flags += ["--algorithms", a.algorithms]
    if a.rounds:
        flags += ["--num-rounds", str(a.rounds)]
    plain = _timed(["compare", *flags, "-o", os.path.join(out, "untuned"), "--overwrite"], a.cold)
    tuned = _timed(["compare", "--tune", *flags, "-o", os.path.join(out, "tuned"),
                    "--overwrite"], a.cold)
    with open(os.path.join(out, "tuned", "tuning.json")) as f:
        methods = json.load(f)["methods"]
    searches = sum(r["seconds"] for r in methods.values())
    cache = "empty for each command" if a.cold else "the persistent one"
    points = sum(r["points"] for r in methods.values())
    print(f"| command | wall clock (s) | ratio |\n|---|---:|---:|\n"
          f"| compare | {plain:.1f} | 1.00 |\n"
          f"| compare --tune | {tuned:.1f} | {tuned / plain:.2f} |\n\n"
          f"compilation cache: {cache}; "
          f"{len(methods)} searches, {points} grid points, {searches:.1f} s of searching; "
          f"outputs in {out}")


if __name__ == "__main__":
    main()
