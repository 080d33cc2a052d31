"""``FederatedAlgorithm(init, apply)`` and ``compose`` (docs/architecture.md).

A federated algorithm is two pure functions and a statement of what it evaluates:

* ``init(params, num_clients) -> ServerState``
* ``apply(state, cohort, key, execution="auto") -> (state, RoundMetrics)``: one round;
  ``execution`` (a strategy name or ``execution.Execution``) says how the cohort's
  clients are mapped and never changes the result beyond float rounding.
* ``personal``: None when the global model is evaluated, else
  ``personal(state, client_ids) -> params [n, ...]``, each client's own model
  (Ditto, SuPerFed, FedRep), evaluated on that client's test rows.
* ``evaluated_params``: None when the global model evaluated is ``state.params``,
  else ``state -> params``, another model the server keeps (A-FedPD, FedDyn:
  the cohort average theta-bar, while ``state.params`` is the broadcast
  theta-bar + lambda-bar / rho).

``compose`` wires the pieces every method is made of, and every module in
``algorithms/`` is a short factory calling it, like optax's aliases:

* a client update (client.py): ``(broadcast, client_state, data, local_steps, key)
  -> (ClientOutput, new_client_state)``;
* ``broadcast(state) -> extra``: what the server sends besides theta^t and the round
  (SCAFFOLD: its control variate);
* a per-client state table (client_states.py, dense or lazy) with
  ``client_state_init(params) -> row``, and an optional ``drift`` moving the rows of
  the clients outside the cohort (A-FedPD's virtual dual update);
* a mixing rule (mixing.py) and an aggregator (aggregators.py), both given the
  round's ``ServerContext`` (parameters, round, server key, ids, mask);
* a server optimizer: any optax transformation applied to the aggregated
  pseudo-gradient (a schedule in optax's step count is a round-indexed rate).

One round, with Delta_k = theta^t - theta_k (the client's pseudo-gradient):

    b = Broadcast(theta^t, t, broadcast(state))
    (out_k, row_k) = client_update(b, table[k], data_k, ...)      for k in the cohort
    p = mixing(out, ctx)                                          # weights on the simplex
    Delta, info = aggregate(out, p, ctx)                          # e.g. sum_k p_k Delta_k
    theta^{t+1} = theta^t + server_opt(Delta)                     # optax.sgd(1.0): theta - Delta
    table <- scatter(drift(table), rows of the cohort)

Streamed rounds: when the mixing rule is separable (``MixingRule.logit``: client
k's weight from its own output) and the aggregator has a ``stream`` form, and no
``drift`` reads the outputs, the map over clients folds each client's terms of the
aggregate into running sums as it finishes (aggregators.STREAM_SUM, a log-sum-exp
fold per client, chunk and device) and stacks only its small outputs: a round never
holds the K updates [K, d] (``FederatedAlgorithm.streamed``). FedAvg, FedProx,
the FedOpt family, FedSAM, q-FFL, TERM, PropFair, FedSoftMax, FedNova's aggregation
and the personalised FedAvg-style methods stream (their personal rows are still
stacked, to be written to the table); rules that read every update or keep
per-client server tables (MGDA, DQN-Fed, AFL, AAggFF, FedMax, SCAFFOLD, the
primal-dual family) stack them. Both forms give the same round up to float rounding (tested).

Randomness: client k trains with ``fold_in(key, k)`` (cohort order never matters);
the server pieces get ``fold_in(key, SERVER_KEY_ID)``.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from fedjax_fair.core import client_states as tables
from fedjax_fair.core.sharding import on_mesh
from fedjax_fair.core.aggregators import STREAM_SUM, Aggregator, weighted_mean
from fedjax_fair.core.client import check_optimizer, data_loss, describe_object
from fedjax_fair.core.execution import as_execution, loss_chunk_size_here, map_clients
from fedjax_fair.core.mixing import MixingRule, by_num_examples, tiered_softmax
from fedjax_fair.core.types import Broadcast, ClientUpdate, Cohort, ServerContext
from fedjax_fair import hparams as H

SERVER_KEY_ID = 2 ** 31 - 1  # the server's fold_in id; client ids stay below it
TRANSFORM_KEY_ID = 2 ** 31 - 2  # the round transforms' (attacks.ATTACK_KEY_ID)


class RoundTransform(NamedTuple):
    """A change to every round of the algorithms ``compose`` builds while it is active
    (``transformed``), so that one line puts any method built over ``compose`` under
    attack, under a robust aggregator or under differential privacy:

    aggregator: ``Aggregator -> Aggregator``, replacing or wrapping the method's own
      (``robust.trimmed_mean``, ``privacy.private_aggregator``).
    data: ``(data, client_ids, mask, key) -> data``, the cohort's data before local
      training (label flipping).
    outputs: ``(outputs, client_ids, mask, key) -> (outputs, info)``, the stacked
      client outputs after local training, before the mixing rule and the aggregator
      see them (poisoned updates); ``info``'s entries join the round's metrics.

    Each gets its own key, ``fold_in(fold_in(round_key, TRANSFORM_KEY_ID), i)``."""

    aggregator: Optional[Callable] = None
    data: Optional[Callable] = None
    outputs: Optional[Callable] = None


_ACTIVE: list = []  # the transforms of the enclosing ``transformed`` blocks


class transformed:
    """``with transformed(*transforms) as t: algorithm = build(...)``: every
    ``compose`` call inside applies ``transforms`` (after any of an enclosing block) to
    the rounds it builds; ``t.composed`` counts those calls, 0 for a method whose
    rounds are not built by ``compose`` (which the transforms cannot reach). The
    algorithm keeps them after the block: it is built, not run, inside."""

    def __init__(self, *transforms: RoundTransform):
        for t in transforms:
            if not isinstance(t, RoundTransform):
                raise H.FieldTypeError("transforms", f"must be RoundTransforms, got "
                                                     f"{describe_object(t)}")
        self.transforms = transforms
        self.composed = 0

    def __enter__(self):
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return False


def _active_transforms() -> tuple:
    for block in _ACTIVE:
        block.composed += 1
    return tuple(t for block in _ACTIVE for t in block.transforms)


class ServerState(NamedTuple):
    params: Any
    opt_state: Any
    mixing_state: Any
    aggregator_state: Any
    client_states: Any  # a client table (client_states.py) or ()
    round: jax.Array  # int32 [], rounds completed


class FederatedAlgorithm(NamedTuple):
    init: Callable
    apply: Callable
    personal: Optional[Callable] = None
    client_table: Optional[tables.ClientTable] = None
    evaluated_params: Optional[Callable] = None
    client_rows: Optional[Callable] = None  # (state, client_ids) -> rows [n, ...]
    # True when a round sums the clients' updates as they finish (aggregators.Stream)
    # instead of stacking them [K, ...]
    streamed: bool = False
    # True when a round reports its own simulated duration (``server/round_seconds``):
    # asynchronous methods on a virtual clock (algorithms/fedbuff.py)
    clock: bool = False

    @property
    def evaluates(self) -> str:
        """"personal" (each client's own model) or "global" (``state.params``)."""
        return "global" if self.personal is None else "personal"


def cohort_train_loss(loss, num_examples, mask):
    """The round's ``train_loss``: the cohort's losses weighted by their training
    examples; NaN (``null`` in the logs) when the cohort has no training example, where
    a mean does not exist (not 0.0, which reads as a perfect fit)."""
    n = jnp.where(mask, num_examples, 0)
    total = jnp.sum(n)
    return jnp.where(total > 0, jnp.sum(jnp.where(mask, n * loss, 0.0))
                     / jnp.maximum(total, 1), jnp.nan)


def _check_pieces(client_update, mixing, aggregator, server_optimizer) -> None:
    """``compose``'s pieces have their types (``TypeError("FIELD: ...")`` naming the
    argument), so a string rule or an uncalled ``optax.adam`` fails here, not inside
    the first round's trace."""
    if not callable(client_update):
        raise H.FieldTypeError("client_update", f"must be a function (client.local_training(...)), "
                                                f"got {type(client_update).__name__}")
    for field, value, kind, example in (("mixing", mixing, MixingRule, "mixing.uniform()"),
                                        ("aggregator", aggregator, Aggregator,
                                         "aggregators.weighted_mean()")):
        if value is not None and not isinstance(value, kind):
            article = "an" if kind.__name__[0] in "AEIOU" else "a"
            raise H.FieldTypeError(field, f"must be None or {article} {kind.__name__} (e.g. "
                                          f"{example}), "
                                          f"got {describe_object(value)}")
    check_optimizer(server_optimizer, "server_optimizer", rate_factory=False)


def compose(client_update: ClientUpdate, *,
            mixing: Optional[MixingRule] = None,
            aggregator: Optional[Aggregator] = None,
            server_optimizer: Optional[optax.GradientTransformation] = None,
            client_state_init: Optional[Callable] = None,
            client_table="dense",
            broadcast: Optional[Callable] = None,
            drift: Optional[Callable] = None,
            personal_params: Optional[Callable] = None,
            evaluated_params: Optional[Callable] = None,
            client_state_fresh: Optional[Callable] = None,
            round_metrics: Optional[Callable] = None) -> FederatedAlgorithm:
    """Builds a FederatedAlgorithm from pieces.

    Args:
      client_update: ONE client's local training (client.local_training).
      mixing: client weights; default ``by_num_examples`` (FedAvg).
      aggregator: default ``weighted_mean``.
      server_optimizer: optax transformation on the aggregated direction; default
        ``optax.sgd(1.0)`` (theta <- theta - Delta, i.e. FedAvg).
      client_state_init: ``params -> row`` for methods with per-client state; the
        table has one row per client. None: stateless clients.
      client_table: "dense", "lazy", "lazy:CAPACITY" or a ``client_states.ClientTable``.
      broadcast: ``state -> extra``, the payload sent with theta^t; default ().
      drift: ``(state, new_params, outputs, weights, ctx) -> delta`` added to every
        client's row before the cohort's new rows are written (A-FedPD's virtual
        update); None: rows outside the cohort never change.
      personal_params: ``(server_params, row) -> params``, a client's own model from
        its row (Ditto: the row; FedRep: global body + personal head). Given, the
        algorithm is evaluated personally.
      evaluated_params: ``state -> params``, the global model to evaluate when it is
        not ``state.params`` (e.g. an average the aggregator keeps in its state).
      client_state_fresh: ``client_id -> row``, the row of a client never written
        (SuPerFed: a local model of the client's own random initialisation), drawn
        whenever such a client's row is read, so it is deterministic per client and
        costs no storage in the lazy table. None: every client starts from
        ``client_state_init(params)``. Rows that drift cannot be fresh.
      round_metrics: ``(outputs, weights, ctx) -> dict``, the method's own round
        metrics (per client [K] or scalars; FedEvg's ``client/pcd``), logged beside the
        round's own (``client_ids`` ... ``update_norm``) and the aggregator's
        ``server/...`` ones, whose names they may not take (in a streamed round
        ``outputs.delta`` is None).
    """
    _check_pieces(client_update, mixing, aggregator, server_optimizer)
    if round_metrics is not None and not callable(round_metrics):
        raise H.FieldTypeError("round_metrics", f"must be None or a function, got "
                                                f"{describe_object(round_metrics)}")
    mixing = mixing or by_num_examples()
    aggregator = aggregator or weighted_mean()
    transforms = _active_transforms()
    for t in transforms:
        if t.aggregator is not None:
            aggregator = t.aggregator(aggregator)
    data_hooks = [(i, t.data) for i, t in enumerate(transforms) if t.data is not None]
    output_hooks = [(i, t.outputs) for i, t in enumerate(transforms) if t.outputs is not None]
    server_optimizer = server_optimizer or optax.sgd(1.0)
    table = tables.get_table(client_table)
    stateful = client_state_init is not None
    if (drift is not None or personal_params is not None) and not stateful:
        raise H.FieldError("client_state_init", "drift and personal_params need per-client state")
    if client_state_fresh is not None and (drift is not None or not stateful):
        raise H.FieldError("client_state_fresh", "needs per-client state without a drift")
    if personal_params is not None and evaluated_params is not None:
        raise H.FieldError("evaluated_params", "a personalised algorithm evaluates each "
                                               "client's own model, not a global one")

    def init(params, num_clients: int) -> ServerState:
        cs = table.init(client_state_init(params), num_clients) if stateful else ()
        return ServerState(params=params, opt_state=server_optimizer.init(params),
                           mixing_state=mixing.init(num_clients),
                           aggregator_state=aggregator.init(params, num_clients),
                           client_states=cs, round=jnp.zeros((), jnp.int32))

    streamed = (getattr(mixing, "logit", None) is not None
                and getattr(aggregator, "stream", None) is not None and drift is None
                and not output_hooks)  # the hooks see the stacked outputs

    def apply(state: ServerState, cohort: Cohort, key, execution="auto"):
        k = cohort.client_ids.shape[0]
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(cohort.client_ids)
        cs = rows(state.client_states, cohort.client_ids) if stateful else ()
        payload = Broadcast(state.params, state.round,
                            broadcast(state) if broadcast is not None else ())
        ctx = ServerContext(params=state.params, round=state.round,
                            key=jax.random.fold_in(key, SERVER_KEY_ID),
                            client_ids=cohort.client_ids, client_mask=cohort.client_mask)
        transform_key = jax.random.fold_in(key, TRANSFORM_KEY_ID)
        data = cohort.data
        for i, hook in data_hooks:
            data = hook(data, cohort.client_ids, cohort.client_mask,
                        jax.random.fold_in(transform_key, i))
        per_client = (cs, data, cohort.local_steps, keys)
        transform_info = {}
        if streamed:
            (outputs, new_cs, logits, stats), (_, _, sums) = map_clients(
                streamed_client, execution, k, reduce=STREAM_SUM)(
                    (payload, ctx), (*per_client, cohort.client_mask),
                    sizes=cohort.data.num_examples)
            weights, mixing_state = tiered_softmax(*logits), state.mixing_state
            direction, agg_state, info = aggregator.stream.finish(
                state.aggregator_state, sums, outputs, stats, weights, ctx)
        else:
            run_clients = map_clients(lambda b, xs: client_update(b, *xs), execution, k)
            outputs, new_cs = run_clients(payload, per_client, sizes=cohort.data.num_examples)
            for i, hook in output_hooks:
                outputs, info = hook(outputs, cohort.client_ids, cohort.client_mask,
                                     jax.random.fold_in(transform_key, i))
                transform_info.update(info)
            with on_mesh(as_execution(execution).mesh):  # the server's solvers run replicated
                weights, mixing_state = mixing.update(state.mixing_state, outputs, ctx)
                direction, agg_state, info = aggregator.aggregate(state.aggregator_state,
                                                                  outputs, weights, ctx)
        updates, opt_state = server_optimizer.update(direction, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        client_table = state.client_states
        if stateful:
            if drift is not None:
                client_table = table.drift(client_table,
                                           drift(state, params, outputs, weights, ctx))
            client_table = table.scatter(client_table, cohort.client_ids, new_cs,
                                         cohort.client_mask, state.round)

        mask = cohort.client_mask
        metrics = {
            "client_ids": cohort.client_ids,
            "client_mask": mask,
            "weights": weights,
            "loss_before": outputs.loss_before,
            "num_steps": outputs.num_steps,
            "train_loss": cohort_train_loss(outputs.loss_before, outputs.num_examples, mask),
            "update_norm": optax.tree.norm(direction),
            **{f"server/{name}": value for name, value in info.items()},
            **transform_info,
        }
        if round_metrics is not None:
            own = round_metrics(outputs, weights, ctx)
            clash = sorted(set(own) & set(metrics))
            if clash:  # static names, known when the round is traced
                raise H.FieldError("round_metrics", f"names {clash} are the round's own")
            metrics.update(own)
        new_state = ServerState(params, opt_state, mixing_state, agg_state, client_table,
                                state.round + 1)
        return new_state, metrics

    def streamed_client(shared, xs):
        """One client's update, split into what is stacked over the cohort (its
        output without the delta, its new row, the mixing rule's (tier, logit) and the
        aggregator's stats) and its terms of the streamed sums (aggregators.Stream)."""
        payload, ctx = shared
        *per_client, in_cohort = xs
        out, row = client_update(payload, *per_client)
        tier, z = mixing.logit(out, in_cohort)
        z_term, summands, stats = aggregator.stream.term(out, z, ctx)
        return (out._replace(delta=None), row, (tier, z), stats), (tier, z_term, summands)

    def rows(client_states, client_ids):
        """The clients' rows as they see them (fresh rows for clients never written)."""
        stored = table.gather(client_states, client_ids)
        if client_state_fresh is None:
            return stored
        never = client_states.last_round[client_ids] < 0

        def one(args):  # a fresh row is drawn only for a client never written
            client_id, is_new, row = args
            draw = lambda: jax.tree.map(lambda f, r: f.astype(r.dtype),
                                        client_state_fresh(client_id), row)
            return jax.lax.cond(is_new, draw, lambda: row)

        return jax.lax.map(one, (client_ids, never, stored))

    def personal(state: ServerState, client_ids):
        return jax.vmap(personal_params, in_axes=(None, 0))(state.params,
                                                            rows(state.client_states, client_ids))

    return FederatedAlgorithm(init, apply, personal if personal_params is not None else None,
                              table if stateful else None, evaluated_params,
                              (lambda state, ids: rows(state.client_states, ids)) if stateful
                              else None, streamed)


def with_improvement(algorithm: FederatedAlgorithm, model) -> FederatedAlgorithm:
    """``algorithm`` whose rounds also log, per participant, ``loss_after`` [K] and the
    ``improved_fraction``: the share of participants whose training loss did not rise
    over the round (DQN-Fed eq. 29, "Distributed Quasi-Newton Method for Fair and Fast
    Federated Learning").

    Both losses are taken on the model the algorithm is evaluated on, over the
    participant's training rows: for a global-model algorithm the server model before
    (theta^t: ``ClientOutput.loss_before``) and after the round (theta^{t+1}; one more
    forward pass over the cohort); for a personalised one (``algorithm.personal``:
    Ditto, FedRep, SuPerFed, ...) the participant's own model before and after the
    round (two forward passes), so a partial-model method's kept layers count on both
    sides."""
    personal = algorithm.personal

    def apply(state, cohort: Cohort, key, execution="auto"):
        new_state, metrics = algorithm.apply(state, cohort, key, execution)
        k = cohort.client_ids.shape[0]
        sizes = cohort.data.num_examples

        def loss(params, data):  # in the chunks loss_before uses (padding skipped alone)
            return data_loss(model, params, data, loss_chunk_size_here())

        if personal is None:
            before = metrics["loss_before"]
            loss_after = map_clients(loss, execution, k)(new_state.params, cohort.data,
                                                         sizes=sizes)
        else:
            own_loss = map_clients(lambda _, xs: loss(*xs), execution, k)
            before = own_loss((), (personal(state, cohort.client_ids), cohort.data),
                              sizes=sizes)
            loss_after = own_loss((), (personal(new_state, cohort.client_ids), cohort.data),
                                  sizes=sizes)
        mask = cohort.client_mask
        improved = (loss_after <= before) & mask
        metrics = {**metrics, "loss_after": loss_after,
                   "improved_fraction": jnp.sum(improved) / jnp.maximum(jnp.sum(mask), 1)}
        if personal is not None:
            metrics["loss_before_personal"] = before
        return new_state, metrics

    return algorithm._replace(apply=apply)
