"""Local training of ONE client (docs/architecture.md).

``local_training`` builds a ``ClientUpdate``: a pure function of
``(broadcast, client_state, data, local_steps, key)`` that an execution strategy
(execution.py) maps over the cohort, returning ``(ClientOutput, new_client_state)``.

Like fedjax's ``for_each_client`` it is split in three, and a method adds what it
needs at each point without a new ``ClientOutput`` field:

* start: ``start(broadcast, client_state) -> params`` picks the model the client
  trains from (default: the broadcast parameters; FedRep: global body + personal head);
* step: minibatch SGD (any optax transformation) on the masked batch loss plus
  ``regularizer(params, broadcast, client_state)`` (FedProx's proximal term,
  SCAFFOLD's correction <c - c_i, w>, FedDyn's linear and quadratic terms);
* final: ``finish(result, broadcast, client_state, data, key) -> (new_state, extra)``
  turns the trained model into the client's new state row and the method's own
  outputs (``ClientOutput.extra``): a control-variate change, a personal model, a
  gradient at the global model, ...

The client learning rate may depend on the round (``client_lr`` a callable of the
broadcast round t, e.g. ``lambda t: 0.1 * 0.99 ** t``) and may be a traced array.

Semantics, for a client with n real examples, batch size B and E epochs:

* steps per epoch = ceil(n / B); the client takes
  ``min(local_steps, E * ceil(n / B))`` steps, where ``local_steps`` is its budget
  (computational heterogeneity). All clients run the same static number of steps,
  ``max_steps``, in one ``lax.scan``; step t is masked off (the carry is kept) when
  t is at or past the client's count.
* each epoch e draws a fresh permutation of the real rows from
  ``fold_in(shuffle_key, e)``; padded rows sort last and are masked, so the last
  batch of an epoch may be partial; batches never mix epochs.
* losses are masked means; a client with no examples takes no step, returns a zero
  delta and a zero loss, never NaN.

"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from fedjax_fair.core import execution
from fedjax_fair import hparams as H
from fedjax_fair.metrics import binned_calibration
from fedjax_fair.models.base import Model
from fedjax_fair.core.types import Array, Broadcast, ClientData, ClientOutput, ClientUpdate


def masked_mean(values: Array, mask: Array) -> Array:
    """sum over real rows / max(count, 1): the mean over real rows, 0 if none.

    Masked rows are selected away (not multiplied by 0), so NaN or inf on a padded
    row cannot leak into the mean."""
    return jnp.sum(jnp.where(mask, values, 0)) / jnp.maximum(jnp.sum(mask), 1)


def steps_per_epoch(num_examples: Array, batch_size: int) -> Array:
    """ceil(n / B) (0 for an empty client)."""
    return (num_examples + batch_size - 1) // batch_size


def max_local_steps(padded_size: int, batch_size: int, num_epochs: int,
                    max_steps: Optional[int] = None) -> int:
    """The static scan length: E * ceil(M / B), optionally capped by ``max_steps``."""
    steps = num_epochs * math.ceil(padded_size / batch_size)
    return steps if max_steps is None else min(steps, max_steps)


# Clients of at most this many stored rows sort their epoch orders as one packed
# integer key (``epoch_order``): 8 bits of row index under 24 bits of score.
PACKED_SORT_ROWS = 256
# ``masked_steps`` gathers a lone client's batches before its step loop when they fit
# in its stored rows (False: always in the loop; for benchmarks/step_overhead.py).
PREGATHER = True


def epoch_order(data: ClientData, shuffle_key: Array, epoch: Array, batch_size: int) -> Array:
    """Row order of one epoch: a permutation of the real rows, padded rows last,
    drawn from ``fold_in(shuffle_key, epoch)`` and padded to a multiple of B.

    The order is the stable argsort of the scores ``uniform(fold_in(shuffle_key,
    epoch), (M,))`` with padded rows scored 2. For M <= ``PACKED_SORT_ROWS`` it is
    computed as ONE sort of uint32 keys ``m << 8 | row``: a float32 uniform is
    ``m * 2^-23`` with m < 2^23 an integer, padded rows take m = 2^23, so the keys
    order like (score, row), i.e. like the stable argsort, and the row is the key's
    low byte. XLA:CPU sorts one primitive array about 4x faster than the argsort's
    (score, index) pair with its comparator (~24 vs ~100 us per client for 4 epochs
    of 200 rows; benchmarks/step_overhead.py), a per-client cost of every round.
    """
    padded = data.mask.shape[0]
    scores = jax.random.uniform(jax.random.fold_in(shuffle_key, epoch), (padded,))
    if padded <= PACKED_SORT_ROWS:
        m = jnp.where(data.mask, scores * 2.0 ** 23, 2.0 ** 23).astype(jnp.uint32)
        keys = (m << 8) | jnp.arange(padded, dtype=jnp.uint32)
        order = (jnp.sort(keys) & 0xFF).astype(jnp.int32)
    else:
        order = jnp.argsort(jnp.where(data.mask, scores, 2.0))
    return jnp.pad(order, (0, math.ceil(padded / batch_size) * batch_size - padded))


def batch_from_orders(data: ClientData, orders: Array, step: Array, batch_size: int):
    """The batch of local step ``step`` given every epoch's row order [E, slots]:
    (examples dict [B, ...], mask [B]). Positions at or past ``num_examples`` within
    the epoch are masked (the last batch of an epoch may be partial)."""
    rows, batch_mask = batch_rows(data, orders, step, batch_size)
    return {k: v[rows] for k, v in data.examples.items()}, batch_mask


def batch_rows(data: ClientData, orders: Array, step: Array, batch_size: int):
    """The row indices [B] and mask [B] of ``batch_from_orders``' batch."""
    n = data.num_examples
    spe = jnp.maximum(steps_per_epoch(n, batch_size), 1)
    epoch, i = step // spe, step % spe
    start = i * batch_size
    rows = jax.lax.dynamic_slice(orders[jnp.minimum(epoch, orders.shape[0] - 1)], (start,),
                                 (batch_size,))
    return rows, (start + jnp.arange(batch_size)) < n


