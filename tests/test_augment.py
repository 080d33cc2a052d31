"""Tests of fedjax_fair/data/augment.py: normalisation, crops, flips, rotations, their
composition, and the ``with_augmentation`` model wrapper (inside local training too).

Images are tiny (a few pixels) and every augmentation runs jitted (``_jit``):
compiling one small program is much cheaper than dispatching the ops one by one.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_fair.core import client
from fedjax_fair.data import augment as A
from fedjax_fair.models import mlp
from fedjax_fair.core.types import Broadcast, ClientData
from fedjax_fair.core.client import ClientTraining


def _images(b=4, h=6, w=5, c=3, seed=0, dtype=np.float32):
    """A batch whose pixels are all distinct positive values (1, 2, 3, ...)."""
    x = np.arange(1, b * h * w * c + 1).reshape(b, h, w, c)
    if seed:
        x = np.random.default_rng(seed).permutation(x.reshape(-1)).reshape(b, h, w, c)
    return jnp.asarray(x.astype(dtype))


def _jit(f, **kwargs):
    """``f`` with keyword arguments fixed, jitted."""
    return jax.jit(functools.partial(f, **kwargs))


def _augmenters():
    # "cifar" covers chain and a crop with p = 0.5 after a flip.
    return {
        "crop": lambda k, x: A.random_crop(k, x, 2),
        "flip": A.random_flip,
        "rotation": A.random_rotation,
        "cifar": A.standard_augmentation("cifar"),
    }


# ------------------------------------------------------------------------ normalisation


def test_normalize_matches_numpy_and_constants():
    x = np.random.default_rng(0).uniform(size=(2, 3, 3, 3)).astype(np.float32)
    out = A.normalize(x, A.CIFAR10_MEAN, A.CIFAR10_STD)
    expected = (x - np.array(A.CIFAR10_MEAN)) / np.array(A.CIFAR10_STD)
    assert out.dtype == jnp.float32 and out.shape == x.shape
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    # The paper's numbers (A-FedPD (arXiv:2409.18915) §5) and the usual ImageNet / MNIST values.
    assert A.CIFAR10_MEAN == (0.491, 0.482, 0.447) and A.CIFAR10_STD == (0.247, 0.243, 0.262)
    assert A.CIFAR100_MEAN == (0.5071, 0.4867, 0.4408)
    assert A.CIFAR100_STD == (0.2675, 0.2565, 0.2761)
    assert A.IMAGENET_MEAN == (0.485, 0.456, 0.406) and A.IMAGENET_STD == (0.229, 0.224, 0.225)
    gray = A.normalize(jnp.full((1, 2, 2, 1), 0.1307 + 0.3081), A.MNIST_MEAN, A.MNIST_STD)
    np.testing.assert_allclose(gray, 1.0, rtol=1e-5)
    # A scalar mean / std is shared by all channels; works under jit too.
    np.testing.assert_allclose(jax.jit(lambda v: A.normalize(v, 0.5, 0.25))(x),
                               (x - 0.5) / 0.25, rtol=1e-6)


@pytest.mark.parametrize("mean,std,x,field", [
    ((0.1, 0.2), (1.0, 1.0), np.zeros((1, 2, 2, 3), np.float32), "mean"),
    ((0.1, 0.2, 0.3), (1.0, 0.0, 1.0), np.zeros((1, 2, 2, 3), np.float32), "std"),
    ((0.1, 0.2, 0.3), ((1.0,),), np.zeros((1, 2, 2, 3), np.float32), "std"),
    (0.0, 1.0, np.zeros((1, 2, 2, 3), np.uint8), "x"),
])
def test_normalize_rejects_bad_arguments(mean, std, x, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        A.normalize(x, mean, std)


# -------------------------------------------------------------------- shared properties


@pytest.mark.parametrize("name", list(_augmenters()))
def test_shape_dtype_determinism_jit_and_client_vmap(name):
    aug = jax.jit(_augmenters()[name])
    x = _images(b=8, h=6, w=6, c=2)
    k1, k2 = jax.random.key(1), jax.random.key(2)
    out = aug(k1, x)
    assert out.shape == x.shape and out.dtype == x.dtype
    np.testing.assert_array_equal(aug(k1, x), out)                    # same key, same output
    assert not np.array_equal(aug(k2, x), out)                        # different key differs
    # vmap over a leading client axis equals one call per client.
    xs = jnp.stack([x, x[::-1] + 100.0, 2.0 * x])
    keys = jax.random.split(jax.random.key(3), 3)
    mapped = jax.jit(jax.vmap(aug))(keys, xs)
    for c in range(3):
        np.testing.assert_array_equal(mapped[c], aug(keys[c], xs[c]))


def test_integer_images_and_raw_keys():
    # "cifar" and "tinyimagenet" between them run every augmenter.
    x = _images(b=3, h=4, w=4, c=1, dtype=np.uint8)
    cifar, tiny = A.standard_augmentation("cifar"), A.standard_augmentation("tinyimagenet")
    run = jax.jit(lambda k: (cifar(k, x), tiny(k, x)))
    for out in run(jax.random.PRNGKey(0)):  # an old-style uint32 key
        assert out.dtype == jnp.uint8 and out.shape == x.shape


# ---------------------------------------------------------------------------- cropping


def test_crop_with_zero_padding_is_identity():
    x = _images()
    np.testing.assert_array_equal(A.random_crop(jax.random.key(0), x, padding=0), x)


def test_crop_places_original_pixels_at_the_drawn_offset():
    b, h, w, c, pad = 16, 6, 5, 2, 3
    x = _images(b, h, w, c)
    key = jax.random.key(7)
    out = np.asarray(_jit(A.random_crop, padding=pad)(key, x))
    offsets = np.asarray(_jit(A.crop_offsets, batch_size=b, padding=pad)(key))
    assert offsets.shape == (b, 2) and offsets.min() >= 0 and offsets.max() <= 2 * pad
    xn = np.asarray(x)
    for i in range(b):
        top, left = offsets[i]
        padded = np.pad(xn[i], ((pad, pad), (pad, pad), (0, 0)))
        np.testing.assert_array_equal(out[i], padded[top:top + h, left:left + w])
        # Independently of crop_offsets: pixel (0, 0) of the original (a unique
        # value) lands at (pad - top, pad - left) when that is inside the window.
        r, s = pad - top, pad - left
        if 0 <= r < h and 0 <= s < w:
            np.testing.assert_array_equal(out[i, r, s], xn[i, 0, 0])
        # Whatever is not an original pixel is the zero padding.
        assert set(np.unique(out[i])) <= set(np.unique(xn[i])) | {0.0}
    # Offsets are drawn per example: not all the same.
    assert len({tuple(o) for o in offsets}) > 1


def test_crop_edge_mode_repeats_border_pixels():
    x = _images(b=32, h=4, w=4, c=1)
    out = np.asarray(_jit(A.random_crop, padding=2, mode="edge")(jax.random.key(0), x))
    assert not np.any(out == 0)                       # no zeros: padding copies the edge
    assert set(np.unique(out)) <= set(np.unique(np.asarray(x)))
    assert not np.array_equal(out, x)


def test_crop_offsets_distribution_and_probability():
    b, pad = 4000, 2
    x = _images(b=4, h=4, w=4, c=1)

    @jax.jit
    def draws(k0, k1, k2):
        return (A.crop_offsets(k0, b, pad), A.crop_offsets(k1, b, pad, p=0.0),
                A.crop_offsets(k2, b, pad, p=0.5), A.random_crop(k1, x, pad, p=0.0))

    full, never, half, uncropped = map(np.asarray, draws(*jax.random.split(jax.random.key(2), 3)))
    # Every corner of {0..4}^2 is reached, each with frequency about 1/25.
    counts = np.bincount(full[:, 0] * 5 + full[:, 1], minlength=25)
    assert counts.size == 25 and np.all(np.abs(counts / b - 0.04) < 0.015)
    np.testing.assert_array_equal(never, pad)          # p = 0: every crop is the identity
    np.testing.assert_array_equal(uncropped, x)
    moved = np.any(half != pad, axis=1).mean()
    # Cropped examples keep the centre with chance 1/25: expected 0.5 * 24/25 = 0.48.
    assert abs(moved - 0.48) < 0.03


@pytest.mark.parametrize("kwargs,field", [
    ({"padding": -1}, "padding"), ({"padding": 1.5}, "padding"), ({"mode": "zeros"}, "mode"),
    ({"p": 1.5}, "p"), ({"padding": 6, "mode": "reflect"}, "padding"),
])
def test_crop_rejects_bad_arguments(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        A.random_crop(jax.random.key(0), _images(h=6, w=6), **kwargs)
    with pytest.raises(ValueError, match=r"^x: "):
        A.random_crop(jax.random.key(0), jnp.zeros((2, 3, 3)))


# ---------------------------------------------------------------------------- flipping


def test_flip_extremes():
    x = _images()
    key = jax.random.key(0)
    np.testing.assert_array_equal(_jit(A.random_flip, p=0.0)(key, x), x)
    np.testing.assert_array_equal(_jit(A.random_flip, p=1.0)(key, x), x[:, :, ::-1])


def test_flip_rate_matches_p():
    b = 10000
    x = jnp.broadcast_to(jnp.array([0.0, 1.0]).reshape(1, 1, 2, 1), (b, 1, 2, 1))
    xs = _images(b=64)

    @jax.jit
    def flips(k):
        k1, k2, k3 = jax.random.split(k, 3)
        return A.random_flip(k1, x, 0.25), A.random_flip(k2, x, 0.8), A.random_flip(k3, xs)

    quarter, most, out = flips(jax.random.key(0))
    for p, flipped in ((0.25, quarter), (0.8, most)):
        assert abs((np.asarray(flipped)[:, 0, 0, 0] == 1.0).mean() - p) < 0.02
    # Each example is either untouched or mirrored, independently.
    same = [np.array_equal(o, xi) for o, xi in zip(np.asarray(out), np.asarray(xs))]
    mirrored = [np.array_equal(o, xi[:, ::-1]) for o, xi in zip(np.asarray(out), np.asarray(xs))]
    assert all(a != m for a, m in zip(same, mirrored)) and 16 < sum(same) < 48
    with pytest.raises(ValueError, match=r"^p: "):
        A.random_flip(jax.random.key(0), x, p=-0.1)


# ---------------------------------------------------------------------------- rotation


def test_rotate_exact_angles():
    x = _images(b=3, h=5, w=5, c=2)
    y = _images(b=3, h=4, w=6, c=1)
    rot = jax.jit(A.rotate)
    np.testing.assert_array_equal(rot(x, jnp.zeros(3)), x)
    np.testing.assert_array_equal(rot(x, jnp.full(3, 180.0)), x[:, ::-1, ::-1])
    # +90 degrees is counter-clockwise on screen, numpy's rot90 over (H, W).
    np.testing.assert_array_equal(rot(x, jnp.full(3, 90.0)), np.rot90(x, 1, axes=(1, 2)))
    # Per-example angles.
    out = rot(x, jnp.array([0.0, 90.0, -90.0]))
    np.testing.assert_array_equal(out[0], x[0])
    np.testing.assert_array_equal(out[2], np.rot90(x[2], -1, axes=(0, 1)))
    # Even sides: the centre lies between pixels; 180 degrees is still exact.
    np.testing.assert_array_equal(rot(y, jnp.full(3, 180.0)), y[:, ::-1, ::-1])


def test_random_rotation_angles_and_fill():
    x = _images(b=16, h=15, w=15, c=1)
    xn = np.asarray(x)
    np.testing.assert_array_equal(_jit(A.random_rotation, max_degrees=0.0)(jax.random.key(0), x), x)
    key = jax.random.key(1)
    out = np.asarray(jax.jit(A.random_rotation)(key, x))
    # The angles are uniform on [-20, 20] drawn from the key, one per example.
    angles = jax.random.uniform(key, (16,), jnp.float32, -20.0, 20.0)
    np.testing.assert_array_equal(out, jax.jit(A.rotate)(x, angles))
    # The centre pixel never moves; corners may fall outside and become 0.
    np.testing.assert_array_equal(out[:, 7, 7], xn[:, 7, 7])
    assert set(np.unique(out)) <= set(np.unique(xn)) | {0.0}
    # Near the corners (7 px from the centre on each axis) a turn by theta moves a
    # pixel by about 7 |sin theta| px (+ 7 (1 - cos theta)): over 5 degrees the image
    # changes, under 3 degrees nearest-neighbour rounding leaves it unchanged.
    changed = np.array([not np.array_equal(o, xi) for o, xi in zip(out, xn)])
    angles = np.abs(np.asarray(angles))
    assert np.all(changed[angles > 5.0]) and not np.any(changed[angles < 3.0])
    assert len(np.unique(np.round(angles, 3))) == 16
    with pytest.raises(ValueError, match=r"^max_degrees: "):
        A.random_rotation(jax.random.key(0), x, -1.0)
    with pytest.raises(ValueError, match=r"^degrees: "):
        A.rotate(x, jnp.zeros(3))


# --------------------------------------------------------------------------- composing


def test_chain_splits_the_key_and_applies_in_order():
    x = _images()
    key = jax.random.key(5)
    flip = lambda k, v: A.random_flip(k, v, 0.5)
    crop = lambda k, v: A.random_crop(k, v, 2)

    chained = A.chain(flip, crop)

    @jax.jit
    def both(k, v):
        k1, k2 = jax.random.split(k)
        return chained(k, v), crop(k2, flip(k1, v))

    got, by_hand = both(key, x)
    np.testing.assert_array_equal(got, by_hand)
    assert not np.array_equal(got, x)
    assert A.chain() is A.identity
    np.testing.assert_array_equal(A.chain()(key, x), x)
    with pytest.raises(ValueError, match=r"^augmenters: "):
        A.chain(flip, 3)


def test_standard_augmentations():
    x = _images(b=8, h=8, w=8, c=3)
    key = jax.random.key(0)
    assert A.standard_augmentation("none") is A.identity

    cifar, tiny = A.standard_augmentation("cifar"), A.standard_augmentation("tinyimagenet")

    @jax.jit
    def both(k, v):
        k1, k2 = jax.random.split(k)
        by_hand = (A.random_crop(k2, A.random_flip(k1, v, 0.5), 4, "constant", p=0.5),
                   A.random_flip(k2, A.random_rotation(k1, v, 20.0), 0.5))
        return (cifar(k, v), tiny(k, v)), by_hand

    (got_cifar, got_tiny), (want_cifar, want_tiny) = both(key, x)
    np.testing.assert_array_equal(got_cifar, want_cifar)
    np.testing.assert_array_equal(got_tiny, want_tiny)
    with pytest.raises(ValueError, match=r"^name: "):
        A.standard_augmentation("imagenet")


# ------------------------------------------------------------------------------ models


@functools.lru_cache(maxsize=None)
def _model_and_batch(b=6):
    """A tiny MLP on 4x4x1 images, its parameters and a batch (built once)."""
    model = mlp((4, 4, 1), 3, hidden=(8,))
    rng = np.random.default_rng(0)
    batch = {"x": jnp.asarray(rng.normal(size=(b, 4, 4, 1)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, 3, b), jnp.int32)}
    return model, jax.jit(model.init)(jax.random.key(0)), batch


def test_with_augmentation_changes_training_loss_only():
    model, params, batch = _model_and_batch()
    aug = lambda k, v: A.random_crop(k, v, 1)
    wrapped = A.with_augmentation(model, aug)
    assert wrapped.name == "mlp+aug" and wrapped.input_shape == model.input_shape
    assert wrapped.per_example_metrics is model.per_example_metrics
    assert wrapped.apply is model.apply and wrapped.init is model.init

    @jax.jit
    def losses(p, b, k):
        k_aug, k_model = jax.random.split(k)
        by_hand = model.per_example_loss(p, {**b, "x": aug(k_aug, b["x"])}, k_model)
        return {"eval": wrapped.per_example_loss(p, b, None),
                "eval_default": wrapped.per_example_loss(p, b),
                "plain_eval": model.per_example_loss(p, b, None),
                "train": wrapped.per_example_loss(p, b, k),
                "plain_train": model.per_example_loss(p, b, k),
                "by_hand": by_hand}

    out = losses(params, batch, jax.random.key(3))
    # Evaluation (key None): identical to the plain model.
    np.testing.assert_array_equal(out["eval"], out["plain_eval"])
    np.testing.assert_array_equal(out["eval_default"], out["plain_eval"])
    # Training (a key): the loss of the augmented batch, with the key split in two.
    assert out["train"].shape == (6,)
    assert not np.allclose(out["train"], out["plain_train"])
    np.testing.assert_allclose(out["train"], out["by_hand"], rtol=1e-6)
    assert A.with_augmentation(model, A.identity) is model
    with pytest.raises(ValueError, match=r"^augment: "):
        A.with_augmentation(model, None)
    with pytest.raises(ValueError, match=r"^model: "):
        A.with_augmentation(object(), aug)


def test_with_augmentation_inside_local_training_vmapped_over_clients():
    # Two clients hold the same rows and take one full-batch SGD step each, so for
    # the plain model their deltas are equal whatever their keys (a full batch is
    # order-free). With augmentation the keys (different per client) reach
    # per_example_loss inside the scan, so the deltas differ. (A flip alone keeps
    # the compile short; "cifar" is covered under jit and vmap above.)
    model, params, _ = _model_and_batch()
    rng = np.random.default_rng(1)
    k, m = 2, 8
    x = np.broadcast_to(rng.normal(size=(1, m, 4, 4, 1)), (k, m, 4, 4, 1))
    y = np.broadcast_to(rng.integers(0, 3, (1, m)), (k, m))
    data = ClientData(examples={"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y, jnp.int32)},
                      mask=jnp.ones((k, m), bool), num_examples=jnp.full((k,), m, jnp.int32))
    keys = jax.random.split(jax.random.key(0), k)
    augmented = A.with_augmentation(model, A.random_flip)
    update = client.local_training(augmented, training=ClientTraining(optimizer=optax.sgd(0.5),
                                                                      batch_size=m, num_epochs=1), track_loss=False)
    broadcast = Broadcast(params, jnp.zeros((), jnp.int32))
    out, _ = jax.jit(jax.vmap(update, in_axes=(None, None, 0, None, 0)))(
        broadcast, (), data, jnp.int32(1), keys)
    assert np.all(np.asarray(out.num_steps) == 1)
    leaves = jax.tree.leaves(out.delta)
    assert all(np.all(np.isfinite(leaf)) for leaf in leaves)
    assert any(np.max(np.abs(leaf)) > 0 for leaf in leaves)
    assert any(not np.allclose(leaf[0], leaf[1]) for leaf in leaves)
