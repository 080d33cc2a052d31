"""Partial-model personalisation: a model split by layer into a shared and a personal part.

FedPer, FedRep (``fedrep.py``) and LG-FedAvg (``lg_fedavg.py``) share one global part
of the network across clients (averaged by the server as in FedAvg) and keep the rest
on each client. This module holds what they have in common:

* ``LayerSplit``: which top-level layers of the parameter pytree are personal. A layer
  is a top-level module of the network: for flax variables ``{"params": {"Dense_0":
  {...}, "Dense_1": {...}}}`` the names under ``"params"`` (``"Dense_0"``, ...); for a
  plain dict of arrays its top-level keys. A layer's leaves (kernel, bias) always go
  together. ``split_layers(model, selection, field)`` resolves a selection, a tuple of
  layer names (``"Dense_1"``) and / or positions (``0``, ``-1``: Python indices into
  the layers in the order the network creates them, input side first), and refuses
  unknown names, out-of-range positions and repeats with ``ValueError("FIELD: ...")``
  before anything is compiled (the layer names are read from ``jax.eval_shape`` of
  ``model.init``).
* ``partial_training``: the client update of these methods. Client k trains from its
  personal model, the server's shared layers with its own personal layers (its row in
  the client table), in one or more phases; a phase trains every layer, only the
  personal layers or only the shared layers (the others frozen: they are constants of
  the loss, so no gradient is computed for them and they are bit-identical after it).
  It returns the new personal layers as its row, and as its delta the shared layers'
  change with the personal layers' entries set to zero: the personal layers never leave
  the client.

What the server holds: ``state.params`` is a whole model. Its shared layers are the
global model; its personal layers stay at their initial values forever (every delta is
zero there, so any server optimizer leaves them, bit for bit) and only serve as every
client's starting personal layers: ``client_state_init`` copies them into each row.
A client never sampled is therefore evaluated with the current shared layers and the
initial personal layers.

Evaluation is personal: client k's model is ``merge(state.params, row_k)`` (shared
layers of the server, personal layers of the client), evaluated on its own test rows.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from fedjax_fair.core import execution
from fedjax_fair.core.algorithm import FederatedAlgorithm, compose
from fedjax_fair.core.client import (ClientTraining, data_loss, describe_object, local_sgd,
                                     make_optimizer, round_value)
from fedjax_fair.core.mixing import prior
from fedjax_fair.models.base import Model
from fedjax_fair.core.types import Broadcast, ClientData, ClientOutput
from fedjax_fair import hparams as H

Layers = tuple  # layer names (str) and / or positions (int; negative counts from the output)

PHASES = ("all", "personal", "shared")


def _is_flax(params) -> bool:
    return isinstance(params, Mapping) and "params" in params


def layer_dict(params) -> Mapping:
    """The mapping layer name -> layer subtree: ``params["params"]`` for flax variables,
    else ``params`` itself (a dict of arrays or sub-dicts)."""
    if _is_flax(params):
        return params["params"]
    if not isinstance(params, Mapping):
        raise H.FieldError("params", f"layers are the keys of a dict of parameters, got "
                                     f"{type(params).__name__}")
    return params


def model_layers(model: Model) -> tuple[str, ...]:
    """The names of the network's layers in the order it creates them (input side
    first), read from a shape-only trace of ``model.init`` (nothing is compiled).

    The order is taken inside the trace, where flax's dict keeps creation order; the
    traced output's dict would be sorted by name (``Dense_10`` before ``Dense_2``)."""
    names = []

    def init(key):  # a fresh function each call: jax's trace cache never skips it
        params = model.init(key)
        names.append(tuple(str(k) for k in layer_dict(params).keys()))
        return params

    jax.eval_shape(init, jax.random.key(0))
    return names[-1]


def resolve_layers(layers: Sequence[str], selection, field: str) -> tuple[str, ...]:
    """The layer names picked by ``selection`` (a tuple of names and / or positions into
    ``layers``), in ``layers`` order. ValueError naming ``field`` for anything else."""
    listing = ", ".join(layers)
    if isinstance(selection, (str, int)) or not isinstance(selection, (tuple, list)):
        raise H.FieldError(field, f"must be a tuple of layer names or positions (e.g. "
                                  f"(-1,) or ('{layers[-1] if layers else 'Dense_0'}',)), got "
                                  f"{selection!r}; the model's layers are: {listing}")
    picked = []
    for item in selection:
        if isinstance(item, bool) or not isinstance(item, (str, int)):
            raise H.FieldError(field, f"entries must be layer names or integer positions, "
                                      f"got {item!r}; the model's layers are: {listing}")
        if isinstance(item, int):
            if not -len(layers) <= item < len(layers):
                raise H.FieldError(field, f"position {item} is out of range for a model with "
                                          f"{len(layers)} layers ({listing})")
            name = layers[item]
        else:
            if item not in layers:
                raise H.FieldError(field, f"unknown layer {item!r}; the model's layers are: "
                                          f"{listing}")
            name = item
        if name in picked:
            raise H.FieldError(field, f"layer {name!r} is selected twice in {selection!r}")
        picked.append(name)
    return tuple(name for name in layers if name in picked)


