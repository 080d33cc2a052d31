"""Bad-input cases of datasets (tests/test_reliability.py runs them): dataset flags and
arguments, and LEAF data files."""
from __future__ import annotations

import json
import os

import numpy as np

from reliability_common import _add, _flags

# ---- datasets and dataset arguments
for flags, field in ((["--dataset-arg", "nope=1"], "dataset_args.nope"),
                     (["--dataset-arg", "noequals"], "dataset_arg"),
                     (["--dataset-args", "[1]"], "dataset_args"),
                     (["--dataset-args", "{"], "dataset_args"),
                     (["--partition", "iid"], "dataset_args.partition"),
                     (["--num-clients", "0"], "num_clients"),
                     (["--num-clients", "-5"], "num_clients"),
                     (["--num-clients", "2.5"], "num_clients"),
                     (["--num-clients", "abc"], "num_clients"),
                     (["--alpha", "-1"], "alpha"), (["--alpha", "nan"], "alpha"),
                     (["--beta", "-1"], "beta"), (["--beta", "x"], "beta"),
                     (["--dataset-arg", "max_examples=0"], "max_examples"),
                     (["--dataset-arg", "seed=-1"], "seed"),
                     (["--dataset-arg", "seed=4294967296"], "dataset_args.seed"),
                     (["--dataset-arg", f"seed={10 ** 30}"], "dataset_args.seed"),
                     (["--num-clients", str(10 ** 30)], "num_clients")):
    _flags("run", flags, field, area=6)
for flags, field in ((["--dataset", "digits", "--partition", "nope"], "partition"),
                     (["--dataset", "digits", "--partition", "dirichlet", "--alpha", "0"],
                      "alpha"),
                     (["--dataset", "leaf"], "path"),
                     (["--dataset", "leaf", "--dataset-arg", "path=/nonexistent/leaf"],
                      "path")):
    _flags("run", flags, field, area=6, tiny=False)
_flags("run", ["--dataset", "digits", "--num-clients", "100000"], "num_clients", area=6,
       tiny=False)
_add(6, "run:mnist unprepared", "`run --dataset mnist --dataset-arg data_dir=EMPTY_DIR`",
     "`run` flag", "dataset", cli=lambda ws: ["run", "--dataset", "mnist", "--dataset-arg",
                     f"data_dir={ws.directory('tfds')}"], subprocess=True)


# ---- LEAF data files
def _vectors(n: int, label=lambda i: i % 3, d: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).round(3).tolist(), [label(i) for i in range(n)]


def _users(**overrides) -> dict:
    data = {u: _vectors(6, seed=i) for i, u in enumerate(("u0", "u1", "u2"))}
    data.update(overrides)
    return data


def _with_nan(value):
    x, y = _vectors(6)
    x[2][1] = value
    return x, y


def _leaf_file(**fields) -> str:
    base = {"users": ["u0"], "num_samples": [2], "user_data": {"u0": {"x": [[0.0, 1.0],
                                                                            [1.0, 0.0]],
                                                                      "y": [0, 1]}}}
    base.update(fields)
    return json.dumps(base)


def _no_train_files(ws) -> str:
    root = ws.leaf({}, {}, train_text="{}", test_text=_leaf_file())
    os.remove(os.path.join(root, "train", "data.json"))
    return root


