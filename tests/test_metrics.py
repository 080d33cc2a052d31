"""Tests of fedjax_fair.metrics against hand-computed values (dqn_fed spec property 12)."""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_fair import metrics as M

A4 = np.array([50.0, 60.0, 70.0, 80.0])


def close(x, y, tol=1e-5):
    return math.isclose(float(x), float(y), rel_tol=tol, abs_tol=tol)


# ------------------------------------------------------------------ basic statistics


def test_property_12_values():
    assert close(M.mean(A4), 65.0)
    assert close(M.variance(A4), 125.0)
    assert close(M.std(A4), math.sqrt(125.0))
    assert close(M.worst_k(A4, 0.25), 50.0)
    assert close(M.best_k(A4, 0.25), 80.0)
    assert close(M.worst_k(A4, 0.5), 55.0)
    assert close(M.best_k(A4, 0.5), 75.0)
    assert close(M.parity_gap(A4, 0.25), 30.0)
    assert close(M.worst_k(A4, 1.0), 65.0)


def test_inputs_numpy_jax_and_int():
    for a in (A4, jnp.asarray(A4), [50, 60, 70, 80], np.array([50, 60, 70, 80])):
        assert close(M.mean(a), 65.0)
        assert close(M.std(a), math.sqrt(125.0))
        assert close(M.gini(a), 100.0 / 1040.0)


def test_rank_checked():
    with pytest.raises(ValueError):
        M.mean(np.ones((2, 2)))
    with pytest.raises(ValueError):
        M.weighted_mean(A4, np.ones(3))


def test_weighted_mean():
    assert close(M.weighted_mean(A4, [1, 1, 1, 1]), 65.0)
    assert close(M.weighted_mean(A4, [1, 0, 0, 3]), (50 + 240) / 4)
    # All weights zero: defined as the unweighted mean.
    assert close(M.weighted_mean(A4, [0, 0, 0, 0]), 65.0)


def test_scale():
    # std scales with the units, the inequality indices do not.
    frac = A4 / 100.0
    assert close(M.std(frac) * 100, M.std(A4))
    assert close(M.gini(frac), M.gini(A4))
    assert close(M.angle_to_uniform(frac), M.angle_to_uniform(A4))
    assert close(M.kl_to_uniform(frac), M.kl_to_uniform(A4))


# ------------------------------------------------------------------ worst / best k


def test_floor_rule():
    assert M.num_selected(15, 0.1) == 1
    assert M.num_selected(25, 0.1) == 2
    assert M.num_selected(20, 0.1) == 2
    assert M.num_selected(9, 0.1) == 1  # max(1, 0)
    assert M.num_selected(100, 0.29) == 29  # 0.29*100 = 28.999999999999996
    assert M.num_selected(4, 0.0) == 1
    assert M.num_selected(4, 1.0) == 4
    with pytest.raises(ValueError):
        M.num_selected(4, 1.5)
    a15 = np.arange(15.0)[::-1]
    a25 = np.arange(25.0)[::-1]
    assert close(M.worst_k(a15, 0.1), 0.0)
    assert close(M.best_k(a15, 0.1), 14.0)
    assert close(M.worst_k(a25, 0.1), 0.5)
    assert close(M.best_k(a25, 0.1), 23.5)


def test_weighted_worst_best():
    a = np.array([10.0, 20.0, 30.0, 40.0])
    w = np.array([1.0, 3.0, 1.0, 1.0])
    assert close(M.worst_k(a, 0.5, w), (10 + 60) / 4)
    assert close(M.best_k(a, 0.5, w), 35.0)
    assert close(M.parity_gap(a, 0.5, w), 35.0 - 17.5)
    # The group is chosen by value only; weights just average it.
    assert close(M.worst_k(a, 0.25, w), 10.0)
    # Zero weights inside the group: unweighted mean of the group.
    assert close(M.worst_k(a, 0.5, [0, 0, 1, 1]), 15.0)


def test_ties_stable():
    a = np.array([1.0, 2.0, 2.0, 3.0])
    w = np.array([1.0, 1.0, 3.0, 1.0])
    # Tied 2's: the lower index (1, weight 1) is selected first in both directions.
    assert close(M.worst_k(a, 0.5, w), 1.5)
    assert close(M.best_k(a, 0.5, w), 2.5)


def test_empty_raises():
    with pytest.raises(ValueError):
        M.worst_k(np.zeros(0), 0.1)
    with pytest.raises(ValueError):
        M.fairness_summary(A4, mask=[False] * 4)


# -------------------------------------------------------------------------- gini


def _gini_pairwise(a):
    a = np.asarray(a, np.float64)
    return np.abs(a[:, None] - a[None, :]).sum() / (2 * a.size**2 * a.mean())


