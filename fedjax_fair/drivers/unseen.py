"""Evaluation on clients never trained on (docs/participation.md, "Clients never trained
on"; the command line's ``--unseen-clients FRACTION``).

A federated model is usually scored on the clients that trained it. Here a fraction
of the federation is held out before anything is built: the algorithm, its client
table, the sampler and the system see only the other clients, and at the end the
held-out clients are evaluated on their test rows.

* ``split_clients(data, fraction, seed)``: the seen and the unseen federations (each
  client's train / test / validation rows kept, padding trimmed to each federation's
  largest client, so the seen federation is exactly the one built without the
  held-out clients) and the unseen clients' rows in the full federation.
  ``hold_out(dataset, fraction, seed)`` does the same to a ``data.Dataset`` (its
  per-client side data, e.g. LEAF's ``info["users"]``, kept for the seen clients) and
  returns the seen ``Dataset`` carrying the held-out part as ``.unseen``.
* ``evaluate_unseen(model, algorithm, state, unseen, key)``: per-client test metrics
  of the unseen clients ([N_unseen] arrays, the keys of ``RunResult.client_metrics``)
  for the final server state ``state``; ``unseen_summary`` their fairness summary
  (``runner.split_summary``'s keys: ``accuracy_mean``, ``accuracy_worst_10%``, ...).

What an unseen client is scored on
----------------------------------

Global methods (``algorithm.personal is None``): the model the runner evaluates,
``state.params`` or ``algorithm.evaluated_params(state)`` (A-FedPD, FedDyn: the
cohort average), unchanged: such a method's answer to a new client is its global
model. ``adaptation`` is ``"none"``.

Personalised methods (``algorithm.personal`` set): a new client has no personal model
until it has run the method's own client procedure, so each unseen client runs it
once, as if it took part in round T + 1: a fresh state for the N_unseen clients
(``algorithm.init(state.params, N_unseen)``) whose server pieces are the trained ones
(the parameters, the server optimizer's state, the round counter, and any mixing or
aggregator state whose shapes do not depend on the number of clients; pieces sized
by the number of clients, the client table above all, start fresh), one
``algorithm.apply`` on a cohort of the unseen clients on their TRAIN rows (no step
budget, the training key of round T + 1: ``round_keys(key, T)``, client i of the
unseen list folding in i), the server update DISCARDED (the new client rows are kept,
every server piece stays the trained one), and each client's
``algorithm.personal(adapted_state, i)`` evaluated on its test rows. ``adaptation``
is ``"one round of the method's client procedure"``. Per method:

* FedAvg-FT: theta^T fine-tuned for E_ft epochs on the client's rows and stored as
  its model. This is the protocol of Wang, Mathews, Kiddon, Eichner, Beaufays,
  Ramage, "Federated Evaluation of On-device Personalization" (arXiv:1910.10252):
  the trained global model is personalised by local fine-tuning on each device and
  evaluated on the device's held-out data, whether or not it trained the model.
* Ditto: v starts at w^T (``init``'s row is the model given) and takes the personal
  loop, steps on h_k(v; w^T) = F_k(v) + (lambda / 2) ||v - w^T||^2 (the global steps
  of the round are run too and discarded). Li, Hu, Beirami, Smith, "Ditto: Fair and
  Robust Federated Learning Through Personalization" (arXiv:2012.04221) define a
  device's personal model as the minimiser of h_k given the global model, a local
  problem any device can solve from w* and its own data; the paper has no separate
  new-device procedure, and its Algorithm 1 solves h_k by exactly these steps.
* pFedMe: theta starts at w^T; the round's R local steps each solve the Moreau
  envelope problem argmin_theta f_i(theta) + (lambda / 2) ||theta - w_i||^2 by K inner
  steps from the client's copy w_i of w^T, and the last solution is the client's
  model. Dinh, Tran, Nguyen, "Personalized Federated Learning with Moreau Envelopes"
  (arXiv:2006.08848) define the personalised model as that proximal solution around
  the global model (their eq. 2); the paper has no separate new-client procedure,
  and this is its client loop.
* APFL: v starts at w^T and alpha at its initial value; the round's local steps train
  the client's copy of w, v and (adaptive) alpha, and the model is alpha v + (1 -
  alpha) w^T. Deng, Kamani, Mahdavi, "Adaptive Personalized Federated Learning"
  (arXiv:2003.13461): the personalised model is this mixture, with v and alpha learned
  only by the client's loop of Algorithm 1; the paper has no separate new-client
  procedure.
* SuPerFed: the local model theta_l is the client's own random initialisation (its
  fresh row, drawn from its index in the unseen list), theta_f starts at theta_g^T,
  and the round trains the pair on the mixture (after ``start_round``: the trained
  round counter is kept, so a run past L adapts with the mixture on, one before it
  leaves theta_l frozen as its rounds do); the model is theta(eval_lambda). Hahn,
  Jeong, Lee, "Connecting Low-Loss Subspace for Personalized Federated Learning"
  (arXiv:2109.07628): a client's personalised model is a point on the line between
  the federated model and a local model that only its own procedure trains; the
  paper has no separate new-client procedure.
* FedRep: the head starts at the server's copy (its initial value, the head of any
  client never sampled), takes ``head_epochs`` epochs with the trained body frozen,
  then the body epochs run and their update is discarded; the model is (phi^T, h).
  Collins, Hassani, Mokhtari, Shakkottai, "Exploiting Shared Representations for
  Personalized Federated Learning" (arXiv:2102.07078) serve new clients this way:
  the learned representation is kept and a new client learns only its head locally.
* FedPer: the head starts at its initial value and is trained jointly with a copy of
  the body for E epochs; the body copy is discarded and the model is (phi^T, h).
  Arivazhagan, Aggarwal, Singh, Choudhary, "Federated Learning with Personalization
  Layers" (arXiv:1912.00818): the personalisation layers are learned on the device by
  its local training against the received base layers; the paper has no separate
  new-client procedure.
* LG-FedAvg: the local layers start at their initial value (as for a client never
  sampled) and are trained jointly with a copy of the global layers for E epochs; the
  copy is discarded and the model is (l, g^T). Liang et al., "Think Locally, Act
  Globally: Federated Learning with Local and Global Representations"
  (arXiv:2001.01523) handle new devices by learning their local representation on the
  device with the global model kept.

Adaptation runs ``chunk_size`` unseen clients at a time (default: all at once, or the
capacity of a lazy client table), each chunk from the same fresh state, so the result
does not depend on the chunking; client i's key is the same in any chunk.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair import hparams as H
from fedjax_fair.core.algorithm import FederatedAlgorithm, ServerState
from fedjax_fair.core.evaluation import make_personal_evaluator, state_evaluator_program
from fedjax_fair.data.federated import require_stored
from fedjax_fair.core.execution import Execution, resolve
from fedjax_fair.scenarios.heterogeneity import UNLIMITED_STEPS
from fedjax_fair.core.types import ClientData, Cohort, FederatedData
from fedjax_fair.data.federated import Dataset, from_padded
from fedjax_fair.drivers.simulate import round_keys

NO_ADAPTATION = "none"
ONE_ROUND = "one round of the method's client procedure"
# Dataset.info entries holding one value per client (LEAF's user ids, the generated
# client sizes): kept for the seen clients only
PER_CLIENT_INFO = ("users", "client_sizes")


def adaptation(algorithm: FederatedAlgorithm) -> str:
    """What an unseen client gets before it is evaluated: ``NO_ADAPTATION`` for a
    global method, ``ONE_ROUND`` for a personalised one."""
    return NO_ADAPTATION if algorithm.personal is None else ONE_ROUND


# ----------------------------------------------------------------------------- split


def num_unseen(num_clients: int, fraction: float) -> int:
    """How many of ``num_clients`` clients a ``fraction`` holds out: fraction x N
    rounded half up, at least 1 when the fraction is positive and at most N - 1 (one
    client must stay to train). ``FieldError("fraction")`` for a fraction outside
    [0, 1), or a positive one with fewer than two clients."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float, np.floating,
                                                               np.integer)):
        raise H.FieldTypeError("fraction", f"must be a number in [0, 1), got {fraction!r}")
    if not (math.isfinite(fraction) and 0 <= fraction < 1):
        raise H.FieldError("fraction", f"must be a number in [0, 1), got {fraction!r}")
    if fraction == 0:
        return 0
    if num_clients < 2:
        raise H.FieldError("fraction", f"{fraction:g} of a federation of {num_clients} "
                                       f"client(s): holding one client out needs at least "
                                       f"two (one to hold out, one to train)")
    return int(min(num_clients - 1, max(1, math.floor(fraction * num_clients + 0.5))))


