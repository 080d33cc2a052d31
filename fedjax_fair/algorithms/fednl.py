"""FedNL and FedNL-PP — Safaryan, Islamov, Qian, Richtárik, "FedNL: Making Newton-Type
Methods Applicable to Federated Learning", ICML 2022 (arXiv:2106.02969), Algorithm 1
(FedNL) and the partial-participation variant FedNL-PP; a second-order baseline of
DQN-Fed (Mohajer Hamidi, Ye, TMLR, OpenReview KbteA50cni).

**FedNL** (``fednl``). Client k keeps a Hessian estimate H_k across rounds (one row
per client). At theta^t it computes its gradient g_k and curvature D_k = ∇²f_k(theta^t),
and learns the Hessian with a compressed correction (no error feedback):

    l_k = ||D_k - H_k||_F,   S_k = C(D_k - H_k),   H_k <- H_k + alpha S_k.

The server keeps H = mean_k H_k, steps with the estimate from *before* this round's
corrections (the paper's order), then adds them:

    Option 1 (``option="projection"``):  theta^{t+1} = theta^t - eta [H]_mu^{-1} g,
    Option 2 (``option="shift"``):       theta^{t+1} = theta^t - eta (H + l I)^{-1} g,
    H <- H + alpha mean_k S_k,

with g = mean_k g_k, l = mean_k l_k, [.]_mu the projection onto {A ⪰ mu I}, eta = 1
in the paper. H_k^0 is ∇²f_k at the first model the client sees
(``hessian_init="first"``: the paper's H_k^0 = ∇²f_k(x^0), sent once in full) or 0
(``"zero"``).

**FedNL-PP** (``fednl_pp``, the paper's rule for partial participation). Client k also
keeps l_k and g~_k = (H_k + l_k I) w_k - ∇f_k(w_k), where w_k is the last model it
saw; the server keeps their sums over the clients and sets

    theta^{t+1} = (H + l I)^{-1} g~,   H = mean_k H_k, l = mean_k l_k, g~ = mean_k g~_k.

A round's cohort S^t receives theta^t (w_k = theta^t), learns H_k as above and
sends the changes of H_k, l_k, g~_k (l_k and g~_k now at the new H_k); clients
outside S^t keep theirs. For quadratic f_k whose Hessians are learned exactly
(H_k = ∇²f_k, l_k = 0, e.g. identity compressor, alpha = 1) x is the global optimum
as soon as every client has reported once, however stale the w_k. Here the server
step is theta^{t+1} = theta^t - eta (theta^t - x) with x the rule above
(eta = ``server_lr``, 1 in the paper).

Deviations (documented):

* **Diagonal Hessians.** A d x d Hessian is infeasible for neural networks, so H_k,
  D_k and S_k are diagonals (the paper's matrices restricted to diagonal ones). D_k is
  the exact diagonal (small models) or Hutchinson's estimate E[z * Hz] with Rademacher
  z via Hessian-vector products (``fedjax_fair.algorithms.families.second_order``; ``curvature``, ``num_probes``,
  ``curvature_rows``). The projection [H]_mu onto {⪰ mu I} of a diagonal matrix is
  max(H_jj, mu) per coordinate; ||.||_F is the Euclidean norm of the diagonal.
* **Compressor** on the diagonal: the identity, or Top-K over all coordinates
  (``compressor="topk"``, K = ceil(``topk_fraction`` d); a contractive compressor,
  for which the paper allows alpha = 1 or alpha = 1 - sqrt(1 - K/d)).
* **Positive curvature.** The theory assumes convex f_k. Network Hessians (and
  Hutchinson estimates even of convex ones) have negative entries, so the curvature
  of every step is floored at mu: Option 2 uses max(H + l, mu), and FedNL-PP floors
  each client's H_k + l_k at mu before it enters g~_k and the sums (so the fixed
  point is unchanged; ``option="projection"`` drops l_k there). With mu below the
  true curvature this changes nothing; the default mu = 1 is a damping for networks
  (no coordinate moves by more than |g_j| / mu).
* **l_k** is the paper's Frobenius norm ||H_k - D_k||_F (the authors' code takes the
  spectral norm in FedNL's Option 2, i.e. max_j |H_jj - D_jj| for diagonals).
* **Participation.** The paper initialises every client at x^0; here a client joins
  the server's sums when it first reports, and H (or the FedNL-PP sums) are means over
  the clients that reported so far — identical under full participation. ``fednl``
  with a cohort uses the cohort's mean gradient (FedNL-PP is the paper's
  partial-participation method). Empty clients and masked cohort rows never count.
* **Gradient.** ``mode="grad_at_global"`` is the papers' exact local gradient at
  theta^t; ``mode="pseudo_grad"`` (default, as DQN-Fed, whose comparison shares E, B
  and eta_l across methods) replaces it by the local-SGD pseudo-gradient
  (theta^t - theta_k^E) / (eta_l tau_k); the curvature is always at theta^t.

Symbols -> arguments: alpha = ``alpha`` (Hessian learning rate), mu = ``mu``, C =
``compressor`` / ``topk_fraction``, eta = ``server_lr`` (a number or a schedule), the
option = ``option``, eta_l, B, E = ``training.lr``, ``training.batch_size``,
``training.num_epochs`` (``ClientTraining``; pseudo-gradient mode only). All clients
count equally (f = mean_k f_k).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from fedjax_fair import hparams as H
from fedjax_fair.core.aggregators import Aggregator, weighted_sum
from fedjax_fair.core.algorithm import FederatedAlgorithm, compose
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.algorithms.families.training import Rate
from fedjax_fair.algorithms.families.second_order import choice, client_derivatives, tree_norm
from fedjax_fair.core.mixing import uniform
from fedjax_fair.core.types import ClientOutput
from fedjax_fair.algorithms.registry import register

OPTIONS = ("projection", "shift")
COMPRESSORS = ("identity", "topk")
HESSIAN_INITS = ("first", "zero")
HPARAMS = {"server_lr": H.POSITIVE, "mu": H.POSITIVE,
           "alpha": H.Range(0.0, 1.0, low_open=True),
           "topk_fraction": H.Range(0.0, 1.0, low_open=True, static=True),
           "num_probes": H.COUNT, "curvature_rows": H.Range(1, None, integer=True, nullable=True)}
_TINY = 1e-30


def _where(cond, a, b):
    return jax.tree.map(lambda x, y: jnp.where(cond, x, y), a, b)


def _scale(c, tree):
    return jax.tree.map(lambda x: c * x, tree)


def top_k(tree, fraction: float):
    """Keeps the ceil(fraction d) entries of largest magnitude over the whole pytree
    (d = all its entries), zeroes the rest; the identity when that is every entry."""
    flat, unravel = ravel_pytree(tree)
    d = flat.shape[0]
    k = max(1, math.ceil(fraction * d))
    if k >= d:
        return tree
    _, idx = jax.lax.top_k(jnp.abs(flat), k)
    return unravel(jnp.zeros_like(flat).at[idx].set(flat[idx]))


def compressor_fn(compressor: str, topk_fraction: float):
    choice("compressor", compressor, COMPRESSORS)
    if compressor == "identity":
        return lambda tree: tree
    return lambda tree: top_k(tree, topk_fraction)


def reporting(outputs, ctx):
    """1.0 for cohort rows that count (unmasked, with data), else 0.0: [K]."""
    return (ctx.client_mask & (outputs.num_examples > 0)).astype(jnp.float32)


def _learn_hessian(row_h, seen, diag, *, alpha, compress, hessian_init):
    """(H_k before, its correction alpha S_k, l_k = ||D_k - H_k||, first report)."""
    first = seen == 0
    h_old = _where(first, diag, row_h) if hessian_init == "first" else row_h
    diff = jax.tree.map(jnp.subtract, diag, h_old)
    return h_old, _scale(alpha, compress(diff)), tree_norm(diff), first


def _output(d, data, extra):
    return ClientOutput(delta=d.delta, loss_before=d.loss, num_examples=data.num_examples,
                        num_steps=d.num_steps, extra=extra, train_loss=d.train_loss)


# ------------------------------------------------------------------------- FedNL


class FedNLRow(NamedTuple):
    h: object  # H_k, parameter-shaped (the diagonal)
    seen: jax.Array  # int32 [] 1 once the client has reported


class FedNLState(NamedTuple):
    h_sum: object  # sum of H_k over the clients that reported
    count: jax.Array  # float32 [] how many reported


def fednl_client(derive, *, alpha, compress, hessian_init: str):
    """FedNL's ClientUpdate: extra = {"grad_scale", "init" (H_k^0 at a first report,
    else 0), "correction" (alpha S_k), "first", "l"}; delta = the derivatives' delta."""

    def client_update(broadcast, row: FedNLRow, data, local_steps, key):
        d = derive(broadcast, data, local_steps, key)
        h_old, correction, l, first = _learn_hessian(row.h, row.seen, d.diag, alpha=alpha,
                                                     compress=compress,
                                                     hessian_init=hessian_init)
        extra = {"grad_scale": d.grad_scale, "init": _where(first, h_old, _scale(0.0, h_old)),
                 "correction": correction, "first": first.astype(jnp.float32), "l": l}
        new_row = FedNLRow(jax.tree.map(jnp.add, h_old, correction), jnp.ones((), jnp.int32))
        return _output(d, data, extra), new_row

    return client_update


