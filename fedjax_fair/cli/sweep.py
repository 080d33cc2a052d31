"""``fedjax-fair sweep``: a grid of one algorithm's hyper-parameters x seeds as compiled
programs (``fedjax_fair.drivers.sweeps.sweep``), saved call by call, with its table,
heat-map and the setting a validation split selects.

    fedjax-fair sweep --algorithm qffl --grid q=0,0.5,1,2,5 --grid client_lr=0.01,0.03,0.1 \\
        --seeds 0-4

**Programs.** The grid's continuous hyper-parameters (``HParam.continuous``: rates,
q, tilts, ...) are vmapped inside one compiled program; each combination of its
static ones (counts such as ``batch_size`` / ``num_epochs``, choices such as
``mode``) is a program of its own, run one after another. A run is the CLI's: seed
``s`` initialises the model with ``jax.random.key(s)`` and keys sampling and
training with it, and the algorithm is built as ``fedjax-fair run`` builds it
(``common.build_algorithm``: local training, mixing, schedules, client SGD), so a
grid point's run equals ``fedjax-fair run --seed s`` with those values, up to float
rounding. Only the final state is evaluated (every client, test and validation).

**Output directory.**

* ``config.json`` (the resolved configuration), ``fingerprint.json`` and the lock, as
  ``compare`` writes them;
* ``parts/program<k>/tile<i>.npz``: the per-client test (and validation) metrics of
  each finished call of program ``k`` (``sweeps.tile_arrays``: ``[s, g, N]`` for the
  call's ``g`` grid points x ``s`` seeds), written by one rename as the call ends,
  with the key of the sweep and call it belongs to;
* ``runs.json``: every run's summaries (``SweepResult.summary``: ``{key: [points]
  [seeds]}``), the grid's axes and the context of the tables: all that ``rebuild``
  reads;
* ``sweep.md`` / ``sweep.csv``: one row per grid point, every summary as mean ± std
  over seeds (accuracies in percent, as ``compare``'s table; the CSV at full
  precision with ``*_seed_std`` columns); ``heatmap.png``: ``--metric`` over the
  first two axes;
* ``summary.json``, written last (a sweep's commit): the setting selected by
  validation accuracy with its test metrics, the programs and timings.

**Resume.** A call's outputs are a deterministic function of the configuration, the
program and the call (its grid points and seeds), so ``--resume`` loads every saved
call whose key matches and runs only the others (``sweeps.sweep``'s ``done``); the
merged results, hence ``runs.json`` and the tables, are the same as an uninterrupted
sweep's. SIGINT / SIGTERM stop after the call in progress is saved (a second one at
once).

**Selection.** With a validation split, the setting with the highest mean validation
accuracy over seeds is selected and its test metrics reported. Without one nothing is
selected: the best setting by ``--metric`` on the test split is shown for orientation,
marked as NOT a fair selection (it is chosen on the data it is scored on).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import shutil
import sys
import time
import zipfile
import zlib
from typing import NamedTuple, Optional

import jax
import numpy as np

from fedjax_fair import reports as report
from fedjax_fair.cli import config as C, lock, tracked
from fedjax_fair.reports import html
from fedjax_fair.cli.common import (EXIT_INTERRUPTED, _check_capacity, _check_recorded, _err,
                                    _ordered_config, _own, _preflight, _resumable_config,
                                    _STAGE, _STAGE_DIR, build_algorithm, build_dataset,
                                    build_model, command_line, dataset_description,
                                    for_method)
from fedjax_fair.scenarios import sampling
from fedjax_fair.core.evaluation import make_evaluator
from fedjax_fair.cli.parsing import parse_budgets
from fedjax_fair.drivers import sweeps

PARTS = "parts"
RUNS = "runs.json"
TABLE_MD, TABLE_CSV, HEATMAP, SUMMARY = "sweep.md", "sweep.csv", "heatmap.png", "summary.json"
SELECT_BY = "validation_accuracy_mean"
VALIDATION = "validation_"


def sweep_config(args: argparse.Namespace) -> C.SweepConfig:
    """The SweepConfig of ``sweep``: with ``--resume``, the interrupted sweep's
    config.json <- the config file <- flags (which may only change where the outputs
    go and how they are shown)."""
    from fedjax_fair.cli.common import config_layers
    cfg = C.build(C.SweepConfig, *config_layers(args, C.SweepConfig))
    if cfg.resume:  # a run's or comparison's folder is not a sweep to continue
        path = os.path.join(cfg.resolved_output_dir(), "config.json")
        try:
            with open(path) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            saved = None  # missing or unreadable: _resumable_config says which
        if isinstance(saved, dict) and "grid" not in saved:
            raise C.ConfigError("resume", f"{path} does not hold a saved sweep (no grid); "
                                          f"continue a run or comparison with its own "
                                          f"command")
    return _resumable_config(args, C.SweepConfig, C.SWEEP_RESUMABLE, "sweep")


# ------------------------------------------------------------------ the grid's programs


class Program(NamedTuple):
    """One compiled program of a sweep: the values of the static hyper-parameters
    (``static``), the run's configuration with them (``cfg``: local training of the
    method's own where unset) and the algorithm's other hyper-parameters."""

    index: int
    static: dict
    cfg: C.SweepConfig
    hparams: dict


def split_grid(algorithm: str, grid: dict) -> tuple[list, list]:
    """(static names, continuous names) of a grid, each in the grid's order."""
    from fedjax_fair.algorithms import method_hparams
    every = method_hparams(algorithm)
    static = [n for n in grid if not every[n].continuous]
    return static, [n for n in grid if every[n].continuous]


def plan_programs(cfg: C.SweepConfig, hparams: dict) -> list:
    """One ``Program`` per combination of the static values, in the grid's C order."""
    static, _ = split_grid(cfg.algorithm, cfg.grid)
    fields = C.config_fields()
    programs = []
    for k, values in enumerate(itertools.product(*[cfg.grid[n] for n in static])):
        chosen = dict(zip(static, values))
        pcfg = dataclasses.replace(cfg, improvement=False,  # the final state only
                                   **{n: v for n, v in chosen.items() if n in fields})
        programs.append(Program(k, chosen, for_method(pcfg, cfg.algorithm),
                                {**hparams, **{n: v for n, v in chosen.items()
                                               if n not in fields}}))
    return programs


