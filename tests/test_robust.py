"""Robust aggregators (``scenarios/robust.py``) against literal NumPy references on random
pytrees with masked slots (holding garbage that must not matter): the coordinate-wise
(weighted) median, the trimmed mean, Krum / Multi-Krum's loop-computed scores, RFA's
smoothed Weiszfeld iterations and their fixed point, norm bounding; robustness to two
huge updates among ten; vmap over ``trim`` / ``max_norm``; jit; build-time checks;
and rounds of ``simulate`` / ``fedavg`` on helpers.tiny_federation().
"""
from __future__ import annotations

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from helpers import (ALG_MODEL as MODEL, ALG_PARAMS as PARAMS, ALG_DATA as DATA, ALG_N as N,
                     ALG_LR as LR, ALG_KEY as KEY)
from fedjax_fair import hparams as H
from fedjax_fair.algorithms import fedavg
from fedjax_fair.scenarios import robust
from fedjax_fair.core.aggregators import weighted_mean
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.core.types import ClientOutput

K = 9
MASK = np.array([1, 1, 0, 1, 1, 1, 0, 1, 1], bool)  # slots 2 and 6 masked
SHAPES = {"w": (3, 4), "b": (5,)}


def make_outputs(delta, k):
    return ClientOutput(delta=delta, loss_before=jnp.ones((k,)),
                        num_examples=jnp.full((k,), 5, jnp.int32),
                        num_steps=jnp.ones((k,), jnp.int32), extra=(),
                        train_loss=jnp.ones((k,)))


def case(seed=0, garbage=1e3, mask=MASK, empty=(7,)):
    """(outputs, weights, ctx, participants): random deltas, masked slots holding
    ``garbage``-sized finite values, random weights on the simplex, 0 on masked slots
    and on the ``empty`` ones (in the cohort, no weight)."""
    rng = np.random.default_rng(seed)
    k = len(mask)
    delta = {n: rng.normal(size=(k, *s)).astype(np.float32) for n, s in SHAPES.items()}
    g = np.random.default_rng(seed + 99)
    for x in delta.values():
        x[~mask] = garbage * g.normal(size=x[~mask].shape)
    present = mask.copy()
    present[list(empty)] = False
    w = np.where(present, rng.uniform(0.2, 1.0, k), 0.0).astype(np.float32)
    w /= w.sum()
    ctx = helpers.server_context(np.arange(k), mask)
    return (make_outputs(jax.tree.map(jnp.asarray, delta), k), jnp.asarray(w), ctx,
            present)


def run(agg, outputs, weights, ctx):
    direction, _, info = agg.aggregate(agg.init(PARAMS, N), outputs, weights, ctx)
    return direction, info


def rows(outputs, present):
    """The participants' deltas flattened, [m, d] float64, and the leaf layout."""
    leaves = jax.tree.leaves(outputs.delta)
    flat = np.concatenate([np.asarray(x, np.float64).reshape(x.shape[0], -1)
                           for x in leaves], 1)
    return flat[present]


def flat(tree):
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


# ------------------------------------------------------------------ references


def np_weighted_median(x, w):
    out = []
    for col in x.T:
        order = np.argsort(col, kind="stable")
        cum = np.cumsum(w[order])
        out.append(col[order][np.argmax(cum >= 0.5 * w.sum())])
    return np.array(out)


def np_trimmed(x, trim):
    m = x.shape[0]
    b = int(np.floor(np.float32(trim) * np.float32(m)))
    out = []
    for col in x.T:
        s = sorted(col)
        out.append(np.mean(s[b:m - b]))
    return np.array(out)


def np_krum_scores(x, f):
    m = x.shape[0]
    n = max(1, min(m - f - 2, m - 1))
    scores = []
    for i in range(m):
        d = sorted(float(np.sum((x[i] - x[j]) ** 2)) for j in range(m) if j != i)
        scores.append(sum(d[:n]))
    return np.array(scores)


def np_weiszfeld(x, a, iters, eps):
    z = (a[:, None] * x).sum(0) / a.sum()
    for _ in range(iters):
        beta = a / np.maximum(eps, np.linalg.norm(x - z, axis=1))
        z = (beta[:, None] * x).sum(0) / beta.sum()
    return z


# ------------------------------------------------------------------ against references


