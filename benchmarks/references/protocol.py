"""A reference that runs in its own process and times rounds on request.

Child side (``serve``): imports, prints a ready line, then reads commands on stdin:
"job PATH" builds the job of that JSON file (data, model, a warm-up) and answers with
its info; "round" answers with the seconds one round took (measured in the child, so
start-up and pipe latency are not counted); "drop" frees the job; "quit" or end of
input stops it. One
child serves every job of a run in turn (the import and thread start-up are paid
once). Protocol lines start with ``@@`` so that anything else a library prints is
ignored.

Parent side (``Reference``): starts the child, ``load(job)`` sends a job,
``round()`` returns the child's seconds. The parent idles while the child runs, so contenders in the
parent and in the children can alternate round by round (``timing.alternate``).
Standard library only: it runs under the fedjax 0.0.17 environment's interpreter too.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

PREFIX = "@@"


def _send(obj) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(setup) -> None:
    """``setup(job) -> (round_fn, info)``; ``round_fn()`` runs one round and returns
    when it is done. A job file named by argv[1] (optional) is loaded at start."""
    round_fn = None

    def load(path):
        nonlocal round_fn
        round_fn = None  # the previous job's data go before the next job's are built
        import gc
        gc.collect()
        try:
            with open(path) as f:
                job = json.load(f)
            t = time.perf_counter()
            round_fn, info = setup(job)
            _send({"ready": True, **info, "setup_s": time.perf_counter() - t})
        except Exception as e:  # reported to the parent, which prints it and goes on
            import traceback
            traceback.print_exc()
            _send({"error": f"{type(e).__name__}: {e}"})

    if len(sys.argv) > 1:
        load(sys.argv[1])
    else:
        _send({"ready": True})
    for line in sys.stdin:
        cmd = line.strip()
        if cmd.startswith("job "):
            load(cmd[4:])
        elif cmd == "round":
            if round_fn is None:
                _send({"error": "no job loaded"})
                continue
            c = time.process_time()
            t = time.perf_counter()
            round_fn()
            _send({"seconds": time.perf_counter() - t, "cpu": time.process_time() - c})
        elif cmd == "drop":  # frees the job's data (the next job may be large)
            round_fn = None
            import gc
            gc.collect()
        elif cmd == "quit":
            break


class ReferenceFailed(RuntimeError):
    pass


class Seconds(float):
    """Wall seconds of a round measured in the child; ``cpu``: its CPU seconds."""

    cpu = float("nan")


class Reference:
    """A child process serving rounds of the jobs it is given (see ``serve``)."""

    def __init__(self, argv: list, job: dict | None = None, env: dict | None = None,
                 timeout: float = 900.0, wait: bool = True):
        self._dir = tempfile.mkdtemp(prefix="fedjax_fair_ref_")
        self._jobs = 0
        self._timeout = timeout
        self._ready = False
        self._log = open(os.path.join(self._dir, "stderr.txt"), "w+")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True,
                                     env={**os.environ, **(env or {})})
        self.info = {}
        if wait or job is not None:
            self.wait_ready()
        if job is not None:
            self.load(job, timeout)

    def wait_ready(self) -> None:
        """Waits for the child's start-up line (its imports done)."""
        if not self._ready:
            self.info = self._read(self._timeout)
            self._ready = True

    def load(self, job: dict, timeout: float = 900.0) -> dict:
        """Builds ``job`` in the child (data, model, warm-up); returns its info."""
        self.wait_ready()
        self._jobs += 1
        path = os.path.join(self._dir, f"job{self._jobs}.json")
        with open(path, "w") as f:
            json.dump(job, f)
        self.proc.stdin.write(f"job {path}\n")
        self.proc.stdin.flush()
        self.info = self._read(timeout)
        if "error" in self.info:
            raise ReferenceFailed(self.info["error"] + "\n" + self.stderr_tail())
        return self.info

    def drop(self) -> None:
        """Frees the child's current job (its data) without stopping the child."""
        if self._ready and self.proc.poll() is None:
            self.proc.stdin.write("drop\n")
            self.proc.stdin.flush()

    def stderr_tail(self, chars: int = 2000) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()[-chars:]

    def _read(self, timeout: float) -> dict:
        start = time.perf_counter()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()
                raise ReferenceFailed(f"reference exited ({self.proc.returncode}):\n"
                                      + self.stderr_tail())
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX):])
            if time.perf_counter() - start > timeout:
                raise ReferenceFailed("reference timed out")

    def round(self) -> float:
        """Seconds of one round, as the child measured it (``.cpu``: its CPU seconds)."""
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        reply = self._read(float("inf"))
        if "error" in reply:
            raise ReferenceFailed(reply["error"])
        out = Seconds(reply["seconds"])
        out.cpu = float(reply.get("cpu", float("nan")))
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired, OSError):
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