def unseen_client_ids(num_clients: int, fraction: float, seed: int) -> np.ndarray:
    """The held-out clients' rows, sorted: the first ``num_unseen`` of the permutation
    ``np.random.default_rng(seed).permutation(num_clients)``."""
    n = num_unseen(num_clients, fraction)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise H.FieldError("seed", f"must be an integer >= 0, got {seed!r}")
    return np.sort(np.random.default_rng(int(seed)).permutation(num_clients)[:n]).astype(
        np.int64)


def take_clients(split: ClientData, ids) -> ClientData:
    """The clients ``ids`` of a split [N, M, ...] as NumPy arrays, padded to the largest
    of them (the split as stacking only those clients would give: local training draws
    its epoch order over the padded rows, so the padding is part of the federation)."""
    ids = np.asarray(ids)
    sizes = np.asarray(split.num_examples)[ids]
    m = min(int(split.mask.shape[1]), max(1, int(sizes.max(initial=0))))
    return jax.tree.map(lambda v: np.asarray(v)[ids][:, :m] if np.ndim(v) > 1
                        else np.asarray(v)[ids], split)


def split_clients(data: FederatedData, fraction: float, seed: int
                  ) -> tuple[FederatedData, FederatedData, np.ndarray]:
    """(seen, unseen, unseen_ids): ``round(fraction x N)`` clients held out
    (``unseen_client_ids``), each client's train / test (/ validation) rows kept. The
    seen federation lists the other clients in their order; both are padded to their
    own largest client (``take_clients``). A fraction of 0 holds out nothing (an
    unseen federation of 0 clients)."""
    n = data.num_clients
    unseen_ids = unseen_client_ids(n, fraction, seed)
    seen_ids = np.setdiff1d(np.arange(n), unseen_ids)
    pick = lambda ids: FederatedData(
        train=take_clients(data.train, ids), test=take_clients(data.test, ids),
        validation=None if data.validation is None else take_clients(data.validation, ids))
    return pick(seen_ids), pick(unseen_ids), unseen_ids


