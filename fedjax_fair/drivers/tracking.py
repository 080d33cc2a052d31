"""Experiment tracking: a run's results in TensorBoard, Weights & Biases and MLflow.

One tracked run is one algorithm x seed of a simulation; runs of one comparison or
sweep share a ``group`` so the dashboards compare them. Each backend is written
through its own library, imported only when a run asks for it::

    kinds = check_trackers(["tensorboard", "mlflow"])   # before any compute
    with open_run(kinds, out, group="compare_synthetic", name="qffl/seed0",
                  config=config) as run:
        log_history(run, result.history, result.client_history)

Where the files go, all under ``directory`` (the run's output folder):

- TensorBoard (``tensorboardX``): event files in ``directory/tensorboard/<name>``, so
  ``tensorboard --logdir directory/tensorboard`` shows every run of the group. The
  config is a text summary ``config`` and the HParams dashboard's hyper-parameters
  (a session start written into the run's own folder; the dashboard takes the
  metrics from the run's scalars).
- Weights & Biases (``wandb``), offline: ``directory/wandb/offline-run-*``, project
  ``fedjax-fair``, with ``group``, ``name`` and ``config``; no console capture, code,
  git state, requirements or system statistics. ``wandb sync`` uploads it later. W&B's
  service writes the log and completes it after ``finish`` returns: it is whole once
  the process exits or ``wandb.teardown()`` returns.
- MLflow (``mlflow-skinny``): the file store ``directory/mlruns`` (experiment =
  ``group``, run name = ``name``, params = the flattened config). Histograms, which
  MLflow has no type for, are JSON artifacts ``histograms/<name>/round_<step>.json``.
- ``directory/tracking/<name>.json``: each backend's run id and the last step it
  recorded, for ``resume``.

Metric names are made valid for every backend by ``metric_name`` (``%`` becomes
``pct``: ``accuracy_worst_10%`` is ``accuracy_worst_10pct``). Values that are not
finite real numbers are skipped (``clean_scalars``).

Offline means offline: a W&B run is created in offline mode and W&B's process-wide
settings are switched to offline too (otherwise W&B 0.31 still sends usage
telemetry); MLflow's usage telemetry is off unless ``MLFLOW_DISABLE_TELEMETRY`` is
set, and its file store (in maintenance mode since MLflow 3.x) is allowed unless
``MLFLOW_ALLOW_FILE_STORE`` is set (both are set in ``os.environ`` before MLflow is
first imported). See docs/tracking.md.
"""
from __future__ import annotations

import importlib.util
import json
import math
import numbers
import os
import pathlib
import re
import shutil
import sys
import time
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from fedjax_fair import hparams as H
from fedjax_fair.hparams import FieldError, FieldTypeError

KINDS = ("tensorboard", "wandb", "mlflow")
PROJECT = "fedjax-fair"  # the W&B project of every run
INSTALL = 'pip install -e ".[tracking]"'
# each tracker's module and the package that provides it
_PACKAGES = {"tensorboard": ("tensorboardX", "tensorboardX"),
             "wandb": ("wandb", "wandb"),
             "mlflow": ("mlflow", "mlflow-skinny")}
_STATE_DIR = "tracking"  # directory/tracking/<name>.json: run ids and steps, for resume
_MAX_NAME = 250  # MLflow's longest metric / param key
_PARAM_LENGTH = 6000  # MLflow's longest param value (mlflow.utils.validation)


# ---------------------------------------------------------------- pure helpers

def check_trackers(kinds: Sequence[str]) -> tuple[str, ...]:
    """The tracker names ``kinds`` (a name or a sequence of names from ``KINDS``),
    each once, in order, after checking that each one's library is installed. It
    imports nothing (``importlib.util.find_spec``), so it is cheap enough to run
    before any compute.

    An unknown name, or a library that is not installed, raises
    ``FieldError("tracker", ...)`` (a ``ValueError``: ``"tracker: ..."``), one line
    naming the missing packages and ``pip install -e ".[tracking]"``."""
    if isinstance(kinds, str):
        kinds = (kinds,)
    chosen: list[str] = []
    for kind in kinds:
        if kind not in KINDS:
            raise FieldError("tracker", f"unknown tracker {kind!r}; choose from "
                                        f"{', '.join(KINDS)}")
        if kind not in chosen:
            chosen.append(kind)
    missing = [f"{kind} needs {_PACKAGES[kind][1]}" for kind in chosen
               if not _installed(_PACKAGES[kind][0])]
    if missing:
        raise FieldError("tracker", f"{', '.join(missing)}, not installed; install the "
                                    f"trackers with {INSTALL}")
    return tuple(chosen)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # imported, without a spec
        return module in sys.modules
    except ImportError:
        return False


