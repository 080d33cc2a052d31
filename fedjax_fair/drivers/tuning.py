"""The search spaces of a tuned comparison (``fedjax-fair compare --tune``).

A method's space is stated once, next to its factory: ``registry.Method.search_space``
(its paper's grid where the paper gives one, ``Method.search_source`` says where from).
``search_space`` adds the client rate on a log grid around the method's own rate
(``RATE_FACTORS`` times it: a rate the defaults leave too small for a method's
correction to act is in reach, as is a smaller one), takes a user's grid per method
(``overrides``: a name given replaces the space's values, a new name adds a
dimension), and thins the product to a budget of grid points (``thin``).

Every grid point of one method is a run of the same compiled program where the names
are continuous (vmapped, ``drivers.sweeps.sweep``); static names split programs.
"""
from __future__ import annotations

import itertools
import math
from typing import Mapping, NamedTuple, Optional

import numpy as np

from fedjax_fair.algorithms.registry import get_method, method_hparams
from fedjax_fair.hparams import FieldError

RATE = "client_lr"
RATE_FACTORS = (0.5, 1.0, 2.0, 4.0)
"""The client-rate grid: the method's own rate times these (a log grid of ratio 2)."""


def rate_grid(rate: float) -> list:
    """``rate`` times ``RATE_FACTORS``, rounded to 6 significant digits."""
    return [float(f"{rate * f:.6g}") for f in RATE_FACTORS]


def search_space(name: str, *, fixed: Mapping = (), overrides: Optional[Mapping] = None,
                 budget: Optional[int] = None) -> dict:
    """``{hyper-parameter: [values]}`` that a tuned comparison searches for method
    ``name`` (a registered method or a ``NAME@LABEL`` variant): its registered space,
    then the client rate (``rate_grid`` of its own default rate) unless the space has
    it or ``fixed`` sets it, then ``overrides`` (``{name: values}``: replaces or adds a
    dimension). Names in ``fixed`` (values the user set: ``--hp``, ``--client-lr``) are
    not searched. ``budget``: at most that many grid points (``thin``). A name that is
    not a hyper-parameter of the method is a ``FieldError("grid")``."""
    every = method_hparams(name)
    space = {k: list(v) for k, v in get_method(name).search_space}
    if RATE in every and RATE not in space and every[RATE].default is not None:
        space[RATE] = rate_grid(float(every[RATE].default))
    for key, values in (overrides or {}).items():
        if key not in every or every[key].python_only:
            settable = [k for k, h in every.items() if not h.python_only]
            raise FieldError("grid", f"{name}.{key}: {key!r} is not a hyper-parameter of "
                                     f"{name!r} that a value sets; allowed: "
                                     f"{', '.join(settable)}")
        space[key] = list(values)
    space = {k: v for k, v in space.items() if k not in fixed}
    return thin(space, budget, {k: every[k].default for k in space})


def size(space: Mapping) -> int:
    """The number of grid points of a product space."""
    return int(np.prod([len(v) for v in space.values()])) if space else 1


def thin(space: Mapping, budget: Optional[int], defaults: Mapping = ()) -> dict:
    """``space`` with at most ``budget`` grid points: the axis with the most values
    loses one at a time, the values kept evenly spaced along it (its first and last,
    and its default value where it is on the axis), until the product fits. None:
    ``space`` as it is. A budget below 1 is a ``FieldError("tune_budget")``."""
    space = {k: list(v) for k, v in space.items()}
    if budget is None:
        return space
    if not isinstance(budget, (int, np.integer)) or budget < 1:
        raise FieldError("tune_budget", f"must be a positive integer, got {budget!r}")
    defaults = dict(defaults)
    while size(space) > budget:
        key = max(space, key=lambda k: (len(space[k]), k))
        values = space[key]
        if len(values) == 1:
            break
        space[key] = _evenly(values, len(values) - 1, defaults.get(key))
    return space


def _evenly(values: list, k: int, keep=None) -> list:
    """``k`` of ``values`` at evenly spaced positions (the ends first), ``keep``
    among them when it is one of the values (in place of the nearest inner pick)."""
    picks = sorted({int(round(i * (len(values) - 1) / max(k - 1, 1))) for i in range(k)})
    at = next((i for i, v in enumerate(values) if same_value(keep, [v])), None)
    if at is not None and at not in picks:
        inner = [j for j in range(1, len(picks) - 1)] or list(range(len(picks)))
        picks[min(inner, key=lambda j: abs(picks[j] - at))] = at
    return [values[i] for i in sorted(set(picks))]


def points(space: Mapping) -> list:
    """Every grid point as a dict, in C order of ``space``'s names."""
    names = list(space)
    return [dict(zip(names, combo)) for combo in itertools.product(*space.values())]


