"""scenarios/wrap.py: attacks, robust rules and client-level DP applied to a method
(``with_attack``, ``with_robust``, ``with_privacy``), checked on whole rounds against
what each scenario means, and across the registry: every method under every scenario
runs or is refused with one line, and each scenario's limit is the method itself."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from fedjax_fair.algorithms import REGISTRY, FAMILIES, build, get_method
from fedjax_fair.scenarios import attacks, privacy, robust
from fedjax_fair import scenarios as S
from fedjax_fair.scenarios import system as SY
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.drivers.simulate import simulate
from fedjax_fair.cli.parsing import parse_robust
from helpers import assert_trees_close, cohort, init_params, logreg, tiny_federation, tree_sub

TRAINING = ClientTraining(lr=0.1, batch_size=4)
IDS = (0, 1, 3, 4)  # clients with data


def _round(name, apply_scenarios=lambda a: a, data=None, key=1, **kwargs):
    """(new state, round metrics, old params) of one round of ``name`` on clients
    ``IDS`` under ``apply_scenarios``."""
    model = logreg()
    data = data or tiny_federation()
    alg = apply_scenarios(build(name, model, training=TRAINING, **kwargs))
    params = init_params(model)
    state, metrics = jax.jit(alg.apply)(alg.init(params, data.num_clients),
                                        cohort(data.train, IDS), jax.random.key(key))
    return state, metrics, params


def _flags(*ids, n=6):
    flags = np.zeros(n, bool)
    flags[list(ids)] = True
    return flags


def _attack(kind, *ids, **kw):
    return lambda alg: S.with_attack(alg, attacks.Attack(kind, **kw), _flags(*ids))


def _dp(noise=1.0, clip=0.5, **kw):
    return lambda alg: S.with_privacy(alg, privacy.ClientDP(noise, clip, **kw))


def _robust(text):
    return lambda alg: S.with_robust(alg, parse_robust(text), text)


# ------------------------------------------------------------------------- attacks


def test_every_client_sign_flipping_reverses_fedavgs_step():
    clean, _, params = _round("fedavg")
    attacked, metrics, _ = _round("fedavg", _attack("sign_flip", *range(6), scale=1.0))
    assert_trees_close(tree_sub(attacked.params, params), tree_sub(params, clean.params))
    assert np.asarray(metrics["attack/malicious"]).all()


def test_only_the_malicious_clients_uploads_change():
    """One sign-flipping client of four under uniform weights moves FedAvg's step by
    -2 w_k Delta_k: the difference to the clean round is the attacker's own update."""
    clean, _, params = _round("fedavg", weight_by_size=False)
    attacked, metrics, _ = _round("fedavg", _attack("sign_flip", 3, scale=1.0),
                                  weight_by_size=False)
    np.testing.assert_array_equal(metrics["attack/malicious"], [False, False, True, False])
    shift = tree_sub(attacked.params, clean.params)  # = +2 (1/4) Delta_3 ...
    model, data = logreg(), tiny_federation()
    alg = build("fedavg", model, training=TRAINING)
    state, _ = jax.jit(alg.apply)(alg.init(params, data.num_clients),
                                  cohort(data.train, (3,)), jax.random.key(1))
    solo = tree_sub(params, state.params)  # ... with Delta_3 = params - client 3's model
    assert_trees_close(shift, jax.tree.map(lambda d: 0.5 * d, solo), rtol=1e-4, atol=1e-6)


def test_label_flipping_trains_on_the_flipped_labels():
    data = tiny_federation()
    flipped = data._replace(train=data.train._replace(  # padding rows are masked anyway
        examples={**data.train.examples, "y": 2 - data.train.examples["y"]}))
    expected, _, _ = _round("qffl", data=flipped)
    attacked, _, _ = _round("qffl", _attack("label_flip", *range(6), num_classes=3))
    assert_trees_close(attacked.params, expected.params)


# --------------------------------------------------------------------------- robust


