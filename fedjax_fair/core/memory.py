"""Memory planning for large federations: size buckets, the estimate, the check.

A federation is stored as one padded block [N, M, ...] (data/federated.py), so a
federation with skewed client sizes is mostly padding: M is the largest client.
Two tools cut that cost:

* **Size buckets.** Clients sorted by size fall into power-of-two buckets; a
  bucket's clients need only be padded to its bound ``min(M, 2^ceil(log2 n))``.
  ``bucket_report`` counts the padding of the single block against the bucketed
  layout. The streamed runner sends a chunk's cohorts in the compact layout
  (``compact_chunk``: only the real rows, concatenated; each round cuts its clients'
  windows, at the bucket of the chunk's largest sampled client, out of them on the
  device: ``compact_views``), and the ``"bucketed"`` execution strategy groups a
  cohort by size so each vmapped group runs only its own busiest client's steps.
* **Placement.** ``runner.run`` keeps the federation on the device
  (``"device"``), or on the host and streams each chunk's cohorts
  (``"host"``) when the device cannot hold it. Before anything is allocated it
  builds a ``MemoryPlan`` from XLA's own accounting of the compiled chunk program
  (``Compiled.memory_analysis``: arguments, outputs and temporaries), adds the
  evaluation split, and compares the total with the device's capacity. A plan that
  cannot fit raises ``MemoryBudgetError`` with what to change, instead of failing
  with an out-of-memory crash halfway through. Over a device mesh (sharding.py)
  every number is per device: XLA's accounting of an SPMD program is one device's
  share, and the evaluation split counts its shard.
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional, Sequence

import jax
import numpy as np

PLACEMENTS = ("auto", "device", "host")


class MemoryBudgetError(ValueError):
    """The chosen placement cannot fit the device; raised before any allocation."""


def tree_bytes(tree) -> int:
    """Bytes of every array (or ShapeDtypeStruct) leaf of ``tree``."""
    return int(sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


def device_capacity(device=None) -> Optional[int]:
    """Free bytes on ``device`` (default: the first device), or None if unknown.

    Accelerators report ``bytes_limit - bytes_in_use``; on CPU the host's available
    memory (``host_available``).
    """
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return host_available()


def host_available() -> Optional[int]:
    """Bytes of host memory a new allocation can have: ``MemAvailable`` of
    /proc/meminfo (free pages plus the page cache the kernel can reclaim: a federation
    just read from disk stays cached without being in use), else the free physical
    pages, or None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def mesh_capacity(mesh) -> Optional[int]:
    """Free bytes per device of ``mesh``: the least free of its local accelerators, or
    on CPU the host's available memory divided among the mesh's devices (CPU devices
    share the host's memory), or None if unknown."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if local and local[0].platform == "cpu":
        free = device_capacity(local[0])
        return None if free is None else free // len(local)
    free = [device_capacity(d) for d in local]
    return None if not free or None in free else min(free)


def size_bucket(size: int, padded_size: int) -> int:
    """Bound of the bucket of a client with ``size`` rows: the next power of two,
    at most ``padded_size`` (and at least 1)."""
    size = max(int(size), 1)
    return min(int(padded_size), 1 << (size - 1).bit_length())


def bucket_report(sizes: Sequence[int]) -> dict:
    """Padding of a federation stored as one block versus in power-of-two buckets.

    Args:
      sizes: examples per client, n_k.

    Returns a JSON-serialisable dict: ``num_examples`` (sum n_k), ``block_slots``
    (N * M), ``block_padding_fraction``, ``bucketed_slots`` (sum over clients of their
    bucket bound), ``bucketed_padding_fraction``, and ``buckets``: one entry per
    non-empty bucket in increasing bound, ``{"bound", "clients", "num_examples",
    "slots"}``. Empty clients sit in the bucket of bound 1.
    """
    sizes = np.asarray(sizes, np.int64)
    m = int(sizes.max()) if sizes.size else 0
    real = int(sizes.sum())
    bounds = np.array([size_bucket(n, max(m, 1)) for n in sizes], np.int64)
    buckets = [{"bound": int(b), "clients": int((bounds == b).sum()),
                "num_examples": int(sizes[bounds == b].sum()),
                "slots": int(b * (bounds == b).sum())} for b in np.unique(bounds)]
    block, bucketed = int(sizes.size * m), int(bounds.sum())
    frac = lambda slots: 1.0 - real / slots if slots else 0.0
    return {"num_examples": real, "block_slots": block, "block_padding_fraction": frac(block),
            "bucketed_slots": bucketed, "bucketed_padding_fraction": frac(bucketed),
            "buckets": buckets}


class MemoryPlan(NamedTuple):
    """What a run will hold on the device, in bytes.

    placement: "device" (federation resident) or "host" (cohorts streamed).
    resident_bytes: arrays kept on the device for the whole run besides the
      program's arguments (the evaluation split when the federation is resident; the
      next chunk's cohorts, read meanwhile, when they are streamed).
    program_bytes: XLA's accounting of one chunk's compiled program: arguments
      (state, and the training split or the streamed cohorts), outputs and temps.
    capacity: free device bytes, or None when unknown (then nothing is checked).
    devices: how many devices share the run (a mesh); every byte count above is
      then per device.
    generated: the federation's rows are computed inside the round
      (``data/generated.py``; placement "device", nothing of it resident but the client
      sizes), so the program's bytes are the whole bill.
    """

    placement: str
    resident_bytes: int
    program_bytes: int
    capacity: Optional[int]
    devices: int = 1
    generated: bool = False

    @property
    def total(self) -> int:
        return self.resident_bytes + self.program_bytes

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.total <= self.capacity

    def describe(self) -> str:
        cap = "unknown" if self.capacity is None else _mib(self.capacity)
        where = ("federation generated in the round" if self.generated else
                 "federation on the device" if self.placement == "device"
                 else "federation on the host, cohorts streamed per chunk")
        if self.devices > 1:
            where = where.replace("the device", "the devices")
            split = "" if self.generated else ", split by client"
            return (f"memory: {_mib(self.total)} needed per device ({where}{split}: "
                    f"{_mib(self.resident_bytes)} resident + "
                    f"{_mib(self.program_bytes)} per chunk program), {cap} free per device "
                    f"on {self.devices} {jax.devices()[0].platform} devices")
        return (f"memory: {_mib(self.total)} needed ({where}: {_mib(self.resident_bytes)} "
                f"resident + {_mib(self.program_bytes)} per chunk program), "
                f"{cap} free on {jax.devices()[0].platform}")


def program_bytes(compiled) -> int:
    """Arguments + outputs + temporaries of a compiled program (XLA's numbers)."""
    m = compiled.memory_analysis()
    if m is None:
        return 0
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:,.1f} MiB"


