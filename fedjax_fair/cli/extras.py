"""Options that need an optional package (an extra of pyproject.toml's
``[project.optional-dependencies]``): refused before anything is built when it is not
installed.

``EXTRAS`` is the table: per option (its config field, as ``cli.options`` declares
it), the module it imports, the package and the extra that install it, and which of
its values need it. ``check(cfg)`` (called by ``config._validate_common``, before any
data is built or any program compiled) looks each needed module up with
``importlib.util.find_spec`` (``tracking._installed``: nothing is imported) and
refuses a missing one with one line ``<field>: ... pip install "fedjax-fair[EXTRA]"``.
Without it, ``--dp-noise`` computed every round and then died writing its outputs
(the privacy spent is accounted for at the end), and ``--dp-epsilon`` died calibrating
its noise, each with a traceback.

The trackers (``--tracker``, the extra ``tracking``) are checked the same way by
``drivers.tracking.check_trackers`` (``config.check_trackers``, just before), which
knows each tracker's package; they are not repeated here. The TFDS datasets need
``tensorflow-datasets``, a dependency of the package, not an extra.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

from fedjax_fair.cli import options as O


class Extra(NamedTuple):
    """An option that imports an optional package when ``needs(value)``."""

    field: str  # the option's config field (cli.options)
    module: str  # what it imports
    package: str  # the distribution that provides it
    extra: str  # pyproject.toml's optional-dependencies key that installs it
    purpose: str  # what the module does for the option
    needs: Callable[[Any], bool] = lambda value: value is not None


EXTRAS = (
    Extra("dp_noise", "dp_accounting", "dp-accounting", "privacy",
          "the privacy accounting (the epsilon spent, reported with the results)"),
    Extra("dp_epsilon", "dp_accounting", "dp-accounting", "privacy",
          "calibrating the noise multiplier to the epsilon"),
)
"""Every option that needs an optional package (the trackers aside: see above)."""


def install_line(extra: str) -> str:
    return f'pip install "fedjax-fair[{extra}]" (in a checkout: pip install -e ".[{extra}]")'


def missing(cfg) -> list:
    """The ``Extra`` entries whose option ``cfg`` sets to a value that needs a package
    that is not installed."""
    from fedjax_fair.drivers.tracking import _installed
    return [e for e in EXTRAS if e.field in O.BY_NAME and hasattr(cfg, e.field)
            and e.needs(getattr(cfg, e.field)) and not _installed(e.module)]


def check(cfg) -> None:
    """``ConfigError`` naming the first option whose optional package is missing."""
    for e in missing(cfg):
        raise O.ConfigError(e.field, f"{getattr(cfg, e.field)!r} needs the optional package "
                                     f"{e.package} ({e.module}) for {e.purpose}, and it is "
                                     f"not installed: {install_line(e.extra)}")
