"""A run's programs: ``make_programs`` builds, from a run's settings (``spec.RunSpec``),
the compiled chunk programs, the evaluator of every client and the memory plan.

A whole run is one function of its configuration (``make_programs(algorithm, model,
data, spec, ...)``); the drivers only call what it returns, chunk after chunk, through
``runner.drive``:

* ``runner.run``: chunk programs of ``simulate`` per chunk length (on a CPU one,
  cut short by ``active_rounds``), on the resident federation or on cohorts streamed
  from the host (compact or padded, one program per size bucket); each is shared
  with later runs of the process through the program cache (``_PROGRAMS``); the
  evaluators are compiled ahead of time in a background thread while XLA compiles
  the first chunk program. The memory plan (``core/memory.py``) decides the
  placement before any data moves.
* ``sweeps.run_seeds`` (``seeds=``): one program per chunk length running every
  seed's chunk and evaluating every client inside it (the seeds vmapped, or one call
  per seed), and a device plan (``plan.fits`` False: nothing has run).
* ``sweeps.sweep`` runs whole runs vmapped over a grid; it shares
  ``simulate_chunk`` (the round program of every driver) and ``evaluate_state``.

Placement (memory.py): the federation stays on the device if the plan fits, else it
stays on the host and each chunk's cohorts are gathered there, padded to their size
bucket, and streamed in; a plan that cannot fit stops with a clear error before
any data moves. Under ``Execution(mesh=...)`` (sharding.py) "the device" is every
device of the mesh: the federation, streamed cohorts and client tables are split by
client, the rest of the state replicated, and the plan counts bytes per device.
"""
from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair import metrics as fairness
from fedjax_fair.core import memory as mem
from fedjax_fair.core import sharding
from fedjax_fair.core.algorithm import FederatedAlgorithm, ServerState
from fedjax_fair.core.evaluation import make_state_evaluator, state_evaluator_program
from fedjax_fair.core.execution import CLIENT_AXIS, compiler_options
from fedjax_fair.core.types import ClientData, Cohort, FederatedData
from fedjax_fair.data.disk import is_on_disk
from fedjax_fair.core.generated import is_generated
from fedjax_fair.drivers.simulate import simulate, simulate_cohorts
from fedjax_fair.drivers.spec import RunSpec, eval_subset
from fedjax_fair.scenarios.heterogeneity import StepBudgets


class _ProgramCache:
    """Compiled chunk programs shared by the runs of one process (the seeds of a
    ``compare``, a resume): keyed by the algorithm object, the chunk's static settings
    and the shapes of the arguments, so a second run of the same algorithm on data of
    the same shapes does not compile again. Keeps the ``size`` most recent."""

    def __init__(self, size: int = 16):
        self.size, self.items = size, {}

    def get(self, key):
        try:
            value = self.items.pop(key)
        except (KeyError, TypeError):  # TypeError: an unhashable piece, never cached
            return None
        self.items[key] = value
        return value

    def put(self, key, value) -> None:
        try:
            self.items[key] = value
        except TypeError:
            return
        while len(self.items) > self.size:
            self.items.pop(next(iter(self.items)))


_PROGRAMS = _ProgramCache()  # runner._PROGRAMS is this cache (run passes its own name)


class Programs(NamedTuple):
    """What ``make_programs`` builds for a run (or for the seeds of one run).

    chunk: the compiled chunk programs. ``runner.run``'s: ``(length, padded_size=None,
      num_rows=None) -> Compiled`` (``RunPrograms``); ``run_seeds``': ``(length,
      states) -> Compiled`` (``SeedPrograms``; length None: the evaluation alone).
    evaluate: ``runner.run``'s: ``state -> (per-client test metrics {name: [N]},
      summary)`` (``Evaluation``); ``run_seeds``': ``(test, validation) -> (per-client
      test metrics, summary)`` of a program's outputs (``SeedSummaries``).
    plan: the memory plan (``memory.MemoryPlan``); the seeds' may not fit, and then
      nothing has run.
    data: the federation, placed as the plan says (device or host arrays).
    step_budgets: the budget table placed with it (None: no table, or ``drawn``).
    drawn: the ``heterogeneity.StepBudgets`` drawn every round, else None.
    first: the first chunk's length (a CPU's one chunk program).
    one_program: whether one chunk program runs chunks of every length (a CPU:
      ``simulate``'s ``active_rounds``) instead of one program per length.
    """

    chunk: Callable
    evaluate: Callable
    plan: mem.MemoryPlan
    data: FederatedData
    step_budgets: Any
    drawn: Optional[StepBudgets]
    first: int
    one_program: bool


