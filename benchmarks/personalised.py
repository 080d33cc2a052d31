"""Personalisation family (issue 12): a cohort of 100 in one compiled program, per method.

Run:   python benchmarks/personalised.py methods     (one round of every method, cohort 100)
       python benchmarks/personalised.py live        (SuPerFed through runner.run, N = 1000)
       python benchmarks/personalised.py all

The static memory bill of the personal-model tables (shapes only, the spec's networks,
N = 100 / 1000) is ``benchmarks/table_memory.py``.

``methods``: one jitted round (``apply``, the server state donated, so tables are
updated in place) of every personalisation method and of FedAvg / FedProx on one fixed
cohort of 100 of N = 1000 MNIST-shaped clients (60 Gaussian examples of 28x28x1, 10
classes) with SuPerFed's TwoNN (784-200-200-200-10, no biases, 238,800 parameters) and
equal local work: E = 10 epochs of batch 10 (60 steps), lr 0.01, the spec's
hyper-parameters (SuPerFed mu 0.01, nu 1 (MM) / 2 (LM), personalising from round 0 so
the mixture, the orthogonality term and theta_l's update are all in the timed round;
APFL alpha 0.25; pFedMe lambda 15, 5 inner steps; Ditto lambda 0.1; FedRep 10 head
epochs). The methods alternate within each trial (the starting method rotates) and
each reports its fastest of ``--trials`` rounds, so load on the shared machine hits
all alike. Columns: seconds per round and the ratio to FedAvg; XLA's cost analysis of
the compiled round (FLOPs and bytes accessed against FedAvg; it counts a loop body
once); XLA's memory analysis of the compiled round (arguments, i.e. the state with its
N-row table and the cohort, and temporaries); compile seconds.

``live``: SuPerFed-MM through ``runner.run`` as the CLI runs it (a checkpoint
directory, so the state is donated to each chunk program) on the same federation
(N = 1000, cohort 100, ``--rounds`` rounds, every client evaluated after each chunk),
each table form in its own subprocess reporting its peak resident memory (VmHWM),
seconds per round (run time only) and the table's bill (``RunResult.client_table``):
FedAvg (no table), dense (1000 local models) and lazy with room for the clients the
run samples.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from primal_dual import gib, header, loadavg, proc_status  # noqa: E402
from timing import alternate_rounds, compile_rounds  # noqa: E402

from fedjax_fair.core.client import ClientTraining  # noqa: E402

NUM_CLIENTS, COHORT, EXAMPLES = 1000, 100, 60


def federation(num_clients: int = NUM_CLIENTS):
    from fedjax_fair.data import from_client_arrays
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(EXAMPLES, 28, 28, 1)).astype(np.float32) for _ in range(num_clients)]
    ys = [rng.integers(0, 10, EXAMPLES).astype(np.int32) for _ in range(num_clients)]
    return from_client_arrays(xs[:], ys[:], [x[:12] for x in xs], [y[:12] for y in ys],
                              name="mnist_shaped", num_classes=10)


def superfed_training(**fields):
    """SuPerFed's own training (its weight decay 1e-4) with ``fields`` replaced."""
    from fedjax_fair.algorithms import default_training
    return default_training("superfed")._replace(**fields)


def method_algorithms(model, lr: float = 0.01, batch_size: int = 10, num_epochs: int = 10,
                      client_table: str = "dense") -> dict:
    from fedjax_fair.algorithms import (apfl, ditto, fedavg, fedavg_ft, fedper, fedprox,
                                        fedrep, lg_fedavg, pfedme, superfed)
    c = dict(training=ClientTraining(lr=lr, batch_size=batch_size, num_epochs=num_epochs))
    sf = dict(training=superfed_training(lr=lr, batch_size=batch_size, num_epochs=num_epochs))
    t = dict(client_table=client_table)
    return {
        "FedAvg": fedavg(model, **c),
        "FedProx": fedprox(model, mu=0.01, **c),
        "FedAvg-FT": fedavg_ft(model, **c, **t),
        "Ditto": ditto(model, lam=0.1, **c, **t),
        "APFL": apfl(model, alpha=0.25, **c, **t),
        "pFedMe": pfedme(model, lam=15.0, inner_steps=5, personal_lr=lr, **c, **t),
        "FedPer": fedper(model, **c, **t),
        "FedRep": fedrep(model, head_epochs=10, **c, **t),
        "LG-FedAvg": lg_fedavg(model, **c, **t),
        "SuPerFed-MM": superfed(model, mode="mm", mu=0.01, nu=1.0, start_round=0, **sf, **t),
        "SuPerFed-LM": superfed(model, mode="lm", mu=0.01, nu=2.0, start_round=0, **sf, **t),
    }


