"""A million clients on one machine: rounds, peak memory and the final evaluation.

Run:   python benchmarks/million_clients.py
       python benchmarks/million_clients.py --methods fedavg --clients 1000000 --cohort 10000
       python benchmarks/million_clients.py --quick       # a CPU smoke test (seconds)
       python benchmarks/million_clients.py --tables --clients 100000 --cohort 1000 --rounds 5
       python benchmarks/million_clients.py --fedjax --cohort 1000 --rounds 5

``--fedjax``: FedAvg against fedjax 0.0.17 (its own interpreter, ``.venv-fedjax``)
holding 10,000 and 100,000 clients as its users do (``InMemoryFederatedData``,
``UniformGetClientSampler``), beside ours in memory and procedural.

``--tables``: SCAFFOLD and MIFA on ``--clients`` procedural writers with client tables
of each form of ``--forms``: lazy on the device, min(N, cohort x rounds) rows
(``client_states.lazy``: rows only for the clients the run can reach); ``host`` and
``disk`` (the rows outside the device, ``core/row_store.py``). The memory plan's bill
against the process's peak RSS (and its peak anonymous RSS: a disk table's rows are
page cache), and the seconds a round in each of two chunks (the first writes its new
rows into memory the process has not touched yet).

For each method (FedAvg, q-FFL, AAggFF-D), in a fresh process each, side by side:

* **procedural**: ``femnist_like(num_clients=N, procedural=True)``, every writer's 20
  training and 5 test rows computed from (seed, writer id) inside the round
  (``fedjax_fair/data/generated.py``), cohorts of K;
* **stored**: the in-memory ``femnist_like`` federation of K writers of the same
  sizes, every writer in every round: the same cohort shapes, drawn from memory.

Both run the MLP 784-200-200-62, one local step of batch 20, ``chunked`` execution on
one device, a checkpoint directory (the chunk program donates its state, as the CLI
runs), ``--rounds`` rounds as one chunk. The procedural run evaluates a subset of
``--eval-clients`` writers at round 0 (``eval_clients``) and every writer at the end.

Columns: seconds per round (``RunResult.run_seconds`` / rounds: sampling, the rows'
generation and training; not compiling), the final evaluation's seconds (the wall
time from the round-0 evaluation to the final one, less the rounds), the process's
RSS once the data is built and its peak (``VmHWM``: training and evaluation), and
the memory plan the runner printed before anything was allocated.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys

# what every child process starts with: imports, a checkpoint folder removed at exit,
# and its resident and peak memory
_PREAMBLE = r"""
import json, sys, tempfile, threading, time
import jax
from fedjax_fair import runner
from fedjax_fair.algorithms import build
from fedjax_fair.data import femnist_like
from fedjax_fair.models import get_model
CK = tempfile.TemporaryDirectory()  # the run's checkpoint, removed at exit

def rss():
    with open("/proc/self/status") as f:
        d = dict(l.split(":", 1) for l in f)
    return int(d["VmRSS"].split()[0]) * 1024, int(d["VmHWM"].split()[0]) * 1024
"""

_CHILD = _PREAMBLE + r"""
method, n, cohort, rounds, eval_clients, procedural = sys.argv[1:7]
n, cohort, rounds, eval_clients = int(n), int(cohort), int(rounds), int(eval_clients)
procedural = procedural == "1"
t0 = time.perf_counter()
ds = femnist_like(num_clients=n, min_examples=20, max_examples=20, test_examples=5,
                  procedural=procedural)
build_s = time.perf_counter() - t0
model = get_model("mlp", ds.input_shape, ds.num_classes)
params = jax.jit(model.init)(jax.random.key(0))
alg = build(method, model, client_lr=0.05, batch_size=20, num_epochs=1)
data_rss = rss()[0]
lines, marks = [], []
res = runner.run(alg, params, ds.host_data, jax.random.key(0), model=model,
                 num_rounds=rounds, cohort_size=cohort, eval_every=rounds,
                 eval_clients=min(eval_clients, n) if procedural else None,
                 progress=False, log=lines.append, execution="chunked",
                 on_eval=lambda e: marks.append(time.perf_counter()),
                 checkpoint_dir=CK.name, donate=True)
print(json.dumps({"build_s": build_s, "data_rss": data_rss, "peak_rss": rss()[1],
                  "plan": lines[-1], "round_s": res.run_seconds / rounds,
                  "compile_s": res.compile_seconds,
                  "eval_s": marks[-1] - marks[0] - res.run_seconds,
                  "accuracy": res.history[-1]["accuracy_mean"],
                  "evaluated": len(res.client_metrics["accuracy"])}))