def default_point(name: str, space: Mapping) -> Optional[dict]:
    """The method's default values of ``space``'s names when every one is in the grid
    (the untuned comparison's setting), else None."""
    every = method_hparams(name)
    point = {k: every[k].default for k in space}
    return point if all(same_value(v, space[k]) for k, v in point.items()) else None


def same_value(value, values) -> bool:
    """Whether ``value`` is one of ``values`` (floats to 1e-9 relative: a grid read back
    from JSON)."""
    return any(value == v or (isinstance(value, float) and isinstance(v, (int, float))
                              and math.isclose(value, v, rel_tol=1e-9)) for v in values)


# ------------------------------------------------------------------ selection


LOWER_IS_BETTER = ("test_loss", "loss", "ece", "mce")


def higher_is_better(key: str) -> bool:
    """Whether a larger value of summary ``key`` (``validation_`` prefix or not) is
    better: accuracies yes; losses, calibration errors, spreads, Gini, parity gaps no."""
    base = key[len("validation_"):] if key.startswith("validation_") else key
    if base in LOWER_IS_BETTER:
        return False
    tail = base[len("accuracy_"):] if base.startswith("accuracy_") else base
    return not (tail in ("std", "variance", "gini", "angle", "kl_to_uniform")
                or tail.startswith("parity_gap"))


def best_point(values, higher: bool) -> Optional[int]:
    """The first grid point (rows of ``values`` [P, S], seeds along S) with the best
    mean over seeds, among those whose every seed is finite (none diverged); None when
    there is none. Ties: the first in the grid's order."""
    values = np.asarray(values, np.float64)
    ok = np.isfinite(values).all(axis=1)
    if not ok.any():
        return None
    mean = np.where(ok, values.mean(axis=1), -np.inf if higher else np.inf)
    return int(np.argmax(mean) if higher else np.argmin(mean))


class Tuned(NamedTuple):
    """A search's choice (``tune``): the selected values, the summary they were selected
    by and its mean and std over the seeds, the searched space and the sweep itself."""

    hparams: dict
    key: str
    score: tuple
    space: dict
    result: object  # sweeps.SweepResult


def tune(name: str, *, data, model, num_rounds: int, cohort_size: int,
         seeds=(100, 101, 102), select: str = "accuracy_mean",
         overrides: Optional[Mapping] = None, fixed: Optional[Mapping] = None,
         budget: Optional[int] = None, **sweep_kwargs) -> Tuned:
    """Method ``name`` searched as ``compare --tune`` searches it, from Python: its
    ``search_space`` (with ``overrides``, without the names ``fixed`` sets, at most
    ``budget`` points) runs as one vmapped ``sweeps.sweep`` over ``seeds`` on ``data``,
    which needs a validation split (``data.hold_out_validation(dataset)``: held out of
    the training rows, so the test split is never read), and the grid point best by
    the validation summary ``select`` is returned. ``sweep_kwargs`` go to
    ``sweeps.sweep`` (sampler, execution, ...). A grid point with a diverged seed is
    never chosen; every one diverged is a ``FieldError("select")``."""
    from fedjax_fair.drivers import sweeps
    federation = getattr(data, "host_data", data)
    if not sweeps.has_examples(getattr(federation, "validation", None)):
        raise FieldError("data", "needs a validation split to select on: "
                                 "data.hold_out_validation(dataset, 0.1) holds one out of "
                                 "the training rows")
    space = search_space(name, fixed=fixed or {}, overrides=overrides, budget=budget)
    key = "validation_" + select
    result = sweeps.sweep(name, space, data=data, model=model, num_rounds=num_rounds,
                          cohort_size=cohort_size, seeds=tuple(seeds), fixed=dict(fixed or {}),
                          **sweep_kwargs)
    if key not in result.summary:
        raise FieldError("select", f"unknown summary {select!r}; allowed: "
                                   f"{sorted(k[len('validation_'):] for k in result.summary if k.startswith('validation_'))}")
    values = np.asarray(result.summary[key], np.float64).reshape(size(space), len(seeds))
    p = best_point(values, higher_is_better(key))
    if p is None:
        raise FieldError("select", f"every grid point of {name} has a diverged seed: "
                                   f"nothing to select")
    chosen = points(space)[p]
    return Tuned(chosen, key, (float(values[p].mean()), float(values[p].std())), space,
                 result)


__all__ = ["RATE", "RATE_FACTORS", "rate_grid", "search_space", "size", "thin", "points",
           "default_point", "same_value", "higher_is_better", "best_point", "Tuned", "tune"]
