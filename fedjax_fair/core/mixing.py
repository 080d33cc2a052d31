"""Mixing rules: per-client weights on the simplex (docs/architecture.md).

A ``MixingRule`` is ``init(num_clients) -> state`` and
``update(state, outputs, ctx) -> (weights [K], state)``. ``outputs`` is the cohort's
stacked ``ClientOutput`` (losses, example counts, steps taken, the method's extra
outputs); ``ctx`` is the round's ``ServerContext`` (server parameters, round, server
key, client ids and mask). The state may hold a table over ALL N clients, read and
written at ``ctx.client_ids``. Weights of masked-out clients are zero and the rest
sum to one.

Separable rules (``separable``; FedAvg's, uniform, and the exponentiated-gradient
family q-FFL / TERM / PropFair / FedSoftMax, ``exponentiated``) also state client
k's weight from its own output alone: ``logit(output_k, in_cohort_k) -> (tier,
z_k)``, with p_k = exp(z_k) / sum_j exp(z_j) over the clients of the highest tier
present (``tiered_softmax``; tiers express the fall-backs, e.g. uniform over the
cohort when no client holds data). ``compose`` then aggregates while the clients
run (aggregators.Stream), without stacking the K updates.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

EXCLUDED = -1  # the tier of a client that takes no weight (outside the cohort)


class MixingRule(NamedTuple):
    init: Callable
    update: Callable
    # (output_k, in_cohort_k) -> (tier, logit): set by ``separable`` rules
    logit: Optional[Callable] = None
    # True when ``update`` reads nothing of the outputs but ``loss_before`` (the losses
    # of the server model before training: AAggFF's online rules), so the weights can
    # be known before the clients train and their updates summed as they finish
    # (``compose``'s two-pass round, given ``cohort_loss``)
    losses_only: bool = False


def normalize(scores, client_mask):
    """scores * mask / sum(scores * mask); uniform over the mask if that sum is 0."""
    s = jnp.where(client_mask, scores, 0.0)
    total = jnp.sum(s)
    uniform = client_mask / jnp.maximum(jnp.sum(client_mask), 1)
    return jnp.where(total > 0, s / jnp.where(total > 0, total, 1.0), uniform)


def top_tier(tiers, logits):
    """(rows that share the weight, shift): the rows of the highest tier present
    (tier >= 0) with a logit above -inf, and their largest logit (0 if none), held
    constant under differentiation (a shift every weight is invariant to)."""
    tiers = jnp.asarray(tiers)
    top = (tiers == jnp.max(tiers)) & (tiers >= 0) & (logits > -jnp.inf)
    shift = jnp.max(jnp.where(top, logits, -jnp.inf))
    return top, jax.lax.stop_gradient(jnp.where(jnp.any(top), shift, 0.0))


def tiered_softmax(tiers, logits):
    """p_k = exp(z_k) / sum_j exp(z_j) over ``top_tier``'s rows, 0 elsewhere (all 0
    when no row has a tier >= 0 and a logit above -inf)."""
    top, shift = top_tier(tiers, logits)
    e = jnp.where(top, jnp.exp(jnp.where(top, logits - shift, 0.0)), 0.0)
    total = jnp.sum(e)
    return e / jnp.where(total > 0, total, 1.0)


def separable(logit_fn: Callable) -> MixingRule:
    """A stateless ``MixingRule`` whose weight of client k depends on its own output
    only: ``logit_fn(output_k, in_cohort_k) -> (tier, logit)`` (``EXCLUDED`` for a
    client outside the cohort), weights ``tiered_softmax`` over the cohort."""

    def update(state, outputs, ctx):
        mask = jnp.asarray(ctx.client_mask, bool)
        # leaves without the cohort axis (a hand-made scalar) are shared by every client
        axes = jax.tree.map(lambda x: 0 if jnp.ndim(x) and jnp.shape(x)[0] == mask.shape[0]
                            else None, outputs)
        tiers, logits = jax.vmap(logit_fn, in_axes=(axes, 0))(outputs, mask)
        return tiered_softmax(tiers, logits), state

    return MixingRule(lambda num_clients: (), update, logit_fn)


def _float(x):
    """``x`` in the default float type (float64 under x64, so weights there keep
    float64 precision)."""
    return jnp.asarray(x, jnp.result_type(float))


def _log(x):
    """log x, -inf where x <= 0."""
    return jnp.where(x > 0, jnp.log(jnp.where(x > 0, x, 1.0)), -jnp.inf)


def share(score, in_cohort):
    """(tier, logit) of ``normalize``: p_k ∝ score_k >= 0 over the cohort, uniform over
    it when every score is 0."""
    score = _float(score)
    positive = score > 0
    tier = jnp.where(in_cohort, positive.astype(jnp.int32), EXCLUDED)
    return tier, jnp.where(positive, _log(score), 0.0)


def stateless(weights_fn: Callable) -> MixingRule:
    """A ``MixingRule`` from ``weights_fn(outputs, ctx) -> weights [K]`` with no state."""

    def init(num_clients):
        del num_clients
        return ()

    def update(state, outputs, ctx):
        return weights_fn(outputs, ctx), state

    return MixingRule(init, update)


def uniform() -> MixingRule:
    """p_k = 1 / |S| over participating clients."""
    return separable(lambda out, in_cohort: share(1.0, in_cohort))


def by_num_examples() -> MixingRule:
    """p_k = n_k / sum_j n_j (FedAvg's data weights; uniform if no client holds data)."""
    return separable(lambda out, in_cohort: share(out.num_examples, in_cohort))


def prior(weight_by_size: bool) -> MixingRule:
    """The plain average a fair-FL protocol names: ``by_num_examples()`` (p_k ∝ n_k)
    if ``weight_by_size``, else ``uniform()`` (simple averaging, the partner of
    size-proportional sampling)."""
    return by_num_examples() if weight_by_size else uniform()


def active_clients(outputs, client_mask):
    """Rows weighted by loss-driven rules: ``client_mask`` and n_k > 0.

    An empty client has no loss (its ``loss_before`` is 0 by convention) and a zero
    delta, so it is left out. If no participating client holds data, the mask
    itself is returned (the weights then stay on the simplex; every delta is 0).
    """
    client_mask = jnp.asarray(client_mask, bool)
    with_data = client_mask & (outputs.num_examples > 0)
    return jnp.where(jnp.any(with_data), with_data, client_mask)


def loss_rule(weights_fn: Callable) -> MixingRule:
    """A stateless ``MixingRule`` from ``weights_fn(outputs, active) -> weights [K]``,
    ``active`` being ``active_clients`` (participating clients that hold data)."""
    return stateless(lambda outputs, ctx: weights_fn(
        outputs, active_clients(outputs, ctx.client_mask)))


def active_tier(logit, output, in_cohort):
    """(tier, logit) of a loss-driven rule, softmax over ``active_clients``: clients
    holding data first, every participant if none does; within them, uniform if every
    logit is -inf."""
    finite = logit > -jnp.inf
    has_data = output.num_examples > 0
    tier = jnp.where(in_cohort, 2 * has_data.astype(jnp.int32) + finite, EXCLUDED)
    return tier, jnp.where(finite, logit, 0.0)


def exponentiated(response_fn: Callable, weight_by_size: bool) -> MixingRule:
    """p_k ∝ prior_k exp(r_k) over ``active_clients``, r_k = ``response_fn(output_k)``
    and prior n_k (``weight_by_size``) or 1: one exponentiated-gradient step from the
    prior (solvers.simplex.exponentiated_gradient), as a ``separable`` rule. q-FFL's
    mixing form (r = q log F), TERM (t F), PropFair (-log(M - F)) and FedSoftMax
    (beta l) are instances."""

    def logit(out, in_cohort):
        z = _log(_float(size_prior(out, weight_by_size))) + _float(response_fn(out))
        return active_tier(z, out, in_cohort)

    return separable(logit)


def size_prior(outputs, weight_by_size: bool):
    """n_k as float32 (FedAvg's prior p_k ∝ n_k) if ``weight_by_size``, else ones."""
    n = jnp.asarray(outputs.num_examples, jnp.float32)
    return n if weight_by_size else jnp.ones_like(n)
