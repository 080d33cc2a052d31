"""Tables and plots of simulation results, as small functions of plain data.

Everything here takes plain Python / NumPy data — ``RunResult.history`` (a list of
dicts, one per evaluation, with ``"round"``, ``"accuracy_mean"``,
``"accuracy_worst_10%"``, ``"test_loss"``, ``"seconds"``, ...; see ``runner.split_summary``), per-client arrays (``RunResult.client_metrics``) — so notebooks
can call the same functions as the CLI.

Plots are drawn on ``matplotlib.figure.Figure`` objects with the Agg canvas, never
through pyplot, so importing this module does not change the matplotlib backend of
a notebook and nothing needs a display. Each ``plot_*`` function draws on a given
``ax`` or on a new figure, and returns the figure; ``save_figure`` writes a PNG.
"""
from __future__ import annotations

import csv
import json
import math
import os
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

# Columns of the comparison table: (key in a run summary, Markdown header, CSV column,
# scale). Accuracies are in percent in both tables, as in the fair-FL papers, and
# the CSV column names carry the unit.
TABLE_COLUMNS = (
    ("accuracy_mean", "Average (%)", "accuracy_mean_percent", 100.0),
    ("accuracy_std", "Std (%)", "accuracy_std_percent", 100.0),
    ("accuracy_worst_10%", "Worst 10% (%)", "accuracy_worst_10%_percent", 100.0),
    ("accuracy_best_10%", "Best 10% (%)", "accuracy_best_10%_percent", 100.0),
    ("accuracy_gini", "Gini", "accuracy_gini", 1.0),
    ("ece", "ECE", "ece", 1.0),
    ("run_seconds", "Run (s)", "run_seconds", 1.0),
    ("compile_seconds", "Compile (s)", "compile_seconds", 1.0),
)
# The clients never trained on (``--unseen-clients``), beside the seen ones' columns.
UNSEEN_COLUMNS = (
    ("unseen_accuracy_mean", "Unseen avg (%)", "unseen_accuracy_mean_percent", 100.0),
    ("unseen_accuracy_worst_10%", "Unseen worst 10% (%)", "unseen_accuracy_worst_10%_percent",
     100.0),
)
DECIMALS = {"dp_epsilon": 2, "accuracy_gini": 4, "ece": 3, "run_seconds": 1, "compile_seconds": 1}
# The better direction of each column, for marking the best value of a family.
LOWER_IS_BETTER = frozenset({"accuracy_std", "accuracy_gini", "ece", "run_seconds",
                             "compile_seconds", "dp_epsilon"})
REFERENCE = "reference"  # the family of the shared reference (FedAvg): in every group
MAX_LINES = 7  # methods on one set of axes besides the reference
TABLE_NOTE = ("Average/Std/Worst/Best: per-client final test accuracy in percent over all "
              "clients with test data (worst/best 10%: the lowest/highest max(1, floor(0.1 N)) "
              "clients, averaged by test size); Gini of per-client accuracy; ECE: each "
              "client's expected calibration error (15 confidence bins) averaged over "
              "clients; Run: seconds of "
              "the compiled rounds (excluding compilation and evaluation); Compile: seconds "
              "to compile them. With several seeds each cell is mean ± std over seeds; "
              "comparison.csv holds the same values in the same units, the std in the "
              "*_seed_std columns.")


# ------------------------------------------------------------------------------ files


def _json_default(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, tuple):
        return list(x)
    return str(x)


def _finite(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, np.floating) and not np.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def to_json(obj, **kwargs) -> str:
    """Strict JSON text: NumPy values become Python numbers, NaN/inf become null."""
    return json.dumps(_finite(obj), default=_json_default, allow_nan=False, **kwargs)


def _replace_with(path: str, text: str) -> None:
    """Writes ``text`` to a temporary name beside ``path`` and renames it over ``path``:
    a reader (or a crash) sees the old file or the new one, never part of it."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def read_json(path: str):
    """The JSON value of ``path``, or None when it is missing or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json(path: str, obj) -> None:
    _replace_with(path, to_json(obj, indent=2) + "\n")


def write_jsonl(path: str, rows: Iterable[Mapping]) -> None:
    """One JSON object per line (``metrics.jsonl``), by one rename."""
    _replace_with(path, "".join(to_json(row) + "\n" for row in rows))


def read_jsonl(path: str, strict: bool = False) -> list[dict]:
    """The JSON objects of a JSONL file, one a line. A torn last line (a write cut
    off by a kill: no final newline, or not JSON) is left out, unless ``strict``, when
    it raises ``ValueError``; a bad line before the last always raises."""
    with open(path) as f:
        lines = f.read().split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        last = i == len(lines) - 1  # text after the final newline: cut off
        try:
            row = json.loads(line)
        except ValueError as e:
            if (last or all(not x.strip() for x in lines[i + 1:])) and not strict:
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON ({e})") from None
        if last and strict:
            raise ValueError(f"{path}: line {i + 1} has no final newline (cut off)")
        if not isinstance(row, dict):
            raise ValueError(f"{path}: line {i + 1} is not a JSON object")
        rows.append(row)
    return rows


