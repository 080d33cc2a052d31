"""Algorithm tests: FedAvg, FedProx, the FedOpt family and compose, against NumPy
float64 references and literal paper formulas; and the registry-wide checks every
factory must pass (bad arguments refused at build time naming the argument, the
shared local-training options, the hyper-parameters stated for the command line).

Most rounds use full-batch clients (B = 12 >= every client's size), so each local
step is one gradient-descent step on the client's whole objective and the
reference needs no knowledge of the shuffling. The federation is
helpers.tiny_federation() (client 2 is empty).
"""
from __future__ import annotations

import functools
import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from helpers import (ALG_MODEL as MODEL, ALG_PARAMS as PARAMS, ALG_TRAIN as TRAIN, ALG_N as N,
                     ALG_LR as LR, ALG_KEY as KEY, sequential as _seq,
                     ALG_FULL_BATCH as FULL_BATCH, ALG_EPOCHS as EPOCHS, ALG_MU as MU,
                     ALG_IDS as IDS, assert_logreg_close as _assert_logreg_close,
                     TRAIN_SIZES_ARRAY as SIZES)
from fedjax_fair.core import mixing as mixing_lib
from fedjax_fair.core.aggregators import Aggregator, weighted_sum
from fedjax_fair.core.algorithm import compose
from fedjax_fair.algorithms.fedopt import scale_by_adagrad_tau
from fedjax_fair.algorithms import fedadagrad, fedadam, fedavg, fedavgm, fedprox, fedyogi
from fedjax_fair.algorithms import REGISTRY as _REGISTRY
from fedjax_fair.algorithms import REGISTRY, method_hparams
from fedjax_fair.algorithms.afl import afl
from fedjax_fair.algorithms.fedmax import fedmax, fedmax_k, fedsoftmax
from fedjax_fair.algorithms.propfair import propfair
from fedjax_fair.algorithms.qffl import qffl
from fedjax_fair.algorithms.term import term
from fedjax_fair.cli import config as config_lib
from fedjax_fair.core.client import local_training
from fedjax_fair.core.mixing import MixingRule
from fedjax_fair.core.client import FIELDS, TRAINING_RANGES, ClientTraining


def _kwargs(**extra):
    return dict(training=ClientTraining(lr=LR, batch_size=FULL_BATCH, num_epochs=EPOCHS),
                **extra)


@functools.cache
def _jitted(name: str):
    """(algorithm, jitted apply) of the configurations shared by several tests."""
    factories = {
        "fedavg": lambda: fedavg(MODEL, **_kwargs()),
        "fedprox0": lambda: fedprox(MODEL, mu=0.0, **_kwargs()),
        "fedprox": lambda: fedprox(MODEL, mu=MU, **_kwargs()),
    }
    alg = _seq(factories[name]())
    return alg, jax.jit(alg.apply)


def _round(name, ids=IDS, budgets=None, params=PARAMS, key=KEY):
    alg, apply = _jitted(name)
    return apply(alg.init(params, N), helpers.cohort(TRAIN, ids, budgets), key)


def _numpy_fedavg(ids, steps, mu=0.0, params=PARAMS):
    """theta - sum_k (n_k / n) Delta_k with every client's full-batch GD in NumPy."""
    w0, b0 = helpers.logreg_to_numpy(params)
    n = SIZES[list(ids)].astype(np.float64)
    w_new, b_new = np.zeros_like(w0), np.zeros_like(b0)
    for k, nk in zip(ids, n):
        x, y = helpers.real_rows(TRAIN, [k])
        w, b = helpers.logreg_gd_numpy(params, x, y, LR, min(steps, EPOCHS) if nk else 0, mu)
        w_new += nk / n.sum() * w
        b_new += nk / n.sum() * b
    return w_new, b_new


# --------------------------------------------------------------------------------------
# FedAvg.


