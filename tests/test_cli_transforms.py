"""The privacy and robustness options of the command line (fedjax_fair/cli/transforms.py):
``--attack`` with malicious clients, ``--robust``, ``--dp-noise`` / ``--dp-epsilon``,
run in-process on tiny data; bad values refused before compute naming the field."""
import csv
import json

import numpy as np
import pytest

from fedjax_fair import cli
from fedjax_fair.scenarios import privacy
from fedjax_fair.drivers import runner
from helpers import CLI_TINY as TINY, one_line_error

pytest.importorskip("dp_accounting")


def _read(out, name):
    return json.loads((out / name).read_text())


def _history(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_an_attacked_run_logs_its_attackers_and_scores_the_benign_clients(tmp_path):
    out = tmp_path / "run"
    assert cli.main(["run", *TINY, "--num-rounds", "3", "--eval-every", "3",
                     "--attack", "sign_flip:3", "--malicious-ids", "1,4",
                     "--robust", "trimmed_mean:0.2", "-o", str(out)]) == 0
    summary = _read(out, "summary.json")
    assert summary["malicious"]["client_ids"] == [1, 4]
    assert summary["final"]["over"].startswith("benign")
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    for row in rounds:  # the attackers of each round, among its participants
        assert [c in (1, 4) for c in row["client_ids"]] == row["attack/malicious"]
        assert "robust/trimmed" in row
    # every evaluation's summary (here the last's) covers the benign clients only
    with open(out / "clients.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    per_client = {"accuracy": np.array([float(r["accuracy"]) for r in rows]),
                  "loss": np.array([float(r["loss"]) for r in rows]),
                  "num_examples": np.array([int(r["num_test_examples"]) for r in rows])}
    benign = ~np.isin(np.arange(len(rows)), [1, 4])
    expected = runner.split_summary(per_client, "test", benign)
    last = _history(out)[-1]
    for name in ("accuracy_mean", "accuracy_worst_10%", "test_loss"):
        assert last[name] == pytest.approx(expected[name], rel=1e-5)
        assert summary["final"][name] == last[name]


def test_a_private_run_reports_dp_accountings_epsilon_at_every_evaluation(tmp_path):
    out = tmp_path / "run"
    assert cli.main(["run", *TINY, "--num-rounds", "4", "--eval-every", "2",
                     "--dp-noise", "1.2", "--dp-clip", "0.5", "--dp-delta", "1e-4",
                     "-o", str(out)]) == 0
    history = _history(out)
    assert [h["round"] for h in history] == [0, 2, 4]
    for h in history[1:]:  # 3 of 6 clients a round, without replacement
        assert h["dp_epsilon"] == pytest.approx(privacy.epsilon(
            1.2, 3 / 6, h["round"], 1e-4, sampling="fixed", population=6), rel=1e-9)
    assert history[0]["dp_epsilon"] == 0.0 and history[2]["dp_epsilon"] > history[1]["dp_epsilon"]


def test_a_target_epsilon_sets_the_noise_and_compare_tables_it(tmp_path):
    out = tmp_path / "cmp"
    # SCAFFOLD releases two sums a round: each noised at z sqrt(2), the same epsilon
    assert cli.main(["compare", *TINY, "--algorithms", "fedavg,scaffold", "--seeds", "0",
                     "--num-rounds", "2", "--dp-epsilon", "8", "--no-plots",
                     "-o", str(out)]) == 0
    with open(out / "comparison.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:  # spent by the last round: at most the target
        assert 7.9 < float(row["dp_epsilon"]) <= 8.0
    assert "| ε" in (out / "comparison.md").read_text()


def test_a_run_clipped_without_noise_reports_an_infinite_epsilon(tmp_path):
    out = tmp_path / "cmp"
    assert cli.main(["compare", *TINY, "--algorithms", "fedavg", "--seeds", "0",
                     "--num-rounds", "2", "--dp-noise", "0", "--dp-clip", "0.1",
                     "--no-plots", "-o", str(out)]) == 0
    with open(out / "comparison.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert float(row["dp_epsilon"]) == float("inf")
    assert "| inf" in (out / "comparison.md").read_text()
    assert _history(out / "fedavg" / "seed0")[-1]["dp_epsilon"] is None  # JSON's inf


@pytest.mark.parametrize("args,field", [
    (["--dp-noise", "-1"], "dp_noise"),
    (["--dp-noise", "1", "--dp-clip", "0"], "dp_clip"),
    (["--dp-noise", "1", "--dp-delta", "1"], "dp_delta"),
    (["--dp-noise", "1", "--dp-epsilon", "3"], "dp_epsilon"),
    (["--robust", "trimmed_mean:0.5"], "robust"),
    (["--robust", "median", "--dp-noise", "1"], "robust"),
    (["--attack", "sign_flip", "--malicious-fraction", "1.5"], "malicious_fraction"),
    (["--attack", "sign_flip"], "malicious_fraction"),
    (["--attack", "bitflip", "--malicious-fraction", "0.2"], "attack"),
    (["--attack", "sign_flip", "--malicious-ids", "9"], "malicious_ids"),
    (["--dp-noise", "1", "--dp-adaptive-clip", "1"], "dp_adaptive_clip"),
    (["--dp-epsilon", "1", "--dp-adaptive-clip", "0.5"], "dp_adaptive_clip"),  # count noise 0.15
    (["--dp-noise", "1", "--availability", "independent:0.5"], "availability"),
    (["--dp-noise", "1", "--dropout", "0.2"], "dropout"),
    (["--dp-noise", "1", "--sampler", "size"], "sampler"),
])
def test_bad_values_are_refused_before_compute(tmp_path, capsys, args, field):
    out = tmp_path / "out"
    assert cli.main(["run", *TINY, *args, "-o", str(out)]) == cli.EXIT_CONFIG
    one_line_error(capsys.readouterr().err, field)
    assert not out.exists()


def test_adaptive_clipping_moves_the_clip_and_is_accounted_with_its_count(tmp_path):
    out = tmp_path / "run"
    assert cli.main(["run", *TINY, "--num-rounds", "4", "--eval-every", "4",
                     "--dp-noise", "0.5", "--dp-clip", "5", "--dp-adaptive-clip", "0.5",
                     "-o", str(out)]) == 0
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    clips = [row["dp/clip"] for row in rounds]
    assert clips[0] == pytest.approx(5.0) and clips[-1] < clips[0]  # C = 5 clips nothing
    assert all(-0.5 <= row["dp/unclipped_fraction"] <= 1.5 for row in rounds)
    dp = privacy.ClientDP(0.5, 5.0, adaptive=privacy.AdaptiveClip(0.5, cohort_size=3.0))
    z = privacy.effective_noise_multiplier(dp)  # sigma_b = 3 / 20 dominates
    assert z < 0.5
    assert _history(out)[-1]["dp_epsilon"] == pytest.approx(privacy.epsilon(
        z, 3 / 6, 4, 1e-5, sampling="fixed", population=6), rel=1e-9)


@pytest.mark.slow  # three runs, each compiled: -m slow
def test_an_attacked_private_run_resumes_to_the_uninterrupted_result(tmp_path):
    flags = ["--eval-every", "2", "--attack", "gaussian", "--malicious-ids", "0,3",
             "--dp-noise", "0.8", "--dp-clip", "0.3"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert cli.main(["run", *TINY, *flags, "--num-rounds", "4", "-o", str(whole)]) == 0
    assert cli.main(["run", *TINY, *flags, "--num-rounds", "2", "-o", str(part)]) == 0
    assert cli.main(["run", "-o", str(part), "--resume", "--num-rounds", "4"]) == 0
    drop = lambda h: {k: v for k, v in h.items() if k != "seconds"}
    assert [drop(h) for h in _history(part)] == [drop(h) for h in _history(whole)]


@pytest.mark.parametrize("algorithm,args,field", [
    ("dqn_fed", ["--robust", "median"], "robust"),  # a solve, not a weighted combination
    ("qffl", ["--dp-noise", "1"], "dp_noise"),  # its step reads losses and norms
    ("afl", ["--dp-noise", "1"], "dp_noise"),  # its weights: state from every loss
    ("dqn_fed", ["--attack", "sign_flip", "--malicious-ids", "1"], "attack"),
    ("scaffold", ["--robust", "median", "--dp-noise", "1"], "robust"),  # one replacement
])
def test_a_pairing_without_sound_meaning_is_refused_in_one_line(tmp_path, capsys, algorithm,
                                                                  args, field):
    out = tmp_path / "out"
    assert cli.main(["run", *TINY, "--algorithm", algorithm, *args,
                     "-o", str(out)]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    one_line_error(err, field)
    assert not out.exists()


def test_qffl_mixing_mode_runs_private_and_scaffold_runs_robust_as_themselves(tmp_path, capsys):
    """q-FFL's separable mode is covered by the release; SCAFFOLD under a median keeps
    its control variates and differs from FedAvg under the same rule; the order of the
    scenarios is recorded and printed."""
    out = tmp_path / "q"
    assert cli.main(["run", *TINY, "--algorithm", "qffl", "--hp", "mode=mixing",
                     "--num-rounds", "2", "--eval-every", "2", "--dp-noise", "1",
                     "-o", str(out)]) == 0
    assert _read(out, "config.json")["scenarios"][0].startswith("client-level DP")
    finals = {}
    for algorithm in ("scaffold", "fedavg"):
        out = tmp_path / algorithm
        assert cli.main(["run", *TINY, "--algorithm", algorithm, "--num-rounds", "2",
                         "--eval-every", "2", "--attack", "sign_flip", "--malicious-ids", "1",
                         "--robust", "median", "-o", str(out)]) == 0
        scenarios = _read(out, "config.json")["scenarios"]
        assert [s.split()[0] for s in scenarios] == ["attack", "robust"]
        finals[algorithm] = _history(out)[-1]["test_loss"]
    assert "scenarios: attack sign_flip by 1 of 6 clients; then robust" in \
        capsys.readouterr().out
    assert finals["scaffold"] != finals["fedavg"]