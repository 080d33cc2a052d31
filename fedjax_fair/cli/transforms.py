"""The command line's privacy and robustness options as scenarios applied to the
built method (scenarios/wrap.py): ``--attack`` on ``--malicious-fraction`` /
``--malicious-ids`` clients (scenarios/attacks.py), ``--robust`` rules (scenarios/robust.py)
and client-level DP, ``--dp-noise`` or ``--dp-epsilon`` with ``--dp-clip``,
``--dp-delta``, ``--dp-max-weight`` (scenarios/privacy.py, docs/scenarios.md,
docs/privacy.md, docs/robustness.md).

Every option is checked when the config is (``check``), the ones that need the
federation's size when the data is built (``apply``), in the order attack, robust
rule, privacy; a method with which one has no sound meaning is refused there, before
anything runs, with one line naming the method, the scenario and why.
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np

from fedjax_fair.cli import options as C
from fedjax_fair.algorithms.registry import get_method
from fedjax_fair.cli.parsing import parse_robust
from fedjax_fair.hparams import FieldError

ATTACKS = ("label_flip", "sign_flip", "gaussian", "scaled_replacement")
# the command-line option a refusal of each scenario kind names
OPTION_OF = {"attack": "attack", "robust": "robust", "privacy": "dp_noise"}


def parse_attack(text: str, num_classes: Optional[int] = None):
    """``label_flip``, ``sign_flip[:SCALE]``, ``gaussian[:STD]``,
    ``scaled_replacement[:SCALE]`` -> ``attacks.Attack``; ``FieldError("attack")``."""
    from fedjax_fair.scenarios import attacks
    kind, _, arg = str(text).partition(":")
    if kind not in ATTACKS or (arg and kind == "label_flip"):
        raise FieldError("attack", f"{text!r}: one of label_flip, sign_flip[:SCALE], "
                                   f"gaussian[:STD], scaled_replacement[:SCALE]")
    try:
        value = float(arg) if arg else None
    except ValueError:
        raise FieldError("attack", f"{text!r}: {arg!r} is not a number") from None
    attack = attacks.Attack(kind, scale=value if kind in ("sign_flip", "scaled_replacement")
                            else None, std=value if kind == "gaussian" else None,
                            num_classes=num_classes if kind == "label_flip" else None)
    try:
        return attacks.check_attack(attack) if kind != "label_flip" or num_classes else attack
    except FieldError as e:
        raise FieldError("attack", f"{text!r}: {str(e).split(': ', 1)[-1]}") from None


def check(cfg) -> None:
    """The options' own values, before anything is built (``ConfigError`` naming the
    field)."""
    try:
        if cfg.robust is not None:
            parse_robust(cfg.robust, cfg.cohort_size)
        if cfg.attack is not None:
            parse_attack(cfg.attack)
            if not cfg.malicious_fraction and not cfg.malicious_ids:
                raise FieldError("malicious_fraction", "--attack needs malicious clients: "
                                                       "--malicious-fraction F or "
                                                       "--malicious-ids I,J")
        if cfg.malicious_fraction or cfg.malicious_ids:
            if cfg.attack is None:
                raise FieldError("attack", "malicious clients need an --attack")
            if not 0 <= float(cfg.malicious_fraction) <= 1:
                raise FieldError("malicious_fraction", f"must lie in [0, 1], got "
                                                       f"{cfg.malicious_fraction}")
        if cfg.dp_noise is not None or cfg.dp_epsilon is not None:
            from fedjax_fair.scenarios import privacy
            if cfg.robust is not None:
                raise FieldError("robust", "not with --dp-noise / --dp-epsilon: both replace "
                                           "the method's combination of the updates, and "
                                           "the release's sensitivity bound holds for its "
                                           "clipped weighted sum only")
            for option, plain in (("availability", "always"), ("dropout", "none")):
                if getattr(cfg, option, plain) != plain:
                    raise FieldError(option, f"client-level DP is accounted for cohorts of "
                                             f"--cohort-size drawn uniformly from every "
                                             f"client: not with --{option}")
            if getattr(cfg, "sampler", "uniform") not in ("uniform", "full"):
                raise FieldError("sampler", "client-level DP is accounted for uniform "
                                            "cohorts (--sampler uniform or full)")
            fields = {"noise_multiplier": "dp_noise", "target_epsilon": "dp_epsilon",
                      "clip": "dp_clip", "delta": "dp_delta", "max_weight": "dp_max_weight",
                      "target_quantile": "dp_adaptive_clip"}
            try:
                privacy.check_dp(cfg.dp_noise, cfg.dp_clip, cfg.dp_delta, cfg.dp_epsilon,
                                 sampling="fixed", max_weight=cfg.dp_max_weight,
                                 adaptive=_adaptive(cfg))
            except FieldError as e:
                raise FieldError(fields.get(e.field, e.field),
                                 str(e)[len(e.field) + 2:]) from None
    except (FieldError, ValueError, TypeError) as e:
        raise C.config_error(e, "attack") from None


def malicious_flags(cfg, num_clients: int) -> Optional[np.ndarray]:
    """bool [N]: the clients under ``--attack`` (drawn with ``--malicious-seed``), or
    None without an attack."""
    if cfg.attack is None:
        return None
    from fedjax_fair.scenarios import attacks
    try:
        return attacks.malicious_ids(num_clients, fraction=cfg.malicious_fraction or None,
                                     ids=list(cfg.malicious_ids) or None,
                                     seed=cfg.malicious_seed)
    except (FieldError, ValueError) as e:
        raise C.config_error(e, "malicious_ids") from None


def _adaptive(cfg):
    """``--dp-adaptive-clip Q`` as ``privacy.AdaptiveClip`` (its count's noise: the
    default cohort / 20), or None."""
    quantile = getattr(cfg, "dp_adaptive_clip", None)
    if quantile is None:
        return None
    from fedjax_fair.scenarios import privacy
    return privacy.AdaptiveClip(target_quantile=float(quantile),
                                cohort_size=float(cfg.cohort_size))


def dp_of(cfg, num_clients: int):
    """The run's ``privacy.ClientDP`` (``--dp-epsilon``: the noise multiplier that spends
    it over ``--num-rounds`` rounds of fixed-size cohorts; with ``--dp-adaptive-clip``
    the updates' share of it beside the clip count's), or None without DP."""
    if cfg.dp_noise is None and cfg.dp_epsilon is None:
        return None
    from fedjax_fair.scenarios import privacy
    adaptive = _adaptive(cfg)
    noise = cfg.dp_noise
    if noise is None:
        run = (int(cfg.cohort_size), int(num_clients), int(cfg.num_rounds), float(cfg.dp_delta))
        count_noise = cfg.cohort_size / 20.0
        # the count's noise alone spending more than the budget leaves the updates none:
        # known from one accounting instead of a calibration
        if adaptive is not None and _spent(count_noise, *run) > cfg.dp_epsilon:
            raise _no_budget(cfg, f"at noise multiplier {count_noise:g} it alone spends more")
        noise = _noise_for(float(cfg.dp_epsilon), *run)
        if adaptive is not None:  # the count's noise spends part of the budget
            try:
                noise = privacy.update_noise_multiplier(noise, count_noise)
            except FieldError as e:
                raise _no_budget(cfg, str(e).split(": ", 1)[-1]) from None
    return privacy.ClientDP(noise_multiplier=float(noise), clip=cfg.dp_clip,
                            sampling="fixed", max_weight=cfg.dp_max_weight, adaptive=adaptive)


def _no_budget(cfg, why: str):
    return C.config_error(FieldError(
        "dp_adaptive_clip", f"the clip count's noise (cohort / 20 = {cfg.cohort_size / 20:g}) "
                            f"leaves no budget for the updates at --dp-epsilon "
                            f"{cfg.dp_epsilon:g}: {why}; use a larger cohort, a larger "
                            f"epsilon or a fixed clip"), "dp_adaptive_clip")


@functools.lru_cache(maxsize=64)
def _spent(noise: float, cohort_size: int, num_clients: int, rounds: int,
           delta: float) -> float:
    """epsilon of ``rounds`` fixed-size cohorts at noise multiplier ``noise``."""
    from fedjax_fair.scenarios import privacy
    return privacy.epsilon(noise, cohort_size / num_clients, rounds, delta, sampling="fixed",
                           population=num_clients)


@functools.lru_cache(maxsize=64)
def _noise_for(epsilon: float, cohort_size: int, num_clients: int, rounds: int,
               delta: float) -> float:
    """``privacy.noise_for_epsilon`` of fixed-size cohorts (seconds: asked once a run)."""
    from fedjax_fair.scenarios import privacy
    return privacy.noise_for_epsilon(epsilon, cohort_size / num_clients, rounds, delta,
                                     sampling="fixed", population=num_clients)


_ACCOUNTANTS: dict = {}


def accountant_of(cfg, num_clients: int):
    """The ``privacy.Accountant`` of the run's DP (epsilon at ``--dp-delta`` after r
    rounds of cohorts of ``--cohort-size`` drawn without replacement from N), or None."""
    dp = dp_of(cfg, num_clients)
    if dp is None:
        return None
    from fedjax_fair.scenarios import privacy
    key = (dp, cfg.cohort_size, num_clients, cfg.dp_delta)  # one per setting: its cache
    if key not in _ACCOUNTANTS:
        _ACCOUNTANTS[key] = privacy.Accountant.for_dp(dp, cfg.cohort_size / num_clients,
                                                      cfg.dp_delta, population=num_clients,
                                                      cohort_size=cfg.cohort_size)
    return _ACCOUNTANTS[key]


def apply(algorithm, cfg, num_clients: int, num_classes: Optional[int] = None):
    """``algorithm`` under the options' scenarios, in the order attack, robust rule,
    privacy (``scenarios.with_attack`` / ``with_robust`` / ``with_privacy``); a
    refused pairing is a ``ConfigError`` naming the option."""
    from fedjax_fair import scenarios
    try:
        flags = malicious_flags(cfg, num_clients)
        if flags is not None:
            algorithm = scenarios.with_attack(algorithm, parse_attack(cfg.attack, num_classes),
                                              flags)
        if cfg.robust is not None:
            algorithm = scenarios.with_robust(algorithm, parse_robust(cfg.robust), cfg.robust)
        if cfg.dp_noise is not None or cfg.dp_epsilon is not None:
            # refused before the noise is calibrated (seconds with --dp-epsilon)
            scenarios.check(algorithm, "privacy", "client-level DP")
            algorithm = scenarios.with_privacy(algorithm, dp_of(cfg, num_clients))
    except scenarios.Refused as e:
        option = ("dp_epsilon" if e.field == "privacy" and cfg.dp_epsilon is not None
                  else OPTION_OF[e.field])
        raise C.ConfigError(option, str(e)[len(e.field) + 2:]) from None
    return algorithm


def annotate(history: list, accountant) -> None:
    """Every evaluation of ``history`` gets ``dp_epsilon``, the privacy spent by its
    round (in place; nothing without DP)."""
    if accountant is None:
        return
    for entry in history:
        entry["dp_epsilon"] = accountant.epsilon(int(entry["round"])) if entry["round"] \
            else 0.0


def announce(cfg, algorithms: dict) -> dict:
    """Prints each method's note at this cohort size (``registry.Method.note``), the
    scenarios applied, in order (the options are the same for every
    method: the first one's names say them), and with DP what its epsilon covers;
    returns name -> the scenarios' names, for config.json. ``algorithms``: name -> the
    method under its scenarios."""
    from fedjax_fair import scenarios
    for name in algorithms:
        note = get_method(name).note
        line = note(cfg.cohort_size) if note is not None else None
        if line:
            print(f"note: {line}")
    names = {name: scenarios.names(alg) for name, alg in algorithms.items()}
    first = next(iter(names.values()), [])
    if first:
        print("scenarios: " + "; then ".join(first))
    if first and (cfg.dp_noise is not None or cfg.dp_epsilon is not None):
        each = ", ".join(f"{name} {scenarios.releases(alg)}"
                         for name, alg in algorithms.items())
        print(f"privacy: epsilon (delta {cfg.dp_delta:g}) covers every combination the "
              f"server takes of its clients' uploads, each clipped and noised; releases "
              f"a round: {each}")
    return names
