"""Reference: FedAvg rounds of fedjax 0.0.17 over a federation of N clients held the
way fedjax holds one (``fedjax.InMemoryFederatedData``: a dict of per-client NumPy
arrays), cohorts drawn each round by ``fedjax.client_samplers.UniformGetClientSampler``.

Run with fedjax's own interpreter (benchmarks/references/fedjax_round.py says how to
make ``.venv-fedjax``); ``benchmarks/million_clients.py --fedjax`` runs it:

    .venv-fedjax/bin/python benchmarks/references/fedjax_scale.py N COHORT ROUNDS

Every client has 20 FEMNIST-shaped rows (28x28x1 float32, 62 classes), the model is
``fedjax.models.emnist.create_dense_model(hidden_units=200)`` (784-200-200-62), one
local step of batch 20 at rate 0.05, server SGD at rate 1. Prints one JSON line: the
seconds to build the federation, the mean round over ``ROUNDS`` rounds after a first
(compiling) one, and the process's peak RSS.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        d = dict(line.split(":", 1) for line in f)
    return int(d["VmHWM"].split()[0]) * 1024


def main(n: int, cohort: int, rounds: int) -> dict:
    import fedjax
    import jax
    from fedjax.algorithms import fed_avg

    t = time.perf_counter()
    rng = np.random.default_rng(0)
    data = {}
    for k in range(n):  # per-client arrays, as a fedjax user's federation holds them
        data[f"{k:07d}".encode()] = {
            "x": rng.standard_normal((20, 28, 28, 1), dtype=np.float32),
            "y": rng.integers(0, 62, 20).astype(np.int32)}
    fd = fedjax.InMemoryFederatedData(data)
    build_s = time.perf_counter() - t
    model = fedjax.models.emnist.create_dense_model(only_digits=False, hidden_units=200)
    algorithm = fed_avg.federated_averaging(
        fedjax.model_grad(model), fedjax.optimizers.sgd(0.05), fedjax.optimizers.sgd(1.0),
        fedjax.ShuffleRepeatBatchHParams(batch_size=20, num_epochs=None, num_steps=1))
    state = algorithm.init(model.init(jax.random.PRNGKey(0)))
    sampler = fedjax.client_samplers.UniformGetClientSampler(fd, num_clients=cohort, seed=0)
    times = []
    for r in range(rounds + 1):
        t = time.perf_counter()
        state, _ = algorithm.apply(state, sampler.sample())
        jax.block_until_ready(state.params)
        times.append(time.perf_counter() - t)
    return {"build_s": build_s, "round_s": float(np.mean(times[1:])),
            "first_round_s": times[0], "peak_rss": peak_rss(), "jax": jax.__version__}


if __name__ == "__main__":
    print(json.dumps(main(*map(int, sys.argv[1:4]))))
