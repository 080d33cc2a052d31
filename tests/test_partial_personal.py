"""Partial-model personalisation (FedPer, FedRep, LG-FedAvg) and FedAvg-FT.

* Three rounds of FedRep, FedPer and LG-FedAvg, and two of FedAvg-FT, against literal
  NumPy float64 references of their module docstrings (fedjax_fair/algorithms/
  {fedrep,lg_fedavg,finetune}.py) on helpers.tiny_federation() with a 2-layer MLP
  (Dense_0: 10 -> 8, ReLU, Dense_1: 8 -> 3): unequal client sizes (client 2 empty),
  minibatches with a partial last batch, partial participation, padded cohorts whose
  masked rows repeat a client id. The reference reproduces each client's batch order
  from its key as ``partial.partial_training`` splits it: client key = fold_in(round
  key, id) trains phase 0, fold_in(client key, i) phase i (FedRep's body phase; FedAvg-
  FT's extra loop uses the finish key fold_in(client key, 1)); inside ``local_sgd``,
  (shuffle key, dropout key) = split(its key) and epoch e's row order is
  ``client.epoch_order(data, shuffle key, e, B)``.
* What is aggregated and what stays personal: the server's personal layers stay at
  their initial values bit for bit, the rows of clients outside the cohort are
  bit-identical, frozen layers of a phase are bit-identical.
* Personal evaluation is each client's combined model ``alg.personal(state, ids)``.
* FedPer with every layer shared is FedAvg; bad layer selections raise ValueError
  naming the field at construction.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from fedjax_fair.algorithms.families import partial
from fedjax_fair.algorithms.fedavg import fedavg
from fedjax_fair.algorithms.fedrep import FEDPER_HPARAMS, HPARAMS as FEDREP_HPARAMS
from fedjax_fair.algorithms.fedrep import fedper, fedrep
from fedjax_fair.algorithms.finetune import HPARAMS as FT_HPARAMS
from fedjax_fair.algorithms.finetune import fedavg_ft
from fedjax_fair.algorithms.lg_fedavg import HPARAMS as LG_HPARAMS
from fedjax_fair.algorithms.lg_fedavg import lg_fedavg
from fedjax_fair.core.evaluation import make_state_evaluator
from fedjax_fair.models import mlp
from fedjax_fair.core.types import Broadcast
from fedjax_fair.core.client import ClientTraining

MODEL = mlp((helpers.NUM_FEATURES,), helpers.NUM_CLASSES, hidden=(8,))
PARAMS = helpers.init_params(MODEL, 1)
DATA = helpers.tiny_federation()
TRAIN = DATA.train
N = DATA.num_clients
SIZES = np.asarray(helpers.TRAIN_SIZES)
LAYERS = ("Dense_0", "Dense_1")
B = 4  # clients of 7, 9 and 5 rows end their epochs with a partial batch
EPOCHS = 2
LR = 0.2
HEAD_EPOCHS, BODY_EPOCHS = 3, 1  # FedRep: head_epochs, num_epochs (the body)
FT_EPOCHS, FT_LR = 3, 0.15

ROUNDS = (([0, 3, 2, 0], [True, True, True, False]),
          ([1, 4, 0, 5], [True, True, True, True]),
          ([5, 0, 3, 1], [True, True, True, False]))
ROUND_KEYS = tuple(jax.random.key(200 + r) for r in range(len(ROUNDS)))
RTOL, ATOL = 1e-4, 1e-5

TRAINING = ClientTraining(lr=LR, batch_size=B, num_epochs=EPOCHS)
FACTORIES = {
    "fedrep": lambda table="dense": fedrep(MODEL, personal_layers=(-1,),
                                           head_epochs=HEAD_EPOCHS,
                                           training=TRAINING._replace(num_epochs=BODY_EPOCHS),
                                           client_table=table),
    "fedper": lambda table="dense": fedper(MODEL, personal_layers=("Dense_1",),
                                           training=TRAINING, client_table=table),
    "lg_fedavg": lambda table="dense": lg_fedavg(MODEL, shared_layers=(-1,), training=TRAINING,
                                                 client_table=table),
    "fedavg_ft": lambda table="dense": fedavg_ft(MODEL, finetune_epochs=FT_EPOCHS,
                                                 finetune_lr=FT_LR, training=TRAINING,
                                                 client_table=table),
}
# (personal layers, phases (trains, epochs)) of the partial methods' references.
SPLITS = {"fedrep": (("Dense_1",), (("personal", HEAD_EPOCHS), ("shared", BODY_EPOCHS))),
          "fedper": (("Dense_1",), (("all", EPOCHS),)),
          "lg_fedavg": (("Dense_0",), (("all", EPOCHS),))}


@functools.cache
def _run(name, table="dense", rounds=len(ROUNDS), execution="auto"):
    """The library's states: [initial, after round 1, ...]."""
    alg = FACTORIES[name](table)
    apply = jax.jit(lambda state, cohort, key: alg.apply(state, cohort, key, execution))
    states = [alg.init(PARAMS, N)]
    for (ids, mask), key in list(zip(ROUNDS, ROUND_KEYS))[:rounds]:
        state, _ = apply(states[-1], helpers.cohort(TRAIN, ids, mask=mask), key)
        states.append(state)
    return alg, states


