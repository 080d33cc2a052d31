"""SCAFFOLD — Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, "SCAFFOLD: Stochastic
Controlled Averaging for Federated Learning", ICML 2020 (arXiv:1910.06378),
Algorithm 1 with option II.

The server keeps a control variate c and every client i its own c_i (both
parameter-shaped, c_i = 0 and c = 0 at the start). The server broadcasts (x, c);
client i runs K local steps of corrected SGD from y_i = x,

    y_i <- y_i - eta_l (g_i(y_i) - c_i + c),

then updates its control variate (option II) and reports both changes:

    c_i^+ = c_i - c + (x - y_i) / (K eta_l),
    Delta y_i = y_i - x,   Delta c_i = c_i^+ - c_i.

The server averages over the cohort S and moves its control variate by the share
of the federation that reported:

    x <- x + eta_g (1 / |S|) sum_{i in S} Delta y_i,
    c <- c + (1 / N) sum_{i in S} Delta c_i.

Pieces: the correction is the linear regulariser <c - c_i, y> (its gradient is
exactly c - c_i), the option-II update is the client's ``finish`` hook (the new row
and Delta c_i as ``extra``), and c lives in the aggregator's state and reaches the
clients through the broadcast. K is the client's actual step count (a client that
took no step keeps c_i); eta_l is this round's client rate (schedules allowed).

Symbols -> arguments: eta_l = ``training.lr``, eta_g = ``server_lr``, K = the local
steps (``training.num_epochs`` x ceil(n_i / B), B = ``training.batch_size``, capped
by ``training.max_steps``), N = the
federation size, the cohort weights 1 / |S| (``uniform`` mixing).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from fedjax_fair import hparams as H
from fedjax_fair.core.aggregators import EXTRA, UPDATE, Aggregator, plain_combine
from fedjax_fair.core.algorithm import FederatedAlgorithm, compose
from fedjax_fair.algorithms.families.training import Rate
from fedjax_fair.core.client import ClientTraining, check_rate_optimizer, local_training
from fedjax_fair.core.client import inner
from fedjax_fair.core.mixing import MixingRule, prior
from fedjax_fair.algorithms.registry import register

HPARAMS = {"server_lr": H.POSITIVE}


class ScaffoldState(NamedTuple):
    """The server's side: c, and 1 / N for its update."""

    control: object  # c, parameter-shaped
    inv_num_clients: jax.Array  # float32 [] 1 / N


def correction(params, broadcast, client_control):
    """<c - c_i, y>: its gradient c - c_i is SCAFFOLD's drift correction."""
    drift = jax.tree.map(jnp.subtract, broadcast.extra, client_control)
    return inner(drift, params)


def option_two(result, broadcast, client_control, data, key):
    """c_i^+ = c_i - c + (x - y_i) / (K eta_l); returns (c_i^+, Delta c_i)."""
    del data, key
    steps = result.num_steps.astype(jnp.float32)
    scale = jnp.where(steps > 0, 1.0 / (jnp.maximum(steps, 1.0) * result.learning_rate), 0.0)
    new = jax.tree.map(
        lambda ci, c, x, y: jnp.where(steps > 0, ci - c + scale * (x - y), ci),
        client_control, broadcast.extra, broadcast.params, result.params)
    return new, jax.tree.map(jnp.subtract, new, client_control)


def scaffold_aggregator() -> Aggregator:
    """Delta = sum_k p_k Delta_k; c <- c + (1/N) sum_{k in S} Delta c_k (the clients'
    ``extra``)."""

    def init(params, num_clients):
        return ScaffoldState(jax.tree.map(jnp.zeros_like, params),
                             jnp.asarray(1.0 / num_clients, jnp.float32))

    def aggregate(state, outputs, weights, ctx, combine=plain_combine):
        reported = ctx.client_mask.astype(jnp.float32) * state.inv_num_clients
        direction = combine(UPDATE, outputs.delta, weights)
        control = jax.tree.map(jnp.add, state.control, combine(EXTRA, outputs.extra, reported))
        return direction, ScaffoldState(control, state.inv_num_clients), {}

    return Aggregator(init, aggregate, combines=(UPDATE, EXTRA))


def scaffold(model, *, server_lr: Rate = 1.0, training: ClientTraining = ClientTraining(),
             client_table: str = "dense",
             mixing: Optional[MixingRule] = None,
             weight_by_size: bool = False) -> FederatedAlgorithm:
    """SCAFFOLD (option II): drift-corrected local SGD with control variates.

    ``mixing`` defaults to 1 / |S| (n_k / n with ``weight_by_size``).

    ``client_table``: "dense", "lazy" or "lazy:CAPACITY" storage of the clients' c_i.
    ``training``: the local steps (``ClientTraining``); ``training.weight_decay`` is
    coupled L2 (gradient + wd y); ``training.optimizer`` must be a
    ``rate -> transformation`` callable (option II divides by K eta_l);
    ``training.clip_mode`` "step" clips g_i - c_i + c, "loss" g_i alone."""
    if not callable(server_lr):
        HPARAMS["server_lr"].check("server_lr", server_lr)
    check_rate_optimizer(training.optimizer, "SCAFFOLD's option II")
    client = local_training(model, training, regularizer=correction, finish=option_two)
    return compose(client, mixing=mixing or prior(weight_by_size), aggregator=scaffold_aggregator(),
                   server_optimizer=optax.sgd(server_lr),
                   client_state_init=lambda params: jax.tree.map(jnp.zeros_like, params),
                   client_table=client_table,
                   broadcast=lambda state: state.aggregator_state.control)


register("scaffold", scaffold, HPARAMS, family="primal_dual", server_rate="server_lr")
