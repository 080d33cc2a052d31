"""Tests of the papers' networks (models/zoo.py, models/text.py).

* Parameter counts at the specs' input shapes, computed by hand in each case, from
  ``jax.eval_shape`` (nothing is compiled), and the logits shape [B, C] there.
* ``PaddedConv``: patches + matmul == XLA convolution == a NumPy loop, for VALID,
  SAME, symmetric and asymmetric padding, with and without bias.
* Every conv model: the "xla" and "patches" forms give the same logits for the same
  parameters (small inputs and widths, so the compiles stay short).
* vmap over a leading client axis of parameters == one client at a time, with finite,
  non-zero gradients.
* ``char_lstm`` == a NumPy float64 LSTM recurrence on the same parameters.
* Deterministic init, argument checks, ``from_flax(input_dtype=...)``.

Numerical checks on the full-size models at the papers' shapes are ``slow``.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from fedjax_fair.models import base, text, zoo
from fedjax_fair.models.simple import _im2col
from fedjax_fair.models.zoo import PaddedConv, explicit_padding, padded_patches


def _count(model) -> int:
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def _batch(model, size=2, seed=0):
    """Random inputs of the model's input shape (token ids for the LSTM) and labels."""
    rng = np.random.default_rng(seed)
    if model.name == "char_lstm":
        x = jnp.asarray(rng.integers(0, model.num_classes, (size, *model.input_shape)), jnp.int32)
    else:
        x = jnp.asarray(rng.normal(size=(size, *model.input_shape)), jnp.float32)
    return {"x": x, "y": jnp.asarray(rng.integers(0, model.num_classes, size), jnp.int32)}


def _leaf_paths(shapes):
    return {"/".join(str(getattr(k, "key", k)) for k in path): leaf.shape
            for path, leaf in jax.tree_util.tree_leaves_with_path(shapes)}


# --------------------------------------------------------------------------------------
# Parameter counts by hand at the specs' shapes.

FEMNIST_CNN = ((5 * 5 * 1 * 32 + 32)            # conv1 5x5, 1 -> 32, bias
               + (5 * 5 * 32 * 64 + 64)         # conv2 5x5, 32 -> 64, bias
               + (7 * 7 * 64 * 2048 + 2048)     # 28 -> 14 -> 7 (SAME convs, 2 pools)
               + (2048 * 62 + 62))              # = 6,603,710
LENET_TRUNK = ((5 * 5 * 3 * 64 + 64) + (5 * 5 * 64 * 64 + 64)   # 32 -> 28 -> 14 -> 10 -> 5
               + (64 * 5 * 5 * 384 + 384) + (384 * 192 + 192))  # + the 192 -> C layer
MLP2 = (3072 * 200 + 200) + (200 * 200 + 200) + (200 * 10 + 10)
CNN_CH = ((3 * 3 * 1 * 32 + 32) + (3 * 3 * 32 * 64 + 64)   # 28 -> 26 -> 13 -> 11 -> 5
          + (64 * 5 * 5 * 10 + 10))
TWONN = 784 * 200 + 200 * 200 + 200 * 200 + 200 * 10       # no biases
TWOCNN = (5 * 5 * 3 * 32 + 5 * 5 * 32 * 64                 # 28 -pad1-> 26 -pool pad1-> 14
          + 64 * 7 * 7 * 200 + 200 * 200 + 200 * 10)       # -> 12 -> 7; no biases
VGG9 = (9 * (1 * 16 + 16 * 32 + 32 * 64 + 64 * 128 + 128 * 256 + 256 * 512)  # 3x3 convs
        + 512 * 1 * 1 * 256 + 256 * 62)                    # 28 -> 14 -> 7 -> 3 -> 1
LSTM_LEAF = (80 * 8                         # embedding V x 8
             + 4 * 256 * (8 + 256 + 1)      # layer 1: W_in, W_rec, b for 4 gates
             + 4 * 256 * (256 + 256 + 1)    # layer 2
             + 256 * 80 + 80)               # output dense


