"""The small vision networks of the reimplemented papers, exactly as their specs give them.

Each builder has the registry signature ``builder(input_shape, num_classes, **kwargs)
-> Model`` and names the model after its registry key (``MODELS`` at the bottom).

* ``femnist_cnn``: the LEAF FEMNIST CNN (Caldas et al., 2018; the DQN-Fed paper (TMLR, OpenReview KbteA50cni) §5
  "FEMNIST-original", inferred LEAF): conv5x5-32 SAME, ReLU, maxpool 2, conv5x5-64 SAME,
  ReLU, maxpool 2, dense 2048, ReLU, dense C. It is ``simple.cnn`` with ``dense=2048``.
* ``lenet_fedpd``: the A-FedPD LeNet (A-FedPD (arXiv:2409.18915) §5): conv5x5-64 VALID, ReLU, maxpool 2,
  conv5x5-64 VALID, ReLU, maxpool 2, FC 384, ReLU, FC 192, ReLU, FC C (CIFAR 32x32x3).
* ``mlp2``: the DQN-Fed two-hidden-layer MLP (the DQN-Fed paper (TMLR, OpenReview KbteA50cni) §5, CIFAR-10 setup 1, inferred
  3072-200-200-10 from FedFV/easyFL; also its Fashion-MNIST MLP). It is ``simple.mlp``.
* ``cnn_ch``: the MNIST CNN of Ben Mansour et al. (arXiv:2307.06283) §3.1: conv3x3-32 VALID, ReLU,
  maxpool 2, conv3x3-64 VALID, ReLU, maxpool 2, flatten (1600), dense 10 (34,826
  parameters); ``hidden=1600`` adds the paper's literal Dense(1600)+ReLU layer (A7).
* ``twonn``, ``twocnn``, ``vgg9``: SuPerFed's reference-code networks (SuPerFed (arXiv:2109.07628) experiments
  "Models"), every layer without bias.

Convolutions are ``PaddedConv``: any explicit zero padding, stride 1, with or without
bias, run either as XLA's convolution or as patches + matmul (``padded_patches``, the
general-padding form of ``simple._im2col``), so the CPU path has no convolution op in
the forward or backward pass (jax-ml/jax#12868).
No network uses batch statistics, so all are safe under ``vmap`` over clients.
"""
from __future__ import annotations

from typing import Sequence, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_fair.models.base import Model, check_widths as _check_widths, from_flax
from fedjax_fair.models.simple import cnn, mlp
from fedjax_fair import hparams as H

Padding = Union[str, int, tuple]
POOL = "M"  # marks a 2x2 max-pool in a ``_ConvNet.layers`` spec


def resolve_conv_impl(conv_impl: str) -> str:
    """``"auto"`` -> ``"patches"`` on CPU, ``"xla"`` elsewhere; checks the name."""
    if conv_impl == "auto":
        return "patches" if jax.default_backend() == "cpu" else "xla"
    if conv_impl not in ("xla", "patches"):
        raise H.FieldError("conv_impl", f"must be 'auto', 'xla' or 'patches', got {conv_impl!r}")
    return conv_impl


