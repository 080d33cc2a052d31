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
from fedjax_fair.cli.common import (EXIT_INTERRUPTED, _check_capacity, _check_recorded, _err,
                                    _ordered_config, _own, _preflight, _record_inputs,
                                    _resumable_config,
                                    _STAGE, _STAGE_DIR, build_algorithm, build_dataset,
                                    build_model, check_interrupted, command_line,
                                    dataset_description, for_method)
from fedjax_fair.scenarios import sampling
from fedjax_fair.core.evaluation import make_evaluator
from fedjax_fair.cli.parsing import parse_budgets
from fedjax_fair.drivers import sweeps
from fedjax_fair.hparams import FieldError
from fedjax_fair.reports.sweep import (HEATMAP, PARTS, RUNS, SUMMARY, TABLE_CSV, TABLE_MD,
                                       VALIDATION, _base, _point_hparams, _rebuild, _setting,
                                       _show, grid_points)



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
        if isinstance(saved, dict) and ("grid" not in saved or "algorithms" in saved):
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


def check_select(select: str, keys: list) -> None:
    """``--select`` names a validation summary (``validation_`` + it is one of
    ``keys``' when the data has a validation split)."""
    names = [k[len(VALIDATION):] for k in keys if k.startswith(VALIDATION)]
    if names and select not in names:
        raise C.ConfigError("select", f"unknown summary {select!r}; allowed: "
                                      f"{', '.join(names)}")


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
    check_interrupted()  # safe points: a signal whose KeyboardInterrupt a callback lost
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
    check_select(cfg.select, keys)
    return Plan(ds, model, programs, continuous, keys, validation, evaluated,
                tiles_of(cfg, continuous), alg)


def cmd_sweep(args) -> int:
    if getattr(args, "distributed", False):
        raise C.ConfigError("distributed", "a sweep runs in one process on one device; drop "
                                           "--distributed")
    return execute(sweep_config(args))


def execute(cfg: C.SweepConfig, *, reraise: bool = False) -> int:
    """The sweep of a built ``SweepConfig`` (``cmd_sweep``'s, and each method's search
    of ``compare --tune``): validated, planned, run and written; the exit status.
    ``reraise``: an interrupt propagates (the caller says how to continue) instead of
    ending the sweep with its own line."""
    hparams = C.validate_sweep(cfg)
    if getattr(cfg, "saved_config", None):
        _check_recorded(*cfg.saved_config)
    from fedjax_fair.cli.run import _persistent_compilation_cache
    _persistent_compilation_cache()
    out = cfg.resolved_output_dir()
    cfg_dict = _ordered_config(cfg)
    cfg_dict["output_dir"] = out
    _record_inputs(cfg, cfg_dict)  # the input files' contents (checked on --resume)
    cfg_dict["fingerprint"] = lock.fingerprint(cfg_dict)
    p = plan(cfg, hparams)
    print(programs_line(cfg, p.programs, p.tiles.count, p.tiles.g * p.tiles.s))
    from fedjax_fair.cli import transforms
    cfg_dict["scenarios"] = transforms.announce(cfg, {cfg.algorithm: p.algorithm})[
        cfg.algorithm]

    check_interrupted()  # before the first write (the programs are traced by now)
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
        if reraise:
            raise
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
        check_interrupted()  # before the first call
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
    check_interrupted()  # e.g. a signal during the last call (it ended the sweep)
    _remove(os.path.join(out, SUMMARY))  # the commit of the outputs written below
    record = runs_record(cfg, p.ds, p.programs, results, p.keys, p.validation, p.evaluated)
    report.write_json(os.path.join(out, RUNS), record)
    track(cfg, cfg_dict, record, results)
    selection, shown = _rebuild(out, plots=cfg.plots, echo=True, command=command_line())
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
            "seeds": list(cfg.seeds), "metric": cfg.metric, "select": cfg.select,
            "validation": validation,
            "keys": keys, "summary": summary}


def rebuild(out_dir: str, *, plots=None, echo: bool = True) -> None:
    """``reports.sweep.rebuild`` of a sweep folder, its errors as ``ConfigError``s."""
    from fedjax_fair.reports import sweep as tables
    try:
        tables.rebuild(out_dir, plots=plots, echo=echo, command=command_line())
    except FieldError as e:
        raise C.config_error(e, "output_dir") from None
