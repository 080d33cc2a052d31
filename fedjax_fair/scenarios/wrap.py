"""Scenarios applied to a method, optax style: each takes a ``FederatedAlgorithm`` and
returns the same method under the scenario (docs/scenarios.md).

* ``with_attack(algorithm, attack, is_malicious)``: the flagged clients poison their
  data before local training (label flipping) or their uploaded updates after it
  (scenarios/attacks.py).
* ``with_robust(algorithm, rule)``: a Byzantine-robust rule (scenarios/robust.py) in place
  of the method's combination of the cohort's updates.
* ``with_privacy(algorithm, dp)``: client-level DP (scenarios/privacy.py): every
  combination the server takes of its clients' uploads is clipped and noised.

A scenario replaces one piece and keeps the rest. A method's server step
(``compose``'s aggregator) declares the combinations it takes of the cohort's uploads,
sum_k c_k U_k with c_k >= 0 (``Aggregator.combines``: the updates, UPDATE, and its
other uploads, EXTRA: SCAFFOLD's control variates, the primal-dual duals), and what
else it reads (``Aggregator.reads``). A robust rule replaces the UPDATE combinations:
(sum_k c_k) Rule(U, c / sum_k c_k), so the rule receives the method's own weights
(q-FFL's coefficients into a weighted median); the EXTRA combinations, the mixing
rule, the method's state (control variates, momentum, previous steps, duals, client
tables) stay the method's and still update. The private release replaces every
combination with sum_k c~_k clip(U_k, C) + noise, times sum_k c_k (c~: the capped,
normalised coefficients of ``privacy.privatize``); the J releases of a round each get
noise multiplier z sqrt(J), so that together they spend what one release at z would
(the Gaussian mechanism composes as sum_j z_j^-2), and the accountant's epsilon (at
``dp.noise_multiplier``) covers all of them. The method's further reads must be
covered by those releases: a mixing rule that weighs each client by its own upload
(separable, capped by the release) is; losses, norms or masks read outside a
combination are not, and such a pairing is refused.

``refusal(algorithm, kind, attack=None)`` says why a pairing has no sound meaning
(None when it has one); the ``with_*`` functions raise it as ``Refused`` before
anything is built, one line naming the method, the scenario and the reason. The
order of application is kept in ``algorithm.scenarios`` (its ``name``s describe it).
Every scenario's numbers may be traced (vmap and grad pass through the clip, the
noise, the trim fraction and the attack's scale).
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair import hparams as H
from fedjax_fair.scenarios import attacks as A
from fedjax_fair.scenarios import privacy as P
from fedjax_fair.core.aggregators import UPDATE, Aggregator, weighted_sum
from fedjax_fair.core.algorithm import Combiner, FederatedAlgorithm, Scenario
from fedjax_fair.core.types import ClientOutput

KINDS = ("attack", "robust", "privacy")


class Refused(H.FieldError):
    """A pairing of a method and a scenario with no sound meaning (``e.field`` is the
    scenario's kind: "attack", "robust" or "privacy")."""


_WORDS = {"delta": "updates", "loss_before": "losses", "num_steps": "local step counts",
          "num_examples": "example counts", "extra": "extra uploads",
          "train_loss": "training losses"}


def _words(fields) -> str:
    """``("loss_before", "delta")`` -> "losses and updates"."""
    words = [_WORDS.get(f, f) for f in fields]
    return " and ".join(filter(None, (", ".join(words[:-1]), words[-1]))) if words else ""


def _reads_update(server) -> bool:
    combines = server.combines or ()
    return UPDATE in combines or "delta" in server.reads


def _replaced_by(algorithm: FederatedAlgorithm) -> Optional[str]:
    """The name of the scenario already replacing the combination, or None."""
    return next((s.name for s in algorithm.scenarios if s.combiner is not None), None)


def refusal(algorithm: FederatedAlgorithm, kind: str,
            attack: Optional[A.Attack] = None) -> Optional[str]:
    """Why ``kind`` ("attack" with its ``attack``, "robust", "privacy") has no sound
    meaning for ``algorithm`` as its pieces declare them (``algorithm.server``), or
    None when it has one."""
    if kind not in KINDS:
        raise H.FieldError("kind", f"must be one of {KINDS}, got {kind!r}")
    server = algorithm.server
    if server is None:
        return "its rounds are not built by compose, so no scenario can reach them"
    if kind == "attack":
        if attack is not None and attack.kind in A.OUTPUT_KINDS and not _reads_update(server):
            return (f"its server reads its clients' {_words(server.reads)}, not the "
                    f"update a {attack.kind} attack poisons")
        return None
    replaced = _replaced_by(algorithm)
    if replaced is not None:
        return f"its combination is already replaced by {replaced}"
    if server.combines is None:
        return (f"its server step reads the clients' {_words(server.reads) or 'uploads'} "
                f"jointly instead of taking a weighted combination of them, so there is "
                + ("no combination for a robust rule to replace" if kind == "robust"
                   else "no combination for the private release to clip and noise"))
    if kind == "robust":
        return None
    if server.reads:
        return (f"its server also reads each client's {_words(server.reads)} outside its "
                f"combinations, which the private release does not clip or noise")
    if not server.separable:
        return ("its mixing weights come from every client's uploads or from server state "
                "updated by them, which the private release does not cover")
    return None


def check(algorithm: FederatedAlgorithm, kind: str, name: str,
          attack: Optional[A.Attack] = None) -> None:
    """Raises ``Refused`` (one line: the method, the scenario ``name``, why) when
    ``refusal`` has a reason; for a caller that checks before building the scenario
    (the command line, before calibrating DP noise)."""
    why = refusal(algorithm, kind, attack)
    if why is not None:
        raise Refused(kind, f"{algorithm.name} with {name}: {why}")


def _applied(algorithm: FederatedAlgorithm, kind: str, scenario: Scenario,
             attack: Optional[A.Attack] = None) -> FederatedAlgorithm:
    check(algorithm, kind, scenario.name, attack)
    return algorithm.rebuild(algorithm.scenarios + (scenario,))


# ----------------------------------------------------------------------------- attacks


def with_attack(algorithm: FederatedAlgorithm, attack: A.Attack,
                is_malicious) -> FederatedAlgorithm:
    """``algorithm`` whose clients flagged in ``is_malicious`` (bool [N]) run
    ``attack``: label flipping on their data before local training
    (``attacks.poison_data``), the update attacks on their uploaded ``delta`` after it
    (``attacks.poison_outputs``, keyed per round and client), logged as
    ``attack/malicious`` [K]. Refused for a method whose server never reads the
    uploaded update (DQN-Fed reads its clients' g_k and d~_k)."""
    A.check_attack(attack)
    flags = jnp.asarray(is_malicious, bool)

    def data(d, client_ids, mask, key):
        del mask, key
        return A.poison_data(d, client_ids, flags, attack)

    def outputs(o, client_ids, mask, key):
        o, info = A.poison_outputs(o, client_ids, mask, flags, attack, key)
        return o, {f"attack/{k}": v for k, v in info.items()}

    count = None if isinstance(is_malicious, jax.core.Tracer) else int(np.sum(is_malicious))
    arg = attack.scale if attack.kind != A.GAUSSIAN else attack.std
    name = attack.kind + (f":{_number(arg)}" if arg is not None else "") + (
        f" by {count} of {flags.shape[0]} clients" if count is not None else "")
    scenario = Scenario(name=f"attack {name}",
                        data=data if attack.kind == A.LABEL_FLIP else None, outputs=outputs)
    return _applied(algorithm, "attack", scenario, attack)


# ------------------------------------------------------------------------------ robust


def robust_combiner(rule: Aggregator) -> Combiner:
    """``rule`` in place of a step's UPDATE combinations: sum_k c_k U_k becomes
    (sum_k c_k) rule(U, c / sum_k c_k), the participants those with c_k > 0; EXTRA
    combinations stay the plain weighted sums. The rule's info is logged under
    ``robust/`` (its state, if any, follows the round's first combination)."""

    def combine(state, index, kind, tree, coefficients, ctx, key):
        del key
        if kind != UPDATE:
            return weighted_sum(tree, coefficients), state, {}
        total = jnp.sum(coefficients)
        share = coefficients / jnp.where(total > 0, total, 1.0)
        uploads = ClientOutput(delta=tree, loss_before=None, num_examples=None,
                               num_steps=None)
        out, new_state, info = rule.aggregate(
            state, uploads, share, ctx._replace(client_mask=coefficients > 0))
        out = jax.tree.map(lambda x: x * total.astype(x.dtype), out)
        return out, new_state if index == 0 else state, {f"robust/{k}": v
                                                          for k, v in info.items()}

    return Combiner(rule.init, combine)


def with_robust(algorithm: FederatedAlgorithm, rule: Aggregator,
                name: Optional[str] = None) -> FederatedAlgorithm:
    """``algorithm`` with ``rule`` (a scenarios/robust.py aggregator: ``coordinate_median()``,
    ``trimmed_mean(0.1)``, ``krum(1)``, ``geometric_median()``, ``norm_bounded(M)``)
    in place of its combination of the cohort's updates (``robust_combiner``); its
    mixing weights, other combinations and state stay its own. ``name`` describes the
    rule (the command line passes its ``--robust`` text). Refused for a method whose
    step is no such combination (DQN-Fed, FedMGDA+, ...)."""
    if not isinstance(rule, Aggregator):
        raise H.FieldTypeError("rule", f"must be an Aggregator (scenarios/robust.py), got "
                                       f"{type(rule).__name__}")
    return _applied(algorithm, "robust",
                    Scenario(name="robust aggregation" + (f" {name}" if name else ""),
                             combiner=robust_combiner(rule)))


# ----------------------------------------------------------------------------- privacy


def private_combiner(dp: P.ClientDP, releases: int) -> Combiner:
    """Each of a round's ``releases`` combinations replaced by ``privacy.privatize``'s
    release (clip C, coefficients capped at b and normalised, Gaussian noise) times
    sum_k c_k, at noise multiplier z sqrt(``releases``) each (together: z). The clip
    adapts (``dp.adaptive``) on the round's first combination, the update's. Logged:
    ``dp/clip``, ``dp/noise_std``, ``dp/clipped_fraction`` (simulation-only: it reads
    raw norms) and, adaptive, ``dp/unclipped_fraction``."""
    each = dp._replace(noise_multiplier=dp.noise_multiplier * math.sqrt(releases))

    def init(params, num_clients):
        del params, num_clients
        return P.init_clip_state(dp)

    def combine(state, index, kind, tree, coefficients, ctx, key):
        del kind, ctx
        total = jnp.sum(coefficients)
        direction, new_state, info = P.privatize(tree, coefficients, coefficients > 0,
                                                 jax.random.fold_in(key, index), each, state)
        direction = jax.tree.map(lambda x: x * total.astype(x.dtype), direction)
        keep = ("clip", "noise_std", "clipped_fraction", "unclipped_fraction")
        return direction, new_state if index == 0 else state, {
            f"dp/{k}": v for k, v in info.items() if k in keep}

    return Combiner(init, combine)


def releases(algorithm: FederatedAlgorithm) -> int:
    """J, the combinations a round of ``algorithm`` releases under ``with_privacy``."""
    return len(algorithm.server.combines or ()) if algorithm.server else 0


def with_privacy(algorithm: FederatedAlgorithm, dp: P.ClientDP) -> FederatedAlgorithm:
    """``algorithm`` under client-level DP (``private_combiner``): each of its J
    combinations per round clipped and noised, the noise multiplier
    ``dp.noise_multiplier`` standing for all J together, which is what the accountant
    (``privacy.Accountant.for_dp(dp, ...)``) takes. Refused for a method whose server
    reads more than its combinations cover (module docstring)."""
    if not isinstance(dp, P.ClientDP):
        raise H.FieldTypeError("dp", f"must be a privacy.ClientDP, got {type(dp).__name__}")
    check(algorithm, "privacy", "client-level DP")
    j = releases(algorithm)
    clip = f"clip {_number(dp.clip)}" + (
        f" adapted to the {_number(dp.adaptive.target_quantile)} quantile of the update "
        f"norms" if dp.adaptive is not None else "")
    name = (f"client-level DP (noise multiplier {_number(dp.noise_multiplier)} over {j} "
            f"release{'s' if j > 1 else ''} a round, {clip})")
    return algorithm.rebuild(algorithm.scenarios + (Scenario(name=name,
                                                             combiner=private_combiner(dp, j)),))


def _number(x) -> str:
    return f"{float(x):.4g}" if H.is_concrete(x) else "traced"


def names(algorithm: FederatedAlgorithm) -> list:
    """The applied scenarios' names, in the order they were applied."""
    return [s.name for s in algorithm.scenarios]


__all__ = ["KINDS", "Refused", "check", "names", "private_combiner", "refusal", "releases",
           "robust_combiner", "scenario_table", "with_attack", "with_privacy", "with_robust"]


def _cell(why: Optional[str], accepted: str) -> str:
    return accepted if why is None else "refused"


def scenario_table(algorithms: dict) -> str:
    """The markdown table of what each scenario does to each method of ``algorithms``
    (name -> ``FederatedAlgorithm``), from their declarations (``algorithm.server``):
    its combinations, its other reads, whether its weights are separable, and per
    scenario "combination" / "J releases" / "uploads" / "data" or "refused"."""
    rows = ["| method | combinations | other reads | separable weights | update attacks "
            "| label flipping | robust rule replaces | private release |",
            "|---|---|---|---|---|---|---|---|"]
    for name, alg in algorithms.items():
        server = alg.server
        combines = ", ".join(server.combines) if server.combines is not None else "none"
        update = _cell(refusal(alg, "attack", A.Attack(A.SIGN_FLIP)), "its uploads")
        flip = _cell(refusal(alg, "attack", A.Attack(A.LABEL_FLIP)), "its data")
        n_updates = sum(kind == UPDATE for kind in server.combines or ())
        rob = _cell(refusal(alg, "robust"), f"{n_updates} update combination"
                    + ("s" if n_updates > 1 else ""))
        j = releases(alg)
        dp = _cell(refusal(alg, "privacy"), f"{j} release" + ("s" if j > 1 else ""))
        rows.append(f"| {name} | {combines} | {_words(server.reads) or '-'} | "
                    f"{'yes' if server.separable else 'no'} | {update} | {flip} | {rob} | {dp} |")
    return "\n".join(rows)
