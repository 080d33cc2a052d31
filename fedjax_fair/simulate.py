"""The driver: a ``lax.scan`` over rounds, and a chunked runner around it (DESIGN.md §6).

* ``simulate``: pure and jittable. Runs ``num_rounds`` rounds of an algorithm as
  one ``lax.scan``; the data is an argument (never closed over), so the same
  compiled program serves any federation of the same shapes. Whole runs can be
  ``jax.vmap``-ed over seeds or hyper-parameters and differentiated with
  ``jax.grad`` (set ``remat=True`` to recompute each round in the backward pass).
* ``run``: a Python loop over chunks of ``eval_every`` rounds: one compiled
  ``simulate`` per chunk length, evaluation of all clients between chunks, a
  progress bar, checkpoints, stop-on-NaN, and resume.

Randomness: the key of round r is ``fold_in(key, r)`` (r counted from the start of
the run, so resuming from a checkpoint reproduces the uninterrupted run); it is
split into a sampling key and a training key, and client k trains with
``fold_in(training_key, k)`` (algorithm.py), so cohort order never matters.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair import checkpoint as ckpt
from fedjax_fair import metrics as fairness
from fedjax_fair import sampling
from fedjax_fair.algorithm import FederatedAlgorithm, ServerState
from fedjax_fair.client_states import gather
from fedjax_fair.evaluation import make_evaluator, to_numpy
from fedjax_fair.types import Cohort, FederatedData

UNLIMITED_STEPS = 2 ** 30


def make_cohort(data: FederatedData, client_ids, step_budgets=None) -> Cohort:
    """Gathers the cohort's training rows; ``step_budgets`` is an int32 table [N]."""
    k = client_ids.shape[0]
    budgets = (jnp.full((k,), UNLIMITED_STEPS, jnp.int32) if step_budgets is None
               else step_budgets[client_ids])
    return Cohort(client_ids=client_ids, data=gather(data.train, client_ids),
                  client_mask=jnp.ones((k,), bool), local_steps=budgets)


def params_finite(params) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)]))


def simulate(algorithm: FederatedAlgorithm, state: ServerState, data: FederatedData, key,
             *, num_rounds: int, cohort_size: int, sampler: Callable = sampling.uniform,
             step_budgets=None, remat: bool = False):
    """Runs ``num_rounds`` rounds; returns (state, metrics with leading axis num_rounds).

    ``step_budgets`` (int32 [N], optional): each client's local-step budget
    (computational heterogeneity); None lets the epoch count decide.
    """
    num_clients = data.train.mask.shape[0]

    def round_fn(state, _):
        sample_key, train_key = jax.random.split(jax.random.fold_in(key, state.round))
        client_ids = sampler(sample_key, num_clients, cohort_size)
        cohort = make_cohort(data, client_ids, step_budgets)
        new_state, metrics = algorithm.apply(state, cohort, train_key)
        metrics["finite"] = params_finite(new_state.params)
        return new_state, metrics

    if remat:
        round_fn = jax.checkpoint(round_fn)
    return jax.lax.scan(round_fn, state, None, length=num_rounds)


class NonFiniteError(FloatingPointError):
    """A run produced NaN/inf. ``round`` is the first bad round (1-based count of
    rounds completed when it appeared); ``last_good_state`` is the state kept."""

    def __init__(self, round_: int, last_good_round: int, last_good_state, where: str):
        super().__init__(f"non-finite parameters at round {round_}; stopped. Last good state: "
                         f"round {last_good_round}{where}")
        self.round = round_
        self.last_good_round = last_good_round
        self.last_good_state = last_good_state


@dataclasses.dataclass
class RunResult:
    state: ServerState
    history: list  # one dict per evaluation: round, summary metrics, timings
    client_metrics: dict  # final per-client test metrics, numpy arrays [N]
    round_metrics: dict  # per-round scalars, numpy arrays [R]
    compile_seconds: float
    run_seconds: float


