"""FedAvg-style local training, shared by the methods built on it.

``client_training`` is E epochs of minibatch SGD (batch B, rate eta_l; any optax
``client_optimizer``) from the broadcast model, with the hooks the methods add: a
``regularizer`` added to every batch loss (FedProx's proximal term, the primal-dual
family's augmented Lagrangian), coupled ``weight_decay``, SAM steps, gradient clipping
(``core.client.local_training``). ``CLIENT_HPARAMS`` are the local-training arguments
every FedAvg-style factory states in its signature, with their ranges.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import optax

from fedjax_fair import hparams as H
from fedjax_fair.core.client import CLIP_NORM, check_clip, check_optimizer, local_training

Rate = Union[float, Callable]  # a number, a traced scalar, or a schedule of the round
Transform = optax.GradientTransformation
Optimizer = Union[Transform, Callable]  # fixed, or rate -> transformation (optax.sgd)

CLIENT_HPARAMS = {"client_lr": H.POSITIVE, "batch_size": H.COUNT, "num_epochs": H.COUNT,
                  "max_steps": H.Range(1, None, integer=True, nullable=True),
                  "clip_norm": CLIP_NORM}
WEIGHT_DECAY = {"weight_decay": H.NONNEGATIVE}  # coupled L2 of the local steps


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
