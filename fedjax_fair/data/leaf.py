"""LEAF JSON federations (FEMNIST, Shakespeare, Synthetic) read into host arrays.

LEAF (Caldas et al. 2018, "LEAF: A Benchmark for Federated Settings") and the
fair-FL reference code built on it (q-FFL, Li et al. 2020; AFL, Mohri et al. 2019)
store a federation as JSON files. Every file holds::

    {"users": [u_1, ..., u_K],            # user ids
     "num_samples": [n_1, ..., n_K],      # examples per user
     "user_data": {u_k: {"x": [...], "y": [...]}, ...}}

and a split directory (``train/`` or ``test/``) holds one or more such files, each
with its own users. ``read_leaf_dir`` merges and validates one directory;
``load_leaf`` reads both splits and converts them into per-user arrays:

- ``images`` (FEMNIST): x rows of 784 floats -> float32 [n, 28, 28, 1], 62 classes.
- ``shakespeare``: x strings of 80 characters, y the next character; both are
  mapped to ids in LEAF's 80-symbol alphabet ``LEAF_CHARS`` -> x int32 [n, 80],
  y int32 [n]. A character outside the alphabet raises an error (``oov="error"``)
  or gets the extra id 80 (``oov="extra"``, then 81 classes).
- ``vectors`` (LEAF Synthetic, q-FFL's vector data sets): x float32 [n, d].

The user order is the sorted user ids, the same in both splits; a user present in
only one split is an error (LEAF's ``-t sample`` split keeps every user in both).
"""
from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

from fedjax_fair.data.federated import _as_labels
from fedjax_fair import hparams as H
from fedjax_fair.hparams import FieldError

# The 80 characters of LEAF's Shakespeare models (ALL_LETTERS in LEAF's
# models/utils/language_utils.py, also used by the q-FFL code); id = position.
LEAF_CHARS = ("\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]"
              "abcdefghijklmnopqrstuvwxyz}")
FEMNIST_SIDE = 28
FEMNIST_CLASSES = 62
KINDS = ("auto", "images", "shakespeare", "vectors")
OOV_POLICIES = ("error", "extra")


class LeafFederation(NamedTuple):
    """A LEAF federation as per-user host arrays (user k = row k of every list).

    user_ids: sorted user ids (str).
    train_xs, test_xs: per-user inputs, float32 [n_k, 28, 28, 1] (images), int32
      [n_k, L] character ids (shakespeare) or float32 [n_k, d] (vectors).
    train_ys, test_ys: per-user int32 [n_k] labels in [0, num_classes).
    num_classes: number of classes (next-character ids for shakespeare).
    input_shape: per-example input shape, e.g. (28, 28, 1), (80,) or (60,).
    vocab: the character alphabet for shakespeare (id = position; with
      oov="extra" id len(vocab) is the unknown character), None otherwise.
    kind: "images", "shakespeare" or "vectors".
    """

    user_ids: list
    train_xs: list
    train_ys: list
    test_xs: list
    test_ys: list
    num_classes: int
    input_shape: tuple
    vocab: str | None
    kind: str


# --------------------------------------------------------------------------- JSON files


def _load_json(file: Path) -> dict:
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise FieldError("leaf", f"{file}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise FieldError("leaf", f"{file}: expected a JSON object with 'users', "
                                 f"'num_samples' and 'user_data', got {type(data).__name__}")
    for key in ("users", "num_samples", "user_data"):
        if key not in data:
            raise FieldError("leaf", f"{file}: missing key {key!r}")
    if not isinstance(data["users"], list) or not isinstance(data["num_samples"], list):
        raise FieldError("leaf", f"{file}: 'users' and 'num_samples' must be lists")
    if not isinstance(data["user_data"], dict):
        raise FieldError("leaf", f"{file}: 'user_data' must be an object")
    return data


