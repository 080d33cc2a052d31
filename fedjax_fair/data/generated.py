"""Federations computed client by client: a federation of any N costs memory in the
cohort only (docs/scaling.md, "A million clients").

A ``GeneratedClients`` split holds no rows. Client k's rows are a pure function of
the dataset's key and k: ``take(client_ids)`` computes the cohort's rows inside the
compiled round (jittable, vmappable), so a round of 10,000 clients of a
1,000,000-client federation holds 10,000 clients' rows, never N. What it keeps is
[N]-sized only for the client sizes (``num_examples``, int32) and the generator's
shared arrays (FEMNIST-like's class templates).

Randomness: client k of a dataset keyed ``key`` draws from ``fold_in(key, k)``, and
each of its quantities (style, contrast, size, each split's rows) from a further
``fold_in`` of that key, so a client's rows do not depend on N, on the cohort it is
drawn in, or on which other clients exist. The values differ from the in-memory
builders' at the same seed: those draw every client in turn from one sequential
NumPy stream (which cannot be indexed by client), these from JAX's counter-based
keys. The generative models are the same (``femnist_like.py``, ``synthetic.py``).

``materialize(split)`` computes every row on the host as an ordinary ``ClientData``:
the same federation held in memory, which ``tests/test_data_generated.py`` runs
against the generated one (the same rounds, to float rounding; to the bit as XLA
compiles them by default on a CPU). The split type itself is
``core/generated.py``'s ``GeneratedClients``.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair.core.generated import GeneratedClients, is_generated, materialize, take
from fedjax_fair.data.federated import Dataset

__all__ = ["GeneratedClients", "check_held", "client_draws", "dataset",
           "is_generated", "materialize", "report", "stream_bytes", "take"]


def client_draws(key, num_clients: int, draw: Callable) -> np.ndarray:
    """``draw(client_key)`` for every client k (``fold_in(key, k)``) as a host array
    [N, ...], computed in blocks of clients (a million scalars in well under a second)."""
    block = 1 << 16
    fn = jax.jit(jax.vmap(lambda k: draw(jax.random.fold_in(key, k))))
    parts = []
    for start in range(0, num_clients, block):
        ids = np.arange(start, min(start + block, num_clients), dtype=np.int32)
        parts.append(np.asarray(fn(np.resize(ids, block)))[:len(ids)])
    return np.concatenate(parts)


def stream_bytes(key, shape) -> jax.Array:
    """uint8 values in [0, 256) of ``shape`` (last axis a multiple of 4), four to a
    32-bit word. The words are a SplitMix32-style stream (Steele, Lea, Flood, "Fast
    splittable pseudorandom number generators", OOPSLA 2014: a Weyl sequence through
    MurmurHash3's 32-bit finaliser) seeded by two words of ``key`` (threefry): about
    a sixth of threefry's work per word, which drew 39 million words (a 10,000-client
    cohort of FEMNIST-like pixel noise) in 0.42 s of a 5.4 s round on a 2-core CPU.
    Integer arithmetic only, so the same bytes on every backend."""
    seed = jax.random.bits(key, (2,), jnp.uint32)
    count = int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // 4)
    x = jnp.arange(count, dtype=jnp.uint32) * jnp.uint32(0x9E3779B9) + seed[0]
    x = (x ^ seed[1]) ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    x = x ^ (x >> 16)
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(shape)


def report(split: GeneratedClients) -> dict:
    """``federated.padding_report``'s fields for a generated split; ``bytes`` is what it
    holds (sizes and shared arrays), ``generated`` True."""
    sizes = np.asarray(split.num_examples)
    n, m = split.num_clients, split.max_examples
    real, slots = int(sizes.sum()), n * m
    return {"num_clients": n, "padded_size": m, "num_examples": real, "num_slots": slots,
            "padding_fraction": 1.0 - real / slots if slots else 0.0,
            "min_examples": int(sizes.min()), "median_examples": float(np.median(sizes)),
            "max_examples": int(sizes.max()), "generated": True,
            "bytes": int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(split)))}


def dataset(name: str, train: GeneratedClients, test: GeneratedClients, num_classes: int,
            input_shape: tuple, info: dict):
    """A ``Dataset`` whose splits are generated (``host_data`` holds no rows)."""
    from fedjax_fair.core.types import FederatedData
    for field, split in (("train", train), ("test", test)):
        if not int(np.asarray(split.num_examples).sum()) > 0:
            raise ValueError(f"{field}_xs: every one of the {split.num_clients} clients has "
                             f"an empty {field} split")
    info = {**info, "padding": {"train": report(train), "test": report(test)}}
    return Dataset(name=name, host_data=FederatedData(train=train, test=test),
                   num_classes=num_classes, input_shape=tuple(input_shape), info=info)


def check_held(num_clients: int, nbytes: int, what: str) -> None:
    """``FieldError("num_clients")`` before an in-memory build of ``nbytes`` that the
    host cannot hold, pointing at ``procedural=True``."""
    from fedjax_fair.core.memory import host_available
    from fedjax_fair.hparams import FieldError
    free = host_available()
    if free is not None and nbytes > free:
        raise FieldError("num_clients", f"{num_clients:,} {what} held in memory take about "
                                        f"{nbytes / 2 ** 30:,.1f} GiB, {free / 2 ** 30:,.1f} GiB "
                                        f"is available; procedural=True (--dataset-arg "
                                        f"procedural=true) computes each client's rows inside "
                                        f"the round instead")
