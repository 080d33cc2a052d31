"""Real-dataset loaders: TFDS (mocked and tiny prepared datasets) and LEAF JSON.

No network: TFDS datasets come from ``tfds.testing.mock_data`` or from a tiny
dataset prepared here in ArrayRecord format; LEAF files are written to tmp_path.
"""
import io
import json
import shutil
import socket
import time

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image

import helpers

from fedjax_fair.data import federated as fd
from fedjax_fair.data import leaf
from fedjax_fair.data.tfds_source import (DatasetNotPreparedError, load_tfds, open_source,
                                          resolve_name)

# --------------------------------------------------------------------------- TFDS mocks


def _raw_images(name, n):
    """The mocked records, read one by one through the (working) __getitem__."""
    source = tfds.data_source(name, split="train", download=False)
    return [source[i] for i in range(n)]


@pytest.mark.parametrize("name, shape, classes", [("mnist", (28, 28, 1), 10),
                                                  ("fashion_mnist", (28, 28, 1), 10),
                                                  ("cifar10", (32, 32, 3), 10)])
def test_tfds_mock_images_are_scaled_uint8_and_labels_match(monkeypatch, name, shape,
                                                            classes):
    with helpers.mock_tfds(monkeypatch, num_examples=7):
        data = load_tfds(name, split="train")
        raw = _raw_images(name, 7)
    assert data.x.shape == (7, *shape) and data.x.dtype == np.float32
    assert data.y.shape == (7,) and data.y.dtype == np.int32
    assert data.num_classes == classes and data.input_shape == shape
    assert data.name == name and data.extras == {}  # cifar10's 'id' is text: no extra
    assert 0.0 <= data.x.min() and data.x.max() <= 1.0 and data.x.max() > 0.5
    for i, record in enumerate(raw):
        np.testing.assert_allclose(data.x[i], record["image"] / np.float32(255), rtol=1e-6)
        assert data.y[i] == record["label"]
    assert ((0 <= data.y) & (data.y < classes)).all()


def test_tfds_mock_cifar100_keeps_coarse_label_as_extra(monkeypatch):
    with helpers.mock_tfds(monkeypatch, num_examples=5):
        data = load_tfds("cifar100")
        raw = _raw_images("cifar100", 5)
    assert data.num_classes == 100 and set(data.extras) == {"coarse_label"}
    assert data.extras["coarse_label"].dtype == np.int64
    np.testing.assert_array_equal(data.extras["coarse_label"],
                                  [r["coarse_label"] for r in raw])


def test_tfds_mock_emnist_letters_labels_shift_to_zero(monkeypatch):
    to_letters = lambda label: 1 + int(label) % 26  # TFDS letters labels are 1..26
    with helpers.mock_tfds(monkeypatch, num_examples=30, label_fn=to_letters):
        data = load_tfds("emnist_letters")
        raw = _raw_images("emnist/letters", 30)
    assert data.name == "emnist/letters" and data.num_classes == 26
    assert data.x.shape == (30, 28, 28, 1)
    np.testing.assert_array_equal(data.y, [to_letters(r["label"]) - 1 for r in raw])
    assert data.y.min() >= 0 and data.y.max() <= 25


def test_tfds_mock_emnist_letters_rejects_labels_outside_1_to_26(monkeypatch):
    with helpers.mock_tfds(monkeypatch, num_examples=4, label_fn=lambda label: 0):
        with pytest.raises(ValueError, match=r"^dataset: 'emnist/letters' labels should "
                                             r"lie in 1\.\.26, found 0\.\.0"):
            load_tfds("emnist/letters")


