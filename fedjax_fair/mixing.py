"""Mixing rules: per-client weights on the simplex (DESIGN.md §5).

A ``MixingRule`` is ``init(num_clients) -> state`` and
``update(state, outputs, ctx) -> (weights [K], state)``. ``outputs`` is the cohort's
stacked ``ClientOutput`` (losses, example counts, steps taken, the method's extra
outputs); ``ctx`` is the round's ``ServerContext`` (server parameters, round, server
key, client ids and mask). The state may hold a table over ALL N clients, read and
written at ``ctx.client_ids``. Weights of masked-out clients are zero and the rest
sum to one.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax.numpy as jnp


class MixingRule(NamedTuple):
    init: Callable
    update: Callable


def normalize(scores, client_mask):
    """scores * mask / sum(scores * mask); uniform over the mask if that sum is 0."""
    s = jnp.where(client_mask, scores, 0.0)
    total = jnp.sum(s)
    uniform = client_mask / jnp.maximum(jnp.sum(client_mask), 1)
    return jnp.where(total > 0, s / jnp.where(total > 0, total, 1.0), uniform)


def stateless(weights_fn: Callable) -> MixingRule:
    """A ``MixingRule`` from ``weights_fn(outputs, ctx) -> weights [K]`` with no state."""

    def init(num_clients):
        del num_clients
        return ()

    def update(state, outputs, ctx):
        return weights_fn(outputs, ctx), state

    return MixingRule(init, update)


def uniform() -> MixingRule:
    """p_k = 1 / |S| over participating clients."""
    return stateless(lambda out, ctx: normalize(jnp.ones_like(out.loss_before, jnp.float32),
                                                ctx.client_mask))


def by_num_examples() -> MixingRule:
    """p_k = n_k / sum_j n_j (FedAvg's data weights)."""
    return stateless(lambda out, ctx: normalize(out.num_examples.astype(jnp.float32),
                                                ctx.client_mask))


def prior(weight_by_size: bool) -> MixingRule:
    """The plain average a fair-FL protocol names: ``by_num_examples()`` (p_k ∝ n_k)
    if ``weight_by_size``, else ``uniform()`` (simple averaging, the partner of
    size-proportional sampling)."""
    return by_num_examples() if weight_by_size else uniform()


def active_clients(outputs, client_mask):
    """Rows weighted by loss-driven rules: ``client_mask`` and n_k > 0.

    An empty client has no loss (its ``loss_before`` is 0 by convention) and a zero
    delta, so it is left out. If no participating client holds data, the mask
    itself is returned (the weights then stay on the simplex; every delta is 0).
    """
    client_mask = jnp.asarray(client_mask, bool)
    with_data = client_mask & (outputs.num_examples > 0)
    return jnp.where(jnp.any(with_data), with_data, client_mask)


def loss_rule(weights_fn: Callable) -> MixingRule:
    """A stateless ``MixingRule`` from ``weights_fn(outputs, active) -> weights [K]``,
    ``active`` being ``active_clients`` (participating clients that hold data)."""
    return stateless(lambda outputs, ctx: weights_fn(
        outputs, active_clients(outputs, ctx.client_mask)))


def size_prior(outputs, weight_by_size: bool):
    """n_k as float32 (FedAvg's prior p_k ∝ n_k) if ``weight_by_size``, else ones."""
    n = jnp.asarray(outputs.num_examples, jnp.float32)
    return n if weight_by_size else jnp.ones_like(n)
