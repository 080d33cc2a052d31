"""FedEvg (fedjax_fair/algorithms/fedevg.py): properties of Hahn's thesis, UNIST 2024, Ch. IV.

* Pure pieces against literal formulas (NumPy, float64 under ``jax.enable_x64``): the
  server schedule (eq. 4.14 values), the signed weights, eq. 4.13 (signed weights, and the
  exact mixture gradient with ``energy_weighting="exp"``), its invariances, the server
  SGLD step (eq. 4.14), the client SGLD direction, the PCD sign, the linear upload.
* Rounds on the tiny federation of tests/helpers.py (logistic regression as the energy
  model; one compiled round per algorithm and strategy, shared): padding garbage, cohort
  order, masked / empty clients, vmap = sequential, determinism, persistent vs stateless
  clients, tracers, the metrics ``with_improvement`` reads.
* ``runner.run`` end to end on a 2-D toy: tests/test_fedevg_toy.py.
"""
from __future__ import annotations

import importlib

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from fedevg_common import TOY_MODEL
from fedjax_fair import hparams as H
from fedjax_fair.core.algorithm import with_improvement
from fedjax_fair.algorithms.families import generative as S
from fedjax_fair.models.resnet import resnet10_gn_sn
from fedjax_fair.core.types import FederatedData
from fedjax_fair.core.client import ClientTraining
F = importlib.import_module("fedjax_fair.algorithms.fedevg")  # the package exports the factory

E = math.e


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


# ----------------------------------------------------------------- 5. schedule


def test_ddpm_cosine_beta_schedule_values():
    beta = np.asarray(F.server_steps(500, 10.0, 0.01, "ddpm_cosine_beta"), np.float64)
    assert beta.shape == (500,)
    assert abs(beta[0] - 10.0) / 10.0 < 1e-3 and abs(beta[0] - 9.999) < 1e-3
    np.testing.assert_allclose(beta[[250, 450, 490, 498]], [9.94, 9.61, 8.10, 2.51], atol=6e-3)
    np.testing.assert_allclose(beta[-1], 0.01, rtol=1e-6)
    assert np.all(np.diff(beta) <= 1e-6)


def test_ddpm_cosine_beta_is_the_reference_formula(x64):
    t_max, s, b0, b1 = 37, 0.008, 3.0, 0.2
    u = np.arange(t_max + 1)
    ab = np.cos(((u / t_max) + s) / (1 + s) * np.pi / 2) ** 2 / np.cos(s / (1 + s) * np.pi / 2) ** 2
    b = 1 - ab[1:] / ab[:-1]
    np.testing.assert_allclose(F.server_steps(t_max, b0, b1), b0 + b * (b1 - b0), rtol=1e-12,
                               atol=1e-12)


def test_cosine_alphabar_schedule_values():
    beta = np.asarray(F.server_steps(500, 10.0, 0.01, "cosine_alphabar"), np.float64)
    assert beta.shape == (500,)
    np.testing.assert_allclose(beta[[0, 250, 450]], [10.0, 4.94, 0.25], atol=6e-3)
    np.testing.assert_allclose(beta[-1], 0.01, rtol=1e-6)
    assert np.all(np.diff(beta) <= 1e-6)


def test_schedule_is_traceable_in_its_endpoints():
    grad = jax.grad(lambda b0, b1: F.server_steps(50, b0, b1)[10], argnums=(0, 1))(10.0, 0.5)
    np.testing.assert_allclose(float(grad[0]) + float(grad[1]), 1.0, rtol=1e-6)  # affine
    out = jax.vmap(lambda b0: F.server_steps(5, b0, 0.1))(jnp.asarray([1.0, 2.0]))
    assert out.shape == (2, 5)


# ----------------------------------------------------------------- 1-3. weights, eq. 4.13


def test_signed_weights_take_three_values_and_bound_the_ratio():
    f = jnp.asarray([-3.0, -1e-6, 0.0, 2e-7, 40.0, -1e9])
    s = np.asarray(F.signed_weights(f))
    np.testing.assert_allclose(s, [1 / E, 1 / E, 1.0, E, E, 1 / E], rtol=1e-6)
    np.testing.assert_allclose(np.exp(np.asarray(F.log_energy_weights(f))), s, rtol=1e-6)
    assert s.max() / s.min() <= E ** 2 * (1 + 1e-6)


