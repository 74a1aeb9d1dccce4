"""The package's shape, read with ``ast`` (nothing is imported):

* no import cycle between modules, and none between library packages (``hyflow.X``);
* no library module imports command-line code: ``hyflow.cli``, ``hyflow.cli_support``, any
  ``*.cli`` module, ``hyflow.launch`` or ``hyflow.tools``;
* no two public classes share a name;
* no Python file over 500 lines (engine, launch, tools, kernels, tests).

What counts as an import: every ``import`` / ``from ... import`` that runs, at module level *or*
inside a function (a lazy import still ties the two modules together: a cycle through one only
fails later, at the first call). Imports under ``if TYPE_CHECKING:`` do not count: they never
run and exist for annotations only.
"""
from __future__ import annotations

import ast
import os
from collections import defaultdict

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: folder -> import name (as setup.py maps them)
FOLDERS = {"engine": "hyflow", "kernels": "hyflow.kernels", "launch": "hyflow.launch", "tools": "hyflow.tools"}
MAX_LINES = 500


def _modules() -> dict[str, str]:
    out = {}
    for folder, prefix in FOLDERS.items():
        base = os.path.join(ROOT, folder)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
            for f in filenames:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), base)[:-3].replace(os.sep, ".")
                    rel = "" if rel == "__init__" else rel.removesuffix(".__init__")
                    out[prefix + ("." + rel if rel else "")] = os.path.join(dirpath, f)
    return out


MODULES = _modules()
TREES = {name: ast.parse(open(path).read(), path) for name, path in MODULES.items()}


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _import_nodes(tree: ast.AST):
    """Every import statement that can run (skips ``if TYPE_CHECKING:`` bodies)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def imports_of(name: str, path: str, tree: ast.AST, modules) -> set[str]:
    """Modules of the package that module ``name`` imports."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for t in targets:
            while t and t not in modules:  # ``from hyflow.x.y import name``: the module is hyflow.x.y
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


GRAPH = {name: imports_of(name, path, TREES[name], MODULES) for name, path in MODULES.items()}


def is_command_line(name: str) -> bool:
    """Command-line code: the ``hyflow`` entry point and its helpers, every ``*.cli`` module, the
    launchers and the tools (bench, convert) that sit on top of the library."""
    return (name in ("hyflow.cli", "hyflow.cli_support") or name.endswith(".cli")
            or name.startswith(("hyflow.launch", "hyflow.tools")))


def package_of(name: str) -> str:
    """A library module's package (``hyflow.X``, ``hyflow.tools.X``); command-line modules and
    top-level modules are their own node."""
    if is_command_line(name):
        return name
    parts = name.split(".")
    return ".".join(parts[:3] if parts[1:2] == ["tools"] and len(parts) > 2 else parts[:2])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_scan_sees_the_package():
    assert {"hyflow.cli", "hyflow.jobs.registry", "hyflow.hybrid.executor", "hyflow.kernels",
            "hyflow.launch.local", "hyflow.tools.bench.reshard"} <= set(MODULES)
    assert "hyflow.jobs.registry" in GRAPH["hyflow.cli"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    src = ("from typing import TYPE_CHECKING\nimport hyflow.b\nif TYPE_CHECKING:\n    import hyflow.c\n"
           "def f():\n    from . import d\n    from hyflow.e import thing\n")
    mods = {"hyflow.a", "hyflow.b", "hyflow.c", "hyflow.d", "hyflow.e"}
    assert imports_of("hyflow.a", "engine/a.py", ast.parse(src), mods) == {"hyflow.b", "hyflow.d", "hyflow.e"}


def test_no_import_cycles_between_modules():
    assert cycles(GRAPH) == []


def test_no_import_cycles_between_packages():
    packages: dict[str, set[str]] = defaultdict(set)
    for name, targets in GRAPH.items():
        packages[package_of(name)] |= {package_of(t) for t in targets} - {package_of(name)}
    assert cycles(dict(packages)) == []


def test_library_never_imports_command_line_modules():
    bad = sorted(f"{name} imports {t}" for name, targets in GRAPH.items() if not is_command_line(name)
                 for t in targets if is_command_line(t))
    assert bad == []


def test_no_two_public_classes_share_a_name():
    seen = defaultdict(list)
    for name, tree in TREES.items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                seen[node.name].append(name)
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}


@pytest.mark.parametrize("folder", sorted(FOLDERS) + ["tests"])
def test_no_file_over_500_lines(folder):
    long = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
        for f in filenames:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                n = sum(1 for _ in open(path))
                if n > MAX_LINES:
                    long[os.path.relpath(path, ROOT)] = n
    assert long == {}
