"""Traced hyper-parameters: whole runs vmapped over, and differentiated in, the
continuous hyper-parameters of every method (hparams.py, simulate.py).

The federation is helpers.tiny_federation(): 6 clients (client 2 empty), 10
features, 3 classes. Runs are 3 rounds of ``simulate`` with the ``sequential``
execution (the fastest to compile on CPU) and a partial cohort of 4 clients, except
AAggFF-S, which needs every client every round. XLA:CPU compiles dominate this
file's run time, so every check shares as few compiled programs as it can:

* a sweep is ONE ``jit(vmap(run))`` over 8 values, compared with one ``jit(run)``
  called with each value as an array argument, and once with a factory built from a
  plain Python float (the concrete-value code path) for one of the values;
* the gradient checks compare ``jax.grad`` with central differences of the loss,
  all values from one compiled ``value_and_grad``; they run in float32 (loose
  tolerances) and in float64 (``jax.enable_x64`` for that test only, tight ones);
* every program here is compiled with LLVM's cheap pipeline (``_jit``).
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from fedjax_fair import algorithms
from fedjax_fair.scenarios import sampling
from fedjax_fair.core.algorithm import FederatedAlgorithm
from fedjax_fair.core.client import data_loss
from fedjax_fair.drivers.simulate import simulate
from fedjax_fair.core.client import ClientTraining

MODEL = helpers.logreg()
PARAMS = helpers.init_params(MODEL, 0)
DATA = helpers.tiny_federation()
N = DATA.num_clients
NUM_ROUNDS = 3
COHORT = 4  # partial participation
KEY = jax.random.key(7)
EXECUTION = "sequential"
LR, B = 0.2, 4
TRAINING = ClientTraining(lr=LR, batch_size=B)

# XLA:CPU compiles dominate this file's run time. LLVM's cheap pipeline compiles
# about 30% faster; results are IEEE arithmetic either way (no fast-math), and every
# comparison is between programs compiled alike or made at a float tolerance.
_jit = (functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0,
                                                     "xla_llvm_disable_expensive_passes": True})
        if jax.default_backend() == "cpu" else jax.jit)  # CPU (LLVM) options only


def _final_params(algorithm, params, data, *, cohort_size=COHORT, sampler=sampling.uniform,
                  num_rounds=NUM_ROUNDS, remat=False, key=KEY):
    state, _ = simulate(algorithm, algorithm.init(params, N), data, key,
                        num_rounds=num_rounds, cohort_size=cohort_size, sampler=sampler,
                        execution=EXECUTION, remat=remat)
    return state.params


def _mean_test_loss(params, data):
    """Mean loss over every client's test rows (clients weighted by their count)."""
    losses = jax.vmap(lambda d: data_loss(MODEL, params, d))(data.test)
    n = data.test.num_examples.astype(losses.dtype)
    return jnp.sum(losses * n) / jnp.sum(n)


def _row(tree, i):
    return jax.tree.map(lambda x: x[i], tree)


# ------------------------------------------------------------------ 1. vmap sweeps


class Method(NamedTuple):
    """``build(**args) -> FederatedAlgorithm`` with every continuous argument in
    ``defaults`` passed as a (possibly traced) value; ``full``: every client every
    round (sampler ``full``)."""

    build: Callable
    defaults: dict
    full: bool = False


