"""The drivers: what runs a ``FederatedAlgorithm`` over rounds.

``simulate`` (one ``lax.scan`` over rounds: pure, jittable, differentiable),
``runner`` (``run``: chunks of rounds with the memory plan, the data's placement,
evaluation of every client, the NaN guard and stop requests; ``drive``, the one loop
every run goes through, and ``Record``, a run's history and its commits),
``checkpoint`` (the run store: one step directory per commit), ``sweeps`` (whole runs
vmapped over grids of hyper-parameters and seeds; ``run_seeds``) and ``meta``
(``jax.grad`` through whole runs). They import the core, the methods, the data and the
models beneath them; the command line (``fedjax_fair.cli``) is built on them.
"""
