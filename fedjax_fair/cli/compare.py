"""``fedjax-fair compare``: several algorithms x seeds on the same data and budget,
each run resumable; the table and plots of the finished runs are
``fedjax_fair.reports.compare``'s, written at the end (and by ``fedjax-fair report``)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import time
from typing import Optional

import jax
import numpy as np

from fedjax_fair.algorithms import REGISTRY, base_name
from fedjax_fair.hparams import FieldError
from fedjax_fair import reports as report
from fedjax_fair.cli import config as C, lock, tracked, transforms
from fedjax_fair.core import interrupts
from fedjax_fair.reports import compare as comparison
from fedjax_fair.cli.common import (EXIT_INTERRUPTED, EXIT_NONFINITE, _check_capacity,
                                    _check_recorded, _err, _has_test, _is_primary,
                                    _method_report, _ordered_config, _other_process, _own,
                                    _preflight, _record_inputs, _resumable_config,
                                    _seeded, _STAGE,
                                    _STAGE_DIR, _write_client_history, build_algorithm,
                                    benign_clients, build_dataset, build_model,
                                    check_interrupted, command_line, execution_of,
                                    for_method, simulate_one,
                                    system_of, write_run_outputs)
from fedjax_fair.scenarios import sampling
from fedjax_fair.cli.parsing import parse_budgets
from fedjax_fair.drivers.runner import verify_resumable
from fedjax_fair.drivers.spec import holds_rows_outside
from fedjax_fair.drivers import sweeps


def compare_config(args: argparse.Namespace):
    """The CompareConfig of ``compare``: with ``--resume``, the interrupted comparison's
    config.json <- the config file <- flags (which may only change progress / plots)."""
    return _resumable_config(args, C.CompareConfig, C.COMPARE_RESUMABLE, "comparison")


def cmd_compare(args) -> int:
    cfg = _other_process(compare_config(args))
    every = not cfg.algorithms  # the default list: methods that refuse the model are left out
    hparams = C.validate_compare(cfg)
    if getattr(cfg, "saved_config", None):
        _check_recorded(*cfg.saved_config)
    out = cfg.resolved_output_dir()
    cfg_dict = _ordered_config(cfg)
    cfg_dict["output_dir"] = out
    _record_inputs(cfg, cfg_dict)  # the input files' contents (checked on --resume)

    ds = build_dataset(cfg)
    check_interrupted()  # safe points: a signal whose KeyboardInterrupt a callback lost
    C.validate_against_data(cfg, ds.num_clients, ds.host_data.train.num_examples)
    for a in cfg.algorithms:
        C.check_data_range(a, hparams[a], ds.host_data.train, f"hparams[{a}]")
    model = build_model(cfg, ds)
    for batch in sorted({for_method(cfg, a).batch_size for a in cfg.algorithms}):
        _preflight(dataclasses.replace(cfg, batch_size=batch), ds, model)
    system = system_of(cfg, ds)
    if system is not None:
        print(f"system: {system.describe()}")
    algs = {}
    for a in cfg.algorithms:
        try:
            algs[a] = build_algorithm(a, model, cfg, hparams[a], ds)
        except C.ConfigError as e:
            if not every:
                raise
            print(f"left out {a}: {e}")  # e.g. LG-FedAvg on a one-layer model
    cfg.algorithms = cfg_dict["algorithms"] = list(algs)
    print(_training_line(cfg))
    cfg_dict["scenarios"] = transforms.announce(cfg, algs)
    for alg in algs.values():
        _check_capacity(alg, ds.num_clients, cfg)
    if cfg.tune:  # every search checked before anything is written
        from fedjax_fair.cli import tune
        searches = tune.check(cfg, {a: hparams[a] for a in algs}, out, model, ds)

    from tqdm.auto import tqdm
    from fedjax_fair.drivers.runner import (Interrupted, NonFiniteError, stop_on_signals,
                                            stop_requested)
    check_interrupted()  # before the first write
    _own(cfg, _is_primary(), check_fresh=True)
    if not cfg.resume:
        cfg_dict["fingerprint"] = lock.fingerprint(cfg_dict)
        report.write_json(os.path.join(out, "config.json"), cfg_dict)
        lock.record(out, cfg_dict)
        tracked.discard(out)  # --overwrite: the earlier runs' dashboards go too
    if cfg.tune:  # each method searched on a validation split, then run at its selection
        try:
            with stop_on_signals():
                records = tune.search(cfg, searches, out)
        except (Interrupted, KeyboardInterrupt):
            _err(f"interrupted while tuning: every finished call of the searches is saved in "
                 f"{os.path.join(out, tune.TUNE_DIR)}; continue with: fedjax-fair compare -o "
                 f"{out} --resume")
            return EXIT_INTERRUPTED
        hparams = tune.tuned_hparams(hparams, records)
        algs = {a: build_algorithm(a, model, cfg, hparams[a], ds) for a in algs}
    t_start = time.perf_counter()
    total_runs = len(algs) * len(cfg.seeds)
    bar = tqdm(total=total_runs, desc="compare", unit="run", dynamic_ncols=True,
               disable=not (cfg.progress and sys.stderr.isatty()))  # no \r floods in logs
    planned: list = []

    def log_first(line):  # the memory plan of the first run stands for all of them
        if not planned:
            planned.append(line)
            print(line)

    interrupted, finished = False, 0
    try:
        with stop_on_signals():
            check_interrupted()  # before the runs
            for name, alg in algs.items():
                found = {s: (comparison.finished_run(os.path.join(out, name, f"seed{s}"))
                             if cfg.resume else None) for s in cfg.seeds}
                missing = [s for s in cfg.seeds if found[s] is None]
                started = {s: _started_round(os.path.join(out, name, f"seed{s}"), alg, model,
                                             ds, cfg.eval_clients) if cfg.resume else 0
                           for s in missing}
                started = _in_step(out, name, started)
                for start in sorted(set(started.values())):  # seeds of one round together
                    group = [s for s in missing if started[s] == start]
                    if _seeds_fallback(name, cfg, group, ds, model, alg) is None:
                        if stop_requested():
                            raise Interrupted(0)
                        bar.set_postfix(algorithm=name, seeds=",".join(map(str, group)))
                        found.update(_compare_seeds(name, alg, group, out, cfg, cfg_dict,
                                                    hparams[name], model, ds, log=log_first,
                                                    resume=start > 0))
                for seed in cfg.seeds:
                    if found[seed] is None:
                        if stop_requested():
                            raise Interrupted(0)
                        bar.set_postfix(algorithm=name, seed=seed)
                        _compare_one(name, _seeded(name, alg, model, cfg, hparams[name], seed, ds),
                                     seed, os.path.join(out, name, f"seed{seed}"), cfg,
                                     cfg_dict, hparams[name], model, ds, NonFiniteError,
                                     log=log_first, resume=started[seed] > 0)
                    finished += 1
                    bar.update(1)
    except (Interrupted, KeyboardInterrupt):
        interrupted = True
        interrupts.clear()  # honoured: the table of the finished runs is written next
    bar.close()
    _STAGE_DIR.append(out)
    _STAGE.append(f"while writing the comparison's table and plots to {out}; its "
                  f"summary.json (written last) is not written; the {finished} finished "
                  f"runs are saved; write them again with: fedjax-fair compare -o {out} "
                  f"--resume")
    if not interrupted:
        check_interrupted()  # e.g. a signal during the last run's last chunk
    code = _write_comparison(out, cfg_dict, time.perf_counter() - t_start,
                             print_table=not interrupted, command=command_line())
    if interrupted:
        from fedjax_fair.drivers import checkpoint as ckpt
        partly = sum(ckpt.latest(os.path.join(out, a, f"seed{s}", "checkpoint")) is not None
                     and not os.path.isfile(os.path.join(out, a, f"seed{s}", "summary.json"))
                     for a in algs for s in cfg.seeds)
        _err(f"interrupted: {finished} of {total_runs} runs finished and saved in {out} "
             f"(comparison.md holds them)"
             + (f", {partly} more committed part-way (each in its checkpoint folder)"
                if partly else "")
             + f"; continue with: fedjax-fair compare -o {out} --resume")
        return EXIT_INTERRUPTED
    return code


def _training_line(cfg) -> str:
    """One line saying which local training each method runs: the flags given, else
    each method's own (grouped by value)."""
    groups: dict = {}
    for a in cfg.algorithms:
        m = for_method(cfg, a)
        groups.setdefault((m.client_lr, m.batch_size, m.num_epochs), []).append(a)
    given = [f"--{f.replace('_', '-')}" for f in ("client_lr", "batch_size", "num_epochs")
             if getattr(cfg, f) is not None]
    largest = max(groups, key=lambda k: len(groups[k]))

    def label(key, names) -> str:
        return "the others" if key == largest and 1 < len(groups) and 1 < len(names) else \
            ", ".join(names)

    text = "; ".join(f"{label(k, names)}: lr {k[0]:g}, batch {k[1]}, "
                     f"{k[2]} epoch{'s' * (k[2] > 1)}"
                     for k, names in sorted(groups.items(), key=lambda kv: kv[0] == largest))
    source = ("each method's own" if not given else f"{', '.join(given)}" if len(given) == 3
              else f"{', '.join(given)}; the rest each method's own")
    return f"local training ({source}): {text}"