@pytest.mark.parametrize("seed", [0, 1])
def test_coordinate_median_matches_numpy(seed):
    outputs, w, ctx, present = case(seed)
    d, _ = run(robust.coordinate_median(), outputs, w, ctx)
    np.testing.assert_allclose(flat(d), np.median(rows(outputs, present), axis=0), rtol=1e-6)
    # an odd number of participants: the middle value itself
    outputs, w, ctx, present = case(seed, empty=())
    assert present.sum() % 2 == 1
    d, _ = run(robust.coordinate_median(), outputs, w, ctx)
    np.testing.assert_array_equal(flat(d), np.median(rows(outputs, present), axis=0))


def test_weighted_median_matches_numpy():
    outputs, w, ctx, present = case(3)
    d, _ = run(robust.coordinate_median(weighted=True), outputs, w, ctx)
    np.testing.assert_array_equal(
        flat(d), np_weighted_median(rows(outputs, present), np.asarray(w, np.float64)[present]))


@pytest.mark.parametrize("trim", [0.0, 0.1, 0.2, 0.3, 0.45])
def test_trimmed_mean_matches_sorted_reference(trim):
    outputs, w, ctx, present = case(4)
    d, info = run(robust.trimmed_mean(trim), outputs, w, ctx)
    x = rows(outputs, present)
    np.testing.assert_allclose(flat(d), np_trimmed(x, trim), rtol=1e-5, atol=1e-6)
    assert int(info["trimmed"]) == math.floor(trim * len(x) + 1e-9)
    if trim == 0.0:  # nothing dropped: the participants' plain mean
        np.testing.assert_allclose(flat(d), x.mean(0), rtol=1e-5, atol=1e-6)


TRIMS = [i / 1000 for i in range(0, 500, 5)]  # 0.000, 0.005, ..., 0.495
SIZES = range(0, 201)


def _exact(trim_text: str, m: int) -> int:
    """floor(trim m) in exact rational arithmetic, from the trim's decimal text."""
    return math.floor(Fraction(trim_text) * m)


def test_trimmed_count_is_exact_over_a_grid():
    """b = floor(trim m) for every trim of 0..0.495 in steps of 0.005 and every m of
    0..200, against ``fractions.Fraction``: for a concrete trim (the table), and for
    a traced one in float32 and under x64 (jit over trim and m). floor(trim m) in
    float32 was one short on 0.265 x 200, 0.295 x 200, 0.42 x 150 and many others."""
    ms = np.arange(len(SIZES), dtype=np.int32)
    expected = np.asarray([[_exact(f"{t:.3f}", m) for m in SIZES] for t in TRIMS])
    float32_floor = np.floor(np.float32(TRIMS)[:, None] * ms[None, :].astype(np.float32))
    assert np.sum(float32_floor != expected) >= 3  # the old rule's misses: the three below
    concrete = np.asarray([robust.trimmed_count(t, jnp.asarray(ms), len(SIZES) - 1)
                           for t in TRIMS])
    np.testing.assert_array_equal(concrete, expected)
    traced = jax.jit(jax.vmap(robust.trimmed_count, in_axes=(0, None)))
    np.testing.assert_array_equal(traced(jnp.asarray(TRIMS, jnp.float32), jnp.asarray(ms)),
                                  expected)
    with jax.enable_x64(True):
        np.testing.assert_array_equal(
            traced(jnp.asarray(TRIMS, jnp.float64), jnp.asarray(ms)), expected)
    # the traced rule's stated range: every four-decimal trim below 0.5, m up to 400
    i, m4 = np.arange(5000), np.arange(401, dtype=np.int32)
    exact4 = (i[:, None] * m4[None, :]) // 10000
    np.testing.assert_array_equal(traced(jnp.asarray(i / 10000, jnp.float32), m4), exact4)
    for trim, m, b in ((0.265, 200, 53), (0.295, 200, 59), (0.42, 150, 63)):  # the issue's
        assert int(robust.trimmed_count(trim, jnp.int32(m), 200)) == b
        assert int(robust.trimmed_count(np.float32(trim), jnp.int32(m), 200)) == b
        assert int(jax.jit(robust.trimmed_count)(jnp.float32(trim), m)) == b


