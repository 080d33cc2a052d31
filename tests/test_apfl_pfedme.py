"""APFL and pFedMe (fedjax_fair/algorithms/{apfl,pfedme}.py), the personalised
baselines of SuPerFed (Hahn et al., KDD 2022, arXiv:2109.07628).

Every comparison with NumPy runs in float64 (``jax.enable_x64`` in a fixture) on the
logistic-regression federation of tests/helpers.py (6 clients of 7, 9, 0, 3, 5 and
13 rows) with minibatches of 4 (partial last batches), 2 epochs and three rounds of
partial participation: padded cohort rows repeat a client id under a False mask, a
step budget caps one client and a budget of 0 makes a sampled client take no step. The
reference reproduces each client's batch order from its key as ``client.local_sgd``
does (client key = fold_in(round key, id); (shuffle key, _) = split(client key); epoch
e's rows = ``client.epoch_order(data, shuffle key, e, B)``).

* APFL: three rounds of w and of every row (v_i, alpha_i) against Algorithm 1, fixed
  and adaptive alpha; the joint loss's gradients are APFL's two (three) gradients;
  alpha = 0 is FedAvg's trajectory with the personal model = the global model.
* pFedMe: three rounds of w and every row theta_i against Algorithm 1 (K inner steps,
  warm start, beta != 1); lambda = 0 freezes w; ``warm_start=False``, K = 1, beta = 1 is
  FedAvg at rate eta lambda personal_lr.
* ``alg.personal`` returns each client's own model, and the runner's evaluator scores
  it (APFL in float32, where dense and lazy tables also hold the same rows).
* ``jax.vmap`` over alpha / lambda of a whole jitted run equals the separate runs.
* Bad concrete values raise ValueError naming the field.
* The shared local-training options: pFedMe with an SGD-momentum client optimizer
  (both its steps) and with gradient clipping (its inner steps) against the
  reference; APFL with alpha = 0 and clipping is FedAvg with clipping.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from fedjax_fair.core import client
from fedjax_fair.algorithms.apfl import Joint, apfl, joint_model
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.algorithms.pfedme import pfedme
from fedjax_fair.core.evaluation import make_state_evaluator
from fedjax_fair.core.client import ClientTraining

MODEL = helpers.logreg()
TRAIN_SIZES = (7, 9, 0, 3, 5, 13)  # client 2 is empty; every epoch ends in a partial batch
DATA = helpers.tiny_federation(TRAIN_SIZES)
N = DATA.num_clients
SIZES = np.asarray(TRAIN_SIZES)
B = 4
EPOCHS = 2
LR = 0.2
BIG = 2 ** 30
# APFL
ALPHA = 0.25
ALPHA_LR = 0.2  # clients 1 and 5 reach the bound alpha = 0
# pFedMe
LAM = 3.0
INNER = 3
PERSONAL_LR = 0.1
ETA = 0.3
BETA = 1.5
MOMENTUM = 0.9
CLIP = 0.15  # below most minibatch gradient norms here

# (ids, mask, step budgets) of three rounds of a cohort of 4 slots. The active
# clients' sizes sum to 16, 32 and 8, so the weights n_k / sum n (float32 in the
# library, also under x64) are exact.
ROUNDS = (([0, 1, 2, 0], [True, True, True, False], [BIG, BIG, BIG, BIG]),
          ([0, 1, 3, 5], [True, True, True, True], [0, 3, BIG, BIG]),
          ([3, 4, 0, 1], [True, True, False, False], [BIG, 2, BIG, BIG]))
KEYS = jax.random.split(jax.random.key(7), len(ROUNDS))
RTOL, ATOL = 1e-9, 1e-11  # float64 against NumPy
ALL = jnp.arange(N, dtype=jnp.int32)


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _federation():
    """(train ClientData, params) in the current precision (float32 values, exact in
    float64)."""
    return helpers.in_default_float(DATA.train, helpers.init_params(MODEL, 1))


def _cohorts(train):
    return helpers.stacked_cohorts(train, ROUNDS)


def _run(algorithm, params, cohorts):
    """(final state, params after every round [R, ...]) over ROUNDS in one lax.scan."""
    return helpers.scan_rounds(algorithm, algorithm.init(params, N), cohorts, KEYS,
                               lambda state: state.params)


def _rows(algorithm, state):
    return algorithm.client_table.gather(state.client_states, ALL)


def _apfl(alpha, adaptive=False):
    return apfl(MODEL, alpha=alpha, adaptive_alpha=adaptive, alpha_lr=ALPHA_LR,
                training=ClientTraining(lr=LR, batch_size=B, num_epochs=EPOCHS))


def _pfedme(lam, beta=BETA, inner_steps=INNER, warm_start=True, **fields):
    """pFedMe at rate ETA, batch B, EPOCHS epochs; ``fields``: further ClientTraining
    fields (optimizer, clip_norm, clip_mode)."""
    return pfedme(MODEL, lam=lam, inner_steps=inner_steps, personal_lr=PERSONAL_LR,
                  beta=beta,
                  training=ClientTraining(lr=ETA, batch_size=B, num_epochs=EPOCHS, **fields),
                  warm_start=warm_start)


@functools.cache
def _program(name: str):
    """One jitted run per variant, its continuous hyper-parameter an argument:
    ``(value, params, cohorts) -> (state, params per round, every row, personal models)``."""
    builders = {
        "apfl": lambda a: _apfl(a),
        "apfl_adaptive": lambda a: _apfl(a, adaptive=True),
        "pfedme": lambda lam: _pfedme(lam),
        "pfedme_cold_k1": lambda lam: _pfedme(lam, beta=1.0, inner_steps=1, warm_start=False),
        "pfedme_momentum": lambda lam: _pfedme(
            lam, optimizer=lambda lr: optax.sgd(lr, momentum=MOMENTUM)),
        "pfedme_clip_loss": lambda lam: _pfedme(lam, clip_norm=CLIP, clip_mode="loss"),
        "pfedme_clip_step": lambda lam: _pfedme(lam, clip_norm=CLIP, clip_mode="step"),
        "fedavg": lambda lr: fedavg(MODEL, training=ClientTraining(lr=lr, batch_size=B,
                                                                   num_epochs=EPOCHS)),
        "apfl_clip": lambda a: apfl(MODEL, alpha=a, training=ClientTraining(
            lr=LR, batch_size=B, num_epochs=EPOCHS, clip_norm=CLIP)),
        "fedavg_clip": lambda lr: fedavg(MODEL, training=ClientTraining(
            lr=lr, batch_size=B, num_epochs=EPOCHS, clip_norm=CLIP)),
    }

    def program(value, params, cohorts):
        alg = builders[name](value)
        state, per_round = _run(alg, params, cohorts)
        if alg.personal is None:
            return state, per_round, (), ()
        return state, per_round, _rows(alg, state), alg.personal(state, ALL)

    return jax.jit(program)


def _library(name, value):
    train, params = _federation()
    return _program(name)(jnp.asarray(value, jnp.result_type(float)), params, _cohorts(train))


# --------------------------------------------------------------------------------------
# The NumPy float64 reference: parameters are (W [d, C], b [C]) tuples.


def _batches(train, k, key, budget):
    """The real rows (x, y) of each local step client k takes with ``key``."""
    n = int(SIZES[k])
    if n == 0:
        return []
    shuffle_key, _ = jax.random.split(jax.random.fold_in(key, k))
    data = helpers.client(train, k)
    orders = np.asarray(jax.vmap(lambda e: client.epoch_order(data, shuffle_key, e, B))(
        jnp.arange(EPOCHS)))
    x = np.asarray(train.examples["x"][k], np.float64)
    y = np.asarray(train.examples["y"][k])
    spe = math.ceil(n / B)
    out = []
    for t in range(min(budget, EPOCHS * spe)):
        e, i = divmod(t, spe)
        rows = orders[e, i * B:min((i + 1) * B, n)]
        assert np.all(rows < n)
        out.append((x[rows], y[rows]))
    return out


def _lin(*terms):
    """sum_j s_j p_j over (scale, (W, b)) pairs."""
    return tuple(sum(s * p[i] for s, p in terms) for i in range(2))


def _grad(p, x, y):
    return helpers.logreg_grad_numpy(p[0], p[1], x, y)


def _dot(a, b):
    return sum(np.sum(u * v) for u, v in zip(a, b))


def _server(x, locals_, beta=1.0):
    """x - beta sum_k p_k (x - w_k), p_k = n_k / sum n over the (ids, models)."""
    total = sum(SIZES[k] for k, _ in locals_)
    mean_delta = _lin(*[(SIZES[k] / total, _lin((1.0, x), (-1.0, w))) for k, w in locals_])
    return _lin((1.0, x), (-beta, mean_delta))


def _active(ids, mask, budgets):
    return [(k, b) for k, m, b in zip(ids, mask, budgets) if m]


def apfl_reference(train, params, alpha, adaptive):
    """Deng et al. 2020, Algorithm 1: w_i and v_i SGD steps on the same batch from the
    pre-step iterates; alpha_i <- clip(alpha_i - eta_a <v - w, grad f(vbar)>, 0, 1)."""
    x = helpers.logreg_to_numpy(params)
    v = {k: x for k in range(N)}
    a = {k: alpha for k in range(N)}
    trajectory = []
    for (ids, mask, budgets), key in zip(ROUNDS, KEYS):
        locals_ = []
        for k, budget in _active(ids, mask, budgets):
            w = x
            for xb, yb in _batches(train, k, key, budget):
                vbar = _lin((a[k], v[k]), (1 - a[k], w))
                g_w, g_bar = _grad(w, xb, yb), _grad(vbar, xb, yb)
                new_a = (np.clip(a[k] - ALPHA_LR * _dot(_lin((1.0, v[k]), (-1.0, w)), g_bar),
                                 0.0, 1.0) if adaptive else a[k])
                w, v[k], a[k] = (_lin((1.0, w), (-LR, g_w)),
                                 _lin((1.0, v[k]), (-LR * a[k], g_bar)), new_a)
            locals_.append((k, w))
        x = _server(x, locals_)
        trajectory.append(x)
    personal = [_lin((a[k], v[k]), (1 - a[k], x)) for k in range(N)]
    return trajectory, v, a, personal


def _clipped(g, clip):
    """g scaled by min(1, clip / ||g||) (no clip for None)."""
    if clip is None:
        return g
    return _lin((min(1.0, clip / np.sqrt(_dot(g, g))), g))


def pfedme_reference(train, params, lam, momentum=0.0, clip=None, clip_mode="step"):
    """Dinh et al. 2020, Algorithm 1 with K gradient steps on the personal problem,
    warm-started from the previous step's solution (w^t at a round's first step).
    ``momentum``: both steps heavy-ball (m <- G + momentum m, state per round);
    ``clip``: the inner gradient clipped to norm ``clip`` ("loss": grad f alone)."""
    x = helpers.logreg_to_numpy(params)
    theta_rows = {k: x for k in range(N)}
    trajectory = []
    for (ids, mask, budgets), key in zip(ROUNDS, KEYS):
        locals_ = []
        for k, budget in _active(ids, mask, budgets):
            w, theta = x, x
            m_inner, m_outer = _lin((0.0, x)), _lin((0.0, x))
            batches = _batches(train, k, key, budget)
            for xb, yb in batches:
                for _ in range(INNER):
                    g = _grad(theta, xb, yb)
                    if clip_mode == "loss":
                        g = _clipped(g, clip)
                    g = _lin((1.0, g), (lam, _lin((1.0, theta), (-1.0, w))))
                    if clip_mode == "step":
                        g = _clipped(g, clip)
                    if momentum:
                        m_inner = _lin((1.0, g), (momentum, m_inner))
                        theta = _lin((1.0, theta), (-PERSONAL_LR, m_inner))
                    else:
                        theta = _lin((1.0, theta), (-PERSONAL_LR, g))
                if momentum:
                    m_outer = _lin((lam, _lin((1.0, w), (-1.0, theta))), (momentum, m_outer))
                    w = _lin((1.0, w), (-ETA, m_outer))
                else:
                    w = _lin((1.0, w), (-ETA * lam, _lin((1.0, w), (-1.0, theta))))
            if batches:
                theta_rows[k] = theta
            locals_.append((k, w))
        x = _server(x, locals_, BETA)
        trajectory.append(x)
    return trajectory, theta_rows


def _close(actual, expected, what, rtol=RTOL, atol=ATOL):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(np.asarray(a, np.float64), e, rtol=rtol, atol=atol,
                                   err_msg=what)


def _round_params(per_round, r):
    return helpers.logreg_to_numpy(jax.tree.map(lambda v: v[r], per_round))


def _row_k(tree, k):
    return helpers.logreg_to_numpy(jax.tree.map(lambda v: v[k], tree))


# --------------------------------------------------------------------------------------
# APFL


def test_joint_loss_gives_apfls_gradients(x64):
    """grad of l(w) + l(alpha v + (1 - alpha) sg(w)) = (grad f(w), alpha grad f(vbar),
    <v - w, grad f(vbar)>), and its value is l(w)."""
    train, params = _federation()
    w, v = params, helpers.random_like(params, 3)
    v = jax.tree.map(lambda u: jnp.asarray(u, jnp.float64), v)
    alpha = jnp.float64(0.3)
    batch = {"x": train.examples["x"][1, :5], "y": train.examples["y"][1, :5]}
    loss = lambda j: jnp.mean(joint_model(MODEL).per_example_loss(j, batch, None))
    value, g = jax.jit(jax.value_and_grad(loss))(Joint(w, v, alpha))
    xb, yb = np.asarray(batch["x"]), np.asarray(batch["y"])
    wn, vn = helpers.logreg_to_numpy(w), helpers.logreg_to_numpy(v)
    vbar = _lin((0.3, vn), (0.7, wn))
    g_bar = _grad(vbar, xb, yb)
    _close(helpers.logreg_to_numpy(g.w), _grad(wn, xb, yb), "grad w")
    _close(helpers.logreg_to_numpy(g.v), _lin((0.3, g_bar)), "grad v")
    np.testing.assert_allclose(float(g.alpha), _dot(_lin((1.0, vn), (-1.0, wn)), g_bar),
                               rtol=1e-10)
    own = jax.jit(lambda p: jnp.mean(MODEL.per_example_loss(p, batch, None)))(w)
    assert float(value) == float(own)


@pytest.mark.parametrize("adaptive", [False, True])
def test_apfl_matches_the_numpy_reference(x64, adaptive):
    train, params = _federation()
    state, per_round, rows, personal = _library("apfl_adaptive" if adaptive else "apfl", ALPHA)
    trajectory, v, a, expected_personal = apfl_reference(train, params, ALPHA, adaptive)
    for r, expected in enumerate(trajectory):
        _close(_round_params(per_round, r), expected, f"w after round {r}")
    for k in range(N):
        _close(_row_k(rows.local, k), v[k], f"v_{k}")
        np.testing.assert_allclose(float(rows.alpha[k]), a[k], rtol=RTOL, atol=ATOL)
        _close(_row_k(personal, k), expected_personal[k], f"personal model of {k}")
    trained = [0, 1, 3, 4, 5]
    assert all(np.abs(v[k][0] - v[2][0]).max() > 1e-3 for k in trained)  # v moved
    if adaptive:  # alpha adapted per client (projected onto [0, 1]); the empty client's stayed
        assert a[1] == a[5] == 0.0 and float(rows.alpha[1]) == 0.0
        assert len({round(a[k], 8) for k in (0, 3, 4)} - {ALPHA, 0.0}) == 3
        assert a[2] == ALPHA
    else:
        assert all(a[k] == ALPHA for k in range(N))
        assert np.all(np.asarray(rows.alpha) == np.float64(ALPHA))


def test_apfl_with_alpha_zero_is_fedavg_and_evaluates_the_global_model(x64):
    _, params = _federation()
    state, per_round, rows, personal = _library("apfl", 0.0)
    _, fedavg_rounds, _, _ = _library("fedavg", LR)
    helpers.assert_trees_close(per_round, fedavg_rounds, rtol=1e-12, atol=1e-14)
    for k in range(N):  # v_i gets zero gradients; the personal model is w
        _close(_row_k(rows.local, k), helpers.logreg_to_numpy(params), "v", 0, 0)
        _close(_row_k(personal, k), helpers.logreg_to_numpy(state.params), "personal", 0, 0)


def _assert_vmap_equals_separate_runs(name, values):
    """One vmapped program over ``values`` of the method's traced hyper-parameter
    equals the separate runs (iterates, rows, personal models)."""
    train, params = _federation()
    values = jnp.asarray(values)
    batched = jax.jit(jax.vmap(_program(name), in_axes=(0, None, None)))(
        values, params, _cohorts(train))
    for i, value in enumerate(values):
        single = _library(name, value)
        helpers.assert_trees_close(jax.tree.map(lambda v: v[i], batched[1:]), single[1:],
                                   rtol=1e-10, atol=1e-12)


def test_apfl_vmap_over_alpha_equals_separate_runs(x64):
    _assert_vmap_equals_separate_runs("apfl", [0.1, 0.6])


# --------------------------------------------------------------------------------------
# pFedMe


def test_pfedme_matches_the_numpy_reference(x64):
    train, params = _federation()
    state, per_round, rows, personal = _library("pfedme", LAM)
    trajectory, theta = pfedme_reference(train, params, LAM)
    for r, expected in enumerate(trajectory):
        _close(_round_params(per_round, r), expected, f"w after round {r}")
    for k in range(N):
        _close(_row_k(rows, k), theta[k], f"theta_{k}")
        _close(_row_k(personal, k), theta[k], f"personal model of {k}")
    # client 0 took no step in round 1 (budget 0): its row is round 0's solution, not w
    assert np.abs(theta[0][0] - trajectory[0][0]).max() > 1e-3


def test_pfedme_with_lambda_zero_freezes_the_global_model(x64):
    """lambda = 0: w_i never moves, so w^t = w^0; theta_i is local SGD from w^0."""
    train, params = _federation()
    state, per_round, rows, _ = _library("pfedme", 0.0)
    _, theta = pfedme_reference(train, params, 0.0)
    for r in range(len(ROUNDS)):
        _close(_round_params(per_round, r), helpers.logreg_to_numpy(params), "w", 0, 0)
    for k in range(N):
        _close(_row_k(rows, k), theta[k], f"theta_{k}")


def test_pfedme_cold_start_one_inner_step_is_fedavg(x64):
    """warm_start=False, K = 1, beta = 1: w <- w - eta lam personal_lr grad f(w; D)."""
    _, cold_rounds, _, _ = _library("pfedme_cold_k1", LAM)
    _, fedavg_rounds, _, _ = _library("fedavg", ETA * LAM * PERSONAL_LR)
    helpers.assert_trees_close(cold_rounds, fedavg_rounds, rtol=1e-10, atol=1e-12)


def test_pfedme_vmap_over_lambda_equals_separate_runs(x64):
    _assert_vmap_equals_separate_runs("pfedme", [1.0, LAM])


@pytest.mark.parametrize("name, options", [
    ("pfedme_momentum", dict(momentum=MOMENTUM)),
    ("pfedme_clip_loss", dict(clip=CLIP, clip_mode="loss")),
    ("pfedme_clip_step", dict(clip=CLIP, clip_mode="step"))])
def test_pfedme_local_training_options_match_the_numpy_reference(x64, name, options):
    """training.optimizer = SGD with momentum 0.9 drives the local-model step and, by
    default, the K inner steps (one heavy-ball state each per round); clip_norm clips
    the inner steps' gradient (both forms). Each differs from plain pFedMe."""
    train, params = _federation()
    _, per_round, rows, _ = _library(name, LAM)
    trajectory, theta = pfedme_reference(train, params, LAM, **options)
    plain, _ = pfedme_reference(train, params, LAM)
    for r, expected in enumerate(trajectory):
        _close(_round_params(per_round, r), expected, f"w after round {r}")
    for k in range(N):
        _close(_row_k(rows, k), theta[k], f"theta_{k}")
    assert np.abs(trajectory[-1][0] - plain[-1][0]).max() > 1e-3


