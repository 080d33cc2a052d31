"""Committing one evaluation: the run store's step directory (issue 27) against the old save.

Run:   python benchmarks/commit_overhead.py                 (all parts, ~5 min on 2 cores)
       python benchmarks/commit_overhead.py --reps 9 --e2e-repeats 3
       python benchmarks/commit_overhead.py --skip-femnist --skip-e2e   (the quick form)

Since commit 47a0ee0 every evaluation of ``runner.run`` commits one step directory
(``checkpoint.save``: tmp.step-N with state.npz, client_history.npz, rounds.npz and
meta.json, each file fsynced, the directory renamed and fsynced, the last two kept).
Before, ``checkpoint.save`` wrote state.npz and meta.json (``np.savez`` / ``json.dump``
to a temporary name, ``os.replace``, no fsync) and ``save_arrays`` the client history
alike; that old save is reimplemented inline here (``old_save``; the module is gone).
Both are timed side by side in one process, alternating, on the same arguments: those of
the last ``checkpoint.save`` of a real run (captured by wrapping ``checkpoint.save``),
grown to the evaluation / round counts of each row with the real per-round metric shapes:

  default   the README's default job (Synthetic(1,1), 30 clients, logistic regression,
            fedavg, cohort 10, 150 rounds, eval every 10: 16 evaluations, 150 rounds);
  femnist   the README's short-run job, femnist_like with 1000 clients, MLP 784-200-200-62,
            cohort 50, for fedavg and for a stateful method (scaffold: a [1000, d]
            control-variate table), grown to 16 evaluations and 150 rounds;
  growth    the default job's save grown to 2,000 and 20,000 rounds (eval every 10): the
            round log (rounds.npz, and round_metrics in meta.json, in both stores) and the
            history are rewritten in full at every commit, so a run's total commit cost
            grows with the square of its length.

Each cell is the median wall time of ``--reps`` commits into a folder on the disk of the
working tree (``--dir``; not /tmp, which may be a RAM disk where fsync costs nothing),
the bytes one commit writes, and new/old. ``fsync`` is also timed alone (the new save
with ``os.fsync`` patched out) to say how much of the difference it is. Last, the
end-to-end effect: the README's default ``fedjax-fair run`` (150 rounds, eval every 10,
16 commits) with checkpoints and with ``--no-checkpoint``, each in a fresh subprocess,
alternating ``--e2e-repeats`` times (median wall time).
"""
from __future__ import annotations

import argparse
import copy
import json
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