def batch_at(data: ClientData, step: Array, shuffle_key: Array, batch_size: int):
    """The batch of local step ``step`` (see ``epoch_order``): (examples [B, ...], mask [B])."""
    spe = jnp.maximum(steps_per_epoch(data.num_examples, batch_size), 1)
    order = epoch_order(data, shuffle_key, step // spe, batch_size)
    return batch_from_orders(data, order[None], step % spe, batch_size)


def skip_past(count: Array, step_fn: Callable, carry, t: Array):
    """``step_fn(carry, t)`` if ``t < count``, else ``carry`` unchanged.

    A client running alone branches on its own count (the step is skipped). Clients
    vmapped together (execution.CLIENT_AXIS) branch on the group's largest count,
    an unbatched predicate, so steps past it are skipped for the whole group; below
    it, a client already past its own count keeps its carry through a select.
    Without the named axis (a plain user vmap) the cond becomes a select.
    """
    bound = execution.group_max(count)
    if bound is None:
        return jax.lax.cond(t < count, step_fn, lambda c, _: c, carry, t)

    def masked(c, t):
        return jax.tree.map(lambda new, old: jnp.where(t < count, new, old), step_fn(c, t), c)

    return jax.lax.cond(t < bound, masked, lambda c, _: c, carry, t)


def data_loss(model: Model, params, data: ClientData, chunk_size: int = 256) -> Array:
    """Masked mean loss of ``params`` over all of one client's rows.

    Rows are processed in chunks of ``chunk_size`` (a rolled ``lax.map``) so the
    activation memory stays bounded under vmap over clients.
    """
    return data_metrics(model, params, data, chunk_size)["loss"]


def loss_before_fn(model: Model, loss_chunk_size: Optional[int] = None) -> Callable:
    """``(params, data) -> loss``: ``ClientOutput.loss_before`` as ``local_training``
    computes it (the masked mean loss over the client's rows, in chunks of
    ``loss_chunk_size``; None: ``execution.loss_chunk_size_here()``), for a pass over
    the cohort before training (``compose(cohort_loss=...)``)."""
    def loss(params, data: ClientData):
        chunk = execution.loss_chunk_size_here() if loss_chunk_size is None else loss_chunk_size
        return data_loss(model, params, data, chunk)
    return loss


def data_metrics(model: Model, params, data: ClientData, chunk_size: int = 256) -> dict:
    """Masked means of every ``model.per_example_metrics`` value over one client, and,
    when the model reports per-row "confidence" and "accuracy", the client's
    calibration errors "ece" and "mce" (``metrics.binned_calibration``, 15 bins)."""
    padded = data.mask.shape[0]
    if padded <= chunk_size:
        per_row = model.per_example_metrics(params, data.examples)
    else:
        num_chunks = math.ceil(padded / chunk_size)
        pad = num_chunks * chunk_size - padded
        chunks = {k: jnp.pad(v, [(0, pad)] + [(0, 0)] * (v.ndim - 1)).reshape(
            num_chunks, chunk_size, *v.shape[1:]) for k, v in data.examples.items()}
        # Real rows come first, so chunks past num_examples hold only padding and
        # are skipped (past the group's largest client under a client vmap).
        shapes = jax.eval_shape(lambda b: model.per_example_metrics(params, b),
                                jax.tree.map(lambda v: v[0], chunks))
        bound = execution.group_max(data.num_examples)
        bound = data.num_examples if bound is None else bound
        skip = lambda b: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        per_chunk = jax.lax.map(
            lambda a: jax.lax.cond(a[0] * chunk_size < bound,
                                   lambda b: model.per_example_metrics(params, b), skip, a[1]),
            (jnp.arange(num_chunks), chunks))
        per_row = jax.tree.map(lambda v: v.reshape(-1)[:padded], per_chunk)
    out = {k: masked_mean(v, data.mask) for k, v in per_row.items()}
    if "confidence" in per_row and "accuracy" in per_row:
        out["ece"], out["mce"] = binned_calibration(per_row["confidence"],
                                                    per_row["accuracy"], data.mask)
    return out


FINISH_KEY_ID = 1  # finish's key: fold_in(client key, 1); training splits the client key


class LocalResult(NamedTuple):
    """What ``finish`` receives about the local run.

    params: the trained local model theta_k.
    num_steps: int32 [] local steps taken.
    learning_rate: [] this round's client learning rate (None for a user optimizer).
    train_loss: [] mean per-example loss over the last local epoch.
    step_budget: int32 [] the round's step budget of this client (computational
      heterogeneity), for a second local loop in ``finish``.
    """

    params: Any
    num_steps: Array
    learning_rate: Any
    train_loss: Array
    step_budget: Array


def round_value(value, round_):
    """``value(round_)`` for a schedule (a callable of the round), else ``value``."""
    return value(round_) if callable(value) else value


def masked_steps(step: Callable, carry, data: ClientData, local_steps, key, *,
                 batch_size: int, num_epochs: int = 1, max_steps: Optional[int] = None,
                 unroll: int | bool = 1):
    """The client's masked minibatch schedule, around any step rule.

    Runs ``step(carry, batch, batch_mask, step_key) -> (carry, batch_loss_sum)`` for
    ``min(local_steps, E ceil(n / B))`` steps, in one ``lax.scan`` of static length
    ``max_local_steps(M, B, E, max_steps)`` (steps past the count keep the carry, see
    ``skip_past``), on the epoch-shuffled batches of ``batch_from_orders``; the step
    key is ``fold_in(dropout key, t)``. Returns ``(carry, num_steps, train_loss)``,
    ``train_loss`` the summed batch losses of the last epoch run over its real rows.
    ``local_sgd`` is one optimizer step per batch; pFedMe nests an inner solve.
    """
    shuffle_key, dropout_key = jax.random.split(key)
    length = max_local_steps(data.mask.shape[0], batch_size, num_epochs, max_steps)
    num_steps = jnp.minimum(jnp.minimum(local_steps, length),
                            num_epochs * steps_per_epoch(data.num_examples, batch_size))
    orders = jax.vmap(lambda e: epoch_order(data, shuffle_key, e, batch_size))(
        jnp.arange(num_epochs))
    # The last epoch the client runs starts at this step; its batches' losses are
    # summed into the train_loss statistic.
    spe = jnp.maximum(steps_per_epoch(data.num_examples, batch_size), 1)
    last_epoch_start = jnp.maximum(num_steps - 1, 0) // spe * spe

    # Examples of more than 2 dimensions (images) are gathered from a [M, -1] view
    # and reshaped back: the same batches, but XLA:CPU then passes the client's rows
    # into the step loop without two layout copies of them per client (logreg /
    # MLP on FEMNIST-shaped clients: ~100 us of ~500 us per client;
    # benchmarks/step_overhead.py).
    shapes = {k: v.shape for k, v in data.examples.items()}
    flat = data._replace(examples={k: v.reshape(v.shape[0], -1) if v.ndim > 2 else v
                                   for k, v in data.examples.items()})
    ts = jnp.arange(length)
    # A client running alone (no client vmap) whose batches hold at most its stored
    # rows gathers every step's batch before the loop, in one gather from the
    # cohort's rows, instead of copying its rows into the loop and gathering there
    # (the same batches; no more memory than that copy).
    pregather = (PREGATHER and execution.group_max(num_steps) is None
                 and length * batch_size <= data.mask.shape[0])
    if pregather:
        rows, masks = jax.vmap(lambda t: batch_rows(data, orders, t, batch_size))(ts)
        batches = {k: v[rows.reshape(-1)].reshape(length, batch_size, *v.shape[1:])
                   for k, v in flat.examples.items()}
        xs = (ts, batches, masks)
    else:
        xs = (ts,)

    def one_step(state, x):
        inner, loss_sum = state
        t = x[0]
        if pregather:
            batch, batch_mask = x[1], x[2]
        else:
            batch, batch_mask = batch_from_orders(flat, orders, t, batch_size)
        batch = {k: v.reshape(batch_size, *shapes[k][1:]) for k, v in batch.items()}
        inner, batch_loss_sum = step(inner, batch, batch_mask, jax.random.fold_in(dropout_key, t))
        loss_sum = loss_sum + jnp.where(t >= last_epoch_start, batch_loss_sum,
                                        0.0).astype(loss_sum.dtype)
        return inner, loss_sum

    def scan_step(state, x):
        return skip_past(num_steps, lambda c, _: one_step(c, x), state, x[0]), None

    (carry, loss_sum), _ = jax.lax.scan(scan_step, (carry, jnp.zeros((), jnp.float32)),
                                        xs, unroll=unroll)
    last_epoch_rows = jnp.minimum(data.num_examples, (num_steps - last_epoch_start) * batch_size)
    return carry, num_steps, loss_sum / jnp.maximum(last_epoch_rows, 1)


def local_sgd(model: Model, *, batch_size: int, num_epochs: int = 1,
              max_steps: Optional[int] = None, regularizer: Optional[Callable] = None,
              unroll: int | bool = 1, batch_loss: Optional[Callable] = None,
              sam_radius=None, sam_eps=1e-2, weight_decay=0.0, clip_norm=None,
              clip_mode: str = "step") -> Callable:
    """The masked minibatch loop shared by every local solver.

    Returns ``train(params, optimizer, data, local_steps, key, reg_args) ->
    (params, num_steps, train_loss)``: ``min(local_steps, E ceil(n / B))`` steps of
    ``optimizer`` on the masked batch loss plus ``regularizer(params, *reg_args)``,
    in one ``lax.scan`` of static length ``max_local_steps(M, B, E, max_steps)``.
    Methods that train a second model (Ditto's personal model) call it again.
    ``batch_loss(per_example [B], batch_mask [B]) -> scalar`` replaces the masked mean
    of the per-example losses (masked rows hold 0), e.g. PropFair's -log(1 - l / M)
    of the batch mean l; ``train_loss`` stays the model's own mean loss.

    ``sam_radius`` r (not None): sharpness-aware minimisation (Foret et al., "Sharpness-
    Aware Minimization for Efficiently Improving Generalization", arXiv:2010.01412),
    two gradient evaluations on the same minibatch per step:

        g0 = grad f(theta; B),  e = r g0 / (||g0|| + sam_eps),
        step gradient = grad f(theta + e; B) + grad regularizer(theta),

    the norm global over the pytree; the regularizer (proximal, dual, weight-decay
    terms) is not perturbed. r may be traced; r = 0 gives the plain step's gradient.

    ``weight_decay`` wd: coupled L2, gradient ``wd * theta`` (see ``local_training``).

    ``clip_norm`` c (not None): every step's gradient is clipped to global norm at most
    c (``clip_by_global_norm``) before the optimizer sees it; ``clip_mode`` picks what:

        "step": clip(grad [f(theta; B) + regularizer(theta)]) + wd theta
        "loss": clip(grad f(theta; B)) + grad regularizer(theta) + wd theta

    f the minibatch objective (``batch_loss``; with SAM its perturbed gradient). "step"
    is ``torch.nn.utils.clip_grad_norm_`` after ``backward()`` of loss plus correction
    terms, with weight decay added by the optimizer afterwards (the A-FedPD author's
    simulator, max norm 10). c may be traced. None: no clipping, the same program as
    without the option (the weight decay then joins the regularizer).
    """
    check_clip(clip_norm, clip_mode)
    if clip_norm is None:
        regularizer = with_weight_decay(regularizer, weight_decay)

    def loss_fn(params, batch, batch_mask, key, reg_args, perturbation=None):
        at = params if perturbation is None else jax.tree.map(jnp.add, params, perturbation)
        per_example = jnp.where(batch_mask, model.per_example_loss(at, batch, key), 0.0)
        loss = (jnp.sum(per_example) / jnp.maximum(jnp.sum(batch_mask), 1)
                if batch_loss is None else batch_loss(per_example, batch_mask))
        if regularizer is not None and reg_args is not None:
            loss = loss + regularizer(params, *reg_args)
        return loss, jnp.sum(per_example)

    grad_fn = jax.grad(loss_fn, has_aux=True)
    if sam_radius is not None:
        plain_grad = grad_fn

        def grad_fn(params, batch, batch_mask, key, reg_args):
            g0, loss_sum = plain_grad(params, batch, batch_mask, key, None)
            scale = sam_radius / (optax.tree.norm(g0) + sam_eps)
            shift = jax.tree.map(lambda g: (scale * g).astype(g.dtype), g0)
            grads, _ = plain_grad(params, batch, batch_mask, key, reg_args, shift)
            return grads, loss_sum

    if clip_norm is not None:
        grad_fn = clipped_gradient(grad_fn, regularizer, weight_decay, clip_norm, clip_mode)

    def train(params, optimizer, data: ClientData, local_steps, key, reg_args=()):
        def sgd_step(carry, batch, batch_mask, step_key):
            params, opt_state = carry
            grads, batch_loss_sum = grad_fn(params, batch, batch_mask, step_key, reg_args)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), batch_loss_sum

        (params, _), num_steps, train_loss = masked_steps(
            sgd_step, (params, optimizer.init(params)), data, local_steps, key,
            batch_size=batch_size, num_epochs=num_epochs, max_steps=max_steps, unroll=unroll)
        return params, num_steps, train_loss

    return train


