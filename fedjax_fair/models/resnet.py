"""Residual and mobile convolutional networks of the reimplemented papers.

Every builder has the signature ``builder(input_shape, num_classes, **kwargs) -> Model``
(``input_shape = (height, width, channels)``, NHWC) and is listed in ``MODELS`` at the
bottom of this module. All of them use flax ``nn.Conv`` (XLA convolutions, strided),
so they are wrapped with ``uses_xla_conv=True``.

* ``resnet18_gn``: ResNet-18 (He et al. 2016, basic blocks [2, 2, 2, 2], widths
  64-128-256-512) with every BatchNorm replaced by GroupNorm, global average pooling
  and a dense classifier. Default: the CIFAR stem (3x3 conv, stride 1, no max-pool)
  and 2 groups (common in FL; DQN-Fed §5 names "ResNet-18-GN" only). The
  A-FedPD simulation (arXiv:2409.18915 §5, its author's FL-Simulator code) keeps torchvision's ImageNet stem (7x7
  stride-2 conv + 3x3 stride-2 max-pool) with 2 groups: ``stem="imagenet"``.
  Initialisation follows torchvision: Kaiming-normal (fan_out) convolutions, GN
  scale 1 / shift 0, PyTorch's default uniform(+-1/sqrt(fan_in)) for the classifier.
* ``resnet10_gn_sn``: the FedEvg energy network (Hahn's thesis Ch. IV §4.1, [ref-code]):
  ResNet-10 (one basic block per stage), GroupNorm with ``width/4`` groups in the stem,
  ``planes/2`` in the blocks and ``width`` groups at the end, Swish (SiLU)
  activations, no activation after the residual sum, flatten (no pooling) and a
  spectral-normalised linear classifier ``W / sigma_max(W)``. Xavier-normal kernels.
* ``resnet9``: SuPerFed's CIFAR-100 "ResNet9" (thesis Ch. II Table 2.2, [ref-code]):
  conv3x3(64, s2) + norm + ReLU, max-pool 3 s2, four basic blocks 64, 128, 256 s2,
  512 s2, global average pooling, 512 -> 256 -> ReLU -> C. No biases, Xavier-normal
  kernels.
* ``mobilenet``: SuPerFed's TinyImageNet MobileNet (thesis Ch. II Table 2.2, [ref-code]):
  conv3x3(32, s2) + norm + ReLU, four depthwise-separable blocks (depthwise 3x3 with
  no padding + norm + ReLU, pointwise 1x1 + norm + ReLU; 32->64 s1, 64->128 s2,
  128->256 s2, 256->512 s1), global average pooling, 512 -> 256 -> ReLU -> C. No
  biases, Xavier-normal kernels.

Deviations and choices (all documented at the builders):

* **No batch statistics anywhere.** The federated engine vmaps local training over
  clients, pads clients to a common size and masks padded rows out of the loss only;
  ``Model.apply`` receives no mask, so a BatchNorm using batch statistics would
  normalise real rows with statistics of the padding (and of other rows of a partial
  last batch). SuPerFed's reference networks use BatchNorm with per-call batch
  statistics (``track_running_stats=False``); here they use GroupNorm (``norm="group"``,
  a deterministic alternative to batch statistics under vmap) and ``norm="batch"`` is
  rejected. With GroupNorm every example is normalised on its own, so a network's
  output on one example never depends on the other examples of the batch (which
  FedEvg's per-sample input gradients need, thesis Ch. IV §3.3). The SuPerFed
  networks default to 2 groups, the FL convention of the other two specs.
* **GroupNorm epsilon 1e-5** (PyTorch's default, used by the A-FedPD and FedEvg
  reference code) instead of Flax's 1e-6, and two-pass variance.
* **Padding as in PyTorch.** Every 3x3 convolution except MobileNet's depthwise ones
  pads 1 pixel on each side (7x7: 3), also at stride 2, where Flax's ``"SAME"`` would
  pad only after; max-pools pad 1 (with -inf).
* **Spectral norm without state.** PyTorch's ``spectral_norm`` carries a power-iteration
  vector ``u`` between forward passes; ``Model`` holds parameters only. By default
  ``sigma_max(W)`` is exact (``jnp.linalg.svd(W, compute_uv=False)[0]``, the choice
  chosen for determinism): deterministic, identical in training and
  evaluation, and its gradient is ``u_1 v_1^T``. ``sn_method="power"`` runs a fixed
  number of power iterations from a fixed start vector inside ``apply``, with the
  singular vectors under ``stop_gradient`` (PyTorch's gradient convention).
* **SuPerFed ResNet9 first block.** In the reference code a basic block only adds its
  input when it has a downsample branch, so the first block (64 -> 64, stride 1) has
  no skip connection at all. ``resnet9`` reproduces that by default;
  ``identity_shortcut=True`` gives it the identity skip of a standard basic block.
* **MobileNet input size.** The reference's unpadded depthwise convolutions need
  inputs of at least 33x33 pixels; ``depthwise_padding=1`` pads them (size-preserving
  at stride 1) so that small test images work.
* **Width knobs.** Every builder takes a ``width`` (the first stage's channel count;
  the others scale with it) so that tests can run narrow versions quickly.
"""
from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair.hparams import FieldError, count
from fedjax_fair.models.base import Model, from_flax

