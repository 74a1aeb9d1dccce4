"""Byte sizes for people: how reports print them and how command lines read them."""

from __future__ import annotations

import argparse


def parse_size(text: str) -> int:
    """Bytes of a size such as ``64MB``, ``1GiB``, ``512k`` or ``1048576`` (binary units).

    Raises ``argparse.ArgumentTypeError`` (a plain ``Exception``) so it serves directly as an
    argparse ``type=``; the message names the text and gives examples.
    """
    units = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
             "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abgikm")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 64MB, 1GiB, 4096)") from None
    if unit not in units or value <= 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 64MB, 1GiB, 4096)")
    return int(value * units[unit])


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``1.5 GiB``, ``64 MiB``, ``512 B``."""
    n = float(n)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) and value >= 10 else f"{value:.2f} {unit}"
    return f"{int(n)} B"
