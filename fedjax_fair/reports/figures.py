"""Figures of simulation results, as small functions of plain data.

Plots are drawn on ``matplotlib.figure.Figure`` objects with the Agg canvas, never
through pyplot, so importing this module does not change the matplotlib backend of
a notebook and nothing needs a display. Each ``plot_*`` function draws on a given
``ax`` or on a new figure, and returns the figure; ``save_figure`` writes a PNG."""

import math
import os
from typing import Mapping, Optional, Sequence

import numpy as np

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


def plot_sensitivity(curves: Mapping[str, Mapping], ax=None,
                     title: str = "Selection metric against the client rate",
                     context: str = "", reference: Sequence[str] = (),
                     ylabel: str = "validation score"):
    """A tuned comparison's sensitivity: per method, the validation score its setting
    was selected by against the client rate (log axis), the method's other
    hyper-parameters at their selected values; a band of ± one std over the tuning
    seeds and a star at the selected point. ``curves``: ``{name: {"x": [...], "mean":
    [...], "std": [...], "selected": (x, y)}}`` (``reports.compare.sensitivity_curves``)."""
    names = list(curves)
    ncol = _side_columns(len(names))
    fig, ax = _new_axes(ax, figsize=(6.5 + 2.2 * ncol, 5.0))
    styles = algorithm_styles(names, reference)
    for name in names:
        c = curves[name]
        x, mean, std = (np.asarray(c[k], np.float64) for k in ("x", "mean", "std"))
        ok = np.isfinite(mean)
        if not ok.any():
            continue
        ax.plot(x[ok], mean[ok], label=name, linewidth=1.6, marker="o", markersize=3,
                **styles[name])
        ax.fill_between(x[ok], (mean - std)[ok], (mean + std)[ok], alpha=0.15,
                        color=styles[name]["color"], linewidth=0)
        if c.get("selected") is not None:
            ax.plot(*c["selected"], marker="*", markersize=12, linestyle="none",
                    color=styles[name]["color"], markeredgecolor="black")
    ax.set_xscale("log")
    from matplotlib.ticker import NullFormatter
    ax.xaxis.set_minor_formatter(NullFormatter())  # decade labels only: no overlaps
    ax.set_xlabel("client learning rate (others at their selected values; ★ selected)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.set_title(_title(title, context))
    _side_legend(ax, ncol)
    return fig
