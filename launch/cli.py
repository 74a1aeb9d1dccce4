"""``hyflow launch local|slurm TARGET [args]``: start a job's ranks on this machine or on Slurm.

``TARGET`` is a job config (the ranks run ``hyflow train TARGET [overrides]``) or
``doctor`` (the ranks run ``hyflow doctor``; its own options go after ``--``)::

    hyflow launch local configs/quickstart.yaml --nproc 2 trainer.total_steps=10
    hyflow launch local doctor --nproc 2
    hyflow launch slurm configs/qwen2_72b_1024gpu.yaml --nodes 128 --gpus-per-node 8 \\
        --partition batch --time 04:00:00 --account proj --dry-run
    hyflow launch slurm doctor --nodes 2 --gpus-per-node 8 -- --max-size 1GiB
"""

from __future__ import annotations

import argparse
import os
import sys

from hyflow.cli_support import IntermixedParser
from hyflow.checkpoint.manifest import NO_VERIFY_ENV
from hyflow.config import ConfigError
from hyflow.jobs.registry import load_job_config
from hyflow.launch.local import LaunchError, check_before_launch, launch_local, resolve_target
from hyflow.launch.slurm import SlurmOptions, render_sbatch, run_dir_for, shared_fs_warning, submit, write_sbatch
from hyflow.plan.core import PlanOptions, build_plan


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="job config (YAML) or 'doctor'")
    p.add_argument("args", nargs="*",
                   help="key=value overrides for a config; arguments of doctor after --")


def _fail(message: str, code: int = 2) -> int:
    print(f"hyflow launch: {message}", file=sys.stderr)
    return code


def cmd_local(args: argparse.Namespace) -> int:
    nproc = args.nproc
    _no_verify(args)
    try:
        if nproc is None:
            nproc = 1
            if args.target.endswith((".yaml", ".yml")):
                nproc = load_job_config(args.target, args.args).trainer.nproc
        target = resolve_target(args.target, args.args, nproc)
        check_before_launch(target)
    except (ConfigError, LaunchError) as e:
        return _fail(str(e))
    try:
        return launch_local(target, nproc, dry_run=args.dry_run)
    except LaunchError as e:
        return _fail(str(e))


def _no_verify(args: argparse.Namespace) -> None:
    """``--no-verify``: the ranks skip checkpoint checksums (they inherit the environment)."""
    if getattr(args, "no_verify", False):
        os.environ[NO_VERIFY_ENV] = "1"


def cmd_slurm(args: argparse.Namespace) -> int:
    opts = SlurmOptions(
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, partition=args.partition,
        time=args.time, account=args.account, container_image=args.container_image,
        container_mounts=args.container_mounts, job_name=args.job_name, torchrun=args.torchrun,
        cpus_per_node=args.cpus_per_node, env=args.env or [], sbatch_args=args.sbatch_arg or [],
        grace_s=args.grace, max_requeues=args.max_requeues)
    try:
        opts.validate()
        target = resolve_target(args.target, args.args, opts.world_size)
        if not args.no_preflight:  # files, reward function, checkpoints: before the queue wait
            check_before_launch(target)
        if target.command == "train" and not args.no_plan_check:
            _plan_check(target, opts)
        warning = shared_fs_warning(run_dir_for(target, os.path.abspath(opts.workdir or os.getcwd())), opts.nodes)
        if warning:
            print(f"hyflow launch: warning: {warning}", file=sys.stderr)
        if args.dry_run:
            sys.stdout.write(render_sbatch(target, opts))
            return 0
        text = render_sbatch(target, opts)
        path = write_sbatch(text, target, opts)
        job_id = submit(path)
    except (ConfigError, LaunchError) as e:
        return _fail(str(e))
    run_dir = path.rsplit("/", 1)[0]
    print(f"[hyflow] submitted job {job_id}: {path}\n"
          f"[hyflow] logs: {run_dir}/logs/slurm-{job_id}.out and {run_dir}/logs/{job_id}/")
    return 0


