"""MIFA — Gu, Huang, Zhang, Zhang, "Fast Federated Learning in the Presence of Arbitrary
Device Unavailability", NeurIPS 2021 (arXiv:2106.04159), Algorithm 1.

The server keeps every client's latest update G_i and, each round, moves along their
average over ALL N clients, the unavailable ones included (their last update stands
in for the one they could not send):

    G_i <- w^t - w_i^{t,K}   for every client i that reported in round t
    w^{t+1} = w^t - (1 / N) sum_{i=1}^N G_i                              (Alg. 1)

G_i = 0 before client i's first report. Under full participation this is FedAvg with
the simple average (1 / N); under partial or biased participation it removes the bias
towards the clients that are online more often, at the price of stale updates.

Symbols -> code: G_i = the rows of ``MifaState.table`` (a client table: dense [N, d]
or lazy, ``core/client_states.py``); sum_i G_i = ``MifaState.total`` (kept as a
running sum, so a round touches the cohort's rows only: total += sum_{i in S}
(Delta_i - G_i^old)); Delta_i = ``ClientOutput.delta``; 1 / N = the divisor. The
paper's update is the local model change divided by the learning rate eta_t and
multiplied back at the server; with a constant client rate that is the stored
Delta_i itself, which is what is kept here (under a decaying client rate the stored
updates keep the rate of the round they were made in).

The mixing weights are not used (every client counts 1 / N); the aggregator logs
``server/stored`` (clients with an update stored) and ``server/staleness`` (the mean
age in rounds of the stored updates).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from fedjax_fair.algorithms.families.training import Transform
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.core import client_states as tables
from fedjax_fair.core.aggregators import Aggregator
from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.algorithms.registry import register

HPARAMS: dict = {}


class MifaState(NamedTuple):
    table: Any  # the latest update G_i of every client (a client table)
    total: Any  # sum_i G_i over all N clients
    num_clients: jax.Array  # N, as a float32 scalar


def mifa_aggregator(table="dense") -> Aggregator:
    """MIFA's server rule as an ``Aggregator``: the direction (1 / N) sum_i G_i over
    every client's latest update. ``table``: "dense" (N rows of the model's size),
    "lazy" / "lazy:CAPACITY" (rows for the clients seen) or a ``ClientTable``."""
    store = tables.get_table(table)

    def init(params, num_clients: int) -> MifaState:
        zero = jax.tree.map(jnp.zeros_like, params)
        return MifaState(store.init(zero, num_clients), zero,
                         jnp.asarray(num_clients, jnp.float32))

    def aggregate(state: MifaState, outputs, weights, ctx):
        del weights
        ids, mask = ctx.client_ids, ctx.client_mask
        old = store.gather(state.table, ids)
        change = jax.tree.map(
            lambda new, prev: jnp.sum(jnp.where(
                mask.reshape((-1,) + (1,) * (new.ndim - 1)), new - prev, 0), axis=0),
            outputs.delta, old)
        total = jax.tree.map(jnp.add, state.total, change)
        table = store.scatter(state.table, ids, outputs.delta, mask, ctx.round)
        direction = jax.tree.map(lambda s: s / state.num_clients.astype(s.dtype), total)
        last = table.last_round
        seen = last >= 0
        info = {"stored": jnp.sum(seen).astype(jnp.int32),
                "staleness": jnp.sum(jnp.where(seen, ctx.round - last, 0))
                / jnp.maximum(jnp.sum(seen), 1)}
        return direction, MifaState(table, total, state.num_clients), info

    # the server keeps every client's latest update
    return Aggregator(init, aggregate, reads=("delta",))


def mifa(model, *, training: ClientTraining = ClientTraining(),
         table: str = "dense",
         server_optimizer: Optional[Transform] = None) -> FederatedAlgorithm:
    """MIFA: FedAvg's local SGD; the server averages every client's latest update over
    all N clients (``mifa_aggregator``; ``table`` stores them dense or lazy)."""
    return fedavg(model, training=training, server_optimizer=server_optimizer,
                  aggregator=mifa_aggregator(table), weight_by_size=False)


register("mifa", mifa, HPARAMS, family="participation", size_prior=None)
