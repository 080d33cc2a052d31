"""FedLF — Pan, Li, Yu, Wang, Wang, Tang, Zhao, "FedLF: Layer-Wise Fair Federated
Learning", AAAI 2024, vol. 38, pp. 14527-14535 (no arXiv version); a DQN-Fed baseline
(Mohajer Hamidi, Ye, TMLR, OpenReview KbteA50cni). The rules follow the authors' reference code
(github.com/zibinpan/FedLF, ``gfedplat/algorithm/FedLF/FedLF.py`` at commit b56e05e,
``get_FedLF_d_layers`` and ``FedLF.train_a_round``).

Each participant k in S (K_S of them) sends the gradient g_k = grad F_k(theta^t) of its
mean training loss over all its rows, and the loss l_k = F_k(theta^t). With the
preference vector p = 1 / sqrt(K_S) (all ones, normalised), the fairness coefficients
are

    h = ((l . p) l / ||l|| - p ||l||) / ||l||^2        (= -grad_l cos(l, p)),

so sum_k h_k g_k is the gradient of -cos(l(theta), p): descending it evens out the
losses. For every layer l (every parameter tensor, the code's ``Loc_list``):

    mu_l      = mean_k ||g_k,l||,          q_k,l = mu_l g_k,l / ||g_k,l||,
    f_l       = mu_l (sum_k h_k q_k,l) / ||sum_k h_k q_k,l||          (fairness row),
    lambda_l  = argmin_{lambda in simplex} || sum_r lambda_r Q_l,r ||^2,
                Q_l = [q_1,l; ...; q_K,l; f_l; a_j,l (history rows)],
    d_l       = sum_r lambda_l,r Q_l,r.

The layers are concatenated, d = (d_1, ..., d_L), rescaled to the norm of the mean
gradient and the server steps with eta_t:

    d <- d ||(1 / K_S) sum_k g_k|| / ||d||,       theta^{t+1} = theta^t - eta_t d.

History rows (``history=True``, the code's behaviour under partial participation):
the server keeps every client's last gradient and the round it was sent. If more
clients have been seen than take part in a round (n_seen > K_S), the last gradients
a_j of the absent clients seen in the last tau_h = floor(n_seen / K_S) rounds
(t - t_j <= tau_h) join every layer's QP, each rescaled to mu_l like the q rows. The
fairness row uses the participants' losses only. Under full participation no row is
ever added. Cost: an [N, d] gradient table in the server state and Gram matrices of
K + 1 + N rows per layer.

Descent guard (``descent_guard=True``, the code's "prevent the float number bias"
loop): with d_0 the concatenated min-norm direction and c = ||mean g|| / ||d_0||, while
some participant has g_k . (c d_0) < -1e-6, halve c if c > 2, else set c = 1 and stop;
the step is c d_0. (Halving never changes the sign of g_k . d, so the loop ends
either when the violation falls below 1e-6 in absolute value or at the unscaled d_0.)

Everything is computed from per-layer Gram matrices of the raw gradients (K + N rows),
so no rescaled copy of a gradient is made, and the QPs of all layers (same size) run
as one vmapped accelerated projected-gradient solve (``solvers.qp``).

Differences from the code, where it cannot be followed literally:
* Each QP is solved by ``qp_iters`` accelerated projected-gradient iterations in
  float32 (the code: cvxopt's interior point in float64); d_l, the min-norm point,
  is unique even when lambda is not.
* Degenerate rows: a participant (or history row) whose gradient of layer l is
  exactly zero, and a fairness row that vanishes (equal losses), are left out of
  layer l's QP (the code divides by zero); clients without training data are left
  out of the round (``active_clients``); a zero d gives a zero step.
* The gradient and the loss are the model's mean over all training rows without
  augmentation or dropout randomness (the code computes them in train mode, with the
  data loader's transforms); the code's ``sgd_step`` variant (one random batch) is
  not reproduced.
* ``client_gradient="pseudo"`` sends g_k = (theta^t - theta_k) / eta_l after FedAvg's
  local training (the code's commented-out alternative), for protocols where every
  method trains E local epochs; l_k is then F_k(theta^t) before training.
* The server rate is eta_t = eta phi^floor(t / s) with phi = 1 by default (the FedLF
  paper uses eta in {0.01, 0.05, 0.1} with decay 0.999 per round; DQN-Fed's grid is
  eta in {0.01, 0.05, 0.1, 0.5, 1}); the code's server optimizer is plain SGD.

Symbols -> arguments: eta = ``server_lr``, phi = ``server_lr_decay`` per ``decay_every``
= s rounds; history rows = ``history``; the guard = ``descent_guard``; QP iterations =
``qp_iters``; how g_k is obtained = ``client_gradient`` (then eta_l, E, B =
``training.lr``, ``training.num_epochs``, ``training.batch_size``: ``ClientTraining``).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax import lax

from fedjax_fair.core import execution
from fedjax_fair import hparams as H
from fedjax_fair.core.aggregators import Aggregator
from fedjax_fair.core.algorithm import FederatedAlgorithm, compose
from fedjax_fair.algorithms.families.training import Rate
from fedjax_fair.algorithms.fedmgda import server_schedule
from fedjax_fair.core.client import ClientTraining, data_loss, local_training, round_value
from fedjax_fair.core.mixing import active_clients, uniform
from fedjax_fair.solvers import qp
from fedjax_fair.core.types import ClientData, ClientOutput
from fedjax_fair.algorithms.registry import register

GRADIENTS = ("global", "pseudo")
GUARD_TOL = 1e-6  # the code's threshold on max_k -(g_k . d)
GUARD_ITERS = 160  # halvings of the guard loop: enough for any float32 scale
HPARAMS = {"server_lr": H.POSITIVE, "server_lr_decay": H.POSITIVE, "decay_every": H.COUNT,
           "qp_iters": H.Range(1, None, integer=True)}

_HI = lax.Precision.HIGHEST


# ------------------------------------------------------------------------ clients


def gradient_client(model, loss_chunk_size: Optional[int] = None):
    """FedLF's client (``client_gradient="global"``): g_k = grad F_k(theta^t) and
    l_k = F_k(theta^t), the mean over all its training rows (the code's
    ``cal_gradient_loss``), returned as ``delta`` and ``loss_before``. A client without
    rows returns zeros."""

    def client_update(broadcast, client_state, data: ClientData, local_steps, key):
        del local_steps, key
        chunk = execution.loss_chunk_size_here() if loss_chunk_size is None else loss_chunk_size
        loss, grad = jax.value_and_grad(lambda p: data_loss(model, p, data, chunk))(
            broadcast.params)
        steps = (data.num_examples > 0).astype(jnp.int32)
        return ClientOutput(delta=grad, loss_before=loss, num_examples=data.num_examples,
                            num_steps=steps, extra=(), train_loss=loss), client_state

    return client_update


def pseudo_gradient_client(local_update, client_lr: Rate = 0.1):
    """``client_gradient="pseudo"``: FedAvg's local training ``local_update``
    (``local_training``), then g_k = (theta^t - theta_k) / eta_l, eta_l being this
    round's ``client_lr`` (``training.lr``)."""

    def client_update(broadcast, client_state, data, local_steps, key):
        out, row = local_update(broadcast, client_state, data, local_steps, key)
        scale = 1.0 / round_value(client_lr, broadcast.round)
        return out._replace(delta=jax.tree.map(lambda d: scale * d, out.delta)), row

    return client_update


