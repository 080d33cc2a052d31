"""The multi-device checks of tests/test_sharding.py, run in a subprocess with 8 CPU
devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``, set before jax is
imported): ``python tests/sharding_checks.py CHECK...`` runs the named checks (the
``check_*`` functions) in one process and prints their results as one JSON line,
which the tests assert on. One subprocess runs several checks, since each pays for
jax's start-up.

Each check runs the same rounds twice, on one device and over a mesh of 8, and
returns the largest absolute difference of the final server states (parameters,
optimizer, mixing, aggregator states and client tables), and what the sharded
arrays look like.
"""
from __future__ import annotations

import json
import os
import sys

from fedjax_fair.core.client import ClientTraining

DEVICES = 8



def _setup():
    """The federation, model and initial parameters of every check: 16 clients of
    unequal sizes (two empty), so the federation splits 2 per device."""
    import helpers as H
    sizes = (7, 12, 0, 3, 9, 5, 4, 8) * 2
    data = H.tiny_federation(sizes, sizes)
    model = H.logreg()
    return data, model, H.init_params(model)


def _compare(alg, cohort_size: int, strategy: str, num_rounds: int = 2, chunk_size=None):
    """Max |sharded - single| over the final state of ``num_rounds`` jitted rounds
    (``simulate``), the sharded final state, and the sharded program's per-device
    argument bytes against the single-device program's."""
    import jax
    import numpy as np
    from fedjax_fair.core import sharding
    from fedjax_fair.core.execution import Execution
    from fedjax_fair.drivers.simulate import simulate

    data, model, params = _setup()
    mesh = sharding.make_mesh(DEVICES)
    key = jax.random.key(3)

    def run(execution, state, data):
        fn = jax.jit(lambda s, d: simulate(alg, s, d, key, num_rounds=num_rounds,
                                           cohort_size=cohort_size, execution=execution))
        compiled = fn.lower(state, data).compile()
        return compiled(state, data), compiled.memory_analysis().argument_size_in_bytes

    state = alg.init(params, data.num_clients)
    (single, _), single_bytes = run(Execution(strategy, chunk_size), state, data)
    layout, note = sharding.federation_shardings(mesh, data)
    assert note is None
    placed = jax.device_put(state, sharding.state_shardings(mesh, state))
    (sharded, metrics), sharded_bytes = run(Execution(strategy, chunk_size, mesh),
                                            placed, jax.device_put(data, layout))
    diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
               for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(sharded)))
    return diff, sharded, single_bytes, sharded_bytes, metrics


def _table_layout(table) -> dict:
    """How the first row leaf of a client table is laid out."""
    import jax
    from fedjax_fair.core import sharding
    leaf = jax.tree.leaves(table.rows)[0]
    s = leaf.sharding
    return {"named": isinstance(s, jax.sharding.NamedSharding),
            "spec": [str(a) for a in s.spec] if hasattr(s, "spec") else None,
            "shards": len(leaf.addressable_shards),
            "shard_rows": sorted({sh.data.shape[0] for sh in leaf.addressable_shards}),
            "rows": leaf.shape[0], "axis": sharding.CLIENTS}


def check_fedavg():
    """FedAvg, cohort 5 (padded to 8: three copies dropped), sequential per device."""
    from fedjax_fair.algorithms.fedavg import fedavg
    _, model, _ = _setup()
    diff, _, single_bytes, sharded_bytes, metrics = _compare(
        fedavg(model, training=ClientTraining(batch_size=4)), 5, "sequential")
    return {"diff": diff, "single_bytes": single_bytes, "sharded_bytes": sharded_bytes,
            "weights_shape": list(metrics["weights"].shape)}


