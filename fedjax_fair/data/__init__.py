"""Federated datasets (docs/datasets.md): builders, partitioners and the registry.

``get_dataset(name, **kwargs)`` builds a registered dataset; ``DATASET_PARAMS[name]``
lists each builder's keyword arguments and their defaults (for the CLI).
"""
from __future__ import annotations

import inspect

from fedjax_fair.data.builders import LEAF_DATASETS, TFDS_DATASETS, federate
from fedjax_fair.data.digits import digits
from fedjax_fair.data.disk import disk_federation
from fedjax_fair.data.federated import (Dataset, from_client_arrays, from_padded,
                                        hold_out_validation, padding_report, resplit,
                                        split_per_client,
                                        stack_clients, zeros_block)
from fedjax_fair.data.femnist_like import femnist_like
from fedjax_fair.data.partition import PARTITIONERS, dirichlet, iid, shards
from fedjax_fair.data.synthetic import synthetic
from fedjax_fair import hparams as H

DATASETS = {"synthetic": synthetic, "digits": digits, "femnist_like": femnist_like,
            **TFDS_DATASETS, **LEAF_DATASETS, "disk": disk_federation}


def _params(builder) -> dict:
    return {p.name: p.default for p in inspect.signature(builder).parameters.values()}


DATASET_PARAMS = {name: _params(builder) for name, builder in DATASETS.items()}


def get_dataset(name: str, **kwargs) -> Dataset:
    """Builds the dataset registered as ``name`` with keyword arguments ``kwargs``."""
    if name not in DATASETS:
        raise H.FieldError("dataset", f"unknown name {name!r}; allowed: {sorted(DATASETS)}")
    unknown = sorted(set(kwargs) - set(DATASET_PARAMS[name]))
    if unknown:
        raise ValueError(f"dataset {name!r}: unknown parameter(s) {unknown}; "
                         f"allowed: {sorted(DATASET_PARAMS[name])}")
    return DATASETS[name](**kwargs)


__all__ = ["DATASETS", "DATASET_PARAMS", "Dataset", "PARTITIONERS", "digits", "dirichlet", "disk_federation",
           "federate",
           "femnist_like", "from_client_arrays", "from_padded", "get_dataset", "iid",
           "hold_out_validation", "padding_report", "resplit", "shards", "split_per_client", "stack_clients", "synthetic",
           "zeros_block"]
