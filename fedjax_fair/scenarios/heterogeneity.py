"""Computational heterogeneity: per-client local-step budgets, redrawn every round.

A ``StepBudgets`` is a pure ``draw(key, num_examples [N]) -> int32 [N]``: how many
local steps each client may take this round. ``simulate`` draws a fresh table each
round from ``fold_in(sampling_key, 1)`` and the cohort reads its rows; local
training then takes ``min(budget_k, E * ceil(n_k / B))`` steps, the steps past a
client's budget being masked inside the same compiled program (client.py). A fixed
int32 [N] table (the old ``step_budgets`` argument) still works and never changes.

This is an optional extension, NOT what Ben Mansour et al. ("Tackling Computational
Heterogeneity in FL", arXiv:2307.06283, §3.1) simulate (their only heterogeneity is
unequal n_k): budgets drawn per client per round, e.g. epochs ~ U{1..E_max} or a
straggler fraction doing one epoch.
Budgets are counted in local steps, or in epochs (``unit="epochs"``: budget b means
b * ceil(n_k / B) steps, which needs the batch size B).

Aggregation can account for the work done: ``aggregators.step_normalized`` averages
the normalised updates Delta_k / tau_k and rescales by the mean step count,
d = (sum_k p_k tau_k) sum_k p_k Delta_k / tau_k (the normalised-update option for
unequal work; FedNova, Wang et al., NeurIPS 2020), so a client that ran more steps
does not pull the model further just because it ran longer.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from fedjax_fair.hparams import FieldError, count, probability

UNLIMITED_STEPS = 2 ** 30
UNITS = ("steps", "epochs")


class StepBudgets(NamedTuple):
    """draw: (key, num_examples int32 [N]) -> budgets int32 [N] (local steps)."""

    draw: Callable
    name: str


def _check_unit(unit: str, batch_size: Optional[int]) -> None:
    if unit not in UNITS:
        raise FieldError("unit", f"must be one of {list(UNITS)}, got {unit!r}")
    if unit == "epochs" and (not isinstance(batch_size, int) or batch_size <= 0):
        raise FieldError("batch_size", f"unit='epochs' needs the positive batch size, got "
                                       f"{batch_size!r}")


def _in_steps(budgets, num_examples, unit: str, batch_size: Optional[int]):
    if unit == "steps":
        return budgets.astype(jnp.int32)
    steps_per_epoch = (num_examples + batch_size - 1) // batch_size
    return (budgets * steps_per_epoch).astype(jnp.int32)



def fixed(budget: int, unit: str = "steps", batch_size: Optional[int] = None) -> StepBudgets:
    """Every client, every round: ``budget`` steps (or epochs)."""
    budget = count(budget, "budget", minimum=0)
    _check_unit(unit, batch_size)

    def draw(key, num_examples):
        del key
        return _in_steps(jnp.full(num_examples.shape, budget), num_examples, unit, batch_size)

    return StepBudgets(draw, f"fixed({budget} {unit})")


def uniform(low: int, high: int, unit: str = "steps",
            batch_size: Optional[int] = None) -> StepBudgets:
    """Each client, each round, independently: a budget ~ U{low, ..., high}."""
    low = count(low, "low", minimum=0)
    high = count(high, "high", minimum=0)
    if high < low:
        raise FieldError("high", f"must be >= low ({low}), got {high}")
    _check_unit(unit, batch_size)

    def draw(key, num_examples):
        b = jax.random.randint(key, num_examples.shape, low, high + 1)
        return _in_steps(b, num_examples, unit, batch_size)

    return StepBudgets(draw, f"uniform({low}..{high} {unit})")


def stragglers(fraction: float, budget: int, unit: str = "steps",
               batch_size: Optional[int] = None) -> StepBudgets:
    """Each round each client is, with probability ``fraction``, a straggler limited to
    ``budget`` steps (or epochs); the others run their full local epochs."""
    fraction = probability(fraction, "fraction")
    budget = count(budget, "budget", minimum=0)
    _check_unit(unit, batch_size)

    def draw(key, num_examples):
        slow = jax.random.bernoulli(key, fraction, num_examples.shape)
        limited = _in_steps(jnp.full(num_examples.shape, budget), num_examples, unit,
                            batch_size)
        return jnp.where(slow, limited, UNLIMITED_STEPS).astype(jnp.int32)

    return StepBudgets(draw, f"stragglers({fraction:g} at {budget} {unit})")


BUDGETS = {"fixed": fixed, "uniform": uniform, "stragglers": stragglers}


def budget_table(step_budgets, key, num_examples):
    """This round's budgets [N]: a fixed table as is, a ``StepBudgets`` drawn with key."""
    if isinstance(step_budgets, StepBudgets):
        return step_budgets.draw(key, num_examples)
    return step_budgets