def test_gini_hand():
    assert close(M.gini([1.0, 2.0, 3.0, 4.0]), 0.25)
    assert close(M.gini([4.0, 1.0, 3.0, 2.0]), 0.25)  # order-invariant
    assert close(M.gini([0.0, 0.0, 0.0, 1.0]), 0.75)  # (N-1)/N
    assert close(M.gini(A4), 100.0 / 1040.0)
    assert close(M.gini([5.0, 5.0, 5.0]), 0.0)
    assert close(M.gini([0.0, 0.0, 0.0]), 1.0)  # sum a = 0 -> 1
    assert close(M.gini([7.0]), 0.0)


def test_gini_pairwise_random():
    rng = np.random.default_rng(0)
    for n in (2, 4, 16):
        a = rng.uniform(0, 100, size=n)
        assert close(M.gini(a), _gini_pairwise(a), tol=1e-4)


# ----------------------------------------------------------------- angle and KL


def test_angle_kl_zero_when_equal():
    for a in ([0.7, 0.7, 0.7], [81.3] * 16, [0.1] * 4, [0.0, 0.0]):
        assert float(M.angle_to_uniform(a)) == 0.0
        assert float(M.kl_to_uniform(a)) == 0.0


def test_angle_kl_two_elements():
    assert close(M.angle_to_uniform([1.0, 0.0]), 45.0)
    assert close(M.angle_to_uniform([3.0, 1.0]), math.degrees(math.atan(0.5)))
    assert close(M.kl_to_uniform([1.0, 0.0]), math.log(2.0))  # 0 ln 0 = 0
    expected = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert close(M.kl_to_uniform([3.0, 1.0]), expected)


def test_angle_kl_random():
    rng = np.random.default_rng(1)
    for n in (4, 16):
        a = rng.uniform(0, 100, size=n)
        cos = a.sum() / (np.linalg.norm(a) * math.sqrt(n))
        assert close(M.angle_to_uniform(a), math.degrees(math.acos(cos)), tol=1e-4)
        p = a / a.sum()
        assert close(M.kl_to_uniform(a), np.sum(p * np.log(n * p)), tol=1e-4)


# ---------------------------------------------------------------- improved clients


def test_improved_fraction():
    before = np.array([1.0, 2.0, 3.0, 4.0])
    after = np.array([1.0, 3.0, 2.0, 5.0])  # tie, worse, better, worse
    assert close(M.improved_fraction(before, after), 0.5)
    assert close(M.improved_fraction(before, after, [True, False, True, False]), 1.0)
    assert close(M.improved_fraction(before, after, [False, True, False, True]), 0.0)
    assert close(M.improved_fraction(before, after, np.array([0, 1, 1, 0])), 0.5)
    assert float(M.improved_fraction(before, after, [False] * 4)) == 0.0
    assert close(M.improved_fraction(before, before), 1.0)  # all ties improved


# ------------------------------------------------------------------ summary and mask


def test_summary_keys_and_values():
    s = M.fairness_summary(A4)
    assert set(s) == {
        "mean", "std", "variance", "worst_5%", "best_5%", "parity_gap_5%",
        "worst_10%", "best_10%", "parity_gap_10%", "gini", "angle", "kl_to_uniform",
    }
    assert all(type(v) is float for v in s.values())
    json.dumps(s)
    assert close(s["mean"], 65.0)
    assert close(s["std"], math.sqrt(125.0))
    assert close(s["worst_10%"], 50.0)
    assert close(s["best_10%"], 80.0)
    assert close(s["parity_gap_10%"], 30.0)
    assert close(s["gini"], 100.0 / 1040.0)

    sw = M.fairness_summary(A4, weights=[1, 1, 1, 3], fractions=(0.25, 0.5))
    assert close(sw["weighted_mean"], (50 + 60 + 70 + 240) / 6)
    assert close(sw["mean"], 65.0)
    assert close(sw["best_50%"], (70 + 240) / 4)
    assert close(sw["worst_25%"], 50.0)
    assert "worst_25%" in sw and "parity_gap_50%" in sw
    # Both forms with weights: the unweighted group means of q-FFL / DQN-Fed.
    assert close(sw["best_50%_unweighted"], (70 + 80) / 2)
    assert close(sw["worst_50%_unweighted"], (50 + 60) / 2)
    assert "worst_50%_unweighted" not in s and "worst_10%_unweighted" not in s