def _numpy_eq_4_13(g, f_y, n):
    """Literal eq. 4.13 with the signed weights, w_i = n_i / n."""
    w = n / n.sum()
    a = w[:, None] * np.exp(np.sign(f_y))
    a = a.reshape(a.shape + (1,) * (g.ndim - 2))
    return (a * g).sum(0) / a.sum(0)


def test_mixture_gradient_matches_numpy_eq_4_13(x64):
    rng = np.random.default_rng(0)
    g = rng.normal(size=(4, 5, 2, 3))
    f_y = rng.normal(size=(4, 5))
    f_y[0, 0] = 0.0  # sign 0: weight 1
    n = np.asarray([7.0, 12.0, 3.0, 9.0])
    got = F.mixture_gradient(jnp.asarray(g), F.log_energy_weights(jnp.asarray(f_y)), jnp.asarray(n))
    np.testing.assert_allclose(got, _numpy_eq_4_13(g, f_y, n), rtol=1e-12, atol=1e-12)


class _TinyNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(3)(nn.silu(nn.Dense(8)(x)))


def test_exp_weighting_is_the_gradient_of_the_mixture_energy(x64):
    """Property 2: with exp(f_y) weights, G = grad_x E_mix(x), E_mix = -logsumexp_s(log w_s
    - E_s(x)), E_s(x) = -f_s(x)[y]."""
    net = _TinyNet()
    apply = lambda p, x: net.apply(p, x)
    params = [net.init(jax.random.key(i), jnp.zeros((1, 4))) for i in range(3)]
    params = [jax.tree.map(lambda v: 3.0 * v, p) for p in params]  # energies far apart
    x = jax.random.normal(jax.random.key(9), (6, 4), jnp.float64)
    y = jnp.asarray([0, 1, 2, 0, 1, 2], jnp.int32)
    n = jnp.asarray([5.0, 1.0, 30.0])

    def e_mix(x):
        neg_e = jnp.stack([jnp.take_along_axis(apply(p, x), y[:, None], 1)[:, 0] for p in params])
        return -jnp.sum(jax.nn.logsumexp(jnp.log(n / n.sum())[:, None] + neg_e, axis=0))

    @jax.jit
    def server_g(x):
        ups = [F.energy_and_grad(apply, p, x, y) for p in params]
        g = jnp.stack([-gr for _, gr in ups])  # grad_x E_s
        log_s = jnp.stack([F.log_energy_weights(fy, "exp") for fy, _ in ups])
        return F.mixture_gradient(g, log_s, n), log_s, jax.grad(e_mix)(x)

    got, log_s, expected = server_g(x)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-8)
    assert np.ptp(np.asarray(log_s)) > 1.0  # the weights really differ


def test_aggregation_invariances(x64):
    mixture_gradient = jax.jit(F.mixture_gradient)
    rng = np.random.default_rng(1)
    g = jnp.asarray(rng.normal(size=(3, 4, 2)))
    log_s = jnp.sign(jnp.asarray(rng.normal(size=(3, 4))))
    n = jnp.asarray([2.0, 5.0, 3.0])
    G = mixture_gradient(g, log_s, n)
    # one client: G = g_1
    np.testing.assert_allclose(mixture_gradient(g[:1], log_s[:1], n[:1]), g[0], rtol=1e-12)
    # equal s: the n-weighted mean
    np.testing.assert_allclose(mixture_gradient(g, jnp.ones_like(log_s), n),
                               jnp.tensordot(n / n.sum(), g, axes=1), rtol=1e-12)
    # scaling n, permuting the cohort
    np.testing.assert_allclose(mixture_gradient(g, log_s, 7.5 * n), G, rtol=1e-12)
    perm = jnp.asarray([2, 0, 1])
    np.testing.assert_allclose(mixture_gradient(g[perm], log_s[perm], n[perm]), G, rtol=1e-12)
    # convex combination
    assert np.all(G >= g.min(0) - 1e-12) and np.all(G <= g.max(0) + 1e-12)
    # a client of weight 0 (empty or masked) is ignored, even with non-finite uploads
    g_bad = g.at[1].set(jnp.nan)
    n0 = n.at[1].set(0.0)
    np.testing.assert_allclose(mixture_gradient(g_bad, log_s, n0),
                               mixture_gradient(g[jnp.asarray([0, 2])], log_s[jnp.asarray([0, 2])],
                                                  n[jnp.asarray([0, 2])]), rtol=1e-12)
    # nobody with weight: G = 0, never NaN
    np.testing.assert_array_equal(mixture_gradient(g, log_s, jnp.zeros(3)), np.zeros((4, 2)))
    # "exp" weights far out of float range stay finite (the log form)
    big = mixture_gradient(g, jnp.asarray(rng.normal(size=(3, 4))) * 1e4, n)
    assert np.all(np.isfinite(big))


