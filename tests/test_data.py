"""Tests of fedjax_fair.data: padding, partitioners, Synthetic(alpha, beta), digits."""
import json

import jax
import functools

import numpy as np
import pytest

from fedjax_fair import data as fd
from fedjax_fair.data import partition
from fedjax_fair.data.synthetic import _generate_clients


def _real_rows(split, name):
    """Concatenated real rows of one field of a padded split, client by client."""
    values, mask = np.asarray(split.examples[name]), np.asarray(split.mask)
    return values[mask]


# ------------------------------------------------------------------ stack_clients


def _toy(sizes, features=2, seed=0):
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(n, features)) + 1.0 for n in sizes]  # never exactly zero
    ys = [rng.integers(0, 3, n) for n in sizes]
    return xs, ys


def test_stack_clients_shapes_mask_and_zero_padding_last():
    xs, ys = _toy([1, 0, 7, 3])
    cd = fd.stack_clients(xs, ys)
    assert cd.examples["x"].shape == (4, 7, 2) and cd.examples["x"].dtype == np.float32
    assert cd.examples["y"].shape == (4, 7) and cd.examples["y"].dtype == np.int32
    assert cd.mask.shape == (4, 7) and cd.mask.dtype == bool
    assert cd.num_examples.dtype == np.int32
    np.testing.assert_array_equal(cd.num_examples, [1, 0, 7, 3])
    np.testing.assert_array_equal(np.asarray(cd.mask).sum(1), [1, 0, 7, 3])
    x, y, mask = (np.asarray(a) for a in (cd.examples["x"], cd.examples["y"], cd.mask))
    for k, n in enumerate([1, 0, 7, 3]):
        assert mask[k, :n].all() and not mask[k, n:].any()  # real rows first
        np.testing.assert_allclose(x[k, :n], xs[k].astype(np.float32))
        np.testing.assert_array_equal(y[k, :n], ys[k])
        assert (x[k, n:] == 0).all() and (y[k, n:] == 0).all()  # padding is zero
    assert isinstance(cd.examples["x"], jax.Array)


def test_stack_clients_pad_to_and_float_labels():
    xs, ys = _toy([2, 3])
    cd = fd.stack_clients(xs, [y.astype(np.float64) for y in ys], pad_to=5)
    assert cd.examples["x"].shape == (2, 5, 2)
    np.testing.assert_array_equal(np.asarray(cd.examples["y"])[1, :3], ys[1])
    with pytest.raises(ValueError, match="pad_to"):
        fd.stack_clients(xs, ys, pad_to=2)


def test_stack_clients_validation_names_field_and_client():
    xs, ys = _toy([2, 3, 4])
    with pytest.raises(ValueError, match="client 1 has 3 inputs but 2 labels"):
        fd.stack_clients(xs, [ys[0], ys[1][:2], ys[2]])
    with pytest.raises(ValueError, match="ys: client 2: labels must be integers"):
        fd.stack_clients(xs, [ys[0], ys[1], ys[2] + 0.5])
    with pytest.raises(ValueError, match="num_clients"):
        fd.stack_clients([], [])
    with pytest.raises(ValueError, match="client 1 has input shape"):
        fd.stack_clients([xs[0], np.zeros((3, 5))], ys[:2])


def test_padding_report_matches_hand_count():
    xs, ys = _toy([1, 2, 7])
    report = fd.padding_report(fd.stack_clients(xs, ys))
    # M = 7, 10 real rows in 3 * 7 = 21 slots; bytes = x 3*7*2*4 + y 3*7*4 + mask 21 + n 3*4.
    assert report == {
        "num_clients": 3, "padded_size": 7, "num_examples": 10, "num_slots": 21,
        "padding_fraction": pytest.approx(11 / 21), "min_examples": 1,
        "median_examples": 2.0, "max_examples": 7, "bytes": 168 + 84 + 21 + 12}
    json.dumps(report)


# ------------------------------------------------------------------ splits and builder