def make_programs(algorithm: FederatedAlgorithm, model, data: FederatedData, spec: RunSpec,
                  *, state, key=None, validate: bool = False, seeds=None,
                  vmap_seeds: bool = False, clock=None, bar=None, log=None,
                  cache: Optional[_ProgramCache] = None) -> Programs:
    """The programs of one run of ``algorithm`` under ``spec`` on ``data``: the chunk
    programs, the evaluator and the memory plan, with the federation placed.

    ``spec``: checked as ``spec.check_run`` returns it (its ``execution`` resolved to
    an ``Execution``). ``state``: the run's starting state (``algorithm.init``, or a
    resumed one; under a mesh, placed): the programs' argument shapes and the first
    chunk's round. ``key``: the run's key. ``validate``: evaluate the validation split
    too. ``clock`` (``runner.CompileClock``) counts every lower + compile, ``bar`` (a
    progress bar) says "compiling" meanwhile, ``log`` receives the data layout's note
    and the plan's line. ``cache``: the compiled programs shared by the runs of the
    process (default: this module's). A plan that cannot fit raises
    ``memory.MemoryBudgetError`` before any data moves.

    ``seeds`` (uint32 [S]): the programs of ``sweeps.run_seeds`` instead, every seed's
    chunk keyed by ``jax.random.key(seed)``, vmapped over the seeds (``vmap_seeds``,
    ``state`` then stacked [S, ...]) or one call per seed (``state`` one seed's); the
    federation goes to the device, and a plan that does not fit is returned unlogged.
    """
    if seeds is not None:
        return _seed_programs(algorithm, model, data, spec, state, seeds, vmap_seeds,
                              validate, log)
    mesh = spec.execution.mesh
    one_program = (jax.default_backend() if mesh is None
                   else mesh.devices.flat[0].platform) == "cpu"
    first = max(1, min(spec.eval_every, spec.num_rounds - int(state.round)))
    drawn = spec.step_budgets if isinstance(spec.step_budgets, StepBudgets) else None
    step_budgets = None if drawn is not None else spec.step_budgets
    data_layout = None
    if mesh is not None:
        data_layout, note = sharding.federation_shardings(mesh, data)
        if note and log:
            log(note)
    evaluation = Evaluation(model, algorithm, spec, state, data, validate, data_layout, bar)
    chunk = RunPrograms(algorithm, spec, state, data, data_layout, key, step_budgets, drawn,
                        one_program, _PROGRAMS if cache is None else cache, clock, bar,
                        on_lowered=evaluation.start)
    plan = _memory_plan(chunk, first, data, mesh, spec.placement, spec.memory_limit,
                        _cohort_shapes(data.train, first, spec.cohort_size,
                                       data.train.mask.shape[1]) if spec.prefetch else None)
    evaluation.start()  # (the chunk program came from this process's cache)
    if log:
        log(plan.describe())
    data, step_budgets = _place(plan, data, data_layout, step_budgets, mesh)
    chunk.data, chunk.step_budgets = data, step_budgets
    evaluation.place(plan, data)
    return Programs(chunk, evaluation, plan, data, step_budgets, drawn, first, one_program)


def closed_table(step_budgets):
    """A budget table that a traced program closes over, as a jax array (a NumPy table
    cannot be indexed by the traced client ids); None or a ``StepBudgets`` as it is."""
    return jnp.asarray(step_budgets) if isinstance(step_budgets, np.ndarray) else step_budgets


def simulate_chunk(algorithm: FederatedAlgorithm, spec: RunSpec, length: int, state, data,
                   key, step_budgets=None, active_rounds=None):
    """``simulate`` of ``length`` rounds under ``spec``'s settings (cohort size, sampler,
    execution, system) with the step budgets ``step_budgets``: the round program of
    every driver (``runner.run``'s resident chunks, ``run_seeds``' chunks, ``sweep``'s
    whole runs)."""
    return simulate(algorithm, state, data, key, num_rounds=length,
                    cohort_size=spec.cohort_size, sampler=spec.sampler,
                    step_budgets=step_budgets, execution=spec.execution,
                    active_rounds=active_rounds, system=spec.system)


# ------------------------------------------------------------------ run's chunk programs