@pytest.mark.parametrize("ids", [IDS, (0, 1, 2, 4), (5, 3)])
def test_fedavg_one_local_step_equals_large_batch_sgd(ids):
    """One full-batch local step per client, data-size weights: the weighted mean of
    per-client mean gradients is the mean gradient over the union of the cohort's
    data, so the round is one SGD step on that union (McMahan et al. 2017, §2)."""
    k = len(ids)
    ids6 = tuple(ids) + (ids[0],) * (N - k)  # pad to the shared cohort shape
    mask = [True] * k + [False] * (N - k)
    alg, apply = _jitted("fedavg")
    state, metrics = apply(alg.init(PARAMS, N),
                           helpers.cohort(TRAIN, ids6, budgets=[1] * N, mask=mask), KEY)
    x, y = helpers.real_rows(TRAIN, ids)
    w0, b0 = helpers.logreg_to_numpy(PARAMS)
    gw, gb = helpers.logreg_grad_numpy(w0, b0, x, y)
    _assert_logreg_close(state.params, (w0 - LR * gw, b0 - LR * gb), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(metrics["weights"])[k:], 0.0)


def test_fedavg_multi_step_round_equals_numpy_reference():
    state, metrics = _round("fedavg")
    _assert_logreg_close(state.params, _numpy_fedavg(IDS, EPOCHS))
    np.testing.assert_array_equal(metrics["num_steps"],
                                  [EPOCHS if SIZES[k] else 0 for k in IDS])
    np.testing.assert_allclose(metrics["weights"], SIZES[list(IDS)] / SIZES.sum(), rtol=1e-6)


def test_fedavg_converges_on_a_separable_problem():
    alg, apply = _jitted("fedavg")
    state = alg.init(PARAMS, N)
    cohort = helpers.cohort(TRAIN, IDS)
    losses = []
    for r in range(40):
        state, metrics = apply(state, cohort, jax.random.key(r))
        losses.append(float(metrics["train_loss"]))
    x, y = helpers.real_rows(TRAIN, range(N))
    w, b = helpers.logreg_to_numpy(state.params)
    accuracy = np.mean(np.argmax(x @ w + b, -1) == y)
    assert accuracy > 0.9, accuracy
    assert losses[-1] < 0.5 * losses[0]
    assert helpers.tree_all_finite(state.params)


# --------------------------------------------------------------------------------------
# FedProx.


def test_fedprox_with_mu_zero_equals_fedavg():
    avg, avg_metrics = _round("fedavg")
    prox, prox_metrics = _round("fedprox0")
    helpers.assert_trees_close(prox.params, avg.params, rtol=1e-6, atol=1e-7)
    for name in ("weights", "loss_before", "num_steps", "train_loss"):
        np.testing.assert_allclose(prox_metrics[name], avg_metrics[name], rtol=1e-6)


def test_fedprox_round_equals_numpy_proximal_gradient_descent():
    """w_{t+1} = w_t - lr (grad F_k(w_t) + mu (w_t - w^0)) for every step t (eq. 2)."""
    state, _ = _round("fedprox")
    _assert_logreg_close(state.params, _numpy_fedavg(IDS, EPOCHS, mu=MU))


@pytest.mark.parametrize("cid", [0, 1, 3])
def test_fedprox_local_steps_by_hand(cid):
    """One client, rounds on a cohort of that client only: step 1 equals FedAvg's
    (the proximal gradient mu (w0 - w0) vanishes); step 2 adds mu (w1 - w0)."""
    ids = (cid,) * N
    x, y = helpers.real_rows(TRAIN, [cid])
    w0, b0 = helpers.logreg_to_numpy(PARAMS)
    gw0, gb0 = helpers.logreg_grad_numpy(w0, b0, x, y)
    w1, b1 = w0 - LR * gw0, b0 - LR * gb0

    prox1, _ = _round("fedprox", ids, budgets=[1] * N)
    avg1, _ = _round("fedavg", ids, budgets=[1] * N)
    helpers.assert_trees_close(prox1.params, avg1.params, rtol=1e-6, atol=1e-7)
    _assert_logreg_close(prox1.params, (w1, b1))

    gw1, gb1 = helpers.logreg_grad_numpy(w1, b1, x, y)
    w2 = w1 - LR * (gw1 + MU * (w1 - w0))
    b2 = b1 - LR * (gb1 + MU * (b1 - b0))
    prox2, _ = _round("fedprox", ids, budgets=[2] * N)
    _assert_logreg_close(prox2.params, (w2, b2))