def methods(args):
    from fedjax_fair.models import get_model
    from fedjax_fair.drivers.simulate import make_cohort

    ds = federation()
    model = get_model("twonn", ds.input_shape, ds.num_classes)
    params = jax.jit(model.init)(jax.random.key(0))
    d = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    ids = jnp.arange(COHORT, dtype=jnp.int32) * (NUM_CLIENTS // COHORT)
    cohort = make_cohort(ds.data, ids)
    algs = method_algorithms(model)
    print(header(f"personalisation round | twonn (d = {d:,}) | N {NUM_CLIENTS} | cohort "
                 f"{COHORT} | 60 local steps of batch 10"), flush=True)
    fns, states, info = compile_rounds(algs, params, NUM_CLIENTS, cohort)
    names = list(algs)
    loads = [loadavg()]
    best = alternate_rounds(fns, states, cohort, args.trials, lambda: loads.append(loadavg()))
    finite = {name: bool(np.all([np.isfinite(x).all() for x in jax.tree.leaves(s.params)]))
              for name, s in states.items()}
    f0, b0 = info["FedAvg"]["flops"], info["FedAvg"]["bytes"]
    print(f"load average during the trials: {' -> '.join(loads)}")
    print("| method | s/round | x FedAvg | XLA flops x FedAvg | XLA bytes x FedAvg | "
          "arguments GiB | temporaries GiB | compile s | finite |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        i = info[name]
        print(f"| {name} | {best[name]:.3f} | {best[name] / best['FedAvg']:.2f} | "
              f"{i['flops'] / f0:.2f} | {i['bytes'] / b0:.2f} | {gib(i['argument_bytes'])} | "
              f"{gib(i['temp_bytes'])} | {i['compile_s']:.1f} | {finite[name]} |", flush=True)


def live_worker(table: str, rounds: int, out: str) -> dict:
    from fedjax_fair.drivers import runner
    from fedjax_fair.algorithms import fedavg, superfed
    from fedjax_fair.models import get_model

    ds = federation()
    model = get_model("twonn", ds.input_shape, ds.num_classes)
    params = jax.jit(model.init)(jax.random.key(0))
    rss_data = proc_status()["VmRSS"]
    c = dict(training=ClientTraining(lr=0.01, batch_size=10, num_epochs=10))
    alg = (fedavg(model, **c) if table == "fedavg" else
           superfed(model, mode="mm", start_round=0, client_table=table,
                    training=superfed_training(lr=0.01, batch_size=10, num_epochs=10)))
    res = runner.run(alg, params, ds.host_data, jax.random.key(1), model=model,
                     num_rounds=rounds, cohort_size=COHORT, eval_every=max(1, rounds // 2),
                     progress=False, checkpoint_dir=out)
    st = proc_status()
    return {"table": table, "rounds": rounds, "peak_rss": st["VmHWM"], "rss_after_data": rss_data,
            "s_per_round": res.run_seconds / rounds, "compile_s": res.compile_seconds,
            "accuracy": res.history[-1]["accuracy_mean"], "client_table": res.client_table}


def live(args):
    tables = ["fedavg", "dense", f"lazy:{COHORT * args.rounds}"]
    print(header(f"live SuPerFed-MM | N {NUM_CLIENTS} | cohort {COHORT} | {args.rounds} rounds "
                 f"| twonn"), flush=True)
    print("| table | peak RSS GiB | RSS after data GiB | s/round | compile s | table bill |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for table in tables:
            out = os.path.join(tmp, table.replace(":", "_"))
            proc = subprocess.run([sys.executable, __file__, "_live_worker", table,
                                   str(args.rounds), out], capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"| {table} | failed: {proc.stderr.strip().splitlines()[-1]} |")
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            bill = r["client_table"]
            bill = (f"{bill['rows_stored']} rows, {gib(bill['bytes'])} GiB"
                    if bill else "none")
            print(f"| {table} | {gib(r['peak_rss'])} | {gib(r['rss_after_data'])} | "
                  f"{r['s_per_round']:.3f} | {r['compile_s']:.1f} | {bill} |", flush=True)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "_live_worker":
        table, rounds, out = sys.argv[2:]
        print(json.dumps(live_worker(table, int(rounds), out)))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["methods", "live", "all"])
    ap.add_argument("--trials", type=int, default=3, help="methods: timed rounds per method")
    ap.add_argument("--rounds", type=int, default=4, help="live: rounds")
    args = ap.parse_args()
    t = time.perf_counter()
    for what in (["methods", "live"] if args.what == "all" else [args.what]):
        {"methods": methods, "live": live}[what](args)
    print(f"seconds: {time.perf_counter() - t:.0f}")


if __name__ == "__main__":
    main()
