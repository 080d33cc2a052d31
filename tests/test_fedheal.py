"""FedHEAL (Chen et al., CVPR 2024), a DQN-Fed baseline (Mohajer Hamidi, Ye, TMLR,
OpenReview KbteA50cni).

Every server step is checked against a literal float64 NumPy transcription of the
authors' code (``consistency_mask``, ``compute_distance``, ``get_params_diff_weights``,
``aggregate_nets_parameter``), over several rounds with partial participation and
masked padding rows; then the reductions, the persistence of per-client state for
clients outside the cohort, vmap == sequential, and a short run on a synthetic
federation. FedLF: tests/test_fedlf.py.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from fedjax_fair.core.client import ClientTraining
from fedheal_fedlf_common import (EPOCHS, FH, FULL_BATCH, LR, _ctx, _jit_apply, _np_leaves,
                                  check_vmap_equals_sequential_and_accuracy_rises,
                                  _out)


# ====================================================================== FedHEAL


class FedHEALReference:
    """The authors' FedHEAL server, literally, with the history averaged over each
    client's own participations (= the round index under full participation)."""

    def __init__(self, num_clients, tau, beta, fphl=True, distance="layers"):
        self.tau, self.beta, self.fphl, self.distance = tau, beta, fphl, distance
        self.history = {}  # client -> (list of arrays, count)
        self.momentum = {}  # previous_delta_weights
        self.weight = {}  # previous_weights (unnormalised)

    def mask(self, cid, delta):
        """consistency_mask: (mask per leaf, and the history updated)."""
        if not self.fphl:
            return [np.ones_like(d, bool) for d in delta]
        h, count = self.history.get(cid, ([np.zeros_like(d) for d in delta], 0))
        if count == 0:
            mask = [np.ones_like(d, bool) for d in delta]
        else:
            mask = [np.where(d >= 0, hh, 1 - hh) > self.tau for d, hh in zip(delta, h)]
        h = [(count * hh + (d >= 0)) / (count + 1) for d, hh in zip(delta, h)]
        self.history[cid] = (h, count + 1)
        return mask

    def step(self, deltas, masks, active, cohort_size):
        """get_params_diff_weights + aggregate_nets_parameter over the active clients;
        returns (direction per leaf, weights {cid: p})."""
        masked = {c: [m * d for m, d in zip(masks[c], deltas[c])] for c in active}
        if self.distance == "layers":
            dist = {c: sum(np.linalg.norm(x) for x in masked[c]) for c in active}
        else:
            dist = {c: np.sqrt(sum(np.sum(x * x) for x in masked[c])) for c in active}
        total = sum(dist.values())
        raw = {}
        for c in active:
            share = dist[c] / total if total > 0 else 0.0
            delta_w = (1 - self.beta) * self.momentum.get(c, 0.0) + self.beta * share
            raw[c] = self.weight.get(c, 1.0 / cohort_size) + delta_w
            self.weight[c], self.momentum[c] = raw[c], delta_w
        freq = {c: raw[c] / sum(raw.values()) for c in active}
        direction = []
        for i in range(len(next(iter(deltas.values())))):
            num = sum(freq[c] * masked[c][i] for c in active)
            den = sum(freq[c] * masks[c][i] for c in active)
            direction.append(np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0))
        return direction, freq


def test_consistency_mask_is_the_codes_rule():
    """First participation keeps everything; then cons > tau (strict) against the
    history of the client's own participations, updated after the mask."""
    rng = np.random.default_rng(0)
    shapes = [(3, 4), (5,)]
    for tau in (0.0, 0.3, 0.5, 1.0):
        ref = FedHEALReference(1, tau, 0.5)
        row = FH.sign_history_init([np.zeros(s, np.float32) for s in shapes])
        for t in range(5):
            delta = [rng.normal(size=s).astype(np.float32) for s in shapes]
            delta[1][0] = 0.0  # Delta = 0 counts as "increase" (>= 0)
            mask, row = FH.consistency_mask([jnp.asarray(d) for d in delta], row, tau)
            expected = ref.mask(0, [d.astype(np.float64) for d in delta])
            for m, e in zip(mask, expected):
                np.testing.assert_array_equal(np.asarray(m), e)
            h, count = ref.history[0]
            assert int(row.count) == count == t + 1
            for a, e in zip(row.positive, h):
                np.testing.assert_allclose(np.asarray(a), e, rtol=1e-6)
            if tau == 1.0 and t > 0:  # cons <= 1: nothing survives after the first round
                assert not any(bool(np.any(np.asarray(m))) for m in mask)