_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-/]")


def metric_name(key: str) -> str:
    """``key`` as a metric (or parameter) name valid in all three backends: ``%``
    becomes ``pct`` (``accuracy_worst_10%`` -> ``accuracy_worst_10pct``), any other
    character but letters, digits, ``_ - . /`` becomes ``_``, empty, ``.`` and ``..``
    path parts are dropped or replaced (MLflow stores names as paths; ``/`` groups
    charts in TensorBoard and W&B), and the name is at most 250 characters."""
    name = _UNSAFE.sub("_", str(key).replace("%", "pct"))[:_MAX_NAME]
    parts = ["__" if p == ".." else p for p in name.split("/") if p not in ("", ".")]
    return "/".join(parts) or "_"


def _real(value) -> Optional[float]:
    """``value`` as a finite float, or None when it is not a finite real number
    (strings, None, booleans, containers, arrays of more than one element, NaN, inf)."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, np.ndarray):
        if value.shape != () or not np.issubdtype(value.dtype, np.number):
            return None
        value = value.item()
    if not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def clean_scalars(scalars: Mapping[str, Any]) -> dict[str, float]:
    """The finite real numbers of ``scalars`` (Python or NumPy numbers, 0-d arrays) as
    floats under their ``metric_name``; anything else (text, None, booleans, lists,
    NaN, +-inf) is left out. Two keys that map to one name keep the later value."""
    out = {}
    for key, value in scalars.items():
        value = _real(value)
        if value is not None:
            out[metric_name(key)] = value
    return out


def _plain(value):
    """``value`` with NumPy scalars and arrays as Python numbers and lists, tuples as
    lists and mappings with string keys, so it serialises as JSON."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.ndarray, np.generic)):
        return _plain(value.tolist())
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    return str(value)


def flatten_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as one level of hyper-parameters: nested mappings joined with ``.``
    (``{"system": {"dropout": 0.1}}`` -> ``system.dropout``), keys through
    ``metric_name``; values a ``str``, ``bool``, ``int`` or ``float`` (NumPy scalars
    converted), anything else (lists, None) as compact JSON text."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, Mapping) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
            return
        value = _plain(value)
        if not isinstance(value, (str, bool, int, float)):
            value = json.dumps(value, separators=(",", ":"))
        out[metric_name(prefix)] = value

    for key, value in config.items():
        walk(str(key), value)
    return out


def _param_value(value) -> str:
    """A flattened config value as MLflow param text, at most 6000 characters (longer
    text ends in ``...``)."""
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= _PARAM_LENGTH else text[:_PARAM_LENGTH - 3] + "..."




def _check_name(name: str) -> str:
    """A run name is a relative path of non-empty parts (``qffl/seed0``): it names the
    run's TensorBoard folder and its state file."""
    if not isinstance(name, str):
        raise FieldTypeError("name", f"must be a string, got {type(name).__name__}")
    if any(p in ("", ".", "..") or "\\" in p for p in name.split("/")):
        raise FieldError("name", f"must be a relative path like 'qffl/seed0' (no empty, "
                                 f"'.' or '..' parts), got {name!r}")
    return name


# ---------------------------------------------------------------- the backends
# Each writer is opened with the state it saved last time (None for a fresh run) and
# keeps in ``state`` what a resumed run needs: its ids and ``step``, the last step
# it recorded (None before any).

