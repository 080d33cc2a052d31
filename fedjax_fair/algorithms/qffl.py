"""q-FFL / q-FedAvg — Li, Sanjabi, Beirami, Smith, "Fair Resource Allocation in
Federated Learning", ICLR 2020, arXiv:1905.10497 (Algorithm 2; a baseline of
the AAggFF thesis, appendix §8.1, eqs. 3.16-3.18, and of DQN-Fed, TMLR, OpenReview KbteA50cni).

q-FFL minimises f_q(w) = sum_k p_k F_k(w)^{q+1} / (q + 1): larger q puts more
weight on clients with a high loss (q = 0 is FedAvg's objective, q -> inf AFL's).
q-FedAvg solves it with FedAvg's local SGD and a step size from a Lipschitz
estimate L = 1 / eta_l of grad F_k:

    Delta w_k = L (w^t - w_k) = L Delta_k,          (Delta_k: the client's delta)
    h_k = q F_k^{q-1} ||Delta w_k||^2 + L F_k^q,
    w^{t+1} = w^t - sum_k F_k^q Delta w_k / sum_k h_k,

with F_k = F_k(w^t) the server model's loss on client k's training rows, measured
before local training (``ClientOutput.loss_before``). Li et al. sample clients
with probability p_k and average uniformly; with a mixing prior pi_k (uniform
over the cohort by default, or pi_k ∝ n_k, the thesis's form) both sums carry pi_k:

    w^{t+1} = w^t - sum_k pi_k L F_k^q Delta_k / sum_k pi_k h_k.

q = 0 gives h_k = L and w^{t+1} = w^t - sum_k pi_k Delta_k: uniform averaging of
the cohort (FedAvg with uniform weights; with pi ∝ n, FedAvg exactly). The
effective coefficients pi_k L F_k^q / sum_j pi_j h_j are ∝ pi_k F_k^q and sum to
at most 1 (q >= 0).

Two modes (``qffl_mode``):

* ``"faithful"`` (default): the update above, an ``Aggregator``
  (``qffl_aggregator``) on top of the prior mixing weights.
* ``"mixing"``: the thesis's idealisation p_k ∝ n_k F_k^q as a ``MixingRule``
  (``qffl_mixing``), averaged like FedAvg (step scale 1).

Numerics: F_k^q and F_k^{q-1} are evaluated as exp(q log F_k - c) with
c = max_j q log F_j (a common factor of both sums), so large q or L cannot
overflow in float32. A client with F_k = 0 has F_k^q = 0 for q > 0 and its h_k
is taken as 0 (its q F^{q-1} ||Delta w||^2 term is 0 * inf at an exact minimum);
F^0 = 1 (also at F = 0; q = 0 is selected exactly with ``jnp.where``, so q may be a
traced array and q = 0 stays FedAvg bit for bit). If every h_k is 0 (all losses 0
with q > 0) the step is 0. Masked rows and empty clients get weight 0, and a NaN
delta on a masked row does not leak. The aggregator logs the effective
coefficients c_k (``server/coefficients``).

Symbols -> arguments: q = ``q`` (grid {0.1, 1, 5} in the thesis, {0, 0.001, 0.01,
0.1, 1, 2, 5, 10} in DQN-Fed; the reference scripts select 0.1 or 1);
L = ``lipschitz`` (default 1 / ``training.lr``); pi = uniform, or ∝ n_k if
``weight_by_size``; the mode = ``mode``; the local SGD is ``training``
(``ClientTraining``: eta_l = ``training.lr``, B = ``training.batch_size``).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_fair import hparams as H
from fedjax_fair.core.aggregators import (UPDATE, Aggregator, ratio, stateless,
                                          stateless_stream)
from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.algorithms.families.training import Transform
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.core.client import ClientTraining, check_rate, round_value
from fedjax_fair.core.mixing import MixingRule, exponentiated
from fedjax_fair.solvers.simplex import exponentiated_gradient
from fedjax_fair.algorithms.registry import register

MODES = ("faithful", "mixing")
HPARAMS = {"q": H.NONNEGATIVE, "lipschitz": H.Range(0.0, None, low_open=True, nullable=True)}


def _check_scalars(**values) -> None:
    """q and L are one number each (a Python / NumPy number or a 0-d, possibly traced,
    JAX array: vmap and grad over them stay open): a vector would make the server's
    update a vector of updates. A static shape check only, never a value's."""
    for name, value in values.items():
        if value is None or callable(value):
            continue
        shape = np.shape(value)
        if shape != ():
            raise H.FieldError(name, f"must be a scalar (one number, or a 0-d array; vmap "
                                     f"over a grid of values), got shape {shape}")


