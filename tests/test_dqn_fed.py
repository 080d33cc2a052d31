"""DQN-Fed (fedjax_fair/algorithms/dqn_fed.py): the properties its theorems and update rules imply.

The client's decrement is checked against dense inverse / direct BFGS matrices, and the
whole method on quadratic federations. The server's closed form against the paper's
literal Gram-Schmidt equations: tests/test_dqn_fed_server.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from fedjax_fair.core.algorithm import with_improvement
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.core.client import ClientTraining, data_loss
from fedjax_fair.drivers.simulate import simulate
from fedjax_fair.solvers.qp import solve_box_simplex_qp
from fedjax_fair.core.types import Broadcast, ClientData, FederatedData
from dqn_fed_common import D, _tree


# ------------------------------------------------------------------------ client


def _pairs_from(S, Y, memory):
    """Pairs from NumPy rows (oldest first), each pushed through ``push_pair``."""
    pairs = D.empty_pairs(jnp.zeros(S.shape[1]), memory)
    for s, y in zip(S, Y):
        pairs = D.push_pair(pairs, jnp.asarray(s, jnp.float32), jnp.asarray(y, jnp.float32))
    return pairs


def np_inverse_bfgs(S, Y, gamma0):
    Hm = gamma0 * np.eye(S.shape[1])
    for s, y in zip(S, Y):
        rho = 1 / (s @ y)
        V = np.eye(len(s)) - rho * np.outer(y, s)
        Hm = V.T @ Hm @ V + rho * np.outer(s, s)
    return Hm


def np_direct_bfgs(S, Y):
    B = np.eye(S.shape[1])
    for s, y in zip(S, Y):
        Bs = B @ s
        B = B - np.outer(Bs, Bs) / (s @ Bs) + np.outer(y, y) / (s @ y)
    return B


def test_lbfgs_two_loop_equals_the_dense_inverse_bfgs():
    rng = np.random.default_rng(0)
    A = rng.normal(size=(6, 6))
    A = A @ A.T + np.eye(6)
    S = rng.normal(size=(3, 6))
    Y = S @ A  # exact curvature pairs of a convex quadratic
    pairs = _pairs_from(S, Y, memory=3)
    gamma0 = float(D.initial_scale(pairs, 0.1))
    np.testing.assert_allclose(gamma0, S[-1] @ Y[-1] / (Y[-1] @ Y[-1]), rtol=1e-5)
    Hm = np_inverse_bfgs(S, Y, gamma0)
    g = rng.normal(size=6)
    np.testing.assert_allclose(D.lbfgs_two_loop(jnp.asarray(g, jnp.float32), pairs, gamma0),
                               Hm @ g, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(D.lbfgs_two_loop(jnp.asarray(Y[-1], jnp.float32), pairs,
                                                gamma0), S[-1], rtol=1e-4, atol=1e-5)  # H y = s
    dt = D.decrement(jnp.asarray(g, jnp.float32), pairs, gamma0)
    np.testing.assert_allclose(float(dt), g @ Hm @ g, rtol=1e-4)
    B = np_direct_bfgs(S, Y)
    np.testing.assert_allclose(D.direct_bfgs_apply(jnp.asarray(g, jnp.float32), pairs), B @ g,
                               rtol=1e-4, atol=1e-5)


def test_pairs_without_curvature_are_rejected_and_no_pairs_gives_the_scaled_norm():
    s = np.array([1.0, 0.0, 0.0])
    pairs = _pairs_from(np.array([s, s]), np.array([-s, 0 * s]), memory=2)
    assert not np.any(pairs.valid)
    g = jnp.asarray([1.0, 2.0, 2.0])
    assert float(D.initial_scale(pairs, 0.05)) == pytest.approx(0.05)
    np.testing.assert_allclose(float(D.decrement(g, pairs, 0.05)), 0.05 * 9.0, rtol=1e-6)


def test_decrement_is_bounded_by_gamma_max_along_g():
    """A pair with s.y just above the acceptance threshold makes H ~ s s^T / (s.y)
    huge along s: d~ is clipped to gamma_max ||g||^2 (the bound H0 already has), and
    untouched below it."""
    s = np.array([1.0, 0.0, 0.0])
    y = np.array([1e-6, 1.0, 0.0])  # s.y = 1e-6 > 1e-8 ||s|| ||y||: accepted
    pairs = _pairs_from(s[None], y[None], memory=2)
    assert bool(pairs.valid[-1])
    gamma0 = D.initial_scale(pairs, 0.1)
    g = jnp.asarray([0.5, 0.0, 0.0])
    free = float(D.decrement(g, pairs, gamma0, gamma_max=np.inf))
    Hm = np_inverse_bfgs(s[None], y[None], float(gamma0))
    np.testing.assert_allclose(free, np.asarray(g) @ Hm @ np.asarray(g), rtol=1e-4)
    assert free > 1e4 * 0.25  # the step d~ / ||g|| would be ~1e5 ||g||
    np.testing.assert_allclose(float(D.decrement(g, pairs, gamma0)), 100.0 * 0.25, rtol=1e-6)
    np.testing.assert_allclose(float(D.decrement(g, pairs, gamma0, gamma_max=3.0)), 0.75,
                               rtol=1e-6)
    small = jnp.asarray([0.0, 0.0, 2.0])  # H = gamma0 there: below the bound, unchanged
    np.testing.assert_allclose(float(D.decrement(small, pairs, gamma0)),
                               float(gamma0) * 4.0, rtol=1e-5)


def test_isotropic_quadratic_gives_the_exact_newton_decrement():
    """f = a/2 ||theta||^2: any pair gives gamma0 = 1/a, H = I/a, d~ = ||g||^2 / a; the
    direct form with one pair matches its closed formula (spec A1)."""
    a = 4.0
    s = np.array([0.3, -1.0, 0.5])
    pairs = _pairs_from(s[None], a * s[None], memory=2)
    gamma0 = D.initial_scale(pairs, 1.0)
    np.testing.assert_allclose(float(gamma0), 1 / a, rtol=1e-6)
    g = jnp.asarray([1.0, 2.0, -1.0])
    np.testing.assert_allclose(float(D.decrement(g, pairs, gamma0)), 6.0 / a, rtol=1e-5)
    gn, y = np.asarray(g, np.float64), a * s
    direct = gn @ gn - (gn @ s) ** 2 / (s @ s) + (gn @ y) ** 2 / (s @ y)
    np.testing.assert_allclose(float(D.decrement(g, pairs, gamma0, bfgs_form="direct")),
                               direct, rtol=1e-5)


# ------------------------------------------------------------ quadratic federation


def quadratic_federation(num_clients=4, dim=8, rows=8, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=2.0, size=(num_clients, 1, dim)) + rng.normal(
        scale=0.1, size=(num_clients, rows, dim))
    curv = rng.uniform(0.5, 3.0, size=(num_clients, 1, dim)) * np.ones((1, rows, 1))
    x = np.concatenate([curv, centres], axis=-1).astype(np.float32)  # rows (a, b)
    split = ClientData(examples={"x": jnp.asarray(x), "y": jnp.zeros(x.shape[:2], jnp.int32)},
                       mask=jnp.ones(x.shape[:2], bool),
                       num_examples=jnp.full((num_clients,), rows, jnp.int32))
    return FederatedData(train=split, test=split)


def _losses(model, params, data):
    return np.asarray(jax.vmap(lambda d: data_loss(model, params, d))(data.train))


def _full(key, n, k):
    return jnp.arange(n)


def test_every_client_improves_every_round_with_the_step_cap():
    """Heterogeneous quadratics, full participation, gradients at the global model,
    Theorem 4.2's cap on the realised decreases: no client's loss ever rises
    (improved fraction, DQN-Fed eq. 29, = 1 every round) and the cohort approaches
    Pareto-stationarity; FedAvg raises some client's loss."""
    model, data = helpers.quadratic_model(8), quadratic_federation()
    alg = with_improvement(D.dqn_fed(model, mode="grad_at_global", step_cap="thm42",
                                     server_lr=1.0, training=ClientTraining(lr=0.2, batch_size=8)),
                           model)
    run = jax.jit(lambda s, k: simulate(alg, s, data, k, num_rounds=40, cohort_size=4,
                                        sampler=_full))
    state, metrics = run(alg.init(model.init(None), 4), jax.random.key(0))
    np.testing.assert_array_equal(metrics["improved_fraction"], 1.0)
    assert float(metrics["server/step_factor"][0]) > 0  # it moves, then stalls (spec A7b)
    # Pareto-stationarity: the min-norm convex combination of the gradients is small
    # next to the gradients themselves
    grads = np.stack([np.asarray(jax.grad(lambda p, d=jax.tree.map(lambda v: v[k], data.train):
                                          data_loss(model, p, d))(state.params)["theta"])
                      for k in range(4)])
    gram = jnp.asarray(grads @ grads.T, jnp.float32)
    lam = solve_box_simplex_qp(gram, jnp.zeros(4), jnp.zeros(4), jnp.ones(4), num_iters=2000)
    assert np.linalg.norm(np.asarray(lam) @ grads) < 1e-2 * np.linalg.norm(grads, axis=1).max()

    fed = with_improvement(
        fedavg(model, training=ClientTraining(lr=0.2, batch_size=2, num_epochs=3)), model)
    _, fed_metrics = jax.jit(lambda s, k: simulate(fed, s, data, k, num_rounds=10,
                                                   cohort_size=4, sampler=_full))(
        fed.init(model.init(None), 4), jax.random.key(0))
    assert np.min(fed_metrics["improved_fraction"]) < 1.0


