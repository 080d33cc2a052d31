"""The run store's commit point (issue 27, item 1): every evaluation commits the state,
the history, the per-client history and the round log as one step directory
(``checkpoint.save``), so a kill at any instant leaves the last committed evaluation,
and ``--resume`` reproduces the uninterrupted run bit for bit. Logs with a torn last
line, torn or missing outputs of a comparison's run, a checkpoint whose meta and state
disagree, and a checkpoint of the older format are handled without a traceback."""
import json
import os

import numpy as np
import pytest

from fedjax_fair.drivers import checkpoint as ckpt
from fedjax_fair import cli
from fedjax_fair.cli import compare as cli_compare

TINY = ["--num-clients", "6", "--dataset-arg", "max_examples=100", "--cohort-size", "3",
        "--no-progress"]
RUN = ["run", *TINY, "--num-rounds", "3", "--eval-every", "1", "--no-plots"]


class Killed(BaseException):
    """A simulated SIGKILL: nothing of the program runs after it but ``finally``."""


def _main(argv) -> int:
    """``cli.main``, then what the end of the process would release (folder locks)."""
    try:
        return cli.main(argv)
    finally:
        held = getattr(cli, "_HELD", [])
        for h in held:
            h.release()
        held.clear()


def _rows(path, drop=("seconds",)):
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in drop} for line in f]


def _outputs(out) -> dict:
    """What a run's results are: its evaluations, rounds, per-client history, final
    summary and final state (timings left out)."""
    with np.load(os.path.join(out, "clients_over_time.npz")) as z:
        clients = {k: z[k] for k in z.files}
    with open(os.path.join(out, "summary.json")) as f:
        final = json.load(f)["final"]
    with np.load(os.path.join(ckpt.latest(os.path.join(out, "checkpoint")), "state.npz")) as z:
        state = {k: z[k] for k in z.files}
    return {"metrics": _rows(os.path.join(out, "metrics.jsonl")),
            "rounds": _rows(os.path.join(out, "rounds.jsonl")),
            "clients": clients, "final": final, "state": state}


