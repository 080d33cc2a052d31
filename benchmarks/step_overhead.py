"""Per-local-step cost of the library's compiled FedAvg round against hand-written
baselines of the same job, side by side in one process.

Run:   python benchmarks/step_overhead.py                      (logreg, K = 100)
       python benchmarks/step_overhead.py --model mlp --reps 5
       python benchmarks/step_overhead.py --slope               (+ per-step / per-client split)

The job is round_throughput.py's (FEMNIST-shaped clients: 200 stored rows, n_k in
60..200, batch 20, S = 10 local steps, E = ceil(S B / 60) = 4 epochs' orders, lr 0.05,
FedAvg without the ``loss_before`` pass). Every contender is timed on the same data, alternating call by
call (the starting one rotates); the table gives the fastest wall and CPU seconds of
a call divided by the local steps it runs (K x S for a round), and the ratio to the
library's round. Contenders:

* ``library round``: ``compose(local_training(...)).apply`` jitted, ``sequential``
  (what ``auto`` runs on one CPU device): ONE program, ``lax.map`` over clients, a
  ``lax.scan`` over steps, each step gathering its batch from the client's
  epoch-shuffled rows.
* ``library, before``: the same round with the engine as it was before this script
  (each epoch's order an argsort of (score, row) pairs; every step gathering its
  batch inside the step loop from the client's rows in their stored [M, 28, 28, 1]
  shape). ``library, argsort orders`` puts back the argsort alone; ``... batches
  gathered in the loop`` gathers every step's batch in the loop (from the [M, 784]
  view; ``client.PREGATHER`` off); ``... unflattened rows in the loop`` also from
  the stored shape.
* ``library round, YNNPACK off (diagnostic)``: the same program compiled with the
  per-compilation option ``xla_cpu_experimental_ynn_fusion_type=""`` (dots on
  XLA's own kernels instead of YNNPACK fusions; float rounding differs).
* ``scan, pre-cut batches``: a minimal hand-written round of the same shapes: batches
  cut on the host ([K, S, B, ...]), ``lax.map`` over clients of a ``lax.scan`` of
  plain SGD steps on the model's mean loss, the deltas stacked like the library's.
  No shuffling, masks, or per-client RNG: the floor of the compiled design.
* ``python loop of jitted step``: how fedjax 0.0.17 runs clients: one jitted SGD
  step dispatched from Python per local step (20 clients, batches cut on the host).

``--slope`` also times the library round (now and before) at S / 2 local steps:
per-step cost = (t(S) - t(S / 2)) / (K (S - S / 2)), per-client cost = t(S) / K - S x
per-step cost.
The load average is printed with the table (the machine is shared: compare ratios).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import sys
from fedjax_fair.core.client import ClientTraining

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from fedjax_fair.core import client as C  # noqa: E402
from fedjax_fair.core.algorithm import compose  # noqa: E402
from fedjax_fair.core.execution import Execution  # noqa: E402
from timing import alternate, load_average  # noqa: E402

BATCH, LR, PADDED = 20, 0.05, 200
LOOP_CLIENTS = 20


# ------------------------------------------------- the engine as it was (for "before")

def legacy_epoch_order(data, shuffle_key, epoch, batch_size):
    """The previous epoch order: stable argsort of the (score, row) pairs."""
    padded = data.mask.shape[0]
    scores = jax.random.uniform(jax.random.fold_in(shuffle_key, epoch), (padded,))
    order = jnp.argsort(jnp.where(data.mask, scores, 2.0))
    return jnp.pad(order, (0, math.ceil(padded / batch_size) * batch_size - padded))


def legacy_masked_steps(step, carry, data, local_steps, key, *, batch_size, num_epochs=1,
                        max_steps=None, unroll=1):
    """The previous masked_steps: batches gathered from the rows in their stored shape."""
    shuffle_key, dropout_key = jax.random.split(key)
    length = C.max_local_steps(data.mask.shape[0], batch_size, num_epochs, max_steps)
    num_steps = jnp.minimum(jnp.minimum(local_steps, length),
                            num_epochs * C.steps_per_epoch(data.num_examples, batch_size))
    orders = jax.vmap(lambda e: C.epoch_order(data, shuffle_key, e, batch_size))(
        jnp.arange(num_epochs))
    spe = jnp.maximum(C.steps_per_epoch(data.num_examples, batch_size), 1)
    last_epoch_start = jnp.maximum(num_steps - 1, 0) // spe * spe

    def one_step(state, t):
        inner, loss_sum = state
        batch, batch_mask = C.batch_from_orders(data, orders, t, batch_size)
        inner, batch_loss_sum = step(inner, batch, batch_mask, jax.random.fold_in(dropout_key, t))
        loss_sum = loss_sum + jnp.where(t >= last_epoch_start, batch_loss_sum,
                                        0.0).astype(loss_sum.dtype)
        return inner, loss_sum

    def scan_step(state, t):
        return C.skip_past(num_steps, one_step, state, t), None

    (carry, loss_sum), _ = jax.lax.scan(scan_step, (carry, jnp.zeros((), jnp.float32)),
                                        jnp.arange(length), unroll=unroll)
    last_epoch_rows = jnp.minimum(data.num_examples, (num_steps - last_epoch_start) * batch_size)
    return carry, num_steps, loss_sum / jnp.maximum(last_epoch_rows, 1)


@contextlib.contextmanager
def engine(argsort: bool = False, unflattened: bool = False, pregather: bool = True):
    """Traces with the previous epoch order and / or batch gather put back, or with
    the batches gathered inside the step loop (``client.PREGATHER`` off)."""
    saved = C.epoch_order, C.masked_steps, C.PREGATHER
    if argsort:
        C.epoch_order = legacy_epoch_order
    if unflattened:
        C.masked_steps = legacy_masked_steps
    C.PREGATHER = pregather
    try:
        yield
    finally:
        C.epoch_order, C.masked_steps, C.PREGATHER = saved


# ------------------------------------------------------------------------ the job

def make_job(model_name: str, k: int):
    import round_throughput as R
    model = R.make_model(model_name)
    fed = R.Federation(k)
    cohort, sizes = fed.cohort(k)
    return model, fed, cohort, sizes


def library_round(model, cohort, k, steps, epochs, compiler_options=None, **engine_kw):
    alg = compose(C.local_training(model, training=ClientTraining(lr=LR, batch_size=BATCH,
                                                                  num_epochs=epochs, max_steps=steps), track_loss=False))
    params = model.init(jax.random.key(0))
    state = alg.init(params, k)
    with engine(**engine_kw):
        compiled = jax.jit(functools.partial(alg.apply, execution=Execution("sequential"))
                           ).lower(state, cohort, jax.random.key(0)).compile(
                               compiler_options=compiler_options)
    return lambda: compiled(state, cohort, jax.random.key(1))


def scan_round(model, fed, k, steps):
    """lax.map over clients of a lax.scan of SGD steps on pre-cut batches."""
    params = model.init(jax.random.key(0))
    rows = np.arange(steps * BATCH) % PADDED
    xb = jnp.asarray(fed.x[:k][:, rows].reshape(k, steps, BATCH, *fed.x.shape[2:]))
    yb = jnp.asarray(fed.y[:k][:, rows].reshape(k, steps, BATCH))

    def loss(p, x, y):
        return jnp.mean(model.per_example_loss(p, {"x": x, "y": y}))

    @jax.jit
    def run(params, xb, yb):
        def client(batches):
            def step(p, b):
                g = jax.grad(loss)(p, *b)
                return jax.tree.map(lambda a, gi: a - LR * gi, p, g), None
            p, _ = jax.lax.scan(step, params, batches)
            return jax.tree.map(jnp.subtract, params, p)
        return jax.lax.map(client, (xb, yb))

    return lambda: run(params, xb, yb)


def python_loop(model, fed, sizes, steps, clients=LOOP_CLIENTS):
    """fedjax-style: one jitted SGD step dispatched per local step."""
    params = model.init(jax.random.key(0))

    @jax.jit
    def step(p, x, y):
        g = jax.grad(lambda q: jnp.mean(model.per_example_loss(q, {"x": x, "y": y})))(p)
        return jax.tree.map(lambda a, gi: a - LR * gi, p, g)

    rng = np.random.default_rng(0)
    cut = []
    for c in range(clients):
        n = int(sizes[c])
        order = np.concatenate([rng.permutation(n) for _ in range(math.ceil(steps * BATCH / n))])
        r = order[:steps * BATCH]
        cut.append((fed.x[c][r], fed.y[c][r]))

    def run():
        out = None
        for x, y in cut:
            p = params
            for s in range(steps):
                p = step(p, x[s * BATCH:(s + 1) * BATCH], y[s * BATCH:(s + 1) * BATCH])
            out = p
        return out

    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="logreg", help="logreg or mlp")
    ap.add_argument("--cohort", type=int, default=100)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--slope", action="store_true",
                    help="also split the library's time into per-step and per-client costs")
    args = ap.parse_args(argv)
    k, s = args.cohort, args.steps
    model, fed, cohort, sizes = make_job(args.model, k)
    e = max(1, math.ceil(s * BATCH / 60))  # round_throughput.local_epochs: 4 for S = 10

    fns, per = {}, {}
    fns["library round"] = library_round(model, cohort, k, s, e)
    fns["library, before"] = library_round(model, cohort, k, s, e, argsort=True, unflattened=True)
    fns["library, argsort orders"] = library_round(model, cohort, k, s, e, argsort=True)
    fns["library, batches gathered in the loop"] = library_round(model, cohort, k, s, e,
                                                                 pregather=False)
    fns["library, unflattened rows in the loop"] = library_round(model, cohort, k, s, e,
                                                                 unflattened=True)
    fns["library round, YNNPACK off (diagnostic)"] = library_round(
        model, cohort, k, s, e, compiler_options={"xla_cpu_experimental_ynn_fusion_type": ""})
    fns["scan, pre-cut batches"] = scan_round(model, fed, k, s)
    fns["python loop of jitted step"] = python_loop(model, fed, sizes, s)
    per.update({n: k * s for n in fns})
    per["python loop of jitted step"] = LOOP_CLIENTS * s
    if args.slope:
        h = s // 2
        fns["library round, S/2 steps"] = library_round(model, cohort, k, h, e)
        fns["library, before, S/2 steps"] = library_round(model, cohort, k, h, e,
                                                          argsort=True, unflattened=True)
        per["library round, S/2 steps"] = per["library, before, S/2 steps"] = k * h

    same = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))),
                        fns["library round"]()[0].params, fns["library, before"]()[0].params)
    cpu = {}
    best = alternate(fns, args.reps, cpu=cpu)
    ref = best["library round"] / per["library round"]
    print(f"# {args.model}, K = {k}, S = {s}, B = {BATCH}; {load_average()} "
          f"(2-core machine: compare ratios); library now vs before: max |param diff| "
          f"{max(jax.tree.leaves(same)):.1e}")
    print("| contender | us / step (wall) | us / step (CPU) | x library round |")
    print("|---|---|---|---|")
    for name, sec in best.items():
        w = sec / per[name]
        print(f"| {name} | {1e6 * w:.1f} | {1e6 * cpu[name] / per[name]:.1f} | {w / ref:.2f} |")
    if args.slope:
        for tag, a, b in (("now", "library round", "library round, S/2 steps"),
                          ("before", "library, before", "library, before, S/2 steps")):
            step = (best[a] - best[b]) / (k * (s - h))
            print(f"# library {tag}: per step {1e6 * step:.1f} us, per client "
                  f"{1e6 * (best[a] / k - s * step):.1f} us (wall)")


if __name__ == "__main__":
    main()
