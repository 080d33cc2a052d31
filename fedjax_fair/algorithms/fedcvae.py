"""FedCVAE — the conditional-VAE baseline of FedEvg's comparison (Hahn, "Algorithms for
Collaborative Machine Learning under Statistical Heterogeneity", PhD thesis, UNIST 2024,
Chapter IV, §4.2 "Baselines" and Tables 4.2-4.5; spec/fedevg.md §4): a conditional VAE
(Sohn, Lee, Yan, "Learning Structured Output Representation using Deep Conditional
Generative Models", NeurIPS 2015) trained with FedAvg; after training the server draws
``samples_per_class`` labelled samples per class from the decoder, the synthetic set
that FedEvg's ``downstream_accuracy`` scores.

Network (``cvae``, fully connected, defined here as the model zoo has no generative
network): encoder q(z | x, y) = N(mu, diag exp(logvar)) from [flatten(x), onehot(y)]
through ReLU layers ``hidden``; decoder p(x | z, y) = Bernoulli(sigmoid(logits)) over the
D inputs (data in [0, 1]) from [z, onehot(y)] through the reversed layers. The
per-example loss is the negative ELBO with one reparameterised draw
z = mu + exp(logvar / 2) eps, eps ~ N(0, I) from the training step's key:

    L(x, y) = sum_d BCE(logits_d, x_d) + kl_weight * KL(N(mu, diag sigma^2) || N(0, I)),
    KL = -1/2 sum_k (1 + logvar_k - mu_k^2 - exp(logvar_k)).

Without a key (evaluation) z = mu. ``Model.apply`` returns the CVAE as a generative
classifier, logits_c = -L(x, c) at z = mu (Bayes' rule with a uniform label prior), so
the runner's per-client "accuracy" of ``state.params`` measures how well the federated
CVAE models each class, and "loss" is L(x, y) at z = mu.

Federated training (``fedcvae``): FedAvg (``algorithms.fedavg``) with Adam local steps
(fresh Adam state every round), size-weighted parameter averaging of both encoder and
decoder, server step sgd(1.0). Symbols -> arguments: eta = ``client_lr``, B =
``batch_size``, E = ``num_epochs``, coupled L2 ``weight_decay``; network sizes
``latent_dim``, ``hidden``, KL weight ``kl_weight`` (beta-VAE) are arguments of ``cvae``.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_fair import hparams as H
from fedjax_fair.algorithm import FederatedAlgorithm, ServerState
from fedjax_fair.algorithms.fedavg import HPARAMS as FEDAVG_HPARAMS
from fedjax_fair.algorithms.fedavg import Rate, fedavg
from fedjax_fair.algorithms.fedevg import balanced_labels
from fedjax_fair.models.base import Model, check_widths

HPARAMS = dict(FEDAVG_HPARAMS)  # client_lr, batch_size, num_epochs, max_steps, weight_decay
NETWORK_HPARAMS = {"latent_dim": H.COUNT, "kl_weight": H.NONNEGATIVE}


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
         kl_weight: float = 1.0) -> Model:
    """The conditional VAE as a ``Model`` (see the module docstring): ``per_example_loss``
    is -ELBO (one draw from the step's key; z = mu without a key), ``apply`` the
    generative classifier's logits -L(x, c) [B, L], ``decoder(model)`` its decoder."""
    H.check(NETWORK_HPARAMS, latent_dim=latent_dim, kl_weight=kl_weight)
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
        logits, mu, logvar = module.apply(params, x.astype(dtype), onehot(y, dtype), eps)
        return negative_elbo(logits, x, mu, logvar, kl_weight)

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
        """Decoder means sigmoid(logits) [B, *input_shape] at latents z [B, latent]."""
        logits = module.apply(params, z, onehot(y, z.dtype), method=_CVAE.decode)
        return jax.nn.sigmoid(logits).reshape(z.shape[0], *input_shape)

    apply.decode = decode
    apply.latent_dim = int(latent_dim)
    return Model(init, apply, per_example_loss, per_example_metrics, "cvae", input_shape,
                 num_classes)


def decoder(model: Model) -> Callable:
    """``decode(params, z, y) -> x`` of a model built by ``cvae``."""
    decode = getattr(model.apply, "decode", None)
    if decode is None:
        raise ValueError(f"model: FedCVAE needs a conditional VAE built by "
                         f"fedjax_fair.algorithms.fedcvae.cvae, got {model.name!r}")
    return decode


def fedcvae(model: Model, *, client_lr: Rate = 1e-3, batch_size: int = 64,
            num_epochs: int = 1, max_steps: Optional[int] = None,
            weight_decay: float = 0.0) -> FederatedAlgorithm:
    """FedCVAE: FedAvg of a conditional VAE (``cvae``) with Adam local steps at rate
    ``client_lr`` (a number, a traced scalar or a schedule of the round)."""
    decoder(model)  # refuses a network that is not a CVAE
    H.check(HPARAMS, batch_size=batch_size, num_epochs=num_epochs, max_steps=max_steps,
            weight_decay=weight_decay)
    return fedavg(model, client_lr=client_lr, batch_size=batch_size, num_epochs=num_epochs,
                  max_steps=max_steps, client_optimizer=optax.adam, weight_decay=weight_decay)


def synthetic_data(model: Model, state, key, samples_per_class: int = 10):
    """The server's labelled synthetic set drawn from the decoder (spec §4, spc = 10):
    balanced labels [0]*spc + [1]*spc + ..., z ~ N(0, I), x = decoder mean.
    ``state``: a ``ServerState`` or the CVAE parameters. Returns (x [L spc, *X], y)."""
    H.COUNT.check("samples_per_class", samples_per_class)
    decode = decoder(model)
    params = state.params if isinstance(state, ServerState) else state
    y = balanced_labels(model.num_classes * int(samples_per_class), model.num_classes)
    z = jax.random.normal(key, (y.shape[0], model.apply.latent_dim))
    return decode(params, z, y), y
