"""Per-client evaluation over ALL clients of a split, in chunks.

Fairness metrics need every client's accuracy, not only the last cohort's
(DQN-Fed §6, AAggFF §7). Clients are evaluated ``chunk_size`` at a time (vmapped
inside a chunk, ``lax.map`` across chunks) so memory stays bounded for large N.

What is evaluated is the algorithm's choice: the global model (``make_evaluator``),
or each client's own model (``make_personal_evaluator``: Ditto, SuPerFed, FedRep),
whose parameters are gathered from the client table one chunk at a time, so a
personalised evaluation never holds N models at once.

Over a device mesh (sharding.py) whose ``clients`` axis splits the split's clients,
``make_state_evaluator(..., mesh=mesh)`` evaluates the global model with
``jax.shard_map``: each device evaluates its own clients (left to XLA's partitioner,
every device would gather the whole split and evaluate every client).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import numpy as np

from fedjax_fair.core.client import data_metrics
from fedjax_fair.models.base import Model
from fedjax_fair.core.types import ClientData


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


@functools.lru_cache(maxsize=32)
def make_personal_evaluator(model: Model, personal: Callable, chunk_size: int = 64) -> Callable:
    """A jitted ``(state, split [n, ...], client_ids [n]) -> {metric: [n]}`` evaluating
    client i's own model ``personal(state, ids)`` on its own rows."""

    def one(state, client_id, data):
        params = jax.tree.map(lambda x: x[0], personal(state, client_id[None]))
        return data_metrics(model, params, data)

    @jax.jit
    def evaluate(state, split: ClientData, client_ids):
        per_client = jax.lax.map(lambda a: one(state, *a), (client_ids, split),
                                 batch_size=chunk_size)
        return {**per_client, "num_examples": split.num_examples}

    return evaluate


@functools.lru_cache(maxsize=32)
def make_sharded_evaluator(model: Model, mesh, chunk_size: int = 64) -> Callable:
    """``make_evaluator`` over ``mesh``: ``(params, split [N, ...]) -> {metric: [N]}``
    with the split's clients (N a multiple of the ``clients`` axis) split over the
    devices, each evaluating its own clients; the parameters replicated."""
    from jax.sharding import PartitionSpec as P
    from fedjax_fair.core.sharding import CLIENTS
    local = make_evaluator(model, chunk_size)
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(CLIENTS)),
                                 out_specs=P(CLIENTS), axis_names=frozenset({CLIENTS}),
                                 check_vma=False))


def make_state_evaluator(model: Model, personal: Optional[Callable] = None,
                         evaluated_params: Optional[Callable] = None,
                         mesh=None) -> Callable:
    """``(state, split, client_ids) -> {metric: [n]}`` for an algorithm: each client's
    own model when ``personal`` is set, else the global model ``state.params`` (or
    ``evaluated_params(state)``, e.g. A-FedPD's cohort average). ``mesh``: evaluate
    the global model sharded by client (``make_sharded_evaluator``; splits whose
    client count is a multiple of the mesh's ``clients`` axis). A personal
    evaluation is left to XLA's partitioner."""
    if personal is not None:
        return make_personal_evaluator(model, personal)
    evaluate = make_evaluator(model) if mesh is None else make_sharded_evaluator(model, mesh)

    def evaluate_clients(state, split, client_ids):  # the name compile_programs reports
        del client_ids
        params = state.params if evaluated_params is None else evaluated_params(state)
        return evaluate(params, split)

    return evaluate_clients


@functools.lru_cache(maxsize=32)
def state_evaluator_program(model: Model, personal: Optional[Callable] = None,
                            evaluated_params: Optional[Callable] = None,
                            mesh=None) -> Callable:
    """``make_state_evaluator`` (one device, or split by client over ``mesh``) as one
    jitted function of ``(state, split, client_ids)``, which the runner compiles ahead
    of time (``.lower(...).compile()``) in a background thread while the chunk program
    compiles. Cached per model and mesh."""
    return jax.jit(make_state_evaluator(model, personal, evaluated_params, mesh))


def to_numpy(metrics: dict) -> dict:
    return {k: np.asarray(v) for k, v in metrics.items()}