@pytest.mark.parametrize("cid", [0, 1, 3, 4, 5])
def test_fedprox_moves_the_local_model_less_than_fedavg(cid):
    ids = (cid,) * N
    avg, _ = _round("fedavg", ids)
    prox, _ = _round("fedprox", ids)
    move_avg = helpers.tree_norm(helpers.tree_sub(PARAMS, avg.params))
    move_prox = helpers.tree_norm(helpers.tree_sub(PARAMS, prox.params))
    assert 0.0 < move_prox < move_avg


# --------------------------------------------------------------------------------------
# Server optimizers (Reddi et al. 2021, Algorithm 2; Hsu et al. 2019).

SERVER_LR = 0.05
TAU = 1e-3
B1, B2 = 0.9, 0.99

FEDOPT = {
    "fedavgm": (lambda: fedavgm(MODEL, server_lr=SERVER_LR, momentum=0.8,
                                **_kwargs()),
                lambda: optax.sgd(SERVER_LR, momentum=0.8)),
    "fedadam": (lambda: fedadam(MODEL, server_lr=SERVER_LR, b1=B1, b2=B2, tau=TAU,
                                **_kwargs()),
                lambda: optax.adam(SERVER_LR, b1=B1, b2=B2, eps=TAU)),
    "fedyogi": (lambda: fedyogi(MODEL, server_lr=SERVER_LR, b1=B1, b2=B2, tau=TAU,
                                **_kwargs()),
                lambda: optax.yogi(SERVER_LR, b1=B1, b2=B2, eps=TAU)),
    "fedadagrad": (lambda: fedadagrad(MODEL, server_lr=SERVER_LR, tau=TAU,
                                      **_kwargs()),
                   # optax.adagrad has eps inside the sqrt; the paper's tau is outside it.
                   lambda: optax.chain(scale_by_adagrad_tau(TAU), optax.scale(-SERVER_LR))),
}
ROUND_KEYS = (jax.random.key(10), jax.random.key(11), jax.random.key(12))
ROUND_IDS = ((0, 1, 3, 4, 5, 2), (5, 4, 3, 1, 0, 2), (1, 0, 5, 3, 4, 2))


@functools.cache
def _fedopt_rounds(name):
    """Three rounds of a FedOpt method: [state_0, state_1, state_2, state_3]."""
    alg = _seq(FEDOPT[name][0]())
    apply = jax.jit(alg.apply)
    states = [alg.init(PARAMS, N)]
    for ids, key in zip(ROUND_IDS, ROUND_KEYS):
        states.append(apply(states[-1], helpers.cohort(TRAIN, ids), key)[0])
    return states


def _averaged_delta(params, ids, key):
    """FedAvg's aggregated pseudo-gradient Delta = theta - FedAvg(theta) at ``params``."""
    new, _ = _round("fedavg", ids, params=params, key=key)
    return jax.tree.map(lambda p, q: np.asarray(p, np.float64) - np.asarray(q, np.float64),
                        params, new.params)


