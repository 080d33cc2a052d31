"""Small networks of the fair-FL literature: logistic regression, MLP, small CNN.

* ``logistic_regression``: multinomial logistic regression, the model of the
  Synthetic(alpha, beta) experiments in FedProx (Li et al., 2020) and q-FFL
  (Li et al., 2020): logits = x W + b.
* ``mlp``: fully connected ReLU network (default 200-200 hidden units, the
  FEMNIST-shaped MLP of docs/performance.md).
* ``cnn``: the LEAF FEMNIST CNN shape (conv5x5-32, pool, conv5x5-64, pool, dense,
  softmax), with width knobs so a small version runs fast in tests.

Convolutions are ``Conv`` below, which can run as XLA's convolution or as
patches + matmul (im2col from shifted slices). The second form keeps
convolution weight-gradients out of rolled loops, which XLA:CPU runs 4-100x slower
(jax-ml/jax#12868); both forms compute the same function with the same parameters.
"""
from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_fair.models.base import Model, check_widths, from_flax


def _im2col(x, kh, kw):
    """'SAME' patches of x [B, H, W, C] as [B, H, W, kh*kw*C], ordered (i, j, c).

    Built from shifted slices of the padded input, so neither the forward pass nor
    its gradient contains a convolution op.
    """
    h, w = x.shape[1], x.shape[2]
    top, left = (kh - 1) // 2, (kw - 1) // 2
    xp = jnp.pad(x, ((0, 0), (top, kh - 1 - top), (left, kw - 1 - left), (0, 0)))
    return jnp.concatenate([xp[:, i:i + h, j:j + w, :] for i in range(kh) for j in range(kw)], -1)


class Conv(nn.Module):
    """'SAME' stride-1 2-D convolution, NHWC, kernel [kh, kw, cin, cout]."""

    features: int
    kernel_size: tuple = (5, 5)
    impl: str = "xla"  # "xla" | "patches"

    @nn.compact
    def __call__(self, x):
        kh, kw = self.kernel_size
        cin = x.shape[-1]
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (kh, kw, cin, self.features))
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        dn = ("NHWC", "HWIO", "NHWC")
        if self.impl == "xla":
            y = jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME", dimension_numbers=dn)
        elif self.impl == "patches":
            y = _im2col(x, kh, kw) @ kernel.reshape(kh * kw * cin, self.features)
        else:
            raise ValueError(f"Conv.impl must be 'xla' or 'patches', got {self.impl!r}")
        return y + bias.reshape(1, 1, 1, -1)


class _MLP(nn.Module):
    hidden: Sequence[int]
    num_classes: int

    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        for h in self.hidden:
            x = nn.relu(nn.Dense(h)(x))
        return nn.Dense(self.num_classes)(x)


class _CNN(nn.Module):
    num_classes: int
    channels: Sequence[int] = (32, 64)
    dense: int = 512
    conv_impl: str = "xla"

    @nn.compact
    def __call__(self, x):
        for c in self.channels:
            x = nn.relu(Conv(c, (5, 5), self.conv_impl)(x))
            x = nn.max_pool(x, (2, 2), (2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(self.dense)(x))
        return nn.Dense(self.num_classes)(x)


def logistic_regression(input_shape, num_classes) -> Model:
    return from_flax(_MLP((), num_classes), input_shape, num_classes, "logreg")


def mlp(input_shape, num_classes, hidden: Sequence[int] = (200, 200)) -> Model:
    return from_flax(_MLP(check_widths("hidden", hidden), num_classes), input_shape,
                     num_classes, "mlp")


def cnn(input_shape, num_classes, channels: Sequence[int] = (32, 64), dense: int = 512,
        conv_impl: str = "auto") -> Model:
    """LEAF-style CNN. ``conv_impl="auto"`` picks patches+matmul on CPU, XLA conv else."""
    if conv_impl == "auto":
        conv_impl = "patches" if jax.default_backend() == "cpu" else "xla"
    module = _CNN(num_classes, check_widths("channels", channels),
                  check_widths("dense", (dense,))[0], conv_impl)
    return from_flax(module, input_shape, num_classes, "cnn", uses_xla_conv=conv_impl == "xla")
