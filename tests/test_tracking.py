"""fedjax_fair/drivers/tracking.py: real files written by the real libraries, read back.

* TensorBoard: the event files through TensorBoard's own ``EventAccumulator`` (scalars
  at their steps, per-client histograms, the HParams session, resume and purge).
* MLflow: the file store through ``MlflowClient`` (experiment, run name, params,
  metric histories, histogram artifacts, status, resume into the same run).
* W&B: the offline run's transaction log (``run-<id>.wandb``: a LevelDB-style log of
  ``wandb_internal_pb2.Record``, read here with W&B's own protobuf classes; W&B ships
  no Python reader any more), resume with the same run id, no W&B process left.
* The three together in a fresh interpreter whose socket calls are blocked: nothing
  leaves the machine, with none of the offline variables set by the caller.

Each backend's tests skip when its library is missing (``pip install -e
".[tracking]"``); the pure helpers and the argument checks run everywhere. Nothing
needs the network: W&B offline, MLflow telemetry off (module fixture).
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import struct
import subprocess
import sys
import textwrap
import time
from unittest.mock import ANY

import numpy as np
import pytest

from fedjax_fair.drivers import tracking as T

GROUP, NAME = "compare_synthetic", "qffl/seed0"
ROUNDS = (0, 2, 4, 6)
CONFIG = {"method": "qffl", "client_lr": 0.05, "seed": 0, "fair": True,
          "system": {"dropout": 0.1, "speeds": [1.0, 2.0]}, "note": "x" * 7000}


def history(shift: float = 0.0) -> list:
    """Four evaluations as ``RunResult.history`` has them, with a text and a NaN
    entry that no tracker receives."""
    return [{"round": r, "accuracy_mean": 0.5 + 0.01 * r + shift,
             "accuracy_worst_10%": 0.2 + 0.02 * r + shift,
             "validation_accuracy_mean": np.float32(0.4 + 0.01 * r),
             "clock_seconds": 1.5 * r, "seconds": np.float64(0.25),
             "status": "ok", "test_loss": float("nan")} for r in ROUNDS]


# the names each tracker must show, and the values at each round
LOGGED = {"accuracy_mean", "accuracy_worst_10pct", "validation_accuracy_mean",
          "clock_seconds", "seconds"}


def expected(shift: float = 0.0) -> dict:
    return {h["round"]: {"accuracy_mean": h["accuracy_mean"],
                         "accuracy_worst_10pct": h["accuracy_worst_10%"],
                         "validation_accuracy_mean": float(h["validation_accuracy_mean"]),
                         "clock_seconds": h["clock_seconds"], "seconds": 0.25}
            for h in history(shift)}


CLIENTS = {"round": np.asarray(ROUNDS),
           "accuracy": np.random.default_rng(0).uniform(0.2, 0.9, (len(ROUNDS), 9)),
           "loss": np.ones((len(ROUNDS), 9))}


@pytest.fixture(scope="module", autouse=True)
def offline(tmp_path_factory):
    """No tracker reaches the network, and W&B keeps its files out of the home
    directory (set before MLflow is first imported, which reads its telemetry
    switch then)."""
    home = tmp_path_factory.mktemp("tracker_home")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                           "WANDB_ERROR_REPORTING": "false",
                           "WANDB_CONFIG_DIR": str(home / "config"),
                           "WANDB_CACHE_DIR": str(home / "cache"),
                           "WANDB_DATA_DIR": str(home / "data"),
                           "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true",
                           "MLFLOW_ALLOW_FILE_STORE": "true"}.items():
            mp.setenv(key, value)
        yield


# ----------------------------------------------------------------- pure helpers

def test_metric_names_are_valid_everywhere_and_stable():
    assert T.metric_name("accuracy_worst_10%") == "accuracy_worst_10pct"
    assert T.metric_name("accuracy_worst_10%_unweighted") == "accuracy_worst_10pct_unweighted"
    assert T.metric_name("system/reported") == "system/reported"
    assert T.metric_name("a b:c(d)") == "a_b_c_d_"
    assert T.metric_name("/x//y/./../z/") == "x/y/__/z"
    assert T.metric_name("%") == "pct" and T.metric_name("") == "_"
    assert len(T.metric_name("a" * 300)) == 250
    for key in ("accuracy_worst_10%", "a b:c", "/x//y/../z/", "é€", "a" * 300):
        name = T.metric_name(key)
        parts = name.split("/")
        assert all(c.isascii() and (c.isalnum() or c in "_-./") for c in name)
        assert all(p not in ("", ".", "..") for p in parts)
        assert T.metric_name(name) == name  # a name maps to itself


def test_clean_scalars_keeps_finite_real_numbers_only():
    out = T.clean_scalars({"a": 1, "b": np.float32(0.5), "c": np.int64(3), "d": np.array(2.0),
                           "e": "text", "f": None, "g": True, "h": np.bool_(False),
                           "i": float("nan"), "j": -np.inf, "k": [1.0], "l": np.ones(2),
                           "m%": 0.25})
    assert out == {"a": 1.0, "b": 0.5, "c": 3.0, "d": 2.0, "mpct": 0.25}
    assert all(type(v) is float for v in out.values())


def test_flatten_config_gives_one_level_of_plain_values():
    flat = T.flatten_config({"lr": np.float32(0.5), "n": np.int64(3), "on": True,
                             "system": {"dropout": 0.1, "clock": {"deadline": None}},
                             "speeds": (1, 2), "empty": {}, "name": "q%"})
    assert flat == {"lr": 0.5, "n": 3, "on": True, "system.dropout": 0.1,
                    "system.clock.deadline": "null", "speeds": "[1,2]", "empty": "{}",
                    "name": "q%"}
    assert type(flat["lr"]) is float and type(flat["n"]) is int


# ----------------------------------------------------------------- arguments

def _all_installed(monkeypatch, missing=()):
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in missing else object())


def test_check_trackers_validates_names_in_order_once(monkeypatch, tmp_path):
    _all_installed(monkeypatch)
    assert T.check_trackers(["mlflow", "tensorboard", "mlflow"]) == ("mlflow", "tensorboard")
    assert T.check_trackers("wandb") == ("wandb",)
    assert T.check_trackers([]) == ()
    for bad in (["tensorboard", "neptune"], ["TensorBoard"]):
        with pytest.raises(ValueError, match="^tracker:") as e:
            T.check_trackers(bad)
        assert e.value.field == "tracker"
    with pytest.raises(ValueError, match="^tracker:"):
        T.open_run(["comet"], str(tmp_path / "out"), group=GROUP, name=NAME, config={})
    assert not (tmp_path / "out").exists()


def test_a_missing_library_is_a_tracker_error_naming_the_package(monkeypatch, tmp_path):
    _all_installed(monkeypatch, missing=("mlflow", "tensorboardX"))
    with pytest.raises(ValueError, match="^tracker:") as e:
        T.check_trackers(["tensorboard", "wandb", "mlflow"])
    message = str(e.value)
    assert e.value.field == "tracker" and "\n" not in message and '.[tracking]"' in message
    assert "tensorboardX" in message and "mlflow-skinny" in message and "wandb" not in message
    assert T.check_trackers(["wandb"]) == ("wandb",)
    with pytest.raises(ValueError, match="^tracker:"):  # before any file is written
        T.open_run(["mlflow"], str(tmp_path / "out"), group=GROUP, name=NAME, config={})
    assert not (tmp_path / "out").exists()


def test_no_tracker_records_nothing_and_steps_are_checked(tmp_path):
    with T.open_run([], str(tmp_path / "out"), group=GROUP, name=NAME, config=CONFIG) as run:
        T.log_history(run, history(), CLIENTS)
        for bad in (-1, 1.5, True, "3"):
            with pytest.raises(ValueError, match="^step:") as e:
                run.log_scalars(bad, {"a": 1.0})
            assert e.value.field == "step"
        with pytest.raises(ValueError, match="^step:"):  # before the last step logged
            run.log_scalars(2, {"a": 1.0})
        run.log_histogram(6, "h", [1.0])  # the same step again is fine
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError):  # closed
        run.log_scalars(7, {"a": 1.0})
    for name in ("", "../x", "a//b", "/abs", "a/./b", 3):
        with pytest.raises(ValueError, match="^name:") as e:
            T.open_run([], str(tmp_path), group=GROUP, name=name, config={})
        assert e.value.field == "name"
    with pytest.raises(ValueError, match="^group:"):
        T.open_run([], str(tmp_path), group="", name=NAME, config={})


# ----------------------------------------------------------------- TensorBoard

def _events(logdir):
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = ea.EventAccumulator(str(logdir), size_guidance={ea.SCALARS: 0, ea.HISTOGRAMS: 0,
                                                           ea.TENSORS: 0})
    acc.Reload()
    return acc


def _scalars(acc) -> dict:
    """{step: {tag: value}} of every scalar, with each (tag, step) seen once."""
    out: dict = {}
    for tag in acc.Tags()["scalars"]:
        for e in acc.Scalars(tag):
            assert tag not in out.setdefault(e.step, {}), (tag, e.step)
            out[e.step][tag] = e.value
    return out


def _close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for step in want:
        assert got[step].keys() == want[step].keys(), step
        np.testing.assert_allclose([got[step][k] for k in want[step]],
                                   list(want[step].values()), rtol=1e-6)


def _hparams(acc):
    from tensorboard.plugins.hparams import plugin_data_pb2
    return {tag: plugin_data_pb2.HParamsPluginData.FromString(content)
            for tag, content in acc.PluginTagToContent("hparams").items()}


def test_tensorboard_scalars_histograms_and_hparams(tmp_path):
    pytest.importorskip("tensorboardX")
    from tensorboard.plugins.hparams import api_pb2
    with T.open_run(["tensorboard"], str(tmp_path), group=GROUP, name=NAME,
                    config=CONFIG) as run:
        T.log_history(run, history(), CLIENTS)
    acc = _events(tmp_path / "tensorboard" / NAME)
    _close(_scalars(acc), expected())
    assert "clients/loss" not in acc.Tags()["histograms"]  # accuracy only, by default
    for row, event in zip(CLIENTS["accuracy"], acc.Histograms("clients/accuracy")):
        h = event.histogram_value
        assert (h.num, h.min, h.max) == (9, row.min(), row.max())
        assert h.sum == pytest.approx(row.sum())
    assert [e.step for e in acc.Histograms("clients/accuracy")] == list(ROUNDS)
    plugin = _hparams(acc)
    hp = plugin["_hparams_/session_start_info"].session_start_info.hparams
    assert hp["client_lr"].number_value == 0.05 and hp["method"].string_value == "qffl"
    assert hp["fair"].bool_value and hp["system.speeds"].string_value == "[1.0,2.0]"
    assert (plugin["_hparams_/session_end_info"].session_end_info.status
            == api_pb2.STATUS_SUCCESS)
    assert "config" in acc.Tags()["tensors"][0] or any(
        "config" in t for t in acc.Tags()["tensors"])

    with pytest.raises(RuntimeError):  # an exception ends the session as failed
        with T.open_run(["tensorboard"], str(tmp_path), group=GROUP, name="failed",
                        config=CONFIG) as run:
            run.log_scalars(0, {"a": 1.0})
            raise RuntimeError
    plugin = _hparams(_events(tmp_path / "tensorboard" / "failed"))
    assert (plugin["_hparams_/session_end_info"].session_end_info.status
            == api_pb2.STATUS_FAILURE)


def test_tensorboard_resume_appends_and_purges_what_was_not_recorded(tmp_path):
    pytest.importorskip("tensorboardX")
    out, logdir = str(tmp_path), tmp_path / "tensorboard" / NAME
    with T.open_run(["tensorboard"], out, group=GROUP, name=NAME, config=CONFIG) as run:
        T.log_history(run, history()[:3], CLIENTS)  # rounds 0, 2, 4
    # as if the process died after writing round 4 but before recording it
    path = T.state_path(out, NAME)
    with open(path) as f:
        state = json.load(f)
    assert state["tensorboard"]["step"] == 4
    state["tensorboard"]["step"] = 2
    with open(path, "w") as f:
        json.dump(state, f)
    with T.open_run(["tensorboard"], out, group=GROUP, name=NAME, config=CONFIG,
                    resume=True) as run:
        T.log_history(run, history(shift=1.0), CLIENTS)  # the whole history again
    first, second = expected(), expected(shift=1.0)
    _close(_scalars(_events(logdir)), {0: first[0], 2: first[2], 4: second[4], 6: second[6]})
    assert [e.step for e in _events(logdir).Histograms("clients/accuracy")] == list(ROUNDS)
    assert len(glob.glob(str(logdir / "events.out.tfevents.*"))) == 2

    # a new run under the same name hides everything the earlier ones wrote
    with T.open_run(["tensorboard"], out, group=GROUP, name=NAME, config=CONFIG) as run:
        T.log_history(run, history(shift=2.0)[:1])
    _close(_scalars(_events(logdir)), {0: expected(shift=2.0)[0]})


# ----------------------------------------------------------------- MLflow

def _mlflow(directory):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=T.mlflow_uri(str(directory)))


def _metric_histories(client, run_id) -> dict:
    """{step: {metric: value}} from every metric's full history (each step once)."""
    out: dict = {}
    for key in client.get_run(run_id).data.metrics:
        for m in client.get_metric_history(run_id, key):
            assert key not in out.setdefault(m.step, {}), (key, m.step)
            out[m.step][key] = m.value
    return out


