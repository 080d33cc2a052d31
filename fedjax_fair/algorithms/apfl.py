"""APFL — Deng, Kamani, Mahdavi, "Adaptive Personalized Federated Learning"
(arXiv:2003.13461), Algorithm 1 (and its adaptive mixing weight, Section 3).

Every client i keeps a local model v_i and a mixing weight alpha_i; its personalised
model is the mixture

    vbar_i = alpha_i v_i + (1 - alpha_i) w_i.

When sampled, client i starts its copy w_i of the global model from the broadcast w^t
and takes local steps on minibatches xi; each step uses ONE minibatch and the
iterates before the step (Algorithm 1):

    w_i     <- w_i - eta grad f_i(w_i; xi)
    v_i     <- v_i - eta grad_v f_i(vbar_i; xi)       = v_i - eta alpha_i grad f_i(vbar_i; xi)
    alpha_i <- alpha_i - eta_alpha <v_i - w_i, grad f_i(vbar_i; xi)>   (adaptive only)

The server averages the w_i (FedAvg, weights n_i); v_i and alpha_i never leave the
client. The algorithm is evaluated personally: client i's model is
alpha_i v_i + (1 - alpha_i) w with w the current global model (a client never sampled
still holds v_i = w^0 and alpha_i = ``alpha``).

Implementation (one local loop): the triple (w_i, v_i, alpha_i) is trained with
``client.local_sgd`` as one joint model whose loss on a batch is

    f(w) + f(alpha v + (1 - alpha) stop_gradient(w)).

Its gradients are exactly APFL's: the stop-gradient keeps the mixture out of w's
gradient (grad_w = grad f(w)); the chain rule through the mixture gives
grad_v = alpha grad f(vbar) and grad_alpha = <v - w, grad f(vbar)>; all three at the
same batch and the pre-step iterates. (The mixture's loss enters as
``f(vbar) - stop_gradient(f(vbar))`` in value, so the client's ``train_loss`` is w's own
last-epoch loss, as FedAvg's, while the gradients are unchanged.) The optimizer moves
(w, v) with ``training.optimizer`` (default SGD at ``training.lr``) and alpha by plain
SGD at ``alpha_lr`` projected onto [0, 1] (as the authors' code clips it); with
``adaptive_alpha=False`` alpha is never moved. ``training.clip_norm`` clips grad_w and
grad_v separately, each to global norm at most c (the two models' own steps, so
alpha = 0 with clipping is FedAvg with clipping); APFL has no regularizer, so both
``clip_mode`` forms coincide. ``training.weight_decay`` must be 0 (the joint loop
would decay alpha too; an optimizer with decayed weights, e.g.
``client.sgd_optimizer(weight_decay=...)``, decays (w, v) only). The row of client i is
``APFLRow(local=v_i, alpha=alpha_i)``, v_i^0 = w^0 and alpha_i^0 = ``alpha``.

Symbols -> arguments: alpha (the initial / fixed mixing weight) = ``alpha`` (the
SuPerFed comparison uses the fixed 0.25 of its reference code; may be traced);
eta = ``training.lr`` (w and v share it, as in the paper); eta_alpha = ``alpha_lr``
(default: ``training.lr``); the number of local steps tau = E ceil(n_i / B) capped by
``training.max_steps`` (E = ``training.num_epochs``, B = ``training.batch_size``).
``alpha = 0`` trains w exactly as FedAvg (v_i then receives zero gradients and the
personal model is w).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from fedjax_fair.core import execution
from fedjax_fair import hparams as H
from fedjax_fair.core.algorithm import FederatedAlgorithm, compose
from fedjax_fair.algorithms.families.training import Rate
from fedjax_fair.core.client import (FIELDS, ClientTraining, clip_by_global_norm, data_loss,
                                     local_sgd, make_optimizer, round_value)
from fedjax_fair.core.mixing import prior
from fedjax_fair.models.base import Model
from fedjax_fair.core.types import Broadcast, ClientData, ClientOutput
from fedjax_fair.algorithms.registry import register

HPARAMS = {"alpha": H.Range(0.0, 1.0),
           "alpha_lr": H.Range(0.0, None, low_open=True, nullable=True)}
# The ClientTraining fields APFL honours, by flat name: all but weight_decay (module doc).
TRAINING_FIELDS = tuple(name for name in FIELDS if name != "weight_decay")


def check_no_weight_decay(training: ClientTraining, method: str) -> None:
    """``FieldError("training.weight_decay")`` unless it is a concrete 0: ``method``'s
    local loop has no coupled weight decay."""
    wd = training.weight_decay
    if not (isinstance(wd, (int, float)) and wd == 0):
        raise H.FieldError("training.weight_decay",
                           f"{method}'s local loop has no weight decay, must be 0 (give "
                           f"an optimizer with decayed weights, e.g. "
                           f"client.sgd_optimizer(weight_decay=...)), got {wd!r}")


class APFLRow(NamedTuple):
    """Client i's row: its local model v_i and mixing weight alpha_i (a scalar)."""

    local: Any
    alpha: jax.Array


class Joint(NamedTuple):
    """What one local loop trains: the global copy w_i, v_i and alpha_i."""

    w: Any
    v: Any
    alpha: jax.Array


