"""FedSAM and FedCM (fedjax_fair/algorithms/{fedsam,fedcm}.py; A-FedPD, arXiv:2409.18915, its baselines).

Every comparison with NumPy runs in float64 (``jax.enable_x64`` for that test) on
logistic regression over a 5-client federation (client 2 empty) with full-batch
local steps (B >= every client's size, so batch order never matters), coupled weight
decay and four rounds of partial participation: padded cohort rows repeat a client
id under a False mask, step budgets make clients take 1-3 steps, and one client gets
a budget of 0 (it takes no step). Cohorts have 4 or 2 active clients, so the uniform
weights 1/4 and 1/2 are exact in float32 too.

* FedSAM: four rounds against a literal NumPy transcription (SAM perturbation with
  the global norm over both leaves and eps, weight decay at the unperturbed point);
  sam_radius = 0 is FedAvg to the last bit.
* FedCM: four rounds of theta and the server's momentum Delta against NumPy with a
  round-indexed client rate; alpha = 1 is FedAvg to 1e-12 (about 1 ulp apart).
* Traced hyper-parameters: ``jax.vmap`` over two values of sam_radius / alpha of the
  whole jitted run equals the separate runs; ``jax.grad`` of the final loss in alpha
  is finite and matches central differences.
* The factories refuse bad concrete values with ValueError naming the field.

Rounds run in one ``lax.scan`` (one compiled round per program); the programs are
cached and shared between the tests.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.algorithms.fedcm import fedcm
from fedjax_fair.algorithms.fedsam import fedsam
from fedjax_fair.core.client import ClientTraining, data_loss

MODEL = helpers.logreg()
SIZES = (7, 12, 0, 3, 9)  # client 2 is empty
N = len(SIZES)
B = 16  # >= max(SIZES): every local step is a full-batch step
EPOCHS = 3  # so a client takes min(budget, 3) steps
LR = 0.2
WD = 0.05
SERVER_LR = 0.8
SAM_RADIUS, SAM_EPS = 0.3, 1e-2
ALPHA = 0.4
BIG = 2 ** 30

# (ids, mask, step budgets) of four rounds of a cohort of 4 slots.
ROUNDS = (([0, 1, 3, 4], [True, True, True, True], [BIG, 2, BIG, 1]),
          ([2, 4, 0, 1], [True, True, False, False], [BIG, BIG, BIG, BIG]),
          ([1, 3, 4, 0], [True, True, True, True], [1, BIG, 0, BIG]),
          ([3, 0, 3, 1], [True, True, False, False], [BIG, 2, BIG, BIG]))
KEYS = jax.random.split(jax.random.key(3), len(ROUNDS))
RTOL, ATOL = 1e-10, 1e-12  # float64 against NumPy


def fedcm_rate(t):
    """FedCM's client rate: a schedule of the round (eta^t in Delta^{t+1})."""
    return LR * 0.9 ** t


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


@functools.cache
def _arrays():
    return helpers.client_arrays(SIZES, seed=5)


def _federation():
    """(train ClientData [N, M], params) in the current precision (float32 values,
    exact in float64)."""
    return helpers.in_default_float(helpers.pack(_arrays()), helpers.init_params(MODEL, 1))


def _cohorts(train):
    """The ROUNDS stacked along a leading round axis (for ``lax.scan``)."""
    return helpers.stacked_cohorts(train, ROUNDS)


def _run(algorithm, params, cohorts):
    """After every round, stacked: (params [R, ...], aggregator state [R, ...])."""
    return helpers.scan_rounds(algorithm, algorithm.init(params, N), cohorts, KEYS,
                               lambda state: (state.params, state.aggregator_state))[1]


COMMON = ClientTraining(batch_size=B, num_epochs=EPOCHS, weight_decay=WD)


def _iterates(algorithm):
    """theta after every round [R, ...] of ``algorithm`` (server_lr 1) on ROUNDS."""
    train, params = _federation()
    return jax.jit(lambda p, c: _run(algorithm, p, c)[0])(params, _cohorts(train))


def _fedavg_iterates(client_lr):
    return _iterates(fedavg(MODEL, training=COMMON._replace(lr=client_lr), weight_by_size=False))


@functools.cache
def _program(name: str):
    """One jitted run per method, its continuous hyper-parameter an argument."""
    builders = {
        "fedsam": lambda r: fedsam(MODEL, sam_radius=r, sam_eps=SAM_EPS,
                                   training=COMMON._replace(lr=LR), server_lr=SERVER_LR),
        "fedcm": lambda a: fedcm(MODEL, alpha=a, training=COMMON._replace(lr=fedcm_rate),
                                 server_lr=SERVER_LR),
    }
    return jax.jit(lambda value, params, cohorts: _run(builders[name](value), params, cohorts))


