"""FedMGDA+ — Hu, Wang, Xu, Yu, "Federated Learning Meets Multi-objective Optimization",
IEEE Transactions on Network Science and Engineering 2022 (arXiv:2006.11489);
a baseline of DQN-Fed (TMLR, OpenReview KbteA50cni) and of the AAggFF thesis (Hahn, UNIST 2024).

Every participating client k sends its model delta Delta_k = theta^t - theta_k. The
server normalises the deltas, finds the minimum-norm point of their convex hull
restricted to an eps-box around the centre weights lambda0, and steps along it:

    g_k = Delta_k / ||Delta_k||              (g_k = 0 when Delta_k = 0)
    lambda* = argmin_{lambda in simplex, |lambda_k - lambda0_k| <= eps} || sum_k lambda_k g_k ||^2
    d = sum_k lambda*_k g_k
    theta^{t+1} = theta^t - eta_t d,         eta_t = eta * phi^floor(t / s).

The QP is lambda^T G lambda with the normalised Gram matrix G_kj = g_k . g_j (K x K),
over the box lo = max(0, lambda0 - eps), hi = min(1, lambda0 + eps) intersected with
the simplex, solved by accelerated projected gradient with an exact projection
(``fedjax_fair.qp``) for ``qp_iters`` iterations. Since lambda0 is on the simplex
and inside its own box, the feasible set is never empty. eps = 0 pins
lambda* = lambda0 (FedAvg's weighted mean of the NORMALISED updates); eps >= 1 is
plain MGDA over the participants (min-norm element of their convex hull, a common
descent direction: g_k . d >= ||d||^2 for every k).

As a mixing-coefficient rule (AAggFF thesis, appendix §8.1) the effective weight on the raw
delta is lambda*_k / ||Delta_k||, which is not on the simplex; hence FedMGDA+ is an
``Aggregator`` (it needs the deltas) whose incoming ``weights`` are the centre
lambda0: any ``MixingRule`` can supply it (``by_num_examples``: data weights
p_k = n_k / sum_S n_j, the FedMGDA+ paper and DQN-Fed; ``uniform``: 1 / |S|,
the AAggFF reference code). Clients with lambda0_k = 0 (masked-out cohort rows, and
clients without training data under ``by_num_examples``) are pinned at
lambda*_k = 0 and never influence the direction. (Under ``uniform`` an empty client
keeps a positive centre and a zero g_k, and MGDA may move weight onto it, which
shortens d: the min-norm point of a hull containing 0 is 0.)

Symbols -> arguments: eps = ``epsilon``; eta = ``server_lr``; phi = ``server_lr_decay``
(per ``decay_every`` = s rounds; default 1.0, a constant rate: the AAggFF thesis and
DQN-Fed give no decay for FedMGDA+);
lambda0 = the mixing rule's weights (``center``, or ``mixing=``); the QP iteration count
= ``qp_iters``. Grids: eps in {0.1, 0.5, 1} (AAggFF thesis; reference scripts pick
1.0 Berka, 0.1 MQP, 0.5 otherwise), eps in {0.01, 0.05, 0.1, 0.5, 1} (DQN-Fed).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax import lax

from fedjax_fair import hparams as H
from fedjax_fair.core.aggregators import Aggregator, weighted_sum
from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.algorithms.families.training import Rate, Transform
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.core.mixing import MixingRule, by_num_examples, uniform
from fedjax_fair.solvers import qp
from fedjax_fair.algorithms.registry import register

CENTERS = {"num_examples": by_num_examples, "uniform": uniform}


def center_prior(by_size: bool) -> dict:
    """FedMGDA+'s ``Method.size_prior``: the centre of its weight box is the plain
    average, n_k / n ("num_examples") or uniform."""
    return {"center": "num_examples" if by_size else "uniform"}


HPARAMS = {"epsilon": H.NONNEGATIVE, "server_lr": H.POSITIVE, "server_lr_decay": H.POSITIVE,
           "decay_every": H.COUNT, "qp_iters": H.Range(0, None, integer=True)}


def normalized_gram(deltas, active=None):
    """Normalised Gram matrix of the stacked client deltas.

    Parameters
    ----------
    deltas : pytree with leading axis K
        Delta_k = theta^t - theta_k.
    active : bool array [K], optional
        Rows to keep; the others get a zero row / column and a zero inverse norm.

    Returns
    -------
    gram : float32 [K, K]
        G_kj = g_k . g_j with g_k = Delta_k / ||Delta_k|| (0 for a zero delta).
    inv_norm : float32 [K]
        1 / ||Delta_k||, or 0 for zero (or inactive) deltas, so g_k = inv_norm_k Delta_k.
    """
    leaves = jax.tree.leaves(deltas)
    k = leaves[0].shape[0]
    raw = jnp.zeros((k, k), jnp.float32)
    for leaf in leaves:  # one K x K matmul per leaf, HIGHEST: TF32 would damage G
        flat = leaf.reshape(k, -1).astype(jnp.float32)
        raw = raw + jnp.matmul(flat, flat.T, precision=lax.Precision.HIGHEST)
    sq = jnp.diagonal(raw)
    nonzero = sq > jnp.finfo(jnp.float32).tiny
    if active is not None:
        nonzero = nonzero & active
    inv_norm = jnp.where(nonzero, lax.rsqrt(jnp.where(nonzero, sq, 1.0)), 0.0)
    gram = inv_norm[:, None] * raw * inv_norm[None, :]
    return gram, inv_norm


def mgda_box(center, epsilon):
    """lo = max(0, lambda0 - eps), hi = min(1, lambda0 + eps); lo = hi = 0 where
    lambda0 = 0 (masked or weightless clients)."""
    center = jnp.asarray(center, jnp.float32)
    active = center > 0
    lo = jnp.where(active, jnp.maximum(center - epsilon, 0.0), 0.0)
    hi = jnp.where(active, jnp.minimum(center + epsilon, 1.0), 0.0)
    return lo, hi


def fedmgda_plus_lambdas(gram, center, epsilon, *, qp_iters: int = 200,
                         method: str = "sort"):
    """lambda* = argmin lambda^T G lambda over the simplex and the eps-box around
    lambda0 (FedMGDA+), started from lambda0.

    Parameters
    ----------
    gram : float [K, K]
        G, the normalised Gram matrix (``normalized_gram``).
    center : float [K]
        lambda0 on the simplex over the participants (0 elsewhere).
    epsilon : float
        eps >= 0; 0 returns lambda0 exactly, >= 1 is unconstrained MGDA.
    qp_iters : int
        Fixed number of QP iterations (``qp.solve_box_simplex_qp``).

    Returns
    -------
    lambdas : float32 [K]
        lambda*, on the simplex and inside the box (zero where lambda0 = 0; all zero
        when no client is active).
    """
    lo, hi = mgda_box(center, epsilon)
    gram = jnp.asarray(gram, jnp.float32)
    c = jnp.zeros(gram.shape[:1], jnp.float32)
    return qp.solve_box_simplex_qp(gram, c, lo, hi, num_iters=qp_iters,
                                   x0=jnp.asarray(center, jnp.float32), method=method)


def fedmgda_plus_direction(deltas, center, epsilon, *, qp_iters: int = 200,
                           method: str = "sort"):
    """d = sum_k lambda*_k Delta_k / ||Delta_k|| and lambda* (module docstring).

    Returns
    -------
    direction : pytree like one client's delta
        d, a convex combination of unit vectors (||d|| <= 1).
    lambdas : float32 [K]
        lambda*.
    """
    center = jnp.asarray(center, jnp.float32)
    gram, inv_norm = normalized_gram(deltas, active=center > 0)
    lambdas = fedmgda_plus_lambdas(gram, center, epsilon, qp_iters=qp_iters, method=method)
    return weighted_sum(deltas, lambdas * inv_norm), lambdas


class FedMGDAState(NamedTuple):
    """Nothing carried between rounds: FedMGDA+'s aggregation is stateless."""


