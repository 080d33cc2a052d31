"""Second-order baselines of DQN-Fed: FedNL, FedNL-PP, FedNew, and the curvature
helpers they share (fedjax_fair/algorithms/families/second_order.py).

* Hutchinson's diagonal estimator: exact with one probe on a diagonal-Hessian
  quadratic; its mean over many probes converges to the exact diagonal (checked
  against ``jax.hessian``) on a logistic loss whose Hessian is not diagonal.
* Three rounds of each method against a literal NumPy float64 transcription of the
  module docstrings' equations on helpers.tiny_federation() (unequal sizes, an empty
  client, padded rows, padded cohorts whose masked rows repeat a client id, partial
  participation), with the exact diagonal of the logistic loss in closed form.
* On a strongly convex quadratic federation with diagonal Hessians, each method
  reaches the global optimum (FedNL in one step under full participation, where a
  Newton step with exact diagonal curvature is exact; FedNL-PP and FedNew with
  partial participation).
* Rows of clients outside a cohort persist unchanged; vmap == sequential execution;
  dense == lazy tables; a traced hyper-parameter vmaps; every registry contract.
* A short run on the synthetic dataset with logistic regression is finite and
  improves test accuracy.
"""
from __future__ import annotations

import functools
import importlib
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import helpers
from fedjax_fair.algorithms.families import second_order as hessian
from fedjax_fair.drivers import simulate as sim
from fedjax_fair.algorithms.fednew import fednew
from fedjax_fair.algorithms.fednl import fednl, fednl_pp, top_k
from fedjax_fair.core.client import FIELDS, ClientTraining, data_loss
from fedjax_fair.core.types import ClientData, FederatedData

# the package exports the factories under the modules' names
fednew_lib = importlib.import_module("fedjax_fair.algorithms.fednew")
fednl_lib = importlib.import_module("fedjax_fair.algorithms.fednl")

MODEL = helpers.logreg()
PARAMS = helpers.init_params(MODEL, 1)
DATA = helpers.tiny_federation()
TRAIN = DATA.train
N = DATA.num_clients
SIZES = np.asarray(helpers.TRAIN_SIZES)
RTOL, ATOL = 1e-4, 1e-5

# (client ids, mask) of three rounds of a cohort of 4 (test_stateful's): the empty
# client takes part, padding rows repeat a client id under a False mask, clients 4
# and 1 take part once.
ROUNDS = (([0, 3, 2, 0], [True, True, True, False]),
          ([1, 4, 0, 5], [True, True, True, True]),
          ([5, 0, 3, 1], [True, True, True, False]))
ROUND_KEYS = tuple(jax.random.key(100 + r) for r in range(len(ROUNDS)))

MU, ALPHA_H, SERVER_LR = 0.05, 0.7, 0.8  # FedNL(-PP)
TOPK = 0.3
RHO, ALPHA_N = 0.6, 0.2  # FedNew
LR, EPOCHS, B = 0.2, 2, 12  # pseudo-gradient mode: B >= every client's size (full batch)

_KW = {
    "fednl": dict(mode="grad_at_global", mu=MU, alpha=ALPHA_H, server_lr=SERVER_LR),
    "fednl_shift_topk": dict(mode="grad_at_global", option="shift", compressor="topk",
                             topk_fraction=TOPK, mu=MU, alpha=ALPHA_H, server_lr=SERVER_LR),
    "fednl_pp": dict(mode="grad_at_global", mu=MU, alpha=ALPHA_H, server_lr=SERVER_LR,
                     compressor="topk", topk_fraction=TOPK),
    "fednew": dict(mode="grad_at_global", rho=RHO, alpha=ALPHA_N, server_lr=SERVER_LR),
    "fednew_pseudo": dict(rho=RHO, alpha=ALPHA_N,
                          training=ClientTraining(lr=LR, batch_size=B, num_epochs=EPOCHS)),
}
_FACTORY = {"fednl": fednl, "fednl_shift_topk": fednl, "fednl_pp": fednl_pp,
            "fednew": fednew, "fednew_pseudo": fednew}


def make(name, table="dense", **overrides):
    return _FACTORY[name](MODEL, client_table=table, **{**_KW[name], **overrides})


