"""The synthetic-set evaluation shared by the generative methods
(fedjax_fair/algorithms/families/generative.py): the Fréchet distance against
``scipy.linalg.sqrtm``, the feature distance on a classifier's logits, the sample grids."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from fedjax_fair.algorithms.families import generative as S
from fedjax_fair.models import mlp


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


# ----------------------------------------------------------------- evaluation (FedEvg thesis Tables 4.4-4.5, sample grids)


def _numpy_frechet(a, b):
    """The literal formula with scipy.linalg.sqrtm (float64)."""
    from scipy import linalg

    mu_a, mu_b = a.mean(0), b.mean(0)
    ca, cb = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    root = linalg.sqrtm(ca @ cb)
    return float(np.sum((mu_a - mu_b) ** 2) + np.trace(ca) + np.trace(cb)
                 - 2.0 * np.real(np.trace(root)))


FRECHET = jax.jit(S.frechet_distance)


def test_frechet_distance_matches_scipy_sqrtm(x64):
    rng = np.random.default_rng(0)
    frechet = FRECHET
    a = rng.normal(size=(120, 10)) @ rng.normal(size=(10, 10))
    for scale in (0.7, 3.0):
        b = 0.5 + rng.normal(size=(120, 10)) @ rng.normal(size=(10, 10)) * scale
        got = frechet(jnp.asarray(a), jnp.asarray(b))
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(float(got), _numpy_frechet(a, b), rtol=1e-9)
        # symmetric in its arguments
        np.testing.assert_allclose(float(frechet(b, a)), float(got), rtol=1e-9)


def test_frechet_distance_identical_and_shifted_sets(x64):
    rng = np.random.default_rng(1)
    a = rng.normal(size=(300, 6)) @ rng.normal(size=(6, 6))
    assert abs(float(FRECHET(a, a))) < 1e-9
    shift = rng.normal(size=6)
    # equal covariances: the closed form ||delta mu||^2
    np.testing.assert_allclose(float(FRECHET(a, a + shift)), np.sum(shift ** 2), rtol=1e-8)
    # singular covariances (n <= d) stay finite and non-negative; float32 works too
    few = rng.normal(size=(4, 6))
    assert float(FRECHET(few, few)) < 1e-6
    f32 = FRECHET(jnp.asarray(a, jnp.float32), jnp.asarray(a + shift, jnp.float32))
    assert f32.dtype == jnp.float32
    np.testing.assert_allclose(float(f32), np.sum(shift ** 2), rtol=1e-3)
    with pytest.raises(ValueError):
        S.frechet_distance(a[:1], a)
    with pytest.raises(ValueError):
        S.frechet_distance(a, a[:, :3])


def test_feature_distance_uses_the_classifier_logits():
    rng = np.random.default_rng(2)
    model = mlp((4, 4, 1), 3, hidden=(8,))
    train = helpers.pack([(rng.uniform(size=(20, 4, 4, 1)).astype(np.float32),
                           np.full(20, c, np.int32)) for c in range(3)])
    x, y = S.pooled_examples(train)
    assert x.shape == (60, 4, 4, 1) and sorted(np.bincount(y)) == [20, 20, 20]
    params, loss = S.feature_classifier(model, train, jax.random.key(0), steps=5, batch_size=16)
    assert np.isfinite(loss)
    xs = jnp.asarray(rng.uniform(size=(30, 4, 4, 1)), jnp.float32)
    distance = jax.jit(lambda p, a, b: S.feature_distance(model, p, a, b))
    want = FRECHET(model.apply(params, xs), model.apply(params, x[:30]))
    np.testing.assert_allclose(float(distance(params, xs, x[:30])), float(want), rtol=1e-5)
    assert float(want) > 0 and float(distance(params, x[:30], x[:30])) < 1e-3


@pytest.mark.parametrize("shape", [(8, 8, 1), (28, 28), (32, 32, 3)])
def test_plot_sample_grid_writes_a_png(tmp_path, shape):
    rng = np.random.default_rng(3)
    labels = np.repeat(np.arange(3), 4)
    snaps = [rng.uniform(-0.2, 1.2, size=(12, *shape)) for _ in range(2)]
    path = tmp_path / "grid.png"
    fig = S.plot_sample_grid(snaps, labels, [0, 50], str(path), num_classes=3, per_class=4,
                             context="test")
    assert path.stat().st_size > 0 and len(fig.axes) == 2
    grid = S._grid_image(snaps[0], labels, 3, 4, (0.0, 1.0))
    h, w = shape[:2]
    assert grid.shape[:2] == (3 * (h + 1) - 1, 4 * (w + 1) - 1)
    assert grid.min() >= 0.0 and grid.max() <= 1.0
    np.testing.assert_allclose(grid[:h, :w].reshape(h, w, -1),
                               np.clip(snaps[0][0], 0, 1).reshape(h, w, -1))
    with pytest.raises(ValueError):
        S.plot_sample_grid(snaps, labels, [0], None, num_classes=3)
