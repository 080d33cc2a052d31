"""The tables, figures and page of a comparison folder, from the files its runs wrote:
what ``fedjax-fair compare`` writes at its end and ``fedjax-fair report`` writes again,
byte for byte; from a notebook, ``rebuild(out)`` on any compare folder.

A comparison folder holds config.json (the algorithms and seeds) and one run per
algorithm and seed in ``ALGORITHM/seedS``: summary.json (written last, the run's
commit), metrics.jsonl, rounds.jsonl, clients.csv and clients_over_time.npz.
``finished_run`` reads one back, or None when it is not finished; ``load_runs`` reads
them all (``Finished``); ``write_comparison`` writes from them comparison.md and
comparison.csv (mean ± std over seeds, grouped by family), the figures (``FIGURES``),
report.html and, last, the comparison's summary.json.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import NamedTuple, Optional

import numpy as np

from fedjax_fair.algorithms import FAMILIES, REGISTRY, base_name
from fedjax_fair.hparams import FieldError
from fedjax_fair import reports as report
from fedjax_fair.reports import html
from fedjax_fair.reports.sweep import _setting, is_percent, values_at


def _improved_curve(run_dir: str):
    """The per-round improved fraction of a run directory's rounds.jsonl, or None."""
    path = os.path.join(run_dir, "rounds.jsonl")
    if not os.path.isfile(path):
        return None
    rows = report.read_jsonl(path)
    values = [r["improved_fraction"] for r in rows if "improved_fraction" in r]
    return np.asarray(values) if values else None


def finished_run(run_dir: str):
    """(summary, history, accuracies) of a run a comparison already wrote, or None
    when it is not finished: ``summary.json``, written last (``fedjax-fair compare``'s
    commit of the run), is missing, unreadable or not a run's summary, or an output it
    commits is missing or unreadable (metrics.jsonl; for a finished run also
    rounds.jsonl, clients.csv and clients_over_time.npz with one row per evaluation).
    ``compare --resume`` then runs it again."""
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
    """The finished runs of the comparison in ``out`` (``finished_run`` of each
    ``out/ALGORITHM/seedS``): the one source of its table, figures and report, whether
    ``compare`` has just run them or ``fedjax-fair report`` reads a folder again."""
    summaries = {a: [] for a in algorithms}
    histories = {a: [] for a in algorithms}
    accuracies = {a: [] for a in algorithms}
    notes, evaluated, dataset = {}, {}, None
    for name in algorithms:
        for seed in seeds:
            done = finished_run(os.path.join(out, name, f"seed{seed}"))
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
                                    "loss did not rise, by family"),
           ("tuning.png", "a tuned comparison's sensitivity: each method's validation score "
                          "(the one it was selected by) against the client rate, its other "
                          "hyper-parameters at their selected values, ± one std over the "
                          "tuning seeds, the selected point starred, by family"))


def rebuild(out_dir: str, *, echo: bool = True, command: Optional[str] = None) -> dict:
    """``write_comparison`` of the comparison folder ``out_dir`` again, from its
    config.json and the runs it holds, without computing a run: the same files byte
    for byte as the comparison wrote (its summary.json's seconds and command kept;
    ``command``: the one report.html shows when summary.json records none). A folder
    without a readable comparison config.json is a ``FieldError("output_dir")``.
    Returns what summary.json now holds."""
    path = os.path.join(out_dir, "config.json")
    try:
        with open(path) as f:
            cfg_dict = json.load(f)
    except (OSError, ValueError) as e:
        raise FieldError("output_dir", f"{out_dir!r} holds no readable config.json of a "
                                       f"comparison ({e})") from None
    if not (isinstance(cfg_dict, dict) and "algorithms" in cfg_dict and "seeds" in cfg_dict):
        raise FieldError("output_dir", f"{path!r} is not the configuration of a comparison")
    previous = report.read_json(os.path.join(out_dir, "summary.json")) or {}
    return write_comparison(out_dir, cfg_dict, previous.get("total_seconds") or 0.0,
                            echo=echo, command=previous.get("command") or command)