def grid_points(grid: dict) -> list:
    """Every grid point as a tuple of value indices, in C order of the grid's names."""
    return list(itertools.product(*[range(len(v)) for v in grid.values()]))


def _show(value) -> str:
    """A grid value as the tables and plots show it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _seeds_text(seeds: list) -> str:
    """``[0, 1, 2, 3, 5, 6]`` -> ``"0-3,5,6"``: runs of three or more consecutive seeds
    as ranges."""
    groups: list = []
    for seed in seeds:
        if groups and seed == groups[-1][-1] + 1:
            groups[-1].append(seed)
        else:
            groups.append([seed])
    return ",".join(f"{g[0]}-{g[-1]}" if len(g) > 2 else ",".join(map(str, g))
                    for g in groups)


def programs_line(cfg: C.SweepConfig, programs: list, calls: int, per_call: int) -> str:
    """What runs as one program: the static names split the grid, the continuous ones
    are vmapped; how many calls each program makes (each saved as it ends)."""
    static, continuous = split_grid(cfg.algorithm, cfg.grid)
    points = int(np.prod([len(cfg.grid[n]) for n in continuous])) if continuous else 1
    seeds = len(cfg.seeds)
    size = f"{points} grid point{'s' * (points > 1)} x {seeds} seed{'s' * (seeds > 1)}"
    vmapped = f" ({', '.join(continuous)} vmapped)" if continuous else ""
    head = (f"{', '.join(static)} {'are' if len(static) > 1 else 'is'} static: "
            f"{len(programs)} program{'s' * (len(programs) > 1)} of {size}{vmapped}" if static
            else f"one program of {size}{vmapped}")
    runs = f"{per_call} run{'s' * (per_call > 1)}"
    return (f"{head}; {calls} calls of {runs} each, saved as each ends" if calls > 1
            else f"{head}; one call of {runs}, saved as it ends")


# ------------------------------------------------------------------ checks before compute


def metric_names(model, ds) -> list:
    """The per-client metrics the final evaluation gives ("accuracy", "loss", ...),
    from shapes alone."""
    params = jax.eval_shape(model.init, jax.random.key(0))
    out = jax.eval_shape(make_evaluator(model), params, ds.host_data.test)
    return [k for k in out if k != "num_examples"]


def summary_keys(metrics: list, validation: bool) -> list:
    """The summaries of every run (``SweepResult.summary``'s keys), in table order."""
    keys = sweeps.summary_keys(metrics, "test")
    if validation:
        keys += sweeps.summary_keys(metrics, "validation")
    return sorted(keys, key=_rank)


_ORDER = ("mean", "weighted_mean", "std", "variance", "worst_10%", "best_10%",
          "parity_gap_10%", "worst_10%_unweighted", "best_10%_unweighted", "worst_5%",
          "best_5%", "parity_gap_5%", "worst_5%_unweighted", "best_5%_unweighted", "gini",
          "angle", "kl_to_uniform")


def _base(key: str) -> str:
    return key[len(VALIDATION):] if key.startswith(VALIDATION) else key


def _rank(key: str) -> tuple:
    base = _base(key)
    if base.startswith("accuracy_") and base[len("accuracy_"):] in _ORDER:
        rank = _ORDER.index(base[len("accuracy_"):])
    else:
        rank = {"test_loss": 100, "loss": 100, "ece": 101, "mce": 102}.get(base, 200)
    return key.startswith(VALIDATION), rank


def check_metric(metric: str, keys: list) -> None:
    if metric not in keys:
        raise C.ConfigError("metric", f"unknown summary {metric!r}; allowed: "
                                      f"{', '.join(keys)}")


def check_traceable(program: Program, model, ds, continuous: list) -> None:
    """The factory accepts traced values of the continuous names (checked by building
    the algorithm under ``jax.eval_shape``: nothing is compiled)."""
    if not continuous:
        return
    shapes = {n: jax.ShapeDtypeStruct((), jax.numpy.float32) for n in continuous}
    jax.eval_shape(lambda hp: (_builder(program, model, ds)(hp), 0)[1], shapes)


@contextlib.contextmanager
def _as_grid_error(static: dict):
    """A factory's refusal of a static grid value (a choice it does not know) as a
    ``grid`` error naming the value."""
    try:
        yield
    except C.ConfigError as e:
        name = e.field.rpartition(".")[2]
        if name not in static:
            raise
        raise C.ConfigError("grid", f"{name}={_show(static[name])}: "
                                    f"{str(e)[len(e.field) + 2:]}") from None


def _builder(program: Program, model, ds):
    """``hparams -> FederatedAlgorithm`` of a program, built as ``fedjax-fair run``
    builds its algorithm, the grid's continuous values (traced) among the
    hyper-parameters."""
    name = program.cfg.algorithm
    return lambda hp: build_algorithm(name, model, program.cfg, {**program.hparams, **hp},
                                      ds)


# ------------------------------------------------------------------ parts


def tiles_of(cfg: C.SweepConfig, continuous: list) -> sweeps.Tiles:
    """The calls of every program (``sweeps.Tiles``), with the seeds vmapped on
    accelerators and one after another on CPU, as ``sweeps.sweep`` does."""
    points = int(np.prod([len(cfg.grid[n]) for n in continuous])) if continuous else 1
    return sweeps.Tiles.of(points, len(cfg.seeds), cfg.tile_size, _vmap_seeds())


def _vmap_seeds() -> bool:
    return jax.default_backend() != "cpu"


def part_path(out: str, program: int, tile: int) -> str:
    return os.path.join(out, PARTS, f"program{program}", f"tile{tile}.npz")


def part_key(cfg_dict: dict, program: Program, tile: int, tiles: sweeps.Tiles,
             num_clients: int) -> str:
    """What a saved call belongs to: the sweep's configuration (its fingerprint and
    length), the program, the call and the geometry of the calls."""
    return json.dumps({"fingerprint": lock.fingerprint(cfg_dict),
                       "num_rounds": cfg_dict["num_rounds"], "program": program.index,
                       "static": program.static, "tile": tile, "tiles": list(tiles),
                       "num_clients": num_clients, "backend": jax.default_backend()},
                      sort_keys=True, default=str)


def save_part(path: str, arrays: dict, seconds: float, key: str) -> None:
    """One finished call's arrays, its seconds and key, written by one rename."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        np.savez(f, _key=np.array(key), _seconds=np.float64(seconds), **arrays)
    os.replace(tmp, path)


def load_part(path: str, key: str, shape: tuple) -> Optional[tuple]:
    """(arrays, seconds) of a saved call with this key and arrays of ``shape``; None
    when it is missing, unreadable or another sweep's (the call then runs again)."""
    try:
        with np.load(path) as z:
            if str(z["_key"]) != key:
                return None
            arrays = {k: np.asarray(z[k]) for k in z.files if not k.startswith("_")}
            seconds = float(z["_seconds"])
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error):
        return None
    if not arrays or any(a.shape != shape for a in arrays.values()):
        return None
    return arrays, seconds


