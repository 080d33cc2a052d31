"""FedNew — Elgabli, Ben Issaid, Bedi, Rajawat, Bennis, Aggarwal, "FedNew: A
Communication-Efficient and Privacy-Preserving Newton-Type Method for Federated
Learning", ICML 2022 (arXiv:2206.08829), Algorithm 1; a second-order baseline of
DQN-Fed (Mohajer Hamidi, Ye, TMLR, OpenReview KbteA50cni).

The Newton direction y* = (mean_k H_k)^{-1} mean_k g_k solves the consensus problem
min sum_k (1/2 y_k^T H_k y_k - g_k^T y_k) s.t. y_k = y. FedNew runs ONE pass of ADMM
on it per round, warm-started from the previous round's y and duals, and steps along
the result. Client k keeps its dual lambda_k across rounds (lambda_k = 0 and y = 0 at
the start); in round t, at theta^t, every participant computes g_k and H_k and

    y_k = (H_k + (alpha + rho) I)^{-1} (g_k - lambda_k + rho y^{t-1}),      (client)
    y^t = mean_k y_k,                                                     (server)
    lambda_k <- lambda_k + rho (y_k - y^t),                               (client)
    theta^{t+1} = theta^t - eta y^t.                                      (server)

Only y_k leaves a client (neither g_k nor H_k). The paper's step is eta = 1 and alpha
is a damping of the local Hessians (the authors' code adds (alpha + lambda_reg) I to
each H_k); the paper's "theta <- theta - alpha y" step is ``server_lr`` here.

Pieces: lambda_k is the client-table row, y the aggregator's state, broadcast with
theta^t. The client returns y_k as its ``delta`` (its proposed model is
theta^t - y_k) and writes lambda_k + rho y_k into its row; once the server has y^t,
the round subtracts rho y^t from the participants' rows (a second write of the
cohort's rows after the server step: the dual update needs y^t, which no client has
during the round).

Deviations (documented):

* **Diagonal Hessians.** H_k is the diagonal of ∇²f_k(theta^t): exact (small models)
  or Hutchinson's estimate E[z * Hz] with Rademacher z via Hessian-vector products
  (``fedjax_fair.algorithms.families.second_order``; ``curvature``, ``num_probes``, ``curvature_rows``); the
  inverse is then per coordinate. Negative entries (networks; Hutchinson noise) are
  floored at 0 before the damping, so H_k + (alpha + rho) I stays positive. H_k is
  recomputed every round (the authors' "H_k" variant; their fixed and periodic
  Hessians are not implemented).
* **Partial participation** (the paper has every client in every round): only the
  cohort's clients with data compute y_k and update lambda_k; y^t is the mean over
  them, and absent clients keep lambda_k. The cohort's dual changes sum to 0, so
  sum_k lambda_k stays 0 as in the paper, and theta* stays a fixed point under any
  cohort (y_k = 0 when lambda_k = g_k(theta*) and y = 0). If no participant holds
  data, y and theta do not move.
* **Gradient.** ``mode="grad_at_global"`` is the paper's exact local gradient;
  ``mode="pseudo_grad"`` (default, as DQN-Fed, whose comparison shares E, B and eta_l)
  uses the local-SGD pseudo-gradient (theta^t - theta_k^E) / (eta_l tau_k); the
  curvature is always at theta^t.

Symbols -> arguments: rho = ``rho``, alpha = ``alpha``, eta = ``server_lr`` (a number
or a schedule), eta_l, B, E = ``training.lr``, ``training.batch_size``,
``training.num_epochs`` (``ClientTraining``; pseudo-gradient mode only). All clients
count equally (f = mean_k f_k).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from fedjax_fair import hparams as H
from fedjax_fair.core.aggregators import UPDATE, Aggregator, plain_combine
from fedjax_fair.core.algorithm import FederatedAlgorithm, compose, derive
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.algorithms.families.training import Rate
from fedjax_fair.algorithms.fednl import reporting
from fedjax_fair.algorithms.families.second_order import client_derivatives
from fedjax_fair.core.mixing import uniform
from fedjax_fair.core.types import ClientOutput
from fedjax_fair.algorithms.registry import register

HPARAMS = {"server_lr": H.POSITIVE, "rho": H.POSITIVE, "alpha": H.NONNEGATIVE,
           "num_probes": H.COUNT, "curvature_rows": H.Range(1, None, integer=True, nullable=True)}


class FedNewState(NamedTuple):
    y: object  # y^{t-1}, parameter-shaped; broadcast with theta^t


def fednew_client(derive, *, rho, alpha):
    """FedNew's ClientUpdate: delta = y_k; the row becomes lambda_k + rho y_k (the
    round then subtracts rho y^t, ``fednew``), unchanged for a client without data."""

    def client_update(broadcast, dual, data, local_steps, key):
        d = derive(broadcast, data, local_steps, key)
        y = jax.tree.map(
            lambda g, lam, yy, h: (g - lam + rho * yy) / (jnp.maximum(h, 0.0) + alpha + rho),
            d.grad, dual, broadcast.extra, d.diag)
        has_data = data.num_examples > 0
        pending = jax.tree.map(lambda lam, yk: jnp.where(has_data, lam + rho * yk, lam),
                               dual, y)
        output = ClientOutput(delta=y, loss_before=d.loss, num_examples=data.num_examples,
                              num_steps=d.num_steps, train_loss=d.train_loss)
        return output, pending

    return client_update


def fednew_aggregator() -> Aggregator:
    """y^t = mean of the reporting clients' y_k (their deltas); direction = y^t. Keeps
    y^{t-1} when no participant holds data (direction 0)."""

    def init(params, num_clients):
        del num_clients
        return FedNewState(jax.tree.map(jnp.zeros_like, params))

    def aggregate(state, outputs, weights, ctx, combine=plain_combine):
        del weights
        c = reporting(outputs, ctx)
        total = jnp.sum(c)
        mean = combine(UPDATE, outputs.delta, c / jnp.maximum(total, 1.0))
        y = jax.tree.map(lambda new, old: jnp.where(total > 0, new, old), mean, state.y)
        direction = jax.tree.map(lambda v: jnp.where(total > 0, v, 0.0), mean)
        return direction, FedNewState(y), {}

    return Aggregator(init, aggregate, combines=(UPDATE,))


def with_dual_update(algorithm: FederatedAlgorithm, rho) -> FederatedAlgorithm:
    """``algorithm`` whose rounds finish lambda_k <- (lambda_k + rho y_k) - rho y^t
    on the cohort's rows (clients with data, unmasked); kept under scenarios."""
    return derive(algorithm, lambda alg: _dual_update(alg, rho))


