"""FedADMM — Wang, Marella, Anderson, "FedADMM: A Federated Primal-Dual Algorithm
Allowing Partial Participation", CDC 2022 (arXiv:2203.15104); Gong, Li, Freris,
"FedADMM: A Robust Federated Deep Learning Framework with Adaptivity to System
Heterogeneity", ICDE 2022 (arXiv:2204.03529). Implemented as the A-FedPD paper
writes it (eq. 6 of arXiv:2409.18915, with g = 0, the average of the active augmented models only):

    active i:   K local steps from theta^t on
                f_i(theta) + <lambda_i, theta - theta^t> + (rho / 2) ||theta - theta^t||^2,
                lambda_i^{t+1} = lambda_i^t + rho (theta_i^{t+1} - theta^t)
    inactive i: lambda_i unchanged
    server:     theta^{t+1} = (1 / P) sum_{i in P} (theta_i^{t+1} + lambda_i^{t+1} / rho).

Only the cohort's augmented models enter the server step, so a client's stale dual
(sampled tens of rounds ago at 10% participation) pulls its next local solve in an
outdated direction: the "dual drift" A-FedPD removes. FedADMM is kept as the
demonstration of that instability (tests/test_afedpd.py, T8: it does not converge on the
heterogeneous quadratics where A-FedPD does). Under full participation it is FedPD
and A-FedPD.

Pieces (primal_dual.py): ``augmented_lagrangian``, ``dual_ascent(report=True)``
(the new duals go up as ``extra``), ``primal_dual_aggregator("cohort")``.
Symbols -> arguments as in afedpd.py.
"""
from __future__ import annotations

from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.algorithms.families.primal_dual import HPARAMS as PD_HPARAMS
from fedjax_fair.algorithms.families.primal_dual import TRAINING, primal_dual
from fedjax_fair.algorithms.registry import register

HPARAMS = dict(PD_HPARAMS)


def fedadmm(model, *, rho: float = 0.1, training: ClientTraining = TRAINING,
            client_table: str = "dense", weight_by_size: bool = False,
            evaluate: str = "average") -> FederatedAlgorithm:
    """FedADMM: duals updated only when sampled, theta the cohort's mean augmented
    model (equation 6 with g = 0). ``evaluate``: "average" (theta-bar) or "server"
    (theta)."""
    return primal_dual(model, rho=rho, rule="cohort", training=training,
                       client_table=client_table, weight_by_size=weight_by_size,
                       evaluate=evaluate)


register("fedadmm", fedadmm, HPARAMS, family="primal_dual",
         search_space={"rho": (0.001, 0.01, 0.1, 1.0)},
         search_source="A-FedPD (arXiv:2409.18915), Table 3: rho in {1e-3, 1e-2, 0.1, 1}")