# ------------------------------------------------------------------ the command


class Plan(NamedTuple):
    """What a sweep runs, checked before anything is written or compiled."""

    ds: object
    model: object
    programs: list
    continuous: list  # the grid's vmapped names
    keys: list  # every run's summaries
    validation: bool
    evaluated: Optional[str]
    tiles: sweeps.Tiles  # the calls of each program
    algorithm: object  # a program's method under its scenarios (what they are)


def plan(cfg: C.SweepConfig, hparams: dict) -> Plan:
    """The data, model and programs of a validated sweep, every program's algorithm
    built (and traced in the continuous names) and ``--metric`` checked: each refusal a
    ``ConfigError`` before compute."""
    ds = build_dataset(cfg)
    C.validate_against_data(cfg, ds.num_clients, ds.host_data.train.num_examples)
    model = build_model(cfg, ds)
    programs = plan_programs(cfg, hparams)
    for batch in sorted({p.cfg.batch_size for p in programs}):
        _preflight(dataclasses.replace(cfg, batch_size=batch), ds, model)
    _, continuous = split_grid(cfg.algorithm, cfg.grid)
    first = {n: cfg.grid[n][0] for n in continuous}
    evaluated = alg = None
    for program in programs:
        with _as_grid_error(program.static):
            alg = build_algorithm(cfg.algorithm, model, program.cfg,
                                  {**program.hparams, **first}, ds)
        _check_capacity(alg, ds.num_clients, program.cfg)
        check_traceable(program, model, ds, continuous)
        evaluated = alg.evaluates
    validation = sweeps.has_examples(ds.host_data.validation)
    keys = summary_keys(metric_names(model, ds), validation)
    check_metric(cfg.metric, keys)
    return Plan(ds, model, programs, continuous, keys, validation, evaluated,
                tiles_of(cfg, continuous), alg)


def cmd_sweep(args) -> int:
    if getattr(args, "distributed", False):
        raise C.ConfigError("distributed", "a sweep runs in one process on one device; drop "
                                           "--distributed")
    cfg = sweep_config(args)
    hparams = C.validate_sweep(cfg)
    if getattr(cfg, "saved_config", None):
        _check_recorded(*cfg.saved_config)
    from fedjax_fair.cli.run import _persistent_compilation_cache
    _persistent_compilation_cache()
    out = cfg.resolved_output_dir()
    cfg_dict = _ordered_config(cfg)
    cfg_dict["output_dir"] = out
    cfg_dict["fingerprint"] = lock.fingerprint(cfg_dict)
    p = plan(cfg, hparams)
    print(programs_line(cfg, p.programs, p.tiles.count, p.tiles.g * p.tiles.s))
    from fedjax_fair.cli import transforms
    cfg_dict["scenarios"] = transforms.announce(cfg, {cfg.algorithm: p.algorithm})[
        cfg.algorithm]

    _own(cfg, True, check_fresh=True)
    if not cfg.resume:  # a fresh sweep: nothing of an earlier one stays (--overwrite)
        shutil.rmtree(os.path.join(out, PARTS), ignore_errors=True)
        for name in (SUMMARY, RUNS, TABLE_MD, TABLE_CSV, HEATMAP):
            _remove(os.path.join(out, name))
        report.write_json(os.path.join(out, "config.json"), cfg_dict)
        lock.record(out, cfg_dict)
        tracked.discard(out)  # the earlier runs' dashboards go too
    t_start = time.perf_counter()
    seconds = [dict() for _ in p.programs]  # per program: {call: its seconds}
    from fedjax_fair.drivers.runner import Interrupted
    try:
        results, timings = run_programs(cfg, cfg_dict, p, seconds)
    except (Interrupted, KeyboardInterrupt):
        saved = sum(len(s) for s in seconds)
        _err(f"interrupted: {saved} of {p.tiles.count * len(p.programs)} calls of the sweep "
             f"are saved in {os.path.join(out, PARTS)}; continue with: fedjax-fair sweep -o "
             f"{out} --resume")
        return EXIT_INTERRUPTED
    write_outputs(cfg, cfg_dict, p, results, timings, t_start)
    return 0


