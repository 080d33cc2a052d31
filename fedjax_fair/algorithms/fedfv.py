"""FedFV — Wang, Fan, Qi, Wen, Wang, Yu, "Federated Learning with Fair Averaging",
IJCAI 2021 (arXiv:2104.14937), Algorithm 1 (with its MitigateInternalConflict and
MitigateExternalConflict steps).

Client k of the round's cohort S_t (m clients) sends its update g_k = theta^t - theta_k
and its training loss l_k = F_k(theta^t) (``ClientOutput.loss_before``). The server
keeps GH, every client's latest update and the round it was sent in, and

1. internal conflicts: sorts the cohort by loss, ascending, into the projecting order
   PO_t; keeps the ceil(alpha m) clients with the largest losses as they are; every
   other client k starts from g_k^PC = g_k and, for each g_j of PO_t in that order
   (j != k), projects onto the normal plane of the ORIGINAL g_j when they conflict:

       if g_k^PC . g_j < 0:   g_k^PC <- g_k^PC - (g_k^PC . g_j / ||g_j||^2) g_j;

   the clients with larger losses come last, so their directions are the ones the
   projected gradients end up not conflicting with. Then g^t = (1 / m) sum_k g_k^PC.
2. external conflicts (if t >= tau): for the rounds t - i, i = tau, ..., 1 (oldest
   first), g_con = the sum of the GH updates sent in round t - i (clients whose latest
   update is from that round, so none of this round's cohort) that conflict with
   g^t; if g^t . g_con < 0, g^t <- g^t - (g^t . g_con / ||g_con||^2) g_con.
3. rescales g^t to the norm of the plain average, ||(1 / m) sum_k g_k||, and steps
   theta^{t+1} = theta^t - g^t.

Symbols -> arguments: alpha = ``alpha`` (the fraction of the cohort with the largest
losses kept unprojected; 0 projects everyone; a static fraction: it picks a count,
ceil(alpha m) computed exactly from the decimal given, and so is not differentiable);
tau = ``tau`` (rounds of history; 0 switches step 2 off and stores nothing);
1 / m = the mixing weights p_k (``mixing``; default uniform over the participants that
hold data, or p_k ∝ n_k with ``weight_by_size``): g^t = sum_k p_k g_k^PC and the
target norm ||sum_k p_k g_k||; the step 3 = the server optimizer's sgd(1.0)
(``server_optimizer`` replaces it). The authors' defaults are alpha = 0.1, tau = 1.

Implementation. Every projection subtracts a multiple of an original g_j, so
g_k^PC = sum_j A_kj g_j and the internal step runs on coefficients: with the Gram
matrix G_ij = g_i . g_j (one K x K product over the leaves), g_k^PC . g_j =
(A G)_kj, and the K x K coefficient matrix A is updated by a ``lax.fori_loop`` over
the positions of PO_t (all clients at once: O(K^2 d) for G, O(K^3) for the loop),
never copying the K updates. g^t = sum_j (A^T p)_j g_j is then one weighted sum.
GH is a dense table of every client's latest update (``client_states.dense``, N x d;
the paper's GH) with the round it was written; the external step reads its rows of
rounds t - tau .. t - 1. Cohort rows with weight 0 (masked or without data) take no
part: they neither project nor are projected onto, and a masked row is not written
to GH.

Where the authors' code (github.com/WwZzz/easyFL, ``algorithm/fedfv.py`` at commit 0f1f8b5;
the same in its FLGo version) differs, the paper is followed:

* its external step reads the GH rounds t - tau + 1 .. t, i.e. with tau = 1 the
  current cohort's own (unprojected) updates; here rounds t - tau .. t - 1: the
  clients outside this round, the conflicts the paper calls external;
* it keeps m - ceil((m - 1)(1 - alpha)) clients unprojected, which equals
  ceil(alpha m) except when alpha m has a fractional part below alpha (e.g. 2 vs 3
  at alpha = 0.7, m = 3); here ceil(alpha m), the paper's "alpha m clients";
* both average with 1 / m (the default mixing rule here).

The aggregator logs ``server/projections`` (per client, the internal projections
applied to its update [K]) and ``server/external_projections`` (how many of the tau
external projections applied).
"""
from __future__ import annotations

