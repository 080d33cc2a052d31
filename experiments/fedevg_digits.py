"""FedEvg vs FedCVAE on the built-in 8x8 digits federation (small-scale stand-in for the
thesis' MNIST / CIFAR-10 comparison, Hahn 2024 Ch. IV Tables 4.2 / 4.4;
§4.1-§4.2). CPU-sized: about 12-15 minutes on 2 (shared) cores for the default 4 cells x 3
seeds at T = 100.

    python experiments/fedevg_digits.py                  # the main grid (I = 20), a table
    python experiments/fedevg_digits.py --local-iters epoch --rounds 200 \
        --img-prefix fedevg_digits_epoch                 # the spec's one-epoch local work
    python experiments/fedevg_digits.py --cells 10:1.0 --seeds 1 --rounds 20 --no-figures

Per cell (K clients, Dirichlet alpha, K = 10: every client every round, K = 50: 10 per
round) and seed s in {1, 2, 3}, on ``get_dataset("digits", num_clients=K,
partition=..., alpha=alpha, seed=s)`` (``dataset``; pixels are already in [0, 1]: the
loader divides sklearn's 0..16 counts by 16; 80/20 stratified holdout per client):

* FedEvg (``algorithms.fedevg``) with the thesis's values (Ch. IV §4.1) (gamma = 1, sigma =
  0.01, beta 10 -> 0.01 on the ddpm-cosine schedule, delta = 0.01, clip 3, lambda = 0.1,
  Adam 1e-3 / wd 1e-4, B = 64, fresh client models every round), M = 10 per class, T
  rounds, through ``runner.run``; the energy network is the zoo's ``mlp`` (ReLU
  200-200). Local work: ``--local-iters`` I Adam iterations per round (default 20).
  The spec's default, one local epoch, is only ceil(n_i / 64) = 1-7 iterations on the
  digits clients (29-420 training rows) against ~75 (K = 10) / ~8 (K = 100) for the
  thesis' MNIST clients, too little to train a fresh classifier whose energy gradients
  mean anything; ``--local-iters epoch`` runs that reading.
* FedCVAE (``algorithms.fedcvae``): a conditional VAE (latent 16, hidden 256) trained
  with FedAvg (Adam ``--cvae-lr``, B = 64) for the same T rounds and cohort and the same
  local work as FedEvg (I Adam steps per client and round, or one epoch with
  ``--local-iters epoch``); its synthetic set is the last round's 10 decoder means per
  class (``synthetic.synthetic_data``), scored exactly like FedEvg's.
* References: FedAvg's global ``mlp`` trained on the clients' real data (SGD 0.1, B =
  20, one epoch, T rounds; its per-client test accuracy), a fresh ``mlp`` trained on
  M = 10 random real training rows per class (pooled over clients, "same-size real
  data"), and chance (1 / L).

Metrics (thesis Ch. IV §4.2): downstream accuracy, a fresh ``mlp`` trained on the synthetic set only
(200 Adam 1e-3 steps of B = 64, i.e. 100 epochs over M = 100) and tested on every
client's real held-out split (mean weighted by test size; "client std" is the
unweighted std across clients); the Fréchet classifier distance
``fedevg.feature_distance`` (FID stand-in: the logits of a fixed ``mlp`` trained on the
cell's pooled real training rows, 2000 Adam steps) between the synthetic set and all
pooled real held-out rows; its scale depends on that classifier, so compare FCDs within
a column only. Diagnostics: "spread", the mean pairwise pixel distance between two
samples of the same class (diversity; ``spread``), and the "border-pixel mean", the mean
value of the near-empty pixels (mean < 0.02 over the cell's real training rows: the
left and right border columns), where the clients' networks get almost no signal. Cells
are mean ± std over seeds.
``--schedule cosine_alphabar`` runs FedEvg with the spec's alternative (smoothly
decaying) server step-size schedule, ``--server-step`` another first step size beta_0.

Figures (seed 1 of each cell): ``docs/img/PREFIX_k{K}_a{alpha}_fedevg.png`` (FedEvg's D~
at rounds 0, T/4, T/2, 3T/4, T) and ``..._final.png`` (FedEvg's and FedCVAE's final
sets beside M random real rows), via ``fedevg.plot_sample_grid``.
"""
from __future__ import annotations

