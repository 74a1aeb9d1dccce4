"""The converter's error type."""

from __future__ import annotations


class ConversionError(ValueError):
    """Bad converter input (unsupported model, missing or damaged files, bad layout...).

    Raised by the pre-flight checks before any heavy work; the message names the
    offending file, tensor or number and what to do about it.
    """