@pytest.mark.parametrize("name,input_shape,num_classes,kwargs,expected", [
    ("femnist_cnn", (28, 28, 1), 62, {}, FEMNIST_CNN),
    ("lenet_fedpd", (32, 32, 3), 10, {}, LENET_TRUNK + 192 * 10 + 10),
    ("lenet_fedpd", (32, 32, 3), 100, {}, LENET_TRUNK + 192 * 100 + 100),
    ("mlp2", (32, 32, 3), 10, {}, MLP2),
    ("cnn_ch", (28, 28, 1), 10, {}, CNN_CH),
    ("cnn_ch", (28, 28, 1), 10, {"hidden": 1600},
     CNN_CH - (1600 * 10 + 10) + (1600 * 1600 + 1600) + (1600 * 10 + 10)),
    ("twonn", (28, 28, 1), 10, {}, TWONN),
    ("twocnn", (28, 28, 3), 10, {}, TWOCNN),
    ("twocnn", (28, 28, 1), 10, {}, TWOCNN - 5 * 5 * 2 * 32),
    ("vgg9", (28, 28, 1), 62, {}, VGG9),
    ("char_lstm", (80,), 80, {}, LSTM_LEAF),
    ("char_lstm", (80,), 80, {"use_bias": False}, LSTM_LEAF - 4 * 256 * 2 - 80),
])
def test_parameter_counts_and_output_shapes(name, input_shape, num_classes, kwargs, expected):
    builders = {**zoo.MODELS, **text.MODELS}
    model = builders[name](input_shape, num_classes, **kwargs)
    assert (model.name, model.input_shape, model.num_classes) == (name, input_shape, num_classes)
    assert _count(model) == expected
    batch = _batch(model, size=3)
    logits, loss = jax.eval_shape(
        lambda k, b: (lambda p: (model.apply(p, b["x"]), model.per_example_loss(p, b)))(
            model.init(k)), jax.random.key(0), batch)
    assert logits.shape == (3, num_classes) and logits.dtype == jnp.float32
    assert loss.shape == (3,)


def test_spec_numbers_and_layer_shapes():
    """The counts the specs state, and the flatten widths they spell out."""
    assert FEMNIST_CNN == 6_603_710
    assert LENET_TRUNK + 192 * 10 + 10 == 797_962  # A-FedPD (arXiv:2409.18915) §5
    assert LENET_TRUNK + 192 * 100 + 100 == 815_332
    assert CNN_CH == 34_826
    assert MLP2 == 656_810 and TWONN == 238_800 and TWOCNN == 722_800
    assert VGG9 == 1_718_416  # superfed.md: "VGG9 (1.7M params)"
    assert LSTM_LEAF == 817_872

    def paths(model):
        return _leaf_paths(jax.eval_shape(model.init, jax.random.key(0)))

    assert paths(zoo.lenet_fedpd((32, 32, 3), 10))["params/Dense_0/kernel"] == (1600, 384)
    assert paths(zoo.cnn_ch((28, 28, 1), 10))["params/Dense_0/kernel"] == (1600, 10)
    twocnn = paths(zoo.twocnn((28, 28, 3), 10))
    assert twocnn["params/Dense_0/kernel"] == (64 * 7 * 7, 200)
    vgg = paths(zoo.vgg9((28, 28, 1), 62))
    assert vgg["params/Dense_0/kernel"] == (512, 256)
    # SuPerFed's networks have no biases at all; LEAF's LSTM has one per layer.
    for model in (zoo.twonn((28, 28, 1), 10), zoo.twocnn((28, 28, 3), 10),
                  zoo.vgg9((28, 28, 1), 62), text.char_lstm((80,), 80, use_bias=False)):
        assert not [p for p in paths(model) if p.endswith("bias")], model.name
    leaf = paths(text.char_lstm((80,), 80))
    assert leaf["params/LSTMLayer_0/bias"] == (4 * 256,)
    assert leaf["params/Embed_0/embedding"] == (80, 8)


def test_registry_names_and_conv_impl():
    builders = {**zoo.MODELS, **text.MODELS}
    shapes = {"char_lstm": (80,), "lenet_fedpd": (32, 32, 3), "mlp2": (32, 32, 3)}
    conv = {"femnist_cnn", "lenet_fedpd", "cnn_ch", "twocnn", "vgg9"}
    on_cpu = jax.default_backend() == "cpu"
    for name, builder in builders.items():
        model = builder(shapes.get(name, (28, 28, 1)), 10)
        assert model.name == name
        assert model.uses_xla_conv == (name in conv and not on_cpu)
        if name in conv:
            assert builder((28, 28, 1), 10, conv_impl="xla").uses_xla_conv
            assert not builder((28, 28, 1), 10, conv_impl="patches").uses_xla_conv
            with pytest.raises(ValueError, match="^conv_impl:"):
                builder((28, 28, 1), 10, conv_impl="fft")
    assert not set(zoo.MODELS) & set(text.MODELS)


# --------------------------------------------------------------------------------------
# PaddedConv: patches == XLA == NumPy.