def _rows(alg, state):
    return alg.client_table.gather(state.client_states, jnp.arange(N, dtype=jnp.int32))


# --------------------------------------------------------------------------------------
# NumPy float64 reference of the MLP: parameters are {layer: {"kernel", "bias"}}.


def _to_np(params):
    return {name: {k: np.asarray(v, np.float64) for k, v in layer.items()}
            for name, layer in params["params"].items()}


def _grad(p, x, y):
    """Gradient of the mean softmax cross-entropy of relu(x W0 + b0) W1 + b1."""
    z = x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]
    h = np.maximum(z, 0.0)
    logits = h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]
    logits = logits - logits.max(-1, keepdims=True)
    d = np.exp(logits)
    d /= d.sum(-1, keepdims=True)
    d[np.arange(len(y)), y] -= 1.0
    d /= len(y)
    dz = (d @ p["Dense_1"]["kernel"].T) * (z > 0)
    return {"Dense_0": {"kernel": x.T @ dz, "bias": dz.sum(0)},
            "Dense_1": {"kernel": h.T @ d, "bias": d.sum(0)}}


def _batches(k: int, key, epochs: int):
    return helpers.local_batches(TRAIN, k, key, epochs, B)


def _sgd(params, batches, lr, layers):
    """SGD steps on ``layers`` only; the other layers are untouched."""
    p = {name: dict(layer) for name, layer in params.items()}
    for x, y in batches:
        g = _grad(p, x, y)
        for name in layers:
            p[name] = {k: p[name][k] - lr * g[name][k] for k in p[name]}
    return p


def _active(ids, mask):
    return [k for k, m in zip(ids, mask) if m]


def _average(server, updates, active, layers):
    """server[layer] - sum_k (n_k / n_S) (server[layer] - local_k[layer]) on ``layers``."""
    w = SIZES[active] / SIZES[active].sum()
    out = {name: dict(layer) for name, layer in server.items()}
    for name in layers:
        for leaf in out[name]:
            out[name][leaf] = server[name][leaf] - sum(
                wk * (server[name][leaf] - u[name][leaf]) for wk, u in zip(w, updates))
    return out


def partial_reference(personal, phases):
    """FedPer / FedRep / LG-FedAvg: (server, rows) after every round."""
    shared = [name for name in LAYERS if name not in personal]
    server = _to_np(PARAMS)
    rows = {k: {name: server[name] for name in personal} for k in range(N)}
    out = []
    for (ids, mask), round_key in zip(ROUNDS, ROUND_KEYS):
        active = _active(ids, mask)
        locals_ = []
        for k in active:
            p = {**server, **rows[k]}
            key = jax.random.fold_in(round_key, k)
            for i, (trains, epochs) in enumerate(phases):
                phase_key = key if i == 0 else jax.random.fold_in(key, i)
                layers = {"all": LAYERS, "personal": personal, "shared": shared}[trains]
                p = _sgd(p, _batches(k, phase_key, epochs), LR, layers)
            rows[k] = {name: p[name] for name in personal}
            locals_.append(p)
        server = _average(server, locals_, active, shared)
        out.append((server, dict(rows)))
    return out


