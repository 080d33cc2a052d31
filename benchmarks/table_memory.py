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

from fedjax_fair import client_states
from fedjax_fair.models import get_model

# (label, registry name, input shape, classes, model keywords)
MODELS = (
    ("logreg", "logreg", (784,), 62, {}),
    ("mlp 784-200-200-62", "mlp", (784,), 62, {}),
    ("mlp 784-1024-256-62", "mlp", (784,), 62, {"hidden": (1024, 256)}),
    ("lenet_fedpd (CIFAR-10)", "lenet_fedpd", (32, 32, 3), 10, {}),
    ("resnet18_gn imagenet stem (CIFAR-10)", "resnet18_gn", (32, 32, 3), 10,
     {"stem": "imagenet"}),
    # SuPerFed's networks (spec/superfed.md §4): its local-model table (one model per
    # client), Ditto's / pFedMe's / APFL's personal models have the same rows.
    ("twonn (MNIST)", "twonn", (28, 28, 1), 10, {}),
    ("twocnn (CIFAR-10, 28x28)", "twocnn", (28, 28, 3), 10, {}),
    ("resnet9 (CIFAR-100, 28x28)", "resnet9", (28, 28, 3), 100, {}),
    ("mobilenet (TinyImageNet)", "mobilenet", (64, 64, 3), 200, {}),
    ("vgg9 (FEMNIST)", "vgg9", (28, 28, 1), 62, {}),
)
EXPECTED = {"lenet_fedpd": 797_962, "resnet18_gn": 11_181_642}  # spec/a_fedpd.md §5


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
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
