"""Committing one evaluation: the run store's log segments against the whole-log rewrite.

Run:   python benchmarks/commit_overhead.py                 (all parts, ~6 min on 2 cores)
       python benchmarks/commit_overhead.py --reps 9 --e2e-repeats 3
       python benchmarks/commit_overhead.py --skip-femnist --skip-e2e --growth 2000
                                                             (the quick form)

Every evaluation of ``runner.run`` commits one step directory (``checkpoint.save``:
tmp.step-N with state.npz and meta.json, each file fsynced, the directory renamed and
fsynced, the last two kept). The runner's logs (the evaluation ``history``, the per-client
``client_history`` [E, N], every round's metrics ``rounds`` [R, ...]) are folders of
segments: a commit writes only the rows since the last one, as one segment merged with the
trailing segments of as many saves or fewer (a binary counter), and hard-links the other
segments from the step before. The store it replaced (47a0ee0 to af52aca) rewrote the
whole logs at every commit: the history and ``round_metrics`` (train_loss / update_norm /
improved_fraction of every round) inside meta.json, the per-client history and the round
log as client_history.npz and rounds.npz. That whole rewrite is reimplemented here
(``whole_save``: the same step-directory commit, ``checkpoint.save(..., arrays=...)``).
The save before 47a0ee0 (rename, no fsync, no step directories) is no longer compared;
docs/performance.md's history has its numbers.

Both stores are timed in one process on the arguments of the last ``checkpoint.save`` of
a real run (captured by wrapping ``checkpoint.save``: the state, meta and the last
chunk's rows), tiled to the evaluations / rounds of each row with the real per-round and
per-client shapes, into folders on the disk of the working tree (``--dir``; not /tmp,
which may be a RAM disk where fsync costs nothing):

  per commit  the commit of evaluation 16 of a 150-round run (eval every 10) for the
              README's default job (Synthetic(1,1), 30 clients, logistic regression,
              fedavg, cohort 10) and the README's femnist_like job (1000 clients, MLP
              784-200-200-62, cohort 50) with fedavg and scaffold (a [1000, d]
              control-variate table). New store: commit 16 merges the 15 saves before
              it (segments of 8, 4, 2, 1: the costliest of the run) and commit 15 merges
              nothing (it links 3 segments); the step directory before is rebuilt from
              hard links before each timed commit. Whole rewrite: the full logs of 16
              evaluations and 150 rounds. Median of ``--reps`` commits, the three
              alternating; the bytes one commit writes (files not linked).
  growth      a whole run of the default job's commits, in order, for each ``--growth``
              round count R (eval every 10: R/10 + 1 commits, default 2,000 and 20,000):
              commit i of the new store (the rows of one chunk) then commit i of the
              whole rewrite (the full logs so far), alternating, each into its own
              checkpoint (the retention of the step before included); total seconds,
              mean and largest commit, and the segments and bytes of the final step.

Last, the end-to-end effect: the README's default ``fedjax-fair run`` (150 rounds, eval
every 10, 16 commits) with checkpoints and with ``--no-checkpoint``, each in a fresh
subprocess, alternating ``--e2e-repeats`` times (median wall time).
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from timing import load_average  # noqa: E402

ROOT = os.path.dirname(HERE)
EVAL_EVERY = 10
TINY = {"x": np.zeros(1, np.float32)}  # the state of the untimed saves that build a log


def whole_save(directory, state, meta, history, clients, rounds, round_metrics,
               fresh=False) -> str:
    """The store of 47a0ee0..af52aca: one step directory holding the whole logs, the
    history and the round metrics in meta.json, client_history.npz and rounds.npz."""
    from fedjax_fair.drivers import checkpoint as ckpt
    return ckpt.save(directory, state,
                     {**meta, "history": history, "round_metrics": round_metrics},
                     {"client_history.npz": clients, "rounds.npz": rounds}, fresh=fresh)


def capture(argv: list) -> tuple:
    """(state, meta, logs) of the last checkpoint.save of ``fedjax-fair run argv``."""
    import jax
    import jax.numpy as jnp
    from fedjax_fair.drivers import checkpoint as ckpt
    from fedjax_fair import cli
    real, last = ckpt.save, []

    def grab(directory, state, meta, arrays=None, fresh=False, logs=None):
        # a copy: the runner donates the state's buffers to the next chunk
        last[:] = [(jax.tree.map(lambda x: jnp.array(x, copy=True), state),
                    copy.deepcopy(meta), copy.deepcopy(logs))]
        return real(directory, state, meta, arrays, fresh, logs)
    ckpt.save = grab
    out = tempfile.mkdtemp(prefix="commit_capture_", dir=ROOT)
    try:
        code = cli.main(["run", *argv, "--no-progress", "--no-plots", "-o", out])
        assert code == 0, f"run {argv} exited {code}"
    finally:
        ckpt.save = real
        for h in getattr(cli, "_HELD", []):
            h.release()
        getattr(cli, "_HELD", []).clear()
        shutil.rmtree(out, ignore_errors=True)
    return last[0]


def _tile(a, n: int):
    a = np.asarray(a)
    return np.concatenate([a] * -(-n // a.shape[0]))[:n]


class Run:
    """A run of ``evaluations`` evaluations (every ``EVAL_EVERY`` rounds) built from the
    captured save: its commits' rows (``chunk``) and its logs so far (``full``)."""

    def __init__(self, saved: tuple, evaluations: int):
        from fedjax_fair.drivers.runner import (CLIENT_HISTORY, HISTORY, ROUND_LOG,
                                                ROUND_SCALARS)
        self.state, self.meta, logs = saved
        self.meta = {k: v for k, v in self.meta.items() if k != "round"}
        self.evaluations, self.rounds = evaluations, (evaluations - 1) * EVAL_EVERY
        entry = logs[HISTORY][-1]
        self.history = [dict(entry, round=i * EVAL_EVERY) for i in range(evaluations)]
        self.clients = {k: _tile(v, evaluations) for k, v in logs[CLIENT_HISTORY].items()}
        self.round_log = {k: _tile(v, max(self.rounds, 1)) for k, v in logs[ROUND_LOG].items()}
        self.scalars = {k: self.round_log[k].tolist() for k in ROUND_SCALARS
                        if k in self.round_log}
        self.names = HISTORY, CLIENT_HISTORY, ROUND_LOG

    def chunk(self, i: int) -> dict:
        """The logs of commit ``i`` (1-based) of the new store: evaluation i - 1's rows
        and the rounds of its chunk (none for the evaluation before the first round)."""
        r0, r1 = (i - 2) * EVAL_EVERY, (i - 1) * EVAL_EVERY
        history, clients, rounds = self.names
        return {history: self.history[i - 1:i],
                clients: {k: v[i - 1:i] for k, v in self.clients.items()},
                rounds: ({k: v[r0:r1] for k, v in self.round_log.items()} if i > 1 else {})}

    def full(self, i: int) -> tuple:
        """whole_save's arguments for commit ``i``: the logs of its i evaluations."""
        r = (i - 1) * EVAL_EVERY
        return ({**self.meta, "round": r}, self.history[:i],
                {k: v[:i] for k, v in self.clients.items()},
                {k: v[:r] for k, v in self.round_log.items()},
                {k: v[:r] for k, v in self.scalars.items()})

    def new(self, directory: str, i: int, state=None) -> str:
        from fedjax_fair.drivers import checkpoint as ckpt
        return ckpt.save(directory, self.state if state is None else state,
                         {**self.meta, "round": (i - 1) * EVAL_EVERY}, logs=self.chunk(i),
                         fresh=i == 1)

    def whole(self, directory: str, i: int, state=None, full=None) -> str:
        meta, history, clients, rounds, scalars = full or self.full(i)
        return whole_save(directory, self.state if state is None else state, meta,
                          history, clients, rounds, scalars, fresh=i == 1)


