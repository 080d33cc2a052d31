"""``fedjax-fair compare``: several algorithms x seeds on the same data and budget,
each run resumable, the table and plots of the finished runs."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from typing import NamedTuple, Optional

import jax
import numpy as np

from fedjax_fair.algorithms import FAMILIES, REGISTRY, base_name
from fedjax_fair import reports as report
from fedjax_fair.cli import config as C, lock, tracked, transforms
from fedjax_fair.reports import html
from fedjax_fair.cli.common import (EXIT_INTERRUPTED, EXIT_NONFINITE, _check_capacity,
                                    _check_recorded, _err, _has_test, _is_primary,
                                    _method_report, _ordered_config, _other_process, _own,
                                    _preflight, _resumable_config, _seeded, _STAGE,
                                    _STAGE_DIR, _write_client_history, build_algorithm,
                                    benign_clients, build_dataset, build_model,
                                    command_line, execution_of, for_method, simulate_one,
                                    system_of, write_run_outputs)
from fedjax_fair.scenarios import sampling
from fedjax_fair.cli.parsing import parse_budgets
from fedjax_fair.drivers.runner import verify_resumable
from fedjax_fair.drivers import sweeps


def compare_config(args: argparse.Namespace):
    """The CompareConfig of ``compare``: with ``--resume``, the interrupted comparison's
    config.json <- the config file <- flags (which may only change progress / plots)."""
    return _resumable_config(args, C.CompareConfig, C.COMPARE_RESUMABLE, "comparison")


def _improved_curve(run_dir: str):
    """The per-round improved fraction of a run directory's rounds.jsonl, or None."""
    path = os.path.join(run_dir, "rounds.jsonl")
    if not os.path.isfile(path):
        return None
    rows = report.read_jsonl(path)
    values = [r["improved_fraction"] for r in rows if "improved_fraction" in r]
    return np.asarray(values) if values else None


def _finished_run(run_dir: str):
    """(summary, history, accuracies) of a run a comparison already wrote, or None
    when it is not finished: ``summary.json``, written last (``_write_compare_run``),
    is missing, unreadable or not a run's summary, or an output it commits is missing
    or unreadable (metrics.jsonl; for a finished run also rounds.jsonl, clients.csv
    and clients_over_time.npz with one row per evaluation). ``compare --resume`` then
    runs it again."""
    import zipfile
    import zlib
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
        if not isinstance(summary, dict) or summary.get("status") not in ("ok",
                                                                          "non_finite"):
            return None
        ok = summary["status"] == "ok"
        if ok and not isinstance(summary.get("final"), dict):
            return None
        history = report.read_jsonl(os.path.join(run_dir, "metrics.jsonl"), strict=True)
        acc = None
        if ok:
            report.read_jsonl(os.path.join(run_dir, "rounds.jsonl"), strict=True)
            with np.load(os.path.join(run_dir, "clients_over_time.npz")) as z:
                if not history or "round" not in z.files or len(z["round"]) != len(history):
                    return None
            table = report.read_client_csv(os.path.join(run_dir, "clients.csv"))
            acc = table["accuracy"][table["num_test_examples"] > 0]
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile,
            zlib.error):
        return None
    return summary, history, acc


def cmd_compare(args) -> int:
    cfg = _other_process(compare_config(args))
    every = not cfg.algorithms  # the default list: methods that refuse the model are left out
    hparams = C.validate_compare(cfg)
    if getattr(cfg, "saved_config", None):
        _check_recorded(*cfg.saved_config)
    out = cfg.resolved_output_dir()
    cfg_dict = _ordered_config(cfg)
    cfg_dict["output_dir"] = out

    ds = build_dataset(cfg)
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

    from tqdm.auto import tqdm
    from fedjax_fair.drivers.runner import (Interrupted, NonFiniteError, stop_on_signals,
                                            stop_requested)
    _own(cfg, _is_primary(), check_fresh=True)
    if not cfg.resume:
        cfg_dict["fingerprint"] = lock.fingerprint(cfg_dict)
        report.write_json(os.path.join(out, "config.json"), cfg_dict)
        lock.record(out, cfg_dict)
        tracked.discard(out)  # --overwrite: the earlier runs' dashboards go too
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
            for name, alg in algs.items():
                found = {s: (_finished_run(os.path.join(out, name, f"seed{s}")) if cfg.resume
                             else None) for s in cfg.seeds}
                missing = [s for s in cfg.seeds if found[s] is None]
                started = {s: _started_round(os.path.join(out, name, f"seed{s}"), alg, model,
                                             ds) if cfg.resume else 0 for s in missing}
                for start in sorted(set(started.values())):  # seeds of one round together
                    group = [s for s in missing if started[s] == start]
                    if _seeds_fallback(name, cfg, group, ds, model) is None:
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
    bar.close()
    _STAGE_DIR.append(out)
    _STAGE.append(f"while writing the comparison's table and plots to {out}; its "
                  f"summary.json (written last) is not written; the {finished} finished "
                  f"runs are saved; write them again with: fedjax-fair compare -o {out} "
                  f"--resume")
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


