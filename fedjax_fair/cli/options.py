"""Every option of ``fedjax-fair run | compare | sweep``, declared once.

An ``Option`` states its name (the config-file key; ``--name-with-dashes`` on the
command line), the group of the library value it builds, its value kind (``coerce``),
default, help, and what a resumed or branched run may do with it. Everything else is
derived from ``OPTIONS``: the config dataclasses (``cli.config``), the flags
(``cli.parser``), the fingerprint's fields (``cli.lock``), what ``--resume`` and
``--resume --branch`` may change, what a sweep refuses, and ``fedjax-fair list options``.

Groups (``GROUPS``) and the library value each builds:

* ``data``: the federation and model (``data.get_dataset``, ``models.get_model``);
* ``training``: the method and its local training (``algorithms.build``,
  ``ClientTraining``);
* ``system``: who takes part and how long rounds take (``cli.parsing.parse_system``
  -> ``scenarios.system.System``; the sampler and step budgets);
* ``robustness``: ``scenarios.with_attack`` / ``with_robust`` (``cli.transforms``);
* ``privacy``: ``scenarios.with_privacy`` and its accountant (``cli.transforms``);
* ``evaluation``: what is measured and when;
* ``execution``: how rounds map to devices (``core.execution.Execution``);
* ``output``: where results go and how they are kept (the run store).

This module is the bottom of the command line: it imports nothing of ``cli`` and
holds its error type, ``ConfigError``.
"""
from __future__ import annotations

import re
import math
from typing import Any, Callable, NamedTuple, Optional

from fedjax_fair.hparams import FieldError

COMMANDS = ("run", "compare", "sweep")
MIXINGS = ("default", "size", "uniform")

def flag_names(name: str) -> list[str]:
    """The command-line spellings of option ``name``: ``--with-dashes`` and, when it
    has underscores, ``--with_underscores`` too."""
    dashed = "--" + name.replace("_", "-")
    return [dashed] if "_" not in name else [dashed, "--" + name]


SWITCH = "switch"
"""``Option.flag`` of a bool switch spelled after each command's default
(``switch_name``), for an option whose default differs between commands."""


def switch_name(name: str, default: bool) -> str:
    """The switch of bool option ``name`` at ``default``: ``--no-name`` (it turns a true
    default off), ``--name`` (it turns a false default on)."""
    return ("--no-" if default is True else "--") + name.replace("_", "-")


class Group(NamedTuple):
    """An option group: what its options describe, and the function of the command line
    that reads them to build the group's library value (``module:function`` under
    ``fedjax_fair.cli``)."""

    title: str
    builder: str


GROUPS = {
    "data": Group("the federation and the model", "common:build_dataset, common:build_model"),
    "training": Group("the method and its local training", "common:build_algorithm"),
    "system": Group("participation and system heterogeneity (who takes part, how long "
                    "rounds take)", "common:system_of"),
    "robustness": Group("attacks and robust aggregation", "transforms:apply"),
    "privacy": Group("client-level differential privacy", "transforms:apply"),
    "evaluation": Group("what is measured, and when", "common:simulate_one"),
    "execution": Group("how rounds map to devices", "common:execution_of"),
    "output": Group("where results go and how they are kept", "common:_own"),
}
"""Group key -> ``Group``, in the order ``list options`` shows them."""


class ConfigError(FieldError):
    """A configuration mistake; ``str(e)`` is ``"<field>: <what is wrong>"`` (the
    library's ``hparams.FieldError``, raised by the command line)."""


