"""FedAvg — McMahan, Moore, Ramage, Hampson, Agüera y Arcas, "Communication-Efficient
Learning of Deep Networks from Decentralized Data", AISTATS 2017 (arXiv:1602.05629).

Each round, client k runs E epochs of minibatch SGD (batch B, rate eta_l) from the
global model theta^t, and the server averages by data size:

    theta^{t+1} = sum_k (n_k / n) theta_k = theta^t - sum_k p_k Delta_k,
    Delta_k = theta^t - theta_k,  p_k = n_k / sum_{j in S} n_j.

Symbols -> arguments: eta_l = ``training.lr`` (a number, a traced scalar, or a
schedule of the round t, e.g. ``lambda t: 0.1 * 0.99 ** t``; or any
``training.optimizer``), E = ``training.num_epochs``, B = ``training.batch_size``
(``ClientTraining``, shared by every FedAvg-style method, with its step cap, weight
decay and gradient clipping); the server step is ``optax.sgd(1.0)``.
"""
from __future__ import annotations

from typing import Callable, Optional

from fedjax_fair.algorithms.families.training import Transform, check_server_optimizer
from fedjax_fair.core.aggregators import Aggregator
from fedjax_fair.core.algorithm import FederatedAlgorithm, compose
from fedjax_fair.core.client import ClientTraining, local_training, loss_before_fn
from fedjax_fair.core.mixing import MixingRule, prior
from fedjax_fair.algorithms.registry import register

HPARAMS = {}


def fedavg(model, *, training: ClientTraining = ClientTraining(),
           server_optimizer: Optional[Transform] = None,
           mixing: Optional[MixingRule] = None, aggregator: Optional[Aggregator] = None,
           regularizer: Optional[Callable] = None,
           weight_by_size: bool = True) -> FederatedAlgorithm:
    """FedAvg with data-size weights (``weight_by_size=False``: the simple average
    1 / |S|, q-FFL's partner of size-proportional sampling); ``server_optimizer``
    defaults to sgd(1.0).

    Pieces for composing: ``regularizer(params, broadcast, client_state)`` is added
    to every local batch loss (FedProx's proximal term); ``mixing`` (weights) and
    ``aggregator`` (default: the weighted mean) swap in other server rules, e.g.
    ``aggregators.step_normalized()`` for unequal local work. ``training``: the
    clients' local training (``ClientTraining``)."""
    check_server_optimizer(server_optimizer)
    return compose(
        local_training(model, training, regularizer=regularizer),
        mixing=mixing or prior(weight_by_size), aggregator=aggregator,
        server_optimizer=server_optimizer, cohort_loss=loss_before_fn(model))


register("fedavg", fedavg, HPARAMS, family="reference")
