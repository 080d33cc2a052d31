"""Pieces of the federated primal-dual family: FedPD, FedADMM, FedDyn, FedSpeed,
A-FedPD and A-FedPDSAM (Sun, Shen, Tao, "A-FedPD: Aligning Dual-Drift is All Federated
Primal-Dual Learning Needs", NeurIPS 2024, arXiv:2409.18915, Algorithms 1-2, eqs. 5-7).

Every client i keeps a dual lambda_i, one parameter-shaped row of a client table
(dense or lazy, client_states.py; lambda_i = 0 at the start). An active client
solves, from the broadcast theta^t with K local steps, its augmented-Lagrangian
subproblem (``augmented_lagrangian``)

    L_i(theta) = f_i(theta) + <lambda_i, theta - theta^t> + (rho / 2) ||theta - theta^t||^2,

and ascends its dual (``dual_ascent``)

    lambda_i^{t+1} = lambda_i^t + rho (theta_i^{t+1} - theta^t).

At an exact local solution lambda_i^{t+1} = -grad f_i(theta_i^{t+1}): the dual is
minus the client's gradient. The server averages the cohort's models,
theta-bar^{t+1} = sum_i p_i theta_i^{t+1} (p_i = 1 / |P| by default), and forms the
next broadcast by one of three rules (``primal_dual_aggregator(rule)``):

* ``"virtual"`` (A-FedPD): every client outside the cohort gets the virtual dual
  update lambda_i += rho (theta-bar^{t+1} - theta^t) (``virtual_dual_drift``, a
  common drift of the client table: the lazy table applies it in O(d), not O(N d)),
  so the mean dual moves as under full participation,

      lambda-bar^{t+1} = lambda-bar^t + rho (theta-bar^{t+1} - theta^t),
      theta^{t+1} = theta-bar^{t+1} + lambda-bar^{t+1} / rho   (= 2 theta-bar^{t+1} - theta-bar^t);

* ``"participants"`` (FedDyn, FedSpeed): the other clients' duals stay put, so
  lambda-bar^{t+1} = lambda-bar^t + (rho / N) sum_{i in P} (theta_i^{t+1} - theta^t), and
  theta^{t+1} = theta-bar^{t+1} + lambda-bar^{t+1} / rho;
* ``"cohort"`` (FedADMM eq. 6 with g = 0; FedPD eq. 5 under full participation):
  theta^{t+1} = sum_i p_i (theta_i^{t+1} + lambda_i^{t+1} / rho), the participants'
  new duals sent up as ``ClientOutput.extra``.

The server state (``PrimalDualState``) holds lambda-bar, the exact mean of the N
duals for uniform weights (the rules' recursions, O(d): the table is never summed),
and theta-bar^t, the model A-FedPD evaluates by default (Theorem 1) (``evaluated``).
With the pseudo-gradients Delta_i = theta^t - theta_i^{t+1} every rule is a
direction d for the server step theta^{t+1} = theta^t - d (``optax.sgd(1)``).

Gradient clipping (``training.clip_norm`` c, ``training.clip_mode``; ``client.local_sgd``).
The penalty's gradient is lambda_i + rho (theta - theta^t) = (lambda_i - rho theta^t)
+ rho theta. By default ("step") the clip takes the loss's gradient g and the whole
penalty's, clip(g + lambda_i + rho (theta - theta^t)) + wd theta; "loss" clips g alone.
With ``penalty_as_decay`` (FedDyn and FedSpeed) the "step" form is the one of their
authors' code: the linear part is clipped and rho theta is added after the clip, as
weight decay,

    clip(g + lambda_i - rho theta^t) + (rho + wd) theta
      (= clip(g + rho (h_i - theta^t)) + (rho + wd) theta, h_i = lambda_i / rho),

because their code writes the penalty as the linear loss term rho <theta, h_i - theta^t>
and puts rho into the optimizer's weight decay, ``torch.optim.SGD(weight_decay=wd +
rho)``, which ``step()`` adds after ``clip_grad_norm_`` (see ``clip_split``). Without a
clip, or while the clip does not bind, the two forms are the same step (to float
rounding).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_fair import hparams as H
from fedjax_fair.core.aggregators import EXTRA, UPDATE, Aggregator, plain_combine
from fedjax_fair.core.algorithm import FederatedAlgorithm, compose
from fedjax_fair.core.client import ClientTraining, inner, local_training, sq_distance
from fedjax_fair.core.mixing import prior

RULES = ("virtual", "participants", "cohort")
EVALUATED = ("average", "server")
HPARAMS = {"rho": H.POSITIVE}
SAM_HPARAMS = {"sam_radius": H.NONNEGATIVE, "sam_eps": H.POSITIVE}
# The default local training of A-FedPD, A-FedPDSAM, FedPD, FedADMM and FedSpeed: the
# A-FedPD paper's experiments (arXiv:2409.18915, Section 5) train every method with
# minibatches of 50 at the initial rate 0.1; the other fields are ClientTraining()'s.
TRAINING = ClientTraining(lr=0.1, batch_size=50)


class PrimalDualState(NamedTuple):
    """The server's side of a primal-dual method.

    mean_dual: lambda-bar^t, parameter-shaped.
    average: theta-bar^t, the last cohort average (theta^0 before the first round).
    inv_num_clients: [] 1 / N in the default float type (float64 under x64).
    """

    mean_dual: object
    average: object
    inv_num_clients: jax.Array


def zero_dual(params):
    """lambda_i^0 = 0: the initial row of every client's dual."""
    return jax.tree.map(jnp.zeros_like, params)


