"""Primal-dual family (issue 11): A-FedPD's dual table live, bf16 storage, round time per method.

Run:   python benchmarks/primal_dual.py live               (N = 200, ~1M-parameter MLP, 20 rounds)
       python benchmarks/primal_dual.py live --full        (N = 1000: the issue's acceptance run)
       python benchmarks/primal_dual.py donation [--full]  (chunk program, state donated or not)
       python benchmarks/primal_dual.py bf16               (digits, 50 clients, 200 rounds)
       python benchmarks/primal_dual.py methods            (MLP and LeNet round time per method)
       python benchmarks/primal_dual.py all [--full]

The static memory bill (shapes only) is ``benchmarks/table_memory.py``.

``live``: A-FedPD (rho 0.1, lr 0.05, wd 1e-3, batch 20, one epoch) on FEMNIST-shaped
synthetic clients (``femnist_like``: 50-200 examples of 28x28x1, 62 classes) with an
MLP 784-1024-256-62 (1,082,174 parameters), cohort 10, through ``runner.run`` (two
chunks, evaluation of every client after each). Each table form runs in its own
subprocess (with a checkpoint directory, so the runner donates the state to each
chunk program, as the CLI does), which reports its peak resident memory (``VmHWM`` of /proc/self/status),
its resident memory once the data are built, the runner's seconds per round (run
time only: no compile, no evaluation) and ``RunResult.client_table``; FedAvg on the
same setup is the no-table baseline. The final parameters (theta and theta-bar) of
every A-FedPD table are compared with the dense run's, and with the float32
sensitivity floor: the dense run started from theta^0 one ulp off (x (1 + 2^-23)).

``donation``: the live setup's chunk program (``simulate`` of 5 rounds, jitted as
``runner.run`` jits it without a checkpoint) against the same program with the
server state donated (``donate_argnums``): seconds per round (the two alternate, best
of 3) and XLA's memory analysis (arguments, outputs, temporaries, aliased). Then the
scatter of 10 rows into 200 stored rows of 784 x 1024 with float32, bfloat16 and
uint16-held bfloat16 storage (XLA:CPU widens a bfloat16 scatter to float32 over the
whole operand).

``bf16``: A-FedPD (rho 0.1, lr 0.1 x 0.998^t, wd 1e-3, batch 10, 5 epochs) on the
digits federation (50 clients, Dirichlet 0.5), MLP 64-200-200-10, cohort 5, for
``--bf16-rounds`` rounds and each of ``--seeds``. Closed loop: the same run (same
keys) with the dual table in fp32 dense, fp32 dense from theta^0 one ulp off (the
float32 sensitivity floor), fp32 lazy, bf16 dense and bf16 lazy (rows stored as
bfloat16, gathered as float32); at rounds 1, 10, 20, 50, 100 and the last, the
relative difference of theta-bar, theta and the gathered duals to the fp32 dense run
and the test accuracy of theta-bar (mean over clients). Open loop: the fp32 dense
run's drifts and cohort writes replayed into fp32 lazy, bf16 dense and bf16 lazy
tables, i.e. the storage error alone, without its feedback on training.

``methods``: one jitted round (``apply``, the server state donated, so tables are
updated in place) of every method on one fixed cohort of 10 of N = 100 clients, with
equal local work: K local steps of batch B from the same data, wd 1e-3, the spec's
hyper-parameters (FedCM alpha 0.1; FedSAM r 0.05; FedDyn / FedSpeed / A-FedPD /
FedADMM rho 0.1; FedSpeed / A-FedPDSAM r 0.1). The methods alternate within each
trial (the starting method rotates) and each reports its fastest of ``--trials``
rounds, so load on the shared machine hits all alike; the table gives seconds and
the ratio to FedAvg, and XLA's cost analysis of each compiled round (FLOPs, bytes
accessed; it counts a loop body once, i.e. one local step plus the server) as a
noise-free check of the extra work. Cases: ``mlp`` (784-200-200-62 on femnist_like
clients of 500 examples, B 50, 5 epochs: K = 50 as in the paper's Table 2) and
``lenet`` (``lenet_fedpd`` on CIFAR-shaped Gaussian inputs, 250 examples per client,
B 50, one epoch: K = 5).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import alternate_rounds, compile_rounds  # noqa: E402
from fedjax_fair.core.client import ClientTraining

COHORT = 10


# ------------------------------------------------------------------------- helpers


def proc_status() -> dict:
    """VmRSS and VmHWM (peak) of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def header(what: str) -> str:
    return (f"# {what} | {platform.machine()} | {os.cpu_count()} cores | jax {jax.__version__} "
            f"| {jax.devices()[0]} | load {loadavg()}")