def test_apfl_with_alpha_zero_and_clipping_is_fedavg_with_clipping(x64):
    """APFL clips grad_w and grad_v separately, so with alpha = 0 (v gets zero
    gradients) w follows FedAvg's clipped steps exactly; the clip binds here."""
    _, clipped_rounds, _, _ = _library("apfl_clip", 0.0)
    _, fedavg_clipped, _, _ = _library("fedavg_clip", LR)
    _, fedavg_rounds, _, _ = _library("fedavg", LR)
    helpers.assert_trees_close(clipped_rounds, fedavg_clipped, rtol=1e-12, atol=1e-14)
    assert helpers.tree_norm(helpers.tree_sub(fedavg_clipped, fedavg_rounds)) > 1e-3


# --------------------------------------------------------------------------------------
# Tables, float32


def _test_loss(params_np, k):
    """Mean cross-entropy of (W, b) on client k's test rows, float64."""
    n = int(DATA.test.num_examples[k])
    x = np.asarray(DATA.test.examples["x"][k, :n], np.float64)
    y = np.asarray(DATA.test.examples["y"][k, :n])
    z = x @ params_np[0] + params_np[1]
    z = z - z.max(-1, keepdims=True)
    return -np.mean((z - np.log(np.exp(z).sum(-1, keepdims=True)))[np.arange(n), y])