def run_programs(cfg: C.SweepConfig, cfg_dict: dict, p: Plan, seconds: list) -> tuple:
    """Every program through ``sweeps.sweep``, each call saved as it ends (``save_part``)
    and, with ``--resume``, the saved calls loaded instead of run; ``seconds[k]``
    collects program k's calls' seconds. SIGINT / SIGTERM stop after the call in
    progress is saved (``runner.Interrupted``). Returns (SweepResults, timings)."""
    from tqdm.auto import tqdm
    from fedjax_fair.drivers.runner import Interrupted, stop_on_signals, stop_requested
    out = cfg.resolved_output_dir()
    ds, tiles = p.ds, p.tiles
    shape = (tiles.s, tiles.g, ds.num_clients)
    key = lambda program, i: part_key(cfg_dict, program, i, tiles, ds.num_clients)
    results, timings = [], []
    bar = tqdm(total=tiles.count * len(p.programs), desc="sweep", unit="call",
               dynamic_ncols=True, disable=not (cfg.progress and sys.stderr.isatty()))
    with bar, stop_on_signals():
        for program in p.programs:
            done = {}
            for i in range(tiles.count) if cfg.resume else ():
                saved = load_part(part_path(out, program.index, i), key(program, i), shape)
                if saved is not None:
                    done[i], seconds[program.index][i] = saved
            bar.update(len(done))
            if cfg.resume:
                where = f" of {_setting(program.static)}" if program.static else ""
                print(f"resumed: {len(done)} of {tiles.count} calls{where} loaded from "
                      f"{os.path.join(out, PARTS)}")
            if len(done) < tiles.count and stop_requested():
                raise Interrupted(0)

            def on_tile(i, arrays, s, program=program):
                save_part(part_path(out, program.index, i), arrays, s, key(program, i))
                seconds[program.index][i] = s
                bar.update(1)
                if stop_requested():  # SIGINT / SIGTERM: stop after the saved call
                    raise Interrupted(0)

            pcfg = program.cfg
            result = sweeps.sweep(
                _builder(program, p.model, ds), {n: cfg.grid[n] for n in p.continuous},
                data=ds.host_data, model=p.model, seeds=cfg.seeds, num_rounds=cfg.num_rounds,
                cohort_size=cfg.cohort_size,
                sampler=sampling.get(cfg.sampler, ds.host_data.train.num_examples),
                execution=C.execution_of(dataclasses.replace(pcfg, devices=1),
                                         ds.num_clients),
                step_budgets=parse_budgets(pcfg.step_budgets, pcfg.batch_size),
                chunk_size=cfg.tile_size, vmap_seeds=_vmap_seeds(), on_tile=on_tile,
                done=done)
            results.append(result)
            timings.append({"static": program.static, "calls": tiles.count,
                            "calls_loaded": len(done),
                            "compile_seconds": result.compile_seconds,
                            "run_seconds": sum(seconds[program.index].values())})
    return results, timings


def write_outputs(cfg: C.SweepConfig, cfg_dict: dict, p: Plan, results: list, timings: list,
                  t_start: float) -> None:
    """runs.json, then the tables and heat-map through ``rebuild`` (printing the table
    and the selection), then summary.json, last, and the closing line."""
    out = cfg.resolved_output_dir()
    _STAGE_DIR.append(out)
    _STAGE.append(f"while writing the sweep's tables to {out}; its summary.json (written "
                  f"last) is not written; every run is saved in {os.path.join(out, PARTS)}; "
                  f"write them again with: fedjax-fair sweep -o {out} --resume")
    _remove(os.path.join(out, SUMMARY))  # the commit of the outputs written below
    record = runs_record(cfg, p.ds, p.programs, results, p.keys, p.validation, p.evaluated)
    report.write_json(os.path.join(out, RUNS), record)
    track(cfg, cfg_dict, record, results)
    selection, shown = _rebuild(out, plots=cfg.plots, echo=True)
    points, seeds = shown["diverged"].shape
    total_seconds = time.perf_counter() - t_start
    report.write_json(os.path.join(out, SUMMARY), {
        "status": "ok", "config": cfg_dict, "command": command_line(),
        "dataset": dataset_description(p.ds),
        "evaluated": p.evaluated, "grid": record["axes"], "seeds": cfg.seeds,
        "grid_points": points, "runs": points * seeds,
        "diverged_runs": int(shown["diverged"].sum()), **selection, "programs": timings,
        "timings": {"seconds": total_seconds,
                    "compile_seconds": sum(t["compile_seconds"] for t in timings),
                    "run_seconds": sum(t["run_seconds"] for t in timings)},
        "outputs": sorted(n for n in (TABLE_MD, TABLE_CSV, HEATMAP, RUNS)
                          if os.path.exists(os.path.join(out, n)))})
    print(f"\n{points * seeds} run{'s' * (points * seeds > 1)} ({points} grid point"
          f"{'s' * (points > 1)} x {seeds} seed{'s' * (seeds > 1)}) in {total_seconds:.1f}s "
          f"-> {out}")


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def locate(cfg: C.SweepConfig) -> list:
    """``[(program, position)]`` of every grid point in C order of the grid's names:
    the static program that ran it and its flat position in that program's vmapped
    (continuous) grid."""
    static, continuous = split_grid(cfg.algorithm, cfg.grid)
    static_sizes = [len(cfg.grid[n]) for n in static]
    cont_sizes = [len(cfg.grid[n]) for n in continuous]
    out = []
    for point in grid_points(cfg.grid):
        at = dict(zip(cfg.grid, point))
        out.append((int(np.ravel_multi_index([at[n] for n in static], static_sizes))
                    if static else 0,
                    int(np.ravel_multi_index([at[n] for n in continuous], cont_sizes))
                    if continuous else 0))
    return out


def track(cfg: C.SweepConfig, cfg_dict: dict, record: dict, results: list) -> None:
    """``--tracker``: one tracked run per grid point and seed, ``SETTING/seedS`` (e.g.
    ``q=0.5,client_lr=0.1/seed0``), holding its final summaries at the last round and
    the histogram of its clients' final test accuracy; the setting is its config's
    hparams."""
    if not cfg.tracker:
        return
    seeds = len(cfg.seeds)
    for p, (k, c) in enumerate(locate(cfg)):
        hp = _point_hparams(record, p)
        setting = ",".join(f"{n}={_show(v)}" for n, v in hp.items())
        has_test = np.asarray(results[k].num_examples["test"]) > 0
        accuracy = np.asarray(results[k].test["accuracy"])
        accuracy = accuracy.reshape((-1, seeds) + accuracy.shape[-1:])[c]
        for s, seed in enumerate(cfg.seeds):
            entry = {"round": cfg.num_rounds,
                     **{key: rows[p][s] for key, rows in record["summary"].items()}}
            tracked.log_run(cfg, cfg.resolved_output_dir(),
                            f"{setting}/seed{seed}" if setting else f"seed{seed}",
                            {**cfg_dict, "hparams": {**cfg_dict.get("hparams", {}), **hp},
                             "seed": seed}, [entry],
                            {"round": [cfg.num_rounds], "accuracy": [accuracy[s][has_test]]},
                            resume=cfg.resume)


