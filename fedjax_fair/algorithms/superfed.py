"""SuPerFed — Hahn, Jeong, Lee, "Connecting Low-Loss Subspace for Personalized
Federated Learning", KDD 2022 (arXiv:2109.07628); S.-J. Hahn, PhD thesis "Algorithms for Collaborative Machine Learning under
Statistical Heterogeneity", UNIST 2024, Chapter II.

Every client i keeps two models of one architecture: the federated model theta_f
(reset to the broadcast theta_g at every participation, the only one uploaded) and a
local model theta_l (never leaves the client, persists across rounds, its own random
initialisation). Each local step draws lambda ~ U(0, 1) and trains the mixture

    theta(lambda) = (1 - lambda) theta_f + lambda theta_l,
    F_i = E_lambda[ loss(theta(lambda)) ] + (mu / 2) ||theta_f - theta_g||^2
          + nu cos^2(theta_f, theta_l),

with one backward pass through the mixture (grad theta_f = (1 - lambda) g, grad
theta_l = lambda g, eq. 2.3). SuPerFed-MM draws one lambda per step for every layer,
SuPerFed-LM one per layer (leaves sharing a parent module share it). Before round L
(``start_round``) lambda = 0, the orthogonality term is off and theta_l is frozen
exactly (no update, no weight decay, no momentum), so the round is FedProx's (FedAvg's
with mu = 0). The server averages the uploaded theta_f by n_i (FedAvg).

A client is evaluated on theta(lambda) with one lambda for every layer
(``eval_lambda`` for the runner's per-round evaluation; ``lambda_grid_metrics``
sweeps lambda in {0, 0.1, ..., 1} for the thesis's best-average-lambda and per-client
oracle accuracies).

Pieces: the client update trains the pair (theta_f, theta_l) with
``client.local_sgd`` on the mixture's loss; theta_l is the client's row in a dense or
lazy table whose never-written rows are drawn per client
(``compose(client_state_fresh=...)``: ``model.init(fold_in(key(local_init_seed),
client_id))``, as the reference code seeds each local model with its client index),
so clients never sampled cost nothing in the lazy table; only theta_f is aggregated
(``by_num_examples``).

Symbols -> arguments: mu = ``mu``, nu = ``nu``, L = ``start_round`` (the thesis's
l_frac x T), eta = ``training.lr`` (a schedule of the round for the 1%/round decay, e.g.
``lambda t: 0.01 * 0.99 ** t``), momentum 0.9 and coupled weight decay 1e-4 over the
pair (``momentum``, ``training.weight_decay``; a ``training.optimizer``, if given,
replaces that SGD), E = ``training.num_epochs``, B = ``training.batch_size`` (defaults
``TRAINING``); ``training.clip_norm`` clips the pair's joint gradient (one global norm
over theta_f and theta_l; ``clip_mode="loss"``: the mixture loss's alone, without the
proximal and orthogonality terms; weight decay after);
``mode`` "mm" or "lm"; ``prox_form`` "squared" (the thesis) or "ref_sum_of_norms"
(the reference code's mu sum_leaves ||theta_f - theta_g||).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_fair import hparams as H
from fedjax_fair.core.algorithm import FederatedAlgorithm, compose
from fedjax_fair.core.client import (ClientTraining, data_loss, data_metrics, describe_object,
                                     local_sgd, make_optimizer, round_value, sq_distance)
from fedjax_fair.core.execution import local_step_unroll
from fedjax_fair.core.evaluation import per_client
from fedjax_fair.metrics import worst_k
from fedjax_fair.core.mixing import by_num_examples
from fedjax_fair.models.base import Model
from fedjax_fair.core.types import Broadcast, ClientData, ClientOutput
from fedjax_fair.algorithms.registry import register

MODES = ("mm", "lm")
PROX_FORMS = ("squared", "ref_sum_of_norms")
LAMBDA_GRID = tuple(i / 10 for i in range(11))
HPARAMS = {"mu": H.NONNEGATIVE, "nu": H.NONNEGATIVE,
           "start_round": H.Range(0, None, integer=True),
           "eval_lambda": H.Range(0.0, 1.0), "momentum": H.Range(0.0, 1.0, high_open=True),
           "local_init_seed": H.Range(0, None, integer=True)}
# SuPerFed's local training (Hahn's thesis, Ch. II; the module docstring): SGD at rate
# 0.01 with momentum 0.9 (``momentum``) and coupled weight decay 1e-4, batch 10.
TRAINING = ClientTraining(lr=0.01, batch_size=10, weight_decay=1e-4)


class LocalModel(NamedTuple):
    """A client's row: its local model theta_l."""

    local: object


def mix(federated, local, lam):
    """theta(lambda) = (1 - lambda) theta_f + lambda theta_l, leaf by leaf; ``lam`` a
    scalar or a pytree of scalars shaped like the parameters (one per leaf)."""
    same = jax.tree.structure(lam) == jax.tree.structure(federated)
    lams = lam if same else jax.tree.map(lambda _: lam, federated)
    return jax.tree.map(lambda f, l, a: (1 - a) * f + a * l, federated, local, lams)


