"""Who owns a run's folders (issue 27, items 2-4): refused commands write nothing, a
process locks its output and checkpoint folders, a run's configuration fingerprint is
checked on --resume, and a diverged run continues as a recorded branch."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from fedjax_fair import cli
from fedjax_fair.cli import lock

TINY = ["--num-clients", "6", "--dataset-arg", "max_examples=100", "--cohort-size", "3",
        "--no-progress", "--no-plots"]


def _one_line_error(err, field):
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and field in lines[0], err
    return lines[0]


def _snapshot(root):
    """Every path under ``root`` with its size and mtime (None: ``root`` is absent)."""
    if not os.path.exists(root):
        return None
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.stat(p)
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("own") / "done")
    assert cli.main(["run", *TINY, "--num-rounds", "2", "-o", out]) == 0
    return out


REFUSED = {
    "batch_size": ["--batch-size", "200000000"],
    "model_args.hidden": ["--model", "mlp", "--model-arg", "hidden=[100000000]"],
    "hparams.mu": ["--algorithm", "fedprox", "--hp", "mu=-1"],
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_refused_command_leaves_a_missing_folder_missing(tmp_path, capsys, field):
    out = str(tmp_path / "new" / "run")
    code = cli.main(["run", *TINY, "--num-rounds", "2", *REFUSED[field], "-o", out])
    assert code == cli.EXIT_CONFIG
    _one_line_error(capsys.readouterr().err, field)
    assert not os.path.exists(tmp_path / "new")


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_refused_command_leaves_an_existing_folder_as_it_was(finished, capsys, field):
    before = _snapshot(finished)
    for extra in (["--overwrite"], ["--resume"]):
        code = cli.main(["run", *TINY, "--num-rounds", "2", *REFUSED[field], "-o", finished,
                         *extra])
        assert code == cli.EXIT_CONFIG
        err = capsys.readouterr().err
        _one_line_error(err, field if extra == ["--overwrite"] else "error: ")
        assert _snapshot(finished) == before


def test_a_refused_command_leaves_the_folder_usable(tmp_path, capsys):
    """The corrected command then runs (the refused one wrote nothing)."""
    out = str(tmp_path / "r")
    assert cli.main(["run", *TINY, "--num-rounds", "2", "--batch-size", "200000000",
                     "-o", out]) == cli.EXIT_CONFIG
    assert cli.main(["run", *TINY, "--num-rounds", "2", "-o", out]) == 0


HOLD = textwrap.dedent("""
    import sys, time
    from fedjax_fair.cli import lock
    held = lock.Held()
    for path in sys.argv[1:]:
        held.acquire(path, "output_dir")
    print("held", flush=True)
    time.sleep(120)