def write_comparison(out: str, cfg_dict: dict, seconds: float, *, echo: bool = True,
                     command: Optional[str] = None) -> dict:
    """comparison.md / .csv, the figures (unless ``cfg_dict["plots"]`` is false),
    report.html and, last, summary.json of the runs ``out`` holds (``load_runs``) for
    the comparison configured by ``cfg_dict`` (its config.json), which took
    ``seconds``; with ``echo``, prints the title, the table and where it went. ``fedjax-fair
    compare`` calls it at its end and ``fedjax-fair report`` on a finished folder, so
    that both write the same files from the same inputs. ``command``: the command line
    recorded in summary.json and report.html. Returns what summary.json holds (its
    ``"notes"``: the diverged runs, by algorithm)."""
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
    tuned = report.read_json(os.path.join(out, TUNING)) if cfg_dict.get("tune") else None
    priors = priors_of(algorithms, cfg_dict)
    tables = report.family_tables(rows, len(seeds), families, FAMILIES, runs.notes, columns,
                                  priors)
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
    tuned_md = tuned_table(tuned, algorithms) if tuned else ""
    markdown = f"{title}\n\n{table}\n{table_note}\n" + (f"\n{tuned_md}" if tuned_md else "")
    report.files._replace_with(os.path.join(out, "comparison.md"), markdown)
    extra = {a: {"prior": priors.get(a, ""), **(tuned_columns(tuned, rows)[a] if tuned else {})}
             for a in rows}
    report.write_comparison_csv(os.path.join(out, "comparison.csv"), rows, len(seeds),
                                families, columns, extra=extra)
    if cfg_dict.get("plots", True):
        _comparison_figures(out, cfg_dict, runs, label, families, finished, total_runs)
        _tuning_figure(out, tuned, label, families)
    summary_path = os.path.join(out, "summary.json")
    reproduce = f"fedjax-fair compare --config {os.path.join(out, 'config.json')} -o NEW_DIR"
    report.files._replace_with(os.path.join(out, "report.html"), html.page(
        title, table + "\n" + table_note + (f"\n\n{tuned_md}" if tuned_md else ""), figures=[(os.path.join(out, f), c) for f, c in FIGURES],
        command=command, reproduce=reproduce, config=cfg_dict))
    summary = {
        "config": cfg_dict, "dataset": ds, "command": command,
        "table": {a: {k: {"mean": m, "std": s} for k, (m, s) in agg.items()}
                  for a, agg in rows.items()},
        "families": families, "evaluated": evaluated, "notes": runs.notes, "labels": label,
        "total_seconds": seconds, "runs_finished": finished, "runs": total_runs}
    report.write_json(summary_path, summary)
    if echo:
        print(title)
        print()
        print(table, end="")
        if personal:
            print(f"(personal models: {', '.join(personal)})")
        print(f"\n{total_runs} runs in {seconds:.1f}s -> {out}")
    return summary


TUNING = "tuning.json"  # a tuned comparison's searches (cli/tune.py)


def _hparams_of(name: str, hparams: dict) -> dict:
    """The hyper-parameters a comparison's config.json gives ``name``: ``NAME`` keys
    (every method), ``name.NAME`` keys and ``{name: {...}}`` (the command line's
    ``split_compare_hparams``, read back without checking)."""
    out = {}
    for key, value in (hparams or {}).items():
        if key == name and isinstance(value, dict):
            out.update(value)
        elif "." in key:
            method, _, k = key.partition(".")
            if method == name:
                out[k] = value
        elif not isinstance(value, dict):
            out.setdefault(key, value)
    return out


def priors_of(algorithms: list, cfg_dict: dict) -> dict:
    """``{name: "size" | "uniform" | "own"}``: the plain average each compared method
    starts from (``registry.prior_of``), the table's "Prior" column."""
    from fedjax_fair.algorithms.registry import prior_of
    mixing = cfg_dict.get("mixing", "default")
    out = {}
    for a in algorithms:
        try:
            out[a] = prior_of(a, _hparams_of(a, cfg_dict.get("hparams", {})), mixing)
        except KeyError:  # a method no longer registered: its folder still reads
            out[a] = ""
    return out


def _score(value: Optional[dict], key: Optional[str]) -> str:
    if not value or key is None:
        return "-"
    if is_percent(key):
        return f"{100 * value['mean']:.2f} ± {100 * value['std']:.2f}"
    return f"{value['mean']:.4g} ± {value['std']:.2g}"


