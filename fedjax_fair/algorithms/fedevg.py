"""FedEvg — Hahn, "Algorithms for Collaborative Machine Learning under Statistical
Heterogeneity", PhD thesis, UNIST 2024, Chapter IV ("Federated Synthetic Data
Generation through Energy-based Composition"); spec/fedevg.md.

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
Client SGLD (eq. 4.9, Alg. 4.2 line 11): x <- clip(x + gamma clip(grad_x f[y]) + sigma eps),
i.e. it descends the energy. PCD loss with the corrected sign (spec §7.1):
L_pcd = E(x_real, y) - E(x_neg, y~) = -f(x_real)[y] + f(x_neg)[y~] (batch means).

Symbols -> arguments: M = ``num_synth`` (default 10 L, class-balanced deterministic
labels [0]*spc + [1]*spc + ...), lambda = ``ce_weight``, E (local iterations) =
``local_iters`` (None: ``num_epochs`` epochs over each client's own rows, the reference
code's epoch mode with per-client step masking; an int: that many iterations for every
client, the thesis' reading; ``mean_epoch_iters`` gives the spec's ceil(mean n_i / B)),
R = ``client_sgld_steps``, gamma = ``client_step``, sigma = ``client_noise``, beta_0 /
beta_{T-1} = ``server_step`` / ``server_step_end`` on the ``schedule``
("ddpm_cosine_beta" | "cosine_alphabar", ``server_steps``) over T = ``num_rounds``,
delta = ``server_noise``, the energy-gradient clip c = ``grad_clip`` (None: off), the
sample range [lo, hi] = ``data_range`` (None: no clipping), eta = ``client_lr`` (Adam;
a number, a traced scalar or a schedule of the round), coupled L2 ``weight_decay``,
optional global gradient-norm clip ``max_grad_norm``, B = ``batch_size``; the
ablations ``energy_weighting`` ("signed_exp" | "exp" | "uniform", spec §7.11) and
``ce_on_initial_synth`` (spec §7.3); ``persistent_client_model`` keeps each client's
classifier in a per-client table (``client_table``) instead of re-initialising it.

What the runner evaluates. FedEvg has no global model: its product is D~. So that
``runner.run``'s per-client test accuracy of ``state.params`` means something, the
server keeps a classifier of the model's architecture in ``state.params`` (its Adam
state in ``state.opt_state``) and trains it, warm-started, for
``server_classifier_steps`` Adam steps (rate ``server_classifier_lr``, minibatches of
min(B, M) distinct synthetic samples) on the updated D~ after every server step. The
runner's accuracy is then the downstream accuracy (spec §5.1) of a classifier trained on
D~ so far; 0 steps leaves ``state.params`` at its initial value (only D~ evolves). The
spec's end-of-run protocol (a *fresh* classifier trained on D~ only) is
``downstream_accuracy``. The synthetic set lives in ``state.aggregator_state``
(``FedEvgState(x, y)``; ``synthetic_data(state)``), drawn at ``init`` from
``jax.random.key(synth_seed)`` (eq. 4.12). Round keys follow the engine: client k uses
``fold_in(key, k)``, the server ``fold_in(key, SERVER_KEY_ID)``.

Public pieces: ``server_steps`` (schedule), ``signed_weights`` / ``log_energy_weights``,
``mixture_weights`` / ``mixture_gradient`` (eq. 4.13), ``server_sgld_step`` (eq. 4.14),
``client_sgld`` (eq. 4.9), ``pcd_loss``, ``energy_and_grad`` (the upload's per-sample
values and gradients), ``make_client_update`` (one client, spec §2.3), ``init_synthetic``
/ ``balanced_labels`` (eq. 4.12), ``mean_epoch_iters``; accessors ``synthetic_data``,
``synthetic_federation``, ``downstream_accuracy`` and ``downstream_report`` (spec §5.1,
the shape of a registry ``report`` hook); evaluation: ``frechet_distance`` and
``feature_distance`` (a Fréchet *classifier* distance on a fixed classifier's logits,
the offline stand-in for the spec's FID, §5.2; not FID), ``feature_classifier`` and
``pooled_examples`` (its embedding network, trained on the pooled real training rows),
``plot_sample_grid`` (class-wise sample grids over rounds, §5.3).

Traced (vmappable / differentiable): ``ce_weight``, ``client_step``, ``client_noise``,
``server_step``, ``server_step_end``, ``server_noise``, ``grad_clip``, ``data_range``
bounds, ``client_lr``, ``weight_decay``, ``max_grad_norm``, ``server_classifier_lr``.
Static: counts, ``num_rounds``, ``schedule``, the flags and choices.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_fair import client_states as tables
from fedjax_fair import hparams as H
from fedjax_fair.algorithm import SERVER_KEY_ID, FederatedAlgorithm, ServerState
from fedjax_fair.client import check_rate, data_loss, masked_mean, masked_steps, round_value
from fedjax_fair.execution import local_step_unroll, loss_chunk_size_here, map_clients
from fedjax_fair.models.base import Model, cross_entropy
from fedjax_fair.types import ClientData, Cohort, FederatedData

Rate = Union[float, Callable]  # a number, a traced scalar, or a schedule of the round

SCHEDULES = ("ddpm_cosine_beta", "cosine_alphabar")
ENERGY_WEIGHTINGS = ("signed_exp", "exp", "uniform")
COSINE_OFFSET = 0.008  # s of Nichol & Dhariwal's cosine schedule

HPARAMS = {
    "num_synth": H.Range(1, None, integer=True, nullable=True),
    "ce_weight": H.NONNEGATIVE,
    "local_iters": H.Range(1, None, integer=True, nullable=True),
    "num_epochs": H.COUNT,
    "client_sgld_steps": H.Range(0, None, integer=True),
    "client_step": H.NONNEGATIVE,
    "client_noise": H.NONNEGATIVE,
    "server_step": H.NONNEGATIVE,
    "server_step_end": H.NONNEGATIVE,
    "server_noise": H.NONNEGATIVE,
    "num_rounds": H.COUNT,
    "grad_clip": H.Range(0.0, None, low_open=True, nullable=True),
    "client_lr": H.POSITIVE,
    "weight_decay": H.NONNEGATIVE,
    "max_grad_norm": H.Range(0.0, None, low_open=True, nullable=True),
    "batch_size": H.COUNT,
    "server_classifier_steps": H.Range(0, None, integer=True),
    "server_classifier_lr": H.POSITIVE,
    "synth_seed": H.Range(0, None, integer=True),
}


class FedEvgState(NamedTuple):
    """The server's synthetic set D~ (the MCMC chain): x [M, *X], y int32 [M]."""

    x: jax.Array
    y: jax.Array


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


