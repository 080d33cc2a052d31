"""Why the MLP's compiled round ran no faster than the per-client loop on a 2-core CPU,
why ``vmap`` is the slowest strategy at cohort 1000, and whether ``auto`` picks right:
each hypothesis timed side by side in one process (issue 14; findings in
docs/bench/cpu_investigation.md).

Run:   python benchmarks/cpu_investigation.py table    [--cohorts 10,100,1000]
       python benchmarks/cpu_investigation.py kernels | overhead | threads | vmap | auto | cores
       python benchmarks/cpu_investigation.py all

The job is round_throughput.py's MLP job (784-200-200-62, FEMNIST-shaped clients of
60-200 rows, 10 local steps of batch 20, FedAvg without the ``loss_before`` pass unless
a row says so). Contenders alternate call by call (the first one rotating); each reports
its fastest and median trial and its CPU seconds (all threads of this process: less
sensitive than wall time to other jobs on a shared machine). The load average is
printed with every table. ``--cpu-devices N`` makes N CPU devices before JAX starts
(``jax_num_cpu_devices``); ``table`` and ``cores`` use one per core by default.

Sections (one per hypothesis):

``kernels``: the matmuls of one local step, alone and batched over K clients as
  ``vmap`` makes them, per client: the forward ``x @ W`` (XLA:CPU hands it to its
  YNNPACK fusion), the weight gradient ``x.T @ dy`` (contracting the batch rows: XLA's
  own dot, not YNNPACK) and the same with ``x`` transposed first (YNNPACK takes it),
  with the library each lands in.
``overhead``: the library's ``sequential`` round against the loop and against
  prototypes without each piece of the engine's work: ``loop`` (round_throughput's
  reference: host loop of a jitted SGD step), ``loop-sync`` (waiting for each step),
  ``host-seq`` (host loop of one jitted library client update each), ``fori-acc``
  (one program summing weighted deltas in a ``fori_loop``: no [K, d] stack of
  deltas), ``2-chains`` (the cohort in two independent ``lax.map`` chains in one
  program), ``plain-map`` (``lax.map`` of a plain scan of SGD steps on batches cut on
  the host: no masks, no in-program shuffling or gathering), ``-loss`` = without
  the ``loss_before`` pass.
``threads``: the same compiled ``sequential`` round with XLA:CPU's intra-op
  threading switched off piece by piece (compiler options, one executable each) and
  with every thread of the process pinned to one core; the loop likewise.
``vmap``: ``vmap`` and ``chunked`` with chunk sizes 2 ... 64 at one cohort, with the
  working set of a chunk and XLA's temporaries beside the time.
``auto``: every strategy at cohort 10, many trials (``auto`` compiled separately).
``cores``: one device against one CPU device per core: ``sequential`` on a mesh
  (``Execution(..., mesh=...)``), and ``auto``, which splits the cohort over the
  local CPU devices by itself (``execution.auto_mesh``).
``table``: per cohort (10, 100, 1000): ``vmap``, ``chunked`` (8), ``sequential`` on
  one device, ``auto`` (here: the cohort over one CPU device per core), the loop;
  x loop = loop time / row time; x floor = row time / (training FLOPs at the
  machine's best measured matmul rate, 1024-2048 square, all cores).
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from fedjax_fair.core.client import ClientTraining

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "references"))

import round_throughput as rt  # noqa: E402
import roofline  # noqa: E402
from timing import load_average  # noqa: E402

from fedjax_fair.core import execution as ex  # noqa: E402
from fedjax_fair.core.algorithm import compose  # noqa: E402
from fedjax_fair.core.client import local_training  # noqa: E402
from fedjax_fair.core.execution import Execution  # noqa: E402
from fedjax_fair.core.types import Broadcast  # noqa: E402


def alternate_stats(fns: dict, trials: int) -> dict:
    """{name: (min wall, median wall, min CPU)} seconds; callables alternate, the
    first one rotating. CPU = this process's user + system seconds (all threads)."""
    for f in fns.values():
        jax.block_until_ready(f())
    names = list(fns)
    seen = {n: [] for n in names}
    cpu = {n: [] for n in names}
    for t in range(trials):
        k = t % len(names)
        for n in names[k:] + names[:k]:
            c = time.process_time()
            s = time.perf_counter()
            jax.block_until_ready(fns[n]())
            seen[n].append(time.perf_counter() - s)
            cpu[n].append(time.process_time() - c)
    return {n: (min(v), statistics.median(v), min(cpu[n])) for n, v in seen.items()}