import importlib

import argparse
import functools
import json
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair.algorithms.families import generative as S
from fedjax_fair.algorithms import fedavg
from fedjax_fair.data import get_dataset
from fedjax_fair.models import get_model
from fedjax_fair.drivers.runner import run
from fedjax_fair.core.client import ClientTraining
C = importlib.import_module("fedjax_fair.algorithms.fedcvae")  # the package exports the factories
F = importlib.import_module("fedjax_fair.algorithms.fedevg")

NUM_CLASSES = 10
INPUT_SHAPE = (8, 8, 1)
SPC = 10  # synthetic (and real-reference) samples per class, M = 100
DOWNSTREAM_STEPS = 200  # 100 epochs over M = 100 at B = 64 (the thesis leaves the budget open)
FEATURE_STEPS = 2000  # the fixed feature classifier: ~90 epochs over the pooled train rows
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dataset(k: int, alpha: float, seed: int):
    """The cell's federation. Per-class Dir(alpha 1_K) ("dirichlet", disjoint, >= 10
    examples per client) wherever it exists; with K = 50 and alpha = 0.01 no such draw
    exists (10 classes cannot be spread over 50 clients), so that cell uses
    "dirichlet_prior" (each client draws its own class prior q_k ~ Dir(alpha 1_L) and
    1797 // K examples from it, the shape of the thesis' reference-code split; its
    class pools are refilled, so some held-out rows also occur in another client's
    training rows, counted in ``leaked``)."""
    if k >= 50 and alpha < 0.1:
        partition = "dirichlet_prior"
    else:
        partition = "dirichlet"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = get_dataset("digits", num_clients=k, partition=partition, alpha=alpha, seed=seed)
    leaked = 0
    for w in caught:
        text = str(w.message)
        if "held-out test examples are also training" in text:
            leaked = int(text.split(": ")[1].split(" of ")[0])
    return ds, partition, leaked


def weighted(per_client, n):
    """(mean weighted by test size, unweighted std) over clients with test rows."""
    per_client, n = np.asarray(per_client, np.float64), np.asarray(n, np.float64)
    has = n > 0
    return float(np.average(per_client[has], weights=n[has])), float(per_client[has].std())


def with_snapshots(alg):
    """FedEvg whose round metrics also carry D~ after the round ("synthetic/x"), so that
    ``runner.run``'s ``on_rounds`` sees the chain (for the sample grids)."""
    def apply(state, cohort, key, execution="auto"):
        new, metrics = alg.apply(state, cohort, key, execution)
        metrics["synthetic/x"] = new.aggregator_state.x
        return new, metrics

    return alg._replace(apply=apply)