GN_EPSILON = 1e-5  # PyTorch's GroupNorm default

# Kernel initialisers, named after the PyTorch calls they reproduce. PyTorch's and
# jax's fan computations agree for conv kernels (HWIO here, OIHW there), including
# depthwise kernels (fan_in = kh*kw, fan_out = C*kh*kw).
kaiming_normal_fan_out = nn.initializers.variance_scaling(2.0, "fan_out", "normal")
xavier_normal = nn.initializers.variance_scaling(1.0, "fan_avg", "normal")
torch_linear_kernel = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def torch_linear_bias(fan_in: int) -> Callable:
    """PyTorch's default ``nn.Linear`` bias initialiser, uniform(-1/sqrt(fan_in), +)."""
    bound = 1.0 / np.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


# --------------------------------------------------------------------------------------
# Spectral normalisation.


def spectral_norm_sigma(w, method: str = "svd", num_iters: int = 20):
    """Largest singular value ``sigma_max(W)`` of a 2-D weight, statelessly.

    Parameters
    ----------
    w : array [F, L]
        Dense kernel (features x outputs; the transpose of PyTorch's ``weight``, which
        has the same singular values).
    method : {"svd", "power"}
        ``"svd"``: exact, ``jnp.linalg.svd(w, compute_uv=False)[0]``; its derivative
        is ``u_1 v_1^T`` (jax differentiates singular values without forming the
        singular-vector derivatives, so nearly equal singular values are harmless).
        ``"power"``: ``num_iters`` power iterations on ``W^T W`` from a fixed
        pseudo-random unit vector (the same on every call: deterministic, no state),
        then ``sigma = u^T W v`` with ``u, v`` under ``stop_gradient``, as PyTorch's
        ``spectral_norm`` computes it. It underestimates ``sigma_max`` when the top
        two singular values are close and ``num_iters`` is small.
    num_iters : int
        Power iterations (``"power"`` only).

    Returns
    -------
    Scalar ``sigma`` (float32).
    """
    if method == "svd":
        return jnp.linalg.svd(w, compute_uv=False)[0]
    if method != "power":
        raise FieldError("sn_method", f"must be 'svd' or 'power', got {method!r}")
    hi = jax.lax.Precision.HIGHEST
    start = np.random.default_rng(0).normal(size=w.shape[1]).astype(np.float32)
    v = jnp.asarray(start / np.linalg.norm(start))

    w_const = jax.lax.stop_gradient(w)  # the iterations are not differentiated

    def step(_, v):
        v = jnp.matmul(w_const.T, jnp.matmul(w_const, v, precision=hi), precision=hi)
        return v / jnp.maximum(jnp.linalg.norm(v), 1e-12)

    v = jax.lax.fori_loop(0, num_iters, step, v)
    wv = jnp.matmul(w, v, precision=hi)
    u = jax.lax.stop_gradient(wv / jnp.maximum(jnp.linalg.norm(wv), 1e-12))
    return jnp.dot(u, wv, precision=hi)


