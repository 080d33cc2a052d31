"""A run's settings as one value, and the checks of a run's arguments.

``RunSpec`` holds what a run *is*: its rounds, cohort, evaluation period, sampler,
local-step budgets, system, execution, placement and memory limit, the clients its
summaries cover, and its checkpoint policy. What only *watches* a run (``progress``,
``description``, ``on_eval``, ``on_rounds``, ``on_clients``, ``log``) and ``resume``
are not settings: they stay arguments of ``runner.run`` / ``sweeps.run_seeds``.

Every driver takes a spec or the same settings as keywords (one or the other)::

    spec = RunSpec(num_rounds=20, cohort_size=5, eval_every=5)
    run(algorithm, params, data, key, model=model, spec=spec)
    run_seeds(algorithm, model, data, seeds=(0, 1), spec=spec)
    sweep("qffl", {"q": [0.1, 1.0]}, data=data, model=model, spec=spec)

``RunSpec.check(data)`` checks the settings against a federation before anything is
compiled, moved or written (a bad one raises ``ValueError`` / ``TypeError`` whose
message starts with the field's name: ``hparams.FieldError``) and returns the spec
with its values normalised (integers as ``int``, a budget table as int32, a sampler
name as its sampler, ``donate`` resolved). The other checks of a run's arguments live
here too: the federation's type (``check_federation``), the model (``check_model``),
the key (``check_key``), the parameters against the model (``check_model_fits``), the
federation's test split (``check_splits``), a lazy client table's capacity
(``check_capacity``) and the system (``check_system``).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair import hparams as H
from fedjax_fair.core.generated import is_generated
from fedjax_fair.core import memory as mem
from fedjax_fair.drivers import checkpoint as ckpt
from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.core.execution import (Execution, as_execution, auto_mesh, model_profile,
                                        resolve)
from fedjax_fair.core.types import FederatedData
from fedjax_fair.scenarios import sampling
from fedjax_fair.scenarios.heterogeneity import StepBudgets
from fedjax_fair.scenarios.system import System


class RunSpec(NamedTuple):
    """A run's settings (what ``runner.run``, ``sweeps.run_seeds`` and ``sweeps.sweep``
    take as ``spec=``, or as keywords of the same names).

    num_rounds, cohort_size: rounds of the run; clients sampled per round (at most
      the federation's clients).
    eval_every: rounds per chunk; every client is evaluated after each chunk (a
      sweep evaluates its runs once, at the end).
    sampler: how each round's cohort is drawn (``scenarios.sampling``; a sweep's
      keyword default None picks ``full`` for a registered method that needs every
      client every round).
    step_budgets: None, an integer table [N] of local-step budgets, or a
      ``heterogeneity.StepBudgets`` drawn afresh every round.
    system: a ``system.System`` (availability, dropouts, a virtual clock;
      docs/participation.md): its round metrics (``system/...``) are logged with the
      others, and every evaluation records the cumulative simulated time
      ``clock_seconds`` when it has a clock.
    execution: how rounds map their clients (a strategy name or an
      ``execution.Execution``; ``Execution(mesh=...)`` splits every cohort over the
      mesh's ``clients`` axis, places the federation's splits and the client table
      split by client and plans memory per device).
    placement: ``"device"`` moves the federation to the device; ``"host"`` keeps it
      in host memory and streams each chunk's sampled cohorts in; ``"auto"`` uses the
      device when the memory plan fits and the host otherwise (``runner.run``).
    stream_layout: how streamed cohorts travel: ``"compact"`` (one device) copies
      only the chunk's real rows and each round reads its clients' windows through
      their offsets; ``"padded"`` (always under a mesh) gathers every cohort padded
      to the chunk's size bucket. Both give the same results.
    prefetch: streamed cohorts only: read and send the next chunk's cohorts in a
      background thread while the current chunk computes (the plan then counts one
      chunk's cohorts more). The same results either way.
    memory_limit: bytes the memory plan (XLA's accounting of the compiled chunk
      program plus the resident evaluation split) must fit; None: the device's free
      memory.
    summary_clients: bool [N], the clients the summaries cover (e.g. the benign ones
      of a run under attack); None: every client. Per-client metrics keep every one.
    eval_clients: evaluate a fixed random subset of this many clients at round 0 and
      after each chunk but the last (``eval_subset``: the same clients for every
      seed and method of a federation); the final evaluation covers every client.
      The per-client history (``RunResult.client_history``) keeps the subset's rows,
      with their ``client_ids``. None: every client at every evaluation.
    checkpoint_dir: commit the state with the logs here after evaluations (one step
      directory per commit, ``checkpoint.py``); None: no checkpoints.
    commit_seconds: commit after the first evaluation at least this long after the
      last commit (0: every evaluation; always at the end and on a stop request).
    donate: each chunk program takes the server state's buffers over
      (``donate_argnums``): client tables are updated in place and peak memory holds
      one state, not two; the last good state before a NaN is then kept only in the
      checkpoint, so it needs ``checkpoint_dir``. None: donate when
      ``checkpoint_dir`` is set.
    """

    num_rounds: int
    cohort_size: int
    eval_every: int = 10
    sampler: Callable = sampling.uniform
    step_budgets: Any = None
    system: Optional[System] = None
    execution: Any = "auto"
    placement: str = "auto"
    stream_layout: str = "compact"
    prefetch: bool = True
    memory_limit: Optional[int] = None
    summary_clients: Any = None
    eval_clients: Optional[int] = None
    checkpoint_dir: Optional[str] = None
    commit_seconds: float = 0.0
    donate: Optional[bool] = None

    def check(self, data: FederatedData, model=None) -> "RunSpec":
        """This spec checked against the federation ``data`` (``runner.run``'s checks:
        the same exceptions and messages), with its values normalised; ``model`` (a
        ``Model`` or its parameters) also checks ``system`` against the model's size.
        Checking a checked spec gives it back unchanged. A sampler may be given by its
        command-line name (``sampling.get``: "uniform", "full", "size"); it is
        returned as the sampler."""
        data = check_federation(data)
        num_clients = data.num_clients
        spec = self._replace(
            num_rounds=check_count(self.num_rounds, "num_rounds"),
            eval_every=check_count(self.eval_every, "eval_every"),
            cohort_size=check_cohort(self.cohort_size, num_clients))
        spec = spec._replace(
            summary_clients=check_summary_clients(self.summary_clients, num_clients),
            eval_clients=check_eval_clients(self.eval_clients, num_clients),
            step_budgets=check_step_budgets(self.step_budgets, num_clients))
        check_choices(spec.placement, spec.stream_layout, spec.commit_seconds)
        if not isinstance(spec.prefetch, (bool, np.bool_)):
            raise H.FieldError("prefetch", f"must be True or False, got {spec.prefetch!r}")
        if spec.placement == "host" and is_generated(data.train):
            raise H.FieldError("placement", "a procedural federation computes each cohort's "
                                            "rows inside the round; it has no rows on the "
                                            "host to stream (use auto or device)")
        as_execution(spec.execution)
        spec = spec._replace(sampler=check_sampler(spec.sampler, data),
                             checkpoint_dir=ckpt.check_directory(spec.checkpoint_dir))
        spec = spec._replace(donate=check_donate(spec.donate, spec.checkpoint_dir))
        if model is not None and spec.system is not None:
            check_system(spec.system, data, model, spec.sampler)
        return spec


class _Default:
    """The default of a settings keyword left out (``DEFAULT``): the field's default in
    ``RunSpec``, or the spec's value when ``spec=`` is given."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT = _Default()


def as_spec(spec: Optional[RunSpec], caller: str, settings: dict,
            takes=RunSpec._fields) -> RunSpec:
    """The ``RunSpec`` of a driver's call: ``spec``, or one made of the ``settings``
    keywords given (``DEFAULT``: left out). A settings keyword given with ``spec`` is a
    ``TypeError`` naming it (``hparams.FieldTypeError``), and a field of ``spec`` that
    ``caller`` does not take (not in ``takes``) must keep its default
    (``FieldError`` naming it)."""
    given = {k: v for k, v in settings.items() if v is not DEFAULT}
    if spec is None:
        missing = [k for k in ("num_rounds", "cohort_size") if k not in given]
        if missing:  # Python's own message for a missing keyword-only argument
            names = " and ".join(repr(k) for k in missing)
            raise TypeError(f"{caller}() missing {len(missing)} required keyword-only argument"
                            f"{'s' if len(missing) > 1 else ''}: {names}")
        return RunSpec(**given)
    if not isinstance(spec, RunSpec):
        raise H.FieldTypeError("spec", f"must be a RunSpec, got {type(spec).__name__}")
    if given:
        name = next(iter(given))
        raise H.FieldTypeError(name, f"given to {caller}() both as a keyword and in spec=; "
                                     f"set it in the spec (spec._replace({name}=...)) or "
                                     f"leave spec out")
    for name in RunSpec._fields:
        if name not in takes and not _is_default(name, getattr(spec, name)):
            raise H.FieldError(name, f"{caller}() does not take this setting (its settings: "
                                     f"{', '.join(takes)}); leave it at its default "
                                     f"{RunSpec._field_defaults[name]!r}")
    return spec


def _is_default(name: str, value) -> bool:
    """Whether ``value`` is ``RunSpec``'s default of field ``name``."""
    default = RunSpec._field_defaults[name]
    if default is None or value is None:
        return value is default
    if isinstance(default, bool):  # True is not the default 1, nor 1 the default True
        return isinstance(value, (bool, np.bool_)) and bool(value) is default
    try:
        return not isinstance(value, bool) and bool(value == default)
    except Exception:  # noqa: BLE001 - an array compared with a default
        return False


# ------------------------------------------------------------------ the settings' checks


def check_federation(data) -> FederatedData:
    """``data`` is a ``FederatedData``: a ``data.Dataset`` (which ``sweeps.sweep`` and
    ``sweeps.run_seeds`` take and unwrap, ``sweeps.as_federation``) or anything else is a
    ``FieldTypeError("data")`` saying what to pass."""
    if isinstance(data, FederatedData):
        return data
    if hasattr(data, "host_data") and hasattr(data, "data"):  # a data.Dataset
        raise H.FieldTypeError("data", "got a data.Dataset; pass its federation, "
                                       "dataset.data (a FederatedData)")
    raise H.FieldTypeError("data", f"must be a FederatedData (data.get_dataset(...).data, "
                                   f"data.federated.from_client_arrays(...)), got "
                                   f"{type(data).__name__}")


def check_model(model):
    """``model`` is a ``models.Model`` (what has its ``init``, ``per_example_loss`` and
    ``per_example_metrics``); else ``FieldError("model")`` / ``FieldTypeError("model")``."""
    if model is None:
        raise H.FieldError("model", "is required: the Model whose parameters are trained "
                                    "(model=...); it checks the parameters and evaluates "
                                    "every client")
    missing = [a for a in ("init", "per_example_loss", "per_example_metrics")
               if not callable(getattr(model, a, None))]
    if missing:
        raise H.FieldTypeError("model", f"must be a models.Model (get_model(...)), got "
                                        f"{type(model).__name__} without {', '.join(missing)}")
    return model


def require_sampler(sampler) -> None:
    """A run's sampler is given (a sweep's may be None: the method decides)."""
    if sampler is None:
        raise H.FieldTypeError("sampler", "must be a sampler of scenarios.sampling or its "
                                          "name, got None")


def check_sampler(sampler, data: FederatedData):
    """A cohort sampler: a callable ``(key, num_clients, cohort_size) -> ids``
    (``scenarios.sampling``), or a command-line name (``sampling.get``: "uniform",
    "full", "size", the last from ``data``'s training sizes), returned as the sampler;
    None (a sweep's: the method decides) passes. Else ``FieldError("sampler")``."""
    if sampler is None or callable(sampler):
        return sampler
    if isinstance(sampler, str):
        return sampling.get(sampler, np.asarray(data.train.num_examples))
    raise H.FieldTypeError("sampler", f"must be a sampler of scenarios.sampling (uniform, "
                                      f"full, by_size(sizes), weighted(w)) or its name "
                                      f"({', '.join(sampling.SAMPLERS)}), got "
                                      f"{type(sampler).__name__} {sampler!r}")


def check_count(value, field: str) -> int:
    """A positive Python / NumPy integer as an int (``hparams.count``)."""
    return H.count(value, field)


def check_cohort(cohort_size, num_clients: int) -> int:
    """``cohort_size`` as an int: a count, at most the federation's ``num_clients``."""
    cohort_size = H.count(cohort_size, "cohort_size")
    if cohort_size > num_clients:
        raise H.FieldError("cohort_size", f"{cohort_size} is more than the {num_clients} "
                                          f"clients of the federation")
    return cohort_size


def check_eval_clients(size, num_clients: int) -> Optional[int]:
    """``size`` as an int in [1, N] (None stays None)."""
    if size is None:
        return None
    size = H.count(size, "eval_clients")
    if size > num_clients:
        raise H.FieldError("eval_clients", f"{size} is more than the {num_clients} clients "
                                           f"of the federation")
    return size


def eval_subset(num_clients: int, size: Optional[int]) -> np.ndarray:
    """The clients the intermediate evaluations cover (int32, sorted): every client when
    ``size`` is None or N, else ``size`` of them drawn without replacement by NumPy's
    generator seeded 0, a function of (N, size) alone, so every seed and method of a
    comparison is measured on the same clients."""
    if size is None or size >= num_clients:
        return np.arange(num_clients, dtype=np.int32)
    ids = np.random.default_rng(0).choice(num_clients, size, replace=False)
    return np.sort(ids).astype(np.int32)


def check_summary_clients(keep, num_clients: int):
    """``keep`` as bool [N] (None stays None); ``FieldError("summary_clients")``
    otherwise, or when it keeps no client."""
    if keep is None:
        return None
    keep = np.asarray(keep)
    if keep.dtype != bool or keep.shape != (num_clients,) or not keep.any():
        raise H.FieldError("summary_clients", f"must be a bool array [{num_clients}] with "
                                              f"some client kept, got {keep.dtype} "
                                              f"{keep.shape}")
    return keep


def check_step_budgets(step_budgets, num_clients: int):
    """None, a ``heterogeneity.StepBudgets``, or a table [N] of non-negative integer
    local-step budgets (returned as int32)."""
    if step_budgets is None or isinstance(step_budgets, StepBudgets):
        return step_budgets
    expected = ("must be None, an integer array [N] of local-step budgets or a "
                "heterogeneity.StepBudgets (cli.parsing.parse_budgets turns text such as "
                "'fixed:2' into one)")
    if isinstance(step_budgets, (list, tuple)):
        step_budgets = np.asarray(step_budgets)
    if not isinstance(step_budgets, (jax.Array, np.ndarray)):
        raise H.FieldTypeError("step_budgets", f"{expected}, got {type(step_budgets).__name__} "
                                               f"{step_budgets!r}")
    if step_budgets.dtype == np.bool_ or not jnp.issubdtype(step_budgets.dtype, jnp.integer):
        raise H.FieldTypeError("step_budgets", f"{expected}, got an array of dtype "
                                               f"{step_budgets.dtype}")
    if step_budgets.shape != (num_clients,):
        raise H.FieldError("step_budgets", f"a table needs one budget per client, shape "
                                           f"({num_clients},), got shape {step_budgets.shape}")
    if not isinstance(step_budgets, jax.core.Tracer) and np.any(np.asarray(step_budgets) < 0):
        raise H.FieldError("step_budgets", "budgets are local-step counts, must be >= 0")
    return step_budgets.astype(jnp.int32 if isinstance(step_budgets, jax.Array)
                               else np.int32)


def check_choices(placement: str, stream_layout: str, commit_seconds) -> None:
    """``placement`` and ``stream_layout`` are among their choices; ``commit_seconds``
    is a number of seconds >= 0."""
    if placement not in mem.PLACEMENTS:
        raise H.FieldError("placement", f"must be one of {list(mem.PLACEMENTS)}, got {placement!r}")
    if stream_layout not in ("compact", "padded"):
        raise H.FieldError("stream_layout", f"must be 'compact' or 'padded', got {stream_layout!r}")
    if (isinstance(commit_seconds, (bool, np.bool_))
            or not isinstance(commit_seconds, (int, float, np.integer, np.floating))
            or not 0 <= commit_seconds < float("inf")):
        raise H.FieldError("commit_seconds", f"must be a number of seconds >= 0, got "
                                             f"{commit_seconds!r}")


def check_donate(donate, checkpoint_dir) -> bool:
    """``donate`` resolved (None: when there is a checkpoint to keep the last good state)."""
    if donate is None:
        return checkpoint_dir is not None
    if not isinstance(donate, bool):
        raise H.FieldTypeError("donate", f"must be True, False or None, got {donate!r}")
    if donate and checkpoint_dir is None:
        raise H.FieldError("donate", "a donated chunk consumes its input state, so the last good "
                                     "state before a NaN is kept only in the checkpoint; give "
                                     "checkpoint_dir or donate=False")
    return donate


def check_system(system, data: FederatedData, params, sampler) -> None:
    """``system`` is a ``system.System`` that fits ``data`` (``System.check``), for
    a model of ``params`` (a pytree, or a ``Model`` whose init gives its shapes)."""
    if not isinstance(system, System):
        raise H.FieldTypeError("system", f"must be None or a system.System, got "
                                         f"{type(system).__name__}")
    if hasattr(params, "init"):  # a Model: its parameters' shapes
        params = jax.eval_shape(params.init, jax.random.key(0))
    system.check(data.num_clients, np.asarray(data.train.num_examples), mem.tree_bytes(params),
                 sampler)


# ------------------------------------------------------------------ the other arguments


def check_key(key):
    """The run's PRNG key: a typed key (``jax.random.key``) or a legacy raw uint32 key
    (``jax.random.PRNGKey``, of the default implementation's shape), both of which the
    engine's ``fold_in`` / ``split`` take; one key, not a batch."""
    if isinstance(key, (jax.Array, np.ndarray)):
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            if key.shape != ():
                raise H.FieldError("key", f"must be one key, got an array of keys of shape "
                                          f"{key.shape}")
            return key
        if key.ndim == 1:
            try:  # shape and dtype against the default implementation; no compute
                jax.eval_shape(jax.random.wrap_key_data, jax.ShapeDtypeStruct(key.shape,
                                                                              key.dtype))
            except (TypeError, ValueError):
                pass
            else:
                return jnp.asarray(key)
        described = f"an array of dtype {key.dtype} and shape {key.shape}"
    else:
        described = f"{type(key).__name__} {key!r}"
    raise H.FieldTypeError("key", f"must be a jax.random.key(seed) (or a legacy "
                                  f"jax.random.PRNGKey(seed)), got {described}")


def check_model_fits(model, params, data) -> None:
    """``params`` have the tree and shapes of ``model.init``'s, and ``model``'s loss
    reads one example of ``data``'s training inputs: checked with ``jax.eval_shape``
    alone (nothing compiled), so that another model's parameters or inputs of another
    shape fail here naming the argument, not deep inside flax while compiling.
    ``params`` None: the model's own (only the data is checked)."""
    check_model(model)
    name = getattr(model, "name", type(model).__name__)
    expected = jax.eval_shape(model.init, jax.random.key(0))
    if params is None:
        params = expected
    want = jax.tree_util.tree_flatten_with_path(expected)[0]
    try:
        got = jax.tree_util.tree_flatten_with_path(params)[0]
    except Exception:  # noqa: BLE001 - not a pytree at all
        got = None
    want_paths = [jax.tree_util.keystr(p) for p, _ in want]
    got_paths = [jax.tree_util.keystr(p) for p, _ in got or ()]
    if got is None or got_paths != want_paths:  # (a FrozenDict for a dict is the same tree)
        missing = [p for p in want_paths if p not in got_paths]
        extra = [p for p in got_paths if p not in want_paths]
        detail = (f"missing {missing[0]}" if missing else
                  f"unexpected {extra[0]}" if extra else "another tree structure")
        raise H.FieldError("params", f"not the parameters of model {name!r} ({len(got_paths)} "
                                     f"arrays, the model has {len(want_paths)}; {detail}); give "
                                     f"model.init(key) of the model passed as model=")
    for (path, w), (_, g) in zip(want, got):
        if tuple(np.shape(g)) != tuple(w.shape):
            raise H.FieldError("params", f"{jax.tree_util.keystr(path)} has shape "
                                         f"{tuple(np.shape(g))}, model {name!r} expects "
                                         f"{tuple(w.shape)}")
    one = {k: jax.ShapeDtypeStruct((1, *np.shape(v)[2:]), v.dtype)
           for k, v in data.train.examples.items()}
    try:
        jax.eval_shape(lambda p, b: model.per_example_loss(p, b, jax.random.key(0)),
                       expected, one)
    except Exception as e:  # noqa: BLE001 - flax raises several types for a wrong shape
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        inputs = ", ".join(f"{k} {v.dtype}{tuple(v.shape[1:])}" for k, v in one.items())
        raise H.FieldError("data", f"model {name!r} cannot read the training inputs "
                                   f"({inputs}): {first}") from None


def check_splits(data: FederatedData) -> bool:
    """Some client has test data (``FieldError("data")`` otherwise); returns whether a
    validation split with examples is there to evaluate too."""
    if not np.asarray(data.test.num_examples).sum() > 0:
        raise H.FieldError("data", "no client has a test example; run evaluates every client "
                                   "on its test split")
    return (data.validation is not None
            and bool(np.asarray(data.validation.num_examples).sum() > 0))


def check_capacity(algorithm: FederatedAlgorithm, num_clients: int, cohort_size: int,
                   num_rounds: int) -> None:
    """Before compute: a lazy client table must hold every client the run can write."""
    capacity = algorithm.client_table.capacity if algorithm.client_table else None
    needed = min(num_clients, cohort_size * num_rounds)
    if capacity is not None and capacity < needed:
        raise H.FieldError("client_table", f"the lazy table holds {capacity} clients but this run "
                                           f"can write {needed} (min(N, cohort_size x "
                                           f"num_rounds)); give a "
                                           f"capacity of at least {needed}")


def require_device_tables(state, what: str) -> None:
    """Host and disk client tables (``client_states.host`` / ``disk``) hold one run's
    rows outside the program, continued by ``runner.run`` alone: ``what`` (runs vmapped
    or differentiated together) refuses them, before compute."""
    from fedjax_fair.core.client_states import outside_tables
    if outside_tables(state):
        raise H.FieldError("client_table", f"a host or disk table keeps one run's rows outside "
                                           f"the program; {what} needs the dense or lazy "
                                           f"table (runner.run takes host and disk tables)")


def holds_rows_outside(algorithm: FederatedAlgorithm, model, num_clients: int) -> bool:
    """Whether ``algorithm``'s state has a host or disk client table (from its
    shapes: nothing is allocated)."""
    from fedjax_fair.core.client_states import outside_tables
    shapes = jax.eval_shape(lambda k: algorithm.init(model.init(k), num_clients),
                            jax.random.key(0))
    return bool(outside_tables(shapes))


def one_example(data: FederatedData) -> dict:
    """Shapes and dtypes of one training example of ``data`` (no client or row axis)."""
    return {k: jax.ShapeDtypeStruct(np.shape(v)[2:], v.dtype)
            for k, v in data.train.examples.items()}


def resolved_execution(execution, cohort_size: int, num_clients: int, model=None,
                       data: Optional[FederatedData] = None) -> Execution:
    """``execution`` with "auto" fixed for this run: several CPU devices that split the
    federation get a mesh (the federation and the client tables are placed over them
    too); else one device and the strategy ``execution.choose`` picks for ``model``
    on ``data``'s examples, so that the round does not split its cohort over devices
    its arguments are not on. A mesh keeps "auto" with the model's profile (each
    device chooses for its share)."""
    execution = as_execution(execution)
    if execution.strategy != "auto":
        return execution
    if execution.model is None and model is not None and data is not None:
        execution = execution._replace(model=model_profile(model, one_example(data)))
    if execution.mesh is None:
        mesh = auto_mesh(cohort_size, num_clients=num_clients)
        if mesh is not None:
            return execution._replace(mesh=mesh)
        strategy, chunk = resolve("auto", cohort_size, chunk_size=execution.chunk_size,
                                  model=execution.model)
        execution = execution._replace(strategy=strategy, chunk_size=chunk)
    return execution


def check_run(algorithm: FederatedAlgorithm, params, data: FederatedData, key, model,
              spec: RunSpec) -> tuple:
    """``runner.run``'s arguments checked before anything is compiled, moved or written:
    ``(spec checked with its execution resolved, key, whether a validation split is
    evaluated)``."""
    check_federation(data)
    check_model(model)
    spec = spec.check(data)
    require_sampler(spec.sampler)
    key = check_key(key)
    check_model_fits(model, params, data)
    validate = check_splits(data)
    spec = spec._replace(execution=resolved_execution(spec.execution, spec.cohort_size,
                                                      data.num_clients, model, data))
    check_capacity(algorithm, data.num_clients, spec.cohort_size, spec.num_rounds)
    if spec.system is not None:
        check_system(spec.system, data, params, spec.sampler)
    return spec, key, validate