def _signature(args):
    """Tree structure, shapes and dtypes of a program's arguments (a hashable key)."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((tuple(np.shape(x)), str(x.dtype)) for x in leaves)


def _replicated(mesh):
    return None if mesh is None else sharding.replicated(mesh)


def _abstract(tree, shardings=None):
    """Shapes and dtypes of ``tree`` (and, under a mesh, the layout ``shardings``)."""
    if shardings is not None:
        return sharding.abstract(tree, jax.tree.map(lambda _: shardings, tree)
                                 if isinstance(shardings, jax.sharding.Sharding) else shardings)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _pinned(f: Callable, mesh) -> Callable:
    """``f`` whose returned state keeps the state's layout on a mesh (the next chunk's
    program takes it as compiled; XLA may otherwise give a per-client aggregator
    table, FedLF's, another layout)."""
    def chunk_program(*args):  # the name compile_programs reports
        new_state, metrics = f(*args)
        return sharding.constrain_state(new_state, mesh), metrics
    return chunk_program


class RunPrograms:
    """``runner.run``'s compiled chunk programs: ``(length, padded_size=None,
    num_rows=None) -> Compiled``, ``length`` rounds on the resident federation
    (``padded_size`` None: ``simulate``), or on streamed cohorts padded to
    ``padded_size`` rows per client (``simulate_cohorts``) or compact (``num_rows``
    rows, ``_simulate_compact``). Each is compiled once per run and shared with later
    runs of the process through ``cache``, keyed by the algorithm (not its ``init``),
    the settings and the arguments' shapes. ``on_lowered()`` is called once a program
    is lowered, before XLA compiles it (the evaluators' tracing then no longer
    contends for the GIL). ``data`` / ``step_budgets``: what the resident programs'
    shapes come from (the placed federation, once placed)."""

    def __init__(self, algorithm: FederatedAlgorithm, spec: RunSpec, state, data, data_layout,
                 key, step_budgets, drawn, one_program: bool, cache: _ProgramCache,
                 clock=None, bar=None, on_lowered: Optional[Callable] = None):
        self.algorithm, self.spec, self.state, self.key = algorithm, spec, state, key
        self.data, self.data_layout, self.step_budgets = data, data_layout, step_budgets
        self.drawn, self.one_program, self.cache = drawn, one_program, cache
        self.clock, self.bar, self.on_lowered = clock, bar, on_lowered
        self.compiled: dict = {}

    def __call__(self, length: int, padded_size: Optional[int] = None,
                 num_rows: Optional[int] = None):
        name = (length, padded_size, num_rows)
        if name not in self.compiled:
            self._postfix("compiling")
            t = time.time()
            fn, args = self._program(length, padded_size, num_rows)
            spec, donate = self.spec, self.spec.donate
            # the program never calls ``init``: algorithms that differ only there (the
            # CLI's per-seed FedEvg / FedCVAE initial states) share their programs
            signature = (self.algorithm._replace(init=None), length, padded_size, num_rows,
                         spec.cohort_size, spec.sampler, self.drawn, spec.execution, donate,
                         spec.system, _signature(args))
            self.compiled[name] = self.cache.get(signature)
            if self.compiled[name] is None:  # not compiled by an earlier run of this process
                lowered = fn.lower(*args)
                if self.on_lowered is not None:
                    self.on_lowered()
                self.compiled[name] = lowered.compile(compiler_options("rounds"))
                self.cache.put(signature, self.compiled[name])
            if self.clock is not None:
                self.clock.add(t, time.time())  # the whole lower + compile, Python included
            self._postfix("")
        return self.compiled[name]

    def _postfix(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text)

    def _program(self, length: int, padded_size: Optional[int], num_rows: Optional[int]):
        """``(jitted program, its arguments' shapes)``."""
        algorithm, spec, state, key = self.algorithm, self.spec, self.state, self.key
        mesh, execution = spec.execution.mesh, spec.execution
        donated = (0,) if spec.donate else ()
        if padded_size is None:
            drawn = self.drawn
            fn = jax.jit(_pinned(lambda s, d, k, b, n: simulate_chunk(
                algorithm, spec, length, s, d, k, drawn or b, n), mesh), donate_argnums=donated)
            budgets = self.step_budgets
            return fn, (state, _abstract(self.data, self.data_layout), key,
                        budgets if mesh is None else _abstract(budgets, _replicated(mesh)),
                        None if not self.one_program else
                        jax.ShapeDtypeStruct((), jnp.int32, sharding=_replicated(mesh)))
        if num_rows is not None:
            fn = jax.jit(_pinned(lambda s, c, k: _simulate_compact(
                algorithm, s, c, k, padded_size, execution), mesh), donate_argnums=donated)
            return fn, (state, mem.compact_chunk_shapes(self.data.train.examples, length,
                                                        spec.cohort_size, num_rows), key)
        fn = jax.jit(_pinned(lambda s, c, k: simulate_cohorts(
            algorithm, s, c, k, execution=execution), mesh), donate_argnums=donated)
        shapes = _cohort_shapes(self.data.train, length, spec.cohort_size, padded_size)
        return fn, (state, _abstract(shapes, None if mesh is None
                                     else sharding.cohort_shardings(mesh, shapes)), key)


