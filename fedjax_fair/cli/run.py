"""``fedjax-fair run``: one algorithm, one seed, resumable from its checkpoint."""
from __future__ import annotations

import argparse
import json
import os

import jax
import numpy as np

from fedjax_fair.algorithms import REGISTRY, base_name
from fedjax_fair import reports as report
from fedjax_fair.cli import config as C, lock, tracked, transforms
from fedjax_fair.cli.common import (EXIT_INTERRUPTED, EXIT_NONFINITE, _check_capacity,
                                    _check_checkpoint_owner, _check_recorded, _err,
                                    _is_primary, _method_report, _ordered_config,
                                    _other_process, _own, _preflight, _record_inputs,
                                    _resumable_config,
                                    _STAGE, _STAGE_DIR, _write_client_history,
                                    build_algorithm, build_dataset, build_model,
                                    check_interrupted, for_method,
                                    participation_report, simulate_one, write_run_figures,
                                    write_run_outputs, write_run_page)
from fedjax_fair.core.execution import initial_params
from fedjax_fair.drivers import checkpoint as ckpt
from fedjax_fair.drivers.programs import while_compiling
from fedjax_fair.drivers.runner import load_round_log, verify_resumable


def run_config(args: argparse.Namespace):
    """The RunConfig of ``run``: with ``--resume``, the saved run's config.json in the
    output directory <- the config file <- flags, which may only extend the run
    (``config.RESUMABLE``)."""
    return _resumable_config(args, C.RunConfig, C.RESUMABLE, "run")