def test_uncapped_literal_step_is_the_paper_step_and_keeps_the_previous_model():
    model, data = helpers.quadratic_model(8), quadratic_federation(seed=1)
    alg = D.dqn_fed(model, mode="grad_at_global", training=ClientTraining(lr=0.2, batch_size=8))
    state = alg.init(model.init(None), 4)
    first, m1 = simulate(alg, state, data, jax.random.key(0), num_rounds=1, cohort_size=4,
                         sampler=_full)
    # round 0: no pair (theta^-1 = theta^0), so d~_k = gamma0 ||g_k||^2 with gamma0 = eta_l
    np.testing.assert_allclose(first.aggregator_state.previous["theta"], 0.0)
    np.testing.assert_allclose(m1["server/realised_decrease"][0], m1["server/dtilde"][0],
                               rtol=1e-3)
    second, _ = simulate(alg, first, data, jax.random.key(1), num_rounds=1, cohort_size=4,
                         sampler=_full)
    np.testing.assert_allclose(second.aggregator_state.previous["theta"],
                               first.params["theta"])


def test_pseudo_gradient_client_sends_the_scaled_delta_and_a_local_pair():
    model, data = helpers.quadratic_model(8), quadratic_federation(seed=2)
    client = D.dqn_client(model, training=ClientTraining(lr=0.1, batch_size=4, num_epochs=2),
                          probe_size=None)
    theta = {"theta": jnp.linspace(-1.0, 1.0, 8)}
    row = jax.tree.map(lambda v: v[0], data.train)
    out, _ = client(Broadcast(theta, jnp.int32(3), theta), (), row, jnp.int32(100),
                    jax.random.key(0))
    assert int(out.num_steps) == 4
    np.testing.assert_allclose(out.extra["g"]["theta"], out.delta["theta"] / (0.1 * 4),
                               rtol=1e-6)
    assert int(out.extra["num_pairs"]) == 2  # one pair per local epoch
    assert float(out.extra["dtilde"]) > 0


