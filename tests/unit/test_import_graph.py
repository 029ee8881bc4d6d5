"""No import circles in the aioengine package, checked on the source (the AST of every
module of every source folder the package is installed from).

Three graphs: the imports that run when a module is imported (module level); those plus
the imports deferred into functions; and those plus the type-only imports (under
`if TYPE_CHECKING:`). A deferred import is how a circle is usually hidden (bench latency ->
offline -> peers -> latency, cli <-> ray_serve.app, ray_serve.options <-> router were all
circles of deferred imports, issue 28), and a type-only one how a file split by size keeps
naming the class it was cut from (PrefixCacheMixin, kv_integrity and eagle_checkpoint
reading KVCacheManager's or EagleHead's state, issue 51): the modules still need each
other, so no graph has a circle. A package's __init__ is an edge only where it is named
(`from aioengine.bench import x`), not for every submodule."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Source folders -> the package each is installed as (pyproject's package-dir).
SOURCE_DIRS = {"aioengine": "aioengine", "spec_decode": "aioengine.spec_decode",
               "structured": "aioengine.structured", "lora": "aioengine.lora",
               "kernels": "aioengine.kernels"}
Graph = dict[str, set[str]]


def module_sources(root: Path = ROOT) -> dict[str, tuple[str, bool]]:
    """Dotted module name -> (its source, whether it is a package's __init__)."""
    out = {}
    for folder, package in SOURCE_DIRS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = [package, *path.relative_to(root / folder).parts]
            parts[-1] = parts[-1].removesuffix(".py")
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            out[".".join(parts)] = (path.read_text(encoding="utf-8"), is_package)
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(body: list[ast.stmt], deferred: bool,
                  type_only: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run: at module level (in if/try/with blocks too, not
    under `if TYPE_CHECKING:`), with `deferred` those inside functions and classes too,
    and with `type_only` those under `if TYPE_CHECKING:` too."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and _is_type_checking(node):
            found += _import_nodes(node.orelse, deferred, type_only)
            if type_only:
                found += _import_nodes(node.body, deferred, type_only)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if deferred or isinstance(node, ast.ClassDef):
                found += _import_nodes(node.body, deferred, type_only)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []) or []:
                    found += _import_nodes([child] if isinstance(child, ast.stmt)
                                           else child.body, deferred, type_only)
    return found


def imported_modules(source: str, module: str, is_package: bool, deferred: bool,
                     type_only: bool = False) -> set[str]:
    """The modules `source` imports (absolute names; ones outside the package too)."""
    names = set()
    for node in _import_nodes(ast.parse(source).body, deferred, type_only):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
        names.add(base)
        # `from package import module` imports that module.
        names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(sources: dict[str, tuple[str, bool]], deferred: bool,
                 type_only: bool = False) -> Graph:
    """module -> the package's modules it imports."""
    return {module: {name for name in imported_modules(source, module, is_package, deferred,
                                                       type_only)
                     if name in sources and name != module}
            for module, (source, is_package) in sources.items()}


def circular_groups(graph: Graph) -> list[set[str]]:
    """The strongly connected groups of more than one module (Tarjan): each module of a
    group imports, through the others, every other one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def cycles(graph: Graph) -> list[list[str]]:
    """One circle through each circular group, as [a, b, ..., a]; [] when none."""
    return [_circle(graph, group) for group in circular_groups(graph)]


def _circle(graph: Graph, group: set[str]) -> list[str]:
    """The shortest circle within `group` from its first module back to it."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    return paths[node] + [start]
                if nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError(f"no circle in {sorted(group)}")


def _named(found: list[list[str]]) -> str:
    return "; ".join(" -> ".join(circle) for circle in found)


@pytest.fixture(scope="module")
def sources() -> dict[str, tuple[str, bool]]:
    return module_sources()


def test_no_module_level_import_cycle(sources: dict[str, tuple[str, bool]]) -> None:
    found = cycles(import_graph(sources, deferred=False))
    assert not found, f"import circles at module level: {_named(found)}"


def test_no_deferred_import_cycle(sources: dict[str, tuple[str, bool]]) -> None:
    found = cycles(import_graph(sources, deferred=True))
    assert not found, f"import circles (imports in functions included): {_named(found)}"


def test_no_type_only_import_cycle(sources: dict[str, tuple[str, bool]]) -> None:
    found = cycles(import_graph(sources, deferred=True, type_only=True))
    assert not found, ("import circles (imports in functions and under TYPE_CHECKING "
                       f"included): {_named(found)}")


def test_the_graph_sees_circles() -> None:
    """A deferred import closing a circle, a relative one, one under TYPE_CHECKING (an edge
    of the type-only graph only) and a `from package import module` are read as they
    run."""
    sources = {
        "pkg": ("", True),
        "pkg.a": ("from pkg import b\n", False),
        "pkg.b": ("def f():\n    from .c import x\n", False),
        "pkg.c": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.d\n"
                  "try:\n    import pkg.a\nexcept ImportError:\n    pass\n", False),
        "pkg.d": ("import pkg.c\n", False),
    }
    assert cycles(import_graph(sources, deferred=False)) == []
    assert cycles(import_graph(sources, deferred=True)) == [["pkg.a", "pkg.b", "pkg.c",
                                                             "pkg.a"]]
    typed = import_graph(sources, deferred=True, type_only=True)
    assert circular_groups(typed) == [{"pkg.a", "pkg.b", "pkg.c", "pkg.d"}]
    only_typed = {**sources, "pkg.b": ("", False)}  # c <-> d through TYPE_CHECKING alone
    assert cycles(import_graph(only_typed, deferred=True)) == []
    assert cycles(import_graph(only_typed, deferred=True, type_only=True)) == [
        ["pkg.c", "pkg.d", "pkg.c"]]