CLIENT_COLUMNS = ("client_id", "client", "num_test_examples", "accuracy", "loss", "ece", "mce",
                  "model")
EVALUATED = {"global": "global model", "personal": "personal models"}


def write_client_csv(path: str, client_metrics: Mapping[str, np.ndarray],
                     evaluated: str = "global", names=None) -> None:
    """Per-client final test metrics: client_id (the row), client (the dataset's own
    identifier, e.g. the LEAF user id; the row number when it has none),
    num_test_examples, accuracy, loss, ece and mce (the client's calibration errors,
    empty for a model that reports no confidence), model ("global": the global model;
    "personal": the client's own model). A client without test rows has empty metrics
    (read back as NaN).

    ``client_metrics`` holds arrays [N] "num_examples", "accuracy", "loss" and
    optionally "ece", "mce" (as ``RunResult.client_metrics``). Floats are written with
    ``repr`` precision so the file round-trips exactly.
    """
    n = np.asarray(client_metrics["num_examples"])
    metrics = [np.asarray(client_metrics[k], np.float64) if k in client_metrics else None
               for k in ("accuracy", "loss", "ece", "mce")]
    names = [str(i) for i in range(n.shape[0])] if names is None else [str(u) for u in names]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CLIENT_COLUMNS)
        for i in range(n.shape[0]):
            values = ["" if v is None or n[i] == 0 else repr(float(v[i])) for v in metrics]
            w.writerow([i, names[i], int(n[i]), *values, evaluated])


def round_rows(first_round: int, metrics: Mapping[str, np.ndarray]) -> list[dict]:
    """One JSON-ready dict per round of a chunk's metrics (leading round axis): the
    round number (1-based), the cohort's ids (masked rows dropped), and every other
    metric; per-client [K] values become lists aligned with ``client_ids``."""
    mask = np.asarray(metrics["client_mask"], bool)
    rows = []
    for r in range(mask.shape[0]):
        keep = mask[r]
        row = {"round": first_round + r + 1}
        for name, value in metrics.items():
            if name in ("client_mask", "finite"):
                continue
            v = np.asarray(value[r])
            row[name] = v[keep].tolist() if v.shape == keep.shape else v.tolist()
        rows.append(row)
    return rows


def read_client_csv(path: str) -> dict[str, np.ndarray]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return {"client_id": np.array([int(r["client_id"]) for r in rows]),
            "client": np.array([r.get("client", r["client_id"]) for r in rows]),
            "num_test_examples": np.array([int(r["num_test_examples"]) for r in rows]),
            **{k: np.array([float(r.get(k) or "nan") for r in rows])
               for k in ("accuracy", "loss", "ece", "mce")},
            "model": np.array([r.get("model", "global") for r in rows])}


# ----------------------------------------------------------------------------- tables


DP_COLUMN = ("dp_epsilon", "ε", "dp_epsilon", 1.0)  # the privacy spent (--dp-*)


def guard_context(cfg_dict: Mapping, epsilon: Optional[float] = None) -> str:
    """The privacy and attack settings of a run or comparison, for its figures'
    context line ("" without them): the epsilon spent at delta (``epsilon``: the final
    evaluation's ``dp_epsilon``), the attack and how many clients run it, the robust
    aggregator."""
    parts = []
    if cfg_dict.get("dp_noise") is not None or cfg_dict.get("dp_epsilon") is not None:
        spent = epsilon if epsilon is not None else cfg_dict.get("dp_epsilon")
        parts.append("client-level DP" + (f", ε = {spent:.2f}" if spent is not None else "")
                     + f" at δ = {cfg_dict.get('dp_delta'):g}")
    if cfg_dict.get("attack"):
        who = (f"{cfg_dict['malicious_fraction']:g} of the clients"
               if cfg_dict.get("malicious_fraction") else
               f"clients {','.join(map(str, cfg_dict.get('malicious_ids') or []))}")
        parts.append(f"attack {cfg_dict['attack']} by {who}")
    if cfg_dict.get("robust"):
        parts.append(f"robust {cfg_dict['robust']}")
    return "; ".join(parts)


def table_columns(unseen: bool = False, dp: bool = False) -> tuple:
    """The comparison table's columns: ``TABLE_COLUMNS``, with the clients never trained
    on (``UNSEEN_COLUMNS``) after the seen ones' accuracies when ``unseen``, and the
    privacy spent (``DP_COLUMN``) after the accuracies with ``dp``."""
    columns = TABLE_COLUMNS[:4] + (UNSEEN_COLUMNS if unseen else ())
    return columns + ((DP_COLUMN,) if dp else ()) + TABLE_COLUMNS[4:]