def test_apfl_in_float32_lazy_table_and_personal_evaluation():
    """Float32: dense and lazy tables hold the same rows (v_i and a scalar alpha_i), and
    the runner's evaluator scores alpha_i v_i + (1 - alpha_i) w on client i's test rows."""
    params, cohorts = helpers.init_params(MODEL, 1), _cohorts(DATA.train)
    algs = {t: apfl(MODEL, alpha=ALPHA, adaptive_alpha=True, alpha_lr=ALPHA_LR,
                    training=ClientTraining(lr=LR, batch_size=B, num_epochs=EPOCHS),
                    client_table=t) for t in ("dense", "lazy")}
    states = {t: jax.jit(lambda alg=alg: _run(alg, params, cohorts)[0])()
              for t, alg in algs.items()}
    rows = {t: _rows(algs[t], states[t]) for t in algs}
    helpers.assert_trees_close((states["lazy"].params, rows["lazy"]),
                               (states["dense"].params, rows["dense"]), rtol=1e-6, atol=1e-7)
    alg, state, rows = algs["dense"], states["dense"], rows["dense"]
    assert alg.evaluates == "personal" and float(jnp.min(rows.alpha)) < ALPHA
    metrics = make_state_evaluator(MODEL, alg.personal)(state, DATA.test, ALL)
    w = helpers.logreg_to_numpy(state.params)
    differs = 0
    for k in range(N):
        if DATA.test.num_examples[k] == 0:
            continue
        a = float(rows.alpha[k])
        mixed = _lin((a, _row_k(rows.local, k)), (1 - a, w))
        np.testing.assert_allclose(metrics["loss"][k], _test_loss(mixed, k), rtol=1e-4,
                                   atol=1e-5)
        differs += abs(_test_loss(mixed, k) - _test_loss(w, k)) > 1e-3
    assert differs  # some client's personal model is not the global model


