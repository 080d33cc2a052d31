"""FedEvg — Hahn, "Algorithms for Collaborative Machine Learning under Statistical
Heterogeneity", PhD thesis, UNIST 2024, Chapter IV ("Federated Synthetic Data
Generation through Energy-based Composition").

The server holds M labelled synthetic samples D~ = {(x~_j, y~_j)} and never receives
parameters. Every round each selected client trains a fresh classifier f(.; theta_i)
(its logits are an energy-based model, E(x, y; theta) = -f(x; theta)[y]) with a
persistent-contrastive-divergence + cross-entropy loss whose negatives are short SGLD
chains started at the downloaded synthetic samples, then uploads, at every synthetic
sample, the energy gradient and an exponentiated signed energy:

    g_ij = grad_x E(x~_j, y~_j; theta_i) = -grad_x f(x~_j; theta_i)[y~_j],
    s_ij = exp(sign(f(x~_j; theta_i)[y~_j])) in {e^-1, 1, e}     ("Note on the Energy Value").

The server combines them into the energy gradient of the mixture sum_i w_i p(x; theta_i)
(eq. 4.13 with the signed weights, w_i = n_i / n over the cohort)

    G_j = sum_i w_i s_ij g_ij / sum_i w_i s_ij,

and takes one SGLD step per round (eq. 4.14), x~ <- clip(x~ - beta_t G + delta eps).
Client SGLD (eq. 4.9, Alg. 4.2 line 11): R steps x <- x + gamma clip(grad_x f[y]) + sigma eps,
i.e. it descends the energy, with the samples clipped to the data range once after the
chain (``sample_clip="chain"``: the authors' sampler) or after every step
(``"step"``); the thesis clips neither the gradient nor the samples. For R = 1 (the
default) the two coincide. PCD loss with the corrected sign (Alg. 4.2 line 13 has it flipped):
L_pcd = E(x_real, y) - E(x_neg, y~) = -f(x_real)[y] + f(x_neg)[y~] (batch means).

Symbols -> arguments: M = ``num_synth`` (default 10 L, class-balanced deterministic
labels [0]*spc + [1]*spc + ...), lambda = ``ce_weight``, E (local iterations) =
``local_iters`` (None: ``training.num_epochs`` epochs over each client's own rows, the reference
code's epoch mode with per-client step masking; an int: that many iterations for every
client, the thesis' reading; ``mean_epoch_iters`` gives ceil(mean n_i / B), about one epoch),
R = ``client_sgld_steps``, gamma = ``client_step``, sigma = ``client_noise``, beta_0 /
beta_{T-1} = ``server_step`` / ``server_step_end`` on the ``schedule``
("ddpm_cosine_beta" | "cosine_alphabar", ``server_steps``) over T = ``num_rounds``,
delta = ``server_noise``, the energy-gradient clip c = ``grad_clip`` (None: off), the
sample range [lo, hi] = ``data_range`` (None: no clipping) applied per ``sample_clip``, eta =
``training.lr`` (Adam; a number, a traced scalar or a schedule of the round), coupled L2
``training.weight_decay`` (also the server classifier's), optional global gradient-norm
clip ``max_grad_norm``, B = ``training.batch_size`` (defaults ``TRAINING``; the local
training is FedEvg's own loop, which honours only ``TRAINING_FIELDS``); the
ablations ``energy_weighting`` ("signed_exp" | "exp" | "uniform"; "exp" is the exact eq. 4.13) and
``ce_on_initial_synth`` (the reference code's reading); ``persistent_client_model`` keeps each client's
classifier in a per-client table (``client_table``) instead of re-initialising it.

What the runner evaluates. FedEvg has no global model: its product is D~. So that
``runner.run``'s per-client test accuracy of ``state.params`` means something, the
server keeps a classifier of the model's architecture in ``state.params`` and trains it,
warm-started, for ``server_classifier_steps`` Adam steps (rate ``server_classifier_lr``,
minibatches of min(B, M) distinct synthetic samples) on the updated D~ after every
server step. The runner's accuracy is then the downstream accuracy (Tables 4.2-4.3) of a
classifier trained on D~ so far; 0 steps leaves ``state.params`` at its initial value
(only D~ evolves). The thesis's end-of-run protocol (a *fresh* classifier trained on D~
only) is ``downstream_accuracy``.

The round is ``compose``d (core/algorithm.py): the broadcast is D~, each client's
``ClientOutput.delta`` is its ``Upload`` (it sends no parameters), and the aggregator is
the server: it keeps ``ServerSide(x, y, classifier_opt_state)`` in
``state.aggregator_state`` (``synthetic_data(state)``; D~^(0) drawn at ``init`` from
``jax.random.key(seed)``, eq. 4.12), takes the SGLD step and returns the classifier's
change theta^t - theta^{t+1} as the direction the server step sgd(1.0) applies. Round
keys follow the engine: client k uses ``fold_in(key, k)``, the server
``fold_in(key, SERVER_KEY_ID)``.

Public pieces: ``server_steps`` (schedule), ``signed_weights`` / ``log_energy_weights``,
``mixture_weights`` / ``mixture_gradient`` (eq. 4.13), ``server_sgld_step`` (eq. 4.14),
``client_sgld`` (eq. 4.9), ``pcd_loss``, ``energy_and_grad`` (the upload's per-sample
values and gradients), ``make_client_update`` (one client, Alg. 4.2), ``init_synthetic``
(eq. 4.12), ``mean_epoch_iters``. The synthetic set's accessors and evaluation, shared
with FedCVAE, are in ``fedjax_fair.algorithms.families.generative``: ``synthetic_data``,
``synthetic_federation``, ``downstream_accuracy`` / ``downstream_report`` (Tables 4.2-4.3),
``feature_distance`` (Tables 4.4-4.5) and ``plot_sample_grid``.

Traced (vmappable / differentiable): ``ce_weight``, ``client_step``, ``client_noise``,
``server_step``, ``server_step_end``, ``server_noise``, ``grad_clip``, ``data_range``
bounds, ``training.lr``, ``training.weight_decay``, ``max_grad_norm``,
``server_classifier_lr``.
Static: counts, ``num_rounds``, ``schedule``, the flags and choices.
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_fair import hparams as H
from fedjax_fair.core.aggregators import Aggregator
from fedjax_fair.core.algorithm import FederatedAlgorithm, cohort_train_loss, compose
from fedjax_fair.core.client import (ClientTraining, data_loss, describe_object, masked_mean,
                                     masked_steps, round_value)
from fedjax_fair.core.execution import local_step_unroll, loss_chunk_size_here
from fedjax_fair.models.base import Model, cross_entropy
from fedjax_fair.algorithms.families.generative import (SyntheticSet, balanced_labels,
                                                        check_data_range, classifier_direction,
                                                        classifier_optimizer, downstream_line,
                                                        downstream_report)
from fedjax_fair.core.types import Broadcast, ClientData, ClientOutput
from fedjax_fair.algorithms.registry import register

Rate = Union[float, Callable]  # a number, a traced scalar, or a schedule of the round

SCHEDULES = ("ddpm_cosine_beta", "cosine_alphabar")
ENERGY_WEIGHTINGS = ("signed_exp", "exp", "uniform")
COSINE_OFFSET = 0.008  # s of Nichol & Dhariwal's cosine schedule

HPARAMS = {
    "num_synth": H.Range(1, None, integer=True, nullable=True),
    "ce_weight": H.NONNEGATIVE,
    "local_iters": H.Range(1, None, integer=True, nullable=True),
    "client_sgld_steps": H.Range(0, None, integer=True),
    "client_step": H.NONNEGATIVE,
    "client_noise": H.NONNEGATIVE,
    "server_step": H.NONNEGATIVE,
    "server_step_end": H.NONNEGATIVE,
    "server_noise": H.NONNEGATIVE,
    "num_rounds": H.COUNT,
    "grad_clip": H.Range(0.0, None, low_open=True, nullable=True),
    "max_grad_norm": H.Range(0.0, None, low_open=True, nullable=True),
    "server_classifier_steps": H.Range(0, None, integer=True),
    "server_classifier_lr": H.POSITIVE,
    "seed": H.Range(0, None, integer=True),
}
# FedEvg's client training (its defaults before ``training`` existed; the module
# docstring): Adam at rate 1e-3 with coupled weight decay 1e-4, batch 64, one epoch.
TRAINING = ClientTraining(lr=1e-3, batch_size=64, weight_decay=1e-4)
TRAINING_FIELDS = ("client_lr", "batch_size", "num_epochs", "weight_decay")
"""The ``ClientTraining`` fields (flat names) FedEvg's own local loop honours; the others
(max_steps, client_optimizer, clip_norm, clip_mode) must keep their defaults (its
optimizer is Adam, its clip ``max_grad_norm``)."""


class Upload(NamedTuple):
    """One client's upload for the M synthetic samples.

    g: [M, *X] energy gradients grad_x E(x~_j, y~_j; theta_i) (clipped to +-c).
    log_s: [M] log of the client's energy weight: sign(f_y) ("signed_exp", so
      s = exp(log_s) in {e^-1, 1, e}), f_y ("exp") or 0 ("uniform"). The server works
      with the logarithm so that the unsigned ablation cannot overflow.
    """

    g: jax.Array
    log_s: jax.Array

    @property
    def s(self) -> jax.Array:
        """The exponentiated (signed) energies the thesis uploads."""
        return jnp.exp(self.log_s)


class ServerSide(NamedTuple):
    """FedEvg's server (``state.aggregator_state``): D~ (x [M, *X], y int32 [M]) and the
    server classifier's Adam state."""

    x: jax.Array
    y: jax.Array
    classifier_opt_state: Any