@pytest.mark.parametrize("name", sorted(FEDOPT))
def test_server_optimizer_equals_optax_on_the_averaged_delta(name):
    states = _fedopt_rounds(name)
    opt = FEDOPT[name][1]()
    params, opt_state = PARAMS, opt.init(PARAMS)
    for r, (ids, key) in enumerate(zip(ROUND_IDS, ROUND_KEYS)):
        delta = jax.tree.map(lambda d: jnp.asarray(d, jnp.float32),
                             _averaged_delta(params, ids, key))
        updates, opt_state = opt.update(delta, opt_state, params)
        params = optax.apply_updates(params, updates)
        helpers.assert_trees_close(states[r + 1].params, params, rtol=1e-5, atol=2e-6)
    helpers.assert_trees_close(states[-1].opt_state, opt_state, rtol=1e-4, atol=1e-6)
    assert int(states[-1].round) == 3


def _literal_server_steps(name):
    """NumPy server steps of the paper's formulas on the same averaged deltas."""
    x = jax.tree.map(lambda p: np.asarray(p, np.float64), PARAMS)
    m = jax.tree.map(np.zeros_like, x)
    v = jax.tree.map(np.zeros_like, x)
    out = []
    for t, (ids, key) in enumerate(zip(ROUND_IDS, ROUND_KEYS), start=1):
        delta = _averaged_delta(jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), x),
                                ids, key)
        if name == "fedavgm":  # v = beta v + Delta; x <- x - eta v
            m = jax.tree.map(lambda m_, d: 0.8 * m_ + d, m, delta)
            x = jax.tree.map(lambda x_, m_: x_ - SERVER_LR * m_, x, m)
        elif name == "fedadam":  # Adam with bias correction (fedopt.py's stated choice)
            m = jax.tree.map(lambda m_, d: B1 * m_ + (1 - B1) * d, m, delta)
            v = jax.tree.map(lambda v_, d: B2 * v_ + (1 - B2) * d * d, v, delta)
            x = jax.tree.map(lambda x_, m_, v_: x_ - SERVER_LR * (m_ / (1 - B1 ** t)) / (
                np.sqrt(v_ / (1 - B2 ** t)) + TAU), x, m, v)
        elif name == "fedadagrad":  # v = v + Delta^2; x <- x - eta Delta / (sqrt(v) + tau)
            v = jax.tree.map(lambda v_, d: v_ + d * d, v, delta)
            x = jax.tree.map(lambda x_, d, v_: x_ - SERVER_LR * d / (np.sqrt(v_) + TAU),
                             x, delta, v)
        out.append(x)
    return out


@pytest.mark.parametrize("name", ["fedavgm", "fedadam", "fedadagrad"])
def test_server_optimizer_matches_the_paper_formula(name):
    """FedAvgM: Hsu et al. 2019; FedAdam / FedAdagrad: Reddi et al. 2021, Alg. 2,
    where tau is added to sqrt(v) (the "adaptivity"), as fedopt.py's docstring states."""
    states = _fedopt_rounds(name)
    for r, expected in enumerate(_literal_server_steps(name)):
        helpers.assert_trees_close(states[r + 1].params, expected, rtol=1e-4, atol=1e-5)


