"""What the commands share: exit codes, building the data, model and algorithm of a
configuration, running one simulation, writing a run's outputs, owning folders, and
resolving a configuration (defaults <- config file <- flags; a resumed run's saved
config.json)."""
from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import re
import sys
from typing import NamedTuple, Optional

import jax
import numpy as np

from fedjax_fair.algorithms import (REGISTRY, base_name, build, default_training, get_method,
                                    method_hparams)
from fedjax_fair.cli import config as C, lock
from fedjax_fair.cli.options import flag_names
from fedjax_fair.core import interrupts, memory
from fedjax_fair.scenarios import sampling
from fedjax_fair.core.client import FIELDS
from fedjax_fair.core.algorithm import with_improvement
from fedjax_fair.core.execution import ModelProfile, initial_params, model_profile
from fedjax_fair.cli.parsing import parse_budgets
from fedjax_fair.cli.parsing import parse_schedule
from fedjax_fair.data import get_dataset
from fedjax_fair.data.augment import standard_augmentation, with_augmentation
from fedjax_fair.drivers import runner
from fedjax_fair.drivers.runner import check_capacity
from fedjax_fair.reports.run import (RUN_FIGURES, _has_test, _num_params,  # noqa: F401
                                     _write_client_history, dataset_description,
                                     participation_report, write_run,
                                     write_run_figures)
from fedjax_fair.reports.run import write_run_page as run_page
from fedjax_fair.models import get_model, with_initializer
from fedjax_fair.models.base import example_flops


EXIT_CONFIG = 2
EXIT_NONFINITE = 3
EXIT_INTERRUPTED = interrupts.EXIT_INTERRUPTED  # 130
EXIT_WRITE = 4
DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


# Dataset flags of the issue text, stored in dataset_args (validated against the
# chosen dataset's builder like any --dataset-arg).
DATASET_SHORTCUTS = (("num_clients", "number of clients (dataset argument)"),
                     ("partition", "partition scheme, e.g. iid, dirichlet, shards (dataset argument)"),
                     ("alpha", "dataset alpha, e.g. Synthetic(alpha, .) or Dirichlet alpha "
                               "(dataset argument)"),
                     ("beta", "dataset beta, e.g. Synthetic(., beta) (dataset argument)"))


def add_dataset_flags(p: argparse.ArgumentParser) -> None:
    """``--dataset-arg``, ``--dataset-args`` and the dataset shortcuts (``--num-clients``,
    ...): how every command that builds a federation takes its builder's arguments."""
    S = argparse.SUPPRESS
    p.add_argument("--dataset-arg", "--dataset_arg", metavar="NAME=VALUE", action="append",
                   default=S, help="dataset builder argument (repeatable)")
    p.add_argument("--dataset-args", "--dataset_args", metavar="JSON", default=S,
                   help="dataset builder arguments as a JSON object")
    for name, help_text in DATASET_SHORTCUTS:
        p.add_argument(*flag_names(name), dest=f"ds_{name}", metavar="VALUE", default=S,
                       help=help_text)


def dataset_args_of(ns: dict) -> dict:
    """The dataset builder's arguments ``add_dataset_flags``' flags gave (the JSON
    object, then each ``NAME=VALUE``, then the shortcuts)."""
    dargs = {}
    if "dataset_args" in ns:
        dargs.update(C.parse_json_object(ns["dataset_args"], "dataset_args"))
    dargs.update(C.parse_assignments(ns.get("dataset_arg"), "dataset_arg"))
    for name, _ in DATASET_SHORTCUTS:
        if f"ds_{name}" in ns:
            dargs[name] = C.parse_value(ns[f"ds_{name}"])
    return dargs


class _Exit(Exception):
    def __init__(self, code: int):
        self.code = code


def config_from_args(args: argparse.Namespace, cls):
    """defaults <- --config file <- flags, as a validated-type ``cls`` instance."""
    return C.build(cls, *config_layers(args, cls))


def _narrowed(hparams, algorithms: list) -> dict:
    """A config file's comparison hyper-parameters without those of registered
    algorithms that an ``--algorithms`` flag left out (``ALGORITHM.NAME`` keys and
    ``ALGORITHM: {...}`` blocks); everything else is kept for validation."""
    if not isinstance(hparams, dict) or not algorithms:
        return hparams
    out = {}
    for key, value in hparams.items():
        owner = key if isinstance(value, dict) else str(key).partition(".")[0]
        if base_name(owner) in REGISTRY and owner not in algorithms and (isinstance(value, dict)
                                                              or "." in str(key)):
            continue
        out[key] = value
    return out


