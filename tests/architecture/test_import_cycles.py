"""No import cycles between the modules of ``ms_llm``.

A cycle makes import order matter (a partly initialised module hands out missing names), and it
is usually hidden by a function-level import that nobody remembers is load-bearing. So this test
reads every module's source (nothing is imported), collects every ``import`` and
``from ... import`` statement -- relative ones and those inside functions included, those under
``if TYPE_CHECKING:`` excluded (they never run) -- and fails naming one cycle per strongly
connected group of modules.

An edge goes to the module an import statement names: ``from .comm import all_reduce`` and
``from . import comm`` both point at ``ms_llm.parallel.comm``; ``from .comm import groups`` points
at the submodule ``ms_llm.parallel.comm.groups``. The parent packages that Python initialises on
the way are not edges: a package whose ``__init__`` re-exports its submodules is not a cycle.
"""
from __future__ import annotations

import ast
import os
from typing import Dict, Iterator, List, Optional, Set

import pytest
from helpers.paths import ROOT

PACKAGE = "ms_llm"

# Cycles being removed right now, as frozensets of module names; each entry must still be a
# real cycle (the test fails when an entry is stale, so the list only shrinks).
KNOWN_CYCLES: List[frozenset] = []


def _modules() -> Dict[str, str]:
    """Module name -> source path, for every .py file inside ``ms_llm``'s package tree."""
    out = {}
    base = os.path.join(ROOT, PACKAGE)
    for folder, dirs, files in os.walk(base):
        dirs[:] = sorted(d for d in dirs if os.path.isfile(os.path.join(folder, d, "__init__.py")))
        parts = os.path.relpath(folder, ROOT).split(os.sep)
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            name = parts if f == "__init__.py" else parts + [f[:-3]]
            out[".".join(name)] = os.path.join(folder, f)
    return out


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node except the bodies of ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _known(name: str, modules: Dict[str, str]) -> Optional[str]:
    """``name`` or its longest prefix that is an ms_llm module (``a.b.attr`` -> ``a.b``)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _imports(module: str, path: str, modules: Dict[str, str]) -> Set[str]:
    """The ms_llm modules ``module`` imports (at any level of its code)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    is_package = path.endswith("__init__.py")
    package = module if is_package else module.rpartition(".")[0]
    out = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
                       for a in node.names]
        else:
            continue
        for t in targets:
            hit = _known(t, modules)
            if hit is not None and hit != module:
                out.add(hit)
    return out


def import_graph() -> Dict[str, Set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _cyclic_groups(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on_stack: Set[str] = set()
    stack: List[str] = []
    groups = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def _one_cycle(graph: Dict[str, Set[str]], group: List[str]) -> List[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    members, start = set(group), group[0]
    parents = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, start]
                if child not in parents:
                    parents[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {group}")


def test_graph_sees_relative_and_function_level_imports():
    graph = import_graph()
    assert "ms_llm.parallel.comm.groups" in graph["ms_llm.parallel.comm.collectives"]
    assert "ms_llm.parallel.comm" in graph["ms_llm.parallel.runtime"]          # inside a function
    assert "ms_llm.checkpoint.native.export" in graph["ms_llm.checkpoint.native.dcp"]  # __getattr__


def test_cycle_finder_reports_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cyclic_groups(graph) == [["a", "b", "c"]]
    assert _one_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_no_import_cycles():
    graph = import_graph()
    groups = _cyclic_groups(graph)
    stale = [sorted(k) for k in KNOWN_CYCLES if not any(k <= set(g) for g in groups)]
    if stale:
        pytest.fail(f"KNOWN_CYCLES lists cycles that are gone, remove them: {stale}")
    found = [g for g in groups if frozenset(g) not in KNOWN_CYCLES]
    if found:
        cycles = ["  " + " -> ".join(_one_cycle(graph, g)) for g in found]
        pytest.fail("import cycle(s) between ms_llm modules:\n" + "\n".join(cycles))