def fednl_aggregator(*, mu, option: str = "projection") -> Aggregator:
    """direction = [H]_mu^{-1} g (or max(H + l, mu)^{-1} g), H from before this round's
    corrections; then H's sum takes them. Logs the mean l_k of the cohort
    (``hessian_error``) and the share of coordinates floored at mu."""
    choice("option", option, OPTIONS)

    def init(params, num_clients):
        del num_clients
        return FedNLState(jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))

    def aggregate(state, outputs, weights, ctx):
        del weights  # every reporting client counts equally
        c = reporting(outputs, ctx)
        total = jnp.maximum(jnp.sum(c), 1.0)
        extra = outputs.extra
        h_sum = jax.tree.map(jnp.add, state.h_sum, weighted_sum(extra["init"], c))
        count = state.count + jnp.sum(c * extra["first"])
        hess = _scale(1.0 / jnp.maximum(count, 1.0), h_sum)
        grad = weighted_sum(outputs.delta, c * extra["grad_scale"] / total)
        error = jnp.sum(c * extra["l"]) / total
        shift = error if option == "shift" else 0.0
        curv = jax.tree.map(lambda h: jnp.maximum(h + shift, mu), hess)
        direction = jax.tree.map(jnp.divide, grad, curv)
        floored = sum(jnp.sum(h + shift < mu) for h in jax.tree.leaves(hess))
        size = sum(h.size for h in jax.tree.leaves(hess))
        h_sum = jax.tree.map(jnp.add, h_sum, weighted_sum(extra["correction"], c))
        info = {"hessian_error": error, "floored_fraction": floored / size}
        return direction, FedNLState(h_sum, count), info

    return Aggregator(init, aggregate, reads=("delta", "extra"))