# ----------------------------------------------------------------- 4. server SGLD


def test_server_sgld_step(x64):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.uniform(size=(5, 3)))
    G = jnp.asarray(rng.normal(size=(5, 3)))
    key = jax.random.key(0)
    np.testing.assert_allclose(F.server_sgld_step(x, G, 0.3, 0.0, key, None), x - 0.3 * G,
                               rtol=1e-15)
    big = jnp.zeros((200_000,))
    moved = F.server_sgld_step(big, jnp.zeros_like(big), 10.0, 0.01, key, None)
    np.testing.assert_allclose(np.std(np.asarray(moved)), 0.01, rtol=0.01)
    clipped = F.server_sgld_step(x, 100.0 * G, 1.0, 0.5, key, (0.0, 1.0))
    assert np.all((np.asarray(clipped) >= 0.0) & (np.asarray(clipped) <= 1.0))


# ----------------------------------------------------------------- 7. client SGLD


def _quadratic_energy(means):
    """f(x)[y] = -1/2 ||x - m_y||^2: the energy E(x, y) = 1/2 ||x - m_y||^2."""
    means = jnp.asarray(means)

    def apply(params, x):
        del params
        return -0.5 * jnp.sum(jnp.square(x[:, None, :] - means[None]), axis=-1)

    return apply


def test_client_sgld_descends_the_energy(x64):
    means = np.asarray([[0.2, 0.8], [0.9, 0.1]])
    apply = _quadratic_energy(means)
    x = jnp.asarray([[0.5, 0.5], [0.0, 0.0], [1.0, 1.0]])
    y = jnp.asarray([0, 1, 0], jnp.int32)
    kw = dict(steps=1, noise=0.0, grad_clip=None, data_range=None)
    small = F.client_sgld(apply, None, x, y, jax.random.key(0), step_size=0.1, **kw)
    np.testing.assert_allclose(small, x + 0.1 * (means[np.asarray(y)] - x), rtol=1e-12)
    np.testing.assert_allclose(F.client_sgld(apply, None, x, y, jax.random.key(0),
                                             step_size=1.0, **kw), means[np.asarray(y)],
                               rtol=1e-12)
    # clipped gradients (c = 0.05) move each coordinate by at most gamma c
    clipped = F.client_sgld(apply, None, x, y, jax.random.key(0), step_size=1.0, steps=1,
                            noise=0.0, grad_clip=0.05, data_range=None)
    np.testing.assert_allclose(clipped, x + np.clip(means[np.asarray(y)] - x, -0.05, 0.05),
                               rtol=1e-12)
    energy = lambda z: 0.5 * np.sum((np.asarray(z) - means[np.asarray(y)]) ** 2, -1)
    assert np.all(energy(small) < energy(x))


