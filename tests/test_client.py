"""Local training (fedjax_fair/core/client.py): empty clients, step budgets and the
static cap, the training loss of the last epoch, masked_mean, data_metrics,
steps_per_epoch and batch_at.

The federation is helpers.tiny_federation(): 6 clients, 10 features, 3 classes,
train sizes (7, 12, 0, 3, 9, 5) padded to M = 12, client 2 empty.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from helpers import (ENGINE_MODEL as MODEL, ENGINE_PARAMS as PARAMS, ENGINE_TRAIN as TRAIN,
                     ENGINE_N as N, ENGINE_LR as LR, UNLIMITED, ENGINE_KEY as KEY,
                     ENGINE_IDS as IDS, vmap_apply_on as _vmap_apply_on, vmap_round as _vmap_round,
                     single_client as _single_client)
from fedjax_fair.core import client as client_lib
from fedjax_fair.core.client import batch_at, masked_mean, max_local_steps, steps_per_epoch
from fedjax_fair.core.types import ClientData


def test_empty_client_update_is_zero_and_finite():
    empty = helpers.client(TRAIN, helpers.EMPTY_CLIENT)
    assert int(empty.num_examples) == 0
    out, _ = _single_client()(PARAMS, (), empty, jnp.int32(UNLIMITED), KEY)
    for leaf in jax.tree.leaves(out.delta):
        np.testing.assert_array_equal(leaf, np.zeros_like(leaf))
    assert float(out.loss_before) == 0.0
    assert int(out.num_steps) == 0
    assert int(out.num_examples) == 0
    assert helpers.tree_all_finite(out)


def test_round_of_only_the_empty_client_keeps_params():
    # Six copies of the empty client (same shapes as the shared cohort).
    state, metrics = _vmap_apply_on(helpers.cohort(TRAIN, [helpers.EMPTY_CLIENT] * N))
    chex.assert_trees_all_equal(state.params, PARAMS)
    # a cohort without training rows has no training loss: NaN (null in the logs), not 0
    assert np.isnan(float(metrics["train_loss"]))
    assert helpers.tree_all_finite({k: v for k, v in metrics.items() if k != "train_loss"})


def test_empty_client_gets_zero_weight_in_a_round():
    _, metrics = _vmap_round()
    slot = IDS.index(helpers.EMPTY_CLIENT)
    assert float(metrics["weights"][slot]) == 0.0
    assert float(metrics["loss_before"][slot]) == 0.0
    assert helpers.tree_all_finite(metrics)


CAP = 3  # static max_steps of the full-batch client below
FULL_EPOCHS = 5


def _full_batch_client():
    """A full-batch client (B = 12 >= n): every step sees all real rows, so k steps
    are k steps of plain gradient descent on F_k whatever the shuffling; 5 epochs,
    statically capped at 3 steps."""
    return _single_client(batch_size=12, num_epochs=FULL_EPOCHS, max_steps=CAP)


@pytest.mark.parametrize("cid,budget", [(1, 2), (0, 1), (4, 10), (3, UNLIMITED)])
def test_step_budget_equals_hand_gradient_descent(cid, budget):
    """b budgeted steps = min(b, E ceil(n/B), cap) steps of gradient descent, checked
    against a NumPy float64 reference."""
    out, _ = _full_batch_client()(PARAMS, (), helpers.client(TRAIN, cid), jnp.int32(budget),
                                  jax.random.fold_in(KEY, cid))
    taken = min(budget, FULL_EPOCHS, CAP)
    x, y = helpers.real_rows(TRAIN, [cid])
    w, b = helpers.logreg_gd_numpy(PARAMS, x, y, LR, taken)
    w0, b0 = helpers.logreg_to_numpy(PARAMS)
    dw, db = helpers.logreg_to_numpy(out.delta)
    np.testing.assert_allclose(dw, w0 - w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(db, b0 - b, rtol=1e-5, atol=1e-6)
    if budget < CAP:
        assert int(out.num_steps) == taken


@pytest.mark.parametrize("cid", [0, 1, 4])
def test_static_cap_reports_the_steps_actually_taken(cid):
    """ClientOutput.num_steps is "local steps actually taken": with a static cap
    ``max_steps`` the scan runs at most that many steps (the delta above is 3 GD
    steps), so num_steps must be capped too, not min(budget, E ceil(n/B)) = 5."""
    out, _ = _full_batch_client()(PARAMS, (), helpers.client(TRAIN, cid),
                                  jnp.int32(UNLIMITED), jax.random.fold_in(KEY, cid))
    assert int(out.num_steps) == min(CAP, FULL_EPOCHS)


def _logreg_loss_numpy(w, b, x, y):
    logits = np.asarray(x, np.float64) @ w + b
    logits -= logits.max(-1, keepdims=True)
    return float(np.mean(np.log(np.exp(logits).sum(-1)) - logits[np.arange(len(y)), y]))


@pytest.mark.parametrize("cid,budget", [(1, 2), (0, 1), (4, 10)])
def test_train_loss_is_the_last_epochs_mean_loss(cid, budget):
    """Full-batch epochs: the last epoch is the last step, taken at the iterate after
    taken - 1 gradient-descent steps; train_loss is its mean loss over the rows."""
    out, _ = _full_batch_client()(PARAMS, (), helpers.client(TRAIN, cid), jnp.int32(budget),
                                  jax.random.fold_in(KEY, cid))
    taken = min(budget, FULL_EPOCHS, CAP)
    x, y = helpers.real_rows(TRAIN, [cid])
    w, b = helpers.logreg_gd_numpy(PARAMS, x, y, LR, taken - 1)
    np.testing.assert_allclose(float(out.train_loss), _logreg_loss_numpy(w, b, x, y),
                               rtol=1e-5)


def test_train_loss_averages_every_batch_of_the_last_epoch():
    # Client 1 has 12 rows, B = 4: 3 batches per epoch, E = 2 -> steps 3, 4, 5 form the
    # last epoch and their 12 per-example losses are averaged (one budget cut: 4 steps
    # -> the last epoch is the single step 3, 4 rows).
    client = _single_client()
    full, _ = client(PARAMS, (), helpers.client(TRAIN, 1), jnp.int32(UNLIMITED), KEY)
    cut, _ = client(PARAMS, (), helpers.client(TRAIN, 1), jnp.int32(4), KEY)
    assert int(full.num_steps) == 6 and int(cut.num_steps) == 4
    assert 0 < float(full.train_loss) < float(full.loss_before)
    assert float(cut.train_loss) > 0
    empty, _ = client(PARAMS, (), helpers.client(TRAIN, helpers.EMPTY_CLIENT),
                      jnp.int32(UNLIMITED), KEY)
    assert float(empty.train_loss) == 0.0


def test_zero_budget_gives_zero_delta():
    out, _ = _single_client()(PARAMS, (), helpers.client(TRAIN, 1), jnp.int32(0), KEY)
    assert int(out.num_steps) == 0
    for leaf in jax.tree.leaves(out.delta):
        np.testing.assert_array_equal(leaf, np.zeros_like(leaf))
    assert float(out.loss_before) > 0.0  # the server model's loss is still measured


def test_masked_mean_of_all_false_mask_is_zero():
    f = jax.jit(masked_mean)
    values = jnp.array([1.0, 2.0, 3.0])
    assert float(f(values, jnp.zeros((3,), bool))) == 0.0
    np.testing.assert_allclose(f(values, jnp.array([True, False, True])), 2.0)
    grad = jax.grad(lambda v: masked_mean(v, jnp.zeros((3,), bool)))(values)
    np.testing.assert_array_equal(grad, np.zeros(3))


def test_data_metrics_calibration_is_the_same_in_row_chunks():
    """ECE / MCE over a client of 700 padded rows (chunked by 256) equal the unchunked
    values, and padded rows never count."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(700, 10)).astype(np.float32)
    y = rng.integers(0, 3, size=700).astype(np.int32)
    data = ClientData({"x": jnp.asarray(x), "y": jnp.asarray(y)}, jnp.arange(700) < 650,
                      jnp.asarray(650))
    chunked = jax.jit(lambda p, d: client_lib.data_metrics(MODEL, p, d, chunk_size=256))(
        PARAMS, data)
    whole = client_lib.data_metrics(MODEL, PARAMS, data, chunk_size=1024)
    from fedjax_fair.metrics import calibration_errors
    logits = MODEL.apply(PARAMS, jnp.asarray(x[:650]))
    expected = [float(v) for v in calibration_errors(logits, jnp.asarray(y[:650]))]
    for m in (chunked, whole):
        np.testing.assert_allclose([float(m["ece"]), float(m["mce"])], expected, atol=1e-6)


