"""Tiny federations and small utilities shared by the engine, algorithm and model tests.

Everything is built with NumPy and packed straight into ``ClientData`` /
``FederatedData`` (real rows first, zero padding after), so these tests do not
depend on ``fedjax_fair.data``.

The default federation has 6 clients, 10 features and 3 classes, with unequal
client sizes including one empty client (client 2). Labels come from a linear
teacher, so the problem is linearly separable.
"""
from __future__ import annotations

from typing import Optional, Sequence

import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair.models import logistic_regression
from fedjax_fair.models.base import Model
from fedjax_fair.core.types import ClientData, ClientOutput, Cohort, FederatedData, ServerContext
from fedjax_fair.core.client import ClientTraining

NUM_FEATURES = 10
NUM_CLASSES = 3
TRAIN_SIZES = (7, 12, 0, 3, 9, 5)
TEST_SIZES = (4, 5, 0, 2, 6, 3)
EMPTY_CLIENT = 2


def client_arrays(sizes: Sequence[int], seed: int = 0, num_features: int = NUM_FEATURES,
                  num_classes: int = NUM_CLASSES, teacher_seed: int = 1234):
    """Per-client (x float32 [n, d], y int32 [n]) labelled by a fixed linear teacher.

    Clients get different feature shifts (feature heterogeneity); the teacher is the
    same for every seed, so train and test splits agree on the labelling rule.
    """
    rng = np.random.default_rng(seed)
    teacher = np.random.default_rng(teacher_seed).normal(size=(num_features, num_classes))
    out = []
    for k, n in enumerate(sizes):
        shift = 0.5 * np.random.default_rng(teacher_seed + 1 + k).normal(size=num_features)
        x = (rng.normal(size=(n, num_features)) + shift).astype(np.float32)
        y = np.argmax(x @ teacher, axis=-1).astype(np.int32)
        out.append((x, y))
    return out


def pack(arrays, padded_size: Optional[int] = None) -> ClientData:
    """Stacks per-client (x, y) into ClientData [N, M, ...] with zero padding rows."""
    sizes = [len(y) for _, y in arrays]
    m = max(sizes) if padded_size is None else padded_size
    assert m >= max(sizes) and m > 0
    d = arrays[0][0].shape[1:]
    xs = np.zeros((len(arrays), m, *d), np.float32)
    ys = np.zeros((len(arrays), m), np.int32)
    mask = np.zeros((len(arrays), m), bool)
    for k, (x, y) in enumerate(arrays):
        xs[k, :len(y)] = x
        ys[k, :len(y)] = y
        mask[k, :len(y)] = True
    return ClientData(examples={"x": jnp.asarray(xs), "y": jnp.asarray(ys)},
                      mask=jnp.asarray(mask),
                      num_examples=jnp.asarray(np.asarray(sizes, np.int32)))


def tiny_federation(train_sizes: Sequence[int] = TRAIN_SIZES,
                    test_sizes: Sequence[int] = TEST_SIZES, *, seed: int = 0,
                    padded_size: Optional[int] = None,
                    test_padded_size: Optional[int] = None) -> FederatedData:
    """The default 6-client federation (client 2 empty); ``seed`` changes the values
    but never the shapes."""
    train = client_arrays(train_sizes, seed=seed)
    test = client_arrays(test_sizes, seed=seed + 10_000)
    return FederatedData(train=pack(train, padded_size), test=pack(test, test_padded_size))


def repad(data: ClientData, padded_size: int) -> ClientData:
    """The same clients with extra zero padding rows (a larger M)."""
    m = data.mask.shape[1]
    assert padded_size >= m
    pad = padded_size - m

    def grow(v):
        return jnp.pad(v, [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2))

    return ClientData(examples={k: grow(v) for k, v in data.examples.items()},
                      mask=grow(data.mask), num_examples=data.num_examples)


