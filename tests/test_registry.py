"""The registry: its order, each method's declarations, and ``register`` itself.

* ``list(REGISTRY)`` is the order ``fedjax-fair list`` shows and ``compare`` runs and
  prints the methods in; the package's methods keep it, whichever module imports which.
* What a method accepts of the command line's shared options is declared in its
  ``register`` call (``server_rate``, ``size_prior``, ``seeded``, ``clocked``); each
  declaration is checked here against the factory's signature.
* Every method module ends with its ``register`` call(s); ``registry.py`` imports none.
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import fedjax_fair.algorithms as algorithms
from fedjax_fair.algorithms import registry
from fedjax_fair.algorithms.registry import (ALGORITHMS, FAMILIES, REGISTRY, WEIGHT_BY_SIZE,
                                             Method, build, register, unregister)
from fedjax_fair.core.client import FIELDS

import helpers

PACKAGE = Path(algorithms.__file__).parent

# the registry's order before methods registered themselves (issue 46): the compare
# table of the default comparison depends on it
TODAY = ["fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "scaffold",
         "feddyn", "ditto", "dqn_fed", "fedheal", "fedlf", "fednl", "fednl_pp", "fednew",
         "qffl", "afl", "term", "propfair", "fedmgda_plus", "fedfv", "fedfa", "mifa",
         "fedbuff", "fedasync", "fedmax", "fedmax_k", "fedsoftmax", "aaggff_s", "aaggff_d",
         "afedpd", "afedpd_sam", "fedpd", "fedadmm", "fedspeed", "fedsam", "fedcm",
         "superfed", "apfl", "pfedme", "fedper", "fedrep", "lg_fedavg", "fedavg_ft",
         "fedevg", "fedcvae"]


def _package_methods() -> list:
    return [n for n, m in REGISTRY.items()
            if m.factory.__module__.startswith(algorithms.__name__ + ".")]


# ------------------------------------------------------------------------------ order


def test_the_registry_keeps_its_order():
    """Today's methods, literally in today's order (fedlf imports fedmgda, and yet
    fedmgda_plus keeps its place after propfair); a method added to the package later
    comes after them, so this list needs no edit for it."""
    assert list(REGISTRY)[:len(TODAY)] == TODAY
    assert list(ALGORITHMS) == list(REGISTRY)
    assert all(ALGORITHMS[n] is m.factory for n, m in REGISTRY.items())
    assert _package_methods()[:len(TODAY)] == TODAY


def test_discovery_finds_every_module_and_orders_the_known_ones():
    modules = algorithms._discover()
    assert list(algorithms.ORDER) == modules[:len(algorithms.ORDER)]
    assert "registry" not in modules and "families" not in modules
    files = sorted(p.stem for p in PACKAGE.glob("*.py")
                   if p.stem not in ("__init__", "registry") and not p.stem.startswith("_"))
    assert sorted(modules) == files


def test_every_factory_is_exported_under_its_name():
    for name, method in REGISTRY.items():
        if method.factory.__module__.startswith(algorithms.__name__ + "."):
            assert getattr(algorithms, method.factory.__name__) is method.factory, name
            assert method.factory.__name__ in algorithms.__all__, name
            # as the registry exported them when it imported every method
            assert getattr(registry, method.factory.__name__) is method.factory, name
    from fedjax_fair.algorithms import fedavg, fedmgda_plus, scaffold
    assert all(map(inspect.isfunction, (fedavg, fedmgda_plus, scaffold)))
    from fedjax_fair.algorithms import aaggff  # a module whose name is no factory's
    assert inspect.ismodule(aaggff)


# ------------------------------------------------------------------------ the modules


def _module_tree(name: str) -> ast.Module:
    return ast.parse((PACKAGE / f"{name}.py").read_text("utf-8"))


def _is_register_call(node) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name) and node.value.func.id == "register")


@pytest.mark.parametrize("module", algorithms._discover())
def test_every_method_module_ends_with_its_register_calls(module):
    body = _module_tree(module).body
    tail = []
    for node in reversed(body):
        if not _is_register_call(node):
            break
        tail.append(node)
    assert tail, f"{module}.py does not end with register(...)"
    assert sum(_is_register_call(n) for n in body) == len(tail), \
        f"{module}.py registers methods before its end"
    names = [n.value.args[0].value for n in reversed(tail)]
    for name in names:  # the module registers the factories it defines
        assert REGISTRY[name].factory.__module__ == f"{algorithms.__name__}.{module}", name


def test_the_registry_imports_no_method_module():
    imported = set()
    for node in ast.walk(ast.parse((PACKAGE / "registry.py").read_text("utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert not [m for m in imported if m.startswith("fedjax_fair.algorithms")], imported


# ---------------------------------------------------------------- the declarations


def _keywords(factory) -> dict:
    return {p.name: p for p in inspect.signature(factory).parameters.values()
            if p.kind is p.KEYWORD_ONLY}


@pytest.mark.parametrize("name", list(REGISTRY))
def test_the_declarations_agree_with_the_factory(name):
    """``server_rate`` names a keyword argument (and every factory with a
    ``server_lr`` declares it), ``size_prior``'s arguments are the factory's and
    differ between True and False (every factory with ``weight_by_size`` declares
    one), ``seeded`` iff it takes ``seed``, ``clocked`` iff it takes ``clock`` (and
    then ``concurrency``)."""
    method = REGISTRY[name]
    keywords = _keywords(method.factory)
    assert method.family in FAMILIES and method.participation in ("partial", "full")
    assert set(method.training_fields) <= set(FIELDS)
    if method.server_rate is None:
        assert "server_lr" not in keywords, "server_lr is its server rate: declare it"
    else:
        assert method.server_rate in keywords, method.server_rate
    if method.size_prior is None:
        assert "weight_by_size" not in keywords, "declare its size_prior"
    else:
        by_size, uniform = method.size_prior(True), method.size_prior(False)
        assert set(by_size) == set(uniform) and set(by_size) <= set(keywords), by_size
        assert by_size != uniform
    assert method.seeded == ("seed" in keywords)
    assert method.clocked == ("clock" in keywords)
    if method.clocked:
        assert "concurrency" in keywords


@pytest.mark.parametrize("name", [n for n in TODAY if REGISTRY[n].size_prior is not None])
def test_the_size_prior_builds_the_method(name):
    """Both plain averages are accepted by the factory (no TypeError, no refusal)."""
    extra = {"shared_layers": ()} if name == "lg_fedavg" else {}
    for by_size in (True, False):
        build(name, helpers.logreg(), **REGISTRY[name].size_prior(by_size), **extra)


def test_the_declared_fields_that_differ_from_the_defaults():
    """The whole table, as the command line inferred it from parameter names before."""
    rate = {n for n, m in REGISTRY.items() if m.server_rate == "server_lr"}
    assert rate & set(TODAY) == {"fedavgm", "fedadam", "fedyogi", "fedadagrad", "scaffold",
                                 "dqn_fed", "fedheal", "fedlf", "fednl", "fednl_pp",
                                 "fednew", "fedmgda_plus", "fedbuff", "aaggff_s",
                                 "aaggff_d", "fedsam", "fedcm"}
    none = {n for n in TODAY if REGISTRY[n].size_prior is None}
    assert none == {"dqn_fed", "fedheal", "fedlf", "fednl", "fednl_pp", "fednew", "afl",
                    "fedfa", "mifa", "fedbuff", "fedasync", "fedmax", "fedmax_k",
                    "aaggff_s", "aaggff_d", "fedpd", "superfed", "fedevg", "fedcvae"}
    assert REGISTRY["fedmgda_plus"].size_prior(True) == {"center": "num_examples"}
    assert REGISTRY["fedmgda_plus"].size_prior(False) == {"center": "uniform"}
    assert all(REGISTRY[n].size_prior is WEIGHT_BY_SIZE
               for n in set(TODAY) - none - {"fedmgda_plus"})
    assert {n for n in TODAY if REGISTRY[n].seeded} == {"fedevg", "fedcvae"}
    assert {n for n in TODAY if REGISTRY[n].clocked} == {"fedbuff", "fedasync"}
    assert {n for n in TODAY if REGISTRY[n].note is not None} == {"fedasync"}


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_note_is_one_line_or_none(name):
    """``Method.note(cohort_size)``: None or one line, for every registered method at
    cohort sizes 1 and 10 (FedAsync: nothing at 1, its paper's algorithm; a line at 10)."""
    note = REGISTRY[name].note
    for k in (1, 10):
        line = note(k) if note is not None else None
        assert line is None or (isinstance(line, str) and line and "\n" not in line)
    if note is not None and name == "fedasync":
        assert note(1) is None and "10" in note(10)


# ------------------------------------------------------------------------ register


def _toy(model, *, gain: float = 1.0):
    return model


def _other(model, *, gain: float = 1.0):
    return model


def test_register_returns_the_entry_and_unregister_removes_it():
    with registry.isolated():
        method = register("toy_registered", _toy, {}, family="fair")
        assert method == Method(_toy, {}, family="fair", size_prior=WEIGHT_BY_SIZE)
        assert REGISTRY["toy_registered"] is method and ALGORITHMS["toy_registered"] is _toy
        assert list(REGISTRY)[-1] == "toy_registered"  # after the package's methods
        assert register("toy_registered", _toy, {}, family="fair") is method  # again: no-op
        assert unregister("toy_registered") is method
        assert "toy_registered" not in REGISTRY and "toy_registered" not in ALGORITHMS
        with pytest.raises(KeyError, match="toy_registered"):
            unregister("toy_registered")
    assert list(REGISTRY)[:len(TODAY)] == TODAY


def test_registering_a_name_twice_is_an_error_naming_it():
    with registry.isolated():
        register("toy_twice", _toy, {}, family="fair")
        with pytest.raises(ValueError, match="'toy_twice' is already registered.*_other"):
            register("toy_twice", _other, {}, family="fair")
        with pytest.raises(ValueError, match="'toy_twice' is already registered.*other fields"):
            register("toy_twice", _toy, {}, family="server")
        with pytest.raises(ValueError, match="'fedavg' is already registered"):
            register("fedavg", _toy, {}, family="reference")
        assert REGISTRY["toy_twice"].factory is _toy


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="a@b"), "letters, digits"),
    (dict(name="a.b"), "letters, digits"),
    (dict(family="nope"), "family must be one of"),
    (dict(participation="some"), "participation must be one of"),
    (dict(training_fields=("client_lr", "momentum")), "momentum"),
    (dict(server_rate=1.0), "server_rate"),
    (dict(size_prior="weight_by_size"), "size_prior"),
    (dict(note="buffered"), "note"),
    (dict(factory="not callable"), "factory must be callable"),
])
def test_register_refuses_a_bad_entry_naming_it(kwargs, match):
    args = {"name": "toy_bad", "factory": _toy, "hparams": {}, "family": "fair", **kwargs}
    with registry.isolated():
        with pytest.raises((TypeError, ValueError), match=match) as e:
            register(args.pop("name"), args.pop("factory"), args.pop("hparams"), **args)
        assert "register(" in str(e.value)
        assert "toy_bad" not in REGISTRY


def test_isolated_restores_the_registry():
    before = list(REGISTRY.items())
    with registry.isolated():
        register("toy_isolated", _toy, {}, family="fair")
        unregister("fedavg")
    assert list(REGISTRY.items()) == before
    assert list(ALGORITHMS) == [n for n, _ in before]


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_method_states_its_prior(name):
    """``prior_of``: "own" exactly for the methods without a size prior; else "size"
    or "uniform" as the factory's default says, the size prior's arguments switch it,
    and ``--mixing size / uniform`` decides."""
    from fedjax_fair.algorithms.registry import PRIORS, prior_of
    method = REGISTRY[name]
    assert prior_of(name) in PRIORS
    if method.size_prior is None:
        assert {prior_of(name, mixing=m) for m in ("default", "size", "uniform")} == {"own"}
        return
    assert prior_of(name, method.size_prior(True)) == "size"
    assert prior_of(name, method.size_prior(False)) == "uniform"
    assert prior_of(name, mixing="size") == "size"
    assert prior_of(name, mixing="uniform") == "uniform"