def spectral_normalize(w, method: str = "svd", num_iters: int = 20):
    """``W / sigma_max(W)`` (spectral norm 1); see ``spectral_norm_sigma``.

    sigma is floored at 1e-12 so that an all-zero kernel gives zeros, not NaN.
    """
    return w / jnp.maximum(spectral_norm_sigma(w, method, num_iters), 1e-12)


class SpectralDense(nn.Module):
    """Dense layer ``y = x (W / sigma_max(W)) + b`` (Miyato et al. 2018).

    Parameters ``kernel`` [F, L] (Xavier-normal) and ``bias`` [L] (zeros) are stored
    unnormalised; the normalisation happens at every call (no power-iteration state).
    """

    features: int
    method: str = "svd"
    num_iters: int = 20

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", xavier_normal, (x.shape[-1], self.features))
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        w = spectral_normalize(kernel, self.method, self.num_iters)
        return x @ w + bias.reshape(1, -1)


# --------------------------------------------------------------------------------------
# Building blocks.


def _conv(features: int, kernel: int, stride: int, pad: int, kernel_init: Callable,
          groups: int = 1, name: str | None = None) -> nn.Conv:
    """Bias-free convolution with PyTorch's symmetric padding ``pad``."""
    return nn.Conv(features, (kernel, kernel), strides=(stride, stride),
                   padding=((pad, pad), (pad, pad)), use_bias=False,
                   feature_group_count=groups, kernel_init=kernel_init, name=name)


def _group_norm(groups: int, name: str | None = None) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=groups, epsilon=GN_EPSILON, use_fast_variance=False,
                        name=name)


def _max_pool_3x3_s2(x):
    """PyTorch ``MaxPool2d(3, stride=2, padding=1)`` (padding never wins the max)."""
    return nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))


class BasicBlock(nn.Module):
    """Two-convolution residual block (He et al. 2016).

    ``y = post_act(norm(conv3x3(act(norm(conv3x3_s(x))))) + shortcut(x))``; the
    shortcut is conv1x1_s + norm when the shape changes (stride != 1 or channels
    differ), otherwise the identity, or nothing when ``identity_shortcut`` is False
    (SuPerFed reference quirk, see the module docstring).
    """

    features: int
    stride: int
    groups: int
    act: Callable = nn.relu
    post_act: bool = True
    identity_shortcut: bool = True
    kernel_init: Callable = kaiming_normal_fan_out

    @nn.compact
    def __call__(self, x):
        y = _conv(self.features, 3, self.stride, 1, self.kernel_init)(x)
        y = self.act(_group_norm(self.groups)(y))
        y = _conv(self.features, 3, 1, 1, self.kernel_init)(y)
        y = _group_norm(self.groups)(y)
        if self.stride != 1 or x.shape[-1] != self.features:
            s = _conv(self.features, 1, self.stride, 0, self.kernel_init, name="down_conv")(x)
            y = y + _group_norm(self.groups, name="down_norm")(s)
        elif self.identity_shortcut:
            y = y + x
        return self.act(y) if self.post_act else y


class _ResNet18GN(nn.Module):
    num_classes: int
    width: int = 64
    groups: int = 2
    stem: str = "cifar"

    @nn.compact
    def __call__(self, x):
        if self.stem == "cifar":
            x = _conv(self.width, 3, 1, 1, kaiming_normal_fan_out)(x)
            x = nn.relu(_group_norm(self.groups)(x))
        else:  # "imagenet", torchvision
            x = _conv(self.width, 7, 2, 3, kaiming_normal_fan_out)(x)
            x = _max_pool_3x3_s2(nn.relu(_group_norm(self.groups)(x)))
        for i, blocks in enumerate((2, 2, 2, 2)):
            for j in range(blocks):
                stride = 2 if (i > 0 and j == 0) else 1
                x = BasicBlock(self.width * 2 ** i, stride, self.groups)(x)
        x = jnp.mean(x, axis=(1, 2))
        fan_in = x.shape[-1]
        return nn.Dense(self.num_classes, kernel_init=torch_linear_kernel,
                        bias_init=torch_linear_bias(fan_in))(x)


