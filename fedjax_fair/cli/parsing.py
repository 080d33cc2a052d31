"""Command-line text to library values: the only module that reads the texts of
``--availability`` / ``--dropout`` / ``--speeds`` / ``--bandwidth`` / ``--latency`` /
``--deadline`` (``parse_system`` -> ``Spec``, whose ``build`` makes a
``scenarios.system.System`` for a federation), ``--robust`` (``parse_robust`` -> a
``scenarios.robust`` aggregator), ``--step-budgets`` (``parse_budgets`` -> a
``scenarios.heterogeneity.StepBudgets``) and ``--client-lr-schedule`` /
``--server-lr-schedule`` (``parse_schedule`` -> ``rate_0 -> schedule``).

Every parser checks its numbers here, so a mistake is a ``FieldError`` naming the option
before any data is built; the library values they make are checked again by the
library (a notebook builds them directly).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import numpy as np

from fedjax_fair import hparams as H
from fedjax_fair.core.aggregators import Aggregator
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.hparams import FieldError
from fedjax_fair.scenarios import heterogeneity as HET
from fedjax_fair.scenarios import robust as R
from fedjax_fair.scenarios import schedules as SCH
from fedjax_fair.scenarios import system as S

# ------------------------------------------------------------------ participation and clock
class Spec(NamedTuple):
    """A system described in text (the command line's ``--availability``,
    ``--dropout``, ``--speeds``, ``--bandwidth``, ``--latency``, ``--deadline``),
    checked by ``parse_system``; ``build`` makes the ``System`` for a federation."""

    availability: tuple
    dropout: tuple
    speeds: tuple
    bandwidth: Optional[float]
    latency: float
    deadline: Optional[tuple]
    seed: int

    def build(self, train, training: ClientTraining = ClientTraining()) -> Optional[S.System]:
        """The ``System`` for a federation whose training split is ``train`` (its sizes and
        labels), the clock timing ``training`` (the method's); None when the spec changes
        nothing."""
        n = int(np.asarray(train.num_examples).shape[0])
        sizes = np.asarray(train.num_examples, np.float64)
        kind, *args = self.availability
        if kind == "always":
            availability = S.Always()
        elif kind == "independent":
            availability = S.independent(args[0])
        elif kind == "size":
            availability = S.independent(S.from_property(sizes, *args))
        elif kind == "labels":
            availability = S.independent(S.from_property(S.label_share(train, args[0]), *args[1:]))
        elif kind == "classes":  # device classes, each with its availability
            availability = S.independent(S.device_classes(n, *args, seed=self.seed))
        elif kind == "periodic":
            availability = S.periodic(*args)
        elif kind == "markov":
            availability = S.markov(*args)
        else:  # trace
            availability = S.trace(_load_table(args[0]))
        kind, *args = self.speeds
        speed = (None if kind == "none" else np.full(n, args[0]) if kind == "fixed"
                 else S.lognormal(n, *args, seed=self.seed) if kind == "lognormal"
                 else S.device_classes(n, *args, seed=self.seed))
        kind, *args = self.dropout
        if kind == "none":
            dropout = None
        elif kind == "fixed":
            dropout = args[0]
        else:  # tied to speed: the slowest client args[0], the fastest args[1]
            if speed is None:
                raise H.FieldError("dropout", "speed:SLOWEST:FASTEST needs --speeds")
            dropout = S.from_property(speed, *args)
        c = None
        if speed is not None:
            deadline, late = self.deadline or (None, "drop")
            c = S.clock(speed, bandwidth=self.bandwidth, latency=self.latency,
                      deadline=deadline, late=late, training=training)
        elif self.deadline is not None or self.bandwidth is not None or self.latency:
            raise H.FieldError("speeds", "a deadline, bandwidth or latency needs a clock: "
                                         "give --speeds")
        if availability == S.Always() and dropout is None and c is None:
            return None
        return S.system(availability, dropout, c)


def _numbers(text: str, field: str, count: int) -> list:
    parts = text.split(":")
    if len(parts) != count:
        raise H.FieldError(field, f"expected {count} numbers separated by ':', got {text!r}")
    try:
        return [float(p) for p in parts]
    except ValueError:
        raise H.FieldError(field, f"cannot read the numbers of {text!r}") from None


def _classes(text: str, field: str, spec: str) -> tuple:
    """(shares, values) of ``SHARE@VALUE+SHARE@VALUE``: shares >= 0 summing to 1."""
    try:
        pairs = [tuple(float(v) for v in c.split("@")) for c in text.split("+")]
    except ValueError:
        pairs = [()]
    if any(len(p) != 2 or not np.isfinite(p).all() or p[0] < 0 for p in pairs) or \
            not sum(p[0] for p in pairs) > 0:
        raise H.FieldError(field, f"classes:SHARE@VALUE+SHARE@VALUE needs numbers, shares "
                                  f">= 0 and not all 0, got {spec!r}")
    shares = tuple(p[0] for p in pairs)
    S.check_shares(shares, field)
    return shares, tuple(p[1] for p in pairs)


def _load_table(path: str) -> np.ndarray:
    try:
        if path.endswith(".npy"):
            return np.load(path)
        return np.loadtxt(path, delimiter=",", ndmin=2)
    except (OSError, ValueError) as e:
        raise H.FieldError("availability", f"cannot read the trace {path!r}: {e}") from None


AVAILABILITY_SPECS = ("always", "independent:P", "size:LOW:HIGH", "labels:L1+L2:LOW:HIGH",
                      "classes:SHARE@P+SHARE@P", "periodic:PERIOD:ON_FRACTION",
                      "markov:P_OFF:P_ON", "trace:FILE")
SPEED_SPECS = ("none", "fixed:STEPS_PER_S", "lognormal:MEDIAN:SIGMA",
               "classes:SHARE@SPEED+SHARE@SPEED")


def parse_system(availability: str = "always", dropout: str = "none", speeds: str = "none",
          bandwidth=None, latency=0.0, deadline: str = "none", seed: int = 0) -> Spec:
    """A ``Spec`` from the command line's texts; every number is checked here (a trace
    file is read), so a mistake is a ``FieldError`` naming the option before any data is
    built. ``deadline``: ``none``, ``SECONDS`` or ``SECONDS:drop|partial``."""
    kind, _, rest = str(availability).strip().partition(":")
    if kind == "always" and not rest:
        avail: tuple = ("always",)
    elif kind == "independent":
        avail = (kind, H.probability(_numbers(rest, "availability", 1)[0], "availability"))
        S.independent(avail[1])  # > 0
    elif kind in ("size", "markov"):
        lo, hi = _numbers(rest, "availability", 2)
        avail = (kind, H.probability(lo, "availability"), H.probability(hi, "availability"))
        if kind == "markov":
            S.markov(lo, hi)  # p_off + p_on in (0, 1], p_on > 0
        else:
            S.independent([lo, hi])  # some client available
    elif kind == "labels":
        labels, _, numbers = rest.partition(":")
        try:
            ids = tuple(int(v) for v in labels.split("+"))
        except ValueError:
            raise H.FieldError("availability", f"labels:L1+L2:LOW:HIGH needs integer labels, "
                                               f"got {labels!r}") from None
        lo, hi = _numbers(numbers, "availability", 2)
        avail = (kind, ids, H.probability(lo, "availability"),
                 H.probability(hi, "availability"))
        S.independent([lo, hi])  # some client available
    elif kind == "periodic":
        period, on = _numbers(rest, "availability", 2)
        if not period.is_integer():
            raise H.FieldError("availability", f"the period is a number of rounds, got {period}")
        S.periodic(int(period), on)
        avail = (kind, int(period), on)
    elif kind == "trace" and rest:
        S.trace(_load_table(rest))  # readable, a 2-D table of booleans
        avail = (kind, rest)
    elif kind == "classes" and rest:
        shares, values = _classes(rest, "availability", availability)
        S._probabilities(values, "availability")
        S.independent([v for s, v in zip(shares, values) if s > 0])  # some class available
        avail = (kind, shares, values)
    else:
        raise H.FieldError("availability", f"expected one of {', '.join(AVAILABILITY_SPECS)}; "
                                           f"got {availability!r}")
    kind, _, rest = str(speeds).strip().partition(":")
    if kind == "none" and not rest:
        speed: tuple = ("none",)
    elif kind == "fixed":
        speed = (kind, float(H.POSITIVE.check("speeds", _numbers(rest, "speeds", 1)[0])))
    elif kind == "lognormal":
        median, sigma = _numbers(rest, "speeds", 2)
        speed = (kind, float(H.POSITIVE.check("speeds", median)),
                 float(H.NONNEGATIVE.check("speeds", sigma)))
    elif kind == "classes" and rest:
        speed = (kind, *_classes(rest, "speeds", speeds))
        S._positive(speed[2], "speeds")
    else:
        raise H.FieldError("speeds", f"expected one of {', '.join(SPEED_SPECS)}; got {speeds!r}")
    text = str(dropout).strip()
    if text == "none":
        drop: tuple = ("none",)
    elif text.startswith("speed:"):
        lo, hi = _numbers(text[len("speed:"):], "dropout", 2)
        drop = ("speed", H.probability(lo, "dropout"), H.probability(hi, "dropout"))
        S.system(dropout=[lo, hi])  # some client reports
    else:
        drop = ("fixed", H.probability(_numbers(text, "dropout", 1)[0], "dropout"))
        S.system(dropout=drop[1])  # < 1: some client reports
    if bandwidth is not None and str(bandwidth).strip() != "none":
        bandwidth = float(H.POSITIVE.check("bandwidth", float(bandwidth)))
    else:
        bandwidth = None
    latency = float(H.NONNEGATIVE.check("latency", float(latency)))
    text = str(deadline).strip()
    dl = None
    if text != "none":
        seconds, _, late = text.partition(":")
        late = late or "drop"
        if late not in S.LATE:
            raise H.FieldError("deadline", f"expected SECONDS or SECONDS:drop|partial, got "
                                           f"{deadline!r}")
        dl = (float(H.POSITIVE.check("deadline", _numbers(seconds, "deadline", 1)[0])), late)
    return Spec(avail, drop, speed, bandwidth, latency, dl, H.count(seed, "system_seed",
                                                                    minimum=0))


# ------------------------------------------------------------------ robust rules

ROBUST = ("median", "weighted_median", "trimmed_mean", "krum", "multi_krum",
          "geometric_median", "norm_bound")


def parse_robust(text: str, cohort_size: Optional[int] = None) -> Aggregator:
    """The robust rule of the command line's ``--robust`` text: ``median``,
    ``weighted_median``, ``trimmed_mean[:TRIM]`` (0.1), ``krum[:F]`` (1),
    ``multi_krum[:F[:M]]`` (1, 5; at most the cohort),
    ``geometric_median[:ITERS]`` (16), ``norm_bound:MAX_NORM`` (each update clipped,
    then the method's own weighted combination). ``scenarios.with_robust`` puts it in
    place of a method's combination of the updates. A bad text raises
    ``FieldError("robust")``; so does, given ``cohort_size`` K, a Krum with F >= K
    Byzantine clients or M > K selected (``robust.check_krum``)."""
    name, *args = str(text).split(":")
    try:
        values = [float(a) for a in args]
    except ValueError:
        raise H.FieldError("robust", f"{text!r}: the arguments after {name!r} must be "
                                   f"numbers") from None
    count = lambda v, what: _whole(v, what, text)
    try:
        if name == "median" and not values:
            return R.coordinate_median()
        if name == "weighted_median" and not values:
            return R.coordinate_median(weighted=True)
        if name == "trimmed_mean" and len(values) <= 1:
            return R.trimmed_mean(*values)
        if name in ("krum", "multi_krum") and len(values) <= (1 if name == "krum" else 2):
            f = count(values[0], "F") if values else 1
            m = 1 if name == "krum" else count(values[1], "M") if len(values) > 1 else 5
            if cohort_size is not None:
                R.check_krum(f, min(m, cohort_size) if len(values) < 2 else m, cohort_size)
            return R.krum(f, multi=m)
        if name == "geometric_median" and len(values) <= 1:
            return R.geometric_median(*(count(v, "ITERS") for v in values)) if values \
                else R.geometric_median(16)
        if name == "norm_bound" and len(values) == 1:
            R._concrete_in(values[0], "robust", 0.0, float("inf"), low_open=True)
            return R.norm_bounded(values[0])
    except H.FieldError as e:
        raise H.FieldError("robust", f"{text!r}: {str(e).split(': ', 1)[-1]}") from None
    raise H.FieldError("robust", f"{text!r}: one of median, weighted_median, "
                               f"trimmed_mean[:TRIM], krum[:F], multi_krum[:F[:M]], "
                               f"geometric_median[:ITERS], norm_bound:MAX_NORM")


def _whole(value: float, what: str, text: str) -> int:
    if value != int(value) or value < 0:
        raise H.FieldError("robust", f"{text!r}: {what} must be a whole number >= 0")
    return int(value)


# ------------------------------------------------------------------ step budgets


def parse_budgets(spec: str, batch_size: Optional[int] = None) -> Optional[HET.StepBudgets]:
    """A ``StepBudgets`` from text (the CLI's ``--step-budgets``): ``"none"``,
    ``"fixed:B"``, ``"uniform:LOW:HIGH"`` or ``"stragglers:FRACTION:B"``, each with an
    optional last field ``steps`` (default) or ``epochs`` (which uses ``batch_size``),
    e.g. ``"uniform:1:5:epochs"``."""
    parts = [p.strip() for p in str(spec).split(":")]
    if parts == ["none"]:
        return None
    kind, args = parts[0], parts[1:]
    unit = args.pop() if args and args[-1] in HET.UNITS else "steps"
    arity = {"fixed": 1, "uniform": 2, "stragglers": 2}
    if kind not in arity or len(args) != arity[kind]:
        raise FieldError("step_budgets", f"expected none, fixed:B, uniform:LOW:HIGH or "
                                         f"stragglers:FRACTION:B (optionally :steps or :epochs), "
                                         f"got {spec!r}")
    try:
        values = [float(a) if kind == "stragglers" and i == 0 else int(a)
                  for i, a in enumerate(args)]
    except ValueError:
        raise FieldError("step_budgets", f"cannot read the numbers of {spec!r}") from None
    try:
        return HET.BUDGETS[kind](*values, unit=unit, batch_size=batch_size)
    except ValueError as e:
        raise FieldError("step_budgets", f"{e}") from None


# ------------------------------------------------------------------ rate schedules


def parse_schedule(text: str, field: str = "schedule") -> Optional[Callable]:
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
            return lambda rate: SCH.exponential(rate, gamma, every)
        if kind == "step":
            factor, at, rounds = arg.partition("@")
            factor = float(factor)
            bounds = [int(r) for r in rounds.split(",") if r.strip()]
            if not at or not bounds or not 0 < factor < float("inf") or min(bounds) < 1:
                raise ValueError
            return lambda rate: SCH.step(rate, factor, bounds)
    except ValueError:
        pass
    raise H.FieldError(field, f"expected none, exponential:GAMMA[@EVERY] (0 < GAMMA <= 1, "
                              f"EVERY >= 1 rounds) or step:FACTOR@R1,R2,... (finite FACTOR > 0, rounds >= "
                              f"1), "
                              f"got {text!r}")