def tuned_table(tuned: dict, algorithms: list) -> str:
    """The Markdown table of a tuned comparison's selections: per method the selected
    setting, its validation score, the default setting's score when the default is a
    grid point, and the size of the search."""
    methods = tuned.get("methods", {})
    key = next((r["key"] for r in methods.values() if r.get("key")), None)
    select = (key or "validation_" + str(tuned.get("select"))).replace("validation_", "", 1)
    pct = " (%)" if is_percent(select) else ""
    header = ["Algorithm", "Selected setting", f"Validation {select}{pct}",
              f"At its defaults{pct}", "Grid points"]
    body = []
    for a in algorithms:
        r = methods.get(a)
        if r is None:
            continue
        body.append([a, _setting(r["hparams"]) if r["hparams"] else f"defaults ({r['note']})",
                     _score(r.get("score"), r.get("key")),
                     _score(r.get("default_score"), r.get("key")), str(r["points"])])
    seeds = ",".join(map(str, tuned.get("seeds", [])))
    return (f"Tuned: each method's setting selected by validation {select} (mean ± std over "
            f"the tuning seeds {seeds}, on a validation split held out of the training "
            f"rows); the table above scores it on the test split with the comparison's "
            f"seeds. Each search: tune/METHOD (sweep.md, heatmap.png).\n\n"
            + report.markdown_table(header, body) + "\n")


def tuned_columns(tuned: dict, rows: dict) -> dict:
    """comparison.csv's columns of a tuned comparison: the selected setting, its
    validation score (mean, std) and the searched grid (JSON)."""
    methods = tuned.get("methods", {})
    out = {}
    for a in rows:
        r = methods.get(a, {})
        score = r.get("score") or {}
        out[a] = {"tuned_setting": json.dumps(r.get("hparams", {}), sort_keys=True),
                  "selected_by": r.get("key") or "",
                  "validation_score": repr(score["mean"]) if score else "",
                  "validation_score_seed_std": repr(score["std"]) if score else "",
                  "grid": json.dumps(r.get("space", {}))}
    return out


def sensitivity_curves(out: str, tuned: dict) -> dict:
    """``{method: curve}`` of ``figures.plot_sensitivity`` from a tuned comparison's
    searches (``tune/METHOD/runs.json``): the selection summary along the client rate
    with the method's other names at their selected values; methods whose search has
    no client rate (fixed by the user) are left out."""
    curves = {}
    for name, r in (tuned or {}).get("methods", {}).items():
        record = report.read_json(os.path.join(out, "tune", name, "runs.json"))
        key, chosen = r.get("key"), r.get("hparams") or {}
        if not record or key not in record.get("summary", {}) or not chosen:
            continue
        axis = next((a for a in record["axes"] if a["name"] == "client_lr"), None)
        if axis is None:
            continue
        x, mean, std = [], [], []
        for v in axis["values"]:
            seeds = values_at(record, {**chosen, "client_lr": v}, key)
            if seeds is None:
                break
            x.append(v)
            mean.append(float(seeds.mean()))
            std.append(float(seeds.std()))
        if len(x) < len(axis["values"]):
            continue
        score = r.get("score") or {}
        curves[name] = {"x": x, "mean": mean, "std": std,
                        "selected": (chosen["client_lr"], score.get("mean"))}
    return curves


def _tuning_figure(out: str, tuned: Optional[dict], label: dict, families: dict) -> None:
    """tuning.png of a tuned comparison (``sensitivity_curves`` by family); removed
    from a folder that has no tuning."""
    path = os.path.join(out, "tuning.png")
    curves = sensitivity_curves(out, tuned) if tuned else {}
    if not curves:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return
    key = next(iter(tuned["methods"].values())).get("key") or ""
    groups = [(t, [label[n] for n in names])
              for t, names in report.family_groups(families, FAMILIES, report.MAX_LINES)]
    refs = [label[n] for n in report.references(families)]
    seeds = ",".join(map(str, tuned.get("seeds", [])))
    fig = report.plot_by_family(
        report.plot_sensitivity, {label[n]: c for n, c in curves.items()}, groups, refs,
        context=f"tuning seeds {seeds}", title=f"{key} against the client rate")
    report.save_figure(fig, path)


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
