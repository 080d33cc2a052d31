"""The price of privacy for fairness: average and worst-10% accuracy against epsilon.

    python experiments/price_of_privacy.py                  # runs, then draws
    python experiments/price_of_privacy.py --plot-only      # draws existing runs

Runs ``fedjax-fair compare`` of FedAvg, q-FFL (its separable ``mixing`` mode, q = 5,
whose weights survive the private release) and AAggFF-D on 1,000 Synthetic clients
sharing one model (``iid=true``: the clients differ in their features, so some are
served worse), cohorts of 100, 150 rounds, 3 seeds: once without DP and once per
``--epsilons`` value with client-level DP (``--dp-epsilon E --dp-delta 1e-4
--dp-clip 0.2 --dp-max-weight 0.02``: the weight cap is twice the uniform 1/100, so a
fair rule keeps some reweighting at twice the noise), and once with the clip and the
cap but no noise (``--dp-noise 0``: what clipping and bounding the weights cost by
themselves). A folder that already holds a ``comparison.csv`` is not run again.

Writes, under ``--out``: ``none/``, ``clip/`` and ``eps{E}/`` (comparison folders),
``price_of_privacy.csv`` (method, epsilon, mean and seed std of both accuracies) and
``price_of_privacy.png`` (two panels against epsilon; clipped without noise, and without DP, at the right).
docs/reproducing.md, "The price of privacy for fairness", reports the result (and one
more comparison by hand: epsilon 4 with ``--dp-adaptive-clip 0.5``). About 2 minutes
per comparison on a 2-core CPU.
"""
from __future__ import annotations

import argparse
import csv
import os

FEDERATION = ["--dataset-arg", "num_clients=1000", "--dataset-arg", "iid=true",
              "--cohort-size", "100", "--num-rounds", "150",
              "--algorithms", "fedavg,qffl,aaggff_d", "--hp", "qffl.mode=mixing",
              "--hp", "qffl.q=5", "--no-progress"]
PRIVATE = ["--dp-delta", "1e-4", "--dp-clip", "0.2", "--dp-max-weight", "0.02"]
COLUMNS = {"average": "accuracy_mean_percent", "worst 10%": "accuracy_worst_10%_percent"}


def _folder(out: str, eps) -> str:
    """None: no DP; "clip": clipped and capped, no noise; a number: that epsilon."""
    return os.path.join(out, "none" if eps is None else "clip" if eps == "clip"
                        else f"eps{eps:g}")


def run(out: str, epsilons, seeds: str) -> None:
    from fedjax_fair import cli
    for eps in [None, "clip", *epsilons]:
        folder = _folder(out, eps)
        if os.path.exists(os.path.join(folder, "comparison.csv")):
            continue
        args = ["compare", *FEDERATION, "--seeds", seeds, "-o", folder]
        if eps == "clip":
            args += ["--dp-noise", "0", *PRIVATE]
        elif eps is not None:
            args += ["--dp-epsilon", f"{eps:g}", *PRIVATE]
        if os.path.exists(folder):
            args.append("--resume")
        code = cli.main(args)
        if code != 0:
            raise SystemExit(f"fedjax-fair {' '.join(args)} exited {code}")


def collect(out: str, epsilons) -> list[dict]:
    rows = []
    for eps in [None, "clip", *epsilons]:
        with open(os.path.join(_folder(out, eps), "comparison.csv"), newline="") as f:
            for r in csv.DictReader(f):
                row = {"method": r["algorithm"],
                       "epsilon": "none" if eps is None else "clip only" if eps == "clip"
                       else eps, "spent": r.get("dp_epsilon") or ""}
                for name, col in COLUMNS.items():
                    row[name] = float(r[col])
                    row[f"{name} seed std"] = float(r[f"{col}_seed_std"] or 0.0)
                rows.append(row)
    return rows


def draw(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    methods = list(dict.fromkeys(r["method"] for r in rows))
    finite = sorted({r["epsilon"] for r in rows if not isinstance(r["epsilon"], str)})
    at = {"clip only": max(finite) * 2.5, "none": max(finite) * 6.0}  # on the log axis
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    for ax, name in zip(axes, COLUMNS):
        for method in methods:
            mine = [r for r in rows if r["method"] == method]
            xs = [at.get(r["epsilon"], r["epsilon"]) for r in mine]
            order = sorted(range(len(xs)), key=xs.__getitem__)
            ax.errorbar([xs[i] for i in order], [mine[i][name] for i in order],
                        yerr=[mine[i][f"{name} seed std"] for i in order], marker="o",
                        capsize=3, label=method, linestyle="--" if method == "fedavg" else "-")
        ax.set_xscale("log")
        ax.set_xticks([*finite, *at.values()], [f"{e:g}" for e in finite]
                      + ["clip,\nno noise", "no DP"])
        ax.minorticks_off()
        ax.set_xlabel("epsilon (delta = 1e-4, client-level, 150 rounds)")
        ax.set_ylabel(f"{name} per-client test accuracy (%)")
        ax.set_title(f"{name.capitalize()} accuracy")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("The price of privacy: Synthetic (iid=true), 1,000 clients, cohorts of 100, "
                 "3 seeds (mean ± std)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/price_of_privacy")
    ap.add_argument("--epsilons", default="16,8,4,2,1")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    epsilons = [float(e) for e in args.epsilons.split(",")]
    if not args.plot_only:
        run(args.out, epsilons, args.seeds)
    rows = collect(args.out, epsilons)
    with open(os.path.join(args.out, "price_of_privacy.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    draw(rows, os.path.join(args.out, "price_of_privacy.png"))
    print(f"{len(rows)} rows -> {args.out}/price_of_privacy.csv, price_of_privacy.png")


if __name__ == "__main__":
    main()
