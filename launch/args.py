"""Argument parsing shared by ``hyflow launch``, ``hyflow plan`` and ``hyflow doctor``.

These commands take a config, ``key=value`` overrides *and* options in any order
(``hyflow plan CONFIG --world-size 8 actor.layout.tp=4``). Plain argparse stops
collecting positionals at the first option, so the overrides after it would be
rejected; :class:`IntermixedParser` parses with ``parse_known_intermixed_args``.
Everything after a literal ``--`` is passed through untouched (that is how rank-level
options reach ``hyflow doctor`` through the launchers).
"""

from __future__ import annotations

import argparse
from typing import Any, Optional, Sequence


class IntermixedParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose positionals may be interleaved with options.

    Used as ``parser_class`` of a subparsers action, or installed on an existing
    parser with :func:`make_intermixed`. The parser must not have subparsers itself.
    """

    _in_intermixed = False

    def parse_known_args(self, args: Optional[Sequence[str]] = None,
                         namespace: Optional[argparse.Namespace] = None) -> Any:
        # parse_known_intermixed_args calls parse_known_args twice internally.
        if self._in_intermixed:
            return super().parse_known_args(args, namespace)
        self._in_intermixed = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._in_intermixed = False


def make_intermixed(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Turn a parser returned by ``subparsers.add_parser`` into an :class:`IntermixedParser`."""
    parser.__class__ = IntermixedParser
    return parser


def parse_size(text: str) -> int:
    """Bytes of a size such as ``64MB``, ``1GiB``, ``512k`` or ``1048576`` (binary units)."""
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
