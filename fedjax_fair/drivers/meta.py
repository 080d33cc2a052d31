"""Meta-gradients: ``jax.grad`` of a validation objective through a whole run.

A run (init + ``simulate`` + evaluating every client) is a differentiable function
of its continuous hyper-parameters (``HParam.continuous`` in the registry: learning
rates and their per-round schedules, q, tilt, temperature, rho, ...). This module
gives that function a validation objective and a small optimiser loop::

    objective = make_objective(lambda hp: qffl(model, q=jnp.exp(hp["log_q"]), ...),
                               worst_accuracy(0.1), model=model, data=ds,
                               num_rounds=20, cohort_size=10)
    value, grads = jax.jit(jax.value_and_grad(objective))({"log_q": jnp.float32(0.0)},
                                                          ds.data)
    result = meta_optimize(objective, {"log_q": jnp.float32(0.0)}, ds.data, num_steps=20)

What is not differentiable, and the surrogate used instead (docs/meta.md):

* accuracy is an argmax, piecewise constant in the parameters: objectives use each
  client's mean probability of the true label, ``exp(-cross-entropy)`` per row
  (``ClientScores.correct_prob``);
* the worst-k% group is chosen by sorting; the objectives take the conditional
  value at risk (the mean of the worst alpha fraction, with a fractional share of
  the boundary client), differentiable wherever no two clients tie at the
  boundary, or the log-sum-exp tilt, smooth everywhere;
* client sampling and local-step counts are discrete: they are held fixed by the
  seed (one key for the run); gradients are taken at fixed cohorts and batches.

Memory: ``remat=True`` (the default) recomputes each round in the backward pass
(``simulate(..., remat=True)``: ``jax.checkpoint`` per round), so the backward pass
keeps one server state per round and one round's local steps at a time, not every
local step of the run (docs/meta.md §4).
"""
from __future__ import annotations

import time
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_fair.core import execution as _execution
from fedjax_fair.scenarios import sampling
from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.core.client import masked_mean
from fedjax_fair.drivers.sweeps import (as_federation, check_cohort, check_count, check_seeds,
                                        final_state, has_examples)
from fedjax_fair.core.types import ClientData
from fedjax_fair.hparams import FieldError, FieldTypeError

Objective = Callable[["ClientScores"], jax.Array]
SPLITS = ("validation", "test", "train")


# ------------------------------------------------------------------ client scores


class ClientScores(NamedTuple):
    """Per-client evaluation values of one model on one split, each [N].

    loss: mean cross-entropy over the client's rows (differentiable).
    correct_prob: mean probability of the true label, exp(-cross-entropy) per row:
      a smooth accuracy (differentiable).
    accuracy: argmax accuracy (zero gradient almost everywhere; for reports).
    num_examples: rows of the client; clients with 0 are left out of objectives.
    """

    loss: jax.Array
    correct_prob: jax.Array
    accuracy: jax.Array
    num_examples: jax.Array


def _client_row_scores(model, params, data: ClientData):
    """(loss, correct_prob, accuracy) of one client: masked means over its rows."""
    per_row = model.per_example_metrics(params, data.examples)
    loss = per_row["loss"]
    return (masked_mean(loss, data.mask), masked_mean(jnp.exp(-loss), data.mask),
            masked_mean(per_row["accuracy"], data.mask))


def client_scores(model, params, split: ClientData, chunk_size: int = 64) -> ClientScores:
    """``ClientScores`` of the global model ``params`` on every client of ``split``
    (``chunk_size`` clients vmapped at a time, ``lax.map`` across chunks)."""
    loss, prob, acc = jax.lax.map(lambda d: _client_row_scores(model, params, d), split,
                                  batch_size=chunk_size)
    return ClientScores(loss, prob, acc, split.num_examples)


def state_scores(model, algorithm: FederatedAlgorithm, state, split: ClientData,
                 chunk_size: int = 64) -> ClientScores:
    """``ClientScores`` of what ``algorithm`` evaluates: each client's own model
    (``personal``), ``evaluated_params(state)`` (e.g. A-FedPD's average), or
    ``state.params``, as evaluation.py does."""
    if algorithm.personal is None:
        params = (state.params if algorithm.evaluated_params is None
                  else algorithm.evaluated_params(state))
        return client_scores(model, params, split, chunk_size)

    def one(xs):
        client_id, data = xs
        params = jax.tree.map(lambda x: x[0], algorithm.personal(state, client_id[None]))
        return _client_row_scores(model, params, data)

    ids = jnp.arange(split.mask.shape[0], dtype=jnp.int32)
    loss, prob, acc = jax.lax.map(one, (ids, split), batch_size=chunk_size)
    return ClientScores(loss, prob, acc, split.num_examples)


# ------------------------------------------------------------------ reductions


