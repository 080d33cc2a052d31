"""Per-client evaluation of one model over ALL clients of a split, in chunks.

Fairness metrics need every client's accuracy, not only the last cohort's
(DQN-Fed §6, AAggFF §7). Clients are evaluated ``chunk_size`` at a time (vmapped
inside a chunk, ``lax.map`` across chunks) so memory stays bounded for large N.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import numpy as np

from fedjax_fair.client import data_metrics
from fedjax_fair.models.base import Model
from fedjax_fair.types import ClientData


@functools.lru_cache(maxsize=32)
def make_evaluator(model: Model, chunk_size: int = 64) -> Callable:
    """A jitted ``(params, split: ClientData [N, ...]) -> {metric: [N]}``.

    Cached per (model, chunk_size), so repeated runs of one model share compilations.

    Values are masked means per client ("loss", "accuracy", ...), plus
    "num_examples". A client with no rows in the split gets 0 for every metric; use
    ``num_examples > 0`` to exclude it from summaries.
    """

    @jax.jit
    def evaluate(params, split: ClientData):
        per_client = jax.lax.map(lambda d: data_metrics(model, params, d), split,
                                 batch_size=chunk_size)
        return {**per_client, "num_examples": split.num_examples}

    return evaluate


def to_numpy(metrics: dict) -> dict:
    return {k: np.asarray(v) for k, v in metrics.items()}
