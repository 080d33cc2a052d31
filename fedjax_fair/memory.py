"""Memory planning for large federations: size buckets, the estimate, the check.

A federation is stored as one padded block [N, M, ...] (data/federated.py), so a
federation with skewed client sizes is mostly padding: M is the largest client.
Two tools cut that cost:

* **Size buckets.** Clients sorted by size fall into power-of-two buckets; a
  bucket's clients need only be padded to its bound ``min(M, 2^ceil(log2 n))``.
  ``bucket_report`` counts the padding of the single block against the bucketed
  layout. The streamed runner pads every chunk's cohorts to the bucket of the chunk's
  largest sampled client, and the ``"bucketed"`` execution strategy groups a cohort
  by size so each vmapped group runs only its own busiest client's steps.
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

    Accelerators report ``bytes_limit - bytes_in_use``; on CPU the available
    physical memory of the host is used.
    """
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
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
      program's arguments (the evaluation split when the federation is resident).
    program_bytes: XLA's accounting of one chunk's compiled program: arguments
      (state, and the training split or the streamed cohorts), outputs and temps.
    capacity: free device bytes, or None when unknown (then nothing is checked).
    devices: how many devices share the run (a mesh); every byte count above is
      then per device.
    """

    placement: str
    resident_bytes: int
    program_bytes: int
    capacity: Optional[int]
    devices: int = 1

    @property
    def total(self) -> int:
        return self.resident_bytes + self.program_bytes

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.total <= self.capacity

    def describe(self) -> str:
        cap = "unknown" if self.capacity is None else _mib(self.capacity)
        where = ("federation on the device" if self.placement == "device"
                 else "federation on the host, cohorts streamed per chunk")
        if self.devices > 1:
            where = where.replace("the device", "the devices")
            return (f"memory: {_mib(self.total)} needed per device ({where}, split by "
                    f"client: {_mib(self.resident_bytes)} resident + "
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
