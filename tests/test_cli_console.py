"""The console script's process (``fedjax_fair.cli.console``): what it sets up around
``main`` that ``main`` called in a notebook or a test does not."""
from __future__ import annotations

import gc
import json
import subprocess
import sys

from fedjax_fair import cli

_PROBE = """
import gc, json, sys
from fedjax_fair import cli
cli.main = lambda argv=None: print(json.dumps([gc.get_threshold(), gc.get_freeze_count()])) or 0
cli.console()
"""


def test_the_console_collects_garbage_less_often_and_main_leaves_the_collector_alone():
    """The command's process freezes the imported modules out of the collector and
    collects young objects in larger batches (cli.GC_THRESHOLDS) before ``main`` runs;
    ``main`` alone changes neither."""
    before = gc.get_threshold(), gc.get_freeze_count()
    assert cli.main(["list", "datasets"]) == 0
    assert (gc.get_threshold(), gc.get_freeze_count()) == before
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         check=True).stdout
    thresholds, frozen = json.loads(out.strip().splitlines()[-1])
    assert tuple(thresholds) == cli.GC_THRESHOLDS
    assert thresholds[0] > gc.get_threshold()[0]  # less often than the interpreter's
    assert frozen > 10_000  # the imported modules' objects
