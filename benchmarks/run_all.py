"""Every benchmark table in one command.

Run:   python benchmarks/run_all.py             (full suite; over an hour on a 2-core
                                                 CPU, not timed end to end:
                                                 round_throughput alone ~30 min)
       python benchmarks/run_all.py --quick     (the short form of each; 10 min on a
                                                 2-core CPU at load 3-4, 7 of them
                                                 server_step)
       python benchmarks/run_all.py --only round_throughput,server_step
       python benchmarks/run_all.py --out docs/bench/cpu2   (also keep JSON rows and plots)
       python benchmarks/run_all.py --dry-run   (print the commands, run nothing)

Each benchmark runs as its own process with its own command line (below), one after
another, its output streamed through; a benchmark that is missing or fails is
reported and the suite goes on. The summary at the end lists every benchmark's wall
seconds and exit status, and the load average (the machine may be shared: every
table compares contenders within its own run).

| benchmark | quick | full |
|---|---|---|
| round_throughput | ``--quick`` (MLP, cohorts 10 and 100) | cohorts 10 ... 10,000 (CNN 10 ... 1,000), widths, every strategy and reference |
| server_step | ``--quick`` (K = 10, 100) | K = 10, 100, 1000 |
| streamed_aggregation | ``--quick`` (MLP, cohort 1,000, sequential) | MLP and logistic regression, cohorts 100 and 1,000, every strategy |
| dqn_server_step | ``--quick`` | K = 10 ... 1000, d = 1e4 ... 1e7 |
| table_memory | shapes only | shapes only |
| skewed_federation | ``--quick`` | ``--quick`` on CPU (its defaults are GPU-sized) |
| generative | ``bill`` (shapes only) | ``methods`` (cohort 100, every method) |
| personalised | not run | ``methods`` (cohort 100, every method) |
| primal_dual | not run | ``methods`` |
| sharding | ``--cohort 100`` | defaults (8 CPU devices, cohort 1000; memory only) |
| mesh_server | FedAvg, FedLF, FedMGDA+ | ten server rules, one device against 2 CPU devices |
| gpu_targets | not run | on an accelerator only: FEMNIST CNN at 1,000 clients, ResNet-18-GN 10 x 50 steps |
| sweep | ``seeds --rounds 10`` | ``all`` (50 rounds) |
| short_run | 50 rounds, one pair | 50 and 10 rounds, 3 pairs, and ``--devices all`` |
| cpu_investigation | not run | ``all`` with ``--with-investigation`` |

Every script gets this checkout's ``fedjax_fair`` first on ``PYTHONPATH`` (so the
suite times the working tree, installed or not). Not run here: ``contract_overhead.py`` (times this checkout against an older commit in
a git worktree) and the long live runs of ``primal_dual.py`` / ``personalised.py`` /
``generative.py`` (``live``), which are experiments rather than tables.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from timing import load_average  # noqa: E402

# name -> (script, quick args or None to skip, full args or None to skip)
SUITE = {
    "round_throughput": ("round_throughput.py", ["--quick"], []),
    "server_step": ("server_step.py", ["--quick"], []),
    "streamed_aggregation": ("streamed_aggregation.py", ["--quick"], []),
    "dqn_server_step": ("dqn_server_step.py", ["--quick"], []),
    "table_memory": ("table_memory.py", [], []),
    "commit_overhead": ("commit_overhead.py", ["--skip-femnist", "--skip-e2e"], []),
    "skewed_federation": ("skewed_federation.py", ["--quick"], None),  # full: see below
    "generative": ("generative.py", ["bill"], ["methods"]),
    "personalised": ("personalised.py", None, ["methods"]),
    "primal_dual": ("primal_dual.py", None, ["methods"]),
    "sharding": ("sharding.py", ["--cohort", "100"], []),
    "mesh_server": ("mesh_server.py", ["--methods", "fedavg,fedlf,fedmgda_plus"], []),
    "gpu_targets": ("gpu_targets.py", None, []),  # accelerator only (command())
    "sweep": ("sweep.py", ["seeds", "--rounds", "10"], ["all"]),
    "short_run": ("short_run.py", ["--rounds", "50", "--repeats", "1"],
                  ["--rounds", "50", "10", "--repeats", "3", "--variant=--devices all"]),
    "cpu_investigation": ("cpu_investigation.py", None, ["all"]),
}
OPTIONAL = {"cpu_investigation"}  # only with --with-investigation


def command(name: str, quick: bool, out: str | None, gpu: bool) -> list | None:
    script, quick_args, full_args = SUITE[name]
    args = quick_args if quick else full_args
    if name == "skewed_federation" and not quick:
        args = [] if gpu else ["--quick"]
    if name == "gpu_targets" and not gpu:
        args = None
    if args is None:
        return None
    args = list(args)
    if name == "round_throughput" and out:
        tag = "quick" if quick else "full"
        args += ["--json", os.path.join(out, f"round_throughput_{tag}.json"),
                 "--plot", out]
    return [sys.executable, os.path.join(HERE, script)] + args


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default=None, help="comma list of benchmark names")
    ap.add_argument("--skip", default="", help="comma list of benchmark names")
    ap.add_argument("--with-investigation", action="store_true",
                    help="also run cpu_investigation.py all (full suite only)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    ap.add_argument("--out", default=None,
                    help="folder for round_throughput's JSON rows and PNG plots")
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else [
        n for n in SUITE if n not in OPTIONAL or args.with_investigation]
    skip = set(filter(None, args.skip.split(",")))
    unknown = [n for n in names + list(skip) if n not in SUITE]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; known: {list(SUITE)}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    import jax  # only to tell CPU from accelerator
    gpu = jax.default_backend() != "cpu"
    print(f"# run_all ({'quick' if args.quick else 'full'}) | {load_average()}", flush=True)
    summary, start = [], time.perf_counter()
    for name in names:
        if name in skip:
            continue
        cmd = command(name, args.quick, args.out, gpu)
        path = os.path.join(HERE, SUITE[name][0])
        if cmd is None:
            summary.append((name, "not run in this mode", 0.0))
            continue
        if not os.path.exists(path):
            summary.append((name, "missing", 0.0))
            continue
        print(f"\n{'=' * 88}\n# {name}: {' '.join(os.path.relpath(c) if c.endswith('.py') else c for c in cmd[1:])}"
              f"  ({load_average()})\n{'=' * 88}", flush=True)
        if args.dry_run:
            summary.append((name, "dry run", 0.0))
            continue
        t = time.perf_counter()
        root = os.path.dirname(HERE)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
        rc = subprocess.call(cmd, cwd=root, env=env)
        summary.append((name, "ok" if rc == 0 else f"exit {rc}", time.perf_counter() - t))
    total = time.perf_counter() - start
    print(f"\n{'=' * 88}\n# summary ({load_average()})\n| benchmark | status | wall s |\n|---|---|---|")
    for name, status, sec in summary:
        print(f"| {name} | {status} | {sec:.0f} |")
    print(f"| total | | {total:.0f} |", flush=True)
    return 0 if all(s in ("ok", "not run in this mode", "dry run")
                    for _, s, _ in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
