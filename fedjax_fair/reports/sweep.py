"""The tables, selection and heat-map of a sweep folder, from its runs.json: what
``fedjax-fair sweep`` writes at its end and ``fedjax-fair report`` writes again
(``rebuild``), byte for byte.

``read_record`` reads runs.json (every summary of every (grid point, seed) run, NaN
where a run diverged); ``table`` / ``write_csv`` make sweep.md and sweep.csv (mean ±
std over seeds); ``select`` picks the setting by validation accuracy when the data
has a validation split; ``plot_heatmap`` draws the chosen metric over the grid.
"""
from __future__ import annotations

import itertools
import json
import math
import os
from typing import Optional

import numpy as np

from fedjax_fair import reports as report
from fedjax_fair.drivers import tuning
from fedjax_fair.hparams import FieldError
from fedjax_fair.reports import html

PARTS = "parts"
RUNS = "runs.json"
TABLE_MD, TABLE_CSV, HEATMAP, SUMMARY = "sweep.md", "sweep.csv", "heatmap.png", "summary.json"
SELECT_BY = "validation_accuracy_mean"
VALIDATION = "validation_"


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


def _base(key: str) -> str:
    return key[len(VALIDATION):] if key.startswith(VALIDATION) else key


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
        raise FieldError("output_dir", f"{out!r} holds no finished sweep ({RUNS}); "
                                          f"continue it with: fedjax-fair sweep -o {out} "
                                          f"--resume") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise FieldError("output_dir", f"{path} is unreadable ({type(e).__name__}); "
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


higher_is_better = tuning.higher_is_better  # which way a summary is better


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
    report.files._replace_with(path, text.getvalue())


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


def values_at(record: dict, point: dict, key: str) -> Optional[np.ndarray]:
    """The seeds' values [S] of summary ``key`` at grid ``point`` (``{name: value}``)
    of a runs.json ``record``; None when ``point`` is not on the grid."""
    index = []
    for axis in record["axes"]:
        match = [i for i, v in enumerate(axis["values"])
                 if tuning.same_value(point.get(axis["name"]), [v])]
        if not match:
            return None
        index.append(match[0])
    sizes = [len(a["values"]) for a in record["axes"]]
    flat = int(np.ravel_multi_index(index, sizes)) if sizes else 0
    return np.asarray(record["summary"][key][flat], np.float64)


def _stats_at(record: dict, p: int, keys) -> dict:
    return {k: {"mean": float(record["summary"][k][p].mean()),
                "std": float(record["summary"][k][p].std())} for k in keys}


_best = tuning.best_point  # the first best grid point, never one with a diverged seed


def select_key(record: dict) -> str:
    """The validation summary a sweep selects by: ``validation_`` + its ``select``
    (``--select``; validation_accuracy_mean for a sweep recorded without one)."""
    return VALIDATION + record.get("select", SELECT_BY[len(VALIDATION):])


def select(record: dict) -> dict:
    """The honest choice of a setting: with a validation split, the best mean over
    seeds of the validation summary ``select_key`` names (the highest, the lowest for
    a loss, a spread or a calibration error; ``selected``, with its test metrics; the
    first grid point of a tie, and never one with a diverged seed); without one,
    ``selected`` is None, and ``best_on_test`` is the best by ``metric`` on the test
    split, which is NOT a fair selection (chosen on the data it is scored on)."""
    test_keys = [k for k in record["keys"] if not k.startswith(VALIDATION)]
    if record["validation"]:
        by = select_key(record)
        higher = higher_is_better(by)
        p = _best(record["summary"][by], higher)
        if p is None:
            return {"selected": None, "selection_note": "every grid point has a diverged "
                                                        "seed: nothing to select"}
        scores = _stats_at(record, p, sorted({by, SELECT_BY}))
        return {"selected": {"by": f"{by} (mean over seeds, "
                                   f"{'highest' if higher else 'lowest'})", "key": by,
                             "point": p, "hparams": _point_hparams(record, p),
                             "score": scores[by], SELECT_BY: scores[SELECT_BY],
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
        by = sel.get("key", SELECT_BY)
        score = sel.get("score", sel[SELECT_BY])
        shown = (_pct(score, seeds) + "%" if is_percent(by) else
                 report._fmt(score["mean"], score["std"] if seeds > 1 else None, _decimals(by)))
        return [f"selected by {by} (mean over seeds): {_setting(sel['hparams'])}"
                f" ({shown}); its test accuracy: "
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


def rebuild(out_dir: str, *, plots: Optional[bool] = None, echo: bool = True,
            command: Optional[str] = None) -> None:
    """Rewrites sweep.md, sweep.csv and heatmap.png of the sweep folder ``out_dir`` from
    its runs.json, without computing a run, and prints the table and the selection
    (``echo``). The same tables byte for byte as the sweep wrote (the sweep command
    writes them with this function). ``plots``: draw the heat-map (None: as the
    sweep's config.json says). A folder without runs.json (an unfinished sweep) is a
    ``FieldError("output_dir")`` naming the command that finishes it. ``command``:
    the command line report.html shows when summary.json records none."""
    _rebuild(out_dir, plots=plots, echo=echo, command=command)


def _rebuild(out: str, plots: Optional[bool], echo: bool,
             command: Optional[str] = None) -> tuple[dict, dict]:
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
    report.files._replace_with(os.path.join(out, TABLE_MD), text)
    write_csv(os.path.join(out, TABLE_CSV), record)
    if plots:
        fig = plot_heatmap(record, selection)
        report.save_figure(fig, os.path.join(out, HEATMAP + ".tmp.png"))
        os.replace(os.path.join(out, HEATMAP + ".tmp.png"), os.path.join(out, HEATMAP))
    write_page(out, text, command)
    if echo:
        print(title(record))
        print()
        print(head, end="")
        print()
        print("\n".join(lines))
    return selection, record


def write_page(out: str, text: str, command: Optional[str] = None) -> None:
    """The sweep's report.html: sweep.md's ``text`` (its first line the title), the
    heat-map, the command (summary.json's when the folder has one, else this one's) and
    config.json."""
    title, _, body = text.partition("\n\n")
    previous = report.read_json(os.path.join(out, SUMMARY)) or {}
    report.files._replace_with(os.path.join(out, "report.html"), html.page(
        title, body, figures=[(os.path.join(out, HEATMAP), "the chosen metric over the "
                                                           "grid, mean over seeds")],
        command=previous.get("command") or command,
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