def _started_round(run_dir: str, alg, model, ds) -> int:
    """The round a comparison's unfinished run has committed in its checkpoint
    (``run_dir/checkpoint``), 0 when it has none or one it cannot continue from (the
    run then starts again, and its first commit replaces that checkpoint)."""
    directory = os.path.join(run_dir, "checkpoint")
    if not os.path.isdir(directory):
        return 0
    template = jax.eval_shape(lambda k: alg.init(model.init(k), ds.num_clients),
                              jax.random.key(0))
    try:
        return int(verify_resumable(directory, template, ds.num_clients)["round"])
    except (OSError, ValueError):
        return 0


def _compare_one(name, alg, seed, run_dir, cfg, cfg_dict, hparams, model, ds, NonFiniteError,
                 log=print, resume=False):
    """One run of a comparison, committed to ``run_dir/checkpoint`` every
    ``cfg.commit_seconds`` (``resume``: continued from there) and written to
    ``run_dir`` as soon as it ends (diverged runs keep their metrics.jsonl); returns
    what ``_finished_run`` would read back."""
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
    run's checkpoint. Returns what ``_finished_run`` would read back."""
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


def _seeds_fallback(name: str, cfg, seeds: list, ds, model) -> Optional[str]:
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
    return None


def _compare_seeds(name, alg, seeds, out, cfg, cfg_dict, hparams, model, ds, log=print,
                   resume=False) -> dict:
    """The runs of ``name`` for ``seeds`` as one program (``sweeps.run_seeds``: vmapped
    on accelerators, one compiled program called per seed on CPU), each committed to
    its run directory's checkpoint every ``cfg.commit_seconds`` (``resume``: every seed
    continues from there, all at one round) and written to its run directory as
    ``_compare_one`` writes it; ``{seed: what _finished_run reads back}``, or {} when
    the program does not fit the device (the caller then runs each seed with
    ``runner.run``, which streams cohorts from the host)."""
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


class Finished(NamedTuple):
    """What a comparison folder holds of its runs (``load_runs``): per algorithm, the
    finished seeds' table columns, histories and per-client accuracies, diverged runs'
    notes, each algorithm's evaluation ("global" / "personal") and the dataset."""

    summaries: dict
    histories: dict
    accuracies: dict
    notes: dict
    evaluated: dict
    dataset: dict


def load_runs(out: str, algorithms: list, seeds: list) -> Finished:
    """The finished runs of the comparison in ``out`` (``_finished_run`` of each
    ``out/ALGORITHM/seedS``): the one source of its table, figures and report, whether
    ``compare`` has just run them or ``fedjax-fair report`` reads a folder again."""
    summaries = {a: [] for a in algorithms}
    histories = {a: [] for a in algorithms}
    accuracies = {a: [] for a in algorithms}
    notes, evaluated, dataset = {}, {}, None
    for name in algorithms:
        for seed in seeds:
            done = _finished_run(os.path.join(out, name, f"seed{seed}"))
            if done is None:
                continue
            summary, history, acc = done
            evaluated.setdefault(name, summary.get("evaluated", "global"))
            if summary.get("status") == "non_finite":
                note = f"diverged at round {summary['non_finite_round']}"
                note = f"seed {seed} {note}" if len(seeds) > 1 else note
                notes[name] = f"{notes[name]}; {note}" if name in notes else note
                summaries[name].append({})
            else:
                unseen = (summary.get("unseen") or {}).get("final", {})
                summaries[name].append({**summary["final"], **summary["timings"],
                                        **{f"unseen_{k}": v for k, v in unseen.items()}})
                accuracies[name].append(acc)
                dataset = dataset or summary.get("dataset")
            if history:
                histories[name].append(history)
    return Finished(summaries, histories, accuracies, notes, evaluated, dataset or {})


