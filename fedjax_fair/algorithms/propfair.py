"""PropFair — Zhang, Malekmohammadi, Chen, Yu, "Proportional Fairness in Federated
Learning", TMLR 2023, arXiv:2202.01666 (aggregation form of spec/aaggff.md §5, thesis
eq. 3.21-3.23).

PropFair maximises the Nash social welfare of the clients' utilities M - F_k:

    min_theta  - sum_k (n_k / n) log(M - F_k(theta)),   M >= 1 (the "baseline").

Its gradient is sum_k (n_k / n) grad F_k / (M - F_k); with the client's delta in
place of its gradient, the server step is

    w_k = (n_k / (M - F_k)) / sum_{j in S} n_j / (M - F_j),
    theta^{t+1} = theta^t - sum_k w_k Delta_k,   Delta_k = theta^t - theta_k,

an exponentiated-gradient step with response r_k = -log(M - F_k) and zeta = 1.
F_k = F_k(theta^t) is ``ClientOutput.loss_before``.

Losses at or above M (spec/aaggff.md §5, §9.10): the formula needs F_k < M, so the
utility is clipped, M - F_k >= ``eps``. Every client with F_k >= M - eps then
gets the same, largest per-example weight n_k / eps (0 < eps <= M, checked in
Python for concrete values). The default eps = 0.2 is the
margin at which the reference code leaves the log utility. (The reference code's
other form — the client loss -log(1 - l / M) per minibatch, aggregated by FedAvg,
spec's ``propfair_mode="client"`` — needs a batch-loss hook in client.py and is not
provided here.)

Symbols -> arguments: M = ``baseline`` (grid {2, 3, 5}; the reference scripts
select 2 or 3); n_k / n = data weights if ``weight_by_size`` (thesis) else uniform;
the clip = ``eps``. Masked rows and empty clients get weight 0.
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from fedjax_fair import hparams as H
from fedjax_fair.algorithm import FederatedAlgorithm
from fedjax_fair.algorithms.fedavg import CLIENT_HPARAMS, Optimizer, Rate, Transform, fedavg
from fedjax_fair.mixing import MixingRule, loss_rule, size_prior
from fedjax_fair.solvers.simplex import exponentiated_gradient

HPARAMS = {"baseline": H.POSITIVE, "eps": H.POSITIVE, **CLIENT_HPARAMS}


def _check(baseline, eps) -> None:
    H.check(HPARAMS, baseline=baseline, eps=eps)
    if H.is_concrete(baseline) and H.is_concrete(eps) and eps > baseline:
        raise ValueError(f"eps: must be in (0, baseline], got {eps!r} > {baseline!r}")


def propfair_weights(losses, prior, mask, baseline=2.0, eps=0.2):
    """w_k ∝ prior_k / max(M - F_k, eps) over ``mask`` (0 elsewhere).

    Parameters
    ----------
    losses : float array [K]
        F_k(theta^t).
    prior : float array [K]
        n_k (thesis) or ones.
    mask : bool array [K]
    baseline : float or traced scalar
        M.
    eps : float or traced scalar
        Smallest utility M - F_k used (clip for F_k >= M - eps).
    """
    utility = jnp.maximum(baseline - jnp.asarray(losses, jnp.float32), eps)
    return exponentiated_gradient(-jnp.log(utility), prior, mask)


def propfair_mixing(baseline=2.0, *, eps=0.2, weight_by_size: bool = True) -> MixingRule:
    """PropFair's proportional-fairness weights as a stateless ``MixingRule``."""
    _check(baseline, eps)
    return loss_rule(lambda out, mask: propfair_weights(
        out.loss_before, size_prior(out, weight_by_size), mask, baseline, eps))


def propfair(model, *, baseline: float = 2.0, eps: float = 0.2, weight_by_size: bool = True,
             client_lr: Rate = 0.1, batch_size: int = 20, num_epochs: int = 1,
             max_steps: Optional[int] = None, client_optimizer: Optional[Optimizer] = None,
             server_optimizer: Optional[Transform] = None) -> FederatedAlgorithm:
    """FedAvg local training with PropFair's aggregation weights."""
    return fedavg(model, mixing=propfair_mixing(baseline, eps=eps,
                                                weight_by_size=weight_by_size),
                  client_lr=client_lr, batch_size=batch_size, num_epochs=num_epochs,
                  max_steps=max_steps, client_optimizer=client_optimizer,
                  server_optimizer=server_optimizer)