def test_split_per_client_rounding_rule_and_content():
    sizes = [0, 1, 2, 10, 55]
    xs, ys = _toy(sizes)
    tr_x, tr_y, te_x, te_y = fd.split_per_client(np.random.default_rng(0), xs, ys, 0.1)
    # n_train = max(1, floor(0.9 n)) for n >= 1: the rule of the reference generators.
    assert [len(y) for y in tr_y] == [0, 1, 1, 9, 49]
    assert [len(y) for y in te_y] == [0, 0, 1, 1, 6]
    for k in range(len(sizes)):
        both = np.concatenate([tr_x[k], te_x[k]])
        np.testing.assert_array_equal(np.sort(both, axis=0), np.sort(xs[k], axis=0))
    with pytest.raises(ValueError, match="test_fraction"):
        fd.split_per_client(np.random.default_rng(0), xs, ys, 1.0)
    with pytest.raises(ValueError, match="test_fraction"):
        fd.split_per_client(np.random.default_rng(0), xs, ys, 0.0)


def test_from_client_arrays_reports_and_validates_labels():
    xs, ys = _toy([1, 2, 7])
    ds = fd.from_client_arrays(xs, ys, xs, ys, name="toy", num_classes=3, info={"a": 1})
    assert ds.input_shape == (2,) and ds.num_classes == 3 and ds.num_clients == 3
    assert ds.info["a"] == 1 and set(ds.info["padding"]) == {"train", "test"}
    json.dumps(ds.info)
    with pytest.raises(ValueError, match="train_ys: client 2 .*num_classes=2"):
        fd.from_client_arrays(xs, [np.zeros(1), np.zeros(2), np.full(7, 2)], xs, ys,
                              name="toy", num_classes=2)
    with pytest.raises(ValueError, match="test_ys: client 0"):
        fd.from_client_arrays(xs, ys, xs, [np.full(1, -1), ys[1], ys[2]], name="toy",
                              num_classes=3)
    with pytest.raises(ValueError, match="num_classes"):
        fd.from_client_arrays(xs, ys, xs, ys, name="toy", num_classes=0)
    with pytest.raises(ValueError, match="test_ys: client 1: labels must be integers"):
        fd.from_client_arrays(xs, ys, xs, [ys[0], ys[1] + 0.5, ys[2]], name="toy",
                              num_classes=3)
    with pytest.raises(ValueError, match="num_clients"):
        fd.from_client_arrays(xs, ys, xs[:2], ys[:2], name="toy", num_classes=3)


@pytest.mark.parametrize("label", [2 ** 31, 2 ** 32 + 1, -(2 ** 31) - 1, float(2 ** 32)])
def test_labels_beyond_int32_are_refused_not_wrapped(label):
    """2^32 + 1 cast to int32 would be 1, a valid class: refused before the cast."""
    xs, ys = _toy([1, 2, 7])
    bad = [ys[0], np.array([1, label]), ys[2]]
    with pytest.raises(ValueError, match="^train_ys: client 1"):
        fd.from_client_arrays(xs, bad, xs, ys, name="toy", num_classes=3)


def test_non_finite_inputs_are_a_data_error_naming_the_client():
    xs, ys = _toy([1, 2, 7])
    bad = [x.astype(np.float32).copy() for x in xs]
    bad[2][4, 1] = np.nan
    with pytest.raises(ValueError, match="^train_xs: client 2 ") as info:
        fd.from_client_arrays(bad, ys, xs, ys, name="toy", num_classes=3)
    assert "example 4" in str(info.value)
    bad[2][4, 1] = np.inf
    with pytest.raises(ValueError, match="^test_xs: client 2 "):
        fd.from_client_arrays(xs, ys, bad, ys, name="toy", num_classes=3)


