"""Seconds per FedAvg round against cohort size, model size and execution strategy, with
the references side by side in the same run and the roofline floor of every row.

Run:   python benchmarks/round_throughput.py            (full sweep; ~30 min on a loaded 2-core CPU)
       python benchmarks/round_throughput.py --quick    (MLP only, cohorts 10 and 100; ~2 min)
       python benchmarks/round_throughput.py --models mlp --cohorts 1000 --reps 5
       python benchmarks/round_throughput.py --cpu-devices 2 --models mlp --cohorts 100
       python benchmarks/round_throughput.py --models mlp --strategies sequential,chunked:4
              --cpu-devices 2 --mesh-strategies sequential,chunked:4   (issue 50's table)
       python benchmarks/round_throughput.py --report a.json,b.json [--plot DIR]
                                              (the docs' tables and plots from --json files)

The job: FEMNIST-shaped clients (28x28x1 inputs, 62 classes, 200 rows stored per
client, n_k drawn from 60, 80, ..., 200), FedAvg with local SGD: every client takes S
local steps of batch B = 20 (reshuffling its rows each epoch), the server averages
by n_k. S = 10 for logistic regression (784-62) and the MLP (784-200-200-62), 1 for
the LEAF FEMNIST CNN (``--cnn-steps``: ten steps at cohort 1000 would take about five
minutes a contender on two cores). The library's round is
``compose(local_training(model, ClientTraining(lr=0.05, batch_size=20, num_epochs=E,
max_steps=S), track_loss=False))``, i.e. ``fedavg(...)`` without the ``loss_before``
pass (each client's loss at the broadcast model, one forward pass over all its rows,
which FedAvg's weights do not use and no reference computes); ``--track-loss``
keeps it (``fedavg``'s default: +22% FLOPs for the MLP job, +2/3 for the 1-step CNN).

Contenders, each timed on the same cohort in the same run, alternating round by
round (the starting one rotates), the fastest of ``--reps`` trials (one trial for
cohorts above 1000):

* ``vmap`` / ``chunked`` (8; ``chunked:N`` in ``--strategies``: N clients a chunk) /
  ``sequential`` / ``bucketed``: one jitted round (``apply``, the state donated) per
  execution strategy; ``auto`` is marked on the strategy it resolves to on one device
  for the model's ``execution.model_profile`` (the same compiled program). A
  strategy is skipped where
  XLA's memory analysis of the compiled round (temporaries + outputs) exceeds
  ``--max-gib`` or the memory available now less 2 GiB (FedAvg's round stacks the
  K clients' deltas: 8 GiB for the MLP at K = 10,000).
* ``auto (N devices)``: with ``--cpu-devices N`` (N CPU devices made before JAX
  starts), ``execution="auto"`` with the model's profile, which then splits the
  cohort over the devices (one chain of clients per device, on its own thread); the
  other contenders still run on one device, except ``--mesh-strategies``: those
  strategies with the cohort split over the devices, tagged ``(N devices)``.
* ``loop``: a Python loop over clients and local steps calling one jitted SGD step
  (batches cut on the host from the client's shuffled rows, each client's model
  added to a running weighted mean by one jitted call), how fedjax's
  ``for_each_client`` and the PyTorch reference codes run clients.
* ``central``: centralised SGD, ONE shared model, S steps of batch K x B on the same
  rows: the same training FLOPs without per-client weights.
* ``torch``: a PyTorch sequential loop of the same network (references/torch_round.py),
  when torch is installed (``pip install -e .[bench]``).
* ``fedjax``: fedjax 0.0.17's ``fed_avg`` over ``for_each_client``
  (references/fedjax_round.py) in its own environment, from ``FEDJAX_PYTHON`` or
  ``.venv-fedjax/bin/python``; skipped with a note when absent.

The references run in their own processes (the parent waits while they run).

Columns: s/round and client updates/s; x loop, x fedjax, x torch = that reference's
time / this row's; the floor (roofline.py): max(FLOPs / peak matmul rate, bytes /
copy bandwidth at the row's working set), FLOPs counted analytically (3x the forward
FLOPs of the rows trained, + the forward over each client's rows for
``loss_before``), bytes = 16 per parameter per client per local step (parameters
read and written, gradients written and read) + the batches (+ the rows of the loss
pass); the working set is one client's (one jitted step's arguments, outputs and
temporaries, from XLA's memory analysis) when clients run one after another
(sequential, loop, torch, fedjax), c clients' when c are vmapped together (chunked:
8; bucketed: K / 4; vmap: K); GFLOP/s and GB/s achieved (analytic counts / time),
% peak = GFLOP/s / peak matmul rate; cpu s = the fewest CPU seconds (user + system,
all threads of the process that ran it) of a round, less sensitive than wall time to
other jobs on a shared machine; compile s (AOT compile of the round; the loop's first
step call; fedjax's first two-client round; blank for torch).

The machine's rates are measured at the start and at the end of the run and the
larger of each is kept. The load average is printed with every table (the machine
is shared: compare ratios within one run).
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import platform
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from fedjax_fair.core.client import ClientTraining

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "references"))
sys.path.insert(1, os.path.dirname(HERE))  # this checkout's fedjax_fair, installed or not

import roofline  # noqa: E402
from job import epoch_rows  # noqa: E402
from protocol import Reference, ReferenceFailed  # noqa: E402
from timing import alternate, load_average  # noqa: E402

from fedjax_fair.core.algorithm import compose  # noqa: E402
from fedjax_fair.algorithms.fedavg import fedavg  # noqa: E402
from fedjax_fair.core.client import local_training  # noqa: E402
from fedjax_fair.data import get_dataset  # noqa: E402
from fedjax_fair.core import sharding  # noqa: E402
from fedjax_fair.core.execution import Execution, model_profile, resolve  # noqa: E402
from fedjax_fair.models import cnn, logistic_regression, mlp  # noqa: E402
from fedjax_fair.core.types import ClientData, Cohort  # noqa: E402

BATCH = 20
LR = 0.05
BASE_CLIENTS = 1000  # distinct clients with data; client k reads base client k % 1000
PADDED = 200  # rows stored per client
INPUT_SHAPE, NUM_CLASSES = (28, 28, 1), 62
STRATEGIES = ("vmap", "chunked", "sequential", "bucketed")
QUICK_STRATEGIES = "vmap,chunked,sequential"  # bucketed is for skewed sizes
REFERENCES = ("loop", "central", "torch", "fedjax")
UNROLL = None  # the library's policy; --unroll overrides
TRACK_LOSS = False  # --track-loss: fedavg's default loss_before pass
EPOCHS = None  # --epochs E: every client trains E epochs (steps E n_k / B, skewed)


# ----------------------------------------------------------------------------- models

def make_model(name: str, hidden=(200, 200)):
    if name == "logreg":
        return logistic_regression(INPUT_SHAPE, NUM_CLASSES)
    if name == "mlp":
        return mlp(INPUT_SHAPE, NUM_CLASSES, hidden=tuple(hidden))
    if name == "cnn":
        return cnn(INPUT_SHAPE, NUM_CLASSES)
    raise ValueError(f"unknown model {name!r}")


def forward_flops(model, params) -> float:
    """Analytic forward FLOPs of one example: 2 * MACs of every dense/conv layer."""
    total = 0.0
    h, w = model.input_shape[0], model.input_shape[1] if len(model.input_shape) > 1 else 1
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path)
        if not name.endswith("['kernel']"):
            continue
        if leaf.ndim == 2:  # dense
            total += 2 * leaf.shape[0] * leaf.shape[1]
        else:  # 'SAME' conv followed by a 2x2 pool: spatial size halves per conv layer
            kh, kw, cin, cout = leaf.shape
            total += 2 * h * w * kh * kw * cin * cout
            h, w = h // 2, w // 2
    return total


def sgd_step_fn(model, lr):
    def sgd_step(params, x, y):
        g = jax.grad(lambda p: jnp.mean(model.per_example_loss(p, {"x": x, "y": y})))(params)
        return jax.tree.map(lambda p, gi: p - lr * gi, params, g)
    return sgd_step


def save_params(params, path) -> None:
    flat = {jax.tree_util.keystr(k, simple=True, separator="/").replace("params/", ""):
            np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(params)}
    np.savez(path, **flat)


# ------------------------------------------------------------------------------- data

class Federation:
    """The base clients' rows on the host and on the device, and every client's n_k."""

    def __init__(self, num_clients: int = BASE_CLIENTS):
        ds = get_dataset("femnist_like", num_clients=num_clients, min_examples=PADDED,
                         max_examples=PADDED)
        self.x = np.asarray(ds.data.train.examples["x"])
        self.y = np.asarray(ds.data.train.examples["y"])
        self.sizes = BATCH * np.random.default_rng(0).integers(3, PADDED // BATCH + 1,
                                                               BASE_CLIENTS)[:num_clients]
        self.x_dev, self.y_dev = jnp.asarray(self.x), jnp.asarray(self.y)
        self.base = num_clients

    def cohort(self, k: int) -> tuple[Cohort, np.ndarray]:
        """The first k clients (client i reads base client i % base) as a library
        Cohort, and their n_k."""
        sizes = np.tile(self.sizes, math.ceil(k / self.base))[:k]
        rows = jnp.arange(k) % self.base

        def take(a):  # one gather: a tile and a slice would hold two copies at once
            return a[:k] if k <= self.base else jax.jit(lambda a: a[rows])(a)

        n = jnp.asarray(sizes, jnp.int32)
        data = ClientData(examples={"x": take(self.x_dev), "y": take(self.y_dev)},
                          mask=jnp.arange(PADDED)[None, :] < n[:, None], num_examples=n)
        cohort = Cohort(client_ids=jnp.arange(k, dtype=jnp.int32), data=data,
                        client_mask=jnp.ones((k,), bool),
                        local_steps=jnp.full((k,), 2 ** 30, jnp.int32))
        return cohort, sizes


# ------------------------------------------------------------------------- references

def loop_reference(model, fed: Federation, sizes, steps: int):
    """One FedAvg round as a host loop over clients and steps of a jitted SGD step."""
    step = jax.jit(sgd_step_fn(model, LR))
    axpy = jax.jit(lambda acc, p, w: jax.tree.map(lambda a, b: a + w * b, acc, p))
    rng = np.random.default_rng(0)
    total = float(sizes.sum())

    def round_fn(params, clients=None):
        acc = jax.tree.map(jnp.zeros_like, params)
        for k in (range(len(sizes)) if clients is None else clients):
            n = int(sizes[k])
            rows = epoch_rows(rng, n, BATCH, steps)
            xk, yk = fed.x[k % fed.base][rows], fed.y[k % fed.base][rows]
            local = params
            for s in range(steps):
                local = step(local, xk[s * BATCH:(s + 1) * BATCH], yk[s * BATCH:(s + 1) * BATCH])
            acc = axpy(acc, local, n / total)
        return acc

    return round_fn


CENTRAL_ROWS = 4096  # rows per forward/backward pass of the central reference


def central_reference(model, cohort: Cohort, steps: int):
    """``steps`` SGD steps of ONE model on batches of K * B rows: step s reads rows
    [s B, (s + 1) B) of every client (wrapping around the stored rows). A batch
    above ``CENTRAL_ROWS`` rows is processed in equal slices whose gradients are
    summed before the step (the same step, with activations bounded: the CNN's
    20,000-row batch at K = 1000 would need 38 GB at once)."""
    x, y = cohort.data.examples["x"], cohort.data.examples["y"]
    k = x.shape[0]
    rows = k * BATCH
    slices = max(1, math.ceil(rows / CENTRAL_ROWS))
    while rows % slices:
        slices += 1

    def loss_sum(p, xb, yb):
        return jnp.sum(model.per_example_loss(p, {"x": xb, "y": yb}))

    @jax.jit
    def train(params, x, y):
        def body(p, s):
            start = (s * BATCH) % PADDED
            xb = jax.lax.dynamic_slice_in_dim(x, start, BATCH, axis=1).reshape(
                slices, rows // slices, *x.shape[2:])
            yb = jax.lax.dynamic_slice_in_dim(y, start, BATCH, axis=1).reshape(
                slices, rows // slices)
            if slices == 1:
                g = jax.grad(loss_sum)(p, xb[0], yb[0])
            else:
                g = jax.lax.scan(lambda acc, b: (jax.tree.map(
                    jnp.add, acc, jax.grad(loss_sum)(p, *b)), None),
                    jax.tree.map(jnp.zeros_like, p), (xb, yb))[0]
            return jax.tree.map(lambda a, gi: a - LR / rows * gi, p, g), None
        return jax.lax.scan(body, params, jnp.arange(steps))[0]

    return lambda params: train(params, x, y)


def fedjax_python() -> str | None:
    path = os.environ.get("FEDJAX_PYTHON") or os.path.join(os.path.dirname(HERE),
                                                           ".venv-fedjax", "bin", "python")
    return path if os.path.exists(path) else None


class Children:
    """The reference processes of this run (started once, given one job per cell)."""

    def __init__(self, wanted):
        self.procs, self.notes = {}, []
        if "torch" in wanted:
            if importlib.util.find_spec("torch") is None:
                self.notes.append("torch: not installed (pip install -e .[bench]); skipped")
            else:
                self._start("torch", [sys.executable, os.path.join(HERE, "references",
                                                                   "torch_round.py")])
        if "fedjax" in wanted:
            py = fedjax_python()
            if py is None:
                self.notes.append("fedjax: no FEDJAX_PYTHON and no .venv-fedjax (see "
                                  "benchmarks/references/fedjax_round.py); skipped")
            else:
                self._start("fedjax", [py, os.path.join(HERE, "references", "fedjax_round.py")])

    def _start(self, name, argv):
        env = {"JAX_PLATFORMS": "cpu"} if jax.default_backend() == "cpu" else {}
        try:
            self.procs[name] = Reference(argv, env=env, timeout=300, wait=False)
        except OSError as e:
            self.notes.append(f"{name}: failed to start ({e}); skipped")

    def wait(self):
        """Waits until every child has imported its library (they start in the
        background while the parent builds its data)."""
        for name in list(self.procs):
            try:
                self.procs[name].wait_ready()
            except ReferenceFailed as e:
                self.notes.append(f"{name}: failed to start ({str(e).splitlines()[0]}); "
                                  "skipped")
                del self.procs[name]

    def close(self):
        for p in self.procs.values():
            p.close()


# ------------------------------------------------------------------------------ table

HEADER = ("model", "params", "K", "contender", "s/round", "upd/s", "x loop", "x fedjax",
          "x torch", "floor s", "x floor", "GFLOP/s", "% peak", "GB/s", "cpu s", "compile s")


def _fmt_s(v):
    if v is None or not math.isfinite(v):
        return ""
    return f"{v:.4f}" if v < 1 else (f"{v:.3f}" if v < 10 else f"{v:.1f}")


def _fmt_x(v):
    return "" if v is None or not math.isfinite(v) else f"{v:.2f}"


def fmt_row(r: dict) -> str:
    cells = [r["model"], f"{r['params'] / 1e6:.3g}M", str(r["cohort"]), r["contender"],
             _fmt_s(r["s_per_round"]), f"{r['updates_per_s']:.0f}",
             _fmt_x(r.get("x_loop")), _fmt_x(r.get("x_fedjax")), _fmt_x(r.get("x_torch")),
             _fmt_s(r["floor_s"]), _fmt_x(r["x_floor"]), f"{r['gflops']:.0f}",
             f"{r['pct_peak']:.0f}", f"{r['gbps']:.0f}", _fmt_s(r.get("cpu_s")),
             "" if r.get("compile_s") is None else f"{r['compile_s']:.1f}"]
    return "| " + " | ".join(cells) + " |"


def print_header():
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER), flush=True)


# ------------------------------------------------------------------------------- cell

def local_epochs(steps: int) -> int:
    """Epochs that let the smallest client (60 rows) take ``steps`` steps of B."""
    return max(1, math.ceil(steps * BATCH / (3 * BATCH)))


def make_algorithm(model, steps):
    training = ClientTraining(lr=LR, batch_size=BATCH, num_epochs=local_epochs(steps),
                              max_steps=steps)
    if EPOCHS:  # E epochs of each client's own rows: 3 E to 10 E steps, not S each
        training = ClientTraining(lr=LR, batch_size=BATCH, num_epochs=EPOCHS)
    if TRACK_LOSS and UNROLL is None:  # exactly fedavg's defaults
        return fedavg(model, training=training)
    return compose(local_training(model, training=training, unroll=UNROLL,
                                  track_loss=TRACK_LOSS))


def strategy_spec(name: str) -> tuple[str, int | None]:
    """(strategy, chunk_size) of a ``--strategies`` / ``--mesh-strategies`` entry:
    ``chunked:16`` is ``chunked`` with 16 clients a chunk; a bare name keeps the
    strategy's default."""
    strategy, _, chunk = name.partition(":")
    return strategy, (int(chunk) if chunk else None)