def _simulate_compact(algorithm: FederatedAlgorithm, state: ServerState,
                      chunk: "mem.CompactChunk", key, padded_size: int, execution):
    """``simulate_cohorts`` over a chunk in the compact layout: each round builds its
    cohort's client windows [K, padded_size] from the chunk's rows (one round's views
    at a time, never the chunk's R x K x padded_size block)."""
    from fedjax_fair.drivers.simulate import _play, round_keys

    def round_fn(state, xs):
        offsets, sizes, ids, steps, mask = xs
        cohort = Cohort(client_ids=ids,
                        data=mem.compact_views(chunk.rows, offsets, sizes, padded_size),
                        client_mask=mask, local_steps=steps)
        return _play(algorithm, state, cohort, round_keys(key, state.round)[1], execution)

    return jax.lax.scan(round_fn, state, (chunk.offsets, chunk.sizes, chunk.client_ids,
                                          chunk.local_steps, chunk.client_mask))


def _cohort_shapes(train: ClientData, num_rounds: int, cohort_size: int,
                   padded_size: int) -> Cohort:
    """Shapes of ``gather_cohorts``' output (nothing allocated)."""
    lead = (num_rounds, cohort_size)
    sds = jax.ShapeDtypeStruct
    data = jax.tree.map(lambda v: sds((*lead, padded_size, *v.shape[2:]) if v.ndim > 1 else lead,
                                      v.dtype), train)
    return Cohort(sds(lead, jnp.int32), data, sds(lead, jnp.bool_), sds(lead, jnp.int32))


def _memory_plan(program: Callable, first: int, data: FederatedData, mesh, placement: str,
                 memory_limit: Optional[int], prefetched=None) -> mem.MemoryPlan:
    """Where the federation goes: on the device when the first chunk's ``program`` plus
    the resident evaluation splits fit (``placement`` "auto" or "device"), else on the
    host with each chunk's cohorts streamed in, planned at the worst case (every
    cohort padded to the federation's M; the chunks then compile per size bucket
    actually sampled), plus the next chunk's cohorts read meanwhile (``prefetched``,
    their shapes; None: no prefetch). ``memory.MemoryBudgetError`` when no plan fits."""
    devices = 1 if mesh is None else mesh.devices.size
    capacity = ((mem.device_capacity() if mesh is None else mem.mesh_capacity(mesh))
                if memory_limit is None else int(memory_limit))
    # a federation memory-mapped from disk (data/disk.py) is streamed unless told
    # otherwise: the point of preparing it is not to hold it
    if placement == "device" or (placement == "auto" and not is_on_disk(data)):
        evaluated = (data.test, data.validation)
        resident = (mem.tree_bytes(evaluated) if mesh is None else sharding.device_bytes(
            evaluated, sharding.federation_shardings(mesh, data)[0][1:]))
        plan = mem.MemoryPlan("device", resident, mem.program_bytes(program(first)),
                              capacity, devices, is_generated(data.train))
        if plan.fits:
            return plan
        if is_generated(data.train):  # nothing to stream: its rows are computed in the round
            raise mem.too_big(plan, "A generated federation's rounds compute their cohort "
                                    "inside the program: lower cohort_size, or use "
                                    "execution='chunked' with a smaller chunk_size.")
        if placement == "device":
            raise mem.too_big(plan, "Use placement='host' to keep the federation in host "
                                    "memory and stream each chunk's cohorts, or a smaller "
                                    "cohort_size / chunk_size.")
    ahead = 0 if prefetched is None else mem.tree_bytes(prefetched) // devices
    plan = mem.MemoryPlan("host", ahead, mem.program_bytes(
        program(first, data.train.mask.shape[1])), capacity, devices)
    if not plan.fits:
        raise mem.too_big(plan, "Streamed cohorts of one chunk must fit: lower eval_every "
                                "(rounds per chunk), cohort_size, or use "
                                "execution='chunked' with a smaller chunk_size.")
    return plan


def _place(plan: mem.MemoryPlan, data: FederatedData, data_layout, step_budgets, mesh):
    """``(data, step_budgets)`` where ``plan`` puts them: on the device(s) (under a mesh,
    the federation as ``data_layout``, the table replicated) or as host arrays."""
    if plan.placement == "device":
        put = jax.device_put if mesh is None else sharding.put
        data = put(data, data_layout)
        return data, None if step_budgets is None else put(step_budgets, _replicated(mesh))
    return _host(data), None if step_budgets is None else np.asarray(step_budgets)


# ------------------------------------------------------------------ run's evaluation


