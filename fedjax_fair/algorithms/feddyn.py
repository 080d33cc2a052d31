"""FedDyn — Acar, Zhao, Matas, Mattina, Whatmough, Saligrama, "Federated Learning
Based on Dynamic Regularization", ICLR 2021 (arXiv:2111.04263), Algorithm 1.

Every client i keeps the gradient of its last local objective, g_i = grad L_i at
its previous local model (g_i = 0 at the start), and solves the dynamically
regularised problem from the server model theta^{t-1}:

    theta_i^t = argmin_theta L_i(theta) - <g_i, theta> + (alpha / 2) ||theta - theta^{t-1}||^2,
    g_i <- g_i - alpha (theta_i^t - theta^{t-1}).

The server keeps h (h = 0 at the start) and, over the cohort P of a federation of
N clients,

    h <- h - (alpha / N) sum_{i in P} (theta_i^t - theta^{t-1}),
    theta^t = (1 / |P|) sum_{i in P} theta_i^t - h / alpha.

With Delta_i = theta^{t-1} - theta_i^t this is theta^t = theta^{t-1} - d with
d = (1 / |P|) sum Delta_i + h / alpha, the aggregator's direction (server step
sgd(1)). At a fixed point the clients' g_i sum to zero and every client's model
is the global optimum, which removes FedAvg's client-drift bias.

Pieces: the client objective's extra terms are the ``regularizer``, the g_i update
is the ``finish`` hook, h lives in the aggregator's state.

Symbols -> arguments: alpha = ``alpha`` (may be traced; the paper's grid {0.1,
0.01, 0.001}); the local solver is SGD with ``client_lr`` for ``num_epochs`` epochs
of batch ``batch_size`` (the argmin is approximate, as in the paper).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from fedjax_fair import hparams as H
from fedjax_fair.aggregators import Aggregator, weighted_sum
from fedjax_fair.algorithm import FederatedAlgorithm, compose
from fedjax_fair.algorithms.fedavg import CLIENT_HPARAMS, Optimizer, Rate, client_training
from fedjax_fair.client import inner, sq_distance
from fedjax_fair.mixing import prior

HPARAMS = {"alpha": H.POSITIVE, **CLIENT_HPARAMS}


class FedDynState(NamedTuple):
    h: object  # parameter-shaped
    inv_num_clients: jax.Array  # float32 [] 1 / N


def feddyn(model, *, alpha: float = 0.01, client_lr: Rate = 0.1, batch_size: int = 20,
           num_epochs: int = 1, max_steps: Optional[int] = None,
           client_optimizer: Optional[Optimizer] = None,
           client_table: str = "dense", weight_by_size: bool = False) -> FederatedAlgorithm:
    """FedDyn: local SGD on the dynamically regularised objective, server state h.
    The participants' models are averaged uniformly (the paper), or by n_k with
    ``weight_by_size``.

    ``client_table``: "dense", "lazy" or "lazy:CAPACITY" storage of the clients' g_i."""
    H.check(HPARAMS, alpha=alpha)

    def regularizer(params, broadcast, grad_i):
        return -inner(grad_i, params) + 0.5 * alpha * sq_distance(params, broadcast.params)

    def finish(result, broadcast, grad_i, data, key):
        del data, key
        new = jax.tree.map(lambda g, th, s: g - alpha * (th - s), grad_i, result.params,
                           broadcast.params)
        return new, ()

    def init(params, num_clients):
        return FedDynState(jax.tree.map(jnp.zeros_like, params),
                           jnp.asarray(1.0 / num_clients, jnp.float32))

    def aggregate(state, outputs, weights, ctx):
        reported = ctx.client_mask.astype(jnp.float32) * state.inv_num_clients
        h = jax.tree.map(lambda h, s: h + alpha * s, state.h,
                         weighted_sum(outputs.delta, reported))
        mean = weighted_sum(outputs.delta, weights)
        direction = jax.tree.map(lambda m, hh: m + hh / alpha, mean, h)
        return direction, FedDynState(h, state.inv_num_clients), {}

    client = client_training(model, client_lr=client_lr, batch_size=batch_size,
                             num_epochs=num_epochs, max_steps=max_steps,
                             client_optimizer=client_optimizer, regularizer=regularizer,
                             finish=finish)
    return compose(client, mixing=prior(weight_by_size), aggregator=Aggregator(init, aggregate),
                   client_state_init=lambda params: jax.tree.map(jnp.zeros_like, params),
                   client_table=client_table)
