"""FedPD — Zhang, Hong, Dhople, Yin, Liu, "FedPD: A Federated Learning Framework with
Adaptivity to Non-IID Data", IEEE TSP 2021 (arXiv:2005.11418), in the
full-participation form the A-FedPD paper writes (eq. 5 of arXiv:2409.18915):

    every i:  theta_i^{t+1} = argmin_theta f_i(theta) + <lambda_i^t, theta - theta^t>
                                 + (rho / 2) ||theta - theta^t||^2   (K local steps)
              lambda_i^{t+1} = lambda_i^t + rho (theta_i^{t+1} - theta^t)
    server:   theta^{t+1} = (1 / C) sum_i (theta_i^{t+1} + lambda_i^{t+1} / rho),

the exact minimiser of the augmented Lagrangian over theta. Every client every round
(registered with participation "full"); then A-FedPD, FedDyn and FedADMM give the
same iterates (tests/test_afedpd.py, T4). FedPD's communication skipping (a client solving again
without a server round) is not part of this form.

Pieces: FedADMM's (``primal_dual_aggregator("cohort")``).
"""
from __future__ import annotations

from typing import Optional

from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.algorithms.families.training import Optimizer, Rate
from fedjax_fair.algorithms.families.primal_dual import HPARAMS as PD_HPARAMS
from fedjax_fair.algorithms.families.primal_dual import primal_dual

HPARAMS = dict(PD_HPARAMS)


def fedpd(model, *, rho: float = 0.1, client_lr: Rate = 0.1, batch_size: int = 50,
          num_epochs: int = 1, max_steps: Optional[int] = None,
          client_optimizer: Optional[Optimizer] = None, weight_decay: float = 0.0,
          clip_norm: Optional[float] = None, clip_mode: str = "step",
          client_table: str = "dense", evaluate: str = "average") -> FederatedAlgorithm:
    """FedPD: every client solves its augmented Lagrangian and ascends its dual;
    theta is the mean augmented model (equation 5). Needs full participation."""
    return primal_dual(model, rho=rho, rule="cohort", client_lr=client_lr,
                       batch_size=batch_size, num_epochs=num_epochs, max_steps=max_steps,
                       client_optimizer=client_optimizer,
                       clip_norm=clip_norm, clip_mode=clip_mode, weight_decay=weight_decay,
                       client_table=client_table, weight_by_size=False, evaluate=evaluate)
