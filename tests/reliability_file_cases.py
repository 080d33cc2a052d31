"""Bad-input cases of files a run reads or writes (tests/test_reliability.py runs them):
config files, output directories and `--resume`, corrupted checkpoints and saved
runs."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from reliability_common import TINY, _add

# ---- config files
_CONFIGS = (
    ("job.yaml", "num_rounds: 3\nlearning_rate: 0.1\n", "learning_rate", "run"),
    ("job.json", '{"num_rounds": 3, "lr": 0.1}', "lr", "run"),
    ("job.yaml", "num_rounds: ten\n", "num_rounds", "run"),
    ("job.json", '{"num_rounds": "ten"}', "num_rounds", "run"),
    ("job.yaml", "num_rounds: true\n", "num_rounds", "run"),
    ("job.yaml", "num_rounds: 2.5\n", "num_rounds", "run"),
    ("job.yaml", "client_lr: [0.1]\n", "client_lr", "run"),
    ("job.yaml", "client_lr: .nan\n", "client_lr", "run"),
    ("job.yaml", "client_lr: -.inf\n", "client_lr", "run"),
    ("job.yaml", "hparams: 3\n", "hparams", "run"),
    ("job.yaml", "hparams: {nope: 1}\n", "hparams.nope", "run"),
    ("job.yaml", "algorithm: fedprox\nhparams: {mu: -1}\n", "hparams.mu", "run"),
    ("job.yaml", "dataset_args: [1, 2]\n", "dataset_args", "run"),
    ("job.yaml", "dataset_args: {nope: 1}\n", "dataset_args.nope", "run"),
    ("job.yaml", "algorithm: [fedavg]\n", "algorithm", "run"),
    ("job.yaml", "seeds: [0, 1]\n", "seeds", "run"),
    ("job.yaml", "checkpoint: maybe\n", "checkpoint", "run"),
    ("job.yaml", "overwrite: 2\n", "overwrite", "run"),
    ("job.yaml", "- num_rounds\n- 3\n", "config", "run"),
    ("job.yaml", "just a string\n", "config", "run"),
    ("job.yaml", "num_rounds: [1, 2\n", "config", "run"),
    ("job.yaml", "a: b: c\n", "config", "run"),
    ("job.json", '{"num_rounds": 3,,}', "config", "run"),
    ("job.json", "[1, 2]", "config", "run"),
    ("job.yaml", "num_rounds: 3\nnum_rounds: 4\n", "num_rounds", "run"),  # a key twice
    ("job.yaml", "hparams: {mu: 0.1, mu: 0.2}\nalgorithm: fedprox\n", "mu", "run"),
    ("job.json", '{"num_rounds": 3, "num_rounds": 4}', "num_rounds", "run"),
    ("job.yaml", f"seed: {2 ** 32}\n", "seed", "run"),
    ("job.yaml", f"num_rounds: {10 ** 30}\n", "num_rounds", "run"),
    ("cmp.yaml", "seeds: [0, 1]\nseeds: [2]\n", "seeds", "compare"),
    ("cmp.yaml", f"seeds: [0, {2 ** 32}]\n", "seeds", "compare"),
    ("cmp.yaml", "seeds: [a, b]\n", "seeds", "compare"),
    ("cmp.yaml", "seeds: [0, 0]\n", "seeds", "compare"),
    ("cmp.yaml", "algorithms: {fedavg: 1}\n", "algorithms", "compare"),
    ("cmp.yaml", "algorithms: [fedavg, nope]\n", "algorithms", "compare"),
    ("cmp.yaml", "algorithm: fedavg\n", "algorithm", "compare"),
    ("cmp.yaml", "algorithms: [fedprox]\nhparams: {fedprox: {nope: 1}}\n",
     "hparams[fedprox].nope", "compare"),
    ("cmp.yaml", "algorithms: [fedprox]\nhparams: {fedadam: {b1: 0.5}}\n",
     "hparams.fedadam.b1", "compare"),
)
for name, text, field, cmd in _CONFIGS:
    shown = f"`{cmd} --config {name}` holding `{text.strip()}`".replace("\n", "⏎")
    _add(7, f"config:{cmd}:{text!r}", shown, "config file", field,
         cli=lambda ws, n=name, t=text, c=cmd: [c, "--config", ws.write(n, t)])
_add(7, "config:missing", "`run --config missing.yaml`", "config file", "config",
     cli=lambda ws: ["run", "--config", str(ws.tmp / "missing.yaml")])
_add(7, "config:directory", "`run --config DIR` (a directory)", "config file", "config",
     cli=lambda ws: ["run", "--config", str(ws.tmp)])


def _latin1_config(ws, name: str) -> str:
    path = ws.tmp / name
    path.write_bytes("# réglages\nnum_rounds: 3\n".encode("latin-1"))
    return str(path)


for _name in ("job.yaml", "job.json"):
    _add(7, f"config:not utf-8 {_name}", f"`run --config {_name}` in Latin-1 (not UTF-8)",
         "config file", "config",
         cli=lambda ws, n=_name: ["run", "--config", _latin1_config(ws, n)])

# ---- output directories and resume
def _resume(*flags):
    return lambda ws: ["run", "-o", ws.finished_run(), "--resume", *flags]


for flags, field in ((["--num-rounds", "4", "--algorithm", "fedprox"], "resume"),
                     (["--num-rounds", "4", "--hp", "max_steps=5"], "resume"),
                     (["--num-rounds", "4", "--seed", "1"], "resume"),
                     (["--num-rounds", "4", "--client-lr", "0.5"], "resume"),
                     (["--num-rounds", "4", "--num-clients", "10"], "resume"),
                     (["--num-rounds", "4", "--batch-size", "5"], "resume"),
                     (["--num-rounds", "4", "--cohort-size", "2"], "resume"),
                     (["--num-rounds", "4", "--model", "mlp"], "resume"),
                     (["--num-rounds", "4", "--dataset", "digits"], "resume"),
                     (["--num-rounds", "4", "--client-lr-schedule", "exponential:0.9"],
                      "resume"),
                     (["--num-rounds", "4", "--no-checkpoint"], "resume"),
                     (["--num-rounds", "4", "--seed", "1", "--client-lr", "0.5",
                       "--algorithm", "fedprox"], ("resume", "seed", "client_lr",
                                                   "algorithm")),
                     (["--num-rounds", "1"], "num_rounds"),
                     (["--num-rounds", "0"], "num_rounds")):
    _add(8, f"resume:{' '.join(flags)}", f"`run -o DONE --resume {' '.join(flags)}`",
         "`run --resume` on a finished 2-round run", field, cli=_resume(*flags))
_add(8, "resume:empty dir", "`run -o EMPTY_DIR --resume`", "`run --resume`", "resume",
     cli=lambda ws: ["run", "-o", ws.directory("empty"), "--resume"])
_add(8, "resume:no dir", "`run -o MISSING_DIR --resume`", "`run --resume`", "resume",
     cli=lambda ws: ["run", "-o", str(ws.tmp / "missing"), "--resume"])
_add(8, "resume:compare dir", "`run -o COMPARE_DIR --resume`", "`run --resume`", "resume",
     cli=lambda ws: ["run", "-o", ws.interrupted_compare(), "--resume"])
_add(8, "resume:other checkpoint dir", "`run -o DONE --resume --checkpoint-dir EMPTY_DIR`",
     "`run --resume`", "resume",
     cli=lambda ws: ["run", "-o", ws.finished_run(), "--resume", "--checkpoint-dir",
                     str(ws.tmp / "elsewhere")])
_add(8, "run:non-empty", "`run -o DONE` (same flags, no --resume / --overwrite)",
     "output directory", "output_dir",
     cli=lambda ws: ["run", *TINY, "--num-rounds", "2", "-o", ws.finished_run()])
_add(8, "compare:non-empty", "`compare -o STOPPED` (an interrupted comparison; no --resume "
     "/ --overwrite)",
     "output directory", "output_dir",
     cli=lambda ws: ["compare", *TINY, "--algorithms", "fedavg", "-o", ws.interrupted_compare()])
_add(8, "run:-o file", "`run -o FILE` (an existing file)", "output directory", "output_dir",
     cli=lambda ws: ["run", *TINY, "-o", ws.write("a_file", "x")])
_add(8, "run:-o under file", "`run -o FILE/sub`", "output directory", "output_dir",
     cli=lambda ws: ["run", *TINY, "-o", os.path.join(ws.write("a_file", "x"), "sub")])
_add(8, "run:--checkpoint-dir file", "`run --checkpoint-dir FILE`", "output directory",
     "checkpoint_dir",
     cli=lambda ws: ["run", *TINY, "--checkpoint-dir", ws.write("a_file", "x")])
_add(8, "compare:resume empty", "`compare -o EMPTY_DIR --resume`", "`compare --resume`",
     "resume", cli=lambda ws: ["compare", "-o", str(ws.tmp / "missing"), "--resume"])
for flags in (["--num-rounds", "3"], ["--seeds", "0,1"], ["--algorithms", "fedavg,fedprox"],
              ["--hp", "max_steps=3"], ["--eval-every", "1"], ["--cohort-size", "2"]):
    _add(8, f"compare:resume {' '.join(flags)}", f"`compare -o STOPPED --resume "
         f"{' '.join(flags)}`", "`compare --resume` on an interrupted comparison", "resume",
         cli=lambda ws, f=flags: ["compare", "-o", ws.interrupted_compare(), "--resume", *f])
_add(8, "compare:resume run dir", "`compare -o RUN_DIR --resume` (a `run` directory)",
     "`compare --resume`", "resume",
     cli=lambda ws: ["compare", "-o", ws.finished_run(), "--resume"])

# ---- corrupted checkpoints and saved runs
def _corrupt(path: str, mutate: Callable) -> Callable:
    """``path`` in the finished run damaged by ``mutate``; ``checkpoint/NAME`` is NAME
    in the checkpoint's newest committed save (its step directory)."""
    def argv(ws):
        run = ws.finished_run()
        target = Path(run) / path
        if path.startswith("checkpoint/"):
            from fedjax_fair.drivers import checkpoint as ckpt
            target = Path(ckpt.latest(str(Path(run) / "checkpoint"))) / path.split("/", 1)[1]
            if target.is_dir():  # a log: its newest segment
                target = max(target.iterdir())
        mutate(target)
        return ["run", "-o", run, "--resume", "--num-rounds", "4"]
    return argv


