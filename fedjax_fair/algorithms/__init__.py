"""The methods: one module per paper (its factory, the paper's symbols mapped to its
arguments), family pieces in ``families``, and the registry (``registry``) that the
command line, sweeps and tests read: ``REGISTRY``, ``ALGORITHMS``, ``get_method``,
``method_hparams``.

Every factory takes the model first and states its hyper-parameters as typed keyword
arguments with defaults (no ``**kwargs``); the clients' local training is one of them,
``training: ClientTraining`` (``fedavg(model, training=ClientTraining(lr=0.05))``).
"""
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.algorithms.registry import (ALGORITHMS, FAMILIES, REGISTRY, HParam, Method, base_name,
                                             build, default_training, get_algorithm,
                                             get_method, method_hparams)
from fedjax_fair.algorithms.registry import (  # the factories
    aaggff_d, aaggff_s, afedpd, afedpd_sam, afl, apfl, ditto, dqn_fed, fedadagrad, fedadam,
    fedadmm, fedasync, fedavg, fedbuff, fedavg_ft, fedavgm, fedcm, fedcvae, feddyn, fedevg, fedfa, fedfv, fedheal, fedlf,
    fedmax, fedmax_k, fedmgda_plus, fednew, fednl, fednl_pp, fedpd, fedper, fedprox,
    fedrep, fedsam, fedsoftmax, fedspeed, fedyogi, lg_fedavg, mifa, pfedme, propfair, qffl,
    scaffold, superfed, term)

__all__ = [
    "ALGORITHMS", "ClientTraining", "FAMILIES", "HParam", "Method", "REGISTRY", "aaggff_d", "aaggff_s", "afedpd",
    "afedpd_sam", "afl", "apfl", "base_name", "build", "default_training", "ditto", "dqn_fed", "fedadagrad", "fedadam",
    "fedadmm", "fedasync", "fedavg", "fedbuff", "fedavg_ft", "fedavgm", "fedcm", "fedcvae", "feddyn", "fedevg",
    "fedfa", "fedfv",
    "fedheal", "fedlf", "fedmax", "fedmax_k", "fedmgda_plus", "fednew", "fednl",
    "fednl_pp", "fedpd", "fedper", "fedprox", "fedrep", "fedsam", "fedsoftmax", "fedspeed",
    "fedyogi", "get_algorithm", "get_method", "lg_fedavg", "method_hparams", "mifa", "pfedme",
    "propfair", "qffl", "scaffold", "superfed", "term",
]