def test_finite_inputs_whose_row_sums_overflow_are_accepted():
    """The check looks element by element only at rows whose sum is not finite: large
    finite values whose sum overflows float32 pass, and a NaN among them is still found
    (the row and example named)."""
    xs, ys = _toy([1, 2, 7])
    big = [np.full(x.shape, 3e38, np.float32) for x in xs]
    ds = fd.from_client_arrays(big, ys, xs, ys, name="toy", num_classes=3)
    assert np.isfinite(ds.host_data.train.examples["x"]).all()
    big[1][1, 0] = np.nan
    with pytest.raises(ValueError, match="^train_xs: client 1 ") as info:
        fd.from_client_arrays(big, ys, xs, ys, name="toy", num_classes=3)
    assert "example 1" in str(info.value)


@pytest.mark.parametrize("shape,dtype", [((3, 5), np.float32), ((2, 700, 200), np.float32),
                                         ((600, 600), np.int32)])
def test_zeros_block_is_an_independent_writable_zero_array(shape, dtype):
    """Large blocks live in their own mapping, small ones are np.zeros: either way
    zeros of the shape and dtype, writable, not shared with another block, and read
    by JAX as they are."""
    a, b = fd.zeros_block(shape, dtype), fd.zeros_block(shape, dtype)
    assert a.shape == shape and a.dtype == dtype and not a.any()
    last = (-1,) * len(shape)
    a[last] = 7
    assert a[last] == 7 and a.sum() == 7 and not b.any()
    np.testing.assert_array_equal(np.asarray(jax.device_put(a)), a)


def test_a_split_in_which_every_client_is_empty_is_refused_by_name():
    """Some clients may be empty, not all: no training rows (nothing to train on) is
    refused naming train_xs, no test rows (run evaluates every client on its test
    split) naming test_xs, whatever the input shape (the emptiness is found before
    any reshape of a zero-row block). An empty validation split is allowed."""
    xs, ys = _toy([1, 2, 7])
    empty_x = [np.zeros((0, 2), np.float32)] * 3
    empty_y = [np.zeros(0, np.int32)] * 3
    with pytest.raises(ValueError, match="^train_xs: "):
        fd.from_client_arrays(empty_x, empty_y, xs, ys, name="toy", num_classes=3)
    with pytest.raises(ValueError, match="^test_xs: "):
        fd.from_client_arrays(xs, ys, empty_x, empty_y, name="toy", num_classes=3)
    images = [np.zeros((0, 4, 4, 1), np.float32)] * 3  # a multi-dimensional input
    with pytest.raises(ValueError, match="^train_xs: "):
        fd.from_client_arrays(images, empty_y, [np.ones((2, 4, 4, 1))] * 3,
                              [np.zeros(2, int)] * 3, name="toy", num_classes=3)
    # Some empty clients in either split are fine.
    part_x, part_y = [xs[0], empty_x[1], xs[2]], [ys[0], empty_y[1], ys[2]]
    ds = fd.from_client_arrays(part_x, part_y, [empty_x[0], xs[1], empty_x[2]],
                               [empty_y[0], ys[1], empty_y[2]], name="toy", num_classes=3)
    np.testing.assert_array_equal(ds.host_data.train.num_examples, [1, 0, 7])
    np.testing.assert_array_equal(ds.host_data.test.num_examples, [0, 2, 0])
    train, test = ds.host_data.train, ds.host_data.test
    no_rows = fd.stack_clients(empty_x, empty_y)
    no_rows = jax.tree.map(np.asarray, no_rows)
    ok = fd.from_padded(train, test, name="toy", num_classes=3, validation=no_rows)
    assert ok.host_data.validation.mask.shape == (3, 0)


def test_resplit_refuses_fractions_that_leave_a_split_without_examples():
    ds = fd.get_dataset("synthetic", num_clients=3, max_examples=20)
    with pytest.raises(ValueError, match="^fractions: "):
        fd.resplit(ds, (0.9, 0.1, 0.0))
    with pytest.raises(ValueError, match="^fractions: .*validation"):
        fd.resplit(ds, (0.98, 0.01, 0.01))  # clients too small for a validation row


# ------------------------------------------------------------------ partitioners

LABELS = np.repeat(np.arange(10), 50)[np.random.default_rng(1).permutation(500)]