# ---------------------------------------------------------------------- FedNL-PP


class FedNLPPRow(NamedTuple):
    h: object  # H_k
    l: jax.Array  # float32 [] l_k (0 under option "projection")
    u: object  # g~_k = a_k * w_k - grad f_k(w_k), a_k = max(H_k + l_k, mu)
    seen: jax.Array  # int32 []


class FedNLPPState(NamedTuple):
    a_sum: object  # sum over reported clients of a_k = max(H_k + l_k, mu)
    u_sum: object  # sum of g~_k


def fednl_pp_client(derive, *, alpha, mu, compress, hessian_init: str, option: str):
    """FedNL-PP's ClientUpdate at w_k = theta^t: learns H_k, recomputes l_k, a_k and
    g~_k, and sends the changes of a_k and g~_k (extra {"da", "du", "l"})."""

    def curvature(h, l):
        return jax.tree.map(lambda x: jnp.maximum(x + l, mu), h)

    def client_update(broadcast, row: FedNLPPRow, data, local_steps, key):
        d = derive(broadcast, data, local_steps, key)
        h_old, correction, _, first = _learn_hessian(row.h, row.seen, d.diag, alpha=alpha,
                                                     compress=compress,
                                                     hessian_init=hessian_init)
        h_new = jax.tree.map(jnp.add, h_old, correction)
        l_new = (tree_norm(jax.tree.map(jnp.subtract, h_new, d.diag)) if option == "shift"
                 else jnp.zeros((), jnp.float32))
        a_new = curvature(h_new, l_new)
        u_new = jax.tree.map(lambda a, w, g: a * w - g, a_new, broadcast.params, d.grad)
        a_old = _where(first, _scale(0.0, a_new), curvature(row.h, row.l))
        u_old = _where(first, _scale(0.0, u_new), row.u)
        extra = {"da": jax.tree.map(jnp.subtract, a_new, a_old),
                 "du": jax.tree.map(jnp.subtract, u_new, u_old), "l": l_new}
        new_row = FedNLPPRow(h_new, l_new, u_new, jnp.ones((), jnp.int32))
        return _output(d, data, extra), new_row

    return client_update