def cmd_run(args) -> int:
    cfg = _other_process(run_config(args))
    C.validate_run(cfg)
    if getattr(cfg, "saved_config", None):
        _check_recorded(*cfg.saved_config)
    cfg = for_method(cfg, cfg.algorithm)  # recorded as run: the method's own training
    _persistent_compilation_cache()
    out = cfg.resolved_output_dir()
    ckdir = cfg.resolved_checkpoint_dir()
    cfg_dict = _ordered_config(cfg)
    cfg_dict["output_dir"], cfg_dict["checkpoint_dir"] = out, ckdir
    _record_inputs(cfg, cfg_dict)  # the input files' contents (checked on --resume)

    ds = build_dataset(cfg)
    check_interrupted()  # safe points: a signal whose KeyboardInterrupt a callback lost
    C.validate_against_data(cfg, ds.num_clients, ds.host_data.train.num_examples)
    C.check_data_range(cfg.algorithm, cfg.hparams, ds.host_data.train)
    model = build_model(cfg, ds)
    system = _preflight(cfg, ds, model)
    if system is not None:
        print(f"system: {system.describe()}")
    alg = build_algorithm(cfg.algorithm, model, cfg, cfg.hparams, ds)
    cfg_dict["scenarios"] = transforms.announce(cfg, {cfg.algorithm: alg})[cfg.algorithm]
    print(improvement_line(cfg.improvement))
    _check_capacity(alg, ds.num_clients, cfg)
    if cfg.resume:  # nothing in the directory is written before the checkpoint fits
        _verify_checkpoint(ckdir, alg, model, ds.num_clients, cfg.eval_clients)
        _check_checkpoint_owner(cfg, cfg_dict)

    primary = _is_primary()
    branches = list(getattr(cfg, "branches", []))
    kept_rounds = None
    done = None
    kept_metrics = None
    if cfg.resume:  # both logs as of the last commit: what ran after it runs again
        done, kept_metrics, kept_rounds = _committed_logs(ckdir)
    changes = getattr(cfg, "branch_changes", None)
    if changes:
        branches.append({"round": int(done), "changed": {k: C._canonical(v)
                                                          for k, v in changes.items()},
                         "fingerprint": lock.fingerprint(cfg_dict)})
    if branches:
        cfg_dict["branches"] = branches
    cfg_dict["fingerprint"] = lock.fingerprint(cfg_dict)
    metrics_path = os.path.join(out, "metrics.jsonl")
    rounds_path = os.path.join(out, "rounds.jsonl")
    started: list = []
    trun: list = []  # the tracked run (--tracker), opened by begin()

    def begin():  # the run's first writes, once it is past every refusal
        if started:
            return
        started.append(True)
        os.makedirs(out, exist_ok=True)
        report.write_json(os.path.join(out, "config.json"), cfg_dict)
        lock.record(out, cfg_dict)
        if ckdir and primary:
            lock.record(ckdir, cfg_dict)
        if not cfg.resume:
            open(metrics_path, "w").close()
            open(rounds_path, "w").close()
            tracked.discard(out)  # --overwrite: the earlier runs' dashboards go too
        else:  # each by one rename (report.write_jsonl)
            report.write_jsonl(metrics_path, kept_metrics)
            report.write_jsonl(rounds_path, kept_rounds)
        # --tracker: each evaluation as it happens, in a tracked run opened only now
        trun.append(tracked.start(cfg, out, f"{cfg.algorithm}/seed{cfg.seed}", cfg_dict,
                                  resume=cfg.resume))

    new_entries: list = []

    def on_eval(entry):  # stream while running; rewritten from the full history at the end
        begin()
        new_entries.append(entry)
        with open(metrics_path, "a") as f:
            f.write(report.to_json(entry) + "\n")

    def on_rounds(first_round, metrics):  # per-round weights, losses, server diagnostics
        begin()
        with open(rounds_path, "a") as f:
            for row in report.round_rows(first_round, metrics):
                f.write(report.to_json(row) + "\n")

    from fedjax_fair.drivers.runner import (CompileClock, Interrupted, NonFiniteError,
                                            stop_on_signals)
    if cfg.plots:  # matplotlib's import (0.3 s) while XLA compiles the first chunk
        # program: earlier, it slowed the tracing by contending for the GIL; during the
        # rounds, it took a core from them
        while_compiling(_import_matplotlib)
    check_interrupted()  # before the first write (the folders' locks)
    held = _own(cfg, primary, check_fresh=True)
    _STAGE_DIR.append(out)
    try:
        check_interrupted()
        with CompileClock() as init_clock:  # simulate_one's initial_params hits the cache
            initial_params(model, jax.random.key(cfg.seed))
        check_interrupted()  # before the rounds: nothing written yet
        with stop_on_signals():
            result = simulate_one(alg, model, ds, cfg, cfg.seed, checkpoint_dir=ckdir,
                                  resume=cfg.resume, progress=cfg.progress,
                                  description=f"{cfg.algorithm}", on_eval=on_eval,
                                  on_rounds=on_rounds,
                                  on_clients=tracked.on_clients(cfg, lambda: trun[0]))
        result.compile_seconds += init_clock.seconds  # the model's init counts too
        programs = dict(result.compile_programs or {})
        for name, seconds in init_clock.programs.items():
            programs[name] = round(programs.get(name, 0.0) + seconds, 4)
        result.compile_programs = dict(sorted(programs.items(), key=lambda kv: -kv[1]))
    except C.ConfigError:  # refused by the runner's memory plan before any round ran
        if not started:
            held.release(undo=True)  # the folders as they were
        raise
    except NonFiniteError as e:
        begin()
        where = (f"kept in {ckdir}" if e.saved else "not saved (checkpoints are off)"
                 if not ckdir else "not saved (the run diverged before its first commit)")
        report.write_json(os.path.join(out, "summary.json"), {
            "status": "non_finite", "config": cfg_dict, "non_finite_round": e.round,
            "last_good_round": e.last_good_round, "checkpoint_dir": ckdir if e.saved else None})
        advice = (f"continue from it with changed settings as a recorded branch, e.g. a "
                  f"client_lr below {cfg.client_lr:g}: fedjax-fair run -o {out} --resume "
                  f"--branch --client-lr LOWER" if e.saved
                  else f"start again with a client_lr below {cfg.client_lr:g}")
        _err(f"non-finite parameters (NaN/inf) at round {e.round}; stopped. The last good "
             f"checkpoint (round {e.last_good_round}) is {where}; {advice}")
        return EXIT_NONFINITE
    except Interrupted as e:
        begin()
        where = (f"saved in {ckdir}; continue with: fedjax-fair run -o {out} --resume"
                 if ckdir else "not saved (checkpoints are off)")
        _err(f"interrupted after round {e.round}, {where}")
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        if not started:  # before the first round: the folders as they were
            held.release(undo=True)
            _err("interrupted before the first round; nothing was written")
            return EXIT_INTERRUPTED
        _err(f"interrupted at once; the last checkpoint is in {ckdir}; continue with: "
             f"fedjax-fair run -o {out} --resume" if ckdir else "interrupted at once")
        return EXIT_INTERRUPTED

    _STAGE.append(f"while writing the outputs of the finished run to {out}; its "
                  f"summary.json (written last) is not written"
                  + (f"; write them again with: fedjax-fair run -o {out} --resume"
                     if ckdir else ""))
    if ckdir:  # e.g. a signal during the last chunk (it ended the run); without a
        check_interrupted()  # checkpoint the outputs are written, then 130 (main)
    begin()
    resumed_from = _fix_resumed_seconds(result.history, new_entries) if cfg.resume else None
    extra = {"resumed_from_round": resumed_from} if cfg.resume else {}
    extra.update(_method_report(cfg.algorithm, model, alg, result, ds))
    extra["participation"] = participation_report(result, ds.num_clients)
    if ckdir:
        check_interrupted()
    _write_client_history(out, result)  # before summary.json, which is written last
    summary = write_run_outputs(out, cfg_dict, ds, model, result, plots=cfg.plots,
                                extra=extra)
    fin = summary["final"]
    print(f"{cfg.algorithm} on {ds.name} ({ds.num_clients} clients, "
          f"{report.EVALUATED[result.evaluated]}), round {fin['round']}: "
          f"accuracy: average {fin['accuracy_mean']:.4f}, worst 10% "
          f"{fin['accuracy_worst_10%']:.4f}, best 10% {fin['accuracy_best_10%']:.4f}, "
          f"gini {fin['accuracy_gini']:.4f}; "
          + (f"epsilon {fin['dp_epsilon']:.4g} (delta {cfg.dp_delta:g}, every release); "
             if fin.get("dp_epsilon") is not None else "")
          + f"compile {result.compile_seconds:.1f}s, run {result.run_seconds:.1f}s -> {out}")
    if summary.get("unseen"):
        print(_unseen_line(summary["unseen"], fin))
    method = REGISTRY.get(base_name(cfg.algorithm))
    if summary.get("method_report") and method is not None and method.report_line:
        print(method.report_line(summary["method_report"]))
    if method is not None and method.reports_improvement and not cfg.improvement:
        print(f"{cfg.algorithm}: its paper reports the share of each round's participants "
              f"whose training loss did not rise; run again with --improvement to log it "
              f"(improved_fraction in rounds.jsonl)")
    sel = summary["selected"]
    if sel:
        print(f"selected by validation accuracy: round {sel['round']} (validation average "
              f"{sel['validation_accuracy_mean']:.4f}); test accuracy there: average "
              f"{sel['accuracy_mean']:.4f}, worst 10% {sel['accuracy_worst_10%']:.4f}")
    return 0


