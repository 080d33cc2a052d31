"""Tests of the residual / mobile networks (fedjax_fair/models/resnet.py).

* parameter counts of the full-size networks, by hand (arithmetic in the comments),
  read with ``jax.eval_shape`` so nothing is materialised;
* per network (narrow widths, 2 clients x 2 examples, tiny images): output shape,
  vmap over a leading client axis equal to a Python loop, GroupNorm's per-example
  independence (example 0's logits do not change when example 1 changes), finite loss
  and gradients reaching every parameter (see the note above ``SMALL`` for which
  variants run by default and which are marked slow);
* spectral normalisation against ``np.linalg.svd``;
* initialisation scales and argument validation.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_fair.models import resnet
from fedjax_fair.models.resnet import (MODELS, SpectralDense, mobilenet, resnet9,
                                       resnet10_gn_sn, resnet18_gn, spectral_norm_sigma,
                                       spectral_normalize)

# --------------------------------------------------------------------------------------
# Parameter counts (full size).


def _shapes(model):
    return jax.eval_shape(model.init, jax.random.key(0))


def _count(model) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(_shapes(model)))


def _gn(c):  # GroupNorm scale + shift
    return 2 * c


def _conv(k, cin, cout):  # bias-free k x k convolution
    return k * k * cin * cout


def _basic(cin, cout, stride, shortcut=True):
    """Basic block: two 3x3 convs + 2 GN, plus a 1x1 conv + GN when the shape changes."""
    n = _conv(3, cin, cout) + _conv(3, cout, cout) + 2 * _gn(cout)
    if stride != 1 or cin != cout:
        n += _conv(1, cin, cout) + _gn(cout)
    return n


def _resnet18_trunk():
    widths = (64, 128, 256, 512)
    n, cin = 0, 64
    for i, w in enumerate(widths):
        n += _basic(cin, w, 1 if i == 0 else 2) + _basic(w, w, 1)
        cin = w
    return n


def test_resnet18_gn_param_count_by_hand():
    trunk = _resnet18_trunk()
    # layer1 147,968 + layer2 525,568 + layer3 2,099,712 + layer4 8,393,728
    assert trunk == 147_968 + 525_568 + 2_099_712 + 8_393_728 == 11_166_976
    cifar_stem = _conv(3, 3, 64) + _gn(64)  # 1,728 + 128
    imagenet_stem = _conv(7, 3, 64) + _gn(64)  # 9,408 + 128
    fc = lambda c: 512 * c + c  # noqa: E731
    # CIFAR stem: the well-known 11,173,962 of CIFAR ResNet-18 (GN has BN's affine count).
    assert cifar_stem + trunk + fc(10) == 11_173_962
    assert _count(resnet18_gn((32, 32, 3), 10)) == 11_173_962
    # ImageNet stem: the A-FedPD FL-Simulator's 11,181,642 (C=10) and 11,227,812 (C=100).
    assert _count(resnet18_gn((32, 32, 3), 10, stem="imagenet")) == \
        imagenet_stem + trunk + fc(10) == 11_181_642
    assert _count(resnet18_gn((32, 32, 3), 100, stem="imagenet")) == \
        imagenet_stem + trunk + fc(100) == 11_227_812
    # the input size does not change the count (global average pooling)
    assert _count(resnet18_gn((64, 64, 3), 10)) == 11_173_962


def test_resnet10_gn_sn_param_count_by_hand():
    stem = _conv(3, 3, 64) + _gn(64)
    blocks = (_basic(64, 64, 1) + _basic(64, 128, 2) + _basic(128, 256, 2)
              + _basic(256, 512, 2))
    trunk = stem + blocks + _gn(512)
    assert trunk == 4_899_136  # FedEvg reference code's ResNet-10: "≈4.9M conv"
    # classifier on the flattened (32/8)^2 * 512 = 8,192 features, with bias
    assert _count(resnet10_gn_sn((32, 32, 3), 10)) == trunk + 8_192 * 10 + 10 == 4_981_066
    # 64x64: (64/8)^2 * 512 = 32,768 features (spec: "32768 for 64x64")
    shapes = _shapes(resnet10_gn_sn((64, 64, 3), 200))
    assert shapes["params"]["classifier"]["kernel"].shape == (32_768, 200)
    assert shapes["params"]["classifier"]["bias"].shape == (200,)


def test_resnet9_param_count_by_hand():
    n = (_conv(3, 3, 64) + _gn(64)            # stem 1,856
         + _basic(64, 64, 1)                  # 73,984 (no downsample)
         + _basic(64, 128, 1)                 # 230,144 (1x1 downsample: channels change)
         + _basic(128, 256, 2)                # 919,040
         + _basic(256, 512, 2)                # 3,673,088
         + 512 * 256 + 256 * 100)             # bias-free head 156,672
    assert n == 5_054_784
    assert _count(resnet9((32, 32, 3), 100)) == n
    # the identity skip of the first block has no parameters
    assert _count(resnet9((32, 32, 3), 100, identity_shortcut=True)) == n
    # no biases: every "bias" leaf belongs to a GroupNorm (its shift)
    leaves = jax.tree_util.tree_leaves_with_path(_shapes(resnet9((32, 32, 3), 100)))
    for path, _ in leaves:
        if path[-1].key == "bias":
            assert "GroupNorm" in jax.tree_util.keystr(path) or "down_norm" in \
                jax.tree_util.keystr(path), jax.tree_util.keystr(path)


def test_mobilenet_param_count_by_hand():
    def sep(cin, cout):  # depthwise 3x3 + GN, pointwise 1x1 + GN
        return 9 * cin + _gn(cin) + cin * cout + _gn(cout)

    n = (_conv(3, 3, 32) + _gn(32)                                       # 928
         + sep(32, 64) + sep(64, 128) + sep(128, 256) + sep(256, 512)    # 181,280
         + 512 * 256 + 256 * 200)                                        # 182,272
    assert n == 364_480
    assert _count(mobilenet((64, 64, 3), 200)) == n
    shapes = _shapes(mobilenet((64, 64, 3), 200))["params"]
    assert shapes["Conv_1"]["kernel"].shape == (3, 3, 1, 32)  # depthwise


# --------------------------------------------------------------------------------------
# Forward / backward / vmap / per-example independence.
#
# XLA:CPU compiles these networks slowly (seconds per network and transformation on
# the shared test machine), so the checks use narrow widths and tiny images, take
# their parameters from NumPy (``_random_params``: compiling ``init``'s random-number
# code costs as much as the forward pass) and compile one function per check. The
# default run covers the forward checks of ResNet-18 and ResNet9 and the gradients of
# the spectral-normalised ResNet-10 (the only layer that is not a stock flax layer);
# MobileNet, the other variants and gradient checks are marked slow (the suite must
# stay well inside CI's budget on 2 cores).

NUM_CLIENTS, BATCH, NUM_CLASSES = 2, 2, 5

SMALL = {
    "resnet18_cifar": lambda: resnet18_gn((16, 16, 3), NUM_CLASSES, width=8),
    "resnet18_imagenet": lambda: resnet18_gn((16, 16, 3), NUM_CLASSES, width=8,
                                             stem="imagenet"),
    "resnet10_svd": lambda: resnet10_gn_sn((16, 16, 3), NUM_CLASSES, width=8),
    "resnet10_power": lambda: resnet10_gn_sn((16, 16, 3), NUM_CLASSES, width=8,
                                             sn_method="power"),
    "resnet9": lambda: resnet9((16, 16, 3), NUM_CLASSES, width=8, hidden=16),
    "mobilenet": lambda: mobilenet((36, 36, 3), NUM_CLASSES, width=4, hidden=16),
    "mobilenet_pad": lambda: mobilenet((16, 16, 1), NUM_CLASSES, width=4, hidden=16,
                                       depthwise_padding=1),
}
FAST_FORWARD = ("resnet18_cifar", "resnet9")  # ResNet-10 runs in the gradient check
FAST_GRAD = ("resnet10_svd",)


def _cases(fast):
    return [n if n in fast else pytest.param(n, marks=pytest.mark.slow) for n in sorted(SMALL)]


def _random_params(model, seed):
    """Parameters with init's tree, drawn with NumPy: kernels N(0, 1/fan_in), GN
    scales 1 + N(0, 0.1^2), shifts and biases N(0, 0.1^2)."""
    rng = np.random.default_rng(seed)

    def leaf(path, s):
        name = path[-1].key
        if name == "kernel":
            x = rng.normal(size=s.shape) / math.sqrt(math.prod(s.shape[:-1]))
        elif name == "scale":
            x = 1.0 + 0.1 * rng.normal(size=s.shape)
        else:
            x = 0.1 * rng.normal(size=s.shape)
        return jnp.asarray(x, s.dtype)

    return jax.tree_util.tree_map_with_path(leaf, _shapes(model))


def _client_params(model):
    """A [NUM_CLIENTS, ...] stack of different parameters."""
    per_client = [_random_params(model, k) for k in range(NUM_CLIENTS)]
    return jax.tree.map(lambda *p: jnp.stack(p), *per_client)


def _data(model, seed=0):
    rng = np.random.default_rng(seed)
    xs = jnp.asarray(rng.normal(size=(NUM_CLIENTS, BATCH, *model.input_shape)), jnp.float32)
    ys = jnp.asarray(rng.integers(0, model.num_classes, (NUM_CLIENTS, BATCH)), jnp.int32)
    return xs, ys


@pytest.mark.parametrize("name", _cases(FAST_FORWARD))
def test_forward_vmap_and_independence(name):
    model = SMALL[name]()
    assert model.uses_xla_conv
    params = _client_params(model)
    xs, _ = _data(model)

    client = [jax.tree.map(lambda p, k=k: p[k], params) for k in range(NUM_CLIENTS)]
    # full float32 convolutions on GPUs too (TF32 would differ between the batched and
    # the per-client programs by more than the tolerances below)
    with jax.default_matmul_precision("highest"):
        batched = jax.jit(jax.vmap(model.apply))(params, xs)
        apply = jax.jit(model.apply)  # one compilation, reused for every call below
        looped = jnp.stack([apply(client[k], xs[k]) for k in range(NUM_CLIENTS)])
        # example 1 replaced by something very different; example 0 untouched
        changed = apply(client[0], xs[0].at[1].set(5.0 * xs[1][1] + 3.0))
    assert batched.shape == (NUM_CLIENTS, BATCH, NUM_CLASSES)
    assert np.all(np.isfinite(batched))
    # vmap over a leading client axis equals a Python loop over clients
    np.testing.assert_allclose(batched, looped, rtol=1e-4, atol=1e-5)
    assert not np.allclose(batched[0], batched[1], atol=1e-3)  # different clients
    # GroupNorm: example 0's logits do not depend on example 1 ...
    np.testing.assert_allclose(changed[0], batched[0, 0], rtol=1e-5, atol=1e-6)
    # ... while example 1's do change (so the check can fail)
    assert not np.allclose(changed[1], batched[0, 1], atol=1e-3)


@pytest.mark.parametrize("name", _cases(FAST_GRAD))
def test_loss_and_gradients(name):
    model = SMALL[name]()
    params = _random_params(model, 0)
    xs, ys = _data(model)
    batch = {"x": xs[0], "y": ys[0]}
    loss, grads = jax.jit(jax.value_and_grad(
        lambda p: jnp.mean(model.per_example_loss(p, batch))))(params)
    assert np.isfinite(loss) and loss > 0
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    # finite gradients that reach every parameter leaf
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert np.all(np.isfinite(g)), jax.tree_util.keystr(path)
        assert np.any(g != 0), f"no gradient reaches {jax.tree_util.keystr(path)}"


def test_resnet10_logits_invariant_to_classifier_scale():
    """The classifier uses W / sigma_max(W): scaling W leaves the logits unchanged
    (an unnormalised classifier would scale its W-part by the same factor)."""
    model = resnet10_gn_sn((16, 16, 3), NUM_CLASSES, width=8)
    params = _random_params(model, 3)
    scaled = jax.tree.map(lambda p: p, params)
    scaled["params"]["classifier"]["kernel"] = 7.5 * params["params"]["classifier"]["kernel"]
    zero_bias = jax.tree.map(lambda p: p, params)
    zero_bias["params"]["classifier"]["bias"] = jnp.zeros(NUM_CLASSES)
    x = _data(model)[0][0]

    apply = jax.jit(model.apply)
    plain, scaled_out, no_bias = apply(params, x), apply(scaled, x), apply(zero_bias, x)
    np.testing.assert_allclose(scaled_out, plain, rtol=1e-4, atol=1e-5)
    w_part = plain - no_bias  # features @ W/sigma
    assert np.abs(w_part).max() > 1e-2
    assert not np.allclose(scaled_out - no_bias, 7.5 * w_part, atol=1e-2)


# --------------------------------------------------------------------------------------
# Spectral normalisation.


def _np_sigma(w):
    return np.linalg.svd(np.asarray(w, np.float64), compute_uv=False)[0]


def _matrix_with_spectrum(rows, cols, spectrum, seed):
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.normal(size=(rows, cols)))
    v, _ = np.linalg.qr(rng.normal(size=(cols, cols)))
    return (u * np.asarray(spectrum)[None, :]) @ v.T


def test_spectral_norm_svd_matches_numpy():
    w = jnp.asarray(np.random.default_rng(0).normal(size=(200, 7)), jnp.float32)
    sigma = jax.jit(spectral_norm_sigma)(w)
    np.testing.assert_allclose(sigma, _np_sigma(w), rtol=1e-5)
    normalised = jax.jit(spectral_normalize)(w)
    np.testing.assert_allclose(_np_sigma(normalised), 1.0, rtol=1e-5)
    np.testing.assert_allclose(normalised * sigma, w, rtol=1e-5, atol=1e-6)


def test_spectral_norm_power_matches_numpy():
    w = jnp.asarray(_matrix_with_spectrum(300, 6, [4.0, 2.0, 1.0, 0.5, 0.3, 0.1], 0),
                    jnp.float32)
    f = jax.jit(lambda w: spectral_norm_sigma(w, "power", 20))
    np.testing.assert_allclose(f(w), 4.0, rtol=1e-5)
    np.testing.assert_allclose(_np_sigma(spectral_normalize(w, "power", 20)), 1.0, rtol=1e-5)
    # few iterations under-estimate when the top singular values are close
    close = jnp.asarray(_matrix_with_spectrum(300, 6, [4.0, 3.9, 1, 1, 1, 1], 1), jnp.float32)
    assert float(spectral_norm_sigma(close, "power", 1)) < 4.0 - 1e-3
    # deterministic: the same input gives bit-identical results
    assert float(f(w)) == float(f(w))


@pytest.mark.parametrize("method", ["svd", "power"])
def test_spectral_norm_gradient_is_top_singular_pair(method):
    """d sigma_max / dW = u_1 v_1^T for a simple top singular value."""
    w = _matrix_with_spectrum(40, 5, [3.0, 1.5, 1.0, 0.5, 0.2], 2)
    grad = jax.jit(jax.grad(lambda w: spectral_norm_sigma(w, method, 30)))(
        jnp.asarray(w, jnp.float32))
    u, _, vt = np.linalg.svd(w, full_matrices=False)
    np.testing.assert_allclose(grad, np.outer(u[:, 0], vt[0]), atol=1e-5)


def test_spectral_dense_layer():
    layer = SpectralDense(4)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 9)), jnp.float32)
    params = layer.init(jax.random.key(0), x)
    kernel = np.asarray(params["params"]["kernel"])
    assert kernel.shape == (9, 4) and params["params"]["bias"].shape == (4,)
    params["params"]["bias"] = jnp.arange(4.0)
    expected = np.asarray(x) @ (kernel / _np_sigma(kernel)) + np.arange(4.0)[None, :]
    np.testing.assert_allclose(layer.apply(params, x), expected, rtol=1e-5, atol=1e-5)
    # an all-zero kernel gives zeros, not NaN
    params["params"]["kernel"] = jnp.zeros((9, 4))
    np.testing.assert_array_equal(layer.apply(params, x), np.broadcast_to(np.arange(4.0), (3, 4)))


# --------------------------------------------------------------------------------------
# Initialisation, structure options, argument validation.

nn_init_zeros = jax.nn.initializers.zeros


def _init(model):
    # The non-partitionable threefry compiles several times faster on CPU; the
    # statistics checked here do not depend on the random stream.
    with jax.threefry_partitionable(False):
        return jax.jit(model.init)(jax.random.key(0))["params"]


@pytest.mark.slow
def test_initialisation_resnet18_torchvision():
    p = _init(resnet18_gn((16, 16, 3), 10, width=16))
    k = np.asarray(p["BasicBlock_7"]["Conv_1"]["kernel"])  # 3x3x128x128
    # torchvision: kaiming_normal_(mode="fan_out", relu): std sqrt(2 / (9 * 128))
    np.testing.assert_allclose(k.std(), math.sqrt(2 / (9 * 128)), rtol=0.03)
    dense, bias = np.asarray(p["Dense_0"]["kernel"]), np.asarray(p["Dense_0"]["bias"])
    # PyTorch nn.Linear default: kernel and bias uniform(+-1/sqrt(fan_in)), fan_in 128
    assert dense.shape == (128, 10)
    assert np.abs(dense).max() <= 1 / math.sqrt(128)
    np.testing.assert_allclose(dense.std(), 1 / math.sqrt(3 * 128), rtol=0.2)
    assert 0 < np.abs(bias).max() <= 1 / math.sqrt(128)
    for norm in (p["GroupNorm_0"], p["BasicBlock_2"]["down_norm"]):
        np.testing.assert_array_equal(norm["scale"], 1.0)
        np.testing.assert_array_equal(norm["bias"], 0.0)


def test_initialisation_resnet9_xavier():
    q = _init(resnet9((16, 16, 3), 10, width=16))
    k = np.asarray(q["BasicBlock_3"]["Conv_1"]["kernel"])  # 3x3x128x128, Xavier-normal
    np.testing.assert_allclose(k.std(), math.sqrt(2 / (9 * 128 + 9 * 128)), rtol=0.03)
    np.testing.assert_allclose(np.abs(k).max() > 3 * k.std(), True)  # normal, not truncated
    np.testing.assert_array_equal(q["GroupNorm_0"]["scale"], 1.0)


def test_group_norm_uses_pytorch_epsilon():
    """A constant input channel group normalises to 0 / sqrt(eps); check eps = 1e-5 via
    a variance of exactly eps: (x - mean) / sqrt(var + eps) = 1/sqrt(2) * sign."""
    gn = resnet._group_norm(1)
    x = jnp.asarray(np.tile([-1.0, 1.0], 8).reshape(1, 4, 4, 1) * math.sqrt(1e-5), jnp.float32)
    params = gn.init(jax.random.key(0), x)
    y = np.asarray(gn.apply(params, x))
    np.testing.assert_allclose(np.abs(y), 1 / math.sqrt(2), rtol=1e-3)


def test_pytorch_style_padding():
    """Stride-2 3x3 convolutions pad one pixel on both sides (PyTorch), not Flax's
    "SAME" (after only); max-pool padding never wins the max."""
    x = jnp.arange(16.0).reshape(1, 4, 4, 1)
    conv = resnet._conv(1, 3, 2, 1, nn_init_zeros)
    kernel = jnp.zeros((3, 3, 1, 1)).at[0, 0, 0, 0].set(1.0)  # picks the top-left tap
    y = conv.apply({"params": {"kernel": kernel}}, x)[0, :, :, 0]
    # output (i, j) reads x[2i - 1, 2j - 1] (zero outside); "SAME" would read x[2i, 2j]
    np.testing.assert_array_equal(y, [[0.0, 0.0], [0.0, 5.0]])
    # window rows/cols 2i-1..2i+1; all values negative, so zero padding would give 0s
    pooled = resnet._max_pool_3x3_s2(-1.0 - x)
    np.testing.assert_array_equal(pooled[0, :, :, 0], [[-1.0, -2.0], [-5.0, -6.0]])


@pytest.mark.slow
def test_resnet9_identity_shortcut_changes_function_only():
    a = resnet9((16, 16, 3), NUM_CLASSES, width=8, hidden=16)
    b = resnet9((16, 16, 3), NUM_CLASSES, width=8, hidden=16, identity_shortcut=True)
    params = _random_params(a, 0)
    assert jax.tree.structure(params) == jax.tree.structure(_shapes(b))
    x = _data(a)[0][0]
    out_a, out_b = jax.jit(lambda p: (a.apply(p, x), b.apply(p, x)))(params)
    assert not np.allclose(out_a, out_b, atol=1e-3)


def test_mobilenet_input_size_limit():
    assert resnet.mobilenet_feature_size(64, 0) == 4  # 32 -> 30 -> 14 -> 6 -> 4
    assert resnet.mobilenet_feature_size(33, 0) == 1
    assert resnet.mobilenet_feature_size(32, 0) < 1
    assert _count(mobilenet((33, 33, 3), 10)) == _count(mobilenet((64, 64, 3), 10))
    with pytest.raises(ValueError, match=r"^input_shape: "):
        mobilenet((32, 32, 3), 10)
    assert _count(mobilenet((8, 8, 3), 10, depthwise_padding=1)) > 0


@pytest.mark.parametrize("builder,kwargs,field", [
    (resnet18_gn, {"groups": 3}, "groups"),
    (resnet18_gn, {"groups": 0}, "groups"),
    (resnet18_gn, {"stem": "tiny"}, "stem"),
    (resnet18_gn, {"width": 0}, "width"),
    (resnet10_gn_sn, {"width": 6}, "width"),
    (resnet10_gn_sn, {"sn_method": "exact"}, "sn_method"),
    (resnet10_gn_sn, {"sn_iters": 0}, "sn_iters"),
    (resnet9, {"norm": "batch"}, "norm"),
    (resnet9, {"norm": "layer"}, "norm"),
    (resnet9, {"groups": 128}, "groups"),
    (resnet9, {"hidden": 0}, "hidden"),
    (mobilenet, {"norm": "batch"}, "norm"),
    (mobilenet, {"groups": 3}, "groups"),
    (mobilenet, {"depthwise_padding": 2}, "depthwise_padding"),
])
def test_invalid_arguments(builder, kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        builder((64, 64, 3), 10, **kwargs)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_registry_and_input_shape_validation(name):
    model = MODELS[name]((40, 40, 3), 7)
    assert model.name == name and model.input_shape == (40, 40, 3)
    assert model.num_classes == 7 and model.uses_xla_conv
    with pytest.raises(ValueError, match=r"^input_shape: "):
        MODELS[name]((40, 40), 7)


# --------------------------------------------------------------------------------------
# Cross-check against PyTorch definitions of the same networks (slow; skipped where
# torch is not installed). Full-size networks at their papers' input sizes; parameters
# are copied from the flax tree into the torch modules in forward order and the logits
# compared. torchvision's resnet18 (with GroupNorm as norm_layer) is the reference for
# ResNet-18; the other three are written from the specs' [ref-code] descriptions.


def _flax_order(name, params):
    """Flax module dicts of ``params`` in forward order (flax sorts names)."""
    p = params["params"]

    def block(b):
        order = ["Conv_0", "GroupNorm_0", "Conv_1", "GroupNorm_1"]
        return [b[k] for k in order + [k for k in ("down_conv", "down_norm") if k in b]]

    if name.startswith("resnet18"):
        return ([p["Conv_0"], p["GroupNorm_0"]]
                + [m for i in range(8) for m in block(p[f"BasicBlock_{i}"])] + [p["Dense_0"]])
    if name == "resnet10":
        return ([p["Conv_0"], p["GroupNorm_0"]]
                + [m for i in range(4) for m in block(p[f"BasicBlock_{i}"])]
                + [p["GroupNorm_1"], p["classifier"]])
    if name == "resnet9":
        return ([p["Conv_0"], p["GroupNorm_0"]]
                + [m for i in range(4) for m in block(p[f"BasicBlock_{i}"])]
                + [p["Dense_0"], p["Dense_1"]])
    assert name == "mobilenet"
    return ([m for i in range(9) for m in (p[f"Conv_{i}"], p[f"GroupNorm_{i}"])]
            + [p["Dense_0"], p["Dense_1"]])


def _torch_reference(name, num_classes):
    torch = pytest.importorskip("torch")
    tnn = torch.nn

    class Block(tnn.Module):
        def __init__(self, cin, cout, stride, groups, act, post_act=True, identity=True):
            super().__init__()
            self.conv1 = tnn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.gn1 = tnn.GroupNorm(groups, cout)
            self.conv2 = tnn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.gn2 = tnn.GroupNorm(groups, cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = tnn.Sequential(tnn.Conv2d(cin, cout, 1, stride, bias=False),
                                           tnn.GroupNorm(groups, cout))
            self.act, self.post_act, self.identity = act, post_act, identity

        def forward(self, x):
            y = self.gn2(self.conv2(self.act(self.gn1(self.conv1(x)))))
            if self.down is not None:
                y = y + self.down(x)
            elif self.identity:
                y = y + x
            return self.act(y) if self.post_act else y

    class SNLinear(tnn.Linear):  # exact W / sigma_max(W)
        def forward(self, x):
            w = self.weight / torch.linalg.matrix_norm(self.weight, ord=2)
            return tnn.functional.linear(x, w, self.bias)

    def head(cin):
        return [tnn.AdaptiveAvgPool2d(1), tnn.Flatten(), tnn.Linear(cin, 256, bias=False),
                tnn.ReLU(), tnn.Linear(256, num_classes, bias=False)]

    if name.startswith("resnet18"):
        torchvision = pytest.importorskip("torchvision")
        net = torchvision.models.resnet18(num_classes=num_classes,
                                          norm_layer=lambda c: tnn.GroupNorm(2, c))
        if name == "resnet18_cifar":
            net.conv1 = tnn.Conv2d(3, 64, 3, 1, 1, bias=False)
            net.maxpool = tnn.Identity()
        return net
    if name == "resnet10":
        silu = tnn.SiLU()
        layers = [tnn.Conv2d(3, 64, 3, 1, 1, bias=False), tnn.GroupNorm(16, 64), silu]
        for cin, cout, s in ((64, 64, 1), (64, 128, 2), (128, 256, 2), (256, 512, 2)):
            layers.append(Block(cin, cout, s, cout // 2, silu, post_act=False))
        layers += [tnn.GroupNorm(64, 512), silu, tnn.Flatten(), SNLinear(4 * 4 * 512,
                                                                         num_classes)]
        return tnn.Sequential(*layers)
    if name == "resnet9":
        relu = tnn.ReLU()
        layers = [tnn.Conv2d(3, 64, 3, 2, 1, bias=False), tnn.GroupNorm(2, 64), relu,
                  tnn.MaxPool2d(3, 2, 1)]
        for cin, cout, s in ((64, 64, 1), (64, 128, 1), (128, 256, 2), (256, 512, 2)):
            layers.append(Block(cin, cout, s, 2, relu, identity=False))
        return tnn.Sequential(*layers, *head(512))
    layers = [tnn.Conv2d(3, 32, 3, 2, 1, bias=False), tnn.GroupNorm(2, 32), tnn.ReLU()]
    for cin, cout, s in ((32, 64, 1), (64, 128, 2), (128, 256, 2), (256, 512, 1)):
        layers += [tnn.Conv2d(cin, cin, 3, s, 0, groups=cin, bias=False),
                   tnn.GroupNorm(2, cin), tnn.ReLU(),
                   tnn.Conv2d(cin, cout, 1, bias=False), tnn.GroupNorm(2, cout), tnn.ReLU()]
    return tnn.Sequential(*layers, *head(512))


def _copy_into_torch(flax_modules, net, final_hw=None):
    """Copies flax module dicts into net's Conv2d / GroupNorm / Linear, in order."""
    import torch
    targets = [m for m in net.modules()
               if isinstance(m, (torch.nn.Conv2d, torch.nn.GroupNorm, torch.nn.Linear))]
    assert len(targets) == len(flax_modules)
    with torch.no_grad():
        for src, dst in zip(flax_modules, targets):
            src = {k: np.asarray(v) for k, v in src.items()}
            if isinstance(dst, torch.nn.GroupNorm):
                weight = src["scale"]
            elif isinstance(dst, torch.nn.Conv2d):
                weight = src["kernel"].transpose(3, 2, 0, 1)  # HWIO -> OIHW
            elif final_hw is not None and dst is targets[-1]:
                # flax flattens (h, w, c), torch (c, h, w)
                h, w = final_hw
                k = src["kernel"]
                weight = k.reshape(h, w, -1, k.shape[-1]).transpose(3, 2, 0, 1).reshape(
                    k.shape[-1], -1)
            else:
                weight = src["kernel"].T
            assert tuple(dst.weight.shape) == weight.shape, (dst, weight.shape)
            dst.weight.copy_(torch.from_numpy(np.array(weight)))
            if dst.bias is not None:
                dst.bias.copy_(torch.from_numpy(src["bias"].copy()))
            else:
                assert "bias" not in src