def aggregate_runs(summaries: Sequence[Mapping[str, float]],
                   columns=TABLE_COLUMNS) -> dict[str, tuple[float, float]]:
    """``{key: (mean, std)}`` over seeds of the table columns (population std; 0 for one run).

    A run that diverged has NaN values and makes the aggregate NaN. JSON holds a
    non-finite value as null: null is NaN, except the privacy spent, where it is the
    infinite epsilon of a run without noise.
    """
    out = {}
    for key, *_ in columns:
        missing = math.inf if key == DP_COLUMN[0] else math.nan
        vals = np.array([missing if s.get(key, math.nan) is None else float(s.get(key, math.nan))
                         for s in summaries], np.float64)
        out[key] = (float(np.mean(vals)), float(np.std(vals)) if len(vals) > 1 else 0.0)
    return out


def _fmt(value: float, std: Optional[float], decimals: int) -> str:
    if value == math.inf:
        return "inf"
    if not math.isfinite(value):
        return "nan"
    text = f"{value:.{decimals}f}"
    if std is not None:
        text += f" ± {std:.{decimals}f}"
    return text


def comparison_table(rows: Mapping[str, Mapping[str, tuple[float, float]]], num_seeds: int,
                     notes: Optional[Mapping[str, str]] = None,
                     columns=TABLE_COLUMNS) -> tuple[list[str], list[list[str]]]:
    """(header, formatted rows) of the paper-style table.

    ``rows`` maps an algorithm name to ``aggregate_runs(...)``; with more than one seed
    every cell reads ``mean ± std``. ``notes`` (e.g. "diverged at round 7") adds a column.
    """
    header = ["Algorithm"] + [h for _, h, _, _ in columns]
    notes = notes or {}
    if any(notes.values()):
        header.append("Note")
    body = []
    for name, agg in rows.items():
        cells = [name]
        for key, _, _, scale in columns:
            m, s = agg[key]
            cells.append(_fmt(m * scale, s * scale if num_seeds > 1 else None,
                              DECIMALS.get(key, 2)))
        if len(header) > len(cells):
            cells.append(notes.get(name, ""))
        body.append(cells)
    return header, body


def family_groups(families: Mapping[str, str], titles: Mapping[str, str],
                  max_size: Optional[int] = None) -> list[tuple[str, list[str]]]:
    """``[(title, names)]``: the compared names by family, families in ``titles``'s
    order (then any other, by name), names in their given order, the reference family
    (FedAvg) left out: it joins every group as the shared baseline. With ``max_size``
    a larger family is cut into near-equal parts titled "fair aggregation (1/2)", ...
    (one set of axes each: at most ``max_size`` methods and the reference)."""
    order = list(titles) + sorted(set(families.values()) - set(titles))
    groups = []
    for family in order:
        names = [n for n, f in families.items() if f == family]
        if family == REFERENCE or not names:
            continue
        parts = 1 if max_size is None else math.ceil(len(names) / max_size)
        size = math.ceil(len(names) / parts)
        title = titles.get(family, family)
        for i in range(parts):
            groups.append((f"{title} ({i + 1}/{parts})" if parts > 1 else title,
                           names[i * size:(i + 1) * size]))
    return groups


def references(families: Mapping[str, str]) -> list[str]:
    """The compared names of the reference family (FedAvg and its ``@`` variants)."""
    return [n for n, f in families.items() if f == REFERENCE]


def _best_cells(rows: Mapping[str, Mapping[str, tuple[float, float]]], names: Sequence[str],
                columns=TABLE_COLUMNS) -> set:
    """``{(name, key)}`` of the best value of every column among ``names`` (two or more),
    compared as displayed, so that a tie at the shown precision marks both (a column
    where every name ties marks none)."""
    if len(names) < 2:
        return set()
    best = set()
    for key, _, _, scale in columns:
        shown = {n: round(rows[n][key][0] * scale, DECIMALS.get(key, 2)) for n in names
                 if math.isfinite(rows[n][key][0])}
        if shown:
            target = (min if key in LOWER_IS_BETTER else max)(shown.values())
            marked = {(n, key) for n, v in shown.items() if v == target}
            if len(marked) < len(names):  # a column where all tie marks nothing
                best |= marked
    return best


