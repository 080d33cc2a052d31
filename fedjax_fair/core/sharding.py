"""Sharded cohorts: a device mesh with a ``clients`` axis (docs/scaling.md).

A round's clients are independent until the server combines their outputs, so the
cohort is the axis to spread over devices. This module holds the mesh and the
layouts; the work itself stays JAX's:

* ``make_mesh(num_devices, model=1)``: a ``jax.sharding.Mesh`` with axes
  ``("clients", "model")`` over the local devices, or over every device of a
  multi-host job after ``initialize_distributed``. Give it to the engine as
  ``Execution(strategy, chunk_size, mesh=mesh)`` (``runner.run(...,
  execution=...)``; the CLI's ``--devices N``).
* Under a mesh, ``execution.map_clients`` runs ``jax.shard_map`` over the
  ``clients`` axis: each device gets K / D of the cohort (its data, keys and
  client-table rows) and runs them with the configured per-device strategy
  (``vmap``, ``chunked``, ``sequential``, ``bucketed``); the server's broadcast
  (parameters, control variates, ...) is replicated. When D does not divide K the
  cohort is padded to the next multiple with copies of its first clients
  (``pad_clients``), like the engine's masked cohort entries, and the copies'
  outputs are dropped (``unpad``) before the server sees them, so the server's
  pieces get exactly the K outputs of the unsharded run.
* ``gather_clients``: the cohort's training rows, gathered from a federation split
  by client so that each device receives only its own share (``simulate`` uses it
  under a mesh).
* Everything after the clients (mixing rules, aggregators, server optimizer,
  the client table's gather / scatter) is ordinary jitted code on arrays whose
  layouts are declared here; XLA's SPMD partitioner inserts the cross-device
  reductions (weighted sums over clients become partial sums + all-reduce).
* ``on_mesh`` / ``replicated_here``: the engine traces its server step (mixing
  rule, aggregator) inside ``on_mesh(mesh)``, and the server's iterative solvers
  (solvers/qp.py, solvers/online.py) pass their small [K] / [K, K] inputs through
  ``replicated_here``: every device then runs the loop on its own copy, where a
  loop over arrays split by client would exchange them at every iteration.
* Layouts (``state_shardings``, ``federation_shardings``): the server's
  parameters, optimizer, mixing and aggregator states are replicated; per-client
  tables (``client_states.DenseTable`` / ``LazyTable`` rows, ``last_round``,
  ``slot``) and the federation's splits (leading client axis N) are split over
  ``clients`` when their leading axis divides the number of shards, and
  replicated otherwise (``federation_shardings`` says so in a note).

The ``model`` axis (default size 1) is left to the compiler: ``shard_map`` is
manual over ``clients`` only, so inside it ``model`` stays an automatic axis of
XLA's partitioner. With replicated parameters (what the runner places) XLA has no
reason to split anything over it, so devices along ``model`` repeat the same work;
a size above 1 is useful only to share one mesh with model-parallel code that
shards the parameters itself.

Multi-host: ``initialize_distributed`` calls ``jax.distributed.initialize``
(before anything touches a device), after which ``jax.devices()`` lists every
process's devices and ``make_mesh`` spans them; ``to_host`` brings sharded results
back to every process (``process_allgather``).
"""
from __future__ import annotations

import contextlib
import math
import os
import re
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fedjax_fair.hparams import FieldError, count
from fedjax_fair.core.client_states import DenseTable, LazyTable

CLIENTS = "clients"  # mesh axis the cohort, the federation and client tables split over
MODEL = "model"  # mesh axis left to the compiler (size 1 by default)
GATHER_STEPS = 4  # gather_clients' steps per device: its staging is 1 / GATHER_STEPS share


# ------------------------------------------------------------------------------ mesh


