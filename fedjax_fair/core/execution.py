"""How a cohort runs: mapping ONE client's update over K clients (docs/performance.md).

Strategies (all produce identical results up to float rounding):

* ``"vmap"``: one batched program over the whole cohort. Best on accelerators,
  where per-client matmuls become batched matmuls.
* ``"chunked"``: ``lax.map`` over chunks of ``chunk_size`` clients, vmapped inside a
  chunk. Bounds activation memory at about chunk_size / K of ``vmap``.
* ``"sequential"``: ``lax.map`` over single clients, a rolled loop inside the same
  program. On CPU one client's parameters stay in cache for all its local steps.
* ``"bucketed"``: the cohort is sorted by client size and cut into buckets of
  ``chunk_size`` similar clients (default: 4 buckets); ``lax.map`` runs the buckets,
  each vmapped, and the outputs are put back in cohort order. For federations with
  skewed client sizes.

Clients vmapped together share the named axis ``CLIENT_AXIS`` (``"client_group"``,
distinct from the device mesh's ``"clients"`` axis). Local training asks
for the largest step count in its group (``group_max``) and skips the steps past it
with a real ``cond`` (an unbatched predicate), so a vmapped group runs only as many
steps as its busiest client needs rather than the federation's padded maximum;
past its own count a client keeps its carry through a select. Bucketing makes the
groups homogeneous, so little work is spent on masked steps.
* ``"auto"``: picks one of the above from the backend, the cohort, the model and the
  devices (``choose``, a pure function of them; ``resolve`` without a model
  description). Benchmarks (benchmarks/round_throughput.py, docs/performance.md)
  justify the rule. On one CPU device a small dense model (``CPU_CHUNK_EXAMPLE_FLOPS``
  an example) runs ``chunked`` (``CPU_CHUNK`` = 4) from ``CPU_CHUNK_MIN_COHORT``
  clients, anything else ``sequential``. On a CPU
  with several local devices (``jax.config.update("jax_num_cpu_devices",
  os.cpu_count())`` or ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before
  JAX starts) ``auto`` also splits the cohort over them (``auto_mesh``): one chain of
  clients per core.

XLA:CPU parallelises only inside an operation (its intra-op thread pool), and a
client's step is a chain of small matmuls (20-row batches): a second core shortens
them little and moves the client's parameters between the cores' caches, so one
device runs a round on about one core (benchmarks/cpu_investigation.py,
docs/bench/cpu_investigation.md). Separate CPU devices run their programs on
separate threads, so the clients of a round are the parallel work there.

All strategies stay inside one traced program, so they compose with ``jit``,
``lax.scan`` over rounds, and ``jax.grad`` / ``jax.vmap`` of a whole run.

Several devices: ``Execution(..., mesh=sharding.make_mesh(D))`` splits the cohort
over the mesh's ``clients`` axis with ``jax.shard_map``; each device maps its K / D
clients with the strategy above (``auto`` and ``chunk_size`` resolved for K / D).
A cohort that does not divide D is padded and the padding's outputs dropped, so the
results equal the unsharded run's (sharding.py, docs/scaling.md).

XLA:CPU runs a convolution's weight-gradient inside a rolled loop 4-100x slower than
unrolled (jax-ml/jax#12868). The built-in CNN therefore runs its convolutions as
im2col + matmul on CPU (models/simple.py), which is unaffected; for a model that
uses XLA convolutions on CPU, ``local_step_unroll`` returns full unrolling.
"""
from __future__ import annotations

import functools
import json
import os
from typing import Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_fair.core import sharding
from fedjax_fair import hparams as H

STRATEGIES = ("auto", "vmap", "chunked", "sequential", "bucketed")
# vmap axis of the clients run together; not the mesh's ``sharding.CLIENTS`` axis,
# which a shard_map binds around them (one name for both would make a collective
# over the group reach across devices)
CLIENT_AXIS = "client_group"
NUM_BUCKETS = 4  # default bucket count of the "bucketed" strategy