def client(data: ClientData, k: int) -> ClientData:
    """Client k's row of a stacked ClientData."""
    return jax.tree.map(lambda v: v[k], data)


def real_rows(data: ClientData, ids: Sequence[int]):
    """The union of the real rows of clients ``ids``: (x [n, d], y [n]) NumPy arrays."""
    xs, ys = [], []
    for k in ids:
        n = int(data.num_examples[k])
        xs.append(np.asarray(data.examples["x"][k, :n]))
        ys.append(np.asarray(data.examples["y"][k, :n]))
    return np.concatenate(xs), np.concatenate(ys)


def cohort(data: ClientData, ids, budgets=None, mask=None) -> Cohort:
    """A Cohort of clients ``ids`` gathered from a stacked train split."""
    ids = jnp.asarray(ids, jnp.int32)
    k = ids.shape[0]
    budgets = (jnp.full((k,), 2 ** 30, jnp.int32) if budgets is None
               else jnp.asarray(budgets, jnp.int32))
    mask = jnp.ones((k,), bool) if mask is None else jnp.asarray(mask, bool)
    return Cohort(client_ids=ids, data=jax.tree.map(lambda v: v[ids], data),
                  client_mask=mask, local_steps=budgets)


def stacked_cohorts(train: ClientData, rounds) -> Cohort:
    """One ``cohort(train, ids, budgets, mask)`` per ``(ids, mask, budgets)`` of
    ``rounds``, stacked along a leading round axis (for a ``lax.scan`` over rounds)."""
    cohorts = [cohort(train, ids, budgets, mask) for ids, mask, budgets in rounds]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *cohorts)


@functools.lru_cache(maxsize=None)
def epoch_orders(epochs: int, batch_size: int):
    from fedjax_fair.core.client import epoch_order
    return jax.jit(lambda data, key: jax.vmap(
        lambda e: epoch_order(data, key, e, batch_size))(jnp.arange(epochs)))


def local_batches(train: ClientData, k: int, key, epochs: int, batch_size: int):
    """The real rows (x float64, y) of each local step of client k run by
    ``client.local_sgd`` with ``key``: epochs x ceil(n / B) steps, the last batch of
    an epoch partial (a literal reference's minibatches)."""
    n = int(train.num_examples[k])
    if n == 0:
        return []
    shuffle_key, _ = jax.random.split(key)
    orders = np.asarray(epoch_orders(epochs, batch_size)(client(train, k), shuffle_key))
    x = np.asarray(train.examples["x"][k], np.float64)
    y = np.asarray(train.examples["y"][k])
    spe = -(-n // batch_size)
    out = []
    for t in range(epochs * spe):
        e, i = divmod(t, spe)
        rows = orders[e, i * batch_size:min((i + 1) * batch_size, n)]
        assert np.all(rows < n)  # real rows only
        out.append((x[rows], y[rows]))
    return out


def scan_rounds(algorithm, state, cohorts: Cohort, keys, collect):
    """(final state, ``collect(state)`` after every round, stacked [R, ...]): the rounds
    of ``cohorts`` (stacked on a leading round axis) and ``keys`` in one ``lax.scan``."""

    def body(state, xs):
        cohort, key = xs
        state, _ = algorithm.apply(state, cohort, key)
        return state, collect(state)

    return jax.lax.scan(body, state, (cohorts, keys))


def in_default_float(train: ClientData, params):
    """``train``'s inputs and ``params`` in the current default float (float64 under
    x64; the float32 values are exact there)."""
    dtype = jnp.result_type(float)
    train = train._replace(examples={**train.examples,
                                     "x": jnp.asarray(train.examples["x"], dtype)})
    return train, jax.tree.map(lambda v: jnp.asarray(v, dtype), params)


def logreg():
    return logistic_regression((NUM_FEATURES,), NUM_CLASSES)


def init_params(model, seed: int = 0):
    """Random parameters of ``model`` drawn with NumPy (float32, LeCun-normal-like
    kernels, small biases). The shapes come from ``jax.eval_shape(model.init)``, so
    nothing is compiled: XLA:CPU takes seconds to compile a jitted flax init."""
    return random_like(jax.eval_shape(model.init, jax.random.key(0)), seed)


def random_like(shapes, seed: int = 0):
    """A pytree of NumPy-random float32 arrays with the shapes of ``shapes``."""
    rng = np.random.default_rng(seed)

    def draw(s):
        if len(s.shape) >= 2:
            scale = 1.0 / np.sqrt(np.prod(s.shape[:-1]))
        else:
            scale = 0.1
        return jnp.asarray(rng.normal(size=s.shape) * scale, s.dtype)

    return jax.tree.map(draw, shapes)


def tree_norm(tree) -> float:
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64)))
                             for x in jax.tree.leaves(tree))))


