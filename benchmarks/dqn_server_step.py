"""DQN-Fed's server step against FedAvg's weighted sum, K clients x d parameters (issue 10).

Run:   python benchmarks/dqn_server_step.py            (K = 10, 100, 1000; d = 1e4 .. 1e7)
       python benchmarks/dqn_server_step.py --quick    (K = 10, 100; d = 1e4, 1e5)

One DQN-Fed step = ``dqn_combine``: the K x K Gram matrix of the stacked client
vectors (HIGHEST precision, O(K^2 d)), the normalised K x K solve (eigh pseudo-inverse by default, O(K^3)),
v = sum_k w_k g_k (O(K d)) and the lambda* diagnostics; jitted as one program. FedAvg's
step is ``aggregators.weighted_sum`` of the same stacked vectors (O(K d)). Both are
timed side by side in one process (fastest of ``--reps`` calls after a warm-up), so
the ratio is what to compare across machines. Cells whose stacked vectors (4 K d
bytes) exceed ``--max-gib`` are skipped, as are cells whose Gram matrix would take
longer than ``--max-seconds`` at the measured rate: the table says so.
"""
from __future__ import annotations

import argparse
import importlib
import platform

import jax
import jax.numpy as jnp

from fedjax_fair.core.aggregators import weighted_sum
from timing import timeit

D = importlib.import_module("fedjax_fair.algorithms.dqn_fed")


def cell(k: int, d: int, reps: int):
    key = jax.random.key(k * 7 + d)
    G = {"w": jax.random.normal(key, (k, d), jnp.float32)}
    dt = jax.random.uniform(jax.random.fold_in(key, 1), (k,), minval=0.5, maxval=2.0)
    w = jnp.full((k,), 1.0 / k)
    dqn = jax.jit(lambda G, dt: D.dqn_combine(G, dt).v)
    avg = jax.jit(weighted_sum)
    t_dqn = timeit(lambda: dqn(G, dt), reps)
    t_avg = timeit(lambda: avg(G, w), reps)
    return t_dqn, t_avg


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-gib", type=float, default=6.0)
    ap.add_argument("--max-seconds", type=float, default=30.0)
    args = ap.parse_args()
    ks = (10, 100) if args.quick else (10, 100, 1000)
    ds = (10**4, 10**5) if args.quick else (10**4, 10**5, 10**6, 10**7)
    print(f"# {platform.machine()} {platform.processor() or ''}, jax {jax.__version__}, "
          f"{jax.default_backend()} ({jax.devices()[0].device_kind}), "
          f"{jax.device_count()} device(s)")
    print("| K | d | DQN-Fed step (ms) | FedAvg weighted sum (ms) | ratio | Gram GFLOP/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    rate = None  # measured Gram FLOP/s, to skip cells that would run too long
    for k in ks:
        for d in ds:
            gib = 4 * k * d / 2**30
            flops = 2 * k * k * d
            if gib > args.max_gib:
                print(f"| {k} | {d:.0e} | skipped: stacked vectors {gib:.0f} GiB > "
                      f"{args.max_gib:g} GiB | | | |")
                continue
            if rate is not None and flops / rate > args.max_seconds:
                print(f"| {k} | {d:.0e} | skipped: about {flops / rate:.0f} s at "
                      f"{rate / 1e9:.0f} GFLOP/s | | | |")
                continue
            t_dqn, t_avg = cell(k, d, args.reps)
            rate = max(rate or 0.0, flops / t_dqn)
            print(f"| {k} | {d:.0e} | {1e3 * t_dqn:.2f} | {1e3 * t_avg:.2f} | "
                  f"{t_dqn / t_avg:.1f} | {flops / t_dqn / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
