"""The package reads bottom-up: each layer imports only from the layers below it, and no
modules import each other in a circle. Every import counts: module-level, inside functions,
and under ``TYPE_CHECKING`` (a type is a dependency too).

    base (errors, compat) < ir < compiler (+ passes) < cost < runtime (+ backends)
        < inspect < api (the ``zerocc`` facade, ``zerocc.train_step``) < cli
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Where each installed package's sources are (pyproject's package-dir).
PACKAGE_DIRS = {"zerocc": ROOT / "zerocc", "zerocc.passes": ROOT / "passes"}
PACKAGE_DIRS["zerocc.backends"] = ROOT / "backends"
LAYERS = ["base", "ir", "compiler", "cost", "runtime", "inspect", "api", "cli"]
LAYER_OF_PREFIX = {  # longest prefix wins
    "zerocc.errors": "base",
    "zerocc.compat": "base",
    "zerocc.ir": "ir",
    "zerocc.compiler": "compiler",
    "zerocc.passes": "compiler",
    "zerocc.cost": "cost",
    "zerocc.runtime": "runtime",
    "zerocc.backends": "runtime",
    "zerocc.inspect": "inspect",
    "zerocc": "api",
    "zerocc.train_step": "api",
    "zerocc.workloads": "api",
    "zerocc.cli": "cli",
    "zerocc.__main__": "cli",
}


def modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name."""
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if package == "zerocc" and parts[0] in ("passes", "backends"):
                continue
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """The zerocc modules ``path`` imports, wherever the import statement is."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                out.add(target if target in known else node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {name for name in out if name in known}


def layer_of(module: str) -> str:
    prefixes = [p for p in LAYER_OF_PREFIX if module == p or module.startswith(p + ".")]
    return LAYER_OF_PREFIX[max(prefixes, key=len)]


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(path, known) - {name} for name, path in known.items()}


def test_every_module_has_a_layer():
    for module in import_graph():
        assert layer_of(module) in LAYERS, module


def test_no_module_imports_from_a_layer_above_its_own():
    upward = [
        f"{module} ({layer_of(module)}) imports {target} ({layer_of(target)})"
        for module, targets in sorted(import_graph().items())
        for target in sorted(targets)
        if LAYERS.index(layer_of(target)) > LAYERS.index(layer_of(module))
    ]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert not cycles(import_graph())


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ],
)
def test_the_cycle_finder_finds_cycles(graph, expected):
    assert cycles(graph) == expected


def test_the_layer_check_sees_function_level_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from zerocc.cli.main import main\n")
    assert imports_of(module, {"zerocc.cli.main": module}) == {"zerocc.cli.main"}