def family_tables(rows: Mapping[str, Mapping[str, tuple[float, float]]], num_seeds: int,
                  families: Mapping[str, str], titles: Mapping[str, str],
                  notes: Optional[Mapping[str, str]] = None,
                  columns=TABLE_COLUMNS) -> list[tuple[str, list, list]]:
    """``[(family title, header, body)]``: ``comparison_table`` cut by family
    (``family_groups``), each table led by the reference rows (FedAvg, labelled
    "(reference)") and the best value of every column within the family in bold
    (``**...**``; higher accuracies, lower std / Gini / ECE / seconds). Without a
    family besides the reference, one table of everything."""
    header, body = comparison_table(rows, num_seeds, notes, columns)
    cells = dict(zip(rows, body))
    refs = [n for n in references(families) if n in rows]
    groups = family_groups({n: families.get(n, REFERENCE) for n in rows}, titles) or \
        [("", [n for n in rows if n not in refs])]
    keys = [key for key, *_ in columns]
    out = []
    for title, names in groups:
        best = _best_cells(rows, names, columns)
        table = [[f"{n} (reference)", *cells[n][1:]] for n in refs]
        for n in names:
            row = list(cells[n])
            for j, key in enumerate(keys, start=1):
                if (n, key) in best:
                    row[j] = f"**{row[j]}**"
            table.append(row)
        out.append((title, header, table))
    return out


def family_markdown(tables: Sequence[tuple[str, list, list]]) -> str:
    """The Markdown of ``family_tables``: a ``###`` heading and a table per family."""
    return "\n".join((f"### {title}\n\n" if title else "") + markdown_table(header, body)
                     for title, header, body in tables)


def markdown_table(header: Sequence[str], body: Sequence[Sequence[str]],
                   left: Sequence[str] = ("Algorithm", "Note")) -> str:
    """A Markdown table; columns named in ``left`` are left-aligned, others right."""
    widths = [max(len(str(r[i])) for r in [header, *body]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) if h in left else "-" * (w + 1) + ":"
                         for h, w in zip(header, widths)) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in body)]) + "\n"


def write_comparison_csv(path: str, rows: Mapping[str, Mapping[str, tuple[float, float]]],
                         num_seeds: int, families: Optional[Mapping[str, str]] = None,
                         columns=TABLE_COLUMNS) -> None:
    """The comparison table, machine-readable: the Markdown table's values in its units
    (accuracies in percent; the unit is in the column name) at full precision, each
    column's mean over seeds followed by its std over seeds (``*_seed_std``), and
    each algorithm's family (``algorithms.FAMILIES``'s key) when ``families`` is given."""
    families = families or {}
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["algorithm", "family", "num_seeds"]
                   + [c for _, _, name, _ in columns for c in (name, f"{name}_seed_std")])
        for name, agg in rows.items():
            w.writerow([name, families.get(name, ""), num_seeds]
                       + [repr(v * scale) for key, _, _, scale in columns
                          for v in agg[key]])


# ------------------------------------------------------------------------------ plots

# Per-client accuracy over rounds: (history key, panel title, y label).
ACCURACY_PANELS = (("accuracy_mean", "Average", "average accuracy"),
                   ("accuracy_worst_10%", "Worst 10% of clients", "worst-10% accuracy"),
                   ("accuracy_std", "Std across clients", "std of accuracy"))
LINESTYLES = ("-", "--", ":", "-.")


