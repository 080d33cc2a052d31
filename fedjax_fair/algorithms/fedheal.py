"""FedHEAL — Chen, Huang, Ye, "Fair Federated Learning under Domain Skew with Local
Consistency and Domain Diversity", CVPR 2024 (arXiv:2405.16585); a DQN-Fed baseline
(Mohajer Hamidi, Ye, TMLR, OpenReview KbteA50cni). The rules follow the authors' code (github.com/yuhangchen0/FedHEAL,
commit fa4f640: ``models/utils/federated_model.py``, ``consistency_mask``,
``compute_distance``, ``get_params_diff_weights``, ``aggregate_nets_parameter``).

FedAvg local training; client k returns Delta_k = theta^t - theta_k. Two pieces:

FPHL (parameter masking by local update consistency). Client k keeps, for every
parameter j, the fraction h_kj of its past participations in which Delta_kj >= 0,
and its participation count c_k. On its first participation every parameter is kept;
afterwards

    cons_kj = h_kj if Delta_kj >= 0 else 1 - h_kj,
    m_kj    = 1[cons_kj > tau]                          (strict, as in the code)
    h_kj   <- (c_k h_kj + 1[Delta_kj >= 0]) / (c_k + 1),  c_k <- c_k + 1.

FAEL (aggregation weights by momentum on the normalised masked-update distances).
With D_k = sum over parameter tensors l of ||m_k,l * Delta_k,l|| (the code's
``compute_distance``: a sum of per-tensor norms; ``distance="global"`` takes the
norm of the whole masked update instead):

    delta_k <- (1 - beta) delta_k + beta D_k / sum_{j in S} D_j     (delta_k = 0 at first)
    w_k     <- w_k + delta_k                                        (w_k = 1/K at first)
    p_k      = w_k / sum_{j in S} w_j                               (k in S)

w_k is stored unnormalised (the code keeps ``previous_weights`` before the division).
Aggregation is per parameter over the clients that kept it, and the server steps
with rate eta_g (1 in the code):

    d_j = sum_k p_k m_kj Delta_kj / sum_k p_k m_kj     (0 where no client kept j),
    theta^{t+1} = theta^t - eta_g d.

Reductions: beta = 0 keeps p_k uniform over the participants holding data; a
client's first participation keeps every parameter, so the first round with beta = 0
is FedAvg with uniform weights, and ``fphl=False`` with beta = 0 is uniform FedAvg in
every round (``fedavg(weight_by_size=False)`` when every participant holds data).
tau = 0 drops only the parameters whose current sign the client has never produced
before (cons = 0); tau = 1 drops every parameter after the first participation
(cons <= 1).

State: h_k and c_k are the client's table row (dense or lazy); delta_k, w_k (and
whether k was seen) live in the mixing rule's state over all N clients. Rows of
clients outside the cohort never change.

Differences from the code, where it cannot be followed literally:
* Partial participation. The code averages h with the global round index t and
  keeps ``sum(euclidean_distance.values())`` over every client ever seen (stale
  entries included); it only runs with every client online (its history is created
  at round 0 only). Here h averages over the client's own participations c_k
  (= t under full participation) and the distances are normalised over the cohort.
  w_k starts at 1/K, K the cohort size (the code's ``online_num``; masked padding
  rows count), so beta = 0 keeps equal weights whatever the cohort's padding.
* Degenerate inputs: sum_j D_j = 0 (every masked update zero) gives a zero share
  instead of 0/0; clients without training data get weight 0 (``active_clients``).
* The code's local optimizer is SGD with momentum 0.9 and weight decay 1e-5; here
  any ``training.optimizer`` (default plain SGD).

Hyper-parameters: the code's defaults are threshold 0.3 and beta 0.4; the DQN-Fed
paper's grid lists (alpha, beta) = (0.5, 0.5), (gamma_s, gamma_c) = (0.5, 0.9), symbols
that do not map onto the code's two; we use the paper's 0.5 for both:
the defaults here are tau = beta = 0.5. (The equations above are the code's; the
FedHEAL paper's own text was not available when this was written.)

Symbols -> arguments: tau (the code's ``threshold``) = ``tau``; beta = ``beta``;
eta_g = ``server_lr``; eta_l, E, B = ``training.lr``, ``training.num_epochs``,
``training.batch_size`` (``ClientTraining``);
FPHL on/off (off: FAEL alone, no client rows) = ``fphl``; the distance form =
``distance``.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_fair import hparams as H
from fedjax_fair.core.aggregators import Aggregator, stateless, weighted_sum
from fedjax_fair.core.algorithm import FederatedAlgorithm, compose
from fedjax_fair.algorithms.families.training import Rate
from fedjax_fair.core.client import ClientTraining, local_training
from fedjax_fair.core.mixing import MixingRule, active_clients, normalize
from fedjax_fair.algorithms.registry import register

DISTANCES = ("layers", "global")
HPARAMS = {"tau": H.Range(0.0, 1.0), "beta": H.Range(0.0, 1.0), "server_lr": H.POSITIVE}


# ------------------------------------------------------------------------- FPHL


class SignHistory(NamedTuple):
    """Client k's row: the fraction of its participations with Delta >= 0, per
    parameter (params-shaped float32), and the number of participations."""

    positive: Any
    count: jax.Array  # int32 []


def sign_history_init(params) -> SignHistory:
    return SignHistory(jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params),
                       jnp.zeros((), jnp.int32))


def consistency_mask(delta, row: SignHistory, tau):
    """FPHL for one client: (mask, new row) from its update Delta_k and history.

    mask_j = True on the first participation, else cons_j > tau with
    cons_j = h_j if Delta_j >= 0 else 1 - h_j; the row then absorbs the sign of
    Delta (module docstring). ``tau`` may be traced."""
    first = row.count == 0
    count = row.count.astype(jnp.float32)

    def leaf_mask(d, h):
        pos = d >= 0
        cons = jnp.where(pos, h, 1.0 - h)
        return jnp.logical_or(first, cons > tau)

    def leaf_history(d, h):
        return (count * h + (d >= 0).astype(jnp.float32)) / (count + 1.0)

    mask = jax.tree.map(leaf_mask, delta, row.positive)
    positive = jax.tree.map(leaf_history, delta, row.positive)
    return mask, SignHistory(positive, row.count + 1)


def fphl_finish(tau):
    """The client's ``finish`` hook: returns (new row, mask) with the mask as
    ``ClientOutput.extra`` (a bool pytree shaped like the parameters)."""

    def finish(result, broadcast, row, data, key):
        del data, key
        delta = jax.tree.map(jnp.subtract, broadcast.params, result.params)
        mask, new_row = consistency_mask(delta, row, tau)
        return new_row, mask

    return finish


def _has_masks(extra) -> bool:
    return len(jax.tree.leaves(extra)) > 0


def _expand(w, leaf):
    """[K] weights with singleton axes to broadcast against a leaf [K, ...]."""
    return w.reshape(w.shape + (1,) * (leaf.ndim - 1))


# ------------------------------------------------------------------------- FAEL


def masked_distances(deltas, masks=None, distance: str = "layers"):
    """D_k [K]: sum over leaves of ||m_k * Delta_k|| ("layers", the code) or the norm
    of the whole masked update ("global"). ``masks`` None keeps every parameter."""
    _check_distance(distance)
    per_leaf = []
    mask_leaves = (jax.tree.leaves(masks) if masks is not None
                   else [None] * len(jax.tree.leaves(deltas)))
    for d, m in zip(jax.tree.leaves(deltas), mask_leaves):
        x = d if m is None else jnp.where(m, d, 0.0)
        x = x.reshape(x.shape[0], -1).astype(jnp.float32)
        per_leaf.append(jnp.sum(jnp.square(x), axis=1))
    if distance == "layers":
        return sum(jnp.sqrt(s) for s in per_leaf)
    return jnp.sqrt(sum(per_leaf))


def fael_weights(momentum, weight, seen, dist, active, beta, initial_weight):
    """One FAEL step for the cohort (arrays [K]; module docstring).

    Parameters
    ----------
    momentum, weight : float [K]
        delta_k and w_k kept from the clients' previous participations.
    seen : bool [K]
        Whether client k has a w_k yet (else it starts at ``initial_weight``).
    dist : float [K]
        D_k, the masked-update distances.
    active : bool [K]
        Rows taking part (the others get weight 0).
    beta : float
        The momentum rate (may be traced).
    initial_weight : float
        w_k of a client seen for the first time (1 / K, K the cohort size).

    Returns
    -------
    (p [K] on the simplex over ``active``, new delta_k [K], new w_k [K]).
    """
    dist = jnp.where(active, jnp.asarray(dist, jnp.float32), 0.0)
    total = jnp.sum(dist)
    share = jnp.where(total > 0, dist / jnp.where(total > 0, total, 1.0), 0.0)
    new_momentum = (1.0 - beta) * momentum + beta * share
    new_weight = jnp.where(seen, weight, initial_weight) + new_momentum
    return normalize(new_weight, active), new_momentum, new_weight


class FAELState(NamedTuple):
    """delta_k, w_k (unnormalised) and "seen" for all N clients."""

    momentum: jax.Array  # float32 [N]
    weight: jax.Array  # float32 [N]
    seen: jax.Array  # bool [N]


def fael_mixing(beta=0.5, distance: str = "layers") -> MixingRule:
    """FAEL's aggregation weights as a stateful ``MixingRule``.

    Reads the deltas and, when present, the clients' FPHL masks (``outputs.extra``);
    with plain FedAvg clients (no extra) the distances are the full updates'.
    Only the cohort's active rows (participants holding data) are written."""
    H.check(HPARAMS, beta=beta)
    _check_distance(distance)

    def init(num_clients):
        return FAELState(jnp.zeros((num_clients,), jnp.float32),
                         jnp.zeros((num_clients,), jnp.float32),
                         jnp.zeros((num_clients,), bool))

    def update(state: FAELState, outputs, ctx):
        active = active_clients(outputs, ctx.client_mask)
        masks = outputs.extra if _has_masks(outputs.extra) else None
        dist = masked_distances(outputs.delta, masks, distance)
        ids = ctx.client_ids
        initial = 1.0 / ids.shape[0]  # 1 / K, the cohort size (the code's online_num)
        p, momentum, weight = fael_weights(state.momentum[ids], state.weight[ids],
                                           state.seen[ids], dist, active, beta, initial)
        n = state.seen.shape[0]
        write = jnp.where(active, ids, n)  # out of range: dropped
        return p, FAELState(state.momentum.at[write].set(momentum, mode="drop"),
                            state.weight.at[write].set(weight, mode="drop"),
                            state.seen.at[write].set(True, mode="drop"))

    return MixingRule(init, update)