def too_big(plan: MemoryPlan, hint: str) -> MemoryBudgetError:
    return MemoryBudgetError(f"placement: {plan.describe()}; it does not fit. {hint}")


# ------------------------------------------------------------ streamed compact layout


class CompactChunk(NamedTuple):
    """One chunk's cohorts in the compact layout: the sampled clients' real rows
    concatenated (round by round, client by client) and read through offsets.

    rows: {name: [T, ...]} the real rows, then zeros to the chunk's row bucket T
      (at least the last offset + the padded size, so every client's window fits).
    offsets, sizes: int32 [R, K] where client (r, k)'s rows start, and how many.
    client_ids, local_steps: int32 [R, K] and client_mask bool [R, K] as in a
      ``Cohort``.
    """

    rows: dict
    offsets: object
    sizes: object
    client_ids: object
    local_steps: object
    client_mask: object


def row_bucket(num_rows: int) -> int:
    """Rows of a compact chunk: the next power of two (few distinct programs), at
    least 8."""
    return max(8, 1 << (max(int(num_rows), 1) - 1).bit_length())


def compact_chunk(examples: dict, sizes, client_ids, local_steps,
                  padded_size: int, client_mask=None) -> CompactChunk:
    """Host side: the compact layout of the cohorts ``client_ids`` [R, K] of a
    federation stored as ``examples`` {name: [N, M, ...]} with ``sizes`` [N] real
    rows per client (real rows first). Copies only the real rows (one NumPy gather
    of sum n_k rows), padded with zeros to ``row_bucket(sum n_k + padded_size)``.
    ``client_mask`` [R, K] (None: every client takes part)."""
    ids = np.asarray(client_ids)
    n = np.asarray(sizes)[ids].astype(np.int64)
    flat_n = n.ravel()
    offsets = np.concatenate([[0], np.cumsum(flat_n)[:-1]]) if flat_n.size else flat_n
    total = int(flat_n.sum())
    bucket = row_bucket(total + padded_size)
    rows = {}
    for name, v in examples.items():
        v = np.asarray(v)
        m = v.shape[1]
        # row j of client (r, k): stored row ids[r, k] * M + j, for j < n[r, k]
        index = (np.repeat(ids.ravel().astype(np.int64) * m - offsets, flat_n)
                 + np.arange(total))
        out = np.zeros((bucket, *v.shape[2:]), v.dtype)
        np.take(v.reshape(-1, *v.shape[2:]), index, axis=0, out=out[:total])
        rows[name] = out
    return CompactChunk(rows, offsets.reshape(ids.shape).astype(np.int32),
                        n.astype(np.int32), ids.astype(np.int32),
                        np.asarray(local_steps, np.int32),
                        np.ones(ids.shape, bool) if client_mask is None
                        else np.asarray(client_mask, bool))


