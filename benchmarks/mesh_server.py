"""A round of every server rule over a CPU mesh: one device against D devices, with the
server's solvers run on every device (the engine's ``sharding.on_mesh``) and left to
XLA's partitioner.

Run:   python benchmarks/mesh_server.py                  (the README's compare job)
       python benchmarks/mesh_server.py --dataset femnist_like --model mlp --cohort 50
       python benchmarks/mesh_server.py --methods fedavg,fedlf --rounds 20 --reps 5

Setup: the registered method with its defaults and ``--batch`` on the built-in
``--dataset`` / ``--model``; ``--rounds`` rounds of ``simulate`` compiled as one
program, every contender alternating within each repetition (``timing``'s minimum
over ``--reps``). Contenders: ``one device`` (``Execution("sequential")``), ``D
devices`` (``Execution("sequential", mesh=make_mesh(D))``, the federation split by
client, the server state replicated, what ``--devices`` gives) and ``D devices,
unpinned`` (the same with ``sharding.on_mesh`` disabled, so the server's solvers
take whatever layout the partitioner propagates; the engine before the fix).
``loop exch.`` counts the collectives inside the compiled program's while-loop bodies
other than the round loop's own (the local-training loops and the server's solver
loops), from ``Compiled.as_text()``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import time
from fedjax_fair.core.client import ClientTraining


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--dataset", default="synthetic")
    p.add_argument("--model", default="logreg")
    p.add_argument("--cohort", type=int, default=10)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--methods", default="fedavg,qffl,afl,term,fedmgda_plus,fedlf,"
                                        "aaggff_d,dqn_fed,scaffold,afedpd")
    return p.parse_args()


ARGS = _args()
if "jax" not in sys.modules:  # make CPU devices before jax starts
    flag = f"--xla_force_host_platform_device_count={ARGS.devices}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

import jax  # noqa: E402

from fedjax_fair.core import algorithm, sharding  # noqa: E402
from fedjax_fair.algorithms import get_method  # noqa: E402
from fedjax_fair.data import get_dataset  # noqa: E402
from fedjax_fair.core.execution import Execution  # noqa: E402
from fedjax_fair.models import get_model  # noqa: E402
from fedjax_fair.drivers.simulate import simulate  # noqa: E402

def loop_exchanges(compiled) -> int:
    """Collectives inside loops, the round scan's own left out: it holds the most and
    runs once a round."""
    counts = sharding.loop_collectives(compiled).values()
    return sum(counts) - max(counts, default=0)


def program(alg, state, data, execution, pinned: bool):
    key = jax.random.key(0)
    saved = algorithm.on_mesh
    if not pinned:
        algorithm.on_mesh = lambda mesh: contextlib.nullcontext()
    try:
        fn = jax.jit(lambda s, d: simulate(alg, s, d, key, num_rounds=ARGS.rounds,
                                           cohort_size=ARGS.cohort, execution=execution))
        compiled = fn.lower(state, data).compile()
    finally:
        algorithm.on_mesh = saved
    return compiled


def main():
    ds = get_dataset(ARGS.dataset)
    model = get_model(ARGS.model, ds.input_shape, ds.num_classes)
    params = model.init(jax.random.key(0))
    mesh = sharding.make_mesh(ARGS.devices)
    num_clients = ds.data.train.mask.shape[0]
    layout, _ = sharding.federation_shardings(mesh, ds.data)
    split_data = sharding.put(ds.data, layout)
    d = ARGS.devices
    print(f"{ARGS.dataset} ({num_clients} clients), {ARGS.model}, cohort {ARGS.cohort}, "
          f"batch {ARGS.batch}, {ARGS.rounds} rounds a program; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, jax {jax.__version__}, load {os.getloadavg()[0]:.1f}")
    print(f"\n| method | one device ms/round | {d} devices | {d} devices, unpinned | "
          f"{d} dev / one | unpinned / one | loop exch. | unpinned loop exch. |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ARGS.methods.split(","):
        method = get_method(name)
        alg = method.factory(model, training=ClientTraining(batch_size=ARGS.batch))
        state = alg.init(params, num_clients)
        split_state = sharding.put(state, sharding.state_shardings(mesh, state))
        runs = {"one": (program(alg, state, ds.data, Execution("sequential"), True),
                        state, ds.data),
                "mesh": (program(alg, split_state, split_data,
                                 Execution("sequential", mesh=mesh), True),
                         split_state, split_data),
                "unpinned": (program(alg, split_state, split_data,
                                     Execution("sequential", mesh=mesh), False),
                             split_state, split_data)}
        best = {k: float("inf") for k in runs}
        for c, s, x in runs.values():  # warm-up
            jax.block_until_ready(c(s, x))
        for rep in range(ARGS.reps):
            for k, (c, s, x) in runs.items():
                t = time.perf_counter()
                jax.block_until_ready(c(s, x))
                best[k] = min(best[k], (time.perf_counter() - t) / ARGS.rounds)
        ms = {k: 1e3 * v for k, v in best.items()}
        print(f"| {name} | {ms['one']:.2f} | {ms['mesh']:.2f} | {ms['unpinned']:.2f} | "
              f"{ms['mesh'] / ms['one']:.2f} | {ms['unpinned'] / ms['one']:.2f} | "
              f"{loop_exchanges(runs['mesh'][0])} | {loop_exchanges(runs['unpinned'][0])} |",
              flush=True)


if __name__ == "__main__":
    main()
