"""Scenarios: the conditions a federated method runs under, as library values.

Between the round contract (``fedjax_fair.core``) and the methods
(``fedjax_fair.algorithms``); no module here parses command-line text (that is
``fedjax_fair.cli.parsing``).

* Who takes part: ``sampling`` (cohort samplers), ``system`` (availability,
  dropouts and a virtual clock with deadlines), ``heterogeneity`` (per-round
  local-step budgets).
* How rates move: ``schedules`` (round-indexed learning-rate schedules).
* What a method is wrapped in (``wrap``, re-exported here: docs/scenarios.md):
  ``with_attack`` (``attacks``: malicious clients), ``with_robust`` (``robust``:
  Byzantine-robust combinations) and ``with_privacy`` (``privacy``: client-level DP
  and its accountant). Each returns the same method under the scenario, or raises
  ``Refused`` in one line when the method's server reads what the scenario cannot
  cover.
"""
from fedjax_fair.scenarios.wrap import (KINDS, Refused, check, names, private_combiner,
                                        refusal, releases, robust_combiner, scenario_table,
                                        with_attack, with_privacy, with_robust)

__all__ = ["KINDS", "Refused", "check", "names", "private_combiner", "refusal", "releases",
           "robust_combiner", "scenario_table", "with_attack", "with_privacy", "with_robust"]
