"""Federations on disk (fedjax_fair/data/disk.py, ``fedjax-fair prepare``): written
once, memory-mapped by runs that stream their cohorts (the next chunk's read in the
background), the same rounds as the same data held in memory; what a broken or
foreign folder gets, and what an interrupted prepare leaves."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from fedjax_fair import runner
from fedjax_fair.algorithms import build
from fedjax_fair.data import disk, femnist_like, generated
from fedjax_fair.hparams import FieldError
from fedjax_fair.models import get_model


def _small(procedural: bool):
    return femnist_like(num_clients=40, min_examples=3, max_examples=9, test_examples=2,
                        procedural=procedural, seed=5)


@pytest.mark.parametrize("procedural", [False, True])
def test_a_prepared_federation_reads_back_the_same_arrays(tmp_path, procedural):
    ds = _small(procedural)
    seen = []
    disk.write(ds, str(tmp_path / "fed"), progress=lambda done, total: seen.append((done, total)))
    back = disk.read(str(tmp_path / "fed"))
    assert back.name == ds.name and back.num_classes == ds.num_classes
    assert back.input_shape == ds.input_shape and disk.is_on_disk(back.host_data)
    for split in ("train", "test"):
        want = generated.materialize(getattr(ds.host_data, split))
        got = getattr(back.host_data, split)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert seen[-1] == (80, 80) and all(d <= t for d, t in seen)
    import hashlib
    manifest = json.load(open(tmp_path / "fed" / disk.MANIFEST))
    for entry in (e for split in manifest["splits"].values() for e in split["arrays"].values()):
        data = (tmp_path / "fed" / entry["file"]).read_bytes()
        assert entry["sha256"] == "sha256:" + hashlib.sha256(data).hexdigest()
    assert sorted(os.listdir(tmp_path)) == ["fed"]  # no partial folder left


def _run(data, **kw):
    model = get_model("mlp", (28, 28, 1), 62, hidden=(16,))
    return runner.run(build("fedavg", model), model.init(jax.random.key(0)), data,
                      jax.random.key(1), model=model, num_rounds=5, cohort_size=6,
                      eval_every=2, progress=False, **kw)


def test_runs_on_disk_equal_runs_on_the_same_rows_in_memory(tmp_path):
    """The federation memory-mapped from disk is streamed (placement auto picks the
    host); its rounds equal the in-memory federation's streamed rounds to the bit, with
    and without the background read of the next chunk."""
    ds = _small(False)
    disk.write(ds, str(tmp_path / "fed"))
    on_disk = disk.read(str(tmp_path / "fed")).host_data
    read = _run(on_disk)
    held = _run(ds.host_data, placement="host")
    serial = _run(on_disk, prefetch=False)
    assert read.memory.placement == "host" and held.memory.placement == "host"
    assert read.memory.resident_bytes > 0 and serial.memory.resident_bytes == 0  # prefetch
    for other in (held, serial):
        for a, b in zip(jax.tree.leaves(read.state.params), jax.tree.leaves(other.state.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(read.client_metrics["accuracy"],
                                      other.client_metrics["accuracy"])


def _broken(tmp_path, how: str) -> str:
    path = str(tmp_path / how)
    disk.write(_small(False), path)
    manifest = os.path.join(path, disk.MANIFEST)
    if how == "missing":
        os.remove(os.path.join(path, "train_x.npy"))
    elif how == "truncated":
        with open(os.path.join(path, "train_x.npy"), "r+b") as f:
            f.truncate(os.path.getsize(f.name) - 100)
    elif how == "version":
        m = json.load(open(manifest))
        m["version"], m["library"] = disk.VERSION + 1, "9.9"
        json.dump(m, open(manifest, "w"))
    elif how == "unprepared":
        os.remove(manifest)
    elif how == "header":
        with open(os.path.join(path, "test_y.npy"), "r+b") as f:
            f.write(b"garbage!")
    return path


@pytest.mark.parametrize("how", ["missing", "truncated", "version", "unprepared", "header"])
def test_a_broken_or_foreign_folder_is_refused_in_one_line(tmp_path, how):
    with pytest.raises(FieldError) as e:
        disk.read(_broken(tmp_path, how))
    assert e.value.field == "path" and "\n" not in str(e.value)


def test_an_interrupted_prepare_leaves_nothing_a_run_would_read(tmp_path):
    def stop(done, total):
        if done > 40:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        disk.write(_small(True), str(tmp_path / "fed"), progress=stop)
    assert os.listdir(tmp_path) == []
    with pytest.raises(FieldError):
        disk.read(str(tmp_path / "fed"))
    stale = tmp_path / "fed.partial-999999999"  # a killed prepare's folder
    stale.mkdir()
    disk.write(_small(True), str(tmp_path / "fed"))
    assert sorted(os.listdir(tmp_path)) == ["fed"]
    with pytest.raises(FieldError, match="exists"):
        disk.write(_small(True), str(tmp_path / "fed"))
    disk.write(_small(False), str(tmp_path / "fed"), overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["fed"]


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fedjax_fair.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def test_prepare_then_run_then_resume_from_the_command_line(tmp_path):
    done = _cli("prepare", "--dataset", "femnist_like", "--dataset-arg", "procedural=true",
                "--dataset-arg", "min_examples=5", "--dataset-arg", "max_examples=10",
                "--num-clients", "200", "-o", "fed", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "--dataset disk" in done.stdout and "100%" in done.stderr
    common = ["run", "--dataset", "disk", "--dataset-arg", "path=fed", "--model", "mlp",
              "--cohort-size", "8", "--eval-every", "2", "--no-progress", "--no-plots",
              "--devices", "1"]
    whole = _cli(*common, "--num-rounds", "4", "-o", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    assert "memory-mapped" in whole.stdout and "on the host" in whole.stdout
    half = _cli(*common, "--num-rounds", "2", "-o", "half", cwd=tmp_path)
    rest = _cli("run", "--resume", "--num-rounds", "4", "--no-progress", "-o", "half",
                cwd=tmp_path)
    assert half.returncode == 0 and rest.returncode == 0, rest.stderr
    assert (tmp_path / "whole" / "clients.csv").read_bytes() == (
        tmp_path / "half" / "clients.csv").read_bytes()
    config = json.loads((tmp_path / "whole" / "config.json").read_text())
    assert config["inputs"]["dataset_args.path"].startswith("sha256:")
    again = _cli("prepare", "--dataset", "femnist_like", "-o", "fed", cwd=tmp_path)
    assert again.returncode == 2 and "exists" in again.stderr
    # the federation changed under the run: its resume is refused before compute
    disk.write(femnist_like(num_clients=200, min_examples=5, max_examples=10, seed=9),
               str(tmp_path / "fed"), overwrite=True)
    moved = _cli("run", "--resume", "--num-rounds", "6", "--no-progress", "-o", "half",
                 cwd=tmp_path)
    assert moved.returncode == 2 and "dataset_args.path" in moved.stderr


def test_announcing_reads_touches_only_memory_mapped_arrays(tmp_path):
    """``will_need`` finds the mapping of a whole memory-mapped array (or a plain view
    of it, as the runner places it) and asks for the clients' rows; arrays in memory
    and slices are left alone."""
    disk.write(_small(False), str(tmp_path / "fed"))
    train = disk.read(str(tmp_path / "fed")).host_data.train
    x = train.examples["x"]
    assert disk._mapping(x) is not None and disk._mapping(np.asarray(x)) is not None
    assert disk._mapping(np.asarray(x)[1:]) is None and disk._mapping(np.zeros(3)) is None
    disk.will_need(train, np.array([[0, 39], [5, 5]]))  # no error, no effect on values
    disk.will_need(_small(False).host_data.train, np.array([1, 2]))
    np.testing.assert_array_equal(
        np.asarray(x[5]), generated.materialize(_small(False).host_data.train).examples["x"][5])