def make_mesh(num_devices: Optional[int] = None, *, model: int = 1,
              devices: Optional[Sequence] = None) -> Mesh:
    """A mesh of axes (``clients``, ``model``) over ``num_devices`` devices.

    ``devices`` defaults to ``jax.devices()``: the local devices, or every process's
    devices in a multi-host job (after ``initialize_distributed``). ``num_devices``
    None takes them all; ``model`` devices per client shard (default 1). Refuses,
    before any compute, a count that is not a positive integer, more devices than
    exist, a ``model`` size that does not divide the count, and, in a multi-host
    job, a mesh that leaves some process's devices out.
    """
    available = list(jax.devices() if devices is None else devices)
    n = len(available) if num_devices is None else count(num_devices, "devices")
    model = count(model, "model")
    if n > len(available):
        raise FieldError("devices", f"{n} requested but only {len(available)} "
                                    f"{available[0].platform if available else ''} device(s) "
                                    f"exist "
                                    f"(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N "
                                    f"before jax is imported makes N)")
    if n % model:
        raise FieldError("model", f"the model axis ({model}) must divide the number of "
                                  f"devices ({n})")
    if jax.process_count() > 1 and devices is None and n != len(available):
        raise FieldError("devices", f"a multi-host job ({jax.process_count()} processes) shards "
                                    f"over all {len(available)} devices; got {n}")
    grid = np.asarray(available[:n], dtype=object).reshape(n // model, model)
    auto = (jax.sharding.AxisType.Auto,) * 2
    return Mesh(grid, (CLIENTS, MODEL), axis_types=auto)


def provide_cpu_devices(devices) -> None:
    """Makes a CPU job's ``devices`` exist before JAX starts its backends.

    JAX's CPU backend has one device unless told otherwise before it starts, and one
    XLA:CPU device computes a round on about one core (docs/bench/cpu_investigation.md).
    ``devices`` N > 1 asks for N CPU devices (at most one per core: ``usable_cores``),
    "all" for one per core, so that ``--devices all`` (and the command line's default
    ``auto``) on a multi-core CPU runs one chain of clients per core. Does
    nothing when the backends are already up, for ``devices`` 1, or when the user
    already chose the count (``JAX_NUM_CPU_DEVICES`` /
    ``--xla_force_host_platform_device_count``). Accelerators are unaffected: their
    devices are still ``jax.devices()``.
    """
    from jax._src import xla_bridge
    if devices == 1 or xla_bridge.backends_are_initialized():
        return
    if (jax.config.jax_num_cpu_devices > 0
            or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")):
        return
    cores = usable_cores()
    count = cores if devices == "all" else int(devices)
    if 1 < count <= cores:  # more than the cores: only on the user's explicit request
        jax.config.update("jax_num_cpu_devices", count)


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup (v2)
    CPU quota, as in a container limited to a few CPUs of a large host
    (``os.cpu_count`` counts the host's)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cores


def check_mesh(mesh) -> Mesh:
    """``mesh`` if it is a ``jax.sharding.Mesh`` with a ``clients`` axis."""
    if not isinstance(mesh, Mesh) or CLIENTS not in mesh.axis_names:
        raise FieldError("mesh", f"must be a jax.sharding.Mesh with a {CLIENTS!r} axis "
                                 f"(fedjax_fair.core.sharding.make_mesh), got {mesh!r}")
    return mesh


def num_shards(mesh: Mesh) -> int:
    """How many parts the cohort is split into: the size of the ``clients`` axis."""
    return int(mesh.shape[CLIENTS])



# ----------------------------------------------------------------------- the cohort


def padded_size(cohort_size: int, shards: int) -> int:
    """The cohort size rounded up to a multiple of the number of shards."""
    return -(-cohort_size // shards) * shards


def per_device(cohort_size: int, mesh: Mesh) -> int:
    """Clients each device runs: the padded cohort's share."""
    return padded_size(cohort_size, num_shards(mesh)) // num_shards(mesh)


def pad_clients(tree, size: int):
    """Leaves [K, ...] grown to [size, ...] with copies of the first clients.

    The copies are real clients (finite inputs, the same work), standing in for
    masked entries; their outputs are dropped by ``unpad``."""
    def grow(v):
        k = v.shape[0]
        if k == size:
            return v
        return jnp.concatenate([v] * -(-size // k))[:size]

    return jax.tree.map(grow, tree)


def unpad(tree, size: int):
    """The first ``size`` rows of every leaf: the real clients' outputs."""
    return jax.tree.map(lambda v: v[:size], tree)


def gather_clients(tree, client_ids, mesh: Mesh):
    """Rows ``client_ids`` [K] of ``tree`` (leaves [N, ...], N a multiple of the shard
    count, split by client), returned split by client: leaves [K, ...].

    XLA's partitioner gathers from a split operand by gathering every requested row
    on every device (masked to the rows it owns) and all-reducing, so each device
    would hold the whole cohort. Here each device receives only its own share: in
    ``GATHER_STEPS`` x D steps (at most one per slot), every device gathers the rows
    it owns for a slice of every device's slots (zeros elsewhere) and a
    ``psum_scatter`` hands each device its slice, written in place into its share; so
    a device holds its share plus a quarter share of staging. Exactly one device
    owns a row, so the sums are exact. The cohort is padded like ``pad_clients`` and
    the padding dropped."""
    shards = num_shards(mesh)
    k = client_ids.shape[0]
    per = per_device(k, mesh)  # slots per device
    # slots per device gathered at each step: the staging buffer of a step holds a
    # quarter of a device's share, in at most min(4 D, per) steps
    step = -(-per // (GATHER_STEPS * shards))
    ids = pad_clients(jnp.asarray(client_ids, jnp.int32), per * shards).reshape(shards, per)

    def local(block, ids):
        rows = jax.tree.leaves(block)[0].shape[0]
        first = jax.lax.axis_index(CLIENTS) * rows

        def take(v, index, owned):
            got = v[jnp.clip(index, 0, rows - 1)]
            wide = got.astype(jnp.int32) if got.dtype == jnp.bool_ else got
            part = jnp.where(owned.reshape(owned.shape + (1,) * (v.ndim - 1)), wide,
                             jnp.zeros((), wide.dtype))
            return jax.lax.psum_scatter(part, CLIENTS, scatter_dimension=0).astype(v.dtype)

        def body(t, out):
            # the last step may overlap the one before: it rewrites the same rows
            start = jnp.minimum(t * step, per - step)
            index = jax.lax.dynamic_slice_in_dim(ids, start, step, axis=1) - first
            owned = (index >= 0) & (index < rows)
            return jax.tree.map(
                lambda o, v: jax.lax.dynamic_update_slice_in_dim(o, take(v, index, owned),
                                                                 start, axis=0), out, block)

        out = jax.tree.map(lambda v: jnp.zeros((per, *v.shape[1:]), v.dtype), block)
        return jax.lax.fori_loop(0, -(-per // step), body, out)

    gathered = jax.shard_map(local, mesh=mesh, in_specs=(P(CLIENTS), P()),
                             out_specs=P(CLIENTS), axis_names=frozenset({CLIENTS}),
                             check_vma=False)(tree, ids)
    return unpad(gathered, k)


def map_sharded(local, mesh: Mesh, cohort_size: int, fold=None):
    """``local(shared, per_client, sizes)`` (mapping a device's share of clients)
    run over the ``clients`` axis of ``mesh`` with ``jax.shard_map``.

    Returns ``mapped(shared, per_client, sizes)`` on the whole cohort: inputs and
    outputs have leading axis ``cohort_size``. ``shared`` is replicated; the cohort
    is padded to a multiple of the shard count and the padding dropped again.

    ``fold`` (a ``Reduction``'s, execution.py): ``local`` takes ``(per_client,
    real)``, ``real`` [K] False on the padding, and returns ``(outs, total)``; the
    devices' totals are folded into one (XLA gathers the D partial totals)."""
    size = padded_size(cohort_size, num_shards(mesh))
    if fold is None:
        per_device_fn, out_specs = local, P(CLIENTS)
    else:
        def per_device_fn(shared, per_client, sizes):
            out, total = local(shared, per_client, sizes)
            return out, jax.tree.map(lambda t: t[None], total)
        out_specs = (P(CLIENTS), P(CLIENTS))
    body = jax.shard_map(per_device_fn, mesh=mesh, in_specs=(P(), P(CLIENTS), P(CLIENTS)),
                         out_specs=out_specs, axis_names=frozenset({CLIENTS}),
                         check_vma=False)

    def mapped(shared, per_client, sizes=None):
        per_client = pad_clients(per_client, size)
        if fold is not None:
            per_client = (per_client, jnp.arange(size) < cohort_size)
        out = body(shared, per_client, None if sizes is None else pad_clients(sizes, size))
        if fold is None:
            return unpad(out, cohort_size)
        return unpad(out[0], cohort_size), fold(out[1])

    return mapped


# -------------------------------------------------------------------------- layouts


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def by_client(mesh: Mesh) -> NamedSharding:
    """Leading axis split over ``clients`` (every other axis replicated)."""
    return NamedSharding(mesh, P(CLIENTS))


def leading(mesh: Mesh, x) -> NamedSharding:
    """``by_client`` when ``x``'s leading axis splits evenly over the shards, else
    ``replicated`` (a device must hold whole rows)."""
    shape = np.shape(x)
    return (by_client(mesh) if shape and shape[0] % num_shards(mesh) == 0
            else replicated(mesh))


def table_shardings(mesh: Mesh, table):
    """The layout of a client table: rows (and ``last_round`` / ``slot``, [N]) split
    by client, the lazy table's initial row, offset and counters replicated. Any
    other client state (a method's own) is replicated."""
    split = lambda tree: jax.tree.map(lambda x: leading(mesh, x), tree)
    rep = lambda tree: jax.tree.map(lambda _: replicated(mesh), tree)
    if isinstance(table, DenseTable):
        return DenseTable(split(table.rows), split(table.last_round))
    if isinstance(table, LazyTable):
        return LazyTable(rows=split(table.rows), initial=rep(table.initial),
                         offset=rep(table.offset), slot=split(table.slot),
                         last_round=split(table.last_round), used=rep(table.used),
                         overflow=rep(table.overflow))
    return rep(table)


def state_shardings(mesh: Mesh, state):
    """The layout of a ``ServerState``: everything replicated but the client table
    (``table_shardings``)."""
    rep = lambda tree: jax.tree.map(lambda _: replicated(mesh), tree)
    return state._replace(params=rep(state.params), opt_state=rep(state.opt_state),
                          mixing_state=rep(state.mixing_state),
                          aggregator_state=rep(state.aggregator_state),
                          client_states=table_shardings(mesh, state.client_states),
                          round=replicated(mesh),
                          scenario_state=rep(state.scenario_state))


def on_mesh(mesh: Optional[Mesh]):
    """A context (for tracing) in which ``replicated_here`` knows ``mesh``; a
    no-op context without one."""
    if mesh is None:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def replicated_here(tree):
    """``tree`` replicated over the mesh of the surrounding ``on_mesh`` (unchanged
    outside one, or on a mesh with explicit axes).

    For the inputs of a loop over a cohort-sized problem: FedLF's and FedMGDA+'s
    200-iteration QP on a [K, K] Gram split by client costs 11 ms a solve on two CPU
    devices (a cross-device exchange per iteration) against 0.75 ms replicated."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or any(t != jax.sharding.AxisType.Auto for t in mesh.axis_types):
        return tree
    return jax.lax.with_sharding_constraint(tree, P())


def loop_collectives(compiled) -> dict:
    """{while-loop body: number of cross-device collectives in it} of a compiled
    program (``jax.stages.Compiled``, read from its HLO text): exchanges that repeat
    on every iteration of a loop (``benchmarks/mesh_server.py``, tests)."""
    text = compiled.as_text()
    bodies = set(re.findall(r"while\(.*?body=(%?[\w.\-]+)", text))
    counts = {}
    for comp in re.split(r"\n(?=\S.*\{\n)", text):
        name = comp.split(" ", 1)[0]
        if name in bodies:
            counts[name] = len(re.findall(r"(?:all-reduce|all-gather|all-to-all|"
                                          r"reduce-scatter|collective-permute)(?:-start)?\(",
                                          comp))
    return counts


def constrain_state(state, mesh: Optional[Mesh]):
    """``state`` pinned to ``state_shardings`` inside a traced program (a no-op
    without a mesh), so a round's output keeps the layout of its input."""
    if mesh is None:
        return state
    return jax.lax.with_sharding_constraint(state, state_shardings(mesh, state))


def federation_shardings(mesh: Mesh, data) -> tuple[object, Optional[str]]:
    """(layout of a ``FederatedData``, note or None): every split's leaves
    [N, ...] split by client when N divides the shard count, else replicated, with a
    note saying so. A generated federation (``data/generated.py``: client sizes and the
    generator's small shared arrays) is replicated, without a note."""
    from fedjax_fair.core.generated import is_generated
    shards = num_shards(mesh)
    n = data.num_clients
    if is_generated(data.train):
        return jax.tree.map(lambda _: replicated(mesh), data), None
    if n % shards == 0:
        return jax.tree.map(lambda _: by_client(mesh), data), None
    note = (f"sharding: the federation's {n} clients do not split evenly over {shards} "
            f"devices; its arrays are replicated on every device (cohorts are still "
            f"split). A number of clients that is a multiple of {shards} shards them.")
    return jax.tree.map(lambda _: replicated(mesh), data), note


def cohort_shardings(mesh: Mesh, cohorts):
    """The layout of streamed cohorts (leaves [R, K, ...]): K split by client when it
    divides the shard count, else replicated."""
    split = cohorts.client_ids.shape[1] % num_shards(mesh) == 0
    spec = NamedSharding(mesh, P(None, CLIENTS)) if split else replicated(mesh)
    return jax.tree.map(lambda _: spec, cohorts)


def abstract(tree, shardings):
    """``jax.ShapeDtypeStruct`` leaves with their shardings (nothing allocated)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s),
                        tree, shardings)


def device_bytes(tree, shardings) -> int:
    """Bytes one device holds of ``tree`` laid out as ``shardings`` (its shard of
    every split leaf, the whole of every replicated one)."""
    return int(sum(math.prod(s.shard_shape(np.shape(x))) * np.dtype(x.dtype).itemsize
                   for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings))))


# ------------------------------------------------------------------------ multi-host


def initialize_distributed(coordinator_address: Optional[str] = None,
                           num_processes: Optional[int] = None,
                           process_id: Optional[int] = None) -> None:
    """``jax.distributed.initialize``: joins this process to a multi-host job.

    Must run before anything touches a device. With no arguments JAX detects the
    cluster (SLURM, Open MPI, Kubernetes, TPU pods) or reads
    ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``
    (docs/scaling.md has launch recipes). Calling it twice is harmless."""
    if jax.distributed.is_initialized():
        return
    kwargs = {k: v for k, v in (("coordinator_address", coordinator_address),
                                ("num_processes", num_processes),
                                ("process_id", process_id)) if v is not None}
    env = {"coordinator_address": "JAX_COORDINATOR_ADDRESS",
           "num_processes": "JAX_NUM_PROCESSES", "process_id": "JAX_PROCESS_ID"}
    for key, name in env.items():
        if key not in kwargs and os.environ.get(name):
            value = os.environ[name]
            kwargs[key] = value if key == "coordinator_address" else int(value)
    jax.distributed.initialize(**kwargs)


def put(tree, shardings):
    """``tree`` laid out as ``shardings`` (one ``Sharding`` for every leaf, or a
    matching pytree), always in new buffers (a donated program never deletes the
    caller's arrays). In a multi-host job every process passes the same values and
    each places the shards its devices hold (``jax.make_array_from_callback``),
    since ``device_put`` cannot place a process's local array on other hosts."""
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)
    if jax.process_count() == 1:
        return unaliased(jax.device_put(tree, shardings, may_alias=False), tree)

    def one(x, s):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = one(jax.random.key_data(x), s)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda index: host[index])

    return jax.tree.map(one, tree, shardings)


def buffers(x) -> set:
    """The device buffers behind array ``x`` (one per addressable shard), as pointers;
    empty for anything else."""
    if not isinstance(x, jax.Array):
        return set()
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return {shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards}


def unaliased(tree, avoid=()):
    """``tree`` with a fresh copy of every array that shares a device buffer with an
    array of ``avoid`` or with an earlier leaf of ``tree``. ``jax.device_put(...,
    may_alias=False)`` of a one-device array to a replicated sharding keeps the source's
    buffer as the shard on that device (jax 0.10), so two leaves put from one array
    share it, and a program donating both fails ("donate the same buffer twice")."""
    taken = set().union(*map(buffers, jax.tree.leaves(avoid)))

    def fresh(x):
        if taken & buffers(x):
            x = jax.device_put(x, x.sharding, may_alias=False)
        taken.update(buffers(x))
        return x

    return jax.tree.map(fresh, tree)


def to_host(tree):
    """NumPy copies of ``tree``'s arrays on every process: ``np.asarray`` in one
    process, ``multihost_utils.process_allgather`` (a collective every process must
    call) when arrays span several hosts."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    from jax.experimental import multihost_utils
    return multihost_utils.process_allgather(tree, tiled=True)