"""


_TABLE_CHILD = _PREAMBLE + r"""
def anon():  # resident anonymous memory (not the page cache of mapped files)
    with open("/proc/self/status") as f:
        d = dict(l.split(":", 1) for l in f)
    return int(d["RssAnon"].split()[0]) * 1024

peak_anon = [0]
def watch():
    while True:
        peak_anon[0] = max(peak_anon[0], anon())
        time.sleep(0.02)
threading.Thread(target=watch, daemon=True).start()

method, n, cohort, rounds, form = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
ds = femnist_like(num_clients=n, min_examples=20, max_examples=20, test_examples=5,
                  procedural=True)
model = get_model("mlp", ds.input_shape, ds.num_classes)
params = jax.jit(model.init)(jax.random.key(0))
capacity = min(n, cohort * rounds)  # every client the run can write
option = {"scaffold": "client_table", "mifa": "table"}[method]
text = f"lazy:{capacity}" if form == "lazy" else form
alg = build(method, model, client_lr=0.05, batch_size=20, num_epochs=1, **{option: text})
before = rss()[0]
lines = []
res = runner.run(alg, params, ds.host_data, jax.random.key(0), model=model,
                 num_rounds=rounds, cohort_size=cohort, eval_every=(rounds + 1) // 2,
                 eval_clients=min(1000, n), progress=False, log=lines.append,
                 execution="chunked", checkpoint_dir=CK.name, donate=True)
table = res.client_table
if table is None:  # MIFA keeps its table of updates in the aggregator's state
    from fedjax_fair.core import client_states
    table = client_states.get_table(text).memory(res.state.aggregator_state.table)
print(json.dumps({"data_rss": before, "peak_rss": rss()[1], "peak_anon": peak_anon[0],
                  "plan": lines[-1], "bill": [l for l in lines if "client rows" in l],
                  "plan_bytes": res.memory.total, "table": table,
                  "round_s": res.run_seconds / rounds,
                  "chunks_s": [h["seconds"] for h in res.history[1:]]}))
"""


def tables(args) -> None:
    """SCAFFOLD's and MIFA's client tables on ``--clients`` procedural writers, in each
    form of ``--forms`` (lazy on the device; host; disk): the plan's bill against the
    process's peak."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
               JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    gib = lambda b: f"{b / 2 ** 30:.2f}"
    print("| method | table | clients | cohort x rounds | rows stored x row MiB | table on "
          "the device GiB | reserved outside GiB | plan GiB (+ bill outside) | RSS with the data "
          "built GiB | peak RSS GiB | peak anonymous RSS GiB | round s: first chunk | "
          "second chunk |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for method in ("scaffold", "mifa"):
        for form in args.forms.split(","):
            proc = subprocess.run([sys.executable, "-c", _TABLE_CHILD, method,
                                   str(args.clients), str(args.cohort), str(args.rounds), form],
                                  env=env, capture_output=True, text=True)
            if proc.returncode:
                tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:160]
                print(f"| {method} | {form} | {args.clients:,} | failed: {tail} |||||||||")
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            t = r["table"]
            half = (args.rounds + 1) // 2  # two chunks: the second writes into used memory
            first, whole = r["chunks_s"][0], r["chunks_s"][-1]
            bill = re.search(r"up to ([\d,.]+) MiB", r["bill"][0]) if r["bill"] else None
            plan = gib(r["plan_bytes"]) + (
                f" (+ {float(bill.group(1).replace(',', '')) / 1024:.2f})" if bill else "")
            print(f"| {method} | {form} | {args.clients:,} | {args.cohort:,} x {args.rounds} | "
                  f"{t['rows_stored']:,} x {t['bytes_per_row'] / 2 ** 20:.2f} | "
                  f"{gib(t['bytes'])} | {gib(t.get('bytes_reserved', 0))} | {plan} | "
                  f"{gib(r['data_rss'])} | {gib(r['peak_rss'])} | {gib(r['peak_anon'])} | "
                  f"{first / half:.2f} | {(whole - first) / (args.rounds - half):.2f} |",
                  flush=True)


