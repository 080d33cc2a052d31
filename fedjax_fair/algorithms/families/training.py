"""FedAvg-style local training, shared by the methods built on it.

Every FedAvg-style factory takes its local training as one value,
``training: ClientTraining`` (``core.client``: rate or schedule, batch size, epochs,
step cap, optax optimizer, weight decay, clipping), and builds its client update
with ``core.client.local_training(model, training, ...)`` plus the hooks it adds: a
``regularizer`` added to every batch loss (FedProx's proximal term, the primal-dual
family's augmented Lagrangian), ``start`` / ``finish``, SAM steps. A factory states
only its own hyper-parameters; ``ClientTraining()`` holds the one set of defaults.
"""
from __future__ import annotations

from typing import Callable, Union

import optax

from fedjax_fair.core.client import ClientTraining, check_optimizer

Rate = Union[float, Callable]  # a number, a traced scalar, or a schedule of the round
Transform = optax.GradientTransformation
Optimizer = Union[Transform, Callable]  # fixed, or rate -> transformation (optax.sgd)

__all__ = ["ClientTraining", "Optimizer", "Rate", "Transform", "check_server_optimizer"]


def check_server_optimizer(server_optimizer) -> None:
    """``server_optimizer`` is None or an optax transformation (TypeError otherwise)."""
    check_optimizer(server_optimizer, "server_optimizer", rate_factory=False)
