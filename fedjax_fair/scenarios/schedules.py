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

from typing import Callable

import jax.numpy as jnp

KINDS = ("none", "exponential", "step")


def exponential(rate, gamma: float, every: int = 1) -> Callable:
    """rate_t = rate * gamma^floor(t / every)."""
    return lambda t: rate * jnp.power(gamma, (jnp.asarray(t) // every).astype(jnp.float32))


def step(rate, factor: float, boundaries) -> Callable:
    """rate_t = rate * factor^(number of boundaries <= t)."""
    bounds = jnp.asarray(sorted(boundaries), jnp.int32)
    return lambda t: rate * jnp.power(factor, jnp.sum(bounds <= t).astype(jnp.float32))


def compensated(server_rate, client_rate: Callable) -> Callable:
    """server_t = server_rate_t * client_rate(0) / client_rate(t): the server rate grows
    as the client rate decays, so eta_g * eta_l stays what it was in round 0 (AAggFF's
    reference code divides the server rate by phi at every client decay; the thesis
    is silent, so this is off by default). ``server_rate``: a number or a schedule."""
    server = server_rate if callable(server_rate) else (lambda t: server_rate)
    return lambda t: server(t) * client_rate(0) / client_rate(t)
