"""Issue 32's GPU benchmark: fedjax_fair ``auto`` against a PyTorch per-client loop and
the roofline floor, one FedAvg round each, in one process on whatever device JAX has.

Run on a GPU session, inside its device time (one command; every row is printed and
written to the JSON as it completes, and rows that would pass the budget print
"skipped: budget", so a timeout still leaves what was done):

    timeout 580 python benchmarks/gpu_targets.py --zoo --budget-s 540 --json $OUT/gpu.json

    python benchmarks/gpu_targets.py --quick [--zoo]   (tiny shapes: a CPU smoke test)
    python benchmarks/gpu_targets.py --jobs resnet18_gn --strategies vmap,sequential

1. Targets. Random data of the papers' shapes; every client holds S x B rows and takes
   S local SGD steps of batch B (lr 0.05, one epoch), the server takes FedAvg's
   n_k-weighted mean:

   * ``mlp``: 784-200-200-62 (28x28x1 inputs), S = 10, B = 20, cohorts 10 / 100 /
     1,000 (round_throughput.py's MLP job);
   * ``cnn``: the LEAF FEMNIST CNN (``models.cnn``, 28x28x1, 62 classes), S = 1,
     B = 20, cohorts 10 / 100 / 1,000;
   * ``resnet18_gn``: ResNet-18 with GroupNorm (CIFAR stem, 32x32x3, 10 classes), 10
     clients, S = 50, B = 50 (the A-FedPD author's sequential PyTorch simulator took
     15.9 s a round on a V100).

   Contenders of each (model, cohort) cell, in this order:

   * ``floor``: the roofline floor (roofline.py, as in round_throughput.py):
     max(FLOPs / peak matmul rate, bytes / copy bandwidth at the working set), FLOPs
     = 3 x the forward FLOPs of one example (XLA's cost analysis) x K S B, bytes = K S
     (16 d + B (input + label bytes)), working set: one local step's (XLA's memory
     analysis) times the clients ``auto`` runs together; the rates are measured at the
     start of the run (``roofline.measure(quick=True)``).
   * ``torch loop``: references/torch_loop.py in its own process, on ``cuda`` when
     torch sees a GPU (else the CPU): the same network and data shapes, plain SGD,
     clients one after another, as PFLlib, FL-bench and the papers' own code train
     them. Skipped with a note where ``import torch`` fails.
   * ``auto -> S``: the library's round (``compose(local_training(...,
     track_loss=False))``: FedAvg without the loss-before pass, which the loop does
     not compute either) with ``Execution("auto", model=model_profile(...))``; S is
     what ``execution.choose`` picked for this backend, cohort and model.
   * ``--strategies``: explicit strategies (vmap, chunked (8), sequential), each its
     own compiled round unless it resolves to auto's.

   Columns. s/round: the fastest of ``--reps`` rounds after a warm-up one (torch:
   ``--torch-reps`` after its first round). x torch loop: the loop's s/round over this
   row's (above 1: faster than the loop). x floor: this row's s/round over its floor
   (1: at the floor). compile s: XLA's compile of the round (torch: its first round,
   CUDA and cuDNN start-up included). peak GiB, on the largest cohort's rows: JAX:
   the device's ``memory_stats()["peak_bytes_in_use"]`` after the row, the process's
   peak so far (written "<= x" when this row did not raise it), "n/a" where the
   backend reports none (CPU); torch: ``torch.cuda.max_memory_allocated()`` over its
   first round, the data included.

2. ``--zoo``: ``auto`` against vmap, chunked (8) and sequential for every model of
   ``fedjax_fair.models.MODELS`` (the convolutional ones first) at cohorts 1,000 /
   100 / 10 (in that order: where the choice matters most first), with the input
   shapes of tests/test_execution.py's ZOO_CHOICES, 10 classes, clients of 20 rows
   taking one step of batch 20; then a summary: each cell's fastest strategy and
   auto's time over it. Columns: MFLOP/ex (forward FLOPs of one example, XLA's cost
   analysis), x auto (auto's s/round over this row's: above 1, faster than auto's
   choice), the others as above.

3. The targets table (target, measured, met / missed), after part 1 and again at the
   end of the run.

4. ``--large-cohort`` (only this part: no targets, zoo, torch loop or roofline): issue
   50's cohort of 100,000 clients in one round of the MLP (784-200-200-62, S = 10 steps
   of B = 20, every client S x B rows), ``chunked`` execution (``--chunk-sizes``,
   default 8, 100 and 1,000) with the streamed aggregation (``compose``'s round sums the
   clients' terms as they finish, never a [K, d] stack: ``FederatedAlgorithm.streamed``),
   against the 1,000-client round of the same setup times 100 (target: within 1.2x).
   The clients are writers of ``femnist_like(procedural=True)``, whose rows each client
   computes from its id inside the client map (``GeneratedClients.take`` of its own id
   in the client update), so a chunk of c clients holds c clients' rows. The rows of a
   100,000-client cohort at once ([K, 200, 28, 28, 1], what ``simulate.make_cohort``'s
   ``take`` of the whole cohort builds) would be 58 GiB and 15.7e9 elements, past the
   2^31 - 1 elements XLA indexes (``memory.MAX_ARRAY_ELEMENTS``). ``held`` rows: the
   smallest cohort with the same rows computed before the round and held on the device
   (what computing them costs). Rows run by chunk size, then cohort, ascending (the
   process's peak only grows), the held ones last.

       timeout 540 python benchmarks/gpu_targets.py --large-cohort --budget-s 480 \
           --json $OUT/large.json
       python benchmarks/gpu_targets.py --large-cohort --quick   (cohorts 20 / 200, 2 x 4)
       python benchmarks/gpu_targets.py --large-cohort --cohorts 1000,100000 --steps 10 \
           --batch 20 --chunk-sizes 8

   Columns: s/round, the median of ``--reps`` rounds after a warm-up one (``min s``:
   the fastest); us/client: s/round over K; x linear: s/round over (K / K0) x the
   smallest cohort K0's s/round at the same chunk size (1: per-client cost flat); XLA
   GiB: the compiled round's temporaries and outputs; plan GiB: the memory plan
   ``runner.run`` bills for a generated federation (``memory.MemoryPlan``: the program's
   arguments, outputs and temporaries plus the resident test split's sizes and
   templates), the largest cohort's printed in full; peak GiB as in part 1.

Memory: a round is skipped ("skipped: out of memory", with a note) without compiling
when one client's step working set times the clients it runs together exceeds twice
the free device memory, after compiling when XLA's memory analysis of the round
exceeds it, and when running it raises RESOURCE_EXHAUSTED. Any other error of a row
is noted and the run goes on (``--quick`` raises it instead). Off the CPU, a heavy
convolutional model (``execution.HEAVY_CONV_EXAMPLE_FLOPS`` or more an example) is not
run with more than ``execution.CONV_GROUP`` clients at once ("skipped: crashes XLA"):
ResNet-10-GN-SN vmapped over 1,000 clients hit a CUDA illegal address in XLA's
autotuner on an H200 (jax 0.11.2), and every later row of that process failed with it.

Budget (``--budget-s``): before each contender the run estimates its cost (its
compile and rounds as last measured at another cohort, the rounds scaled linearly with
K and the compile with the clients run at once to the power 0.7, as a vmapped VGG-9's
on an H200 grew from 5.4 s at 100 clients to 29 s at 1,000; 30 s before anything like
it ran) and skips it ("skipped: budget") when the run would pass the budget; the budget
counts from the start of the process. Compile times vary more than that between
models, so leave the command's timeout a minute past the budget; every finished row is
in the JSON either way.
"""
from __future__ import annotations

