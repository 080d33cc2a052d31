"""The runner: a whole simulation in chunks of rounds, around the pure core.

``run`` is a Python loop over chunks of ``eval_every`` rounds of
``simulate.simulate`` (on a CPU one compiled program whatever the chunk lengths: a
chunk shorter than the first runs its first rounds; elsewhere one per length). It
owns what a pure function cannot: the memory plan and the data's placement,
evaluation of every client between chunks (of the global model, or of each client's
own model for a personalised algorithm), checkpoints and resume, the NaN guard,
progress, and the per-round diagnostics handed to ``on_rounds``.

Placement (memory.py): the federation stays on the device if the plan fits, else it
stays on the host and each chunk's cohorts are gathered there, padded to their size
bucket, and streamed in; a plan that cannot fit stops with a clear error before
any data moves. Under ``Execution(mesh=...)`` (sharding.py) "the device" is every
device of the mesh: the federation, streamed cohorts and client tables are split by
client, the rest of the state replicated, and the plan counts bytes per device.
"""
from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair.drivers import checkpoint as ckpt
from fedjax_fair.core import memory as mem
from fedjax_fair import metrics as fairness
from fedjax_fair.scenarios import sampling
from fedjax_fair import hparams as H
from fedjax_fair.core import sharding
from fedjax_fair.core.algorithm import FederatedAlgorithm, ServerState
from fedjax_fair.core.client_states import table_memory
from fedjax_fair.core.evaluation import make_state_evaluator, state_evaluator_program
from fedjax_fair.core.execution import (Execution, as_execution, auto_mesh,
                                        compiler_options, model_profile, resolve)
from fedjax_fair.scenarios.heterogeneity import UNLIMITED_STEPS, StepBudgets
from fedjax_fair.scenarios.system import System
from fedjax_fair.drivers.simulate import (budget_tables, gather_cohorts, plan_rounds,
                                          sample_client_ids, simulate,
                                          simulate_cohorts)
from fedjax_fair.core.types import ClientData, Cohort, FederatedData


_STOP = threading.Event()


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


_PROGRAMS = _ProgramCache()


