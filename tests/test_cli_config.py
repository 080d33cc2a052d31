"""Configuration of the command line (fedjax_fair/cli/config.py, parser.py): files and
flags, hyper-parameters and their ranges, inputs refused before compute with one
line, and the checks of ``--resume`` and of a non-empty output directory.

Every simulation here is tiny (Synthetic with 6 clients of at most 100 examples,
logistic regression, 2-4 rounds); compilation dominates the run time.
"""

import json
import os

import numpy as np
import pytest

from fedjax_fair import cli
from fedjax_fair.cli import config as C
from fedjax_fair.algorithms import ALGORITHMS, REGISTRY
from helpers import CLI_TINY as TINY, one_line_error as _one_line_error, latest_step as _latest


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


def test_model_that_cannot_read_the_inputs_is_a_config_error(tmp_path, capsys):
    code = cli.main(["run", *TINY, "--model", "char_lstm", "--num-rounds", "1",
                     "-o", str(tmp_path / "lstm")])
    assert code == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith("error: model: ") and "Traceback" not in err
    assert not os.path.exists(tmp_path / "lstm")  # refused before anything is written


def test_unprepared_tfds_dataset_prints_the_whole_instruction(tmp_path, capsys):
    code = cli.main(["run", "--dataset", "mnist", "--dataset-arg", f"data_dir={tmp_path}",
                     "-o", str(tmp_path / "out")])
    assert code == cli.EXIT_CONFIG
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: dataset: ")
    assert f"tfds build mnist --data_dir {tmp_path} --file_format array_record" in err
    assert err.endswith("(or set $TFDS_DATA_DIR)")


def test_mixing_is_refused_for_learned_weights(tmp_path, capsys):
    code = cli.main(["run", "--algorithm", "afl", "--mixing", "uniform", "-o",
                     str(tmp_path / "x"), *TINY])
    assert code == 2
    _one_line_error(capsys.readouterr().err, "mixing")
    assert not (tmp_path / "x").exists()


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


def test_hparams_come_from_the_factory_signature():
    import inspect
    params = C.algorithm_hparams("fedadam")
    assert {"server_lr", "b1", "b2", "tau", "max_steps"} <= set(params)
    # config fields (client_lr, batch_size, num_epochs) and Python objects are not hparams
    assert not {"client_lr", "batch_size", "num_epochs", "client_optimizer"} & set(params)
    for name in ALGORITHMS:  # every settable name is a keyword of the factory itself, or a
        # field of its ``training`` (ClientTraining) by its flat name
        keywords = {p.name for p in inspect.signature(ALGORITHMS[name]).parameters.values()
                    if p.kind is p.KEYWORD_ONLY}
        assert "training" in keywords, name
        honoured = set(REGISTRY[name].training_fields)
        assert set(C.algorithm_hparams(name)) <= keywords | honoured
        assert {"client_lr", "batch_size", "num_epochs"} <= honoured


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
        optimizer = seen["training"].optimizer(0.1)
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


def test_unset_training_flags_leave_each_method_its_own_training():
    """--client-lr / --batch-size / --num-epochs replace only the fields given; unset
    ones are each method's own (its factory's default ``training``), and compare says
    which training each method runs."""
    from fedjax_fair.cli.common import for_method
    from fedjax_fair.cli.compare import _training_line
    methods = ["fedavg", "afedpd", "superfed"]
    cfg = C.build(C.CompareConfig, None, {"algorithms": methods, "client_lr": 0.05})
    own = {a: for_method(cfg, a) for a in methods}
    assert [own[a].client_lr for a in methods] == [0.05, 0.05, 0.05]
    assert [own[a].batch_size for a in methods] == [10, 50, 10]
    assert cfg.batch_size is None  # the comparison's config records "each method's own"
    assert "afedpd: lr 0.05, batch 50" in _training_line(cfg)
    every = C.build(C.CompareConfig, None, {"algorithms": methods, "batch_size": 5,
                                            "client_lr": 0.1, "num_epochs": 2})
    assert {for_method(every, a).batch_size for a in methods} == {5}