@functools.cache
def _run_rounds(name, execution="sequential", table="dense"):
    """The three ROUNDS with the library; (algorithm, [initial state, states...])."""
    alg = make(name, table)
    apply = jax.jit(lambda s, c, k: alg.apply(s, c, k, execution))
    states = [alg.init(PARAMS, N)]
    for (ids, mask), key in zip(ROUNDS, ROUND_KEYS):
        states.append(apply(states[-1], helpers.cohort(TRAIN, ids, mask=mask), key)[0])
    return alg, states


def _rows(alg, state):
    return alg.client_table.gather(state.client_states, jnp.arange(N, dtype=jnp.int32))


def _np(params):
    return helpers.logreg_to_numpy(params)


def _close(actual, expected, what):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL, err_msg=what)


# --------------------------------------------------------------------------------------
# Curvature helpers.


def _diag_quadratic(a, b):
    return lambda p: 0.5 * sum(jnp.sum(ai * jnp.square(pi - bi)) for ai, pi, bi in
                               zip(jax.tree.leaves(a), jax.tree.leaves(p), jax.tree.leaves(b)))


def test_hutchinson_is_exact_on_a_diagonal_hessian():
    a = {"u": jnp.asarray([0.5, 2.0, 3.0]), "v": jnp.asarray([[1.5, 0.1], [4.0, 0.7]])}
    b = jax.tree.map(lambda x: x + 1.0, a)
    params = jax.tree.map(jnp.zeros_like, a)
    fn = _diag_quadratic(a, b)
    est = jax.jit(lambda p, k: hessian.hutchinson_diagonal(fn, p, k, 3))(params,
                                                                       jax.random.key(3))
    helpers.assert_trees_close(est, a, rtol=1e-6, atol=1e-7)
    helpers.assert_trees_close(jax.jit(lambda p: hessian.exact_diagonal(fn, p))(params), a,
                               rtol=1e-6, atol=1e-7)


def _logreg_loss(k=0):
    return lambda p: data_loss(MODEL, p, helpers.client(TRAIN, k))


@functools.cache
def _full_hessian(fn):
    flat, unravel = ravel_pytree(PARAMS)
    return np.asarray(jax.jit(jax.hessian(lambda x: fn(unravel(x))))(flat), np.float64)


_LOSS_1 = _logreg_loss(1)