_EVAL_CLIENTS = 256  # clients per evaluation call of a streamed (host) federation
_GENERATED_BLOCK = 1 << 16  # clients per evaluation call of a generated federation


def generated_block(num_clients: int) -> int:
    """Clients per evaluation call of a generated federation: every client in one call
    up to ``_GENERATED_BLOCK``, else blocks of it (a progress step each)."""
    return min(num_clients, _GENERATED_BLOCK)


def _evaluate_generated(evaluate, state, split, client_ids: np.ndarray, block: int,
                        progress=None) -> dict:
    """``evaluate(state, split, ids)`` of a generated split over ``client_ids`` [n], a
    block of ``block`` ids per call (the last padded with repeats of its first, whose
    results are dropped), so one compiled program serves every call; ``progress(done)``
    after each block."""
    parts = []
    for start in range(0, len(client_ids), block):
        ids = client_ids[start:start + block]
        out = sharding.to_host(evaluate(state, split, np.resize(ids, block)))
        parts.append({k: np.asarray(v)[:len(ids)] for k, v in out.items()})
        if progress is not None:
            progress(start + len(ids))
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


_COMPILER = None  # one background thread compiling evaluators for every run
_QUEUED: list = []  # while_compiling's functions, for the next run's compile thread


def while_compiling(fn: Callable[[], Any]) -> None:
    """Runs ``fn()`` once, in the thread that compiles the evaluators, after the next
    run's evaluators: while XLA compiles that run's first chunk program, which holds no
    GIL and leaves a core idle once the evaluators are done. For work a command's end
    will need that holds the GIL (``run`` imports matplotlib here): done earlier, while
    the program is traced, it would slow the tracing; during the rounds, it takes a
    core from them. ``fn``'s exceptions are dropped; what needs its result does the
    work itself if it has not run."""
    _QUEUED.append(fn)


def _run_queued() -> None:
    def quietly(fn):
        try:
            fn()
        except Exception:  # noqa: BLE001  (while_compiling: the caller redoes the work)
            pass

    compiler = _compiler()
    while _QUEUED:
        compiler.submit(quietly, _QUEUED.pop(0))


def _compiler():
    """The background compile thread's executor (created once)."""
    import concurrent.futures
    global _COMPILER
    if _COMPILER is None:
        _COMPILER = concurrent.futures.ThreadPoolExecutor(1, "fedjax-fair-compile")
    return _COMPILER


def _compile_evaluators(model, algorithm, state, data: FederatedData, num_clients: int,
                        placement: str, validate: bool, mesh=None, data_layout=None) -> dict:
    """Futures of the compiled evaluators ``{(split, placement): Compiled}``, compiled in
    a background thread: the placement asked for ("auto": the device) and the test and
    validation splits. The arguments are the state's avals (weak types included: the
    chunk program's carry; under ``mesh``, its layout) and the split's shapes (under
    ``mesh``, laid out as ``data_layout``: split by client, the only layout the mesh's
    evaluator is compiled for here)."""
    compiler = _compiler()
    fn = state_evaluator_program(model, algorithm.personal, algorithm.evaluated_params, mesh)
    splits = [("test", data.test)] + ([("validation", data.validation)] if validate else [])
    # the state may be donated before this runs
    state = jax.tree.map(_aval if mesh is None else _sharded_aval, state)
    where = "host" if placement == "host" else "device"  # "auto" mostly stays
    out = {}
    n = num_clients if where == "device" else _EVAL_CLIENTS
    generated = is_generated(data.train)
    if generated:  # evaluated on the device, a block of client ids per call
        where, n = "device", generated_block(num_clients)
    if mesh is not None and (where == "host" or algorithm.personal is not None
                             or n % sharding.num_shards(mesh) or generated):
        return out  # left to the jitted evaluator
    for name, split in splits:
        shapes = (_abstract(split) if generated else jax.tree.map(
            lambda v: jax.ShapeDtypeStruct((n, *np.shape(v)[1:]), v.dtype), split))
        ids = jax.ShapeDtypeStruct((n,), np.int32)
        if mesh is not None:
            shapes = sharding.abstract(shapes, getattr(data_layout, name))
            ids = jax.ShapeDtypeStruct((n,), np.int32, sharding=sharding.replicated(mesh))
        out[(name, where)] = compiler.submit(
            lambda s=shapes, i=ids: fn.lower(state, s, i).compile(
                compiler_options("evaluate")))
    return out


def _aval(x):
    """Shape, dtype and weak type of an array (a host array is never weak); a Python
    scalar as it is."""
    if not hasattr(x, "dtype"):
        return x
    weak = bool(getattr(getattr(x, "aval", None), "weak_type", False))
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=weak)