def tree_sub(a, b):
    return jax.tree.map(lambda x, y: x - y, a, b)


def assert_trees_close(actual, expected, rtol: float = 1e-5, atol: float = 1e-6):
    """Leaf-wise np.testing.assert_allclose with matching tree structures."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


def tree_all_finite(tree) -> bool:
    return all(bool(np.all(np.isfinite(np.asarray(x)))) for x in jax.tree.leaves(tree))


# --------------------------------------------------------------------------------------
# NumPy float64 reference for the logistic-regression model (logits = x W + b).


def logreg_to_numpy(params):
    """Flax logreg params -> (W [d, C], b [C]) float64."""
    p = params["params"]["Dense_0"]
    return np.asarray(p["kernel"], np.float64), np.asarray(p["bias"], np.float64)


def logreg_from_numpy(w, b, like):
    """(W, b) -> flax params with the dtypes of ``like``."""
    p = like["params"]["Dense_0"]
    return {"params": {"Dense_0": {"kernel": np.asarray(w, p["kernel"].dtype),
                                   "bias": np.asarray(b, p["bias"].dtype)}}}


def logreg_grad_numpy(w, b, x, y):
    """Gradient of the mean softmax cross-entropy over rows (x, y); 0 if no rows."""
    x = np.asarray(x, np.float64)
    if len(y) == 0:
        return np.zeros_like(w), np.zeros_like(b)
    logits = x @ w + b
    logits -= logits.max(-1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(-1, keepdims=True)
    probs[np.arange(len(y)), y] -= 1.0
    return x.T @ probs / len(y), probs.mean(0)


def logreg_gd_numpy(params, x, y, lr, steps, mu=0.0):
    """``steps`` steps of full-batch gradient descent on the mean cross-entropy plus
    (mu / 2) ||w - w0||^2, from ``params``; returns (W, b) float64."""
    w0, b0 = logreg_to_numpy(params)
    w, b = w0.copy(), b0.copy()
    for _ in range(steps):
        gw, gb = logreg_grad_numpy(w, b, x, y)
        w, b = w - lr * (gw + mu * (w - w0)), b - lr * (gb + mu * (b - b0))
    return w, b


# ------------------------------------------------------------- real-data fixtures


def fixed_getitems(label_fn=None):
    """A replacement for mocking._getitems.

    tfds 4.9.10's mock sets ``__getitems__`` as a plain attribute of a MagicMock, so
    it is called without ``self`` and fails ("missing record_keys"); ``__getitem__``
    (a real magic method) works. This version takes the keys first. ``label_fn``
    rewrites the random labels (e.g. into EMNIST letters' 1..26).
    """
    def getitems(record_keys, generator, serialized=False):
        assert not serialized
        out = []
        for k in record_keys:
            ex = dict(generator[k])
            if label_fn is not None:
                ex["label"] = label_fn(ex["label"])
            out.append(ex)
        return out
    return getitems


def mock_tfds(monkeypatch, num_examples=6, label_fn=None):
    """``tfds.testing.mock_data`` (random records, no files, no network) with the
    ``fixed_getitems`` repair; use as a context manager."""
    import tensorflow_datasets as tfds
    from tensorflow_datasets.testing import mocking
    monkeypatch.setattr(mocking, "_getitems", fixed_getitems(label_fn))
    return tfds.testing.mock_data(num_examples=num_examples,
                                  policy=tfds.testing.MockPolicy.USE_CODE)


def write_leaf(path, users, data, num_samples=None, extra_user_data=None):
    """Writes one LEAF json file: users, num_samples, user_data {u: {x, y}}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    user_data = {u: {"x": x, "y": y} for u, (x, y) in data.items()}
    user_data.update(extra_user_data or {})
    if num_samples is None:
        num_samples = [len(data[u][1]) for u in users]
    path.write_text(json.dumps({"users": users, "num_samples": num_samples,
                                "user_data": user_data}))
    return path


def bind_execution(algorithm, execution):
    """``algorithm`` whose ``apply`` uses ``execution`` (a strategy name or an
    ``Execution``) unless told otherwise."""
    def apply(state, cohort, key, execution_=None):
        return algorithm.apply(state, cohort, key, execution_ or execution)
    return algorithm._replace(apply=apply)


def with_params(client_update):
    """A client update called with plain server parameters (round 0, no extra)."""
    from fedjax_fair.core.types import Broadcast

    def call(params, client_state, data, local_steps, key):
        return client_update(Broadcast(params, jnp.zeros((), jnp.int32)), client_state, data,
                             local_steps, key)
    return call


def quadratic_model(dim: int) -> Model:
    """A 'model' whose loss on a row x = (a, b) (2 dim features) is
    f(theta) = 1/2 (theta - b)^T diag(a) (theta - b): heterogeneous quadratic clients
    whose optimum and curvature are known in closed form."""

    def loss(params, batch, key=None):
        del key
        a, b = batch["x"][:, :dim], batch["x"][:, dim:]
        return 0.5 * jnp.sum(a * jnp.square(params["theta"][None] - b), axis=-1)

    def metrics(params, batch):
        return {"loss": loss(params, batch),
                "accuracy": jnp.zeros(batch["x"].shape[:1], jnp.float32)}

    return Model(init=lambda key: {"theta": jnp.zeros((dim,), jnp.float32)},
                 apply=lambda params, x, key=None: x, per_example_loss=loss,
                 per_example_metrics=metrics, name="quadratic", input_shape=(2 * dim,),
                 num_classes=1)


# =====================================================================================
# Shared by the per-module test files (moved out of their copies there). Test files
# import these under the names they use locally, e.g.
# ``from helpers import client_output as _out``.
# =====================================================================================

# ------------------------------------- mixing-rule inputs (test_qffl, test_term, test_afl,
# test_propfair, test_fedmax, test_mixing): a round's ClientOutput and ServerContext


def client_output(losses, n=None, delta=()):
    losses = jnp.asarray(losses, jnp.float32)
    n = jnp.ones(losses.shape, jnp.int32) if n is None else jnp.asarray(n, jnp.int32)
    return ClientOutput(delta=delta, loss_before=losses, num_examples=n,
                        num_steps=jnp.zeros(losses.shape, jnp.int32), train_loss=losses)


def server_context(client_ids, client_mask):
    """The round's ServerContext for a cohort (what mixing rules and aggregators read
    here: the ids and the mask)."""
    return ServerContext(params=(), round=jnp.zeros((), jnp.int32), key=jax.random.key(0),
                         client_ids=jnp.asarray(client_ids, jnp.int32),
                         client_mask=jnp.asarray(client_mask, bool))


def full_context(k):
    return server_context(jnp.arange(k, dtype=jnp.int32), jnp.ones((k,), bool))


def rule_weights(rule, losses, n=None):
    """(weights float64 [K], new state) of one round of ``rule`` over rows 0..K-1."""
    k = len(losses)
    w, state = rule.update(rule.init(k), client_output(losses, n), full_context(k))
    return np.asarray(w, np.float64), state


# ------------------------- NumPy float64 references of the fair rules (test_simplex and
# test_afl, test_term, test_qffl, test_propfair)


def np_project_simplex(v, radius=1.0):
    """Projection by bisection on tau: sum_i max(v_i - tau, 0) = radius."""
    v = np.asarray(v, np.float64)
    lo, hi = v.min() - radius, v.max()
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if np.maximum(v - mid, 0).sum() > radius:
            lo = mid
        else:
            hi = mid
    return np.maximum(v - 0.5 * (lo + hi), 0)


def np_term(losses, n, t):
    """TERM: w_k = n_k exp(t F_k) / sum_j n_j exp(t F_j)."""
    e = np.asarray(n, np.float64) * np.exp(t * np.asarray(losses, np.float64))
    return e / e.sum()


def np_qffl_mixing(losses, n, q):
    """Thesis q-FFL: p_k = n_k F_k^q / sum_j n_j F_j^q."""
    s = np.asarray(n, np.float64) * np.asarray(losses, np.float64) ** q
    return s / s.sum()


def np_propfair(losses, n, m, eps):
    """PropFair: w_k = (n_k / max(M - F_k, eps)) / sum_j (...)."""
    s = np.asarray(n, np.float64) / np.maximum(m - np.asarray(losses, np.float64), eps)
    return s / s.sum()


# ------------------------------ the skewed federation's whole rounds (test_qffl, test_fedmax,
# test_propfair, test_mixing, test_aggregators)
# One skewed federation with the shapes of tiny_federation (6 clients, M = 12, 10
# features, 3 classes): clients 0-3 (12 examples) are labelled by a linear teacher,
# client 4 (4 examples) by the opposite teacher, client 5 is empty. No linear model fits
# both groups and FedAvg's data weights favour the majority. Clients train full-batch
# (B = 12 >= n_k), so NumPy gradient descent reproduces every local model.

SKEWED_LR, SKEWED_EPOCHS = 0.3, 2
SKEWED_TRAINING = ClientTraining(lr=SKEWED_LR, batch_size=12, num_epochs=SKEWED_EPOCHS)
SKEWED_KW = dict(training=SKEWED_TRAINING)
SKEWED_KEY = jax.random.key(7)
ALL_IDS = tuple(range(6))


def skewed_train(seed=0, sizes=(12, 12, 12, 12, 4, 0)):
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(NUM_FEATURES, NUM_CLASSES))
    arrays = []
    for k, n in enumerate(sizes):
        x = rng.normal(size=(n, NUM_FEATURES)).astype(np.float32)
        arrays.append((x, np.argmax(x @ (teacher if k < 4 else -teacher), -1).astype(np.int32)))
    return pack(arrays)


