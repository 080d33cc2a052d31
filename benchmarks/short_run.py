"""Short runs end to end: ``fedjax-fair run`` against the same job in fedjax 0.0.17.

    python benchmarks/short_run.py                 # 50 rounds, 3 alternating pairs
    python benchmarks/short_run.py --rounds 10 50 200 --repeats 3
    python benchmarks/short_run.py --batch-size 20       # the issue-32 job at batch 20

Expected runtime: about a minute per (rounds, repeat) pair on an idle 2-core CPU.

The job a new user runs first: ``fedjax-fair run --dataset femnist_like --model mlp
--cohort-size 50 --num-rounds R`` (1000 FEMNIST-shaped clients with 50-200 train and
10 test rows, the MLP 784-200-200-62, FedAvg, batch 10, one local epoch, every client
evaluated every 10 rounds and at the end, outputs, checkpoints and plots written), and
benchmarks/references/fedjax_short_run.py: the same data shapes, model, cohort, rounds,
local steps and evaluations written with fedjax 0.0.17, run by its own interpreter
(``--fedjax-python``, default ``.venv-fedjax/bin/python``). Each is a fresh process
timed by the wall clock from launch to exit (imports, data, compiles, rounds,
evaluations, outputs), the two alternating so that a change in the machine's load
hits both. ``--variant "--devices all"`` times ``fedjax-fair run`` with those flags as
another column (one XLA:CPU device per core, sharding.provide_cpu_devices); a single
flag goes after an equals sign, ``--variant=--improvement``.
``--ours-root DIR`` runs another checkout of fedjax_fair (e.g. a ``git worktree`` of
the last commit) as another column, for before/after figures.

``fedjax-fair run`` is timed cold (its persistent compilation cache off: every
program compiled, as in a user's first run) and warm (the cache filled by one run of
the same job beforehand, as in every later run of a job of the same shapes).

Prints a table (median and min seconds of each, the ratio of medians), where each
column's seconds went (ours: compiling, the rounds with their evaluations, the rest;
fedjax: its set-up, rounds, evaluations, and the rest: its interpreter's start and
exit, outside the times its script reports) and the load average before and after;
``--json PATH`` writes the raw times.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def ours(root: str, rounds: int, eval_every: int, out: str, plots: bool,
         extra=(), cache: str = "off", batch_size: int = 10) -> dict:
    """``fedjax-fair run`` of the job; ``cache``: its persistent compilation cache
    directory (``FEDJAX_FAIR_COMPILATION_CACHE``), "off" for a cold start."""
    cmd = [sys.executable, "-m", "fedjax_fair.cli", "run", "--dataset", "femnist_like",
           "--model", "mlp", "--cohort-size", "50", "--num-rounds", str(rounds),
           "--eval-every", str(eval_every), "--batch-size", str(batch_size), "-o", out,
           "--overwrite", "--no-progress"]
    if not plots:
        cmd.append("--no-plots")
    cmd += list(extra)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env["FEDJAX_FAIR_COMPILATION_CACHE"] = cache
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if proc.returncode:
        raise RuntimeError(f"fedjax-fair run failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        timings = json.load(f)["timings"]
    return {"seconds": seconds, "compile_seconds": timings["compile_seconds"],
            "run_seconds": timings["run_seconds"]}


def theirs(python: str, rounds: int, eval_every: int, batch_size: int = 10) -> dict:
    cmd = [python, os.path.join(HERE, "references", "fedjax_short_run.py"),
           "--num-rounds", str(rounds), "--cohort-size", "50", "--eval-every", str(eval_every),
           "--batch-size", str(batch_size)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if proc.returncode:
        raise RuntimeError(f"fedjax reference failed:\n{proc.stderr[-3000:]}")
    reported = json.loads(proc.stdout.strip().splitlines()[-1])
    # its own "seconds" start after the interpreter and end before the exit: kept as
    # script_seconds, the wall clock (launch to exit, as for ours) is the column's
    return {**reported, "script_seconds": reported["seconds"], "seconds": seconds}


def split(runs: list) -> dict:
    """Medians of where a column's seconds went: ours cold and warm, compiling
    (``compile_seconds``), the rounds with their evaluations (``run_seconds``) and the
    rest (imports, the data, the set-up, the outputs, the exit);
    fedjax its set-up, rounds, evaluations and the rest (its interpreter's start and
    exit)."""
    keys = {"ours": ("compile_seconds", "run_seconds"), "warm": ("compile_seconds", "run_seconds"),
            "fedjax": ("setup_seconds", "rounds_seconds", "eval_seconds")}
    out = {}
    for who, names in keys.items():
        mine = [r for r in runs if r["who"] == who]
        if not mine:
            continue
        med = lambda f: statistics.median(f(r) for r in mine)
        out[who] = {n.replace("_seconds", ""): med(lambda r: r[n]) for n in names}
        out[who]["rest"] = med(lambda r: r["seconds"] - sum(r[n] for n in names))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, nargs="+", default=[50])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=10, help="local batch of both")
    p.add_argument("--no-plots", action="store_true", help="run ours with --no-plots")
    p.add_argument("--fedjax-python", default=os.environ.get(
        "FEDJAX_PYTHON", os.path.join(ROOT, ".venv-fedjax", "bin", "python")))
    p.add_argument("--ours-root", default=None,
                   help="another checkout of fedjax_fair, timed as a third column")
    p.add_argument("--variant", default=None,
                   help="extra flags of `fedjax-fair run` timed as another column, "
                        "e.g. '--devices all'")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    have_fedjax = os.path.exists(a.fedjax_python)
    if not have_fedjax:
        print(f"fedjax 0.0.17 not found at {a.fedjax_python}: its column is skipped")
    rows, raw, parts = [], [], []
    print(f"load average before: {load()}")
    with tempfile.TemporaryDirectory() as tmp:
        for rounds in a.rounds:
            times = {"ours": [], "fedjax": [], "warm": [], "other": [], "variant": []}
            cache = os.path.join(tmp, f"cache{rounds}")
            # fills the cache: the warm column's runs load from it
            ours(ROOT, rounds, a.eval_every, os.path.join(tmp, "warm"), not a.no_plots,
                 cache=cache, batch_size=a.batch_size)
            compiles = []
            for rep in range(a.repeats):
                r = ours(ROOT, rounds, a.eval_every, os.path.join(tmp, "ours"), not a.no_plots,
                         batch_size=a.batch_size)
                times["ours"].append(r["seconds"])
                compiles.append(r["compile_seconds"])
                raw.append({"rounds": rounds, "who": "ours", **r, "load": load()})
                if have_fedjax:
                    r = theirs(a.fedjax_python, rounds, a.eval_every, a.batch_size)
                    times["fedjax"].append(r["seconds"])
                    raw.append({"rounds": rounds, "who": "fedjax", **r, "load": load()})
                r = ours(ROOT, rounds, a.eval_every, os.path.join(tmp, "warm"),
                         not a.no_plots, cache=cache, batch_size=a.batch_size)
                times["warm"].append(r["seconds"])
                raw.append({"rounds": rounds, "who": "warm", **r, "load": load()})
                if a.variant:
                    r = ours(ROOT, rounds, a.eval_every, os.path.join(tmp, "variant"),
                             not a.no_plots, a.variant.split(), batch_size=a.batch_size)
                    times["variant"].append(r["seconds"])
                    raw.append({"rounds": rounds, "who": "variant", **r, "load": load()})
                if a.ours_root:
                    r = ours(a.ours_root, rounds, a.eval_every, os.path.join(tmp, "other"),
                             not a.no_plots, batch_size=a.batch_size)
                    times["other"].append(r["seconds"])
                    raw.append({"rounds": rounds, "who": "other", **r, "load": load()})
                print(f"  rounds {rounds} repeat {rep + 1}: " + ", ".join(
                    f"{k} {v[-1]:.2f}s" for k, v in times.items() if v) + f" (load {load()})",
                      flush=True)
            rows.append((rounds, times, statistics.median(compiles)))
            parts.append((rounds, split([r for r in raw if r["rounds"] == rounds])))
    print(f"load average after: {load()}")
    head = f"{'rounds':>6} | {'fedjax-fair run':>18} | {'compile':>7}"
    if have_fedjax:
        head += f" | {'fedjax 0.0.17':>16} | {'ours / fedjax':>13}"
    head += f" | {'warm cache':>18} | {'warm / fedjax':>13}"
    if a.variant:
        head += f" | {a.variant:>16} | {'it / fedjax':>11}"
    if a.ours_root:
        head += f" | {'--ours-root':>16} | {'ours / it':>9}"
    print(head + "\n" + "-" * len(head))
    fmt = lambda v: f"{statistics.median(v):6.2f} (min {min(v):5.2f})"
    for rounds, t, comp in rows:
        line = f"{rounds:>6} | {fmt(t['ours']):>18} | {comp:6.2f}s"
        if have_fedjax:
            line += (f" | {fmt(t['fedjax']):>16} | "
                     f"{statistics.median(t['ours']) / statistics.median(t['fedjax']):13.2f}")
        line += f" | {fmt(t['warm']):>18} | " + (
            f"{statistics.median(t['warm']) / statistics.median(t['fedjax']):13.2f}"
            if have_fedjax else f"{'-':>13}")
        if a.variant:
            line += f" | {fmt(t['variant']):>16} | " + (
                f"{statistics.median(t['variant']) / statistics.median(t['fedjax']):11.2f}"
                if have_fedjax else f"{'-':>11}")
        if a.ours_root:
            line += (f" | {fmt(t['other']):>16} | "
                     f"{statistics.median(t['ours']) / statistics.median(t['other']):9.2f}")
        print(line)
    print("seconds: wall clock of a fresh process, launch to exit (median of "
          f"{a.repeats}, alternating); compile: the cold run's compile_seconds (median); "
          "fedjax-fair run cold (persistent compilation cache off) and warm (the cache "
          "filled by an earlier run of the same job)")
    print("\nwhere the seconds go (medians):")
    for rounds, part in parts:
        for who, d in part.items():
            print(f"  {rounds} rounds, {who}: " + ", ".join(f"{k} {v:.2f}" for k, v in d.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
