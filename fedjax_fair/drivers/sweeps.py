"""Vectorised sweeps: many whole runs as ONE compiled program (docs/meta.md).

A run (init + ``simulate`` + a final evaluation of every client) is a pure function
of its continuous hyper-parameters and its seed, so ``jax.vmap`` maps it over a grid
of hyper-parameters times a list of seeds. ``sweep`` does that and returns the
per-client metrics with labelled axes::

    result = sweep(lambda hp: qffl(model, q=hp["q"],
                                   training=ClientTraining(lr=hp["lr"], batch_size=10)),
                   {"q": [0.0, 0.1, 1.0, 5.0], "lr": [0.003, 0.01, 0.02, 0.03]},
                   model=model, data=ds, seeds=(0, 1), num_rounds=50, cohort_size=10)
    result.axes                         # (Axis q [4], Axis lr [4], Axis seed [2])
    result.test["accuracy"].shape       # (4, 4, 2, N): [*grid, seeds, clients]
    result.summary["accuracy_worst_10%"].shape   # (4, 4, 2)

Seeds follow the command line (``fedjax-fair run --seed S``): the key
``jax.random.key(S)`` initialises the model (unless ``params`` is given) and drives
sampling and local training, so a sweep's run equals ``runner.run(algorithm,
model.init(key), data, key, ...)`` with the same values, up to float rounding.

How the runs are mapped. The runs form a rectangle of G grid points x S seeds, cut
into tiles (``Tiles``) that go one after another through ONE compiled program:

* the grid points of a tile are vmapped with the seed's key shared, so sampling,
  cohorts and minibatch orders are computed once and only training is batched;
* the seeds of a tile are vmapped too on accelerators (``vmap_seeds``); on CPU one
  seed per tile is faster: different seeds train different clients, and clients
  vmapped together all run as many local steps as the busiest of them (the same
  trade-off as the cohort's ``execution`` strategies, benchmarks/sweep.py);
* ``chunk_size`` bounds the runs per tile, hence memory. Tiles are called from a
  host loop (``chunk_loop="host"``, the default) or mapped with ``lax.map`` inside
  one program (``"map"``); on CPU both cost the same within noise (docs/meta.md),
  and the host loop keeps one tile's outputs on the device at a time. Edge tiles
  are padded with copies, whose results are dropped.

The seeds' vmap binds ``execution.CLIENT_AXIS``, the axis the engine takes a group's
largest step count over (``execution.group_max``): runs vmapped together skip, as one
group, the local steps past the busiest of their clients, as a cohort vmapped by the
``vmap`` strategy does, instead of computing every padded step and selecting the
results away.

``run_seeds`` is ``runner.run`` for several seeds of ONE algorithm as one program, with
its history (evaluations every ``eval_every`` rounds) and per-round metrics: the seeds
of ``fedjax-fair compare``.

Both take a run's settings as one ``spec.RunSpec`` (``spec=``) or as the keywords of
the same names, as ``runner.run`` does; a sweep's runs are ``programs.simulate_chunk``
(the round program every driver runs) from ``algorithm.init``, and ``run_seeds`` calls
the programs of ``programs.make_programs(..., seeds=...)`` through ``runner.drive``.
"""
from __future__ import annotations

import functools
import numbers
import time
from typing import Callable, Mapping, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair import algorithms
from fedjax_fair.core import execution as _execution
from fedjax_fair.scenarios import sampling
from fedjax_fair import metrics as fairness
from fedjax_fair.core.algorithm import FederatedAlgorithm, ServerState
from fedjax_fair.drivers.programs import (closed_table, evaluate_state, make_programs,
                                          simulate_chunk)
from fedjax_fair.drivers.runner import (Chunk, CompileClock, Record, _progress, drive,
                                        has_clock)
from fedjax_fair.drivers.simulate import simulate
from fedjax_fair.drivers import checkpoint as ckpt
from fedjax_fair.drivers.spec import (DEFAULT, RunSpec, as_spec, check_cohort, check_count,
                                      check_model, check_model_fits, check_summary_clients,
                                      require_device_tables, require_sampler,
                                      check_system)
from fedjax_fair.core.types import ClientData, FederatedData
from fedjax_fair.hparams import FieldError, FieldTypeError

__all__ = [
    "Axis", "Builder", "CHUNK_LOOPS", "CONFIG", "SEED", "SEEDS_SETTINGS", "SWEEP_SETTINGS",
    "SeedRuns", "SweepResult", "Tiles", "as_federation", "check_cohort", "check_count",
    "check_grid", "check_grid_ranges", "check_seeds", "check_summary_clients", "check_system",
    "evaluate_state", "final_state", "has_examples", "initial_params", "resolve_builder",
    "run_seeds", "summarise", "summary_keys", "sweep", "tile_arrays",
]


SEED = "seed"  # name of the seeds' axis
CONFIG = "config"  # name of the one axis of a zipped grid
CHUNK_LOOPS = ("host", "map")

Builder = Union[str, Callable[[dict], FederatedAlgorithm]]


class Axis(NamedTuple):
    """One labelled axis of a sweep's results.

    name: the hyper-parameter that varies along it (a product grid), ``"config"``
      (a zipped grid: several hyper-parameters vary together) or ``"seed"``.
    values: ``{hyper-parameter: np.ndarray [size, ...]}``, the value of each
      hyper-parameter at every position along the axis (``{"seed": seeds}`` for
      the seeds).
    """

    name: str
    values: dict

    @property
    def size(self) -> int:
        return len(next(iter(self.values.values())))