def check_gather():
    """``sharding.gather_clients`` (each device receives its share of the cohort's
    rows) against a plain gather: float, int and bool leaves, cohorts that do and do
    not divide the devices, repeated ids."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from fedjax_fair.core import sharding
    mesh = sharding.make_mesh(DEVICES)
    rng = np.random.default_rng(0)
    tree = {"x": rng.normal(size=(64, 3, 2)).astype(np.float32),
            "y": rng.integers(0, 9, size=(64, 3)).astype(np.int32),
            "m": rng.random(size=(64, 3)) < 0.5}
    placed = jax.device_put(tree, sharding.by_client(mesh))
    out = {}
    for k in (260, 3):  # 260: padded to 264, 33 slots a device in 17 steps of 2 (the
        # last overlapping the one before); 3: fewer clients than devices
        ids = jnp.asarray(rng.integers(0, 64, size=k), jnp.int32)
        got = jax.jit(lambda t, i: sharding.gather_clients(t, i, mesh))(placed, ids)
        want = jax.tree.map(lambda v: v[np.asarray(ids)], tree)
        out[str(k)] = all(np.array_equal(np.asarray(got[n]), want[n]) for n in tree)
    return out


def check_qffl():
    """q-FFL (a fair mixing rule and aggregator), cohort 8, vmap per device."""
    from fedjax_fair.algorithms.qffl import qffl
    _, model, _ = _setup()
    return {"diff": _compare(qffl(model, q=1.0, training=ClientTraining(batch_size=4)), 8,
                             "vmap")[0]}


def check_scaffold():
    """SCAFFOLD (per-client control variates), cohort 11 (padded to 16), chunked."""
    from fedjax_fair.algorithms.scaffold import scaffold
    _, model, _ = _setup()
    diff, state, single_bytes, sharded_bytes, _ = _compare(
        scaffold(model, training=ClientTraining(batch_size=4)), 11, "chunked", chunk_size=1)
    return {"diff": diff, "table": _table_layout(state.client_states),
            "single_bytes": single_bytes, "sharded_bytes": sharded_bytes}


def check_dqn_fed():
    """DQN-Fed (quasi-Newton directions combined by a Gram system), cohort 6."""
    from fedjax_fair.algorithms.dqn_fed import dqn_fed
    _, model, _ = _setup()
    return {"diff": _compare(dqn_fed(model, mode="grad_at_global",
                                     training=ClientTraining(batch_size=4)), 6,
                             "vmap")[0]}


def check_afedpd():
    """A-FedPD (per-client dual table with a drift of every inactive row), cohort 8."""
    from fedjax_fair.algorithms.afedpd import afedpd
    _, model, _ = _setup()
    diff, state, _, _, _ = _compare(afedpd(model, training=ClientTraining(batch_size=4)), 8,
                                    "sequential",
                                    num_rounds=3)
    return {"diff": diff, "table": _table_layout(state.client_states)}


def _runner_cases(cases, placement: str = "auto"):
    """``runner.run`` over the mesh (SCAFFOLD, cohort 5: padded, two chunks) against
    one device, for each federation of ``cases``: the differences of evaluations and
    final states, the table's layout, the plan and the log."""
    import jax
    import numpy as np
    from fedjax_fair.drivers import runner
    from fedjax_fair.core import sharding
    from fedjax_fair.algorithms.scaffold import scaffold
    from fedjax_fair.core.execution import Execution

    out = {}
    mesh = sharding.make_mesh(DEVICES)
    for name, (data, model, params) in cases.items():
        alg = scaffold(model, training=ClientTraining(batch_size=4))
        runs, logs = [], []
        for ex in (Execution("sequential"), Execution("sequential", mesh=mesh)):
            lines: list = []
            runs.append(runner.run(alg, params, data, jax.random.key(0), model=model,
                                   num_rounds=4, cohort_size=5, eval_every=2,
                                   progress=False, execution=ex, log=lines.append,
                                   placement=placement))
            logs.append(lines)
        single, sharded = runs
        out[name] = {
            "state_diff": max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                              for a, b in zip(jax.tree.leaves(single.state),
                                              jax.tree.leaves(sharded.state))),
            "accuracy_diff": float(np.max(np.abs(single.client_metrics["accuracy"]
                                                 - sharded.client_metrics["accuracy"]))),
            "rounds": [h["round"] for h in sharded.history],
            "table": _table_layout(sharded.state.client_states),
            "plan_devices": sharded.memory.devices,
            "log": logs[1],
            "notes": sum(line.startswith("sharding:") for line in logs[1]),
        }
    return out


def check_runner():
    """The runner over 16 clients (split 2 per device); and the layout of a
    federation of 6 clients, which 8 devices cannot split: replicated, with a note."""
    import helpers as H
    from fedjax_fair.core import sharding
    out = _runner_cases({"even": _setup()})
    layout, note = sharding.federation_shardings(sharding.make_mesh(DEVICES),
                                                 H.tiny_federation())
    out["uneven_layout"] = {"note": note is not None,
                            "replicated": all(s.is_fully_replicated
                                              for s in jax_leaves(layout))}
    return out


