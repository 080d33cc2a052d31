"""FedFV (``algorithms/fedfv.py``; Wang et al., IJCAI 2021, arXiv:2104.14937,
Algorithm 1): the server step against a literal NumPy float64 transcription of the
algorithm (projections in parameter space, a gradient history dict) over rounds of
random conflicting updates and over whole rounds of NumPy local models; a masked
cohort row is an absent client; alpha = 1 without history is the simple average; the
projected updates do not conflict with the largest-loss client's; vmap and grad over
the client rate through ``simulate``; the worst client fares better than under the
plain average on a federation whose minority conflicts with the majority.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from fedjax_fair.algorithms.fedfv import (fedfv, fedfv_aggregator, gram_matrix,
                                          internal_coefficients, keep_counts)
from fedjax_fair.core.client import ClientTraining, data_loss
from fedjax_fair.core.types import ClientOutput, FederatedData
from fedjax_fair.drivers.simulate import simulate

MODEL = helpers.logreg()
TRAIN = helpers.SKEWED_TRAIN  # clients 0-3 and 4 labelled by opposite teachers, 5 empty
PARAMS = helpers.SKEWED_PARAMS
N = 6
LR, EPOCHS = helpers.SKEWED_LR, helpers.SKEWED_EPOCHS
TRAINING = helpers.SKEWED_TRAINING  # full batch: NumPy gradient descent is exact


# ------------------------------------------------------------- NumPy float64 reference


def np_fedfv(cohorts, alpha, tau):
    """Algorithm 1 literally. ``cohorts``: per round (ids, reported, grads [K, d],
    losses [K], has_data [K]); returns the step g^t of every round.

    GH[i] = (latest update of client i, its round); the cohort's clients that hold
    data are averaged with 1 / m; the ceil(alpha m) largest losses are not projected."""
    history, steps = {}, []
    for t, (ids, reported, grads, losses, has_data) in enumerate(cohorts):
        for k, cid in enumerate(ids):
            if reported[k]:
                history[cid] = (np.asarray(grads[k], np.float64), t)
        clients = [k for k in range(len(ids)) if reported[k] and has_data[k]]
        m = len(clients)
        g = {k: np.asarray(grads[k], np.float64) for k in clients}
        order = sorted(clients, key=lambda k: losses[k])  # ascending losses
        kept = order[m - math.ceil(round(alpha * m, 9)):] if alpha > 0 else []
        projected = {}
        for k in clients:
            gk = g[k].copy()
            if k not in kept:
                for j in order:
                    if j != k and gk @ g[j] < 0:
                        gk = gk - (gk @ g[j]) / (g[j] @ g[j]) * g[j]
            projected[k] = gk
        step = sum(projected.values()) / m
        if t >= tau:
            for i in range(tau, 0, -1):
                conflicting = [h for h, r in history.values() if r == t - i and step @ h < 0]
                if conflicting:
                    g_con = sum(conflicting)
                    if step @ g_con < 0:
                        step = step - (step @ g_con) / (g_con @ g_con) * g_con
        average = sum(g.values()) / m
        steps.append(step / np.linalg.norm(step) * np.linalg.norm(average))
    return steps


# --------------------------------------------------- the server step on random updates

K, SHAPES = 5, {"a": (3, 2), "b": (4,)}
D = sum(math.prod(s) for s in SHAPES.values())
# (ids, reported) of four rounds from a federation of 8: partial cohorts, a client
# absent for a round and back, padding rows under a False mask
RANDOM_ROUNDS = [([0, 1, 2, 3, 4], [True] * 5),
                 ([5, 6, 0, 7, 1], [True, True, True, False, True]),
                 ([2, 3, 5, 6, 4], [True] * 5),
                 ([7, 1, 3, 0, 6], [True, False, True, True, True])]


def _unflat(vec):
    """[..., D] -> the pytree of SHAPES with the leading axes kept."""
    lead = vec.shape[:-1]
    return {"a": jnp.asarray(vec[..., :6].reshape(*lead, 3, 2), jnp.float32),
            "b": jnp.asarray(vec[..., 6:], jnp.float32)}


def _flat(tree):
    return np.concatenate([np.asarray(tree["a"], np.float64).reshape(-1),
                           np.asarray(tree["b"], np.float64)])


def _random_cohorts(seed):
    """Updates around a shared direction with large, opposed components (so many
    pairs conflict and the magnitudes differ), and random losses; client 6 holds no
    data (zero update, loss 0)."""
    rng = np.random.default_rng(seed)
    out = []
    for ids, reported in RANDOM_ROUNDS:
        grads = rng.normal(size=(K, D)) * rng.uniform(0.2, 3.0, size=(K, 1)) + 0.3
        has_data = np.asarray([cid != 6 for cid in ids])
        grads[~has_data] = 0.0
        losses = np.where(has_data, rng.uniform(0.1, 3.0, size=K), 0.0)
        out.append((ids, reported, grads, losses, has_data))
    return out


@functools.cache
def _server_step(alpha, tau):
    """The jitted aggregate of one round (shared by every round: same shapes)."""
    agg = fedfv_aggregator(alpha, tau)

    def step(state, grads, losses, weights, ids, mask, round_):
        out = ClientOutput(delta=_unflat(grads), loss_before=losses,
                           num_examples=jnp.ones(losses.shape, jnp.int32),
                           num_steps=jnp.ones(losses.shape, jnp.int32))
        ctx = helpers.server_context(ids, mask)._replace(round=round_)
        return agg.aggregate(state, out, weights, ctx)

    return agg, jax.jit(step)


@pytest.mark.parametrize("alpha, tau", [(0.0, 0), (0.25, 1), (0.5, 2), (1.0, 1)])
def test_server_step_equals_a_literal_transcription_of_algorithm_1(alpha, tau):
    agg, step = _server_step(alpha, tau)
    for seed in range(2):
        cohorts = _random_cohorts(seed)
        state = agg.init(_unflat(np.zeros(D)), 8)
        for t, (ids, reported, grads, losses, has_data) in enumerate(cohorts):
            active = np.asarray(reported) & has_data
            weights = active / active.sum()
            direction, state, info = step(state, grads, jnp.asarray(losses, jnp.float32),
                                          jnp.asarray(weights, jnp.float32), jnp.asarray(ids),
                                          jnp.asarray(reported), jnp.int32(t))
            expected = np_fedfv(cohorts[:t + 1], alpha, tau)[-1]
            np.testing.assert_allclose(_flat(direction), expected, rtol=2e-5, atol=2e-6)
            counts = np.asarray(info["projections"])
            assert np.all(counts[~active] == 0)
            if alpha == 1.0:  # every update kept: no internal projection
                assert not counts.any()
        if tau == 0:
            assert state.history == ()
    assert int(info["external_projections"]) <= tau


@jax.jit
def _internal(g, losses):
    gram = gram_matrix(g, jnp.ones(g.shape[:1], bool))
    return internal_coefficients(gram, losses, jnp.full(losses.shape, 1 / 6, jnp.float32), 0.1)


def test_projected_updates_do_not_conflict_with_the_largest_loss():
    """The projections run in ascending order of loss, so every projected update ends
    with the one onto the update of the client with the largest loss and does not
    conflict with it (the direction the paper protects), and alpha = 0.1 of a cohort
    of 6 keeps that client's update (ceil(0.6) = 1) as it is; the plain updates did
    conflict with it."""
    rng = np.random.default_rng(3)
    conflicted = 0
    for _ in range(10):
        g = rng.normal(size=(6, 9)) + 0.2
        losses = rng.uniform(size=6)
        coef, count = _internal(jnp.asarray(g, jnp.float32), jnp.asarray(losses, jnp.float32))
        projected = np.asarray(coef, np.float64) @ g
        worst = int(np.argmax(losses))
        others = np.arange(6) != worst
        assert np.all(projected[others] @ g[worst] >= -1e-4 * np.linalg.norm(g[worst]) ** 2)
        np.testing.assert_array_equal(projected[worst], g[worst])
        assert int(count[worst]) == 0
        conflicted += int(np.any(g[others] @ g[worst] < 0))
    assert conflicted >= 5


def test_the_kept_count_is_ceil_alpha_m_exactly():
    """ceil(alpha m) from the decimal given: 0.3 x 10 keeps 3 (not ceil(3.0000000000000004));
    the authors' code's m - ceil((m - 1)(1 - alpha)) would keep 2 of 3 at alpha = 0.7."""
    assert keep_counts(0.3, 10)[10] == 3
    assert keep_counts(0.1, 10)[10] == 1 and keep_counts(0.1, 10)[9] == 1
    assert keep_counts(0.7, 3)[3] == 3 and 3 - math.ceil(2 * 0.3) == 2
    assert keep_counts(np.float32(0.1), 10)[10] == 1
    np.testing.assert_array_equal(keep_counts(0.0, 4), 0)
    np.testing.assert_array_equal(keep_counts(1.0, 4), np.arange(5))


def test_bad_values_are_refused_when_built():
    for kw, field in ((dict(alpha=-0.1), "alpha"), (dict(alpha=1.5), "alpha"),
                      (dict(tau=-1), "tau"), (dict(tau=1.5), "tau"),
                      (dict(weight_by_size="no"), "weight_by_size")):
        with pytest.raises(ValueError, match=f"^{field}: "):
            fedfv(MODEL, **kw)
    with pytest.raises(TypeError, match="^alpha: "):  # a static fraction, never traced
        fedfv(MODEL, alpha=jnp.float32(0.1))


# ----------------------------------------------------------------------- whole rounds

# (ids, mask) of four rounds of 6 rows (the shape of the full cohort, so one compiled
# round serves every test here): partial cohorts padded with masked rows that repeat
# an id or hold another client, the empty client 5 and the minority client 4 in and out
ROUNDS = [([0, 1, 4, 2, 0, 3], [True, True, True, True, False, False]),
          ([3, 5, 0, 1, 4, 4], [True, True, True, False, False, False]),
          ([4, 2, 3, 0, 1, 2], [True, True, True, True, False, False]),
          ([1, 3, 5, 2, 0, 0], [True, True, True, True, False, False])]
EVERYONE = (list(range(N)), [True] * N)


def _np_local(theta, k):
    """(update theta - theta_k, F_k(theta), has data) of client k from theta (flat)."""
    w0 = theta[:-3].reshape(10, 3)
    b0 = theta[-3:]
    x, y = helpers.real_rows(TRAIN, [k])
    if not len(y):
        return np.zeros_like(theta), 0.0, False
    logits = x.astype(np.float64) @ w0 + b0
    logits -= logits.max(-1, keepdims=True)
    loss = np.mean(np.log(np.exp(logits).sum(-1)) - logits[np.arange(len(y)), y])
    start = helpers.logreg_from_numpy(w0, b0, PARAMS)
    w, b = helpers.logreg_gd_numpy(start, x, y, LR, EPOCHS)
    return theta - np.concatenate([w.ravel(), b]), loss, True


def _np_rounds(alpha, tau):
    w, b = helpers.logreg_to_numpy(PARAMS)
    theta = np.concatenate([w.ravel(), b])
    cohorts = []
    for ids, mask in ROUNDS:
        local = [_np_local(theta, k) for k in ids]
        cohorts.append((ids, mask, np.stack([u for u, _, _ in local]),
                        np.asarray([f for _, f, _ in local]),
                        np.asarray([d for _, _, d in local])))
        theta = theta - np_fedfv(cohorts, alpha, tau)[-1]
    return theta


@functools.cache
def _compiled(alpha, tau):
    alg = helpers.bind_execution(fedfv(MODEL, alpha=alpha, tau=tau, training=TRAINING),
                                 "sequential")
    return alg, jax.jit(alg.apply)


def _run(alpha, tau, rounds=ROUNDS):
    alg, apply = _compiled(alpha, tau)
    state = alg.init(PARAMS, N)
    for r, (ids, mask) in enumerate(rounds):
        state, metrics = apply(state, helpers.cohort(TRAIN, ids, mask=mask),
                               jax.random.fold_in(helpers.SKEWED_KEY, r))
    return state, metrics


def test_rounds_equal_numpy_local_models_and_algorithm_1():
    state, metrics = _run(0.25, 2)
    w, b = helpers.logreg_to_numpy(state.params)
    np.testing.assert_allclose(np.concatenate([w.ravel(), b]), _np_rounds(0.25, 2),
                               rtol=1e-4, atol=1e-5)
    assert int(state.round) == len(ROUNDS)
    # GH holds every client's latest update and its round (-1: never reported)
    np.testing.assert_array_equal(state.aggregator_state.history.last_round,
                                  [2, 3, 3, 3, 2, 3])


def test_a_masked_row_is_an_absent_client():
    """A masked row (whatever client and data it holds) changes nothing: the whole
    server state, GH included, equals the round in which another client sat in that
    row; the client is not written to GH and gets weight 0."""
    alg, apply = _compiled(0.25, 2)
    state = alg.init(PARAMS, N)
    first = [True, True, True, True, False, False]
    state, _ = apply(state, helpers.cohort(TRAIN, [0, 4, 2, 3, 1, 5], mask=first),
                     helpers.SKEWED_KEY)
    mask = [True, False, True, True, False, True]
    a, ma = apply(state, helpers.cohort(TRAIN, [1, 4, 0, 3, 2, 5], mask=mask),
                  helpers.SKEWED_KEY)
    b, mb = apply(state, helpers.cohort(TRAIN, [1, 2, 0, 3, 4, 5], mask=mask),
                  helpers.SKEWED_KEY)
    helpers.assert_trees_close(b, a, rtol=0, atol=0)
    assert float(ma["weights"][1]) == 0.0 and int(ma["server/projections"][1]) == 0
    last = np.asarray(a.aggregator_state.history.last_round)
    np.testing.assert_array_equal(last, [1, 1, 0, 1, 0, 1])  # 2, 4: their round-0 updates stay


def test_alpha_one_without_history_is_the_simple_average():
    """alpha = 1 keeps every update and tau = 0 reads no history: the step is the
    average of the updates of the clients holding data (rescaled to its own norm)."""
    state, metrics = _run(1.0, 0, ROUNDS[:1])
    theta = np.concatenate([x.ravel() for x in helpers.logreg_to_numpy(PARAMS)])
    ids, mask = ROUNDS[0]
    clients = [_np_local(theta, k) for k, m in zip(ids, mask) if m]
    helpers.assert_skewed_step(state.params, np.mean([u for u, _, _ in clients], axis=0),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(metrics["server/projections"], 0)


# ------------------------------------------------- traced client rate: vmap and grad

DATA = FederatedData(train=TRAIN, test=helpers.skewed_train(seed=1))


def _final_params(lr):
    alg = fedfv(MODEL, alpha=0.2, tau=1, training=ClientTraining(lr=lr, batch_size=12))
    state, _ = simulate(alg, alg.init(PARAMS, N), DATA, jax.random.key(0), num_rounds=3,
                        cohort_size=4, execution="sequential")
    return state.params


def _test_loss(params):
    return jnp.mean(jax.vmap(lambda d: data_loss(MODEL, params, d))(DATA.test)[:5])


def test_vmap_and_grad_over_the_client_rate_through_simulate():
    """One program, the test loss and its gradient in the client rate vmapped over five
    rates: the gradient at 0.3 equals the central difference of the losses at
    0.3 -/+ h, and the rate reaches the run (the losses differ)."""
    h = 1e-3
    rates = jnp.asarray([0.1, 0.3 - h, 0.3, 0.3 + h, 0.5], jnp.float32)
    values, grads = jax.jit(jax.vmap(jax.value_and_grad(
        lambda lr: _test_loss(_final_params(lr)))))(rates)
    values, grads = np.asarray(values, np.float64), np.asarray(grads, np.float64)
    assert np.all(np.isfinite(values)) and np.all(np.isfinite(grads))
    fd = (values[3] - values[1]) / (rates[3] - rates[1])
    assert abs(fd) > 1e-3
    np.testing.assert_allclose(grads[2], fd, rtol=5e-2)
    assert abs(values[0] - values[4]) > 1e-3


# ------------------------------------------------------------- the paper's claim, small


def test_the_conflicting_minority_fares_better_than_under_the_plain_average():
    """Client 4's labels oppose clients 0-3's, so its update conflicts with theirs and
    the plain average follows the majority. After 20 full-participation rounds FedFV
    leaves the worst client with a clearly smaller training loss than the simple
    average of the same updates (FedFV with alpha = 1, tau = 0), at a similar mean."""
    losses = {}
    for name, (alpha, tau) in (("fedfv", (0.25, 2)), ("average", (1.0, 0))):
        state, _ = _run(alpha, tau, [EVERYONE] * 20)
        losses[name] = np.asarray(jax.vmap(lambda d: data_loss(MODEL, state.params, d))(
            TRAIN))[:5]
    assert losses["fedfv"].max() < 0.8 * losses["average"].max()
    assert losses["fedfv"].mean() < 1.1 * losses["average"].mean()
    assert np.argmax(losses["average"]) == 4  # the minority client, under the average