class Option(NamedTuple):
    """One option. ``kind``: the value kind (``config.coerce``: "int", "float?", ...).
    ``commands``: the commands that take it. ``helps`` / ``defaults`` / ``kinds``:
    per-command overrides. ``flag``: how the command line gives it: "" (the default)
    ``--name VALUE``; a switch such as ``"--no-plots"`` (sets the opposite of the
    default) or ``"--overwrite"``; ``SWITCH``: a switch spelled after the command's
    default (``switch_name``: ``--no-name`` where it is True, ``--name`` where False);
    None: only a config file (or a flag of its own in ``cli.parser``: ``--hp``,
    ``--grid``). ``iterates``: a change alters the run's
    iterates (part of its fingerprint). ``resume``: the commands whose ``--resume``
    may change it. ``branch``: ``run --resume --branch`` may change it (optimisation
    settings that keep the state's shapes). ``later``: added after runs were recorded
    without it: left out of the fingerprint at its default, so such runs still resume.
    ``sweep``: False when a sweep refuses any value but the default (its runs have no
    participation or clock model). ``check(field, value)``: its range (raises
    ``ConfigError``; None passes unchecked where the kind allows None). ``choices()``:
    the names it may take (imported when the config is validated)."""

    name: str
    group: str
    kind: str
    default: Any
    help: str
    commands: tuple = COMMANDS
    helps: Optional[dict] = None
    defaults: Optional[dict] = None
    kinds: Optional[dict] = None
    flag: Optional[str] = ""
    iterates: bool = True
    resume: tuple = ()
    branch: bool = False
    later: bool = False
    sweep: bool = True
    check: Optional[Callable] = None
    choices: Optional[Callable] = None

    def for_command(self, command: str) -> "Option":
        """This option as ``command`` takes it (its help, default and kind there)."""
        pick = lambda d, v: (d or {}).get(command, v)
        default = pick(self.defaults, self.default)
        flag = switch_name(self.name, default) if self.flag == SWITCH else self.flag
        return self._replace(help=pick(self.helps, self.help), default=default,
                             kind=pick(self.kinds, self.kind), flag=flag)

    @property
    def flags(self) -> list:
        """The command-line spellings of a value option (``--num-rounds``, ``--num_rounds``)."""
        dashed = "--" + self.name.replace("_", "-")
        return [dashed] if "_" not in self.name else [dashed, "--" + self.name]


# ------------------------------------------------------------------- ranges

COUNT_LIMIT = 2 ** 31  # rounds, batches, epochs ... are int32 on the device
SEED_LIMIT = 2 ** 32  # jax.random.key and numpy's legacy generators take 32-bit seeds


def positive_count(field: str, value) -> None:
    """An integer >= 1 that fits the device's int32."""
    if value <= 0:
        raise ConfigError(field, f"must be a positive integer, got {value}")
    if value >= COUNT_LIMIT:
        raise ConfigError(field, f"must be below 2^31, got {value}")


def seed(field: str, value) -> None:
    """An integer in [0, 2^32): a larger one would alias a smaller seed
    (``jax.random.key`` keeps 32 bits) or overflow."""
    if not 0 <= value < SEED_LIMIT:
        raise ConfigError(field, f"must be an integer in [0, 2^32), got {value}")


def _real(test, what: str) -> Callable:
    def check(field: str, value) -> None:
        if not (math.isfinite(value) and test(value)):
            raise ConfigError(field, f"must be {what}, got {value}")
    return check


POSITIVE = _real(lambda v: v > 0, "a positive finite number")
NONNEGATIVE = _real(lambda v: v >= 0, "a finite number >= 0")
UNIT = _real(lambda v: 0 <= v < 1, "a number in [0, 1)")
SECONDS = _real(lambda v: v >= 0, "a finite number of seconds >= 0")
HOLD_OUT = _real(lambda v: 0 <= v < 1, "a fraction in [0, 1) (0: every client trains)")


def _names(module: str, attribute: str, *extra) -> Callable:
    """``choices`` read from ``module.attribute`` when asked (no import before)."""
    def choices():
        import importlib
        return (*extra, *getattr(importlib.import_module(module), attribute))
    return choices



_IMPROVEMENT = ('log every round the share of participants whose training loss did not '
                'rise (improved_fraction in rounds.jsonl, DQN-Fed eq. 29, drawn as '
                'improved_clients.png; one more forward pass over the cohort a round, two '
                'for personalised methods)')