def check_runner_uneven():
    """The runner over 6 clients (replicated federation and table, cohorts split);
    and over 16 clients kept on the host, cohorts streamed in (a cohort of 5 does not
    split over 8 devices: replicated, then padded inside the round)."""
    import helpers as H
    out = _runner_cases({"uneven": (H.tiny_federation(), H.logreg(),
                                    H.init_params(H.logreg()))})
    out.update(_runner_cases({"streamed": _setup()}, placement="host"))
    return out


def check_runner_auto():
    """``runner.run`` with ``auto`` and no mesh, in a process with several CPU devices:
    the cohort and federation go over every device (execution.auto_mesh), with the
    results of one device's ``sequential`` run."""
    import jax
    import numpy as np
    from fedjax_fair.drivers import runner
    from fedjax_fair.algorithms.fedavg import fedavg
    from fedjax_fair.core.execution import Execution
    data, model, params = _setup()
    runs = [runner.run(fedavg(model, training=ClientTraining(batch_size=4)), params, data,
                       jax.random.key(0),
                       model=model, num_rounds=3, cohort_size=8, eval_every=3,
                       progress=False, execution=ex)
            for ex in (Execution("sequential"), Execution("auto"))]
    # 14 clients: the most of 8 devices that split them evenly is 7 (cohort 8);
    # 13 clients split over none: one device, no copy of the federation on each
    odd = {n: runner.run(fedavg(model, training=ClientTraining(batch_size=4)), params,
                         _first(data, n),
                         jax.random.key(0), model=model, num_rounds=2, cohort_size=8,
                         eval_every=2, progress=False, execution=Execution("auto"))
           for n in (14, 13)}
    return {"state_diff": max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                              for a, b in zip(*(jax.tree.leaves(r.state) for r in runs))),
            "accuracy_diff": float(np.max(np.abs(runs[0].client_metrics["accuracy"]
                                                 - runs[1].client_metrics["accuracy"]))),
            "plan_devices": [r.memory.devices for r in runs],
            "odd_devices": {str(n): r.memory.devices for n, r in odd.items()}}


def _first(data, n: int):
    """The federation of ``data``'s first ``n`` clients."""
    import jax
    return jax.tree.map(lambda v: v[:n], data)


def check_fresh_buffers():
    """``sharding.put`` of one array placed twice, replicated: every result in its own
    buffers; and ``runner.run`` of DQN-Fed (whose state holds theta^0 twice) over the
    mesh, its state donated to every chunk program, against one device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from fedjax_fair.drivers import runner
    from fedjax_fair.core import sharding
    from fedjax_fair.algorithms.dqn_fed import dqn_fed
    from fedjax_fair.core.execution import Execution
    mesh = sharding.make_mesh(DEVICES)
    a = jnp.arange(3.0)
    put = sharding.put({"x": a, "y": a}, sharding.replicated(mesh))
    owned = [sharding.buffers(v) for v in (a, put["x"], put["y"])]
    from fedjax_fair.algorithms.fedlf import fedlf
    data, model, params = _setup()
    out = {"disjoint": all(not (owned[i] & owned[j]) for i in range(3) for j in range(i)),
           "buffers": [len(b) for b in owned]}
    # FedLF keeps a per-client gradient table in its aggregator state: its layout must
    # survive from one chunk program to the next (eval_every 1: a program per round)
    for name, alg in (("dqn_fed", dqn_fed(model, training=ClientTraining(batch_size=4))),
                      ("fedlf", fedlf(model, training=ClientTraining(batch_size=4)))):
        runs = [runner.run(alg, params, data, jax.random.key(0), model=model,
                           num_rounds=2, cohort_size=8, eval_every=1, progress=False,
                           execution=ex)
                for ex in (Execution("sequential"), Execution("sequential", mesh=mesh))]
        out[name] = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                        for a, b in zip(*(jax.tree.leaves(r.state) for r in runs)))
    return out


def check_server_solvers():
    """The server's iterative solvers under ``sharding.on_mesh`` (how the engine traces
    a server step), fed a Gram matrix computed from updates split by client: no
    cross-device exchange inside their loops (FedLF's layer QPs took 320 ms a round
    over two devices, an exchange per iteration, against 4 ms on one), and the
    one-device answers."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from fedjax_fair.core import sharding
    from fedjax_fair.algorithms.fedlf import fedlf_direction
    from fedjax_fair.solvers import online, qp
    mesh = sharding.make_mesh(DEVICES)
    k = 2 * DEVICES
    grads = {"w": jax.random.normal(jax.random.key(0), (k, 12, 3)),
             "b": jax.random.normal(jax.random.key(1), (k, 3))}
    losses = jnp.linspace(0.5, 2.0, k)
    active = jnp.arange(k) % 5 != 0
    flat = lambda g: jnp.concatenate([v.reshape(k, -1) for v in jax.tree.leaves(g)], 1)
    solvers = {
        "fedlf": lambda g, l, a: fedlf_direction(g, l, a)[0],
        "qp": lambda g, l, a: qp.solve_box_simplex_qp(
            flat(g) @ flat(g).T, l, jnp.zeros(k), a.astype(jnp.float32)),
        "online": lambda g, l, a: online.simplex_qp(flat(g) @ flat(g).T, l)}
    split = jax.device_put((grads, losses, active), sharding.by_client(mesh))
    out = {}
    for name, fn in solvers.items():
        def on(g, l, a, fn=fn):
            with sharding.on_mesh(mesh):
                return fn(g, l, a)
        compiled = jax.jit(on).lower(*split).compile()
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(jax.tree.leaves(compiled(*split)),
                                   jax.tree.leaves(jax.jit(fn)(grads, losses, active))))
        out[name] = {"loop_exchanges": sum(sharding.loop_collectives(compiled).values()),
                     "diff": diff}
    # without on_mesh the same program exchanges inside the loop: the check can fail
    out["unpinned"] = sum(sharding.loop_collectives(
        jax.jit(solvers["qp"]).lower(*split).compile()).values())
    return out


