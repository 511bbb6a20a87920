"""No import cycle among first-party modules, hidden or not.

Imports inside functions count (a cycle kept out of sight that way still ties
the modules together), and so do relative ones. A cycle means two modules
are one idea, or that what both need belongs in a third that both import.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_layers import PACKAGES, sources


def edges(module: str, path: Path, known: set[str]) -> set[str]:
    """The known modules `module` imports, anywhere in its source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    resolved = set()
    for name in found:
        while name not in known and "." in name:
            name = name.rpartition(".")[0]
        if name in known and name != module and name.split(".")[0] in PACKAGES:
            resolved.add(name)
    return resolved


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
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
                    found.append(sorted(group))
    return found


def test_no_import_cycle() -> None:
    modules = sources()
    known = set(modules)
    graph = {module: edges(module, path, known) for module, path in modules.items()}
    assert sum(len(targets) for targets in graph.values()) > 100, "the import graph was not read"
    assert cycles(graph) == []


def test_the_check_sees_a_cycle_hidden_in_a_function(tmp_path: Path) -> None:
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("import pipeline.b\n")
    b.write_text("def f():\n    from pipeline import a\n")
    known = {"pipeline.a", "pipeline.b"}
    graph = {"pipeline.a": edges("pipeline.a", a, known), "pipeline.b": edges("pipeline.b", b, known)}
    assert cycles(graph) == [["pipeline.a", "pipeline.b"]]
    assert cycles({"pipeline.a": {"pipeline.b"}, "pipeline.b": set()}) == []
