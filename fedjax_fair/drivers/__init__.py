"""The drivers: what runs a ``FederatedAlgorithm`` over rounds.

``spec`` (``RunSpec``: a run's settings as one value, and the checks of a run's
arguments), ``programs`` (``make_programs``: a run's compiled chunk programs, its
evaluator of every client and its memory plan, built from the spec), ``simulate``
(one ``lax.scan`` over rounds: pure, jittable, differentiable), ``runner`` (``run``:
chunks of rounds with the data's placement, evaluation of every client, the NaN
guard and stop requests; ``drive``, the one loop every run goes through, and
``Record``, a run's history and its commits), ``checkpoint`` (the run store: one step
directory per commit), ``sweeps`` (whole runs vmapped over grids of hyper-parameters
and seeds; ``run_seeds``) and ``meta`` (``jax.grad`` through whole runs). They import
the core, the methods, the data and the models beneath them; the command line
(``fedjax_fair.cli``) is built on them.
"""
from fedjax_fair.drivers.programs import Programs, make_programs
from fedjax_fair.drivers.spec import RunSpec

__all__ = ["Programs", "RunSpec", "make_programs"]
