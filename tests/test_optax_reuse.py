"""Checks behind reusing optax where it already does the job (tree arithmetic, byte
counts) and behind *keeping* the hand-written simplex projection.

Each test compares the hand-written version that was replaced (copied here literally as
the reference) with what the package now uses, or, for the simplex, optax's
``projection_simplex`` with ``solvers.simplex`` (which stays: no masks, and its
``scale`` path v / scale ... * scale loses accuracy for a radius other than 1)."""
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_fair.algorithms.families import second_order
from fedjax_fair.core import client_states, memory
from fedjax_fair.solvers import simplex

pfedme = importlib.import_module("fedjax_fair.algorithms.pfedme")  # the package exports the factory


# ------------------------------------------------------------ literal references


def _reference_project_simplex_masked(v, mask, radius: float = 1.0):
    """solvers/simplex.py's body before the optax review (kept there unchanged)."""
    v = jnp.asarray(v)
    if v.ndim != 1:
        raise ValueError(f"v: must be a vector, got shape {v.shape}")
    dtype = v.dtype if jnp.issubdtype(v.dtype, jnp.floating) else jnp.float32
    v = v.astype(dtype)
    mask = jnp.asarray(mask, bool)
    k = v.shape[0]
    count = jnp.sum(mask)
    u = -jnp.sort(-jnp.where(mask, v, -jnp.inf))
    real = jnp.arange(k) < count
    u = jnp.where(real, u, 0.0)
    cumsum = jnp.cumsum(u)
    j = jnp.arange(1, k + 1, dtype=dtype)
    support = real & (u * j > cumsum - radius)
    rho = jnp.maximum(jnp.max(jnp.where(support, jnp.arange(1, k + 1), 0)), 1)
    tau = (cumsum[rho - 1] - radius) / rho.astype(dtype)
    return jnp.where(mask, jnp.maximum(v - tau, 0.0), 0.0)


def _reference_project_simplex(v, radius: float = 1.0):
    v = jnp.asarray(v)
    return _reference_project_simplex_masked(v, jnp.ones(v.shape, bool), radius)


def _dqn_axpy(a, x, y):
    """algorithms/dqn_fed.py's former _axpy: a * x + y."""
    return jax.tree.map(lambda u, w: a * u + w, x, y)


def _pfedme_axpy(x, a, y):
    """algorithms/pfedme.py's former _axpy: x + a y in x's dtypes."""
    return jax.tree.map(lambda u, v: (u + a * v).astype(u.dtype), x, y)


def _tree_norm(tree):
    """algorithms/families/second_order.py's former tree_norm."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def _row_bytes(row) -> int:
    """core/client_states.py's former _row_bytes / _tree_bytes."""
    return int(sum(np.prod(np.shape(x), dtype=np.int64) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(row)))


def _exact_projection(v, radius=1.0):
    """Float64 NumPy projection of ``v`` (Duchi et al. 2008, Fig. 1)."""
    v = np.asarray(v, np.float64)
    u = np.sort(v)[::-1]
    c = np.cumsum(u)
    j = np.arange(1, v.size + 1)
    rho = np.max(j[u - (c - radius) / j > 0])
    return np.maximum(v - (c[rho - 1] - radius) / rho, 0.0)


_OPTAX = jax.jit(optax.projections.projection_simplex)
_OURS = jax.jit(simplex.project_simplex, static_argnames="radius")
_OURS_MASKED = jax.jit(simplex.project_simplex_masked, static_argnames="radius")
_REF = jax.jit(_reference_project_simplex, static_argnames="radius")
_REF_MASKED = jax.jit(_reference_project_simplex_masked, static_argnames="radius")


def _leaves_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _tree(rng, dtype=jnp.float32):
    return {"w": jnp.asarray(rng.normal(size=(3, 4)), dtype),
            "b": jnp.asarray(rng.normal(size=(4,)), dtype),
            "s": jnp.asarray(rng.normal(), dtype)}


# ------------------------------------------------------------- simplex: ours kept


SPECIAL = [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0], [3.0, 3.0, 1.0, 0.0],
           [0.5, 0.5, 0.5, -2.0], [0.0] * 5, [-1e3, 0.0, 1e-30], [7.0], [2.0, 2.0],
           [1e-12, -1e-12, 0.0], [-5.0, -5.0, -5.0]]


