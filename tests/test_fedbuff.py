"""FedBuff and FedAsync (algorithms/fedbuff.py): the in-flight pool against a literal
NumPy event simulation of the same clock, FedBuff with C = K (staleness 0) == FedAvg
with the simple average, FedAsync with one client in flight == FedProx (mu = rho) with
server rate alpha, FedAsync's proximal local steps against a literal NumPy
transcription (float32 and x64), the staleness weighting (against float64 NumPy under
x64), the bounds on concurrency, vmap over seeds, grad through the staleness exponent,
and the runner's simulated time."""
from __future__ import annotations

import heapq
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from fedjax_fair.algorithms import fedavg, fedprox
from fedjax_fair.algorithms.fedbuff import (Pool, buffered_aggregator, check_concurrency,
                                            fedasync, fedasync_cohort_note, fedbuff,
                                            staleness_weight)
from fedjax_fair.core.types import ClientOutput, ServerContext
from fedjax_fair.scenarios import system as S
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.drivers.simulate import simulate

N = helpers.ENGINE_N
TRAINING = ClientTraining(lr=0.3, batch_size=4, num_epochs=2)
SPEED = np.array([1.0, 2.3, 4.1, 0.55, 3.2, 1.7])  # no two clients tie
CLOCK = S.clock(SPEED, latency=0.25, training=TRAINING)


def _sim(alg, num_rounds, cohort_size, key=jax.random.key(0), system=None):
    alg = helpers.bind_execution(alg, "sequential")
    state = alg.init(helpers.ENGINE_PARAMS, N)
    return jax.jit(lambda s, k: simulate(alg, s, helpers.ENGINE_DATA, k, num_rounds=num_rounds,
                                         cohort_size=cohort_size, execution="sequential",
                                         system=system))(state, key)


def _numpy_events(ids, mask, steps, concurrency, k):
    """FedBuff's schedule by a literal event simulation: per round, the cohort's
    reporting clients start at the current time into free slots, then (once C are in
    flight, or when fewer could start than slots were free) the k earliest finishers
    are applied. Returns per round (clock advance, mean staleness, applied)."""
    in_flight = []  # heap of (finish, order, start_version)
    now, version, order, out = 0.0, 0, 0, []
    for r in range(len(ids)):
        free = concurrency - len(in_flight)
        started = 0
        for cid, m, st in zip(ids[r], mask[r], steps[r]):
            if m and started < free:
                t = 0.25 + st / SPEED[cid]
                heapq.heappush(in_flight, (np.float32(now) + np.float32(t), order, version))
                order += 1
                started += 1
        starved = started < min(k, free)
        if len(in_flight) >= concurrency or (starved and in_flight):
            popped = [heapq.heappop(in_flight) for _ in range(min(k, len(in_flight)))]
            arrival = max(p[0] for p in popped)
            out.append((arrival - now, np.mean([version - p[2] for p in popped]),
                        len(popped)))
            now, version = arrival, version + 1
        else:
            out.append((0.0, 0.0, 0))
    return out


