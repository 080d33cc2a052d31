"""``fedjax-fair compare --tune``: every method searched under the same budget on a
validation split, then compared at its selected setting on the test split.

For each compared method (``search``):

1. its search space (``drivers.tuning.search_space``: the paper's grid stated next to
   its factory, the client rate on a 4-point log grid, ``--grid METHOD.NAME=...``,
   thinned to ``--tune-budget`` grid points) runs as a sweep in
   ``OUTPUT_DIR/tune/METHOD`` (``cli.sweep.execute``: the continuous names vmapped in
   one compiled program, the static ones split programs; every call saved as it ends)
   with the seeds ``--tune-seeds``, on the data with a validation split held out of
   each client's training rows (``--validation-fraction``, 0.1 when it is 0; a dataset
   with its own validation split keeps it). The test split is never read by the
   selection.
2. the setting whose validation ``--select`` summary is best (mean over the tuning
   seeds; a grid point with a diverged seed is never chosen; ties: the first point in
   the grid's order) is selected (``reports.sweep.select``).

``OUTPUT_DIR/tuning.json`` then records every method's space, selection and score,
and the comparison runs each method at its selected setting with ``--seeds``
(disjoint from the tuning seeds) on the original data, as ``compare`` runs it.
``--resume`` continues a search from its saved calls (and skips none that changed).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import time
from typing import Optional

import numpy as np

from fedjax_fair import reports as report
from fedjax_fair.algorithms import base_name
from fedjax_fair.cli import config as C, options as O
from fedjax_fair.drivers import tuning
from fedjax_fair.reports.sweep import SUMMARY, _setting, is_percent, values_at

TUNE_DIR = "tune"
TUNING = "tuning.json"
DEFAULT_VALIDATION = 0.1

# what a comparison's search does not take from the comparison (set here, or the
# sweep's own: its output, its seeds and grid, the summary its heat-map draws)
_OWN = ("algorithm", "hparams", "seeds", "grid", "output_dir", "resume", "overwrite",
        "metric", "progress")


def search_dir(out: str, name: str) -> str:
    return os.path.join(out, TUNE_DIR, name)


def spaces(cfg, hparams: dict) -> dict:
    """``{method: {name: values}}`` of the comparison's searches (``check_tune`` has
    checked the grids): the values the user fixed (``--hp``, ``--client-lr``) are not
    searched."""
    grids = C.tune_grids(cfg)
    out = {}
    for a in cfg.algorithms:
        fixed = dict(hparams[a])
        if getattr(cfg, "client_lr", None) is not None:
            fixed[tuning.RATE] = cfg.client_lr
        space = tuning.search_space(a, fixed=fixed, overrides=grids.get(a),
                                    budget=cfg.tune_budget)
        if not space:
            raise C.ConfigError("grid", f"{a}: nothing to search (every name of its space is "
                                        f"fixed by --hp or a flag); give --grid {a}.NAME=...")
        out[a] = space
    return out


def sweep_config(cfg, name: str, hparams: dict, space: dict, out: str) -> C.SweepConfig:
    """The ``SweepConfig`` of method ``name``'s search: the comparison's settings, the
    tuning seeds, ``space`` as the grid, a validation split held out of the training
    rows, ``--select``."""
    values = {o.name: getattr(cfg, o.name) for o in O.of("sweep")
              if o.name not in _OWN and hasattr(cfg, o.name)}
    directory = search_dir(out, name)
    values.update(
        algorithm=base_name(name), hparams={k: v for k, v in hparams.items() if k not in space},
        seeds=list(cfg.tune_seeds), grid={k: list(v) for k, v in space.items()},
        output_dir=directory, progress=False,
        resume=bool(cfg.resume) and os.path.isfile(os.path.join(directory, "config.json")),
        overwrite=bool(cfg.overwrite) and not cfg.resume,
        validation_fraction=cfg.validation_fraction or DEFAULT_VALIDATION)
    if values.get(tuning.RATE) is not None and tuning.RATE in space:
        values[tuning.RATE] = None
    return C.build(C.SweepConfig, None, values)


def check(cfg, hparams: dict, out: str, model, ds) -> dict:
    """Every method's search configuration, validated before anything is written or
    compiled (``validate_sweep``: a system option a sweep cannot honour, a bad value of
    a grid; ``--select`` against the summaries of ``model`` on ``ds``):
    ``{method: SweepConfig}``."""
    from fedjax_fair.cli import sweep
    names = sweep.summary_keys(sweep.metric_names(model, ds), True)
    sweep.check_select(cfg.select, names)
    configs = {}
    for name, space in spaces(cfg, hparams).items():
        scfg = sweep_config(cfg, name, hparams[name], space, out)
        try:
            C.validate_sweep(scfg)
        except C.ConfigError as e:
            raise C.ConfigError(e.field, f"the search of {name}: "
                                         f"{str(e).split(': ', 1)[-1]}") from None
        configs[name] = scfg
    return configs


def search(cfg, configs: dict, out: str) -> dict:
    """Runs every method's search (``check``'s configurations, one after another) and
    returns ``{method: record}`` (``tuning.json``'s rows: the space, the selected
    values, the score they were selected by, the grid points, seeds and seconds). A
    method whose every grid point diverged keeps its defaults, and says so."""
    from fedjax_fair.cli import sweep
    total = sum(tuning.size(c.grid) for c in configs.values())
    programs = sum(len(sweep.plan_programs(c, c.hparams)) for c in configs.values())
    print(f"tune: {len(configs)} methods, {programs} compiled programs, {total} grid points "
          f"x {len(cfg.tune_seeds)} seeds "
          f"(seeds {','.join(map(str, cfg.tune_seeds))}) on a validation split, selected by "
          f"validation {cfg.select}; searches in {os.path.join(out, TUNE_DIR)}")
    if cfg.dp_noise is not None or cfg.dp_epsilon is not None:
        print("note: the reported epsilon covers the scored runs only; the searches train "
              "on the same clients' data and spend privacy that is not accounted for "
              "(tuning on private data is not private)")
    records, done_points, t_all = {}, 0, time.perf_counter()
    for k, (name, scfg) in enumerate(configs.items()):
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # its table: tune/NAME/sweep.md
            code = sweep.execute(scfg, reraise=True)
        if code != 0:
            raise C.ConfigError("tune", f"the search of {name} ended with status {code}")
        with open(os.path.join(scfg.resolved_output_dir(), SUMMARY)) as f:
            summary = json.load(f)
        seconds = time.perf_counter() - t0
        records[name] = _record(name, scfg, summary, seconds)
        done_points += tuning.size(scfg.grid)
        print(f"tune {name}: {_line(records[name])} ({tuning.size(scfg.grid)} points, "
              f"{seconds:.1f}s)")
        if k == 0 and len(configs) > 1:
            rate = (time.perf_counter() - t_all) / max(done_points, 1)
            print(f"tune: about {rate * (total - done_points) / 60:.1f} more minutes for the "
                  f"other searches (from the first one's seconds per grid point)")
    report.write_json(os.path.join(out, TUNING), {"select": cfg.select,
                                                  "seeds": list(cfg.tune_seeds),
                                                  "methods": records})
    return records


def _record(name: str, scfg, summary: dict, seconds: float) -> dict:
    """One method's row of tuning.json; ``default_score``: the selection summary at
    the method's default setting when it is a grid point (what tuning gained)."""
    selected = summary.get("selected")
    default = tuning.default_point(name, scfg.grid)
    key = selected.get("key") if selected else None
    record = report.read_json(os.path.join(scfg.resolved_output_dir(), "runs.json")) or {}
    ties = 1
    if selected and key in record.get("summary", {}):
        means = np.asarray(record["summary"][key], np.float64).mean(axis=1)
        ties = int(np.sum(means == selected["score"]["mean"]))
    return {"space": scfg.grid, "points": tuning.size(scfg.grid), "ties": ties,
            "seeds": list(scfg.seeds), "seconds": seconds,
            "hparams": selected["hparams"] if selected else {},
            "key": key, "score": selected.get("score") if selected else None,
            "default": default,
            "default_score": _score_at(record, default, key),
            "note": None if selected else summary.get("selection_note", "nothing selected")}


