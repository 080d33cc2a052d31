"""Stateful methods: SCAFFOLD, FedDyn and Ditto (per-client state tables).

* Three rounds of each method against a literal NumPy float64 reference of its
  paper's equations (module docstrings of fedjax_fair/algorithms/{scaffold,feddyn,
  ditto}.py) on helpers.tiny_federation(): unequal client sizes (client 2 empty),
  minibatches with a partial last batch, partial participation, padded cohorts
  whose masked rows repeat a client id. The reference reproduces each client's
  batch order from its key exactly as ``client.local_training`` splits it:
  client key = fold_in(round key, id) trains; finish key = fold_in(client key, 1);
  inside ``local_sgd``, (shuffle key, dropout key) = split(its key) and epoch e's
  row order is ``client.epoch_order(data, shuffle key, e, B)``.
* A heterogeneous quadratic federation where SCAFFOLD and FedDyn reach the global
  optimum and FedAvg with many local steps does not.
* Dense and lazy client tables give the same iterates.
* Ditto is evaluated with each client's own model.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_fair as ff
import helpers
from fedjax_fair.core import client
from fedjax_fair.scenarios import sampling
from fedjax_fair.drivers import simulate as sim
from fedjax_fair.algorithms import ditto, fedavg, feddyn, scaffold
from fedjax_fair.models.base import Model
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.core.types import ClientData, FederatedData

MODEL = helpers.logreg()
PARAMS = helpers.init_params(MODEL, 1)
DATA = helpers.tiny_federation()
TRAIN = DATA.train
N = DATA.num_clients
SIZES = np.asarray(helpers.TRAIN_SIZES)
B = 4  # minibatches: clients of 7, 9 and 5 rows end their epochs with a partial batch
EPOCHS = 2
LR = 0.2
SERVER_LR = 0.7  # SCAFFOLD's eta_g
ALPHA = 0.3  # FedDyn
LAM = 0.5  # Ditto
PERSONAL_LR = 0.15
PERSONAL_EPOCHS = 3

# (client ids, mask) of three rounds of a cohort of 4: the empty client takes part,
# padding rows repeat a client id under a False mask (client 1 is padding in round
# 2 after taking part in round 1), clients 4 and 1 take part once.
ROUNDS = (([0, 3, 2, 0], [True, True, True, False]),
          ([1, 4, 0, 5], [True, True, True, True]),
          ([5, 0, 3, 1], [True, True, True, False]))
ROUND_KEYS = tuple(jax.random.key(100 + r) for r in range(len(ROUNDS)))

RTOL, ATOL = 1e-4, 1e-5
TRAINING = ClientTraining(lr=LR, batch_size=B, num_epochs=EPOCHS)

FACTORIES = {
    "scaffold": lambda table="dense": scaffold(MODEL, server_lr=SERVER_LR, training=TRAINING,
                                               client_table=table),
    "feddyn": lambda table="dense": feddyn(MODEL, alpha=ALPHA, training=TRAINING,
                                           client_table=table),
    "ditto": lambda table="dense", lam=LAM, personal_lr=PERSONAL_LR: ditto(
        MODEL, lam=lam, personal_lr=personal_lr, personal_epochs=PERSONAL_EPOCHS,
        training=TRAINING, client_table=table),
}


@functools.cache
def _ditto_apply():
    """One compiled Ditto round with lambda and the personal rate as traced
    arguments (the reference test and the lambda test share it)."""
    return jax.jit(lambda state, cohort, key, lam, personal_lr: FACTORIES["ditto"](
        lam=lam, personal_lr=personal_lr).apply(state, cohort, key))


@functools.cache
def _jitted(name: str):
    alg = FACTORIES[name]()
    if name == "ditto":
        apply = _ditto_apply()
        return alg, lambda state, cohort, key: apply(state, cohort, key, jnp.float32(LAM),
                                                     jnp.float32(PERSONAL_LR))
    return alg, jax.jit(alg.apply)


def _run_rounds(name):
    """The three ROUNDS with the library; the state after every round."""
    alg, apply = _jitted(name)
    state = alg.init(PARAMS, N)
    states = []
    for (ids, mask), key in zip(ROUNDS, ROUND_KEYS):
        state, _ = apply(state, helpers.cohort(TRAIN, ids, mask=mask), key)
        states.append(state)
    return alg, states


def _table_rows(alg, state):
    """Every client's row, (W [N, d, C], b [N, C]) float64."""
    rows = alg.client_table.gather(state.client_states, jnp.arange(N, dtype=jnp.int32))
    return helpers.logreg_to_numpy(rows)


