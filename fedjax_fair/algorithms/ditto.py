"""Ditto — Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021 (arXiv:2012.04221), Algorithm 1.

The global model w is trained by FedAvg. Every client k also keeps a personal model
v_k (v_k = w^0 at the start) and, when sampled, takes local steps on its
personalised objective

    h_k(v_k; w^t) = F_k(v_k) + (lambda / 2) ||v_k - w^t||^2,
    v_k <- v_k - eta_p (grad F_k(v_k) + lambda (v_k - w^t)),

from the model it kept, towards the global model it received. Only the global
updates are aggregated; v_k never leaves the client. The algorithm is evaluated
personally: client k's accuracy is v_k's on its own test rows (clients never
sampled still hold w^0). lambda = 0 gives local training of independent models;
lambda -> inf ties v_k to w (FedAvg).

Pieces: the global update is FedAvg's local training; the personal update is its
``finish`` hook, a second masked SGD loop (``client.local_sgd``) with FedProx's
proximal term towards the broadcast model; v_k is the client's row, and
``personal_params`` reads it for evaluation.

Symbols -> arguments: lambda = ``lam`` (may be traced; the paper's grid
{0.01, 0.1, 1, 2}); eta_p = ``personal_lr`` (default: ``client_lr``); the personal
steps use the same batch size and epochs as the global ones (``personal_epochs``
to change the epochs). The global steps use ``client_optimizer`` (default SGD), the
personal ones ``personal_optimizer`` (default: ``client_optimizer``), each a
``rate -> optax transformation`` at its rate or a fixed transformation, its state
fresh every round. ``clip_norm`` clips every step of both loops (``clip_mode="loss"``:
the gradient of F_k alone, before lambda (v_k - w^t) is added).
"""
from __future__ import annotations

from typing import Optional

import optax

from fedjax_fair import hparams as H
from fedjax_fair.core.algorithm import FederatedAlgorithm, compose
from fedjax_fair.algorithms.families.training import (CLIENT_HPARAMS, Optimizer, Rate,
                                                      check_client, client_training)
from fedjax_fair.core.client import (check_optimizer, local_sgd, make_optimizer,
                                     proximal_term, round_value)
from fedjax_fair.core.mixing import prior

HPARAMS = {"lam": H.NONNEGATIVE,
           "personal_lr": H.Range(0.0, None, low_open=True, nullable=True),
           "personal_epochs": H.Range(1, None, integer=True, nullable=True),
           **CLIENT_HPARAMS}


def ditto(model, *, lam: float = 0.1, personal_lr: Optional[Rate] = None,
          personal_epochs: Optional[int] = None, client_lr: Rate = 0.1, batch_size: int = 20,
          num_epochs: int = 1, max_steps: Optional[int] = None,
          client_optimizer: Optional[Optimizer] = None,
          clip_norm: Optional[float] = None, clip_mode: str = "step",
          personal_optimizer: Optional[Optimizer] = None,
          client_table: str = "dense", weight_by_size: bool = True) -> FederatedAlgorithm:
    """Ditto: FedAvg for the global model (weights n_k, or 1 / |S| with
    ``weight_by_size=False``) and a personal model per client, evaluated personally.

    ``client_optimizer`` drives the global steps, ``personal_optimizer`` (default:
    ``client_optimizer``, then SGD) the personal ones; ``clip_norm`` / ``clip_mode``
    clip both. ``client_table``: "dense", "lazy" or "lazy:CAPACITY" storage of the
    personal models."""
    H.check(HPARAMS, lam=lam, personal_epochs=personal_epochs)
    if personal_lr is not None and not callable(personal_lr):
        HPARAMS["personal_lr"].check("personal_lr", personal_lr)
    check_client(client_lr, batch_size, num_epochs, max_steps, client_optimizer, clip_norm,
                 clip_mode)
    check_optimizer(personal_optimizer, "personal_optimizer")
    personal_rate = client_lr if personal_lr is None else personal_lr
    personal_opt = personal_optimizer or client_optimizer or optax.sgd
    prox = proximal_term(lam)
    train_personal = local_sgd(model, batch_size=batch_size,
                               num_epochs=personal_epochs or num_epochs, max_steps=max_steps,
                               regularizer=lambda v, broadcast: prox(v, broadcast, ()),
                               clip_norm=clip_norm, clip_mode=clip_mode)

    def finish(result, broadcast, personal, data, key):
        """v_k <- personal steps on F_k(v) + lambda/2 ||v - w^t||^2, from the kept v_k."""
        lr = round_value(personal_rate, broadcast.round)
        v, _, _ = train_personal(personal, make_optimizer(personal_opt, lr), data,
                                 result.step_budget, key, (broadcast,))
        return v, ()

    client = client_training(model, client_lr=client_lr, batch_size=batch_size,
                             num_epochs=num_epochs, max_steps=max_steps,
                             client_optimizer=client_optimizer,
                             clip_norm=clip_norm, clip_mode=clip_mode, finish=finish)
    return compose(client, mixing=prior(weight_by_size), client_state_init=lambda params: params,
                   client_table=client_table,
                   personal_params=lambda server_params, personal: personal)