def families_of(names) -> dict:
    """``{name: family}`` of compared names (``NAME@LABEL``: its method's), the
    reference family for a name the registry does not know."""
    return {n: REGISTRY[base_name(n)].family if base_name(n) in REGISTRY else report.REFERENCE
            for n in names}


FIGURES = (("accuracy.png", "average and worst-10% per-client test accuracy over rounds, "
                            "by family, FedAvg dashed in every panel (mean over seeds, band: "
                            "min to max)"),
           ("accuracy_time.png", "the same against simulated time"),
           ("client_accuracy_hist.png", "final per-client test accuracy, one box per "
                                        "method, grouped by family"),
           ("client_accuracy_ecdf.png", "fraction of clients at or below each accuracy, "
                                        "by family"),
           ("lorenz.png", "Lorenz curves of final per-client accuracy, by family"),
           ("improved_clients.png", "share of each round's participants whose training "
                                    "loss did not rise, by family"))


def _write_comparison(out, cfg_dict, seconds, print_table=True, command=None) -> int:
    """comparison.md / .csv, the figures, report.html and, last, summary.json of the
    runs ``out`` holds (``load_runs``); ``fedjax-fair report`` calls it on a finished
    folder, so that both write the same files from the same inputs."""
    try:  # an earlier summary.json would vouch for outputs being rewritten now
        os.remove(os.path.join(out, "summary.json"))
    except FileNotFoundError:
        pass
    algorithms, seeds = list(cfg_dict["algorithms"]), list(cfg_dict["seeds"])
    runs = load_runs(out, algorithms, seeds)
    families = families_of(algorithms)
    done = {a: s for a, s in runs.summaries.items() if s}
    columns = report.table_columns(unseen=bool(cfg_dict.get("unseen_clients")),
                                   dp=cfg_dict.get("dp_noise") is not None
                                   or cfg_dict.get("dp_epsilon") is not None)
    rows = {a: report.aggregate_runs(s, columns) for a, s in done.items()}
    tables = report.family_tables(rows, len(seeds), families, FAMILIES, runs.notes, columns)
    table = report.family_markdown(tables)
    ds = runs.dataset
    where = (f"{ds.get('name', cfg_dict.get('dataset'))}"
             + (f" ({ds['num_clients']} clients)" if "num_clients" in ds else "")
             + f", {cfg_dict.get('model')}, {cfg_dict.get('num_rounds')} rounds, "
               f"cohort {cfg_dict.get('cohort_size')}")
    title = (f"{where}, seeds {','.join(map(str, seeds))}: final per-client test accuracy "
             f"(mean ± std over seeds)" if len(seeds) > 1 else
             f"{where}, seed {seeds[0]}: final per-client test accuracy")
    finished = sum(len(s) for s in runs.summaries.values())
    total_runs = len(algorithms) * len(seeds)
    if finished < total_runs:
        title += f" ({finished} of {total_runs} runs finished)"
    evaluated = {a: runs.evaluated.get(a, "global") for a in algorithms}
    personal = [a for a in algorithms if evaluated[a] == "personal"]
    table_note = report.TABLE_NOTE + (
        " Grouped by family, each led by FedAvg (the reference); in bold, the best value "
        "of each column within the family." if len(tables) > 1 else "") + (
        f" Evaluated on each client's own (personal) model: {', '.join(personal)}; the "
        f"others on the global model." if personal else "") + (
        f" Unseen: the {cfg_dict['unseen_clients']:g} of the clients held out of training "
        f"(--unseen-clients), global models as trained, personalised ones after one round "
        f"of their client procedure; the other columns are over the clients trained on."
        if cfg_dict.get("unseen_clients") else "")
    label = {a: a + (" (personal)" if evaluated[a] == "personal" else "")
             + (" (diverged)" if a in runs.notes else "") for a in algorithms}
    markdown = f"{title}\n\n{table}\n{table_note}\n"
    report.files._replace_with(os.path.join(out, "comparison.md"), markdown)
    report.write_comparison_csv(os.path.join(out, "comparison.csv"), rows, len(seeds),
                                families, columns)
    if cfg_dict.get("plots", True):
        _comparison_figures(out, cfg_dict, runs, label, families, finished, total_runs)
    summary_path = os.path.join(out, "summary.json")
    reproduce = f"fedjax-fair compare --config {os.path.join(out, 'config.json')} -o NEW_DIR"
    report.files._replace_with(os.path.join(out, "report.html"), html.page(
        title, table + "\n" + table_note, figures=[(os.path.join(out, f), c) for f, c in FIGURES],
        command=command, reproduce=reproduce, config=cfg_dict))
    report.write_json(summary_path, {
        "config": cfg_dict, "dataset": ds, "command": command,
        "table": {a: {k: {"mean": m, "std": s} for k, (m, s) in agg.items()}
                  for a, agg in rows.items()},
        "families": families, "evaluated": evaluated, "notes": runs.notes, "labels": label,
        "total_seconds": seconds, "runs_finished": finished, "runs": total_runs})
    if not print_table:
        return 0
    print(title)
    print()
    print(table, end="")
    if personal:
        print(f"(personal models: {', '.join(personal)})")
    print(f"\n{total_runs} runs in {seconds:.1f}s -> {out}")
    if runs.notes:
        _err("non-finite parameters (NaN/inf) in " + "; ".join(f"{a}: {n}"
                                                                for a, n in runs.notes.items()))
        return EXIT_NONFINITE
    return 0