OPTIONS = (
    Option("dataset", "data", 'str', 'synthetic',
           'dataset name (see `fedjax-fair list datasets`)'),
    Option("dataset_args", "data", 'dict', {},
           'keyword arguments of the dataset builder',
           flag=None),
    Option("model", "data", 'str', 'logreg',
           'model name (see `fedjax-fair list models`)',
           choices=_names("fedjax_fair.models", "MODELS")),
    Option("model_args", "data", 'dict', {},
           'keyword arguments of the model builder',
           flag=None),
    Option("initializer", "data", 'str', 'default',
           "weight initializer: default (the network's own) or glorot_uniform, "
           'glorot_normal, lecun_uniform, lecun_normal, he_uniform, he_normal, '
           'zeros for every kernel, with zero biases',
           choices=_names("fedjax_fair.models", "INITIALIZERS", "default")),
    Option("resplit", "data", 'str', 'none',
           'TRAIN,VALIDATION,TEST fractions, e.g. 0.8,0.1,0.1: pool each '
           "client's examples, shuffle them with resplit_seed and split them "
           "anew (q-FFL's protocol); none keeps the dataset's own split"),
    Option("resplit_seed", "data", 'int', 0,
           'seed of --resplit (in [0, 2^32); q-FFL averages seeds 1-5)',
           check=seed),
    Option("validation_fraction", "data", 'float', 0.0,
           "hold out this fraction of each client's training rows as a "
           'validation split (drawn with resplit_seed; the test split untouched; '
           'nothing when the data has a validation split already); compare --tune '
           'uses 0.1 for its search when this is 0',
           later=True, check=UNIT),
    Option("augment", "data", 'str', 'none',
           'training-time augmentation of the inputs: none, cifar (flip + '
           'padded crop) or tinyimagenet (rotation + flip)',
           choices=_names("fedjax_fair.data.augment", "STANDARD_AUGMENTATIONS")),
    Option("client_lr", "training", 'float?', None,
           "client learning rate (> 0); none: each method's own (its factory's "
           'default training)',
           branch=True,
           check=POSITIVE),
    Option("client_momentum", "training", 'float', 0.0,
           "SGD momentum of the clients' local steps, in [0, 1) (0: plain SGD); "
           'with --client-weight-decay it sets the client_optimizer of every '
           "algorithm that takes one (client.sgd_optimizer: torch.optim.SGD's "
           "momentum and weight decay; the thesis's 0.9 and 1e-4)",
           branch=True,
           check=UNIT),
    Option("client_weight_decay", "training", 'float', 0.0,
           'weight decay of that client SGD (>= 0), added to the gradient after '
           'any clip_norm',
           branch=True,
           check=NONNEGATIVE),
    Option("client_lr_schedule", "training", 'str', 'none',
           'client learning rate by round t: none, exponential:GAMMA (lr * '
           'GAMMA^t), exponential:GAMMA@S (lr * GAMMA^floor(t/S)) or '
           'step:FACTOR@R1,R2 (lr * FACTOR at each listed round)',
           branch=True),
    Option("server_lr_schedule", "training", 'str', 'none',
           'the same for the server rate (server_lr) of algorithms that have '
           'one',
           branch=True),
    Option("compensate_server_lr", "training", 'bool', False,
           'scale the server rate by client_lr_0 / client_lr_t, keeping their '
           "product constant as the client rate decays (AAggFF's reference "
           'code)',
           flag='--compensate-server-lr', branch=True),
    Option("batch_size", "training", 'int?', None,
           "client batch size (> 0); none: each method's own",
           check=positive_count),
    Option("num_epochs", "training", 'int?', None,
           "local epochs per round (> 0); none: each method's own",
           branch=True,
           check=positive_count),
    Option("num_rounds", "training", 'int', 150,
           'number of rounds (> 0)',
           iterates=False, resume=('run',),
           check=positive_count),
    Option("cohort_size", "training", 'int', 10,
           'clients per round (> 0, at most the number of clients)',
           check=positive_count),
    Option("eval_every", "evaluation", 'int', 10,
           'evaluate every client every this many rounds (> 0)',
           iterates=False, resume=('run',),
           check=positive_count),
    Option("eval_clients", "evaluation", 'int?', None,
           'evaluate a fixed random subset of this many clients at the evaluations '
           'before the last (the same clients for every seed and method); the final '
           'evaluation covers every client; none: every client every time',
           commands=("run", "compare"), iterates=False, later=True,
           check=positive_count),
    Option("execution", "execution", 'str', 'auto',
           'cohort execution strategy',
           choices=_names("fedjax_fair.core.execution", "STRATEGIES")),
    Option("chunk_size", "execution", 'int?', None,
           'clients per chunk (execution=chunked, default 8) or per bucket '
           '(execution=bucketed, default a quarter of the cohort)',
           check=positive_count),
    Option("sampler", "system", 'str', 'uniform',
           'cohort sampler: uniform, full (every client) or size (probability '
           'n_k / n, without replacement)',
           choices=_names("fedjax_fair.scenarios.sampling", "SAMPLERS")),
    Option("mixing", "training", 'str', 'default',
           'the plain average an algorithm starts from: default (the '
           "algorithm's own), size (p_k ∝ n_k) or uniform (1 / |S|, the partner "
           'of --sampler size); for algorithms with a size prior',
           choices=lambda: MIXINGS),
    Option("step_budgets", "system", 'str', 'none',
           'local-step budgets redrawn every round: none, fixed:B, '
           'uniform:LOW:HIGH, stragglers:FRACTION:B (append :epochs to count '
           'epochs)'),
    Option("availability", "system", 'str', 'always',
           'which clients can be sampled each round (docs/participation.md): '
           'always, independent:P, size:LOW:HIGH (probability from data size, '
           'smallest LOW, largest HIGH), labels:L1+L2:LOW:HIGH (from the share '
           'of those labels), classes:SHARE@P+SHARE@P (device classes, each '
           'with its probability), periodic:PERIOD:ON_FRACTION (diurnal, '
           'per-client phase), markov:P_OFF:P_ON (on/off chain per client), '
           'trace:FILE (.npy or .csv table [rounds, clients], replayed '
           'cyclically)',
           sweep=False),
    Option("dropout", "system", 'str', 'none',
           'probability that a selected client fails to report: none, P, or '
           'speed:SLOWEST:FASTEST (tied to --speeds)',
           sweep=False),
    Option("speeds", "system", 'str', 'none',
           "a virtual clock: each client's local steps per second, none (no "
           'clock), fixed:S, lognormal:MEDIAN:SIGMA or '
           'classes:SHARE@SPEED+SHARE@SPEED (device classes)',
           sweep=False),
    Option("bandwidth", "system", 'str', 'none',
           "bytes per second each way for the model's download and upload "
           '(none: communication takes no time)',
           sweep=False),
    Option("latency", "system", 'float', 0.0,
           'seconds of latency per round trip (>= 0)',
           sweep=False),
    Option("deadline", "system", 'str', 'none',
           'round deadline: none, SECONDS (late clients dropped) or '
           'SECONDS:partial (late clients send the steps finished in time)',
           sweep=False),
    Option("system_seed", "system", 'int', 0,
           'seed of the drawn client speeds and device classes'),
    Option("placement", "execution", 'str', 'auto',
           'federation on the device, or on the host with cohorts streamed per '
           'chunk (auto: device if the memory plan fits)',
           iterates=False,
           choices=_names("fedjax_fair.core.memory", "PLACEMENTS")),
    Option("devices", "execution", 'devices', 'auto',
           "devices to split every cohort over (a mesh with a 'clients' axis; "
           'the federation and client tables are split by client too); each '
           'device runs its share with --execution. auto: on a CPU, one device '
           'per core, as many as split the federation evenly, or one device for '
           "local steps large enough to keep the cores busy (a CNN's) or rounds "
           "too small to gain from a split (a small logistic regression's); "
           "results equal one device's to float rounding, not bit for bit; one "
           'device on an accelerator; every device of a --distributed job. 1: '
           'one device; N > 1: the first N devices; all: every device (every '
           "process's with --distributed). On a CPU, N, all and auto make one "
           'device per core (up to N) before JAX starts',
           iterates=False),
    Option("output_dir", "output", 'str?', None,
           'output directory',
           iterates=False, resume=('run', 'compare', 'sweep')),
    Option("overwrite", "output", 'bool', False,
           'write into an output directory that already holds results, '
           'replacing them',
           flag='--overwrite', iterates=False, resume=('run', 'compare', 'sweep')),
    Option("progress", "output", 'bool', True,
           'show progress bars (--no-progress: none)',
           flag='--no-progress', iterates=False, resume=('run', 'compare', 'sweep')),
    Option("plots", "output", 'bool', True,
           'write PNG plots (--no-plots: none)',
           flag='--no-plots', iterates=False, resume=('run', 'compare', 'sweep')),
    Option("improvement", "evaluation", 'bool', True,
           _IMPROVEMENT + '; on by default, --no-improvement saves it',
           helps={'run': _IMPROVEMENT + '; off by default in run, --improvement turns it on',
                  'sweep': "accepted as in run and compare, but a sweep keeps only each "
                           "run's final state: it logs no per-round share "
                           "(improved_fraction) whatever the value"},
           defaults={'run': False},
           flag=SWITCH, iterates=False),
    Option("robust", "robustness", 'str?', None,
           "a robust aggregator in place of the method's (docs/robustness.md): "
           'median, weighted_median, trimmed_mean[:TRIM], krum[:F], '
           'multi_krum[:F[:M]], geometric_median[:ITERS], norm_bound:MAX_NORM '
           '(wraps it)',
           later=True),
    Option("attack", "robustness", 'str?', None,
           "malicious clients' attack: label_flip, sign_flip[:SCALE], "
           'gaussian[:STD], scaled_replacement[:SCALE] (with '
           '--malicious-fraction or --malicious-ids)',
           later=True),
    Option("malicious_fraction", "robustness", 'float', 0.0,
           'fraction of the clients under --attack, in [0, 1] (floor(F N) '
           'clients, drawn with --malicious-seed)',
           later=True),
    Option("malicious_ids", "robustness", 'list[int]', [],
           'comma-separated clients under --attack',
           later=True),
    Option("malicious_seed", "robustness", 'int', 0,
           'the seed that draws the malicious clients (the same for every '
           'method and seed of a comparison)',
           later=True),
    Option("dp_noise", "privacy", 'float?', None,
           'client-level DP (DP-FedAvg): the noise multiplier z; noise std z 2 '
           'C b on the weighted sum (docs/privacy.md)',
           later=True),
    Option("dp_epsilon", "privacy", 'float?', None,
           'client-level DP: the epsilon to spend over --num-rounds (sets the '
           'noise multiplier)',
           later=True),
    Option("dp_clip", "privacy", 'float', 1.0,
           'client-level DP: the L2 clip C of each update',
           later=True),
    Option("dp_delta", "privacy", 'float', 1e-05,
           'client-level DP: the delta epsilon is reported at',
           later=True),
    Option("dp_max_weight", "privacy", 'float?', None,
           'client-level DP: the largest mixing weight b a client may get '
           '(default 1 / cohort: uniform); larger lets fair rules reweight at '
           'more noise',
           later=True),
    Option("dp_adaptive_clip", "privacy", 'float?', None,
           'client-level DP: adaptive clipping to this quantile of the update '
           'norms, in (0, 1), from --dp-clip (Andrew et al.; its noisy count is '
           'accounted for)',
           later=True),
    Option("tracker", "output", 'list[str]', [],
           'comma-separated experiment trackers to log to, any of tensorboard, '
           'wandb (offline), mlflow (file store): one tracked run per algorithm '
           'and seed under OUTPUT_DIR (docs/tracking.md; pip install -e '
           '".[tracking]"); none by default',
           iterates=False, resume=('run', 'compare', 'sweep')),
    Option("algorithm", "training", 'str', 'fedavg',
           'algorithm name (see `fedjax-fair list algorithms`)',
           commands=('run', 'sweep')),
    Option("hparams", "training", 'dict', {},
           'algorithm hyper-parameters',
           helps={'compare': 'hyper-parameters, NAME or ALGORITHM.NAME',
                  'sweep': "the algorithm's other hyper-parameters"},
           flag=None, branch=True),
    Option("seed", "training", 'int', 0,
           'seed of model init, sampling and local training (in [0, 2^32))',
           commands=('run',),
           check=seed),
    Option("checkpoint", "output", 'bool', True,
           'save a checkpoint after every evaluation (--no-checkpoint: none)',
           commands=('run',), flag='--no-checkpoint', iterates=False),
    Option("checkpoint_dir", "output", 'str?', None,
           'checkpoint directory (default: OUTPUT_DIR/checkpoint)',
           commands=('run',), iterates=False),
    Option("resume", "output", 'bool', False,
           'continue from the checkpoint (same result as an uninterrupted run)',
           helps={'compare': 'continue an interrupted comparison: finished runs are kept',
                  'sweep': 'continue an interrupted sweep: its saved calls are not run '
                           'again'},
           flag='--resume', iterates=False, resume=('run', 'compare', 'sweep')),
    Option("unseen_clients", "data", 'float', 0.0,
           'fraction of the clients, in [0, 1), held out of training and '
           'evaluated at the end as clients never trained on '
           '(docs/participation.md): global methods on their final model, '
           'personalised ones after one round of their client procedure; drawn '
           "with the dataset's seed (0 if it has none)",
           commands=('run', 'compare'), later=True,
           check=HOLD_OUT),
    Option("algorithms", "training", 'list[str]', [],
           'comma-separated algorithms',
           commands=('compare',)),
    Option("seeds", "training", 'list[int]', [0, 1, 2],
           'comma-separated seeds',
           commands=('compare', 'sweep'),
           helps={'sweep': 'comma-separated seeds or ranges, e.g. 0-4 or 0,2,5-7'},
           kinds={'sweep': 'seeds'}),
    Option("sweep_seeds", "execution", 'bool', True,
           "run each algorithm's seeds as one program "
           '(fedjax_fair.drivers.sweeps.run_seeds: vmapped on accelerators, one '
           'compiled program called per seed on CPU; the same results as one '
           'run per seed up to float rounding); false: one runner.run per seed. '
           'Generative methods, a device mesh (--devices), --placement host, a '
           'program too large for the device and a single seed always run per '
           'seed',
           commands=('compare',), iterates=False, resume=('compare',)),
    Option("commit_seconds", "output", 'float', 30.0,
           "seconds between two commits of a run's checkpoint "
           "(OUTPUT_DIR/ALGORITHM/seedS/checkpoint, removed once the run's "
           'outputs are written): a kill loses at most this much of a run, and '
           '--resume continues it; 0 commits every evaluation',
           commands=('compare',), iterates=False, resume=('compare',),
           check=SECONDS),
    Option("grid", "training", 'grid', {},
           'NAME=V1,V2,...: the values of one hyper-parameter of the algorithm '
           '(repeatable; the runs are their product)',
           commands=('sweep', 'compare'), flag=None, later=True,
           helps={'compare': "METHOD.NAME=V1,V2,...: with --tune, the values of "
                             "METHOD's hyper-parameter NAME searched instead of its "
                             "search space's (or as a further dimension); repeatable"}),
    Option("tune", "evaluation", 'bool', False,
           "tune every method first: its search space (its paper's grid x a "
           "4-point client-rate grid, docs/algorithms.md) runs on a validation "
           "split held out of the training rows with --tune-seeds, the setting "
           "best by --select is chosen, and the comparison runs it with --seeds on "
           "the test split (OUTPUT_DIR/tune/METHOD holds each search, a sweep "
           "folder)",
           commands=('compare',), flag="--tune", later=True),
    Option("tune_seeds", "evaluation", 'list[int]', [100, 101, 102],
           'comma-separated seeds of the search, disjoint from --seeds',
           commands=('compare',), later=True),
    Option("tune_budget", "evaluation", 'int?', None,
           'at most this many grid points per method (evenly spaced in the grid, '
           'its default point kept); none: the whole search space',
           commands=('compare',), later=True, check=positive_count),
    Option("select", "evaluation", 'str', 'accuracy_mean',
           'the validation summary a setting is selected by (the highest, or the '
           'lowest for losses, gini and calibration errors; mean over seeds): '
           'accuracy_mean, accuracy_worst_10%, accuracy_gini, ...',
           commands=('compare', 'sweep'), later=True),
    Option("metric", "evaluation", 'str', 'accuracy_worst_10%',
           'the summary drawn in heatmap.png (any column of sweep.csv without '
           'its unit, e.g. accuracy_mean, accuracy_gini, test_loss, '
           'validation_accuracy_mean)',
           commands=('sweep',)),
    Option("tile_size", "execution", 'int?', None,
           'at most this many runs (grid points x seeds) per call of a compiled '
           'program, which bounds memory; each finished call is saved '
           '(OUTPUT_DIR/parts), so --resume loses at most one call. none: every '
           'grid point of a seed per call on CPU (seeds one after another), all '
           'runs at once on accelerators',
           commands=('sweep',),
           check=positive_count),
)
"""Every option, in the order of a saved config.json."""

