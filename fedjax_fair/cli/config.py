"""Typed configuration of the command line (``fedjax-fair run | compare | sweep``).

A configuration is a flat dataclass: ``RunConfig`` for one simulation,
``CompareConfig`` for several algorithms x seeds on the same data and budget and
``SweepConfig`` for a grid of one algorithm's hyper-parameters x seeds. It
is built in three layers, later layers overriding earlier ones:

1. the dataclass defaults (the README's main job: Synthetic(1, 1), 30 clients,
   logistic regression, cohort 10);
2. a JSON or YAML file (``--config file.yaml``) holding any subset of the fields,
   with the same names as the dataclass fields (unknown keys are errors);
3. command-line flags.

Every value goes through ``coerce`` (so "0.1" from a flag and 0.1 from YAML end up
the same float) and then ``validate_*``, which checks everything that can be
checked before any data is built or any program compiled: registry names,
hyper-parameter names against the algorithm factory's signature, dataset
arguments against the dataset builder's signature, positivity of counts and
rates, existence of files. Failures raise ``ConfigError``, whose message starts
with the offending field and lists the allowed values; the CLI prints it as one
line ``error: <field>: ...`` and exits with status 2.

Seeds: ``seed`` drives the model initialisation, cohort sampling and local
training (``jax.random.key(seed)``). The data set has its own ``seed`` argument
(``dataset_args``), so ``compare --seeds 0,1,2`` varies the runs on fixed data.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import re
from typing import Any, Callable, Optional

import jax
import numpy as np

from fedjax_fair.algorithms import ALGORITHMS, base_name, get_method, method_hparams
from fedjax_fair.cli import lock, options as O
from fedjax_fair.cli.options import (ConfigError, canonical as _canonical, config_error,
                                     error_from_message)  # noqa: F401 (C.error_from_message)
from fedjax_fair.scenarios import sampling
from fedjax_fair.core.execution import Execution, resolve
from fedjax_fair.cli.parsing import parse_budgets
from fedjax_fair.cli.parsing import parse_schedule
from fedjax_fair.core.sharding import make_mesh, provide_cpu_devices
from fedjax_fair.data.federated import _check_fractions
from fedjax_fair.drivers import checkpoint as ckpt
from fedjax_fair.models import MODELS

REQUIRED = "<required>"


def _field(option):
    """A dataclass field of ``option`` (as a command takes it): its default, value kind
    and help in the field's metadata."""
    meta = {"kind": option.kind, "help": option.help, "flag": option.flag == "",
            "group": option.group}
    if isinstance(option.default, (dict, list)):
        return dataclasses.field(default_factory=lambda d=option.default: type(d)(d),
                                 metadata=meta)
    return dataclasses.field(default=option.default, metadata=meta)


def _config_class(command: str, name: str, doc: str, output_dir: Callable):
    """The flat dataclass of ``command``'s options (``options.of``), with
    ``resolved_output_dir`` from ``output_dir(cfg)``."""
    cls = dataclasses.make_dataclass(
        name, [(o.name, Any, _field(o)) for o in O.of(command)],
        namespace={"__doc__": doc, "command": command,
                   "resolved_output_dir": lambda self: self.output_dir or output_dir(self)})
    cls.__module__ = __name__
    return cls


def _checkpoint_dir(self) -> Optional[str]:
    if not self.checkpoint:
        return None
    return self.checkpoint_dir or os.path.join(self.resolved_output_dir(), "checkpoint")


RunConfig = _config_class(
    "run", "RunConfig", "One simulation: ``fedjax-fair run``.",
    lambda c: os.path.join("runs", f"{c.algorithm}_{c.dataset}_seed{c.seed}"))
RunConfig.resolved_checkpoint_dir = _checkpoint_dir
CompareConfig = _config_class(
    "compare", "CompareConfig", """Several algorithms x seeds on the same data and budget:
    ``fedjax-fair compare``.

    ``algorithms`` empty means every entry of ``ALGORITHMS``. ``hparams`` keys are
    either ``name`` (given to every selected algorithm that accepts it) or
    ``algorithm.name`` (one algorithm only), e.g. ``{"fedprox.mu": 0.1}``; in a
    config file also nested, ``hparams: {fedprox: {mu: 0.1}}``.""",
    lambda c: os.path.join("runs", f"compare_{c.dataset}"))
SweepConfig = _config_class(
    "sweep", "SweepConfig", """A grid of one algorithm's hyper-parameters x seeds:
    ``fedjax-fair sweep``.

    ``grid`` maps a hyper-parameter of the algorithm (``method_hparams``: its
    factory's arguments and the flat local-training names client_lr, batch_size,
    num_epochs, ...) to its values; the runs are the product of the values, in the
    order given, times ``seeds``. Continuous hyper-parameters are vmapped inside one
    compiled program; the others (counts, choices) are static and split the grid
    into one program per combination of their values (``fedjax_fair.cli.sweep``).""",
    lambda c: os.path.join("runs", f"sweep_{c.algorithm}_{c.dataset}"))
CONFIGS = {"run": RunConfig, "compare": CompareConfig, "sweep": SweepConfig}


def fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


# ----------------------------------------------------------------------------- values


def parse_value(text: str) -> Any:
    """A command-line value: int, float, bool, null, a JSON list/object, else the string.

    ``"0.01" -> 0.01``, ``"1e-3" -> 0.001``, ``"10" -> 10``, ``"true" -> True``,
    ``"none" -> None``, ``"[1, 2]" -> [1, 2]``, ``"dirichlet" -> "dirichlet"``.
    """
    s = text.strip()
    try:
        return int(s)
    except ValueError:
        pass
    try:
        return float(s)
    except ValueError:
        pass
    low = s.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    if s[:1] in "[{":
        try:
            return json.loads(s)
        except json.JSONDecodeError:
            pass
    return s


def parse_assignments(items, field: str) -> dict:
    """``["mu=0.01", "alpha=0.5"] -> {"mu": 0.01, "alpha": 0.5}``."""
    out = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ConfigError(field, f"expected NAME=VALUE, got {item!r}")
        out[name] = parse_value(value)
    return out