CLIP_MODES = ("step", "loss")  # what ``clip_norm`` clips (``local_sgd``)
CLIP_NORM = H.Range(0.0, None, low_open=True, nullable=True)  # c > 0, or None: off


def clip_by_global_norm(tree, max_norm):
    """``tree`` scaled by min(1, max_norm / ||tree||), the norm global over its leaves
    (``optax.clip_by_global_norm``'s rule, as ``torch.nn.utils.clip_grad_norm_``
    without its 1e-6). Written out because optax's divides by the norm in the branch it
    does not take: reverse mode through a zero gradient (an all-masked batch of a
    client past its step count) gives NaN, and a traced float32 ``max_norm`` with
    bfloat16 leaves fails its ``lax.select``. Here the scale is exactly 1 below the
    bound, every gradient is finite, and ``max_norm`` may be traced (vmap / grad)."""
    sq = optax.tree.norm(tree, squared=True)
    over = sq > jnp.square(max_norm)
    scale = jnp.where(over, max_norm * jax.lax.rsqrt(jnp.where(over, sq, 1.0)), 1.0)
    return jax.tree.map(lambda g: (scale * g).astype(g.dtype), tree)


def clipped_gradient(grad_fn: Callable, regularizer: Optional[Callable], weight_decay,
                     clip_norm, clip_mode: str) -> Callable:
    """``grad_fn(params, batch, batch_mask, key, reg_args) -> (grads, loss_sum)`` (the
    gradient of the batch objective plus ``regularizer(params, *reg_args)``, or of the
    objective alone for ``reg_args=None``) with ``local_sgd``'s clipping: mode "step"
    clips the whole gradient, "loss" only the objective's (the regularizer's gradient
    is then taken apart, without a model evaluation); coupled ``weight_decay`` adds
    ``wd * theta`` after the clip in both."""
    reg_grad = None if regularizer is None else jax.grad(lambda p, args: regularizer(p, *args))
    decay = isinstance(weight_decay, jax.Array) or weight_decay != 0

    def clipped(params, batch, batch_mask, key, reg_args):
        apart = clip_mode == "loss" and reg_grad is not None and reg_args is not None
        grads, loss_sum = grad_fn(params, batch, batch_mask, key, None if apart else reg_args)
        grads = clip_by_global_norm(grads, clip_norm)
        if apart:
            grads = jax.tree.map(lambda g, r: (g + r).astype(g.dtype), grads,
                                 reg_grad(params, reg_args))
        if decay:
            grads = jax.tree.map(lambda g, p: (g + weight_decay * p).astype(g.dtype), grads,
                                 params)
        return grads, loss_sum

    return clipped


