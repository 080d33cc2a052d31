"""Cohort samplers (fedjax_fair/scenarios/sampling.py) and the plain-average prior they pair with."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_fair.scenarios import sampling
from fedjax_fair.core.mixing import prior
from fedjax_fair.core.types import ClientOutput, ServerContext


def _draws(sampler, num_clients, cohort_size, n):
    keys = jax.random.split(jax.random.key(0), n)
    return np.asarray(jax.vmap(lambda k: sampler(k, num_clients, cohort_size))(keys))


def test_size_sampler_draws_distinct_clients_and_never_empty_ones():
    sizes = np.array([5, 0, 20, 1, 0, 74])
    ids = _draws(sampling.get("size", sizes), 6, 4, 500)
    assert all(len(set(row)) == 4 for row in ids)  # without replacement
    assert not np.isin(ids, [1, 4]).any()  # no training examples: never drawn


def test_size_sampler_first_draw_is_proportional_to_size():
    sizes = np.array([10, 30, 60])
    first = _draws(sampling.by_size(sizes), 3, 1, 6000)[:, 0]
    freq = np.bincount(first, minlength=3) / first.size
    np.testing.assert_allclose(freq, sizes / sizes.sum(), atol=0.02)


def test_size_sampler_inclusion_matches_successive_sampling():
    """K = 2 of 3 without replacement: P(i in S) = p_i + sum_{j != i} p_j p_i / (1 - p_j)."""
    p = np.array([0.1, 0.3, 0.6])
    ids = _draws(sampling.by_size(p * 10), 3, 2, 20000)
    inclusion = np.array([(ids == i).any(axis=1).mean() for i in range(3)])
    expected = [p[i] + sum(p[j] * p[i] / (1 - p[j]) for j in range(3) if j != i)
                for i in range(3)]
    np.testing.assert_allclose(inclusion, expected, atol=0.015)


def test_equal_size_samplers_are_equal():
    """Runs of a comparison rebuild the sampler; equal samplers share a compiled program."""
    a, b = sampling.by_size(np.array([1, 2, 3])), sampling.by_size([1.0, 2.0, 3.0])
    assert a == b and hash(a) == hash(b)
    assert a != sampling.by_size([1, 2, 4])


@pytest.mark.parametrize("weights", [[], [1.0, -1.0], [0.0, 0.0], [1.0, np.nan], [[1.0]]])
def test_bad_weights_are_refused(weights):
    with pytest.raises(ValueError, match="sampler"):
        sampling.weighted(weights)


def test_size_sampler_needs_enough_clients_with_data():
    sampler = sampling.by_size([3, 0, 0, 4])
    with pytest.raises(ValueError, match="cohort_size"):
        sampler(jax.random.key(0), 4, 3)
    with pytest.raises(ValueError, match="sampler"):
        sampler(jax.random.key(0), 5, 1)


def test_get_names_and_errors():
    assert sampling.get("uniform") is sampling.uniform
    assert sampling.get("full") is sampling.full
    with pytest.raises(ValueError, match="sampler"):
        sampling.get("size")
    with pytest.raises(ValueError, match="sampler"):
        sampling.get("nope")


@pytest.mark.parametrize("weight_by_size", [True, False])
def test_prior_is_size_or_simple_average(weight_by_size):
    n = jnp.array([1, 3, 6, 10])
    mask = jnp.array([True, True, True, False])
    out = ClientOutput(delta=None, loss_before=jnp.zeros(4), num_examples=n,
                       num_steps=jnp.ones(4, jnp.int32))
    ctx = ServerContext(params=None, round=jnp.int32(0), key=jax.random.key(0),
                        client_ids=jnp.arange(4), client_mask=mask)
    rule = prior(weight_by_size)
    w, _ = rule.update(rule.init(4), out, ctx)
    expected = np.array([0.1, 0.3, 0.6, 0.0]) if weight_by_size else np.array([1, 1, 1, 0]) / 3
    np.testing.assert_allclose(np.asarray(w), expected, rtol=1e-6)


def test_uniform_sampler_gives_distinct_ids_in_range():
    sampler = jax.jit(sampling.uniform, static_argnums=(1, 2))
    ids = np.stack([sampler(jax.random.key(s), 9, 4) for s in range(32)])
    assert ids.shape == (32, 4) and ids.dtype == np.int32
    assert ids.min() >= 0 and ids.max() < 9
    assert all(len(set(row)) == 4 for row in ids)
    assert len(set(ids.ravel())) == 9  # every client turns up eventually


def test_full_sampler():
    np.testing.assert_array_equal(sampling.full(jax.random.key(0), 5, 5), np.arange(5))
    with pytest.raises(ValueError, match="cohort_size"):
        sampling.full(jax.random.key(0), 5, 3)


def test_weighted_sampler_never_picks_zero_probability_clients():
    sampler = sampling.weighted([0.0, 1.0, 2.0, 0.0, 1.0, 3.0])
    sampler = jax.jit(sampler, static_argnums=(1, 2))
    ids = np.stack([sampler(jax.random.key(s), 6, 3) for s in range(32)])
    assert set(ids.ravel()) <= {1, 2, 4, 5}
    assert all(len(set(row)) == 3 for row in ids)


# ------------------------------------------------ uniform sampling of large federations


def test_uniform_below_a_large_federation_is_the_permutation_draw():
    """Recorded runs keep their cohorts: below ``LARGE_FEDERATION`` clients (or with
    K above N / 16) ``uniform`` is ``jax.random.choice`` without replacement."""
    from fedjax_fair.scenarios import sampling
    key = jax.random.key(5)
    for n, k in ((1000, 10), (sampling.LARGE_FEDERATION, sampling.LARGE_FEDERATION // 8)):
        np.testing.assert_array_equal(
            np.asarray(sampling.uniform(key, n, k)),
            np.asarray(jax.random.choice(key, n, (k,), replace=False)))


def test_distinct_draws_sample_uniform_subsets_without_replacement():
    """K distinct clients in [0, N); every client and every (client, position) equally
    likely (a chi-square test over 100,000 draws), at the large-federation switch
    too; fewer distinct draws than K falls back to the permutation."""
    from fedjax_fair.scenarios import sampling
    n, k, draws = 40, 4, 100_000
    ids = np.asarray(jax.jit(jax.vmap(lambda key: sampling.distinct_draws(key, n, k)))(
        jax.random.split(jax.random.key(0), draws)))
    assert ((ids >= 0) & (ids < n)).all()
    assert all(len(set(row)) == k for row in ids[:2000])
    for counts, expected in ((np.bincount(ids.ravel(), minlength=n), draws * k / n),
                             (np.bincount(ids[:, 0], minlength=n), draws / n)):
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 80, chi2  # 39 degrees of freedom: p < 1e-4 above 80
    big = sampling.uniform(jax.random.key(1), sampling.LARGE_FEDERATION, 1000)
    assert len(set(np.asarray(big).tolist())) == 1000
    crowded = np.asarray(sampling.distinct_draws(jax.random.key(2), 100, 95))
    assert sorted(set(crowded.tolist())) == sorted(crowded.tolist()) and len(crowded) == 95
