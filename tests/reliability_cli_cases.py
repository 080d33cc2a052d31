"""Bad-input cases given as command-line flags (tests/test_reliability.py runs them):
`run`, `compare` and `sweep` flags, every algorithm's hyper-parameter values and names,
learning-rate schedules and step budgets, models against the data."""
from __future__ import annotations

from reliability_common import TINY, _add, _bad_values, _flags

# ---- run flags
for flag, values in (("--num-rounds", ["0", "-5", "1.5", "nan", "inf", "ten", ""]),
                     ("--cohort-size", ["0", "-2", "2.5", "7", "abc"]),
                     ("--eval-every", ["0", "-3", "nan", "x"]),
                     ("--batch-size", ["0", "-1", "x", "1e9.5"]),
                     ("--num-epochs", ["0", "2.5"]),
                     ("--client-lr", ["0", "-0.1", "nan", "inf", "-inf", "abc", "1e-3x"]),
                     ("--seed", ["-1", "1.5", "abc"]),
                     ("--chunk-size", ["0", "-4", "x"])):
    field = flag[2:].replace("-", "_")
    for v in values:
        _flags("run", [flag, v], field)
_flags("run", ["--num-rounds"], "num_rounds", id_="run:--num-rounds (no value)")
# seeds past 32 bits would alias smaller seeds; integers past C's would overflow
for flag, values in (("--seed", ["4294967296", str(10 ** 30)]),
                     ("--resplit-seed", ["4294967296", str(10 ** 30)]),
                     ("--num-rounds", [str(10 ** 30), "3000000000"]),
                     ("--batch-size", [str(10 ** 30)]),
                     ("--num-epochs", [str(10 ** 30), "3000000000"]),
                     ("--cohort-size", [str(10 ** 30)]),
                     ("--eval-every", [str(10 ** 30)]),
                     ("--chunk-size", [str(10 ** 30)])):
    for v in values:
        _flags("run", [flag, v], flag[2:].replace("-", "_"))
_flags("run", ["--resplit", "0.9,0.1,0"], "resplit")  # no client keeps a test example
_flags("run", ["--algorithm", "superfed", "--hp", "local_init_seed=4294967296"],
       "hparams.local_init_seed")
for flag, field in (("--algorithm", "algorithm"), ("--model", "model"),
                    ("--dataset", "dataset"), ("--execution", "execution"),
                    ("--sampler", "sampler"), ("--placement", "placement"),
                    ("--augment", "augment")):
    _flags("run", [flag, "nope"], field)
_flags("run", ["--algorithm", "FedAvg"], "algorithm")
_flags("run", ["--bogus-flag"], "arguments")
_flags("run", ["--num-rounds", "2", "extra"], "arguments")
_flags("run", ["--sampler", "full"], "cohort_size")
_flags("run", ["--algorithm", "aaggff_s"], "cohort_size")  # full participation only
_add(0, "cli:frobnicate", "`frobnicate`", "sub-command", "command",
     cli=lambda ws: ["frobnicate"])
_add(0, "list:nope", "`list nope`", "`list` section", "list", cli=lambda ws: ["list", "nope"])

# ---- compare flags
for flags, field in ((["--algorithms", "nope"], "algorithms"),
                     (["--algorithms", "fedavg,nope"], "algorithms"),
                     (["--algorithms", "fedavg,fedavg"], "algorithms"),
                     (["--algorithms", "fedavg,aaggff_s"], "cohort_size"),
                     (["--seeds", "x"], "seeds"), (["--seeds", "0,x"], "seeds"),
                     (["--seeds", "-1"], "seeds"), (["--seeds", "1.5"], "seeds"),
                     (["--seeds", "0,0"], "seeds"), (["--seeds", ","], "seeds"),
                     (["--seeds", "4294967296"], "seeds"),
                     (["--seeds", f"0,{10 ** 30}"], "seeds"),
                     (["--resplit-seed", "4294967296"], "resplit_seed"),
                     (["--commit-seconds", "-1"], "commit_seconds"),
                     (["--commit-seconds", "inf"], "commit_seconds"),
                     (["--num-rounds", "0"], "num_rounds"),
                     (["--cohort-size", "100"], "cohort_size"),
                     (["--client-lr", "nan"], "client_lr"),
                     (["--algorithms", "fedavg", "--hp", "mu=0.1"], "hparams.mu"),
                     (["--algorithms", "fedprox", "--hp", "fedprox.nope=1"],
                      "hparams[fedprox].nope"),
                     (["--algorithms", "fedprox", "--hp", "nope.mu=1"], "hparams.nope.mu"),
                     (["--algorithms", "fedavg", "--hp", "fedprox.mu=1"],
                      "hparams.fedprox.mu"),
                     (["--algorithms", "fedprox", "--hp", "fedprox.mu=-1"],
                      "hparams[fedprox].mu"),
                     (["--algorithms", "fedavg,fedadam", "--server-lr-schedule",
                       "exponential:0.9"], "server_lr_schedule")):
    _flags("compare", flags, field, area=1)