@pytest.mark.parametrize("name", partition.COVERING)
def test_partitioner_disjoint_covering_deterministic(name):
    fn = functools.partial(partition.PARTITIONERS[name],
                           **({"shard_size": 20} if name == "unbalanced_shards" else {}))
    parts = fn(LABELS, 10, seed=3)
    assert len(parts) == 10
    together = np.concatenate(parts)
    np.testing.assert_array_equal(np.sort(together), np.arange(LABELS.size))  # disjoint, covering
    again = fn(LABELS, 10, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = fn(LABELS, 10, seed=4)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


@pytest.mark.parametrize("name", sorted(partition.PARTITIONERS))
def test_partitioner_validation(name):
    fn = partition.PARTITIONERS[name]
    with pytest.raises(ValueError, match="num_clients"):
        fn(LABELS, 0, seed=0)
    with pytest.raises(ValueError, match="labels"):
        fn(LABELS.astype(np.float32) + 0.5, 5, seed=0)


def _mean_label_entropy(labels, parts):
    entropies = []
    for p in parts:
        freq = np.bincount(labels[p], minlength=10) / len(p)
        freq = freq[freq > 0]
        entropies.append(-(freq * np.log(freq)).sum())
    return float(np.mean(entropies))


def test_dirichlet_small_alpha_is_more_skewed():
    skewed = partition.dirichlet(LABELS, 10, seed=0, alpha=0.1, min_size=5)
    mild = partition.dirichlet(LABELS, 10, seed=0, alpha=100.0, min_size=5)
    assert min(len(p) for p in skewed) >= 5
    assert _mean_label_entropy(LABELS, skewed) < _mean_label_entropy(LABELS, mild) - 0.5
    assert _mean_label_entropy(LABELS, mild) > np.log(10) - 0.1  # near uniform


def test_dirichlet_min_size_errors_and_balance():
    with pytest.raises(ValueError, match="min_size"):
        partition.dirichlet(LABELS, 10, seed=0, min_size=51)  # 510 > 500 examples
    with pytest.raises(ValueError, match="max_retries=2"):
        partition.dirichlet(LABELS, 20, seed=0, alpha=0.01, min_size=20, max_retries=2)
    with pytest.raises(ValueError, match="alpha"):
        partition.dirichlet(LABELS, 10, seed=0, alpha=0.0)
    plain = partition.dirichlet(LABELS, 10, seed=0, alpha=0.3, min_size=0)
    balanced = partition.dirichlet(LABELS, 10, seed=0, alpha=0.3, min_size=0, balance=True)
    assert np.std([len(p) for p in balanced]) < np.std([len(p) for p in plain])


def test_shards_give_at_most_shards_per_client_labels():
    labels = np.repeat(np.arange(10), 20)  # 200 examples; 20 shards of 10 lie in one label
    parts = partition.shards(labels, 10, seed=0, shards_per_client=2)
    assert [len(p) for p in parts] == [20] * 10
    assert all(len(np.unique(labels[p])) <= 2 for p in parts)
    with pytest.raises(ValueError, match="shards_per_client"):
        partition.shards(labels, 150, seed=0, shards_per_client=2)


# ------------------------------------------------------------------ Synthetic


def test_synthetic_shapes_sizes_and_determinism():
    ds = fd.synthetic(alpha=0.5, beta=0.5, num_clients=12, seed=7)
    assert ds.name == "synthetic" and ds.input_shape == (60,) and ds.num_classes == 10
    tr, te = ds.data.train, ds.data.test
    assert tr.examples["x"].shape[2:] == (60,)
    total = np.asarray(tr.num_examples) + np.asarray(te.num_examples)
    np.testing.assert_array_equal(total, ds.info["client_sizes"])
    assert total.min() >= 50 and total.max() <= 1000
    assert np.asarray(te.num_examples).min() >= 1
    assert set(np.unique(_real_rows(tr, "y"))) <= set(range(10))
    json.dumps(ds.info)
    same = fd.synthetic(alpha=0.5, beta=0.5, num_clients=12, seed=7)
    for a, b in zip(jax.tree.leaves(ds.data), jax.tree.leaves(same.data)):
        np.testing.assert_array_equal(a, b)
    other = fd.synthetic(alpha=0.5, beta=0.5, num_clients=12, seed=8)
    assert not np.array_equal(ds.info["client_sizes"], other.info["client_sizes"]) or \
        not np.array_equal(tr.examples["x"], other.data.train.examples["x"])


def test_synthetic_labels_follow_generating_model():
    clients = _generate_clients(1.0, 1.0, 8, False, 300, seed=3, alpha_beta_as_std=False)
    ds = fd.synthetic(alpha=1.0, beta=1.0, num_clients=8, max_examples=300, seed=3)
    x_tr, y_tr = np.asarray(ds.data.train.examples["x"]), np.asarray(ds.data.train.examples["y"])
    x_te, y_te = np.asarray(ds.data.test.examples["x"]), np.asarray(ds.data.test.examples["y"])
    for k, c in enumerate(clients):
        assert c["W"].shape == (10, 60) and c["b"].shape == (10,) and c["v"].shape == (60,)
        np.testing.assert_array_equal(c["y"], np.argmax(c["x"] @ c["W"].T + c["b"], axis=1))
        n_tr, n_te = int(ds.data.train.num_examples[k]), int(ds.data.test.num_examples[k])
        x = np.concatenate([x_tr[k, :n_tr], x_te[k, :n_te]])
        y = np.concatenate([y_tr[k, :n_tr], y_te[k, :n_te]])
        np.testing.assert_array_equal(y, np.argmax(x.astype(np.float64) @ c["W"].T + c["b"], 1))
        assert len(y) == len(c["y"])
    # More than one class per client on average: the task is not degenerate.
    assert np.mean([len(np.unique(c["y"])) for c in clients]) > 2


def test_synthetic_alpha_beta_as_variance():
    def spread(alpha, as_std, key):
        clients = _generate_clients(alpha, alpha, 300, False, 50, seed=0,
                                    alpha_beta_as_std=as_std)
        return np.std([c[key].mean() for c in clients])

    assert spread(0.0, False, "W") < 0.1  # alpha = 0: every u_k = 0
    assert spread(4.0, False, "W") == pytest.approx(2.0, rel=0.15)  # std sqrt(alpha)
    assert spread(4.0, True, "W") == pytest.approx(4.0, rel=0.15)  # reference: std alpha
    assert spread(4.0, False, "v") == pytest.approx(2.0, rel=0.15)  # B_k for beta


def test_synthetic_alpha_cancels_in_the_labels_unless_per_class():
    def labels(alpha, per_class):
        clients = _generate_clients(alpha, 1.0, 6, False, 200, seed=3,
                                    alpha_beta_as_std=False, alpha_per_class=per_class)
        return [c["y"] for c in clients]

    # The reference's shared shift u_k adds the same to every logit: alpha changes W
    # and b but not one label.
    assert all(np.array_equal(a, b) for a, b in zip(labels(0.0, False), labels(5.0, False)))
    # One shift per class moves the class boundaries.
    changed = [np.mean(a != b) for a, b in zip(labels(0.0, True), labels(5.0, True))]
    assert np.mean(changed) > 0.2


def test_synthetic_iid_shares_one_model():
    clients = _generate_clients(1.0, 1.0, 5, True, 100, seed=0, alpha_beta_as_std=False)
    for c in clients[1:]:
        np.testing.assert_array_equal(c["W"], clients[0]["W"])
        np.testing.assert_array_equal(c["b"], clients[0]["b"])
    assert all((c["v"] == 0).all() for c in clients)


def test_synthetic_validation():
    for kwargs, field in [({"num_clients": 0}, "num_clients"), ({"alpha": -1.0}, "alpha"),
                          ({"beta": "x"}, "beta"), ({"test_fraction": 1.5}, "test_fraction"),
                          ({"max_examples": 0}, "max_examples"), ({"seed": -1}, "seed")]:
        with pytest.raises(ValueError, match=field):
            fd.synthetic(**kwargs)


# ------------------------------------------------------------------ digits


def test_digits_uses_every_example_once_and_is_deterministic():
    from sklearn.datasets import load_digits
    bunch = load_digits()
    ref = np.concatenate([(bunch.data / 16.0).astype(np.float32), bunch.target[:, None]], 1)
    for partition_name in ["dirichlet", "iid", "shards"]:
        ds = fd.digits(num_clients=10, partition=partition_name, seed=1)
        assert ds.name == "digits" and ds.input_shape == (8, 8, 1) and ds.num_classes == 10
        x = np.concatenate([_real_rows(ds.data.train, "x"), _real_rows(ds.data.test, "x")])
        y = np.concatenate([_real_rows(ds.data.train, "y"), _real_rows(ds.data.test, "y")])
        assert x.shape == (1797, 8, 8, 1) and 0.0 <= x.min() and x.max() <= 1.0
        # The same multiset of (image, label) rows as the bundled data set.
        rows = np.concatenate([x.reshape(1797, 64), y[:, None]], axis=1)
        np.testing.assert_array_equal(np.unique(rows, axis=0), np.unique(ref, axis=0))
        np.testing.assert_array_equal(np.unique(rows, axis=0, return_counts=True)[1],
                                      np.unique(ref, axis=0, return_counts=True)[1])
    again = fd.digits(num_clients=10, partition="shards", seed=1)
    for a, b in zip(jax.tree.leaves(ds.data), jax.tree.leaves(again.data)):
        np.testing.assert_array_equal(a, b)
    json.dumps(ds.info)


def test_digits_validation():
    with pytest.raises(ValueError, match="partition"):
        fd.digits(partition="by_writer")
    with pytest.raises(ValueError, match="num_clients"):
        fd.digits(num_clients=0)
    with pytest.raises(ValueError, match="test_fraction"):
        fd.digits(test_fraction=0.0)


# ------------------------------------------------------------------ femnist_like


def test_femnist_like_shapes_padding_and_determinism():
    ds = fd.femnist_like(num_clients=6, min_examples=5, max_examples=12, test_examples=3,
                         seed=2)
    tr, te = ds.data.train, ds.data.test
    assert ds.input_shape == (28, 28, 1) and ds.num_classes == 62
    assert tr.examples["x"].shape[0] == 6 and tr.examples["x"].shape[2:] == (28, 28, 1)
    n = np.asarray(tr.num_examples)
    assert n.min() >= 5 and n.max() <= 12 and tr.examples["x"].shape[1] == n.max()
    np.testing.assert_array_equal(te.num_examples, [3] * 6)
    x, mask = np.asarray(tr.examples["x"]), np.asarray(tr.mask)
    assert (x[~mask] == 0).all() and (np.abs(x[mask]).sum(axis=(1, 2, 3)) > 0).all()
    assert 0.5 < x[mask].std() < 2.0  # normalised to about unit variance
    same = fd.femnist_like(num_clients=6, min_examples=5, max_examples=12, test_examples=3,
                           seed=2)
    for a, b in zip(jax.tree.leaves(ds.data), jax.tree.leaves(same.data)):
        np.testing.assert_array_equal(a, b)
    json.dumps(ds.info)
    with pytest.raises(ValueError, match="max_examples"):
        fd.femnist_like(min_examples=10, max_examples=5)
    with pytest.raises(ValueError, match="noise"):
        fd.femnist_like(noise=-1.0)


# ------------------------------------------------------------------ registry


def test_registry():
    assert set(fd.DATASETS) == {
        "synthetic", "digits", "femnist_like", "mnist", "fashion_mnist", "emnist_byclass",
        "emnist_letters", "emnist_digits", "cifar10", "cifar100", "tfds", "femnist",
        "shakespeare", "leaf", "disk"}
    assert fd.DATASET_PARAMS["digits"]["num_clients"] == 20
    assert fd.DATASET_PARAMS["synthetic"]["alpha"] == 1.0
    ds = fd.get_dataset("synthetic", num_clients=3, max_examples=60)
    assert ds.num_clients == 3
    with pytest.raises(ValueError, match=r"dataset: unknown name 'x'; allowed: \["):
        fd.get_dataset("x")
    with pytest.raises(ValueError, match="unknown parameter.*'foo'"):
        fd.get_dataset("digits", foo=1)


def test_masked_mean_under_jit_with_strict_rank_promotion():
    ds = fd.synthetic(num_clients=4, max_examples=60)
    train = ds.data.train

    @jax.jit
    def masked_label_mean(cd):
        y = cd.examples["y"].astype(np.float32)
        return (y * cd.mask).sum(1) / cd.num_examples

    got = masked_label_mean(train)
    y, mask = np.asarray(train.examples["y"]), np.asarray(train.mask)
    np.testing.assert_allclose(got, [y[k][mask[k]].mean() for k in range(4)], rtol=1e-6)


# ------------------------------------------------------------------------- resplit


def _pooled(ds, k):
    """Client k's (x, y) rows over every split, as a sorted list of tuples."""
    rows = []
    for split in (ds.host_data.train, ds.host_data.validation, ds.host_data.test):
        if split is None:
            continue
        m = np.asarray(split.mask[k])
        xs, ys = np.asarray(split.examples["x"][k])[m], np.asarray(split.examples["y"][k])[m]
        rows += [(tuple(x.ravel().round(6)), int(y)) for x, y in zip(xs, ys)]
    return sorted(rows)


def test_resplit_follows_the_qffl_cut_points_and_keeps_every_example():
    ds = fd.get_dataset("synthetic", num_clients=8, max_examples=60, seed=3)
    new = fd.resplit(ds, (0.8, 0.1, 0.1), seed=1)
    for k in range(8):
        n = int(ds.host_data.train.num_examples[k] + ds.host_data.test.num_examples[k])
        # q-FFL's code: x[:int(0.8 n)], x[int(0.8 n):int(0.9 n)], x[int(0.9 n):]
        expected = (int(0.8 * n), int(0.9 * n) - int(0.8 * n), n - int(0.9 * n))
        got = tuple(int(s.num_examples[k]) for s in (new.host_data.train,
                                                     new.host_data.validation,
                                                     new.host_data.test))
        assert got == expected
        assert _pooled(new, k) == _pooled(ds, k)  # a re-partition, nothing lost or added
    assert new.info["resplit"] == {"fractions": [0.8, 0.1, 0.1], "seed": 1}
    assert set(new.info["padding"]) == {"train", "validation", "test"}


def test_resplit_is_seeded():
    ds = fd.get_dataset("synthetic", num_clients=4, max_examples=50)
    a, b, c = (fd.resplit(ds, (0.6, 0.2, 0.2), seed=s) for s in (1, 1, 2))
    leaves = lambda d: jax.tree.leaves(d.host_data)
    assert all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(b)))
    assert not all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(c))
                   if x.shape == y.shape)


