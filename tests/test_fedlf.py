"""FedLF (Pan et al., AAAI 2024), a DQN-Fed baseline (Mohajer Hamidi, Ye, TMLR,
OpenReview KbteA50cni).

Every server step is checked against a literal float64 NumPy transcription of the
authors' code (``get_FedLF_d_layers`` and ``train_a_round`` with cvxopt replaced by an
exact enumeration of the simplex QP's faces), over several rounds with partial
participation, history rows and masked padding rows; then the reductions, the
persistence of per-client state for clients outside the cohort, vmap == sequential,
and a short run on a synthetic federation. FedHEAL: tests/test_fedheal.py.
"""
from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from fedjax_fair.core.client import ClientTraining, local_training
from fedheal_fedlf_common import (FL, FULL_BATCH, _jit_apply, _logreg_loss_numpy,
                                  check_vmap_equals_sequential_and_accuracy_rises,
                                  _np_leaves)


# ======================================================================== FedLF


def minnorm_reference(rows):
    """argmin ||lambda^T Q|| over the simplex by enumerating supports (exact KKT on
    each face; the smallest feasible objective). Returns (lambda, d)."""
    q = np.asarray(rows, np.float64)
    g = q @ q.T
    p = len(q)
    best, best_f = None, np.inf
    for size in range(1, p + 1):
        for support in itertools.combinations(range(p), size):
            s = list(support)
            a = np.zeros((size + 1, size + 1))
            a[:size, :size] = g[np.ix_(s, s)]
            a[:size, size] = 1.0
            a[size, :size] = 1.0
            rhs = np.zeros(size + 1)
            rhs[size] = 1.0
            x = np.linalg.lstsq(a, rhs, rcond=None)[0][:size]
            if np.all(x >= -1e-12) and abs(x.sum() - 1) < 1e-9:
                lam = np.zeros(p)
                lam[s] = x
                f = lam @ g @ lam
                if f < best_f - 1e-15:
                    best, best_f = lam, f
    return best, best @ q


def fedlf_reference(grads, losses, active, history=None, history_active=None, guard=True):
    """get_FedLF_d_layers + the rescale and guard of train_a_round, literally.

    grads: list of leaves [K, ...]; history: list of leaves [N, ...]. Rows whose
    layer gradient is zero and a vanishing fairness row are left out (the code
    divides by zero there)."""
    idx = [i for i, a in enumerate(active) if a]
    flat = np.concatenate([np.asarray(g, np.float64).reshape(len(active), -1) for g in grads],
                          axis=1)[idx]
    l = np.asarray(losses, np.float64)[idx]
    pref = np.ones(len(idx)) / np.sqrt(len(idx))
    h = (l @ pref * l / np.linalg.norm(l) - pref * np.linalg.norm(l)) / np.linalg.norm(l) ** 2
    hidx = [] if history is None else [j for j, a in enumerate(history_active) if a]
    d = []
    for i, leaf in enumerate(grads):
        q = np.asarray(leaf, np.float64).reshape(len(active), -1)[idx]
        norms = np.linalg.norm(q, axis=1)
        mu = norms.mean()
        scaled = np.array([r / nr * mu if nr > 0 else np.zeros_like(r)
                           for r, nr in zip(q, norms)])
        rows = [r for r, nr in zip(scaled, norms) if nr > 0]
        fair = h @ scaled
        if np.linalg.norm(fair) > 0:
            rows.append(fair / np.linalg.norm(fair) * mu)
        if hidx:
            hl = np.asarray(history[i], np.float64).reshape(len(history_active), -1)[hidx]
            rows += [r / np.linalg.norm(r) * mu for r in hl if np.linalg.norm(r) > 0]
        d.append(minnorm_reference(np.stack(rows))[1])
    d = np.concatenate(d)
    g_norm = np.linalg.norm(flat.mean(0))
    d_norm = np.linalg.norm(d)
    d_old = d.copy()
    d = d / d_norm * g_norm
    while guard and np.max(-(flat @ d)) > 1e-6:
        if np.linalg.norm(d) > d_norm * 2:
            d /= 2
        else:
            d = d_old
            break
    return d


def _flatten(tree):
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


SHAPES = [(2, 4), (9,), (3, 3)]
QP_ITERS = 2000