def test_mlflow_file_store_holds_the_run(tmp_path):
    client = _mlflow(tmp_path)
    with T.open_run(["mlflow"], str(tmp_path), group=GROUP, name=NAME, config=CONFIG) as run:
        T.log_history(run, history(), CLIENTS)
    assert T.mlflow_uri(str(tmp_path)).startswith("file:") and (tmp_path / "mlruns").is_dir()
    experiment = client.get_experiment_by_name(GROUP)
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_id == run.ids["mlflow"]["run_id"]
    assert found.info.run_name == NAME and found.info.status == "FINISHED"
    params = found.data.params
    assert {k: params[k] for k in ("method", "client_lr", "seed", "fair", "system.dropout",
                                   "system.speeds")} == {
        "method": "qffl", "client_lr": "0.05", "seed": "0", "fair": "true",
        "system.dropout": "0.1", "system.speeds": "[1.0,2.0]"}
    assert len(params["note"]) == 6000 and params["note"].startswith("xxx")
    assert set(found.data.metrics) == LOGGED
    _close(_metric_histories(client, found.info.run_id), expected())
    arts = [f.path for f in client.list_artifacts(found.info.run_id, "histograms/clients/accuracy")]
    assert arts == [f"histograms/clients/accuracy/round_{r:06d}.json" for r in ROUNDS]
    local = client.download_artifacts(found.info.run_id, arts[1], str(tmp_path / "dl"))
    with open(local) as f:
        saved = json.load(f)
    assert saved["step"] == 2
    np.testing.assert_allclose(saved["values"], CLIENTS["accuracy"][1])


