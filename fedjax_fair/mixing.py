"""Mixing rules: per-client weights on the simplex (DESIGN.md §5).

A ``MixingRule`` is ``init(num_clients) -> state`` and
``update(state, outputs, client_ids, client_mask) -> (weights [K], state)``.
``outputs`` is the cohort's stacked ``ClientOutput`` (losses, example counts,
steps taken). The state may hold a table over ALL N clients, read and written at
``client_ids``. Weights of masked-out clients are zero and the rest sum to one.
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


def _stateless(score_fn) -> MixingRule:
    def init(num_clients):
        del num_clients
        return ()

    def update(state, outputs, client_ids, client_mask):
        del client_ids
        return normalize(score_fn(outputs).astype(jnp.float32), client_mask), state

    return MixingRule(init, update)


def uniform() -> MixingRule:
    """p_k = 1 / |S| over participating clients."""
    return _stateless(lambda out: jnp.ones_like(out.loss_before))


def by_num_examples() -> MixingRule:
    """p_k = n_k / sum_j n_j (FedAvg's data weights)."""
    return _stateless(lambda out: out.num_examples)


MIXING_RULES = {"uniform": uniform, "num_examples": by_num_examples}
