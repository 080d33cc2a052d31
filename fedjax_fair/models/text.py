"""Character-level next-token model: the LEAF Shakespeare stacked LSTM.

``char_lstm``: embedding(V, 8) -> 2 stacked LSTM layers of 256 units -> hidden state of
the last time step -> dense V. This is the Shakespeare model of LEAF (Caldas et al.,
2018, ``models/shakespeare/stacked_lstm.py``) used by q-FFL (Li et al., 2020) and
inferred for DQN-Fed (the DQN-Fed paper (TMLR, OpenReview KbteA50cni) §5), and SuPerFed's StackedLSTM (SuPerFed (arXiv:2109.07628) experiments,
reference code) with ``use_bias=False, forget_bias=0.0``.

Inputs are int32 token ids [B, T] (T = 80 in LEAF), targets the id of the next
character [B], so the model plugs into the same cross-entropy ``Model`` container as
the classifiers (``from_flax(..., input_dtype=jnp.int32)``).

The LSTM is written out (``LSTMLayer``) instead of using ``nn.OptimizedLSTMCell``
because (a) flax's cells always have a bias and SuPerFed's have none, and (b) the input
projection of all T steps is one matmul before the time loop, leaving one [B, H] x
[H, 4H] matmul per step inside ``lax.scan``. Nothing depends on other examples of the
batch, so the model is safe under ``vmap`` over clients.
"""
from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_fair.hparams import FieldError, count
from fedjax_fair.models.base import Model, from_flax


def _per_gate(init, gates: int = 4):
    """Initialiser for a [n, gates * h] kernel: ``init`` drawn per [n, h] gate block."""

    def init_fn(key, shape, dtype=jnp.float32):
        n, width = shape
        keys = jax.random.split(key, gates)
        return jnp.concatenate([init(k, (n, width // gates), dtype) for k in keys], axis=-1)

    return init_fn


class LSTMLayer(nn.Module):
    """One LSTM layer over a whole sequence: x [B, T, D] -> hidden states [B, T, H].

    Gates in PyTorch order (i, f, g, o) with pre-activations
    z_t = x_t W_in + h_{t-1} W_rec (+ b) and
    c_t = sigmoid(z_f + forget_bias) * c_{t-1} + sigmoid(z_i) * tanh(z_g),
    h_t = sigmoid(z_o) * tanh(c_t), from c_0 = h_0 = 0.

    ``use_bias``: one bias vector b [4H] (TF's BasicLSTMCell in LEAF has one; PyTorch's
    b_ih + b_hh is the same function with one redundant vector). ``forget_bias``: a
    constant added to the forget gate (LEAF's BasicLSTMCell default 1.0; PyTorch 0).
    Initialisation: LeCun-normal input kernel, orthogonal recurrent kernel per gate
    (flax's LSTM defaults), zero bias.
    """

    features: int
    use_bias: bool = True
    forget_bias: float = 1.0
    unroll: int = 1

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        h = self.features
        w_in = self.param("input_kernel", nn.initializers.lecun_normal(), (d, 4 * h))
        w_rec = self.param("recurrent_kernel", _per_gate(nn.initializers.orthogonal()),
                           (h, 4 * h))
        z_in = (x.reshape(b * t, d) @ w_in).reshape(b, t, 4 * h)
        shift = jnp.zeros((4 * h,), z_in.dtype).at[h:2 * h].set(self.forget_bias)
        if self.use_bias:
            shift = shift + self.param("bias", nn.initializers.zeros_init(), (4 * h,))
        z_in = z_in + shift.reshape(1, 1, 4 * h)

        def step(carry, z_t):
            c, h_prev = carry
            i, f, g, o = jnp.split(z_t + h_prev @ w_rec, 4, axis=-1)
            c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
            h_t = jax.nn.sigmoid(o) * jnp.tanh(c)
            return (c, h_t), h_t

        zeros = jnp.zeros((b, h), z_in.dtype)
        _, hs = jax.lax.scan(step, (zeros, zeros), jnp.swapaxes(z_in, 0, 1), unroll=self.unroll)
        return jnp.swapaxes(hs, 0, 1)


class _CharLSTM(nn.Module):
    vocab_size: int
    num_classes: int
    embed_dim: int = 8
    hidden: tuple = (256, 256)
    use_bias: bool = True
    forget_bias: float = 1.0
    unroll: int = 1

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab_size, self.embed_dim)(tokens)
        for h in self.hidden:
            x = LSTMLayer(h, self.use_bias, self.forget_bias, self.unroll)(x)
        return nn.Dense(self.num_classes, use_bias=self.use_bias)(x[:, -1, :])



def char_lstm(input_shape, num_classes, embed_dim: int = 8, hidden: Sequence[int] = (256, 256),
              use_bias: bool = True, forget_bias: float = 1.0, vocab_size: int | None = None,
              unroll: int = 1) -> Model:
    """Stacked character LSTM (LEAF Shakespeare; SuPerFed (arXiv:2109.07628) experiments StackedLSTM).

    Parameters
    ----------
    input_shape : (T,), the sequence length (80 in LEAF).
    num_classes : V, the number of next-character classes (LEAF: 80; SuPerFed's code
        uses ``len(string.printable)`` = 100); also the embedding's vocabulary unless
        ``vocab_size`` is given.
    embed_dim : width of the character embedding (8).
    hidden : widths of the stacked LSTM layers ((256, 256)).
    use_bias : biases in the LSTM layers and the output layer. Default True as in LEAF
        (BasicLSTMCell and tf.layers.dense have biases); SuPerFed's reference code has
        none (``use_bias=False``).
    forget_bias : constant added to the forget gate: 1.0 = LEAF's BasicLSTMCell,
        0.0 = PyTorch's nn.LSTM (SuPerFed).
    unroll : ``lax.scan`` unroll factor over time steps (speed only).

    With V = 80: 817,872 parameters (LEAF) and 815,744 with ``use_bias=False``.
    """
    input_shape = tuple(input_shape)
    if len(input_shape) != 1:
        raise FieldError("input_shape", f"must be (sequence_length,), got {input_shape!r}")
    count(input_shape[0], "input_shape")
    hidden = tuple(hidden)
    if not hidden:
        raise FieldError("hidden", "needs at least one LSTM layer")
    for h in hidden:
        count(h, "hidden")
    vocab = int(num_classes) if vocab_size is None else count(vocab_size, "vocab_size")
    module = _CharLSTM(vocab, int(num_classes), count(embed_dim, "embed_dim"), hidden,
                       bool(use_bias), float(forget_bias), count(unroll, "unroll"))
    return from_flax(module, input_shape, num_classes, "char_lstm", input_dtype=jnp.int32)


MODELS = {"char_lstm": char_lstm}