METHODS = {
    "qffl": Method(lambda q: algorithms.qffl(MODEL, q=q, training=TRAINING),
                   dict(q=0.1)),
    "term": Method(lambda tilt: algorithms.term(MODEL, tilt=tilt, training=TRAINING),
                   dict(tilt=0.1)),
    "afl": Method(lambda lambda_lr: algorithms.afl(MODEL, lambda_lr=lambda_lr, training=TRAINING), dict(lambda_lr=0.01)),
    "propfair": Method(lambda baseline, eps: algorithms.propfair(
        MODEL, baseline=baseline, eps=eps, training=TRAINING),
        dict(baseline=2.0, eps=0.2)),
    "fedsoftmax": Method(lambda beta: algorithms.fedsoftmax(MODEL, beta=beta, training=TRAINING), dict(beta=5.0)),
    "aaggff_s": Method(lambda alpha, beta: algorithms.aaggff_s(
        MODEL, alpha=alpha, beta=beta, training=TRAINING),
        dict(alpha=0.05, beta=1.5), full=True),
    # response_range = (0, C2) with C2 traced.
    "aaggff_d": Method(lambda c2: algorithms.aaggff_d(MODEL, response_range=(0.0, c2),
                                                      training=TRAINING),
                       dict(c2=2.0 / 3.0)),
    "fedprox": Method(lambda mu: algorithms.fedprox(MODEL, mu=mu, training=TRAINING),
                      dict(mu=0.01)),
    "fedavg": Method(lambda client_lr: algorithms.fedavg(
        MODEL, training=TRAINING._replace(lr=client_lr)), dict(client_lr=LR)),
}


class Sweep(NamedTuple):
    """8 ``values`` of ``METHODS[method]``'s argument ``arg`` (the others at their
    defaults); ``concrete``: the index of the value also run with a factory built
    from plain Python floats (one sweep per method), or None."""

    method: str
    arg: str
    values: Sequence[float]
    concrete: Optional[int]

    @property
    def name(self) -> str:
        return f"{self.method}-{self.arg}"


SWEEPS = [
    Sweep("qffl", "q", (0.0, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0), concrete=0),
    Sweep("term", "tilt", (-2.0, -0.5, 0.0, 0.1, 0.5, 1.0, 2.0, 5.0), concrete=2),
    Sweep("afl", "lambda_lr", (0.0, 0.01, 0.05, 0.1, 0.3, 1.0, 3.0, 10.0), concrete=4),
    Sweep("propfair", "baseline", (1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 10.0, 100.0), concrete=1),
    Sweep("propfair", "eps", (0.05, 0.2, 0.5, 0.8, 1.0, 1.2, 1.5, 2.0), concrete=None),
    Sweep("fedsoftmax", "beta", (0.0, 0.5, 1.0, 5.0, 10.0, 15.0, 20.0, 30.0), concrete=3),
    Sweep("aaggff_s", "alpha", (0.01, 0.03, 0.1, 0.3, 1.0, 4.0, 16.0, 64.0), concrete=2),
    Sweep("aaggff_s", "beta", (0.0, 0.5, 1.5, 3.0, 6.0, 12.0, 24.0, 100.0), concrete=None),
    Sweep("aaggff_d", "c2", (0.05, 0.25, 0.5, 2.0 / 3.0, 1.0, 2.0, 5.0, 20.0), concrete=4),
    Sweep("fedprox", "mu", (0.0, 0.01, 0.1, 0.5, 1.0, 2.0, 3.0, 5.0), concrete=3),
    Sweep("fedavg", "client_lr", (0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0), concrete=5),
]

_TRACES: dict = {}


def _run_fn(method: str) -> Callable:
    """``run(args, params, data) -> final params`` of a 3-round run of ``method``."""
    spec = METHODS[method]

    def run(args, params, data):
        _TRACES[method] = _TRACES.get(method, 0) + 1
        kw = dict(cohort_size=N, sampler=sampling.full) if spec.full else {}
        return _final_params(spec.build(**args), params, data, **kw)

    return run


@functools.cache
def _programs(method: str):
    """The jitted sweep (vmap over every argument) and single run of ``method``,
    shared by all its sweeps (same shapes, new values: traced once each)."""
    run = _run_fn(method)
    return _jit(jax.vmap(run, in_axes=(0, None, None))), _jit(run)


def test_sweeps_cover_continuous_hparams():
    """Every swept argument is one the registry marks continuous (AAggFF-D's C2 is the
    upper end of the pair ``response_range``), and every method is swept."""
    for sweep in SWEEPS:
        hparam = "response_range" if sweep.arg == "c2" else sweep.arg
        hp = algorithms.method_hparams(sweep.method)[hparam]
        assert hparam == "response_range" or hp.continuous, sweep.name
    assert {s.method for s in SWEEPS} == set(METHODS)
    assert all(any(s.method == m and s.concrete is not None for s in SWEEPS) for m in METHODS)


