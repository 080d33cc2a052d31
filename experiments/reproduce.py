"""Runs the small-scale experiments (issues 4 and 10) and writes docs/reproducing.md.

    python experiments/reproduce.py                 # every experiment (~15 min, 2-core CPU)
    python experiments/reproduce.py --only aaggff_cross_silo --seeds 0
    python experiments/reproduce.py --reuse         # re-render from runs/reproduce/

Each experiment is a ``fedjax-fair compare`` config in this folder; this script runs
exactly ``fedjax-fair compare --config experiments/NAME.yaml`` (in-process), reads the
runs it wrote under ``runs/reproduce/NAME/``, and renders the tables:

* fairness experiments (AAggFF cross-silo / cross-device): the final per-client test
  accuracy's mean, worst 10% (test-size weighted, AAggFF §7), std and Gini, mean ±
  std over seeds;
* computational-heterogeneity experiments (IID / NIID / TNIID): R90 (rounds until the
  global model's test accuracy first reaches 90%, spec §5; 95% CI over seeds), the
  smoothness S of the accuracy curve, and the final accuracy;
* DQN-Fed experiments (CIFAR-10 setups 1 and 2 and the participation ablation at small
  scale): DQN-Fed's metrics (unweighted worst / best 10%), rounds to FedAvg's final
  accuracy and the share of improved clients (``dqn_table``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FAIRNESS = ("aaggff_cross_silo", "aaggff_cross_device", "aaggff_cross_device_synthetic")
COMPHET = ("comphet_iid", "comphet_niid", "comphet_tniid")
DQN = ("dqn_setup1", "dqn_setup2", "dqn_participation_50", "dqn_participation_10")
LEVEL = 0.9


def run_compare(name: str, out: str, seeds) -> None:
    from fedjax_fair import cli
    argv = ["compare", "--config", os.path.join(HERE, f"{name}.yaml"), "-o", out,
            "--no-progress", "--overwrite"]  # reruns replace the old ones
    if name not in DQN:  # DQN-Fed's improved-clients curves go into the page
        argv.append("--no-plots")
    if seeds:
        argv += ["--seeds", seeds]
    code = cli.main(argv)
    if code != 0:
        sys.exit(f"{name}: fedjax-fair compare exited with {code}")


def _histories(out: str) -> dict:
    """{algorithm: [history (list of eval dicts) per seed]} from a compare output."""
    summary = json.load(open(os.path.join(out, "summary.json")))
    runs = {}
    for alg in summary["config"]["algorithms"]:
        runs[alg] = []
        for seed in summary["config"]["seeds"]:
            path = os.path.join(out, alg, f"seed{seed}", "metrics.jsonl")
            runs[alg].append([json.loads(line) for line in open(path)])
    return runs


def _pm(values, scale=100.0, digits=1) -> str:
    v = scale * np.asarray(values, np.float64)
    return f"{v.mean():.{digits}f} ± {v.std():.{digits}f}" if v.size > 1 else f"{v[0]:.{digits}f}"


def fairness_table(out: str) -> str:
    rows = ["| algorithm | mean acc (%) | worst 10% (%) | std (%) | Gini |",
            "|---|---|---|---|---|"]
    for alg, hs in _histories(out).items():
        final = [h[-1] for h in hs]
        rows.append(f"| {alg} | {_pm([f['accuracy_mean'] for f in final])} | "
                    f"{_pm([f['accuracy_worst_10%'] for f in final])} | "
                    f"{_pm([f['accuracy_std'] for f in final])} | "
                    f"{_pm([f['accuracy_gini'] for f in final], 1.0, 4)} |")
    return "\n".join(rows)


def _improved(out: str, alg: str, seeds) -> list:
    """Mean improved fraction (DQN-Fed eq. 29) over the rounds of each seed's run."""
    values = []
    for seed in seeds:
        path = os.path.join(out, alg, f"seed{seed}", "rounds.jsonl")
        rows = [json.loads(line) for line in open(path)] if os.path.isfile(path) else []
        imp = [r["improved_fraction"] for r in rows if "improved_fraction" in r]
        if imp:
            values.append(np.mean(imp))
    return values


