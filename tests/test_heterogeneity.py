"""Computational heterogeneity: step-budget draws, their use in rounds, FedNova averaging."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from fedjax_fair.scenarios import heterogeneity as het
from fedjax_fair.core.aggregators import step_normalized, weighted_mean
from fedjax_fair.algorithms import fedavg
from fedjax_fair.drivers.runner import run
from fedjax_fair.drivers.simulate import simulate
from fedjax_fair.core.types import ClientOutput, ServerContext
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.cli.parsing import parse_budgets

SIZES = jnp.array([7, 12, 0, 3, 9, 5])


def test_draws_respect_their_distribution():
    key = jax.random.key(0)
    np.testing.assert_array_equal(het.fixed(3).draw(key, SIZES), [3] * 6)
    # Epochs: b * ceil(n / B) steps (B = 4).
    np.testing.assert_array_equal(het.fixed(2, "epochs", 4).draw(key, SIZES),
                                  [4, 6, 0, 2, 6, 4])
    many = jnp.zeros(20000, jnp.int32)
    u = np.asarray(het.uniform(2, 5).draw(key, many))
    assert set(np.unique(u)) == {2, 3, 4, 5}
    assert abs((u == 2).mean() - 0.25) < 0.02
    s = np.asarray(het.stragglers(0.3, 1).draw(key, many))
    assert set(np.unique(s)) == {1, het.UNLIMITED_STEPS}
    assert abs((s == 1).mean() - 0.3) < 0.02
    # A new key, a new draw.
    assert not np.array_equal(u, het.uniform(2, 5).draw(jax.random.key(1), many))


@pytest.mark.parametrize("call, field", [
    (lambda: het.fixed(-1), "budget"), (lambda: het.uniform(3, 2), "high"),
    (lambda: het.stragglers(1.5, 1), "fraction"), (lambda: het.fixed(1, "hours"), "unit"),
    (lambda: het.fixed(1, "epochs"), "batch_size")])
def test_bad_budgets_name_the_field(call, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        call()


def _alg(**kw):
    return helpers.bind_execution(
        fedavg(helpers.logreg(), training=ClientTraining(lr=0.3, batch_size=2, num_epochs=2),
               **kw), "vmap")


def test_budgets_are_redrawn_every_round_inside_one_program():
    data = helpers.tiny_federation()
    alg = _alg()
    params = helpers.init_params(helpers.logreg())
    state = alg.init(params, data.num_clients)
    budgets = het.uniform(0, 3)
    sim = jax.jit(lambda s, k: simulate(alg, s, data, k, num_rounds=6, cohort_size=6,
                                        step_budgets=budgets, execution="vmap"))
    _, metrics = sim(state, jax.random.key(0))
    steps = np.asarray(metrics["num_steps"])  # [rounds, K]
    full = 2 * np.ceil(np.asarray(data.train.num_examples)[np.asarray(metrics["client_ids"])]
                       / 2)
    assert (steps <= np.minimum(3, full)).all() and (steps >= 0).all()
    assert len({tuple(r) for r in steps}) > 1  # not the same budgets every round
    # fixed(b) as a draw == the same fixed table.
    s1, _ = jax.jit(lambda s, k: simulate(alg, s, data, k, num_rounds=2, cohort_size=6,
                                          step_budgets=het.fixed(1), execution="vmap"))(state, jax.random.key(0))
    s2, _ = jax.jit(lambda s, k: simulate(alg, s, data, k, num_rounds=2, cohort_size=6,
                                          step_budgets=jnp.ones(6, jnp.int32),
                                          execution="vmap"))(
        state, jax.random.key(0))
    helpers.assert_trees_close(s1.params, s2.params)


@pytest.mark.slow
def test_streamed_placement_draws_the_same_budgets():
    data = jax.tree.map(np.asarray, helpers.tiny_federation())
    model = helpers.logreg()
    kw = dict(model=model, num_rounds=4, cohort_size=3, eval_every=2, progress=False,
              step_budgets=het.stragglers(0.5, 1), execution="vmap")
    params = helpers.init_params(model)
    device = run(_alg(), params, data, jax.random.key(2), placement="device", **kw)
    host = run(_alg(), params, data, jax.random.key(2), placement="host", **kw)
    helpers.assert_trees_close(host.state.params, device.state.params, rtol=1e-5, atol=1e-6)


def _ctx(k):
    """A ServerContext for a cohort of k clients (ids 0..k-1, all participating)."""
    return ServerContext(params=(), round=jnp.zeros((), jnp.int32), key=jax.random.key(0),
                         client_ids=jnp.arange(k, dtype=jnp.int32),
                         client_mask=jnp.ones((k,), bool))


def test_step_normalized_is_fednova_averaging():
    deltas = {"w": jnp.array([[1.0, 2.0], [3.0, -1.0], [0.0, 0.0]])}
    weights = jnp.array([0.5, 0.3, 0.2])
    steps = jnp.array([2, 6, 0])
    out = ClientOutput(delta=deltas, loss_before=jnp.zeros(3), num_examples=jnp.ones(3),
                       num_steps=steps)
    ctx = _ctx(3)
    d, _, _ = step_normalized().aggregate((), out, weights, ctx)
    tau_eff = 0.5 * 2 + 0.3 * 6
    expected = tau_eff * (0.5 * np.array([1, 2]) / 2 + 0.3 * np.array([3, -1]) / 6)
    np.testing.assert_allclose(d["w"], expected, rtol=1e-6)
    # Equal step counts: the plain weighted mean.
    same = out._replace(num_steps=jnp.array([4, 4, 4]))
    d_same, _, _ = step_normalized().aggregate((), same, weights, ctx)
    d_mean, _, _ = weighted_mean().aggregate((), same, weights, ctx)
    np.testing.assert_allclose(d_same["w"], d_mean["w"], rtol=1e-6)


def test_parse_reads_the_cli_forms():
    assert parse_budgets("none") is None
    key, n = jax.random.key(0), jnp.array([7, 12, 0])
    np.testing.assert_array_equal(parse_budgets("fixed:3").draw(key, n), [3, 3, 3])
    np.testing.assert_array_equal(parse_budgets("fixed:1:epochs", batch_size=4).draw(key, n),
                                  [2, 3, 0])
    assert parse_budgets("uniform:1:5").name == "uniform(1..5 steps)"
    assert parse_budgets("stragglers:0.25:1:epochs", batch_size=4).name.startswith("stragglers")
    for bad in ("uniform:5", "often:1", "fixed:x", "stragglers:2:1"):
        with pytest.raises(ValueError, match="^step_budgets: "):
            parse_budgets(bad, batch_size=4)