def _comparison_figures(out, cfg_dict, runs: Finished, label, families, finished,
                        total_runs) -> None:
    """The comparison's figures (``FIGURES``), one panel per family group."""
    seeds = list(cfg_dict["seeds"])
    ctx = (f"{runs.dataset.get('name', cfg_dict.get('dataset'))}, {cfg_dict.get('model')}, "
           f"{cfg_dict.get('num_rounds')} rounds, "
           f"seed{'s' if len(seeds) > 1 else ''} {','.join(map(str, seeds))}"
           + (f" ({finished} of {total_runs} runs finished)" if finished < total_runs else ""))
    spent = [h[-1].get("dp_epsilon") for runs_ in runs.histories.values() for h in runs_ if h]
    guards = report.guard_context(cfg_dict, max((e for e in spent if e is not None),
                                                default=None))
    ctx += f"\n{guards}" if guards else ""
    groups = [(t, [label[n] for n in names])
              for t, names in report.family_groups(families, FAMILIES, report.MAX_LINES)]
    refs = [label[n] for n in report.references(families)]
    histories = {label[a]: h for a, h in runs.histories.items()}
    save = lambda fig, name: report.save_figure(fig, os.path.join(out, name))
    save(report.plot_family_accuracy(histories, groups, refs, context=ctx), "accuracy.png")
    timed = [report.CLOCK in h[0][-1] for h in runs.histories.values() if h and h[0]]
    if timed and all(timed):  # every method on a clock (--speeds), not only the async
        save(report.plot_family_accuracy(
            histories, groups, refs, context=ctx, x=report.CLOCK,
            title="Per-client test accuracy against simulated time"), "accuracy_time.png")
    else:  # a rebuilt folder keeps no figure of an earlier configuration
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out, "accuracy_time.png"))
    all_seeds = " (all seeds)" if len(seeds) > 1 else ""
    final = {label[a]: np.concatenate(v) for a, v in runs.accuracies.items() if v}
    whole = [(t, [label[n] for n in names])  # boxes: one group per family, uncut
             for t, names in report.family_groups(families, FAMILIES)]
    save(report.plot_family_boxplots(final, whole, refs, context=ctx,
                                     title="Final per-client test accuracy" + all_seeds),
         "client_accuracy_hist.png")
    save(report.plot_by_family(report.plot_compare_ecdf, final, groups, refs, context=ctx,
                               title="Final per-client test accuracy, ECDF" + all_seeds),
         "client_accuracy_ecdf.png")
    save(report.plot_by_family(report.plot_lorenz, final, groups, refs, context=ctx,
                               title="Lorenz curve of final per-client accuracy" + all_seeds),
         "lorenz.png")
    improved = {label[a]: [c for c in (_improved_curve(os.path.join(out, a, f"seed{s}"))
                                      for s in seeds) if c is not None]
                for a in runs.summaries}
    save(report.plot_by_family(report.plot_improved_fraction,
                               {k: v for k, v in improved.items() if v}, groups, refs,
                               context=ctx, title="Participants whose training loss did "
                                                  "not rise"), "improved_clients.png")