def _written(step: str) -> int:
    """Bytes of the files of ``step`` that this commit wrote (not hard links)."""
    total = 0
    for folder, _, files in os.walk(step):
        for name in files:
            st = os.stat(os.path.join(folder, name))
            total += st.st_size if st.st_nlink == 1 else 0
    return total


def _segments(step: str) -> int:
    return sum(len(files) for folder, _, files in os.walk(step) if folder != step)


def _size(step: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, name))
               for folder, _, files in os.walk(step) for name in files)


def measure(run: Run, reps: int, base: str) -> dict:
    """Median seconds and bytes of commit E (and E - 1) of the new store and of commit
    E of the whole rewrite, alternating ``reps`` times, each into a checkpoint whose
    two step directories before are hard-link copies of saves built untimed."""
    e = run.evaluations
    templates = {}
    for name, commits, save in (("new", e - 1, run.new), ("new-1", e - 2, run.new),
                                ("whole", e - 1, run.whole)):
        d = templates[name] = tempfile.mkdtemp(prefix=f"template_{name}_", dir=base)
        for i in range(1, commits + 1):  # the logs as the run left them, a tiny state
            save(d, i, TINY)
    full = run.full(e)
    cells = {"new": (e, lambda d: run.new(d, e)),
             "new-1": (e - 1, lambda d: run.new(d, e - 1)),
             "whole": (e, lambda d: run.whole(d, e, full=full))}
    times = {k: [] for k in cells}
    written = {}
    try:
        for rep in range(reps + 1):  # the first: warm-up (first touch, imports)
            for name, (_, fn) in cells.items():
                d = os.path.join(base, f"{name}_{rep}")
                shutil.copytree(templates[name], d, copy_function=os.link)
                t = time.perf_counter()
                step = fn(d)
                if rep:
                    times[name].append(time.perf_counter() - t)
                written[name] = _written(step)
                shutil.rmtree(d, ignore_errors=True)
    finally:
        for d in templates.values():
            shutil.rmtree(d, ignore_errors=True)
    return {**{f"{k}_s": statistics.median(v) for k, v in times.items()},
            **{f"{k}_bytes": v for k, v in written.items()}}


