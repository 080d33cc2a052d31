"""Issue 14's accelerator targets, one FedAvg round each, on whatever device JAX has.

Run:   python benchmarks/gpu_targets.py            (on a GPU)
       python benchmarks/gpu_targets.py --quick    (small shapes: a smoke test on a CPU)

Jobs (random data of the papers' shapes; every row real; one round of ``simulate``
compiled once, then timed: minimum of ``--reps`` runs):

* ``femnist_cnn``: the LEAF FEMNIST CNN (``models.cnn``, 28x28x1, 62 classes), FedAvg,
  a cohort of ``--cohort`` (1,000) clients, one epoch of 20 rows in batches of 20 (one
  local step, as ``round_throughput.py``'s CNN job). Target: under 1 s a round on one
  H100.
* ``resnet18_gn``: ResNet-18 with GroupNorm (``models.resnet18_gn``, CIFAR stem,
  32x32x3, 10 classes), FedAvg, 10 clients x 50 local steps of batch 50. Target: at
  least 10x the 15.9 s a round the authors' sequential PyTorch simulator took on a V100
  (issue 14), i.e. under 1.59 s.

Each job runs under ``vmap`` (``auto`` on an accelerator) and ``sequential``, and
prints s/round, client updates a second and compile seconds.
"""
from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.core.execution import Execution
from fedjax_fair.models import cnn
from fedjax_fair.models.resnet import resnet18_gn
from fedjax_fair.drivers.simulate import simulate
from fedjax_fair.core.types import ClientData, FederatedData
from fedjax_fair.core.client import ClientTraining


def federation(clients: int, rows: int, shape, classes: int) -> FederatedData:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(clients, rows, *shape)).astype(np.float32)
    y = rng.integers(0, classes, size=(clients, rows)).astype(np.int32)
    split = ClientData({"x": x, "y": y}, np.ones((clients, rows), bool),
                       np.full((clients,), rows, np.int32))
    return FederatedData(train=split, test=split)


def time_round(model, data, cohort: int, batch: int, strategy: str, reps: int):
    alg = fedavg(model, training=ClientTraining(lr=0.05, batch_size=batch, num_epochs=1))
    params = model.init(jax.random.key(0))
    state = alg.init(params, data.train.mask.shape[0])
    data = jax.device_put(data)
    fn = jax.jit(lambda s, d, k: simulate(alg, s, d, k, num_rounds=1, cohort_size=cohort,
                                          execution=Execution(strategy)))
    t = time.perf_counter()
    compiled = fn.lower(state, data, jax.random.key(0)).compile()
    compile_s = time.perf_counter() - t
    jax.block_until_ready(compiled(state, data, jax.random.key(0)))
    best = float("inf")
    for rep in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(compiled(state, data, jax.random.key(rep + 1)))
        best = min(best, time.perf_counter() - t)
    return best, compile_s


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cohort", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--strategies", default="vmap,sequential")
    ap.add_argument("--jobs", default="femnist_cnn,resnet18_gn")
    args = ap.parse_args()
    cohort = 8 if args.quick else args.cohort
    resnet_steps, resnet_batch = (2, 4) if args.quick else (50, 50)
    jobs = {
        "femnist_cnn": (lambda: cnn((28, 28, 1), 62),
                        federation(cohort, 20, (28, 28, 1), 62), cohort, 20, 1),
        "resnet18_gn": (lambda: resnet18_gn((32, 32, 3), 10),
                        federation(10, resnet_steps * resnet_batch, (32, 32, 3), 10), 10,
                        resnet_batch, resnet_steps),
    }
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}")
    print("\n| job | clients | local steps x batch | strategy | s/round | client updates/s "
          "| compile s |")
    print("|---|---|---|---|---|---|---|")
    for name in args.jobs.split(","):
        make, data, k, batch, steps = jobs[name]
        model = make()
        for strategy in args.strategies.split(","):
            s, c = time_round(model, data, k, batch, strategy, args.reps)
            print(f"| {name} | {k} | {steps} x {batch} | {strategy} | {s:.4f} | "
                  f"{k / s:,.0f} | {c:.1f} |", flush=True)


if __name__ == "__main__":
    main()
