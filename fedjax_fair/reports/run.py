"""The files of one finished run: metrics.jsonl, clients.csv, clients_over_time.npz,
the figures, report.html and, written last, summary.json (``write_run``), from a
``drivers.runner.RunResult`` and its configuration as a plain dict. A run folder whose
summary.json exists has all its outputs; ``fedjax-fair report`` draws the figures and
the page again from the files (``write_run_figures``, ``write_run_page``)."""
from __future__ import annotations

import math
import os
from typing import Optional

import jax
import numpy as np

from fedjax_fair import reports as report
from fedjax_fair.algorithms import REGISTRY, base_name, method_hparams
from fedjax_fair.algorithms.families import generative as synthetic
from fedjax_fair.drivers.runner import attacked_summary
from fedjax_fair.metrics import select_evaluation
from fedjax_fair.reports import html


def participation_report(result, num_clients: int) -> dict:
    """summary.json's "participation": how often each client reported over the run
    (its round log; unavailable, dropped and late clients do not count), the summary of
    ``metrics.participation_summary`` against the final accuracy, and, on a virtual
    clock, the simulated seconds to reach 50% / 80% / 90% average accuracy (null:
    never)."""
    from fedjax_fair import metrics as fm
    rounds = result.rounds
    counts = fm.participation_counts(rounds["client_ids"], rounds["client_mask"], num_clients)
    out = fm.participation_summary(counts, len(rounds["client_mask"]),
                                   result.client_metrics["accuracy"],
                                   _has_test(result.client_metrics))
    out["counts"] = counts.tolist()
    if "clock_seconds" in result.history[-1]:
        out["clock_seconds"] = float(result.history[-1]["clock_seconds"])
        reach = {f"{level:g}": fm.time_to_reach(result.history, level)
                 for level in (0.5, 0.8, 0.9)}
        out["time_to_accuracy_mean"] = {k: t if math.isfinite(t) else None  # JSON: null
                                        for k, t in reach.items()}
    return out


def final_summary(result) -> dict:
    """The last evaluation's fairness summary (history[-1] without timing)."""
    return {k: v for k, v in result.history[-1].items() if k != "seconds"}


def _selected(history: list) -> Optional[dict]:
    """The evaluation with the best validation_accuracy_mean (None without a
    validation split), labelled with what selected it."""
    best = select_evaluation(history, "validation_accuracy_mean")
    if best is None:
        return None
    best.pop("seconds", None)
    return {"by": "validation_accuracy_mean (max)", **best}


def _has_test(client_metrics) -> np.ndarray:
    return np.asarray(client_metrics["num_examples"]) > 0


def dataset_description(ds) -> dict:
    return {"name": ds.name, "num_clients": int(ds.num_clients),
            "input_shape": list(ds.input_shape), "num_classes": int(ds.num_classes),
            "info": ds.info}