class LayerSplit(NamedTuple):
    """The layers of a network split into personal and shared ones (names, in the
    network's order). Every function works on any pytree shaped like the parameters
    (parameters, deltas, gradients)."""

    personal: tuple[str, ...]
    shared: tuple[str, ...]

    def _part(self, params, names):
        layers = layer_dict(params)
        sub = {name: layers[name] for name in names}
        return {"params": sub} if _is_flax(params) else sub

    def personal_part(self, params):
        """The personal layers only (a client's row): same nesting, other layers absent."""
        return self._part(params, self.personal)

    def shared_part(self, params):
        """The shared layers only."""
        return self._part(params, self.shared)

    def merge(self, params, part):
        """``params`` with the layers present in ``part`` (a ``personal_part`` or
        ``shared_part``, or () for none) taken from ``part``; other collections than
        flax's "params" come from ``params``."""
        if isinstance(part, tuple) and not part:
            return params
        layers = {**layer_dict(params), **layer_dict(part)}
        return {**params, "params": layers} if _is_flax(params) else layers

    def zero_personal(self, tree):
        """``tree`` with its personal layers set to zero (a delta the server may apply)."""
        return self.merge(tree, jax.tree.map(jnp.zeros_like, self.personal_part(tree)))


def split_layers(model: Model, selection, field: str, *,
                 selects: str = "personal") -> LayerSplit:
    """A ``LayerSplit`` of ``model`` from a selection of layers (names / positions).

    ``selects``: "personal" (the selection names the personal layers, the rest are
    shared: FedPer, FedRep) or "shared" (it names the shared layers, the rest are
    personal: LG-FedAvg's global head). Either side may be empty. Errors are
    ``ValueError("FIELD: ...")``."""
    if selects not in ("personal", "shared"):
        raise H.FieldError("selects", f"must be 'personal' or 'shared', got {selects!r}")
    layers = model_layers(model)
    picked = resolve_layers(layers, selection, field)
    rest = tuple(name for name in layers if name not in picked)
    return LayerSplit(picked, rest) if selects == "personal" else LayerSplit(rest, picked)


class Phase(NamedTuple):
    """One local training phase: ``trains`` "all" (every layer), "personal" or "shared"
    (the other layers frozen), for ``num_epochs`` epochs."""

    trains: str
    num_epochs: int


def check_training(training) -> ClientTraining:
    """``training`` if it is a valid ``ClientTraining`` (its ``check``), else TypeError /
    ``FieldError("training.F")``; the factories call it before anything is traced."""
    if not isinstance(training, ClientTraining):
        raise H.FieldTypeError("training", f"must be a ClientTraining, got "
                                           f"{describe_object(training)}")
    return training.check()


