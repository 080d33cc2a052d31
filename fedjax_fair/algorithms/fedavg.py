"""FedAvg — McMahan, Moore, Ramage, Hampson, Agüera y Arcas, "Communication-Efficient
Learning of Deep Networks from Decentralized Data", AISTATS 2017 (arXiv:1602.05629).

Each round, client k runs E epochs of minibatch SGD (batch B, rate eta_l) from the
global model theta^t, and the server averages by data size:

    theta^{t+1} = sum_k (n_k / n) theta_k = theta^t - sum_k p_k Delta_k,
    Delta_k = theta^t - theta_k,  p_k = n_k / sum_{j in S} n_j.

Symbols -> arguments: eta_l = ``client_lr`` (a number, a traced scalar, or a
schedule of the round t, e.g. ``lambda t: 0.1 * 0.99 ** t``; or any
``client_optimizer``), E = ``num_epochs``, B = ``batch_size``; the server step is
``optax.sgd(1.0)``.

The local training is ``algorithms.families.training.client_training`` (shared by
every FedAvg-style method). Every step's gradient may be clipped to global norm
``clip_norm`` (None: off; ``clip_mode`` "step" clips loss plus regularizer, "loss" the
loss alone; ``core.client.local_sgd``).
"""
from __future__ import annotations

from typing import Callable, Optional

from fedjax_fair.algorithms.families.training import (CLIENT_HPARAMS, WEIGHT_DECAY, Optimizer,
                                                      Rate, Transform, check_server_optimizer,
                                                      client_training)
from fedjax_fair.core.aggregators import Aggregator
from fedjax_fair.core.algorithm import FederatedAlgorithm, compose
from fedjax_fair.core.mixing import MixingRule, prior

HPARAMS = {**CLIENT_HPARAMS, **WEIGHT_DECAY}


def fedavg(model, *, client_lr: Rate = 0.1, batch_size: int = 20, num_epochs: int = 1,
           max_steps: Optional[int] = None, client_optimizer: Optional[Optimizer] = None,
           clip_norm: Optional[float] = None, clip_mode: str = "step",
           server_optimizer: Optional[Transform] = None,
           mixing: Optional[MixingRule] = None, aggregator: Optional[Aggregator] = None,
           regularizer: Optional[Callable] = None,
           weight_by_size: bool = True, weight_decay: float = 0.0) -> FederatedAlgorithm:
    """FedAvg with data-size weights (``weight_by_size=False``: the simple average
    1 / |S|, q-FFL's partner of size-proportional sampling); ``server_optimizer``
    defaults to sgd(1.0).

    Pieces for composing: ``regularizer(params, broadcast, client_state)`` is added
    to every local batch loss (FedProx's proximal term); ``mixing`` (weights) and
    ``aggregator`` (default: the weighted mean) swap in other server rules, e.g.
    ``aggregators.step_normalized()`` for unequal local work. ``weight_decay``: coupled
    L2 in the local steps (gradient + wd theta; A-FedPD's Table 3 uses 1e-3).
    ``clip_norm`` / ``clip_mode``: gradient clipping of every local step
    (``client.local_sgd``)."""
    check_server_optimizer(server_optimizer)
    return compose(
        client_training(model, client_lr=client_lr, batch_size=batch_size,
                        num_epochs=num_epochs, max_steps=max_steps,
                        client_optimizer=client_optimizer, regularizer=regularizer,
                        weight_decay=weight_decay, clip_norm=clip_norm, clip_mode=clip_mode),
        mixing=mixing or prior(weight_by_size), aggregator=aggregator,
        server_optimizer=server_optimizer)