# --------------------------------------------------------------------------------------
# Hyper-parameter checks


@pytest.mark.parametrize("field, kwargs", [
    ("alpha", dict(alpha=1.5)), ("alpha", dict(alpha=-0.1)), ("alpha_lr", dict(alpha_lr=0.0)),
    ("adaptive_alpha", dict(adaptive_alpha="yes")),
    ("training.lr", dict(training=ClientTraining(lr=-1.0))),
    ("training.batch_size", dict(training=ClientTraining(batch_size=0))),
    ("training.weight_decay", dict(training=ClientTraining(weight_decay=1e-4)))])
def test_apfl_refuses_bad_values(field, kwargs):
    with pytest.raises(ValueError, match=field):
        apfl(MODEL, **kwargs)


@pytest.mark.parametrize("field, kwargs", [
    ("lam", dict(lam=-1.0)), ("inner_steps", dict(inner_steps=0)),
    ("inner_steps", dict(inner_steps=2.5)), ("personal_lr", dict(personal_lr=0.0)),
    ("beta", dict(beta=0.0)), ("training.lr", dict(training=ClientTraining(lr=0.0))),
    ("warm_start", dict(warm_start=1)),
    ("training.num_epochs", dict(training=ClientTraining(num_epochs=0))),
    ("training.weight_decay", dict(training=ClientTraining(lr=0.005, weight_decay=1e-4)))])
def test_pfedme_refuses_bad_values(field, kwargs):
    with pytest.raises(ValueError, match=field):
        pfedme(MODEL, **kwargs)


def test_traced_hyper_parameters_pass_the_factories():
    apfl(MODEL, alpha=jnp.float32(0.3), alpha_lr=jnp.float32(0.1))
    pfedme(MODEL, lam=jnp.float32(15.0), personal_lr=jnp.float32(0.05), beta=jnp.float32(2.0))