def config_layers(args: argparse.Namespace, cls) -> tuple[dict, dict, str]:
    """(config-file values, flag values, the file's name) given on the command line."""
    ns = vars(args)
    file_values = C.load_file(ns["config"]) if "config" in ns else {}
    overrides = {}
    fields = C.fields(cls)
    for name in fields:
        if name in ns:
            overrides[name] = ns[name]
    hparams = {}
    if "hparams" in ns:
        hparams.update(C.parse_json_object(ns["hparams"], "hparams"))
    hparams.update(C.parse_assignments(ns.get("hp"), "hp"))
    if hparams:
        overrides["hparams"] = hparams
    dargs = dataset_args_of(ns)
    if dargs:
        overrides["dataset_args"] = dargs
    if cls is C.CompareConfig and "algorithms" in overrides and "hparams" in file_values:
        file_values = {**file_values, "hparams": _narrowed(
            file_values["hparams"], C.coerce("list[str]", overrides["algorithms"], "algorithms"))}
    margs = C.parse_assignments(ns.get("model_arg"), "model_arg")
    if margs:
        overrides["model_args"] = margs
    source = os.path.basename(ns["config"]) if "config" in ns else "config"
    return file_values, overrides, f"config[{source}]"


def _resumable_config(args: argparse.Namespace, cls, allowed, what: str):
    """``cls`` from the command line; with ``--resume``, layered on the config.json
    saved in the output directory, changing only the ``allowed`` fields."""
    layers = config_layers(args, cls)
    cfg = C.build(cls, *layers)
    if not cfg.resume:
        if getattr(args, "branch", False):
            raise C.ConfigError("branch", "continues a saved run: give it with --resume "
                                          "(fedjax-fair run -o DIR --resume --branch ...)")
        return cfg
    out = cfg.resolved_output_dir()
    path = os.path.join(out, "config.json")
    if not os.path.isfile(path):
        raise C.ConfigError("resume", f"no saved {what} in {out!r} (config.json); give its "
                                      f"directory with -o")
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise C.ConfigError("resume", f"{path} is unreadable ({type(e).__name__}: "
                                      f"{str(e).splitlines()[0] if str(e) else ''}); it is "
                                      f"not a saved {what}") from None
    kind = "algorithms" if cls is C.CompareConfig else "algorithm"
    if not isinstance(saved, dict) or kind not in saved:
        other = "run" if cls is C.CompareConfig else "compare"
        hint = (f"; continue it with `fedjax-fair {other} -o {out} --resume`"
                if isinstance(saved, dict) and ("algorithm" in saved or "algorithms" in saved)
                else "")
        raise C.ConfigError("resume", f"{path} does not hold a saved {what}{hint}")
    branch = bool(getattr(args, "branch", False))
    rebased = _rebased(saved, out)
    cfg = C.resumed(cls, rebased, *layers,
                    allowed=tuple(allowed) + (C.BRANCHABLE if branch else ()))
    cfg.branches = list(saved.get("branches") or [])
    cfg.saved_config = (out, path, saved)  # checked against its fingerprint once valid
    if branch:
        known = C.fields(cls)
        before = C.build(cls, base={k: v for k, v in rebased.items() if k in known})
        changed = {k: [getattr(before, k), getattr(cfg, k)] for k in C.BRANCHABLE
                   if k in known and C._canonical(getattr(before, k))
                   != C._canonical(getattr(cfg, k))}
        if not changed:
            raise C.ConfigError("branch", "no setting changed; give the settings the branch "
                                          "continues with (e.g. --client-lr 0.01), or resume "
                                          "without --branch")
        cfg.branch_changes = changed
    return cfg


def _check_recorded(out: str, path: str, saved: dict) -> None:
    """A config.json whose iterate settings differ from the fingerprint the run recorded
    when it started (``lock.FINGERPRINT_NAME``, e.g. edited by hand) is refused, naming
    the fields that differ."""
    recorded = lock.read(out)
    if not recorded or not isinstance(recorded.get("config"), dict):
        return  # a run from before fingerprints: nothing to compare
    diffs = lock.differences(recorded["config"], saved)
    if diffs:
        raise C.ConfigError("resume", f"{path} differs from the configuration the run "
                                      f"recorded when it started ({lock.FINGERPRINT_NAME}): "
                                      f"{', '.join(diffs)}; restore it, or change settings "
                                      f"with --resume --branch and the flags")


