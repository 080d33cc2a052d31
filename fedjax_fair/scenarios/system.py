"""Participation and system heterogeneity: who can be sampled, who reports, and how
long a round takes on a virtual clock.

A ``System`` adds three independent pieces to ``simulate``'s rounds (``system=``);
each is a pure function of (the run's key, the round, the client), so runs stay
deterministic, resumable and ``jax.vmap``-able over seeds:

* **availability** (applied before the sampler): which of the N clients can be
  sampled this round. ``always``; ``independent(p)`` (a probability for every client
  or one per client, e.g. from ``from_property`` to bias participation on purpose by
  data size, label share or device class); ``periodic(period, on_fraction)``
  (diurnal, each client with its own phase); ``markov(p_off, p_on)`` (a two-state
  on/off chain per client); ``trace(table)`` (a recorded availability table
  [rounds, N], replayed cyclically). The sampler then draws the cohort among the
  available clients; a round with fewer available clients than the cohort samples
  what is there, and the other cohort slots are masked (``Cohort.client_mask``).
* **dropout** (connectivity, after selection): each selected client fails to report
  with its probability (one for all, or per client, e.g. tied to its speed with
  ``from_property``).
* **clock** (responsiveness and completeness): each client's compute speed (local
  steps per second) and communication time (model bytes down and up over its
  bandwidth, plus latency). Client k's time is
  t_k = latency_k + 2 * bytes / bandwidth_k + steps_k / speed_k, with steps_k its
  local steps this round (``min(budget, E * ceil(n_k / B), max_steps)`` of
  ``clock.training``). A synchronous round lasts until its last reporting client;
  with a ``deadline`` D, a client whose t_k > D is dropped (``late="drop"``) or
  contributes the steps it finished in time, floor((D - comm_k) * speed_k)
  (``late="partial"``: its step budget comes from the clock, which is how the
  computational-heterogeneity paper's step budgets, arXiv:2307.06283, meet a clock),
  and a round in which a selected client did not report in time lasts D.

The aggregation sees who reported through the cohort mask: masked clients get zero
weight and methods with per-client state leave their rows as they were. Each round
logs ``system/available`` (clients that could be sampled), ``system/reported`` (the
cohort's clients that reported) and, with a clock, ``system/round_seconds`` and the
per-client ``system/client_seconds`` [K]; the runner adds the cumulative simulated
time ``clock_seconds`` to every evaluation.

The Markov chain is evaluated without carrying state from round to round: with
q = p_off + p_on <= 1, the chain equals "each round, with probability q, draw the
client's state afresh from the stationary law (on with probability p_on / q);
otherwise keep it". The state at round r is therefore the draw made at the last
refresh round tau <= r (round 0 always refreshes), found by looking back over
fixed blocks of refresh indicators, each a pure function of (key, block, client).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair import hparams as H
from fedjax_fair.scenarios import sampling
from fedjax_fair.core.client import ClientTraining, steps_per_epoch

SYSTEM_KEY_ID = 2 ** 31 - 2  # the system's fold_in id of the run key (below the server's)
_AVAILABILITY, _DROPOUT = 0, 1
LATE = ("drop", "partial")


# ------------------------------------------------------------------ per-client values


def _per_client(values, field: str, check: Callable = None) -> tuple:
    """A number or a 1-D array-like as a tuple of floats (hashable: two systems with
    equal values are equal, so runs share their compiled programs)."""
    a = np.asarray(values, np.float64)
    if a.ndim > 1 or a.size == 0:
        raise H.FieldError(field, f"must be a number or a 1-D array with one value per "
                                  f"client, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise H.FieldError(field, "must be finite")
    if check is not None:
        check(a)
    return tuple(float(v) for v in a.reshape(-1))


def _probabilities(values, field: str) -> tuple:
    def check(a):
        if np.any((a < 0) | (a > 1)):
            raise H.FieldError(field, f"probabilities must lie in [0, 1], got values in "
                                      f"[{a.min():g}, {a.max():g}]")
    return _per_client(values, field, check)


def _positive(values, field: str) -> tuple:
    def check(a):
        if np.any(a <= 0):
            raise H.FieldError(field, f"must be > 0, got a minimum of {a.min():g}")
    return _per_client(values, field, check)


def _nonnegative(values, field: str) -> tuple:
    def check(a):
        if np.any(a < 0):
            raise H.FieldError(field, f"must be >= 0, got a minimum of {a.min():g}")
    return _per_client(values, field, check)


def _array(values: tuple, num_clients: int):
    """float32 [N] of a stored per-client value (one number: every client)."""
    a = jnp.asarray(values, jnp.float32)
    return jnp.broadcast_to(a, (num_clients,)) if a.shape == (1,) else a


def _check_length(values: tuple, field: str, num_clients: int) -> None:
    if len(values) not in (1, num_clients):
        raise H.FieldError(field, f"has {len(values)} values; needs one, or one per client "
                                  f"({num_clients})")


def from_property(values, low: float, high: float) -> np.ndarray:
    """Per-client probabilities (or any per-client value) mapped linearly from a client
    property: the smallest value gets ``low``, the largest ``high`` (``low > high``
    reverses the order), e.g. availability rising with data size,
    ``from_property(num_examples, 0.1, 0.9)``, or dropout falling with speed,
    ``from_property(speed, 0.5, 0.0)``. A constant property gives the midpoint."""
    v = np.asarray(values, np.float64)
    if v.ndim != 1 or v.size == 0 or not np.all(np.isfinite(v)):
        raise H.FieldError("values", "must be a non-empty 1-D array of finite numbers")
    span = v.max() - v.min()
    t = (v - v.min()) / span if span > 0 else np.full(v.shape, 0.5)
    return low + t * (high - low)


def label_share(train, labels) -> np.ndarray:
    """The share of each client's training examples whose label is in ``labels``
    ([N]; 0 for a client without examples): a property to tie availability to a
    client's label distribution (``from_property(label_share(train, [0, 1]), ...)``)."""
    from fedjax_fair.core.generated import client_blocks, is_generated
    if is_generated(train):  # computed a block of clients at a time
        return np.concatenate([label_share(rows, labels) for _, rows in client_blocks(train)])
    y = np.asarray(train.examples["y"])
    mask = np.asarray(train.mask)
    hit = np.isin(y, np.asarray(labels)) & mask
    n = mask.sum(axis=1)
    return np.where(n > 0, hit.sum(axis=1) / np.maximum(n, 1), 0.0)


