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

``CLIENT_HPARAMS`` are the local-training arguments every FedAvg-style factory
states in its signature; ``client_training`` builds that local training. Every step's
gradient may be clipped to global norm ``clip_norm`` (None: off; ``clip_mode`` "step"
clips loss plus regularizer, "loss" the loss alone; ``client.local_sgd``).
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import optax

from fedjax_fair import hparams as H
from fedjax_fair.aggregators import Aggregator
from fedjax_fair.algorithm import FederatedAlgorithm, compose
from fedjax_fair.client import (CLIP_NORM, check_clip, check_optimizer, check_rate_optimizer,
                                local_training)
from fedjax_fair.mixing import MixingRule, prior

Rate = Union[float, Callable]  # a number, a traced scalar, or a schedule of the round
Transform = optax.GradientTransformation
Optimizer = Union[Transform, Callable]  # fixed, or rate -> transformation (optax.sgd)

CLIENT_HPARAMS = {"client_lr": H.POSITIVE, "batch_size": H.COUNT, "num_epochs": H.COUNT,
                  "max_steps": H.Range(1, None, integer=True, nullable=True),
                  "clip_norm": CLIP_NORM}
WEIGHT_DECAY = {"weight_decay": H.NONNEGATIVE}  # coupled L2 of the local steps
HPARAMS = {**CLIENT_HPARAMS, **WEIGHT_DECAY}


def check_client(client_lr, batch_size, num_epochs, max_steps, client_optimizer=None,
                 clip_norm=None, clip_mode: str = "step") -> None:
    """Range checks of the local-training arguments (concrete values only; ``clip_norm``
    > 0 or None, ``clip_mode`` "step" or "loss") and the type of ``client_optimizer``
    (None, an optax transformation or a callable rate -> transformation; anything else,
    e.g. the string "adam", is a TypeError)."""
    if not callable(client_lr):
        CLIENT_HPARAMS["client_lr"].check("client_lr", client_lr)
    H.check(CLIENT_HPARAMS, batch_size=batch_size, num_epochs=num_epochs, max_steps=max_steps)
    check_clip(clip_norm, clip_mode)
    check_optimizer(client_optimizer, "client_optimizer")


def check_server_optimizer(server_optimizer) -> None:
    """``server_optimizer`` is None or an optax transformation (TypeError otherwise)."""
    check_optimizer(server_optimizer, "server_optimizer", rate_factory=False)


def client_training(model, *, client_lr: Rate = 0.1, batch_size: int = 20, num_epochs: int = 1,
                    max_steps: Optional[int] = None,
                    client_optimizer: Optional[Optimizer] = None,
                    regularizer: Optional[Callable] = None,
                    start=None, finish=None, track_loss: bool = True,
                    batch_loss: Optional[Callable] = None, weight_decay=0.0,
                    sam_radius=None, sam_eps=1e-2, clip_norm: Optional[float] = None,
                    clip_mode: str = "step"):
    """Local SGD shared by FedAvg-style methods (masked steps, optax optimizer).

    ``client_optimizer``: ``rate -> optax transformation`` (default ``optax.sgd``) or
    a fixed optax transformation. The other hooks (coupled ``weight_decay``, SAM steps
    with ``sam_radius``, gradient clipping ``clip_norm`` / ``clip_mode``) are
    ``client.local_training``'s."""
    check_client(client_lr, batch_size, num_epochs, max_steps, client_optimizer, clip_norm,
                 clip_mode)
    return local_training(model, client_lr=client_lr, optimizer=client_optimizer or optax.sgd,
                          batch_size=batch_size, num_epochs=num_epochs, max_steps=max_steps,
                          regularizer=regularizer, start=start, finish=finish,
                          track_loss=track_loss, batch_loss=batch_loss,
                          weight_decay=weight_decay, sam_radius=sam_radius, sam_eps=sam_eps,
                          clip_norm=clip_norm, clip_mode=clip_mode)


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
