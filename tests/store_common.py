"""Shared pieces of the run-store tests (tests/test_store.py, tests/test_store_compare.py):
the tiny federation's flags, a simulated SIGKILL, ``cli.main`` as a process would end,
and a JSONL log's rows."""
import json

from fedjax_fair import cli

TINY = ["--num-clients", "6", "--dataset-arg", "max_examples=100", "--cohort-size", "3",
        "--no-progress"]


class Killed(BaseException):
    """A simulated SIGKILL: nothing of the program runs after it but ``finally``."""


def _main(argv) -> int:
    """``cli.main``, then what the end of the process would release (folder locks)."""
    try:
        return cli.main(argv)
    finally:
        held = getattr(cli, "_HELD", [])
        for h in held:
            h.release()
        held.clear()


def _rows(path, drop=("seconds",)):
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in drop} for line in f]
