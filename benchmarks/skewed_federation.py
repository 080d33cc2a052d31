"""Skewed client sizes: what size buckets and streamed placement buy (issue 3).

Run:   python benchmarks/skewed_federation.py           (GPU-sized defaults)
       python benchmarks/skewed_federation.py --quick   (a 2-core CPU in a few minutes)

Setup: N clients of FEMNIST-shaped examples (28x28x1, 62 classes) whose sizes follow
the quantity-skew partitioner (log-normal, sigma 1.5, so a few clients hold most of
the data and the padded block is mostly padding). FedAvg, MLP 200-200, batch 20, one
local epoch: client k takes ceil(n_k / 20) steps.

Part 1 (one round, side by side in one process): cohort strategies
* vmap-static: vmap with the step loop masked by selects up to the federation's
  padded maximum, the behaviour before the group bound (group_max disabled);
* vmap: vmap whose steps past the cohort's busiest client are skipped (group bound);
* bucketed: the cohort sorted by size into buckets, each skipping past its own
  busiest client; chunked: fixed chunks of 8 in sampling order; sequential.
Part 2 (whole runs): ``runner.run`` with the federation on the device versus in
host memory with every chunk's cohorts gathered, padded to their size bucket and
streamed in; per-round seconds and the memory plans, and the padding report.
"""
from __future__ import annotations

import argparse
import functools
import platform

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair import execution
from fedjax_fair.algorithms import fedavg
from fedjax_fair.data import federate
from fedjax_fair.models import mlp
from fedjax_fair.runner import run
from fedjax_fair.simulate import make_cohort
from timing import timeit

BATCH = 20


def skewed(num_clients: int, mean_size: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    total = num_clients * mean_size
    x = rng.normal(size=(total, 28, 28, 1)).astype(np.float32)
    y = rng.integers(0, 62, total).astype(np.int32)
    return federate(x, y, name="skewed", num_classes=62, num_clients=num_clients,
                    partition="quantity", sigma=1.5, min_size=2, seed=seed, test_fraction=0.1)


def round_seconds(model, data, cohort_size, strategies, reps):
    ids = jax.random.choice(jax.random.key(1), data.num_clients, (cohort_size,), replace=False)
    cohort = make_cohort(data, ids.astype(jnp.int32))
    params = jax.jit(model.init)(jax.random.key(0))
    out = {}
    for strategy in strategies:
        static = strategy == "vmap-static"
        alg = fedavg(model, client_lr=0.05, batch_size=BATCH)
        state = alg.init(params, data.num_clients)
        apply = functools.partial(alg.apply, execution="vmap" if static else strategy)
        original = execution.group_max
        if static:  # the pre-bound behaviour: selects up to the padded maximum
            execution.group_max = lambda value: None
        try:
            compiled = jax.jit(apply).lower(state, cohort, jax.random.key(0)).compile()
        finally:
            execution.group_max = original
        out[strategy] = timeit(lambda: compiled(state, cohort, jax.random.key(0)), reps)
    sizes = np.asarray(data.train.num_examples)[np.asarray(ids)]
    return out, sizes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--clients", type=int, default=None)
    ap.add_argument("--cohort", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    n = args.clients or (200 if args.quick else 1000)
    k = args.cohort or (20 if args.quick else 100)
    cpu = jax.default_backend() == "cpu"
    strategies = ["vmap-static", "vmap", "bucketed", "chunked"] + (["sequential"] if cpu else [])
    print(f"# {platform.processor() or platform.machine()} | jax {jax.__version__} | "
          f"backend {jax.default_backend()} | {jax.devices()[0]}")
    ds = skewed(n, 60)
    model = mlp(ds.input_shape, ds.num_classes, hidden=(200, 200))
    pad = ds.info["padding"]["train"]
    print(f"# {n} clients, sizes {pad['min_examples']}-{pad['max_examples']} "
          f"(median {pad['median_examples']:g}); one block: {100 * pad['padding_fraction']:.0f}% "
          f"padding, {pad['bytes'] / 2**20:.0f} MiB; power-of-two buckets: "
          f"{100 * pad['buckets']['bucketed_padding_fraction']:.0f}% padding")
    secs, sizes = round_seconds(model, ds.data, k, strategies, args.reps)
    need = np.ceil(sizes / BATCH)
    print(f"# cohort {k}: steps needed {int(need.sum())}, busiest client {int(need.max())}, "
          f"padded maximum {int(np.ceil(pad['max_examples'] / BATCH))}")
    print("| strategy | s/round | x vmap-static |")
    print("|---|---|---|")
    for s, t in secs.items():
        print(f"| {s} | {t:.4f} | {secs['vmap-static'] / t:.2f} |")

    alg = fedavg(model, client_lr=0.05, batch_size=BATCH)
    params = jax.jit(model.init)(jax.random.key(0))
    print("| placement | s/round (run) | compile s | memory plan |")
    print("|---|---|---|---|")
    for placement in ("device", "host"):
        res = run(alg, params, ds.host_data, jax.random.key(0), model=model,
                  num_rounds=args.rounds, cohort_size=k, eval_every=args.rounds // 2,
                  progress=False, placement=placement)
        print(f"| {placement} | {res.run_seconds / args.rounds:.4f} | {res.compile_seconds:.1f} | "
              f"{res.memory.describe()} |")


if __name__ == "__main__":
    main()
