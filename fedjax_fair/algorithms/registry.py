"""The registry of methods: ``REGISTRY`` holds one ``Method`` entry per CLI name.

Every factory takes the model first and states its hyper-parameters as typed
keyword arguments with defaults (no ``**kwargs``). The registry entry adds what a
command line needs and a signature cannot say: the valid range of each numeric
hyper-parameter (which also marks it continuous — traceable, vmappable and
differentiable — or static), and whether the method needs every client every round.
``method_hparams(name)`` joins the two. A factory's local training is one value,
``training: ClientTraining``; ``method_hparams`` lists its fields under their flat
names (``client_lr``, ``batch_size``, ...: ``core.client.FIELDS``) with the factory's
own defaults, and ``build(name, model, **values)`` folds such names into ``training``,
so the command line and sweeps pass only the values they were given.
"""
from __future__ import annotations

import inspect
import re
from typing import Callable, NamedTuple, Optional

from fedjax_fair.algorithms import aaggff as _aaggff
from fedjax_fair.algorithms import afedpd as _afedpd
from fedjax_fair.algorithms import afl as _afl
from fedjax_fair.algorithms import apfl as _apfl
from fedjax_fair.algorithms import ditto as _ditto
from fedjax_fair.algorithms import dqn_fed as _dqn_fed
from fedjax_fair.algorithms import fedadmm as _fedadmm
from fedjax_fair.algorithms import fedavg as _fedavg
from fedjax_fair.algorithms import fedcm as _fedcm
from fedjax_fair.algorithms import fedcvae as _fedcvae
from fedjax_fair.algorithms import fedevg as _fedevg
from fedjax_fair.algorithms import fedfa as _fedfa
from fedjax_fair.algorithms import fedfv as _fedfv
from fedjax_fair.algorithms import fedheal as _fedheal
from fedjax_fair.algorithms import fedlf as _fedlf
from fedjax_fair.algorithms import feddyn as _feddyn
from fedjax_fair.algorithms import fedmax as _fedmax
from fedjax_fair.algorithms import fedmgda as _fedmgda
from fedjax_fair.algorithms import fednew as _fednew
from fedjax_fair.algorithms import fednl as _fednl
from fedjax_fair.algorithms import fedopt as _fedopt
from fedjax_fair.algorithms import fedpd as _fedpd
from fedjax_fair.algorithms import fedprox as _fedprox
from fedjax_fair.algorithms import fedrep as _fedrep
from fedjax_fair.algorithms import finetune as _finetune
from fedjax_fair.algorithms import lg_fedavg as _lg_fedavg
from fedjax_fair.algorithms import mifa as _mifa
from fedjax_fair.algorithms import fedbuff as _fedbuff
from fedjax_fair.algorithms import pfedme as _pfedme
from fedjax_fair.algorithms import propfair as _propfair
from fedjax_fair.algorithms import qffl as _qffl
from fedjax_fair.algorithms import fedsam as _fedsam
from fedjax_fair.algorithms import scaffold as _scaffold
from fedjax_fair.algorithms import superfed as _superfed
from fedjax_fair.algorithms import fedspeed as _fedspeed
from fedjax_fair.algorithms import term as _term
from fedjax_fair.algorithms.aaggff import aaggff_d, aaggff_s
from fedjax_fair.algorithms.afedpd import afedpd, afedpd_sam
from fedjax_fair.algorithms.afl import afl
from fedjax_fair.algorithms.apfl import apfl
from fedjax_fair.algorithms.ditto import ditto
from fedjax_fair.algorithms.dqn_fed import dqn_fed
from fedjax_fair.algorithms.fedadmm import fedadmm
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.algorithms.fedcm import fedcm
from fedjax_fair.algorithms.fedcvae import fedcvae
from fedjax_fair.algorithms.fedevg import fedevg
from fedjax_fair.algorithms.fedfa import fedfa
from fedjax_fair.algorithms.fedfv import fedfv
from fedjax_fair.algorithms.fedheal import fedheal
from fedjax_fair.algorithms.fedlf import fedlf
from fedjax_fair.algorithms.feddyn import feddyn
from fedjax_fair.algorithms.fedmax import fedmax, fedmax_k, fedsoftmax
from fedjax_fair.algorithms.fedmgda import fedmgda_plus
from fedjax_fair.algorithms.fednew import fednew
from fedjax_fair.algorithms.fednl import fednl, fednl_pp
from fedjax_fair.algorithms.fedopt import fedadagrad, fedadam, fedavgm, fedyogi
from fedjax_fair.algorithms.fedpd import fedpd
from fedjax_fair.algorithms.fedprox import fedprox
from fedjax_fair.algorithms.fedrep import fedper, fedrep
from fedjax_fair.algorithms.finetune import fedavg_ft
from fedjax_fair.algorithms.lg_fedavg import lg_fedavg
from fedjax_fair.algorithms.mifa import mifa
from fedjax_fair.algorithms.fedbuff import fedasync, fedbuff
from fedjax_fair.algorithms.pfedme import pfedme
from fedjax_fair.algorithms.fedsam import fedsam
from fedjax_fair.algorithms.fedspeed import fedspeed
from fedjax_fair.algorithms.propfair import propfair
from fedjax_fair.algorithms.qffl import qffl
from fedjax_fair.algorithms.scaffold import scaffold
from fedjax_fair.algorithms.superfed import superfed
from fedjax_fair.algorithms.term import term
from fedjax_fair.core.algorithm import derive
from fedjax_fair.core.client import FIELDS, TRAINING_RANGES, ClientTraining
from fedjax_fair.hparams import FieldError, Range
from fedjax_fair.algorithms.families.generative import downstream_line, downstream_report