SKEWED_TRAIN = skewed_train()
SKEWED_PARAMS = init_params(logreg(), 0)


def skewed_rounds(factories):
    """The ``_rounds(name, num_rounds=1, ids=ALL_IDS, mask=None)`` of a test file whose
    algorithms are ``factories`` ({name: () -> algorithm}): each algorithm is compiled
    once (one round, sequential execution) and reused by every test of that file."""

    @functools.cache
    def compiled(name):
        alg = bind_execution(factories[name](), "sequential")
        return alg, jax.jit(alg.apply)

    def rounds(name, num_rounds=1, ids=ALL_IDS, mask=None):
        """(state, metrics of the last round) after ``num_rounds`` rounds from SKEWED_PARAMS."""
        alg, apply = compiled(name)
        state, clients = alg.init(SKEWED_PARAMS, 6), cohort(SKEWED_TRAIN, ids, mask=mask)
        for r in range(num_rounds):
            state, metrics = apply(state, clients, jax.random.fold_in(SKEWED_KEY, r))
        return state, metrics

    return rounds


@functools.cache
def skewed_np_clients():
    """Per client with data: (flat delta theta^t - theta_k, F_k(theta^t)) in float64."""
    w0, b0 = logreg_to_numpy(SKEWED_PARAMS)
    out = {}
    for k in range(6):
        x, y = real_rows(SKEWED_TRAIN, [k])
        if not len(y):
            continue
        logits = x.astype(np.float64) @ w0 + b0
        logits -= logits.max(-1, keepdims=True)
        loss = np.mean(np.log(np.exp(logits).sum(-1)) - logits[np.arange(len(y)), y])
        w, b = logreg_gd_numpy(SKEWED_PARAMS, x, y, SKEWED_LR, SKEWED_EPOCHS)
        out[k] = (np.concatenate([(w0 - w).ravel(), b0 - b]), loss)
    return out


