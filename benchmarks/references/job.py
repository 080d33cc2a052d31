"""The benchmark's job, shared by every reference (standard library and NumPy only, so
the PyTorch and fedjax 0.0.17 references import it under their own interpreters).

A job is a JSON-able dict:

    model        "logreg" | "mlp" | "cnn"
    hidden       MLP widths, e.g. [200, 200]
    channels, dense   CNN widths (LEAF FEMNIST CNN: [32, 64], 512)
    input_shape  [28, 28, 1]; num_classes 62
    cohort       K clients; sizes: their n_k (K ints, multiples of batch)
    batch, steps B and S: every client takes S local SGD steps of B rows, the epochs
                 reshuffled (n_k is a multiple of B, so no batch is partial and the
                 repeat-then-batch order of fedjax's shuffle_repeat_batch and the
                 per-epoch order of the others draw the same number of rows)
    lr           client learning rate (server: FedAvg, sgd(1.0) on the weighted mean)
    base_clients distinct clients whose data exist (client k reads base k % base_clients)
    padded       rows stored per client (M)
    params_file  .npz of the initial parameters ("Dense_0/kernel", ... flax names, HWIO
                 convolution kernels, NHWC flattening), so every reference starts from
                 the same model
"""
from __future__ import annotations

import json
import math

import numpy as np


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def save(job: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(job, f)


def epoch_rows(rng: np.random.Generator, n: int, batch: int, steps: int) -> np.ndarray:
    """Row indices of a client's ``steps`` batches: per-epoch permutations of its n
    rows, concatenated (n is a multiple of ``batch``, so batches never straddle)."""
    epochs = math.ceil(steps * batch / n)
    return np.concatenate([rng.permutation(n) for _ in range(epochs)])[:steps * batch]


def synthetic_data(job: dict, layout: str = "nhwc", seed: int = 0):
    """(x [base, M, *input], y int [base, M]) of random values: the references time
    the same shapes as the main process, not its values. ``layout="nchw"`` puts the
    channel axis first (PyTorch)."""
    rng = np.random.default_rng(seed)
    shape = tuple(job["input_shape"])
    if layout == "nchw" and len(shape) == 3:
        shape = (shape[2], shape[0], shape[1])
    x = rng.standard_normal((job["base_clients"], job["padded"], *shape), dtype=np.float32)
    y = rng.integers(0, job["num_classes"], (job["base_clients"], job["padded"])).astype(np.int64)
    return x, y


def layer_names(params: dict, prefix: str) -> list:
    """Layer names of a flat "Layer_i/leaf" dict starting with ``prefix``, in order."""
    names = sorted({k.split("/")[0] for k in params if k.startswith(prefix)},
                   key=lambda s: int(s.rsplit("_", 1)[1]))
    return names
