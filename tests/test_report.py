"""Plot functions of ``fedjax_fair.reports`` on small synthetic data (no simulation)."""
import numpy as np
import pytest

from fedjax_fair import reports as report

CONTEXT = "synthetic, logreg, 20 rounds, seeds 0,1"


def _history(rounds=(0, 5, 10, 15, 20), shift=0.0):
    return [{"round": r, "accuracy_mean": 0.5 + shift + 0.01 * r,
             "accuracy_worst_10%": 0.1 + 0.01 * r,
             "accuracy_best_10%": 0.9, "accuracy_std": 0.3 - 0.005 * r, "test_loss": 2.0 - 0.05 * r,
             "train_loss": 1.5 - 0.03 * r} for r in rounds]


def _names(n):
    return [f"alg{i}" for i in range(n)]


def _data_lines(ax):
    return [l for l in ax.get_lines() if l.get_label() and not l.get_label().startswith("_")]


def _all_text(fig):
    parts = [fig.get_suptitle()] + [ax.get_title() for ax in fig.axes]
    return "\n".join(parts)


def _assert_integer_round_ticks(ax):
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_styles_distinct_for_many_algorithms_and_deterministic():
    names = _names(16)
    styles = report.algorithm_styles(names)
    pairs = {(tuple(s["color"]), s["linestyle"]) for s in styles.values()}
    assert len(pairs) == 16
    assert report.algorithm_styles(names) == styles
    assert len({(tuple(s["color"]), s["linestyle"])
                for s in report.algorithm_styles(_names(40)).values()}) == 40


def test_compare_accuracy_panels_lines_styles_ticks_and_title():
    names = _names(16)
    histories = {n: [_history(shift=0.01 * i), _history(shift=0.02 * i)]
                 for i, n in enumerate(names)}
    fig = report.plot_compare_accuracy(histories, context=CONTEXT)
    assert len(fig.axes) == 3
    for ax in fig.axes:
        lines = _data_lines(ax)
        assert len(lines) == 16
        assert len({(l.get_color(), l.get_linestyle()) for l in lines}) == 16
        _assert_integer_round_ticks(ax)
    assert len(fig.legends) == 1
    assert CONTEXT in _all_text(fig)
    # The three panels plot mean, worst 10% and std (values of the first algorithm).
    first = [_data_lines(ax)[0].get_ydata() for ax in fig.axes]
    h = _history()
    for ydata, key in zip(first, ("accuracy_mean", "accuracy_worst_10%", "accuracy_std")):
        assert ydata[-1] == pytest.approx(h[-1][key])


def test_compare_accuracy_on_given_axes_stays_single_panel():
    fig = report.plot_compare_accuracy({"a": [_history()], "b": [_history()]},
                                       context=CONTEXT)
    ax = fig.axes[0]
    fig2 = report.plot_compare_accuracy({"a": [_history()]}, ax=ax, key="accuracy_worst_10%")
    assert fig2 is fig


def test_one_point_history_drawn_with_marker():
    histories = {"fedavg": [_history()], "fedprox (diverged)": [_history(rounds=(0,))]}
    fig = report.plot_compare_accuracy(histories, context=CONTEXT)
    for ax in fig.axes:
        line = next(l for l in _data_lines(ax) if l.get_label() == "fedprox (diverged)")
        assert len(line.get_xdata()) == 1
        assert line.get_marker() not in (None, "None", "", " ")
    fig = report.plot_accuracy(_history(rounds=(3,)), context=CONTEXT)
    for ax in fig.axes:
        assert _data_lines(ax)[0].get_marker() not in (None, "None", "", " ")


def test_run_accuracy_loss_histogram():
    fig = report.plot_accuracy(_history(), context=CONTEXT)
    assert len(fig.axes) == 3
    for ax in fig.axes:
        assert len(_data_lines(ax)) == 1
        _assert_integer_round_ticks(ax)
    assert CONTEXT in _all_text(fig)
    fig = report.plot_loss(_history(), context=CONTEXT)
    assert len(_data_lines(fig.axes[0])) == 2
    _assert_integer_round_ticks(fig.axes[0])
    assert CONTEXT in _all_text(fig)
    fig = report.plot_client_histogram(np.linspace(0, 1, 30), context=CONTEXT)
    assert CONTEXT in _all_text(fig)
    assert len(fig.axes[0].patches) > 0


def test_lorenz_curve_and_gini():
    acc = np.array([0.0, 0.2, 0.5, 0.9, 1.0, np.nan])
    x, y = report.lorenz_curve(acc)
    assert (x[0], y[0]) == (0.0, 0.0)
    assert x[-1] == pytest.approx(1.0) and y[-1] == pytest.approx(1.0)
    assert np.all(y <= x + 1e-12) and np.all(np.diff(y) >= 0)
    assert report.gini_coefficient(np.ones(5)) == pytest.approx(0.0)
    assert report.gini_coefficient([0, 0, 0, 1]) == pytest.approx(0.75)
    x, y = report.lorenz_curve(np.ones(4))
    np.testing.assert_allclose(x, y)


