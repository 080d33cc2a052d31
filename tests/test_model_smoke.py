"""A 3-round federated run of every registered model on mocked data (issue 3).

Each model trains with FedAvg on the dataset its paper uses, read through the real
loader path (TFDS builders under ``tfds.testing.mock_data``, LEAF JSON files written
here): partition, holdout, padding, memory plan, rounds, evaluation. Run them all
with ``pytest -m slow tests/test_model_smoke.py`` plus the default selection.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

import helpers
from fedjax_fair.algorithms import fedavg
from fedjax_fair.data import get_dataset, leaf
from fedjax_fair.models import MODELS, get_model
from fedjax_fair.drivers.runner import run
from fedjax_fair.core.client import ClientTraining

# model -> dataset (and whether the test is slow on a 2-core CPU)
SMOKE = {
    "logreg": "mnist", "mlp": "fashion_mnist", "cnn": "mnist",
    "femnist_cnn": "emnist_byclass", "lenet_fedpd": "cifar10", "mlp2": "cifar10",
    "cnn_ch": "mnist", "twonn": "mnist", "twocnn": "cifar10", "vgg9": "emnist_byclass",
    "char_lstm": "shakespeare", "resnet18_gn": "cifar10", "resnet10_gn_sn": "cifar10",
    "resnet9": "cifar100", "mobilenet": "cifar100",
}
# A dense and a convolutional model run by default (the char LSTM's vmap, gradients
# and NumPy reference are in test_model_zoo.py, its LEAF builder in
# test_builders.py); the rest are slow-marked to keep the default suite inside the
# CI budget.
FAST = {"twonn", "cnn_ch"}
# MobileNet's unpadded depthwise convolutions need >= 33x33 inputs (the TinyImageNet
# model); on 32x32 CIFAR it runs with one pixel of depthwise padding.
MODEL_ARGS = {"mobilenet": {"depthwise_padding": 1}}


def _shakespeare(root):
    text = ("But soft, what light through yonder window breaks? It is the east, and "
            "Juliet is the sun. Arise, fair sun, and kill the envious moon. ")
    for split, n in (("train", 12), ("test", 4)):
        data = {u: tuple(v[i:i + n] for v in leaf.char_windows(text)) for i, u in
                enumerate(("ROMEO", "JULIET", "NURSE"))}
        helpers.write_leaf(root / split / "plays.json", list(data), data)


def _dataset(name, monkeypatch, tmp_path):
    if name == "shakespeare":
        _shakespeare(tmp_path)
        return get_dataset("shakespeare", path=str(tmp_path))
    with helpers.mock_tfds(monkeypatch, num_examples=30):
        return get_dataset(name, num_clients=3, partition="iid", seed=0)


def test_every_registered_model_has_a_smoke_run():
    assert set(SMOKE) == set(MODELS)


@pytest.mark.parametrize("name", [m if m in FAST else pytest.param(m, marks=pytest.mark.slow)
                                  for m in SMOKE])
def test_three_round_smoke_run(name, monkeypatch, tmp_path):
    ds = _dataset(SMOKE[name], monkeypatch, tmp_path)
    model = get_model(name, ds.input_shape, ds.num_classes, **MODEL_ARGS.get(name, {}))
    alg = fedavg(model, training=ClientTraining(lr=0.01, batch_size=4, num_epochs=1, max_steps=2))
    params = jax.jit(model.init)(jax.random.key(0))
    result = run(alg, params, ds.host_data, jax.random.key(1), model=model, num_rounds=3,
                 cohort_size=2, eval_every=3, progress=False)
    assert [h["round"] for h in result.history] == [0, 3]
    assert np.isfinite(result.round_metrics["train_loss"]).all()
    assert np.isfinite(result.history[-1]["test_loss"])
    assert result.client_metrics["accuracy"].shape == (ds.num_clients,)
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
                         result.state.params, params)
    assert max(jax.tree.leaves(moved)) > 0