class ClientModel(NamedTuple):
    """A persistent client's row (``persistent_client_model``): its classifier and
    whether it has trained yet (its first visit starts from a fresh model)."""

    params: Any
    trained: jax.Array  # bool []


CLIENT_METRICS = ("ce", "pcd", "acc")  # per client, logged as client/NAME


# ----------------------------------------------------------------- pure pieces


def init_synthetic(key, num_synth: int, num_classes: int, input_shape) -> SyntheticSet:
    """D~^(0): x~ ~ N(0, I_D) (eq. 4.12) and balanced labels."""
    x = jax.random.normal(key, (num_synth, *tuple(input_shape)), jnp.result_type(float))
    return SyntheticSet(x, balanced_labels(num_synth, num_classes))


def _alphabar(num_rounds: int, s: float = COSINE_OFFSET) -> np.ndarray:
    """alpha-bar(u), u = 0..T (float64 [T + 1]), of the cosine schedule."""
    u = np.arange(num_rounds + 1, dtype=np.float64)
    f = np.cos((u / num_rounds + s) / (1 + s) * np.pi / 2) ** 2
    return f / f[0]


def server_steps(num_rounds: int, beta_0, beta_end, schedule: str = "ddpm_cosine_beta"):
    """The server SGLD step sizes beta_t, t = 0..T-1 ([T]; eq. 4.14).

    "ddpm_cosine_beta" ([ref-code]): b_t = 1 - alphabar(t+1) / alphabar(t) rises from
    ~9e-5 to 1, beta_t = (1 - b_t) beta_0 + b_t beta_end (= beta_0 + b_t (beta_end -
    beta_0), written so that b = 1 gives beta_end exactly).
    "cosine_alphabar": beta_t = beta_end + (beta_0 - beta_end) a_t with a_t = alphabar(t)
    rescaled to a_0 = 1, a_{T-1} = 0, so that beta_{T-1} = beta_end exactly (the
    rescaling moves the other values by less than 1e-5 (beta_0 - beta_end)).
    ``num_rounds`` is static; ``beta_0`` / ``beta_end`` may be traced.
    """
    if schedule not in SCHEDULES:
        raise H.FieldError("schedule", f"must be one of {SCHEDULES}, got {schedule!r}")
    num_rounds = int(num_rounds)
    if num_rounds < 1:
        raise H.FieldError("num_rounds", f"must be an integer >= 1, got {num_rounds}")
    ab = _alphabar(num_rounds)
    if schedule == "ddpm_cosine_beta":
        frac = np.clip(1.0 - ab[1:] / ab[:-1], 0.0, 1.0)
    elif num_rounds == 1:
        frac = np.ones((1,))
    else:
        a = ab[:-1]
        frac = 1.0 - (a - a[-1]) / (a[0] - a[-1])
    dtype = jnp.result_type(beta_0, beta_end, float)
    frac = jnp.asarray(frac, dtype)
    return (1.0 - frac) * beta_0 + frac * beta_end


