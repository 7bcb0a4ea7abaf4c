"""No import cycles among the modules of ``composer_tune``.

Every module is parsed with :mod:`ast`, and every ``import`` statement in it is an edge: at
module level, inside functions (a deferred import is still a dependency; deferring one only hides
a cycle until that function runs) and under ``if TYPE_CHECKING:``. The last count too, although
they never run: a type-only import still means one module needs the other's definitions, and
a cycle through one is fixed the same way (move the shared definition down a layer).

An edge goes to the most specific module the statement names: ``from composer_tune.a import b``
goes to ``composer_tune.a.b`` when that is a module, else to ``composer_tune.a`` (``b`` is then a
name that package defines or re-exports). Importing ``composer_tune.a.b`` also runs
``composer_tune/a/__init__.py``, but that implicit step is not an edge: a package that re-exports
its submodules, whose submodules import each other by full path, is not a cycle, and Python
imports it without error.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "composer_tune"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _imported(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: dict[str, Path]
) -> list[str]:
    """The dotted names an import statement in ``module`` imports: for ``from pkg import name``,
    the submodule ``pkg.name`` if there is one, else ``pkg`` (``name`` is defined there)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        # Relative: level 1 is the module's own package (the module itself for an __init__).
        anchor = module.split(".")
        anchor = anchor if is_package else anchor[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    return [
        f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
        for alias in node.names
    ]


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The most specific module of ours that ``name`` is or lies in; None outside the package."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _edges(
    tree: ast.AST, module: str, is_package: bool, modules: dict[str, Path]
) -> dict[str, int]:
    """``{imported module: line of its first import}`` over every import statement in ``tree``."""
    edges: dict[str, int] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        for name in _imported(node, module, is_package, modules):
            target = _resolve(name, modules)
            if target is not None and target != module:
                edges[target] = min(edges.get(target, node.lineno), node.lineno)
    return edges


def import_graph() -> dict[str, dict[str, int]]:
    """``{module: {imported module: line}}`` for every module of the package."""
    modules = _modules()
    return {
        module: _edges(
            ast.parse(path.read_text(), filename=str(path)),
            module,
            path.name == "__init__.py",
            modules,
        )
        for module, path in modules.items()
    }


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), each as
    the module path ``[a, b, ..., a]`` found inside it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, {})):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_within(graph, set(component)) for component in components]


def _cycle_within(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module, by breadth-first search."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node]):
                if successor not in component:
                    continue
                if successor == start:
                    chain = [node]
                    while chain[-1] != start:
                        chain.append(parents[chain[-1]])
                    return [*reversed(chain), start]
                if successor not in parents:
                    parents[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"no cycle in strongly connected component {sorted(component)}")


def _describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return (
        " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False))
        + f" -> {cycle[-1]}"
    )


def test_composer_tune_has_no_import_cycle() -> None:
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles among composer_tune modules:\n" + "\n".join(
        _describe(cycle, graph) for cycle in cycles
    )


def test_a_cycle_is_found_and_a_re_exporting_package_is_not_one() -> None:
    graph = {
        "p": {"p.a": 1, "p.b": 2},  # __init__ re-exports; not a cycle by itself
        "p.a": {"p.b": 3},
        "p.b": {"p.c": 4},
        "p.c": {"p.a": 5},
    }
    assert find_cycles(graph) == [["p.a", "p.b", "p.c", "p.a"]]
    assert find_cycles({"p": {"p.a": 1}, "p.a": {"p.b": 1}, "p.b": {}}) == []


@pytest.mark.parametrize(
    ("source", "module", "is_package", "expected"),
    [
        (
            "def f():\n    from composer_tune.stop import x\n",
            "composer_tune.guards",
            False,
            {"composer_tune.stop"},
        ),
        ("from . import stop\n", "composer_tune", True, {"composer_tune.stop"}),
        ("from .. import stop\n", "composer_tune.distributed", True, {"composer_tune.stop"}),
        (
            "from ..losses.kl import kl_penalty\n",
            "composer_tune.channels.policy",
            False,
            {"composer_tune.losses.kl"},
        ),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from composer_tune.losses import policy_loss\n",
            "composer_tune.guards",
            False,
            {"composer_tune.losses"},
        ),
        (
            "import composer_tune.losses.kl as kl\n",
            "composer_tune.guards",
            False,
            {"composer_tune.losses.kl"},
        ),
        (
            "from composer_tune.data import GSM8K, tokenizer\n",  # a name and a submodule
            "composer_tune.guards",
            False,
            {"composer_tune.data", "composer_tune.data.tokenizer"},
        ),
        ("import torch\nfrom os import path\n", "composer_tune.guards", False, set()),
    ],
)
def test_each_kind_of_import_is_an_edge(
    source: str, module: str, is_package: bool, expected: set[str]
) -> None:
    assert set(_edges(ast.parse(source), module, is_package, _modules())) == expected