def write_run(out: str, cfg_dict: dict, ds, model, result, *, plots: bool = True,
              extra: Optional[dict] = None, page: bool = True, malicious=None,
              command: Optional[str] = None) -> dict:
    """metrics.jsonl, clients.csv (+ plots) and, last, summary.json of one finished
    run, with its report.html unless ``page`` is off (a comparison's runs: the
    comparison has the page). ``extra``: more summary.json entries; its "unseen" (an ``UnseenReport`` from
    ``_method_report``) also writes clients_unseen.csv, and summary.json gets its
    block. ``malicious`` (bool [N], or None): the clients under attack; the fairness
    summary then covers the benign ones. ``command``: the command line it records.
    What a crash between two writes leaves: no summary.json, so the run is unfinished
    and ``--resume`` writes everything again."""
    os.makedirs(out, exist_ok=True)
    try:  # an earlier summary.json would vouch for outputs being rewritten now
        os.remove(os.path.join(out, "summary.json"))
    except FileNotFoundError:
        pass
    report.write_jsonl(os.path.join(out, "metrics.jsonl"), result.history)
    held = getattr(ds, "unseen", None)
    seen_names = ds.info.get("users")
    if seen_names is None and held is not None:  # the clients' rows of the full federation
        seen_names = [str(i) for i in held.seen_ids]
    report.write_client_csv(os.path.join(out, "clients.csv"), result.client_metrics,
                            evaluated=result.evaluated, names=seen_names)
    extra = dict(extra or {})
    unseen = extra.pop("unseen", None)
    if unseen is not None:  # the clients never trained on (_method_report)
        report.write_client_csv(os.path.join(out, "clients_unseen.csv"),
                                unseen.client_metrics, evaluated=unseen.evaluated,
                                names=unseen.names)
        extra["unseen"] = unseen.block
    imp = result.round_metrics.get("improved_fraction")
    summary = {
        "status": "ok",
        "config": cfg_dict,
        "dataset": dataset_description(ds),
        "model": {"name": model.name, "num_params": _num_params(model)},
        "evaluated": result.evaluated,
        "final": final_summary(result),
        "selected": _selected(result.history),
        "improved_fraction_mean": None if imp is None or not len(imp) else float(np.mean(imp)),
        "timings": {"compile_seconds": result.compile_seconds,
                    "compile_programs": result.compile_programs or {},
                    "run_seconds": result.run_seconds,
                    "run_seconds_cumulative": result.history[-1].get("seconds", 0.0)},
        "client_table": result.client_table,
        "devices": 1 if result.memory is None else result.memory.devices,  # --devices auto
        "command": command,
        **extra,
    }
    if malicious is not None:  # the fairness summary is the benign clients'
        split = attacked_summary(result.client_metrics, malicious)
        summary["final"] = {**summary["final"], **split["benign"],
                            "over": "benign clients (the malicious ones: summary.json's "
                                    "malicious)"}
        summary["malicious"] = {"client_ids": np.flatnonzero(malicious).tolist(),
                                "attack": cfg_dict.get("attack"), "final": split["malicious"]}
    if plots:
        acc = np.asarray(result.client_metrics["accuracy"])[_has_test(result.client_metrics)]
        write_run_figures(out, summary, result.history, acc, imp)
    _write_synthetic(out, cfg_dict, ds, result.state, plots)
    # the plots written (an interrupt while plotting leaves no summary.json at all)
    summary["plots"] = sorted(n for n in ("accuracy.png", "accuracy_time.png", "loss.png",
                                          "client_accuracy_hist.png", "lorenz.png",
                                          "improved_clients.png", "synthetic_samples.png")
                              if plots and os.path.exists(os.path.join(out, n)))
    if page:
        write_run_page(out, summary)
    # last, by one rename: a run directory with its summary.json has all its outputs
    report.write_json(os.path.join(out, "summary.json"), summary)
    return summary


RUN_FIGURES = (("accuracy.png", "average, worst-10% and std of per-client test accuracy "
                                "over rounds"),
               ("accuracy_time.png", "the same against simulated time"),
               ("loss.png", "test loss and the cohort's training loss"),
               ("client_accuracy_hist.png", "final per-client test accuracy"),
               ("lorenz.png", "Lorenz curve of final per-client accuracy"),
               ("improved_clients.png", "share of each round's participants whose training "
                                        "loss did not rise"),
               ("synthetic_samples.png", "samples of the final synthetic data set"))


def write_run_figures(out: str, summary: dict, history: list, acc, imp) -> None:
    """A run's figures (``RUN_FIGURES``) from its summary.json's ``summary``, its
    evaluations ``history``, final per-client accuracies ``acc`` (clients with test
    data) and per-round improved fractions ``imp``: what ``run`` draws when it ends and
    ``fedjax-fair report`` draws again from the folder's files."""
    cfg_dict = summary["config"]
    which = report.EVALUATED[summary["evaluated"]]
    ctx = ", ".join(str(x) for x in (
        summary["dataset"]["name"], summary["model"]["name"], cfg_dict.get("algorithm"),
        f"{cfg_dict.get('num_rounds', history[-1]['round'])} rounds",
        f"seed {cfg_dict.get('seed')}") if x is not None)
    guards = report.guard_context(cfg_dict, history[-1].get("dp_epsilon"))
    ctx += f"\n{guards}" if guards else ""
    save = lambda fig, name: report.save_figure(fig, os.path.join(out, name))
    save(report.plot_accuracy(history, context=ctx, title=f"Per-client test accuracy ({which})"),
         "accuracy.png")
    if report.CLOCK in history[-1]:  # a run on a virtual clock
        save(report.plot_accuracy(history, context=ctx, x=report.CLOCK,
                                  title=f"Per-client test accuracy ({which}) against "
                                        f"simulated time"), "accuracy_time.png")
    save(report.plot_loss(history, title=f"Loss ({which})", context=ctx), "loss.png")
    save(report.plot_client_histogram(acc, title=f"Final per-client test accuracy ({which})",
                                      context=ctx), "client_accuracy_hist.png")
    save(report.plot_lorenz(acc, context=ctx), "lorenz.png")
    if imp is not None and len(imp):
        save(report.plot_improved_fraction(imp, context=ctx), "improved_clients.png")


