"""The ``fedjax-fair`` command line: ``run``, ``compare``, ``sweep``, ``report`` and ``list``.

    fedjax-fair compare                       # every algorithm on Synthetic(1, 1), a few minutes
    fedjax-fair compare --tune                # each first searched on validation data (cli.tune)
    fedjax-fair run --algorithm fedprox --hp mu=0.01 --dataset digits --num-clients 20 \\
        --dataset-arg partition=dirichlet --alpha 0.3 --model mlp -o runs/prox
    fedjax-fair run --config job.yaml --num-rounds 400   # flags override the file
    fedjax-fair run -o runs/prox --resume --num-rounds 800   # continue a run (saved settings)
    fedjax-fair run -o runs/prox --resume --branch --client-lr 0.01  # continue, changed (recorded)
    fedjax-fair sweep --algorithm qffl --grid q=0,0.5,1,2,5 --grid client_lr=0.01,0.03,0.1 \\
        --seeds 0-4                           # 15 grid points x 5 seeds, one program
    fedjax-fair report runs/compare_synthetic # tables, figures, report.html again
    fedjax-fair list                          # algorithms (+ hyper-parameters), datasets, ...

One module per command (``run``, ``compare``, ``sweep``, ``rebuild`` for ``report``,
``listing``; ``tune`` for ``compare --tune``), the trackers in ``tracked``, the HTML page in ``html``, what they share in
``common``, the argument parser in ``parser``, the configuration dataclasses and their
validation in ``config``, the options that need an optional package in ``extras``, the
output files and plots in ``report``, folder ownership and the fingerprint in ``lock``;
``main`` (here) turns every failure into one line and an exit status.

``run`` writes to its output directory: ``config.json``, ``metrics.jsonl`` (one JSON
line per evaluation), ``rounds.jsonl`` (per-round weights, losses and server
diagnostics), ``clients.csv`` (final per-client test metrics), ``clients_over_time.npz``
(per-client metrics at every evaluation), ``summary.json`` (config, final fairness
summary, timings), ``accuracy.png`` (mean / worst 10% / std over rounds), ``loss.png``,
``client_accuracy_hist.png``, ``lorenz.png``, ``improved_clients.png`` (the share of
each round's participants whose training loss did not rise; with ``--improvement``, which
``run`` leaves off and ``compare`` turns on) and ``checkpoint/`` (one
committed step directory per evaluation, the last two kept: ``checkpoint.save``).
``compare`` writes ``config.json``, ``comparison.md`` / ``comparison.csv``
(the printed table), ``summary.json``, ``accuracy.png``, ``client_accuracy_hist.png``
(box plots), ``client_accuracy_ecdf.png``, ``lorenz.png``, ``improved_clients.png``,
and one sub-directory per
algorithm and seed with that run's metrics (with ``--tune`` also ``tuning.json``, each
method's search space, selection and validation score, and ``tune/METHOD``, its
search as a sweep folder). ``sweep`` writes ``config.json``,
``sweep.md`` / ``sweep.csv`` (one row per grid point, every summary, mean ± std over
seeds), ``heatmap.png``, ``runs.json`` (every run's summaries, what
``cli.sweep.rebuild`` rewrites the tables from), ``parts/`` (each finished call's
per-client metrics) and ``summary.json`` (the setting selected by validation
accuracy, timings). Each of the three writes ``report.html`` too (its tables, figures,
command and configuration in one self-contained page); ``--tracker`` adds
``tensorboard/``, ``wandb/``, ``mlruns/`` and ``tracking/``. ``report DIR`` writes a
finished folder's tables, figures and page again from its files, computing nothing.
A comparison's table and figures are grouped by family (``algorithms.FAMILIES``).

All three also write ``fingerprint.json`` (the configuration's fingerprint, which covers
the contents of the files the run reads too: a ``--availability trace:FILE``, a LEAF
data folder, recorded as ``inputs`` in ``config.json``; ``run`` also puts it in the
checkpoint directory and ``config.json``: ``--resume`` refuses an edited config.json,
another run's checkpoint, or an input file whose contents changed, naming its option)
and ``.fedjax-fair.lock`` (``fcntl.flock``-ed for the process's life; a second writer
is refused naming the holder). A refused command writes nothing.

Exit status: 0 success; 2 configuration error (one line ``error: <field>: ...`` on
stderr, checked before any compute where possible, an option whose optional package
is not installed included: ``extras``); 3 the parameters became
NaN/inf (the last good checkpoint is kept, and a run that diverged before its first
commit says that no state was saved; a sweep instead marks a diverged run's cells nan
and says so); 4 the output could not be written (disk full, quota,
read-only: one line ``error: output_dir: ...``; what was written stays); 130
interrupted (SIGINT / SIGTERM stop at the next chunk boundary: ``run`` keeps its
checkpoint, ``compare`` its finished runs and their table, ``sweep`` its finished
calls in ``parts/``; ``--resume`` continues each; before the first round or while
the outputs are written, they stop at once with one line, and ``summary.json``,
written last, is not written). A signal is never lost, from the package's import
(``core.interrupts.guard_import``: one line, nothing written) to the last write: the
handler records it as well as raising ``KeyboardInterrupt``, so an exception that a
garbage-collector or weakref callback swallows (JAX's, during start-up and compiles)
still stops the command at its next safe point (``common.check_interrupted``: after
the data is built, before the first write, before the rounds, before the outputs),
and a signal during a run's last chunk stops it before its outputs (when a checkpoint
can write them again; without one they are written); one swallowed during the very
last writes, or a run without a checkpoint, ends the command with 130 and a line saying
every output was written.
"""
from __future__ import annotations