def _steps(k, budget):
    return 0 if SIZES[k] == 0 else min(budget, EPOCHS)


def _np_params(params):
    return helpers.logreg_to_numpy(params)


def _round_server(theta, locals_, server_lr):
    """theta - eta_g * (1 / |S|) sum_k (theta - theta_k) over (W, b) tuples."""
    mean = [sum(t - l[i] for l in locals_) / len(locals_) for i, t in enumerate(theta)]
    return tuple(t - server_lr * m for t, m in zip(theta, mean))


def _check(actual, expected, what):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL, err_msg=what)


# ------------------------------------------------------------------------ FedSAM


def fedsam_np(params, train_arrays, radius):
    """Four rounds of FedSAM, literal float64: theta per round."""
    theta = _np_params(params)
    out = []
    for ids, mask, budgets in ROUNDS:
        locals_ = []
        for k, m, budget in zip(ids, mask, budgets):
            if not m:
                continue
            x, y = train_arrays[k]
            w, b = theta
            for _ in range(_steps(k, budget)):
                gw, gb = helpers.logreg_grad_numpy(w, b, x, y)
                scale = radius / (np.sqrt(np.sum(gw ** 2) + np.sum(gb ** 2)) + SAM_EPS)
                sw, sb = helpers.logreg_grad_numpy(w + scale * gw, b + scale * gb, x, y)
                w, b = w - LR * (sw + WD * w), b - LR * (sb + WD * b)
            locals_.append((w, b))
        theta = _round_server(theta, locals_, SERVER_LR)
        out.append(theta)
    return out


def test_fedsam_matches_numpy(x64):
    train, params = _federation()
    thetas, _ = _program("fedsam")(jnp.float64(SAM_RADIUS), params, _cohorts(train))
    expected = fedsam_np(params, _arrays(), SAM_RADIUS)
    for r, theta in enumerate(expected):
        _check(_np_params(jax.tree.map(lambda v: v[r], thetas)), theta, f"round {r}")
    # SAM matters here: the same run without the perturbation is far away
    plain = fedsam_np(params, _arrays(), 0.0)[-1]
    assert np.abs(plain[0] - expected[-1][0]).max() > 1e-3


