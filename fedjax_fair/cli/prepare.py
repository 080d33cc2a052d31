"""``fedjax-fair prepare``: write a federation to disk once (``data/disk.py``), for runs
that memory-map it (``--dataset disk --dataset-arg path=DIR``).

    fedjax-fair prepare --dataset femnist_like --dataset-arg procedural=true \\
        --num-clients 100000 -o federations/femnist_100k

The dataset is given as ``run`` takes it (``--dataset``, ``--dataset-arg``,
``--dataset-args``, the dataset shortcuts such as ``--num-clients``); a procedural one
is written a block of clients at a time, so the federation never has to fit in
memory. Progress goes to stderr (a bar on a terminal, a line every tenth otherwise).
An interrupted prepare (Ctrl-C, a kill) leaves no ``DIR`` that a run would read.
"""
from __future__ import annotations

import sys
import time

from fedjax_fair.cli import config as C
from fedjax_fair.cli.common import add_dataset_flags, dataset_args_of


def add_parser(sub) -> None:
    p = sub.add_parser("prepare", help="write a federation to disk once, for runs that "
                                       "memory-map it (--dataset disk)",
                       description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--dataset", default="synthetic", metavar="DATASET",
                   help="the dataset to prepare, as run takes it (default: synthetic)")
    add_dataset_flags(p)
    p.add_argument("--output-dir", "--output_dir", "-o", dest="output_dir", required=True,
                   metavar="DIR", help="the folder to write (must not exist)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DIR once the new federation is complete")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress on stderr")
    p.set_defaults(func=cmd_prepare)


def _reporter(enabled: bool):
    """``progress(done, total)`` on stderr: a bar on a terminal, else a line at every
    tenth; and a function closing it."""
    if not enabled:
        return None, lambda: None
    if sys.stderr.isatty():
        from tqdm.auto import tqdm
        bar = tqdm(desc="prepare", unit="client split", leave=False, dynamic_ncols=True)

        def progress(done, total):
            bar.total = total
            bar.update(done - bar.n)
        return progress, bar.close
    shown = [0]

    def progress(done, total):
        tenth = 10 * done // max(total, 1)
        if tenth > shown[0]:
            shown[0] = tenth
            print(f"prepare: {done:,} of {total:,} client splits written ({10 * tenth}%)",
                  file=sys.stderr, flush=True)
    return progress, lambda: None


def cmd_prepare(args) -> int:
    from fedjax_fair.data import DATASETS, get_dataset
    from fedjax_fair.data.disk import write
    from fedjax_fair.hparams import FieldError
    if args.dataset not in DATASETS:
        raise C.ConfigError("dataset", f"unknown name {args.dataset!r}; allowed: "
                                       f"{sorted(DATASETS)}")
    dargs = dataset_args_of(vars(args))
    t = time.perf_counter()
    try:
        ds = get_dataset(args.dataset, **dargs)
    except (ValueError, TypeError) as e:
        raise C.config_error(e, "dataset_args") from None
    progress, close = _reporter(args.progress)
    try:
        out = write(ds, args.output_dir, overwrite=args.overwrite, progress=progress)
    except FieldError as e:
        raise C.ConfigError(e.field, str(e).split(": ", 1)[-1]) from None
    finally:
        close()
    pad = ds.info.get("padding", {}).get("train", {})
    print(f"prepared {ds.name}: {ds.num_clients:,} clients, {pad.get('padded_size', '?')} "
          f"training rows each at most, in {time.perf_counter() - t:.1f}s -> {out}")
    print(f"run it with: fedjax-fair run --dataset disk --dataset-arg path={out}")
    return 0
