"""Streamed against stacked aggregation of one FedAvg round, side by side in one run.

Run:   python benchmarks/streamed_aggregation.py            (MLP and logistic
                                                            regression, cohorts 100 and
                                                            1,000, every strategy)
       python benchmarks/streamed_aggregation.py --quick    (MLP, cohort 1,000, the
                                                            CPU's default strategy)

A round of FedAvg streams its aggregate by default (algorithm.py): each client's
weighted update is folded into a running sum as it finishes, so the compiled round
never holds the cohort's updates [K, d]. "stacked" is the same round with the mixing
rule's per-client form removed (``rule._replace(logit=None)``), which makes
``compose`` stack every update before the server step, as every round did before.
The job is round_throughput.py's (femnist_like clients, 10 local steps of batch 20,
n_k from 60 to 200). Both programs are compiled with the state donated; their rounds
alternate within each trial and the fastest is kept. The table gives seconds per
round, stacked / streamed, and XLA's temporary bytes of each compiled round.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import jax  # noqa: E402

from round_throughput import (BATCH, LR, Federation, local_epochs,  # noqa: E402
                              make_model)
from timing import alternate_rounds, compile_rounds, load_average  # noqa: E402

from fedjax_fair.algorithms.fedavg import fedavg  # noqa: E402
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.core.execution import Execution  # noqa: E402
from fedjax_fair.core.mixing import by_num_examples  # noqa: E402

STEPS = 10


def algorithms(model) -> dict:
    rule = by_num_examples()
    kw = dict(training=ClientTraining(lr=LR, batch_size=BATCH, num_epochs=local_epochs(STEPS),
                                      max_steps=STEPS))
    algs = {"streamed": fedavg(model, mixing=rule, **kw),
            "stacked": fedavg(model, mixing=rule._replace(logit=None), **kw)}
    assert algs["streamed"].streamed and not algs["stacked"].streamed
    return algs


def bound(alg, execution):
    return alg._replace(apply=lambda s, c, key, alg=alg: alg.apply(s, c, key, execution))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args(argv)
    models = ["mlp"] if args.quick else ["mlp", "logreg"]
    cohorts = [1000] if args.quick else [100, 1000]
    strategies = (["sequential"] if args.quick
                  else ["sequential", "chunked", "vmap"])
    print(f"# {platform.machine()} | jax {jax.__version__} | {os.cpu_count()} cores | "
          f"load {load_average()} | FedAvg, {STEPS} local steps of batch {BATCH}")
    print("| model | cohort | strategy | streamed s | stacked s | stacked / streamed | "
          "streamed temp MiB | stacked temp MiB |")
    print("|---|---|---|---|---|---|---|---|")
    fed = Federation()
    for name in models:
        model = make_model(name)
        params = jax.jit(model.init)(jax.random.key(0))
        for k in cohorts:
            cohort, _ = fed.cohort(k)
            for strategy in strategies:
                execution = Execution(strategy, 8 if strategy == "chunked" else None)
                algs = {label: bound(alg, execution)
                        for label, alg in algorithms(model).items()}
                fns, states, info = compile_rounds(algs, params, k, cohort)
                best = alternate_rounds(fns, states, cohort, args.trials)
                mib = lambda label: info[label]["temp_bytes"] / 2 ** 20
                print(f"| {name} | {k:,} | {strategy} | {best['streamed']:.4f} | "
                      f"{best['stacked']:.4f} | {best['stacked'] / best['streamed']:.2f} | "
                      f"{mib('streamed'):,.1f} | {mib('stacked'):,.1f} |", flush=True)
    print(f"# load after: {load_average()}")


if __name__ == "__main__":
    main()
