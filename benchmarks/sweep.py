"""A vectorised sweep (``fedjax_fair.drivers.sweeps``) against the same runs one after another.

Run:   python benchmarks/sweep.py grid      (q-FFL, 4 q x 4 client rates, one seed)
       python benchmarks/sweep.py seeds     (FedAvg, one setting x 16 seeds)
       python benchmarks/sweep.py chunks    (the grid in tiles of 4 runs: host loop vs lax.map)
       python benchmarks/sweep.py remat     (memory of a meta-gradient, remat on / off)
       python benchmarks/sweep.py all       [--rounds 50] [--json out.json]

The federation is Synthetic(1, 1) (30 clients, the q-FFL paper's generator, padded to
800 rows) with multinomial logistic regression, cohorts of 10, local SGD with batch 10
for one epoch, ``--rounds`` rounds; every variant ends with every client's test
accuracy. Timings are end to end (wall clock, compilation included) in one process,
after a warm-up (``warm_up``) that pays the process's one-time costs:

* ``sweep``: one ``sweep(...)`` call: one compiled program for all 16 runs (the
  grid's 16 points vmapped in one call; 16 seeds one after another on CPU, and
  ``sweep, seeds vmapped`` with ``vmap_seeds=True``, the accelerators' default);
* ``runner.run x 16``: what a user writes without ``sweep``: a loop building each
  algorithm from Python floats and calling ``runner.run`` (each new setting compiles
  its own program; the runs of one setting over seeds share one through the runner's
  program cache);
* ``jit(run) x 16``: one jitted run taking the hyper-parameters and the seed as
  arguments (compiled once), called 16 times: the best a sequential loop can do.

``chunks`` runs the grid's sweep with ``chunk_size=4`` both ways: a host loop over
4 calls of one compiled tile (``chunk_loop="host"``, the default) and a ``lax.map``
over the tiles in one program (``"map"``).

``remat``: XLA's memory analysis (temporaries of the compiled program) of
``jax.grad`` of ``meta.make_objective`` (FedAvg on digits with a 64-200-10 MLP,
mean validation loss, client rate the argument) at 5 and 20 rounds of 1 and 4 local
epochs, each round recomputed in the backward pass (``remat=True``) or not.

Every variant's final per-client accuracies are checked against the sweep's (the
largest difference is printed). The machine is shared: the load average is printed
in the header; compare ratios within one invocation.
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

from fedjax_fair.drivers import runner
from fedjax_fair.algorithms import fedavg, qffl
from fedjax_fair.data import get_dataset
from fedjax_fair.models import logistic_regression
from fedjax_fair.drivers.sweeps import evaluate_state, final_state, sweep
from fedjax_fair.scenarios import sampling
from fedjax_fair.core.client import ClientTraining

COHORT, BATCH = 10, 10
QS = (0.0, 0.1, 1.0, 5.0)
LRS = (0.003, 0.01, 0.02, 0.03)


def header(what: str) -> str:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"# {what} | {platform.machine()} | {os.cpu_count()} cores | jax {jax.__version__} "
            f"| {jax.devices()[0]} | load {load}")


def setup():
    ds = get_dataset("synthetic", alpha=1.0, beta=1.0, num_clients=30, seed=0)
    return ds, logistic_regression(ds.input_shape, ds.num_classes)


def scenario(name: str, model):
    """(builder of traced hparams, grid, seeds, factory of Python floats -> algorithm)."""
    if name == "grid":
        build = lambda hp: qffl(model, q=hp["q"], training=ClientTraining(lr=hp["lr"],
                                                                          batch_size=BATCH))
        configs = [dict(q=q, lr=lr) for q in QS for lr in LRS]  # the sweep's C order
        return build, {"q": QS, "lr": LRS}, (0,), [(c, 0) for c in configs]
    build = lambda hp: fedavg(model, training=ClientTraining(lr=0.03, batch_size=BATCH))
    return build, {}, tuple(range(16)), [({}, s) for s in range(16)]


def time_sweep(build, grid, seeds, ds, model, rounds, **kw):
    t = time.perf_counter()
    r = sweep(build, grid, model=model, data=ds, seeds=seeds, num_rounds=rounds,
              cohort_size=COHORT, **kw)
    total = time.perf_counter() - t
    acc = r.test["accuracy"].reshape(-1, ds.num_clients)
    return dict(compile=r.compile_seconds, run=r.run_seconds, total=total), acc


def time_runner(build, runs, ds, model, rounds):
    """A user's loop: each setting's algorithm built from Python floats, runner.run."""
    t = time.perf_counter()
    compile_s, accs, built = 0.0, [], {}
    for hp, seed in runs:
        name = tuple(sorted(hp.items()))
        if name not in built:  # one algorithm object per setting (seeds share it)
            built[name] = build({k: float(v) for k, v in hp.items()})
        key = jax.random.key(seed)
        params = jax.jit(model.init)(key)
        res = runner.run(built[name], params, ds.host_data, key, model=model,
                         num_rounds=rounds, cohort_size=COHORT, eval_every=rounds,
                         progress=False)
        compile_s += res.compile_seconds
        accs.append(res.client_metrics["accuracy"])
    total = time.perf_counter() - t
    return dict(compile=compile_s, run=total - compile_s, total=total), np.stack(accs)


def time_jit_loop(build, runs, ds, model, rounds):
    """One jitted run with the hyper-parameters and the seed as arguments."""
    def one(hp, seed, data):
        key = jax.random.key(seed)
        alg = build(hp)
        state = final_state(alg, model.init(key), data, key, num_rounds=rounds,
                            cohort_size=COHORT, sampler=sampling.uniform)
        return evaluate_state(model, alg, state, data.test)["accuracy"]

    t = time.perf_counter()
    hp0 = {k: jnp.float32(v) for k, v in runs[0][0].items()}
    compiled = jax.jit(one).lower(hp0, jnp.uint32(runs[0][1]), ds.data).compile()
    compile_s = time.perf_counter() - t
    accs = [np.asarray(compiled({k: jnp.float32(v) for k, v in hp.items()}, jnp.uint32(s),
                                ds.data)) for hp, s in runs]
    total = time.perf_counter() - t
    return dict(compile=compile_s, run=total - compile_s, total=total), np.stack(accs)


def table(rows, reference: str) -> str:
    ref = rows[reference]["total"]
    lines = [f"{'variant':<24} {'compile s':>10} {'run s':>8} {'total s':>8} "
             f"{'total / sweep':>13} {'max |acc diff|':>15}"]
    for name, r in rows.items():
        lines.append(f"{name:<24} {r['compile']:>10.2f} {r['run']:>8.2f} {r['total']:>8.2f} "
                     f"{r['total'] / ref:>13.2f} {r['diff']:>15.2e}")
    return "\n".join(lines)


def warm_up(ds, model) -> None:
    """One-time costs of a process (XLA and LLVM start-up, the jitted model init, the
    summary kernels) paid before any timing, so the variant timed first is not
    charged for them: a 1-round sweep, runner.run and jitted run of FedAvg."""
    build = lambda hp: fedavg(model, training=ClientTraining(lr=0.01, batch_size=BATCH))
    time_sweep(build, {}, (0,), ds, model, 1)
    time_runner(build, [({}, 0)], ds, model, 1)
    time_jit_loop(build, [({}, 0)], ds, model, 1)


def compare(name: str, ds, model, rounds: int) -> dict:
    build, grid, seeds, runs = scenario(name, model)
    rows = {}
    rows["sweep"], acc = time_sweep(build, grid, seeds, ds, model, rounds)
    rows["sweep"]["diff"] = 0.0
    if len(seeds) > 1:  # the default on CPU runs the seeds one after another
        rows["sweep, seeds vmapped"], other = time_sweep(build, grid, seeds, ds, model, rounds,
                                                         vmap_seeds=True)
        rows["sweep, seeds vmapped"]["diff"] = float(np.abs(other - acc).max())
    for label, fn in (("runner.run x 16", time_runner), ("jit(run) x 16", time_jit_loop)):
        rows[label], other = fn(build, runs, ds, model, rounds)
        rows[label]["diff"] = float(np.abs(other - acc).max())
    print(header(f"sweep '{name}': {len(runs)} runs of {rounds} rounds"))
    print(table(rows, "sweep"), flush=True)
    return rows


def chunks(ds, model, rounds: int) -> dict:
    build, grid, seeds, _ = scenario("grid", model)
    rows = {}
    rows["all at once"], acc = time_sweep(build, grid, seeds, ds, model, rounds)
    for loop in ("host", "map"):
        rows[f"chunks of 4, {loop}"], other = time_sweep(build, grid, seeds, ds, model, rounds,
                                                        chunk_size=4, chunk_loop=loop)
        rows[f"chunks of 4, {loop}"]["diff"] = float(np.abs(other - acc).max())
    rows["all at once"]["diff"] = 0.0
    print(header(f"sweep chunking: 16 runs of {rounds} rounds"))
    print(table(rows, "all at once"), flush=True)
    return rows


def remat() -> dict:
    from fedjax_fair.drivers import meta
    from fedjax_fair.data import resplit
    from fedjax_fair.models import mlp
    ds = resplit(get_dataset("digits", num_clients=20, seed=0), (0.6, 0.2, 0.2), seed=0)
    model = mlp(ds.input_shape, ds.num_classes, hidden=(200,))
    rows = {}
    print(header("meta-gradient memory: temporaries of jit(grad(objective)), MiB"))
    print(f"{'rounds':>6} {'epochs':>6} {'local steps':>11} {'remat off':>10} {'remat on':>9}")
    for rounds in (5, 20):
        for epochs in (1, 4):
            row = {}
            for on in (False, True):
                f = meta.make_objective(
                    lambda hp: fedavg(model, training=ClientTraining(lr=hp["lr"], batch_size=10,
                                                                     num_epochs=epochs)), meta.mean_loss, model=model,
                    data=ds, num_rounds=rounds, cohort_size=5, remat=on)
                compiled = jax.jit(jax.grad(f)).lower({"lr": jnp.float32(0.05)},
                                                      ds.data).compile()
                row["on" if on else "off"] = compiled.memory_analysis().temp_size_in_bytes
            steps = epochs * -(-ds.host_data.train.mask.shape[1] // 10)
            rows[f"{rounds}x{epochs}"] = dict(rounds=rounds, epochs=epochs, steps=steps, **row)
            print(f"{rounds:>6} {epochs:>6} {steps:>11} {row['off'] / 2**20:>10.2f} "
                  f"{row['on'] / 2**20:>9.2f}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["grid", "seeds", "chunks", "remat", "all"])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--json", help="write the timings here")
    args = ap.parse_args()
    ds, model = setup()
    if args.what != "remat":
        warm_up(ds, model)
    out = {}
    for what in (["grid", "seeds", "chunks", "remat"] if args.what == "all" else [args.what]):
        out[what] = (chunks(ds, model, args.rounds) if what == "chunks" else remat()
                     if what == "remat" else compare(what, ds, model, args.rounds))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