def _close(actual, expected, what):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL, err_msg=what)


# --------------------------------------------------------------------------------------
# The NumPy float64 reference: parameters are (W [d, C], b [C]) tuples.


def _batches(k: int, key, epochs: int):
    return helpers.local_batches(TRAIN, k, key, epochs, B)


def _client_keys(round_key, k):
    """(train key, finish key) of client k in a round."""
    key = jax.random.fold_in(round_key, k)
    return key, jax.random.fold_in(key, client.FINISH_KEY_ID)


def _zeros():
    w, b = helpers.logreg_to_numpy(PARAMS)
    return np.zeros_like(w), np.zeros_like(b)


def _add(*trees, scales=None):
    scales = scales or [1.0] * len(trees)
    return tuple(sum(s * t[i] for s, t in zip(scales, trees)) for i in range(2))


def _sgd(start, batches, lr, extra_grad):
    """Local SGD: p <- p - lr (mean CE gradient on the batch + extra_grad(p))."""
    p = start
    for x, y in batches:
        g = helpers.logreg_grad_numpy(p[0], p[1], x, y)
        p = _add(p, g, extra_grad(p), scales=[1.0, -lr, -lr])
    return p


def _heavy_ball(start, batches, lr, extra_grad, momentum):
    """Local SGD with momentum (optax.sgd(lr, momentum), torch's heavy ball):
    m <- g + momentum m, p <- p - lr m, g the batch's CE gradient + extra_grad(p)."""
    p, m = start, _zeros()
    for x, y in batches:
        g = _add(helpers.logreg_grad_numpy(p[0], p[1], x, y), extra_grad(p))
        m = _add(g, m, scales=[1.0, momentum])
        p = _add(p, m, scales=[1.0, -lr])
    return p


def _active(ids, mask):
    return [k for k, m in zip(ids, mask) if m]


def scaffold_reference():
    """Karimireddy et al. 2020, Algorithm 1, option II, weights 1/|S|, c += (1/N) sum."""
    x = helpers.logreg_to_numpy(PARAMS)
    c = _zeros()
    ci = {k: _zeros() for k in range(N)}
    out = []
    for (ids, mask), key in zip(ROUNDS, ROUND_KEYS):
        active = _active(ids, mask)
        deltas, dcs = [], []
        for k in active:
            train_key, _ = _client_keys(key, k)
            batches = _batches(k, train_key, EPOCHS)
            correction = _add(c, ci[k], scales=[1.0, -1.0])  # c - c_i
            y = _sgd(x, batches, LR, lambda p: correction)
            steps = len(batches)
            if steps:
                new = _add(ci[k], c, x, y, scales=[1.0, -1.0, 1 / (steps * LR), -1 / (steps * LR)])
            else:
                new = ci[k]
            dcs.append(_add(new, ci[k], scales=[1.0, -1.0]))
            ci[k] = new
            deltas.append(_add(x, y, scales=[1.0, -1.0]))
        mean_delta = _add(*deltas, scales=[1 / len(active)] * len(active))
        x = _add(x, mean_delta, scales=[1.0, -SERVER_LR])
        c = _add(c, *dcs, scales=[1.0] + [1 / N] * len(dcs))
        out.append((x, c, {k: v for k, v in ci.items()}))
    return out


def feddyn_reference():
    """Acar et al. 2021, Algorithm 1 with local SGD on the dynamic objective."""
    theta = helpers.logreg_to_numpy(PARAMS)
    h = _zeros()
    g = {k: _zeros() for k in range(N)}
    out = []
    for (ids, mask), key in zip(ROUNDS, ROUND_KEYS):
        active = _active(ids, mask)
        models = []
        for k in active:
            train_key, _ = _client_keys(key, k)
            batches = _batches(k, train_key, EPOCHS)
            # grad [L_i(p) - <g_i, p> + alpha/2 ||p - theta||^2] = grad L_i - g_i + alpha (p - theta)
            tk = _sgd(theta, batches, LR,
                      lambda p, gk=g[k]: _add(gk, p, theta, scales=[-1.0, ALPHA, -ALPHA]))
            g[k] = _add(g[k], tk, theta, scales=[1.0, -ALPHA, ALPHA])
            models.append(tk)
        moved = _add(*models, *([theta] * len(models)),
                     scales=[1.0] * len(models) + [-1.0] * len(models))  # sum (theta_i - theta)
        h = _add(h, moved, scales=[1.0, -ALPHA / N])
        mean = _add(*models, scales=[1 / len(models)] * len(models))
        theta = _add(mean, h, scales=[1.0, -1 / ALPHA])
        out.append((theta, h, {k: v for k, v in g.items()}))
    return out


