"""Registered real-data federations: TFDS (mocked) and LEAF builders, end to end."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import helpers
from fedjax_fair.data import DATASET_PARAMS, get_dataset
from fedjax_fair.data.builders import federate

POOL = 200  # mocked examples per split


def _pool_rows(ds, split):
    d = getattr(ds.host_data, split)
    return int(np.asarray(d.num_examples).sum())


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(
        (a.host_data.train.examples["x"], a.host_data.train.examples["y"],
         a.host_data.test.examples["y"]),
        (b.host_data.train.examples["x"], b.host_data.train.examples["y"],
         b.host_data.test.examples["y"])))


def test_tfds_cifar10_dirichlet_holdout(monkeypatch):
    with helpers.mock_tfds(monkeypatch, num_examples=POOL):
        ds = get_dataset("cifar10", num_clients=5, alpha=0.3, min_size=5, seed=1)
        again = get_dataset("cifar10", num_clients=5, alpha=0.3, min_size=5, seed=1)
        other = get_dataset("cifar10", num_clients=5, alpha=0.3, min_size=5, seed=2)
    assert ds.name == "cifar10" and ds.num_clients == 5 and ds.num_classes == 10
    assert ds.input_shape == (32, 32, 3)
    assert ds.host_data.train.examples["x"].dtype == np.float32
    # A covering partition + holdout uses every pooled example exactly once.
    assert _pool_rows(ds, "train") + _pool_rows(ds, "test") == POOL
    assert ds.info["partition"] == "dirichlet" and ds.info["partition_params"]["alpha"] == 0.3
    assert _same(ds, again) and not _same(ds, other)


def test_tfds_matched_test_comes_from_the_test_split(monkeypatch):
    with helpers.mock_tfds(monkeypatch, num_examples=POOL):
        ds = get_dataset("mnist", num_clients=10, partition="classes", classes_per_client=2,
                         test="matched", seed=0)
    assert _pool_rows(ds, "train") == POOL  # no holdout: the whole train pool is used
    train, test = ds.host_data.train, ds.host_data.test
    for k in range(10):
        tr = set(np.asarray(train.examples["y"][k])[np.asarray(train.mask[k])])
        te = set(np.asarray(test.examples["y"][k])[np.asarray(test.mask[k])])
        assert len(tr) <= 2 and te <= tr  # test labels follow the client's classes


def test_label_noise_flips_training_labels_only():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 3)).astype(np.float32)
    y = rng.integers(0, 4, 600).astype(np.int32)
    kw = dict(name="pool", num_classes=4, num_clients=6, partition="iid", seed=3)
    clean = federate(x, y, **kw)
    noisy = federate(x, y, label_noise="symmetric", noise_rate=0.5, **kw)
    ct, nt = clean.host_data.train, noisy.host_data.train
    np.testing.assert_array_equal(ct.examples["x"], nt.examples["x"])
    flipped = (ct.examples["y"] != nt.examples["y"])[ct.mask].mean()
    assert 0.4 < flipped < 0.6
    np.testing.assert_array_equal(clean.host_data.test.examples["y"],
                                  noisy.host_data.test.examples["y"])
    assert noisy.info["label_noise"] == "symmetric"


def test_builder_errors_name_the_field():
    x, y = np.zeros((40, 2), np.float32), np.arange(40) % 2
    with pytest.raises(ValueError, match="^test: 'matched' needs"):
        federate(x, y, name="p", num_classes=2, num_clients=2, test="matched")
    with pytest.raises(ValueError, match="^partition: unknown"):
        federate(x, y, name="p", num_classes=2, num_clients=2, partition="zipf")
    with pytest.raises(ValueError, match="^min_size: cannot read"):
        federate(x, y, name="p", num_classes=2, num_clients=2, min_size="ten")
    with pytest.raises(ValueError, match="^tfds_name: "):
        get_dataset("tfds")
    with pytest.raises(ValueError, match="^path: "):
        get_dataset("femnist")
    # Every builder lists its arguments (the CLI validates --dataset-arg against them).
    assert {"num_clients", "partition", "alpha", "test", "label_noise", "data_dir"} <= set(
        DATASET_PARAMS["cifar100"])


def _leaf_femnist(root, sizes):
    rng = np.random.default_rng(0)
    for split, mult in (("train", 1), ("test", 0.5)):
        data = {f"w{k}": (rng.random((max(int(n * mult), 1), 784)).round(2).tolist(),
                          rng.integers(0, 62, max(int(n * mult), 1)).tolist())
                for k, n in enumerate(sizes)}
        helpers.write_leaf(root / split / "all_data.json", list(data), data)


def test_leaf_femnist_builder_keeps_the_natural_partition(tmp_path):
    sizes = (6, 2, 9, 4)
    _leaf_femnist(tmp_path, sizes)
    ds = get_dataset("femnist", path=str(tmp_path))
    assert ds.num_clients == 4 and ds.input_shape == (28, 28, 1) and ds.num_classes == 62
    np.testing.assert_array_equal(ds.host_data.train.num_examples, sizes)
    sub = get_dataset("femnist", path=str(tmp_path), num_clients=2, min_size=3, seed=0)
    assert sub.num_clients == 2 and set(sub.info["users"]) <= {"w0", "w2", "w3"}
    with pytest.raises(ValueError, match="^num_clients: 4 requested"):
        get_dataset("femnist", path=str(tmp_path), num_clients=4, min_size=3)


def test_leaf_shakespeare_builder_gives_token_ids(tmp_path):
    from fedjax_fair.data import leaf
    text = "Now is the winter of our discontent made glorious summer by this sun of York; "
    for split in ("train", "test"):
        data = {u: tuple(v[:n] for v in leaf.char_windows(text * (2 + i)))
                for i, (u, n) in enumerate((("A", 5), ("B", 3)))}
        helpers.write_leaf(tmp_path / split / "d.json", list(data), data)
    ds = get_dataset("shakespeare", path=str(tmp_path))
    x = ds.host_data.train.examples["x"]
    assert x.dtype == np.int32 and x.shape == (2, 5, 80) and ds.num_classes == 80
    assert ds.info["vocab"] == leaf.LEAF_CHARS


def test_tfds_normalize_uses_the_published_channel_statistics(monkeypatch):
    from fedjax_fair.data import augment
    with helpers.mock_tfds(monkeypatch, num_examples=40):
        raw = get_dataset("cifar10", num_clients=2, partition="iid")
        std = get_dataset("cifar10", num_clients=2, partition="iid", normalize=True)
    r, s = raw.host_data.train, std.host_data.train
    mean, sd = np.array(augment.CIFAR10_MEAN), np.array(augment.CIFAR10_STD)
    real = np.asarray(r.mask)
    np.testing.assert_allclose(s.examples["x"][real], (r.examples["x"][real] - mean) / sd,
                               rtol=1e-5, atol=1e-5)
    assert not s.examples["x"][~real].any()  # padding rows stay zero


def test_tfds_cache_dir_keeps_the_decoded_split(monkeypatch, tmp_path):
    cache = tmp_path / "cache"
    with helpers.mock_tfds(monkeypatch, num_examples=20):
        first = get_dataset("mnist", num_clients=2, partition="iid", cache_dir=str(cache))
    files = list(cache.glob("*.npz"))
    assert len(files) == 1 and "mnist" in files[0].name
    # The second build reads the cache (decoding records would fail) and is equal.
    from fedjax_fair.data import tfds_source
    monkeypatch.setattr(tfds_source, "read_all", lambda *a, **k: pytest.fail("not cached"))
    with helpers.mock_tfds(monkeypatch, num_examples=20):
        again = get_dataset("mnist", num_clients=2, partition="iid", cache_dir=str(cache))
    assert _same(first, again)


def test_holdout_warns_when_a_reused_example_leaks_into_another_clients_test_split():
    """``dirichlet_prior`` refills its class pools, so a held-out example of one client
    can be a training example of another: the builder says how many."""
    with pytest.warns(UserWarning, match="held-out test examples are also training"):
        get_dataset("digits", num_clients=50, partition="dirichlet_prior", alpha=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_dataset("digits", num_clients=20, partition="iid")  # disjoint: silent
