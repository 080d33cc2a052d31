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
