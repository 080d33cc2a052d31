"""Shared timing helper of the benchmark scripts (imported as a sibling module)."""
from __future__ import annotations

import time

import jax


def timeit(fn, reps: int) -> float:
    """Fastest wall seconds of ``fn()`` over ``reps`` calls after one warm-up (the minimum
    is the least disturbed by other load on a shared machine)."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return best


def alternate_rounds(fns: dict, states: dict, cohort, trials: int, on_trial=None) -> dict:
    """Fastest seconds of one round per method, the methods alternating within each
    trial (the starting method rotates), so load on a shared machine hits all alike.

    ``fns[name](state, cohort, key) -> (state, metrics)`` is a compiled round that
    donates its state; ``states`` is updated in place with each method's last state.
    ``on_trial()`` runs after every trial (e.g. to record the load average)."""
    names = list(fns)
    best = {name: float("inf") for name in names}
    for trial in range(trials):
        order = names[trial % len(names):] + names[:trial % len(names)]
        for name in order:
            t = time.perf_counter()
            states[name], _ = fns[name](states[name], cohort, jax.random.key(trial + 1))
            jax.block_until_ready(states[name])
            best[name] = min(best[name], time.perf_counter() - t)
        if on_trial:
            on_trial()
    return best


def compile_rounds(algs: dict, params, num_clients: int, cohort):
    """(fns, states, info) for ``alternate_rounds``: each algorithm's round
    (``apply``) jitted with its state donated (tables updated in place), compiled for
    ``cohort``, and run once (warm-up). ``info[name]``: compile seconds and XLA's cost
    analysis (FLOPs and bytes accessed; a loop body counts once) and memory analysis
    (argument and temporary bytes) of the compiled round."""
    import jax.numpy as jnp
    fns, states, info = {}, {}, {}
    for name, alg in algs.items():
        states[name] = jax.tree.map(jnp.copy, alg.init(params, num_clients))  # own buffers
        t = time.perf_counter()
        fns[name] = jax.jit(lambda s, c, key, alg=alg: alg.apply(s, c, key),
                            donate_argnums=0).lower(states[name], cohort,
                                                    jax.random.key(0)).compile()
        ca = fns[name].cost_analysis()
        ca = ca[0] if isinstance(ca, list) else ca
        ma = fns[name].memory_analysis()
        info[name] = {"compile_s": time.perf_counter() - t,
                      "flops": float(ca.get("flops", 0.0)),
                      "bytes": float(ca.get("bytes accessed", 0.0)),
                      "argument_bytes": ma.argument_size_in_bytes if ma else 0,
                      "temp_bytes": ma.temp_size_in_bytes if ma else 0}
        states[name], _ = fns[name](states[name], cohort, jax.random.key(0))
        jax.block_until_ready(states[name])
    return fns, states, info


def alternate(fns: dict, trials: int, warmup: bool = True, on_trial=None,
              cpu: dict | None = None) -> dict:
    """Fastest wall seconds of each zero-argument callable in ``fns``, the callables
    alternating within each trial (the starting one rotates), so load on a shared
    machine hits all alike. ``fns[name]()`` may return JAX arrays (they are waited
    for) or, for a reference timed in another process, a float: the seconds that
    process measured itself (then that value is used; its ``cpu`` attribute, if any,
    is that process's CPU seconds). ``warmup``: call each once first, untimed.
    ``on_trial()`` runs after every trial. ``cpu``: if a dict, it receives each
    callable's fewest CPU seconds of a call (this process's user + system time, all
    threads: less sensitive than wall time to other jobs on the machine)."""
    names = list(fns)
    if warmup:
        for name in names:
            jax.block_until_ready(fns[name]())
    best = {name: float("inf") for name in names}
    best_cpu = {name: float("inf") for name in names}
    for trial in range(trials):
        k = trial % len(names)
        for name in names[k:] + names[:k]:
            c = time.process_time()
            t = time.perf_counter()
            out = jax.block_until_ready(fns[name]())
            seconds = time.perf_counter() - t
            cpu_s = time.process_time() - c
            if isinstance(out, float):
                seconds, cpu_s = float(out), getattr(out, "cpu", float("nan"))
            best[name] = min(best[name], seconds)
            if cpu_s < best_cpu[name]:  # (a NaN never is)
                best_cpu[name] = cpu_s
        if on_trial:
            on_trial()
    if cpu is not None:
        cpu.update({n: v if v < float("inf") else float("nan") for n, v in best_cpu.items()})
    return best


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages, e.g. "load 1.93 3.70 3.77" (other
    jobs on a shared machine; compare timings only within one run)."""
    try:
        import os
        return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except (OSError, AttributeError):
        return "load n/a"