def ditto_reference(momenta=None):
    """Li et al. 2021, Algorithm 1: FedAvg for w; personal SGD on
    F_k(v) + lam/2 ||v - w^t||^2 from the kept v_k (v_k = w^0 at the start).
    ``momenta`` (global, personal): heavy-ball steps with those momenta instead."""
    w = helpers.logreg_to_numpy(PARAMS)
    v = {k: w for k in range(N)}
    out = []
    glob, personal = ((_sgd, _sgd) if momenta is None else
                      tuple(functools.partial(_heavy_ball, momentum=m) for m in momenta))
    for (ids, mask), key in zip(ROUNDS, ROUND_KEYS):
        active = _active(ids, mask)
        total = sum(SIZES[k] for k in active)
        new_w = _zeros()
        for k in active:
            train_key, finish_key = _client_keys(key, k)
            wk = glob(w, _batches(k, train_key, EPOCHS), LR, lambda p: _zeros())
            new_w = _add(new_w, wk, scales=[1.0, SIZES[k] / total])
            v[k] = personal(v[k], _batches(k, finish_key, PERSONAL_EPOCHS), PERSONAL_LR,
                            lambda p: _add(p, w, scales=[LAM, -LAM]))
        w = new_w
        out.append((w, {k: val for k, val in v.items()}))
    return out


def _stacked(rows):
    return tuple(np.stack([rows[k][i] for k in range(N)]) for i in range(2))


# --------------------------------------------------------------------------------------
# Three rounds against the references.


def test_batches_reference_matches_batch_from_orders():
    """The reference's batch order is the library's: batch_from_orders on the same
    orders gives the same rows and mask for every step."""
    k, key = 0, jax.random.key(9)
    data = helpers.client(TRAIN, k)
    shuffle_key, _ = jax.random.split(key)
    orders = helpers.epoch_orders(EPOCHS, B)(data, shuffle_key)
    mine = _batches(k, key, EPOCHS)
    assert len(mine) == EPOCHS * math.ceil(SIZES[k] / B)
    batch = jax.jit(lambda t: client.batch_from_orders(data, orders, t, B))
    for t, (x, _) in enumerate(mine):
        examples, bmask = batch(jnp.asarray(t))
        np.testing.assert_array_equal(np.asarray(examples["x"])[np.asarray(bmask)], x)
    # Every epoch visits every real row once.
    per_epoch = len(mine) // EPOCHS
    for e in range(EPOCHS):
        rows = np.concatenate([x for x, _ in mine[e * per_epoch:(e + 1) * per_epoch]])
        assert sorted(map(tuple, rows)) == sorted(map(tuple, np.asarray(
            TRAIN.examples["x"][k, :SIZES[k]], np.float64)))


def test_scaffold_matches_numpy_reference():
    alg, states = _run_rounds("scaffold")
    assert alg.evaluates == "global"
    for r, (state, (x, c, ci)) in enumerate(zip(states, scaffold_reference())):
        _close(helpers.logreg_to_numpy(state.params), x, f"round {r}: x")
        _close(helpers.logreg_to_numpy(state.aggregator_state.control), c, f"round {r}: c")
        _close(_table_rows(alg, state), _stacked(ci), f"round {r}: c_i")
    # Sanity: the control variates moved, and c = (1/N) sum_i c_i (every c_i starts at 0).
    c_rows = _table_rows(alg, states[-1])
    assert np.abs(c_rows[0]).max() > 1e-2
    _close(helpers.logreg_to_numpy(states[-1].aggregator_state.control),
           tuple(r.mean(0) for r in c_rows), "c = mean c_i")


