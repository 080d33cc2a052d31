"""The pure simulation core: a ``lax.scan`` over rounds (docs/architecture.md).

* ``simulate``: pure and jittable. Runs ``num_rounds`` rounds of an algorithm as
  one ``lax.scan``; the data is an argument (never closed over), so the same
  compiled program serves any federation of the same shapes. Whole runs can be
  ``jax.vmap``-ed over seeds or hyper-parameters and differentiated with
  ``jax.grad`` (set ``remat=True`` to recompute each round in the backward pass).
* ``simulate_cohorts``: the same rounds over cohorts gathered beforehand (a
  ``Cohort`` with a leading round axis), for federations kept in host memory.

The runner around it (memory plan, placement, evaluation, checkpoints, the NaN
guard, progress) is ``fedjax_fair.drivers.runner.run``.

Randomness: the key of round r is ``fold_in(key, r)`` (r counted from the start of
the run, so resuming from a checkpoint reproduces the uninterrupted run); it is
split into a sampling key and a training key, and client k trains with
``fold_in(training_key, k)`` (algorithm.py), so cohort order never matters.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair.core import sharding
from fedjax_fair.scenarios import sampling
from fedjax_fair.core.memory import tree_bytes
from fedjax_fair.scenarios.system import System, plan_round
from fedjax_fair.core.algorithm import FederatedAlgorithm, ServerState
from fedjax_fair.core.client_states import gather
from fedjax_fair.core.execution import as_execution
from fedjax_fair.core.generated import is_generated
from fedjax_fair.scenarios.heterogeneity import UNLIMITED_STEPS, StepBudgets, budget_table
from fedjax_fair.core.types import ClientData, Cohort, FederatedData
from fedjax_fair import hparams as H


def make_cohort(data: FederatedData, client_ids, step_budgets=None, mesh=None) -> Cohort:
    """Gathers the cohort's training rows (a generated federation's are computed here,
    inside the round); ``step_budgets`` is an int32 table [N].

    ``mesh``: when the federation's N splits over the mesh's ``clients`` axis, each
    device receives only its share of the cohort's rows (``sharding.gather_clients``)."""
    k = client_ids.shape[0]
    budgets = (jnp.full((k,), UNLIMITED_STEPS, jnp.int32) if step_budgets is None
               else step_budgets[client_ids])
    if is_generated(data.train):
        rows = data.train.take(client_ids)
    elif mesh is not None and data.num_clients % sharding.num_shards(mesh) == 0:
        rows = sharding.gather_clients(data.train, client_ids, mesh)
    else:
        rows = gather(data.train, client_ids)
    return Cohort(client_ids=client_ids, data=rows, client_mask=jnp.ones((k,), bool),
                  local_steps=budgets)


