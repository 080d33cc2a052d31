"""LG-FedAvg — Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency, "Think
Locally, Act Globally: Federated Learning with Local and Global Representations",
arXiv:2001.01523, Algorithm 1.

The opposite split to FedPer / FedRep (``fedrep.py``): each client keeps its own local
representation, the lower layers l_k, and all clients share the global top layers g
(the head), which the server averages. In round t client k trains (l_k, g) jointly
for E epochs of SGD from its own l_k and the received g^t,

    (l_k, g_k) <- (l_k, g_k) - eta grad f_k(l_k, g_k),   g_k = g^t at the start,

sends Delta_k = g^t - g_k, and the server sets g^{t+1} = g^t - sum_k p_k Delta_k (p_k =
n_k / sum_S n_j, or 1 / |S| with ``weight_by_size=False``). l_k never leaves the
client; it is its row in the client table, starting from the initial model's lower
layers (the server's copy of them stays at that initial value: its delta is zero).
Evaluation is personal ("local test" in the paper): client k's model (l_k, g^t) on its
own test rows; a client never sampled uses the initial lower layers with g^t. The
paper starts from a FedAvg-trained model; pass such parameters to ``init`` to do so.

Symbols -> arguments: the global layers g = ``shared_layers`` (names or positions;
default ``(-1,)``, the last layer (the classifier); ``(-2, -1)`` shares the top
two), the local layers l = the others; eta = ``training.lr`` (or
``training.optimizer``), E = ``training.num_epochs``, B = ``training.batch_size``.
``shared_layers=()`` is local training alone. A selection that shares every layer (the
default ``(-1,)`` on a one-layer model such as logistic regression) is refused: it would
be FedAvg under another name.

Pieces: ``partial.partial_training`` (one "all" phase) as the client update, the local
layers as the client's row (dense or lazy table), ``prior(weight_by_size)`` mixing,
the weighted mean, sgd(1.0).
"""
from __future__ import annotations

from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.algorithms.families import partial
from fedjax_fair.core.client import ClientTraining
from fedjax_fair import hparams as H
from fedjax_fair.algorithms.registry import register

HPARAMS = {}


def lg_fedavg(model, *, shared_layers: tuple = (-1,),
              training: ClientTraining = ClientTraining(),
              client_table: str = "dense", weight_by_size: bool = True) -> FederatedAlgorithm:
    """LG-FedAvg: local lower layers, a global head averaged by the server.

    ``shared_layers``: the global layers (names / positions); the others are local.
    ``training``: the local training (``ClientTraining``). ``client_table``: "dense",
    "lazy" or "lazy:CAPACITY" storage of the local layers."""
    partial.check_training(training)
    split = partial.split_layers(model, shared_layers, "shared_layers", selects="shared")
    if not split.personal:
        raise H.FieldError("shared_layers", f"{shared_layers!r} shares every layer of the model "
                                            f"({', '.join(split.shared)}): no layer stays local, "
                                            f"so LG-FedAvg "
                                            f"would be FedAvg; use fedavg, or a model with more "
                                            f"than one layer")
    return partial.compose_partial(model, split, (partial.Phase("all", training.num_epochs),),
                                   training=training, client_table=client_table,
                                   weight_by_size=weight_by_size)


register("lg_fedavg", lg_fedavg, HPARAMS, family="personalised")