def cvar(values, alpha: float, mask) -> jax.Array:
    """Conditional value at risk: the mean of the largest ``alpha`` fraction of
    ``values`` [N] over the clients with ``mask`` True, k = alpha * n clients with a
    fractional share of the boundary one (the form of "Optimization of Conditional
    Value-at-Risk"); the largest value when k < 1, the plain mean of the k largest
    when k is an integer (``metrics.worst_k`` of -values, negated). ``alpha`` in
    (0, 1], a Python number. Its gradient averages the selected values; it is
    defined wherever no two clients tie at the boundary."""
    values = jnp.asarray(values)
    n = jnp.sum(mask)
    ordered = -jnp.sort(-jnp.where(mask, values, -jnp.inf))  # descending, masked last
    position = jnp.arange(values.shape[0])
    k = jnp.maximum(alpha * n, 1.0).astype(values.dtype)
    share = jnp.clip(k - position, 0, 1).astype(values.dtype)
    return jnp.sum(share * jnp.where(position < n, ordered, 0)) / k


def tilted_mean(values, tilt: float, mask) -> jax.Array:
    """(1 / t) log((1 / n) sum_i exp(t v_i)) over the clients with ``mask`` True: the
    mean at t -> 0, the maximum as t -> inf (TERM's tilt, a smooth worst case)."""
    values = jnp.asarray(values)
    n = jnp.sum(mask).astype(values.dtype)
    scaled = jnp.where(mask, tilt * values, -jnp.inf)
    return (jax.nn.logsumexp(scaled) - jnp.log(n)) / tilt


def _mask(scores: ClientScores):
    return scores.num_examples > 0


# ------------------------------------------------------------------ objectives
# Each objective maps ClientScores to a scalar to minimise, over the clients with
# examples, every client counting once (fairness: clients, not rows).


def mean_loss(scores: ClientScores) -> jax.Array:
    """Mean validation loss over clients."""
    m = _mask(scores)
    return jnp.sum(jnp.where(m, scores.loss, 0)) / jnp.sum(m)


def cvar_loss(alpha: float = 0.1) -> Objective:
    """CVaR_alpha of the client losses: the mean loss of the worst alpha fraction."""
    _check_fraction(alpha, "alpha")
    return lambda scores: cvar(scores.loss, alpha, _mask(scores))


def tilted_loss(tilt: float = 1.0) -> Objective:
    """The log-sum-exp tilt of the client losses (TERM's objective across clients)."""
    if not isinstance(tilt, (int, float)) or isinstance(tilt, bool) or not tilt > 0:
        raise FieldError("tilt", f"must be a number > 0, got {tilt!r}")
    return lambda scores: tilted_mean(scores.loss, tilt, _mask(scores))


def worst_accuracy(fraction: float = 0.1) -> Objective:
    """Minus the smooth worst-``fraction`` accuracy: -(mean correct-label probability
    of the worst ``fraction`` of clients, CVaR form). The surrogate of
    ``metrics.worst_k(accuracy, fraction)``."""
    _check_fraction(fraction, "fraction")
    return lambda scores: cvar(-scores.correct_prob, fraction, _mask(scores))


def accuracy_std(scores: ClientScores) -> jax.Array:
    """Standard deviation over clients of the correct-label probability: the
    surrogate of the accuracy std (``metrics.std``)."""
    m = _mask(scores)
    n = jnp.sum(m)
    p = jnp.where(m, scores.correct_prob, 0)
    mean = jnp.sum(p) / n
    var = jnp.sum(jnp.where(m, jnp.square(p - mean), 0)) / n
    return jnp.sqrt(var + jnp.finfo(var.dtype).tiny)


OBJECTIVES = {
    "mean_loss": lambda: mean_loss,
    "cvar_loss": cvar_loss,
    "tilted_loss": tilted_loss,
    "worst_accuracy": worst_accuracy,
    "accuracy_std": lambda: accuracy_std,
}
"""Objective name -> factory (the arguments of the parametrised ones: alpha, tilt,
fraction)."""