def growth(run: Run, base: str) -> dict:
    """Every commit of ``run`` in order, new store and whole rewrite alternating."""
    new_dir, whole_dir = (tempfile.mkdtemp(prefix=p, dir=base) for p in ("new_", "whole_"))
    times = {"new": [], "whole": []}
    try:
        for i in range(1, run.evaluations + 1):
            full = run.full(i)  # slicing the logs is the runner's, not the store's
            t = time.perf_counter()
            run.new(new_dir, i)
            times["new"].append(time.perf_counter() - t)
            t = time.perf_counter()
            run.whole(whole_dir, i, full=full)
            times["whole"].append(time.perf_counter() - t)
        from fedjax_fair.drivers import checkpoint as ckpt
        from fedjax_fair.drivers.runner import CLIENT_HISTORY
        new_step, whole_step = ckpt.latest(new_dir), ckpt.latest(whole_dir)
        # the store reads back what the run wrote
        assert ckpt.load_log(new_dir, CLIENT_HISTORY)["accuracy"].shape[0] == run.evaluations
        assert len(ckpt.read_meta(new_dir)["history"]) == run.evaluations
        out = {"segments": _segments(new_step), "new_bytes": _size(new_step),
               "whole_bytes": _size(whole_step)}
    finally:
        for d in (new_dir, whole_dir):
            shutil.rmtree(d, ignore_errors=True)
    for k, v in times.items():
        out.update({f"{k}_total": sum(v), f"{k}_mean": statistics.mean(v),
                    f"{k}_max": max(v), f"{k}_last": v[-1]})
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f}"


def table(rows: list) -> str:
    head = ("| case | state | evals / rounds | new, commit 16 (ms) | new, commit 15 (ms) | "
            "whole rewrite (ms) | new 16 / whole | bytes new 16 / 15 | bytes whole |")
    lines = [head, "|" + "|".join("---" for _ in range(9)) + "|"]
    for r in rows:
        m = r["m"]
        lines.append(f"| {r['case']} | {r['state']} | {r['evals']} / {r['rounds']:,} | "
                     f"{_ms(m['new_s'])} | {_ms(m['new-1_s'])} | {_ms(m['whole_s'])} | "
                     f"{m['new_s'] / m['whole_s']:.2f} | {_mib(m['new_bytes'])} / "
                     f"{_mib(m['new-1_bytes'])} | {_mib(m['whole_bytes'])} |")
    return "\n".join(lines)


def growth_table(rows: list) -> str:
    head = ("| evals / rounds (commits) | new total (s) | whole total (s) | whole / new | "
            "new mean / max (ms) | whole mean / last (ms) | new: segments, final step | "
            "whole: final step |")
    lines = [head, "|" + "|".join("---" for _ in range(8)) + "|"]
    for r in rows:
        g = r["g"]
        lines.append(f"| {r['evals']:,} / {r['rounds']:,} | {g['new_total']:,.1f} | "
                     f"{g['whole_total']:,.1f} | {g['whole_total'] / g['new_total']:.1f} | "
                     f"{_ms(g['new_mean'])} / {_ms(g['new_max'])} | {_ms(g['whole_mean'])} / "
                     f"{_ms(g['whole_last'])} | {g['segments']}, {_mib(g['new_bytes'])} | "
                     f"{_mib(g['whole_bytes'])} |")
    return "\n".join(lines)