def _check_checkpoint_owner(cfg, cfg_dict: dict) -> None:
    """A checkpoint directory whose recorded fingerprint is another run's is refused on
    ``--resume`` (two runs shared it), naming what differs."""
    ckdir = cfg.resolved_checkpoint_dir()
    theirs = lock.read(ckdir) if ckdir else None
    ours = lock.read(cfg.resolved_output_dir())
    if not theirs or not ours or theirs.get("fingerprint") == ours.get("fingerprint"):
        return
    diffs = lock.differences(ours.get("config") or {}, theirs.get("config") or {})
    raise C.ConfigError("checkpoint_dir", f"{ckdir!r} holds the checkpoint of another run "
                                          f"(fingerprint {theirs.get('fingerprint')}, this "
                                          f"run's {ours.get('fingerprint')}"
                                          + (f": {', '.join(diffs)}" if diffs else "")
                                          + "); give this run's own checkpoint directory")


def _record_inputs(cfg, cfg_dict: dict) -> None:
    """Records the contents of the files the run reads (``lock.input_hashes``: a trace,
    a LEAF folder) in ``cfg_dict`` (``lock.INPUTS_KEY``, part of the fingerprint; no key
    when there are none). On ``--resume``, an input whose contents differ from what the
    saved run recorded is refused, naming its option, before anything is built or
    written: the resumed run would mix two inputs. A run saved before the contents were
    recorded is resumed unchecked, with its fingerprint as it was."""
    now = lock.input_hashes(cfg_dict)
    saved = getattr(cfg, "saved_config", None)
    if saved is None:
        if now:
            cfg_dict[lock.INPUTS_KEY] = now
        return
    recorded = saved[2].get(lock.INPUTS_KEY)
    if not isinstance(recorded, dict):
        return
    for field, digest in sorted(recorded.items()):
        if field in now and now[field] != digest:
            where = lock.input_files(cfg_dict)[field][0]
            raise C.ConfigError(field, f"the contents of {where!r} changed since the run in "
                                       f"{saved[0]!r} recorded them ({digest[:19]}..., now "
                                       f"{now[field][:19]}...); resuming would mix two "
                                       f"inputs: restore them, or start a new run")
    cfg_dict[lock.INPUTS_KEY] = dict(recorded)


def _rebased(saved: dict, out: str) -> dict:
    """A saved config whose run directory was copied or moved to ``out``: its output
    directory is ``out``, and a checkpoint directory that lay inside the old output
    directory lies at the same place inside ``out``."""
    saved = dict(saved)
    old = saved.get("output_dir")
    ck = saved.get("checkpoint_dir")
    if isinstance(old, str) and isinstance(ck, str):
        rel = os.path.relpath(ck, old)
        if not rel.startswith(os.pardir):
            saved["checkpoint_dir"] = os.path.join(out, rel)
    saved["output_dir"] = out
    return saved


def build_dataset(cfg):
    try:
        ds = get_dataset(cfg.dataset, **cfg.dataset_args)
    except (ValueError, TypeError) as e:
        err = C.config_error(e, "dataset_args")
        if err.field in cfg.dataset_args or err.field in C.dataset_params(
                C.dataset_registry()[cfg.dataset]):
            err = C.ConfigError(f"dataset_args.{err.field}", str(e).split(": ", 1)[-1])
        raise err from None
    if cfg.resplit != "none":
        from fedjax_fair.data import resplit
        try:
            ds = resplit(ds, C.parse_fractions(cfg.resplit), cfg.resplit_seed)
        except ValueError as e:  # e.g. fractions that leave no client a test example
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise C.ConfigError("resplit", first.split(": ", 1)[-1]) from None
    if getattr(cfg, "validation_fraction", 0.0):  # a validation split of the train rows
        from fedjax_fair.data import hold_out_validation
        try:
            ds = hold_out_validation(ds, cfg.validation_fraction, cfg.resplit_seed)
        except ValueError as e:
            raise C.ConfigError("validation_fraction", str(e).split(": ", 1)[-1]) from None
    ds = _hold_out(ds, getattr(cfg, "unseen_clients", 0.0))
    pad = ds.info.get("padding", {})
    for split in ("train", "validation", "test"):
        p = pad.get(split)
        if p is not None and (p.get("generated") or p.get("on_disk")):
            held = (f"{p['num_clients']:,} clients, each client's rows computed from (seed, "
                    f"client id) inside the round" if p.get("generated") else
                    f"{p['num_clients']:,} clients x {p['padded_size']} rows")
            where = ("held" if p.get("generated") else
                     f"memory-mapped from {ds.info.get('prepared', 'disk')}")
            print(f"data: {ds.name} {split}: {held} ({p['min_examples']}-{p['max_examples']} "
                  f"rows, median {p['median_examples']:g}); {p['bytes'] / 2**20:,.1f} MiB "
                  f"{where}")
        elif split in pad:
            p = pad[split]
            print(f"data: {ds.name} {split}: {p['num_clients']} clients x {p['padded_size']} rows "
                  f"({p['min_examples']}-{p['max_examples']} real, median {p['median_examples']:g}), "
                  f"{100 * p['padding_fraction']:.0f}% padding, {p['bytes'] / 2**20:.1f} MiB"
                  + (f"; in size buckets {100 * p['buckets']['bucketed_padding_fraction']:.0f}% "
                     "padding" if "buckets" in p else ""))
    return ds


