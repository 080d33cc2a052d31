"""PropFair — Zhang, Malekmohammadi, Chen, Yu, "Proportional Fairness in Federated
Learning", TMLR 2023, arXiv:2202.01666: the aggregation form of the AAggFF thesis (Hahn, UNIST 2024,
appendix §8.1, eqs. 3.21-3.23; default), and the authors' client-loss form (``mode="client"``).

PropFair maximises the Nash social welfare of the clients' utilities M - F_k:

    min_theta  - sum_k (n_k / n) log(M - F_k(theta)),   M >= 1 (the "baseline").

Its gradient is sum_k (n_k / n) grad F_k / (M - F_k); with the client's delta in
place of its gradient, the server step is

    w_k = (n_k / (M - F_k)) / sum_{j in S} n_j / (M - F_j),
    theta^{t+1} = theta^t - sum_k w_k Delta_k,   Delta_k = theta^t - theta_k,

an exponentiated-gradient step with response r_k = -log(M - F_k) and zeta = 1.
F_k = F_k(theta^t) is ``ClientOutput.loss_before``.

Losses at or above M (the thesis does not treat them; we clip): the formula needs F_k < M, so the
utility is clipped, M - F_k >= ``eps``. Every client with F_k >= M - eps then
gets the same, largest per-example weight n_k / eps (0 < eps <= M, checked in
Python for concrete values). The default eps = 0.2 is the
margin at which the reference code leaves the log utility.

``mode="client"`` is the authors' implementation instead (AAggFF code, commit
3932c3d, ``src/client/propfairclient.py``): each local minibatch with mean
loss l minimises

    -log(1 - l / M)   if M - l >= eps,      l / M   if M - l < eps  (eps = 0.2 there),

whose gradient is grad l / (M - l) on the log side (grad l / M past the switch; the
value jumps there), and the server averages with FedAvg's weights n_k (uniform with
``weight_by_size=False``, as the authors' cross-device runs do). The batch objective
is local training's ``batch_loss`` hook (``client_objective``), l the mean over the
batch's real rows, partial batches included. ``loss_before`` and ``train_loss`` stay
the model's own loss.

Symbols -> arguments: M = ``baseline`` (grid {2, 3, 5}; the reference scripts
select 2 or 3); n_k / n = data weights if ``weight_by_size`` (thesis) else uniform;
the clip / switch margin = ``eps``; the form = ``mode`` ("mixing" or "client"); the
local training = ``training`` (``ClientTraining``: eta_l = ``training.lr``).
Masked rows get weight 0; so do empty clients, except under the uniform average of
``mode="client", weight_by_size=False`` (their delta is 0). ``baseline`` and ``eps``
may be traced in both modes (the run is differentiable in M).
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from fedjax_fair import hparams as H
from fedjax_fair.core.algorithm import FederatedAlgorithm, compose
from fedjax_fair.algorithms.families.training import Transform
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.core.client import ClientTraining, local_training, masked_mean
from fedjax_fair.core.mixing import MixingRule, exponentiated, prior
from fedjax_fair.solvers.simplex import exponentiated_gradient
from fedjax_fair.algorithms.registry import register

HPARAMS = {"baseline": H.POSITIVE, "eps": H.POSITIVE}
MODES = ("mixing", "client")


def _check(baseline, eps, mode: str = "mixing") -> None:
    if mode not in MODES:
        raise H.FieldError("mode", f"must be one of {MODES}, got {mode!r}")
    H.check(HPARAMS, baseline=baseline, eps=eps)
    if H.is_concrete(baseline) and H.is_concrete(eps) and eps > baseline:
        raise H.FieldError("eps", f"must be in (0, baseline], got {eps!r} > {baseline!r}")


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
    return exponentiated_gradient(_response(losses, baseline, eps), prior, mask)


def _response(losses, baseline, eps):
    """-log max(M - F_k, eps), PropFair's exponentiated-gradient response."""
    return -jnp.log(jnp.maximum(baseline - jnp.asarray(losses, jnp.float32), eps))


def propfair_mixing(baseline=2.0, *, eps=0.2, weight_by_size: bool = True) -> MixingRule:
    """PropFair's proportional-fairness weights as a stateless ``MixingRule``."""
    _check(baseline, eps)
    return exponentiated(lambda out: _response(out.loss_before, baseline, eps), weight_by_size)


# ------------------------------------------------------------------ client form


def client_batch_loss(mean_loss, baseline=2.0, eps=0.2):
    """The authors' PropFair loss of one minibatch from its mean loss l:

        -log(1 - l / M)   if M - l >= eps,      l / M   if M - l < eps.

    d/dl: 1 / (M - l) on the log side, 1 / M on the linear side. The unused branch
    is evaluated on a safe value, so neither the value nor the gradient (in the
    parameters or in M) is ever NaN. ``baseline`` (M) and ``eps`` may be traced.
    """
    mean_loss = jnp.asarray(mean_loss)
    linear = baseline - mean_loss < eps
    ratio = mean_loss / baseline
    return jnp.where(linear, ratio, -jnp.log1p(-jnp.where(linear, 0.0, ratio)))


def client_objective(baseline=2.0, eps=0.2):
    """The ``batch_loss`` of ``mode="client"`` (``client.local_training``): the
    PropFair loss ``client_batch_loss(l, M, eps)`` of the batch's mean loss l over its
    real rows (masked rows hold 0 and are not counted)."""
    def batch_loss(per_example, batch_mask):
        return client_batch_loss(masked_mean(per_example, batch_mask), baseline, eps)

    return batch_loss


# ------------------------------------------------------------------ factory


def propfair(model, *, baseline: float = 2.0, eps: float = 0.2, weight_by_size: bool = True,
             mode: str = "mixing", training: ClientTraining = ClientTraining(),
             server_optimizer: Optional[Transform] = None) -> FederatedAlgorithm:
    """PropFair. ``mode="mixing"`` (default, thesis eq. 3.21-3.23): FedAvg local
    training with PropFair's aggregation weights n_k / (M - F_k). ``mode="client"``
    (the authors' code): local training on the per-minibatch loss -log(1 - l / M)
    (l / M once M - l < eps), FedAvg weights (module doc)."""
    _check(baseline, eps, mode)
    if mode == "mixing":
        return fedavg(model, mixing=propfair_mixing(baseline, eps=eps,
                                                    weight_by_size=weight_by_size),
                      training=training, server_optimizer=server_optimizer)
    update = local_training(model, training, batch_loss=client_objective(baseline, eps))
    return compose(update, mixing=prior(weight_by_size), server_optimizer=server_optimizer)


register("propfair", propfair, HPARAMS, family="fair",
         search_space={"baseline": (2.0, 3.0, 5.0)},
         search_source="Hahn's PhD thesis (UNIST 2024; AAggFF, arXiv:2405.20821), its fair baselines' grid: M in {2, 3, 5}")