# The default suite sweeps one client-side, one mixing-rule and one solver-driven
# hyper-parameter; the other sweeps (slow) repeat the same vmap over a whole run for
# the other methods, whose factories test_factories_accept_tracers traces by default.
DEFAULT_SWEEPS = ("fedavg-client_lr", "qffl-q", "aaggff_s-alpha")


@pytest.mark.parametrize("sweep", [
    pytest.param(s, id=s.name, marks=() if s.name in DEFAULT_SWEEPS else pytest.mark.slow)
    for s in SWEEPS])
def test_vmap_sweep_equals_separate_runs(sweep):
    spec = METHODS[sweep.method]
    sweep_fn, single = _programs(sweep.method)
    args = {k: jnp.full((8,), v, jnp.float32) for k, v in spec.defaults.items()}
    args[sweep.arg] = jnp.asarray(sweep.values, jnp.float32)

    traces = _TRACES.get(sweep.method, 0)
    swept = sweep_fn(args, PARAMS, DATA)
    # One traced program for all 8 values (and for every sweep of the method).
    assert _TRACES[sweep.method] - traces <= 1
    assert helpers.tree_all_finite(swept)

    separate = [single(_row(args, i), PARAMS, DATA) for i in range(8)]
    for i, one in enumerate(separate):
        # vmap reorders float reductions; AAggFF-S's 300-iteration QP carries that
        # rounding to ~1e-6 in the parameters (magnitudes ~0.1-0.5).
        helpers.assert_trees_close(_row(swept, i), one, rtol=1e-5, atol=1e-5)

    # The value reaches the computation: the 8 runs are not all the same.
    spread = max(helpers.tree_norm(helpers.tree_sub(one, separate[0])) for one in separate)
    assert spread > 1e-3 * helpers.tree_norm(separate[0])

    # A factory built from concrete Python floats takes the same path.
    if sweep.concrete is not None:
        i = sweep.concrete
        floats = {k: float(v[i]) for k, v in args.items()}
        floats[sweep.arg] = float(sweep.values[i])
        run = _run_fn(sweep.method)
        concrete = _jit(lambda params, data: run(floats, params, data))(PARAMS, DATA)
        helpers.assert_trees_close(concrete, separate[i], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------- 2. meta-gradients


@pytest.fixture(params=["float32", "float64"])
def dtype(request):
    """float32 with loose tolerances, and float64 (x64 enabled only for the test)."""
    if request.param == "float32":
        yield jnp.float32
        return
    with jax.enable_x64(True):
        yield jnp.float64


def _cast(tree, dtype):
    return jax.tree.map(lambda x: jnp.asarray(x, dtype)
                        if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating) else x, tree)


# (finite-difference step, rtol, atol) per dtype.
FD = {jnp.float32: (1e-2, 5e-3, 1e-4), jnp.float64: (1e-5, 1e-5, 1e-8)}


def _check_gradient(loss, args, dtype):
    """jax.grad(loss) at ``args`` (a tuple of scalars) vs central differences of the
    loss (the values from the same compiled ``value_and_grad``: one compile)."""
    step, rtol, atol = FD[dtype]
    args = tuple(jnp.asarray(a, dtype) for a in args)
    value_and_grad = _jit(jax.value_and_grad(loss, argnums=tuple(range(len(args)))))
    value, grads = value_and_grad(*args)
    assert value.dtype == dtype
    for i, g in enumerate(grads):
        assert g.dtype == dtype
        up = tuple(a + step if j == i else a for j, a in enumerate(args))
        down = tuple(a - step if j == i else a for j, a in enumerate(args))
        fd = (float(value_and_grad(*up)[0]) - float(value_and_grad(*down)[0])) / (2 * step)
        assert abs(fd) > 1e-3  # the loss depends on the argument
        np.testing.assert_allclose(float(g), fd, rtol=rtol, atol=atol)