def test_module_projection_is_the_reference_bit_for_bit():
    rng = np.random.default_rng(0)
    for dtype in (jnp.float32,):
        for k in (1, 2, 5, 37):
            for radius in (1.0, 2.5):
                v = jnp.asarray(rng.normal(size=k) * 3, dtype)
                mask = jnp.asarray(rng.random(k) < 0.6)
                np.testing.assert_array_equal(_OURS(v, radius=radius), _REF(v, radius=radius))
                np.testing.assert_array_equal(_OURS_MASKED(v, mask, radius=radius),
                                              _REF_MASKED(v, mask, radius=radius))


@pytest.mark.parametrize("x64", [False, True])
def test_optax_matches_ours_on_random_vectors_at_radius_one(x64):
    """Unit radius: optax and ours agree to a few ulps of the inputs' scale (measured
    max |diff| 1.9e-7 at unit scale in float32, 2.8e-16 in float64)."""
    with jax.enable_x64(x64):
        dtype = jnp.float64 if x64 else jnp.float32
        tol = 1e-12 if x64 else 1e-6
        rng = np.random.default_rng(1)
        worst = 0.0
        for scale in (1e-6, 1e-3, 1.0, 10.0):
            for k in (1, 2, 3, 10, 100, 1000):
                for _ in range(5):
                    v = jnp.asarray(rng.normal(size=k) * scale, dtype)
                    a, b = np.asarray(_OURS(v)), np.asarray(_OPTAX(v))
                    assert a.dtype == b.dtype == np.dtype(dtype)
                    diff = float(np.max(np.abs(a - b)))
                    worst = max(worst, diff / max(1.0, scale))
        assert worst <= tol, worst


@pytest.mark.parametrize("v", SPECIAL)
def test_optax_matches_ours_on_ties_one_hot_and_equal_inputs(v):
    v = jnp.asarray(v, jnp.float32)
    np.testing.assert_allclose(_OURS(v), _OPTAX(v), atol=1e-6)
    np.testing.assert_allclose(_OURS(v), _exact_projection(v), atol=1e-6)


def test_optax_matches_ours_under_vmap_and_in_gradients():
    rng = np.random.default_rng(2)
    batch = jnp.asarray(rng.normal(size=(16, 9)), jnp.float32)
    np.testing.assert_allclose(jax.vmap(simplex.project_simplex)(batch),
                               jax.vmap(optax.projections.projection_simplex)(batch), atol=1e-6)
    weights = jnp.arange(9.0) ** 2
    for v in batch[:4]:
        g_ours = jax.grad(lambda x: jnp.sum(simplex.project_simplex(x) * weights))(v)
        g_opt = jax.grad(
            lambda x: jnp.sum(optax.projections.projection_simplex(x) * weights))(v)
        np.testing.assert_allclose(g_ours, g_opt, atol=1e-5)
        # traced radius: optax's scale and ours give the same derivative
        d_ours = jax.grad(lambda r: jnp.sum(simplex.project_simplex(v, r) ** 2))(2.0)
        d_opt = jax.grad(
            lambda r: jnp.sum(optax.projections.projection_simplex(v, r) ** 2))(2.0)
        np.testing.assert_allclose(d_ours, d_opt, rtol=1e-5)


def test_masked_projection_needs_compaction_in_optax():
    """optax has no mask: it agrees with ours only on the compacted vector v[mask],
    a data-dependent shape that cannot be traced (so ours stays)."""
    rng = np.random.default_rng(3)
    v = jnp.asarray(rng.normal(size=12), jnp.float32)
    mask = np.asarray(rng.random(12) < 0.5)
    mask[0] = True
    ours = np.asarray(simplex.project_simplex_masked(v, jnp.asarray(mask)))
    np.testing.assert_allclose(ours[mask], _OPTAX(v[mask]), atol=1e-6)
    assert np.all(ours[~mask] == 0)
    empty = simplex.project_simplex_masked(v, jnp.zeros(12, bool))
    np.testing.assert_array_equal(empty, np.zeros(12, np.float32))


