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

from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.algorithms.families.primal_dual import HPARAMS as PD_HPARAMS
from fedjax_fair.algorithms.families.primal_dual import TRAINING, primal_dual
from fedjax_fair.algorithms.registry import register

HPARAMS = dict(PD_HPARAMS)


def fedpd(model, *, rho: float = 0.1, training: ClientTraining = TRAINING,
          client_table: str = "dense", evaluate: str = "average") -> FederatedAlgorithm:
    """FedPD: every client solves its augmented Lagrangian and ascends its dual;
    theta is the mean augmented model (equation 5). Needs full participation."""
    return primal_dual(model, rho=rho, rule="cohort", training=training,
                       client_table=client_table, weight_by_size=False, evaluate=evaluate)


register("fedpd", fedpd, HPARAMS, family="primal_dual", participation="full", size_prior=None,
         search_space={"rho": (0.001, 0.01, 0.1, 1.0)},
         search_source="A-FedPD (arXiv:2409.18915), Table 3: rho in {1e-3, 1e-2, 0.1, 1}")
