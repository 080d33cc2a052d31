"""Participation and the virtual clock (scenarios/system.py, algorithms/fedbuff.py): what they
cost, as ratios measured side by side in one run.

    python benchmarks/system.py                       # both tables
    python benchmarks/system.py --table overhead --cohort 1000 --rounds 5
    python benchmarks/system.py --table async --updates 100000

``overhead``: a round of FedAvg (femnist_like's 1000 clients, the MLP 784-200-200-62,
batch 10, one epoch) at cohort K, plain against the same round under a System with
availability (independent 0.9), dropouts (0.1) and a clock with a deadline
(lognormal speeds, bandwidth, latency; late clients send the steps they finished).
Each is ``simulate`` of R rounds compiled once; the two alternate over trials and the
fastest trial counts. Both train every cohort slot (the masked ones too: shapes are
static), so the ratio is the cost of planning the round: availability, the Gumbel /
uniform top-k among the available, the dropouts and the clock.

``async``: U client updates of FedBuff (K = 10 per server step, C = 100 in flight,
on a lognormal clock) against synchronous FedAvg with the simple average over the
same U updates (U / 10 rounds of 10 clients), on the synthetic federation's logistic
regression. Both are one ``simulate`` scan; the table gives their wall seconds, the
ratio and the simulated seconds each took on the clock.

Prints a table and the machine; ``--json PATH`` writes the raw figures.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair.algorithms import fedavg, fedbuff
from fedjax_fair.scenarios import system as S
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.data import get_dataset
from fedjax_fair.drivers.simulate import simulate
from fedjax_fair.models import get_model


def _compiled(alg, params, data, rounds: int, cohort: int, system, execution="vmap"):
    state = alg.init(params, data.num_clients)
    fn = jax.jit(lambda s, k: simulate(alg, s, data, k, num_rounds=rounds, cohort_size=cohort,
                                       execution=execution, system=system))
    t = time.perf_counter()
    compiled = fn.lower(state, jax.random.key(0)).compile()
    return compiled, state, time.perf_counter() - t


def overhead(cohort: int, rounds: int, trials: int) -> dict:
    ds = get_dataset("femnist_like")
    model = get_model("mlp", ds.input_shape, ds.num_classes)
    params = model.init(jax.random.key(0))
    data = jax.device_put(ds.host_data)
    training = ClientTraining(lr=0.05, batch_size=10, num_epochs=1)
    alg = fedavg(model, training=training)
    n = ds.num_clients
    system = S.system(S.independent(0.9), dropout=0.1,
                      clock=S.clock(S.lognormal(n, 20.0, 1.0), bandwidth=1e6, latency=0.1,
                                    deadline=30.0, late="partial", training=training))
    system.check(n, np.asarray(ds.host_data.train.num_examples))
    runs = {}
    for name, sys_ in (("plain", None), ("system", system)):
        fn, state, compile_s = _compiled(alg, params, data, rounds, cohort, sys_)
        runs[name] = {"fn": fn, "state": state, "compile_s": compile_s, "best": float("inf")}
    for trial in range(trials):
        for name in (["plain", "system"] if trial % 2 == 0 else ["system", "plain"]):
            r = runs[name]
            t = time.perf_counter()
            jax.block_until_ready(r["fn"](r["state"], jax.random.key(trial)))
            r["best"] = min(r["best"], time.perf_counter() - t)
    out = {name: {"round_s": r["best"] / rounds, "compile_s": r["compile_s"]}
           for name, r in runs.items()}
    out["ratio"] = out["system"]["round_s"] / out["plain"]["round_s"]
    return out


def asynchronous(updates: int, trials: int) -> dict:
    ds = get_dataset("synthetic")
    model = get_model("logreg", ds.input_shape, ds.num_classes)
    params = model.init(jax.random.key(0))
    data = jax.device_put(ds.host_data)
    training = ClientTraining(lr=0.05, batch_size=10, num_epochs=1)
    k = 10
    rounds = updates // k
    clock = S.clock(S.lognormal(ds.num_clients, 20.0, 1.0), bandwidth=1e6, latency=0.1,
                    training=training)
    algs = {"fedbuff": (fedbuff(model, training=training, concurrency=100, clock=clock), None),
            "fedavg": (fedavg(model, training=training, weight_by_size=False),
                       S.system(clock=clock))}
    out = {}
    for name, (alg, sys_) in algs.items():
        fn, state, compile_s = _compiled(alg, params, data, rounds, k, sys_)
        best, metrics = float("inf"), None
        for trial in range(trials):
            t = time.perf_counter()
            _, metrics = jax.block_until_ready(fn(state, jax.random.key(trial)))
            best = min(best, time.perf_counter() - t)
        clock_key = "server/round_seconds" if name == "fedbuff" else "system/round_seconds"
        out[name] = {"wall_s": best, "compile_s": compile_s, "rounds": rounds,
                     "simulated_s": float(jnp.sum(metrics[clock_key]))}
    out["ratio"] = out["fedbuff"]["wall_s"] / out["fedavg"]["wall_s"]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--table", choices=["overhead", "async", "both"], default="both")
    p.add_argument("--cohort", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--updates", type=int, default=100_000)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--json")
    a = p.parse_args(argv)
    info = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                       f"jax {jax.__version__}, {jax.devices()[0].platform}"}
    print(info["machine"], "load", os.getloadavg())
    if a.table in ("overhead", "both"):
        o = overhead(a.cohort, a.rounds, a.trials)
        info["overhead"] = o
        print(f"\nFedAvg round, femnist_like MLP, cohort {a.cohort} ({a.rounds} rounds per call, "
              f"fastest of {a.trials})")
        print("| | round (s) | compile (s) |\n|---|---|---|")
        for name in ("plain", "system"):
            print(f"| {name} | {o[name]['round_s']:.3f} | {o[name]['compile_s']:.1f} |")
        print(f"| system / plain | **{o['ratio']:.3f}x** | |")
    if a.table in ("async", "both"):
        r = asynchronous(a.updates, a.trials)
        info["async"] = r
        print(f"\n{a.updates:,} client updates, synthetic logistic regression, K = 10 "
              f"(FedBuff C = 100), fastest of {a.trials}")
        print("| | rounds | wall (s) | compile (s) | simulated time (s) |\n|---|---|---|---|---|")
        for name in ("fedbuff", "fedavg"):
            x = r[name]
            print(f"| {name} | {x['rounds']:,} | {x['wall_s']:.2f} | {x['compile_s']:.1f} | "
                  f"{x['simulated_s']:,.0f} |")
        print(f"| fedbuff / fedavg | | **{r['ratio']:.2f}x** | | |")
    print("load", os.getloadavg())
    if a.json:
        with open(a.json, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
