"""The files a run folder holds, written so that a crash between two writes leaves the
old file or the new one, never half of one: JSON (non-finite numbers as null), JSON
lines, and the per-client and per-round CSV tables."""

import csv
import json
import math
import os
from typing import Iterable, Mapping

import numpy as np

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