class Execution(NamedTuple):
    """How a round maps its clients: one value passed to ``apply`` / ``simulate`` /
    ``run`` (never to an algorithm factory). ``chunk_size``: clients per chunk
    (``chunked``, default 8) or per bucket (``bucketed``, default K / 4), per device
    under a mesh. ``mesh``: a ``jax.sharding.Mesh`` with a ``clients`` axis
    (``sharding.make_mesh``) splitting every cohort over its devices; None runs on
    one device."""

    strategy: str = "auto"
    chunk_size: Optional[int] = None
    mesh: Optional[jax.sharding.Mesh] = None
    model: Optional["ModelProfile"] = None  # what ``auto`` knows of the model (``choose``)


def as_execution(execution: Union[str, Execution, None]) -> Execution:
    """An ``Execution`` from itself, a strategy name, or None (``auto``)."""
    if execution is None:
        return Execution()
    if isinstance(execution, str):
        execution = Execution(execution)
    if not isinstance(execution, Execution):
        raise H.FieldError("execution", f"must be a strategy name {list(STRATEGIES)} or an "
                                        f"Execution, got {execution!r}")
    if execution.strategy not in STRATEGIES:
        raise H.FieldError("execution", f"unknown strategy {execution.strategy!r}; allowed: "
                                        f"{list(STRATEGIES)}")
    if execution.mesh is not None:
        sharding.check_mesh(execution.mesh)
    return execution


# --------------------------------------------------------------- compile options

# XLA:CPU options per kind of program (docs/performance.md, "Compile time on a first
# run"): "once", programs that run once or a few times on small arrays (the model's
# init, the sweeps' summaries), compile with LLVM at level 0 and the classic fusion
# emitters (a logistic regression's init: 1.76 s -> 0.13 s; values within an ulp);
# "evaluate" (the evaluators, a forward pass) compiles with the classic emitters alone
# (the femnist_like MLP's: 1.1 s -> 0.7 s, the LEAF CNN's 2.7 s -> 1.7 s, running as
# fast or faster); "rounds" (the chunk programs) keeps XLA's defaults (the classic
# emitters compile it 1.3 s faster but its rounds run 10-15% slower).
CPU_COMPILE_OPTIONS = {
    "once": {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False},
    "rounds": None,
    "evaluate": {"xla_cpu_use_fusion_emitters": False},
}
COMPILE_OPTIONS_ENV = "FEDJAX_FAIR_XLA_OPTIONS"


def compiler_options(program: str, backend: Optional[str] = None) -> Optional[dict]:
    """XLA compile options for a program of kind ``program`` ("once", "rounds",
    "evaluate") on ``backend``: ``CPU_COMPILE_OPTIONS`` on a CPU, None (XLA's
    defaults) elsewhere. ``$FEDJAX_FAIR_XLA_OPTIONS`` overrides: ``default`` for XLA's
    defaults everywhere, or a JSON object ``{kind: options or null}``."""
    if (backend or jax.default_backend()) != "cpu":
        return None
    table = compile_options_override()
    if table is None:
        return None
    options = {**CPU_COMPILE_OPTIONS, **table}.get(program)
    return dict(options) if options else None


def compile_options_override() -> Optional[dict]:
    """``$FEDJAX_FAIR_XLA_OPTIONS`` read and checked: ``{}`` when unset, None for
    ``default``, else its ``{kind: options or null}`` object; anything else is a
    ``FieldError`` naming the variable (the command line checks it before any work)."""
    text = os.environ.get(COMPILE_OPTIONS_ENV, "").strip()
    if text.lower() == "default":
        return None
    try:
        table = json.loads(text) if text else {}
    except ValueError as e:
        raise H.FieldError(COMPILE_OPTIONS_ENV, f"must be 'default' or a JSON object, "
                                                f"got {text!r} ({e})") from None
    if not isinstance(table, dict) or any(k not in CPU_COMPILE_OPTIONS for k in table) \
            or any(v is not None and not isinstance(v, dict) for v in table.values()):
        raise H.FieldError(COMPILE_OPTIONS_ENV, f"must map program kinds "
                                                f"{sorted(CPU_COMPILE_OPTIONS)} to an object "
                                                f"of XLA options or null, got {text!r}")
    return table