def test_fedavgm_without_momentum_and_unit_rate_equals_fedavg():
    alg = _seq(fedavgm(MODEL, server_lr=1.0, momentum=0.0, **_kwargs()))
    state, _ = jax.jit(alg.apply)(alg.init(PARAMS, N), helpers.cohort(TRAIN, IDS), KEY)
    ref, _ = _round("fedavg")
    helpers.assert_trees_close(state.params, ref.params, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------
# compose with custom pieces.


@pytest.mark.parametrize("field, value", [
    ("mixing", "uniform"), ("aggregator", lambda state, outputs: outputs),
    ("server_optimizer", optax.adam), ("server_optimizer", "sgd")])
def test_compose_refuses_pieces_of_the_wrong_type_naming_the_argument(field, value):
    """A string rule or an uncalled optax factory fails when composed, naming the
    argument, not inside the first round's trace."""
    clients = local_training(MODEL, training=ClientTraining(lr=0.1, batch_size=2))
    with pytest.raises(TypeError, match=f"^{field}"):
        compose(clients, **{field: value})
    with pytest.raises(TypeError, match="^client_update"):
        compose("fedavg")


def test_compose_with_custom_pieces():
    """Custom client update (with a per-client state table and extras), a stateful
    mixing rule over all N clients (uniform weights), a stateful aggregator and an
    optax server optimizer, wired by compose; checked against NumPy."""
    base = local_training(MODEL, training=ClientTraining(optimizer=optax.sgd(LR),
                                                         batch_size=FULL_BATCH, num_epochs=1))

    def client_update(broadcast, client_state, data, local_steps, key):
        out, _ = base(broadcast, (), data, local_steps, key)
        out = out._replace(extra={"n_twice": 2 * out.num_examples})
        return out, client_state + 1  # times this client has trained

    def mixing_init(num_clients):
        return jnp.zeros((num_clients,), jnp.float32)  # participation counts

    def mixing_update(state, outputs, ctx):
        weights, _ = mixing_lib.uniform().update((), outputs, ctx)
        state = state.at[jnp.where(ctx.client_mask, ctx.client_ids, state.shape[0])].add(
            1.0, mode="drop")
        return weights, state

    def agg_init(params, num_clients):
        return jnp.zeros((), jnp.int32)

    def agg_aggregate(state, outputs, weights, ctx):
        chex.assert_equal(outputs.extra["n_twice"].shape, weights.shape)
        return weighted_sum(outputs.delta, weights), state + 1, {}

    def round_metrics(outputs, weights, ctx):  # the method's own, beside the round's
        return {"client/n_twice": outputs.extra["n_twice"],
                "weighted_n": jnp.sum(weights * outputs.num_examples)}

    server_lr = 0.5
    pieces = dict(mixing=MixingRule(mixing_init, mixing_update),
                  aggregator=Aggregator(agg_init, agg_aggregate),
                  server_optimizer=optax.sgd(server_lr),
                  client_state_init=lambda params: jnp.zeros((), jnp.int32))
    alg = _seq(compose(client_update, round_metrics=round_metrics, **pieces))
    ids = [4, 0, 1, 0]  # slot 3 repeats client 0 but is masked out
    mask = [True, True, True, False]
    cohort = helpers.cohort(TRAIN, ids, mask=mask)
    state, metrics = jax.jit(alg.apply)(alg.init(PARAMS, N), cohort, KEY)

    np.testing.assert_allclose(metrics["weights"], [1 / 3, 1 / 3, 1 / 3, 0.0], rtol=1e-6)
    sizes = np.asarray(cohort.data.num_examples)
    np.testing.assert_array_equal(metrics["client/n_twice"], 2 * sizes)
    np.testing.assert_allclose(metrics["weighted_n"], sizes[:3].mean(), rtol=1e-6)
    # a method's metric may not take one of the round's names; a non-function is refused
    clash = _seq(compose(client_update, round_metrics=lambda o, w, c: {"weights": w},
                         **pieces))
    with pytest.raises(ValueError, match="^round_metrics"):
        jax.eval_shape(clash.apply, alg.init(PARAMS, N), cohort, KEY)
    with pytest.raises(TypeError, match="^round_metrics"):
        compose(client_update, round_metrics={"x": 1})
    np.testing.assert_array_equal(state.client_states.rows, [1, 1, 0, 0, 1, 0])
    np.testing.assert_array_equal(state.mixing_state, [1, 1, 0, 0, 1, 0])
    assert int(state.aggregator_state) == 1 and int(state.round) == 1

    w0, b0 = helpers.logreg_to_numpy(PARAMS)
    dw, db = np.zeros_like(w0), np.zeros_like(b0)
    for k in (4, 0, 1):
        x, y = helpers.real_rows(TRAIN, [k])
        gw, gb = helpers.logreg_grad_numpy(w0, b0, x, y)
        dw += LR * gw / 3
        db += LR * gb / 3
    _assert_logreg_close(state.params, (w0 - server_lr * dw, b0 - server_lr * db))


@pytest.mark.parametrize("table", ["dense", "lazy"])
def test_compose_broadcast_drift_and_personal_wiring(table):
    """A minimal stateful method: the server broadcasts its round-count payload, each
    client's row counts its participations plus the payload, every row drifts by the
    round's count / 2 before the cohort writes, and the personal model is the global
    one scaled by the row. Checked against the same recursion by hand."""
    base = local_training(MODEL, training=ClientTraining(optimizer=optax.sgd(LR),
                                                         batch_size=FULL_BATCH, num_epochs=1))

    def client_update(broadcast, row, data, local_steps, key):
        out, _ = base(broadcast, (), data, local_steps, key)
        return out, row + 1.0 + broadcast.extra

    def drift(state, new_state):  # reads the server's state, never an upload
        return 0.5 * new_state.round.astype(jnp.float32)

    alg = _seq(compose(client_update, client_state_init=lambda p: jnp.zeros((), jnp.float32),
                       client_table=table,
                       broadcast=lambda state: 10.0 * state.round.astype(jnp.float32),
                       drift=drift,
                       personal_params=lambda params, row: jax.tree.map(
                           lambda x: x * row, params)))
    assert alg.evaluates == "personal"
    apply = jax.jit(alg.apply)
    # Literally: every row drifts by the round's weighted loss, then the cohort writes
    # the row it saw (before the drift) + 1 + the broadcast 10 t.
    expected = np.zeros(N)
    state2 = alg.init(PARAMS, N)
    for r, ids in enumerate(([0, 1, 3], [1, 4, 5])):
        state2, m = apply(state2, helpers.cohort(TRAIN, ids), jax.random.fold_in(KEY, r))
        written = expected[ids] + 1.0 + 10.0 * r
        expected += 0.5 * (r + 1)
        expected[ids] = written
    got = np.asarray(alg.personal(state2, jnp.arange(N))["params"]["Dense_0"]["bias"])
    bias = np.asarray(state2.params["params"]["Dense_0"]["bias"])  # the global model
    np.testing.assert_allclose(got, expected[:, None] * bias[None], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(state2.client_states.last_round),
                                  [0, 1, -1, 0, 1, 1])


# --------------------------------------------------------------------------------------
# Bad Python inputs: refused when the algorithm is built, naming the argument.


def _factories_taking(argument: str) -> list:
    from fedjax_fair.algorithms import REGISTRY
    return [name for name in REGISTRY if argument in method_hparams(name)]


@pytest.mark.parametrize("name", _factories_taking("client_optimizer"))
@pytest.mark.parametrize("value", ["adam", 0.1, (optax.sgd(0.1),)],
                         ids=["string", "number", "tuple_of_transforms"])
def test_factories_refuse_a_client_optimizer_that_is_not_optax(name, value):
    """Every factory built on client.local_training inherits the check: not a string
    that fails later inside the run ("'str' object is not callable")."""
    from fedjax_fair.algorithms import REGISTRY
    with pytest.raises(TypeError, match="^training.optimizer: "):
        REGISTRY[name].factory(MODEL, training=ClientTraining(optimizer=value))


@pytest.mark.parametrize("name", _factories_taking("server_optimizer"))
@pytest.mark.parametrize("value", ["adam", optax.adam], ids=["string", "rate_to_transform"])
def test_factories_refuse_a_server_optimizer_that_is_not_a_transformation(name, value):
    """The server step takes no rate: a rate -> transformation factory is refused too."""
    from fedjax_fair.algorithms import REGISTRY
    with pytest.raises(TypeError, match="^server_optimizer: "):
        REGISTRY[name].factory(MODEL, server_optimizer=value)


def test_optimizers_given_as_optax_objects_are_accepted():
    cohort = helpers.cohort(TRAIN, IDS)
    for client in (None, optax.sgd, optax.adam, optax.adam(1e-3),
                   optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)):
        alg = fedavg(MODEL, training=ClientTraining(optimizer=client),
                     server_optimizer=optax.adam(0.1))
        # a round traces: the model keeps its shapes, one weight per cohort row
        state, metrics = jax.eval_shape(alg.apply, alg.init(PARAMS, N), cohort, KEY)
        chex.assert_trees_all_equal_shapes_and_dtypes(state.params, PARAMS)
        assert metrics["weights"].shape == (N,), client
    from fedjax_fair.core.types import Broadcast
    data = helpers.client(TRAIN, 0)

    def delta(update):
        out, _ = update(Broadcast(PARAMS, jnp.zeros((), jnp.int32), ()), (), data,
                        jnp.int32(2 ** 30), KEY)
        return out.delta

    default = delta(local_training(MODEL, training=ClientTraining(lr=0.1, batch_size=4)))
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(default)) > 0
    none = delta(local_training(MODEL, training=ClientTraining(lr=0.1, optimizer=None,
                                                              batch_size=4)))  # optax.sgd
    chex.assert_trees_all_equal(none, default)
    # A fixed transformation does not use client_lr, which is then not checked.
    fixed = delta(local_training(MODEL, training=ClientTraining(optimizer=optax.sgd(0.1),
                                                                lr=None, batch_size=4)))
    helpers.assert_trees_close(fixed, default, rtol=1e-6, atol=1e-7)