def test_fedsam_radius_zero_is_fedavg_bitwise(x64):
    """sam_radius = 0 (concrete): e = 0 * g0 / (||g0|| + eps) and theta + 0 = theta,
    so the iterates equal FedAvg's with uniform weights bit for bit (float64)."""
    sam = _iterates(fedsam(MODEL, sam_radius=0.0, training=COMMON._replace(lr=LR)))
    for a, e in zip(jax.tree.leaves(sam), jax.tree.leaves(_fedavg_iterates(LR))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


# ------------------------------------------------------------------------- FedCM


def fedcm_np(params, train_arrays, alpha):
    """Four rounds of FedCM, literal float64: (theta, Delta) per round."""
    theta = _np_params(params)
    momentum = tuple(np.zeros_like(t) for t in theta)  # Delta^0 = 0
    out = []
    for t, (ids, mask, budgets) in enumerate(ROUNDS):
        lr = fedcm_rate(t)
        active = [(k, budget) for k, m, budget in zip(ids, mask, budgets) if m]
        p = 1.0 / len(active)
        locals_, new_momentum = [], [np.zeros_like(v) for v in theta]
        for k, budget in active:
            x, y = train_arrays[k]
            w, b = theta
            steps = _steps(k, budget)
            for _ in range(steps):
                gw, gb = helpers.logreg_grad_numpy(w, b, x, y)
                vw = alpha * gw + (1 - alpha) * momentum[0]
                vb = alpha * gb + (1 - alpha) * momentum[1]
                w, b = w - lr * (vw + WD * w), b - lr * (vb + WD * b)
            locals_.append((w, b))
            if steps > 0:
                for i, (before, after) in enumerate(zip(theta, (w, b))):
                    new_momentum[i] += p * (before - after) / (steps * lr)
        theta = _round_server(theta, locals_, SERVER_LR)
        momentum = tuple(new_momentum)
        out.append((theta, momentum))
    return out


def _fedcm_rounds(alpha):
    train, params = _federation()
    thetas, agg = _program("fedcm")(jnp.float64(alpha), params, _cohorts(train))
    rows = lambda tree, r: _np_params(jax.tree.map(lambda v: v[r], tree))
    return params, [(rows(thetas, r), rows(agg.momentum, r)) for r in range(len(ROUNDS))]


def test_fedcm_matches_numpy(x64):
    params, rounds = _fedcm_rounds(ALPHA)
    expected = fedcm_np(params, _arrays(), ALPHA)
    for r, ((theta, momentum), (theta_np, momentum_np)) in enumerate(zip(rounds, expected)):
        _check(theta, theta_np, f"theta, round {r}")
        _check(momentum, momentum_np, f"Delta, round {r}")
        assert np.abs(momentum_np[0]).max() > 1e-2  # the momentum is not trivially 0
    # round 0 (Delta^0 = 0) is FedAvg on alpha * loss: the local steps alpha * g + wd theta
    theta0 = _np_params(params)
    locals_ = []
    for k, budget in zip(ROUNDS[0][0], ROUNDS[0][2]):
        x, y = _arrays()[k]
        w, b = theta0
        for _ in range(_steps(k, budget)):
            gw, gb = helpers.logreg_grad_numpy(w, b, x, y)
            w, b = w - LR * (ALPHA * gw + WD * w), b - LR * (ALPHA * gb + WD * b)
        locals_.append((w, b))
    _check(rounds[0][0], _round_server(theta0, locals_, SERVER_LR), "round 0 as FedAvg")


def test_fedcm_alpha_one_is_fedavg(x64):
    """alpha = 1 (concrete): 1 * mean loss and a 0 * <Delta, theta> term give FedAvg's
    iterates with uniform weights to 1e-12 in float64 (not bit for bit: the two
    programs fuse differently, about 1 ulp apart after four rounds)."""
    cm = _iterates(fedcm(MODEL, alpha=1.0, training=COMMON._replace(lr=fedcm_rate)))
    for a, e in zip(jax.tree.leaves(cm), jax.tree.leaves(_fedavg_iterates(fedcm_rate))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-12, atol=1e-15)


# ------------------------------------------------------ traced hyper-parameters


@pytest.mark.parametrize("name,values", [("fedsam", (0.05, 0.5)), ("fedcm", (0.3, 1.0))])
def test_vmap_over_hyperparameter(x64, name, values):
    """jit(vmap(run)) over two values == jit(run) with each value (float64)."""
    train, params = _federation()
    cohorts = _cohorts(train)
    program = _program(name)
    swept = jax.jit(jax.vmap(program, in_axes=(0, None, None)))(
        jnp.asarray(values, jnp.float64), params, cohorts)
    for i, value in enumerate(values):
        single = program(jnp.float64(value), params, cohorts)
        for a, e in zip(jax.tree.leaves(swept), jax.tree.leaves(single)):
            np.testing.assert_allclose(np.asarray(a)[i], np.asarray(e), rtol=1e-12,
                                       atol=1e-14)


@pytest.mark.slow  # the traced-alpha path is also covered by the vmap test
def test_grad_in_alpha(x64):
    """d/d alpha of the mean training loss of FedCM's final model: finite, and equal
    to central differences of the forward run (float64)."""
    train, params = _federation()
    cohorts = _cohorts(train)
    program = _program("fedcm")

    def final_loss(alpha):
        thetas, _ = program(alpha, params, cohorts)
        final = jax.tree.map(lambda v: v[-1], thetas)
        losses = jax.vmap(lambda d: data_loss(MODEL, final, d))(train)
        n = train.num_examples.astype(losses.dtype)
        return jnp.sum(losses * n) / jnp.sum(n)

    grad = jax.jit(jax.grad(final_loss))(jnp.float64(ALPHA))
    assert np.isfinite(float(grad)) and abs(float(grad)) > 1e-6
    h = 1e-5
    loss = jax.jit(final_loss)
    numeric = (float(loss(jnp.float64(ALPHA + h))) - float(loss(jnp.float64(ALPHA - h)))) / (2 * h)
    np.testing.assert_allclose(float(grad), numeric, rtol=1e-6)


# ---------------------------------------------------------------------- checks


@pytest.mark.parametrize("factory,field,value", [
    (fedcm, "alpha", 0.0), (fedcm, "alpha", 1.5), (fedcm, "alpha", -0.1),
    (fedcm, "server_lr", 0.0), (fedcm, "training.weight_decay", -1e-3),
    (fedcm, "training.lr", 0.0),
    (fedsam, "sam_radius", -0.01), (fedsam, "sam_eps", 0.0), (fedsam, "server_lr", -1.0),
    (fedsam, "training.weight_decay", -1e-3), (fedsam, "training.batch_size", 0)])
def test_refuses_bad_values(factory, field, value):
    name = field.removeprefix("training.")
    kwargs = {"training": ClientTraining()._replace(**{name: value})} if name != field else {
        field: value}
    with pytest.raises(ValueError) as info:
        factory(MODEL, **kwargs)
    assert field in str(info.value)


def test_accepts_boundary_values():
    fedcm(MODEL, alpha=1.0)
    fedsam(MODEL, sam_radius=0.0)