@pytest.mark.slow
@pytest.mark.parametrize("name,model_fn,num_classes,size", [
    ("resnet18_cifar", lambda: resnet18_gn((32, 32, 3), 10), 10, 32),
    ("resnet18_imagenet", lambda: resnet18_gn((32, 32, 3), 100, stem="imagenet"), 100, 32),
    ("resnet10", lambda: resnet10_gn_sn((32, 32, 3), 10), 10, 32),
    ("resnet9", lambda: resnet9((32, 32, 3), 100), 100, 32),
    ("mobilenet", lambda: mobilenet((64, 64, 3), 200), 200, 64),
])
def test_matches_pytorch_reference(name, model_fn, num_classes, size):
    torch = pytest.importorskip("torch")
    model = model_fn()
    net = _torch_reference(name, num_classes).eval()
    params = _random_params(model, 0)
    assert model.num_params(params) == sum(p.numel() for p in net.parameters())
    _copy_into_torch(_flax_order(name, params), net,
                     final_hw=(size // 8, size // 8) if name == "resnet10" else None)
    x = np.random.default_rng(0).normal(size=(3, size, size, 3)).astype(np.float32)
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(jax.jit(model.apply)(params, jnp.asarray(x)))
    with torch.no_grad():
        theirs = net(torch.from_numpy(x.transpose(0, 3, 1, 2).copy())).numpy()
    assert np.abs(theirs).max() > 0.1
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-3 * np.abs(theirs).max())