class _ResNet10GNSN(nn.Module):
    num_classes: int
    width: int = 64
    sn_method: str = "svd"
    sn_iters: int = 20

    @nn.compact
    def __call__(self, x):
        x = _conv(self.width, 3, 1, 1, xavier_normal)(x)
        x = nn.silu(_group_norm(self.width // 4)(x))
        for i in range(4):
            planes = self.width * 2 ** i
            x = BasicBlock(planes, 1 if i == 0 else 2, planes // 2, act=nn.silu,
                           post_act=False, kernel_init=xavier_normal)(x)
        x = nn.silu(_group_norm(self.width)(x))
        x = x.reshape(x.shape[0], -1)
        return SpectralDense(self.num_classes, self.sn_method, self.sn_iters,
                             name="classifier")(x)


def _head(x, hidden: int, num_classes: int):
    """SuPerFed classifier: GAP -> Dense(hidden) -> ReLU -> Dense(C), no biases."""
    x = jnp.mean(x, axis=(1, 2))
    x = nn.relu(nn.Dense(hidden, use_bias=False, kernel_init=xavier_normal)(x))
    return nn.Dense(num_classes, use_bias=False, kernel_init=xavier_normal)(x)


class _ResNet9(nn.Module):
    num_classes: int
    width: int = 64
    groups: int = 2
    hidden: int = 256
    identity_shortcut: bool = False

    @nn.compact
    def __call__(self, x):
        x = _conv(self.width, 3, 2, 1, xavier_normal)(x)
        x = _max_pool_3x3_s2(nn.relu(_group_norm(self.groups)(x)))
        for mult, stride in ((1, 1), (2, 1), (4, 2), (8, 2)):
            x = BasicBlock(self.width * mult, stride, self.groups,
                           identity_shortcut=self.identity_shortcut,
                           kernel_init=xavier_normal)(x)
        return _head(x, self.hidden, self.num_classes)


class _MobileNet(nn.Module):
    num_classes: int
    width: int = 32
    groups: int = 2
    hidden: int = 256
    depthwise_padding: int = 0

    @nn.compact
    def __call__(self, x):
        x = _conv(self.width, 3, 2, 1, xavier_normal)(x)
        x = nn.relu(_group_norm(self.groups)(x))
        for mult, stride in MOBILENET_BLOCKS:
            cin = x.shape[-1]
            x = _conv(cin, 3, stride, self.depthwise_padding, xavier_normal, groups=cin)(x)
            x = nn.relu(_group_norm(self.groups)(x))
            x = _conv(self.width * mult, 1, 1, 0, xavier_normal)(x)
            x = nn.relu(_group_norm(self.groups)(x))
        return _head(x, self.hidden, self.num_classes)


# (output channels as a multiple of the width, depthwise stride) of MobileNet's blocks.
MOBILENET_BLOCKS = ((2, 1), (4, 2), (8, 2), (16, 1))


# --------------------------------------------------------------------------------------
# Argument checks.


def _check_image_shape(input_shape) -> tuple:
    input_shape = tuple(int(d) for d in input_shape)
    if len(input_shape) != 3 or min(input_shape) < 1:
        raise FieldError("input_shape", f"must be (height, width, channels) with positive "
                                        f"sizes, got {input_shape}")
    return input_shape



def _check_groups(groups, channels: Sequence[int]) -> int:
    groups = count(groups, "groups")
    bad = sorted({c for c in channels if c % groups})
    if bad:
        raise FieldError("groups", f"{groups} GroupNorm groups must divide every channel "
                                   f"count, but not {bad}")
    return groups


def _check_norm(norm: str) -> None:
    if norm == "batch":
        raise FieldError("norm", "'batch' is not supported: Model.apply gets no padding "
                                 "mask, so batch statistics would mix padded rows into real "
                                 "ones; use 'group'")
    if norm != "group":
        raise FieldError("norm", f"must be 'group', got {norm!r}")


def mobilenet_feature_size(size: int, depthwise_padding: int) -> int:
    """Spatial size after MobileNet's stem and blocks (PyTorch conv arithmetic)."""
    size = (size + 2 - 3) // 2 + 1  # stem, 3x3 s2 pad 1
    for _, stride in MOBILENET_BLOCKS:
        size = (size + 2 * depthwise_padding - 3) // stride + 1 if size > 0 else size
    return size


# --------------------------------------------------------------------------------------
# Builders.


def resnet18_gn(input_shape, num_classes, groups: int = 2, stem: str = "cifar",
                width: int = 64) -> Model:
    """ResNet-18 with GroupNorm (DQN-Fed §5; A-FedPD, arXiv:2409.18915, §5).

    Parameters
    ----------
    input_shape : (H, W, C_in)
    num_classes : int
        C, the classifier's outputs.
    groups : int
        GroupNorm groups in every norm layer, downsample norms included. 2 in both
        specs (dqn_fed: recommendation; a_fedpd: the simulation code).
    stem : {"cifar", "imagenet"}
        ``"cifar"``: conv3x3(64, stride 1) + GN + ReLU, no max-pool (dqn_fed
        recommendation, the default). ``"imagenet"``: torchvision's conv7x7(64,
        stride 2, pad 3) + GN + ReLU + max-pool 3 s2 (the A-FedPD simulation).
    width : int
        Channels of the first stage (64); stages use width x (1, 2, 4, 8).

    Parameter count (width 64, 3 input channels): 11,173,962 (CIFAR stem, C = 10);
    11,181,642 (ImageNet stem, C = 10) and 11,227,812 (C = 100), the numbers of
    the A-FedPD author's FL-Simulator ResNet-18.
    """
    input_shape = _check_image_shape(input_shape)
    width = count(width, "width")
    groups = _check_groups(groups, [width * 2 ** i for i in range(4)])
    if stem not in ("cifar", "imagenet"):
        raise FieldError("stem", f"must be 'cifar' or 'imagenet', got {stem!r}")
    module = _ResNet18GN(int(num_classes), width, groups, stem)
    return from_flax(module, input_shape, num_classes, "resnet18_gn", uses_xla_conv=True)


def resnet10_gn_sn(input_shape, num_classes, width: int = 64, sn_method: str = "svd",
                   sn_iters: int = 20) -> Model:
    """FedEvg's ResNet-10: GroupNorm, Swish, spectral-normalised classifier.

    Hahn's thesis Ch. IV §4.1 ([ref-code] ``ResNet10(width=64)``): stem conv3x3(width,
    stride 1, no bias) -> GN(width/4 groups) -> SiLU; four stages of one basic block
    (width x 1 s1, x2 s2, x4 s2, x8 s2) conv3x3_s -> GN(planes/2) -> SiLU -> conv3x3 ->
    GN(planes/2), shortcut identity or conv1x1_s + GN(planes/2), no activation after
    the sum; GN(width groups) -> SiLU -> flatten ((H/8)(W/8)·8·width features, no
    pooling) -> Linear(features -> L, bias) normalised as ``W / sigma_max(W)``.
    Xavier-normal kernels, zero classifier bias (the paper names only kernels), GN
    scale 1 / shift 0, eps 1e-5.

    Parameters
    ----------
    input_shape : (H, W, C_in)
    num_classes : int
        L, the number of classes (energies ``E(x, y) = -f(x)[y]``).
    width : int
        Stem / first-stage channels (64); must be divisible by 4.
    sn_method : {"svd", "power"}
        How ``sigma_max`` is computed, see ``spectral_norm_sigma`` (default: exact).
    sn_iters : int
        Power iterations for ``sn_method="power"``.

    Parameter count (width 64, 32x32x3, L = 10): 4,899,136 in the convolutional
    trunk and 81,930 in the classifier, 4,981,066 in all.
    """
    input_shape = _check_image_shape(input_shape)
    width = count(width, "width")
    if width % 4:
        raise FieldError("width", f"must be divisible by 4 (stem GroupNorm has width/4 "
                                  f"groups), got {width}")
    if sn_method not in ("svd", "power"):
        raise FieldError("sn_method", f"must be 'svd' or 'power', got {sn_method!r}")
    sn_iters = count(sn_iters, "sn_iters")
    module = _ResNet10GNSN(int(num_classes), width, sn_method, sn_iters)
    return from_flax(module, input_shape, num_classes, "resnet10_gn_sn", uses_xla_conv=True)


def resnet9(input_shape, num_classes, norm: str = "group", groups: int = 2,
            width: int = 64, hidden: int = 256, identity_shortcut: bool = False) -> Model:
    """SuPerFed's "ResNet9" (thesis Ch. II Table 2.2, [ref-code], CIFAR-100).

    conv3x3(width, stride 2, pad 1) -> norm -> ReLU -> max-pool 3 s2 pad 1 -> four
    basic blocks (width x 1, x2, x4 s2, x8 s2; conv-norm-ReLU-conv-norm, conv1x1 + norm
    downsample where the shape changes, ReLU after the sum) -> global average pool ->
    Dense(hidden) -> ReLU -> Dense(C). No biases; Xavier-normal kernels.

    Parameters
    ----------
    input_shape : (H, W, C_in)
    num_classes : int
    norm : {"group"}
        The reference's BatchNorm with batch statistics is replaced by GroupNorm (see
        the module docstring; "batch" raises).
    groups : int
        GroupNorm groups (2, as in the other specs; the reference has no groups).
    width : int
        First-stage channels (64).
    hidden : int
        Hidden units of the classifier (256).
    identity_shortcut : bool
        False (reference): the first block, which keeps the shape, has no skip
        connection. True: identity skip, as in a standard basic block.

    Parameter count (width 64, 3 input channels, C = 100): 5,054,784.
    """
    input_shape = _check_image_shape(input_shape)
    _check_norm(norm)
    width = count(width, "width")
    hidden = count(hidden, "hidden")
    groups = _check_groups(groups, [width * m for m in (1, 2, 4, 8)])
    module = _ResNet9(int(num_classes), width, groups, hidden, bool(identity_shortcut))
    return from_flax(module, input_shape, num_classes, "resnet9", uses_xla_conv=True)


def mobilenet(input_shape, num_classes, norm: str = "group", groups: int = 2,
              width: int = 32, hidden: int = 256, depthwise_padding: int = 0) -> Model:
    """SuPerFed's MobileNet (thesis Ch. II Table 2.2, [ref-code], TinyImageNet 64x64).

    conv3x3(width, stride 2, pad 1) -> norm -> ReLU -> four depthwise-separable blocks
    [depthwise conv3x3 (stride s, padding ``depthwise_padding``) -> norm -> ReLU ->
    pointwise conv1x1 -> norm -> ReLU] with channels width -> 2w (s1) -> 4w (s2) ->
    8w (s2) -> 16w (s1) -> global average pool -> Dense(hidden) -> ReLU -> Dense(C).
    No biases; Xavier-normal kernels.

    Parameters
    ----------
    input_shape : (H, W, C_in)
        With the reference's ``depthwise_padding=0``, H and W must be >= 33 (64x64
        gives 4x4 final maps).
    num_classes : int
    norm : {"group"}
        GroupNorm instead of the reference's batch-statistics BatchNorm ("batch"
        raises).
    groups : int
        GroupNorm groups (2).
    width : int
        Stem channels (32); the blocks output 2, 4, 8 and 16 times it.
    hidden : int
        Hidden units of the classifier (256).
    depthwise_padding : {0, 1}
        0: unpadded depthwise convolutions (reference). 1: pad 1 pixel per side.

    Parameter count (width 32, 3 input channels, C = 200): 364,480.
    """
    input_shape = _check_image_shape(input_shape)
    _check_norm(norm)
    width = count(width, "width")
    hidden = count(hidden, "hidden")
    groups = _check_groups(groups, [width] + [width * m for m, _ in MOBILENET_BLOCKS])
    if depthwise_padding not in (0, 1):
        raise FieldError("depthwise_padding", f"must be 0 or 1, got {depthwise_padding!r}")
    h, w = (mobilenet_feature_size(s, depthwise_padding) for s in input_shape[:2])
    if min(h, w) < 1:
        raise FieldError("input_shape", f"{input_shape} is too small for MobileNet with "
                                        f"depthwise_padding={depthwise_padding} (needs >= 33x33 "
                                        f"without padding)")
    module = _MobileNet(int(num_classes), width, groups, hidden, int(depthwise_padding))
    return from_flax(module, input_shape, num_classes, "mobilenet", uses_xla_conv=True)


MODELS = {
    "resnet18_gn": resnet18_gn,
    "resnet10_gn_sn": resnet10_gn_sn,
    "resnet9": resnet9,
    "mobilenet": mobilenet,
}