@functools.lru_cache(maxsize=32)
def _init_program(model) -> Callable:
    return jax.jit(model.init, compiler_options=compiler_options("once"))


def initial_params(model, key):
    """``model.init(key)`` compiled once per model with the "once" options (the
    command line's initial parameters: equal to ``jax.jit(model.init)(key)`` up to an
    ulp on a CPU, where level 0 generates other machine code)."""
    return _init_program(model)(key)


def group_max(value: jax.Array) -> Optional[jax.Array]:
    """max of ``value`` over the clients vmapped together with this one, or None.

    Under ``map_clients``' vmap (axis ``CLIENT_AXIS``) the result is one unbatched
    scalar, so a ``lax.cond`` on it stays a branch instead of becoming a select.
    None when this client runs alone (sequential, or no named client axis).
    """
    try:
        return jax.lax.pmax(value, CLIENT_AXIS)
    except NameError:  # the axis is not bound: no group to take a max over
        return None


class ModelProfile(NamedTuple):
    """What ``choose`` needs of a model: whether it runs XLA convolutions
    (``Model.uses_xla_conv``) and the FLOPs of its forward pass on one example
    (``models.base.example_flops``; None when unknown)."""

    convolutional: bool = False
    example_flops: Optional[float] = None


# auto on accelerators (docs/performance.md, "Choosing the strategy on a GPU"). vmap
# turns the clients' convolutions into grouped convolutions, slower than one client's
# after another once a client's work is large or the group is wide (H100: ResNet-18-GN,
# 0.97 GFLOP an example, 10 clients: sequential 1.79 s vs vmap 4.30 s; LEAF CNN,
# 0.03 GFLOP, vmap the fastest at 10 and 100 clients, 2.3x slower than sequential at
# 1,000). Dense models batch into matmuls: vmap won at every cohort measured.
HEAVY_CONV_EXAMPLE_FLOPS = 2e8  # at or above: one client after another
CONV_GROUP = 100  # the widest vmapped group of a light convolutional model


# auto on a CPU (docs/performance.md, "Choosing the strategy on a CPU (issue 50)"). On
# one CPU device a chunk of CPU_CHUNK clients vmapped together turns a client's batch-20
# products into batch-80 ones, which XLA:CPU runs faster and over both cores (MLP
# 784-200-200-62, 0.42 MFLOP an example: chunked (4) 1.08-1.30x sequential at cohorts
# 10-1,000; logistic regression 784-62, 0.1 MFLOP: 0.98-1.24x). A heavier model runs
# one client after another (MLP 784-500-500-62, 1.35 MFLOP: 0.98x; 784-1000-1000-62:
# 0.65x; the LEAF CNN, 25 MFLOP: 0.82-0.96x), and so does a tinier one (0.001-0.02
# MFLOP: 0.96-1.13x), where a chunk gains nothing but compiles 1-3 s longer. On several
# CPU devices (a mesh, ``auto_mesh``) each device keeps a core busy with its own chain
# of clients, and single clients won there (MLP, two devices: sequential 1.02-1.39x
# chunked (4) on each).
CPU_CHUNK = 4  # clients vmapped together by auto on one CPU device
CPU_CHUNK_MIN_COHORT = 10  # from this many clients: chunked
CPU_CHUNK_EXAMPLE_FLOPS = (5e4, 1e6)  # forward FLOPs an example of a model chunked


def model_profile(model, example, backend: Optional[str] = None) -> ModelProfile:
    """The ``ModelProfile`` of ``model`` (a ``models.Model``) on examples shaped like
    ``example`` (a dict of arrays or ``ShapeDtypeStruct``, one example, no batch axis).
    Its FLOPs are counted (``models.base.example_flops``: XLA's cost analysis of the
    loss lowered for the CPU, the same count on every backend, nothing compiled) only
    where ``choose`` reads them: every model on a CPU, a convolutional model off it."""
    from fedjax_fair.models.base import example_flops
    backend = backend or jax.default_backend()
    conv = bool(model.uses_xla_conv)
    return ModelProfile(conv, example_flops(model, example) if conv or backend == "cpu"
                        else None)


