"""FedAvg round time of this checkout against an earlier commit, side by side in one run.

Run:   python benchmarks/contract_overhead.py                    (baseline: 4a52cbd, the
                                                                  last commit before the
                                                                  round contract of issue 8)
       python benchmarks/contract_overhead.py --baseline COMMIT --reps 7

The baseline is checked out into a temporary ``git worktree``; each configuration is
timed in a fresh subprocess per version, the two versions alternating ``--trials``
times, and the table reports the fastest round of each (the minimum is the least
disturbed by other load) and their ratio. The workload: FedAvg with local SGD on
FEMNIST-shaped clients (784 inputs, 62 classes, 50-200 examples, batch 20, one
epoch), one jitted round (``apply``) over a fixed cohort, for an MLP 784-200-200-62
and logistic regression, with the ``sequential`` (CPU default) and ``vmap`` strategies.
XLA's cost analysis of both compiled rounds (flops, bytes accessed; it counts a loop
body once) is printed as a noise-free check that the two programs do the same work.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

BASELINE = "4a52cbd"

WORKER = r'''
import functools, inspect, json, sys, time
import jax, jax.numpy as jnp, numpy as np
from fedjax_fair.algorithms import fedavg
from fedjax_fair.data import federate
from fedjax_fair.models import logistic_regression, mlp
from fedjax_fair.drivers.simulate import make_cohort

model_name, strategy, cohort_size, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rng = np.random.default_rng(0)
sizes = rng.integers(50, 201, 200)
x = rng.normal(size=(int(sizes.sum()), 784)).astype(np.float32)
y = rng.integers(0, 62, int(sizes.sum())).astype(np.int32)
ds = federate(x, y, name="bench", num_classes=62, num_clients=200, partition="iid", seed=0,
              test_fraction=0.1)
model = (mlp((784,), 62, hidden=(200, 200)) if model_name == "mlp"
         else logistic_regression((784,), 62))
params = jax.jit(model.init)(jax.random.key(0))
data = ds.data
cohort = make_cohort(data, jnp.arange(cohort_size, dtype=jnp.int32))
parameters = inspect.signature(fedavg).parameters
training = ({"training": __import__("fedjax_fair").ClientTraining(lr=0.05, batch_size=20)}
            if "training" in parameters else dict(client_lr=0.05, batch_size=20))
if "execution" in parameters:  # the old contract
    alg = fedavg(model, execution=strategy, **training)
    apply = alg.apply
else:
    alg = fedavg(model, **training)
    apply = functools.partial(alg.apply, execution=strategy)
state = alg.init(params, data.num_clients)
fn = jax.jit(apply).lower(state, cohort, jax.random.key(0)).compile()
cost = fn.cost_analysis()
cost = cost[0] if isinstance(cost, list) else cost
jax.block_until_ready(fn(state, cohort, jax.random.key(0)))
best = float("inf")
for r in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(state, cohort, jax.random.key(r)))
    best = min(best, time.perf_counter() - t)
print(json.dumps({"seconds": best, "flops": float(cost.get("flops", 0.0)),
                  "bytes": float(cost.get("bytes accessed", 0.0))}))
'''


def time_version(root: str, args) -> dict:
    """{"seconds": fastest round, "flops", "bytes": XLA's cost analysis of the round}."""
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", WORKER, *map(str, args)], cwd=root, env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default=BASELINE)
    ap.add_argument("--reps", type=int, default=5, help="timed rounds per subprocess")
    ap.add_argument("--trials", type=int, default=3, help="alternating subprocesses per version")
    ap.add_argument("--cohort", type=int, default=50)
    ap.add_argument("--configs", default="mlp:sequential,mlp:vmap,logreg:sequential,logreg:vmap")
    args = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    import jax
    print(f"# {platform.processor() or platform.machine()} | {os.cpu_count()} cores | "
          f"jax {jax.__version__} | {jax.devices()[0]} | cohort {args.cohort} | "
          f"baseline {args.baseline} vs working tree")
    print("| model | strategy | baseline s/round | new s/round | new / baseline | "
          "XLA flops new / baseline | XLA bytes new / baseline |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        old = os.path.join(tmp, "baseline")
        subprocess.run(["git", "worktree", "add", "--detach", old, args.baseline], cwd=here,
                       check=True, capture_output=True)
        try:
            for config in args.configs.split(","):
                model, strategy = config.split(":")
                worker_args = (model, strategy, args.cohort, args.reps)
                old_s, new_s = float("inf"), float("inf")
                for _ in range(args.trials):
                    old_r, new_r = time_version(old, worker_args), time_version(here, worker_args)
                    old_s, new_s = min(old_s, old_r["seconds"]), min(new_s, new_r["seconds"])
                ratio = lambda k: new_r[k] / old_r[k] if old_r[k] else float("nan")
                print(f"| {model} | {strategy} | {old_s:.4f} | {new_s:.4f} | "
                      f"{new_s / old_s:.3f} | {ratio('flops'):.4f} | {ratio('bytes'):.4f} |",
                      flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", old], cwd=here,
                           capture_output=True)


if __name__ == "__main__":
    main()