def _round_rows(rounds: dict) -> list:
    """rounds.jsonl's rows of a run's per-round metrics (none when no round ran)."""
    return report.round_rows(0, rounds) if rounds else []


def _in_step(out: str, name: str, started: dict) -> dict:
    """``started`` with every seed that committed ahead of the others rolled back to
    their earliest round (``checkpoint.roll_back``), where its checkpoint still holds
    that save: the seeds then resume as the one program the uninterrupted comparison
    ran, bit for bit (a program of fewer seeds rounds some methods differently). A
    seed whose save of that round is gone keeps its own round."""
    from fedjax_fair.drivers import checkpoint as ckpt
    if len(set(started.values())) < 2:
        return started
    common = min(started.values())
    out_started = dict(started)
    for seed, start in started.items():
        directory = os.path.join(out, name, f"seed{seed}", "checkpoint")
        if start > common and ckpt.roll_back(directory, common):
            out_started[seed] = common
    return out_started


def _started_round(run_dir: str, alg, model, ds, eval_clients=None) -> int:
    """The round a comparison's unfinished run has committed in its checkpoint
    (``run_dir/checkpoint``), 0 when it has none or one it cannot continue from (the
    run then starts again, and its first commit replaces that checkpoint)."""
    directory = os.path.join(run_dir, "checkpoint")
    if not os.path.isdir(directory):
        return 0
    template = jax.eval_shape(lambda k: alg.init(model.init(k), ds.num_clients),
                              jax.random.key(0))
    try:
        return int(verify_resumable(directory, template, ds.num_clients,
                                    eval_clients)["round"])
    except (OSError, ValueError):
        return 0