def test_a_robust_rule_replaces_fedavgs_combination():
    direct, _, _ = _round("fedavg", aggregator=robust.coordinate_median())
    hooked, _, _ = _round("fedavg", _robust("median"))
    assert_trees_close(hooked.params, direct.params)
    _, metrics, _ = _round("fedavg", _robust("norm_bound:0.01"))
    assert "robust/clip_scale" in metrics
    with pytest.raises(ValueError, match="^robust"):
        parse_robust("trimmed_mean:0.7")


def test_a_robust_rule_keeps_the_methods_weights_and_state():
    """q-FFL's coefficients reach a weighted median (so its step differs from FedAvg's
    under the same rule), and SCAFFOLD's control variate still updates."""
    qffl, qm, _ = _round("qffl", _robust("weighted_median"), q=5.0)
    fedavg, _, _ = _round("fedavg", _robust("weighted_median"))
    assert not np.allclose(jax.tree.leaves(qffl.params)[0], jax.tree.leaves(fedavg.params)[0])
    assert "server/coefficients" in qm  # the method's own step ran
    scaffold, _, _ = _round("scaffold", _robust("median"))
    assert helpers.tree_norm(scaffold.aggregator_state.control) > 0


def test_robust_rules_scale_back_unnormalised_coefficients():
    """sum_k c_k U_k with c summing to s becomes s Rule(U, c / s): with identical
    uploads every rule gives s U."""
    from fedjax_fair.core.types import ServerContext
    u = {"w": jnp.tile(jnp.arange(3.0)[None], (4, 1))}
    c = jnp.array([0.1, 0.2, 0.0, 0.3])
    ctx = ServerContext(params={"w": jnp.zeros(3)}, round=jnp.zeros((), jnp.int32),
                        key=jax.random.key(0), client_ids=jnp.arange(4),
                        client_mask=jnp.ones(4, bool))
    for text in ("median", "weighted_median", "trimmed_mean:0.25", "krum", "geometric_median",
                 "norm_bound:100"):
        combiner = S.robust_combiner(parse_robust(text))
        out, _, _ = combiner.combine(combiner.init(ctx.params, 4), 0, "update", u, c, ctx,
                                     jax.random.key(1))
        np.testing.assert_allclose(out["w"], 0.6 * np.arange(3.0), rtol=1e-5, err_msg=text)


def test_trimmed_mean_traces_through_the_trim_fraction():
    """``jax.grad`` and ``jax.vmap`` pass through a robust round (the trim fraction
    traced, one program)."""
    model, data = logreg(), tiny_federation()
    params = init_params(model)

    def loss(trim):
        alg = S.with_robust(build("fedavg", model, training=TRAINING), robust.trimmed_mean(trim))
        state, m = alg.apply(alg.init(params, data.num_clients), cohort(data.train, IDS),
                             jax.random.key(0))
        return jnp.sum(jnp.square(jax.tree.leaves(state.params)[0]))

    values = jax.jit(jax.vmap(loss))(jnp.array([0.0, 0.25]))
    assert np.isfinite(values).all() and values[0] != values[1]
    g = jax.jit(jax.grad(lambda c: loss(0.25) + c))(0.0)
    assert np.isfinite(g)


# -------------------------------------------------------------------------- privacy


def test_dp_without_noise_and_clipping_is_the_plain_average():
    plain, _, _ = _round("fedavg", weight_by_size=False)
    private, metrics, _ = _round("fedavg", _dp(0.0, 1e6), weight_by_size=False)
    assert_trees_close(private.params, plain.params)
    assert float(metrics["dp/clipped_fraction"]) == 0.0