def test_vmap_equals_sequential(mode="pseudo_grad"):
    data = helpers.tiny_federation(padded_size=13)
    model = helpers.logreg()
    alg = D.dqn_fed(model, mode=mode, training=ClientTraining(lr=0.1, batch_size=4))
    params = helpers.init_params(model, 0)
    outs = {}
    for execution in ("vmap", "sequential"):
        state = alg.init(params, data.num_clients)
        outs[execution], _ = simulate(alg, state, data, jax.random.key(0), num_rounds=3,
                                      cohort_size=4, execution=execution)
    helpers.assert_trees_close(outs["vmap"].params, outs["sequential"].params, rtol=2e-4,
                               atol=1e-6)


def test_factory_checks_its_arguments():
    model = helpers.logreg()
    for kwargs in ({"mode": "nope"}, {"bfgs_form": "nope"}, {"step_cap": "nope"},
                   {"ridge": -1.0}, {"server_lr": 0.0}, {"gamma_min": 1.0, "gamma_max": 0.5},
                   {"memory": 0}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            D.dqn_fed(model, **kwargs)
    # a traced ridge / server rate passes (sweeps and meta-gradients)
    jax.jit(lambda r: D.dqn_combine(_tree(np.eye(10)[:2], 2), jnp.ones(2), ridge=r).S)(1e-6)


def test_aggregator_under_any_client_update():
    """With plain FedAvg clients it uses the deltas and d~_k = ||Delta_k||^2: every
    client's linearised change equals its own step's."""
    model = helpers.logreg()
    data = helpers.tiny_federation(padded_size=13)
    from fedjax_fair import compose, local_training
    alg = compose(local_training(model, ClientTraining(lr=0.1, batch_size=4)),
                  aggregator=D.dqn_aggregator())
    state = alg.init(helpers.init_params(model, 0), data.num_clients)
    _, metrics = simulate(alg, state, data, jax.random.key(0), num_rounds=1, cohort_size=4)
    real, dt = metrics["server/realised_decrease"][0], metrics["server/dtilde"][0]
    keep = dt > 0
    np.testing.assert_allclose(real[keep], dt[keep], rtol=1e-3)


def test_grad_and_vmap_through_the_server_rate_and_ridge():
    """The continuous hyper-parameters stay traceable: d(final loss)/d(eta_g) of a
    2-round run is finite and matches a central finite difference; vmap over eta_g."""
    model, data = helpers.quadratic_model(8), quadratic_federation(seed=3)

    def final_loss(rate, ridge=1e-6):
        alg = D.dqn_fed(model, mode="grad_at_global", server_lr=rate, ridge=ridge,
                        training=ClientTraining(lr=0.2, batch_size=8))
        state, _ = simulate(alg, alg.init(model.init(None), 4), data, jax.random.key(0),
                            num_rounds=2, cohort_size=4, sampler=_full)
        return jnp.mean(jax.vmap(lambda d: data_loss(model, state.params, d))(data.train))

    g = float(jax.jit(jax.grad(final_loss))(0.3))
    h = 1e-3
    fd = (float(jax.jit(final_loss)(0.3 + h)) - float(jax.jit(final_loss)(0.3 - h))) / (2 * h)
    assert np.isfinite(g) and g == pytest.approx(fd, rel=2e-2, abs=1e-4)
    losses = jax.jit(jax.vmap(final_loss))(jnp.array([0.1, 0.3, 0.5]))
    assert losses.shape == (3,) and np.all(np.isfinite(losses))
    assert np.isfinite(float(jax.jit(jax.grad(final_loss, argnums=1))(0.3, 1e-4)))