def test_explicit_padding():
    assert explicit_padding("SAME", (5, 5)) == ((2, 2), (2, 2))
    assert explicit_padding("same", (4, 3)) == ((1, 2), (1, 1))
    assert explicit_padding("VALID", (3, 3)) == ((0, 0), (0, 0))
    assert explicit_padding(1, (5, 5)) == ((1, 1), (1, 1))
    assert explicit_padding(((0, 2), (1, 0)), (3, 3)) == ((0, 2), (1, 0))
    for bad in ("FULL", -1, ((1, 2),), True, ((0, -1), (0, 0))):
        with pytest.raises(ValueError, match="^padding:"):
            explicit_padding(bad, (3, 3))


def test_padded_patches_same_is_simple_im2col():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 6, 3)), jnp.float32)
    for k in [(3, 3), (4, 3), (5, 2)]:
        np.testing.assert_array_equal(padded_patches(x, *k, explicit_padding("SAME", k)),
                                      _im2col(x, *k))
    with pytest.raises(ValueError, match="^input_shape:"):
        padded_patches(x, 7, 3, ((0, 0), (0, 0)))


CONV_CASES = [((3, 3), "VALID", True), ((5, 5), 1, False), ((4, 3), "SAME", True),
              ((3, 2), ((0, 2), (1, 0)), False)]


def test_padded_conv_patches_equals_xla_with_gradients():
    """Outputs and gradients w.r.t. kernel, bias and input agree for every padding."""
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 7, 6, 2)), jnp.float32)
    pairs = [(PaddedConv(3, k, p, b, "xla"), PaddedConv(3, k, p, b, "patches"))
             for k, p, b in CONV_CASES]
    params = [helpers.random_like(jax.eval_shape(xla.init, jax.random.key(0), x), seed=i)
              for i, (xla, _) in enumerate(pairs)]

    def loss(module):
        return lambda p, x: jnp.sum(jnp.sin(module.apply(p, x)))

    @jax.jit
    def run(params, x):
        return [(xla.apply(p, x), patches.apply(p, x),
                 jax.grad(loss(xla), argnums=(0, 1))(p, x),
                 jax.grad(loss(patches), argnums=(0, 1))(p, x))
                for (xla, patches), p in zip(pairs, params)]

    for (k, pad, _), (y_xla, y_patches, g_xla, g_patches) in zip(CONV_CASES, run(params, x)):
        (t, b), (l, r) = explicit_padding(pad, k)
        assert y_xla.shape == (2, 7 + t + b - k[0] + 1, 6 + l + r - k[1] + 1, 3)
        np.testing.assert_allclose(y_patches, y_xla, rtol=1e-5, atol=1e-5)
        helpers.assert_trees_close(g_patches, g_xla, rtol=1e-5, atol=1e-5)


def test_padded_conv_matches_numpy():
    """Asymmetric padding, even kernel, no bias: a direct NumPy correlation."""
    conv = PaddedConv(2, (2, 3), ((1, 0), (2, 1)), use_bias=False, impl="patches")
    x = np.random.default_rng(0).normal(size=(1, 4, 5, 3)).astype(np.float32)
    params = helpers.random_like(jax.eval_shape(conv.init, jax.random.key(0), x), seed=3)
    assert set(params["params"]) == {"kernel"}
    y = jax.jit(conv.apply)(params, x)
    k = np.asarray(params["params"]["kernel"], np.float64)
    xp = np.pad(x.astype(np.float64), ((0, 0), (1, 0), (2, 1), (0, 0)))
    ho, wo = 4 + 1 - 2 + 1, 5 + 3 - 3 + 1
    expected = np.zeros((1, ho, wo, 2))
    for i in range(ho):
        for j in range(wo):
            expected[0, i, j] = np.einsum("hwc,hwco->o", xp[0, i:i + 2, j:j + 3], k)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------
# Whole models: both convolution forms, finiteness, vmap over clients.

# Small versions of the conv networks: the same code paths (paddings, pool padding,
# biases or none) at small inputs and widths. femnist_cnn is simple.cnn, whose two
# forms tests/test_models.py compares; cnn_ch's layers (3x3 VALID with bias) are
# CONV_CASES[0] and it runs under vmap below.
SMALL_CONV = {
    "lenet_fedpd": ((16, 16, 1), 5, dict(channels=(2, 3), hidden=(6, 4))),
    "twocnn": ((8, 8, 2), 5, {}),
    "vgg9": ((16, 16, 1), 5, dict(channels=(2, 2, 3, 3, 4, 4), dense=4)),
}


