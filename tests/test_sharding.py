"""Sharded cohorts (fedjax_fair/core/sharding.py, docs/scaling.md).

The multi-device checks (tests/sharding_checks.py) run in a subprocess with 8 CPU
devices and report their results as JSON, which the tests here assert on; the
single-device validation follows them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
DEVICES = 8
TOL = 2e-5  # float32 rounding: the sharded reductions add in another order


# ---------------------------------------------------------------------- in pytest


def run_checks(*names, devices: int = DEVICES) -> dict:
    """Runs ``check_<name>`` for every name in a fresh process with ``devices`` CPU
    devices; returns {name: result}."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={devices}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, os.path.join(HERE, "sharding_checks.py"), *names],
                          env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULTS ")][-1]
    return json.loads(line[len("RESULTS "):])


def _assert_split_by_client(table: dict, num_clients: int = 16) -> None:
    assert table["named"] and table["spec"][0] == table["axis"]
    assert table["shards"] == DEVICES
    assert table["rows"] == num_clients and table["shard_rows"] == [num_clients // DEVICES]


@pytest.fixture(scope="module")
def default_checks():
    return run_checks("gather", "fedavg", "afedpd", "runner", "runner_auto", "cli",
                      "fresh_buffers", "server_solvers")


@pytest.fixture(scope="module")
def slow_checks():
    return run_checks("qffl", "dqn_fed", "scaffold", "runner_uneven")


def test_gather_clients_equals_a_plain_gather(default_checks):
    assert default_checks["gather"] == {"260": True, "3": True}


def test_fedavg_sharded_equals_single_device_with_padding(default_checks):
    r = default_checks["fedavg"]
    assert r["diff"] < TOL
    assert r["weights_shape"] == [2, 5]  # the padding's outputs are dropped
    # the federation is split: each device holds about an eighth of the arguments
    assert r["sharded_bytes"] < r["single_bytes"] / 4


@pytest.mark.slow
def test_scaffold_chunked_sharded_equals_single_device_and_table_is_split(slow_checks):
    r = slow_checks["scaffold"]
    assert r["diff"] < TOL
    _assert_split_by_client(r["table"])
    assert r["sharded_bytes"] < r["single_bytes"] / 4


def test_afedpd_sharded_equals_single_device_and_dual_table_is_split(default_checks):
    r = default_checks["afedpd"]
    assert r["diff"] < TOL
    _assert_split_by_client(r["table"])


def _assert_runs_equal(r) -> None:
    assert r["state_diff"] < TOL and r["accuracy_diff"] < 1e-6
    assert r["rounds"] == [0, 2, 4]
    assert r["plan_devices"] == DEVICES


def test_runner_over_a_mesh_equals_one_device(default_checks):
    """SCAFFOLD through ``runner.run``: padded cohorts, its control-variate table split
    by client, the same evaluations and state as on one device."""
    even = default_checks["runner"]["even"]
    _assert_runs_equal(even)
    _assert_split_by_client(even["table"])
    assert even["notes"] == 0
    # 6 clients do not split over 8 devices: replicated, with a note
    assert default_checks["runner"]["uneven_layout"] == {"note": True, "replicated": True}


@pytest.mark.slow
def test_runner_over_a_mesh_with_a_federation_that_does_not_split(slow_checks):
    uneven = slow_checks["runner_uneven"]["uneven"]
    _assert_runs_equal(uneven)
    assert uneven["notes"] == 1  # the log says the federation is replicated
    assert uneven["table"]["shards"] == DEVICES and uneven["table"]["shard_rows"] == [6]
    streamed = slow_checks["runner_uneven"]["streamed"]
    _assert_runs_equal(streamed)
    _assert_split_by_client(streamed["table"])
    assert any("cohorts streamed" in line for line in streamed["log"])


def test_runner_auto_uses_every_cpu_device_with_the_same_results(default_checks):
    r = default_checks["runner_auto"]
    assert r["plan_devices"] == [1, DEVICES]
    assert r["odd_devices"] == {"14": 7, "13": 1}
    assert r["state_diff"] < TOL and r["accuracy_diff"] < 1e-6


def test_cli_devices_flag_runs_sharded_with_the_same_results(default_checks):
    r = default_checks["cli"]
    assert all(r[k]["code"] == 0 for k in ("1", "small", "auto"))
    # auto: the most devices that split the 16 clients, at most the cohort of 5,
    # unless the rounds are too small for a mesh (this job's are)
    assert r["auto"]["saved_devices"] == "auto" and r["auto"]["used_devices"] == 4
    assert r["small"]["saved_devices"] == "auto" and r["small"]["used_devices"] == 1
    assert r["1"]["used_devices"] == 1
    assert r["resumed"] == {"code": 0, "same_clients": True}
    assert r["mesh_by_step"] == [4, None, None, 8]  # an explicit count is kept
    for k, v in r["1"]["final"].items():
        if isinstance(v, float):
            assert abs(r["auto"]["final"][k] - v) < 1e-5, k
            assert abs(r["small"]["final"][k] - v) < 1e-5, k


def test_put_gives_fresh_buffers_and_a_donated_run_over_a_mesh_survives(default_checks):
    """jax's replicated ``device_put`` kept the source's buffer on its device even with
    ``may_alias=False``: DQN-Fed over a mesh then donated one buffer twice and crashed."""
    r = default_checks["fresh_buffers"]
    assert r["disjoint"] and r["buffers"] == [1, DEVICES, DEVICES]
    assert r["dqn_fed"] < TOL
    assert r["fedlf"] < TOL  # its client table kept its layout across chunk programs


def test_server_solvers_loop_on_every_device_without_exchanges(default_checks):
    r = default_checks["server_solvers"]
    for name in ("fedlf", "qp", "online"):
        assert r[name]["loop_exchanges"] == 0, name
        assert r[name]["diff"] < 1e-4, name
    assert r["unpinned"] > 0


@pytest.mark.slow
def test_fair_and_quasi_newton_rules_sharded_equal_single_device(slow_checks):
    assert slow_checks["qffl"]["diff"] < TOL
    assert slow_checks["dqn_fed"]["diff"] < TOL


# ------------------------------------------------------------ validation, one device


def test_make_mesh_refuses_more_devices_than_exist():
    import jax
    from fedjax_fair.core import sharding
    n = jax.device_count()
    with pytest.raises(ValueError, match="^devices:"):
        sharding.make_mesh(n + 1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="^devices:"):
            sharding.make_mesh(bad)
    with pytest.raises(ValueError, match="^model:"):
        sharding.make_mesh(n, model=n + 1)
    mesh = sharding.make_mesh(n)
    assert mesh.axis_names == (sharding.CLIENTS, sharding.MODEL)
    assert sharding.num_shards(mesh) == n


def test_execution_refuses_a_mesh_without_a_clients_axis():
    import jax
    import numpy as np
    from fedjax_fair.core.execution import Execution, as_execution
    with pytest.raises(ValueError, match="^mesh:"):
        as_execution(Execution("vmap", None, "8 devices"))
    other = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("batch",))
    with pytest.raises(ValueError, match="^mesh:"):
        as_execution(Execution("vmap", None, other))


