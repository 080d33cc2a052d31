"""fedjax_fair: fast, functional simulation of fair federated learning in JAX.

The layers, bottom up (each imports only those beneath it; docs/architecture.md):

* ``hparams`` (the one validation vocabulary: ranges, counts, fractions,
  ``FieldError``), ``models`` (networks behind the ``Model`` interface) and
  ``metrics`` (fairness summaries, calibration): leaves.
* ``core``: the round contract and its engine, naming no method: ``types``
  (ClientData, FederatedData, Cohort, ClientOutput), ``client.local_training``
  (one client's masked local optimisation), ``mixing`` / ``aggregators`` (client
  weights and how deltas combine), ``algorithm.compose`` (a client update, a mixing
  rule, an aggregator and an optax server optimizer as one ``FederatedAlgorithm``),
  ``execution`` (vmap / sequential / chunked / a device mesh), ``client_states``,
  ``evaluation``, ``memory``, ``sharding``.
* ``solvers``: simplex, QP and online solvers.
* ``data``: federations (synthetic, shipped and TFDS / LEAF loaders).
* ``scenarios``: the conditions a method runs under: ``sampling``, ``system``
  (availability, dropouts, a virtual clock), ``heterogeneity`` (step budgets),
  ``schedules``, and what wraps a built method (``with_attack``, ``with_robust``,
  ``with_privacy``: ``attacks``, ``robust``, ``privacy``).
* ``algorithms``: one module per paper, family pieces in ``algorithms.families``,
  the registry in ``algorithms.registry``.
* ``drivers``: ``simulate`` (one ``lax.scan`` over rounds, pure), ``runner``
  (``run``: chunks, the memory plan, evaluation, the run store, the NaN guard),
  ``checkpoint`` (the run store), ``sweeps`` (grids x seeds as one program) and
  ``meta`` (``jax.grad`` through whole runs).
* ``cli``: the ``fedjax-fair`` command.

The names most programs need are exported here: ``compose``, ``run``, ``sweep``,
``make_objective``, ... and the core modules used most (``mixing``, ``aggregators``,
``sampling``, ...), as ``fedjax_fair.mixing`` etc.
"""
# first, before jax: in the fedjax-fair command, a Ctrl-C during this import is one line
from fedjax_fair.core import interrupts as _interrupts

_interrupts.guard_import()

from fedjax_fair import (algorithms, core, data, drivers, hparams, metrics, models, scenarios,
                         solvers)
from fedjax_fair.core import (aggregators, client, client_states, execution, memory, mixing,
                              sharding)
from fedjax_fair.scenarios import heterogeneity, sampling, schedules, system
from fedjax_fair.core.algorithm import (FederatedAlgorithm, ServerState, compose,
                                        with_improvement)
from fedjax_fair.core.client import ClientTraining, local_training, proximal_term
from fedjax_fair.core.evaluation import make_evaluator
from fedjax_fair.core.execution import Execution
from fedjax_fair.core.types import (Broadcast, ClientData, ClientOutput, Cohort,
                                    FederatedData, ServerContext)
from fedjax_fair.drivers import meta, runner, simulate, sweeps
from fedjax_fair.drivers.meta import make_objective, meta_optimize
from fedjax_fair.drivers.programs import make_programs
from fedjax_fair.drivers.spec import RunSpec
from fedjax_fair.drivers.runner import NonFiniteError, RunResult, run
from fedjax_fair.drivers.simulate import make_cohort
from fedjax_fair.drivers.sweeps import SweepResult, sweep

__version__ = "0.1.0"

__all__ = [
    "Broadcast", "ClientData", "ClientTraining", "ClientOutput", "Cohort", "Execution", "FederatedAlgorithm",
    "FederatedData", "NonFiniteError", "RunResult", "RunSpec", "ServerContext", "ServerState",
    "SweepResult", "aggregators", "algorithms", "client", "client_states", "compose", "core",
    "data", "drivers", "execution", "heterogeneity", "hparams", "local_training",
    "make_cohort", "make_evaluator", "make_objective", "make_programs", "memory", "meta", "meta_optimize",
    "metrics", "mixing", "models", "proximal_term", "run", "runner", "sampling",
    "scenarios",
    "schedules",
    "sharding", "simulate", "solvers", "sweep", "sweeps", "system", "with_improvement",
]