SHARES_TOLERANCE = 1e-9


def check_shares(shares, field: str = "shares") -> None:
    """Class shares are the probabilities of the classes: they sum to 1 (within
    ``SHARES_TOLERANCE``), not renormalised behind the caller's back."""
    total = float(np.sum(np.asarray(shares, np.float64)))
    if not abs(total - 1.0) <= SHARES_TOLERANCE:
        raise H.FieldError(field, f"the class shares sum to {total:.10g}; they are the "
                                  f"shares of the clients in each class and must sum to 1")


def device_classes(num_clients: int, shares, values, seed: int = 0) -> np.ndarray:
    """Per-client values of ``device classes``: client k belongs to class c with
    probability ``shares[c]`` (drawn once with ``seed``; the shares sum to 1) and gets
    ``values[c]`` (a speed, a bandwidth, an availability probability)."""
    num_clients = H.count(num_clients, "num_clients")
    shares = np.asarray(shares, np.float64)
    values = np.asarray(values, np.float64)
    if shares.ndim != 1 or shares.shape != values.shape or not np.all(np.isfinite(shares)) \
            or np.any(shares < 0) or not shares.sum() > 0:
        raise H.FieldError("shares", "must be non-negative, not all zero, one per value")
    check_shares(shares)
    c = np.random.default_rng(seed).choice(len(shares), num_clients, p=shares / shares.sum())
    return values[c]