def assert_skewed_step(params, step, rtol=1e-5, atol=1e-6):
    """params == SKEWED_PARAMS - step (flat [W, b])."""
    w0, b0 = logreg_to_numpy(SKEWED_PARAMS)
    w, b = logreg_to_numpy(params)
    np.testing.assert_allclose(w, w0 - step[:w0.size].reshape(w0.shape), rtol=rtol, atol=atol)
    np.testing.assert_allclose(b, b0 - step[w0.size:], rtol=rtol, atol=atol)


# ------------------------- full-batch rounds on tiny_federation() (test_algorithms,
# test_local_training; test_aggregators uses the first eight)

ALG_MODEL = logreg()
ALG_PARAMS = init_params(ALG_MODEL, 1)
ALG_DATA = tiny_federation()
ALG_TRAIN = ALG_DATA.train
ALG_N = ALG_DATA.num_clients
ALG_LR = 0.3
ALG_KEY = jax.random.key(3)


def sequential(alg):
    # Sequential execution compiles faster than vmap; test_execution.py ties them together.
    return bind_execution(alg, "sequential")


ALG_FULL_BATCH = 12  # >= every client's size: one step per epoch over all real rows
ALG_EPOCHS = 3
ALG_MU = 0.5
ALG_IDS = (4, 0, 2, 5, 1, 3)  # the whole federation, scrambled