def server_state_finite(state: ServerState) -> jax.Array:
    """Whether every float of the server's own state is finite: the parameters, the
    optimizer, mixing, aggregator and scenario states (FedEvg's synthetic set, FedCVAE's
    generator, DQN-Fed's history, an adaptive DP clip). The per-client table is left out: a pass over N
    rows every round would cost as much as the round for the table-bound methods, and
    a non-finite row reaches the parameters the next time its client trains."""
    leaves = [x for x in jax.tree.leaves((state.params, state.opt_state, state.mixing_state,
                                          state.aggregator_state, state.scenario_state))
              if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if not leaves:
        return jnp.asarray(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def round_keys(key, round_):
    """(sampling key, training key) of round ``round_``."""
    return jax.random.split(jax.random.fold_in(key, round_))


def _play(algorithm: FederatedAlgorithm, state: ServerState, cohort: Cohort, train_key,
          execution):
    """One round; under a mesh the new state keeps the sharded layout (client table
    split by client, the rest replicated) from round to round."""
    new_state, metrics = algorithm.apply(state, cohort, train_key, execution)
    new_state = sharding.constrain_state(new_state, as_execution(execution).mesh)
    metrics["finite"] = server_state_finite(new_state)
    return new_state, metrics


def _budget_key(sample_key):
    return jax.random.fold_in(sample_key, 1)


def budget_tables(step_budgets: StepBudgets, key, first_round: int, num_rounds: int,
                  num_examples) -> np.ndarray:
    """The budget tables ``simulate`` draws in rounds first_round.., [R, N]."""
    rounds = first_round + jnp.arange(num_rounds)
    draw = jax.jit(jax.vmap(lambda r: step_budgets.draw(
        _budget_key(round_keys(key, r)[0]), num_examples)))
    return np.asarray(draw(rounds))


def _plan(system: System, key, round_, num_examples, *, sampler: Callable, num_clients: int,
          cohort_size: int, step_budgets, model_bytes: int):
    """``system.plan_round`` of round ``round_``, with the round's budget table drawn as
    ``simulate`` draws it: (client_ids, client_mask, local_steps, metrics)."""
    sample_key = round_keys(key, round_)[0]
    budgets = budget_table(step_budgets, _budget_key(sample_key), num_examples)
    return plan_round(system, key, round_, sample_key, sampler=sampler,
                      num_clients=num_clients, cohort_size=cohort_size,
                      num_examples=num_examples, budgets=budgets, model_bytes=model_bytes)


def make_round_cohort(data: FederatedData, key, round_, *, sampler: Callable,
                      cohort_size: int, step_budgets=None, system: Optional[System] = None,
                      params=None, mesh=None):
    """(this round's cohort, the system's round metrics): the sampled clients with their
    budgets; under a ``system`` (scenarios/system.py) sampled among the available clients,
    masked where they did not report, their budgets cut by the clock's deadline."""
    num_clients = data.train.mask.shape[0]
    if system is None:
        sample_key = round_keys(key, round_)[0]
        budgets = budget_table(step_budgets, _budget_key(sample_key), data.train.num_examples)
        client_ids = sampler(sample_key, num_clients, cohort_size)
        return make_cohort(data, client_ids, budgets, mesh), {}
    ids, mask, steps, metrics = _plan(
        system, key, round_, data.train.num_examples, sampler=sampler,
        num_clients=num_clients, cohort_size=cohort_size, step_budgets=step_budgets,
        model_bytes=tree_bytes(params))
    cohort = make_cohort(data, ids, None, mesh)
    return cohort._replace(client_mask=mask, local_steps=steps), metrics


def simulate(algorithm: FederatedAlgorithm, state: ServerState, data: FederatedData, key,
             *, num_rounds: int, cohort_size: int, sampler: Callable = sampling.uniform,
             step_budgets=None, remat: bool = False, execution="auto", active_rounds=None,
             system: Optional[System] = None):
    """Runs ``num_rounds`` rounds; returns (state, metrics with leading axis num_rounds).

    ``step_budgets``: each client's local-step budget (computational heterogeneity):
    an int32 table [N] fixed for the run, or a ``heterogeneity.StepBudgets`` drawn
    afresh every round; None lets the epoch count decide. ``execution``: how each
    round maps its clients (a strategy name or ``execution.Execution``).
    ``active_rounds``: None, or an int32 scalar (traced: one program serves every
    value) n <= ``num_rounds``: only the first n rounds run, the others leave the
    state as it is and log zeros (the runner's one chunk program for chunks of any
    length). ``system``: participation and system heterogeneity (scenarios/system.py:
    availability, dropouts, a virtual clock), checked by the caller
    (``System.check``); its round metrics (``system/...``) join the round's.
    """
    def round_fn(state, _):
        train_key = round_keys(key, state.round)[1]
        cohort, system_metrics = make_round_cohort(
            data, key, state.round, sampler=sampler, cohort_size=cohort_size,
            step_budgets=step_budgets, system=system, params=state.params,
            mesh=as_execution(execution).mesh)
        new_state, metrics = _play(algorithm, state, cohort, train_key, execution)
        return new_state, {**metrics, **system_metrics}

    if remat:
        round_fn = jax.checkpoint(round_fn)
    if active_rounds is None:
        return jax.lax.scan(round_fn, state, None, length=num_rounds)
    return jax.lax.scan(_only_while(round_fn, active_rounds), state,
                        jnp.arange(num_rounds, dtype=jnp.int32))


def _only_while(round_fn: Callable, active_rounds) -> Callable:
    """``round_fn`` for scan step i < ``active_rounds``; later steps keep the state and
    log zeros of the round's metrics."""
    traced = []  # the metrics' shapes, from the round's own trace (lax.cond traces the
    # true branch first; else the skip branch traces the round once more for them)

    def play(state, _):
        new_state, metrics = round_fn(state, None)
        traced.append(jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), metrics))
        return new_state, metrics

    def skip(state, _):
        metrics = traced[-1] if traced else jax.eval_shape(round_fn, state, None)[1]
        return state, jax.tree.map(lambda m: jnp.zeros(m.shape, m.dtype), metrics)

    def step(state, i):
        return jax.lax.cond(i < active_rounds, play, skip, state, None)

    return step


