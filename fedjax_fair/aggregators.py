"""Aggregators: the cohort's outputs + mixing weights [K] -> one direction.

An ``Aggregator`` is a pair of pure functions (optax style):
``init(params, num_clients) -> state`` and
``aggregate(state, outputs, weights, ctx) -> (direction, state, info)``, where
``outputs`` is the stacked ``ClientOutput`` (``outputs.delta`` a pytree with leading
axis K, plus losses, counts and the method's ``extra``), ``weights`` [K] are on the
simplex (zero for masked-out clients) and ``ctx`` is the round's ``ServerContext``
(server parameters, round, server key, ids, mask). The state may be anything the
server keeps between rounds (SCAFFOLD's control variate, FedDyn's h, a previous
model). ``info`` is a dict of fixed-shape diagnostics (per-client values [K], e.g.
q-FFL's effective coefficients), logged with the round's metrics. The server
optimizer then treats ``direction`` as a pseudo-gradient.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp


class Aggregator(NamedTuple):
    init: Callable
    aggregate: Callable


def stateless(direction_fn: Callable) -> Aggregator:
    """An ``Aggregator`` from ``direction_fn(outputs, weights, ctx) -> (direction,
    info)`` that keeps no state."""

    def init(params, num_clients):
        del params, num_clients
        return ()

    def aggregate(state, outputs, weights, ctx):
        direction, info = direction_fn(outputs, weights, ctx)
        return direction, state, info

    return Aggregator(init, aggregate)


def weighted_sum(tree, weights):
    """sum_k weights[k] * tree[k] for every leaf (leading axis K), one dot product.

    Not NaN-safe on zero-weight rows (0 * NaN = NaN): selecting them away first
    copies the K stacked deltas, which made the K = 1000 server step 7x slower and
    doubled its memory (benchmarks/server_step.py). The engine's masked cohort rows
    hold real clients' finite deltas, so this is only a concern for hand-made input.
    """
    return jax.tree.map(lambda x: jnp.tensordot(weights.astype(x.dtype), x, axes=1), tree)


def weighted_mean() -> Aggregator:
    """Delta = sum_k p_k Delta_k (FedAvg, McMahan et al. 2017; p from a MixingRule)."""
    return stateless(lambda outputs, weights, ctx: (weighted_sum(outputs.delta, weights), {}))


def step_normalized() -> Aggregator:
    """FedNova's normalised averaging (Wang, Liu, Liang, Joshi, Poor, "Tackling the
    Objective Inconsistency Problem in Heterogeneous Federated Optimization", NeurIPS
    2020, arXiv:2007.07481) for unequal local work (heterogeneity.py):

        d = tau_eff * sum_k p_k Delta_k / tau_k,   tau_eff = sum_k p_k tau_k,

    tau_k = ``outputs.num_steps``. With equal step counts it is the weighted mean.
    A client that took no step has Delta_k = 0 and adds nothing.
    """

    def direction(outputs, weights, ctx):
        tau = outputs.num_steps.astype(jnp.float32)
        tau_eff = jnp.sum(weights * tau)
        per_step = weights / jnp.maximum(tau, 1.0)
        return (jax.tree.map(lambda d: tau_eff * d, weighted_sum(outputs.delta, per_step)),
                {"tau_eff": tau_eff})

    return stateless(direction)
