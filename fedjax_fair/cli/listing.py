"""``fedjax-fair list``: algorithms (with their hyper-parameters), datasets, models,
partitions, strategies, samplers, participation and clock options, metrics."""
from __future__ import annotations

import inspect
import re
import sys

from fedjax_fair.algorithms import FAMILIES, REGISTRY, method_hparams
from fedjax_fair.cli import config as C, options as O
from fedjax_fair.core.execution import STRATEGIES
from fedjax_fair.scenarios.sampling import SAMPLERS
from fedjax_fair.data import PARTITIONERS
from fedjax_fair.metrics import METRICS
from fedjax_fair.models import MODELS


def _fmt_default(v) -> str:
    if v is C.REQUIRED:
        return "(required)"
    if callable(v):
        return getattr(v, "__name__", repr(v))
    return repr(v)


def _params_line(params: dict) -> str:
    return ", ".join(f"{k}={_fmt_default(v)}" for k, v in params.items()) or "(none)"


def _doc_line(obj) -> str:
    """The first sentence of ``obj``'s docstring (its module's if it has none)."""
    doc = inspect.getdoc(obj) or ""
    if not doc and hasattr(obj, "__module__"):
        doc = inspect.getdoc(sys.modules.get(obj.__module__)) or ""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    return re.split(r"(?<=\.)\s", paragraph, maxsplit=1)[0]


def _hparam_text(h) -> str:
    kind = f": {h.annotation}" if h.annotation else ""
    rng = f" in {h.range.describe()}" if h.range is not None else ""
    diff = ", differentiable" if h.continuous else ""
    return f"{h.name}{kind} = {_fmt_default(h.default)}{rng}{diff}"


def _list_algorithms() -> list[str]:
    lines = ["algorithms (client_lr, batch_size, num_epochs: their flags when given, else "
             "each method's own default shown below; set the others with --hp NAME=VALUE; "
             "'differentiable' ones may be traced arrays for jax.vmap / jax.grad in Python):"]
    for name, method in REGISTRY.items():
        every = method_hparams(name)
        settable = C.algorithm_hparams(name)
        objects = [k for k, h in every.items() if h.python_only]
        head = f"  {name}  [{FAMILIES[method.family]}" + (
            "; full participation: --sampler full" if method.participation == "full"
            else "") + "]"
        lines.append(head + f"  — {_doc_line(method.factory)}")
        for h in settable.values():
            lines.append(f"      {_hparam_text(h)}")
        managed = [_hparam_text(h) for k, h in every.items()
                   if k in C.config_fields() and not h.python_only]
        if managed:
            lines.append(f"      from flags: {'; '.join(managed)}")
        if objects:
            lines.append(f"      Python API only: {', '.join(objects)}")
    return lines


def _list_datasets() -> list[str]:
    lines = ["datasets (set arguments with --dataset-arg NAME=VALUE):"]
    for name, builder in C.dataset_registry().items():
        lines.append(f"  {name:<14} {_params_line(C.dataset_params(builder))}")
    return lines


def _list_partitions() -> list[str]:
    lines = ["partitions (--partition; their arguments are dataset arguments):"]
    for name, fn in PARTITIONERS.items():
        extra = {p.name: p.default for p in list(inspect.signature(fn).parameters.values())[3:]
                 if p.default is not p.empty}
        lines.append(f"  {name:<18} {_params_line(extra) if extra else ''}".rstrip())
    return lines


def _list_models() -> list[str]:
    lines = ["models (input shape and classes come from the dataset):"]
    for name, fn in MODELS.items():
        sig = inspect.signature(fn)
        extra = {p.name: p.default for p in list(sig.parameters.values())[2:]
                 if p.default is not p.empty}
        lines.append(f"  {name:<14} {_params_line(extra) if extra else ''}".rstrip())
    return lines


def _list_strategies() -> list[str]:
    return ["execution strategies (--execution):"] + [f"  {s}" for s in STRATEGIES]


def _list_samplers() -> list[str]:
    return ["samplers (--sampler):"] + [f"  {n:<14} {_doc_line(f)}".rstrip()
                                        for n, f in SAMPLERS.items()]


def _list_system() -> list[str]:
    """Participation and the virtual clock (docs/participation.md)."""
    from fedjax_fair.cli import parsing
    return (["participation and system heterogeneity (docs/participation.md):",
             "  --availability  " + ", ".join(parsing.AVAILABILITY_SPECS),
             "  --dropout       none, P, speed:SLOWEST:FASTEST",
             "  --speeds        " + ", ".join(parsing.SPEED_SPECS) + " (local steps per second)",
             "  --bandwidth     none or BYTES_PER_SECOND (each way);  --latency SECONDS",
             "  --deadline      none, SECONDS (late clients dropped), SECONDS:partial (late "
             "clients send the steps finished in time)",
             "  --system-seed   seed of drawn speeds and device classes"])


def _list_robustness() -> list[str]:
    """Attacks, robust aggregators and client-level DP (docs/robustness.md,
    docs/privacy.md)."""
    return ["privacy and robustness (docs/privacy.md, docs/robustness.md):",
            "  --attack              label_flip, sign_flip[:SCALE], gaussian[:STD], "
            "scaled_replacement[:SCALE]",
            "  --malicious-fraction  F in [0, 1] (floor(F N) clients), or --malicious-ids I,J;"
            " --malicious-seed S",
            "  --robust              median, weighted_median, trimmed_mean[:TRIM], krum[:F], "
            "multi_krum[:F[:M]], geometric_median[:ITERS], norm_bound:MAX_NORM",
            "  --dp-noise Z | --dp-epsilon E   client-level DP (DP-FedAvg), with --dp-clip C "
            "(1), --dp-delta D (1e-5), --dp-max-weight B (1 / cohort), --dp-adaptive-clip "
            "QUANTILE"]


def _list_scenarios() -> list[str]:
    """What each scenario replaces and keeps of each registered method, from their
    declarations (scenarios/wrap.py, docs/scenarios.md)."""
    return ["scenarios per method (docs/scenarios.md):", registry_scenario_table()]


def registry_scenario_table() -> str:
    """``scenarios.scenario_table`` of every registered method, built on a small
    logistic-regression model (two layers for LG-FedAvg, which keeps its last local):
    the declarations do not depend on the model."""
    import jax
    from fedjax_fair.algorithms import build
    from fedjax_fair.scenarios import scenario_table
    from fedjax_fair.models import get_model
    one, two = (get_model("mlp", (4,), 3, hidden=h) for h in ((), (4,)))
    del jax
    return scenario_table({name: build(name, two if name == "lg_fedavg" else one)
                           for name in REGISTRY})


def _list_metrics() -> list[str]:
    return ["metrics:"] + [f"  {n:<18} {d}" for n, d in METRICS.items()]


LIST_SECTIONS = {"algorithms": _list_algorithms, "datasets": _list_datasets,
                 "partitions": _list_partitions,
                 "models": _list_models, "strategies": _list_strategies,
                 "samplers": _list_samplers, "system": _list_system,
                 "robustness": _list_robustness, "scenarios": _list_scenarios,
                 "metrics": _list_metrics, "options": lambda: O.table()}


def cmd_list(args) -> int:
    sections = args.what or list(LIST_SECTIONS)
    for s in sections:
        if s not in LIST_SECTIONS:
            raise C.ConfigError("list", f"unknown section {s!r}; allowed: "
                                        f"{', '.join(LIST_SECTIONS)}")
    blocks = ["\n".join(LIST_SECTIONS[s]()) for s in sections]
    print("\n\n".join(blocks))
    return 0
