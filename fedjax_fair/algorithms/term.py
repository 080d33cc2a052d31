"""TERM — Li, Beirami, Sanjabi, Smith, "Tilted Empirical Risk Minimization", ICLR 2021,
arXiv:2007.01162 (client-level tilt, as used for fair FL; a baseline of the AAggFF thesis, appendix §8.1,
eqs. 3.19-3.20, and of DQN-Fed, TMLR, OpenReview KbteA50cni).

The tilted objective over clients

    min_w (1 / t) log( sum_k p_k exp(t F_k(w)) ),   p_k = n_k / n,

has gradient sum_k w_k grad F_k with softmax weights, so with the client's model
delta in place of its gradient the server step is

    w_k = p_k exp(t F_k) / sum_{j in S} p_j exp(t F_j)
        = softmax_k(t F_k + log n_k)                         (log-sum-exp, stable)
    theta^{t+1} = theta^t - sum_k w_k Delta_k,   Delta_k = theta^t - theta_k.

F_k = F_k(theta^t) is the server model's loss on client k's training rows,
measured before local training (``ClientOutput.loss_before``). t > 0 up-weights
high-loss clients (fairness); t -> 0 gives FedAvg's data weights n_k / n; t < 0
down-weights them (robustness to outliers). The thesis form keeps the n_k prior
(eq. 3.20); the reference code and DQN-Fed's softmax_k(t F_k) drop it:
``weight_by_size=False`` (uniform prior, t -> 0 gives 1 / |S|).

Symbols -> arguments: t (the paper's tilt; the thesis's lambda) = ``tilt``;
p_k = n_k / n if ``weight_by_size`` else uniform. Grids: lambda in {0.1, 1, 10}
(thesis), t in {0.1, 0.5, 1, 2, 5} (DQN-Fed); the reference scripts select 0.1.
Empty clients (n_k = 0) and masked rows get weight 0.
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from fedjax_fair import hparams as H
from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.algorithms.families.training import Transform
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.core.mixing import MixingRule, exponentiated
from fedjax_fair.solvers.simplex import exponentiated_gradient
from fedjax_fair.algorithms.registry import register

HPARAMS = {"tilt": H.REAL}


def term_weights(losses, prior, mask, tilt):
    """w_k = prior_k exp(t F_k) / sum_{j in mask} prior_j exp(t F_j) (log-sum-exp).

    Parameters
    ----------
    losses : float array [K]
        F_k(theta^t).
    prior : float array [K]
        p_k >= 0 (n_k for the thesis form, ones for the reference code).
    mask : bool array [K]
        Rows to weight; the rest get 0.
    tilt : float or traced scalar
        t; t = 0 returns ``prior`` normalised over the mask.
    """
    return exponentiated_gradient(tilt * jnp.asarray(losses, jnp.float32), prior, mask)


def term_mixing(tilt=0.1, *, weight_by_size: bool = True) -> MixingRule:
    """TERM's client-level tilt as a stateless ``MixingRule`` (see the module doc)."""
    H.check(HPARAMS, tilt=tilt)
    return exponentiated(lambda out: tilt * out.loss_before, weight_by_size)


def term(model, *, tilt: float = 0.1, weight_by_size: bool = True,
         training: ClientTraining = ClientTraining(),
         server_optimizer: Optional[Transform] = None) -> FederatedAlgorithm:
    """FedAvg local training with TERM's tilted aggregation weights."""
    return fedavg(model, mixing=term_mixing(tilt, weight_by_size=weight_by_size),
                  training=training, server_optimizer=server_optimizer)


register("term", term, HPARAMS, family="fair",
         search_space={"tilt": (0.1, 1.0, 10.0)},
         search_source="Hahn's PhD thesis (UNIST 2024; AAggFF, arXiv:2405.20821), its fair baselines' grid: lambda in {0.1, 1, 10}")
