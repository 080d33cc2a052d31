"""Server-step cost: the fair rules alone (issue 4), every registered method (issue 14)
and the robust aggregators (scenarios/robust.py).

Run:   python benchmarks/server_step.py                   (the three tables, K = 10, 100,
                                                           1000)
       python benchmarks/server_step.py --quick           (the three tables, K = 10, 100;
                                                           the methods' rounds only, 3 trials)
       python benchmarks/server_step.py --table rules     (issue 4's table only; d = 100k,
                                                           --quick: d = 10k; --params d)
       python benchmarks/server_step.py --methods fedavg,scaffold,dqn_fed [--quick]
                                                          (issue 14's table, chosen methods)
       python benchmarks/server_step.py --table robust    (the robust aggregators beside
                                                           weighted_mean; d as the rules)

``--clients`` (a comma list of K) applies to every table; ``--split`` / ``--no-split``
turns the clients / server columns on or off (default: on, off with ``--quick``).

**Rules table (issue 4).** One server step = the mixing rule's ``update`` (weights
from the K clients' losses, steps and state) + the aggregator (one direction from the
K stacked deltas of d parameters), jitted as one program, full participation (K = N,
so AAggFF-S's ONS matrix is K x K). Timed side by side in one process: the fastest of
``--reps`` calls after a warm-up. Memory: XLA's own accounting of the compiled step
(``memory_analysis``: temporaries, and the persistent state such as the ONS matrix).
Local training is not included; it dominates a round for any real model.

**Robust table (scenarios/robust.py).** The rules table's server step (``by_num_examples``
weights + the aggregator, jitted, the same K x d stacked deltas, fastest of ``--reps``)
for each robust aggregator, and weighted_mean's step timed at the same K just before
it: "x mean" is their ratio. The coordinate-wise rules sort the K values of every
coordinate (O(K d log K)), Krum forms the K x K Gram matrix (O(K^2 d), HIGHEST matmul
precision), the geometric median makes 2 passes over the K x d deltas per Weiszfeld
step, norm bounding one pass more than the mean. A cell is skipped when its ``--reps``
+ 1 steps, predicted quadratically in K from the previous K, exceed ``--max-seconds``
(XLA's CPU sort takes ~200 ns per element: the coordinate-wise rules at K = 1000,
d = 100k would take 15-20 s a step there).

**Methods table (issue 14).** Every entry of ``fedjax_fair.algorithms.REGISTRY`` (or
``--methods``) with its registry defaults, on one fixed model: the MLP 64-512-128-10
(d = 100,234 parameters; FedCVAE's clients train a CVAE with hidden (512,), 101,472
parameters, and the MLP is its server classifier), N = K clients (full participation,
which the "full" methods need), 10-20 real examples of 8x8x1 inputs in [0, 1] per
client (M = 20), execution "auto" (sequential on CPU).

Definition: a method's *server-step cost* is its whole jitted round (``apply``, the
state donated as ``runner.run`` donates it) with every client's step budget 0
(``Cohort.local_steps``), so no client takes a local step. What is left is what the
method adds around local training: the server (mixing, aggregation, server optimizer,
drift of the client tables, a server-side solve or classifier fit) and each client's
fixed work, i.e. its bookkeeping (table rows gathered and written back: duals, control
variates, personal models) and whatever it computes that a zero budget does not
remove: gradients at theta^t (DQN-Fed, FedLF, FedNL, FedNew), Hessian-vector products
for a curvature diagonal (FedNL, FedNew), a fresh model and per-sample energy
gradients (FedEvg), and every method's ``loss_before`` forward pass over the client's
rows. FedAvg's zero-step round (that forward pass, the K zero deltas, their weighted
mean) is the reference: "x FedAvg" is the ratio of the two rounds, measured in the
same trials.

For methods built by ``compose`` (all but FedEvg and FedCVAE; FedNew is composed with
a wrapper that writes the duals back), the round is also split in two, each timed on
its own: *clients* = the cohort's rows gathered + the zero-budget client map (what
``compose`` runs before the server), *server* = everything after it: the mixing rule,
the aggregator, the server optimizer, the table's drift and the scatter of the cohort's
rows (round metrics left out), on the clients' outputs computed once. The pieces are
read from the factory's own ``compose`` call (recorded while the factory runs), and
the split is checked in every cell: clients + server from the round's initial state
and key must give the round's new parameters ("split check" below the table). Both
halves are then timed from the state after one round (rows written, SuPerFed's fresh
local models drawn), as the round is. They materialise the client outputs between
them, which the round's single program need not, so clients + server can exceed the
round. FedNew's server column leaves out its wrapper's dual write-back (one gather and
one scatter of K rows). "server x FedAvg" is the ratio of the server columns: the
issue-4 kind of number, for every method.

Clients take no step, so their deltas are zero. No server piece has a data-dependent
iteration count (every solver loop is a fixed-length ``fori_loop``/``scan``), so the
timings do not depend on the values.

Timing: per method and K, FedAvg's round and server step and the method's round,
clients and server programs (each compiled and run once first) alternate within every
trial (the starting program rotates, as ``timing.alternate_rounds`` does), and each
reports its fastest trial; the ratios come from the same trials, so load on a shared
machine hits both sides alike. A cell runs at least ``--trials`` trials, more (up to
100) while they fit in ``--target-seconds`` (cheap cells at small K are the noisiest),
and fewer when ``--max-seconds`` cannot hold ``--trials`` of them ("trials" column).
Columns: ms per round (fastest), x FedAvg, clients and server ms, server x FedAvg;
the state's bytes (every leaf: parameters, optimizer state, client tables); XLA's
memory analysis of the compiled round: arguments (the state leaves the round reads,
jit drops unused ones, + the cohort) and temporaries; the round's compile seconds; the
1-minute load average when the cell finished. A cell is skipped (and the table says
why) when XLA's memory analysis of the compiled round exceeds ``--max-gib``, or when
one trial, predicted linearly in K from the method's previous K, would exceed
``--max-seconds``.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_fair.core import aggregators, mixing
from fedjax_fair.algorithms.aaggff import aaggff_d_mixing, aaggff_s_mixing
from fedjax_fair.algorithms.afl import afl_mixing
from fedjax_fair.algorithms.fedmax import fedsoftmax_mixing
from fedjax_fair.algorithms.fedmgda import fedmgda_plus_aggregator
from fedjax_fair.algorithms.propfair import propfair_mixing
from fedjax_fair.algorithms.qffl import prior_mixing, qffl_aggregator
from fedjax_fair.algorithms.term import term_mixing
from fedjax_fair.core.memory import tree_bytes
from fedjax_fair.core.types import ClientOutput, ServerContext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import timeit  # noqa: E402

RULES = {
    "fedavg": lambda: (mixing.by_num_examples(), aggregators.weighted_mean()),
    "qffl": lambda: (prior_mixing(), qffl_aggregator(1.0, 10.0)),
    "term": lambda: (term_mixing(0.1), aggregators.weighted_mean()),
    "afl": lambda: (afl_mixing(0.01), aggregators.weighted_mean()),
    "propfair": lambda: (propfair_mixing(2.0), aggregators.weighted_mean()),
    "fedsoftmax": lambda: (fedsoftmax_mixing(5.0), aggregators.weighted_mean()),
    "fedmgda_plus": lambda: (mixing.by_num_examples(), fedmgda_plus_aggregator(0.5)),
    "aaggff_s (ONS, full K x K)": lambda: (aaggff_s_mixing(), aggregators.weighted_mean()),
    "aaggff_s (diagonal)": lambda: (aaggff_s_mixing(solver="diagonal"),
                                    aggregators.weighted_mean()),
    "aaggff_d (FTRL)": lambda: (aaggff_d_mixing(), aggregators.weighted_mean()),
}

MiB = 2 ** 20
MAX_TRIALS = 100
HIDDEN = (512, 128)  # MLP 64-512-128-10: 100,234 parameters
CVAE_HIDDEN = (512,)  # FedCVAE's generator: 101,472 parameters
INPUT_SHAPE, NUM_CLASSES, PADDED = (8, 8, 1), 10, 20
FACTORY_KWARGS = {"fedcvae": {"hidden": CVAE_HIDDEN}}  # all others: registry defaults


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ------------------------------------------------------------------ rules (issue 4)


def outputs(k: int, d: int) -> ClientOutput:
    keys = jax.random.split(jax.random.key(0), 4)
    return ClientOutput(delta={"w": jax.random.normal(keys[0], (k, d), jnp.float32)},
                        loss_before=jax.random.uniform(keys[1], (k,), minval=0.1, maxval=3.0),
                        num_examples=jax.random.randint(keys[2], (k,), 10, 200),
                        num_steps=jnp.full((k,), 10, jnp.int32),
                        train_loss=jax.random.uniform(keys[3], (k,), minval=0.1, maxval=3.0))


def rules_table(ks, d: int, reps: int):
    print(f"# {platform.processor() or platform.machine()} | jax {jax.__version__} | "
          f"{jax.devices()[0]} | d = {d:,} parameters | full participation (K = N) | "
          f"load {loadavg()}")
    print("| rule | K | ms / step | state MiB | temp MiB | compile s |")
    print("|---|---|---|---|---|---|")
    for k in ks:
        out = outputs(k, d)
        ids, mask = jnp.arange(k, dtype=jnp.int32), jnp.ones((k,), bool)
        for name, build in RULES.items():
            mix, agg = build()
            params = {"w": jnp.zeros((d,))}
            state = (mix.init(k), agg.init(params, k))
            ctx = ServerContext(params, jnp.zeros((), jnp.int32), jax.random.key(0), ids, mask)

            def step(state, out):
                w, ms = mix.update(state[0], out, ctx)
                direction, ags, _ = agg.aggregate(state[1], out, w, ctx)
                return direction, (ms, ags)

            t = time.perf_counter()
            compiled = jax.jit(step).lower(state, out).compile()
            compile_s = time.perf_counter() - t
            mem = compiled.memory_analysis()
            temp = (mem.temp_size_in_bytes if mem is not None else 0) / 2 ** 20
            sec = timeit(lambda: compiled(state, out), reps)
            print(f"| {name} | {k} | {1e3 * sec:.3f} | {tree_bytes(state) / 2 ** 20:.2f} | "
                  f"{temp:.1f} | {compile_s:.1f} |", flush=True)


# -------------------------------------------------------------- robust aggregators


def robust_aggregators():
    from fedjax_fair.scenarios import robust
    return {
        "coordinate_median": robust.coordinate_median,
        "coordinate_median (weighted)": lambda: robust.coordinate_median(weighted=True),
        "trimmed_mean (0.1)": lambda: robust.trimmed_mean(0.1),
        "krum (f = 1)": lambda: robust.krum(1),
        "multi_krum (f = 1, multi = K/2)": None,  # built per K
        "geometric_median (8 steps)": lambda: robust.geometric_median(8),
        "norm_bounded (1.0, mean)": lambda: robust.norm_bounded(1.0),
    }


def compiled_step(agg, k: int, d: int):
    """(compiled server step, its arguments, compile s, temp MiB) for ``agg`` at K."""
    mix = mixing.by_num_examples()
    params = {"w": jnp.zeros((d,))}
    ids, mask = jnp.arange(k, dtype=jnp.int32), jnp.ones((k,), bool)
    ctx = ServerContext(params, jnp.zeros((), jnp.int32), jax.random.key(0), ids, mask)

    def step(state, out):
        w, _ = mix.update((), out, ctx)
        direction, _, info = agg.aggregate(state, out, w, ctx)
        return direction, info

    state = agg.init(params, k)
    t = time.perf_counter()
    compiled = jax.jit(step).lower(state, outputs(k, d)).compile()
    compile_s = time.perf_counter() - t
    mem = compiled.memory_analysis()
    return compiled, state, compile_s, (mem.temp_size_in_bytes if mem is not None else 0) / MiB


def robust_table(ks, d: int, reps: int, max_seconds: float):
    """Prints the robust aggregators' server steps beside weighted_mean's."""
    from fedjax_fair.scenarios import robust
    print(f"# {platform.processor() or platform.machine()} | {os.cpu_count()} cores | jax "
          f"{jax.__version__} | {jax.devices()[0]} | d = {d:,} parameters | full "
          f"participation (K = N) | by_num_examples weights | load {loadavg()}")
    print("| aggregator | K | ms / step | x mean | temp MiB | compile s |")
    print("|---|---:|---:|---:|---:|---:|")
    previous = {}
    for k in ks:
        out = outputs(k, d)
        builds = robust_aggregators()
        builds["multi_krum (f = 1, multi = K/2)"] = lambda: robust.krum(1, multi=max(1, k // 2))
        for name, build in builds.items():
            prev = previous.get(name)
            predicted = None if prev is None else prev[1] * (k / prev[0]) ** 2
            if predicted is not None and (reps + 1) * predicted > max_seconds:
                print(f"| {name} | {k} | skipped: {reps + 1} steps predicted "
                      f"{(reps + 1) * predicted:.0f} s (quadratic from K = {prev[0]}) "
                      f"> {max_seconds:g} s | | | |", flush=True)
                continue
            mean, mean_state, _, _ = compiled_step(aggregators.weighted_mean(), k, d)
            step, state, compile_s, temp = compiled_step(build(), k, d)
            ref = timeit(lambda: mean(mean_state, out), reps)
            sec = timeit(lambda: step(state, out), reps)
            previous[name] = (k, sec)
            print(f"| {name} | {k} | {1e3 * sec:.3f} | {sec / ref:.1f} | {temp:.1f} | "
                  f"{compile_s:.1f} |", flush=True)
        print(f"| weighted_mean (reference) | {k} | {1e3 * ref:.3f} | 1.0 | | |", flush=True)


# -------------------------------------------------------------- methods (issue 14)


def federation(num_clients: int, seed: int = 0):
    """N clients of 10-20 real rows (8x8x1 inputs in [0, 1], 10 classes), padded to 20."""
    from fedjax_fair.core.types import ClientData
    rng = np.random.default_rng(seed)
    n = rng.integers(10, PADDED + 1, num_clients).astype(np.int32)
    x = rng.uniform(0.0, 1.0, (num_clients, PADDED, *INPUT_SHAPE)).astype(np.float32)
    y = rng.integers(0, NUM_CLASSES, (num_clients, PADDED)).astype(np.int32)
    mask = np.arange(PADDED)[None, :] < n[:, None]
    x, y = np.where(mask[:, :, None, None, None], x, 0.0), np.where(mask, y, 0)
    return ClientData({"x": jnp.asarray(x), "y": jnp.asarray(y)}, jnp.asarray(mask),
                      jnp.asarray(n))


def zero_step_cohort(num_clients: int):
    """The whole federation as one cohort, every step budget 0."""
    from fedjax_fair.core.types import Cohort
    return Cohort(client_ids=jnp.arange(num_clients, dtype=jnp.int32),
                  data=federation(num_clients), client_mask=jnp.ones((num_clients,), bool),
                  local_steps=jnp.zeros((num_clients,), jnp.int32))


class Built:
    """A registered method built on the model, with its ``compose`` pieces when the
    factory's round is a composed one (``kind``: "composed", "composed+wrapper" or
    "own apply")."""

    def __init__(self, name: str, model):
        import fedjax_fair.core.algorithm as A
        from fedjax_fair.algorithms import REGISTRY
        real, calls = A.compose, []

        def recording(client_update, **kwargs):
            alg = real(client_update, **kwargs)
            calls.append((client_update, kwargs, alg))
            return alg

        # Every module that imported ``compose`` calls it through its own global.
        patched = [m for m in list(sys.modules.values())
                   if getattr(m, "__name__", "").startswith("fedjax_fair")
                   and getattr(m, "compose", None) is real]
        for m in patched:
            m.compose = recording
        try:
            self.alg = REGISTRY[name].factory(model, **FACTORY_KWARGS.get(name, {}))
        finally:
            for m in patched:
                m.compose = real
        self.name, self.pieces = name, None
        self.kind = "own apply"
        if calls:
            client_update, kwargs, inner = calls[-1]
            if inner.apply is self.alg.apply:
                self.kind = "composed"
            elif inner.init is self.alg.init and inner.client_table is self.alg.client_table:
                self.kind = "composed+wrapper"  # e.g. FedNew: compose + a dual write-back
            if self.kind != "own apply":
                self.pieces = (client_update, kwargs, inner)

    def round(self):
        alg = self.alg
        return lambda state, cohort, key: alg.apply(state, cohort, key)

    def clients(self):
        """The zero-budget cohort as ``compose`` runs it: rows gathered, client map."""
        from fedjax_fair.core.execution import map_clients
        from fedjax_fair.core.types import Broadcast
        client_update, kw, inner = self.pieces
        broadcast = kw.get("broadcast")
        stateful = kw.get("client_state_init") is not None

        def clients(state, cohort, key):
            k = cohort.client_ids.shape[0]
            keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(cohort.client_ids)
            cs = inner.client_rows(state, cohort.client_ids) if stateful else ()
            payload = Broadcast(state.params, state.round,
                                broadcast(state) if broadcast is not None else ())
            run = map_clients(lambda b, xs: client_update(b, *xs), "auto", k)
            return run(payload, (cs, cohort.data, cohort.local_steps, keys),
                       sizes=cohort.data.num_examples)

        return clients

    def server(self):
        """What ``compose``'s round runs after the client map (metrics left out)."""
        from fedjax_fair.core.algorithm import SERVER_KEY_ID, ServerState
        _, kw, inner = self.pieces
        mix = kw.get("mixing") or mixing.by_num_examples()
        agg = kw.get("aggregator") or aggregators.weighted_mean()
        opt = kw.get("server_optimizer") or optax.sgd(1.0)
        drift, table = kw.get("drift"), inner.client_table

        def server(state, client_out, cohort, key):
            outs, new_rows = client_out
            ctx = ServerContext(params=state.params, round=state.round,
                                key=jax.random.fold_in(key, SERVER_KEY_ID),
                                client_ids=cohort.client_ids, client_mask=cohort.client_mask)
            weights, mixing_state = mix.update(state.mixing_state, outs, ctx)
            direction, agg_state, _ = agg.aggregate(state.aggregator_state, outs, weights, ctx)
            updates, opt_state = opt.update(direction, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            tbl = state.client_states
            if table is not None:
                if drift is not None:
                    tbl = table.drift(tbl, drift(state, params, outs, weights, ctx))
                tbl = table.scatter(tbl, cohort.client_ids, new_rows, cohort.client_mask,
                                    state.round)
            return ServerState(params, opt_state, mixing_state, agg_state, tbl,
                               state.round + 1)

        return server


def own_copy(tree):
    return jax.tree.map(jnp.copy, tree)


class Program:
    """One compiled program ``fn(state, *args, key)`` and the state it carries from
    call to call. ``returns``: "pair" ((state, metrics): a round), "state" (a server
    step) or "outputs" (the clients: the state is only read)."""

    def __init__(self, fn, state, args, returns: str):
        donate = (0,) if returns != "outputs" else ()
        t = time.perf_counter()
        self.compiled = jax.jit(fn, donate_argnums=donate).lower(
            state, *args, jax.random.key(0)).compile()
        self.compile_s = time.perf_counter() - t
        self.state, self.args, self.returns = state, args, returns
        self.first_s = None

    def memory(self):
        ma = self.compiled.memory_analysis()
        return (ma.argument_size_in_bytes, ma.temp_size_in_bytes) if ma else (0, 0)

    def __call__(self, key):
        out = self.compiled(self.state, *self.args, key)
        if self.returns == "outputs":
            return out
        self.state = out[0] if self.returns == "pair" else out
        return self.state

    def warm(self):
        t = time.perf_counter()
        jax.block_until_ready(self(jax.random.key(0)))
        self.first_s = time.perf_counter() - t


def alternate(programs: dict, trials: int) -> dict:
    """Fastest seconds of each program, the programs alternating within each trial
    (the starting one rotates), as ``timing.alternate_rounds`` runs rounds."""
    names = list(programs)
    best = {name: float("inf") for name in names}
    for trial in range(trials):
        order = names[trial % len(names):] + names[:trial % len(names)]
        for name in order:
            t = time.perf_counter()
            jax.block_until_ready(programs[name](jax.random.key(trial + 1)))
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def rel_err(a, ref) -> float:
    return max(float(jnp.max(jnp.abs(x - y)) / (1e-12 + jnp.max(jnp.abs(y))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(ref)))


def skipped(name, k, kind, why) -> str:
    return (f"| {name} | {k} | {kind} | | skipped: {why} | | | | | | | | | "
            f"{loadavg().split()[0]} |")


def method_cell(b: Built, params, k, cohort, opts, ref: dict, previous, checks):
    """(table row, programs) of method ``b`` at cohort size ``k``; ``ref``: FedAvg's
    programs ("round", "server") at this K, empty for FedAvg's own cell."""
    trials, target, max_seconds, max_gib, split = opts
    name, key0 = b.name, jax.random.key(0)
    prev = previous.get(name)
    if prev is not None and prev[1] * k / prev[0] > max_seconds:
        return skipped(name, k, b.kind, f"one trial predicted {prev[1] * k / prev[0]:.0f} s "
                       f"(linear from K = {prev[0]}) > {max_seconds:g} s"), {}
    state0 = b.alg.init(params, k)
    state_mib = tree_bytes(state0) / MiB
    rnd = Program(b.round(), own_copy(state0), (cohort,), "pair")
    arg_b, temp_b = rnd.memory()
    if (arg_b + temp_b) / 2 ** 30 > max_gib:
        return skipped(name, k, b.kind, f"compiled round needs "
                       f"{(arg_b + temp_b) / 2 ** 30:.1f} GiB > {max_gib:g} GiB"), {}
    rnd.warm()  # round 1 from state0 with key 0: every client has written its row
    programs = {"round": rnd}
    if split and b.pieces is not None:
        cli = Program(b.clients(), state0, (cohort,), "outputs")
        out0 = cli.compiled(state0, cohort, key0)
        srv = Program(b.server(), own_copy(state0), (out0, cohort), "state")
        # the split check: clients + server from state0 with key 0 = the round's state
        by_split = srv.compiled(own_copy(state0), out0, cohort, key0)
        err = rel_err(by_split.params, rnd.state.params)
        checks[(name, k)] = "ok" if err < 1e-5 else f"MISMATCH (rel. err {err:.1e})"
        # time both halves in the round's steady state (rows written, SuPerFed's fresh
        # local models drawn once), as the round program is timed
        steady = own_copy(rnd.state)
        cli.state = steady
        srv.state, srv.args = own_copy(steady), (cli(key0), cohort)
        del out0, by_split
        programs.update(clients=cli, server=srv)
    programs.update({f"fedavg {n}": p for n, p in ref.items()})
    for p in programs.values():
        if p.first_s is None:
            p.warm()
    per_trial = max(sum(p.first_s for p in programs.values()), 1e-9)
    n = max(trials, min(MAX_TRIALS, int(target // per_trial)))  # cheap cells: more trials
    n = max(1, min(n, int(max_seconds // per_trial)))
    best = alternate(programs, n)
    previous[name] = (k, sum(best.values()))
    ref_round, ref_server = (best.get("fedavg round", best["round"]),
                             best.get("fedavg server", best.get("server")))
    ms = lambda s: f"{1e3 * s:.2f}" if s is not None else "—"
    ratio = lambda a, r: f"{a / r:.2f}" if a is not None and r else "—"
    cli_s, srv_s = best.get("clients"), best.get("server")
    row = (f"| {name} | {k} | {b.kind} | {n} | {ms(best['round'])} | "
           f"{ratio(best['round'], ref_round)} | {ms(cli_s)} | {ms(srv_s)} | "
           f"{ratio(srv_s, ref_server)} | {state_mib:.1f} | {arg_b / MiB:.1f} | "
           f"{temp_b / MiB:.1f} | {rnd.compile_s:.1f} | {loadavg().split()[0]} |")
    return row, {n: programs[n] for n in ("round", "server") if n in programs}


def methods_table(names, ks, trials: int, target: float, max_seconds: float,
                  max_gib: float, split: bool) -> dict:
    """Prints the table; returns {(name, K): wall seconds of the cell}."""
    from fedjax_fair.models import mlp
    model = mlp(INPUT_SHAPE, NUM_CLASSES, hidden=HIDDEN)
    params = jax.jit(model.init)(jax.random.key(0))
    d = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    print(f"# {platform.machine()} {platform.processor() or ''} | {os.cpu_count()} cores | "
          f"jax {jax.__version__} | {jax.devices()[0]} | MLP 64-512-128-10, d = {d:,} | "
          f"N = K, M = {PADDED}, step budgets 0 | execution auto | fastest of >= {trials} "
          f"trials (up to {MAX_TRIALS} within {target:g} s) | load {loadavg()}")
    print("| method | K | kind | trials | round ms | x FedAvg | clients ms | server ms | "
          "server x FedAvg | state MiB | args MiB | temp MiB | compile s | load |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    fedavg = Built("fedavg", model)
    opts = (trials, target, max_seconds, max_gib, split)
    checks, previous, cell_s = {}, {}, {}
    for k in ks:
        cohort = zero_step_cohort(k)
        ref = {}
        for name in ["fedavg"] + [n for n in names if n != "fedavg"]:
            t_cell = time.perf_counter()
            try:
                b = fedavg if name == "fedavg" else Built(name, model)
                row, programs = method_cell(b, params, k, cohort, opts, ref, previous,
                                            checks)
                if name == "fedavg":
                    ref = programs
            except Exception as e:  # a method that cannot run here: say why, go on
                row = skipped(name, k, "", f"failed: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:120]}")
            print(row, flush=True)
            cell_s[(name, k)] = time.perf_counter() - t_cell
        del ref
    bad = {nk: c for nk, c in checks.items() if c != "ok"}
    if checks:
        print(f"\nsplit check (clients + server from the same state and key give the "
              f"round's new parameters, rel. err < 1e-5): "
              f"{'ok in all ' + str(len(checks)) + ' cells' if not bad else bad}")
    return cell_s


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="K = 10, 100 (rules: d = 10k; methods: 3 trials, no split)")
    ap.add_argument("--table", choices=("all", "rules", "methods", "robust"), default=None,
                    help="default: all, or methods when --methods is given")
    ap.add_argument("--methods", default=None,
                    help="comma list of registered methods (default: all of REGISTRY)")
    ap.add_argument("--clients", default=None, help="comma list of K")
    ap.add_argument("--params", type=int, default=None, help="rules and robust tables: d")
    ap.add_argument("--reps", type=int, default=5, help="rules and robust tables: timed calls")
    ap.add_argument("--trials", type=int, default=None,
                    help="methods table: least trials (default 5, --quick 3)")
    ap.add_argument("--split", action=argparse.BooleanOptionalAction, default=None,
                    help="methods table: time the clients and server halves of composed "
                         "rounds too (default: on, off with --quick)")
    ap.add_argument("--target-seconds", type=float, default=None,
                    help="methods table: cheap cells run more trials (up to "
                         f"{MAX_TRIALS}) within this many seconds (default 5, --quick 1)")
    ap.add_argument("--max-seconds", type=float, default=120.0,
                    help="methods table: timing seconds per method and K; robust table: "
                         "skip an aggregator whose reps + 1 steps are predicted (quadratically "
                         "in K from the previous K) to take longer")
    ap.add_argument("--max-gib", type=float, default=8.0,
                    help="methods table: skip a round whose XLA memory exceeds this")
    args = ap.parse_args()
    table = args.table or ("methods" if args.methods else "all")
    ks = [int(k) for k in args.clients.split(",")] if args.clients else (
        [10, 100] if args.quick else [10, 100, 1000])
    t0 = time.perf_counter()
    if table in ("all", "rules"):
        rules_table(ks, args.params or (10_000 if args.quick else 100_000), args.reps)
        print(f"\n# rules table: {time.perf_counter() - t0:.0f} s\n", flush=True)
    if table in ("all", "robust"):
        t1 = time.perf_counter()
        robust_table(ks, args.params or (10_000 if args.quick else 100_000), args.reps,
                     args.max_seconds)
        print(f"\n# robust table: {time.perf_counter() - t1:.0f} s\n", flush=True)
    if table in ("all", "methods"):
        from fedjax_fair.algorithms import REGISTRY
        names = args.methods.split(",") if args.methods else list(REGISTRY)
        unknown = [n for n in names if n not in REGISTRY]
        if unknown:
            ap.error(f"--methods: unknown {unknown}; allowed: {sorted(REGISTRY)}")
        t1 = time.perf_counter()
        split = not args.quick if args.split is None else args.split
        cells = methods_table(names, ks, args.trials or (3 if args.quick else 5),
                              args.target_seconds or (1.0 if args.quick else 5.0),
                              args.max_seconds, args.max_gib, split)
        slow = sorted(cells.items(), key=lambda kv: -kv[1])[:5]
        print(f"# methods table: {time.perf_counter() - t1:.0f} s; slowest cells (s, incl. "
              f"compile): " + ", ".join(f"{n} K={k} {s:.0f}" for (n, k), s in slow))
    print(f"# total {time.perf_counter() - t0:.0f} s | load {loadavg()}")


if __name__ == "__main__":
    main()