def check_clip(clip_norm, clip_mode) -> None:
    """``clip_norm`` > 0 or None (a JAX array passes unchecked) and ``clip_mode`` one of
    ``CLIP_MODES``; ``ValueError("FIELD: ...")`` otherwise."""
    CLIP_NORM.check("clip_norm", clip_norm)
    if clip_mode not in CLIP_MODES:
        raise H.FieldError("clip_mode", f"must be one of {CLIP_MODES}, got {clip_mode!r}")


def check_optimizer(optimizer, field: str, rate_factory: bool = True) -> None:
    """Refuses, before anything runs, an optimizer that is not an optax
    ``GradientTransformation`` (or, with ``rate_factory``, a callable ``rate ->
    transformation`` such as ``optax.sgd``): ``TypeError("FIELD: ...")``. None passes
    (the caller's default)."""
    if optimizer is None or isinstance(optimizer, optax.GradientTransformation):
        return
    if rate_factory and callable(optimizer):
        return
    allowed = ("an optax GradientTransformation (e.g. optax.adam(1e-3)) or a function "
               "rate -> transformation (e.g. optax.sgd)" if rate_factory else
               "an optax GradientTransformation (e.g. optax.adam(1e-3))")
    raise H.FieldTypeError(field, f"must be None or {allowed}, got {describe_object(optimizer)}")