def run_fedevg(model, data, seed, rounds, cohort, snapshot_rounds, local_iters=None,
               schedule="ddpm_cosine_beta", server_step=10.0):
    alg = F.fedevg(model, num_rounds=rounds, seed=seed, local_iters=local_iters,
                   schedule=schedule, server_step=server_step)
    snaps = {}

    def on_rounds(first, metrics):
        xs = metrics["synthetic/x"]
        for i in range(xs.shape[0]):
            if first + i + 1 in snapshot_rounds:
                snaps[first + i + 1] = np.asarray(xs[i])

    params = model.init(jax.random.key(seed))
    state0 = alg.init(params, data.num_clients)
    snaps[0] = np.asarray(state0.aggregator_state.x)
    res = run(with_snapshots(alg), params, data, jax.random.key(seed), model=model,
              num_rounds=rounds, cohort_size=cohort, eval_every=max(1, rounds // 4),
              progress=False, execution="auto", on_rounds=on_rounds)
    x, y = S.synthetic_data(res.state)
    return np.asarray(x), np.asarray(y), snaps, res


@functools.lru_cache(maxsize=1)
def classifier():
    """The zoo's ``mlp`` (ReLU 200-200) on 8x8x1: FedEvg's energy network, the
    downstream and feature classifiers and FedAvg's model. One object for the whole
    script, so that its compiled programs (evaluator, downstream training) are reused."""
    return get_model("mlp", INPUT_SHAPE, NUM_CLASSES)


def run_fedcvae(model, data, seed, rounds, cohort, lr, local_iters):
    """FedCVAE with ``local_iters`` Adam steps per client and round (as many epochs,
    capped at that many steps: every client takes exactly ``local_iters`` steps, the
    local work FedEvg gets), or one local epoch when None; its synthetic set is the
    last round's M decoder means."""
    epochs = 1 if local_iters is None else local_iters
    alg = C.fedcvae(model, latent_dim=16, hidden=(256,), training=ClientTraining(lr=lr, batch_size=64, num_epochs=epochs, max_steps=local_iters), samples_per_class=SPC,
                    seed=seed)
    res = run(alg, model.init(jax.random.key(seed)), data, jax.random.key(seed), model=model,
              num_rounds=rounds, cohort_size=cohort, eval_every=rounds, progress=False)
    x, y = S.synthetic_data(res.state)
    return np.asarray(x), np.asarray(y), res


def run_fedavg(model, data, seed, rounds, cohort):
    alg = fedavg(model, training=ClientTraining(lr=0.1, batch_size=20, num_epochs=1))
    res = run(alg, model.init(jax.random.key(seed)), data, jax.random.key(seed), model=model,
              num_rounds=rounds, cohort_size=cohort, eval_every=rounds, progress=False)
    return weighted(res.client_metrics["accuracy"], res.client_metrics["num_examples"])


def spread(x, y):
    """Diversity of a labelled sample set: the mean over classes of the mean pairwise
    Euclidean pixel distance between two different samples of that class."""
    x = np.asarray(x, np.float64).reshape(len(y), -1)
    out = []
    for c in np.unique(y):
        xc = x[np.asarray(y) == c]
        d = np.sqrt(np.maximum(((xc[:, None] - xc[None]) ** 2).sum(-1), 0.0))
        out.append(d.sum() / max(1, len(xc) * (len(xc) - 1)))
    return float(np.mean(out))


def real_subset(train, seed):
    """SPC random real training rows per class from the pooled clients (class-balanced)."""
    x, y = S.pooled_examples(train)
    rng = np.random.default_rng(seed)
    idx = np.concatenate([rng.choice(np.flatnonzero(y == c), SPC, replace=False)
                          for c in range(NUM_CLASSES)])
    return x[idx], y[idx]


def one_cell(k, alpha, seed, args, figures: bool):
    t0 = time.perf_counter()
    ds, partition, leaked = dataset(k, alpha, seed)
    data = ds.host_data
    cohort = min(10, k)
    model = classifier()
    test = data.test
    x_test, _ = S.pooled_examples(test)
    # near-empty pixels: mean < 0.02 over the real training rows (the left and right
    # border columns, 17 of 64); the clients' networks get almost no signal there
    dead = S.pooled_examples(data.train)[0].reshape(-1, 64).mean(0) < 0.02
    feat_params, _ = S.feature_classifier(model, data.train, jax.random.key(500 + seed),
                                          steps=FEATURE_STEPS)
    fcd = jax.jit(lambda a, b: S.feature_distance(model, feat_params, a, b))

    def score(x, y, name):
        out = S.downstream_accuracy(model, x, y, test, jax.random.key(700 + seed),
                                    steps=DOWNSTREAM_STEPS, lr=1e-3, batch_size=64)
        x = np.asarray(x)
        return {f"{name}_acc": out["accuracy"], f"{name}_acc_client_std": out["accuracy_std"],
                f"{name}_fcd": float(fcd(jnp.asarray(x), jnp.asarray(x_test))),
                f"{name}_spread": spread(x, np.asarray(y)),
                f"{name}_dead": float(np.mean(x.reshape(len(x), -1)[:, dead]))}

    row = {"K": k, "alpha": alpha, "seed": seed, "partition": partition,
           "leaked_test_rows": leaked,
           "train_sizes": [int(v) for v in np.asarray(data.train.num_examples)]}
    snap_rounds = sorted({0, args.rounds // 4, args.rounds // 2, 3 * args.rounds // 4,
                          args.rounds})
    t = time.perf_counter()
    x_e, y_e, snaps, res_e = run_fedevg(model, data, seed, args.rounds, cohort, set(snap_rounds),
                                       args.local_iters, args.schedule, args.server_step)
    row.update(score(x_e, y_e, "fedevg"))
    row["fedevg_server_classifier_acc"] = res_e.history[-1]["accuracy_mean"]
    row["fedevg_seconds"] = time.perf_counter() - t
    t = time.perf_counter()
    x_c, y_c, res_c = run_fedcvae(model, data, seed, args.rounds, cohort, args.cvae_lr,
                                 args.local_iters)
    row.update(score(x_c, y_c, "fedcvae"))
    row["fedcvae_server_classifier_acc"] = res_c.history[-1]["accuracy_mean"]
    row["fedcvae_seconds"] = time.perf_counter() - t
    t = time.perf_counter()
    row["fedavg_acc"], row["fedavg_acc_client_std"] = run_fedavg(model, data, seed,
                                                                  args.rounds, cohort)
    row["fedavg_seconds"] = time.perf_counter() - t
    x_r, y_r = real_subset(data.train, seed)
    row.update(score(x_r, y_r, "real_m"))
    row["real_all_fcd"] = float(fcd(jnp.asarray(S.pooled_examples(data.train)[0]),
                                    jnp.asarray(x_test)))
    row["seconds"] = time.perf_counter() - t0
    if figures:
        tag = f"k{k}_a{alpha:g}".replace(".", "")
        local = "1 epoch" if args.local_iters is None else f"I={args.local_iters}"
        context = (f"digits 8x8, K={k}, {cohort} clients/round, Dirichlet alpha={alpha:g} "
                   f"({partition}), seed {seed}, M={SPC * NUM_CLASSES}, local work {local}"
                   + ("" if args.schedule == "ddpm_cosine_beta" else f", {args.schedule}")
                   + ("" if args.server_step == 10.0 else f", beta_0={args.server_step:g}"))
        # D~^(0) ~ N(0, I) is shown clipped to [0, 1] like every later D~
        S.plot_sample_grid([snaps[r] for r in snap_rounds], y_e, snap_rounds,
                           os.path.join(args.img_dir, f"{args.img_prefix}_{tag}_fedevg.png"),
                           NUM_CLASSES, per_class=SPC, title="FedEvg: the server's synthetic "
                           "set D~ over rounds", context=context, panel_width=2.4)
        S.plot_sample_grid([x_e, x_c, x_r], [y_e, y_c, y_r],
                           [f"FedEvg, round {args.rounds}", f"FedCVAE, round {args.rounds}",
                            "real (M random train rows)"],
                           os.path.join(args.img_dir, f"{args.img_prefix}_{tag}_final.png"),
                           NUM_CLASSES, per_class=SPC, title="Final synthetic sets",
                           context=context, panel_width=2.4)
    return row


def fmt(values, scale=1.0, decimals=1):
    v = np.asarray(values, np.float64) * scale
    if v.size == 1:
        return f"{v[0]:.{decimals}f}"
    return f"{v.mean():.{decimals}f} ± {v.std(ddof=0):.{decimals}f}"


def table(rows, cells):
    """The markdown table: one column per cell, mean ± std over seeds."""
    head = [f"K={k}, α={a:g}" for k, a in cells]
    lines = ["| method | metric | " + " | ".join(head) + " |",
             "|---|---|" + "---|" * len(cells)]

    def cell_rows(k, a):
        return [r for r in rows if r["K"] == k and r["alpha"] == a]

    spec = [("FedEvg", "accuracy (%)", "fedevg_acc", 100, 1),
            ("FedCVAE", "accuracy (%)", "fedcvae_acc", 100, 1),
            ("real, M = 100 random rows", "accuracy (%)", "real_m_acc", 100, 1),
            ("FedAvg on client data (global model)", "accuracy (%)", "fedavg_acc", 100, 1),
            ("chance", "accuracy (%)", None, 100, 1),
            ("FedEvg", "client std (%)", "fedevg_acc_client_std", 100, 1),
            ("FedCVAE", "client std (%)", "fedcvae_acc_client_std", 100, 1),
            ("FedEvg", "FCD ↓", "fedevg_fcd", 1, 2),
            ("FedCVAE", "FCD ↓", "fedcvae_fcd", 1, 2),
            ("real, M = 100 random rows", "FCD ↓", "real_m_fcd", 1, 2),
            ("real, all train rows", "FCD ↓", "real_all_fcd", 1, 2),
            ("FedEvg", "spread", "fedevg_spread", 1, 2),
            ("FedCVAE", "spread", "fedcvae_spread", 1, 2),
            ("real, M = 100 random rows", "spread", "real_m_spread", 1, 2),
            ("FedEvg", "border-pixel mean", "fedevg_dead", 1, 2),
            ("FedCVAE", "border-pixel mean", "fedcvae_dead", 1, 2),
            ("real, M = 100 random rows", "border-pixel mean", "real_m_dead", 1, 2)]
    for name, metric, key, scale, dec in spec:
        vals = []
        for k, a in cells:
            rs = cell_rows(k, a)
            if key is None:
                vals.append(f"{100.0 / NUM_CLASSES:.1f}")
            elif not rs:
                vals.append("–")
            else:
                vals.append(fmt([r[key] for r in rs], scale, dec))
        lines.append(f"| {name} | {metric} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def parse_cells(text):
    cells = []
    for part in text.split(","):
        k, a = part.split(":")
        cells.append((int(k), float(a)))
    return cells


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", default="10:0.01,10:1.0,50:0.01,50:1.0",
                   help="K:alpha pairs, comma-separated")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--local-iters", default="20",
                   help="local Adam iterations I per client and round of FedEvg and FedCVAE "
                        "(an int), or 'epoch' for one local epoch each (the spec's default "
                        "reading; see the module docstring)")
    p.add_argument("--schedule", default="ddpm_cosine_beta", choices=F.SCHEDULES,
                   help="FedEvg's server step-size schedule beta_t (thesis Ch. IV §3.2)")
    p.add_argument("--server-step", type=float, default=10.0,
                   help="FedEvg's first server step size beta_0 (the thesis: 10)")
    p.add_argument("--cvae-lr", type=float, default=1e-3)
    p.add_argument("--img-dir", default=os.path.join(REPO, "docs", "img"))
    p.add_argument("--img-prefix", default="fedevg_digits",
                   help="figure file names: PREFIX_k{K}_a{alpha}_{fedevg,final}.png")
    p.add_argument("--no-figures", action="store_true")
    p.add_argument("--json", default=None, help="also write the per-seed rows here")
    args = p.parse_args(argv)
    args.local_iters = None if args.local_iters == "epoch" else int(args.local_iters)
    cells = parse_cells(args.cells)
    t0 = time.perf_counter()
    rows = []
    for k, a in cells:
        for seed in args.seeds:
            row = one_cell(k, a, seed, args, figures=not args.no_figures
                           and seed == args.seeds[0])
            rows.append(row)
            print(f"K={k} alpha={a:g} seed={seed} ({row['partition']}): "
                  f"FedEvg {100 * row['fedevg_acc']:.1f}% FCD {row['fedevg_fcd']:.2f} | "
                  f"FedCVAE {100 * row['fedcvae_acc']:.1f}% FCD {row['fedcvae_fcd']:.2f} | "
                  f"real-M {100 * row['real_m_acc']:.1f}% | FedAvg "
                  f"{100 * row['fedavg_acc']:.1f}% | {row['seconds']:.0f}s", flush=True)
    print()
    print(table(rows, cells))
    local = "one epoch" if args.local_iters is None else f"I = {args.local_iters} iterations"
    print(f"\n{len(args.seeds)} seed(s) {args.seeds}, T = {args.rounds} rounds, local work "
          f"{local}, FedEvg schedule {args.schedule}, beta_0 {args.server_step:g}; total {time.perf_counter() - t0:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