def _score_at(record: dict, point: Optional[dict], key: Optional[str]) -> Optional[dict]:
    """Mean and std over seeds of summary ``key`` at grid ``point`` of a sweep's
    runs.json ``record``."""
    values = None if point is None or key is None or not record else \
        values_at(record, point, key)
    return None if values is None else {"mean": float(values.mean()),
                                        "std": float(values.std())}


def _line(record: dict) -> str:
    if not record["hparams"]:
        return f"kept its defaults: {record['note']}"
    score = record["score"]
    tie = (f"; {record['ties']} grid points tie at the best score: the first in the grid's "
           f"order is taken" if record.get("ties", 1) > 1 else "")
    shown = (f"{100 * score['mean']:.2f} ± {100 * score['std']:.2f}%"
             if is_percent(record["key"]) else
             f"{score['mean']:.4g} ± {score['std']:.2g}")
    return f"{_setting(record['hparams'])} ({record['key']} {shown}{tie})"


def tuned_hparams(hparams: dict, records: dict) -> dict:
    """Each method's hyper-parameters with its selected values."""
    return {a: {**hp, **records.get(a, {}).get("hparams", {})} for a, hp in hparams.items()}


def read(out: str) -> Optional[dict]:
    """``tuning.json`` of a comparison folder, or None."""
    return report.read_json(os.path.join(out, TUNING))


__all__ = ["TUNE_DIR", "TUNING", "search_dir", "spaces", "sweep_config", "check", "search",
           "tuned_hparams", "read"]