def augmented_lagrangian(rho) -> Callable:
    """The client's regularizer ``<lambda_i, theta> + (rho / 2) ||theta - theta^t||^2``:
    its gradient lambda_i + rho (theta - theta^t) is the augmented Lagrangian's (the
    constant -<lambda_i, theta^t> is left out). ``rho`` may be traced."""

    def regularizer(params, broadcast, dual):
        return inner(dual, params) + 0.5 * rho * sq_distance(params, broadcast.params)

    return regularizer


def dual_correction(rho) -> Callable:
    """The linear part of ``augmented_lagrangian``: the regularizer
    ``<lambda_i - rho theta^t, theta>``, gradient lambda_i - rho theta^t (the FedDyn /
    FedSpeed authors' ``lamb * <theta, Local_dual_correction>``, correction h_i - theta^t
    with lambda_i = rho h_i). Its quadratic remainder's gradient rho theta is added as
    weight decay (``clip_split``). ``rho`` may be traced."""

    def regularizer(params, broadcast, dual):
        return inner(dual, params) - rho * inner(broadcast.params, params)

    return regularizer


def clip_split(rho, training: ClientTraining):
    """``(regularizer, training)`` of the local solve with the penalty split as the
    FedDyn / FedSpeed authors' code splits it: under a clip in the "step" form, the
    linear part ``dual_correction(rho)`` is clipped with the loss and rho joins
    ``training.weight_decay``, which ``client.local_sgd`` adds after the clip
    (their ``SGD(weight_decay=wd + rho)`` after ``clip_grad_norm_``). Otherwise (no
    clip, or ``clip_mode="loss"``) ``augmented_lagrangian(rho)`` and ``training``
    unchanged: without a clip the program is the one built without the split.
    ``training`` is checked first, so an error names the caller's own values."""
    if not isinstance(training, ClientTraining):  # refused by local_training, in one line
        return augmented_lagrangian(rho), training
    training.check()
    if training.clip_norm is None or training.clip_mode != "step":
        return augmented_lagrangian(rho), training
    return dual_correction(rho), training._replace(weight_decay=training.weight_decay + rho)


def dual_ascent(rho, report: bool = False) -> Callable:
    """The client's ``finish``: lambda_i^{t+1} = lambda_i^t + rho (theta_i^{t+1} - theta^t)
    as the new row; with ``report`` also sent up as ``extra`` (the "cohort" rule)."""

    def finish(result, broadcast, dual, data, key):
        del data, key
        new = jax.tree.map(lambda lam, th, s: lam + rho * (th - s), dual, result.params,
                           broadcast.params)
        return new, (new if report else ())

    return finish


