"""Execution strategies (fedjax_fair/core/execution.py): vmap, chunked, bucketed and
sequential rounds agree with each other and with a Python loop over clients;
map_clients and its reductions, client.skip_past under each strategy, padding and
cohort-order invariances, tracing once, execution.resolve and auto_mesh.

The federation is helpers.tiny_federation(): 6 clients, 10 features, 3 classes,
train sizes (7, 12, 0, 3, 9, 5) padded to M = 12, client 2 empty.
"""

from __future__ import annotations

import functools
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from helpers import (ENGINE_PARAMS as PARAMS, ENGINE_TRAIN as TRAIN, ENGINE_N as N,
                     TRAIN_SIZES_ARRAY as SIZES, ENGINE_B as B, ENGINE_E as E, UNLIMITED,
                     ENGINE_KEY as KEY, ENGINE_IDS as IDS, engine_steps as _steps,
                     engine_fedavg as _fedavg, vmap_apply as _vmap_apply,
                     vmap_apply_on as _vmap_apply_on, vmap_round as _vmap_round,
                     single_client as _single_client)
from fedjax_fair import hparams as H
from fedjax_fair.core import client as client_lib
from fedjax_fair.core import execution
from fedjax_fair.core.client import max_local_steps
from fedjax_fair.core.execution import Execution


def _one_round(alg, cohort, key=KEY, params=PARAMS):
    return jax.jit(alg.apply)(alg.init(params, N), cohort, key)


def test_vmap_round_equals_python_loop_over_single_client_updates():
    state, metrics = _vmap_round()
    client_update = _single_client()
    deltas, losses, steps = [], [], []
    for cid in IDS:
        out, cs = client_update(PARAMS, (), helpers.client(TRAIN, cid), jnp.int32(UNLIMITED),
                                jax.random.fold_in(KEY, cid))
        assert cs == ()
        deltas.append(out.delta)
        losses.append(float(out.loss_before))
        steps.append(int(out.num_steps))
    n = SIZES[list(IDS)].astype(np.float64)
    p = n / n.sum()
    expected = jax.tree.map(
        lambda w, *d: np.asarray(w, np.float64) - sum(pk * np.asarray(dk, np.float64)
                                                      for pk, dk in zip(p, d)),
        PARAMS, *deltas)
    helpers.assert_trees_close(state.params, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["weights"], p, rtol=1e-6)
    np.testing.assert_allclose(metrics["loss_before"], losses, rtol=1e-6)
    np.testing.assert_array_equal(metrics["num_steps"], steps)
    np.testing.assert_array_equal(metrics["num_steps"], [_steps(SIZES[c]) for c in IDS])
    np.testing.assert_array_equal(metrics["client_ids"], IDS)
    assert int(state.round) == 1


@functools.cache
def _strategy_round(strategy, chunk_size=None):
    return _one_round(_fedavg(execution=strategy, chunk_size=chunk_size),
                      helpers.cohort(TRAIN, IDS))


