"""Client-level DP (fedjax_fair/scenarios/privacy.py): clipping, weight capping, noise
calibration, adaptive clipping, accounting against dp-accounting, validation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_fair.scenarios import privacy as P
from fedjax_fair.hparams import FieldError

dp_accounting = pytest.importorskip("dp_accounting")
from dp_accounting import pld, rdp  # noqa: E402

K = 4


def _stack(key=0, scale=3.0):
    k1, k2 = jax.random.split(jax.random.key(key))
    return {"w": scale * jax.random.normal(k1, (K, 3, 2)), "b": scale * jax.random.normal(k2, (K, 2))}


def _norm(tree):
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(x))) for x in jax.tree.leaves(tree))))


# ---------------------------------------------------------------------------- clipping

def test_clip_update_bounds_the_pytree_norm_and_keeps_short_updates():
    # each leaf has norm 0.8 < 1, the tree 0.8 sqrt(2) > 1: clipped as a whole
    delta = {"a": jnp.array([0.8, 0.0]), "b": jnp.array([[0.0], [0.8]])}
    clipped, norm = P.clip_update(delta, 1.0)
    assert float(norm) == pytest.approx(0.8 * np.sqrt(2), rel=1e-6)
    assert _norm(clipped) == pytest.approx(1.0, rel=1e-6)
    np.testing.assert_allclose(clipped["a"], delta["a"] / (0.8 * np.sqrt(2)), rtol=1e-6)
    short, norm = P.clip_update(delta, 2.0)
    for x, y in zip(jax.tree.leaves(short), jax.tree.leaves(delta)):
        np.testing.assert_array_equal(x, y)
    zero, norm = P.clip_update(jax.tree.map(jnp.zeros_like, delta), 1.0)
    assert float(norm) == 0.0 and _norm(zero) == 0.0


def test_clip_update_with_traced_clip_under_vmap_and_grad():
    delta = {"a": jnp.array([3.0, 4.0])}
    norms = jax.vmap(lambda c: _tree_norm_of(P.clip_update(delta, c)[0]))(jnp.array([1.0, 2.0, 9.0]))
    np.testing.assert_allclose(norms, [1.0, 2.0, 5.0], rtol=1e-6)
    g = jax.grad(lambda c: P.clip_update(delta, c)[0]["a"].sum())(1.0)
    assert float(g) == pytest.approx(7.0 / 5.0, rel=1e-6)
    g0 = jax.grad(lambda x: P.clip_update({"a": x}, 1.0)[0]["a"].sum())(jnp.zeros(2))
    assert np.all(np.isfinite(g0))


def _tree_norm_of(tree):
    return jnp.sqrt(sum(jnp.sum(x ** 2) for x in jax.tree.leaves(tree)))


# ----------------------------------------------------------------------------- weights

def test_cap_weights_caps_renormalises_and_keeps_ratios():
    w = jnp.array([0.6, 0.2, 0.1, 0.05, 0.05, 0.0])
    mask = jnp.array([1, 1, 1, 1, 1, 1], bool)
    capped = np.asarray(P.cap_weights(w, mask, 0.3))
    assert capped.max() <= 0.3 + 1e-7
    assert capped.sum() == pytest.approx(1.0, abs=1e-6)
    assert capped[0] == pytest.approx(0.3)
    np.testing.assert_allclose(capped[2] / capped[3], 2.0, rtol=1e-5)  # uncapped ratio kept
    assert capped[5] == 0.0
    # a cascade: once 0.6 is capped, 0.2 rescaled exceeds the cap too
    capped = np.asarray(P.cap_weights(w, mask, 0.25))
    np.testing.assert_allclose(capped[:2], [0.25, 0.25], rtol=1e-6)
    assert capped.sum() == pytest.approx(1.0, abs=1e-6)
    # fewer than 1/b clients with weight: each gets b, total n b < 1
    capped = np.asarray(P.cap_weights(jnp.array([0.5, 0.5, 0.0, 0.0]), jnp.ones(4, bool), 0.25))
    np.testing.assert_allclose(capped, [0.25, 0.25, 0.0, 0.0])
    # masked-out clients never get weight, whatever they were given
    capped = np.asarray(P.cap_weights(jnp.array([0.9, 0.1, 0.1, 0.1]), jnp.array([0, 1, 1, 1], bool),
                                      0.5))
    assert capped[0] == 0.0 and capped.sum() == pytest.approx(1.0, abs=1e-6)


# -------------------------------------------------------------------------- privatize

def test_noise_std_is_calibrated_to_two_c_max_weight():
    deltas = _stack()
    weights = jnp.array([0.7, 0.1, 0.1, 0.1])
    mask = jnp.ones(K, bool)
    dp = P.ClientDP(noise_multiplier=1.3, clip=0.5, max_weight=0.4)
    exact, _, _ = P.privatize(deltas, weights, mask, jax.random.key(0), dp._replace(noise_multiplier=0.0))
    keys = jax.random.split(jax.random.key(1), 4000)
    noisy, _, info = jax.jit(jax.vmap(lambda k: P.privatize(deltas, weights, mask, k, dp)))(keys)
    resid = np.concatenate([np.asarray(n - e[None]).reshape(4000, -1)
                            for n, e in zip(jax.tree.leaves(noisy), jax.tree.leaves(exact))], axis=1)
    expected = 1.3 * 2 * 0.5 * 0.4
    assert float(info["noise_std"][0]) == pytest.approx(expected, rel=1e-6)
    assert resid.std() == pytest.approx(expected, rel=0.05)
    assert abs(resid.mean()) < 0.05 * expected
    # the weights were capped at max_weight and the exact sum used the clipped updates
    assert float(info["dp_weights"][0].max()) <= 0.4 + 1e-7
    assert float(info["clipped_fraction"][0]) == 1.0  # every norm ~ 3 sqrt(8) > 0.5
    w = np.asarray(P.cap_weights(weights, mask, 0.4))
    clipped = jax.vmap(P.clip_update, in_axes=(0, None))(deltas, 0.5)[0]
    np.testing.assert_allclose(exact["b"], np.tensordot(w, np.asarray(clipped["b"]), axes=1),
                               rtol=1e-5, atol=1e-6)


def test_default_max_weight_is_one_over_the_cohort():
    dp = P.ClientDP(noise_multiplier=1.0, clip=2.0)
    _, _, info = P.privatize(_stack(), jnp.ones(K) / K, jnp.ones(K, bool), jax.random.key(0), dp)
    assert float(info["noise_std"]) == pytest.approx(1.0 * 2 * 2.0 / K)
    np.testing.assert_allclose(info["dp_weights"], np.full(K, 1 / K))


def test_masked_slots_never_contribute():
    deltas = _stack()
    mask = jnp.array([1, 1, 0, 1], bool)
    weights = jnp.array([0.25, 0.25, 0.25, 0.25])
    dp = P.ClientDP(noise_multiplier=0.7, clip=1.0, max_weight=0.5)
    key = jax.random.key(3)
    out, _, info = P.privatize(deltas, weights, mask, key, dp)
    poisoned = jax.tree.map(lambda x: x.at[2].set(jnp.nan), deltas)
    out2, _, info2 = P.privatize(poisoned, weights.at[2].set(100.0), mask, key, dp)
    for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(out2)):
        assert np.all(np.isfinite(y))
        np.testing.assert_allclose(x, y, rtol=1e-6)
    assert float(info2["dp_weights"][2]) == 0.0
    assert float(info2["clipped_fraction"]) == pytest.approx(1.0)  # over the 3 participants


def test_deterministic_in_the_key():
    deltas, weights, mask = _stack(), jnp.ones(K) / K, jnp.ones(K, bool)
    dp = P.ClientDP(noise_multiplier=1.0, clip=1.0)
    a = P.privatize(deltas, weights, mask, jax.random.key(5), dp)[0]
    b = P.privatize(deltas, weights, mask, jax.random.key(5), dp)[0]
    c = P.privatize(deltas, weights, mask, jax.random.key(6), dp)[0]
    for x, y, z in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(c)):
        np.testing.assert_array_equal(x, y)
        assert not np.allclose(x, z)


def test_vmap_over_noise_multiplier():
    deltas, weights, mask = _stack(), jnp.ones(K) / K, jnp.ones(K, bool)
    dp = P.ClientDP(noise_multiplier=1.0, clip=1.0)
    zs = jnp.array([0.0, 1.0, 2.0])
    run = jax.jit(jax.vmap(lambda z: P.privatize(deltas, weights, mask, jax.random.key(0),
                                                 dp._replace(noise_multiplier=z))))
    out, _, info = run(zs)
    np.testing.assert_allclose(info["noise_std"], zs * 2 * 1.0 / K, rtol=1e-6)
    for x in jax.tree.leaves(out):
        noise1, noise2 = x[1] - x[0], x[2] - x[0]
        assert np.abs(noise1).max() > 0
        np.testing.assert_allclose(noise2, 2 * noise1, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------ adaptive clipping

def _adapt(dp, deltas, steps=100):
    mask = jnp.ones(jax.tree.leaves(deltas)[0].shape[0], bool)

    def step(state, key):
        _, state, info = P.privatize(deltas, jnp.ones(mask.shape), mask, key, dp, state)
        return state, info["unclipped_fraction"]

    return jax.lax.scan(step, P.init_clip_state(dp), jax.random.split(jax.random.key(0), steps))


def test_adaptive_clip_converges_to_the_target_quantile():
    norms = jnp.linspace(1.0, 100.0, 101)              # median 50.5, 0.9-quantile 90.1
    deltas = {"v": jnp.stack([norms, jnp.zeros_like(norms)], axis=1)}
    dp = P.ClientDP(noise_multiplier=0.0, clip=1.0,
                    adaptive=P.AdaptiveClip(target_quantile=0.5, learning_rate=0.2,
                                            count_noise_multiplier=0.0))
    state, fractions = _adapt(dp, deltas)
    assert float(state.clip) == pytest.approx(50.5, rel=0.05)
    assert float(fractions[-1]) == pytest.approx(0.5, abs=0.05)
    # another quantile, approached from above
    dp90 = dp._replace(clip=500.0, adaptive=dp.adaptive._replace(target_quantile=0.9))
    state, _ = _adapt(dp90, deltas)
    assert float(state.clip) == pytest.approx(90.1, rel=0.05)


def test_adaptive_count_noise_is_used_and_keyed():
    norms = jnp.linspace(1.0, 2.0, 8)
    mask = jnp.ones(8, bool)
    ad = P.AdaptiveClip(count_noise_multiplier=2.0)
    fr = jax.vmap(lambda k: P.adaptive_clip_step(jnp.float32(1.5), norms, mask, k, ad)[1])(
        jax.random.split(jax.random.key(0), 4000))
    assert float(fr.mean()) == pytest.approx(0.5, abs=0.02)
    assert float(fr.std()) == pytest.approx(2.0 / 8, rel=0.05)
    default = P.AdaptiveClip()  # sigma_b = m / 20: std 0.05 on the fraction
    fr = jax.vmap(lambda k: P.adaptive_clip_step(jnp.float32(1.5), norms, mask, k, default)[1])(
        jax.random.split(jax.random.key(1), 4000))
    assert float(fr.std()) == pytest.approx(0.05, rel=0.05)


def test_effective_noise_multiplier_matches_composed_release():
    ad = P.AdaptiveClip(count_noise_multiplier=5.0)
    dp = P.ClientDP(noise_multiplier=1.1, clip=1.0, sampling="poisson", adaptive=ad)
    z = P.effective_noise_multiplier(dp)
    assert z == pytest.approx((1.1 ** -2 + 10.0 ** -2) ** -0.5)
    assert P.update_noise_multiplier(z, 5.0, "poisson") == pytest.approx(1.1)
    assert P.effective_noise_multiplier(dp._replace(sampling="fixed")) == pytest.approx(
        (1.1 ** -2 + 5.0 ** -2) ** -0.5)
    # dp-accounting's own view of the two Gaussian releases on the same sample
    both = dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(1.1),
                                          dp_accounting.GaussianDpEvent(10.0)])
    acc = rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(0.05, both), 50)
    assert P.epsilon(z, 0.05, 50, 1e-6) == pytest.approx(acc.get_epsilon(1e-6), rel=1e-9)
    with pytest.raises(FieldError) as e:
        P.update_noise_multiplier(3.0, 1.0, "poisson")
    assert e.value.field == "count_noise_multiplier"
    with pytest.raises(FieldError) as e:
        P.effective_noise_multiplier(dp._replace(adaptive=P.AdaptiveClip()))
    assert e.value.field == "cohort_size"


# ------------------------------------------------------------------------ accounting

def test_epsilon_equals_dp_accounting_poisson_rdp_and_pld():
    ev = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(2.0)), 50)
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    assert P.epsilon(2.0, 0.05, 50, 1e-5) == acc.compose(ev).get_epsilon(1e-5)
    acc = pld.PLDAccountant()
    ref = acc.compose(ev).get_epsilon(1e-5)
    assert P.epsilon(2.0, 0.05, 50, 1e-5, accountant="pld") == ref
    assert ref < P.epsilon(2.0, 0.05, 50, 1e-5)  # PLD is tighter than RDP here
    assert P.epsilon(0.0, 0.02, 10, 1e-5) == np.inf
    assert P.epsilon(1.0, 0.02, 0, 1e-5) == 0.0


def test_epsilon_equals_dp_accounting_fixed_size_rdp():
    ev = dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(500, 10, dp_accounting.GaussianDpEvent(1.2)), 100)
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    assert P.epsilon(1.2, 10 / 500, 100, 1e-5, sampling="fixed", population=500) == \
        acc.compose(ev).get_epsilon(1e-5)
    with pytest.raises(FieldError) as e:
        P.epsilon(1.2, 0.02, 100, 1e-5, sampling="fixed", accountant="pld", population=500)
    assert e.value.field == "accountant"
    with pytest.raises(FieldError) as e:
        P.epsilon(1.2, 0.021, 100, 1e-5, sampling="fixed", population=500)
    assert e.value.field == "sampling_probability"
    with pytest.raises(FieldError) as e:
        P.epsilon(1.2, 0.02, 100, 1e-5, sampling="fixed")
    assert e.value.field == "population"


@pytest.mark.parametrize("kw", [dict(), dict(sampling="fixed", population=500)],
                         ids=["poisson", "fixed"])
def test_noise_for_epsilon_inverts_epsilon_on_the_private_side(kw):
    z = P.noise_for_epsilon(3.0, 0.02, 100, 1e-5, rtol=1e-3, **kw)
    eps = P.epsilon(z, 0.02, 100, 1e-5, **kw)
    assert 0.99 * 3.0 <= eps <= 3.0


def test_accountant_caches_and_grows_with_rounds():
    acc = P.Accountant(1.0, 0.05, 1e-5)
    e10, e20 = acc.epsilon(10), acc.epsilon(20)
    assert 0 < e10 < e20 == P.epsilon(1.0, 0.05, 20, 1e-5)
    acc._cache[20] = -1.0
    assert acc.epsilon(20) == -1.0  # answered from the cache, not recomputed
    dp = P.ClientDP(1.0, 1.0, sampling="poisson",
                    adaptive=P.AdaptiveClip(count_noise_multiplier=None, cohort_size=20))
    via_dp = P.Accountant.for_dp(dp, 0.05, 1e-5)
    assert via_dp.noise_multiplier == pytest.approx((1.0 + 2.0 ** -2) ** -0.5)
    assert via_dp.epsilon(10) > e10


# ------------------------------------------------------------------------ validation

@pytest.mark.parametrize("kwargs, field", [
    (dict(noise_multiplier=-0.1, clip=1.0), "noise_multiplier"),
    (dict(noise_multiplier=1.0, clip=0.0), "clip"),
    (dict(noise_multiplier=1.0, clip=-2.0), "clip"),
    (dict(noise_multiplier=1.0), "clip"),
    (dict(noise_multiplier=1.0, clip=1.0, delta=0.0), "delta"),
    (dict(noise_multiplier=1.0, clip=1.0, delta=1.0), "delta"),
    (dict(clip=1.0, delta=1e-5, target_epsilon=0.0), "target_epsilon"),
    (dict(clip=1.0, delta=1e-5, target_epsilon=-1.0), "target_epsilon"),
    (dict(noise_multiplier=1.0, clip=1.0, delta=1e-5, target_epsilon=2.0), "target_epsilon"),
    (dict(clip=1.0), "noise_multiplier"),
    (dict(clip=1.0, target_epsilon=2.0), "delta"),
    (dict(noise_multiplier=1.0, clip=1.0, max_weight=1.5), "max_weight"),
    (dict(noise_multiplier=1.0, clip=1.0, sampling="bernoulli"), "sampling"),
    (dict(noise_multiplier=1.0, clip=1.0, accountant="gdp"), "accountant"),
    (dict(noise_multiplier=1.0, clip=1.0, accountant="pld"), "accountant"),  # fixed + pld
    (dict(noise_multiplier=1.0, clip=1.0, sampling_probability=1.5), "sampling_probability"),
    (dict(noise_multiplier=1.0, clip=1.0, sampling_probability=0.1), "population"),
    (dict(noise_multiplier=1.0, clip=1.0, adaptive=P.AdaptiveClip(target_quantile=1.0)),
     "target_quantile"),
    (dict(noise_multiplier=1.0, clip=1.0, adaptive=P.AdaptiveClip(learning_rate=-0.1)),
     "clip_learning_rate"),
    (dict(noise_multiplier=1.0, clip=1.0, adaptive=P.AdaptiveClip(count_noise_multiplier=-1.0)),
     "count_noise_multiplier"),
])
def test_check_dp_refuses_bad_settings_naming_the_field(kwargs, field):
    with pytest.raises(FieldError) as e:
        P.check_dp(**kwargs)
    assert e.value.field == field


def test_check_dp_accepts_good_and_traced_settings():
    P.check_dp(noise_multiplier=1.0, clip=0.5, delta=1e-5, sampling="poisson", accountant="pld",
               sampling_probability=0.01, max_weight=0.01, adaptive=P.AdaptiveClip())
    P.check_dp(clip=0.5, delta=1e-5, target_epsilon=4.0, sampling_probability=0.02, population=500)
    jax.vmap(lambda z: P.check_dp(noise_multiplier=z, clip=1.0) or z)(jnp.array([-1.0, 1.0]))


# ------------------------------------------------------------------------------ docs

def test_docs_page_runs_and_links_inside_the_repository():
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parent.parent / "docs" / "privacy.md"
    text = page.read_text("utf-8")
    namespace = {}
    for block in re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S):
        exec(compile(block, str(page), "exec"), namespace)
    assert "direction" in namespace
    links = re.findall(r"\]\(([^)]+)\)", text)
    assert links
    for link in links:
        assert "://" not in link, link
        assert (page.parent / link.split("#")[0]).resolve().exists(), link


@pytest.mark.parametrize("sampling", ["fixed", "poisson"])
def test_no_noise_spends_an_infinite_epsilon_without_failing(sampling):
    assert P.epsilon(0.0, 0.5, 3, 1e-5, sampling=sampling, population=6) == float("inf")
    assert P.epsilon(0.0, 0.5, 0, 1e-5, sampling=sampling, population=6) == 0.0


def test_vmap_and_grad_through_the_target_quantile():
    """--dp-adaptive-clip's quantile is continuous: a grid of quantiles is one vmapped
    call, and the next clip's derivative in it is C eta exp(-eta (b - gamma)) (no count
    noise here)."""
    k = 8
    deltas = {"w": jax.random.normal(jax.random.key(0), (k, 5, 3))}

    def next_clip(q):
        dp = P.ClientDP(1.0, 1.0, adaptive=P.AdaptiveClip(
            target_quantile=q, learning_rate=0.2, count_noise_multiplier=0.0))
        _, state, _ = P.privatize(deltas, jnp.ones(k) / k, jnp.ones(k, bool),
                                  jax.random.key(1), dp, P.ClipState(jnp.asarray(2.0)))
        return state.clip

    qs = jnp.array([0.1, 0.5, 0.9])
    grid = jax.vmap(next_clip)(qs)
    np.testing.assert_allclose(grid, [next_clip(q) for q in qs], rtol=1e-6)
    assert bool(jnp.all(jnp.diff(grid) > 0))  # a higher quantile keeps a larger clip
    np.testing.assert_allclose(jax.grad(next_clip)(0.5), 0.2 * next_clip(0.5), rtol=1e-5)


# ------------------------------------------------------------------------ precision

def _np_release(deltas, weights, clip):
    """sum_k w~_k clip(Delta_k, C) in float64 NumPy, w~ = w / sum(w) (no weight reaches
    the cap here), clip(D, C) = D min(1, C / ||D||) over the whole pytree."""
    leaves = [np.asarray(x, np.float64).reshape(K, -1) for x in jax.tree.leaves(deltas)]
    norms = np.sqrt(sum(np.sum(x ** 2, axis=1) for x in leaves))
    scale = np.minimum(1.0, clip / norms)
    w = np.asarray(weights, np.float64) / np.sum(weights)
    return [np.tensordot(w * scale, x, axes=1) for x in leaves], norms


def test_release_follows_the_widest_float_under_x64():
    """Under x64 with float64 updates the clip norm C = 0.1, the norms, the weights and
    the noise std 2 z C b are float64 and equal the float64 reference to rounding
    (float32 coefficients were off by ~6e-8 relative every round); without x64 the
    release stays float32."""
    weights, clip, z, b = [0.4, 0.3, 0.2, 0.1], 0.1, 1.3, 0.45
    dp = P.ClientDP(noise_multiplier=z, clip=clip, max_weight=b)
    with jax.enable_x64(True):
        deltas = jax.tree.map(lambda x: x.astype(jnp.float64), _stack())
        w = jnp.asarray(weights, jnp.float64)
        mask = jnp.ones(K, bool)
        exact, _, info = P.privatize(deltas, w, mask, jax.random.key(0),
                                     dp._replace(noise_multiplier=0.0))
        noisy, _, noisy_info = P.privatize(deltas, w, mask, jax.random.key(0), dp)
        want, norms = _np_release(deltas, weights, clip)
        for got, ref in zip(jax.tree.leaves(exact), want):
            assert got.dtype == jnp.float64
            np.testing.assert_allclose(np.asarray(got).reshape(-1), ref, rtol=1e-13, atol=0)
        np.testing.assert_allclose(info["update_norms"], norms, rtol=1e-14)
        assert noisy_info["noise_std"].dtype == jnp.float64
        assert float(noisy_info["noise_std"]) == pytest.approx(z * 2 * clip * b, rel=1e-15)
        assert float(info["clip"]) == clip and info["dp_weights"].dtype == jnp.float64
        assert all(x.dtype == jnp.float64 for x in jax.tree.leaves(noisy))
    exact32, _, info32 = P.privatize(_stack(), jnp.asarray(weights), jnp.ones(K, bool),
                                     jax.random.key(0), dp._replace(noise_multiplier=0.0))
    assert info32["clip"].dtype == jnp.float32
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(exact32))
    for got, ref in zip(jax.tree.leaves(exact32), _np_release(_stack(), weights, clip)[0]):
        np.testing.assert_allclose(np.asarray(got).reshape(-1), ref, rtol=2e-6, atol=1e-7)