def runs_record(cfg: C.SweepConfig, ds, programs: list, results: list, keys: list,
                validation: bool, evaluated: Optional[str]) -> dict:
    """runs.json: the grid's axes, the seeds, every run's summaries ``{key: [point]
    [seed]}`` (points in C order of the grid's names) and the tables' context."""
    static, continuous = split_grid(cfg.algorithm, cfg.grid)
    names = list(cfg.grid)
    flat = [{k: np.asarray(r.summary[k]).reshape(-1, len(cfg.seeds)) for k in keys}
            for r in results]
    summary = {k: [] for k in keys}
    for k, c in locate(cfg):
        for key in keys:
            summary[key].append([float(v) for v in flat[k][key][c]])
    from fedjax_fair.cli import transforms
    accountant = transforms.accountant_of(cfg, ds.num_clients)  # one for every grid point
    private = {} if accountant is None else {
        "dp_epsilon": accountant.epsilon(cfg.num_rounds), "dp_delta": cfg.dp_delta}
    return {"algorithm": cfg.algorithm,
            "context": {"dataset": ds.name, "num_clients": int(ds.num_clients),
                        "model": cfg.model, "num_rounds": cfg.num_rounds,
                        "cohort_size": cfg.cohort_size, "evaluated": evaluated, **private},
            "axes": [{"name": n, "values": cfg.grid[n], "static": n in static}
                     for n in names],
            "seeds": list(cfg.seeds), "metric": cfg.metric, "validation": validation,
            "keys": keys, "summary": summary}


# ------------------------------------------------------------------ tables (from runs.json)


def read_record(out: str) -> dict:
    """runs.json of a sweep folder, its nulls (NaN/inf) as NaN, and every summary of a
    diverged run (``diverged``) NaN: a model whose parameters became NaN/inf still
    predicts a class, and its accuracy is no measurement."""
    path = os.path.join(out, RUNS)
    try:
        with open(path) as f:
            record = json.load(f)
        record["summary"] = {k: np.array([[math.nan if v is None else v for v in row]
                                          for row in rows], np.float64)
                             for k, rows in record["summary"].items()}
    except FileNotFoundError:
        raise C.ConfigError("output_dir", f"{out!r} holds no finished sweep ({RUNS}); "
                                          f"continue it with: fedjax-fair sweep -o {out} "
                                          f"--resume") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise C.ConfigError("output_dir", f"{path} is unreadable ({type(e).__name__}); "
                                          f"write it again with: fedjax-fair sweep -o {out} "
                                          f"--resume") from None
    record["diverged"] = mask = diverged(record["summary"])
    for values in record["summary"].values():
        values[mask] = math.nan
    return record


def diverged(summary: dict) -> np.ndarray:
    """``[points, seeds]``: the runs whose test (or validation) loss is NaN/inf, i.e.
    whose parameters became NaN/inf."""
    losses = [summary[k] for k in ("test_loss", "validation_loss") if k in summary]
    return ~np.all([np.isfinite(v) for v in losses], axis=0)


def is_percent(key: str) -> bool:
    """Accuracies and their spreads are shown in percent (compare's table); the
    variance, Gini, angle, KL, losses and calibration errors as they are."""
    base = _base(key)
    return base.startswith("accuracy_") and base[len("accuracy_"):] not in (
        "variance", "gini", "angle", "kl_to_uniform")


def higher_is_better(key: str) -> bool:
    base = _base(key)
    if base in ("test_loss", "loss", "ece", "mce"):
        return False
    tail = base[len("accuracy_"):] if base.startswith("accuracy_") else base
    return not (tail in ("std", "variance", "gini", "angle", "kl_to_uniform")
                or tail.startswith("parity_gap"))


def _decimals(key: str) -> int:
    base = _base(key)
    if is_percent(key):
        return 2
    if base in ("ece", "mce"):
        return 3
    return 6 if base.endswith("variance") else 4


def _header(key: str) -> str:
    return key + (" (%)" if is_percent(key) else "")


HEADLINE = (("accuracy_mean", "Average (%)"), ("accuracy_std", "Std (%)"),
            ("accuracy_worst_10%", "Worst 10% (%)"), ("accuracy_best_10%", "Best 10% (%)"),
            ("accuracy_gini", "Gini"), ("ece", "ECE"), ("test_loss", "Test loss"),
            ("validation_accuracy_mean", "Val. average (%)"),
            ("validation_accuracy_worst_10%", "Val. worst 10% (%)"))
NOTE = ("Average/Std/Worst/Best: per-client final test accuracy in percent over all clients "
        "with test data (worst/best 10%: the lowest/highest max(1, floor(0.1 N)) clients, "
        "averaged by test size); Gini of per-client accuracy; Test loss: example-weighted; "
        "Val.: the same on the validation split. With several seeds each cell is mean ± std "
        "over seeds; sweep.csv holds every summary at full precision, the std in the "
        "*_seed_std columns.")


def headline_columns(record: dict) -> list:
    """(key, header) of the printed table: compare's columns that the runs have, the
    validation accuracy, and ``--metric`` when it is none of them."""
    keys = record["keys"]
    cols = [(k, h) for k, h in HEADLINE if k in keys]
    if record["metric"] not in dict(cols):
        cols.append((record["metric"], _header(record["metric"])))
    return cols


