"""Preemption contract between ``hyflow launch slurm`` and the ranks.

Launcher side: the job is submitted with ``--signal=USR1@<grace>`` and ``--requeue``. On every
node the sbatch script starts torchrun with SIGUSR1 ignored (torchrun would die of it and take
the ranks along), forwards the signal to the ranks (torchrun's children) and marks it; when
the ranks have exited, a marked job requeues itself (``scontrol requeue``) and the new run
resumes from the last checkpoint (``trainer.resume=auto``).

Rank side: on SIGUSR1 (or SIGTERM), finish the current step, agree across ranks, save, exit
0. The RL trainer does this with :class:`hyflow.training.supervisor.StepSupervisor`; other
entry points (scripts, the ``lm`` job) can use the minimal :class:`PreemptionFlag`::

    stop = PreemptionFlag.install()          # once, after init_distributed()
    for step in ...:
        train_step(...)
        if stop.agreed():                    # collective: every rank calls it every step
            save_checkpoint(...)
            return                           # exit 0: the batch script requeues the job

and the requeued job resumes from the checkpoint (``trainer.resume=auto``). :meth:`agreed`
all-reduces the flag (MAX) so that all ranks stop after the same step even when the signal
reaches them at slightly different times.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist


class PreemptionFlag:
    """Set by SIGUSR1 (or another signal given to :meth:`install`); never cleared."""

    def __init__(self) -> None:
        self.requested = False
        self.signum: Optional[int] = None

    @classmethod
    def install(cls, signals: Iterable[int] = (signal.SIGUSR1,)) -> "PreemptionFlag":
        """Install the handler for ``signals`` (main thread only) and return the flag."""
        flag = cls()
        for sig in signals:
            signal.signal(sig, flag._handle)
        return flag

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.requested:
            print(f"[hyflow] rank {os.environ.get('RANK', '?')}: received signal {signum}; "
                  "will save and exit after the current step", flush=True)
        self.requested = True
        self.signum = signum

    def agreed(self, group: Any = None) -> bool:
        """True on every rank once any rank has the flag (a MAX all-reduce over ``group``).

        Without an initialised process group this is just :attr:`requested`.
        """
        if not dist.is_available() or not dist.is_initialized():
            return self.requested
        device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        value = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return bool(value.item())
