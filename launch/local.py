"""``hyflow launch local``: torchrun on this machine.

The target is a job config (the ranks run ``hyflow train CONFIG [overrides]``) or
``doctor`` (the ranks run ``hyflow doctor [args]``). The config is validated for
the launched world size before any process starts; ``torch.distributed`` then
picks gloo on CPU and NCCL on GPU (:func:`hyflow.parallel.distributed.init_distributed`).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence

#: Targets that are hyflow subcommands rather than config files.
RANK_COMMANDS = ("doctor",)


class LaunchError(ValueError):
    """A launch request that cannot work; the message says why and what to change."""


@dataclass
class Target:
    """What every rank runs: ``hyflow <command> [config] <args>``.

    Attributes:
        command: ``train`` or a name from :data:`RANK_COMMANDS`.
        config: absolute path of the job config (``train`` only).
        args: overrides (``train``) or the subcommand's own arguments.
        job: the config's ``job`` key (``lm``, ``rl``) once validated.
        output_dir: the config's ``trainer.output_dir`` (absolute) once validated.
    """

    command: str
    config: Optional[str] = None
    args: list[str] = field(default_factory=list)
    job: Optional[str] = None
    output_dir: Optional[str] = None

    def hyflow_argv(self) -> list[str]:
        """Arguments after ``python -m hyflow.cli``."""
        head = [self.command] + ([self.config] if self.config else [])
        return head + list(self.args)


def resolve_target(target: str, args: Sequence[str], world_size: int,
                   extra_overrides: Sequence[str] = ()) -> Target:
    """Validate ``target`` for ``world_size`` ranks and return what the ranks run.

    For a config, ``trainer.nproc=<world_size>`` is appended to the overrides (so the
    ranks validate the same layout), then the config is parsed and validated here;
    a :class:`hyflow.config.ConfigError` propagates with its message.
    """
    if world_size < 1:
        raise LaunchError(f"the number of ranks must be >= 1, got {world_size}")
    if target in RANK_COMMANDS:
        return Target(command=target, args=list(args))
    if not os.path.isfile(target):
        raise LaunchError(
            f"{target!r} is neither a config file nor one of {', '.join(RANK_COMMANDS)}")
    from hyflow.cli import load_job_config

    overrides = [a for a in args if not a.startswith("trainer.nproc=")]
    overrides += [f"trainer.nproc={world_size}", *extra_overrides]
    cfg = load_job_config(target, overrides)
    output_dir = os.path.abspath(cfg.trainer.output_dir)
    return Target(command="train", config=os.path.abspath(target), args=overrides,
                  job=getattr(cfg, "job", None), output_dir=output_dir)


def visible_gpus() -> Optional[int]:
    """GPUs on this machine per ``nvidia-smi -L`` (None when there is no NVIDIA driver)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    count = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip()]))
    return count


def torchrun_command(target: Target, nproc: int, python: str = sys.executable,
                     extra: Sequence[str] = ()) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N -m hyflow.cli ...``."""
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            *extra, "-m", "hyflow.cli", *target.hyflow_argv()]


def launch_local(target: Target, nproc: int, dry_run: bool = False) -> int:
    """Start ``nproc`` ranks on this machine and wait; returns torchrun's exit code."""
    gpus = visible_gpus()
    if gpus and nproc > gpus:
        raise LaunchError(
            f"--nproc {nproc} but this machine shows {gpus} GPU(s); one rank per GPU: "
            f"use --nproc {gpus} or fewer, or `hyflow launch slurm` for more machines")
    cmd = torchrun_command(target, nproc)
    print(f"[hyflow] launching {nproc} rank(s): {shlex.join(cmd)}", flush=True)
    if dry_run:
        return 0
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return run_forwarding_signals(cmd, env)


def run_forwarding_signals(cmd: list[str], env: Optional[dict] = None,
                           signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)) -> int:
    """Run ``cmd`` (torchrun) and wait; SIGTERM / SIGINT / SIGUSR1 sent to this process are
    passed on to it (torchrun hands them to the ranks, which checkpoint and stop), instead of
    killing the launcher and leaving the ranks running. Returns the child's exit code."""
    child = subprocess.Popen(cmd, env=env)
    previous = {}

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(signum)

    for sig in signals:
        previous[sig] = signal.signal(sig, forward)
    try:
        return child.wait()  # (interrupted waits are retried after the handler runs)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
