"""docs/new_method.md and docs/architecture.md stay true.

* Every ```python block of a page is executed, in order, in one namespace per page (as a
  reader would paste them). new_method.md's blocks define a whole method
  (``lossprop``: p_k ∝ n_k F_k^alpha) and run it with ``fedjax_fair.run``. The checks
  here read that namespace: the run's evaluations, finite accuracies, the logged
  weights on the simplex, and the test functions the page proposes, which are called.
* The page's registration (a ```diff block, never executed) is tried against a
  temporary copy of the registry entry. It must give the ``docs/meta.md`` row the page
  states, and the real registry must stay untouched.
* Every relative link of both pages points to a file in the repository.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from fedjax_fair import algorithms
from fedjax_fair.algorithms import ClientTraining
from fedjax_fair.algorithms import registry

DOCS = Path(__file__).resolve().parent.parent / "docs"
NEW_METHOD = DOCS / "new_method.md"
ARCHITECTURE = DOCS / "architecture.md"
PAGES = (NEW_METHOD, ARCHITECTURE)


def code_blocks(text: str, lang: str) -> list[str]:
    """Bodies of the fenced code blocks of ``text`` whose info string is ``lang``."""
    return re.findall(rf"^```{lang}(?:[ \t][^\n]*)?\n(.*?)^```", text, flags=re.M | re.S)


def test_block_extraction_takes_only_the_language_asked_for():
    text = ("```python\nx = 1\n```\nprose\n```diff\n+y = 2\n```\n"
            "```python title\nz = 3\n```\n```pythonic\nw = 4\n```\n")
    assert code_blocks(text, "python") == ["x = 1\n", "z = 3\n"]
    assert code_blocks(text, "diff") == ["+y = 2\n"]


def _run_page(page: Path) -> dict:
    namespace: dict = {"__name__": f"docs_{page.stem}_snippets"}
    for body in code_blocks(page.read_text("utf-8"), "python"):
        exec(compile(body, str(page), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def new_method() -> dict:
    return _run_page(NEW_METHOD)


def test_architecture_snippets_run():
    """architecture.md's Python blocks (if it has any) run as written."""
    _run_page(ARCHITECTURE)


# --------------------------------------------------------------------- new_method.md


def test_the_page_defines_the_method_in_python_and_registers_it_only_in_a_diff():
    text = NEW_METHOD.read_text("utf-8")
    python = code_blocks(text, "python")
    assert len(python) >= 4
    assert not any("REGISTRY" in body for body in python), "snippets must not register"
    (diff,) = code_blocks(text, "diff")
    assert 'register("lossprop", lossprop, HPARAMS, family="fair")' in diff
    assert "registry.py" not in diff and "__init__.py" not in diff  # one new module


def test_the_run_finished_with_every_evaluation(new_method):
    ds, results = new_method["ds"], new_method["results"]
    assert set(results) == {"fedavg", "lossprop"}
    for name, result in results.items():
        assert [h["round"] for h in result.history] == [0, 10, 20], name
        for entry in result.history:
            for key in ("accuracy_mean", "accuracy_worst_10%"):
                assert 0.0 <= entry[key] <= 1.0, (name, entry)
        accuracy = np.asarray(result.client_metrics["accuracy"])
        assert accuracy.shape == (ds.num_clients,) and np.isfinite(accuracy).all(), name
        assert int(result.state.round) == 20, name
        # training moved the model: the last evaluation differs from the first
        assert result.history[-1]["test_loss"] < result.history[0]["test_loss"], name


def test_the_methods_weights_are_on_the_simplex_every_round(new_method):
    weights = np.asarray(new_method["round_weights"])
    assert weights.shape == (20, 10)
    assert (weights >= 0).all()
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-5)
    # loss-proportional weights differ from FedAvg's n_k / n on some round
    fedavg = np.asarray(new_method["results"]["fedavg"].rounds["weights"])
    assert not np.allclose(weights, fedavg, atol=1e-3)
    hand_made = np.asarray(new_method["weights"])  # section 1's cohort
    np.testing.assert_allclose(hand_made.sum(), 1.0, rtol=1e-6)
    assert hand_made[2] == 0.0 and hand_made[3] == 0.0


def test_the_tests_the_page_proposes_pass(new_method):
    proposed = sorted(k for k, v in new_method.items() if k.startswith("test_") and callable(v))
    assert proposed == ["test_lossprop_weights_equal_the_formula",
                        "test_the_first_rounds_weights_are_the_formula"]
    for name in proposed:
        new_method[name]()


def test_the_factory_streams_and_checks_its_arguments(new_method):
    lossprop, model = new_method["lossprop"], new_method["model"]
    assert lossprop(model).streamed
    with pytest.raises(ValueError, match="^alpha: "):
        lossprop(model, alpha=-1.0)
    with pytest.raises(TypeError, match="^training.optimizer: "):
        lossprop(model, training=ClientTraining(optimizer="adam"))
    with pytest.raises(TypeError, match="^server_optimizer: "):
        lossprop(model, server_optimizer="adam")


def _meta_row(diff: str) -> tuple[list, list]:
    (row,) = [line[1:] for line in diff.splitlines() if line.startswith("+| `lossprop`")]
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    return re.findall(r"`(\w+)`", cells[1]), re.findall(r"`(\w+)`", cells[2])


def test_the_registration_gives_the_stated_meta_row(new_method):
    """The diff's registry entry, applied to a patched registry, yields the docs/meta.md
    row the diff adds (the table tests/test_meta.py checks) and the shared options the
    registry-wide tests demand; the real registry has no such entry."""
    assert "lossprop" not in algorithms.REGISTRY
    with registry.isolated():
        registry.register("lossprop", new_method["lossprop"], new_method["HPARAMS"],
                          family="fair")
        hps = algorithms.method_hparams("lossprop")
    assert "lossprop" not in algorithms.REGISTRY
    continuous, static = _meta_row(code_blocks(NEW_METHOD.read_text("utf-8"), "diff")[0])
    assert continuous == [k for k, h in hps.items() if h.continuous]
    assert static == [k for k, h in hps.items() if h.range is not None and not h.continuous]
    assert hps["clip_norm"].default is None and hps["clip_mode"].default == "step"
    assert hps["client_optimizer"].python_only and hps["server_optimizer"].python_only
    assert hps["alpha"].range is not None and hps["alpha"].continuous


# ------------------------------------------------------------------------ both pages


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_point_into_the_repository(page):
    root = DOCS.parent.resolve()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text("utf-8"))
    assert links, page.name
    for link in links:
        assert "://" not in link, f"{page.name}: external link {link}"
        target = (page.parent / link).resolve()
        assert target.is_relative_to(root), f"{page.name}: {link} leaves the repository"
        assert target.exists(), f"{page.name}: {link} does not exist"