def finetune_reference(rounds):
    """FedAvg-FT: (global, fine-tuned rows or None) after every round."""
    server = _to_np(PARAMS)
    rows = {k: None for k in range(N)}
    out = []
    for (ids, mask), round_key in list(zip(ROUNDS, ROUND_KEYS))[:rounds]:
        active = _active(ids, mask)
        locals_ = []
        for k in active:
            key = jax.random.fold_in(round_key, k)
            locals_.append(_sgd(server, _batches(k, key, EPOCHS), LR, LAYERS))
            if SIZES[k]:
                rows[k] = _sgd(server, _batches(k, jax.random.fold_in(key, 1), FT_EPOCHS),
                               FT_LR, LAYERS)
        server = _average(server, locals_, active, LAYERS)
        out.append((server, dict(rows)))
    return out


def _close(actual, expected, what):
    """``actual`` (flax params, optionally with a leading client axis) vs a reference
    {layer: {leaf}} restricted to the reference's layers."""
    for name, layer in expected.items():
        for leaf, value in layer.items():
            np.testing.assert_allclose(np.asarray(actual["params"][name][leaf]), value,
                                       rtol=RTOL, atol=ATOL, err_msg=f"{what}: {name}/{leaf}")


def _stack(rows_by_client, layers):
    return {name: {leaf: np.stack([rows_by_client[k][name][leaf] for k in range(N)])
                   for leaf in ("kernel", "bias")} for name in layers}


# --------------------------------------------------------------------------------------
# The layer split.


def test_model_layers_and_split_api():
    assert partial.model_layers(MODEL) == LAYERS
    deep = mlp((4,), 2, hidden=(3,) * 11)  # creation order, not name order (Dense_10)
    assert partial.model_layers(deep) == tuple(f"Dense_{i}" for i in range(12))
    assert partial.split_layers(deep, (-1,), "f").personal == ("Dense_11",)
    split = partial.split_layers(MODEL, (-1,), "personal_layers")
    assert split == partial.LayerSplit(("Dense_1",), ("Dense_0",))
    assert partial.split_layers(MODEL, ("Dense_1",), "f") == split
    assert partial.split_layers(MODEL, (-1,), "f", selects="shared") == partial.LayerSplit(
        ("Dense_0",), ("Dense_1",))
    head = split.personal_part(PARAMS)
    assert set(head["params"]) == {"Dense_1"}
    other = helpers.random_like(jax.eval_shape(lambda: PARAMS), 5)
    merged = split.merge(other, head)
    helpers.assert_trees_close(merged["params"]["Dense_1"], PARAMS["params"]["Dense_1"], 0, 0)
    helpers.assert_trees_close(merged["params"]["Dense_0"], other["params"]["Dense_0"], 0, 0)
    zeroed = split.zero_personal(PARAMS)
    assert all(np.all(np.asarray(v) == 0) for v in jax.tree.leaves(zeroed["params"]["Dense_1"]))
    helpers.assert_trees_close(zeroed["params"]["Dense_0"], PARAMS["params"]["Dense_0"], 0, 0)
    # A plain dict of arrays: its keys are the layers.
    plain = {"a": jnp.ones(2), "b": {"w": jnp.zeros(3)}}
    s = partial.LayerSplit(("b",), ("a",))
    assert set(s.personal_part(plain)) == {"b"} and set(s.shared_part(plain)) == {"a"}


@pytest.mark.parametrize("factory, field, value, match", [
    (fedrep, "personal_layers", ("Dense_9",), "unknown layer 'Dense_9'"),
    (fedrep, "personal_layers", (2,), "out of range"),
    (fedrep, "personal_layers", "Dense_1", "tuple of layer names"),
    (fedrep, "personal_layers", ("Dense_1", -1), "selected twice"),
    (fedrep, "personal_layers", (True,), "layer names or integer positions"),
    (fedper, "personal_layers", ("head",), "unknown layer 'head'"),
    (lg_fedavg, "shared_layers", ("Dense_2",), "unknown layer"),
    (lg_fedavg, "shared_layers", (-3,), "out of range"),
    (fedrep, "head_epochs", 0, "head_epochs"),
    (fedrep, "training", ClientTraining(num_epochs=1.5), "training.num_epochs"),
    (fedavg_ft, "finetune_epochs", 0, "finetune_epochs"),
    (fedavg_ft, "finetune_lr", -0.1, "finetune_lr"),
])
def test_bad_arguments_raise_naming_the_field(factory, field, value, match):
    with pytest.raises(ValueError, match=field) as info:
        factory(MODEL, **{field: value})
    assert match in str(info.value)