def _safe_log(x):
    """log x for x > 0, 0 elsewhere (so 0 * log 0 never makes a NaN gradient)."""
    positive = x > 0
    return jnp.where(positive, jnp.log(jnp.where(positive, x, 1.0)), 0.0)


def _floats(x):
    """``x`` as a float array of at least float32 precision: float64 losses and
    deltas (x64 runs, e.g. meta-gradients checked by finite differences) stay float64."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _q_log_loss(losses, q):
    """q log F_k, with 0 for q = 0 (F^0 = 1, also at F = 0) and -inf for F_k = 0 < q."""
    losses = _floats(losses)
    at_zero = jnp.where(q == 0, 0.0, -jnp.inf)  # F^q at F = 0: 1 if q = 0, else 0
    return jnp.where(losses > 0, q * _safe_log(losses), at_zero)


def qffl_weights(losses, prior, mask, q):
    """The mixing form p_k = prior_k F_k^q / sum_{j in mask} prior_j F_j^q.

    Parameters
    ----------
    losses : float array [K]
        F_k(w^t) >= 0.
    prior : float array [K]
        n_k (thesis) or ones.
    mask : bool array [K]
    q : float or traced scalar
        q >= 0; q = 0 returns the prior normalised over the mask.
    """
    return exponentiated_gradient(_q_log_loss(losses, q), prior, mask)


def qffl_mixing(q=0.1, *, weight_by_size: bool = True) -> MixingRule:
    """The thesis's q-FFL mixing rule p_k ∝ n_k F_k^q (uniform prior if not
    ``weight_by_size``) as a stateless ``MixingRule``."""
    _check_scalars(q=q)
    H.check(HPARAMS, q=q)
    return exponentiated(lambda out: _q_log_loss(out.loss_before, q), weight_by_size)


def prior_mixing(weight_by_size: bool = False) -> MixingRule:
    """pi_k: uniform over the participating clients that hold data, or ∝ n_k."""
    return exponentiated(lambda out: 0.0, weight_by_size)


def _per_client_sq_norms(deltas, keep):
    """||Delta_k||^2 summed over every leaf [K]; rows with keep False count 0 (selected
    on the [K] norms, so NaN on such a row stays out without copying the deltas)."""
    total = 0.0
    for x in jax.tree.leaves(deltas):
        x2 = _floats(jnp.reshape(x, (x.shape[0], -1)))
        total = total + jnp.sum(jnp.square(x2), axis=1)
    return jnp.where(keep, total, 0.0)


def qffl_coefficients(losses, sq_norms, prior, q, lipschitz):
    """Raw coefficients c_k with direction = sum_k c_k Delta_k (q-FedAvg).

    c_k = pi_k L F_k^q / sum_j pi_j (q F_j^{q-1} L^2 ||Delta_j||^2 + L F_j^q),
    evaluated after dividing both sums by L exp(max_j q log F_j).

    Parameters
    ----------
    losses : float array [K]
        F_k(w^t).
    sq_norms : float array [K]
        ||Delta_k||^2 = ||w^t - w_k||^2.
    prior : float array [K]
        pi_k >= 0 on the simplex (0 on masked rows).
    q, lipschitz : float or traced scalars
        q >= 0 and L > 0.
    """
    losses = _floats(losses)
    prior = _floats(prior)
    keep = prior > 0
    qlog = jnp.where(keep, _q_log_loss(losses, q), -jnp.inf)
    top = jnp.max(qlog)
    shift = jnp.where(jnp.isfinite(top), top, 0.0)
    scaled = jnp.where(qlog > -jnp.inf, jnp.exp(jnp.where(keep, qlog, 0.0) - shift), 0.0)
    # F^q / e^c (scaled) and q F^{q-1} L ||Delta||^2 / e^c = q scaled L ||Delta||^2 / F
    # (exactly 0 at q = 0).
    positive = keep & (losses > 0)
    curvature = jnp.where(positive, q * scaled * lipschitz * sq_norms
                          / jnp.where(positive, losses, 1.0), 0.0)
    numer = jnp.where(keep, prior * scaled, 0.0)
    denom = jnp.sum(jnp.where(keep, prior * (scaled + curvature), 0.0))
    return jnp.where(denom > 0, numer / jnp.where(denom > 0, denom, 1.0), 0.0)


def qffl_aggregator(q=0.1, lipschitz=10.0) -> Aggregator:
    """q-FedAvg's server update as an ``Aggregator``; the mixing weights are pi_k.

    ``aggregate`` returns sum_k c_k Delta_k (``qffl_coefficients``), so the default
    server step sgd(1.0) gives w^{t+1} = w^t - sum_k F_k^q Delta w_k / sum_k h_k;
    ``info["coefficients"]`` holds c_k [K]. ``lipschitz`` may be a schedule of the
    round (L_t = 1 / eta_t under a decaying client rate)."""
    _check_scalars(q=q, lipschitz=lipschitz)
    H.check(HPARAMS, q=q)
    if not callable(lipschitz):
        H.check(HPARAMS, lipschitz=lipschitz)

    def direction(outputs, weights, ctx, combine):
        keep = weights > 0
        sq = _per_client_sq_norms(outputs.delta, keep)
        coef = qffl_coefficients(outputs.loss_before, sq, weights, q,
                                 round_value(lipschitz, ctx.round))
        # One dot product, like weighted_sum (a NaN-safe select would copy all K
        # deltas: 10x slower at K = 1000, benchmarks/server_step.py).
        return combine(UPDATE, outputs.delta, coef), {"coefficients": coef}

    def term(out, z, ctx):
        # client k's share of both sums carries pi_k F_k^q = exp(z_k + q log F_k);
        # its denominator term is 1 + q L ||Delta_k||^2 / F_k (0 at F_k = 0 < q).
        loss = _floats(out.loss_before)
        sq = _floats(optax.tree.norm(out.delta, squared=True))
        positive = loss > 0
        curvature = jnp.where(positive, q * round_value(lipschitz, ctx.round) * sq
                              / jnp.where(positive, loss, 1.0), 0.0)
        return z + _q_log_loss(loss, q), (out.delta, 1.0 + curvature), sq

    def finish(sums, outputs, sq, weights, ctx):
        coef = qffl_coefficients(outputs.loss_before, jnp.where(weights > 0, sq, 0.0), weights,
                                 q, round_value(lipschitz, ctx.round))
        return ratio(*sums), {"coefficients": coef}

    # the coefficients read every client's loss and update norm (h_k)
    return stateless(direction, stream=stateless_stream(term, finish), combines=(UPDATE,),
                     reads=("loss_before", "delta"))


def qffl(model, *, q: float = 0.1, mode: str = "faithful",
         weight_by_size: Optional[bool] = None, lipschitz: Optional[float] = None,
         training: ClientTraining = ClientTraining(),
         server_optimizer: Optional[Transform] = None,
         mixing: Optional[MixingRule] = None) -> FederatedAlgorithm:
    """q-FedAvg: FedAvg's local SGD with the q-FFL server step (see the module doc).

    In ``"faithful"`` mode a ``mixing`` rule, if given, replaces the prior pi.

    ``weight_by_size`` (pi ∝ n_k) defaults to False for ``"faithful"`` (Li et al.'s
    reference code: uniform) and True for ``"mixing"`` (the thesis's n_k F_k^q).
    ``lipschitz`` defaults to 1 / ``training.lr`` (round by round when the client rate
    is a schedule)."""
    _check_scalars(q=q, lipschitz=lipschitz)
    H.check(HPARAMS, q=q, lipschitz=lipschitz)
    training.check()  # before 1 / training.lr
    check_rate(training.lr, "training.lr")  # also with a fixed optimizer: L uses it
    if mode not in MODES:
        raise H.FieldError("mode", f"must be one of {MODES}, got {mode!r}")
    if weight_by_size is not None and not isinstance(weight_by_size, bool):
        raise H.FieldError("weight_by_size", f"must be true, false or null, got {weight_by_size!r}")
    client = dict(training=training, server_optimizer=server_optimizer)
    if mode == "mixing":
        if lipschitz is not None:
            raise H.FieldError("lipschitz", "only used by mode='faithful'")
        if mixing is not None:
            raise H.FieldError("mixing", "mode='mixing' sets the mixing rule itself")
        by_size = True if weight_by_size is None else weight_by_size
        return fedavg(model, mixing=qffl_mixing(q, weight_by_size=by_size), **client)
    if lipschitz is None:
        client_lr = training.lr
        lipschitz = ((lambda t: 1.0 / client_lr(t)) if callable(client_lr)
                     else 1.0 / client_lr)
    by_size = False if weight_by_size is None else weight_by_size
    return fedavg(model, aggregator=qffl_aggregator(q, lipschitz),
                  mixing=mixing or prior_mixing(by_size), **client)


register("qffl", qffl, HPARAMS, family="fair",
         search_space={"q": (0.1, 1.0, 5.0)},
         search_source="Hahn's PhD thesis (UNIST 2024; AAggFF, arXiv:2405.20821), its fair baselines' grid: q in {0.1, 1, 5}")