# ------------------------------------------------------------------- aggregation


def masked_mean(deltas, masks, weights):
    """d_j = sum_k p_k m_kj Delta_kj / sum_k p_k m_kj (0 where no weighted client kept
    parameter j); ``masks`` None is the plain weighted mean."""
    weights = jnp.asarray(weights, jnp.float32)
    if masks is None:
        return weighted_sum(deltas, weights)

    def leaf(d, m):
        w = weights.astype(d.dtype)
        num = jnp.tensordot(w, jnp.where(m, d, 0.0), axes=1)
        den = jnp.tensordot(w, m.astype(d.dtype), axes=1)
        return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)

    return jax.tree.map(leaf, deltas, masks)


def masked_mean_aggregator() -> Aggregator:
    """FedHEAL's per-parameter aggregation over the kept coordinates (``masked_mean``)
    with the mixing weights p; without masks in ``outputs.extra``, the weighted mean.
    ``info["kept"]`` [K] is the fraction of parameters each client kept."""

    def direction(outputs, weights, ctx):
        del ctx
        if not _has_masks(outputs.extra):
            return weighted_sum(outputs.delta, weights), {}
        masks = outputs.extra
        leaves = jax.tree.leaves(masks)
        k = leaves[0].shape[0]
        kept = sum(jnp.sum(m.reshape(k, -1), axis=1, dtype=jnp.float32) for m in leaves)
        size = sum(m[0].size for m in leaves)
        return masked_mean(outputs.delta, masks, weights), {"kept": kept / size}

    # a mean per coordinate over the clients whose masks (extra) keep it
    return stateless(direction, reads=("delta", "extra"))