def test_invalid_arguments_name_their_field():
    model = helpers.logreg()
    with pytest.raises(ValueError, match=r"^q: "):
        qffl(model, q=-1.0)
    with pytest.raises(ValueError, match=r"^mode: "):
        qffl(model, mode="newton")
    with pytest.raises(ValueError, match=r"^lipschitz: "):
        qffl(model, lipschitz=0.0)
    with pytest.raises(ValueError, match=r"^lipschitz: "):
        qffl(model, mode="mixing", lipschitz=3.0)
    with pytest.raises(ValueError, match=r"^training.lr: "):
        qffl(model, training=ClientTraining(lr=0.0))
    with pytest.raises(ValueError, match=r"^weight_by_size: "):
        qffl(model, weight_by_size="false")
    with pytest.raises(ValueError, match=r"^lambda_lr: "):
        afl(model, lambda_lr=-0.1)
    with pytest.raises(ValueError, match=r"^tilt: "):
        term(model, tilt=float("inf"))
    with pytest.raises(ValueError, match=r"^beta: "):
        fedsoftmax(model, beta=float("nan"))
    with pytest.raises(ValueError, match=r"^k: "):
        fedmax_k(model, k=-1)
    # Loss-driven rules always track the pre-round loss: loss tracking cannot be
    # switched off (no factory takes a track_loss argument any more).
    for name, factory in (("qffl", qffl), ("afl", afl), ("term", term), ("propfair", propfair),
                          ("fedmax", fedmax), ("fedmax_k", fedmax_k),
                          ("fedsoftmax", fedsoftmax)):
        assert "track_loss" not in method_hparams(name), name
        with pytest.raises(TypeError, match="track_loss"):
            factory(model, track_loss=False)