def fednl_pp_aggregator() -> Aggregator:
    """x = (sum a_k)^{-1} sum g~_k over the clients that reported so far; direction =
    theta^t - x (0 before any client reported). Logs the cohort's mean l_k."""

    def init(params, num_clients):
        del num_clients
        zeros = jax.tree.map(jnp.zeros_like, params)
        return FedNLPPState(zeros, zeros)

    def aggregate(state, outputs, weights, ctx):
        del weights
        c = reporting(outputs, ctx)
        a_sum = jax.tree.map(jnp.add, state.a_sum, weighted_sum(outputs.extra["da"], c))
        u_sum = jax.tree.map(jnp.add, state.u_sum, weighted_sum(outputs.extra["du"], c))
        direction = jax.tree.map(
            lambda th, a, u: jnp.where(a > 0, th - u / jnp.where(a > 0, a, 1.0), 0.0),
            ctx.params, a_sum, u_sum)
        error = jnp.sum(c * outputs.extra["l"]) / jnp.maximum(jnp.sum(c), 1.0)
        return direction, FedNLPPState(a_sum, u_sum), {"hessian_error": error}

    return Aggregator(init, aggregate, reads=("delta", "extra"))


# --------------------------------------------------------------------- factories


def _check(server_lr, mu, alpha, compressor, topk_fraction, hessian_init, option,
           num_probes, curvature_rows, training: ClientTraining):
    training.check()
    if not callable(server_lr):
        HPARAMS["server_lr"].check("server_lr", server_lr)
    H.check(HPARAMS, mu=mu, alpha=alpha, topk_fraction=topk_fraction, num_probes=num_probes,
            curvature_rows=curvature_rows)
    choice("compressor", compressor, COMPRESSORS)
    choice("hessian_init", hessian_init, HESSIAN_INITS)
    choice("option", option, OPTIONS)


def _derive(model, curvature, num_probes, curvature_rows, mode, training):
    return client_derivatives(model, curvature=curvature, num_probes=num_probes,
                              curvature_rows=curvature_rows, mode=mode, training=training)


def fednl(model, *, server_lr: Rate = 1.0, option: str = "projection", mu: float = 1.0,
          alpha: float = 1.0, compressor: str = "identity", topk_fraction: float = 0.1,
          hessian_init: str = "first", curvature: str = "auto", num_probes: int = 1,
          curvature_rows: Optional[int] = None, mode: str = "pseudo_grad",
          training: ClientTraining = ClientTraining(),
          client_table: str = "dense") -> FederatedAlgorithm:
    """FedNL (Algorithm 1) with diagonal Hessians (module doc). ``client_table``:
    "dense", "lazy" or "lazy:CAPACITY" storage of the clients' H_k. ``training``
    (``ClientTraining``; its optimizer a ``rate -> transformation``) shapes the local
    steps of ``mode="pseudo_grad"``."""
    _check(server_lr, mu, alpha, compressor, topk_fraction, hessian_init, option,
           num_probes, curvature_rows, training)
    derive = _derive(model, curvature, num_probes, curvature_rows, mode, training)
    client = fednl_client(derive, alpha=alpha,
                          compress=compressor_fn(compressor, topk_fraction),
                          hessian_init=hessian_init)
    return compose(client, mixing=uniform(), aggregator=fednl_aggregator(mu=mu, option=option),
                   server_optimizer=optax.sgd(server_lr),
                   client_state_init=lambda params: FedNLRow(
                       jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.int32)),
                   client_table=client_table)


def fednl_pp(model, *, server_lr: Rate = 1.0, option: str = "shift", mu: float = 1.0,
             alpha: float = 1.0, compressor: str = "identity", topk_fraction: float = 0.1,
             hessian_init: str = "first", curvature: str = "auto", num_probes: int = 1,
             curvature_rows: Optional[int] = None, mode: str = "pseudo_grad",
             training: ClientTraining = ClientTraining(),
             client_table: str = "dense") -> FederatedAlgorithm:
    """FedNL-PP (partial participation) with diagonal Hessians (module doc).
    ``client_table``: storage of the clients' (H_k, l_k, g~_k); ``training`` as in
    ``fednl``."""
    _check(server_lr, mu, alpha, compressor, topk_fraction, hessian_init, option,
           num_probes, curvature_rows, training)
    derive = _derive(model, curvature, num_probes, curvature_rows, mode, training)
    client = fednl_pp_client(derive, alpha=alpha, mu=mu,
                             compress=compressor_fn(compressor, topk_fraction),
                             hessian_init=hessian_init, option=option)

    def row(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return FedNLPPRow(zeros, jnp.zeros((), jnp.float32), zeros, jnp.zeros((), jnp.int32))

    return compose(client, mixing=uniform(), aggregator=fednl_pp_aggregator(),
                   server_optimizer=optax.sgd(server_lr), client_state_init=row,
                   client_table=client_table)


register("fednl", fednl, HPARAMS, family="second_order", server_rate="server_lr", size_prior=None)
register("fednl_pp", fednl_pp, HPARAMS, family="second_order", server_rate="server_lr", size_prior=None)
