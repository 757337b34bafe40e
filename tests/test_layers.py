"""The package reads bottom-up: each layer imports only from the layers below it, and no
modules, nor packages, import each other in a circle. Every import counts: module-level,
inside functions, and under ``TYPE_CHECKING`` (a type is a dependency too). The folders are the
packages (no ``package-dir`` mapping), so every import between them is seen.

    base (errors, compat, logs, local_ranks) < ir < compiler (+ passes) < cost < engine
        < backends < runtime < inspect < api (the ``zerocc`` facade, ``zerocc.train_step``) < cli

Within the compiler, packages stack too (:data:`COMPILER_PACKAGES`)::

    compiler.plan.deepspeed < compiler.plan < compiler < compiler.parallel.dims
        < compiler.parallel
        < compiler.passes.support < compiler.passes < compiler.driver

The plan (with the DeepSpeed import under it) is data and its checks, at the bottom: it
imports only the base and the IR. The compiler's own modules (capture, units, state, ...) read
the plan. The parallel dimensions (``parallel.dims``: each one's degree, groups and rank
order) read only the plan; parallelism (the ranks' mesh, tensor parallelism) captures and
splits the model's layers, so it sits on capture and units; the passes' helpers
(``passes.support``: analyses and emitters that register no pass) on those; the passes (and
``passes.spec``, what a pass is and the context it reads: the mesh, the layers split) sit on
all of them; the driver (the pass manager and ``compile_program``) on top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = [
    "base",
    "ir",
    "compiler",
    "cost",
    "engine",
    "backends",
    "runtime",
    "inspect",
    "api",
    "cli",
]
LAYER_OF_PREFIX = {  # longest prefix wins
    "zerocc.errors": "base",
    "zerocc.compat": "base",
    "zerocc.logs": "base",
    "zerocc.local_ranks": "base",
    "zerocc.ir": "ir",
    "zerocc.compiler": "compiler",
    "zerocc.cost": "cost",
    "zerocc.engine": "engine",
    "zerocc.backends": "backends",
    "zerocc.runtime": "runtime",
    "zerocc.inspect": "inspect",
    "zerocc": "api",
    "zerocc.train_step": "api",
    "zerocc.workloads": "api",
    "zerocc.cli": "cli",
    "zerocc.__main__": "cli",
}


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (its folders are its packages)."""
    found = {}
    for path in (ROOT / "zerocc").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
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


# The modules directly in zerocc/: the base's and the API's (the facade, its steps, the
# command's entry). Anything else belongs in its layer's package.
TOP_LEVEL = {
    "zerocc", "zerocc.__main__", "zerocc.errors", "zerocc.compat", "zerocc.logs",
    "zerocc.local_ranks", "zerocc.train_step",
}  # fmt: skip


def test_the_top_level_holds_only_the_base_and_the_api():
    known = modules()
    top = {m for m, path in known.items() if path.parent == ROOT / "zerocc"} - {"zerocc"}
    stray = sorted(top - TOP_LEVEL)
    assert not stray, (
        f"{stray} sit directly in zerocc/, where a module is the base's or the API's (and may "
        "import any layer): put each in its layer's package (a wrapper of inspect/ in inspect/)"
    )


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


def package_of(module: str, known: dict[str, Path]) -> str:
    """The package whose folder holds ``module`` (a package is its own); a module directly in
    ``zerocc/`` is its own node (errors and compat sit at the bottom, the facade at the top)."""
    if known[module].name == "__init__.py":
        return module
    parent = module.rpartition(".")[0]
    return module if parent == "zerocc" else parent


def package_graph() -> dict[str, set[str]]:
    """Which packages import which: an edge for every import between modules of two."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        source = package_of(module, known)
        graph.setdefault(source, set())
        for target in targets:
            if package_of(target, known) != source:
                graph[source].add(package_of(target, known))
                graph.setdefault(package_of(target, known), set())
    return graph


def test_no_package_import_cycles():
    assert not cycles(package_graph())


COMPILER_PACKAGES = [
    "zerocc.compiler.plan.deepspeed",
    "zerocc.compiler.plan",
    "zerocc.compiler",
    "zerocc.compiler.parallel.dims",
    "zerocc.compiler.parallel",
    "zerocc.compiler.passes.support",
    "zerocc.compiler.passes",
    "zerocc.compiler.driver",
]


def test_compiler_packages_import_only_those_below_them():
    graph = package_graph()
    found = {p for p in graph if p.startswith("zerocc.compiler")}
    assert set(COMPILER_PACKAGES) == found, (
        f"compiler packages not in tests/test_layers.py's COMPILER_PACKAGES: "
        f"{sorted(found - set(COMPILER_PACKAGES))} (add each where it sits in the stack); "
        f"listed but gone: {sorted(set(COMPILER_PACKAGES) - found)}"
    )
    upward = [
        f"{package} imports {target}"
        for package in COMPILER_PACKAGES
        for target in sorted(graph[package])
        if target in COMPILER_PACKAGES
        and COMPILER_PACKAGES.index(target) > COMPILER_PACKAGES.index(package)
    ]
    assert not upward, "upward imports within the compiler:\n" + "\n".join(upward)


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
