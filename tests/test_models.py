"""Model tests: shapes, parameter counts by hand, the CNN's two convolution forms,
and vmap over a client axis of parameters (models/base.py, models/simple.py).

Shapes come from ``jax.eval_shape`` and every numerical check runs as one jitted
function, because compiling op by op dominates the run time of small models.

``test_cnn_under_strict_rank_promotion`` runs the CNN under the suite's
``jax_numpy_rank_promotion="raise"``; the other CNN checks run inside
``jax.numpy_rank_promotion("allow")`` so that they test the convolution
arithmetic on their own.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from fedjax_fair.models import MODELS, cnn, cross_entropy, get_model, logistic_regression, mlp
from fedjax_fair.models.simple import Conv

allow_rank_promotion = jax.numpy_rank_promotion("allow")


def _count(model) -> int:
    """Parameter count without materialising the parameters."""
    with allow_rank_promotion:  # counting is not the point of the strict-mode test
        shapes = jax.eval_shape(model.init, jax.random.key(0))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def _batch(input_shape, num_classes, size=5, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": jnp.asarray(rng.normal(size=(size, *input_shape)), jnp.float32),
            "y": jnp.asarray(rng.integers(0, num_classes, size), jnp.int32)}


def _shapes(model, batch):
    """(params, logits, per-example loss, metrics) as ShapeDtypeStructs."""
    def f(key, batch):
        params = model.init(key)
        return (params, model.apply(params, batch["x"]), model.per_example_loss(params, batch),
                model.per_example_metrics(params, batch))
    return jax.eval_shape(f, jax.random.key(0), batch)


# --------------------------------------------------------------------------------------
# Shapes and parameter counts.


@pytest.mark.parametrize("input_shape,num_classes", [((10,), 3), ((4, 4, 1), 5)])
def test_logistic_regression_shapes_and_count(input_shape, num_classes):
    model = logistic_regression(input_shape, num_classes)
    params, logits, loss, metrics = _shapes(model, _batch(input_shape, num_classes))
    d = math.prod(input_shape)
    assert params["params"]["Dense_0"]["kernel"].shape == (d, num_classes)
    assert params["params"]["Dense_0"]["bias"].shape == (num_classes,)
    assert _count(model) == d * num_classes + num_classes
    assert logits.shape == (5, num_classes) and logits.dtype == jnp.float32
    assert loss.shape == (5,)
    assert set(metrics) == {"loss", "accuracy", "confidence"}
    assert metrics["loss"].shape == metrics["accuracy"].shape == metrics["confidence"].shape
    assert metrics["confidence"].shape == (5,)
    assert (model.name, model.input_shape, model.num_classes) == ("logreg", input_shape,
                                                                  num_classes)
    assert not model.uses_xla_conv


def test_example_flops_counts_the_forward_products():
    """XLA's count for one example: 2 FLOPs per multiply-add of the dense layers, plus
    the bias, activation and loss terms (a little more, never less)."""
    from fedjax_fair.models import mlp
    from fedjax_fair.models.base import example_flops
    one = {"x": jax.ShapeDtypeStruct((28, 28, 1), jnp.float32),
           "y": jax.ShapeDtypeStruct((), jnp.int32)}
    macs = 784 * 200 + 200 * 200 + 200 * 62
    flops = example_flops(mlp((28, 28, 1), 62), one)
    assert 2 * macs <= flops <= 1.05 * 2 * macs
    assert example_flops(logistic_regression((28, 28, 1), 62), one) < flops / 4


def test_example_flops_where_lowered_programs_report_no_cost(monkeypatch):
    """The GPU and TPU plugins have no cost analysis before compiling
    (``Lowered.cost_analysis`` is None): the count then comes from the compiled loss,
    about the same FLOPs (the optimised program may fold a few), not 0, which would
    class every convolutional network as light in ``execution.choose``."""
    from fedjax_fair.models import mlp
    from fedjax_fair.models.base import example_flops
    one = {"x": jax.ShapeDtypeStruct((28, 28, 1), jnp.float32),
           "y": jax.ShapeDtypeStruct((), jnp.int32)}
    model = mlp((28, 28, 1), 62)
    lowered_count = example_flops(model, one)
    monkeypatch.setattr(jax.stages.Lowered, "cost_analysis", lambda self: None)
    compiled_count = example_flops(model, one)
    assert 0.9 * lowered_count <= compiled_count <= 1.1 * lowered_count


def test_example_flops_without_a_cpu_backend(monkeypatch):
    """With no CPU backend in the process the loss is lowered for the default one."""
    from fedjax_fair.models import mlp
    from fedjax_fair.models.base import example_flops
    one = {"x": jax.ShapeDtypeStruct((28, 28, 1), jnp.float32),
           "y": jax.ShapeDtypeStruct((), jnp.int32)}
    model = mlp((28, 28, 1), 62)
    count = example_flops(model, one)
    devices = jax.devices

    def no_cpu(backend=None):
        if backend == "cpu":
            raise RuntimeError("Unknown backend cpu")
        return devices(backend)

    monkeypatch.setattr(jax, "devices", no_cpu)
    assert example_flops(model, one) == count


def test_logistic_regression_matches_numpy():
    model = logistic_regression((10,), 3)
    batch = _batch((10,), 3, size=7)
    params = helpers.init_params(model, 1)
    assert model.num_params(params) == 33

    @jax.jit
    def run(params, batch):
        return (model.apply(params, batch["x"]), model.per_example_loss(params, batch),
                model.per_example_metrics(params, batch))

    logits, loss, metrics = run(params, batch)
    p = params["params"]["Dense_0"]
    x = np.asarray(batch["x"], np.float64)
    expected = x @ np.asarray(p["kernel"], np.float64) + np.asarray(p["bias"], np.float64)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-6)
    shifted = expected - expected.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    ce = -log_probs[np.arange(7), np.asarray(batch["y"])]
    np.testing.assert_allclose(loss, ce, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["loss"], ce, rtol=1e-5, atol=1e-6)
    acc = (np.argmax(expected, -1) == np.asarray(batch["y"])).astype(np.float32)
    np.testing.assert_array_equal(metrics["accuracy"], acc)
    np.testing.assert_allclose(cross_entropy(logits, batch["y"]), ce, rtol=1e-5, atol=1e-6)


def test_mlp_shapes_and_count():
    model = mlp((10,), 3, hidden=(8, 5))
    params, logits, _, _ = _shapes(model, _batch((10,), 3))
    assert _count(model) == (10 * 8 + 8) + (8 * 5 + 5) + (5 * 3 + 3)
    assert [params["params"][f"Dense_{i}"]["kernel"].shape for i in range(3)] == [
        (10, 8), (8, 5), (5, 3)]
    assert logits.shape == (5, 3)
    # Image inputs are flattened.
    image = mlp((4, 4, 1), 3, hidden=(6,))
    assert _count(image) == (16 * 6 + 6) + (6 * 3 + 3)
    assert _shapes(image, _batch((4, 4, 1), 3))[1].shape == (5, 3)
    # The FEMNIST-shaped default MLP 784-200-200-62 of docs/performance.md (d ~ 210k).
    assert _count(mlp((28, 28, 1), 62)) == (784 * 200 + 200) + (200 * 200 + 200) + (200 * 62 + 62)


def test_cnn_shapes_and_count():
    model = cnn((8, 8, 1), 4, channels=(2, 3), dense=8)
    conv1 = 5 * 5 * 1 * 2 + 2
    conv2 = 5 * 5 * 2 * 3 + 3
    flat = (8 // 4) * (8 // 4) * 3  # two 2x2 max-pools
    assert _count(model) == conv1 + conv2 + (flat * 8 + 8) + (8 * 4 + 4)
    with allow_rank_promotion:
        _, logits, loss, _ = _shapes(model, _batch((8, 8, 1), 4))
    assert logits.shape == (5, 4) and loss.shape == (5,)
    # The LEAF FEMNIST CNN shape.
    assert _count(cnn((28, 28, 1), 62)) == (
        (25 * 32 + 32) + (25 * 32 * 64 + 64) + (7 * 7 * 64 * 512 + 512) + (512 * 62 + 62))


@pytest.mark.parametrize("conv_impl", ["xla", "patches"])
def test_cnn_under_strict_rank_promotion(conv_impl):
    """The suite runs with jax_numpy_rank_promotion="raise" (tests/conftest.py): the
    built-in CNN must trace under it, like the MLP does."""
    model = cnn((8, 8, 1), 4, channels=(2,), dense=8, conv_impl=conv_impl)
    _, logits, _, _ = _shapes(model, _batch((8, 8, 1), 4))
    assert logits.shape == (5, 4)


def test_cnn_conv_impl_choice():
    auto = cnn((8, 8, 1), 3, channels=(2,), dense=4)
    assert auto.uses_xla_conv == (jax.default_backend() != "cpu")
    assert cnn((8, 8, 1), 3, conv_impl="xla").uses_xla_conv
    assert not cnn((8, 8, 1), 3, conv_impl="patches").uses_xla_conv
    bad = Conv(2, (3, 3), impl="fft")
    with pytest.raises(ValueError, match="impl"):
        jax.eval_shape(bad.init, jax.random.key(0), jnp.zeros((1, 4, 4, 1)))


def test_get_model():
    assert get_model("logreg", [10], 3).name == "logreg"
    assert get_model("mlp", (10,), 3, hidden=(4,)).name == "mlp"
    assert get_model("cnn", (8, 8, 1), 3, channels=(2,), dense=4).name == "cnn"
    assert set(MODELS) >= {"logreg", "mlp", "cnn"}
    with pytest.raises(ValueError, match="allowed"):
        get_model("resnet", (10,), 3)


# --------------------------------------------------------------------------------------
# Patches + matmul convolution == XLA convolution.


@pytest.mark.parametrize("kernel_size,cin", [((5, 5), 1), ((4, 3), 2)])
def test_conv_patches_equals_xla(kernel_size, cin):
    """Same parameters, random input: outputs and gradients (w.r.t. kernel, bias and
    input) agree, including even kernels where 'SAME' pads one more row at the end."""
    xla, patches = Conv(4, kernel_size, "xla"), Conv(4, kernel_size, "patches")
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 7, 6, cin)), jnp.float32)
    with allow_rank_promotion:
        shapes = jax.eval_shape(xla.init, jax.random.key(0), x)
        assert jax.tree.structure(shapes) == jax.tree.structure(
            jax.eval_shape(patches.init, jax.random.key(0), x))
    params = helpers.random_like(shapes, seed=2)

    def loss(module):
        return lambda p, x: jnp.sum(jnp.sin(module.apply(p, x)))

    @jax.jit
    def run(params, x):
        return (xla.apply(params, x), patches.apply(params, x),
                jax.grad(loss(xla), argnums=(0, 1))(params, x),
                jax.grad(loss(patches), argnums=(0, 1))(params, x))

    with allow_rank_promotion:
        y_xla, y_patches, g_xla, g_patches = run(params, x)
    assert y_xla.shape == (2, 7, 6, 4)
    np.testing.assert_allclose(y_patches, y_xla, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g_patches), jax.tree.leaves(g_xla)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_conv_matches_numpy_same_convolution():
    conv = Conv(2, (3, 3), "patches")
    x = np.random.default_rng(0).normal(size=(1, 4, 5, 2)).astype(np.float32)
    with allow_rank_promotion:
        params = helpers.random_like(jax.eval_shape(conv.init, jax.random.key(0), x), seed=3)
        y = jax.jit(conv.apply)(params, x)
    k = np.asarray(params["params"]["kernel"], np.float64)
    b = np.asarray(params["params"]["bias"], np.float64)
    xp = np.pad(x.astype(np.float64), ((0, 0), (1, 1), (1, 1), (0, 0)))
    expected = np.zeros((1, 4, 5, 2))
    for i in range(4):
        for j in range(5):
            expected[0, i, j] = np.einsum("hwc,hwco->o", xp[0, i:i + 3, j:j + 3], k) + b
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_cnn_patches_equals_xla_with_gradients():
    xla = cnn((8, 8, 1), 4, channels=(2, 3), dense=8, conv_impl="xla")
    patches = cnn((8, 8, 1), 4, channels=(2, 3), dense=8, conv_impl="patches")
    batch = _batch((8, 8, 1), 4, size=6, seed=3)
    with allow_rank_promotion:
        params = helpers.init_params(xla, 4)

    def value_and_grad(model, params):
        return jax.value_and_grad(lambda p: jnp.mean(model.per_example_loss(p, batch)))(params)

    @jax.jit
    def run(params):
        return (xla.apply(params, batch["x"]), patches.apply(params, batch["x"]),
                value_and_grad(xla, params), value_and_grad(patches, params))

    with allow_rank_promotion:
        y_xla, y_patches, (l_xla, g_xla), (l_patches, g_patches) = run(params)
    np.testing.assert_allclose(y_patches, y_xla, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(l_patches, l_xla, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_patches), jax.tree.leaves(g_xla)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------
# vmap over a client axis of parameters.


@pytest.mark.parametrize("name", ["logreg", "mlp", "cnn"])
def test_models_vmap_over_client_params(name):
    """Per-client parameters stacked on a leading axis: vmapped apply and grad equal
    the same computation one client at a time."""
    shape = (8, 8, 1) if name == "cnn" else (10,)
    kwargs = {"mlp": dict(hidden=(6,)), "cnn": dict(channels=(2,), dense=4)}.get(name, {})
    model = get_model(name, shape, 3, **kwargs)
    clients = 3
    with allow_rank_promotion:
        # init itself vmaps over keys (shapes only: compiling flax init is slow).
        stacked_shapes = jax.eval_shape(jax.vmap(model.init),
                                        jax.random.split(jax.random.key(0), clients))
        one = [helpers.init_params(model, seed) for seed in range(clients)]
    stacked = jax.tree.map(lambda *p: jnp.stack(p), *one)
    assert jax.tree.map(lambda s: s.shape, stacked_shapes) == jax.tree.map(
        lambda s: s.shape, stacked)
    batches = [_batch(shape, 3, size=4, seed=s) for s in range(clients)]
    xs = jax.tree.map(lambda *b: jnp.stack(b), *batches)

    def loss(p, batch):
        return jnp.mean(model.per_example_loss(p, batch))

    def both(p, batch):
        return model.apply(p, batch["x"]), jax.grad(loss)(p, batch)

    with allow_rank_promotion:
        logits, grads = jax.jit(jax.vmap(both))(stacked, xs)
        single = jax.jit(both)
        each = [single(p, b) for p, b in zip(one, batches)]
    assert logits.shape == (clients, 4, 3)
    for k, (logits_k, grads_k) in enumerate(each):
        np.testing.assert_allclose(logits[k], logits_k, rtol=1e-5, atol=1e-5)
        for a, b in zip(jax.tree.leaves(jax.tree.map(lambda v: v[k], grads)),
                        jax.tree.leaves(grads_k)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_with_initializer_draws_kernels_and_zeroes_biases():
    from fedjax_fair.models import INITIALIZERS, with_initializer
    base = logistic_regression((60,), 10)
    model = with_initializer(base, "glorot_uniform")
    params = model.init(jax.random.key(0))
    (w,), (b,) = ([v for p, v in jax.tree_util.tree_flatten_with_path(params)[0]
                   if p[-1].key == name] for name in ("kernel", "bias"))
    limit = np.sqrt(6.0 / (60 + 10))  # Glorot-uniform: U(-sqrt(6 / (fan_in + fan_out)), .)
    assert w.shape == (60, 10) and np.abs(w).max() <= limit
    assert np.abs(w).max() > 0.9 * limit and abs(float(w.mean())) < 0.05
    np.testing.assert_allclose(np.var(w), limit ** 2 / 3, rtol=0.15)
    assert not np.any(b)
    assert with_initializer(base, "default") is base
    zeros = with_initializer(base, "zeros").init(jax.random.key(1))
    assert not any(np.any(v) for v in jax.tree.leaves(zeros))
    with pytest.raises(ValueError, match="initializer"):
        with_initializer(base, "orthogonal-ish")
    assert set(INITIALIZERS) >= {"glorot_uniform", "lecun_normal", "he_normal"}


@pytest.mark.slow
def test_with_initializer_keeps_norm_scales_and_conv_fans():
    from fedjax_fair.models import with_initializer
    model = with_initializer(get_model("cnn", (8, 8, 1), 4, channels=(4, 8), dense=16),
                             "he_normal")
    params = model.init(jax.random.key(0))
    flat = {"/".join(str(getattr(k, "key", k)) for k in p): v
            for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    kernels = [v for k, v in flat.items() if k.endswith("kernel")]
    assert kernels and all(np.std(v) > 0 for v in kernels)
    assert all(not np.any(v) for k, v in flat.items() if k.endswith("bias"))
    batch = {"x": np.zeros((2, 8, 8, 1), np.float32), "y": np.zeros(2, np.int32)}
    assert np.isfinite(np.asarray(model.per_example_loss(params, batch))).all()