@pytest.mark.parametrize("seed", [2 ** 32, 10 ** 30])
def test_seeds_of_32_bits_and_more_are_refused_by_name(seed):
    """Data seeds are 32-bit, as the run's: a larger one is an error, not an alias."""
    ds = fd.get_dataset("synthetic", num_clients=3, max_examples=20)
    with pytest.raises(ValueError, match=r"^seed: "):
        fd.resplit(ds, (0.8, 0.1, 0.1), seed=seed)
    with pytest.raises(ValueError, match=r"seed"):
        fd.get_dataset("synthetic", num_clients=3, max_examples=20, seed=seed)
    fd.resplit(ds, (0.8, 0.1, 0.1), seed=2 ** 32 - 1)  # the largest is fine


def test_resplit_without_validation_and_of_a_split_with_validation():
    ds = fd.get_dataset("synthetic", num_clients=4, max_examples=50)
    two = fd.resplit(ds, (0.9, 0.0, 0.1), seed=0)
    assert two.host_data.validation is None
    three = fd.resplit(ds, (0.8, 0.1, 0.1), seed=0)
    again = fd.resplit(three, (0.5, 0.25, 0.25), seed=4)  # validation rows are pooled too
    for k in range(4):
        assert _pooled(again, k) == _pooled(ds, k)