def test_mlflow_resume_continues_the_same_run(tmp_path):
    client, out = _mlflow(tmp_path), str(tmp_path)
    with T.open_run(["mlflow"], out, group=GROUP, name=NAME, config=CONFIG) as run:
        T.log_history(run, history()[:2])
        run_id = run.ids["mlflow"]["run_id"]
    with pytest.raises(RuntimeError):  # interrupted after round 4
        with T.open_run(["mlflow"], out, group=GROUP, name=NAME, config=CONFIG,
                        resume=True) as run:
            T.log_history(run, history()[:3])
            raise RuntimeError
    assert client.get_run(run_id).info.status == "FAILED"
    changed = {**CONFIG, "client_lr": 0.01, "new_key": 1}
    with T.open_run(["mlflow"], out, group=GROUP, name=NAME, config=changed,
                    resume=True) as run:
        T.log_history(run, history(shift=1.0))  # rounds 0..4 are there already
        assert run.ids["mlflow"]["run_id"] == run_id
    experiment = client.get_experiment_by_name(GROUP)
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    found = client.get_run(run_id)
    assert found.info.status == "FINISHED"
    assert found.data.params["client_lr"] == "0.05" and found.data.params["new_key"] == "1"
    first, second = expected(), expected(shift=1.0)
    _close(_metric_histories(client, run_id), {0: first[0], 2: first[2], 4: first[4],
                                               6: second[6]})
    with T.open_run(["mlflow"], out, group=GROUP, name=NAME, config=CONFIG) as run:
        assert run.ids["mlflow"]["run_id"] != run_id  # no resume: a new run


