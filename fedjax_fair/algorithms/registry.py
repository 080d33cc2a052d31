"""The registry of methods: ``REGISTRY`` holds one ``Method`` entry per CLI name.

Every factory takes the model first and states its hyper-parameters as typed
keyword arguments with defaults (no ``**kwargs``). The registry entry adds what a
command line needs and a signature cannot say: the valid range of each numeric
hyper-parameter (which also marks it continuous — traceable, vmappable and
differentiable — or static), whether the method needs every client every round, and
what it accepts of the command line's shared options (its server rate, its size
prior, a seed, the system's clock). ``method_hparams(name)`` joins the ranges with
the signature. A factory's local training is one value, ``training:
ClientTraining``; ``method_hparams`` lists its fields under their flat names
(``client_lr``, ``batch_size``, ...: ``core.client.FIELDS``) with the factory's own
defaults, and ``build(name, model, **values)`` folds such names into ``training``,
so the command line and sweeps pass only the values they were given.

**A method registers itself.** Its module ends with ``register(name, factory,
HPARAMS, family=...)``; this module imports no method.
``fedjax_fair.algorithms`` imports every module of the package, so importing it
fills ``REGISTRY``. A method defined elsewhere registers the same way from its own
module, which ``load_plugins`` imports: a module name or a path to a ``.py`` file,
the comma-separated list of the environment variable ``FEDJAX_FAIR_PLUGINS``
(``load_env_plugins``; the command line reads it when it starts), and the installed
entry points of group ``fedjax_fair.methods`` (a package's ``[project.entry-points.
"fedjax_fair.methods"] toy = "mypackage.toy"``), which are imported once, the first
time the registry is read.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterable, NamedTuple, Optional, Union

from fedjax_fair.core.algorithm import derive
from fedjax_fair.core.client import FIELDS, TRAINING_RANGES, ClientTraining
from fedjax_fair.hparams import FieldError, Range

ENTRY_POINT_GROUP = "fedjax_fair.methods"
"""The entry-point group of installed plugin methods: each entry names a module."""

PLUGINS_ENV = "FEDJAX_FAIR_PLUGINS"
"""The environment variable of plugin methods: comma-separated module names or paths
to ``.py`` files (``load_env_plugins``)."""


def _weight_by_size(by_size: bool) -> dict:
    return {"weight_by_size": by_size}


WEIGHT_BY_SIZE: Callable[[bool], dict] = _weight_by_size
"""``Method.size_prior`` of a factory with a ``weight_by_size`` flag (the default):
True gives p_k ∝ n_k, False the uniform 1 / |S|."""

PARTICIPATIONS = ("partial", "full")


class Method(NamedTuple):
    """A registry entry: the factory and what a command line needs to know of it."""

    factory: Callable
    """Builds the method: ``factory(model, **hyper_parameters) -> FederatedAlgorithm``."""
    hparams: dict
    """The ranges (``hparams.Range``) of its numeric hyper-parameters, by name."""
    participation: str = "partial"
    """"partial": any cohort; "full": every client every round (sampler ``full``)."""
    report: Optional[Callable] = None
    """An end-of-run ``report(model, algorithm, state, test_split) -> dict`` of the
    method's own numbers (SuPerFed's lambda grid), written under "method_report" in
    summary.json."""
    generative: bool = False
    """Its product is a synthetic data set (``algorithms.families.generative``;
    ``state.params`` is a classifier trained on it); a ``compare`` without
    ``--algorithms`` leaves it out."""
    report_line: Optional[Callable] = None
    """``report_line(report) -> str``: the one line ``run`` prints of that report (the
    method's own wording, so the command line names no method)."""
    training_fields: tuple = tuple(FIELDS)
    """The ``ClientTraining`` fields it honours, by flat name (``client_lr``, ...)."""
    family: str = "reference"
    """A key of ``FAMILIES``: the group ``compare`` shows it in (table and plots)."""
    server_rate: Optional[str] = None
    """The factory argument holding its server learning rate (``--server-lr-schedule``
    and ``--compensate-server-lr`` act on it); None when it has none."""
    size_prior: Optional[Callable[[bool], dict]] = WEIGHT_BY_SIZE
    """``size_prior(by_size) -> {argument: value}``: the factory arguments that make its
    plain average size-weighted (True: p_k ∝ n_k) or uniform (False) (``--mixing``);
    None when it has no such prior (its weights are learned or selected)."""
    seeded: bool = False
    """Its initial state depends on a ``seed`` argument (FedEvg's synthetic set,
    FedCVAE's generator): a run's seed is passed to it."""
    clocked: bool = False
    """It is asynchronous: it takes the system's virtual clock as ``clock=`` and the
    number of clients in flight as ``concurrency=`` (FedBuff, FedAsync)."""
    note: Optional[Callable[[int], Optional[str]]] = None
    """``note(cohort_size) -> str or None``: one line a command prints before compute
    when the method, at that cohort size, is not its paper's algorithm as stated
    (FedAsync with a cohort above 1); None when there is nothing to say."""
    search_space: tuple = ()
    """``((name, (v1, v2, ...)), ...)``: the values of its own hyper-parameters that a
    tuned comparison searches (``compare --tune``; ``tuning.search_space`` adds the
    client rate), the paper's grid where its paper gives one (``search_source`` says
    where from); empty when it has none."""
    search_source: str = ""
    """Where ``search_space`` comes from (a paper's table or appendix), for the docs."""
    reports_improvement: bool = False
    """Its paper reports the per-round share of participants whose training loss did not
    rise (DQN-Fed's eq. 29, ``improved_fraction``): a ``run`` without ``--improvement``
    says so at its end."""


FAMILIES = {
    "reference": "the shared reference",
    "server": "server optimisers",
    "fair": "fair aggregation",
    "primal_dual": "primal-dual and drift correction",
    "second_order": "second order",
    "personalised": "personalised",
    "participation": "partial participation and asynchrony",
    "generative": "generative",
}
"""Family key -> title, in the order ``compare`` shows them (``Method.family``)."""


class HParam(NamedTuple):
    """One hyper-parameter as the CLI sees it (``method_hparams``)."""

    name: str
    default: object
    annotation: str  # the signature's type, as written
    range: Optional[Range]  # None: a choice or a Python object
    python_only: bool  # an object (optimizer, mixing rule, ...): no flag can build it

    @property
    def continuous(self) -> bool:
        return self.range is not None and self.range.continuous


class PluginError(FieldError):
    """A plugin that cannot be loaded: ``e.field`` is where it was named ("plugins",
    ``FEDJAX_FAIR_PLUGINS`` or the entry-point group) and the message names the spec."""


# --------------------------------------------------------------------------- the registry

_STATE = {"ready": False, "entry_points": False}  # discovery done; entry points loaded


def _load_entry_points() -> None:
    """Imports the installed entry points of ``ENTRY_POINT_GROUP`` once, after the
    package's own methods are registered; one ``PluginError`` names every failure."""
    if _STATE["entry_points"] or not _STATE["ready"]:
        return
    _STATE["entry_points"] = True
    from importlib.metadata import entry_points
    failures = []
    for point in entry_points(group=ENTRY_POINT_GROUP):
        new = point.module not in sys.modules
        try:
            with _rollback():
                point.load()
        except Exception as e:  # noqa: BLE001: a broken plugin is reported, by name
            failures.append(f"{point.name} = {point.value!r}: {type(e).__name__}: {e}")
            continue
        if new:
            _PLUGIN_MODULES.append(point.module)
    if failures:
        raise PluginError(ENTRY_POINT_GROUP, "cannot load " + "; ".join(failures))


class _Registry(dict):
    """A dict that imports the installed plugins (``ENTRY_POINT_GROUP``) the first
    time it is read. Writes are plain."""

    def __getitem__(self, key):
        _load_entry_points()
        return dict.__getitem__(self, key)

    def __contains__(self, key):
        _load_entry_points()
        return dict.__contains__(self, key)

    def __iter__(self):
        _load_entry_points()
        return dict.__iter__(self)

    def __reversed__(self):
        _load_entry_points()
        return dict.__reversed__(self)

    def __len__(self):
        _load_entry_points()
        return dict.__len__(self)

    def __eq__(self, other):
        _load_entry_points()
        return dict.__eq__(self, other)

    __hash__ = None

    def __repr__(self):
        _load_entry_points()
        return dict.__repr__(self)

    def get(self, key, default=None):
        _load_entry_points()
        return dict.get(self, key, default)

    def keys(self):
        _load_entry_points()
        return dict.keys(self)

    def values(self):
        _load_entry_points()
        return dict.values(self)

    def items(self):
        _load_entry_points()
        return dict.items(self)

    def copy(self) -> dict:
        _load_entry_points()
        return dict(dict.items(self))


REGISTRY: dict = _Registry()
"""CLI name -> ``Method``, in the order ``list`` shows and ``compare`` runs them."""

ALGORITHMS: dict = _Registry()
"""CLI name -> factory."""

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")  # no "@" (NAME@LABEL), "," or "." (--hp)


def _qualname(factory) -> str:
    return f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', factory)}"


def register(name: str, factory: Callable, hparams: dict, *, family: str,
             participation: str = "partial", report: Optional[Callable] = None,
             generative: bool = False, report_line: Optional[Callable] = None,
             training_fields: tuple = tuple(FIELDS), server_rate: Optional[str] = None,
             size_prior: Optional[Callable[[bool], dict]] = WEIGHT_BY_SIZE,
             seeded: bool = False, clocked: bool = False,
             note: Optional[Callable[[int], Optional[str]]] = None,
             search_space: Optional[dict] = None, search_source: str = "",
             reports_improvement: bool = False) -> Method:
    """Registers ``factory`` under ``name`` (the keywords are ``Method``'s fields) and
    returns its ``Method``. A method's module ends with this call. Registering a name
    again with the same entry does nothing; with another factory or other fields it is
    a ValueError naming it (``unregister`` it first)."""
    where = f"register({name!r})"
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{where}: a method's name is letters, digits and underscores, "
                         f"starting with a letter")
    if not callable(factory):
        raise TypeError(f"{where}: factory must be callable, got {factory!r}")
    if not isinstance(hparams, dict):
        raise TypeError(f"{where}: hparams must be a dict of ranges, got {hparams!r}")
    if family not in FAMILIES:
        raise ValueError(f"{where}: family must be one of {list(FAMILIES)}, got {family!r}")
    if participation not in PARTICIPATIONS:
        raise ValueError(f"{where}: participation must be one of {PARTICIPATIONS}, "
                         f"got {participation!r}")
    unknown = [f for f in training_fields if f not in FIELDS]
    if unknown:
        raise ValueError(f"{where}: training_fields {unknown} are not ClientTraining "
                         f"fields ({list(FIELDS)})")
    if server_rate is not None and not isinstance(server_rate, str):
        raise TypeError(f"{where}: server_rate must name an argument, got {server_rate!r}")
    if size_prior is not None and not callable(size_prior):
        raise TypeError(f"{where}: size_prior must be callable or None, got {size_prior!r}")
    if note is not None and not callable(note):
        raise TypeError(f"{where}: note must be callable or None, got {note!r}")
    space = _check_space(where, factory, search_space or {})
    method = Method(factory, hparams, participation, report, bool(generative), report_line,
                    tuple(training_fields), family, server_rate, size_prior, bool(seeded),
                    bool(clocked), note, space, str(search_source),
                    bool(reports_improvement))
    existing = dict.get(REGISTRY, name)
    if existing is not None:
        if existing == method:
            return existing
        other = ("another factory, " + _qualname(factory) if existing.factory is not factory
                 else "other fields")
        raise ValueError(f"method {name!r} is already registered (factory "
                         f"{_qualname(existing.factory)}); registering it again with "
                         f"{other}: choose another name, or unregister({name!r}) first")
    dict.__setitem__(REGISTRY, name, method)
    dict.__setitem__(ALGORITHMS, name, factory)
    return method


