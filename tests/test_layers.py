"""The package's layers (docs/architecture.md): every module imports only modules of its
own layer or of the layers beneath it, function-level imports included, so the folder
tree reads bottom up."""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fedjax_fair"

# bottom up; a module may import its own layer and those before it
LAYERS = ["hparams", "metrics", "models", "core", "solvers", "data", "scenarios", "algorithms",
          "drivers", "reports", "cli"]


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
            if node.module == "fedjax_fair" or node.module.startswith("fedjax_fair."):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    found.add(sub if _is_module(sub) else node.module)
    return found


def _is_module(name: str) -> bool:
    """Whether ``fedjax_fair.x.y`` is a module or package of the package."""
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


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


def _graph() -> dict:
    """module -> the fedjax_fair modules it imports (function-level imports included),
    restricted to modules of the package."""
    modules = dict(_modules())
    return {m: {i for i in _imports(p, m) if i in modules and i != m} for m, p in modules.items()}


def _cycle(graph: dict):
    """One import cycle of ``graph`` as a list of modules, or None."""
    state = {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n, path + [n])
                if found:
                    return found
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_no_import_cycle_inside_a_layer():
    """Within a layer the modules import each other as a tree (a DAG), so each layer
    also reads bottom up: one cycle (cli/config -> cli/lock -> cli/config) is one
    module in two files."""
    graph = _graph()
    within = {m: {n for n in deps if _layer(n) == _layer(m)} for m, deps in graph.items()}
    assert _cycle(within) is None, f"import cycle: {' -> '.join(_cycle(within))}"


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