def test_feddyn_matches_numpy_reference():
    alg, states = _run_rounds("feddyn")
    assert alg.evaluates == "global"
    # The module keeps the family's duals: lambda_i = -g_i, lambda-bar = -h.
    neg = lambda tree: tuple(-np.asarray(x) for x in tree)
    for r, (state, (theta, h, g)) in enumerate(zip(states, feddyn_reference())):
        _close(helpers.logreg_to_numpy(state.params), theta, f"round {r}: theta")
        _close(neg(helpers.logreg_to_numpy(state.aggregator_state.mean_dual)), h,
               f"round {r}: h")
        _close(neg(_table_rows(alg, state)), _stacked(g), f"round {r}: g_i")
    g_rows = neg(_table_rows(alg, states[-1]))
    assert np.abs(g_rows[0]).max() > 1e-3
    # h tracks the clients' linear terms: h = (1/N) sum_i g_i.
    _close(neg(helpers.logreg_to_numpy(states[-1].aggregator_state.mean_dual)),
           tuple(r.mean(0) for r in g_rows), "h = mean g_i")


def test_ditto_matches_numpy_reference():
    alg, states = _run_rounds("ditto")
    assert alg.evaluates == "personal"
    for r, (state, (w, v)) in enumerate(zip(states, ditto_reference())):
        _close(helpers.logreg_to_numpy(state.params), w, f"round {r}: w")
        _close(_table_rows(alg, state), _stacked(v), f"round {r}: v_k")
        personal = alg.personal(state, jnp.arange(N, dtype=jnp.int32))
        _close(helpers.logreg_to_numpy(personal), _stacked(v), f"round {r}: personal")


def test_ditto_with_momentum_optimizers_matches_numpy_reference():
    """client_optimizer drives the global steps, personal_optimizer the personal ones
    (each SGD with its own momentum; heavy ball, state fresh every round): the first
    two rounds against the reference, and not the plain-SGD iterates."""
    momenta = (0.9, 0.5)
    alg = ditto(MODEL, lam=LAM, personal_lr=PERSONAL_LR, personal_epochs=PERSONAL_EPOCHS,
                training=TRAINING._replace(
                    optimizer=lambda lr: optax.sgd(lr, momentum=momenta[0])),
                personal_optimizer=lambda lr: optax.sgd(lr, momentum=momenta[1]))
    apply = jax.jit(alg.apply)
    state = alg.init(PARAMS, N)
    plain = ditto_reference()
    for r, (w, v) in enumerate(ditto_reference(momenta)[:2]):
        ids, mask = ROUNDS[r]
        state, _ = apply(state, helpers.cohort(TRAIN, ids, mask=mask), ROUND_KEYS[r])
        _close(helpers.logreg_to_numpy(state.params), w, f"round {r}: w")
        _close(_table_rows(alg, state), _stacked(v), f"round {r}: v_k")
        assert np.abs(w[0] - plain[r][0][0]).max() > 1e-3  # momentum changed w
        assert np.abs(v[0][0] - plain[r][1][0][0]).max() > 1e-3  # and v_0


def test_ditto_rows_of_absent_clients_persist_unchanged():
    """Rows change only for a round's unmasked clients with data; everyone else's
    row is bit-for-bit the previous one, and never-sampled clients hold w^0."""
    alg, states = _run_rounds("ditto")
    previous = _table_rows(alg, alg.init(PARAMS, N))
    for (ids, mask), state in zip(ROUNDS, states):
        rows = _table_rows(alg, state)
        active = set(_active(ids, mask))
        for k in range(N):
            changed = not all(np.array_equal(a[k], b[k]) for a, b in zip(rows, previous))
            assert changed == (k in active and SIZES[k] > 0), (k, ids, mask)
        previous = rows
    seen = set().union(*(_active(ids, mask) for ids, mask in ROUNDS))
    w0 = helpers.logreg_to_numpy(PARAMS)
    for k in set(range(N)) - seen - {helpers.EMPTY_CLIENT}:
        np.testing.assert_array_equal(previous[0][k], w0[0])


# --------------------------------------------------------------------------------------
# Client drift on a heterogeneous quadratic federation.

QD, QN = 5, 8  # dimension, clients
_rng = np.random.default_rng(0)
QA = _rng.uniform(0.3, 3.0, size=(QN, QD)).astype(np.float32)  # diagonals of A_i
QB = (2.0 * _rng.normal(size=(QN, QD))).astype(np.float32)  # b_i
Q_STAR = (QA.astype(np.float64) * QB).sum(0) / QA.astype(np.float64).sum(0)


def _quadratic_loss(params, batch, key=None):
    """f_i(theta) = 1/2 (theta - b_i)^T diag(a_i) (theta - b_i); each client's single
    example row holds (a_i, b_i)."""
    del key
    a, b = batch["x"][:, :QD], batch["x"][:, QD:]
    return 0.5 * jnp.sum(a * jnp.square(params["theta"][None] - b), axis=-1)