def test_mask():
    a = np.array([50.0, 60.0, np.nan, 70.0, 80.0])
    n = np.array([10, 20, 0, 30, 40])
    keep = n > 0
    np.testing.assert_array_equal(M.apply_mask(a, keep), A4)
    am, nm = M.apply_mask(a, keep, n)
    np.testing.assert_array_equal(nm, [10, 20, 30, 40])
    s = M.fairness_summary(a, weights=n, mask=keep)
    ref = M.fairness_summary(A4, weights=[10, 20, 30, 40])
    assert s == ref
    assert close(s["weighted_mean"], (500 + 1200 + 2100 + 3200) / 100)
    assert all(not math.isnan(v) for v in s.values())


def test_metrics_table():
    for name in ("mean", "weighted_mean", "std", "variance", "worst_x%", "best_x%",
                 "parity_gap_x%", "gini", "angle", "kl_to_uniform", "improved_fraction"):
        assert isinstance(M.METRICS[name], str) and M.METRICS[name]


# --------------------------------------------------------------------------- jit


def test_jit_matches_eager():
    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.uniform(0, 1, size=4), jnp.float32)
    w = jnp.asarray(rng.integers(0, 50, size=4), jnp.float32)
    before = jnp.asarray(rng.uniform(size=4), jnp.float32)
    after = jnp.asarray(rng.uniform(size=4), jnp.float32)
    mask = jnp.asarray(rng.uniform(size=4) > 0.3)
    def all_metrics(a, w, before, after, mask):
        return (M.mean(a), M.std(a), M.variance(a), M.gini(a), M.angle_to_uniform(a),
                M.kl_to_uniform(a), M.worst_k(a, 0.1), M.best_k(a, 0.1),
                M.parity_gap(a, 0.5), M.weighted_mean(a, w), M.worst_k(a, 0.5, w),
                M.best_k(a, 0.1, w), M.parity_gap(a, 0.1, w),
                M.improved_fraction(before, after, mask))

    args = (a, w, before, after, mask)
    np.testing.assert_allclose(jax.jit(all_metrics)(*args), all_metrics(*args), rtol=1e-6)
    # Special cases keep their definitions under jit.
    z = jnp.zeros(4)
    assert float(jax.jit(M.gini)(z)) == 1.0
    assert float(jax.jit(M.angle_to_uniform)(z)) == 0.0
    assert float(jax.jit(M.kl_to_uniform)(jnp.full(5, 0.3))) == 0.0
    assert float(jax.jit(M.weighted_mean)(a, jnp.zeros(4))) == pytest.approx(float(M.mean(a)))


# ------------------------------------------------------------------ curve metrics


def test_rounds_to_reach_follows_the_spec_examples():
    from fedjax_fair.metrics import rounds_to_reach
    assert rounds_to_reach([0.1, 0.5, 0.92, 0.95]) == 2
    assert rounds_to_reach([0.1, 0.5, 0.8]) == float("inf")
    assert rounds_to_reach([0.95, 0.2]) == 0  # a_0 is the initial model
    with pytest.raises(ValueError, match="^curve"):
        rounds_to_reach([])


def test_smoothness_is_zero_for_a_line_and_scale_invariant():
    from fedjax_fair.metrics import smoothness
    assert smoothness([0.1, 0.2, 0.3, 0.4]) == pytest.approx(0.0, abs=1e-12)
    curve = np.array([0.1, 0.4, 0.35, 0.7, 0.72])
    d = np.diff(curve)
    assert smoothness(curve) == pytest.approx(d.std() / abs(d.mean()))
    assert smoothness(3.0 * curve) == pytest.approx(smoothness(curve))


def test_confidence_interval_reproduces_table_3():
    from fedjax_fair.metrics import confidence_interval
    # 38 integer R90 samples with sum 507 and sum of squares 6907, i.e. mean 13.342 and
    # population sigma 1.937: Table 3's NIID FedAvg row is 12.726 .. 13.958.
    counts = [1, 7, 4, 9, 10, 3, 1, 0, 3]  # of the values 10 .. 18
    samples = np.repeat(np.arange(10, 19), counts).astype(np.float64)
    assert samples.size == 38 and samples.sum() == 507 and (samples ** 2).sum() == 6907
    lo, hi = confidence_interval(samples)
    assert (round(lo, 3), round(hi, 3)) == (12.726, 13.958)
    with pytest.raises(ValueError, match="^samples"):
        confidence_interval([12.0, float("inf")])


def test_weight_drift_is_the_mean_absolute_gap():
    from fedjax_fair.metrics import weight_drift
    alpha = np.array([[0.5, 0.5], [0.9, 0.1]])
    p = np.array([[0.5, 0.5], [0.5, 0.5]])
    np.testing.assert_allclose(weight_drift(alpha, p), [0.0, 0.4])