def unseen_seed(ds) -> int:
    """The seed that draws the clients ``--unseen-clients`` holds out: the dataset's own
    seed (``info["seed"]``: the partition / generation seed its arguments gave), 0 for
    a dataset without one. Fixed by the data alone, so every method and seed of a
    ``compare`` holds out the same clients."""
    seed = ds.info.get("seed", 0)
    return int(seed) if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) \
        and 0 <= seed < 2 ** 32 else 0


def _hold_out(ds, fraction: float):
    """``ds`` without the clients ``--unseen-clients`` holds out (``unseen.hold_out``:
    the seen dataset, carrying them as ``.unseen``), or ``ds`` for a fraction of 0. Too
    small a federation is a ``ConfigError`` naming ``unseen_clients``."""
    if not fraction:
        return ds
    from fedjax_fair.drivers import unseen
    try:
        seen = unseen.hold_out(ds, fraction, unseen_seed(ds))
    except ValueError as e:  # a federation of one client; no training / test row left
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise C.ConfigError("unseen_clients", f"{fraction:g} of the {ds.num_clients} clients "
                                              f"of {ds.name!r}: {first.split(': ', 1)[-1]}"
                            ) from None
    held = seen.unseen
    ids = [str(i) for i in held.client_ids]
    print(f"data: {len(ids)} of {ds.num_clients} clients held out, never trained on "
          f"(--unseen-clients {fraction:g}, seed {held.seed}): "
          f"{', '.join(ids[:12])}{', ...' if len(ids) > 12 else ''}")
    return seen


def build_model(cfg, ds):
    inputs = ", ".join(f"{k} {v.dtype}{tuple(v.shape[2:])}"
                       for k, v in ds.host_data.train.examples.items())
    # The loss on one real example of the data (shapes and dtypes only): a model or
    # an augmentation that cannot read these inputs fails here, not in XLA.
    one = {k: jax.ShapeDtypeStruct((1, *v.shape[2:]), v.dtype)
           for k, v in ds.host_data.train.examples.items()}
    try:
        model = with_initializer(get_model(cfg.model, ds.input_shape, ds.num_classes,
                                           **cfg.model_args), cfg.initializer)
        params = jax.eval_shape(model.init, jax.random.key(0))  # shape check, no compute
        jax.eval_shape(lambda p, b: model.per_example_loss(p, b, jax.random.key(0)),
                       params, one)
    except Exception as e:  # flax raises several types for a wrong input shape
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if isinstance(e, ValueError) and re.match(r"^\w+: ", first):  # a model argument
            err = C.error_from_message(first, "model_args")
            if err.field in cfg.model_args:
                err = C.ConfigError(f"model_args.{err.field}", first.split(": ", 1)[1])
            raise err from None
        raise C.ConfigError("model", f"{cfg.model!r} cannot take the {ds.name!r} inputs "
                                     f"({inputs}): {first}") from None
    augmented = with_augmentation(model, standard_augmentation(cfg.augment))
    try:
        jax.eval_shape(lambda p, b: augmented.per_example_loss(p, b, jax.random.key(0)),
                       params, one)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise C.ConfigError("augment", f"{cfg.augment!r} cannot augment the {ds.name!r} "
                                       f"inputs ({inputs}): {first}") from None
    return augmented


TRAINING_FLAGS = ("client_lr", "batch_size", "num_epochs")  # config fields of ClientTraining


def for_method(cfg, name: str):
    """``cfg`` with the local-training fields it leaves unset (None: --client-lr,
    --batch-size, --num-epochs not given) set to method ``name``'s own, its factory's
    default ``training`` (A-FedPD's batch 50, SuPerFed's rate 0.01, ...): the flags
    a user gives replace those fields for every method, the others never override a
    factory's defaults."""
    own = default_training(name)
    unset = {flat: getattr(own, FIELDS[flat]) for flat in TRAINING_FLAGS
             if getattr(cfg, flat, 0) is None}
    if not unset:
        return cfg
    new = dataclasses.replace(cfg, **unset)
    vars(new).update({k: v for k, v in vars(cfg).items() if k not in vars(new)})  # records
    return new


