"""Per-client evaluation over ALL clients of a split, in chunks.

Fairness metrics need every client's accuracy, not only the last cohort's
(DQN-Fed §6, AAggFF §7). Clients are evaluated ``chunk_size`` at a time (vmapped
inside a chunk, ``lax.map`` across chunks) so memory stays bounded for large N.

What is evaluated is the algorithm's choice: the global model (``make_evaluator``),
or each client's own model (``make_personal_evaluator``: Ditto, SuPerFed, FedRep),
whose parameters are gathered from the client table one chunk at a time, so a
personalised evaluation never holds N models at once.

A generated split (``data/generated.py``: rows computed from the client id) is
evaluated at the client ids passed: each chunk's rows are computed inside the map,
so evaluating a million generated clients holds one chunk's rows at a time.

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
from fedjax_fair.core.generated import is_generated
from fedjax_fair.models.base import Model
from fedjax_fair.core.types import ClientData


def per_client(fn: Callable, split, client_ids, chunk_size: int) -> dict:
    """``fn(client_id, rows)`` of every client, ``chunk_size`` clients at a time
    (vmapped inside a chunk, ``lax.map`` across chunks), with ``"num_examples"``. A
    stored split holds the rows of ``client_ids`` ([n, M, ...]); a generated split
    computes them per chunk (``client_ids`` None: every client)."""
    if is_generated(split):
        if client_ids is None:
            client_ids = jax.numpy.arange(split.num_clients, dtype=jax.numpy.int32)

        def one(i):
            rows = split.take(i[None])
            return {**fn(i, jax.tree.map(lambda v: v[0], rows)),
                    "num_examples": rows.num_examples[0]}

        return jax.lax.map(one, client_ids, batch_size=chunk_size)
    if client_ids is None:
        client_ids = jax.numpy.arange(split.mask.shape[0], dtype=jax.numpy.int32)
    out = jax.lax.map(lambda a: fn(*a), (client_ids, split), batch_size=chunk_size)
    return {**out, "num_examples": split.num_examples}


@functools.lru_cache(maxsize=32)
def make_evaluator(model: Model, chunk_size: int = 64) -> Callable:
    """A jitted ``(params, split: ClientData [N, ...], client_ids=None) -> {metric: [N]}``
    (a generated split: the clients ``client_ids``, default every client).

    Cached per (model, chunk_size), so repeated runs of one model share compilations.

    Values are masked means per client ("loss", "accuracy", ...), plus
    "num_examples". A client with no rows in the split gets 0 for every metric; use
    ``num_examples > 0`` to exclude it from summaries.
    """

    @jax.jit
    def evaluate(params, split: ClientData, client_ids=None):
        return per_client(lambda _, d: data_metrics(model, params, d), split, client_ids,
                          chunk_size)

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
        return per_client(lambda i, d: one(state, i, d), split, client_ids, chunk_size)

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
        params = state.params if evaluated_params is None else evaluated_params(state)
        if is_generated(split):  # the rows of client_ids are computed
            return make_evaluator(model)(params, split, client_ids)
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
