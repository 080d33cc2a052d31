"""``fedjax_fair.cli.options``: every option declared once, and everything else derived
from the declarations (config classes, flags, fingerprint, resume, branch, list)."""
import dataclasses
import subprocess
import sys

import pytest

from fedjax_fair.cli import config as C, lock, options as O
from fedjax_fair.cli.parser import build_parser


def test_each_option_is_declared_once_in_a_known_group():
    names = [o.name for o in O.OPTIONS]
    assert len(names) == len(set(names))
    assert {o.group for o in O.OPTIONS} <= set(O.GROUPS)
    assert all(set(o.commands) <= set(O.COMMANDS) for o in O.OPTIONS)


@pytest.mark.parametrize("command", O.COMMANDS)
def test_a_commands_config_has_exactly_its_declared_options(command):
    cls = C.CONFIGS[command]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    declared = {o.name: o for o in O.of(command)}
    assert list(fields) == list(declared)
    cfg = cls()
    for name, o in declared.items():
        assert getattr(cfg, name) == o.default, name
        assert fields[name].metadata["kind"] == o.kind


@pytest.mark.parametrize("command", O.COMMANDS)
def test_every_declared_flag_is_on_the_command_line(command):
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    spelled = {s for a in sub._actions for s in a.option_strings}
    for o in O.of(command):
        if o.flag == "":
            assert set(o.flags) <= spelled, o.name
        elif o.flag:
            assert o.flag in spelled, o.name


def test_a_switch_sets_the_opposite_of_its_default(tmp_path):
    args = build_parser().parse_args(["run", "--no-plots", "--overwrite"])
    assert args.plots is False and args.overwrite is True


def test_a_switch_is_spelled_after_each_commands_default():
    """``flag=SWITCH``: ``--no-NAME`` where the command's default is True, ``--NAME``
    where it is False (issue 50: the improvement share is off in run, on in compare)."""
    assert O.switch_name("improvement", True) == "--no-improvement"
    assert O.switch_name("plots_x", False) == "--plots-x"
    flags = {c: O.BY_NAME["improvement"].for_command(c) for c in O.COMMANDS}
    assert {c: (o.flag, o.default) for c, o in flags.items()} == {
        "run": ("--improvement", False), "compare": ("--no-improvement", True),
        "sweep": ("--no-improvement", True)}
    parse = build_parser().parse_args
    assert parse(["run", "--improvement"]).improvement is True
    assert parse(["compare", "--no-improvement"]).improvement is False
    assert parse(["sweep", "--no-improvement"]).improvement is False
    for command, wrong, hint in (("run", "--no-improvement", "--improvement turns it on"),
                                 ("compare", "--improvement", "--no-improvement turns it off")):
        with pytest.raises(C.ConfigError, match="unrecognized") as info:
            parse([command, wrong])
        assert hint in str(info.value)  # the other command's spelling, named
    assert C.RunConfig().improvement is False and C.CompareConfig().improvement is True


@pytest.mark.parametrize("command", O.COMMANDS)
@pytest.mark.parametrize("value", [True, False])
def test_a_config_files_improvement_key_works_for_every_command(command, value, tmp_path,
                                                                  monkeypatch):
    from fedjax_fair.cli.common import config_from_args
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text(f"improvement: {str(value).lower()}\n")
    args = build_parser().parse_args([command, "--config", "job.yaml"])
    assert config_from_args(args, C.CONFIGS[command]).improvement is value


def test_the_fingerprint_covers_exactly_the_iterate_options():
    cfg = C.to_dict(C.RunConfig())
    fields = set(lock.iterate_config(cfg))
    later = {k for k, v in O.LATER_DEFAULTS.items() if k in cfg and O.canonical(cfg[k]) == v}
    assert fields == {o.name for o in O.of("run") if o.iterates} - later
    changed = dict(cfg, dp_clip=2.0)  # a later option away from its default counts
    assert lock.fingerprint(changed) != lock.fingerprint(cfg)
    assert lock.fingerprint(dict(cfg, plots=False)) == lock.fingerprint(cfg)


def test_resume_and_branch_lists_come_from_the_declarations():
    assert set(C.RESUMABLE) == {o.name for o in O.OPTIONS if "run" in o.resume}
    assert "num_rounds" in C.RESUMABLE and "num_rounds" not in C.SWEEP_RESUMABLE
    assert "commit_seconds" in C.COMPARE_RESUMABLE
    assert set(C.BRANCHABLE) == {o.name for o in O.OPTIONS if o.branch}
    assert set(C.SYSTEM_FIELDS) == {o.name for o in O.OPTIONS if not o.sweep}
    assert all(o.group == "system" for o in O.OPTIONS if not o.sweep)


@pytest.mark.parametrize("name,value", [("num_rounds", 0), ("cohort_size", -1),
                                        ("client_momentum", 1.0), ("unseen_clients", 1.0),
                                        ("model", "nope"), ("sampler", "nope")])
def test_a_declared_range_or_choice_refuses_a_bad_value_naming_the_option(name, value):
    cfg = C.build(C.RunConfig, overrides={name: value})
    with pytest.raises(C.ConfigError) as info:
        C.check_declared(cfg)
    assert info.value.field == name


def test_list_options_shows_every_group_and_option():
    out = subprocess.run([sys.executable, "-m", "fedjax_fair.cli", "list", "options"],
                         capture_output=True, text=True, check=True).stdout
    for group in O.GROUPS:
        assert f"{group}:" in out
    for command in O.COMMANDS:
        for o in O.of(command):
            assert (o.flags[0] if o.flag == "" else o.flag or o.name) in out
    assert "--improvement [run] (default: False)" in out


def test_every_group_names_a_builder_that_exists():
    import importlib
    for group in O.GROUPS.values():
        for ref in group.builder.split(", "):
            module, _, name = ref.partition(":")
            assert callable(getattr(importlib.import_module(f"fedjax_fair.cli.{module}"), name))


def _commands() -> list:
    """``fedjax-fair`` itself and every sub-command its parser has."""
    import argparse
    from fedjax_fair.cli.parser import build_parser
    sub = next(a for a in build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    return [[]] + [[name] for name in sub.choices]


def test_the_commands_include_those_the_guide_names():
    assert {"run", "compare", "sweep", "report", "prepare", "list"} <= {
        c[0] for c in _commands() if c}


@pytest.mark.parametrize("command", _commands())
def test_every_commands_help_prints(command):
    """``--help`` of every command prints its usage and exits 0 (a ``%`` in a declared
    help text, as in ``--metric``'s default accuracy_worst_10%, once crashed it)."""
    done = subprocess.run([sys.executable, "-m", "fedjax_fair.cli", *command, "--help"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
