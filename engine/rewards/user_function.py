"""User reward functions with verl's signature, loaded from a Python file.

    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float

The function may also return a dict with a ``"score"`` key; its other numeric entries become
per-sample extras (logged as ``reward_extra/<key>``). Functions are called with keyword
arguments when their parameter names are verl's, positionally otherwise; ``extra_info`` is
passed only if the function takes a fourth parameter.

Every failure names what failed: a missing file, an import error, a missing or non-callable
function (listing the functions the file does define), an incompatible signature, and at call
time an exception or a non-numeric / non-finite return, with the row and ``data_source``.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import inspect
import math
import numbers
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["RewardError", "UserFunction", "load_user_function", "coerce_score"]

_ARG_NAMES = ("data_source", "solution_str", "ground_truth", "extra_info")


class RewardError(RuntimeError):
    """A reward could not be computed; names the function, file, row and data source when known."""

    def __init__(self, message: str, function: Optional[str] = None, path: Optional[str] = None,
                 row: Optional[str] = None, data_source: Optional[str] = None) -> None:
        super().__init__(message)
        self.function, self.path, self.row, self.data_source = function, path, row, data_source


def coerce_score(value: Any, what: str) -> tuple[float, dict[str, float]]:
    """``(score, extras)`` from a scorer's return value; ``ValueError`` naming ``what`` if unusable."""
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"{what} returned a dict without a 'score' key (keys: {sorted(value)})")
        for key, item in value.items():
            if key != "score" and _is_number(item):
                extras[str(key)] = float(item)
        value = value["score"]
    if not _is_number(value):
        raise ValueError(f"{what} returned {value!r} ({type(value).__name__}); expected a float "
                         f"or a dict with a 'score' key")
    try:
        score = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} returned {value!r}, which is not a real number ({exc})") from None
    if not math.isfinite(score):
        raise ValueError(f"{what} returned a non-finite score ({score})")
    return score, extras


def _is_number(value: Any) -> bool:
    if isinstance(value, numbers.Real):  # bool, int, float, numpy scalars, Fraction
        return True
    shape = getattr(value, "shape", None)  # 0-d numpy arrays / torch tensors
    return shape is not None and tuple(shape) == () and hasattr(value, "item")


@dataclass
class UserFunction:
    """A loaded user reward function; call it like the original, with ``where`` for messages."""

    fn: Callable[..., Any]
    name: str
    path: str
    keywords: bool
    passes_extra_info: bool

    @property
    def label(self) -> str:
        return f"reward function {self.name}() from {self.path}"

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any,
                 extra_info: Optional[dict] = None, where: Optional[str] = None) -> tuple[float, dict[str, float]]:
        """``(score, extras)``; any failure raises :class:`RewardError` naming row and data source."""
        values = [data_source, solution_str, ground_truth, extra_info][:4 if self.passes_extra_info else 3]
        context = f" on {where or 'a sample'} (data_source={data_source!r})"
        try:
            if self.keywords:
                result = self.fn(**dict(zip(_ARG_NAMES, values)))
            else:
                result = self.fn(*values)
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise RewardError(f"{self.label} raised {type(exc).__name__}: {exc}{context}",
                              self.name, self.path, where, data_source) from exc
        try:
            return coerce_score(result, self.label)
        except ValueError as exc:
            raise RewardError(f"{exc}{context}", self.name, self.path, where, data_source) from None


def _calling_convention(fn: Callable[..., Any], label: str) -> tuple[bool, bool]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return True, True  # builtins etc.: trust verl's convention
    dummy = ("ds", "text", "gt", None)
    for keywords, n in ((True, 4), (True, 3), (False, 4), (False, 3)):
        try:
            if keywords:
                sig.bind(**dict(zip(_ARG_NAMES[:n], dummy[:n])))
            else:
                sig.bind(*dummy[:n])
            return keywords, n == 4
        except TypeError:
            continue
    raise RewardError(f"{label} has signature {sig}; expected "
                      f"(data_source, solution_str, ground_truth, extra_info=None)")


def load_user_function(path: Optional[str], name: str = "compute_score") -> UserFunction:
    """Import ``path`` as a module and return its function ``name`` wrapped as :class:`UserFunction`."""
    if not path:
        raise RewardError("no reward function file: set reward.function_path", function=name)
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise RewardError(f"reward function file not found: {path} (reward.function_path)",
                          function=name, path=path)
    digest = hashlib.sha1(path.encode()).hexdigest()[:10]
    module_name = f"hyflow_user_reward_{digest}"
    loader = importlib.machinery.SourceFileLoader(module_name, path)
    spec = importlib.util.spec_from_loader(module_name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        loader.exec_module(module)
    except BaseException as exc:  # noqa: BLE001 - SyntaxError, ImportError, SystemExit, ...
        sys.modules.pop(module_name, None)
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise RewardError(f"importing reward function file {path} failed: {type(exc).__name__}: {exc}",
                          function=name, path=path) from exc
    label = f"reward function {name}() from {path}"
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items()
                         if inspect.isfunction(v) and v.__module__ == module_name)
        raise RewardError(f"{path} defines no function {name!r} (reward.function_name); "
                          f"functions defined there: {', '.join(defined) or 'none'}", function=name, path=path)
    if not callable(fn):
        raise RewardError(f"{path}: {name!r} is a {type(fn).__name__}, not a function", function=name, path=path)
    keywords, extra = _calling_convention(fn, label)
    return UserFunction(fn, name, path, keywords, extra)
