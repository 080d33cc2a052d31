"""MIFA (algorithms/mifa.py): a literal NumPy transcription of Algorithm 1 over rounds
with clients that drop out, FedAvg under full participation, dense == lazy tables, and
its use under a system's availability."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import helpers
from fedjax_fair.algorithms import fedavg
from fedjax_fair.algorithms.mifa import mifa
from fedjax_fair.scenarios import system as S
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.drivers.simulate import simulate

TRAIN = helpers.ENGINE_TRAIN
N = helpers.ENGINE_N
LR, STEPS = 0.3, 2
FULL = ClientTraining(lr=LR, batch_size=64, num_epochs=STEPS)  # full batch: STEPS GD steps
# (ids, mask) per round: partial cohorts, some clients dropped (masked)
ROUNDS = [([0, 1, 3], [True, True, True]), ([1, 4, 5], [True, False, True]),
          ([3, 0, 4], [False, True, True]), ([5, 2, 1], [True, True, False])]


def _numpy_mifa(params, rounds):
    """Algorithm 1 with G_i = w^t - w_i (0 before client i's first report)."""
    w, b = helpers.logreg_to_numpy(params)
    gw = np.zeros((N, *w.shape))
    gb = np.zeros((N, *b.shape))
    for ids, mask in rounds:
        start = helpers.logreg_from_numpy(w, b, params)
        for k, m in zip(ids, mask):
            if m:
                x, y = helpers.real_rows(TRAIN, [k])
                wk, bk = helpers.logreg_gd_numpy(start, x, y, LR, STEPS if len(y) else 0)
                gw[k], gb[k] = w - wk, b - bk
        w, b = w - gw.mean(0), b - gb.mean(0)
    return w, b


@pytest.mark.parametrize("table", ["dense", "lazy"])
def test_mifa_matches_a_numpy_transcription_of_algorithm_1(table):
    alg = helpers.bind_execution(mifa(helpers.ENGINE_MODEL, training=FULL, table=table),
                                 "sequential")
    state = alg.init(helpers.ENGINE_PARAMS, N)
    apply = jax.jit(alg.apply)
    for r, (ids, mask) in enumerate(ROUNDS):
        state, metrics = apply(state, helpers.cohort(TRAIN, ids, mask=mask), jax.random.key(r))
    w, b = _numpy_mifa(helpers.ENGINE_PARAMS, ROUNDS)
    got_w, got_b = helpers.logreg_to_numpy(state.params)
    np.testing.assert_allclose(got_w, w, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got_b, b, rtol=1e-4, atol=1e-6)
    assert int(metrics["server/stored"]) == 6  # every client has reported once
    # the round each client last reported in (ROUNDS' masks); ages at round 3
    last = {0: 2, 1: 1, 2: 3, 3: 0, 4: 2, 5: 3}
    np.testing.assert_allclose(float(metrics["server/staleness"]),
                               np.mean([3 - v for v in last.values()]), rtol=1e-6)


def test_mifa_under_full_participation_is_fedavg_with_the_simple_average():
    kw = dict(training=ClientTraining(lr=0.3, batch_size=4, num_epochs=2))
    a = helpers.bind_execution(mifa(helpers.ENGINE_MODEL, **kw), "sequential")
    b = helpers.bind_execution(fedavg(helpers.ENGINE_MODEL, weight_by_size=False, **kw),
                               "sequential")
    sa, sb = a.init(helpers.ENGINE_PARAMS, N), b.init(helpers.ENGINE_PARAMS, N)
    everyone = helpers.cohort(TRAIN, range(N))
    fa, fb = jax.jit(a.apply), jax.jit(b.apply)
    for r in range(3):
        sa, _ = fa(sa, everyone, jax.random.key(r))
        sb, _ = fb(sb, everyone, jax.random.key(r))
    helpers.assert_trees_close(sa.params, sb.params, rtol=1e-5, atol=1e-7)


def test_mifa_runs_under_availability_and_keeps_absent_clients_updates():
    """With clients 0-2 rarely available, MIFA still counts their last updates every
    round: its direction differs from FedAvg's over the same cohorts."""
    avail = S.independent([0.1, 0.1, 0.1, 0.9, 0.9, 0.9])
    system = S.system(avail)
    kw = dict(training=ClientTraining(lr=0.3, batch_size=4, num_epochs=1))
    out = {}
    for name, alg in (("mifa", mifa(helpers.ENGINE_MODEL, **kw)),
                      ("fedavg", fedavg(helpers.ENGINE_MODEL, weight_by_size=False, **kw))):
        alg = helpers.bind_execution(alg, "sequential")
        state = alg.init(helpers.ENGINE_PARAMS, N)
        out[name] = jax.jit(lambda s, a=alg: simulate(
            a, s, helpers.ENGINE_DATA, jax.random.key(0), num_rounds=12, cohort_size=3,
            execution="sequential", system=system))(state)
    (sm, mm), (sf, mf) = out["mifa"], out["fedavg"]
    np.testing.assert_array_equal(mm["client_mask"], mf["client_mask"])  # same cohorts
    assert int(mm["server/stored"][-1]) == int(np.unique(
        np.asarray(mm["client_ids"])[np.asarray(mm["client_mask"])]).size)
    assert helpers.tree_all_finite(sm.params)
    assert not np.allclose(helpers.logreg_to_numpy(sm.params)[0],
                           helpers.logreg_to_numpy(sf.params)[0])