def test_client_sgld_clips_samples_after_the_chain_or_every_step(x64):
    """The authors' sampler clips the samples to the data range once after the R
    steps ("chain"); "step" clips after each; one step is the same either way. An
    overshooting step (gamma = 1.5 towards m = 0.9 from 0) leaves the range after the
    first step, so the two paths part."""
    means = np.asarray([[0.9, 0.5]])
    apply = _quadratic_energy(means)
    x = jnp.asarray([[0.0, 0.5]])
    y = jnp.zeros((1,), jnp.int32)
    kw = dict(noise=0.0, grad_clip=None, data_range=(0.0, 1.0), step_size=1.5)

    def literal(steps, per_step):
        z = np.asarray(x, np.float64)
        for _ in range(steps):
            z = z + 1.5 * (means - z)
            z = np.clip(z, 0.0, 1.0) if per_step else z
        return np.clip(z, 0.0, 1.0)

    for steps in (1, 2, 3):
        chain = F.client_sgld(apply, None, x, y, jax.random.key(0), steps=steps, **kw)
        step = F.client_sgld(apply, None, x, y, jax.random.key(0), steps=steps,
                             sample_clip="step", **kw)
        np.testing.assert_allclose(chain, literal(steps, False), rtol=1e-12)
        np.testing.assert_allclose(step, literal(steps, True), rtol=1e-12)
        assert (steps == 1) == bool(np.allclose(chain, step))
    with pytest.raises(ValueError, match="sample_clip"):
        F.fedevg(TOY_MODEL, sample_clip="each")


# ----------------------------------------------------------------- 6. PCD sign


def test_pcd_step_raises_real_over_negative_logits(x64):
    net = _TinyNet()
    apply = lambda p, x: net.apply(p, x)
    params = net.init(jax.random.key(1), jnp.zeros((1, 4)))
    kr, kn = jax.random.split(jax.random.key(2))
    x_real, x_neg = jax.random.normal(kr, (16, 4)), jax.random.normal(kn, (16, 4))
    y, y_neg = jnp.arange(16) % 3, (jnp.arange(16) + 1) % 3
    mask = jnp.arange(16) < 12

    def gap(p):
        f_r = jnp.take_along_axis(apply(p, x_real), y[:, None], 1)[:, 0]
        f_n = jnp.take_along_axis(apply(p, x_neg), y_neg[:, None], 1)[:, 0]
        return jnp.sum(jnp.where(mask, f_r, 0.0)) / 12 - jnp.mean(f_n)

    @jax.jit
    def check(params):
        loss, grads = jax.value_and_grad(
            lambda p: F.pcd_loss(apply, p, x_real, y, mask, x_neg, y_neg))(params)
        stepped = jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)
        return loss, gap(params), gap(stepped)

    loss, before, after = check(params)
    np.testing.assert_allclose(loss, -before, rtol=1e-12)
    assert after > before


# ----------------------------------------------------------------- 1, 8. client upload


def test_linear_client_upload_and_payload(x64):
    """Property 1 and 8: for f(x) = x W + b the upload is g_j = -W[:, y_j] and
    s_j = exp(sign(x_j W[:, y_j] + b[y_j])) at the final theta; the payload is g [M, D],
    s [M] and scalar metrics; equal inputs give equal outputs."""
    model = helpers.logreg()
    data = helpers.client(helpers.tiny_federation().train, 1)
    data = data._replace(examples={**data.examples, "x": jnp.asarray(data.examples["x"],
                                                                        jnp.float64)})
    params = jax.tree.map(lambda v: jnp.asarray(v, jnp.float64), helpers.init_params(model))
    synth = F.init_synthetic(jax.random.key(3), 6, 3, (helpers.NUM_FEATURES,))
    update = jax.jit(F.make_client_update(model, F.ClientConfig(
        local_iters=3, batch_size=4, grad_clip=None, data_range=None)))
    args = (synth.x, synth.y, data, jnp.asarray(2 ** 30), jax.random.key(4), 0.05, params)
    upload, metrics, theta = update(*args)
    w, b = helpers.logreg_to_numpy(theta)
    assert not np.allclose(w, helpers.logreg_to_numpy(params)[0])  # it trained
    y = np.asarray(synth.y)
    np.testing.assert_allclose(upload.g, -w[:, y].T, rtol=1e-12)
    f_y = np.einsum("md,dm->m", np.asarray(synth.x), w[:, y]) + b[y]
    np.testing.assert_allclose(upload.s, np.exp(np.sign(f_y)), rtol=1e-12)
    assert set(np.round(np.asarray(upload.s), 6)) <= {round(1 / E, 6), 1.0, round(E, 6)}
    assert upload.g.shape == synth.x.shape and upload.log_s.shape == (6,)
    assert all(np.shape(v) == () for v in metrics.values())
    assert int(metrics["num_steps"]) == 3
    again = update(*args)
    for a, c in zip(jax.tree.leaves((upload, metrics)), jax.tree.leaves(again[:2])):
        np.testing.assert_array_equal(a, c)