def test_optax_scale_path_is_less_accurate_for_other_radii():
    """optax projects v / scale and multiplies back: two extra roundings. At a radius of
    2.5 on float32 inputs near 1e3 (a non-trivial support) the two differ by ~2e-4,
    far beyond 1e-6; ours is the closer to the float64 projection (max error 1.0e-4
    against optax's 1.2e-4; both are float32 cancellation at ulp(1e3) = 6e-5)."""
    rng = np.random.default_rng(0)
    err_ours = err_optax = diff = 0.0
    for k in (2, 10, 100):
        for _ in range(20):
            v = jnp.asarray(1e3 + rng.normal(size=k), jnp.float32)
            exact = _exact_projection(v, 2.5)
            a, b = np.asarray(_OURS(v, radius=2.5)), np.asarray(_OPTAX(v, 2.5))
            err_ours = max(err_ours, float(np.max(np.abs(a - exact))))
            err_optax = max(err_optax, float(np.max(np.abs(b - exact))))
            diff = max(diff, float(np.max(np.abs(a - b))))
    assert diff > 1e-6
    assert err_ours <= err_optax


# --------------------------------------------------------------- tree arithmetic


@pytest.mark.parametrize("x64", [False, True])
def test_add_scale_is_the_former_dqn_axpy_bit_for_bit(x64):
    with jax.enable_x64(x64):
        rng = np.random.default_rng(4)
        for dtype in (jnp.float32, jnp.bfloat16) + ((jnp.float64,) if x64 else ()):
            x, y = _tree(rng, dtype), _tree(rng, dtype)
            for a in (jnp.asarray(-0.3, jnp.float32), jnp.asarray(1.7, dtype)):
                _leaves_equal(optax.tree.add_scale(y, a, x), _dqn_axpy(a, x, y))
                jitted = jax.jit(lambda a, x, y: optax.tree.add_scale(y, a, x))(a, x, y)
                _leaves_equal(jitted, jax.jit(_dqn_axpy)(a, x, y))
            _leaves_equal(optax.tree.scale(0.25, x), jax.tree.map(lambda v: 0.25 * v, x))
            _leaves_equal(optax.tree.sub(x, y), jax.tree.map(jnp.subtract, x, y))


def test_pfedme_axpy_keeps_the_leaf_dtypes_bit_for_bit():
    with jax.enable_x64(True):
        rng = np.random.default_rng(5)
        for dtype in (jnp.float32, jnp.bfloat16, jnp.float64):
            x, y = _tree(rng, dtype), _tree(rng, dtype)
            for a in (-0.05, jnp.asarray(-0.05, jnp.float64), jnp.asarray(2.0, jnp.float32)):
                _leaves_equal(pfedme._axpy(x, a, y), _pfedme_axpy(x, a, y))
                _leaves_equal(jax.jit(pfedme._axpy)(x, a, y), jax.jit(_pfedme_axpy)(x, a, y))


@pytest.mark.parametrize("x64", [False, True])
def test_tree_norm_is_the_former_one_bit_for_bit(x64):
    with jax.enable_x64(x64):
        rng = np.random.default_rng(6)
        dtypes = (jnp.float32, jnp.bfloat16) + ((jnp.float64,) if x64 else ())
        for dtype in dtypes:
            tree = _tree(rng, dtype)
            new, old = second_order.tree_norm(tree), _tree_norm(tree)
            assert new.dtype == old.dtype
            np.testing.assert_array_equal(new, old)
            np.testing.assert_array_equal(jax.jit(second_order.tree_norm)(tree),
                                          jax.jit(_tree_norm)(tree))
        np.testing.assert_array_equal(second_order.tree_norm({}), _tree_norm({}))


# ------------------------------------------------------------------- byte counts


def test_memory_tree_bytes_is_the_former_client_states_count():
    trees = [{"a": jnp.zeros((3, 5), jnp.float32), "b": jnp.zeros((7,), jnp.bfloat16),
              "c": jnp.zeros((), jnp.int32), "d": np.zeros((2, 0), np.float64)},
             jax.ShapeDtypeStruct((1000, 1000, 3), jnp.float32), {}, (jnp.ones(4, bool),)]
    for tree in trees:
        assert memory.tree_bytes(tree) == _row_bytes(tree)
    row = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
    for table_kind in (client_states.dense(), client_states.dense(jnp.bfloat16)):
        table = table_kind.init(row, 10)
        report = table_kind.memory(table)
        assert report["bytes"] == _row_bytes(table)
        assert report["bytes_per_row"] == _row_bytes(table.rows) // 10
    assert math.prod(()) == int(np.prod((), dtype=np.int64)) == 1