def fedmgda_plus_aggregator(epsilon: float = 0.1, *, qp_iters: int = 200,
                            method: str = "sort") -> Aggregator:
    """FedMGDA+ as an ``Aggregator``: the incoming mixing weights are the centre lambda0.

    Works with any client update and any ``MixingRule`` (the centre), e.g.
    ``compose(client_update, mixing=uniform(), aggregator=fedmgda_plus_aggregator(0.5))``.
    ``info["lambdas"]`` holds lambda* [K].
    """
    H.check(HPARAMS, epsilon=epsilon, qp_iters=qp_iters)
    qp._check_method(method)

    def init(params, num_clients):
        del params, num_clients
        return FedMGDAState()

    def aggregate(state, outputs, weights, ctx):
        direction, lambdas = fedmgda_plus_direction(outputs.delta, weights, epsilon,
                                                    qp_iters=qp_iters, method=method)
        return direction, state, {"lambdas": lambdas}

    # the weights solve a QP over every normalised update
    return Aggregator(init, aggregate, reads=("delta",))


def server_schedule(server_lr, server_lr_decay=1.0, decay_every: int = 1):
    """eta_t = eta * phi^floor(t / s) as an optax schedule (t = server steps taken).

    Traced (non-Python) ``server_lr`` / ``server_lr_decay`` are allowed, so a whole run
    can be differentiated or vmapped over them; ``server_lr`` may itself be a schedule
    of the round."""
    def schedule(count):
        rate = server_lr(count) if callable(server_lr) else server_lr
        return rate * jnp.power(server_lr_decay, (count // decay_every).astype(jnp.float32))
    return schedule


def fedmgda_plus(model, *, epsilon: float = 0.1, server_lr: Rate = 1.0,
                 server_lr_decay: float = 1.0, decay_every: int = 1, qp_iters: int = 200,
                 center: str = "num_examples",
                 training: ClientTraining = ClientTraining(),
                 mixing: Optional[MixingRule] = None,
                 server_optimizer: Optional[Transform] = None) -> FederatedAlgorithm:
    """FedAvg local training with FedMGDA+ aggregation and server step eta_t d.

    Parameters
    ----------
    model : Model
    epsilon : float
        eps, the box half-width around the centre weights (0 = FedAvg over the
        normalised updates, 1 = MGDA).
    server_lr, server_lr_decay, decay_every :
        eta, phi, s of eta_t = eta phi^floor(t / s) (the server's sgd step); eta and
        phi may be traced.
    qp_iters : int
        Fixed number of QP iterations per round.
    center : {"num_examples", "uniform"}
        lambda0: data weights (default; the paper, DQN-Fed) or 1 / |S| (the
        AAggFF reference code). A ``mixing=`` rule, if given, is the centre instead.
    training : ClientTraining
        FedAvg's local training (eta_l = ``training.lr``, B = ``training.batch_size``).
    server_optimizer :
        Replaces the sgd(eta_t) step; then leave ``server_lr`` and
        ``server_lr_decay`` at 1.0.
    """
    H.check(HPARAMS, epsilon=epsilon, server_lr_decay=server_lr_decay,
            decay_every=decay_every, qp_iters=qp_iters)
    if not callable(server_lr):
        HPARAMS["server_lr"].check("server_lr", server_lr)
    if center not in CENTERS:
        raise H.FieldError("center", f"must be one of {sorted(CENTERS)}, got {center!r}")
    if mixing is not None and center != "num_examples":
        raise H.FieldError("center", "give either center or mixing, not both")
    if server_optimizer is not None and not (
            H.is_concrete(server_lr) and server_lr == 1.0
            and H.is_concrete(server_lr_decay) and server_lr_decay == 1.0):
        raise H.FieldError("server_optimizer", "replaces the sgd(server_lr) server step; "
                                               "leave server_lr and server_lr_decay at 1.0 when "
                                               "giving one")
    if server_optimizer is None:
        server_optimizer = optax.sgd(server_schedule(server_lr, server_lr_decay, decay_every))
    return fedavg(model, training=training,
                  mixing=mixing or CENTERS[center](),
                  aggregator=fedmgda_plus_aggregator(epsilon, qp_iters=qp_iters),
                  server_optimizer=server_optimizer)


register("fedmgda_plus", fedmgda_plus, HPARAMS, family="fair", server_rate="server_lr",
         size_prior=center_prior)
