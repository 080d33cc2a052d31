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
{0.01, 0.1, 1, 2}); the global steps are ``training`` (``ClientTraining``: eta_l =
``training.lr``, B = ``training.batch_size``, E = ``training.num_epochs``); eta_p =
``personal_lr`` (default: ``training.lr``); the personal steps use the same batch size,
step cap, weight decay and clipping as the global ones, and their epochs unless
``personal_epochs`` is given. The global steps use ``training.optimizer`` (default
SGD), the personal ones ``personal_optimizer`` (default: ``training.optimizer``), each
a ``rate -> optax transformation`` at its rate or a fixed transformation, its state
fresh every round. ``training.clip_norm`` clips every step of both loops
(``clip_mode="loss"``: the gradient of F_k alone, before lambda (v_k - w^t) is added).
"""
from __future__ import annotations

from typing import Optional

import optax

from fedjax_fair import hparams as H
from fedjax_fair.core.algorithm import FederatedAlgorithm, compose
from fedjax_fair.algorithms.families.training import Optimizer, Rate
from fedjax_fair.core.client import (ClientTraining, check_optimizer, local_sgd,
                                     local_training, make_optimizer, proximal_term,
                                     round_value)
from fedjax_fair.core.mixing import prior
from fedjax_fair.algorithms.registry import register

HPARAMS = {"lam": H.NONNEGATIVE,
           "personal_lr": H.Range(0.0, None, low_open=True, nullable=True),
           "personal_epochs": H.Range(1, None, integer=True, nullable=True)}


def ditto(model, *, lam: float = 0.1, personal_lr: Optional[Rate] = None,
          personal_epochs: Optional[int] = None, training: ClientTraining = ClientTraining(),
          personal_optimizer: Optional[Optimizer] = None,
          client_table: str = "dense", weight_by_size: bool = True) -> FederatedAlgorithm:
    """Ditto: FedAvg for the global model (weights n_k, or 1 / |S| with
    ``weight_by_size=False``) and a personal model per client, evaluated personally.

    ``training`` drives the global steps; ``personal_optimizer`` (default:
    ``training.optimizer``, then SGD) the personal ones, which share ``training``'s
    batch size, step cap, weight decay and clipping. ``client_table``: "dense", "lazy"
    or "lazy:CAPACITY" storage of the personal models."""
    H.check(HPARAMS, lam=lam, personal_epochs=personal_epochs)
    if personal_lr is not None and not callable(personal_lr):
        HPARAMS["personal_lr"].check("personal_lr", personal_lr)
    training.check()
    check_optimizer(personal_optimizer, "personal_optimizer")
    personal_rate = training.lr if personal_lr is None else personal_lr
    personal_opt = personal_optimizer or training.optimizer or optax.sgd
    prox = proximal_term(lam)
    train_personal = local_sgd(model, batch_size=training.batch_size,
                               num_epochs=personal_epochs or training.num_epochs,
                               max_steps=training.max_steps,
                               regularizer=lambda v, broadcast: prox(v, broadcast, ()),
                               weight_decay=training.weight_decay,
                               clip_norm=training.clip_norm, clip_mode=training.clip_mode)

    def finish(result, broadcast, personal, data, key):
        """v_k <- personal steps on F_k(v) + lambda/2 ||v - w^t||^2, from the kept v_k."""
        lr = round_value(personal_rate, broadcast.round)
        v, _, _ = train_personal(personal, make_optimizer(personal_opt, lr), data,
                                 result.step_budget, key, (broadcast,))
        return v, ()

    client = local_training(model, training, finish=finish)
    return compose(client, mixing=prior(weight_by_size), client_state_init=lambda params: params,
                   client_table=client_table,
                   personal_params=lambda server_params, personal: personal)


register("ditto", ditto, HPARAMS, family="personalised",
         search_space={"lam": (0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0)},
         search_source="DQN-Fed (TMLR, OpenReview KbteA50cni), Appendix H: lambda in {0.01, 0.05, 0.1, 0.5, 1, 2, 5}")