# ---- sweep flags (beside compare's: both run many settings of one command). The
# output directory is given (-o), so that nothing could be written outside the case's.
for flags, field in ((["--grid", "nope=1,2"], "grid"),  # not a hyper-parameter of qffl
                     (["--grid", "q=-1,1"], "grid"),  # out of q's range
                     (["--grid", "q=abc"], "grid"),  # not a number
                     (["--grid", "mode=faithful,bogus"], "grid")):  # a static choice
    _add(1, f"sweep:{' '.join(flags)}", f"`sweep --algorithm qffl {' '.join(flags)}`",
         "`sweep` flag", field,
         cli=lambda ws, f=flags: ["sweep", *TINY, "--algorithm", "qffl", *f, "-o", ws.out])

# ---- hyper-parameter values, generated from the registry's ranges
def _generate_hparam_cases() -> None:
    from fedjax_fair.algorithms import REGISTRY
    from fedjax_fair.cli import config as C
    seen = set()
    for algorithm in REGISTRY:
        for name, h in C.algorithm_hparams(algorithm).items():
            if h.range is None:
                continue
            values = _bad_values(h.range)
            if (name, h.range) in seen:  # declared alike by an earlier algorithm: one case
                values = values[:1]
            seen.add((name, h.range))
            for value, _ in values:
                _flags("run", ["--algorithm", algorithm, "--hp", f"{name}={value}"],
                       f"hparams.{name}", area=2, tiny=False)


_generate_hparam_cases()

# ---- hyper-parameter names and Python objects
def _generate_name_cases() -> None:
    from fedjax_fair.algorithms import REGISTRY, method_hparams
    from fedjax_fair.cli import config as C
    objects = {}
    for algorithm in REGISTRY:
        settable = list(C.algorithm_hparams(algorithm))
        name = settable[0]
        typo = name[0] + name[2:] if len(name) > 2 else name + "s"
        assert typo not in method_hparams(algorithm)
        _flags("run", ["--algorithm", algorithm, "--hp", f"{typo}=1"], f"hparams.{typo}",
               area=3, tiny=False)
        for obj, h in method_hparams(algorithm).items():
            if h.python_only:
                objects.setdefault(obj, algorithm)
    for obj, algorithm in objects.items():
        _flags("run", ["--algorithm", algorithm, "--hp", f"{obj}=adam"], f"hparams.{obj}",
               area=3, tiny=False)


_generate_name_cases()
for flags, field in ((["--hp", "client_lr=0.1"], "hparams.client_lr"),
                     (["--hp", "batch_size=5"], "hparams.batch_size"),
                     (["--hp", "mu"], "hp"), (["--hp", "=3"], "hp"),
                     (["--hparams", "{bad"], "hparams"), (["--hparams", "[1, 2]"], "hparams"),
                     (["--algorithm", "qffl", "--hp", "mode=nope"], "mode"),
                     (["--algorithm", "qffl", "--hp", "weight_by_size=maybe"],
                      "hparams.weight_by_size"),
                     (["--algorithm", "term", "--hp", "weight_by_size=2"],
                      "hparams.weight_by_size"),
                     (["--algorithm", "fedmgda_plus", "--hp", "center=nope"], "center"),
                     (["--algorithm", "fedmax", "--hp", "loss_source=nope"], "loss_source"),
                     (["--algorithm", "aaggff_d", "--hp", "cdf=nope"], "cdf"),
                     (["--algorithm", "aaggff_d", "--hp", "cdf=9"], "cdf"),
                     (["--algorithm", "aaggff_d", "--hp", "variant=nope"], "variant"),
                     (["--algorithm", "aaggff_d", "--hp", "response_range=[1]"],
                      "response_range"),
                     (["--algorithm", "aaggff_d", "--hp", "response_range=[2, 1]"],
                      "response_range"),
                     (["--algorithm", "aaggff_s", "--cohort-size", "6", "--sampler", "full",
                       "--hp", "solver=nope"], "solver"),
                     (["--algorithm", "scaffold", "--hp", "client_table=nope"],
                      "client_table"),
                     (["--algorithm", "feddyn", "--hp", "client_table=lazy:0"],
                      "client_table"),
                     (["--algorithm", "ditto", "--hp", "client_table=lazy:x"],
                      "client_table"),
                     (["--algorithm", "fedprox", "--hp", "mu=null"], "hparams.mu")):
    _flags("run", flags, field, area=3)
