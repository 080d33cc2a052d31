"""FedRep and FedPer: a shared body (representation) and a personal head per client.

* FedRep — Collins, Hassani, Mokhtari, Shakkottai, "Exploiting Shared Representations
  for Personalized Federated Learning", ICML 2021 (arXiv:2102.07078), Algorithm 1.
* FedPer — Arivazhagan, Aggarwal, Singh, Choudhary, "Federated Learning with
  Personalization Layers", arXiv:1912.00818.

The network is split by layer (``partial.py``) into a body phi (shared by all clients,
averaged by the server as in FedAvg) and a head h_k (client k's own, never sent). In
round t, client k starts from (phi^t, h_k), its own head from its last participation:

* FedRep: first tau_h = ``head_epochs`` epochs of SGD on the head with the body frozen,

      h_k <- h_k - eta grad_h f_k(phi^t, h_k),

  then tau_phi = ``num_epochs`` epochs on the body with the new head frozen,

      phi_k <- phi_k - eta grad_phi f_k(phi_k, h_k)   (from phi_k = phi^t);

* FedPer: E = ``num_epochs`` epochs of SGD on body and head jointly.

Both send Delta_k = phi^t - phi_k and the server sets phi^{t+1} = phi^t - sum_k p_k Delta_k
(p_k = n_k / sum_S n_j, or 1 / |S| with ``weight_by_size=False``); the client keeps h_k as
its row. The server's copy of the head stays at its initial value (its delta is zero)
and is every client's first head; a client never sampled is evaluated with phi^t and
that initial head. Evaluation is personal: client k's model is (phi^t, h_k) on its own
test rows (``alg.personal``).

Symbols -> arguments: the head = the layers named by ``personal_layers`` (default
``(-1,)``, the last layer; names such as ``("Dense_1",)`` or positions), the body =
the other layers; eta = ``client_lr`` (both phases; a number, traced scalar or
schedule of the round; or ``client_optimizer``); tau_h = ``head_epochs`` (the paper's 10),
tau_phi = ``num_epochs`` (the paper's 1: the epochs of the shared part, as in FedAvg);
FedPer's E = ``num_epochs``; B = ``batch_size``; ``max_steps`` caps each phase, and a
client's step budget (computational heterogeneity) applies to each phase.

Degenerate splits are allowed: with ``personal_layers=()`` both methods are FedAvg (no
client state, global evaluation; FedRep runs only its body phase); with every layer
personal (e.g. logistic regression, whose only layer is the head) they are local
training alone (FedRep runs only its head phase, and nothing is averaged).

Pieces: ``partial.partial_training`` (phases "personal" then "shared" for FedRep,
"all" for FedPer) as the client update, the personal layers as the client's row
(dense or lazy table), ``prior(weight_by_size)`` mixing, the weighted mean, sgd(1.0).
"""
from __future__ import annotations

from typing import Optional

from fedjax_fair import hparams as H
from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.algorithms.families import partial
from fedjax_fair.algorithms.families.training import (CLIENT_HPARAMS, Optimizer, Rate,
                                                      check_client)

FEDPER_HPARAMS = dict(CLIENT_HPARAMS)
HPARAMS = {"head_epochs": H.COUNT, **CLIENT_HPARAMS}


def fedrep(model, *, personal_layers: tuple = (-1,), head_epochs: int = 10,
           client_lr: Rate = 0.1, batch_size: int = 20, num_epochs: int = 1,
           max_steps: Optional[int] = None, client_optimizer: Optional[Optimizer] = None,
           clip_norm: Optional[float] = None, clip_mode: str = "step",
           client_table: str = "dense", weight_by_size: bool = True) -> FederatedAlgorithm:
    """FedRep: per round, ``head_epochs`` on the own head (body frozen), then
    ``num_epochs`` on the body (head frozen); only the body is averaged.

    ``personal_layers``: the head (layer names / positions). ``client_table``: "dense",
    "lazy" or "lazy:CAPACITY" storage of the heads."""
    H.check(HPARAMS, head_epochs=head_epochs)
    check_client(client_lr, batch_size, num_epochs, max_steps, client_optimizer, clip_norm,
                 clip_mode)
    split = partial.split_layers(model, personal_layers, "personal_layers")
    phases = (partial.Phase("personal", head_epochs), partial.Phase("shared", num_epochs))
    return partial.compose_partial(model, split, phases, client_lr=client_lr,
                                   batch_size=batch_size, max_steps=max_steps,
                                   client_optimizer=client_optimizer,
                                   client_table=client_table, weight_by_size=weight_by_size,
                                   clip_norm=clip_norm, clip_mode=clip_mode)


def fedper(model, *, personal_layers: tuple = (-1,), client_lr: Rate = 0.1,
           batch_size: int = 20, num_epochs: int = 1, max_steps: Optional[int] = None,
           client_optimizer: Optional[Optimizer] = None,
           clip_norm: Optional[float] = None, clip_mode: str = "step",
           client_table: str = "dense", weight_by_size: bool = True) -> FederatedAlgorithm:
    """FedPer: ``num_epochs`` of joint SGD on (global body, own head); only the body is
    averaged. ``personal_layers``: the personalization layers (names / positions;
    ``()`` gives FedAvg)."""
    check_client(client_lr, batch_size, num_epochs, max_steps, client_optimizer, clip_norm,
                 clip_mode)
    split = partial.split_layers(model, personal_layers, "personal_layers")
    return partial.compose_partial(model, split, (partial.Phase("all", num_epochs),),
                                   client_lr=client_lr, batch_size=batch_size,
                                   max_steps=max_steps, client_optimizer=client_optimizer,
                                   client_table=client_table, weight_by_size=weight_by_size,
                                   clip_norm=clip_norm, clip_mode=clip_mode)