def test_conv_models_patches_equal_xla():
    """Same parameters, both convolution forms: the same logits (the gradients of each
    padding kind are compared on ``PaddedConv`` above)."""
    models = {name: (zoo.MODELS[name](shape, c, conv_impl="xla", **kw),
                     zoo.MODELS[name](shape, c, conv_impl="patches", **kw))
              for name, (shape, c, kw) in SMALL_CONV.items()}
    params = {name: helpers.init_params(xla, seed=1) for name, (xla, _) in models.items()}
    xs = {name: _batch(xla, size=3, seed=2)["x"] for name, (xla, _) in models.items()}

    @jax.jit
    def run(params, xs):
        return {name: (xla.apply(params[name], xs[name]), patches.apply(params[name], xs[name]))
                for name, (xla, patches) in models.items()}

    for name, (y_xla, y_patches) in run(params, xs).items():
        assert y_xla.shape == (3, 5), name
        assert np.all(np.isfinite(y_patches)) and np.std(y_patches) > 0, name
        np.testing.assert_allclose(y_patches, y_xla, rtol=1e-5, atol=1e-5, err_msg=name)


SMALL_ANY = {
    "cnn_ch": lambda: zoo.cnn_ch((12, 12, 1), 4),
    "twonn": lambda: zoo.twonn((3, 3, 1), 4, hidden=(5, 6)),
    "char_lstm": lambda: text.char_lstm((5,), 6, embed_dim=3, hidden=(4,)),
}


@pytest.mark.parametrize("name", sorted(SMALL_ANY))
def test_vmap_over_client_params(name):
    """Stacked per-client parameters: vmapped logits and gradients equal lax.map over
    the clients (one at a time)."""
    model = SMALL_ANY[name]()
    clients = 3
    stacked = jax.tree.map(lambda *p: jnp.stack(p),
                           *[helpers.init_params(model, seed) for seed in range(clients)])
    batches = jax.tree.map(lambda *b: jnp.stack(b),
                           *[_batch(model, size=4, seed=s) for s in range(clients)])

    def both(args):
        p, batch = args
        loss = lambda p: jnp.mean(model.per_example_loss(p, batch))  # noqa: E731
        return model.apply(p, batch["x"]), jax.grad(loss)(p)

    @jax.jit
    def run(stacked, batches):
        return jax.vmap(lambda p, b: both((p, b)))(stacked, batches), jax.lax.map(
            both, (stacked, batches))

    (logits, grads), (logits_seq, grads_seq) = run(stacked, batches)
    assert logits.shape == (clients, 4, model.num_classes)
    np.testing.assert_allclose(logits, logits_seq, rtol=1e-5, atol=1e-6)
    helpers.assert_trees_close(grads, grads_seq, rtol=1e-4, atol=1e-6)
    assert helpers.tree_all_finite(grads) and helpers.tree_norm(grads) > 0
    # Different clients' parameters give different outputs (the client axis is real).
    assert not np.allclose(logits[0], logits[1])


def test_deterministic_init():
    models = [zoo.twonn((2, 2, 1), 3, hidden=(4,)),
              text.char_lstm((4,), 5, embed_dim=2, hidden=(3,))]
    init = jax.jit(lambda key: [m.init(key) for m in models])
    a, b, c = init(jax.random.key(7)), init(jax.random.key(7)), init(jax.random.key(8))
    helpers.assert_trees_close(a, b, rtol=0, atol=0)
    for pa, pc in zip(a, c):
        assert any(not np.array_equal(u, v) for u, v in zip(jax.tree.leaves(pa),
                                                            jax.tree.leaves(pc)))
        assert helpers.tree_all_finite(pa) and helpers.tree_norm(pa) > 0


# --------------------------------------------------------------------------------------
# char_lstm against a NumPy LSTM.


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def _numpy_char_lstm(params, tokens, forget_bias):
    """Float64 reference: embedding, LSTM layers (gates i, f, g, o), last step, dense."""
    p = jax.tree.map(lambda v: np.asarray(v, np.float64), params["params"])
    x = p["Embed_0"]["embedding"][np.asarray(tokens)]          # [B, T, E]
    layer = 0
    while f"LSTMLayer_{layer}" in p:
        q = p[f"LSTMLayer_{layer}"]
        h_dim = q["recurrent_kernel"].shape[0]
        bias = q.get("bias", np.zeros(4 * h_dim))
        h = np.zeros((x.shape[0], h_dim))
        c = np.zeros_like(h)
        outs = []
        for t in range(x.shape[1]):
            z = x[:, t] @ q["input_kernel"] + h @ q["recurrent_kernel"] + bias
            i, f, g, o = np.split(z, 4, axis=-1)
            c = _sigmoid(f + forget_bias) * c + _sigmoid(i) * np.tanh(g)
            h = _sigmoid(o) * np.tanh(c)
            outs.append(h)
        x = np.stack(outs, axis=1)
        layer += 1
    dense = p["Dense_0"]
    return x[:, -1] @ dense["kernel"] + dense.get("bias", 0.0)


