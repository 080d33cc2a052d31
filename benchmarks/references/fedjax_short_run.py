"""Reference: the short user job of benchmarks/short_run.py written with fedjax 0.0.17.

Run by fedjax 0.0.17's own interpreter (see fedjax_round.py for the virtual
environment), e.g.::

    .venv-fedjax/bin/python benchmarks/references/fedjax_short_run.py \
        --num-rounds 50 --cohort-size 50 --eval-every 10

The same job as ``fedjax-fair run --dataset femnist_like --model mlp --cohort-size 50``:

* data of femnist_like's shapes: 1000 clients, 50-200 train rows each (uniform), 10
  test rows each, 28x28x1 float32 inputs, 62 classes (random values: the job times
  shapes, not accuracy), held in a ``fedjax.InMemoryFederatedData``;
* the MLP 784-200-200-62 (``fedjax.models.emnist.create_dense_model``);
* FedAvg (``fedjax.algorithms.fed_avg``): client SGD at 0.02, one epoch of batches of
  10 per round (``ShuffleRepeatBatchHParams(batch_size=10, num_epochs=1)``, the last
  batch partial like ours), server SGD at 1.0, a uniform cohort of 50 per round
  (``UniformGetClientSampler``);
* every ``--eval-every`` rounds and at the end, every client's test accuracy with
  ``fedjax.ModelEvaluator.evaluate_global_params`` (the per-client evaluation a
  fairness study needs), summarised (mean, worst 10%) with NumPy.

Prints one line ``{"seconds": ..., "accuracy_mean": ...}`` (JSON) with the wall clock
from the start of the script (imports included) to the end of the last evaluation.
"""
from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402

import numpy as np  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-rounds", type=int, default=50)
    p.add_argument("--cohort-size", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--num-clients", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--client-lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    import fedjax
    import jax
    from fedjax.algorithms import fed_avg

    rng = np.random.default_rng(a.seed)
    sizes = rng.integers(50, 201, a.num_clients)
    train, test = {}, {}
    for k, n in enumerate(sizes):
        cid = f"{k:06d}".encode()
        train[cid] = {"x": rng.standard_normal((n, 28, 28, 1), dtype=np.float32),
                      "y": rng.integers(0, 62, n).astype(np.int32)}
        test[cid] = {"x": rng.standard_normal((10, 28, 28, 1), dtype=np.float32),
                     "y": rng.integers(0, 62, 10).astype(np.int32)}
    train_fd = fedjax.InMemoryFederatedData(train)
    test_fd = fedjax.InMemoryFederatedData(test)

    model = fedjax.models.emnist.create_dense_model(only_digits=False, hidden_units=200)
    grad_fn = fedjax.model_grad(model)
    hparams = fedjax.ShuffleRepeatBatchHParams(batch_size=a.batch_size, num_epochs=1,
                                               drop_remainder=False)
    algorithm = fed_avg.federated_averaging(
        grad_fn, fedjax.optimizers.sgd(learning_rate=a.client_lr),
        fedjax.optimizers.sgd(learning_rate=1.0), hparams)
    state = algorithm.init(model.init(jax.random.PRNGKey(a.seed)))
    sampler = fedjax.client_samplers.UniformGetClientSampler(
        train_fd, num_clients=a.cohort_size, seed=a.seed)
    evaluator = fedjax.ModelEvaluator(model)
    test_batches = [(cid, ds.padded_batch(batch_size=10))
                    for cid, ds in test_fd.clients()]

    def evaluate(params) -> dict:
        acc = np.array([float(m["accuracy"]) for _, m in
                        evaluator.evaluate_global_params(params, test_batches)])
        k = max(1, int(np.floor(0.1 * acc.size)))
        return {"accuracy_mean": float(acc.mean()),
                "accuracy_worst_10%": float(np.sort(acc)[:k].mean())}

    t_setup = time.perf_counter()
    eval_s = 0.0

    def timed_evaluate(params):
        nonlocal eval_s
        t = time.perf_counter()
        out = evaluate(params)
        eval_s += time.perf_counter() - t
        return out

    history = [{"round": 0, **timed_evaluate(state.params)}]
    for r in range(1, a.num_rounds + 1):
        state, _ = algorithm.apply(state, sampler.sample())
        if r % a.eval_every == 0 or r == a.num_rounds:
            history.append({"round": r, **timed_evaluate(state.params)})
    jax.block_until_ready(state.params)
    end = time.perf_counter()
    print(json.dumps({"seconds": end - T0, "setup_seconds": t_setup - T0,
                      "rounds_seconds": end - t_setup - eval_s, "eval_seconds": eval_s,
                      **history[-1], "evaluations": len(history)}))


if __name__ == "__main__":
    main()
