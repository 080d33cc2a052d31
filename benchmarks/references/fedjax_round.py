"""Reference: one FedAvg round of fedjax 0.0.17, written the way a fedjax user writes it.

fedjax 0.0.17 pins an old JAX, so it lives in its own virtual environment:

    python -m venv .venv-fedjax
    .venv-fedjax/bin/pip install fedjax==0.0.17 jax==0.4.30 jaxlib==0.4.30 \
        dm-haiku==0.0.12 optax==0.2.2 "numpy<2" "scipy<1.14" "ml_dtypes<0.5"

benchmarks/round_throughput.py runs this file with that interpreter (``FEDJAX_PYTHON``,
default ``.venv-fedjax/bin/python`` when it exists) in a subprocess (protocol.py) and
skips it with a note otherwise. Alone: ``.venv-fedjax/bin/python
benchmarks/references/fedjax_round.py JOB.json`` (then type "round" lines).

The job (job.py): the same network as haiku modules (``fedjax.models.emnist``'s
``create_logistic_model`` / ``create_dense_model`` when their shapes match, else the
same layers written with haiku, e.g. the LEAF CNN with 5x5 'SAME' convolutions), the
initial parameters copied from the job's .npz, FedAvg from
``fedjax.algorithms.fed_avg.federated_averaging`` with ``fedjax.model_grad``, SGD
client and server optimizers, and ``ShuffleRepeatBatchHParams(batch_size=B,
num_steps=S)`` (each client: S batches of B rows, reshuffled every pass over its
data), over a fixed cohort of K clients from an ``InMemoryFederatedData``.
``federated_averaging`` runs the clients with ``fedjax.for_each_client`` (its jit
backend: jitted client init, step and final, the step state donated) and averages
the deltas weighted by n_k. One round = one ``algorithm.apply(server_state, clients)``.
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import job as J  # noqa: E402
import protocol  # noqa: E402


def build_model(job):
    import fedjax
    import haiku as hk
    import jax

    classes = job["num_classes"]
    loss = lambda batch, preds: fedjax.metrics.unreduced_cross_entropy_loss(batch["y"], preds)
    sample = {"x": np.zeros((1, *job["input_shape"]), np.float32),
              "y": np.zeros((1,), np.int32)}
    hidden = list(job.get("hidden", []))
    if job["model"] == "logreg":
        return fedjax.models.emnist.create_logistic_model(only_digits=classes == 10)
    if job["model"] == "mlp" and len(hidden) == 2 and hidden[0] == hidden[1] and classes == 62:
        return fedjax.models.emnist.create_dense_model(only_digits=False,
                                                       hidden_units=hidden[0])
    if job["model"] == "mlp":
        def forward(batch):
            x = hk.Flatten()(batch["x"])
            for h in hidden:
                x = jax.nn.relu(hk.Linear(h)(x))
            return hk.Linear(classes)(x)
    else:  # the LEAF FEMNIST CNN of fedjax_fair.models.cnn
        ch1, ch2 = job["channels"]

        def forward(batch):
            x = batch["x"]
            for c in (ch1, ch2):
                x = jax.nn.relu(hk.Conv2D(c, kernel_shape=5, padding="SAME")(x))
                x = hk.MaxPool(window_shape=(1, 2, 2, 1), strides=(1, 2, 2, 1),
                               padding="VALID")(x)
            x = hk.Flatten()(x)
            x = jax.nn.relu(hk.Linear(job["dense"])(x))
            return hk.Linear(classes)(x)
    return fedjax.create_model_from_haiku(transformed_forward_pass=hk.transform(forward),
                                          sample_batch=sample, train_loss=loss)


def initial_params(model, job):
    """The model's haiku parameters with the job's initial values (layers in order)."""
    import jax
    p = dict(np.load(job["params_file"]))
    params = jax.tree_util.tree_map(np.asarray, model.init(jax.random.PRNGKey(0)))
    ours = J.layer_names(p, "Conv_") + J.layer_names(p, "Dense_")
    theirs = sorted(params, key=lambda s: (not s.startswith("conv"), len(s), s))
    if len(ours) != len(theirs):
        raise ValueError(f"layers differ: {ours} vs {theirs}")
    out = {}
    for a, b in zip(ours, theirs):
        w, bias = p[a + "/kernel"], p[a + "/bias"]
        if params[b]["w"].shape != w.shape:
            raise ValueError(f"{a} {w.shape} vs {b} {params[b]['w'].shape}")
        out[b] = {"w": w, "b": bias}
    return out


def setup(job):
    import fedjax
    import jax
    from fedjax.algorithms import fed_avg

    x, y = J.synthetic_data(job)
    y = y.astype(np.int32)
    base, sizes = job["base_clients"], job["sizes"]
    clients_data = {f"{k:06d}".encode(): {"x": x[k % base, :n], "y": y[k % base, :n]}
                    for k, n in enumerate(sizes)}
    fd = fedjax.InMemoryFederatedData(clients_data)
    model = build_model(job)
    grad_fn = fedjax.model_grad(model)
    client_optimizer = fedjax.optimizers.sgd(learning_rate=job["lr"])
    server_optimizer = fedjax.optimizers.sgd(learning_rate=1.0)
    hparams = fedjax.ShuffleRepeatBatchHParams(batch_size=job["batch"], num_epochs=None,
                                               num_steps=job["steps"])
    algorithm = fed_avg.federated_averaging(grad_fn, client_optimizer, server_optimizer,
                                            hparams)
    state = {"server": algorithm.init(initial_params(model, job))}
    rng = jax.random.PRNGKey(0)
    ids = list(clients_data)
    clients = [(cid, fd.get_client(cid), jax.random.fold_in(rng, i))
               for i, cid in enumerate(ids)]

    def one_round(cohort=clients):
        state["server"], _ = algorithm.apply(state["server"], cohort)
        jax.block_until_ready(state["server"].params)

    import time
    t = time.perf_counter()
    one_round(clients[:2])  # warm-up: compiles client init / step / final
    compile_s = time.perf_counter() - t
    d = sum(v.size for v in jax.tree_util.tree_leaves(state["server"].params))
    return one_round, {"params": int(d), "first_round_s": compile_s, "jax": jax.__version__}


if __name__ == "__main__":
    import fedjax  # noqa: F401  (imported once, before the first job)
    import haiku  # noqa: F401
    protocol.serve(setup)