def virtual_dual_drift(state, new_state):
    """A-FedPD's virtual update of every client outside the cohort, as ``compose``'s
    ``drift``: rho (theta-bar^{t+1} - theta^t) = -rho sum_i p_i Delta_i, the change
    of the mean dual lambda-bar over the round under the "virtual" rule (so a
    scenario's combination of the Delta_i reaches it)."""
    return jax.tree.map(jnp.subtract, new_state.aggregator_state.mean_dual,
                        state.aggregator_state.mean_dual)


def primal_dual_aggregator(rho, rule: str) -> Aggregator:
    """The server step of ``rule`` ("virtual", "participants" or "cohort"; see the
    module docstring) as an ``Aggregator`` with state ``PrimalDualState``."""
    if rule not in RULES:
        raise H.FieldError("rule", f"must be one of {RULES}, got {rule!r}")

    def init(params, num_clients):
        return PrimalDualState(zero_dual(params), params,
                               jnp.asarray(1.0 / num_clients, jnp.result_type(float)))

    def aggregate(state: PrimalDualState, outputs, weights, ctx, combine=plain_combine):
        mean_delta = combine(UPDATE, outputs.delta, weights)  # theta^t - theta-bar^{t+1}
        average = jax.tree.map(jnp.subtract, ctx.params, mean_delta)
        if rule == "virtual":
            moved = mean_delta
        else:  # the participants' duals moved, the others' did not
            share = ctx.client_mask.astype(state.inv_num_clients.dtype) * state.inv_num_clients
            moved = combine(UPDATE, outputs.delta, share)
        mean_dual = jax.tree.map(lambda lam, m: lam - rho * m, state.mean_dual, moved)
        # theta^{t+1} = theta-bar^{t+1} + (dual term) / rho: the mean dual, or the
        # weighted mean of the cohort's new duals.
        dual_term = (combine(EXTRA, outputs.extra, weights) if rule == "cohort"
                     else mean_dual)
        direction = jax.tree.map(lambda m, lam: m - lam / rho, mean_delta, dual_term)
        return direction, PrimalDualState(mean_dual, average, state.inv_num_clients), {}

    combines = ((UPDATE,) if rule == "virtual" else (UPDATE, UPDATE)) + (
        (EXTRA,) if rule == "cohort" else ())
    return Aggregator(init, aggregate, combines=combines)


def evaluated_model(evaluate: str):
    """``compose``'s ``evaluated_params`` for ``evaluate``: "average" (theta-bar^t, the
    A-FedPD paper's output) or "server" (theta^t = ``state.params``, the broadcast)."""
    if evaluate not in EVALUATED:
        raise H.FieldError("evaluate", f"must be one of {EVALUATED}, got {evaluate!r}")
    return (lambda state: state.aggregator_state.average) if evaluate == "average" else None


def primal_dual(model, *, rho, rule: str, training: ClientTraining, client_table,
                weight_by_size: bool, evaluate: str, sam_radius=None,
                sam_eps=1e-2, penalty_as_decay: bool = False) -> FederatedAlgorithm:
    """A primal-dual method: augmented-Lagrangian local steps (``training``: rate,
    batch, epochs, coupled weight decay, gradient clipping; SAM steps when
    ``sam_radius`` is given), dual ascent into a dense or lazy table of duals, and the
    server ``rule``; evaluated on theta-bar (``evaluate="average"``) or the broadcast
    theta (``"server"``). ``penalty_as_decay``: under ``clip_mode="step"`` the penalty's
    rho theta is added after the clip (``clip_split``; FedDyn's and FedSpeed's
    authors' code). Every factory of the family is this with its rule and defaults."""
    H.check(HPARAMS, rho=rho)
    if sam_radius is not None:
        H.check(SAM_HPARAMS, sam_radius=sam_radius, sam_eps=sam_eps)
    evaluated = evaluated_model(evaluate)
    aggregator = primal_dual_aggregator(rho, rule)
    regularizer = augmented_lagrangian(rho)
    if penalty_as_decay:
        regularizer, training = clip_split(rho, training)
    client = local_training(model, training, regularizer=regularizer,
                            finish=dual_ascent(rho, report=rule == "cohort"),
                            sam_radius=sam_radius, sam_eps=sam_eps)
    return compose(client, mixing=prior(weight_by_size), aggregator=aggregator,
                   client_state_init=zero_dual, client_table=client_table,
                   drift=virtual_dual_drift if rule == "virtual" else None,
                   evaluated_params=evaluated)