import time

START = time.perf_counter()  # the budget counts from here (the imports included)

import argparse  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from typing import Callable, NamedTuple, Optional  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "references"))
sys.path.insert(1, os.path.dirname(HERE))  # this checkout's fedjax_fair, installed or not

import roofline  # noqa: E402
from protocol import Reference, ReferenceFailed  # noqa: E402
from round_throughput import available_bytes, save_params, sgd_step_fn  # noqa: E402

from fedjax_fair.core.algorithm import compose  # noqa: E402
from fedjax_fair.core import memory as mem  # noqa: E402
from fedjax_fair.core.client import ClientTraining, local_training  # noqa: E402
from fedjax_fair.core.execution import (  # noqa: E402
    CONV_GROUP, HEAVY_CONV_EXAMPLE_FLOPS, Execution, model_profile, resolve)
from fedjax_fair.core.types import ClientData, Cohort  # noqa: E402
from fedjax_fair.data import femnist_like  # noqa: E402
from fedjax_fair.models import MODELS, cnn, get_model, mlp  # noqa: E402
from fedjax_fair.models.base import example_flops  # noqa: E402
from fedjax_fair.models.resnet import resnet18_gn  # noqa: E402

LR = 0.05
AFEDPD_S = 15.9  # the A-FedPD author's ResNet-18-GN round (10 clients x 50 steps, V100)
GiB = 2 ** 30
FIRST_COST_S = 30.0  # budget: the cost of a contender before anything like it ran
# budget: a vmapped round's compile grows about as (clients at once) ** 0.7 (H200, jax
# 0.11.2: VGG-9 5.4 s at 100 clients, 29 s at 1,000; 10 ** 0.7 = 5.0)
COMPILE_GROWTH = 0.7
STRATEGIES = ("vmap", "chunked", "sequential")
# the input shapes of tests/test_execution.py's ZOO_CHOICES (char_lstm: token ids), in
# the zoo's order: the convolutional models first (the part of auto's rule drawn from
# the fewest measurements), the dense ones last (vmap won at every cohort measured)
ZOO_SHAPES = {
    "cnn_ch": (28, 28, 1), "twocnn": (28, 28, 1), "femnist_cnn": (28, 28, 1),
    "lenet_fedpd": (32, 32, 3), "vgg9": (32, 32, 3), "resnet9": (32, 32, 3),
    "mobilenet": (64, 64, 3), "resnet10_gn_sn": (32, 32, 3), "resnet18_gn": (32, 32, 3),
    "cnn": (28, 28, 1), "char_lstm": (80,), "mlp2": (3072,), "twonn": (784,),
    "mlp": (784,), "logreg": (784,),
}
ZOO_CLASSES, ZOO_ROWS = 10, 20
QUICK_ZOO_MODELS = "logreg,cnn"


class OutOfMemory(RuntimeError):
    """A round that XLA's memory analysis says does not fit the free memory."""


# ------------------------------------------------------------------------------ jobs

class Job(NamedTuple):
    name: str
    make: Callable  # () -> Model
    input_shape: tuple
    classes: int
    cohorts: tuple
    steps: int  # S
    batch: int  # B
    torch: dict  # the torch job's model fields (references/torch_loop.py)


def target_jobs(quick: bool, cohorts: Optional[tuple]) -> list:
    image = (28, 28, 1)
    mlp_torch = {"model": "mlp", "hidden": [200, 200]}
    cnn_torch = {"model": "cnn", "channels": [32, 64], "dense": 512}
    if quick:  # every code path once, few compiles
        return [Job("mlp", lambda: mlp(image, 62), image, 62, cohorts or (2, 4), 2, 20,
                    mlp_torch),
                Job("cnn", lambda: cnn(image, 62), image, 62, cohorts or (2,), 1, 20, cnn_torch),
                Job("resnet18_gn", lambda: resnet18_gn((8, 8, 3), 10, width=8),
                    (8, 8, 3), 10, (2,), 1, 4, {"model": "resnet18_gn", "width": 8})]
    cohorts = cohorts or (10, 100, 1000)
    return [Job("mlp", lambda: mlp(image, 62), image, 62, cohorts, 10, 20, mlp_torch),
            Job("cnn", lambda: cnn(image, 62), image, 62, cohorts, 1, 20, cnn_torch),
            Job("resnet18_gn", lambda: resnet18_gn((32, 32, 3), 10), (32, 32, 3), 10,
                (10,), 50, 50, {"model": "resnet18_gn", "width": 64})]


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def make_cohort(k: int, rows: int, shape: tuple, classes: int, dtype=jnp.float32) -> Cohort:
    """K clients of ``rows`` random rows each, all real, made on the device."""
    kx, ky = jax.random.split(jax.random.key(0))
    if jnp.issubdtype(dtype, jnp.integer):  # token ids
        x = jax.random.randint(kx, (k, rows, *shape), 0, classes, dtype)
    else:
        x = jax.random.normal(kx, (k, rows, *shape), dtype)
    y = jax.random.randint(ky, (k, rows), 0, classes, jnp.int32)
    data = ClientData({"x": x, "y": y}, jnp.ones((k, rows), bool),
                      jnp.full((k,), rows, jnp.int32))
    return Cohort(jnp.arange(k, dtype=jnp.int32), data, jnp.ones((k,), bool),
                  jnp.full((k,), 2 ** 30, jnp.int32))