def plan_cell(model_label, k, strategies, refs, children, history, args, auto):
    """The contenders of a cell, in priority order, within the cell's time budget.

    Priority: the strategy ``auto`` picks (``auto``: its (strategy, chunk_size) for
    this model and cohort on one device; added when ``strategies`` lacks it), the loop, fedjax, central, torch, the other
    strategies, then the ``--mesh-strategies`` over the CPU devices. A contender's
    round time is estimated from its largest timed
    cohort of this model (linear in K; unknown counts 0). Trials: ``--reps`` (one
    above cohort 1000), fewer if the estimated rounds would exceed ``--cell-budget``
    seconds, more (up to 3 x ``--reps``) while a cell's trials take under 30 s;
    contenders that do not fit the budget, or whose round would exceed
    ``--max-round-s``, are skipped with a note."""
    def is_auto(name):
        strategy, chunk_size = strategy_spec(name)
        return resolve(strategy, k, chunk_size=chunk_size) == auto

    if not multi_cpu() and not any(is_auto(s) for s in strategies):  # time auto's pick
        strategies = [auto[0] + (f":{auto[1]}" if auto[1] else "")] + list(strategies)
    names = ["auto"] if multi_cpu() else []
    names += [s for s in strategies if is_auto(s)] + [r for r in ("loop", "fedjax", "central",
                                                                 "torch") if r in refs]
    names += [s for s in strategies if not is_auto(s)]
    if multi_cpu():
        names += [s + "@mesh" for s in args.mesh_strategies]
    names = [n for n in names if n not in ("torch", "fedjax") or n in children.procs]
    known = {n: _estimate(history, model_label, n, k) for n in names}
    est = {n: v or 0.0 for n, v in known.items()}
    chosen = []
    for n in names:
        if est[n] > args.max_round_s:
            print(f"# {model_label} K={k} {n}: skipped (estimated {est[n]:.0f} s a round "
                  f"> --max-round-s {args.max_round_s:g})", flush=True)
        elif sum(est[c] for c in chosen) + est[n] > args.cell_budget:
            print(f"# {model_label} K={k} {n}: skipped (estimated {est[n]:.0f} s a round; the "
                  f"cell's budget --cell-budget {args.cell_budget:g} s is spent)", flush=True)
        else:
            chosen.append(n)
    total = sum(est[c] for c in chosen)
    trials = args.reps if k <= 1000 else 1
    if total > 0 and all(known[c] is not None for c in chosen):
        if trials * total > args.cell_budget:
            trials = max(1, int(args.cell_budget // total))
        elif k <= 1000:  # cheap cells are the noisiest: more trials while they take < 30 s
            trials = max(trials, min(3 * args.reps, int(30 // total)))
    return chosen, trials


def run_cell(name, model, fed, k, steps, strategies, refs, children, args, rates, rows,
             history, label=None):
    """Times every contender of one (model, cohort) cell; appends rows."""
    model_label = label or name
    profile = model_profile(model, {"x": jax.ShapeDtypeStruct(model.input_shape, jnp.float32),
                                    "y": jax.ShapeDtypeStruct((), jnp.int32)})
    auto = resolve("auto", k, model=profile)  # auto's choice on one device
    chosen, trials = plan_cell(model_label, k, strategies, refs, children, history, args, auto)
    params = model.init(jax.random.key(0))
    d = sum(int(p.size) for p in jax.tree.leaves(params))
    fwd = forward_flops(model, params)
    cohort, sizes = fed.cohort(k)
    in_bytes = 4 * math.prod(model.input_shape)
    sgd = sgd_step_fn(model, LR)
    w1 = roofline.step_working_set(sgd, params, *_batch_shapes(model, BATCH))
    train_rows = k * steps * BATCH
    flops_train = 3 * fwd * train_rows
    bytes_train = k * steps * (16 * d + BATCH * (in_bytes + 4))
    loss_rows = float(sizes.sum()) if TRACK_LOSS else 0.0
    flops_lib = flops_train + fwd * loss_rows
    bytes_lib = bytes_train + loss_rows * in_bytes

    for ref, proc in children.procs.items():
        if ref not in chosen:
            proc.drop()  # a child left out of this cell frees its last job's data
    fns, meta = {}, {}
    alg = make_algorithm(model, steps)
    job = None

    def setup(name_):
        """Compiles / warms one contender and registers it in ``fns`` and ``meta``."""
        nonlocal job
        base = name_.split("@")[0]
        if strategy_spec(base)[0] in STRATEGIES or name_ == "auto":  # one program
            strategy, chunk_size = strategy_spec(base)
            mesh = sharding.make_mesh(jax.local_device_count()) if name_.endswith("@mesh") \
                else None
            conc = resolve(strategy, k if mesh is None else sharding.per_device(k, mesh),
                           chunk_size=chunk_size)
            if conc[0] != strategy and strategy != "auto":
                return  # e.g. chunked with chunk >= K is vmap: nothing new to time
            state = jax.tree.map(jnp.copy, alg.init(params, k))
            ex = Execution(strategy, chunk_size, mesh,
                           profile if strategy == "auto" else None)
            fn = jax.jit(functools.partial(alg.apply, execution=ex), donate_argnums=0)
            t = time.perf_counter()
            try:
                compiled = fn.lower(state, cohort, jax.random.key(0)).compile()
            except Exception as e:  # out of memory at compile time, etc.
                print(f"# {model_label} K={k} {name_}: compile failed "
                      f"({type(e).__name__}); skipped", flush=True)
                return
            compile_s = time.perf_counter() - t
            ma = compiled.memory_analysis()
            temp = ma.temp_size_in_bytes + ma.output_size_in_bytes if ma is not None else 0
            free = available_bytes()
            if temp > min(args.max_gib * 2 ** 30, free - 2 * 2 ** 30):
                print(f"# {model_label} K={k} {name_}: skipped (XLA memory analysis: "
                      f"{temp / 2 ** 30:.1f} GiB of temporaries and outputs; --max-gib "
                      f"{args.max_gib:g}, {free / 2 ** 30:.1f} GiB available now)", flush=True)
                return
            chunk = conc[1] or (k if conc[0] == "vmap" else 1)
            box = {"state": state}

            def call(compiled=compiled, box=box):
                box["state"], _ = compiled(box["state"], cohort, jax.random.key(1))
                return box["state"]

            tag = strategy + (f" ({conc[1]})" if conc[1] else "")
            if strategy == "auto":  # several CPU devices: the cohort split over them
                tag, chunk = f"auto ({jax.local_device_count()} devices)", 1
            elif mesh is not None:
                tag += f" ({mesh.devices.size} devices)"
            elif conc == auto and not multi_cpu():
                tag += " = auto"
            fns[tag] = call
            meta[tag] = {"flops": flops_lib, "bytes": bytes_lib, "ws": w1 * min(chunk, k),
                         "compile_s": compile_s, "kind": "library", "temp": temp,
                         "name": name_}
        elif name_ == "loop":
            loop = loop_reference(model, fed, sizes, steps)
            t = time.perf_counter()
            jax.block_until_ready(loop(params, clients=[0]))  # compiles the step and the axpy
            fns["loop"] = lambda loop=loop: loop(params)
            meta["loop"] = {"flops": flops_train, "bytes": bytes_train, "ws": w1,
                            "compile_s": time.perf_counter() - t, "kind": "reference"}
        elif name_ == "central":
            central = central_reference(model, cohort, steps)
            t = time.perf_counter()
            jax.block_until_ready(central(params))
            fns["central"] = lambda central=central: central(params)
            meta["central"] = {
                "flops": flops_train, "bytes": steps * (16 * d + k * BATCH * in_bytes),
                "ws": roofline.step_working_set(
                    sgd, params, *_batch_shapes(model, min(k * BATCH, CENTRAL_ROWS))),
                "compile_s": time.perf_counter() - t, "kind": "reference"}
        else:  # torch / fedjax, in their own processes
            if job is None:
                job = _job(name, model, params, k, sizes, steps, args)
            try:
                info = children.procs[name_].load(job)
            except ReferenceFailed as e:
                print(f"# {name_}: {str(e).splitlines()[0]}; skipped", flush=True)
                return
            if info.get("params") != d:
                print(f"# {name_}: {info.get('params')} parameters, ours {d}", flush=True)
            tag = name_ + (f" ({info['threads']} thr)" if "threads" in info else "")
            fns[tag] = children.procs[name_].round
            meta[tag] = {"flops": flops_train, "bytes": bytes_train, "ws": w1,
                         "compile_s": info.get("first_round_s"), "kind": "reference",
                         "name": name_}

    for name_ in chosen:
        try:
            setup(name_)
        except Exception as e:  # e.g. RESOURCE_EXHAUSTED: note it, time the others
            if "RESOURCE_EXHAUSTED" not in str(e) and not isinstance(e, MemoryError):
                raise
            print(f"# {model_label} K={k} {name_}: skipped (out of memory: "
                  f"{str(e).splitlines()[0][:100]})", flush=True)
            for tag in [t for t in fns if t.split(" ")[0] == name_]:
                fns.pop(tag)
                meta.pop(tag)

    cpu = {}
    best = alternate(fns, trials, warmup=False, cpu=cpu)
    for tag, sec in best.items():
        history[(model_label, meta[tag].get("name", tag.split(" ")[0]), k)] = sec
    ref_time = {r: next((v for t, v in best.items() if t.split(" ")[0] == r), None)
                for r in ("loop", "torch", "fedjax")}
    for tag, sec in best.items():
        m = meta[tag]
        fl = roofline.floor(m["flops"], m["bytes"], m["ws"], rates)
        rows.append({
            "model": model_label, "params": d, "cohort": k, "contender": tag,
            "kind": m["kind"], "steps": steps, "s_per_round": sec, "updates_per_s": k / sec,
            "x_loop": ref_time["loop"] / sec if ref_time["loop"] else None,
            "x_fedjax": ref_time["fedjax"] / sec if ref_time["fedjax"] else None,
            "x_torch": ref_time["torch"] / sec if ref_time["torch"] else None,
            "floor_s": fl["floor_s"], "x_floor": sec / fl["floor_s"], "bound": fl["bound"],
            "working_set": m["ws"], "bandwidth": fl["bandwidth"],
            "gflops": m["flops"] / sec / 1e9,
            "pct_peak": 100 * m["flops"] / sec / rates.matmul_flops,
            "gbps": m["bytes"] / sec / 1e9, "compile_s": m["compile_s"], "cpu_s": cpu[tag],
            "temp_bytes": m.get("temp"), "flops": m["flops"], "bytes": m["bytes"],
            "trials": trials, "load": load_average()})
        print(fmt_row(rows[-1]), flush=True)
    return rows


def multi_cpu() -> bool:
    """Several CPU devices (``--cpu-devices``): ``auto`` then splits the cohort over
    them and is timed as its own contender."""
    return jax.default_backend() == "cpu" and jax.local_device_count() > 1


def available_bytes() -> float:
    """The host's available memory (``memory.host_available``; inf where unknown):
    other jobs on a shared machine hold memory too, and an out-of-memory kill would
    end the whole run."""
    from fedjax_fair.core.memory import host_available
    free = host_available()
    return float("inf") if free is None else float(free)


def _batch_shapes(model, rows):
    return (jax.ShapeDtypeStruct((rows, *model.input_shape), jnp.float32),
            jax.ShapeDtypeStruct((rows,), jnp.int32))


def _job(name, model, params, k, sizes, steps, args):
    path = os.path.join(args.tmp, f"params_{name}_{sum(int(p.size) for p in jax.tree.leaves(params))}.npz")
    if not os.path.exists(path):
        save_params(params, path)
    job = {"model": name, "input_shape": list(INPUT_SHAPE), "num_classes": NUM_CLASSES,
           "cohort": k, "sizes": [int(s) for s in sizes], "batch": BATCH, "steps": steps,
           "lr": LR, "base_clients": min(k, BASE_CLIENTS), "padded": PADDED,
           "params_file": path}
    if name == "mlp":
        job["hidden"] = [int(leaf.shape[1]) for pth, leaf in
                         jax.tree_util.tree_leaves_with_path(params)
                         if jax.tree_util.keystr(pth).endswith("['kernel']")][:-1]
    if name == "cnn":
        job["channels"], job["dense"] = [32, 64], 512
    if args.torch_threads:
        job["torch_threads"] = args.torch_threads
    return job


def _estimate(history, model_label, contender, k):
    """Seconds a round of ``contender`` should take at cohort k, from its largest
    timed cohort of this model (time grows linearly with K)."""
    known = [(kk, v) for (m, c, kk), v in history.items() if m == model_label and c == contender]
    if not known:
        return None
    kk, v = max(known)
    return v * k / kk


# ------------------------------------------------------------------------------- main

def dense_step_line(name, model, rates) -> float:
    """Measures and prints the rate of the model's first dense layer's SGD-step
    products at batch B (roofline.dense_step_rate): what a local step's matmuls can
    reach, against the peak that the floor uses; and at batches 4 B and 8 B, the
    products of a chunk of 4 or 8 clients vmapped together (``chunked``)."""
    params = model.init(jax.random.key(0))
    d_in, d_out = next(leaf.shape for leaf in jax.tree.leaves(params) if leaf.ndim == 2)
    rate = roofline.dense_step_rate(BATCH, d_in, d_out)
    chunks = {c: roofline.dense_step_rate(c * BATCH, d_in, d_out) for c in (4, 8)}
    print(f"# {name}: first dense layer ({d_in}x{d_out}) products of an SGD step at batch "
          f"{BATCH}: {rate / 1e9:.0f} GFLOP/s ({100 * rate / rates.matmul_flops:.0f}% of the "
          "matmul peak)" + "".join(f"; at batch {c * BATCH}: {r / 1e9:.0f} GFLOP/s "
                                   f"({100 * r / rates.matmul_flops:.0f}%)"
                                   for c, r in chunks.items()), flush=True)
    return rate


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"# {cpu}, {os.cpu_count()} cores | jax {jax.__version__} | backend "
            f"{jax.default_backend()} | devices {jax.devices()} | unroll {UNROLL or 'policy'} "
            f"| track_loss {TRACK_LOSS} | {load_average()}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="MLP only, cohorts 10 and 100, 2 trials (a minute or two)")
    ap.add_argument("--models", default=None, help="comma list of logreg, mlp, cnn")
    ap.add_argument("--cohorts", default=None,
                    help="comma list; default 10,100,1000,10000 (cnn: 10,100,1000)")
    ap.add_argument("--widths", default=None,
                    help="MLP hidden widths of the model-size sweep (two equal layers), "
                         "comma list; default 50,200,500,1000 at cohort --width-cohort "
                         "(200 is the cohort table's MLP); 'none' skips it")
    ap.add_argument("--width-cohort", type=int, default=100)
    ap.add_argument("--strategies", default=None,
                    help=f"comma list (default {','.join(STRATEGIES)}; quick {QUICK_STRATEGIES})")
    ap.add_argument("--refs", default=",".join(REFERENCES),
                    help="comma list of loop, central, torch, fedjax ('' for none)")
    ap.add_argument("--steps", type=int, default=10, help="local steps (logreg, mlp)")
    ap.add_argument("--cnn-steps", type=int, default=1, help="local steps of the CNN")
    ap.add_argument("--reps", type=int, default=None, help="trials per cell (default 3; quick 2)")
    ap.add_argument("--max-round-s", type=float, default=150.0,
                    help="skip a contender whose estimated round exceeds this")
    ap.add_argument("--cell-budget", type=float, default=None,
                    help="seconds of timed rounds per (model, cohort) cell (default 200; "
                         "quick 20)")
    ap.add_argument("--max-gib", type=float, default=10.0,
                    help="skip a strategy whose compiled round needs more temporaries")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="fix PyTorch's threads (default: cores or 1, the faster in warm-up)")
    ap.add_argument("--cpu-devices", type=int, default=None,
                    help="make this many CPU devices (jax_num_cpu_devices) and time "
                         "'auto', which splits the cohort over them; the other "
                         "contenders run on one device as before")
    ap.add_argument("--mesh-strategies", default="",
                    help="with --cpu-devices: also time these strategies (comma list, "
                         "e.g. sequential,chunked:16) with the cohort split over the CPU "
                         "devices, tagged '(N devices)'")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    ap.add_argument("--plot", default=None, help="write PNG plots into this folder")
    ap.add_argument("--report", default=None,
                    help="print the docs' tables from --json files (comma list) and exit (no timing)")
    ap.add_argument("--unroll", default=None, help="override the local-step unroll (int or 'full')")
    ap.add_argument("--epochs", type=int, default=None,
                    help="the library's clients train this many epochs of their own rows "
                         "(n_k / 20 steps an epoch: 3-10, skewed like the command line's "
                         "default job) instead of --steps each; the references and the "
                         "floor still count --steps, so compare the library's rows only")
    ap.add_argument("--track-loss", action="store_true",
                    help="keep fedavg's loss_before pass (the references do not compute it)")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.report:
        report(args.report)
        if args.plot:  # the plots of the rows of every file given
            rows = []
            for path in args.report.split(","):
                with open(path) as f:
                    rows += json.load(f)["rows"]
            plot(rows, args.plot)
        return None
    global UNROLL, TRACK_LOSS, EPOCHS
    if args.cpu_devices:  # before JAX starts its backend
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    TRACK_LOSS = args.track_loss
    EPOCHS = args.epochs
    if args.unroll is not None:
        UNROLL = True if args.unroll == "full" else int(args.unroll)
    models = (args.models or ("mlp" if args.quick else "logreg,mlp,cnn")).split(",")
    args.reps = args.reps or (2 if args.quick else 3)
    args.cell_budget = args.cell_budget or (20.0 if args.quick else 200.0)
    widths = args.widths or ("none" if args.quick else "50,200,500,1000")
    strategies = [s for s in (args.strategies or (QUICK_STRATEGIES if args.quick
                                                  else ",".join(STRATEGIES))).split(",") if s]
    # bucketed (for skewed client sizes) is timed on the logreg / MLP cohorts only,
    # unless --strategies names it: every compile costs ~10 s on a loaded 2-core CPU
    lean = [s for s in strategies if args.strategies or s != "bucketed"]
    refs = [r for r in args.refs.split(",") if r]
    args.mesh_strategies = [s for s in args.mesh_strategies.split(",") if s]
    args.tmp = tempfile.mkdtemp(prefix="round_throughput_")
    start = time.perf_counter()

    def cohorts_of(name):
        if args.cohorts:
            return [int(c) for c in args.cohorts.split(",")]
        if args.quick:
            return [10, 100]
        return [10, 100, 1000] + ([10_000] if name != "cnn" else [])

    print(machine_line())
    children = Children(refs)  # they import in the background
    largest = max(max(cohorts_of(m)) for m in models)
    fed = Federation(min(BASE_CLIENTS, max(largest, args.width_cohort)))
    children.wait()
    for note in children.notes:
        print("# " + note)
    rates = roofline.measure(quick=args.quick)
    print(rates.describe(), flush=True)
    step_rates = {name: dense_step_line(name, make_model(name), rates) for name in models}
    rows, history = [], {}
    try:
        print_header()
        for name in models:
            cohorts = cohorts_of(name)
            steps = args.cnn_steps if name == "cnn" else args.steps
            model = make_model(name)
            for k in cohorts:
                run_cell(name, model, fed, k, steps, lean if name == "cnn" else strategies,
                         refs, children, args, rates, rows, history)
        if widths != "none" and "mlp" in models:
            for w in [int(v) for v in widths.split(",")]:
                label = f"mlp-{w}"
                if w == 200 and any(r["model"] == "mlp" and r["cohort"] == args.width_cohort
                                    for r in rows):
                    continue  # the cohort table has it
                run_cell("mlp", make_model("mlp", (w, w)), fed, args.width_cohort, args.steps,
                         lean, refs, children, args, rates, rows, history, label=label)
    finally:
        children.close()
    end_rates = roofline.measure(quick=True, sweep=tuple(sorted(rates.bandwidth)),
                                 matmul_sizes=(512,) if args.quick else None)
    merged = rates.merge(end_rates)
    changed = False
    for r in rows:  # re-derive the floor with the larger rates of the start and end
        fl = roofline.floor(r["flops"], r["bytes"], r["working_set"], merged)
        changed |= abs(fl["floor_s"] / r["floor_s"] - 1) > 0.01
        r.update(floor_s=fl["floor_s"], x_floor=r["s_per_round"] / fl["floor_s"],
                 bound=fl["bound"], bandwidth=fl["bandwidth"],
                 pct_peak=100 * r["flops"] / r["s_per_round"] / merged.matmul_flops)
    if changed:
        print("\n# floors re-derived with the larger rates of the start and end of the run:")
        print_header()
        for r in rows:
            print(fmt_row(r))
    print(merged.describe())
    below = [r for r in rows if r["x_floor"] < 1]
    if below:
        print(f"# WARNING: {len(below)} rows below their floor (a rate was measured low)")
    print(f"# {load_average()} | wall {time.perf_counter() - start:.0f} s")
    out = {"machine": machine_line(), "rates": merged.to_json(), "rows": rows,
           "dense_step_flops": step_rates,
           "args": {k: v for k, v in vars(args).items() if k != "tmp"},
           "wall_s": time.perf_counter() - start}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return out


DOC_HEADER = ("K", "contender", "s/round", "upd/s", "x loop", "x fedjax", "x torch", "cpu s",
              "cpu x loop", "cpu x fedjax", "cpu x torch", "floor s", "bound", "x floor",
              "GFLOP/s", "% peak", "GB/s", "compile s")


def report(paths: str) -> None:
    """Prints the docs' tables (one per model) from ``--json`` files (comma list): the
    wall-time ratios and, beside them, the same ratios in CPU seconds (the work each
    contender did, which the scheduler of a shared machine does not distort). bound:
    the floor's larger term, "flops" or "bytes @ B" (B: the copy bandwidth in GB/s at
    the row's working set)."""
    for path in paths.split(","):
        with open(path) as f:
            report_one(json.load(f))
        print()


def report_one(out: dict) -> None:
    rows = out["rows"]
    rates = out["rates"]
    print(f"{out['machine']}")
    print(f"# peak matmul {rates['matmul_flops'] / 1e9:.0f} GFLOP/s; copy bandwidth (GB/s) "
          + ", ".join(f"{roofline._size(float(s))}: {float(b) / 1e9:.0f}"
                      for s, b in sorted(rates["bandwidth"].items(), key=lambda t: float(t[0]))))
    for name, rate in out.get("dense_step_flops", {}).items():
        print(f"# {name}: first dense layer's SGD-step products at batch {BATCH}: "
              f"{rate / 1e9:.0f} GFLOP/s")
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        print(f"\n{model}: d = {mine[0]['params']:,}, {mine[0]['steps']} local steps of batch "
              f"{BATCH}")
        print("| " + " | ".join(DOC_HEADER) + " |")
        print("|" + "---|" * len(DOC_HEADER))
        for k in dict.fromkeys(r["cohort"] for r in mine):
            cell = [r for r in mine if r["cohort"] == k]
            cpu_ref = {ref: next((r["cpu_s"] for r in cell
                                  if r["contender"].split(" ")[0] == ref), None)
                       for ref in ("loop", "fedjax", "torch")}
            for r in cell:
                cx = [("" if not cpu_ref[ref] or not r.get("cpu_s") else
                       f"{cpu_ref[ref] / r['cpu_s']:.2f}") for ref in ("loop", "fedjax", "torch")]
                name = r["contender"]
                if name.endswith("= auto"):
                    name = "**" + name + "**"
                print("| " + " | ".join([
                    f"{k:,}", name, _fmt_s(r["s_per_round"]), f"{r['updates_per_s']:.0f}",
                    _fmt_x(r.get("x_loop")), _fmt_x(r.get("x_fedjax")), _fmt_x(r.get("x_torch")),
                    _fmt_s(r.get("cpu_s")), *cx, _fmt_s(r["floor_s"]),
                    "flops" if r["bound"] == "flops" else f"bytes @ {r['bandwidth'] / 1e9:.0f}",
                    _fmt_x(r["x_floor"]), f"{r['gflops']:.0f}", f"{r['pct_peak']:.0f}",
                    f"{r['gbps']:.0f}",
                    "" if r.get("compile_s") is None else f"{r['compile_s']:.1f}"]) + " |")


def plot(rows, folder):
    """Client updates per second against cohort size (one panel per model) and
    seconds per round against model size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(folder, exist_ok=True)
    models = [m for m in dict.fromkeys(r["model"] for r in rows) if not m.startswith("mlp-")]
    fig, axes = plt.subplots(1, len(models), figsize=(max(8, 5 * len(models)), 4.5),
                             squeeze=False)
    for ax, m in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == m]
        for c in dict.fromkeys(r["contender"].split(" ")[0] for r in mine):
            pts = sorted((r["cohort"], r["updates_per_s"]) for r in mine
                         if r["contender"].split(" ")[0] == c)
            ax.plot(*zip(*pts), marker="o", label=c,
                    linestyle="-" if any(r["kind"] == "library" for r in mine
                                         if r["contender"].split(" ")[0] == c) else "--")
        floor_pts = sorted({(r["cohort"], r["cohort"] / r["floor_s"]) for r in mine
                            if r["contender"].startswith("sequential")})
        if floor_pts:
            ax.plot(*zip(*floor_pts), color="k", linestyle=":", label="floor (sequential)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("cohort size K")
        ax.set_ylabel("client updates / s")
        ax.set_title(f"{m} ({mine[0]['params'] / 1e6:.3g}M params, {mine[0]['steps']} steps)",
                     fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=8,
               frameon=False)
    fig.suptitle("client updates per second (wall clock; solid: library strategies, dashed: "
                 "references)", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 0.95))
    fig.savefig(os.path.join(folder, "round_throughput_cohort.png"), dpi=110)
    plt.close(fig)
    sized = [r for r in rows if r["model"].startswith("mlp")]
    kk = max((r["cohort"] for r in sized if r["model"].startswith("mlp-")), default=None)
    if kk is None:
        return
    sized = [r for r in sized if r["cohort"] == kk]
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in dict.fromkeys(r["contender"].split(" ")[0] for r in sized):
        mine = [r for r in sized if r["contender"].split(" ")[0] == c]
        pts = sorted((r["params"], r["s_per_round"]) for r in mine)
        ax.plot(*zip(*pts), marker="o", label=c,
                linestyle="-" if mine[0]["kind"] == "library" else "--")
    floor_pts = sorted({(r["params"], r["floor_s"]) for r in sized
                        if r["contender"].startswith("sequential")})
    if floor_pts:
        ax.plot(*zip(*floor_pts), color="k", linestyle=":", label="floor (sequential)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("MLP parameters")
    ax.set_ylabel("seconds per round")
    ax.set_title(f"MLP width sweep, cohort {kk}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "round_throughput_model_size.png"), dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
