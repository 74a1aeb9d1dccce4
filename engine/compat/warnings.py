"""Third-party warnings that every run would print and that say nothing about it, filtered once
per rank (:func:`quiet_known_warnings`, called before a job runs). Each filter matches one message
exactly; anything else still shows.

* Megatron-Core's ``tensor_parallel.layers``: "When using async grad allreduce (sequence parallelism)
  it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1" at TP > 1 (on the
  CPU there is no such connection; on GPUs the launchers decide the environment).
* torch's deprecation of ``all_gather_into_tensor``, which Megatron-Core 0.16's distributed
  optimizer and DDP call (not hyflow's code).
"""

from __future__ import annotations

import warnings

KNOWN = (
    (UserWarning, r"When using (async grad allreduce|sequence parallelism) it is recommended to set the "
                  r"environment variable CUDA_DEVICE_MAX_CONNECTIONS"),
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated"),
)


def quiet_known_warnings() -> None:
    """Ignore the :data:`KNOWN` warnings in this process."""
    for category, message in KNOWN:
        warnings.filterwarnings("ignore", message=message, category=category)
