"""fedjax_fair: fast, functional simulation of fair federated learning in JAX.

The pieces, bottom up (DESIGN.md, docs/architecture.md):

* ``types``: ClientData, FederatedData, Cohort, ClientOutput.
* ``client.local_training``: one client's masked local optimisation.
* ``mixing`` / ``aggregators``: client weights and how deltas are combined.
* ``compose``: wires a client update, mixing rule, aggregator and optax server
  optimizer into a ``FederatedAlgorithm(init, apply)``.
* ``simulate.simulate`` (one ``lax.scan`` over rounds, pure) and ``runner.run``
  (chunks, memory plan, evaluation, checkpoints, the NaN guard, progress).
* ``client_states``: per-client tables (dense, lazy); ``solvers``: simplex, QP and
  online solvers; ``hparams``: the ranges every factory states.
* ``algorithms``, ``models``, ``data``, ``metrics``: methods, networks, federations
  and fairness summaries.
* ``heterogeneity``: per-round local-step budgets; ``memory``: size buckets, the
  memory plan and ``MemoryBudgetError``.
* ``sharding``: cohorts split over a device mesh's ``clients`` axis
  (``Execution(mesh=sharding.make_mesh())``), multi-host start-up.
* ``sweep``: whole runs vmapped over seeds and grids of continuous
  hyper-parameters in one program (``sweep.sweep`` -> ``SweepResult``;
  ``sweep.run_seeds``, the seeds of ``fedjax-fair compare``); ``meta``:
  ``jax.grad`` of a validation objective through whole runs (``make_objective``,
  ``meta_optimize``; docs/meta.md).
"""
from fedjax_fair import (aggregators, algorithms, client, client_states, data, heterogeneity,
                         hparams, memory, meta, metrics, mixing, models, runner, sampling,
                         sharding, simulate, solvers)
from fedjax_fair import sweep as sweeps  # the module; ``sweep`` below is its function
from fedjax_fair.algorithm import FederatedAlgorithm, ServerState, compose, with_improvement
from fedjax_fair.client import local_training, proximal_term
from fedjax_fair.evaluation import make_evaluator
from fedjax_fair.execution import Execution
from fedjax_fair.runner import NonFiniteError, RunResult, run
from fedjax_fair.simulate import make_cohort
from fedjax_fair.meta import make_objective, meta_optimize
from fedjax_fair.sweep import SweepResult, sweep
from fedjax_fair.types import Broadcast, ClientData, ClientOutput, Cohort, FederatedData, ServerContext

__version__ = "0.1.0"

__all__ = [
    "Broadcast", "ClientData", "ClientOutput", "Cohort", "Execution", "FederatedAlgorithm",
    "FederatedData", "NonFiniteError", "RunResult", "ServerContext", "ServerState",
    "SweepResult", "aggregators", "algorithms", "client", "client_states", "compose", "data",
    "heterogeneity", "hparams", "local_training", "make_cohort", "make_evaluator",
    "make_objective", "memory", "meta", "meta_optimize", "metrics", "mixing", "models",
    "proximal_term", "run", "runner", "sampling", "sharding", "simulate", "solvers", "sweep",
    "sweeps", "with_improvement",
]