def test_dp_noise_is_calibrated_keyed_and_split_over_the_releases():
    one, metrics, params = _round("fedavg", _dp(), key=3)
    again, _, _ = _round("fedavg", _dp(), key=3)
    other, _, _ = _round("fedavg", _dp(), key=4)
    assert_trees_close(one.params, again.params, rtol=0, atol=0)
    assert not np.allclose(one.params["params"]["Dense_0"]["kernel"],
                           other.params["params"]["Dense_0"]["kernel"])
    assert float(metrics["dp/noise_std"]) == pytest.approx(1.0 * 2 * 0.5 / len(IDS))
    # SCAFFOLD releases two sums a round (updates, control variates): each at z sqrt(2)
    _, sm, _ = _round("scaffold", _dp())
    assert S.releases(S.with_privacy(build("scaffold", logreg()),
                                     privacy.ClientDP(1.0, 0.5))) == 2
    assert float(sm["dp/noise_std"]) == pytest.approx(math.sqrt(2) * 2 * 0.5 / len(IDS),
                                                      rel=1e-6)
    assert "dp/noise_std_1" in sm


def test_dp_vmaps_over_seeds_and_differentiates_through_the_clip():
    model, data = logreg(), tiny_federation()
    params = init_params(model)

    def final(clip, key):
        alg = S.with_privacy(build("fedcm", model, training=TRAINING),
                             privacy.ClientDP(0.5, clip))
        state, _ = alg.apply(alg.init(params, data.num_clients), cohort(data.train, IDS), key)
        return jnp.sum(jnp.square(jax.tree.leaves(state.params)[0]))

    keys = jax.random.split(jax.random.key(0), 3)
    values = jax.jit(jax.vmap(lambda k: final(0.05, k)))(keys)
    assert values.shape == (3,) and len(set(np.asarray(values).tolist())) == 3
    g = jax.jit(jax.grad(final))(0.05, keys[0])
    assert np.isfinite(g) and g != 0


# --------------------------------------------------------------------- composition


def test_scenarios_are_values_applied_in_order_without_global_state():
    model = logreg()
    base = build("qffl", model, training=TRAINING)
    alg = S.with_robust(S.with_attack(base, attacks.Attack("sign_flip"), _flags(1)),
                        robust.coordinate_median(), "median")
    assert [s.name.split()[0] for s in alg.scenarios] == ["attack", "robust"]
    assert S.names(alg)[0] == "attack sign_flip by 1 of 6 clients"
    assert base.scenarios == () and build("qffl", model).scenarios == ()
    with pytest.raises(S.Refused) as e:  # one combination, one replacement
        S.with_privacy(alg, privacy.ClientDP(1.0, 1.0))
    assert e.value.field == "privacy" and "\n" not in str(e.value)
    assert "qffl" in str(e.value)


def test_derived_methods_stay_derived_under_scenarios():
    """FedBuff's clock flag, FedNew's dual update and the improvement log survive
    being rebuilt with a scenario."""
    from fedjax_fair.core.algorithm import with_improvement
    model = logreg()
    assert S.with_robust(build("fedbuff", model), robust.coordinate_median()).clock
    improved = with_improvement(build("fedavg", model, training=TRAINING), model)
    private = S.with_privacy(improved, privacy.ClientDP(0.0, 1e6))
    data, params = tiny_federation(), init_params(model)
    _, m = jax.jit(private.apply)(private.init(params, 6), cohort(data.train, IDS),
                                  jax.random.key(0))
    assert "improved_fraction" in m and "dp/clip" in m


# ----------------------------------------------------------------- the registry


def _model_for(name):
    from fedjax_fair.models import get_model
    if name in ("lg_fedavg", "fedper", "fedrep"):  # keep a layer local: need two
        model = get_model("mlp", (helpers.NUM_FEATURES,), helpers.NUM_CLASSES, hidden=(4,))
        return model, model.init(jax.random.key(0))
    return helpers.ENGINE_MODEL, helpers.ENGINE_PARAMS


