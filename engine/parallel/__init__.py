"""Parallel layouts and process groups: :class:`~hyflow.parallel.layout.Layout` is the one type that maps
ranks to (tp, cp, dp, pp) coordinates and back (a pool's layout starts at its first rank); the reshard
plan, the weight sync, placement and ``hyflow plan`` read ranks off it."""