class HeldOut(NamedTuple):
    """The clients a dataset held out: their federation (host arrays), their rows in
    the full federation, the seen clients' rows, the dataset's identifiers of the
    unseen clients (``info["users"]``; None when it has none), and the fraction and
    seed that chose them."""

    data: FederatedData
    client_ids: np.ndarray
    seen_ids: np.ndarray
    names: Optional[list]
    fraction: float
    seed: int

    def describe(self) -> dict:
        """The JSON record of the split (the seen dataset's ``info["unseen_clients"]``)."""
        return {"fraction": float(self.fraction), "seed": int(self.seed),
                "num_clients": int(len(self.client_ids)),
                "client_ids": [int(i) for i in self.client_ids]}


@dataclasses.dataclass(frozen=True)
class SeenDataset(Dataset):
    """A ``Dataset`` of the seen clients only, carrying the held-out ones as
    ``unseen`` (``hold_out``)."""

    unseen: Optional[HeldOut] = None


def hold_out(dataset: Dataset, fraction: float, seed: int) -> SeenDataset:
    """``dataset`` without the clients ``split_clients`` holds out, which it carries as
    ``.unseen`` (``HeldOut``). The seen dataset's padding report is its own, its
    per-client ``info`` lists (``PER_CLIENT_INFO``) keep the seen clients' entries, and
    ``info["unseen_clients"]`` records the split."""
    require_stored(dataset, "unseen_clients", "holding clients out")
    seen, unseen, unseen_ids = split_clients(dataset.host_data, fraction, seed)
    seen_ids = np.setdiff1d(np.arange(dataset.num_clients), unseen_ids)
    info = {k: v for k, v in dataset.info.items() if k != "padding"}
    names = None
    for key in PER_CLIENT_INFO:
        values = info.get(key)
        if isinstance(values, (list, tuple)) and len(values) == dataset.num_clients:
            info[key] = [values[i] for i in seen_ids]
            if key == "users":
                names = [values[i] for i in unseen_ids]
    held = HeldOut(unseen, unseen_ids, seen_ids, names, float(fraction), int(seed))
    info["unseen_clients"] = held.describe()
    built = from_padded(seen.train, seen.test, name=dataset.name,
                        num_classes=dataset.num_classes, info=info,
                        validation=seen.validation)
    return SeenDataset(**{f.name: getattr(built, f.name) for f in dataclasses.fields(Dataset)},
                       unseen=held)


