"""FedCVAE — the conditional-VAE baseline of FedEvg's comparison (Hahn, "Algorithms for
Collaborative Machine Learning under Statistical Heterogeneity", PhD thesis, UNIST 2024,
Chapter IV, §4.2 "Baselines" and Tables 4.2-4.5): a conditional VAE
(Sohn, Lee, Yan, "Learning Structured Output Representation using Deep Conditional
Generative Models", NeurIPS 2015) trained with FedAvg, whose decoder gives the server a
labelled synthetic set of ``samples_per_class`` samples per class.

Network (``cvae``, fully connected, defined here as the model zoo has no generative
network): encoder q(z | x, y) = N(mu, diag exp(logvar)) from [flatten(u), onehot(y)]
through ReLU layers ``hidden``; decoder p(u | z, y) = Bernoulli(sigmoid(logits)) over the
D inputs from [z, onehot(y)] through the reversed layers, where u = (x - lo) / (hi - lo)
rescales the data range [lo, hi] = ``data_range`` to [0, 1] (clipped there). The
per-example loss is the negative ELBO with one reparameterised draw
z = mu + exp(logvar / 2) eps, eps ~ N(0, I) from the training step's key:

    L(x, y) = sum_d BCE(logits_d, u_d) + kl_weight * KL(N(mu, diag sigma^2) || N(0, I)),
    KL = -1/2 sum_k (1 + logvar_k - mu_k^2 - exp(logvar_k)).

Without a key z = mu. The CVAE's own ``Model.apply`` is a generative classifier,
logits_c = -L(x, c) at z = mu (Bayes' rule with a uniform label prior). Samples are
decoder means x = lo + (hi - lo) sigmoid(logits) at z ~ N(0, I) (``sample``).

Federated training (``fedcvae(model, ...)``), shaped like FedEvg so that both compare
with every method in one table: ``model`` is the user's classifier, the CVAE is built
inside from its input shape and classes. The round is ``compose``d
(core/algorithm.py): the broadcast is the CVAE, each client takes FedAvg's local
training of it (``client.local_training``: Adam steps with a fresh Adam state every
round), and the aggregator is the server: FedAvg's step on the CVAE (the size-weighted
mean of the clients' deltas, subtracted), a fresh synthetic set D~ of M = L
``samples_per_class`` decoder means (``fold_in(server_key, 0)``), then the classifier in
``state.params`` trained on it, warm-started, for ``server_classifier_steps`` Adam steps
(``generative.classifier_direction``, as FedEvg does). The runner's accuracy is thus
downstream accuracy (the thesis's Tables 4.2-4.3), and ``generative.synthetic_data(state)`` /
``generative.downstream_report`` read the set as for FedEvg. ``state.aggregator_state``
is ``FedCVAEState(x, y, generator, classifier_opt_state)``, ``generator`` the CVAE's
parameters.

Symbols -> arguments: eta = ``training.lr``, B = ``training.batch_size`` (also the
server classifier's batch), E = ``training.num_epochs`` (at most ``training.max_steps``
steps), coupled L2 ``training.weight_decay``, the clients' optimizer
``training.optimizer`` (None: ``optax.adam``), gradient clipping ``training.clip_norm``
/ ``training.clip_mode`` (FedAvg's, off by default), defaults ``TRAINING``; network
sizes ``latent_dim``, ``hidden``, KL weight ``kl_weight`` (beta-VAE), the data range
``data_range``; the CVAE's initialisation and D~^(0) come from ``jax.random.key(seed)``.
Traced: ``training.lr``, ``training.weight_decay``, ``kl_weight``, ``data_range``
bounds, ``server_classifier_lr``.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_fair import hparams as H
from fedjax_fair.core.aggregators import Aggregator, weighted_sum
from fedjax_fair.core.algorithm import FederatedAlgorithm, cohort_train_loss, compose
from fedjax_fair.core.client import ClientTraining, data_loss, describe_object, local_training
from fedjax_fair.core.execution import local_step_unroll, loss_chunk_size_here
from fedjax_fair.models.base import Model, check_widths
from fedjax_fair.algorithms.families.generative import (balanced_labels, check_data_range,
                                                        classifier_direction,
                                                        classifier_optimizer, downstream_line,
                                                        downstream_report)
from fedjax_fair.core.types import Broadcast
from fedjax_fair.algorithms.registry import register

NETWORK_HPARAMS = {"latent_dim": H.COUNT, "kl_weight": H.NONNEGATIVE}
HPARAMS = {**NETWORK_HPARAMS, "samples_per_class": H.COUNT,
           "server_classifier_steps": H.Range(0, None, integer=True),
           "server_classifier_lr": H.POSITIVE, "seed": H.Range(0, None, integer=True)}
# FedCVAE's client training, FedEvg's (``fedevg.TRAINING``) without weight decay: Adam
# (``optimizer=None`` means Adam here) at rate 1e-3, batch 64, one epoch.
TRAINING = ClientTraining(lr=1e-3, batch_size=64)


class _CVAE(nn.Module):
    input_dim: int
    num_classes: int
    latent_dim: int
    hidden: tuple

    def setup(self):
        self.enc = [nn.Dense(h, name=f"enc_{i}") for i, h in enumerate(self.hidden)]
        self.enc_mu = nn.Dense(self.latent_dim)
        self.enc_logvar = nn.Dense(self.latent_dim)
        self.dec = [nn.Dense(h, name=f"dec_{i}") for i, h in enumerate(self.hidden[::-1])]
        self.dec_out = nn.Dense(self.input_dim)

    def encode(self, x, y_onehot):
        h = jnp.concatenate([x.reshape(x.shape[0], -1), y_onehot.astype(x.dtype)], axis=-1)
        for layer in self.enc:
            h = nn.relu(layer(h))
        return self.enc_mu(h), self.enc_logvar(h)

    def decode(self, z, y_onehot):
        """Bernoulli logits [B, D] of p(x | z, y)."""
        h = jnp.concatenate([z, y_onehot.astype(z.dtype)], axis=-1)
        for layer in self.dec:
            h = nn.relu(layer(h))
        return self.dec_out(h)

    def __call__(self, x, y_onehot, eps):
        mu, logvar = self.encode(x, y_onehot)
        z = mu + jnp.exp(0.5 * logvar) * eps
        return self.decode(z, y_onehot), mu, logvar


def negative_elbo(logits, x, mu, logvar, kl_weight=1.0):
    """Per-example -ELBO [B]: Bernoulli reconstruction sum_d (softplus(l) - x l) plus
    ``kl_weight`` * KL(N(mu, exp(logvar)) || N(0, I))."""
    x = x.reshape(x.shape[0], -1).astype(logits.dtype)
    recon = jnp.sum(jax.nn.softplus(logits) - x * logits, axis=-1)
    kl = -0.5 * jnp.sum(1.0 + logvar - jnp.square(mu) - jnp.exp(logvar), axis=-1)
    return recon + kl_weight * kl


def cvae(input_shape, num_classes, latent_dim: int = 16, hidden: Sequence[int] = (256,),
         kl_weight: float = 1.0, data_range: tuple = (0.0, 1.0)) -> Model:
    """The conditional VAE as a ``Model`` (see the module docstring): ``per_example_loss``
    is -ELBO (one draw from the step's key; z = mu without a key), ``apply`` the
    generative classifier's logits -L(x, c) [B, L], ``decoder(model)`` its decoder; the
    inputs' range [lo, hi] = ``data_range`` is the Bernoulli's [0, 1]."""
    H.check(NETWORK_HPARAMS, latent_dim=latent_dim, kl_weight=kl_weight)
    lo, hi = _bounds(data_range)
    hidden = check_widths("hidden", hidden)
    input_shape = tuple(int(d) for d in input_shape)
    num_classes = int(num_classes)
    input_dim = 1
    for d in input_shape:
        input_dim *= d
    module = _CVAE(input_dim, num_classes, int(latent_dim), hidden)

    def onehot(y, dtype):
        return jax.nn.one_hot(y, num_classes, dtype=dtype)

    def init(key):
        return module.init(key, jnp.zeros((1, *input_shape)), jnp.zeros((1, num_classes)),
                           jnp.zeros((1, latent_dim)))

    def loss(params, x, y, key):
        dtype = jnp.result_type(x.dtype, jnp.float32)
        eps = (jnp.zeros((x.shape[0], latent_dim), dtype) if key is None
               else jax.random.normal(key, (x.shape[0], latent_dim), dtype))
        u = jnp.clip((x.astype(dtype) - lo) / (hi - lo), 0.0, 1.0)
        logits, mu, logvar = module.apply(params, u, onehot(y, dtype), eps)
        return negative_elbo(logits, u, mu, logvar, kl_weight)

    def per_example_loss(params, batch, key=None):
        return loss(params, batch["x"], batch["y"], key)

    def apply(params, x, key=None):
        del key  # the classifier scores at z = mu
        labels = jnp.arange(num_classes, dtype=jnp.int32)
        per_class = jax.vmap(lambda c: -loss(params, x, jnp.full((x.shape[0],), c), None))(
            labels)
        return per_class.T  # [B, L]

    def per_example_metrics(params, batch):
        logits = apply(params, batch["x"])
        return {"loss": loss(params, batch["x"], batch["y"], None),
                "accuracy": (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32),
                "confidence": jnp.max(jax.nn.softmax(logits, -1), -1)}

    def decode(params, z, y):
        """Decoder means lo + (hi - lo) sigmoid(logits) [B, *input_shape] at latents
        z [B, latent]."""
        logits = module.apply(params, z, onehot(y, z.dtype), method=_CVAE.decode)
        return (lo + (hi - lo) * jax.nn.sigmoid(logits)).reshape(z.shape[0], *input_shape)

    apply.decode = decode
    apply.latent_dim = int(latent_dim)
    return Model(init, apply, per_example_loss, per_example_metrics, "cvae", input_shape,
                 num_classes)


def _bounds(data_range):
    if data_range is None:
        raise H.FieldError("data_range", "FedCVAE's Bernoulli decoder needs a pair (lo, hi), "
                                         "got None")
    return check_data_range(data_range)


def decoder(model: Model) -> Callable:
    """``decode(params, z, y) -> x`` of a model built by ``cvae``."""
    decode = getattr(model.apply, "decode", None)
    if decode is None:
        raise H.FieldError("model", f"FedCVAE needs a conditional VAE built by "
                                    f"fedjax_fair.algorithms.fedcvae.cvae, got {model.name!r}")
    return decode


class FedCVAEState(NamedTuple):
    """FedCVAE's server (``state.aggregator_state``): the synthetic set (x [M, *X],
    y [M], drawn after the last round), the CVAE's parameters ``generator`` and the
    server classifier's Adam state."""

    x: jax.Array
    y: jax.Array
    generator: Any
    classifier_opt_state: Any


