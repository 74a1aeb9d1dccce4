"""Every package says what it holds: an ``__init__`` docstring whose module references exist, and a
line in the README's repository map."""

import ast
import importlib.util
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: folder -> import name (setup.py's package_dir)
ROOTS = {"engine": "hyflow", "kernels": "hyflow.kernels", "launch": "hyflow.launch", "tools": "hyflow.tools"}


def _packages():
    for folder, name in ROOTS.items():
        for dirpath, _, files in os.walk(os.path.join(REPO, folder)):
            if "__init__.py" in files and "__pycache__" not in dirpath:
                rel = os.path.relpath(dirpath, os.path.join(REPO, folder))
                yield os.path.join(dirpath, "__init__.py"), name if rel == "." else f"{name}.{rel.replace(os.sep, '.')}"


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def test_every_package_docstring_names_modules_that_exist():
    problems = []
    for path, package in _packages():
        with open(path) as f:
            doc = ast.get_docstring(ast.parse(f.read()))
        if not doc:
            problems.append(f"{package}: no docstring")
            continue
        for ref in re.findall(r":mod:`~?([\w.]+)`", doc):
            target = package + ref if ref.startswith(".") else ref
            if not _exists(target):
                problems.append(f"{package}: names {ref}, which does not exist")
    assert problems == []


def test_the_readme_map_has_a_line_for_every_engine_package():
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    top = sorted({p.split(".")[1] for _, p in _packages() if p.count(".") >= 1 and p.startswith("hyflow.")
                  and p.split(".")[1] not in ("kernels", "launch", "tools")})
    missing = [name for name in top if f"{name}/" not in readme]
    assert missing == []
