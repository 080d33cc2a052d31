"""The run store under ``compare`` (issue 27): torn or missing outputs of a comparison's
run are run again on ``--resume``, and a comparison killed at any instant (inside a
run, between runs, while outputs or its summary are written) or stopped part-way
resumes to the uninterrupted comparison, bit for bit. A single run's store:
tests/test_store.py."""
import json
import os

import numpy as np
import pytest

from fedjax_fair.drivers import checkpoint as ckpt
from fedjax_fair import cli
from fedjax_fair.cli import compare as cli_compare
from store_common import TINY, Killed, _main, _rows

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


# ---- compare: a kill at any instant, then --resume (issue 27) ----------------------
# ``compare``'s runs go through the runner's loop and commit their checkpoints
# (``run_dir/checkpoint``, every evaluation with --commit-seconds 0); a finished run's
# commit is its summary.json (written last, by rename), after which its checkpoint is
# removed. Its write points are every checkpoint write (``checkpoint._fault``), every
# ``report.files._replace_with`` (JSON, JSONL, CSV by rename), every
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
    from fedjax_fair import reports as report
    sweep = importlib.import_module("fedjax_fair.drivers.sweeps")  # the module, not the function
    points: list = []
    real_replace, real_history = report.files._replace_with, cli_compare._write_client_history
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
    monkeypatch.setattr(report.files, "_replace_with", replace_with)
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