def aggregate(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean, population std) over seeds of ``[points, seeds]``; NaN where a seed is."""
    return values.mean(axis=1), values.std(axis=1)


def table(record: dict, columns: list, notes: bool = False) -> tuple[list, list]:
    """(header, rows) of a table: the grid's values, then mean ± std of each column;
    ``notes``: a last column naming the diverged seeds of each grid point (when any
    run diverged)."""
    names = [a["name"] for a in record["axes"]]
    seeds = len(record["seeds"])
    stats = {k: aggregate(record["summary"][k]) for k, _ in columns}
    lost = record["diverged"]
    notes = notes and bool(lost.any())
    body = []
    for p, point in enumerate(grid_points({a["name"]: a["values"] for a in record["axes"]})):
        cells = [_show(a["values"][i]) for a, i in zip(record["axes"], point)]
        for k, _ in columns:
            scale = 100.0 if is_percent(k) else 1.0
            m, s = stats[k][0][p], stats[k][1][p]
            cells.append(_fmt(m * scale, s * scale if seeds > 1 else None, _decimals(k)))
        if notes:
            which = [str(seed) for seed, bad in zip(record["seeds"], lost[p]) if bad]
            cells.append(f"diverged: seed{'s' * (len(which) > 1)} {','.join(which)}"
                         if which else "")
        body.append(cells)
    return names + [h for _, h in columns] + (["Note"] if notes else []), body


def _fmt(value: float, std: Optional[float], decimals: int) -> str:
    """``report._fmt`` (compare's cells), in scientific notation past a million."""
    if math.isfinite(value) and abs(value) >= 1e6:
        return f"{value:.3e}" + (f" ± {std:.3e}" if std is not None else "")
    return report._fmt(value, std, decimals)


def write_csv(path: str, record: dict) -> None:
    """Every summary of every grid point, in the tables' units (accuracies in percent,
    the unit in the column name) at full precision: mean over seeds, then std
    (``*_seed_std``), as ``report.write_comparison_csv``; NaN (``nan``) where a seed
    diverged (``num_diverged``). Written by one rename."""
    import csv
    import io
    names = [a["name"] for a in record["axes"]]
    columns = [k + ("_percent" if is_percent(k) else "") for k in record["keys"]]
    stats = {k: aggregate(record["summary"][k]) for k in record["keys"]}
    text = io.StringIO()
    w = csv.writer(text)
    w.writerow(names + ["num_seeds", "num_diverged"]
               + [c for col in columns for c in (col, f"{col}_seed_std")])
    for p, point in enumerate(grid_points({a["name"]: a["values"] for a in record["axes"]})):
        row = [_csv_value(a["values"][i]) for a, i in zip(record["axes"], point)]
        row += [len(record["seeds"]), int(record["diverged"][p].sum())]
        for k in record["keys"]:
            scale = 100.0 if is_percent(k) else 1.0
            row += [repr(float(stats[k][0][p] * scale)), repr(float(stats[k][1][p] * scale))]
        w.writerow(row)
    report._replace_with(path, text.getvalue())


def _csv_value(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, float) else str(value)


# ------------------------------------------------------------------ selection


def _point_hparams(record: dict, p: int) -> dict:
    axes = {a["name"]: a["values"] for a in record["axes"]}
    point = grid_points(axes)[p]
    return {a["name"]: a["values"][i] for a, i in zip(record["axes"], point)}


def _stats_at(record: dict, p: int, keys) -> dict:
    return {k: {"mean": float(record["summary"][k][p].mean()),
                "std": float(record["summary"][k][p].std())} for k in keys}


def _best(values: np.ndarray, higher: bool) -> Optional[int]:
    """The first grid point with the best mean over seeds, among those whose every
    seed is finite (none diverged); None when there is none."""
    ok = np.isfinite(values).all(axis=1)
    if not ok.any():
        return None
    mean = np.where(ok, values.mean(axis=1), -np.inf if higher else np.inf)
    return int(np.argmax(mean) if higher else np.argmin(mean))


def select(record: dict) -> dict:
    """The honest choice of a setting: with a validation split, the highest mean
    validation accuracy over seeds (``selected``, with its test metrics); without one,
    ``selected`` is None, and ``best_on_test`` is the best by ``metric`` on the test
    split, which is NOT a fair selection (chosen on the data it is scored on)."""
    test_keys = [k for k in record["keys"] if not k.startswith(VALIDATION)]
    if record["validation"]:
        p = _best(record["summary"][SELECT_BY], True)
        if p is None:
            return {"selected": None, "selection_note": "every grid point has a diverged "
                                                        "seed: nothing to select"}
        return {"selected": {"by": f"{SELECT_BY} (mean over seeds, highest)", "point": p,
                             "hparams": _point_hparams(record, p),
                             SELECT_BY: _stats_at(record, p, [SELECT_BY])[SELECT_BY],
                             "test": _stats_at(record, p, test_keys)}}
    metric = record["metric"]
    p = _best(record["summary"][metric], higher_is_better(metric))
    best = None if p is None else {
        "by": f"{metric} (mean over seeds, {'highest' if higher_is_better(metric) else 'lowest'})"
              f" on the test split", "point": p, "hparams": _point_hparams(record, p),
        "test": _stats_at(record, p, test_keys)}
    return {"selected": None, "best_on_test": best,
            "selection_note": "no validation split: no setting is selected; best_on_test is "
                              "chosen on the test split it is scored on (optimistic), NOT a "
                              "fair selection; give the data a validation split (e.g. "
                              "--resplit 0.8,0.1,0.1) to select one"}


def _pct(stats: dict, seeds: int) -> str:
    return report._fmt(100 * stats["mean"], 100 * stats["std"] if seeds > 1 else None, 2)


def _setting(hparams: dict) -> str:
    return ", ".join(f"{k}={_show(v)}" for k, v in hparams.items())


def selection_lines(record: dict, selection: dict) -> list:
    """The printed lines of ``select``'s choice."""
    seeds = len(record["seeds"])
    sel = selection.get("selected")
    if sel is not None:
        t = sel["test"]
        return [f"selected by validation accuracy (mean over seeds): {_setting(sel['hparams'])}"
                f" (validation average {_pct(sel[SELECT_BY], seeds)}%); its test accuracy: "
                f"average {_pct(t['accuracy_mean'], seeds)}%, worst 10% "
                f"{_pct(t['accuracy_worst_10%'], seeds)}%"]
    best = selection.get("best_on_test")
    if best is None:
        return [f"no setting selected: {selection['selection_note']}"]
    metric = record["metric"]
    value = best["test"][metric]
    shown = (_pct(value, seeds) + "%" if is_percent(metric) else
             report._fmt(value["mean"], value["std"] if seeds > 1 else None,
                         _decimals(metric)))
    return ["no validation split: no setting is selected.",
            f"the best by {metric} on the TEST split is {_setting(best['hparams'])} ({shown}): "
            f"NOT a fair selection (chosen on the data it is scored on, so optimistic); give "
            f"the data a validation split (e.g. --resplit 0.8,0.1,0.1) to select one"]


# ------------------------------------------------------------------ rebuild


def title(record: dict) -> str:
    c = record["context"]
    seeds = record["seeds"]
    what = (f"final per-client test accuracy (mean ± std over {len(seeds)} seeds)"
            if len(seeds) > 1 else "final per-client test accuracy")
    model = report.EVALUATED.get(c.get("evaluated"), "")
    private = "" if "dp_epsilon" not in c else (
        f", client-level DP epsilon {c['dp_epsilon']:.3g} at delta {c['dp_delta']:g}"
        if c["dp_epsilon"] is not None else ", client-level DP without noise (epsilon inf)")
    return (f"{record['algorithm']} on {c['dataset']} ({c['num_clients']} clients), "
            f"{c['model']}{', ' + model if model else ''}, {c['num_rounds']} rounds, cohort "
            f"{c['cohort_size']}{private}, seed{'s' * (len(seeds) > 1)} "
            f"{_seeds_text(seeds)}: {what}")


def rebuild(out_dir: str, *, plots: Optional[bool] = None, echo: bool = True) -> None:
    """Rewrites sweep.md, sweep.csv and heatmap.png of the sweep folder ``out_dir`` from
    its runs.json, without computing a run, and prints the table and the selection
    (``echo``). The same tables byte for byte as the sweep wrote (the sweep command
    writes them with this function). ``plots``: draw the heat-map (None: as the
    sweep's config.json says). A folder without runs.json (an unfinished sweep) is a
    ``ConfigError`` naming the command that finishes it."""
    _rebuild(out_dir, plots=plots, echo=echo)


def _rebuild(out: str, plots: Optional[bool], echo: bool) -> tuple[dict, dict]:
    """``rebuild``; returns (the selection, the record read)."""
    record = read_record(out)
    if plots is None:
        try:
            with open(os.path.join(out, "config.json")) as f:
                plots = bool(json.load(f).get("plots", True))
        except (OSError, ValueError, AttributeError):
            plots = True
    selection = select(record)
    columns = headline_columns(record)
    left = [a["name"] for a in record["axes"]] + ["Note"]
    head = report.markdown_table(*table(record, columns, notes=True), left=left)
    every = report.markdown_table(*table(record, [(k, _header(k)) for k in record["keys"]]),
                                  left=left)
    lines = selection_lines(record, selection)
    lost = int(record["diverged"].sum())
    if lost:
        lines.append(f"{lost} of {record['diverged'].size} runs diverged (their parameters "
                     f"became NaN/inf): their grid points read nan and are never selected")
    text = (f"{title(record)}\n\n{head}\n{NOTE}\n\n" + "\n".join(lines)
            + "\n\nEvery summary (mean ± std over seeds):\n\n" + every)
    report._replace_with(os.path.join(out, TABLE_MD), text)
    write_csv(os.path.join(out, TABLE_CSV), record)
    if plots:
        fig = plot_heatmap(record, selection)
        report.save_figure(fig, os.path.join(out, HEATMAP + ".tmp.png"))
        os.replace(os.path.join(out, HEATMAP + ".tmp.png"), os.path.join(out, HEATMAP))
    write_page(out, text)
    if echo:
        print(title(record))
        print()
        print(head, end="")
        print()
        print("\n".join(lines))
    return selection, record


def write_page(out: str, text: str) -> None:
    """The sweep's report.html: sweep.md's ``text`` (its first line the title), the
    heat-map, the command (summary.json's when the folder has one, else this one's) and
    config.json."""
    title, _, body = text.partition("\n\n")
    previous = report.read_json(os.path.join(out, SUMMARY)) or {}
    report._replace_with(os.path.join(out, "report.html"), html.page(
        title, body, figures=[(os.path.join(out, HEATMAP), "the chosen metric over the "
                                                           "grid, mean over seeds")],
        command=previous.get("command") or command_line(),
        reproduce=f"fedjax-fair sweep --config {os.path.join(out, 'config.json')} -o NEW_DIR",
        config=report.read_json(os.path.join(out, "config.json"))))


# ------------------------------------------------------------------ heat-map

MAX_PANELS = 12


def plot_heatmap(record: dict, selection: dict):
    """``record["metric"]`` (mean over seeds) over the first two grid axes, each cell
    annotated; one axis: a line with the std over seeds as error bars; more than two:
    one panel per combination of the others (up to ``MAX_PANELS``), else the best over
    them. The setting selected by validation accuracy is outlined."""
    metric = record["metric"]
    axes = record["axes"]
    shape = tuple(len(a["values"]) for a in axes)
    percent = is_percent(metric)
    scale = 100.0 if percent else 1.0
    mean, std = (v.reshape(shape) * scale for v in aggregate(record["summary"][metric]))
    seeds = len(record["seeds"])
    higher = higher_is_better(metric)
    sel = selection.get("selected")
    chosen = grid_points({a["name"]: a["values"] for a in axes})[sel["point"]] if sel else None
    unit = " (%)" if is_percent(metric) else ""
    over = f"mean over {seeds} seeds" if seeds > 1 else f"seed {record['seeds'][0]}"
    c = record["context"]
    context = (f"{record['algorithm']}, {c['dataset']}, {c['model']}, {c['num_rounds']} rounds, "
               f"{over}; {'higher' if higher else 'lower'} is better"
               + ("; box: selected by validation accuracy" if chosen else ""))
    if len(axes) == 1:
        return _line_plot(axes[0], mean, std, seeds, metric + unit, chosen, context, percent)
    rest = axes[2:]
    panels = [()] if not rest else list(itertools.product(*[range(len(a["values"]))
                                                            for a in rest]))
    if len(panels) > MAX_PANELS:  # the best over the remaining axes
        flat = mean.reshape(shape[:2] + (-1,))
        with np.errstate(invalid="ignore"):
            best = (np.nanmax if higher else np.nanmin)(np.where(
                np.isfinite(flat), flat, np.nan), axis=2) if np.isfinite(flat).any() else \
                flat[..., 0]
        names = ", ".join(a["name"] for a in rest)
        fig = _new_grid_figure(1, shape)
        ax = fig.add_subplot(1, 1, 1)
        image = _heat(ax, axes[0], axes[1], best, None, seeds, higher, None, *_limits(best),
                      percent)
        fig.colorbar(image, ax=ax, label=metric + unit, shrink=0.9)
        _suptitle(fig, f"{metric}{unit}: the {'highest' if higher else 'lowest'} over "
                       f"{names}", context)
        return fig
    lo, hi = _limits(mean)
    fig = _new_grid_figure(len(panels), shape)
    ncols = min(len(panels), 3)
    nrows = -(-len(panels) // ncols)
    drawn = []
    for j, idx in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, j + 1)
        drawn.append(ax)
        sub = (slice(None), slice(None)) + tuple(idx)
        mark = None
        if chosen is not None and tuple(chosen[2:]) == tuple(idx):
            mark = chosen[:2]
        image = _heat(ax, axes[0], axes[1], mean[sub], std[sub], seeds, higher, mark, lo, hi,
                      percent)
        if rest:
            ax.set_title(", ".join(f"{a['name']}={_show(a['values'][i])}"
                                   for a, i in zip(rest, idx)), fontsize="medium")
    fig.colorbar(image, ax=drawn, label=metric + unit, shrink=0.9)  # one scale for all
    panels_text = (f", one panel per {', '.join(a['name'] for a in rest)}" if rest else "")
    _suptitle(fig, f"{metric}{unit} over {axes[0]['name']} x {axes[1]['name']}{panels_text}",
              context)
    return fig


def _suptitle(fig, text: str, context: str) -> None:
    """The figure's title and context, the context wrapped to the figure's width."""
    import textwrap
    width = max(40, int(fig.get_figwidth() * 11))
    fig.suptitle(report._title(text, "\n".join(textwrap.wrap(context, width))),
                 fontsize="medium")


def _new_grid_figure(panels: int, shape: tuple):
    ncols = min(panels, 3)
    nrows = -(-panels // ncols)
    cell_w = max(4.2, 0.9 * shape[1] + 2.4)
    cell_h = max(3.4, 0.6 * shape[0] + 1.8)
    return report._new_figure((min(ncols * cell_w, 20.0), min(nrows * cell_h + 1.0, 24.0)))


def _cell(value: float, percent: bool) -> str:
    """A heat-map cell's number: percentages with one decimal, else 3 significant
    digits."""
    return f"{value:.1f}" if percent else f"{value:.3g}"


def _limits(values: np.ndarray) -> tuple[float, float]:
    """The colour scale of the finite ``values`` (a flat one widened to be drawable)."""
    finite = values[np.isfinite(values)]
    if not finite.size:
        return 0.0, 1.0
    lo, hi = float(finite.min()), float(finite.max())
    if hi - lo < 1e-12:
        pad = max(abs(lo) * 0.05, 0.5)
        return lo - pad, hi + pad
    return lo, hi


def _heat(ax, row_axis, col_axis, mean, std, seeds, higher, mark, lo, hi, percent):
    """One heat-map on ``ax`` (rows: ``row_axis``, columns: ``col_axis``), every cell
    annotated with its mean (and std over seeds), ``mark`` (row, column) outlined;
    returns the image (for the colour bar)."""
    from matplotlib import colormaps
    from matplotlib.patches import Rectangle
    cmap = colormaps["viridis" if higher else "viridis_r"].with_extremes(bad="lightgrey")
    values = np.ma.masked_invalid(mean)
    image = ax.imshow(values, cmap=cmap, vmin=lo, vmax=hi, aspect="auto")
    rows, cols = mean.shape
    small = rows * cols > 64
    for i in range(rows):
        for j in range(cols):
            v = mean[i, j]
            text = "nan" if not np.isfinite(v) else _cell(v, percent)
            if std is not None and seeds > 1 and np.isfinite(v) and not small:
                text += "\n±" + _cell(std[i, j], percent)
            shade = (v - lo) / (hi - lo) if np.isfinite(v) and hi > lo else 0.5
            dark = (shade < 0.55) if higher else (shade > 0.45)
            ax.text(j, i, text, ha="center", va="center", fontsize=7 if small else 8.5,
                    color="white" if dark and np.isfinite(v) else "black")
    if mark is not None:
        ax.add_patch(Rectangle((mark[1] - 0.5, mark[0] - 0.5), 1, 1, fill=False,
                               edgecolor="red", linewidth=2.2))
    ax.set_xticks(range(cols), [_show(v) for v in col_axis["values"]])
    ax.set_yticks(range(rows), [_show(v) for v in row_axis["values"]])
    ax.set_xlabel(col_axis["name"])
    ax.set_ylabel(row_axis["name"])
    return image


def _line_plot(axis, mean, std, seeds, label, chosen, context, percent):
    fig = report._new_figure((max(5.5, 0.8 * len(axis["values"]) + 3.0), 4.2))
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(len(axis["values"]))
    ax.errorbar(x, mean, yerr=std if seeds > 1 else None, marker="o", capsize=4,
                linewidth=1.6)
    for xi, v in zip(x, mean):
        if np.isfinite(v):
            ax.annotate(_cell(v, percent), (xi, v), textcoords="offset points",
                        xytext=(0, 7), ha="center", fontsize=8.5)
    if chosen is not None:
        ax.plot([chosen[0]], [mean[chosen[0]]], marker="s", markersize=13, fillstyle="none",
                color="red", linestyle="none", label="selected by validation accuracy")
        report._legend(ax, fontsize="small")
    ax.set_xticks(x, [_show(v) for v in axis["values"]])
    ax.set_xlabel(axis["name"])
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    bars = " (bars: std over seeds)" if seeds > 1 else ""
    _suptitle(fig, f"{label} over {axis['name']}{bars}", context)
    return fig
