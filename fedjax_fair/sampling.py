"""Cohort samplers: ``sampler(key, num_clients, cohort_size) -> client_ids int32 [K]``.

``num_clients`` and ``cohort_size`` are static Python ints.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def uniform(key, num_clients: int, cohort_size: int):
    """K distinct clients, uniformly at random without replacement."""
    return jax.random.choice(key, num_clients, (cohort_size,), replace=False).astype(jnp.int32)


def full(key, num_clients: int, cohort_size: int):
    """Every client every round (cross-silo); requires cohort_size == num_clients."""
    del key
    if cohort_size != num_clients:
        raise ValueError(f"cohort_size: the 'full' sampler needs cohort_size == num_clients "
                         f"({num_clients}), got {cohort_size}")
    return jnp.arange(num_clients, dtype=jnp.int32)


def weighted(probabilities):
    """K distinct clients drawn with probability proportional to ``probabilities`` [N]
    (e.g. availability or data size), without replacement."""
    probabilities = jnp.asarray(probabilities, jnp.float32)

    def sampler(key, num_clients: int, cohort_size: int):
        return jax.random.choice(key, num_clients, (cohort_size,), replace=False,
                                 p=probabilities / probabilities.sum()).astype(jnp.int32)

    return sampler


SAMPLERS = {"uniform": uniform, "full": full}