def unregister(name: str) -> Method:
    """Removes ``name`` from the registry and returns its entry (tests; a plugin
    replaced in a running session). A KeyError names an unknown name."""
    if not dict.__contains__(REGISTRY, name):
        raise KeyError(f"no method {name!r} is registered")
    dict.pop(ALGORITHMS, name, None)
    return dict.pop(REGISTRY, name)


def _arrange(modules: Iterable[str]) -> None:
    """Orders the registry by the module that defines each factory, in ``modules``'
    order (each module's methods in the order it registered them; any other after
    them, as registered). ``fedjax_fair.algorithms`` calls this once its discovery has
    imported every module: a module imported early by another keeps its place."""
    rank = {m: i for i, m in enumerate(modules)}
    entries = sorted(dict.items(REGISTRY),
                     key=lambda kv: rank.get(getattr(kv[1].factory, "__module__", None),
                                             len(rank)))
    for table in (REGISTRY, ALGORITHMS):
        dict.clear(table)
    for name, method in entries:
        dict.__setitem__(REGISTRY, name, method)
        dict.__setitem__(ALGORITHMS, name, method.factory)
    _STATE["ready"] = True


# ----------------------------------------------------------------------------- plugins

_PLUGIN_MODULES: list = []  # the modules load_plugins imported, in order (isolated())


