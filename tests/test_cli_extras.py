"""Options that need an optional package (fedjax_fair/cli/extras.py): without it they
are refused before anything is built or written, with one line naming the option and
the install command, instead of computing every round and failing at the end."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

import fedjax_fair
from fedjax_fair import cli
from fedjax_fair.cli import config as C, extras, options as O
from helpers import CLI_TINY as TINY, one_line_error as _one_line_error

COMMANDS = {"run": ["run"],
            "compare": ["compare", "--algorithms", "fedavg", "--seeds", "0"],
            "sweep": ["sweep", "--grid", "client_lr=0.05,0.1", "--seeds", "0"]}
INSTALL = 'pip install "fedjax-fair[privacy]"'


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("flag,value", [("--dp-noise", "1.0"), ("--dp-epsilon", "4")])
def test_dp_without_dp_accounting_is_refused_before_compute(tmp_path, capsys, monkeypatch,
                                                            command, flag, value):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # not importable
    out = tmp_path / "out"
    code = cli.main([*COMMANDS[command], *TINY, "--num-rounds", "2", flag, value,
                     "-o", str(out)])
    err = capsys.readouterr().err
    assert code == cli.EXIT_CONFIG, err
    field = flag[2:].replace("-", "_")
    _one_line_error(err, f"{field}: ")
    assert INSTALL in err
    assert not out.exists()


def test_the_check_imports_nothing(monkeypatch):
    """``importlib.util.find_spec`` alone decides (no import cost before compute)."""
    asked = []
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        asked.append(name)
        return None if name == "dp_accounting" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.delitem(sys.modules, "dp_accounting", raising=False)
    cfg = C.build(C.RunConfig, overrides={"dp_epsilon": 3.0})
    assert [e.field for e in extras.missing(cfg)] == ["dp_epsilon"]
    assert "dp_accounting" in asked and "dp_accounting" not in sys.modules
    with pytest.raises(C.ConfigError) as info:
        extras.check(cfg)
    assert info.value.field == "dp_epsilon" and INSTALL in str(info.value)


def test_installed_or_unset_passes():
    assert not extras.missing(C.build(C.RunConfig))  # no DP asked for
    if importlib.util.find_spec("dp_accounting") is not None:
        assert not extras.missing(C.build(C.RunConfig, overrides={"dp_noise": 1.0}))


def test_the_table_names_declared_options_and_pyproject_extras():
    """Every entry is an option of cli.options, and its package is in its extra of
    pyproject.toml (when the checkout has one)."""
    for e in extras.EXTRAS:
        assert e.field in O.BY_NAME, e
    path = os.path.join(os.path.dirname(os.path.dirname(fedjax_fair.__file__)),
                        "pyproject.toml")
    if not os.path.exists(path):
        pytest.skip("no pyproject.toml beside the package")
    import tomllib
    with open(path, "rb") as f:
        optional = tomllib.load(f)["project"]["optional-dependencies"]
    for e in extras.EXTRAS:
        names = [d.split(">")[0].split("=")[0].split("<")[0].strip().lower()
                 for d in optional[e.extra]]
        assert e.package in names, (e, optional[e.extra])
