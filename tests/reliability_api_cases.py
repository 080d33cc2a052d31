"""Bad-input cases of the Python API (tests/test_reliability.py runs them): data
(``from_client_arrays``), builders, algorithm factories and ``fedjax_fair.run``."""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

import helpers
from fedjax_fair.core.client import ClientTraining
from fedjax_fair.core.client import ClientTraining as _T
from reliability_common import _add, _bad_values

# ---- Python API: data
def _arrays(sizes=(5, 4, 3)):
    pairs = helpers.client_arrays(list(sizes))
    return [x for x, _ in pairs], [y for _, y in pairs]


def _fca(edit: Callable = lambda a: a, num_classes=3):
    """from_client_arrays on 3 clients after ``edit`` changes its argument dict."""
    def call(ws):
        from fedjax_fair.data.federated import from_client_arrays
        xs, ys = _arrays()
        args = edit({"train_xs": [x.copy() for x in xs], "train_ys": list(ys),
                     "test_xs": [x.copy() for x in xs], "test_ys": list(ys)})
        from_client_arrays(**args, name="mine", num_classes=num_classes)
    return call


def _set(key, index, fn):
    def edit(a):
        a[key][index] = fn(a[key][index])
        return a
    return edit


def _poke(value):
    def fn(x):
        x[1, 2] = value
        return x
    return fn


for shown, call, field, xfail in (
        ("NaN in a client's train inputs", _fca(_set("train_xs", 1, _poke(np.nan))),
         "train_xs", None),
        ("inf in a client's test inputs", _fca(_set("test_xs", 2, _poke(np.inf))),
         "test_xs", None),
        ("labels outside [0, num_classes)", _fca(_set("train_ys", 0, lambda y: y + 5)),
         "train_ys", None),
        ("negative labels", _fca(_set("test_ys", 1, lambda y: y - 5)), "test_ys", None),
        ("float labels 0.5, 1.5, ...", _fca(_set("train_ys", 0, lambda y: y + 0.5)),
         "train_ys", None),
        ("2-D labels [n, 1]", _fca(_set("train_ys", 0, lambda y: y[:, None])), "train_ys",
         None),
        ("num_classes=0", _fca(num_classes=0), "num_classes", None),
        ("num_classes=2.5", _fca(num_classes=2.5), "num_classes", None),
        ("train and test with different client counts",
         _fca(lambda a: {**a, "test_xs": a["test_xs"][:2], "test_ys": a["test_ys"][:2]}),
         "num_clients", None),
        ("a client with more inputs than labels", _fca(_set("train_ys", 0, lambda y: y[:2])),
         "train_xs", None),
        ("clients with different input shapes", _fca(_set("train_xs", 1, lambda x: x[:, :5])),
         "train_xs", None),
        ("no clients at all", _fca(lambda a: {k: [] for k in a}), "num_clients", None),
        ("every client empty", _fca(lambda a: {
            **a, "train_xs": [np.zeros((0, 10), np.float32)] * 3,
            "train_ys": [np.zeros(0, np.int32)] * 3}), "train", None)):
    _add(11, f"api:from_client_arrays {shown}", f"`from_client_arrays(...)` with {shown}",
         "Python: `fedjax_fair.data.federated.from_client_arrays`", field, call=call,
         xfail=xfail)

# ---- Python API: builders and fedjax_fair.run
def _run_with(overrides):
    """fedjax_fair.run of FedAvg on helpers.tiny_federation (6 clients, cohort 3, 2
    rounds) with ``overrides`` (``algorithm``: model -> algorithm)."""
    import jax
    import fedjax_fair as ff
    model = helpers.logreg()
    make = overrides.pop("algorithm", None)
    alg = make(model) if make else ff.algorithms.fedavg(model, training=_T(batch_size=4))
    key = overrides.pop("key", jax.random.key(0))
    if overrides.get("sampler") == "full":
        overrides["sampler"] = ff.sampling.full
    data = overrides.pop("data", None) or helpers.tiny_federation()
    args = dict(model=model, num_rounds=2, cohort_size=3, eval_every=1, progress=False)
    args.update(overrides)
    ff.run(alg, helpers.init_params(model), data, key, **args)


def _lazy2(model):
    import fedjax_fair as ff
    return ff.algorithms.feddyn(model, training=_T(batch_size=4), client_table="lazy:2")


def _adam_string(model):
    import fedjax_fair as ff
    return ff.algorithms.fedavg(model, training=ClientTraining(optimizer="adam"))


