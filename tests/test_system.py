"""Participation and system heterogeneity (scenarios/system.py): availability models, the
sampler among available clients, dropouts, the virtual clock and its deadline, and
their use in ``simulate`` and ``runner.run``."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from fedjax_fair.scenarios import sampling
from fedjax_fair.scenarios import system as S
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.drivers.simulate import plan_rounds, simulate
from fedjax_fair.cli.parsing import parse_system

KEY = jax.random.key(3)


@functools.lru_cache(maxsize=None)
def _rounds(avail, num_rounds: int, num_clients: int):
    """Availability [R, N] of rounds 0..R-1 (one program per model)."""
    fn = jax.jit(jax.vmap(lambda r: avail(KEY, r, num_clients)))
    return np.asarray(fn(jnp.arange(num_rounds)))


# ------------------------------------------------------------------ availability models


def test_independent_frequencies_match_the_probabilities():
    p = np.linspace(0.05, 0.95, 40)
    a = _rounds(S.independent(p), 2000, 40)
    # 2000 rounds: a frequency's standard deviation is at most 0.011
    np.testing.assert_allclose(a.mean(axis=0), p, atol=0.045)
    assert abs(a.mean() - p.mean()) < 0.01
    one = _rounds(S.independent(0.3), 500, 400)
    assert abs(one.mean() - 0.3) < 0.01
    # different rounds, different draws; rounds are independent (lag-1 correlation ~ 0)
    x = one - one.mean()
    assert abs((x[1:] * x[:-1]).mean() / x.var()) < 0.03


def test_periodic_windows_and_phases():
    offsets = np.arange(6) * 4
    a = _rounds(S.periodic(24, 0.25, offsets), 72, 6)
    r = np.arange(72)[:, None]
    np.testing.assert_array_equal(a, (r + offsets[None, :]) % 24 < 6)
    # drawn phases: every client on exactly 6 of every 24 rounds, with the period 24
    d = _rounds(S.periodic(24, 0.25), 96, 50)
    np.testing.assert_array_equal(d.reshape(4, 24, 50).sum(axis=1), 6)
    np.testing.assert_array_equal(d[:24], d[24:48])
    assert len({tuple(col) for col in d[:24].T}) > 5  # phases differ between clients


@pytest.mark.parametrize("p_off, p_on", [(0.1, 0.3), pytest.param(0.02, 0.05,
                                                                 marks=pytest.mark.slow)])
def test_markov_chain_stationary_share_and_transitions(p_off, p_on):
    rounds, n = 1500, 300
    a = _rounds(S.markov(p_off, p_on), rounds, n)
    share = p_on / (p_off + p_on)
    assert abs(a.mean() - share) < 0.02
    assert abs(a[0].mean() - share) < 0.1  # starts stationary
    prev, nxt = a[:-1], a[1:]
    off_rate = (prev & ~nxt).sum() / prev.sum()
    on_rate = (~prev & nxt).sum() / (~prev).sum()
    np.testing.assert_allclose([off_rate, on_rate], [p_off, p_on], rtol=0.08)


def test_markov_chain_is_a_pure_function_of_the_round():
    m = S.markov(0.05, 0.05)
    a = _rounds(m, 300, 20)
    fn = jax.jit(lambda r: m(KEY, r, 20))
    for r in (0, 17, 150, 299):  # one round alone, as a resumed run computes it
        np.testing.assert_array_equal(np.asarray(fn(r)), a[r])


def test_trace_replays_cyclically():
    table = np.random.default_rng(0).random((5, 7)) < 0.5
    a = _rounds(S.trace(table), 12, 7)
    np.testing.assert_array_equal(a, table[np.arange(12) % 5])


def test_from_property_and_label_share():
    np.testing.assert_allclose(S.from_property([0, 5, 10], 0.1, 0.9), [0.1, 0.5, 0.9])
    np.testing.assert_allclose(S.from_property([2, 1], 0.5, 0.0), [0.0, 0.5])
    np.testing.assert_allclose(S.from_property([3, 3], 0.2, 0.4), [0.3, 0.3])
    train = helpers.tiny_federation().train
    share = S.label_share(train, [0])
    for k in range(6):
        y = np.asarray(train.examples["y"][k, :int(train.num_examples[k])])
        assert share[k] == (np.mean(y == 0) if y.size else 0.0)
    c = S.device_classes(1000, [0.7, 0.3], [1.0, 10.0], seed=1)
    assert set(np.unique(c)) == {1.0, 10.0} and abs((c == 10.0).mean() - 0.3) < 0.05
    s = S.lognormal(2000, 5.0, 1.0, seed=0)
    assert abs(np.median(s) / 5.0 - 1) < 0.1 and abs(np.log(s).std() - 1.0) < 0.05


def test_texts_build_the_documented_models():
    train = helpers.tiny_federation().train
    sizes = np.asarray(train.num_examples, float)
    build = lambda **kw: parse_system(**kw).build(train)
    assert build() is None  # nothing changes: no system at all
    np.testing.assert_allclose(build(availability="size:0.1:0.9").availability.p,
                               S.from_property(sizes, 0.1, 0.9))
    np.testing.assert_allclose(build(availability="labels:0+2:0.9:0.1").availability.p,
                               S.from_property(S.label_share(train, [0, 2]), 0.9, 0.1))
    c = parse_system(availability="classes:0.5@0.9+0.5@0.2", seed=3).build(train)
    assert set(c.availability.p) <= {0.9, 0.2}
    assert build(availability="markov:0.1:0.3").availability == S.markov(0.1, 0.3)
    assert build(availability="periodic:24:0.25").availability == S.periodic(24, 0.25)
    s = build(speeds="lognormal:20:1", dropout="speed:0.5:0.0", deadline="3:partial",
              bandwidth="1e5", latency=0.2)
    np.testing.assert_allclose(s.clock.speed, S.lognormal(6, 20.0, 1.0, seed=0))
    np.testing.assert_allclose(s.dropout, S.from_property(s.clock.speed, 0.5, 0.0))
    assert (s.clock.deadline, s.clock.late, s.clock.bandwidth, s.clock.latency) == \
        (3.0, "partial", (1e5,), (0.2,))


# --------------------------------------------------------- sampling, dropouts, the clock


def _plan(system, num_rounds, sizes, cohort_size, sampler=sampling.uniform, **kw):
    return plan_rounds(system, KEY, 0, num_rounds, np.asarray(sizes, np.int32),
                       cohort_size=cohort_size, sampler=sampler, **kw)


@pytest.mark.parametrize("sampler", ["uniform", "size", "full"])
def test_cohorts_are_drawn_among_the_available_clients(sampler):
    n = 12
    sizes = np.arange(1, n + 1) * 3
    smp = sampling.get(sampler, sizes)
    k = n if sampler == "full" else 4
    avail = S.independent(0.35)
    ids, mask, _, metrics = _plan(S.system(avail), 600, sizes, k, smp)
    for r in range(600):
        assert len(set(ids[r])) == k  # distinct
        assert mask[r].sum() == min(k, metrics["system/available"][r])
    # the masked-in clients are available ones: the plan's own availability
    skey = jax.random.fold_in(jax.random.fold_in(KEY, S.SYSTEM_KEY_ID), 0)
    av = np.asarray(jax.vmap(lambda r: avail(skey, r, n))(jnp.arange(600)))
    rows = np.arange(600)[:, None]
    assert av[rows, ids][mask].all()
    np.testing.assert_array_equal(av.sum(axis=1), metrics["system/available"])
    if sampler == "full":
        np.testing.assert_array_equal(ids, np.broadcast_to(np.arange(n), ids.shape))
        np.testing.assert_array_equal(mask, av)
        return
    # K = 1: client k is drawn with probability w_k / (sum of w over the available),
    # w = 1 (uniform) or its size
    ids1, mask1, _, _ = _plan(S.system(avail), 4000, sizes, 1, smp)
    av = np.asarray(jax.vmap(lambda r: avail(skey, r, n))(jnp.arange(4000)))
    w = np.ones(n) if sampler == "uniform" else sizes.astype(float)
    share = av * w / np.maximum((av * w).sum(axis=1, keepdims=True), 1e-12)
    counts = np.bincount(ids1[mask1[:, 0], 0], minlength=n)
    np.testing.assert_allclose(counts / 4000, share.mean(axis=0), atol=0.012)


def test_dropout_rates_and_reported_mask():
    n = 10
    p = np.linspace(0.0, 0.9, n)
    ids, mask, _, metrics = _plan(S.system(dropout=p), 3000, [5] * n, n, sampling.full)
    np.testing.assert_allclose(1 - mask.mean(axis=0), p, atol=0.03)
    np.testing.assert_array_equal(mask.sum(axis=1), metrics["system/reported"])
    np.testing.assert_array_equal(metrics["system/available"], n)


def _numpy_clock(c: S.Clock, sizes, ids, avail_mask, budgets, nbytes):
    """A literal NumPy transcription of the clock for one round."""
    t_train = c.training
    out_t, out_steps, reported, late = [], [], [], []
    for k, m in zip(ids, avail_mask):
        speed = c.speed[k] if len(c.speed) > 1 else c.speed[0]
        lat = c.latency[k] if len(c.latency) > 1 else c.latency[0]
        bw = None if c.bandwidth is None else (c.bandwidth[k] if len(c.bandwidth) > 1
                                               else c.bandwidth[0])
        comm = lat + (0.0 if bw is None else 2 * nbytes / bw)
        work = t_train.num_epochs * -(-int(sizes[k]) // t_train.batch_size)
        work = min(work, int(budgets[k]))
        t, steps, is_late = comm + work / speed, work, False
        if c.deadline is not None:
            if c.late == "drop":
                is_late = t > c.deadline
            else:
                done = max(0, int(np.floor((c.deadline - comm) * speed)))
                if done < work:
                    steps, t = done, comm + done / speed
                is_late = (done <= 0 and work > 0) or comm > c.deadline
        out_t.append(t if m else 0.0)
        out_steps.append(steps)
        reported.append(bool(m) and not is_late)
        late.append(bool(m) and is_late)
    reported = np.asarray(reported)
    if c.deadline is not None and np.any(np.asarray(avail_mask) & ~reported):
        duration = c.deadline
    else:
        duration = max([t for t, r in zip(out_t, reported) if r], default=0.0)
    return np.asarray(out_t), np.asarray(out_steps), reported, np.sum(late), duration


@pytest.mark.parametrize("late", ["drop", "partial", None])
def test_clock_and_deadline_against_a_numpy_transcription(late):
    n = 8
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 40, n)
    speed = rng.uniform(2.0, 20.0, n)
    bandwidth = rng.uniform(1e4, 1e5, n)
    training = ClientTraining(batch_size=4, num_epochs=2)
    c = S.clock(speed, bandwidth=bandwidth, latency=0.1, late=late or "drop",
                deadline=None if late is None else 0.5, training=training)
    budgets = rng.integers(1, 30, n).astype(np.int32)
    nbytes = 4000
    ids, mask, steps, metrics = _plan(S.system(S.independent(0.8), clock=c), 40, sizes, 5,
                                      step_budgets=budgets, model_bytes=nbytes)
    skey = jax.random.fold_in(jax.random.fold_in(KEY, S.SYSTEM_KEY_ID), 0)
    av = np.asarray(jax.vmap(lambda r: S.independent(0.8)(skey, r, n))(jnp.arange(40)))
    for r in range(40):
        avail_mask = av[r, ids[r]]
        t, s, rep, n_late, duration = _numpy_clock(c, sizes, ids[r], avail_mask, budgets,
                                                   nbytes)
        np.testing.assert_allclose(metrics["system/client_seconds"][r], t, rtol=1e-5)
        np.testing.assert_array_equal(mask[r], rep)
        np.testing.assert_allclose(metrics["system/round_seconds"][r], duration, rtol=1e-5)
        full = 2 * -(-sizes[ids[r]] // 4)  # the budget is a cap: the steps taken
        np.testing.assert_array_equal(np.minimum(steps[r], full)[rep], s[rep])
        if late is not None:
            assert metrics["system/late"][r] == n_late
    if late == "drop":  # the deadline bites
        assert metrics["system/late"].sum() > 0 and not mask[av[np.arange(40)[:, None], ids]].all()
    if late == "partial":  # some clients send the steps they finished in time
        assert (steps < np.minimum(budgets[ids], 2 * -(-sizes[ids] // 4)))[mask].any()
    if late is not None:
        assert (metrics["system/round_seconds"] <= 0.5 + 1e-6).all()


# ---------------------------------------------------------------- in rounds and runs


def _alg():
    return helpers.seq_fedavg()


def _sim(system, num_rounds=4, key=KEY, **kw):
    alg = _alg()
    state = alg.init(helpers.ENGINE_PARAMS, helpers.ENGINE_N)
    return simulate(alg, state, helpers.ENGINE_DATA, key, num_rounds=num_rounds,
                    cohort_size=4, execution="sequential", system=system, **kw)


def test_a_system_that_changes_nothing_is_the_plain_run():
    plain = jax.jit(lambda: _sim(None))()
    same = jax.jit(lambda: _sim(S.system()))()
    helpers.assert_trees_close(same[0], plain[0], rtol=0, atol=0)
    np.testing.assert_array_equal(same[1]["client_ids"], plain[1]["client_ids"])
    np.testing.assert_array_equal(same[1]["system/reported"], 4)


def test_clients_that_did_not_report_change_nothing():
    """Dropped and unavailable clients have zero weight and their data is never read:
    garbage in their rows leaves the round as it was."""
    system = S.system(S.independent(0.6), dropout=0.3)
    _, metrics = jax.jit(lambda: _sim(system, num_rounds=6))()
    mask = np.asarray(metrics["client_mask"])
    assert (~mask).any() and mask.any()
    np.testing.assert_array_equal(np.asarray(metrics["weights"])[~mask], 0.0)
    np.testing.assert_array_equal(mask.sum(axis=1), metrics["system/reported"])


def test_vmap_over_seeds_and_grad_through_the_client_rate():
    system = S.system(S.markov(0.2, 0.3), dropout=0.1,
                      clock=S.clock(5.0, deadline=1.5, late="partial",
                                    training=ClientTraining(batch_size=4, num_epochs=2)))
    keys = jax.vmap(jax.random.key)(jnp.arange(3))
    states, metrics = jax.jit(jax.vmap(lambda k: _sim(system, 3, k)))(keys)
    assert metrics["system/round_seconds"].shape == (3, 3)
    assert not np.array_equal(metrics["client_mask"][0], metrics["client_mask"][1])
    from fedjax_fair.algorithms import fedavg

    def final_loss(lr):
        alg = fedavg(helpers.ENGINE_MODEL, training=ClientTraining(lr=lr, batch_size=4,
                                                                   num_epochs=2))
        state = alg.init(helpers.ENGINE_PARAMS, helpers.ENGINE_N)
        _, m = simulate(alg, state, helpers.ENGINE_DATA, KEY, num_rounds=3, cohort_size=4,
                        execution="sequential", system=system)
        return m["train_loss"][-1]

    g = jax.jit(jax.grad(final_loss))(0.3)
    assert np.isfinite(g) and g != 0


def _run(system, **kw):
    args = dict(num_rounds=4, cohort_size=4, eval_every=2, progress=False, system=system,
                execution="sequential")
    args.update(kw)
    return helpers.engine_run(_alg(), **args)


SYSTEM = S.system(S.independent(0.7), dropout=0.2,
                  clock=S.clock(S.lognormal(6, 4.0, 0.5), bandwidth=2e4, latency=0.05,
                                deadline=2.0, training=ClientTraining(batch_size=4,
                                                                      num_epochs=2)))


def test_run_logs_the_clock_and_resumes_identically(tmp_path):
    full = _run(SYSTEM)
    assert full.history[0]["clock_seconds"] == 0.0
    sim = np.cumsum(full.rounds["system/round_seconds"], dtype=np.float64)
    np.testing.assert_allclose([h["clock_seconds"] for h in full.history[1:]],
                               sim[[1, 3]], rtol=1e-6)
    d = str(tmp_path / "ckpt")
    _run(SYSTEM, num_rounds=2, checkpoint_dir=d)
    resumed = _run(SYSTEM, checkpoint_dir=d, resume=True)
    helpers.assert_trees_close(resumed.state, full.state, rtol=0, atol=0)
    assert [h["clock_seconds"] for h in resumed.history[1:]] == \
        [h["clock_seconds"] for h in full.history[1:]]
    for name in ("client_ids", "client_mask", "system/round_seconds"):
        np.testing.assert_array_equal(resumed.rounds[name], full.rounds[name])


def test_run_seeds_plans_each_seed_as_runner_run_does():
    from fedjax_fair.drivers.runner import run
    from fedjax_fair.drivers.sweeps import run_seeds
    model = helpers.ENGINE_MODEL
    runs = run_seeds(_alg(), model, helpers.ENGINE_DATA, [5, 6], num_rounds=4, cohort_size=4,
                     eval_every=2, execution="sequential", system=SYSTEM)
    for seed, got in zip([5, 6], runs.results):
        key = jax.random.key(seed)
        ref = run(_alg(), model.init(key), helpers.ENGINE_DATA, key, model=model,
                  num_rounds=4, cohort_size=4, eval_every=2, progress=False,
                  execution="sequential", system=SYSTEM)
        for name in ("client_ids", "client_mask", "system/round_seconds"):
            np.testing.assert_array_equal(got.rounds[name], ref.rounds[name])
        np.testing.assert_allclose([h["clock_seconds"] for h in got.history],
                                   [h["clock_seconds"] for h in ref.history], rtol=1e-6)
    assert not np.array_equal(runs.results[0].rounds["client_mask"],
                              runs.results[1].rounds["client_mask"])


@pytest.mark.parametrize("layout", ["compact", "padded"])
def test_host_placement_plans_the_same_rounds(layout):
    device = _run(SYSTEM, placement="device")
    host = _run(SYSTEM, placement="host", stream_layout=layout)
    for name in ("client_ids", "client_mask", "num_steps", "system/round_seconds"):
        np.testing.assert_array_equal(host.rounds[name], device.rounds[name])
    helpers.assert_trees_close(host.state.params, device.state.params, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("make, field", [
    (lambda: S.independent(1.2), "availability"),
    (lambda: S.independent([0.5, -0.1]), "availability"),
    (lambda: S.markov(0.7, 0.6), "availability.p_on"),
    (lambda: S.markov(0.0, 0.0), "availability.p_on"),
    (lambda: S.periodic(0, 0.5), "availability.period"),
    (lambda: S.periodic(10, 1.5), "availability.on_fraction"),
    (lambda: S.trace(np.ones(5)), "availability"),
    (lambda: S.trace(np.full((2, 3), 2)), "availability"),
    (lambda: S.system(dropout=[0.1, 1.1]), "dropout"),
    (lambda: S.clock(0.0), "clock.speed"),
    (lambda: S.clock(1.0, deadline=-1.0), "clock.deadline"),
    (lambda: S.clock(1.0, late="wait"), "clock.late"),
    (lambda: S.system(availability="always"), "availability"),
    # settings under which no client would ever train (issue 47)
    (lambda: S.independent(0.0), "availability"),
    (lambda: S.independent([0.0] * 4), "availability"),
    (lambda: S.markov([0.5, 0.5], [0.0, 0.0]), "availability"),
    (lambda: S.periodic(24, 0.0), "availability"),
    (lambda: S.trace(np.zeros((4, 6), bool)), "availability"),
    (lambda: S.system(dropout=1.0), "dropout"),
    (lambda: S.system(dropout=[1.0] * 5), "dropout"),
    # class shares are a distribution, never renormalised behind the caller's back
    (lambda: S.device_classes(6, [0.6, 0.5], [1.0, 2.0]), "shares"),
    (lambda: S.device_classes(6, [0.3, 0.3], [1.0, 2.0]), "shares"),
])
def test_bad_settings_name_the_field(make, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        make()


@pytest.mark.parametrize("system, field", [
    (S.system(S.independent([0.5] * 5)), "availability"),
    (S.system(S.trace(np.ones((3, 5), bool))), "availability"),
    (S.system(dropout=[0.1] * 7), "dropout"),
    (S.system(clock=S.clock([1.0] * 4)), "clock.speed"),
    (S.system(clock=S.clock(1.0, deadline=0.5, training=ClientTraining(batch_size=4))),
     "clock.deadline"),
    (S.system(clock=S.clock(100.0, bandwidth=10.0, deadline=5.0)), "clock.deadline"),
])
def test_a_system_that_does_not_fit_the_federation_is_refused_before_compute(system, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        _run(system)


def test_availability_with_a_custom_sampler_is_refused():
    def mine(key, n, k):
        return jnp.arange(k, dtype=jnp.int32)

    with pytest.raises(ValueError, match="^sampler: "):
        _run(S.system(S.independent(0.5)), sampler=mine)


# ------------------------------------------ every method: clients that did not report


def _registry_names():
    from fedjax_fair.algorithms import REGISTRY
    return sorted(REGISTRY)


# a default-suite selection: the per-client tables (dense rows, drifts, personal
# models), the fair rules that read every client's loss or update, the server solvers
DROPOUT_DEFAULT = ("aaggff_d", "afedpd", "ditto", "dqn_fed", "fedavg", "qffl", "scaffold")


@pytest.mark.parametrize("name", [n if n in DROPOUT_DEFAULT else
                                  pytest.param(n, marks=pytest.mark.slow)
                                  for n in _registry_names()])
def test_every_method_treats_a_masked_client_as_not_selected(name):
    """A cohort slot masked (unavailable, dropped or late) is as if its client had not
    been selected: the round with clients (0, 1, 3, 4), 1 and 4 masked, equals the round
    with clients (0, 2, 3, 5), 2 and 5 masked, in the whole server state (parameters,
    optimizer, mixing and aggregator states, every client's row). A method that needs
    every client (AAggFF-S) gets the whole federation, 1 and 4 masked, against the
    same with other clients' rows in the masked slots. Masked clients still train on
    their own (real, finite) rows; aggregation gives them weight 0
    (``aggregators.weighted_sum``)."""
    from fedjax_fair.algorithms import registry
    from fedjax_fair.core.execution import Execution
    from fedjax_fair.models import get_model
    model, params = helpers.ENGINE_MODEL, helpers.ENGINE_PARAMS
    if name == "lg_fedavg":  # keeps its last layer local: needs two
        model = get_model("mlp", (helpers.NUM_FEATURES,), helpers.NUM_CLASSES, hidden=(4,))
        params = model.init(jax.random.key(0))
    alg = helpers.bind_execution(registry.build(name, model), Execution("sequential"))
    state = alg.init(params, helpers.ENGINE_N)
    train = helpers.ENGINE_TRAIN
    if registry.get_method(name).participation == "full":
        mask = [True, False, True, False, True, True]
        a_cohort = helpers.cohort(train, range(6), mask=mask)
        other = helpers.cohort(train, [0, 5, 2, 0, 4, 5])
        b_cohort = a_cohort._replace(data=other.data)
    else:
        mask = [True, False, True, False]
        a_cohort = helpers.cohort(train, [0, 1, 3, 4], mask=mask)
        b_cohort = helpers.cohort(train, [0, 2, 3, 5], mask=mask)
    apply = jax.jit(alg.apply)
    a, ma = apply(state, a_cohort, KEY)
    b, mb = apply(state, b_cohort, KEY)
    assert helpers.tree_all_finite(a.params)
    helpers.assert_trees_close(b, a, rtol=0, atol=0)
    off = ~np.asarray(mask)
    for m in (ma, mb):
        np.testing.assert_array_equal(np.asarray(m["weights"])[off], 0.0)


def test_docs_participation_page_runs():
    """docs/participation.md's Python blocks, in order, in one namespace."""
    import pathlib
    import re
    page = pathlib.Path(__file__).resolve().parents[1] / "docs" / "participation.md"
    blocks = re.findall(r"^```python\n(.*?)^```", page.read_text("utf-8"), flags=re.M | re.S)
    assert blocks
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/participation.md[python {i}]", "exec"), namespace)
    result = namespace["result"]
    clock = [h["clock_seconds"] for h in result.history]
    assert clock[0] == 0.0 and clock[-1] > clock[1] > 0
    reported = result.rounds["system/reported"]
    assert reported.shape == (20,) and (reported <= 10).all() and reported.min() < 10


@pytest.mark.parametrize("name", ["afl", "aaggff_d"])
def test_participation_aware_rules_use_the_realised_cohort(name):
    """AFL's lambda step scales by N / m and AAggFF-D's doubly robust estimator divides
    by the propensity m / N, with m the clients that reported: a cohort of four with two
    masked is the cohort of the other two."""
    from fedjax_fair.algorithms import registry
    alg = helpers.bind_execution(registry.build(name, helpers.ENGINE_MODEL), "sequential")
    state = alg.init(helpers.ENGINE_PARAMS, helpers.ENGINE_N)
    masked = helpers.cohort(helpers.ENGINE_TRAIN, [0, 1, 3, 4], mask=[True, False, True, False])
    alone = helpers.cohort(helpers.ENGINE_TRAIN, [0, 3])
    a, _ = jax.jit(alg.apply)(state, masked, KEY)
    b, _ = jax.jit(alg.apply)(state, alone, KEY)
    helpers.assert_trees_close(a.mixing_state, b.mixing_state, rtol=1e-6, atol=1e-7)
    helpers.assert_trees_close(a.params, b.params, rtol=1e-5, atol=1e-7)