def report(title, stats, flops=None, extra=None):
    print(f"\n## {title} ({load_average()})")
    base = min(v[0] for v in stats.values())
    base_cpu = min(v[2] for v in stats.values())
    print("| contender | best s | median s | best / fastest | CPU s | CPU / least |"
          + (" GFLOP/s |" if flops else "") + (" note |" if extra else ""))
    print("|---|---|---|---|---|---|" + ("---|" if flops else "") + ("---|" if extra else ""))
    for n, (lo, med, c) in stats.items():
        line = f"| {n} | {lo:.4f} | {med:.4f} | {lo / base:.2f} | {c:.4f} | {c / base_cpu:.2f} |"
        if flops:
            line += f" {flops / lo / 1e9:.0f} |"
        if extra:
            line += f" {extra.get(n, '')} |"
        print(line, flush=True)


def lib_round(model, steps, strategy, chunk=None, track_loss=True, unroll=None):
    alg = compose(local_training(model, training=ClientTraining(lr=rt.LR, batch_size=rt.BATCH,
                                                                num_epochs=rt.local_epochs(steps), max_steps=steps),
                                 track_loss=track_loss, unroll=unroll))
    return alg, jax.jit(functools.partial(alg.apply, execution=Execution(strategy, chunk)),
                        donate_argnums=0)


def bind(alg, fn, params, cohort, k):
    box = {"s": jax.tree.map(jnp.copy, alg.init(params, k))}
    compiled = fn.lower(box["s"], cohort, jax.random.key(0)).compile()

    def call():
        box["s"], _ = compiled(box["s"], cohort, jax.random.key(1))
        return box["s"]
    return call


def host_sequential(model, steps, params, cohort, track_loss=True):
    """Prototype: a host loop over clients, one jitted call per client (its update
    and the weighted accumulation), the cohort indexed inside the call."""
    update = local_training(model, training=ClientTraining(lr=rt.LR, batch_size=rt.BATCH,
                                                           num_epochs=rt.local_epochs(steps), max_steps=steps),
                            track_loss=track_loss)
    n = cohort.data.num_examples
    weights = n / jnp.sum(n)

    @functools.partial(jax.jit, donate_argnums=0)
    def one(acc, params, data, local_steps, ids, i, key):
        take = lambda v: jax.lax.dynamic_index_in_dim(v, i, keepdims=False)
        out, _ = update(Broadcast(params, jnp.zeros((), jnp.int32)), (),
                        jax.tree.map(take, data), take(local_steps),
                        jax.random.fold_in(key, take(ids)))
        delta_sum, losses = acc  # the losses stay live, as the round's metrics keep them
        return (jax.tree.map(lambda a, dl: a + take(weights) * dl, delta_sum, out.delta),
                losses.at[i].set(out.loss_before))

    k = int(cohort.client_ids.shape[0])

    def round_fn():
        acc = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((k,), jnp.float32))
        for i in range(k):
            acc = one(acc, params, cohort.data, cohort.local_steps, cohort.client_ids, i,
                      jax.random.key(1))
        return jax.tree.map(jnp.subtract, params, acc[0]), acc[1]
    return round_fn


def sync_loop(model, fed, sizes, steps, params):
    """The loop reference waiting for every step before dispatching the next, so the
    host's dispatch no longer overlaps the previous step's computation."""
    step = jax.jit(rt.sgd_step_fn(model, rt.LR))
    axpy = jax.jit(lambda acc, p, w: jax.tree.map(lambda a, b: a + w * b, acc, p))
    rng = np.random.default_rng(0)
    total = float(sizes.sum())

    def round_fn():
        acc = jax.tree.map(jnp.zeros_like, params)
        for k in range(len(sizes)):
            n = int(sizes[k])
            rows = rt.epoch_rows(rng, n, rt.BATCH, steps)
            xk, yk = fed.x[k % fed.base][rows], fed.y[k % fed.base][rows]
            local = params
            for s in range(steps):
                local = jax.block_until_ready(
                    step(local, xk[s * rt.BATCH:(s + 1) * rt.BATCH],
                         yk[s * rt.BATCH:(s + 1) * rt.BATCH]))
            acc = axpy(acc, local, n / total)
        return acc
    return round_fn


