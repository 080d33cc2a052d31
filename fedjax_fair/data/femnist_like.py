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

``procedural=True`` holds no rows: writer k's rows are computed from (seed, k) inside
each round (``generated.py``), with the same generative model, so a federation of a
million writers costs memory in the cohort only. Its values differ from the
in-memory federation's at the same seed (JAX's counter-based keys, one per writer,
instead of one sequential NumPy stream).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair.data import generated
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
                 style: float = 0.5, seed: int = 0, procedural: bool = False) -> Dataset:
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
      procedural: compute each writer's rows from (seed, writer id) inside the round
        instead of holding them (the splits are ``generated.GeneratedClients``).

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
    info = {"num_clients": num_clients, "min_examples": min_examples,
            "max_examples": max_examples, "num_classes": num_classes,
            "test_examples": test_examples, "noise": noise, "style": style, "seed": seed,
            "source": "synthetic, FEMNIST-shaped (not real FEMNIST)"}
    if procedural:
        return _procedural(info, norm)
    row = SIDE * SIDE * 4 + 4 + 1  # an input, its label and its mask entry
    generated.check_held(num_clients, num_clients * (max_examples + test_examples) * row,
                         "writers")
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
    return from_padded(train, test, name="femnist_like", num_classes=num_classes, info=info)


# ------------------------------------------------------------------ procedural


@dataclasses.dataclass(frozen=True)
class _WriterRows:
    """Writer k's rows of one split (``generated.GeneratedClients.rows``): the module
    docstring's model, drawn from the writer's key ``fold_in(key, k)``: its style shift
    from ``fold_in(., 0)``, contrast from ``fold_in(., 1)``, size from ``fold_in(., 4)``
    and split s's labels and pixel noise from ``fold_in(fold_in(., 2 + s), 0 | 1)``."""

    split: int  # 0 train, 1 test
    max_examples: int
    num_classes: int
    shift_scale: float  # norm * style
    noise_scale: float  # norm * noise / std of a byte

    def __call__(self, shared, key, client_id):
        del client_id
        factor = SIDE // LOW_RES
        low = jax.random.normal(jax.random.fold_in(key, 0), (LOW_RES, LOW_RES), jnp.float32)
        shift = jnp.float32(self.shift_scale) * jnp.repeat(jnp.repeat(low, factor, 0), factor, 1)
        contrast = jax.random.uniform(jax.random.fold_in(key, 1), (), jnp.float32, 0.5, 1.5)
        key = jax.random.fold_in(key, 2 + self.split)
        m = self.max_examples
        labels = jax.random.randint(jax.random.fold_in(key, 0), (m,), 0, self.num_classes,
                                    jnp.int32)
        noise = generated.stream_bytes(jax.random.fold_in(key, 1), (m, SIDE * SIDE))
        x = (noise.reshape(m, SIDE, SIDE).astype(jnp.float32) - jnp.float32(127.5))
        x = x * jnp.float32(self.noise_scale)
        x = x + shared["templates"][labels] * contrast
        x = x + shift[None]
        return {"x": x[..., None], "y": labels}


def _procedural(info: dict, norm: float) -> Dataset:
    n, c = info["num_clients"], info["num_classes"]
    root = jax.random.key(info["seed"])
    clients = jax.random.fold_in(root, 0)
    factor = SIDE // LOW_RES
    low = jax.random.normal(jax.random.fold_in(root, 1), (c, LOW_RES, LOW_RES), jnp.float32)
    templates = np.float32(norm) * np.repeat(np.repeat(np.asarray(low), factor, 1), factor, 2)
    lo, hi = info["min_examples"], info["max_examples"]
    sizes = generated.client_draws(clients, n, lambda k: jax.random.randint(
        jax.random.fold_in(k, 4), (), lo, hi + 1, jnp.int32)).astype(np.int32)
    spec = (("x", (SIDE, SIDE, 1), "float32"), ("y", (), "int32"))
    key_data = np.asarray(jax.random.key_data(clients))

    def split(index: int, num_examples: np.ndarray):
        m = int(num_examples.max())
        rows = _WriterRows(index, m, c, float(norm * info["style"]),
                           float(norm * info["noise"] / _BYTE_STD))
        return generated.GeneratedClients(num_examples, {"templates": templates}, key_data,
                                          rows, m, spec)

    train = split(0, sizes)
    test = split(1, np.full(n, info["test_examples"], np.int32))
    return generated.dataset("femnist_like", train, test, c, (SIDE, SIDE, 1),
                             {**info, "procedural": True})
