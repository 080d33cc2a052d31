"""The runner: a whole simulation in chunks of rounds, around the pure core.

``run`` is a Python loop over chunks of ``eval_every`` rounds of
``simulate.simulate`` (on a CPU one compiled program whatever the chunk lengths: a
chunk shorter than the first runs its first rounds; elsewhere one per length). Its
settings are one value, ``spec.RunSpec`` (or the same keywords); its programs, the
evaluator and the memory plan come from ``programs.make_programs``. It owns what a
pure function cannot: the loop (``drive``, which ``sweeps.run_seeds`` shares),
checkpoints and resume (``Record``), the NaN guard, stop requests, progress, and the
per-round diagnostics handed to ``on_rounds``.

Placement (memory.py, ``programs.py``): the federation stays on the device if the
plan fits, else it stays on the host and each chunk's cohorts are gathered there,
padded to their size bucket, and streamed in; a plan that cannot fit stops with a
clear error before any data moves. Under ``Execution(mesh=...)`` (sharding.py) "the
device" is every device of the mesh: the federation, streamed cohorts and client
tables are split by client, the rest of the state replicated, and the plan counts
bytes per device.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
from typing import Any, Callable, NamedTuple, Optional

import jax
import numpy as np

from fedjax_fair.drivers import checkpoint as ckpt
from fedjax_fair.core import interrupts, memory as mem
from fedjax_fair import hparams as H
from fedjax_fair.core import sharding
from fedjax_fair.core.algorithm import FederatedAlgorithm, ServerState
from fedjax_fair.core import row_store
from fedjax_fair.core.client_states import HostTable, outside_tables, table_memory
from fedjax_fair.scenarios.heterogeneity import UNLIMITED_STEPS
from fedjax_fair.scenarios.system import System
from fedjax_fair.drivers.programs import _PROGRAMS as _SHARED_PROGRAMS
from fedjax_fair.drivers.programs import Programs, _ProgramCache, make_programs, split_summary
from fedjax_fair.drivers.simulate import (budget_tables, gather_cohorts, plan_rounds,
                                          sample_client_ids, simulate)
from fedjax_fair.drivers.spec import (DEFAULT, RunSpec, as_spec, check_capacity, check_cohort,
                                      check_count, check_run, check_summary_clients,
                                      check_system, eval_subset, one_example)
from fedjax_fair.core.types import FederatedData
from fedjax_fair.data.disk import will_need

__all__ = [
    "CLIENT_HISTORY", "CLIENT_ROWS", "CLOCK_METRICS", "Chunk", "CompileClock", "HISTORY",
    "Interrupted", "NonFiniteError", "ROUND_LOG", "ROUND_SCALARS", "Record", "RunResult",
    "RunSpec", "attacked_summary", "check_capacity", "check_outside", "check_cohort",
    "check_count", "check_summary_clients", "check_system", "drive", "has_clock",
    "load_round_log", "make_programs", "one_example", "request_stop", "restore", "run",
    "split_summary", "stop_on_signals", "stop_requested", "verify_resumable",
    "simulate",  # (tests replace runner.simulate to catch a compile)
]


_STOP = threading.Event()

# the compiled chunk programs shared by the runs of this process (programs._PROGRAMS):
# run hands make_programs this name's value, so replacing it gives the runs a fresh cache
_PROGRAMS: _ProgramCache = _SHARED_PROGRAMS


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
    thread only; the previous handlers and a clear stop flag are restored on exit.
    Inside the ``fedjax-fair`` command each signal is also recorded as the command's
    stop request (``core.interrupts.record``), which outlives this context: a signal
    during a run's last chunk, which ends the run instead of stopping it, still stops
    the command before it writes its outputs."""
    def handler(signum, frame):
        interrupts.record(signum)
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
    rounds completed when it appeared); ``last_good_state`` is the state kept, of round
    ``last_good_round``; ``saved``: whether it is the newest commit of the run's
    checkpoint (False without a checkpoint, or when the run diverged before its first
    commit: its initial state is kept, in memory only)."""

    def __init__(self, round_: int, last_good_round: int, last_good_state, where: str,
                 saved: bool = False):
        super().__init__(f"non-finite server state at round {round_}; stopped. Last good state: "
                         f"round {last_good_round}{where}")
        self.round = round_
        self.last_good_round = last_good_round
        self.last_good_state = last_good_state
        self.saved = saved
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


def _cohort_budgets(client_ids: np.ndarray, tables) -> np.ndarray:
    """The step budgets [R, K] of sampled clients (``gather_cohorts``' rule): none,
    a table [N] for the run, or one table per round [R, N]."""
    if tables is None:
        return np.full(client_ids.shape, UNLIMITED_STEPS, np.int32)
    tables = np.asarray(tables, np.int32)
    return (tables[client_ids] if tables.ndim == 1
            else np.take_along_axis(tables, client_ids, axis=1))


def run(algorithm: FederatedAlgorithm, params, data: FederatedData, key, *, model,
        num_rounds: int = DEFAULT, cohort_size: int = DEFAULT, eval_every: int = DEFAULT,
        sampler: Callable = DEFAULT, step_budgets=DEFAULT,
        checkpoint_dir: Optional[str] = DEFAULT, resume: bool = False, progress: bool = True,
        on_eval: Optional[Callable[[dict], None]] = None, description: str = "",
        placement: str = DEFAULT, memory_limit: Optional[int] = DEFAULT,
        log: Optional[Callable[[str], None]] = None, execution=DEFAULT,
        on_rounds: Optional[Callable[[int, dict], None]] = None,
        donate: Optional[bool] = DEFAULT, stream_layout: str = DEFAULT,
        commit_seconds: float = DEFAULT, system: Optional[System] = DEFAULT,
        on_clients: Optional[Callable[[dict, dict], None]] = None,
        summary_clients=DEFAULT, eval_clients: Optional[int] = DEFAULT,
        prefetch: bool = DEFAULT, spec: Optional[RunSpec] = None) -> RunResult:
    """Runs a whole simulation in chunks of ``eval_every`` rounds.

    The settings are ``spec`` (a ``RunSpec``) or the keywords of the same names
    (``num_rounds``, ``cohort_size``, ``eval_every=10``, ``sampler``,
    ``step_budgets``, ``system``, ``execution``, ``placement``, ``stream_layout``,
    ``memory_limit``, ``summary_clients``, ``eval_clients``, ``prefetch``,
    ``checkpoint_dir``, ``commit_seconds``,
    ``donate``; ``RunSpec`` says what each does), one or the other: a settings keyword
    given with ``spec`` raises ``TypeError`` naming it.

    After every chunk all clients are evaluated on their test split — the global
    model, or each client's own model when ``algorithm.personal`` is set — and the
    fairness summary (over ``summary_clients``) is appended to ``history`` (and passed
    to ``on_eval``; ``on_clients(entry, per_client)`` also receives the clients' test
    metrics, host arrays [N] per metric: what an experiment tracker's histograms
    need). ``on_rounds(first_round, metrics)`` receives every chunk's per-round
    metrics (host arrays with a leading round axis: weights, losses, the server
    pieces' ``server/...`` diagnostics). ``log`` receives the memory plan's one-line
    description (and a mesh's layout note). With ``checkpoint_dir`` the state is
    committed with the logs after evaluations; ``resume=True`` continues from the
    newest commit and gives the same result as an uninterrupted run. If the server's
    state (parameters, optimizer, mixing or aggregator state; not the client table)
    becomes NaN/inf, ``NonFiniteError`` is raised with the round number; the last
    good state stays in the checkpoint (and on the exception; a run with donated
    chunks that diverged before its first commit keeps its initial state, on the
    exception only, ``saved`` False). A plan that cannot fit
    raises ``memory.MemoryBudgetError`` before any data moves. In a multi-host job
    (``sharding.initialize_distributed``) only process 0 writes checkpoints.

    Compiles one chunk program on a CPU (the first chunk's length; shorter chunks run
    its first rounds), else one per distinct chunk length (and, streamed, per size
    bucket); compiled programs are shared with later runs of the process.

    The arguments are checked before anything is compiled, moved or written
    (``RunSpec.check``, ``spec.check_run``): ``num_rounds``, ``eval_every`` and
    ``cohort_size`` are integers >= 1 (the cohort at most the number of clients),
    ``key`` is one ``jax.random.key`` (or a legacy ``jax.random.PRNGKey``),
    ``step_budgets`` is None, an integer table [N] or a ``heterogeneity.StepBudgets``,
    ``params`` are ``model``'s, and some client has test data; a bad one raises
    ``ValueError`` / ``TypeError`` whose message starts with the argument's name. On
    resume an unreadable or inconsistent checkpoint raises
    ``ValueError("checkpoint: ...")`` naming the file, before anything is written.
    """
    spec = as_spec(spec, "run", dict(
        num_rounds=num_rounds, cohort_size=cohort_size, eval_every=eval_every,
        sampler=sampler, step_budgets=step_budgets, system=system, execution=execution,
        placement=placement, stream_layout=stream_layout, memory_limit=memory_limit,
        summary_clients=summary_clients, eval_clients=eval_clients,
        checkpoint_dir=checkpoint_dir, commit_seconds=commit_seconds, donate=donate,
        prefetch=prefetch))
    spec, key, validate = check_run(algorithm, params, data, key, model, spec)
    clock = CompileClock().start()  # every compile from here on counts
    try:
        state, record, key = _start(algorithm, params, data.num_clients, key, spec, resume,
                                    dict(on_eval=on_eval, on_rounds=on_rounds,
                                         on_clients=on_clients), log)
        bar = _progress(progress, spec.num_rounds, int(state.round), description)
        try:
            programs = make_programs(algorithm, model, data, spec, state=state, key=key,
                                     validate=validate, clock=clock, bar=bar, log=log,
                                     cache=_PROGRAMS)
        except mem.MemoryBudgetError:
            bar.close()
            raise
        if spec.donate:  # the program may consume only buffers the state alone owns
            state = _own_buffers(state, params)
        loop = _RunLoop(algorithm, spec, programs, key, state, mem.tree_bytes(params))
        drive([record], loop.advance, loop.initial, num_rounds=spec.num_rounds,
              eval_every=spec.eval_every, bar=bar, clock=clock)
        if record.non_finite is not None:
            raise _non_finite(record, algorithm, params, data.num_clients, spec)
        if record.last_test is None:  # resumed at the end: nothing ran
            record.last_test, _ = programs.evaluate(record.state)
        return record.result(algorithm, programs.plan, clock)
    finally:
        clock.stop()


def history_ids(num_clients: int, spec: RunSpec) -> Optional[np.ndarray]:
    """The clients a run's per-client history keeps: None (every client) unless
    ``spec.eval_clients`` names fewer than N (then ``spec.eval_subset``'s)."""
    if spec.eval_clients is None or spec.eval_clients >= num_clients:
        return None
    return eval_subset(num_clients, spec.eval_clients)


def _start(algorithm: FederatedAlgorithm, params, num_clients: int, key, spec: RunSpec,
           resume: bool, observers: dict, log=None) -> tuple:
    """``(starting state, Record, key)`` of a run: ``algorithm.init``'s state, or the
    newest commit's (``resume``, with the rows of host and disk tables); under a mesh
    the state placed (replicated, the client table split by client) and the key
    replicated. The bill of host and disk tables is checked (``check_outside``)."""
    state = algorithm.init(params, num_clients)
    record = Record(spec.checkpoint_dir, **observers, commit_seconds=spec.commit_seconds,
                    donated=spec.donate, history_ids=history_ids(num_clients, spec))
    if resume:
        state = record.resume(state, num_clients)
    check_outside(state, spec, num_clients, log)
    mesh = spec.execution.mesh
    if mesh is not None:  # replicated server state, client table split by client
        state = sharding.put(state, sharding.state_shardings(mesh, state))
        key = sharding.put(key, sharding.replicated(mesh))
    return state, record, key


def _non_finite(record: "Record", algorithm: FederatedAlgorithm, params, num_clients: int,
                spec: RunSpec) -> "NonFiniteError":
    """The ``NonFiniteError`` of a run that diverged, with its last good state and its
    good logs. Not donated, the state before the bad chunk (committed by
    ``Record.diverged`` with a checkpoint). Donated, the chunk consumed its input: the
    newest commit's state, read back, or, when the run had committed nothing yet (a
    comparison's run commits every ``commit_seconds``), its initial state,
    ``algorithm.init`` of ``params`` again (round 0; the caller's ``params`` are never
    donated), saved nowhere: the error says so."""
    bad, last_good = record.non_finite
    state = record.state
    saved = spec.checkpoint_dir is not None
    if spec.donate:  # the chunk consumed its input
        saved = record.saved  # this run's commit (or the one it resumed from)
        state = (restore(spec.checkpoint_dir, algorithm.init(params, num_clients))[0]
                 if saved else algorithm.init(params, num_clients))
        last_good = int(state.round)
    where = (f", saved in {spec.checkpoint_dir}" if saved else
             " (the initial state; the run diverged before its first checkpoint commit, so "
             "no state was saved)" if spec.checkpoint_dir else "")
    error = NonFiniteError(bad, last_good, state, where, saved)
    error.history = record.history  # the evaluations up to the last good one
    error.rounds = {k: np.concatenate(v) for k, v in record.rounds.items()}
    return error


_READER = None  # one background thread reading the next chunk's cohorts (prefetch)


def _reader():
    import concurrent.futures
    global _READER
    if _READER is None:
        _READER = concurrent.futures.ThreadPoolExecutor(1, "fedjax-fair-prefetch")
    return _READER


class _RunLoop:
    """``run``'s side of ``drive``: ``initial()`` evaluates the starting state;
    ``advance(r0, length)`` runs the next chunk of ``length`` rounds from round ``r0``
    with ``programs`` (on the resident federation, or on cohorts sampled on the host
    and streamed in) and evaluates it, unless a round was not finite."""

    def __init__(self, algorithm: FederatedAlgorithm, spec: RunSpec, programs: Programs, key,
                 state, model_bytes: int):
        self.algorithm, self.spec, self.programs, self.key = algorithm, spec, programs, key
        self.state, self.model_bytes = state, model_bytes
        # a mesh streams padded cohorts
        self.compact = spec.stream_layout == "compact" and spec.execution.mesh is None
        self.pending = None  # ((first round, length), future of _cohorts) being read

    def initial(self) -> list:
        per_client, summary = self.programs.evaluate(self.state)
        if has_clock(self.algorithm, self.spec.system):
            summary["clock_seconds"] = 0.0
        return [Chunk(self.state, None, per_client, summary, 0.0)]

    def advance(self, r0: int, length: int) -> list:
        """The next chunk of ``length`` rounds from round ``r0``, evaluated. Host and
        disk tables keep the chunk's rows when its rounds were finite, else go back to
        the rows before it."""
        held = [(row_store.get(t.store), int(t.version)) for t in outside_tables(self.state)]
        if self.programs.plan.placement == "device":
            new_state, metrics, t = self._resident(length)
        else:  # sampling, gathering and the transfer count as run time
            new_state, metrics, t = self._streamed(r0, length)
        metrics = jax.tree.map(lambda m: m[:length], sharding.to_host(metrics))
        seconds = time.perf_counter() - t
        self.state = new_state
        finite = np.asarray(metrics["finite"]).all()
        for store, version in held:
            if finite:
                store.settle()
            else:
                store.rollback(version)
        if not finite:
            return [Chunk(new_state, metrics, None, None, seconds)]
        _check_table(new_state)
        per_client, summary = self.programs.evaluate(new_state)
        return [Chunk(new_state, metrics, per_client, summary, seconds)]

    def _resident(self, length: int) -> tuple:
        """``(state, metrics, start time)`` of a chunk on the resident federation."""
        p = self.programs
        if p.one_program:  # the first chunk's, cut short
            fn = p.chunk(p.first)
            t = time.perf_counter()
            return (*fn(self.state, p.data, self.key, p.step_budgets, np.int32(length)), t)
        fn = p.chunk(length)
        t = time.perf_counter()
        return (*fn(self.state, p.data, self.key, p.step_budgets, None), t)

    def _streamed(self, r0: int, length: int) -> tuple:
        """``(state, metrics, start time)`` of a chunk on cohorts streamed from the host
        (a first compile of the chunk's program is not run time). With
        ``spec.prefetch`` the next chunk's cohorts are drawn, read and sent in a
        background thread while this chunk computes (they depend on the key and the
        round alone, never on the state); waiting for them counts as run time."""
        p, spec = self.programs, self.spec
        t = time.perf_counter()
        pending, self.pending = self.pending, None
        if pending is not None and pending[0] == (r0, length):
            cohorts, rows, m, planned = pending[1].result()
        else:
            cohorts, rows, m, planned = self._cohorts(r0, length)
        following = min(spec.eval_every, spec.num_rounds - r0 - length)
        if spec.prefetch and following > 0:
            self.pending = ((r0 + length, following),
                            _reader().submit(self._cohorts, r0 + length, following))
        t_compile = time.perf_counter()
        fn = p.chunk(length, m, rows)
        t += time.perf_counter() - t_compile  # a first compile is not run time
        new_state, metrics = fn(self.state, cohorts, self.key)
        return new_state, {**metrics, **planned}, t

    def _cohorts(self, r0: int, length: int) -> tuple:
        """``(cohorts on the device, rows, size bucket, the system's metrics)`` of the
        chunk of ``length`` rounds from round ``r0``."""
        p = self.programs
        ids, tables, budgets, mask, planned = self._draw(r0, length)
        will_need(p.data.train, ids)  # a memory-mapped federation: reads start at once
        m = mem.size_bucket(p.data.train.num_examples[ids].max(), p.data.train.mask.shape[1])
        cohorts, rows = self._gather(ids, tables, budgets, mask, m)
        return cohorts, rows, m, planned

    def _draw(self, r0: int, length: int) -> tuple:
        """The chunk's cohorts as the device would draw them: ``(client ids [R, K], the
        budget tables, budgets [R, K], mask [R, K] or None, the system's metrics)``."""
        p, spec, key = self.programs, self.spec, self.key
        sizes = p.data.train.num_examples
        if spec.system is None:
            ids = sample_client_ids(key, r0, length, p.data.num_clients, spec.cohort_size,
                                    spec.sampler)
            tables = (budget_tables(p.drawn, key, r0, length, sizes)
                      if p.drawn is not None else p.step_budgets)
            return ids, tables, _cohort_budgets(ids, tables), None, {}
        # the system's plan: who takes part, with what budget
        ids, mask, budgets, planned = plan_rounds(
            spec.system, key, r0, length, sizes, cohort_size=spec.cohort_size,
            sampler=spec.sampler, step_budgets=p.drawn or p.step_budgets,
            model_bytes=self.model_bytes)
        return ids, None, budgets, mask, planned

    def _gather(self, ids, tables, budgets, mask, m: int) -> tuple:
        """``(cohorts on the device, rows)``: compact (the real rows only, read through
        offsets in the program; ``rows`` their count) or padded to ``m`` (rows None)."""
        train, mesh = self.programs.data.train, self.spec.execution.mesh
        if self.compact:
            cohorts = jax.device_put(mem.compact_chunk(
                train.examples, train.num_examples, ids, budgets, m, mask))
            return cohorts, cohorts.rows[next(iter(cohorts.rows))].shape[0]
        cohorts = gather_cohorts(train, ids, tables, m)
        if mask is not None:
            cohorts = cohorts._replace(client_mask=mask, local_steps=budgets)
        cohorts = (jax.device_put(cohorts) if mesh is None else
                   sharding.put(cohorts, sharding.cohort_shardings(mesh, cohorts)))
        return cohorts, None


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
                 commit_seconds: float = 0.0, donated: bool = False, on_clients=None,
                 history_ids: Optional[np.ndarray] = None):
        self.checkpoint_dir = checkpoint_dir
        self.on_eval, self.on_rounds, self.on_clients = on_eval, on_rounds, on_clients
        self.commit_seconds = float(commit_seconds)
        self.donated = donated  # the state's buffers go to the next chunk
        # the clients of the per-client history (None: every client; ``history_ids``)
        self.history_ids = history_ids
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
        state, meta = restore(self.checkpoint_dir, template)
        _check_meta(meta, self.checkpoint_dir, int(state.round))
        self.history = meta["history"]
        self.compile_before = meta.get("compile_seconds", 0.0)
        self.run_s = meta.get("run_seconds", 0.0)
        self.clients = _load_client_history(
            self.checkpoint_dir, len(self.history),
            num_clients if self.history_ids is None else len(self.history_ids))
        self.rounds = {k: [v] for k, v in
                       load_round_log(self.checkpoint_dir, int(state.round)).items()}
        self._saved, self.state = True, state
        return state

    @property
    def stopped(self) -> bool:
        return self.non_finite is not None

    @property
    def saved(self) -> bool:
        """Whether the checkpoint holds a commit of this run (or the one it resumed)."""
        return self._saved

    def chunk(self, r0: int, metrics: dict) -> None:
        for k, v in metrics.items():
            v = np.asarray(v)
            self.rounds.setdefault(k, []).append(v)
            self._pending[2].setdefault(k, []).append(v)
        if self.on_rounds:
            self.on_rounds(r0, {k: np.asarray(v) for k, v in metrics.items()})

    def evaluation(self, state, test: dict, entry: dict, clock: "CompileClock") -> None:
        self.state, self.last_test = state, test
        ids = self.history_ids
        for k, v in test.items():
            if k != "num_examples":
                row = np.asarray(v, np.float32)
                if ids is not None and len(row) != len(ids):  # a final evaluation: [N]
                    row = row[ids]
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
        stores = [row_store.get(t.store) for t in outside_tables(state)]
        if write:
            rows = {f"{CLIENT_ROWS}_{i}": store.dirty() for i, store in enumerate(stores)}
            ckpt.save(self.checkpoint_dir, state,
                      {"round": int(state.round),
                       "compile_seconds": self.compile_before + clock.seconds,
                       "run_seconds": self.run_s},
                      logs={HISTORY: list(history),
                            CLIENT_HISTORY: {k: np.stack(v) for k, v in clients.items()},
                            ROUND_LOG: {k: np.concatenate(v) for k, v in rounds.items()},
                            **{k: v for k, v in rows.items() if len(v["client"])}},
                      fresh=not self._saved,  # an earlier run's saves go at the first
                      unmerged=tuple(rows))
        for store in stores:
            store.clean()
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
                            **({} if self.history_ids is None else
                               {"client_ids": self.history_ids}),
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
# the rows a host or disk table wrote since the last commit, one log per table
# ("client_rows_0", ...; row_store.RowStore.dirty), a segment per commit
CLIENT_ROWS = "client_rows"


def restore(directory: str, template) -> tuple:
    """``checkpoint.restore`` of ``template``, with the rows of its host and disk
    tables (``client_states.host`` / ``disk``) replayed from the checkpoint into the
    template's own stores, which the restored state then reads."""
    state, meta = ckpt.restore(directory, template)
    tables = iter(range(len(outside_tables(template))))

    def reattach(fresh, restored):
        if not isinstance(fresh, HostTable):
            return restored
        i, store = next(tables), row_store.get(fresh.store)
        for segment in ckpt.log_segments(directory, f"{CLIENT_ROWS}_{i}"):
            store.load(segment)
        store.set_version(int(restored.version))
        return restored._replace(store=fresh.store)

    return jax.tree.map(reattach, template, state,
                        is_leaf=lambda x: isinstance(x, HostTable)), meta


def check_outside(state, spec: RunSpec, num_clients: int, log=None) -> None:
    """Before compute: the host or disk tables of ``state`` (one device, no mesh) and
    their bill, logged, against the host's available memory or the folder's free disk:
    min(N, cohort x rounds, capacity) rows, plus a chunk's journal (the old rows a
    chunk overwrites, kept until its rounds are known to be finite)."""
    import shutil
    for table in outside_tables(state):
        if spec.execution.mesh is not None:
            raise H.FieldError("client_table", "host and disk tables run on one device; "
                                               "under a mesh use the dense or lazy table")
        store = row_store.get(table.store)
        rows = min(store.capacity, spec.cohort_size * spec.num_rounds)
        journal = min(rows, spec.cohort_size * spec.eval_every)
        bill = (rows + journal) * store.row_bytes
        if store.disk:
            os.makedirs(store.parent, exist_ok=True)
        where = store.parent if store.disk else "host memory"
        free = (shutil.disk_usage(store.parent).free if store.disk
                else mem.host_available())
        line = (f"client rows in {where}: up to {mem._mib(bill)} ({rows:,} rows of "
                f"{store.row_bytes:,} bytes and a chunk's journal of {journal:,})")
        if free is not None and bill > free:
            fix = ("set TMPDIR to a folder with room (or give disk(directory=...))"
                   if store.disk else "use the disk table (files in $TMPDIR)")
            raise H.FieldError("client_table", f"{line}, but {mem._mib(free)} is "
                                               f"available; {fix}")
        if log:
            log(line)
        store.expect(rows, journal)


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
    checkpoint (one row of ``num_clients`` each: the clients the run's history keeps;
    anything else raises ``ValueError("checkpoint: ...")``)."""
    stored = ckpt.load_arrays(directory, CLIENT_HISTORY)
    step = ckpt.latest(directory)
    if not stored:
        raise H.FieldError("checkpoint", f"{CLIENT_HISTORY} in {step!r} is missing or empty; "
                                         f"the run cannot resume from it (start it again)")
    out = {}
    for k, v in stored.items():
        if v.ndim != 2 or v.shape[1] != num_clients:
            raise H.FieldError("checkpoint", f"{CLIENT_HISTORY} in {step!r} holds {k!r} of "
                                             f"shape {v.shape}, this run records {num_clients} "
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


def verify_resumable(directory: str, template, num_clients: int,
                     eval_clients: Optional[int] = None) -> dict:
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
    _load_client_history(directory, len(meta["history"]),
                         num_clients if eval_clients is None else min(eval_clients,
                                                                      num_clients))
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


def _check_table(state: ServerState) -> None:
    """A lazy client table that ran out of slots dropped rows: stop with the fix."""
    overflow = getattr(state.client_states, "overflow", None)
    if overflow is not None and bool(overflow):
        raise H.FieldError("client_table", "the lazy table ran out of slots and dropped client "
                                           "rows; give lazy(capacity=...) at least min(N, "
                                           "cohort_size x "
                                           "num_rounds) slots, or use the dense table")


def _progress(enabled: bool, total: int, initial: int, description: str):
    """A round progress bar on stderr, only when stderr is a terminal (a log file or a
    pipe gets no carriage-return updates); it says "compiling" while XLA compiles."""
    import sys
    from tqdm.auto import tqdm
    enabled = enabled and sys.stderr.isatty()
    return tqdm(total=total, initial=initial, desc=description or "rounds", unit="round",
                disable=not enabled, leave=False, dynamic_ncols=True)