def test_trimmed_mean_is_exact_on_a_cohort_of_200():
    """0.295 x 200 = 59 per side: the trimmed mean of 200 values keeps ranks 59..140,
    as the float64 NumPy reference does; vmap and grad over trim still run."""
    rng = np.random.default_rng(5)
    k = 200
    x = rng.normal(size=(k, 3)).astype(np.float32)
    outputs = make_outputs({"w": jnp.asarray(x)}, k)
    w = jnp.full((k,), 1.0 / k)
    ctx = helpers.server_context(np.arange(k), np.ones(k, bool))
    d, info = run(robust.trimmed_mean(0.295), outputs, w, ctx)
    assert int(info["trimmed"]) == 59
    want = np.sort(x.astype(np.float64), axis=0)[59:141].mean(0)
    np.testing.assert_allclose(np.asarray(d["w"]), want, rtol=1e-5, atol=1e-6)
    grid = jnp.asarray([0.265, 0.295], jnp.float32)
    counts = jax.vmap(lambda t: run(robust.trimmed_mean(t), outputs, w, ctx)[1]["trimmed"])(grid)
    np.testing.assert_array_equal(counts, [53, 59])
    g = jax.grad(lambda t: jnp.sum(run(robust.trimmed_mean(t), outputs, w, ctx)[0]["w"]))(
        jnp.float32(0.295))
    assert np.isfinite(float(g))


def test_krum_refuses_more_byzantine_clients_than_the_cohort_holds():
    """f >= K (no honest client) and m > K are refused when the round is traced (a
    static check of the cohort's slots), naming the argument; f < K runs."""
    outputs, w, ctx, present = case(6)
    k = len(present)
    run(robust.krum(k - 1), outputs, w, ctx)
    with pytest.raises(H.FieldError, match="num_byzantine"):
        run(robust.krum(k), outputs, w, ctx)
    with pytest.raises(H.FieldError, match="multi"):
        run(robust.krum(1, multi=k + 1), outputs, w, ctx)
    robust.check_krum(k - 1, k, k)


@pytest.mark.parametrize("f,multi", [(0, 1), (1, 1), (2, 3), (5, 2)])
def test_krum_matches_loop_scores(f, multi):
    outputs, w, ctx, present = case(5)
    d, info = run(robust.krum(num_byzantine=f, multi=multi), outputs, w, ctx)
    x = rows(outputs, present)
    scores = np_krum_scores(x, f)
    got = np.asarray(info["krum_scores"])
    assert np.all(np.isnan(got[~present]))
    np.testing.assert_allclose(got[present], scores, rtol=1e-4)
    chosen = np.argsort(scores, kind="stable")[:multi]
    expected = np.zeros(len(present), bool)
    expected[np.flatnonzero(present)[chosen]] = True
    np.testing.assert_array_equal(info["selected"], expected)
    np.testing.assert_allclose(flat(d), x[chosen].mean(0), rtol=1e-5, atol=1e-6)


def test_geometric_median_runs_rfa_iterations_to_weiszfelds_fixed_point():
    outputs, w, ctx, present = case(6)
    x, a = rows(outputs, present), np.asarray(w, np.float64)[present]
    d, info = run(robust.geometric_median(iters=8), outputs, w, ctx)
    np.testing.assert_allclose(flat(d), np_weiszfeld(x, a, 8, 1e-6), rtol=1e-4, atol=1e-5)
    ww = np.asarray(info["weiszfeld_weights"])
    assert np.all(ww[~present] == 0) and abs(ww.sum() - 1) < 1e-5
    np.testing.assert_allclose(flat(d), ww[present] @ x, rtol=1e-4, atol=1e-5)
    # converged: z = sum_i (a_i / max(eps, |x_i - z|)) x_i / sum_i (a_i / max(eps, |x_i - z|))
    eps = 1e-6
    z, _ = run(robust.geometric_median(iters=200, eps=eps), outputs, w, ctx)
    z = flat(z)
    beta = a / np.maximum(eps, np.linalg.norm(x - z, axis=1))
    np.testing.assert_allclose(z, (beta[:, None] * x).sum(0) / beta.sum(), atol=1e-5)
    assert np.linalg.norm(z - x.mean(0)) > 1e-2  # not the mean: the fixed point moved it


def test_norm_bounded_clips_then_aggregates():
    outputs, w, ctx, present = case(7)
    x = rows(outputs, present)
    norms = np.linalg.norm(x, axis=1)
    bound = float(np.median(norms))
    d, info = run(robust.norm_bounded(bound), outputs, w, ctx)
    scale = np.minimum(1.0, bound / norms)
    wp = np.asarray(w, np.float64)[present]
    np.testing.assert_allclose(flat(d), (wp * scale) @ x, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(info["clip_scale"])[present], scale, rtol=1e-5)
    assert 0 < np.sum(scale < 1) < len(scale)
    # a bound above every norm is the inner aggregator itself
    helpers.assert_trees_close(run(robust.norm_bounded(1e6), outputs, w, ctx)[0],
                               run(weighted_mean(), outputs, w, ctx)[0])
    # over another inner aggregator: its info passes through
    d, info = run(robust.norm_bounded(bound, robust.krum(1)), outputs, w, ctx)
    assert set(info) == {"krum_scores", "selected", "clip_scale"}
    np.testing.assert_allclose(
        flat(d), (scale[:, None] * x)[np.asarray(info["selected"])[present]].mean(0),
        rtol=1e-5, atol=1e-6)