QMODEL = Model(init=lambda key: {"theta": jnp.zeros((QD,), jnp.float32)},
               apply=lambda params, x, key=None: x,
               per_example_loss=_quadratic_loss,
               per_example_metrics=lambda params, batch: {
                   "loss": _quadratic_loss(params, batch),
                   "accuracy": jnp.zeros(batch["x"].shape[:1], jnp.float32)},
               name="quadratic", input_shape=(2 * QD,), num_classes=1)
_qsplit = ClientData(examples={"x": jnp.asarray(np.concatenate([QA, QB], 1)[:, None, :]),
                               "y": jnp.zeros((QN, 1), jnp.int32)},
                     mask=jnp.ones((QN, 1), bool), num_examples=jnp.ones((QN,), jnp.int32))
QDATA = FederatedData(_qsplit, _qsplit)
Q_LOCAL_STEPS = 20  # one example per client: one full-batch step per epoch
Q_LR = 0.1
Q_TRAINING = ClientTraining(lr=Q_LR, batch_size=1, num_epochs=Q_LOCAL_STEPS)


def _quadratic_run(alg, cohort_size, rounds, sampler=sampling.uniform):
    run = jax.jit(lambda s, d, k: sim.simulate(alg, s, d, k, num_rounds=rounds,
                                               cohort_size=cohort_size, sampler=sampler))
    state, metrics = run(alg.init({"theta": jnp.zeros((QD,), jnp.float32)}, QN), QDATA,
                         jax.random.key(0))
    assert bool(np.all(metrics["finite"]))
    return np.asarray(state.params["theta"], np.float64)


def test_quadratic_optimum_is_far_from_the_unweighted_mean():
    """Precondition: the problem is heterogeneous enough to show FedAvg's bias."""
    assert np.linalg.norm(QB.mean(0) - Q_STAR) > 0.5
    assert len(np.unique(QA.round(4), axis=0)) == QN and len(np.unique(QB.round(4), axis=0)) == QN


def test_fedavg_with_many_local_steps_is_biased_on_the_quadratic():
    alg = fedavg(QMODEL, training=Q_TRAINING)
    theta = _quadratic_run(alg, QN, 100, sampling.full)
    assert np.linalg.norm(theta - Q_STAR) > 0.2, theta


