"""``hyflow plan``: a job's layouts, process groups, reshard traffic and per-GPU memory,
worked out offline (no GPU, one CPU process) for any world size."""
