"""FedCVAE (fedjax_fair/algorithms/fedcvae.py), the conditional-VAE baseline of FedEvg.

* The network's -ELBO against a literal NumPy forward pass (float64), with and without
  the reparameterisation noise, the generative classifier's logits, and the data-range
  rescaling.
* One round on the tiny federation: the CVAE takes FedAvg's step exactly, the server
  draws a fresh balanced set in the data range and trains the classifier on it, the
  metrics ``with_improvement`` reads are the classifier's.
* ``runner.run`` on the 2-D toy of tests/test_fedevg.py (two Gaussians) with one class per client (slow):
  the runner's accuracy (the server classifier, trained on decoder samples only) is
  high, the samples sit at their class means, and ``downstream_accuracy`` scores them.
"""
from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from fedjax_fair.algorithms.families import generative as S
from fedjax_fair.core.algorithm import SERVER_KEY_ID, with_improvement
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.core.client import data_loss
from fedjax_fair.models import mlp
from fedjax_fair.drivers.runner import run
from fedjax_fair.core.types import FederatedData
from fedjax_fair.core.client import ClientTraining
C = importlib.import_module("fedjax_fair.algorithms.fedcvae")  # the package exports the factory


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


def test_data_range_maps_onto_the_bernoulli_range():
    unit = C.cvae((3,), 2, latent_dim=2, hidden=(4,))
    wide = C.cvae((3,), 2, latent_dim=2, hidden=(4,), data_range=(-2.0, 2.0))
    params = unit.init(jax.random.key(0))
    u = jax.random.uniform(jax.random.key(1), (5, 3))
    y = jnp.asarray([0, 1, 1, 0, 1], jnp.int32)
    np.testing.assert_allclose(wide.per_example_loss(params, {"x": 4 * u - 2, "y": y}),
                               unit.per_example_loss(params, {"x": u, "y": y}), rtol=1e-5)
    z = jax.random.normal(jax.random.key(2), (5, 2))
    np.testing.assert_allclose(C.decoder(wide)(params, z, y),
                               4 * C.decoder(unit)(params, z, y) - 2, rtol=1e-5, atol=1e-6)


def test_factory_and_accessor_checks():
    model = helpers.logreg()
    for bad in (dict(training=C.TRAINING._replace(batch_size=0)),
                dict(training=C.TRAINING._replace(lr=0.0)),
                dict(training=C.TRAINING._replace(weight_decay=-1.0)),
                dict(latent_dim=0), dict(samples_per_class=0), dict(data_range=None),
                dict(data_range=(1.0, 0.0)), dict(server_classifier_steps=-1)):
        with pytest.raises(ValueError):
            C.fedcvae(model, **bad)
    with pytest.raises(ValueError):
        C.decoder(model)  # not a CVAE
    generator = C.cvae((2,), 2, latent_dim=2, hidden=(4,))
    with pytest.raises(ValueError):
        C.sample(generator, generator.init(jax.random.key(0)), jax.random.key(0), 0)


def test_round_trains_the_cvae_like_fedavg_and_the_classifier_on_its_samples():
    model, data = helpers.logreg(), helpers.tiny_federation()
    n, ids, key = data.num_clients, [0, 3, 4, 1], jax.random.key(7)
    training = ClientTraining(lr=0.01, batch_size=4, num_epochs=2)
    kw = dict(latent_dim=3, hidden=(8,), data_range=(-4.0, 4.0), training=training)
    alg = with_improvement(C.fedcvae(model, samples_per_class=4, server_classifier_steps=3,
                                     **kw), model)
    state0 = alg.init(helpers.init_params(model), n)
    cohort = helpers.cohort(data.train, ids)
    state, metrics = jax.jit(lambda s, c, k: alg.apply(s, c, k, "sequential"))(
        state0, cohort, key)
    # the CVAE takes exactly FedAvg's round with Adam clients
    generator = C.cvae(model.input_shape, model.num_classes, 3, (8,), 1.0, (-4.0, 4.0))
    plain = fedavg(generator, training=training._replace(optimizer=optax.adam))
    expected, _ = plain.apply(plain.init(state0.aggregator_state.generator, n), cohort, key,
                              "sequential")
    helpers.assert_trees_close(state.aggregator_state.generator, expected.params)
    # a fresh balanced set drawn from the new decoder with the server's key
    x, y = S.synthetic_data(state)
    np.testing.assert_array_equal(y, np.repeat(np.arange(helpers.NUM_CLASSES), 4))
    assert x.shape == (4 * helpers.NUM_CLASSES, helpers.NUM_FEATURES)
    assert np.all((np.asarray(x) >= -4) & (np.asarray(x) <= 4))
    x_ref, _ = C.sample(generator, expected.params,
                        jax.random.fold_in(jax.random.fold_in(key, SERVER_KEY_ID), 0), 4)
    np.testing.assert_allclose(x, x_ref, rtol=1e-5, atol=1e-6)
    assert not np.allclose(x, S.synthetic_data(state0)[0])
    # the classifier moved; the loss metrics are the classifier's cross-entropy
    assert helpers.tree_norm(helpers.tree_sub(state.params, state0.params)) > 0
    before = [float(data_loss(model, state0.params, helpers.client(data.train, k)))
              for k in ids]
    np.testing.assert_allclose(metrics["loss_before"], before, rtol=1e-5)
    assert metrics["client/elbo_before"].shape == (4,)
    assert metrics["improved_fraction"].shape == () and int(state.round) == 1


MEANS = np.asarray([[0.25, 0.5], [0.75, 0.5]])


def _toy(n, seed):
    rng = np.random.default_rng(seed)
    return helpers.pack([((MEANS[c] + 0.05 * rng.normal(size=(n, 2))).astype(np.float32),
                          np.full(n, c, np.int32)) for c in (0, 1)])


@pytest.mark.slow  # a 26 s run; the NumPy references of the loss stay in the default run
def test_runner_on_the_toy_with_one_class_per_client():
    data = FederatedData(_toy(200, 0), _toy(50, 1))
    model = mlp((2,), 2, hidden=(16,))
    alg = C.fedcvae(model, latent_dim=2, hidden=(32,),
                    training=ClientTraining(lr=1e-2, batch_size=32),
                    samples_per_class=20, server_classifier_lr=1e-2)
    result = run(alg, model.init(jax.random.key(0)), data, jax.random.key(0), model=model,
                 num_rounds=20, cohort_size=2, eval_every=20, progress=False,
                 execution="sequential")
    assert result.history[-1]["accuracy_mean"] >= 0.95  # the server classifier, on real data
    x, y = (np.asarray(a) for a in S.synthetic_data(result.state))
    np.testing.assert_array_equal(y, np.repeat([0, 1], 20))
    assert x.shape == (40, 2) and np.all((x >= 0) & (x <= 1))
    d = np.linalg.norm(x[:, None] - MEANS[None], axis=-1)
    assert np.mean(d.argmin(1) == y) >= 0.9
    out = S.downstream_accuracy(model, x, y, data.test, jax.random.key(0), steps=100,
                                lr=1e-2, batch_size=32)
    assert out["accuracy"] >= 0.9