def choose(backend: str, cohort_size: int, model: Optional[ModelProfile] = None,
           devices: int = 1) -> tuple[str, Optional[int]]:
    """``auto``'s (strategy, chunk_size) for ``cohort_size`` clients on one device of
    ``backend`` ("cpu", "gpu", "tpu", ...), for a model described by ``model`` (None:
    a dense one of unknown size), where the round runs over ``devices`` devices (a
    mesh's; ``cohort_size`` is then one device's share).

    CPU, one device: ``chunked`` in chunks of ``CPU_CHUNK`` for a model without XLA
    convolutions whose forward pass takes ``CPU_CHUNK_EXAMPLE_FLOPS`` = [low, high)
    FLOPs an example, from ``CPU_CHUNK_MIN_COHORT`` clients; else ``sequential`` (one
    client's parameters stay in cache across its local steps, and masked steps are
    skipped), also where the FLOPs are unknown (None, or 0 when XLA reported none).
    CPU, several devices: ``sequential`` on each.
    Accelerators: ``vmap`` for dense models; convolutional ones with a forward pass of
    ``HEAVY_CONV_EXAMPLE_FLOPS`` or more an example run ``sequential``; lighter
    convolutional ones ``vmap`` up to ``CONV_GROUP`` clients and ``chunked`` in groups
    of ``CONV_GROUP`` above (whatever ``devices``)."""
    if backend == "cpu":
        low, high = CPU_CHUNK_EXAMPLE_FLOPS
        light = (model is not None and not model.convolutional
                 and model.example_flops is not None  # None: not counted
                 and low <= model.example_flops < high)
        if light and devices == 1 and cohort_size >= CPU_CHUNK_MIN_COHORT:
            return "chunked", CPU_CHUNK
        return "sequential", None
    if model is None or not model.convolutional:
        return "vmap", None
    if model.example_flops is not None and model.example_flops >= HEAVY_CONV_EXAMPLE_FLOPS:
        return "sequential", None
    return ("vmap", None) if cohort_size <= CONV_GROUP else ("chunked", CONV_GROUP)


