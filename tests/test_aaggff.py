"""AAggFF-S / AAggFF-D tests (Hahn, UNIST 2024 thesis, Ch. III; arXiv:2405.20821): the
mixing rules' shared properties against literal NumPy float64 references
(tests/aaggff_common.py), a few end-to-end rounds on helpers.tiny_federation() and the
API. The response transforms, solvers, ONS / FTRL updates and regret guarantees:
tests/test_aaggff_mixing.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from fedjax_fair.core import mixing as mixing_lib
from fedjax_fair.scenarios import sampling
from fedjax_fair.solvers import online
from fedjax_fair.algorithms import REGISTRY, method_hparams
from fedjax_fair.algorithms import aaggff as ag
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.core.client import ClientTraining, proximal_term
from fedjax_fair.drivers.simulate import simulate
from aaggff_common import (KEY, ctx_of, np_ftrl_run, np_ons_run, np_responses, outputs_of,
                           run_rule)

MODEL = helpers.logreg()
PARAMS = helpers.init_params(MODEL, 1)


# ------------------------------------------------------------------ shared properties


RULES = {  # name -> (rule kwargs, cdf)
    "s_thesis": (dict(), "normal"),
    "s_reference": (dict(variant="reference"), "weibull"),
    "s_diagonal": (dict(solver="diagonal"), "frechet"),
    "d_thesis": (dict(), "gumbel"),
    "d_reference": (dict(variant="reference"), "logistic"),
}


def _scenarios(partial, n, k, rounds, rng):
    """Loss sequences [4, R, K + 1], cohorts and masks: 0 random incl. zero / equal /
    huge losses, 1 equal losses, 2 client 3 the worst in round 1, 3 = 0 with the
    clients relabelled by ``perm`` (full participation only). Every cohort carries one
    extra masked-out row that repeats a client id with a wild loss (padding)."""
    random = rng.gamma(1.0, 1.0, size=(rounds, k))
    random[::7] = 0.0
    random[3::7] = 2.5
    random[5::7, 0] = 1e6
    equal = np.repeat(rng.gamma(2.0, 1.0, size=(rounds, 1)), k, axis=1)
    worst = rng.gamma(2.0, 0.2, size=(rounds, k))
    if k == 6:
        worst[0] = [0.5, 0.7, 0.6, 2.0, 0.4, 0.55]
    perm = rng.permutation(n)
    if partial:
        ids = np.stack([np.stack([np.sort(rng.choice(n, k, replace=False))
                                  for _ in range(rounds)]) for _ in range(4)])
        permuted = random
    else:
        ids = np.broadcast_to(np.arange(n), (4, rounds, n))
        permuted = random[:, perm]
    losses = np.stack([random, equal, worst, permuted])
    losses = np.concatenate([losses, np.full((4, rounds, 1), 1e9)], axis=-1)
    ids = np.concatenate([ids, ids[..., :1]], axis=-1)
    masks = np.ones(losses.shape, bool)
    masks[..., k] = False
    return losses, ids, masks, perm


@pytest.mark.parametrize("name", sorted(RULES))
def test_rule_properties(name):
    """NumPy references of the updates, the simplex invariant over 200 rounds,
    symmetry, permutation equivariance and the monotone response,
    one compiled scan per rule."""
    n, rounds = 6, 200
    partial = name.startswith("d")
    k = 3 if partial else n
    rng = np.random.default_rng(16)
    losses, ids, masks, perm = _scenarios(partial, n, k, rounds, rng)
    kwargs, cdf = RULES[name]
    factory = ag.aaggff_d_mixing if partial else ag.aaggff_s_mixing
    w, dec, _ = run_rule(factory(cdf=cdf, **kwargs), n, losses, ids=ids, masks=masks)
    assert np.all(w[..., k] == 0)  # the padding row
    w, losses, ids = w[..., :k], losses[..., :k], ids[..., :k]
    # Literal NumPy references of the first rounds of scenario 0 (includes all-zero,
    # equal and huge losses).
    head = 12
    variant = kwargs.get("variant", "thesis")
    if partial:
        c = k / n
        ref = np_ftrl_run([(i, np_responses(l, cdf, 0.0, c))
                           for i, l in zip(ids[0, :head], losses[0, :head])], n, variant)
        np.testing.assert_allclose(dec[0, :head], ref, atol=1e-6)
        sel = ref[np.arange(head)[:, None], ids[0, :head]]
        np.testing.assert_allclose(w[0, :head], sel / sel.sum(1, keepdims=True), atol=1e-6)
    else:
        assert ag.ons_defaults(n) == (4.0, n / 4)
        resp = np.stack([np_responses(l, cdf, 0.0, 1.0 / n) for l in losses[0, :head]])
        ref = np_ons_run(resp, *ag.ons_defaults(n), variant,
                         diagonal=kwargs.get("solver") == "diagonal")
        np.testing.assert_allclose(dec[0, :head], ref, atol=2e-5)
        np.testing.assert_allclose(w[0, :head], ref, atol=2e-5)  # full cohort: ptilde = p
    assert np.all(np.isfinite(dec)) and np.all(np.isfinite(w))
    assert dec.min() >= -1e-6 and np.abs(dec.sum(-1) - 1).max() <= 1e-5
    assert w.min() >= 0 and np.abs(w.sum(-1) - 1).max() <= 1e-5
    if name == "d_reference":
        # The reference code's DR value (r_i - rbar) / C drops rbar for participants
        # (it drops rbar): even equal losses move weight away from the sampled clients.
        first = dec[1, 0]
        assert np.all(first[ids[1, 0]] < np.delete(first, ids[1, 0]).min() - 1e-3)
    else:
        np.testing.assert_allclose(dec[1], 1.0 / n, atol=1e-6)
        np.testing.assert_allclose(w[1], 1.0 / k, atol=1e-6)
    if not partial:
        np.testing.assert_allclose(dec[3], dec[0][:, perm], atol=2e-6)
        assert dec[2, 0, 3] > np.delete(dec[2, 0], 3).max()
        assert w[2, 0, 3] > np.delete(w[2, 0], 3).max()


def test_d_full_participation_follows_the_largest_loss():
    n = 6
    losses = np.array([[0.5, 0.7, 0.6, 2.0, 0.4, 0.55]])
    w, dec, _ = run_rule(ag.aaggff_d_mixing(), n, losses)  # C = 1: exact responses
    assert dec[0, 3] > np.delete(dec[0], 3).max()
    np.testing.assert_allclose(w[0], dec[0], atol=1e-7)


def test_collapsed_response_range_gives_fedavg_weights():
    """C1 = C2: every response is the same constant, the decision stays 1/N, and the
    weights are FedAvg's uniform weights (= its n_k weights for equal sizes), whatever
    the losses."""
    n = 6
    losses = np.random.default_rng(19).gamma(1.0, 1.0, size=(1, 30, n))
    for rule in (ag.aaggff_s_mixing(response_range=(0.1, 0.1)),
                 ag.aaggff_d_mixing(response_range=(0.2, 0.2))):
        w, dec, _ = run_rule(rule, n, losses)
        np.testing.assert_allclose(dec, 1.0 / n, atol=1e-6)
        uniform, _ = mixing_lib.uniform().update((), outputs_of(losses[0, 0]),
                                                 ctx_of(jnp.arange(n), jnp.ones(n, bool)))
        np.testing.assert_allclose(w[0], np.broadcast_to(np.asarray(uniform), (30, n)),
                                   atol=1e-6)


@pytest.mark.slow
def test_collapsed_response_range_is_fedavg_end_to_end():
    data = helpers.tiny_federation(train_sizes=(6, 6, 6, 6), test_sizes=(2, 2, 2, 2))
    kw = dict(training=ClientTraining(lr=0.3, batch_size=6, num_epochs=1))

    def final(alg):
        state, _ = jax.jit(lambda s, key: simulate(
            alg, s, data, key, num_rounds=2, cohort_size=4, sampler=sampling.full,
            execution="sequential"))(
                alg.init(PARAMS, 4), KEY)
        return state.params

    base = final(fedavg(MODEL, **kw))
    helpers.assert_trees_close(final(ag.aaggff_s(MODEL, response_range=(0.1, 0.1), **kw)),
                               base, rtol=1e-5, atol=1e-6)
    helpers.assert_trees_close(final(ag.aaggff_d(MODEL, response_range=(0.2, 0.2), **kw)),
                               base, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ end to end


def test_aaggff_s_end_to_end_matches_reference_weights():
    data = helpers.tiny_federation()
    n = data.num_clients
    alg = ag.aaggff_s(MODEL, cdf="normal",
                      training=ClientTraining(lr=0.3, batch_size=12, num_epochs=1))
    state, metrics = jax.jit(lambda s, key: simulate(
        alg, s, data, key, num_rounds=4, cohort_size=n, sampler=sampling.full,
        execution="sequential"))(
            alg.init(PARAMS, n), KEY)
    assert helpers.tree_all_finite(state.params)
    losses = np.asarray(metrics["loss_before"], np.float64)
    resp = np.stack([np_responses(l, "normal", 0.0, 1.0 / n) for l in losses])
    ref = np_ons_run(resp, *ag.ons_defaults(n))
    np.testing.assert_allclose(np.asarray(metrics["weights"]), ref, atol=2e-5)
    np.testing.assert_allclose(np.asarray(state.mixing_state.decision), ref[-1], atol=2e-5)
    assert int(state.mixing_state.round) == 4
    # The global model improves on the clients' training data.
    assert losses[-1].mean() < losses[0].mean()


def test_aaggff_d_end_to_end_plug_and_play_with_fedprox():
    """AAggFF-D's rule on FedProx clients (one line), partial participation."""
    data = helpers.tiny_federation()
    n, rounds = data.num_clients, 5
    kw = dict(training=ClientTraining(lr=0.3, batch_size=12, num_epochs=1))
    # FedProx clients = FedAvg's local training with the proximal regulariser (the
    # fedprox factory fixes the mixing rule, so the pieces are plugged in directly).
    alg = fedavg(MODEL, regularizer=proximal_term(0.01),
                 mixing=ag.aaggff_d_mixing(cdf="exponential"), **kw)
    state, metrics = jax.jit(lambda s, key: simulate(
        alg, s, data, key, num_rounds=rounds, cohort_size=3, sampler=sampling.uniform,
        execution="sequential"))(
            alg.init(PARAMS, n), KEY)
    assert helpers.tree_all_finite(state.params)
    ids = np.asarray(metrics["client_ids"])
    assert len({tuple(sorted(i)) for i in ids}) > 1  # different cohorts
    losses = np.asarray(metrics["loss_before"], np.float64)
    rounds_ = [(i, np_responses(l, "exponential", 0.0, 3 / n)) for i, l in zip(ids, losses)]
    ref = np_ftrl_run(rounds_, n)
    sel = ref[np.arange(rounds)[:, None], ids]
    np.testing.assert_allclose(np.asarray(metrics["weights"]), sel / sel.sum(1, keepdims=True),
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.mixing_state.decision), ref[-1], atol=1e-6)
    assert int(state.mixing_state.round) == rounds
    # The factory builds the same thing on FedAvg clients.
    d_alg = ag.aaggff_d(MODEL, cdf="exponential", **kw)
    assert isinstance(d_alg.init(PARAMS, n).mixing_state, ag.FTRLState)