def _assert_same(a: dict, b: dict) -> None:
    assert [r["round"] for r in b["metrics"]] == [0, 1, 2, 3]  # every evaluation, once
    assert [r["round"] for r in b["rounds"]] == [1, 2, 3]
    assert list(b["clients"]["round"]) == [0, 1, 2, 3]
    assert a["metrics"] == b["metrics"] and a["rounds"] == b["rounds"]
    assert a["final"] == b["final"]
    assert a["clients"].keys() == b["clients"].keys()
    for k in a["clients"]:
        np.testing.assert_array_equal(a["clients"][k], b["clients"][k])  # NaN == NaN
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert a["state"][k].tobytes() == b["state"][k].tobytes()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, and the fault points of its saves in order."""
    out = str(tmp_path_factory.mktemp("store") / "full")
    points = []
    original = ckpt._fault
    ckpt._fault = points.append
    try:
        assert _main([*RUN, "-o", out]) == 0
    finally:
        ckpt._fault = original
    return _outputs(out), points


def _kill_at(monkeypatch, n: int) -> None:
    calls = [0]

    def fault(point):
        calls[0] += 1
        if calls[0] == n:
            raise Killed(point)
    monkeypatch.setattr(ckpt, "_fault", fault)


def test_saves_have_the_fault_points_the_kill_test_walks(reference):
    _, points = reference
    first = points.index("commit") + 1
    assert points[:first] == ["mkdir", "link history", "open history segment",
                              "inside history segment", "link client_history",
                              "open client_history segment", "inside client_history segment",
                              "link rounds", "open state.npz", "inside state.npz",
                              "open meta.json", "inside meta.json", "commit"]
    second = points.index("commit", first) + 1  # round 1's: the round log's first rows
    assert points[first:second] == ["mkdir", "link history", "open history segment",
                                    "inside history segment", "link client_history",
                                    "open client_history segment",
                                    "inside client_history segment", "link rounds",
                                    "open rounds segment", "inside rounds segment",
                                    "open state.npz", "inside state.npz",
                                    "open meta.json", "inside meta.json", "commit"]
    assert points.count("commit") == 4  # one commit per evaluation: rounds 0, 1, 2, 3


def test_logs_are_segments_merged_as_a_binary_counter(tmp_path):
    """A save writes its log rows as one new segment, merged with the trailing segments
    of as many saves or fewer; the others are hard-linked from the previous save. After
    E saves a log has one segment per 1-bit of E, so a commit never rewrites the whole
    log (issue 27: the round log was rewritten at every commit); readers see it whole."""
    import jax.numpy as jnp
    d = str(tmp_path / "c")
    for i in range(1, 12):
        ckpt.save(d, {"w": jnp.zeros(2)}, {"i": i},
                  logs={"rows": {"x": np.full(2, i)}, "history": [{"i": i}]})
        step = ckpt.latest(d)
        segs = sorted(os.listdir(os.path.join(step, "rows")))
        assert [int(s.split("-")[2].split(".")[0]) for s in segs] == [
            1 << b for b in reversed(range(i.bit_length())) if i >> b & 1]
        np.testing.assert_array_equal(ckpt.load_log(d, "rows")["x"],
                                      np.repeat(np.arange(1, i + 1), 2))
        assert ckpt.read_meta(d)["history"] == [{"i": j} for j in range(1, i + 1)]
    older = os.path.join(d, f"step-{ckpt.steps(d)[0]:08d}")
    assert os.path.samefile(os.path.join(step, "rows", segs[0]),  # 8 saves' rows: linked
                            os.path.join(older, "rows", segs[0]))
    ckpt.save(d, {"w": jnp.zeros(2)}, {"i": 12})  # a save that adds no rows keeps the logs
    np.testing.assert_array_equal(ckpt.load_log(d, "rows")["x"],
                                  np.repeat(np.arange(1, 12), 2))
    assert len(ckpt.read_meta(d)["history"]) == 11
    with pytest.raises(ValueError, match="^checkpoint: log 'rows'"):  # one set of arrays
        ckpt.save(d, {"w": jnp.zeros(2)}, {"i": 13}, logs={"rows": {"y": np.zeros(2)}})


def test_a_commit_writes_only_its_own_segment_and_links_the_rest(tmp_path):
    """In a run, every log of the newest commit is whole, and a segment it did not
    rewrite is the previous commit's file, not a copy."""
    out = str(tmp_path / "run")
    assert _main([*RUN, "-o", out]) == 0
    ck = os.path.join(out, "checkpoint")
    newest, older = ckpt.latest(ck), os.path.join(ck, "step-00000003")
    for log in ("history", "client_history"):  # 4 saves: one segment
        assert len(os.listdir(os.path.join(newest, log))) == 1
    rounds = sorted(os.listdir(os.path.join(newest, "rounds")))  # 3 saves: 2 + 1
    assert len(rounds) == 2 and os.path.samefile(os.path.join(newest, "rounds", rounds[0]),
                                                 os.path.join(older, "rounds", rounds[0]))
    assert [h["round"] for h in ckpt.read_meta(ck)["history"]] == [0, 1, 2, 3]
    assert ckpt.load_arrays(ck, "rounds")["train_loss"].shape == (3,)
    assert ckpt.load_arrays(ck, "client_history")["accuracy"].shape == (4, 6)


# every instant of the commit of round 1's and round 3's evaluations (between any two
# file writes, inside each, before and after the renaming commit, during retention)
_POINTS = [(1, k) for k in range(15)] + [(3, k) for k in range(16)]  # save 1: no retention


