"""Algorithm tests: FedAvg, FedProx, the FedOpt family and compose, against NumPy
float64 references and literal paper formulas.

Most rounds use full-batch clients (B = 12 >= every client's size), so each local
step is one gradient-descent step on the client's whole objective and the
reference needs no knowledge of the shuffling. The federation is
helpers.tiny_federation() (client 2 is empty).
"""
from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from fedjax_fair.core import mixing as mixing_lib
from fedjax_fair.core.aggregators import Aggregator, weighted_sum
from fedjax_fair.core.algorithm import compose
from fedjax_fair.algorithms.fedopt import scale_by_adagrad_tau
from fedjax_fair.algorithms import fedadagrad, fedadam, fedavg, fedavgm, fedprox, fedyogi
from fedjax_fair.algorithms import REGISTRY as _REGISTRY
from fedjax_fair.core.client import local_training
from fedjax_fair.core.mixing import MixingRule
from fedjax_fair.core.types import ClientOutput, ServerContext

MODEL = helpers.logreg()
PARAMS = helpers.init_params(MODEL, 1)
DATA = helpers.tiny_federation()
TRAIN = DATA.train
N = DATA.num_clients
SIZES = np.asarray(helpers.TRAIN_SIZES)
LR = 0.3
FULL_BATCH = 12  # >= every client's size: one step per epoch over all real rows
EPOCHS = 3
MU = 0.5
IDS = (4, 0, 2, 5, 1, 3)  # the whole federation, scrambled
KEY = jax.random.key(3)


def _kwargs(**extra):
    kw = dict(client_lr=LR, batch_size=FULL_BATCH, num_epochs=EPOCHS)
    kw.update(extra)
    return kw


def _seq(alg):
    # Sequential execution compiles faster than vmap; test_engine ties them together.
    return helpers.bind_execution(alg, "sequential")


def _ctx(client_ids, client_mask):
    """The ServerContext of a round with these cohort ids and mask (round 0)."""
    client_ids = jnp.asarray(client_ids, jnp.int32)
    return ServerContext(params=(), round=jnp.zeros((), jnp.int32), key=jax.random.key(0),
                         client_ids=client_ids, client_mask=jnp.asarray(client_mask, bool))


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


def _assert_logreg_close(params, wb, rtol=1e-5, atol=1e-6):
    w, b = helpers.logreg_to_numpy(params)
    np.testing.assert_allclose(w, wb[0], rtol=rtol, atol=atol)
    np.testing.assert_allclose(b, wb[1], rtol=rtol, atol=atol)


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


def test_uniform_mixing_weights():
    rule = mixing_lib.uniform()
    out = ClientOutput(delta=(), loss_before=jnp.array([3.0, 1.0, 2.0, 5.0]),
                       num_examples=jnp.array([1, 2, 3, 4]), num_steps=jnp.zeros(4, jnp.int32))
    w, _ = rule.update(rule.init(7), out, _ctx(jnp.arange(4), jnp.ones(4, bool)))
    np.testing.assert_allclose(w, np.full(4, 0.25))
    w, _ = rule.update(rule.init(7), out,
                       _ctx(jnp.arange(4), jnp.array([True, False, True, True])))
    np.testing.assert_allclose(w, [1 / 3, 0.0, 1 / 3, 1 / 3], rtol=1e-6)
    w, _ = mixing_lib.by_num_examples().update((), out, _ctx(jnp.arange(4), jnp.ones(4, bool)))
    np.testing.assert_allclose(w, np.array([1, 2, 3, 4]) / 10, rtol=1e-6)


@pytest.mark.parametrize("field, value", [
    ("mixing", "uniform"), ("aggregator", lambda state, outputs: outputs),
    ("server_optimizer", optax.adam), ("server_optimizer", "sgd")])
def test_compose_refuses_pieces_of_the_wrong_type_naming_the_argument(field, value):
    """A string rule or an uncalled optax factory fails when composed, naming the
    argument, not inside the first round's trace."""
    clients = local_training(MODEL, client_lr=0.1, batch_size=2)
    with pytest.raises(TypeError, match=f"^{field}"):
        compose(clients, **{field: value})
    with pytest.raises(TypeError, match="^client_update"):
        compose("fedavg")