def test_hparams_name_keyword_arguments():
    import inspect
    for factory, table in ((fedrep, FEDREP_HPARAMS), (fedper, FEDPER_HPARAMS),
                           (lg_fedavg, LG_HPARAMS), (fedavg_ft, FT_HPARAMS)):
        params = inspect.signature(factory).parameters
        assert set(table) <= set(params), factory.__name__
        assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty
                   for name, p in params.items() if name != "model")


def test_frozen_layers_of_a_phase_are_bit_identical():
    split = partial.split_layers(MODEL, (-1,), "f")
    row = helpers.random_like(jax.eval_shape(lambda: split.personal_part(PARAMS)), 3)
    data = helpers.client(TRAIN, 1)
    broadcast = Broadcast(PARAMS, jnp.zeros((), jnp.int32))
    key = jax.random.key(7)
    for trains in ("personal", "shared"):
        update = jax.jit(partial.partial_training(
            MODEL, split, (partial.Phase(trains, 2),),
            training=ClientTraining(lr=LR, optimizer=optax.sgd, batch_size=B)))
        out, new_row = update(broadcast, row, data, jnp.int32(2 ** 30), key)
        # The head never reaches the server; the body moves only when trained.
        assert all(np.all(np.asarray(v) == 0) for v in jax.tree.leaves(
            split.personal_part(out.delta)))
        body_delta = jax.tree.leaves(split.shared_part(out.delta))
        head_same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new_row),
                                                             jax.tree.leaves(row)))
        if trains == "personal":
            assert all(np.all(np.asarray(v) == 0) for v in body_delta) and not head_same
        else:
            assert any(np.any(np.asarray(v) != 0) for v in body_delta) and head_same
        assert int(out.num_steps) == 2 * math.ceil(SIZES[1] / B)


# --------------------------------------------------------------------------------------
# One round at a time against the references.


@pytest.mark.parametrize("name", ["fedrep", "fedper", "lg_fedavg"])
def test_partial_methods_match_numpy_reference(name):
    personal, phases = SPLITS[name]
    shared = tuple(n for n in LAYERS if n not in personal)
    alg, states = _run(name)
    assert alg.evaluates == "personal"
    reference = partial_reference(personal, phases)
    ids = jnp.arange(N, dtype=jnp.int32)
    for r, ((server, rows), state) in enumerate(zip(reference, states[1:])):
        what = f"{name} round {r}"
        # The shared layers follow FedAvg on the shared part ...
        _close(state.params, {n: server[n] for n in shared}, what + " server")
        # ... and the server's personal layers never move.
        for n in personal:
            helpers.assert_trees_close(state.params["params"][n], PARAMS["params"][n], 0, 0)
        got = _rows(alg, state)
        assert set(got["params"]) == set(personal)
        _close(got, _stack(rows, personal), what + " rows")
        # Clients outside the cohort keep their rows bit for bit.
        before = _rows(alg, states[r])
        active = set(_active(*ROUNDS[r]))
        for k in set(range(N)) - active:
            for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(got)):
                np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))
        # Personal evaluation: the server's shared layers + the client's own layers.
        combined = alg.personal(state, ids)
        _close(combined, _stack({k: {**server, **rows[k]} for k in range(N)}, LAYERS),
               what + " personal")


def test_fedavg_ft_matches_numpy_reference():
    alg, states = _run("fedavg_ft", rounds=2)
    assert alg.evaluates == "personal"
    ids = jnp.arange(N, dtype=jnp.int32)
    for r, ((server, rows), state) in enumerate(zip(finetune_reference(2), states[1:])):
        _close(state.params, server, f"round {r} global")
        personal = alg.personal(state, ids)
        tuned = np.asarray(_rows(alg, state).tuned)
        for k in range(N):
            # Fine-tuned copy where the client fine-tuned, else the CURRENT global model.
            expected = rows[k] if rows[k] is not None else server
            assert tuned[k] == (rows[k] is not None)
            _close(jax.tree.map(lambda v: v[k], personal), expected, f"round {r} client {k}")
    # After round 1, clients 1, 4, 5 were never sampled and client 2 has no rows.
    assert [k for k in range(N) if np.asarray(_rows(alg, states[1]).tuned)[k] == 0] == [1, 2, 4, 5]