# ------------------------------------------------------------------ API


def test_argument_validation():
    with pytest.raises(ValueError, match="^cdf:"):
        ag.aaggff_s_mixing(cdf="cauchy")
    with pytest.raises(ValueError, match="^cdf:"):
        ag.aaggff_d_mixing(cdf=6)
    with pytest.raises(ValueError, match="^variant:"):
        ag.aaggff_s_mixing(variant="paper")
    with pytest.raises(ValueError, match="^alpha:"):
        ag.aaggff_s_mixing(alpha=0.0)
    with pytest.raises(ValueError, match="^beta:"):
        ag.aaggff_s_mixing(beta=-1.0)
    with pytest.raises(ValueError, match="^solver:"):
        ag.aaggff_s_mixing(solver="cvxpy")
    with pytest.raises(ValueError, match="^num_iters:"):
        ag.aaggff_s_mixing(num_iters=0)
    for bad in [(0.5, 0.1), (0.0, 0.0), (-0.1, 1.0), "x"]:
        with pytest.raises(ValueError, match="^response_range:"):
            ag.aaggff_d_mixing(response_range=bad)
    # The factory sets the mixing rule itself: its signature takes no ``mixing``.
    assert "mixing" not in method_hparams("aaggff_s")
    with pytest.raises(TypeError, match="mixing"):
        ag.aaggff_s(MODEL, mixing=mixing_lib.uniform())
    rule = ag.aaggff_s_mixing()
    with pytest.raises(ValueError, match="^cohort_size:"):
        rule.update(rule.init(6), outputs_of(jnp.ones(3)),
                    ctx_of(jnp.arange(3), jnp.ones(3, bool)))
    # Both factories state FedAvg's local-training arguments (with FedAvg's ranges).
    fedavg_hparams = method_hparams("fedavg")
    for name in ("aaggff_s", "aaggff_d"):
        hparams = method_hparams(name)
        for arg in ("client_lr", "batch_size", "num_epochs", "max_steps", "client_optimizer",
                    "server_optimizer"):
            assert arg in hparams, (name, arg)
            assert hparams[arg].range == fedavg_hparams[arg].range, (name, arg)
    assert REGISTRY["aaggff_s"].participation == "full"
    assert REGISTRY["aaggff_d"].participation == "partial"
    assert ag.cdf_name(3) == "normal" and set(ag.REFERENCE_CDFS.values()) <= set(ag.CDFS)