def test_tfds_aliases_and_bad_names():
    assert resolve_name("emnist_letters") == "emnist/letters"
    assert resolve_name("EMNIST_DIGITS") == "emnist/digits"
    assert resolve_name("emnist") == "emnist/byclass"
    assert resolve_name("cifar10") == "cifar10"
    with pytest.raises(ValueError, match="^dataset: must be a non-empty"):
        resolve_name("  ")
    with pytest.raises(ValueError, match="^dataset: unknown TFDS dataset 'no_such_set_xyz'"):
        load_tfds("no_such_set_xyz")
    with pytest.raises(ValueError, match="^dataset: cannot open TFDS dataset 'emnist/nope'"):
        load_tfds("emnist/nope")
    with pytest.raises(ValueError, match="^split: must be a non-empty"):
        load_tfds("mnist", split="")


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@pytest.mark.parametrize("name", ["mnist", "emnist/letters", "cifar100"])
def test_tfds_not_prepared_fails_fast_with_instructions(tmp_path, no_network, name):
    start = time.perf_counter()
    with pytest.raises(DatasetNotPreparedError) as info:
        load_tfds(name, data_dir=str(tmp_path))
    assert time.perf_counter() - start < 10.0
    message = str(info.value)
    assert isinstance(info.value, ValueError) and message.startswith("dataset: ")
    assert repr(name) in message and str(tmp_path) in message
    assert f"tfds build {name} --data_dir {tmp_path} --file_format array_record" in message
    assert "download_and_prepare()" in message
    assert list(tmp_path.iterdir()) == []  # nothing was written, nothing downloaded


# --------------------------------------------------------------------------- TFDS files

TINY_TRAIN, TINY_TEST = 11, 4


def _png(image):
    buffer = io.BytesIO()
    Image.fromarray(image[..., 0]).save(buffer, format="PNG")
    buffer.seek(0)
    return buffer  # a file object: TFDS stores the PNG bytes without TensorFlow


def _tiny_examples(n, seed):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 6, 5, 1), dtype=np.uint8)
    labels = (np.arange(n) * 3 + seed) % 4
    writers = 100 + np.arange(n) // 3
    return images, labels, writers


