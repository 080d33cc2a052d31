"""The argument parser of ``fedjax-fair``: one sub-command per command, flags from
the config dataclasses (``cli.config``), errors as one-line ``ConfigError``s."""
from __future__ import annotations

import argparse
import sys

from fedjax_fair.cli import config as C, options as O
from fedjax_fair.cli.common import _Exit, add_dataset_flags
from fedjax_fair.cli.compare import cmd_compare
from fedjax_fair.cli.listing import LIST_SECTIONS, cmd_list
from fedjax_fair.cli.prepare import add_parser as add_prepare
from fedjax_fair.cli.rebuild import cmd_report
from fedjax_fair.cli.run import cmd_run
from fedjax_fair.cli.sweep import cmd_sweep


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one-line ``ConfigError``s and that never calls sys.exit."""

    def error(self, message):
        # "argument --num-rounds: invalid ..." -> field "num_rounds"
        if message.startswith("argument "):
            head, _, rest = message[len("argument "):].partition(": ")
            field = head.split("/")[0].lstrip("-").replace("-", "_")
            if field.startswith("{"):  # the sub-command positional
                field = "command"
            raise C.ConfigError(field, rest)
        if message.startswith("unrecognized arguments: "):
            message += "".join(O.switch_hint(token) for token in message.split()[2:])
        raise C.ConfigError("arguments", message)

    def exit(self, status=0, message=None):
        if message:
            sys.stderr.write(message)
        raise _Exit(status)





def _add_common(p: argparse.ArgumentParser, cls) -> None:
    """The flags of ``cls.command``: the input syntaxes of the dict options (``--hp``,
    ``--dataset-arg``, ``--model-arg``, ...) and one flag per option (``options.of``)."""
    S = argparse.SUPPRESS
    p.add_argument("--config", metavar="FILE", default=S,
                   help="JSON or YAML file of config fields; flags override it")
    p.add_argument("--hp", metavar="NAME=VALUE", action="append", default=S,
                   help="algorithm hyper-parameter (repeatable)"
                        + (", NAME or ALGORITHM.NAME" if cls is C.CompareConfig else ""))
    p.add_argument("--hparams", metavar="JSON", default=S,
                   help="hyper-parameters as a JSON object, e.g. '{\"mu\": 0.01}'")
    add_dataset_flags(p)
    p.add_argument("--model-arg", "--model_arg", metavar="NAME=VALUE", action="append",
                   default=S, help="model builder argument (repeatable), e.g. groups=32")
    command = cls.command
    for o in O.of(command):  # every option declared once (cli.options)
        default = o.default
        if o.name in ("algorithms", "seeds"):
            default = ",".join(map(str, default)) or "all"
        if o.name == "output_dir":
            default = {"run": "runs/ALGORITHM_DATASET_seedSEED",
                       "sweep": "runs/sweep_ALGORITHM_DATASET"}.get(command,
                                                                    "runs/compare_DATASET")
        text = f"{o.help} (default: {default})".replace("%", "%%")  # argparse formats it
        if o.flag == "":
            p.add_argument(*o.flags, *(["-o"] if o.name == "output_dir" else []), dest=o.name,
                           metavar=o.name.upper(), default=S, help=text)
        elif o.flag:  # a switch: sets the opposite of a true default, else true
            p.add_argument(o.flag, dest=o.name, default=S, help=o.help.replace("%", "%%"),
                           action="store_false" if o.default is True else "store_true")
    p.add_argument("--distributed", dest="distributed", action="store_true", default=S,
                   help="join a multi-host job first (jax.distributed.initialize: SLURM, "
                        "Open MPI and Kubernetes are detected, else JAX_COORDINATOR_ADDRESS, "
                        "JAX_NUM_PROCESSES, JAX_PROCESS_ID); see docs/scaling.md")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fedjax-fair", description="Fast, functional simulation of fair "
                     "federated learning in JAX.", formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog="examples:\n  fedjax-fair compare\n"
                            "  fedjax-fair run --algorithm fedprox --hp mu=0.01 -o runs/prox\n"
                            "  fedjax-fair sweep --algorithm qffl --grid q=0,1,5 "
                            "--grid client_lr=0.01,0.1 --seeds 0-2\n"
                            "  fedjax-fair list algorithms")
    sub = parser.add_subparsers(dest="command",
                                metavar="{run,compare,sweep,report,prepare,list}")

    p = sub.add_parser("run", help="one simulation; writes metrics, plots and a checkpoint",
                       description="Run one federated simulation and write metrics.jsonl, "
                                   "clients.csv, summary.json and plots to the output "
                                   "directory (default runs/ALGORITHM_DATASET_seedSEED).")
    _add_common(p, C.RunConfig)
    S = argparse.SUPPRESS
    p.add_argument("--branch", dest="branch", action="store_true", default=S,
                   help="with --resume: continue from the checkpoint (a diverged run's last "
                        "good evaluation) with changed optimisation settings (learning "
                        "rates, hyper-parameters, schedules, epochs), recorded in "
                        "config.json / summary.json as a branch at that round")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("compare", help="several algorithms x seeds on the same data and budget",
                       description="Run every algorithm (default: all of them) for every seed "
                                   "on the same data and budget, print a table of final "
                                   "per-client accuracy statistics and timings, and save it "
                                   "with overlaid plots. An algorithm's seeds run as one "
                                   "program (fedjax_fair.drivers.sweeps.run_seeds; --sweep-seeds "
                                   "false: one run per seed), except for generative "
                                   "methods, a device mesh (--devices), --placement host, "
                                   "a program larger than the device and a single seed, "
                                   "which run one runner.run per seed; the outputs are the "
                                   "same. With --tune, each method is first searched on a "
                                   "validation split (its paper's grid x a client-rate grid, "
                                   "OUTPUT_DIR/tune/METHOD) with --tune-seeds, and compared "
                                   "at the setting --select picks.")
    _add_common(p, C.CompareConfig)
    p.add_argument("--grid", dest="grid", metavar="METHOD.NAME=V1,V2,...", action="append",
                   default=S, help=O.BY_NAME["grid"].for_command("compare").help
                   + "; e.g. --tune --grid qffl.q=0.1,1,5")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("report", help="tables, figures and report.html of a finished folder "
                                      "again, without computing",
                       description="Write the tables (comparison.md / .csv, sweep.md / "
                                   ".csv), the figures and report.html of a finished (or "
                                   "interrupted) run, compare or sweep folder again from "
                                   "the files it holds; nothing is computed, and the tables "
                                   "are the ones the command wrote, byte for byte.")
    p.add_argument("directory", metavar="DIR", help="the output folder of run, compare or sweep")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("sweep", help="a grid of one algorithm's hyper-parameters x seeds as "
                                     "compiled programs",
                       description="Run a grid of one algorithm's hyper-parameters x seeds "
                                   "(fedjax_fair.drivers.sweeps.sweep): the continuous "
                                   "hyper-parameters of the grid are vmapped inside one "
                                   "compiled program, each combination of the static ones "
                                   "(counts such as batch_size, choices) is a program of its "
                                   "own. Writes sweep.md / sweep.csv (one row per grid point, "
                                   "every summary, mean ± std over seeds), heatmap.png, "
                                   "the setting selected by validation accuracy (when the data "
                                   "has a validation split) in summary.json, and each finished "
                                   "call's per-client metrics in parts/ (--resume continues "
                                   "from them).")
    _add_common(p, C.SweepConfig)
    p.add_argument("--grid", dest="grid", metavar="NAME=V1,V2,...", action="append",
                   default=S, help=O.BY_NAME["grid"].help
                   + "; e.g. --grid q=0,0.5,1 --grid client_lr=0.01,0.03")
    p.set_defaults(func=cmd_sweep)

    add_prepare(sub)

    p = sub.add_parser("list", help="algorithms, datasets, models, strategies, samplers, metrics")
    p.add_argument("what", nargs="*", metavar="SECTION",
                   help=f"any of {', '.join(LIST_SECTIONS)} (default: all)")
    p.set_defaults(func=cmd_list)
    return parser