@pytest.mark.parametrize("mode", ["s", "d"])
def test_server_step_helper(mode):
    n = 40 if mode == "s" else 300
    step, (state, outputs, ctx) = ag.aaggff_server_step(n, mode=mode)
    ids = ctx.client_ids
    assert ids.shape == ((n,) if mode == "s" else (3,))
    losses = jnp.asarray(np.random.default_rng(20).gamma(2.0, 1.0, (25, ids.shape[0])),
                         jnp.float32)

    def body(st, loss):
        w, st = step(st, outputs._replace(loss_before=loss), ctx)
        return st, w

    state, w = jax.jit(lambda st, ls: jax.lax.scan(body, st, ls))(state, losses)
    assert np.abs(np.asarray(w).sum(1) - 1).max() <= 1e-5 and int(state.round) == 25
    if mode == "s":
        assert state.hessian.shape == (n, n)
        # After 25 rounds the warm-started QP is still solved to float32 precision.
        alpha, beta = ag.ons_defaults(n)
        B = alpha * jnp.eye(n) + beta * state.hessian
        assert float(online.simplex_qp_kkt_residual(B, state.linear, state.decision)) <= 1e-5
    else:
        assert state.decision.shape == (300,)


@pytest.mark.slow
def test_server_lr_scales_the_step_and_accepts_a_compensating_schedule():
    """AAggFF's reference code has a global rate eta_g (default 1, FedAvg's step);
    ``schedules.compensated`` grows it as the client rate decays (the reference code's choice)."""
    from fedjax_fair.data import get_dataset
    from fedjax_fair.models import logistic_regression
    from fedjax_fair.scenarios.schedules import compensated, exponential
    from fedjax_fair.drivers.simulate import simulate
    ds = get_dataset("synthetic", num_clients=6, max_examples=40)
    model = logistic_regression(ds.input_shape, ds.num_classes)
    params = model.init(jax.random.key(0))

    def steps(server_lr, rounds):
        alg = ag.aaggff_d(model, server_lr=server_lr,
                          training=ClientTraining(lr=exponential(0.1, 0.5)))
        state, out = alg.init(params, 6), []
        for t in range(rounds):
            new, metrics = simulate(alg, state, ds.data, jax.random.key(t), num_rounds=1,
                                    cohort_size=3, execution="sequential")
            moved = np.sqrt(sum(float(np.sum((np.asarray(a) - np.asarray(b)) ** 2)) for a, b
                                in zip(jax.tree.leaves(new.params),
                                       jax.tree.leaves(state.params))))
            out.append(moved / float(metrics["update_norm"][0]))
            state = new
        return out

    assert steps(1.0, 1) == pytest.approx([1.0], rel=1e-4)
    assert steps(0.5, 1) == pytest.approx([0.5], rel=1e-4)
    # compensated: eta_g,t = 2 / 0.5^t while the client rate halves each round
    assert steps(compensated(2.0, exponential(0.1, 0.5)), 3) == pytest.approx([2, 4, 8],
                                                                              rel=1e-4)
    with pytest.raises(ValueError, match="server_lr"):
        ag.aaggff_s(model, server_lr=-1.0)