def dqn_table(out: str) -> str:
    """DQN-Fed's metrics (spec §6): mean, std and worst / best 10% (unweighted) of the
    final per-client accuracy; rounds until the global model's mean client accuracy
    first reaches FedAvg's final one (mean over seeds; "-" if never); the mean share of
    participants whose training loss did not rise (eq. 29)."""
    from fedjax_fair.metrics import rounds_to_reach
    seeds = json.load(open(os.path.join(out, "summary.json")))["config"]["seeds"]
    runs = _histories(out)
    target = np.mean([h[-1]["accuracy_mean"] for h in runs["fedavg"]])
    rows = [f"| algorithm | mean acc (%) | std (%) | worst 10% (%) | best 10% (%) | rounds to "
            f"FedAvg's {100 * target:.1f}% | improved clients (%) |",
            "|---|---|---|---|---|---|---|"]
    for alg, hs in runs.items():
        final = [h[-1] for h in hs]
        reach = []
        for h in hs:
            i = rounds_to_reach([e["accuracy_mean"] for e in h], target)
            reach.append(h[int(i)]["round"] if np.isfinite(i) else np.inf)
        hit = [r for r in reach if np.isfinite(r)]
        reach_text = (f"{np.mean(hit):.0f}" + (f" ({len(reach) - len(hit)} of {len(reach)} "
                                                f"never)" if len(hit) < len(reach) else "")
                      if hit else "never")
        imp = _improved(out, alg, seeds)
        rows.append(f"| {alg} | {_pm([f['accuracy_mean'] for f in final])} | "
                    f"{_pm([f['accuracy_std'] for f in final])} | "
                    f"{_pm([f['accuracy_worst_10%_unweighted'] for f in final])} | "
                    f"{_pm([f['accuracy_best_10%_unweighted'] for f in final])} | "
                    f"{reach_text} | {_pm(imp) if imp else 'n/a'} |")
    return "\n".join(rows)


def comphet_table(out: str) -> str:
    from fedjax_fair.metrics import confidence_interval, rounds_to_reach, smoothness
    rows = ["| algorithm | R90 (rounds) | R90 95% CI | not reached | smoothness S | final acc (%) |",
            "|---|---|---|---|---|---|"]
    for alg, hs in _histories(out).items():
        curves = [[e["accuracy_weighted_mean"] for e in h] for h in hs]  # global-model accuracy
        r = np.array([rounds_to_reach(c, LEVEL) for c in curves])
        hit = r[np.isfinite(r)]
        mean = f"{hit.mean():.1f}" if hit.size else "inf"
        ci = "{:.1f} .. {:.1f}".format(*confidence_interval(hit)) if hit.size > 1 else "n/a"
        s = np.mean([smoothness(c) for c in curves])
        rows.append(f"| {alg} | {mean} | {ci} | {r.size - hit.size} | {s:.3f} | "
                    f"{_pm([c[-1] for c in curves])} |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=None, help="comma list of experiment names")
    ap.add_argument("--seeds", default=None, help="override the configs' seeds, e.g. 0")
    ap.add_argument("--runs", default=os.path.join("runs", "reproduce"))
    ap.add_argument("--doc", default=os.path.join(ROOT, "docs", "reproducing.md"))
    ap.add_argument("--reuse", action="store_true",
                    help="render experiments already run under --runs instead of rerunning")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(FAIRNESS + COMPHET + DQN)
    sections = {}
    for name in names:
        out = os.path.join(args.runs, name)
        if not (args.reuse and os.path.exists(os.path.join(out, "summary.json"))):
            run_compare(name, out, args.seeds)
        table = (fairness_table(out) if name in FAIRNESS else dqn_table(out) if name in DQN
                 else comphet_table(out))
        figure = os.path.join(out, "improved_clients.png")
        if name in DQN and os.path.isfile(figure):
            os.makedirs(os.path.join(ROOT, "docs", "img"), exist_ok=True)
            shutil.copyfile(figure, os.path.join(ROOT, "docs", "img",
                                                 f"{name}_improved_clients.png"))
        sections[name] = table
        print(f"\n## {name}\n\n{table}\n", flush=True)
    if args.only is None:
        write_doc(args.doc, sections, args.seeds)
    else:
        print("(docs/reproducing.md is rewritten only when every experiment is rendered)")


def write_doc(path: str, sections: dict, seeds) -> None:
    import jax
    stamp = (f"Generated by `python experiments/reproduce.py` on "
             f"{datetime.date.today().isoformat()} ({platform.machine()}, jax {jax.__version__}, "
             f"{jax.default_backend()}{', seeds ' + seeds if seeds else ''}).")
    text = open(os.path.join(HERE, "reproducing_template.md")).read()
    text = text.replace("{{stamp}}", stamp)
    for name, table in sections.items():
        text = text.replace("{{" + name + "}}", table)
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