def describe_object(value) -> str:
    """``value`` for an error message: a function by its qualified name (a repr would
    hold its memory address), anything else by type and repr."""
    name = getattr(value, "__qualname__", None)
    if callable(value) and name:
        return f"the function {getattr(value, '__module__', '') or ''}.{name} (not called)"
    return f"{type(value).__name__} {value!r}"


def check_rate_optimizer(client_optimizer, why: str) -> None:
    """For a method that divides by the client rate (``why``): ``client_optimizer`` is
    None or a ``rate -> transformation`` callable, not a fixed transformation, which
    ignores ``client_lr`` (``ValueError("client_optimizer: ...")``)."""
    if isinstance(client_optimizer, optax.GradientTransformation):
        raise H.FieldError("client_optimizer", f"{why} divides by the client rate; give a "
                                               f"rate -> optimizer callable (e.g. optax.sgd or "
                                               f"lambda lr: optax.sgd(lr, momentum=0.9))")


def check_rate(value, field: str = "client_lr"):
    """A learning rate: > 0 when it is a concrete number; a schedule (a callable of
    the round) or a JAX array (possibly traced: vmap / grad over the rate) passes
    unchecked."""
    if callable(value):
        return value
    return H.POSITIVE.check(field, value)


def sgd_optimizer(momentum: float = 0.0, weight_decay: float = 0.0) -> Callable:
    """``rate -> optax transformation``: SGD with heavy-ball ``momentum`` (0: none) and
    ``weight_decay`` wd added to the gradient before the momentum, as
    ``torch.optim.SGD(lr, momentum, weight_decay)`` (the thesis trains every baseline
    with 0.9 and 1e-4). Coupled like ``local_training``'s ``weight_decay``, and added
    after any gradient clip. The command line's ``--client-momentum`` /
    ``--client-weight-decay`` give it to every algorithm as ``client_optimizer``."""
    H.Range(0.0, 1.0, high_open=True).check("client_momentum", momentum)
    H.NONNEGATIVE.check("client_weight_decay", weight_decay)

    def optimizer(rate):
        sgd = optax.sgd(rate, momentum=momentum or None)
        return optax.chain(optax.add_decayed_weights(weight_decay), sgd) if weight_decay else sgd

    return optimizer


