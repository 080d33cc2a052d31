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

Scenarios (scenarios/wrap.py: attacks, robust rules, client-level DP) are values
applied to a built method: ``scenarios.with_robust(algorithm, rule)`` calls
``algorithm.rebuild(algorithm.scenarios + (scenario,))``, which is ``compose`` again
with the same pieces and one more ``Scenario``. A scenario may change the cohort's data
before local training, the stacked uploads after it, and, through a ``Combiner``, the
combinations the aggregator declares (``Aggregator.combines``: it takes each weighted
sum of uploads through a ``combine`` argument); everything else stays the method's.
``FederatedAlgorithm.server`` records what the pieces declare they read, from which
scenarios/wrap.py decides what each scenario may do. A method made from a composed one
(a wrapped ``apply``, a flag) stays so under scenarios when made with ``derive``.

Randomness: client k trains with ``fold_in(key, k)`` (cohort order never matters);
the server pieces get ``fold_in(key, SERVER_KEY_ID)``; scenario i gets
``fold_in(fold_in(key, SCENARIO_KEY_ID), i)``.
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
from fedjax_fair.core.mixing import EXCLUDED, MixingRule, by_num_examples, tiered_softmax
from fedjax_fair.core.types import Broadcast, ClientOutput, ClientUpdate, Cohort, ServerContext
from fedjax_fair import hparams as H

SERVER_KEY_ID = 2 ** 31 - 1  # the server's fold_in id; client ids stay below it
SCENARIO_KEY_ID = 2 ** 31 - 2  # the scenarios' (attacks.ATTACK_KEY_ID)


class Combiner(NamedTuple):
    """What a scenario puts in place of a step's combinations (``Aggregator.combines``):
    ``init(params, num_clients) -> state`` and ``combine(state, index, kind, tree,
    coefficients, ctx, key) -> (tree, state, info)`` for the round's ``index``-th
    combination of ``kind`` (aggregators.UPDATE / EXTRA), ``tree`` [K, ...] with
    coefficients c [K] >= 0; ``key`` is the scenario's for the round."""

    init: Callable
    combine: Callable


class Scenario(NamedTuple):
    """A change to every round of a method (scenarios/wrap.py builds them:
    ``with_attack``, ``with_robust``, ``with_privacy``), applied by ``compose`` around
    the method's own pieces:

    name: what it is, in one line (recorded in config.json, shown when a run starts).
    data: ``(data, client_ids, mask, key) -> data``, the cohort's data before local
      training (label flipping).
    outputs: ``(outputs, client_ids, mask, key) -> (outputs, info)``, the stacked
      uploads after local training, before the mixing rule and the aggregator read
      them (poisoned updates); ``info``'s entries join the round's metrics.
    combiner: a ``Combiner`` in place of the step's combinations (robust rules, the
      private release); its state is ``ServerState.scenario_state``.

    Scenario i's keys derive from ``fold_in(fold_in(round_key, SCENARIO_KEY_ID), i)``."""

    name: str
    data: Optional[Callable] = None
    outputs: Optional[Callable] = None
    combiner: Optional[Combiner] = None


class ServerReads(NamedTuple):
    """What a composed method's server reads of its clients, as its pieces declare it
    (scenarios/wrap.py decides from it which scenarios a method accepts).

    combines: ``Aggregator.combines`` (None: no replaceable combination).
    reads: ``Aggregator.reads``: the uploads read outside the combinations.
    separable: the mixing rule gives each client a weight from its own upload alone
      (``MixingRule.logit``), keeping no state.
    """

    combines: Optional[tuple]
    reads: tuple
    separable: bool