def fori_accumulate(model, steps, params, cohort, track_loss=True):
    """Prototype: one program, a fori_loop over clients carrying the weighted sum of
    deltas (no [K, d] stack of deltas)."""
    update = local_training(model, training=ClientTraining(lr=rt.LR, batch_size=rt.BATCH,
                                                           num_epochs=rt.local_epochs(steps), max_steps=steps),
                            track_loss=track_loss)

    @jax.jit
    def round_(params, cohort, key):
        n = cohort.data.num_examples
        weights = n / jnp.sum(n)

        def body(i, acc):
            take = lambda v: jax.lax.dynamic_index_in_dim(v, i, keepdims=False)
            out, _ = update(Broadcast(params, jnp.zeros((), jnp.int32)), (),
                            jax.tree.map(take, cohort.data), take(cohort.local_steps),
                            jax.random.fold_in(key, take(cohort.client_ids)))
            return jax.tree.map(lambda a, dl: a + take(weights) * dl, acc, out.delta)
        acc = jax.lax.fori_loop(0, n.shape[0], body, jax.tree.map(jnp.zeros_like, params))
        return jax.tree.map(jnp.subtract, params, acc)
    return lambda: round_(params, cohort, jax.random.key(1))


def two_chains(model, steps, params, cohort, chains=2):
    """Prototype: the cohort cut into ``chains`` parts, each a ``lax.map`` over its
    clients, in one program: the parts are independent, so XLA:CPU's executor may
    run them on different cores at once (one chain runs on one core at a time)."""
    update = local_training(model, training=ClientTraining(lr=rt.LR, batch_size=rt.BATCH,
                                                           num_epochs=rt.local_epochs(steps), max_steps=steps),
                            track_loss=False)

    @jax.jit
    def round_(params, cohort, key):
        n = cohort.data.num_examples
        weights = n / jnp.sum(n)
        k = n.shape[0]
        per = -(-k // chains)
        b = Broadcast(params, jnp.zeros((), jnp.int32))
        acc = jax.tree.map(jnp.zeros_like, params)
        for c in range(chains):
            sl = slice(c * per, min(k, (c + 1) * per))
            part = jax.tree.map(lambda v: v[sl], (cohort.data, cohort.local_steps,
                                                  cohort.client_ids))
            out = jax.lax.map(lambda xs: update(b, (), xs[0], xs[1],
                                                jax.random.fold_in(key, xs[2]))[0].delta, part)
            acc = jax.tree.map(lambda a, o: a + jnp.tensordot(weights[sl], o, 1), acc, out)
        return jax.tree.map(jnp.subtract, params, acc)
    return lambda: round_(params, cohort, jax.random.key(1))


def plain_map(model, steps, params, fed, sizes):
    """Prototype: lax.map over clients of a plain scan of SGD steps, batches cut on
    the host before the round ([K, S, B, ...])."""
    k = len(sizes)
    rng = np.random.default_rng(0)
    rows = [rt.epoch_rows(rng, int(n), rt.BATCH, steps) for n in sizes]
    xb = jnp.asarray(np.stack([fed.x[i % rt.BASE_CLIENTS][r] for i, r in enumerate(rows)])
                     .reshape(k, steps, rt.BATCH, *fed.x.shape[2:]))
    yb = jnp.asarray(np.stack([fed.y[i % rt.BASE_CLIENTS][r] for i, r in enumerate(rows)])
                     .reshape(k, steps, rt.BATCH))
    w = jnp.asarray(sizes / sizes.sum(), jnp.float32)
    sgd = rt.sgd_step_fn(model, rt.LR)

    @jax.jit
    def round_(params, xb, yb):
        def client(xy):
            return jax.lax.scan(lambda p, b: (sgd(p, *b), None), params, xy)[0]
        out = jax.lax.map(client, (xb, yb))
        return jax.tree.map(lambda o: jnp.tensordot(w, o, 1), out)
    return lambda: round_(params, xb, yb)


def setup(k, steps=10):
    model = rt.make_model("mlp")
    fed = rt.Federation()
    params = model.init(jax.random.key(0))
    cohort, sizes = fed.cohort(k)
    flops = 3 * rt.forward_flops(model, params) * k * steps * rt.BATCH
    return model, fed, params, cohort, sizes, flops


def cmd_overhead(args):
    k, steps = args.cohort or 100, 10
    model, fed, params, cohort, sizes, flops = setup(k, steps)
    fns = {}
    for tl in (True, False):
        alg, fn = lib_round(model, steps, "sequential", track_loss=tl)
        fns[f"lib sequential{'' if tl else ' -loss'}"] = bind(alg, fn, params, cohort, k)
    alg, fn = lib_round(model, steps, "sequential", track_loss=False, unroll=True)
    fns["seq-unroll -loss"] = bind(alg, fn, params, cohort, k)
    loop = rt.loop_reference(model, fed, sizes, steps)
    fns["loop"] = lambda: loop(params)
    fns["loop-sync"] = sync_loop(model, fed, sizes, steps, params)
    fns["host-seq -loss"] = host_sequential(model, steps, params, cohort, track_loss=False)
    fns["host-seq"] = host_sequential(model, steps, params, cohort, track_loss=True)
    fns["fori-acc -loss"] = fori_accumulate(model, steps, params, cohort, track_loss=False)
    fns["2-chains -loss"] = two_chains(model, steps, params, cohort)
    fns["plain-map"] = plain_map(model, steps, params, fed, sizes)
    stats = alternate_stats(fns, args.trials)
    report(f"MLP K={k}, {steps} steps of {rt.BATCH}: compiled round vs loop (-loss: "
           "no loss_before pass; GFLOP/s counts training only)", stats, flops)


def cmd_vmap(args):
    k, steps = args.cohort or 1000, 10
    model, fed, params, cohort, sizes, flops = setup(k, steps)
    w1 = roofline.step_working_set(rt.sgd_step_fn(model, rt.LR), params,
                                   *rt._batch_shapes(model, rt.BATCH))
    fns, note = {}, {}
    for strategy, chunk in [("sequential", None), ("chunked", 2), ("chunked", 4),
                            ("chunked", 8), ("chunked", 16), ("chunked", 64), ("vmap", None)]:
        if chunk is not None and chunk >= k:
            continue
        alg, fn = lib_round(model, steps, strategy, chunk, track_loss=False)
        name = strategy + (f" ({chunk})" if chunk else "")
        compiled_temp = fn.lower(alg.init(params, k), cohort, jax.random.key(0)).compile() \
            .memory_analysis().temp_size_in_bytes
        fns[name] = bind(alg, fn, params, cohort, k)
        c = 1 if strategy == "sequential" else (chunk or k)
        note[name] = (f"working set {c * w1 / 2 ** 20:.1f} MiB; XLA temporaries "
                      f"{compiled_temp / 2 ** 20:.0f} MiB")
    stats = alternate_stats(fns, args.trials)
    report(f"MLP K={k}: vmap vs chunk size (no loss_before; one client's step working "
           f"set {w1 / 2 ** 20:.2f} MiB)", stats, flops, note)


def cmd_auto(args):
    k, steps = args.cohort or 10, 10
    model, fed, params, cohort, sizes, flops = setup(k, steps)
    fns = {}
    for strategy in ("sequential", "chunked", "vmap", "bucketed", "auto"):
        alg, fn = lib_round(model, steps, strategy, track_loss=False)
        fns[strategy] = bind(alg, fn, params, cohort, k)
    loop = rt.loop_reference(model, fed, sizes, steps)
    fns["loop"] = lambda: loop(params)
    stats = alternate_stats(fns, args.trials)
    report(f"H5: MLP K={k}: every strategy, {args.trials} alternating trials, no loss_before "
           "(auto is resolve('auto') = sequential on one CPU device, compiled separately)",
           stats, flops)



def libraries(compiled_text: str) -> str:
    """Which library XLA:CPU hands each dot to: YNNPACK fusions, or XLA's own dot."""
    ynn = len(re.findall(r'"kind":"__ynn_fusion"', compiled_text))
    dots = len(re.findall(r"\} dot\(", compiled_text))  # a YNNPACK fusion holds one dot
    return f"{ynn} YNNPACK, {dots - ynn} XLA dot"


def best_per_call(fn, calls: int, repeats: int = 3) -> float:
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def cmd_kernels(args):
    """H1: per-client cost of the step's largest matmuls (layer 1, 784 x 200, batch
    20), alone and batched over K clients."""
    print(f"\n## H1: layer-1 matmuls of one local step, per client, batched over K clients as "
          f"vmap makes them ({load_average()})")
    print("| K | forward x@W | weight grad x.T@dy | weight grad, x transposed first | "
          "weight grad + SGD update | per-client weights |")
    print("|---|---|---|---|---|---|")
    flops = 2 * 20 * 784 * 200
    for k in (1, 2, 8, 64, 256):
        x = jax.random.normal(jax.random.key(0), (k, 20, 784))
        dy = jax.random.normal(jax.random.key(1), (k, 20, 200))
        w = jax.random.normal(jax.random.key(2), (k, 784, 200))
        cands = [(lambda x, w: jnp.einsum("kbd,kdh->kbh", x, w), (x, w)),
                 (lambda x, dy: jnp.einsum("kbd,kbh->kdh", x, dy), (x, dy)),
                 (lambda x, dy: jnp.einsum("kdb,kbh->kdh", jnp.swapaxes(x, 1, 2), dy), (x, dy)),
                 (lambda x, dy, w: w - 0.05 * jnp.einsum("kbd,kbh->kdh", x, dy), (x, dy, w))]
        cells = []
        for f, a in cands:
            f = jax.jit(f)
            text = f.lower(*a).compile().as_text()
            t = best_per_call(lambda: f(*a), max(3, 1000 // k))
            cells.append(f"{t / k * 1e6:.0f} us ({flops * k / t / 1e9:.0f} GFLOP/s; "
                         f"{libraries(text)})")
        print(f"| {k} | " + " | ".join(cells) + f" | {k * 784 * 200 * 4 / 2 ** 20:.1f} MiB |",
              flush=True)


def pin(cpus) -> None:
    """Every thread of this process onto ``cpus`` (new threads inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass


def pinned(fn, cpus=frozenset({0})):
    every = set(range(os.cpu_count() or 1))

    def call():
        pin(cpus)
        try:
            return jax.block_until_ready(fn())
        finally:
            pin(every)
    return call


def cmd_threads(args):
    """H4: XLA:CPU's intra-op threads on the library's sequential round."""
    k, steps = args.cohort or 100, 10
    model, fed, params, cohort, sizes, flops = setup(k, steps)
    alg, fn = lib_round(model, steps, "sequential", track_loss=False)
    state = alg.init(params, k)
    fns = {}
    for name, opts in [("sequential", {}),
                       ("sequential, Eigen on 1 thread", {"xla_cpu_multi_thread_eigen": False}),
                       ("sequential, no YNNPACK", {"xla_cpu_experimental_ynn_fusion_type": ""}),
                       ("sequential, no YNNPACK, Eigen on 1 thread",
                        {"xla_cpu_experimental_ynn_fusion_type": "",
                         "xla_cpu_multi_thread_eigen": False})]:
        compiled = jax.jit(functools.partial(alg.apply, execution=Execution("sequential"))) \
            .lower(state, cohort, jax.random.key(0)).compile(compiler_options=opts or None)
        fns[name] = functools.partial(compiled, state, cohort, jax.random.key(1))
    fns["sequential, all threads pinned to core 0"] = pinned(fns["sequential"])
    loop = rt.loop_reference(model, fed, sizes, steps)
    fns["loop"] = lambda: loop(params)
    fns["loop, all threads pinned to core 0"] = pinned(lambda: loop(params))
    stats = alternate_stats(fns, args.trials)
    report(f"H4: MLP K={k} sequential round and loop, XLA:CPU threading (no loss_before)",
           stats, flops)


def round_contender(model, steps, params, cohort, k, execution, track_loss=False):
    alg = compose(local_training(model, training=ClientTraining(lr=rt.LR, batch_size=rt.BATCH,
                                                                num_epochs=rt.local_epochs(steps), max_steps=steps),
                                 track_loss=track_loss))
    fn = jax.jit(functools.partial(alg.apply, execution=execution), donate_argnums=0)
    box = {"s": jax.tree.map(jnp.copy, alg.init(params, k))}
    t = time.perf_counter()
    compiled = fn.lower(box["s"], cohort, jax.random.key(0)).compile()
    compile_s = time.perf_counter() - t

    def call():
        box["s"], _ = compiled(box["s"], cohort, jax.random.key(1))
        return box["s"]
    return call, compile_s


def cmd_cores(args):
    """One device against one CPU device per core (client-level parallelism)."""
    from fedjax_fair.core import sharding
    k, steps = args.cohort or 100, 10
    cores = len(jax.local_devices(backend="cpu"))
    if cores < 2:
        print("\n## cores: one CPU device only; run with --cpu-devices 2")
        return
    model, fed, params, cohort, sizes, flops = setup(k, steps)
    mesh = sharding.make_mesh(cores)
    fns = {}
    fns["sequential, 1 device"], _ = round_contender(model, steps, params, cohort, k,
                                                     Execution("sequential"))
    fns[f"sequential, mesh of {cores} devices"], _ = round_contender(
        model, steps, params, cohort, k, Execution("sequential", mesh=mesh))
    fns[f"auto ({cores} devices: auto_mesh)"], _ = round_contender(
        model, steps, params, cohort, k, Execution("auto"))
    loop = rt.loop_reference(model, fed, sizes, steps)
    fns["loop"] = lambda: loop(params)
    stats = alternate_stats(fns, args.trials)
    report(f"MLP K={k}: the cohort over {cores} CPU devices, one per core (no loss_before)",
           stats, flops)


def cmd_table(args):
    """Every strategy against the loop at each cohort, in one process."""
    cores = len(jax.local_devices(backend="cpu"))
    peak = max(roofline.matmul_rates((1024, 2048), seconds_per_size=1.0).values())
    step_rate = roofline.dense_step_rate(rt.BATCH, 784, 200)
    print(f"\n# matmul peak {peak / 1e9:.0f} GFLOP/s (best of 1024, 2048 square); layer-1 "
          f"SGD-step products at batch 20: {step_rate / 1e9:.0f} GFLOP/s; {cores} CPU "
          f"device(s) ({load_average()})")
    cohorts = [int(c) for c in args.cohorts.split(",")]
    for k in cohorts:
        steps = 10
        model, fed, params, cohort, sizes, flops = setup(k, steps)
        fns, note = {}, {}
        for name, execution in [("vmap", Execution("vmap")),
                                ("chunked (8)", Execution("chunked", 8)),
                                ("sequential", Execution("sequential")),
                                (f"auto -> {'sequential on ' + str(cores) + ' devices' if ex.auto_mesh(k) else ex.resolve('auto', k)[0]}",
                                 Execution("auto"))]:
            fns[name], c = round_contender(model, steps, params, cohort, k, execution)
            note[name] = f"compile {c:.1f} s"
        loop = rt.loop_reference(model, fed, sizes, steps)
        fns["loop"] = lambda loop=loop, params=params: loop(params)
        trials = args.trials or (9 if k <= 10 else 5 if k <= 100 else 2)
        stats = alternate_stats(fns, trials)
        print(f"\n## MLP K={k}, {steps} steps of {rt.BATCH} ({trials} trials; {load_average()})")
        print("| contender | best s | median s | x loop (best) | x loop (median) | CPU s | "
              "GFLOP/s | x floor | note |")
        print("|---|---|---|---|---|---|---|---|---|")
        lo_loop, med_loop = stats["loop"][0], stats["loop"][1]
        for n, (lo, med, c) in stats.items():
            print(f"| {n} | {lo:.4f} | {med:.4f} | {lo_loop / lo:.2f} | {med_loop / med:.2f} | "
                  f"{c:.4f} | {flops / lo / 1e9:.0f} | {lo / (flops / peak):.2f} | "
                  f"{note.get(n, '')} |", flush=True)


COMMANDS = {"kernels": cmd_kernels, "overhead": cmd_overhead, "threads": cmd_threads,
            "vmap": cmd_vmap, "auto": cmd_auto, "cores": cmd_cores, "table": cmd_table}
TRIALS = {"kernels": 0, "overhead": 7, "threads": 5, "vmap": 3, "auto": 21, "cores": 7,
          "table": 0}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=[*COMMANDS, "all"])
    ap.add_argument("--cohort", type=int, default=None)
    ap.add_argument("--cohorts", default="10,100,1000", help="table: comma-separated")
    ap.add_argument("--trials", type=int, default=None)
    ap.add_argument("--cpu-devices", type=int, default=None,
                    help="CPU devices to make before JAX starts (default: one per core for "
                         "table, cores and all; else 1)")
    args = ap.parse_args(argv)
    devices = args.cpu_devices or ((os.cpu_count() or 1)
                                   if args.what in ("table", "cores", "all") else 1)
    if devices > 1:
        jax.config.update("jax_num_cpu_devices", devices)
    print(rt.machine_line())
    todo = list(COMMANDS) if args.what == "all" else [args.what]
    for what in todo:
        a = argparse.Namespace(**vars(args))
        a.trials = args.trials or TRIALS[what] or None
        COMMANDS[what](a)


if __name__ == "__main__":
    main()
