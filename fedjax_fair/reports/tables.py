"""The comparison tables: per-method rows of mean ± std over seeds, grouped by family
with the best value of each column in bold, as Markdown and CSV."""

import csv
import math
from typing import Mapping, Optional, Sequence

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
                     columns=TABLE_COLUMNS,
                     priors: Optional[Mapping[str, str]] = None
                     ) -> tuple[list[str], list[list[str]]]:
    """(header, formatted rows) of the paper-style table.

    ``rows`` maps an algorithm name to ``aggregate_runs(...)``; with more than one seed
    every cell reads ``mean ± std``. ``notes`` (e.g. "diverged at round 7") adds a column.
    ``priors`` (``registry.prior_of``: size, uniform, own) adds a "Prior" column after
    the name: which FedAvg a row is to be read against.
    """
    header = ["Algorithm"] + (["Prior"] if priors else []) + [h for _, h, _, _ in columns]
    notes = notes or {}
    if any(notes.values()):
        header.append("Note")
    body = []
    for name, agg in rows.items():
        cells = [name] + ([priors.get(name, "")] if priors else [])
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
                  columns=TABLE_COLUMNS,
                  priors: Optional[Mapping[str, str]] = None) -> list[tuple[str, list, list]]:
    """``[(family title, header, body)]``: ``comparison_table`` cut by family
    (``family_groups``), each table led by the reference rows (FedAvg, labelled
    "(reference)") and the best value of every column within the family in bold
    (``**...**``; higher accuracies, lower std / Gini / ECE / seconds). Without a
    family besides the reference, one table of everything."""
    header, body = comparison_table(rows, num_seeds, notes, columns, priors)
    first = 2 if priors else 1  # the first numeric column
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
            for j, key in enumerate(keys, start=first):
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
                         columns=TABLE_COLUMNS,
                         extra: Optional[Mapping[str, Mapping[str, str]]] = None) -> None:
    """The comparison table, machine-readable: the Markdown table's values in its units
    (accuracies in percent; the unit is in the column name) at full precision, each
    column's mean over seeds followed by its std over seeds (``*_seed_std``), and
    each algorithm's family (``algorithms.FAMILIES``'s key) when ``families`` is given.
    ``extra``: ``{algorithm: {column: text}}``, further columns at the end (a tuned
    comparison's selected setting, its score and its grid)."""
    families = families or {}
    names = list(next(iter(extra.values())).keys()) if extra else []
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["algorithm", "family", "num_seeds"]
                   + [c for _, _, name, _ in columns for c in (name, f"{name}_seed_std")]
                   + names)
        for name, agg in rows.items():
            w.writerow([name, families.get(name, ""), num_seeds]
                       + [repr(v * scale) for key, _, _, scale in columns
                          for v in agg[key]]
                       + [(extra or {}).get(name, {}).get(c, "") for c in names])