def one_example(shape, dtype=jnp.float32) -> dict:
    return {"x": jax.ShapeDtypeStruct(tuple(shape), dtype),
            "y": jax.ShapeDtypeStruct((), jnp.int32)}


def fedavg_round(model, steps: int, batch: int):
    return compose(local_training(model, ClientTraining(lr=LR, batch_size=batch, num_epochs=1,
                                                        max_steps=steps), track_loss=False))


def describe(concrete) -> str:
    strategy, chunk = concrete
    return strategy + (f" ({chunk})" if chunk else "")


# --------------------------------------------------------------------------- memory

def device_stats() -> Optional[dict]:
    try:
        return jax.devices()[0].memory_stats()
    except Exception:  # a backend without memory statistics
        return None


def peak_bytes() -> Optional[int]:
    stats = device_stats() or {}
    return int(stats["peak_bytes_in_use"]) if "peak_bytes_in_use" in stats else None


def free_bytes() -> float:
    """Memory a new round may take: the device's limit less what is in use, or the
    host's available memory less 2 GiB (CPU)."""
    stats = device_stats()
    if stats and "bytes_limit" in stats:
        return float(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return available_bytes() - 2 * GiB


def is_oom(e: Exception) -> bool:
    text = str(e)
    return (isinstance(e, (MemoryError, OutOfMemory)) or "RESOURCE_EXHAUSTED" in text
            or "out of memory" in text.lower())


# --------------------------------------------------------------------------- timing

def time_round(alg, params, cohort: Cohort, execution: Execution, reps: int) -> dict:
    """Compiles one round, refuses it when XLA's memory analysis exceeds the free
    memory, runs it once, then times ``reps`` rounds: the fastest (``s_per_round``),
    the median (``s_median``) and each (``s_all``)."""
    k = cohort.client_ids.shape[0]
    state = alg.init(params, k)
    fn = jax.jit(functools.partial(alg.apply, execution=execution))
    t = time.perf_counter()
    compiled = fn.lower(state, cohort, jax.random.key(0)).compile()
    compile_s = time.perf_counter() - t
    ma = compiled.memory_analysis()
    need = (ma.temp_size_in_bytes + ma.output_size_in_bytes) if ma is not None else 0
    free = free_bytes()
    if need > free:
        raise OutOfMemory(f"XLA memory analysis: {need / GiB:.1f} GiB of temporaries and "
                          f"outputs, {free / GiB:.1f} GiB free")
    before = peak_bytes()
    jax.block_until_ready(compiled(state, cohort, jax.random.key(0)))
    times = []
    for rep in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(compiled(state, cohort, jax.random.key(rep + 1)))
        times.append(time.perf_counter() - t)
    after = peak_bytes()
    return {"s_per_round": min(times), "s_median": statistics.median(times), "s_all": times,
            "compile_s": compile_s, "xla_bytes": int(need),
            "program_bytes": mem.program_bytes(compiled),
            "peak_bytes": after, "peak_rose": after is not None and after != before}


# ------------------------------------------------------------------------------ run

class Run:
    """The run's state: arguments, budget, rates, the torch child, rows, notes."""

    def __init__(self, args):
        self.args = args
        self.budget = args.budget_s
        # (model, contender) -> (K, clients at once, setup s, s/round) last measured
        self.history = {}
        self.rows, self.zoo, self.targets, self.notes = [], [], [], []
        self.large = []  # part 4, --large-cohort
        self.rates = None
        self.torch = None
        self.described = set()  # what the notes have described once
        self.tmp = tempfile.mkdtemp(prefix="gpu_targets_")

    def elapsed(self) -> float:
        return time.perf_counter() - START

    def estimate(self, model: str, contender: str, k: int, reps: int,
                 group: int = 1) -> float:
        """Seconds of a contender at cohort ``k`` running ``group`` clients at once:
        its rounds scale with ``k``; its compile with ``group`` to the power
        ``COMPILE_GROWTH`` (a vmapped round compiles longer the more clients it holds)."""
        if (model, contender) not in self.history:
            return FIRST_COST_S
        k0, group0, setup_s, round_s = self.history[(model, contender)]
        grown = max(1.0, group / group0) ** COMPILE_GROWTH
        return setup_s * grown + (reps + 1) * round_s * k / k0

    def fits(self, seconds: float) -> bool:
        return self.budget is None or self.elapsed() + seconds <= self.budget

    def note(self, text: str) -> None:
        self.notes.append(text)
        print("# " + text, flush=True)

    def attempt(self, what: str, fn):
        """fn() or, when it runs out of memory (or fails, outside --quick), a note
        and the reason as a string."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - one failed row must not end the run
            first = (str(e).splitlines() or [""])[0][:160]
            if is_oom(e):
                self.note(f"{what}: skipped: out of memory ({first})")
                gc.collect()
                return "skipped: out of memory"
            if self.args.quick:
                raise
            self.note(f"{what}: failed ({type(e).__name__}: {first})")
            return f"failed: {type(e).__name__}"

    def save(self) -> None:
        if not self.args.json:
            return
        dev = jax.devices()[0]
        out = {"device": f"{dev.device_kind} ({dev.platform})", "jax": jax.__version__,
               "rates": self.rates.to_json() if self.rates else None, "rows": self.rows,
               "zoo": self.zoo, "large": self.large, "targets": self.targets,
               "notes": self.notes,
               "args": {k: v for k, v in vars(self.args).items() if k != "target_jobs"},
               "wall_s": self.elapsed()}
        tmp = self.args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, self.args.json)

    # -- the torch child

    def start_torch(self) -> None:
        if self.args.no_torch:
            self.note("torch loop: --no-torch; skipped")
        elif importlib.util.find_spec("torch") is None:
            self.note("torch loop: torch not installed; skipped")
        else:
            try:  # imports torch in the background while JAX builds its data
                self.torch = Reference([sys.executable, os.path.join(HERE, "references",
                                                                     "torch_loop.py")],
                                       timeout=900, wait=False)
            except OSError as e:
                self.note(f"torch loop: failed to start ({e}); skipped")

    def torch_ready(self) -> bool:
        if self.torch is None:
            return False
        try:
            self.torch.wait_ready()
            return True
        except ReferenceFailed as e:
            self.note(f"torch loop: failed to start ({str(e).splitlines()[0]}); skipped")
            self.torch = None
            return False

    def close(self) -> None:
        if self.torch is not None:
            self.torch.close()


# ---------------------------------------------------------------------- 1. targets

HEADER = ("model", "K", "S x B", "contender", "s/round", "x torch loop", "x floor",
          "compile s", "peak GiB")


def print_header(header) -> None:
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header), flush=True)


def fmt_s(v) -> str:
    if v is None:
        return ""
    return f"{v:.4f}" if v < 1 else (f"{v:.3f}" if v < 10 else f"{v:.1f}")


def fmt_x(v) -> str:
    return "" if v is None else (f"{v:.2f}" if v < 10 else f"{v:.1f}")


def fmt_peak(row) -> str:
    if not row.get("show_peak") or not isinstance(row.get("s_per_round"), float):
        return ""
    if row.get("peak_bytes") is None:
        return "n/a"
    return ("" if row.get("peak_rose", True) else "<= ") + f"{row['peak_bytes'] / GiB:.2f}"


def print_row(row) -> None:
    s = row["s_per_round"]
    cells = [row["model"], f"{row['cohort']:,}", f"{row['steps']} x {row['batch']}",
             row["contender"], s if isinstance(s, str) else fmt_s(s),
             fmt_x(row.get("x_torch")), fmt_x(row.get("x_floor")),
             "" if row.get("compile_s") is None else f"{row['compile_s']:.1f}", fmt_peak(row)]
    print("| " + " | ".join(cells) + " |", flush=True)


class Prepared(NamedTuple):
    """What the cells of one model share."""
    name: str
    params: object
    d: int  # parameters
    fwd: float  # forward FLOPs of one example (XLA's cost analysis)
    step_ws: int  # bytes one client's local step touches (XLA's memory analysis)
    profile: object  # execution.ModelProfile, what auto chooses by
    alg: object  # the FedAvg round


def prepare(name: str, model, shape, steps: int, batch: int, dtype=jnp.float32) -> Prepared:
    params = jax.jit(model.init)(jax.random.key(0))  # one compile, not one an op
    example = one_example(shape, dtype)
    xy = (jax.ShapeDtypeStruct((batch, *shape), dtype),
          jax.ShapeDtypeStruct((batch,), jnp.int32))
    return Prepared(name, params, sum(int(p.size) for p in jax.tree.leaves(params)),
                    example_flops(model, example),
                    roofline.step_working_set(sgd_step_fn(model, LR), params, *xy),
                    model_profile(model, example), fedavg_round(model, steps, batch))


def group_of(concrete, k: int) -> int:
    """Clients run together (vmapped) by a concrete (strategy, chunk)."""
    strategy, chunk = concrete
    return k if strategy == "vmap" else (chunk or 1)


def contenders(k: int, prep: Prepared, strategies) -> list:
    """(name, label, Execution, concrete) of auto and of each explicit strategy that
    compiles to another program than the ones before it."""
    auto = resolve("auto", k, model=prep.profile)
    out = [("auto", f"auto -> {describe(auto)}", Execution("auto", model=prep.profile), auto)]
    for s in strategies:
        concrete = resolve(s, k)
        if all(c[3] != concrete for c in out):
            out.append((s, describe(concrete), Execution(s), concrete))
    return out


def time_contender(run: Run, prep: Prepared, name: str, label: str, k: int, reps: int,
                   fn, group: int = 1):
    """``fn()`` (a result dict) unless the budget or the memory rules it out, or it
    runs out of memory; then the reason, a string. Records its cost for the budget."""
    if not run.fits(run.estimate(prep.name, name, k, reps, group)):
        return "skipped: budget"
    if (jax.default_backend() != "cpu" and prep.fwd >= HEAVY_CONV_EXAMPLE_FLOPS
            and group > CONV_GROUP):
        # ResNet-10-GN-SN vmapped over 1,000 clients hit a CUDA illegal address in XLA's
        # autotuner on an H200 (jax 0.11.2), which broke every later row of the process
        run.note(f"{prep.name} K={k} {label}: skipped: {group} clients of a heavy "
                 f"convolutional model at once crashed XLA's GPU autotuner")
        return "skipped: crashes XLA"
    need = prep.step_ws * group
    if need > 2 * free_bytes():  # clearly too large: no compile spent on it
        run.note(f"{prep.name} K={k} {label}: skipped: out of memory (about "
                 f"{need / GiB:.0f} GiB: {group} clients of {prep.step_ws / GiB:.2f} GiB)")
        return "skipped: out of memory"
    res = run.attempt(f"{prep.name} K={k} {label}", fn)
    if isinstance(res, dict):
        run.history[(prep.name, name)] = (k, group, res.pop("setup_s", res.get(
            "compile_s", 0.0)), res["s_per_round"])
    return res


def floor_s(job: Job, prep: Prepared, k: int, group: int, rates) -> float:
    """The roofline floor of a round whose clients run ``group`` at a time."""
    examples = k * job.steps * job.batch
    flops = 3 * prep.fwd * examples
    moved = k * job.steps * 16 * prep.d + examples * (4 * math.prod(job.input_shape) + 4)
    return roofline.floor(flops, moved, prep.step_ws * group, rates)["floor_s"]


def time_torch_loop(job: Job, prep: Prepared, k: int, params_file: str, run: Run) -> dict:
    rows = job.steps * job.batch
    spec = {**job.torch, "input_shape": list(job.input_shape), "num_classes": job.classes,
            "cohort": k, "sizes": [rows] * k, "batch": job.batch, "steps": job.steps,
            "lr": LR, "base_clients": k, "padded": rows,
            "torch_threads": run.args.torch_threads}
    if job.torch["model"] != "resnet18_gn":  # torch_round.py copies these parameters
        spec["params_file"] = params_file
    t = time.perf_counter()
    try:
        info = run.torch.load(spec)
        best = min(run.torch.round() for _ in range(run.args.torch_reps))
    finally:
        run.torch.drop()
    if info.get("params") != prep.d:
        run.note(f"torch loop {job.name}: {info.get('params')} parameters, fedjax_fair {prep.d}")
    if "torch" not in run.described:
        run.described.add("torch")
        run.note(f"torch loop: torch {info.get('torch')} on {info.get('device')}, "
                 f"{info.get('threads')} threads")
    return {"s_per_round": float(best), "compile_s": info.get("first_round_s"),
            "peak_bytes": info.get("peak_bytes"), "peak_rose": True,
            "setup_s": time.perf_counter() - t - best * run.args.torch_reps}


def run_target_cell(job: Job, prep: Prepared, k: int, params_file: str, run: Run) -> None:
    """The floor, the torch loop, auto and the explicit strategies of one cohort."""
    args = run.args
    cells = contenders(k, prep, args.strategies)
    base = {"part": "targets", "model": job.name, "cohort": k, "steps": job.steps,
            "batch": job.batch, "show_peak": k == max(job.cohorts)}

    def add(contender, result, floor=None, torch_s=None):
        row = {**base, "contender": contender, "floor_s": floor}
        if isinstance(result, dict):
            row.update(result)
            row["x_floor"] = row["s_per_round"] / floor if floor else None
            row["x_torch"] = torch_s / row["s_per_round"] if torch_s else None
        else:  # the reason it was skipped
            row["s_per_round"] = result
        run.rows.append(row)
        print_row(row)
        run.save()

    add("floor", {"s_per_round": floor_s(job, prep, k, group_of(cells[0][3], k), run.rates),
                  "show_peak": False})
    torch_s = None
    if run.torch_ready():
        res = time_contender(run, prep, "torch", "torch loop", k, args.torch_reps,
                             lambda: time_torch_loop(job, prep, k, params_file, run))
        torch_s = res["s_per_round"] if isinstance(res, dict) else None
        add("torch loop", res, floor_s(job, prep, k, 1, run.rates))
    cohort = make_cohort(k, job.steps * job.batch, tuple(job.input_shape), job.classes)
    for name, label, execution, concrete in cells:
        group = group_of(concrete, k)
        res = time_contender(run, prep, name, label, k, args.reps, lambda: time_round(
            prep.alg, prep.params, cohort, execution, args.reps), group)
        add(label, res, floor_s(job, prep, k, group, run.rates), torch_s)
        gc.collect()


def run_targets(run: Run) -> None:
    backend = jax.default_backend()
    for job in run.args.target_jobs:
        if not run.fits(run.estimate(job.name, "auto", job.cohorts[0], run.args.reps)):
            print(f"\n# {job.name}: skipped: budget", flush=True)
            continue
        prep = prepare(job.name, job.make(), job.input_shape, job.steps, job.batch)
        params_file = os.path.join(run.tmp, f"{job.name}.npz")  # the torch loop's start
        save_params(prep.params, params_file)
        print(f"\n# [{run.elapsed():.0f} s] {job.name}: {prep.d:,} parameters, "
              f"{prep.fwd / 1e6:.3g} MFLOP forward an example; auto on {backend} "
              f"(execution.choose, convolutional={prep.profile.convolutional}): " + ", ".join(
                  f"K={k}: {describe(resolve('auto', k, model=prep.profile))}"
                  for k in job.cohorts), flush=True)
        print_header(HEADER)
        for k in job.cohorts:
            run_target_cell(job, prep, k, params_file, run)
        del prep
        gc.collect()


# ----------------------------------------------------------------------- 3. targets

def closest(cohorts, wanted: int) -> int:
    return min(cohorts, key=lambda c: abs(math.log(c / wanted)))


def find(run: Run, model: str, k: int, contender: str) -> Optional[dict]:
    for r in run.rows:
        if (r["model"] == model and r["cohort"] == k and r["contender"].startswith(contender)
                and isinstance(r["s_per_round"], float)):
            return r
    return None


def evaluate_targets(run: Run) -> list:
    """Issue 32's targets (and issue 14's CNN one) from the rows of part 1, each at
    the cohort of its job nearest the one the issue names."""
    jobs = {j.name: j for j in run.args.target_jobs}

    def cell(model, wanted):  # (K, auto's row, the torch loop's row)
        if model not in jobs:
            return wanted, None, None
        k = closest(jobs[model].cohorts, wanted)
        return k, find(run, model, k, "auto"), find(run, model, k, "torch loop")

    def result(target, measured=None, met=None, value=None):
        if measured is None:
            return {"target": target, "measured": "not measured", "status": "not measured"}
        return {"target": target, "measured": measured, "status": "met" if met else "missed",
                "value": value}

    out = []
    for model, wanted, times, name in (("mlp", 1000, 10, "MLP"), ("cnn", 100, 3, "LEAF CNN")):
        k, auto, loop = cell(model, wanted)
        target = f"{name}, K = {k:,}: at least {times}x the torch loop"
        if auto is None or loop is None:
            out.append({"target": target, "status": "not measured", "measured": (
                "torch loop not measured (see the notes)" if auto else "auto not measured")})
            continue
        x = loop["s_per_round"] / auto["s_per_round"]
        out.append(result(target, f"{fmt_x(x)}x ({auto['contender']} {fmt_s(auto['s_per_round'])}"
                                  f" s, torch loop {fmt_s(loop['s_per_round'])} s)", x >= times, x))
    k, auto, loop = cell("resnet18_gn", 10)
    job = jobs.get("resnet18_gn")
    shape = f"{k} clients x {job.steps} steps x {job.batch}" if job else "10 x 50 x 50"
    target = (f"ResNet-18-GN, {shape}: under {AFEDPD_S / 10:.2f} s (10x the A-FedPD "
              f"author's {AFEDPD_S} s)")
    if auto is None:
        out.append(result(target))
    else:
        s = auto["s_per_round"]
        here = (f"; the torch loop here: {fmt_s(loop['s_per_round'])} s, "
                f"{fmt_x(loop['s_per_round'] / s)}x" if loop else "")
        out.append(result(target, f"{fmt_s(s)} s, {auto['contender']}: {fmt_x(AFEDPD_S / s)}x "
                                  f"the {AFEDPD_S} s{here}", s < AFEDPD_S / 10, s))
    k, auto, _ = cell("cnn", 1000)
    target = f"(issue 14) LEAF CNN, K = {k:,}: under 1 s"
    out.append(result(target) if auto is None else result(
        target, f"{fmt_s(auto['s_per_round'])} s, {auto['contender']}",
        auto["s_per_round"] < 1, auto["s_per_round"]))
    big = [r for r in run.rows if r.get("show_peak") and isinstance(r["s_per_round"], float)
           and r["contender"] != "floor" and r["model"] != "resnet18_gn"]
    peaks = [memory_text(r) for r in big]
    reported = any(r.get("peak_bytes") is not None for r in big)
    out.append({"target": "GPU memory of a 1,000-client round reported",
                "measured": "; ".join(peaks) or "no row",
                "status": "reported" if reported else "not measured" if not big
                else "n/a (no memory statistics here)"})
    return out


def memory_text(row) -> str:
    """A largest-cohort row's device memory: the process's peak after it, and XLA's
    memory analysis of the compiled round (arguments, outputs and temporaries)."""
    text = f"{row['model']} {row['contender']}: {fmt_peak(row)}"
    text += "" if row.get("peak_bytes") is None else " GiB"
    if row.get("xla_bytes"):
        text += f" (XLA's memory analysis of the round: {row['xla_bytes'] / GiB:.2f} GiB)"
    return text


def print_targets(run: Run) -> None:
    run.targets = evaluate_targets(run)
    print_header(("target", "measured", "status"))
    for t in run.targets:
        print(f"| {t['target']} | {t['measured']} | **{t['status']}** |", flush=True)
    run.save()


# --------------------------------------------------------------------------- 2. zoo

ZOO_HEADER = ("model", "MFLOP/ex", "K", "contender", "s/round", "x auto", "compile s")


def zoo_cell(prep: Prepared, shape, dtype, k: int, run: Run) -> None:
    cohort = make_cohort(k, ZOO_ROWS, tuple(shape), ZOO_CLASSES, dtype)
    auto_s = None
    for name, label, execution, concrete in contenders(k, prep, STRATEGIES):
        res = time_contender(run, prep, name, label, k, run.args.zoo_reps, lambda: time_round(
            prep.alg, prep.params, cohort, execution, run.args.zoo_reps), group_of(concrete, k))
        row = {"part": "zoo", "model": prep.name, "mflop": prep.fwd / 1e6, "cohort": k,
               "contender": label, "strategy": describe(concrete), "auto": name == "auto"}
        row.update(res if isinstance(res, dict) else {"s_per_round": res})
        s = row["s_per_round"]
        timed = isinstance(s, float)
        if name == "auto" and timed:
            auto_s = s
        x = fmt_x(auto_s / s) if timed and auto_s and name != "auto" else ""
        compile_s = "" if row.get("compile_s") is None else f"{row['compile_s']:.1f}"
        print(f"| {prep.name} | {prep.fwd / 1e6:.3g} | {k:,} | {label} | "
              f"{fmt_s(s) if timed else s} | {x} | {compile_s} |", flush=True)
        run.zoo.append(row)
        run.save()
        gc.collect()


def run_zoo(run: Run) -> None:
    print(f"\n# [{run.elapsed():.0f} s] zoo: auto against {', '.join(STRATEGIES)}; every "
          f"client {ZOO_ROWS} rows, one step of batch {ZOO_ROWS}; {ZOO_CLASSES} classes",
          flush=True)
    missing = sorted(set(MODELS) - set(ZOO_SHAPES))
    if missing:
        run.note(f"zoo: no input shape for {missing} (add them to ZOO_SHAPES)")
    print_header(ZOO_HEADER)
    for name in run.args.zoo_models:
        if not run.fits(FIRST_COST_S):
            print(f"| {name} | | | | skipped: budget | | |", flush=True)
            continue
        shape = ZOO_SHAPES[name]
        dtype = jnp.int32 if name == "char_lstm" else jnp.float32
        prep = run.attempt(f"zoo {name}", lambda: prepare(
            name, get_model(name, shape, ZOO_CLASSES), shape, 1, ZOO_ROWS, dtype))
        if isinstance(prep, str):
            continue
        for k in run.args.zoo_cohorts:
            run.attempt(f"zoo {name} K={k}", lambda: zoo_cell(prep, shape, dtype, k, run))
        gc.collect()
    print_zoo_summary(run)


def print_zoo_summary(run: Run) -> None:
    """Each cell's fastest strategy and auto's time over it."""
    print_header(("model", "K", "auto's choice", "fastest", "auto / fastest"))
    cells = {}
    for r in run.zoo:
        if isinstance(r["s_per_round"], float):
            cells.setdefault((r["model"], r["cohort"]), []).append(r)
    agree = 0
    for (name, k), rows in cells.items():
        auto = next((r for r in rows if r["auto"]), None)
        fastest = min(rows, key=lambda r: r["s_per_round"])
        if auto is None:
            continue
        ratio = auto["s_per_round"] / fastest["s_per_round"]
        agree += ratio <= 1.1
        print(f"| {name} | {k:,} | {auto['strategy']} | {fastest['strategy']} "
              f"({fmt_s(fastest['s_per_round'])} s) | {ratio:.2f} |")
    print(f"# auto within 10% of the fastest in {agree} of {len(cells)} cells", flush=True)


# ------------------------------------------------------------------ 4. large cohort

LARGE_COHORTS, QUICK_LARGE_COHORTS = (1000, 100_000), (20, 200)
LARGE_CHUNKS, QUICK_LARGE_CHUNKS = (8, 100, 1000), (4,)
LARGE_STEPS, LARGE_BATCH, QUICK_LARGE_STEPS, QUICK_LARGE_BATCH = 10, 20, 2, 4
LARGE_RATIO = 1.2  # issue 50: the 100,000-client round within 1.2x of 100 x the 1,000
LARGE_HEADER = ("K", "execution", "rows", "s/round", "min s", "us/client", "x linear",
                "compile s", "XLA GiB", "plan GiB", "peak GiB")


def generated_round(model, split, steps: int, batch: int):
    """FedAvg (``fedavg_round``'s pieces) whose client update computes its own rows
    from its id (``data.examples["id"]``) with the generated ``split``: inside the
    client map, so a chunk of c clients holds c clients' rows, never the cohort's."""
    inner = local_training(model, ClientTraining(lr=LR, batch_size=batch, num_epochs=1,
                                                 max_steps=steps), track_loss=False)

    def update(broadcast, client_state, data, local_steps, key):
        rows = jax.tree.map(lambda v: v[0], split.take(data.examples["id"][None]))
        return inner(broadcast, client_state, rows, local_steps, key)

    return compose(update)


def id_cohort(k: int, rows: int) -> Cohort:
    """Clients 0 .. K-1, each carrying only its id (its rows are computed in the round)."""
    ids = jnp.arange(k, dtype=jnp.int32)
    data = ClientData({"id": ids}, jnp.ones((k, rows), bool), jnp.full((k,), rows, jnp.int32))
    return Cohort(ids, data, jnp.ones((k,), bool), jnp.full((k,), 2 ** 30, jnp.int32))


def held_cohort(split, k: int) -> Cohort:
    """Clients 0 .. K-1 with the same rows computed before the round, on the device."""
    ids = jnp.arange(k, dtype=jnp.int32)
    return Cohort(ids, jax.jit(lambda s, i: s.take(i))(split, ids), jnp.ones((k,), bool),
                  jnp.full((k,), 2 ** 30, jnp.int32))


def fmt_us(v: float) -> str:
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def fmt_gib(v) -> str:
    return "" if v is None else f"{v / GiB:.2f}"


def print_large_row(row) -> None:
    s = row["s_per_round"]
    if not isinstance(s, float):
        cells = [f"{row['cohort']:,}", row["execution"], row["rows"], s] + [""] * 7
    else:
        cells = [f"{row['cohort']:,}", row["execution"], row["rows"], fmt_s(row["s_median"]),
                 fmt_s(s), fmt_us(row["us_per_client"]), fmt_x(row.get("x_linear")),
                 f"{row['compile_s']:.1f}", fmt_gib(row["xla_bytes"]),
                 fmt_gib(row["plan_bytes"]), fmt_peak(row)]
    print("| " + " | ".join(cells) + " |", flush=True)


def large_cell(run: Run, prep: Prepared, resident: int, k: int, chunk: int, rows: str,
               alg, make) -> dict:
    """One row: the round of ``alg`` on ``make()`` (a cohort of K) with ``chunked``
    (``chunk``) execution, timed by ``time_round`` unless the budget or the memory
    rule it out; its memory plan as ``runner.run`` bills a generated federation."""
    args = run.args
    execution = Execution("chunked", chunk_size=chunk)
    concrete = resolve("chunked", k, chunk_size=chunk)
    label = describe(concrete)
    row = {"part": "large", "model": prep.name, "cohort": k, "chunk": chunk,
           "execution": label, "rows": rows, "steps": args.steps, "batch": args.batch,
           "show_peak": True}

    res = time_contender(run, prep, f"chunked {chunk} {rows}", label, k, args.reps,
                         lambda: time_round(alg, prep.params, make(), execution, args.reps),
                         group_of(concrete, k))
    if isinstance(res, dict):
        row.update(res)
        plan = mem.MemoryPlan("device", resident, res["program_bytes"], mem.device_capacity(),
                              1, rows == "generated")
        row.update(us_per_client=res["s_median"] / k * 1e6, plan_bytes=plan.total,
                   plan=plan.describe())
        base = next((r for r in run.large if r["chunk"] == chunk and r["rows"] == rows
                     and r["cohort"] == min(args.large_cohorts)
                     and isinstance(r["s_per_round"], float)), None)
        if rows == "generated" and k == min(args.large_cohorts):
            row["x_linear"] = 1.0
        elif base is not None:
            row["x_linear"] = res["s_median"] / (k / base["cohort"] * base["s_median"])
    else:
        row["s_per_round"] = res
    run.large.append(row)
    print_large_row(row)
    run.save()
    gc.collect()
    return row


def run_large_cohort(run: Run) -> None:
    args = run.args
    cohorts, chunks = sorted(args.large_cohorts), sorted(args.chunk_sizes)
    k0, top, rows = cohorts[0], cohorts[-1], args.steps * args.batch
    image = (28, 28, 1)
    ds = femnist_like(num_clients=top, min_examples=rows, max_examples=rows, test_examples=1,
                      procedural=True)
    split = jax.device_put(ds.host_data.train)
    model = mlp(image, ds.num_classes)
    prep = prepare("mlp", model, image, args.steps, args.batch)
    alg = generated_round(model, split, args.steps, args.batch)
    resident = mem.tree_bytes((ds.host_data.test, ds.host_data.validation))
    print(f"\n# [{run.elapsed():.0f} s] large cohort: MLP 784-200-200-62 ({prep.d:,} "
          f"parameters), FedAvg, every client {args.steps} steps of batch {args.batch} on "
          f"its {rows} rows of femnist_like(procedural=True, num_clients={top:,}), computed "
          f"in the client map; chunked execution, streamed aggregation: {alg.streamed}; "
          f"s/round: the median of {args.reps} after a warm-up", flush=True)
    if not alg.streamed:
        run.note("large cohort: the round is not streamed (it stacks the [K, d] updates)")
    print_header(LARGE_HEADER)
    for chunk in chunks:
        for k in cohorts:
            large_cell(run, prep, resident, k, chunk, "generated", alg,
                       lambda k=k: id_cohort(k, rows))
    if not args.no_held:
        held = prep.alg  # fedavg_round: the same pieces on rows held on the device
        for chunk in chunks:
            large_cell(run, prep, resident, k0, chunk, "held", held,
                       lambda: held_cohort(split, k0))
    for r in run.large:
        if r["cohort"] == top and r["rows"] == "generated" and r.get("plan"):
            run.note(f"K={top:,} {r['execution']}: {r['plan']}")
    print_large_targets(run, k0, top, chunks)


def large_targets(run: Run, k0: int, top: int, chunks) -> list:
    """Issue 50's target at each chunk size, and the largest round's memory."""
    out = []
    for chunk in chunks:
        pick = lambda k: next((r for r in run.large if r["chunk"] == chunk and r["cohort"] == k
                               and r["rows"] == "generated"
                               and isinstance(r["s_per_round"], float)), None)
        small, big = pick(k0), pick(top)
        target = (f"K = {top:,}, chunked ({chunk}): within {LARGE_RATIO}x of {top / k0:g} x "
                  f"the K = {k0:,} round")
        if small is None or big is None or top == k0:
            out.append({"target": target, "measured": "not measured", "status": "not measured"})
            continue
        x = big["x_linear"]
        out.append({"target": target, "value": x, "status": "met" if x <= LARGE_RATIO
                    else "missed", "measured": (
                        f"{fmt_x(x)}x ({big['execution']} {fmt_s(big['s_median'])} s, "
                        f"{fmt_us(big['us_per_client'])} us a client; K = {k0:,} "
                        f"{small['execution']} {fmt_s(small['s_median'])} s, "
                        f"{fmt_us(small['us_per_client'])} us)")})
    big = [r for r in run.large if r["cohort"] == top and r["rows"] == "generated"
           and isinstance(r["s_per_round"], float)]
    out.append({"target": f"device memory of the K = {top:,} round reported",
                "measured": "; ".join(f"{r['execution']}: peak {fmt_peak(r)}"
                                      f"{'' if r.get('peak_bytes') is None else ' GiB'}, plan "
                                      f"{fmt_gib(r['plan_bytes'])} GiB" for r in big)
                or "no row",
                "status": ("reported" if any(r.get("peak_bytes") is not None for r in big)
                           else "not measured" if not big
                           else "n/a (no memory statistics here; the plan only)")})
    return out


def print_large_targets(run: Run, k0: int, top: int, chunks) -> None:
    run.targets = large_targets(run, k0, top, chunks)
    print_header(("target", "measured", "status"))
    for t in run.targets:
        print(f"| {t['target']} | {t['measured']} | **{t['status']}** |", flush=True)
    run.save()


# ------------------------------------------------------------------------------ main

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="tiny shapes and cohorts (a CPU smoke test; errors are raised)")
    ap.add_argument("--jobs", default="mlp,cnn,resnet18_gn",
                    help="target jobs, comma list ('' for none)")
    ap.add_argument("--cohorts", default=None, help="MLP / CNN cohorts (default 10,100,1000; "
                                                  "--large-cohort: 1000,100000, quick 20,200)")
    ap.add_argument("--strategies", default="",
                    help="explicit strategies timed beside auto, comma list of "
                         f"{','.join(STRATEGIES)} (default: none)")
    ap.add_argument("--reps", type=int, default=None,
                    help="timed rounds a JAX contender (default 5; quick 2)")
    ap.add_argument("--torch-reps", type=int, default=3, help="timed rounds of the torch loop")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch loop")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch.set_num_threads of the loop (default: torch's own)")
    ap.add_argument("--zoo", action="store_true", help="then auto's choice over the model zoo")
    ap.add_argument("--zoo-models", default=None,
                    help=f"comma list (default: every model of MODELS, the convolutional "
                         f"ones first; quick {QUICK_ZOO_MODELS})")
    ap.add_argument("--zoo-cohorts", default=None,
                    help="comma list, run in this order (default 1000,100,10; quick 4,2)")
    ap.add_argument("--zoo-reps", type=int, default=3)
    ap.add_argument("--large-cohort", action="store_true",
                    help="only part 4: a cohort of 100,000 MLP clients, chunked and streamed, "
                         "against 100 x the 1,000-client round (--cohorts sets the cohorts)")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"--large-cohort: local steps S (default {LARGE_STEPS}; quick "
                         f"{QUICK_LARGE_STEPS})")
    ap.add_argument("--batch", type=int, default=None,
                    help=f"--large-cohort: batch B; each client holds S x B rows (default "
                         f"{LARGE_BATCH}; quick {QUICK_LARGE_BATCH})")
    ap.add_argument("--chunk-sizes", default=None,
                    help="--large-cohort: chunked's clients at once, comma list (default "
                         f"{','.join(map(str, LARGE_CHUNKS))}; quick "
                         f"{','.join(map(str, QUICK_LARGE_CHUNKS))})")
    ap.add_argument("--no-held", action="store_true",
                    help="--large-cohort: no rows-held round at the smallest cohort")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip contenders that would end the run past this many seconds")
    ap.add_argument("--json", default=None, help="write the rows here (after every row)")
    args = ap.parse_args(argv)
    args.reps = args.reps or (2 if args.quick else 5)
    args.strategies = [s for s in args.strategies.split(",") if s]
    for s in args.strategies:
        if s not in STRATEGIES:
            ap.error(f"--strategies: {s!r} is not one of {STRATEGIES}")
    cohorts = tuple(int(c) for c in args.cohorts.split(",")) if args.cohorts else None
    if args.large_cohort:
        if args.zoo:
            ap.error("--large-cohort runs alone: leave out --zoo")
        args.large_cohorts = cohorts or (QUICK_LARGE_COHORTS if args.quick else LARGE_COHORTS)
        args.steps = args.steps or (QUICK_LARGE_STEPS if args.quick else LARGE_STEPS)
        args.batch = args.batch or (QUICK_LARGE_BATCH if args.quick else LARGE_BATCH)
        args.chunk_sizes = (tuple(int(c) for c in args.chunk_sizes.split(",")) if
                            args.chunk_sizes else QUICK_LARGE_CHUNKS if args.quick
                            else LARGE_CHUNKS)
        if min(args.large_cohorts) < 1 or min(args.chunk_sizes) < 1 or min(
                args.steps, args.batch) < 1:
            ap.error("--cohorts, --chunk-sizes, --steps and --batch must be positive")
        cohorts = None  # the targets' jobs are not run
    wanted = [j for j in args.jobs.split(",") if j]
    args.target_jobs = [j for j in target_jobs(args.quick, cohorts) if j.name in wanted]
    models = args.zoo_models or (QUICK_ZOO_MODELS if args.quick else ",".join(ZOO_SHAPES))
    args.zoo_models = [m for m in models.split(",") if m]
    unknown = [m for m in args.zoo_models if m not in ZOO_SHAPES]
    if unknown:
        ap.error(f"--zoo-models: no input shape for {unknown}; known: {sorted(ZOO_SHAPES)}")
    args.zoo_cohorts = [int(c) for c in (args.zoo_cohorts or
                                         ("4,2" if args.quick else "1000,100,10")).split(",")]
    return args


def run_targets_and_zoo(run: Run) -> None:
    args = run.args
    if args.target_jobs:
        run.start_torch()
    quick_cpu = args.quick and jax.default_backend() == "cpu"
    run.rates = roofline.measure(
        quick=True, sweep=(256 * 2 ** 10, 4 * 2 ** 20, 64 * 2 ** 20) if quick_cpu else None,
        matmul_sizes=(512,) if quick_cpu else None)
    print(run.rates.describe(), flush=True)
    if args.target_jobs:
        run_targets(run)
        print_targets(run)
    if args.zoo:
        run_zoo(run)
        if args.target_jobs:
            print("\n# the targets again:")
            print_targets(run)


def main(argv=None) -> Run:
    args = parse_args(argv)
    run = Run(args)
    dev = jax.devices()[0]  # the backend starts here (on a GPU: its memory pool)
    print(f"# device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, "
          f"budget {args.budget_s or 'none'} s", flush=True)
    try:
        if args.large_cohort:  # alone: no torch loop, no roofline rates
            run_large_cohort(run)
        else:
            run_targets_and_zoo(run)
    finally:
        run.close()
    print(f"# wall {run.elapsed():.0f} s", flush=True)
    run.save()
    return run


if __name__ == "__main__":
    main()