def layer_groups(params) -> tuple[list, int]:
    """(group id of every leaf in ``jax.tree.leaves`` order, number of groups): leaves
    with the same parent path (one layer's kernel and bias, a norm's scale and shift)
    share a group."""
    paths = [path[:-1] for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    ids = {p: i for i, p in enumerate(dict.fromkeys(paths))}
    return [ids[p] for p in paths], len(ids)


def draw_lambdas(key, params, mode: str):
    """A pytree of mixing weights for one step: one U(0, 1) draw for every leaf (MM) or
    one per layer group (LM)."""
    leaves, treedef = jax.tree.flatten(params)
    if mode == "mm":
        lam = jax.random.uniform(key, ())
        return jax.tree.unflatten(treedef, [lam] * len(leaves))
    groups, count = layer_groups(params)
    draws = jax.random.uniform(key, (count,))
    return jax.tree.unflatten(treedef, [draws[g] for g in groups])


def cos_squared(a, b, eps: float = 1e-12):
    """cos^2 of the angle between two pytrees, each flattened into one vector."""
    dot = sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    na = sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(a))
    nb = sum(jnp.sum(jnp.square(y)) for y in jax.tree.leaves(b))
    return jnp.square(dot) / (na * nb + eps)


def mixture_model(model: Model, mode: str, personalize) -> Model:
    """``model`` over the pair (theta_f, theta_l): each loss evaluation draws lambda
    from its key (one per local step) and evaluates theta(lambda); lambda = 0 while
    ``personalize`` is False."""

    def loss(pair, batch, key=None):
        federated, local = pair
        lam_key, model_key = jax.random.split(key)
        lams = jax.tree.map(lambda a: jnp.where(personalize, a, 0.0),
                            draw_lambdas(lam_key, federated, mode))
        return model.per_example_loss(mix(federated, local, lams), batch, model_key)

    return model._replace(per_example_loss=loss, init=None)


def superfed(model, *, mu: float = 0.01, nu: float = 1.0, start_round: int = 0,
             mode: str = "mm", eval_lambda: float = 0.5, prox_form: str = "squared",
             momentum: float = 0.9, training: ClientTraining = TRAINING,
             client_table: str = "dense", local_init_seed: int = 0) -> FederatedAlgorithm:
    """SuPerFed (MM or LM): federated and local model trained through their random
    interpolation; evaluated personally at ``eval_lambda``.

    ``training``: the pair's local training (default ``TRAINING``, the thesis's).
    ``training.optimizer`` (None: SGD with ``momentum`` and coupled
    ``training.weight_decay``) replaces that optimizer of the pair, ``momentum`` and
    ``weight_decay`` then unused; ``clip_norm`` / ``clip_mode``: gradient clipping of
    every local step.

    ``client_table``: "dense", "lazy" or "lazy:CAPACITY" storage of the local models
    (never-sampled clients' models are drawn on demand, so the lazy table stores only
    the clients sampled)."""
    H.check(HPARAMS, mu=mu, nu=nu, start_round=start_round, eval_lambda=eval_lambda,
            momentum=momentum)
    if not isinstance(training, ClientTraining):
        raise H.FieldTypeError("training", f"must be a ClientTraining, got "
                                           f"{describe_object(training)}")
    training.check()
    if mode not in MODES:
        raise H.FieldError("mode", f"must be one of {MODES}, got {mode!r}")
    if prox_form not in PROX_FORMS:
        raise H.FieldError("prox_form", f"must be one of {PROX_FORMS}, got {prox_form!r}")
    unroll = local_step_unroll(model.uses_xla_conv)

    def prox(federated, global_params):
        if prox_form == "squared":
            return 0.5 * mu * sq_distance(federated, global_params)
        return mu * sum(jnp.sqrt(jnp.sum(jnp.square(f - g)) + 1e-24)
                        for f, g in zip(jax.tree.leaves(federated),
                                        jax.tree.leaves(global_params)))

    def regularizer(pair, broadcast: Broadcast, personalize):
        federated, local = pair
        orth = jnp.where(personalize, nu * cos_squared(federated, local), 0.0)
        return prox(federated, broadcast.params) + orth

    def optimizer(rate):
        return optax.chain(optax.add_decayed_weights(training.weight_decay),
                           optax.sgd(rate, momentum=momentum))

    def client_update(broadcast: Broadcast, row: LocalModel, data: ClientData, local_steps,
                      key):
        personalize = broadcast.round >= start_round
        train = local_sgd(mixture_model(model, mode, personalize),
                          batch_size=training.batch_size, num_epochs=training.num_epochs,
                          max_steps=training.max_steps, regularizer=regularizer,
                          unroll=unroll, clip_norm=training.clip_norm,
                          clip_mode=training.clip_mode)
        lr = round_value(training.lr, broadcast.round)
        (federated, local), num_steps, train_loss = train(
            (broadcast.params, row.local), make_optimizer(training.optimizer or optimizer, lr),
            data, local_steps, key, (broadcast, personalize))
        # Before L theta_l is frozen exactly: its (zero-gradient) momentum and weight
        # decay moves are discarded; lambda = 0 kept them out of theta_f's steps.
        local = jax.tree.map(lambda new, old: jnp.where(personalize, new, old), local,
                             row.local)
        output = ClientOutput(delta=jax.tree.map(jnp.subtract, broadcast.params, federated),
                              loss_before=data_loss(model, broadcast.params, data),
                              num_examples=data.num_examples, num_steps=num_steps,
                              train_loss=train_loss)
        return output, LocalModel(local)

    return compose(client_update, mixing=by_num_examples(),
                   client_state_init=lambda params: LocalModel(params),
                   client_state_fresh=lambda client_id: LocalModel(model.init(
                       jax.random.fold_in(jax.random.key(local_init_seed), client_id))),
                   client_table=client_table,
                   personal_params=lambda server_params, row: mix(server_params, row.local,
                                                                  eval_lambda))


