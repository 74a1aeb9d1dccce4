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
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Optional, Sequence

from hyflow.launch.rank_report import LOG_DIR_ENV


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

# Set by a launcher that starts ranks through torchrun: the ranks' hyflow arguments as a JSON
# list. torchrun's own parser would otherwise read options after ``-m hyflow.cli`` as its own
# (``--n`` is an ambiguous prefix of ``--nnodes`` / ``--nproc-per-node``) and stop with an error.
RANK_ARGV_ENV = "HYFLOW_RANK_ARGV"


def run_ranks_here(command: str, world: int) -> int:
    """Run this ``hyflow COMMAND ...`` command line again as ``world`` ranks on this machine through
    torchrun (a command whose ``--tp``/``--pp``/``--dp`` ask for several ranks); its exit code.
    Only from the command line: the ranks re-read ``sys.argv``."""
    if sys.argv[1:2] != [command]:
        print(f"hyflow: run `hyflow {command} ...` from the command line for several ranks", file=sys.stderr)
        return 2
    # hyflow's torchrun: a rank's failure is one line (tracebacks in the rank logs), not torchrun's dump
    cmd = [sys.executable, "-m", "hyflow.launch.torchrun", "--standalone", f"--nproc-per-node={world}",
           "-m", "hyflow.cli"]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env[RANK_ARGV_ENV] = json.dumps(sys.argv[1:])  # not on torchrun's command line: see RANK_ARGV_ENV
    env[LOG_DIR_ENV] = tempfile.mkdtemp(prefix=f"hyflow-{command}-logs-")
    return subprocess.call(cmd, env=env)
