"""Malicious clients (scenarios/attacks.py): who is malicious, what each attack changes
(exactly the malicious unmasked clients, exactly the quantity it should), literal NumPy
references, determinism of the random updates, vmap over keys and over the scale, the
benign / malicious summaries, and a few hand-run FedAvg rounds with sign flippers."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_fair import hparams as H
from fedjax_fair.scenarios import attacks as A
from fedjax_fair.core.types import ClientOutput

from helpers import NUM_CLASSES, cohort, tiny_federation

N = 10
IDS = np.array([7, 2, 9, 0, 5, 3], np.int32)  # cohort slots -> client ids, scrambled
MASK = np.array([True, True, False, True, True, True])  # client 9's slot is padding
BAD = (2, 5, 9)  # malicious clients: 2 and 5 unmasked, 9 masked
IS_BAD = np.isin(np.arange(N), BAD)
HIT = np.array([False, True, False, False, True, False])  # malicious and unmasked slots
KEY = jax.random.key(11)


def fake_outputs(k=len(IDS), shape=(4, 3), seed=0) -> ClientOutput:
    rng = np.random.default_rng(seed)

    def draw(*s):
        return jnp.asarray(rng.normal(size=s), jnp.float32)

    return ClientOutput(delta={"w": draw(k, *shape), "b": draw(k, shape[-1])},
                        loss_before=draw(k), num_examples=jnp.arange(1, k + 1, dtype=jnp.int32),
                        num_steps=jnp.full((k,), 3, jnp.int32), extra={"c": draw(k, 2)},
                        train_loss=draw(k))


OUTPUTS = fake_outputs()


@functools.cache
def jitted(attack):
    return jax.jit(lambda o, i, m, b, k: A.poison_outputs(o, i, m, b, attack, k, None))


def poison(attack, outputs=OUTPUTS, ids=IDS, mask=MASK, key=KEY):
    return jitted(attack)(outputs, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(IS_BAD), key)


def assert_only_delta_rows(new: ClientOutput, old: ClientOutput, changed):
    """Every field but ``delta`` equal; delta rows outside ``changed`` equal."""
    for field in ("loss_before", "num_examples", "num_steps", "extra", "train_loss"):
        jax.tree.map(np.testing.assert_array_equal, getattr(new, field), getattr(old, field))
    for name in old.delta:
        np.testing.assert_array_equal(np.asarray(new.delta[name])[~changed],
                                      np.asarray(old.delta[name])[~changed])


# --------------------------------------------------------------- malicious_ids


def test_malicious_ids_fraction_is_seeded_with_the_floor_count():
    a = A.malicious_ids(N, fraction=0.2, seed=3)
    assert a.dtype == bool and a.shape == (N,) and a.sum() == 2
    np.testing.assert_array_equal(a, A.malicious_ids(N, fraction=0.2, seed=3))
    draws = {tuple(np.flatnonzero(A.malicious_ids(N, fraction=0.2, seed=s))) for s in range(8)}
    assert len(draws) > 1  # the seed matters
    # for one seed, a larger fraction's clients include a smaller one's
    assert np.all(A.malicious_ids(N, fraction=0.5, seed=3)[a])
    assert A.malicious_ids(100, fraction=0.29).sum() == 29  # not 28 (float error)
    assert A.malicious_ids(10, fraction=0.05).sum() == 0  # floor, never rounded up
    assert A.malicious_ids(15, fraction=0.1).sum() == 1
    assert A.malicious_ids(7, fraction=1.0).all() and not A.malicious_ids(7, fraction=0.0).any()
    assert not A.malicious_ids(7).any()  # neither: nobody


def test_malicious_ids_explicit_list():
    np.testing.assert_array_equal(A.malicious_ids(N, ids=[9, 0, 4]),
                                  np.isin(np.arange(N), [0, 4, 9]))
    np.testing.assert_array_equal(A.malicious_ids(N, ids=np.array([3])), np.arange(N) == 3)
    assert not A.malicious_ids(N, ids=[]).any()


@pytest.mark.parametrize("fraction", [1.5, -0.1, float("nan"), True, "half"])
def test_malicious_ids_refuses_a_bad_fraction(fraction):
    with pytest.raises(H.FieldError) as e:
        A.malicious_ids(N, fraction=fraction)
    assert e.value.field == "malicious_fraction"


@pytest.mark.parametrize("ids", [[10], [-1], [1, 1], [1.5], [True], [[1, 2]]])
def test_malicious_ids_refuses_bad_ids(ids):
    with pytest.raises(H.FieldError) as e:
        A.malicious_ids(N, ids=ids)
    assert e.value.field == "malicious_ids"


def test_malicious_ids_refuses_both_a_fraction_and_ids():
    with pytest.raises(H.FieldError, match="malicious_ids"):
        A.malicious_ids(N, fraction=0.1, ids=[1])


@pytest.mark.parametrize("attack,field", [
    (A.Attack("nope"), "attack.kind"),
    (A.Attack("sign_flip", scale=-1.0), "attack.scale"),
    (A.Attack("sign_flip", scale=0.0), "attack.scale"),
    (A.Attack("gaussian", std=-0.1), "attack.std"),
    (A.Attack("label_flip"), "attack.num_classes"),
    (A.Attack("label_flip", num_classes=1), "attack.num_classes"),
    (A.Attack("label_flip", flip_map=(0, 3, 1)), "attack.flip_map"),
    (A.Attack("label_flip", num_classes=4, flip_map=(1, 0)), "attack.flip_map"),
])
def test_check_attack_names_the_bad_field(attack, field):
    with pytest.raises(H.FieldError) as e:
        A.check_attack(attack)
    assert e.value.field == field


# ----------------------------------------------------------------- label flipping


def test_label_flip_changes_only_the_real_labels_of_malicious_clients():
    train = tiny_federation().train  # 6 clients, sizes (7, 12, 0, 3, 9, 5), M = 12
    ids = [3, 0, 5, 2, 1, 4]
    bad = np.isin(np.arange(6), [0, 4, 2])  # client 2 has no rows
    data = cohort(train, ids).data
    attack = A.Attack("label_flip", num_classes=NUM_CLASSES)
    new = jax.jit(lambda d, i, b: A.poison_data(d, i, b, attack))(
        data, jnp.asarray(ids), jnp.asarray(bad))
    y, new_y = np.asarray(data.examples["y"]), np.asarray(new.examples["y"])
    for slot, k in enumerate(ids):
        n = int(data.num_examples[slot])
        expected = y[slot].copy()
        if bad[k]:
            expected[:n] = NUM_CLASSES - 1 - y[slot, :n]  # padding rows stay 0
        np.testing.assert_array_equal(new_y[slot], expected)
    assert (new_y != y).any()
    np.testing.assert_array_equal(new.examples["x"], data.examples["x"])
    np.testing.assert_array_equal(new.mask, data.mask)
    np.testing.assert_array_equal(new.num_examples, data.num_examples)
    # one client without a cohort axis gives its row of the cohort's result
    one = A.poison_data(jax.tree.map(lambda v: v[5], data), jnp.int32(4),
                        jnp.asarray(bad), attack)
    np.testing.assert_array_equal(one.examples["y"], new_y[5])
    assert (new_y[5] != y[5]).any()


def test_label_flip_map_and_unknown_labels():
    train = tiny_federation().train
    data = cohort(train, [1]).data
    y = np.asarray(data.examples["y"]).copy()
    y[0, 0] = 7  # outside [0, 3): left as it is
    data = data._replace(examples={**data.examples, "y": jnp.asarray(y)})
    attack = A.Attack("label_flip", flip_map=(1, 2, 0))
    new = np.asarray(A.poison_data(data, jnp.array([1]), jnp.ones((6,), bool), attack)
                     .examples["y"])
    n = int(data.num_examples[0])
    expected = y.copy()
    expected[0, 1:n] = np.array([1, 2, 0])[y[0, 1:n]]
    np.testing.assert_array_equal(new, expected)


@pytest.mark.parametrize("kind", A.OUTPUT_KINDS)
def test_output_attacks_leave_the_data_alone(kind):
    data = cohort(tiny_federation().train, [0, 1]).data
    assert A.poison_data(data, jnp.array([0, 1]), jnp.ones((6,), bool), A.Attack(kind)) is data


def test_label_flip_leaves_the_outputs_alone():
    new, info = poison(A.Attack("label_flip", num_classes=3))
    assert_only_delta_rows(new, OUTPUTS, np.zeros(len(IDS), bool))
    np.testing.assert_array_equal(info["malicious"], HIT)


# ----------------------------------------------------------------- model poisoning


@pytest.mark.parametrize("attack,factor", [
    (A.Attack("sign_flip", scale=3.0), -3.0),
    (A.Attack("sign_flip"), -1.0),
    (A.Attack("scaled_replacement", scale=4.0), 4.0),
    (A.Attack("scaled_replacement"), float(MASK.sum())),  # gamma = unmasked clients
])
def test_scaling_attacks_match_their_formula(attack, factor):
    new, info = poison(attack)
    np.testing.assert_array_equal(info["malicious"], HIT)
    assert_only_delta_rows(new, OUTPUTS, HIT)
    for name, old in OUTPUTS.delta.items():
        ref = np.asarray(old, np.float64).copy()
        ref[HIT] *= factor
        np.testing.assert_allclose(np.asarray(new.delta[name]), ref, rtol=1e-6)
        assert not np.allclose(np.asarray(new.delta[name])[HIT], np.asarray(old)[HIT])


def test_gaussian_updates_replace_only_malicious_unmasked_deltas():
    new, info = poison(A.Attack("gaussian", std=0.5))
    np.testing.assert_array_equal(info["malicious"], HIT)
    assert_only_delta_rows(new, OUTPUTS, HIT)
    for name, old in OUTPUTS.delta.items():
        assert not np.any(np.isclose(np.asarray(new.delta[name])[HIT], np.asarray(old)[HIT]))


def test_gaussian_updates_have_the_requested_std():
    big = fake_outputs(k=2, shape=(400, 250))  # 100,250 coordinates per client
    ids, mask = np.array([2, 5]), np.array([True, True])
    for std in (0.7, 3.0):
        new, _ = poison(A.Attack("gaussian", std=std), big, ids, mask)
        for row in range(2):
            flat = np.concatenate([np.ravel(v[row]) for v in new.delta.values()])
            assert abs(flat.std() / std - 1) < 0.01 and abs(flat.mean()) < 0.01 * std
    # std=None: the client's own update's std (Ditto's random updates)
    scaled = big._replace(delta=jax.tree.map(lambda v: 2.5 * v, big.delta))
    new, _ = poison(A.Attack("gaussian"), scaled, ids, mask)
    own = np.concatenate([np.ravel(v[0]) for v in scaled.delta.values()]).std()
    flat = np.concatenate([np.ravel(v[0]) for v in new.delta.values()])
    assert abs(own / 2.5 - 1) < 0.01 and abs(flat.std() / own - 1) < 0.01


def test_gaussian_updates_are_deterministic_per_key_and_client():
    attack = A.Attack("gaussian", std=1.0)
    everyone = np.ones(len(IDS), bool)
    new, _ = poison(attack, mask=everyone)
    again, _ = poison(attack, mask=everyone)
    jax.tree.map(np.testing.assert_array_equal, new.delta, again.delta)
    # the cohort order does not matter: a client's draw follows its id, not its slot
    perm = np.array([4, 2, 0, 5, 1, 3])
    shuffled = jax.tree.map(lambda v: v[perm], OUTPUTS)
    moved, _ = poison(attack, shuffled, IDS[perm], everyone)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a)[perm], b),
                 new.delta, moved.delta)
    # two malicious clients draw different updates; another key draws others
    w = np.asarray(new.delta["w"])
    assert not np.allclose(w[1], w[4])
    other, _ = poison(attack, mask=everyone, key=jax.random.key(12))
    assert not np.allclose(np.asarray(other.delta["w"])[HIT], w[HIT])
    # and equal A.gaussian_update for the client alone
    alone = A.gaussian_update(KEY, 5, jax.tree.map(lambda v: v[4], OUTPUTS.delta), 1.0)
    np.testing.assert_array_equal(alone["w"], w[4])


def test_vmap_over_keys_equals_one_call_per_key():
    attack = A.Attack("gaussian", std=0.3)
    keys = jax.random.split(KEY, 3)
    fn = lambda k: A.poison_outputs(OUTPUTS, IDS, MASK, jnp.asarray(IS_BAD), attack, k, None)
    batched, info = jax.jit(jax.vmap(fn))(keys)
    assert info["malicious"].shape == (3, len(IDS))
    for i in range(3):
        single, _ = fn(keys[i])
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a[i], b, rtol=1e-6),
                     batched.delta, single.delta)


@pytest.mark.parametrize("kind,sign", [("sign_flip", -1.0), ("scaled_replacement", 1.0)])
def test_vmap_over_the_scale(kind, sign):
    scales = jnp.array([1.0, 2.5, 10.0])

    def fn(s):
        return A.poison_outputs(OUTPUTS, IDS, MASK, jnp.asarray(IS_BAD),
                                A.Attack(kind, scale=s), KEY, None)[0].delta

    batched = jax.jit(jax.vmap(fn))(scales)
    for i, s in enumerate(np.asarray(scales)):
        for name, old in OUTPUTS.delta.items():
            ref = np.asarray(old, np.float64).copy()
            ref[HIT] *= sign * s
            np.testing.assert_allclose(batched[name][i], ref, rtol=1e-6)


def test_vmap_over_the_std():
    stds = jnp.array([0.5, 2.0])
    fn = lambda s: A.poison_outputs(OUTPUTS, IDS, MASK, jnp.asarray(IS_BAD),
                                    A.Attack("gaussian", std=s), KEY, None)[0].delta["w"]
    batched = np.asarray(jax.vmap(fn)(stds))
    # one key: the same normal draws, scaled by each std
    np.testing.assert_allclose(batched[1][HIT], 4.0 * batched[0][HIT], rtol=1e-6)


# ------------------------------------------------------------------------ reports


def test_split_summary_keeps_malicious_clients_out_of_the_benign_summary():
    from fedjax_fair.drivers.runner import attacked_summary, split_summary
    rng = np.random.default_rng(0)
    per_client = {"accuracy": rng.uniform(0.6, 0.9, N), "loss": rng.uniform(0.2, 1.0, N),
                  "num_examples": rng.integers(1, 20, N)}
    per_client["accuracy"][IS_BAD] = 0.0  # the attackers' own test accuracy
    out = attacked_summary(per_client, IS_BAD)
    benign = {k: v[~IS_BAD] for k, v in per_client.items()}
    assert out["benign"] == split_summary(benign, "test")
    assert out["benign"]["accuracy_worst_10%"] >= 0.6  # no attacker among the worst
    assert out["malicious"]["accuracy_mean"] == 0.0
    full = split_summary(per_client, "test")
    assert full["accuracy_worst_10%"] == 0.0 < out["benign"]["accuracy_worst_10%"]
    assert attacked_summary(per_client, np.zeros(N, bool))["malicious"] == {}
    validation = attacked_summary(per_client, IS_BAD, "validation")
    assert validation["benign"] == split_summary(benign, "validation")
    with pytest.raises(H.FieldError, match="is_malicious"):
        attacked_summary(per_client, IS_BAD[:5])
    assert split_summary(per_client, "test", ~IS_BAD) == out["benign"]  # runner.run's


@pytest.mark.parametrize("keep", [IS_BAD[:5], np.zeros(N, bool), IS_BAD.astype(int)])
def test_summary_clients_must_be_a_bool_mask_of_every_client_keeping_some(keep):
    from fedjax_fair.drivers.runner import check_summary_clients
    with pytest.raises(H.FieldError, match="summary_clients"):
        check_summary_clients(keep, N)
    assert check_summary_clients(None, N) is None


# ------------------------------------------------------- hand-run FedAvg rounds


def test_sign_flippers_push_fedavg_away_from_the_honest_mean():
    """10 clients run real local SGD (core/client.py); 2 of them flip and scale their
    updates by 10. The server step (stack, poison, aggregators.weighted_mean) then
    points against the honest clients' mean update, and the benign loss rises while a
    clean run's falls."""
    import optax
    from fedjax_fair.core.aggregators import weighted_mean
    from fedjax_fair.core.client import ClientTraining, local_training
    from fedjax_fair.core.types import Broadcast, ServerContext
    from helpers import init_params, logreg

    data = tiny_federation(train_sizes=(8,) * N, test_sizes=(2,) * N).train
    ids = jnp.arange(N, dtype=jnp.int32)
    bad = A.malicious_ids(N, fraction=0.2, seed=0)
    assert bad.sum() == 2
    update = local_training(logreg(), ClientTraining(optimizer=optax.sgd(0.3), batch_size=8,
                                                     num_epochs=2))
    aggregator, attack = weighted_mean(), A.Attack("sign_flip", scale=10.0)
    mask = jnp.ones((N,), bool)

    @functools.partial(jax.jit, static_argnums=2)
    def server_step(params, r, attacked):
        keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(r), i))(ids)
        outputs, _ = jax.vmap(update, in_axes=(None, None, 0, 0, 0))(
            Broadcast(params, r), (), data, jnp.full((N,), 2 ** 30, jnp.int32), keys)
        honest = jax.tree.map(lambda d: jnp.mean(d[~bad], 0), outputs.delta)
        if attacked:
            outputs, info = A.poison_outputs(outputs, ids, mask, jnp.asarray(bad), attack,
                                             jax.random.fold_in(jax.random.key(r),
                                                                A.ATTACK_KEY_ID), params)
        weights = outputs.num_examples / jnp.sum(outputs.num_examples)
        ctx = ServerContext(params, r, jax.random.key(0), ids, mask)
        direction, _, _ = aggregator.aggregate((), outputs, weights.astype(jnp.float32), ctx)
        flat = lambda t: jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(t)])
        a, b = flat(direction), flat(honest)
        cosine = jnp.dot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b))
        benign_loss = jnp.sum(jnp.where(bad, 0.0, outputs.loss_before)) / (N - bad.sum())
        return jax.tree.map(lambda p, d: p - d, params, direction), cosine, benign_loss

    for attacked in (False, True):
        params, cosines, losses = init_params(logreg(), 0), [], []
        for r in range(3):
            params, cosine, loss = server_step(params, jnp.int32(r), attacked)
            cosines.append(float(cosine))
            losses.append(float(loss))
        if attacked:
            assert max(cosines) < 0.0, cosines  # against the honest mean, every round
            assert losses[-1] > losses[0], losses
        else:
            assert min(cosines) > 0.9, cosines
            assert losses[-1] < losses[0], losses