class TinyWriters(tfds.core.GeneratorBasedBuilder):
    """A 4-class dataset of 6x5 grey images with a writer id, built offline."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(6, 5, 1)),
            "label": tfds.features.ClassLabel(num_classes=4),
            "writer": tfds.features.Scalar(dtype=np.int64)}))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(TINY_TRAIN, 0),
                "test": self._generate_examples(TINY_TEST, 1)}

    def _generate_examples(self, n, seed):
        images, labels, writers = _tiny_examples(n, seed)
        for i in range(n):
            yield i, {"image": _png(images[i]), "label": int(labels[i]),
                      "writer": int(writers[i])}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("tfds")
    TinyWriters(data_dir=str(data_dir), file_format="array_record").download_and_prepare()
    return data_dir


def test_tfds_prepared_array_record_dataset_reads_exactly(tiny_dir, no_network):
    for split, n, seed in (("train", TINY_TRAIN, 0), ("test", TINY_TEST, 1)):
        data = load_tfds("tiny_writers", split=split, data_dir=str(tiny_dir))
        images, labels, writers = _tiny_examples(n, seed)
        assert data.x.shape == (n, 6, 5, 1) and data.input_shape == (6, 5, 1)
        assert data.num_classes == 4 and data.name == "tiny_writers"
        # Stored order is shuffled by TFDS: match records by their writer/label pairs.
        order = np.lexsort((labels, writers))
        got = np.lexsort((data.y, data.extras["writer"]))
        np.testing.assert_array_equal(data.extras["writer"][got], writers[order])
        np.testing.assert_array_equal(data.y[got], labels[order])
        stored = np.rint(data.x * 255).astype(np.uint8)
        assert {im.tobytes() for im in stored} == {im.tobytes() for im in images}


def test_tfds_prepared_split_slicing_and_reading_in_batches(tiny_dir, monkeypatch):
    full = load_tfds("tiny_writers", split="train", data_dir=str(tiny_dir))
    head = load_tfds("tiny_writers", split="train[:5]", data_dir=str(tiny_dir))
    assert head.x.shape == (5, 6, 5, 1)
    np.testing.assert_array_equal(head.x, full.x[:5])
    monkeypatch.setattr("fedjax_fair.data.tfds_source.READ_BATCH", 3)  # 4 batches
    batched = load_tfds("tiny_writers", split="train", data_dir=str(tiny_dir))
    np.testing.assert_array_equal(batched.x, full.x)
    np.testing.assert_array_equal(batched.y, full.y)


def test_tfds_prepared_errors_for_split_features_and_format(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match=r"^split: cannot read split 'validation' of "
                                         r"'tiny_writers' \(splits: \['test', 'train'\]\)"):
        load_tfds("tiny_writers", split="validation", data_dir=str(tiny_dir))
    with pytest.raises(ValueError, match=r"^image_key: no feature 'img'; features: "
                                         r"\['image', 'label', 'writer'\]"):
        load_tfds("tiny_writers", data_dir=str(tiny_dir), image_key="img")
    with pytest.raises(ValueError, match="^label_key: feature 'image' is not an integer"):
        load_tfds("tiny_writers", data_dir=str(tiny_dir), label_key="image")
    # writer ids as labels: not a ClassLabel, so num_classes = max + 1.
    by_writer = load_tfds("tiny_writers", data_dir=str(tiny_dir), label_key="writer")
    assert by_writer.num_classes == int(by_writer.y.max()) + 1 == 100 + (TINY_TRAIN - 1) // 3 + 1
    assert set(by_writer.extras) == {"label"}
    # The same files declared as TFRecord (no random access): a clear conversion hint.
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    info_file = copy / "tiny_writers" / "1.0.0" / "dataset_info.json"
    info = json.loads(info_file.read_text())
    info["fileFormat"] = "tfrecord"
    info_file.write_text(json.dumps(info))
    with pytest.raises(ValueError, match=r"^dataset: 'tiny_writers' is prepared at .* in a "
                                         r"format without random access") as err:
        open_source("tiny_writers", data_dir=str(copy))
    assert "tfds convert_format" in str(err.value)


# --------------------------------------------------------------------------- LEAF files


def _femnist_user(rng, n):
    return rng.random((n, 784)).round(3).tolist(), rng.integers(0, 62, n).tolist()


def test_leaf_femnist_two_files_merged_in_sorted_user_order(tmp_path):
    rng = np.random.default_rng(0)
    users = {u: (_femnist_user(rng, n), _femnist_user(rng, 2))
             for u, n in (("f_b", 3), ("f_a", 1), ("f_c", 0))}
    helpers.write_leaf(tmp_path / "train" / "part_1.json", ["f_b"], {"f_b": users["f_b"][0]})
    helpers.write_leaf(tmp_path / "train" / "part_0.json", ["f_c", "f_a"],
           {"f_c": users["f_c"][0], "f_a": users["f_a"][0]})
    helpers.write_leaf(tmp_path / "test" / "all.json", ["f_a", "f_b", "f_c"],
           {u: users[u][1] for u in ("f_a", "f_b", "f_c")})
    fed = leaf.load_leaf(tmp_path)
    assert fed.kind == "images" and fed.user_ids == ["f_a", "f_b", "f_c"]
    assert fed.num_classes == 62 and fed.input_shape == (28, 28, 1) and fed.vocab is None
    for k, u in enumerate(fed.user_ids):
        for xs, ys, (x, y) in ((fed.train_xs, fed.train_ys, users[u][0]),
                               (fed.test_xs, fed.test_ys, users[u][1])):
            assert xs[k].dtype == np.float32 and xs[k].shape == (len(y), 28, 28, 1)
            assert ys[k].dtype == np.int32
            np.testing.assert_allclose(xs[k].reshape(len(y), 784),
                                       np.asarray(x, np.float32).reshape(len(y), 784))
            np.testing.assert_array_equal(ys[k], y)
    merged = leaf.read_leaf_dir(tmp_path / "train")
    assert list(merged) == ["f_c", "f_a", "f_b"]  # sorted files, then file order
    # The explicit train/test directory form gives the same federation.
    again = leaf.load_leaf(tmp_path / "train", tmp_path / "test", kind="images")
    np.testing.assert_array_equal(again.train_xs[1], fed.train_xs[1])


def test_leaf_chars_is_the_leaf_alphabet():
    assert len(leaf.LEAF_CHARS) == 80 == len(set(leaf.LEAF_CHARS))
    assert leaf.LEAF_CHARS[:3] == "\n !" and leaf.LEAF_CHARS[-1] == "}"
    ids = {c: leaf.LEAF_CHARS.index(c) for c in "0A[a}"}
    assert ids == {"0": 11, "A": 25, "[": 51, "a": 53, "}": 79}
    np.testing.assert_array_equal(leaf.encode("Aa0}\n"), [25, 53, 11, 79, 0])
    assert leaf.encode("").shape == (0,) and leaf.encode("").dtype == np.int32


def test_encode_oov_policies_and_vocab_checks():
    with pytest.raises(ValueError, match=r"^text: character '~' at position 2 is not in "
                                         r"the vocabulary"):
        leaf.encode("ab~c")
    np.testing.assert_array_equal(leaf.encode("ab~c", oov="extra"), [53, 54, 80, 55])
    np.testing.assert_array_equal(leaf.encode("cab", "abc"), [2, 0, 1])
    with pytest.raises(ValueError, match="^oov: must be one of"):
        leaf.encode("a", oov="skip")
    with pytest.raises(ValueError, match="^vocab: character 'a' appears more than once"):
        leaf.encode("a", "aba")


def test_char_windows_follow_leaf_preprocessing():
    windows, targets = leaf.char_windows("abcdef", window=3)
    assert windows == ["abc", "bcd", "cde"] and targets == ["d", "e", "f"]
    assert leaf.char_windows("abc", window=3) == ([], [])
    windows, targets = leaf.char_windows("a\n\nb   c", window=2, collapse_whitespace=True)
    assert windows == ["a ", " b", "b "] and targets == ["b", " ", "c"]  # "a b c"
    x, y = leaf.encode_windows(windows, targets)
    assert x.shape == (3, 2) and x.dtype == np.int32
    np.testing.assert_array_equal(x[0], [53, 1])
    np.testing.assert_array_equal(y, [54, 1, 55])
    with pytest.raises(ValueError, match="^window: "):
        leaf.char_windows("abc", window=0)
    with pytest.raises(ValueError, match="^x: window 1 has 2 characters, expected 3"):
        leaf.encode_windows(["abc", "ab"], ["d", "e"])
    with pytest.raises(ValueError, match="^x: target 0 must be one character"):
        leaf.encode_windows(["abc"], ["de"])


def _shakespeare_user(text):
    return leaf.char_windows(text, window=80)


def test_leaf_shakespeare_encodes_windows_and_targets(tmp_path):
    base = "To be, or not to be: that is the question. Whether 'tis nobler in the mind "
    texts = {"ROMEO": base * 2, "JULIET": base[::-1] * 2 + "}"}
    for split, cut in (("train", slice(0, 50)), ("test", slice(50, 60))):
        data = {}
        for u, t in texts.items():
            w, y = _shakespeare_user(t)
            data[u] = (w[cut], y[cut])
        helpers.write_leaf(tmp_path / split / "data.json", list(data), data)
    fed = leaf.load_leaf(tmp_path)
    assert fed.kind == "shakespeare" and fed.user_ids == ["JULIET", "ROMEO"]
    assert fed.vocab == leaf.LEAF_CHARS and fed.num_classes == 80
    assert fed.input_shape == (80,)
    for k, u in enumerate(fed.user_ids):
        windows, targets = _shakespeare_user(texts[u])
        assert fed.train_xs[k].shape == (50, 80) and fed.train_xs[k].dtype == np.int32
        assert fed.test_xs[k].shape == (10, 80)
        decoded = "".join(leaf.LEAF_CHARS[i] for i in fed.train_xs[k][7])
        assert decoded == windows[7]
        assert fed.test_ys[k][3] == leaf.LEAF_CHARS.index(targets[53])
    # Integer inputs survive stacking: token ids stay int32, padding is 0.
    ds = fd.from_client_arrays(fed.train_xs, fed.train_ys, fed.test_xs, fed.test_ys,
                               name="shakespeare", num_classes=fed.num_classes)
    assert ds.data.train.examples["x"].dtype == np.int32
    np.testing.assert_array_equal(np.asarray(ds.data.train.examples["x"][0]),
                                  fed.train_xs[0])


def test_leaf_shakespeare_unknown_character_policy(tmp_path):
    helpers.write_leaf(tmp_path / "train" / "a.json", ["u1"], {"u1": (["ab~" + "a" * 77], ["b"])})
    helpers.write_leaf(tmp_path / "test" / "a.json", ["u1"], {"u1": (["a" * 80], ["~"])})
    with pytest.raises(ValueError, match=r"^leaf: .*train: user 'u1': window 0 has "
                                         r"character '~' at position 2, which is not in "
                                         r"the vocabulary"):
        leaf.load_leaf(tmp_path)
    with pytest.raises(ValueError, match=r"^x: window 1 has character '~' at position 0"):
        leaf.encode_windows(["abc", "~bc"], ["d", "e"])
    with pytest.raises(ValueError, match=r"^x: target 1 '~', which is not in"):
        leaf.encode_windows(["abc", "abc"], ["d", "~"])
    fed = leaf.load_leaf(tmp_path, oov="extra")
    assert fed.num_classes == 81 and fed.train_xs[0][0, 2] == 80 and fed.test_ys[0][0] == 80


def test_leaf_synthetic_vectors_and_num_classes(tmp_path):
    rng = np.random.default_rng(1)
    def user(n):
        return rng.normal(size=(n, 5)).tolist(), rng.integers(0, 4, n).tolist()
    train = {"f_0": user(6), "f_1": user(0), "f_2": user(4)}
    test = {"f_0": user(2), "f_1": user(1), "f_2": user(0)}
    train["f_2"][1][0] = 3  # make sure the largest label is 3
    helpers.write_leaf(tmp_path / "train" / "mytrain.json", list(train), train)
    helpers.write_leaf(tmp_path / "test" / "mytest.json", list(test), test)
    fed = leaf.load_leaf(tmp_path)
    assert fed.kind == "vectors" and fed.input_shape == (5,) and fed.num_classes == 4
    assert fed.train_xs[1].shape == (0, 5) and fed.test_xs[2].shape == (0, 5)
    np.testing.assert_allclose(fed.train_xs[0], np.asarray(train["f_0"][0], np.float32))
    assert leaf.load_leaf(tmp_path, num_classes=10).num_classes == 10
    with pytest.raises(ValueError, match="^num_classes: label 3 does not fit num_classes=3"):
        leaf.load_leaf(tmp_path, num_classes=3)
    with pytest.raises(ValueError, match="^kind: must be one of"):
        leaf.load_leaf(tmp_path, kind="text")


def test_leaf_stray_label_is_an_error_naming_file_and_user(tmp_path):
    rng = np.random.default_rng(2)
    def user(n):
        return rng.normal(size=(n, 5)).tolist(), (np.arange(n) % 10).tolist()
    train = {"u0": user(20), "u1": user(20)}
    test = {"u0": user(5), "u1": user(5)}
    train["u1"][1][3] = 999  # one stray label among classes 0..9
    helpers.write_leaf(tmp_path / "train" / "part_a.json", ["u0"], {"u0": train["u0"]})
    helpers.write_leaf(tmp_path / "train" / "part_b.json", ["u1"], {"u1": train["u1"]})
    helpers.write_leaf(tmp_path / "test" / "t.json", list(test), test)
    with pytest.raises(ValueError, match="^num_classes: ") as info:
        leaf.load_leaf(tmp_path)
    assert "999" in str(info.value) and "part_b.json" in str(info.value)
    assert "'u1'" in str(info.value)
    with pytest.raises(ValueError, match="part_b.json"):  # a declared count, too
        leaf.load_leaf(tmp_path, num_classes=10)
    assert leaf.load_leaf(tmp_path, num_classes=1000).num_classes == 1000  # if intended


def test_leaf_rows_of_different_width_name_the_user(tmp_path):
    helpers.write_leaf(tmp_path / "train" / "a.json", ["u1", "u2"],
           {"u1": ([[0.0, 1.0, 2.0]], [0]), "u2": ([[0.0, 1.0]], [1])})
    helpers.write_leaf(tmp_path / "test" / "a.json", ["u1", "u2"], {"u1": ([], []), "u2": ([], [])})
    with pytest.raises(ValueError, match=r"^leaf: .*train: user 'u2': x has shape "
                                         r"\(1, 2\), expected \(n, 3\)"):
        leaf.load_leaf(tmp_path)


def test_leaf_user_missing_from_one_split_is_named(tmp_path):
    helpers.write_leaf(tmp_path / "train" / "a.json", ["u1", "u2"],
           {"u1": ([[0.0]], [0]), "u2": ([[1.0]], [1])})
    helpers.write_leaf(tmp_path / "test" / "a.json", ["u1"], {"u1": ([[0.5]], [0])})
    with pytest.raises(ValueError, match=r"^leaf: user 'u2' is in train \(.*train\) but not "
                                         r"in test \(.*test\)"):
        leaf.load_leaf(tmp_path)
    with pytest.raises(ValueError, match=r"^path: .* has no train/ and test/"):
        leaf.load_leaf(tmp_path / "train")
    with pytest.raises(ValueError, match=r"^path: no \*\.json files in"):
        leaf.read_leaf_dir(tmp_path)
    with pytest.raises(ValueError, match=r"^test_dir: .*nowhere is not a directory"):
        leaf.load_leaf(tmp_path / "train", tmp_path / "nowhere")


GOOD = {"u1": ([[0.0], [1.0]], [0, 1]), "u2": ([[2.0]], [1])}


def _bad_missing_key(d):
    d.write_text(json.dumps({"users": ["u1"], "user_data": {"u1": {"x": [], "y": []}}}))


def _bad_count(d):
    helpers.write_leaf(d, ["u1", "u2"], GOOD, num_samples=[2, 5])


def _bad_lengths(d):
    helpers.write_leaf(d, ["u1", "u2"], {"u1": GOOD["u1"], "u2": ([[2.0], [3.0]], [1])},
           num_samples=[2, 2])


def _bad_twice(d):
    helpers.write_leaf(d, ["u1", "u2", "u2"], GOOD, num_samples=[2, 1, 1])


def _bad_not_in_user_data(d):
    helpers.write_leaf(d, ["u1", "u2"], {"u1": GOOD["u1"]}, num_samples=[2, 1])


def _bad_not_in_users(d):
    helpers.write_leaf(d, ["u1"], {"u1": GOOD["u1"]}, extra_user_data={"u2": {"x": [], "y": []}})


def _bad_lists(d):
    helpers.write_leaf(d, ["u1", "u2"], GOOD, num_samples=[2])


def _bad_json(d):
    d.write_text('{"users": [')


def _bad_no_x(d):
    helpers.write_leaf(d, ["u1"], {}, extra_user_data={"u1": {"y": [0]}}, num_samples=[1])


@pytest.mark.parametrize("make, user, message", [
    (_bad_missing_key, None, "missing key 'num_samples'"),
    (_bad_count, "u2", "num_samples says 5 but the user has 1 examples"),
    (_bad_lengths, "u2", "has 2 x but 1 y"),
    (_bad_twice, "u2", r"is listed twice \(earlier in this file\)"),
    (_bad_not_in_user_data, "u2", "is in 'users' but not in 'user_data'"),
    (_bad_not_in_users, "u2", "is in 'user_data' but not in 'users'"),
    (_bad_lists, None, "'users' has 2 entries but 'num_samples' has 1"),
    (_bad_json, None, "not valid JSON"),
    (_bad_no_x, "u1", "missing key 'x'"),
])
def test_leaf_malformed_files_name_file_and_user(tmp_path, make, user, message):
    helpers.write_leaf(tmp_path / "train" / "a_good.json", ["u0"], {"u0": ([[5.0]], [0])})
    bad = tmp_path / "train" / "b_bad.json"
    make(bad)
    pattern = f"^leaf: {bad}: " + (f"user '{user}':? " if user else "") + message
    with pytest.raises(ValueError, match=pattern):
        leaf.read_leaf_dir(tmp_path / "train")


def test_leaf_user_repeated_across_files_names_both(tmp_path):
    first = helpers.write_leaf(tmp_path / "a.json", ["u1"], {"u1": GOOD["u1"]})
    second = helpers.write_leaf(tmp_path / "b.json", ["u1"], {"u1": GOOD["u1"]})
    with pytest.raises(ValueError, match=f"^leaf: {second}: user 'u1' is listed twice "
                                         f"\\(also in {first}\\)"):
        leaf.read_leaf_dir(tmp_path)


# --------------------------------------------------------------------------- stacking


def test_stack_clients_keeps_integer_inputs_as_int32():
    ids = [np.array([[1, 2, 3], [4, 5, 6]], np.int64), np.zeros((0, 3)),  # empty: float
           np.array([[7, 8, 9]], np.uint8)]
    cd = fd.stack_clients(ids, [np.array([0, 1]), np.zeros(0, int), np.array([2])])
    x = np.asarray(cd.examples["x"])
    assert x.dtype == np.int32 and x.shape == (3, 2, 3)
    np.testing.assert_array_equal(x[0], [[1, 2, 3], [4, 5, 6]])
    assert (x[1] == 0).all() and (x[2, 1] == 0).all()  # padding is 0
    mixed = fd.stack_clients([ids[0], np.array([[0.5, 1.0, 2.0]])], [[0, 1], [0]])
    assert mixed.examples["x"].dtype == np.float32
    with pytest.raises(ValueError, match="^xs: client 0 has integer inputs outside"):
        fd.stack_clients([np.array([[2 ** 40]])], [[0]])


def test_tfds_class_subset_one_client_per_class(tiny_dir, no_network):
    """The AFL protocol: keep some classes (relabelled in the order given), one client
    per class, each client's test set its class's examples of the global test set."""
    from fedjax_fair.data import get_dataset
    ds = get_dataset("tfds", tfds_name="tiny_writers", data_dir=str(tiny_dir),
                     classes=[3, 1], partition="by_class", num_clients=2, test="matched")
    full = load_tfds("tiny_writers", split="train", data_dir=str(tiny_dir))
    test = load_tfds("tiny_writers", split="test", data_dir=str(tiny_dir))
    assert ds.num_classes == 2
    for k, label in enumerate((3, 1)):
        for split, pool in ((ds.host_data.train, full), (ds.host_data.test, test)):
            y = np.asarray(split.examples["y"][k])[np.asarray(split.mask[k])]
            assert set(y.tolist()) <= {k}
        assert int(ds.host_data.train.num_examples[k]) == int(np.sum(full.y == label))
    with pytest.raises(ValueError, match="^classes"):
        get_dataset("tfds", tfds_name="tiny_writers", data_dir=str(tiny_dir), classes=[1, 1],
                    partition="by_class", num_clients=2)
    with pytest.raises(ValueError, match="num_clients"):
        get_dataset("tfds", tfds_name="tiny_writers", data_dir=str(tiny_dir), classes=[0, 1],
                    partition="by_class", num_clients=3)
