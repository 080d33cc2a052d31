"""Server optimizers — FedAvgM (Hsu, Qi, Brown, "Measuring the Effects of Non-Identical
Data Distribution for Federated Visual Classification", 2019) and FedAdagrad / FedAdam /
FedYogi (Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar, McMahan, "Adaptive
Federated Optimization", ICLR 2021, arXiv:2003.00295, Algorithm 2).

The clients run FedAvg's local SGD; the server treats the averaged client delta
Delta^t = sum_k p_k (x^t - x_k) as a pseudo-gradient and steps with an optax
optimizer (server rate eta = ``server_lr``):

    FedAvgM:   v = beta v + Delta;  x <- x - eta v                (optax.sgd momentum)
    FedAdam:   m = b1 m + (1-b1) Delta;  v = b2 v + (1-b2) Delta^2;
               x <- x - eta m / (sqrt(v) + tau)                    (optax.adam, eps=tau)
    FedYogi:   v = v - (1-b2) Delta^2 sign(v - Delta^2)            (optax.yogi)
    FedAdagrad: v = v + Delta^2;  x <- x - eta Delta / (sqrt(v) + tau)   (scale_by_adagrad_tau)

Reddi et al. run the adaptive rules without bias correction; optax's adam applies
it, which only rescales early steps. tau = ``tau`` (the paper's adaptivity, 1e-3 by
default there). ``server_lr`` may be a schedule of the round (optax's step count is
the number of server steps, one per round). The clients' local training is
``training`` (``ClientTraining``, as FedAvg's: eta_l = ``training.lr``).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_fair import hparams as H
from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.algorithms.families.training import Rate
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.algorithms.registry import register

HPARAMS = {"server_lr": H.POSITIVE, "momentum": H.Range(0.0, 1.0, high_open=True),
           "b1": H.Range(0.0, 1.0, high_open=True), "b2": H.Range(0.0, 1.0, high_open=True),
           "tau": H.POSITIVE}


def _check(**values):
    for name, value in values.items():
        if not callable(value):
            HPARAMS[name].check(name, value)


def fedavgm(model, *, server_lr: Rate = 1.0, momentum: float = 0.9,
            training: ClientTraining = ClientTraining(),
            weight_by_size: bool = True) -> FederatedAlgorithm:
    """FedAvg clients; server SGD with momentum on the averaged delta."""
    _check(server_lr=server_lr, momentum=momentum)
    return fedavg(model, training=training, weight_by_size=weight_by_size,
                  server_optimizer=optax.sgd(server_lr, momentum=momentum))


def fedadam(model, *, server_lr: Rate = 0.01, b1: float = 0.9, b2: float = 0.99,
            tau: float = 1e-3, training: ClientTraining = ClientTraining(),
            weight_by_size: bool = True) -> FederatedAlgorithm:
    """FedAvg clients; server Adam on the averaged delta."""
    _check(server_lr=server_lr, b1=b1, b2=b2, tau=tau)
    return fedavg(model, training=training, weight_by_size=weight_by_size,
                  server_optimizer=optax.adam(server_lr, b1=b1, b2=b2, eps=tau))


def fedyogi(model, *, server_lr: Rate = 0.01, b1: float = 0.9, b2: float = 0.99,
            tau: float = 1e-3, training: ClientTraining = ClientTraining(),
            weight_by_size: bool = True) -> FederatedAlgorithm:
    """FedAvg clients; server Yogi on the averaged delta."""
    _check(server_lr=server_lr, b1=b1, b2=b2, tau=tau)
    return fedavg(model, training=training, weight_by_size=weight_by_size,
                  server_optimizer=optax.yogi(server_lr, b1=b1, b2=b2, eps=tau))


def fedadagrad(model, *, server_lr: Rate = 0.1, tau: float = 1e-3,
               training: ClientTraining = ClientTraining(),
               weight_by_size: bool = True) -> FederatedAlgorithm:
    """FedAvg clients; server Adagrad (Reddi et al.'s form) on the averaged delta."""
    _check(server_lr=server_lr, tau=tau)
    return fedavg(model, training=training, weight_by_size=weight_by_size,
                  server_optimizer=optax.chain(scale_by_adagrad_tau(tau),
                                               optax.scale_by_learning_rate(server_lr)))


class AdagradTauState(NamedTuple):
    sum_of_squares: optax.Updates  # v


def scale_by_adagrad_tau(tau: float) -> optax.GradientTransformation:
    """Reddi et al.'s Adagrad step direction: v <- v + Delta^2, Delta / (sqrt(v) + tau).

    (optax.adagrad puts its eps inside the square root, sqrt(v + eps).)"""

    def init(params):
        return AdagradTauState(jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None):
        del params
        v = jax.tree.map(lambda s, g: s + jnp.square(g), state.sum_of_squares, updates)
        return jax.tree.map(lambda g, s: g / (jnp.sqrt(s) + tau), updates, v), AdagradTauState(v)

    return optax.GradientTransformation(init, update)


register("fedavgm", fedavgm, HPARAMS, family="server", server_rate="server_lr")
register("fedadam", fedadam, HPARAMS, family="server", server_rate="server_lr")
register("fedyogi", fedyogi, HPARAMS, family="server", server_rate="server_lr")
register("fedadagrad", fedadagrad, HPARAMS, family="server", server_rate="server_lr")