@functools.lru_cache(maxsize=None)
def _direction_fn():
    """Jitted ``fedlf_direction`` with N = 5 history rows; ``direction(g, l, a)`` passes
    none of them (one compile for every FedLF direction test)."""
    fn = jax.jit(lambda g, l, a, hist, ha: FL.fedlf_direction(g, l, a, hist, ha,
                                                             qp_iters=QP_ITERS))
    zeros = [jnp.zeros((5, *s), jnp.float32) for s in SHAPES]

    def direction(g, l, a, hist=None, history_active=None):
        if hist is None:
            return fn(g, l, a, zeros, jnp.zeros(5, bool))
        return fn(g, l, a, hist, history_active)

    return direction


def test_fairness_coefficients_are_minus_the_gradient_of_the_cosine():
    losses = np.asarray([0.3, 1.2, 0.7, 5.0], np.float32)
    active = np.asarray([True, True, True, False])
    coefficients = jax.jit(FL.fairness_coefficients)
    h = np.asarray(coefficients(losses, active))
    # d/dl cos(l, 1) = (1 / ||l|| - (l . 1) l / ||l||^3) / sqrt(K)
    l = losses[:3].astype(np.float64)
    grad_cos = (1 / np.linalg.norm(l) - l.sum() * l / np.linalg.norm(l) ** 3) / np.sqrt(3)
    np.testing.assert_allclose(h[:3], -grad_cos, rtol=1e-5)
    assert h[3] == 0.0
    np.testing.assert_allclose(np.asarray(coefficients(np.full(4, 2.0, np.float32),
                                                       np.ones(4, bool))), 0.0, atol=1e-7)
    assert np.all(np.asarray(coefficients(np.zeros(4, np.float32), np.ones(4, bool))) == 0)


def test_fedlf_direction_equals_the_code():
    """Random gradients (K = 4 rows, one masked padding row holding garbage, one
    participant with a zero layer), with and without history rows."""
    rng = np.random.default_rng(3)
    k, n = 4, 5
    direction = with_hist = _direction_fn()
    for trial in range(3):
        grads = [rng.normal(size=(k, *s)) for s in SHAPES]
        grads[1][2] = 0.0  # participant 2 has a zero gradient in layer 1
        losses = rng.uniform(0.2, 3.0, size=k)
        active = np.array([True, True, True, False])
        g32 = [jnp.asarray(g, jnp.float32) for g in grads]
        d, sol = direction(g32, jnp.asarray(losses, jnp.float32), jnp.asarray(active))
        expected = fedlf_reference(grads, losses, active)
        np.testing.assert_allclose(_flatten(d), expected, rtol=2e-4, atol=1e-5)
        # each participant descends: g_k . d >= 0 (min-norm property, layer by layer)
        flat = np.concatenate([g.reshape(k, -1) for g in grads], axis=1)
        assert np.all(flat[active] @ _flatten(d) >= -1e-5)
        np.testing.assert_allclose(np.asarray(sol.descent)[active], flat[active] @ expected,
                                   rtol=1e-3, atol=1e-5)

        hist = [rng.normal(size=(n, *s)) for s in SHAPES]
        hist[0][4] = 0.0
        hist_active = np.array([True, False, True, False, True])
        d, sol = with_hist(g32, jnp.asarray(losses, jnp.float32), jnp.asarray(active),
                           [jnp.asarray(x, jnp.float32) for x in hist],
                           jnp.asarray(hist_active))
        expected = fedlf_reference(grads, losses, active, hist, hist_active)
        np.testing.assert_allclose(_flatten(d), expected, rtol=2e-4, atol=1e-5)
        assert float(sol.scale) == pytest.approx(float(sol.unscaled_scale))


def test_fedlf_reductions():
    """One participant: d = g. Mutually orthogonal layer gradients of equal norms and
    equal losses (no fairness row): the min-norm point is their mean, so d is the
    mean gradient (a FedSGD step)."""
    rng = np.random.default_rng(4)
    direction = _direction_fn()
    g = [rng.normal(size=(4, *s)) for s in SHAPES]
    active = np.array([True, False, False, False])
    d, _ = direction([jnp.asarray(x, jnp.float32) for x in g], jnp.ones(4),
                     jnp.asarray(active))
    np.testing.assert_allclose(_flatten(d), np.concatenate([x[0].ravel() for x in g]),
                               rtol=1e-5, atol=1e-6)

    # orthogonal rows per layer with equal norms (norms differ across layers)
    grads = []
    for s in SHAPES:
        basis = np.linalg.qr(rng.normal(size=(int(np.prod(s)), 4)))[0].T  # 4 x d_l
        grads.append((rng.uniform(0.5, 2.0) * basis).reshape(4, *s))
    d, sol = direction([jnp.asarray(x, jnp.float32) for x in grads], jnp.full(4, 0.7),
                       jnp.ones(4, bool))
    mean = np.concatenate([x.mean(0).ravel() for x in grads])
    np.testing.assert_allclose(_flatten(d), mean, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sol.lambdas)[:, :4], 0.25, atol=1e-4)
    assert np.all(np.asarray(sol.lambdas)[:, 4] == 0)  # no fairness row at equal losses