def _compare_one(name, alg, seed, run_dir, cfg, cfg_dict, hparams, model, ds, NonFiniteError,
                 log=print, resume=False):
    """One run of a comparison, committed to ``run_dir/checkpoint`` every
    ``cfg.commit_seconds`` (``resume``: continued from there) and written to
    ``run_dir`` as soon as it ends (diverged runs keep their metrics.jsonl); returns
    what ``comparison.finished_run`` would read back."""
    cfg = for_method(cfg, name)
    try:
        res = simulate_one(alg, model, ds, cfg, seed, progress=cfg.progress,
                           description=f"{name} seed {seed}", log=log,
                           checkpoint_dir=os.path.join(run_dir, "checkpoint"), resume=resume,
                           commit_seconds=cfg.commit_seconds)
    except NonFiniteError as e:
        return _tracked(cfg, name, seed, run_dir, _write_compare_run(
            name, alg, seed, run_dir, cfg_dict, hparams, model, ds, None, e.history,
            _round_rows(e.rounds), (e.round, e.last_good_round)))
    return _tracked(cfg, name, seed, run_dir, _write_compare_run(
        name, alg, seed, run_dir, cfg_dict, hparams, model, ds, res, res.history,
        _round_rows(res.rounds)), res.client_history)


def _tracked(cfg, name, seed, run_dir, written, client_history=None):
    """Logs a run ``_write_compare_run`` has ``written`` to ``--tracker`` (as
    ``NAME/seedS`` under the comparison's folder); returns ``written``."""
    summary, history, _ = written
    tracked.log_run(cfg, os.path.dirname(os.path.dirname(run_dir)), f"{name}/seed{seed}",
                    summary["config"], history, client_history, resume=cfg.resume)
    return written