# ----------------------------------------------------------------- pure pieces


def balanced_labels(num_synth: int, num_classes: int) -> jax.Array:
    """[0]*spc + [1]*spc + ... + [L-1]*spc, spc = M / L (int32 [M]; spec §2.2)."""
    if num_synth % num_classes:
        raise ValueError(f"num_synth: must be a multiple of num_classes={num_classes} "
                         f"(class-balanced labels), got {num_synth}")
    return jnp.repeat(jnp.arange(num_classes, dtype=jnp.int32), num_synth // num_classes)


def init_synthetic(key, num_synth: int, num_classes: int, input_shape) -> FedEvgState:
    """D~^(0): x~ ~ N(0, I_D) (eq. 4.12) and balanced labels."""
    x = jax.random.normal(key, (num_synth, *tuple(input_shape)), jnp.result_type(float))
    return FedEvgState(x, balanced_labels(num_synth, num_classes))


def _alphabar(num_rounds: int, s: float = COSINE_OFFSET) -> np.ndarray:
    """alpha-bar(u), u = 0..T (float64 [T + 1]), of the cosine schedule."""
    u = np.arange(num_rounds + 1, dtype=np.float64)
    f = np.cos((u / num_rounds + s) / (1 + s) * np.pi / 2) ** 2
    return f / f[0]


def server_steps(num_rounds: int, beta_0, beta_end, schedule: str = "ddpm_cosine_beta"):
    """The server SGLD step sizes beta_t, t = 0..T-1 ([T]; spec §2.4).

    "ddpm_cosine_beta" ([ref-code]): b_t = 1 - alphabar(t+1) / alphabar(t) rises from
    ~9e-5 to 1, beta_t = (1 - b_t) beta_0 + b_t beta_end (= beta_0 + b_t (beta_end -
    beta_0), written so that b = 1 gives beta_end exactly).
    "cosine_alphabar": beta_t = beta_end + (beta_0 - beta_end) a_t with a_t = alphabar(t)
    rescaled to a_0 = 1, a_{T-1} = 0, so that beta_{T-1} = beta_end exactly (the
    rescaling moves the other values by less than 1e-5 (beta_0 - beta_end)).
    ``num_rounds`` is static; ``beta_0`` / ``beta_end`` may be traced.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: must be one of {SCHEDULES}, got {schedule!r}")
    num_rounds = int(num_rounds)
    if num_rounds < 1:
        raise ValueError(f"num_rounds: must be an integer >= 1, got {num_rounds}")
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
    raise ValueError(f"energy_weighting: must be one of {ENERGY_WEIGHTINGS}, got {mode!r}")


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
    statistics; spec §7.7)."""
    def f_y(x):
        return _pick(apply(params, x), y)

    values, vjp = jax.vjp(f_y, x)
    (grad,) = vjp(jnp.ones_like(values))
    return values, grad


def _clip_grad(grad, grad_clip):
    return grad if grad_clip is None else jnp.clip(grad, -grad_clip, grad_clip)


def client_sgld(apply: Callable, params, x, y, key, *, steps: int, step_size, noise,
                grad_clip=3.0, data_range=(0.0, 1.0)):
    """R client SGLD steps on stop_gradient(theta) (Alg. 4.2 line 11, eq. 4.9):
    x <- clip(x + gamma clip(grad_x f(x)[y], +-c) + sigma eps, lo, hi), descending the
    energy E = -f[y]; the r-th step's noise is drawn from ``fold_in(key, r)``."""
    params = jax.lax.stop_gradient(params)

    def step(r, x):
        _, gx = energy_and_grad(apply, params, x, y)
        eps = jax.random.normal(jax.random.fold_in(key, r), x.shape, x.dtype)
        return _clip_range(x + step_size * _clip_grad(gx, grad_clip) + noise * eps,
                           data_range)

    return jax.lax.fori_loop(0, steps, step, x) if steps > 0 else x


def pcd_from_logits(logits_real, y_real, mask, logits_neg, y_neg):
    """L_pcd = mean E(x_real, y) - mean E(x_neg, y~) = -mean f(x_real)[y] + mean
    f(x_neg)[y~] (spec §7.1: the thesis' Alg. 4.2 line 13 has the sign flipped), the
    real mean over the rows where ``mask`` is True."""
    return -masked_mean(_pick(logits_real, y_real), mask) + jnp.mean(_pick(logits_neg, y_neg))


def pcd_loss(apply: Callable, params, x_real, y_real, mask, x_neg, y_neg):
    """``pcd_from_logits`` of the network ``apply(params, .)``."""
    return pcd_from_logits(apply(params, x_real), y_real, mask, apply(params, x_neg), y_neg)


def client_optimizer(lr, weight_decay=1e-4, max_grad_norm=None):
    """[ref-code] local optimiser: (optional global-norm clip), coupled L2, Adam."""
    parts = [] if max_grad_norm is None else [optax.clip_by_global_norm(max_grad_norm)]
    return optax.chain(*parts, optax.add_decayed_weights(weight_decay), optax.adam(lr))


def mean_epoch_iters(train: ClientData, batch_size: int) -> int:
    """ceil(mean_i n_i / B) over the clients of a (host or device) split: the spec's
    default ``local_iters`` (about one epoch, spec §7.5)."""
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
    weight_decay: object = 1e-4
    max_grad_norm: object = None
    batch_size: int = 64
    energy_weighting: str = "signed_exp"
    ce_on_initial_synth: bool = False
    unroll: Union[int, bool] = 1


def make_client_update(model: Model, cfg: ClientConfig) -> Callable:
    """ONE client's FedEvg update (spec §2.3 ``fedevg_client_update``):

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
        optimizer = client_optimizer(lr, cfg.weight_decay, cfg.max_grad_norm)

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
                data_range=cfg.data_range))
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


def fit_classifier(model: Model, params, opt_state, optimizer, x, y, key, steps: int,
                   batch_size: int, unroll: Union[int, bool] = 1):
    """``steps`` optimizer steps of the mean cross-entropy on minibatches of min(B, M)
    distinct rows of (x, y), the s-th drawn from ``fold_in(key, s)``. Returns (params,
    opt_state, mean loss over the steps)."""
    if steps == 0:
        return params, opt_state, jnp.zeros((), jnp.float32)
    m = x.shape[0]
    bs = min(batch_size, m)

    def loss_fn(p, xb, yb):
        return jnp.mean(cross_entropy(model.apply(p, xb), yb))

    def step(carry, s):
        p, o = carry
        idx = jax.random.permutation(jax.random.fold_in(key, s), m)[:bs]
        loss, grads = jax.value_and_grad(loss_fn)(p, x[idx], y[idx])
        updates, o = optimizer.update(grads, o, p)
        return (optax.apply_updates(p, updates), o), loss

    (params, opt_state), losses = jax.lax.scan(step, (params, opt_state), jnp.arange(steps),
                                               unroll=unroll)
    return params, opt_state, jnp.mean(losses).astype(jnp.float32)


def _accuracy(model: Model, params, x, y):
    return jnp.mean((jnp.argmax(model.apply(params, x), -1) == y).astype(jnp.float32))


# ----------------------------------------------------------------- the algorithm


def fedevg(model: Model, *, num_synth: Optional[int] = None, ce_weight: float = 0.1,
           local_iters: Optional[int] = None, num_epochs: int = 1,
           client_sgld_steps: int = 1, client_step: float = 1.0, client_noise: float = 0.01,
           server_step: float = 10.0, server_step_end: float = 0.01,
           server_noise: float = 0.01, schedule: str = "ddpm_cosine_beta",
           num_rounds: int = 500, grad_clip: Optional[float] = 3.0,
           data_range: Optional[tuple] = (0.0, 1.0), client_lr: Rate = 1e-3,
           weight_decay: float = 1e-4, max_grad_norm: Optional[float] = None,
           batch_size: int = 64, energy_weighting: str = "signed_exp",
           ce_on_initial_synth: bool = False, persistent_client_model: bool = False,
           client_table: str = "dense", server_classifier_steps: int = 10,
           server_classifier_lr: float = 1e-3, synth_seed: int = 0) -> FederatedAlgorithm:
    """FedEvg: federated energy-based synthetic-data generation (see the module
    docstring for the symbols).

    ``init(params, N)``: ``params`` initialises the server classifier (``state.params``)
    and, with ``persistent_client_model``, the shape of the per-client table; D~^(0) is
    drawn from ``jax.random.key(synth_seed)``. ``apply(state, cohort, key, execution)``:
    one round; the clients are mapped with ``execution.map_clients`` (any strategy).

    Round metrics: per client [K] ``client_ids``, ``client_mask``, ``weights`` (n_i over
    the cohort's n; 0 for masked rows), ``num_steps``, ``loss_before`` (the server
    classifier's loss on the client's rows before the round), ``client/ce``,
    ``client/pcd``, ``client/acc`` (means over the local iterations); scalars
    ``train_loss`` (n-weighted last-epoch real cross-entropy), ``update_norm``
    (||x~^{t+1} - x~^t||), ``server/grad_norm`` (||G||), ``server/beta``,
    ``server/frac_s_positive`` (share of uploads with s = e), ``server/classifier_loss``
    and ``server/synthetic_accuracy`` (the server classifier on D~^{t+1}).
    """
    H.check(HPARAMS, num_synth=num_synth, ce_weight=ce_weight, local_iters=local_iters,
            num_epochs=num_epochs, client_sgld_steps=client_sgld_steps,
            client_step=client_step, client_noise=client_noise, server_step=server_step,
            server_step_end=server_step_end, server_noise=server_noise,
            num_rounds=num_rounds, grad_clip=grad_clip, weight_decay=weight_decay,
            max_grad_norm=max_grad_norm, batch_size=batch_size,
            server_classifier_steps=server_classifier_steps,
            server_classifier_lr=server_classifier_lr, synth_seed=synth_seed)
    check_rate(client_lr, "client_lr")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: must be one of {SCHEDULES}, got {schedule!r}")
    if energy_weighting not in ENERGY_WEIGHTINGS:
        raise ValueError(f"energy_weighting: must be one of {ENERGY_WEIGHTINGS}, got "
                         f"{energy_weighting!r}")
    data_range = _check_range(data_range)
    num_classes = int(model.num_classes)
    num_synth = 10 * num_classes if num_synth is None else int(num_synth)
    balanced_labels(num_synth, num_classes)  # refuses an unbalanced M now
    num_rounds = int(num_rounds)
    table = tables.get_table(client_table)  # refuses a bad name in either mode
    table = table if persistent_client_model else None
    unroll = local_step_unroll(model.uses_xla_conv)
    cfg = ClientConfig(ce_weight=ce_weight, local_iters=local_iters, num_epochs=num_epochs,
                       client_sgld_steps=client_sgld_steps, client_step=client_step,
                       client_noise=client_noise, grad_clip=grad_clip, data_range=data_range,
                       weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                       batch_size=batch_size, energy_weighting=energy_weighting,
                       ce_on_initial_synth=ce_on_initial_synth, unroll=unroll)
    client_update = make_client_update(model, cfg)
    server_opt = client_optimizer(server_classifier_lr, weight_decay)

    def init(params, num_clients: int) -> ServerState:
        synth = init_synthetic(jax.random.key(synth_seed), num_synth, num_classes,
                               model.input_shape)
        cs = table.init(params, num_clients) if table is not None else ()
        return ServerState(params=params, opt_state=server_opt.init(params), mixing_state=(),
                           aggregator_state=synth, client_states=cs,
                           round=jnp.zeros((), jnp.int32))

    def one_client(shared, xs):
        x_syn, y_syn, lr, server_params = shared
        row, never, data, budget, key = xs
        k_init, k_train = jax.random.split(key)
        fresh = model.init(k_init)
        if table is None:
            start = fresh
        else:  # a client's first participation starts from its own fresh model
            start = jax.tree.map(lambda f, r: jnp.where(never, f.astype(r.dtype), r), fresh,
                                 row)
        upload, metrics, params = client_update(x_syn, y_syn, data, budget, k_train, lr,
                                                start)
        # the server classifier's loss on the client's rows (``loss_before``, read by
        # algorithm.with_improvement and loss-based diagnostics)
        metrics["loss_before"] = data_loss(model, server_params, data, loss_chunk_size_here())
        return upload, metrics, (params if table is not None else ())

    def apply(state: ServerState, cohort: Cohort, key, execution="auto"):
        synth: FedEvgState = state.aggregator_state
        k = cohort.client_ids.shape[0]
        ids = cohort.client_ids
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(ids)
        if table is not None:
            rows = table.gather(state.client_states, ids)
            never = state.client_states.last_round[ids] < 0
        else:
            rows, never = (), jnp.zeros((k,), bool)
        lr = round_value(client_lr, state.round)
        run_clients = map_clients(one_client, execution, k)
        upload, cm, new_rows = run_clients(
            (synth.x, synth.y, jnp.asarray(lr), state.params), (rows, never, cohort.data, cohort.local_steps, keys),
            sizes=cohort.data.num_examples)

        mask = cohort.client_mask
        n = jnp.where(mask, cohort.data.num_examples, 0).astype(jnp.float32)
        grad = mixture_gradient(upload.g, upload.log_s, n)  # eq. 4.13
        betas = server_steps(num_rounds, server_step, server_step_end, schedule)
        beta = betas[jnp.minimum(state.round, num_rounds - 1)]
        server_key = jax.random.fold_in(key, SERVER_KEY_ID)
        x_new = server_sgld_step(synth.x, grad.astype(synth.x.dtype), beta, server_noise,
                                 jax.random.fold_in(server_key, 0), data_range)  # eq. 4.14
        params, opt_state, cls_loss = fit_classifier(
            model, state.params, state.opt_state, server_opt, x_new, synth.y,
            jax.random.fold_in(server_key, 1), server_classifier_steps, batch_size, unroll)

        client_table_ = state.client_states
        if table is not None:
            client_table_ = table.scatter(client_table_, ids, new_rows, mask, state.round)

        total = jnp.maximum(jnp.sum(n), 1.0)
        valid = (n > 0)[:, None] & jnp.ones(upload.log_s.shape, bool)
        metrics = {
            "client_ids": ids,
            "client_mask": mask,
            "weights": n / total,
            "num_steps": cm["num_steps"],
            "loss_before": cm["loss_before"],
            "train_loss": jnp.sum(n * cm["train_loss"]) / total,
            "update_norm": jnp.sqrt(jnp.sum(jnp.square(x_new - synth.x))),
            "client/ce": cm["ce"],
            "client/pcd": cm["pcd"],
            "client/acc": cm["acc"],
            "server/grad_norm": jnp.sqrt(jnp.sum(jnp.square(grad))),
            "server/beta": beta,
            "server/frac_s_positive": jnp.sum(valid & (upload.log_s > 0))
            / jnp.maximum(jnp.sum(valid), 1),
            "server/classifier_loss": cls_loss,
            "server/synthetic_accuracy": _accuracy(model, params, x_new, synth.y),
        }
        new_state = ServerState(params, opt_state, state.mixing_state,
                                FedEvgState(x_new, synth.y), client_table_, state.round + 1)
        return new_state, metrics

    def client_rows(state, client_ids):
        """The persistent classifiers of ``client_ids`` (rows never written hold the
        table's template; such a client starts from a fresh model)."""
        return table.gather(state.client_states, client_ids)

    return FederatedAlgorithm(init, apply, None, table, None,
                              client_rows if table is not None else None)


def _check_range(data_range):
    if data_range is None:
        return None
    try:
        lo, hi = data_range
    except (TypeError, ValueError):
        raise ValueError(f"data_range: must be None or a pair (lo, hi), got "
                         f"{data_range!r}") from None
    if H.is_concrete(lo) and H.is_concrete(hi):
        H.REAL.check("data_range", lo)
        H.REAL.check("data_range", hi)
        if not lo < hi:
            raise ValueError(f"data_range: needs lo < hi, got {data_range!r}")
    return (lo, hi)


# ----------------------------------------------------------------- accessors


def synthetic_data(state: ServerState):
    """The server's synthetic set (x [M, *X], y int32 [M])."""
    synth: FedEvgState = state.aggregator_state
    return synth.x, synth.y


def synthetic_federation(state: ServerState, num_clients: int = 1,
                         test: Optional[ClientData] = None) -> FederatedData:
    """D~ as a federation: sample j goes to client j mod ``num_clients`` (the labels are
    sorted by class, so every client gets a near-balanced share), padded and masked like
    any built-in split (``data.federated.stack_clients``). ``test``: a test split with
    ``num_clients`` rows (e.g. real held-out data, which ``runner.run`` evaluates on);
    default: an empty test split of padded size 1."""
    from fedjax_fair.data.federated import stack_clients

    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) \
            or num_clients < 1:
        raise ValueError(f"num_clients: must be an integer >= 1, got {num_clients!r}")
    x, y = (np.asarray(a) for a in synthetic_data(state))
    xs = [x[k::num_clients] for k in range(num_clients)]
    ys = [y[k::num_clients] for k in range(num_clients)]
    train = stack_clients(xs, ys)
    if test is None:
        empty_x = [np.zeros((0, *x.shape[1:]), np.float32)] * num_clients
        empty_y = [np.zeros((0,), np.int32)] * num_clients
        test = stack_clients(empty_x, empty_y, pad_to=1)
    elif test.mask.shape[0] != num_clients:
        raise ValueError(f"test: must have one row per client ({num_clients}), got "
                         f"{test.mask.shape[0]}")
    return FederatedData(train=train, test=test)


@functools.lru_cache(maxsize=16)
def _downstream_program(model: Model, steps: int, batch_size: int):
    def train(x, y, key, lr, weight_decay):
        k_init, k_fit = jax.random.split(key)
        params = model.init(k_init)
        opt = client_optimizer(lr, weight_decay)
        params, _, loss = fit_classifier(model, params, opt.init(params), opt, x, y, k_fit,
                                         steps, batch_size)
        return params, loss

    return jax.jit(train)


def downstream_accuracy(model: Model, x, y, test_split: ClientData, key, steps: int = 200,
                        lr=1e-3, batch_size: int = 64, weight_decay=0.0) -> dict:
    """Spec §5.1: a fresh classifier (``model.init`` from ``key``) trained on the
    synthetic set (x, y) only, ``steps`` Adam steps (rate ``lr``, coupled L2
    ``weight_decay``) on minibatches of min(B, M) distinct samples (100 epochs over
    M = 100 with B = 64: ``steps = 200``), then evaluated on every client's real
    held-out rows ``test_split`` [N, m, ...].

    Returns {"accuracy": mean over clients weighted by test size (the [ref-code]
    number), "accuracy_std": unweighted std across clients with test rows,
    "per_client": [N] accuracies, "num_examples": [N], "train_loss": mean loss over the
    steps, "params": the trained classifier}."""
    from fedjax_fair.evaluation import make_evaluator

    H.Range(0, None, integer=True).check("steps", steps)
    H.COUNT.check("batch_size", batch_size)
    H.POSITIVE.check("lr", lr)
    H.NONNEGATIVE.check("weight_decay", weight_decay)
    params, loss = _downstream_program(model, int(steps), int(batch_size))(
        jnp.asarray(x), jnp.asarray(y, jnp.int32), key, lr, weight_decay)
    per = make_evaluator(model)(params, test_split)
    acc = np.asarray(per["accuracy"], np.float64)
    n = np.asarray(per["num_examples"], np.float64)
    has = n > 0
    if not has.any():
        raise ValueError("test_split: no client has a test example")
    return {"accuracy": float(np.average(acc[has], weights=n[has])),
            "accuracy_std": float(acc[has].std()), "per_client": acc,
            "num_examples": n.astype(np.int64), "train_loss": float(loss), "params": params}


def downstream_report(model: Model, algorithm: FederatedAlgorithm, state: ServerState,
                      test_split: ClientData, *, epochs: int = 100, lr=1e-3,
                      batch_size: int = 64, seed: int = 0) -> dict:
    """The end-of-run numbers of spec §5.1 for a registry ``report`` hook: a fresh
    ``model`` trained on the final D~ only for ``epochs`` passes (``epochs`` ceil(M / B)
    Adam steps, rate ``lr``, batch ``batch_size``; the spec's recommendation is 100
    epochs, Adam 1e-3, B = 64), tested on every client's held-out rows. Returns
    {"downstream_accuracy" (weighted by test size), "downstream_accuracy_std" (across
    clients, unweighted), "downstream_steps", "num_synth", "synthetic_min",
    "synthetic_max"}. ``algorithm`` is unused (the hook's signature)."""
    del algorithm
    H.COUNT.check("epochs", epochs)
    x, y = synthetic_data(state)
    steps = int(epochs) * math.ceil(x.shape[0] / batch_size)
    out = downstream_accuracy(model, x, y, test_split, jax.random.key(seed), steps=steps,
                              lr=lr, batch_size=batch_size)
    xs = np.asarray(x)
    return {"downstream_accuracy": out["accuracy"],
            "downstream_accuracy_std": out["accuracy_std"], "downstream_steps": steps,
            "num_synth": int(xs.shape[0]), "synthetic_min": float(xs.min()),
            "synthetic_max": float(xs.max())}


# ----------------------------------------------------------------- evaluation: feature distance


def _float_dtype(*arrays):
    """The inputs' common float type, at least float32 (float64 stays float64)."""
    return jnp.promote_types(jnp.result_type(*arrays), jnp.float32)


def frechet_distance(feat_a, feat_b):
    """Fréchet distance between Gaussians fitted to two feature sets [n_a, d], [n_b, d]
    (Dowson & Landau 1982; the formula of FID, Heusel et al. 2017):

        d^2 = ||mu_a - mu_b||^2 + Tr(C_a) + Tr(C_b) - 2 Tr((C_a^1/2 C_b C_a^1/2)^1/2),

    mu = the feature mean, C = the unbiased covariance (1 / (n - 1), as ``numpy.cov``).
    The last trace equals Tr((C_a C_b)^1/2) (same eigenvalues) and is computed from
    symmetric eigendecompositions only: C_a^1/2 = V diag(sqrt(max(lambda, 0))) V^T, then
    the eigenvalues of the symmetrised C_a^1/2 C_b C_a^1/2, clamped at 0 before their
    square roots (round-off on singular covariances, e.g. n <= d). Pure and jittable;
    computed in the inputs' float type, at least float32 (float64 inputs under
    ``jax.enable_x64`` stay float64). The result is clamped at 0. Needs n_a, n_b >= 2.
    """
    a = jnp.asarray(feat_a)
    b = jnp.asarray(feat_b)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"feat_a, feat_b: must be [n, d] with the same d, got {a.shape} and "
                         f"{b.shape}")
    if a.shape[0] < 2 or b.shape[0] < 2:
        raise ValueError(f"feat_a, feat_b: need at least 2 rows each for a covariance, got "
                         f"{a.shape[0]} and {b.shape[0]}")
    dtype = _float_dtype(a, b)
    a, b = a.astype(dtype), b.astype(dtype)

    def moments(f):
        mu = jnp.mean(f, axis=0)
        c = f - mu[None, :]
        return mu, c.T @ c / (f.shape[0] - 1)

    mu_a, cov_a = moments(a)
    mu_b, cov_b = moments(b)
    lam, vec = jnp.linalg.eigh(cov_a)
    root_a = (vec * jnp.sqrt(jnp.maximum(lam, 0.0))[None, :]) @ vec.T
    inner = root_a @ cov_b @ root_a
    inner = 0.5 * (inner + inner.T)
    trace_root = jnp.sum(jnp.sqrt(jnp.maximum(jnp.linalg.eigvalsh(inner), 0.0)))
    d2 = (jnp.sum(jnp.square(mu_a - mu_b)) + jnp.trace(cov_a) + jnp.trace(cov_b)
          - 2.0 * trace_root)
    return jnp.maximum(d2, 0.0)


