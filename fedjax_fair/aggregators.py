"""Aggregators: stacked client deltas [K, ...] + mixing weights [K] -> one direction.

An ``Aggregator`` is a pair of pure functions (optax style):
``init(params) -> state`` and
``aggregate(state, deltas, weights, outputs) -> (direction, state)``, where
``deltas`` is a pytree with leading axis K, ``weights`` [K] are on the simplex
(zero for masked-out clients) and ``outputs`` is the stacked ``ClientOutput`` for
rules that need more than the deltas. The server optimizer then treats
``direction`` as a pseudo-gradient.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp


class Aggregator(NamedTuple):
    init: Callable
    aggregate: Callable


def weighted_sum(tree, weights):
    """sum_k weights[k] * tree[k] for every leaf (leading axis K)."""
    return jax.tree.map(lambda x: jnp.tensordot(weights.astype(x.dtype), x, axes=1), tree)


def weighted_mean() -> Aggregator:
    """Delta = sum_k p_k Delta_k (FedAvg, McMahan et al. 2017; p from a MixingRule)."""

    def init(params):
        del params
        return ()

    def aggregate(state, deltas, weights, outputs=None):
        del outputs
        return weighted_sum(deltas, weights), state

    return Aggregator(init, aggregate)