def parse_json_object(text: str, field: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(field, f"not valid JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise ConfigError(field, f"expected a JSON object like '{{\"mu\": 0.01}}', got {text!r}")
    return value


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


INT_LIMIT = 2 ** 63  # what a C integer (numpy's int64) holds


def _as_int(v, field):
    out = None
    if _is_int(v):
        out = v
    elif isinstance(v, float) and v.is_integer():
        out = int(v)
    elif isinstance(v, str):
        try:
            out = int(v.strip())
        except ValueError:
            pass
    if out is None:
        raise ConfigError(field, f"expected an integer, got {v!r}")
    if not -INT_LIMIT <= out < INT_LIMIT:
        raise ConfigError(field, f"{v!r} is too large for an integer (at most 2^63 - 1)")
    return out


def _as_float(v, field):
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            pass
    raise ConfigError(field, f"expected a number, got {v!r}")


def _as_bool(v, field):
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "false", "yes", "no", "1", "0"):
        return v.strip().lower() in ("true", "yes", "1")
    raise ConfigError(field, f"expected true or false, got {v!r}")


def _as_str(v, field):
    if isinstance(v, str):
        return v
    raise ConfigError(field, f"expected a string, got {v!r}")


def _as_list(v, field, item):
    if isinstance(v, str):
        v = [s for s in (p.strip() for p in v.split(",")) if s]
    elif isinstance(v, (int, float)) and not isinstance(v, bool):
        v = [v]
    if not isinstance(v, (list, tuple)):
        raise ConfigError(field, f"expected a comma-separated list, got {v!r}")
    return [item(x, field) for x in v]


def _as_devices(v, field):
    if isinstance(v, str) and v.strip().lower() in ("all", "auto"):
        return v.strip().lower()
    try:
        return _as_int(v, field)
    except ConfigError:
        raise ConfigError(field, f"expected an integer, 'all' or 'auto', got {v!r}") from None


SEED_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")
MAX_SEEDS = 10_000  # seeds a range may expand to


def _as_seeds(v, field):
    """Seeds as integers: a comma-separated list whose items may be ranges ``A-B``
    (both ends included: ``0-4`` is 0, 1, 2, 3, 4), or a list of integers / ranges."""
    if isinstance(v, str):
        v = [p for p in (p.strip() for p in v.split(",")) if p]
    elif isinstance(v, (int, float)) and not isinstance(v, bool):
        v = [v]
    if not isinstance(v, (list, tuple)):
        raise ConfigError(field, f"expected comma-separated seeds or ranges A-B, got {v!r}")
    out = []
    for item in v:
        m = SEED_RANGE.match(item) if isinstance(item, str) else None
        if m is None:
            out.append(_as_int(item, field))
            continue
        low, high = int(m.group(1)), int(m.group(2))
        if low > high:
            raise ConfigError(field, f"the range {item!r} is empty (write LOW-HIGH, LOW <= HIGH)")
        if high - low >= MAX_SEEDS:
            raise ConfigError(field, f"the range {item!r} has {high - low + 1} seeds; at most "
                                     f"{MAX_SEEDS}")
        out.extend(range(low, high + 1))
    return out


def _as_grid(v, field):
    """A sweep's grid ``{name: [values]}``: from the command line a list of
    ``NAME=V1,V2,...`` (each value read by ``parse_value``), from a file a mapping of a
    name to a list of values (or to one ``V1,V2`` string). Values are scalars."""
    if isinstance(v, (list, tuple)):
        out = {}
        for item in v:
            name, sep, values = str(item).partition("=")
            name = name.strip()
            if not sep or not name:
                raise ConfigError(field, f"expected NAME=V1,V2,..., got {item!r}")
            if name in out:
                raise ConfigError(field, f"{name!r} is given twice; give all its values in "
                                         f"one --grid {name}=V1,V2,...")
            out[name] = [parse_value(p) for p in values.split(",")]
        v = out
    if not isinstance(v, dict):
        raise ConfigError(field, f"expected a mapping NAME: [V1, V2, ...], got {v!r}")
    out = {}
    for name, values in v.items():
        if isinstance(values, str):
            values = [parse_value(p) for p in values.split(",")]
        elif not isinstance(values, (list, tuple)):
            values = [values]
        if not values or any(isinstance(x, str) and not x.strip() for x in values):
            raise ConfigError(field, f"{name}: give its values as {name}=V1,V2,..., got an "
                                     f"empty value")
        for x in values:
            if isinstance(x, (list, dict)):
                raise ConfigError(field, f"{name}: values are numbers or names, got {x!r}")
        out[str(name)] = list(values)
    return out


def coerce(kind: str, value, field: str):
    """Converts ``value`` to the field kind ("int", "float", "str", "bool", "dict",
    "list[str]", "list[int]", "devices" (an integer, 'all' or 'auto'), "seeds" (a
    list of integers, ranges ``A-B`` allowed), "grid" (``{name: [values]}``); a
    trailing "?" allows None)."""
    if kind.endswith("?"):
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
            return None
        kind = kind[:-1]
    if kind == "int":
        return _as_int(value, field)
    if kind == "float":
        return _as_float(value, field)
    if kind == "bool":
        return _as_bool(value, field)
    if kind == "str":
        return _as_str(value, field)
    if kind == "dict":
        if isinstance(value, str):
            value = parse_json_object(value, field)
        if not isinstance(value, dict):
            raise ConfigError(field, f"expected a mapping NAME: VALUE, got {value!r}")
        return {str(k): v for k, v in value.items()}
    if kind == "list[str]":
        return _as_list(value, field, _as_str)
    if kind == "list[int]":
        return _as_list(value, field, _as_int)
    if kind == "devices":
        return _as_devices(value, field)
    if kind == "seeds":
        return _as_seeds(value, field)
    if kind == "grid":
        return _as_grid(value, field)
    raise AssertionError(kind)


def coerce_like(value, default, field: str):
    """Converts a hyper-parameter / dataset argument to the type of its default."""
    if value is None or default is None or default is REQUIRED:
        return value
    if isinstance(default, bool):
        return _as_bool(value, field)
    if isinstance(default, int):
        return _as_int(value, field)
    if isinstance(default, float):
        return _as_float(value, field)
    if isinstance(default, str):
        return _as_str(value, field)
    if isinstance(default, (tuple, list)):
        if not isinstance(value, (tuple, list)):
            raise ConfigError(field, f"must be a list like {list(default)}, got {value!r}")
        return tuple(value)
    return value


# ------------------------------------------------------------------------ load / merge


def _unique_json_object(pairs) -> dict:
    """json's ``object_pairs_hook``: a key given twice is an error naming it."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"config.{key}", "given twice in the file; keep one")
        out[key] = value
    return out


def _load_yaml_unique(text: str):
    """``yaml.safe_load`` that refuses a mapping key given twice (PyYAML keeps the
    last silently)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        pass

    def construct_mapping(loader, node, deep=False):
        seen = set()
        for key_node, _ in node.value:  # the mapping's own keys (a merge << may be overridden)
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = loader.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: SafeLoader reports it
                break
            if duplicate:
                raise ConfigError(f"config.{key}", f"given twice in the file (line "
                                                   f"{key_node.start_mark.line + 1}); keep one")
            seen.add(key)
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                    construct_mapping)
    return yaml.load(text, Loader=UniqueKeyLoader)


