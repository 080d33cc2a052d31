"""The command line (fedjax_fair/cli.py, config.py, report.py), run in-process.

Every simulation here is tiny (Synthetic with 6 clients of at most 100 examples,
logistic regression, 2-4 rounds); compilation dominates the run time.
"""
import csv
import json
import os

import numpy as np
import pytest

from fedjax_fair import cli
from fedjax_fair.cli import compare as cli_compare
from fedjax_fair.cli import run as cli_run
from fedjax_fair.cli import report
from fedjax_fair.cli import config as C
from fedjax_fair.algorithms import ALGORITHMS
from fedjax_fair.data import DATASETS
from fedjax_fair.core.execution import STRATEGIES
from fedjax_fair.metrics import METRICS
from fedjax_fair.models import MODELS
from fedjax_fair.core.sampling import SAMPLERS

TINY = ["--num-clients", "6", "--dataset-arg", "max_examples=100", "--cohort-size", "3",
        "--no-progress"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _latest(checkpoint_dir):
    """The newest committed step directory of a checkpoint (checkpoint.latest)."""
    from fedjax_fair.drivers import checkpoint as ckpt
    return ckpt.latest(str(checkpoint_dir))


def _committed_round(meta) -> int:
    """The round of the newest committed save (-1 before the first; a step directory
    retention removes while it is read counts as none)."""
    try:
        return json.loads(open(meta()).read())["round"]
    except (OSError, ValueError):
        return -1


def _png_ok(path):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    import matplotlib.image
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def _one_line_error(err, field):
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and field in lines[0], err


# ------------------------------------------------------------------------------- run


def test_run_writes_all_outputs(tmp_path, capsys):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("algorithm: fedprox\nhparams: {mu: 0.1}\nnum_rounds: 2\neval_every: 1\n"
                   "dataset_args: {num_clients: 6, max_examples: 100}\ncohort_size: 3\n")
    out = tmp_path / "out"
    # progress bars on (the default) to exercise them; the flag overrides the file.
    code = cli.main(["run", "--config", str(cfg), "--num-rounds", "3", "-o", str(out)])
    assert code == 0
    captured = capsys.readouterr()
    assert "fedprox" in captured.out and "Traceback" not in captured.err

    rows = report.read_jsonl(out / "metrics.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    for key in ("accuracy_mean", "accuracy_std", "accuracy_worst_10%", "accuracy_best_10%",
                "accuracy_gini", "test_loss"):
        assert all(np.isfinite(r[key]) for r in rows)
    assert all("train_loss" in r and "seconds" in r for r in rows[1:])

    with open(out / "clients.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == ["client_id", "client", "num_test_examples", "accuracy", "loss",
                              "ece", "mce", "model"]
    assert all(0.0 <= float(r["ece"]) <= float(r["mce"]) <= 1.0 for r in table)
    assert [r["client"] for r in table] == [str(i) for i in range(6)]  # no own ids
    assert {row["model"] for row in table} == {"global"}
    assert [int(r["client_id"]) for r in table] == list(range(6))
    assert all(0.0 <= float(r["accuracy"]) <= 1.0 for r in table)

    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok"
    assert summary["config"]["algorithm"] == "fedprox"
    assert summary["config"]["hparams"] == {"mu": 0.1}
    assert summary["config"]["num_rounds"] == 3  # flag over file
    assert summary["final"]["round"] == 3
    assert summary["final"] == {k: v for k, v in rows[-1].items() if k != "seconds"}
    for key in ("accuracy_mean", "accuracy_worst_10%", "accuracy_best_10%", "accuracy_gini"):
        assert key in summary["final"]
    assert summary["timings"]["compile_seconds"] > 0 and summary["timings"]["run_seconds"] > 0
    assert 0.0 <= summary["improved_fraction_mean"] <= 1.0
    assert summary["dataset"]["num_clients"] == 6
    for name in ("accuracy.png", "loss.png", "client_accuracy_hist.png"):
        _png_ok(out / name)
    assert os.path.isfile(os.path.join(_latest(out / "checkpoint"), "state.npz"))


def test_resume_gives_the_uninterrupted_result(tmp_path, capsys):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    args = TINY + ["--eval-every", "2", "--seed", "3", "--no-plots"]
    assert cli.main(["run", *args, "--num-rounds", "4", "-o", full]) == 0
    assert cli.main(["run", *args, "--num-rounds", "2", "-o", part]) == 0  # "interrupted"
    with open(os.path.join(part, "rounds.jsonl"), "a") as f:  # a chunk cut off mid-way
        f.write(json.dumps({"round": 3, "client_ids": [0]}) + "\n")
    assert cli.main(["run", *args, "--num-rounds", "4", "-o", part, "--resume"]) == 0
    assert "warning" not in capsys.readouterr().err
    # Per-round diagnostics continue without the rows of the cut-off chunk.
    assert (report.read_jsonl(os.path.join(part, "rounds.jsonl"))
            == report.read_jsonl(os.path.join(full, "rounds.jsonl")))
    assert [r["round"] for r in report.read_jsonl(os.path.join(full, "rounds.jsonl"))] == [
        1, 2, 3, 4]

    with open(os.path.join(full, "clients.csv")) as a, open(os.path.join(part, "clients.csv")) as b:
        assert a.read() == b.read()
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]
    rows_full = report.read_jsonl(os.path.join(full, "metrics.jsonl"))
    rows_part = report.read_jsonl(os.path.join(part, "metrics.jsonl"))
    assert strip(rows_full) == strip(rows_part)
    seconds = [r["seconds"] for r in rows_part[1:]]
    assert seconds == sorted(seconds)  # cumulative across the resume
    s_full = json.loads(open(os.path.join(full, "summary.json")).read())
    s_part = json.loads(open(os.path.join(part, "summary.json")).read())
    assert s_full["final"] == s_part["final"]
    assert s_full["improved_fraction_mean"] == s_part["improved_fraction_mean"]
    assert s_part["resumed_from_round"] == 2
    assert not os.path.exists(os.path.join(part, "accuracy.png"))