def test_grad_client_lr_matches_finite_differences(dtype):
    params, data = _cast(PARAMS, dtype), _cast(DATA, dtype)

    def loss(lr):
        alg = algorithms.fedavg(MODEL, training=ClientTraining(lr=lr, batch_size=B))
        return _mean_test_loss(_final_params(alg, params, data), data)

    _check_gradient(loss, (LR,), dtype)


def test_grad_qffl_q_and_client_lr_match_finite_differences_with_remat(dtype):
    params, data = _cast(PARAMS, dtype), _cast(DATA, dtype)

    def loss(q, lr):
        alg = algorithms.qffl(MODEL, q=q, training=ClientTraining(lr=lr, batch_size=B))
        return _mean_test_loss(_final_params(alg, params, data, remat=True), data)

    _check_gradient(loss, (0.5, LR), dtype)


# ------------------------------------------------------ 3. round-indexed schedules


def test_client_lr_schedule_equals_per_round_rebuilt_fedavg():
    state = algorithms.fedavg(MODEL, training=ClientTraining(batch_size=B)).init(PARAMS, N)
    # one round at a time, the rate fixed for the round (one program, the rate its argument)
    one_round = jax.jit(lambda lr, s: simulate(
        algorithms.fedavg(MODEL, training=ClientTraining(lr=lr,
                                                         batch_size=B)), s, DATA, KEY, num_rounds=1,
        cohort_size=COHORT, execution=EXECUTION)[0])
    for r in range(NUM_ROUNDS):
        state = one_round(jnp.float32(0.1 * 0.9 ** r), state)
        assert int(state.round) == r + 1
    literal = state.params

    run = _jit(lambda sched, p, d: _final_params(
        algorithms.fedavg(MODEL, training=ClientTraining(lr=sched,
                                                         batch_size=B)), p, d), static_argnums=0)
    scheduled = run(lambda t: 0.1 * 0.9 ** t, PARAMS, DATA)
    helpers.assert_trees_close(scheduled, literal, rtol=1e-5, atol=1e-6)
    decayed = run(optax.exponential_decay(0.1, 1, 0.9), PARAMS, DATA)
    helpers.assert_trees_close(decayed, literal, rtol=1e-5, atol=1e-6)

    # The schedule matters: a constant 0.1 (the fedavg sweep's compiled run) gives
    # other iterates.
    constant = _programs("fedavg")[1]({"client_lr": jnp.float32(0.1)}, PARAMS, DATA)
    assert helpers.tree_norm(helpers.tree_sub(constant, literal)) > 1e-4


# ---------------------------------------------------- 4. range checks vs tracers


BAD_CONCRETE = [
    ("qffl q < 0", lambda: algorithms.qffl(MODEL, q=-1.0)),
    ("qffl q nan", lambda: algorithms.qffl(MODEL, q=math.nan)),
    ("qffl lipschitz 0", lambda: algorithms.qffl(MODEL, lipschitz=0.0)),
    ("term tilt nan", lambda: algorithms.term(MODEL, tilt=math.nan)),
    ("term tilt inf", lambda: algorithms.term(MODEL, tilt=math.inf)),
    ("fedprox mu < 0", lambda: algorithms.fedprox(MODEL, mu=-0.1)),
    ("afl lambda_lr < 0", lambda: algorithms.afl(MODEL, lambda_lr=-0.01)),
    ("propfair baseline 0", lambda: algorithms.propfair(MODEL, baseline=0.0)),
    ("propfair eps > baseline", lambda: algorithms.propfair(MODEL, baseline=1.0, eps=2.0)),
    ("fedsoftmax beta nan", lambda: algorithms.fedsoftmax(MODEL, beta=math.nan)),
    ("fedsoftmax beta < 0", lambda: algorithms.fedsoftmax(MODEL, beta=-5.0)),
    ("aaggff_s alpha 0", lambda: algorithms.aaggff_s(MODEL, alpha=0.0)),
    ("aaggff_s beta < 0", lambda: algorithms.aaggff_s(MODEL, beta=-1.0)),
    ("aaggff_d C2 < C1", lambda: algorithms.aaggff_d(MODEL, response_range=(0.5, 0.1))),
    ("aaggff_d C2 0", lambda: algorithms.aaggff_d(MODEL, response_range=(0.0, 0.0))),
    ("fedavg client_lr 0", lambda: algorithms.fedavg(MODEL, training=ClientTraining(lr=0.0))),
    ("fedavg client_lr < 0", lambda: algorithms.fedavg(MODEL, training=ClientTraining(lr=-0.1))),
]


