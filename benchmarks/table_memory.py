"""Memory bill of per-client state tables (SCAFFOLD's c_i, FedDyn's / FedSpeed's /
FedADMM's / A-FedPD's duals lambda_i, Ditto's personal models: one parameter-shaped
row per client), dense against lazy, float32 against bfloat16 storage.

Run:   python benchmarks/table_memory.py
       python benchmarks/table_memory.py --cohort 10 --rounds 800 100 --clients 100 1000 10000

Nothing is allocated: shapes come from ``jax.eval_shape`` of the model's init and of
each table's ``init`` (``client_states.dense(dtype)`` / ``lazy(capacity, dtype)``),
so the figures include every piece of the table: the rows, the lazy table's initial
row and drift offset (always float32) and its 8 bytes per client (slot and last
round), and the dense table's 4 bytes per client (last round).

A lazy table needs as many slots as a run can write, min(N, cohort x rounds)
(``runner.run`` refuses fewer): with the paper's cohort of 10 and 800 rounds that is
8000 slots, so lazy stores as much as dense for N <= 8000; a 100-round run needs
1000. ``lazy`` without a capacity has N slots (dense's memory plus 8 N bytes: it
saves the per-round work of A-FedPD's virtual update, not memory).

Two tables are printed: the size of one client's row, and the bill of a federation of
N clients in each storage form.
"""
from __future__ import annotations

import argparse
import platform

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair.core import client_states
from fedjax_fair.models import get_model

# (label, registry name, input shape, classes, model keywords)
MODELS = (
    ("logreg", "logreg", (784,), 62, {}),
    ("mlp 784-200-200-62", "mlp", (784,), 62, {}),
    ("mlp 784-1024-256-62", "mlp", (784,), 62, {"hidden": (1024, 256)}),
    ("lenet_fedpd (CIFAR-10)", "lenet_fedpd", (32, 32, 3), 10, {}),
    ("resnet18_gn imagenet stem (CIFAR-10)", "resnet18_gn", (32, 32, 3), 10,
     {"stem": "imagenet"}),
    # SuPerFed's networks (thesis Ch. II Table 2.2): its local-model table (one model per
    # client), Ditto's / pFedMe's / APFL's personal models have the same rows.
    ("twonn (MNIST)", "twonn", (28, 28, 1), 10, {}),
    ("twocnn (CIFAR-10, 28x28)", "twocnn", (28, 28, 3), 10, {}),
    ("resnet9 (CIFAR-100, 28x28)", "resnet9", (28, 28, 3), 100, {}),
    ("mobilenet (TinyImageNet)", "mobilenet", (64, 64, 3), 200, {}),
    ("vgg9 (FEMNIST)", "vgg9", (28, 28, 1), 62, {}),
)
EXPECTED = {"lenet_fedpd": 797_962, "resnet18_gn": 11_181_642}  # A-FedPD (arXiv:2409.18915) §5, FL-Simulator


def nbytes(tree) -> int:
    return int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


def fmt(b: int) -> str:
    """MiB below 1 GiB, GiB above."""
    return f"{b / 2**20:,.1f} MiB" if b < 2**30 else f"{b / 2**30:,.2f} GiB"


def table_bytes(table, row, n: int) -> int:
    return nbytes(jax.eval_shape(lambda r: table.init(r, n), row))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cohort", type=int, default=10)
    ap.add_argument("--rounds", type=int, nargs="+", default=[800, 100])
    ap.add_argument("--clients", type=int, nargs="+", default=[100, 1000, 10_000])
    ap.add_argument("--cohort-peaks", type=int, nargs="*", default=None,
                    help="instead: measured peak RSS of one MLP FedAvg round at these "
                         "cohorts (e.g. 1000 10000), chunked vs vmap, in subprocesses")
    args = ap.parse_args()
    if args.cohort_peaks is not None:
        cohort_peaks(args.cohort_peaks or [1000, 10_000])
        return
    print(f"# {platform.machine()} | jax {jax.__version__} | shapes only (jax.eval_shape) | "
          f"cohort {args.cohort}, rounds {' / '.join(map(str, args.rounds))}")

    rows = []
    print("\n| model | parameters | per client fp32 | per client bf16 |")
    print("|---|---|---|---|")
    for label, name, shape, classes, kw in MODELS:
        row = jax.eval_shape(get_model(name, shape, classes, **kw).init, jax.random.key(0))
        count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(row))
        if name in EXPECTED and count != EXPECTED[name]:
            raise SystemExit(f"{label}: {count:,} parameters, the spec says {EXPECTED[name]:,}")
        bf16 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), row)
        print(f"| {label} | {count:,} | {fmt(nbytes(row))} | {fmt(nbytes(bf16))} |")
        rows.append((label, row))

    caps = [f"lazy fp32 / bf16, {r} rounds" for r in args.rounds]
    print(f"\n| model | N | dense fp32 | dense bf16 | {' | '.join(caps)} |")
    print("|---|---|---|---|" + "---|" * len(caps))
    for label, row in rows:
        for n in args.clients:
            cells = [fmt(table_bytes(client_states.dense(), row, n)),
                     fmt(table_bytes(client_states.dense(jnp.bfloat16), row, n))]
            for r in args.rounds:
                cap = min(n, args.cohort * r)
                f32 = table_bytes(client_states.lazy(cap), row, n)
                b16 = table_bytes(client_states.lazy(cap, jnp.bfloat16), row, n)
                cells.append(f"{fmt(f32)} / {fmt(b16)} ({cap:,} slots)")
            print(f"| {label} | {n:,} | {' | '.join(cells)} |")


