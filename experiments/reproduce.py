"""Runs the small-scale experiments (issues 4 and 10-13) and writes docs/reproducing.md.

    python experiments/reproduce.py                 # every experiment (~1.5 hours, 2-core CPU)
    python experiments/reproduce.py --only aaggff_cross_silo --seeds 0
    python experiments/reproduce.py --reuse         # re-render from runs/reproduce/

Each experiment is a ``fedjax-fair compare`` config in this folder; this script runs
exactly ``fedjax-fair compare --config experiments/NAME.yaml`` (in-process), reads the
runs it wrote under ``runs/reproduce/NAME/``, and renders the tables:

* fairness experiments (AAggFF cross-silo / cross-device): the final per-client test
  accuracy's mean, worst 10% (test-size weighted, AAggFF, thesis Ch. III §6.1), std and Gini, mean ±
  std over seeds;
* computational-heterogeneity experiments (IID / NIID / TNIID): R90 (rounds until the
  global model's test accuracy first reaches 90%, arXiv:2307.06283 §3.2; 95% CI over
  seeds), the
  smoothness S of the accuracy curve, and the final accuracy;
* DQN-Fed experiments (CIFAR-10 setups 1 and 2 and the participation ablation at small
  scale): DQN-Fed's metrics (unweighted worst / best 10%), rounds to FedAvg's final
  accuracy and the share of improved clients (``dqn_table``);
* SuPerFed and the personalisation baselines (pathological / Dirichlet non-IID and the
  label-noise study; ``superfed_table``, ``noise_table``): each client's own model's
  final accuracy, its spread over clients, ECE, and SuPerFed's lambda
  grid (best-average lambda, per-client oracle, the two endpoints);
* A-FedPD and the primal-dual family (IID / Dirichlet-1.0 / Dirichlet-0.1, 10%
  participation; ``afedpd_table``): the global model's test accuracy (max over
  evaluations and mean of the last 3), its late swing, rounds to FedAvg's and to
  SCAFFOLD's final accuracy (A-FedPD Table 4 style) and seconds per round relative to
  FedAvg; the
  Dirichlet-0.1 curves are drawn into docs/img/afedpd_dir01_curves.png;
* FedEvg against FedCVAE, FedAvg and same-size real data on digits (``GENERATIVE``: not
  ``compare`` configs but runs of ``experiments/fedevg_digits.py``, whose rows are kept
  in ``runs/reproduce/NAME/rows.json`` and whose sample grids go to docs/img/):
  downstream accuracy, the Fréchet classifier distance, diversity and border pixels.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
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
AFEDPD = ("afedpd_iid", "afedpd_dir1", "afedpd_dir01")
PRIMAL_DUAL = ("feddyn", "fedspeed", "afedpd", "afedpd_sam", "fedadmm", "fedpd")
SUPERFED = ("superfed_pathological", "superfed_dirichlet", "superfed_ablation")
NOISE = ("superfed_noise_pair01", "superfed_noise_pair04", "superfed_noise_sym02",
         "superfed_noise_sym06")
GENERATIVE = {  # experiments/fedevg_digits.py runs: name -> its arguments
    "fedevg_digits": [],
    "fedevg_digits_epoch": ["--local-iters", "epoch", "--rounds", "200",
                            "--img-prefix", "fedevg_digits_epoch"],
    "fedevg_digits_beta1": ["--server-step", "1", "--cells", "10:1.0,50:0.01",
                            "--img-prefix", "fedevg_digits_beta1"],
    "fedevg_digits_beta01": ["--server-step", "0.1", "--cells", "10:1.0,50:0.01",
                             "--img-prefix", "fedevg_digits_beta01"],
}
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
    """DQN-Fed's metrics (its §5): mean, std and worst / best 10% (unweighted) of the
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


def _reach(h, target: float) -> float:
    """The first evaluated round whose global test accuracy is >= target; inf if none."""
    from fedjax_fair.metrics import rounds_to_reach
    i = rounds_to_reach([e["accuracy_weighted_mean"] for e in h], target)
    return float(h[int(i)]["round"]) if np.isfinite(i) else np.inf