@pytest.mark.parametrize("fractions", [(0.8, 0.1), (0.8, 0.3, 0.1), (0.0, 0.5, 0.5),
                                       (0.9, -0.1, 0.2), ("a", 0, 1), (1.0, float("nan"), 0)])
def test_resplit_refuses_bad_fractions(fractions):
    ds = fd.get_dataset("synthetic", num_clients=3, max_examples=20)
    with pytest.raises(ValueError, match="fractions"):
        fd.resplit(ds, fractions)


def test_resplit_of_leaf_data_keeps_user_ids(tmp_path):
    import helpers
    rng = np.random.default_rng(0)
    user = lambda n: (rng.random((n, 784)).round(3).tolist(), rng.integers(0, 10, n).tolist())
    train = {"u_b": user(9), "u_a": user(20)}
    test = {"u_b": user(1), "u_a": user(5)}
    helpers.write_leaf(tmp_path / "train" / "all.json", ["u_b", "u_a"], train)
    helpers.write_leaf(tmp_path / "test" / "all.json", ["u_b", "u_a"], test)
    ds = fd.get_dataset("femnist", path=str(tmp_path))
    new = fd.resplit(ds, (0.8, 0.1, 0.1), seed=2)
    assert new.info["users"] == ds.info["users"]
    for k, u in enumerate(ds.info["users"]):
        n = len(train[u][1]) + len(test[u][1])
        assert int(new.host_data.train.num_examples[k]) == int(0.8 * n)
        assert _pooled(new, k) == _pooled(ds, k)