def gib(b) -> str:
    return f"{b / 2**30:.2f}"


def flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def rel_diffs(a, ref) -> tuple[float, float]:
    """(max |a - ref| / max |ref|, ||a - ref|| / ||ref||) over all leaves."""
    a, ref = flat(a), flat(ref)
    return (float(np.max(np.abs(a - ref)) / np.max(np.abs(ref))),
            float(np.linalg.norm(a - ref) / np.linalg.norm(ref)))


# ----------------------------------------------------------------------------- live


def live_worker(table: str, num_clients: int, rounds: int, hidden, out: str) -> dict:
    from fedjax_fair.drivers import runner
    from fedjax_fair.algorithms import afedpd, fedavg
    from fedjax_fair.data import femnist_like
    from fedjax_fair.models import get_model

    ds = femnist_like(num_clients=num_clients, seed=0)
    model = get_model("mlp", ds.input_shape, ds.num_classes, hidden=tuple(hidden))
    params = jax.jit(model.init)(jax.random.key(0))
    d = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    rss_data = proc_status()["VmRSS"]
    common = dict(training=ClientTraining(lr=0.05, batch_size=20, num_epochs=1, weight_decay=1e-3))
    if table == "dense+ulp":  # the float32 sensitivity floor: theta^0 one ulp off
        params = jax.tree.map(lambda x: x * (1 + 2.0 ** -23), params)
    alg = (fedavg(model, weight_by_size=False, **common) if table == "fedavg"
           else afedpd(model, rho=0.1, client_table=table.split("+")[0], **common))
    plan = []
    # With a checkpoint directory the runner donates the state to each chunk program
    # (tables updated in place; the last good state lives in the checkpoint), as the
    # CLI does by default.
    res = runner.run(alg, params, ds.host_data, jax.random.key(1), model=model,
                     num_rounds=rounds, cohort_size=COHORT, eval_every=max(1, rounds // 2),
                     progress=False, log=plan.append, checkpoint_dir=out + "_ckpt")
    st = proc_status()
    state = res.state
    avg = state.aggregator_state.average if table != "fedavg" else state.params
    np.savez(out, *[np.asarray(x) for x in jax.tree.leaves(state.params)],
             *[np.asarray(x) for x in jax.tree.leaves(avg)])
    return {"table": table, "params": d, "num_clients": num_clients, "rounds": rounds,
            "peak_rss": st["VmHWM"], "rss_after_data": rss_data,
            "s_per_round": res.run_seconds / rounds, "compile_s": res.compile_seconds,
            "accuracy": res.history[-1]["accuracy_mean"], "client_table": res.client_table,
            "plan": plan[0] if plan else "", "placement": res.memory.placement}


def live(args):
    n = 1000 if args.full else args.clients
    tables = ["fedavg", "dense", "dense+ulp", "lazy", f"lazy:{COHORT * args.rounds}",
              "dense:bf16", f"lazy:{COHORT * args.rounds}:bf16"]
    print(header(f"live A-FedPD | N {n} | cohort {COHORT} | {args.rounds} rounds | "
                 f"mlp 784-{'-'.join(map(str, args.hidden))}-62"), flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for table in tables:
            out = os.path.join(tmp, table.replace(":", "_") + ".npz")
            cmd = [sys.executable, __file__, "_live_worker", table, str(n), str(args.rounds),
                   out, *map(str, args.hidden)]
            t = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode:
                print(f"| {table} | failed: {p.stderr.strip().splitlines()[-1:]} |", flush=True)
                continue
            r = json.loads(p.stdout.strip().splitlines()[-1])
            r["wall_s"] = time.perf_counter() - t
            r["load"] = loadavg()
            with np.load(out) as z:
                leaves = [z[k] for k in sorted(z.files, key=lambda s: int(s.split("_")[1]))]
            half = len(leaves) // 2
            r["theta"], r["theta_bar"] = leaves[:half], leaves[half:]
            results.append(r)
            print(f"  {table}: peak {gib(r['peak_rss'])} GiB, {r['s_per_round']:.3f} s/round, "
                  f"load {r['load']}; plan: {r['plan']}", flush=True)
    ref = next((r for r in results if r["table"] == "dense"), None)
    base = next((r for r in results if r["table"] == "fedavg"), None)
    print(f"\nparameters d = {results[0]['params']:,}; rows of the table: {n} x "
          f"{4 * results[0]['params'] / 2**20:.1f} MiB fp32")
    print("| run | table bytes (RunResult.client_table) | rows stored | peak RSS GiB | "
          "peak - FedAvg's GiB | s/round | x FedAvg | compile s | max rel. diff of theta / "
          "theta-bar to dense | final accuracy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ct = r["client_table"] or {}
        tb = f"{gib(ct['bytes'])} GiB" if ct else "-"
        stored = f"{ct.get('rows_stored', '-')}" if ct else "-"
        over = gib(r["peak_rss"] - base["peak_rss"]) if base else "-"
        ratio = f"{r['s_per_round'] / base['s_per_round']:.2f}" if base else "-"
        if ref is not None and r["table"] != "fedavg":
            dt = rel_diffs(r["theta"], ref["theta"])[0]
            db = rel_diffs(r["theta_bar"], ref["theta_bar"])[0]
            diff = f"{dt:.1e} / {db:.1e}"
        else:
            diff = "-"
        name = {"fedavg": "FedAvg (no table)",
                "dense+ulp": "A-FedPD dense, theta^0 + 1 ulp"}.get(r["table"],
                                                                   f"A-FedPD {r['table']}")
        print(f"| {name} | {tb} | {stored} | {gib(r['peak_rss'])} | {over} | "
              f"{r['s_per_round']:.3f} | {ratio} | {r['compile_s']:.1f} | {diff} | "
              f"{r['accuracy']:.3f} |")

    def gap(r):  # max rel. difference of theta and theta-bar to the dense run
        return max(rel_diffs(r["theta"], ref["theta"])[0],
                   rel_diffs(r["theta_bar"], ref["theta_bar"])[0])

    floor = next((r for r in results if r["table"] == "dense+ulp"), None)
    for r in results if ref is not None else []:
        if r["table"] in ("lazy", f"lazy:{COHORT * args.rounds}"):
            ok = all(np.allclose(a, b, rtol=1e-4, atol=1e-5)
                     for a, b in zip(r["theta"] + r["theta_bar"], ref["theta"] + ref["theta_bar"]))
            line = (f"{r['table']} vs dense: allclose (rtol 1e-4, atol 1e-5) {ok}, "
                    f"max rel. diff {gap(r):.1e}")
            if floor is not None:
                line += (f"; dense with theta^0 one ulp off differs by {gap(floor):.1e}: "
                         f"lazy within that floor: {gap(r) <= gap(floor)}")
            print(line)
    built = ", ".join(f"{r['table']} {gib(r['rss_after_data'])}" for r in results)
    walls = ", ".join(f"{r['table']} {r['wall_s']:.0f}" for r in results)
    print(f"RSS once the data were built (before the run), GiB: {built}")
    print(f"wall seconds per subprocess: {walls}")


# ------------------------------------------------------------------------- donation


def donation(args):
    """The live setup's chunk program (``simulate`` of 5 rounds, as ``runner.run``
    compiles it) jitted with and without donating the server state."""
    from fedjax_fair.algorithms import afedpd, fedavg
    from fedjax_fair.data import femnist_like
    from fedjax_fair.models import get_model
    from fedjax_fair.drivers.simulate import simulate

    n = 1000 if args.full else args.clients
    rounds, reps, cap = 5, 3, COHORT * args.rounds  # (1 + reps) x rounds x cohort <= cap
    ds = femnist_like(num_clients=n, seed=0)
    data = ds.data
    model = get_model("mlp", ds.input_shape, ds.num_classes, hidden=tuple(args.hidden))
    params = jax.jit(model.init)(jax.random.key(0))
    key = jax.random.key(1)
    common = dict(training=ClientTraining(lr=0.05, batch_size=20, num_epochs=1, weight_decay=1e-3))
    print(header(f"chunk program, donated or not | N {n} | cohort {COHORT} | "
                 f"{rounds} rounds per call, best of {reps} | "
                 f"mlp 784-{'-'.join(map(str, args.hidden))}-62"), flush=True)
    rows, base = [], None
    for table in ["fedavg", "dense", "lazy", f"lazy:{cap}", "dense:bf16", f"lazy:{cap}:bf16"]:
        alg = (fedavg(model, weight_by_size=False, **common) if table == "fedavg"
               else afedpd(model, rho=0.1, client_table=table, **common))
        fns, states, best = {}, {}, {}
        for donate in (False, True):
            states[donate] = jax.tree.map(jnp.copy, alg.init(params, n))  # distinct buffers
            fns[donate] = jax.jit(
                lambda s, d, k, alg=alg: simulate(alg, s, d, k, num_rounds=rounds,
                                                  cohort_size=COHORT)[0],
                donate_argnums=(0,) if donate else ()).lower(states[donate], data, key).compile()
            states[donate] = jax.block_until_ready(fns[donate](states[donate], data, key))
            best[donate] = float("inf")
        for _ in range(reps):  # the two programs alternate
            for donate in (False, True):
                t = time.perf_counter()
                states[donate] = jax.block_until_ready(fns[donate](states[donate], data, key))
                best[donate] = min(best[donate], (time.perf_counter() - t) / rounds)
        del states
        if table == "fedavg":  # nothing to donate but the model: one baseline
            base = min(best.values())
        for donate in (False, True):
            m = fns[donate].memory_analysis()
            rows.append((table, donate, best[donate], m, loadavg()))
    print("| run | state donated | s/round | x FedAvg | XLA arguments GiB | outputs GiB | "
          "temporaries GiB | aliased GiB | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for table, donate, t, m, load in rows:
        name = "FedAvg (no table)" if table == "fedavg" else f"A-FedPD {table}"
        print(f"| {name} | {'yes' if donate else 'no'} | {t:.3f} | {t / base:.2f} | "
              f"{gib(m.argument_size_in_bytes)} | {gib(m.output_size_in_bytes)} | "
              f"{gib(m.temp_size_in_bytes)} | {gib(m.alias_size_in_bytes)} | {load} |")
    scatter_storage(reps=5)


def scatter_storage(reps: int, slots: int = 200, rows: int = 10, shape=(784, 1024)):
    """Writing ``rows`` float32 rows into ``slots`` stored rows (donated, in place) when
    the storage is float32, bfloat16, or bfloat16 bits held as uint16."""
    ids = jnp.arange(rows) * 3
    new = jnp.ones((rows, *shape), jnp.float32)
    as_bits = lambda r: jax.lax.bitcast_convert_type(r.astype(jnp.bfloat16), jnp.uint16)
    cases = {"f32": (jnp.float32, lambda r: r), "bf16": (jnp.bfloat16,
                                                         lambda r: r.astype(jnp.bfloat16)),
             "bf16 bits as uint16": (jnp.uint16, as_bits)}
    print(f"\nscatter of {rows} rows into {slots} x {shape} stored rows, donated, best of {reps}")
    print("| storage | ms | XLA temporaries MiB |")
    print("|---|---|---|")
    for name, (dtype, cast) in cases.items():
        table = jnp.zeros((slots, *shape), dtype)
        fn = jax.jit(lambda t, r, cast=cast: t.at[ids].set(cast(r), mode="drop"),
                     donate_argnums=0).lower(table, new).compile()
        table = jax.block_until_ready(fn(table, new))
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            table = jax.block_until_ready(fn(table, new))
            best = min(best, time.perf_counter() - t)
        print(f"| {name} | {1e3 * best:.1f} | "
              f"{fn.memory_analysis().temp_size_in_bytes / 2**20:.0f} |")


# ----------------------------------------------------------------------------- bf16


def bf16(args):
    from fedjax_fair.core import client_states
    from fedjax_fair.algorithms import afedpd
    from fedjax_fair.data import digits
    from fedjax_fair.core.evaluation import make_state_evaluator, to_numpy
    from fedjax_fair.models import get_model
    from fedjax_fair.drivers.runner import split_summary
    from fedjax_fair.drivers.simulate import simulate

    rho, cohort, rounds = 0.1, 5, args.bf16_rounds
    ds = digits(num_clients=50)
    data = ds.data
    n = data.train.mask.shape[0]
    ids = jnp.arange(n, dtype=jnp.int32)
    model = get_model("mlp", ds.input_shape, ds.num_classes)
    params = jax.jit(model.init)(jax.random.key(0))
    ulp = jax.tree.map(lambda x: x * (1 + 2.0 ** -23), params)  # 1 ulp off theta^0
    runs = {"dense": ("dense", params), "dense, theta^0 + 1 ulp": ("dense", ulp),
            "lazy": ("lazy", params), "dense:bf16": ("dense:bf16", params),
            "lazy:bf16": ("lazy:bf16", params)}
    replayed = ["lazy", "dense:bf16", "lazy:bf16"]
    marks = sorted({1, 10, 20, 50, 100, rounds} & set(range(1, rounds + 1)))
    print(header(f"bf16 duals | digits, {n} clients, cohort {cohort} | A-FedPD rho {rho}, "
                 f"lr 0.1 x 0.998^t, wd 1e-3, B 10, 5 epochs | mlp 64-200-200-10 | "
                 f"{rounds} rounds | seeds {args.seeds}"), flush=True)
    closed, replay, final = [], [], []
    t0 = time.perf_counter()
    for seed in args.seeds:
        key = jax.random.key(seed)
        algs = {name: afedpd(model, rho=rho,
                             training=ClientTraining(lr=lambda r: 0.1 * 0.998 ** r, batch_size=10,
                                                     num_epochs=5, weight_decay=1e-3), client_table=t)
                for name, (t, _) in runs.items()}
        states = {name: algs[name].init(p, n) for name, (_, p) in runs.items()}
        step = {name: jax.jit(lambda s, a=a: simulate(a, s, data, key, num_rounds=1,
                                                      cohort_size=cohort))
                for name, a in algs.items()}
        evaluate = {name: jax.jit(lambda s, a=a: make_state_evaluator(
            model, None, a.evaluated_params)(s, data.test, ids)) for name, a in algs.items()}
        # open loop: the fp32 dense run's writes and drifts replayed into other tables
        tabs = {t: client_states.get_table(t) for t in replayed}
        rep = {t: tabs[t].init(jax.tree.map(jnp.zeros_like, params), n) for t in replayed}
        ref_table = algs["dense"].client_table
        mask = jnp.ones((cohort,), bool)

        @jax.jit
        def replay_round(rep, before, after, cids):
            drift = jax.tree.map(lambda a, p: rho * (a - p), after.aggregator_state.average,
                                 before.params)
            rows = ref_table.gather(after.client_states, cids)
            return {t: tabs[t].scatter(tabs[t].drift(rep[t], drift), cids, rows, mask,
                                       before.round) for t in replayed}

        for r in range(1, rounds + 1):
            before = states["dense"]
            for name in runs:
                states[name], metrics = step[name](states[name])
                if name == "dense":
                    cids = metrics["client_ids"][0]
            rep = replay_round(rep, before, states["dense"], cids)
            if r not in marks:
                continue
            ref = states["dense"]
            ref_duals = ref_table.gather(ref.client_states, ids)
            for name in runs:
                s = states[name]
                mb, lb = rel_diffs(s.aggregator_state.average, ref.aggregator_state.average)
                mt, _ = rel_diffs(s.params, ref.params)
                md, _ = rel_diffs(algs[name].client_table.gather(s.client_states, ids),
                                  ref_duals)
                acc = split_summary(to_numpy(evaluate[name](s)), "test")["accuracy_mean"]
                closed.append((seed, r, name, mb, lb, mt, md, acc))
                if r == rounds:
                    final.append((seed, name, acc))
            for t in replayed:
                m, l2 = rel_diffs(tabs[t].gather(rep[t], ids), ref_duals)
                replay.append((seed, r, t, m, l2))
    print("\nClosed loop: each table trains its own run (same keys); difference to the fp32 "
          "dense run.")
    print("| seed | round | run | max rel. diff theta-bar | rel. L2 diff theta-bar | "
          "max rel. diff theta | max rel. diff duals | test accuracy (theta-bar) |")
    print("|---|---|---|---|---|---|---|---|")
    for seed, r, name, mb, lb, mt, md, acc in closed:
        print(f"| {seed} | {r} | {name} | {mb:.1e} | {lb:.1e} | {mt:.1e} | {md:.1e} | "
              f"{acc:.4f} |")
    print("\nOpen loop: the fp32 dense run's drifts and writes replayed into each table; "
          "storage error of the gathered duals.")
    print("| seed | round | table | max rel. error | rel. L2 error |")
    print("|---|---|---|---|---|")
    for seed, r, t, m, l2 in replay:
        print(f"| {seed} | {r} | {t} | {m:.1e} | {l2:.1e} |")
    print(f"\nFinal test accuracy (theta-bar) after {rounds} rounds, mean over seeds "
          f"{args.seeds}:")
    for name in runs:
        accs = [a for _, nm, a in final if nm == name]
        print(f"  {name}: {np.mean(accs):.4f} (" + ", ".join(f"{a:.4f}" for a in accs) + ")")
    print(f"seconds: {time.perf_counter() - t0:.0f}")


# -------------------------------------------------------------------------- methods


def method_algorithms(model, batch_size: int, num_epochs: int, lr: float) -> dict:
    from fedjax_fair.algorithms import (afedpd, afedpd_sam, fedadmm, fedavg, fedcm, feddyn,
                                        fedsam, fedspeed, scaffold)
    c = dict(training=ClientTraining(lr=lr, batch_size=batch_size, num_epochs=num_epochs,
                                     weight_decay=1e-3))
    return {
        "FedAvg": fedavg(model, weight_by_size=False, **c),
        "FedCM": fedcm(model, alpha=0.1, **c),
        "SCAFFOLD": scaffold(model, **c),
        "FedSAM": fedsam(model, sam_radius=0.05, **c),
        "FedDyn": feddyn(model, alpha=0.1, **c),
        "FedSpeed": fedspeed(model, rho=0.1, sam_radius=0.1, **c),
        "A-FedPD (dense)": afedpd(model, rho=0.1, client_table="dense", **c),
        "A-FedPD (lazy)": afedpd(model, rho=0.1, client_table="lazy", **c),
        "A-FedPDSAM": afedpd_sam(model, rho=0.1, sam_radius=0.1, **c),
        "FedADMM": fedadmm(model, rho=0.1, **c),
    }


def methods_case(case: str, trials: int):
    from fedjax_fair.data import femnist_like, from_client_arrays
    from fedjax_fair.models import get_model
    from fedjax_fair.drivers.simulate import make_cohort

    n = 100
    if case == "mlp":
        ds = femnist_like(num_clients=n, min_examples=500, max_examples=500, seed=0)
        model = get_model("mlp", ds.input_shape, ds.num_classes)
        batch, epochs, k, lr = 50, 5, 50, 0.05
    else:
        rng = np.random.default_rng(0)
        xs = [rng.normal(size=(250, 32, 32, 3)).astype(np.float32) for _ in range(n)]
        ys = [rng.integers(0, 10, 250).astype(np.int32) for _ in range(n)]
        ds = from_client_arrays(xs, ys, [x[:10] for x in xs], [y[:10] for y in ys],
                                name="cifar_shaped", num_classes=10)
        del xs, ys
        model = get_model("lenet_fedpd", (32, 32, 3), 10)
        batch, epochs, k, lr = 50, 1, 5, 0.01
    params = jax.jit(model.init)(jax.random.key(0))
    d = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    cohort = make_cohort(ds.data, jnp.arange(COHORT, dtype=jnp.int32) * (n // COHORT))
    algs = method_algorithms(model, batch, epochs, lr)
    print(header(f"round time | {case} (d = {d:,}) | N {n} | cohort {COHORT} | K {k} | B {batch}"),
          flush=True)
    fns, states, info = compile_rounds(algs, params, n, cohort)
    names = list(algs)
    loads = [loadavg()]
    best = alternate_rounds(fns, states, cohort, trials, lambda: loads.append(loadavg()))
    finite = {name: bool(np.all([np.isfinite(x).all() for x in jax.tree.leaves(s.params)]))
              for name, s in states.items()}
    f0, b0 = info["FedAvg"]["flops"], info["FedAvg"]["bytes"]
    print(f"load average during the trials: {' -> '.join(loads[::max(1, trials // 3)])}")
    print("| method | s/round | x FedAvg | XLA flops x FedAvg | XLA bytes x FedAvg | "
          "compile s | finite |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        f, b = info[name]["flops"], info[name]["bytes"]
        print(f"| {name} | {best[name]:.4f} | {best[name] / best['FedAvg']:.2f} | "
              f"{f / f0:.2f} | {b / b0:.2f} | {info[name]['compile_s']:.1f} | {finite[name]} |",
              flush=True)


def methods(args):
    for case in args.cases:
        methods_case(case, args.trials)


# ----------------------------------------------------------------------------- main


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "_live_worker":
        table, n, rounds, out, *hidden = sys.argv[2:]
        print(json.dumps(live_worker(table, int(n), int(rounds), [int(h) for h in hidden], out)))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["live", "donation", "bf16", "methods", "all"])
    ap.add_argument("--full", action="store_true", help="live: N = 1000 (else --clients)")
    ap.add_argument("--clients", type=int, default=200, help="live: N without --full")
    ap.add_argument("--rounds", type=int, default=20, help="live: rounds")
    ap.add_argument("--hidden", type=int, nargs="+", default=[1024, 256], help="live: MLP")
    ap.add_argument("--bf16-rounds", type=int, default=200)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="bf16")
    ap.add_argument("--cases", nargs="+", default=["mlp", "lenet"], choices=["mlp", "lenet"])
    ap.add_argument("--trials", type=int, default=5, help="methods: timed rounds per method")
    args = ap.parse_args()
    t = time.perf_counter()
    for what in (["live", "donation", "bf16", "methods"] if args.what == "all" else [args.what]):
        {"live": live, "donation": donation, "bf16": bf16, "methods": methods}[what](args)
        print(flush=True)
    print(f"total seconds: {time.perf_counter() - t:.0f}")


if __name__ == "__main__":
    main()
