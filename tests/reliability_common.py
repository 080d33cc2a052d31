"""The shared pieces of the bad-input cases that tests/test_reliability.py runs and
tabulates in docs/reliability.md: the ``Case`` record and the list ``CASES`` the case
modules (tests/reliability_*_cases.py) append to, the table's ``AREAS``, the helpers
that add a case (``_add``, ``_flags``), each case's ``Workspace`` and ``_no_compute``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

import helpers

# The tiny federation of tests/test_cli_run.py: Synthetic, 6 clients, cohort 3.
TINY = ["--num-clients", "6", "--dataset-arg", "max_examples=100", "--cohort-size", "3",
        "--no-progress", "--no-plots"]


class ReachedCompute(Exception):
    """Raised in place of compiling a chunk program: the input got as far as compute."""


@contextlib.contextmanager
def _no_compute():
    """Compiling a program ahead of time (how the runner compiles its chunk programs)
    raises ``ReachedCompute``; the runner's cache of compiled programs starts empty, so
    a program compiled by an earlier test is not reused either."""
    import jax.stages
    from fedjax_fair.drivers import runner

    def refuse(*args, **kwargs):
        raise ReachedCompute("the input was not refused before compiling a chunk program")

    saved = jax.stages.Lowered.compile, runner._PROGRAMS
    jax.stages.Lowered.compile, runner._PROGRAMS = refuse, runner._ProgramCache()
    try:
        yield
    finally:
        jax.stages.Lowered.compile, runner._PROGRAMS = saved


# ------------------------------------------------------------------------ workspace


class _Saved:
    """A finished run and an interrupted comparison, made once per process and copied
    into the cases that need them. The run is a real tiny CLI run (2 rounds, the only
    compute in this file); the comparison is stopped before its first run (as by
    Ctrl-C: config.json, comparison.md with 0 of 1 runs)."""

    root: Optional[Path] = None

    @classmethod
    def get(cls) -> Path:
        if cls.root is None:
            import atexit
            from fedjax_fair import cli
            from fedjax_fair.drivers import runner
            root = Path(tempfile.mkdtemp(prefix="fedjax_fair_reliability_"))
            atexit.register(shutil.rmtree, root, True)
            quiet = io.StringIO()
            with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
                code_run = cli.main(["run", *TINY, "--num-rounds", "2", "--eval-every", "1",
                                     "-o", str(root / "run")])
                runner.request_stop()  # cleared when compare returns
                code_cmp = cli.main(["compare", *TINY, "--algorithms", "fedavg", "--seeds",
                                     "0", "--num-rounds", "1", "-o", str(root / "cmp")])
            assert code_run == 0 and code_cmp == cli.EXIT_INTERRUPTED, quiet.getvalue()
            cls.root = root
        return cls.root


class Workspace:
    """The directory of one case; ``out`` is the default output directory."""

    def __init__(self, tmp: Path):
        self.tmp = Path(tmp)
        self.out = str(self.tmp / "out")

    def write(self, name: str, text: str) -> str:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return str(path)

    def directory(self, name: str) -> str:
        """An empty directory."""
        (self.tmp / name).mkdir(parents=True)
        return str(self.tmp / name)

    def finished_run(self) -> str:
        """A finished 2-round FedAvg run (config.json, checkpoint, ...) as if it had
        been run here: a copy whose config.json names this directory."""
        return self._copy("run", checkpoint=True)

    def interrupted_compare(self) -> str:
        """An interrupted comparison (FedAvg, seed 0, 1 round; no run finished), as if it
        had been run here."""
        return self._copy("cmp", checkpoint=False)

    def _copy(self, name: str, checkpoint: bool) -> str:
        path = self.tmp / name
        shutil.copytree(_Saved.get() / name, path)
        config = json.loads((path / "config.json").read_text())
        config["output_dir"] = str(path)
        if checkpoint:
            config["checkpoint_dir"] = str(path / "checkpoint")
        (path / "config.json").write_text(json.dumps(config))
        return str(path)

    def leaf(self, train: dict, test: Optional[dict] = None, **raw) -> str:
        """A LEAF root with train/ and test/ (one JSON file each) from {user: (x, y)};
        ``raw`` overrides whole files: train_text=..., test_text=..."""
        root = self.tmp / "leaf"
        test = {u: (x[:2], y[:2]) for u, (x, y) in train.items()} if test is None else test
        for split, data in (("train", train), ("test", test)):
            if f"{split}_text" in raw:
                (root / split).mkdir(parents=True, exist_ok=True)
                (root / split / "data.json").write_text(raw[f"{split}_text"])
            else:
                helpers.write_leaf(root / split / "data.json", list(data), data)
        return str(root)


def _snapshot(directory: Path) -> dict:
    """{relative path: bytes} of every file (and empty directory) below ``directory``."""
    out = {}
    for root, dirs, names in os.walk(directory):
        rel = os.path.relpath(root, directory)
        if not dirs and not names:
            out[rel + "/"] = b""
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.join(rel, name)] = f.read()
    return out


# ---------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad input.

    area: the table section. shown: the input as the table shows it. where: where a
    user gives it. field: what the message must name (a tuple: every one of them).
    cli: workspace -> argv of ``fedjax-fair`` ("-o OUT" is appended for run / compare
    without -o). call:
    workspace -> None, a Python call that must raise ``raises``. xfail: why the input
    is not refused cleanly yet (a known bug). subprocess: run the command line in a
    fresh ``python -m fedjax_fair.cli`` (for what a library logs once per process).
    """

    id: str
    area: str
    shown: str
    where: str
    field: object
    cli: Optional[Callable] = None
    call: Optional[Callable] = None
    raises: tuple = (ValueError, TypeError)
    xfail: Optional[str] = None
    subprocess: bool = False


