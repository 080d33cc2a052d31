"""Procedural federations (fedjax_fair/data/generated.py): client rows computed from
(seed, client id) inside the round give the same rounds as the same rows held in
memory, for every registered method; evaluation over a generated split, a subset
(``eval_clients``) and the command line."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import helpers
from fedjax_fair import runner
from fedjax_fair.algorithms import REGISTRY, build, get_method
from fedjax_fair.core.evaluation import make_evaluator
from fedjax_fair.core.execution import Execution
from fedjax_fair.core.types import FederatedData
from fedjax_fair.data import femnist_like, generated, synthetic
from fedjax_fair.drivers.simulate import simulate
from fedjax_fair.hparams import FieldError
from fedjax_fair.models import get_model

SYNTH = synthetic(num_clients=8, max_examples=60, procedural=True, seed=3)
SYNTH_MODEL = get_model("logreg", (60,), 10)


def stored(ds) -> FederatedData:
    """The generated federation ``ds`` with every row computed and held in memory."""
    return FederatedData(train=generated.materialize(ds.host_data.train),
                         test=generated.materialize(ds.host_data.test))


def test_a_client_depends_on_its_id_alone():
    """Client k's rows are the same whatever N, cohort or order it is drawn in, and
    ``take`` pads like a stored federation: real rows first, then zeros."""
    small = femnist_like(num_clients=5, min_examples=3, max_examples=9, test_examples=2,
                         procedural=True, seed=7)
    large = femnist_like(num_clients=50, min_examples=3, max_examples=9, test_examples=2,
                         procedural=True, seed=7)
    a = generated.materialize(small.host_data.train)
    b = generated.materialize(large.host_data.train, [4, 0, 2, 1, 3])
    order = [4, 0, 2, 1, 3]
    m = a.mask.shape[1]
    for k, row in enumerate(order):  # the padded size is the largest client of each
        n = int(a.num_examples[row])
        assert int(b.num_examples[k]) == n
        np.testing.assert_array_equal(b.examples["x"][k, :n], a.examples["x"][row, :n])
        np.testing.assert_array_equal(b.examples["y"][k, :n], a.examples["y"][row, :n])
        assert not b.examples["x"][k, n:].any() and not a.examples["x"][row, n:m].any()
    assert a.mask.sum() == a.num_examples.sum()
    other = generated.materialize(femnist_like(num_clients=5, min_examples=3, max_examples=9,
                                               test_examples=2, procedural=True,
                                               seed=8).host_data.train)
    assert not np.array_equal(other.examples["x"], a.examples["x"])


def test_the_generated_data_follow_the_generative_models():
    """Synthetic: sizes in [50, cap] split 90/10 with at least one training row, labels
    the argmax of each client's own linear model; FEMNIST-like: sizes in
    [min, max], inputs of about unit variance, labels over every class."""
    tr, te = SYNTH.host_data.train, SYNTH.host_data.test
    total = np.asarray(tr.num_examples) + np.asarray(te.num_examples)
    assert ((total >= 50) & (total <= 60)).all()
    np.testing.assert_array_equal(np.asarray(tr.num_examples), np.floor(0.9 * total + 1e-9))
    rows = generated.materialize(tr)
    assert set(np.unique(rows.examples["y"][rows.mask])) <= set(range(10))
    ds = femnist_like(num_clients=300, min_examples=4, max_examples=6, procedural=True)
    sizes = np.asarray(ds.host_data.train.num_examples)
    assert sizes.min() == 4 and sizes.max() == 6
    rows = generated.materialize(ds.host_data.train)
    x = rows.examples["x"][rows.mask]
    assert 0.8 < x.std() < 1.2 and abs(x.mean()) < 0.1
    assert len(np.unique(rows.examples["y"][rows.mask])) == 62
    assert ds.info["procedural"] and ds.info["padding"]["train"]["generated"]


def _model_for(name):
    if name in ("lg_fedavg", "fedper", "fedrep"):  # keep a layer local: need two
        model = get_model("mlp", (60,), 10, hidden=(4,))
        return model, model.init(jax.random.key(0))
    return SYNTH_MODEL, SYNTH_MODEL.init(jax.random.key(0))


FAST = ("fedavg", "qffl", "scaffold", "ditto", "aaggff_d", "dqn_fed", "fedcvae")


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(REGISTRY)])
def test_every_method_runs_the_same_rounds_on_generated_and_stored_rows(name):
    """Two rounds of every registered method on the generated federation and on its
    rows held in memory: the same server state, to float rounding. (The programs
    differ: XLA compiles the rows' generator into the round, and may round a value
    of it differently from the program that materialised the rows: compiled with
    XLA's defaults all 46 methods came out bit-identical; under this suite's fast
    compile flags (tests/conftest.py) FedCVAE's decoder differed by 4e-5 relative in
    one entry of 256.)"""
    model, params = _model_for(name)
    alg = helpers.bind_execution(build(name, model), Execution("sequential"))
    full = get_method(name).participation == "full"
    n = SYNTH.num_clients

    def two_rounds(data):
        state = alg.init(params, n)
        return jax.jit(lambda s, d, k: simulate(alg, s, d, k, num_rounds=2,
                                                cohort_size=n if full else 4))(
            state, data, jax.random.key(1))

    a, _ = two_rounds(SYNTH.host_data)
    b, _ = two_rounds(stored(SYNTH))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-7)


def test_runner_on_a_generated_federation_equals_the_stored_one():
    """``runner.run``: the same parameters to the bit, and the same per-client test
    metrics to float rounding (the evaluation programs differ: the generated split's
    rows are computed per chunk of clients)."""
    ds = femnist_like(num_clients=30, min_examples=3, max_examples=8, test_examples=2,
                      procedural=True)
    model = get_model("mlp", ds.input_shape, ds.num_classes, hidden=(16,))
    params, alg = model.init(jax.random.key(0)), build("fedavg", model)
    runs = [runner.run(alg, params, data, jax.random.key(2), model=model, num_rounds=4,
                       cohort_size=7, eval_every=2, progress=False)
            for data in (ds.host_data, stored(ds))]
    for x, y in zip(jax.tree.leaves(runs[0].state.params), jax.tree.leaves(runs[1].state.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for k in ("accuracy", "loss", "num_examples"):
        np.testing.assert_allclose(runs[0].client_metrics[k], runs[1].client_metrics[k],
                                   rtol=1e-5, atol=1e-6)
    assert runs[0].memory.generated and not runs[1].memory.generated
    assert "generated in the round" in runs[0].memory.describe()


def test_the_evaluator_computes_the_rows_of_the_ids_it_is_given():
    ds = femnist_like(num_clients=12, min_examples=2, max_examples=5, test_examples=3,
                      procedural=True)
    model = get_model("mlp", ds.input_shape, ds.num_classes, hidden=(8,))
    params = model.init(jax.random.key(0))
    every = make_evaluator(model)(params, ds.host_data.test)
    ids = np.array([9, 2, 5], np.int32)
    some = make_evaluator(model)(params, ds.host_data.test, ids)
    held = make_evaluator(model)(params, generated.materialize(ds.host_data.test))
    for k in ("accuracy", "loss", "num_examples"):
        np.testing.assert_allclose(np.asarray(some[k]), np.asarray(every[k])[ids], rtol=1e-6)
        np.testing.assert_allclose(np.asarray(every[k]), np.asarray(held[k]), rtol=1e-5)


def test_eval_clients_evaluates_a_fixed_subset_until_the_final_evaluation():
    """Intermediate evaluations cover the same ``eval_clients`` clients (their
    summaries over them), the last covers everyone; the per-client history keeps the
    subset's rows with their ids, and equals the full run's rows at those clients."""
    from fedjax_fair.drivers.spec import eval_subset
    data, model, params = helpers.ENGINE_DATA, helpers.ENGINE_MODEL, helpers.ENGINE_PARAMS
    alg = build("fedavg", model)
    kw = dict(model=model, num_rounds=4, cohort_size=3, eval_every=2, progress=False)
    full = runner.run(alg, params, data, jax.random.key(0), **kw)
    part = runner.run(alg, params, data, jax.random.key(0), eval_clients=3, **kw)
    ids = eval_subset(data.num_clients, 3)
    assert len(ids) == 3 and np.array_equal(ids, np.sort(ids))
    np.testing.assert_array_equal(part.client_history["client_ids"], ids)
    assert part.client_history["accuracy"].shape == (3, 3)
    np.testing.assert_allclose(part.client_history["accuracy"],
                               full.client_history["accuracy"][:, ids], rtol=1e-6)
    assert [h["clients_evaluated"] for h in part.history] == [3, 3, data.num_clients]
    assert part.history[-1]["accuracy_mean"] == pytest.approx(full.history[-1]["accuracy_mean"])
    assert len(part.client_metrics["accuracy"]) == data.num_clients
    with pytest.raises(ValueError, match="^eval_clients"):
        runner.run(alg, params, data, jax.random.key(0), eval_clients=data.num_clients + 1,
                   **kw)


def test_rows_are_refused_where_a_federation_must_be_held():
    from fedjax_fair.data import hold_out_validation, resplit
    for call, field in ((lambda: resplit(SYNTH), "resplit"),
                        (lambda: hold_out_validation(SYNTH, 0.1), "validation_fraction")):
        with pytest.raises(FieldError) as e:
            call()
        assert e.value.field == field and "\n" not in str(e.value)
    with pytest.raises(FieldError, match="max_examples"):
        synthetic(num_clients=4, max_examples=None, procedural=True)


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fedjax_fair.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def test_the_command_line_runs_and_resumes_a_procedural_federation(tmp_path):
    """``fedjax-fair run`` on a procedural federation says so, evaluates a subset
    in between, and a run resumed half-way writes what the uninterrupted run writes."""
    common = ["run", "--dataset", "femnist_like", "--dataset-arg", "procedural=true",
              "--dataset-arg", "min_examples=10", "--dataset-arg", "max_examples=20", "--num-clients", "300", "--model", "mlp",
              "--cohort-size", "8", "--eval-every", "2", "--eval-clients", "40",
              "--no-progress", "--no-plots", "--devices", "1"]
    whole = _cli(*common, "--num-rounds", "4", "-o", str(tmp_path / "whole"), cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    assert "computed from (seed, client id)" in whole.stdout
    half = _cli(*common, "--num-rounds", "2", "-o", str(tmp_path / "half"), cwd=tmp_path)
    assert half.returncode == 0, half.stderr
    rest = _cli("run", "--resume", "--num-rounds", "4", "--no-progress", "-o",
                str(tmp_path / "half"), cwd=tmp_path)
    assert rest.returncode == 0, rest.stderr
    for name in ("clients.csv",):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "half" / name).read_bytes()
    final = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").open()]
    assert [e["clients_evaluated"] for e in final] == [40, 40, 300]
    bad = _cli(*common, "--num-rounds", "1", "--eval-clients", "301", "-o",
               str(tmp_path / "bad"), cwd=tmp_path)
    assert bad.returncode == 2 and "eval_clients" in bad.stderr
    assert not os.path.exists(tmp_path / "bad" / "summary.json")


def test_per_client_statistics_of_a_generated_split_equal_the_stored_ones():
    """``system.label_share`` (a property availability can follow) reads a generated
    split a block of clients at a time; the same shares as its rows held in memory."""
    from fedjax_fair.core.generated import client_blocks
    from fedjax_fair.scenarios.system import label_share
    held = stored(SYNTH)
    np.testing.assert_array_equal(label_share(SYNTH.host_data.train, [0, 1]),
                                  label_share(held.train, [0, 1]))
    blocks = list(client_blocks(SYNTH.host_data.train, size=3))
    assert [len(ids) for ids, _ in blocks] == [3, 3, 2]
    np.testing.assert_array_equal(np.concatenate([r.examples["x"] for _, r in blocks]),
                                  held.train.examples["x"])
