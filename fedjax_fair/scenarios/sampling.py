"""Cohort samplers: ``sampler(key, num_clients, cohort_size) -> client_ids int32 [K]``.

``num_clients`` and ``cohort_size`` are static Python ints. ``SAMPLERS`` names the
samplers the command line offers (``--sampler``); ``get(name, num_examples)`` builds
one for a federation (the ``"size"`` sampler needs every client's training size).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from fedjax_fair import hparams as H


LARGE_FEDERATION = 1 << 17  # uniform's draw switches to distinct_draws from here


def uniform(key, num_clients: int, cohort_size: int):
    """K distinct clients, uniformly at random without replacement.

    ``jax.random.choice(replace=False)``, which permutes all N clients (sorts of N
    random keys: 0.65 s a round at N = 10^6 on a 2-core CPU, more than a 10,000-client
    round's sampled training needs); from ``LARGE_FEDERATION`` clients with K at most
    N / 16, ``distinct_draws`` instead (the same distribution, O(K log K))."""
    if num_clients >= LARGE_FEDERATION and 16 * cohort_size <= num_clients:
        return distinct_draws(key, num_clients, cohort_size)
    return jax.random.choice(key, num_clients, (cohort_size,), replace=False).astype(jnp.int32)


def distinct_draws(key, num_clients: int, cohort_size: int):
    """The first K distinct values of K + K/8 + 64 independent uniform draws from
    [0, N): a uniformly random K-subset in uniformly random order (each ordered
    K-tuple of distinct clients is equally likely, by symmetry), which is what
    sampling without replacement gives. Should the draws hold fewer than K distinct
    values (for K <= N / 16 the expected repeats are under K / 30), the permutation
    of ``jax.random.choice`` is used instead."""
    n, k = num_clients, cohort_size
    m = k + k // 8 + 64
    draws = jax.random.randint(key, (m,), 0, n, dtype=jnp.int32)
    order = jnp.argsort(draws, stable=True)  # equal values keep their draw order
    ranked = draws[order]
    first = jnp.concatenate([jnp.ones((1,), bool), ranked[1:] != ranked[:-1]])
    fresh = jnp.zeros((m,), bool).at[order].set(first)  # first occurrence, in draw order
    position = jnp.cumsum(fresh) - 1
    slot = jnp.where(fresh & (position < k), position, k)
    picked = jnp.zeros((k,), jnp.int32).at[slot].set(draws, mode="drop")
    return jax.lax.cond(
        jnp.sum(fresh) >= k, lambda: picked,
        lambda: jax.random.choice(jax.random.fold_in(key, 1), n, (k,),
                                  replace=False).astype(jnp.int32))


def full(key, num_clients: int, cohort_size: int):
    """Every client every round (cross-silo); requires cohort_size == num_clients."""
    del key
    if cohort_size != num_clients:
        raise H.FieldError("cohort_size", f"the 'full' sampler needs cohort_size == num_clients "
                                          f"({num_clients}), got {cohort_size}")
    return jnp.arange(num_clients, dtype=jnp.int32)


@dataclasses.dataclass(frozen=True)
class Weighted:
    """K distinct clients drawn successively with probability proportional to
    ``weights`` [N] (renormalised over the clients not yet drawn), i.e. without
    replacement. Two samplers with equal weights are equal, so runs of a comparison
    share one compiled program."""

    weights: tuple

    def __call__(self, key, num_clients: int, cohort_size: int):
        if num_clients != len(self.weights):
            raise H.FieldError("sampler", f"weights are given for {len(self.weights)} clients, "
                                          f"the federation has {num_clients}")
        positive = sum(w > 0 for w in self.weights)
        if cohort_size > positive:
            raise H.FieldError("cohort_size", f"{cohort_size} exceeds the {positive} clients with "
                                              f"a positive sampling weight")
        p = np.asarray(self.weights, np.float64)
        return jax.random.choice(key, num_clients, (cohort_size,), replace=False,
                                 p=jnp.asarray(p / p.sum(), jnp.float32)).astype(jnp.int32)


def weighted(weights) -> Weighted:
    """K distinct clients drawn with probability proportional to ``weights`` [N]
    (e.g. availability or data size), without replacement."""
    w = np.asarray(weights, np.float64)
    if w.ndim != 1 or w.size == 0 or not np.all(np.isfinite(w)) or np.any(w < 0) \
            or not w.sum() > 0:
        raise H.FieldError("sampler", f"weights must be a non-empty 1-D array of finite, "
                                      f"non-negative numbers with a positive sum, got {weights!r}")
    return Weighted(tuple(float(v) for v in w))


def by_size(num_examples) -> Weighted:
    """Clients drawn with probability n_k / n, without replacement (the q-FFL and
    FedProx protocol, ``sampling=2`` in their code, paired with simple averaging:
    ``--mixing uniform``); clients without training examples are never drawn."""
    return weighted(num_examples)


SAMPLERS = {"uniform": uniform, "full": full, "size": by_size}
"""Command-line samplers; ``"size"`` is a builder of the federation's sizes (``get``)."""


def get(name: str, num_examples=None):
    """The sampler called ``name`` for a federation whose clients hold
    ``num_examples`` [N] training examples (needed by ``"size"`` only)."""
    if name not in SAMPLERS:
        raise H.FieldError("sampler", f"unknown name {name!r}; allowed: {', '.join(SAMPLERS)}")
    if name == "size":
        if num_examples is None:
            raise H.FieldError("sampler", "'size' needs the clients' training sizes")
        return by_size(np.asarray(num_examples))
    return SAMPLERS[name]
