"""Methods defined outside the package register the same way (``registry.load_plugins``).

A toy method module, ``toy_avg`` (FedAvg whose server steps by ``server_lr`` times the
weighted mean delta), is written into ``tmp_path`` and loaded by path, by module name,
as an installed entry point and through ``FEDJAX_FAIR_PLUGINS``; it then appears in
the registry, ``method_hparams`` and ``build``, and runs rounds. Every test leaves the
registry, ``sys.path`` and ``sys.modules`` as they were (``registry.isolated``).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest

import fedjax_fair
from fedjax_fair.algorithms import fedavg, registry
from fedjax_fair.algorithms.registry import (ALGORITHMS, ENTRY_POINT_GROUP, PLUGINS_ENV,
                                             REGISTRY, PluginError, build, load_env_plugins,
                                             load_plugins, method_hparams)
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.drivers.simulate import simulate

import helpers

TOY = textwrap.dedent('''
    """toy_avg: FedAvg whose server steps by server_lr times the weighted mean delta."""
    import optax

    from fedjax_fair import hparams as H
    from fedjax_fair.algorithms import fedavg
    from fedjax_fair.algorithms.registry import register
    from fedjax_fair.core.client import ClientTraining

    HPARAMS = {"server_lr": H.POSITIVE}


    def toy_avg(model, *, server_lr: float = 0.5, weight_by_size: bool = True,
                training: ClientTraining = ClientTraining()):
        """FedAvg's clients; the server takes sgd(server_lr) on the weighted mean."""
        return fedavg(model, training=training, weight_by_size=weight_by_size,
                      server_optimizer=optax.sgd(server_lr))


    register("toy_avg", toy_avg, HPARAMS, family="reference", server_rate="server_lr")