def test_exact_diagonal_equals_the_hessian_diagonal_and_grad_comes_along():
    fn = _LOSS_1
    full = _full_hessian(fn)
    assert np.abs(full - np.diag(np.diag(full))).max() > 1e-3  # not diagonal
    value, grad, diag, exact, reference_grad = jax.jit(lambda p: (
        *hessian.value_grad_diagonal(fn, p, curvature="exact"),
        hessian.exact_diagonal(fn, p, chunk_size=7), jax.grad(fn)(p)))(PARAMS)
    np.testing.assert_allclose(ravel_pytree(exact)[0], np.diag(full), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(value, fn(PARAMS), rtol=1e-6)
    helpers.assert_trees_close(grad, reference_grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ravel_pytree(diag)[0], np.diag(full), rtol=1e-5, atol=1e-7)
    w, b = _np(PARAMS)
    np.testing.assert_allclose(ravel_pytree(diag)[0], np.concatenate(
        [x.ravel() for x in reversed(_np_diag(w, b, *helpers.real_rows(TRAIN, [1])))]),
        rtol=1e-5, atol=1e-7)  # the closed form used by the NumPy references


def test_hutchinson_mean_converges_to_the_exact_diagonal():
    """Each entry's estimate has variance sum_{j != i} H_ij^2 / P: the error of the
    mean over P probes stays within 5 standard deviations and shrinks with P."""
    fn = _LOSS_1
    full = _full_hessian(fn)
    exact = np.diag(full)
    off = np.sqrt(np.sum(np.square(full), 1) - np.square(exact))
    estimate = jax.jit(hessian.hutchinson_diagonal, static_argnums=(0, 3))
    errors = {}
    for probes in (16, 4096):
        est = ravel_pytree(estimate(fn, PARAMS, jax.random.key(3), probes))[0]
        err = np.abs(np.asarray(est, np.float64) - exact)
        assert np.all(err <= 5 * off / np.sqrt(probes) + 1e-6), probes
        errors[probes] = err.max()
    assert errors[4096] < errors[16] / 4


def test_row_subset_draws_real_rows():
    data = helpers.client(TRAIN, 1)  # 12 rows
    sub = hessian.row_subset(data, jax.random.key(0), 5)
    assert sub.mask.shape == (5,) and int(sub.num_examples) == 5 and bool(sub.mask.all())
    real = {tuple(r) for r in np.asarray(data.examples["x"])[:12]}
    assert {tuple(r) for r in np.asarray(sub.examples["x"])} <= real
    small = hessian.row_subset(helpers.client(TRAIN, 3), jax.random.key(0), 5)  # 3 rows
    assert int(small.num_examples) == 3 and np.asarray(small.mask).tolist() == [1, 1, 1, 0, 0]
    assert hessian.row_subset(data, jax.random.key(0), None) is data


def test_top_k_keeps_the_largest_entries_over_the_whole_tree():
    tree = {"a": jnp.asarray([0.1, -3.0, 0.2]), "b": jnp.asarray([[2.0, -0.05], [0.3, 1.0]])}
    out = top_k(tree, 3 / 7)
    np.testing.assert_array_equal(out["a"], [0.0, -3.0, 0.0])
    np.testing.assert_array_equal(out["b"], [[2.0, 0.0], [0.0, 1.0]])
    assert top_k(tree, 1.0) is tree


def test_curvature_auto_picks_exact_for_small_models():
    assert hessian.resolve_curvature("auto", PARAMS) == "exact"
    big = {"w": jnp.zeros((hessian.EXACT_MAX_PARAMS + 1,))}
    assert hessian.resolve_curvature("auto", big) == "hutchinson"
    with pytest.raises(ValueError, match="curvature"):
        hessian.resolve_curvature("full", PARAMS)


# --------------------------------------------------------------------------------------
# NumPy float64 references (parameters are (W [d, C], b [C]) tuples).


def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def _np_diag(w, b, x, y):
    """Diagonal of the Hessian of the mean cross-entropy of logits x W + b:
    d2/dW_jc2 = mean_n x_nj^2 p_nc (1 - p_nc), d2/db_c2 = mean_n p_nc (1 - p_nc)."""
    if len(y) == 0:
        return np.zeros_like(w), np.zeros_like(b)
    x = np.asarray(x, np.float64)
    s = _softmax(x @ w + b)
    s = s * (1 - s)
    return np.square(x).T @ s / len(y), s.mean(0)


def _derivatives(theta, k):
    x, y = helpers.real_rows(TRAIN, [k])
    return helpers.logreg_grad_numpy(*theta, x, y), _np_diag(*theta, x, y)


def _map(f, *trees):
    return tuple(f(*leaves) for leaves in zip(*trees))


def _zeros():
    return _map(np.zeros_like, _np(PARAMS))


def _norm(t):
    return np.sqrt(sum(np.sum(np.square(x)) for x in t))


def _np_top_k(t, fraction):
    """Top-K over ravel_pytree's order (bias, then kernel)."""
    w, b = t
    flat = np.concatenate([b.ravel(), w.ravel()])
    k = int(np.ceil(fraction * flat.size))
    keep = np.zeros_like(flat)
    idx = np.argsort(-np.abs(flat), kind="stable")[:k]
    keep[idx] = flat[idx]
    return keep[b.size:].reshape(w.shape), keep[:b.size]


def _active(ids, mask):
    return [k for k, m in zip(ids, mask) if m]


def fednl_reference(option="projection", fraction=None):
    """FedNL Algorithm 1 with diagonal Hessians, H_k^0 = D_k at a first report."""
    compress = (lambda t: t) if fraction is None else (lambda t: _np_top_k(t, fraction))
    theta = _np(PARAMS)
    h = {k: _zeros() for k in range(N)}
    seen = set()
    h_sum, count = _zeros(), 0
    out = []
    for ids, mask in ROUNDS:
        grads, errors, corrections = [], [], []
        for k in _active(ids, mask):
            g, d = _derivatives(theta, k)
            first = k not in seen
            h_old = d if first else h[k]
            diff = _map(np.subtract, d, h_old)
            corr = _map(lambda x: ALPHA_H * x, compress(diff))
            h[k] = _map(np.add, h_old, corr)
            seen.add(k)
            if SIZES[k] > 0:
                if first:
                    h_sum, count = _map(np.add, h_sum, h_old), count + 1
                grads.append(g)
                errors.append(_norm(diff))
                corrections.append(corr)
        hess = _map(lambda s: s / max(count, 1), h_sum)
        shift = np.mean(errors) if option == "shift" else 0.0
        g = _map(lambda *gs: sum(gs) / len(gs), *grads)
        theta = _map(lambda t, gg, hh: t - SERVER_LR * gg / np.maximum(hh + shift, MU),
                     theta, g, hess)
        h_sum = _map(lambda s, *cs: s + sum(cs), h_sum, *corrections)
        out.append((theta, h_sum, count, {k: v for k, v in h.items()}))
    return out


def fednl_pp_reference(fraction=TOPK):
    """FedNL-PP with diagonal Hessians: x = (sum a_k)^{-1} sum g~_k over reported
    clients, a_k = max(H_k + l_k, mu), g~_k = a_k w_k - grad f_k(w_k)."""
    theta = _np(PARAMS)
    rows = {}
    a_sum, u_sum = _zeros(), _zeros()
    out = []
    for ids, mask in ROUNDS:
        for k in _active(ids, mask):
            g, d = _derivatives(theta, k)
            old = rows.get(k)
            h_old = d if old is None else old[0]
            corr = _map(lambda x: ALPHA_H * x, _np_top_k(_map(np.subtract, d, h_old), TOPK))
            h_new = _map(np.add, h_old, corr)
            l_new = _norm(_map(np.subtract, h_new, d))
            a_new = _map(lambda x: np.maximum(x + l_new, MU), h_new)
            u_new = _map(lambda a, w, gg: a * w - gg, a_new, theta, g)
            if SIZES[k] > 0:
                a_old = _zeros() if old is None else _map(lambda x: np.maximum(x + old[1], MU),
                                                          old[0])
                u_old = _zeros() if old is None else old[2]
                a_sum = _map(lambda s, n, o: s + n - o, a_sum, a_new, a_old)
                u_sum = _map(lambda s, n, o: s + n - o, u_sum, u_new, u_old)
            rows[k] = (h_new, l_new, u_new)
        x = _map(np.divide, u_sum, a_sum)
        theta = _map(lambda t, xx: t - SERVER_LR * (t - xx), theta, x)
        out.append((theta, a_sum, u_sum, dict(rows)))
    return out


def fednew_reference(pseudo=False):
    """FedNew Algorithm 1 with diagonal Hessians, y^t the mean over reporting clients."""
    theta = _np(PARAMS)
    y = _zeros()
    lam = {k: _zeros() for k in range(N)}
    out = []
    for ids, mask in ROUNDS:
        ys = {}
        for k in _active(ids, mask):
            if SIZES[k] == 0:
                continue
            g, d = _derivatives(theta, k)
            if pseudo:  # E full-batch steps (B >= n_k): g = (theta - theta_E) / (lr E)
                x, yy = helpers.real_rows(TRAIN, [k])
                local = helpers.logreg_gd_numpy(helpers.logreg_from_numpy(*theta, PARAMS), x,
                                                yy, LR, EPOCHS)
                g = _map(lambda t, l: (t - l) / (LR * EPOCHS), theta, local)
            ys[k] = _map(lambda gg, la, yv, dd: (gg - la + RHO * yv) / (np.maximum(dd, 0)
                                                                        + ALPHA_N + RHO),
                         g, lam[k], y, d)
        y = _map(lambda *v: sum(v) / len(v), *ys.values())
        for k, yk in ys.items():
            lam[k] = _map(lambda la, a, b: la + RHO * (a - b), lam[k], yk, y)
        step = 1.0 if pseudo else SERVER_LR
        theta = _map(lambda t, v: t - step * v, theta, y)
        out.append((theta, y, {k: v for k, v in lam.items()}))
    return out


def _stacked(rows):
    return tuple(np.stack([rows[k][i] for k in range(N)]) for i in range(2))


# --------------------------------------------------------------------------------------
# Three rounds against the references.


@pytest.mark.parametrize("name,option,fraction", [("fednl", "projection", None),
                                                  ("fednl_shift_topk", "shift", TOPK)])
def test_fednl_matches_numpy_reference(name, option, fraction):
    alg, states = _run_rounds(name)
    assert alg.evaluates == "global"
    for r, (state, (theta, h_sum, count, h)) in enumerate(
            zip(states[1:], fednl_reference(option, fraction))):
        _close(_np(state.params), theta, f"round {r}: theta")
        _close(_np(state.aggregator_state.h_sum), h_sum, f"round {r}: sum H_k")
        assert float(state.aggregator_state.count) == count
        rows = _rows(alg, state)
        _close(_np(rows.h), _stacked(h), f"round {r}: H_k")
    # The Hessian estimates moved away from H^0 = D_k(theta at the first report).
    assert float(np.abs(np.asarray(_rows(alg, states[-1]).h["params"]["Dense_0"]["kernel"])
                        ).max()) > 1e-3


def test_fednl_pp_matches_numpy_reference():
    alg, states = _run_rounds("fednl_pp")
    for r, (state, (theta, a_sum, u_sum, rows)) in enumerate(
            zip(states[1:], fednl_pp_reference())):
        _close(_np(state.params), theta, f"round {r}: theta")
        _close(_np(state.aggregator_state.a_sum), a_sum, f"round {r}: sum a_k")
        _close(_np(state.aggregator_state.u_sum), u_sum, f"round {r}: sum g~_k")
        got = _rows(alg, state)
        for k, (h, l, u) in rows.items():
            _close(_map(lambda v: v[k], _np(got.h)), h, f"round {r}: H_{k}")
            np.testing.assert_allclose(float(got.l[k]), l, rtol=RTOL, atol=ATOL)
            _close(_map(lambda v: v[k], _np(got.u)), u, f"round {r}: g~_{k}")
    # Top-K with alpha < 1 leaves Hessian error behind: l_k > 0 for a returning client.
    assert float(_rows(alg, states[-1]).l[0]) > 0


@pytest.mark.parametrize("name,pseudo", [("fednew", False), ("fednew_pseudo", True)])
def test_fednew_matches_numpy_reference(name, pseudo):
    alg, states = _run_rounds(name)
    for r, (state, (theta, y, lam)) in enumerate(zip(states[1:], fednew_reference(pseudo))):
        _close(_np(state.params), theta, f"round {r}: theta")
        _close(_np(state.aggregator_state.y), y, f"round {r}: y")
        _close(_np(_rows(alg, state)), _stacked(lam), f"round {r}: lambda_k")
    # y^t is the cohort's mean y_k, so the cohort's dual changes sum to 0.
    ids, mask = ROUNDS[-1]
    cohort = [k for k in _active(ids, mask) if SIZES[k] > 0]
    change = _np(_rows(alg, states[-1]))[0][cohort] - _np(_rows(alg, states[-2]))[0][cohort]
    assert np.abs(change).max() > 1e-3
    np.testing.assert_allclose(change.sum(0), 0.0, atol=1e-5)


def test_rows_of_absent_clients_persist_unchanged():
    """A round changes only its unmasked clients' rows (a first report marks an empty
    client seen in FedNL; FedNew leaves an empty client's dual alone); everyone
    else's row is bit-for-bit the previous one."""
    for name in ("fednl", "fednl_pp", "fednew"):
        alg, states = _run_rounds(name)
        previous = _rows(alg, states[0])
        for (ids, mask), state in zip(ROUNDS, states[1:]):
            rows = _rows(alg, state)
            active = set(_active(ids, mask))
            for k in range(N):
                same = all(np.array_equal(np.asarray(a)[k], np.asarray(b)[k])
                           for a, b in zip(jax.tree.leaves(rows), jax.tree.leaves(previous)))
                expect_change = k in active and (name != "fednew" or SIZES[k] > 0)
                assert same != expect_change, (name, k, ids, mask)
            previous = rows


@pytest.mark.parametrize("name,table", [("fednl_pp", "lazy"), ("fednew", "lazy")])
def test_vmap_with_either_table_equals_sequential_with_dense(name, table):
    """The three rounds with vmapped clients and a lazy table (FedNew writes its
    cohort's rows twice a round, the dual update following the server step) equal
    the sequential run with a dense table. (FedNL's client is FedNL-PP's: the same
    derivatives, Hessian learning and Top-K.)"""
    seq_alg, seq = _run_rounds(name)
    vm_alg, vm = _run_rounds(name, "vmap", table)
    assert vm_alg.client_table.name == table
    for a, b in zip(seq[1:], vm[1:]):
        helpers.assert_trees_close(b.params, a.params, rtol=1e-5, atol=1e-6)
        helpers.assert_trees_close(b.aggregator_state, a.aggregator_state, rtol=1e-5,
                                   atol=1e-6)
        helpers.assert_trees_close(_rows(vm_alg, b), _rows(seq_alg, a), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(b.client_states.last_round, a.client_states.last_round)


# --------------------------------------------------------------------------------------
# Convergence on a strongly convex quadratic federation with diagonal Hessians.

QD, QN = 5, 8
_rng = np.random.default_rng(0)
QA = _rng.uniform(0.3, 3.0, size=(QN, QD)).astype(np.float32)  # diagonals of A_i
QB = (2.0 * _rng.normal(size=(QN, QD))).astype(np.float32)
Q_STAR = (QA.astype(np.float64) * QB).sum(0) / QA.astype(np.float64).sum(0)


QMODEL = helpers.quadratic_model(QD)
_qsplit = ClientData(examples={"x": jnp.asarray(np.concatenate([QA, QB], 1)[:, None, :]),
                               "y": jnp.zeros((QN, 1), jnp.int32)},
                     mask=jnp.ones((QN, 1), bool), num_examples=jnp.ones((QN,), jnp.int32))
QDATA = FederatedData(_qsplit, _qsplit)
QKW = dict(mode="grad_at_global", mu=0.01)


def _quadratic_run(alg, cohort_size, rounds):
    """``rounds`` rounds on cohorts of ``cohort_size`` clients drawn at random (all QN
    when it is QN), padded to QN rows with a mask (one compiled round for every
    cohort size)."""
    rng = np.random.default_rng(0)
    apply = jax.jit(alg.apply)
    state = alg.init({"theta": jnp.zeros((QD,), jnp.float32)}, QN)
    for r in range(rounds):
        ids = rng.permutation(QN)
        mask = np.arange(QN) < cohort_size
        state, _ = apply(state, helpers.cohort(QDATA.train, ids, mask=mask),
                         jax.random.key(r))
    theta = np.asarray(state.params["theta"], np.float64)
    assert np.all(np.isfinite(theta))
    return theta


def test_quadratic_optimum_is_far_from_the_unweighted_mean():
    assert np.linalg.norm(QB.mean(0) - Q_STAR) > 0.5


def test_fednl_takes_the_exact_newton_step_under_full_participation():
    """H_k^0 = D_k exactly, so the first step is theta* (one Newton step)."""
    theta = _quadratic_run(fednl(QMODEL, curvature="exact", **QKW), QN, 1)
    np.testing.assert_allclose(theta, Q_STAR, rtol=1e-5, atol=1e-5)


def test_fednl_learns_the_hessian_with_top_k_from_zero():
    """H_k^0 = 0 and Top-K corrections: the estimate is learned over rounds and the
    iterates still reach theta* (FedNL's local superlinear regime)."""
    alg = fednl(QMODEL, hessian_init="zero", compressor="topk", topk_fraction=0.4,
                **{**QKW, "mu": 0.3})
    theta = _quadratic_run(alg, QN, 40)
    np.testing.assert_allclose(theta, Q_STAR, rtol=1e-4, atol=1e-4)


def test_fednl_pp_reaches_the_optimum_with_partial_participation():
    theta = _quadratic_run(fednl_pp(QMODEL, **QKW), QN // 2, 30)
    np.testing.assert_allclose(theta, Q_STAR, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cohort_size", [QN, QN // 2])
def test_fednew_reaches_the_optimum(cohort_size):
    alg = fednew(QMODEL, mode="grad_at_global", rho=1.0, alpha=0.0)
    theta = _quadratic_run(alg, cohort_size, 100)
    np.testing.assert_allclose(theta, Q_STAR, rtol=1e-3, atol=1e-3)


# --------------------------------------------------------------------------------------
# Hyper-parameters and the registry contract.


def test_traced_hyper_parameters_pass_the_factories():
    """Continuous hyper-parameters may be traced (vmapped over, differentiated in):
    the factories check only concrete values, and every use is jnp arithmetic
    (FedNew's rho also enters the dual update after the server step)."""
    cohort = helpers.cohort(TRAIN, *ROUNDS[0])
    key = ROUND_KEYS[0]
    traced = {"fednl": lambda v: dict(mu=v, alpha=v / 4, server_lr=v),
              "fednl_pp": lambda v: dict(mu=v, alpha=v / 4, server_lr=v),
              "fednew": lambda v: dict(rho=v, alpha=v, server_lr=v)}
    for name, kwargs in traced.items():
        def one(v, name=name, kwargs=kwargs):
            alg = make(name, **kwargs(v))
            return alg.apply(alg.init(PARAMS, N), cohort, key)[0].params
        out = jax.eval_shape(jax.vmap(one), jnp.asarray([0.5, 2.0], jnp.float32))
        assert jax.tree.leaves(out)[0].shape[0] == 2, name


@pytest.mark.parametrize("factory,bad", [
    (fednl, {"mu": 0.0}), (fednl, {"alpha": 1.5}), (fednl, {"topk_fraction": 0.0}),
    (fednl, {"option": "cubic"}), (fednl, {"compressor": "rank1"}),
    (fednl, {"hessian_init": "eye"}), (fednl_pp, {"server_lr": -1.0}),
    (fednl_pp, {"num_probes": 0}), (fednew, {"rho": 0.0}), (fednew, {"alpha": -0.1}),
    (fednew, {"curvature": "full"}), (fednew, {"mode": "newton"}),
    (fednew, {"curvature_rows": 0}), (fednew, {"training": ClientTraining(batch_size=0)})])
def test_bad_hyper_parameters_are_refused_with_their_name(factory, bad):
    (name, value), = bad.items()
    if name == "training":
        name = "training.batch_size"
    with pytest.raises(ValueError, match=name):
        factory(MODEL, **bad)


@pytest.mark.parametrize("factory,module", [(fednl, fednl_lib), (fednl_pp, fednl_lib),
                                            (fednew, fednew_lib)])
def test_registry_contract(factory, module):
    """What REGISTRY entries must satisfy (tests/test_mixing.py,
    tests/test_algorithms.py): the local training as one ``training`` value (FedAvg's
    ``ClientTraining()`` by default; its ranges are ClientTraining's, so HPARAMS holds
    none of its flat names), no **kwargs, every keyword range-checked or categorical, a
    stable round carry."""
    params = inspect.signature(factory).parameters.values()
    assert not any(p.kind is p.VAR_KEYWORD for p in params)
    assert inspect.signature(factory).parameters["training"].default == ClientTraining()
    assert not set(module.HPARAMS) & set(FIELDS)
    names = {p.name for p in params if p.kind is p.KEYWORD_ONLY}
    assert set(module.HPARAMS) <= names
    alg = helpers.bind_execution(
        factory(MODEL, training=ClientTraining(batch_size=4, num_epochs=2)), "vmap")
    state = alg.init(PARAMS, N)
    cohort = helpers.cohort(TRAIN, [0, 1, 3])
    new_state, metrics = jax.eval_shape(alg.apply, state, cohort, jax.random.key(0))
    structs = lambda t: jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype),
                                                bool(getattr(x, "weak_type", False))), t)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    assert structs(new_state) == structs(jax.eval_shape(lambda s: s, state))
    assert all(v.shape in ((), (3,)) for v in metrics.values())
    _, rounds = jax.eval_shape(lambda s, d, k: sim.simulate(alg, s, d, k, num_rounds=2,
                                                            cohort_size=3),
                               state, DATA, jax.random.key(0))
    assert rounds["client_ids"].shape == (2, 3)


# --------------------------------------------------------------------------------------
# End to end on the synthetic dataset.


@pytest.mark.slow
def test_end_to_end_on_synthetic_improves_accuracy():
    from fedjax_fair.data import get_dataset
    from fedjax_fair.core.evaluation import make_evaluator
    from fedjax_fair.models import logistic_regression
    ds = get_dataset("synthetic", num_clients=6, max_examples=60)
    data = ds.data
    model = logistic_regression(ds.input_shape, ds.num_classes)
    params = helpers.init_params(model, 0)
    evaluate = jax.jit(make_evaluator(model))
    accuracy = lambda p: float(np.mean(np.asarray(evaluate(p, data.test)["accuracy"])))
    before = accuracy(params)
    # Defaults for FedNew (local-SGD pseudo-gradients, exact diagonal: d = 610); the
    # papers' exact gradients for FedNL (Hutchinson) and FedNL-PP.
    for alg in (fednl(model, mode="grad_at_global", curvature="hutchinson"),
                fednl_pp(model, mode="grad_at_global"), fednew(model)):
        apply, state = jax.jit(alg.apply), alg.init(params, 6)
        rng = np.random.default_rng(1)
        for r in range(10):  # cohorts of 3
            state, metrics = apply(state, helpers.cohort(data.train, rng.permutation(6)[:3]),
                                   jax.random.key(r))
            assert helpers.tree_all_finite(metrics)
        assert helpers.tree_all_finite(state.params)
        assert accuracy(state.params) > before + 0.3, (before, accuracy(state.params))