def explicit_padding(padding: Padding, kernel_size: tuple) -> tuple:
    """Normalises ``padding`` to ((top, bottom), (left, right)).

    ``"SAME"`` pads (k - 1) // 2 before and the rest after (XLA's convention, so even
    kernels pad one more row at the end), ``"VALID"`` pads nothing, an int p pads p on
    every side (PyTorch's ``padding=p``), and a pair of pairs is taken as given.
    """
    kh, kw = kernel_size
    if isinstance(padding, str):
        if padding.upper() == "SAME":
            return ((kh - 1) // 2, kh - 1 - (kh - 1) // 2), ((kw - 1) // 2, kw - 1 - (kw - 1) // 2)
        if padding.upper() == "VALID":
            return (0, 0), (0, 0)
        raise H.FieldError("padding", f"must be 'SAME', 'VALID', an int or ((t, b), (l, r)), "
                                      f"got {padding!r}")
    if isinstance(padding, int) and not isinstance(padding, bool):
        if padding < 0:
            raise H.FieldError("padding", f"must be >= 0, got {padding}")
        return (padding, padding), (padding, padding)
    try:
        (t, b), (l, r) = padding
        pads = tuple(int(v) for v in (t, b, l, r))
    except (TypeError, ValueError):
        raise H.FieldError("padding", f"must be 'SAME', 'VALID', an int or ((t, b), (l, r)), "
                                      f"got {padding!r}") from None
    if min(pads) < 0:
        raise H.FieldError("padding", f"entries must be >= 0, got {padding!r}")
    return (pads[0], pads[1]), (pads[2], pads[3])


def padded_patches(x, kh: int, kw: int, padding: tuple):
    """Stride-1 patches of x [B, H, W, C] zero-padded by ``padding`` ((t, b), (l, r)):
    [B, H', W', kh*kw*C] with H' = H + t + b - kh + 1, ordered (i, j, c).

    The general form of ``simple._im2col`` (which is the 'SAME' case, equal to
    ``padded_patches(x, kh, kw, explicit_padding("SAME", (kh, kw)))``): kh*kw shifted
    slices of the padded input, concatenated on channels, so neither the forward pass
    nor its gradient contains a convolution op. Slicing only the window positions that
    exist was 1.2-1.6x faster on CPU (LeNet's second layer, forward + gradient) than
    cropping the 'SAME' patches of the padded input.
    """
    (t, b), (l, r) = padding
    xp = jnp.pad(x, ((0, 0), (t, b), (l, r), (0, 0)))
    ho, wo = xp.shape[1] - kh + 1, xp.shape[2] - kw + 1
    if ho <= 0 or wo <= 0:
        raise H.FieldError("input_shape", f"spatial size {x.shape[1:3]} padded by {padding} is "
                                          f"smaller than the {kh}x{kw} kernel")
    return jnp.concatenate([xp[:, i:i + ho, j:j + wo, :] for i in range(kh) for j in range(kw)],
                           -1)


class PaddedConv(nn.Module):
    """Stride-1 2-D convolution with explicit zero padding, NHWC, kernel [kh, kw, cin, cout].

    Same parameter names and shapes as ``simple.Conv`` ("kernel", and "bias" when
    ``use_bias``), so ``impl="xla"`` and ``impl="patches"`` share parameters.
    """

    features: int
    kernel_size: tuple = (3, 3)
    padding: Padding = "SAME"
    use_bias: bool = True
    impl: str = "xla"  # "xla" | "patches"

    @nn.compact
    def __call__(self, x):
        kh, kw = self.kernel_size
        pads = explicit_padding(self.padding, (kh, kw))
        (t, b), (l, r) = pads
        if x.shape[1] + t + b < kh or x.shape[2] + l + r < kw:
            raise H.FieldError("input_shape", f"a {x.shape[1]}x{x.shape[2]} feature map padded by "
                                              f"{pads} is smaller than the {kh}x{kw} kernel")
        cin = x.shape[-1]
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (kh, kw, cin, self.features))
        if self.impl == "xla":
            y = jax.lax.conv_general_dilated(x, kernel, (1, 1), pads,
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
        elif self.impl == "patches":
            y = padded_patches(x, kh, kw, pads) @ kernel.reshape(kh * kw * cin, self.features)
        else:
            raise H.FieldError("conv_impl", f"must be 'xla' or 'patches', got {self.impl!r}")
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros_init(), (self.features,)).reshape(
                1, 1, 1, -1)
        return y