def improvement_line(on: bool) -> str:
    """The line ``run`` prints before its rounds: whether it logs the improvement share
    (``--improvement``; off by default)."""
    if on:
        return ("improvement share: on (each round's share of participants whose training "
                "loss did not rise, improved_fraction in rounds.jsonl)")
    return ("improvement share: off (--improvement logs each round's share of participants "
            "whose training loss did not rise)")


def _unseen_line(block: dict, seen: dict) -> str:
    """One line: the clients never trained on against the seen ones (average and
    worst-10% accuracy)."""
    head = (f"{block['num_clients']} clients never trained on ("
            + ("global model" if block["adaptation"] == "none" else block["adaptation"])
            + "): ")
    final = block["final"]
    if "accuracy_mean" not in final:
        return head + "no test examples"
    return (head + f"accuracy: average {final['accuracy_mean']:.4f} (seen "
            f"{seen['accuracy_mean']:.4f}), worst 10% {final['accuracy_worst_10%']:.4f} "
            f"(seen {seen['accuracy_worst_10%']:.4f})")


def rebuild_run(out: str) -> int:
    """``fedjax-fair report`` of a ``run`` folder: its figures and report.html drawn again
    from summary.json, metrics.jsonl, clients.csv and rounds.jsonl (nothing computed)."""
    try:
        with open(os.path.join(out, "summary.json")) as f:
            summary = json.load(f)
        if summary.get("status") != "ok":
            raise ValueError(f"its run did not finish (status {summary.get('status')!r})")
        history = report.read_jsonl(os.path.join(out, "metrics.jsonl"), strict=True)
        clients = report.read_client_csv(os.path.join(out, "clients.csv"))
        rounds = report.read_jsonl(os.path.join(out, "rounds.jsonl"))
    except (OSError, ValueError, KeyError) as e:
        raise C.ConfigError("directory", f"{out!r} holds no finished run's outputs "
                                         f"({e})") from None
    if summary["config"].get("plots", True):
        imp = [r["improved_fraction"] for r in rounds if "improved_fraction" in r]
        acc = clients["accuracy"][clients["num_test_examples"] > 0]
        write_run_figures(out, summary, history, acc, np.asarray(imp) if imp else None)
    write_run_page(out, summary)
    print(f"{summary['config'].get('algorithm')}: figures and report.html of {out} written "
          f"again")
    return 0