# ------------------------------------------------------------------------- server


def fairness_coefficients(losses, active):
    """h = ((l . p) l / ||l|| - p ||l||) / ||l||^2 over the active rows (0 elsewhere),
    p = 1 / sqrt(#active); h = 0 when every loss is 0."""
    active = jnp.asarray(active, bool)
    l = jnp.where(active, jnp.asarray(losses, jnp.float32), 0.0)
    k = jnp.maximum(jnp.sum(active), 1).astype(jnp.float32)
    p = jnp.where(active, lax.rsqrt(k), 0.0)
    norm = jnp.sqrt(jnp.sum(jnp.square(l)))
    ok = norm > 0
    safe = jnp.where(ok, norm, 1.0)
    h = (jnp.dot(l, p) * l / safe - p * safe) / jnp.square(safe)
    return jnp.where(ok & active, h, 0.0)


def _flat(leaf, rows):
    return leaf.reshape(rows, -1).astype(jnp.float32)


def _leaf_grams(grads, k, history=None, n=0):
    """Raw Gram matrices [L, K + N, K + N] of [g_k,l; a_j,l] per leaf l."""
    grams = []
    hist_leaves = jax.tree.leaves(history) if history is not None else None
    for i, leaf in enumerate(jax.tree.leaves(grads)):
        a = _flat(leaf, k)
        cc = jnp.matmul(a, a.T, precision=_HI)
        if hist_leaves is None:
            grams.append(cc)
            continue
        b = _flat(hist_leaves[i], n)
        ch = jnp.matmul(a, b.T, precision=_HI)
        hh = jnp.matmul(b, b.T, precision=_HI)
        grams.append(jnp.block([[cc, ch], [ch.T, hh]]))
    return jnp.stack(grams)


