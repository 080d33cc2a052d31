"""Shared pieces of the FedHEAL and FedLF tests (tests/test_fedheal.py,
tests/test_fedlf.py): the two algorithm modules, the local-training constants, round
contexts and client outputs, and a jitted ``apply``."""
from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair.core.types import ClientOutput, ServerContext

# the package exports the factories under the modules' names
FH = importlib.import_module("fedjax_fair.algorithms.fedheal")
FL = importlib.import_module("fedjax_fair.algorithms.fedlf")

LR = 0.3
EPOCHS = 2
FULL_BATCH = 16  # >= every client's size: one full-batch GD step per epoch


def _ctx(ids, mask, round_=0):
    return ServerContext(params=(), round=jnp.int32(round_), key=jax.random.key(0),
                         client_ids=jnp.asarray(ids, jnp.int32),
                         client_mask=jnp.asarray(mask, bool))


def _out(delta, losses, n, extra=()):
    losses = jnp.asarray(losses, jnp.float32)
    return ClientOutput(delta=delta, loss_before=losses,
                        num_examples=jnp.asarray(n, jnp.int32),
                        num_steps=jnp.ones(losses.shape, jnp.int32), extra=extra,
                        train_loss=losses)


def _np_leaves(tree):
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


def _logreg_loss_numpy(w, b, x, y):
    if len(y) == 0:
        return 0.0
    logits = np.asarray(x, np.float64) @ w + b
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(y)), y].mean())


def _jit_apply(alg, execution="sequential"):
    return jax.jit(lambda s, c, k: alg.apply(s, c, k, execution))


def check_vmap_equals_sequential_and_accuracy_rises(name: str) -> None:
    """On a synthetic federation (6 clients, power-law sizes, cohorts of 3): both
    strategies give the same parameters, everything stays finite, and accuracy rises.
    (FedLF with local training and no history rows here; its gradient client and
    history rows run in the round-by-round reference test.)"""
    import helpers
    from fedjax_fair.core.client import ClientTraining
    from fedjax_fair.drivers.simulate import simulate
    from fedjax_fair.data import get_dataset
    from fedjax_fair.models import logistic_regression
    ds = get_dataset("synthetic", num_clients=6, max_examples=60)
    model = logistic_regression(ds.input_shape, ds.num_classes)
    params = helpers.init_params(model, 0)
    training = ClientTraining(lr=0.1, batch_size=10)
    alg = (FH.fedheal(model, training=training) if name == "fedheal"
           else FL.fedlf(model, server_lr=0.5, client_gradient="pseudo", training=training,
                         history=False))
    x, y = helpers.real_rows(ds.data.test, range(6))

    def accuracy(p):  # over every test row
        w, b = helpers.logreg_to_numpy(p)
        return float(np.mean(np.argmax(x @ w + b, -1) == y))

    outs = {}
    for execution in ("vmap", "sequential"):
        state = alg.init(params, 6)
        outs[execution], metrics = simulate(alg, state, ds.data, jax.random.key(1),
                                            num_rounds=12, cohort_size=3,
                                            execution=execution)
        assert helpers.tree_all_finite(outs[execution].params)
        assert all(np.all(np.isfinite(np.asarray(v))) for v in metrics.values())
    helpers.assert_trees_close(outs["vmap"].params, outs["sequential"].params, rtol=2e-4,
                               atol=1e-5)
    start, end = accuracy(params), accuracy(outs["sequential"].params)
    assert end > start + 0.3, (start, end)