@pytest.mark.parametrize("save,k", _POINTS)
def test_a_kill_at_any_instant_of_a_commit_resumes_bit_for_bit(reference, tmp_path,
                                                              monkeypatch, save, k):
    """Killed at the k-th write / rename / removal of the save of round ``save``'s
    evaluation: the run directory reads as the last committed evaluation, and
    --resume gives the uninterrupted run's numbers with every evaluation once."""
    full, points = reference
    starts = [i for i, p in enumerate(points) if p == "mkdir"]
    end = starts[save + 1] if save + 1 < len(starts) else len(points)
    assert starts[save] + k < end
    n = starts[save] + k + 1
    out = str(tmp_path / "run")
    _kill_at(monkeypatch, n)
    with pytest.raises(Killed):
        _main([*RUN, "-o", out])
    monkeypatch.setattr(ckpt, "_fault", lambda point: None)
    meta = ckpt.read_meta(os.path.join(out, "checkpoint"))
    committed = points[:n - 1].count("commit")  # saves committed before the kill
    assert meta["round"] == committed - 1 and len(meta["history"]) == committed
    assert _main(["run", "-o", out, "--resume"]) == 0
    _assert_same(full, _outputs(out))
    steps = os.listdir(os.path.join(out, "checkpoint"))
    assert not [s for s in steps if s.startswith("tmp.")]
    assert 1 <= len([s for s in steps if s.startswith("step-")]) <= ckpt.KEEP + 1


