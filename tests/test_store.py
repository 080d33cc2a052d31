"""The run store's commit point (issue 27, item 1): every evaluation commits the state,
the history, the per-client history and the round log as one step directory
(``checkpoint.save``), so a kill at any instant leaves the last committed evaluation,
and ``--resume`` reproduces the uninterrupted run bit for bit. Logs with a torn last
line, a checkpoint whose meta and state disagree, and a checkpoint of the older format
are handled without a traceback. A comparison's runs (``compare``):
tests/test_store_compare.py."""
import json
import os

import numpy as np
import pytest

from fedjax_fair.drivers import checkpoint as ckpt
from fedjax_fair import cli
from store_common import TINY, Killed, _main, _rows

RUN = ["run", *TINY, "--num-rounds", "3", "--eval-every", "1", "--no-plots"]


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
# file writes, inside each, before and after the renaming commit, during retention).
# Save 3 passes the same 15 points as save 1 (which has no retention) and then retention,
# each with a committed evaluation to fall back to: the default suite kills save 3 at
# every point and save 1 at its first and last; save 1's other points are slow.
_POINTS = ([pytest.param(1, k, marks=() if k in (0, 14) else pytest.mark.slow)
            for k in range(15)] + [(3, k) for k in range(16)])


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
    from fedjax_fair import reports as report
    full, _ = reference
    out = str(tmp_path / "run")
    real = report.files._replace_with
    calls = []

    def torn(path, text):
        calls.append(path)
        if path.endswith("summary.json"):
            with open(path, "w") as f:
                f.write(text[:len(text) // 2])  # cut off
            raise Killed(path)
        real(path, text)
    monkeypatch.setattr(report.files, "_replace_with", torn)
    with pytest.raises(Killed):
        _main([*RUN, "-o", out])
    monkeypatch.setattr(report.files, "_replace_with", real)
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
    from fedjax_fair import reports as report
    rows = report.read_jsonl(path)  # the reader leaves the torn line out
    assert rows[-1]["round"] == 3
    with pytest.raises(ValueError):
        report.read_jsonl(path, strict=True)
    assert _main(["run", "-o", out, "--resume", "--num-rounds", "3"]) == 0
    _assert_same(full, _outputs(out))


def test_read_jsonl_tolerates_only_a_torn_last_line(tmp_path):
    from fedjax_fair import reports as report
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
