"""Clients never trained on (fedjax_fair/drivers/unseen.py): the held-out split, the
evaluation of global methods (the plain evaluator on the held-out clients), the
adaptation of every personalised method (one round of its client procedure: it changes
the personal model and lowers the new clients' training loss, and the server's update
is discarded), and docs/participation.md's snippet.

Small problems only: 8 clients of 10 features and 3 classes, an MLP with 8 hidden
units, untrained or briefly trained states; compilation dominates."""
from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_fair.algorithms import build
from fedjax_fair.core.evaluation import make_personal_evaluator, make_state_evaluator
from fedjax_fair.core.types import FederatedData
from fedjax_fair.data import from_client_arrays
from fedjax_fair.drivers import unseen as U
from fedjax_fair.hparams import FieldError
from fedjax_fair.models import get_model
from helpers import client_arrays, pack

TRAIN_SIZES = (9, 14, 6, 11, 8, 12, 5, 10)
TEST_SIZES = (4, 5, 3, 6, 2, 4, 3, 5)
PERSONALISED = ("ditto", "superfed", "apfl", "pfedme", "fedper", "fedrep", "lg_fedavg",
                "fedavg_ft")


def _federation(validation: bool = False) -> FederatedData:
    train = pack(client_arrays(TRAIN_SIZES, seed=0))
    test = pack(client_arrays(TEST_SIZES, seed=1))
    val = pack(client_arrays(TEST_SIZES[::-1], seed=2)) if validation else None
    return FederatedData(train=train, test=test, validation=val)


@pytest.fixture(scope="module")
def model():
    return get_model("mlp", (10,), 3, hidden=(8,))


# ------------------------------------------------------------------------------ split


@pytest.mark.parametrize("n,fraction,expected", [
    (10, 0.2, 2), (10, 0.25, 3), (10, 0.24, 2),  # rounded half up
    (3, 0.01, 1),  # at least one
    (2, 0.9, 1), (5, 0.99, 4),  # at most N - 1
    (5, 0.0, 0)])
def test_number_held_out(n, fraction, expected):
    assert U.num_unseen(n, fraction) == expected


@pytest.mark.parametrize("n,fraction", [(10, 1.0), (10, -0.1), (10, float("nan")),
                                        (10, float("inf")), (1, 0.5)])
def test_bad_fractions_are_refused_naming_the_fraction(n, fraction):
    with pytest.raises(FieldError) as e:
        U.num_unseen(n, fraction)
    assert e.value.field == "fraction"


def test_split_keeps_every_clients_rows_and_trims_the_padding():
    data = _federation(validation=True)
    seen, unseen, ids = U.split_clients(data, 0.25, seed=3)
    assert len(ids) == 2 and seen.num_clients == 6 and unseen.num_clients == 2
    seen_ids = np.setdiff1d(np.arange(8), ids)
    for part, rows in ((seen, seen_ids), (unseen, ids)):
        for name in ("train", "test", "validation"):
            whole, mine = getattr(data, name), getattr(part, name)
            sizes = np.asarray(whole.num_examples)[rows]
            np.testing.assert_array_equal(mine.num_examples, sizes)
            assert mine.mask.shape[1] == sizes.max()  # padded to its own largest client
            for j, k in enumerate(rows):
                n = sizes[j]
                for key in ("x", "y"):
                    np.testing.assert_array_equal(np.asarray(mine.examples[key])[j, :n],
                                                  np.asarray(whole.examples[key])[k, :n])
    # deterministic in the seed; another seed draws other clients
    np.testing.assert_array_equal(U.split_clients(data, 0.25, seed=3)[2], ids)
    assert any(not np.array_equal(U.split_clients(data, 0.25, seed=s)[2], ids)
               for s in range(4, 10))
    assert U.split_clients(data, 0.0, seed=0)[1].num_clients == 0


def test_hold_out_keeps_the_seen_clients_side_data():
    arrays = client_arrays(TRAIN_SIZES, seed=0)
    tests = client_arrays(TEST_SIZES, seed=1)
    users = [f"user{k}" for k in range(8)]
    ds = from_client_arrays([x for x, _ in arrays], [y for _, y in arrays],
                            [x for x, _ in tests], [y for _, y in tests], name="toy",
                            num_classes=3, info={"users": users, "client_sizes":
                                                 list(TRAIN_SIZES), "seed": 4})
    seen = U.hold_out(ds, 0.3, seed=4)
    held = seen.unseen
    assert seen.num_clients == 6 and len(held.client_ids) == 2
    np.testing.assert_array_equal(held.seen_ids, np.setdiff1d(np.arange(8), held.client_ids))
    assert seen.info["users"] == [users[k] for k in held.seen_ids]
    assert seen.info["client_sizes"] == [TRAIN_SIZES[k] for k in held.seen_ids]
    assert held.names == [users[k] for k in held.client_ids]
    assert seen.info["unseen_clients"]["client_ids"] == [int(k) for k in held.client_ids]
    assert seen.info["padding"]["train"]["num_clients"] == 6
    assert ds.num_clients == 8  # the dataset given is unchanged


# --------------------------------------------------------------------------- global


