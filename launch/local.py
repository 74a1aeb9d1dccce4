"""``hyflow launch local``: torchrun on this machine.

The target is a job config (the ranks run ``hyflow train CONFIG [overrides]``) or
``doctor`` (the ranks run ``hyflow doctor [args]``). The config is validated for
the launched world size, and its files checked (:mod:`hyflow.jobs.preflight`), before any
process starts; ``torch.distributed`` then picks gloo on CPU and NCCL on GPU
(:func:`hyflow.parallel.distributed.init_distributed`). The ranks run under
:mod:`hyflow.launch.torchrun`: a rank failure is reported in a few lines (tracebacks in
per-rank log files under ``<run dir>/logs/<launch time>/``), a stop signal gives the ranks the
grace period of :mod:`hyflow.launch.grace` to save, and a clean stop exits 0.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from hyflow.checkpoint.manifest import apply_verify_setting
from hyflow.jobs.preflight import preflight
from hyflow.jobs.registry import load_job_config
from hyflow.launch.grace import preemption_grace
from hyflow.launch.torchrun import run
from hyflow.parallel.distributed import set_rank_env

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
        cfg: the validated job config.
    """

    command: str
    config: Optional[str] = None
    args: list[str] = field(default_factory=list)
    job: Optional[str] = None
    output_dir: Optional[str] = None
    cfg: Any = field(default=None, repr=False, compare=False)

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
    overrides = [a for a in args if not a.startswith("trainer.nproc=")]
    overrides += [f"trainer.nproc={world_size}", *extra_overrides]
    cfg = load_job_config(target, overrides)
    output_dir = os.path.abspath(cfg.trainer.output_dir)
    return Target(command="train", config=os.path.abspath(target), args=overrides,
                  job=getattr(cfg, "job", None), output_dir=output_dir, cfg=cfg)


def check_before_launch(target: Target) -> None:
    """What must pass before ranks start for ``target``: the job's pre-flight file checks
    (:mod:`hyflow.jobs.preflight`; a :class:`~hyflow.config.ConfigError` names the key and the
    path). Notes from validating the config are printed first."""
    if target.cfg is None:
        return
    apply_verify_setting(target.cfg)  # trainer.verify_checkpoints=false: as --no-verify, here and in the ranks

    for note in getattr(target.cfg, "notes", []):
        print(f"[hyflow] note: {note}", file=sys.stderr, flush=True)
    preflight(target.cfg)


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
    """``python -m hyflow.launch.torchrun --standalone --nproc-per-node N [extra] -m hyflow.cli ...``
    (torchrun's command line, run by :mod:`hyflow.launch.torchrun`)."""
    return [python, "-m", "hyflow.launch.torchrun", "--standalone", f"--nproc-per-node={nproc}",
            *extra, "-m", "hyflow.cli", *target.hyflow_argv()]


#: Signals the agent forwards to the ranks (SIGUSR1: Slurm's warning before the time limit).
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def new_log_dir(run_dir: str) -> str:
    """``<run_dir>/logs/<YYYYmmdd-HHMMSS>``: where one launch's rank logs go (not created)."""
    base = os.path.join(run_dir, "logs", time.strftime("%Y%m%d-%H%M%S"))
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def launch_local(target: Target, nproc: int, dry_run: bool = False) -> int:
    """Start ``nproc`` ranks on this machine and wait; returns the exit code (0 also after a
    stop signal every rank handled by saving). A stopping rank gets the run's grace period
    (:func:`hyflow.launch.grace.preemption_grace`; 300 s for doctor) before it is killed."""
    gpus = visible_gpus()
    if gpus and nproc > gpus:
        raise LaunchError(
            f"--nproc {nproc} but this machine shows {gpus} GPU(s); one rank per GPU: "
            f"use --nproc {gpus} or fewer, or `hyflow launch slurm` for more machines")
    grace_s, grace_note = 300, "300 s"
    if target.cfg is not None and hasattr(target.cfg, "trainer"):
        grace = preemption_grace(target.cfg, nproc)
        grace_s, grace_note = grace.seconds, grace.describe()
    cmd = torchrun_command(target, nproc, extra=[f"--shutdown-timeout={grace_s}",
                                                 f"--signals-to-handle={FORWARDED_SIGNALS}"])
    run_dir = target.output_dir or os.path.abspath(os.path.join("runs", target.command))
    log_dir = new_log_dir(run_dir)
    print(f"[hyflow] launching {nproc} rank{'' if nproc == 1 else 's'}: {shlex.join(cmd)}", flush=True)
    print(f"[hyflow] rank logs: {log_dir}; on a stop signal (SIGTERM, SIGUSR1) the ranks get "
          f"{grace_note} to save", flush=True)
    if dry_run:
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    set_rank_env()  # CUDA_DEVICE_MAX_CONNECTIONS=1, as the Slurm launcher sets it

    return run(cmd[3:], log_dir=log_dir, run_dir=target.output_dir)


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