def sample(generator: Model, params, key, samples_per_class: int = 10):
    """Labelled decoder means of a CVAE (``cvae``) at ``params`` (spc = 10, as for the thesis's baselines):
    balanced labels [0]*spc + [1]*spc + ..., z ~ N(0, I) from ``key``. Returns
    (x [L spc, *X], y int32 [L spc])."""
    H.COUNT.check("samples_per_class", samples_per_class)
    decode = decoder(generator)
    y = balanced_labels(generator.num_classes * int(samples_per_class), generator.num_classes)
    z = jax.random.normal(key, (y.shape[0], generator.apply.latent_dim),
                          jnp.result_type(float))
    return decode(params, z, y), y


def fedcvae(model: Model, *, latent_dim: int = 16, hidden: Sequence[int] = (256,),
            kl_weight: float = 1.0, data_range: tuple = (0.0, 1.0),
            training: ClientTraining = TRAINING, samples_per_class: int = 10,
            server_classifier_steps: int = 10, server_classifier_lr: float = 1e-3,
            seed: int = 0) -> FederatedAlgorithm:
    """FedCVAE: a conditional VAE trained with FedAvg, its decoder's samples training
    the server classifier ``model`` (see the module docstring).

    The CVAE has ``model``'s inputs and classes; its clients train with ``training``
    (FedAvg's local training; Adam steps unless ``training.optimizer`` is given, at rate
    ``training.lr``: a number, a traced scalar or a schedule of the round); after every
    round the server classifier ``state.params`` trains on a fresh decoder set.

    Round metrics: ``compose``'s (``weights``, ``num_steps``; ``loss_before``, the
    server classifier's cross-entropy on each client's rows before the round, and
    ``train_loss``, its n-weighted mean as for every method; ``update_norm``, the
    classifier's change), ``client/elbo_before`` (the CVAE's -ELBO per client) and its
    n-weighted mean ``generator_loss``, ``server/generator_update_norm`` (the CVAE's
    step), ``server/classifier_loss`` and ``server/synthetic_accuracy``."""
    if not isinstance(training, ClientTraining):
        raise H.FieldTypeError("training", f"must be a ClientTraining, got "
                                           f"{describe_object(training)}")
    H.check(HPARAMS, latent_dim=latent_dim, kl_weight=kl_weight,
            samples_per_class=samples_per_class,
            server_classifier_steps=server_classifier_steps,
            server_classifier_lr=server_classifier_lr, seed=seed)
    generator = cvae(model.input_shape, model.num_classes, latent_dim, hidden, kl_weight,
                     data_range)
    train_cvae = local_training(generator, training._replace(
        optimizer=optax.adam if training.optimizer is None else training.optimizer))
    server_opt = classifier_optimizer(server_classifier_lr, 0.0)
    unroll = local_step_unroll(model.uses_xla_conv)  # XLA:CPU's rolled-conv slowdown

    def client(b: Broadcast, row, data, local_steps, key):
        """FedAvg's client on the CVAE ``b.extra``; its -ELBO before the round moves to
        ``extra`` and ``loss_before`` is the server classifier's."""
        out, _ = train_cvae(Broadcast(b.extra, b.round), (), data, local_steps, key)
        return out._replace(loss_before=data_loss(model, b.params, data,
                                                  loss_chunk_size_here()),
                            extra={"elbo_before": out.loss_before}), ()

    def init_server(params, num_clients: int) -> FedCVAEState:
        k_gen, k_synth = jax.random.split(jax.random.key(seed))
        gen = generator.init(k_gen)
        x, y = sample(generator, gen, k_synth, samples_per_class)
        return FedCVAEState(x, y, gen, server_opt.init(params))

    def aggregate(server: FedCVAEState, outputs, weights, ctx):
        """FedAvg's server step on the CVAE (theta_g - sum_k p_k Delta_k), a fresh set
        from its decoder, then the classifier's fit on it."""
        step = weighted_sum(outputs.delta, weights)
        gen = jax.tree.map(jnp.subtract, server.generator, step)
        x, y = sample(generator, gen, jax.random.fold_in(ctx.key, 0), samples_per_class)
        direction, opt_state, info = classifier_direction(
            model, ctx.params, server.classifier_opt_state, server_opt, x, y,
            jax.random.fold_in(ctx.key, 1), server_classifier_steps, training.batch_size,
            unroll)
        info["generator_update_norm"] = optax.tree.norm(step)
        return direction, FedCVAEState(x, y, gen, opt_state), info

    def round_metrics(outputs, weights, ctx):
        elbo = outputs.extra["elbo_before"]
        return {"client/elbo_before": elbo,
                "generator_loss": cohort_train_loss(elbo, outputs.num_examples,
                                                    ctx.client_mask)}

    server = Aggregator(init_server, aggregate, reads=("delta", "extra", "num_examples"))
    return compose(client, aggregator=server,
                   broadcast=lambda state: state.aggregator_state.generator,
                   round_metrics=round_metrics)


register("fedcvae", fedcvae, HPARAMS, family="generative", generative=True,
         report=downstream_report, report_line=downstream_line, size_prior=None, seeded=True)
