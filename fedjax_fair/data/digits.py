"""scikit-learn's bundled 8x8 handwritten digits, partitioned across clients.

The UCI "Optical Recognition of Handwritten Digits" test set shipped with
scikit-learn (``sklearn.datasets.load_digits``): 1797 grey-scale 8x8 images, 10
classes, pixel counts 0..16. It needs no network, which makes it the real-data
federation of the test suite and the quick examples.

Build: scale pixels to [0, 1] (divide by 16), reshape to (8, 8, 1), partition all
1797 examples across clients with a partitioner of ``partition.py``, then split each
client's examples into local train/test with ``split_per_client``. Every example is
used exactly once, in one client's train or test split.
"""
from __future__ import annotations

import functools

import numpy as np

from fedjax_fair.data.federated import (Dataset, _check_seed, from_client_arrays,
                                        split_per_client)
from fedjax_fair.data.partition import PARTITIONERS

NUM_CLASSES = 10
INPUT_SHAPE = (8, 8, 1)


@functools.lru_cache(maxsize=1)
def _load() -> tuple[np.ndarray, np.ndarray]:
    """(x float32 [1797, 8, 8, 1] in [0, 1], y int32 [1797]), read-only and cached."""
    from sklearn.datasets import load_digits  # deferred: importing sklearn takes a while
    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32).reshape(-1, *INPUT_SHAPE)
    y = bunch.target.astype(np.int32)
    x.setflags(write=False)
    y.setflags(write=False)
    return x, y


def digits(num_clients: int = 20, partition: str = "dirichlet", alpha: float = 0.5,
           shards_per_client: int = 2, min_size: int = 10, test_fraction: float = 0.2,
           seed: int = 0) -> Dataset:
    """The 8x8 digits federation.

    Args:
      num_clients: number of clients N.
      partition: "iid", "dirichlet" (label skew, per-class Dir(alpha)) or "shards"
        (McMahan et al. 2017, shards_per_client shards of sorted labels).
      alpha: Dirichlet concentration (partition="dirichlet" only).
      shards_per_client: shards per client (partition="shards" only).
      min_size: smallest client before the train/test split (partition="dirichlet").
      test_fraction: per-client test share in (0, 1).
      seed: seeds both the partition and the per-client split.

    Returns a Dataset named "digits" with input_shape (8, 8, 1).
    """
    if partition not in PARTITIONERS:
        raise ValueError(f"partition: unknown name {partition!r}; allowed: {sorted(PARTITIONERS)}")
    seed = _check_seed(seed)
    params = {"dirichlet": {"alpha": alpha, "min_size": min_size},
              "shards": {"shards_per_client": shards_per_client}}.get(partition, {})
    x, y = _load()
    parts = PARTITIONERS[partition](y, num_clients, seed, **params)
    split = split_per_client(np.random.default_rng([seed, 1]), [x[i] for i in parts],
                             [y[i] for i in parts], test_fraction)
    info = {"num_clients": int(num_clients), "partition": partition,
            "partition_params": {k: (float(v) if k == "alpha" else int(v))
                                 for k, v in params.items()},
            "test_fraction": float(test_fraction), "seed": seed,
            "client_sizes": [int(len(i)) for i in parts],
            "source": "sklearn.datasets.load_digits (UCI optdigits, 1797 images)"}
    return from_client_arrays(*split, name="digits", num_classes=NUM_CLASSES, info=info)