BY_NAME = {o.name: o for o in OPTIONS}


def switch_hint(token: str) -> str:
    """For ``token``, the spelling a ``SWITCH`` option has in other commands (``run
    --no-improvement``): where it is not a flag and what is (else "")."""
    for o in OPTIONS:
        if o.flag != SWITCH:
            continue
        others: dict = {}  # (flag, default) -> the commands spelling it so
        for c in o.commands:
            here = o.for_command(c)
            others.setdefault((here.flag, here.default), []).append(c)
        if token not in {flag for flag, _ in others}:
            continue
        return "".join(f"; {token} is not a flag of {' or '.join(cs)}, where {o.name} is "
                       f"{'on' if default else 'off'} by default ({flag} turns it "
                       f"{'off' if default else 'on'})"
                       for (flag, default), cs in others.items() if flag != token)
    return ""


def of(command: str) -> list:
    """The options ``command`` takes, as it takes them."""
    return [o.for_command(command) for o in OPTIONS if command in o.commands]


RECORD_KEYS = ("fingerprint", "branches")
"""Keys of a saved config.json that record the run, not configure it."""
NOT_ITERATES = frozenset({o.name for o in OPTIONS if not o.iterates} | set(RECORD_KEYS)
                         | {"distributed"})
"""Options (and record keys) that do not change the iterates: not in the fingerprint."""
BRANCHABLE = tuple(o.name for o in OPTIONS if o.branch)
"""Options ``run --resume --branch`` may change."""
LATER_DEFAULTS = {o.name: o.default for o in OPTIONS if o.later}
"""Options added after runs were recorded, at the default such a run had."""
NOT_IN_SWEEPS = tuple(o.name for o in OPTIONS if not o.sweep)
"""Options a sweep refuses at any value but the default."""


