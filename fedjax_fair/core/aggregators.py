"""Aggregators: the cohort's outputs + mixing weights [K] -> one direction.

An ``Aggregator`` is a pair of pure functions (optax style):
``init(params, num_clients) -> state`` and
``aggregate(state, outputs, weights, ctx) -> (direction, state, info)``, where
``outputs`` is the stacked ``ClientOutput`` (``outputs.delta`` a pytree with leading
axis K, plus losses, counts and the method's ``extra``), ``weights`` [K] are on the
simplex (zero for masked-out clients) and ``ctx`` is the round's ``ServerContext``
(server parameters, round, server key, ids, mask). The state may be anything the
server keeps between rounds (SCAFFOLD's control variate, FedDyn's h, a previous
model). ``info`` is a dict of fixed-shape diagnostics (per-client values [K], e.g.
q-FFL's effective coefficients), logged with the round's metrics. The server
optimizer then treats ``direction`` as a pseudo-gradient.

Streamed aggregation. When the direction is a ratio of sums over clients whose
terms each depend on one client's output, and the mixing rule is separable
(mixing.separable: client k's weight is exp(z_k) / sum_j exp(z_j) within a tier),
the sums can be formed while the clients run: ``compose`` then never stacks the K
updates ([K, d]: 7.8 GiB for a 10,000-client MLP cohort). An aggregator states how in
its ``stream`` (``Stream(term, finish)``):

* ``term(output_k, z_k, ctx) -> (z'_k, summands_k, stats_k)``: client k's summands
  (a pytree, e.g. (Delta_k, 1)) carry the factor exp(z'_k) (z_k: its mixing logit;
  q-FFL adds q log F_k); ``stats_k`` (small, e.g. ||Delta_k||^2) are stacked [K].
* ``finish(state, sums, outputs, stats, weights, ctx) -> (direction, state, info)``:
  ``sums`` = sum_k exp(z'_k - c) summands_k over the mixing rule's top tier, for an
  unknown shift c (the running maximum of z', which keeps every exp <= 1), so
  ``finish`` returns ratios of them; ``outputs`` are the stacked outputs without
  ``delta``; ``weights`` the mixing weights [K].

``STREAM_SUM`` is that sum as an ``execution.Reduction`` (a log-sum-exp fold, as in
online softmax); ``map_clients`` folds it per client, chunk and device.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from fedjax_fair.core.execution import Reduction
from fedjax_fair.core.mixing import EXCLUDED, top_tier


class Stream(NamedTuple):
    term: Callable
    finish: Callable


class Aggregator(NamedTuple):
    """``init``, ``aggregate`` and what the step declares of itself (docs/scenarios.md).

    combines: the cohort combinations ``aggregate`` takes through its ``combine``
      argument, one kind per call in call order: ``UPDATE`` (the uploaded updates or
      what the server derives from them alone, e.g. FedNova's Delta_k / tau_k) or
      ``EXTRA`` (the method's other uploads: SCAFFOLD's control variates, the
      primal-dual duals). Such an aggregator's signature is ``aggregate(state,
      outputs, weights, ctx, combine=plain_combine)``, with ``combine(kind, tree,
      coefficients) -> tree`` = sum_k c_k tree_k for c_k >= 0: the one piece a
      scenario replaces (a robust rule, a private release). None: the step is not a
      sum of non-negative multiples of its uploads (DQN-Fed's solve, MGDA's QP), its
      ``aggregate`` takes no ``combine`` and scenarios that replace the combination
      refuse it.
    reads: what else of the clients' uploads the step reads (``ClientOutput`` field
      names: "delta", "loss_before", "num_steps", "num_examples", "extra"), beyond
      the combinations' trees and the mixing weights; () when nothing.
    """

    init: Callable
    aggregate: Callable
    stream: Optional[Stream] = None  # set when the direction can be streamed
    combines: Optional[tuple] = None
    reads: tuple = ()


UPDATE = "update"  # a combination of the uploaded updates (or what derives from them alone)
EXTRA = "extra"  # a combination of the method's other uploads (control variates, duals)


def plain_combine(kind: str, tree, coefficients):
    """sum_k c_k tree_k: a step's combination when no scenario replaces it."""
    del kind
    return weighted_sum(tree, coefficients)


def _fold_scaled(batch):
    """(tier, z, summands) elements [n, ...] -> one element: sum_k exp(z_k - c)
    summands_k over the top tier's rows (mixing.top_tier), with logit c."""
    tiers, logits, trees = batch
    top, shift = top_tier(tiers, logits)
    scale = jnp.where(top, jnp.exp(jnp.where(top, logits - shift, 0.0)), 0.0)
    logit = jnp.where(jnp.any(top), shift, -jnp.inf).astype(logits.dtype)
    return jnp.max(tiers), logit, weighted_sum(trees, scale)


