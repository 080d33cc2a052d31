"""The core: the round contract and the engine that plays it, naming no method.

Bottom up: ``types`` (ClientData, FederatedData, Cohort, ClientOutput),
``sharding`` (device meshes), ``memory`` (size buckets, the memory plan),
``client_states`` (per-client tables), ``execution`` (how a round maps its cohort:
vmap, sequential, chunked, over a mesh), ``client`` (one client's masked local
training), ``mixing`` (client weights) and ``aggregators`` (how deltas combine),
``algorithm`` (``compose``: a client update, a mixing rule, an aggregator and an optax
server optimizer as one ``FederatedAlgorithm``, with the ``Scenario`` values that wrap
it) and ``evaluation`` (every client's metrics of a state). It imports only
``hparams`` (the validation vocabulary), ``models`` (the ``Model`` interface) and
``metrics`` beneath it; the scenarios (``fedjax_fair.scenarios``: sampling, system,
step budgets, schedules, attacks, robust rules, privacy), the methods
(``fedjax_fair.algorithms``) and the drivers (``fedjax_fair.drivers``) are built on it.
"""