CASES: list[Case] = []
AREAS = ("`run` flags", "`compare` flags", "Hyper-parameter values (from every algorithm's "
         "ranges)", "Hyper-parameter names and Python objects", "Learning-rate schedules "
         "and step budgets", "Models against the data", "Datasets and dataset arguments",
         "Config files (`--config`)", "Output directories and `--resume`",
         "Corrupted checkpoints and saved runs", "LEAF data files",
         "Python API: data", "Python API: builders and `fedjax_fair.run`")


def _add(area_index: int, id_: str, shown: str, where: str, field, **kw) -> None:
    CASES.append(Case(id=id_, area=AREAS[area_index], shown=shown, where=where,
                      field=field, **kw))


def _flags(cmd: str, flags: list, field, area: int = 0, id_: Optional[str] = None,
           tiny: bool = True, **kw) -> None:
    """A ``fedjax-fair CMD FLAGS`` case (on the tiny federation unless ``tiny`` is
    False)."""
    shown = f"`{cmd} {' '.join(_quote(f) for f in flags)}`"
    _add(area, id_ or f"{cmd}:{' '.join(flags)}", shown, f"`{cmd}` flag", field,
         cli=lambda ws, f=list(flags): [cmd, *(TINY if tiny else []), *f], **kw)


def _quote(arg: str) -> str:
    return arg if arg and re.fullmatch(r"[\w.,:@=/+\-\[\]]+", arg) else "'" + arg + "'"


def _bad_values(r) -> list:
    """(value text, what is wrong) for a Range: below / above the bounds, wrong type."""
    out = []
    if r.low is not None:
        low = int(r.low) if r.integer else r.low
        out.append((f"{low:g}" if r.low_open else f"{low - 1:g}",
                    "at the open lower bound" if r.low_open else "below the lower bound"))
    if r.high is not None:
        out.append((f"{r.high:g}" if r.high_open else f"{r.high + 1:g}", "above the range"))
    out.append(("2.5", "not an integer") if r.integer else ("nan", "NaN"))
    out.append(("abc", "a string"))
    return out