AGGREGATORS = {
    "median": lambda: robust.coordinate_median(),
    "weighted_median": lambda: robust.coordinate_median(weighted=True),
    "trimmed_mean": lambda: robust.trimmed_mean(0.2),
    "krum": lambda: robust.krum(1),
    "multi_krum": lambda: robust.krum(2, multi=3),
    "geometric_median": lambda: robust.geometric_median(),
    "norm_bounded": lambda: robust.norm_bounded(1.5),
}


@pytest.mark.parametrize("name", sorted(AGGREGATORS))
def test_masked_slots_do_not_matter_and_jit_agrees(name):
    agg = AGGREGATORS[name]()
    a = case(8, garbage=1.0)
    b = case(8, garbage=1e4)
    assert not np.array_equal(a[0].delta["w"], b[0].delta["w"])
    da, ia = run(agg, *a[:3])
    db, ib = jax.jit(lambda o, w, c: run(agg, o, w, c))(*b[:3])
    helpers.assert_trees_close(db, da, rtol=1e-5, atol=1e-6)
    for key in ia:
        if key != "clip_scale":  # the masked slots' own scale follows their garbage
            np.testing.assert_allclose(ib[key], ia[key], rtol=1e-5, err_msg=key)


ROBUST = {"median": lambda: robust.coordinate_median(),
          "trimmed_mean": lambda: robust.trimmed_mean(0.2),
          "krum": lambda: robust.krum(2),
          "multi_krum": lambda: robust.krum(2, multi=4),
          # 8 steps from the mean leave 3.8 of the 1e6 pull here, 12 leave 0.04
          "geometric_median": lambda: robust.geometric_median(iters=16),
          "norm_bounded": lambda: robust.norm_bounded(math.sqrt(17))}


def test_two_huge_updates_among_ten_move_only_the_mean():
    rng = np.random.default_rng(9)
    k = 10
    delta = {n: (0.5 + 0.1 * rng.normal(size=(k, *s))).astype(np.float32)
             for n, s in SHAPES.items()}
    for x in delta.values():
        x[[3, 7]] = 1e6
    outputs = make_outputs(jax.tree.map(jnp.asarray, delta), k)
    w, ctx = jnp.full((k,), 1.0 / k), helpers.full_context(k)
    honest = np.delete(rows(outputs, np.ones(k, bool)), [3, 7], axis=0).mean(0)
    err = lambda agg: np.max(np.abs(flat(run(agg, outputs, w, ctx)[0]) - honest))
    assert err(weighted_mean()) > 1e5
    assert 1.0 < err(robust.geometric_median(iters=8)) < 10.0  # not converged yet
    for name, build in ROBUST.items():
        assert err(build()) < 0.5, name


def test_vmap_over_trim_and_max_norm_equals_separate_calls():
    outputs, w, ctx, _ = case(10)
    trims = jnp.array([0.0, 0.15, 0.3, 0.49])
    batched = jax.vmap(lambda t: run(robust.trimmed_mean(t), outputs, w, ctx)[0])(trims)
    for i, t in enumerate([0.0, 0.15, 0.3, 0.49]):
        helpers.assert_trees_close(jax.tree.map(lambda x: x[i], batched),
                                   run(robust.trimmed_mean(t), outputs, w, ctx)[0])
    bounds = [0.5, 2.0, 100.0]
    batched = jax.vmap(lambda m: run(robust.norm_bounded(m), outputs, w, ctx))(
        jnp.asarray(bounds))
    for i, m in enumerate(bounds):
        helpers.assert_trees_close(jax.tree.map(lambda x: x[i], batched),
                                   run(robust.norm_bounded(m), outputs, w, ctx))
    # the trim's gradient-free count is traced too: a jitted trim serves every value
    f = jax.jit(lambda t: run(robust.trimmed_mean(t), outputs, w, ctx)[1]["trimmed"])
    assert [int(f(t)) for t in (0.0, 0.2, 0.45)] == [0, 1, 2]  # m = 6 participants