def signed_weights(f_y):
    """exp(sign(f(x~)[y~])) in {e^-1, 1, e} (the thesis' stabilised energy weight)."""
    return jnp.exp(jnp.sign(f_y))


def log_energy_weights(f_y, mode: str = "signed_exp"):
    """log s of ``Upload``: sign(f_y), f_y or 0 (``ENERGY_WEIGHTINGS``)."""
    if mode == "signed_exp":
        return jnp.sign(f_y)
    if mode == "exp":
        return f_y
    if mode == "uniform":
        return jnp.zeros_like(f_y)
    raise H.FieldError("energy_weighting", f"must be one of {ENERGY_WEIGHTINGS}, got {mode!r}")


def mixture_weights(log_s, weights):
    """p_sj = w_s s_sj / sum_r w_r s_rj over the cohort ([S, M]); clients with weight
    w_s = 0 (empty or masked) get p = 0, and a sample no client weighs gets p = 0 for
    all (so G_j = 0, never NaN). Computed as a softmax of log w_s + log s_sj."""
    weights = jnp.asarray(weights)
    valid = weights > 0
    log_w = jnp.log(jnp.where(valid, weights, 1.0)).astype(log_s.dtype)
    logits = jnp.where(valid[:, None], log_w[:, None] + log_s, -jnp.inf)
    top = jnp.max(logits, axis=0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    e = jnp.where(valid[:, None], jnp.exp(logits - top[None]), 0.0)
    return e / jnp.maximum(jnp.sum(e, axis=0), jnp.finfo(e.dtype).tiny)[None]


def mixture_gradient(g, log_s, weights):
    """Eq. 4.13 with the uploaded weights: G_j = sum_s p_sj g_sj ([M, *X]), p from
    ``mixture_weights``. With ``log_s = f_y`` ("exp") this is the exact gradient of
    E_mix(x) = -log sum_s w_s exp(-E_s(x)) (equal normalisers)."""
    p = mixture_weights(log_s, weights).astype(g.dtype)
    p = p.reshape(p.shape + (1,) * (g.ndim - 2))
    return jnp.sum(jnp.where(p > 0, p * g, 0.0), axis=0)  # weight-0 uploads never leak


def _clip_range(x, data_range):
    if data_range is None:
        return x
    return jnp.clip(x, data_range[0], data_range[1])


def server_sgld_step(x, grad, beta, delta, key, data_range=(0.0, 1.0)):
    """Eq. 4.14: clip(x - beta G + delta eps, lo, hi), eps ~ N(0, I)."""
    noise = jax.random.normal(key, x.shape, x.dtype)
    return _clip_range(x - beta * grad + delta * noise, data_range)


def _pick(logits, y):
    return jnp.take_along_axis(logits, y[:, None], axis=1)[:, 0]


def energy_and_grad(apply: Callable, params, x, y):
    """(f(x; theta)[y] [M], grad_x sum_j f(x_j; theta)[y_j] [M, *X]).

    One backward pass; the rows of the gradient are the per-sample gradients only when
    the network treats samples independently (GroupNorm / no normalisation, never batch
    statistics)."""
    def f_y(x):
        return _pick(apply(params, x), y)

    values, vjp = jax.vjp(f_y, x)
    (grad,) = vjp(jnp.ones_like(values))
    return values, grad


def _clip_grad(grad, grad_clip):
    return grad if grad_clip is None else jnp.clip(grad, -grad_clip, grad_clip)


SAMPLE_CLIPS = ("chain", "step")


def client_sgld(apply: Callable, params, x, y, key, *, steps: int, step_size, noise,
                grad_clip=3.0, data_range=(0.0, 1.0), sample_clip: str = "chain"):
    """R client SGLD steps on stop_gradient(theta) (Alg. 4.2 line 11, eq. 4.9):
    x <- x + gamma clip(grad_x f(x)[y], +-c) + sigma eps, descending the energy
    E = -f[y]; the r-th step's noise is drawn from ``fold_in(key, r)``. The samples are
    clipped to [lo, hi] once after the R steps (``sample_clip="chain"``, the authors'
    sampler) or after every step (``"step"``); identical for R = 1."""
    params = jax.lax.stop_gradient(params)
    per_step = data_range if sample_clip == "step" else None

    def step(r, x):
        _, gx = energy_and_grad(apply, params, x, y)
        eps = jax.random.normal(jax.random.fold_in(key, r), x.shape, x.dtype)
        return _clip_range(x + step_size * _clip_grad(gx, grad_clip) + noise * eps, per_step)

    if steps <= 0:
        return x
    x = jax.lax.fori_loop(0, steps, step, x)
    return x if sample_clip == "step" else _clip_range(x, data_range)


def pcd_from_logits(logits_real, y_real, mask, logits_neg, y_neg):
    """L_pcd = mean E(x_real, y) - mean E(x_neg, y~) = -mean f(x_real)[y] + mean
    f(x_neg)[y~] (the thesis' Alg. 4.2 line 13 has the sign flipped), the
    real mean over the rows where ``mask`` is True."""
    return -masked_mean(_pick(logits_real, y_real), mask) + jnp.mean(_pick(logits_neg, y_neg))


def pcd_loss(apply: Callable, params, x_real, y_real, mask, x_neg, y_neg):
    """``pcd_from_logits`` of the network ``apply(params, .)``."""
    return pcd_from_logits(apply(params, x_real), y_real, mask, apply(params, x_neg), y_neg)


def mean_epoch_iters(train: ClientData, batch_size: int) -> int:
    """ceil(mean_i n_i / B) over the clients of a (host or device) split: the
    default ``local_iters`` (about one epoch; Alg. 4.2 counts iterations)."""
    n = np.asarray(train.num_examples, np.float64)
    return max(1, math.ceil(float(n.mean()) / batch_size))


# ----------------------------------------------------------------- client update


class ClientConfig(NamedTuple):
    """The static and traced settings of ``make_client_update``."""

    ce_weight: object = 0.1
    local_iters: Optional[int] = None
    num_epochs: int = 1
    client_sgld_steps: int = 1
    client_step: object = 1.0
    client_noise: object = 0.01
    grad_clip: object = 3.0
    data_range: object = (0.0, 1.0)
    sample_clip: str = "chain"
    weight_decay: object = 1e-4
    max_grad_norm: object = None
    batch_size: int = 64
    energy_weighting: str = "signed_exp"
    ce_on_initial_synth: bool = False
    unroll: Union[int, bool] = 1


def make_client_update(model: Model, cfg: ClientConfig) -> Callable:
    """ONE client's FedEvg update (Alg. 4.2, client side):

    ``update(x_syn, y_syn, data, local_steps, key, lr, params) -> (Upload, metrics,
    params)``: local training of the classifier ``params`` (the fresh initialisation,
    or the client's persistent model) from the downloaded D~, then the upload at the
    downloaded samples with the final theta. Local iteration (a ``lax.scan``, masked
    past the client's count, ``client.masked_steps``): a real minibatch; a synthetic
    minibatch of min(B, M) distinct indices j of the local chain buffer; R SGLD steps
    from it; one Adam step on L_pcd + CE(real) + lambda CE(synthetic); buffer[j] <- the
    SGLD samples. ``metrics``: mean real cross-entropy ``ce``, ``pcd`` loss and real
    ``acc`` over the steps taken, ``num_steps``, ``train_loss`` (the last epoch's mean
    real cross-entropy).
    """
    apply = model.apply

    def update(x_syn, y_syn, data: ClientData, local_steps, key, lr, params):
        m = x_syn.shape[0]
        bs = min(cfg.batch_size, m)
        optimizer = classifier_optimizer(lr, cfg.weight_decay, cfg.max_grad_norm)

        def loss_fn(params, batch, batch_mask, x_neg, x_ce, y_b):
            logits = apply(params, batch["x"])
            ce_rows = cross_entropy(logits, batch["y"])
            ce_real = masked_mean(ce_rows, batch_mask)
            pcd = pcd_from_logits(logits, batch["y"], batch_mask, apply(params, x_neg), y_b)
            ce_syn = jnp.mean(cross_entropy(apply(params, x_ce), y_b))
            acc = masked_mean((jnp.argmax(logits, -1) == batch["y"]).astype(ce_real.dtype),
                              batch_mask)
            total = pcd + ce_real + cfg.ce_weight * ce_syn
            return total, (ce_real, pcd, acc, jnp.sum(jnp.where(batch_mask, ce_rows, 0.0)))

        def step(carry, batch, batch_mask, step_key):
            params, opt_state, buf, sums = carry
            k_s, k_n = jax.random.split(step_key)
            j = jax.random.permutation(k_s, m)[:bs]
            x_b, y_b = buf[j], y_syn[j]
            x_neg = jax.lax.stop_gradient(client_sgld(
                apply, params, x_b, y_b, k_n, steps=cfg.client_sgld_steps,
                step_size=cfg.client_step, noise=cfg.client_noise, grad_clip=cfg.grad_clip,
                data_range=cfg.data_range, sample_clip=cfg.sample_clip))
            x_ce = x_syn[j] if cfg.ce_on_initial_synth else x_b
            grads, (ce, pcd, acc, ce_sum) = jax.grad(loss_fn, has_aux=True)(
                params, batch, batch_mask, x_neg, x_ce, y_b)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            buf = buf.at[j].set(x_neg.astype(buf.dtype))
            sums = sums + jnp.stack([ce, pcd, acc]).astype(sums.dtype)
            return (params, opt_state, buf, sums), ce_sum

        if cfg.local_iters is None:
            epochs, cap = cfg.num_epochs, None
        else:  # exactly I iterations (epochs enough for a one-batch client), capped at I
            epochs, cap = cfg.local_iters, cfg.local_iters
        carry = (params, optimizer.init(params), x_syn, jnp.zeros((3,), jnp.float32))
        (params, _, _, sums), num_steps, train_loss = masked_steps(
            step, carry, data, local_steps, key, batch_size=cfg.batch_size,
            num_epochs=epochs, max_steps=cap, unroll=cfg.unroll)

        f_y, grad = energy_and_grad(apply, params, x_syn, y_syn)
        upload = Upload(g=_clip_grad(-grad, cfg.grad_clip),
                        log_s=log_energy_weights(f_y, cfg.energy_weighting))
        mean = sums / jnp.maximum(num_steps, 1).astype(sums.dtype)
        metrics = {"ce": mean[0], "pcd": mean[1], "acc": mean[2], "num_steps": num_steps,
                   "train_loss": train_loss}
        return upload, metrics, params

    return update


# ----------------------------------------------------------------- server classifier


# ----------------------------------------------------------------- the algorithm


def check_training(training) -> ClientTraining:
    """``training`` checked (``ClientTraining.check``) after refusing, with
    ``FieldError("training.F")``, a field FedEvg's local loop does not use
    (max_steps, optimizer, clip_norm, clip_mode) set to other than its default."""
    if not isinstance(training, ClientTraining):
        raise H.FieldTypeError("training", f"must be a ClientTraining, got "
                                           f"{describe_object(training)}")
    default = ClientTraining()
    for field in ("max_steps", "optimizer", "clip_norm", "clip_mode"):
        value, usual = getattr(training, field), getattr(default, field)
        if value is not usual and (usual is None or value != usual):
            raise H.FieldError(f"training.{field}", f"must stay {usual!r}, got "
                               f"{describe_object(value)}: FedEvg's local training does not "
                               f"use it (its optimizer is Adam, its clip max_grad_norm)")
    return training.check()


def fedevg(model: Model, *, num_synth: Optional[int] = None, ce_weight: float = 0.1,
           local_iters: Optional[int] = None,
           client_sgld_steps: int = 1, client_step: float = 1.0, client_noise: float = 0.01,
           server_step: float = 10.0, server_step_end: float = 0.01,
           server_noise: float = 0.01, schedule: str = "ddpm_cosine_beta",
           num_rounds: int = 500, grad_clip: Optional[float] = 3.0,
           data_range: Optional[tuple] = (0.0, 1.0), sample_clip: str = "chain",
           training: ClientTraining = TRAINING, max_grad_norm: Optional[float] = None,
           energy_weighting: str = "signed_exp",
           ce_on_initial_synth: bool = False, persistent_client_model: bool = False,
           client_table: str = "dense", server_classifier_steps: int = 10,
           server_classifier_lr: float = 1e-3, seed: int = 0) -> FederatedAlgorithm:
    """FedEvg: federated energy-based synthetic-data generation (see the module
    docstring for the symbols).

    ``training``: the clients' rate, batch, epochs and weight decay (``TRAINING_FIELDS``;
    a step cap, optimizer or clipping is a ``FieldError``: the loop is FedEvg's own).
    ``init(params, N)``: ``params`` initialises the server classifier (``state.params``)
    and, with ``persistent_client_model``, the shape of the per-client table; D~^(0) is
    drawn from ``jax.random.key(seed)``. ``apply(state, cohort, key, execution)``:
    one round (any execution strategy). ``client_rows(state, ids)``: the persistent
    clients' ``ClientModel`` rows.

    Round metrics: ``compose``'s (per client [K] ``client_ids``, ``client_mask``,
    ``weights`` (n_i over the cohort's n; 0 for masked rows), ``num_steps``,
    ``loss_before`` (the server classifier's loss on the client's rows before the
    round); scalars ``train_loss`` (their n-weighted mean, as for every method) and
    ``update_norm`` (||theta^t - theta^{t+1}||, the server classifier's change)); per
    client ``client/ce``, ``client/pcd``, ``client/acc`` (means over the local
    iterations); ``client_train_loss`` (the clients' n-weighted last-epoch real
    cross-entropy); the server's ``server/grad_norm`` (||G||), ``server/beta``,
    ``server/frac_s_positive`` (share of uploads with s = e),
    ``server/synthetic_change`` (||x~^{t+1} - x~^t||), ``server/classifier_loss`` and
    ``server/synthetic_accuracy`` (the server classifier on D~^{t+1}).
    """
    H.check(HPARAMS, num_synth=num_synth, ce_weight=ce_weight, local_iters=local_iters,
            client_sgld_steps=client_sgld_steps,
            client_step=client_step, client_noise=client_noise, server_step=server_step,
            server_step_end=server_step_end, server_noise=server_noise,
            num_rounds=num_rounds, grad_clip=grad_clip, max_grad_norm=max_grad_norm,
            server_classifier_steps=server_classifier_steps,
            server_classifier_lr=server_classifier_lr, seed=seed)
    check_training(training)
    if schedule not in SCHEDULES:
        raise H.FieldError("schedule", f"must be one of {SCHEDULES}, got {schedule!r}")
    if energy_weighting not in ENERGY_WEIGHTINGS:
        raise H.FieldError("energy_weighting", f"must be one of {ENERGY_WEIGHTINGS}, got "
                                               f"{energy_weighting!r}")
    if sample_clip not in SAMPLE_CLIPS:
        raise H.FieldError("sample_clip", f"must be one of {SAMPLE_CLIPS}, got {sample_clip!r}")
    data_range = check_data_range(data_range)
    num_classes = int(model.num_classes)
    num_synth = 10 * num_classes if num_synth is None else int(num_synth)
    balanced_labels(num_synth, num_classes)  # refuses an unbalanced M now
    num_rounds = int(num_rounds)
    unroll = local_step_unroll(model.uses_xla_conv)
    cfg = ClientConfig(ce_weight=ce_weight, local_iters=local_iters,
                       num_epochs=training.num_epochs,
                       client_sgld_steps=client_sgld_steps, client_step=client_step,
                       client_noise=client_noise, grad_clip=grad_clip, data_range=data_range,
                       sample_clip=sample_clip, weight_decay=training.weight_decay,
                       max_grad_norm=max_grad_norm, batch_size=training.batch_size,
                       energy_weighting=energy_weighting,
                       ce_on_initial_synth=ce_on_initial_synth, unroll=unroll)
    client_update = make_client_update(model, cfg)
    server_opt = classifier_optimizer(server_classifier_lr, training.weight_decay)
    betas = server_steps(num_rounds, server_step, server_step_end, schedule)

    def client(b: Broadcast, row, data: ClientData, local_steps, key):
        """One client (Alg. 4.2): trains a fresh classifier (or, persistent, its own
        from its second visit on) from the downloaded D~ = ``b.extra``; uploads
        (g, log s) as its ``delta``; ``loss_before`` is the server classifier's."""
        k_init, k_train = jax.random.split(key)
        start = model.init(k_init)
        if persistent_client_model:
            start = jax.tree.map(lambda f, r: jnp.where(row.trained, r, f.astype(r.dtype)),
                                 start, row.params)
        upload, cm, params = client_update(b.extra.x, b.extra.y, data, local_steps, k_train,
                                           round_value(training.lr, b.round), start)
        out = ClientOutput(delta=upload,
                           loss_before=data_loss(model, b.params, data, loss_chunk_size_here()),
                           num_examples=data.num_examples, num_steps=cm["num_steps"],
                           extra={name: cm[name] for name in CLIENT_METRICS},
                           train_loss=cm["train_loss"])
        new_row = ClientModel(params, jnp.ones((), bool)) if persistent_client_model else ()
        return out, new_row

    def init_server(params, num_clients: int) -> ServerSide:
        synth = init_synthetic(jax.random.key(seed), num_synth, num_classes,
                               model.input_shape)
        return ServerSide(synth.x, synth.y, server_opt.init(params))

    def aggregate(server: ServerSide, outputs, weights, ctx):
        """The server (Alg. 4.2): eq. 4.13's mixture gradient over the clients holding
        data, one SGLD step on D~ (eq. 4.14), then the classifier's fit on it."""
        upload = outputs.delta
        weights = jnp.where(outputs.num_examples > 0, weights, 0.0)
        grad = mixture_gradient(upload.g, upload.log_s, weights)  # eq. 4.13
        beta = betas[jnp.minimum(ctx.round, num_rounds - 1)]
        x_new = server_sgld_step(server.x, grad.astype(server.x.dtype), beta, server_noise,
                                 jax.random.fold_in(ctx.key, 0), data_range)  # eq. 4.14
        direction, opt_state, info = classifier_direction(
            model, ctx.params, server.classifier_opt_state, server_opt, x_new, server.y,
            jax.random.fold_in(ctx.key, 1), server_classifier_steps, training.batch_size,
            unroll)
        valid = (weights > 0)[:, None] & jnp.ones(upload.log_s.shape, bool)
        info.update(grad_norm=jnp.sqrt(jnp.sum(jnp.square(grad))), beta=beta,
                    frac_s_positive=jnp.sum(valid & (upload.log_s > 0))
                    / jnp.maximum(jnp.sum(valid), 1),
                    synthetic_change=jnp.sqrt(jnp.sum(jnp.square(x_new - server.x))))
        return direction, ServerSide(x_new, server.y, opt_state), info

    def round_metrics(outputs, weights, ctx):
        return {"client_train_loss": cohort_train_loss(outputs.train_loss,
                                                       outputs.num_examples, ctx.client_mask),
                **{f"client/{name}": value for name, value in outputs.extra.items()}}

    server = Aggregator(init_server, aggregate, reads=("delta", "extra", "num_examples"))
    return compose(client, aggregator=server,
                   broadcast=lambda state: state.aggregator_state,
                   client_state_init=((lambda params: ClientModel(params, jnp.zeros((), bool)))
                                      if persistent_client_model else None),
                   client_table=client_table, round_metrics=round_metrics)


register("fedevg", fedevg, HPARAMS, family="generative", generative=True,
         report=downstream_report, report_line=downstream_line,
         training_fields=TRAINING_FIELDS, size_prior=None, seeded=True)