class _TensorBoard:
    kind = "tensorboard"

    def __init__(self, directory: str, group: str, name: str, config: dict,
                 previous: Optional[dict], flat: dict):
        from tensorboardX import SummaryWriter
        from tensorboardX.summary import hparams
        self.state = {"step": previous.get("step") if previous else None}
        done = self.state["step"]
        # purge: on resume the steps after the last one recorded (a crash may have left
        # some), on a fresh run everything an earlier run left in this folder
        # one event file per session, named in time order: tensorboardX names files by
        # the second, and a second session within it would overwrite the first's
        self.writer = SummaryWriter(logdir=os.path.join(directory, "tensorboard", name),
                                    purge_step=0 if done is None else done + 1,
                                    filename_suffix=f".{time.time_ns()}")
        _, session_start, self._session_end = hparams(flat, {})
        self.writer.file_writer.add_summary(session_start)
        rows = "\n".join(f"| {k} | {str(v).replace('|', '&#124;')} |"
                         for k, v in flat.items())
        self.writer.add_text("config", f"| parameter | value |\n|---|---|\n{rows}",
                             0 if done is None else done + 1)
        self.writer.flush()

    def scalars(self, step: int, scalars: dict) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def histogram(self, step: int, name: str, values: np.ndarray) -> None:
        self.writer.add_histogram(name, values, step)
        self.writer.flush()

    def close(self, failed: bool) -> None:
        from tensorboardX.proto.api_pb2 import Status
        from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData
        end = self._session_end
        if failed:  # the same session end summary, with the status FAILURE
            data = HParamsPluginData.FromString(end.value[0].metadata.plugin_data.content)
            data.session_end_info.status = Status.Value("STATUS_FAILURE")
            end.value[0].metadata.plugin_data.content = data.SerializeToString()
        self.writer.file_writer.add_summary(end)
        self.writer.close()


def _wandb_settings(wandb) -> Any:
    """W&B settings that keep an offline run quiet and fast: no console capture, no
    code, git state, requirements, system metadata or statistics. Fields this W&B
    version lacks are left out."""
    wanted = dict(mode="offline", silent=True, quiet=True, console="off",
                  save_code=False, disable_code=True, disable_git=True,
                  disable_job_creation=True, x_disable_stats=True,
                  x_disable_meta=True, x_disable_machine_info=True,
                  x_save_requirements=False)
    fields = getattr(wandb.Settings, "model_fields", None)
    if fields is not None:
        wanted = {k: v for k, v in wanted.items() if k in fields}
    return wandb.Settings(**wanted)


class _WandB:
    kind = "wandb"

    def __init__(self, directory: str, group: str, name: str, config: dict,
                 previous: Optional[dict], flat: dict):
        import wandb
        self.wandb = wandb
        settings = _wandb_settings(wandb)
        # process-wide offline too: W&B decides on its usage telemetry from the global
        # settings, not the run's
        wandb.setup(settings=wandb.Settings(mode="offline", silent=True))
        run_id = previous.get("id") if previous else None
        self.run = wandb.init(
            mode="offline", dir=directory, project=PROJECT, group=group, name=name,
            config=_plain(config), id=run_id, resume="allow" if run_id else None,
            reinit="create_new", settings=settings)
        self.state = {"id": self.run.id,
                      "step": previous.get("step") if previous else None}

    def scalars(self, step: int, scalars: dict) -> None:
        self.run.log(scalars, step=step)

    def histogram(self, step: int, name: str, values: np.ndarray) -> None:
        self.run.log({name: self.wandb.Histogram(values)}, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class _MLflow:
    kind = "mlflow"

    def __init__(self, directory: str, group: str, name: str, config: dict,
                 previous: Optional[dict], flat: dict):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
        self.uri = mlflow_uri(directory)
        self.client = MlflowClient(tracking_uri=self.uri)
        run = None
        if previous and previous.get("run_id"):
            try:
                run = self.client.get_run(previous["run_id"])
            except MlflowException:  # the store was removed: a new run
                run = None
            if run is not None and run.info.lifecycle_stage != "active":
                run = None
        if run is None:
            run = self.client.create_run(self._experiment(group, MlflowException),
                                         run_name=name)
            previous = None
        else:
            self.client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        # params cannot change in MLflow: a resumed run adds the new keys only
        known = run.data.params
        params = [Param(k, _param_value(v)) for k, v in flat.items() if k not in known]
        for i in range(0, len(params), 100):  # MLflow's batch limit
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.state = {"run_id": self.run_id, "experiment_id": run.info.experiment_id,
                      "step": previous.get("step") if previous else None}

    def _experiment(self, group: str, MlflowException) -> str:
        found = self.client.get_experiment_by_name(group)
        if found is None:
            try:
                return self.client.create_experiment(group)
            except MlflowException:  # created meanwhile by another process?
                found = self.client.get_experiment_by_name(group)
                if found is None:
                    raise
        if found.lifecycle_stage != "active":
            self.client.restore_experiment(found.experiment_id)
        return found.experiment_id

    def scalars(self, step: int, scalars: dict) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def histogram(self, step: int, name: str, values: np.ndarray) -> None:
        self.client.log_dict(self.run_id, {"step": step, "values": values.tolist()},
                             f"histograms/{name}/round_{step:06d}.json")

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


def mlflow_uri(directory: str) -> str:
    """The tracking URI of the MLflow file store of ``directory``: the ``file://`` URI
    of ``directory/mlruns`` (absolute)."""
    return pathlib.Path(directory, "mlruns").resolve().as_uri()


_WRITERS = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow}