@pytest.mark.parametrize("use_bias,forget_bias", [(True, 1.0), (False, 0.0)])
def test_char_lstm_matches_numpy(use_bias, forget_bias):
    model = text.char_lstm((6,), 7, embed_dim=3, hidden=(4, 5), use_bias=use_bias,
                           forget_bias=forget_bias)
    params = helpers.init_params(model, seed=4)
    batch = _batch(model, size=3, seed=5)
    assert batch["x"].dtype == jnp.int32
    logits, metrics = jax.jit(lambda p, b: (model.apply(p, b["x"]),
                                            model.per_example_metrics(p, b)))(params, batch)
    expected = _numpy_char_lstm(params, batch["x"], forget_bias)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
    assert metrics["loss"].shape == (3,) and np.all(np.isfinite(metrics["loss"]))
    # The last logits depend on the first token (the recurrence carries it).
    changed = batch["x"].at[:, 0].set((batch["x"][:, 0] + 1) % 7)
    assert not np.allclose(jax.jit(model.apply)(params, changed), logits)


def test_from_flax_input_dtype():
    module = text._CharLSTM(5, 5, embed_dim=2, hidden=(3,))
    as_ids = base.from_flax(module, (4,), 5, "ids", input_dtype=jnp.int32)
    assert _count(as_ids) == 5 * 2 + 4 * 3 * (2 + 3 + 1) + 3 * 5 + 5
    as_floats = base.from_flax(module, (4,), 5, "floats")  # float32 by default
    with pytest.raises(ValueError, match="integer"):
        jax.eval_shape(as_floats.init, jax.random.key(0))


def test_argument_checks():
    with pytest.raises(ValueError, match="^channels:"):
        zoo.vgg9((28, 28, 1), 62, channels=(16, 32, 64, 128, 256))
    with pytest.raises(ValueError, match="^dense:"):
        zoo.vgg9((28, 28, 1), 62, dense=0)
    with pytest.raises(ValueError, match="^channels:"):
        zoo.lenet_fedpd((32, 32, 3), 10, channels=(64, -1))
    with pytest.raises(ValueError, match="^hidden:"):
        zoo.cnn_ch((28, 28, 1), 10, hidden=-1)
    with pytest.raises(ValueError, match="^hidden:"):
        zoo.twonn((28, 28, 1), 10, hidden=(200, 0))
    with pytest.raises(ValueError, match="^input_shape:"):
        text.char_lstm((80, 1), 80)
    with pytest.raises(ValueError, match="^hidden:"):
        text.char_lstm((80,), 80, hidden=())
    with pytest.raises(ValueError, match="^embed_dim:"):
        text.char_lstm((80,), 80, embed_dim=0)
    # LeNet's VALID 5x5 convolutions need at least 5x5 maps after the first pool.
    for impl in ("xla", "patches"):
        small = zoo.lenet_fedpd((8, 8, 3), 10, conv_impl=impl)
        with pytest.raises(ValueError, match="^input_shape:"):
            jax.eval_shape(small.init, jax.random.key(0))


# --------------------------------------------------------------------------------------
# Full-size models at the papers' shapes (slow: several seconds of compilation each).


@pytest.mark.slow
@pytest.mark.parametrize("name,input_shape,num_classes", [
    ("femnist_cnn", (28, 28, 1), 62), ("lenet_fedpd", (32, 32, 3), 10),
    ("mlp2", (32, 32, 3), 10), ("cnn_ch", (28, 28, 1), 10), ("twonn", (28, 28, 1), 10),
    ("twocnn", (28, 28, 3), 10), ("vgg9", (28, 28, 1), 62), ("char_lstm", (80,), 80)])
def test_spec_models_finite_loss_and_gradients(name, input_shape, num_classes):
    model = {**zoo.MODELS, **text.MODELS}[name](input_shape, num_classes)
    params = jax.jit(model.init)(jax.random.key(0))
    batch = _batch(model, size=2)
    loss, grads = jax.jit(jax.value_and_grad(
        lambda p, b: jnp.mean(model.per_example_loss(p, b))))(params, batch)
    assert np.isfinite(float(loss)) and helpers.tree_all_finite(grads)
    assert helpers.tree_norm(grads) > 0