def _empty_scaled(shapes):
    tier, logit, trees = shapes
    return (jnp.full(tier.shape, EXCLUDED, tier.dtype), jnp.full(logit.shape, -jnp.inf, logit.dtype),
            jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), trees))


STREAM_SUM = Reduction(fold=_fold_scaled, empty=_empty_scaled)


def ratio(tree, total):
    """tree / total, 0 where total is 0 (no client carried weight)."""
    return jax.tree.map(lambda x: x / jnp.where(total > 0, total, 1).astype(x.dtype), tree)


def weighted_sum(tree, weights):
    """sum_k weights[k] * tree[k] for every leaf (leading axis K), one dot product.

    Not NaN-safe on zero-weight rows (0 * NaN = NaN): selecting them away first
    copies the K stacked deltas, which made the K = 1000 server step 7x slower and
    doubled its memory (benchmarks/server_step.py). The engine's masked cohort rows
    hold real clients' finite deltas, so this is only a concern for hand-made input.
    """
    return jax.tree.map(lambda x: jnp.tensordot(weights.astype(x.dtype), x, axes=1), tree)


def scale_rows(tree, scale):
    """Leaf [K, ...] times scale [K] (or a single delta times a scalar scale)."""
    return jax.tree.map(
        lambda x: x * scale.reshape(scale.shape + (1,) * (x.ndim - scale.ndim)).astype(x.dtype),
        tree)


def stateless(direction_fn: Callable, stream: Optional[Stream] = None,
              combines: Optional[tuple] = None, reads: tuple = ()) -> Aggregator:
    """An ``Aggregator`` from ``direction_fn(outputs, weights, ctx) -> (direction,
    info)`` that keeps no state (``stream``: its streamed form, if any). With
    ``combines`` (``Aggregator.combines``) ``direction_fn`` takes ``combine`` as a
    fourth argument."""

    def init(params, num_clients):
        del params, num_clients
        return ()

    if combines is None:
        def aggregate(state, outputs, weights, ctx):
            direction, info = direction_fn(outputs, weights, ctx)
            return direction, state, info
    else:
        def aggregate(state, outputs, weights, ctx, combine=plain_combine):
            direction, info = direction_fn(outputs, weights, ctx, combine)
            return direction, state, info

    return Aggregator(init, aggregate, stream, combines, tuple(reads))


def stateless_stream(term: Callable, finish: Callable) -> Stream:
    """The ``Stream`` of a stateless aggregator, from ``finish(sums, outputs, stats,
    weights, ctx) -> (direction, info)``."""

    def finish_keeping(state, sums, outputs, stats, weights, ctx):
        direction, info = finish(sums, outputs, stats, weights, ctx)
        return direction, state, info

    return Stream(term, finish_keeping)


def weighted_mean() -> Aggregator:
    """Delta = sum_k p_k Delta_k (FedAvg, McMahan et al. 2017; p from a MixingRule)."""
    return stateless(
        lambda outputs, weights, ctx, combine: (combine(UPDATE, outputs.delta, weights), {}),
        stream=stateless_stream(lambda out, z, ctx: (z, (out.delta, jnp.ones((), z.dtype)), ()),
                                lambda sums, outputs, stats, weights, ctx: (ratio(*sums), {})),
        combines=(UPDATE,))


def step_normalized() -> Aggregator:
    """FedNova's normalised averaging (Wang, Liu, Liang, Joshi, Poor, "Tackling the
    Objective Inconsistency Problem in Heterogeneous Federated Optimization", NeurIPS
    2020, arXiv:2007.07481) for unequal local work (heterogeneity.py):

        d = tau_eff * sum_k p_k Delta_k / tau_k,   tau_eff = sum_k p_k tau_k,

    tau_k = ``outputs.num_steps``. With equal step counts it is the weighted mean.
    A client that took no step has Delta_k = 0 and adds nothing.
    """

    def steps(outputs):
        return outputs.num_steps.astype(jnp.float32)

    def scaled(tau_eff, tree):
        return jax.tree.map(lambda d: tau_eff * d, tree), {"tau_eff": tau_eff}

    def direction(outputs, weights, ctx, combine):
        tau = steps(outputs)
        per_step = scale_rows(outputs.delta, 1.0 / jnp.maximum(tau, 1.0))
        return scaled(jnp.sum(weights * tau), combine(UPDATE, per_step, weights))

    def term(out, z, ctx):
        per_step = 1.0 / jnp.maximum(steps(out), 1.0)
        return z, (jax.tree.map(lambda d: per_step.astype(d.dtype) * d, out.delta),
                   jnp.ones((), z.dtype)), ()

    def finish(sums, outputs, stats, weights, ctx):
        return scaled(jnp.sum(weights * steps(outputs)), ratio(*sums))

    return stateless(direction, stream=stateless_stream(term, finish), combines=(UPDATE,),
                     reads=("num_steps",))