# ----------------------------------------------------------------------- evaluation


def _leaf_shapes(tree) -> tuple:
    return (jax.tree.structure(tree), tuple(np.shape(x) for x in jax.tree.leaves(tree)))


def per_client_pieces(algorithm: FederatedAlgorithm, params) -> tuple[str, ...]:
    """The ``ServerState`` fields whose shapes depend on the number of clients (the
    client table; a mixing or aggregator state kept per client): the pieces a new
    federation starts fresh. Read from ``init``'s shapes for two sizes (nothing
    computed)."""
    shapes = [jax.eval_shape(lambda p, n=n: algorithm.init(p, n), params) for n in (2, 3)]
    return tuple(name for name in ServerState._fields
                 if _leaf_shapes(getattr(shapes[0], name))
                 != _leaf_shapes(getattr(shapes[1], name)))


def adaptation_state(algorithm: FederatedAlgorithm, state: ServerState,
                     num_clients: int) -> ServerState:
    """The state ``num_clients`` new clients adapt from: ``algorithm.init(state.params,
    num_clients)`` for the pieces sized by the number of clients
    (``per_client_pieces``), the trained ``state``'s for every other piece (parameters,
    server optimizer state, round counter, ...)."""
    fresh = algorithm.init(state.params, num_clients)
    fresh_fields = per_client_pieces(algorithm, state.params)
    return ServerState(**{name: getattr(fresh if name in fresh_fields else state, name)
                          for name in ServerState._fields})


def _chunk_size(algorithm: FederatedAlgorithm, n: int, chunk_size: Optional[int]) -> int:
    size = n if chunk_size is None else H.count(chunk_size, "chunk_size")
    capacity = getattr(algorithm.client_table, "capacity", None)
    return max(1, min(size, n, capacity or n))


def _one_round(algorithm: FederatedAlgorithm, fresh_fields: tuple, start: ServerState,
               train: ClientData, ids, mask, key, strategy: str) -> ServerState:
    """``start`` after one round of the clients ``ids`` (``mask``: real rows) on their
    ``train`` rows with the server update discarded: the pieces ``fresh_fields`` (the
    client table) from the round, every other piece as in ``start``."""
    cohort = Cohort(client_ids=ids, data=train, client_mask=mask,
                    local_steps=jnp.full(ids.shape, UNLIMITED_STEPS, jnp.int32))
    new_state, _ = algorithm.apply(start, cohort, key, Execution(strategy))
    return ServerState(**{name: getattr(new_state if name in fresh_fields else start, name)
                          for name in ServerState._fields})