class ServerState(NamedTuple):
    params: Any
    opt_state: Any
    mixing_state: Any
    aggregator_state: Any
    client_states: Any  # a client table (client_states.py) or ()
    round: jax.Array  # int32 [], rounds completed
    scenario_state: Any = ()  # the combiner's of a scenario that has one (privacy's clip)


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
    # what the server reads of its clients (None: not built by ``compose``, which no
    # scenario can reach)
    server: Optional[ServerReads] = None
    scenarios: tuple = ()  # the Scenarios applied, in order
    # scenarios -> the same method with those scenarios (None: not built by compose)
    rebuild: Optional[Callable] = None
    name: str = "the method"  # the registry's name, for messages (registry.build)

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
            round_metrics: Optional[Callable] = None,
            scenarios: tuple = (),
            cohort_loss: Optional[Callable] = None) -> FederatedAlgorithm:
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
      drift: ``(state, new_state) -> delta`` added to every client's row before the
        cohort's new rows are written, from the server's state before and after the
        round (A-FedPD's virtual update); it reads no upload, so a scenario's
        combination reaches it through the aggregator's state. None: rows outside
        the cohort never change.
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
      scenarios: ``Scenario`` values, applied in order (scenarios/wrap.py applies them
        to a built method: ``with_robust(algorithm, rule)``, ...).
      cohort_loss: ``(params, data) -> loss``, one client's ``loss_before`` as its
        ``client_update`` computes it (``client.loss_before_fn``). Given, with a mixing
        rule that reads only the losses (``MixingRule.losses_only``: AAggFF) and an
        aggregator that streams, a round takes two passes: every client's loss first,
        the weights from them, then the updates summed with those weights as they
        finish (never stacked [K, ...]); the client's outputs carry the first pass's
        loss, so its own ``loss_before`` is never computed (XLA drops the unused pass).
    """
    _check_pieces(client_update, mixing, aggregator, server_optimizer)
    if round_metrics is not None and not callable(round_metrics):
        raise H.FieldTypeError("round_metrics", f"must be None or a function, got "
                                                f"{describe_object(round_metrics)}")
    mixing = mixing or by_num_examples()
    aggregator = aggregator or weighted_mean()
    scenarios = tuple(scenarios)
    data_hooks = [(i, t.data) for i, t in enumerate(scenarios) if t.data is not None]
    output_hooks = [(i, t.outputs) for i, t in enumerate(scenarios) if t.outputs is not None]
    combiners = [(i, t.combiner) for i, t in enumerate(scenarios) if t.combiner is not None]
    if len(combiners) > 1 or (combiners and aggregator.combines is None):
        raise H.FieldError("scenarios", "at most one scenario replaces the combination, of "
                                        "an aggregator that declares one")
    combiner = combiners[0] if combiners else None
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
                           client_states=cs, round=jnp.zeros((), jnp.int32),
                           scenario_state=(combiner[1].init(params, num_clients)
                                           if combiner else ()))

    two_pass = cohort_loss is not None and getattr(mixing, "losses_only", False)
    streamed = ((getattr(mixing, "logit", None) is not None or two_pass)
                and getattr(aggregator, "stream", None) is not None and drift is None
                and not output_hooks and combiner is None)  # scenarios see the stack
    two_pass = two_pass and streamed

    def apply(state: ServerState, cohort: Cohort, key, execution="auto"):
        k = cohort.client_ids.shape[0]
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(cohort.client_ids)
        cs = rows(state.client_states, cohort.client_ids) if stateful else ()
        payload = Broadcast(state.params, state.round,
                            broadcast(state) if broadcast is not None else ())
        ctx = ServerContext(params=state.params, round=state.round,
                            key=jax.random.fold_in(key, SERVER_KEY_ID),
                            client_ids=cohort.client_ids, client_mask=cohort.client_mask)
        scenario_key = jax.random.fold_in(key, SCENARIO_KEY_ID)
        data = cohort.data
        for i, hook in data_hooks:
            data = hook(data, cohort.client_ids, cohort.client_mask,
                        jax.random.fold_in(scenario_key, i))
        per_client = (cs, data, cohort.local_steps, keys)
        scenario_info, scenario_state = {}, state.scenario_state
        if streamed:
            if two_pass:  # the weights from every client's loss, before training
                losses = map_clients(lambda b, d: cohort_loss(b.params, d), execution, k)(
                    payload, data, sizes=cohort.data.num_examples)
                with on_mesh(as_execution(execution).mesh):  # the server's rule, replicated
                    weights, mixing_state = mixing.update(
                        state.mixing_state, _losses_output(losses, cohort.data.num_examples),
                        ctx)
                given = (weights, losses)
            else:
                none = jnp.zeros((k,), jnp.float32)
                given, mixing_state = (none, none), state.mixing_state
            (outputs, new_cs, logits, stats), (_, _, sums) = map_clients(
                streamed_client, execution, k, reduce=STREAM_SUM)(
                    (payload, ctx), (*per_client, cohort.client_mask, given),
                    sizes=cohort.data.num_examples)
            if not two_pass:
                weights = tiered_softmax(*logits)
            direction, agg_state, info = aggregator.stream.finish(
                state.aggregator_state, sums, outputs, stats, weights, ctx)
        else:
            run_clients = map_clients(lambda b, xs: client_update(b, *xs), execution, k)
            outputs, new_cs = run_clients(payload, per_client, sizes=cohort.data.num_examples)
            for i, hook in output_hooks:
                outputs, info = hook(outputs, cohort.client_ids, cohort.client_mask,
                                     jax.random.fold_in(scenario_key, i))
                scenario_info.update(info)
            with on_mesh(as_execution(execution).mesh):  # the server's solvers run replicated
                weights, mixing_state = mixing.update(state.mixing_state, outputs, ctx)
                if combiner is None:
                    direction, agg_state, info = aggregator.aggregate(
                        state.aggregator_state, outputs, weights, ctx)
                else:
                    combine, combined = _threaded(combiner[1], state.scenario_state, ctx,
                                                  jax.random.fold_in(scenario_key, combiner[0]))
                    direction, agg_state, info = aggregator.aggregate(
                        state.aggregator_state, outputs, weights, ctx, combine)
                    scenario_state, combine_info = combined()
                    scenario_info.update(combine_info)
        updates, opt_state = server_optimizer.update(direction, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new_state = ServerState(params, opt_state, mixing_state, agg_state,
                                state.client_states, state.round + 1, scenario_state)
        client_table = state.client_states
        if stateful:
            if drift is not None:
                client_table = table.drift(client_table, drift(state, new_state))
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
            **scenario_info,
        }
        if round_metrics is not None:
            own = round_metrics(outputs, weights, ctx)
            clash = sorted(set(own) & set(metrics))
            if clash:  # static names, known when the round is traced
                raise H.FieldError("round_metrics", f"names {clash} are the round's own")
            metrics.update(own)
        return new_state._replace(client_states=client_table), metrics

    def streamed_client(shared, xs):
        """One client's update, split into what is stacked over the cohort (its
        output without the delta, its new row, the mixing rule's (tier, logit) and the
        aggregator's stats) and its terms of the streamed sums (aggregators.Stream)."""
        payload, ctx = shared
        *per_client, in_cohort, (weight, loss) = xs
        out, row = client_update(payload, *per_client)
        if two_pass:  # the weight known before training, as a logit of one tier
            # the loss the weight came from: the client's own forward pass of the same
            # loss is then unused, and XLA drops it (one forward pass a client, not two)
            out = out._replace(loss_before=loss)
            tier = jnp.where(in_cohort & (weight > 0), 0, EXCLUDED)
            z = jnp.log(jnp.where(weight > 0, weight, 1.0))
        else:
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

    def rebuild(new_scenarios):
        return compose(client_update, mixing=mixing, aggregator=aggregator,
                       server_optimizer=server_optimizer, client_state_init=client_state_init,
                       client_table=client_table, broadcast=broadcast, drift=drift,
                       personal_params=personal_params, evaluated_params=evaluated_params,
                       client_state_fresh=client_state_fresh, round_metrics=round_metrics,
                       scenarios=new_scenarios, cohort_loss=cohort_loss)

    return FederatedAlgorithm(init, apply, personal if personal_params is not None else None,
                              table if stateful else None, evaluated_params,
                              (lambda state, ids: rows(state.client_states, ids)) if stateful
                              else None, streamed,
                              server=ServerReads(aggregator.combines, aggregator.reads,
                                                 mixing.logit is not None),
                              scenarios=scenarios, rebuild=rebuild)


def _losses_output(losses, num_examples) -> ClientOutput:
    """The cohort's outputs as a rule that reads only ``loss_before`` sees them before
    training (``MixingRule.losses_only``): the losses, the sizes, nothing else."""
    zeros = jnp.zeros_like(losses)
    return ClientOutput(delta=(), loss_before=losses, num_examples=num_examples,
                        num_steps=zeros.astype(jnp.int32), extra=(), train_loss=zeros)


def _threaded(combiner: Combiner, state, ctx, key):
    """(combine, combined): ``combine(kind, tree, coefficients)`` for an aggregator,
    calling ``combiner`` with the round's i-th call and threading its state through
    the calls; ``combined()`` -> (the state after them, their info: the first call's
    names as the combiner gives them, the i-th's with a ``_i`` suffix)."""
    calls = {"state": state, "info": {}, "count": 0}

    def combine(kind, tree, coefficients):
        i = calls["count"]
        out, calls["state"], info = combiner.combine(calls["state"], i, kind, tree,
                                                     coefficients, ctx, key)
        calls["info"].update({k + (f"_{i}" if i else ""): v
                              for k, v in info.items()})
        calls["count"] = i + 1
        return out

    return combine, lambda: (calls["state"], calls["info"])


def derive(algorithm: FederatedAlgorithm, change: Callable) -> FederatedAlgorithm:
    """``change(algorithm)``, a method made from another (a wrapped ``apply``, a flag),
    that stays made so when scenarios rebuild it (``FederatedAlgorithm.rebuild``)."""
    out = change(algorithm)
    rebuild = algorithm.rebuild
    if rebuild is None:
        return out
    return out._replace(rebuild=lambda scenarios: derive(rebuild(scenarios), change))


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
    sides. Kept when scenarios are applied afterwards (``derive``)."""
    return derive(algorithm, lambda alg: _logging_improvement(alg, model))


def _logging_improvement(algorithm: FederatedAlgorithm, model) -> FederatedAlgorithm:
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