COMPILATION_CACHE_ENV = "FEDJAX_FAIR_COMPILATION_CACHE"


def _persistent_compilation_cache() -> None:
    """``run`` keeps XLA's compiled programs in jax's persistent compilation cache, so
    running a job again (more rounds, another seed or learning rate of the same shapes)
    loads its programs instead of compiling them; the same executables, the same
    results. The directory is ``$FEDJAX_FAIR_COMPILATION_CACHE`` (default
    ``~/.cache/fedjax_fair/xla``; ``off`` disables it); a cache directory the user gave
    jax (``JAX_COMPILATION_CACHE_DIR``) is used as it is."""
    if jax.config.jax_compilation_cache_dir:
        return
    path = os.environ.get(COMPILATION_CACHE_ENV, os.path.join(
        os.path.expanduser("~"), ".cache", "fedjax_fair", "xla"))
    if path.strip().lower() in ("", "0", "off", "none", "false"):
        return
    jax.config.update("jax_compilation_cache_dir", path)
    # the evaluator and the model's init compile in well under jax's default 1 s
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def _import_matplotlib() -> None:
    """The modules the run's figures draw with (reports.figures imports them too)."""
    import importlib
    for name in ("matplotlib.figure", "matplotlib.backends.backend_agg"):
        importlib.import_module(name)


def _fix_resumed_seconds(history: list, new_entries: list) -> int:
    """Makes ``seconds`` cumulative across a resume; returns the round resumed from."""
    restored = len(history) - len(new_entries)
    if restored <= 0:
        return 0
    offset = float(history[restored - 1].get("seconds", 0.0))
    for entry in history[restored:]:
        if "seconds" in entry:
            entry["seconds"] += offset
    return int(history[restored - 1]["round"])


def _committed_logs(ckdir: str) -> tuple:
    """(round, metrics.jsonl rows, rounds.jsonl rows) of the last committed checkpoint:
    its evaluation history and its round log, so an evaluation or round streamed after
    that commit (a killed chunk) is neither kept nor lost on resume."""
    meta = ckpt.read_meta(ckdir)
    done = int(meta["round"])
    rounds = report.round_rows(0, load_round_log(ckdir, done)) if done else []
    return done, meta["history"], rounds


def _verify_checkpoint(directory: str, alg, model, num_clients: int,
                       eval_clients=None) -> None:
    """The checkpoint's arrays have this run's state shapes (read from file headers),
    and its meta, per-client history and round log are of the state's round
    (``runner.verify_resumable``)."""
    template = jax.eval_shape(lambda k: alg.init(model.init(k), num_clients),
                              jax.random.key(0))
    try:
        verify_resumable(directory, template, num_clients, eval_clients)
    except ValueError as e:
        raise C.ConfigError("resume", str(e).split(": ", 1)[-1]) from None
