"""The package's shape, read with ``ast`` (nothing is imported):

* the **layer rules** (:data:`LAYERS`): every library package sits in one layer and imports only
  packages of lower layers; command-line code sits on top and no library module imports it;
* no import cycle between modules, and none between library packages (``hyflow.X``);
* no two public classes or module-level type aliases share a name (two ``KLKind = Literal[...]``
  drift apart);
* imports inside functions stay a small share of all imports (:data:`MAX_FUNCTION_IMPORTS`), and
  each one says why in a comment (an optional dependency, Megatron kept off a light path such as
  ``hyflow --help`` or the preflight): a module's dependencies are read at its top;
* files over :data:`WARN_LINES` lines get a printed warning, not a failure: modules are split by
  concept, never by a line count.

What counts as an import: every ``import`` / ``from ... import`` that runs, at module level *or*
inside a function (a lazy import still ties the two modules together: a cycle through one only
fails later, at the first call). Imports under ``if TYPE_CHECKING:`` do not count: they never
run and exist for annotations only.
"""
from __future__ import annotations

import ast
import os
import warnings
from collections import defaultdict


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: folder -> import name (as setup.py maps them)
FOLDERS = {"engine": "hyflow", "kernels": "hyflow.kernels", "launch": "hyflow.launch", "tools": "hyflow.tools"}
WARN_LINES = 800

#: The dependency order of the library, bottom to top: a package may import the packages of the
#: layers *below* its own, nothing of its own layer or above. Command-line code (``hyflow.cli``,
#: ``hyflow.cli_support``, every ``*.cli`` module, ``hyflow.launch``, ``hyflow.tools``) is above all.
#: Read as rules: algorithms sit below rl and training; hybrid, placement and rl never import jobs;
#: models never import rl, jobs or placement; the library never imports the command line.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundations: declared names and roles, config, CPU shims, kernels, monitoring",
     ("hyflow", "hyflow.choices", "hyflow.roles", "hyflow.config", "hyflow.compat", "hyflow.kernels",
      "hyflow.monitor")),
    ("process groups and layouts", ("hyflow.parallel",)),
    ("pure math, models, data, rewards", ("hyflow.algorithms", "hyflow.models", "hyflow.data", "hyflow.rewards")),
    ("the training step", ("hyflow.training",)),
    ("checkpoints", ("hyflow.checkpoint",)),
    ("generation and the hybrid engine", ("hyflow.rollout", "hyflow.hybrid")),
    ("vLLM as the generation engine", ("hyflow.vllm_backend",)),
    ("the RL step's parts", ("hyflow.rl",)),
    ("multi-turn rollouts: trajectories, tools, environments", ("hyflow.agent",)),
    ("validation on held-out data", ("hyflow.validation",)),
    ("placement pools", ("hyflow.placement",)),
    ("jobs", ("hyflow.jobs",)),
    ("planning, diagnostics, test helpers", ("hyflow.plan", "hyflow.doctor", "hyflow.testing")),
)
#: imports inside functions / all imports, engine + launch + tools + kernels (31.0% on 2026-11-28
#: before issue 32's first moves, 27.7% after them, 25.1% with the shared job loop, 19.8% with the
#: bench / CLI / monitor / testing / model-source moves, 20.3% after the MoE merge, under 10% once the
#: imports that were inside functions by habit moved to the top)
MAX_FUNCTION_IMPORTS = 0.10


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