def load_file(path: str) -> dict:
    """Reads a JSON (``.json``) or YAML (anything else) config file into a dict."""
    if not os.path.isfile(path):
        raise ConfigError("config", f"file not found: {path!r}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError("config", f"{path!r} is not UTF-8 text ({e.reason} at byte "
                                    f"{e.start})") from None
    except OSError as e:
        raise ConfigError("config", f"cannot read {path!r}: {e.strerror or e}") from None
    try:
        if path.endswith(".json"):
            data = json.loads(text, object_pairs_hook=_unique_json_object)
        else:
            data = _load_yaml_unique(text)
    except ConfigError:
        raise
    except Exception as e:  # yaml.YAMLError / json.JSONDecodeError: report in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError("config", f"cannot parse {path!r}: {first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path!r} must hold a mapping of field: value, "
                                    f"got {type(data).__name__}")
    return data


def build(cls, file_values: Optional[dict] = None, overrides: Optional[dict] = None,
          source: str = "config", base: Optional[dict] = None):
    """``cls`` from defaults <- ``base`` <- ``file_values`` <- ``overrides`` (flat dicts;
    ``base`` is a saved run's config when resuming).

    Unknown keys in ``file_values`` are errors naming the allowed keys. Dict fields
    (``hparams``, ``dataset_args``) are merged key by key, so a flag overrides one
    hyper-parameter of a config file without dropping the others.
    """
    known = fields(cls)
    values: dict = {}
    for layer, where in ((base or {}, "saved"), (file_values or {}, source),
                         (overrides or {}, "flags")):
        for key, value in layer.items():
            if key in RECORD_KEYS and where != "flags":  # a saved config.json's record
                continue
            if key not in known:
                raise ConfigError(f"{where}.{key}" if where != "flags" else key,
                                  f"unknown key; allowed: {sorted(known)}")
            kind = known[key].metadata["kind"]
            value = coerce(kind, value, key)
            if kind in ("dict", "grid") and key in values:
                value = {**values[key], **value}
            values[key] = value
    return cls(**values)


# What a resumed run, comparison or sweep may change, and what --branch may (cli.options).
RESUMABLE = O.resumable("run")
COMPARE_RESUMABLE = O.resumable("compare")
SWEEP_RESUMABLE = O.resumable("sweep")
BRANCHABLE = O.BRANCHABLE
RECORD_KEYS = O.RECORD_KEYS


def resumed(cls, saved: dict, file_values: Optional[dict], overrides: Optional[dict],
            source: str = "config", allowed=RESUMABLE):
    """The config of a resumed run: the ``saved`` run's config.json <- the config file
    <- flags. Flags may only change the ``allowed`` fields; any other difference is a
    ``ConfigError("resume", ...)`` listing every changed field."""
    known = fields(cls)
    saved_fields = {k: v for k, v in saved.items() if k in known}
    before = build(cls, base=saved_fields)
    cfg = build(cls, file_values, overrides, source, base=saved_fields)
    changed = [k for k in known if k not in allowed
               and _canonical(getattr(before, k)) != _canonical(getattr(cfg, k))]
    if changed:
        raise ConfigError("resume", "these settings differ from the saved run and would change "
                                    "its results: " + ", ".join(
                                        f"{k} ({getattr(before, k)!r} -> {getattr(cfg, k)!r})"
                                        for k in changed)
                          + "; resume with the saved settings, or start a new run"
                          + ("; or continue from the checkpoint with the changed settings "
                             "as a recorded branch: --resume --branch"
                             if cls is RunConfig and all(k in BRANCHABLE for k in changed)
                             else ""))
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


# ------------------------------------------------------------------ introspection


def config_fields() -> set:
    """Names of RunConfig fields; a factory argument with such a name (client_lr,
    batch_size, num_epochs) is set from the field, not from ``hparams``."""
    return {f.name for f in dataclasses.fields(RunConfig)}


def algorithm_hparams(name: str) -> dict:
    """``{name: HParam}`` that ``hparams`` may set for a registered algorithm: the
    factory's keyword arguments that are neither Python objects nor config fields."""
    managed = config_fields()
    return {k: h for k, h in method_hparams(name).items()
            if not h.python_only and k not in managed}


def accepts(name: str, key: str) -> bool:
    """Whether algorithm ``name``'s factory has a keyword argument ``key``."""
    return key in method_hparams(name)


def needs_full_participation(name: str) -> bool:
    return get_method(name).participation == "full"


_SCALAR_TYPES = (("bool", bool), ("int", int), ("float", float), ("Rate", float),
                 ("str", str))


def coerce_hparam(hp, value, field: str):
    """``value`` converted to the hyper-parameter's type (from its default, else its
    annotation) and checked against its range."""
    if value is None:
        if hp.default is None or (hp.range is not None and hp.range.nullable):
            return None
        raise ConfigError(field, "may not be null")
    default = hp.default
    if default is None:  # Optional[...]: the annotation says the type
        for word, kind in _SCALAR_TYPES:
            if re.search(rf"\b{word}\b", hp.annotation):
                default = kind()
                break
    value = coerce_like(value, default, field)
    if hp.range is not None:
        try:
            hp.range.check(field, value)
        except ValueError as e:
            raise ConfigError(field, str(e).split(": ", 1)[-1]) from None
    return value


