"""Input preprocessing: per-channel normalisation and keyed per-batch augmentation.

Two kinds of function live here.

* ``normalize(x, mean, std)`` is deterministic and meant to run once, when a
  dataset is built (host or device). The named constants are the channel statistics
  the specs ask for.
* Augmenters are pure functions ``augment(key, x) -> x`` of a PRNG key and an image
  batch ``x [B, H, W, C]`` (channels last). They return an array of the same shape
  and dtype, draw every random choice from ``key`` (independently per example), and
  are jittable and vmappable over a leading client axis, so they run inside the
  ``lax.scan`` of local training (client.py). ``random_crop``, ``random_flip`` and
  ``random_rotation`` are the building blocks; ``chain`` composes them and
  ``standard_augmentation`` names the pipelines of the specs.

``with_augmentation(model, augment)`` plugs an augmenter into a ``Model``: its
``per_example_loss(params, batch, key)`` augments ``batch["x"]`` whenever ``key`` is
a key (local training) and leaves the batch alone when ``key`` is None (evaluation).

Pipelines of the specs (/work/shared/spec):

* A-FedPD (A-FedPD (arXiv:2409.18915) §5, CIFAR-10/100): per-channel normalisation, then a random
  horizontal flip with p = 0.5, then with probability 0.5 a random 32x32 crop of the
  image zero-padded by 4 px (zero padding in normalised space, i.e. normalise
  first, then augment). Test set: no augmentation. -> ``standard_augmentation("cifar")``.
* SuPerFed (superfed.md, TinyImageNet 64x64): ImageNet normalisation, random
  rotation of up to 20 degrees and horizontal flip.
  -> ``standard_augmentation("tinyimagenet")``. Its other datasets (MNIST, CIFAR
  resized to 28x28, FEMNIST) use values in [0, 1] with no normalisation.
* computational_heterogeneity.md and fedevg.md: no normalisation, no augmentation
  (``"none"``).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair.hparams import FieldError, probability
from fedjax_fair.models.base import Model

Augmenter = Callable[[jax.Array, jax.Array], jax.Array]

# Channel statistics of images scaled to [0, 1] (RGB order).
# CIFAR-10 and CIFAR-100: the values written in A-FedPD (arXiv:2409.18915) §5 (the sim's numbers:
# the training-set channel mean / std usually quoted for these sets; CIFAR-10's are
# rounded to three decimals).
CIFAR10_MEAN = (0.491, 0.482, 0.447)
CIFAR10_STD = (0.247, 0.243, 0.262)
CIFAR100_MEAN = (0.5071, 0.4867, 0.4408)
CIFAR100_STD = (0.2675, 0.2565, 0.2761)
# ImageNet (ILSVRC-2012 training set), the torchvision ``transforms.Normalize``
# values; superfed.md normalises TinyImageNet with them ("ImageNet-normalised").
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# MNIST training set, the values of the PyTorch MNIST example (pytorch/examples,
# mnist/main.py: Normalize((0.1307,), (0.3081,))). One channel.
MNIST_MEAN = (0.1307,)
MNIST_STD = (0.3081,)

PAD_MODES = ("constant", "edge", "reflect", "symmetric", "wrap")
STANDARD_AUGMENTATIONS = ("none", "cifar", "tinyimagenet")


# ----------------------------------------------------------------------------- checks


def _check_images(x) -> None:
    if x.ndim != 4:
        raise FieldError("x", f"must be an image batch [B, H, W, C], got shape {x.shape}")


def _check_probability(p) -> float:
    return probability(p, "p")


def _channel_stat(field: str, value, num_channels: int) -> np.ndarray:
    """``value`` as a float32 vector of length ``num_channels`` (a scalar is repeated)."""
    arr = np.asarray(value, np.float32)
    if arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] not in (1, num_channels)):
        raise FieldError(field, f"must be a scalar or hold one value per channel "
                                f"({num_channels}), got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise FieldError(field, f"must be finite, got {value!r}")
    return np.broadcast_to(arr.reshape(-1), (num_channels,))


# ----------------------------------------------------------------------- normalisation


def normalize(x, mean: Sequence[float], std: Sequence[float]) -> jax.Array:
    """Per-channel standardisation ``(x - mean) / std`` over the last (channel) axis.

    Parameters
    ----------
    x : array [..., C]
        Floating-point inputs on the scale of ``mean`` / ``std`` (for the constants
        of this module: pixels in [0, 1], i.e. ``uint8 / 255``). Integer inputs are
        refused rather than silently rescaled.
    mean, std : scalar or sequence of C floats
        Channel statistics (e.g. ``CIFAR10_MEAN``, ``CIFAR10_STD``); every std > 0.

    Returns
    -------
    array [..., C]
        float32 (or x's dtype if wider).
    """
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise FieldError("x", "must have a channel axis, got a scalar")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise FieldError("x", f"must be floating point on the scale of mean/std (e.g. "
                              f"uint8 / 255), got dtype {x.dtype}")
    c = x.shape[-1]
    mean_c = _channel_stat("mean", mean, c)
    std_c = _channel_stat("std", std, c)
    if np.any(std_c <= 0):
        raise FieldError("std", f"every value must be > 0, got {std!r}")
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    shape = (1,) * (x.ndim - 1) + (c,)
    return ((x.astype(dtype) - jnp.asarray(mean_c, dtype).reshape(shape))
            / jnp.asarray(std_c, dtype).reshape(shape))


# ---------------------------------------------------------------------------- cropping


def crop_offsets(key, batch_size: int, padding: int, p: float = 1.0) -> jax.Array:
    """The crop corners ``random_crop`` draws from ``key``: int32 [B, 2] (top, left).

    Each example independently is cropped with probability ``p``; a cropped example
    gets (top, left) uniform on {0, ..., 2 * padding}^2, an uncropped one gets
    (padding, padding), the crop that returns the image unchanged. The draws do
    not depend on ``p`` (only the coin's threshold does).
    """
    # One draw of 3B uniforms u on [0, 1), seen as [B, 3]: columns 0 and 1 give the
    # corner as floor(u * n), uniform on {0, ..., n - 1} up to the float32 grid of u
    # (relative bias below n * 2^-23); column 2 is the coin, u < p (what
    # jax.random.bernoulli computes). One flat draw compiles several times faster on
    # XLA:CPU than randint + bernoulli.
    n = 2 * padding + 1
    u = jax.random.uniform(key, (3 * batch_size,), jnp.float32).reshape(batch_size, 3)
    offsets = jnp.minimum(jnp.floor(u[:, :2] * n).astype(jnp.int32), n - 1)
    apply = u[:, 2] < p
    return jnp.where(apply[:, None], offsets, jnp.int32(padding))


def random_crop(key, x, padding: int = 4, mode: str = "constant", p: float = 1.0
                ) -> jax.Array:
    """Random translation: pad every image by ``padding`` px, take an H x W window.

    The window of example b starts at ``crop_offsets(key, B, padding, p)[b]`` in the
    padded image, so the output has the input's shape and dtype. This is
    torchvision's ``RandomCrop(H, padding=padding)`` applied per example (with
    ``p < 1``, as in A-FedPD (arXiv:2409.18915) §5, only a random subset of examples is cropped).

    Parameters
    ----------
    key : PRNG key
    x : array [B, H, W, C]
    padding : int >= 0
        Pixels added on every side; 0 makes the crop the identity.
    mode : str
        ``jnp.pad`` mode for the border: "constant" (zeros, the specs' choice),
        "edge", "reflect", "symmetric" or "wrap". "reflect" needs padding < H and W.
    p : float in [0, 1]
        Probability that an example is cropped (default 1: every example).
    """
    _check_images(x)
    if isinstance(padding, bool) or not isinstance(padding, (int, np.integer)) or padding < 0:
        raise FieldError("padding", f"must be an integer >= 0, got {padding!r}")
    if mode not in PAD_MODES:
        raise FieldError("mode", f"must be one of {PAD_MODES}, got {mode!r}")
    p = _check_probability(p)
    b, h, w, c = x.shape
    if mode == "reflect" and padding >= min(h, w):
        raise FieldError("padding", f"must be < the image side ({min(h, w)}) with "
                                    f"mode='reflect', got {padding}")
    if padding == 0:
        return x
    pad = ((padding, padding), (padding, padding), (0, 0))
    offsets = crop_offsets(key, b, padding, p)

    def crop_one(image, corner):
        padded = jnp.pad(image, pad, mode=mode)
        return jax.lax.dynamic_slice(padded, (corner[0], corner[1], 0), (h, w, c))

    return jax.vmap(crop_one)(x, offsets)


# ---------------------------------------------------------------------------- flipping


def random_flip(key, x, p: float = 0.5) -> jax.Array:
    """Horizontal (left-right, W axis) flip of each example with probability ``p``.

    Example b is flipped iff ``jax.random.bernoulli(key, p, (B,))[b]``, so p = 0
    returns x and p = 1 returns ``x[:, :, ::-1]``.
    """
    _check_images(x)
    p = _check_probability(p)
    flip = jax.random.bernoulli(key, p, (x.shape[0],))
    return jnp.where(flip[:, None, None, None], x[:, :, ::-1], x)


# ---------------------------------------------------------------------------- rotation


def rotate(x, degrees) -> jax.Array:
    """Rotates example b by ``degrees[b]`` about the image centre (nearest neighbour).

    Positive angles turn the image counter-clockwise as displayed (row 0 at the
    top), like torchvision's ``rotate``. Output pixels whose source falls outside
    the image are 0. Pixel (i, j) of the output reads the input at
    the inverse rotation of ``(i, j) - centre``, plus centre, rounded to the nearest pixel, with
    centre = ((H - 1) / 2, (W - 1) / 2).

    Parameters
    ----------
    x : array [B, H, W, C]
    degrees : array [B]
    """
    _check_images(x)
    b, h, w, _ = x.shape
    degrees = jnp.asarray(degrees, jnp.float32)
    if degrees.shape != (b,):
        raise FieldError("degrees", f"must have shape ({b},), got {degrees.shape}")
    ci, cj = (h - 1) / 2.0, (w - 1) / 2.0
    di = (jnp.arange(h, dtype=jnp.float32) - ci)[:, None]  # [H, 1], down
    dj = (jnp.arange(w, dtype=jnp.float32) - cj)[None, :]  # [1, W], right

    def rotate_one(image, angle):
        theta = jnp.deg2rad(angle)
        cos, sin = jnp.cos(theta), jnp.sin(theta)
        # Rows point down, so a counter-clockwise turn on screen by theta moves the
        # offset (di, dj) to (cos di - sin dj, sin di + cos dj); an output offset
        # therefore reads its pixel from (cos di + sin dj, -sin di + cos dj).
        src_i = jnp.round(ci + cos * di + sin * dj).astype(jnp.int32)
        src_j = jnp.round(cj - sin * di + cos * dj).astype(jnp.int32)
        inside = (src_i >= 0) & (src_i < h) & (src_j >= 0) & (src_j < w)
        pixels = image[jnp.clip(src_i, 0, h - 1), jnp.clip(src_j, 0, w - 1)]
        return jnp.where(inside[:, :, None], pixels, jnp.zeros((), image.dtype))

    return jax.vmap(rotate_one)(x, degrees)


def random_rotation(key, x, max_degrees: float = 20.0) -> jax.Array:
    """Rotation of each example by an angle uniform on [-max_degrees, max_degrees].

    torchvision's ``RandomRotation(max_degrees)`` per example (nearest neighbour,
    zero fill), the TinyImageNet augmentation of superfed.md. See ``rotate``.
    """
    _check_images(x)
    try:
        max_degrees = float(max_degrees)
    except (TypeError, ValueError):
        raise FieldError("max_degrees", f"must be a number >= 0, got {max_degrees!r}") from None
    if not (math.isfinite(max_degrees) and max_degrees >= 0):
        raise FieldError("max_degrees", f"must be a finite number >= 0, got {max_degrees}")
    angles = jax.random.uniform(key, (x.shape[0],), jnp.float32, -max_degrees, max_degrees)
    return rotate(x, angles)


# --------------------------------------------------------------------------- composing


def identity(key, x):
    """The augmenter that does nothing (``standard_augmentation("none")``)."""
    del key
    return x


def chain(*augmenters: Augmenter) -> Augmenter:
    """Composition: applies ``augmenters`` in order, each with its own key.

    ``chain(f, g)(key, x) = g(k2, f(k1, x))`` with ``k1, k2 = jax.random.split(key)``.
    With no augmenter the chain is ``identity``.
    """
    for i, f in enumerate(augmenters):
        if not callable(f):
            raise FieldError("augmenters", f"item {i} is not callable, got {f!r}")
    if not augmenters:
        return identity

    def augment(key, x):
        keys = jax.random.split(key, len(augmenters))
        for k, f in zip(keys, augmenters):
            x = f(k, x)
        return x

    return augment


def standard_augmentation(name: str) -> Augmenter:
    """The training-time augmentation of a spec, by name.

    * ``"none"``: ``identity``.
    * ``"cifar"`` (A-FedPD (arXiv:2409.18915) §5): horizontal flip with p = 0.5, then with
      probability 0.5 a random crop from the image zero-padded by 4 px. Apply it to
      normalised images (the zero padding is in normalised space).
    * ``"tinyimagenet"`` (superfed.md): random rotation in [-20, 20] degrees, then a
      horizontal flip with p = 0.5 (torchvision order: RandomRotation,
      RandomHorizontalFlip).
    """
    if name == "none":
        return identity
    if name == "cifar":
        return chain(lambda k, x: random_flip(k, x, 0.5),
                     lambda k, x: random_crop(k, x, padding=4, mode="constant", p=0.5))
    if name == "tinyimagenet":
        return chain(lambda k, x: random_rotation(k, x, 20.0),
                     lambda k, x: random_flip(k, x, 0.5))
    raise FieldError("name", f"must be one of {STANDARD_AUGMENTATIONS}, got {name!r}")


# ------------------------------------------------------------------------------ models


def with_augmentation(model: Model, augment: Augmenter) -> Model:
    """A Model whose training loss sees augmented inputs.

    The new ``per_example_loss(params, batch, key)``:

    * key is None (evaluation): the wrapped model's loss on ``batch`` as is;
    * otherwise: ``k_aug, k_model = jax.random.split(key)``, then the wrapped
      model's loss on ``{**batch, "x": augment(k_aug, batch["x"])}`` with key
      ``k_model``, so the network's own randomness (dropout-like) gets a key
      independent of the augmentation.

    ``per_example_metrics`` and ``apply`` are unchanged (augmentation belongs to the
    training objective, not to the network function), as are ``init`` and the
    static fields except ``name``, which becomes ``model.name + "+aug"`` so reports
    show that the model was trained with augmentation. Wrapping with ``identity``
    returns the model unchanged.
    """
    if not isinstance(model, Model):
        raise FieldError("model", f"must be a fedjax_fair Model, got {type(model).__name__}")
    if not callable(augment):
        raise FieldError("augment", f"must be a callable (key, x) -> x, got {augment!r}")
    if augment is identity:
        return model
    base_loss = model.per_example_loss

    def per_example_loss(params, batch, key=None):
        if key is None:
            return base_loss(params, batch, None)
        key_aug, key_model = jax.random.split(key)
        return base_loss(params, {**batch, "x": augment(key_aug, batch["x"])}, key_model)

    return model._replace(per_example_loss=per_example_loss, name=f"{model.name}+aug")