@contextlib.contextmanager
def _rollback():
    """Leaves the registry as it was if the block raises (a plugin half registered)."""
    before = list(dict.items(REGISTRY))
    try:
        yield
    except BaseException:
        for table in (REGISTRY, ALGORITHMS):
            dict.clear(table)
        for name, method in before:
            dict.__setitem__(REGISTRY, name, method)
            dict.__setitem__(ALGORITHMS, name, method.factory)
        raise


def _is_path(spec: str) -> bool:
    return spec.endswith(".py") or "/" in spec or os.sep in spec


def _file_module_name(path: Path) -> str:
    stem = re.sub(r"\W", "_", path.stem)
    digest = hashlib.sha1(str(path).encode("utf-8")).hexdigest()[:10]
    return f"_fedjax_fair_plugin_{stem}_{digest}"


def _load_path(spec: str, field: str) -> ModuleType:
    path = Path(spec).expanduser()
    if not path.is_file():
        raise PluginError(field, f"{spec!r}: no such file (a plugin is a module name or "
                                 f"a path to a .py file)")
    path = path.resolve()
    name = _file_module_name(path)
    if name in sys.modules:  # loaded before: a module runs once, as an import would
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise PluginError(field, f"{spec!r}: not a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        with _rollback():
            module_spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise PluginError(field, f"{spec!r}: {type(e).__name__}: {e}") from e
    _PLUGIN_MODULES.append(name)
    return module


def _load_module(spec: str, field: str) -> ModuleType:
    if not all(part.isidentifier() for part in spec.split(".")):
        raise PluginError(field, f"{spec!r}: neither a module name nor a path to a .py file")
    new = spec not in sys.modules
    try:
        with _rollback():
            module = importlib.import_module(spec)
    except ModuleNotFoundError as e:
        if e.name is not None and (spec == e.name or spec.startswith(e.name + ".")):
            raise PluginError(field, f"{spec!r}: no module named {e.name!r} on sys.path "
                                     f"(a plugin is a module name or a path to a .py "
                                     f"file)") from e
        raise PluginError(field, f"{spec!r}: {type(e).__name__}: {e}") from e
    except Exception as e:
        raise PluginError(field, f"{spec!r}: {type(e).__name__}: {e}") from e
    if new:
        _PLUGIN_MODULES.append(spec)
    return module


def load_plugins(specs: Union[str, Iterable[str], None] = (), *,
                 field: str = "plugins") -> list:
    """Imports plugin methods, so that their ``register`` calls run, and returns their
    modules. Each spec is a module name (``mypackage.toy``, found on ``sys.path``) or a
    path to a ``.py`` file; a string is split at commas, empty entries are skipped. A
    spec loaded before is not run again. The installed entry points
    (``ENTRY_POINT_GROUP``) are loaded first, once. A failure is a ``PluginError``
    (``field``: where the specs came from) naming the spec; the registry is then as
    it was before that spec."""
    if specs is None:
        specs = ()
    elif isinstance(specs, str):
        specs = specs.split(",")
    specs = [s.strip() for s in specs]
    _load_entry_points()
    return [(_load_path if _is_path(s) else _load_module)(s, field) for s in specs if s]


def load_env_plugins(environ=None) -> list:
    """``load_plugins`` of ``$FEDJAX_FAIR_PLUGINS`` (comma-separated; errors name the
    variable); nothing at all when it is unset or empty. The command line calls this
    when it starts."""
    value = (os.environ if environ is None else environ).get(PLUGINS_ENV, "")
    if not value.strip():
        return []
    return load_plugins(value, field=PLUGINS_ENV)


@contextlib.contextmanager
def isolated():
    """Restores the registry on exit, and forgets the plugin modules loaded in the
    block (so they load afresh later): for tests that register or load methods."""
    entries = list(dict.items(REGISTRY))
    loaded = len(_PLUGIN_MODULES)
    try:
        yield
    finally:
        for table in (REGISTRY, ALGORITHMS):
            dict.clear(table)
        for name, method in entries:
            dict.__setitem__(REGISTRY, name, method)
            dict.__setitem__(ALGORITHMS, name, method.factory)
        for module in _PLUGIN_MODULES[loaded:]:
            sys.modules.pop(module, None)
        del _PLUGIN_MODULES[loaded:]


def __getattr__(name: str):
    """The registered factories by their function's name (this module exported them
    when it imported every method: ``from ...registry import fedavg`` still works)."""
    if not name.startswith("__"):
        for method in dict.values(REGISTRY):
            if getattr(method.factory, "__name__", None) == name:
                return method.factory
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------- reading it

def base_name(name: str) -> str:
    """The registered method of a compared entry: ``"superfed@lm"`` -> ``"superfed"``
    (``NAME@LABEL`` compares one method under several settings side by side)."""
    return name.partition("@")[0]


def get_method(name: str) -> Method:
    """The registry entry of ``name`` or of a ``NAME@LABEL`` variant."""
    return REGISTRY[base_name(name)]


def get_algorithm(name: str):
    if name not in ALGORITHMS:
        raise FieldError("algorithm", f"unknown name {name!r}; allowed: {sorted(ALGORITHMS)}")
    return ALGORITHMS[name]


def _annotation(p: inspect.Parameter) -> str:
    a = p.annotation
    if a is p.empty:
        return ""
    return a if isinstance(a, str) else getattr(a, "__name__", str(a))


_VALUE_TYPES = re.compile(r"\b(bool|int|float|str|tuple|Rate)\b")


def _check_space(where: str, factory: Callable, space) -> tuple:
    """``search_space`` as ``((name, values), ...)``: each name a keyword argument of
    ``factory`` or a ``ClientTraining`` field's flat name, each value list non-empty
    numbers (or strings), without repeats."""
    if not isinstance(space, dict):
        raise TypeError(f"{where}: search_space must be a dict of name -> values, got "
                        f"{space!r}")
    names = {p.name for p in inspect.signature(factory).parameters.values()
             if p.kind is p.KEYWORD_ONLY} | set(FIELDS)
    out = []
    for name, values in space.items():
        values = tuple(values) if isinstance(values, (list, tuple)) else None
        if name not in names:
            raise ValueError(f"{where}: search_space names {name!r}, not an argument of "
                             f"the factory")
        if not values or len(set(values)) != len(values) or not all(
                isinstance(v, (int, float, str)) and not isinstance(v, bool) for v in values):
            raise ValueError(f"{where}: search_space[{name!r}] must be distinct numbers or "
                             f"strings, got {space[name]!r}")
        out.append((name, values))
    return tuple(out)


PRIORS = ("size", "uniform", "own")
"""What ``prior_of`` says: p_k ∝ n_k, 1 / |S|, or the method's own weights."""


def prior_of(name: str, hparams: Optional[dict] = None, mixing: str = "default") -> str:
    """The plain average method ``name`` starts from with hyper-parameters ``hparams``
    under ``--mixing mixing``: "size" (p_k ∝ n_k), "uniform" (1 / |S|), or "own" for a
    method without a size prior (its weights are learned or selected: AFL, AAggFF,
    FedMax, ...). A comparison's table says it for every row, so that a method is
    credited only beyond the FedAvg of the same prior."""
    method = get_method(name)
    if method.size_prior is None:
        return "own"
    if mixing in ("size", "uniform"):
        return mixing
    every = method_hparams(name)
    by_size = method.size_prior(True)
    given = {k: (hparams or {}).get(k, every[k].default if k in every else None)
             for k in by_size}
    return "size" if given == by_size else "uniform"


def method_hparams(name: str) -> dict:
    """``{name: HParam}`` of a registered method's keyword hyper-parameters, in
    signature order: default and type from the factory's signature, range from the
    registry. Parameters whose type names no value type (bool, int, float, str,
    tuple, Rate) are Python objects: optimizers, mixing rules, aggregators. The
    ``training`` argument is listed as its fields under their flat names
    (``client_lr``, ``batch_size``, ...), each with the factory's default
    ``ClientTraining``'s value. A ``NAME@LABEL`` variant has its method's
    hyper-parameters."""
    method = get_method(name)
    out = {}
    for p in inspect.signature(method.factory).parameters.values():
        if p.kind is not p.KEYWORD_ONLY:
            continue
        if p.name == "training":
            out.update(_training_hparams(p.default, method.training_fields))
            continue
        annotation = _annotation(p)
        python_only = (not _VALUE_TYPES.search(annotation) if annotation
                       else p.default is None)
        out[p.name] = HParam(p.name, p.default, annotation, method.hparams.get(p.name),
                             python_only)
    return out


_TRAINING_TYPES = {"lr": "Rate", "batch_size": "int", "num_epochs": "int",
                   "max_steps": "Optional[int]", "optimizer": "Optimizer",
                   "weight_decay": "float", "clip_norm": "Optional[float]", "clip_mode": "str"}


def _training_hparams(default: ClientTraining, flat_names) -> dict:
    return {flat: HParam(flat, getattr(default, FIELDS[flat]), _TRAINING_TYPES[FIELDS[flat]],
                         TRAINING_RANGES.get(FIELDS[flat]), FIELDS[flat] == "optimizer")
            for flat in flat_names}


def default_training(name: str) -> ClientTraining:
    """The ``ClientTraining`` a registered method's factory defaults to."""
    p = inspect.signature(get_method(name).factory).parameters["training"]
    return p.default


def build(name: str, model, **values):
    """``REGISTRY[name].factory(model, ...)`` with ``values`` by flat name: the
    local-training ones (``client_lr=0.02, batch_size=10``) replace those fields of
    the factory's default ``training`` (the others keep the method's own defaults),
    the rest are passed as they are. A name the method does not take is a TypeError,
    as a call would give. The method carries ``name`` (``FederatedAlgorithm.name``)."""
    method = get_method(name)
    flat = {k: values.pop(k) for k in list(values) if k in FIELDS}
    unknown = sorted(set(flat) - set(method.training_fields))
    if unknown:
        raise TypeError(f"{base_name(name)}() got unexpected keyword arguments {unknown} "
                        f"(its local training honours {list(method.training_fields)})")
    if flat:
        values["training"] = values.get("training", default_training(name)).with_flat(**flat)
    return derive(method.factory(model, **values), lambda alg: alg._replace(name=name))


__all__ = ["ALGORITHMS", "ENTRY_POINT_GROUP", "FAMILIES", "HParam", "Method", "PLUGINS_ENV",
           "PluginError", "REGISTRY", "WEIGHT_BY_SIZE", "base_name", "build",
           "default_training", "get_algorithm", "get_method", "isolated", "load_env_plugins",
           "load_plugins", "method_hparams", "register", "unregister"]