def resolve(strategy: str, cohort_size: int, backend: Optional[str] = None,
            chunk_size: Optional[int] = None,
            model: Optional[ModelProfile] = None,
            devices: int = 1) -> tuple[str, Optional[int]]:
    """Returns the concrete (strategy, chunk_size) for ``strategy`` over
    ``cohort_size`` clients on one device; ``auto`` is ``choose(backend, cohort_size,
    model, devices)`` (a ``chunk_size`` given wins over its group)."""
    if strategy not in STRATEGIES:
        raise H.FieldError("execution", f"unknown strategy {strategy!r}; allowed: "
                                        f"{list(STRATEGIES)}")
    backend = backend or jax.default_backend()
    if strategy == "auto":
        strategy, group = choose(backend, cohort_size, model, devices)
        if strategy != "chunked":
            return strategy, None
        chunk_size = chunk_size or group
    if strategy in ("chunked", "bucketed"):
        default = 8 if strategy == "chunked" else -(-cohort_size // NUM_BUCKETS)
        chunk_size = chunk_size or default
        if chunk_size <= 0:
            raise H.FieldError("execution", f"chunk_size must be positive, got {chunk_size}")
        if chunk_size >= cohort_size:
            return "vmap", None
        return strategy, chunk_size
    return strategy, None


def loss_chunk_size_here(backend: Optional[str] = None) -> int:
    """Rows per forward pass of a client's ``loss_before`` evaluation (client.py), for
    the client being traced.

    32 when it runs alone on CPU (no client axis bound: the ``sequential`` strategy):
    the chunks stay in cache and chunks of pure padding are skipped. One forward pass
    over 50 FEMNIST-shaped clients of 50-200 rows padded to 200, 2-core CPU: the MLP
    31 ms with 32 (38 ms with 64, 31 ms with 256), the LEAF CNN 1.80 s (2.04 s with
    64, 2.59 s with 256). 256 otherwise: under vmap the chunk loop turns into selects
    over every chunk (vmap on CPU: 1.44 s with 64 vs 0.97 s with 256).
    """
    backend = backend or jax.default_backend()
    alone = group_max(jnp.zeros((), jnp.int32)) is None
    return 32 if (alone and backend == "cpu") else 256


def local_step_unroll(uses_xla_conv: bool, backend: Optional[str] = None) -> int | bool:
    """Unroll policy of the local-step scan: full unroll only for XLA convs on CPU."""
    backend = backend or jax.default_backend()
    return True if (uses_xla_conv and backend == "cpu") else 1


class Reduction(NamedTuple):
    """How ``map_clients(..., reduce=)`` combines a per-client value as the clients
    finish, instead of stacking it over the cohort (aggregators.STREAM_SUM).

    ``fold(batch)``: the elements of a tree with leading axis n combined into one
    element (associative and commutative, so chunks, sequential chains and devices
    may combine in any grouping). ``empty(shapes)``: the identity element for a tree
    of element shapes (anything with ``.shape`` and ``.dtype``); it starts each fold
    and stands in for a mesh's padding clients.
    """

    fold: Callable
    empty: Callable


def _fold_into(reduce: Reduction, acc, parts, batched: bool):
    """``acc`` combined with one element ``parts`` (or a batch of them)."""
    grow = (lambda p: p) if batched else (lambda p: p[None])
    return reduce.fold(jax.tree.map(lambda a, p: jnp.concatenate([a[None], grow(p)]),
                                    acc, parts))


def _element_shapes(fn, arg, batched: bool):
    """The shapes of one reduced element of ``fn(arg) -> (out, parts)``."""
    parts = jax.eval_shape(fn, arg)[1]
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:] if batched else s.shape,
                                                       s.dtype), parts)


def _map_rows(fn: Callable, xs, reduce: Optional[Reduction], batched: bool):
    """``lax.map`` of ``fn`` over the leading axis of ``xs``. With ``reduce``, ``fn``
    returns ``(out, parts)``: ``out`` is stacked, ``parts`` (one element, or a batch
    of them if ``batched``) folded into a running element carried by a ``lax.scan``,
    so no [rows, ...] stack of them is ever built."""
    if reduce is None:
        return jax.lax.map(fn, xs)
    first = jax.tree.map(lambda v: v[0], xs)

    def body(acc, x):
        out, parts = fn(x)
        return _fold_into(reduce, acc, parts, batched), out

    acc, out = jax.lax.scan(body, reduce.empty(_element_shapes(fn, first, batched)), xs)
    return out, acc


def _map_chunks(fn: Callable, xs, chunk_size: int, reduce: Optional[Reduction] = None):
    """``fn`` (batched over a leading axis) over chunks of ``chunk_size`` rows of ``xs``
    with ``lax.map``; a last partial chunk runs as one extra call. With ``reduce``,
    ``fn`` returns ``(out, parts)`` and ``parts`` are folded (``_map_rows``).

    Each chunk is sliced out of ``xs`` inside the loop: a [chunks, chunk_size, ...]
    reshape of the cohort's data would make XLA copy all of it (627 MiB for 1,000
    MLP clients of 200 rows)."""
    k = jax.tree.leaves(xs)[0].shape[0]
    full = k - k % chunk_size
    chunk = lambda i: jax.tree.map(
        lambda v: jax.lax.dynamic_slice_in_dim(v, i * chunk_size, chunk_size), xs)
    mapped = _map_rows(lambda i: fn(chunk(i)), jnp.arange(full // chunk_size), reduce,
                       batched=True)
    out, acc = mapped if reduce is not None else (mapped, None)
    out = jax.tree.map(lambda v: v.reshape(full, *v.shape[2:]), out)
    if full < k:
        tail = fn(jax.tree.map(lambda v: v[full:], xs))
        if reduce is not None:
            tail, parts = tail
            acc = _fold_into(reduce, acc, parts, batched=True)
        out = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), out, tail)
    return out if reduce is None else (out, acc)