def _dual_update(algorithm: FederatedAlgorithm, rho) -> FederatedAlgorithm:
    table = algorithm.client_table

    def apply(state, cohort, key, execution="auto"):
        new_state, metrics = algorithm.apply(state, cohort, key, execution)
        ids = cohort.client_ids
        rows = table.gather(new_state.client_states, ids)
        y = new_state.aggregator_state.y
        rows = jax.tree.map(lambda r, yy: r - rho * yy[None], rows, y)
        write = cohort.client_mask & (cohort.data.num_examples > 0)
        tables = table.scatter(new_state.client_states, ids, rows, write, state.round)
        return new_state._replace(client_states=tables), metrics

    return algorithm._replace(apply=apply)


def fednew(model, *, server_lr: Rate = 1.0, rho: float = 1.0, alpha: float = 1.0,
           curvature: str = "auto", num_probes: int = 1,
           curvature_rows: Optional[int] = None, mode: str = "pseudo_grad",
           training: ClientTraining = ClientTraining(),
           client_table: str = "dense") -> FederatedAlgorithm:
    """FedNew with diagonal Hessians (module doc). ``client_table``: "dense", "lazy"
    or "lazy:CAPACITY" storage of the clients' duals lambda_k. ``training``
    (``ClientTraining``; its optimizer a ``rate -> transformation``) shapes the local
    steps of ``mode="pseudo_grad"``."""
    training.check()
    if not callable(server_lr):
        HPARAMS["server_lr"].check("server_lr", server_lr)
    H.check(HPARAMS, rho=rho, alpha=alpha, num_probes=num_probes,
            curvature_rows=curvature_rows)
    derivatives = client_derivatives(model, curvature=curvature, num_probes=num_probes,
                                curvature_rows=curvature_rows, mode=mode, training=training)
    algorithm = compose(fednew_client(derivatives, rho=rho, alpha=alpha), mixing=uniform(),
                        aggregator=fednew_aggregator(), server_optimizer=optax.sgd(server_lr),
                        client_state_init=lambda params: jax.tree.map(jnp.zeros_like, params),
                        client_table=client_table,
                        broadcast=lambda state: state.aggregator_state.y)
    return with_dual_update(algorithm, rho)


register("fednew", fednew, HPARAMS, family="second_order", server_rate="server_lr", size_prior=None)
