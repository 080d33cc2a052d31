"""A SIGINT (Ctrl-C) or SIGTERM is never lost by the command line, from the package's
import to the last write: the command ends with one line on stderr and exit status
130, no traceback, no "Exception ignored", and nothing lost (nothing written before the
rounds; after them, the checkpoint ``--resume`` continues from).

Real signals to subprocesses (``python -m fedjax_fair.cli`` and a console script like
the one pip writes, run from the test's own directory with this checkout on
``PYTHONPATH``), at instants that fall in the import, the start-up and first compile,
and the rounds; the default run sends three, the wider sweep of instants is
``-m slow``. In-process, the cases a timer cannot aim at: a ``KeyboardInterrupt``
swallowed by a weakref callback, and a signal during the run's last chunk (which ends
the run rather than stopping it).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import fedjax_fair
from fedjax_fair import cli
from fedjax_fair.cli import run as cli_run
from fedjax_fair.core import interrupts
from fedjax_fair.drivers import checkpoint as ckpt
from helpers import CLI_TINY as TINY, one_line_error as _one_line_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(fedjax_fair.__file__)))
# long enough never to end within a test; a signal stops it at its next chunk boundary
LONG = ["run", *TINY, "--num-rounds", "100000", "--eval-every", "20", "--no-plots",
        "--devices", "1"]
CONSOLE_SCRIPT = """import re
import sys
from fedjax_fair.cli import console
if __name__ == "__main__":
    sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])
    sys.exit(console())
"""


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _spawn(tmp_path, args, console=False) -> subprocess.Popen:
    if console:  # as the console script `fedjax-fair` (its name is how it is recognised)
        script = tmp_path / "fedjax-fair"
        script.write_text(CONSOLE_SCRIPT)
        command = [sys.executable, str(script)]
    else:
        command = [sys.executable, "-m", "fedjax_fair.cli"]
    return subprocess.Popen([*command, *args], cwd=str(tmp_path), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _interrupted(proc: subprocess.Popen, out) -> str:
    """Waits for the command; asserts the interrupt's contract; returns its line."""
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:  # the signal was lost: the run goes on
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the command did not stop: {err[-2000:]}")
    assert proc.returncode == cli.EXIT_INTERRUPTED, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    # nothing lost: either nothing was written, or the checkpoint --resume continues
    if os.path.exists(out):
        assert ckpt.latest(os.path.join(out, "checkpoint")), (err, os.listdir(out))
        assert "--resume" in lines[0], err
    return lines[0]


def _after_delay(tmp_path, delay, sig=signal.SIGINT, console=False, args=LONG) -> str:
    out = str(tmp_path / "out")
    proc = _spawn(tmp_path, [*args, "-o", out], console)
    time.sleep(delay)
    proc.send_signal(sig)
    return _interrupted(proc, out)


def test_ctrl_c_while_the_console_script_imports_the_package_is_one_line(tmp_path):
    """0.3 s in, the console script is importing fedjax_fair (jax): one line, 130,
    nothing written (without the import guard: a 30-line traceback)."""
    line = _after_delay(tmp_path, 0.3, console=True)
    assert not (tmp_path / "out").exists(), line


def test_ctrl_c_after_the_first_output_line_is_one_line(tmp_path):
    """Right after the command's first line on stdout (the data is built; the model is
    compiled next, where JAX's callbacks used to swallow the KeyboardInterrupt)."""
    out = str(tmp_path / "out")
    proc = _spawn(tmp_path, [*LONG, "-o", out])
    first = proc.stdout.readline()
    assert first.strip(), proc.stderr.read()
    proc.send_signal(signal.SIGINT)
    _interrupted(proc, out)


def test_sigterm_mid_start_up_is_one_line(tmp_path):
    """SIGTERM about when jax starts and the first program compiles."""
    _after_delay(tmp_path, 1.5, sig=signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.3, 1.0, 2.0, 3.0])
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_at_any_instant_is_one_line(tmp_path, delay, sig):
    _after_delay(tmp_path, delay, getattr(signal, sig))


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.3, 1.5, 2.0, 3.0])
@pytest.mark.parametrize("command", ["compare", "sweep"])
def test_compare_and_sweep_stop_with_one_line(tmp_path, delay, command):
    """The same for ``compare`` and ``sweep`` (what they keep is their own tests')."""
    out = str(tmp_path / "out")
    args = ([command, *TINY, "--algorithms", "fedavg,fedprox,qffl", "--seeds", "0,1"]
            if command == "compare" else
            [command, *TINY, "--grid", "client_lr=0.01,0.1", "--seeds", "0-3", "--tile-size",
             "1"])
    proc = _spawn(tmp_path, [*args, "--num-rounds", "3000", "--eval-every", "20",
                             "--no-plots", "-o", out])
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the command did not stop")
    assert proc.returncode == cli.EXIT_INTERRUPTED, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err