def make_optimizer(optimizer, learning_rate) -> optax.GradientTransformation:
    """``optimizer`` if it is an optax transformation (fixed, ignores the rate), else
    ``optimizer(learning_rate)`` (e.g. ``optax.sgd``)."""
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    return optimizer(learning_rate)


class ClientTraining(NamedTuple):
    """How a client trains locally: one value every FedAvg-style factory takes as
    ``training`` (as optax's aliases take a transformation and fedjax a
    ``client_optimizer``), so a factory states only its own hyper-parameters.

    Fields (the paper symbols of FedAvg, arXiv:1602.05629, Algorithm 1):
      lr: eta_l, a number (> 0), a (traced) JAX scalar — ``jax.vmap`` / ``jax.grad``
        through it — or a schedule ``round -> rate`` evaluated at the broadcast round.
      batch_size: B.
      num_epochs: E.
      max_steps: optional cap on the local steps; the static scan length is
        ``max_local_steps(M, B, E, max_steps)`` for padded size M.
      optimizer: ``rate -> optax transformation`` (None: ``optax.sgd``) or a fixed optax
        transformation (then ``lr`` is unused); fresh state for every client every round.
      weight_decay: wd >= 0, coupled L2: ``(wd / 2) ||theta||^2`` joins the batch loss,
        so every step adds ``wd * theta`` (all parameters); may be traced.
      clip_norm, clip_mode: every step's gradient clipped to global norm c > 0 (may be
        traced; None: off); "step" clips loss plus regularizer, "loss" the loss alone;
        weight decay is added after the clip (``local_sgd``).

    The defaults (rate 0.02, batch 10, one epoch: the default comparison's) are the
    library's one set of local-training defaults; a factory whose paper trains
    otherwise states its own ``ClientTraining`` as its default (A-FedPD's rate 0.1 and
    batch 50). ``FIELDS`` maps the flat names the command line and sweeps use
    (``client_lr``, ``client_optimizer``, the others as they are) to these fields.
    """

    lr: Any = 0.02
    batch_size: int = 10
    num_epochs: int = 1
    max_steps: Optional[int] = None
    optimizer: Any = None
    weight_decay: Any = 0.0
    clip_norm: Any = None
    clip_mode: str = "step"

    def check(self) -> "ClientTraining":
        """``self`` if every concrete field is allowed, else ``FieldError("training.F")``
        (``TypeError`` for an optimizer that is not one); traced values pass."""
        for name, rng in TRAINING_RANGES.items():
            value = getattr(self, name)
            if not (name == "lr" and (callable(value) or isinstance(
                    self.optimizer, optax.GradientTransformation))):  # a schedule; unused
                rng.check(f"training.{name}", value)
        if self.clip_mode not in CLIP_MODES:
            raise H.FieldError("training.clip_mode",
                               f"must be one of {CLIP_MODES}, got {self.clip_mode!r}")
        check_optimizer(self.optimizer, "training.optimizer")
        return self

    def with_flat(self, **flat) -> "ClientTraining":
        """This training with fields given by their flat names (``client_lr=0.02``)."""
        return self._replace(**{FIELDS[k]: v for k, v in flat.items()})