def test_resume_with_other_trackers_keeps_each_record(tmp_path):
    pytest.importorskip("tensorboardX")
    client, out = _mlflow(tmp_path), str(tmp_path)
    with T.open_run(["mlflow"], out, group=GROUP, name=NAME, config=CONFIG) as run:
        T.log_history(run, history()[:2])
        run_id = run.ids["mlflow"]["run_id"]
    # TensorBoard joins on resume: it has no record, so it receives every round
    with T.open_run(["tensorboard"], out, group=GROUP, name=NAME, config=CONFIG,
                    resume=True) as run:
        T.log_history(run, history())
    _close(_scalars(_events(tmp_path / "tensorboard" / NAME)), expected())
    with open(T.state_path(out, NAME)) as f:
        assert json.load(f) == {"mlflow": {"run_id": run_id, "experiment_id": ANY,
                                           "step": 2},
                                "tensorboard": {"step": 6}}
    with T.open_run(["mlflow"], out, group=GROUP, name=NAME, config=CONFIG,
                    resume=True) as run:
        T.log_history(run, history())
        assert run.ids["mlflow"]["run_id"] == run_id
    _close(_metric_histories(client, run_id), expected())


# ----------------------------------------------------------------- W&B

def _wandb_records(path) -> list:
    """The ``Record`` protos of a W&B transaction log: a 7-byte header (``:W&B``, a
    magic number, a version), then 32 KiB blocks of records (CRC, length, type: full,
    first, middle, last), each record's payload one serialised ``Record``."""
    from wandb.proto import wandb_internal_pb2
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, parts, out = 32768, 7, [], []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        assert len(payload) == length, "a truncated record: the log is incomplete"
        if kind == 0:
            pos += block - pos % block
            continue
        parts = [payload] if kind in (1, 2) else parts + [payload]
        if kind in (1, 4):
            out.append(wandb_internal_pb2.Record.FromString(b"".join(parts)))
    return out