def _check_user(file: Path, user: str, count, entry) -> tuple[list, list]:
    """The (x, y) lists of one user entry after checking them against num_samples."""
    if not isinstance(entry, dict):
        raise FieldError("leaf", f"{file}: user {user!r}: user_data entry must be an "
                                 f"object with 'x' and 'y'")
    for key in ("x", "y"):
        if key not in entry:
            raise FieldError("leaf", f"{file}: user {user!r}: missing key {key!r}")
        if not isinstance(entry[key], list):
            raise FieldError("leaf", f"{file}: user {user!r}: {key!r} must be a list")
    x, y = entry["x"], entry["y"]
    if len(x) != len(y):
        raise FieldError("leaf", f"{file}: user {user!r} has {len(x)} x but {len(y)} y")
    if isinstance(count, bool) or not isinstance(count, int) or count != len(y):
        raise FieldError("leaf", f"{file}: user {user!r}: num_samples says {count!r} but "
                                 f"the user has {len(y)} examples")
    return x, y


def _read_leaf_file(file: Path, seen: dict) -> dict:
    """user -> (x, y) of one file; ``seen`` (user -> file) catches repeated users."""
    data = _load_json(file)
    users, counts, user_data = data["users"], data["num_samples"], data["user_data"]
    if len(users) != len(counts):
        raise FieldError("leaf", f"{file}: 'users' has {len(users)} entries but "
                                 f"'num_samples' has {len(counts)}")
    out = {}
    for raw_user, count in zip(users, counts):
        user = str(raw_user)
        if user in seen:
            where = "earlier in this file" if seen[user] == file else f"also in {seen[user]}"
            raise FieldError("leaf", f"{file}: user {user!r} is listed twice ({where})")
        seen[user] = file
        if user not in user_data:
            raise FieldError("leaf", f"{file}: user {user!r} is in 'users' but not in "
                                     f"'user_data'")
        out[user] = _check_user(file, user, count, user_data[user])
    extra = sorted(set(user_data) - set(out))
    if extra:
        raise FieldError("leaf", f"{file}: user {extra[0]!r} is in 'user_data' but not in "
                                 f"'users'")
    return out


def read_leaf_dir(path, *, field: str = "path") -> dict:
    """Reads and merges every ``*.json`` file of one LEAF split directory.

    Files are read in sorted name order. Checks: the keys ``users``,
    ``num_samples`` and ``user_data`` exist; ``users`` and ``num_samples`` have the
    same length; each user's ``x`` and ``y`` have the same length, equal to its
    ``num_samples`` entry; no user is listed twice (in one file or across files);
    ``users`` and the keys of ``user_data`` name the same users. Every error names
    the file and, where one is involved, the user.

    ``field`` names the argument in the errors about the directory itself.

    Returns:
      dict user id (str) -> (x list, y list), users in file order.
    """
    directory = Path(os.fspath(path)).expanduser()
    if not directory.is_dir():
        raise FieldError(field, f"{directory} is not a directory")
    files = sorted(directory.glob("*.json"))
    if not files:
        raise FieldError(field, f"no *.json files in {directory}")
    seen, merged = {}, {}
    for file in files:
        merged.update(_read_leaf_file(file, seen))
    return merged


# --------------------------------------------------------------------------- characters


def _vocab_table(vocab: str) -> tuple[np.ndarray, np.ndarray]:
    """(sorted code points, their ids) for a vocabulary of distinct characters."""
    if not isinstance(vocab, str) or not vocab:
        raise FieldError("vocab", f"must be a non-empty string, got {vocab!r}")
    return _cached_vocab_table(vocab)


@functools.lru_cache(maxsize=8)
def _cached_vocab_table(vocab: str) -> tuple[np.ndarray, np.ndarray]:
    if len(set(vocab)) != len(vocab):
        repeated = next(c for c in vocab if vocab.count(c) > 1)
        raise FieldError("vocab", f"character {repeated!r} appears more than once")
    codes = np.frombuffer(vocab.encode("utf-32-le"), np.uint32)
    order = np.argsort(codes, kind="stable")
    return codes[order], order.astype(np.int32)


def _check_oov(oov: str) -> str:
    if oov not in OOV_POLICIES:
        raise FieldError("oov", f"must be one of {OOV_POLICIES}, got {oov!r}")
    return oov