import os
import sys
from typing import NoReturn, Optional, Sequence

from fedjax_fair.cli import config as C
from fedjax_fair.cli.common import (DISK_ERRORS, EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_WRITE,
                                    _COMMAND, _Exit, _HELD, _STAGE, _STAGE_DIR, _err,
                                    check_interrupted)
from fedjax_fair.cli.parser import build_parser
from fedjax_fair.core import interrupts
from fedjax_fair.core.execution import compile_options_override
from fedjax_fair.hparams import FieldError
# what programs and tests call by its command-line name
from fedjax_fair import reports as report
from fedjax_fair.cli.common import (EXIT_NONFINITE, build_algorithm, build_dataset,
                                    build_model, config_from_args)
from fedjax_fair.cli.compare import compare_config
from fedjax_fair.cli.run import (COMPILATION_CACHE_ENV, _persistent_compilation_cache,
                                 run_config)

__all__ = ["COMPILATION_CACHE_ENV", "EXIT_CONFIG", "EXIT_INTERRUPTED", "EXIT_NONFINITE",
           "EXIT_WRITE", "build_algorithm", "build_dataset", "build_model", "build_parser",
           "compare_config", "config_from_args", "main", "report", "run_config",
           "_persistent_compilation_cache"]


def _initialize_distributed() -> None:
    """``--distributed``: ``sharding.initialize_distributed``, its failures reported as
    a ``distributed`` configuration error (the job's environment is the config)."""
    from fedjax_fair.core import sharding
    try:
        sharding.initialize_distributed()
    except (ValueError, RuntimeError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise C.ConfigError("distributed", f"jax.distributed.initialize failed: {message}; "
                                           f"see docs/scaling.md for the environment a "
                                           f"multi-host launch needs") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the exit status (the console script passes it to sys.exit).
    From its first line to its last write a SIGINT / SIGTERM ends the command with one
    line and status 130 (``_interrupt_on_sigterm``; the module docstring)."""
    restore_sigterm = _interrupt_on_sigterm()
    try:
        _COMMAND[:] = list(sys.argv[1:] if argv is None else argv)
        parser = build_parser()
        try:  # methods from outside the package (FEDJAX_FAIR_PLUGINS, entry points)
            from fedjax_fair.algorithms import registry
            registry.load_env_plugins()
        except FieldError as e:
            raise C.ConfigError(e.field, str(e)[len(e.field) + 2:]) from None
        args = parser.parse_args(argv)
        if not getattr(args, "command", None):
            parser.print_help(sys.stderr)
            raise C.ConfigError("command", "choose one of run, compare, sweep, report, prepare, "
                                           "list")
        try:  # an experiment's XLA options, checked before any work
            compile_options_override()
        except FieldError as e:
            raise C.ConfigError(e.field, str(e).split(": ", 1)[1]) from None
        if getattr(args, "distributed", False):  # before anything touches a device
            _initialize_distributed()
        check_interrupted()
        code = args.func(args)
        if code == 0 and interrupts.requested():  # lost in a callback during the last writes
            where = f" to {_STAGE_DIR[-1]}" if _STAGE_DIR else ""
            _err(f"interrupted as the command finished; every output was written{where}")
            return EXIT_INTERRUPTED
        return code
    except _Exit as e:
        return e.code
    except C.ConfigError as e:
        _err(str(e))
        return EXIT_CONFIG
    except KeyboardInterrupt:  # SIGINT / SIGTERM outside the runner's stop_on_signals
        _err(f"interrupted {_STAGE[-1] if _STAGE else 'before anything was written'}")
        return EXIT_INTERRUPTED
    except OSError as e:
        if e.errno not in DISK_ERRORS:
            raise
        where = e.filename or (_STAGE_DIR[-1] if _STAGE_DIR else "the output directory")
        _err(f"output_dir: cannot write {where!r}: {e.strerror or os.strerror(e.errno)}; "
             f"what was written before stays (the last checkpoint, if any); free space "
             f"and continue with --resume")
        return EXIT_WRITE
    finally:  # the command is the process's life: its folders' locks end with it
        while _HELD:
            _HELD.pop().release()
        del _STAGE[:], _STAGE_DIR[:]
        restore_sigterm()


def console(argv: Optional[Sequence[str]] = None) -> NoReturn:
    """The console script ``fedjax-fair`` and ``python -m fedjax_fair.cli``: exits with
    ``main``'s status. Its first act is the command's signal handler (until then, while
    the package is imported, ``core.interrupts.guard_import``'s: one line, status 130),
    and once ``main`` returns SIGINT / SIGTERM are ignored: every write is done, and the
    process ends with ``main``'s status. What the command leaves in memory is frozen out
    of the garbage collector first (``gc.freeze``): the interpreter's collections at exit
    otherwise walk every jaxpr, tracer cache and compiled program the command made, 0.45
    s of a 0.6 s exit after a femnist_like run. Everything is still released when the
    process ends; the command's files are closed by then. The same holds while it
    works (``_collect_less``): the imported modules are frozen, and young objects are
    collected every ``GC_THRESHOLDS[0]`` allocations instead of 700."""
    _interrupt_on_sigterm()  # first: replaces the import guard's handler
    _collect_less()
    status = None
    try:
        status = main(argv)
        _ignore_signals()
    except KeyboardInterrupt:  # in the instants around main's own handler
        _ignore_signals()
        _err("interrupted before anything was written" if status is None else
             "interrupted as the command finished; every output was written")
        status = EXIT_INTERRUPTED
    import gc
    gc.freeze()
    sys.exit(status)


# the garbage collector's thresholds in a command's process: (young objects between
# collections, young collections between middle ones, middle between full ones);
# CPython's default is (700, 10, 10). docs/performance.md, "The first run's fixed cost".
GC_THRESHOLDS = (20_000, 10, 10)


def _collect_less() -> None:
    """The command's process collects garbage less often: tracing and lowering a round
    program allocate a few million short-lived objects, and at CPython's default
    thresholds the collections that walk them and the imported modules' objects took
    0.3-0.4 s of a 7 s first run (femnist_like, the MLP), on the thread that traces and
    dispatches. The modules' objects are frozen out of every collection (``gc.freeze``;
    they live as long as the process), and young collections come every
    ``GC_THRESHOLDS[0]`` allocations: 0.1 s in all. Garbage is still collected, only
    in larger batches (a young generation of tens of thousands of objects, a few MB).
    Only ``console`` does this: ``main`` called in a notebook or a test leaves the
    interpreter's collector as it is."""
    import gc
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _ignore_signals() -> None:
    import signal
    import threading
    if threading.current_thread() is threading.main_thread():
        for sig in interrupts.SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def _in_gc_callback(frame) -> bool:
    """Whether ``frame`` runs inside a garbage-collector callback (JAX registers one):
    an exception raised there is printed as "Exception ignored" and lost."""
    import gc
    codes = {getattr(c, "__code__", None) for c in gc.callbacks}
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def _interrupt(signum, frame):
    """The command's SIGINT / SIGTERM handler: records the stop request
    (``core.interrupts.record``), then raises ``KeyboardInterrupt``, or, inside a
    garbage-collector callback (where it would be swallowed), sends the same signal
    again 50 ms later. A ``KeyboardInterrupt`` swallowed anyway (a weakref callback, a
    finalizer) is not lost: the recorded request stops the command at its next safe
    point (``common.check_interrupted``) or when it ends."""
    import os
    import threading
    interrupts.record(signum)
    if _in_gc_callback(frame):
        threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()
        return
    raise KeyboardInterrupt


def _quiet_interrupts(previous):
    """A ``sys.unraisablehook`` that leaves out the "Exception ignored ...
    KeyboardInterrupt" CPython prints when a callback swallows the handler's exception:
    the recorded stop request carries it on. Anything else goes to ``previous``."""
    def hook(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and interrupts.requested():
            return
        previous(unraisable)
    return hook


def _interrupt_on_sigterm():
    """For the command's span (``core.interrupts.begin`` / ``end``): SIGTERM raises
    KeyboardInterrupt, as SIGINT does (the runner's ``stop_on_signals`` turns both into
    a stop request while rounds run), so that it ends with one line instead of dying
    silently; every signal is also recorded as a stop request that a swallowed
    exception cannot lose (``_interrupt``), and a swallowed one is not printed
    (``_quiet_interrupts``). Returns the restorer."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    interrupts.begin()
    previous = {sig: signal.signal(sig, _interrupt) for sig in interrupts.SIGNALS}
    hook = sys.unraisablehook
    sys.unraisablehook = _quiet_interrupts(hook)

    def restore():
        for sig, old in previous.items():
            signal.signal(sig, old)
        sys.unraisablehook = hook
        interrupts.end()
    return restore