def test_plot_lorenz_single_and_many():
    rng = np.random.default_rng(0)
    fig = report.plot_lorenz(rng.uniform(size=40), context=CONTEXT)
    ax = fig.axes[0]
    lines = _data_lines(ax)
    assert len(lines) == 2  # equality diagonal + the curve
    diag = [l for l in lines if l.get_linestyle() == "--"]
    assert len(diag) == 1
    np.testing.assert_allclose(diag[0].get_xdata(), diag[0].get_ydata())
    curve = [l for l in lines if l is not diag[0]][0]
    assert curve.get_xdata()[-1] == pytest.approx(1.0)
    assert curve.get_ydata()[-1] == pytest.approx(1.0)
    assert np.all(curve.get_ydata() <= curve.get_xdata() + 1e-12)
    assert "Gini" in curve.get_label() or "gini" in curve.get_label().lower()
    assert CONTEXT in _all_text(fig)
    accs = {n: rng.uniform(size=30) for n in _names(16)}
    fig = report.plot_lorenz(accs, context=CONTEXT)
    curves = [l for l in _data_lines(fig.axes[0]) if l.get_label().startswith("alg")]
    assert len(curves) == 16
    assert len({(l.get_color(), l.get_linestyle()) for l in curves}) == 16


def test_compare_boxplots_and_ecdf():
    rng = np.random.default_rng(1)
    names = _names(16)
    accs = {n: rng.uniform(size=25) for n in names}
    accs["alg3"] = np.array([0.4])  # a single client
    fig = report.plot_compare_boxplots(accs, context=CONTEXT)
    ax = fig.axes[0]
    pos = {t.get_text(): y for t, y in zip(ax.get_yticklabels(), ax.get_yticks())}
    assert sorted(pos, key=pos.get, reverse=True) == names  # first algorithm on top
    assert CONTEXT in _all_text(fig)
    fig = report.plot_compare_ecdf(accs, context=CONTEXT)
    lines = _data_lines(fig.axes[0])
    assert len(lines) == 16
    assert len({(l.get_color(), l.get_linestyle()) for l in lines}) == 16
    for l in lines:
        assert l.get_ydata()[-1] == pytest.approx(1.0)
        assert np.all(np.diff(l.get_ydata()) >= 0)
    assert CONTEXT in _all_text(fig)


def test_save_figure_writes_png(tmp_path):
    fig = report.plot_compare_accuracy({"a": [_history()], "b (personal)": [_history()]},
                                       context=CONTEXT)
    path = tmp_path / "sub" / "accuracy.png"
    report.save_figure(fig, str(path))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_moving_average_is_a_trailing_mean():
    np.testing.assert_allclose(report.moving_average([1, 2, 3, 4, 5], 2), [1, 1.5, 2.5, 3.5, 4.5])
    np.testing.assert_allclose(report.moving_average([1, 2, 3], 1), [1, 2, 3])
    np.testing.assert_allclose(report.moving_average([4, 0, 2], 10), [4, 2, 2])


@pytest.mark.parametrize("plot", ["improved", "ecdf", "lorenz"])
def test_every_method_plots_keep_their_axes_beside_a_long_legend(tmp_path, plot):
    """The README's compare plots 37 methods: the legend beside the axes must leave the
    axes their size (the improved-fraction plot's collapsed under one 37-row column)."""
    import warnings
    names = [f"method_{i}" for i in range(40)]
    rng = np.random.default_rng(0)
    fig = {"improved": lambda: report.plot_improved_fraction(
               {n: [rng.uniform(size=150)] for n in names}),
           "ecdf": lambda: report.plot_compare_ecdf({n: rng.uniform(size=30) for n in names}),
           "lorenz": lambda: report.plot_lorenz({n: rng.uniform(size=30) for n in names})}[plot]()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns when constrained layout collapses
        report.save_figure(fig, str(tmp_path / f"{plot}.png"))
    box = fig.axes[0].get_position()
    assert box.height > 0.5 and box.width > 0.3


def test_improved_fraction_plot_draws_one_smoothed_line_per_algorithm(tmp_path):
    curves = {"a": [np.array([1.0, 0.5, 1.0, 1.0]), np.array([1.0, 1.0, 0.0, 1.0])],
              "b": [np.array([0.0, 0.0, 1.0, 1.0])]}
    fig = report.plot_improved_fraction(curves, context="toy", window=2)
    lines = {l.get_label(): l for l in fig.axes[0].get_lines()}
    np.testing.assert_allclose(lines["a"].get_ydata(), [100, 87.5, 62.5, 75.0])
    np.testing.assert_allclose(lines["b"].get_xdata(), [1, 2, 3, 4])
    report.save_figure(fig, str(tmp_path / "imp.png"))
    assert (tmp_path / "imp.png").stat().st_size > 1000
    single = report.plot_improved_fraction(np.ones(90))  # window 90 // 30 = 3
    assert "3 rounds" in single.axes[0].get_ylabel()


