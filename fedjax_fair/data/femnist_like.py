"""FEMNIST-shaped synthetic data for speed and memory benchmarks.

Same shapes as LEAF's FEMNIST (Caldas et al. 2018, "LEAF: A Benchmark for Federated
Settings"): 28x28x1 float32 inputs, 62 classes, a thousand-odd writers with a few
hundred examples each. The content is synthetic so that benchmarks run offline and
in about a second, yet the task is learnable and heterogeneous:

  template_c   a smooth random 28x28 pattern per class (7x7 N(0, 1) blocks, upsampled 4x)
  a_k          writer k's contrast, ~ U(0.5, 1.5)
  s_k          writer k's style shift: ``style`` x a smooth random pattern
  e            pixel noise, 8-bit uniform (256 levels), zero mean, std ``noise``
  x = (a_k * template_y + s_k + e) / sqrt(E[a^2] + style^2 + noise^2),  y ~ uniform

The normaliser gives the inputs about unit variance whatever the knobs. At the
default noise=5, a centralised multinomial logistic regression fitted on 8000
training examples reaches about 84% test accuracy (noise=3: about 98%, noise=7:
about 57%), so the task is learnable but not trivial.

Writer k holds n_k ~ U{min_examples..max_examples} training examples and
``test_examples`` test examples from the same distribution. Inputs are written straight
into the padded float32 block (no per-client copies; its padding pages are never
touched: ``federated.zeros_block``), and the noise is drawn as bytes,
which is several times cheaper than Gaussian draws. The padded train block alone takes
N * max_examples * 784 * 4 bytes (627 MB at the defaults).
"""
from __future__ import annotations

import numpy as np

from fedjax_fair.data.federated import Dataset, _check_seed, from_padded, zeros_block
from fedjax_fair.hparams import FieldError, count
from fedjax_fair.core.types import ClientData

SIDE = 28
LOW_RES = 7  # templates and style shifts are 7x7 patterns upsampled to 28x28
_BYTE_STD = np.sqrt((256.0 ** 2 - 1.0) / 12.0)  # std of a uniform integer on 0..255


def _smooth_patterns(rng: np.random.Generator, count: int) -> np.ndarray:
    """count smooth float32 [28, 28] patterns with N(0, 1) values on 4x4 blocks."""
    low = rng.standard_normal((count, LOW_RES, LOW_RES), dtype=np.float32)
    factor = SIDE // LOW_RES
    return np.repeat(np.repeat(low, factor, axis=1), factor, axis=2)


def _check_nonnegative(value, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not value >= 0:
        raise FieldError(field, f"must be a number >= 0, got {value!r}")
    return float(value)


def femnist_like(num_clients: int = 1000, min_examples: int = 50, max_examples: int = 200,
                 num_classes: int = 62, test_examples: int = 10, noise: float = 5.0,
                 style: float = 0.5, seed: int = 0) -> Dataset:
    """A FEMNIST-shaped federation (see the module docstring for the generator).

    Args:
      num_clients: number of writers N.
      min_examples, max_examples: range of per-client TRAIN sizes (inclusive); the
        train block is padded to M = the largest drawn size.
      num_classes: 62 like FEMNIST (digits, upper- and lower-case letters).
      test_examples: test examples per client (>= 1).
      noise: pixel-noise standard deviation relative to the templates (>= 0);
        larger is harder.
      style: size of the per-writer style shift (>= 0); larger is more heterogeneous.
      seed: everything is a function of the seed.

    Returns a Dataset named "femnist_like" with input_shape (28, 28, 1).
    """
    num_clients = count(num_clients, "num_clients")
    min_examples = count(min_examples, "min_examples")
    max_examples = count(max_examples, "max_examples")
    num_classes = count(num_classes, "num_classes")
    test_examples = count(test_examples, "test_examples")
    noise, style = _check_nonnegative(noise, "noise"), _check_nonnegative(style, "style")
    seed = _check_seed(seed)
    if max_examples < min_examples:
        raise FieldError("max_examples", f"must be >= min_examples={min_examples}, "
                                         f"got {max_examples}")
    norm = 1.0 / np.sqrt(13.0 / 12.0 + style ** 2 + noise ** 2)  # E[a^2] = 13/12
    rng = np.random.default_rng(seed)
    templates = np.float32(norm) * _smooth_patterns(rng, num_classes)
    shifts = np.float32(norm * style) * _smooth_patterns(rng, num_clients)
    contrast = rng.uniform(0.5, 1.5, num_clients).astype(np.float32)
    train_sizes = rng.integers(min_examples, max_examples + 1, num_clients).astype(np.int32)
    test_sizes = np.full(num_clients, test_examples, np.int32)
    scale = np.float32(norm * noise / _BYTE_STD)

    def fill(sizes: np.ndarray) -> ClientData:
        m = int(sizes.max())
        x = zeros_block((num_clients, m, SIDE, SIDE, 1), np.float32)
        y = np.zeros((num_clients, m), np.int32)
        # every client's contrast-scaled template rows go through one scratch block
        # instead of two fresh [n, 28, 28] temporaries per client (the same bits)
        scratch = np.empty((m, SIDE, SIDE), np.float32)
        for k, n in enumerate(sizes):
            labels = rng.integers(0, num_classes, n, dtype=np.int32)
            out, rows = x[k, :n, :, :, 0], scratch[:n]
            np.subtract(rng.integers(0, 256, out.shape, dtype=np.uint8), np.float32(127.5),
                        out=out)
            out *= scale
            np.multiply(np.take(templates, labels, axis=0, out=rows), contrast[k], out=rows)
            out += rows
            out += shifts[k]
            y[k, :n] = labels
        mask = np.arange(m)[None, :] < sizes[:, None]
        return ClientData(examples={"x": x, "y": y}, mask=mask, num_examples=sizes)

    train, test = fill(train_sizes), fill(test_sizes)
    info = {"num_clients": num_clients, "min_examples": min_examples,
            "max_examples": max_examples, "num_classes": num_classes,
            "test_examples": test_examples, "noise": noise, "style": style, "seed": seed,
            "source": "synthetic, FEMNIST-shaped (not real FEMNIST)"}
    return from_padded(train, test, name="femnist_like", num_classes=num_classes, info=info)