TRAINING_RANGES = {"lr": H.POSITIVE, "batch_size": H.COUNT, "num_epochs": H.COUNT,
                   "max_steps": H.Range(1, None, integer=True, nullable=True),
                   "weight_decay": H.NONNEGATIVE, "clip_norm": CLIP_NORM}
FIELDS = {"client_lr": "lr", "batch_size": "batch_size", "num_epochs": "num_epochs",
          "max_steps": "max_steps", "client_optimizer": "optimizer",
          "weight_decay": "weight_decay", "clip_norm": "clip_norm", "clip_mode": "clip_mode"}
"""Flat name (command line, sweeps, ``method_hparams``) -> ``ClientTraining`` field."""


def local_training(model: Model, training: ClientTraining = ClientTraining(), *,
                   regularizer: Optional[Callable] = None, start: Optional[Callable] = None,
                   finish: Optional[Callable] = None, unroll: int | bool | None = None,
                   track_loss: bool = True, loss_chunk_size: Optional[int] = None,
                   batch_loss: Optional[Callable] = None, sam_radius=None,
                   sam_eps=1e-2) -> ClientUpdate:
    """Builds a ClientUpdate running masked local optimisation.

    Args:
      model: the network.
      training: the local training (``ClientTraining``: rate, batch, epochs, step cap,
        optimizer, weight decay, clipping); checked here, before anything is traced.
      regularizer: optional ``(params, broadcast, client_state) -> scalar`` added to
        every batch loss.
      start: optional ``(broadcast, client_state) -> params``, the starting model
        (default ``broadcast.params``).
      finish: optional ``(LocalResult, broadcast, client_state, data, key) ->
        (new_client_state, extra)``; default: the state unchanged and no extra.
      unroll: ``lax.scan`` unroll of the local steps; None applies
        ``execution.local_step_unroll`` (full unroll for XLA convolutions on CPU).
      track_loss: compute ``loss_before`` = F_k(broadcast params) on all train rows
        (one forward pass; needed by loss-driven fair mixing rules).
      loss_chunk_size: rows per forward pass of that evaluation. None: 32 when the
        client runs alone on CPU (chunks of pure padding are skipped), else 256.
      batch_loss: optional ``(per_example_losses [B], batch_mask [B]) -> scalar``, the
        minibatch objective (default: the masked mean; see ``local_sgd``).
      sam_radius, sam_eps: SAM local steps of the methods built on SAM (FedSAM,
        A-FedPDSAM, FedSpeed; see ``local_sgd``); None: plain steps.
    """
    if not isinstance(training, ClientTraining):
        raise H.FieldTypeError("training", f"must be a ClientTraining, got "
                                           f"{describe_object(training)}")
    training.check()
    optimizer = optax.sgd if training.optimizer is None else training.optimizer
    client_lr = training.lr
    batch_size, num_epochs, max_steps = training.batch_size, training.num_epochs, training.max_steps
    weight_decay, clip_norm, clip_mode = training.weight_decay, training.clip_norm, training.clip_mode
    if unroll is None:
        unroll = execution.local_step_unroll(model.uses_xla_conv)
    if sam_radius is not None:
        H.NONNEGATIVE.check("sam_radius", sam_radius)
        H.POSITIVE.check("sam_eps", sam_eps)
    train = local_sgd(model, batch_size=batch_size, num_epochs=num_epochs,
                      max_steps=max_steps, regularizer=regularizer, unroll=unroll,
                      batch_loss=batch_loss, sam_radius=sam_radius, sam_eps=sam_eps,
                      weight_decay=weight_decay, clip_norm=clip_norm, clip_mode=clip_mode)

    initial_loss = loss_before_fn(model, loss_chunk_size)

    def client_update(broadcast: Broadcast, client_state, data: ClientData, local_steps, key):
        lr = round_value(client_lr, broadcast.round)
        init = broadcast.params if start is None else start(broadcast, client_state)
        # The training loop uses the client's key itself (as before the hooks
        # existed, so FedAvg-style iterates are unchanged); ``finish`` gets its own.
        params, num_steps, train_loss = train(init, make_optimizer(optimizer, lr), data,
                                              local_steps, key, (broadcast, client_state))
        delta = jax.tree.map(jnp.subtract, broadcast.params, params)
        loss_before = (initial_loss(broadcast.params, data) if track_loss
                       else jnp.zeros((), jnp.float32))
        if finish is None:
            new_state, extra = client_state, ()
        else:
            result = LocalResult(params, num_steps,
                                 None if isinstance(optimizer, optax.GradientTransformation)
                                 else lr, train_loss, local_steps)
            new_state, extra = finish(result, broadcast, client_state, data,
                                      jax.random.fold_in(key, FINISH_KEY_ID))
        output = ClientOutput(delta=delta, loss_before=loss_before,
                              num_examples=data.num_examples, num_steps=num_steps,
                              extra=extra, train_loss=train_loss)
        return output, new_state

    return client_update