def test_steps_per_epoch_and_scan_length():
    np.testing.assert_array_equal(steps_per_epoch(jnp.array([0, 1, 4, 5, 8]), 4),
                                  [0, 1, 1, 2, 2])
    assert max_local_steps(12, 4, 2) == 6
    assert max_local_steps(13, 4, 2) == 8
    assert max_local_steps(13, 4, 2, max_steps=5) == 5


@pytest.mark.parametrize("batch,sizes", [(3, (7, 1, 12, 0)), (5, (5, 9, 11, 3))])
def test_batch_at_covers_real_rows_once_per_epoch(batch, sizes):
    padded, epochs = 12, 3
    key = jax.random.key(11)
    num_steps = epochs * math.ceil(padded / batch)  # enough for every n <= 12

    @jax.jit
    def batches(n):
        data = ClientData(examples={"row": jnp.arange(padded, dtype=jnp.int32)},
                          mask=jnp.arange(padded) < n, num_examples=n)
        return jax.vmap(lambda t: batch_at(data, t, key, batch))(jnp.arange(num_steps))

    for n in sizes:
        spe = max(math.ceil(n / batch), 1)
        ex, bmask = batches(jnp.int32(n))
        rows = np.asarray(ex["row"])[:epochs * spe].reshape(epochs, spe, batch)
        bmask = np.asarray(bmask)[:epochs * spe].reshape(epochs, spe, batch)
        orders = []
        for e in range(epochs):
            assert np.all(rows[e][bmask[e]] < n)  # padded rows never appear unmasked
            seen = rows[e][bmask[e]].tolist()
            assert sorted(seen) == list(range(n))  # every real row exactly once per epoch
            if n:  # only the epoch's last batch may be partial
                np.testing.assert_array_equal(bmask[e].sum(-1)[:-1], batch)
            orders.append(seen)
        if n >= 5:
            assert orders[0] != orders[1] or orders[1] != orders[2]  # epochs reshuffle
