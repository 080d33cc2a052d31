"""Core types of fedjax_fair (docs/architecture.md).

Everything that crosses a jit boundary is a NamedTuple of arrays, so it is a pytree
with fixed shapes: no dicts keyed by client id, no Python lists of clients.

Shapes use ``N`` for the number of clients in the federation, ``K`` for the cohort
size, ``M`` for the padded number of examples per client and ``d`` for parameters.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Protocol

import jax

Array = jax.Array
PRNGKey = jax.Array
Params = Any  # a pytree of arrays
PyTree = Any


class ClientData(NamedTuple):
    """One client's examples, real rows first, then zero padding.

    examples: dict name -> array [M, ...] (``"x"`` inputs and ``"y"`` integer labels
      for the built-in datasets).
    mask: bool [M], True on real rows.
    num_examples: int32 [], the number of real rows (= mask.sum()).

    With a leading client axis ([N, M, ...], mask [N, M], num_examples [N]) the same
    type holds a whole federation's split.
    """

    examples: dict
    mask: Array
    num_examples: Array


class FederatedData(NamedTuple):
    """Stacked, padded train and test splits of every client ([N, M, ...]), and an
    optional validation split (each split padded to its own M)."""

    train: ClientData
    test: ClientData
    validation: Optional[ClientData] = None

    @property
    def num_clients(self) -> int:
        return int(self.train.mask.shape[0])


class Cohort(NamedTuple):
    """The clients taking part in one round.

    client_ids: int32 [K] rows of the federation.
    data: ClientData [K, M, ...] gathered at client_ids.
    client_mask: bool [K]; False rows are ignored by aggregation (padding cohorts).
    local_steps: int32 [K] step budget of each client (computational heterogeneity);
      the effective number of steps is min(budget, epochs * ceil(n_k / B)).
    """

    client_ids: Array
    data: ClientData
    client_mask: Array
    local_steps: Array


class ClientOutput(NamedTuple):
    """What one client sends back.

    delta: the upload the aggregator combines: server_params - local_params (a
      pseudo-gradient pytree), or what a method sends instead of parameters
      (FedEvg's energy gradients at the synthetic samples, ``fedevg.Upload``).
    loss_before: [] masked mean training loss of the server model on this client.
    num_examples: [] number of real training examples.
    num_steps: [] local steps actually taken.
    extra: the method's own per-client outputs, a fixed-shape pytree it declares
      (SCAFFOLD's control-variate change, DQN-Fed's gradient and decrement, ...);
      () for plain local training.
    train_loss: [] mean per-example training loss over the client's last local epoch,
      accumulated while training (the loss statistic of the computational-
      heterogeneity code; 0 for a client that took no step).
    """

    delta: Params
    loss_before: Array
    num_examples: Array
    num_steps: Array
    extra: PyTree = ()
    train_loss: Array = 0.0


class Broadcast(NamedTuple):
    """What the server sends to every client of a round.

    params: theta^t, the model clients start from (and their deltas refer to).
    round: int32 [] t, rounds completed: drives round-indexed schedules
      (e.g. a client learning rate 0.1 * 0.99^t).
    extra: the method's payload, chosen by ``compose(broadcast=...)``: () by default,
      SCAFFOLD's server control variate c, FedEvg's synthetic samples, ...
    """

    params: Params
    round: Array
    extra: PyTree = ()


class ServerContext(NamedTuple):
    """What every server piece (mixing rule, aggregator, drift) sees of a round.

    params: theta^t, the server parameters before this round's step.
    round: int32 [] t.
    key: the round's server key (independent of every client's key).
    client_ids: int32 [K]; client_mask: bool [K] (False rows are padding).

    Pieces that need the federation size N get it at ``init(..., num_clients)`` and
    keep what they need in their state.
    """

    params: Params
    round: Array
    key: PRNGKey
    client_ids: Array
    client_mask: Array


class ClientUpdate(Protocol):
    """Local training of ONE client; an execution strategy maps it over a cohort.

    Returns the client's output and its new state row (returned unchanged by
    stateless clients)."""

    def __call__(self, broadcast: Broadcast, client_state: PyTree, data: ClientData,
                 local_steps: Array, key: PRNGKey) -> tuple[ClientOutput, PyTree]:
        ...


RoundMetrics = dict  # flat dict name -> fixed-shape array
Sampler = Callable[[PRNGKey, int, int], Array]