_flags("run", ["--algorithm", "feddyn", "--hp", "client_table=lazy:2", "--num-rounds", "2"],
       "client_table", area=3)

# ---- schedules and step budgets
for spec in ("exponential:0", "exponential:1.5", "exponential:-0.5", "exponential:nan",
             "exponential:0.9@0", "exponential:0.9@x", "step:0.1", "step:0@10",
             "step:-1@10", "step:0.1@0", "step:0.1@x", "cosine", "exponential"):
    _flags("run", ["--algorithm", "fedadam", "--client-lr-schedule", spec],
           "client_lr_schedule", area=4)
for spec in ("exponential:2", "step:0.1@-5"):
    _flags("run", ["--algorithm", "fedadam", "--server-lr-schedule", spec],
           "server_lr_schedule", area=4)
_flags("run", ["--server-lr-schedule", "exponential:0.9"], "server_lr_schedule", area=4)
for spec in ("fixed:-1", "fixed:x", "uniform:5", "uniform:5:2", "uniform:-1:3",
             "stragglers:1.5:2", "stragglers:2:1", "stragglers:0.5:-1", "fixed:2:hours",
             "gaussian:3"):
    _flags("run", ["--step-budgets", spec], "step_budgets", area=4)
# participation and the virtual clock (docs/participation.md)
for flags, field in ((["--availability", "independent:1.5"], "availability"),
                     (["--availability", "independent:-0.1"], "availability"),
                     (["--availability", "sometimes"], "availability"),
                     (["--availability", "size:0.2"], "availability"),
                     (["--availability", "labels:a+b:0.1:0.9"], "availability"),
                     (["--availability", "periodic:0:0.5"], "availability"),
                     (["--availability", "periodic:24.5:0.5"], "availability"),
                     (["--availability", "markov:0.7:0.6"], "availability"),
                     (["--availability", "markov:0:0"], "availability"),
                     (["--availability", "trace:/nonexistent.npy"], "availability"),
                     (["--dropout", "1.5"], "dropout"), (["--dropout", "x"], "dropout"),
                     (["--dropout", "speed:0.5:0"], "dropout"),
                     (["--speeds", "fixed:0"], "speeds"), (["--speeds", "lognormal:1"], "speeds"),
                     (["--speeds", "classes:1@0"], "speeds"), (["--speeds", "fast"], "speeds"),
                     (["--deadline", "2"], "speeds"),
                     (["--speeds", "fixed:1", "--deadline", "-1"], "deadline"),
                     (["--speeds", "fixed:1", "--deadline", "2:late"], "deadline"),
                     (["--speeds", "fixed:1", "--deadline", "0.01"], "deadline"),
                     (["--speeds", "fixed:1", "--bandwidth", "0"], "bandwidth"),
                     (["--speeds", "fixed:1", "--latency", "-1"], "latency"),
                     (["--system-seed", "-1"], "system_seed")):
    _flags("run", flags, field, area=4)
_flags("run", ["--algorithm", "fedbuff", "--hp", "concurrency=2"], "hparams.concurrency",
       area=4)  # the tiny federation's cohort is 3
_flags("run", ["--algorithm", "fedbuff", "--speeds", "fixed:5", "--deadline", "3"], "deadline",
       area=4)

# ---- models against the data
for flags, field, kw in (
        (["--model", "char_lstm"], "model", {}), (["--model", "cnn"], "model", {}),
        (["--model", "resnet18_gn"], "input_shape", {}),
        (["--model-arg", "nope=1"], "model_args.nope", {}),
        (["--model", "mlp", "--model-arg", "hidden=x"], "model_args.hidden", {}),
        (["--model", "mlp", "--model-arg", "hidden=[-1]"], "model_args.hidden", {}),
        (["--model-arg", "hidden"], "model_arg", {}),
        (["--augment", "cifar"], "augment", {})):
    _flags("run", flags, field, area=5, **kw)


