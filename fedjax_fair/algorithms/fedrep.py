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

  then tau_phi = ``training.num_epochs`` epochs on the body with the new head frozen,

      phi_k <- phi_k - eta grad_phi f_k(phi_k, h_k)   (from phi_k = phi^t);

* FedPer: E = ``training.num_epochs`` epochs of SGD on body and head jointly.

Both send Delta_k = phi^t - phi_k and the server sets phi^{t+1} = phi^t - sum_k p_k Delta_k
(p_k = n_k / sum_S n_j, or 1 / |S| with ``weight_by_size=False``); the client keeps h_k as
its row. The server's copy of the head stays at its initial value (its delta is zero)
and is every client's first head; a client never sampled is evaluated with phi^t and
that initial head. Evaluation is personal: client k's model is (phi^t, h_k) on its own
test rows (``alg.personal``).

Symbols -> arguments: the head = the layers named by ``personal_layers`` (default
``(-1,)``, the last layer; names such as ``("Dense_1",)`` or positions), the body =
the other layers; eta = ``training.lr`` (both phases; a number, traced scalar or
schedule of the round; or ``training.optimizer``); tau_h = ``head_epochs`` (the paper's
10), tau_phi = ``training.num_epochs`` (the paper's 1: the epochs of the shared part, as
in FedAvg); FedPer's E = ``training.num_epochs``; B = ``training.batch_size``;
``training.max_steps`` caps each phase, and a client's step budget (computational
heterogeneity) applies to each phase.

Degenerate splits are allowed: with ``personal_layers=()`` both methods are FedAvg (no
client state, global evaluation; FedRep runs only its body phase); with every layer
personal (e.g. logistic regression, whose only layer is the head) they are local
training alone (FedRep runs only its head phase, and nothing is averaged).

Pieces: ``partial.partial_training`` (phases "personal" then "shared" for FedRep,
"all" for FedPer) as the client update, the personal layers as the client's row
(dense or lazy table), ``prior(weight_by_size)`` mixing, the weighted mean, sgd(1.0).
"""
from __future__ import annotations

from fedjax_fair import hparams as H
from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.algorithms.families import partial
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.algorithms.registry import register

FEDPER_HPARAMS = {}
HPARAMS = {"head_epochs": H.COUNT}


def fedrep(model, *, personal_layers: tuple = (-1,), head_epochs: int = 10,
           training: ClientTraining = ClientTraining(),
           client_table: str = "dense", weight_by_size: bool = True) -> FederatedAlgorithm:
    """FedRep: per round, ``head_epochs`` on the own head (body frozen), then
    ``training.num_epochs`` on the body (head frozen); only the body is averaged.

    ``personal_layers``: the head (layer names / positions). ``training``: both phases'
    local training (``ClientTraining``). ``client_table``: "dense", "lazy" or
    "lazy:CAPACITY" storage of the heads."""
    H.check(HPARAMS, head_epochs=head_epochs)
    partial.check_training(training)
    split = partial.split_layers(model, personal_layers, "personal_layers")
    phases = (partial.Phase("personal", head_epochs),
              partial.Phase("shared", training.num_epochs))
    return partial.compose_partial(model, split, phases, training=training,
                                   client_table=client_table, weight_by_size=weight_by_size)


def fedper(model, *, personal_layers: tuple = (-1,),
           training: ClientTraining = ClientTraining(),
           client_table: str = "dense", weight_by_size: bool = True) -> FederatedAlgorithm:
    """FedPer: ``training.num_epochs`` of joint SGD on (global body, own head); only the
    body is averaged. ``personal_layers``: the personalization layers (names / positions;
    ``()`` gives FedAvg)."""
    partial.check_training(training)
    split = partial.split_layers(model, personal_layers, "personal_layers")
    return partial.compose_partial(model, split, (partial.Phase("all", training.num_epochs),),
                                   training=training, client_table=client_table,
                                   weight_by_size=weight_by_size)


register("fedper", fedper, FEDPER_HPARAMS, family="personalised")
register("fedrep", fedrep, HPARAMS, family="personalised")