RUN_ROWS = (("accuracy_mean", "Average accuracy (%)", 100.0, 2),
            ("accuracy_std", "Std of accuracy (%)", 100.0, 2),
            ("accuracy_worst_10%", "Worst 10% (%)", 100.0, 2),
            ("accuracy_best_10%", "Best 10% (%)", 100.0, 2),
            ("accuracy_gini", "Gini", 1.0, 4), ("ece", "ECE", 1.0, 3),
            ("test_loss", "Test loss", 1.0, 4))


def run_markdown(summary: dict) -> str:
    """The Markdown of a run's report: its final per-client test metrics, beside the
    evaluation selected by validation accuracy and the clients never trained on when
    the run has them."""
    columns = [("Final", summary["final"])]
    if summary.get("selected"):
        columns.append((f"Selected by validation (round {summary['selected']['round']})",
                        summary["selected"]))
    if summary.get("unseen"):
        columns.append((f"Unseen clients ({summary['unseen']['num_clients']})",
                        summary["unseen"]["final"]))
    body = [[label] + [report._fmt(float(c[key]) * scale, None, decimals)
                       if isinstance(c.get(key), (int, float)) else "" for _, c in columns]
            for key, label, scale, decimals in RUN_ROWS]
    timings = summary["timings"]
    ds = summary["dataset"]
    text = (f"{summary['config'].get('algorithm')} on {ds['name']} ({ds['num_clients']} "
            f"clients), {summary['model']['name']}, {report.EVALUATED[summary['evaluated']]}, "
            f"round {summary['final']['round']}\n\n"
            + report.markdown_table(["Metric"] + [name for name, _ in columns], body,
                                    left=("Metric",))
            + f"\nCompile {timings['compile_seconds']:.1f} s, rounds "
              f"{timings['run_seconds']:.1f} s.\n")
    return text


def write_run_page(out: str, summary: dict, command: Optional[str] = None) -> None:
    """A run's report.html: ``run_markdown``, the command (``command``, else the one
    summary.json records), the figures that exist and the configuration."""
    text = run_markdown(summary)
    title, _, body = text.partition("\n\n")
    command = command or summary.get("command")
    reproduce = f"fedjax-fair run --config {os.path.join(out, 'config.json')} -o NEW_DIR"
    report.files._replace_with(os.path.join(out, "report.html"), html.page(
        title, body, figures=[(os.path.join(out, f), c) for f, c in RUN_FIGURES],
        command=command, reproduce=reproduce, config=summary["config"]))


def _write_synthetic(out: str, cfg_dict: dict, ds, state, plots: bool) -> None:
    """A generative method's final synthetic set: synthetic.npz ("x", "y") and, for
    image inputs, synthetic_samples.png (a row of samples per class)."""
    name = base_name(str(cfg_dict.get("algorithm")))
    if name not in REGISTRY or not REGISTRY[name].generative:
        return
    x, y = (np.asarray(a) for a in synthetic.synthetic_data(state))
    np.savez(os.path.join(out, "synthetic.npz"), x=x, y=y)
    shape = tuple(ds.input_shape)
    if not plots or not (len(shape) == 2 or (len(shape) == 3 and shape[-1] in (1, 3))):
        return
    bounds = (cfg_dict.get("hparams") or {}).get(
        "data_range", method_hparams(name)["data_range"].default)
    bounds = (float(x.min()), float(x.max())) if bounds is None else tuple(bounds)
    per_class = int(np.bincount(y).max())
    synthetic.plot_sample_grid(
        [x], y, [f"round {int(state.round)}"], os.path.join(out, "synthetic_samples.png"),
        ds.num_classes, per_class=min(per_class, 20), value_range=bounds,
        title=f"{name}: the final synthetic set by class",
        context=f"{ds.name}, {cfg_dict.get('model')}, seed {cfg_dict.get('seed')}")


def _num_params(model) -> int:
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    return int(sum(np.prod(x.shape, dtype=np.int64) for x in jax.tree.leaves(shapes)))


def _write_client_history(out: str, result) -> None:
    """clients_over_time.npz: "round" [E] and each per-client test metric [E, N] at
    every evaluation (``np.load``), plus "num_test_examples" [N]; written to a
    temporary name and renamed."""
    path = os.path.join(out, "clients_over_time.npz")
    with open(path + ".tmp", "wb") as f:
        np.savez(f, **result.client_history,
                 num_test_examples=np.asarray(result.client_metrics["num_examples"]))
    os.replace(path + ".tmp", path)
