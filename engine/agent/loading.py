"""Load a user's class from a spec string: ``module:Name``, ``module.Name`` (verl's
``class_name``) or ``path/to/file.py:Name``; one error naming the spec and what went wrong."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Any


class LoadError(ValueError):
    """A spec that names no loadable object."""


def load_object(spec: str, what: str) -> Any:
    """The object ``spec`` names; ``what`` says what it is for in the error message."""
    if not isinstance(spec, str) or not spec.strip():
        raise LoadError(f"{what}: empty name; use 'module:Class' or 'path/to/file.py:Class'")
    if ":" in spec:
        where, name = spec.rsplit(":", 1)
    elif "." in spec:
        where, name = spec.rsplit(".", 1)
    else:
        raise LoadError(f"{what}: {spec!r} names no module; use 'module:Class' or 'path/to/file.py:Class'")
    if where.endswith(".py"):
        module = _load_file(where, what)
    else:
        try:
            module = importlib.import_module(where)
        except Exception as exc:  # noqa: BLE001 - re-raised with the spec named
            raise LoadError(f"{what}: importing {where!r} failed: {type(exc).__name__}: {exc}") from exc
    obj = getattr(module, name, None)
    if obj is None:
        raise LoadError(f"{what}: {where!r} defines no {name!r}")
    return obj


def _load_file(path: str, what: str) -> Any:
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise LoadError(f"{what}: file not found: {path}")
    module_name = "hyflow_user_" + hashlib.sha1(path.encode()).hexdigest()[:10]
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:  # noqa: BLE001 - SyntaxError, ImportError, SystemExit, ...
        sys.modules.pop(module_name, None)
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise LoadError(f"{what}: importing {path} failed: {type(exc).__name__}: {exc}") from exc
    return module