def lambda_grid_metrics(model: Model, algorithm: FederatedAlgorithm, state, split: ClientData,
                        lambdas=LAMBDA_GRID) -> dict:
    """Every client's test metrics at every lambda of ``lambdas`` (one lambda for every
    layer): {"accuracy": [N, L], "loss": [N, L], "ece": [N, L], "mce": [N, L],
    "num_examples": [N]} over the clients of ``split`` (ids 0..N-1; stored or
    generated), one client at a time (``evaluation.per_client``)."""
    lambdas = jnp.asarray(lambdas, jnp.float32)

    @jax.jit
    def run(state, split):
        def one(client_id, data):
            row = jax.tree.map(lambda x: x[0], algorithm.client_rows(state, client_id[None]))
            return jax.vmap(lambda a: data_metrics(model, mix(state.params, row.local, a),
                                                   data))(lambdas)

        return per_client(one, split, None, chunk_size=1)

    per = run(state, split)
    return {**{k: per[k] for k in ("accuracy", "loss", "ece", "mce") if k in per},
            "num_examples": per["num_examples"]}


def personalised_summary(grid: dict, lambdas=LAMBDA_GRID) -> dict:
    """The thesis's evaluation numbers (Ch. II) from ``lambda_grid_metrics``, over clients with test data,
    unweighted: ``acc_best_lambda_avg`` = max_lambda mean_i A[i, lambda] (and that
    lambda), ``acc_oracle_per_client`` = mean_i max_lambda A[i, lambda] (optimistic),
    ``acc_lambda0`` (the federated endpoint), ``acc_lambda1`` (the local endpoint),
    each with its population std over clients, the unweighted worst 10% of clients at
    the best-average lambda (``acc_best_lambda_worst_10%``), and the calibration errors at the
    best-average lambda (``ece_best_lambda``, ``mce_best_lambda``, averaged over
    clients) when the grid has them."""
    has = jnp.asarray(grid["num_examples"]) > 0
    acc = jnp.asarray(grid["accuracy"])[has]
    mean = acc.mean(0)
    best = int(jnp.argmax(mean))
    oracle = acc.max(1)
    out = {"acc_best_lambda_avg": float(mean[best]),
           "acc_best_lambda_std": float(acc[:, best].std()),
           "acc_best_lambda_worst_10%": float(worst_k(acc[:, best], 0.1)),
           "best_lambda": float(lambdas[best]),
           "acc_oracle_per_client": float(oracle.mean()), "acc_oracle_std": float(oracle.std()),
           "acc_lambda0": float(mean[0]), "acc_lambda0_std": float(acc[:, 0].std()),
           "acc_lambda1": float(mean[-1]), "acc_lambda1_std": float(acc[:, -1].std())}
    for name in ("ece", "mce"):
        if name in grid:
            out[f"{name}_best_lambda"] = float(jnp.asarray(grid[name])[has][:, best].mean())
    return out


def lambda_report(model: Model, algorithm: FederatedAlgorithm, state, split: ClientData
                  ) -> dict:
    """``personalised_summary`` of the lambda grid on ``split`` at ``state``: what the
    CLI writes under "method_report" in a SuPerFed run's summary.json."""
    return personalised_summary(lambda_grid_metrics(model, algorithm, state, split))


def lambda_line(report: dict) -> str:
    """The line ``fedjax-fair run`` prints of ``lambda_report``'s numbers."""
    return (f"personalised (lambda grid, SuPerFed arXiv:2109.07628 §4.1): best average "
            f"lambda {report['best_lambda']:.1f} -> {report['acc_best_lambda_avg']:.4f}; "
            f"per-client oracle {report['acc_oracle_per_client']:.4f}; lambda 0 (federated) "
            f"{report['acc_lambda0']:.4f}; lambda 1 (local) {report['acc_lambda1']:.4f}")


register("superfed", superfed, HPARAMS, family="personalised", report=lambda_report,
         report_line=lambda_line, size_prior=None,
         search_space={"mu": (0.0, 0.01, 0.1, 1.0), "nu": (1.0, 2.0, 5.0)},
         search_source="SuPerFed (arXiv:2109.07628), its grids: mu in {0, 0.01, 0.1, 1}, nu in {1, 2, 5} (nu > 0)")