def _truncate(p: Path):
    data = p.read_bytes()
    p.write_bytes(data[:len(data) // 2])


def _wrong_arrays(p: Path):
    with open(p, "wb") as f:
        np.savez(f, leaf_00000=np.zeros(3, np.float32))


def _wrong_dtype(p: Path):
    with np.load(p) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["leaf_00000"] = arrays["leaf_00000"].astype(np.float64)
    with open(p, "wb") as f:
        np.savez(f, **arrays)


def _edit_json(**changes):
    def mutate(p: Path):
        data = json.loads(p.read_text())
        data.update(changes)
        p.write_text(json.dumps(data))
    return mutate


def _mutated(directory: str, name: str, mutate: Callable) -> str:
    mutate(Path(directory) / name)
    return directory


for path, mutate, what, field, xfail in (
        ("checkpoint/state.npz", lambda p: p.write_bytes(b"not a zip file"),
         "state.npz replaced by garbage bytes", "resume", None),
        ("checkpoint/state.npz", _truncate, "state.npz cut in half", "resume",
         None),
        ("checkpoint/state.npz", _wrong_arrays, "state.npz holding other arrays", "resume",
         None),
        ("checkpoint/state.npz", _wrong_dtype, "state.npz with a float64 leaf", "resume",
         None),
        ("checkpoint/state.npz", Path.unlink, "state.npz deleted", "resume", None),
        ("checkpoint/meta.json", lambda p: p.write_text("{not json"),
         "meta.json not JSON", "resume", None),
        ("checkpoint/meta.json", lambda p: p.write_text('{"history": []}'),
         "meta.json with an empty history", "resume", None),
        ("checkpoint/meta.json", lambda p: p.write_text("[]"), "meta.json a list",
         "resume", None),
        ("checkpoint/meta.json", Path.unlink, "meta.json deleted", "resume", None),
        ("checkpoint", shutil.rmtree, "checkpoint/ deleted", "resume", None),
        ("checkpoint/client_history", lambda p: p.write_bytes(b"junk"),
         "the newest client_history segment replaced by garbage bytes", "resume",
         None),
        ("checkpoint/history", lambda p: p.write_text('{"round": 2}'),
         "the newest history segment not a list", "resume", None),
        ("config.json", lambda p: p.write_text("{not json"), "config.json not JSON",
         "resume", None),
        ("config.json", lambda p: p.write_text("[1, 2]"), "config.json a list", "resume",
         None),
        ("config.json", _edit_json(num_rounds="x"), "config.json with num_rounds \"x\"",
         "num_rounds", None),
        ("config.json", _edit_json(algorithm="nope"), "config.json naming an unknown "
         "algorithm", "algorithm", None),
        ("config.json", _edit_json(hparams={"nope": 1}), "config.json with an unknown "
         "hyper-parameter", "hparams.nope", None)):
    _add(9, f"corrupt:{what}", f"{what}, then `run -o DONE --resume --num-rounds 4`",
         "saved run", field, cli=_corrupt(path, mutate),
         xfail=xfail and f"a traceback ({xfail}) instead of a one-line error")
_add(9, "corrupt:compare config", "config.json not JSON, then `compare -o STOPPED --resume`",
     "saved comparison", "resume",
     cli=lambda ws: ["compare", "-o", _mutated(ws.interrupted_compare(), "config.json",
                                              lambda p: p.write_text("{not json")),
                     "--resume"])