def old_save(directory, state, meta, client_history) -> None:
    """checkpoint.save + save_arrays as of 47a0ee0^: rename, no fsync, no step dirs."""
    import jax
    from fedjax_fair.checkpoint import _to_numpy
    os.makedirs(directory, exist_ok=True)
    arrays = {f"leaf_{i:05d}": _to_numpy(x) for i, x in enumerate(jax.tree.leaves(state))}
    tmp = os.path.join(directory, "state.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, os.path.join(directory, "state.npz"))
    tmp = os.path.join(directory, "meta.tmp.json")
    with open(tmp, "w") as f:
        json.dump(meta, f)
    os.replace(tmp, os.path.join(directory, "meta.json"))
    tmp = os.path.join(directory, "tmp.client_history.npz")
    with open(tmp, "wb") as f:
        np.savez(f, **{k: np.asarray(v) for k, v in client_history.items()})
    os.replace(tmp, os.path.join(directory, "client_history.npz"))


def capture(argv: list) -> tuple:
    """(state, meta, arrays) of the last checkpoint.save of ``fedjax-fair run argv``."""
    import jax
    import jax.numpy as jnp
    from fedjax_fair import checkpoint as ckpt
    from fedjax_fair import cli
    real, last = ckpt.save, []

    def grab(directory, state, meta, arrays=None, fresh=False):
        # a copy: the runner donates the state's buffers to the next chunk
        last[:] = [(jax.tree.map(lambda x: jnp.array(x, copy=True), state),
                    copy.deepcopy(meta), copy.deepcopy(arrays))]
        return real(directory, state, meta, arrays, fresh)
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


def grow(saved: tuple, evaluations: int, rounds: int, eval_every: int) -> tuple:
    """The save of a run of ``rounds`` rounds (``evaluations`` evaluations), its round
    log and histories tiled from ``saved``'s (the real per-round / per-client shapes)."""
    from fedjax_fair.runner import CLIENT_HISTORY, ROUND_LOG
    state, meta, arrays = saved

    def tile(a, n):
        reps = -(-n // a.shape[0])
        return np.concatenate([a] * reps)[:n]
    history = [dict(meta["history"][min(i, len(meta["history"]) - 1)], round=i * eval_every)
               for i in range(evaluations)]
    round_metrics = {k: [v[i % len(v)] for i in range(rounds)]
                     for k, v in meta.get("round_metrics", {}).items()}
    arrays = {CLIENT_HISTORY: {k: tile(v, evaluations)
                               for k, v in arrays[CLIENT_HISTORY].items()},
              ROUND_LOG: {k: tile(v, rounds) for k, v in arrays[ROUND_LOG].items()}}
    if "round" in arrays[CLIENT_HISTORY]:
        arrays[CLIENT_HISTORY]["round"] = np.arange(evaluations) * eval_every
    meta = {**meta, "round": rounds, "history": history, "round_metrics": round_metrics}
    return state, meta, arrays


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def measure(saved: tuple, reps: int, base: str) -> dict:
    """Median seconds and bytes of one commit, new store / old save / new without fsync,
    the three alternating ``reps`` times."""
    from fedjax_fair import checkpoint as ckpt
    from fedjax_fair.runner import CLIENT_HISTORY
    state, meta, arrays = saved
    new_dir, old_dir, nosync_dir = (tempfile.mkdtemp(prefix=p, dir=base)
                                    for p in ("new_", "old_", "nosync_"))
    times = {"new": [], "old": [], "nosync": []}
    real_fsync = os.fsync

    def new():
        ckpt.save(new_dir, state, meta, arrays)

    def old():
        old_save(old_dir, state, meta, arrays[CLIENT_HISTORY])

    def nosync():
        os.fsync = lambda fd: None
        try:
            ckpt.save(nosync_dir, state, meta, arrays)
        finally:
            os.fsync = real_fsync
    try:
        for fn in (new, old, nosync):  # warm-up (first-touch of the arrays, imports)
            fn()
        for _ in range(reps):
            for name, fn in (("new", new), ("old", old), ("nosync", nosync)):
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        new_bytes = _size(ckpt.latest(new_dir))
        old_bytes = sum(_size(os.path.join(old_dir, n))
                        for n in ("state.npz", "meta.json", "client_history.npz"))
    finally:
        for d in (new_dir, old_dir, nosync_dir):
            shutil.rmtree(d, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"new_s": med["new"], "old_s": med["old"], "nosync_s": med["nosync"],
            "new_bytes": new_bytes, "old_bytes": old_bytes}


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f}"


def table(rows: list) -> str:
    head = ("| case | state | evals / rounds | new (ms) | old (ms) | new/old | new, no fsync "
            "(ms) | bytes new | bytes old |")
    lines = [head, "|" + "|".join("---" for _ in range(9)) + "|"]
    for r in rows:
        m = r["m"]
        lines.append(f"| {r['case']} | {r['state']} | {r['evals']} / {r['rounds']:,} | "
                     f"{_ms(m['new_s'])} | {_ms(m['old_s'])} | "
                     f"{m['new_s'] / m['old_s']:.2f} | {_ms(m['nosync_s'])} | "
                     f"{_mib(m['new_bytes'])} | {_mib(m['old_bytes'])} |")
    return "\n".join(lines)


def state_bytes(state) -> str:
    import jax
    from fedjax_fair.checkpoint import _to_numpy
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
    args = ap.parse_args(argv)
    import jax
    fs = subprocess.run(["df", "-T", args.dir], capture_output=True, text=True).stdout
    fs = fs.splitlines()[-1].split()[1] if fs else "?"
    print(f"# commit_overhead | {platform.platform()} | {platform.processor() or '?'} | "
          f"{os.cpu_count()} CPUs | jax {jax.__version__} ({jax.default_backend()}) | "
          f"numpy {np.__version__} | {fs} at {args.dir} | {load_average()}", flush=True)
    base = tempfile.mkdtemp(prefix="commit_overhead_", dir=args.dir)
    rows = []
    try:
        default = capture([])  # the README's default job, 150 rounds, eval every 10
        n_eval, n_rounds = len(default[1]["history"]), default[1]["round"]
        s = state_bytes(default[0])
        rows.append({"case": "default job (fedavg, 30 clients, logreg)", "state": s,
                     "evals": n_eval, "rounds": n_rounds,
                     "m": measure(default, args.reps, base)})
        print(table(rows[-1:]), flush=True)
        if not args.skip_femnist:
            for method in filter(None, args.femnist_methods.split(",")):
                got = capture(["--dataset", "femnist_like", "--num-clients", "1000",
                               "--model", "mlp", "--algorithm", method, "--cohort-size",
                               "50", "--num-rounds", "2", "--eval-every", "1"])
                rows.append({"case": f"femnist_like 1000 clients, mlp, {method}",
                             "state": state_bytes(got[0]), "evals": 16, "rounds": 150,
                             "m": measure(grow(got, 16, 150, 10), args.reps, base)})
                print(table(rows[-1:]).splitlines()[-1], flush=True)
                del got
        for rounds in (2_000, 20_000):
            rows.append({"case": "default job, longer round log", "state": s,
                         "evals": rounds // 10 + 1, "rounds": rounds,
                         "m": measure(grow(default, rounds // 10 + 1, rounds, 10),
                                      max(3, args.reps // 2), base)})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print()
    print(table(rows))
    long = rows[-1]["m"]
    commits = 20_000 // 10 + 1
    print(f"\nA 20,000-round run evaluating every 10 rounds commits {commits:,} times; at a "
          f"cost growing linearly to {_ms(long['new_s'])} ms (new) / {_ms(long['old_s'])} ms "
          f"(old) the commits total about {commits * long['new_s'] / 2:,.0f} s (new) / "
          f"{commits * long['old_s'] / 2:,.0f} s (old).")
    if not args.skip_e2e:
        res = e2e(args.e2e_repeats)
        (a, a0, a1), (b, b0, b1) = res["checkpoints"], res["--no-checkpoint"]
        print(f"\nEnd to end, `fedjax-fair run` (README default: 150 rounds, eval every 10, "
              f"{n_eval} commits), median of {args.e2e_repeats} fresh processes:")
        print("| run | wall (s) | min-max (s) |\n|---|---|---|")
        print(f"| checkpoints (default) | {a:.2f} | {a0:.2f}-{a1:.2f} |")
        print(f"| --no-checkpoint | {b:.2f} | {b0:.2f}-{b1:.2f} |")
        print(f"| difference | {a - b:+.2f} ({(a - b) / b:+.1%}) | |")
        print(f"(the {n_eval} commits at the measured {_ms(rows[0]['m']['new_s'])} ms each: "
              f"{n_eval * rows[0]['m']['new_s']:.2f} s)")


if __name__ == "__main__":
    main()
