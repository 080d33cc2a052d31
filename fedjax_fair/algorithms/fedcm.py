"""FedCM — Xu, Wang, Wang, Jiang, "FedCM: Federated Learning with Client-level
Momentum", arXiv:2106.10874.

The server keeps a global momentum Delta^t (parameter-shaped, Delta^0 = 0) and
broadcasts it with theta^t. Client k runs K_k local steps from theta^t, mixing its
minibatch gradient g with the momentum:

    v = alpha g + (1 - alpha) Delta^t,
    theta <- theta - eta^t ( v + wd theta ).

The server steps as FedAvg and sets the next momentum to the cohort's average
update per local step and unit rate:

    theta^{t+1} = theta^t - eta_g sum_k p_k Delta_k,   Delta_k = theta^t - theta_k,
    Delta^{t+1} = sum_k p_k Delta_k / (K_k eta^t),

i.e. Delta^{t+1} = -(theta-bar^{t+1} - theta^t) / (K eta^t) when every client takes
K steps (the A-FedPD paper's FedCM baseline, arXiv:2409.18915, Table 3). A client that took no step adds nothing to
Delta^{t+1}. Round 0 is FedAvg on the data term scaled by alpha; alpha = 1 is FedAvg.

Pieces: v is the gradient of the batch objective alpha * (masked mean loss) plus the
linear regulariser (1 - alpha) <Delta^t, theta>; Delta^t lives in the aggregator's
state and reaches the clients through the broadcast (like SCAFFOLD's c). The
client's ``train_loss`` stays the model's own mean loss.

Symbols -> arguments: alpha = ``alpha`` in (0, 1] (may be traced), eta^t =
``training.lr`` (a number, a traced scalar or a schedule of the round), wd =
``training.weight_decay``, eta_g = ``server_lr``, K_k = the client's local steps
(``training.num_epochs`` x ceil(n_k / B), capped by ``training.max_steps`` and its
step budget), B = ``training.batch_size`` (``ClientTraining``); p_k = 1 / |S|, or
n_k / n with ``weight_by_size``.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_fair import hparams as H
from fedjax_fair.core.aggregators import UPDATE, Aggregator, plain_combine, scale_rows
from fedjax_fair.core.algorithm import FederatedAlgorithm, compose
from fedjax_fair.algorithms.families.training import Rate
from fedjax_fair.core.client import ClientTraining, check_rate_optimizer, local_training
from fedjax_fair.core.client import inner, masked_mean, round_value
from fedjax_fair.core.mixing import prior
from fedjax_fair.algorithms.registry import register

HPARAMS = {"alpha": H.Range(0.0, 1.0, low_open=True), "server_lr": H.POSITIVE}


class FedCMState(NamedTuple):
    """The server's side: the momentum Delta^t broadcast to the clients."""

    momentum: Any  # parameter-shaped


def momentum_aggregator(client_lr: Rate) -> Aggregator:
    """Delta = sum_k p_k Delta_k (the FedAvg direction); the new momentum
    sum_k p_k Delta_k / (K_k eta^t), eta^t = ``client_lr`` at the round."""

    def init(params, num_clients):
        del num_clients
        return FedCMState(jax.tree.map(jnp.zeros_like, params))

    def aggregate(state, outputs, weights, ctx, combine=plain_combine):
        del state
        steps = outputs.num_steps
        rate = round_value(client_lr, ctx.round)
        # each client's Delta_k / K_k, the update per local step (0 without a step)
        per_step = scale_rows(outputs.delta, jnp.where(steps > 0, 1.0 / jnp.maximum(steps, 1),
                                                       0.0))
        direction = combine(UPDATE, outputs.delta, weights)
        momentum = jax.tree.map(lambda m: m / jnp.asarray(rate).astype(m.dtype),
                                combine(UPDATE, per_step, weights))
        return direction, FedCMState(momentum), {}

    return Aggregator(init, aggregate, combines=(UPDATE, UPDATE))


def fedcm(model, *, alpha: float = 0.1, training: ClientTraining = ClientTraining(),
          server_lr: float = 1.0, weight_by_size: bool = False) -> FederatedAlgorithm:
    """FedCM: local steps along alpha g + (1 - alpha) Delta^t, FedAvg server step
    ``optax.sgd(server_lr)`` (weights 1 / |S|, or n_k / n with ``weight_by_size``).
    ``training.optimizer``: a ``rate -> transformation`` callable (Delta^t divides by
    K eta); ``training.clip_mode``: "step" clips alpha g + (1 - alpha) Delta^t, "loss"
    alpha g alone."""
    H.check(HPARAMS, alpha=alpha, server_lr=server_lr)
    check_rate_optimizer(training.optimizer, "FedCM's momentum")

    def momentum_term(params, broadcast, client_state):
        del client_state
        return (1.0 - alpha) * inner(broadcast.extra, params)

    client = local_training(model, training, regularizer=momentum_term,
                            batch_loss=lambda losses, mask: alpha * masked_mean(losses, mask))
    return compose(client, mixing=prior(weight_by_size),
                   aggregator=momentum_aggregator(training.lr),
                   server_optimizer=optax.sgd(server_lr),
                   broadcast=lambda state: state.aggregator_state.momentum)


register("fedcm", fedcm, HPARAMS, family="primal_dual", server_rate="server_lr",
         search_space={"alpha": (0.05, 0.1, 0.2, 0.5)},
         search_source="A-FedPD (arXiv:2409.18915), Table 3: alpha in {0.05, 0.1, 0.2, 0.5}")