def state_bytes(state) -> str:
    import jax
    from fedjax_fair.drivers.checkpoint import _to_numpy
    return _mib(sum(_to_numpy(x).nbytes for x in jax.tree.leaves(state)))


def e2e(repeats: int) -> dict:
    """Median wall seconds of the README's default run with and without checkpoints."""
    times = {"checkpoints": [], "--no-checkpoint": []}
    for _ in range(repeats):
        for name, extra in (("checkpoints", []), ("--no-checkpoint", ["--no-checkpoint"])):
            out = tempfile.mkdtemp(prefix="commit_e2e_", dir=ROOT)
            try:
                t = time.perf_counter()
                subprocess.run([sys.executable, "-m", "fedjax_fair.cli", "run", "--no-progress",
                                "--no-plots", "-o", out, "--overwrite", *extra], check=True,
                               stdout=subprocess.DEVNULL, cwd=ROOT)
                times[name].append(time.perf_counter() - t)
            finally:
                shutil.rmtree(out, ignore_errors=True)
    return {k: (statistics.median(v), min(v), max(v)) for k, v in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7, help="commits timed per cell (median)")
    ap.add_argument("--e2e-repeats", type=int, default=3)
    ap.add_argument("--dir", default=ROOT, help="where the commits are written")
    ap.add_argument("--femnist-methods", default="fedavg,scaffold")
    ap.add_argument("--skip-femnist", action="store_true")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--growth", default="2000,20000",
                    help="round counts of the whole-run replays (eval every 10; '' for none)")
    args = ap.parse_args(argv)
    import jax
    fs = subprocess.run(["df", "-T", args.dir], capture_output=True, text=True).stdout
    fs = fs.splitlines()[-1].split()[1] if fs else "?"
    print(f"# commit_overhead | {platform.platform()} | {platform.processor() or '?'} | "
          f"{os.cpu_count()} CPUs | jax {jax.__version__} ({jax.default_backend()}) | "
          f"numpy {np.__version__} | {fs} at {args.dir} | {load_average()}", flush=True)
    base = tempfile.mkdtemp(prefix="commit_overhead_", dir=args.dir)
    rows, grown = [], []
    try:
        default = capture([])  # the README's default job, 150 rounds, eval every 10
        s = state_bytes(default[0])
        rows.append({"case": "default job (fedavg, 30 clients, logreg)", "state": s,
                     "evals": 16, "rounds": 150,
                     "m": measure(Run(default, 16), args.reps, base)})
        print(table(rows[-1:]), flush=True)
        if not args.skip_femnist:
            for method in filter(None, args.femnist_methods.split(",")):
                got = capture(["--dataset", "femnist_like", "--num-clients", "1000",
                               "--model", "mlp", "--algorithm", method, "--cohort-size",
                               "50", "--num-rounds", "2", "--eval-every", "1"])
                rows.append({"case": f"femnist_like 1000 clients, mlp, {method}",
                             "state": state_bytes(got[0]), "evals": 16, "rounds": 150,
                             "m": measure(Run(got, 16), args.reps, base)})
                print(table(rows[-1:]).splitlines()[-1], flush=True)
                del got
        for rounds in (int(r) for r in args.growth.split(",") if r.strip()):
            evals = rounds // EVAL_EVERY + 1
            t = time.perf_counter()
            grown.append({"evals": evals, "rounds": rounds,
                          "g": growth(Run(default, evals), base)})
            print(growth_table(grown[-1:]) + f"\n({time.perf_counter() - t:.0f} s; "
                  f"{load_average()})", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print()
    print(table(rows))
    if grown:
        print()
        print(growth_table(grown))
    if not args.skip_e2e:
        res = e2e(args.e2e_repeats)
        (a, a0, a1), (b, b0, b1) = res["checkpoints"], res["--no-checkpoint"]
        print(f"\nEnd to end, `fedjax-fair run` (README default: 150 rounds, eval every 10, "
              f"16 commits), median of {args.e2e_repeats} fresh processes:")
        print("| run | wall (s) | min-max (s) |\n|---|---|---|")
        print(f"| checkpoints (default) | {a:.2f} | {a0:.2f}-{a1:.2f} |")
        print(f"| --no-checkpoint | {b:.2f} | {b0:.2f}-{b1:.2f} |")
        print(f"| difference | {a - b:+.2f} ({(a - b) / b:+.1%}) | |")
    print(f"\n{load_average()}")


if __name__ == "__main__":
    main()