# ------------------------------------------------------------------- by family

TITLES = {"reference": "FedAvg", "server": "server optimisers", "fair": "fair aggregation"}


def test_family_groups_order_split_and_reference():
    families = {"fedavg": "reference", **{f"f{i}": "fair" for i in range(9)},
                "adam": "server", "x": "unknown"}
    groups = report.family_groups(families, TITLES)
    assert [t for t, _ in groups] == ["server optimisers", "fair aggregation", "unknown"]
    assert all("fedavg" not in names for _, names in groups)
    split = report.family_groups(families, TITLES, max_size=4)
    fair = [(t, n) for t, n in split if t.startswith("fair")]
    assert [t for t, _ in fair] == [f"fair aggregation ({i}/3)" for i in (1, 2, 3)]
    assert [len(n) for _, n in fair] == [3, 3, 3]  # near-equal parts, in the given order
    assert sum((n for _, n in fair), []) == [f"f{i}" for i in range(9)]
    assert report.references(families) == ["fedavg"]


def _agg(mean, worst, gini, seconds):
    keys = [k for k, *_ in report.TABLE_COLUMNS]
    values = dict.fromkeys(keys, 0.5) | {"accuracy_mean": mean, "accuracy_worst_10%": worst,
                                         "accuracy_gini": gini, "run_seconds": seconds}
    return {k: (values[k], 0.0) for k in keys}


def test_family_tables_lead_with_reference_and_bold_the_best_within_each_family():
    rows = {"fedavg": _agg(0.60, 0.10, 0.20, 3.0), "qffl": _agg(0.58, 0.30, 0.10, 2.0),
            "afl": _agg(0.62, 0.20, 0.15, 2.0), "adam": _agg(0.70, 0.05, 0.30, 1.0)}
    families = {"fedavg": "reference", "qffl": "fair", "afl": "fair", "adam": "server"}
    tables = report.family_tables(rows, 1, families, TITLES)
    assert [t for t, *_ in tables] == ["server optimisers", "fair aggregation"]
    header, body = tables[1][1], tables[1][2]
    col = {h: i for i, h in enumerate(header)}
    cell = {r[0]: r for r in body}
    assert [r[0] for r in body] == ["fedavg (reference)", "qffl", "afl"]
    assert cell["afl"][col["Average (%)"]] == "**62.00**"  # higher is better
    assert cell["qffl"][col["Worst 10% (%)"]] == "**30.00**"
    assert cell["qffl"][col["Gini"]] == "**0.1000**"  # lower is better
    assert "**" not in cell["qffl"][col["Run (s)"]]  # a tie of every member marks nothing
    assert not any("**" in c for c in cell["fedavg (reference)"])  # the reference is not ranked
    assert not any("**" in c for r in tables[0][2] for c in r)  # one member: nothing to mark
    md = report.family_markdown(tables)
    assert md.count("### ") == 2 and md.count("fedavg (reference)") == 2


def test_family_figures_keep_at_most_eight_lines_per_axes():
    names = [f"fair{i}" for i in range(13)] + ["fedavg"]
    families = {n: "fair" for n in names[:-1]} | {"fedavg": "reference"}
    groups = report.family_groups(families, TITLES, report.MAX_LINES)
    histories = {n: [_history(shift=0.01 * i)] for i, n in enumerate(names)}
    fig = report.plot_family_accuracy(histories, groups, ["fedavg"], context=CONTEXT)
    axes = [ax for ax in fig.axes if ax.has_data()]
    assert len(axes) == 2 * len(groups) == 4
    for ax in axes:
        labels = [l.get_label() for l in _data_lines(ax)]
        assert len(labels) <= report.MAX_LINES + 1 and labels[0] == "fedavg"
        reference = _data_lines(ax)[0]
        assert reference.get_color() == "black" and reference.get_linestyle() == "--"
    rng = np.random.default_rng(0)
    accs = {n: rng.uniform(size=20) for n in names}
    for plot in (report.plot_compare_ecdf, report.plot_lorenz):
        fig = report.plot_by_family(plot, accs, groups, ["fedavg"], context=CONTEXT)
        shown = [ax for ax in fig.axes if ax.get_visible()]
        assert len(shown) == len(groups)
        for ax in shown:
            assert 2 <= len([l for l in _data_lines(ax) if l.get_label() != "equality"]) \
                <= report.MAX_LINES + 1
    fig = report.plot_family_boxplots(accs, groups, ["fedavg"], context=CONTEXT)
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert ticks[0] == "fedavg" and len(ticks) == len(names)


def test_guard_context_names_the_privacy_spent_and_the_attack():
    assert report.guard_context({"dp_noise": None, "attack": None}) == ""
    text = report.guard_context({"dp_noise": 1.0, "dp_delta": 1e-5, "attack": "sign_flip:3",
                                 "malicious_fraction": 0.2, "robust": "median"}, 4.0)
    assert "ε = 4.00 at δ = 1e-05" in text and "sign_flip:3 by 0.2" in text
    assert "robust median" in text