def _sharded_aval(x):
    """``_aval`` with the array's sharding (a placed state's leaf)."""
    aval = _aval(x)
    if not isinstance(x, jax.Array):
        return aval
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type,
                                sharding=x.sharding)


def _evaluate_in_chunks(evaluate, state, split: ClientData, clients_per_call: int,
                        layout=None, client_ids: Optional[np.ndarray] = None,
                        progress=None) -> dict:
    """``evaluate`` over a host split, ``clients_per_call`` clients at a time (the last
    call padded with empty clients, so one compiled program serves every call); each
    part placed as ``layout`` (a mesh's replicated sharding) when given. ``client_ids``:
    the ids of the split's rows (default 0..n-1); ``progress(done)`` after each call."""
    n = split.mask.shape[0]
    ids = np.arange(n, dtype=np.int32) if client_ids is None else client_ids
    parts = []
    for start in range(0, n, clients_per_call):
        rows = np.minimum(np.arange(start, start + clients_per_call), n - 1)
        part = jax.tree.map(lambda v: v[rows], split)
        empty = np.arange(start, start + clients_per_call) >= n
        part = part._replace(mask=part.mask & ~empty[:, None],
                             num_examples=np.where(empty, 0, part.num_examples))
        part = jax.device_put(part) if layout is None else sharding.put(part, layout)
        parts.append(sharding.to_host(evaluate(state, part, ids[rows].astype(np.int32))))
        if progress is not None:
            progress(min(start + clients_per_call, n))
    return {k: np.concatenate([p[k] for p in parts])[:n] for k in parts[0]}


class Evaluation:
    """``runner.run``'s evaluation of every client: ``(state) -> (per-client test
    metrics {name: [N]}, summary)``, the summary of the test (and validation) split
    (``summarise_clients``) over ``spec.summary_clients``. The evaluators are compiled
    ahead of time in a background thread (``start``, once: for the placement asked
    for, from the starting state's avals and the splits' shapes); ``place`` gives the
    placed federation, after which the evaluator compiled for the plan's placement
    runs, or else the jitted one (on the device at once, on the host
    ``_EVAL_CLIENTS`` clients per call)."""

    def __init__(self, model, algorithm: FederatedAlgorithm, spec: RunSpec, state,
                 data: FederatedData, validate: bool, data_layout=None, bar=None):
        self.model, self.algorithm, self.spec, self.state = model, algorithm, spec, state
        self.data, self.validate, self.data_layout = data, validate, data_layout
        self.bar = bar  # a long evaluation's progress goes to its postfix
        self.mesh = spec.execution.mesh
        self.pending: Optional[dict] = None  # {(split, placement): Future} once started
        self.plan = self.jitted = None

    def start(self) -> None:
        if self.pending is None:  # once; from the initial state and the data's shapes
            self.pending = {}
            self.pending.update(_compile_evaluators(
                self.model, self.algorithm, self.state, self.data, self.data.num_clients,
                self.spec.placement, self.validate, self.mesh, self.data_layout))
            _run_queued()

    def place(self, plan: mem.MemoryPlan, data: FederatedData) -> None:
        self.plan, self.data = plan, data
        mesh, num_clients = self.mesh, data.num_clients
        split_by_client = (mesh is not None and plan.placement == "device"
                           and num_clients % sharding.num_shards(mesh) == 0
                           and not is_generated(data.train))
        self.jitted = make_state_evaluator(self.model, self.algorithm.personal,
                                           self.algorithm.evaluated_params,
                                           mesh if split_by_client else None)
        self.all_ids = np.arange(num_clients, dtype=np.int32)  # host: valid on every process
        self.subset = eval_subset(num_clients, self.spec.eval_clients)
        self.of_subset = make_state_evaluator(self.model, self.algorithm.personal,
                                              self.algorithm.evaluated_params)

    def program(self, name: str):
        """The ahead-of-time compiled evaluator of split ``name`` when it was compiled
        for this placement, else the jitted one."""
        pending = self.pending.get((name, self.plan.placement))
        if pending is not None:
            try:
                return pending.result()
            except Exception:  # noqa: BLE001 (the jitted path reports any real error)
                self.pending.pop((name, self.plan.placement))
        return self.jitted

    def split(self, state, name: str, ids: Optional[np.ndarray] = None) -> dict:
        """Per-client metrics of split ``name`` (host arrays [N]; of the clients ``ids``
        when given, [len(ids)], by the jitted evaluator)."""
        split = getattr(self.data, name)
        if is_generated(split):  # a subset by the jitted evaluator, compiled for its size
            program = self.program(name) if ids is None else self.of_subset
            ids = self.all_ids if ids is None else ids
            return _evaluate_generated(program, state, split, ids, generated_block(len(ids)),
                                       self._progress(name, len(ids)))
        if ids is not None:
            part = jax.tree.map(lambda v: v[ids], split)  # host or device rows
            if self.plan.placement == "device":
                return sharding.to_host(self.of_subset(state, part, ids))
            return _evaluate_in_chunks(self.of_subset, state, part, _EVAL_CLIENTS,
                                       _replicated(self.mesh), ids,
                                       self._progress(name, len(ids)))
        if self.plan.placement == "device":
            return sharding.to_host(self.program(name)(state, split, self.all_ids))
        return _evaluate_in_chunks(self.program(name), state, split, _EVAL_CLIENTS,
                                   _replicated(self.mesh),
                                   progress=self._progress(name, len(self.all_ids)))

    def _progress(self, name: str, total: int):
        """``progress(done)`` showing an evaluation's clients in the bar's postfix."""
        if self.bar is None:
            return None
        return lambda done: self.bar.set_postfix_str(
            "" if done >= total else f"evaluating {name}: {done:,}/{total:,} clients")

    def clients(self, state) -> Optional[np.ndarray]:
        """The clients evaluated at ``state``: None (every client) at the run's last
        round or without ``spec.eval_clients``, else the fixed subset."""
        if len(self.subset) == len(self.all_ids) or int(state.round) >= self.spec.num_rounds:
            return None
        return self.subset

    def __call__(self, state) -> tuple:
        """Per-client test metrics and the summary of test (and validation) accuracy, of
        every client, or of the subset ``clients(state)`` (the summaries then over it)."""
        ids = self.clients(state)
        per_client = self.split(state, "test", ids)
        # a validation split without examples has nothing to summarise
        validation = self.split(state, "validation", ids) if self.validate else None
        keep = self.spec.summary_clients
        if ids is not None and keep is not None:
            keep = np.asarray(keep)[ids]
        summary = summarise_clients(per_client, validation, keep)
        if self.spec.eval_clients is not None:  # how many clients this evaluation covers
            summary["clients_evaluated"] = len(self.all_ids if ids is None else ids)
        return per_client, summary


