"""FedMax, FedMax(k), FedSoftMax — Ben Mansour, Carenini, Duplessis, "Tackling
Computational Heterogeneity in FL: A Few Theoretical Insights", arXiv:2307.06283
(Section 2, the aggregation strategies).

Loss-aware aggregation: the new model is a convex combination of the returned
client models, theta^{t+1} = sum_i alpha_i theta_i = theta^t - sum_i alpha_i Delta_i,
with weights alpha driven by each client's loss gap gap_i = l_i - F_i* (F_i* = 0):

    FedMax:      alpha_i = 1 / |J| for i in J = argmax_i gap_i, else 0
                 (ties share the weight, as the paper's 1 / |J_t|);
    FedMax(k):   alpha_i = 1 / k for the k clients with the largest gaps, else 0
                 (uniform, not size-weighted; ties broken by the lower cohort row);
    FedSoftMax:  alpha_i = p_i exp(beta gap_i) / sum_j p_j exp(beta gap_j),
                 p_i = n_i / sum_j n_j   (log-sum-exp; beta -> inf gives FedMax).

The theory (Theorem 3, Corollary 4) shows that biasing alpha toward high-gap
clients raises the weighting skew rho and speeds convergence, at the price of a
bias term when data are heterogeneous; the soft variant keeps every weight
positive, which caps that bias.

Choices where the paper is ambiguous:

* A2 loss source: ``loss_source="pre_round"`` (default; the paper's formula, which
  tilts by F_i(w_t) - F_i*) reads ``ClientOutput.loss_before`` = F_i(theta^t) on the
  client's training rows; ``"last_epoch"`` (the authors' code) reads
  ``ClientOutput.train_loss``, the mean per-example training loss over the client's
  last local epoch, accumulated while training. The running loss ranks clients by how
  slowly they fit their own data, not by how badly the global model serves them: on
  the command line's default job (Synthetic(1, 1), 30 clients, logistic regression)
  it made FedSoftMax (beta 5) and FedMax the weakest rows (56.5% and 48.6% mean
  client accuracy against FedAvg's 76.2%), while the paper's F_i(theta^t) gives 84.3%
  and 82.4% (docs/reproducing.md). F_i* = 0;
  a common ``loss_star`` would change none of the three rules (they are invariant
  to adding a constant to every loss), so there is no such argument.
* A3 temperature: one multiplier ``beta`` (default 5, swept over {5, 10, 15, 20,
  30}); larger is sharper. Never divided by. beta = 1 / T with T > 0, so beta >= 0
  (0 is FedAvg); a negative beta, which would favour the lowest losses, is refused.
* A4 the p_i factor: ``weight_by_size=True`` (paper) or False (the authors' code,
  uniform prior); identical on balanced splits.
* A11 ties: FedMax splits the weight across ties; FedMax(k) breaks ties by the
  lower cohort row. They coincide for k = 1 when losses are distinct.
* k: a fraction of the cohort when 0 < k < 1, k_eff = max(1, floor(k m)) with m
  the number of weighted clients (the code's convention; the runs used 0.1 and
  0.2), or a count when k >= 1 (an integer), capped at m. Default 0.2: at the
  command line's cohort of 10, 0.1 is one client, i.e. FedMax itself.

Masked cohort rows and empty clients (n_i = 0) never get weight (partial
participation: "renormalised over the sampled clients"). The paper discusses no
weighting by local steps, so none is offered.

Symbols -> arguments: beta (the paper's T^{-1}) = ``beta``; k = ``k``;
p_i = n_i / n if ``weight_by_size``.
"""
from __future__ import annotations

import math
from typing import Optional

import jax.numpy as jnp

from fedjax_fair import hparams as H
from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.algorithms.families.training import Transform
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.core.mixing import MixingRule, exponentiated, loss_rule
from fedjax_fair.solvers.simplex import exponentiated_gradient
from fedjax_fair.algorithms.registry import register

HPARAMS = {"beta": H.NONNEGATIVE, "k": H.Range(0.0, None, low_open=True, static=True)}


def _check_k(k):
    if isinstance(k, bool) or not isinstance(k, (int, float)) or not math.isfinite(k) or k <= 0:
        raise H.FieldError("k", f"must be a fraction in (0, 1) or an integer count >= 1, got {k!r}")
    if k >= 1 and float(k) != int(k):
        raise H.FieldError("k", f"a count >= 1 must be an integer, got {k!r}")
    return float(k)


def fedmax_weights(losses, mask):
    """alpha_i = 1 / |J| on J = argmax_{i in mask} l_i, 0 elsewhere.

    Parameters
    ----------
    losses : float array [K]
        gap_i (the loss, with F_i* = 0).
    mask : bool array [K]
        Rows that can be chosen; an empty mask gives all zeros.
    """
    losses = jnp.asarray(losses, jnp.float32)
    mask = jnp.asarray(mask, bool)
    g = jnp.where(mask, losses, -jnp.inf)
    chosen = mask & (g == jnp.max(g))
    return chosen / jnp.maximum(jnp.sum(chosen), 1).astype(jnp.float32)


def effective_k(k: float, num_active):
    """k_eff: max(1, floor(k m)) for a fraction 0 < k < 1, else min(k, m) (m >= 1)."""
    k = _check_k(k)
    m = jnp.maximum(jnp.asarray(num_active, jnp.int32), 1)
    if k < 1:
        return jnp.maximum(1, jnp.floor(k * m.astype(jnp.float32)).astype(jnp.int32))
    return jnp.minimum(jnp.int32(int(k)), m)