def _plan_check(target, opts) -> None:
    """Refuse to submit a job that ``hyflow plan`` already knows cannot run."""
    result = build_plan(target.config, target.args,
                        PlanOptions(world_size=opts.world_size, megatron_ranks=()))
    if result.errors:
        raise LaunchError("`hyflow plan` rejects this job at "
                          f"{opts.world_size} ranks:\n  " + "\n  ".join(result.errors)
                          + "\n(--no-plan-check submits anyway)")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``hyflow launch local`` and ``hyflow launch slurm``."""
    launch = subparsers.add_parser(
        "launch", help="start a job's ranks: torchrun here (local) or sbatch (slurm)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = launch.add_subparsers(dest="mode", metavar="MODE", parser_class=IntermixedParser)
    launch.set_defaults(func=lambda a: (launch.print_help(), 2)[1])

    local = modes.add_parser("local", help="torchrun on this machine (gloo on CPU, NCCL on GPU)",
                             description="Start ranks on this machine with torchrun --standalone; "
                                         "the config is validated for --nproc ranks first.")
    _common(local)
    local.add_argument("--nproc", type=int, help="ranks to start (default: trainer.nproc, 1 for doctor)")
    local.add_argument("--dry-run", action="store_true", help="print the torchrun command only")
    local.add_argument("--no-verify", action="store_true",
                       help="skip checkpoint checksums when resuming / loading (sizes and pickles are still checked)")
    local.set_defaults(func=cmd_local)

    slurm = modes.add_parser(
        "slurm", help="render an sbatch script into the run directory and submit it",
        description="Render <run dir>/hyflow.sbatch (one srun task per node running torchrun with a "
                    "c10d rendezvous on the first node; logs in <run dir>/logs/<job id>/, one file per "
                    "rank; SIGUSR1 before the time limit saves, requeues and resumes; SIGTERM saves and "
                    "stops) and submit it with sbatch. The config, its files and `hyflow plan` are "
                    "checked first.")
    _common(slurm)
    slurm.add_argument("--nodes", type=int, required=True, help="nodes (one srun task each)")
    slurm.add_argument("--gpus-per-node", type=int, required=True, help="ranks per node")
    slurm.add_argument("--partition", help="Slurm partition")
    slurm.add_argument("--time", help="time limit, e.g. 04:00:00")
    slurm.add_argument("--account", help="Slurm account")
    slurm.add_argument("--container-image", help="pyxis/enroot image for the ranks")
    slurm.add_argument("--container-mounts", help="pyxis mounts, e.g. /data:/data,/ckpt:/ckpt")
    slurm.add_argument("--job-name", help="Slurm job name (default hyflow-<run dir name>)")
    slurm.add_argument("--torchrun", help="torchrun command on the compute nodes")
    slurm.add_argument("--cpus-per-node", type=int, help="CPUs of each node's task (default: all)")
    slurm.add_argument("--env", action="append", metavar="KEY=VALUE",
                       help="export KEY=VALUE on the nodes (repeatable; beats the NCCL defaults)")
    slurm.add_argument("--sbatch-arg", action="append", metavar="OPTION",
                       help="extra #SBATCH option, e.g. --sbatch-arg=--qos=high (repeatable)")
    slurm.add_argument("--grace", type=int, default=None,
                       help="seconds before the time limit at which SIGUSR1 asks for a save, and that torchrun "
                            "waits for stopping ranks (default: from the run's measured step and save times, "
                            "or estimated from the model size)")
    slurm.add_argument("--max-requeues", type=int, default=20,
                       help="requeues allowed (after preemption by the script, or by Slurm)")
    slurm.add_argument("--no-plan-check", action="store_true",
                       help="submit even when `hyflow plan` finds the job does not fit")
    slurm.add_argument("--no-preflight", action="store_true",
                       help="submit without checking the config's files here (paths that exist only on the "
                            "compute nodes)")
    slurm.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    slurm.set_defaults(func=cmd_slurm)
