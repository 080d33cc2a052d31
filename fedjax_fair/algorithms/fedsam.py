"""FedSAM — Qu, Li, Duan, Liu, Tang, Lu, "Generalized Federated Learning via
Sharpness Aware Minimization", ICML 2022 (arXiv:2206.02618).

FedAvg whose clients take sharpness-aware (SAM) local steps. Client k runs K steps
from theta^t; each step draws one minibatch B and evaluates two gradients on it:

    g0 = grad f_k(theta; B),
    e  = r g0 / (||g0|| + eps),                  (||.|| global over the pytree)
    theta <- theta - eta_l ( grad f_k(theta + e; B) + wd theta ),

the weight decay (coupled L2) taken at the unperturbed point. The server averages
as FedAvg:

    theta^{t+1} = theta^t - eta_g sum_k p_k Delta_k,   Delta_k = theta^t - theta_k.

With r = 0 the step is plain SGD, so FedSAM is FedAvg.

Symbols -> arguments: r = ``sam_radius`` (may be traced), eps = ``sam_eps``,
eta_l = ``client_lr`` (a number, a traced scalar or a schedule of the round),
wd = ``weight_decay``, eta_g = ``server_lr``, K = the local steps (``num_epochs`` x
ceil(n_k / B), capped by ``max_steps``), B = ``batch_size``; p_k = 1 / |S| (the
A-FedPD paper's uniform average of the active models), n_k / n with ``weight_by_size``.
"""
from __future__ import annotations

from typing import Optional

import optax

from fedjax_fair import hparams as H
from fedjax_fair.core.algorithm import FederatedAlgorithm, compose
from fedjax_fair.algorithms.families.training import (CLIENT_HPARAMS, WEIGHT_DECAY, Optimizer,
                                                      Rate, client_training)
from fedjax_fair.core.mixing import prior

HPARAMS = {"sam_radius": H.NONNEGATIVE, "sam_eps": H.POSITIVE, "server_lr": H.POSITIVE,
           **CLIENT_HPARAMS, **WEIGHT_DECAY}


def fedsam(model, *, sam_radius: float = 0.05, sam_eps: float = 1e-2,
           client_lr: Rate = 0.1, batch_size: int = 20, num_epochs: int = 1,
           max_steps: Optional[int] = None, client_optimizer: Optional[Optimizer] = None,
           clip_norm: Optional[float] = None, clip_mode: str = "step", server_lr: float = 1.0,
           weight_decay: float = 0.0, weight_by_size: bool = False) -> FederatedAlgorithm:
    """FedSAM: SAM local steps of radius ``sam_radius``, FedAvg server step
    ``optax.sgd(server_lr)`` on the mean delta (weights 1 / |S|, or n_k / n with
    ``weight_by_size``). ``client_optimizer`` steps along the SAM gradient, which
    ``clip_norm`` clips before the weight decay is added (FedSAM has no other
    regularizer, so both ``clip_mode`` forms coincide)."""
    H.check(HPARAMS, sam_radius=sam_radius, sam_eps=sam_eps, server_lr=server_lr,
            weight_decay=weight_decay)
    client = client_training(model, client_lr=client_lr, batch_size=batch_size,
                             num_epochs=num_epochs, max_steps=max_steps,
                             client_optimizer=client_optimizer,
                             clip_norm=clip_norm, clip_mode=clip_mode,
                             weight_decay=weight_decay, sam_radius=sam_radius,
                             sam_eps=sam_eps)
    return compose(client, mixing=prior(weight_by_size), server_optimizer=optax.sgd(server_lr))