def test_fedavg_ft_default_stores_the_local_model():
    """finetune_epochs = finetune_lr = None: the row is the round's local model, theta^t
    after E epochs at eta_l with the client's own key (no extra loop)."""
    alg = fedavg_ft(MODEL, training=TRAINING)
    (ids, mask), key = ROUNDS[0], ROUND_KEYS[0]
    state, _ = jax.jit(alg.apply)(alg.init(PARAMS, N), helpers.cohort(TRAIN, ids, mask=mask),
                                  key)
    personal = alg.personal(state, jnp.arange(N, dtype=jnp.int32))
    start = _to_np(PARAMS)
    for k in range(N):
        if k in (0, 3):
            expected = _sgd(start, _batches(k, jax.random.fold_in(key, k), EPOCHS), LR, LAYERS)
        else:
            expected = _to_np(state.params)
        _close(jax.tree.map(lambda v: v[k], personal), expected, f"client {k}")


@functools.cache
def _fedavg_states():
    ref = fedavg(MODEL, training=TRAINING)
    apply = jax.jit(ref.apply)
    state, out = ref.init(PARAMS, N), []
    for (ids, mask), key in zip(ROUNDS, ROUND_KEYS):
        state, metrics = apply(state, helpers.cohort(TRAIN, ids, mask=mask), key)
        out.append((state, metrics))
    return out  # (state, metrics) after every round


