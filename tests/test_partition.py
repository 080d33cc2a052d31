"""Tests of the partitioners, per-client test sets and label noise.

fedjax_fair.data.partition (every registered partitioner), client_test
(holdout_split, matched_test) and noise (transition matrices, flips). All on
generated label arrays; pure NumPy, no JAX.
"""
import numpy as np
import pytest

from fedjax_fair.data import client_test, noise, partition
from fedjax_fair.data.federated import _num_train

# 10 classes x 200 examples, shuffled.
LABELS = np.repeat(np.arange(10), 200)[np.random.default_rng(0).permutation(2000)]

# Arguments under which each covering partitioner must give a disjoint cover of LABELS.
COVERING_KWARGS = {
    "iid": {}, "dirichlet": {"alpha": 0.5}, "shards": {}, "classes": {"classes_per_client": 2},
    "quantity": {"sigma": 1.0}, "unbalanced_shards": {"shard_size": 20},
}
# Arguments that make every registered partitioner run on LABELS with 10 clients.
GROUPS = np.arange(LABELS.size) % 10
ALL_KWARGS = {**COVERING_KWARGS, "natural": {"groups": GROUPS},
              "handpick": {"samples_per_class": 30}, "dirichlet_prior": {"alpha": 0.5},
              "by_class": {}}


def _hist(labels, part, num_classes=10):
    return np.bincount(labels[part], minlength=num_classes)


def _label_sets(labels, parts):
    return [set(np.unique(labels[p]).tolist()) for p in parts]


def test_registry_names_and_covering_list():
    assert {"iid", "dirichlet", "shards", "classes", "quantity", "natural"} <= set(
        partition.PARTITIONERS)
    assert set(partition.COVERING) <= set(partition.PARTITIONERS)
    assert set(ALL_KWARGS) == set(partition.PARTITIONERS)
    assert set(COVERING_KWARGS) == set(partition.COVERING)


# ------------------------------------------------------------------ common contract


@pytest.mark.parametrize("name", sorted(COVERING_KWARGS))
def test_covering_partitioners_disjoint_cover_sorted_deterministic(name):
    fn, kwargs = partition.PARTITIONERS[name], COVERING_KWARGS[name]
    parts = fn(LABELS, 10, 3, **kwargs)
    assert len(parts) == 10
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in parts)  # sorted, unique
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(LABELS.size))
    again = fn(LABELS, 10, 3, **kwargs)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = fn(LABELS, 10, 4, **kwargs)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


@pytest.mark.parametrize("name", sorted(ALL_KWARGS))
def test_every_partitioner_is_deterministic_and_validates(name):
    fn, kwargs = partition.PARTITIONERS[name], ALL_KWARGS[name]
    parts = fn(LABELS, 10, 5, **kwargs)
    assert len(parts) == 10 and all(p.dtype == np.int64 for p in parts)
    assert all(np.all(np.diff(p) >= 0) for p in parts)
    assert all(p.size == 0 or (p.min() >= 0 and p.max() < LABELS.size) for p in parts)
    assert all(np.array_equal(a, b) for a, b in zip(parts, fn(LABELS, 10, 5, **kwargs)))
    with pytest.raises(ValueError, match="^num_clients:"):
        fn(LABELS, 0, 0, **kwargs)
    with pytest.raises(ValueError, match="^labels:"):
        fn(LABELS.astype(np.float32) + 0.5, 5, 0, **kwargs)
    with pytest.raises(ValueError, match="^seed:"):
        fn(LABELS, 5, -1, **kwargs)


# ------------------------------------------------------------------ classes per client


@pytest.mark.parametrize("num_clients,k", [(10, 2), (25, 3), (4, 3), (7, 10), (60, 1)])
def test_classes_per_client_exact_label_count_and_even_split(num_clients, k):
    parts = partition.classes_per_client(LABELS, num_clients, 1, classes_per_client=k)
    sets = _label_sets(LABELS, parts)
    assert all(len(s) == k for s in sets)
    assert set().union(*sets) == set(range(10))  # every class used (num_clients * k >= 10)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(LABELS.size))
    for c in range(10):  # a class is cut evenly among its holders
        counts = [int(_hist(LABELS, p)[c]) for p in parts if c in _label_sets(LABELS, [p])[0]]
        assert sum(counts) == 200 and max(counts) - min(counts) <= 1


