"""TERM's mixing rule (``algorithms/term.py``; Li et al. 2021): the tilted weights
against a literal NumPy float64 transcription, the reduction t -> 0 to FedAvg, shift
invariance and log-sum-exp stability at huge tilts and losses.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fedjax_fair.algorithms.term import term_mixing, term_weights
from fedjax_fair.core.mixing import by_num_examples
from helpers import rule_weights as _weights, np_term

K = 6  # cohort rows


# ------------------------------------------------------------- NumPy float64 references


# --------------------------------------------------------------------------------- TERM


def test_term_matches_reference_and_reduces_to_fedavg(rng):
    for _ in range(5):
        f = rng.uniform(0, 3, size=K).astype(np.float32)
        n = rng.integers(1, 40, size=K)
        for t in (0.1, 1.0, 5.0, -2.0):
            w, _ = _weights(term_mixing(t), f, n)
            np.testing.assert_allclose(w, np_term(f, n, t), rtol=1e-5)
            w, _ = _weights(term_mixing(t, weight_by_size=False), f, n)
            np.testing.assert_allclose(w, np_term(f, np.ones(K), t), rtol=1e-5)
        # t -> 0: FedAvg's data weights (exact at t = 0).
        w, _ = _weights(term_mixing(1e-8), f, n)
        np.testing.assert_allclose(w, n / n.sum(), rtol=1e-6)
        w, _ = _weights(term_mixing(0.0), f, n)
        fedavg_w, _ = _weights(by_num_examples(), f, n)
        np.testing.assert_allclose(w, fedavg_w, rtol=1e-6)
    # Shift invariance and log-sum-exp stability at huge tilts / losses.
    f = np.array([1e3, 999.0, 5.0], np.float32)
    w = np.asarray(term_weights(f, np.ones(3), jnp.ones(3, bool), 50.0))
    np.testing.assert_allclose(w, [1 / (1 + np.exp(-50.0)), np.exp(-50.0) / (1 + np.exp(-50.0)),
                                   0.0], rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(term_weights(f + 7.0, np.ones(3), jnp.ones(3, bool), 0.5),
                               term_weights(f, np.ones(3), jnp.ones(3, bool), 0.5), rtol=1e-5)
