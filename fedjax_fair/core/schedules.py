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

``parse(text)`` checks the text (errors name the field) and returns ``scale(rate_0)
-> schedule`` or None for ``none``; rate_0 may be a traced array.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax.numpy as jnp
from fedjax_fair import hparams as H

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


def parse(text: str, field: str = "schedule") -> Optional[Callable]:
    """``none`` -> None; else ``rate_0 -> schedule`` (see the module doc)."""
    text = str(text).strip()
    kind, _, arg = text.partition(":")
    if kind == "none" and not arg:
        return None
    try:
        if kind == "exponential":
            gamma, at, every = arg.partition("@")
            gamma, every = float(gamma), int(every) if at else 1
            if not 0 < gamma <= 1 or every < 1:
                raise ValueError
            return lambda rate: exponential(rate, gamma, every)
        if kind == "step":
            factor, at, rounds = arg.partition("@")
            factor = float(factor)
            bounds = [int(r) for r in rounds.split(",") if r.strip()]
            if not at or not bounds or factor <= 0 or min(bounds) < 1:
                raise ValueError
            return lambda rate: step(rate, factor, bounds)
    except ValueError:
        pass
    raise H.FieldError(field, f"expected none, exponential:GAMMA[@EVERY] (0 < GAMMA <= 1, "
                              f"EVERY >= 1 rounds) or step:FACTOR@R1,R2,... (FACTOR > 0, rounds >= "
                              f"1), "
                              f"got {text!r}")