def lognormal(num_clients: int, median: float, sigma: float, seed: int = 0) -> np.ndarray:
    """Per-client values drawn once from a lognormal law (e.g. speeds in steps per second
    spread over an order of magnitude: ``sigma=1``), with ``seed``."""
    num_clients = H.count(num_clients, "num_clients")
    H.POSITIVE.check("median", median)
    H.NONNEGATIVE.check("sigma", sigma)
    return median * np.exp(sigma * np.random.default_rng(seed).standard_normal(num_clients))


# ------------------------------------------------------------------------ availability


@dataclasses.dataclass(frozen=True)
class Always:
    """Every client can be sampled every round."""

    def __call__(self, key, round_, num_clients: int):
        return jnp.ones((num_clients,), bool)

    def check(self, num_clients: int) -> None:
        pass

    def describe(self) -> str:
        return "always"


@dataclasses.dataclass(frozen=True)
class Independent:
    """Client k is available each round independently with probability p_k."""

    p: tuple

    def __call__(self, key, round_, num_clients: int):
        u = jax.random.uniform(jax.random.fold_in(key, round_), (num_clients,))
        return u < _array(self.p, num_clients)

    def check(self, num_clients: int) -> None:
        _check_length(self.p, "availability", num_clients)

    def describe(self) -> str:
        return (f"independent(p={self.p[0]:g})" if len(self.p) == 1 else
                f"independent(p per client, mean {np.mean(self.p):.3g})")


@dataclasses.dataclass(frozen=True)
class Periodic:
    """Diurnal availability: client k is available in the rounds r where
    (r + offset_k) mod period < on_fraction * period, i.e. a window of
    ``on_fraction`` of every ``period`` rounds, at its own phase offset_k (drawn
    uniformly from the run's key, or given)."""

    period: int
    on_fraction: float
    offsets: Optional[tuple] = None

    def __call__(self, key, round_, num_clients: int):
        offsets = (jax.random.randint(key, (num_clients,), 0, self.period)
                   if self.offsets is None else jnp.asarray(self.offsets, jnp.int32))
        offsets = jnp.broadcast_to(offsets, (num_clients,))
        return (jnp.mod(round_ + offsets, self.period)
                < jnp.float32(self.on_fraction * self.period))

    def check(self, num_clients: int) -> None:
        if self.offsets is not None:
            _check_length(self.offsets, "availability", num_clients)

    def describe(self) -> str:
        return f"periodic(period={self.period}, on={self.on_fraction:g})"


@dataclasses.dataclass(frozen=True)
class Markov:
    """A two-state on/off Markov chain per client: an available client becomes
    unavailable with probability ``p_off`` per round, an unavailable one available
    again with probability ``p_on``; it starts from the stationary law (available with
    probability p_on / (p_off + p_on)). Evaluated statelessly (module docstring) with
    look-back blocks of ``block`` rounds."""

    p_off: tuple
    p_on: tuple
    block: int

    def __call__(self, key, round_, num_clients: int):
        a, b = _array(self.p_off, num_clients), _array(self.p_on, num_clients)
        q = a + b  # the refresh probability
        on = b / q  # the stationary share
        w = self.block
        refresh_key, value_key = jax.random.split(key)
        pos = jnp.arange(w)

        def last_refresh(j, upto):
            """Per client: the last refresh position <= ``upto`` in block j, or -1."""
            u = jax.random.uniform(jax.random.fold_in(refresh_key, j), (num_clients, w))
            hit = (u < q[:, None]) | ((j == 0) & (pos == 0))[None, :]
            hit = hit & (pos <= upto)[None, :]
            return jnp.max(jnp.where(hit, pos[None, :], -1), axis=1)

        j0 = round_ // w
        first = last_refresh(j0, round_ % w)
        tau = jnp.where(first >= 0, j0 * w + first, -1)

        def back(carry):
            j, tau = carry
            j = j - 1
            last = last_refresh(j, w - 1)
            return j, jnp.where((tau < 0) & (last >= 0), j * w + last, tau)

        # block 0 always refreshes at round 0: the loop ends there at the latest
        _, tau = jax.lax.while_loop(lambda c: jnp.any(c[1] < 0), back, (j0, tau))
        u = jax.vmap(lambda t, k: jax.random.uniform(
            jax.random.fold_in(jax.random.fold_in(value_key, t), k)))(
                tau, jnp.arange(num_clients))
        return u < on

    def check(self, num_clients: int) -> None:
        _check_length(self.p_off, "availability", num_clients)
        _check_length(self.p_on, "availability", num_clients)

    def describe(self) -> str:
        f = lambda v: f"{v[0]:g}" if len(v) == 1 else "per client"
        return f"markov(p_off={f(self.p_off)}, p_on={f(self.p_on)})"