def adapt(algorithm: FederatedAlgorithm, state: ServerState, train: ClientData,
          key) -> ServerState:
    """The state of the clients of ``train`` [n, M, ...] (new clients, row i = client i)
    after their adaptation: ``adaptation_state`` and one round of ``algorithm.apply`` on
    all of them, the server update discarded (the module docstring). Read client i's
    model with ``algorithm.personal(adapted, ids)``. ``key``: the run's key (round
    T + 1's training key is used). A personalised algorithm only."""
    if algorithm.personal is None:
        raise H.FieldError("algorithm", "evaluates its global model: a new client has "
                                        "nothing to adapt (evaluate state.params)")
    n = int(train.mask.shape[0])
    fresh_fields = per_client_pieces(algorithm, state.params)
    ids = jnp.arange(n, dtype=jnp.int32)
    run = jax.jit(functools.partial(_one_round, algorithm, fresh_fields,
                                    strategy=resolve("auto", n)[0]))
    return run(adaptation_state(algorithm, state, n), jax.device_put(train), ids,
               jnp.ones((n,), bool), round_keys(key, state.round)[1])


@functools.lru_cache(maxsize=16)
def _adapt_program(model, algorithm: FederatedAlgorithm, fresh_fields: tuple,
                   strategy: str):
    """jit of (start state, train rows [c], test rows [c], ids [c], mask [c], key) ->
    the chunk's personal test metrics after ``_one_round``."""
    evaluate = make_personal_evaluator(model, algorithm.personal)

    @jax.jit
    def program(start, train, test, ids, mask, key):
        adapted = _one_round(algorithm, fresh_fields, start, train, ids, mask, key, strategy)
        return evaluate(adapted, test, ids)

    return program


def evaluate_unseen(model, algorithm: FederatedAlgorithm, state: ServerState,
                    unseen: FederatedData, key, *, chunk_size: Optional[int] = None) -> dict:
    """Per-client test metrics {name: [N_unseen]} of the clients of ``unseen``, never
    trained on, for the trained server ``state`` (the keys of
    ``RunResult.client_metrics``: accuracy, loss, num_examples, and ece / mce when the
    model reports them): the global model for a global method, each client's personal
    model after one round of the method's client procedure for a personalised one (the
    module docstring). ``key``: the run's key (the adaptation uses round T + 1's
    training key). ``chunk_size``: clients per call (default: all; a lazy client table's
    capacity bounds it); the metrics do not depend on it."""
    n = unseen.num_clients
    if n == 0:
        raise H.FieldError("unseen", "holds no client; hold some out with split_clients("
                                     "data, fraction > 0, seed)")
    size = _chunk_size(algorithm, n, chunk_size)
    if algorithm.personal is None:
        evaluate = state_evaluator_program(model, None, algorithm.evaluated_params)
        start, run = state, lambda st, train, test, ids, mask: evaluate(st, test, ids)
    else:
        fresh_fields = per_client_pieces(algorithm, state.params)
        strategy = resolve("auto", size)[0]
        program = _adapt_program(model, algorithm, fresh_fields, strategy)
        start = adaptation_state(algorithm, state, n)
        train_key = round_keys(key, state.round)[1]
        run = lambda st, train, test, ids, mask: program(st, train, test, ids, mask,
                                                         train_key)
    parts = []
    for first in range(0, n, size):
        rows = np.minimum(np.arange(first, first + size), n - 1)  # the last chunk padded
        mask = np.arange(first, first + size) < n
        pick = lambda split: jax.device_put(jax.tree.map(lambda v: np.asarray(v)[rows], split))
        out = run(start, pick(unseen.train), pick(unseen.test), jnp.asarray(rows, jnp.int32),
                  jnp.asarray(mask))
        parts.append({k: np.asarray(v)[mask] for k, v in out.items()})
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def unseen_summary(per_client: dict, round_: int) -> dict:
    """The unseen clients' fairness summary, with the keys of the seen clients' final
    evaluation (``runner.split_summary`` on the test split: ``accuracy_mean``,
    ``accuracy_worst_10%``, ..., ``test_loss``) and its ``round``; only ``round`` when
    no unseen client has a test example."""
    from fedjax_fair.drivers.runner import split_summary
    return {"round": int(round_), **split_summary(per_client, "test")}