def _write_compare_run(name, alg, seed, run_dir, cfg_dict, hparams, model, ds, res, entries,
                       rounds, non_finite=None):
    """Writes one run of a comparison to ``run_dir``: the finished run ``res``, or,
    with ``non_finite = (round, last_good_round)``, a diverged run's evaluations
    ``entries`` and rounds; its summary.json last (the run's commit), then removes the
    run's checkpoint. Returns what ``comparison.finished_run`` would read back."""
    summary, history, acc = _write_compare_outputs(name, alg, seed, run_dir, cfg_dict,
                                                   hparams, model, ds, res, entries, rounds,
                                                   non_finite)
    shutil.rmtree(os.path.join(run_dir, "checkpoint"), ignore_errors=True)
    return summary, history, acc


def _write_compare_outputs(name, alg, seed, run_dir, cfg_dict, hparams, model, ds, res,
                           entries, rounds, non_finite):
    run_cfg = {**cfg_dict, "algorithm": name, "hparams": hparams, "seed": seed,
               "output_dir": run_dir}
    for k in ("algorithms", "seeds", "sweep_seeds"):
        run_cfg.pop(k, None)
    os.makedirs(run_dir, exist_ok=True)
    try:  # a run being redone is not finished until its summary.json is written again
        os.remove(os.path.join(run_dir, "summary.json"))
    except FileNotFoundError:
        pass
    if non_finite is not None:
        report.write_jsonl(os.path.join(run_dir, "metrics.jsonl"), entries)
        report.write_jsonl(os.path.join(run_dir, "rounds.jsonl"), rounds)
        summary = {"status": "non_finite", "config": run_cfg, "evaluated": alg.evaluates,
                   "non_finite_round": non_finite[0], "last_good_round": non_finite[1]}
        report.write_json(os.path.join(run_dir, "summary.json"), summary)
        return summary, entries, None
    # the run's commit is its summary.json, which write_run_outputs writes last
    report.write_jsonl(os.path.join(run_dir, "rounds.jsonl"), rounds)
    _write_client_history(run_dir, res)
    summary = write_run_outputs(run_dir, run_cfg, ds, model, res, plots=False, page=False,
                                extra=_method_report(name, model, alg, res, ds))
    acc = np.asarray(res.client_metrics["accuracy"])[_has_test(res.client_metrics)]
    return summary, res.history, acc


