"""``hyflow doctor``: versions, GPU topology, environment and collective bandwidth of the
launched ranks, checked against pass/warn thresholds."""