@pytest.mark.parametrize("strategy,chunk_size", [
    ("chunked", 2),  # divides K = 6
    ("chunked", 4),  # does not divide K = 6
    ("sequential", None),
    ("bucketed", 4),  # sorted by size, a partial last bucket
])
def test_strategies_equal_vmap(strategy, chunk_size):
    ref_state, ref_metrics = _vmap_round()
    state, metrics = _strategy_round(strategy, chunk_size)
    helpers.assert_trees_close(state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    for name in ("weights", "loss_before", "train_loss", "update_norm"):
        np.testing.assert_allclose(metrics[name], ref_metrics[name], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(metrics["num_steps"], ref_metrics["num_steps"])


def test_map_clients_chunked_matches_vmap_on_a_plain_function():
    fn = lambda shared, xs: (shared * xs[0] + xs[1], xs[1].sum())
    xs = (jnp.arange(7.0), jnp.arange(14.0).reshape(7, 2))
    ref = execution.map_clients(fn, "vmap", 7)(jnp.float32(2.0), xs)
    for strategy, c in (("chunked", 3), ("chunked", 7), ("sequential", None),
                        ("bucketed", 3), ("bucketed", None)):
        out = jax.jit(execution.map_clients(fn, Execution(strategy, c), 7))(jnp.float32(2.0), xs)
        chex.assert_trees_all_close(out, ref)
    # Buckets sort the clients by size; the outputs come back in cohort order.
    sizes = jnp.array([5, 1, 4, 1, 9, 2, 6])
    out = jax.jit(execution.map_clients(fn, Execution("bucketed", 2), 7))(jnp.float32(2.0), xs, sizes)
    chex.assert_trees_all_close(out, ref)


SUM = execution.Reduction(
    fold=lambda batch: jax.tree.map(lambda v: jnp.sum(v, axis=0), batch),
    empty=lambda shapes: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))


@pytest.mark.parametrize("strategy,chunk_size", [
    ("vmap", None), ("chunked", 3), ("chunked", 7), ("sequential", None),
    ("bucketed", 2), ("bucketed", None)])
def test_map_clients_folds_a_reduction_as_the_clients_finish(strategy, chunk_size):
    # fn returns (stacked output, part to fold): the fold over every strategy equals
    # the sum of the stacked parts, and the stacked outputs keep cohort order
    fn = lambda shared, xs: (shared * xs[0], {"v": xs[1] * shared, "n": xs[0]})
    xs = (jnp.arange(7.0), jnp.arange(14.0).reshape(7, 2))
    sizes = jnp.array([5, 1, 4, 1, 9, 2, 6])
    out, total = jax.jit(execution.map_clients(fn, Execution(strategy, chunk_size), 7,
                                               reduce=SUM))(jnp.float32(2.0), xs, sizes)
    np.testing.assert_allclose(out, 2.0 * np.arange(7.0))
    np.testing.assert_allclose(total["v"], 2.0 * np.arange(14.0).reshape(7, 2).sum(0))
    np.testing.assert_allclose(total["n"], np.arange(7.0).sum())


def _count_steps(strategy, counts, chunk_size=None):
    """Steps each client takes through client.skip_past, and the traced program."""
    def fn(shared, count):
        def body(c, t):
            return client_lib.skip_past(count, lambda c, t: c + 1, c, t), None
        return jax.lax.scan(body, shared, jnp.arange(10))[0]
    mapped = execution.map_clients(fn, Execution(strategy, chunk_size), len(counts))
    counts = jnp.asarray(counts)
    return (jax.jit(mapped)(jnp.int32(0), counts, counts),
            str(jax.make_jaxpr(mapped)(jnp.int32(0), counts, counts)))


@pytest.mark.parametrize("strategy,chunk_size", [("vmap", None), ("chunked", 2),
                                                 ("bucketed", 2), ("sequential", None)])
def test_skip_past_takes_each_clients_steps(strategy, chunk_size):
    steps, _ = _count_steps(strategy, [3, 0, 7, 2, 10], chunk_size)
    np.testing.assert_array_equal(steps, [3, 0, 7, 2, 10])


def test_skip_past_under_client_vmap_branches_on_the_group_max():
    # The predicate is the group's pmax (unbatched), so the step is a real cond that
    # XLA skips past the busiest client, not a select computing all 10 steps.
    _, jaxpr = _count_steps("vmap", [3, 1, 2])
    assert "pmax" in jaxpr and "cond[" in jaxpr
    # A plain user vmap (no named client axis) still gives the right counts.
    def fn(count):
        return jax.lax.scan(lambda c, t: (client_lib.skip_past(count, lambda c, t: c + 1, c, t),
                                          None), jnp.int32(0), jnp.arange(10))[0]
    np.testing.assert_array_equal(jax.vmap(fn)(jnp.array([3, 1, 2])), [3, 1, 2])


def test_padding_invariance():
    # Sequential execution (cheaper to compile); test_strategies_equal_vmap ties it
    # to vmap.
    ref_state, ref_metrics = _strategy_round("sequential")
    padded = helpers.repad(TRAIN, 19)  # not a multiple of B; the scan grows 6 -> 10 steps
    assert max_local_steps(19, B, E) > max_local_steps(12, B, E)
    state, metrics = _one_round(_fedavg(execution="sequential"), helpers.cohort(padded, IDS))
    helpers.assert_trees_close(state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(metrics["num_steps"], ref_metrics["num_steps"])
    np.testing.assert_allclose(metrics["loss_before"], ref_metrics["loss_before"], rtol=1e-6)


def test_cohort_order_invariance():
    ref_state, ref_metrics = _vmap_round()
    perm = np.array([4, 2, 0, 5, 1, 3])
    ids = np.asarray(IDS)[perm]
    state, metrics = _vmap_apply_on(helpers.cohort(TRAIN, ids))
    helpers.assert_trees_close(state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    for name in ("weights", "loss_before", "num_steps"):
        np.testing.assert_allclose(metrics[name], np.asarray(ref_metrics[name])[perm],
                                   rtol=1e-6)


def test_apply_traces_once_for_new_values_of_same_shapes():
    alg, apply = _vmap_apply()  # wrapped in chex.assert_max_traces(n=1)
    _vmap_round()
    state = alg.init(PARAMS, N)
    for seed in range(1, 4):
        data = helpers.tiny_federation(seed=seed)
        ids = np.random.default_rng(seed).permutation(N)
        budgets = np.random.default_rng(seed).integers(0, 8, N)
        state, metrics = apply(state, helpers.cohort(data.train, ids, budgets),
                               jax.random.key(seed))
    assert int(state.round) == 3
    assert helpers.tree_all_finite(state.params)


def test_resolve_rejects_unknown_strategy():
    with pytest.raises(ValueError) as info:
        execution.resolve("pmap", 8)
    for allowed in ("auto", "vmap", "chunked", "sequential"):
        assert allowed in str(info.value)
    assert "pmap" in str(info.value)


def test_resolve_rules():
    assert execution.resolve("auto", 100, backend="gpu") == ("vmap", None)
    assert execution.resolve("auto", 100, backend="tpu") == ("vmap", None)
    # CPU, a model of unknown size: one client after another
    assert execution.resolve("auto", 100, backend="cpu") == ("sequential", None)
    assert execution.resolve("chunked", 10, chunk_size=3) == ("chunked", 3)
    assert execution.resolve("chunked", 10, chunk_size=10) == ("vmap", None)
    assert execution.resolve("sequential", 10) == ("sequential", None)
    assert execution.resolve("vmap", 10) == ("vmap", None)
    with pytest.raises(ValueError):
        execution.resolve("chunked", 10, chunk_size=-2)


# auto's choice for each model of the zoo, as built on an accelerator (XLA convolutions),
# at cohorts 10 / 100 / 1,000 (docs/performance.md, "Choosing the strategy on a GPU")
_LIGHT_CONV = ("vmap", "vmap", "chunked")
ZOO_CHOICES = {
    "logreg": ((784,), ("vmap",) * 3), "mlp": ((784,), ("vmap",) * 3),
    "mlp2": ((3072,), ("vmap",) * 3), "twonn": ((784,), ("vmap",) * 3),
    "char_lstm": ((80,), ("vmap",) * 3),
    "cnn": ((28, 28, 1), _LIGHT_CONV), "femnist_cnn": ((28, 28, 1), _LIGHT_CONV),
    "cnn_ch": ((28, 28, 1), _LIGHT_CONV), "twocnn": ((28, 28, 1), _LIGHT_CONV),
    "lenet_fedpd": ((32, 32, 3), _LIGHT_CONV), "vgg9": ((32, 32, 3), _LIGHT_CONV),
    "resnet9": ((32, 32, 3), _LIGHT_CONV), "mobilenet": ((64, 64, 3), _LIGHT_CONV),
    "resnet18_gn": ((32, 32, 3), ("sequential",) * 3),
    "resnet10_gn_sn": ((32, 32, 3), ("sequential",) * 3),
}


# auto's choice on a CPU for each model of the zoo as built there (convolutions as
# patches + matmul where the model offers it), at cohorts 10 / 100 / 1,000
# (docs/performance.md, "Choosing the strategy on a CPU (issue 50)"): models without XLA
# convolutions of 0.05-1 MFLOP an example (execution.CPU_CHUNK_EXAMPLE_FLOPS; the zoo's
# MLP 784-200-200-10 and TwoNN) run chunks of execution.CPU_CHUNK clients from
# execution.CPU_CHUNK_MIN_COHORT clients, the others (the 10-class logistic
# regression's 0.016 MFLOP, mlp2's 1.3, every CNN) one client after another
_SEQ = ("sequential",) * 3
_CHUNKS = ("chunked",) * 3
CPU_CHOICES = {
    "logreg": _SEQ, "mlp": _CHUNKS, "mlp2": _SEQ, "twonn": _CHUNKS,
    "char_lstm": _SEQ, "cnn": _SEQ, "femnist_cnn": _SEQ, "cnn_ch": _SEQ, "twocnn": _SEQ,
    "lenet_fedpd": _SEQ, "vgg9": _SEQ, "resnet9": _SEQ, "mobilenet": _SEQ,
    "resnet18_gn": _SEQ, "resnet10_gn_sn": _SEQ,
}


def test_every_zoo_model_has_its_choice_listed():
    from fedjax_fair.models import MODELS
    assert sorted(ZOO_CHOICES) == sorted(MODELS) == sorted(CPU_CHOICES)


def _zoo_profile(name, backend, **kwargs):
    from fedjax_fair.models import get_model
    shape = ZOO_CHOICES[name][0]
    model = get_model(name, shape, 10, **kwargs)
    dtype = jnp.int32 if name == "char_lstm" else jnp.float32
    example = {"x": jax.ShapeDtypeStruct(shape, dtype), "y": jax.ShapeDtypeStruct((), jnp.int32)}
    return execution.model_profile(model, example, backend=backend)


@pytest.mark.parametrize("name", sorted(ZOO_CHOICES))
def test_auto_chooses_by_model_and_backend(name):
    import inspect
    from fedjax_fair.models import MODELS
    expected = ZOO_CHOICES[name][1]
    as_on_gpu = {"conv_impl": "xla"} if "conv_impl" in inspect.signature(
        MODELS[name]).parameters else {}
    profile = _zoo_profile(name, "gpu", **as_on_gpu)
    for cohort, strategy in zip((10, 100, 1000), expected):
        for backend in ("gpu", "tpu"):
            chosen = execution.choose(backend, cohort, profile)
            assert chosen[0] == strategy, (name, cohort, backend, profile)
            assert (chosen[1] is not None) == (strategy == "chunked")
    on_cpu = _zoo_profile(name, "cpu")
    assert on_cpu.example_flops > 0  # counted on a CPU, where choose reads them
    for cohort, strategy in zip((10, 100, 1000), CPU_CHOICES[name]):
        chosen = execution.choose("cpu", cohort, on_cpu)
        assert chosen == ((strategy, execution.CPU_CHUNK) if strategy == "chunked"
                          else (strategy, None)), (name, cohort, on_cpu)


def test_auto_on_a_cpu_by_cohort_and_model_size():
    """chunked from CPU_CHUNK_MIN_COHORT clients for a model without XLA convolutions
    whose forward FLOPs lie in CPU_CHUNK_EXAMPLE_FLOPS; sequential otherwise,
    including a model of unknown FLOPs; accelerators unchanged."""
    low, high = execution.CPU_CHUNK_EXAMPLE_FLOPS
    light = execution.ModelProfile(False, low)
    least = execution.CPU_CHUNK_MIN_COHORT
    chunked = ("chunked", execution.CPU_CHUNK)
    assert execution.CPU_CHUNK < least  # a chunked cohort holds two chunks or more
    assert execution.choose("cpu", least, light) == chunked
    assert execution.choose("cpu", 10_000, execution.ModelProfile(False, high / 2)) == chunked
    assert execution.choose("cpu", least - 1, light) == ("sequential", None)
    for flops in (high, 10 * high, low / 2, None, 0.0):  # heavy, tiny, not counted
        assert execution.choose("cpu", 1000, execution.ModelProfile(False, flops)) == \
            ("sequential", None), flops
    assert execution.choose("cpu", 1000, None) == ("sequential", None)
    assert execution.choose("cpu", 1000, execution.ModelProfile(True, low)) == \
        ("sequential", None)  # XLA convolutions: never vmapped on a CPU
    # several CPU devices (a mesh's share of the cohort): one chain of clients on each
    assert execution.choose("cpu", 1000, light, devices=2) == ("sequential", None)
    assert execution.resolve("auto", 1000, backend="cpu", model=light, devices=2) == \
        ("sequential", None)
    # accelerators: the GPU rule, whatever the devices
    assert execution.choose("gpu", 1000, light) == ("vmap", None)
    assert execution.choose("gpu", 1000, light, devices=2) == ("vmap", None)
    conv = execution.ModelProfile(True, 3e7)
    assert execution.choose("gpu", 1000, conv, devices=2) == ("chunked", execution.CONV_GROUP)
    # resolve: a chunk_size given wins over CPU_CHUNK
    assert execution.resolve("auto", 1000, backend="cpu", model=light) == chunked
    assert execution.resolve("auto", 1000, backend="cpu", model=light, chunk_size=32) == \
        ("chunked", 32)
    assert execution.resolve("auto", 1000, backend="cpu", model=light,
                             chunk_size=1000) == ("vmap", None)


def test_a_run_resolves_auto_to_chunks_for_a_small_dense_model_on_one_cpu_device():
    """runner.run's resolution (spec.resolved_execution) profiles the model on the
    federation's examples: the MLP 784-200-200-10 on one CPU device runs chunks of
    CPU_CHUNK clients, with the same round as one client after another (to float
    rounding); logistic regression on 10 features stays sequential."""
    if jax.default_backend() != "cpu" or jax.local_device_count() != 1:
        pytest.skip("one CPU device")
    from fedjax_fair.algorithms import ClientTraining, fedavg
    from fedjax_fair.core.types import FederatedData
    from fedjax_fair.drivers.spec import resolved_execution
    from fedjax_fair.models import mlp
    sizes = (7, 12, 3, 9, 5, 8, 6, 10, 4, 11, 9, 7)
    arrays = helpers.client_arrays(sizes, num_features=784, num_classes=10)
    data = FederatedData(train=helpers.pack(arrays), test=helpers.pack(arrays))
    model = mlp((784,), 10)
    ex = resolved_execution("auto", 12, 12, model, data)
    assert (ex.strategy, ex.chunk_size, ex.mesh) == ("chunked", execution.CPU_CHUNK, None)
    assert execution.CPU_CHUNK_EXAMPLE_FLOPS[0] <= ex.model.example_flops \
        < execution.CPU_CHUNK_EXAMPLE_FLOPS[1]
    alg = fedavg(model, training=ClientTraining(lr=0.1, batch_size=4, num_epochs=2))
    params = helpers.init_params(model, 0)
    cohort = helpers.cohort(data.train, range(12))
    run = lambda e: jax.jit(lambda: alg.apply(alg.init(params, 12), cohort,
                                              jax.random.key(1), execution=e))()
    chunked, seq = run(ex), run(execution.Execution("sequential"))
    helpers.assert_trees_close(chunked[0].params, seq[0].params, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(chunked[1]["loss_before"], seq[1]["loss_before"], rtol=1e-5)
    small = resolved_execution("auto", 5, 6, helpers.logreg(), helpers.tiny_federation())
    assert (small.strategy, small.chunk_size) == ("sequential", None)


def test_auto_sees_a_heavy_model_where_lowered_programs_report_no_cost(monkeypatch):
    """On a GPU the CUDA plugin has no cost analysis before compiling
    (``Lowered.cost_analysis`` is None): ResNet-18-GN's forward FLOPs must still be
    counted, or ``auto`` runs it vmap (3.80 s a round on an H200 against 1.49 s
    sequential, docs/performance.md)."""
    from fedjax_fair.models import get_model
    monkeypatch.setattr(jax.stages.Lowered, "cost_analysis", lambda self: None)
    model = get_model("resnet18_gn", (32, 32, 3), 10)
    example = {"x": jax.ShapeDtypeStruct((32, 32, 3), jnp.float32),
               "y": jax.ShapeDtypeStruct((), jnp.int32)}
    profile = execution.model_profile(model, example, backend="gpu")
    assert profile.example_flops >= execution.HEAVY_CONV_EXAMPLE_FLOPS
    assert execution.choose("gpu", 10, profile) == ("sequential", None)


def test_auto_resolves_with_the_model_and_keeps_a_given_chunk():
    light = execution.ModelProfile(True, 3e7)
    assert execution.resolve("auto", 1000, backend="gpu", model=light) == \
        ("chunked", execution.CONV_GROUP)
    assert execution.resolve("auto", 1000, backend="gpu", model=light, chunk_size=50) == \
        ("chunked", 50)
    assert execution.resolve("auto", 1000, backend="gpu",
                             model=execution.ModelProfile(True, 1e9)) == ("sequential", None)
    assert execution.resolve("auto", 1000, backend="gpu") == ("vmap", None)  # no model: dense


def test_auto_mesh_only_for_several_cpu_devices():
    """One device (the test process), accelerators, or a cohort of one: no mesh."""
    assert execution.auto_mesh(100, backend="gpu") is None
    assert execution.auto_mesh(1, backend="cpu") is None
    if len(jax.local_devices(backend="cpu")) == 1:
        assert execution.auto_mesh(100, backend="cpu") is None


_AUTO_MESH_CHECK = """
import jax, jax.numpy as jnp, numpy as np, optax
import helpers
from fedjax_fair.algorithms import ClientTraining, fedavg
from fedjax_fair.core import execution
from fedjax_fair.core.execution import Execution
model, data = helpers.logreg(), helpers.tiny_federation()
params = helpers.init_params(model, 0)
cohort = helpers.cohort(data.train, (4, 0, 3, 1, 5))  # 5 clients over 2 devices: padded
assert execution.auto_mesh(5) is not None and execution.auto_mesh(5).devices.size == 2
# a federation to place: only devices that split it evenly (7 clients: none of 2)
assert execution.auto_mesh(5, num_clients=6).devices.size == 2
assert execution.auto_mesh(5, num_clients=7) is None
# local steps that busy one device's cores (execution.SPLIT_MAX_STEP_FLOPS): no split
assert execution.auto_mesh(5, step_flops=execution.SPLIT_MAX_STEP_FLOPS) is None
assert execution.auto_mesh(5, step_flops=1e6).devices.size == 2
# rounds whose local training is too small to pay for the mesh: no split
floor = execution.SPLIT_MIN_ROUND_FLOPS
assert execution.auto_mesh(5, step_flops=1e6, round_flops=floor / 2) is None
assert execution.auto_mesh(5, step_flops=1e6, round_flops=floor).devices.size == 2

def run(strategy, lr=0.5):
    alg = fedavg(model, training=ClientTraining(lr=lr, batch_size=4, num_epochs=2))
    return alg.apply(alg.init(params, 6), cohort, jax.random.key(1),
                     execution=Execution(strategy))

seq, auto = jax.jit(lambda: run("sequential"))(), jax.jit(lambda: run("auto"))()
for a, b in zip(jax.tree.leaves((seq[0].params, seq[1]["loss_before"])),
                jax.tree.leaves((auto[0].params, auto[1]["loss_before"]))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
text = jax.jit(lambda: run("auto")).lower().compile().as_text()
assert "num_partitions=2" in text, text[:400]
# a traced hyper-parameter: vmap and grad through the sharded round
lrs = jnp.asarray([0.1, 0.5])
seqs = jax.vmap(lambda lr: run("sequential", lr)[0].params)(lrs)
autos = jax.jit(jax.vmap(lambda lr: run("auto", lr)[0].params))(lrs)
for a, b in zip(jax.tree.leaves(seqs), jax.tree.leaves(autos)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
loss = lambda strategy: lambda lr: sum(jnp.sum(v ** 2) for v in jax.tree.leaves(
    run(strategy, lr)[0].params))
np.testing.assert_allclose(jax.grad(loss("auto"))(0.3), jax.grad(loss("sequential"))(0.3),
                           rtol=1e-4)
print("OK")
"""


@pytest.mark.slow
def test_auto_splits_the_cohort_over_several_cpu_devices():
    """With two CPU devices, ``auto`` runs the cohort on both (a 2-partition program)
    and equals the one-device ``sequential`` round, also under vmap and grad."""
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                          + " --xla_force_host_platform_device_count=2").strip(),
               PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _AUTO_MESH_CHECK], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-4000:]


def test_compile_options_by_program_and_backend(monkeypatch):
    monkeypatch.delenv(execution.COMPILE_OPTIONS_ENV, raising=False)
    once = execution.compiler_options("once", backend="cpu")
    assert once["xla_backend_optimization_level"] == 0
    assert execution.compiler_options("rounds", backend="cpu") is None
    assert execution.compiler_options("once", backend="gpu") is None
    monkeypatch.setenv(execution.COMPILE_OPTIONS_ENV, "default")
    assert execution.compiler_options("once", backend="cpu") is None
    monkeypatch.setenv(execution.COMPILE_OPTIONS_ENV, '{"rounds": {"xla_cpu_use_fusion_emitters": false}}')
    assert execution.compiler_options("rounds", backend="cpu") == {
        "xla_cpu_use_fusion_emitters": False}
    assert execution.compiler_options("once", backend="cpu") == once


@pytest.mark.parametrize("value", ["{bad", "[1]", '{"rounds": 3}', '{"nope": null}'])
def test_bad_compile_options_are_refused_naming_the_variable(monkeypatch, value):
    """A malformed $FEDJAX_FAIR_XLA_OPTIONS is a FieldError naming it, and the command
    line refuses it as a configuration error before any work."""
    from fedjax_fair import cli
    monkeypatch.setenv(execution.COMPILE_OPTIONS_ENV, value)
    with pytest.raises(H.FieldError) as info:
        execution.compiler_options("rounds", backend="cpu")
    assert info.value.field == execution.COMPILE_OPTIONS_ENV
    assert cli.main(["list"]) == cli.EXIT_CONFIG


def test_initial_params_are_the_models_init_within_an_ulp():
    model = helpers.logreg()
    key = jax.random.key(7)
    fast, reference = execution.initial_params(model, key), jax.jit(model.init)(key)
    chex.assert_trees_all_close(fast, reference, rtol=1e-6, atol=0)
    chex.assert_trees_all_equal(fast, execution.initial_params(model, key))  # one program