@dataclasses.dataclass(frozen=True)
class Trace:
    """A recorded availability table [R, N] (True: available), round r reading row
    r mod R (the trace replays cyclically)."""

    packed: bytes
    shape: tuple

    @property
    def table(self) -> np.ndarray:
        r, n = self.shape
        bits = np.unpackbits(np.frombuffer(self.packed, np.uint8), count=r * n)
        return bits.reshape(r, n).astype(bool)

    def __call__(self, key, round_, num_clients: int):
        return jnp.asarray(self.table)[jnp.mod(round_, self.shape[0])]

    def check(self, num_clients: int) -> None:
        if self.shape[1] != num_clients:
            raise H.FieldError("availability", f"the trace has {self.shape[1]} clients per "
                                               f"round, the federation {num_clients}")

    def describe(self) -> str:
        return f"trace({self.shape[0]} rounds, mean {self.table.mean():.3g} available)"


def always() -> Always:
    return Always()


def _never(what: str, fix: str) -> H.FieldError:
    return H.FieldError("availability", f"{what}: no client is ever available, so no "
                                        f"client ever trains; {fix}")


def independent(p) -> Independent:
    """Each client available each round with probability ``p`` (one for all, or [N];
    some client's > 0)."""
    p = _probabilities(p, "availability")
    if not any(v > 0 for v in p):
        raise _never("every probability is 0", "give some client a probability > 0")
    return Independent(p)


def periodic(period: int, on_fraction: float, offsets=None) -> Periodic:
    """Available ``on_fraction`` of every ``period`` rounds, each client at its own phase:
    ``offsets`` [N] integers (None: drawn uniformly in [0, period) from the run's key)."""
    period = H.count(period, "availability.period")
    on_fraction = H.probability(on_fraction, "availability.on_fraction")
    if on_fraction == 0:
        raise _never("an on_fraction of 0", "give an on_fraction > 0")
    if offsets is not None:
        o = np.asarray(offsets)
        if o.ndim != 1 or not np.issubdtype(o.dtype, np.integer):
            raise H.FieldError("availability.offsets", "must be a 1-D integer array [N]")
        offsets = tuple(int(v) % period for v in o)
    return Periodic(period, on_fraction, offsets)


def markov(p_off, p_on) -> Markov:
    """A two-state on/off chain per client (``Markov``); p_off + p_on must be in (0, 1]
    for every client (chains that persist in their states; the stateless form needs
    it)."""
    a = _probabilities(p_off, "availability.p_off")
    b = _probabilities(p_on, "availability.p_on")
    q = np.add(a, b) if len(a) == len(b) or 1 in (len(a), len(b)) else None
    if q is None:
        raise H.FieldError("availability.p_on", "p_off and p_on must have the same length")
    if np.any(q <= 0) or np.any(q > 1 + 1e-12):
        raise H.FieldError("availability.p_on", f"p_off + p_on must lie in (0, 1] for every "
                                                f"client, got values in [{q.min():g}, "
                                                f"{q.max():g}]")
    if not any(v > 0 for v in b):  # the stationary share p_on / q is 0 for every client
        raise _never("p_on is 0 for every client", "give p_on > 0")
    # blocks of about 1 / q rounds (a power of two in [16, 4096]): a look-back visits
    # few of them, and each round draws N x block numbers per visited block
    block = int(min(4096, max(16, 2 ** math.ceil(math.log2(1.0 / float(np.min(q)))))))
    return Markov(a, b, block)


