"""Generative FL (issue 13): FedEvg and FedCVAE at a cohort of 100 in one compiled program.

Run:   python benchmarks/generative.py methods     (one round of every method, cohort 100)
       python benchmarks/generative.py live        (FedEvg and FedAvg through runner.run, N = 1000)
       python benchmarks/generative.py bill        (FedEvg's memory bill, shapes only)
       python benchmarks/generative.py all

``bill`` (also printed by ``methods`` and ``all``): FedEvg's memory, from shapes only
(``jax.eval_shape``, float32, nothing allocated), for the spec's settings
(Hahn's thesis Ch. IV §4.1: ResNet-10 with GroupNorm and a spectral-normalised head,
``resnet10_gn_sn``; MNIST padded to 32x32x1 and CIFAR-10 32x32x3; M = 10 L = 100
synthetic samples; K = 100 clients, C = 0.1, so S = 10 per round, and S = 100 for
the issue's cohort of 100) and for this benchmark's (``mlp``, 28x28x1, M = 100,
N = 1000, S = 100). Columns: P (classifier parameters), D (input size); the
synthetic set D~ (M x D inputs and M int32 labels); the cohort's uploads (S x M x D
energy gradients and S x M log-weights, the input of the server's eq. 4.13); the
server classifier with its optimiser state (coupled L2 + Adam: 2 P and a count); the
dense per-client table of ``persistent_client_model=True`` (N x P and 4 bytes a
client); the cohort's classifiers with their Adam states when vmapped together
(S x 3 P, the local chain buffers S x M x D; one client's under ``sequential``).

``methods``: one jitted round (``apply``, the server state donated, so the table is
updated in place) of each method on one fixed cohort of 100 of N = 1000 MNIST-shaped
clients (60 examples of 28x28x1, pixels uniform in [0, 1] (FedEvg clips its samples
to [0, 1]), 10 classes) with the zoo's ``mlp`` (784-200-200-10, 199,210 parameters)
and equal local work: 20 local steps of batch 64 (a client's 60 rows are one batch,
so 20 epochs capped at 20 steps). FedAvg: SGD, lr 0.1. FedEvg: M = 100 synthetic
samples, ``local_iters`` 20, one client SGLD step per iteration, the server's SGLD
step and 10 Adam steps of the server classifier on D~ (the defaults), T = 500;
with fresh client models (the default) and with ``persistent_client_model=True``
(a dense table of 1000 classifiers). FedCVAE: ``fedcvae(model, ...)`` with the
classifier model (it builds its CVAE inside: latent 16, one hidden layer of 256; Adam
1e-3 clients, FedAvg of the CVAE, then a fresh decoder set of 100 samples and 10 Adam
steps of the server classifier on it; ``--skip-fedcvae`` leaves it out, and so does
a ``fedcvae`` that refuses the classifier, with a note). These run with the default
execution (``"auto"``: ``sequential`` on CPU); FedEvg (fresh) also runs with each strategy of
``execution.map_clients``: ``vmap``, ``chunked`` (10 and 25 clients per chunk) and
``bucketed`` (4 buckets of 25; all clients have 60 rows here, so it is ``chunked``
plus a sort). The methods alternate within each trial (the starting method rotates)
and each reports its fastest of ``--trials`` rounds, so load on the shared machine
hits all alike. Columns: seconds per round and the ratio to FedAvg; XLA's cost
analysis of the compiled round (FLOPs and bytes accessed against FedAvg; it counts a
loop body once: the 20 local steps count as one, and under ``sequential`` /
``chunked`` / ``bucketed`` the loop over clients counts one client or one chunk, so
compare these columns only between rows of the same strategy); XLA's memory analysis
of the compiled round (arguments, i.e. the state with its table and the cohort, and
temporaries); compile seconds; whether the new state is finite.

``live``: FedEvg (fresh client models), FedEvg with the dense table of persistent
client models and FedAvg (the same settings as ``methods``) through ``runner.run`` as
the CLI runs it (a checkpoint directory, so the state is donated to each chunk
program) on the same federation (N = 1000, cohort 100, ``--rounds`` rounds, every
client evaluated after each of two chunks), each in its own subprocess reporting its
peak resident memory (VmHWM), its resident memory once the data are built, seconds
per round (run time only) and the table's bill (``RunResult.client_table``).
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
from table_memory import fmt, nbytes, table_bytes  # noqa: E402
from timing import alternate_rounds, compile_rounds  # noqa: E402
from fedjax_fair.algorithms import default_training
from fedjax_fair.core.client import ClientTraining

NUM_CLIENTS, COHORT, EXAMPLES = 1000, 100, 60
NUM_SYNTH, LOCAL_STEPS, BATCH = 100, 20, 64


def federation(num_clients: int = NUM_CLIENTS):
    from fedjax_fair.data import from_client_arrays
    rng = np.random.default_rng(0)
    xs = [rng.uniform(size=(EXAMPLES, 28, 28, 1)).astype(np.float32) for _ in range(num_clients)]
    ys = [rng.integers(0, 10, EXAMPLES).astype(np.int32) for _ in range(num_clients)]
    return from_client_arrays(xs[:], ys[:], [x[:12] for x in xs], [y[:12] for y in ys],
                              name="mnist_shaped_uniform", num_classes=10)


def fedavg_alg(model):
    from fedjax_fair.algorithms.fedavg import fedavg
    return fedavg(model, training=ClientTraining(batch_size=BATCH, num_epochs=LOCAL_STEPS,
                                                 max_steps=LOCAL_STEPS))


def fedevg_alg(model, persistent: bool = False):
    from fedjax_fair.algorithms.fedevg import fedevg
    return fedevg(model, num_synth=NUM_SYNTH, local_iters=LOCAL_STEPS,
                  training=default_training("fedevg")._replace(batch_size=BATCH),
                  num_rounds=500, persistent_client_model=persistent)


def fedcvae_alg(model):
    """FedCVAE with the classifier model, or (None, why) while ``fedcvae`` still
    takes a CVAE only."""
    from fedjax_fair.algorithms.fedcvae import fedcvae
    try:
        return fedcvae(model, training=default_training("fedcvae")._replace(
            batch_size=BATCH, num_epochs=LOCAL_STEPS, max_steps=LOCAL_STEPS)), None
    except (TypeError, ValueError) as e:
        return None, f"fedcvae does not take the classifier model yet ({e})"


def with_execution(alg, execution):
    """``alg`` whose round always maps its clients with ``execution``."""
    return alg._replace(apply=lambda s, c, k, e=None, _apply=alg.apply: _apply(s, c, k,
                                                                              execution))


def method_algorithms(model, skip_fedcvae: bool = False) -> tuple[dict, dict, list]:
    """(algorithms, their execution labels, notes on skipped methods)."""
    from fedjax_fair.core.execution import Execution
    algs, notes = {"FedAvg": fedavg_alg(model)}, []
    fresh = fedevg_alg(model)
    algs["FedEvg"] = fresh
    algs["FedEvg persistent (dense)"] = fedevg_alg(model, persistent=True)
    cvae, why = (None, "--skip-fedcvae") if skip_fedcvae else fedcvae_alg(model)
    if cvae is None:
        notes.append(f"FedCVAE skipped: {why}")
    else:
        algs["FedCVAE"] = cvae
    execs = {name: "auto (sequential)" for name in algs}
    for label, ex in [("vmap", Execution("vmap")), ("chunked:10", Execution("chunked", 10)),
                      ("chunked:25", Execution("chunked", 25)),
                      ("bucketed:25", Execution("bucketed"))]:
        algs[f"FedEvg {label}"] = with_execution(fresh, ex)
        execs[f"FedEvg {label}"] = label
    return algs, execs, notes


def finite(state) -> bool:
    leaves = jax.tree.leaves((state.params, state.aggregator_state))
    return bool(np.all([np.isfinite(x).all() for x in leaves
                        if jnp.issubdtype(x.dtype, jnp.floating)]))


def methods(args):
    from fedjax_fair.models import get_model
    from fedjax_fair.drivers.simulate import make_cohort

    ds = federation()
    model = get_model("mlp", ds.input_shape, ds.num_classes)
    params = jax.jit(model.init)(jax.random.key(0))
    d = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    ids = jnp.arange(COHORT, dtype=jnp.int32) * (NUM_CLIENTS // COHORT)
    cohort = make_cohort(ds.data, ids)
    algs, execs, notes = method_algorithms(model, args.skip_fedcvae)
    print(header(f"generative round | mlp (d = {d:,}) | N {NUM_CLIENTS} | cohort {COHORT} | "
                 f"{LOCAL_STEPS} local steps of batch {BATCH} | M {NUM_SYNTH}"), flush=True)
    for note in notes:
        print(note, flush=True)
    fns, states, info = compile_rounds(algs, params, NUM_CLIENTS, cohort)
    names = list(algs)
    loads = [loadavg()]
    best = alternate_rounds(fns, states, cohort, args.trials, lambda: loads.append(loadavg()))
    f0, b0 = info["FedAvg"]["flops"], info["FedAvg"]["bytes"]
    print(f"load average during the trials: {' -> '.join(loads)}")
    print("| method | execution | s/round | x FedAvg | XLA flops x FedAvg | XLA bytes x FedAvg | "
          "arguments GiB | temporaries GiB | compile s | finite |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        i = info[name]
        label = "FedEvg" if execs[name] != "auto (sequential)" else name
        print(f"| {label} | {execs[name]} | {best[name]:.3f} | "
              f"{best[name] / best['FedAvg']:.2f} | {i['flops'] / f0:.2f} | "
              f"{i['bytes'] / b0:.2f} | {gib(i['argument_bytes'])} | {gib(i['temp_bytes'])} | "
              f"{i['compile_s']:.1f} | {finite(states[name])} |", flush=True)


# ----------------------------------------------------------------- memory bill

# (label, registry name, input shape, classes, M, N, S)
BILL_SETTINGS = (
    ("spec MNIST (resnet10_gn_sn, 32x32x1)", "resnet10_gn_sn", (32, 32, 1), 10, 100, 100, 10),
    ("spec CIFAR-10 (resnet10_gn_sn, 32x32x3)", "resnet10_gn_sn", (32, 32, 3), 10, 100, 100, 10),
    ("spec MNIST, cohort 100", "resnet10_gn_sn", (32, 32, 1), 10, 100, 100, 100),
    ("spec CIFAR-10, cohort 100", "resnet10_gn_sn", (32, 32, 3), 10, 100, 100, 100),
    ("this benchmark (mlp, 28x28x1)", "mlp", (28, 28, 1), 10, NUM_SYNTH, NUM_CLIENTS, COHORT),
)


def bill(args=None):
    import optax

    from fedjax_fair.core import client_states
    from fedjax_fair.models import get_model

    f32 = 4
    print(f"# FedEvg memory bill | shapes only (jax.eval_shape), float32 | jax {jax.__version__}")
    print("| setting | P | D | M | N | S | D~ (M x D) | uploads (S x M x (D + 1)) | "
          "server classifier + Adam | table N x P (persistent) | S classifiers + Adam "
          "(vmap) | S chain buffers (vmap) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, name, shape, classes, m, n, s in BILL_SETTINGS:
        model = get_model(name, shape, classes)
        row = jax.eval_shape(model.init, jax.random.key(0))
        p = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(row))
        d = int(np.prod(shape))
        opt = jax.eval_shape(optax.chain(optax.add_decayed_weights(1e-4),
                                         optax.adam(1e-3)).init, row)
        synth = m * d * f32 + m * 4
        uploads = s * m * (d + 1) * f32
        server = nbytes(row) + nbytes(opt)
        table = table_bytes(client_states.dense(), row, n)
        in_flight = s * (nbytes(row) + nbytes(opt))
        buffers = s * m * d * f32
        print(f"| {label} | {p:,} | {d:,} | {m} | {n} | {s} | {fmt(synth)} | {fmt(uploads)} | "
              f"{fmt(server)} | {fmt(table)} | {fmt(in_flight)} | {fmt(buffers)} |",
              flush=True)


# ----------------------------------------------------------------- live


def live_worker(which: str, rounds: int, out: str) -> dict:
    from fedjax_fair.drivers import runner
    from fedjax_fair.models import get_model

    ds = federation()
    model = get_model("mlp", ds.input_shape, ds.num_classes)
    params = jax.jit(model.init)(jax.random.key(0))
    rss_data = proc_status()["VmRSS"]
    alg = {"fedavg": lambda: fedavg_alg(model), "fedevg": lambda: fedevg_alg(model),
           "fedevg-persistent": lambda: fedevg_alg(model, persistent=True)}[which]()
    res = runner.run(alg, params, ds.host_data, jax.random.key(1), model=model,
                     num_rounds=rounds, cohort_size=COHORT, eval_every=max(1, rounds // 2),
                     progress=False, checkpoint_dir=out)
    st = proc_status()
    return {"method": which, "rounds": rounds, "peak_rss": st["VmHWM"],
            "rss_after_data": rss_data, "s_per_round": res.run_seconds / rounds,
            "compile_s": res.compile_seconds, "accuracy": res.history[-1]["accuracy_mean"],
            "client_table": res.client_table}


def live(args):
    which = ["fedavg", "fedevg", "fedevg-persistent"]
    print(header(f"live FedEvg / FedAvg | N {NUM_CLIENTS} | cohort {COHORT} | {args.rounds} "
                 f"rounds | mlp"), flush=True)
    print("| method | peak RSS GiB | RSS after data GiB | s/round | compile s | table bill |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for w in which:
            out = os.path.join(tmp, w)
            proc = subprocess.run([sys.executable, __file__, "_live_worker", w,
                                   str(args.rounds), out], capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"| {w} | failed: {proc.stderr.strip().splitlines()[-1]} |")
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            tb = r["client_table"]
            tb = f"{tb['rows_stored']} rows, {gib(tb['bytes'])} GiB" if tb else "none"
            print(f"| {w} | {gib(r['peak_rss'])} | {gib(r['rss_after_data'])} | "
                  f"{r['s_per_round']:.3f} | {r['compile_s']:.1f} | {tb} |", flush=True)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "_live_worker":
        which, rounds, out = sys.argv[2:]
        print(json.dumps(live_worker(which, int(rounds), out)))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["methods", "live", "bill", "all"])
    ap.add_argument("--trials", type=int, default=3, help="methods: timed rounds per method")
    ap.add_argument("--rounds", type=int, default=10, help="live: rounds")
    ap.add_argument("--skip-fedcvae", action="store_true",
                    help="methods: leave FedCVAE out (e.g. while its factory changes)")
    args = ap.parse_args()
    t = time.perf_counter()
    steps = {"all": ["bill", "methods", "live"], "methods": ["bill", "methods"]}
    for what in steps.get(args.what, [args.what]):
        {"methods": methods, "live": live, "bill": bill}[what](args)
    print(f"seconds: {time.perf_counter() - t:.0f}")


if __name__ == "__main__":
    main()
