"""Seconds per federated round on FEMNIST-shaped data, against two references and the roofline.

Run:   python benchmarks/round_throughput.py            (full table; ~10 min on a 2-core CPU)
       python benchmarks/round_throughput.py --quick    (cohorts 10 and 50, MLP only)

Setup (issue 2): 1000 clients with 50-200 examples of 28x28x1 inputs and 62 classes,
batch 20, one local epoch (so each client takes ceil(n_k / 20) SGD steps, at most 10),
FedAvg with local SGD. For every model and cohort size it times one round of each
execution strategy (all in one jitted program) and, side by side in the same process:

* loop:  a Python loop over clients and local steps, one jitted SGD step per call,
         batches cut on the host (how fedjax and the PyTorch reference codes run);
* central: centralised SGD on the same number of examples with ONE shared model
         (batch K * 20), i.e. the same FLOPs without per-client weights;
* floor: max(training FLOPs / measured large-matmul rate,
             bytes that must move / measured copy bandwidth), where the bytes count
         every client's parameters read and written, and gradients written and read,
         at each local step (16 bytes per parameter per step) plus its input batch.
         FLOPs are counted analytically (3x the forward FLOPs of the examples actually
         trained, + the loss_before forward pass over the real rows that FedAvg computes
         by default and the references do not; --no-track-loss drops it). XLA's
         cost_analysis of the compiled
         round is printed as a cross-check (it counts a loop body once).

Ratios are computed within this run, so they are comparable across noisy machines.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair.algorithm import compose
from fedjax_fair.client import local_training
from fedjax_fair.data import get_dataset
from fedjax_fair.execution import Execution, resolve
from fedjax_fair.models import cnn, mlp
from fedjax_fair.simulate import make_cohort
from timing import timeit

BATCH = 20
UNROLL = None  # the library's policy; --unroll overrides
TRACK_LOSS = True  # FedAvg's default: every round also evaluates F_k(theta^t); --no-track-loss


def machine_rates(reps: int = 3) -> dict:
    """Large-matmul FLOP/s and copy bandwidth (bytes read + written per second)."""
    n = 4096 if jax.default_backend() == "cpu" else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    matmul = 2 * n ** 3 / timeit(lambda: mm(a), reps)
    size = (64 if jax.default_backend() == "cpu" else 512) * 2 ** 20 // 4
    v = jnp.ones((size,), jnp.float32)
    cp = jax.jit(lambda x: x * 1.0001)
    bandwidth = 2 * 4 * size / timeit(lambda: cp(v), reps)
    return {"matmul_flops": matmul, "copy_bytes_per_s": bandwidth}


def forward_flops(model, params) -> float:
    """Analytic forward FLOPs of one example: 2 * MACs of every dense/conv layer."""
    total = 0.0
    h, w = model.input_shape[0], model.input_shape[1] if len(model.input_shape) > 1 else 1
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path)
        if not name.endswith("['kernel']"):
            continue
        if leaf.ndim == 2:  # dense
            total += 2 * leaf.shape[0] * leaf.shape[1]
        else:  # 'SAME' conv followed by a 2x2 pool: spatial size halves per conv layer
            kh, kw, cin, cout = leaf.shape
            total += 2 * h * w * kh * kw * cin * cout
            h, w = h // 2, w // 2
    return total


def loop_reference(model, lr, data_np, ids):
    """One FedAvg round as a host loop over clients and steps of a jitted SGD step."""

    @jax.jit
    def sgd_step(params, x, y):
        g = jax.grad(lambda p: jnp.mean(model.per_example_loss(p, {"x": x, "y": y})))(params)
        return jax.tree.map(lambda p, gi: p - lr * gi, params, g)

    xs, ys, ns = data_np
    rng = np.random.default_rng(0)

    def round_fn(params):
        total = sum(int(ns[k]) for k in ids)
        acc = jax.tree.map(jnp.zeros_like, params)
        for k in ids:
            n = int(ns[k])
            order = rng.permutation(n)
            local = params
            for s in range(math.ceil(n / BATCH)):
                rows = order[s * BATCH:(s + 1) * BATCH]
                local = sgd_step(local, xs[k][rows], ys[k][rows])
            acc = jax.tree.map(lambda a, p: a + (n / total) * p, acc, local)
        return acc

    return round_fn


def central_reference(model, lr, cohort_size, num_steps, input_shape):
    """num_steps SGD steps of one shared model on batches of cohort_size * BATCH."""
    b = cohort_size * BATCH
    x = jax.random.normal(jax.random.key(1), (num_steps, b, *input_shape), jnp.float32)
    y = jax.random.randint(jax.random.key(2), (num_steps, b), 0, model.num_classes)

    @jax.jit
    def train(params, x, y):
        def step(p, xy):
            g = jax.grad(lambda q: jnp.mean(model.per_example_loss(q, {"x": xy[0], "y": xy[1]})))(p)
            return jax.tree.map(lambda a, gi: a - lr * gi, p, g), None
        return jax.lax.scan(step, params, (x, y))[0]

    return lambda params: train(params, x, y)


def bench_model(name, model, data, data_np, cohorts, strategies, rates, reps, rows):
    params = model.init(jax.random.key(0))
    d = sum(p.size for p in jax.tree.leaves(params))
    fwd = forward_flops(model, params)
    in_bytes = 4 * math.prod(model.input_shape)
    for k in cohorts:
        ids = np.asarray(jax.random.choice(jax.random.key(k), data.num_clients, (k,), replace=False))
        cohort = make_cohort(data, jnp.asarray(ids, jnp.int32))
        ns = np.asarray(data.train.num_examples)[ids]
        steps = np.ceil(ns / BATCH)
        flops = 3 * fwd * ns.sum() + (fwd * ns.sum() if TRACK_LOSS else 0)  # + loss_before pass
        moved = steps.sum() * (16 * d + BATCH * in_bytes)
        floor = max(flops / rates["matmul_flops"], moved / rates["copy_bytes_per_s"])
        loop = loop_reference(model, 0.05, data_np, ids)
        loop_s = timeit(lambda: loop(params), max(1, reps - 1))
        total_steps = max(1, int(round(ns.sum() / (k * BATCH))))
        central = central_reference(model, 0.05, k, total_steps, model.input_shape)
        central_s = timeit(lambda: central(params), reps)
        state = None
        for strategy in strategies:
            chunk = 8 if strategy == "chunked" else None
            alg = compose(local_training(model, client_lr=0.05, batch_size=BATCH,
                                         unroll=UNROLL, track_loss=TRACK_LOSS))  # FedAvg
            state = alg.init(params, data.num_clients)
            fn = jax.jit(functools.partial(alg.apply, execution=Execution(strategy, chunk)))
            t = time.perf_counter()
            compiled = fn.lower(state, cohort, jax.random.key(0)).compile()
            compile_s = time.perf_counter() - t
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            sec = timeit(lambda: compiled(state, cohort, jax.random.key(0)), reps)
            label = strategy if strategy != "auto" else "auto->" + "/".join(
                str(v) for v in resolve("auto", k) if v is not None)
            rows.append({"model": name, "params": d, "cohort": k, "strategy": label,
                         "s_per_round": sec, "compile_s": compile_s,
                         "updates_per_s": k / sec, "x_loop": loop_s / sec,
                         "x_central": sec / central_s, "x_floor": sec / floor,
                         "loop_s": loop_s, "central_s": central_s, "floor_s": floor,
                         "gflop": flops / 1e9, "xla_gflop_once": cost.get("flops", 0) / 1e9})
            print(_fmt(rows[-1]), flush=True)


HEADER = ("model", "cohort", "strategy", "s/round", "upd/s", "loop s", "x loop", "central s",
          "x central", "floor s", "x floor", "compile s", "GFLOP", "XLA GFLOP*")


def _fmt(r):
    return ("| {model} | {cohort} | {strategy} | {s_per_round:.4f} | {updates_per_s:.0f} | "
            "{loop_s:.4f} | {x_loop:.2f} | {central_s:.4f} | {x_central:.2f} | {floor_s:.4f} | "
            "{x_floor:.2f} | {compile_s:.1f} | {gflop:.1f} | {xla_gflop_once:.1f} |").format(**r)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--cohorts", default=None, help="comma list; default 10,50,100 (+1000 for mlp)")
    ap.add_argument("--strategies", default="vmap,chunked,sequential,auto")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    ap.add_argument("--unroll", default=None, help="override the local-step unroll (int or 'full')")
    ap.add_argument("--no-track-loss", action="store_true",
                    help="skip the loss_before pass (the references do not compute it)")
    args = ap.parse_args()
    global UNROLL, TRACK_LOSS
    TRACK_LOSS = not args.no_track_loss
    if args.unroll is not None:
        UNROLL = True if args.unroll == "full" else int(args.unroll)

    print(f"# {platform.processor() or platform.machine()} | jax {jax.__version__} | "
          f"backend {jax.default_backend()} | devices {jax.devices()} | unroll {UNROLL or 'policy'} | track_loss {TRACK_LOSS}")
    rates = machine_rates()
    print(f"# matmul {rates['matmul_flops'] / 1e9:.1f} GFLOP/s, copy "
          f"{rates['copy_bytes_per_s'] / 1e9:.1f} GB/s (read+write)")
    ds = get_dataset("femnist_like", num_clients=1000, min_examples=50, max_examples=200)
    data = ds.data
    n = np.asarray(data.train.num_examples)
    x = np.asarray(data.train.examples["x"])
    y = np.asarray(data.train.examples["y"])
    data_np = ([x[k, :n[k]] for k in range(len(n))], [y[k, :n[k]] for k in range(len(n))], n)
    strategies = args.strategies.split(",")
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))
    rows: list = []
    for name in args.models.split(","):
        model = (mlp(ds.input_shape, ds.num_classes, hidden=(200, 200)) if name == "mlp"
                 else cnn(ds.input_shape, ds.num_classes))
        if args.cohorts:
            cohorts = [int(c) for c in args.cohorts.split(",")]
        elif args.quick:
            cohorts = [10, 50]
        else:
            cohorts = [10, 50, 100] + ([1000] if name == "mlp" else [])
        bench_model(name, model, data, data_np, cohorts, strategies, rates, args.reps, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rates": rates, "backend": jax.default_backend(),
                       "device": str(jax.devices()[0]), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