def test_compose_with_custom_pieces():
    """Custom client update (with a per-client state table and extras), a stateful
    mixing rule over all N clients (uniform weights), a stateful aggregator and an
    optax server optimizer, wired by compose; checked against NumPy."""
    base = local_training(MODEL, optimizer=optax.sgd(LR), batch_size=FULL_BATCH, num_epochs=1)

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

    server_lr = 0.5
    alg = compose(client_update, mixing=MixingRule(mixing_init, mixing_update),
                  aggregator=Aggregator(agg_init, agg_aggregate),
                  server_optimizer=optax.sgd(server_lr),
                  client_state_init=lambda params: jnp.zeros((), jnp.int32))
    alg = _seq(alg)
    ids = [4, 0, 1, 0]  # slot 3 repeats client 0 but is masked out
    mask = [True, True, True, False]
    state, metrics = jax.jit(alg.apply)(alg.init(PARAMS, N),
                                        helpers.cohort(TRAIN, ids, mask=mask), KEY)

    np.testing.assert_allclose(metrics["weights"], [1 / 3, 1 / 3, 1 / 3, 0.0], rtol=1e-6)
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
    round's mean loss before the cohort writes, and the personal model is the global
    one scaled by the row. Checked against the same recursion by hand."""
    base = local_training(MODEL, optimizer=optax.sgd(LR), batch_size=FULL_BATCH, num_epochs=1)

    def client_update(broadcast, row, data, local_steps, key):
        out, _ = base(broadcast, (), data, local_steps, key)
        return out, row + 1.0 + broadcast.extra

    def drift(state, new_params, outputs, weights, ctx):
        return jnp.sum(weights * outputs.loss_before)

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
        expected += float(np.sum(np.asarray(m["weights"]) * np.asarray(m["loss_before"])))
        expected[ids] = written
    got = np.asarray(alg.personal(state2, jnp.arange(N))["params"]["Dense_0"]["bias"])
    bias = np.asarray(state2.params["params"]["Dense_0"]["bias"])  # the global model
    np.testing.assert_allclose(got, expected[:, None] * bias[None], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(state2.client_states.last_round),
                                  [0, 1, -1, 0, 1, 1])


# --------------------------------------------------------------------------------------
# Bad Python inputs: refused when the algorithm is built, naming the argument.


def _factories_taking(argument: str) -> list:
    import inspect
    from fedjax_fair.algorithms import REGISTRY
    return [name for name, entry in REGISTRY.items()
            if argument in inspect.signature(entry.factory).parameters]


@pytest.mark.parametrize("name", _factories_taking("client_optimizer"))
@pytest.mark.parametrize("value", ["adam", 0.1, (optax.sgd(0.1),)],
                         ids=["string", "number", "tuple_of_transforms"])
def test_factories_refuse_a_client_optimizer_that_is_not_optax(name, value):
    """Every factory built on fedavg.client_training inherits the check: not a string
    that fails later inside the run ("'str' object is not callable")."""
    from fedjax_fair.algorithms import REGISTRY
    with pytest.raises(TypeError, match="^client_optimizer: "):
        REGISTRY[name].factory(MODEL, client_optimizer=value)


@pytest.mark.parametrize("name", _factories_taking("server_optimizer"))
@pytest.mark.parametrize("value", ["adam", optax.adam], ids=["string", "rate_to_transform"])
def test_factories_refuse_a_server_optimizer_that_is_not_a_transformation(name, value):
    """The server step takes no rate: a rate -> transformation factory is refused too."""
    from fedjax_fair.algorithms import REGISTRY
    with pytest.raises(TypeError, match="^server_optimizer: "):
        REGISTRY[name].factory(MODEL, server_optimizer=value)


def test_optimizers_given_as_optax_objects_are_accepted():
    for client in (None, optax.sgd, optax.adam, optax.adam(1e-3),
                   optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)):
        fedavg(MODEL, client_optimizer=client, server_optimizer=optax.adam(0.1))
    local_training(MODEL, optimizer=None, batch_size=4)  # None: optax.sgd
    # A fixed transformation does not use client_lr, which is then not checked.
    local_training(MODEL, optimizer=optax.sgd(0.1), client_lr=None, batch_size=4)


@pytest.mark.parametrize("value", [-1.0, 0.0, float("nan"), float("inf"), "0.1", True],
                         ids=repr)
def test_local_training_checks_a_concrete_client_lr(value):
    with pytest.raises(ValueError, match="^client_lr: "):
        local_training(MODEL, client_lr=value, batch_size=4)


def test_local_training_refuses_an_optimizer_that_is_not_optax():
    with pytest.raises(TypeError, match="^optimizer: "):
        local_training(MODEL, optimizer="adam", batch_size=4)


def test_local_training_lets_schedules_and_traced_rates_through():
    """A schedule and a JAX array pass unchecked (never a Python comparison on a
    tracer): the client update is differentiable in a traced client_lr."""
    from fedjax_fair.core.types import Broadcast
    local_training(MODEL, client_lr=lambda t: -1.0, batch_size=4)  # evaluated per round
    local_training(MODEL, client_lr=jnp.float32(-1.0), batch_size=4)
    data = helpers.client(TRAIN, 0)

    def loss_after(lr):
        update = local_training(MODEL, client_lr=lr, batch_size=FULL_BATCH)
        out, _ = update(Broadcast(PARAMS, jnp.zeros((), jnp.int32), ()), (), data,
                        jnp.int32(2 ** 30), KEY)
        return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(out.delta))

    grad = jax.grad(loss_after)(jnp.float32(LR))
    assert np.isfinite(float(grad)) and float(grad) > 0.0


@pytest.mark.parametrize("value", [-1.0, -1e-9, float("nan"), "0.1", None], ids=repr)
def test_proximal_term_checks_a_concrete_mu(value):
    from fedjax_fair.core.client import proximal_term
    with pytest.raises(ValueError, match="^mu: "):
        proximal_term(value)


def test_proximal_term_is_differentiable_and_vmappable_in_a_traced_mu():
    """mu as a tracer skips the check: d/dmu (mu / 2) ||w - w^t||^2 = ||w - w^t||^2 / 2,
    under jax.grad and jax.vmap alike (mu = 0 is allowed, as FedAvg)."""
    from fedjax_fair.core.client import proximal_term
    from fedjax_fair.core.types import Broadcast
    proximal_term(0.0)
    proximal_term(np.float32(0.5))
    params = {"w": jnp.array([1.0, 2.0, 3.0])}
    broadcast = Broadcast({"w": jnp.array([0.0, 2.0, 5.0])}, jnp.zeros((), jnp.int32), ())
    term = lambda mu: proximal_term(mu)(params, broadcast, ())
    np.testing.assert_allclose(jax.grad(term)(jnp.float32(0.3)), 0.5 * (1.0 + 4.0))
    np.testing.assert_allclose(jax.vmap(term)(jnp.array([0.0, 1.0, 2.0])), [0.0, 2.5, 5.0])
    # Through a whole FedProx client update: the local model depends on mu.
    data = helpers.client(TRAIN, 0)

    def moved(mu):
        update = local_training(MODEL, client_lr=LR, batch_size=FULL_BATCH, num_epochs=EPOCHS,
                                regularizer=proximal_term(mu))
        out, _ = update(Broadcast(PARAMS, jnp.zeros((), jnp.int32), ()), (), data,
                        jnp.int32(2 ** 30), KEY)
        return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(out.delta))

    assert float(jax.grad(moved)(jnp.float32(MU))) < 0.0  # a stronger pull moves less


# ------------------------------------------------------------------------------------
# Gradient clipping of the local steps (client.local_sgd: clip_norm, clip_mode) and the
# options every method that trains locally takes (clip_norm, clip_mode,
# client_optimizer).

CLIP_MU, CLIP_WD, CLIP_STEPS = 2.0, 0.05, 4
# LLVM's cheap pipeline (as tests/test_traced.py): XLA:CPU compiles dominate these tests.
CHEAP_COMPILE = ({"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
                 if jax.default_backend() == "cpu" else None)


def _clip_np(grads, c):
    """grads scaled by min(1, c / ||grads||), the norm over the (W, b) pair."""
    norm = np.sqrt(sum(np.sum(g ** 2) for g in grads))
    return tuple(g * min(1.0, c / norm) for g in grads), norm


def _clipped_numpy(start, anchor, x, y, lr, c, mode):
    """CLIP_STEPS full-batch steps on CE + (mu / 2) ||p - anchor||^2 with coupled weight
    decay wd: "step" p -= lr (clip(g + mu (p - anchor)) + wd p), "loss" p -= lr (clip(g)
    + mu (p - anchor) + wd p). Also returns the norms the clip saw."""
    p, seen = start, []
    for _ in range(CLIP_STEPS):
        g = helpers.logreg_grad_numpy(p[0], p[1], x, y)
        reg = tuple(CLIP_MU * (a - b) for a, b in zip(p, anchor))
        if mode == "step":
            g, norm = _clip_np(tuple(u + r for u, r in zip(g, reg)), c)
        else:
            g, norm = _clip_np(g, c)
            g = tuple(u + r for u, r in zip(g, reg))
        seen.append(norm)
        p = tuple(q - lr * (u + CLIP_WD * q) for q, u in zip(p, g))
    return p, seen


def _clipped_update(clip_norm, clip_mode, start_params):
    """One client's FedProx-style local training from ``start_params`` (not the
    broadcast, so the proximal term pulls from the first step)."""
    from fedjax_fair.core.client import proximal_term
    return local_training(MODEL, client_lr=LR, batch_size=FULL_BATCH, num_epochs=CLIP_STEPS,
                          regularizer=proximal_term(CLIP_MU), weight_decay=CLIP_WD,
                          start=lambda broadcast, state: start_params,
                          clip_norm=clip_norm, clip_mode=clip_mode)


@pytest.mark.parametrize("mode", ["step", "loss"])
def test_clipped_local_steps_equal_a_numpy_reference(mode):
    """Both clip forms against a literal float64 reference, the clip active at every
    step, the proximal term present (so the forms differ) and the weight decay added
    after the clip."""
    from fedjax_fair.core.types import Broadcast
    k = 1  # 12 rows: one full batch a step
    x, y = helpers.real_rows(TRAIN, [k])
    start = helpers.random_like(PARAMS, 5)
    anchor_np, start_np = helpers.logreg_to_numpy(PARAMS), helpers.logreg_to_numpy(start)
    g0 = helpers.logreg_grad_numpy(*start_np, x, y)
    clip = 0.3 * float(np.sqrt(sum(np.sum(g ** 2) for g in g0)))
    expected, norms = _clipped_numpy(start_np, anchor_np, x, y, LR, clip, mode)
    assert min(norms) > 1.2 * clip  # the clip is active at every step
    other, _ = _clipped_numpy(start_np, anchor_np, x, y, LR, clip,
                              "loss" if mode == "step" else "step")
    assert np.abs(expected[0] - other[0]).max() > 1e-3  # the two forms differ here

    broadcast = Broadcast(PARAMS, jnp.zeros((), jnp.int32), ())
    update = jax.jit(_clipped_update(clip, mode, start))
    out, _ = update(broadcast, (), helpers.client(TRAIN, k), jnp.int32(2 ** 30), KEY)
    assert int(out.num_steps) == CLIP_STEPS
    trained = jax.tree.map(jnp.subtract, PARAMS, out.delta)
    _assert_logreg_close(trained, expected, rtol=2e-5, atol=2e-6)


def test_clip_norm_none_builds_the_program_without_the_option():
    """clip_norm=None: the same compiled program as the local steps had before the
    option (weight decay joined to the regularizer), so the iterates are bit-identical;
    a clip that never binds gives the same iterates to float rounding."""
    from fedjax_fair.core.client import local_sgd, proximal_term, with_weight_decay
    prox = proximal_term(CLIP_MU)
    reg = lambda p, b: prox(p, b, ())
    data = helpers.client(TRAIN, 1)
    from fedjax_fair.core.types import Broadcast
    broadcast = Broadcast(PARAMS, jnp.zeros((), jnp.int32), ())
    start = helpers.random_like(PARAMS, 5)

    def program(train):
        fn = jax.jit(lambda p: train(p, optax.sgd(LR), data, jnp.int32(2 ** 30), KEY,
                                     (broadcast,)))
        return fn.lower(start).as_text(), fn(start)[0]

    kw = dict(batch_size=4, num_epochs=2)
    before = program(local_sgd(MODEL, regularizer=with_weight_decay(reg, CLIP_WD), **kw))
    now = program(local_sgd(MODEL, regularizer=reg, weight_decay=CLIP_WD, clip_norm=None, **kw))
    assert now[0] == before[0]
    chex.assert_trees_all_equal(now[1], before[1])
    loose = program(local_sgd(MODEL, regularizer=reg, weight_decay=CLIP_WD, clip_norm=1e6,
                              clip_mode="loss", **kw))
    assert loose[0] != before[0]
    helpers.assert_trees_close(loose[1], before[1], rtol=1e-6, atol=1e-7)


def test_clip_by_global_norm_matches_optax_and_is_finite_at_zero():
    """The rule of optax.clip_by_global_norm, but NaN-free in reverse mode through a
    zero gradient (an all-masked batch), with bfloat16 leaves and a traced bound."""
    from fedjax_fair.core.client import clip_by_global_norm
    tree = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([[12.0]])}  # norm 13
    for c in (1.0, 13.0, 20.0):
        mine = clip_by_global_norm(tree, c)
        ref, _ = optax.clip_by_global_norm(c).update(tree, None)
        helpers.assert_trees_close(mine, ref, rtol=1e-6, atol=0)
    chex.assert_trees_all_equal(clip_by_global_norm(tree, 20.0), tree)  # exactly 1 below c
    zero_grad = jax.grad(lambda x: jnp.sum(clip_by_global_norm({"a": 0.0 * x}, 1.0)["a"]))(
        jnp.ones(3))
    assert np.all(np.isfinite(zero_grad))
    half = jax.jit(clip_by_global_norm)(jax.tree.map(lambda v: v.astype(jnp.bfloat16), tree),
                                        jnp.float32(6.5))
    assert half["a"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(half["b"], np.float32), [[6.0]], rtol=1e-2)


def test_clip_norm_is_differentiable_and_vmappable_through_rounds():
    """A traced clip_norm: jax.vmap over it equals separate runs, and jax.grad of the
    squared norm of the model after a FedProx round (vmap execution: clients past
    their step count take masked steps with a zero loss gradient; "loss" form) is
    finite and matches central differences (float64)."""
    with jax.enable_x64(True):
        train, params = helpers.in_default_float(TRAIN, PARAMS)
        cohort = helpers.cohort(train, (0, 1, 3, 2), (2 ** 30, 2, 2 ** 30, 2 ** 30))

        def final_norm(c):
            alg = helpers.bind_execution(
                fedprox(MODEL, mu=MU, client_lr=LR, batch_size=4, num_epochs=2, clip_norm=c,
                        clip_mode="loss"), "vmap")
            state, _ = alg.apply(alg.init(params, N), cohort, KEY)
            return sum(jnp.sum(jnp.square(v)) for v in jax.tree.leaves(state.params))

        values = jnp.array([0.05, 0.2, 1e3])
        cheap = functools.partial(jax.jit, compiler_options=CHEAP_COMPILE)
        value_and_grad = cheap(jax.value_and_grad(final_norm))
        swept = cheap(jax.vmap(final_norm))(values)
        separate = [value_and_grad(v) for v in values]
        np.testing.assert_allclose(swept, [float(v) for v, _ in separate], rtol=1e-12)
        assert abs(float(separate[0][0]) - float(separate[2][0])) > 1e-3  # the clip binds
        step = 1e-6
        for c, (_, g) in zip(values[:2], separate[:2]):
            assert np.isfinite(float(g)) and abs(float(g)) > 1e-3
            up, down = value_and_grad(c + step)[0], value_and_grad(c - step)[0]
            np.testing.assert_allclose(float(g), (float(up) - float(down)) / (2 * step),
                                       rtol=1e-6)
        assert float(separate[2][1]) == 0.0  # a clip that never binds: no dependence


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
    alg = factory(clip_norm=1.0, clip_mode="loss", client_optimizer=momentum, batch_size=4)
    factory(clip_norm=jnp.float32(-1.0))  # traced values are never compared
    for bad in (-1.0, 0.0, float("nan")):
        with pytest.raises(ValueError, match="^clip_norm: "):
            factory(clip_norm=bad)
    with pytest.raises(ValueError, match="^clip_mode: "):
        factory(clip_mode="gradient")
    if name != "fedcvae":  # (its CVAE takes seconds to trace)
        cohort = helpers.cohort(TRAIN, list(range(N)))
        jax.eval_shape(alg.apply, alg.init(PARAMS, N), cohort, KEY)


# ------------------------------------------------------------------------------------
# Engine fast paths (benchmarks/step_overhead.py): the same batches and the same
# results as the plain paths.

def _argsort_epoch_order(data, shuffle_key, epoch, batch_size):
    """The epoch order's definition: the stable argsort of the scores, padded rows 2."""
    padded = data.mask.shape[0]
    scores = jax.random.uniform(jax.random.fold_in(shuffle_key, epoch), (padded,))
    order = jnp.argsort(jnp.where(data.mask, scores, 2.0), stable=True)
    return jnp.pad(order, (0, -(-padded // batch_size) * batch_size - padded))


@pytest.mark.parametrize("padded", [1, 7, 200, 256, 300])  # 300: the argsort itself
def test_epoch_order_is_the_stable_argsort_of_the_scores(padded):
    """``epoch_order`` (one packed uint32 sort for M <= 256) equals the stable argsort
    of the uniform scores for every client size, empty and full clients included,
    under vmap; 400 clients of 256 rows also meet a few tied scores on average."""
    from fedjax_fair.core import client as client_lib
    from fedjax_fair.core.types import ClientData
    num = 400
    n = jnp.asarray(np.random.default_rng(padded).integers(0, padded + 1, num), jnp.int32)
    n = n.at[:2].set(jnp.asarray([0, padded], jnp.int32))
    data = ClientData({}, jnp.arange(padded)[None] < n[:, None], n)
    keys = jax.random.split(jax.random.key(padded), num)
    for fn_epoch in (0, 3):
        got = jax.jit(jax.vmap(lambda d, k: client_lib.epoch_order(d, k, fn_epoch, 20)))(
            data, keys)
        want = jax.jit(jax.vmap(lambda d, k: _argsort_epoch_order(d, k, fn_epoch, 20)))(
            data, keys)
        np.testing.assert_array_equal(got, want)


def test_epoch_order_breaks_tied_scores_by_row(monkeypatch):
    """Tied scores keep their rows in order (a stable sort), in the packed sort too."""
    from fedjax_fair.core import client as client_lib
    from fedjax_fair.core.types import ClientData
    tied = lambda key, shape: (jnp.arange(shape[0]) * 7 % 5).astype(jnp.float32) / 8
    monkeypatch.setattr(jax.random, "uniform", tied)
    for padded, n in ((12, 9), (256, 200), (300, 250)):
        data = ClientData({}, jnp.arange(padded) < n, jnp.int32(n))
        got = client_lib.epoch_order(data, jax.random.key(0), 0, 4)
        want = _argsort_epoch_order(data, jax.random.key(0), 0, 4)
        np.testing.assert_array_equal(got, want)
        assert sorted(np.asarray(got[:n]).tolist()) == list(range(n))


@pytest.mark.parametrize("image", [False, True], ids=["rows", "image_rows"])
def test_batches_gathered_before_the_loop_give_the_same_round(image, monkeypatch):
    """A lone client whose batches fit in its rows gathers them before its step loop
    (``client.PREGATHER``), from a [M, -1] view of image-shaped examples: the round
    (parameters, metrics, train losses) and its gradient in the client learning rate
    equal the in-loop gather's exactly, with step budgets and an empty client."""
    from fedjax_fair.core import client as client_lib
    train = TRAIN
    if image:  # [N, M, d] -> [N, M, 2, d / 2, 1]: the model flattens its input
        x = train.examples["x"]
        train = train._replace(examples={**train.examples, "x": x.reshape(
            *x.shape[:2], 2, x.shape[-1] // 2, 1)})
    cohort = helpers.cohort(train, IDS, budgets=[3, 2, 0, 1, 3, 3])

    def run(lr):
        alg = _seq(fedavg(MODEL, client_lr=lr, batch_size=2, num_epochs=2, max_steps=3))
        state, metrics = alg.apply(alg.init(PARAMS, N), cohort, KEY)
        return state.params, metrics

    def loss_after(lr):
        params, _ = run(lr)
        return sum(jnp.sum(jnp.square(v)) for v in jax.tree.leaves(params))

    assert 3 * 2 <= train.mask.shape[1]  # the batches fit: the pregathered path runs
    fast = jax.jit(run)(jnp.float32(LR)), jax.grad(loss_after)(jnp.float32(LR))
    monkeypatch.setattr(client_lib, "PREGATHER", False)
    plain = jax.jit(run)(jnp.float32(LR)), jax.grad(loss_after)(jnp.float32(LR))
    chex.assert_trees_all_equal(fast, plain)


# --------------------------------------------------------------------------------------
# Streamed aggregation: a separable mixing rule and an aggregator with a stream form
# are summed as the clients finish (aggregators.Stream); the K deltas are never stacked.


def _stacked(rule):
    """``rule`` without its per-client form: compose then stacks the K deltas."""
    return rule._replace(logit=None)


def _stream_cases():
    from fedjax_fair.core.aggregators import step_normalized, weighted_mean
    from fedjax_fair.algorithms.fedmax import fedsoftmax_mixing
    from fedjax_fair.algorithms.propfair import propfair_mixing
    from fedjax_fair.algorithms.qffl import prior_mixing, qffl_aggregator, qffl_mixing
    from fedjax_fair.algorithms.term import term_mixing
    return {
        "fedavg": (mixing_lib.by_num_examples(), weighted_mean()),
        "uniform": (mixing_lib.uniform(), weighted_mean()),
        "qffl": (prior_mixing(False), qffl_aggregator(0.5, lambda t: 2.0 / (1.0 + t))),
        "qffl_sized": (prior_mixing(True), qffl_aggregator(2.0, 3.0)),
        "qffl_mixing": (qffl_mixing(1.0), weighted_mean()),
        "term": (term_mixing(0.5), weighted_mean()),
        "propfair": (propfair_mixing(2.0), weighted_mean()),
        "fedsoftmax": (fedsoftmax_mixing(2.0), weighted_mean()),
        "fednova": (mixing_lib.by_num_examples(), step_normalized()),
    }


STREAM_IDS = [4, 0, 2, 1, 5, 0]  # client 2 is empty; slot 5 repeats client 0, masked
STREAM_MASK = [True, True, True, True, True, False]
STREAM_BUDGETS = [1, 3, 2, 2, 1, 3]  # unequal local work (FedNova's case)


def _streamed_and_stacked(mixing, aggregator, execution, ids=STREAM_IDS, mask=STREAM_MASK,
                          rounds=1):
    """The last of ``rounds`` rounds (two: the second at t = 1, for round schedules),
    streamed and stacked."""
    kw = dict(client_lr=LR, batch_size=4, num_epochs=2)
    cohort = helpers.cohort(TRAIN, ids, budgets=STREAM_BUDGETS[:len(ids)], mask=mask)
    out = []
    for rule in (mixing, _stacked(mixing)):
        alg = helpers.bind_execution(fedavg(MODEL, mixing=rule, aggregator=aggregator, **kw),
                                     execution)
        apply = jax.jit(alg.apply)
        state = alg.init(PARAMS, N)
        for t in range(rounds - 1):
            state, _ = apply(state, cohort, jax.random.fold_in(KEY, t))
        out.append(apply(state, cohort, jax.random.fold_in(KEY, rounds - 1)))
    return out


def _assert_rounds_close(streamed, stacked):
    (s1, m1), (s2, m2) = streamed, stacked
    helpers.assert_trees_close(s1.params, s2.params, rtol=1e-5, atol=1e-6)
    assert set(m1) == set(m2)
    for name in m1:
        np.testing.assert_allclose(m1[name], m2[name], rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("name", sorted(_stream_cases()))
def test_streamed_round_equals_the_stacked_round(name):
    mixing, aggregator = _stream_cases()[name]
    assert mixing.logit is not None and aggregator.stream is not None
    rounds = 2 if name == "qffl" else 1  # its Lipschitz constant is a round schedule
    _assert_rounds_close(*_streamed_and_stacked(mixing, aggregator, "sequential", rounds=rounds))


@pytest.mark.parametrize("strategy,chunk_size", [("vmap", None), ("chunked", 4),
                                                 ("bucketed", 4)])
def test_streamed_round_equals_the_stacked_round_under_every_strategy(strategy, chunk_size):
    from fedjax_fair.core.execution import Execution
    mixing, aggregator = _stream_cases()["qffl"]
    _assert_rounds_close(*_streamed_and_stacked(mixing, aggregator,
                                                Execution(strategy, chunk_size)))


@pytest.mark.parametrize("name", ["fedavg", "uniform", "term"])
def test_streamed_fall_backs_equal_the_stacked_rules(name):
    # every participant is empty: the rules fall back to uniform over the cohort
    mixing, aggregator = _stream_cases()[name]
    streamed, stacked = _streamed_and_stacked(mixing, aggregator, "sequential",
                                              ids=[2, 2, 3], mask=[True, True, False])
    _assert_rounds_close(streamed, stacked)
    np.testing.assert_allclose(streamed[1]["weights"], [0.5, 0.5, 0.0])


def test_stream_sum_folds_in_any_grouping_without_overflow():
    from fedjax_fair.core.aggregators import STREAM_SUM, ratio
    tiers = jnp.array([3, 3, 2, 3, -1, 3, 2], jnp.int32)
    # logits 2000 apart: a plain exp would overflow; -inf takes no weight
    logits = jnp.array([1000.0, -1000.0, 5.0, 999.0, 7.0, -jnp.inf, 0.0])
    values = jnp.arange(7.0) + 1.0
    batch = (tiers, logits, (values, jnp.ones(7)))
    whole = STREAM_SUM.fold(batch)
    take = lambda rows: jax.tree.map(lambda v: v[np.asarray(rows)], batch)
    parts = [STREAM_SUM.fold(take(rows)) for rows in ([4, 2, 0], [6, 1], [5, 3])]
    stacked = jax.tree.map(lambda *v: jnp.stack(v), *parts)
    nested = STREAM_SUM.fold(stacked)
    empty = STREAM_SUM.empty(jax.tree.map(lambda v: v[0], batch))
    with_empty = STREAM_SUM.fold(jax.tree.map(lambda e, w: jnp.stack([e, w]), empty, whole))
    weights = mixing_lib.tiered_softmax(tiers, logits)
    np.testing.assert_allclose(weights, [1 / (1 + np.exp(-1.0)), 0, 0, 1 / (1 + np.e), 0, 0, 0],
                               rtol=1e-6)
    for folded in (whole, nested, with_empty):
        assert int(folded[0]) == 3
        np.testing.assert_allclose(ratio(*folded[2]), jnp.dot(weights, values), rtol=1e-6)


def test_stream_sum_of_no_weighted_client_is_zero():
    from fedjax_fair.core.aggregators import STREAM_SUM, ratio
    batch = (jnp.array([-1, 3, 3]), jnp.array([0.0, -jnp.inf, -jnp.inf]),
             (jnp.array([5.0, 6.0, 7.0]), jnp.ones(3)))
    np.testing.assert_array_equal(ratio(*STREAM_SUM.fold(batch)[2]), 0.0)


def test_streamed_round_differentiates_like_the_stacked_round():
    from fedjax_fair.algorithms.qffl import prior_mixing, qffl_aggregator
    cohort = helpers.cohort(TRAIN, STREAM_IDS, mask=STREAM_MASK)

    def loss_of(rule):
        def loss(q, lr):
            alg = fedavg(MODEL, mixing=rule, aggregator=qffl_aggregator(q, 2.0), client_lr=lr,
                         batch_size=4)
            state, _ = _seq(alg).apply(alg.init(PARAMS, N), cohort, KEY)
            return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(state.params))
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(0.7, 0.3)

    rule = prior_mixing(True)
    np.testing.assert_allclose(loss_of(rule), loss_of(_stacked(rule)), rtol=1e-4)


def test_streamed_round_does_not_hold_every_clients_update():
    # K = 128 clients of a 4096-parameter model, one example each: the stacked round
    # holds [K, d] deltas (2 MiB) in its temporaries, the streamed one does not
    from fedjax_fair.core.types import ClientData, Cohort
    k, dim = 128, 4096
    model = helpers.quadratic_model(dim)
    x = jax.random.uniform(jax.random.key(0), (k, 1, 2 * dim))
    data = ClientData({"x": x, "y": jnp.zeros((k, 1), jnp.int32)}, jnp.ones((k, 1), bool),
                      jnp.ones((k,), jnp.int32))
    cohort = Cohort(jnp.arange(k, dtype=jnp.int32), data, jnp.ones((k,), bool),
                    jnp.full((k,), 4, jnp.int32))
    temp = {}
    for name, rule in (("streamed", mixing_lib.by_num_examples()),
                       ("stacked", _stacked(mixing_lib.by_num_examples()))):
        alg = _seq(fedavg(model, mixing=rule, batch_size=1, client_lr=0.1))
        state = alg.init(model.init(None), k)
        compiled = jax.jit(alg.apply).lower(state, cohort, KEY).compile()
        temp[name] = compiled.memory_analysis().temp_size_in_bytes
    stacked_deltas = k * dim * 4
    assert temp["stacked"] >= stacked_deltas
    assert temp["streamed"] < stacked_deltas / 4


def test_fedavg_style_methods_stream_and_rules_reading_every_update_stack():
    from fedjax_fair.algorithms import ALGORITHMS
    streamed = {"fedavg", "fedprox", "fedadam", "fedsam", "qffl", "term", "propfair",
                "fedsoftmax", "ditto"}
    stacked = {"scaffold", "dqn_fed", "afl", "aaggff_d", "afedpd", "fedmgda_plus", "fedmax"}
    for name in streamed | stacked:
        assert ALGORITHMS[name](MODEL).streamed == (name in streamed), name
    assert fedavg(MODEL, mixing=_stacked(mixing_lib.by_num_examples())).streamed is False
