"""The machine's measured rates and the roofline floor of a federated round.

Used by ``benchmarks/round_throughput.py``; run alone it prints the rates:

    python benchmarks/roofline.py            (matmul sizes and the copy-bandwidth sweep)

* Matmul rate: the fastest f32 ``x @ y`` over several square sizes (512 ... 4096 on
  CPU), each the best of many calls. Short products reach the machine's peak even
  when other jobs share it; the largest one shows the sustained rate under that load.
  The floor uses the peak, so no timing can come out below it.
* Copy bandwidth at a working-set size S: a buffer of S bytes updated in place
  (``x = x * a + b``, read + written: 2 S bytes a pass) many times, one pass per
  iteration of a compiled loop and, separately, by NumPy; the faster of the two, best
  of several calls (``copy_bandwidth``). A sweep over S from L1- to DRAM-sized shows
  where the data live: on the 2-core Xeon of docs/performance.md (L2 2 MiB a core),
  buffers up to a few MiB move at 50-90 GB/s, a 1 GiB buffer at 15-20 GB/s (memory).

The floor of a round (``floor``): max(FLOPs / matmul rate, bytes / bandwidth at the
working set), where the bytes are every client's parameters read and written and its
gradients written and read at every local step (16 bytes a parameter a step), plus
its batches, and the working set is what must stay resident while they move: one
client's (parameters, gradients, optimiser state, one batch and its activations)
when clients run one after another, ``c`` clients' when ``c`` of them are vmapped
together (the whole cohort under ``vmap``). ``bandwidth_at`` reads the sweep at the
largest measured size not above the working set, and takes no less than any larger
size measured (bandwidth never grows with size, so a lower reading is noise): the
floor errs low, never high.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

KiB, MiB, GiB = 2 ** 10, 2 ** 20, 2 ** 30
CPU_MATMUL_SIZES = (512, 1024, 2048, 4096)
ACCEL_MATMUL_SIZES = (2048, 4096, 8192)
SWEEP_SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 2 * MiB, 4 * MiB, 16 * MiB, 64 * MiB,
               256 * MiB, 1 * GiB)
QUICK_SWEEP_SIZES = (256 * KiB, 1 * MiB, 4 * MiB, 64 * MiB, 1 * GiB)


class Rates(NamedTuple):
    """matmul_flops: peak f32 matmul FLOP/s; matmul_by_size: {n: FLOP/s};
    bandwidth: {bytes: bytes/s read + written} (the sweep)."""

    matmul_flops: float
    matmul_by_size: dict
    bandwidth: dict

    def bandwidth_at(self, working_set: float) -> float:
        """Copy bandwidth (bytes/s) for a working set of ``working_set`` bytes."""
        sizes = sorted(self.bandwidth)
        below = [s for s in sizes if s <= working_set]
        start = below[-1] if below else sizes[0]
        return max(self.bandwidth[s] for s in sizes if s >= start)

    def merge(self, other: "Rates") -> "Rates":
        """The larger of two measurements (e.g. the start and the end of a run)."""
        mm = {n: max(self.matmul_by_size.get(n, 0.0), other.matmul_by_size.get(n, 0.0))
              for n in set(self.matmul_by_size) | set(other.matmul_by_size)}
        bw = {s: max(self.bandwidth.get(s, 0.0), other.bandwidth.get(s, 0.0))
              for s in set(self.bandwidth) | set(other.bandwidth)}
        return Rates(max(mm.values()), mm, bw)

    def to_json(self) -> dict:
        return {"matmul_flops": self.matmul_flops,
                "matmul_by_size": {str(k): v for k, v in self.matmul_by_size.items()},
                "bandwidth": {str(k): v for k, v in self.bandwidth.items()}}

    def describe(self) -> str:
        mm = ", ".join(f"{n}: {r / 1e9:.0f}" for n, r in sorted(self.matmul_by_size.items()))
        bw = ", ".join(f"{_size(s)}: {b / 1e9:.0f}" for s, b in sorted(self.bandwidth.items()))
        return (f"# matmul peak {self.matmul_flops / 1e9:.0f} GFLOP/s (by size, GFLOP/s: {mm})\n"
                f"# copy bandwidth by working set (GB/s, read + write): {bw}")


def _size(s: float) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if s >= unit:
            return f"{s / unit:g} {name}"
    return f"{s:g} B"


def _best(fn, calls: int, max_seconds: float) -> float:
    jax.block_until_ready(fn())
    best, start = float("inf"), time.perf_counter()
    for i in range(calls):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() - start > max_seconds and i >= 2:
            break
    return best


def matmul_rates(sizes=None, seconds_per_size: float = 1.5) -> dict:
    """{n: best f32 FLOP/s of an n x n by n x n product}; the smaller sizes get
    twice the time (their best call is the one that ran without interruption)."""
    if sizes is None:
        sizes = CPU_MATMUL_SIZES if jax.default_backend() == "cpu" else ACCEL_MATMUL_SIZES
    out = {}
    mm = jax.jit(jnp.matmul)
    for n in sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
        b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
        seconds = seconds_per_size * (2 if n <= 1024 else 1)
        out[n] = 2 * n ** 3 / _best(lambda: mm(a, b), 1000, seconds)
    return out


def dense_step_rate(batch: int, d_in: int, d_out: int, seconds: float = 1.0) -> float:
    """Best FLOP/s of one dense layer's SGD-step products at ``batch`` rows: the
    forward ``x @ W`` and the two backward ``dy @ W.T`` and ``x.T @ dy`` (6 * batch
    * d_in * d_out FLOPs), in one compiled call. With batch 20 this is the rate a
    client's local step can reach at best, well below the large-matmul peak: the
    diagnostic beside the floor, which uses the peak."""
    x = jax.random.normal(jax.random.key(0), (batch, d_in), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (d_in, d_out), jnp.float32)
    dy = jax.random.normal(jax.random.key(2), (batch, d_out), jnp.float32)
    f = jax.jit(lambda x, w, dy: (x @ w, dy @ w.T, x.T @ dy))
    return 6 * batch * d_in * d_out / _best(lambda: f(x, w, dy), 2000, seconds)


def copy_bandwidth(nbytes: int, seconds: float = 0.6, bytes_per_call: float = 2e9) -> float:
    """Best bytes/s (read + written) of in-place passes ``x = x * a + b`` over a buffer
    of ``nbytes``, the faster of two ways of running them:

    * XLA: one pass per iteration of a compiled ``fori_loop`` (a loop body is its own
      computation, so passes cannot fuse: several passes written in one body are fused
      into one by XLA, optimisation barriers or not, which would count each byte
      several times);
    * NumPy: ``np.multiply(x, a, out=x)`` in a Python loop (one thread; XLA:CPU's
      elementwise kernels are slower than this on buffers of a few hundred KiB).
    """
    n = max(1, nbytes // 4)
    iters = max(1, int(bytes_per_call // (2 * 4 * n)))
    loop = jax.jit(lambda x: jax.lax.fori_loop(0, iters, lambda _, v: v * 1.0001 - 1e-7, x),
                   donate_argnums=0)
    state = {"x": jnp.ones((n,), jnp.float32)}

    def xla():
        state["x"] = loop(state["x"])
        return state["x"]

    x = np.ones((n,), np.float32)
    np_iters = min(iters, 4000)

    def numpy():
        for _ in range(np_iters):
            np.multiply(x, 1.0001, out=x)

    return max(2 * 4 * n * iters / _best(xla, 50, seconds),
               2 * 4 * n * np_iters / _best(numpy, 50, seconds))


def measure(quick: bool = False, sweep=None, matmul_sizes=None) -> Rates:
    """Matmul rates and the copy-bandwidth sweep of this machine, now (``quick``:
    fewer sizes, shorter)."""
    if matmul_sizes is None and quick and jax.default_backend() == "cpu":
        matmul_sizes = (512, 2048)
    mm = matmul_rates(matmul_sizes, seconds_per_size=0.5 if quick else 1.5)
    sizes = sweep or (QUICK_SWEEP_SIZES if quick else SWEEP_SIZES)
    bw = {s: copy_bandwidth(s, 0.2 if quick else 0.6, 1e9 if quick else 2e9) for s in sizes}
    return Rates(max(mm.values()), mm, bw)


def step_working_set(step_fn, *args) -> int:
    """Bytes one jitted local step touches: its arguments (parameters, optimiser
    state, batch), outputs and XLA's temporaries (gradients, activations), from the
    compiled step's memory analysis."""
    ma = jax.jit(step_fn).lower(*args).compile().memory_analysis()
    if ma is None:  # a backend without memory analysis: parameters and gradients
        return 2 * sum(4 * x.size for x in jax.tree.leaves(args))
    return int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
               - ma.alias_size_in_bytes)


def floor(flops: float, moved_bytes: float, working_set: float, rates: Rates) -> dict:
    """The roofline floor in seconds and its two terms."""
    bandwidth = rates.bandwidth_at(working_set)
    compute_s = flops / rates.matmul_flops
    memory_s = moved_bytes / bandwidth
    return {"floor_s": max(compute_s, memory_s), "compute_s": compute_s, "memory_s": memory_s,
            "bandwidth": bandwidth, "working_set": working_set,
            "bound": "flops" if compute_s >= memory_s else "bytes"}


def main():
    import argparse
    import sys
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from timing import load_average
    print(f"# {load_average()}")
    rates = measure(args.quick)
    print(rates.describe())
    print(f"# {load_average()}")


if __name__ == "__main__":
    main()
