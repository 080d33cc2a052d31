"""The primal-dual family (fedjax_fair/algorithms/{primal_dual, afedpd, fedadmm, fedpd,
fedspeed, feddyn}.py): the properties T1-T11 below (A-FedPD, arXiv:2409.18915), in float64
on heterogeneous quadratic clients f_i(theta) = 1/2 (theta - b_i)^T A_i (theta - b_i)
with full-batch local steps, where every quantity has a closed form.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from fedjax_fair.algorithms.afedpd import afedpd, afedpd_sam
from fedjax_fair.algorithms.fedadmm import fedadmm
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.algorithms.feddyn import feddyn
from fedjax_fair.algorithms.fedpd import fedpd
from fedjax_fair.algorithms.fedspeed import fedspeed
from fedjax_fair.algorithms.families.primal_dual import augmented_lagrangian, dual_ascent
from fedjax_fair.drivers.simulate import make_cohort, simulate
from fedjax_fair.core.types import Broadcast, ClientData, FederatedData
from fedjax_fair.core.client import ClientTraining, local_training

DIM, N, P, LR = 5, 20, 4, 0.1


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def quadratics(num_clients=N, dim=DIM, seed=0, identical=False):
    """(data, A [N, d], b [N, d]): one row (a_i, b_i) per client, A_i = diag(U(0.5, 2)),
    b_i ~ N(0, 3^2 I)."""
    rng = np.random.default_rng(seed)
    a = rng.uniform(0.5, 2.0, size=(num_clients, dim))
    b = rng.normal(scale=3.0, size=(num_clients, dim))
    if identical:
        a, b = np.repeat(a[:1], num_clients, 0), np.repeat(b[:1], num_clients, 0)
    x = np.concatenate([a, b], axis=-1)[:, None, :]
    split = ClientData(examples={"x": jnp.asarray(x), "y": jnp.zeros((num_clients, 1), jnp.int32)},
                       mask=jnp.ones((num_clients, 1), bool),
                       num_examples=jnp.ones((num_clients,), jnp.int32))
    return FederatedData(train=split, test=split), a, b


MODEL = helpers.quadratic_model(DIM)


def params():
    return {"theta": jnp.zeros((DIM,), jnp.float64)}  # inside the x64 fixture


def optimum(a, b):
    return (a * b).sum(0) / a.sum(0)


def make(factory, steps=20, **kw):
    return factory(MODEL, training=ClientTraining(lr=LR, batch_size=1, num_epochs=steps),
                   **kw)


def rows(alg, state, n=N):
    return np.asarray(alg.client_table.gather(state.client_states,
                                              jnp.arange(n, dtype=jnp.int32))["theta"])


def play(alg, data, cohorts, key=jax.random.key(0)):
    """States after each round of explicit cohorts ([R, P] ids); index 0 is init."""
    apply = jax.jit(lambda s, ids, k: alg.apply(s, make_cohort(data, ids), k)[0])
    states = [alg.init(params(), data.num_clients)]
    for r, ids in enumerate(cohorts):
        states.append(apply(states[-1], jnp.asarray(ids, jnp.int32),
                            jax.random.fold_in(key, r)))
    return states


def random_cohorts(rounds, n=N, p=P, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.choice(n, p, replace=False) for _ in range(rounds)]


def theta(state):
    return np.asarray(state.params["theta"])


def average(state):
    return np.asarray(state.aggregator_state.average["theta"])


def mean_dual(state):
    return np.asarray(state.aggregator_state.mean_dual["theta"])


# ------------------------------------------------------------------ T1, T2, T3


@pytest.mark.parametrize("rho", [0.1, 0.5, 2.0])
def test_mean_dual_recursion_extrapolation_and_frozen_deviations(rho):
    data, _, _ = quadratics()
    alg = make(afedpd, rho=rho)
    cohorts = random_cohorts(12)
    states = play(alg, data, cohorts)
    never = set(range(N)) - set(np.concatenate(cohorts))
    assert never, "the test wants a client never sampled"
    for t, ids in enumerate(cohorts):
        before, after = states[t], states[t + 1]
        lam0, lam1 = rows(alg, before), rows(alg, after)
        # T1: the mean of all N duals follows lambda-bar^t + rho (theta-bar^{t+1} - theta^t),
        # and the server's O(d) copy is that mean.
        expected = lam0.mean(0) + rho * (average(after) - theta(before))
        np.testing.assert_allclose(lam1.mean(0), expected, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(mean_dual(after), lam1.mean(0), rtol=1e-10, atol=1e-10)
        # T2: theta^{t+1} = 2 theta-bar^{t+1} - theta-bar^t and theta - theta-bar = lambda-bar / rho.
        np.testing.assert_allclose(theta(after), 2 * average(after) - average(before),
                                   rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(theta(after) - average(after), mean_dual(after) / rho,
                                   rtol=1e-10, atol=1e-10)
        # T3: inactive clients' deviations from the mean dual are frozen; the active
        # ones move by rho (theta_i - theta-bar); deviations sum to zero.
        inactive = np.setdiff1d(np.arange(N), ids)
        np.testing.assert_allclose((lam1 - lam1.mean(0))[inactive],
                                   (lam0 - lam0.mean(0))[inactive], rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose((lam1 - lam1.mean(0)).sum(0), 0.0, atol=1e-10)
    last = rows(alg, states[-1])
    for i in never:
        np.testing.assert_allclose(last[i], mean_dual(states[-1]), rtol=1e-10, atol=1e-12)
    assert np.abs(mean_dual(states[-1])).max() > 1e-2  # the duals moved


# ------------------------------------------------------------------ T4


def test_full_participation_equals_fedpd_feddyn_and_fedadmm():
    data, _, _ = quadratics(num_clients=6)
    rho = 0.5
    cohorts = [np.arange(6)] * 8
    trajectories = {}
    for name, alg in {"afedpd": make(afedpd, rho=rho), "fedpd": make(fedpd, rho=rho),
                      "feddyn": make(feddyn, alpha=rho), "fedadmm": make(fedadmm, rho=rho)}.items():
        trajectories[name] = np.stack([theta(s) for s in play(alg, data, cohorts)])
    for name in ("fedpd", "feddyn", "fedadmm"):
        np.testing.assert_allclose(trajectories[name], trajectories["afedpd"], rtol=1e-9,
                                   atol=1e-9, err_msg=name)
    assert np.abs(trajectories["afedpd"][-1]).max() > 0.1


# ------------------------------------------------------------------ T5


@pytest.mark.parametrize("factory,kw,rounds", [(afedpd, {"rho": 0.5}, 100),
                                               (feddyn, {"alpha": 0.5}, 20),
                                               (fedadmm, {"rho": 0.5}, 20)])
def test_lazy_table_equals_dense_over_100_rounds(factory, kw, rounds):
    data, _, _ = quadratics()
    out = {}
    for table in ("dense", "lazy", "lazy:20"):
        alg = make(factory, steps=3, client_table=table, **kw)
        run = jax.jit(lambda s, k: simulate(alg, s, data, k, num_rounds=rounds, cohort_size=P))
        state, _ = run(alg.init(params(), N), jax.random.key(3))
        out[table] = (theta(state), rows(alg, state), mean_dual(state))
    for table in set(out) - {"dense"}:
        for got, want in zip(out[table], out["dense"]):
            assert np.abs(got - want).max() < 1e-10, table


def test_lazy_table_stores_only_sampled_clients():
    data, _, _ = quadratics()
    alg = make(afedpd, steps=2, rho=0.5, client_table="lazy")
    cohorts = random_cohorts(3)
    state = play(alg, data, cohorts)[-1]
    report = alg.client_table.memory(state.client_states)
    assert report["rows_stored"] == len(set(np.concatenate(cohorts)))


# ------------------------------------------------------------------ T6, T7


def _client(rho, steps, weight_decay=0.0, sam_radius=None):
    training = ClientTraining(lr=LR, batch_size=1, num_epochs=steps, weight_decay=weight_decay)
    return jax.jit(local_training(MODEL, training, regularizer=augmented_lagrangian(rho),
                                  finish=dual_ascent(rho), sam_radius=sam_radius))


def _run_client(client, start, dual, a, b, steps):
    """(theta_K, lambda^+) of one client holding the single row (a, b)."""
    data = ClientData({"x": jnp.asarray(np.concatenate([a, b])[None]),
                       "y": jnp.zeros((1,), jnp.int32)},
                      jnp.ones((1,), bool), jnp.asarray(1, jnp.int32))
    out, new_dual = client(Broadcast({"theta": jnp.asarray(start)}, jnp.asarray(0, jnp.int32)),
                           {"theta": jnp.asarray(dual)}, data, jnp.asarray(steps, jnp.int32),
                           jax.random.key(0))
    return start - np.asarray(out.delta["theta"]), np.asarray(new_dual["theta"])


def test_local_solver_closed_form_signs_of_dual_penalty_and_weight_decay():
    rng = np.random.default_rng(0)
    start, c = rng.normal(size=DIM), rng.normal(size=DIM)
    zero = np.zeros(DIM)  # a = 0: the loss is constant
    rho, k = 0.5, 30
    local, new_dual = _run_client(_client(rho, k), start, c, zero, zero, k)
    np.testing.assert_allclose(local - start, -(c / rho) * (1 - (1 - LR * rho) ** k), rtol=1e-12)
    np.testing.assert_allclose(new_dual, c + rho * (local - start), rtol=1e-12)
    same, _ = _run_client(_client(rho, k), start, zero, zero, zero, k)
    np.testing.assert_array_equal(same, start)
    # Coupled weight decay: theta <- theta - eta (rho (theta - s) + wd theta), a fixed
    # point at rho s / (rho + wd), approached at the rate 1 - eta (rho + wd).
    wd = 0.3
    decayed, _ = _run_client(_client(rho, k, weight_decay=wd), start, zero, zero, zero, k)
    fixed = rho * start / (rho + wd)
    np.testing.assert_allclose(decayed, fixed + (start - fixed) * (1 - LR * (rho + wd)) ** k,
                               rtol=1e-12)


def test_sam_step_matches_literal_equations():
    rng = np.random.default_rng(1)
    start, dual = rng.normal(size=DIM), rng.normal(size=DIM)
    a, b = rng.uniform(0.5, 2.0, DIM), rng.normal(size=DIM)
    rho, r, eps, wd, k = 0.5, 0.3, 1e-2, 1e-2, 4
    got, _ = _run_client(jax.jit(local_training(
        MODEL, ClientTraining(lr=LR, batch_size=1, num_epochs=k, weight_decay=wd),
        regularizer=augmented_lagrangian(rho), finish=dual_ascent(rho), sam_radius=r,
        sam_eps=eps)),
        start, dual, a, b, k)
    th = start.copy()
    for _ in range(k):
        g0 = a * (th - b)
        e = r * g0 / (np.linalg.norm(g0) + eps)
        g = a * (th + e - b)  # perturbed loss gradient; dual, penalty, decay unperturbed
        th = th - LR * (g + dual + rho * (th - start) + wd * th)
    np.testing.assert_allclose(got, th, rtol=1e-12)


def test_sam_radius_zero_reduces_bitwise():
    data, _, _ = quadratics()
    cohorts = random_cohorts(4)
    pairs = [(make(afedpd_sam, rho=0.5, sam_radius=0.0), make(afedpd, rho=0.5)),
             (make(fedspeed, rho=0.5, sam_radius=0.0), make(feddyn, alpha=0.5))]
    for sam, plain in pairs:
        a, b = play(sam, data, cohorts)[-1], play(plain, data, cohorts)[-1]
        np.testing.assert_array_equal(theta(a), theta(b))
        np.testing.assert_array_equal(rows(sam, a), rows(plain, b))
    # and a positive radius changes the iterates
    moved = play(make(afedpd_sam, rho=0.5, sam_radius=0.2), data, cohorts)[-1]
    assert np.abs(theta(moved) - theta(play(make(afedpd, rho=0.5), data, cohorts)[-1])).max() > 1e-6


def test_zero_dual_zero_penalty_client_is_fedavg_client():
    rng = np.random.default_rng(2)
    start, a, b = rng.normal(size=DIM), rng.uniform(0.5, 2, DIM), rng.normal(size=DIM)
    pd, _ = _run_client(_client(0.0, 7), start, np.zeros(DIM), a, b, 7)
    plain = jax.jit(local_training(MODEL, ClientTraining(lr=LR, batch_size=1, num_epochs=7)))
    avg, _ = _run_client(plain, start, np.zeros(DIM), a, b, 7)
    np.testing.assert_array_equal(pd, avg)


# ------------------------------------------------------------------ T8, T9, T10


def _final_error(alg, data, a, b, rounds, seed=0):
    run = jax.jit(lambda s, k: simulate(alg, s, data, k, num_rounds=rounds, cohort_size=P))
    state, _ = run(alg.init(params(), N), jax.random.key(seed))
    return (np.linalg.norm(average(state) - optimum(a, b)) if hasattr(
        state.aggregator_state, "average") else np.linalg.norm(theta(state) - optimum(a, b)))


def test_quadratic_convergence_under_partial_participation():
    """T8: C = 20, P = 4, K = 200, eta = 0.1, 300 rounds: A-FedPD reaches the
    optimum, FedAvg keeps its client-drift bias, FedADMM (dual drift) does not converge."""
    data, a, b = quadratics()
    errors = {"afedpd": _final_error(make(afedpd, steps=200, rho=0.5), data, a, b, 300),
              "afedpd_rho2": _final_error(make(afedpd, steps=200, rho=2.0), data, a, b, 300),
              "fedavg": _final_error(make(fedavg, steps=200, weight_by_size=False), data, a, b,
                                     300),
              "fedadmm": _final_error(make(fedadmm, steps=200, rho=0.5), data, a, b, 300)}
    assert errors["afedpd"] < 1e-2, errors
    assert errors["afedpd_rho2"] < 1e-6, errors
    assert errors["fedavg"] > 0.5 and errors["fedadmm"] > 0.5, errors
    assert 100 * errors["afedpd"] < min(errors["fedavg"], errors["fedadmm"]), errors


def test_duals_are_minus_the_local_gradients_at_near_exact_solves():
    """T9: K = 500 full-batch steps solve the local problem; every active client's new
    dual is -grad f_i(theta_i^{t+1}), the duals sum to ~0 and theta -> theta*."""
    data, a, b = quadratics()
    rho = 1.0
    alg = make(afedpd, steps=500, rho=rho)
    cohorts = random_cohorts(150, seed=5)
    states = play(alg, data, cohorts)
    for t in (0, 10, 149):
        before, after, ids = states[t], states[t + 1], cohorts[t]
        lam0, lam1 = rows(alg, before)[ids], rows(alg, after)[ids]
        local = theta(before) + (lam1 - lam0) / rho  # theta_i^{t+1}
        np.testing.assert_allclose(lam1, -a[ids] * (local - b[ids]), atol=1e-6)
    final = rows(alg, states[-1])
    assert np.abs(final.sum(0)).max() < 1e-2 * np.abs(final).sum(0).max()
    assert np.linalg.norm(theta(states[-1]) - optimum(a, b)) < 1e-2


def test_identical_clients_partial_equals_full_participation_but_not_feddyn():
    """T10: with identical clients the virtual update is exact, so A-FedPD with P < C
    follows the full-participation trajectory; FedDyn's mean dual moves P/C as far."""
    data, _, _ = quadratics(num_clients=10, identical=True)
    partial = random_cohorts(10, n=10, p=3)
    full = [np.arange(10)] * 10

    def traj(alg, cohorts):
        return np.stack([theta(s) for s in play(alg, data, cohorts)])

    # (to the float32 rounding of the mixing weights 1/3 and 1/10)
    np.testing.assert_allclose(traj(make(afedpd, rho=0.5), partial),
                               traj(make(afedpd, rho=0.5), full), rtol=1e-6, atol=1e-6)
    dyn_gap = np.abs(traj(make(feddyn, alpha=0.5), partial)
                     - traj(make(feddyn, alpha=0.5), full)).max()
    assert dyn_gap > 1e-3


