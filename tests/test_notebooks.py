"""Executes every notebook's code cells in one namespace (no Jupyter kernel needed)."""
import json
import pathlib

import numpy as np
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def execute(path) -> dict:
    namespace: dict = {}
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    for i, cell in enumerate(cells):
        assert not cell.get("outputs"), f"{path.name}: stored with outputs"
        exec(compile("".join(cell["source"]), f"{path.name}[cell {i}]", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    namespace = execute(path)
    if path.name.startswith("01_"):
        # The gradient through a whole federated run matches a finite difference.
        np.testing.assert_allclose(namespace["grad"], namespace["fd"], rtol=0.05)
        assert np.all(np.asarray(namespace["accs"]) > 0.1)
