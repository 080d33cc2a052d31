"""FedBuff and FedAsync (algorithms/fedbuff.py): the in-flight pool against a literal
NumPy event simulation of the same clock, FedBuff with C = K (staleness 0) == FedAvg
with the simple average, FedAsync with one client in flight == FedAvg with server rate
alpha, the staleness weighting, vmap over seeds, grad through the staleness exponent,
and the runner's simulated time."""
from __future__ import annotations

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from fedjax_fair.algorithms import fedavg
from fedjax_fair.algorithms.fedbuff import fedasync, fedbuff, staleness_weight
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


def test_fedasync_with_one_client_in_flight_is_fedavg_at_server_rate_alpha():
    a, _ = _sim(fedasync(helpers.ENGINE_MODEL, training=TRAINING, concurrency=1, alpha=0.4),
                5, 1)
    b, _ = _sim(fedavg(helpers.ENGINE_MODEL, training=TRAINING, weight_by_size=False,
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
