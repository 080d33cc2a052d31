"""``--tracker``: the commands' runs in TensorBoard, W&B and MLflow
(``fedjax_fair.drivers.tracking``; docs/tracking.md).

Every command logs under its output folder, one tracked run per algorithm and seed
(a sweep: per grid point and seed), grouped by the folder's name, so
``tensorboard --logdir OUT/tensorboard`` (or the W&B / MLflow group) compares every run
of one ``compare`` or ``sweep``. ``run`` logs each evaluation as it happens (scalars
and the per-client accuracy histogram); ``compare`` and ``sweep`` log a run once it is
written. Without ``--tracker`` nothing is imported and nothing is written.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Mapping, Optional, Sequence


def group(out: str) -> str:
    """The dashboards' group of a command's runs: its output folder's name."""
    return os.path.basename(os.path.normpath(os.path.abspath(out)))


def open_run(cfg, out: str, name: str, config: Mapping, resume: bool = False):
    """The tracked run ``name`` of ``cfg.tracker`` (a context manager), or a null
    context without trackers."""
    if not cfg.tracker:
        return contextlib.nullcontext(None)
    from fedjax_fair.drivers import tracking
    return tracking.open_run(cfg.tracker, out, group=group(out), name=name, config=config,
                             resume=resume)


def discard(out: str) -> None:
    """A fresh run replaces the results in ``out`` (``--overwrite``): the folder's
    earlier tracked runs go too, so its dashboards show the new runs only. Called at
    the command's first write, so a command refused before it leaves them as they
    were."""
    from fedjax_fair.drivers import tracking
    tracking.discard_runs(out)


class _Ending:
    """Ends a tracked run with the command (``common._HELD``, released by ``main``)."""

    def __init__(self, run):
        self.run = run

    def release(self, undo: bool = False) -> None:
        self.run.close()


def start(cfg, out: str, name: str, config: Mapping, resume: bool = False):
    """A tracked run that lives until the command ends (``run``'s live logging), or
    None without trackers."""
    if not cfg.tracker:
        return None
    from fedjax_fair.cli.common import _HELD
    run = open_run(cfg, out, name, config, resume).__enter__()
    _HELD.append(_Ending(run))
    return run


def on_clients(cfg, opened: Callable[[], Any]) -> Optional[Callable]:
    """``runner.run``'s ``on_clients``: each evaluation's scalars and per-client accuracy
    histogram, logged as it happens to the tracked run ``opened()`` returns (opened
    with the command's first write); None without trackers."""
    if not cfg.tracker:
        return None
    from fedjax_fair.drivers import tracking

    def log(entry: dict, per_client: dict) -> None:
        run = opened()
        history = [entry]
        clients = None
        if "accuracy" in per_client and "num_examples" in per_client:
            has_test = per_client["num_examples"] > 0
            clients = {"round": [entry["round"]],
                       "accuracy": [per_client["accuracy"][has_test]]}
        tracking.log_history(run, history, clients)
    return log


def log_run(cfg, out: str, name: str, config: Mapping, history: Sequence[Mapping],
            client_history: Optional[Mapping] = None, resume: bool = False) -> None:
    """A finished run's every evaluation (and per-client accuracies at each) to
    ``cfg.tracker``; nothing without trackers."""
    if not cfg.tracker:
        return
    from fedjax_fair.drivers import tracking
    with open_run(cfg, out, name, config, resume) as run:
        tracking.log_history(run, history, client_history)