def build_algorithm(name: str, model, cfg, hparams: dict, ds=None):
    """The registered factory called with the config fields its signature names
    (client_lr, batch_size, num_epochs), the client SGD of --client-momentum /
    --client-weight-decay (as ``client_optimizer``), the hyper-parameters, and the
    round-indexed schedules; wrapped to log the per-round improved fraction unless
    ``cfg.improvement`` is off. An asynchronous method (one taking a ``clock``:
    FedBuff, FedAsync) gets the clock of ``--speeds`` on dataset ``ds``, and refuses
    ``--deadline`` (it has no rounds to cut)."""
    accepted = method_hparams(name)
    kwargs = {k: getattr(cfg, k) for k, h in accepted.items()  # client_lr, batch_size, ...
              if not h.python_only and k in C.config_fields() and hasattr(cfg, k)
              and getattr(cfg, k) is not None}  # unset: the method's own
    kwargs.update(C.mixing_kwargs(name, cfg.mixing) or {})  # an explicit --hp wins
    if C.client_sgd_field(cfg) and "client_optimizer" in accepted:  # --client-momentum
        from fedjax_fair.core.client import sgd_optimizer
        kwargs["client_optimizer"] = sgd_optimizer(cfg.client_momentum, cfg.client_weight_decay)
    kwargs.update(hparams)
    if get_method(name).clocked:  # asynchronous on the system's clock (FedBuff, FedAsync)
        if C.system_spec(cfg).deadline is not None:
            raise C.ConfigError("deadline", f"{name} is asynchronous: clients are never cut "
                                            f"off by a round deadline; drop --deadline")
        concurrency = kwargs.get("concurrency", accepted["concurrency"].default)
        if isinstance(concurrency, int):  # C <= N (one task per client), C >= K (the buffer)
            from fedjax_fair.algorithms.fedbuff import check_concurrency
            try:
                check_concurrency(concurrency, ds.num_clients if ds is not None else
                                  concurrency, cfg.cohort_size)
            except ValueError as e:
                raise C.ConfigError("hparams.concurrency", str(e).split(": ", 1)[-1]) from None
        system = system_of(for_method(cfg, name), ds) if ds is not None else None
        if system is not None and system.clock is not None:
            kwargs["clock"] = system.clock
    client_schedule = parse_schedule(cfg.client_lr_schedule, "client_lr_schedule")
    if client_schedule is not None and "client_lr" in accepted:
        kwargs["client_lr"] = client_schedule(kwargs.get("client_lr",
                                                         accepted["client_lr"].default))
    server_schedule = parse_schedule(cfg.server_lr_schedule, "server_lr_schedule")
    rate = C.server_rate_name(name)
    if server_schedule is not None:
        kwargs[rate] = server_schedule(kwargs.get(rate, accepted[rate].default))
    if cfg.compensate_server_lr:
        from fedjax_fair.scenarios.schedules import compensated
        kwargs[rate] = compensated(kwargs.get(rate, accepted[rate].default),
                                   client_schedule(1.0))
    try:
        algorithm = build(name, model, **kwargs)
    except (TypeError, ValueError) as e:
        raise C.config_error(e, "hparams") from None
    algorithm = with_scenarios(algorithm, cfg, ds)
    return with_improvement(algorithm, model) if cfg.improvement else algorithm


class _Guards(NamedTuple):
    accountant: object  # privacy.Accountant, or None without DP
    malicious: Optional[np.ndarray]  # bool [N], or None without an attack


def _guarded(cfg_dict: dict, num_clients: int) -> _Guards:
    """What a run's outputs need of its privacy and attack options (cli/transforms.py),
    from its recorded configuration."""
    import types
    from fedjax_fair.cli import transforms
    cfg = types.SimpleNamespace(**{**dict.fromkeys(("attack", "dp_noise", "dp_epsilon")),
                                   **cfg_dict})
    return _Guards(transforms.accountant_of(cfg, num_clients),
                   transforms.malicious_flags(cfg, num_clients))


def with_scenarios(algorithm, cfg, ds):
    """``algorithm`` under the scenarios of ``--attack``, ``--robust`` and ``--dp-*``
    (cli/transforms.py) on dataset ``ds``, in that order; as it is without them."""
    from fedjax_fair.cli import transforms
    if not any(getattr(cfg, f, None) is not None for f in ("attack", "robust", "dp_noise",
                                                            "dp_epsilon")):
        return algorithm
    if ds is None:
        raise C.ConfigError("attack", "the privacy and robustness options need the dataset")
    return transforms.apply(algorithm, cfg, ds.num_clients, ds.num_classes)