class _GroupNormNet(nn.Module):
    """Dense -> GroupNorm (2 groups, per sample) -> SiLU -> Dense."""

    @nn.compact
    def __call__(self, x):
        x = nn.silu(nn.GroupNorm(num_groups=2, epsilon=1e-5)(nn.Dense(8)(x)))
        return nn.Dense(3)(x)


def _check_per_sample_gradients(apply, x, y):
    @jax.jit
    def both(x):
        one = jax.vmap(jax.grad(lambda xi, yi: apply(None, xi[None])[0, yi]))
        return F.energy_and_grad(apply, None, x, y), one(x, y)

    (f_y, grad), per_sample = both(x)
    np.testing.assert_allclose(grad, per_sample, rtol=1e-4, atol=1e-6)
    assert f_y.shape == y.shape


def test_per_sample_upload_gradients_with_groupnorm():
    """Property 9: the batched upload gradient (one backward pass of the summed
    energies) equals vmap(grad(one sample's energy)) for a GroupNorm network."""
    net = _GroupNormNet()
    params = net.init(jax.random.key(0), jnp.zeros((1, 5)))
    _check_per_sample_gradients(lambda p, x: net.apply(params, x),
                                jax.random.normal(jax.random.key(1), (6, 5)),
                                jnp.asarray([0, 2, 1, 2, 0, 1], jnp.int32))


@pytest.mark.slow
def test_per_sample_upload_gradients_with_the_resnet10():
    model = resnet10_gn_sn((8, 8, 1), 3, width=4)
    params = model.init(jax.random.key(0))
    _check_per_sample_gradients(lambda p, x: model.apply(params, x),
                                jax.random.uniform(jax.random.key(1), (4, 8, 8, 1)),
                                jnp.asarray([0, 2, 1, 2], jnp.int32))


def test_balanced_labels_and_factory_checks():
    np.testing.assert_array_equal(S.balanced_labels(6, 3), [0, 0, 1, 1, 2, 2])
    model = helpers.logreg()
    for bad in (dict(num_synth=7), dict(ce_weight=-1.0), dict(server_noise=-0.1),
                dict(client_sgld_steps=-1), dict(training=F.TRAINING._replace(batch_size=0)),
                dict(grad_clip=0.0), dict(data_range=(1.0, 0.0)), dict(schedule="linear"),
                dict(energy_weighting="abs"), dict(training=F.TRAINING._replace(lr=0.0)),
                dict(num_rounds=0),
                dict(local_iters=0), dict(client_table="nope", persistent_client_model=True)):
        with pytest.raises(ValueError):
            F.fedevg(model, **bad)


@pytest.mark.parametrize("field, value", [("max_steps", 5), ("optimizer", optax.sgd),
                                          ("clip_norm", 1.0), ("clip_mode", "loss")])
def test_training_fields_fedevg_does_not_use_are_refused(field, value):
    with pytest.raises(H.FieldError, match="FedEvg's local training does not use it") as info:
        F.fedevg(helpers.logreg(), training=F.TRAINING._replace(**{field: value}))
    assert info.value.field == f"training.{field}"
    assert F.TRAINING == ClientTraining(lr=1e-3, batch_size=64, weight_decay=1e-4)
    assert set(F.TRAINING_FIELDS) == {"client_lr", "batch_size", "num_epochs",
                                      "weight_decay"}


# ----------------------------------------------------------------- rounds on a federation

MODEL = helpers.logreg()  # the cheapest energy model to compile; engine-level properties
PARAMS = helpers.init_params(MODEL)
DATA = helpers.tiny_federation()
TRAIN = helpers.repad(DATA.train, DATA.train.mask.shape[1] + 3)  # room for garbage rows
N = DATA.num_clients
IDS = [0, 3, 4, 1]
CONFIG = dict(num_synth=6, training=F.TRAINING._replace(batch_size=4, lr=0.01),
              server_classifier_steps=2, data_range=(-4.0, 4.0),
              server_step=0.5, server_step_end=0.05, num_rounds=10, client_step=0.1)
