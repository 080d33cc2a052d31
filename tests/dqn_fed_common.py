"""Shared pieces of the DQN-Fed tests (tests/test_dqn_fed_server.py,
tests/test_dqn_fed.py): the module, a jitted ``dqn_combine``, client vectors as a
two-leaf pytree, and the paper's literal Gram-Schmidt equations in NumPy (float64)."""
from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np

D = importlib.import_module("fedjax_fair.algorithms.dqn_fed")  # the package exports the factory dqn_fed


_combine = jax.jit(D.dqn_combine, static_argnames=("solver",))  # one compile per shape


def _tree(flat, k, dtype=jnp.float32):
    """[K, 10] -> a two-leaf pytree with leading axis K."""
    return {"w": jnp.asarray(flat[:, :6].reshape(k, 2, 3), dtype),
            "b": jnp.asarray(flat[:, 6:], dtype)}


def _flat(tree):
    return np.concatenate([np.asarray(tree["w"], np.float64).reshape(-1),
                           np.asarray(tree["b"], np.float64).reshape(-1)])


def np_literal(G, dt):
    """Eqs. 7-8 (scaled Gram-Schmidt), 11-12 (lambda*), 17 (eta = S), float64."""
    tilde = []
    for k in range(len(G)):
        coef = [G[k] @ t / (t @ t) for t in tilde]
        residual = G[k] - sum((c * t for c, t in zip(coef, tilde)), np.zeros_like(G[k]))
        tilde.append(residual / (dt[k] - sum(coef)))
    tilde = np.array(tilde)
    inv = 1.0 / np.sum(tilde * tilde, axis=1)
    S = inv.sum()
    lam = inv / S
    return tilde, lam, S, lam @ tilde