def test_a_keyboard_interrupt_swallowed_by_a_callback_still_stops_the_command(
        tmp_path, capsys, monkeypatch):
    """The handler's KeyboardInterrupt raised inside a weakref callback (as inside JAX's
    during a compile) is swallowed by CPython; the recorded request stops the command
    at its next safe point instead of letting it run to exit 0, and no "Exception
    ignored" is printed."""
    import weakref
    real = cli_run.build_dataset

    class Owner:
        pass

    def callback(_):
        signal.raise_signal(signal.SIGINT)  # the handler runs inside this callback
        for _ in range(3):
            pass

    def build_dataset(cfg):
        ds = real(cfg)
        owner = Owner()
        ref = weakref.ref(owner, callback)
        del owner  # the callback runs (and swallows the KeyboardInterrupt) here
        assert ref() is None
        return ds

    monkeypatch.setattr(cli_run, "build_dataset", build_dataset)
    out = tmp_path / "out"
    code = cli.main(["run", *TINY, "--num-rounds", "2", "-o", str(out)])
    err = capsys.readouterr().err
    assert code == cli.EXIT_INTERRUPTED, err
    assert "Exception ignored" not in err
    _one_line_error(err, "interrupted")
    assert not out.exists()
    assert not interrupts.requested()  # the command's end clears it


@pytest.mark.parametrize("checkpoint", [True, False])
def test_a_signal_during_the_last_chunk_stops_before_the_outputs(tmp_path, capsys,
                                                                   monkeypatch, checkpoint):
    """A signal during a run's last chunk ends the run rather than stopping it (there is
    no chunk boundary left); it used to be forgotten with the runner's stop flag and the
    command went on to write its outputs and exit 0. Now, with a checkpoint, the
    outputs are not written (no summary.json), the final checkpoint is kept, and
    --resume writes them; without one (nothing to write them again from) they are
    written and the command still exits 130, saying so."""
    real = cli_run.simulate_one

    def simulate_one(*args, **kwargs):
        on_eval = kwargs["on_eval"]

        def at_the_end(entry):  # inside stop_on_signals, after the last chunk
            on_eval(entry)
            if entry["round"] == 2:
                signal.raise_signal(signal.SIGINT)
                for _ in range(3):
                    pass
        return real(*args, **{**kwargs, "on_eval": at_the_end})

    monkeypatch.setattr(cli_run, "simulate_one", simulate_one)
    out = tmp_path / "out"
    code = cli.main(["run", *TINY, "--num-rounds", "2", "--no-plots", "-o", str(out),
                     *([] if checkpoint else ["--no-checkpoint"])])
    assert code == cli.EXIT_INTERRUPTED
    _one_line_error(capsys.readouterr().err, "interrupted")
    assert (out / "summary.json").exists() is not checkpoint
    if not checkpoint:
        return
    assert ckpt.latest(str(out / "checkpoint"))
    monkeypatch.setattr(cli_run, "simulate_one", real)
    assert cli.main(["run", "-o", str(out), "--resume", "--no-progress"]) == 0
    assert (out / "summary.json").exists()


@pytest.mark.parametrize("argv,orig,expected", [
    (["/usr/bin/fedjax-fair", "run"], None, True),
    (["-m"], ["python", "-m", "fedjax_fair.cli", "run"], True),
    (["-m"], ["python", "-X", "importtime", "-m", "fedjax_fair.cli"], True),
    (["-m"], ["python", "-mfedjax_fair.cli"], True),
    (["-m"], ["python", "-m", "pytest"], False),
    (["-c"], ["python", "-c", "import fedjax_fair", "-m", "fedjax_fair.cli"], False),
    (["script.py"], ["python", "script.py"], False),
])
def test_the_import_guard_recognises_the_command_only(monkeypatch, argv, orig, expected):
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", orig or [sys.executable, *argv], raising=False)
    assert interrupts.is_command() is expected


def test_outside_a_command_a_signal_is_not_recorded():
    """A library's ``stop_on_signals`` (a notebook) leaves no request behind."""
    from fedjax_fair.drivers import runner
    with runner.stop_on_signals():
        signal.raise_signal(signal.SIGINT)
        for _ in range(3):
            pass
        assert runner.stop_requested()
    assert not runner.stop_requested() and not interrupts.requested()