def run(algorithm: FederatedAlgorithm, params, data: FederatedData, key, *, model,
        num_rounds: int, cohort_size: int, eval_every: int = 10,
        sampler: Callable = sampling.uniform, step_budgets=None,
        checkpoint_dir: Optional[str] = None, resume: bool = False, progress: bool = True,
        on_eval: Optional[Callable[[dict], None]] = None, description: str = "") -> RunResult:
    """Runs a whole simulation in chunks of ``eval_every`` rounds.

    After every chunk all clients are evaluated on their test split and the
    fairness summary is appended to ``history`` (and passed to ``on_eval``). With
    ``checkpoint_dir`` the state is saved after every chunk; ``resume=True``
    continues from it and gives the same result as an uninterrupted run. If the
    parameters become NaN/inf, ``NonFiniteError`` is raised with the round number;
    the last good state stays in the checkpoint (and on the exception).

    Compiles ``simulate`` once per distinct chunk length (one, plus one for a
    shorter final chunk when ``eval_every`` does not divide ``num_rounds``).
    """
    num_clients = data.num_clients
    state = algorithm.init(params, num_clients)
    history: list = []
    round_log: dict = {}
    compile_s = run_s = 0.0
    if resume:
        if checkpoint_dir is None or not ckpt.exists(checkpoint_dir):
            raise FileNotFoundError(f"resume: no checkpoint in checkpoint_dir={checkpoint_dir!r}")
        state, meta = ckpt.restore(checkpoint_dir, state)
        history, round_log = meta["history"], meta["round_metrics"]
        compile_s, run_s = meta.get("compile_seconds", 0.0), meta.get("run_seconds", 0.0)

    def save(state):
        ckpt.save(checkpoint_dir, state, {"history": history, "round_metrics": round_log,
                                          "compile_seconds": compile_s, "run_seconds": run_s})

    evaluate = make_evaluator(model)
    compiled: dict = {}
    bar = _progress(progress, num_rounds, int(state.round), description)

    def evaluate_now(state):
        per_client = to_numpy(evaluate(state.params, data.test))
        has_test = per_client["num_examples"] > 0
        acc = per_client["accuracy"][has_test]
        summary = fairness.fairness_summary(acc, weights=per_client["num_examples"][has_test])
        summary["test_loss"] = float(np.average(per_client["loss"][has_test],
                                                weights=per_client["num_examples"][has_test]))
        return per_client, summary

    if not history:
        _, summary = evaluate_now(state)
        history.append({"round": 0, **summary})
        if on_eval:
            on_eval(history[-1])
        if checkpoint_dir:
            save(state)

    per_client = None
    while int(state.round) < num_rounds:
        r0 = int(state.round)
        length = min(eval_every, num_rounds - r0)
        if length not in compiled:
            t = time.perf_counter()
            fn = jax.jit(lambda s, d, k, b, n=length: simulate(
                algorithm, s, d, k, num_rounds=n, cohort_size=cohort_size, sampler=sampler,
                step_budgets=b))
            compiled[length] = fn.lower(state, data, key, step_budgets).compile()
            compile_s += time.perf_counter() - t
        t = time.perf_counter()
        new_state, metrics = compiled[length](state, data, key, step_budgets)
        finite = np.asarray(metrics["finite"])
        run_s += time.perf_counter() - t
        if not finite.all():
            bad = r0 + int(np.argmin(finite)) + 1
            bar.close()
            where = f", saved in {checkpoint_dir}" if checkpoint_dir else ""
            raise NonFiniteError(bad, r0, state, where)
        state = new_state
        for name in ("train_loss", "update_norm", "improved_fraction"):
            if name in metrics:
                round_log.setdefault(name, []).extend(np.asarray(metrics[name]).tolist())
        per_client, summary = evaluate_now(state)
        entry = {"round": int(state.round), **summary, "seconds": run_s,
                 "train_loss": round_log["train_loss"][-1]}
        history.append(entry)
        if on_eval:
            on_eval(entry)
        if checkpoint_dir:
            save(state)
        bar.update(length)
        bar.set_postfix(acc=f"{summary['mean']:.3f}", worst10=f"{summary['worst_10%']:.3f}")
    bar.close()
    if per_client is None:
        per_client, _ = evaluate_now(state)
    return RunResult(state=state, history=history, client_metrics=per_client,
                     round_metrics={k: np.asarray(v) for k, v in round_log.items()},
                     compile_seconds=compile_s, run_seconds=run_s)


def _progress(enabled: bool, total: int, initial: int, description: str):
    from tqdm.auto import tqdm
    return tqdm(total=total, initial=initial, desc=description or "rounds", unit="round",
                disable=not enabled, leave=False, dynamic_ncols=True)