def mixture(alpha, local, global_params):
    """alpha v + (1 - alpha) w, leaf by leaf (in each leaf's dtype)."""
    return jax.tree.map(lambda v, w: (alpha * v + (1 - alpha) * w).astype(w.dtype), local,
                        global_params)


def joint_model(model: Model) -> Model:
    """``model`` over ``Joint``: per-example loss l(w) + l(alpha v + (1 - alpha) sg(w)),
    whose value is l(w) (the mixture's loss enters as l - sg(l))."""

    def loss(joint: Joint, batch, key=None):
        w_key, v_key = (None, None) if key is None else jax.random.split(key)
        own = model.per_example_loss(joint.w, batch, w_key)
        mixed = model.per_example_loss(
            mixture(joint.alpha, joint.v, jax.lax.stop_gradient(joint.w)), batch, v_key)
        return own + (mixed - jax.lax.stop_gradient(mixed))

    return model._replace(per_example_loss=loss, init=None)


def joint_optimizer(pair: optax.GradientTransformation, alpha_lr, adaptive: bool,
                    clip_norm=None):
    """``pair`` on (w, v); alpha <- clip(alpha - alpha_lr g_alpha, 0, 1) if ``adaptive``,
    else alpha unchanged. ``clip_norm`` (not None): g_w and g_v are each clipped to
    global norm at most ``clip_norm`` before ``pair`` sees them."""

    def init(params: Joint):
        return pair.init((params.w, params.v))

    def update(grads: Joint, state, params: Joint):
        gw, gv = grads.w, grads.v
        if clip_norm is not None:
            gw, gv = clip_by_global_norm(gw, clip_norm), clip_by_global_norm(gv, clip_norm)
        (dw, dv), state = pair.update((gw, gv), state, (params.w, params.v))
        a = params.alpha
        da = (jnp.clip(a - alpha_lr * grads.alpha, 0.0, 1.0) - a).astype(a.dtype) if adaptive \
            else jnp.zeros_like(a)
        return Joint(dw, dv, da), state

    return optax.GradientTransformation(init, update)


def apfl(model, *, alpha: float = 0.25, adaptive_alpha: bool = False,
         alpha_lr: Optional[Rate] = None, training: ClientTraining = ClientTraining(),
         client_table: str = "dense", weight_by_size: bool = True) -> FederatedAlgorithm:
    """APFL: FedAvg on the global copies w_i (weights n_i, or 1 / |S| with
    ``weight_by_size=False``), a local model v_i and mixing weight alpha_i per client
    trained in the same local steps; evaluated personally on
    alpha_i v_i + (1 - alpha_i) w.

    ``training`` (``ClientTraining``, weight decay 0): its optimizer, ``rate -> optax
    transformation`` (default ``optax.sgd``) or a fixed transformation, is applied to
    the pair (w_i, v_i), its state fresh every round; ``clip_norm``: grad_w and grad_v
    each clipped (``clip_mode`` accepted for uniformity; no regularizer).
    ``client_table``: "dense", "lazy" or "lazy:CAPACITY" storage of the rows."""
    H.check(HPARAMS, alpha=alpha)
    if alpha_lr is not None and not callable(alpha_lr):
        HPARAMS["alpha_lr"].check("alpha_lr", alpha_lr)
    if not isinstance(adaptive_alpha, bool):
        raise H.FieldError("adaptive_alpha", f"must be a bool, got {adaptive_alpha!r}")
    training.check()
    check_no_weight_decay(training, "APFL")
    client_lr, clip_norm = training.lr, training.clip_norm
    pair_optimizer = training.optimizer or optax.sgd
    alpha_rate = client_lr if alpha_lr is None else alpha_lr
    train = local_sgd(joint_model(model), batch_size=training.batch_size,
                      num_epochs=training.num_epochs, max_steps=training.max_steps,
                      unroll=execution.local_step_unroll(model.uses_xla_conv))

    def client_update(broadcast: Broadcast, row: APFLRow, data: ClientData, local_steps,
                      key):
        lr = round_value(client_lr, broadcast.round)
        optimizer = joint_optimizer(make_optimizer(pair_optimizer, lr),
                                    round_value(alpha_rate, broadcast.round), adaptive_alpha,
                                    clip_norm)
        start = Joint(broadcast.params, row.local, row.alpha)
        trained, num_steps, train_loss = train(start, optimizer, data, local_steps, key)
        output = ClientOutput(
            delta=jax.tree.map(jnp.subtract, broadcast.params, trained.w),
            loss_before=data_loss(model, broadcast.params, data,
                                  execution.loss_chunk_size_here()),
            num_examples=data.num_examples, num_steps=num_steps, train_loss=train_loss)
        return output, APFLRow(trained.v, trained.alpha)

    def init_row(params):
        dtype = jax.tree.leaves(params)[0].dtype
        return APFLRow(params, jnp.asarray(alpha, dtype))

    return compose(client_update, mixing=prior(weight_by_size), client_state_init=init_row,
                   client_table=client_table,
                   personal_params=lambda server_params, row: mixture(row.alpha, row.local,
                                                                      server_params))


register("apfl", apfl, HPARAMS, family="personalised", training_fields=TRAINING_FIELDS)
