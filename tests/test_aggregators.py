"""Aggregators (``core/aggregators.py``): streamed aggregation (a separable mixing
rule and an aggregator with a stream form summed as the clients finish, never
stacking the K deltas) equals the stacked round, in value, gradient and under every
execution strategy, and holds less memory; the stream sum's folding; and (slow)
FedAvg with the explicit weighted-mean aggregator equals FedAvg.

The federation is helpers.tiny_federation() (client 2 is empty), except for the
weighted-mean check, which runs on the skewed federation of helpers.skewed_train.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from helpers import (ALG_MODEL as MODEL, ALG_PARAMS as PARAMS, ALG_TRAIN as TRAIN, ALG_N as N,
                     ALG_LR as LR, ALG_KEY as KEY, sequential as _seq, SKEWED_KW, skewed_rounds)
from fedjax_fair.algorithms import fedavg
from fedjax_fair.core import mixing as mixing_lib
from fedjax_fair.core.aggregators import weighted_mean
from fedjax_fair.core.client import ClientTraining


# Streamed aggregation: a separable mixing rule and an aggregator with a stream form
# are summed as the clients finish (aggregators.Stream); the K deltas are never stacked.


def _stacked(rule):
    """``rule`` without its per-client form (nor its losses-only declaration): compose
    then stacks the K deltas."""
    return rule._replace(logit=None, losses_only=False)


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
    kw = dict(training=ClientTraining(lr=LR, batch_size=4, num_epochs=2))
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


@pytest.mark.parametrize("strategy,chunk_size", [("sequential", None), ("vmap", None),
                                                 ("chunked", 4)])
def test_rules_that_read_only_the_losses_stream_in_two_passes(strategy, chunk_size):
    """AAggFF's online rules read only ``loss_before``: the round maps every client's
    loss first, takes the weights from the rule, then sums the updates with them as
    they finish. Two rounds (the rules' state carries over) equal the stacked round:
    the same losses and weights, the parameters to float rounding."""
    from fedjax_fair.algorithms.aaggff import aaggff_d_mixing, aaggff_s_mixing
    from fedjax_fair.core.execution import Execution
    execution = Execution(strategy, chunk_size)
    rule = aaggff_d_mixing()
    assert rule.losses_only and rule.logit is None
    _assert_rounds_close(*_streamed_and_stacked(rule, weighted_mean(), execution, rounds=2))
    everyone = list(range(N))  # AAggFF-S takes every client every round
    _assert_rounds_close(*_streamed_and_stacked(aaggff_s_mixing(), weighted_mean(), execution,
                                                ids=everyone, mask=[True] * N, rounds=2))


def test_a_two_pass_round_computes_each_clients_loss_once():
    """The second pass's outputs carry the first pass's losses, so the client's own
    forward pass of the same loss is dead code that XLA drops: the compiled two-pass
    round has no more matrix products than the stacked round, which computes each
    loss once inside the client (before this, it had one more: the model's forward
    product)."""
    import re
    from fedjax_fair.algorithms.aaggff import aaggff_d_mixing
    kw = dict(training=ClientTraining(lr=LR, batch_size=4, num_epochs=2))
    cohort = helpers.cohort(TRAIN, STREAM_IDS, budgets=STREAM_BUDGETS, mask=STREAM_MASK)
    algs = [helpers.bind_execution(fedavg(MODEL, mixing=rule, aggregator=weighted_mean(),
                                          **kw), "sequential")
            for rule in (aaggff_d_mixing(), _stacked(aaggff_d_mixing()))]
    assert algs[0].streamed and not algs[1].streamed
    dots = [len(re.findall(r" dot\(", jax.jit(alg.apply).lower(
        alg.init(PARAMS, N), cohort, KEY).compile().as_text())) for alg in algs]
    assert dots[1] > 0
    assert dots[0] == dots[1]


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
            alg = fedavg(MODEL, mixing=rule, aggregator=qffl_aggregator(q, 2.0),
                         training=ClientTraining(lr=lr, batch_size=4))
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
    from fedjax_fair.algorithms.aaggff import aaggff_d_mixing
    temp = {}
    for name, rule in (("streamed", mixing_lib.by_num_examples()),
                       ("stacked", _stacked(mixing_lib.by_num_examples())),
                       ("two passes", aaggff_d_mixing())):
        alg = _seq(fedavg(model, mixing=rule, training=ClientTraining(lr=0.1, batch_size=1)))
        state = alg.init(model.init(None), k)
        compiled = jax.jit(alg.apply).lower(state, cohort, KEY).compile()
        temp[name] = compiled.memory_analysis().temp_size_in_bytes
    stacked_deltas = k * dim * 4
    assert temp["stacked"] >= stacked_deltas
    assert temp["streamed"] < stacked_deltas / 4
    assert temp["two passes"] < stacked_deltas / 4


def test_fedavg_style_methods_stream_and_rules_reading_every_update_stack():
    from fedjax_fair.algorithms import ALGORITHMS
    streamed = {"fedavg", "fedprox", "fedadam", "fedsam", "qffl", "term", "propfair",
                "fedsoftmax", "ditto"}
    streamed |= {"aaggff_d", "aaggff_s"}  # two passes: the losses, then the updates
    stacked = {"scaffold", "dqn_fed", "afl", "afedpd", "fedmgda_plus", "fedmax"}
    for name in streamed | stacked:
        assert ALGORITHMS[name](MODEL).streamed == (name in streamed), name
    assert fedavg(MODEL, mixing=_stacked(mixing_lib.by_num_examples())).streamed is False


# -------------------------------------------------------------------- the weighted mean
# The skewed federation of helpers.skewed_train (6 clients, M = 12; clients 0-3
# and client 4 labelled by opposite linear teachers, client 5 empty), full-batch.

FACTORIES = {
    "fedavg": lambda: fedavg(MODEL, **SKEWED_KW),
    "agg_mean": lambda: fedavg(MODEL, aggregator=weighted_mean(), **SKEWED_KW),
}
_rounds = skewed_rounds(FACTORIES)


@pytest.mark.slow
def test_fedavg_with_the_weighted_mean_aggregator_equals_fedavg():
    ref, _ = _rounds("fedavg")
    state, _ = _rounds("agg_mean")
    helpers.assert_trees_close(state.params, ref.params, rtol=1e-6, atol=1e-7)