SCENARIOS = {
    "median": _robust("median"), "weighted_median": _robust("weighted_median"),
    "trimmed_mean": _robust("trimmed_mean:0.25"), "krum": _robust("krum:1"),
    "multi_krum": _robust("multi_krum:1:2"), "geometric_median": _robust("geometric_median:4"),
    "norm_bound": _robust("norm_bound:0.5"),
    "dp": _dp(0.5, 1.0),
    "dp_adaptive": _dp(0.5, 1.0, adaptive=privacy.AdaptiveClip(cohort_size=4.0)),
    "label_flip": _attack("label_flip", 1, 3, num_classes=helpers.NUM_CLASSES),
    "sign_flip": _attack("sign_flip", 1, 3), "gaussian": _attack("gaussian", 1, 3),
    "scaled_replacement": _attack("scaled_replacement", 1, 3),
}
SYSTEMS = {
    "availability": lambda: SY.system(SY.independent(0.7)),
    "dropout": lambda: SY.system(dropout=0.3),
    "deadline": lambda: SY.system(clock=SY.clock(
        SY.lognormal(6, 4.0, 0.5), deadline=1.0, training=ClientTraining(batch_size=4))),
}


# the default suite's method of each family: the one whose server step exercises the
# most of the contract (per-client state, a second combination, separable weights)
REPRESENTATIVES = {"reference": "fedavg", "server": "fedadam", "fair": "qffl",
                   "primal_dual": "scaffold", "second_order": "fednew",
                   "personalised": "ditto", "participation": "fedbuff",
                   "generative": "fedcvae"}
DEFAULT = set(REPRESENTATIVES.values())
DEFAULT_SCENARIOS = {"median", "dp", "sign_flip"}


def test_the_default_suite_covers_every_family():
    assert {get_method(n).family: n for n in DEFAULT}.keys() == set(FAMILIES)
    assert all(get_method(n).family == f for f, n in REPRESENTATIVES.items())


def _cases():
    for name in sorted(REGISTRY):
        for scenario in [*SCENARIOS, *SYSTEMS]:
            fast = name in DEFAULT and scenario in DEFAULT_SCENARIOS or (
                name == "fedavg")
            yield pytest.param(name, scenario, marks=() if fast else pytest.mark.slow,
                               id=f"{name}-{scenario}")


def _run_two_rounds(alg, params, system=None, key=0):
    n = helpers.ENGINE_N
    full = get_method(alg.name).participation == "full"
    state = alg.init(params, n)
    return jax.jit(lambda s, k: simulate(alg, s, helpers.ENGINE_DATA, k, num_rounds=2,
                                         cohort_size=n if full else 4,
                                         execution="sequential", system=system))(
        state, jax.random.key(key))


@pytest.mark.parametrize("name,scenario", list(_cases()))
def test_every_method_under_every_scenario_runs_or_is_refused_in_one_line(name, scenario):
    model, params = _model_for(name)
    base = build(name, model)
    system = None
    if scenario in SYSTEMS:
        alg, system = base, SYSTEMS[scenario]()
    else:
        try:
            alg = SCENARIOS[scenario](base)
        except S.Refused as e:
            assert "\n" not in str(e) and name in str(e) and e.field in S.KINDS
            return
        assert len(alg.scenarios) == 1
    try:
        state, metrics = _run_two_rounds(alg, params, system)
    except (ValueError, TypeError) as e:  # a system the method cannot take: one line
        assert system is not None and "\n" not in str(e).strip(), e
        return
    assert int(state.round) == 2
    assert helpers.tree_all_finite(state.params)


