"""FedProx — Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in
Heterogeneous Networks", MLSys 2020.

Client k approximately minimises the proximal objective (eq. 2)

    h_k(w; w^t) = F_k(w) + (mu / 2) ||w - w^t||^2

with local SGD, and the server averages as in FedAvg. With mu = 0 it is FedAvg.
Variable stragglers (partial work) are the ``step_budgets`` of the simulator.

Symbols -> arguments: mu = ``mu``; w^t = the server parameters.
"""
from __future__ import annotations

from fedjax_fair.algorithm import FederatedAlgorithm
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.client import proximal_term


def fedprox(model, *, mu: float = 0.01, **fedavg_kwargs) -> FederatedAlgorithm:
    """FedAvg whose clients add (mu / 2) ||w - w^t||^2; other arguments are FedAvg's."""
    return fedavg(model, regularizer=proximal_term(mu), **fedavg_kwargs)