def feature_distance(model: Model, params, x_synth, x_real):
    """The Fréchet *classifier* distance (FCD) between a synthetic and a real image set:
    ``frechet_distance`` of the **logits** f(x; theta) [n, L] of a fixed classifier
    ``model`` / ``params`` (lower is better; 0 for identical sets).

    A stand-in for the spec's FID (§5.2), which needs InceptionV3 pool3 features that
    are not available offline. It is **not FID** and not on FID's scale: the embedding
    is a small classifier trained on the federation's real pooled training rows
    (``feature_classifier``), d = L; logits rather than penultimate features because
    ``Model.apply`` returns logits only (the ``Model`` API exposes no hidden layer).
    Logits are a class-discriminative embedding: the distance grows when the synthetic
    set's class-conditional structure, confidence or spread differs from the real
    data's, and it is blind to pixel detail the classifier ignores. The spec's two
    variants are the caller's choice of ``x_real``: all real held-out images (the
    default reading of FID, n_real = all), or M of them ("M vs M", the [ref-code]
    variant, noisier with M <= d samples). Pure and jittable in ``params`` and both
    sets."""
    return frechet_distance(model.apply(params, jnp.asarray(x_synth)),
                            model.apply(params, jnp.asarray(x_real)))


def pooled_examples(split: ClientData):
    """Every client's valid rows of a (host or device) split, stacked in client order:
    (x [n, *X], y int32 [n]) as NumPy arrays (the padding rows dropped)."""
    mask = np.asarray(split.mask, bool)
    x = np.asarray(split.examples["x"])[mask]
    y = np.asarray(split.examples["y"])[mask].astype(np.int32)
    return x, y