class Method(NamedTuple):
    """A registry entry: the factory, the ranges of its numeric hyper-parameters, the
    participation it needs ("partial": any cohort; "full": every client every round,
    sampler ``full``), an optional end-of-run ``report(model, algorithm, state,
    test_split) -> dict`` of the method's own numbers (SuPerFed's lambda grid), which
    the CLI writes under "method_report" in summary.json, and whether the method is
    ``generative``: its product is a synthetic data set (``fedjax_fair.algorithms.families.generative``;
    ``state.params`` is a classifier trained on it). A ``compare`` without
    ``--algorithms`` leaves generative methods out. ``report_line(report) -> str``: the
    one line ``run`` prints of that report (the method's own wording, so the command
    line names no method). ``family``: the group ``compare`` shows it in (``FAMILIES``)."""

    factory: Callable
    hparams: dict
    participation: str = "partial"
    report: Optional[Callable] = None
    generative: bool = False
    report_line: Optional[Callable] = None
    training_fields: tuple = tuple(FIELDS)  # the ClientTraining fields it honours (flat)
    family: str = "reference"  # a key of FAMILIES: how compare groups its table and plots


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


REGISTRY = {
    "fedavg": Method(fedavg, _fedavg.HPARAMS, family="reference"),
    "fedprox": Method(fedprox, _fedprox.HPARAMS, family="primal_dual"),
    "fedavgm": Method(fedavgm, _fedopt.HPARAMS, family="server"),
    "fedadam": Method(fedadam, _fedopt.HPARAMS, family="server"),
    "fedyogi": Method(fedyogi, _fedopt.HPARAMS, family="server"),
    "fedadagrad": Method(fedadagrad, _fedopt.HPARAMS, family="server"),
    "scaffold": Method(scaffold, _scaffold.HPARAMS, family="primal_dual"),
    "feddyn": Method(feddyn, _feddyn.HPARAMS, family="primal_dual"),
    "ditto": Method(ditto, _ditto.HPARAMS, family="personalised"),
    "dqn_fed": Method(dqn_fed, _dqn_fed.HPARAMS, family="fair"),
    "fedheal": Method(fedheal, _fedheal.HPARAMS, family="fair"),
    "fedlf": Method(fedlf, _fedlf.HPARAMS, family="fair"),
    "fednl": Method(fednl, _fednl.HPARAMS, family="second_order"),
    "fednl_pp": Method(fednl_pp, _fednl.HPARAMS, family="second_order"),
    "fednew": Method(fednew, _fednew.HPARAMS, family="second_order"),
    "qffl": Method(qffl, _qffl.HPARAMS, family="fair"),
    "afl": Method(afl, _afl.HPARAMS, family="fair"),
    "term": Method(term, _term.HPARAMS, family="fair"),
    "propfair": Method(propfair, _propfair.HPARAMS, family="fair"),
    "fedmgda_plus": Method(fedmgda_plus, _fedmgda.HPARAMS, family="fair"),
    "fedfv": Method(fedfv, _fedfv.HPARAMS, family="fair"),
    "fedfa": Method(fedfa, _fedfa.HPARAMS, family="fair"),
    "mifa": Method(mifa, _mifa.HPARAMS, family="participation"),
    "fedbuff": Method(fedbuff, _fedbuff.HPARAMS, family="participation"),
    "fedasync": Method(fedasync, _fedbuff.HPARAMS, family="participation"),
    "fedmax": Method(fedmax, _fedmax.HPARAMS, family="fair"),
    "fedmax_k": Method(fedmax_k, _fedmax.HPARAMS, family="fair"),
    "fedsoftmax": Method(fedsoftmax, _fedmax.HPARAMS, family="fair"),
    "aaggff_s": Method(aaggff_s, _aaggff.HPARAMS, participation="full", family="fair"),
    "aaggff_d": Method(aaggff_d, _aaggff.HPARAMS, family="fair"),
    "afedpd": Method(afedpd, _afedpd.HPARAMS, family="primal_dual"),
    "afedpd_sam": Method(afedpd_sam, _afedpd.SAM_VARIANT_HPARAMS, family="primal_dual"),
    "fedpd": Method(fedpd, _fedpd.HPARAMS, participation="full", family="primal_dual"),
    "fedadmm": Method(fedadmm, _fedadmm.HPARAMS, family="primal_dual"),
    "fedspeed": Method(fedspeed, _fedspeed.HPARAMS, family="primal_dual"),
    "fedsam": Method(fedsam, _fedsam.HPARAMS, family="primal_dual"),
    "fedcm": Method(fedcm, _fedcm.HPARAMS, family="primal_dual"),
    "superfed": Method(superfed, _superfed.HPARAMS, report=_superfed.lambda_report,
                       report_line=_superfed.lambda_line, family="personalised"),
    "apfl": Method(apfl, _apfl.HPARAMS, training_fields=_apfl.TRAINING_FIELDS,
                   family="personalised"),
    "pfedme": Method(pfedme, _pfedme.HPARAMS, training_fields=_pfedme.TRAINING_FIELDS,
                     family="personalised"),
    "fedper": Method(fedper, _fedrep.FEDPER_HPARAMS, family="personalised"),
    "fedrep": Method(fedrep, _fedrep.HPARAMS, family="personalised"),
    "lg_fedavg": Method(lg_fedavg, _lg_fedavg.HPARAMS, family="personalised"),
    "fedavg_ft": Method(fedavg_ft, _finetune.HPARAMS, family="personalised"),
    "fedevg": Method(fedevg, _fedevg.HPARAMS, report=downstream_report, generative=True,
                     report_line=downstream_line, training_fields=_fedevg.TRAINING_FIELDS,
                     family="generative"),
    "fedcvae": Method(fedcvae, _fedcvae.HPARAMS, report=downstream_report, generative=True,
                      report_line=downstream_line, family="generative"),
}

ALGORITHMS = {name: m.factory for name, m in REGISTRY.items()}
"""CLI name -> factory."""


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


__all__ = ["ALGORITHMS", "FAMILIES", "HParam", "Method", "REGISTRY", "base_name", "build", "default_training", "get_method", "aaggff_d", "aaggff_s", "afedpd",
           "afedpd_sam", "afl", "apfl", "fedadmm", "fedavg_ft", "fedcm", "fedcvae", "fedevg", "fedpd", "fedper", "fedrep",
           "fedsam", "fedspeed", "lg_fedavg", "pfedme", "superfed",
           "ditto", "dqn_fed", "fedadagrad", "fedadam", "fedavg", "fedavgm", "feddyn", "fedfa", "fedfv", "fedheal", "fedlf", "fedmax",
           "fedmax_k", "fedmgda_plus", "fednew", "fednl", "fednl_pp", "fedprox", "fedsoftmax", "fedyogi", "get_algorithm",
           "method_hparams", "mifa", "propfair", "qffl", "scaffold", "term", "fedbuff",
           "fedasync"]