@pytest.mark.parametrize("distance", ["layers", "global"])
def test_fael_and_masked_aggregation_equal_the_code_over_rounds(distance):
    """The mixing rule + aggregator against the code's dict-based server, N = 6,
    cohorts of 4 with a masked padding row and an empty client; rows of clients
    outside the cohort never change."""
    rng = np.random.default_rng(1)
    n_clients, beta = 6, 0.3
    shapes = [(4, 3), (3,)]
    mixing = FH.fael_mixing(beta, distance)
    agg = FH.masked_mean_aggregator()
    ref = FedHEALReference(n_clients, 0.5, beta, distance=distance)
    state = mixing.init(n_clients)
    sizes = np.array([5, 0, 7, 3, 9, 4])
    cohorts = [([0, 2, 3, 0], [1, 1, 1, 0]), ([1, 2, 4, 5], [1, 1, 1, 1]),
               ([0, 4, 5, 4], [1, 1, 1, 0]), ([2, 3, 5, 1], [1, 1, 1, 1])]
    mix = jax.jit(mixing.update)
    aggregate = jax.jit(agg.aggregate)
    for t, (ids, mask) in enumerate(cohorts):
        deltas = [rng.normal(size=(4, *s)) for s in shapes]
        masks = [rng.random(size=(4, *s)) < 0.7 for s in shapes]
        n = sizes[ids]
        for d, m in zip(deltas, masks):  # an empty client sends 0 and keeps all
            d[n == 0] = 0.0
            m[n == 0] = True
        out = _out([jnp.asarray(d, jnp.float32) for d in deltas], np.ones(4), n,
                   extra=[jnp.asarray(m) for m in masks])
        ctx = _ctx(ids, mask, t)
        before = state
        p, state = mix(state, out, ctx)
        direction, _, info = aggregate((), out, p, ctx)

        active = [c for c, m, k in zip(ids, mask, n) if m and k > 0]
        rows = {c: i for i, c in enumerate(ids) if mask[i]}
        exp_dir, freq = ref.step({c: [d[rows[c]] for d in deltas] for c in active},
                                 {c: [m[rows[c]] for m in masks] for c in active},
                                 active, cohort_size=len(ids))
        for a, e in zip(direction, exp_dir):
            np.testing.assert_allclose(np.asarray(a), e, rtol=2e-5, atol=1e-6)
        exp_p = np.array([freq.get(c, 0.0) if m and k > 0 else 0.0
                          for c, m, k in zip(ids, mask, n)])
        np.testing.assert_allclose(np.asarray(p), exp_p, rtol=2e-5, atol=1e-7)
        kept = [np.mean(np.concatenate([m[i].ravel() for m in masks])) for i in range(4)]
        np.testing.assert_allclose(np.asarray(info["kept"]), kept, rtol=1e-6)
        for c in range(n_clients):
            if c in active:
                assert float(state.weight[c]) == pytest.approx(ref.weight[c], rel=2e-5)
                assert float(state.momentum[c]) == pytest.approx(ref.momentum[c], rel=2e-5,
                                                                 abs=1e-7)
            else:  # persistence: absent, masked or empty clients keep their values
                assert float(state.weight[c]) == float(before.weight[c])
                assert float(state.momentum[c]) == float(before.momentum[c])
                assert bool(state.seen[c]) == bool(before.seen[c])


def _local_gd_delta(params, data, k, lr=LR, steps=EPOCHS):
    w0, b0 = helpers.logreg_to_numpy(params)
    x, y = helpers.real_rows(data, [k])
    if len(y) == 0:
        return [np.zeros_like(b0), np.zeros_like(w0)]
    w, b = helpers.logreg_gd_numpy(params, x, y, lr, steps)
    return [b0 - b, w0 - w]  # leaf order of the flax params: bias, kernel


def _as_params(leaves, like):
    return jax.tree.unflatten(jax.tree.structure(like),
                              [np.asarray(x, np.float32) for x in leaves])


COHORTS = [([0, 1, 3, 0], [1, 1, 1, 0]), ([1, 2, 4, 5], [1, 1, 1, 1]),
           ([0, 1, 4, 4], [1, 1, 1, 0]), ([1, 3, 5, 0], [1, 1, 1, 1])]


def test_fedheal_rounds_equal_the_code_with_partial_participation():
    """Whole rounds (full-batch local GD, so the clients are deterministic) against
    the reference; the clients' sign histories in the table and the FAEL state
    match it for every client, sampled or not."""
    data = helpers.tiny_federation(padded_size=FULL_BATCH)
    model = helpers.logreg()
    params = helpers.init_params(model, 0)
    alg = FH.fedheal(model, tau=0.5, beta=0.5,
                     training=ClientTraining(lr=LR, batch_size=FULL_BATCH, num_epochs=EPOCHS))
    apply = _jit_apply(alg)
    state = alg.init(params, data.num_clients)
    ref = FedHEALReference(data.num_clients, 0.5, 0.5)
    theta = _np_leaves(params)
    for t, (ids, mask) in enumerate(COHORTS):
        state, metrics = apply(state, helpers.cohort(data.train, ids, mask=mask),
                               jax.random.key(t))
        parts = [c for c, m in zip(ids, mask) if m]
        current = _as_params(theta, params)
        deltas = {c: _local_gd_delta(current, data.train, c) for c in parts}
        masks = {c: ref.mask(c, deltas[c]) for c in parts}
        active = [c for c in parts if int(data.train.num_examples[c]) > 0]
        direction, _ = ref.step(deltas, masks, active, cohort_size=len(ids))
        theta = [th - d for th, d in zip(theta, direction)]
        for a, e in zip(_np_leaves(state.params), theta):
            np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5)
        assert np.all(np.isfinite(np.asarray(metrics["weights"])))

    rows = state.client_states.rows
    for c in range(data.num_clients):
        h, count = ref.history.get(c, ([np.zeros_like(x) for x in theta], 0))
        assert int(rows.count[c]) == count
        for a, e in zip(jax.tree.leaves(rows.positive), h):
            np.testing.assert_allclose(np.asarray(a[c]), e, atol=1e-6)
        fael = state.mixing_state
        assert float(fael.weight[c]) == pytest.approx(ref.weight.get(c, 0.0), rel=1e-4)
    assert int(rows.count[2]) == 1  # the empty client trained once; never weighted
    assert float(state.mixing_state.weight[2]) == 0.0


