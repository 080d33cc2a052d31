"""Meta-gradients (fedjax_fair/drivers/meta.py): gradients of validation objectives through
whole runs agree with finite differences in float64; the reductions match their
definitions; a meta-optimiser improves a held-out objective on built-in data.

The gradient checks run 3 rounds of ``simulate`` (``remat=True``, the default) on
helpers.tiny_federation() (6 clients, client 2 empty, 10 features, 3 classes) with a
validation split drawn like its test split; each compiles one ``value_and_grad``
with XLA:CPU's cheaper pipeline and evaluates it at x and x +- h.
"""
from __future__ import annotations

import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from fedjax_fair import algorithms
from fedjax_fair.drivers import meta
from fedjax_fair import metrics as fairness
from fedjax_fair.core.types import FederatedData
from fedjax_fair.core.client import ClientTraining

MODEL = helpers.logreg()
NUM_ROUNDS, COHORT, EXECUTION, B = 3, 4, "sequential", 4
_CHEAP = ({"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
          if jax.default_backend() == "cpu" else None)


def _federation() -> FederatedData:
    """The tiny federation with a validation split, in the default float."""
    data = helpers.tiny_federation()
    cast = lambda split: helpers.in_default_float(split, {})[0]
    return FederatedData(cast(data.train), cast(data.test),
                         cast(helpers.tiny_federation(seed=1).test))


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


# (name, build from x, x0, objective): one continuous hyper-parameter per method.
CASES = [
    ("fedavg-client_lr", lambda x: algorithms.fedavg(MODEL, training=ClientTraining(lr=x,
                                                                                    batch_size=B)), 0.2,
     meta.mean_loss),
    ("qffl-q", lambda x: algorithms.qffl(MODEL, q=x, training=ClientTraining(lr=0.2,
                                                                             batch_size=B)), 0.5,
     meta.cvar_loss(0.3)),
    ("afedpd-rho", lambda x: algorithms.afedpd(MODEL, rho=x, training=ClientTraining(lr=0.2,
                                                                                     batch_size=B)),
     0.3, meta.worst_accuracy(0.3)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_meta_gradient_matches_central_differences_float64(case, x64):
    _, build, x0, objective = case
    data = _federation()
    params = helpers.in_default_float(data.train, helpers.init_params(MODEL))[1]
    f = meta.make_objective(lambda hp: build(hp["x"]), objective, model=MODEL, data=data,
                            num_rounds=NUM_ROUNDS, cohort_size=COHORT, params=params,
                            execution=EXECUTION)
    value_and_grad = jax.jit(jax.value_and_grad(f), compiler_options=_CHEAP)
    at = lambda x: value_and_grad({"x": jnp.float64(x)}, data)
    value, grads = at(x0)
    assert value.dtype == grads["x"].dtype == jnp.float64
    h = 1e-5 * x0
    fd = (float(at(x0 + h)[0]) - float(at(x0 - h)[0])) / (2 * h)
    assert abs(fd) > 1e-4  # the objective depends on the hyper-parameter
    np.testing.assert_allclose(float(grads["x"]), fd, rtol=1e-3)


# ------------------------------------------------------------------ reductions


def test_cvar_is_the_worst_k_mean_with_a_fractional_boundary():
    v = jnp.asarray([0.3, 2.0, 0.7, 1.5, 0.1, 9.0], jnp.float32)
    mask = jnp.asarray([True, True, True, True, True, False])  # the 9.0 is left out
    real = np.asarray(v)[:5]
    # alpha * n integer: the mean of the k largest, = -worst_k(-v)
    np.testing.assert_allclose(meta.cvar(v, 0.4, mask), -fairness.worst_k(-real, 0.4),
                               rtol=1e-6)
    # fractional: k = 1.5 -> (2.0 + 0.5 * 1.5) / 1.5
    np.testing.assert_allclose(meta.cvar(v, 0.3, mask), (2.0 + 0.5 * 1.5) / 1.5, rtol=1e-6)
    # k < 1: the largest; alpha = 1: the mean
    np.testing.assert_allclose(meta.cvar(v, 0.1, mask), 2.0, rtol=1e-6)
    np.testing.assert_allclose(meta.cvar(v, 1.0, mask), real.mean(), rtol=1e-6)
    # its gradient averages the selected clients (the boundary one with its share)
    g = jax.grad(lambda x: meta.cvar(x, 0.3, mask))(v)
    np.testing.assert_allclose(g, [0, 1 / 1.5, 0, 0.5 / 1.5, 0, 0], atol=1e-6)


def test_tilted_mean_between_mean_and_max():
    v = jnp.asarray([0.3, 2.0, 0.7, 5.0], jnp.float32)
    mask = jnp.asarray([True, True, True, False])
    real = np.asarray([0.3, 2.0, 0.7])
    np.testing.assert_allclose(meta.tilted_mean(v, 1.0, mask),
                               np.log(np.mean(np.exp(real))), rtol=1e-6)
    np.testing.assert_allclose(meta.tilted_mean(v, 1e-4, mask), real.mean(), rtol=1e-3)
    np.testing.assert_allclose(meta.tilted_mean(v, 200.0, mask), real.max(), rtol=1e-2)


def test_objectives_on_scores():
    scores = meta.ClientScores(loss=jnp.asarray([1.0, 2.0, 0.0, 4.0]),
                               correct_prob=jnp.asarray([0.5, 0.25, 0.0, 0.75]),
                               accuracy=jnp.asarray([1.0, 0.0, 0.0, 1.0]),
                               num_examples=jnp.asarray([3, 2, 0, 5]))
    np.testing.assert_allclose(meta.mean_loss(scores), 7.0 / 3, rtol=1e-6)
    np.testing.assert_allclose(meta.cvar_loss(1 / 3)(scores), 4.0, rtol=1e-6)
    np.testing.assert_allclose(meta.worst_accuracy(1 / 3)(scores), -0.25, rtol=1e-6)
    np.testing.assert_allclose(meta.accuracy_std(scores), np.std([0.5, 0.25, 0.75]),
                               rtol=1e-6)
    assert float(meta.tilted_loss(0.5)(scores)) > 7.0 / 3
    assert set(meta.OBJECTIVES) == {"mean_loss", "cvar_loss", "tilted_loss", "worst_accuracy",
                                    "accuracy_std"}


def test_per_round_schedule_indexes_and_holds_the_last_value():
    schedule = meta.per_round(jnp.asarray([0.5, 1.0, 2.0]))
    assert [float(schedule(t)) for t in (0, 1, 2, 7)] == [0.5, 1.0, 2.0, 2.0]


BAD = [
    (dict(split="validation", data=helpers.tiny_federation()), ValueError, "split: "),
    (dict(split="dev"), ValueError, "split: "),
    (dict(num_rounds=0), ValueError, "num_rounds: "),
    (dict(cohort_size=7), ValueError, "cohort_size: "),
    (dict(seeds=[]), ValueError, "seeds: "),
    (dict(objective="mean_loss"), TypeError, "objective: "),
]


@pytest.mark.parametrize("kwargs,error,prefix", BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_make_objective_checks_its_arguments(kwargs, error, prefix):
    args = dict(objective=meta.mean_loss, model=MODEL, data=_federation(),
                num_rounds=NUM_ROUNDS, cohort_size=COHORT)
    args.update(kwargs)
    with pytest.raises(error, match="^" + prefix):
        meta.make_objective(lambda hp: algorithms.fedavg(MODEL), **args)


@pytest.mark.parametrize("make", [lambda: meta.cvar_loss(0.0), lambda: meta.worst_accuracy(1.5),
                                  lambda: meta.tilted_loss(-1.0)])
def test_objective_factories_check_their_argument(make):
    with pytest.raises(ValueError):
        make()


# ------------------------------------------------------------------ meta-optimisation


@functools.cache
def _digits():
    """The built-in digits federation (20 clients, Dirichlet(0.5) label skew),
    every client's rows re-split 60 / 20 / 20 into train / validation / test."""
    from fedjax_fair.data import get_dataset, resplit
    from fedjax_fair.models import logistic_regression
    ds = resplit(get_dataset("digits", num_clients=20, seed=0), (0.6, 0.2, 0.2), seed=0)
    return ds, logistic_regression(ds.input_shape, ds.num_classes)


def test_meta_optimiser_improves_held_out_worst_accuracy():
    """A per-round server learning-rate schedule of FedAvg (log rates, from FedAvg's
    1.0), learned on the smooth worst-10% validation accuracy of two seeds, raises the
    (argmax) worst-10% and mean test accuracy of three other seeds."""
    from fedjax_fair.drivers.sweeps import sweep
    ds, model = _digits()
    rounds, cohort = 10, 5

    def build(rates):
        return algorithms.fedavg(model, training=ClientTraining(lr=0.03, batch_size=10),
                                 server_optimizer=optax.sgd(meta.per_round(rates)))

    objective = meta.make_objective(lambda hp: build(jnp.exp(hp["log_lr"])),
                                    meta.worst_accuracy(0.1), model=model, data=ds,
                                    num_rounds=rounds, cohort_size=cohort, seeds=(0, 1))
    result = meta.meta_optimize(objective, {"log_lr": jnp.zeros(rounds)}, ds.data,
                                optimizer=optax.adam(0.3), num_steps=8,
                                compiler_options=_CHEAP)
    assert result.values[-1] < result.values[0]  # the training objective improved
    assert result.values.shape == (9,) and result.grad_norms.shape == (8,)
    held_out = sweep(lambda hp: build(hp["lr"]),
                     {"lr": [np.ones(rounds), np.exp(result.hparams["log_lr"])]},
                     product=False, model=model, data=ds, seeds=(5, 6, 7),
                     num_rounds=rounds, cohort_size=cohort, compiler_options=_CHEAP)
    worst = held_out.summary["accuracy_worst_10%"].mean(axis=-1)
    mean = held_out.summary["accuracy_mean"].mean(axis=-1)
    assert worst[1] > worst[0] + 0.1 and mean[1] > mean[0], (worst, mean)


# ------------------------------------------------------------------ docs/meta.md

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "meta.md"


def test_docs_table_lists_the_registrys_continuous_hyper_parameters():
    """docs/meta.md's table of differentiable arguments is the registry's."""
    rows = {}
    for line in DOCS.read_text("utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[0][1:-1] in algorithms.REGISTRY:
            rows[cells[0][1:-1]] = (re.findall(r"`(\w+)`", cells[1]),
                                    re.findall(r"`(\w+)`", cells[2]))
    assert set(rows) == set(algorithms.REGISTRY)
    for name, (continuous, static) in rows.items():
        hps = algorithms.method_hparams(name)
        assert continuous == [k for k, h in hps.items() if h.continuous], name
        assert static == [k for k, h in hps.items()
                          if h.range is not None and not h.continuous], name


@pytest.mark.slow
def test_docs_meta_snippets_run():
    """Every Python block of docs/meta.md, in order, in one namespace."""
    blocks = re.findall(r"^```python\n(.*?)^```", DOCS.read_text("utf-8"), flags=re.M | re.S)
    assert len(blocks) >= 4
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/meta.md[python {i}]", "exec"), namespace)
    assert namespace["result"].values[-1] < namespace["result"].values[0]
    worst = namespace["held_out"].summary["accuracy_worst_10%"].mean(axis=-1)
    assert worst[1] > worst[0]
