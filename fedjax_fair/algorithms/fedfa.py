"""FedFa — Huang, Li, Wang, Du, Zhang, "Fairness and Accuracy in Federated Learning",
Information Sciences 2022 (arXiv:2012.10069).

Two parts: aggregation weights from the information quantity of each client's
training accuracy and participation frequency, and a double momentum (momentum SGD on
the clients, momentum on the server).

Weights. Client i of the round's cohort S reports Acc_i, the accuracy of the server
model w^t on its training rows (measured before local training, with
``loss_before``), and its participation frequency f_i, the number of rounds it has
taken part in, this one included (the server counts them). Their information
quantities, each normalised over the cohort:

    ACC_i = -log2(Acc_i / sum_{j in S} Acc_j + eps_a),   ACC_i <- ACC_i / sum_j ACC_j,
    F_i   = -log2(1 - f_i / sum_{j in S} f_j + eps_f),   F_i   <- F_i / sum_j F_j,
    p_i   = (alpha ACC_i + beta F_i) / (alpha + beta),

so a client the model fits worse (a smaller accuracy share) gets more weight, and so
does a client that has taken part more often (a larger share of the participations).
The authors' framework sets alpha = 1 - beta; any other pair is normalised to that
(only alpha / (alpha + beta) matters) so the weights stay on the simplex.
eps_a = 1e-6 and eps_f = 1e-5 keep the logarithms finite (Acc_i = 0; one client in
the cohort); quantities are clipped at 0 (-log2(1 + eps) is -1.4e-6), and a cohort
whose accuracies (or quantities) are all 0 shares that term uniformly.

Double momentum. Client i runs its local SGD with heavy-ball momentum gamma, fresh
every round (v <- gamma v + grad, w <- w - eta_l v). The server aggregates
w_new = sum_i p_i w_i and keeps a momentum of the aggregated update
Delta^t = w^t - w_new = sum_i p_i (w^t - w_i):

    m^{t+1} = mu m^t + (1 - mu) Delta^t,       m^0 = 0,
    w^{t+1} = w_new - eta m^{t+1} = w^t - (Delta^t + eta m^{t+1}).

Symbols -> arguments: alpha, beta = ``alpha``, ``beta`` (>= 0, not both 0); gamma =
``gamma`` (client momentum, in [0, 1)); mu = ``server_momentum`` (in [0, 1]; default
gamma: one momentum coefficient on both sides, as the authors' framework sets it);
eta = ``momentum_lr`` (>= 0; default the client rate eta_l = ``training.lr`` at the
round, as the authors' framework uses its learning rate); every one of them may be
traced (vmap / grad). Active clients are the participants holding data (masked rows
and empty clients get weight 0; a masked row is not counted as a participation).
eta = 0 is FedAvg's step with FedFa's weights; with gamma = 0, eta = 0 and equal
accuracies and frequencies (e.g. the first round with alpha = 0) it is FedAvg with
the simple average.

Sources and departures. The weights and the momenta above follow the non-official
implementation in the FedFV authors' framework (github.com/WwZzz/easyFL,
``flgo/algorithm/fedfa.py`` at commit ee6e269), the only public code of the method,
with its symbols (alpha, beta, gamma, eta) and defaults (beta = 0.5, alpha = 1 - beta,
gamma = 0.9); its server step, ``w_new - eta m`` with
``m = gamma m + (1 - gamma)(w_new - w^t)``, moves back against the round's progress,
which cannot be the acceleration the paper's double momentum is for: here the
momentum m tracks Delta^t = w^t - w_new, the direction the model moves in, so
w_new - eta m continues it. ``training.optimizer``, if given, replaces the momentum
SGD (gamma is then unused).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from fedjax_fair import hparams as H
from fedjax_fair.core import execution
from fedjax_fair.core.aggregators import UPDATE, Aggregator, plain_combine
from fedjax_fair.core.algorithm import FederatedAlgorithm, compose
from fedjax_fair.core.client import (ClientTraining, check_rate, data_metrics,
                                     local_training, round_value)
from fedjax_fair.core.mixing import MixingRule, active_clients
from fedjax_fair.algorithms.registry import register

HPARAMS = {"alpha": H.NONNEGATIVE, "beta": H.NONNEGATIVE,
           "gamma": H.Range(0.0, 1.0, high_open=True),
           "server_momentum": H.Range(0.0, 1.0, nullable=True),
           "momentum_lr": H.Range(0.0, None, nullable=True)}
EPS_ACCURACY = 1e-6
EPS_FREQUENCY = 1e-5


def _share(values, active):
    """values_i / sum_{j active} values_j on the active rows (0 elsewhere), uniform
    over them when that sum is 0."""
    values = jnp.where(active, values, 0.0)
    total = jnp.sum(values)
    uniform = active / jnp.maximum(jnp.sum(active), 1)
    return jnp.where(total > 0, values / jnp.where(total > 0, total, 1.0), uniform)


def _information(probability, eps, active):
    """-log2(probability + eps), clipped at 0, on the active rows."""
    bits = -jnp.log2(jnp.where(active, probability, 1.0) + eps)
    return jnp.where(active, jnp.maximum(bits, 0.0), 0.0)


def fedfa_weights(accuracy, frequency, active, alpha=0.5, beta=0.5):
    """p_i = (alpha ACC_i + beta F_i) / (alpha + beta) (module docstring).

    Parameters
    ----------
    accuracy : float [K]
        Acc_i in [0, 1].
    frequency : float [K]
        f_i >= 1 on the active rows: the rounds each client has taken part in.
    active : bool [K]
        The rows to weight; the others get 0.
    alpha, beta : float or traced scalars
        >= 0; alpha + beta = 0 gives the uniform weights.
    """
    active = jnp.asarray(active, bool)
    dtype = jnp.result_type(jnp.asarray(accuracy).dtype, jnp.float32)
    accuracy = jnp.asarray(accuracy, dtype)
    frequency = jnp.asarray(frequency, dtype)
    acc_info = _share(_information(_share(accuracy, active), EPS_ACCURACY, active), active)
    freq_info = _share(_information(1.0 - _share(frequency, active), EPS_FREQUENCY, active),
                       active)
    total = alpha + beta
    mixed = (alpha * acc_info + beta * freq_info) / jnp.where(total > 0, total, 1.0)
    return jnp.where(total > 0, mixed, _share(jnp.ones_like(accuracy), active))


class FedFaMixingState(NamedTuple):
    counts: jax.Array  # float32 [N]: rounds each client has taken part in


def fedfa_mixing(alpha=0.5, beta=0.5) -> MixingRule:
    """FedFa's weights as a ``MixingRule``: the participation counts of all N clients
    are its state; Acc_i is ``ClientOutput.extra`` (``with_accuracy``)."""
    H.check(HPARAMS, alpha=alpha, beta=beta)

    def init(num_clients: int) -> FedFaMixingState:
        return FedFaMixingState(jnp.zeros((num_clients,), jnp.float32))

    def update(state: FedFaMixingState, outputs, ctx):
        mask = jnp.asarray(ctx.client_mask, bool)
        n = state.counts.shape[0]
        counts = state.counts.at[jnp.where(mask, ctx.client_ids, n)].add(1.0, mode="drop")
        frequency = counts[ctx.client_ids]
        active = active_clients(outputs, mask)
        weights = fedfa_weights(outputs.extra, frequency, active, alpha, beta)
        return weights, FedFaMixingState(counts)

    return MixingRule(init, update)


def with_accuracy(model, training: ClientTraining):
    """FedAvg-style local training whose output also carries Acc_i: ``extra`` is the
    accuracy of the broadcast model on the client's training rows, computed in the
    same forward pass as ``loss_before``."""
    train = local_training(model, training, track_loss=False)

    def loss_and_accuracy(params, batch):
        per_row = model.per_example_metrics(params, batch)
        return {"loss": per_row["loss"], "accuracy": per_row["accuracy"]}

    evaluated = model._replace(per_example_metrics=loss_and_accuracy)

    def client_update(broadcast, client_state, data, local_steps, key):
        out, row = train(broadcast, client_state, data, local_steps, key)
        metrics = data_metrics(evaluated, broadcast.params, data,
                               execution.loss_chunk_size_here())
        return out._replace(loss_before=metrics["loss"], extra=metrics["accuracy"]), row

    return client_update


class FedFaState(NamedTuple):
    momentum: Any  # m^t, parameter-shaped


def fedfa_aggregator(server_momentum=0.9, momentum_lr=0.02) -> Aggregator:
    """Delta^t = sum_i p_i Delta_i, m <- mu m + (1 - mu) Delta^t and the direction
    Delta^t + eta m (the server optimizer's sgd(1.0) steps w^t - direction).
    ``momentum_lr`` may be a schedule of the round. Logs ``server/momentum_norm``."""
    H.check(HPARAMS, server_momentum=server_momentum)
    if not callable(momentum_lr):
        H.check(HPARAMS, momentum_lr=momentum_lr)

    def init(params, num_clients):
        del num_clients
        return FedFaState(jax.tree.map(jnp.zeros_like, params))

    def aggregate(state: FedFaState, outputs, weights, ctx, combine=plain_combine):
        mean = combine(UPDATE, outputs.delta, weights)
        eta = round_value(momentum_lr, ctx.round)
        momentum = jax.tree.map(lambda m, d: (server_momentum * m + (1.0 - server_momentum) * d)
                                .astype(m.dtype), state.momentum, mean)
        direction = jax.tree.map(lambda d, m: d + (eta * m).astype(d.dtype), mean, momentum)
        return direction, FedFaState(momentum), {"momentum_norm": optax.tree.norm(momentum)}

    return Aggregator(init, aggregate, combines=(UPDATE,))


def momentum_sgd(gamma):
    """``rate -> transformation``: SGD with heavy-ball momentum ``gamma`` (may be traced)."""
    return lambda rate: optax.sgd(rate, momentum=gamma)


def fedfa(model, *, alpha: float = 0.5, beta: float = 0.5, gamma: float = 0.9,
          server_momentum: Optional[float] = None, momentum_lr: Optional[float] = None,
          training: ClientTraining = ClientTraining()) -> FederatedAlgorithm:
    """FedFa: momentum local SGD, the accuracy / frequency weights and the server
    momentum (module docstring)."""
    H.check(HPARAMS, alpha=alpha, beta=beta, gamma=gamma, server_momentum=server_momentum,
            momentum_lr=momentum_lr)
    if H.is_concrete(alpha) and H.is_concrete(beta) and alpha + beta <= 0:
        raise H.FieldError("beta", "alpha and beta cannot both be 0")
    if training.optimizer is None:
        training = training._replace(optimizer=momentum_sgd(gamma))
    training.check()
    if momentum_lr is None:
        if isinstance(training.optimizer, optax.GradientTransformation):
            raise H.FieldError("momentum_lr", "give it when training.optimizer is a fixed "
                                              "transformation (it defaults to the client rate)")
        momentum_lr = check_rate(training.lr, "training.lr")
    mu = gamma if server_momentum is None else server_momentum
    return compose(with_accuracy(model, training), mixing=fedfa_mixing(alpha, beta),
                   aggregator=fedfa_aggregator(mu, momentum_lr),
                   server_optimizer=optax.sgd(1.0))


register("fedfa", fedfa, HPARAMS, family="fair", size_prior=None)