def fedjax_side(args) -> None:
    """FedAvg against fedjax 0.0.17 at federations of ``--fedjax-sizes`` clients:
    fedjax holding them as its users do (benchmarks/references/fedjax_scale.py, in
    its own interpreter ``--fedjax-python``), ours held in memory and procedural."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "benchmarks", "references", "fedjax_scale.py")
    gib = lambda b: f"{b / 2 ** 30:.2f}"
    print("| N | fedjax: build s | fedjax: round s | fedjax: peak RSS GiB | ours in memory: "
          "round s | peak GiB | ours procedural: round s | peak GiB | fedjax / ours in memory |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in map(int, args.fedjax_sizes.split(",")):
        proc = subprocess.run([args.fedjax_python, script, str(n), str(args.cohort),
                               str(args.rounds)], capture_output=True, text=True)
        fj = (json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0
              else {"failed": f"exit {proc.returncode}: " + (
                  proc.stderr.strip().splitlines() or ["killed"])[-1][:100]})
        held = child("fedavg", n, args.cohort, args.rounds, args.eval_clients, False)
        made = child("fedavg", n, args.cohort, args.rounds, args.eval_clients, True)
        cells = ([f"{fj['build_s']:.1f}", f"{fj['round_s']:.2f}", gib(fj["peak_rss"])]
                 if "failed" not in fj else [fj["failed"], "", ""])
        for r in (held, made):
            cells += ([f"{r['round_s']:.2f}", gib(r["peak_rss"])] if "failed" not in r
                      else [r["failed"], ""])
        ratio = (f"**{fj['round_s'] / held['round_s']:.2f}**"
                 if "failed" not in fj and "failed" not in held else "")
        print(f"| {n:,} | " + " | ".join(cells) + f" | {ratio} |", flush=True)


def child(method: str, n: int, cohort: int, rounds: int, eval_clients: int,
          procedural: bool) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
               JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    proc = subprocess.run([sys.executable, "-c", _CHILD, method, str(n), str(cohort),
                           str(rounds), str(eval_clients), "1" if procedural else "0"],
                          env=env, capture_output=True, text=True)
    if proc.returncode:
        return {"failed": (proc.stderr.strip().splitlines() or ["?"])[-1][:160]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="fedavg,qffl,aaggff_d")
    p.add_argument("--clients", type=int, default=1_000_000)
    p.add_argument("--cohort", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--eval-clients", type=int, default=1000)
    p.add_argument("--quick", action="store_true",
                   help="2,000 clients, cohorts of 100, 2 rounds: checks the script runs")
    p.add_argument("--tables", action="store_true",
                   help="SCAFFOLD and MIFA with lazy client tables instead (e.g. --clients "
                        "100000 --cohort 1000 --rounds 5): the plan's bill and the peak")
    p.add_argument("--forms", default="lazy,host,disk",
                   help="with --tables: the table forms to run (lazy: on the device; host: "
                        "rows in host memory; disk: rows in memory-mapped files in $TMPDIR)")
    p.add_argument("--fedjax", action="store_true",
                   help="FedAvg against fedjax 0.0.17 at --fedjax-sizes clients instead "
                        "(e.g. --cohort 1000 --rounds 5)")
    p.add_argument("--fedjax-sizes", default="10000,100000")
    p.add_argument("--fedjax-python", default=os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv-fedjax", "bin",
        "python"))
    args = p.parse_args(argv)
    if args.fedjax:
        return fedjax_side(args)
    if args.quick:
        args.clients, args.cohort, args.rounds, args.eval_clients = 2000, 100, 2, 100
    if args.tables:
        return tables(args)
    import jax
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, jax {jax.__version__}; "
          f"N = {args.clients:,} procedural against {args.cohort:,} stored, cohorts of "
          f"{args.cohort:,}, {args.rounds} rounds\n")
    gib = lambda b: f"{b / 2 ** 30:.2f}"
    print("| method | federation | round s | procedural / stored | final evaluation s "
          "(clients) | data RSS GiB | peak RSS GiB | memory plan |")
    print("|---|---|---|---|---|---|---|---|")
    for method in args.methods.split(","):
        stored = child(method, args.cohort, args.cohort, args.rounds, args.eval_clients, False)
        made = child(method, args.clients, args.cohort, args.rounds, args.eval_clients, True)
        for label, r in ((f"{args.clients:,} procedural", made),
                         (f"{args.cohort:,} stored", stored)):
            if "failed" in r:
                print(f"| {method} | {label} | failed: {r['failed']} |||||")
                continue
            ratio = (f"**{made['round_s'] / stored['round_s']:.2f}**"
                     if r is made and "round_s" in stored else "")
            print(f"| {method} | {label} | {r['round_s']:.2f} | {ratio} | "
                  f"{r['eval_s']:.1f} ({r['evaluated']:,}) | {gib(r['data_rss'])} | "
                  f"{gib(r['peak_rss'])} | {r['plan'].removeprefix('memory: ')} |", flush=True)


if __name__ == "__main__":
    main()
