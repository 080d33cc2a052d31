"""The package's layers (docs/architecture.md): every module imports only modules of its
own layer or of the layers beneath it, function-level imports included, so the folder
tree reads bottom up."""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fedjax_fair"

# bottom up; a module may import its own layer and those before it
LAYERS = ["hparams", "metrics", "models", "core", "solvers", "data", "algorithms", "drivers",
          "cli"]


def _layer(module: str) -> str:
    """fedjax_fair.core.client -> "core"; fedjax_fair.metrics -> "metrics"."""
    return module.split(".")[1]


def _imports(path: pathlib.Path, module: str) -> set:
    """The fedjax_fair modules ``path`` imports (a name imported from a package counts
    as its submodule when there is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("fedjax_fair.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "fedjax_fair":
                found |= {f"fedjax_fair.{a.name}" for a in node.names}
            elif node.module.startswith("fedjax_fair."):
                found.add(node.module)
    return found


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts == ("fedjax_fair", "__init__"):
            continue  # the package's own exports
        yield ".".join(p for p in parts if p != "__init__"), path


@pytest.mark.parametrize("module,path", list(_modules()), ids=lambda v: str(v))
def test_a_module_imports_only_its_layer_and_those_beneath(module, path):
    rank = LAYERS.index(_layer(module))
    above = sorted(m for m in _imports(path, module) if LAYERS.index(_layer(m)) > rank)
    assert not above, f"{module} ({_layer(module)}) imports a layer above it: {above}"


def test_every_module_is_in_a_layer():
    assert {_layer(m) for m, _ in _modules()} == set(LAYERS)