def partial_training(model: Model, split: LayerSplit, phases: Sequence[Phase], *,
                     training: ClientTraining = ClientTraining(),
                     track_loss: bool = True) -> Callable:
    """The client update of partial-model personalisation (see the module docstring).

    ``(broadcast, row, data, local_steps, key) -> (ClientOutput, new_row)`` where ``row``
    is the client's personal layers (() when there are none: the update is then
    FedAvg's ``client.local_training``, iterate for iterate).

    * start: ``params = split.merge(broadcast.params, row)``;
    * phase i runs ``client.local_sgd`` (E_i epochs of batch B = ``training.batch_size``,
      at most ``min(local_steps, training.max_steps)`` steps, each phase with the full
      step budget; ``training.num_epochs`` is not read, the phases set the epochs) on
      the layers it trains, with its own optimizer state, using the client's key for
      phase 0 and ``fold_in(key, i)`` for phase i > 0; a phase that trains an empty
      side (no personal / no shared layer) is dropped first (so FedRep without a head
      is FedAvg, key for key);
    * output: delta = ``zero_personal(broadcast.params - params)``, ``num_steps`` the
      steps of all phases, ``train_loss`` the last phase's, ``loss_before`` the loss of
      the starting personal model on the client's rows; new row =
      ``split.personal_part(params)``.

    ``training`` (``ClientTraining``, checked here): ``optimizer`` ``rate -> optax
    transformation`` (None: ``optax.sgd``) or a fixed transformation, with fresh state
    for every client every round shared by its phases; ``lr`` a number, traced scalar or
    schedule of the round; coupled ``weight_decay`` and gradient clipping ``clip_norm`` /
    ``clip_mode`` of every step (``client.local_sgd``; a phase decays and clips the
    layers it trains).
    """
    check_training(training)
    optimizer = optax.sgd if training.optimizer is None else training.optimizer
    batch_size, max_steps = training.batch_size, training.max_steps
    sgd_options = dict(weight_decay=training.weight_decay, clip_norm=training.clip_norm,
                       clip_mode=training.clip_mode)
    phases = tuple(Phase(*p) for p in phases)
    if not phases:
        raise H.FieldError("phases", "at least one local training phase is needed")
    for p in phases:
        if p.trains not in PHASES:
            raise H.FieldError("phases", f"trains must be one of {PHASES}, got {p.trains!r}")
    # A phase training an empty side is dropped; the keys count the phases that run.
    phases = tuple(p for p in phases if (p.trains != "personal" or split.personal)
                   and (p.trains != "shared" or split.shared))
    unroll = execution.local_step_unroll(model.uses_xla_conv)

    def run_phase(phase: Phase, params, opt, data, local_steps, key):
        if phase.trains == "all":
            train = local_sgd(model, batch_size=batch_size, num_epochs=phase.num_epochs,
                              max_steps=max_steps, unroll=unroll, **sgd_options)
            return train(params, opt, data, local_steps, key)
        part_of = split.personal_part if phase.trains == "personal" else split.shared_part
        # The frozen layers are constants of the loss (closed over, not trained): no
        # gradient is computed for them and they come out unchanged.
        frozen = params

        def loss(part, batch, key=None):
            return model.per_example_loss(split.merge(frozen, part), batch, key)

        train = local_sgd(model._replace(per_example_loss=loss), batch_size=batch_size,
                          num_epochs=phase.num_epochs, max_steps=max_steps, unroll=unroll,
                          **sgd_options)
        part, num_steps, train_loss = train(part_of(params), opt, data, local_steps, key)
        return split.merge(params, part), num_steps, train_loss

    def client_update(broadcast: Broadcast, row, data: ClientData, local_steps, key):
        lr = round_value(training.lr, broadcast.round)
        opt = make_optimizer(optimizer, lr)
        params = split.merge(broadcast.params, row)
        chunk = execution.loss_chunk_size_here()
        loss_before = (data_loss(model, params, data, chunk) if track_loss
                       else jnp.zeros((), jnp.float32))
        total_steps = jnp.zeros((), jnp.int32)
        train_loss = jnp.zeros((), jnp.float32)
        for i, phase in enumerate(phases):
            phase_key = key if i == 0 else jax.random.fold_in(key, i)
            params, num_steps, train_loss = run_phase(phase, params, opt, data, local_steps,
                                                      phase_key)
            total_steps = total_steps + num_steps.astype(jnp.int32)
        delta = jax.tree.map(jnp.subtract, broadcast.params, params)
        if split.personal:
            delta = split.zero_personal(delta)
        new_row = split.personal_part(params) if split.personal else row
        output = ClientOutput(delta=delta, loss_before=loss_before,
                              num_examples=data.num_examples, num_steps=total_steps,
                              extra=(), train_loss=train_loss)
        return output, new_row

    return client_update


def combined(split: LayerSplit) -> Callable:
    """``personal_params`` for ``compose``: the server's shared layers with the client's
    personal layers (its row)."""
    return lambda server_params, row: split.merge(server_params, row)


def compose_partial(model, split: LayerSplit, phases, *, training: ClientTraining,
                    client_table, weight_by_size) -> FederatedAlgorithm:
    """FedAvg on the shared layers with the personal layers as client rows (shared by
    FedPer, FedRep and LG-FedAvg). No personal layer: stateless, evaluated globally."""
    client = partial_training(model, split, phases, training=training)
    if not split.personal:
        return compose(client, mixing=prior(weight_by_size))
    return compose(client, mixing=prior(weight_by_size),
                   client_state_init=split.personal_part, client_table=client_table,
                   personal_params=combined(split))
