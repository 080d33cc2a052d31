"""Curvature helpers shared by the second-order baselines (FedNL, FedNew).

A d x d Hessian is out of reach for a neural network, so both methods work with its
diagonal, estimated from Hessian-vector products (HVPs). Everything is built on one
linearisation of the gradient, ``(loss, grad), hvp = jax.linearize(value_and_grad(f),
theta)``: ``hvp(v) = H v`` then costs one forward-over-reverse pass and no second
linearisation, whatever the number of products.

* ``hutchinson_diagonal``: Hutchinson's estimator diag(H) ~ (1/P) sum_p z_p * H z_p
  with Rademacher probes z_p (E[z z^T] = I, so E[z * Hz] = diag H exactly; one probe is
  exact when H is diagonal, since z * z = 1). Unbiased, O(P) HVPs, O(d) memory.
* ``exact_diagonal``: H_jj = e_j . H e_j, d HVPs (in chunks of ``chunk_size``): exact,
  affordable for small models only (logistic regression on low-dimensional inputs).
* ``curvature="auto"`` takes the exact diagonal up to ``EXACT_MAX_PARAMS``
  parameters, else Hutchinson's.

``client_derivatives`` is what a second-order client computes at the broadcast model:
its masked-mean training loss, a gradient (the exact full-batch gradient, or the
pseudo-gradient of local SGD: ``mode`` as in DQN-Fed) and the diagonal curvature on all
its rows or on ``curvature_rows`` of them drawn afresh every round.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from fedjax_fair.core.client import (ClientTraining, check_rate_optimizer, data_loss,
                                     epoch_order, local_sgd, make_optimizer, round_value)
from fedjax_fair.core.types import ClientData
from fedjax_fair.hparams import FieldError

CURVATURES = ("auto", "exact", "hutchinson")
MODES = ("grad_at_global", "pseudo_grad")
EXACT_MAX_PARAMS = 64  # "auto": the exact diagonal up to this many parameters (d HVPs each)
EXACT_CHUNK = 128  # basis vectors per vmapped batch of the exact diagonal


def choice(field: str, value, allowed) -> None:
    """A ``field: must be one of ...`` ValueError for a categorical argument."""
    if value not in allowed:
        raise FieldError(field, f"must be one of {allowed}, got {value!r}")


def num_params(params) -> int:
    return sum(math.prod(jnp.shape(x)) for x in jax.tree.leaves(params))


def resolve_curvature(curvature: str, params) -> str:
    """"exact" or "hutchinson" (``"auto"``: exact up to ``EXACT_MAX_PARAMS``)."""
    choice("curvature", curvature, CURVATURES)
    if curvature == "auto":
        return "exact" if num_params(params) <= EXACT_MAX_PARAMS else "hutchinson"
    return curvature


def hvp(fn: Callable, params, v):
    """H v for the Hessian H of the scalar ``fn`` at ``params`` (forward-over-reverse)."""
    return jax.jvp(jax.grad(fn), (params,), (v,))[1]


def rademacher_like(key, tree):
    """A pytree of independent +-1 entries shaped like ``tree`` (its dtypes), drawn
    with one call to the generator (one threefry op for the whole tree)."""
    flat, unravel = ravel_pytree(tree)
    bits = jax.random.bits(key, flat.shape, jnp.uint32)
    return unravel((2 * (bits & 1).astype(flat.dtype) - 1).astype(flat.dtype))


def hutchinson_from_hvp(hvp_fn: Callable, params, key, num_probes: int = 1):
    """(1/P) sum_p z_p * hvp_fn(z_p), z_p Rademacher from ``fold_in(key, p)``; the
    probes are accumulated in a ``lax.scan`` (O(d) memory)."""

    def probe(total, p):
        z = rademacher_like(jax.random.fold_in(key, p), params)
        return jax.tree.map(lambda t, zz, hz: t + zz * hz, total, z, hvp_fn(z)), None

    total, _ = jax.lax.scan(probe, jax.tree.map(jnp.zeros_like, params),
                            jnp.arange(num_probes))
    # a division, not optax.tree.scale(1 / P, .): that would round differently
    return jax.tree.map(lambda t: t / num_probes, total)


def exact_from_hvp(hvp_fn: Callable, params, chunk_size: int = EXACT_CHUNK):
    """diag(H)_j = e_j . hvp_fn(e_j) for every coordinate j: d products, vmapped in
    equal chunks of at most ``chunk_size`` (the last index repeated to fill the last
    chunk, so one vmapped program serves every chunk)."""
    flat, unravel = ravel_pytree(params)
    d = flat.shape[0]
    num_chunks = math.ceil(d / chunk_size)
    size = math.ceil(d / num_chunks)

    def entry(j):
        e = jnp.zeros((d,), flat.dtype).at[j].set(1)
        return ravel_pytree(hvp_fn(unravel(e)))[0][j]

    index = jnp.minimum(jnp.arange(num_chunks * size), d - 1)
    return unravel(jax.lax.map(entry, index, batch_size=size)[:d])


def hutchinson_diagonal(fn: Callable, params, key, num_probes: int = 1):
    """Hutchinson's estimate of diag(Hessian of ``fn``) at ``params``."""
    _, lin = jax.linearize(jax.grad(fn), params)
    return hutchinson_from_hvp(lin, params, key, num_probes)


def exact_diagonal(fn: Callable, params, chunk_size: int = EXACT_CHUNK):
    """The exact diagonal of the Hessian of ``fn`` at ``params`` (d HVPs)."""
    _, lin = jax.linearize(jax.grad(fn), params)
    return exact_from_hvp(lin, params, chunk_size)


