"""The methods: one module per paper (its factory, the paper's symbols mapped to its
arguments, and at its end the ``register`` call(s) that name it), family pieces in
``families``, and the registry (``registry``) that the command line, sweeps and tests
read: ``REGISTRY``, ``ALGORITHMS``, ``get_method``, ``method_hparams``.

Importing this package imports every module of it (all but ``registry``,
``families`` and private ``_*`` modules), so every method registers itself; each
registered factory is then exported here under its function's name
(``from fedjax_fair.algorithms import fedavg, scaffold``). A method added to the
package is one new module ending in its ``register`` call; a method defined outside
it registers the same way (``registry.load_plugins``).

Every factory takes the model first and states its hyper-parameters as typed keyword
arguments with defaults (no ``**kwargs``); the clients' local training is one of them,
``training: ClientTraining`` (``fedavg(model, training=ClientTraining(lr=0.05))``).
"""
import importlib as _importlib
import pkgutil as _pkgutil

from fedjax_fair.core.client import ClientTraining
from fedjax_fair.algorithms import registry
from fedjax_fair.algorithms.registry import (ALGORITHMS, FAMILIES, REGISTRY, HParam, Method,
                                             base_name, build, default_training,
                                             get_algorithm, get_method, method_hparams,
                                             register)

ORDER = ("fedavg", "fedprox", "fedopt", "scaffold", "feddyn", "ditto", "dqn_fed", "fedheal",
         "fedlf", "fednl", "fednew", "qffl", "afl", "term", "propfair", "fedmgda", "fedfv",
         "fedfa", "mifa", "fedbuff", "fedmax", "aaggff", "afedpd", "fedpd", "fedadmm",
         "fedspeed", "fedsam", "fedcm", "superfed", "apfl", "pfedme", "fedrep", "lg_fedavg",
         "finetune", "fedevg", "fedcvae")
"""The modules whose methods come first in ``REGISTRY``, in this order (the order
``fedjax-fair list`` shows and ``compare`` runs them); any other module's methods
follow, by module name. A new method needs no entry here."""

_SKIPPED = ("registry", "families")


def _discover() -> list:
    """Every method module of the package, in ``ORDER`` then by name."""
    found = [m.name for m in _pkgutil.iter_modules(__path__)
             if m.name not in _SKIPPED and not m.name.startswith("_")]
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(found, key=lambda name: (rank.get(name, len(rank)), name))


_MODULES = [f"{__name__}.{name}" for name in _discover()]
for _module in _MODULES:
    _importlib.import_module(_module)
registry._arrange(_MODULES)  # a module imported early by another keeps its place

_FACTORIES = {}
for _method in dict.values(REGISTRY):  # the package's own methods (no entry point yet)
    _FACTORIES[_method.factory.__name__] = _method.factory
globals().update(_FACTORIES)  # after the imports: the factory fedavg, not the module

__all__ = ["ALGORITHMS", "ClientTraining", "FAMILIES", "HParam", "Method", "REGISTRY", "base_name",
           "build", "default_training", "get_algorithm", "get_method", "method_hparams",
           "register"]
__all__ += sorted(_FACTORIES)  # the factories of the methods registered above
del _module, _method