def jax_leaves(tree):
    import jax
    return jax.tree.leaves(tree)


def check_cli():
    """``fedjax-fair run`` with the default ``--devices auto`` against ``--devices 1``:
    the job's rounds are too small for a mesh, so auto stays on one device; with
    ``SPLIT_MIN_ROUND_FLOPS`` lowered to 0 it takes a mesh of 4 of the 8 devices, with
    the same final summary; an auto run resumed; the mesh ``auto`` and an explicit
    count pick by step and round size."""
    import tempfile
    from fedjax_fair import cli
    from fedjax_fair.core import execution
    args = ["--num-clients", "16", "--dataset-arg", "max_examples=60", "--cohort-size",
            "5", "--num-rounds", "2", "--eval-every", "1", "--no-progress", "--no-plots"]
    out = {}
    floor = execution.SPLIT_MIN_ROUND_FLOPS
    with tempfile.TemporaryDirectory() as tmp:
        for devices in ("1", "small", "auto"):  # auto: 4 of the 8 devices
            execution.SPLIT_MIN_ROUND_FLOPS = floor if devices == "small" else 0.0
            d = os.path.join(tmp, devices)
            code = cli.main(["run", *args, "--devices", devices.replace("small", "auto"),
                             "-o", d])
            with open(os.path.join(d, "summary.json")) as f:
                summary = json.load(f)
            with open(os.path.join(d, "config.json")) as f:
                saved = json.load(f)
            out[devices] = {"code": code, "final": summary["final"],
                            "saved_devices": saved["devices"],
                            "used_devices": summary["devices"]}
        # auto, stopped after a round and resumed: the uninterrupted auto run's clients
        d = os.path.join(tmp, "resumed")
        cli.main(["run", *args[:-6], "--num-rounds", "1", "--eval-every", "1",
                  "--no-progress", "--no-plots", "-o", d])
        code = cli.main(["run", "-o", d, "--resume", "--num-rounds", "2", "--no-progress"])
        with open(os.path.join(d, "clients.csv")) as a, \
                open(os.path.join(tmp, "auto", "clients.csv")) as b:
            out["resumed"] = {"code": code, "same_clients": a.read() == b.read()}
    execution.SPLIT_MIN_ROUND_FLOPS = floor
    # auto keeps one device for local steps big enough to busy its cores (a CNN's)
    # and for rounds too small to pay for the mesh
    from fedjax_fair.cli import config as C
    big, small = execution.SPLIT_MAX_STEP_FLOPS, execution.SPLIT_MIN_ROUND_FLOPS
    out["mesh_by_step"] = [None if m is None else int(m.devices.size)
                           for m in (C.mesh_of("auto", 5, 16, big / 100, small),
                                     C.mesh_of("auto", 5, 16, big, small),
                                     C.mesh_of("auto", 5, 16, big / 100, small / 2),
                                     C.mesh_of(8, 5, 16, big, small / 2))]
    return out


def main(names) -> None:
    import time
    results = {}
    for name in names:
        t = time.perf_counter()
        results[name] = globals()[f"check_{name}"]()
        print(f"check_{name}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