def test_tail_mean_averages_the_last_k_evaluations():
    assert close(M.tail_mean([0.1, 0.2, 0.5, 0.7, 0.9], 2), 0.8)
    assert close(M.tail_mean([0.4, 0.6], 10), 0.5)  # shorter than k: all of it
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            M.tail_mean([1.0, 2.0], bad)
    with pytest.raises(ValueError):
        M.tail_mean([], 1)


def test_select_evaluation_picks_the_first_best_finite_entry():
    history = [{"round": 0, "validation_accuracy_mean": 0.1, "accuracy_mean": 0.2},
               {"round": 5, "validation_accuracy_mean": 0.7, "accuracy_mean": 0.6},
               {"round": 10, "validation_accuracy_mean": float("nan"), "accuracy_mean": 0.9},
               {"round": 15, "validation_accuracy_mean": 0.7, "accuracy_mean": 0.5}]
    best = M.select_evaluation(history)
    assert best["round"] == 5 and best["accuracy_mean"] == 0.6
    assert M.select_evaluation(history, mode="min")["round"] == 0
    assert M.select_evaluation([{"round": 0, "accuracy_mean": 0.3}]) is None
    with pytest.raises(ValueError, match="mode"):
        M.select_evaluation(history, mode="best")


def test_calibration_errors_match_a_literal_binning():
    """ECE / MCE with 15 equal-width bins against a plain NumPy loop; padded rows
    (mask False) never count; a perfectly calibrated toy set gives 0."""
    from fedjax_fair.metrics import calibration_errors
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=2.0, size=(200, 5)).astype(np.float32)
    labels = rng.integers(0, 5, size=200)
    mask = np.arange(200) < 170
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    conf, pred = p.max(1), p.argmax(1)
    ece, mce, n = 0.0, 0.0, mask.sum()
    for b in range(15):
        inside = mask & (conf > b / 15) & (conf <= (b + 1) / 15)
        if inside.any():
            gap = abs((pred[inside] == labels[inside]).mean() - conf[inside].mean())
            ece += inside.sum() / n * gap
            mce = max(mce, gap)
    got = calibration_errors(jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(mask))
    np.testing.assert_allclose([float(got[0]), float(got[1])], [ece, mce], rtol=1e-5, atol=1e-6)
    garbage = logits.copy()
    garbage[170:] = 1e4  # padded rows: anything
    again = calibration_errors(jnp.asarray(garbage), jnp.asarray(labels), jnp.asarray(mask))
    np.testing.assert_allclose([float(a) for a in again], [float(g) for g in got], rtol=1e-6)
    # two classes, confidence 0.75 and exactly 3 of 4 right: calibrated
    two = jnp.log(jnp.asarray([[3.0, 1.0]] * 4))
    ece0, mce0 = calibration_errors(two, jnp.asarray([0, 0, 0, 1]))
    assert float(ece0) < 1e-6 and float(mce0) < 1e-6
    per_client = jax.vmap(calibration_errors)(jnp.stack([logits[:100], logits[100:]]),
                                              jnp.stack([labels[:100], labels[100:]]),
                                              jnp.stack([mask[:100], mask[100:]]))
    assert per_client[0].shape == (2,)


@pytest.mark.parametrize("weighted", [False, True])
def test_summary_equals_the_jittable_metrics(weighted):
    """The host summary (NumPy) gives what the jittable metrics give, ties included
    (values on a coarse grid, so groups cut through runs of equal values)."""
    rng = np.random.default_rng(3)
    a = (rng.integers(0, 11, 257) / 10).astype(np.float32)
    w = rng.integers(0, 5, 257).astype(np.float32) if weighted else None
    s = M.fairness_summary(a, weights=w, fractions=(0.05, 0.1, 0.5))
    expected = {"mean": M.mean(a), "std": M.std(a), "variance": M.variance(a),
                "gini": M.gini(a), "angle": M.angle_to_uniform(a),
                "kl_to_uniform": M.kl_to_uniform(a)}
    if weighted:
        expected["weighted_mean"] = M.weighted_mean(a, w)
    for f, tag in ((0.05, "5%"), (0.1, "10%"), (0.5, "50%")):
        expected[f"worst_{tag}"] = M.worst_k(a, f, w)
        expected[f"best_{tag}"] = M.best_k(a, f, w)
        expected[f"parity_gap_{tag}"] = M.parity_gap(a, f, w)
        if weighted:
            expected[f"worst_{tag}_unweighted"] = M.worst_k(a, f)
            expected[f"best_{tag}_unweighted"] = M.best_k(a, f)
    assert set(s) == set(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(s[key], float(value), rtol=2e-6, atol=2e-6, err_msg=key)
    # a summary compiles nothing
    before = M._group_kernel._cache_size()
    M.fairness_summary(rng.random(123), weights=w[:123] if weighted else None)
    assert M._group_kernel._cache_size() == before