def trace(table) -> Trace:
    """A recorded availability table [rounds, N] of booleans (or 0/1), replayed
    cyclically."""
    t = np.asarray(table)
    if t.ndim != 2 or t.size == 0:
        raise H.FieldError("availability", f"a trace must be a 2-D table [rounds, clients], "
                                           f"got shape {t.shape}")
    if t.dtype != bool:
        if not np.issubdtype(t.dtype, np.number) or not np.all(np.isin(t, (0, 1))):
            raise H.FieldError("availability", "a trace holds booleans (or 0 / 1)")
        t = t.astype(bool)
    if not t.any():
        raise _never(f"the trace of {t.shape[0]} rounds x {t.shape[1]} clients is all 0",
                     "give a trace in which some client is available")
    return Trace(np.packbits(t.reshape(-1)).tobytes(), tuple(int(s) for s in t.shape))


# ------------------------------------------------------------------------------ clock


@dataclasses.dataclass(frozen=True)
class Clock:
    """Per-client compute speed and communication (see the module docstring).

    speed: local steps per second (one for all, or [N]).
    bandwidth: bytes per second, each way (None: communication takes no time).
    latency: seconds per round trip.
    deadline: seconds, or None (a round waits for its last reporting client).
    late: "drop" or "partial" (what happens to a client past the deadline).
    training: the local training whose steps the clock times (its batch size, epochs
      and step cap; the method's own).
    """

    speed: tuple
    bandwidth: Optional[tuple]
    latency: tuple
    deadline: Optional[float]
    late: str
    training: ClientTraining

    def check(self, num_clients: int) -> None:
        for field, values in (("clock.speed", self.speed), ("clock.bandwidth", self.bandwidth),
                              ("clock.latency", self.latency)):
            if values is not None:
                _check_length(values, field, num_clients)

    def describe(self) -> str:
        d = "none" if self.deadline is None else f"{self.deadline:g} s ({self.late})"
        return (f"clock(speed mean {np.mean(self.speed):.3g} steps/s, deadline {d})")


def clock(speed, *, bandwidth=None, latency=0.0, deadline: Optional[float] = None,
          late: str = "drop", training: ClientTraining = ClientTraining()) -> Clock:
    """A virtual clock (``Clock``); the arguments are checked here."""
    if late not in LATE:
        raise H.FieldError("clock.late", f"must be one of {list(LATE)}, got {late!r}")
    if deadline is not None:
        H.POSITIVE.check("clock.deadline", deadline)
        deadline = float(deadline)
    if not isinstance(training, ClientTraining):
        raise H.FieldTypeError("clock.training", f"must be a ClientTraining, got "
                                                 f"{type(training).__name__}")
    return Clock(_positive(speed, "clock.speed"),
                 None if bandwidth is None else _positive(bandwidth, "clock.bandwidth"),
                 _nonnegative(latency, "clock.latency"), deadline, late, training.check())


# ----------------------------------------------------------------------------- system


