"""Memory bill of per-client state tables (SCAFFOLD c_i, FedDyn g_i, Ditto's personal
models: one parameter-shaped row per client), dense against lazy.

Run:   python benchmarks/table_memory.py

Nothing is allocated: shapes come from ``jax.eval_shape`` of the model's init and of
each table's ``init``. The lazy table's capacity is the most clients a run can write,
min(N, cohort x rounds); the example uses cohort 10 and 50 rounds (500 slots).
"""
from __future__ import annotations

import jax
import numpy as np

from fedjax_fair import client_states
from fedjax_fair.models import get_model

MODELS = (("logreg", (784,), 62), ("mlp", (784,), 62), ("lenet_fedpd", (32, 32, 3), 10),
          ("resnet18_gn", (32, 32, 3), 10))
FEDERATIONS = (100, 1000, 10_000)
COHORT, ROUNDS = 10, 50


def nbytes(tree) -> int:
    return int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


def main():
    print("| model | parameters | MiB per client | N | dense MiB | lazy MiB (500 slots) |")
    print("|---|---|---|---|---|---|")
    for name, shape, classes in MODELS:
        model = get_model(name, shape, classes)
        row = jax.eval_shape(model.init, jax.random.key(0))
        count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(row))
        for n in FEDERATIONS:
            dense = jax.eval_shape(lambda r: client_states.dense().init(r, n), row)
            lazy = jax.eval_shape(
                lambda r: client_states.lazy(min(n, COHORT * ROUNDS)).init(r, n), row)
            print(f"| {name} | {count:,} | {nbytes(row) / 2**20:.2f} | {n:,} | "
                  f"{nbytes(dense) / 2**20:,.1f} | {nbytes(lazy) / 2**20:,.1f} |")


if __name__ == "__main__":
    main()