def assert_logreg_close(params, wb, rtol=1e-5, atol=1e-6):
    w, b = logreg_to_numpy(params)
    np.testing.assert_allclose(w, wb[0], rtol=rtol, atol=atol)
    np.testing.assert_allclose(b, wb[1], rtol=rtol, atol=atol)


# ------------------------- the engine's FedAvg rounds on tiny_federation() (test_client,
# test_execution, test_simulate, test_runner, test_checkpoint)

ENGINE_MODEL = logreg()
ENGINE_PARAMS = init_params(ENGINE_MODEL, 0)
ENGINE_DATA = tiny_federation()
ENGINE_TRAIN = ENGINE_DATA.train
ENGINE_N = ENGINE_DATA.num_clients
ENGINE_LR, ENGINE_B, ENGINE_E = 0.5, 4, 2
UNLIMITED = 2 ** 30
ENGINE_KEY = jax.random.key(42)
# A scrambled full cohort, so slot order != client id order.
ENGINE_IDS = (3, 0, 5, 2, 1, 4)
TRAIN_SIZES_ARRAY = np.asarray(TRAIN_SIZES)  # also test_algorithms's SIZES


def engine_steps(n, b=ENGINE_B, e=ENGINE_E):
    return e * math.ceil(n / b)


def engine_fedavg(execution="vmap", chunk_size=None, **kwargs):
    from fedjax_fair.algorithms import fedavg
    from fedjax_fair.core.execution import Execution
    kw = dict(training=ClientTraining(lr=ENGINE_LR, batch_size=ENGINE_B, num_epochs=ENGINE_E))
    kw.update(kwargs)
    return bind_execution(fedavg(ENGINE_MODEL, **kw), Execution(execution, chunk_size))


