"""The ``Model`` container: a network as a bundle of pure functions.

A ``Model`` hides flax from the federated code: local training only ever calls
``model.per_example_loss(params, batch, key)`` and evaluation calls
``model.per_example_metrics(params, batch)``. ``batch`` is a dict with ``"x"`` and
``"y"`` arrays whose leading axis is the batch. Models must be safe under ``vmap``
over clients: no batch statistics (GroupNorm, never BatchNorm).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from fedjax_fair import hparams as H


class Model(NamedTuple):
    """Pure functions of one network.

    init: key -> params.
    apply: (params, x, key | None) -> logits [B, C]; ``key`` drives dropout-like
      randomness in training and is None at evaluation.
    per_example_loss: (params, batch, key | None) -> [B] cross-entropy.
    per_example_metrics: (params, batch) -> {"loss": [B], "accuracy": [B],
      "confidence": [B]} (the max softmax probability, for calibration).
    name, input_shape, num_classes: static description.
    uses_xla_conv: True when the network runs XLA convolution ops; on CPU the
      local steps are then unrolled (execution.local_step_unroll, jax-ml/jax#12868).
    """

    init: Callable
    apply: Callable
    per_example_loss: Callable
    per_example_metrics: Callable
    name: str
    input_shape: tuple
    num_classes: int
    uses_xla_conv: bool = False

    def num_params(self, params) -> int:
        return sum(int(p.size) for p in jax.tree.leaves(params))


def example_flops(model: Model, example) -> float:
    """FLOPs of the loss's forward pass on one example of ``example``'s shapes (a dict
    of arrays or ``ShapeDtypeStruct``, one example, no batch axis): XLA's cost
    analysis of the program lowered for the CPU, nothing compiled or run, so the
    count is the un-optimised program's and the same on every backend. The CPU
    lowering is used because the GPU and TPU plugins have no cost analysis before
    compiling (``Lowered.cost_analysis`` is None there). Where none is reported (no
    CPU backend in the process: ``JAX_PLATFORMS`` without ``cpu``) the loss is
    compiled once and its compiled cost analysis read. 0 where neither reports.
    Counted once per model and example shapes in a process (a ``compare`` runs the
    same model many times)."""
    shapes = tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in example.items()))
    try:
        return _counted_flops(model, shapes)
    except TypeError:  # an unhashable model (functools.cache's key): counted every time
        return _count_flops(model, shapes)


def _count_flops(model: Model, shapes: tuple) -> float:
    """``example_flops`` of one example of ``shapes`` ((name, shape, dtype) per leaf)."""
    one = {k: jax.ShapeDtypeStruct((1, *shape), dtype) for k, shape, dtype in shapes}
    params = jax.eval_shape(model.init, jax.random.key(0))
    try:
        cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        one, params = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=cpu), (one, params))
    except RuntimeError:  # no CPU backend: lowered for the default one
        pass
    lowered = jax.jit(lambda p, b: model.per_example_loss(p, b, jax.random.key(0))).lower(
        params, one)
    cost = lowered.cost_analysis()
    if cost is None:
        cost = lowered.compile().cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jaxlibs: one dict per computation
        cost = cost[0] if cost else None
    return float(cost.get("flops", 0.0)) if isinstance(cost, dict) else 0.0


_counted_flops = functools.cache(_count_flops)


def check_widths(field: str, widths) -> tuple:
    """Layer widths as a tuple of positive ints (errors name ``field``)."""
    try:
        widths = tuple(widths)
    except TypeError:
        raise H.FieldError(field, f"must be a list of positive ints, got {widths!r}") from None
    if any(isinstance(w, bool) or not isinstance(w, int) or w <= 0 for w in widths):
        raise H.FieldError(field, f"must be positive ints, got {widths!r}")
    return widths


def cross_entropy(logits, labels):
    """Per-example softmax cross-entropy with integer labels, [B]."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def from_flax(module: nn.Module, input_shape: tuple, num_classes: int, name: str,
              uses_xla_conv: bool = False, input_dtype=jnp.float32) -> Model:
    """Wraps a flax.linen module mapping x [B, *input_shape] to logits [B, C].

    ``input_dtype`` is the dtype of the dummy input that ``init`` traces the module
    with: float32 for images and features, an integer dtype for token ids (embeddings
    reject float inputs).
    """

    def init(key):
        return module.init(key, jnp.zeros((1, *input_shape), input_dtype))

    def apply(params, x, key=None):
        del key  # the built-in networks are deterministic
        return module.apply(params, x)

    def per_example_loss(params, batch, key=None):
        return cross_entropy(apply(params, batch["x"], key), batch["y"])

    def per_example_metrics(params, batch):
        logits = apply(params, batch["x"])
        return {"loss": cross_entropy(logits, batch["y"]),
                "accuracy": (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32),
                "confidence": jnp.max(jax.nn.softmax(logits, -1), -1)}

    return Model(init, apply, per_example_loss, per_example_metrics, name,
                 tuple(input_shape), int(num_classes), uses_xla_conv)


INITIALIZERS = {
    "glorot_uniform": nn.initializers.glorot_uniform(),
    "glorot_normal": nn.initializers.glorot_normal(),
    "lecun_uniform": nn.initializers.lecun_uniform(),
    "lecun_normal": nn.initializers.lecun_normal(),
    "he_uniform": nn.initializers.he_uniform(),
    "he_normal": nn.initializers.he_normal(),
    "zeros": nn.initializers.zeros_init(),
}
"""Weight initializers by name (flax's; fan-in / fan-out from the last two axes and
the receptive field of the others, so convolution kernels [kh, kw, in, out] work)."""


def with_initializer(model: Model, kernel: str = "glorot_uniform") -> Model:
    """A Model whose ``init`` draws every weight matrix / kernel (a leaf named
    ``kernel`` with at least 2 axes) from ``INITIALIZERS[kernel]`` and sets every
    ``bias`` to zero; other leaves (embeddings, norm scales) keep the network's own
    initialisation. q-FFL's logistic regression is ``with_initializer(logreg,
    "glorot_uniform")`` (TensorFlow's dense default: Glorot-uniform, zero bias).
    ``"default"`` returns the model unchanged."""
    if kernel == "default":
        return model
    if kernel not in INITIALIZERS:
        raise H.FieldError("initializer", f"unknown name {kernel!r}; allowed: default, "
                                          f"{', '.join(INITIALIZERS)}")
    draw = INITIALIZERS[kernel]

    def init(key):
        params = model.init(key)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        keys = jax.random.split(jax.random.fold_in(key, 1), max(1, len(leaves)))
        new = []
        for (path, leaf), k in zip(leaves, keys):
            name = getattr(path[-1], "key", None) if path else None
            if name == "kernel" and leaf.ndim >= 2:
                leaf = draw(k, leaf.shape, leaf.dtype)
            elif name == "bias":
                leaf = jnp.zeros_like(leaf)
            new.append(leaf)
        return jax.tree_util.tree_unflatten(treedef, new)

    return model._replace(init=init, name=f"{model.name}+{kernel}")