# --------------------------------------------------------------------------------------
# The options every method that trains locally takes (clip_norm, clip_mode,
# client_optimizer; the clip itself is checked in tests/test_local_training.py),
# and the hyper-parameters every factory states for the command line.

# Every registered method that trains locally takes the shared options; FedEvg (a
# generative method: SGLD on synthetic data, its own grad_clip / max_grad_norm) does not.
LOCAL_TRAINING = sorted(set(_REGISTRY) - {"fedevg"})
_BUILD_EXTRA = {"lg_fedavg": dict(shared_layers=())}  # the one-layer model stays local


def test_the_methods_that_train_locally_state_the_shared_options():
    from fedjax_fair.algorithms import method_hparams
    from fedjax_fair.core.client import CLIP_NORM
    shared = ("clip_norm", "clip_mode", "client_optimizer")
    takers = {n for n in _REGISTRY if set(shared) <= set(method_hparams(n))}
    assert takers == set(LOCAL_TRAINING)
    assert not set(shared) & set(method_hparams("fedevg"))
    for name in LOCAL_TRAINING:
        hp = method_hparams(name)
        assert hp["clip_norm"].default is None and hp["clip_norm"].range == CLIP_NORM, name
        assert hp["clip_norm"].continuous and not hp["clip_norm"].python_only, name
        assert hp["clip_mode"].default == "step" and not hp["clip_mode"].python_only, name
        assert hp["client_optimizer"].default is None and hp["client_optimizer"].python_only


