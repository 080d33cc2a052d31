"""FedMax, FedMax(k) and FedSoftMax (``algorithms/fedmax.py``; arXiv:2307.06283):
the weights against literal NumPy float64 transcriptions, ties, limits and
reductions (beta = 0 and equal losses give FedAvg, large beta gives FedMax,
FedMax(1) = FedMax, FedMax(M) = uniform), FedMax(k)'s fraction over active rows,
skew monotone in beta, the loss statistic read, and (slow) a FedMax round that
returns the worst client's model.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from helpers import (client_output as _out, full_context as _full_ctx, SKEWED_KW as KW,
                     skewed_np_clients as _np_clients, assert_skewed_step as _assert_step,
                     skewed_rounds)
from fedjax_fair.algorithms.fedmax import (effective_k, fedmax, fedmax_k_mixing,
                                           fedmax_k_weights, fedmax_mixing, fedmax_weights,
                                           fedsoftmax_mixing, fedsoftmax_weights)

K = 6  # cohort rows


# ------------------------------------------------------------- NumPy float64 references


def np_fedmax(losses):
    losses = np.asarray(losses, np.float64)
    sel = (losses == losses.max()).astype(np.float64)
    return sel / sel.sum()


def np_fedmax_k(losses, k):
    """Uniform over the k largest losses; ties by lower index (Python sort)."""
    order = sorted(range(len(losses)), key=lambda i: (-losses[i], i))[:k]
    w = np.zeros(len(losses))
    w[order] = 1.0 / k
    return w


# ------------------------------------------------------ FedMax / FedMax(k) / FedSoftMax


def test_fedmax_family_matches_reference(rng):
    for _ in range(10):
        f = rng.uniform(0, 3, size=K).astype(np.float32)
        n = rng.integers(1, 40, size=K)
        mask = jnp.ones(K, bool)
        np.testing.assert_allclose(fedmax_weights(f, mask), np_fedmax(f))
        for k in (1, 2, 4, K):
            w = np.asarray(fedmax_k_weights(f, mask, k))
            np.testing.assert_allclose(w, np_fedmax_k(f, k), rtol=1e-7)
            assert np.sum(w > 0) == k and np.all(w[w > 0] == np.float32(1 / k))
        for beta in (0.0, 5.0, 30.0):
            p = n * np.exp(beta * (f.astype(np.float64) - f.max()))
            np.testing.assert_allclose(fedsoftmax_weights(f, n, mask, beta), p / p.sum(),
                                       rtol=2e-5, atol=1e-30)
    # Ties: FedMax shares, FedMax(k) takes the lower row.
    f = np.array([1.0, 3.0, 2.0, 3.0], np.float32)
    np.testing.assert_allclose(fedmax_weights(f, jnp.ones(4, bool)), [0, 0.5, 0, 0.5])
    np.testing.assert_allclose(fedmax_k_weights(f, jnp.ones(4, bool), 1), [0, 1, 0, 0])
    np.testing.assert_allclose(fedmax_k_weights(f, jnp.ones(4, bool), 3), [0, 1 / 3, 1 / 3, 1 / 3])


def test_fedmax_limits_and_reductions():
    """FedSoftMax (arXiv:2307.06283): beta = 0 and equal losses give FedAvg;
    a common shift changes nothing; beta = 1e4 with gaps >= 0.01 equals FedMax;
    FedMax(1) = FedMax; FedMax(M) = uniform."""
    mask = jnp.ones(6, bool)
    n = np.array([3, 9, 4, 1, 7, 5])
    gaps = np.array([0.31, 0.52, 0.12, 0.53, 0.41, 0.05], np.float32)
    np.testing.assert_allclose(fedsoftmax_weights(gaps, n, mask, 0.0), n / n.sum(), rtol=1e-6)
    np.testing.assert_allclose(fedsoftmax_weights(gaps, n, mask, 1e4), np_fedmax(gaps),
                               atol=1e-6)
    np.testing.assert_allclose(fedsoftmax_weights(gaps + 4.0, n, mask, 5.0),
                               fedsoftmax_weights(gaps, n, mask, 5.0), rtol=1e-5)
    np.testing.assert_allclose(fedmax_k_weights(gaps, mask, 1), fedmax_weights(gaps, mask))
    np.testing.assert_allclose(fedmax_k_weights(gaps, mask, 6), np.full(6, 1 / 6), rtol=1e-6)
    np.testing.assert_allclose(fedmax_k_weights(gaps, mask, 0.5), [0, 1 / 3, 0, 1 / 3, 1 / 3, 0],
                               rtol=1e-6)  # floor(0.5 * 6) = 3 largest gaps


def test_fedmax_k_fraction_counts_only_active_rows():
    assert int(effective_k(0.1, 10)) == 1 and int(effective_k(0.25, 10)) == 2
    assert int(effective_k(0.1, 3)) == 1 and int(effective_k(5, 3)) == 3
    assert int(effective_k(2.0, 10)) == 2
    f = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2], np.float32)
    mask = np.array([False, True, True, True, True, False, False, False])
    w = np.asarray(jax.jit(lambda f, m: fedmax_k_weights(f, m, 0.5))(f, mask))
    np.testing.assert_allclose(w, [0, 0.5, 0.5, 0, 0, 0, 0, 0])  # floor(0.5 * 4) = 2
    with pytest.raises(ValueError, match=r"^k: "):
        fedmax_k_mixing(0.0)
    with pytest.raises(ValueError, match=r"^k: "):
        fedmax_k_mixing(2.5)


def test_skew_is_monotone_in_beta():
    """Skew (arXiv:2307.06283, Section 1.3): heterogeneous 1-D quadratics
    F_i(w) = a_i (w - c_i)^2 / 2 (F_i* = 0): rho(FedAvg) = 1,
    rho(FedMax) = max gap / sum p gap, and rho(FedSoftMax(beta)) is non-decreasing in
    beta and lies between the two."""
    a = np.array([1.0, 2.0, 0.5, 3.0, 1.5])
    c = np.array([-1.0, 0.5, 2.0, 1.0, -0.3])
    n = np.array([10, 20, 5, 8, 12])
    p = n / n.sum()
    mask = jnp.ones(5, bool)
    for w in (-0.5, 0.3, 1.7):
        gap = (a * (w - c) ** 2 / 2).astype(np.float32)
        rho = lambda alpha: float(np.dot(alpha, gap) / np.dot(p, gap))
        assert rho(np.asarray(fedsoftmax_weights(gap, n, mask, 0.0))) == pytest.approx(1.0, 1e-6)
        rho_max = rho(np.asarray(fedmax_weights(gap, mask)))
        assert rho_max == pytest.approx(gap.max() / np.dot(p, gap), rel=1e-6) and rho_max >= 1
        rhos = [rho(np.asarray(fedsoftmax_weights(gap, n, mask, b)))
                for b in np.linspace(0, 40, 41)]
        assert np.all(np.diff(rhos) >= -1e-6)
        assert 1 - 1e-6 <= min(rhos) and max(rhos) <= rho_max + 1e-5


def test_fedmax_family_reads_the_chosen_loss_statistic():
    """The default reads the paper's F_i(theta^t), the server model's pre-round loss
    (loss_before); "last_epoch" the authors' code's last-epoch running loss
    (train_loss)."""
    out = _out([0.1, 0.9, 0.5])._replace(train_loss=jnp.array([0.8, 0.2, 0.1]))
    ctx = _full_ctx(3)
    for rule, last_top, pre_top in ((fedmax_mixing, 0, 1),
                                    (lambda **kw: fedsoftmax_mixing(50.0, **kw), 0, 1),
                                    (lambda **kw: fedmax_k_mixing(1, **kw), 0, 1)):
        w_default, _ = rule().update(rule().init(3), out, ctx)
        w_last, _ = rule(loss_source="last_epoch").update((), out, ctx)
        assert int(jnp.argmax(w_default)) == pre_top
        assert int(jnp.argmax(w_last)) == last_top
    with pytest.raises(ValueError, match="^loss_source"):
        fedmax_mixing(loss_source="post_round")


# ------------------------------------------------------------------------- whole rounds
# The skewed federation of helpers.skewed_train (6 clients, M = 12): clients 0-3
# and client 4 are labelled by opposite linear teachers, client 5 is empty; clients
# train full-batch, so NumPy gradient descent reproduces every local model.
# helpers.skewed_rounds compiles each algorithm once for every test below.

MODEL = helpers.logreg()
FACTORIES = {
    "fedmax": lambda: fedmax(MODEL, loss_source="pre_round", **KW),
}
_rounds = skewed_rounds(FACTORIES)


@pytest.mark.slow
def test_fedmax_round_returns_the_worst_clients_model():
    """One-hot weights on j give theta' = theta_j (the aggregation of AAggFF thesis eq. 3.13)."""
    state, metrics = _rounds("fedmax")
    losses = np.asarray(metrics["loss_before"])
    j = int(np.argmax(losses))
    np.testing.assert_allclose(metrics["weights"], np_fedmax(losses))
    _assert_step(state.params, _np_clients()[j][0])