def feature_classifier(model: Model, train_split: ClientData, key, steps: int = 2000,
                       lr=1e-3, batch_size: int = 64, weight_decay=0.0):
    """The fixed embedding of ``feature_distance``: a fresh ``model`` (``model.init``
    from ``key``) trained on the clients' pooled real training rows
    (``pooled_examples``), ``steps`` Adam steps of minibatch cross-entropy (the program
    of ``downstream_accuracy``). Returns (params, mean training loss)."""
    H.COUNT.check("steps", steps)
    H.COUNT.check("batch_size", batch_size)
    x, y = pooled_examples(train_split)
    params, loss = _downstream_program(model, int(steps), int(batch_size))(
        jnp.asarray(x), jnp.asarray(y), key, lr, weight_decay)
    return params, float(loss)


# ----------------------------------------------------------------- evaluation: sample grids


def _grid_image(x, y, num_classes: int, per_class: int, value_range):
    """One mosaic [L (h+1) - 1, per_class (w+1) - 1, C] of the first ``per_class``
    samples of each class (rows = classes; missing samples and the 1-pixel gutters are
    blank at the top of the range), clipped to ``value_range`` and rescaled to [0, 1]."""
    x = np.asarray(x, np.float64)
    if x.ndim == 2:  # flat samples: square grey images when D is a square
        side = int(round(math.sqrt(x.shape[1])))
        if side * side != x.shape[1]:
            raise ValueError(f"snapshots: flat samples of {x.shape[1]} features are not "
                             f"square images")
        x = x.reshape(x.shape[0], side, side, 1)
    elif x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4 or x.shape[-1] not in (1, 3):
        raise ValueError(f"snapshots: need images [M, H, W] or [M, H, W, 1 | 3], got "
                         f"{x.shape}")
    lo, hi = value_range
    x = (np.clip(x, lo, hi) - lo) / (hi - lo)
    y = np.asarray(y)
    h, w, c = x.shape[1:]
    grid = np.ones((num_classes * (h + 1) - 1, per_class * (w + 1) - 1, c))
    for cls in range(num_classes):
        rows = np.flatnonzero(y == cls)[:per_class]
        for col, j in enumerate(rows):
            grid[cls * (h + 1):cls * (h + 1) + h, col * (w + 1):col * (w + 1) + w] = x[j]
    return grid