def _seeded(name: str, alg, model, cfg, hparams: dict, seed: int, ds=None):
    """``alg`` of a ``compare`` for one seed: a factory with a ``seed`` argument (the
    method's own initial state: FedEvg's synthetic set, FedCVAE's generator; ``run``
    sets it from ``--seed``) gets the run's seed in its ``init``. The round programs
    stay shared across seeds (the runner keys them without ``init``)."""
    if not get_method(name).seeded:
        return alg
    return alg._replace(init=build_algorithm(name, model, cfg, {**hparams, "seed": seed},
                                             ds).init)


def execution_of(cfg, ds, model):
    """``config.execution_of`` for this federation and model: ``--devices auto`` splits
    the cohort over the CPU's cores unless a client's local step (3 x batch x the
    forward FLOPs of one example) is large enough to keep one device's cores busy
    (``execution.SPLIT_MAX_STEP_FLOPS``), or a round's local training (cohort x the
    federation's mean local steps x a step) too small to pay for the mesh
    (``execution.SPLIT_MIN_ROUND_FLOPS``)."""
    step_flops = round_flops = profile = None
    one = runner.one_example(ds.host_data)
    if cfg.devices == "auto":
        flops = example_flops(model, one)
        step_flops = 3 * cfg.batch_size * flops
        sizes = np.asarray(ds.host_data.train.num_examples)
        steps = cfg.num_epochs * float(np.mean(np.ceil(sizes / cfg.batch_size)))
        round_flops = cfg.cohort_size * steps * step_flops
        profile = ModelProfile(bool(model.uses_xla_conv), flops)
    if cfg.execution == "auto" and profile is None:  # auto's choice reads the model
        profile = model_profile(model, one)
    return C.execution_of(cfg, ds.host_data.num_clients, step_flops, round_flops, profile)


def simulate_one(alg, model, ds, cfg, seed: int, *, checkpoint_dir=None, resume=False,
                 progress=True, description="", on_eval=None, on_rounds=None, log=print,
                 commit_seconds=0.0, on_clients=None):
    """``runner.run`` with the CLI's seeding: init and run keys are ``key(seed)``."""
    params = initial_params(model, jax.random.key(seed))  # one compile, not one per op
    try:
        return runner.run(alg, params, ds.host_data, jax.random.key(seed), model=model,
                            num_rounds=cfg.num_rounds, cohort_size=cfg.cohort_size,
                            eval_every=cfg.eval_every, sampler=sampling.get(cfg.sampler, ds.host_data.train.num_examples),
                            step_budgets=parse_budgets(cfg.step_budgets, cfg.batch_size),
                            checkpoint_dir=checkpoint_dir, resume=resume, progress=progress,
                            on_eval=on_eval, description=description,
                            placement=cfg.placement, log=log,
                            execution=execution_of(cfg, ds, model),
                            on_rounds=on_rounds, commit_seconds=commit_seconds,
                            on_clients=on_clients, summary_clients=benign_clients(cfg, ds),
                            eval_clients=cfg.eval_clients,
                            system=system_of(cfg, ds))  # checked by the preflight
    except ValueError as e:
        if str(e).startswith(("checkpoint:", "placement:", "client_table:")):  # another config's checkpoint,
            raise C.config_error(e, "checkpoint") from None  # or no memory plan fits
        raise


def benign_clients(cfg, ds) -> Optional[np.ndarray]:
    """bool [N]: the clients not under ``--attack`` (every evaluation's fairness summary
    covers them only), or None without an attack."""
    from fedjax_fair.cli import transforms
    flags = transforms.malicious_flags(cfg, ds.num_clients)
    return None if flags is None else ~flags


def system_of(cfg, ds, model=None):
    """The run's ``system.System`` (``--availability``, ``--dropout``, ``--speeds``, ...)
    for dataset ``ds``, its clock timing the local training of ``cfg`` (a method's own,
    ``for_method``); None when the options change nothing. With ``model``, also checked
    against the federation and the model's size (``System.check``: a deadline no client
    can meet, a trace of another federation), as ``ConfigError`` naming the option."""
    from fedjax_fair.core.client import ClientTraining
    from fedjax_fair.drivers.runner import check_system
    spec = C.system_spec(cfg)
    training = ClientTraining(batch_size=cfg.batch_size or 10, num_epochs=cfg.num_epochs or 1)
    options = {"clock.deadline": "deadline", "clock.speed": "speeds",
               "clock.bandwidth": "bandwidth", "clock.latency": "latency"}
    try:
        system = spec.build(ds.host_data.train, training)
        if system is not None and model is not None:
            check_system(system, ds.host_data, model,
                         sampling.get(cfg.sampler, ds.host_data.train.num_examples))
        return system
    except ValueError as e:
        error = C.config_error(e, "availability")
        field = options.get(error.field, error.field)
        raise C.ConfigError(field, str(error)[len(error.field) + 2:]) from None