def _states_differ(a, b) -> bool:
    return any(not np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("name", [n if n in DEFAULT | {"fedcm"}
                                  else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(REGISTRY)])
def test_each_scenarios_limit_is_the_method_itself(name):
    """Per method, for each scenario it accepts: DP with zero noise, no cap on the
    weights and a clip no upload reaches; a robust rule when every client sends the same
    update (here: one client in the cohort); an attack on no client. Each gives the
    method's own round; and the method's server state changes in a round under each."""
    model, params = _model_for(name)
    data = helpers.ENGINE_DATA
    full = get_method(name).participation == "full"
    base = build(name, model)
    # one participant: every client of the round sends the same update (the other
    # slots masked, so that the round with all of them unmasked reuses the program)
    ids = range(6) if full else IDS
    one = cohort(data.train, ids, mask=[True] + [False] * (len(ids) - 1))
    key = jax.random.key(5)
    limits = {"privacy": lambda a: S.with_privacy(a, privacy.ClientDP(0.0, 1e9,
                                                                      max_weight=1.0)),
              "attack": lambda a: S.with_attack(a, attacks.Attack("sign_flip"), _flags()),
              "robust": lambda a: S.with_robust(a, robust.coordinate_median())}
    for kind, limit in limits.items():
        try:
            alg = limit(base)
        except S.Refused:
            continue
        expected, _ = jax.jit(base.apply)(base.init(params, 6), one, key)
        got, _ = jax.jit(alg.apply)(alg.init(params, 6), one, key)
        for field in ("params", "opt_state", "mixing_state", "aggregator_state"):
            assert_trees_close(getattr(got, field), getattr(expected, field), rtol=2e-5,
                               atol=2e-6)
        start = alg.init(params, 6)
        moved = jax.jit(alg.apply)(start, cohort(data.train, ids), key)[0]
        assert _states_differ(moved[:4], start[:4]), kind  # FedBuff's first: a dispatch
        for field in ("mixing_state", "aggregator_state"):
            if jax.tree.leaves(getattr(start, field)):
                assert _states_differ(getattr(moved, field), getattr(start, field)), (kind,
                                                                                      field)


def test_the_issue_commands_run_as_the_named_method_or_are_refused():
    """SCAFFOLD under a median keeps its control variates, FedCM under DP its momentum,
    DQN-Fed under a median is refused in one line."""
    model, params = helpers.ENGINE_MODEL, helpers.ENGINE_PARAMS
    scaffold = _robust("median")(build("scaffold", model))
    state, _ = _run_two_rounds(scaffold, params)
    assert helpers.tree_norm(state.aggregator_state.control) > 0
    fedcm = _dp(0.5, 1.0)(build("fedcm", model))
    state, _ = _run_two_rounds(fedcm, params)
    assert helpers.tree_norm(state.aggregator_state.momentum) > 0
    fedavg, _ = _run_two_rounds(_dp(0.5, 1.0)(build("fedavg", model)), params)
    assert _states_differ(state.params, fedavg.params)  # the same noise, FedCM's steps
    with pytest.raises(S.Refused, match="^robust: dqn_fed"):
        _robust("median")(build("dqn_fed", model))


# ----------------------------------------------------------------------- the docs

DOCS = __import__("pathlib").Path(__file__).resolve().parents[1] / "docs"


def _python_blocks(page):
    import re
    return re.findall(r"^```python\n(.*?)^```", (DOCS / page).read_text("utf-8"),
                      flags=re.M | re.S)


@pytest.mark.parametrize("page", ["scenarios.md", "robustness.md"])
def test_the_pages_python_blocks_run(page, capsys):
    blocks = _python_blocks(page)
    assert blocks
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/{page}[python {i}]", "exec"), namespace)
    if page == "scenarios.md":
        out = capsys.readouterr().out
        assert "attack sign_flip:5 by 4 of 20 clients" in out and "\n2\n" in out
        assert "robust: dqn_fed with" in out


def test_the_scenario_table_is_generated_from_the_declarations():
    """docs/scenarios.md's table is ``fedjax-fair list scenarios``'s (regenerate it with
    ``python -c "from fedjax_fair.cli.listing import registry_scenario_table as t;
    print(t())"``)."""
    from fedjax_fair.cli.listing import registry_scenario_table
    text = (DOCS / "scenarios.md").read_text("utf-8")
    begin, end = "<!-- scenario-table: begin -->\n", "\n<!-- scenario-table: end -->"
    shown = text[text.index(begin) + len(begin):text.index(end)]
    assert shown == registry_scenario_table()