def dataset_params(builder: Callable) -> dict:
    """``{name: default}`` of a dataset builder's keyword arguments."""
    sig = inspect.signature(builder)
    return {p.name: (REQUIRED if p.default is p.empty else p.default)
            for p in sig.parameters.values()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def dataset_registry() -> dict:
    try:
        from fedjax_fair.data import DATASETS
    except ImportError as e:  # the data package is missing or broken
        raise ConfigError("dataset", f"the dataset registry cannot be imported ({e})") from None
    return DATASETS


# -------------------------------------------------------------------------- validation


SEED_LIMIT, COUNT_LIMIT = O.SEED_LIMIT, O.COUNT_LIMIT
check_seed = O.seed  # a seed is an integer in [0, 2^32)


def check_trackers(cfg) -> None:
    """``tracker``: known names whose libraries are installed (``tracking.check_trackers``),
    before anything is built; stored as the checked tuple's list."""
    from fedjax_fair.drivers import tracking
    try:
        cfg.tracker = list(tracking.check_trackers(cfg.tracker))
    except (ValueError, TypeError) as e:
        raise config_error(e, "tracker") from None


def check_declared(cfg) -> None:
    """Every option's declared range and choices (``options.Option.check`` /
    ``choices``); a None value is the method's own (batch size, epochs, ...)."""
    for o in O.of(cfg.command):
        value = getattr(cfg, o.name)
        if value is None:
            continue
        if o.check is not None:
            o.check(o.name, value)
        if o.choices is not None:
            _choice(o.name, value, o.choices())


def _choice(field: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ConfigError(field, f"unknown name {value!r}; allowed: {', '.join(sorted(allowed))}")


def system_spec(cfg):
    """The participation and clock options as a ``parsing.Spec`` (their syntax and
    values checked; a trace file read), or ``ConfigError`` naming the option."""
    from fedjax_fair.cli import parsing
    try:
        return parsing.parse_system(cfg.availability, cfg.dropout, cfg.speeds, cfg.bandwidth,
                            cfg.latency, cfg.deadline, cfg.system_seed)
    except ValueError as e:
        raise config_error(e, "availability") from None


DP_SETTINGS = ("dp_clip", "dp_delta", "dp_max_weight", "dp_adaptive_clip")


def check_dp_settings(cfg) -> None:
    """--dp-clip, --dp-delta, --dp-max-weight and --dp-adaptive-clip shape client-level
    DP, which only --dp-noise or --dp-epsilon turns on: set (away from their declared
    defaults) without either, they would be ignored without a word."""
    if getattr(cfg, "dp_noise", None) is not None or getattr(cfg, "dp_epsilon", None) is not None:
        return
    for name in DP_SETTINGS:
        default = O.BY_NAME[name].default
        value = getattr(cfg, name, default)
        if _canonical(value) != _canonical(default):
            raise ConfigError(name, f"{value!r} shapes client-level DP, which is off without "
                                    f"--dp-noise or --dp-epsilon; give one of them, or drop "
                                    f"--{name.replace('_', '-')}")


def _validate_common(cfg) -> None:
    check_trackers(cfg)
    from fedjax_fair.cli import extras, transforms
    extras.check(cfg)  # options whose optional package (an extra) is missing
    transforms.check(cfg)
    check_dp_settings(cfg)

    check_declared(cfg)
    if cfg.compensate_server_lr and cfg.client_lr_schedule == "none":
        raise ConfigError("compensate_server_lr", "needs a decaying client rate: give "
                                                  "--client-lr-schedule too")
    if cfg.resplit != "none":
        parse_fractions(cfg.resplit)
    check_devices(cfg.devices)
    for name in ("client_lr_schedule", "server_lr_schedule"):
        try:
            parse_schedule(getattr(cfg, name), name)
        except ValueError as e:
            raise config_error(e, name) from None
    try:
        parse_budgets(cfg.step_budgets, cfg.batch_size or 1)  # the syntax; counts per method
    except ValueError as e:
        raise config_error(e, "step_budgets") from None
    system_spec(cfg)
    cfg.model_args = validate_model_args(cfg.model, cfg.model_args, MODELS)
    datasets = dataset_registry()
    _choice("dataset", cfg.dataset, datasets)
    cfg.dataset_args = validate_dataset_args(cfg.dataset, cfg.dataset_args, datasets)


def check_devices(devices) -> None:
    """``devices`` is 'auto', 'all' or an integer >= 1, at most the devices JAX sees
    (only an integer other than 1 asks JAX, so that no other value starts the backend
    here). On a CPU, if JAX has not started yet, makes the devices asked for, one per
    core for 'auto' and 'all' (``sharding.provide_cpu_devices``)."""
    if devices == 1:
        return
    if devices not in ("all", "auto") and (not _is_int(devices) or devices < 1):
        raise ConfigError("devices", f"must be an integer >= 1, 'all' or 'auto', "
                                     f"got {devices!r}")
    provide_cpu_devices("all" if devices == "auto" else devices)
    if devices in ("all", "auto"):
        return
    try:
        make_mesh(devices)
    except ValueError as e:
        raise config_error(e, "devices") from None


def execution_of(cfg, num_clients: int, step_flops: Optional[float] = None,
                 round_flops: Optional[float] = None, model=None):
    """The ``Execution`` of a config over a federation of ``num_clients`` whose local
    steps take ``step_flops`` and rounds' local training ``round_flops``: ``execution``
    and ``chunk_size`` over the mesh of ``devices`` (``mesh_of``). Without a mesh,
    ``auto`` is fixed for one device even where JAX has several CPU devices (``auto``
    alone would split the cohort over them, ``execution.auto_mesh``), as
    ``execution.choose`` picks for ``model`` (an ``execution.ModelProfile``)."""
    mesh = mesh_of(cfg.devices, cfg.cohort_size, num_clients, step_flops, round_flops)
    strategy, chunk_size = cfg.execution, cfg.chunk_size
    if mesh is None and strategy == "auto":
        strategy, chunk_size = resolve("auto", cfg.cohort_size, chunk_size=chunk_size,
                                       model=model)
    return Execution(strategy, chunk_size, mesh, model)


def mesh_of(devices, cohort_size: int, num_clients: int,
            step_flops: Optional[float] = None, round_flops: Optional[float] = None):
    """The mesh of a config's ``devices`` for cohorts of ``cohort_size`` out of
    ``num_clients`` clients (None for one device). ``auto``: ``execution.auto_mesh``
    (the CPU devices that split the federation evenly; none for local steps of
    ``step_flops`` large enough to keep one device's cores busy, or for rounds of
    ``round_flops`` too small to pay for the mesh), or every device of a
    multi-process job."""
    if devices == 1:
        return None
    if devices == "auto" and jax.process_count() == 1:
        from fedjax_fair.core.execution import auto_mesh
        return auto_mesh(cohort_size, num_clients=num_clients, step_flops=step_flops,
                         round_flops=round_flops)
    mesh = make_mesh(None if devices in ("all", "auto") else devices)
    return mesh if mesh.devices.size > 1 else None


def _validate_builder_args(kind: str, name: str, args: dict, allowed: dict) -> dict:
    """``args`` checked against a builder's ``{name: default}`` and coerced to the
    defaults' types; errors name ``{kind}_args.KEY``."""
    out = {}
    for key, value in args.items():
        if key not in allowed:
            raise ConfigError(f"{kind}_args.{key}",
                              f"not an argument of {kind} {name!r}; allowed: "
                              f"{', '.join(sorted(allowed)) or '(none)'}")
        out[key] = coerce_like(value, allowed[key], f"{kind}_args.{key}")
        if (key == "seed" or key.endswith("_seed")) and _is_int(out[key]):
            check_seed(f"{kind}_args.{key}", out[key])
    return out


def validate_dataset_args(name: str, args: dict, datasets: dict) -> dict:
    return _validate_builder_args("dataset", name, args, dataset_params(datasets[name]))


def model_params(builder: Callable) -> dict:
    """``{name: default}`` of a model builder's keyword arguments (after input_shape
    and num_classes, which come from the dataset)."""
    return {p.name: p.default for p in list(inspect.signature(builder).parameters.values())[2:]
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def validate_model_args(name: str, args: dict, models: dict) -> dict:
    return _validate_builder_args("model", name, args, model_params(models[name]))


def validate_hparams(algorithm: str, hparams: dict, field: str = "hparams") -> dict:
    """Checks names against the factory signature and values against the registry's
    ranges; returns coerced values."""
    every = method_hparams(algorithm)
    allowed = algorithm_hparams(algorithm)
    out = {}
    for key, value in hparams.items():
        if key in every and key in config_fields():
            raise ConfigError(f"{field}.{key}", f"set it with the config field / flag "
                                                f"{key} (--{key.replace('_', '-')}), not as a "
                                                f"hyper-parameter")
        if key in every and every[key].python_only:
            raise ConfigError(f"{field}.{key}", f"an object for the Python API "
                                                f"({algorithm}({key}=...)); no value from a "
                                                f"config can build it")
        if key not in allowed:
            raise ConfigError(f"{field}.{key}",
                              f"not a hyper-parameter of {algorithm!r}; allowed: "
                              f"{', '.join(allowed) or '(none)'}")
        out[key] = coerce_hparam(allowed[key], value, f"{field}.{key}")
        if (key == "seed" or key.endswith("_seed")) and _is_int(out[key]):
            check_seed(f"{field}.{key}", out[key])
    return out


def check_fresh_output(path: str, overwrite: bool) -> None:
    """A directory that already holds files is not written into without ``--overwrite``
    (or ``--resume`` for ``run``)."""
    lock.check_not_held(path, "output_dir")
    if not overwrite and lock.holds_results(path):
        raise ConfigError("output_dir", f"{path!r} already holds results; continue that run "
                                        f"with --resume, or replace it with --overwrite")


def check_directory(path: str, field: str) -> None:
    """``path`` is a directory or can be created as one (nothing is created here)."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ConfigError(field, f"{path!r} exists and is not a directory")
        if not os.access(path, os.W_OK):
            raise ConfigError(field, f"{path!r} is not writable")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ConfigError(field, f"cannot create {path!r}: {parent!r} is not a writable "
                                 f"directory")


def _check_fresh_checkpoint(cfg: RunConfig) -> None:
    """A new run does not write into a checkpoint directory outside its output
    directory that another process holds, or that holds a checkpoint, without
    ``--overwrite`` (two runs sharing one would overwrite each other)."""
    directory = cfg.resolved_checkpoint_dir()
    out = os.path.abspath(cfg.resolved_output_dir())
    if directory is None or os.path.abspath(directory).startswith(out + os.sep):
        return
    lock.check_not_held(directory, "checkpoint_dir")
    if not cfg.overwrite and os.path.isdir(directory) and ckpt.exists(directory):
        raise ConfigError("checkpoint_dir", f"{directory!r} already holds a checkpoint "
                                            f"(another run's?); give a new directory, or "
                                            f"replace it with --overwrite")


def validate_run(cfg: RunConfig) -> RunConfig:
    """Static checks of a RunConfig (no data built). Coerces hparams/dataset_args in place."""
    _choice("algorithm", cfg.algorithm, ALGORITHMS)
    check_seed("seed", cfg.seed)
    cfg.hparams = validate_hparams(cfg.algorithm, cfg.hparams)
    _validate_common(cfg)
    check_client_sgd(cfg, [cfg.algorithm])
    check_server_schedule(cfg.algorithm, cfg.server_lr_schedule, cfg.compensate_server_lr)
    check_schedule_rates(cfg, cfg.algorithm, cfg.hparams)
    check_mixing(cfg.algorithm, cfg.mixing)
    check_directory(cfg.resolved_output_dir(), "output_dir")
    if cfg.resolved_checkpoint_dir():
        check_directory(cfg.resolved_checkpoint_dir(), "checkpoint_dir")
    if not cfg.resume:
        check_fresh_output(cfg.resolved_output_dir(), cfg.overwrite)
        _check_fresh_checkpoint(cfg)
    else:
        from fedjax_fair.drivers import checkpoint as ckpt
        directory = cfg.resolved_checkpoint_dir()
        if directory is None:
            raise ConfigError("resume", "needs checkpoints; remove --no-checkpoint")
        if not ckpt.exists(directory):
            raise ConfigError("resume", f"no checkpoint found in {directory!r} "
                                        f"(state.npz + meta.json)")
        try:
            done = int(ckpt.read_meta(directory)["history"][-1]["round"])
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise ConfigError("resume", f"the checkpoint in {directory!r} is unreadable "
                                        f"({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                                        f"; start again with --overwrite") from None
        if cfg.num_rounds < done:
            raise ConfigError("num_rounds", f"the run in {cfg.resolved_output_dir()!r} has "
                                            f"done {done} rounds; --num-rounds {cfg.num_rounds}"
                                            f" is fewer (give at least {done})")
    return cfg


def split_compare_hparams(cfg: CompareConfig, registry: dict) -> dict[str, dict]:
    """Per-algorithm hyper-parameters from ``NAME`` / ``ALGORITHM.NAME`` keys (an
    ``ALGORITHM`` may be a compared ``NAME@LABEL`` variant)."""
    known = lambda a: base_name(a) in registry and (a in cfg.algorithms or "@" not in a)
    per_alg: dict[str, dict] = {a: {} for a in cfg.algorithms}
    flat = {}
    for key, value in cfg.hparams.items():  # {"fedprox": {"mu": 0.1}} == {"fedprox.mu": 0.1}
        if known(key) and isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    for key, value in flat.items():
        alg, dot, name = key.partition(".")
        if dot:
            if base_name(alg) not in registry:
                _choice(f"hparams.{key}", alg, registry)
            if alg not in per_alg:
                raise ConfigError(f"hparams.{key}", f"algorithm {alg!r} is not compared; "
                                                    f"compared: {', '.join(cfg.algorithms)}")
            per_alg[alg][name] = value
        else:
            takers = [a for a in cfg.algorithms if accepts(a, key)]
            if not takers:
                raise ConfigError(f"hparams.{key}", f"no compared algorithm takes it; compared: "
                                                    f"{', '.join(cfg.algorithms)}")
            for a in takers:
                per_alg[a][key] = value
    return {a: validate_hparams(a, hp, field=f"hparams[{a}]") for a, hp in per_alg.items()}


UNIFORM_FEDAVG = "fedavg@uniform"
"""The second reference of a default comparison: FedAvg with the simple average 1 / |S|
(``weight_by_size=False``), against which a method with a uniform prior is read."""


def validate_compare(cfg: CompareConfig) -> dict[str, dict]:
    """Static checks of a CompareConfig; returns the hyper-parameters of each algorithm."""
    if not cfg.algorithms:  # every non-generative algorithm that runs with partial participation
        cfg.algorithms = [a for a in ALGORITHMS if not needs_full_participation(a)
                          and not get_method(a).generative]
        if cfg.mixing == "default":  # both references: FedAvg size-weighted and uniform
            at = cfg.algorithms.index("fedavg") + 1
            cfg.algorithms.insert(at, UNIFORM_FEDAVG)
            cfg.hparams = {**cfg.hparams, f"{UNIFORM_FEDAVG}.weight_by_size": False}
    for a in cfg.algorithms:
        _choice("algorithms", base_name(a), ALGORITHMS)
        if "@" in a and not re.fullmatch(r"[A-Za-z0-9_.-]+", a.partition("@")[2]):
            raise ConfigError("algorithms", f"{a!r}: a variant is NAME@LABEL with a label of "
                                            f"letters, digits, '_', '-' or '.'")
    if len(set(cfg.algorithms)) != len(cfg.algorithms):
        raise ConfigError("algorithms", f"listed twice: {cfg.algorithms}")
    if not cfg.seeds:
        raise ConfigError("seeds", "need at least one seed")
    for s in cfg.seeds:
        check_seed("seeds", s)
    O.SECONDS("commit_seconds", cfg.commit_seconds)
    if len(set(cfg.seeds)) != len(cfg.seeds):
        raise ConfigError("seeds", f"listed twice: {cfg.seeds}")
    hparams = split_compare_hparams(cfg, ALGORITHMS)
    check_tune(cfg)
    _validate_common(cfg)
    check_client_sgd(cfg, cfg.algorithms)
    if not cfg.resume:
        check_fresh_output(cfg.resolved_output_dir(), cfg.overwrite)
    for a in cfg.algorithms:
        check_server_schedule(a, cfg.server_lr_schedule, cfg.compensate_server_lr)
        check_schedule_rates(cfg, a, hparams[a])
        check_mixing(a, cfg.mixing)
    check_directory(cfg.resolved_output_dir(), "output_dir")
    return hparams


def tune_grids(cfg) -> dict:
    """``--grid METHOD.NAME=V1,V2`` of a comparison as ``{method: {name: values}}``; a
    key without a compared method's prefix is a ``ConfigError("grid")``."""
    out: dict = {}
    for key, values in (cfg.grid or {}).items():
        method, dot, name = key.partition(".")
        if not dot or not name:
            raise ConfigError("grid", f"{key!r}: a comparison's grid is METHOD.NAME=V1,V2,... "
                                      f"(e.g. --grid qffl.q=0.1,1)")
        if method not in cfg.algorithms:
            raise ConfigError("grid", f"{key!r}: {method!r} is not compared; compared: "
                                      f"{', '.join(cfg.algorithms)}")
        out.setdefault(method, {})[name] = list(values)
    return out


def check_tune(cfg) -> None:
    """``--tune`` and its options: ``--grid`` only with it, tuning seeds valid and
    disjoint from ``--seeds`` (the final scores come from seeds the selection never
    saw), each method's grid names its hyper-parameters."""
    if not cfg.tune:
        for name, default in (("grid", {}), ("tune_budget", None)):
            if getattr(cfg, name) != default:
                raise ConfigError(name, f"--{name.replace('_', '-')} needs --tune")
        return
    if not cfg.tune_seeds:
        raise ConfigError("tune_seeds", "need at least one seed")
    for s in cfg.tune_seeds:
        check_seed("tune_seeds", s)
    if len(set(cfg.tune_seeds)) != len(cfg.tune_seeds):
        raise ConfigError("tune_seeds", f"listed twice: {cfg.tune_seeds}")
    shared = sorted(set(cfg.tune_seeds) & set(cfg.seeds))
    if shared:
        raise ConfigError("tune_seeds", f"{shared} also in --seeds: the search and the scored "
                                        f"runs must use disjoint seeds")
    if cfg.tune_budget is not None:
        O.positive_count("tune_budget", cfg.tune_budget)
    grids = tune_grids(cfg)
    from fedjax_fair.drivers import tuning
    for method, grid in grids.items():
        for name, values in grid.items():
            if not values or len(set(map(repr, values))) != len(values):
                raise ConfigError("grid", f"{method}.{name}: give distinct values")
        try:
            tuning.search_space(method, overrides=grid)
        except ValueError as e:
            raise config_error(e, "grid") from None


# The participation and clock options a sweep cannot honour (its runs are simulate's
# rounds without a system).
SYSTEM_FIELDS = O.NOT_IN_SWEEPS


def _check_seeds(seeds: list) -> None:
    if not seeds:
        raise ConfigError("seeds", "need at least one seed")
    for s in seeds:
        check_seed("seeds", s)
    if len(set(seeds)) != len(seeds):
        raise ConfigError("seeds", f"listed twice: {seeds}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate_grid(cfg: "SweepConfig") -> dict:
    """``cfg.grid`` checked against the algorithm: every name a hyper-parameter that a
    value sets (``method_hparams``, local-training names included), not also given
    with --hp or its own flag; every value of its type and in its range (continuous
    ones numbers: they are vmapped), none twice. Returns the coerced grid."""
    if not cfg.grid:
        raise ConfigError("grid", f"give at least one --grid NAME=V1,V2,... (a hyper-parameter "
                                  f"of {cfg.algorithm!r} and its values; `fedjax-fair list "
                                  f"algorithms` shows them)")
    every = method_hparams(cfg.algorithm)
    settable = [k for k, h in every.items() if not h.python_only]
    out = {}
    for name, values in cfg.grid.items():
        if name not in every or every[name].python_only:
            raise ConfigError("grid", f"{name!r} is not a hyper-parameter of {cfg.algorithm!r} "
                                      f"that a value sets; allowed: {', '.join(settable)}")
        if name in cfg.hparams:
            raise ConfigError("grid", f"{name!r} is also given as a hyper-parameter (--hp); "
                                      f"give it in one place")
        if name in config_fields() and getattr(cfg, name, None) is not None:
            raise ConfigError("grid", f"{name!r} is also given with --{name.replace('_', '-')}; "
                                      f"give it in one place")
        hp = every[name]
        coerced = []
        for value in values:
            if hp.continuous and not _is_number(value) and not isinstance(value, str):
                raise ConfigError("grid", f"{name}: a continuous hyper-parameter is vmapped "
                                          f"over its values, which must be numbers; got "
                                          f"{value!r}")
            try:
                coerced.append(coerce_hparam(hp, value, name))
            except ConfigError as e:
                raise ConfigError("grid", str(e)) from None
        repeated = sorted({repr(v) for v in coerced if coerced.count(v) > 1})
        if repeated:
            raise ConfigError("grid", f"{name}: values listed twice: {', '.join(repeated)}")
        out[name] = coerced
    from fedjax_fair.drivers.sweeps import check_grid_ranges  # the sweep's own check
    try:
        check_grid_ranges(cfg.algorithm, {k: np.asarray(v, np.float64) for k, v in out.items()
                                          if every[k].continuous})
    except ValueError as e:
        raise config_error(e, "grid") from None
    return out


def validate_sweep(cfg: "SweepConfig") -> dict:
    """Static checks of a SweepConfig (no data built); coerces its grid,
    hyper-parameters and dataset arguments in place and returns the
    hyper-parameters. What a sweep cannot honour is refused naming the option:
    generative methods, --placement host, a device mesh, the participation and
    clock options."""
    _choice("algorithm", cfg.algorithm, ALGORITHMS)
    if get_method(cfg.algorithm).generative:
        raise ConfigError("algorithm", f"{cfg.algorithm!r} is generative: each run's product "
                                       f"is a synthetic data set, which a sweep does not "
                                       f"keep; run it with fedjax-fair run or compare")
    _check_seeds(cfg.seeds)
    cfg.hparams = validate_hparams(cfg.algorithm, cfg.hparams)
    cfg.grid = validate_grid(cfg)
    if not isinstance(cfg.metric, str) or not cfg.metric.strip():
        raise ConfigError("metric", f"name a summary, e.g. accuracy_worst_10%; got "
                                    f"{cfg.metric!r}")
    if cfg.tile_size is not None:
        O.positive_count("tile_size", cfg.tile_size)
    if cfg.placement == "host":
        raise ConfigError("placement", "a sweep keeps the federation on the device (its runs "
                                       "are vmapped in one program); use auto or device, or "
                                       "fedjax-fair run / compare to stream cohorts")
    if cfg.devices not in ("auto", 1):
        raise ConfigError("devices", f"a sweep runs on one device (its runs are vmapped, not "
                                     f"split over a mesh); give 1 or auto, got {cfg.devices!r}")
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    for name in SYSTEM_FIELDS:
        if _canonical(getattr(cfg, name)) != _canonical(defaults[name]):
            raise ConfigError(name, f"a sweep runs simulate's rounds without a participation "
                                    f"or clock model; drop --{name.replace('_', '-')} or use "
                                    f"fedjax-fair run / compare")
    _validate_common(cfg)
    check_client_sgd(cfg, [cfg.algorithm])
    check_server_schedule(cfg.algorithm, cfg.server_lr_schedule, cfg.compensate_server_lr)
    check_schedule_rates(cfg, cfg.algorithm, cfg.hparams)
    check_mixing(cfg.algorithm, cfg.mixing)
    check_directory(cfg.resolved_output_dir(), "output_dir")
    if not cfg.resume:
        check_fresh_output(cfg.resolved_output_dir(), cfg.overwrite)
    return cfg.hparams


def validate_against_data(cfg, num_clients: int, num_examples=None) -> None:
    """Checks that need the federation's size (after building data, before compiling)."""
    if cfg.cohort_size > num_clients:
        raise ConfigError("cohort_size", f"{cfg.cohort_size} exceeds the {num_clients} clients "
                                         f"of the federation; allowed: 1..{num_clients}")
    eval_clients = getattr(cfg, "eval_clients", None)
    if eval_clients is not None and eval_clients > num_clients:
        raise ConfigError("eval_clients", f"{eval_clients} exceeds the {num_clients} clients "
                                          f"of the federation; allowed: 1..{num_clients}")
    names = getattr(cfg, "algorithms", None) or [getattr(cfg, "algorithm", None)]
    for name in names:
        if base_name(name) in ALGORITHMS and needs_full_participation(name) and (
                cfg.cohort_size != num_clients):
            raise ConfigError("cohort_size", f"{name} needs every client every round: use "
                                             f"--cohort-size {num_clients} --sampler full")
    try:  # samplers check their own constraints (e.g. "full" needs K == N)
        sampler = sampling.get(cfg.sampler, num_examples)
        jax.eval_shape(lambda k: sampler(k, num_clients, cfg.cohort_size), jax.random.key(0))
    except ValueError as e:
        raise config_error(e, "sampler") from None
    if num_examples is not None:
        check_local_steps(cfg, names, num_examples)


STEP_LIMIT = O.COUNT_LIMIT  # local steps per round are counted in int32 on the device


def check_local_steps(cfg, names, num_examples) -> None:
    """A round's local steps, epochs x ceil(n / B) for the largest client, stay below
    2^31 (the device counts them in int32): the largest number of epochs any run takes
    (--num-epochs, a sweep's grid, else the methods' own) with the smallest batch.
    Else ``ConfigError("num_epochs")``, before anything is compiled."""
    n = np.asarray(num_examples)
    largest = int(n.max()) if n.size else 0
    if largest <= 0:
        return
    grid = getattr(cfg, "grid", None) or {}
    for name in names:
        if base_name(name) not in ALGORITHMS:
            continue
        every = method_hparams(name)
        if "num_epochs" not in every or "batch_size" not in every:
            continue
        epochs = [e for e in [cfg.num_epochs or every["num_epochs"].default,
                              *grid.get("num_epochs", ())] if _is_int(e) and e > 0]
        batches = [b for b in [cfg.batch_size or every["batch_size"].default,
                               *grid.get("batch_size", ())] if _is_int(b) and b > 0]
        if not epochs or not batches:
            continue
        epochs, batch = max(epochs), min(batches)
        per_epoch = -(-largest // batch)
        if epochs * per_epoch >= STEP_LIMIT:
            raise ConfigError("num_epochs", f"{epochs} epochs x {per_epoch} steps per epoch "
                                            f"(the largest client's {largest} examples in "
                                            f"batches of {batch}) = {epochs * per_epoch:,} "
                                            f"local steps per round, past the 2^31 - 1 the "
                                            f"device counts; give at most "
                                            f"{(STEP_LIMIT - 1) // per_epoch:,} epochs")


def check_data_range(name: str, hparams: dict, train, field: str = "hparams") -> None:
    """A method that keeps its samples in ``data_range`` (FedEvg, FedCVAE) must get
    training inputs inside that range: checked on the data before anything compiles
    (a procedural federation: on its first 1,024 clients' rows)."""
    every = method_hparams(name)
    if "data_range" not in every:
        return
    bounds = hparams.get("data_range", every["data_range"].default)
    if bounds is None:
        return
    from fedjax_fair.core.generated import is_generated, materialize
    if is_generated(train):  # a procedural federation: its first clients' rows
        train = materialize(train, np.arange(min(train.num_clients, 1024)))
    x = np.asarray(train.examples["x"])[np.asarray(train.mask, bool)]
    if x.size == 0:
        return
    lo, hi = float(x.min()), float(x.max())
    if lo < bounds[0] or hi > bounds[1]:
        raise ConfigError(f"{field}.data_range",
                          f"{name} keeps its synthetic samples in [{bounds[0]:g}, {bounds[1]:g}] "
                          f"but the training inputs span [{lo:.4g}, {hi:.4g}]; set a range "
                          f"that holds them, e.g. data_range=[{math.floor(lo)},{math.ceil(hi)}]")


MIXINGS = O.MIXINGS


def parse_fractions(text: str) -> tuple:
    """``"0.8,0.1,0.1"`` -> (0.8, 0.1, 0.1), checked by ``data.federated``'s rule."""
    try:
        return _check_fractions(text.split(","))
    except ValueError as e:
        raise ConfigError("resplit", str(e).split(": ", 1)[-1]) from None


def mixing_kwargs(algorithm: str, mixing: str) -> Optional[dict]:
    """The factory arguments that give ``algorithm`` the plain average ``mixing``
    ("size": p_k ∝ n_k, "uniform": 1 / |S|); {} for "default"; None when the algorithm
    has no such prior (its weights are learned or selected: AFL, AAggFF, FedMax)."""
    if mixing == "default":
        return {}
    prior = get_method(algorithm).size_prior  # declared by the method's registry entry
    return None if prior is None else prior(mixing == "size")


def client_sgd_field(cfg) -> Optional[str]:
    """The first of --client-momentum / --client-weight-decay that is set, else None."""
    return next((f for f in ("client_momentum", "client_weight_decay")
                 if getattr(cfg, f, 0.0)), None)


def check_client_sgd(cfg, algorithms) -> None:
    """--client-momentum / --client-weight-decay set the ``client_optimizer`` of every
    algorithm that takes one (as a ``NAME`` hyper-parameter reaches every algorithm
    taking it): at least one of ``algorithms`` must."""
    field = client_sgd_field(cfg)
    if field and not any(accepts(a, "client_optimizer") for a in algorithms):
        raise ConfigError(field, f"sets the client_optimizer, which "
                                 f"{', '.join(algorithms)} does not take")


def check_mixing(algorithm: str, mixing: str) -> None:
    if mixing_kwargs(algorithm, mixing) is None:
        allowed = [a for a in ALGORITHMS if mixing_kwargs(a, mixing) is not None]
        raise ConfigError("mixing", f"{algorithm!r} has no plain average to replace (its "
                                    f"client weights are learned or selected); use default, "
                                    f"or one of: {', '.join(allowed)}")


SERVER_RATE = "server_lr"  # what the messages call it


def server_rate_name(algorithm: str) -> Optional[str]:
    """The factory argument holding the server learning rate, if any (declared by the
    method's registry entry: ``Method.server_rate``)."""
    return get_method(algorithm).server_rate


def check_server_schedule(algorithm: str, schedule: str, compensate: bool = False) -> None:
    if schedule != "none" and server_rate_name(algorithm) is None:
        raise ConfigError("server_lr_schedule", f"{algorithm!r} has no server learning rate "
                                                f"({SERVER_RATE}); use none")
    if compensate and server_rate_name(algorithm) is None:
        raise ConfigError("compensate_server_lr", f"{algorithm!r} has no server learning "
                                                  f"rate ({SERVER_RATE}) to "
                                                  f"compensate")


def check_schedule_rates(cfg, algorithm: str, hparams: dict) -> None:
    """The rates --client-lr-schedule / --server-lr-schedule (and
    --compensate-server-lr) give ``algorithm`` over the run's rounds are finite and
    >= 0 as the device computes them (``schedules.check_rates``): a step factor > 1 can
    overflow float32, and a compensated server rate divides by a client rate that
    must not decay to 0. The base rates are the ones the run uses (the flag, the
    hyper-parameter or the method's default; every value of a sweep's grid)."""
    from fedjax_fair.scenarios.schedules import check_rates, compensated
    every = method_hparams(algorithm)
    grid = getattr(cfg, "grid", None) or {}

    def bases(name: str, given) -> list:
        first = given if given is not None else every[name].default
        return [v for v in [first, *grid.get(name, ())] if _is_number(v)]

    client = parse_schedule(cfg.client_lr_schedule, "client_lr_schedule")
    server = parse_schedule(cfg.server_lr_schedule, "server_lr_schedule")
    try:
        if client is not None and "client_lr" in every:
            for rate in bases("client_lr", cfg.client_lr):
                check_rates(client(rate), cfg.num_rounds, "client_lr_schedule")
        name = server_rate_name(algorithm)
        if name is None or name not in every:
            return
        for rate in bases(name, hparams.get(name)):
            if server is not None:
                check_rates(server(rate), cfg.num_rounds, "server_lr_schedule")
            if cfg.compensate_server_lr and client is not None:
                try:
                    check_rates(client(1.0), cfg.num_rounds, "compensate_server_lr",
                                positive=True)
                except ValueError:
                    raise ConfigError("compensate_server_lr", f"the client rate of "
                                      f"--client-lr-schedule {cfg.client_lr_schedule} decays "
                                      f"to 0 in float32 within {cfg.num_rounds} rounds, and "
                                      f"the compensated server rate divides by it; give a "
                                      f"slower decay or fewer rounds") from None
                check_rates(compensated(server(rate) if server else rate, client(1.0)),
                            cfg.num_rounds, "compensate_server_lr")
    except ValueError as e:
        raise config_error(e, "client_lr_schedule") from None