@pytest.mark.parametrize("build", [b for _, b in BAD_CONCRETE],
                         ids=[name for name, _ in BAD_CONCRETE])
def test_factories_reject_bad_concrete_values(build):
    with pytest.raises(ValueError):
        build()


def _training_of(name, **fields):
    """``name``'s own default training with ``fields`` replaced."""
    return algorithms.default_training(name)._replace(**fields)


TRACED_FACTORIES = {
    "qffl": lambda v: algorithms.qffl(MODEL, q=v, lipschitz=v + 1.0,
                                      training=ClientTraining(lr=v + 0.1)),
    "term": lambda v: algorithms.term(MODEL, tilt=v),
    "afl": lambda v: algorithms.afl(MODEL, lambda_lr=v),
    "propfair": lambda v: algorithms.propfair(MODEL, baseline=v + 1.0, eps=v),
    "fedsoftmax": lambda v: algorithms.fedsoftmax(MODEL, beta=v),
    "aaggff_s": lambda v: algorithms.aaggff_s(MODEL, alpha=v + 1.0, beta=v),
    "aaggff_d": lambda v: algorithms.aaggff_d(MODEL, response_range=(0.0 * v, v + 1.0)),
    "fedprox": lambda v: algorithms.fedprox(MODEL, mu=v),
    "fedavg": lambda v: algorithms.fedavg(MODEL, training=ClientTraining(lr=v + 0.1,
                                                                         weight_decay=v)),
    "afedpd": lambda v: algorithms.afedpd(MODEL, rho=v,
                                          training=_training_of("afedpd", weight_decay=v)),
    "afedpd_sam": lambda v: algorithms.afedpd_sam(MODEL, rho=v + 1.0, sam_radius=v, sam_eps=v),
    "fedspeed": lambda v: algorithms.fedspeed(MODEL, rho=v, sam_radius=v),
    "feddyn": lambda v: algorithms.feddyn(MODEL, alpha=v),
    "fedcm": lambda v: algorithms.fedcm(MODEL, alpha=v),
    "fedsam": lambda v: algorithms.fedsam(MODEL, sam_radius=v),
    "fedevg": lambda v: algorithms.fedevg(MODEL, ce_weight=v, client_step=v, server_step=v,
                                          server_noise=v, grad_clip=v + 1.0,
                                          data_range=(v - 1.0, v + 1.0),
                                          training=_training_of("fedevg", lr=v + 0.1)),
    "fedcvae": lambda v: algorithms.fedcvae(MODEL, kl_weight=v,
                                            training=_training_of("fedcvae", lr=v + 0.1),
                                            data_range=(v - 1.0, v + 1.0),
                                            server_classifier_lr=v + 0.1),
}


@pytest.mark.parametrize("name", sorted(TRACED_FACTORIES))
def test_factories_accept_tracers(name):
    """Built inside vmap and grad (values are tracers, unchecked), also from values a
    concrete check would reject (a sweep's grid is the caller's business)."""
    build = TRACED_FACTORIES[name]
    built = []

    def f(v):
        built.append(isinstance(build(v), FederatedAlgorithm))
        return v * 2.0

    out = jax.vmap(f)(jnp.asarray([-1.0, 0.0, 0.5], jnp.float32))
    np.testing.assert_allclose(out, [-2.0, 0.0, 1.0])
    assert jax.grad(f)(0.3) == 2.0
    assert built == [True, True]