def layer_of(package: str) -> int:
    for i, (_, members) in enumerate(LAYERS):
        if package in members:
            return i
    raise KeyError(f"package {package} is in no layer of tests/test_structure.py LAYERS: add it to the layer "
                   "its imports put it in")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import of ``graph`` (module -> modules) that breaks the layer rules, as readable lines."""
    bad = []
    for name, targets in sorted(graph.items()):
        for t in sorted(targets):
            if is_command_line(t) and not is_command_line(name):
                bad.append(f"{name} imports command-line module {t}")
                continue
            if is_command_line(name):
                continue
            a, b = package_of(name), package_of(t)
            if a != b and layer_of(b) >= layer_of(a):
                bad.append(f"{name} imports {t}: {b} ({LAYERS[layer_of(b)][0]}) is not below "
                           f"{a} ({LAYERS[layer_of(a)][0]})")
    return bad


def test_every_library_package_has_a_layer():
    packages = {package_of(n) for n in MODULES if not is_command_line(n)}
    missing = []
    for p in sorted(packages):
        try:
            layer_of(p)
        except KeyError:
            missing.append(p)
    assert missing == []
    listed = [p for _, members in LAYERS for p in members]
    assert len(listed) == len(set(listed))  # one layer each


def test_layer_rules_hold():
    assert layer_violations(GRAPH) == []


def test_layer_rules_report_a_forbidden_edge():
    """A deliberately broken copy: the real graph plus a models -> rl edge, a hybrid -> jobs edge,
    a same-layer edge and a library -> command-line edge, each read from source text."""
    assert layer_violations({"hyflow.models.a": {"hyflow.parallel.b"}}) == []  # downwards: fine
    broken = {k: set(v) for k, v in GRAPH.items()}
    src = "import hyflow.rl.models\n\ndef f():\n    from hyflow.jobs import rl\n"
    mods = set(MODULES) | {"hyflow.models.broken"}
    broken["hyflow.models.broken"] = imports_of("hyflow.models.broken", "engine/models/broken.py", ast.parse(src), mods)
    broken["hyflow.hybrid.executor"].add("hyflow.jobs.rl")
    broken["hyflow.rollout.engine"].add("hyflow.hybrid.executor")  # same layer
    broken["hyflow.rl.dispatch"].add("hyflow.cli")
    found = layer_violations(broken)
    assert len(found) == 5, found
    assert any(line.startswith("hyflow.models.broken imports hyflow.rl.models: hyflow.rl") for line in found)
    assert any(line.startswith("hyflow.models.broken imports hyflow.jobs.rl") for line in found)  # lazy counts
    assert any(line.startswith("hyflow.hybrid.executor imports hyflow.jobs.rl") for line in found)
    assert any(line.startswith("hyflow.rollout.engine imports hyflow.hybrid.executor") for line in found)
    assert "hyflow.rl.dispatch imports command-line module hyflow.cli" in found


def public_names(trees: dict[str, ast.AST]) -> dict[str, list[str]]:
    """Public classes and module-level type aliases (``X = Literal[...]``, ``Y = Callable[...]``,
    ``Z: TypeAlias = ...``) -> the modules that declare them."""
    seen = defaultdict(list)
    for name, tree in trees.items():
        for node in tree.body:
            declared = None
            if isinstance(node, ast.ClassDef):
                declared = node.name
            elif (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                  and _is_type_expression(node.value)):
                declared = node.targets[0].id
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                    ast.unparse(node.annotation).endswith("TypeAlias"):
                declared = node.target.id
            if declared and not declared.startswith("_"):
                seen[declared].append(name)
    return seen


TYPE_FORMS = {"Literal", "Union", "Optional", "Callable", "Annotated", "Type", "Tuple", "Dict", "List"}


def _is_type_expression(value: ast.AST) -> bool:
    """``Literal[...]``, ``typing.Callable[...]`` and friends (a type alias, not a constant)."""
    if not isinstance(value, ast.Subscript):
        return False
    base = value.value
    name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
    return name in TYPE_FORMS


def test_no_two_public_classes_or_type_aliases_share_a_name():
    seen = public_names(TREES)
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}


def test_duplicate_type_aliases_are_reported():
    trees = {"hyflow.a": ast.parse('KLKind = Literal["k1", "k2"]\nK = 3\n'),
             "hyflow.b": ast.parse('from typing import Literal\nKLKind = Literal["k1"]\nclass K: pass\n'),
             "hyflow.c": ast.parse('Fn: TypeAlias = int\nclass Fn: pass\n_P = Literal["x"]\n')}
    seen = public_names(trees)
    assert seen["KLKind"] == ["hyflow.a", "hyflow.b"]  # the twin
    assert seen["K"] == ["hyflow.b"]  # a constant is not a type alias
    assert seen["Fn"] == ["hyflow.c", "hyflow.c"] and "_P" not in seen


def function_imports(tree: ast.AST) -> tuple[int, list[ast.AST]]:
    """(all imports that can run, those inside a function body)."""
    total, inside = 0, []

    def walk(node: ast.AST, in_function: bool) -> None:
        nonlocal total
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                total += 1
                if in_function:
                    inside.append(child)
            walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    walk(tree, False)
    return total, inside


def test_imports_inside_functions_stay_few():
    total = inside = 0
    for tree in TREES.values():
        t, found = function_imports(tree)
        total, inside = total + t, inside + len(found)
    share = inside / total
    print(f"[structure] imports inside functions: {inside} of {total} ({share:.1%}; limit {MAX_FUNCTION_IMPORTS:.0%})")
    assert share <= MAX_FUNCTION_IMPORTS, f"{inside}/{total} imports sit inside functions: move them to the top"


def unjustified_imports(name: str, source: str) -> list[str]:
    """Imports inside functions of ``source`` with no comment on their line or above them: one
    comment line may head a block of imports (blank lines inside the block allowed)."""
    lines = source.splitlines()
    _, found = function_imports(ast.parse(source))
    import_lines = {i for node in found for i in range(node.lineno, node.end_lineno + 1)}
    out = []
    for node in found:
        here = lines[node.lineno - 1:node.end_lineno]
        above = node.lineno - 1  # 1-based number of the line above
        while above > 0 and (above in import_lines or not lines[above - 1].strip()):
            above -= 1
        if not any("#" in line for line in here) and not (above > 0 and lines[above - 1].strip().startswith("#")):
            out.append(f"{name}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return out


def test_imports_inside_functions_say_why():
    bad = []
    for name, path in MODULES.items():
        bad += unjustified_imports(name, open(path).read())
    assert bad == [], "an import inside a function needs a comment saying why (or move it to the top)"
    assert unjustified_imports("x", "def f():\n    import os\n") == ["x:2: import os"]
    assert unjustified_imports("x", "def f():\n    # optional heavy dependency\n    import vllm\n") == []
    block = "def f():\n    # optional heavy dependencies\n    import vllm\n\n    from vllm import x\n"
    assert unjustified_imports("x", block) == []
    assert unjustified_imports("x", "def f():\n    # why\n    y = 1\n    import os\n") == ["x:4: import os"]


def test_size_is_a_warning_only():
    """Modules are split by concept: a long file is printed as a warning, never a failure."""
    long, seen = {}, 0
    for folder in sorted(FOLDERS) + ["tests"]:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
            for f in filenames:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    seen += 1
                    n = sum(1 for _ in open(path))
                    if n > WARN_LINES:
                        long[os.path.relpath(path, ROOT)] = n
    for path, n in sorted(long.items()):
        print(f"[structure] warning: {path} has {n} lines (> {WARN_LINES}): one concept? split it by concept if not")
        warnings.warn(f"{path} has {n} lines", UserWarning, stacklevel=1)
    assert seen > len(MODULES), f"the size scan read {seen} files: it misses the package and the tests"