def _seeds_fallback(name: str, cfg, seeds: list, ds, model, alg=None) -> Optional[str]:
    """Why ``compare`` runs ``name``'s ``seeds`` one ``runner.run`` each instead of as one
    program (``_compare_seeds``), or None when one program runs them all."""
    if not cfg.sweep_seeds:
        return "sweep_seeds is off"
    if len(seeds) < 2:
        return "one seed to run"
    if REGISTRY[base_name(name)].generative:
        return "a generative method (per-seed synthetic sets, written per run)"
    if execution_of(for_method(cfg, name), ds, model).mesh is not None:
        return "a device mesh (runner.run splits each cohort over the devices)"
    if cfg.placement == "host":
        return "placement host (runner.run streams each chunk's cohorts)"
    if cfg.eval_clients is not None and cfg.eval_clients < ds.num_clients:
        return "eval_clients (runner.run evaluates a subset between chunks)"
    if alg is not None and holds_rows_outside(alg, model, ds.num_clients):
        return "a host or disk client table (runner.run keeps its rows)"
    return None


def _compare_seeds(name, alg, seeds, out, cfg, cfg_dict, hparams, model, ds, log=print,
                   resume=False) -> dict:
    """The runs of ``name`` for ``seeds`` as one program (``sweeps.run_seeds``: vmapped
    on accelerators, one compiled program called per seed on CPU), each committed to
    its run directory's checkpoint every ``cfg.commit_seconds`` (``resume``: every seed
    continues from there, all at one round) and written to its run directory as
    ``_compare_one`` writes it; ``{seed: what comparison.finished_run reads back}``,
    or {} when the program does not fit the device (the caller then runs each seed
    with ``runner.run``, which streams cohorts from the host)."""
    run_dirs = [os.path.join(out, name, f"seed{seed}") for seed in seeds]
    cfg = for_method(cfg, name)
    runs = sweeps.run_seeds(
        alg, model, ds.host_data, seeds, num_rounds=cfg.num_rounds,
        cohort_size=cfg.cohort_size, eval_every=cfg.eval_every,
        sampler=sampling.get(cfg.sampler, ds.host_data.train.num_examples),
        execution=execution_of(cfg, ds, model),
        step_budgets=parse_budgets(cfg.step_budgets, cfg.batch_size),
        inits=[_seeded(name, alg, model, cfg, hparams, s, ds).init for s in seeds], log=log,
        checkpoint_dirs=[os.path.join(d, "checkpoint") for d in run_dirs], resume=resume,
        commit_seconds=cfg.commit_seconds, progress=cfg.progress,
        description=f"{name} seeds {','.join(map(str, seeds))}", system=system_of(cfg, ds),
        summary_clients=benign_clients(cfg, ds))
    if runs is None:
        return {}
    return {seed: _tracked(cfg, name, seed, run_dir, _write_compare_run(
                name, alg, seed, run_dir, cfg_dict, hparams, model, ds, res, res.history,
                _round_rows(rounds), bad), None if bad else res.client_history)
            for seed, run_dir, res, rounds, bad in zip(seeds, run_dirs, runs.results,
                                                       runs.rounds, runs.non_finite)}


def _write_comparison(out, cfg_dict, seconds, print_table=True, command=None) -> int:
    """``comparison.write_comparison`` of the runs ``out`` holds (printing the table
    with ``print_table``); its exit status: ``EXIT_NONFINITE`` when a run diverged (the
    table printed, then the diverged runs as an error line), else 0."""
    summary = comparison.write_comparison(out, cfg_dict, seconds, echo=print_table,
                                          command=command)
    return _status(summary["notes"]) if print_table else 0


def rebuild(out_dir: str) -> int:
    """``fedjax-fair report`` of a comparison folder: ``comparison.rebuild``, its
    errors as ``ConfigError``s, its exit status as ``_write_comparison``'s."""
    try:
        summary = comparison.rebuild(out_dir)
    except FieldError as e:
        raise C.config_error(e, "output_dir") from None
    return _status(summary["notes"])


def _status(notes: dict) -> int:
    """The exit status of a comparison whose diverged runs are ``notes``."""
    if notes:
        _err("non-finite parameters (NaN/inf) in " + "; ".join(f"{a}: {n}"
                                                                for a, n in notes.items()))
        return EXIT_NONFINITE
    return 0
