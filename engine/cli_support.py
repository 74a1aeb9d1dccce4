"""Command-line support shared by the ``hyflow`` subcommands (``launch``, ``plan``, ``doctor``,
``data``, ``bench``): argument parsing only; library code never imports this module.

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