def simulate_cohorts(algorithm: FederatedAlgorithm, state: ServerState, cohorts: Cohort, key,
                     *, remat: bool = False, execution="auto"):
    """One round per cohort of ``cohorts`` (leaves with a leading round axis R).

    With cohorts from ``sample_client_ids`` + ``gather_cohorts`` this is the same
    computation as ``simulate`` (the same keys and clients), up to float rounding
    when the cohorts are padded to a smaller size.
    """
    def round_fn(state, cohort):
        return _play(algorithm, state, cohort, round_keys(key, state.round)[1], execution)

    if remat:
        round_fn = jax.checkpoint(round_fn)
    return jax.lax.scan(round_fn, state, cohorts)


def sample_client_ids(key, first_round: int, num_rounds: int, num_clients: int,
                      cohort_size: int, sampler: Callable = sampling.uniform) -> np.ndarray:
    """The cohorts ``simulate`` draws in rounds first_round .. first_round+R-1, [R, K]."""
    ids = _cohort_sampler(sampler, num_clients, cohort_size)
    return np.asarray(ids(key, first_round + jnp.arange(num_rounds)))


@functools.lru_cache(maxsize=16)
def _cohort_sampler(sampler: Callable, num_clients: int, cohort_size: int) -> Callable:
    return jax.jit(jax.vmap(lambda key, r: sampler(round_keys(key, r)[0], num_clients,
                                                   cohort_size), in_axes=(None, 0)))


def plan_rounds(system: System, key, first_round: int, num_rounds: int, num_examples, *,
                cohort_size: int, sampler: Callable = sampling.uniform, step_budgets=None,
                model_bytes: int = 0):
    """Host side: what ``simulate`` plans under ``system`` in rounds first_round.. as
    NumPy arrays: (client_ids [R, K], client_mask [R, K], local_steps [R, K], the
    system's round metrics {name: [R, ...]}), for cohorts gathered on the host."""
    drawn = step_budgets if isinstance(step_budgets, StepBudgets) else None
    plan = _round_planner(system, sampler, len(num_examples), cohort_size, drawn,
                          model_bytes)
    table = None if drawn is not None or step_budgets is None else jnp.asarray(step_budgets)
    return jax.device_get(plan(key, first_round + jnp.arange(num_rounds, dtype=jnp.int32),
                               jnp.asarray(num_examples), table))


@functools.lru_cache(maxsize=16)
def _round_planner(system: System, sampler: Callable, num_clients: int, cohort_size: int,
                   drawn, model_bytes: int) -> Callable:
    def one(key, round_, num_examples, table):
        return _plan(system, key, round_, num_examples, sampler=sampler,
                     num_clients=num_clients, cohort_size=cohort_size,
                     step_budgets=drawn if drawn is not None else table,
                     model_bytes=model_bytes)

    return jax.jit(jax.vmap(one, in_axes=(None, 0, None, None)))


def gather_cohorts(train: ClientData, client_ids: np.ndarray, step_budgets=None,
                   padded_size: Optional[int] = None) -> Cohort:
    """Host-side ``make_cohort`` for R rounds: a NumPy Cohort [R, K, padded_size, ...].

    ``padded_size`` (default: the split's M) must hold the largest sampled client;
    rows past it are padding, so dropping them loses nothing. ``step_budgets``: an
    int32 table [N], or one table per round [R, N] (``budget_tables``).
    """
    sizes = np.asarray(train.num_examples)
    m = padded_size or train.mask.shape[1]
    if sizes[client_ids].max(initial=0) > m:
        raise H.FieldError("padded_size", f"{m} is smaller than the largest sampled client "
                                          f"({sizes[client_ids].max()})")
    data = jax.tree.map(lambda v: np.asarray(v)[:, :m][client_ids] if np.ndim(v) > 1
                        else np.asarray(v)[client_ids], train)
    tables = None if step_budgets is None else np.asarray(step_budgets, np.int32)
    budgets = (np.full(client_ids.shape, UNLIMITED_STEPS, np.int32) if tables is None
               else tables[client_ids] if tables.ndim == 1
               else np.take_along_axis(tables, client_ids, axis=1))
    return Cohort(client_ids=client_ids.astype(np.int32), data=data,
                  client_mask=np.ones(client_ids.shape, bool), local_steps=budgets)