# ------------------------------------------------------------------ T11 and traced rho


def test_cohort_order_does_not_matter():
    data, _, _ = quadratics()
    alg = make(afedpd, rho=0.5)
    cohorts = random_cohorts(5)
    permuted = [c[::-1] for c in cohorts]
    s1, s2 = play(alg, data, cohorts)[-1], play(alg, data, permuted)[-1]
    np.testing.assert_allclose(theta(s1), theta(s2), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(rows(alg, s1), rows(alg, s2), rtol=1e-12, atol=1e-12)


def test_evaluated_model_is_the_average_or_the_server_model():
    data, _, _ = quadratics()
    cohorts = random_cohorts(3)
    avg_alg = make(afedpd, rho=0.5)
    state = play(avg_alg, data, cohorts)[-1]
    np.testing.assert_array_equal(np.asarray(avg_alg.evaluated_params(state)["theta"]),
                                  average(state))
    assert make(afedpd, rho=0.5, evaluate="server").evaluated_params is None
    assert make(feddyn, alpha=0.5, evaluate="server").evaluated_params is None  # its paper
    dyn = make(feddyn, alpha=0.5)  # the family's default: theta-bar
    np.testing.assert_array_equal(np.asarray(dyn.evaluated_params(play(dyn, data, cohorts)[-1])[
        "theta"]), average(play(dyn, data, cohorts)[-1]))
    with pytest.raises(ValueError, match="evaluate"):
        make(afedpd, evaluate="best")


def test_gradient_through_rho_matches_finite_differences():
    data, a, b = quadratics()

    def final_loss(rho):
        alg = make(afedpd, steps=5, rho=rho)
        state, _ = simulate(alg, alg.init(params(), N), data, jax.random.key(1), num_rounds=4,
                            cohort_size=P)
        return jnp.sum(jnp.square(state.params["theta"] - optimum(a, b)))

    grad = jax.jit(jax.grad(final_loss))(0.5)
    h = 1e-5
    values = jax.jit(jax.vmap(final_loss))(jnp.asarray([0.5 + h, 0.5 - h, 0.3]))
    fd = (values[0] - values[1]) / (2 * h)
    np.testing.assert_allclose(grad, fd, rtol=1e-5)
    assert abs(values[2] - values[0]) > 1e-3  # rho matters


def test_bad_hyperparameters_fail_before_compute():
    for factory, kw, field in [
            (afedpd, {"rho": 0.0}, "rho"), (afedpd_sam, {"sam_radius": -1.0}, "sam_radius"),
            (fedspeed, {"sam_eps": 0.0}, "sam_eps"),
            (fedadmm, {"training": ClientTraining(weight_decay=-1.0)}, "training.weight_decay"),
            (feddyn, {"alpha": -1.0}, "alpha")]:
        with pytest.raises(ValueError, match=field):
            factory(MODEL, **kw)