@pytest.mark.parametrize("name", ["fedavg", "feddyn"])  # feddyn: evaluated_params
def test_global_methods_are_the_plain_evaluator_on_the_held_out_clients(model, name):
    data = _federation()
    _, unseen, ids = U.split_clients(data, 0.3, seed=1)
    alg = build(name, model)
    state = alg.init(model.init(jax.random.key(0)), 6)
    assert U.adaptation(alg) == "none"
    got = U.evaluate_unseen(model, alg, state, unseen, jax.random.key(5), chunk_size=2)
    plain = make_state_evaluator(model, None, alg.evaluated_params)
    want = plain(state, unseen.test, jnp.arange(len(ids)))
    assert set(got) == set(want)
    for k in want:  # the held-out clients' own split: equal
        np.testing.assert_array_equal(got[k], np.asarray(want[k]), err_msg=k)
    whole = plain(state, data.test, jnp.arange(8))  # the full federation, at their rows
    for k in ("accuracy", "loss", "num_examples"):
        np.testing.assert_allclose(got[k], np.asarray(whole[k])[ids], rtol=1e-6, err_msg=k)
    summary = U.unseen_summary(got, 0)
    assert summary["round"] == 0 and 0 <= summary["accuracy_worst_10%"] <= summary[
        "accuracy_mean"] <= 1


# ---------------------------------------------------------------------- personalised


def _personal_loss(model, alg, state, split, n):
    metrics = make_personal_evaluator(model, alg.personal)(state, split, jnp.arange(n))
    return float(np.average(metrics["loss"], weights=np.asarray(split.num_examples)))


def _algorithm(name, model):
    if name == "superfed":  # the mixture (and the local model's training) from round 3
        return build(name, model, start_round=3)
    return build(name, model)


@pytest.mark.parametrize("name", [n if n in ("ditto", "fedrep", "fedavg_ft", "superfed")
                                  else pytest.param(n, marks=pytest.mark.slow)
                                  for n in PERSONALISED])  # the other four: -m slow
def test_adaptation_changes_the_personal_model_and_lowers_the_train_loss(model, name):
    data = _federation()
    seen, unseen, ids = U.split_clients(data, 0.3, seed=2)
    alg = _algorithm(name, model)
    assert U.adaptation(alg) == U.ONE_ROUND
    # a "trained" server: the initial model at round 3 (SuPerFed's mixture is on only
    # if the trained round counter is carried into the adaptation)
    state = alg.init(model.init(jax.random.key(1)), seen.num_clients)
    state = state._replace(round=jnp.asarray(3, jnp.int32))
    n = unseen.num_clients
    start = U.adaptation_state(alg, state, n)
    adapted = U.adapt(alg, state, unseen.train, jax.random.key(7))
    # the server's update is discarded: every server piece is the trained one
    for field in ("params", "opt_state", "round"):
        for a, b in zip(jax.tree.leaves(getattr(adapted, field)),
                        jax.tree.leaves(getattr(state, field))):
            np.testing.assert_array_equal(a, b, err_msg=field)
    ids_ = jnp.arange(n)
    before, after = alg.personal(start, ids_), alg.personal(adapted, ids_)
    changed = [np.abs(np.asarray(a) - np.asarray(b)).reshape(n, -1).max(axis=1)
               for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))]
    assert (np.max(changed, axis=0) > 0).all(), "every new client's model moves"
    loss_before = _personal_loss(model, alg, start, unseen.train, n)
    loss_after = _personal_loss(model, alg, adapted, unseen.train, n)
    assert loss_after < loss_before, (loss_before, loss_after)


def test_personal_evaluation_is_the_adapted_model_on_test_rows_in_any_chunking(model):
    """evaluate_unseen = the adapted personal models on the test rows, the same in one
    chunk and with a lazy client table of 2 slots (which bounds the chunk to 2 clients,
    the last chunk padded)."""
    data = _federation()
    seen, unseen, _ = U.split_clients(data, 0.4, seed=0)
    n = unseen.num_clients
    assert n == 3
    alg = build("fedrep", model, head_epochs=2)
    state = alg.init(model.init(jax.random.key(2)), seen.num_clients)
    key = jax.random.key(9)
    adapted = U.adapt(alg, state, unseen.train, key)
    want = make_personal_evaluator(model, alg.personal)(adapted, unseen.test, jnp.arange(n))
    lazy = build("fedrep", model, head_epochs=2, client_table="lazy:2")
    lazy_state = lazy.init(model.init(jax.random.key(2)), seen.num_clients)
    for got in (U.evaluate_unseen(model, alg, state, unseen, key),
                U.evaluate_unseen(model, lazy, lazy_state, unseen, key)):
        for k in ("accuracy", "loss", "num_examples"):
            np.testing.assert_allclose(got[k], np.asarray(want[k]), rtol=1e-5, atol=1e-6,
                                       err_msg=k)


def test_adapt_refuses_a_global_method(model):
    alg = build("fedavg", model)
    with pytest.raises(FieldError) as e:
        U.adapt(alg, alg.init(model.init(jax.random.key(0)), 2), _federation().train,
                jax.random.key(0))
    assert e.value.field == "algorithm"


# ------------------------------------------------------------------------------ docs


def test_the_participation_page_snippet_runs():
    """docs/participation.md's "Clients never trained on" Python block runs as written
    and evaluates the held-out clients."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "participation.md").read_text()
    section = page.split("## Clients never trained on", 1)[1].split("\n## ", 1)[0]
    (body,) = re.findall(r"^```python\n(.*?)^```", section, flags=re.M | re.S)
    namespace: dict = {}
    exec(compile(body, "participation.md", "exec"), namespace)
    metrics, summary = namespace["metrics"], namespace["summary"]
    assert len(metrics["accuracy"]) == len(namespace["unseen_ids"]) > 0
    assert 0 <= summary["accuracy_mean"] <= 1