def test_nan_exits_3_with_round_and_keeps_checkpoint(tmp_path, capsys):
    out = tmp_path / "nan"
    code = cli.main(["run", *TINY, "--num-rounds", "4", "--eval-every", "2",
                     "--client-lr", "1e38", "-o", str(out)])
    assert code == 3
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "round 1" in err and "checkpoint" in err
    assert os.path.isfile(os.path.join(_latest(out / "checkpoint"), "state.npz"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "non_finite" and summary["non_finite_round"] == 1
    assert [r["round"] for r in report.read_jsonl(out / "metrics.jsonl")] == [0]


# ---------------------------------------------------------------------------- compare


def test_compare_writes_table_and_plots(tmp_path, capsys):
    out = tmp_path / "cmp"
    code = cli.main(["compare", *TINY, "--algorithms", "fedavg,fedprox", "--seeds", "1",
                     "--hp", "fedprox.mu=0.5", "--num-rounds", "2", "--eval-every", "2",
                     "-o", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "fedavg" in printed and "fedprox" in printed

    md = (out / "comparison.md").read_text()
    body = [l for l in md.splitlines() if l.startswith("| fed")]
    assert [l.split("|")[1].strip() for l in body] == ["fedavg", "fedprox"]
    for header in ("Average", "Std", "Worst 10%", "Best 10%", "Gini", "Run (s)", "Compile"):
        assert header in md
    with open(out / "comparison.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["algorithm"] for r in rows] == ["fedavg", "fedprox"]
    for key in ("accuracy_mean_percent", "accuracy_std_percent", "accuracy_worst_10%_percent",
                "accuracy_best_10%_percent", "accuracy_gini", "run_seconds", "compile_seconds",
                "accuracy_mean_percent_seed_std"):
        assert all(np.isfinite(float(r[key])) for r in rows)
    assert all(r["num_seeds"] == "1" for r in rows)
    # one unit in both tables: the Markdown cell is the CSV value rounded
    for line, row in zip(body, rows):
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert cells[1] == f"{float(row['accuracy_mean_percent']):.2f}"
        assert cells[3] == f"{float(row['accuracy_worst_10%_percent']):.2f}"
    _png_ok(out / "accuracy.png")
    _png_ok(out / "client_accuracy_hist.png")
    _png_ok(out / "improved_clients.png")
    rounds = report.read_jsonl(out / "fedprox" / "seed1" / "rounds.jsonl")
    assert [r["round"] for r in rounds] == [1, 2] and "improved_fraction" in rounds[0]
    run_summary = json.loads((out / "fedprox" / "seed1" / "summary.json").read_text())
    assert run_summary["config"]["hparams"] == {"mu": 0.5}
    assert run_summary["config"]["seed"] == 1
    assert (out / "fedavg" / "seed1" / "clients.csv").is_file()


def test_compare_defaults_cover_every_algorithm(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default output runs/compare_synthetic: not the user's
    cfg = cli.config_from_args(cli.build_parser().parse_args(["compare"]), C.CompareConfig)
    C.validate_compare(cfg)
    # Every algorithm but the full-participation ones (AAggFF-S, FedPD), which need
    # --cohort-size N --sampler full, and the generative ones (FedEvg, FedCVAE), whose
    # product is a synthetic data set: they are compared when named.
    assert cfg.algorithms == [a for a in ALGORITHMS
                              if a not in ("aaggff_s", "fedpd", "fedevg", "fedcvae")]
    assert cfg.dataset == "synthetic" and cfg.model == "logreg" and cfg.seeds == [0, 1, 2]


def test_compare_leaves_out_methods_that_refuse_the_model(tmp_path, monkeypatch, capsys):
    """The default list (no --algorithms) leaves out, in one line each, a method whose
    factory refuses the model (LG-FedAvg on one-layer logistic regression would be
    FedAvg); named with --algorithms it is a one-line error before compute."""
    import fedjax_fair.algorithms as A
    monkeypatch.setattr(C, "needs_full_participation",  # keep the run small: 3 methods
                        lambda a: a not in ("fedavg", "lg_fedavg", "fedper"))
    out = tmp_path / "cmp"
    code = cli.main(["compare", *TINY, "--num-rounds", "1", "--eval-every", "1", "--seeds",
                     "0", "--no-plots", "--no-improvement", "-o", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert any(l.startswith("left out lg_fedavg") and "shared_layers" in l
               for l in captured.out.splitlines()), captured.out
    saved = json.loads((out / "config.json").read_text())
    assert saved["algorithms"] == ["fedavg", "fedper"] and saved["improvement"] is False
    assert not (out / "lg_fedavg").exists()
    rounds = report.read_jsonl(out / "fedper" / "seed0" / "rounds.jsonl")
    assert "improved_fraction" not in rounds[0] and "loss_after" not in rounds[0]
    assert A.get_method("lg_fedavg")  # still registered: refused only for this model
    code = cli.main(["compare", *TINY, "--algorithms", "fedavg,lg_fedavg", "--num-rounds", "1",
                     "-o", str(tmp_path / "named")])
    assert code != 0
    _one_line_error(capsys.readouterr().err, "shared_layers")


# ------------------------------------------------------------------------------- list


def test_list_prints_every_registry_entry(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    for names in (ALGORITHMS, DATASETS, MODELS, STRATEGIES, SAMPLERS, METRICS):
        for name in names:
            assert name in out
    assert "mu: float = 0.01 in [0, inf), differentiable" in out  # type, default, range
    assert "server_lr: Rate = 0.01 in (0, inf)" in out  # FedAdam's own
    assert "qp_iters: int = 200 in integer 0..inf" in out  # a static count
    assert "full participation" in out  # AAggFF-S
    assert "num_clients=" in out  # dataset arguments


def test_list_shows_partitions(capsys):
    from fedjax_fair.data import PARTITIONERS
    assert cli.main(["list", "partitions"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in PARTITIONERS) and "shards_per_client=2" in out


def test_run_on_a_tfds_dataset_with_the_issue_flags(tmp_path, capsys, monkeypatch):
    # The issue's command shape on mocked CIFAR-10 (no files, no network).
    import helpers
    out = tmp_path / "cifar"
    with helpers.mock_tfds(monkeypatch, num_examples=120):
        code = cli.main(["run", "--dataset", "cifar10", "--partition", "dirichlet",
                         "--alpha", "0.1", "--num-clients", "4", "--dataset-arg", "min_size=5",
                         "--model", "cnn", "--model-arg", "channels=[4,8]",
                         "--model-arg", "dense=16", "--augment", "cifar", "--num-rounds", "2",
                         "--eval-every", "1", "--cohort-size", "2", "--batch-size", "8",
                         "--no-progress", "--no-plots", "-o", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "data: cifar10 train: 4 clients" in printed and "in size buckets" in printed
    assert "memory: " in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"]["name"] == "cifar10"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dataset_args"]["alpha"] == 0.1 and cfg["augment"] == "cifar"


def test_list_one_section(capsys):
    assert cli.main(["list", "models"]) == 0
    out = capsys.readouterr().out
    assert "logreg" in out and "fedavg" not in out


# ------------------------------------------------------------------------- validation


@pytest.mark.parametrize("args, field", [
    (["--algorithm", "nope"], "algorithm"),
    (["--hp", "nope=1"], "hparams.nope"),
    (["--algorithm", "fedprox", "--hparams", '{"mu": "abc"}'], "hparams.mu"),
    (["--cohort-size", "7"], "cohort_size"),
    (["--client-lr", "-0.1"], "client_lr"),
    (["--num-rounds", "0"], "num_rounds"),
    (["--batch-size", "x"], "batch_size"),
    (["--model", "nope"], "model"),
    (["--execution", "nope"], "execution"),
    (["--sampler", "nope"], "sampler"),
    (["--dataset", "nope"], "dataset"),
    (["--dataset-arg", "nope=1"], "dataset_args.nope"),
    (["--partition", "iid"], "dataset_args.partition"),
    (["--alpha", "-1"], "alpha"),
    (["--config", "/does/not/exist.yaml"], "config"),
    (["--resume"], "resume"),
    (["--bogus-flag"], "arguments"),
    (["--model-arg", "nope=1"], "model_args.nope"),
    (["--model", "mlp", "--model-arg", "hidden=x"], "model_args.hidden"),
    (["--augment", "nope"], "augment"),
    (["--placement", "nope"], "placement"),
    (["--algorithm", "aaggff_s"], "cohort_size"),  # full participation only
    (["--step-budgets", "uniform:5"], "step_budgets"),
    (["--step-budgets", "stragglers:2:1"], "step_budgets"),
])
def test_validation_errors_exit_2(tmp_path, capsys, args, field):
    code = cli.main(["run", *TINY, "-o", str(tmp_path / "v"), *args])
    assert code == 2
    _one_line_error(capsys.readouterr().err, field)
    assert not (tmp_path / "v" / "metrics.jsonl").exists()


def test_unknown_config_key_exits_2(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("num_rounds: 3\nlearning_rate: 0.1\n")
    assert cli.main(["run", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    _one_line_error(err, "learning_rate")
    assert "num_rounds" in err  # the allowed keys are listed


def test_malformed_config_file_exits_2(tmp_path, capsys):
    cfg = tmp_path / "bad.json"
    cfg.write_text('{"num_rounds": 3,,}')
    assert cli.main(["run", "--config", str(cfg)]) == 2
    _one_line_error(capsys.readouterr().err, "config")


def test_yaml_merge_keys_may_be_overridden_but_a_key_twice_is_refused(tmp_path):
    """A key given twice in one mapping is an error naming it (PyYAML would keep the
    last); overriding a key merged in with ``<<`` is not a duplicate."""
    cfg = tmp_path / "job.yaml"
    cfg.write_text("hparams: {<<: {mu: 0.1, x: 1}, mu: 0.2}\n")
    assert C.load_file(str(cfg)) == {"hparams": {"mu": 0.2, "x": 1}}
    cfg.write_text("num_rounds: 3\neval_every: 1\nnum_rounds: 4\n")
    with pytest.raises(C.ConfigError) as e:
        C.load_file(str(cfg))
    assert "num_rounds" in e.value.field


def test_seed_of_32_bits_is_refused_not_aliased(tmp_path, capsys):
    """run refuses a seed >= 2^32 as compare does (jax.random.key would keep 32 bits:
    seed 2^32 would give seed 0's run)."""
    for argv, field in ((["run", "--seed", str(2 ** 32)], "seed"),
                        (["compare", "--seeds", str(2 ** 32)], "seeds"),
                        (["run", "--resplit-seed", str(2 ** 32)], "resplit_seed")):
        assert cli.main([*argv, *TINY, "-o", str(tmp_path / "out")]) == cli.EXIT_CONFIG
        _one_line_error(capsys.readouterr().err, field)
        assert not (tmp_path / "out").exists()


def test_compare_validation(capsys):
    assert cli.main(["compare", "--algorithms", "fedavg,nope"]) == 2
    _one_line_error(capsys.readouterr().err, "algorithms")
    assert cli.main(["compare", "--algorithms", "fedavg", "--hp", "mu=0.1"]) == 2
    _one_line_error(capsys.readouterr().err, "hparams.mu")
    assert cli.main(["compare", "--seeds", "0,x"]) == 2
    _one_line_error(capsys.readouterr().err, "seeds")


def test_no_command_exits_2(capsys):
    assert cli.main([]) == 2
    assert "error: command" in capsys.readouterr().err


# ----------------------------------------------------------------------------- config


def _cfg(argv, cls=C.RunConfig):
    return cli.config_from_args(cli.build_parser().parse_args(argv), cls)


@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_config_file_and_flag_override(tmp_path, suffix):
    values = {"algorithm": "fedprox", "hparams": {"mu": 0.1}, "num_rounds": 7,
              "client_lr": "1e-3", "dataset": "digits",
              "dataset_args": {"num_clients": 8, "partition": "iid"}}
    path = tmp_path / f"job.{suffix}"
    if suffix == "json":
        path.write_text(json.dumps(values))
    else:
        import yaml
        path.write_text(yaml.safe_dump(values))
    cfg = _cfg(["run", "--config", str(path), "--num-rounds", "9", "--hp", "max_steps=5",
                "--num-clients", "4"])
    C.validate_run(cfg)
    assert cfg.algorithm == "fedprox" and cfg.dataset == "digits"
    assert cfg.num_rounds == 9  # flag over file
    assert cfg.client_lr == pytest.approx(1e-3) and isinstance(cfg.client_lr, float)
    assert cfg.hparams == {"mu": 0.1, "max_steps": 5}  # merged key by key
    assert cfg.dataset_args == {"num_clients": 4, "partition": "iid"}
    assert cfg.cohort_size == C.RunConfig().cohort_size  # untouched default


def test_value_parsing():
    assert C.parse_assignments(["mu=0.01", "n=3", "flag=true", "p=dirichlet", "x=none",
                                "l=[1, 2]", "e=1e-3"], "hp") == {
        "mu": 0.01, "n": 3, "flag": True, "p": "dirichlet", "x": None, "l": [1, 2], "e": 1e-3}
    with pytest.raises(C.ConfigError, match="^hp: expected NAME=VALUE"):
        C.parse_assignments(["mu"], "hp")
    cfg = _cfg(["run", "--hparams", '{"mu": 1}', "--algorithm", "fedprox"])
    assert C.validate_run(cfg).hparams == {"mu": 1.0}  # int coerced to the default's float


def test_compare_hparams_per_algorithm(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default output runs/compare_synthetic: not the user's
    path = tmp_path / "cmp.yaml"
    path.write_text("algorithms: [fedavg, fedprox, fedadam]\n"
                    "hparams: {fedprox: {mu: 0.5}, server_lr: 0.03}\n")
    cfg = _cfg(["compare", "--config", str(path), "--hp", "fedadam.b1=0.8"], C.CompareConfig)
    hp = C.validate_compare(cfg)
    assert hp == {"fedavg": {}, "fedprox": {"mu": 0.5},
                  "fedadam": {"server_lr": 0.03, "b1": 0.8}}


def test_compare_variants_of_one_method_get_their_own_hparams(tmp_path):
    """NAME@LABEL compares one method under several settings: each variant is validated
    against its method's signature and gets only its own block (plus shared keys)."""
    path = tmp_path / "cmp.yaml"
    path.write_text("algorithms: [qffl, qffl@q5, fedavg]\n"
                    "hparams: {qffl@q5: {q: 5.0}, qffl.q: 1.0, max_steps: 3}\n")
    cfg = _cfg(["compare", "--config", str(path)], C.CompareConfig)
    cfg.output_dir = str(tmp_path / "out")
    hp = C.validate_compare(cfg)
    assert hp["qffl"]["q"] == 1.0 and hp["qffl@q5"]["q"] == 5.0 and "q" not in hp["fedavg"]
    assert all(h["max_steps"] == 3 for h in hp.values())
    for bad in ("qffl@", "qffl@a/b", "nosuch@x"):
        path.write_text(f"algorithms: [fedavg, '{bad}']\n")
        cfg = _cfg(["compare", "--config", str(path)], C.CompareConfig)
        cfg.output_dir = str(tmp_path / "out")
        with pytest.raises(C.ConfigError) as e:
            C.validate_compare(cfg)
        assert e.value.field == "algorithms"
    path.write_text("algorithms: [qffl@q5]\nhparams: {qffl@q5: {nonsense: 1}}\n")
    cfg = _cfg(["compare", "--config", str(path)], C.CompareConfig)
    cfg.output_dir = str(tmp_path / "out")
    with pytest.raises(C.ConfigError):
        C.validate_compare(cfg)


def test_hparams_come_from_the_factory_signature():
    import inspect
    params = C.algorithm_hparams("fedadam")
    assert {"server_lr", "b1", "b2", "tau", "max_steps"} <= set(params)
    # config fields (client_lr, batch_size, num_epochs) and Python objects are not hparams
    assert not {"client_lr", "batch_size", "num_epochs", "client_optimizer"} & set(params)
    for name in ALGORITHMS:  # every settable name is a keyword of the factory itself
        keywords = {p.name for p in inspect.signature(ALGORITHMS[name]).parameters.values()
                    if p.kind is p.KEYWORD_ONLY}
        assert set(C.algorithm_hparams(name)) <= keywords
        assert {"client_lr", "batch_size", "num_epochs"} <= keywords


def test_hparam_ranges_and_objects_are_refused_before_compute(tmp_path):
    for bad in (["--hp", "q=-1"], ["--hp", "client_optimizer=adam"], ["--hp", "tilt=1"],
                ["--client-lr-schedule", "exponential:2"],
                ["--server-lr-schedule", "step:0.1@10"]):
        with pytest.raises(C.ConfigError):
            C.validate_run(_cfg(["run", "--algorithm", "qffl", *bad,
                                 "-o", str(tmp_path / "x")], C.RunConfig))
    cfg = _cfg(["run", "--algorithm", "fedadam", "--server-lr-schedule", "step:0.1@10",
                "--client-lr-schedule", "exponential:0.99", "-o", str(tmp_path / "y")],
               C.RunConfig)
    C.validate_run(cfg)  # fedadam has a server rate


# Gradient clipping and the client optimizer: every method that trains locally.
CLIP_LINE = "clip_norm: Optional[float] = None in (0, inf) or None, differentiable"


def test_list_shows_the_local_training_options_of_every_method_that_trains_locally(capsys):
    assert cli.main(["list", "algorithms"]) == 0
    out = capsys.readouterr().out
    sections = {}
    for line in out.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            name = line.split()[0]
            sections[name] = []
        elif line.startswith("      ") and sections:
            sections[name].append(line.strip())
    assert set(sections) == set(ALGORITHMS)
    for name, lines in sections.items():
        trains_locally = name != "fedevg"  # FedEvg: SGLD on synthetic data, its own clips
        assert (CLIP_LINE in lines) == trains_locally, name
        assert ("clip_mode: str = 'step'" in lines) == trains_locally, name
        objects = next((l for l in lines if l.startswith("Python API only:")), "")
        assert ("client_optimizer" in objects) == trains_locally, name


def test_clip_norm_and_client_momentum_on_the_command_line(tmp_path, capsys):
    """--hp clip_norm / clip_mode and --client-momentum / --client-weight-decay are
    accepted by run and compare (the latter reach every algorithm taking them) and set
    the factory's arguments; bad values stop before any data or compute, naming the
    field."""
    out = tmp_path / "run"
    assert cli.main(["run", *TINY, "--algorithm", "ditto", "--hp", "clip_norm=10",
                     "--hp", "clip_mode=loss", "--client-momentum", "0.9",
                     "--client-weight-decay", "1e-4", "--num-rounds", "1", "--eval-every",
                     "1", "--no-plots", "-o", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["hparams"] == {"clip_norm": 10.0, "clip_mode": "loss"}
    assert cfg["client_momentum"] == 0.9 and cfg["client_weight_decay"] == 1e-4
    capsys.readouterr()

    compare = _cfg(["compare", "--algorithms", "fedavg,pfedme,feddyn", "--hp", "clip_norm=10",
                    "--client-momentum", "0.9", "-o", str(tmp_path / "c")], C.CompareConfig)
    per_algorithm = C.validate_compare(compare)
    assert all(hp == {"clip_norm": 10} for hp in per_algorithm.values())

    for flags, field in ((["--hp", "clip_norm=-1"], "clip_norm"),
                         (["--hp", "clip_norm=0"], "clip_norm"),
                         (["--client-momentum", "1.5"], "client_momentum"),
                         (["--client-weight-decay", "-1"], "client_weight_decay"),
                         (["--algorithm", "fedevg", "--client-momentum", "0.9"],
                          "client_momentum"),
                         (["--algorithm", "fedevg", "--hp", "clip_norm=1"], "clip_norm")):
        bad = tmp_path / "bad"
        assert cli.main(["run", *TINY, "--algorithm", "fedavg", *flags, "-o", str(bad)]) == 2
        _one_line_error(capsys.readouterr().err, field)
        assert not bad.exists()
    assert cli.main(["compare", *TINY, "--algorithms", "fedavg,ditto", "--hp",
                     "clip_norm=-1", "-o", str(tmp_path / "bad")]) == 2
    _one_line_error(capsys.readouterr().err, "clip_norm")


def test_client_momentum_builds_the_client_sgd_of_every_algorithm(monkeypatch):
    """--client-momentum / --client-weight-decay reach the factory as its
    client_optimizer: torch.optim.SGD's update (g + wd theta into a heavy ball)."""
    import inspect
    import jax.numpy as jnp
    import helpers
    from fedjax_fair import algorithms
    for name in ("ditto", "pfedme", "fedavg"):
        entry, seen = algorithms.REGISTRY[name], {}

        def capture(model, _factory=entry.factory, **kwargs):
            seen.update(kwargs)
            return _factory(model, **kwargs)

        capture.__signature__ = inspect.signature(entry.factory)
        monkeypatch.setitem(algorithms.REGISTRY, name, entry._replace(factory=capture))
        cfg = C.build(C.RunConfig, None, {"algorithm": name, "client_momentum": 0.9,
                                          "client_weight_decay": 0.01})
        C.validate_run(cfg)
        cli.build_algorithm(name, helpers.logreg(), cfg, {})
        optimizer = seen["client_optimizer"](0.1)
        params, grads = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, 0.5])}
        first, state = optimizer.update(grads, optimizer.init(params), params)
        second, _ = optimizer.update(grads, state, params)
        g = np.array([0.5, 0.5]) + 0.01 * np.array([1.0, -2.0])
        np.testing.assert_allclose(first["w"], -0.1 * g, rtol=1e-6)
        np.testing.assert_allclose(second["w"], -0.1 * (g + 0.9 * g), rtol=1e-6)


def test_lazy_table_too_small_is_a_config_error(tmp_path, capsys):
    code = cli.main(["run", *TINY, "--algorithm", "feddyn", "--hp", "client_table=lazy:2",
                     "--num-rounds", "2", "-o", str(tmp_path / "lazy")])
    assert code == cli.EXIT_CONFIG
    assert capsys.readouterr().err.startswith("error: client_table: ")


def test_personal_run_and_round_diagnostics(tmp_path):
    out = tmp_path / "superfed"
    assert cli.main(["run", *TINY, "--algorithm", "superfed", "--num-rounds", "2",
                     "--eval-every", "1", "--no-plots", "-o", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["evaluated"] == "personal"
    grid = summary["method_report"]  # SuPerFed's lambda grid, thesis Ch. II §4.2
    assert grid["acc_oracle_per_client"] >= grid["acc_best_lambda_avg"] >= grid["acc_lambda0"]
    assert 0.0 <= grid["best_lambda"] <= 1.0
    assert summary["client_table"]["rows_stored"] == summary["dataset"]["num_clients"]
    with open(out / "clients.csv", newline="") as f:
        assert {row["model"] for row in csv.DictReader(f)} == {"personal"}
    out = tmp_path / "qffl"
    assert cli.main(["run", *TINY, "--algorithm", "qffl", "--num-rounds", "2",
                     "--client-lr-schedule", "step:0.5@1", "--no-plots", "-o", str(out)]) == 0
    rounds = report.read_jsonl(out / "rounds.jsonl")
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:  # q-FFL's effective coefficients, one per participant
        assert len(r["server/coefficients"]) == len(r["client_ids"]) == len(r["weights"])
        assert 0 < sum(r["server/coefficients"]) <= 1 + 1e-6


DIGITS = ["--dataset", "digits", "--num-clients", "6", "--model", "mlp", "--model-arg",
          "hidden=[16]", "--cohort-size", "3", "--batch-size", "32", "--no-progress"]


def test_generative_run_writes_its_synthetic_set_and_downstream_report(tmp_path, capsys):
    out = tmp_path / "fedevg"
    assert cli.main(["run", *DIGITS, "--algorithm", "fedevg", "--num-rounds", "2",
                     "--hp", "local_iters=2", "--client-lr", "0.001", "-o", str(out)]) == 0
    assert "synthetic set (100 samples" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    report_ = summary["method_report"]  # FedEvg's downstream utility, thesis Ch. IV §4.2
    assert 0.0 <= report_["downstream_accuracy"] <= 1.0 and report_["num_synth"] == 100
    saved = np.load(out / "synthetic.npz")
    assert saved["x"].shape == (100, 8, 8, 1) and saved["y"].shape == (100,)
    assert 0.0 <= saved["x"].min() and saved["x"].max() <= 1.0
    _png_ok(out / "synthetic_samples.png")


@pytest.mark.slow
def test_compare_of_generative_methods_gives_each_seed_its_initial_set(tmp_path):
    out = tmp_path / "cmp"
    assert cli.main(["compare", *DIGITS, "--algorithms", "fedevg,fedcvae", "--seeds", "0,1",
                     "--num-rounds", "1", "--hp", "fedevg.local_iters=1",
                     "--hp", "fedcvae.max_steps=1", "-o", str(out)]) == 0
    for name in ("fedevg", "fedcvae"):
        x0, x1 = (np.load(out / name / f"seed{s}" / "synthetic.npz")["x"] for s in (0, 1))
        assert not np.allclose(x0, x1)
        second = json.loads((out / name / "seed1" / "summary.json").read_text())
        assert second["timings"]["compile_seconds"] < 1.0  # the first seed's program
        assert "downstream_accuracy" in second["method_report"]


@pytest.mark.parametrize("command", ["run", "compare"])
def test_inputs_outside_the_synthetic_range_are_refused_before_compute(tmp_path, capsys,
                                                                       command):
    which = ["--algorithm", "fedevg"] if command == "run" else ["--algorithms", "fedevg"]
    code = cli.main([command, *TINY, *which, "--num-rounds", "1", "-o", str(tmp_path / "x")])
    assert code == cli.EXIT_CONFIG
    assert "data_range" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    hp = "data_range=[-10,10]" if command == "run" else "fedevg.data_range=[-10,10]"
    cfg = _cfg([command, *TINY, *which, "--hp", hp, "-o", str(tmp_path / "x")],
               C.RunConfig if command == "run" else C.CompareConfig)
    hparams = cfg.hparams if command == "run" else C.validate_compare(cfg)["fedevg"]
    from fedjax_fair.data import get_dataset
    train = get_dataset("synthetic", num_clients=6, max_examples=100).host_data.train
    C.check_data_range("fedevg", C.validate_hparams("fedevg", hparams), train)  # accepted


# ----------------------------------------------------------------------------- report


def test_comparison_table_mean_std():
    runs = [{"accuracy_mean": 0.8, "accuracy_std": 0.1, "accuracy_worst_10%": 0.5,
             "accuracy_best_10%": 1.0, "accuracy_gini": 0.1,
             "run_seconds": 1.0, "compile_seconds": 2.0},
            {"accuracy_mean": 0.6, "accuracy_std": 0.3, "accuracy_worst_10%": 0.3,
             "accuracy_best_10%": 0.9, "accuracy_gini": 0.2,
             "run_seconds": 3.0, "compile_seconds": 2.0}]
    agg = report.aggregate_runs(runs)
    assert agg["accuracy_mean"] == pytest.approx((0.7, 0.1))
    header, body = report.comparison_table({"a": agg}, num_seeds=2)
    assert body[0][:2] == ["a", "70.00 ± 10.00"]
    header, body = report.comparison_table({"a": report.aggregate_runs(runs[:1])}, num_seeds=1)
    assert body[0][1] == "80.00"
    md = report.markdown_table(header, body)
    assert md.splitlines()[0].startswith("| Algorithm")


# ------------------------------------------------------------- resume and overwrite


def _files(directory) -> dict:
    """{relative path: bytes} of every file below ``directory``."""
    out = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = f.read()
    return out


def test_resume_reads_the_saved_config(tmp_path, capsys):
    """``run -o DIR --resume`` continues the saved run (FedProx, 10 clients, its mu), not
    the defaults, and equals the uninterrupted run."""
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    args = ["--algorithm", "fedprox", "--hp", "mu=0.5", "--num-clients", "10",
            "--cohort-size", "4", "--eval-every", "2", "--seed", "2", "--no-plots",
            "--no-progress"]
    assert cli.main(["run", *args, "--num-rounds", "4", "-o", full]) == 0
    assert cli.main(["run", *args, "--num-rounds", "2", "-o", part]) == 0
    assert cli.main(["run", "-o", part, "--resume", "--num-rounds", "4", "--no-plots",
                     "--no-progress"]) == 0
    with open(os.path.join(full, "clients.csv")) as a, open(os.path.join(part, "clients.csv")) as b:
        assert a.read() == b.read()
    saved = json.loads(open(os.path.join(part, "config.json")).read())
    assert saved["algorithm"] == "fedprox" and saved["hparams"] == {"mu": 0.5}
    assert saved["dataset_args"]["num_clients"] == 10 and saved["num_rounds"] == 4


@pytest.mark.parametrize("change", [["--hp", "mu=0.1"], ["--num-clients", "30"],
                                    ["--client-lr", "0.5"], ["--algorithm", "fedavg"],
                                    ["--seed", "3"]])
def test_resume_refuses_changes_and_writes_nothing(tmp_path, capsys, change):
    part = str(tmp_path / "part")
    args = ["--algorithm", "fedprox", "--hp", "mu=0.5", "--num-clients", "10",
            "--cohort-size", "4", "--eval-every", "2", "--seed", "2", "--no-plots",
            "--no-progress"]
    assert cli.main(["run", *args, "--num-rounds", "2", "-o", part]) == 0
    before = _files(part)
    capsys.readouterr()
    code = cli.main(["run", "-o", part, "--resume", "--num-rounds", "4", *change])
    assert code == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith("error: resume: ")
    assert change[0].lstrip("-").replace("-", "_") in err or "hparams" in err \
        or "dataset_args" in err
    assert _files(part) == before


def test_resume_with_fewer_rounds_than_done_says_so(tmp_path, capsys):
    part = str(tmp_path / "part")
    assert cli.main(["run", *TINY, "--num-rounds", "4", "--eval-every", "2", "--no-plots",
                     "-o", part]) == 0
    before = _files(part)
    capsys.readouterr()
    assert cli.main(["run", "-o", part, "--resume", "--num-rounds", "2"]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith("error: num_rounds: ") and "4" in err
    assert _files(part) == before


def test_resume_refuses_a_checkpoint_of_another_shape_and_writes_nothing(tmp_path, capsys):
    import shutil
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert cli.main(["run", *TINY, "--num-rounds", "2", "--no-plots", "-o", a]) == 0
    assert cli.main(["run", *TINY, "--algorithm", "scaffold", "--num-rounds", "2",
                     "--no-plots", "-o", b]) == 0
    shutil.copy(os.path.join(_latest(os.path.join(b, "checkpoint")), "state.npz"),
                os.path.join(_latest(os.path.join(a, "checkpoint")), "state.npz"))
    before = _files(a)
    capsys.readouterr()
    assert cli.main(["run", "-o", a, "--resume", "--num-rounds", "4"]) == cli.EXIT_CONFIG
    assert capsys.readouterr().err.startswith("error: resume: ")
    assert _files(a) == before


def test_non_empty_output_directory_needs_resume_or_overwrite(tmp_path, capsys):
    out = str(tmp_path / "out")
    assert cli.main(["run", *TINY, "--num-rounds", "1", "--no-plots", "-o", out]) == 0
    before = _files(out)
    capsys.readouterr()
    assert cli.main(["run", *TINY, "--num-rounds", "1", "-o", out]) == cli.EXIT_CONFIG
    assert capsys.readouterr().err.startswith("error: output_dir: ")
    assert _files(out) == before
    assert cli.main(["compare", *TINY, "--algorithms", "fedavg", "--num-rounds", "1",
                     "-o", out]) == cli.EXIT_CONFIG
    assert cli.main(["run", *TINY, "--algorithm", "fedprox", "--num-rounds", "1",
                     "--no-plots", "--overwrite", "-o", out]) == 0
    assert json.loads(open(os.path.join(out, "config.json")).read())["algorithm"] == "fedprox"


# ---------------------------------------------------------------------- interrupts


@pytest.mark.parametrize("signal_name", ["SIGINT", pytest.param("SIGTERM", marks=pytest.mark.slow)])
def test_signal_stops_run_cleanly_and_resume_finishes_it(tmp_path, signal_name):
    """A real SIGINT (Ctrl-C) or SIGTERM mid-run: exit 130 with one line, the
    checkpoint of the last finished chunk kept; --resume then gives the uninterrupted
    result."""
    import signal
    import subprocess
    import sys
    import time
    out, full = str(tmp_path / "run"), str(tmp_path / "full")
    # one device, as in this process (the default, auto, would split the cohort over
    # the subprocess's CPU devices: equal to float rounding, not bit for bit)
    args = ["run", *TINY, "--num-rounds", "400", "--eval-every", "1", "--no-plots",
            "--devices", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "fedjax_fair.cli", *args, "-o", out],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    def meta():  # the newest committed save's meta.json (a step directory)
        step = _latest(os.path.join(out, "checkpoint"))
        return os.path.join(step, "meta.json") if step else ""
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if _committed_round(meta) >= 2:
            break
        time.sleep(0.1)
    proc.send_signal(getattr(signal, signal_name))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == cli.EXIT_INTERRUPTED
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith("error: interrupted after round ") and "--resume" in err
    done = _committed_round(meta)
    assert 2 <= done < 400
    # Finishing it: a short target keeps the test fast, compared with a fresh run.
    target = str(done + 2)
    assert cli.main(["run", "-o", out, "--resume", "--num-rounds", target, "--no-progress"]) == 0
    assert cli.main(["run", *TINY, "--num-rounds", target, "--eval-every", "1", "--no-plots",
                     "--devices", "1", "-o", full]) == 0
    with open(os.path.join(full, "clients.csv")) as a, open(os.path.join(out, "clients.csv")) as b:
        assert a.read() == b.read()


def test_sigterm_stops_compare_cleanly_with_finished_runs_on_disk(tmp_path):
    """A real SIGTERM during a comparison's second run: one line, exit 130, the first
    run's outputs and the table of finished runs on disk."""
    import signal
    import subprocess
    import sys
    import time
    out = str(tmp_path / "cmp")
    proc = subprocess.Popen([sys.executable, "-m", "fedjax_fair.cli", "compare", *TINY,
                             "--algorithms", "fedavg,fedprox", "--seeds", "0",
                             "--num-rounds", "200", "--eval-every", "1", "--no-plots",
                             "-o", out], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    first = os.path.join(out, "fedavg", "seed0", "summary.json")
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None and not os.path.isfile(first):
        time.sleep(0.1)
    time.sleep(1.0)  # into the second run
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == cli.EXIT_INTERRUPTED
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: ") and "--resume" in err
    assert os.path.isfile(os.path.join(out, "fedavg", "seed0", "summary.json"))
    assert "| fedavg" in open(os.path.join(out, "comparison.md")).read()


@pytest.mark.slow
def test_resume_may_change_the_evaluation_frequency(tmp_path):
    out = str(tmp_path / "run")
    assert cli.main(["run", *TINY, "--num-rounds", "2", "--eval-every", "1", "-o", out]) == 0
    assert cli.main(["run", "-o", out, "--resume", "--num-rounds", "6", "--eval-every", "2",
                     "--no-progress"]) == 0
    rows = report.read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["round"] for r in rows] == [0, 1, 2, 4, 6]


@pytest.mark.slow  # heavy; the default run keeps test_resume_gives_the_uninterrupted_result
def test_a_moved_run_directory_resumes_from_its_own_checkpoint(tmp_path):
    """config.json records where the run was; a copied or moved run resumes from the
    checkpoint beside it, and writes only there."""
    import shutil
    first, moved = str(tmp_path / "first"), str(tmp_path / "moved")
    assert cli.main(["run", *TINY, "--num-rounds", "2", "-o", first]) == 0
    shutil.move(first, moved)
    assert cli.main(["run", "-o", moved, "--resume", "--num-rounds", "3",
                     "--no-progress"]) == 0
    assert not os.path.exists(first)
    rows = report.read_jsonl(os.path.join(moved, "metrics.jsonl"))
    assert rows[-1]["round"] == 3
    saved = json.loads(open(os.path.join(moved, "config.json")).read())
    assert saved["checkpoint_dir"] == os.path.join(moved, "checkpoint")


@pytest.mark.slow  # heavy; the default run keeps the SIGTERM compare test
def test_interrupted_compare_keeps_finished_runs_and_resumes(tmp_path, capsys, monkeypatch):
    from fedjax_fair.drivers import runner
    out, fresh = str(tmp_path / "cmp"), str(tmp_path / "fresh")
    args = [*TINY, "--algorithms", "fedavg,fedprox,scaffold", "--num-rounds", "2",
            "--seeds", "0", "--no-plots"]
    real = cli_compare._compare_one
    calls = []

    def stop_after_first(*a, **k):  # as if Ctrl-C came during the second run
        calls.append(a[0])
        if len(calls) == 2:
            runner.request_stop()
        return real(*a, **k)

    monkeypatch.setattr(cli_compare, "_compare_one", stop_after_first)
    assert cli.main(["compare", *args, "-o", out]) == cli.EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert "2 of 3 runs finished" in err and "--resume" in err  # the second one ends its chunk
    assert os.path.isfile(os.path.join(out, "fedavg", "seed0", "summary.json"))
    assert not os.path.exists(os.path.join(out, "scaffold"))
    md = open(os.path.join(out, "comparison.md")).read()
    assert "| fedprox" in md and "| scaffold" not in md and "2 of 3 runs" in md

    calls.clear()
    monkeypatch.setattr(cli_compare, "_compare_one", real)
    assert cli.main(["compare", "-o", out, "--resume", "--no-progress"]) == 0
    assert cli.main(["compare", *args, "-o", fresh]) == 0
    strip = lambda path: [l.split("|")[1:7] for l in open(path).read().splitlines()
                          if l.startswith("| fed") or l.startswith("| sca")]
    assert strip(os.path.join(out, "comparison.md")) == strip(
        os.path.join(fresh, "comparison.md"))
    # --resume keeps the saved settings
    assert cli.main(["compare", "-o", out, "--resume", "--num-rounds", "3"]) == cli.EXIT_CONFIG


def test_diverged_compare_run_keeps_its_metrics_and_is_marked(tmp_path, capsys):
    out = tmp_path / "div"
    code = cli.main(["compare", *TINY, "--algorithms", "fedavg,fedprox",
                     "--hp", "fedprox.mu=1e38", "--num-rounds", "2", "--eval-every",
                     "1", "-o", str(out)])
    assert code == cli.EXIT_NONFINITE
    rows = report.read_jsonl(out / "fedprox" / "seed0" / "metrics.jsonl")
    assert [r["round"] for r in rows][:1] == [0]  # the evaluations before it diverged
    summary = json.loads((out / "summary.json").read_text())
    assert summary["labels"]["fedprox"] == "fedprox (diverged)"
    assert summary["labels"]["fedavg"] == "fedavg"
    assert "diverged" in summary["notes"]["fedprox"]
    _png_ok(out / "accuracy.png")


def test_model_that_cannot_read_the_inputs_is_a_config_error(tmp_path, capsys):
    code = cli.main(["run", *TINY, "--model", "char_lstm", "--num-rounds", "1",
                     "-o", str(tmp_path / "lstm")])
    assert code == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith("error: model: ") and "Traceback" not in err
    assert not os.path.exists(tmp_path / "lstm")  # refused before anything is written


def test_client_without_test_rows_is_empty_in_clients_csv(tmp_path):
    path = str(tmp_path / "clients.csv")
    report.write_client_csv(path, {"num_examples": np.array([3, 0]),
                                   "accuracy": np.array([0.5, 0.0]),
                                   "loss": np.array([1.2, 0.0])})
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["accuracy"] == "0.5" and rows[1]["accuracy"] == "" and rows[1]["loss"] == ""
    report.write_client_csv(path, {"num_examples": np.array([3, 0]),
                                   "accuracy": np.array([0.5, 0.0]),
                                   "loss": np.array([1.2, 0.0])}, names=["f_0007", "f_0123"])
    assert list(report.read_client_csv(path)["client"]) == ["f_0007", "f_0123"]
    back = report.read_client_csv(path)
    assert back["accuracy"][0] == 0.5 and np.isnan(back["accuracy"][1])


def test_unprepared_tfds_dataset_prints_the_whole_instruction(tmp_path, capsys):
    code = cli.main(["run", "--dataset", "mnist", "--dataset-arg", f"data_dir={tmp_path}",
                     "-o", str(tmp_path / "out")])
    assert code == cli.EXIT_CONFIG
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: dataset: ")
    assert f"tfds build mnist --data_dir {tmp_path} --file_format array_record" in err
    assert err.endswith("(or set $TFDS_DATA_DIR)")


@pytest.mark.slow
def test_memory_plan_prints_once_per_compare_and_no_progress_floods_in_logs(tmp_path,
                                                                             capsys):
    # capsys's stderr is not a terminal: no progress bars, hence no carriage returns.
    assert cli.main(["compare", *TINY[:-1], "--algorithms", "fedavg,fedprox,scaffold",
                     "--num-rounds", "2", "--no-plots", "-o", str(tmp_path / "cmp")]) == 0
    captured = capsys.readouterr()
    assert sum(line.startswith("memory:") for line in captured.out.splitlines()) == 1
    assert "\r" not in captured.err and "\r" not in captured.out


def test_progress_bar_on_a_terminal_says_compiling(tmp_path, monkeypatch):
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert cli.main(["run", *TINY[:-1], "--num-rounds", "2", "--no-plots",
                     "-o", str(tmp_path / "run")]) == 0
    assert "compiling" in term.getvalue() and "\r" in term.getvalue()


@pytest.mark.parametrize("algorithm,hp", [("fedprox", "mu=-1"), ("fedadam", "server_lr=0"),
                                          ("fedavgm", "server_lr=-0.5"),
                                          ("fedavgm", "momentum=1.5"),
                                          ("fedsoftmax", "beta=-5"), ("qffl", "q=-0.1"),
                                          ("feddyn", "alpha=0"), ("ditto", "lam=-1")])
def test_out_of_range_hyper_parameters_are_refused_by_name(tmp_path, algorithm, hp):
    name = hp.split("=")[0]
    with pytest.raises(C.ConfigError) as info:
        C.validate_run(_cfg(["run", "--algorithm", algorithm, "--hp", hp,
                             "-o", str(tmp_path / "x")], C.RunConfig))
    assert info.value.field == f"hparams.{name}"


def test_per_client_metrics_at_every_evaluation_survive_a_resume(tmp_path):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    args = [*TINY, "--eval-every", "1", "--no-plots"]
    assert cli.main(["run", *args, "--num-rounds", "3", "-o", full]) == 0
    assert cli.main(["run", *args, "--num-rounds", "2", "-o", part]) == 0
    assert cli.main(["run", "-o", part, "--resume", "--num-rounds", "3"]) == 0
    with np.load(os.path.join(full, "clients_over_time.npz")) as a, \
            np.load(os.path.join(part, "clients_over_time.npz")) as b:
        assert list(a["round"]) == [0, 1, 2, 3] and a["accuracy"].shape == (4, 6)
        for k in ("round", "accuracy", "loss", "num_test_examples"):
            np.testing.assert_array_equal(a[k], b[k])
        final = report.read_client_csv(os.path.join(full, "clients.csv"))
        np.testing.assert_allclose(a["accuracy"][-1], final["accuracy"], rtol=1e-6)


def test_leaf_user_ids_reach_clients_csv(tmp_path):
    import helpers
    rng = np.random.default_rng(0)

    def user(n):
        return rng.normal(size=(n, 4)).tolist(), (np.arange(n) % 3).tolist()

    users = ["writer_b", "writer_a", "writer_c"]
    train = {u: user(12) for u in users}
    test = {u: user(4) for u in users}
    helpers.write_leaf(tmp_path / "leaf" / "train" / "t.json", users, train)
    helpers.write_leaf(tmp_path / "leaf" / "test" / "t.json", users, test)
    out = tmp_path / "out"
    assert cli.main(["run", "--dataset", "leaf", "--dataset-arg",
                     f"path={tmp_path / 'leaf'}", "--cohort-size", "2", "--num-rounds", "1",
                     "--no-plots", "--no-progress", "-o", str(out)]) == 0
    table = report.read_client_csv(out / "clients.csv")
    assert sorted(table["client"]) == sorted(users)  # the users' own ids, row by row


@pytest.mark.parametrize("algorithm,mixing", [("fedavg", "uniform"), ("fedmgda_plus", "uniform"),
                                              ("scaffold", "size")])
def test_size_sampler_and_mixing_flags_reach_every_round(tmp_path, algorithm, mixing):
    """q-FFL's protocol: clients drawn by size without replacement, averaged simply."""
    out = tmp_path / "run"
    code = cli.main(["run", "--algorithm", algorithm, "--sampler", "size", "--mixing", mixing,
                     "--num-rounds", "3", "--eval-every", "3", "-o", str(out), *TINY])
    assert code == 0
    rows = report.read_jsonl(out / "rounds.jsonl")
    for row in rows:
        assert len(set(row["client_ids"])) == 3
        if algorithm == "fedavg":  # exactly the simple average
            np.testing.assert_allclose(row["weights"], 1 / 3, rtol=1e-6)
    saved = json.loads((out / "config.json").read_text())
    assert (saved["sampler"], saved["mixing"]) == ("size", mixing)


def test_mixing_is_refused_for_learned_weights(tmp_path, capsys):
    code = cli.main(["run", "--algorithm", "afl", "--mixing", "uniform", "-o",
                     str(tmp_path / "x"), *TINY])
    assert code == 2
    _one_line_error(capsys.readouterr().err, "mixing")
    assert not (tmp_path / "x").exists()


def test_initializer_flag_sets_the_starting_model(tmp_path):
    out = tmp_path / "run"
    assert cli.main(["run", "--initializer", "zeros", "--num-rounds", "1", "-o", str(out),
                     *TINY]) == 0
    first = report.read_jsonl(out / "metrics.jsonl")[0]
    assert first["round"] == 0
    assert first["test_loss"] == pytest.approx(np.log(10), rel=1e-5)  # all logits zero
    assert json.loads((out / "config.json").read_text())["initializer"] == "zeros"


def test_resplit_gives_validation_metrics_and_a_selected_round(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["run", "--resplit", "0.6,0.2,0.2", "--resplit-seed", "1",
                     "--num-rounds", "4", "--eval-every", "2", "-o", str(out), *TINY]) == 0
    assert "selected by validation" in capsys.readouterr().out
    rows = report.read_jsonl(out / "metrics.jsonl")
    assert all("validation_accuracy_mean" in r and "accuracy_mean" in r for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    best = max(rows, key=lambda r: r["validation_accuracy_mean"])
    assert summary["selected"]["round"] == best["round"]
    assert summary["selected"]["accuracy_mean"] == best["accuracy_mean"]
    assert summary["dataset"]["info"]["resplit"] == {"fractions": [0.6, 0.2, 0.2], "seed": 1}
    # a resumed run must keep the partition
    code = cli.main(["run", "-o", str(out), "--resume", "--resplit", "0.8,0.1,0.1",
                     "--num-rounds", "6"])
    assert code == 2
    assert "resplit" in capsys.readouterr().err


def test_compensate_server_lr_scales_the_server_rate(tmp_path, capsys):
    """FedAvgM (momentum 0) steps by server_lr_t x direction: compensated, server_lr_t
    grows as 1 / client_lr_t, so round t's step is 2^t times the direction."""
    import jax
    from fedjax_fair.drivers.simulate import simulate
    cfg = C.build(C.RunConfig, None, {"algorithm": "fedavgm", "hparams": {"momentum": 0.0},
                                      "client_lr_schedule": "exponential:0.5",
                                      "compensate_server_lr": True,
                                      "dataset_args": {"num_clients": 6, "max_examples": 100}})
    C.validate_run(cfg)
    ds = cli.build_dataset(cfg)
    model = cli.build_model(cfg, ds)
    alg = cli.build_algorithm("fedavgm", model, cfg, cfg.hparams)
    state = alg.init(model.init(jax.random.key(0)), ds.num_clients)
    one_round = jax.jit(lambda s, key: simulate(alg, s, ds.data, key, num_rounds=1,
                                                cohort_size=3))
    for t in range(3):
        new, metrics = one_round(state, jax.random.key(t))
        step = np.sqrt(sum(float(np.sum((np.asarray(a) - np.asarray(b)) ** 2)) for a, b in
                           zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params))))
        assert step == pytest.approx(2.0 ** t * float(metrics["update_norm"][0]), rel=1e-4)
        state = new
    capsys.readouterr()
    assert cli.main(["run", "--algorithm", "fedavgm", "--compensate-server-lr",
                     "-o", str(tmp_path / "x"), *TINY]) == 2
    _one_line_error(capsys.readouterr().err, "compensate_server_lr")
    assert cli.main(["run", "--algorithm", "fedprox", "--compensate-server-lr",
                     "--client-lr-schedule", "exponential:0.9", "-o", str(tmp_path / "y"),
                     *TINY]) == 2
    _one_line_error(capsys.readouterr().err, "compensate_server_lr")
    assert cli.main(["run", "--algorithm", "fedavgm", "--compensate-server-lr",
                     "--client-lr-schedule", "exponential:0.9", "--num-rounds", "2",
                     "-o", str(tmp_path / "z"), *TINY]) == 0
    assert json.loads((tmp_path / "z" / "config.json").read_text())["compensate_server_lr"]


def test_algorithms_flag_narrows_a_config_files_hyper_parameters(tmp_path):
    cfg_file = tmp_path / "cmp.yaml"
    cfg_file.write_text("algorithms: [fedavg, fedprox, qffl]\n"
                        "hparams: {fedprox: {mu: 0.5}, qffl.q: 2.0}\n")
    args = cli.build_parser().parse_args(["compare", "--config", str(cfg_file),
                                          "--algorithms", "fedavg,qffl"])
    cfg = cli.compare_config(args)
    cfg.output_dir = str(tmp_path / "out")
    assert C.validate_compare(cfg) == {"fedavg": {}, "qffl": {"q": 2.0}}
    # without the flag, a file naming an algorithm it does not compare is refused
    cfg_file.write_text("algorithms: [fedavg]\nhparams: {fedprox: {mu: 0.5}}\n")
    args = cli.build_parser().parse_args(["compare", "--config", str(cfg_file)])
    cfg = cli.compare_config(args)
    cfg.output_dir = str(tmp_path / "out")
    with pytest.raises(C.ConfigError, match="fedprox"):
        C.validate_compare(cfg)


# ------------------------------------------------------- compare: seeds as one program


def _run_files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _, files in os.walk(root) for f in files)


@pytest.mark.slow  # heavy; the default run keeps test_sweep's run_seeds == runner.run per seed
def test_compare_seeds_as_one_program_equal_one_run_per_seed(tmp_path):
    """``compare --seeds 0,1`` runs each algorithm's seeds through sweep.run_seeds; its
    files and numbers equal one runner.run per seed (``--sweep-seeds false``), with a
    validation split, a personalised method and a diverged method."""
    args = [*TINY, "--algorithms", "fedavg,ditto,fedprox", "--hp", "fedprox.mu=1e38",
            "--seeds", "0,1", "--num-rounds", "3", "--eval-every", "2",
            "--resplit", "0.6,0.2,0.2", "--no-plots"]
    swept, runs = str(tmp_path / "swept"), str(tmp_path / "runs")
    assert cli.main(["compare", *args, "-o", swept]) == cli.EXIT_NONFINITE
    assert cli.main(["compare", *args, "--sweep-seeds", "false", "-o", runs]) == \
        cli.EXIT_NONFINITE
    assert _run_files(swept) == _run_files(runs)
    for alg in ("fedavg", "ditto", "fedprox"):
        for seed in (0, 1):
            a, b = (os.path.join(root, alg, f"seed{seed}") for root in (swept, runs))
            ha, hb = (report.read_jsonl(os.path.join(d, "metrics.jsonl")) for d in (a, b))
            assert [h["round"] for h in ha] == [h["round"] for h in hb]
            for x, y in zip(ha, hb):
                assert x.keys() == y.keys()
                for k in x:
                    if k != "seconds":
                        np.testing.assert_allclose(x[k], y[k], rtol=1e-5, atol=1e-6)
            ra, rb = (report.read_jsonl(os.path.join(d, "rounds.jsonl")) for d in (a, b))
            assert [r["client_ids"] for r in ra] == [r["client_ids"] for r in rb]
            sa, sb = (json.loads(open(os.path.join(d, "summary.json")).read()) for d in (a, b))
            assert sa.keys() == sb.keys() and sa["status"] == sb["status"]
            if alg == "fedprox":  # diverged: the same rounds, the same evaluations kept
                assert sa["status"] == "non_finite"
                assert (sa["non_finite_round"], sa["last_good_round"]) == (
                    sb["non_finite_round"], sb["last_good_round"])
                continue
            assert sa["evaluated"] == sb["evaluated"]
            ca, cb = (report.read_client_csv(os.path.join(d, "clients.csv")) for d in (a, b))
            np.testing.assert_allclose(ca["accuracy"], cb["accuracy"], atol=1e-6)
            np.testing.assert_allclose(ca["loss"], cb["loss"], rtol=1e-5)
            na, nb = (np.load(os.path.join(d, "clients_over_time.npz")) for d in (a, b))
            assert sorted(na.files) == sorted(nb.files)
            for k in na.files:
                np.testing.assert_allclose(na[k], nb[k], rtol=1e-5, atol=1e-6)
    strip = lambda path: [l.split("|")[1:7] for l in open(path).read().splitlines()
                          if l.startswith(("| fed", "| dit"))]
    assert strip(os.path.join(swept, "comparison.md")) == strip(
        os.path.join(runs, "comparison.md"))


@pytest.mark.slow
def test_compare_resume_runs_the_missing_seeds_as_one_program(tmp_path, monkeypatch):
    """A comparison interrupted after its first algorithm resumes with the missing
    seeds of the others run together; the table equals an uninterrupted one."""
    from fedjax_fair.drivers import runner
    out, fresh = str(tmp_path / "cmp"), str(tmp_path / "fresh")
    args = [*TINY, "--algorithms", "fedavg,qffl", "--seeds", "0,1", "--num-rounds", "2",
            "--no-plots"]
    real = cli_compare._compare_seeds
    calls = []

    def stop_after_first(*a, **k):  # as if Ctrl-C came during the first algorithm's seeds
        calls.append((a[0], list(a[2])))
        runner.request_stop()
        return real(*a, **k)

    monkeypatch.setattr(cli_compare, "_compare_seeds", stop_after_first)
    assert cli.main(["compare", *args, "-o", out]) == cli.EXIT_INTERRUPTED
    assert calls == [("fedavg", [0, 1])]
    assert not os.path.exists(os.path.join(out, "qffl"))
    calls.clear()
    monkeypatch.setattr(cli_compare, "_compare_seeds", lambda *a, **k: (calls.append(a[0]),
                                                                real(*a, **k))[1])
    assert cli.main(["compare", "-o", out, "--resume", "--no-progress"]) == 0
    assert calls == ["qffl"]
    assert cli.main(["compare", *args, "-o", fresh]) == 0
    strip = lambda path: [l.split("|")[1:7] for l in open(path).read().splitlines()
                          if l.startswith(("| fed", "| qff"))]
    assert strip(os.path.join(out, "comparison.md")) == strip(
        os.path.join(fresh, "comparison.md"))


def test_run_turns_on_the_persistent_compilation_cache_unless_off(tmp_path, monkeypatch):
    """``run`` points jax's compilation cache at $FEDJAX_FAIR_COMPILATION_CACHE; "off"
    leaves it off, and a directory the user gave jax is kept."""
    import jax
    saved = (jax.config.jax_compilation_cache_dir,
             jax.config.jax_persistent_cache_min_compile_time_secs)
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv(cli.COMPILATION_CACHE_ENV, "off")
        cli._persistent_compilation_cache()
        assert jax.config.jax_compilation_cache_dir is None
        monkeypatch.setenv(cli.COMPILATION_CACHE_ENV, str(tmp_path / "xla"))
        cli._persistent_compilation_cache()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
        cli._persistent_compilation_cache()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
    finally:
        jax.config.update("jax_compilation_cache_dir", saved[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])


# ------------------------------------------------------- interrupts and a full disk


@pytest.mark.parametrize("where", ["build_dataset", "simulate_one"])
def test_interrupt_before_the_first_round_is_one_line_and_writes_nothing(
        tmp_path, capsys, monkeypatch, where):
    """Ctrl-C while the data is built (outside the runner's stop_on_signals) or as the
    runner starts (a second signal, before any round): one line, exit 130, the output
    directory not even created."""
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli_run, where, interrupt)  # as cmd_run calls it
    out = tmp_path / "out"
    code = cli.main(["run", *TINY, "--num-rounds", "2", "-o", str(out)])
    assert code == cli.EXIT_INTERRUPTED
    _one_line_error(capsys.readouterr().err, "interrupted")
    assert not out.exists()


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_interrupt_while_plotting_leaves_no_summary_and_resume_writes_it(
        tmp_path, capsys, monkeypatch, how):
    """A real SIGINT / SIGTERM while the plots of a finished run are drawn: one line,
    exit 130, no summary.json claiming outputs that are not there (the metrics and the
    checkpoint are); --resume then writes the outputs, and summary.json lists the plots."""
    import signal
    out = tmp_path / "out"
    real = report.save_figure
    calls = []

    def save_figure(fig, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            os.kill(os.getpid(), getattr(signal, how))  # delivered at once, here
        return real(fig, path, *args, **kwargs)

    monkeypatch.setattr(report, "save_figure", save_figure)
    code = cli.main(["run", *TINY, "--num-rounds", "2", "--eval-every", "1", "-o", str(out)])
    assert code == cli.EXIT_INTERRUPTED
    _one_line_error(capsys.readouterr().err, "interrupted")
    assert not (out / "summary.json").exists()
    assert len(report.read_jsonl(out / "metrics.jsonl")) == 3
    monkeypatch.setattr(report, "save_figure", real)
    assert cli.main(["run", "-o", str(out), "--resume", "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["plots"]
    for name in summary["plots"]:
        _png_ok(out / name)


def test_full_disk_is_one_line_naming_the_output_directory(tmp_path, capsys, monkeypatch):
    """No space left while the results are written: one line naming output_dir, a
    non-zero exit that is not the bad-input 2, the checkpoint and metrics kept."""
    import errno
    out = tmp_path / "out"
    real = report.write_json

    def write_json(path, obj):
        if str(path).endswith("summary.json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, obj)

    monkeypatch.setattr(report, "write_json", write_json)
    code = cli.main(["run", *TINY, "--num-rounds", "2", "--eval-every", "1", "--no-plots",
                     "-o", str(out)])
    assert code == cli.EXIT_WRITE and code not in (0, cli.EXIT_CONFIG)
    _one_line_error(capsys.readouterr().err, "output_dir")
    assert not (out / "summary.json").exists()
    assert len(report.read_jsonl(out / "metrics.jsonl")) == 3
    assert _latest(out / "checkpoint")


def test_full_disk_while_the_run_streams_its_metrics_is_one_line(tmp_path, capsys,
                                                                 monkeypatch):
    """The disk filling mid-run, as an evaluation is appended to metrics.jsonl: one
    line naming output_dir, exit EXIT_WRITE, no traceback."""
    import errno
    from fedjax_fair.drivers import runner
    out = tmp_path / "out"
    real = runner.run

    def run(*args, **kwargs):
        def full(*a, **k):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        kwargs["on_eval"] = full
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "run", run)
    code = cli.main(["run", *TINY, "--num-rounds", "2", "--eval-every", "1", "--no-plots",
                     "-o", str(out)])
    assert code == cli.EXIT_WRITE
    _one_line_error(capsys.readouterr().err, "output_dir")
