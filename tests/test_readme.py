"""The README's Python examples run as written (in order, in one namespace)."""
import pathlib
import re

import jax

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_examples_run():
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text("utf-8"), flags=re.M | re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md[python {i}]", "exec"), namespace)
    result, algorithm = namespace["result"], namespace["algorithm"]
    assert result.history[-1]["round"] == 100
    # The plug-and-play example builds a working round: AAggFF-D weights on FedProx.
    ds, model = namespace["ds"], namespace["model"]
    state = algorithm.init(model.init(jax.random.key(0)), ds.num_clients)
    from fedjax_fair.drivers.simulate import simulate
    _, metrics = simulate(algorithm, state, ds.data, jax.random.key(1), num_rounds=2,
                          cohort_size=5)
    assert abs(float(metrics["weights"][-1].sum()) - 1.0) < 1e-5
    # The sweep over q runs as one program, one result per value.
    sweep = namespace["sweep"]
    assert all(leaf.shape[0] == 4 for leaf in jax.tree.leaves(sweep))