def value_grad_diagonal(fn: Callable, params, *, curvature: str, key=None,
                        num_probes: int = 1):
    """(fn, grad fn, diag Hessian) at ``params`` from one linearisation;
    ``curvature`` "exact" or "hutchinson" (``resolve_curvature``)."""
    (value, grad), lin = jax.linearize(jax.value_and_grad(fn), params)
    hvp_fn = lambda v: lin(v)[1]
    if curvature == "exact":
        diag = exact_from_hvp(hvp_fn, params)
    else:
        diag = hutchinson_from_hvp(hvp_fn, params, key, num_probes)
    return value, grad, diag


def row_subset(data: ClientData, key, size: Optional[int]) -> ClientData:
    """``size`` of the client's real rows drawn at random (all of them if it has
    fewer), as a padded ``ClientData`` of ``size`` rows; ``data`` itself if ``size``
    is None or not smaller than its padded size."""
    if size is None or size >= data.mask.shape[0]:
        return data
    rows = epoch_order(data, key, 0, 1)[:size]
    n = jnp.minimum(data.num_examples, size)
    return ClientData(examples={k: v[rows] for k, v in data.examples.items()},
                      mask=jnp.arange(size) < n, num_examples=n)


def tree_norm(tree):
    """||tree||_2 over all leaves (``optax.tree.norm``: per-leaf sums of squares added in
    leaf order, as the hand-written version did)."""
    return optax.tree.norm(tree)


class Derivatives(NamedTuple):
    """What a second-order client measures at the broadcast model theta^t.

    loss: F_k(theta^t), masked mean over all its rows.
    delta: theta^t - theta_k: the local SGD delta (mode "pseudo_grad"), or the delta
      eta_l g_k of one gradient step at the client rate (mode "grad_at_global").
    grad_scale: [] 1 / (eta_l max(tau_k, 1)), so that ``grad = grad_scale * delta`` is
      the gradient g_k ("grad_at_global") or the pseudo-gradient
      (theta^t - theta_k^E) / (eta_l tau_k) ("pseudo_grad").
    diag: the diagonal curvature estimate at theta^t.
    num_steps: local steps taken (1 for a client with data in "grad_at_global").
    train_loss: mean loss over the last local epoch (F_k(theta^t) without training).
    """

    loss: jax.Array
    delta: object
    grad_scale: jax.Array
    diag: object
    num_steps: jax.Array
    train_loss: jax.Array

    @property
    def grad(self):
        return optax.tree.scale(self.grad_scale, self.delta)


CURVATURE_KEY_ID = 1  # Hutchinson probes and row subsets: fold_in(client key, 1)


def client_derivatives(model, *, curvature: str = "auto", num_probes: int = 1,
                       curvature_rows: Optional[int] = None, mode: str = "grad_at_global",
                       training: ClientTraining = ClientTraining()) -> Callable:
    """``derive(broadcast, data, local_steps, key) -> Derivatives`` at theta^t.

    The curvature is the diagonal of the Hessian of the masked mean loss, on all of
    the client's rows (``curvature_rows`` None) or a random subset, exact or by
    Hutchinson with ``num_probes`` Rademacher probes (keys from
    ``fold_in(key, CURVATURE_KEY_ID)``). In "grad_at_global" mode the gradient comes
    from the same linearisation (on all rows). In "pseudo_grad" mode the client also
    runs FedAvg's masked local SGD (``training``: rate eta_l, batch, epochs, step cap,
    its step budget; ``training.optimizer`` a ``rate -> transformation``, default
    ``optax.sgd``; weight decay; gradient clipping) with the client key and reports
    g_k = (theta^t - theta_k) / (eta_l max(tau_k, 1)). "grad_at_global" uses only
    ``training.lr`` (g_k's scale).
    """
    training.check()
    choice("mode", mode, MODES)
    choice("curvature", curvature, CURVATURES)
    if mode == "pseudo_grad":
        check_rate_optimizer(training.optimizer, "the pseudo-gradient")
    train = local_sgd(model, batch_size=training.batch_size, num_epochs=training.num_epochs,
                      max_steps=training.max_steps, weight_decay=training.weight_decay,
                      clip_norm=training.clip_norm, clip_mode=training.clip_mode)
    client_lr = training.lr
    optimizer = training.optimizer or optax.sgd

    def derive(broadcast, data: ClientData, local_steps, key) -> Derivatives:
        theta = broadcast.params
        kind = resolve_curvature(curvature, theta)
        curv_key = jax.random.fold_in(key, CURVATURE_KEY_ID)
        subset_key, probe_key = jax.random.split(curv_key)
        rows = row_subset(data, subset_key, curvature_rows)
        loss_on = lambda d: (lambda p: data_loss(model, p, d))
        value, grad, diag = value_grad_diagonal(loss_on(rows), theta, curvature=kind,
                                                key=probe_key, num_probes=num_probes)
        if rows is not data:  # the loss and the gradient on all rows
            value, grad = jax.value_and_grad(loss_on(data))(theta)
        lr = jnp.asarray(round_value(client_lr, broadcast.round), jnp.float32)
        if mode == "grad_at_global":
            steps = (data.num_examples > 0).astype(jnp.int32)
            return Derivatives(value, optax.tree.scale(lr, grad), 1.0 / lr, diag,
                               steps, value)
        local, steps, train_loss = train(theta, make_optimizer(optimizer, lr), data,
                                         local_steps, key)
        delta = optax.tree.sub(theta, local)
        scale = 1.0 / (lr * jnp.maximum(steps, 1).astype(jnp.float32))
        return Derivatives(value, delta, scale, diag, steps, train_loss)

    return derive