''')

TRAINING = ClientTraining(lr=0.5, batch_size=4, num_epochs=1)


@pytest.fixture
def toy_file(tmp_path):
    path = tmp_path / "toy_avg_plugin.py"
    path.write_text(TOY, "utf-8")
    return path


@pytest.fixture
def isolated():
    """The registry, sys.path and the plugin modules as they were, after the test."""
    path = list(sys.path)
    with registry.isolated():
        yield
    sys.path[:] = path
    sys.modules.pop("toy_avg_plugin", None)


def _two_rounds(algorithm):
    data = helpers.ENGINE_DATA
    state = algorithm.init(helpers.ENGINE_PARAMS, data.num_clients)
    final, metrics = simulate(algorithm, state, data, jax.random.key(0), num_rounds=2,
                              cohort_size=3, execution="vmap")
    return final, metrics


def _check_toy_is_registered():
    assert "toy_avg" in REGISTRY and list(REGISTRY)[-1] == "toy_avg"
    method = REGISTRY["toy_avg"]
    assert ALGORITHMS["toy_avg"] is method.factory
    assert method.family == "reference" and method.server_rate == "server_lr"
    assert method.size_prior(False) == {"weight_by_size": False}
    hps = method_hparams("toy_avg")
    assert hps["server_lr"].default == 0.5 and hps["server_lr"].continuous
    assert {"client_lr", "batch_size", "weight_by_size"} <= set(hps)
    algorithm = build("toy_avg", helpers.ENGINE_MODEL, server_lr=0.25, client_lr=0.5,
                      batch_size=4, num_epochs=1)
    assert algorithm.name == "toy_avg"
    final, metrics = _two_rounds(algorithm)
    assert int(final.round) == 2 and np.asarray(metrics["finite"]).all()
    # it is FedAvg with sgd(0.25) on the server
    reference, _ = _two_rounds(fedavg(helpers.ENGINE_MODEL, training=TRAINING,
                                      server_optimizer=optax.sgd(0.25)))
    helpers.assert_trees_close(final.params, reference.params)
    start = helpers.ENGINE_PARAMS
    assert helpers.tree_norm(helpers.tree_sub(final.params, start)) > 0


def test_a_plugin_file_registers_its_method(toy_file, isolated):
    (module,) = load_plugins([str(toy_file)])
    assert module.toy_avg is REGISTRY["toy_avg"].factory
    _check_toy_is_registered()
    # loaded again (the command line may start twice in one process): not run again
    assert load_plugins(str(toy_file)) == [module]
    assert REGISTRY["toy_avg"].factory is module.toy_avg


def test_a_plugin_module_registers_its_method_by_name(toy_file, isolated):
    sys.path.insert(0, str(toy_file.parent))
    (module,) = load_plugins(" toy_avg_plugin , ")  # a comma-separated string
    assert module.__name__ == "toy_avg_plugin"
    _check_toy_is_registered()


def test_isolated_forgets_the_plugins_it_loaded(toy_file):
    before = list(REGISTRY)
    with registry.isolated():
        (module,) = load_plugins([str(toy_file)])
        assert module.__name__ in sys.modules
    assert list(REGISTRY) == before and "toy_avg" not in ALGORITHMS
    assert module.__name__ not in sys.modules
    with registry.isolated():  # so it loads afresh
        load_plugins([str(toy_file)])
        assert "toy_avg" in REGISTRY


def test_the_environment_variable_loads_plugins(toy_file, isolated, monkeypatch):
    monkeypatch.setattr(registry, "_load_entry_points",
                        lambda: pytest.fail("unset: nothing is read"))
    assert load_env_plugins({}) == [] and load_env_plugins({PLUGINS_ENV: " "}) == []
    monkeypatch.delenv(PLUGINS_ENV, raising=False)
    assert load_env_plugins() == []
    monkeypatch.undo()
    monkeypatch.setenv(PLUGINS_ENV, f"{toy_file},")
    assert [m.toy_avg for m in load_env_plugins()] == [REGISTRY["toy_avg"].factory]
    with pytest.raises(PluginError, match=rf"^{PLUGINS_ENV}: 'no_such_plugin_x': no module"):
        load_env_plugins({PLUGINS_ENV: "no_such_plugin_x"})


def test_an_installed_entry_point_loads_when_the_registry_is_first_read(
        toy_file, isolated, monkeypatch):
    sys.path.insert(0, str(toy_file.parent))
    point = importlib.metadata.EntryPoint(name="toy", value="toy_avg_plugin",
                                          group=ENTRY_POINT_GROUP)
    asked = []

    def entry_points(*, group):
        asked.append(group)
        return [point] if group == ENTRY_POINT_GROUP else []

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    monkeypatch.setitem(registry._STATE, "entry_points", False)
    assert "toy_avg" not in dict.keys(REGISTRY)  # not yet loaded
    assert "toy_avg" in REGISTRY  # the first read loads it
    assert asked == [ENTRY_POINT_GROUP]
    list(REGISTRY), load_plugins([])
    assert asked == [ENTRY_POINT_GROUP]  # once
    _check_toy_is_registered()


def test_a_broken_entry_point_is_named(tmp_path, isolated, monkeypatch):
    point = importlib.metadata.EntryPoint(name="broken", value="no_such_module_for_fedjax",
                                          group=ENTRY_POINT_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda *, group: [point] if group == ENTRY_POINT_GROUP else [])
    monkeypatch.setitem(registry._STATE, "entry_points", False)
    with pytest.raises(PluginError, match=rf"^{ENTRY_POINT_GROUP}: cannot load broken = "
                                          r"'no_such_module_for_fedjax'"):
        len(REGISTRY)
    assert "fedavg" in REGISTRY  # reported once; the registry is usable


def test_plugin_errors_name_the_spec_and_leave_the_registry_as_it_was(tmp_path, isolated):
    before = list(REGISTRY)
    with pytest.raises(PluginError, match=r"^plugins: 'no_such_plugin_y': no module named"):
        load_plugins(["no_such_plugin_y"])
    missing = str(tmp_path / "missing.py")
    with pytest.raises(PluginError, match=rf"^plugins: '{missing}': no such file"):
        load_plugins([missing])
    with pytest.raises(PluginError, match=r"^plugins: 'not a-module': neither a module"):
        load_plugins(["not a-module"])
    half = tmp_path / "half.py"  # registers one method, then fails
    half.write_text(TOY + "\nraise RuntimeError('half way')\n", "utf-8")
    with pytest.raises(PluginError, match=rf"^plugins: '{half}': RuntimeError: half way"):
        load_plugins([str(half)])
    clash = tmp_path / "clash.py"
    clash.write_text(TOY.replace('register("toy_avg"', 'register("fedavg"'), "utf-8")
    with pytest.raises(PluginError, match=r"clash.py': ValueError: method 'fedavg' is "
                                          r"already registered"):
        load_plugins([str(clash)])
    assert list(REGISTRY) == before
    assert REGISTRY["fedavg"].factory is fedavg and fedjax_fair.algorithms.fedavg is fedavg


def test_a_plugin_method_runs_through_the_command_line(toy_file, tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, PLUGINS_ENV: str(toy_file)}
    proc = subprocess.run(
        [sys.executable, "-m", "fedjax_fair.cli", "run", "--algorithm", "toy_avg",
         "--hp", "server_lr=0.3", "--num-rounds", "2", "--eval-every", "1",
         "--output-dir", str(out), "--no-plots", *helpers.CLI_TINY],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    config = json.loads((out / "summary.json").read_text("utf-8"))["config"]
    assert config["algorithm"] == "toy_avg" and config["hparams"] == {"server_lr": 0.3}