@pytest.mark.parametrize("factory", [fedper, fedrep])
def test_every_layer_shared_is_fedavg(factory):
    """personal_layers=(): no client state, global evaluation, FedAvg's iterates (FedRep
    runs its body phase alone, num_epochs epochs)."""
    alg = factory(MODEL, personal_layers=(), training=TRAINING)
    assert alg.personal is None and alg.client_table is None
    apply = jax.jit(alg.apply)
    state = alg.init(PARAMS, N)
    for ((ids, mask), key), (ref, ref_metrics) in zip(zip(ROUNDS, ROUND_KEYS),
                                                      _fedavg_states()):
        state, metrics = apply(state, helpers.cohort(TRAIN, ids, mask=mask), key)
        helpers.assert_trees_close(state.params, ref.params, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(metrics["train_loss"], ref_metrics["train_loss"], rtol=1e-6)


def test_every_layer_shared_with_decay_and_clipping_is_fedavg():
    """FedPer with personal_layers=() honours training's weight decay and clipping as
    FedAvg does (one round, the same iterates)."""
    training = TRAINING._replace(weight_decay=0.05, clip_norm=0.5)
    (ids, mask), key = ROUNDS[0], ROUND_KEYS[0]
    cohort = helpers.cohort(TRAIN, ids, mask=mask)
    ref = fedavg(MODEL, training=training)
    expected, _ = jax.jit(ref.apply)(ref.init(PARAMS, N), cohort, key)
    alg = fedper(MODEL, personal_layers=(), training=training)
    state, _ = jax.jit(alg.apply)(alg.init(PARAMS, N), cohort, key)
    helpers.assert_trees_close(state.params, expected.params, rtol=1e-6, atol=1e-7)
    plain, _ = _fedavg_states()[0]
    assert not all(np.allclose(a, b) for a, b in zip(jax.tree.leaves(state.params),
                                                     jax.tree.leaves(plain.params)))


def test_fedrep_on_a_one_layer_model_trains_heads_only():
    """Logistic regression has no body: every layer is the head, so FedRep is local
    training of the heads (head_epochs) and the server model never moves."""
    model = helpers.logreg()
    params = helpers.init_params(model, 2)
    alg = fedrep(model, head_epochs=2, training=ClientTraining(lr=LR, batch_size=B))
    (ids, mask), key = ROUNDS[0], ROUND_KEYS[0]
    state, metrics = jax.jit(alg.apply)(alg.init(params, N),
                                        helpers.cohort(TRAIN, ids, mask=mask), key)
    helpers.assert_trees_close(state.params, params, 0, 0)
    w, b = helpers.logreg_to_numpy(params)
    heads = helpers.logreg_to_numpy(alg.personal(state, jnp.arange(N, dtype=jnp.int32)))
    for k in range(N):
        wk, bk = w.copy(), b.copy()
        if k in (0, 3):  # sampled, with rows: SGD on the client's own batches
            for x, y in _batches(k, jax.random.fold_in(key, k), 2):
                gw, gb = helpers.logreg_grad_numpy(wk, bk, x, y)
                wk, bk = wk - LR * gw, bk - LR * gb
        np.testing.assert_allclose(heads[0][k], wk, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(heads[1][k], bk, rtol=RTOL, atol=ATOL)
    assert float(metrics["update_norm"]) == 0.0


def test_lazy_table_and_vmapped_clients_give_the_same_iterates():
    """Heads in a lazy table, clients vmapped together (the frozen layers are closed
    over inside the vmapped local loops) == dense table, clients one at a time."""
    _, dense = _run("fedrep")  # "auto": one client at a time on CPU
    alg, lazy = _run("fedrep", "lazy", execution="vmap")
    ids = jnp.arange(N, dtype=jnp.int32)
    for a, b in zip(dense[1:], lazy[1:]):
        helpers.assert_trees_close(a.params, b.params, 1e-5, 1e-6)
        helpers.assert_trees_close(FACTORIES["fedrep"]().personal(a, ids),
                                   alg.personal(b, ids), 1e-5, 1e-6)


def test_personal_evaluation_uses_each_clients_combined_model():
    alg, states = _run("lg_fedavg")
    state = states[-1]
    ids = jnp.arange(N, dtype=jnp.int32)
    metrics = make_state_evaluator(MODEL, alg.personal)(state, DATA.test, ids)
    combined = alg.personal(state, ids)
    per_example = jax.jit(MODEL.per_example_metrics)
    server_loss = []
    for k in range(N):
        n = int(DATA.test.num_examples[k])
        if n == 0:
            continue
        batch = {key: v[k, :n] for key, v in DATA.test.examples.items()}
        own = per_example(jax.tree.map(lambda v: v[k], combined), batch)
        np.testing.assert_allclose(metrics["loss"][k], np.mean(own["loss"]), rtol=1e-5)
        np.testing.assert_allclose(metrics["accuracy"][k], np.mean(own["accuracy"]),
                                   rtol=1e-6)
        server_loss.append(np.mean(per_example(state.params, batch)["loss"]))
    # Not the server's model (whose local layers are the initial ones).
    assert not np.allclose(server_loss, [metrics["loss"][k] for k in range(N)
                                        if DATA.test.num_examples[k]])


def test_lg_fedavg_refuses_a_split_with_no_local_layer():
    """Sharing every layer would make LG-FedAvg FedAvg under another name: refused,
    the default (-1,) on a one-layer model included."""
    for model, shared in ((helpers.logreg(), (-1,)), (MODEL, LAYERS)):
        with pytest.raises(ValueError, match="^shared_layers"):
            lg_fedavg(model, shared_layers=shared)
    lg_fedavg(MODEL, shared_layers=(-1,))  # one local layer is enough


@pytest.mark.parametrize("name", ["fedrep", "fedper", "lg_fedavg"])
def test_improved_fraction_compares_each_clients_own_model(name):
    """``with_improvement`` on a partial-model method takes both losses on the model
    each participant is scored on: its own layers merged with the global ones,
    before and after the round (the global model would miss the kept layers)."""
    from fedjax_fair.core.algorithm import with_improvement
    from fedjax_fair.core.client import data_loss
    alg = FACTORIES[name]()
    wrapped = with_improvement(alg, MODEL)
    state = alg.init(PARAMS, N)
    for (ids, mask), key in zip(ROUNDS[:2], ROUND_KEYS[:2]):
        cohort = helpers.cohort(TRAIN, ids, mask=mask)
        new, metrics = jax.jit(wrapped.apply)(state, cohort, key)
        ids = jnp.asarray(ids, jnp.int32)
        own = lambda s: jax.vmap(lambda p, i: data_loss(
            MODEL, p, jax.tree.map(lambda v: v[i], TRAIN)))(alg.personal(s, ids), ids)
        before, after = np.asarray(own(state)), np.asarray(own(new))
        np.testing.assert_allclose(metrics["loss_after"], after, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(metrics["loss_before_personal"], before, rtol=1e-5,
                                   atol=1e-6)
        expect = np.mean((after <= before)[np.asarray(mask)])
        np.testing.assert_allclose(metrics["improved_fraction"], expect, rtol=1e-6)
        state = new