def test_build_time_checks_only_concrete_values():
    for bad in (0.5, -0.1, 1.0):
        with pytest.raises(H.FieldError, match="trim"):
            robust.trimmed_mean(bad)
    with pytest.raises(H.FieldTypeError, match="trim"):
        robust.trimmed_mean("0.1")
    with pytest.raises(H.FieldTypeError, match="trim"):
        robust.trimmed_mean(True)
    for bad in (0.0, -1.0):
        with pytest.raises(H.FieldError, match="max_norm"):
            robust.norm_bounded(bad)
    with pytest.raises(H.FieldError, match="eps"):
        robust.geometric_median(eps=0.0)
    with pytest.raises(H.FieldError, match="iters"):
        robust.geometric_median(iters=1.5)
    with pytest.raises(H.FieldError, match="num_byzantine"):
        robust.krum(-1)
    with pytest.raises(H.FieldError, match="multi"):
        robust.krum(1, multi=0)
    with pytest.raises(H.FieldTypeError, match="inner"):
        robust.norm_bounded(1.0, inner=lambda *a: a)
    robust.trimmed_mean(np.float32(0.25))  # NumPy numbers are concrete and fine
    # traced values are never checked (a trim of 0.7 under jit is the caller's business)
    outputs, w, ctx, _ = case(11)
    jax.jit(lambda t: run(robust.trimmed_mean(t), outputs, w, ctx)[0])(0.7)


def test_only_norm_bounding_over_a_streaming_inner_streams():
    assert robust.norm_bounded(1.0).stream is not None
    assert robust.norm_bounded(1.0, robust.trimmed_mean()).stream is None
    for name, build in AGGREGATORS.items():
        assert (build().stream is not None) == (name == "norm_bounded"), name


# ------------------------------------------------------------------ inside rounds

KW = dict(training=ClientTraining(lr=LR, batch_size=4, num_epochs=1))


def simulated(alg, rounds=2, cohort_size=4):
    from fedjax_fair.drivers.simulate import simulate
    alg = helpers.sequential(alg)
    return jax.jit(lambda s, key: simulate(alg, s, DATA, key, num_rounds=rounds,
                                           cohort_size=cohort_size))(alg.init(PARAMS, N), KEY)


def test_rounds_of_simulate_with_every_robust_aggregator():
    from fedjax_fair.core.algorithm import compose
    from fedjax_fair.core.client import local_training
    from fedjax_fair.core.mixing import by_num_examples
    update = local_training(MODEL, KW["training"])
    names = ["median", "multi_krum", "geometric_median"]  # the trimmed mean: below
    for name in names:
        alg = compose(update, mixing=by_num_examples(), aggregator=ROBUST[name]())
        assert not alg.streamed
        state, metrics = simulated(alg)
        assert int(state.round) == 2 and helpers.tree_all_finite(state.params), name
        assert np.all(np.isfinite(metrics["update_norm"])), name
        assert helpers.tree_norm(helpers.tree_sub(state.params, PARAMS)) > 0, name
        if name == "multi_krum":  # 4 of the 4 slots when the empty client is not drawn
            selected = np.asarray(metrics["server/selected"])
            assert selected.shape == (2, 4) and np.all(selected.sum(1) >= 3)


@pytest.mark.slow  # the round-level checks of tests/test_scenarios.py run by default
def test_fedavg_with_trimmed_mean_and_norm_bounding():
    trimmed, metrics = simulated(fedavg(MODEL, aggregator=robust.trimmed_mean(0.2), **KW),
                                 cohort_size=N)
    assert helpers.tree_all_finite(trimmed.params)
    # every client but the empty one takes part: floor(0.2 * 5) = 1 dropped at each end
    np.testing.assert_array_equal(metrics["server/trimmed"], [1, 1])
    # norm bounding streams; streamed and stacked rounds agree, and a loose bound is FedAvg
    alg = fedavg(MODEL, aggregator=robust.norm_bounded(0.05), **KW)
    assert alg.streamed
    stacked = fedavg(MODEL, aggregator=robust.norm_bounded(0.05), mixing=alg_stacked(), **KW)
    assert not stacked.streamed
    (s1, m1), (s2, m2) = simulated(alg), simulated(stacked)
    helpers.assert_trees_close(s1.params, s2.params, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m1["server/clip_scale"], m2["server/clip_scale"], rtol=1e-5)
    assert np.any(np.asarray(m1["server/clip_scale"]) < 1)


def alg_stacked():
    from fedjax_fair.core.mixing import by_num_examples
    return by_num_examples()._replace(logit=None)
