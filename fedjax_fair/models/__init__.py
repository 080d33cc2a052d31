"""Networks behind the ``Model`` container; ``get_model(name, ...)`` builds one by name.

simple.py: logistic regression, MLP, small CNN. zoo.py: the papers' vision networks
(LEAF FEMNIST CNN, A-FedPD LeNet, DQN-Fed MLP, the computational-heterogeneity CNN,
SuPerFed's TwoNN / TwoCNN / VGG9). resnet.py: GroupNorm ResNet-18 (CIFAR stem),
FedEvg's ResNet-10 with a spectral-normalised head, SuPerFed's ResNet9 and
MobileNet. text.py: the Shakespeare character LSTM.
"""
from fedjax_fair.models import resnet, text, zoo
from fedjax_fair.models.base import (INITIALIZERS, Model, cross_entropy, from_flax,
                                     with_initializer)
from fedjax_fair.models.simple import cnn, logistic_regression, mlp
from fedjax_fair import hparams as H

MODELS = {"logreg": logistic_regression, "mlp": mlp, "cnn": cnn, **zoo.MODELS, **resnet.MODELS,
          **text.MODELS}


def get_model(name: str, input_shape, num_classes, **kwargs) -> Model:
    if name not in MODELS:
        raise H.FieldError("model", f"unknown name {name!r}; allowed: {sorted(MODELS)}")
    return MODELS[name](tuple(input_shape), int(num_classes), **kwargs)


__all__ = ["INITIALIZERS", "Model", "MODELS", "with_initializer", "cnn", "cross_entropy", "from_flax", "get_model",
           "logistic_regression", "mlp"]