def compact_views(rows: dict, offsets, sizes, padded_size: int):
    """Device side (traced): the clients' ``ClientData`` [K, padded_size, ...] of one
    round, each client's window of ``rows`` at its offset, rows past its size zeroed
    and masked: the same arrays as the padded layout's."""
    from fedjax_fair.core.types import ClientData
    import jax.numpy as jnp

    def view(offset, n):
        mask = jnp.arange(padded_size) < n
        examples = {}
        for name, v in rows.items():
            window = jax.lax.dynamic_slice_in_dim(v, offset, padded_size, axis=0)
            keep = mask.reshape((padded_size,) + (1,) * (v.ndim - 1))
            examples[name] = jnp.where(keep, window, jnp.zeros((), v.dtype))
        return ClientData(examples=examples, mask=mask, num_examples=n)

    return jax.vmap(view)(offsets, sizes)


def compact_chunk_shapes(examples: dict, num_rounds: int, cohort_size: int,
                         num_rows: int) -> CompactChunk:
    """Shapes of ``compact_chunk``'s output (nothing allocated)."""
    sds = jax.ShapeDtypeStruct
    lead = (num_rounds, cohort_size)
    rows = {k: sds((num_rows, *np.shape(v)[2:]), v.dtype) for k, v in examples.items()}
    i32 = sds(lead, np.int32)
    return CompactChunk(rows, i32, i32, i32, i32, sds(lead, np.bool_))


# ------------------------------------------------------------------ before compiling

# The most elements one XLA array may hold here: XLA's CPU and GPU kernels index
# arrays with 32-bit integers, and a larger array aborts the process (SIGABRT) in C++.
MAX_ARRAY_ELEMENTS = 2 ** 31 - 1


class Preflight(NamedTuple):
    """A refusal of ``preflight``: what is too large (``what``: "params" or "batch"),
    the offending leaf's path, and the message."""

    what: str
    message: str


def preflight(param_shapes, example_shapes: dict, batch_size: int,
              capacity: Optional[int] = None) -> Optional[Preflight]:
    """Shapes XLA cannot hold, checked from ``jax.eval_shape`` results before anything
    is compiled or allocated: a parameter array over ``MAX_ARRAY_ELEMENTS``, parameters
    over the device's free memory (the run holds them at least twice: the state and a
    client's copy), a batch (``batch_size`` x one example, of ``example_shapes``
    {name: ShapeDtypeStruct of one example}) with an array over ``MAX_ARRAY_ELEMENTS``
    or over the free memory. Returns None when the lower bounds fit; the full plan
    (XLA's own accounting) is ``runner.run``'s."""
    capacity = device_capacity() if capacity is None else capacity
    flat = jax.tree_util.tree_flatten_with_path(param_shapes)[0]
    for path, leaf in flat:
        n = math.prod(np.shape(leaf))
        if n > MAX_ARRAY_ELEMENTS:
            return Preflight("params", f"the parameter {jax.tree_util.keystr(path)} has shape "
                                       f"{tuple(np.shape(leaf))} ({n:,} elements); XLA holds at "
                                       f"most {MAX_ARRAY_ELEMENTS:,} in one array")
    total = tree_bytes(param_shapes)
    if capacity is not None and 2 * total > capacity:
        return Preflight("params", f"the model's parameters take {_mib(total)} (at least "
                                   f"twice that during a round), {_mib(capacity)} free on "
                                   f"{jax.devices()[0].platform}")
    batch_bytes = 0
    for name, v in example_shapes.items():
        n = batch_size * math.prod(np.shape(v))
        if n > MAX_ARRAY_ELEMENTS:
            return Preflight("batch", f"a batch of {batch_size:,} examples makes the input "
                                      f"{name!r} {n:,} elements; XLA holds at most "
                                      f"{MAX_ARRAY_ELEMENTS:,} in one array")
        batch_bytes += n * np.dtype(v.dtype).itemsize
    if capacity is not None and batch_bytes + total > capacity:
        return Preflight("batch", f"a batch of {batch_size:,} examples takes "
                                  f"{_mib(batch_bytes)} of inputs alone, {_mib(capacity)} free "
                                  f"on {jax.devices()[0].platform}")
    return None