@dataclasses.dataclass(frozen=True)
class System:
    """Availability, dropout and clock of a simulation (``simulate(system=...)``)."""

    availability: object = Always()
    dropout: Optional[tuple] = None
    clock: Optional[Clock] = None

    def check(self, num_clients: int, num_examples=None, model_bytes: int = 0,
              sampler: Callable = sampling.uniform) -> "System":
        """``self`` if it fits a federation of ``num_clients`` whose clients hold
        ``num_examples`` [N] training examples (per-client arrays and the trace have N
        entries; a deadline that some client with data can meet) with ``sampler``;
        else ``FieldError`` naming the field. Called before anything is compiled."""
        self.availability.check(num_clients)
        if self.dropout is not None:
            _check_length(self.dropout, "dropout", num_clients)
        if not (self.availability == Always() or sampler is sampling.uniform
                or sampler is sampling.full or isinstance(sampler, sampling.Weighted)):
            raise H.FieldError("sampler", "availability needs the uniform, full or a "
                                          "weighted sampler (it samples among the available "
                                          "clients)")
        c = self.clock
        if c is None:
            return self
        c.check(num_clients)
        if c.deadline is not None and num_examples is not None:
            n = np.asarray(num_examples)
            comm = np.asarray(_comm_seconds(c, model_bytes, num_clients))
            # drop: the whole work in time; partial: at least one step
            work = (np.asarray(local_steps(c.training, n, None)) if c.late == "drop" else 1)
            need = (comm + work / np.asarray(_array(c.speed, num_clients)))[n > 0]
            if need.size and not np.any(need <= c.deadline):
                raise H.FieldError("clock.deadline", f"{c.deadline:g} s: no client can "
                                                     f"report in time (the fastest needs "
                                                     f"{float(np.min(need)):.3g} s)")
        return self

    def describe(self) -> str:
        parts = [f"availability {self.availability.describe()}"]
        if self.dropout is not None:
            parts.append(f"dropout {np.mean(self.dropout):.3g}")
        if self.clock is not None:
            parts.append(self.clock.describe())
        return ", ".join(parts)


def system(availability=None, dropout=None, clock: Optional[Clock] = None) -> System:
    """A ``System``: ``availability`` (None: always), ``dropout`` probabilities (one for
    all, or [N]; None: every selected client reports), ``clock`` (None: no clock)."""
    if availability is None:
        availability = Always()
    if not isinstance(availability, (Always, Independent, Periodic, Markov, Trace)):
        raise H.FieldTypeError("availability", f"must be built by system.always / "
                                               f"independent / periodic / markov / trace, got "
                                               f"{type(availability).__name__}")
    if clock is not None and not isinstance(clock, Clock):
        raise H.FieldTypeError("clock", f"must be built by system.clock, got "
                                        f"{type(clock).__name__}")
    if dropout is not None:
        dropout = _probabilities(dropout, "dropout")
        if all(v >= 1 for v in dropout):
            raise H.FieldError("dropout", "every client drops out with probability 1: no "
                                          "selected client ever reports, so no client "
                                          "trains; give a probability below 1")
    return System(availability, dropout, clock)


def _comm_seconds(c: Clock, model_bytes: int, num_clients: int):
    comm = _array(c.latency, num_clients)
    if c.bandwidth is not None:
        comm = comm + 2.0 * model_bytes / _array(c.bandwidth, num_clients)
    return comm


def client_seconds(c: Clock, num_steps, client_ids, model_bytes: int):
    """The time on clock ``c`` of clients ``client_ids`` [K] that took ``num_steps`` [K]
    local steps: latency + 2 * model_bytes / bandwidth + steps / speed (the clock's
    per-client values, or its one value for every client)."""
    lengths = [len(c.speed), len(c.latency)] + ([len(c.bandwidth)] if c.bandwidth else [])
    n = max(lengths)  # N with per-client values, else 1
    ids = client_ids if n > 1 else jnp.zeros_like(client_ids)
    return (_comm_seconds(c, model_bytes, n)[ids]
            + num_steps.astype(jnp.float32) / _array(c.speed, n)[ids])


def local_steps(training: ClientTraining, num_examples, budgets):
    """The local steps a client takes: min(budget, E * ceil(n / B), max_steps)."""
    steps = training.num_epochs * steps_per_epoch(num_examples, training.batch_size)
    if training.max_steps is not None:
        steps = jnp.minimum(steps, training.max_steps)
    return steps if budgets is None else jnp.minimum(steps, budgets)