def _reach_text(reach, reference=None) -> str:
    """Mean round over the seeds that reached the target, "k of n never" for the others
    and, when every seed reached it, the speed-up against the reference method's mean
    round (None: no reference, or the reference missed in some seed)."""
    hit = [r for r in reach if np.isfinite(r)]
    if not hit:
        return "never"
    text = f"{np.mean(hit):.0f}"
    if reference is not None and len(hit) == len(reach):  # speed-ups only when all seeds hit
        text += f" ({reference / np.mean(hit):.2f}x)"
    if len(hit) < len(reach):
        text += f", {len(reach) - len(hit)} of {len(reach)} never"
    return text


def afedpd_table(out: str) -> str:
    """A-FedPD's Table 2 / Table 4 / Table 5 columns (arXiv:2409.18915) for one split:
    the global model's test accuracy (``accuracy_weighted_mean``, the pooled test
    examples of every client) as max over evaluations and mean of the last 3
    evaluations, mean ± std over seeds; the swing, the std of that accuracy over the
    evaluations of the second half of training (seed mean, percentage points: how much
    the model still oscillates); rounds until it first reaches FedAvg's and
    SCAFFOLD's final accuracy (seed means of their last-3 means; mean round over the
    seeds that reach it; speed-up against the reference's own mean round where both
    reach it in every seed); run seconds per round (``timings.run_seconds``: no
    compilation, no evaluation) and the ratio to FedAvg."""
    from fedjax_fair.metrics import tail_mean
    summary = json.load(open(os.path.join(out, "summary.json")))
    seeds = summary["config"]["seeds"]
    runs = _histories(out)
    acc = {a: [[e["accuracy_weighted_mean"] for e in h] for h in hs] for a, hs in runs.items()}
    final = {a: [tail_mean(c, 3) for c in cs] for a, cs in acc.items()}
    refs = [("FedAvg", "fedavg"), ("SCAFFOLD", "scaffold")]
    targets = [(label, ref, float(np.mean(final[ref]))) for label, ref in refs if ref in final]
    reach = {a: [[_reach(h, t) for h in hs] for _, _, t in targets] for a, hs in runs.items()}
    per_round = {}
    for alg in runs:
        values = []
        for seed in seeds:
            run = json.load(open(os.path.join(out, alg, f"seed{seed}", "summary.json")))
            values.append(run["timings"]["run_seconds"] / run["config"]["num_rounds"])
        per_round[alg] = float(np.mean(values))
    base = per_round.get("fedavg")
    head = " | ".join(f"rounds to {label}'s {100 * t:.1f}%" for label, _, t in targets)
    late = {a: [np.std([e["accuracy_weighted_mean"] for e in h
                        if e["round"] > h[-1]["round"] / 2]) for h in hs]
            for a, hs in runs.items()}
    rows = [f"| algorithm | max acc (%) | last-3 acc (%) | swing (pp) | {head} | ms / round "
            f"| vs FedAvg |",
            "|---|---|---|---|" + "---|" * len(targets) + "---|---|"]
    for alg in runs:
        cells = []
        for j, (_, ref, _) in enumerate(targets):
            r = [x for x in reach[ref][j] if np.isfinite(x)]
            ref_mean = np.mean(r) if len(r) == len(reach[ref][j]) else None
            cells.append(_reach_text(reach[alg][j], None if alg == ref else ref_mean))
        ratio = f"{per_round[alg] / base:.2f}x" if base else "n/a"
        rows.append(f"| {alg} | {_pm([max(c) for c in acc[alg]])} | {_pm(final[alg])} | "
                    f"{100 * np.mean(late[alg]):.1f} | " + " | ".join(cells)
                    + f" | {1e3 * per_round[alg]:.1f} | {ratio} |")
    return "\n".join(rows)


def _personal_runs(out: str) -> dict:
    """{algorithm: [(accuracy, client std, worst 10%, ECE, seconds per round, lambda
    grid or None) per seed]}
    of a personalisation comparison: the final evaluation of each client's own model
    (clients unweighted, as in SuPerFed's reference code); for SuPerFed the lambda grid's
    best-average lambda (``summary["method_report"]``)."""
    summary = json.load(open(os.path.join(out, "summary.json")))
    runs = {}
    for alg in summary["config"]["algorithms"]:
        runs[alg] = []
        for seed in summary["config"]["seeds"]:
            run = json.load(open(os.path.join(out, alg, f"seed{seed}", "summary.json")))
            fin, grid = run["final"], run.get("method_report")
            per_round = run["timings"]["run_seconds"] / run["config"]["num_rounds"]
            if grid:
                runs[alg].append((grid["acc_best_lambda_avg"], grid["acc_best_lambda_std"],
                                  grid.get("acc_best_lambda_worst_10%", math.nan),
                                  grid["ece_best_lambda"], per_round, grid))
            else:
                runs[alg].append((fin["accuracy_mean"], fin["accuracy_std"],
                                  fin["accuracy_worst_10%_unweighted"], fin["ece"], per_round,
                                  None))
    return runs


