"""An on-disk federation's rounds with and without the background read of the next
chunk's cohorts (``RunSpec.prefetch``): how much of the read time it hides.

Run:   python benchmarks/prefetch.py                    # 100,000 clients (7.9 GB on disk)
       python benchmarks/prefetch.py --clients 2000 --cohort 100 --rounds 4   # smoke test

The federation is ``femnist_like`` (20 training and 5 test rows a writer),
procedural, written once with ``fedjax_fair.data.disk.write`` (what ``fedjax-fair
prepare`` does) to ``--dir``. Each measured run is a fresh process on a cold page
cache (the files' pages dropped with ``posix_fadvise(DONTNEED)`` first), FedAvg with
the MLP 784-200-200-62, cohorts of ``--cohort``, ``--rounds`` rounds in chunks of
``--eval-every``, one device, intermediate evaluations of 1,000 writers
(``eval_clients``). Prefetch off and on alternate, ``--pairs`` times.

Columns: the chunks' seconds (``RunResult.run_seconds``: drawing, reading and sending
the cohorts, and training; evaluation and compiling excluded), the seconds spent
reading the cohorts (drawing, announcing the reads to the kernel, gathering the rows
from the memory-mapped files and ``device_put``; in the background when
prefetching), the seconds the chunks waited for them (all of the reading without
prefetch; with it, the waits for a chunk read in the background, plus the first
chunk's read, which nothing can hide), and the share of the read time hidden: 1 -
waited / reading, and by the chunk times, (off - on) / reading off, which the
machine's noise in the training moves by more than the reading itself at this size.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import os
import platform
import subprocess
import sys
import time

_CHILD = r"""
import json, sys, time
import jax
from fedjax_fair import runner
from fedjax_fair.algorithms import build
from fedjax_fair.data import disk
from fedjax_fair.drivers import runner as R
from fedjax_fair.models import get_model

path, cohort, rounds, every, prefetch = sys.argv[1:6]
read = [0.0]
cohorts = R._RunLoop._cohorts
def timed(self, r0, length):
    t = time.perf_counter()
    try:
        return cohorts(self, r0, length)
    finally:
        read[0] += time.perf_counter() - t
R._RunLoop._cohorts = timed
waited = [0.0]  # the main thread waiting for a chunk's cohorts read in the background
class Timed:
    def __init__(self, future):
        self.future = future
    def result(self):
        t = time.perf_counter()
        try:
            return self.future.result()
        finally:
            waited[0] += time.perf_counter() - t
reader = R._reader
class Reader:
    def submit(self, *args):
        return Timed(reader().submit(*args))
R._reader = lambda: Reader()
ds = disk.read(path)
model = get_model("mlp", ds.input_shape, ds.num_classes)
alg = build("fedavg", model, client_lr=0.05, batch_size=20, num_epochs=1)
res = runner.run(alg, jax.jit(model.init)(jax.random.key(0)), ds.host_data,
                 jax.random.key(0), model=model, num_rounds=int(rounds),
                 cohort_size=int(cohort), eval_every=int(every),
                 eval_clients=min(1000, ds.num_clients),
                 progress=False, execution="chunked", prefetch=prefetch == "1")
print(json.dumps({"run_s": res.run_seconds, "read_s": read[0], "waited_s": waited[0],
                  "accuracy": res.history[-1]["accuracy_mean"]}))
"""


def drop_cache(directory: str) -> None:
    """Evicts the federation's files from the page cache (no root needed)."""
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def child(path: str, args, prefetch: bool) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
               JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    drop_cache(path)
    proc = subprocess.run([sys.executable, "-c", _CHILD, path, str(args.cohort),
                           str(args.rounds), str(args.eval_every), "1" if prefetch else "0"],
                          env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=100_000)
    p.add_argument("--cohort", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                 "fedjax_fair_bench", "femnist_like"))
    args = p.parse_args(argv)
    from fedjax_fair.data import disk, femnist_like
    path = f"{args.dir}_{args.clients}"
    if not os.path.exists(path):
        t = time.perf_counter()
        disk.write(femnist_like(num_clients=args.clients, min_examples=20, max_examples=20,
                                test_examples=5, procedural=True), path)
        print(f"prepared {path} in {time.perf_counter() - t:.1f}s")
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    import jax
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, jax {jax.__version__}; "
          f"{args.clients:,} writers, {size / 1e9:.1f} GB on disk; cohorts of {args.cohort:,}, "
          f"{args.rounds} rounds in chunks of {args.eval_every}\n")
    print("| pair | prefetch | chunks s | reading s | waited for reads s | hidden: 1 - waited / reading | hidden: (off - on) / reading off |")
    print("|---|---|---|---|---|---|---|")
    offs, ons = [], []
    for pair in range(args.pairs):
        off = child(path, args, False)
        on = child(path, args, True)
        offs.append(off)
        ons.append(on)
        waited = on["waited_s"] + _first_read(on, args)
        hidden = (off["run_s"] - on["run_s"]) / off["read_s"] if off["read_s"] else 0.0
        print(f"| {pair + 1} | off | {off['run_s']:.2f} | {off['read_s']:.2f} | "
              f"{off['read_s']:.2f} | | |")
        print(f"| {pair + 1} | on | {on['run_s']:.2f} | {on['read_s']:.2f} (background) | "
              f"{waited:.2f} | **{100 * (1 - waited / on['read_s']):.0f}%** | "
              f"{100 * hidden:.0f}% |", flush=True)
    med = lambda rows, k: float(np.median([r[k] for r in rows]))
    print(f"\nmedians: chunks {med(offs, 'run_s'):.2f} s off, {med(ons, 'run_s'):.2f} s on; "
          f"reading {med(offs, 'read_s'):.2f} s; hidden by the chunk times "
          f"{100 * (med(offs, 'run_s') - med(ons, 'run_s')) / med(offs, 'read_s'):.0f}%")


def _first_read(on: dict, args) -> float:
    """The first chunk's cohorts are read before anything runs (nothing to hide them
    behind): its share of the read time, counted as waited."""
    chunks = -(-args.rounds // args.eval_every)
    return on["read_s"] / chunks


if __name__ == "__main__":
    main()