def split_summary(per_client: dict, split: str, keep=None) -> dict:
    """The fairness summary of one split's per-client accuracy, named for what it
    measures: ``accuracy_mean``, ``accuracy_worst_10%`` (weighted by test size),
    ``accuracy_worst_10%_unweighted``, ... (``metrics.fairness_summary``'s keys
    prefixed ``accuracy_``), ``loss`` (the example-weighted mean loss) and, when the
    model reports them, ``ece`` / ``mce`` (each client's calibration errors averaged
    over clients, unweighted, as SuPerFed's calibration study does, Hahn's PhD thesis
    Ch. II §4.3), over the clients that have examples in the split. Test keys are
    returned as they are (``loss`` as ``test_loss``); validation keys are prefixed ``validation_``. A split
    in which no client has examples gives {}. ``keep`` (bool [N], default every
    client): the clients the summary covers (an attacked run's benign ones)."""
    has = per_client["num_examples"] > 0
    if keep is not None:
        has = has & np.asarray(keep, bool)
    if not has.any():
        return {}
    n = per_client["num_examples"][has]
    out = {f"accuracy_{k}": v for k, v in
           fairness.fairness_summary(per_client["accuracy"][has], weights=n).items()}
    out["loss"] = float(np.average(per_client["loss"][has], weights=n))
    for name in ("ece", "mce"):  # per client over its split, then averaged over clients
        if name in per_client:
            out[name] = float(np.mean(per_client[name][has]))
    if split == "test":
        out["test_loss"] = out.pop("loss")
        return out
    return {f"{split}_{k}": v for k, v in out.items()}


def summarise_clients(test: dict, validation: Optional[dict], keep=None) -> dict:
    """An evaluation's summary: ``split_summary`` of the per-client test metrics, and of
    the validation metrics when given, over the clients ``keep``."""
    summary = split_summary(test, "test", keep)
    if validation is not None:
        summary.update(split_summary(validation, "validation", keep))
    return summary


def evaluate_state(model, algorithm: FederatedAlgorithm, state, split: ClientData) -> dict:
    """Per-client metrics [N] of what ``algorithm`` evaluates (global, averaged or
    personal model; evaluation.py), without ``num_examples``."""
    evaluate = make_state_evaluator(model, algorithm.personal, algorithm.evaluated_params)
    ids = jnp.arange(split.mask.shape[0], dtype=jnp.int32)
    out = dict(evaluate(state, split, ids))
    out.pop("num_examples")
    return out


