"""Find tensors created without an explicit device, on a machine without a GPU (test support).

On a GPU a factory call without ``device=`` (``torch.zeros(n)``, ``torch.tensor(values)``) makes a
*host* tensor, which then meets CUDA tensors and fails, or crosses PCIe every step. On the CPU
such bugs are invisible. Inside :class:`ImplicitDeviceGuard` every such call creates a *meta*
tensor instead (what ``torch.set_default_device("meta")`` does), so any use of it breaks the code
under test, and the call site is recorded. Call sites that are deliberately host-side are listed
in ``allow`` with the reason, as ``(path suffix, function name)``; a call is allowed when any
frame of its stack matches, so an entry covers what that function calls.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

_TORCH = os.path.dirname(torch.__file__)


def _skipped(filename: str) -> bool:
    """torch itself, this module and the CPU compat layer's factory wrappers are not callers."""
    return filename.startswith(_TORCH) or filename == __file__ or filename.endswith(os.path.join("compat", "cpu.py"))


class ImplicitDeviceGuard(TorchFunctionMode):
    """Within the block, implicit-device tensor factories create meta tensors (except ``allow``).

    ``violations``: ``"file:line in function"`` of each recorded call site.
    """

    def __init__(self, allow: Optional[Mapping[tuple[str, str], str]] = None, meta: bool = True) -> None:
        super().__init__()
        self.meta = meta  # False: only record (to list every call site in one run)
        self.allow = dict(allow or {})
        self.violations: list[str] = []
        self._constructors = _device_constructors()

    def _caller(self):
        frame = sys._getframe(2)
        while frame is not None and _skipped(frame.f_code.co_filename):
            frame = frame.f_back
        return frame

    def _allowed(self, frame) -> bool:
        while frame is not None:
            for (suffix, function) in self.allow:
                if frame.f_code.co_name == function and frame.f_code.co_filename.endswith(suffix):
                    return True
            frame = frame.f_back
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._constructors and kwargs.get("device") is None and not _inherits_device(func, args):
            caller = self._caller()
            if not self._allowed(caller):
                where = "?" if caller is None else \
                    f"{caller.f_code.co_filename}:{caller.f_lineno} in {caller.f_code.co_name}"
                self.violations.append(where)
                if self.meta:
                    kwargs = dict(kwargs, device=torch.device("meta"))
        return func(*args, **kwargs)


def _inherits_device(func, args) -> bool:
    """``torch.as_tensor(t)`` / ``torch.asarray(t)`` of a tensor keep its device."""
    return getattr(func, "__name__", "") in ("as_tensor", "asarray") and bool(args) and isinstance(args[0], torch.Tensor)
