"""``fedjax-fair report DIR``: the tables, figures and ``report.html`` of a ``run``,
``compare`` or ``sweep`` folder written again from the files it holds, without
computing anything (a figure lost or deleted, a folder copied from a cluster, a
library update that draws them better). The writers are the ones the commands use,
so the tables come out byte for byte as the command wrote them."""
from __future__ import annotations

import json
import os

from fedjax_fair.cli import config as C, lock
from fedjax_fair.cli.common import _COMMAND, _HELD, _STAGE, _STAGE_DIR


def folder_kind(out: str) -> str:
    """"compare", "sweep" or "run": what wrote ``out`` (its config.json says), else
    ``ConfigError("directory")``."""
    path = os.path.join(out, "config.json")
    if not os.path.isdir(out):
        raise C.ConfigError("directory", f"{out!r} is not a directory")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise C.ConfigError("directory", f"{out!r} holds no readable config.json of a run, "
                                         f"comparison or sweep ({e})") from None
    if not isinstance(cfg, dict):
        raise C.ConfigError("directory", f"{path!r} is not a configuration")
    if "algorithms" in cfg and "seeds" in cfg:  # (a tuned comparison has a grid too)
        return "compare"
    if "grid" in cfg:
        return "sweep"
    if "algorithm" in cfg:
        return "run"
    raise C.ConfigError("directory", f"{path!r} is not the configuration of a run, "
                                     f"comparison or sweep")


def cmd_report(args) -> int:
    out = args.directory
    kind = folder_kind(out)
    held = lock.Held(_COMMAND or None)  # not while a command writes there
    held.acquire(out, "directory")
    _HELD.append(held)
    _STAGE_DIR.append(out)
    _STAGE.append(f"while writing the tables and figures of {out} again")
    if kind == "compare":
        from fedjax_fair.cli.compare import rebuild
        return rebuild(out)
    if kind == "sweep":
        from fedjax_fair.cli.sweep import rebuild
        rebuild(out)
        return 0
    from fedjax_fair.cli.run import rebuild_run
    return rebuild_run(out)