# XLA:CPU compiles dominate the run time of these files, so the jitted functions that
# several tests can share (same shapes, new values) are built once.


@functools.cache
def vmap_apply():
    """The jitted vmapped FedAvg round, shared by every test using 6-client cohorts of
    the M = 12 federation: new values, same shapes, so it must trace exactly once."""
    import chex
    alg = engine_fedavg()
    return alg, jax.jit(chex.assert_max_traces(alg.apply, n=1))


def vmap_apply_on(cohort, key=ENGINE_KEY):
    alg, apply = vmap_apply()
    return apply(alg.init(ENGINE_PARAMS, ENGINE_N), cohort, key)


@functools.cache
def vmap_round():
    """FedAvg round over the scrambled full cohort, vmapped."""
    return vmap_apply_on(cohort(ENGINE_TRAIN, ENGINE_IDS))


@functools.cache
def single_client(**fields):
    """One client's jitted local SGD (sgd(ENGINE_LR), batch ENGINE_B, ENGINE_E epochs),
    ``fields`` replacing those of its ``ClientTraining``."""
    import optax
    from fedjax_fair.core.client import local_training
    training = ClientTraining(optimizer=optax.sgd(ENGINE_LR), batch_size=ENGINE_B,
                              num_epochs=ENGINE_E)._replace(**fields)
    return jax.jit(with_params(local_training(ENGINE_MODEL, training)))


# ------------------------------- checkpointed runs (test_runner, test_checkpoint; the
# reference_run fixture in conftest.py)


def counting(alg):
    """The same algorithm, counting how often its round function is traced."""
    from fedjax_fair.core.algorithm import FederatedAlgorithm
    count = [0]

    def apply(state, cohort, key, execution="auto"):
        count[0] += 1
        return alg.apply(state, cohort, key, execution)

    return FederatedAlgorithm(alg.init, apply), count


def seq_fedavg():
    return engine_fedavg(execution="sequential")  # cheaper to compile than vmap


def engine_run(alg, **kwargs):
    from fedjax_fair.drivers.runner import run
    kw = dict(model=ENGINE_MODEL, num_rounds=5, cohort_size=3, eval_every=2, progress=False)
    kw.update(kwargs)
    data = kw.pop("data", ENGINE_DATA)
    return run(alg, ENGINE_PARAMS, data, jax.random.key(5), **kw)


# Damaged checkpoint files. Their names stay private-looking: test ids are made of
# ``__name__`` (e.g. ``state.npz-_garbage``).


def _garbage(path):
    path.write_bytes(b"not a checkpoint file")


def _cut_in_half(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _npy_not_npz(path):
    with open(path, "wb") as f:
        np.save(f, np.zeros(3, np.float32))


def newest_file(directory, name) -> Path:
    """The newest committed save's file ``name``, or its log ``name``'s newest segment
    (the one that save wrote)."""
    from fedjax_fair.drivers import checkpoint as ckpt
    path = Path(ckpt.latest(str(directory))) / name
    return max(path.iterdir()) if path.is_dir() else path


# ------------------------------------- the command line (test_cli_run, test_cli_compare,
# test_cli_config)

CLI_TINY = ["--num-clients", "6", "--dataset-arg", "max_examples=100", "--cohort-size", "3",
            "--no-progress"]
CLI_DIGITS = ["--dataset", "digits", "--num-clients", "6", "--model", "mlp", "--model-arg",
              "hidden=[16]", "--cohort-size", "3", "--batch-size", "32", "--no-progress"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def latest_step(checkpoint_dir):
    """The newest committed step directory of a checkpoint (checkpoint.latest)."""
    from fedjax_fair.drivers import checkpoint as ckpt
    return ckpt.latest(str(checkpoint_dir))


def png_ok(path):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    import matplotlib.image
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def one_line_error(err, field):
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and field in lines[0], err
