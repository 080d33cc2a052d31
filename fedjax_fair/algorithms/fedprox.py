"""FedProx — Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in
Heterogeneous Networks", MLSys 2020 (arXiv:1812.06127).

Client k approximately minimises the proximal objective (eq. 2)

    h_k(w; w^t) = F_k(w) + (mu / 2) ||w - w^t||^2

with local SGD, and the server averages as in FedAvg. With mu = 0 it is FedAvg.
Variable stragglers (partial work) are the ``step_budgets`` of the simulator.

Symbols -> arguments: mu = ``mu`` (may be traced); w^t = the broadcast parameters.
"""
from __future__ import annotations

from typing import Optional

from fedjax_fair import hparams as H
from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.algorithms.families.training import CLIENT_HPARAMS, Optimizer, Rate, Transform
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.core.client import proximal_term

HPARAMS = {"mu": H.NONNEGATIVE, **CLIENT_HPARAMS}


def fedprox(model, *, mu: float = 0.01, client_lr: Rate = 0.1, batch_size: int = 20,
            num_epochs: int = 1, max_steps: Optional[int] = None,
            client_optimizer: Optional[Optimizer] = None,
            clip_norm: Optional[float] = None, clip_mode: str = "step",
            server_optimizer: Optional[Transform] = None,
            weight_by_size: bool = True) -> FederatedAlgorithm:
    """FedAvg whose clients add (mu / 2) ||w - w^t||^2 to their batch loss (weights
    n_k, or 1 / |S| with ``weight_by_size=False``)."""
    H.check(HPARAMS, mu=mu)
    return fedavg(model, client_lr=client_lr, batch_size=batch_size, num_epochs=num_epochs,
                  max_steps=max_steps, client_optimizer=client_optimizer,
                  clip_norm=clip_norm, clip_mode=clip_mode,
                  server_optimizer=server_optimizer, regularizer=proximal_term(mu),
                  weight_by_size=weight_by_size)