class _ConvNet(nn.Module):
    """Convolution/pool trunk, flatten, ReLU MLP head (VGG-style layer spec).

    layers: ints are ``PaddedConv(c)`` + ReLU, ``POOL`` is a 2x2 stride-2 max-pool
      padded by ``pool_padding`` on every side (-inf padding, as PyTorch).
    hidden: widths of the Dense + ReLU layers after flattening; then Dense(num_classes).
    """

    num_classes: int
    layers: tuple = ()
    kernel_size: tuple = (3, 3)
    padding: Padding = "SAME"
    pool_padding: int = 0
    hidden: tuple = ()
    use_bias: bool = True
    conv_impl: str = "xla"

    @nn.compact
    def __call__(self, x):
        p = self.pool_padding
        for spec in self.layers:
            if spec == POOL:
                x = nn.max_pool(x, (2, 2), (2, 2), padding=((p, p), (p, p)))
            else:
                x = nn.relu(PaddedConv(spec, self.kernel_size, self.padding, self.use_bias,
                                       self.conv_impl)(x))
        x = x.reshape(x.shape[0], -1)
        for h in self.hidden:
            x = nn.relu(nn.Dense(h, use_bias=self.use_bias)(x))
        return nn.Dense(self.num_classes, use_bias=self.use_bias)(x)


def _check_layers(layers) -> tuple:
    layers = tuple(layers)
    for spec in layers:
        if spec != POOL and (isinstance(spec, bool) or not isinstance(spec, int) or spec <= 0):
            raise H.FieldError("channels", f"entries must be positive ints or {POOL!r}, got "
                                           f"{spec!r}")
    return layers


def _conv_model(name, input_shape, num_classes, *, layers, kernel_size, padding, hidden,
                use_bias, conv_impl, pool_padding=0) -> Model:
    impl = resolve_conv_impl(conv_impl)
    module = _ConvNet(int(num_classes), _check_layers(layers), tuple(kernel_size), padding,
                      int(pool_padding), _check_widths("hidden", hidden), bool(use_bias), impl)
    return from_flax(module, input_shape, num_classes, name, uses_xla_conv=impl == "xla")


def femnist_cnn(input_shape, num_classes, conv_impl: str = "auto") -> Model:
    """LEAF FEMNIST CNN (Caldas et al., 2018, ``models/femnist/cnn.py``; the DQN-Fed paper (TMLR, OpenReview KbteA50cni) §5).

    conv5x5-32 SAME + ReLU, maxpool 2, conv5x5-64 SAME + ReLU, maxpool 2, dense 2048 +
    ReLU, dense C; biases everywhere. 6,603,710 parameters for 28x28x1 and C = 62.
    """
    resolve_conv_impl(conv_impl)  # same error message as the other conv builders
    return cnn(input_shape, num_classes, channels=(32, 64), dense=2048,
               conv_impl=conv_impl)._replace(name="femnist_cnn")


def lenet_fedpd(input_shape, num_classes, channels: Sequence[int] = (64, 64),
                hidden: Sequence[int] = (384, 192), conv_impl: str = "auto") -> Model:
    """A-FedPD LeNet (A-FedPD (arXiv:2409.18915) §5 "LeNet [sim]") for CIFAR 32x32x3.

    conv5x5 3->64 VALID + ReLU, maxpool 2, conv5x5 64->64 VALID + ReLU, maxpool 2,
    flatten (64*5*5 = 1600), FC 384 + ReLU, FC 192 + ReLU, FC n_cls; no normalisation.
    797,962 parameters for 10 classes, 815,332 for 100.
    """
    channels = _check_widths("channels", channels)
    layers = sum(((c, POOL) for c in channels), ())
    return _conv_model("lenet_fedpd", input_shape, num_classes, layers=layers,
                       kernel_size=(5, 5), padding="VALID", hidden=hidden, use_bias=True,
                       conv_impl=conv_impl)


def mlp2(input_shape, num_classes, hidden: Sequence[int] = (200, 200)) -> Model:
    """DQN-Fed MLP with two hidden ReLU layers (the DQN-Fed paper (TMLR, OpenReview KbteA50cni) §5, CIFAR-10 setup 1 and
    Fashion-MNIST; widths inferred from FedFV/easyFL: 3072-200-200-10, biases).
    656,810 parameters for 32x32x3 inputs and 10 classes."""
    return mlp(input_shape, num_classes, hidden=_check_widths("hidden", hidden))._replace(
        name="mlp2")