def _lookup(text: str, vocab: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32, found bool) per character of text; unknown characters get id 0."""
    table, ids = _vocab_table(vocab)
    codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    pos = np.minimum(np.searchsorted(table, codes), table.size - 1)
    found = table[pos] == codes
    return np.where(found, ids[pos], 0).astype(np.int32), found


def _oov_hint(vocab: str) -> str:
    return f"(use oov='extra' to map unknown characters to id {len(vocab)})"


def encode(text: str, vocab: str = LEAF_CHARS, *, oov: str = "error") -> np.ndarray:
    """Character ids of ``text``: id of c = ``vocab.index(c)``, int32 [len(text)].

    Args:
      text: the string to encode.
      vocab: the alphabet (distinct characters); LEAF's ``LEAF_CHARS`` by default.
      oov: what to do with a character outside ``vocab``: "error" raises a
        ValueError naming it; "extra" gives it the id ``len(vocab)``.
    """
    _check_oov(oov)
    if not isinstance(text, str):
        raise FieldError("text", f"must be a string, got {type(text).__name__}")
    ids, found = _lookup(text, vocab)
    if not found.all():
        if oov == "error":
            i = int(np.flatnonzero(~found)[0])
            raise FieldError("text", f"character {text[i]!r} at position {i} is not in "
                                     f"the vocabulary {_oov_hint(vocab)}")
        ids[~found] = len(vocab)
    return ids


def char_windows(text: str, window: int = 80, *, collapse_whitespace: bool = False
                 ) -> tuple[list, list]:
    """Next-character examples from raw text, as in LEAF's Shakespeare preprocessing.

    Example i is the window ``text[i : i + window]`` and its target
    ``text[i + window]``, for i = 0 .. len(text) - window - 1 (stride 1).

    Args:
      text: raw text of one user.
      window: characters per input (LEAF: 80).
      collapse_whitespace: apply LEAF's cleaning first (newlines become spaces,
        runs of spaces become one space).

    Returns:
      (windows, targets): lists of strings of length ``window`` and 1; empty when
      the text has at most ``window`` characters. Encode them with
      ``encode_windows``.
    """
    window = H.count(window, "window")
    if not isinstance(text, str):
        raise FieldError("text", f"must be a string, got {type(text).__name__}")
    if collapse_whitespace:
        text = re.sub(r" +", " ", text.replace("\n", " "))
    count = max(0, len(text) - window)
    return ([text[i:i + window] for i in range(count)],
            [text[i + window] for i in range(count)])


def encode_windows(windows: Sequence[str], targets: Sequence[str], vocab: str = LEAF_CHARS,
                   *, oov: str = "error", field: str = "x") -> tuple[np.ndarray, np.ndarray]:
    """Encodes equal-length windows and one-character targets.

    Returns (x int32 [n, L], y int32 [n]). Errors start with ``field``, e.g.
    "x: window 3 has 79 characters, expected 80".
    """
    if len(windows) != len(targets):
        raise FieldError(field, f"{len(windows)} windows but {len(targets)} targets")
    for i, t in enumerate(targets):
        if not isinstance(t, str) or len(t) != 1:
            raise FieldError(field, f"target {i} must be one character, got {t!r}")
    if not windows:
        return np.zeros((0, 0), np.int32), np.zeros(0, np.int32)
    length = len(windows[0]) if isinstance(windows[0], str) else -1
    for i, w in enumerate(windows):
        if not isinstance(w, str) or len(w) != length:
            got = f"{len(w)} characters" if isinstance(w, str) else type(w).__name__
            raise FieldError(field, f"window {i} has {got}, expected {length} "
                                    f"characters like window 0")
    _check_oov(oov)
    x, x_found = _lookup("".join(windows), vocab)
    y, y_found = _lookup("".join(targets), vocab)
    if oov == "error" and not (x_found.all() and y_found.all()):
        if not x_found.all():
            i, p = divmod(int(np.flatnonzero(~x_found)[0]), length)
            what = f"window {i} has character {windows[i][p]!r} at position {p}"
        else:
            i = int(np.flatnonzero(~y_found)[0])
            what = f"target {i} {targets[i]!r}"
        raise FieldError(field, f"{what}, which is not in the vocabulary "
                                f"{_oov_hint(vocab)}")
    x[~x_found] = len(vocab)
    y[~y_found] = len(vocab)
    return x.reshape(len(windows), length), y


# --------------------------------------------------------------------------- conversion


def _infer_kind(split_data: dict) -> str:
    """images / shakespeare / vectors from the first example of the first user."""
    for user in sorted(split_data):
        x = split_data[user][0]
        if not x:
            continue
        row = x[0]
        if isinstance(row, str):
            return "shakespeare"
        if isinstance(row, list) and row and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in row):
            return "images" if len(row) == FEMNIST_SIDE * FEMNIST_SIDE else "vectors"
        raise FieldError("kind", f"cannot infer the kind from user {user!r}'s first x "
                                 f"({str(row)[:60]}); supported: rows of numbers (images, "
                                 f"vectors) and strings (shakespeare)")
    raise FieldError("kind", "every training user is empty; cannot infer the kind")


def _float_rows(x: list, width: int | None, where: str) -> np.ndarray:
    """float32 [n, d] from a list of numeric rows (d = width when given)."""
    try:
        arr = np.asarray(x, np.float32)
    except (ValueError, TypeError):
        raise FieldError("leaf", f"{where}: x rows must be lists of numbers of equal "
                                 f"length") from None
    if arr.size == 0:
        return np.zeros((0, width or 0), np.float32)
    if arr.ndim != 2 or (width is not None and arr.shape[1] != width):
        raise FieldError("leaf", f"{where}: x has shape {arr.shape}, expected "
                                 f"(n, {width if width is not None else 'd'})")
    return arr


def _labels(y: list, where: str) -> np.ndarray:
    try:
        labels = _as_labels(np.asarray(y) if y else np.zeros(0, np.int32), "y")
    except ValueError as err:
        raise FieldError("leaf", f"{where}: {err}") from None
    if labels.size and labels.min() < 0:
        raise FieldError("leaf", f"{where}: negative label {labels.min()}")
    return labels


def _convert(kind: str, x: list, y: list, where: str, width: int | None, oov: str
             ) -> tuple[np.ndarray, np.ndarray]:
    if kind == "shakespeare":
        return encode_windows(x, y, LEAF_CHARS, oov=oov, field=f"leaf: {where}")
    if kind == "images":
        side = FEMNIST_SIDE
        xs = _float_rows(x, side * side, where).reshape(-1, side, side, 1)
    else:
        xs = _float_rows(x, width, where)
    return xs, _labels(y, where)


def _split_dirs(path, test_dir) -> tuple[Path, Path]:
    path = Path(os.fspath(path)).expanduser()
    if test_dir is not None:
        return path, Path(os.fspath(test_dir)).expanduser()
    train, test = path / "train", path / "test"
    if not (train.is_dir() and test.is_dir()):
        raise FieldError("path", f"{path} has no train/ and test/ subdirectories; pass "
                                 f"the LEAF data root or the train directory with test_dir=...")
    return train, test


def load_leaf(path, test_dir=None, *, kind: str = "auto", num_classes: int | None = None,
              oov: str = "error") -> LeafFederation:
    """Reads a LEAF federation (train and test JSON directories) into arrays.

    Args:
      path: the LEAF data root holding ``train/`` and ``test/`` (e.g.
        ``leaf/data/femnist/data``), or the train directory when ``test_dir`` is
        given.
      test_dir: the test directory, or None to use ``path/test``.
      kind: "images" (FEMNIST), "shakespeare", "vectors" (Synthetic) or "auto"
        (strings -> shakespeare, rows of 784 numbers -> images, other numeric rows
        -> vectors).
      num_classes: classes; default 62 for images (FEMNIST), the alphabet size for
        shakespeare (80, or 81 with oov="extra"), max label + 1 over both splits
        for vectors. Every label must lie below it.
      oov: shakespeare characters outside ``LEAF_CHARS``: "error" or "extra"
        (id 80).

    Returns:
      LeafFederation with users sorted by id, the same order in both splits.
    """
    if kind not in KINDS:
        raise FieldError("kind", f"must be one of {KINDS}, got {kind!r}")
    _check_oov(oov)
    given_test = test_dir
    train_dir, test_dir = _split_dirs(path, test_dir)
    splits = {"train": read_leaf_dir(train_dir),
              "test": read_leaf_dir(test_dir, field="path" if given_test is None else "test_dir")}
    dirs = {"train": train_dir, "test": test_dir}
    for split, other in (("train", "test"), ("test", "train")):
        missing = sorted(set(splits[split]) - set(splits[other]))
        if missing:
            raise FieldError("leaf", f"user {missing[0]!r} is in {split} ({dirs[split]}) "
                                     f"but not in {other} ({dirs[other]}); every user needs "
                                     f"both splits (LEAF's '-t sample' split)")
    users = sorted(splits["train"])
    if kind == "auto":
        kind = _infer_kind(splits["train"])
    arrays = {"train": ([], []), "test": ([], [])}
    shape, first = None, None  # common per-example shape and where it was first seen
    for split in ("train", "test"):
        for user in users:
            x, y = splits[split][user]
            where = f"{dirs[split]}: user {user!r}"
            width = shape[0] if kind == "vectors" and shape else None
            xs, ys = _convert(kind, x, y, where, width, oov)
            if xs.shape[0] and shape is None:
                shape, first = xs.shape[1:], where
            elif xs.shape[0] and xs.shape[1:] != shape:
                raise FieldError("leaf", f"{where}: examples of shape {xs.shape[1:]} differ "
                                         f"from {shape} of {first}")
            arrays[split][0].append(xs)
            arrays[split][1].append(ys)
    if shape is None:
        raise FieldError("leaf", f"every user is empty in both splits ({train_dir}, {test_dir})")
    for xs, _ in arrays.values():  # empty users get the common shape
        xs[:] = [a if a.shape[0] else np.zeros((0, *shape), a.dtype) for a in xs]
    return LeafFederation(user_ids=users, train_xs=arrays["train"][0],
                          train_ys=arrays["train"][1], test_xs=arrays["test"][0],
                          test_ys=arrays["test"][1],
                          num_classes=_num_classes(kind, num_classes, oov, arrays, users,
                                                   dirs),
                          input_shape=tuple(shape),
                          vocab=LEAF_CHARS if kind == "shakespeare" else None, kind=kind)


def _num_classes(kind: str, num_classes, oov: str, arrays: dict, users=None,
                 dirs=None) -> int:
    """Default or checked number of classes (every label must lie below it).

    Inferred for vectors as max label + 1, which must be plausible: at least half of
    the classes 0..max appear, so one stray label (999 among 0..9) is an error that
    names the file and user holding it instead of a silent 1000-class model.
    """
    top = max((int(y.max()) for _, ys in arrays.values() for y in ys if y.size), default=-1)
    inferred = num_classes is None
    if inferred:
        if kind == "images":
            num_classes = FEMNIST_CLASSES
        elif kind == "shakespeare":
            num_classes = len(LEAF_CHARS) + (oov == "extra")
        else:
            num_classes = top + 1
    num_classes = H.count(num_classes, "num_classes")
    distinct = np.unique(np.concatenate([y for _, ys in arrays.values() for y in ys]
                                        or [np.zeros((0,), np.int32)]))
    stray = top >= num_classes or (inferred and kind == "vectors"
                                   and 2 * distinct.size < num_classes)
    if stray:
        where = _holder(arrays, users, dirs, top)
        if top >= num_classes:
            raise FieldError("num_classes", f"label {top} does not fit num_classes="
                                            f"{num_classes}{where}")
        raise FieldError("num_classes", f"labels run up to {top}{where} but only "
                                        f"{distinct.size} distinct labels appear; pass "
                                        f"num_classes="
                                        f"{top + 1} if that many classes are intended")
    return num_classes


def _holder(arrays: dict, users, dirs, label: int) -> str:
    """" (file F, user U)" of the first example with ``label``, for error messages."""
    if users is None:
        return ""
    for split, (_, ys) in arrays.items():
        for user, y in zip(users, ys):
            if y.size and int(y.max()) == label:
                return f" (file {_file_of(dirs[split], user)}, user {user!r})"
    return ""


def _file_of(directory, user: str):
    """The JSON file of ``directory`` that lists ``user`` (error paths only)."""
    for file in sorted(Path(os.fspath(directory)).glob("*.json")):
        with open(file) as f:
            if user in map(str, json.load(f).get("users", [])):
                return file
    return directory