def plot_sample_grid(snapshots, labels, rounds, path: Optional[str], num_classes: int,
                     per_class: int = 10, title: str = "Synthetic samples by class",
                     context: str = "", value_range=(0.0, 1.0), class_names=None,
                     panel_width: float = 2.6, dpi: int = 110):
    """Class-wise grids of synthetic samples (spec §5.3), one panel per snapshot.

    snapshots: a sequence of sample sets [M, H, W], [M, H, W, 1] (grey, e.g. 8x8,
      28x28, 32x32), [M, H, W, 3] (RGB) or [M, H*W] (flat square grey images), e.g.
      D~ after the rounds ``rounds``; labels: int [M], shared by all snapshots, or a
      sequence with one label array per snapshot; rounds: one entry per snapshot, the
      panel's title ("round r"; a string is used as it is).
    Each panel is a mosaic with a row per class (0..num_classes-1, labelled on the
    left) and the first ``per_class`` samples of that class as columns; pixels are
    clipped to ``value_range`` (the data range) and shown on a fixed scale, grey
    images with the grey colour map (black = lo). ``title`` / ``context`` form the
    figure title as in ``cli.report`` (``context`` on a second line). The figure is
    drawn on a ``matplotlib.figure.Figure`` with the Agg canvas (matplotlib is
    imported here, never pyplot), written to ``path`` as PNG when given, and returned.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    snapshots = list(snapshots)
    rounds = list(rounds)
    if not snapshots or len(rounds) != len(snapshots):
        raise ValueError(f"rounds: need one entry per snapshot ({len(snapshots)}), got "
                         f"{len(rounds)}")
    if isinstance(labels, (list, tuple)) and len(labels) == len(snapshots) and \
            np.ndim(labels[0]) == 1:
        label_sets = [np.asarray(v) for v in labels]
    else:
        label_sets = [np.asarray(labels)] * len(snapshots)
    H.COUNT.check("num_classes", num_classes)
    H.COUNT.check("per_class", per_class)
    grids = [_grid_image(x, y, num_classes, per_class, value_range)
             for x, y in zip(snapshots, label_sets)]
    ratio = grids[0].shape[0] / grids[0].shape[1]
    n = len(grids)
    fig = Figure(figsize=(panel_width * n + 0.4, panel_width * ratio + 0.9),
                 layout="constrained")
    FigureCanvasAgg(fig)
    names = [str(c) for c in range(num_classes)] if class_names is None else list(class_names)
    h = (grids[0].shape[0] + 1) / num_classes
    for i, (grid, r) in enumerate(zip(grids, rounds)):
        ax = fig.add_subplot(1, n, i + 1)
        if grid.shape[-1] == 1:
            ax.imshow(grid[..., 0], cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
        else:
            ax.imshow(grid, interpolation="nearest")
        ax.set_title(r if isinstance(r, str) else f"round {r}", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([(c + 0.5) * h - 1 for c in range(num_classes)])
        ax.set_yticklabels(names if i == 0 else [], fontsize=7)
        ax.tick_params(length=0)
    fig.suptitle(f"{title}\n{context}" if context else title, fontsize=10)
    if path is not None:
        import os
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=dpi)
    return fig