_LEAF = (
    ("labels out of range (999 among 0..2)",
     lambda ws: ws.leaf(_users(u1=_vectors(6, label=lambda i: 999 if i == 3 else i % 3))),
     "num_classes"),
    ("a negative label", lambda ws: ws.leaf(_users(u1=_vectors(6, label=lambda i: -1))),
     "label"),
    ("a label 1.5", lambda ws: ws.leaf(_users(u1=_vectors(6, label=lambda i: 1.5))),
     "labels"),
    ("a NaN feature", lambda ws: ws.leaf(_users(u2=_with_nan(float("nan")))), "NaN"),
    ("an Infinity feature", lambda ws: ws.leaf(_users(u2=_with_nan(float("inf")))), "inf"),
    ("a user missing from test/", lambda ws: ws.leaf(
        _users(), {u: xy for u, xy in _users().items() if u != "u1"}), "'u1'"),
    ("a user in users but not in user_data", lambda ws: ws.leaf(
        {}, {}, train_text=_leaf_file(users=["u0", "u9"], num_samples=[2, 1]),
        test_text=_leaf_file()), "'u9'"),
    ("a user in user_data but not in users", lambda ws: ws.leaf(
        {}, {}, train_text=_leaf_file(user_data={"u0": {"x": [[0.0, 1.0], [1.0, 0.0]],
                                                        "y": [0, 1]},
                                                 "u7": {"x": [], "y": []}}),
        test_text=_leaf_file()), "'u7'"),
    ("num_samples disagreeing with the data", lambda ws: ws.leaf(
        {}, {}, train_text=_leaf_file(num_samples=[5]), test_text=_leaf_file()),
     "num_samples"),
    ("x and y of different lengths", lambda ws: ws.leaf(
        {}, {}, train_text=_leaf_file(user_data={"u0": {"x": [[0.0, 1.0]], "y": [0, 1]}}),
        test_text=_leaf_file()), "'u0'"),
    ("a user listed twice", lambda ws: ws.leaf(
        {}, {}, train_text=_leaf_file(users=["u0", "u0"], num_samples=[2, 2]),
        test_text=_leaf_file()), "twice"),
    ("a file missing the key users", lambda ws: ws.leaf(
        {}, {}, train_text=json.dumps({"num_samples": [], "user_data": {}}),
        test_text=_leaf_file()), "users"),
    ("a file that is not JSON", lambda ws: ws.leaf(
        {}, {}, train_text="{not json", test_text=_leaf_file()), "JSON"),
    ("a file holding a JSON list", lambda ws: ws.leaf(
        {}, {}, train_text="[1, 2]", test_text=_leaf_file()), "JSON object"),
    ("rows of unequal length", lambda ws: ws.leaf(
        {}, {}, train_text=_leaf_file(user_data={"u0": {"x": [[0.0, 1.0], [1.0]],
                                                        "y": [0, 1]}}),
        test_text=_leaf_file()), "x"),
    ("test rows of another width than train", lambda ws: ws.leaf(
        _users(), {u: _vectors(2, d=5) for u in _users()}), "shape"),
    ("every user empty", lambda ws: ws.leaf({u: ([], []) for u in ("u0", "u1")},
                                            {u: ([], []) for u in ("u0", "u1")}), "empty"),
    ("no *.json file in train/", lambda ws: _no_train_files(ws), "json"),
    ("x rows that are not numbers or strings", lambda ws: ws.leaf(
        {}, {}, train_text=_leaf_file(user_data={"u0": {"x": [[[0.0]], [[1.0]]],
                                                        "y": [0, 1]}}),
        test_text=_leaf_file()), "kind"),
)
for what, make, field in _LEAF:
    _add(10, f"leaf:{what}", f"LEAF files with {what} (`run --dataset leaf`)", "LEAF JSON",
         field, cli=lambda ws, m=make: ["run", "--dataset", "leaf", "--dataset-arg",
                                         f"path={m(ws)}", "--cohort-size", "2"])
_add(10, "leaf:num_clients", "`run --dataset leaf --num-clients 5` on 3 users", "LEAF JSON",
     "num_clients", cli=lambda ws: ["run", "--dataset", "leaf", "--dataset-arg",
                                    f"path={ws.leaf(_users())}", "--num-clients", "5"])
_add(10, "leaf:min_size", "`run --dataset leaf --dataset-arg min_size=100` (no user that big)",
     "LEAF JSON", "num_clients",
     cli=lambda ws: ["run", "--dataset", "leaf", "--dataset-arg", f"path={ws.leaf(_users())}",
                     "--dataset-arg", "min_size=100"])
_add(10, "leaf:cohort", "`run --dataset leaf --cohort-size 4` on 3 users", "LEAF JSON",
     "cohort_size", cli=lambda ws: ["run", "--dataset", "leaf", "--dataset-arg",
                                    f"path={ws.leaf(_users())}", "--cohort-size", "4"])
_add(10, "leaf:femnist width", "`run --dataset femnist` on rows of 4 numbers", "LEAF JSON",
     "shape", cli=lambda ws: ["run", "--dataset", "femnist", "--dataset-arg",
                              f"path={ws.leaf(_users())}", "--cohort-size", "2"])


def _shakespeare(windows, targets):
    return {"u0": (windows, targets)}


_add(10, "leaf:shakespeare oov", "Shakespeare windows with a character outside LEAF's "
     "alphabet (`run --dataset shakespeare`)", "LEAF JSON", "vocabulary",
     cli=lambda ws: ["run", "--dataset", "shakespeare", "--dataset-arg",
                     f"path={ws.leaf(_shakespeare(['ab€d', 'abcd'], ['e', 'f']))}",
                     "--cohort-size", "1"])
_add(10, "leaf:shakespeare ragged", "Shakespeare windows of unequal length "
     "(`run --dataset shakespeare`)", "LEAF JSON", "window",
     cli=lambda ws: ["run", "--dataset", "shakespeare", "--dataset-arg",
                     f"path={ws.leaf(_shakespeare(['abcd', 'abc'], ['e', 'f']))}",
                     "--cohort-size", "1"])
_add(10, "leaf:char_lstm on vectors", "`run --dataset leaf --model char_lstm` on vector "
     "rows", "LEAF JSON", "model",
     cli=lambda ws: ["run", "--dataset", "leaf", "--dataset-arg",
                     f"path={ws.leaf(_users())}", "--model", "char_lstm", "--cohort-size",
                     "2"])
