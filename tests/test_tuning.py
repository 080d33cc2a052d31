"""drivers/tuning.py: the search spaces of ``compare --tune``, across the registry."""
from __future__ import annotations

import numpy as np
import pytest

from fedjax_fair.algorithms import REGISTRY, method_hparams
from fedjax_fair.drivers import tuning as T
from fedjax_fair.drivers.sweeps import check_grid_ranges
from fedjax_fair.hparams import FieldError


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_method_has_a_search_space_of_its_own_values(name):
    """Every registered method's space names hyper-parameters a value sets, with values
    in their ranges (the sweep's own check), the client rate included where the method
    has one; a method with a registered space says where it comes from."""
    method = REGISTRY[name]
    every = method_hparams(name)
    space = T.search_space(name)
    assert space, name
    for key, values in space.items():
        assert key in every and not every[key].python_only, (name, key)
        assert len(set(values)) == len(values) >= 1
    continuous = {k: np.asarray(v, np.float64) for k, v in space.items()
                  if every[k].continuous}
    check_grid_ranges(name, continuous)
    if method.search_space:
        assert method.search_source, name
    if T.RATE in every and every[T.RATE].default is not None \
            and T.RATE not in dict(method.search_space):
        assert space[T.RATE] == T.rate_grid(every[T.RATE].default)


def test_the_space_is_the_registered_grid_times_the_rate_grid():
    assert T.search_space("qffl") == {"q": [0.1, 1.0, 5.0], "client_lr": [0.01, 0.02, 0.04, 0.08]}
    assert T.search_space("fedavg") == {"client_lr": [0.01, 0.02, 0.04, 0.08]}
    assert T.size(T.search_space("superfed")) == 4 * 3 * 4


def test_fixed_names_are_not_searched_and_overrides_replace_or_add():
    assert T.search_space("qffl", fixed={"client_lr": 0.1}) == {"q": [0.1, 1.0, 5.0]}
    assert T.search_space("qffl", overrides={"q": [0.0, 2.0]})["q"] == [0.0, 2.0]
    added = T.search_space("fedavg", overrides={"num_epochs": [1, 2]})
    assert added == {"client_lr": [0.01, 0.02, 0.04, 0.08], "num_epochs": [1, 2]}
    with pytest.raises(FieldError, match="^grid: "):
        T.search_space("qffl", overrides={"nope": [1]})


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 8, 13])
def test_thinning_fits_the_budget_and_keeps_the_default_point(budget):
    """The product fits the budget, every axis keeps at least one value, and the
    method's default point stays in the grid (the untuned comparison's setting)."""
    for name in ("superfed", "ditto", "fedsoftmax", "afedpd"):
        full = T.search_space(name)
        space = T.search_space(name, budget=budget)
        assert T.size(space) <= budget and set(space) == set(full), (name, space)
        for key, values in space.items():
            assert values and set(values) <= set(full[key])
            assert values == [v for v in full[key] if v in values]  # the grid's order
        assert T.default_point(name, space) is not None, (name, space)


def test_thinning_keeps_the_ends_when_there_is_room():
    space = T.thin({"x": [1, 2, 3, 4, 5, 6, 7]}, 3, {"x": 4})
    assert space == {"x": [1, 4, 7]}
    assert T.thin({"x": [1, 2, 3]}, None) == {"x": [1, 2, 3]}
    for bad in (0, -1, 2.5):
        with pytest.raises(FieldError, match="^tune_budget: "):
            T.thin({"x": [1, 2]}, bad)


def test_points_and_default_point():
    space = {"q": [0.1, 1.0], "client_lr": [0.01, 0.02]}
    assert T.points(space)[1] == {"q": 0.1, "client_lr": 0.02}
    assert len(T.points(space)) == T.size(space) == 4
    assert T.default_point("qffl", space) == {"q": 0.1, "client_lr": 0.02}
    assert T.default_point("qffl", {"q": [1.0, 5.0]}) is None


def _doc_row(name: str) -> str:
    method = REGISTRY[name]
    space = T.search_space(name)
    own = ", ".join(f"`{k}` {{{', '.join(f'{v:g}' for v in values)}}}"
                    for k, values in method.search_space) or "—"
    rate = space.get(T.RATE)
    shown = ("{" + ", ".join(f"{v:g}" for v in rate) + "}"
             if rate and T.RATE not in dict(method.search_space) else "—")
    source = method.search_source or "no grid registered: the client rate only"
    return f"| `{name}` | {own} | {shown} | {T.size(space)} | {source} |"


def test_the_docs_table_of_search_spaces_is_the_registrys():
    """docs/algorithms.md's "Search spaces" table lists every non-generative method's
    space, size and source as the registry states them."""
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[1] / "docs" / "algorithms.md").read_text()
    section = doc.split("## Search spaces of a tuned comparison", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert rows == [_doc_row(n) for n, m in REGISTRY.items() if not m.generative]


def test_tune_from_python_selects_the_best_validation_point():
    """``tuning.tune``: the search as one vmapped sweep on a federation with a held-out
    validation split; the chosen point is the best validation mean of the sweep's own
    summaries, at least the default point's; no validation split is refused."""
    from fedjax_fair.data import get_dataset, hold_out_validation
    from fedjax_fair.models import get_model
    ds = hold_out_validation(get_dataset("synthetic", num_clients=6, max_examples=60), 0.2)
    model = get_model("logreg", ds.input_shape, ds.num_classes)
    tuned = T.tune("qffl", data=ds.host_data, model=model, num_rounds=2, cohort_size=3,
                   seeds=(5, 6), overrides={"q": [0.1, 5.0]},
                   fixed={"batch_size": 10})
    assert tuned.space == {"q": [0.1, 5.0], "client_lr": [0.01, 0.02, 0.04, 0.08]}
    values = np.asarray(tuned.result.summary["validation_accuracy_mean"]).reshape(8, 2)
    means = values.mean(axis=1)
    best = int(np.argmax(means))
    assert tuned.hparams == T.points(tuned.space)[best]
    assert tuned.score[0] == pytest.approx(means[best]) and tuned.key.startswith("validation_")
    default = T.points(tuned.space).index(T.default_point("qffl", tuned.space))
    assert tuned.score[0] >= means[default]
    with pytest.raises(FieldError, match="^data: "):
        T.tune("qffl", data=get_dataset("synthetic", num_clients=6, max_examples=60).host_data,
               model=model, num_rounds=2, cohort_size=3)
