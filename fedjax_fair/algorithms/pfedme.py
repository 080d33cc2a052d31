"""pFedMe — Dinh, Tran, Nguyen, "Personalized Federated Learning with Moreau
Envelopes", NeurIPS 2020 (arXiv:2006.08848), Algorithm 1.

Client i's personal model theta_i solves the Moreau-envelope problem around its
local copy w_i of the global model,

    theta_i(w_i) = argmin_theta  f_i(theta) + (lambda / 2) ||theta - w_i||^2.

When sampled, client i sets w_{i,0} = w^t and takes R local steps; local step r
draws one minibatch D and

    theta~ <- K gradient steps on h_i(theta; w_{i,r}, D) = f_i(theta; D)
              + (lambda / 2) ||theta - w_{i,r}||^2  at the personal rate:
              theta <- theta - personal_lr (grad f_i(theta; D) + lambda (theta - w_{i,r})),
    w_{i,r+1} = w_{i,r} - eta lambda (w_{i,r} - theta~).

The server moves the global model towards the cohort's average local model:

    w^{t+1} = (1 - beta) w^t + beta sum_{i in S} p_i w_{i,R}
            = w^t - beta sum_i p_i (w^t - w_{i,R}),

i.e. ``optax.sgd(beta)`` on FedAvg's aggregated pseudo-gradient (beta = 1: FedAvg's
averaging). p_i = n_i / sum n_j as in the authors' code (``weight_by_size=False``: the
paper's 1 / |S|). The algorithm is evaluated personally on theta_i, the last personal
solution of client i (its row; theta_i^0 = w^0; a client that takes no step keeps its
row).

The paper leaves the inner solver's starting point open. ``warm_start=True`` (default,
as the authors' implementation) continues from the previous step's theta~ (w^t at the
first step of a round); ``warm_start=False`` restarts it at w_{i,r} every step. With
``warm_start=False`` and K = 1, a local step is w <- w - eta lambda personal_lr
grad f_i(w; D): FedAvg at client rate eta lambda personal_lr. With lambda = 0 the global
model never moves and theta_i is plain local SGD from w^t (each batch K times).
Only the sampled clients train (the paper's Algorithm 1 lets every client train and
samples S for the average; they coincide for the aggregated model).

Pieces: a client update with its own masked local loop (the same batches, masking and
step budget as ``client.local_sgd``, whose single gradient per step cannot hold the K
inner steps); FedAvg's mixing and aggregator; the server optimizer ``optax.sgd(beta)``;
theta_i is the client's row, read by ``personal_params``. The client's
``train_loss`` is the mean loss, over its last local epoch, of the inner solver's
starting point of each step (the personal model before its K steps).

Symbols -> arguments: lambda = ``lam`` (paper: 15 on MNIST, 20 on Synthetic; may be
traced), K = ``inner_steps`` (5), personal learning rate = ``personal_lr`` (0.01 - 0.1),
eta = ``training.lr`` (0.005: ``TRAINING``), beta = ``beta`` (1 or 2; may be traced), R =
the local steps, E ceil(n_i / B) capped by ``training.max_steps`` (E =
``training.num_epochs``, B = ``training.batch_size``, 20 in the paper).

Optimizers: ``training.optimizer`` (a ``rate -> optax transformation`` at eta, or a
fixed one) makes the local-model step w_{i,r+1} from the Moreau-envelope gradient
lambda (w_{i,r} - theta~); ``personal_optimizer`` (default: ``training.optimizer``)
makes the K inner steps at ``personal_lr`` from grad f_i(theta; D) + lambda (theta -
w_{i,r}). Each keeps one state per round, carried across the round's steps (and inner
steps). None for both: the plain steps written above. Gradient clipping
(``training.clip_norm``) applies to the inner steps, the only minibatch gradients:
``clip_mode="step"`` clips grad f_i + lambda (theta - w_{i,r}), ``"loss"`` grad f_i
alone; the local-model step is not clipped. ``training.weight_decay`` must be 0 (no
coupled weight decay in this loop; an optimizer with decayed weights gives one).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import optax

from fedjax_fair.core import execution
from fedjax_fair import hparams as H
from fedjax_fair.core.algorithm import FederatedAlgorithm, compose
# TRAINING_FIELDS: the ClientTraining fields pFedMe honours too, all but weight_decay
from fedjax_fair.algorithms.apfl import TRAINING_FIELDS, check_no_weight_decay
from fedjax_fair.algorithms.families.training import Optimizer, Rate
from fedjax_fair.core.client import (ClientTraining, check_optimizer, clip_by_global_norm,
                                     data_loss, make_optimizer, masked_steps, round_value)
from fedjax_fair.core.mixing import prior
from fedjax_fair.core.types import Broadcast, ClientData, ClientOutput
from fedjax_fair.algorithms.registry import register

HPARAMS = {"lam": H.NONNEGATIVE, "inner_steps": H.COUNT, "personal_lr": H.POSITIVE,
           "beta": H.POSITIVE}
# pFedMe's default local training: the paper's local-model rate eta = 0.005 and batch
# 20 (arXiv:2006.08848, experimental settings); the other fields are ClientTraining()'s.
TRAINING = ClientTraining(lr=0.005, batch_size=20)


def _axpy(x, a, y):
    """x + a y leaf by leaf, in x's dtypes (a may be a traced scalar): optax.tree.add_scale
    cast back with optax.tree.cast_like (add_scale alone would let a wider traced ``a``
    promote the leaves)."""
    return optax.tree.cast_like(optax.tree.add_scale(x, a, y), x)


def pfedme(model, *, lam: float = 15.0, inner_steps: int = 5, personal_lr: Rate = 0.1,
           beta: float = 1.0, training: ClientTraining = TRAINING,
           personal_optimizer: Optional[Optimizer] = None, warm_start: bool = True,
           client_table: str = "dense", weight_by_size: bool = True) -> FederatedAlgorithm:
    """pFedMe (Algorithm 1): bi-level local steps (K inner steps on the personal
    problem, then the local-model step), server step beta towards the cohort's average;
    evaluated personally on each client's last personal model theta_i.

    ``training`` (``ClientTraining``, weight decay 0): its optimizer makes the
    local-model step (rate ``training.lr``), its clipping clips the inner steps;
    ``personal_optimizer`` (default: ``training.optimizer``): the inner steps (rate
    ``personal_lr``).
    ``client_table``: "dense", "lazy" or "lazy:CAPACITY" storage of the personal models."""
    H.check(HPARAMS, lam=lam, inner_steps=inner_steps, beta=beta)
    if not callable(personal_lr):
        HPARAMS["personal_lr"].check("personal_lr", personal_lr)
    if not isinstance(warm_start, bool):
        raise H.FieldError("warm_start", f"must be a bool, got {warm_start!r}")
    training.check()
    check_no_weight_decay(training, "pFedMe")
    check_optimizer(personal_optimizer, "personal_optimizer")
    client_lr, client_optimizer = training.lr, training.optimizer
    clip_norm, clip_mode = training.clip_norm, training.clip_mode
    inner_choice = personal_optimizer or client_optimizer  # None: the plain step as written
    unroll = execution.local_step_unroll(model.uses_xla_conv)

    def batch_objective(theta, batch, batch_mask, key):
        """(masked mean of f over the batch, its sum over the real rows)."""
        per_example = jnp.where(batch_mask, model.per_example_loss(theta, batch, key), 0.0)
        total = jnp.sum(per_example)
        return total / jnp.maximum(jnp.sum(batch_mask), 1), total

    grad_fn = jax.grad(batch_objective, has_aux=True)

    def client_update(broadcast: Broadcast, personal, data: ClientData, local_steps, key):
        eta = round_value(client_lr, broadcast.round)
        rate = round_value(personal_lr, broadcast.round)
        inner_opt = None if inner_choice is None else make_optimizer(inner_choice, rate)
        outer_opt = None if client_optimizer is None else make_optimizer(client_optimizer, eta)

        def local_step(carry, batch, batch_mask, step_key):
            w, theta, outer_state, inner_state = carry

            def inner(inner_carry, j):
                th, opt_state, first = inner_carry
                g, total = grad_fn(th, batch, batch_mask, jax.random.fold_in(step_key, j))
                if clip_norm is not None and clip_mode == "loss":
                    g = clip_by_global_norm(g, clip_norm)
                # the gradient grad f(theta; D) + lambda (theta - w) of the personal problem
                g = optax.tree.add_scale(g, lam, optax.tree.sub(th, w))
                if clip_norm is not None and clip_mode == "step":
                    g = clip_by_global_norm(g, clip_norm)
                if inner_opt is None:  # theta <- theta - personal_lr g
                    th = _axpy(th, -rate, g)
                else:
                    updates, opt_state = inner_opt.update(g, opt_state, th)
                    th = optax.apply_updates(th, updates)
                return (th, opt_state, jnp.where(j == 0, total.astype(first.dtype), first)), None

            start = theta if warm_start else w
            (theta, inner_state, first_loss), _ = jax.lax.scan(
                inner, (start, inner_state, jnp.zeros((), jnp.float32)), jnp.arange(inner_steps))
            if outer_opt is None:
                w = _axpy(w, -eta * lam, optax.tree.sub(w, theta))  # w - eta lambda (w - theta~)
            else:  # the optimizer's step on the Moreau-envelope gradient lambda (w - theta~)
                updates, outer_state = outer_opt.update(
                    optax.tree.scale(lam, optax.tree.sub(w, theta)), outer_state, w)
                w = optax.apply_updates(w, updates)
            return (w, theta, outer_state, inner_state), first_loss

        start = broadcast.params
        states = (() if outer_opt is None else outer_opt.init(start),
                  () if inner_opt is None else inner_opt.init(start))
        (w, theta, _, _), num_steps, train_loss = masked_steps(
            local_step, (start, start, *states), data, local_steps, key,
            batch_size=training.batch_size, num_epochs=training.num_epochs,
            max_steps=training.max_steps, unroll=unroll)
        new_personal = jax.tree.map(lambda new, old: jnp.where(num_steps > 0, new, old),
                                    theta, personal)
        output = ClientOutput(
            delta=optax.tree.sub(broadcast.params, w),
            loss_before=data_loss(model, broadcast.params, data,
                                  execution.loss_chunk_size_here()),
            num_examples=data.num_examples, num_steps=num_steps,
            train_loss=train_loss)
        return output, new_personal

    return compose(client_update, mixing=prior(weight_by_size),
                   server_optimizer=optax.sgd(beta),
                   client_state_init=lambda params: params, client_table=client_table,
                   personal_params=lambda server_params, personal: personal)


register("pfedme", pfedme, HPARAMS, family="personalised", training_fields=TRAINING_FIELDS)