def _wandb_history(records) -> dict:
    """{step: {key: value}} of the history records (nested keys joined with ``/``)."""
    out: dict = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = out.setdefault(r.history.step.num, {})
            for item in r.history.item:
                row[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def _wandb_children() -> list:
    """This process's children that run W&B's service."""
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                text = f.read()
            with open(stat[:-4] + "cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if int(text[text.rindex(")") + 2:].split()[1]) == os.getpid() and b"wandb" in cmd:
            found.append(cmd)
    return found


@pytest.fixture
def wandb():
    wandb = pytest.importorskip("wandb")
    yield wandb
    wandb.teardown()


def _torn_down(wandb) -> bool:
    wandb.teardown()
    deadline = time.monotonic() + 10
    while _wandb_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _wandb_children()


def test_wandb_offline_run_holds_config_scalars_and_histograms(tmp_path, wandb):
    with T.open_run(["wandb"], str(tmp_path), group=GROUP, name=NAME, config=CONFIG) as run:
        T.log_history(run, history(), CLIENTS)
        run_id = run.ids["wandb"]["id"]
    # W&B's service writes the log in 32 KiB blocks and closes it after finish()
    # returns: the file is complete once the service is torn down
    assert _torn_down(wandb)
    (folder,) = (tmp_path / "wandb").glob("offline-run-*")
    assert folder.name.endswith(run_id)
    records = _wandb_records(folder / f"run-{run_id}.wandb")
    (meta,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (meta.run_id, meta.project, meta.run_group, meta.display_name) == (
        run_id, T.PROJECT, GROUP, NAME)
    config = {i.key: json.loads(i.value_json) for i in meta.config.update}
    assert config["client_lr"] == 0.05 and config["system"] == {"dropout": 0.1,
                                                                 "speeds": [1.0, 2.0]}
    rows = _wandb_history(records)
    assert sorted(rows) == list(ROUNDS)
    _close({s: {k: v for k, v in row.items() if k in LOGGED} for s, row in rows.items()},
           expected())
    for row, accuracy in zip(rows.values(), CLIENTS["accuracy"]):
        assert row["clients/accuracy/_type"] == "histogram"
        assert sum(row["clients/accuracy/values"]) == len(accuracy)
        assert not {"status", "test_loss", "round"} & set(row)
    # quiet: no system statistics, metadata, requirements or code
    kinds = {r.WhichOneof("record_type") for r in records}
    assert "stats" not in kinds and "output_raw" not in kinds
    assert not list((folder / "files").glob("*"))


def test_wandb_resume_keeps_the_run_id(tmp_path, wandb):
    out = str(tmp_path)
    with T.open_run(["wandb"], out, group=GROUP, name=NAME, config=CONFIG) as run:
        T.log_history(run, history()[:2], CLIENTS)
        run_id = run.ids["wandb"]["id"]
    with T.open_run(["wandb"], out, group=GROUP, name=NAME, config=CONFIG,
                    resume=True) as run:
        T.log_history(run, history(), CLIENTS)
        assert run.ids["wandb"]["id"] == run_id
    assert _torn_down(wandb)  # the logs are complete
    # W&B cannot resume an offline run in place: the continuation is a second
    # offline folder under the same run id, holding the new rounds only
    logs = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 2 and {p.name for p in logs} == {f"run-{run_id}.wandb"}
    assert sorted(sorted(_wandb_history(_wandb_records(p))) for p in logs) == [[0, 2], [4, 6]]


# ----------------------------------------------------------------- all three, offline

_GUARDED = textwrap.dedent("""
    import atexit, json, socket, sys
    blocked = []
    atexit.register(lambda: print("BLOCKED=" + json.dumps(blocked)))  # runs last
    LOCAL = (None, "localhost", "127.0.0.1", "::1")
    def guard(event, args):
        if (event == "socket.getaddrinfo" and args[0] not in LOCAL) or (
                event == "socket.connect" and args[0].family != socket.AF_UNIX):
            blocked.append([event, repr(args[1:] if event == "socket.connect" else args[:2])])
            raise OSError("network blocked by the test")
    sys.addaudithook(guard)
    import numpy as np
    from fedjax_fair.drivers import tracking as T
    history = [{"round": r, "accuracy_mean": 0.1 * r, "accuracy_worst_10%": 0.05 * r}
               for r in range(3)]
    clients = {"round": np.arange(3), "accuracy": np.full((3, 4), 0.5)}
    with T.open_run(T.KINDS, sys.argv[1], group="g", name="fedavg/seed1",
                    config={"lr": 0.1}) as run:
        T.log_history(run, history, clients)
        print("IDS=" + json.dumps(run.ids))
""")


def test_all_trackers_together_stay_offline_by_themselves(tmp_path):
    for module in ("tensorboardX", "wandb", "mlflow", "tensorboard"):
        pytest.importorskip(module)
    # none of the variables that would keep W&B and MLflow offline anyway
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("WANDB_", "MLFLOW_")) and k not in (
               "DO_NOT_TRACK", "CI", "PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER")}
    env["WANDB_CONFIG_DIR"] = str(tmp_path / "wandb_config")
    env["WANDB_CACHE_DIR"] = str(tmp_path / "wandb_cache")
    done = subprocess.run([sys.executable, "-c", _GUARDED, str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    assert json.loads(lines["BLOCKED"]) == []
    assert "wandb:" not in done.stderr  # quiet
    ids = json.loads(lines["IDS"])
    assert set(ids) == set(T.KINDS) and all(v["step"] == 2 for v in ids.values())
    with open(T.state_path(str(tmp_path / "out"), "fedavg/seed1")) as f:
        assert json.load(f) == ids
    _close(_scalars(_events(tmp_path / "out" / "tensorboard" / "fedavg" / "seed1")),
           {r: {"accuracy_mean": 0.1 * r, "accuracy_worst_10pct": 0.05 * r} for r in range(3)})
    client = _mlflow(tmp_path / "out")
    _close(_metric_histories(client, ids["mlflow"]["run_id"]),
           {r: {"accuracy_mean": 0.1 * r, "accuracy_worst_10pct": 0.05 * r} for r in range(3)})
    (wb,) = glob.glob(str(tmp_path / "out" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert sorted(_wandb_history(_wandb_records(wb))) == [0, 1, 2]


def test_discard_runs_removes_the_trackers_folders_only(tmp_path):
    with T.open_run(["tensorboard"], str(tmp_path), group=GROUP, name=NAME,
                    config=CONFIG) as run:
        T.log_history(run, history())
    for folder in ("wandb/offline-run-x", "mlruns/0", "results"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert sorted(T.discard_runs(str(tmp_path))) == ["mlruns", "tensorboard", "tracking",
                                                     "wandb"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "results"]
    assert T.discard_runs(str(tmp_path)) == []  # nothing left to remove