ALG = F.fedevg(MODEL, **CONFIG)
PERSISTENT = F.fedevg(MODEL, persistent_client_model=True, **CONFIG)
_APPLY: dict = {}


def _round(alg, state, ids=IDS, key=jax.random.key(7), execution="sequential", mask=None,
           train=TRAIN):
    if (alg, execution) not in _APPLY:
        _APPLY[alg, execution] = jax.jit(lambda s, c, k: alg.apply(s, c, k, execution))
    return _APPLY[alg, execution](state, helpers.cohort(train, ids, mask=mask), key)


def _close(a, b, **kw):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)


def test_round_keeps_shapes_and_labels_and_moves_the_synthetic_set():
    state = ALG.init(PARAMS, N)
    x0, y0 = S.synthetic_data(state)
    assert x0.shape == (6, helpers.NUM_FEATURES) and y0.dtype == jnp.int32
    new, metrics = _round(ALG, state)
    x1, y1 = S.synthetic_data(new)
    assert x1.shape == x0.shape and int(new.round) == 1
    np.testing.assert_array_equal(y1, [0, 0, 1, 1, 2, 2])
    assert helpers.tree_all_finite((new, metrics))
    assert not np.allclose(x1, x0) and np.all(np.abs(np.asarray(x1)) <= 4.0)
    assert not np.allclose(jax.tree.leaves(new.params)[0], jax.tree.leaves(PARAMS)[0])
    np.testing.assert_allclose(metrics["weights"],
                               np.asarray(helpers.TRAIN_SIZES)[IDS] / sum(
                                   np.asarray(helpers.TRAIN_SIZES)[IDS]), rtol=1e-6)
    assert metrics["num_steps"].tolist() == [math.ceil(helpers.TRAIN_SIZES[i] / 4) for i in IDS]
    # no hidden state: the same inputs and key give the same round
    again, _ = _round(ALG, state)
    _close(again, new, rtol=0, atol=0)


def test_padding_garbage_changes_nothing():
    x = np.asarray(TRAIN.examples["x"]).copy()
    x[:, -3:] = 1e6
    garbage = TRAIN._replace(examples={**TRAIN.examples, "x": jnp.asarray(x)})
    state = ALG.init(PARAMS, N)
    a, _ = _round(ALG, state)
    b, _ = _round(ALG, state, train=garbage)
    _close(a, b, rtol=0, atol=0)


def test_cohort_order_invariance():
    state = ALG.init(PARAMS, N)
    a, ma = _round(ALG, state)
    perm = np.asarray([2, 0, 3, 1])
    b, mb = _round(ALG, state, ids=list(np.asarray(IDS)[perm]))
    _close(S.synthetic_data(a), S.synthetic_data(b), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mb["client/pcd"], np.asarray(ma["client/pcd"])[perm], rtol=1e-5)


def test_masked_client_counts_like_an_empty_one():
    """A masked-out cohort row and the empty client both get weight 0."""
    state = ALG.init(PARAMS, N)
    a, _ = _round(ALG, state, ids=[0, 3, 4, 1], mask=[True, True, True, False])
    b, _ = _round(ALG, state, ids=[0, 3, 4, helpers.EMPTY_CLIENT])
    _close(S.synthetic_data(a), S.synthetic_data(b), rtol=1e-6, atol=1e-7)