""")


@pytest.fixture
def holder():
    procs = []

    def start(*paths):
        p = subprocess.Popen([sys.executable, "-c", HOLD, *paths], stdout=subprocess.PIPE,
                             text=True)
        assert p.stdout.readline().strip() == "held"
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_second_writer_is_refused_naming_the_holder(tmp_path, capsys, holder):
    out = str(tmp_path / "x")
    p = holder(out)
    for cmd in (["run", *TINY, "--num-rounds", "2", "-o", out],
                ["run", *TINY, "--num-rounds", "2", "-o", out, "--overwrite"],
                ["compare", *TINY, "--algorithms", "fedavg", "--seeds", "0",
                 "--num-rounds", "2", "-o", out]):
        assert cli.main(cmd) == cli.EXIT_CONFIG
        line = _one_line_error(capsys.readouterr().err, "output_dir")
        assert f"pid {p.pid}" in line
    assert os.listdir(out) == [lock.LOCK_NAME]  # the holder's lock file only
    # a killed holder leaves no stale lock
    p.kill()
    p.wait()
    assert lock.holder(out) is None
    assert cli.main(["run", *TINY, "--num-rounds", "2", "-o", out]) == 0
    info = json.loads(open(os.path.join(out, lock.LOCK_NAME)).read())
    assert info["pid"] == os.getpid() and "run" in info["command"] and info["started"]


def test_held_checkpoint_dir_is_refused(tmp_path, capsys, holder):
    ck = str(tmp_path / "ck")
    p = holder(ck)
    assert cli.main(["run", *TINY, "--num-rounds", "2", "-o", str(tmp_path / "a"),
                     "--checkpoint-dir", ck]) == cli.EXIT_CONFIG
    line = _one_line_error(capsys.readouterr().err, "checkpoint_dir")
    assert f"pid {p.pid}" in line
    assert not os.path.exists(tmp_path / "a")


def test_shared_checkpoint_dir_is_refused(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert cli.main(["run", *TINY, "--num-rounds", "2", "-o", a, "--checkpoint-dir", ck]) == 0
    # a second run into the same checkpoint folder: refused unless --overwrite
    assert cli.main(["run", *TINY, "--num-rounds", "2", "--seed", "1", "-o", b,
                     "--checkpoint-dir", ck]) == cli.EXIT_CONFIG
    _one_line_error(capsys.readouterr().err, "checkpoint_dir")
    assert cli.main(["run", *TINY, "--num-rounds", "2", "--seed", "1", "-o", b,
                     "--checkpoint-dir", ck, "--overwrite"]) == 0
    capsys.readouterr()
    # resuming the first now would continue the second's state: refused, naming seed
    before = _snapshot(a)
    assert cli.main(["run", "-o", a, "--resume", "--num-rounds", "4",
                     "--no-progress"]) == cli.EXIT_CONFIG
    line = _one_line_error(capsys.readouterr().err, "checkpoint_dir")
    assert "seed" in line
    assert _snapshot(a) == before


def test_edited_config_json_is_refused_on_resume(tmp_path, capsys):
    out = str(tmp_path / "e")
    assert cli.main(["run", *TINY, "--num-rounds", "2", "-o", out]) == 0
    path = os.path.join(out, "config.json")
    saved = json.load(open(path))
    assert saved["fingerprint"] == lock.fingerprint(saved)
    original, saved["client_lr"] = saved["client_lr"], 0.5
    json.dump(saved, open(path, "w"))
    capsys.readouterr()
    assert cli.main(["run", "-o", out, "--resume", "--num-rounds", "4",
                     "--no-progress"]) == cli.EXIT_CONFIG
    line = _one_line_error(capsys.readouterr().err, "resume")
    assert "client_lr" in line
    # restored, it resumes
    saved["client_lr"] = original
    json.dump(saved, open(path, "w"))
    assert cli.main(["run", "-o", out, "--resume", "--num-rounds", "4",
                     "--no-progress"]) == 0


def test_diverged_run_continues_as_a_recorded_branch(tmp_path, capsys):
    out = str(tmp_path / "d")
    code = cli.main(["run", *TINY, "--model", "mlp", "--client-lr", "3e38", "--num-rounds",
                     "4", "--eval-every", "2", "-o", out])
    assert code == cli.EXIT_NONFINITE
    err = capsys.readouterr().err
    assert "--resume --branch" in err
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["status"] == "non_finite"
    good = summary["last_good_round"]
    # a plain changed setting is refused, pointing at --branch
    assert cli.main(["run", "-o", out, "--resume", "--client-lr", "0.01",
                     "--no-progress"]) == cli.EXIT_CONFIG
    assert "--branch" in _one_line_error(capsys.readouterr().err, "resume")
    # --branch needs --resume, and a change
    assert cli.main(["run", *TINY, "-o", out, "--branch", "--client-lr", "0.01",
                     "--overwrite"]) == cli.EXIT_CONFIG
    _one_line_error(capsys.readouterr().err, "branch")
    assert cli.main(["run", "-o", out, "--resume", "--branch",
                     "--no-progress"]) == cli.EXIT_CONFIG
    _one_line_error(capsys.readouterr().err, "branch")
    assert cli.main(["run", "-o", out, "--resume", "--branch", "--client-lr", "0.01",
                     "--no-progress"]) == 0
    config = json.load(open(os.path.join(out, "config.json")))
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert config["client_lr"] == 0.01
    branch = config["branches"]
    assert branch == summary["config"]["branches"]
    assert branch[-1]["round"] == good
    assert branch[-1]["changed"] == {"client_lr": [3e38, 0.01]}
    assert branch[-1]["fingerprint"] == config["fingerprint"] == lock.fingerprint(config)
    assert summary["final"]["round"] == 4
    # the branch is the run now: a plain resume continues it
    assert cli.main(["run", "-o", out, "--resume", "--num-rounds", "6",
                     "--no-progress"]) == 0
    assert json.load(open(os.path.join(out, "config.json")))["branches"] == branch


def test_memory_plan_refusal_after_the_lock_leaves_the_folders_as_they_were(
        tmp_path, capsys, monkeypatch, finished):
    """The runner's own plan (XLA's accounting) refuses after the folders were locked:
    the lock files and directories this command created are removed again."""
    from fedjax_fair.core import memory
    monkeypatch.setattr(memory, "device_capacity", lambda device=None: 100_000)
    out = str(tmp_path / "new" / "run")
    assert cli.main(["run", *TINY, "--num-rounds", "2", "--placement", "device",
                     "-o", out]) == cli.EXIT_CONFIG
    _one_line_error(capsys.readouterr().err, "placement")
    assert not os.path.exists(tmp_path / "new")
    before = _snapshot(finished)
    assert cli.main(["run", *TINY, "--num-rounds", "2", "--placement", "device",
                     "-o", finished, "--overwrite"]) == cli.EXIT_CONFIG
    _one_line_error(capsys.readouterr().err, "placement")
    assert _snapshot(finished) == before