from fractions import Fraction
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fedjax_fair import hparams as H
from fedjax_fair.algorithms.families.training import Transform
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.core import client_states
from fedjax_fair.core.aggregators import Aggregator, weighted_sum
from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.core.mixing import MixingRule, exponentiated
from fedjax_fair.algorithms.registry import register

HPARAMS = {"alpha": H.Range(0.0, 1.0, static=True), "tau": H.Range(0, None, integer=True)}


class FedFVState(NamedTuple):
    """GH: every client's latest update and its round (a ``client_states.DenseTable``);
    () when tau = 0."""

    history: Any


def _float_type(tree):
    """The computation's float type: at least float32 (float64 under x64 stays)."""
    dtype = jnp.result_type(*jax.tree.leaves(tree))
    return jnp.promote_types(dtype, jnp.float32)


def gram_matrix(deltas, active):
    """G_ij = g_i . g_j [K, K] over every leaf (HIGHEST precision: TF32 would damage
    the conflict tests), 0 on rows and columns that are not ``active``."""
    leaves = jax.tree.leaves(deltas)
    k = leaves[0].shape[0]
    dtype = _float_type(deltas)
    gram = jnp.zeros((k, k), dtype)
    for leaf in leaves:
        flat = leaf.reshape(k, -1).astype(dtype)
        gram = gram + jnp.matmul(flat, flat.T, precision=lax.Precision.HIGHEST)
    pair = active[:, None] & active[None, :]
    return jnp.where(pair, gram, 0.0)


def keep_counts(alpha, cohort_size: int) -> np.ndarray:
    """ceil(alpha m) for m = 0..K (int32 [K + 1]), exact for the decimal alpha is
    written as (0.3 * 10 is 3, not 3.0000000000000004 -> 4)."""
    if isinstance(alpha, jax.Array):
        raise H.FieldTypeError("alpha", "is a static fraction (it picks a count of clients): "
                                        "give a Python number, not a JAX array")
    try:  # str: the decimal as written (also for NumPy scalars: str(float32(0.1)) = "0.1")
        fraction = Fraction(str(alpha))
    except ValueError:
        fraction = Fraction(float(alpha))
    num, den = fraction.as_integer_ratio()
    return np.asarray([-(-num * m // den) for m in range(cohort_size + 1)], np.int32)


def internal_coefficients(gram, losses, weights, alpha):
    """MitigateInternalConflict on coefficients.

    Parameters
    ----------
    gram : float [K, K]
        G_ij = g_i . g_j (``gram_matrix``; 0 off the active rows).
    losses : float [K]
        l_k = F_k(theta^t), the projecting order (ascending).
    weights : float [K]
        p_k; the active clients are those with p_k > 0.
    alpha : float
        The fraction of active clients with the largest losses kept unprojected.

    Returns
    -------
    coefficients : float [K, K]
        A with g_k^PC = sum_j A_kj g_j (the identity row for kept and inactive k).
    projections : int32 [K]
        How many projections each client's update went through.
    """
    k = gram.shape[0]
    active = weights > 0
    m = jnp.sum(active, dtype=jnp.int32)
    n_keep = jnp.asarray(keep_counts(alpha, k))[m]
    order = jnp.argsort(jnp.where(active, losses, jnp.inf), stable=True)  # inactive last
    rank = jnp.zeros((k,), jnp.int32).at[order].set(jnp.arange(k, dtype=jnp.int32))
    movable = active & (rank < m - n_keep)  # the m - ceil(alpha m) smallest losses
    sq_norm = jnp.diagonal(gram)
    rows = jnp.arange(k)

    def project_onto(s, carry):
        coef, count = carry
        j = order[s]
        dots = coef @ gram[:, j]  # g_k^PC . g_j for every k
        norm_j = sq_norm[j]
        hit = movable & active[j] & (rows != j) & (dots < 0) & (norm_j > 0)
        step = jnp.where(hit, dots / jnp.where(norm_j > 0, norm_j, 1.0), 0.0)
        return coef.at[:, j].add(-step), count + hit.astype(jnp.int32)

    start = (jnp.eye(k, dtype=gram.dtype), jnp.zeros((k,), jnp.int32))
    return lax.fori_loop(0, k, project_onto, start)


def _dots(rows, vector):
    """rows_r . vector for every row r [R] (rows: leaves [R, ...], vector: one row)."""
    total = 0.0
    for r, v in zip(jax.tree.leaves(rows), jax.tree.leaves(vector)):
        total = total + jnp.matmul(r.reshape(r.shape[0], -1), v.reshape(-1).astype(r.dtype),
                                   precision=lax.Precision.HIGHEST)
    return total


def _sq_norm(tree):
    return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree))


def external_projection(g, history: client_states.DenseTable, round_, tau: int):
    """MitigateExternalConflict: for i = tau, ..., 1, project g off the sum of the GH
    rows written in round t - i that conflict with it (nothing before round tau).

    Returns (g, the number of projections applied)."""
    rows, last = history.rows, history.last_round
    on = round_ >= tau

    def round_back(s, carry):
        g, count = carry
        sent = on & (last == round_ - (tau - s))
        dots = _dots(rows, g)
        conflict = sent & (dots < 0)
        g_con = weighted_sum(rows, conflict.astype(dots.dtype))
        dot = jnp.sum(jnp.where(conflict, dots, 0.0))  # g . g_con
        norm = _sq_norm(g_con)
        hit = (dot < 0) & (norm > 0)
        step = jnp.where(hit, dot / jnp.where(hit, norm, 1.0), 0.0)
        g = jax.tree.map(lambda x, c: x - step.astype(x.dtype) * c.astype(x.dtype), g, g_con)
        return g, count + hit.astype(jnp.int32)

    return lax.fori_loop(0, tau, round_back, (g, jnp.zeros((), jnp.int32)))


def _safe_sqrt(x):
    positive = x > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, x, 1.0)), 0.0)