for shown, overrides, field, raises, xfail in (
        ("cohort_size=0", {"cohort_size": 0}, "cohort_size", None, None),
        ("cohort_size=-1", {"cohort_size": -1}, "cohort_size", None, None),
        ("cohort_size=7 (6 clients)", {"cohort_size": 7}, "cohort_size", None, None),
        ("cohort_size=2.5", {"cohort_size": 2.5}, "cohort_size", None, None),
        ("num_rounds=0", {"num_rounds": 0}, "num_rounds", None, None),
        ("eval_every=0", {"eval_every": 0}, "eval_every", None, None),
        ("placement='gpu'", {"placement": "gpu"}, "placement", None, None),
        ("execution='nope'", {"execution": "nope"}, "execution", None, None),
        ("sampler=sampling.full with cohort_size=3 of 6", {"sampler": "full"},
         "cohort_size", None, None),
        ("a lazy client table of 2 slots for 6 clients", {"algorithm": _lazy2},
         "client_table", None, None),
        ("resume=True without a checkpoint_dir", {"resume": True}, "resume",
         (FileNotFoundError,), None),
        ("resume=True on an empty checkpoint_dir",
         {"resume": True, "checkpoint_dir": "/nonexistent/ckpt"}, "resume",
         (FileNotFoundError,), None),
        ("key=0 (an int, not a jax.random.key)", {"key": 0}, "key", None, None),
        ("step_budgets='fixed:2' (CLI text)", {"step_budgets": "fixed:2"}, "step_budgets",
         None, None),
        ("fedavg(training=ClientTraining(optimizer='adam'))", {"algorithm": _adam_string},
         "training.optimizer",
         None, None)):
    _add(12, f"api:run {shown}", f"`fedjax_fair.run(...)` with {shown}",
         "Python: `fedjax_fair.run`", field,
         call=lambda ws, o=overrides: _run_with(dict(o)),
         raises=raises or (ValueError, TypeError), xfail=xfail)


def _run_mismatched(params_of: str, model_input: Optional[int] = None) -> Callable:
    """fedjax_fair.run of FedAvg on helpers.tiny_federation with the parameters of
    model ``params_of`` (logreg / mlp), or a logistic regression on inputs of
    ``model_input`` features (the data has helpers.NUM_FEATURES)."""
    def call(ws):
        import jax
        import fedjax_fair as ff
        from fedjax_fair.models import get_model
        shape = (model_input,) if model_input else (helpers.NUM_FEATURES,)
        model = get_model("logreg", shape, helpers.NUM_CLASSES)
        params = helpers.init_params(get_model(params_of, shape, helpers.NUM_CLASSES))
        alg = ff.algorithms.fedavg(model, training=_T(batch_size=4))
        ff.run(alg, params, helpers.tiny_federation(), jax.random.key(0), model=model,
               num_rounds=2, cohort_size=3, eval_every=1, progress=False)
    return call


for shown, fn, field in (
        ("the parameters of an MLP for a logistic regression", _run_mismatched("mlp"),
         "params"),
        ("a logistic regression of 7 inputs on data of 10 features",
         _run_mismatched("logreg", model_input=7), "data")):
    _add(12, f"api:run {shown}", f"`fedjax_fair.run(...)` with {shown}",
         "Python: `fedjax_fair.run`", field, call=fn)


def _run_reshaped_params(ws):
    """fedjax_fair.run with the logistic regression's kernel cut to 3 rows."""
    import jax
    import fedjax_fair as ff
    model = helpers.logreg()
    params = jax.tree.map(lambda x: x[:3], helpers.init_params(model))
    ff.run(ff.algorithms.fedavg(model, training=_T(batch_size=4)), params,
           helpers.tiny_federation(), jax.random.key(0), model=model, num_rounds=2,
           cohort_size=3, eval_every=1, progress=False)


_add(12, "api:run params of another shape", "`fedjax_fair.run(...)` with a kernel of "
     "another shape", "Python: `fedjax_fair.run`", "params", call=_run_reshaped_params)


def _factory_case(algorithm: str, name: str, value) -> Callable:
    def call(ws):
        from fedjax_fair.algorithms import REGISTRY
        REGISTRY[algorithm].factory(helpers.logreg(), **{name: value})
    return call


def _generate_factory_cases() -> None:
    from fedjax_fair.algorithms import REGISTRY
    from fedjax_fair.cli import config as C
    for algorithm in REGISTRY:
        ranged = [(n, h) for n, h in C.algorithm_hparams(algorithm).items() if h.range]
        name, h = ranged[0]
        text = _bad_values(h.range)[0][0]
        value = int(text) if h.range.integer else float(text)
        _add(12, f"api:{algorithm}({name}={text})", f"`{algorithm}(model, {name}={text})`",
             "Python: algorithm factory", name, call=_factory_case(algorithm, name, value))


_generate_factory_cases()


def _call(fn: Callable) -> Callable:
    return lambda ws: fn()


def _ff():
    import fedjax_fair as ff
    return ff