def guard_scale(scale, violation, tol=GUARD_TOL):
    """The code's loop on c, starting at ``scale``: while c * violation > tol, halve c
    if c > 2, else set c = 1 and stop (``violation`` = max_k -(g_k . d_0))."""

    def body(_, carry):
        c, done = carry
        violated = jnp.logical_and(~done, c * violation > tol)
        halve = violated & (c > 2.0)
        reset = violated & ~(c > 2.0)
        c = jnp.where(halve, 0.5 * c, jnp.where(reset, jnp.ones_like(c), c))
        return c, done | ~violated | reset

    c, _ = lax.fori_loop(0, GUARD_ITERS, body, (jnp.asarray(scale, jnp.float32),
                                                jnp.zeros((), bool)))
    return c


class LayerSolution(NamedTuple):
    """What ``fedlf_direction`` found (diagnostics)."""

    lambdas: jax.Array  # [L, K + 1 + N] lambda per layer: K participants, fairness, history
    scale: jax.Array  # [] the final c (||mean g|| / ||d_0|| unless the guard acted)
    unscaled_scale: jax.Array  # [] ||mean g|| / ||d_0||
    descent: jax.Array  # [K] g_k . d of the returned d


def fedlf_direction(grads, losses, active, history=None, history_active=None, *,
                    qp_iters: int = 200, descent_guard: bool = True, method: str = "sort"):
    """FedLF's server direction d (module docstring) and its ``LayerSolution``.

    Parameters
    ----------
    grads : pytree with leading axis K
        g_k, one row per cohort slot.
    losses : float [K]
        l_k = F_k(theta^t).
    active : bool [K]
        Participating rows (masked padding and clients without data: False).
    history : pytree with leading axis N, optional
        Stored gradients a_j of all clients; ``history_active`` [N] bool marks the
        rows that join the QPs this round.
    qp_iters : int
        Iterations of each layer's simplex QP.
    descent_guard : bool
        Apply the code's scale fallback (``guard_scale``).
    """
    active = jnp.asarray(active, bool)
    leaves = jax.tree.leaves(grads)
    k = leaves[0].shape[0]
    n = 0 if history is None else jax.tree.leaves(history)[0].shape[0]
    r = _leaf_grams(grads, k, history, n)  # [L, P, P], P = K + N
    row_active = (active if history is None
                  else jnp.concatenate([active, jnp.asarray(history_active, bool)]))
    norms = jnp.sqrt(jnp.maximum(jnp.diagonal(r, axis1=1, axis2=2), 0.0))  # [L, P]
    k_active = jnp.maximum(jnp.sum(active), 1).astype(jnp.float32)
    mu = jnp.sum(jnp.where(active, norms[:, :k], 0.0), axis=1) / k_active  # [L]
    ok = row_active[None, :] & (norms > 0)
    s = jnp.where(ok, mu[:, None] / jnp.where(ok, norms, 1.0), 0.0)  # [L, P]

    # Fairness row: f_l = sigma_l sum_k h_k s_k g_k,l with sigma_l = mu_l / ||sum h s g||.
    h = fairness_coefficients(losses, active)
    a = jnp.concatenate([h[None, :] * s[:, :k], jnp.zeros((s.shape[0], n), jnp.float32)],
                        axis=1)  # [L, P]
    f_sq = jnp.einsum("lp,lpq,lq->l", a, r, a, precision=_HI)
    f_ok = f_sq > 0
    sigma = jnp.where(f_ok, mu / jnp.sqrt(jnp.where(f_ok, f_sq, 1.0)), 0.0)

    # Each layer's QP rows are s_p x_p (p = raw row) and the fairness row sigma sum_p a_p x_p;
    # their Gram is assembled in O(P^2) and the fairness row/column inserted after the
    # K participants: order [participants (K), fairness (1), history (N)].
    ra = jnp.einsum("lpq,lq->lp", r, a, precision=_HI)  # (R a)_p
    scaled = s[:, :, None] * r * s[:, None, :]
    cross = sigma[:, None] * ra * s  # fairness row . row p
    fair = jnp.square(sigma) * f_sq
    top = jnp.concatenate([scaled[:, :k, :k], cross[:, :k, None], scaled[:, :k, k:]], axis=2)
    mid = jnp.concatenate([cross[:, None, :k], fair[:, None, None], cross[:, None, k:]],
                          axis=2)
    low = jnp.concatenate([scaled[:, k:, :k], cross[:, k:, None], scaled[:, k:, k:]], axis=2)
    gram = jnp.concatenate([top, mid, low], axis=1)  # [L, K + 1 + N, K + 1 + N]
    qp_active = jnp.concatenate([ok[:, :k], f_ok[:, None], ok[:, k:]], axis=1)
    hi = qp_active.astype(jnp.float32)
    x0 = hi / jnp.maximum(jnp.sum(hi, axis=1, keepdims=True), 1.0)
    solve = lambda g, lo_, hi_, x0_: qp.solve_box_simplex_qp(
        g, jnp.zeros(g.shape[:1], g.dtype), lo_, hi_, num_iters=qp_iters, x0=x0_,
        method=method)
    lambdas = jax.vmap(solve)(gram, jnp.zeros_like(hi), hi, x0)  # [L, K + 1 + N]
    # d_l = sum_p u_p x_p with u_p = s_p lambda_p + sigma a_p lambda_fair.
    row_lambda = jnp.concatenate([lambdas[:, :k], lambdas[:, k + 1:]], axis=1)
    u = s * row_lambda + (sigma * lambdas[:, k])[:, None] * a

    # ||d_0||, g_k . d_0 and ||mean g|| from the Grams.
    d_sq = jnp.sum(jnp.einsum("lp,lpq,lq->l", u, r, u, precision=_HI))
    descent = jnp.sum(jnp.einsum("lkq,lq->lk", r[:, :k, :], u, precision=_HI), axis=0)
    mean_w = active.astype(jnp.float32) / k_active
    g_sq = jnp.sum(jnp.einsum("k,lkj,j->l", mean_w, r[:, :k, :k], mean_w, precision=_HI))
    d_ok = d_sq > 0
    scale0 = jnp.where(d_ok, jnp.sqrt(jnp.maximum(g_sq, 0.0))
                       / jnp.sqrt(jnp.where(d_ok, d_sq, 1.0)), 0.0)
    if descent_guard:
        violation = jnp.max(jnp.where(active, -descent, -jnp.inf))
        scale = guard_scale(scale0, violation)
    else:
        scale = scale0

    hist_leaves = jax.tree.leaves(history) if history is not None else None
    out = []
    for i, leaf in enumerate(leaves):
        w = scale * u[i]
        d = jnp.tensordot(w[:k].astype(leaf.dtype), leaf, axes=1)
        if hist_leaves is not None:
            hl = hist_leaves[i]
            d = d + jnp.tensordot(w[k:].astype(hl.dtype), hl, axes=1).astype(d.dtype)
        out.append(d)
    direction = jax.tree.unflatten(jax.tree.structure(grads), out)
    return direction, LayerSolution(lambdas, scale, scale0, scale * descent)