def test_a_kill_while_the_final_outputs_are_written_resumes(reference, tmp_path,
                                                            monkeypatch):
    """Killed after the last commit, while summary.json etc. are being written: the
    resumed run (no round left to run) writes them all, the same numbers."""
    from fedjax_fair.cli import report
    full, _ = reference
    out = str(tmp_path / "run")
    real = report._replace_with
    calls = []

    def torn(path, text):
        calls.append(path)
        if path.endswith("summary.json"):
            with open(path, "w") as f:
                f.write(text[:len(text) // 2])  # cut off
            raise Killed(path)
        real(path, text)
    monkeypatch.setattr(report, "_replace_with", torn)
    with pytest.raises(Killed):
        _main([*RUN, "-o", out])
    monkeypatch.setattr(report, "_replace_with", real)
    assert _main(["run", "-o", out, "--resume"]) == 0
    _assert_same(full, _outputs(out))


@pytest.mark.parametrize("name", ["rounds.jsonl", "metrics.jsonl"])
def test_a_torn_last_line_and_lines_past_the_commit_are_dropped_on_resume(
        reference, tmp_path, monkeypatch, name):
    """Killed in the middle of a chunk after its rows were streamed (one whole line
    past the commit, then a torn one): --resume keeps the logs as of the last commit
    and gives the uninterrupted run."""
    full, _ = reference
    out = str(tmp_path / "run")
    assert _main([*RUN[:-5], "--num-rounds", "2", "--eval-every", "1", "--no-plots",
                  "-o", out]) == 0
    path = os.path.join(out, name)
    with open(path) as f:
        last = f.readlines()[-1]
    with open(path, "a") as f:  # an extra row (not committed), then a torn one
        f.write(last.replace('"round": 2', '"round": 3'))
        f.write(last[:len(last) // 2])
    from fedjax_fair.cli import report
    rows = report.read_jsonl(path)  # the reader leaves the torn line out
    assert rows[-1]["round"] == 3
    with pytest.raises(ValueError):
        report.read_jsonl(path, strict=True)
    assert _main(["run", "-o", out, "--resume", "--num-rounds", "3"]) == 0
    _assert_same(full, _outputs(out))


def test_read_jsonl_tolerates_only_a_torn_last_line(tmp_path):
    from fedjax_fair.cli import report
    path = tmp_path / "log.jsonl"
    path.write_text('{"round": 1}\n{"round": 2}\n{"rou')
    assert report.read_jsonl(str(path)) == [{"round": 1}, {"round": 2}]
    path.write_text('{"round": 1}\n{"rou\n{"round": 2}\n')
    with pytest.raises(ValueError, match="line 2"):
        report.read_jsonl(str(path))
    path.write_text('{"round": 1}\n{"round": 2}')  # complete, the newline cut off
    assert report.read_jsonl(str(path)) == [{"round": 1}, {"round": 2}]


def test_meta_of_another_round_than_the_state_is_refused(tmp_path, capsys):
    """A checkpoint whose meta.json is for another round than its state.npz (the old
    layout's kill between two renames): one line, exit 2, nothing written."""
    out = str(tmp_path / "run")
    assert _main([*RUN[:-5], "--num-rounds", "2", "--eval-every", "1", "--no-plots",
                  "-o", out]) == 0
    step = ckpt.latest(os.path.join(out, "checkpoint"))
    meta = json.loads(open(os.path.join(step, "meta.json")).read())
    meta["round"] = 1
    open(os.path.join(step, "meta.json"), "w").write(json.dumps(meta))
    os.remove(max(os.path.join(step, "history", s)  # round 2's evaluation
                  for s in os.listdir(os.path.join(step, "history"))))
    before = {p: open(os.path.join(out, p), "rb").read() for p in ("metrics.jsonl",
                                                                    "rounds.jsonl")}
    capsys.readouterr()
    assert _main(["run", "-o", out, "--resume", "--num-rounds", "3"]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith("error: resume: ") and "round 1" in err and "round 2" in err
    assert len(err.strip().splitlines()) == 1
    assert {p: open(os.path.join(out, p), "rb").read() for p in before} == before


def test_a_checkpoint_of_the_older_format_is_refused_in_one_line(tmp_path, capsys):
    """state.npz and meta.json directly in the checkpoint directory (before step
    directories): a one-line error, exit 2, not a resume from a possibly mixed save."""
    out = str(tmp_path / "run")
    assert _main([*RUN[:-5], "--num-rounds", "1", "--no-plots", "-o", out]) == 0
    ck = os.path.join(out, "checkpoint")
    step = ckpt.latest(ck)
    for name in ("state.npz", "meta.json"):
        os.replace(os.path.join(step, name), os.path.join(ck, name))
    for s in ckpt.steps(ck):
        import shutil
        shutil.rmtree(os.path.join(ck, f"step-{s:08d}"))
    capsys.readouterr()
    assert _main(["run", "-o", out, "--resume", "--num-rounds", "2"]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith("error: resume: ") and "older format" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    with pytest.raises(ValueError, match="^checkpoint: .*older format"):
        ckpt.read_meta(ck)


def test_checkpoint_keeps_the_last_two_commits_and_reads_the_newest(tmp_path):
    import jax.numpy as jnp
    d = str(tmp_path / "c")
    for i in range(4):
        ckpt.save(d, {"w": jnp.full(2, float(i))}, {"i": i},
                  {"extra.npz": {"x": np.arange(i)}})
    assert ckpt.steps(d) == [3, 4]
    state, meta = ckpt.restore(d, {"w": jnp.zeros(2)})
    assert meta == {"i": 3} and float(state["w"][0]) == 3.0
    np.testing.assert_array_equal(ckpt.load_arrays(d, "extra.npz")["x"], np.arange(3))


COMPARE = ["compare", *TINY, "--algorithms", "fedavg,fedprox", "--num-rounds", "2",
           "--no-plots"]


@pytest.mark.parametrize("damage", ["torn summary", "no rounds", "no clients_over_time",
                                    "torn metrics"])
def test_compare_resume_redoes_a_run_with_a_torn_or_missing_output(tmp_path, capsys,
                                                                   damage):
    """A comparison's run directory counts as finished only with all its outputs: a
    torn summary.json (a kill while it was written), a missing rounds.jsonl /
    clients_over_time.npz or a torn metrics.jsonl makes --resume run it again (the
    same numbers, the outputs back), not crash."""
    out = str(tmp_path / "cmp")
    assert _main([*COMPARE, "-o", out]) == 0
    run = os.path.join(out, "fedprox", "seed0")
    before = {n: open(os.path.join(run, n), "rb").read()
              for n in ("metrics.jsonl", "rounds.jsonl", "clients_over_time.npz")}
    final = json.loads(open(os.path.join(run, "summary.json")).read())["final"]
    other = os.path.join(out, "fedavg", "seed0", "summary.json")
    untouched = os.stat(other).st_mtime_ns
    if damage == "torn summary":
        text = open(os.path.join(run, "summary.json")).read()
        open(os.path.join(run, "summary.json"), "w").write(text[:len(text) // 2])
    elif damage == "no rounds":
        os.remove(os.path.join(run, "rounds.jsonl"))
    elif damage == "no clients_over_time":
        os.remove(os.path.join(run, "clients_over_time.npz"))
    else:
        text = open(os.path.join(run, "metrics.jsonl")).read()
        open(os.path.join(run, "metrics.jsonl"), "w").write(text[:-10])
    capsys.readouterr()
    assert _main(["compare", "-o", out, "--resume"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert json.loads(open(os.path.join(run, "summary.json")).read())["final"] == final
    for n, data in before.items():
        if n.endswith(".jsonl"):
            assert _rows(os.path.join(run, n)) == [
                {k: v for k, v in json.loads(line).items() if k != "seconds"}
                for line in data.decode().splitlines()]
        else:
            assert os.path.isfile(os.path.join(run, n))
    assert os.stat(other).st_mtime_ns == untouched  # the finished run was kept


def test_a_new_runs_first_commit_drops_an_earlier_runs_saves(tmp_path):
    """checkpoint.save(fresh=True), a new run's first save into a directory an earlier
    run used: its commit is the only save left (the older format's files included)."""
    import jax.numpy as jnp
    d = str(tmp_path / "c")
    os.makedirs(d)
    (tmp_path / "c" / "state.npz").write_bytes(b"older format")
    (tmp_path / "c" / "meta.json").write_text("{}")
    ckpt.save(d, {"w": jnp.zeros(2)}, {"run": 1})
    ckpt.save(d, {"w": jnp.zeros(2)}, {"run": 1})
    assert sorted(os.listdir(d)) == ["meta.json", "state.npz", "step-00000001",
                                     "step-00000002"]
    ckpt.save(d, {"w": jnp.ones(2)}, {"run": 2}, fresh=True)
    assert sorted(os.listdir(d)) == ["step-00000003"]
    assert ckpt.read_meta(d) == {"run": 2}


def test_a_real_sigkill_mid_run_resumes_to_the_uninterrupted_result(tmp_path):
    """SIGKILL (no handler runs) to a subprocess while it evaluates and commits every
    round: --resume then reproduces a fresh run of the same length, every evaluation
    once."""
    import signal
    import subprocess
    import sys
    import time
    out, full = str(tmp_path / "run"), str(tmp_path / "full")
    args = ["run", *TINY, "--num-rounds", "400", "--eval-every", "1", "--no-plots",
            "--devices", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "fedjax_fair.cli", *args, "-o", out],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ck = os.path.join(out, "checkpoint")
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            if ckpt.read_meta(ck)["round"] >= 3:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    done = ckpt.read_meta(ck)["round"]
    assert 3 <= done < 400
    target = str(done + 2)
    assert _main(["run", "-o", out, "--resume", "--num-rounds", target]) == 0
    assert _main([*args, "--num-rounds", target, "-o", full]) == 0
    a, b = _outputs(full), _outputs(out)
    rounds = list(range(int(target) + 1))
    assert [r["round"] for r in b["metrics"]] == rounds
    assert [r["round"] for r in b["rounds"]] == rounds[1:]
    assert list(b["clients"]["round"]) == rounds
    assert a["metrics"] == b["metrics"] and a["rounds"] == b["rounds"]
    for k in a["clients"]:
        np.testing.assert_array_equal(a["clients"][k], b["clients"][k])
    assert all(a["state"][k].tobytes() == b["state"][k].tobytes() for k in a["state"])


# ---- compare: a kill at any instant, then --resume (issue 27) ----------------------
# ``compare``'s runs go through the runner's loop and commit their checkpoints
# (``run_dir/checkpoint``, every evaluation with --commit-seconds 0); a finished run's
# commit is its summary.json (written last, by rename), after which its checkpoint is
# removed. Its write points are every checkpoint write (``checkpoint._fault``), every
# ``report._replace_with`` (JSON, JSONL, CSV by rename), every
# ``_write_client_history`` (clients_over_time.npz) and the computation of each
# algorithm's seeds (``sweep.run_seeds``); a kill is raised before one of them
# ("before"), or after half of its temporary file is written ("torn"), or after the
# run's numbers are computed and none written ("inside").

CMP = ["compare", *TINY, "--num-rounds", "4", "--eval-every", "2", "--seeds", "0,1",
       "--algorithms", "fedavg,fedprox", "--no-plots", "--commit-seconds", "0"]
_CMP_RUNS = [(a, s) for a in ("fedavg", "fedprox") for s in (0, 1)]


def _compare_outputs(out) -> dict:
    """A comparison's results: every run's evaluations, rounds, per-client history,
    clients.csv and final metrics, and the comparison table (timings left out)."""
    import csv
    runs = {}
    for alg, seed in _CMP_RUNS:
        d = os.path.join(out, alg, f"seed{seed}")
        with np.load(os.path.join(d, "clients_over_time.npz")) as z:
            clients = {k: z[k] for k in z.files}
        with open(os.path.join(d, "summary.json")) as f:
            final = json.load(f)["final"]
        with open(os.path.join(d, "clients.csv")) as f:
            table = f.read()
        runs[alg, seed] = {"metrics": _rows(os.path.join(d, "metrics.jsonl")),
                           "rounds": _rows(os.path.join(d, "rounds.jsonl")),
                           "clients": clients, "final": final, "clients.csv": table}
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "comparison.csv")) as f:
        csv_rows = [{k: v for k, v in row.items() if "seconds" not in k}
                    for row in csv.DictReader(f)]
    table = {a: {k: v for k, v in row.items() if "seconds" not in k}
             for a, row in summary["table"].items()}
    return {"runs": runs, "table": table, "csv": csv_rows,
            "finished": (summary["runs_finished"], summary["runs"]),
            "leftovers": sorted(os.path.relpath(os.path.join(r, n), out)
                                for r, _, names in os.walk(out) for n in names
                                if n.endswith(".tmp"))}


def _assert_same_comparison(a: dict, b: dict) -> None:
    assert b["finished"] == (4, 4) and b["leftovers"] == []
    assert a["table"] == b["table"] and a["csv"] == b["csv"]
    for key in _CMP_RUNS:
        ra, rb = a["runs"][key], b["runs"][key]
        assert [r["round"] for r in rb["metrics"]] == [0, 2, 4]  # every evaluation, once
        assert [r["round"] for r in rb["rounds"]] == [1, 2, 3, 4]
        assert list(rb["clients"]["round"]) == [0, 2, 4]
        assert ra["metrics"] == rb["metrics"] and ra["rounds"] == rb["rounds"], key
        assert ra["final"] == rb["final"] and ra["clients.csv"] == rb["clients.csv"], key
        assert ra["clients"].keys() == rb["clients"].keys()
        for k in ra["clients"]:
            assert ra["clients"][k].tobytes() == rb["clients"][k].tobytes(), (key, k)


def _compare_points(monkeypatch, out, kill=None) -> list:
    """Hooks compare's write points (see above) and returns the list they append to
    ("write REL" and "run #k" in order); ``kill = (n, how)`` raises ``Killed`` at the
    n-th (1-based) point, ``how`` being "before", "torn" or "inside"."""
    import importlib
    from fedjax_fair.cli import report
    sweep = importlib.import_module("fedjax_fair.drivers.sweeps")  # the module, not the function
    points: list = []
    real_replace, real_history = report._replace_with, cli_compare._write_client_history
    real_run_seeds = sweep.run_seeds

    def reached(point, torn_write=None):
        points.append(point)
        if kill is not None and len(points) == kill[0]:
            if kill[1] == "torn" and torn_write is not None:
                torn_write()
            if kill[1] in ("before", "torn"):
                raise Killed(point)
            return True  # "inside": the caller raises once the work is done
        return False

    def replace_with(path, text):
        def torn():
            with open(f"{path}.tmp", "w") as f:
                f.write(text[:len(text) // 2])
        reached(f"write {os.path.relpath(path, out)}", torn)
        real_replace(path, text)

    def write_history(run_dir, result):
        path = os.path.join(run_dir, "clients_over_time.npz")

        def torn():
            import io
            buf = io.BytesIO()
            np.savez(buf, **result.client_history)
            with open(path + ".tmp", "wb") as f:
                f.write(buf.getvalue()[:len(buf.getvalue()) // 2])
        reached(f"write {os.path.relpath(path, out)}", torn)
        real_history(run_dir, result)

    def run_seeds(*args, **kwargs):
        inside = reached(f"run #{sum(p.startswith('run') for p in points) + 1}")
        res = real_run_seeds(*args, **kwargs)
        if inside:
            raise Killed("inside the run")
        return res

    def fault(point):
        if reached(f"checkpoint {point}"):
            raise Killed(point)
    monkeypatch.setattr(report, "_replace_with", replace_with)
    monkeypatch.setattr(cli_compare, "_write_client_history", write_history)
    monkeypatch.setattr(sweep, "run_seeds", run_seeds)
    monkeypatch.setattr(ckpt, "_fault", fault)
    return points


@pytest.fixture(scope="module")
def compare_reference(tmp_path_factory):
    """The uninterrupted comparison, and its write points in order."""
    out = str(tmp_path_factory.mktemp("store") / "cmp")
    with pytest.MonkeyPatch.context() as mp:
        points = _compare_points(mp, out)
        assert _main([*CMP, "-o", out]) == 0
    return _compare_outputs(out), points


def _kill_compare_and_resume(compare_reference, tmp_path, monkeypatch, n, how):
    full, points = compare_reference
    out = str(tmp_path / "cmp")
    with monkeypatch.context() as mp:
        _compare_points(mp, out, kill=(n, how))
        with pytest.raises(Killed):
            _main([*CMP, "-o", out])
    # killed before the comparison's summary.json: the runs committed so far are there
    assert not os.path.exists(os.path.join(out, "summary.json"))
    committed = {p[len("write "):-len("/summary.json")] for p in points[:n - 1]
                 if p.startswith("write ") and p.endswith("/summary.json")}
    assert {f"{a}/seed{s}" for a, s in _CMP_RUNS
            if os.path.isfile(os.path.join(out, a, f"seed{s}", "summary.json"))} == committed
    assert _main(["compare", "-o", out, "--resume"]) == 0
    _assert_same_comparison(full, _compare_outputs(out))


def test_compare_write_points_the_kill_test_walks(compare_reference):
    _, points = compare_reference
    assert points.count("checkpoint commit") == 4 * 3  # every run commits rounds 0, 2, 4
    assert points.count("run #1") == points.count("run #2") == 1
    for alg, seed in _CMP_RUNS:
        run = [p for p in points if p.startswith(f"write {alg}/seed{seed}/")]
        assert run[-1] == f"write {alg}/seed{seed}/summary.json"  # the run's commit, last
    assert points[-1] == "write summary.json"


def _point(points, name) -> int:
    """The position (from 1) of point ``name``, or of its k-th occurrence ``name@k``."""
    name, _, k = name.partition("@")
    return [i for i, p in enumerate(points) if p == name][int(k or 1) - 1] + 1


# instants named by the point they hit: (point, how)
_COMPARE_KILLS = [
    ("run #2", "inside"),  # inside the second algorithm's runs: computed, nothing written
    ("run #2", "before"),  # between runs: the first algorithm's runs all written
    ("checkpoint commit@3", "before"),  # a run part-way: seed 0 resumes at round 0 ...
    ("checkpoint commit@4", "before"),  # ... at round 2, seed 1 at round 0 (one by one)
    ("checkpoint inside state.npz@5", "before"),  # inside a commit's file write
    ("write fedprox/seed0/summary.json", "torn"),  # a finished run's commit, torn
    ("write fedprox/seed1/clients_over_time.npz", "torn"),  # a run's outputs, half written
    ("write summary.json", "torn"),  # the comparison's own summary, all runs finished
]


@pytest.mark.parametrize("name,how", _COMPARE_KILLS)
def test_compare_killed_then_resumed_is_the_uninterrupted_comparison(
        compare_reference, tmp_path, monkeypatch, name, how):
    """compare killed inside a run, between runs, while a finished run's outputs or the
    comparison's summary are written: compare --resume gives the uninterrupted
    comparison's table and every run's metrics, bit for bit, every evaluation once."""
    _kill_compare_and_resume(compare_reference, tmp_path, monkeypatch,
                             _point(compare_reference[1], name), how)


def _all_compare_kills():
    return [(n, how) for n in range(1, 260) for how in ("before", "torn", "inside")]


# the checkpoint points a run's commit walks through, killed at in every commit (the
# others, between, are walked by test_a_kill_at_any_instant_of_a_commit_resumes_bit_for_bit)
_RUN_COMMIT_POINTS = ("checkpoint mkdir", "checkpoint inside state.npz", "checkpoint commit")


@pytest.mark.slow
@pytest.mark.parametrize("n,how", _all_compare_kills())
def test_compare_killed_at_every_write_point_resumes(compare_reference, tmp_path,
                                                     monkeypatch, n, how):
    """Every write point of the comparison after its config.json (before it there is
    nothing to resume), each way of being killed there."""
    _, points = compare_reference
    first = _point(points, "write config.json") + 1
    if not first <= n <= len(points):
        pytest.skip("no such point")
    if (how == "inside") != points[n - 1].startswith("run"):
        pytest.skip("not that kind of point")
    if points[n - 1].startswith("checkpoint") and (points[n - 1] not in _RUN_COMMIT_POINTS
                                                   or how == "torn"):
        pytest.skip("a run's commit point walked by the run's own kill test")
    _kill_compare_and_resume(compare_reference, tmp_path, monkeypatch, n, how)


def test_a_stop_during_an_algorithms_seeds_is_honoured_at_the_chunks_end(
        compare_reference, tmp_path, monkeypatch, capsys):
    """compare runs an algorithm's seeds as one program through the runner's loop: a
    stop request (what Ctrl-C / SIGTERM do) part-way stops at the end of the chunk, with
    every seed's progress committed to its checkpoint, and --resume continues those
    runs from there to the uninterrupted comparison."""
    from fedjax_fair.drivers import runner
    full, _ = compare_reference
    out = str(tmp_path / "cmp")
    commits = []

    def fault(point):
        if point == "commit":
            commits.append(point)
            if len(commits) == 3:  # fedavg seed 0's round-2 commit: mid-program
                runner.request_stop()
    monkeypatch.setattr(ckpt, "_fault", fault)
    assert _main([*CMP, "-o", out]) == cli.EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert "0 of 4 runs finished" in err and "2 more committed part-way" in err
    for seed in (0, 1):  # both seeds stopped at the same chunk's end, committed
        meta = ckpt.read_meta(os.path.join(out, "fedavg", f"seed{seed}", "checkpoint"))
        assert meta["round"] == 2 and [h["round"] for h in meta["history"]] == [0, 2]
    assert not os.path.exists(os.path.join(out, "fedprox"))  # never started
    monkeypatch.setattr(ckpt, "_fault", lambda point: None)
    assert _main(["compare", "-o", out, "--resume"]) == 0
    _assert_same_comparison(full, _compare_outputs(out))
    assert not os.path.exists(os.path.join(out, "fedavg", "seed0", "checkpoint"))