# ---- clients never trained on (docs/participation.md)
_flags("run", ["--unseen-clients", "1.5"], "unseen_clients")
# privacy and robustness (cli/transforms.py)
_flags("run", ["--dp-noise", "-1"], "dp_noise")
_flags("run", ["--dp-noise", "1", "--dp-clip", "0"], "dp_clip")
_flags("run", ["--dp-noise", "1", "--dp-delta", "1"], "dp_delta")
_flags("run", ["--dp-epsilon", "0"], "dp_epsilon")
_flags("run", ["--robust", "trimmed_mean:0.5"], "robust")
_flags("run", ["--robust", "median", "--dp-noise", "1"], "robust")
# scenarios without sound meaning for a method (scenarios/wrap.py, docs/scenarios.md)
_flags("run", ["--algorithm", "dqn_fed", "--robust", "median"], "robust")
_flags("run", ["--algorithm", "qffl", "--dp-noise", "1"], "dp_noise")
_flags("run", ["--algorithm", "aaggff_d", "--dp-epsilon", "4"], "dp_epsilon")
_flags("run", ["--algorithm", "dqn_fed", "--attack", "gaussian", "--malicious-ids", "1"],
       "attack")
_flags("run", ["--attack", "sign_flip", "--malicious-fraction", "1.5"], "malicious_fraction")
_flags("run", ["--attack", "sign_flip", "--malicious-ids", "99"], "malicious_ids")
_flags("run", ["--attack", "bitflip", "--malicious-fraction", "0.2"], "attack")

# ---- accepted values that could not do what they say (issue 47)
for flags, field in (
        # client-level DP settings without --dp-noise / --dp-epsilon would be ignored
        (["--dp-clip", "2"], "dp_clip"), (["--dp-delta", "1e-6"], "dp_delta"),
        (["--dp-max-weight", "0.5"], "dp_max_weight"),
        (["--dp-adaptive-clip", "0.5"], "dp_adaptive_clip"),
        # no client would ever train
        (["--dropout", "1.0"], "dropout"), (["--dropout", "speed:1:1"], "dropout"),
        (["--availability", "independent:0"], "availability"),
        (["--availability", "size:0:0"], "availability"),
        (["--availability", "markov:0.5:0"], "availability"),
        (["--availability", "periodic:24:0"], "availability"),
        (["--availability", "classes:0.5@0+0.5@0"], "availability"),
        # class shares that are not a distribution (renormalised without a word before)
        (["--speeds", "classes:0.6@1+0.5@2"], "speeds"),
        (["--availability", "classes:0.5@0.9+0.4@0.1"], "availability"),
        # a schedule whose rates overflow float32 within the run
        (["--num-rounds", "4", "--client-lr-schedule", "step:1e30@1,2"], "client_lr_schedule"),
        # more local steps than the device counts (int32)
        (["--num-epochs", "300000000"], "num_epochs"),
        # more clients in flight than clients; more Byzantine clients than the cohort
        (["--algorithm", "fedbuff", "--hp", "concurrency=1000000"], "hparams.concurrency"),
        (["--robust", "krum:100"], "robust"), (["--robust", "krum:3"], "robust"),
        (["--robust", "multi_krum:1:4"], "robust")):
    _flags("run", flags, field, area=4)
_add(4, "run:--availability trace:all-zero", "`run --availability trace:FILE` (every entry 0)",
     "`run` flag", "availability",
     cli=lambda ws: ["run", *TINY, "--availability",
                     "trace:" + ws.write("zeros.csv", "\n".join(["0,0,0,0,0,0"] * 4))])

# ---- a tuned comparison's options (issue 48; cli/tune.py)
for flags, field in ((["--grid", "qffl.q=1"], "grid"),
                     (["--tune", "--grid", "nope.q=1"], "grid"),
                     (["--tune", "--grid", "q=1"], "grid"),
                     (["--tune", "--grid", "qffl.zz=1"], "grid"),
                     (["--tune", "--grid", "qffl.q=-1,1"], "grid"),
                     (["--tune", "--hp", "q=1", "--client-lr", "0.1"], "grid"),
                     (["--tune", "--select", "nope"], "select"),
                     (["--tune", "--tune-seeds", "0,9"], "tune_seeds"),
                     (["--tune", "--tune-seeds", "5,5"], "tune_seeds"),
                     (["--tune-budget", "4"], "tune_budget"),
                     (["--tune", "--tune-budget", "0"], "tune_budget"),
                     (["--tune", "--availability", "independent:0.5"], "availability"),
                     (["--validation-fraction", "1.5"], "validation_fraction")):
    _flags("compare", ["--algorithms", "qffl", *flags], field, area=1)