class SweepResult(NamedTuple):
    """Stacked results of a sweep; every array's leading axes follow ``axes``.

    axes: the grid's axes, then the seeds' (``Axis("seed", ...)``).
    test / validation: per-client metrics of the final state, ``{metric: [*axes, N]}``
      ("loss", "accuracy", and the model's other ``per_example_metrics`` averaged
      per client, as ``runner.run`` reports them); validation is None when the
      federation has no validation split with examples.
    num_examples: ``{split: [N]}``, the same for every run; a client with 0 is left
      out of every summary.
    summary: fairness summaries of the per-client accuracies, ``{key: [*axes]}``,
      under ``runner.split_summary``'s names: ``accuracy_mean``, ``accuracy_std``,
      ``accuracy_worst_10%`` (groups averaged with test-size weights),
      ``accuracy_worst_10%_unweighted``, ..., ``test_loss``; validation keys are
      prefixed ``validation_``.
    states: the final ``ServerState`` of every run, leaves ``[*axes, ...]``, when
      asked for (``keep_states=True``), else None.
    compile_seconds / run_seconds: the initial parameters and compiling the
      program; running every tile.
    """

    axes: tuple
    test: dict
    validation: Optional[dict]
    num_examples: dict
    summary: dict
    states: Optional[ServerState]
    compile_seconds: float
    run_seconds: float

    @property
    def shape(self) -> tuple:
        """The sizes of ``axes``: (*grid, seeds)."""
        return tuple(a.size for a in self.axes)

    def hparams(self) -> dict:
        """``{hyper-parameter: [*grid, ...]}``: the value every grid point ran with."""
        grid = self.axes[:-1]
        out = {}
        for i, axis in enumerate(grid):
            for name, values in axis.values.items():
                shape = [1] * len(grid) + list(values.shape[1:])
                shape[i] = axis.size
                out[name] = np.broadcast_to(values.reshape(shape), tuple(
                    a.size for a in grid) + values.shape[1:])
        return out


# ------------------------------------------------------------------ validation


def check_seeds(seeds) -> np.ndarray:
    """``seeds`` as an int array [S]: a non-empty sequence of integers in [0, 2^32)."""
    if isinstance(seeds, (int, np.integer)) and not isinstance(seeds, (bool, np.bool_)):
        seeds = [seeds]
    try:
        items = list(seeds)
    except TypeError:
        raise FieldTypeError("seeds", f"must be a sequence of integers, got {seeds!r}") from None
    if not items:
        raise FieldError("seeds", "needs at least one seed")
    for s in items:
        if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)):
            raise FieldTypeError("seeds", f"must be integers, got {s!r}")
        if not 0 <= s < 2 ** 32:
            raise FieldError("seeds", f"must lie in [0, 2^32), got {s}")
    return np.asarray(items, np.int64)


def as_federation(data) -> FederatedData:
    """The FederatedData of ``data`` (a ``data.Dataset`` or FederatedData), checked:
    some client has a training and some a test example."""
    if hasattr(data, "host_data") and hasattr(data, "data"):  # a data.Dataset
        data = data.data
    if not isinstance(data, FederatedData):
        raise FieldTypeError("data", f"must be a FederatedData or a data.Dataset, got "
                                     f"{type(data).__name__}")
    for field in ("train", "test"):
        if not np.asarray(getattr(data, field).num_examples).sum() > 0:
            raise FieldError("data", f"no client has a {field} example")
    return data


def has_examples(split: Optional[ClientData]) -> bool:
    return split is not None and bool(np.asarray(split.num_examples).sum() > 0)


def _grid_values(name: str, values) -> np.ndarray:
    """One grid entry as a float array [n, ...], n >= 1, every value finite."""
    if isinstance(values, (numbers.Number, np.number)) or (
            isinstance(values, (np.ndarray, jax.Array)) and np.ndim(values) == 0):
        raise FieldError("grid", f"{name!r} must be a sequence of values, got the single "
                                 f"value {values!r} (write [{values!r}])")
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise FieldError("grid", f"{name!r} must be a sequence of numbers (or of arrays of "
                                 f"one shape), got {values!r}") from None
    if array.ndim == 0 or array.shape[0] == 0:
        raise FieldError("grid", f"{name!r} has no values")
    if not np.all(np.isfinite(array)):
        raise FieldError("grid", f"{name!r} has a non-finite value: {values!r}")
    return array.astype(jnp.result_type(float))  # float32, or float64 under x64


def check_grid(grid: Mapping, product: bool) -> tuple[list, dict]:
    """(grid axes, ``{name: values [G, ...]}`` flattened in the axes' C order)."""
    if not isinstance(grid, Mapping):
        raise FieldTypeError("grid", f"must be a mapping {{name: values}}, got "
                                     f"{type(grid).__name__}")
    for name in grid:
        if not isinstance(name, str) or not name.isidentifier():
            raise FieldError("grid", f"names must be identifiers, got {name!r}")
        if name == SEED:
            raise FieldError("grid", "'seed' is not a hyper-parameter; pass seeds=...")
    values = {name: _grid_values(name, v) for name, v in grid.items()}
    if not values:
        return [], {}
    if product:
        axes = [Axis(name, {name: v}) for name, v in values.items()]
        sizes = [len(v) for v in values.values()]
        index = np.indices(sizes).reshape(len(sizes), -1)
        return axes, {name: v[index[i]] for i, (name, v) in enumerate(values.items())}
    sizes = {name: len(v) for name, v in values.items()}
    if len(set(sizes.values())) > 1:
        raise FieldError("grid", f"a zipped grid (product=False) needs as many values for "
                                 f"every name, got {sizes}")
    return [Axis(CONFIG, values)], dict(values)


def resolve_builder(builder: Builder, grid_names, model, fixed: Optional[dict]):
    """``(hparams -> FederatedAlgorithm, registry entry or None)``; for a registered
    name, checks that the grid's names are continuous hyper-parameters of the
    method and ``fixed`` names its other arguments."""
    if callable(builder):
        if fixed:
            raise FieldError("fixed", "only for a registered method name; close over the "
                                      "values in the builder instead")
        return builder, None
    if not isinstance(builder, str):
        raise FieldTypeError("builder", f"must be a registered method name or a callable "
                                        f"hparams -> FederatedAlgorithm, got {builder!r}")
    if algorithms.base_name(builder) not in algorithms.REGISTRY:
        raise FieldError("builder", f"unknown method {builder!r}; allowed: "
                                    f"{sorted(algorithms.REGISTRY)}")
    if model is None:
        raise FieldError("model", f"a registered method ({builder!r}) is built from the model")
    method = algorithms.get_method(builder)
    hps = algorithms.method_hparams(builder)
    continuous = sorted(k for k, h in hps.items() if h.continuous)
    for name in grid_names:
        if name not in hps:
            raise FieldError("grid", f"{name!r} is not a hyper-parameter of {builder!r}; its "
                                     f"continuous ones: {continuous}")
        if not hps[name].continuous:
            raise FieldError("grid", f"{name!r} of {builder!r} is not continuous (a count, a "
                                     f"choice or an object is static: one program per value); "
                                     f"its "
                                     f"continuous ones: {continuous}")
    fixed = dict(fixed or {})
    for name in fixed:
        if name not in hps:
            raise FieldError("fixed", f"{name!r} is not a hyper-parameter of {builder!r}; "
                                      f"allowed: {sorted(hps)}")
        if name in grid_names:
            raise FieldError("fixed", f"{name!r} is also in the grid")
    return (lambda hp: algorithms.build(builder, model, **fixed, **hp)), method