def sq_distance(a, b):
    """||a - b||^2 summed over the leaves of two pytrees."""
    return sum(jnp.sum(jnp.square(x - y)) for x, y in zip(jax.tree.leaves(a),
                                                           jax.tree.leaves(b)))


def inner(a, b):
    """<a, b> summed over the leaves of two pytrees."""
    return sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def with_weight_decay(regularizer: Optional[Callable], weight_decay) -> Optional[Callable]:
    """``regularizer`` plus coupled L2 ``(wd / 2) ||theta||^2`` (gradient ``wd * theta``);
    ``regularizer`` itself when ``weight_decay`` is a concrete 0."""
    if not isinstance(weight_decay, jax.Array) and weight_decay == 0:
        return regularizer

    def regularized(params, *args):
        l2 = 0.5 * weight_decay * sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(params))
        return l2 if regularizer is None else regularizer(params, *args) + l2

    return regularized


def proximal_term(mu) -> Callable:
    """FedProx's (mu / 2) ||w - w^t||^2 as a ``regularizer`` (Li et al., 2020, eq. 2);
    ``mu`` may be a traced array (checked, >= 0, only when it is a concrete number)."""
    H.NONNEGATIVE.check("mu", mu)

    def regularizer(params, broadcast, client_state):
        del client_state
        return 0.5 * mu * sq_distance(params, broadcast.params)

    return regularizer
