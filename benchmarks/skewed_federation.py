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
Part 2 (whole runs, side by side in one process): ``runner.run`` with the federation
on the device versus in host memory with every chunk's cohorts streamed in, in the
compact layout (the chunk's real rows concatenated, each round's client windows
read on the device through their offsets; the default) and in the padded layout
(every cohort gathered on the host, padded to the bucket of the chunk's largest
client); per-round seconds, the bytes each chunk streams, and the memory plans.
``--part 2`` skips part 1.
"""
from __future__ import annotations

import argparse
import functools
import platform

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair.core import execution
from fedjax_fair.algorithms import fedavg
from fedjax_fair.data import federate
from fedjax_fair.models import mlp
from fedjax_fair.drivers.runner import run
from fedjax_fair.drivers.simulate import make_cohort
from timing import timeit
from fedjax_fair.core.client import ClientTraining

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
        alg = fedavg(model, training=ClientTraining(lr=0.05, batch_size=BATCH))
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
    ap.add_argument("--part", type=int, choices=(1, 2), default=None,
                    help="run only part 1 (strategies) or part 2 (placements)")
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
    if args.part in (None, 1):
        secs, sizes = round_seconds(model, ds.data, k, strategies, args.reps)
        need = np.ceil(sizes / BATCH)
        print(f"# cohort {k}: steps needed {int(need.sum())}, busiest client "
              f"{int(need.max())}, padded maximum {int(np.ceil(pad['max_examples'] / BATCH))}")
        print("| strategy | s/round | x vmap-static |")
        print("|---|---|---|")
        for s, t in secs.items():
            print(f"| {s} | {t:.4f} | {secs['vmap-static'] / t:.2f} |")
    if args.part == 1:
        return

    alg = fedavg(model, training=ClientTraining(lr=0.05, batch_size=BATCH))
    params = jax.jit(model.init)(jax.random.key(0))
    streamed = chunk_bytes(ds.host_data.train, k, max(1, args.rounds // 2))
    print(f"# streamed bytes per chunk of {max(1, args.rounds // 2)} rounds (mean over the "
          f"run's chunks): padded {streamed['padded'] / 2**20:,.0f} MiB, compact "
          f"{streamed['compact'] / 2**20:,.0f} MiB")
    print("| placement | s/round (run) | x host padded | compile s | memory plan |")
    print("|---|---|---|---|---|")
    results = {}
    for placement, layout in (("device", "compact"), ("host", "padded"), ("host", "compact")):
        res = run(alg, params, ds.host_data, jax.random.key(0), model=model,
                  num_rounds=args.rounds, cohort_size=k, eval_every=args.rounds // 2,
                  progress=False, placement=placement, stream_layout=layout)
        results[(placement, layout)] = res
    base = results[("host", "padded")].run_seconds
    for (placement, layout), res in results.items():
        name = placement if placement == "device" else f"host, {layout}"
        print(f"| {name} | {res.run_seconds / args.rounds:.4f} | {base / res.run_seconds:.2f} | "
              f"{res.compile_seconds:.1f} | {res.memory.describe()} |")
    a, b = results[("host", "compact")], results[("host", "padded")]
    same = all(np.allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
               for x, y in zip(jax.tree.leaves(a.state.params), jax.tree.leaves(b.state.params)))
    print(f"# compact == padded parameters (rtol 1e-5): {same}")


def chunk_bytes(train, cohort_size: int, rounds: int, num_chunks: int = 2) -> dict:
    """Bytes the streamed runner copies in per chunk, padded vs compact layout (the
    cohorts ``runner.run`` samples with key 0), averaged over the first chunks."""
    from fedjax_fair.core import memory as mem
    from fedjax_fair.drivers.simulate import sample_client_ids
    sizes = np.asarray(train.num_examples)
    row = sum(int(np.prod(np.shape(v)[2:])) * np.dtype(v.dtype).itemsize
              for v in train.examples.values())
    out = {"padded": 0.0, "compact": 0.0}
    for c in range(num_chunks):
        ids = sample_client_ids(jax.random.key(0), c * rounds, rounds, sizes.size, cohort_size)
        m = mem.size_bucket(sizes[ids].max(), train.mask.shape[1])
        out["padded"] += ids.size * m * row / num_chunks
        out["compact"] += mem.row_bucket(int(sizes[ids].sum()) + m) * row / num_chunks
    return out


if __name__ == "__main__":
    main()