def cnn_ch(input_shape, num_classes, hidden: int = 0, conv_impl: str = "auto") -> Model:
    """MNIST CNN of Ben Mansour et al. (arXiv:2307.06283) §3.1 (code's Keras model).

    conv3x3-32 VALID + ReLU, maxpool 2, conv3x3-64 VALID + ReLU, maxpool 2, flatten
    (64*5*5 = 1600 for 28x28x1), Dense(C): 34,826 parameters. ``hidden > 0`` inserts a
    Dense(hidden) + ReLU before the output layer (the paper's literal "fully connected
    layer with 1600 units and ReLU", spec A7: ``hidden=1600``).
    """
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 0:
        raise H.FieldError("hidden", f"must be an int >= 0, got {hidden!r}")
    return _conv_model("cnn_ch", input_shape, num_classes, layers=(32, POOL, 64, POOL),
                       kernel_size=(3, 3), padding="VALID", hidden=(hidden,) if hidden else (),
                       use_bias=True, conv_impl=conv_impl)


def twonn(input_shape, num_classes, hidden: Sequence[int] = (200, 200, 200),
          use_bias: bool = False) -> Model:
    """SuPerFed TwoNN (SuPerFed (arXiv:2109.07628) experiments, ref code): flatten, 784-200-200-200-C with ReLU,
    no biases (one hidden layer more than McMahan et al.'s 2NN).
    238,800 parameters for 28x28x1 and C = 10."""
    module = _ConvNet(int(num_classes), hidden=_check_widths("hidden", hidden),
                      use_bias=bool(use_bias))
    return from_flax(module, input_shape, num_classes, "twonn")


def twocnn(input_shape, num_classes, use_bias: bool = False, conv_impl: str = "auto") -> Model:
    """SuPerFed TwoCNN (SuPerFed (arXiv:2109.07628) experiments, ref code), no biases.

    conv5x5-32 pad 1 + ReLU, maxpool 2 pad 1, conv5x5-64 pad 1 + ReLU, maxpool 2 pad 1,
    flatten (64*7*7 for 28x28 input), 200 + ReLU, 200 + ReLU, C.
    722,800 parameters for 28x28x3 (CIFAR-10 resized) and C = 10.
    """
    return _conv_model("twocnn", input_shape, num_classes, layers=(32, POOL, 64, POOL),
                       kernel_size=(5, 5), padding=1, pool_padding=1, hidden=(200, 200),
                       use_bias=use_bias, conv_impl=conv_impl)


VGG9_CHANNELS = (16, 32, 64, 128, 256, 512)


def vgg9(input_shape, num_classes, channels: Sequence[int] = VGG9_CHANNELS,
         dense: int = 256, use_bias: bool = False, conv_impl: str = "auto") -> Model:
    """SuPerFed VGG9 for FEMNIST 28x28x1 (SuPerFed (arXiv:2109.07628) experiments), no biases, no BN.

    conv3x3 (pad 1) widths c1, pool, c2, pool, c3, c4, pool, c5, c6, pool, each conv
    followed by ReLU; flatten (c6 * 1 * 1 for 28x28), dense ``dense`` + ReLU, dense C.
    Defaults (16, 32, 64, 128, 256, 512), 256: 1,718,416 parameters for C = 62 (the
    paper's "1.7M"). An older reference-code revision is narrower:
    ``channels=(16, 32, 64, 64, 128, 64), dense=64``.
    """
    c = _check_widths("channels", channels)
    if len(c) != 6:
        raise H.FieldError("channels", f"VGG9 has 6 convolutions, got {len(c)} widths")
    if isinstance(dense, bool) or not isinstance(dense, int) or dense <= 0:
        raise H.FieldError("dense", f"must be a positive int, got {dense!r}")
    layers = (c[0], POOL, c[1], POOL, c[2], c[3], POOL, c[4], c[5], POOL)
    return _conv_model("vgg9", input_shape, num_classes, layers=layers, kernel_size=(3, 3),
                       padding=1, hidden=(dense,), use_bias=use_bias, conv_impl=conv_impl)


MODELS = {
    "femnist_cnn": femnist_cnn,
    "lenet_fedpd": lenet_fedpd,
    "mlp2": mlp2,
    "cnn_ch": cnn_ch,
    "twonn": twonn,
    "twocnn": twocnn,
    "vgg9": vgg9,
}