class FedLFState(NamedTuple):
    """The server's memory of every client's last gradient (``history=True``)."""

    gradients: Any  # pytree, leaves [N, ...]
    last_round: jax.Array  # int32 [N], -1 = never seen


def history_rows(last_round, client_ids, client_mask, round_):
    """The absent clients whose last gradient joins this round's QPs: seen, sent in
    the last floor(n_seen / K_S) rounds, not in the cohort; none unless
    n_seen > K_S (the code's ``train_a_round``)."""
    n = last_round.shape[0]
    seen = last_round >= 0
    n_seen = jnp.sum(seen)
    k_on = jnp.maximum(jnp.sum(client_mask), 1)
    window = n_seen // k_on
    in_cohort = jnp.zeros((n,), bool).at[jnp.where(client_mask, client_ids, n)].set(
        True, mode="drop")
    return (n_seen > k_on) & seen & (round_ - last_round <= window) & ~in_cohort


def fedlf_aggregator(*, history: bool = True, qp_iters: int = 200,
                     descent_guard: bool = True, method: str = "sort") -> Aggregator:
    """FedLF's server step as an ``Aggregator`` on clients that send gradients as
    ``delta`` and losses as ``loss_before`` (the incoming mixing weights are not used).

    ``info``: "lambdas" [K] (mean over layers), "fair_lambda" (mean over layers),
    "history_rows" (how many stored gradients joined), "scale" (c) and "guarded"
    (1 when the guard changed c)."""
    H.check(HPARAMS, qp_iters=qp_iters)
    qp._check_method(method)

    def init(params, num_clients):
        if not history:
            return ()
        grads = jax.tree.map(lambda p: jnp.zeros((num_clients, *jnp.shape(p)), jnp.float32),
                             params)
        return FedLFState(grads, jnp.full((num_clients,), -1, jnp.int32))

    def aggregate(state, outputs, weights, ctx):
        del weights
        active = active_clients(outputs, ctx.client_mask)
        if history:
            rows = history_rows(state.last_round, ctx.client_ids, ctx.client_mask, ctx.round)
            stored = state.gradients
        else:
            rows, stored = None, None
        direction, sol = fedlf_direction(outputs.delta, outputs.loss_before, active, stored,
                                         rows, qp_iters=qp_iters, descent_guard=descent_guard,
                                         method=method)
        k = ctx.client_ids.shape[0]
        info = {"lambdas": jnp.mean(sol.lambdas[:, :k], axis=0),
                "fair_lambda": jnp.mean(sol.lambdas[:, k]),
                "scale": sol.scale,
                "guarded": (sol.scale != sol.unscaled_scale).astype(jnp.float32),
                "history_rows": (jnp.sum(rows) if history else jnp.zeros((), jnp.int32)
                                 ).astype(jnp.float32)}
        if history:
            n = state.last_round.shape[0]
            write = jnp.where(ctx.client_mask, ctx.client_ids, n)  # out of range: dropped
            grads = jax.tree.map(lambda t, g: t.at[write].set(g.astype(t.dtype), mode="drop"),
                                 state.gradients, outputs.delta)
            last = state.last_round.at[write].set(ctx.round.astype(jnp.int32), mode="drop")
            state = FedLFState(grads, last)
        return direction, state, info

    return Aggregator(init, aggregate, reads=("delta", "loss_before"))


