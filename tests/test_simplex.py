"""The simplex helpers the loss-driven fair rules share (``solvers/simplex.py``):
Euclidean projection onto the simplex (plain and masked), the masked softmax, and
exponentiated gradient, which unifies FedAvg, q-FFL, TERM and PropFair (AAggFF
thesis, Remark 3.1), each against a literal NumPy float64 transcription.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair.solvers.simplex import (exponentiated_gradient, masked_softmax,
                                         project_simplex, project_simplex_masked)
from helpers import np_project_simplex, np_term, np_qffl_mixing, np_propfair


# ------------------------------------------------------------- NumPy float64 references


# ---------------------------------------------------------------------- simplex helpers


_PROJECT = jax.jit(project_simplex, static_argnames="radius")
_PROJECT_MASKED = jax.jit(project_simplex_masked, static_argnames="radius")


def test_project_simplex_matches_bisection_reference(rng):
    for k in (1, 5, 17):
        for scale in (0.01, 1.0, 100.0):
            for _ in range(5):
                v = (rng.normal(size=k) * scale).astype(np.float32)
                p = np.asarray(_PROJECT(v))
                np.testing.assert_allclose(p, np_project_simplex(v), atol=2e-6 * max(1, scale))
                assert p.min() >= 0 and abs(p.sum() - 1) < 1e-5


def test_project_simplex_properties(rng):
    # A point of the simplex is its own projection; shifting v by c changes nothing.
    p = rng.dirichlet(np.ones(5)).astype(np.float32)
    np.testing.assert_allclose(_PROJECT(p), p, atol=1e-6)
    v = rng.normal(size=5).astype(np.float32)
    np.testing.assert_allclose(_PROJECT(v + 3.0), _PROJECT(v), atol=1e-6)
    np.testing.assert_allclose(_PROJECT(np.zeros(5, np.float32)), np.full(5, 0.2))
    np.testing.assert_allclose(_PROJECT(np.array([5.0, 0, -1, 0, 0], np.float32)), [1, 0, 0, 0, 0])
    np.testing.assert_allclose(_PROJECT(v, radius=2.0), np_project_simplex(v, 2.0), atol=1e-5)
    # vmap over a batch of vectors.
    batch = rng.normal(size=(8, 5)).astype(np.float32)
    out = jax.jit(jax.vmap(project_simplex))(batch)
    for row, ref in zip(np.asarray(out), batch):
        np.testing.assert_allclose(row, np_project_simplex(ref), atol=1e-6)


def test_project_simplex_masked_projects_only_the_masked_coordinates(rng):
    v = rng.normal(size=5).astype(np.float32)
    mask = np.array([1, 0, 1, 1, 0], bool)
    p = np.asarray(_PROJECT_MASKED(v, mask))
    np.testing.assert_array_equal(p[~mask], 0.0)
    np.testing.assert_allclose(p[mask], np_project_simplex(v[mask]), atol=1e-6)
    # Masked-out values, even inf / NaN, do not matter.
    w = v.copy()
    w[~mask] = [np.inf, np.nan]
    np.testing.assert_array_equal(_PROJECT_MASKED(w, mask), p)
    np.testing.assert_array_equal(_PROJECT_MASKED(v, np.zeros(5, bool)), 0.0)


def test_masked_softmax_is_stable_and_handles_empty_support():
    z = jnp.array([1e4, 1e4 - 1.0, -1e4, 3.0])
    w = np.asarray(masked_softmax(z, jnp.array([True, True, True, False])))
    e = np.exp([0.0, -1.0])
    np.testing.assert_allclose(w, [e[0] / e.sum(), e[1] / e.sum(), 0.0, 0.0], rtol=1e-6)
    w = masked_softmax(jnp.array([-jnp.inf, -jnp.inf, 2.0]), jnp.array([True, True, False]))
    np.testing.assert_allclose(w, [0.5, 0.5, 0.0])  # no finite logit: uniform over the mask
    np.testing.assert_array_equal(masked_softmax(jnp.zeros(3), jnp.zeros(3, bool)), 0.0)


def test_exponentiated_gradient_unifies_the_rules(rng):
    """Unification (AAggFF thesis, Remark 3.1 and appendix §8.1): EG with prior n / sum n reproduces FedAvg (r = 0), q-FFL
    (r = q log F, zeta = 1), TERM (r = F, zeta = 1 / lambda) and PropFair
    (r = -log(M - F), zeta = 1) to 1e-6 after normalisation."""
    mask = jnp.ones(6, bool)
    for _ in range(5):
        f = rng.uniform(0.05, 1.9, size=6)
        n = rng.integers(1, 50, size=6).astype(np.float64)
        fj, nj = jnp.asarray(f, jnp.float32), jnp.asarray(n, jnp.float32)
        q, lam, m = 2.0, 3.0, 2.0
        cases = [(jnp.zeros(6), 1.0, n / n.sum()),
                 (q * jnp.log(fj), 1.0, np_qffl_mixing(f, n, q)),
                 (fj, 1.0 / lam, np_term(f, n, lam)),
                 (-jnp.log(m - fj), 1.0, np_propfair(f, n, m, 1e-9))]
        for r, zeta, ref in cases:
            np.testing.assert_allclose(exponentiated_gradient(r, nj, mask, zeta), ref,
                                       rtol=1e-5, atol=1e-6)