def check_grid_ranges(method_name: str, flat: dict) -> None:
    """Every value of a registered method's grid lies in its range (before tracing)."""
    hps = algorithms.method_hparams(method_name)
    for name, values in flat.items():
        rng = hps[name].range
        if rng is None:
            continue
        for v in np.unique(values):
            rng.check(f"grid: {name!r}", float(v))


# ------------------------------------------------------------------ one run


def final_state(algorithm: FederatedAlgorithm, params, data: FederatedData, key, *,
                num_rounds: int, cohort_size: int, sampler: Callable, execution="auto",
                remat: bool = False, step_budgets=None) -> ServerState:
    """The state after ``num_rounds`` rounds of ``simulate`` from ``algorithm.init``."""
    state = algorithm.init(params, data.num_clients)
    require_device_tables(state, "a differentiated or vmapped run (final_state)")
    state, _ = simulate(algorithm, state, data, key, num_rounds=num_rounds,
                        cohort_size=cohort_size, sampler=sampler, remat=remat,
                        execution=execution, step_budgets=step_budgets)
    return state


def _run_fn(build: Callable, model, data_has_validation: bool, spec: RunSpec,
            keep_states: bool):
    """``run(hparams, seed, params, data) -> (test, validation, state)`` of one run:
    ``spec.num_rounds`` rounds of ``simulate_chunk`` from ``algorithm.init``, then every
    client evaluated (``final_state``'s run, with ``spec``'s settings)."""
    budgets = closed_table(spec.step_budgets)

    def run(hp, seed, params, data):
        key = jax.random.key(seed)
        algorithm = build(hp)
        state = algorithm.init(params, data.num_clients)
        require_device_tables(state, "a sweep (its runs vmapped together)")
        state, _ = simulate_chunk(algorithm, spec, spec.num_rounds, state, data, key, budgets)
        test = evaluate_state(model, algorithm, state, data.test)
        val = (evaluate_state(model, algorithm, state, data.validation)
               if data_has_validation else None)
        return test, val, (state if keep_states else None)

    return run