def test_classes_per_client_all_classes_is_class_balanced_iid():
    parts = partition.classes_per_client(LABELS, 40, 0, classes_per_client=10)
    hists = np.stack([_hist(LABELS, p) for p in parts])
    assert (hists == 5).all()  # 200 per class / 40 clients


def test_classes_per_client_drops_unheld_classes_and_validates():
    parts = partition.classes_per_client(LABELS, 3, 0, classes_per_client=2)
    sets = _label_sets(LABELS, parts)
    assert all(len(s) == 2 for s in sets) and len(set().union(*sets)) == 6  # distinct deal
    assert sum(p.size for p in parts) == 6 * 200
    with pytest.raises(ValueError, match="^classes_per_client:"):
        partition.classes_per_client(LABELS, 3, 0, classes_per_client=11)
    with pytest.raises(ValueError, match="^classes_per_client:"):
        partition.classes_per_client(LABELS, 3, 0, classes_per_client=0)


# ------------------------------------------------------------------ dirichlet


def _mean_max_share(labels, parts):
    return float(np.mean([_hist(labels, p).max() / p.size for p in parts if p.size]))


def test_dirichlet_small_alpha_more_skewed_than_large():
    skewed = partition.dirichlet(LABELS, 10, 0, alpha=0.05, min_size=5)
    mild = partition.dirichlet(LABELS, 10, 0, alpha=100.0, min_size=5)
    assert _mean_max_share(LABELS, skewed) > 0.5
    assert _mean_max_share(LABELS, mild) < 0.2


# ------------------------------------------------------------------ shards


def _old_shards(labels, num_clients, seed, shards_per_client):
    """The shards implementation before assignment= was added (must stay identical)."""
    rng = np.random.default_rng(seed)
    shuffled = rng.permutation(labels.size)
    by_label = shuffled[np.argsort(labels[shuffled], kind="stable")]
    pieces = np.array_split(by_label, num_clients * shards_per_client)
    deal = rng.permutation(num_clients * shards_per_client).reshape(num_clients,
                                                                    shards_per_client)
    return [np.sort(np.concatenate([pieces[s] for s in row])) for row in deal]


def test_shards_default_unchanged():
    for seed, n, spc in [(0, 10, 2), (7, 13, 3)]:
        new = partition.shards(LABELS, n, seed, shards_per_client=spc)
        assert all(np.array_equal(a, b) for a, b in
                   zip(new, _old_shards(LABELS, n, seed, spc)))
        assert all(np.array_equal(a, b) for a, b in
                   zip(new, partition.shards(LABELS, n, seed, spc, assignment="random")))