def _check_fraction(value, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise FieldError(field, f"must be a number in (0, 1], got {value!r}")


# ------------------------------------------------------------------ whole runs


def per_round(values) -> Callable:
    """The schedule ``t -> values[t]`` of a per-round array [T] (held at its last
    value past T): a learnable learning-rate schedule, e.g. ``optax.sgd(per_round(
    jnp.exp(hp["log_lr"])))`` as a server optimizer, or ``client_lr=per_round(...)``."""
    values = jnp.asarray(values)
    return lambda t: values[jnp.clip(jnp.asarray(t), 0, values.shape[0] - 1)]


def make_objective(build: Callable[[dict], FederatedAlgorithm], objective: Objective, *,
                 model, data, num_rounds: int, cohort_size: int,
                 seeds: Sequence[int] = (0,), params=None, split: str = "validation",
                 sampler: Callable = sampling.uniform, execution="auto",
                 remat: bool = True, step_budgets=None) -> Callable:
    """``f(hparams, data) -> scalar``: ``objective`` of the final state's
    ``state_scores`` on ``split``, averaged over ``seeds``; differentiable in every
    traced hyper-parameter ``build`` uses. ``data`` is an argument of ``f`` (a jitted
    ``f`` then never bakes the federation into its program); the one given here is
    checked, and must have examples in ``split``.

    Seed s keys the run with ``jax.random.key(s)`` and initialises the model from it
    unless ``params`` is given (as ``sweep``). ``remat``: recompute each round in the
    backward pass (memory: a state per round plus one round's local steps, not every
    local step of the run).
    """
    data_ = as_federation(data)
    num_rounds = check_count(num_rounds, "num_rounds")
    cohort_size = check_cohort(cohort_size, data_.num_clients)
    if sampler is sampling.full and cohort_size != data_.num_clients:
        raise FieldError("cohort_size", f"the 'full' sampler needs cohort_size == "
                                      f"{data_.num_clients}, got {cohort_size}")
    seed_values = check_seeds(seeds).astype(np.uint32)
    if split not in SPLITS:
        raise FieldError("split", f"must be one of {SPLITS}, got {split!r}")
    if not has_examples(getattr(data_, split)):
        raise FieldError("split", f"the federation has no {split} example (build one with "
                                f"fedjax_fair.data.resplit(dataset, (0.8, 0.1, 0.1)))")
    if not callable(objective):
        raise FieldTypeError("objective", f"must be a callable ClientScores -> scalar, got "
                                        f"{objective!r}")
    _execution.as_execution(execution)

    def one(hparams, seed, data):
        key = jax.random.key(seed)
        p = model.init(key) if params is None else params
        algorithm = build(hparams)
        state = final_state(algorithm, p, data, key, num_rounds=num_rounds,
                          cohort_size=cohort_size, sampler=sampler, execution=execution,
                          remat=remat, step_budgets=step_budgets)
        return objective(state_scores(model, algorithm, state, getattr(data, split)))

    def f(hparams, data):
        if len(seed_values) == 1:
            return one(hparams, seed_values[0], data)
        values = jax.vmap(one, in_axes=(None, 0, None), axis_name=_execution.CLIENT_AXIS)(
            hparams, jnp.asarray(seed_values), data)
        return jnp.mean(values)

    return f


# ------------------------------------------------------------------ optimiser loop


class MetaResult(NamedTuple):
    """A meta-optimisation's trajectory.

    hparams: the hyper-parameters after the last step; initial: where it started;
    best: those with the lowest objective seen (``values.argmin()``).
    values: the objective at the hyper-parameters of each step, then at the final
      ones, [num_steps + 1]; grad_norms: the global norm of each step's gradient.
    compile_seconds / run_seconds: compiling value-and-grad; the steps.
    """

    hparams: dict
    initial: dict
    best: dict
    values: np.ndarray
    grad_norms: np.ndarray
    compile_seconds: float
    run_seconds: float


def meta_optimize(objective: Callable, hparams: dict, data, *,
                optimizer: Optional[optax.GradientTransformation] = None,
                num_steps: int = 20,
                compiler_options: Optional[dict] = None) -> MetaResult:
    """Minimises ``objective(hparams, data)`` (``make_objective``) over ``hparams`` with
    ``optimizer`` (default ``optax.adam(0.05)``) for ``num_steps`` steps, one compiled
    value-and-grad. Parametrise constrained values in ``build`` (``exp`` of a log rate,
    ``softplus`` of q) so that any step stays valid."""
    num_steps = check_count(num_steps, "num_steps")
    data = as_federation(data)
    optimizer = optimizer or optax.adam(0.05)
    hparams = jax.tree.map(jnp.asarray, hparams)
    for leaf in jax.tree.leaves(hparams):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise FieldTypeError("hparams", f"every leaf must be a float array, got {leaf.dtype}")
    value_and_grad = jax.jit(jax.value_and_grad(objective), compiler_options=compiler_options)
    t = time.perf_counter()
    compiled = value_and_grad.lower(hparams, data).compile()
    compile_s = time.perf_counter() - t

    t = time.perf_counter()
    opt_state = optimizer.init(hparams)
    current, values, norms, best, best_value = hparams, [], [], hparams, np.inf
    for _ in range(num_steps):
        value, grads = compiled(current, data)
        value = float(value)
        values.append(value)
        norms.append(float(optax.tree.norm(grads)))
        if value < best_value:
            best, best_value = current, value
        updates, opt_state = optimizer.update(grads, opt_state, current)
        current = optax.apply_updates(current, updates)
    final = float(compiled(current, data)[0])
    values.append(final)
    if final < best_value:
        best = current
    run_s = time.perf_counter() - t
    host = lambda tree: jax.tree.map(np.asarray, tree)
    return MetaResult(hparams=host(current), initial=host(hparams), best=host(best),
                    values=np.asarray(values), grad_norms=np.asarray(norms),
                    compile_seconds=compile_s, run_seconds=run_s)
