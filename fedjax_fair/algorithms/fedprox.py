"""FedProx — Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in
Heterogeneous Networks", MLSys 2020 (arXiv:1812.06127).

Client k approximately minimises the proximal objective (eq. 2)

    h_k(w; w^t) = F_k(w) + (mu / 2) ||w - w^t||^2

with local SGD, and the server averages as in FedAvg. With mu = 0 it is FedAvg.
Variable stragglers (partial work) are the ``step_budgets`` of the simulator.

Symbols -> arguments: mu = ``mu`` (may be traced); w^t = the broadcast parameters;
the local SGD is ``training`` (``ClientTraining``: eta_l = ``training.lr``, B =
``training.batch_size``, E = ``training.num_epochs``).
"""
from __future__ import annotations

from typing import Optional

from fedjax_fair import hparams as H
from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.algorithms.families.training import Transform
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.core.client import ClientTraining, proximal_term
from fedjax_fair.algorithms.registry import register

HPARAMS = {"mu": H.NONNEGATIVE}


def fedprox(model, *, mu: float = 0.01, training: ClientTraining = ClientTraining(),
            server_optimizer: Optional[Transform] = None,
            weight_by_size: bool = True) -> FederatedAlgorithm:
    """FedAvg whose clients add (mu / 2) ||w - w^t||^2 to their batch loss (weights
    n_k, or 1 / |S| with ``weight_by_size=False``)."""
    H.check(HPARAMS, mu=mu)
    return fedavg(model, training=training, server_optimizer=server_optimizer,
                  regularizer=proximal_term(mu),
                  weight_by_size=weight_by_size)


register("fedprox", fedprox, HPARAMS, family="primal_dual",
         search_space={"mu": (0.001, 0.01, 0.1, 1.0)},
         search_source="FedProx (arXiv:1812.06127), Section 5: mu in {0.001, 0.01, 0.1, 1}")