def test_persistent_clients_start_fresh_then_keep_their_model():
    """Persistent clients run vmapped, stateless ones sequentially: a first visit starts
    from the same fresh model, so round 0 agrees (vmap = sequential, property 9); then the
    persistent clients continue from their stored model."""
    st, sp = ALG.init(PARAMS, N), PERSISTENT.init(PARAMS, N)
    a, _ = _round(ALG, st)
    b, _ = _round(PERSISTENT, sp, execution="vmap")
    _close(S.synthetic_data(a), S.synthetic_data(b), rtol=1e-5, atol=1e-6)
    _close(a.params, b.params, rtol=1e-5, atol=1e-6)
    last = np.asarray(b.client_states.last_round)
    assert last[IDS].tolist() == [0, 0, 0, 0] and last[[2, 5]].tolist() == [-1, -1]
    rows = PERSISTENT.client_rows(b, jnp.asarray(IDS))
    assert not np.allclose(jax.tree.leaves(rows)[0][0], jax.tree.leaves(rows)[0][1])
    # second round: stateless clients re-initialise, persistent ones continue
    key = jax.random.key(8)
    a2, _ = _round(ALG, a, key=key)
    b2, _ = _round(PERSISTENT, b._replace(aggregator_state=a.aggregator_state), key=key,
                   execution="vmap")
    assert not np.allclose(S.synthetic_data(a2)[0], S.synthetic_data(b2)[0], atol=1e-4)
    rows2 = PERSISTENT.client_rows(b2, jnp.asarray(IDS))
    assert not np.allclose(jax.tree.leaves(rows2)[0], jax.tree.leaves(rows)[0])
    np.testing.assert_array_equal(S.synthetic_data(b2)[1], S.synthetic_data(sp)[1])


def test_factory_and_round_accept_tracers():
    """Continuous hyper-parameters may be traced (vmap / grad): the round traces with
    them as tracers (shapes only, nothing compiled) and its gradient in them exists."""
    state = ALG.init(PARAMS, N)
    cohort = helpers.cohort(TRAIN, IDS)

    def final_x(h):
        alg = F.fedevg(MODEL, **{**CONFIG, "ce_weight": h[0], "client_step": h[1],
                                 "client_noise": h[2], "server_step": h[3],
                                 "server_step_end": h[4], "server_noise": h[5],
                                 "grad_clip": h[6],
                                 "training": CONFIG["training"]._replace(lr=h[7],
                                                                         weight_decay=h[8]),
                                 "server_classifier_lr": h[9],
                                 "data_range": (-h[10], h[10])})
        new, _ = alg.apply(state, cohort, jax.random.key(1), "sequential")
        return jnp.sum(new.aggregator_state.x)

    h = jnp.asarray([0.1, 0.1, 0.01, 0.5, 0.05, 0.01, 3.0, 0.01, 1e-4, 1e-3, 4.0])
    assert jax.eval_shape(jax.grad(final_x), h).shape == h.shape
    assert isinstance(jax.eval_shape(jax.vmap(final_x), jnp.stack([h, h])), jax.ShapeDtypeStruct)


def test_round_metrics_serve_with_improvement():
    """The CLI wraps every method in ``with_improvement``, which reads ``loss_before``."""
    alg = with_improvement(ALG, MODEL)
    _, metrics = jax.eval_shape(lambda s, c: alg.apply(s, c, jax.random.key(0), "sequential"),
                                ALG.init(PARAMS, N), helpers.cohort(TRAIN, IDS))
    k = len(IDS)
    assert metrics["loss_before"].shape == (k,) and metrics["loss_after"].shape == (k,)
    assert metrics["improved_fraction"].shape == () and metrics["train_loss"].shape == ()


def test_synthetic_federation_and_downstream_report():
    state, _ = _round(ALG, ALG.init(PARAMS, N))
    x, y = S.synthetic_data(state)
    fed = S.synthetic_federation(state, num_clients=2)
    assert isinstance(fed, FederatedData)
    np.testing.assert_array_equal(fed.train.num_examples, [3, 3])
    np.testing.assert_array_equal(np.sort(np.asarray(fed.train.examples["y"]).ravel()),
                                  np.asarray(y))
    np.testing.assert_allclose(np.sort(np.asarray(fed.train.examples["x"]).ravel()),
                               np.sort(np.asarray(x).ravel()))
    assert int(np.asarray(fed.test.num_examples).sum()) == 0
    with_test = S.synthetic_federation(state, N, test=DATA.test)
    assert with_test.train.examples["x"].shape == (N, 1, helpers.NUM_FEATURES)
    with pytest.raises(ValueError):
        S.synthetic_federation(state, 1, test=DATA.test)  # one test row per client
    report = S.downstream_report(MODEL, ALG, state, DATA.test, epochs=2, batch_size=4)
    assert report["downstream_steps"] == 4 and report["num_synth"] == 6
    assert 0.0 <= report["downstream_accuracy"] <= 1.0
