"""SuPerFed (fedjax_fair/algorithms/superfed.py): its properties (Hahn et al.,
KDD 2022, arXiv:2109.07628) on the tiny logistic-regression federation of tests/helpers.py
and a two-layer MLP (for layer mixing)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.algorithms.fedprox import fedprox
from fedjax_fair.algorithms.superfed import (cos_squared, draw_lambdas, lambda_grid_metrics,
                                             layer_groups, mix, personalised_summary,
                                             superfed)
from fedjax_fair.core.evaluation import make_evaluator
from fedjax_fair.models import mlp
from fedjax_fair.core.client import ClientTraining

MODEL = helpers.logreg()
PARAMS = helpers.init_params(MODEL)
DATA = helpers.tiny_federation()
N = DATA.num_clients
B = 4
IDS = [0, 3, 4]


TRAINING = ClientTraining(lr=0.1, batch_size=B, num_epochs=2)  # weight decay 0


def _sf(**kw):
    args = dict(training=TRAINING, momentum=0.0)
    args.update(kw)
    return superfed(MODEL, **args)


_APPLY: dict = {}


def _round(alg, state, ids=IDS, key=jax.random.key(1), execution="auto"):
    """One round of ``alg`` on clients ``ids``; one compiled program per algorithm and
    strategy (the cohort and key are arguments)."""
    if (alg, execution) not in _APPLY:
        _APPLY[alg, execution] = jax.jit(lambda s, c, k: alg.apply(s, c, k, execution))
    return _APPLY[alg, execution](state, helpers.cohort(DATA.train, ids), key)


def _rows(alg, state, ids=range(N)):
    return alg.client_rows(state, jnp.asarray(list(ids), jnp.int32)).local


def _assert_trees(a, b, **kw):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)


def _equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# --------------------------------------------------------------- 1. reductions


def test_before_start_round_a_round_is_fedavg_or_fedprox_and_local_models_stay():
    state = _sf(mu=0.0, nu=0.0, start_round=10).init(PARAMS, N)
    alg = _sf(mu=0.0, nu=0.0, start_round=10)
    new, _ = _round(alg, state)
    plain, _ = _round(fedavg(MODEL, training=TRAINING),
                      fedavg(MODEL).init(PARAMS, N))
    _assert_trees(new.params, plain.params, rtol=1e-6, atol=1e-7)
    assert _equal(_rows(alg, new), _rows(alg, state))  # theta_l bit-identical
    prox = _sf(mu=0.3, nu=0.0, start_round=10)
    new, _ = _round(prox, prox.init(PARAMS, N))
    ref, _ = _round(fedprox(MODEL, mu=0.3, training=TRAINING),
                    fedprox(MODEL, mu=0.3).init(PARAMS, N))
    _assert_trees(new.params, ref.params, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------- 2-4. pieces


def test_mixing_endpoints_and_affine_in_lambda():
    f, l = helpers.random_like(PARAMS, 1), helpers.random_like(PARAMS, 2)
    assert _equal(mix(f, l, 0.0), f) and _equal(mix(f, l, 1.0), l)
    for lam in (0.25, 0.7):
        expected = jax.tree.map(lambda a, b: a + lam * (b - a), f, l)
        _assert_trees(mix(f, l, lam), expected, rtol=1e-6, atol=1e-7)


def test_gradient_through_the_mixture_is_the_chain_rule_and_matches_finite_differences():
    batch = {"x": DATA.train.examples["x"][0, :4], "y": DATA.train.examples["y"][0, :4]}
    f, l = helpers.random_like(PARAMS, 1), helpers.random_like(PARAMS, 2)
    lam = 0.3

    def loss(pair):
        return jnp.mean(MODEL.per_example_loss(mix(*pair, lam), batch, None))

    g_f, g_l = jax.grad(loss)((f, l))
    g = jax.grad(lambda p: jnp.mean(MODEL.per_example_loss(p, batch, None)))(mix(f, l, lam))
    _assert_trees(g_f, jax.tree.map(lambda x: (1 - lam) * x, g), rtol=1e-5, atol=1e-7)
    _assert_trees(g_l, jax.tree.map(lambda x: lam * x, g), rtol=1e-5, atol=1e-7)
    # central differences along a random direction, in float64
    with jax.enable_x64(True):
        f64, l64 = (jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), t) for t in (f, l))
        b64 = {"x": jnp.asarray(batch["x"], jnp.float64), "y": batch["y"]}
        loss64 = lambda pair: jnp.mean(MODEL.per_example_loss(mix(*pair, lam), b64, None))
        d = jax.tree.map(lambda x: jnp.asarray(np.random.default_rng(0).normal(size=x.shape)),
                         (f64, l64))
        h = 1e-6
        step = lambda s: jax.tree.map(lambda x, y: x + s * y, (f64, l64), d)
        fd = (loss64(step(h)) - loss64(step(-h))) / (2 * h)
        ad = sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(jax.grad(loss64)((f64, l64))),
                                                jax.tree.leaves(d)))
        np.testing.assert_allclose(ad, fd, rtol=1e-6)


def test_orthogonality_term():
    a = {"w": jnp.asarray([1.0, 0.0, 0.0])}
    b = {"w": jnp.asarray([0.0, 2.0, 0.0])}
    assert float(cos_squared(a, b)) == 0.0
    assert abs(float(cos_squared(a, {"w": -3.0 * a["w"]})) - 1.0) < 1e-6
    rng = np.random.default_rng(0)
    x, y = ({"w": jnp.asarray(rng.normal(size=20))} for _ in range(2))
    c = float(cos_squared(x, y))
    assert 0 <= c <= 1
    assert abs(float(cos_squared({"w": 5 * x["w"]}, {"w": 0.1 * y["w"]})) - c) < 1e-6
    g = jax.grad(lambda p: cos_squared(p, y))(x)
    lr = 1e-2 * float(jnp.linalg.norm(x["w"]))
    stepped = {"w": x["w"] - lr * g["w"] / jnp.linalg.norm(g["w"])}
    assert float(cos_squared(stepped, y)) < c


def test_model_mixing_shares_one_lambda_layer_mixing_draws_one_per_layer():
    model = mlp((6,), 3, hidden=(5,))
    params = model.init(jax.random.key(0))
    groups, count = layer_groups(params)
    assert count == 2 and len(groups) == 4  # two Dense layers, kernel + bias each
    mm = jax.tree.leaves(draw_lambdas(jax.random.key(3), params, "mm"))
    assert len({float(v) for v in mm}) == 1
    lm = jax.tree.leaves(draw_lambdas(jax.random.key(3), params, "lm"))
    by_group = {}
    for g, v in zip(groups, lm):
        by_group.setdefault(g, set()).add(float(v))
    assert all(len(v) == 1 for v in by_group.values())  # shared within a layer
    assert len({next(iter(v)) for v in by_group.values()}) == 2  # different across layers


# --------------------------------------------------------------- 5-6. server and table


def test_server_ignores_local_models_and_only_cohort_rows_change():
    alg = _sf(nu=1.0, start_round=0)
    state = alg.init(PARAMS, N)
    new, _ = _round(alg, state)
    before, after = _rows(alg, state), _rows(alg, new)
    for i in range(N):
        same = _equal(jax.tree.map(lambda x: x[i], before), jax.tree.map(lambda x: x[i], after))
        assert same == (i not in IDS or int(DATA.train.num_examples[i]) == 0), i
    # theta_g depends on the uploaded theta_f only: other local models (another
    # local_init_seed) change theta_l, hence theta_f, but with nu = 0 and lambda = 0
    # (before L) nothing of theta_l reaches the server.
    a = _sf(nu=0.0, start_round=5)
    b = _sf(nu=0.0, start_round=5, local_init_seed=7)
    ra, _ = _round(a, a.init(PARAMS, N))
    rb, _ = _round(b, b.init(PARAMS, N))
    assert _equal(ra.params, rb.params)


def test_local_models_start_distinct_and_persist_for_clients_never_sampled():
    alg = _sf(start_round=0)
    state = alg.init(PARAMS, N)
    rows = _rows(alg, state)
    flat = np.concatenate([np.asarray(x).reshape(N, -1) for x in jax.tree.leaves(rows)], 1)
    glob = np.concatenate([np.asarray(x).reshape(-1) for x in jax.tree.leaves(PARAMS)])
    assert not np.allclose(flat[0], flat[1])  # their own random initialisations
    assert not np.allclose(flat[0], glob)
    new, _ = _round(alg, state)
    untouched = [i for i in range(N) if i not in IDS]
    assert _equal(_rows(alg, new, untouched), _rows(alg, state, untouched))


@pytest.mark.parametrize("table", ["lazy", pytest.param("lazy:5", marks=pytest.mark.slow)])
def test_lazy_table_equals_dense(table):
    dense, lazy = _sf(start_round=1), _sf(start_round=1, client_table=table)
    sd, sl = dense.init(PARAMS, N), lazy.init(PARAMS, N)
    for r, ids in enumerate([[0, 3, 4], [1, 3, 5], [0, 1, 4]]):
        sd, _ = _round(dense, sd, ids, jax.random.key(r))
        sl, _ = _round(lazy, sl, ids, jax.random.key(r))
    # two programs: equal to float rounding (XLA may order a fusion's arithmetic
    # differently in each)
    _assert_trees(sd.params, sl.params, rtol=1e-6, atol=1e-7)
    _assert_trees(_rows(dense, sd), _rows(lazy, sl), rtol=1e-6, atol=1e-7)
    assert lazy.client_table.memory(sl.client_states)["rows_stored"] == 5  # 0, 1, 3, 4, 5


# --------------------------------------------------------------- 8-9. execution


def test_vmapped_cohort_equals_sequential_clients():
    alg = _sf(mode="lm", start_round=0)
    state = alg.init(PARAMS, N)
    a, _ = _round(alg, state, execution="vmap")
    b, _ = _round(alg, state, execution="sequential")
    _assert_trees(a.params, b.params, rtol=1e-5, atol=1e-6)
    _assert_trees(_rows(alg, a), _rows(alg, b), rtol=1e-5, atol=1e-6)


def test_padding_rows_change_nothing():
    alg = _sf(start_round=0)
    padded = helpers.repad(DATA.train, DATA.train.mask.shape[1] + 5)
    garbage = jax.tree.map(lambda v: v, padded)
    x = np.asarray(garbage.examples["x"]).copy()
    x[:, -5:] = 1e6
    garbage = garbage._replace(examples={**garbage.examples, "x": jnp.asarray(x)})
    state = alg.init(PARAMS, N)
    run = jax.jit(lambda s, d: alg.apply(s, helpers.cohort(d, IDS), jax.random.key(1))[0])
    a, b = run(state, padded), run(state, garbage)
    _assert_trees(a.params, b.params, rtol=0, atol=0)


# --------------------------------------------------------------- evaluation


def test_lambda_grid_metrics_and_summary():
    alg = _sf(start_round=0)
    state = alg.init(PARAMS, N)
    for r in range(3):
        state, _ = _round(alg, state, key=jax.random.key(r))
    grid = lambda_grid_metrics(MODEL, alg, state, DATA.test)
    acc = np.asarray(grid["accuracy"])
    assert acc.shape == (N, 11)
    # lambda = 0 is the global model on every client's test rows
    global_acc = np.asarray(make_evaluator(MODEL)(state.params, DATA.test)["accuracy"])
    summary = personalised_summary(grid)
    has = np.asarray(DATA.test.num_examples) > 0
    assert summary["acc_oracle_per_client"] >= summary["acc_best_lambda_avg"] - 1e-9
    np.testing.assert_allclose(summary["acc_lambda0"], acc[has, 0].mean(), rtol=1e-6)
    np.testing.assert_allclose(summary["acc_lambda1"], acc[has, -1].mean(), rtol=1e-6)
    np.testing.assert_allclose(global_acc[has], acc[has, 0], rtol=1e-6)
    # calibration at the best-average lambda, and the registry's end-of-run report
    best = int(np.argmax(acc[has].mean(0)))
    np.testing.assert_allclose(summary["ece_best_lambda"],
                               np.asarray(grid["ece"])[has, best].mean(), rtol=1e-6)
    assert 0.0 <= summary["ece_best_lambda"] <= summary["mce_best_lambda"] <= 1.0
    worst = np.sort(acc[has, best])[:max(1, int(0.1 * has.sum()))].mean()
    np.testing.assert_allclose(summary["acc_best_lambda_worst_10%"], worst, rtol=1e-6)
    from fedjax_fair.algorithms import REGISTRY
    assert REGISTRY["superfed"].report(MODEL, alg, state, DATA.test) == summary
    # the runner's personal model is theta(eval_lambda)
    personal = alg.personal(state, jnp.arange(N, dtype=jnp.int32))
    _assert_trees(jax.tree.map(lambda x: x[0], personal),
                  mix(state.params, jax.tree.map(lambda x: x[0], _rows(alg, state)), 0.5),
                  rtol=1e-6, atol=1e-7)


def test_bad_arguments_fail_before_compute():
    for kw in ({"mode": "xx"}, {"prox_form": "l1"}, {"nu": -1.0}, {"eval_lambda": 1.5},
               {"start_round": -1}, {"momentum": 1.0},
               {"training": ClientTraining(weight_decay=-1.0)}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            superfed(MODEL, **kw)
