"""Server-step cost of every aggregation rule for K = 10, 100, 1000 clients (issue 4).

Run:   python benchmarks/server_step.py               (K = 10, 100, 1000; d = 100k)
       python benchmarks/server_step.py --quick       (K = 10, 100; d = 10k)

One server step = the mixing rule's ``update`` (weights from the K clients' losses,
steps and state) + the aggregator (one direction from the K stacked deltas of d
parameters), jitted as one program, full participation (K = N, so AAggFF-S's ONS
matrix is K x K). Timed side by side in one process: the fastest of ``--reps`` calls
after a warm-up. Memory: XLA's own accounting of the compiled step
(``memory_analysis``: temporaries, and the persistent state such as the ONS
matrix). Local training is not included; it dominates a round for any real model.
"""
from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp

from fedjax_fair import aggregators, mixing
from fedjax_fair.algorithms.aaggff import aaggff_d_mixing, aaggff_s_mixing
from fedjax_fair.algorithms.afl import afl_mixing
from fedjax_fair.algorithms.fedmax import fedsoftmax_mixing
from fedjax_fair.algorithms.fedmgda import fedmgda_plus_aggregator
from fedjax_fair.algorithms.propfair import propfair_mixing
from fedjax_fair.algorithms.qffl import prior_mixing, qffl_aggregator
from fedjax_fair.algorithms.term import term_mixing
from fedjax_fair.memory import tree_bytes
from fedjax_fair.types import ClientOutput, ServerContext
from timing import timeit

RULES = {
    "fedavg": lambda: (mixing.by_num_examples(), aggregators.weighted_mean()),
    "qffl": lambda: (prior_mixing(), qffl_aggregator(1.0, 10.0)),
    "term": lambda: (term_mixing(0.1), aggregators.weighted_mean()),
    "afl": lambda: (afl_mixing(0.01), aggregators.weighted_mean()),
    "propfair": lambda: (propfair_mixing(2.0), aggregators.weighted_mean()),
    "fedsoftmax": lambda: (fedsoftmax_mixing(5.0), aggregators.weighted_mean()),
    "fedmgda_plus": lambda: (mixing.by_num_examples(), fedmgda_plus_aggregator(0.5)),
    "aaggff_s (ONS, full K x K)": lambda: (aaggff_s_mixing(), aggregators.weighted_mean()),
    "aaggff_s (diagonal)": lambda: (aaggff_s_mixing(solver="diagonal"),
                                    aggregators.weighted_mean()),
    "aaggff_d (FTRL)": lambda: (aaggff_d_mixing(), aggregators.weighted_mean()),
}


def outputs(k: int, d: int) -> ClientOutput:
    keys = jax.random.split(jax.random.key(0), 4)
    return ClientOutput(delta={"w": jax.random.normal(keys[0], (k, d), jnp.float32)},
                        loss_before=jax.random.uniform(keys[1], (k,), minval=0.1, maxval=3.0),
                        num_examples=jax.random.randint(keys[2], (k,), 10, 200),
                        num_steps=jnp.full((k,), 10, jnp.int32),
                        train_loss=jax.random.uniform(keys[3], (k,), minval=0.1, maxval=3.0))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--clients", default=None, help="comma list of K")
    ap.add_argument("--params", type=int, default=None, help="d, parameters per model")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    ks = [int(k) for k in args.clients.split(",")] if args.clients else (
        [10, 100] if args.quick else [10, 100, 1000])
    d = args.params or (10_000 if args.quick else 100_000)
    print(f"# {platform.processor() or platform.machine()} | jax {jax.__version__} | "
          f"{jax.devices()[0]} | d = {d:,} parameters | full participation (K = N)")
    print("| rule | K | ms / step | state MiB | temp MiB | compile s |")
    print("|---|---|---|---|---|---|")
    for k in ks:
        out = outputs(k, d)
        ids, mask = jnp.arange(k, dtype=jnp.int32), jnp.ones((k,), bool)
        for name, build in RULES.items():
            mix, agg = build()
            params = {"w": jnp.zeros((d,))}
            state = (mix.init(k), agg.init(params, k))
            ctx = ServerContext(params, jnp.zeros((), jnp.int32), jax.random.key(0), ids, mask)

            def step(state, out):
                w, ms = mix.update(state[0], out, ctx)
                direction, ags, _ = agg.aggregate(state[1], out, w, ctx)
                return direction, (ms, ags)

            t = time.perf_counter()
            compiled = jax.jit(step).lower(state, out).compile()
            compile_s = time.perf_counter() - t
            mem = compiled.memory_analysis()
            temp = (mem.temp_size_in_bytes if mem is not None else 0) / 2 ** 20
            sec = timeit(lambda: compiled(state, out), args.reps)
            print(f"| {name} | {k} | {1e3 * sec:.3f} | {tree_bytes(state) / 2 ** 20:.2f} | "
                  f"{temp:.1f} | {compile_s:.1f} |", flush=True)


if __name__ == "__main__":
    main()