def fedmax_k_weights(losses, mask, k: float = 0.2):
    """alpha_i = 1 / k_eff on the k_eff largest losses in ``mask``, 0 elsewhere.

    Ties are broken by the lower row index (a stable sort).

    Parameters
    ----------
    losses : float array [K]
    mask : bool array [K]
    k : float
        Fraction of the weighted rows (0 < k < 1) or a count (integer >= 1).
    """
    losses = jnp.asarray(losses, jnp.float32)
    mask = jnp.asarray(mask, bool)
    num = losses.shape[0]
    k_eff = effective_k(k, jnp.sum(mask))
    # Ascending stable sort of -loss: largest loss first, ties -> lower row first,
    # masked rows last.
    order = jnp.argsort(jnp.where(mask, -losses, jnp.inf), stable=True)
    rank = jnp.zeros((num,), jnp.int32).at[order].set(jnp.arange(num, dtype=jnp.int32))
    chosen = mask & (rank < k_eff)
    return chosen / jnp.maximum(jnp.sum(chosen), 1).astype(jnp.float32)


def fedsoftmax_weights(losses, prior, mask, beta=5.0):
    """alpha_i = prior_i exp(beta l_i) / sum_{j in mask} prior_j exp(beta l_j).

    Parameters
    ----------
    losses : float array [K]
    prior : float array [K]
        n_i (paper) or ones (authors' code).
    mask : bool array [K]
    beta : float or traced scalar
        The loss multiplier; beta = 0 returns the prior normalised (FedAvg).
    """
    return exponentiated_gradient(beta * jnp.asarray(losses, jnp.float32), prior, mask)




LOSS_SOURCES = ("last_epoch", "pre_round")


def client_losses(outputs, loss_source: str):
    """The loss statistic l_i (choice A2 above): last-epoch running loss or F_i(theta^t)."""
    return outputs.train_loss if loss_source == "last_epoch" else outputs.loss_before


def _check_source(loss_source: str) -> str:
    if loss_source not in LOSS_SOURCES:
        raise H.FieldError("loss_source", f"must be one of {list(LOSS_SOURCES)}, "
                                          f"got {loss_source!r}")
    return loss_source


def fedmax_mixing(*, loss_source: str = "pre_round") -> MixingRule:
    """FedMax as a stateless ``MixingRule``: all weight on the highest loss."""
    _check_source(loss_source)
    return loss_rule(lambda out, mask: fedmax_weights(client_losses(out, loss_source), mask))


def fedmax_k_mixing(k: float = 0.2, *, loss_source: str = "pre_round") -> MixingRule:
    """FedMax(k) as a stateless ``MixingRule``: uniform over the k highest losses."""
    _check_k(k)
    _check_source(loss_source)
    return loss_rule(lambda out, mask: fedmax_k_weights(client_losses(out, loss_source),
                                                         mask, k))


def fedsoftmax_mixing(beta=5.0, *, weight_by_size: bool = True,
                      loss_source: str = "pre_round") -> MixingRule:
    """FedSoftMax as a stateless ``MixingRule``: alpha ∝ p_i exp(beta l_i)."""
    H.check(HPARAMS, beta=beta)
    _check_source(loss_source)
    return exponentiated(lambda out: beta * client_losses(out, loss_source), weight_by_size)


def fedmax(model, *, loss_source: str = "pre_round",
           training: ClientTraining = ClientTraining(),
           server_optimizer: Optional[Transform] = None) -> FederatedAlgorithm:
    """FedAvg local training; the new model is the highest-loss client's (ties
    averaged)."""
    return fedavg(model, mixing=fedmax_mixing(loss_source=loss_source), training=training,
                  server_optimizer=server_optimizer)


def fedmax_k(model, *, k: float = 0.2, loss_source: str = "pre_round",
             training: ClientTraining = ClientTraining(),
             server_optimizer: Optional[Transform] = None) -> FederatedAlgorithm:
    """FedAvg local training averaged uniformly over the k highest-loss clients."""
    return fedavg(model, mixing=fedmax_k_mixing(k, loss_source=loss_source),
                  training=training, server_optimizer=server_optimizer)


def fedsoftmax(model, *, beta: float = 5.0, weight_by_size: bool = True,
               loss_source: str = "pre_round", training: ClientTraining = ClientTraining(),
               server_optimizer: Optional[Transform] = None) -> FederatedAlgorithm:
    """FedAvg local training with FedSoftMax's loss-tilted weights."""
    return fedavg(model, mixing=fedsoftmax_mixing(beta, weight_by_size=weight_by_size,
                                                  loss_source=loss_source),
                  training=training, server_optimizer=server_optimizer)


register("fedmax", fedmax, HPARAMS, family="fair", size_prior=None)
register("fedmax_k", fedmax_k, HPARAMS, family="fair", size_prior=None)
register("fedsoftmax", fedsoftmax, HPARAMS, family="fair",
         search_space={"beta": (5.0, 10.0, 15.0, 20.0, 30.0)},
         search_source="the FedSoftMax authors' code (arXiv:2307.06283): beta in {5, 10, 15, 20, 30}")
