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
eta_l = ``training.lr`` (a number, a traced scalar or a schedule of the round),
wd = ``training.weight_decay``, eta_g = ``server_lr``, K = the local steps
(``training.num_epochs`` x ceil(n_k / B), capped by ``training.max_steps``), B =
``training.batch_size`` (``ClientTraining``); p_k = 1 / |S| (the
A-FedPD paper's uniform average of the active models), n_k / n with ``weight_by_size``.
"""
from __future__ import annotations

import optax

from fedjax_fair import hparams as H
from fedjax_fair.core.algorithm import FederatedAlgorithm, compose
from fedjax_fair.core.client import ClientTraining, local_training
from fedjax_fair.core.mixing import prior
from fedjax_fair.algorithms.registry import register

HPARAMS = {"sam_radius": H.NONNEGATIVE, "sam_eps": H.POSITIVE, "server_lr": H.POSITIVE}


def fedsam(model, *, sam_radius: float = 0.05, sam_eps: float = 1e-2,
           training: ClientTraining = ClientTraining(), server_lr: float = 1.0,
           weight_by_size: bool = False) -> FederatedAlgorithm:
    """FedSAM: SAM local steps of radius ``sam_radius``, FedAvg server step
    ``optax.sgd(server_lr)`` on the mean delta (weights 1 / |S|, or n_k / n with
    ``weight_by_size``). ``training.optimizer`` steps along the SAM gradient, which
    ``training.clip_norm`` clips before the weight decay is added (FedSAM has no other
    regularizer, so both ``clip_mode`` forms coincide)."""
    H.check(HPARAMS, sam_radius=sam_radius, sam_eps=sam_eps, server_lr=server_lr)
    client = local_training(model, training, sam_radius=sam_radius, sam_eps=sam_eps)
    return compose(client, mixing=prior(weight_by_size), server_optimizer=optax.sgd(server_lr))


register("fedsam", fedsam, HPARAMS, family="primal_dual", server_rate="server_lr",
         search_space={"sam_radius": (0.01, 0.05, 0.1, 0.5)},
         search_source="A-FedPD (arXiv:2409.18915), Table 3: r in {0.01, 0.05, 0.1, 0.5}")
