"""``algorithm.transformed`` and ``RoundTransform`` (fedjax_fair/core/algorithm.py): one
line puts any method built over ``compose`` under attack (core/attacks.py), under a
robust aggregator (core/robust.py) or under client-level DP (core/privacy.py), checked
on whole rounds against what each transform means."""
import jax
import numpy as np
import pytest

from fedjax_fair.algorithms import build
from fedjax_fair.core import attacks, privacy, robust
from fedjax_fair.core.algorithm import RoundTransform, transformed
from fedjax_fair.core.client import ClientTraining
from helpers import assert_trees_close, cohort, init_params, logreg, tiny_federation, tree_sub

TRAINING = ClientTraining(lr=0.1, batch_size=4)
IDS = (0, 1, 3, 4)  # clients with data


def _round(name, transforms=(), data=None, key=1, **kwargs):
    """(new params, round metrics, old params) of one round of ``name`` on clients
    ``IDS`` built under ``transforms``."""
    model = logreg()
    data = data or tiny_federation()
    with transformed(*transforms) as block:
        alg = build(name, model, training=TRAINING, **kwargs)
    assert block.composed >= 1 or not transforms
    params = init_params(model)
    state, metrics = jax.jit(alg.apply)(alg.init(params, data.num_clients),
                                        cohort(data.train, IDS), jax.random.key(key))
    return state, metrics, params


def _flags(*ids, n=6):
    flags = np.zeros(n, bool)
    flags[list(ids)] = True
    return flags


def test_every_client_sign_flipping_reverses_fedavgs_step():
    clean, _, params = _round("fedavg")
    attacked, metrics, _ = _round("fedavg", [attacks.attack_transform(
        attacks.Attack("sign_flip", scale=1.0), _flags(*range(6)))])
    assert_trees_close(tree_sub(attacked.params, params), tree_sub(params, clean.params))
    assert np.asarray(metrics["attack/malicious"]).all()


def test_only_the_malicious_clients_uploads_change():
    """One sign-flipping client of four under uniform weights moves FedAvg's step by
    -2 w_k Delta_k: the difference to the clean round is the attacker's own update."""
    clean, _, params = _round("fedavg", weight_by_size=False)
    attacked, metrics, _ = _round("fedavg", [attacks.attack_transform(
        attacks.Attack("sign_flip", scale=1.0), _flags(3))], weight_by_size=False)
    np.testing.assert_array_equal(metrics["attack/malicious"], [False, False, True, False])
    shift = tree_sub(attacked.params, clean.params)  # = +2 (1/4) Delta_3 ...
    solo = _round_of_one(3, params)  # ... with Delta_3 = params - client 3's model
    assert_trees_close(shift, jax.tree.map(lambda d: 0.5 * d, solo), rtol=1e-4, atol=1e-6)


def _round_of_one(client, params):
    """Delta of ``client`` alone: a FedAvg round with that client only."""
    model = logreg()
    data = tiny_federation()
    alg = build("fedavg", model, training=TRAINING)
    state, _ = jax.jit(alg.apply)(alg.init(params, data.num_clients),
                                  cohort(data.train, (client,)), jax.random.key(1))
    return tree_sub(params, state.params)


def test_label_flipping_trains_on_the_flipped_labels():
    data = tiny_federation()
    flipped = data._replace(train=data.train._replace(  # padding rows are masked anyway
        examples={**data.train.examples, "y": 2 - data.train.examples["y"]}))
    expected, _, _ = _round("qffl", data=flipped)
    attacked, _, _ = _round("qffl", [attacks.attack_transform(
        attacks.Attack("label_flip", num_classes=3), _flags(*range(6)))])
    assert_trees_close(attacked.params, expected.params)


def test_a_robust_aggregator_replaces_the_methods_own():
    direct, _, _ = _round("fedavg", aggregator=robust.coordinate_median())
    hooked, metrics, _ = _round("fedavg", [RoundTransform(
        aggregator=robust.parse("median"))])
    assert_trees_close(hooked.params, direct.params)
    bounded, metrics, _ = _round("fedavg", [RoundTransform(
        aggregator=robust.parse("norm_bound:0.01"))])
    assert "server/clip_scale" in metrics  # norm bounding wraps the method's aggregator
    with pytest.raises(ValueError, match="^robust"):
        robust.parse("trimmed_mean:0.7")


def test_dp_without_noise_and_clipping_is_the_plain_average():
    plain, _, _ = _round("fedavg", weight_by_size=False)
    dp = privacy.ClientDP(noise_multiplier=0.0, clip=1e6)
    private, metrics, _ = _round("fedavg", [privacy.private_transform(dp)],
                                 weight_by_size=False)
    assert_trees_close(private.params, plain.params)
    assert float(metrics["server/dp_clipped_fraction"]) == 0.0


def test_dp_noise_is_calibrated_keyed_and_vmaps_over_seeds():
    dp = privacy.ClientDP(noise_multiplier=1.0, clip=0.5)
    one, metrics, params = _round("fedavg", [privacy.private_transform(dp)], key=3)
    again, _, _ = _round("fedavg", [privacy.private_transform(dp)], key=3)
    other, _, _ = _round("fedavg", [privacy.private_transform(dp)], key=4)
    assert_trees_close(one.params, again.params, rtol=0, atol=0)
    assert not np.allclose(one.params["params"]["Dense_0"]["kernel"],
                           other.params["params"]["Dense_0"]["kernel"])
    assert float(metrics["server/dp_noise_std"]) == pytest.approx(1.0 * 2 * 0.5 / len(IDS))
    model, data = logreg(), tiny_federation()
    with transformed(privacy.private_transform(dp)):
        alg = build("fedavg", model, training=TRAINING)
    keys = jax.random.split(jax.random.key(0), 3)
    states = jax.vmap(lambda k: alg.apply(alg.init(params, data.num_clients),
                                          cohort(data.train, IDS), k)[0].params)(keys)
    assert jax.tree.leaves(states)[0].shape[0] == 3


def test_transforms_apply_only_inside_the_block():
    model = logreg()
    block = transformed(privacy.private_transform(privacy.ClientDP(1.0, 1.0)))
    with block:
        inside = build("fedavg", model, training=TRAINING)
    outside = build("fedavg", model, training=TRAINING)
    params = init_params(model)
    assert block.composed == 1
    assert isinstance(inside.init(params, 6).aggregator_state, privacy.ClipState)
    assert outside.init(params, 6).aggregator_state == ()
    with pytest.raises(TypeError, match="^transforms"):
        transformed("dp")