_PEAK_CHILD = r"""
import json, sys, time
import jax
from fedjax_fair.algorithms import fedavg
from fedjax_fair.data import get_dataset
from fedjax_fair.models import mlp
from fedjax_fair.drivers.runner import run
cohort, strategy, aggregation = int(sys.argv[1]), sys.argv[2], sys.argv[3]
def rss():
    with open("/proc/self/status") as f:
        d = dict(l.split(":", 1) for l in f)
    return int(d["VmRSS"].split()[0]) * 1024, int(d["VmHWM"].split()[0]) * 1024
ds = get_dataset("femnist_like", num_clients=cohort, min_examples=20, max_examples=20,
                 test_examples=5)
model = mlp(ds.input_shape, ds.num_classes)
params = jax.jit(model.init)(jax.random.key(0))
# "stacked": the same weights without their per-client form, so the round stacks
# every client's update [K, d] before the server step (the layout before streaming)
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.core.mixing import by_num_examples
mixing = by_num_examples()
mixing = mixing if aggregation == "streamed" else mixing._replace(logit=None)
alg = fedavg(model, training=ClientTraining(lr=0.05, batch_size=20), mixing=mixing)
assert alg.streamed == (aggregation == "streamed")
before = rss()[1]
lines = []
t = time.perf_counter()
import tempfile  # a checkpoint directory, as the CLI runs: the chunk donates its state
CK = tempfile.TemporaryDirectory()  # removed at exit
res = run(alg, params, ds.host_data, jax.random.key(0), model=model, num_rounds=1,
          cohort_size=cohort, eval_every=1, progress=False, log=lines.append,
          execution=strategy, checkpoint_dir=CK.name, donate=True)
print(json.dumps({"data_rss": before, "peak_rss": rss()[1], "plan": lines[-1],
                  "round_s": res.run_seconds, "compile_s": res.compile_seconds,
                  "seconds": time.perf_counter() - t}))
"""


def cohort_peaks(cohorts) -> None:
    """Peak RSS (VmHWM) of one FedAvg round of the MLP 784-200-200-62 over every client
    of a femnist_like federation of ``cohort`` clients (20 rows each, one local step
    of 20), in a fresh subprocess per (cohort, strategy, aggregation), run as the CLI
    runs it (a checkpoint directory, the chunk program donating the state): the
    runner's printed memory plan beside what the process actually peaked at.
    Aggregation "streamed" (the default: updates summed as the clients finish) and
    "stacked" (every update held [K, d] for the server step) side by side."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    print("| cohort | execution | aggregation | data GiB (RSS before the run) | peak RSS GiB | "
          "run s (1 round) | compile s | memory plan printed before allocation |")
    print("|---|---|---|---|---|---|---|---|")
    for cohort in cohorts:
        cases = [("chunked", "streamed"), ("chunked", "stacked"), ("sequential", "streamed")]
        # vmap holds every client's parameters and gradients at once: at 10,000
        # clients (over 8 GiB of parameters alone) it is not run
        cases += [("vmap", "streamed")] if cohort <= 1000 else []
        for strategy, aggregation in cases:
            proc = subprocess.run([sys.executable, "-c", _PEAK_CHILD, str(cohort), strategy,
                                   aggregation], env=env, capture_output=True, text=True)
            if proc.returncode:
                tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:120]
                print(f"| {cohort} | {strategy} | {aggregation} | - | failed: {tail} | - | - | - |")
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"| {cohort} | {strategy} | {aggregation} | {r['data_rss'] / 2**30:.2f} | "
                  f"{r['peak_rss'] / 2**30:.2f} | {r['round_s']:.2f} | {r['compile_s']:.1f} | "
                  f"{r['plan']} |", flush=True)


if __name__ == "__main__":
    main()