def resumable(command: str) -> tuple:
    """Options ``command --resume`` may change (they extend the run or only show it)."""
    return tuple(o.name for o in OPTIONS if command in o.resume)


def canonical(value):
    """Values compared across a resume: tuples as lists, nested dicts recursively."""
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items()}
    return value


def config_error(error: Exception, default_field: str) -> ConfigError:
    """A ConfigError from a library error: its ``field`` when it is a ``FieldError``,
    else the ``field: ...`` prefix of its message (``error_from_message``)."""
    if isinstance(error, FieldError):
        return ConfigError(error.field, str(error)[len(error.field) + 2:])
    return error_from_message(str(error), default_field)


def error_from_message(message: str, default_field: str) -> ConfigError:
    """A ConfigError from a library error's message, keeping its ``field: ...`` prefix."""
    first = message.strip().splitlines()[0] if message.strip() else default_field
    m = re.match(r"^([A-Za-z_][\w.\[\]]*): (.*)$", first)
    if m:
        return ConfigError(m.group(1), m.group(2))
    return ConfigError(default_field, first)


def table(commands=COMMANDS) -> list:
    """``fedjax-fair list options``: every option by group, with its flag, default,
    the commands that take it and its help (a line per flag and default where they
    differ between commands: ``--improvement [run]``, ``--no-improvement [compare,
    sweep]``)."""
    lines = []
    for group, (title, builder) in GROUPS.items():
        members = [o for o in OPTIONS if o.group == group
                   and any(c in o.commands for c in commands)]
        if not members:
            continue
        lines.append(f"{group}: {title} (built by {builder})")
        for o in members:
            variants: dict = {}  # (flag, default) -> the commands that take it so
            for command in (c for c in o.commands if c in commands):
                here = o.for_command(command)
                flag = (o.flags[0] + " " + o.name.upper() if here.flag == ""
                        else here.flag or f"(config file: {o.name})")
                variants.setdefault((flag, repr(here.default)), []).append((command, here))
            for (flag, default), takes in variants.items():
                where = ("" if len(variants) == 1 and o.commands == COMMANDS
                         else f" [{', '.join(o.commands)}]" if len(variants) == 1
                         else f" [{', '.join(c for c, _ in takes)}]")
                lines.append(f"  {flag}{where} (default: {default})")
                lines.append(f"      {o.help if len(variants) == 1 else takes[0][1].help}")
    return lines