# ---------------------------------------------------------------- the run

FOLDERS = (_STATE_DIR, "tensorboard", "wandb", "mlruns")  # the records first


def discard_runs(directory: str) -> list[str]:
    """Removes every tracked run under ``directory``: the run records
    (``tracking/``), then the TensorBoard, W&B and MLflow folders the backends wrote
    there. The command line calls it when a fresh run replaces a folder's results
    (``--overwrite``), so the dashboards do not mix the old runs with the new. Returns
    the folders removed. Nothing is imported and nothing outside these folders is
    touched."""
    removed = []
    for folder in FOLDERS:
        path = os.path.join(directory, folder)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
            removed.append(folder)
    return removed


def state_path(directory: str, name: str) -> str:
    """The file in which a tracked run keeps its backends' run ids and steps."""
    return os.path.join(directory, _STATE_DIR, _check_name(name) + ".json")


def _read_state(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise FieldError("tracker", f"{path} is unreadable ({e}); remove it to track "
                                    f"the resumed run as a new one") from None
    return state


def _write_state(path: str, state: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f, indent=1)
    os.replace(tmp, path)


class Run:
    """One tracked run (one algorithm x seed) in each chosen backend; made by
    ``open_run``, closed by ``close`` or by leaving its ``with`` block (an exception
    marks it failed).

    Steps are evaluation rounds and must not decrease within a session. A resumed
    run skips, per backend, the steps that backend already recorded, so logging a
    resumed run's whole history again adds only what is new."""

    def __init__(self, writers: list, path: Optional[str], kept: Optional[dict] = None):
        self._writers = writers
        self._path = path
        self._kept = kept or {}  # the records of backends this session does not write
        # steps up to these were recorded before this session: skipped
        self._done = {w.kind: w.state["step"] for w in writers}
        self._last = -1
        self.closed = False
        self._save()

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(w.kind for w in self._writers)

    @property
    def ids(self) -> dict:
        """Each backend's run identity: ``{"wandb": {"id": ...}, "mlflow": {"run_id":
        ..., "experiment_id": ...}, ...}`` (and the last ``step`` it recorded)."""
        return {w.kind: dict(w.state) for w in self._writers}

    def _targets(self, step) -> tuple[int, list]:
        if self.closed:
            raise ValueError("logging to a closed tracked run")
        step = H.count(step, "step", minimum=0)
        if step < self._last:
            raise FieldError("step", f"{step} is before the last step logged, {self._last}")
        self._last = step
        return step, [w for w in self._writers
                      if self._done[w.kind] is None or step > self._done[w.kind]]

    def _mark(self, writers: list, step: int) -> None:
        for w in writers:
            w.state["step"] = step
        self._save()

    def _save(self) -> None:
        if self._path is not None:
            _write_state(self._path, {**self._kept, **self.ids})

    def log_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        """Logs the finite real numbers of ``scalars`` at ``step`` under their
        ``metric_name`` (``clean_scalars``: text, None, booleans and non-finite values
        are skipped)."""
        step, writers = self._targets(step)
        values = clean_scalars(scalars)
        if not writers or not values:
            return
        for w in writers:
            w.scalars(step, values)
        self._mark(writers, step)

    def log_histogram(self, step: int, name: str, values: np.ndarray) -> None:
        """Logs the distribution of ``values`` (e.g. every client's accuracy) at
        ``step`` under ``metric_name(name)``; non-finite values are left out and
        nothing is logged when none is left."""
        step, writers = self._targets(step)
        values = np.asarray(values, dtype=np.float64).ravel()
        values = values[np.isfinite(values)]
        if not writers or not values.size:
            return
        for w in writers:
            w.histogram(step, metric_name(name), values)
        self._mark(writers, step)

    def close(self, *, failed: bool = False) -> None:
        """Ends the run in every backend (``failed``: marked failed where the backend
        can say so: W&B's exit code, MLflow's status, TensorBoard's HParams session
        status). A second call does nothing."""
        if self.closed:
            return
        self.closed = True
        errors = []
        for w in self._writers:
            try:
                w.close(failed)
            except Exception as e:  # close the others all the same
                errors.append(e)
        self._save()
        if errors:
            raise errors[0]

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)