def superfed_table(out: str) -> str:
    """Spec Table 2.3 / 2.4 columns: each client's own model's final test accuracy
    (mean over clients, then mean ± std over seeds), the std over clients and the
    unweighted worst 10% (seed means) and ECE (15 bins, per client then averaged);
    then SuPerFed's lambda grid. (Round times: ``benchmarks/personalised.py``, which
    times the methods side by side; these runs share the machine with other work.)"""
    runs = _personal_runs(out)
    rows = ["| method | accuracy (%) | std over clients (%) | worst 10% (%) | ECE |",
            "|---|---|---|---|---|"]
    for alg, rs in runs.items():
        label = alg + (" (best-average lambda)" if rs[0][5] else "")
        rows.append(f"| {label} | {_pm([r[0] for r in rs])} | "
                    f"{100 * np.mean([r[1] for r in rs]):.1f} | "
                    f"{100 * np.mean([r[2] for r in rs]):.1f} | "
                    f"{np.mean([r[3] for r in rs]):.3f} |")
    rows += ["", "| SuPerFed | best-average lambda | its accuracy (%) | per-client oracle (%) "
             "| lambda = 0, federated (%) | lambda = 1, local (%) | ECE / MCE at best lambda |",
             "|---|---|---|---|---|---|---|"]
    for alg, rs in runs.items():
        grids = [r[5] for r in rs if r[5]]
        if not grids:
            continue
        g = lambda k: [x[k] for x in grids]
        lams = ", ".join(f"{x:.1f}" for x in g("best_lambda"))
        rows.append(f"| {alg} | {lams} | {_pm(g('acc_best_lambda_avg'))} | "
                    f"{_pm(g('acc_oracle_per_client'))} | {_pm(g('acc_lambda0'))} | "
                    f"{_pm(g('acc_lambda1'))} | {np.mean(g('ece_best_lambda')):.3f} / "
                    f"{np.mean(g('mce_best_lambda')):.3f} |")
    return "\n".join(rows)