def test_shards_modulo_gives_client_k_shards_k_and_k_plus_n():
    # 20 shards of 100 over 2000 sorted labels: shard s lies in label s // 2.
    parts = partition.shards(LABELS, 10, 0, shards_per_client=2, assignment="modulo")
    for k, p in enumerate(parts):
        expected = np.zeros(10, np.int64)
        for s in (k, k + 10):
            expected[s // 2] += 100
        np.testing.assert_array_equal(_hist(LABELS, p), expected)
    # Three shards per client: shards k, k + N, k + 2N (here shard s lies in label s // 3).
    parts = partition.shards(LABELS, 10, 1, shards_per_client=3, assignment="modulo")
    sorted_labels = np.sort(LABELS)
    pieces = np.array_split(np.arange(2000), 30)
    for k, p in enumerate(parts):
        want = np.concatenate([sorted_labels[pieces[s]] for s in (k, k + 10, k + 20)])
        np.testing.assert_array_equal(np.sort(LABELS[p]), np.sort(want))
    with pytest.raises(ValueError, match="^assignment:"):
        partition.shards(LABELS, 10, 0, assignment="roundrobin")


def test_unbalanced_shards_one_each_then_random():
    parts = partition.unbalanced_shards(LABELS, 10, 2, shard_size=20)  # 100 shards
    sizes = np.array([p.size for p in parts])
    assert (sizes % 20 == 0).all() and (sizes >= 20).all() and sizes.sum() == 2000
    assert sizes.std() > 0  # unbalanced
    for p in parts:  # shards lie inside one label (20 divides 200): counts in shard units
        assert (_hist(LABELS, p) % 20 == 0).all()
    # Last shard shorter when shard_size does not divide the pool: still a cover.
    odd = partition.unbalanced_shards(LABELS, 10, 2, shard_size=30)
    np.testing.assert_array_equal(np.sort(np.concatenate(odd)), np.arange(2000))
    with pytest.raises(ValueError, match="^shard_size:"):
        partition.unbalanced_shards(LABELS, 50, 0, shard_size=60)  # 34 shards < 50 clients


# ------------------------------------------------------------------ quantity skew


def test_apportion_sums_and_is_proportional():
    out = partition.apportion([1.0, 2.0, 3.0, 0.0], 10)
    assert out.sum() == 10 and out[3] == 0
    np.testing.assert_array_equal(out, [2, 3, 5, 0])  # 1.67, 3.33, 5: largest remainder
    np.testing.assert_array_equal(partition.apportion([1, 1, 1], 4), [2, 1, 1])  # tie: lowest
    with pytest.raises(ValueError, match="^weights:"):
        partition.apportion([0.0, 0.0], 3)


def _cv(parts):
    sizes = np.array([p.size for p in parts], np.float64)
    return sizes.std() / sizes.mean()


def test_quantity_skew_sizes_spread_sum_and_min_size():
    labels = np.repeat(np.arange(10), 5000)
    narrow = partition.quantity_skew(labels, 400, 0, sigma=0.3, min_size=5)
    wide = partition.quantity_skew(labels, 400, 0, sigma=1.0, min_size=5)
    for parts in (narrow, wide):
        assert sum(p.size for p in parts) == labels.size
        assert min(p.size for p in parts) >= 5
    # Coefficient of variation of a log-normal: sqrt(exp(sigma^2) - 1).
    assert abs(_cv(narrow) - np.sqrt(np.exp(0.09) - 1)) < 0.05
    assert _cv(wide) > 2 * _cv(narrow)
    heavy = partition.quantity_skew(labels, 400, 0, distribution="power", exponent=2.5)
    light = partition.quantity_skew(labels, 400, 0, distribution="power", exponent=6.0)
    assert _cv(heavy) > _cv(light) and min(p.size for p in light) >= 1
    # Label-IID: the largest clients have near-uniform label mixes.
    for p in sorted(wide, key=len)[-5:]:
        assert np.abs(_hist(labels, p) / p.size - 0.1).max() < 0.05


def test_quantity_skew_validation():
    with pytest.raises(ValueError, match="^distribution:"):
        partition.quantity_skew(LABELS, 10, 0, distribution="zipf")
    with pytest.raises(ValueError, match="^sigma:"):
        partition.quantity_skew(LABELS, 10, 0, sigma=0.0)
    with pytest.raises(ValueError, match="^exponent:"):
        partition.quantity_skew(LABELS, 10, 0, distribution="power", exponent=1.0)
    with pytest.raises(ValueError, match="^min_size:"):
        partition.quantity_skew(LABELS, 10, 0, min_size=201)


# ------------------------------------------------------------------ natural


def test_natural_maps_groups_exactly():
    rng = np.random.default_rng(0)
    groups = rng.choice(np.array(["w07", "w01", "w13", "w02"]), LABELS.size)
    parts = partition.natural(LABELS, 4, 0, groups=groups)
    ids = sorted(set(groups.tolist()))
    for k, p in enumerate(parts):
        np.testing.assert_array_equal(p, np.flatnonzero(groups == ids[k]))  # ascending id order
    same = partition.natural(LABELS, None, 9, groups=groups)  # all groups; seed unused
    assert all(np.array_equal(a, b) for a, b in zip(parts, same))


def test_natural_subset_and_min_size_drop_whole_groups():
    groups = np.repeat(np.arange(40), 50)  # 40 writers of 50 examples
    groups[:5] = 99  # writer 99 has 5 examples
    subset = partition.natural(LABELS, 12, 1, groups=groups)
    kept = [np.unique(groups[p]) for p in subset]
    assert all(k.size == 1 for k in kept)
    kept = np.concatenate(kept)
    assert np.all(np.diff(kept) > 0)
    for g, p in zip(kept, subset):
        np.testing.assert_array_equal(p, np.flatnonzero(groups == g))
    assert all(np.array_equal(a, b) for a, b in
               zip(subset, partition.natural(LABELS, 12, 1, groups=groups)))
    other = np.concatenate([np.unique(groups[p]) for p in
                            partition.natural(LABELS, 12, 2, groups=groups)])
    assert not np.array_equal(kept, other)
    big = partition.natural(LABELS, None, 0, groups=groups, min_size=10)
    assert len(big) == 40 and 99 not in {int(groups[p[0]]) for p in big}
    assert len(partition.natural(LABELS, None, 0, groups=groups)) == 41


def test_natural_errors_name_the_field():
    with pytest.raises(ValueError, match="^groups:"):
        partition.natural(LABELS, 4, 0)
    with pytest.raises(ValueError, match="^groups:"):
        partition.natural(LABELS, 4, 0, groups=np.zeros(5))
    with pytest.raises(ValueError, match="^num_clients:"):
        partition.natural(LABELS, 11, 0, groups=GROUPS)
    with pytest.raises(ValueError, match="^min_size:"):
        partition.natural(LABELS, 4, 0, groups=GROUPS, min_size=0)


# ------------------------------------------------------------------ handpick, dirichlet_prior


def test_handpick_groups_share_class_pairs():
    parts = partition.handpick(LABELS, 10, 0, classes_per_client=2, samples_per_class=30)
    for i, p in enumerate(parts):
        expected = np.zeros(10, np.int64)
        expected[[2 * (i // 2), 2 * (i // 2) + 1]] = 30  # clients 2b, 2b+1 share {2b, 2b+1}
        np.testing.assert_array_equal(_hist(LABELS, p), expected)
    together = np.concatenate(parts)
    assert np.unique(together).size == together.size == 600  # disjoint, rest dropped
    with pytest.raises(ValueError, match="^samples_per_class:"):
        partition.handpick(LABELS, 10, 0, samples_per_class=101)
    with pytest.raises(ValueError, match="^classes_per_client:"):
        partition.handpick(LABELS, 10, 0, classes_per_client=3)


def test_dirichlet_prior_equal_sizes_skew_and_refills():
    skewed = partition.dirichlet_prior(LABELS, 20, 0, alpha=0.05)
    mild = partition.dirichlet_prior(LABELS, 20, 0, alpha=100.0)
    assert [p.size for p in skewed] == [100] * 20 == [p.size for p in mild]
    assert _mean_max_share(LABELS, skewed) > 0.6 and _mean_max_share(LABELS, mild) < 0.25
    # 30 clients x 500 from 2000 examples: pools refill, so indices repeat across clients.
    over = partition.dirichlet_prior(LABELS, 30, 1, alpha=1.0, client_size=500)
    together = np.concatenate(over)
    assert together.size == 15000 and np.unique(together).size <= 2000
    with pytest.raises(ValueError, match="^alpha:"):
        partition.dirichlet_prior(LABELS, 10, 0, alpha=0.0)
    with pytest.raises(ValueError, match="^client_size:"):
        partition.dirichlet_prior(LABELS, 10, 0, client_size=0)


# ------------------------------------------------------------------ holdout_split


def test_holdout_split_follows_num_train_rule():
    rng = np.random.default_rng(0)
    sizes = [0, 1, 2, 5, 10, 101]
    parts = np.split(rng.permutation(sum(sizes)), np.cumsum(sizes)[:-1])
    train, test = client_test.holdout_split(parts, 0.2, 3)
    for p, tr, te, n in zip(parts, train, test, sizes):
        assert tr.size == _num_train(n, 0.2) and te.size == n - tr.size
        assert np.intersect1d(tr, te).size == 0
        np.testing.assert_array_equal(np.sort(np.concatenate([tr, te])), np.sort(p))
        assert tr.dtype == te.dtype == np.int64
    assert [t.size for t in test] == [0, 0, 1, 1, 2, 21]
    again = client_test.holdout_split(parts, 0.2, 3)
    assert all(np.array_equal(a, b) for a, b in zip(test, again[1]))
    other = client_test.holdout_split(parts, 0.2, 4)
    assert not all(np.array_equal(a, b) for a, b in zip(test, other[1]))
    with pytest.raises(ValueError, match="^test_fraction:"):
        client_test.holdout_split(parts, 1.0, 0)


def test_holdout_split_stratified_keeps_class_shares():
    parts = partition.dirichlet(LABELS, 8, 0, alpha=0.5, min_size=20)
    train, test = client_test.holdout_split(parts, 0.25, 0, labels=LABELS)
    for p, tr, te in zip(parts, train, test):
        np.testing.assert_array_equal(np.sort(np.concatenate([tr, te])), p)
        for c, n_c in enumerate(_hist(LABELS, p)):
            assert _hist(LABELS, tr)[c] == _num_train(int(n_c), 0.25)


# ------------------------------------------------------------------ matched_test


TEST_LABELS = np.repeat(np.arange(10), 100)[np.random.default_rng(1).permutation(1000)]


def test_matched_test_label_proportions_follow_training():
    parts = partition.dirichlet(LABELS, 10, 2, alpha=0.3, min_size=20)
    tests = client_test.matched_test(LABELS, TEST_LABELS, 10, 0, parts=parts)
    for p, t in zip(parts, tests):
        assert t.size == round(1000 * p.size / 2000)  # proportional default size
        assert np.unique(t).size == t.size and t.dtype == np.int64
        train_share = _hist(LABELS, p) / p.size
        test_share = _hist(TEST_LABELS, t) / t.size
        assert np.abs(test_share - train_share).max() <= 1.0 / t.size + 1e-12
    # Same result from per-client label arrays; deterministic; seeds matter.
    again = client_test.matched_test([LABELS[p] for p in parts], TEST_LABELS, 10, 0)
    assert all(np.array_equal(a, b) for a, b in zip(tests, again))
    other = client_test.matched_test(LABELS, TEST_LABELS, 10, 1, parts=parts)
    assert not all(np.array_equal(a, b) for a, b in zip(tests, other))


def test_matched_test_sizes_replace_and_errors():
    train = [np.array([0, 0, 0, 1]), np.array([], np.int64), np.array([2, 2, 3, 3, 3, 3])]
    fixed = client_test.matched_test(train, TEST_LABELS, 10, 0, size=40)
    np.testing.assert_array_equal(_hist(TEST_LABELS, fixed[0])[:2], [30, 10])
    assert fixed[1].size == 0  # no training data, no test data
    np.testing.assert_array_equal(_hist(TEST_LABELS, fixed[2])[2:4], [13, 27])  # 13.3, 26.7
    listed = client_test.matched_test(train, TEST_LABELS, 10, 0, size=[8, 5, 3])
    assert [t.size for t in listed] == [8, 0, 3]
    with pytest.raises(ValueError, match="^size:"):
        client_test.matched_test(train, TEST_LABELS, 10, 0, size=200)  # 150 of class 0 > 100
    big = client_test.matched_test(train, TEST_LABELS, 10, 0, size=200, replace=True)
    assert _hist(TEST_LABELS, big[0])[0] == 150
    with pytest.raises(ValueError, match="^size:"):
        client_test.matched_test(train, TEST_LABELS, 10, 0, size=[1, 2])
    with pytest.raises(ValueError, match="^test_labels:"):
        client_test.matched_test(train, TEST_LABELS[TEST_LABELS != 3], 10, 0, size=10)
    with pytest.raises(ValueError, match="^train_labels:"):
        client_test.matched_test([np.array([0, 12])], TEST_LABELS, 10, 0)


# ------------------------------------------------------------------ label noise


def test_transition_matrices_entries_and_rows():
    sym = noise.symmetric_transition(5, 0.6)
    pair = noise.pair_transition(5, 0.4)
    for t in (sym, pair):
        assert t.shape == (5, 5) and (t >= 0).all()
        np.testing.assert_allclose(t.sum(axis=1), 1.0)
    np.testing.assert_allclose(np.diag(sym), 0.4)
    np.testing.assert_allclose(sym[~np.eye(5, dtype=bool)], 0.15)
    np.testing.assert_allclose(np.diag(pair), 0.6)
    for i in range(5):
        np.testing.assert_allclose(pair[i, (i + 1) % 5], 0.4)
    assert np.count_nonzero(pair) == 10
    with pytest.raises(ValueError, match="^noise_rate:"):
        noise.pair_transition(5, 1.5)
    with pytest.raises(ValueError, match="^num_classes:"):
        noise.symmetric_transition(1, 0.2)


@pytest.mark.parametrize("kind,rate", [("pair", 0.1), ("pair", 0.4), ("symmetric", 0.2),
                                       ("symmetric", 0.6)])
def test_empirical_flip_rate(kind, rate):
    labels = np.random.default_rng(0).integers(0, 10, 100_000).astype(np.int32)
    original = labels.copy()
    noisy = noise.add_label_noise(labels, kind, rate, 10, seed=1)
    np.testing.assert_array_equal(labels, original)  # input untouched
    assert noisy.dtype == labels.dtype and noisy.shape == labels.shape
    flipped = noisy != labels
    assert abs(flipped.mean() - rate) < 0.01
    if kind == "pair":
        np.testing.assert_array_equal(noisy[flipped], (labels[flipped] + 1) % 10)
    else:  # flips spread evenly over the 9 other classes
        offsets = np.bincount((noisy[flipped] - labels[flipped]) % 10, minlength=10)[1:]
        assert np.abs(offsets / flipped.sum() - 1 / 9).max() < 0.01
    np.testing.assert_array_equal(noisy, noise.add_label_noise(labels, kind, rate, 10, seed=1))


def test_flip_labels_general_matrix_and_validation():
    perm = np.eye(3)[[2, 0, 1]]  # 0 -> 2, 1 -> 0, 2 -> 1 with certainty
    np.testing.assert_array_equal(noise.flip_labels(np.array([0, 1, 2, 2]), perm, 0),
                                  [2, 0, 1, 1])
    labels = np.arange(10)
    np.testing.assert_array_equal(noise.add_label_noise(labels, "none", 0.5, 10, 0), labels)
    np.testing.assert_array_equal(noise.add_label_noise(labels, "pair", 0.0, 10, 0), labels)
    with pytest.raises(ValueError, match="^label_noise:"):
        noise.add_label_noise(labels, "asymmetric", 0.2, 10, 0)
    with pytest.raises(ValueError, match="^noise_rate:"):
        noise.add_label_noise(labels, "symmetric", -0.1, 10, 0)
    with pytest.raises(ValueError, match="^transition:"):
        noise.flip_labels(labels, np.full((10, 10), 0.2), 0)
    with pytest.raises(ValueError, match="^labels:"):
        noise.flip_labels(np.array([0, 3]), perm, 0)


def test_noise_on_train_only_leaves_test_labels_clean():
    pool = LABELS.copy()
    pool.setflags(write=False)  # noising must never write into the caller's labels
    parts = partition.dirichlet(pool, 5, 0, alpha=1.0, min_size=20)
    train, test = client_test.holdout_split(parts, 0.2, 0)
    noisy = np.array(pool)
    for k, tr in enumerate(train):
        noisy[tr] = noise.add_label_noise(pool[tr], "symmetric", 0.6, 10, seed=k)
    assert abs(np.mean(noisy != pool) - 0.6 * 0.8) < 0.05  # ~80% of rows are train rows
    whole = noise.add_label_noise(pool, "pair", 0.4, 10, seed=0)  # read-only input is fine
    assert whole is not pool and np.array_equal(pool, LABELS)
    for te in test:
        np.testing.assert_array_equal(noisy[te], LABELS[te])  # test labels stay clean