@pytest.mark.parametrize("concurrency, k", [(4, 2), (5, 2)])
def test_pool_schedule_matches_a_numpy_event_simulation(concurrency, k):
    alg = fedbuff(helpers.ENGINE_MODEL, training=TRAINING, concurrency=concurrency,
                  clock=CLOCK)
    _, m = _sim(alg, 10, k, system=S.system(S.independent(0.8)))
    ids, mask = np.asarray(m["client_ids"]), np.asarray(m["client_mask"])
    expected = _numpy_events(ids, mask, np.asarray(m["num_steps"]), concurrency, k)
    np.testing.assert_allclose(m["server/round_seconds"], [e[0] for e in expected],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(m["server/staleness"], [e[1] for e in expected], atol=1e-6)
    np.testing.assert_array_equal(m["server/applied"], [e[2] for e in expected])
    assert np.asarray(m["server/staleness"]).max() > 0  # some updates were stale


def test_fedbuff_with_the_buffer_as_concurrency_is_fedavg_with_the_simple_average():
    a, ma = _sim(fedbuff(helpers.ENGINE_MODEL, training=TRAINING, concurrency=3), 4, 3)
    b, mb = _sim(fedavg(helpers.ENGINE_MODEL, training=TRAINING, weight_by_size=False), 4, 3)
    np.testing.assert_array_equal(ma["client_ids"], mb["client_ids"])
    np.testing.assert_array_equal(ma["server/staleness"], 0.0)
    helpers.assert_trees_close(a.params, b.params, rtol=1e-5, atol=1e-7)


def test_fedasync_with_one_client_in_flight_is_fedprox_at_server_rate_alpha():
    """One client in flight: FedAsync's client is FedProx's (proximal term centred on
    the model it started from, mu = rho) and its mixing a server step of rate alpha;
    rho = 0 is FedAvg's client."""
    for rho, other in ((0.7, lambda **kw: fedprox(helpers.ENGINE_MODEL, mu=0.7, **kw)),
                       (0.0, lambda **kw: fedavg(helpers.ENGINE_MODEL, **kw))):
        a, _ = _sim(fedasync(helpers.ENGINE_MODEL, training=TRAINING, concurrency=1,
                             alpha=0.4, rho=rho), 5, 1)
        b, _ = _sim(other(training=TRAINING, weight_by_size=False,
                          server_optimizer=optax.sgd(0.4)), 5, 1)
        helpers.assert_trees_close(a.params, b.params, rtol=1e-5, atol=1e-7)


def test_stale_updates_are_weighted_down():
    np.testing.assert_allclose(staleness_weight(jnp.arange(4), 0.5),
                               1 / np.sqrt(1 + np.arange(4)), rtol=1e-6)
    assert float(staleness_weight(jnp.asarray(3), 0.0)) == 1.0
    # a larger exponent trusts stale updates less: the run moves less far
    far = {}
    for a in (0.0, 2.0):
        state, m = _sim(fedbuff(helpers.ENGINE_MODEL, training=TRAINING, concurrency=5,
                                staleness_exponent=a, clock=CLOCK), 8, 2)
        far[a] = helpers.tree_norm(helpers.tree_sub(state.params, helpers.ENGINE_PARAMS))
    assert far[2.0] < far[0.0]


def test_vmap_over_seeds_and_grad_through_the_staleness_exponent():
    def final_loss(a, key):
        alg = fedbuff(helpers.ENGINE_MODEL, training=TRAINING, concurrency=4,
                      staleness_exponent=a, clock=CLOCK)
        state = alg.init(helpers.ENGINE_PARAMS, N)
        _, m = simulate(alg, state, helpers.ENGINE_DATA, key, num_rounds=6, cohort_size=2,
                        execution="sequential")
        return m["train_loss"][-1]

    keys = jax.vmap(jax.random.key)(jnp.arange(2))
    g = jax.jit(jax.vmap(jax.grad(final_loss), in_axes=(None, 0)))(0.5, keys)
    assert np.all(np.isfinite(g)) and np.any(g != 0)
    h = 1e-3
    fd = (final_loss(0.5 + h, keys[0]) - final_loss(0.5 - h, keys[0])) / (2 * h)
    np.testing.assert_allclose(g[0], fd, rtol=0.05, atol=1e-4)


def test_the_run_sums_the_pools_clock_and_resumes_identically(tmp_path):
    alg = fedbuff(helpers.ENGINE_MODEL, training=TRAINING, concurrency=4, clock=CLOCK)
    kw = dict(num_rounds=6, cohort_size=2, eval_every=3, execution="sequential")
    full = helpers.engine_run(alg, **kw)
    clock = [h["clock_seconds"] for h in full.history]
    assert clock[0] == 0.0 and clock[-1] > clock[1] > 0
    np.testing.assert_allclose(clock[-1], np.sum(full.rounds["server/round_seconds"],
                                                 dtype=np.float64), rtol=1e-6)
    d = str(tmp_path / "ck")
    helpers.engine_run(alg, checkpoint_dir=d, **{**kw, "num_rounds": 3})
    resumed = helpers.engine_run(alg, checkpoint_dir=d, resume=True, **kw)
    helpers.assert_trees_close(resumed.state, full.state, rtol=0, atol=0)
    assert [h["clock_seconds"] for h in resumed.history] == clock


def test_a_cohort_larger_than_the_pool_is_refused():
    with pytest.raises(ValueError, match="^concurrency: "):
        _sim(fedbuff(helpers.ENGINE_MODEL, training=TRAINING, concurrency=2), 2, 3)
    with pytest.raises(ValueError, match="^concurrency: "):
        fedbuff(helpers.ENGINE_MODEL, concurrency=0)


# ------------------------------------------------------- FedAsync's proximal local steps


def _np_fedasync_client(w0, b0, x, y, lr, rho, steps):
    """Xie et al.'s worker, literally: full-batch SGD on the mean cross-entropy plus
    (rho / 2) ||x - x_tau||^2 from x_tau = (w0, b0), in float64."""
    w, b = w0.copy(), b0.copy()
    for _ in range(steps):
        logits = x @ w + b
        logits = logits - logits.max(axis=1, keepdims=True)
        p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
        p[np.arange(len(y)), y] -= 1.0
        gw, gb = x.T @ p / len(y), p.mean(axis=0)
        w = w - lr * (gw + rho * (w - w0))
        b = b - lr * (gb + rho * (b - b0))
    return w, b


def _fedasync_one_client(rho, k, epochs, lr):
    """The state after one round of FedAsync with one client (k) in flight, alpha = 1
    and staleness 0: w <- x_k, the client's own model."""
    train, params = helpers.in_default_float(helpers.ENGINE_TRAIN, helpers.ENGINE_PARAMS)
    training = ClientTraining(lr=lr, batch_size=12, num_epochs=epochs)  # full batch
    alg = helpers.bind_execution(fedasync(helpers.ENGINE_MODEL, training=training,
                                          concurrency=1, alpha=1.0, rho=rho), "sequential")
    state, m = jax.jit(alg.apply)(alg.init(params, N), helpers.cohort(train, [k]),
                                  jax.random.key(5))
    assert int(m["server/applied"]) == 1 and float(m["server/staleness"]) == 0.0
    return state.params, params


@pytest.mark.parametrize("x64", [False, True], ids=["float32", "x64"])
def test_fedasync_client_minimises_the_regularised_objective(x64):
    """Each local step is x - gamma (grad f(x) + rho (x - x_tau)) (Algorithm 1's
    g_{x_tau}), against a float64 NumPy transcription: 1e-5 in float32, 1e-12 under
    x64 (where the inputs are the same float32 values)."""
    k, epochs, lr, rho = 1, 4, 0.5, 0.8
    x = np.asarray(helpers.ENGINE_TRAIN.examples["x"][k], np.float64)
    y = np.asarray(helpers.ENGINE_TRAIN.examples["y"][k])
    n = int(helpers.ENGINE_TRAIN.num_examples[k])
    with jax.enable_x64(x64):
        got, start = _fedasync_one_client(rho, k, epochs, lr)
        w0, b0 = helpers.logreg_to_numpy(start)
        expected = _np_fedasync_client(w0, b0, x[:n], y[:n], lr, rho, epochs)
        tol = dict(rtol=1e-12, atol=1e-13) if x64 else dict(rtol=1e-5, atol=1e-6)
        helpers.assert_logreg_close(got, expected, **tol)
        # the proximal term matters: rho = 0 is another model
        plain = _np_fedasync_client(w0, b0, x[:n], y[:n], lr, 0.0, epochs)
        assert np.abs(plain[0] - expected[0]).max() > 1e-3


def test_fedasync_rho_is_a_registered_nonnegative_hyper_parameter():
    from fedjax_fair.algorithms import REGISTRY, method_hparams
    hp = method_hparams("fedasync")["rho"]
    assert hp.default == 0.005 and hp.continuous and hp.range.low == 0.0
    assert "rho" not in method_hparams("fedbuff")
    assert REGISTRY["fedasync"].hparams["rho"] is hp.range
    with pytest.raises(ValueError, match="^rho: "):
        fedasync(helpers.ENGINE_MODEL, rho=-0.1)
    fedasync(helpers.ENGINE_MODEL, rho=jnp.float32(-1.0))  # traced values pass unchecked


# ------------------------------------------------------- staleness weight: precision


def _np_staleness(tau, a):
    return (1.0 + np.asarray(tau, np.float64)) ** (-a)


@pytest.mark.parametrize("x64", [False, True], ids=["float32", "x64"])
def test_staleness_weight_follows_the_widest_float(x64):
    taus, a = np.arange(7), 0.3
    with jax.enable_x64(x64):
        s = staleness_weight(jnp.asarray(taus, jnp.int32), a)
        assert s.dtype == (jnp.float64 if x64 else jnp.float32)
        np.testing.assert_allclose(s, _np_staleness(taus, a), rtol=1e-15 if x64 else 1e-6)


def _pool_round(dtype):
    """One buffered round by hand: two clients in flight (started at versions 1 and 3,
    finishing at 1.2 and 1.7), the server at version 4 and time 1; a cohort of two
    dispatched (finishing later). Returns (direction, info, the two in-flight updates)."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=3), dtype)}
    old = rng.normal(size=(2, 3))
    agg = buffered_aggregator(concurrency=4, staleness_exponent=0.3, mode="buffer")
    pool = agg.init(params, 6)
    pool = pool._replace(
        payload={"w": pool.payload["w"].at[:2].set(jnp.asarray(old, dtype))},
        client_ids=jnp.asarray([3, 5, -1, -1], jnp.int32),
        start_version=jnp.asarray([1, 3, 0, 0], jnp.int32),
        finish=jnp.asarray([1.2, 1.7, 0.0, 0.0], jnp.float32),
        busy=jnp.asarray([True, True, False, False]),
        version=jnp.asarray(4, jnp.int32), now=jnp.asarray(1.0, jnp.float32))
    assert isinstance(pool, Pool)
    outputs = ClientOutput(delta={"w": jnp.asarray(rng.normal(size=(2, 3)), dtype)},
                           loss_before=jnp.zeros(2), num_examples=jnp.ones(2, jnp.int32),
                           num_steps=jnp.asarray([3, 4], jnp.int32))
    ctx = ServerContext(params=params, round=jnp.zeros((), jnp.int32), key=jax.random.key(0),
                        client_ids=jnp.asarray([0, 2], jnp.int32),
                        client_mask=jnp.ones(2, bool))
    direction, _, info = agg.aggregate(pool, outputs, jnp.full(2, 0.5), ctx)
    return direction, info, old


@pytest.mark.parametrize("x64", [False, True], ids=["float32", "x64"])
def test_fedbuff_direction_weights_stale_updates_in_the_widest_float(x64):
    """(1 / n) sum_k s(tau_k) Delta_k over the two in-flight clients (tau = 3 and 1),
    against float64 NumPy: to 1e-14 under x64 (a float32 s(tau) was off by ~6e-8)."""
    with jax.enable_x64(x64):
        dtype = jnp.float64 if x64 else jnp.float32
        direction, info, old = _pool_round(dtype)
        assert direction["w"].dtype == dtype
        old = np.asarray(np.asarray(old, dtype), np.float64)
        expected = (_np_staleness(3, 0.3) * old[0] + _np_staleness(1, 0.3) * old[1]) / 2
        np.testing.assert_allclose(direction["w"], expected, rtol=1e-14 if x64 else 1e-6,
                                   atol=0 if x64 else 1e-7)
        assert int(info["applied"]) == 2 and float(info["staleness"]) == 2.0


# ------------------------------------------------------------------ bounds on concurrency


def test_concurrency_is_bounded_by_the_federation_and_the_cohort():
    assert check_concurrency(6, 6, 3) == 6 and check_concurrency(3, 6, 3) == 3
    assert check_concurrency(4, 6) == 4
    for c, n, k in ((1000000, 6, 3), (7, 6, None), (2, 6, 3)):
        with pytest.raises(ValueError, match="^concurrency: ") as e:
            check_concurrency(c, n, k)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="^concurrency: "):
        check_concurrency(2.5, 6)
    with pytest.raises(ValueError, match="^num_clients: "):
        check_concurrency(2, 0)


def test_fedasync_says_in_one_line_what_a_larger_cohort_does():
    assert fedasync_cohort_note(1) is None
    note = fedasync_cohort_note(10)
    assert "\n" not in note and "cohort size 10" in note and "cohort size 1" in note
    with pytest.raises(ValueError, match="^cohort_size: "):
        fedasync_cohort_note(0)


def test_a_pool_filled_within_the_run_steps():
    """C = N = 6 and K = 3: the pool is full after ceil(C / K) = 2 rounds, which then
    takes a server step (the largest pool ``check_concurrency`` allows)."""
    alg = fedbuff(helpers.ENGINE_MODEL, training=TRAINING, concurrency=check_concurrency(6, N, 3))
    _, m = _sim(alg, 2, 3)
    fill = math.ceil(6 / 3)
    np.testing.assert_array_equal(m["server/applied"], [0] * (fill - 1) + [3])


def test_grad_and_vmap_through_fedasync_rho():
    """rho is traced: jax.grad of the final parameters' squared norm after 3 rounds
    equals a central finite difference (x64), and jax.vmap runs a grid of rho."""
    with jax.enable_x64(True):
        params = jax.tree.map(lambda x: x.astype(jnp.float64), helpers.ALG_PARAMS)
        data = jax.tree.map(lambda x: x.astype(jnp.float64)
                            if jnp.issubdtype(x.dtype, jnp.floating) else x, helpers.ALG_DATA)

        def final_norm(rho):
            alg = fedasync(helpers.ALG_MODEL, rho=rho, concurrency=3,
                           training=ClientTraining(batch_size=4))
            state, _ = simulate(alg, alg.init(params, helpers.ALG_N), data, jax.random.key(0),
                                num_rounds=3, cohort_size=1)
            return sum(jnp.sum(x ** 2) for x in jax.tree.leaves(state.params))

        grad = float(jax.grad(final_norm)(0.5))
        fd = float((final_norm(0.5 + 1e-5) - final_norm(0.5 - 1e-5)) / 2e-5)
        assert grad == pytest.approx(fd, rel=1e-5) and grad != 0.0
        norms = jax.vmap(final_norm)(jnp.asarray([0.0, 0.5, 5.0]))
        assert np.all(np.isfinite(norms)) and len(set(np.asarray(norms).tolist())) == 3