def test_runner_refuses_a_bad_mesh_before_compute(monkeypatch):
    import jax
    import helpers as H
    from fedjax_fair.drivers import runner
    from fedjax_fair.algorithms.fedavg import fedavg
    from fedjax_fair.core.execution import Execution
    model = H.logreg()
    from fedjax_fair.drivers import programs  # where the chunk programs are built
    monkeypatch.setattr(programs, "simulate", lambda *a, **k: pytest.fail("compiled"))
    with pytest.raises(ValueError, match="^mesh:"):
        runner.run(fedavg(model), H.init_params(model), H.tiny_federation(),
                   jax.random.key(0), model=model, num_rounds=1, cohort_size=2,
                   progress=False, execution=Execution("vmap", None, "all"))


@pytest.mark.parametrize("value", ["0", "-2", "two", "100000"])
def test_cli_refuses_bad_devices_before_compute(tmp_path, capsys, value):
    from fedjax_fair import cli
    out = tmp_path / "run"
    code = cli.main(["run", "--num-clients", "6", "--num-rounds", "1", "--no-progress",
                     "--devices", value, "-o", str(out)])
    assert code == cli.EXIT_CONFIG
    assert "devices" in capsys.readouterr().err
    assert not out.exists()


def test_cli_distributed_without_a_cluster_fails_before_compute(tmp_path, capsys):
    """``--distributed`` outside a multi-host launch: a ``distributed`` error, nothing
    written (the coordinator address is missing before anything connects)."""
    if any(k.startswith(("SLURM_", "OMPI_", "JAX_COORDINATOR", "KUBERNETES_"))
           for k in os.environ):
        pytest.skip("a cluster environment is set")
    from fedjax_fair import cli
    out = tmp_path / "run"
    code = cli.main(["run", "--distributed", "--num-rounds", "1", "--no-progress",
                     "-o", str(out)])
    assert code == cli.EXIT_CONFIG
    assert "distributed" in capsys.readouterr().err
    assert not out.exists()


def test_devices_config_value():
    import jax
    from fedjax_fair.cli import config as C
    assert C.coerce("devices", "all", "devices") == "all"
    assert C.coerce("devices", "Auto", "devices") == "auto"
    assert C.coerce("devices", "8", "devices") == 8
    assert C.coerce("devices", 8, "devices") == 8
    with pytest.raises(C.ConfigError, match="^devices:"):
        C.coerce("devices", "many", "devices")
    assert C.RunConfig().devices == "auto" and C.CompareConfig().devices == "auto"
    assert C.mesh_of(1, 50, 100) is None
    if jax.device_count() == 1:  # one device: "all" and "auto" need no mesh
        assert C.mesh_of("all", 50, 100) is None and C.mesh_of("auto", 50, 100) is None


def test_pad_and_unpad_clients_keep_the_real_clients_in_order():
    import jax.numpy as jnp
    import numpy as np
    from fedjax_fair.core import sharding
    x = {"a": jnp.arange(3), "b": jnp.arange(6.0).reshape(3, 2)}
    padded = sharding.pad_clients(x, 8)
    assert padded["a"].shape == (8,) and padded["b"].shape == (8, 2)
    np.testing.assert_array_equal(padded["a"], [0, 1, 2, 0, 1, 2, 0, 1])
    back = sharding.unpad(padded, 3)
    np.testing.assert_array_equal(back["b"], x["b"])
    assert sharding.padded_size(5, 8) == 8 and sharding.padded_size(16, 8) == 16
