"""The run fingerprint covers the contents of the files a run reads (cli/lock.py
``input_hashes``): an ``--availability trace:FILE`` or a LEAF data folder edited in
place before ``--resume`` is refused naming its option, before anything is built or
written, instead of a resumed run that mixes two inputs; unchanged, the run resumes.
Runs without input files keep the fingerprint they always had."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

import helpers
from fedjax_fair import cli
from fedjax_fair.cli import lock
from helpers import CLI_TINY as TINY, one_line_error as _one_line_error
from reliability_common import _snapshot  # every file's bytes, empty folders


def _refused(capsys, argv, out, field):
    """``argv`` exits 2 with one line naming ``field``, leaving ``out`` as it was."""
    before = _snapshot(out)
    assert cli.main(argv) == cli.EXIT_CONFIG
    _one_line_error(capsys.readouterr().err, f"{field}: ")
    assert _snapshot(out) == before  # the run directory untouched


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def test_a_changed_trace_file_is_refused_on_resume(tmp_path, capsys):
    trace = tmp_path / "trace.npy"
    table = np.ones((4, 6), bool)
    table[1, :2] = False
    np.save(trace, table)  # its last byte is table[-1, -1]
    out = tmp_path / "out"
    args = ["run", *TINY, "--no-plots", "--eval-every", "1",
            "--availability", f"trace:{trace}"]
    assert cli.main([*args, "--num-rounds", "2", "-o", str(out)]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved[lock.INPUTS_KEY] == {"availability": lock.content_hash(str(trace))}
    capsys.readouterr()

    _flip_last_byte(trace)  # one byte: client 5 is off in round 4
    resume = ["run", "-o", str(out), "--resume", "--num-rounds", "4", "--no-progress"]
    _refused(capsys, resume, out, "availability")

    _flip_last_byte(trace)  # restored: the run continues
    assert cli.main(resume) == 0
    assert json.loads((out / "summary.json").read_text())["final"]["round"] == 4
    assert json.loads((out / "config.json").read_text())["fingerprint"] == saved["fingerprint"]


def _leaf(root, seed=0):
    rng = np.random.default_rng(seed)
    users = ["u_a", "u_b", "u_c"]
    for split, n in (("train", 10), ("test", 4)):
        data = {u: (rng.normal(size=(n, 4)).round(3).tolist(), (np.arange(n) % 3).tolist())
                for u in users}
        helpers.write_leaf(root / split / "all.json", users, data)


def test_a_changed_leaf_folder_is_refused_on_resume(tmp_path, capsys):
    """The same shapes, other features: refused naming dataset_args.path."""
    leaf = tmp_path / "leaf"
    _leaf(leaf)
    out = tmp_path / "out"
    assert cli.main(["run", "--dataset", "leaf", "--dataset-arg", f"path={leaf}",
                     "--cohort-size", "2", "--num-rounds", "1", "--no-plots", "--no-progress",
                     "-o", str(out)]) == 0
    capsys.readouterr()
    original = (leaf / "test" / "all.json").read_bytes()
    _leaf(tmp_path / "other", seed=1)
    (leaf / "test" / "all.json").write_bytes((tmp_path / "other" / "test" / "all.json")
                                             .read_bytes())
    resume = ["run", "-o", str(out), "--resume", "--num-rounds", "2", "--no-progress"]
    _refused(capsys, resume, out, "dataset_args.path")
    (leaf / "test" / "all.json").write_bytes(original)
    assert cli.main(resume) == 0


def test_a_comparison_with_a_changed_trace_is_refused_on_resume(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text("1,1,1,1,1,1\n1,1,0,1,1,1\n")
    out = tmp_path / "cmp"
    args = ["compare", *TINY, "--algorithms", "fedavg", "--seeds", "0", "--num-rounds", "1",
            "--no-plots", "--availability", f"trace:{trace}", "-o", str(out)]
    assert cli.main(args) == 0
    capsys.readouterr()
    trace.write_text("1,1,1,1,1,1\n1,1,1,0,1,1\n")
    _refused(capsys, ["compare", "-o", str(out), "--resume", "--no-progress"], out,
             "availability")


def test_a_folder_hash_covers_names_and_contents_in_reading_order(tmp_path):
    leaf = tmp_path / "leaf"
    _leaf(leaf)
    cfg = {"dataset": "leaf", "dataset_args": {"path": str(leaf)}}
    (root, files), = lock.input_files(cfg).values()
    assert [os.path.relpath(f, root) for f in files] == [os.path.join("train", "all.json"),
                                                         os.path.join("test", "all.json")]
    first = lock.input_hashes(cfg)
    (leaf / "train" / "all.json").rename(leaf / "train" / "renamed.json")
    assert lock.input_hashes(cfg) != first  # another name
    (leaf / "train" / "renamed.json").rename(leaf / "train" / "all.json")
    assert lock.input_hashes(cfg) == first
    (leaf / "train" / "notes.txt").write_text("not read by the loader")
    assert lock.input_hashes(cfg) == first


def test_runs_without_input_files_keep_their_fingerprint(tmp_path):
    """No input files: no record, the fingerprint as before content hashes."""
    out = tmp_path / "out"
    assert cli.main(["run", *TINY, "--num-rounds", "1", "--no-plots", "-o", str(out)]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert lock.INPUTS_KEY not in saved
    assert saved["fingerprint"] == lock.fingerprint(saved)


def test_a_run_recorded_before_content_hashes_still_resumes(tmp_path, capsys):
    """A saved run with a trace but no recorded contents (made before they were
    recorded) resumes as it did, its fingerprint unchanged."""
    trace = tmp_path / "trace.csv"
    trace.write_text("1,1,1,1,1,1\n1,0,1,1,1,1\n")
    out = tmp_path / "out"
    assert cli.main(["run", *TINY, "--num-rounds", "1", "--no-plots", "--availability",
                     f"trace:{trace}", "-o", str(out)]) == 0
    saved = json.loads((out / "config.json").read_text())
    del saved[lock.INPUTS_KEY]
    saved["fingerprint"] = lock.fingerprint(saved)
    (out / "config.json").write_text(json.dumps(saved))
    for folder in (out, out / "checkpoint"):
        lock.record(str(folder), saved)
    assert cli.main(["run", "-o", str(out), "--resume", "--num-rounds", "2",
                     "--no-progress"]) == 0
    again = json.loads((out / "config.json").read_text())
    assert lock.INPUTS_KEY not in again and again["fingerprint"] == saved["fingerprint"]


@pytest.mark.parametrize("value", ["always", "trace:", "independent:0.5"])
def test_options_that_read_no_file_have_no_inputs(value):
    assert lock.input_files({"availability": value, "dataset": "synthetic"}) == {}