# ------------------------------------------------------------------ run_seeds' programs


def _seeds_functions(algorithm: FederatedAlgorithm, model, validate: bool, spec: RunSpec):
    """``(chunk(length), evaluate)``: ``chunk(length)`` is ``(seed, state, data, n) ->
    (state, per-round metrics [length, ...], per-client test, validation or None)``, a
    chunk of ``runner.run``'s rounds keyed by ``jax.random.key(seed)`` (the first n of
    them when n is not None: ``simulate``'s ``active_rounds``) and every client
    evaluated after it; ``evaluate`` is ``(seed, state, data, None) -> (test, validation)``."""

    def evaluate(seed, state, data, active_rounds=None):  # (the chunks' arguments)
        test = evaluate_state(model, algorithm, state, data.test)
        val = evaluate_state(model, algorithm, state, data.validation) if validate else None
        return test, val

    budgets = closed_table(spec.step_budgets)

    def chunk(length: int):
        def one(seed, state, data, active_rounds):
            state, metrics = simulate_chunk(algorithm, spec, length, state, data,
                                            jax.random.key(seed), budgets, active_rounds)
            return (state, metrics, *evaluate(seed, state, data))
        return one

    return chunk, evaluate


class SeedPrograms:
    """``run_seeds``' compiled programs: ``(length, states) -> Compiled``, a chunk of
    ``length`` rounds of every seed followed by every client's evaluation (length
    None: the evaluation alone), compiled once per length for the shapes of ``states``
    (the seeds' stacked states when ``vmap_seeds``, else one seed's). Called as
    ``(seeds, states, data, n)`` vmapped, or ``(seed, state, data, n)`` once per seed,
    with ``n`` the rounds to run when ``one_program`` (else None)."""

    def __init__(self, algorithm: FederatedAlgorithm, model, spec: RunSpec, data, seeds,
                 vmap_seeds: bool, validate: bool, one_program: bool):
        self.chunk, self.evaluate = _seeds_functions(algorithm, model, validate, spec)
        self.data, self.seeds, self.vmap_seeds = data, seeds, vmap_seeds
        self.one_program = one_program
        self.compiled: dict = {}

    def _jit(self, fn):
        if self.vmap_seeds:
            return jax.jit(jax.vmap(fn, in_axes=(0, 0, None, None), axis_name=CLIENT_AXIS))
        return jax.jit(fn)

    def __call__(self, length: Optional[int], states):
        if length not in self.compiled:
            args = (self.seeds if self.vmap_seeds else self.seeds[0], states, self.data)
            fn = self.evaluate if length is None else self.chunk(length)
            args += (jax.ShapeDtypeStruct((), jnp.int32)
                     if self.one_program and length is not None else None,)
            self.compiled[length] = self._jit(fn).lower(*args).compile(
                compiler_options("evaluate" if length is None else "rounds"))
        return self.compiled[length]


class SeedSummaries:
    """``(test, validation) -> (per-client test metrics with num_examples, summary)``:
    the host summary of one seed's evaluation as a seeds' program outputs it."""

    def __init__(self, data: FederatedData, validate: bool, keep=None):
        self.n_test = np.asarray(data.test.num_examples)
        self.n_val = np.asarray(data.validation.num_examples) if validate else None
        self.keep = keep

    def __call__(self, test: dict, val: Optional[dict]) -> tuple:
        per_client = {**{k: np.asarray(v) for k, v in test.items()},
                      "num_examples": self.n_test}
        validation = (None if self.n_val is None else
                      {**{k: np.asarray(v) for k, v in val.items()},
                       "num_examples": self.n_val})
        return per_client, summarise_clients(per_client, validation, self.keep)


def _seed_programs(algorithm, model, data, spec, states, seeds, vmap_seeds, validate,
                   log) -> Programs:
    data = jax.device_put(data)
    one_program = jax.default_backend() == "cpu"  # as runner.run: one chunk program
    start = int(np.asarray(states.round).reshape(-1)[0])
    first = max(1, min(spec.eval_every, spec.num_rounds - start))
    chunk = SeedPrograms(algorithm, model, spec, data, seeds, vmap_seeds, validate, one_program)
    capacity = mem.device_capacity() if spec.memory_limit is None else int(spec.memory_limit)
    plan = mem.MemoryPlan("device", 0, mem.program_bytes(chunk(first, states)), capacity)
    if plan.fits and log:
        log(plan.describe().replace("per chunk program", "the seeds' chunk program"))
    return Programs(chunk, SeedSummaries(data, validate, spec.summary_clients), plan, data,
                    spec.step_budgets, None, first, one_program)