def fedfv_aggregator(alpha: float = 0.1, tau: int = 1) -> Aggregator:
    """FedFV's server step (module docstring) as an ``Aggregator``; the incoming
    mixing weights are the averaging weights p_k (1 / m in the paper)."""
    H.check(HPARAMS, alpha=alpha, tau=tau)
    keep_counts(alpha, 0)  # refuses a traced alpha here, not at the first round
    tau = int(tau)
    table = client_states.dense()

    def init(params, num_clients: int) -> FedFVState:
        if tau == 0:
            return FedFVState(())
        return FedFVState(table.init(jax.tree.map(jnp.zeros_like, params), num_clients))

    def aggregate(state: FedFVState, outputs, weights, ctx):
        deltas = outputs.delta
        dtype = _float_type(deltas)
        weights = weights.astype(dtype)
        active = weights > 0
        gram = gram_matrix(deltas, active)
        losses = jnp.asarray(outputs.loss_before).astype(dtype)
        coef, projections = internal_coefficients(gram, losses, weights, alpha)
        g = weighted_sum(deltas, coef.T @ weights)
        history, external = state.history, jnp.zeros((), jnp.int32)
        if tau > 0:
            history = table.scatter(history, ctx.client_ids, deltas, ctx.client_mask, ctx.round)
            g, external = external_projection(g, history, ctx.round, tau)
        target = _safe_sqrt(weights @ gram @ weights)  # ||sum_k p_k g_k||
        norm = _safe_sqrt(_sq_norm(g))
        scale = jnp.where(norm > 0, target / jnp.where(norm > 0, norm, 1.0), 0.0)
        direction = jax.tree.map(lambda x: scale.astype(x.dtype) * x, g)
        info = {"projections": projections, "external_projections": external}
        return direction, FedFVState(history), info

    return Aggregator(init, aggregate, reads=("delta", "loss_before"))


def fedfv(model, *, alpha: float = 0.1, tau: int = 1, weight_by_size: bool = False,
          training: ClientTraining = ClientTraining(),
          server_optimizer: Optional[Transform] = None,
          mixing: Optional[MixingRule] = None) -> FederatedAlgorithm:
    """FedFV: FedAvg's local SGD, the server's conflict-mitigating average (module
    docstring). ``mixing`` replaces the averaging weights (default uniform over the
    participants holding data; p_k ∝ n_k with ``weight_by_size``)."""
    H.check(HPARAMS, alpha=alpha, tau=tau)
    if not isinstance(weight_by_size, bool):
        raise H.FieldError("weight_by_size", f"must be true or false, got {weight_by_size!r}")
    return fedavg(model, training=training, server_optimizer=server_optimizer,
                  mixing=mixing or exponentiated(lambda out: 0.0, weight_by_size),
                  aggregator=fedfv_aggregator(alpha, tau))


register("fedfv", fedfv, HPARAMS, family="fair")