def _check_distance(distance: str) -> None:
    if distance not in DISTANCES:
        raise H.FieldError("distance", f"must be one of {DISTANCES}, got {distance!r}")


def fedheal(model, *, tau: float = 0.5, beta: float = 0.5, fphl: bool = True,
            distance: str = "layers", server_lr: Rate = 1.0,
            training: ClientTraining = ClientTraining(),
            client_table: str = "dense") -> FederatedAlgorithm:
    """FedHEAL = FedAvg local training + FPHL masks + FAEL weights (module docstring).

    Parameters
    ----------
    tau : float in [0, 1]
        Consistency threshold of FPHL (may be traced; not differentiable).
    beta : float in [0, 1]
        FAEL momentum rate (may be traced).
    fphl : bool
        False: FAEL only (no masks, no client rows), the paper's ablation.
    distance : {"layers", "global"}
        D_k as a sum of per-tensor norms (the code) or one norm.
    server_lr : Rate
        eta_g of theta - eta_g d (the code: 1).
    training : ClientTraining
        The clients' local training.
    client_table : "dense", "lazy" or "lazy:CAPACITY"
        Storage of the sign histories.
    """
    H.check(HPARAMS, tau=tau, beta=beta)
    if not callable(server_lr):
        HPARAMS["server_lr"].check("server_lr", server_lr)
    _check_distance(distance)
    if not isinstance(fphl, bool):
        raise H.FieldError("fphl", f"must be true or false, got {fphl!r}")
    client = local_training(model, training, finish=fphl_finish(tau) if fphl else None)
    return compose(client, mixing=fael_mixing(beta, distance),
                   aggregator=masked_mean_aggregator(), server_optimizer=optax.sgd(server_lr),
                   client_state_init=sign_history_init if fphl else None,
                   client_table=client_table)


register("fedheal", fedheal, HPARAMS, family="fair", server_rate="server_lr", size_prior=None)