def open_run(kinds: Sequence[str], directory: str, *, group: str, name: str,
             config: Mapping[str, Any], resume: bool = False) -> Run:
    """Opens one tracked run in each tracker of ``kinds`` (``check_trackers``; none:
    a run that records nothing and writes no file), its files under ``directory``.

    ``group`` groups the runs one comparison or sweep compares (e.g.
    ``"compare_synthetic"``: the MLflow experiment, the W&B group); ``name`` names
    this run within it (e.g. ``"qffl/seed0"``: W&B and MLflow run name, the
    TensorBoard run folder); ``config`` is recorded as the run's hyper-parameters.

    ``resume``: continue the run that ``directory/tracking/<name>.json`` records (the
    same MLflow run and W&B run id; TensorBoard appends to the run's folder, hiding
    anything logged after the last step recorded), skipping the steps each backend
    already has; a backend without a record starts a new run. Without ``resume`` a
    new run is started and the record replaced."""
    kinds = check_trackers(kinds)
    if not isinstance(group, str) or not group:
        raise FieldError("group", f"must be a non-empty string, got {group!r}")
    path = state_path(directory, name)
    if not kinds:
        return Run([], None)
    previous = _read_state(path) if resume else {}
    config = dict(config)
    flat = flatten_config(config)
    os.makedirs(directory, exist_ok=True)
    writers: list = []
    try:
        for kind in kinds:
            writers.append(_WRITERS[kind](directory, group, name, config,
                                          previous.get(kind), flat))
    except BaseException:
        for w in writers:
            try:
                w.close(True)
            except Exception:
                pass
        raise
    return Run(writers, path, {k: v for k, v in previous.items() if k not in kinds})


def log_history(run: Run, history: Sequence[Mapping[str, Any]],
                client_history: Optional[Mapping[str, Any]] = None, *,
                histograms: Sequence[str] = ("accuracy",)) -> None:
    """Logs a finished run: every evaluation of ``history`` (dicts with ``"round"``
    and the summary metrics, ``RunResult.history``) as scalars at step = its round,
    and, from ``client_history`` (``{"round": [E], "accuracy": [E, N], ...}``,
    ``RunResult.client_history``), a histogram ``clients/<key>`` of each per-client
    metric named in ``histograms`` at the same step. Each evaluation's scalars and
    histograms are logged together, in round order (W&B needs steps that never
    decrease)."""
    rows: dict[int, int] = {}
    arrays: dict[str, np.ndarray] = {}
    if client_history is not None:
        rows = {int(r): i for i, r in enumerate(np.asarray(client_history["round"]))}
        arrays = {k: np.asarray(client_history[k]) for k in histograms
                  if k in client_history}
    for entry in history:
        step = int(entry["round"])
        run.log_scalars(step, {k: v for k, v in entry.items() if k != "round"})
        if step in rows:
            for key, table in arrays.items():
                run.log_histogram(step, f"clients/{key}", table[rows[step]])