def write_run_outputs(out: str, cfg_dict: dict, ds, model, result, *, plots: bool = True,
                      extra: Optional[dict] = None, page: bool = True) -> dict:
    """``reports.run.write_run`` of a run of the command line: its evaluations annotated
    with the privacy spent (``--dp-*``), the benign clients' summary under ``--attack``,
    and the command that ran."""
    guarded = _guarded(cfg_dict, ds.num_clients)
    from fedjax_fair.cli import transforms
    transforms.annotate(result.history, guarded.accountant)  # dp_epsilon at every evaluation
    return write_run(out, cfg_dict, ds, model, result, plots=plots, extra=extra, page=page,
                     malicious=guarded.malicious, command=command_line())


def write_run_page(out: str, summary: dict, command: Optional[str] = None) -> None:
    """``reports.run.write_run_page`` with this command line when summary.json has none."""
    run_page(out, summary, command or summary.get("command") or command_line())


def _err(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


def _ordered_config(cfg) -> dict:
    d = C.to_dict(cfg)
    first = [k for k in ("algorithm", "algorithms", "hparams", "seed", "seeds") if k in d]
    return {**{k: d[k] for k in first}, **{k: v for k, v in d.items() if k not in first}}


def _other_process(cfg):
    """In a multi-host job every process runs the same simulation and process 0 writes
    the results: another process writes its copies into a temporary directory
    (removed at exit) but keeps the shared checkpoint directory, which it reads on
    ``--resume`` and never writes (``runner.run``). ``cfg`` as is in process 0 and in
    a single-process run."""
    if "jax" not in sys.modules:
        return cfg
    if not jax.distributed.is_initialized() or jax.process_index() == 0:
        return cfg
    import atexit
    import shutil
    import tempfile
    if isinstance(cfg, C.CompareConfig) and cfg.resume:
        raise C.ConfigError("resume", "a multi-host compare cannot resume (each process "
                                      "would have to read process 0's finished runs); "
                                      "start it again or resume on one host")
    scratch = tempfile.mkdtemp(prefix=f"fedjax-fair-process{jax.process_index()}-")
    atexit.register(shutil.rmtree, scratch, True)
    changes = {"output_dir": scratch, "overwrite": True, "plots": False}
    if isinstance(cfg, C.RunConfig):
        changes["checkpoint_dir"] = cfg.resolved_checkpoint_dir()
    extra = {k: v for k, v in vars(cfg).items() if k not in C.fields(type(cfg))}
    new = dataclasses.replace(cfg, **changes)
    vars(new).update(extra)  # the resume's record (saved config, branches)
    return new


def _preflight(cfg, ds, model):
    """Shapes XLA cannot hold (``memory.preflight``: a parameter array or a batch too
    large for one array or for the device) and a system that does not fit the data
    (``system_of``) are refused naming the field, from ``jax.eval_shape`` alone: before
    anything is compiled or written. Returns the run's system (None: none)."""
    params = jax.eval_shape(model.init, jax.random.key(0))
    one = {k: jax.ShapeDtypeStruct(v.shape[2:], v.dtype)
           for k, v in ds.host_data.train.examples.items()}
    system = system_of(cfg, ds, model)  # the participation and clock options
    refused = memory.preflight(params, one, cfg.batch_size)
    if refused is None:
        return system
    if refused.what == "batch":
        raise C.ConfigError("batch_size", f"{cfg.batch_size} is too large: {refused.message}")
    args = list(cfg.model_args)
    field = f"model_args.{args[0]}" if len(args) == 1 else "model_args" if args else "model"
    raise C.ConfigError(field, f"the {cfg.model!r} model is too large: {refused.message}")


def _own(cfg, primary: bool, check_fresh: bool):
    """Locks the output directory and (when it lies elsewhere) the checkpoint directory
    for this process's life (``lock.Held``); refuses a directory another process holds,
    and a new run's directory that filled meanwhile."""
    held = lock.Held(_COMMAND or None)
    out = cfg.resolved_output_dir()
    try:
        held.acquire(out, "output_dir")
        ckdir = cfg.resolved_checkpoint_dir() if isinstance(cfg, C.RunConfig) else None
        if primary and ckdir and not os.path.abspath(ckdir).startswith(
                os.path.abspath(out) + os.sep):
            held.acquire(ckdir, "checkpoint_dir")
        if check_fresh and not cfg.resume and not cfg.overwrite and lock.holds_results(out):
            raise C.ConfigError("output_dir", f"{out!r} already holds results (written by a "
                                              f"run that ended meanwhile); continue that run "
                                              f"with --resume, or replace it with --overwrite")
    except BaseException:
        held.release(undo=True)
        raise
    _HELD.append(held)  # released when the process ends
    return held


_HELD: list = []


_COMMAND: list = []  # the arguments of main(), written into the lock files


def command_line() -> Optional[str]:
    """The command being run, as a shell would take it (``fedjax-fair compare ...``);
    None outside ``main``."""
    import shlex
    return shlex.join(["fedjax-fair", *_COMMAND]) if _COMMAND else None


def _is_primary() -> bool:
    if "jax" not in sys.modules:
        return True
    return not jax.distributed.is_initialized() or jax.process_index() == 0


def _method_report(name: str, model, alg, result, ds) -> dict:
    """The end-of-run numbers computed from the algorithm and its final state, for
    ``write_run_outputs``' ``extra``: {"method_report": the method's own}
    (``Method.report`` on the test split, e.g. SuPerFed's lambda grid) for a method
    with one, and {"unseen": ``UnseenReport``} when ``ds`` holds clients never
    trained on (``--unseen-clients``)."""
    out = {}
    method = REGISTRY.get(base_name(name))
    if method is not None and method.report is not None:
        out["method_report"] = method.report(model, alg, result.state, ds.host_data.test)
    held = getattr(ds, "unseen", None)
    if held is not None:  # as many clients at a time as a training round held
        ids = (getattr(result, "rounds", None) or {}).get("client_ids")
        out["unseen"] = unseen_report(model, alg, result.state, held,
                                      None if ids is None else int(np.shape(ids)[-1]))
    return out


class UnseenReport(NamedTuple):
    """The evaluation of the clients never trained on: summary.json's ``"unseen"``
    block and their per-client metrics (written to clients_unseen.csv)."""

    block: dict
    client_metrics: dict
    evaluated: str
    names: Optional[list]


def unseen_report(model, alg, state, held, chunk_size: Optional[int] = None) -> UnseenReport:
    """``unseen.evaluate_unseen`` of the held-out clients ``held`` for the final
    ``state``, ``chunk_size`` clients at a time (the adaptation's key: ``key(held.seed)``,
    the data's seed); the block
    {"num_clients", "client_ids" (rows of the full federation), "fraction", "seed",
    "evaluated", "adaptation", "final" (``unseen_summary``: the keys of the seen
    clients' "final")}."""
    from fedjax_fair.drivers import unseen
    per_client = unseen.evaluate_unseen(model, alg, state, held.data,
                                        jax.random.key(held.seed), chunk_size=chunk_size)
    block = {"num_clients": int(len(held.client_ids)),
             "client_ids": [int(i) for i in held.client_ids],
             "fraction": float(held.fraction), "seed": int(held.seed),
             "evaluated": alg.evaluates, "adaptation": unseen.adaptation(alg),
             "final": unseen.unseen_summary(per_client, int(state.round))}
    names = held.names if held.names is not None else [str(i) for i in held.client_ids]
    return UnseenReport(block, per_client, alg.evaluates, names)


def _check_capacity(alg, num_clients: int, cfg) -> None:
    """A lazy client table too small for the run is a config error before anything
    is written (``runner.check_capacity``)."""
    try:
        check_capacity(alg, num_clients, cfg.cohort_size, cfg.num_rounds)
    except ValueError as e:
        raise C.config_error(e, "client_table") from None


def check_interrupted() -> None:
    """A safe point of a command: a SIGINT / SIGTERM recorded since it started
    (``core.interrupts``) stops it here with ``KeyboardInterrupt``, as the handler's own
    exception would have, had a garbage-collector or weakref callback not swallowed it.
    The commands call it after each long step before their rounds (the data, the
    programs), before their first write, before the rounds start and before the outputs
    are written."""
    if interrupts.requested():
        raise KeyboardInterrupt


# What an interrupt outside the runner's stop_on_signals leaves (set by the commands as
# they go), and the output directory being written.
_STAGE: list = []


_STAGE_DIR: list = []