def map_clients(fn: Callable, execution: Union[str, Execution, None],
                cohort_size: int, reduce: Optional[Reduction] = None) -> Callable:
    """Maps ``fn(shared, *per_client)`` over the leading axis of ``per_client``.

    ``shared`` (the server parameters) is broadcast to every client; every leaf of
    ``per_client`` has leading axis K. Returns ``mapped(shared, per_client,
    sizes=None)`` whose outputs have leading axis K, in cohort order. ``sizes``
    [K] (client sizes) orders the clients into buckets under ``"bucketed"``;
    other strategies ignore it. Under ``execution.mesh`` each device maps its share
    of the cohort (``sharding.map_sharded``) with the strategy.

    ``reduce``: ``fn`` returns ``(out, part)``; ``mapped`` returns ``(outs, total)``
    with ``outs`` stacked as above and ``total`` every client's ``part`` folded by
    the ``Reduction``: inside a vmapped group, along a sequential chain or over
    chunks (a ``lax.scan`` carry), then over the mesh's devices. No [K, ...] stack
    of the parts is built, so a round's memory does not grow with K times their
    size (a client's whole update, for ``compose``'s streamed aggregation).
    """
    execution = as_execution(execution)
    mesh = execution.mesh
    if mesh is None and execution.strategy == "auto":
        mesh = auto_mesh(cohort_size)
    if mesh is None:
        return _map_local(fn, execution, cohort_size, reduce)
    if reduce is not None:  # a padding client's part is the identity
        fn = _padding_folds_nothing(fn, reduce)
    local = _map_local(fn, execution, sharding.per_device(cohort_size, mesh), reduce,
                       devices=sharding.num_shards(mesh))
    return sharding.map_sharded(local, mesh, cohort_size,
                                fold=None if reduce is None else reduce.fold)


def _padding_folds_nothing(fn: Callable, reduce: Reduction) -> Callable:
    """``fn`` taking ``(per_client, real)``: where ``real`` is False (a mesh's padding
    client) its part is replaced by the reduction's identity."""

    def padded(shared, xs):
        per_client, real = xs
        out, part = fn(shared, per_client)
        empty = reduce.empty(part)
        return out, jax.tree.map(lambda p, e: jnp.where(real, p, e), part, empty)

    return padded


# FLOPs of one client's local step (3 x batch x the forward FLOPs of an example) from
# which one XLA:CPU device already keeps the cores busy, splitting the step's large
# products over its threads, so that ``auto_mesh`` keeps to one device. Measured
# (docs/performance.md, "Final CPU re-run"): the MLP at batch 20 (25 MFLOP a step)
# ran 1.7-2.5x faster on two CPU devices than on one; the LEAF CNN at batch 20
# (1.5 GFLOP a step, patches + matmul) 0.90x.
SPLIT_MAX_STEP_FLOPS = 2e8
# FLOPs of a round's local training (cohort x local steps x step FLOPs) below which
# ``auto_mesh`` keeps to one device: a mesh adds cross-device exchanges to every round
# (the gather of the cohort's rows, the server's reductions over clients; about
# 1-8 ms a round on two CPU devices) that only a round with enough work pays back.
# Measured (docs/performance.md, "Final CPU re-run"): logistic regression at cohort
# 10 (5.8e8 FLOPs a round, 11 ms) broke even on two CPU devices (1.03x one device's
# round); the MLP at cohort 10 (2.5e9) ran 1.74x faster.
SPLIT_MIN_ROUND_FLOPS = 1e9


