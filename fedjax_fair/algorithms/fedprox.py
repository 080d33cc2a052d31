"""FedProx — Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in
Heterogeneous Networks", MLSys 2020.

Client k approximately minimises the proximal objective (eq. 2)

    h_k(w; w^t) = F_k(w) + (mu / 2) ||w - w^t||^2

with local SGD, and the server averages as in FedAvg. With mu = 0 it is FedAvg.
Variable stragglers (partial work) are the ``step_budgets`` of the simulator.

Symbols -> arguments: mu = ``mu``; w^t = the server parameters.
"""
from __future__ import annotations

from typing import Optional

from fedjax_fair.algorithm import FederatedAlgorithm, compose
from fedjax_fair.algorithms.fedavg import client_training
from fedjax_fair.client import proximal_term
from fedjax_fair.mixing import by_num_examples


def fedprox(model, *, mu: float = 0.01, client_lr: float = 0.1, client_optimizer=None,
            batch_size: int = 20, num_epochs: int = 1, max_steps: Optional[int] = None,
            server_optimizer=None, mixing=None, execution: str = "auto",
            chunk_size: Optional[int] = None, track_improvement: bool = False,
            track_loss: bool = True, unroll: Optional[int] = None) -> FederatedAlgorithm:
    return compose(
        client_training(model, client_lr=client_lr, client_optimizer=client_optimizer,
                        batch_size=batch_size, num_epochs=num_epochs, max_steps=max_steps,
                        regularizer=proximal_term(mu), track_loss=track_loss,
                        unroll=unroll),
        mixing=mixing or by_num_examples(), server_optimizer=server_optimizer,
        execution=execution, chunk_size=chunk_size,
        improvement_model=model if track_improvement else None)