def algorithm_styles(names: Sequence[str], reference: Sequence[str] = ()) -> dict[str, dict]:
    """A (colour, line style) per name, deterministic by order and distinct for up to
    40 names: tab10 colours, solid lines for the first ten, another style each time the
    colours wrap.
    Names in ``reference`` (the shared baseline of a family panel) are black, dashed."""
    from matplotlib import colormaps
    colors = colormaps["tab10"].colors
    out = {}
    for i, name in enumerate(n for n in names if n not in reference):
        out[name] = {"color": colors[i % 10],
                     "linestyle": LINESTYLES[(i // 10) % len(LINESTYLES)]}
    out.update({n: dict(REFERENCE_STYLE) for n in names if n in reference})
    return out


REFERENCE_STYLE = {"color": "black", "linestyle": "--"}


def _new_figure(figsize=(6.0, 4.0)):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _new_axes(ax, ncols: int = 1, figsize=(6.0, 4.0)):
    if ax is not None:
        return ax.figure, ax
    fig = _new_figure(figsize)
    return fig, fig.add_subplot(1, ncols, 1)


def save_figure(fig, path: str, dpi: int = 110) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi)


def _legend(ax, **kwargs) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def _side_columns(num_entries: int) -> int:
    """Columns of a legend beside the axes: two past 20 entries, so that the every-method
    comparison's legend fits the figure's height."""
    return 1 if num_entries <= 20 else 2


def _side_legend(ax, ncol: int) -> None:
    """The legend to the right of ``ax``, in ``ncol`` columns."""
    _legend(ax, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small",
            ncols=ncol, frameon=False)


def _title(title: str, context: str = "") -> str:
    return f"{title}\n{context}" if context else title


def _round_axis(ax) -> None:
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    ax.set_xlabel("round")


def _series(history: Sequence[Mapping], key: str, x: str = "round"):
    rows = [h for h in history if key in h and x in h]
    rounds = np.array([h[x] for h in rows], np.float64)
    values = np.array([h[key] for h in rows], np.float64)
    return rounds, values


def _seed_lines(runs: Sequence[Sequence[Mapping]], key: str, x: str = "round"):
    """(x values, values [seeds, T]) of ``key``, cut to the shortest history, or None;
    the x values are the seeds' mean (the same rounds; simulated times differ)."""
    series = [_series(h, key, x) for h in runs if h]
    series = [(r, v) for r, v in series if len(r)]
    if not series:
        return None
    n = min(len(r) for r, _ in series)
    return (np.mean([r[:n] for r, _ in series], axis=0),
            np.stack([v[:n] for _, v in series]))


CLOCK = "clock_seconds"  # an evaluation's cumulative simulated time (scenarios/system.py)


def _x_axis(ax, x: str) -> None:
    if x == CLOCK:
        ax.set_xlabel("simulated time (s)")
    else:
        _round_axis(ax)


def _draw_algorithm(ax, rounds, vals, label, style, markers: bool = False):
    # A run cut short (diverged) may have a single point: a marker keeps it visible.
    marker = "o" if markers or len(rounds) <= 2 else None
    line, = ax.plot(rounds, vals.mean(0), label=label, marker=marker, markersize=4,
                    linewidth=1.6, **style)
    if vals.shape[0] > 1:
        ax.fill_between(rounds, vals.min(0), vals.max(0), color=line.get_color(), alpha=0.12,
                        linewidth=0)
    return line


def plot_accuracy_panels(histories: Mapping[str, Sequence[Sequence[Mapping]]],
                         context: str = "", title: str = "Per-client test accuracy",
                         panels=ACCURACY_PANELS, legend: bool = True,
                         markers: bool = False, x: str = "round"):
    """Small multiples over rounds, one panel per ``panels`` key (average, worst 10%,
    std of per-client accuracy), one line per algorithm (mean over seeds, band =
    min..max over seeds), one shared legend below the panels.

    ``histories`` maps an algorithm to a list (over seeds) of histories. ``x``:
    ``"round"``, or ``"clock_seconds"`` for the simulated time of a run with a clock
    (the seeds' mean at each evaluation).
    """
    n = len(histories)
    ncol = max(1, min(n, 4))
    fig = _new_figure((5.0 * len(panels), 4.2 + (0.28 * math.ceil(n / ncol) if legend else 0)))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    styles = algorithm_styles(list(histories))
    for ax, (key, panel_title, ylabel) in zip(axes, panels):
        for name, runs in histories.items():
            lines = _seed_lines(runs, key, x)
            if lines is not None:
                _draw_algorithm(ax, *lines, name, styles[name], markers)
        _x_axis(ax, x)
        if ax.has_data():  # accuracies and their std are >= 0: no negative axis range
            ax.set_ylim(bottom=max(ax.get_ylim()[0], -0.02))
        ax.set_ylabel(ylabel)
        ax.set_title(panel_title)
        ax.grid(alpha=0.3)
    fig.suptitle(_title(title, context))
    handles, labels = axes[0].get_legend_handles_labels()
    if not handles:  # e.g. no "accuracy_mean" anywhere: take the first panel that has lines
        for ax in axes:
            handles, labels = ax.get_legend_handles_labels()
            if handles:
                break
    if legend and handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=ncol, frameon=False)
    return fig


def plot_accuracy(history: Sequence[Mapping], ax=None, title: str = "Test accuracy",
                  context: str = "", x: str = "round"):
    """Per-client test accuracy of one run vs round (``x="clock_seconds"``: vs the
    simulated time of a run with a clock).

    Without ``ax``: three panels (average, worst 10%, std of per-client accuracy).
    With ``ax``: average, worst-10% and best-10% accuracy on that axes.
    """
    if ax is None:
        return plot_accuracy_panels({"run": [history]}, context=context, title=title,
                                    legend=False, markers=True, x=x)
    fig = ax.figure
    for key, label, style in (("accuracy_mean", "average", "-"),
                              ("accuracy_worst_10%", "worst 10%", "--"),
                              ("accuracy_best_10%", "best 10%", ":")):
        r, v = _series(history, key, x)
        if len(r):
            ax.plot(r, v, style, label=label, marker="o", markersize=3)
    _x_axis(ax, x)
    ax.set_ylabel("accuracy")
    ax.set_title(_title(title, context))
    ax.grid(alpha=0.3)
    _legend(ax)
    return fig


def plot_loss(history: Sequence[Mapping], ax=None, title: str = "Loss", context: str = ""):
    """Test loss (all clients, example-weighted) and cohort training loss vs round."""
    fig, ax = _new_axes(ax, figsize=(6.5, 4.2))
    for key, label in (("test_loss", "test loss"), ("train_loss", "train loss (cohort)")):
        r, v = _series(history, key)
        if len(r):
            ax.plot(r, v, label=label, marker="o", markersize=3)
    _round_axis(ax)
    ax.set_ylabel("cross-entropy")
    ax.set_title(_title(title, context))
    ax.grid(alpha=0.3)
    _legend(ax)
    return fig


def _bins(values: Sequence[np.ndarray], num_bins: int = 20):
    flat = np.concatenate([np.asarray(v, np.float64).ravel() for v in values] or [np.zeros(1)])
    flat = flat[np.isfinite(flat)]
    lo, hi = (0.0, 1.0) if flat.size == 0 else (min(0.0, flat.min()), max(1.0, flat.max()))
    return np.linspace(lo, hi, num_bins + 1)


def _clean(acc) -> np.ndarray:
    acc = np.asarray(acc, np.float64).ravel()
    return acc[np.isfinite(acc)]


def plot_client_histogram(accuracy, ax=None, title: str = "Final per-client test accuracy",
                          num_bins: int = 20, context: str = ""):
    """Histogram of per-client accuracy (clients without test data already removed)."""
    fig, ax = _new_axes(ax, figsize=(6.5, 4.2))
    acc = np.asarray(accuracy, np.float64)
    ax.hist(acc[np.isfinite(acc)], bins=_bins([acc], num_bins), edgecolor="black", alpha=0.8)
    ax.set_xlabel("accuracy")
    ax.set_ylabel("clients")
    ax.set_title(_title(title, context))
    return fig


def plot_compare_accuracy(histories: Mapping[str, Sequence[Sequence[Mapping]]], ax=None,
                          key: str = "accuracy_mean", title: str = "Per-client test accuracy",
                          context: str = "", x: str = "round", reference: Sequence[str] = (),
                          legend: bool = True):
    """One line per algorithm vs round, mean over seeds, band = min..max.

    Without ``ax``: three panels (average, worst 10%, std; see
    :func:`plot_accuracy_panels`). With ``ax``: only ``key`` on that axes.
    ``histories`` maps an algorithm to a list (over seeds) of histories.
    """
    if ax is None:
        return plot_accuracy_panels(histories, context=context, title=title, x=x)
    fig = ax.figure
    styles = algorithm_styles(list(histories), reference)
    for name, runs in histories.items():
        lines = _seed_lines(runs, key, x)
        if lines is not None:
            _draw_algorithm(ax, *lines, name, styles[name])
    _x_axis(ax, x)
    ax.set_ylabel(dict((k, y) for k, _, y in ACCURACY_PANELS).get(key, key))
    ax.set_title(_title(title, context))
    ax.grid(alpha=0.3)
    if legend:
        _legend(ax, fontsize="small")
    return fig


def plot_compare_histograms(accuracies: Mapping[str, np.ndarray], ax=None,
                            title: str = "Final per-client test accuracy", num_bins: int = 20,
                            context: str = ""):
    """Overlaid step histograms of per-client accuracy, one per algorithm (readable for
    a few algorithms; see :func:`plot_compare_boxplots` for many)."""
    fig, ax = _new_axes(ax, figsize=(7.0, 4.5))
    bins = _bins(list(accuracies.values()), num_bins)
    styles = algorithm_styles(list(accuracies))
    for name, acc in accuracies.items():
        ax.hist(_clean(acc), bins=bins, histtype="step", linewidth=1.5, label=name,
                **styles[name])
    ax.set_xlabel("accuracy")
    ax.set_ylabel("clients")
    ax.set_title(_title(title, context))
    _legend(ax, fontsize="small")
    return fig


def plot_compare_boxplots(accuracies: Mapping[str, np.ndarray], ax=None,
                          title: str = "Final per-client test accuracy", context: str = ""):
    """One horizontal box per algorithm (first algorithm on top): median, quartiles,
    whiskers at 1.5 IQR, outlying clients as points; the mean as a white diamond."""
    names = list(accuracies)
    fig, ax = _new_axes(ax, figsize=(7.5, 1.6 + 0.38 * max(len(names), 1)))
    styles = algorithm_styles(names)
    data = [_clean(accuracies[n]) for n in names]
    keep = [i for i, d in enumerate(data) if d.size]
    if keep:
        pos = [len(names) - i for i in keep]
        bp = ax.boxplot([data[i] for i in keep], positions=pos, orientation="horizontal",
                        widths=0.6, patch_artist=True, showmeans=True,
                        meanprops=dict(marker="D", markerfacecolor="white",
                                       markeredgecolor="black", markersize=4),
                        flierprops=dict(marker=".", markersize=3, alpha=0.5),
                        medianprops=dict(color="black"))
        for box, i in zip(bp["boxes"], keep):
            box.set_facecolor(styles[names[i]]["color"])
            box.set_alpha(0.75)
    ax.set_yticks(range(len(names), 0, -1), names)
    ax.set_ylim(0.4, len(names) + 0.6)
    ax.set_xlabel("accuracy")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(_title(title, context))
    return fig


def plot_compare_ecdf(accuracies: Mapping[str, np.ndarray], ax=None,
                      title: str = "Final per-client test accuracy (ECDF)", context: str = "",
                      reference: Sequence[str] = ()):
    """Empirical CDF of per-client accuracy, one step curve per algorithm: the fraction
    of clients at or below each accuracy (curves further right are better; the left
    tail shows the worst clients)."""
    names = list(accuracies)
    ncol = _side_columns(len(names))
    fig, ax = _new_axes(ax, figsize=(6.5 + 2.2 * ncol, 5.0))
    styles = algorithm_styles(names, reference)
    for name in names:
        acc = np.sort(_clean(accuracies[name]))
        if not acc.size:
            continue
        frac = np.arange(1, acc.size + 1) / acc.size
        ax.step(np.concatenate([[acc[0]], acc]), np.concatenate([[0.0], frac]), where="post",
                label=name, linewidth=1.6, marker="o" if acc.size <= 2 else None,
                **styles[name])
    ax.set_xlabel("accuracy")
    ax.set_ylabel("fraction of clients ≤ accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(_title(title, context))
    _side_legend(ax, ncol)
    return fig


def lorenz_curve(values) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of the Lorenz curve of non-negative values: x = fraction of clients
    (ascending by value), y = their share of the total; starts at (0, 0), ends at (1, 1).
    All-zero values give the curve of total inequality."""
    v = np.sort(_clean(values))
    n = v.size
    x = np.arange(n + 1) / max(n, 1)
    total = v.sum()
    if n == 0 or total <= 0:
        y = np.zeros(n + 1)
        y[-1] = 1.0
        return x, y
    return x, np.concatenate([[0.0], np.cumsum(v) / total])


def gini_coefficient(values) -> float:
    """Gini of non-negative values (as :func:`fedjax_fair.metrics.gini`; 1 if all zero)."""
    v = np.sort(_clean(values))
    n = v.size
    if n == 0:
        return math.nan
    total = v.sum()
    if total == 0:
        return 1.0
    return float(np.sum((2 * np.arange(1, n + 1) - n - 1) * v) / (n * total))


def plot_lorenz(accuracies, ax=None, title: str = "Lorenz curve of final per-client accuracy",
                context: str = "", reference: Sequence[str] = ()):
    """Lorenz curve(s) of per-client accuracy, with the Gini coefficient in the legend and
    the line of equality dashed. ``accuracies``: one array, or a mapping from an
    algorithm to an array (one curve each)."""
    single = not isinstance(accuracies, Mapping)
    data = {"clients": accuracies} if single else dict(accuracies)
    names = list(data)
    ncol = _side_columns(len(names))
    fig, ax = _new_axes(ax, figsize=(5.2 if single else 4.8 + 2.8 * ncol, 5.0))
    styles = algorithm_styles(names, reference)
    ax.plot([0, 1], [0, 1], linestyle="--", color="grey", linewidth=1, label="equality")
    for name in names:
        acc = _clean(data[name])
        if not acc.size:
            continue
        x, y = lorenz_curve(acc)
        g = gini_coefficient(acc)
        style = {"color": "C0", "linestyle": "-"} if single else styles[name]
        ax.plot(x, y, label=f"{name} (Gini {g:.3f})" if not single else f"Gini {g:.3f}",
                linewidth=1.6, marker="o" if acc.size <= 2 else None, **style)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_aspect("equal")
    ax.set_xlabel("fraction of clients (lowest accuracy first)")
    ax.set_ylabel("share of total accuracy")
    ax.grid(alpha=0.3)
    ax.set_title(_title(title, context))
    if single:
        ax.legend(loc="upper left")
    else:
        _side_legend(ax, ncol)
    return fig


def moving_average(values, window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` points (fewer at the start)."""
    v = np.asarray(values, np.float64)
    if window <= 1 or v.size == 0:
        return v
    c = np.cumsum(np.insert(v, 0, 0.0))
    idx = np.arange(1, v.size + 1)
    start = np.maximum(idx - window, 0)
    return (c[idx] - c[start]) / (idx - start)


def plot_improved_fraction(curves, ax=None, title: str = "Participants whose training loss "
                           "did not rise", context: str = "", window: Optional[int] = None,
                           reference: Sequence[str] = ()):
    """The share of each round's participants whose training loss did not rise over
    the round (DQN-Fed eq. 29; ``improved_fraction`` in ``rounds.jsonl``), in percent
    against the round, as a trailing moving average (``window``: about 1/30 of the
    run by default). ``curves``: one array [R], or a mapping from an algorithm to a
    list (over seeds) of arrays, averaged over the seeds."""
    single = not isinstance(curves, Mapping)
    data = {"run": [curves]} if single else {k: list(v) for k, v in curves.items()}
    ncol = _side_columns(len(data))
    fig, ax = _new_axes(ax, figsize=(7.5, 4.4) if single else (6.5 + 2.2 * ncol, 5.0))
    styles = algorithm_styles(list(data), reference)
    longest = max((len(c) for runs in data.values() for c in runs), default=0)
    window = window or max(1, longest // 30)
    for name, runs in data.items():
        runs = [np.asarray(c, np.float64) for c in runs if len(c)]
        if not runs:
            continue
        n = min(len(c) for c in runs)
        mean = np.mean([c[:n] for c in runs], axis=0)
        style = {"color": "C0", "linestyle": "-"} if single else styles[name]
        ax.plot(np.arange(1, n + 1), 100 * moving_average(mean, window), linewidth=1.6,
                label=None if single else name, **style)
    _round_axis(ax)
    ax.set_ylabel(f"improved clients (%), mean of {window} round{'s' if window > 1 else ''}")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.set_title(_title(title, context))
    if not single:
        _side_legend(ax, ncol)
    return fig


# ------------------------------------------------------------------- by family


def plot_family_accuracy(histories: Mapping[str, Sequence[Sequence[Mapping]]],
                         groups: Sequence[tuple[str, Sequence[str]]],
                         reference: Sequence[str] = (), context: str = "",
                         title: str = "Per-client test accuracy", x: str = "round",
                         panels=ACCURACY_PANELS[:2]):
    """One row of panels per family group (``family_groups``), one column per
    ``panels`` key (average and worst-10% accuracy), the group's methods and the
    ``reference`` (FedAvg, black dashed) in each, the row's legend at its right: at
    most ``MAX_LINES`` + 1 lines on one set of axes, whatever the number compared."""
    groups = [(t, [n for n in names if n in histories]) for t, names in groups]
    groups = [(t, names) for t, names in groups if names] or [("", [])]
    refs = [r for r in reference if r in histories]
    fig = _new_figure((4.6 * len(panels) + 2.4, 0.9 + 3.1 * len(groups)))
    axes = fig.subplots(len(groups), len(panels), squeeze=False)
    for row, (group, names) in zip(axes, groups):
        subset = {n: histories[n] for n in refs + names}
        for ax, (key, panel_title, _) in zip(row, panels):
            plot_compare_accuracy(subset, ax=ax, key=key, x=x, reference=refs, legend=False,
                                  title=f"{group}: {panel_title.lower()}" if group
                                  else panel_title)
            if ax.has_data():
                ax.set_ylim(bottom=max(ax.get_ylim()[0], -0.02))
        _side_legend(row[-1], 1)
    fig.suptitle(_title(title, context))
    return fig


def plot_by_family(plot, data: Mapping, groups: Sequence[tuple[str, Sequence[str]]],
                   reference: Sequence[str] = (), context: str = "", title: str = "",
                   ncols: int = 2, panel_size=(4.8, 3.9)):
    """Small multiples of a comparison plot, one panel per family group: ``plot(subset,
    ax=ax, title=group, reference=...)`` (``plot_compare_ecdf``, ``plot_lorenz``,
    ``plot_improved_fraction``) on the group's methods and the ``reference``."""
    groups = [(t, [n for n in names if n in data]) for t, names in groups]
    groups = [(t, names) for t, names in groups if names] or [("", [])]
    refs = [r for r in reference if r in data]
    ncols = min(ncols, len(groups))
    nrows = math.ceil(len(groups) / ncols)
    fig = _new_figure((panel_size[0] * ncols + 2.2 * ncols, 0.9 + panel_size[1] * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, (group, names) in zip(axes, groups):
        plot({n: data[n] for n in refs + names}, ax=ax, title=group, reference=refs)
    for ax in axes[len(groups):]:
        ax.set_visible(False)
    fig.suptitle(_title(title, context))
    return fig


def plot_family_boxplots(accuracies: Mapping[str, np.ndarray],
                         groups: Sequence[tuple[str, Sequence[str]]],
                         reference: Sequence[str] = (), context: str = "",
                         title: str = "Final per-client test accuracy"):
    """``plot_compare_boxplots`` with the methods ordered by family: the reference
    first, then each group under its title (a label and a rule between groups)."""
    refs = [r for r in reference if r in accuracies]
    order, marks = list(refs), []
    for group, names in groups:
        names = [n for n in names if n in accuracies and n not in order]
        if names:
            marks.append((len(order), group))
            order += names
    fig = plot_compare_boxplots({n: accuracies[n] for n in order}, title=title, context=context)
    ax = fig.axes[0]
    for start, group in marks:  # a rule above each group, its title beside the axes
        y = len(order) - start + 0.5
        ax.axhline(y, color="grey", linewidth=0.8)
        ax.text(1.01, y - 0.1, group, transform=ax.get_yaxis_transform(), ha="left",
                va="top", fontsize="small", color="dimgrey", clip_on=False)
    return fig