def initial_params(model, seeds: np.ndarray):
    """``model.init(jax.random.key(s))`` of every seed, stacked [S, ...]: one compiled
    init (the command line's ``execution.initial_params``), called once per seed,
    outside the sweep's program (a vmapped flax init inside it doubled its compile
    time)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *[
        _execution.initial_params(model, jax.random.key(int(s))) for s in seeds])


# ------------------------------------------------------------------ summaries


@functools.lru_cache(maxsize=8)
def _summary_fn(fractions: tuple) -> Callable:
    """A jitted ``(accuracy [B, n], weights [n]) -> {key: [B]}`` of
    ``metrics.fairness_summary``'s keys, vmapped over runs (the clients with
    examples; groups weighted by size). Cached: compiled once per shape."""

    def one(a, w):
        out = {"mean": fairness.mean(a), "weighted_mean": fairness.weighted_mean(a, w),
               "std": fairness.std(a), "variance": fairness.variance(a)}
        for f in fractions:
            tag = fairness._pct(f)
            lo, hi = fairness.worst_k(a, f, w), fairness.best_k(a, f, w)
            out[f"worst_{tag}"], out[f"best_{tag}"] = lo, hi
            out[f"parity_gap_{tag}"] = hi - lo
            out[f"worst_{tag}_unweighted"] = fairness.worst_k(a, f)
            out[f"best_{tag}_unweighted"] = fairness.best_k(a, f)
        out.update(gini=fairness.gini(a), angle=fairness.angle_to_uniform(a),
                   kl_to_uniform=fairness.kl_to_uniform(a))
        return out

    # tiny arrays: XLA:CPU's cheaper pipeline halves the compile, the run is negligible
    return jax.jit(jax.vmap(one, in_axes=(0, None)),
                   compiler_options=_execution.compiler_options("once"))


def summarise(per_client: dict, num_examples, split: str = "test",
              fractions: Sequence[float] = (0.05, 0.1)) -> dict:
    """Fairness summaries of stacked per-client metrics ``{metric: [B, N]}``:
    ``{key: [B]}`` with ``runner.split_summary``'s keys and values (accuracy summary,
    example-weighted loss, mean ECE / MCE), over the clients with examples."""
    n = np.asarray(num_examples)
    has = n > 0
    if not has.any():
        return {}
    w = n[has].astype(np.float32)
    acc = np.asarray(per_client["accuracy"])[:, has]
    out = {f"accuracy_{k}": np.asarray(v)
           for k, v in _summary_fn(tuple(fractions))(jnp.asarray(acc), jnp.asarray(w)).items()}
    out["loss"] = np.average(np.asarray(per_client["loss"])[:, has], weights=w, axis=1)
    for name in ("ece", "mce"):
        if name in per_client:
            out[name] = np.asarray(per_client[name])[:, has].mean(axis=1)
    if split == "test":
        out["test_loss"] = out.pop("loss")
        return out
    return {f"{split}_{k}": v for k, v in out.items()}


# ------------------------------------------------------------------ sweep


def _row(tree, i):
    return jax.tree.map(lambda v: v[i], tree)


def _tile_fn(run: Callable, g: int, s: int, params_axis: Optional[int]) -> Callable:
    """``(hparams [g, ...], seeds [s], params ([s, ...] or shared), data) -> outputs
    [s, g, ...]``: the runs of g grid points x s seeds.

    The grid points of one seed share its key, so sampling, cohorts and batch orders
    are computed once for all of them and only the training is batched over the
    grid. The seeds' vmap binds ``execution.CLIENT_AXIS``: runs of different seeds
    train different clients side by side, and the engine's ``group_max`` gives them
    one step bound (a grid's points share their clients, hence their step counts).
    An axis of size 1 is not vmapped (the program compiles faster without it)."""

    def one_point(fn):
        return lambda hp, seed, p, d: jax.tree.map(
            lambda v: v[None], fn(jax.tree.map(lambda v: v[0], hp), seed, p, d))

    over_grid = (jax.vmap(run, in_axes=(0, None, None, None)) if g > 1
                 else one_point(run))
    if s > 1:
        return jax.vmap(over_grid, in_axes=(None, 0, params_axis, None),
                        axis_name=_execution.CLIENT_AXIS)
    take = (lambda p: jax.tree.map(lambda v: v[0], p)) if params_axis == 0 else (lambda p: p)
    return lambda hp, seeds, p, d: jax.tree.map(lambda v: v[None],
                                                over_grid(hp, seeds[0], take(p), d))


class Tiles(NamedTuple):
    """The (grid points x seeds) rectangle cut into tiles of ``g`` points x ``s``
    seeds, ``count`` in all; the edges are padded with copies of the last point /
    seed, whose results are dropped."""

    num_points: int
    num_seeds: int
    g: int
    s: int

    @classmethod
    def of(cls, num_points: int, num_seeds: int, chunk_size: Optional[int],
           vmap_seeds: bool = True) -> "Tiles":
        """Tiles of at most ``chunk_size`` runs (None: no bound), as many grid points
        as fit, then seeds; one seed per tile unless ``vmap_seeds``."""
        seeds = num_seeds if vmap_seeds else 1
        chunk = chunk_size or num_points * seeds
        g = min(num_points, chunk)
        s = min(seeds, max(1, chunk // g))
        return cls(num_points, num_seeds, g, s)

    @property
    def shape(self) -> tuple[int, int]:
        return -(-self.num_points // self.g), -(-self.num_seeds // self.s)

    @property
    def count(self) -> int:
        return self.shape[0] * self.shape[1]

    def split(self, flat: dict, seeds: np.ndarray):
        """``({name: [count, g, ...]}, seeds [count, s], seed positions [count, s])``,
        tiles in (point, seed) C order."""
        tg, ts = self.shape
        points = np.minimum(np.arange(tg * self.g), self.num_points - 1).reshape(tg, self.g)
        seed_rows = np.minimum(np.arange(ts * self.s), self.num_seeds - 1).reshape(ts, self.s)
        hp = {k: np.repeat(v[points], ts, axis=0) for k, v in flat.items()}
        positions = np.tile(seed_rows, (tg, 1))
        return hp, seeds[positions].astype(np.uint32), positions

    def merge(self, out):
        """Tile outputs ``[count, s, g, ...]`` -> ``[num_points, num_seeds, ...]``."""
        tg, ts = self.shape

        def one(v):
            v = v.reshape((tg, ts, self.s, self.g) + v.shape[3:])
            v = np.moveaxis(v, 3, 1)  # [tg, g, ts, s, ...]
            v = v.reshape((tg * self.g, ts * self.s) + v.shape[4:])
            return v[:self.num_points, :self.num_seeds]

        return jax.tree.map(one, out)



def tile_arrays(output) -> dict:
    """One tile's outputs ``(test, validation, states)`` as the flat arrays
    ``{"test/<metric>": [s, g, N], "validation/<metric>": ...}`` that ``sweep``'s
    ``on_tile`` gets and its ``done`` takes back (states are not included)."""
    test, val, _ = output
    arrays = {f"test/{k}": np.asarray(v) for k, v in test.items()}
    arrays.update({f"validation/{k}": np.asarray(v) for k, v in (val or {}).items()})
    return arrays


def _tile_output(i, arrays: Mapping, tiles: Tiles, num_clients: int, validate: bool):
    """``tile_arrays``' inverse for tile ``i``, checked against the sweep's tiles:
    every array ``[s, g, N]``, test (and, with a validation split, validation)
    accuracy and loss present."""
    if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)) or not (
            0 <= i < tiles.count):
        raise FieldError("done", f"tile indices are integers in [0, {tiles.count}), got {i!r}")
    if not isinstance(arrays, Mapping):
        raise FieldTypeError("done", f"tile {i}: must be a mapping of arrays (tile_arrays), "
                                     f"got {type(arrays).__name__}")
    splits: dict = {"test": {}, "validation": {}}
    for key, value in arrays.items():
        split, _, metric = str(key).partition("/")
        value = np.asarray(value)
        if split not in splits or not metric:
            raise FieldError("done", f"tile {i}: unknown array {key!r} (test/<metric> or "
                                     f"validation/<metric>)")
        if value.shape != (tiles.s, tiles.g, num_clients):
            raise FieldError("done", f"tile {i}: {key!r} has shape {value.shape}, the sweep's "
                                     f"tiles {(tiles.s, tiles.g, num_clients)}")
        splits[split][metric] = value
    for split in ("test", "validation") if validate else ("test",):
        missing = {"accuracy", "loss"} - set(splits[split])
        if missing:
            raise FieldError("done", f"tile {i}: no {split} {', '.join(sorted(missing))}")
    return splits["test"], (splits["validation"] if validate else None), None


def summary_keys(metrics: Sequence[str], split: str = "test",
                 fractions: Sequence[float] = (0.05, 0.1)) -> list:
    """The keys, in order, of ``summarise`` for per-client ``metrics`` (their names:
    "accuracy", "loss", "ece", ...) on ``split``, found without computing anything."""
    if "accuracy" not in metrics:
        return []
    f32 = jnp.float32
    shapes = jax.eval_shape(_summary_fn(tuple(fractions)), jax.ShapeDtypeStruct((1, 2), f32),
                            jax.ShapeDtypeStruct((2,), f32))
    accuracy = [f"accuracy_{k}" for k in shapes]
    calibration = [m for m in ("ece", "mce") if m in metrics]
    if split == "test":  # summarise renames the loss, which moves it last
        return accuracy + calibration + ["test_loss"]
    return [f"{split}_{k}" for k in accuracy + ["loss"] + calibration]


# the RunSpec fields sweep takes (eval_every is not used: a sweep evaluates at the end)
SWEEP_SETTINGS = ("num_rounds", "cohort_size", "eval_every", "sampler", "step_budgets",
                  "execution")


def sweep(builder: Builder, grid: Mapping, *, data, num_rounds: int = DEFAULT,
          cohort_size: int = DEFAULT, model=None, seeds: Sequence[int] = (0,), params=None,
          product: bool = True, fixed: Optional[dict] = None, chunk_size: Optional[int] = None,
          sampler: Optional[Callable] = DEFAULT, execution=DEFAULT, step_budgets=DEFAULT,
          keep_states: bool = False, fractions: Sequence[float] = (0.05, 0.1),
          vmap_seeds: Optional[bool] = None, chunk_loop: str = "host",
          compiler_options: Optional[dict] = None,
          on_tile: Optional[Callable[[int, dict, float], None]] = None,
          done: Optional[Mapping[int, dict]] = None,
          spec: Optional[RunSpec] = None) -> SweepResult:
    """Runs every (grid point, seed) as one vmapped, compiled program.

    Args:
      builder: ``hparams -> FederatedAlgorithm`` (``hparams`` a dict of the grid's
        names to traced scalars or arrays), or a registered method name, built as
        ``REGISTRY[name].factory(model, **fixed, **hparams)``; the grid's names must
        then be continuous hyper-parameters of the method, and its values in range.
      grid: ``{name: values}``; each entry a sequence of numbers, or of arrays of one
        shape (e.g. per-round schedules, ``[n, T]``). ``{}``: seeds only.
      data: the federation (``data.Dataset`` or ``FederatedData``); its validation
        split, when it has examples, is evaluated too.
      num_rounds, cohort_size, sampler, execution, step_budgets: the settings of every
        run, as keywords or as ``spec`` (a ``RunSpec``; its other fields keep their
        defaults, ``eval_every`` aside: a sweep evaluates once, at the end). The
        keyword ``sampler`` defaults to ``sampling.full`` for a registered method that
        needs every client every round, else ``sampling.uniform`` (a spec's None too).
      model: evaluates the final states (and initialises them unless ``params``).
      seeds: one run per seed per grid point; seed s uses ``jax.random.key(s)`` for
        the model's initialisation, sampling and training (as the command line).
      params: initial parameters shared by every run; None: ``model.init(key)``.
      product: the full product of the grid's values (one axis per name), or
        ``False``: zipped (one ``"config"`` axis; every name as many values).
      fixed: a registered method's other arguments.
      chunk_size: at most this many runs (grid points x seeds) at once; None: no
        bound. Bounds memory at about chunk_size runs. The rectangle of runs is cut
        into tiles of g grid points x s seeds (g = min(G, chunk_size), s =
        min(S, chunk_size // g), or s = 1 without ``vmap_seeds``), run one after
        another through one compiled program.
      vmap_seeds: vmap the seeds together (True) or run them one after another
        (False); None: True on accelerators, False on CPU. The grid points of one
        seed share its cohorts and batches, so vmapping them batches the same work;
        different seeds train different clients, and vmapped together every client
        runs as many local steps as the busiest client beside it (on CPU the
        sequential loop wins, as for clients: benchmarks/sweep.py, docs/meta.md).
      chunk_loop: ``"host"``: one compiled tile, called once per tile from Python;
        ``"map"``: a ``lax.map`` over the tiles inside one program (one call).
      keep_states: also return every final state (memory: one state per run).
      fractions: the worst / best groups of the summaries.
      compiler_options: passed to ``jax.jit`` (e.g. XLA:CPU's cheaper pipeline).
      on_tile: called as ``on_tile(i, arrays, seconds)`` after tile ``i`` (of
        ``Tiles.of(...).count``, in (grid point, seed) C order) has run: ``arrays`` is
        the tile's outputs as flat arrays (``tile_arrays``), ``seconds`` the call's
        wall time. What it raises stops the sweep (e.g. a stop request: the tiles
        before it are done and were handed over). Host loop only.
      done: ``{i: arrays}`` of tiles already run (what ``on_tile`` got, e.g. saved by
        an interrupted sweep with the same arguments): they are not run again and
        their arrays are merged as they are; when every tile is done nothing is
        compiled. Host loop only; not with ``keep_states``.

    Every argument is checked before anything is compiled; a bad one raises
    ``ValueError`` / ``TypeError`` whose message starts with its name.
    """
    if spec is None and sampler is DEFAULT:
        sampler = None  # the method's participation decides
    spec = as_spec(spec, "sweep", dict(
        num_rounds=num_rounds, cohort_size=cohort_size, sampler=sampler,
        execution=execution, step_budgets=step_budgets), takes=SWEEP_SETTINGS)
    data = as_federation(data)
    spec = spec.check(data)
    seed_values = check_seeds(seeds)
    axes, flat = check_grid(grid, product)
    build, method = resolve_builder(builder, list(flat), model, fixed)
    if method is not None:
        check_grid_ranges(builder, flat)
    if model is None:
        raise FieldError("model", "needed to evaluate the final states")
    check_model_fits(model, params, data)  # params None: the model's own, per seed
    _check_built(build, flat)
    spec = spec._replace(sampler=_sweep_sampler(spec, builder, method, data.num_clients))
    if chunk_size is not None:
        chunk_size = check_count(chunk_size, "chunk_size")
    _check_tile_loop(chunk_loop, on_tile, done, keep_states)

    num_points = len(next(iter(flat.values()))) if flat else 1
    if vmap_seeds is None:
        vmap_seeds = jax.default_backend() != "cpu"
    tiles = Tiles.of(num_points, len(seed_values), chunk_size, bool(vmap_seeds))
    validate = has_examples(data.validation)
    restored = {i: _tile_output(i, arrays, tiles, data.num_clients, validate)
                for i, arrays in (done or {}).items()}
    run = _run_fn(build, model, validate, spec, keep_states)
    hp_tiles, seed_tiles, positions = tiles.split(flat, seed_values)
    per_seed = params is None
    todo = [i for i in range(tiles.count) if i not in restored]
    t = time.perf_counter()
    if per_seed and todo:
        inits = initial_params(model, seed_values)
        params = jax.tree.map(lambda v: v[positions], inits)  # [count, s, ...]
    tile = _tile_fn(run, tiles.g, tiles.s, 0 if per_seed else None)
    if chunk_loop == "host":
        out, compile_s, run_s = _host_tiles(tile, hp_tiles, seed_tiles, params, per_seed, data,
                                            tiles, todo, restored, compiler_options, on_tile, t)
    else:
        out, compile_s, run_s = _mapped_tiles(tile, hp_tiles, seed_tiles, params, per_seed,
                                              data, compiler_options, t)
    return _sweep_result(out, tiles, axes, seed_values, data, validate, fractions,
                         keep_states, compile_s, run_s)


def _check_built(build: Callable, flat: dict) -> None:
    """The builder returns a FederatedAlgorithm (built at the grid's first point)."""
    built = build({name: values[0] for name, values in flat.items()})  # cheap: closures
    if not isinstance(built, FederatedAlgorithm):
        raise FieldTypeError("builder", f"must return a FederatedAlgorithm (e.g. fedavg(model, "
                                        f"training=ClientTraining(lr=hparams['lr']))), got "
                                        f"{type(built).__name__}")


def _sweep_sampler(spec: RunSpec, builder, method, num_clients: int) -> Callable:
    """The spec's sampler; None: ``sampling.full`` for a registered method that needs
    every client every round, else ``sampling.uniform``. The full sampler needs
    ``cohort_size == num_clients``."""
    sampler = spec.sampler
    if sampler is None:
        sampler = (sampling.full if method is not None and method.participation == "full"
                   else sampling.uniform)
    if sampler is sampling.full and spec.cohort_size != num_clients:
        raise FieldError("cohort_size", f"the 'full' sampler (every client every round"
                                        f"{', as ' + repr(builder) + ' needs' if method else ''}) needs "
                                        f"cohort_size == {num_clients}, got {spec.cohort_size}")
    return sampler


def _check_tile_loop(chunk_loop: str, on_tile, done, keep_states: bool) -> None:
    if chunk_loop not in CHUNK_LOOPS:
        raise FieldError("chunk_loop", f"must be one of {CHUNK_LOOPS}, got {chunk_loop!r}")
    if (on_tile is not None or done) and chunk_loop != "host":
        raise FieldError("chunk_loop", "on_tile and done need the host loop ('host')")
    if done and keep_states:
        raise FieldError("done", "tiles already run carry no states; keep_states=False")


def _host_tiles(tile: Callable, hp_tiles: dict, seed_tiles, params, per_seed: bool, data,
                tiles: Tiles, todo: list, restored: dict, compiler_options, on_tile,
                t: float) -> tuple:
    """``(outputs [count, s, g, ...], compile seconds since t, run seconds)``: one
    compiled tile called for every tile not ``restored``, from a host loop."""
    tile_params = (lambda i: _row(params, i)) if per_seed else (lambda i: params)
    outputs = dict(restored)
    compile_s = 0.0
    if todo:
        program = jax.jit(tile, compiler_options=compiler_options)
        compiled = program.lower(_row(hp_tiles, todo[0]), seed_tiles[todo[0]],
                                 tile_params(todo[0]), data).compile()
        compile_s = time.perf_counter() - t
    t = time.perf_counter()
    for i in todo:
        t_i = time.perf_counter()
        outputs[i] = jax.device_get(compiled(_row(hp_tiles, i), seed_tiles[i],
                                             tile_params(i), data))
        if on_tile is not None:
            on_tile(i, tile_arrays(outputs[i]), time.perf_counter() - t_i)
    out = jax.tree.map(lambda *xs: np.stack(xs), *[outputs[i] for i in range(tiles.count)])
    return out, compile_s, time.perf_counter() - t


def _mapped_tiles(tile: Callable, hp_tiles: dict, seed_tiles, params, per_seed: bool, data,
                  compiler_options, t: float) -> tuple:
    """``(outputs [count, s, g, ...], compile seconds since t, run seconds)``: a
    ``lax.map`` over the tiles inside one program."""
    if per_seed:
        program = jax.jit(lambda hp, seeds, p, d: jax.lax.map(
            lambda xs: tile(*xs, d), (hp, seeds, p)), compiler_options=compiler_options)
    else:
        program = jax.jit(lambda hp, seeds, p, d: jax.lax.map(
            lambda xs: tile(*xs, p, d), (hp, seeds)), compiler_options=compiler_options)
    args = (hp_tiles, seed_tiles, params, data)
    compiled = program.lower(*args).compile()
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    out = jax.device_get(compiled(*args))
    return out, compile_s, time.perf_counter() - t


def _sweep_result(out, tiles: Tiles, axes: list, seed_values: np.ndarray,
                  data: FederatedData, validate: bool, fractions, keep_states: bool,
                  compile_s: float, run_s: float) -> SweepResult:
    """The tiles' outputs merged into the labelled ``SweepResult``, with summaries."""
    test, val, states = tiles.merge(out)  # [G, S, ...]
    shape = tuple(a.size for a in axes) + (len(seed_values),)
    grid_shape = lambda tree: jax.tree.map(lambda v: v.reshape(shape + v.shape[2:]), tree)
    flat_runs = lambda tree: jax.tree.map(lambda v: v.reshape((-1,) + v.shape[2:]), tree)
    num_examples = {"test": np.asarray(data.test.num_examples)}
    summary = summarise(flat_runs(test), num_examples["test"], "test", fractions)
    if validate:
        num_examples["validation"] = np.asarray(data.validation.num_examples)
        summary.update(summarise(flat_runs(val), num_examples["validation"], "validation",
                                 fractions))
    summary = jax.tree.map(lambda v: v.reshape((tiles.num_points, len(seed_values))), summary)
    seed_axis = Axis(SEED, {SEED: seed_values})
    return SweepResult(axes=tuple(axes) + (seed_axis,), test=grid_shape(test),
                       validation=grid_shape(val) if validate else None,
                       num_examples=num_examples, summary=grid_shape(summary),
                       states=grid_shape(states) if keep_states else None,
                       compile_seconds=compile_s, run_seconds=run_s)


# ------------------------------------------------------------------ seeds with history


class SeedRuns(NamedTuple):
    """The runs of one algorithm over several seeds (``run_seeds``), one entry per seed.

    results: a ``runner.RunResult`` per seed, with ``runner.run``'s history (an
      evaluation at round 0, every ``eval_every`` rounds and at the end),
      per-client metrics, per-round metrics and client history. A diverged seed's
      result stops at its last good evaluation.
    rounds: per seed, the simulate metrics of every round kept ({name: [R, ...]},
      the ``on_rounds`` values of ``runner.run``).
    non_finite: per seed, None, or ``(round, last_good_round)`` where the server's
      state first became NaN/inf (``runner.NonFiniteError``'s numbers).
    compile_seconds / run_seconds: compiling the one program; running every seed.
    """

    results: list
    rounds: list
    non_finite: list
    compile_seconds: float
    run_seconds: float


# the RunSpec fields run_seeds takes (its checkpoints: checkpoint_dirs, one per seed)
SEEDS_SETTINGS = ("num_rounds", "cohort_size", "eval_every", "sampler", "step_budgets",
                  "system", "execution", "memory_limit", "summary_clients", "commit_seconds")


def run_seeds(algorithm: FederatedAlgorithm, model, data: FederatedData, seeds: Sequence[int],
              *, num_rounds: int = DEFAULT, cohort_size: int = DEFAULT,
              eval_every: int = DEFAULT, sampler: Callable = DEFAULT, execution=DEFAULT,
              step_budgets=DEFAULT, inits: Optional[Sequence[Callable]] = None,
              vmap_seeds: Optional[bool] = None, memory_limit: Optional[int] = DEFAULT,
              log: Optional[Callable] = None, checkpoint_dirs: Optional[Sequence[str]] = None,
              resume: bool = False, commit_seconds: float = DEFAULT, progress: bool = False,
              description: str = "", system=DEFAULT, summary_clients=DEFAULT,
              spec: Optional[RunSpec] = None) -> Optional[SeedRuns]:
    """``runner.run`` of one algorithm for every seed, the seeds as ONE compiled program.

    The settings are ``spec`` (a ``RunSpec``) or the keywords of the same names, one
    or the other, as ``runner.run``'s; a spec's ``placement``, ``stream_layout``,
    ``checkpoint_dir`` and ``donate`` keep their defaults (the checkpoints are
    ``checkpoint_dirs``, one per seed).

    Seed s initialises the model with ``jax.random.key(s)`` and keys the run with it
    (as ``fedjax-fair run --seed s``); each seed's result equals ``runner.run``'s
    with those keys up to float rounding, history included (evaluations at round 0,
    every ``eval_every`` rounds and at the end). The seeds go through ``runner.drive``,
    the loop ``runner.run`` uses, with the programs of ``programs.make_programs``
    (``seeds=``): each chunk of ``eval_every`` rounds is one call of a compiled
    program for every seed (vmapped, ``vmap_seeds`` True; None: on accelerators) or
    one call per seed of the same program (CPU: different seeds train different
    clients, benchmarks/sweep.py), every client evaluated inside it; then each seed's
    ``runner.Record`` logs the evaluation and commits it with the seed's state to
    ``checkpoint_dirs[i]`` (when given), so a kill loses at most the chunks since the
    last commit, and a stop request (``runner.request_stop``, a signal under
    ``runner.stop_on_signals``) is honoured at the next chunk's end, after the
    commits, by ``runner.Interrupted``. ``resume``: every seed continues from its
    checkpoint; the checkpoints must be of one round (``ValueError("resume: ...")``
    otherwise: resume such seeds one by one).

    ``inits``: per seed, the ``init`` to use instead of ``algorithm.init`` (a method
    whose initial state depends on the seed; the round program is shared). The
    federation must fit on the device: with ``memory_limit`` (default: the device's
    free memory, when known) a chunk program whose arguments, outputs and temporaries
    exceed it returns None, and nothing has run (``runner.run`` streams cohorts from
    the host instead). The per-seed ``compile_seconds`` are the programs' for the
    first seed and 0 for the others; vmapped seeds split each chunk's seconds evenly.
    A seed whose state becomes NaN/inf stops at its last good evaluation
    (``SeedRuns.non_finite``) while the others go on.
    """
    spec = as_spec(spec, "run_seeds", dict(
        num_rounds=num_rounds, cohort_size=cohort_size, eval_every=eval_every,
        sampler=sampler, step_budgets=step_budgets, system=system, execution=execution,
        memory_limit=memory_limit, summary_clients=summary_clients,
        commit_seconds=commit_seconds), takes=SEEDS_SETTINGS)
    data = as_federation(data)
    check_model(model)
    spec = spec.check(data, model)
    require_sampler(spec.sampler)
    check_model_fits(model, None, data)  # each seed's parameters are model.init's
    seed_values = check_seeds(seeds)
    _check_per_seed(inits, checkpoint_dirs, resume, len(seed_values))
    if vmap_seeds is None:
        vmap_seeds = jax.default_backend() != "cpu"
    validate = has_examples(data.validation)
    clock = CompileClock().start()
    try:
        states, records = _seed_states(algorithm, model, data.num_clients, seed_values, inits,
                                       checkpoint_dirs, resume, spec.commit_seconds)
        require_device_tables(states, "run_seeds (its seeds run as one program)")
        seeds32 = seed_values.astype(np.uint32)
        current = [_stack(states)] if vmap_seeds else list(states)
        programs = make_programs(algorithm, model, data, spec, state=current[0],
                                 seeds=seeds32, vmap_seeds=vmap_seeds, validate=validate,
                                 log=log)
        if not programs.plan.fits:
            return None
        loop = _SeedLoop(algorithm, spec, programs, records, current, seeds32, vmap_seeds,
                         validate)
        bar = _progress(progress, spec.num_rounds, int(states[0].round), description)
        drive(records, loop.advance, loop.initial, num_rounds=spec.num_rounds,
              eval_every=spec.eval_every, bar=bar, clock=clock)
        if records[0].last_test is None:  # resumed at the end: nothing ran
            for rec, c in zip(records, loop.initial()):
                rec.last_test = c.test
        compile_s = clock.seconds
    finally:
        clock.stop()
    results = [rec.result(algorithm, programs.plan, clock,
                          compile_seconds=compile_s if i == 0 else 0.0)
               for i, rec in enumerate(records)]
    return SeedRuns(results, [r.rounds for r in results], [rec.non_finite for rec in records],
                    compile_s, sum(r.run_seconds for r in results))


def _check_per_seed(inits, checkpoint_dirs, resume: bool, num_seeds: int) -> None:
    if inits is not None and len(inits) != num_seeds:
        raise FieldError("inits", f"one per seed, got {len(inits)} for {num_seeds}")
    if checkpoint_dirs is not None and len(checkpoint_dirs) != num_seeds:
        raise FieldError("checkpoint_dirs", f"one per seed, got {len(checkpoint_dirs)} for "
                                            f"{num_seeds}")
    for directory in checkpoint_dirs or ():
        ckpt.check_directory(directory, "checkpoint_dirs")
    if resume and checkpoint_dirs is None:
        raise FieldError("resume", "needs checkpoint_dirs")


def _seed_states(algorithm: FederatedAlgorithm, model, num_clients: int,
                 seed_values: np.ndarray, inits, checkpoint_dirs, resume: bool,
                 commit_seconds) -> tuple:
    """``(states, records)``: every seed's starting state (its ``init`` of
    ``model.init(key(seed))``, or its checkpoint's: all of one round) and ``Record``."""
    states = [(algorithm.init if inits is None else inits[i])(
        _execution.initial_params(model, jax.random.key(int(s))), num_clients)
        for i, s in enumerate(seed_values)]
    records = [Record(None if checkpoint_dirs is None else checkpoint_dirs[i],
                      commit_seconds=commit_seconds) for i in range(len(seed_values))]
    if resume:
        states = [rec.resume(st, num_clients) for rec, st in zip(records, states)]
        rounds_at = sorted({int(st.round) for st in states})
        if len(rounds_at) > 1:
            raise FieldError("resume", f"the seeds' checkpoints are at rounds {rounds_at}; "
                                       f"one program continues seeds of one round (resume "
                                       f"the "
                                       f"others one by one)")
    return states, records


def _stack(trees: list):
    return jax.tree.map(lambda *v: jnp.stack(v), *trees)


class _SeedLoop:
    """``run_seeds``' side of ``drive``: ``initial()`` evaluates every seed's starting
    state; ``advance(r0, length)`` runs the next chunk of every live seed (one
    vmapped call, or one call per seed) and evaluates it. ``current``: the seeds'
    states, one stacked tree when vmapped, else one per seed."""

    def __init__(self, algorithm: FederatedAlgorithm, spec: RunSpec, programs, records: list,
                 current: list, seeds: np.ndarray, vmap_seeds: bool, validate: bool):
        self.algorithm, self.spec, self.programs, self.records = algorithm, spec, programs, records
        self.current, self.seeds, self.vmap_seeds = current, seeds, vmap_seeds
        self.validate = validate

    def _state(self, i: int):
        return _row(self.current[0], i) if self.vmap_seeds else self.current[i]

    def _clocked(self, per_client: dict, summary: dict) -> tuple:
        if has_clock(self.algorithm, self.spec.system):  # simulated time 0
            summary["clock_seconds"] = 0.0
        return per_client, summary

    def initial(self) -> list:
        program, data = self.programs.chunk(None, self.current[0]), self.programs.data
        if self.vmap_seeds:
            test, val = jax.device_get(program(self.seeds, self.current[0], data, None))
            outs = [(_row(test, i), _row(val, i) if self.validate else None)
                    for i in range(len(self.records))]
        else:
            outs = [jax.device_get(program(self.seeds[i], self.current[i], data, None))
                    for i in range(len(self.records))]
        return [Chunk(self._state(i), None, *self._clocked(*self.programs.evaluate(*o)), 0.0)
                for i, o in enumerate(outs)]

    def advance(self, r0: int, length: int) -> list:
        p = self.programs
        fn = p.chunk(p.first if p.one_program else length, self.current[0])
        n = np.int32(length) if p.one_program else None
        live = [i for i, rec in enumerate(self.records) if not rec.stopped]
        outs = (self._vmapped(fn, n, length, live) if self.vmap_seeds
                else self._one_by_one(fn, n, length, live))
        chunks = []
        for i in range(len(self.records)):
            if i not in outs:
                chunks.append(None)
                continue
            metrics, test, val, seconds = outs[i]
            if not np.asarray(metrics["finite"]).all():
                chunks.append(Chunk(None, metrics, None, None, seconds))
            else:
                chunks.append(Chunk(self._state(i), metrics, *p.evaluate(test, val), seconds))
        return chunks

    def _vmapped(self, fn, n, length: int, live: list) -> dict:
        """``{seed index: (metrics, test, validation, seconds)}`` of one vmapped call."""
        t = time.perf_counter()
        self.current[0], metrics, test, val = fn(self.seeds, self.current[0],
                                                 self.programs.data, n)
        metrics, test, val = jax.device_get((metrics, test, val))
        metrics = jax.tree.map(lambda m: m[:, :length], metrics)
        seconds = (time.perf_counter() - t) / len(live)
        return {i: (_row(metrics, i), _row(test, i), _row(val, i) if self.validate else None,
                    seconds) for i in live}

    def _one_by_one(self, fn, n, length: int, live: list) -> dict:
        """``{seed index: (metrics, test, validation, seconds)}`` of one call per seed."""
        outs = {}
        for i in live:
            t = time.perf_counter()
            self.current[i], metrics, test, val = fn(self.seeds[i], self.current[i],
                                                     self.programs.data, n)
            metrics, test, val = jax.device_get((metrics, test, val))
            outs[i] = (jax.tree.map(lambda m: m[:length], metrics), test, val,
                       time.perf_counter() - t)
        return outs