@pytest.mark.parametrize("name", LOCAL_TRAINING)
def test_factories_take_and_check_the_shared_local_options(name):
    """Built with a clip and an SGD-momentum client optimizer, a round traces; a
    concrete clip_norm <= 0 or an unknown clip_mode is refused at build time, naming
    the argument; a JAX array passes unchecked."""
    factory = functools.partial(_REGISTRY[name].factory, MODEL, **_BUILD_EXTRA.get(name, {}))
    momentum = lambda lr: optax.sgd(lr, momentum=0.9)
    alg = factory(training=ClientTraining(clip_norm=1.0, clip_mode="loss", optimizer=momentum,
                                          batch_size=4))
    factory(training=ClientTraining(clip_norm=jnp.float32(-1.0)))  # traced values are never compared
    for bad in (-1.0, 0.0, float("nan")):
        with pytest.raises(ValueError, match="^training.clip_norm: "):
            factory(training=ClientTraining(clip_norm=bad))
    with pytest.raises(ValueError, match="^training.clip_mode: "):
        factory(training=ClientTraining(clip_mode="gradient"))
    if name != "fedcvae":  # (its CVAE takes seconds to trace)
        cohort = helpers.cohort(TRAIN, list(range(N)))
        jax.eval_shape(alg.apply, alg.init(PARAMS, N), cohort, KEY)


CLIENT_HPARAMS = {flat: TRAINING_RANGES[field] for flat, field in FIELDS.items()
                  if field in TRAINING_RANGES}


def test_factories_state_fedavg_arguments_for_the_cli():
    """Every registered method's signature takes its local training as one
    ``training`` value (listed for the command line as FedAvg's flat arguments, with
    FedAvg's ranges) and no **kwargs; the fair rules' own hyper-parameters are
    settable from the command line."""
    expected = {"qffl": {"q", "mode", "lipschitz"}, "afl": {"lambda_lr"},
                "term": {"tilt", "weight_by_size"}, "propfair": {"baseline", "eps"},
                "fedmax": set(), "fedmax_k": {"k"}, "fedsoftmax": {"beta", "weight_by_size"}}
    for name, method in REGISTRY.items():
        params = inspect.signature(method.factory).parameters.values()
        assert not any(p.kind is p.VAR_KEYWORD for p in params), name
        assert "training" in {p.name for p in params}, name
        hparams = method_hparams(name)
        for arg, value_range in CLIENT_HPARAMS.items():
            if arg not in method.training_fields:
                # FedEvg counts its local work in local_iters (Algorithm 4.2 of the thesis
                # counts iterations) and clips its gradients with its own grad_clip /
                # max_grad_norm; APFL's and pFedMe's loops have no coupled weight decay
                assert (name, arg) in {("fedevg", "max_steps"), ("fedevg", "clip_norm"),
                                       ("apfl", "weight_decay"),
                                       ("pfedme", "weight_decay")}, (name, arg)
                assert arg not in hparams, (name, arg)
                continue
            assert arg in hparams, (name, arg)
            assert hparams[arg].range == value_range, (name, arg)
    for name, own in expected.items():
        assert own <= set(config_lib.algorithm_hparams(name)), name
        assert own | {"client_lr", "batch_size", "num_epochs"} <= set(method_hparams(name)), name