def _uniform_fedavg_numpy(theta, params, data, ids, mask):
    """theta - mean of the deltas of the participants holding data (NumPy)."""
    current = _as_params(theta, params)
    parts = [c for c, m in zip(ids, mask) if m and int(data.train.num_examples[c]) > 0]
    deltas = [_local_gd_delta(current, data.train, c) for c in parts]
    return [th - np.mean([d[i] for d in deltas], axis=0) for i, th in enumerate(theta)]


def test_fedheal_reductions():
    """beta = 0 without FPHL is uniform FedAvg (over the participants holding data)
    in every round. With FPHL a client's first participation keeps every parameter,
    so the first round with beta = 0 is uniform FedAvg too; with tau = 1 nothing is
    kept afterwards (cons <= 1), so a cohort seen before no longer moves the model."""
    data = helpers.tiny_federation(padded_size=FULL_BATCH)
    model = helpers.logreg()
    params = helpers.init_params(model, 0)
    kw = dict(training=ClientTraining(lr=LR, batch_size=FULL_BATCH, num_epochs=EPOCHS))
    fael_only = FH.fedheal(model, fphl=False, beta=0.0, **kw)
    stop = FH.fedheal(model, tau=1.0, beta=0.0, **kw)
    apply_fael, apply_stop = _jit_apply(fael_only), _jit_apply(stop)
    state = fael_only.init(params, data.num_clients)
    theta = _np_leaves(params)
    cohorts = [([0, 1, 3, 0], [1, 1, 1, 0]), ([1, 5, 2, 0], [1, 1, 1, 1]),
               ([3, 4, 5, 4], [1, 1, 1, 0])]
    for t, (ids, mask) in enumerate(cohorts):
        state, metrics = apply_fael(state, helpers.cohort(data.train, ids, mask=mask),
                                    jax.random.key(t))
        theta = _uniform_fedavg_numpy(theta, params, data, ids, mask)
        for a, e in zip(_np_leaves(state.params), theta):
            np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)
        n = np.asarray(data.train.num_examples)[ids]
        active = (np.asarray(mask) > 0) & (n > 0)
        np.testing.assert_allclose(np.asarray(metrics["weights"]), active / active.sum(),
                                   rtol=1e-6)

    ids, mask = [0, 1, 3, 4], [1, 1, 1, 1]
    cohort = helpers.cohort(data.train, ids, mask=mask)
    state, metrics = apply_stop(stop.init(params, data.num_clients), cohort, jax.random.key(0))
    expected = _uniform_fedavg_numpy(_np_leaves(params), params, data, ids, mask)
    for a, e in zip(_np_leaves(state.params), expected):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(metrics["server/kept"]), 1.0)
    for t in (1, 2):
        moved, metrics = apply_stop(state, cohort, jax.random.key(t))
        helpers.assert_trees_close(moved.params, state.params, rtol=0, atol=0)
        np.testing.assert_array_equal(np.asarray(metrics["server/kept"]), 0.0)
        state = moved


def test_fedheal_factory_checks():
    model = helpers.logreg()
    for kwargs in ({"tau": 1.5}, {"beta": -0.1}, {"distance": "l1"}, {"server_lr": 0.0},
                   {"fphl": "yes"}, {"client_table": "sparse"}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            FH.fedheal(model, **kwargs)
    # traced tau / beta pass the checks (sweeps)
    jax.jit(lambda b: FH.fael_weights(jnp.zeros(2), jnp.zeros(2), jnp.zeros(2, bool),
                                      jnp.ones(2), jnp.ones(2, bool), b, 0.5)[0])(0.3)
    jax.jit(lambda tau: FH.consistency_mask(jnp.ones(2), FH.sign_history_init(jnp.ones(2)),
                                            tau)[0])(0.4)


# ======================================================================== FedLF


# ============================================================== both, end to end


@pytest.mark.slow
def test_vmap_equals_sequential_and_a_short_run_improves_accuracy():
    check_vmap_equals_sequential_and_accuracy_rises("fedheal")