def test_scaffold_reaches_the_global_optimum_with_partial_participation():
    alg = scaffold(QMODEL, training=Q_TRAINING)
    theta = _quadratic_run(alg, QN // 2, 100)
    assert np.linalg.norm(theta - Q_STAR) < 1e-2, (theta, Q_STAR)


def test_feddyn_reaches_the_global_optimum_with_partial_participation():
    alg = feddyn(QMODEL, alpha=1.0, training=Q_TRAINING)
    theta = _quadratic_run(alg, QN // 2, 100)
    assert np.linalg.norm(theta - Q_STAR) < 1e-2, (theta, Q_STAR)


# --------------------------------------------------------------------------------------
# Dense and lazy tables.


@pytest.mark.parametrize("name", ["scaffold", "feddyn", "ditto"])
def test_dense_and_lazy_tables_give_the_same_iterates(name):
    results = {}
    for table in ("dense", "lazy"):
        alg = FACTORIES[name](table)
        assert alg.client_table.name == table
        run = jax.jit(lambda s, d, k, alg=alg: sim.simulate(alg, s, d, k, num_rounds=5,
                                                            cohort_size=3))
        state, metrics = run(alg.init(PARAMS, N), DATA, jax.random.key(11))
        rows = alg.client_table.gather(state.client_states, jnp.arange(N, dtype=jnp.int32))
        results[table] = (state, metrics, rows)
    (dense, dense_metrics, dense_rows), (lazy, lazy_metrics, lazy_rows) = results.values()
    helpers.assert_trees_close(lazy.params, dense.params, rtol=1e-6, atol=1e-7)
    helpers.assert_trees_close(lazy.aggregator_state, dense.aggregator_state, rtol=1e-6,
                               atol=1e-7)
    helpers.assert_trees_close(lazy_rows, dense_rows, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(lazy.client_states.last_round,
                                  dense.client_states.last_round)
    np.testing.assert_array_equal(lazy_metrics["client_ids"], dense_metrics["client_ids"])
    # Partial participation: some client was never sampled, and the lazy table
    # stores rows for the sampled ones only.
    sampled = np.unique(np.asarray(dense_metrics["client_ids"]))
    assert len(sampled) < N
    assert int(lazy.client_states.used) == len(sampled)
    assert not bool(lazy.client_states.overflow)


# --------------------------------------------------------------------------------------
# Ditto: personal evaluation and the role of lambda.


def _logreg_metrics(params_np, k):
    """(accuracy, mean loss) of (W, b) on client k's test rows, float64."""
    n = int(DATA.test.num_examples[k])
    x = np.asarray(DATA.test.examples["x"][k, :n], np.float64)
    y = np.asarray(DATA.test.examples["y"][k, :n])
    logits = x @ params_np[0] + params_np[1]
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return np.mean(np.argmax(logits, -1) == y), -np.mean(logp[np.arange(n), y])


def test_ditto_run_evaluates_each_clients_personal_model():
    alg = FACTORIES["ditto"]()
    key = jax.random.key(4)
    rounds, cohort_size = 2, 2
    result = ff.run(alg, PARAMS, DATA, key, model=MODEL, num_rounds=rounds,
                    cohort_size=cohort_size, eval_every=rounds, progress=False)
    assert result.evaluated == "personal"
    assert result.client_table is not None and result.client_table["form"] == "dense"
    sampled = set(np.unique(sim.sample_client_ids(key, 0, rounds, N, cohort_size)).tolist())
    unsampled = [k for k in range(N) if k not in sampled and DATA.test.num_examples[k] > 0]
    trained = [k for k in sampled if SIZES[k] > 0 and DATA.test.num_examples[k] > 0]
    assert unsampled and trained  # precondition of this key

    rows = _table_rows(alg, result.state)
    w0 = helpers.logreg_to_numpy(PARAMS)
    global_model = helpers.logreg_to_numpy(result.state.params)
    metrics = result.client_metrics
    for k in range(N):
        if DATA.test.num_examples[k] == 0:
            continue
        acc, loss = _logreg_metrics((rows[0][k], rows[1][k]), k)
        np.testing.assert_allclose(metrics["accuracy"][k], acc, atol=1e-6)
        np.testing.assert_allclose(metrics["loss"][k], loss, rtol=1e-4, atol=1e-5)
    for k in unsampled:  # never sampled: still the initial model
        np.testing.assert_array_equal(rows[0][k], w0[0])
        np.testing.assert_array_equal(rows[1][k], w0[1])
        np.testing.assert_allclose(metrics["loss"][k], _logreg_metrics(w0, k)[1], rtol=1e-4)
    for k in trained:  # the personal model, not the global one, was evaluated
        assert abs(metrics["loss"][k] - _logreg_metrics(global_model, k)[1]) > 1e-3
    # The summary in the history is the personal evaluation too.
    has_test = metrics["num_examples"] > 0
    np.testing.assert_allclose(result.history[-1]["accuracy_mean"], np.mean(metrics["accuracy"][has_test]),
                               rtol=1e-5)


def test_ditto_with_large_lambda_approaches_the_global_model():
    """lambda = 0: independent local models drifting away from w; lambda -> inf ties
    v_k to the broadcast w^t. The distance of the personal models to the last
    broadcast model shrinks as lambda grows."""
    apply = _ditto_apply()
    ids = [0, 1, 3, 4]  # clients with data; cohorts of 4 as in ROUNDS (one compilation)
    cohort = helpers.cohort(TRAIN, ids)
    personal_lr = 0.04
    distance = {}
    for lam in (0.0, 1.0, 25.0):  # personal_lr * lam = 0, 0.04, 1
        state = FACTORIES["ditto"]().init(PARAMS, N)
        for r in range(4):
            broadcast = state.params
            state, _ = apply(state, cohort, jax.random.key(r), jnp.float32(lam),
                             jnp.float32(personal_lr))
        rows = helpers.logreg_to_numpy(state.client_states.rows)
        w = helpers.logreg_to_numpy(broadcast)
        distance[lam] = np.sqrt(((rows[0] - w[0][None]) ** 2).sum((1, 2))
                                + ((rows[1] - w[1][None]) ** 2).sum(1))[ids].max()
    assert distance[25.0] < distance[1.0] < distance[0.0], distance
    assert distance[25.0] < 0.15 * distance[0.0], distance
