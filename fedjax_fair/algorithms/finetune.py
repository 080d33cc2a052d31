"""FedAvg-FT — FedAvg (McMahan et al., "Communication-Efficient Learning of Deep
Networks from Decentralized Data", AISTATS 2017, arXiv:1602.05629) followed by local
fine-tuning, the personalisation baseline of e.g. Wang, Mathews, Kiddon, Eichner,
Beaufays, Ramage, "Federated Evaluation of On-device Personalization",
arXiv:1910.10252.

The global model theta is trained by FedAvg, unchanged (weights n_k, or 1 / |S| with
``weight_by_size=False``). Client k's personal model is a global model fine-tuned on
its own training rows:

    v_k = theta^t after E_ft epochs of SGD (rate eta_ft) on F_k, from theta^t,

where theta^t is the global model the client received in its LAST participation: the
fine-tuned copy is computed when the client is sampled (its data is not available at
evaluation time) and stored as its row, and it is not refreshed until the client is
sampled again. What is evaluated (personally, on each client's own test rows):

* a client that has fine-tuned at least once: its stored v_k (fine-tuned from the
  global model of the round it last took part in, possibly stale);
* a client never sampled (or whose participations never took a step: no rows, or a
  zero step budget): the current global model theta.

Cost: with ``finetune_epochs=None`` and ``finetune_lr=None`` (the default) fine-tuning
is free: FedAvg's own local model theta_k (E epochs at eta_l from theta^t) is exactly
theta^t fine-tuned for E epochs, and it is stored as v_k. Otherwise each participant
runs one extra local loop (E_ft epochs at eta_ft from theta^t, the FedAvg step budget,
key ``fold_in(client key, 1)``). Memory: one full model per client (the client table;
"lazy" stores only the clients sampled so far, "dense:bf16" halves it).

Symbols -> arguments: E_ft = ``finetune_epochs`` (default: ``training.num_epochs``),
eta_ft = ``finetune_lr`` (default: ``training.lr``), both with ``training.optimizer``
(default SGD), its weight decay and gradient clipping (off by default); the FedAvg
part: eta_l = ``training.lr``, E = ``training.num_epochs``, B = ``training.batch_size``
(also the fine-tuning batch), ``training.max_steps`` (caps both loops).

Pieces: FedAvg's ``client.local_training`` with a ``finish`` hook that stores the
fine-tuned copy (``client.local_sgd`` for the extra loop), the client row
``FineTuned(params, tuned)``, and ``personal_params`` choosing between the row and the
global model.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from fedjax_fair import hparams as H
from fedjax_fair.core.algorithm import FederatedAlgorithm, compose
from fedjax_fair.algorithms.families.training import Rate
from fedjax_fair.core.client import (ClientTraining, describe_object, local_sgd,
                                     local_training, make_optimizer, round_value)
from fedjax_fair.core.execution import local_step_unroll
from fedjax_fair.core.mixing import prior
from fedjax_fair.algorithms.registry import register

HPARAMS = {"finetune_epochs": H.Range(1, None, integer=True, nullable=True),
           "finetune_lr": H.Range(0.0, None, low_open=True, nullable=True)}


class FineTuned(NamedTuple):
    """A client's row: its fine-tuned model and whether it has one (float32 [] 1.0 /
    0.0; a float so that every table form, drift offsets included, can store it)."""

    params: Any
    tuned: Any


def personal_model(server_params, row: FineTuned):
    """The evaluated model: the stored fine-tuned copy, or the global model if none."""
    return jax.tree.map(lambda v, g: jnp.where(row.tuned > 0, v, g), row.params,
                        server_params)


def fedavg_ft(model, *, finetune_epochs: Optional[int] = None,
              finetune_lr: Optional[Rate] = None,
              training: ClientTraining = ClientTraining(),
              client_table: str = "dense", weight_by_size: bool = True) -> FederatedAlgorithm:
    """FedAvg whose participants store a fine-tuned copy of the received global model,
    evaluated personally (the global model for clients without one).

    ``finetune_epochs`` / ``finetune_lr`` None: the round's local model is the copy (no
    extra work). ``training``: the local training of both loops (``ClientTraining``).
    ``client_table``: "dense", "lazy", "lazy:CAPACITY" (or ":bf16")."""
    H.check(HPARAMS, finetune_epochs=finetune_epochs)
    if finetune_lr is not None and not callable(finetune_lr):
        HPARAMS["finetune_lr"].check("finetune_lr", finetune_lr)
    if not isinstance(training, ClientTraining):
        raise H.FieldTypeError("training", f"must be a ClientTraining, got "
                                           f"{describe_object(training)}")
    training.check()
    optimizer = training.optimizer or optax.sgd
    reuse = finetune_epochs is None and finetune_lr is None
    rate = training.lr if finetune_lr is None else finetune_lr
    train_ft = local_sgd(model, batch_size=training.batch_size,
                         num_epochs=finetune_epochs or training.num_epochs,
                         max_steps=training.max_steps,
                         unroll=local_step_unroll(model.uses_xla_conv),
                         weight_decay=training.weight_decay, clip_norm=training.clip_norm,
                         clip_mode=training.clip_mode)

    def finish(result, broadcast, row, data, key):
        """v_k <- theta^t fine-tuned on the client's rows; the row is kept if no step."""
        if reuse:
            params, steps = result.params, result.num_steps
        else:
            opt = make_optimizer(optimizer, round_value(rate, broadcast.round))
            params, steps, _ = train_ft(broadcast.params, opt, data, result.step_budget, key)
        new = FineTuned(params, jnp.ones((), jnp.float32))
        return jax.tree.map(lambda n, o: jnp.where(steps > 0, n, o), new, row), ()

    client = local_training(model, training, finish=finish)
    return compose(client, mixing=prior(weight_by_size),
                   client_state_init=lambda params: FineTuned(params,
                                                              jnp.zeros((), jnp.float32)),
                   client_table=client_table, personal_params=personal_model)


register("fedavg_ft", fedavg_ft, HPARAMS, family="personalised")
