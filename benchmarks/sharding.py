"""Per-device memory of a sharded FedAvg round: one device against a mesh of D devices.

Run:   python benchmarks/sharding.py                 (8 CPU devices, cohort 1000)
       python benchmarks/sharding.py --devices 4 --cohort 500 --strategies vmap
       python benchmarks/sharding.py --run           (also run each round once and
                                                      check the sharded result)

On CPU the script makes the devices itself (``--xla_force_host_platform_device_count``
in ``XLA_FLAGS`` before jax is imported); on a machine with D accelerators it uses
them.

Setup: N = cohort federation of synthetic clients with ``--examples`` rows of
``--features`` inputs each and 10 classes; an MLP (features-200-200-10); FedAvg
with ``--steps`` local steps of batch 20 (one epoch when examples = 20 x steps).
For each execution strategy the same round (``simulate``, one round, every client
sampled) is compiled twice: on one device, and over ``sharding.make_mesh(D)`` with
the federation split by client (``sharding.federation_shardings``) and the server
state replicated. The table prints XLA's own accounting of each compiled program
(``Compiled.memory_analysis()``: for an SPMD program, one device's share): the
arguments (federation, state, key), the temporaries (the clients' parameters,
gradients and activations, the gathered cohort) and their sum, and the ratio of the
sharded program's per-device bytes to the single device's. Nothing is timed: the
numbers are what each device must hold, independent of the machine's load.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
from fedjax_fair.core.client import ClientTraining


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--cohort", type=int, default=1000, help="clients per round (= N)")
    p.add_argument("--examples", type=int, default=200, help="rows per client")
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--steps", type=int, default=10, help="local steps of batch 20")
    p.add_argument("--strategies", default="vmap,chunked,sequential")
    p.add_argument("--chunk-size", type=int, default=25)
    p.add_argument("--run", action="store_true",
                   help="run each round once and compare the sharded result")
    return p.parse_args()


ARGS = _args()
if "jax" not in sys.modules:  # make CPU devices before jax starts
    flag = f"--xla_force_host_platform_device_count={ARGS.devices}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from fedjax_fair.core import sharding  # noqa: E402
from fedjax_fair.algorithms.fedavg import fedavg  # noqa: E402
from fedjax_fair.core.execution import Execution  # noqa: E402
from fedjax_fair.models import mlp  # noqa: E402
from fedjax_fair.drivers.simulate import simulate  # noqa: E402
from fedjax_fair.core.types import ClientData, FederatedData  # noqa: E402

CLASSES = 10
BATCH = 20


def federation(num_clients: int, examples: int, features: int) -> FederatedData:
    """Synthetic clients, every row real (NumPy, float32 inputs, int32 labels)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(num_clients, examples, features)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(num_clients, examples)).astype(np.int32)
    split = ClientData({"x": x, "y": y}, np.ones((num_clients, examples), bool),
                       np.full((num_clients,), examples, np.int32))
    return FederatedData(train=split, test=split)


def compiled_round(alg, state, data, execution, cohort: int):
    fn = jax.jit(lambda s, d, k: simulate(alg, s, d, k, num_rounds=1, cohort_size=cohort,
                                          execution=execution))
    return fn.lower(state, data, jax.random.key(0)).compile()


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:,.1f}"


def main():
    a = ARGS
    if jax.device_count() < a.devices:
        raise SystemExit(f"devices: {a.devices} requested, {jax.device_count()} exist")
    model = mlp((a.features,), CLASSES)
    params = jax.jit(model.init)(jax.random.key(0))
    d = sum(x.size for x in jax.tree.leaves(params))
    alg = fedavg(model, training=ClientTraining(batch_size=BATCH, max_steps=a.steps,
                                                num_epochs=max(1, -(-a.steps * BATCH // a.examples))))
    data = federation(a.cohort, a.examples, a.features)
    mesh = sharding.make_mesh(a.devices)
    layout, note = sharding.federation_shardings(mesh, data)
    if note:
        print(note)
    state = alg.init(params, a.cohort)
    single_state, single_data = jax.device_put(state), jax.device_put(data)
    sharded_state = jax.device_put(state, sharding.state_shardings(mesh, state))
    sharded_data = jax.device_put(data, layout)

    print(f"# Per-device memory of one FedAvg round, {jax.devices()[0].platform} x "
          f"{a.devices}, jax {jax.__version__}, {platform.machine()} "
          f"({os.cpu_count()} cores)")
    print(f"# cohort {a.cohort} of N = {a.cohort} clients x {a.examples} rows x "
          f"{a.features} features; MLP {a.features}-200-200-{CLASSES} ({d:,} parameters); "
          f"{a.steps} local steps of batch {BATCH}")
    print("| strategy | devices | arguments MiB | temporaries MiB | outputs MiB | "
          "total MiB / device | sharded / single |")
    print("|---|---|---|---|---|---|---|")
    for strategy in a.strategies.split(","):
        chunk = a.chunk_size if strategy == "chunked" else None
        totals = {}
        results = {}
        for devices, st, dt, ex in (
                (1, single_state, single_data, Execution(strategy, chunk)),
                (a.devices, sharded_state, sharded_data, Execution(strategy, chunk, mesh))):
            compiled = compiled_round(alg, st, dt, ex, a.cohort)
            m = compiled.memory_analysis()
            total = (m.argument_size_in_bytes + m.temp_size_in_bytes
                     + m.output_size_in_bytes - m.alias_size_in_bytes)
            totals[devices] = total
            ratio = "" if devices == 1 else f"{total / totals[1]:.3f}"
            label = strategy + (f":{chunk}" if chunk else "")
            print(f"| {label} | {devices} | {_mib(m.argument_size_in_bytes)} | "
                  f"{_mib(m.temp_size_in_bytes)} | {_mib(m.output_size_in_bytes)} | "
                  f"{_mib(total)} | {ratio} |", flush=True)
            if a.run:
                results[devices] = compiled(st, dt, jax.random.key(0))[0].params
        if a.run:
            diff = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
                       for x, y in zip(jax.tree.leaves(results[1]),
                                       jax.tree.leaves(results[a.devices])))
            print(f"| (ran both: new parameters differ by at most {diff:.1e}) | | | | | | |",
                  flush=True)


if __name__ == "__main__":
    main()
