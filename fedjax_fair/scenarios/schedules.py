"""Round-indexed schedules for learning rates (and any other decayed hyper-parameter).

A schedule is a function of the round t (``Broadcast.round`` on the clients, optax's
step count on the server, which counts one step per round). Any optax schedule is
one (``optax.exponential_decay(0.1, 1, 0.99)``). The command line's
``--client-lr-schedule`` / ``--server-lr-schedule`` take text:

* ``none``: constant;
* ``exponential:GAMMA``: rate_t = rate_0 * GAMMA^t (the computational-heterogeneity
  code's 0.99^t); ``exponential:GAMMA@S``: rate_0 * GAMMA^floor(t / S), a decay every
  S rounds (AAggFF's phi every s rounds, FedEvg's 0.9 every 50);
* ``step:FACTOR@R1,R2,...``: rate_t = rate_0 * FACTOR^(number of R_i <= t) (AAggFF's
  step decay, e.g. ``step:0.1@100,200``).

``fedjax_fair.cli.parsing.parse_schedule(text)`` checks the text (errors name the
field) and returns ``scale(rate_0) -> schedule`` or None for ``none``; rate_0 may be a
traced array.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair import hparams as H

KINDS = ("none", "exponential", "step")


def _concrete_positive(value, field: str) -> None:
    """A concrete number (Python / NumPy) is finite and > 0; a JAX array (possibly
    traced: vmap / grad over the rate) or a NumPy array of values (``hparams.Range``'s
    rule) passes unchecked."""
    if isinstance(value, jax.Array) or (isinstance(value, np.ndarray) and value.ndim > 0):
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.ndarray)):
        raise H.FieldError(field, f"must be a number > 0, got {value!r}")
    if not 0 < float(value) < math.inf:
        raise H.FieldError(field, f"must be a finite number > 0, got {value!r}")


def _whole(value, field: str, low: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral,)) \
            or value < low:
        raise H.FieldError(field, f"must be an integer >= {low}, got {value!r}")
    return int(value)


def exponential(rate, gamma: float, every: int = 1) -> Callable:
    """rate_t = rate * gamma^floor(t / every). ``rate`` > 0 (or a JAX array),
    ``gamma`` finite > 0 (< 1 decays), ``every`` >= 1 rounds; else ``FieldError``."""
    _concrete_positive(rate, "rate")
    _concrete_positive(gamma, "gamma")
    every = _whole(every, "every", 1)
    return lambda t: rate * jnp.power(gamma, (jnp.asarray(t) // every).astype(jnp.float32))


def step(rate, factor: float, boundaries) -> Callable:
    """rate_t = rate * factor^(number of boundaries <= t). ``rate`` > 0 (or a JAX
    array), ``factor`` finite > 0, ``boundaries`` rounds >= 0; else ``FieldError``."""
    _concrete_positive(rate, "rate")
    _concrete_positive(factor, "factor")
    bounds = [_whole(b, "boundaries", 0) for b in np.asarray(boundaries).reshape(-1).tolist()]
    bounds = jnp.asarray(sorted(bounds), jnp.int32)
    return lambda t: rate * jnp.power(factor, jnp.sum(bounds <= t).astype(jnp.float32))


def check_rates(schedule: Callable, num_rounds: int, field: str,
                positive: bool = False) -> None:
    """The rates of a monotone schedule (this module's, from a concrete rate) over rounds
    0 .. ``num_rounds`` - 1, i.e. at both ends, are finite and >= 0 (> 0 with
    ``positive``: a rate that is divided by) as the device computes them (float32);
    else ``FieldError(field)`` naming the round. A step factor > 1 can overflow
    float32, and a decay underflows to 0 (the clients stop moving)."""
    num_rounds = H.count(num_rounds, "num_rounds")
    for t in sorted({0, num_rounds - 1}):
        value = float(np.asarray(schedule(t)))
        if not math.isfinite(value) or value < 0 or (positive and value <= 0):
            raise H.FieldError(field, f"its rate reaches {value:g} in round {t} (float32); "
                                      f"every rate of the run must be finite and "
                                      f"{'> 0' if positive else '>= 0'}")


def compensated(server_rate, client_rate: Callable) -> Callable:
    """server_t = server_rate_t * client_rate(0) / client_rate(t): the server rate grows
    as the client rate decays, so eta_g * eta_l stays what it was in round 0 (AAggFF's
    reference code divides the server rate by phi at every client decay; the thesis
    is silent, so this is off by default). ``server_rate``: a number or a schedule."""
    server = server_rate if callable(server_rate) else (lambda t: server_rate)
    return lambda t: server(t) * client_rate(0) / client_rate(t)