def auto_mesh(cohort_size: int, backend: Optional[str] = None,
              num_clients: Optional[int] = None,
              step_flops: Optional[float] = None,
              round_flops: Optional[float] = None) -> Optional[jax.sharding.Mesh]:
    """The mesh ``auto`` splits a cohort over when no mesh is given: local CPU
    devices when the backend is a CPU with more than one (a single-process job, a cohort
    of at least two clients); None otherwise (one device, accelerators, multi-host,
    or a cohort of one).

    The mesh takes at most ``cohort_size`` devices (more would only compute padding
    clients). With ``num_clients`` (a federation to be placed over the mesh, as
    ``runner.run`` does) it takes the most devices that split the federation evenly,
    so that each device holds its share instead of a copy of the whole federation
    (``sharding.federation_shardings``); None when only one device would.
    ``step_flops``: the FLOPs of a client's local step; from ``SPLIT_MAX_STEP_FLOPS``
    on, None (one device already uses the cores inside each step). ``round_flops``:
    the FLOPs of a round's local training; below ``SPLIT_MIN_ROUND_FLOPS``, None (the
    mesh's exchanges would cost more than the split saves).

    On CPU each device runs its share of the clients as its own ``sequential`` chain
    on its own thread (2-core CPU, MLP cohort 100, benchmarks/cpu_investigation.py
    ``cores``: 1.9x one device's best round at load 3, 1.1-1.25x at load 4.5 when
    other jobs hold the cores; 13-15% fewer CPU seconds). The outputs equal the
    one-device round's to float rounding (sums over clients split into partial sums).
    CPU devices are made before JAX starts (``jax_num_cpu_devices``;
    ``sharding.provide_cpu_devices``); by default there is one and ``auto`` runs
    unsharded.
    """
    backend = backend or jax.default_backend()
    if backend != "cpu" or cohort_size < 2 or jax.process_count() > 1:
        return None
    if step_flops is not None and step_flops >= SPLIT_MAX_STEP_FLOPS:
        return None
    if round_flops is not None and round_flops < SPLIT_MIN_ROUND_FLOPS:
        return None
    devices = jax.local_devices(backend="cpu")[:cohort_size]
    if num_clients is not None:
        count = max(d for d in range(1, len(devices) + 1) if num_clients % d == 0)
        devices = devices[:count]
    if len(devices) < 2:
        return None
    # the clients axis alone (no size-1 model axis): every axis of the mesh is then
    # manual inside the shard_map, which eager (unjitted) grad and vmap also accept
    return jax.sharding.Mesh(np.asarray(devices, dtype=object), (sharding.CLIENTS,),
                             axis_types=(jax.sharding.AxisType.Auto,))


def _map_local(fn: Callable, execution: Execution, cohort_size: int,
               reduce: Optional[Reduction] = None, devices: int = 1) -> Callable:
    """``map_clients`` on one device: the strategy over ``cohort_size`` clients (one
    device's share of a round over ``devices``)."""
    strategy, chunk_size = resolve(execution.strategy, cohort_size,
                                   chunk_size=execution.chunk_size, model=execution.model,
                                   devices=devices)
    vmapped = jax.vmap(fn, in_axes=(None, 0), axis_name=CLIENT_AXIS)

    def mapped(shared, per_client, sizes=None):
        if strategy == "vmap":
            out = vmapped(shared, per_client)
            return out if reduce is None else (out[0], reduce.fold(out[1]))
        if strategy == "sequential":
            return _map_rows(lambda xs: fn(shared, xs), per_client, reduce, batched=False)
        if strategy == "chunked" or sizes is None:
            return _map_chunks(lambda xs: vmapped(shared, xs), per_client, chunk_size, reduce)
        order = jnp.argsort(sizes, stable=True)
        out = _map_chunks(lambda xs: vmapped(shared, xs),
                          jax.tree.map(lambda v: v[order], per_client), chunk_size, reduce)
        inverse = jnp.argsort(order)
        unsort = lambda tree: jax.tree.map(lambda v: v[inverse], tree)
        return unsort(out) if reduce is None else (unsort(out[0]), out[1])

    return mapped