def test_guard_scale_is_the_codes_loop():
    def loop(c, m):
        while c * m > 1e-6:
            if c > 2:
                c /= 2
            else:
                c = 1.0
                break
        return c

    guard = jax.jit(FL.guard_scale)
    for c, m in [(5.0, -1.0), (5.0, 0.0), (0.5, 1e-3), (37.0, 1e-3), (1e6, 1e-9),
                 (1e6, 3e-12), (3e4, 1e-10), (2.5, 1e-2), (1e30, 1.0)]:
        assert float(guard(c, m)) == pytest.approx(loop(c, m), rel=1e-6), (c, m)


def test_history_rows_follow_the_codes_window():
    """The absent clients whose last gradient is used: the code's bookkeeping
    (client_online_round_history) replayed over random cohorts."""
    rng = np.random.default_rng(5)
    n, k = 9, 3
    rule = jax.jit(FL.history_rows)
    last = -np.ones(n, int)
    for t in range(12):
        ids = rng.choice(n, k, replace=False)
        total = int(np.sum(last >= 0))
        expected = np.zeros(n, bool)
        if total > k:
            window = int(total / k)
            for c in range(n):
                if last[c] >= 0 and t - last[c] <= window and c not in ids:
                    expected[c] = True
        got = rule(jnp.asarray(last, jnp.int32), jnp.asarray(ids, jnp.int32),
                   jnp.ones(k, bool), jnp.int32(t))
        np.testing.assert_array_equal(np.asarray(got), expected)
        last[ids] = t
    # a masked padding row neither counts nor is excluded as "in the cohort"
    got = rule(jnp.asarray([0, 0, 0, -1], jnp.int32), jnp.asarray([1, 2], jnp.int32),
               jnp.asarray([True, False]), jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(got), [True, False, True, False])


def test_gradient_client_sends_the_full_gradient_and_loss():
    data = helpers.tiny_federation(padded_size=FULL_BATCH)
    model = helpers.logreg()
    params = helpers.init_params(model, 0)
    client = jax.jit(helpers.with_params(FL.gradient_client(model)))
    w, b = helpers.logreg_to_numpy(params)
    for c in (1, 2):  # a client with data and the empty client
        row = helpers.client(data.train, c)
        out, _ = client(params, (), row, jnp.int32(10), jax.random.key(0))
        x, y = helpers.real_rows(data.train, [c])
        gw, gb = helpers.logreg_grad_numpy(w, b, x, y)
        np.testing.assert_allclose(np.asarray(out.delta["params"]["Dense_0"]["kernel"]), gw,
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(out.delta["params"]["Dense_0"]["bias"]), gb,
                                   rtol=1e-5, atol=1e-6)
        assert float(out.loss_before) == pytest.approx(_logreg_loss_numpy(w, b, x, y),
                                                       rel=1e-5, abs=1e-7)
        assert int(out.num_steps) == int(len(y) > 0)