def fedlf(model, *, server_lr: Rate = 0.1, server_lr_decay: float = 1.0, decay_every: int = 1,
          history: bool = True, descent_guard: bool = True, qp_iters: int = 200,
          client_gradient: str = "global",
          training: ClientTraining = ClientTraining()) -> FederatedAlgorithm:
    """FedLF (module docstring): layer-wise min-norm direction with a fairness row.

    Parameters
    ----------
    server_lr, server_lr_decay, decay_every :
        eta, phi, s of eta_t = eta phi^floor(t / s); eta and phi may be traced and
        ``server_lr`` may be a schedule of the round.
    history : bool
        Add the recent gradients of absent clients to the QPs (the code's behaviour;
        keeps an [N, d] table on the server).
    descent_guard : bool
        The code's scale fallback when some participant's g_k . d < -1e-6.
    qp_iters : int
        Iterations of every layer's simplex QP.
    client_gradient : {"global", "pseudo"}
        g_k = grad F_k(theta^t) over all rows (the code; ``training`` is then only
        checked) or (theta^t - theta_k) / eta_l after local training.
    training : ClientTraining
        The local training of ``client_gradient="pseudo"``.
    """
    H.check(HPARAMS, server_lr_decay=server_lr_decay, decay_every=decay_every,
            qp_iters=qp_iters)
    if not callable(server_lr):
        HPARAMS["server_lr"].check("server_lr", server_lr)
    for name, value in (("history", history), ("descent_guard", descent_guard)):
        if not isinstance(value, bool):
            raise H.FieldError(name, f"must be true or false, got {value!r}")
    if client_gradient not in GRADIENTS:
        raise H.FieldError("client_gradient", f"must be one of {GRADIENTS}, got "
                                              f"{client_gradient!r}")
    # Built in both modes, so ``training`` is always checked.
    local = local_training(model, training)
    if client_gradient == "global":
        client = gradient_client(model)
    else:
        if isinstance(training.optimizer, optax.GradientTransformation):
            raise H.FieldError("client_optimizer", "client_gradient='pseudo' divides by the "
                                                   "client rate; give a rate -> optimizer callable")
        client = pseudo_gradient_client(local, training.lr)
    return compose(client, mixing=uniform(),
                   aggregator=fedlf_aggregator(history=history, qp_iters=qp_iters,
                                               descent_guard=descent_guard),
                   server_optimizer=optax.sgd(server_schedule(server_lr, server_lr_decay,
                                                              decay_every)))


register("fedlf", fedlf, HPARAMS, family="fair", server_rate="server_lr", size_prior=None,
         search_space={"server_lr": (0.01, 0.05, 0.1, 0.5, 1.0)},
         search_source="DQN-Fed (TMLR, OpenReview KbteA50cni), Appendix H: eta in {0.01, 0.05, 0.1, 0.5, 1}")