def test_device_copy_first_touched_under_jit_is_concrete():
    ds = fd.get_dataset("synthetic", num_clients=3, max_examples=20)
    total = jax.jit(lambda x: x + ds.data.train.num_examples.sum())(0)
    assert int(total) == int(np.asarray(ds.host_data.train.num_examples).sum())
    assert int(ds.data.train.num_examples.sum()) == int(total)  # no leaked tracer


def _rows(split, k):
    keep = np.asarray(split.mask[k])
    x, y = np.asarray(split.examples["x"][k])[keep], np.asarray(split.examples["y"][k])[keep]
    return sorted(map(tuple, np.column_stack([x.reshape(len(y), -1), y]).tolist()))


def test_hold_out_validation_moves_training_rows_and_leaves_test_alone():
    """floor(f n_k) of each client's training rows become its validation rows (train
    and validation together are the original training rows), the test split is the
    original's bit for bit, the draw is seeded, and a split already there is kept."""
    ds = fd.get_dataset("synthetic", num_clients=8, max_examples=60)
    held = fd.hold_out_validation(ds, 0.2, seed=3)
    h, o = held.host_data, ds.host_data
    n = np.asarray(o.train.num_examples)
    np.testing.assert_array_equal(h.validation.num_examples, np.floor(0.2 * n + 1e-9))
    np.testing.assert_array_equal(h.train.num_examples, n - np.floor(0.2 * n + 1e-9))
    for k in range(ds.num_clients):
        assert sorted(_rows(h.train, k) + _rows(h.validation, k)) == _rows(o.train, k)
        assert _rows(h.test, k) == _rows(o.test, k)
    again = fd.hold_out_validation(ds, 0.2, seed=3).host_data
    other = fd.hold_out_validation(ds, 0.2, seed=4).host_data
    assert all(_rows(again.validation, k) == _rows(h.validation, k) for k in range(8))
    assert any(_rows(other.validation, k) != _rows(h.validation, k) for k in range(8))
    assert fd.hold_out_validation(held, 0.5) is held  # a validation split is kept
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="^fraction: "):
            fd.hold_out_validation(ds, bad)
