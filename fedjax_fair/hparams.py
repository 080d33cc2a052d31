"""Hyper-parameter ranges: stated once per method, checked outside traced code.

Every algorithm module declares ``HPARAMS = {name: Range(...)}`` for the arguments
of its factory that take numbers. The same table serves two callers:

* the factory itself (a Python-facing builder) calls ``check(HPARAMS, q=q, ...)``,
  which validates concrete Python / NumPy numbers and lets JAX arrays through
  unchecked, so ``jax.vmap`` / ``jax.grad`` over a continuous hyper-parameter (whose
  value is then a tracer) never meets a Python comparison;
* the config layer (``fedjax_fair.cli.config``) checks command-line and YAML values
  against the same ranges before any data is built, and ``fedjax-fair list`` prints
  them.

``Range.continuous`` marks the arguments a whole run is differentiable in and can be
vmapped over (learning rates, q, tilt, temperature, ...); integer counts and
categorical choices are static. ``probability`` checks the Python-level fractions of
the data and heterogeneity settings, ``count`` the integer counts of the runner, the
sweeps, the data builders and the device mesh.

Every failure is a ``FieldError`` (a ``ValueError``; ``FieldTypeError`` for a value
of the wrong type is also a ``TypeError``) that carries its ``field``, with the
message ``"field: what is wrong"``; the command line reports it as it is (its
``ConfigError`` is a ``FieldError``).
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional

import jax
import numpy as np


class FieldError(ValueError):
    """A bad value of a named field (an argument, an option, a configuration key):
    ``str(e)`` is ``"<field>: <what is wrong>"``; ``e.field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class FieldTypeError(FieldError, TypeError):
    """A ``FieldError`` for a value of the wrong type (caught as either)."""


def count(value, field: str, minimum: int = 1) -> int:
    """A Python / NumPy integer >= ``minimum`` as an int: booleans, floats and other
    types raise ``FieldTypeError``, a smaller value ``FieldError``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise FieldTypeError(field, f"must be an integer >= {minimum}, got "
                                    f"{type(value).__name__} {value!r}")
    if value < minimum:
        raise FieldError(field, f"must be an integer >= {minimum}, got {value}")
    return int(value)


class Range(NamedTuple):
    """Allowed values of one numeric hyper-parameter.

    low / high: bounds (None: unbounded); low_open / high_open: exclude the bound.
    integer: a count (static; never traced). static: a real number used in Python
    (e.g. a fraction that picks a count); never traced. Any other Range is
    ``continuous``: the value may be a traced array (vmap / grad). nullable: None is
    allowed (a documented default derived from other arguments).
    """

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    nullable: bool = False
    static: bool = False

    @property
    def continuous(self) -> bool:
        """A real number the run may be vmapped over and differentiated in."""
        return not (self.integer or self.static)

    def describe(self) -> str:
        if self.integer:
            lo = "-inf" if self.low is None else str(int(self.low) + int(self.low_open))
            hi = "inf" if self.high is None else str(int(self.high) - int(self.high_open))
            text = f"integer {lo}..{hi}"
        else:
            lo = "-inf" if self.low is None else f"{self.low:g}"
            hi = "inf" if self.high is None else f"{self.high:g}"
            text = (("(" if self.low_open or self.low is None else "[") + f"{lo}, {hi}"
                    + (")" if self.high_open or self.high is None else "]"))
        return text + (" or None" if self.nullable else "")

    def contains(self, value) -> bool:
        """Whether ``value`` is in the range; a real (non-integer) value must be in it
        also as the float32 the computation will use (1e-50 is positive, but 0 in
        float32; 1e39 is finite, but inf), its bounds rounded alike."""
        if self.integer and not float(value).is_integer():
            return False
        if not self._within(value):
            return False
        if not self.integer:
            with np.errstate(over="ignore", under="ignore"):
                low, high, v = (None if b is None else float(np.float32(b))
                                for b in (self.low, self.high, value))
            return self._replace(low=low, high=high)._within(v)
        return True

    def _within(self, value) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        if self.high is not None and (value > self.high
                                      or (self.high_open and value == self.high)):
            return False
        return True

    def check(self, name: str, value):
        """``value`` if allowed; JAX arrays (tracers included) pass unchecked."""
        if value is None and self.nullable:
            return value
        if isinstance(value, jax.Array):
            return value
        if isinstance(value, np.ndarray) and value.ndim > 0:
            return value  # a grid of values for a sweep: each is checked by its caller
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real,
                                                                         np.ndarray)):
            raise FieldError(name, f"must be {'an integer' if self.integer else 'a number'}"
                                   f" in {self.describe()}, got {value!r}")
        if not self.contains(float(value)):
            single = ""
            if not self.integer and self._within(float(value)):  # not as a float32
                with np.errstate(over="ignore", under="ignore"):
                    single = (f" ({float(np.float32(value))!r} in float32, the "
                              f"computation's precision)")
            raise FieldError(name, f"must be in {self.describe()}, got {value!r}{single}")
        return value


POSITIVE = Range(0.0, None, low_open=True)
NONNEGATIVE = Range(0.0, None)
REAL = Range()
COUNT = Range(1, None, integer=True)


def check(ranges: dict, **values) -> None:
    """Checks every ``name=value`` whose name has a Range in ``ranges``."""
    for name, value in values.items():
        ranges[name].check(name, value)


def is_concrete(value) -> bool:
    """True for Python / NumPy numbers; False for JAX arrays (possibly traced)."""
    return not isinstance(value, jax.Array)


def probability(value, field: str) -> float:
    """``value`` as a float in [0, 1] (booleans refused), else ``ValueError("field: ...")``
    (for Python-level settings: augmentation, label-noise and straggler fractions)."""
    if isinstance(value, bool):
        raise FieldError(field, f"must be a number in [0, 1], got {value!r}")
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise FieldError(field, f"must be a number in [0, 1], got {value!r}") from None
    if not 0.0 <= value <= 1.0:
        raise FieldError(field, f"must lie in [0, 1], got {value}")
    return value
