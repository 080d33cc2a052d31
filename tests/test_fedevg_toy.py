"""FedEvg (fedjax_fair/algorithms/fedevg.py) end to end: ``runner.run`` on a 2-D toy
(two Gaussians, two clients; both splits, seeds 0-2 and the downstream accuracy of a
fresh classifier trained on D~ under ``-m slow``): the synthetic samples move to their
class means. The pure pieces and single rounds are tests/test_fedevg.py's.
"""
from __future__ import annotations

import importlib

import jax
import numpy as np
import pytest

import helpers
from fedevg_common import TOY_MODEL
from fedjax_fair.algorithms.families import generative as S
from fedjax_fair.scenarios import sampling
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.core.types import FederatedData
from fedjax_fair.drivers.runner import run
from fedjax_fair.drivers.simulate import simulate
from fedjax_fair.models import mlp
F = importlib.import_module("fedjax_fair.algorithms.fedevg")  # the package exports the factory


# ----------------------------------------------------------------- 10. the 2-D toy


TOY_MEANS = np.asarray([[0.25, 0.5], [0.75, 0.5]])
TOY = F.fedevg(TOY_MODEL, num_synth=40, local_iters=30,
               training=ClientTraining(batch_size=32, lr=1e-3, weight_decay=1e-4),
               client_sgld_steps=1, client_step=0.01, client_noise=0.01, grad_clip=3.0,
               ce_weight=0.1, server_step=0.01, server_step_end=0.001,
               server_noise=0.01, num_rounds=200, schedule="ddpm_cosine_beta",
               data_range=(0.0, 1.0), server_classifier_steps=5, server_classifier_lr=1e-2)
_TOY_RUN: list = []


def _toy_data(split: str, seed: int):
    rng = np.random.default_rng(seed)
    xs = [(TOY_MEANS[c] + 0.05 * rng.normal(size=(500, 2))).astype(np.float32) for c in (0, 1)]
    ys = [np.full(500, c, np.int32) for c in (0, 1)]
    if split == "iid":
        x, y = np.concatenate(xs), np.concatenate(ys)
        p = rng.permutation(1000)
        parts = [(x[p[:500]], y[p[:500]]), (x[p[500:]], y[p[500:]])]
    else:
        parts = list(zip(xs, ys))
    return helpers.pack(parts)


def _stats(state):
    """(mean distance of each synthetic sample to its own class mean, share of samples
    nearest to their own class mean), on the samples clipped to [0, 1]."""
    x, y = (np.asarray(a) for a in S.synthetic_data(state))
    d = np.linalg.norm(np.clip(x, 0, 1)[:, None] - TOY_MEANS[None], axis=-1)
    return d[np.arange(len(y)), y].mean(), float(np.mean(d.argmin(1) == y))


def _toy(split: str, seed: int):
    """(initial distance, final distance, agreement, final state, data) of 200 rounds."""
    if not _TOY_RUN:
        _TOY_RUN.append(jax.jit(lambda s, d, k: simulate(
            TOY, s, FederatedData(d, d), k, num_rounds=200, cohort_size=2,
            sampler=sampling.uniform, execution="sequential")[0]))
    state = TOY.init(TOY_MODEL.init(jax.random.key(seed)), 2)
    synth = F.init_synthetic(jax.random.key(100 + seed), 40, 2, (2,))
    state = state._replace(aggregator_state=state.aggregator_state._replace(x=synth.x,
                                                                            y=synth.y))
    train = _toy_data(split, seed)
    final = _TOY_RUN[0](state, train, jax.random.key(seed))
    (d0, _), (d1, agree) = _stats(state), _stats(final)
    return d0, d1, agree, final, train


def _check_toy(split, seed):
    d0, d1, agree, final, train = _toy(split, seed)
    assert 1 - d1 / d0 >= 0.25, (split, seed, d0, d1)
    assert agree >= 0.7, (split, seed, agree)
    return final, train


def test_runner_on_the_toy_moves_samples_to_their_class_means():
    """``runner.run`` end to end on the 2-D toy (IID split; one class per client, where
    only the composition of the clients' energies can place both classes, runs under
    ``-m slow``): distance reduction >= 25% and nearest-mean agreement >= 0.7, and the runner's accuracy, that of the
    server classifier trained on D~ only, on held-out real points."""
    train = _toy_data("iid", 0)
    data = FederatedData(train, _toy_data("iid", 1))
    params = TOY_MODEL.init(jax.random.key(0))
    state0 = TOY.init(params, 2)
    result = run(TOY, params, data, jax.random.key(0), model=TOY_MODEL, num_rounds=200,
                 cohort_size=2, eval_every=200, progress=False, execution="sequential")
    state = result.state
    assert int(state.round) == 200 and helpers.tree_all_finite(state)
    x, y = S.synthetic_data(state)
    assert x.shape == (40, 2) and np.all((np.asarray(x) >= 0) & (np.asarray(x) <= 1))
    np.testing.assert_array_equal(y, np.repeat([0, 1], 20))
    (d0, _), (d1, agree) = _stats(state0), _stats(state)
    assert 1 - d1 / d0 >= 0.25 and agree >= 0.7, (d0, d1, agree)
    assert [h["round"] for h in result.history] == [0, 200]
    assert result.history[-1]["accuracy_mean"] >= 0.9
    assert result.round_metrics["train_loss"].shape == (200,)
    assert np.all(np.isfinite(result.round_metrics["train_loss"]))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("split", ["iid", "one_class_per_client"])
def test_toy_all_seeds_and_downstream_accuracy(split, seed):
    final, train = _check_toy(split, seed)
    # the thesis's protocol: a fresh classifier trained on D~ only, tested on the real data
    x, y = S.synthetic_data(final)
    out = S.downstream_accuracy(mlp((2,), 2, hidden=(16,)), np.clip(np.asarray(x), 0, 1), y,
                                train, jax.random.key(0), steps=100, lr=1e-2, batch_size=32)
    assert out["accuracy"] >= 0.9 and out["per_client"].shape == (2,)