def _sample_available(sampler, key, available, cohort_size: int):
    """``cohort_size`` distinct clients drawn among the available ones as ``sampler``
    would (uniform, or weighted: Gumbel top-k, which is successive sampling without
    replacement); when fewer are available the cohort is padded with unavailable
    clients, masked. ``full``: every client, the unavailable ones masked."""
    n = available.shape[0]
    if sampler is sampling.full:
        return sampling.full(key, n, cohort_size), available
    if isinstance(sampler, sampling.Weighted):
        w = jnp.asarray(sampler.weights, jnp.float32)
        score = jnp.where(w > 0, jnp.log(jnp.where(w > 0, w, 1.0)), -jnp.inf) \
            + jax.random.gumbel(key, (n,))
    else:
        score = -jax.random.uniform(key, (n,))
    score = jnp.where(available & jnp.isfinite(score), score, -jnp.inf)
    _, ids = jax.lax.top_k(score, cohort_size)
    ids = ids.astype(jnp.int32)
    return ids, jnp.isfinite(score[ids])


def plan_round(sys: System, key, round_, sample_key, *, sampler: Callable, num_clients: int,
               cohort_size: int, num_examples, budgets, model_bytes: int):
    """This round's (client_ids [K], client_mask [K], local_steps [K], metrics).

    ``key`` is the run's key, ``sample_key`` the round's sampling key (the same draw as
    without a system when every client is available), ``budgets`` the round's step
    budget table [N] (or None)."""
    skey = jax.random.fold_in(key, SYSTEM_KEY_ID)
    available = sys.availability(jax.random.fold_in(skey, _AVAILABILITY), round_,
                                 num_clients)
    if sys.availability == Always():
        ids = sampler(sample_key, num_clients, cohort_size)
        mask = jnp.ones((cohort_size,), bool)
    else:
        ids, mask = _sample_available(sampler, sample_key, available, cohort_size)
    steps = None if budgets is None else budgets[ids]
    metrics = {"system/available": jnp.sum(available).astype(jnp.int32)}
    reported = mask
    if sys.dropout is not None:
        u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(
            jax.random.fold_in(jax.random.fold_in(skey, _DROPOUT), round_), k)))(ids)
        reported = reported & (u >= _array(sys.dropout, num_clients)[ids])
    c = sys.clock
    if c is not None:
        n = jnp.asarray(num_examples)[ids]
        speed = _array(c.speed, num_clients)[ids]
        comm = _comm_seconds(c, model_bytes, num_clients)[ids]
        work = local_steps(c.training, n, steps)
        t = comm + work / speed
        late = jnp.zeros_like(mask)
        if c.deadline is not None:
            if c.late == "partial":  # the steps finished in time
                in_time = jnp.floor((c.deadline - comm) * speed)
                in_time = jnp.clip(in_time, 0, None).astype(jnp.int32)
                cut = in_time < work
                steps = jnp.where(cut, in_time, work if steps is None else steps)
                t = jnp.where(cut, comm + in_time / speed, t)
                late = (in_time <= 0) & (work > 0) | (comm > c.deadline)
            else:
                late = t > c.deadline
            reported = reported & ~late
            waited = jnp.any(mask & ~reported)  # the server waits for D
            duration = jnp.where(waited, c.deadline,
                                 jnp.max(jnp.where(reported, t, 0.0), initial=0.0))
            metrics["system/late"] = jnp.sum(mask & late).astype(jnp.int32)
        else:
            duration = jnp.max(jnp.where(reported, t, 0.0), initial=0.0)
        metrics["system/client_seconds"] = jnp.where(mask, t, 0.0).astype(jnp.float32)
        metrics["system/round_seconds"] = duration.astype(jnp.float32)
    metrics["system/reported"] = jnp.sum(reported).astype(jnp.int32)
    if steps is None:
        steps = jnp.full((cohort_size,), 2 ** 30, jnp.int32)
    return ids, reported, steps.astype(jnp.int32), metrics
