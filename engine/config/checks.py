"""Checks a config section's ``validate()`` calls on several of its fields at once; each raises
:class:`~hyflow.config.ConfigError` naming the field (the loader prepends the section's path)."""

from __future__ import annotations

import math
from typing import Any

from hyflow.config.core import ConfigError


def check_finite(obj: Any, *names: str) -> None:
    """Each of ``names`` is None or a finite number (no NaN / inf)."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and not math.isfinite(value):
            raise ConfigError(f"must be a finite number, got {value}", key=name)


def check_positive(obj: Any, *names: str) -> None:
    """Each of ``names`` is a count >= 1."""
    for name in names:
        value = getattr(obj, name)
        if value is None or value < 1:
            raise ConfigError(f"must be >= 1, got {value}", key=name)
