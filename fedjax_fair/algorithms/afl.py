"""AFL — Mohri, Sivek, Suresh, "Agnostic Federated Learning", ICML 2019,
arXiv:1902.00146 (the AAggFF thesis's AFL baseline, Hahn, UNIST 2024, appendix §8.1,
eq. 3.15).

AFL solves the minimax problem over the mixture weights of all N clients,

    min_theta max_{lambda in Delta_{N-1}} sum_i lambda_i F_i(theta),

by simultaneous gradient steps: descent on theta with the lambda-weighted loss,
projected ascent on lambda. The gradient of the objective in lambda is the loss
vector, so one round is

    lambda <- Proj_Delta(lambda + gamma_lambda F),          lambda^(0) = 1 / N,
    p_k = lambda_{i_k} / sum_{j in S} lambda_{i_j},         (renormalised on the cohort)
    theta^{t+1} = theta^t - sum_k p_k Delta_k,

with F_i = F_i(theta^t) the server model's loss on client i's training rows,
measured before local training (``ClientOutput.loss_before``), and Proj_Delta the
Euclidean projection onto the simplex (``fedjax_fair.simplex.project_simplex``).
lambda is updated first and the new lambda weights this round's deltas (the
thesis's order: the losses are observed before the model step).

Partial participation. The thesis runs AFL with full participation only (every
client every round), where the above is exact. With a cohort S of m < N clients
only their losses are seen, and ``ascent`` picks the lambda step:

* ``ascent="unbiased"`` (default): the inverse-propensity estimate of the loss
  vector, g_i = (N / m) F_i for i in S and 0 otherwise (unbiased under uniform
  sampling, as in DRFA, Deng, Kamani, Mahdavi, NeurIPS 2020), and the projection of
  the whole lambda: lambda <- Proj_Delta(lambda + gamma_lambda g). This is what the
  AFL paper's analysis assumes: Mohri et al.'s stochastic algorithm takes unbiased
  stochastic gradients of the minimax objective (the lambda-gradient of one domain
  drawn uniformly is its loss times the number of domains) and projects the whole
  lambda onto Lambda (a subset of the simplex); their convergence bound rests on
  that unbiasedness (and a bounded variance).
* ``ascent="sampled"``: the AAggFF authors' AFL baseline (``src/server/aflserver.py``
  of their repository): only the sampled coordinates move,
  lambda_S <- Proj_Delta(lambda_S + gamma_lambda F_S) (the sub-vector projected onto
  the unit simplex of |S| coordinates), lambda_i unchanged for i not in S, no N / m
  scale. The step is biased, and lambda leaves the simplex of all N clients (the
  cohort's coordinates sum to 1, the others keep their mass); the cohort's weights
  are lambda_S, which already sums to 1.

Both are the same step with m = N (full participation). Masked cohort rows change
nothing and count out of m (they are not in S); an empty participating client
(n_i = 0) counts in m (is in S) with loss 0. Rounds whose cohort is entirely
masked leave lambda unchanged. A cohort names each client at most once (the
samplers draw without replacement).

Symbols -> arguments: gamma_lambda = ``lambda_lr`` (grid {0.01, 0.1, 1}; the
reference scripts select 0.01); lambda = the mixing state ``AFLState.lambdas`` [N];
the partial-participation step = ``ascent`` (``ASCENTS``).
The model step is FedAvg's local training plus the server optimizer.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from fedjax_fair import hparams as H
from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.algorithms.families.training import Transform
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.core.mixing import MixingRule, active_clients, normalize
from fedjax_fair.solvers.simplex import project_simplex, project_simplex_masked
from fedjax_fair.algorithms.registry import register

HPARAMS = {"lambda_lr": H.NONNEGATIVE}

ASCENTS = ("unbiased", "sampled")
"""The choices of ``ascent``: the (N / m)-scaled step of the whole lambda (the AFL
paper's unbiased stochastic gradient), or the AAggFF authors' code's projection of
the sampled coordinates alone."""


def _check_ascent(ascent):
    if ascent not in ASCENTS:
        raise H.FieldError("ascent", f"must be one of {ASCENTS}, got {ascent!r}")


class AFLState(NamedTuple):
    lambdas: jax.Array  # float32 [N]: on the simplex ("sampled": the cohort's sum to 1)


def afl_ascent(lambdas, losses, client_ids, client_mask, lambda_lr, ascent="unbiased"):
    """``ascent="unbiased"``: lambda <- Proj_Delta(lambda + gamma (N / m) F_S) with F_S
    scattered at the ids; ``ascent="sampled"``: lambda_S <- Proj_Delta(lambda_S +
    gamma F_S), the other coordinates kept (module docstring).

    Parameters
    ----------
    lambdas : float array [N]
        The current mixture over all clients.
    losses : float array [K]
        F_{i_k}(theta^t) of the cohort.
    client_ids : int array [K]
    client_mask : bool array [K]
        Rows of the cohort that took part (m = their count).
    lambda_lr : float or traced scalar
        gamma_lambda >= 0.
    ascent : "unbiased" or "sampled" (``ASCENTS``)
    """
    _check_ascent(ascent)
    lambdas = jnp.asarray(lambdas, jnp.float32)
    num_clients = lambdas.shape[0]
    client_mask = jnp.asarray(client_mask, bool)
    m = jnp.sum(client_mask)
    if ascent == "sampled":
        observed = jnp.where(client_mask, jnp.asarray(losses, jnp.float32), 0.0)
        rows = lambdas[jnp.where(client_mask, client_ids, 0)]
        moved = project_simplex_masked(rows + lambda_lr * observed, client_mask)
        ids = jnp.where(client_mask, client_ids, num_clients)  # out of range: dropped
        new = lambdas.at[ids].set(moved.astype(lambdas.dtype), mode="drop")
        return jnp.where(m > 0, new, lambdas)
    scale = num_clients / jnp.maximum(m, 1).astype(jnp.float32)
    ids = jnp.where(client_mask, client_ids, num_clients)  # out of range: dropped
    observed = jnp.where(client_mask, jnp.asarray(losses, jnp.float32), 0.0)
    grad = jnp.zeros_like(lambdas).at[ids].add(scale * observed, mode="drop")
    new = project_simplex(lambdas + lambda_lr * grad)
    return jnp.where(m > 0, new, lambdas)


def afl_mixing(lambda_lr=0.01, *, ascent: str = "unbiased") -> MixingRule:
    """AFL's projected-gradient-ascent mixture over all N clients as a ``MixingRule``
    (state ``AFLState``; the weights are lambda at the cohort, renormalised);
    ``ascent`` the partial-participation step (module docstring)."""
    H.check(HPARAMS, lambda_lr=lambda_lr)
    _check_ascent(ascent)

    def init(num_clients):
        return AFLState(jnp.full((num_clients,), 1.0 / num_clients, jnp.float32))

    def update(state, outputs, ctx):
        client_ids, client_mask = ctx.client_ids, ctx.client_mask
        active = active_clients(outputs, client_mask)
        # An empty client's loss is 0 by definition (it still counts in m).
        losses = jnp.where(active, outputs.loss_before, 0.0)
        lambdas = afl_ascent(state.lambdas, losses, client_ids, client_mask, lambda_lr,
                             ascent)
        weights = normalize(lambdas[client_ids], active)
        return weights, AFLState(lambdas)

    return MixingRule(init, update)


def afl(model, *, lambda_lr: float = 0.01, ascent: str = "unbiased",
        training: ClientTraining = ClientTraining(),
        server_optimizer: Optional[Transform] = None) -> FederatedAlgorithm:
    """FedAvg local training with AFL's minimax client weights. Meant for full
    participation (the ``full`` sampler); in partial rounds ``ascent="unbiased"``
    moves lambda by the (N / m)-scaled losses (the AFL paper's analysis),
    ``ascent="sampled"`` projects the sampled coordinates alone (the AAggFF authors'
    code)."""
    return fedavg(model, mixing=afl_mixing(lambda_lr, ascent=ascent), training=training,
                  server_optimizer=server_optimizer)


register("afl", afl, HPARAMS, family="fair", size_prior=None,
         search_space={"lambda_lr": (0.01, 0.1, 1.0)},
         search_source="Hahn's PhD thesis (UNIST 2024; AAggFF, arXiv:2405.20821), its fair baselines' grid: gamma_lambda in {0.01, 0.1, 1}")