def noise_table(outs: dict) -> str:
    """Thesis Table 2.6 layout: per noise setting, accuracy (mean over clients, mean ±
    std over seeds) / ECE (seed mean) of each client's own model; SuPerFed at its
    best-average lambda."""
    runs = {name: _personal_runs(out) for name, out in outs.items()}
    algs = list(next(iter(runs.values())))
    heads = [json.load(open(os.path.join(out, "summary.json")))["config"]["dataset_args"]
             for out in outs.values()]
    rows = ["| method | " + " | ".join(f"{h['label_noise']} {h['noise_rate']}" for h in heads)
            + " |", "|---|" + "---|" * len(heads)]
    for alg in algs:
        cells = [f"{_pm([r[0] for r in rs[alg]])} / {np.mean([r[3] for r in rs[alg]]):.2f}"
                 for rs in runs.values()]
        rows.append(f"| {alg} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def generative_table(name: str, out: str, rerun: bool, seeds) -> str:
    """FedEvg against FedCVAE, FedAvg and same-size real data on digits: runs
    ``experiments/fedevg_digits.py`` with the experiment's arguments (its rows kept in
    ``out/rows.json``) unless ``rerun`` is False and they exist, and renders its table."""
    sys.path.insert(0, HERE)
    import fedevg_digits
    rows_path = os.path.join(out, "rows.json")
    if rerun or not os.path.isfile(rows_path):
        os.makedirs(out, exist_ok=True)
        argv = GENERATIVE[name] + ["--json", rows_path]
        if seeds:
            argv += ["--seeds", *seeds.split(",")]
        fedevg_digits.main(argv)
    with open(rows_path) as f:
        rows = json.load(f)["rows"]
    cells = list(dict.fromkeys((r["K"], r["alpha"]) for r in rows))
    return fedevg_digits.table(rows, cells)


def afedpd_figure(out: str, path: str) -> None:
    """Seed-mean global test accuracy and the cohort's training loss at the broadcast
    model per round, one line per method (the loss as a 5-round moving average)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    seeds = json.load(open(os.path.join(out, "summary.json")))["config"]["seeds"]
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
    for alg, hs in _histories(out).items():
        style = "-" if alg in PRIMAL_DUAL else "--"  # primal-dual solid, primal dashed
        rounds = [e["round"] for e in hs[0]]
        ax_acc.plot(rounds, 100 * np.mean([[e["accuracy_weighted_mean"] for e in h]
                                           for h in hs], axis=0), style, label=alg)
        losses = []
        for seed in seeds:
            rows = [json.loads(line) for line in
                    open(os.path.join(out, alg, f"seed{seed}", "rounds.jsonl"))]
            losses.append([r["train_loss"] for r in rows])
        loss = np.convolve(np.mean(losses, axis=0), np.ones(5) / 5, mode="valid")
        ax_loss.plot(np.arange(5, 5 + loss.size), loss, style, label=alg)
    ax_acc.set(xlabel="round", ylabel="global test accuracy (%)", ylim=(80, 100),
               title=f"test accuracy (mean of {len(seeds)} seeds)")
    ax_loss.set(xlabel="round", ylabel="cohort training loss", yscale="log",
                title="cohort loss at the broadcast model\n(5-round moving average)")
    ax_acc.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=None, help="comma list of experiment names")
    ap.add_argument("--seeds", default=None, help="override the configs' seeds, e.g. 0")
    ap.add_argument("--runs", default=os.path.join("runs", "reproduce"))
    ap.add_argument("--doc", default=os.path.join(ROOT, "docs", "reproducing.md"))
    ap.add_argument("--reuse", action="store_true",
                    help="render experiments already run under --runs instead of rerunning")
    args = ap.parse_args()
    names = (args.only.split(",") if args.only
             else list(FAIRNESS + COMPHET + DQN + AFEDPD + SUPERFED + NOISE) + list(GENERATIVE))
    sections = {}
    for name in names:
        out = os.path.join(args.runs, name)
        if name in GENERATIVE:
            sections[name] = generative_table(name, out, not args.reuse, args.seeds)
            print(f"\n## {name}\n\n{sections[name]}\n", flush=True)
            continue
        if not (args.reuse and os.path.exists(os.path.join(out, "summary.json"))):
            run_compare(name, out, args.seeds)
        if name in NOISE:  # one table over the four noise settings, once all are in
            sections[name] = os.path.join(args.runs, name)
            if all(n in sections for n in NOISE):
                sections["superfed_noise"] = noise_table({n: sections.pop(n) for n in NOISE})
                print(f"\n## superfed_noise\n\n{sections['superfed_noise']}\n", flush=True)
            continue
        table = (fairness_table(out) if name in FAIRNESS else dqn_table(out) if name in DQN
                 else afedpd_table(out) if name in AFEDPD
                 else superfed_table(out) if name in SUPERFED else comphet_table(out))
        figure = os.path.join(out, "improved_clients.png")
        if name in DQN and os.path.isfile(figure):
            os.makedirs(os.path.join(ROOT, "docs", "img"), exist_ok=True)
            shutil.copyfile(figure, os.path.join(ROOT, "docs", "img",
                                                 f"{name}_improved_clients.png"))
        if name == "afedpd_dir01":
            os.makedirs(os.path.join(ROOT, "docs", "img"), exist_ok=True)
            afedpd_figure(out, os.path.join(ROOT, "docs", "img", "afedpd_dir01_curves.png"))
        sections[name] = table
        print(f"\n## {name}\n\n{table}\n", flush=True)
    if args.only is None:
        write_doc(args.doc, sections, args.seeds)
    else:
        splice_doc(args.doc, sections)


def splice_doc(path: str, sections: dict) -> None:
    """Replaces only ``sections``' tables in the rendered doc: each table lies between
    the non-empty lines around its ``{{name}}`` placeholder in the template."""
    template = open(os.path.join(HERE, "reproducing_template.md")).read()
    text = open(path).read()
    for name, table in sections.items():
        if "{{" + name + "}}" not in template:
            continue
        before, after = template.split("{{" + name + "}}")
        head = [l for l in before.splitlines() if l.strip()][-1]
        tail = [l for l in after.splitlines() if l.strip()][0]
        start = text.index(head + "\n") + len(head) + 1
        end = text.index("\n" + tail, start)
        text = text[:start] + "\n" + table.strip("\n") + "\n" + text[end:]
    with open(path, "w") as f:
        f.write(text)
    print(f"spliced {', '.join(sections)} into {path}")


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