for shown, fn, field, xfail in (
        ("fedprox(model, muu=0.1) (a misspelled keyword)",
         lambda: _ff().algorithms.fedprox(helpers.logreg(), muu=0.1), "muu", None),
        ("fedavg(model, training=ClientTraining(lr=0))",
         lambda: _ff().algorithms.fedavg(helpers.logreg(), training=_T(lr=0.0)),
         "training.lr", None),
        ("fedavg(model, training=ClientTraining(batch_size=0))",
         lambda: _ff().algorithms.fedavg(helpers.logreg(), training=_T(batch_size=0)),
         "training.batch_size", None),
        ("fedavg(model, training=ClientTraining(num_epochs=0))",
         lambda: _ff().algorithms.fedavg(helpers.logreg(), training=_T(num_epochs=0)),
         "training.num_epochs", None),
        ("local_training(model, ClientTraining(batch_size=0))",
         lambda: _ff().local_training(helpers.logreg(), _T(batch_size=0)),
         "training.batch_size", None),
        ("local_training(model, ClientTraining(lr=-1))",
         lambda: _ff().local_training(helpers.logreg(), _T(lr=-1.0)),
         "training.lr", None),
        ("local_training(model, ClientTraining(batch_size=10.5))",
         lambda: _ff().local_training(helpers.logreg(), _T(batch_size=10.5)),
         "training.batch_size", None),
        ("fedavg(model, training=ClientTraining(lr=1e-50)) (0 in float32)",
         lambda: _ff().algorithms.fedavg(helpers.logreg(), training=_T(lr=1e-50)),
         "training.lr", None),
        ("compose(clients, mixing='uniform')",
         lambda: _ff().compose(_ff().local_training(helpers.logreg(), _T(batch_size=2)), mixing="uniform"),
         "mixing", None),
        ("compose(clients, server_optimizer=optax.adam) (not called)",
         lambda: _ff().compose(_ff().local_training(helpers.logreg(), _T(batch_size=2)),
                               server_optimizer=__import__("optax").adam),
         "server_optimizer", None),
        ("proximal_term(-1)", lambda: _ff().proximal_term(-1.0), "mu", None),
        ("client_states.lazy(capacity=0)", lambda: _ff().client_states.lazy(0), "capacity",
         None),
        ("client_states.get_table('lazy:x')",
         lambda: _ff().client_states.get_table("lazy:x"), "client_table", None),
        ("parse_schedule('exponential:2')",
         lambda: __import__("fedjax_fair.cli.parsing", fromlist=["parse"]).parse_schedule(
             "exponential:2", "client_lr_schedule"), "client_lr_schedule", None),
        ("parse_budgets('uniform:3:1')",
         lambda: __import__("fedjax_fair.cli.parsing", fromlist=["parse"]).parse_budgets(
             "uniform:3:1"), "step_budgets", None),
        ("get_dataset('synthetic', num_clients=0)",
         lambda: __import__("fedjax_fair.data", fromlist=["get_dataset"]).get_dataset(
             "synthetic", num_clients=0), "num_clients", None),
        ("get_model('nope', (4,), 3)",
         lambda: __import__("fedjax_fair.models", fromlist=["get_model"]).get_model(
             "nope", (4,), 3), "model", None)):
    _add(12, f"api:{shown}", f"`{shown}`", "Python", field, call=_call(fn), xfail=xfail)


# ---- Python API: arguments of the wrong kind (issue 47: each error names the argument)
def _qffl_vector_q(ws):
    import jax.numpy as jnp
    _ff().algorithms.qffl(helpers.logreg(), q=jnp.asarray([0.1, 1.0]))


def _as_dataset(ws):
    """A data.Dataset (what get_dataset returns) where a FederatedData is expected."""
    from fedjax_fair.data import get_dataset
    _run_with({"data": get_dataset("synthetic", num_clients=6)})


def _sweep_params_of_another_model(ws):
    import fedjax_fair as ff
    from fedjax_fair.models import get_model
    mlp = get_model("mlp", (helpers.NUM_FEATURES,), helpers.NUM_CLASSES)
    ff.sweep(lambda lr: ff.algorithms.fedavg(helpers.logreg(), training=_T(lr=lr, batch_size=4)),
             {"lr": [0.1, 0.2]}, data=helpers.tiny_federation(), num_rounds=2, cohort_size=3,
             model=helpers.logreg(), params=helpers.init_params(mlp))


for shown, call, field in (
        ("qffl(model, q=jnp.asarray([0.1, 1.0])) (a vector q)", _qffl_vector_q, "q"),
        ("model=None", lambda ws: _run_with({"model": None}), "model"),
        ("a data.Dataset as the federation", _as_dataset, "data"),
        ("checkpoint_dir naming a file",
         lambda ws: _run_with({"checkpoint_dir": ws.write("a_file", "x")}), "checkpoint_dir"),
        ("sampler=5 (neither a sampler nor its name)", lambda ws: _run_with({"sampler": 5}),
         "sampler"),
        ("sampler='nope' (an unknown name)", lambda ws: _run_with({"sampler": "nope"}),
         "sampler"),
        ("sweep(..., params=) of another model", _sweep_params_of_another_model, "params")):
    _add(12, f"api:{shown}", f"`{shown}`", "Python", field, call=call)
