"""FedCVAE (fedjax_fair/algorithms/fedcvae.py), the conditional-VAE baseline of FedEvg.

* The network's -ELBO against a literal NumPy forward pass (float64), with and without
  the reparameterisation noise, and the generative classifier's logits.
* ``runner.run`` on the 2-D toy of spec/fedevg.md §8.10 with one class per client: the
  federated CVAE classifies the held-out points, its decoder samples sit at their class
  means, and FedEvg's ``downstream_accuracy`` scores the sampled set.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from fedjax_fair.algorithms import fedcvae as C
from fedjax_fair.algorithms.fedevg import downstream_accuracy
from fedjax_fair.models import mlp
from fedjax_fair.runner import run
from fedjax_fair.types import FederatedData


def _numpy_negative_elbo(params, x, y, eps, num_classes, kl_weight):
    p = jax.tree.map(lambda v: np.asarray(v, np.float64), params["params"])
    dense = lambda name, h: h @ p[name]["kernel"] + p[name]["bias"]
    onehot = np.eye(num_classes)[y]
    h = np.concatenate([x.reshape(len(x), -1), onehot], -1)
    h = np.maximum(dense("enc_0", h), 0)
    mu, logvar = dense("enc_mu", h), dense("enc_logvar", h)
    z = mu + np.exp(0.5 * logvar) * eps
    h = np.maximum(dense("dec_0", np.concatenate([z, onehot], -1)), 0)
    logits = dense("dec_out", h)
    xf = x.reshape(len(x), -1)
    recon = np.sum(np.log1p(np.exp(logits)) - xf * logits, -1)
    kl = -0.5 * np.sum(1 + logvar - mu ** 2 - np.exp(logvar), -1)
    return recon + kl_weight * kl


def test_negative_elbo_and_classifier_match_numpy():
    with jax.enable_x64(True):
        model = C.cvae((2, 3), 4, latent_dim=3, hidden=(5,), kl_weight=0.7)
        params = jax.tree.map(lambda v: jnp.asarray(v, jnp.float64),
                              model.init(jax.random.key(0)))
        rng = np.random.default_rng(0)
        x = rng.uniform(size=(6, 2, 3))
        y = np.asarray([0, 1, 2, 3, 1, 0], np.int32)
        batch = {"x": jnp.asarray(x), "y": jnp.asarray(y)}
        key = jax.random.key(5)
        eps = np.asarray(jax.random.normal(key, (6, 3), jnp.float64))
        loss = jax.jit(model.per_example_loss)
        np.testing.assert_allclose(loss(params, batch, key),
                                   _numpy_negative_elbo(params, x, y, eps, 4, 0.7), rtol=1e-10)
        at_mean = _numpy_negative_elbo(params, x, y, np.zeros_like(eps), 4, 0.7)
        np.testing.assert_allclose(loss(params, batch, None), at_mean, rtol=1e-10)
        logits = np.asarray(jax.jit(model.apply)(params, batch["x"]))
        per_class = np.stack([_numpy_negative_elbo(params, x, np.full(6, c), 0 * eps, 4, 0.7)
                              for c in range(4)], 1)
        np.testing.assert_allclose(logits, -per_class, rtol=1e-10)
        metrics = jax.jit(model.per_example_metrics)(params, batch)
        np.testing.assert_allclose(metrics["loss"], at_mean, rtol=1e-10)
        np.testing.assert_array_equal(metrics["accuracy"], per_class.argmin(1) == y)


def test_factory_and_accessor_checks():
    plain = mlp((2,), 2, hidden=(4,))
    with pytest.raises(ValueError):
        C.fedcvae(plain)
    model = C.cvae((2,), 2, latent_dim=2, hidden=(4,))
    for bad in (dict(batch_size=0), dict(client_lr=0.0), dict(weight_decay=-1.0)):
        with pytest.raises(ValueError):
            C.fedcvae(model, **bad)
    with pytest.raises(ValueError):
        C.cvae((2,), 2, latent_dim=0)
    with pytest.raises(ValueError):
        C.synthetic_data(model, model.init(jax.random.key(0)), jax.random.key(0), 0)


MEANS = np.asarray([[0.25, 0.5], [0.75, 0.5]])


def _toy(n, seed):
    rng = np.random.default_rng(seed)
    return helpers.pack([((MEANS[c] + 0.05 * rng.normal(size=(n, 2))).astype(np.float32),
                          np.full(n, c, np.int32)) for c in (0, 1)])


@pytest.mark.slow  # a 26 s run; the NumPy references of the loss stay in the default run
def test_runner_on_the_toy_with_one_class_per_client():
    data = FederatedData(_toy(200, 0), _toy(50, 1))
    model = C.cvae((2,), 2, latent_dim=2, hidden=(32,))
    alg = C.fedcvae(model, client_lr=1e-2, batch_size=32)
    result = run(alg, model.init(jax.random.key(0)), data, jax.random.key(0), model=model,
                 num_rounds=20, cohort_size=2, eval_every=20, progress=False,
                 execution="sequential")
    first, last = result.history[0], result.history[-1]
    assert last["test_loss"] < first["test_loss"] and last["accuracy_mean"] >= 0.95
    x, y = C.synthetic_data(model, result.state, jax.random.key(1), samples_per_class=20)
    x, y = np.asarray(x), np.asarray(y)
    np.testing.assert_array_equal(y, np.repeat([0, 1], 20))
    assert x.shape == (40, 2) and np.all((x >= 0) & (x <= 1))
    d = np.linalg.norm(x[:, None] - MEANS[None], axis=-1)
    assert np.mean(d.argmin(1) == y) >= 0.9
    again, _ = C.synthetic_data(model, result.state.params, jax.random.key(1), 20)
    np.testing.assert_array_equal(again, x)
    out = downstream_accuracy(mlp((2,), 2, hidden=(16,)), x, y, data.test, jax.random.key(0),
                              steps=100, lr=1e-2, batch_size=32)
    assert out["accuracy"] >= 0.9