def _signature(args):
    """Tree structure, shapes and dtypes of a program's arguments (a hashable key)."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((tuple(np.shape(x)), str(x.dtype)) for x in leaves)


# XLA's compile pipeline as jax reports it (jax.monitoring): tracing to a jaxpr,
# lowering to MLIR, and the backend compile. Nested jits nest their spans, so
# ``CompileClock`` counts the union of the spans, never a second of it twice.
_COMPILE_EVENTS = frozenset({"/jax/core/compile/jaxpr_trace_duration",
                             "/jax/core/compile/jaxpr_to_mlir_module_duration",
                             "/jax/core/compile/backend_compile_duration"})


class CompileClock:
    """Wall-clock seconds spent compiling while it is running: every span jax reports
    for tracing, lowering and XLA compiles (``jax.monitoring`` time spans: the chunk
    programs, the evaluator, one-off eager ops, ...), plus the spans added with
    ``add`` (a program's whole ``lower().compile()``), merged so that nested or
    concurrent compiles (a background thread) count once. Compiles of any thread of
    the process count while the clock runs. ``start``/``stop``, or a context.
    ``programs`` splits the jax spans by the program they compiled."""

    def __init__(self):
        self._spans: list = []
        self._named: dict = {}  # program name -> its jax spans
        self._lock = threading.Lock()
        self._running = False

    def _listener(self, event, start, end, **kwargs):
        if event in _COMPILE_EVENTS:
            self.add(start, end)
            name = str(kwargs.get("fun_name", "?"))
            if name.startswith("jit(") and name.endswith(")"):  # lowering and XLA's spans
                name = name[4:-1]
            with self._lock:
                self._named.setdefault(name, []).append((float(start), float(end)))

    def add(self, start: float, end: float) -> None:
        """A span in ``time.time()`` seconds."""
        with self._lock:
            self._spans.append((float(start), float(end)))

    def start(self) -> "CompileClock":
        if not self._running:
            jax.monitoring.register_event_time_span_listener(self._listener)
            self._running = True
        return self

    def stop(self) -> None:
        if self._running:
            jax.monitoring.unregister_event_time_span_listener(self._listener)
            self._running = False

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def seconds(self) -> float:
        with self._lock:
            spans = list(self._spans)
        return _covered(spans)

    @property
    def programs(self) -> dict:
        """``{program: seconds}``, largest first: each program's tracing, lowering and
        XLA compile as jax names it (the function's name), its own spans merged. A
        program traced inside another (a nested jit) also counts in its parent's
        tracing, so the values may add up to more than ``seconds``."""
        with self._lock:
            named = {k: list(v) for k, v in self._named.items()}
        out = {k: round(_covered(v), 4) for k, v in named.items()}
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _covered(spans) -> float:
    """Seconds covered by the union of ``spans`` [(start, end)]."""
    total, end = 0.0, -float("inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


class Interrupted(Exception):
    """A run stopped on request (SIGINT / SIGTERM under ``stop_on_signals``) at a chunk
    boundary: ``round`` rounds are done, and saved if ``checkpoint_dir`` is set."""

    def __init__(self, round_: int, checkpoint_dir: Optional[str] = None):
        super().__init__(f"interrupted after round {round_}")
        self.round = round_
        self.checkpoint_dir = checkpoint_dir


def request_stop() -> None:
    """Asks every ``run`` to stop at its next chunk boundary (after its checkpoint)."""
    _STOP.set()


def stop_requested() -> bool:
    return _STOP.is_set()


@contextlib.contextmanager
def stop_on_signals(signals=(signal.SIGINT, signal.SIGTERM)):
    """While active, the first SIGINT or SIGTERM only requests a stop: ``run`` finishes
    the chunk on the device, saves its checkpoint and raises ``Interrupted``, so no
    signal ever lands inside XLA (where a ``KeyboardInterrupt`` could crash the
    process). A second signal interrupts at once (``KeyboardInterrupt``). Main
    thread only; the previous handlers and a clear stop flag are restored on exit."""
    def handler(signum, frame):
        if _STOP.is_set():
            raise KeyboardInterrupt
        _STOP.set()

    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        _STOP.clear()


class NonFiniteError(FloatingPointError):
    """A run produced NaN/inf. ``round`` is the first bad round (1-based count of
    rounds completed when it appeared); ``last_good_state`` is the state kept."""

    def __init__(self, round_: int, last_good_round: int, last_good_state, where: str):
        super().__init__(f"non-finite server state at round {round_}; stopped. Last good state: "
                         f"round {last_good_round}{where}")
        self.round = round_
        self.last_good_round = last_good_round
        self.last_good_state = last_good_state
        self.history: Optional[list] = None  # ``run`` sets: the run's good evaluations
        self.rounds: Optional[dict] = None  # and its good rounds' metrics


@dataclasses.dataclass
class RunResult:
    state: ServerState
    history: list  # one dict per evaluation: round, summary metrics, timings
    client_metrics: dict  # final per-client test metrics, numpy arrays [N]
    round_metrics: dict  # per-round scalars, numpy arrays [R]
    compile_seconds: float  # every compile during the run (CompileClock): programs,
    # the evaluator, eager ops; a resumed run adds the checkpoint's
    run_seconds: float
    memory: Optional[mem.MemoryPlan] = None  # the plan the run used
    evaluated: str = "global"  # "global": state.params; "personal": each client's own model
    client_table: Optional[dict] = None  # the client-state table's memory report
    # per-client test metrics at every evaluation: "round" [E] and each metric [E, N]
    client_history: Optional[dict] = None
    # every round's metrics, as on_rounds receives them: {name: [R, ...]}
    rounds: Optional[dict] = None
    # this process's compile seconds per program (CompileClock.programs)
    compile_programs: Optional[dict] = None


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


_EVAL_CLIENTS = 256  # clients per evaluation call of a streamed (host) federation
_COMPILER = None  # one background thread compiling evaluators for every run


def _compile_evaluators(model, algorithm, state, data: FederatedData, num_clients: int,
                        placement: str, validate: bool, mesh=None, data_layout=None) -> dict:
    """Futures of the compiled evaluators ``{(split, placement): Compiled}``, compiled in
    a background thread: the placement asked for ("auto": the device) and the test and
    validation splits. The arguments are the state's avals (weak types included: the
    chunk program's carry; under ``mesh``, its layout) and the split's shapes (under
    ``mesh``, laid out as ``data_layout``: split by client, the only layout the mesh's
    evaluator is compiled for here)."""
    import concurrent.futures
    global _COMPILER
    if _COMPILER is None:
        _COMPILER = concurrent.futures.ThreadPoolExecutor(1, "fedjax-fair-compile")
    fn = state_evaluator_program(model, algorithm.personal, algorithm.evaluated_params, mesh)
    splits = [("test", data.test)] + ([("validation", data.validation)] if validate else [])
    # the state may be donated before this runs
    state = jax.tree.map(_aval if mesh is None else _sharded_aval, state)
    where = "host" if placement == "host" else "device"  # "auto" mostly stays
    out = {}
    n = num_clients if where == "device" else _EVAL_CLIENTS
    if mesh is not None and (where == "host" or algorithm.personal is not None
                             or n % sharding.num_shards(mesh)):
        return out  # left to the jitted evaluator
    for name, split in splits:
        shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct((n, *np.shape(v)[1:]), v.dtype),
                              split)
        ids = jax.ShapeDtypeStruct((n,), np.int32)
        if mesh is not None:
            shapes = sharding.abstract(shapes, getattr(data_layout, name))
            ids = jax.ShapeDtypeStruct((n,), np.int32, sharding=sharding.replicated(mesh))
        out[(name, where)] = _COMPILER.submit(
            lambda s=shapes, i=ids: fn.lower(state, s, i).compile(
                compiler_options("evaluate")))
    return out


def _cohort_budgets(client_ids: np.ndarray, tables) -> np.ndarray:
    """The step budgets [R, K] of sampled clients (``gather_cohorts``' rule): none,
    a table [N] for the run, or one table per round [R, N]."""
    if tables is None:
        return np.full(client_ids.shape, UNLIMITED_STEPS, np.int32)
    tables = np.asarray(tables, np.int32)
    return (tables[client_ids] if tables.ndim == 1
            else np.take_along_axis(tables, client_ids, axis=1))


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
                        layout=None) -> dict:
    """``evaluate`` over a host split, ``clients_per_call`` clients at a time (the last
    call padded with empty clients, so one compiled program serves every call); each
    part placed as ``layout`` (a mesh's replicated sharding) when given."""
    n = split.mask.shape[0]
    parts = []
    for start in range(0, n, clients_per_call):
        rows = np.minimum(np.arange(start, start + clients_per_call), n - 1)
        part = jax.tree.map(lambda v: v[rows], split)
        empty = np.arange(start, start + clients_per_call) >= n
        part = part._replace(mask=part.mask & ~empty[:, None],
                             num_examples=np.where(empty, 0, part.num_examples))
        part = jax.device_put(part) if layout is None else sharding.put(part, layout)
        parts.append(sharding.to_host(evaluate(state, part, rows.astype(np.int32))))
    return {k: np.concatenate([p[k] for p in parts])[:n] for k in parts[0]}


def _check_model_fits(model, params, data) -> None:
    """``params`` have the tree and shapes of ``model.init``'s, and ``model``'s loss
    reads one example of ``data``'s training inputs: checked with ``jax.eval_shape``
    alone (nothing compiled), so that another model's parameters or inputs of another
    shape fail here naming the argument, not deep inside flax while compiling."""
    name = getattr(model, "name", type(model).__name__)
    expected = jax.eval_shape(model.init, jax.random.key(0))
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


def _check_splits(data: FederatedData) -> bool:
    """Some client has test data (``FieldError("data")`` otherwise); returns whether a
    validation split with examples is there to evaluate too."""
    if not np.asarray(data.test.num_examples).sum() > 0:
        raise H.FieldError("data", "no client has a test example; run evaluates every client "
                                   "on its test split")
    return (data.validation is not None
            and bool(np.asarray(data.validation.num_examples).sum() > 0))


def _check_choices(placement: str, stream_layout: str, commit_seconds) -> None:
    if placement not in mem.PLACEMENTS:
        raise H.FieldError("placement", f"must be one of {list(mem.PLACEMENTS)}, got {placement!r}")
    if stream_layout not in ("compact", "padded"):
        raise H.FieldError("stream_layout", f"must be 'compact' or 'padded', got {stream_layout!r}")
    if (isinstance(commit_seconds, (bool, np.bool_))
            or not isinstance(commit_seconds, (int, float, np.integer, np.floating))
            or not 0 <= commit_seconds < float("inf")):
        raise H.FieldError("commit_seconds", f"must be a number of seconds >= 0, got "
                                             f"{commit_seconds!r}")


def _check_donate(donate, checkpoint_dir) -> bool:
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


def one_example(data: FederatedData) -> dict:
    """Shapes and dtypes of one training example of ``data`` (no client or row axis)."""
    return {k: jax.ShapeDtypeStruct(np.shape(v)[2:], v.dtype)
            for k, v in data.train.examples.items()}


def _resolved_execution(execution, cohort_size: int, num_clients: int, model=None,
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


def _memory_plan(program: Callable, first: int, data: FederatedData, mesh, placement: str,
                 memory_limit: Optional[int]) -> mem.MemoryPlan:
    """Where the federation goes: on the device when the first chunk's ``program`` plus
    the resident evaluation splits fit (``placement`` "auto" or "device"), else on the
    host with each chunk's cohorts streamed in, planned at the worst case (every
    cohort padded to the federation's M; the chunks then compile per size bucket
    actually sampled). ``memory.MemoryBudgetError`` when no plan fits."""
    devices = 1 if mesh is None else mesh.devices.size
    capacity = ((mem.device_capacity() if mesh is None else mem.mesh_capacity(mesh))
                if memory_limit is None else int(memory_limit))
    if placement in ("auto", "device"):
        evaluated = (data.test, data.validation)
        resident = (mem.tree_bytes(evaluated) if mesh is None else sharding.device_bytes(
            evaluated, sharding.federation_shardings(mesh, data)[0][1:]))
        plan = mem.MemoryPlan("device", resident, mem.program_bytes(program(first)),
                              capacity, devices)
        if plan.fits:
            return plan
        if placement == "device":
            raise mem.too_big(plan, "Use placement='host' to keep the federation in host "
                                    "memory and stream each chunk's cohorts, or a smaller "
                                    "cohort_size / chunk_size.")
    plan = mem.MemoryPlan("host", 0, mem.program_bytes(
        program(first, data.train.mask.shape[1])), capacity, devices)
    if not plan.fits:
        raise mem.too_big(plan, "Streamed cohorts of one chunk must fit: lower eval_every "
                                "(rounds per chunk), cohort_size, or use "
                                "execution='chunked' with a smaller chunk_size.")
    return plan


def run(algorithm: FederatedAlgorithm, params, data: FederatedData, key, *, model,
        num_rounds: int, cohort_size: int, eval_every: int = 10,
        sampler: Callable = sampling.uniform, step_budgets=None,
        checkpoint_dir: Optional[str] = None, resume: bool = False, progress: bool = True,
        on_eval: Optional[Callable[[dict], None]] = None, description: str = "",
        placement: str = "auto", memory_limit: Optional[int] = None,
        log: Optional[Callable[[str], None]] = None, execution="auto",
        on_rounds: Optional[Callable[[int, dict], None]] = None,
        donate: Optional[bool] = None, stream_layout: str = "compact",
        commit_seconds: float = 0.0, system: Optional[System] = None,
        on_clients: Optional[Callable[[dict, dict], None]] = None,
        summary_clients=None) -> RunResult:
    """Runs a whole simulation in chunks of ``eval_every`` rounds.

    After every chunk all clients are evaluated on their test split — the global
    model, or each client's own model when ``algorithm.personal`` is set — and the
    fairness summary is appended to ``history`` (and passed to ``on_eval``;
    ``on_clients(entry, per_client)`` also receives the clients' test metrics, host
    arrays [N] per metric: what an experiment tracker's histograms need).
    ``summary_clients`` (bool [N], default every client): the clients the summaries
    cover, e.g. the benign ones of a run under attack (scenarios/attacks.py); the
    per-client metrics keep every client.
    ``on_rounds(first_round, metrics)`` receives every chunk's per-round metrics
    (host arrays with a leading round axis: weights, losses, the server pieces'
    ``server/...`` diagnostics). ``execution``: how rounds map their clients. With
    ``checkpoint_dir`` the state is committed with the logs after every chunk (after
    the first chunk that ends ``commit_seconds`` after the last commit, and always at
    the end and on a stop request); ``resume=True`` continues from the newest commit
    and gives the same result as an uninterrupted run. If the
    server's state (parameters, optimizer, mixing or aggregator state; not the client
    table) becomes NaN/inf, ``NonFiniteError`` is raised with the round number;
    the last good state stays in the checkpoint (and on the exception).

    ``donate`` (default: when ``checkpoint_dir`` is set): each chunk program takes the
    server state's buffers over (``donate_argnums``), so client tables are updated in
    place instead of copied, and peak memory holds one state, not two (A-FedPD's dual
    table at N = 1000: docs/performance.md). The chunk's input state is then gone; a
    non-finite chunk's last good state is read back from the checkpoint, which is why
    donating needs ``checkpoint_dir``.

    Placement (memory.py): ``"device"`` moves the federation to the device;
    ``"host"`` keeps it in host memory and streams each chunk's sampled cohorts in;
    ``"auto"`` uses the device when the plan fits and the host otherwise. Streamed
    cohorts travel in ``stream_layout``: ``"compact"`` (default on one device) copies
    only the chunk's real rows, concatenated, and each round reads its clients'
    windows through their offsets, padded on the device to the size bucket of the
    chunk's largest client; ``"padded"`` (always under a mesh) gathers every cohort
    on the host padded to that bucket. Both give the same results.
    The plan (XLA's accounting of the compiled chunk program plus the resident
    evaluation split) is checked against ``memory_limit`` bytes (default: the
    device's free memory) before any data moves; ``log`` receives its one-line
    description. A plan that cannot fit raises ``memory.MemoryBudgetError``.

    Several devices: ``execution=Execution(strategy, chunk_size, mesh=mesh)`` with a
    mesh from ``sharding.make_mesh`` splits every cohort over the mesh's ``clients``
    axis (each device runs its share with ``strategy``), places the federation's
    splits and the client table split by client (replicated, with a note to ``log``,
    when N does not divide the device count) and the rest of the state replicated,
    and plans memory per device. Results equal the single-device run's up to float
    rounding. In a multi-host job (``sharding.initialize_distributed``) only
    process 0 writes checkpoints.

    ``system`` (scenarios/system.py): availability, dropouts and a virtual clock; its round
    metrics (``system/...``) are logged with the others, and every evaluation records
    the cumulative simulated time ``clock_seconds`` when it has a clock.

    Compiles one chunk program on a CPU (the first chunk's length; shorter chunks run
    its first rounds), else one per distinct chunk length (and, streamed, per size
    bucket).

    The arguments are checked before anything is compiled, moved or written:
    ``num_rounds``, ``eval_every`` and ``cohort_size`` are integers >= 1 (the cohort
    at most the number of clients), ``key`` is one ``jax.random.key`` (or a legacy
    ``jax.random.PRNGKey``), ``step_budgets`` is None, an integer table [N] or a
    ``heterogeneity.StepBudgets``, and some client has test data; a bad one raises
    ``ValueError`` / ``TypeError`` whose message starts with the argument's name. On
    resume an unreadable or inconsistent checkpoint raises
    ``ValueError("checkpoint: ...")`` naming the file, before anything is written.
    """
    # ---- the arguments, before anything is compiled, moved or written
    num_clients = data.num_clients
    num_rounds = check_count(num_rounds, "num_rounds")
    eval_every = check_count(eval_every, "eval_every")
    cohort_size = check_cohort(cohort_size, num_clients)
    summary_clients = check_summary_clients(summary_clients, num_clients)
    key = _check_key(key)
    step_budgets = _check_step_budgets(step_budgets, num_clients)
    _check_model_fits(model, params, data)
    validate = _check_splits(data)
    _check_choices(placement, stream_layout, commit_seconds)
    execution = _resolved_execution(execution, cohort_size, num_clients, model, data)
    mesh = execution.mesh
    compact = stream_layout == "compact" and mesh is None  # a mesh streams padded cohorts
    check_capacity(algorithm, num_clients, cohort_size, num_rounds)
    donate = _check_donate(donate, checkpoint_dir)
    if system is not None:
        check_system(system, data, params, sampler)
    clock = CompileClock().start()  # every compile from here on counts
    try:
        state = algorithm.init(params, num_clients)
        record = Record(checkpoint_dir, on_eval=on_eval, on_rounds=on_rounds,
                        on_clients=on_clients,
                        commit_seconds=commit_seconds, donated=donate)
        if resume:
            state = record.resume(state, num_clients)
        if mesh is not None:  # replicated server state, client table split by client
            state = sharding.put(state, sharding.state_shardings(mesh, state))
            key = sharding.put(key, sharding.replicated(mesh))

        compiled: dict = {}
        # on a CPU, one chunk program (the first chunk's length, the longest) runs chunks
        # of any length (simulate's active_rounds): a run whose rounds do not divide
        # into its evaluations compiles once. An accelerator keeps a program per length
        # (a lax.cond per round there costs a device-to-host sync).
        one_program = (jax.default_backend() if mesh is None
                       else mesh.devices.flat[0].platform) == "cpu"
        first = max(1, min(eval_every, num_rounds - int(state.round)))
        bar = _progress(progress, num_rounds, int(state.round), description)
        drawn = step_budgets if isinstance(step_budgets, StepBudgets) else None
        if drawn is not None:  # a function, closed over; tables are the arguments otherwise
            step_budgets = None
        data_layout = None
        if mesh is not None:
            data_layout, note = sharding.federation_shardings(mesh, data)
            if note and log:
                log(note)

        def program(length: int, padded_size: Optional[int] = None,
                    num_rows: Optional[int] = None):
            """The compiled chunk program: resident data (padded_size None) or streamed,
            padded to ``padded_size`` rows per client, or compact (``num_rows`` rows)."""
            name = (length, padded_size, num_rows)
            if name not in compiled:
                bar.set_postfix_str("compiling")
                t = time.time()
                donated = (0,) if donate else ()

                def pinned(f):
                    """``f`` whose returned state keeps the state's layout on a mesh
                    (the next chunk's program takes it as compiled; XLA may otherwise
                    give a per-client aggregator table, FedLF's, another layout)."""
                    def chunk_program(*args):  # the name compile_programs reports
                        new_state, metrics = f(*args)
                        return sharding.constrain_state(new_state, mesh), metrics
                    return chunk_program

                if padded_size is None:
                    fn = jax.jit(pinned(lambda s, d, k, b, n: simulate(
                        algorithm, s, d, k, num_rounds=length, cohort_size=cohort_size,
                        sampler=sampler, step_budgets=drawn or b, execution=execution,
                        active_rounds=n, system=system)), donate_argnums=donated)
                    args = (state, _abstract(data, data_layout), key,
                            step_budgets if mesh is None else _abstract(step_budgets,
                                                                        _replicated(mesh)),
                            None if not one_program else
                            jax.ShapeDtypeStruct((), jnp.int32, sharding=_replicated(mesh)))
                elif num_rows is not None:
                    fn = jax.jit(pinned(lambda s, c, k: _simulate_compact(
                        algorithm, s, c, k, padded_size, execution)), donate_argnums=donated)
                    args = (state, mem.compact_chunk_shapes(data.train.examples, length,
                                                            cohort_size, num_rows), key)
                else:
                    fn = jax.jit(pinned(lambda s, c, k: simulate_cohorts(
                        algorithm, s, c, k, execution=execution)), donate_argnums=donated)
                    shapes = _cohort_shapes(data.train, length, cohort_size, padded_size)
                    args = (state, _abstract(shapes, None if mesh is None
                                              else sharding.cohort_shardings(mesh, shapes)), key)
                # the program never calls ``init``: algorithms that differ only there (the
                # CLI's per-seed FedEvg / FedCVAE initial states) share their programs
                signature = (algorithm._replace(init=None), length, padded_size, num_rows,
                             cohort_size, sampler, drawn, execution, donate, system,
                             _signature(args))
                compiled[name] = _PROGRAMS.get(signature)
                if compiled[name] is None:  # not compiled by an earlier run of this process
                    lowered = fn.lower(*args)
                    start_evaluators()  # their tracing no longer contends for the GIL
                    compiled[name] = lowered.compile(compiler_options("rounds"))
                    _PROGRAMS.put(signature, compiled[name])
                clock.add(t, time.time())  # the whole lower + compile, Python included
                bar.set_postfix_str("")
            return compiled[name]

        # ---- the evaluator, compiled ahead of time in a background thread while XLA
        # compiles the first chunk program (once that program is lowered: the two
        # tracings would contend for the GIL; XLA's compile releases it)
        eval_programs: dict = {}
        started: list = []

        def start_evaluators() -> None:
            if not started:  # once; from the initial state and the data's shapes
                started.append(True)
                eval_programs.update(_compile_evaluators(
                    model, algorithm, state, data, num_clients, placement, validate, mesh,
                    data_layout))

        # ---- memory plan, before any data moves to the device
        try:
            plan = _memory_plan(program, first, data, mesh, placement, memory_limit)
        except mem.MemoryBudgetError:
            bar.close()
            raise
        start_evaluators()  # (the chunk program came from this process's cache)
        if log:
            log(plan.describe())

        if plan.placement == "device":
            put = jax.device_put if mesh is None else sharding.put
            data = put(data, data_layout)
            step_budgets = None if step_budgets is None else put(step_budgets, _replicated(mesh))
        else:
            data = _host(data)
            step_budgets = None if step_budgets is None else np.asarray(step_budgets)
            sizes = data.train.num_examples

        split_by_client = (mesh is not None and plan.placement == "device"
                           and num_clients % sharding.num_shards(mesh) == 0)
        evaluate = make_state_evaluator(model, algorithm.personal, algorithm.evaluated_params,
                                        mesh if split_by_client else None)
        all_ids = np.arange(num_clients, dtype=np.int32)  # host: valid on every process

        def evaluator(name: str):
            """The ahead-of-time compiled evaluator of split ``name`` when it was compiled
            for this placement, else the jitted one."""
            pending = eval_programs.get((name, plan.placement))
            if pending is not None:
                try:
                    return pending.result()
                except Exception:  # noqa: BLE001 (the jitted path reports any real error)
                    eval_programs.pop((name, plan.placement))
            return evaluate

        def evaluate_split(state, split: ClientData, name: str) -> dict:
            if plan.placement == "device":
                return sharding.to_host(evaluator(name)(state, split, all_ids))
            return _evaluate_in_chunks(evaluator(name), state, split, _EVAL_CLIENTS,
                                       _replicated(mesh))

        def evaluate_now(state):
            """Per-client test metrics and the summary of test (and validation) accuracy."""
            per_client = evaluate_split(state, data.test, "test")
            summary = split_summary(per_client, "test", summary_clients)
            if validate:  # a validation split without examples has nothing to summarise
                summary.update(split_summary(evaluate_split(state, data.validation,
                                                            "validation"), "validation",
                                             summary_clients))
            return per_client, summary

        if donate:  # the program may consume only buffers the state alone owns
            state = _own_buffers(state, params)
        current = [state]

        def advance(r0: int, length: int) -> list:
            """The next chunk of ``length`` rounds from round ``r0``, evaluated."""
            state = current[0]
            if plan.placement == "device" and one_program:  # the first chunk's, cut short
                fn = program(first)
                t = time.perf_counter()
                new_state, metrics = fn(state, data, key, step_budgets, np.int32(length))
            elif plan.placement == "device":
                fn = program(length)
                t = time.perf_counter()
                new_state, metrics = fn(state, data, key, step_budgets, None)
            else:  # sampling, gathering and the transfer count as run time
                t = time.perf_counter()
                if system is None:
                    ids = sample_client_ids(key, r0, length, num_clients, cohort_size,
                                            sampler)
                    tables = (budget_tables(drawn, key, r0, length, sizes)
                              if drawn is not None else step_budgets)
                    budgets, mask, planned = _cohort_budgets(ids, tables), None, {}
                else:  # the system's plan: who takes part, with what budget
                    tables = None
                    ids, mask, budgets, planned = plan_rounds(
                        system, key, r0, length, sizes, cohort_size=cohort_size,
                        sampler=sampler, step_budgets=drawn or step_budgets,
                        model_bytes=mem.tree_bytes(params))
                m = mem.size_bucket(sizes[ids].max(), data.train.mask.shape[1])
                if compact:  # the real rows only, read through offsets in the program
                    cohorts = jax.device_put(mem.compact_chunk(
                        data.train.examples, sizes, ids, budgets, m, mask))
                    rows = cohorts.rows[next(iter(cohorts.rows))].shape[0]
                else:
                    cohorts = gather_cohorts(data.train, ids, tables, m)
                    if mask is not None:
                        cohorts = cohorts._replace(client_mask=mask, local_steps=budgets)
                    cohorts = (jax.device_put(cohorts) if mesh is None else
                               sharding.put(cohorts, sharding.cohort_shardings(mesh, cohorts)))
                    rows = None
                t_compile = time.perf_counter()
                fn = program(length, m, rows)
                t += time.perf_counter() - t_compile  # a first compile is not run time
                new_state, metrics = fn(state, cohorts, key)
                metrics = {**metrics, **planned}
            metrics = jax.tree.map(lambda m: m[:length], sharding.to_host(metrics))
            seconds = time.perf_counter() - t
            current[0] = new_state
            if not np.asarray(metrics["finite"]).all():
                return [Chunk(new_state, metrics, None, None, seconds)]
            _check_table(new_state)
            per_client, summary = evaluate_now(new_state)
            return [Chunk(new_state, metrics, per_client, summary, seconds)]

        def initial() -> list:
            per_client, summary = evaluate_now(state)
            if has_clock(algorithm, system):
                summary["clock_seconds"] = 0.0
            return [Chunk(state, None, per_client, summary, 0.0)]

        drive([record], advance, initial, num_rounds=num_rounds, eval_every=eval_every,
              bar=bar, clock=clock)
        if record.non_finite is not None:
            bad, last_good = record.non_finite
            where = f", saved in {checkpoint_dir}" if checkpoint_dir else ""
            state = record.state
            if donate:  # the chunk consumed its input: the checkpoint holds the last good
                state, _ = ckpt.restore(checkpoint_dir, algorithm.init(params, num_clients))
                last_good = int(state.round)
            error = NonFiniteError(bad, last_good, state, where)
            error.history = record.history  # the evaluations up to the last good one
            error.rounds = {k: np.concatenate(v) for k, v in record.rounds.items()}
            raise error
        if record.last_test is None:  # resumed at the end: nothing ran
            record.last_test, _ = evaluate_now(record.state)
        return record.result(algorithm, plan, clock)
    finally:
        clock.stop()


class Chunk(NamedTuple):
    """What the shared loop (``drive``) receives of one run for one chunk: the state
    after it, every round's metrics (host arrays [rounds, ...], with ``"finite"``), the
    per-client test metrics and the evaluation's summary (None when a round was not
    finite), and the seconds the run spent on it."""

    state: Any
    metrics: Optional[dict]
    test: Optional[dict]
    summary: Optional[dict]
    seconds: float


ROUND_SCALARS = ("train_loss", "update_norm", "improved_fraction")  # RunResult.round_metrics


class Record:
    """One run's record in the shared loop (``drive``): its evaluation history, its
    per-client history and every round's metrics, and their commits, with the state,
    to ``checkpoint_dir`` (``checkpoint.save``: one step directory per commit, the logs
    appended as segments). A commit follows an evaluation when ``commit_seconds`` have
    passed since the last one (0: every evaluation), and always when the run stops
    (its end, a stop request, a divergence)."""

    def __init__(self, checkpoint_dir: Optional[str] = None, *, on_eval=None, on_rounds=None,
                 commit_seconds: float = 0.0, donated: bool = False, on_clients=None):
        self.checkpoint_dir = checkpoint_dir
        self.on_eval, self.on_rounds, self.on_clients = on_eval, on_rounds, on_clients
        self.commit_seconds = float(commit_seconds)
        self.donated = donated  # the state's buffers go to the next chunk
        self.history: list = []
        self.clients: dict = {}  # metric -> per-client rows [N], one per evaluation
        self.rounds: dict = {}  # metric -> arrays [rounds, ...], one per chunk
        self.compile_before = self.run_s = 0.0  # a resumed run's, from its checkpoint
        self.state = None  # after the last good evaluation
        self.last_test: Optional[dict] = None  # its per-client test metrics
        self.non_finite: Optional[tuple] = None  # (round, last good round) once diverged
        self._pending = ([], {}, {})  # history, clients, rounds not yet committed
        self._saved = False  # whether this run has committed (a resumed run continues)
        self._last_commit = time.monotonic()  # the first commit: commit_seconds in

    def resume(self, template, num_clients: int):
        """The newest commit's state (shaped like ``template``), with the logs."""
        if self.checkpoint_dir is None or not ckpt.exists(self.checkpoint_dir):
            raise FileNotFoundError(f"resume: no checkpoint in "
                                    f"checkpoint_dir={self.checkpoint_dir!r}")
        state, meta = ckpt.restore(self.checkpoint_dir, template)
        _check_meta(meta, self.checkpoint_dir, int(state.round))
        self.history = meta["history"]
        self.compile_before = meta.get("compile_seconds", 0.0)
        self.run_s = meta.get("run_seconds", 0.0)
        self.clients = _load_client_history(self.checkpoint_dir, len(self.history),
                                            num_clients)
        self.rounds = {k: [v] for k, v in
                       load_round_log(self.checkpoint_dir, int(state.round)).items()}
        self._saved, self.state = True, state
        return state

    @property
    def stopped(self) -> bool:
        return self.non_finite is not None

    def chunk(self, r0: int, metrics: dict) -> None:
        for k, v in metrics.items():
            v = np.asarray(v)
            self.rounds.setdefault(k, []).append(v)
            self._pending[2].setdefault(k, []).append(v)
        if self.on_rounds:
            self.on_rounds(r0, {k: np.asarray(v) for k, v in metrics.items()})

    def evaluation(self, state, test: dict, entry: dict, clock: "CompileClock") -> None:
        self.state, self.last_test = state, test
        for k, v in test.items():
            if k != "num_examples":
                row = np.asarray(v, np.float32)
                self.clients.setdefault(k, []).append(row)
                self._pending[1].setdefault(k, []).append(row)
        self.history.append(entry)
        self._pending[0].append(entry)
        if self.on_eval:
            self.on_eval(entry)
        if self.on_clients:
            self.on_clients(entry, {k: np.asarray(v) for k, v in test.items()})
        if time.monotonic() - self._last_commit >= self.commit_seconds:
            self.commit(clock)

    def diverged(self, bad_round: int, last_good_round: int, clock) -> None:
        self.non_finite = (bad_round, last_good_round)
        if not self.donated:  # the last good state is still there to commit
            self.commit(clock)

    def commit(self, clock: "CompileClock") -> None:
        """Commits the evaluations since the last commit (nothing without a checkpoint
        directory or a new evaluation)."""
        history, clients, rounds = self._pending
        if self.checkpoint_dir is None or not history:
            return
        state = self.state
        write = True
        if jax.process_count() > 1:  # every process gathers; process 0 writes
            state = sharding.to_host(state)
            write = jax.process_index() == 0
        if write:
            ckpt.save(self.checkpoint_dir, state,
                      {"round": int(state.round),
                       "compile_seconds": self.compile_before + clock.seconds,
                       "run_seconds": self.run_s},
                      logs={HISTORY: list(history),
                            CLIENT_HISTORY: {k: np.stack(v) for k, v in clients.items()},
                            ROUND_LOG: {k: np.concatenate(v) for k, v in rounds.items()}},
                      fresh=not self._saved)  # an earlier run's saves go at the first
        self._pending = ([], {}, {})
        self._saved = True
        self._last_commit = time.monotonic()

    def result(self, algorithm: FederatedAlgorithm, plan, clock: "CompileClock",
               compile_seconds: Optional[float] = None) -> RunResult:
        """The run's result; ``compile_seconds`` given (runs sharing programs) replaces
        the clock's, and 0 means this run compiled nothing of its own."""
        rounds = {k: np.concatenate(v) for k, v in self.rounds.items()}
        table = (table_memory(algorithm.client_table, self.state.client_states)
                 if algorithm.client_table is not None else None)
        return RunResult(
            state=self.state, history=self.history, client_metrics=self.last_test,
            round_metrics={k: rounds[k] for k in ROUND_SCALARS if k in rounds},
            compile_seconds=self.compile_before + (clock.seconds if compile_seconds is None
                                                   else compile_seconds),
            run_seconds=self.run_s, memory=plan, evaluated=algorithm.evaluates,
            client_table=table,
            client_history={"round": np.asarray([h["round"] for h in self.history]),
                            **{k: np.stack(v) for k, v in self.clients.items()}},
            rounds=rounds, compile_programs={} if compile_seconds == 0.0 else clock.programs)


def drive(records: list, advance: Callable, initial: Callable, *, num_rounds: int,
          eval_every: int, bar, clock: "CompileClock") -> None:
    """The one loop every run goes through (``run``, and ``sweep.run_seeds``' seeds as
    one program): chunks of ``eval_every`` rounds, each followed by an evaluation of
    every client, recorded and committed per run (``Record``), the NaN guard and stop
    requests, until round ``num_rounds``.

    ``records`` start at the same round (fresh, or resumed from their checkpoints);
    ``initial()`` gives each a ``Chunk`` of its starting state and evaluation (called
    only when they have no history yet); ``advance(r0, length)`` runs the next chunk of
    every run and gives one ``Chunk`` per record (the records that diverged are
    ignored). A run whose chunk is not finite stops at its last good evaluation
    (``Record.non_finite``); the others go on. On a stop request (``request_stop``,
    ``stop_on_signals``) every run commits and ``Interrupted`` is raised."""
    if not records[0].history:
        for rec, c in zip(records, initial()):
            rec.evaluation(c.state, c.test, {"round": int(c.state.round), **c.summary}, clock)
    r0 = int(records[0].state.round)
    live = [rec for rec in records if not rec.stopped]
    while r0 < num_rounds and live:
        length = min(eval_every, num_rounds - r0)
        for rec, c in zip(records, advance(r0, length)):
            if rec.stopped:
                continue
            rec.run_s += c.seconds
            finite = np.asarray(c.metrics["finite"], bool)
            if not finite.all():
                rec.diverged(r0 + int(np.argmin(finite)) + 1, r0, clock)
                continue
            rec.chunk(r0, c.metrics)
            entry = {"round": r0 + length, **c.summary, "seconds": rec.run_s,
                     "train_loss": float(np.asarray(c.metrics["train_loss"])[-1])}
            clock_metric = next((m for m in CLOCK_METRICS if m in c.metrics), None)
            if clock_metric:  # simulated time, cumulative over the run
                entry["clock_seconds"] = (rec.history[-1].get("clock_seconds", 0.0)
                                          + float(np.sum(c.metrics[clock_metric],
                                                         dtype=np.float64)))
            rec.evaluation(c.state, c.test, entry, clock)
        r0 += length
        live = [rec for rec in records if not rec.stopped]
        bar.update(length)
        if live:
            last = live[0].history[-1]
            bar.set_postfix(acc=f"{last['accuracy_mean']:.3f}",
                            worst10=f"{last['accuracy_worst_10%']:.3f}")
        if stop_requested() and r0 < num_rounds:
            for rec in live:
                rec.commit(clock)
            bar.close()
            raise Interrupted(r0, records[0].checkpoint_dir if len(records) == 1 else None)
    for rec in live:
        rec.commit(clock)
    bar.close()


# a round's simulated duration: an asynchronous method's own (algorithms/fedbuff.py),
# else the synchronous round's on the system's clock (scenarios/system.py)
CLOCK_METRICS = ("server/round_seconds", "system/round_seconds")


def has_clock(algorithm: FederatedAlgorithm, system) -> bool:
    """Whether a run's evaluations carry ``clock_seconds`` (0 at the start)."""
    return algorithm.clock or (system is not None and system.clock is not None)
HISTORY = "history"  # the checkpoint's log of evaluations (one JSON object each)
CLIENT_HISTORY = "client_history"  # per-client test metrics, a row [N] per evaluation
ROUND_LOG = "rounds"  # every round's metrics (as on_rounds receives them)


def load_round_log(directory: str, rounds: int) -> dict:
    """The per-round metrics of rounds 1..``rounds`` saved with the newest checkpoint
    ({metric: array [rounds, ...]}, what ``on_rounds`` received, concatenated), or
    ``ValueError("checkpoint: ...")`` when they do not cover exactly those rounds."""
    stored = ckpt.load_arrays(directory, ROUND_LOG)
    step = ckpt.latest(directory)
    if rounds and not stored:
        raise H.FieldError("checkpoint", f"{ROUND_LOG} in {step!r} is missing; the run cannot "
                                         f"resume from it (start it again)")
    for k, v in stored.items():
        if v.ndim < 1 or v.shape[0] != rounds:
            raise H.FieldError("checkpoint", f"{ROUND_LOG} in {step!r} holds {k!r} of "
                                             f"{v.shape[0] if v.ndim else 0} rounds, the state has "
                                             f"{rounds}; the run cannot resume from it (start it "
                                             f"again)")
    return stored


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


def attacked_summary(per_client: dict, is_malicious, split: str = "test") -> dict:
    """The fairness summaries of the benign and of the malicious clients (``--attack``,
    scenarios/attacks.py): ``{"benign": {...}, "malicious": {...}}``, each ``split_summary``
    of the per-client metrics (``RunResult.client_metrics``: arrays [N]) restricted to
    those clients, so that the benign summary never sees a malicious client. A group
    without examples in the split (e.g. no malicious client) gives {}."""
    flags = np.asarray(is_malicious, bool)
    n = flags.shape[0]
    for name, values in per_client.items():
        if np.ndim(values) < 1 or np.shape(values)[0] != n:
            raise H.FieldError("is_malicious", f"has {n} clients, per-client metric "
                                               f"{name!r} has shape {np.shape(values)}")

    return {"benign": split_summary(per_client, split, ~flags),
            "malicious": split_summary(per_client, split, flags)}


def _load_client_history(directory: str, evaluations: int, num_clients: int) -> dict:
    """The per-client metrics of the ``evaluations`` evaluations saved with the newest
    checkpoint (one row each; anything else raises ``ValueError("checkpoint: ...")``)."""
    stored = ckpt.load_arrays(directory, CLIENT_HISTORY)
    step = ckpt.latest(directory)
    if not stored:
        raise H.FieldError("checkpoint", f"{CLIENT_HISTORY} in {step!r} is missing or empty; "
                                         f"the run cannot resume from it (start it again)")
    out = {}
    for k, v in stored.items():
        if v.ndim != 2 or v.shape[1] != num_clients:
            raise H.FieldError("checkpoint", f"{CLIENT_HISTORY} in {step!r} holds {k!r} of "
                                             f"shape {v.shape}, this run has {num_clients} "
                                             f"clients; the run "
                                             f"cannot resume from it (was it made by another "
                                             f"config?)")
        if v.shape[0] != evaluations:
            raise H.FieldError("checkpoint", f"{CLIENT_HISTORY} in {step!r} holds {v.shape[0]} "
                                             f"evaluations of {k!r}, meta.json {evaluations}; the "
                                             f"run "
                                             f"cannot resume from it (start it again)")
        out[k] = list(v)
    return out


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


def _check_key(key):
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


def _check_step_budgets(step_budgets, num_clients: int):
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


def verify_resumable(directory: str, template, num_clients: int) -> dict:
    """What ``run(resume=True)`` checks of the newest save in ``directory``, without
    loading the state (``template``: the state's shapes, e.g. ``jax.eval_shape`` of
    ``algorithm.init``): the leaves' shapes and dtypes (``checkpoint.verify``), the
    state's round against meta.json's, one per-client history row per evaluation and
    the round log of every round done. Returns the meta; raises
    ``ValueError("checkpoint: ...")`` (``FileNotFoundError`` without a checkpoint)."""
    ckpt.verify(directory, template)
    meta = ckpt.read_meta(directory)
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(template)[0]]
    state_round = meta.get("round")
    if ".round" in paths:  # the ServerState's round, read alone
        state_round = int(ckpt.read_leaf(directory, paths.index(".round")))
    _check_meta(meta, directory, state_round)
    _load_client_history(directory, len(meta["history"]), num_clients)
    load_round_log(directory, state_round)
    return meta


def _check_meta(meta, directory: str, state_round: int) -> None:
    """A restored meta.json the runner can continue from: a non-empty evaluation
    history (one object with a "round" per evaluation) whose last round, and the
    meta's own "round", are the restored state's round."""
    history = meta.get("history")
    step = ckpt.latest(directory)
    if (not isinstance(history, list) or not history
            or not all(isinstance(h, dict) and isinstance(h.get("round"), int)
                       for h in history)
            or not isinstance(meta.get("round_metrics", {}), dict)):
        raise H.FieldError("checkpoint", f"meta.json in {step!r} is unreadable or corrupt "
                                         f"(no evaluation history with rounds); the run cannot "
                                         f"resume from "
                                         f"it (start it again)")
    if meta.get("round") != state_round or history[-1]["round"] != state_round:
        raise H.FieldError("checkpoint", f"meta.json in {step!r} is for round "
                                         f"{meta.get('round')} (last evaluation "
                                         f"{history[-1]['round']}), "
                                         f"state.npz for round {state_round}; the run cannot "
                                         f"resume from it "
                                         f"(start it again)")


def _own_buffers(state, params):
    """``state`` with a private copy of every array that shares a device buffer with
    one of the caller's ``params`` or with another leaf (an aggregator keeping theta^0
    as its average; replicated copies of one array on a mesh), so donating the state
    never deletes an array someone else holds (``sharding.unaliased``)."""
    return sharding.unaliased(state, params)


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


def _check_table(state: ServerState) -> None:
    """A lazy client table that ran out of slots dropped rows: stop with the fix."""
    overflow = getattr(state.client_states, "overflow", None)
    if overflow is not None and bool(overflow):
        raise H.FieldError("client_table", "the lazy table ran out of slots and dropped client "
                                           "rows; give lazy(capacity=...) at least min(N, "
                                           "cohort_size x "
                                           "num_rounds) slots, or use the dense table")


def _cohort_shapes(train: ClientData, num_rounds: int, cohort_size: int,
                   padded_size: int) -> Cohort:
    """Shapes of ``gather_cohorts``' output (nothing allocated)."""
    lead = (num_rounds, cohort_size)
    sds = jax.ShapeDtypeStruct
    data = jax.tree.map(lambda v: sds((*lead, padded_size, *v.shape[2:]) if v.ndim > 1 else lead,
                                      v.dtype), train)
    return Cohort(sds(lead, jnp.int32), data, sds(lead, jnp.bool_), sds(lead, jnp.int32))


def _progress(enabled: bool, total: int, initial: int, description: str):
    """A round progress bar on stderr, only when stderr is a terminal (a log file or a
    pipe gets no carriage-return updates); it says "compiling" while XLA compiles."""
    import sys
    from tqdm.auto import tqdm
    enabled = enabled and sys.stderr.isatty()
    return tqdm(total=total, initial=initial, desc=description or "rounds", unit="round",
                disable=not enabled, leave=False, dynamic_ncols=True)
