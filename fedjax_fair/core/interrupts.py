"""SIGINT / SIGTERM of the ``fedjax-fair`` command: a stop request that is never lost.

Standard library only (``fedjax_fair.core`` imports nothing on its own):
``fedjax_fair/__init__`` imports this module before anything else (jax, the methods),
so that it runs in the command's first instants.

* ``guard_import()``: when the process is the command (the console script
  ``fedjax-fair``, or ``python -m fedjax_fair.cli``), a SIGINT or SIGTERM while the
  package is being imported (a second or two: jax, every method) ends the process at
  once with one line on stderr and status 130; nothing has been written by then. The
  command's own handler (``cli._interrupt``) replaces it as the first thing ``cli.console``
  does. A library import (a notebook, a test) changes no handler.
* ``begin`` / ``end``: the span of a command (``cli.console``, ``cli.main``; nested calls
  count once). Inside it, ``record`` keeps every SIGINT / SIGTERM as a stop request that
  only the command's end clears (or ``clear``, by a command that has honoured it and
  goes on to write what the stop keeps). The command's handlers record the signal as
  well as raising ``KeyboardInterrupt`` (``cli._interrupt``) or asking the runner to stop
  at the chunk's end (``runner.stop_on_signals``): an exception raised inside a
  garbage-collector or weakref callback (JAX registers both) is swallowed by CPython
  ("Exception ignored ...") and the command would go on to exit 0, while a recorded
  request stays, and the command honours it at its next safe point
  (``cli.common.check_interrupted``) or when it ends. Outside a command ``record`` does
  nothing, so a library's ``stop_on_signals`` behaves as before.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

EXIT_INTERRUPTED = 130  # cli.common.EXIT_INTERRUPTED
SIGNALS = (signal.SIGINT, signal.SIGTERM)
CONSOLE_SCRIPTS = ("fedjax-fair", "fedjax-fair.exe", "fedjax-fair-script.py")
CLI_MODULES = ("fedjax_fair.cli", "fedjax_fair.cli.__main__")

_REQUESTED = threading.Event()
_DEPTH = [0]  # commands running in this process (console, then main inside it)


def is_command() -> bool:
    """Whether this process is the ``fedjax-fair`` command, while the package is being
    imported: the console script (its path is ``sys.argv[0]``), or
    ``python -m fedjax_fair.cli`` (``sys.argv[0]`` is ``"-m"`` until the module is found;
    ``sys.orig_argv`` names it)."""
    first = sys.argv[0] if sys.argv else ""
    if os.path.basename(first) in CONSOLE_SCRIPTS:
        return True
    if first != "-m":
        return False
    argv = list(getattr(sys, "orig_argv", ()))
    for i, arg in enumerate(argv[1:], 1):
        if arg == "-m":
            return i + 1 < len(argv) and argv[i + 1] in CLI_MODULES
        if arg.startswith("-m"):
            return arg[2:] in CLI_MODULES
    return False


def guard_import() -> None:
    """In the command's process (``is_command``), SIGINT / SIGTERM end it at once with
    one line and status 130 until the command's own handler is installed."""
    if threading.current_thread() is threading.main_thread() and is_command():
        for sig in SIGNALS:
            signal.signal(sig, _exit_at_once)


def _exit_at_once(signum, frame) -> None:
    """The import guard's handler: nothing is written yet, and nothing needs closing."""
    os.write(2, b"error: interrupted while starting; nothing was written\n")
    os._exit(EXIT_INTERRUPTED)


def begin() -> None:
    """A command starts (the outermost one clears any earlier request)."""
    _DEPTH[0] += 1
    if _DEPTH[0] == 1:
        _REQUESTED.clear()


def end() -> None:
    """A command ends (the outermost one clears its request)."""
    _DEPTH[0] = max(0, _DEPTH[0] - 1)
    if _DEPTH[0] == 0:
        _REQUESTED.clear()


def record(signum=None) -> None:
    """Keeps a SIGINT / SIGTERM as the running command's stop request (nothing outside a
    command)."""
    if _DEPTH[0]:
        _REQUESTED.set()


def requested() -> bool:
    """Whether a signal came since the command started (and was not ``clear``-ed)."""
    return _REQUESTED.is_set()


def clear() -> None:
    """The request is honoured: the command stops, writing what the stop keeps (a
    comparison's table of its finished runs); a later signal is a new request."""
    _REQUESTED.clear()