def test_fedlf_rounds_equal_the_code_with_history():
    """Whole rounds with partial participation (N = 6, K = 3 plus a padding row):
    the gradients of absent clients seen in the window join the QPs; parameters,
    stored gradients and their rounds match the reference, and the stored rows of
    clients outside the cohort never change."""
    data = helpers.tiny_federation(padded_size=FULL_BATCH)
    model = helpers.logreg()
    params = helpers.init_params(model, 0)
    eta = 0.7
    alg = FL.fedlf(model, server_lr=eta, qp_iters=QP_ITERS)
    apply = _jit_apply(alg)
    state = alg.init(params, data.num_clients)
    theta = _np_leaves(params)  # bias, kernel
    last, stored = -np.ones(6, int), [None] * 6
    cohorts = [([0, 1, 3, 0], [1, 1, 1, 0]), ([4, 5, 2, 4], [1, 1, 1, 0]),
               ([1, 3, 5, 1], [1, 1, 1, 0]), ([0, 4, 3, 0], [1, 1, 1, 0])]
    used_history = 0
    for t, (ids, mask) in enumerate(cohorts):
        before = state.aggregator_state
        state, metrics = apply(state, helpers.cohort(data.train, ids, mask=mask),
                               jax.random.key(t))
        parts = [c for c, m in zip(ids, mask) if m]
        w, b = theta[1], theta[0]
        grads, losses = {}, {}
        for c in parts:
            x, y = helpers.real_rows(data.train, [c])
            gw, gb = helpers.logreg_grad_numpy(w, b, x, y)
            grads[c], losses[c] = [gb, gw], _logreg_loss_numpy(w, b, x, y)
        active = [c for c in parts if int(data.train.num_examples[c]) > 0]
        total = int(np.sum(last >= 0))
        hist_ids = ([c for c in range(6) if last[c] >= 0 and t - last[c] <= total // 3
                     and c not in parts] if total > 3 else [])
        hist_ids = [c for c in hist_ids if np.linalg.norm(np.concatenate(
            [x.ravel() for x in stored[c]])) > 0]
        used_history += len(hist_ids)
        d = fedlf_reference([np.stack([grads[c][i] for c in active]) for i in range(2)],
                            [losses[c] for c in active], [True] * len(active),
                            [np.stack([stored[c][i] for c in hist_ids]) for i in range(2)]
                            if hist_ids else None, [True] * len(hist_ids))
        sizes = [g.size for g in theta]
        theta = [theta[0] - eta * d[:sizes[0]],
                 theta[1] - eta * d[sizes[0]:].reshape(theta[1].shape)]
        for a, e in zip(_np_leaves(state.params), theta):
            np.testing.assert_allclose(a, e, rtol=5e-4, atol=1e-5)
        assert float(metrics["server/guarded"][()]) == 0.0
        for c in parts:
            last[c], stored[c] = t, grads[c]
        after = state.aggregator_state
        np.testing.assert_array_equal(np.asarray(after.last_round), last)
        for c in range(6):
            for a, a0, e in zip(jax.tree.leaves(after.gradients),
                                jax.tree.leaves(before.gradients),
                                stored[c] or [np.zeros_like(x) for x in theta]):
                if c in parts:
                    np.testing.assert_allclose(np.asarray(a[c]), e, rtol=1e-5, atol=1e-6)
                else:  # persistence
                    np.testing.assert_array_equal(np.asarray(a[c]), np.asarray(a0[c]))
    assert used_history > 0


def test_fedlf_factory_checks():
    model = helpers.logreg()
    import optax
    for kwargs in ({"server_lr": 0.0}, {"qp_iters": 0}, {"client_gradient": "local"},
                   {"history": 1}, {"descent_guard": "no"}, {"server_lr_decay": -1.0},
                   {"training": ClientTraining(lr=0.0)}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            FL.fedlf(model, **kwargs)
    with pytest.raises(ValueError, match="^training.lr: "):
        FL.fedlf(model, training=ClientTraining(lr=0.0))
    with pytest.raises(ValueError, match="client_optimizer"):
        FL.fedlf(model, client_gradient="pseudo",
                 training=ClientTraining(optimizer=optax.sgd(0.1)))


def test_pseudo_gradient_client_divides_the_fedavg_delta_by_the_rate():
    data = helpers.tiny_federation(padded_size=13)
    model = helpers.logreg()
    params = helpers.init_params(model, 0)
    training = ClientTraining(lr=lambda t: 0.2 * 0.5 ** t, batch_size=4, num_epochs=2)
    plain = local_training(model, training)
    pseudo = FL.pseudo_gradient_client(plain, training.lr)
    row = helpers.client(data.train, 1)
    from fedjax_fair.core.types import Broadcast

    @jax.jit
    def both(b):
        return tuple(c(b, (), row, jnp.int32(100), jax.random.key(3))[0]
                     for c in (pseudo, plain))

    out, ref = both(Broadcast(params, jnp.int32(1)))
    helpers.assert_trees_close(out.delta, jax.tree.map(lambda d: d / 0.1, ref.delta),
                               rtol=1e-6, atol=1e-7)
    assert float(out.loss_before) == float(ref.loss_before)


# ============================================================== both, end to end


@pytest.mark.slow
def test_vmap_equals_sequential_and_a_short_run_improves_accuracy():
    check_vmap_equals_sequential_and_accuracy_rises("fedlf")
