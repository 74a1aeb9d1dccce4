"""``hyflow launch slurm``: render an sbatch script into the run directory and submit it.

The script (:mod:`hyflow.launch.sbatch_template`) runs one ``srun`` task per node; each
runs ``python -m hyflow.launch.torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d
--rdzv-endpoint <first node>:<port>`` with the python found on the compute node (the first node
coming from ``scontrol show hostnames``). Logs go to ``<run dir>/logs/slurm-<job id>.out`` (the
batch script), ``<run dir>/logs/<job id>/node-<n>.out`` (one file per node: its local rank 0)
and ``<run dir>/logs/<job id>/ranks-<restart>/`` (every rank's output, tracebacks and the
failure records the summary is made from). ``--signal=USR1@<grace>`` and ``--requeue`` make a
time-limited job save, requeue itself (a bounded number of times, and only after saving a new
checkpoint) and resume (``trainer.resume=auto``); the grace period comes from the run's measured
save and step times (:mod:`hyflow.launch.grace`).

Quoting: every value that reaches bash goes through :func:`shlex.quote`; ``#SBATCH``
values, which Slurm (not bash) parses, go through :func:`sbatch_quote`.
"""

from __future__ import annotations

import datetime
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Optional

from hyflow.config import config_keys
from hyflow.jobs.registry import job_schema
from hyflow.launch.grace import preemption_grace
from hyflow.launch.local import LaunchError, Target
from hyflow.launch.sbatch_template import TEMPLATE

#: NCCL / torch environment defaults (each overridable by the submitting environment).
ENV_DEFAULTS: dict[str, tuple[str, str]] = {
    "NCCL_DEBUG": ("WARN", "NCCL log level (INFO to debug hangs and topology)"),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("1", "abort the job on a failed or timed-out collective"),
    "TORCH_NCCL_AVOID_RECORD_STREAMS": ("1", "free NCCL buffers promptly"),
    "CUDA_DEVICE_MAX_CONNECTIONS": ("1", "Megatron: keep TP/SP communication ordered with compute"),
    "NCCL_IB_TIMEOUT": ("22", "longer InfiniBand retry timeout for large jobs"),
    "NCCL_NVLS_ENABLE": ("0", "NVLink SHARP buffers cost GPU memory; enable explicitly"),
    "PYTHONUNBUFFERED": ("1", "logs appear as they are written"),
    "OMP_NUM_THREADS": ("8", "CPU threads per rank"),
}

_SAFE_DIRECTIVE = re.compile(r"^[A-Za-z0-9_./:@+=,%-]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class SlurmOptions:
    """What ``hyflow launch slurm`` was asked for.

    Attributes:
        nodes: number of nodes (one srun task each).
        gpus_per_node: ranks per node (one per GPU).
        partition, time, account: the usual sbatch options (omitted when None).
        container_image, container_mounts: pyxis/enroot container for the ranks.
        job_name: Slurm job name (default ``hyflow-<run dir name>``).
        torchrun: the torchrun command on the compute nodes, shell-split (default:
            ``python -m hyflow.launch.torchrun`` with the python that imports hyflow on the
            node's PATH, or ``$HYFLOW_PYTHON``).
        cpus_per_node: CPUs for the node's srun task (default: all of the node's CPUs).
        env: ``KEY=VALUE`` pairs exported before srun (they override the defaults).
        sbatch_args: extra ``#SBATCH`` options, e.g. ``--qos=high``.
        grace_s: seconds before the time limit at which SIGUSR1 is sent, and how long torchrun
            waits for stopping ranks (default: :func:`hyflow.launch.grace.preemption_grace`).
        max_requeues: how often the job may be requeued (by itself or by Slurm).
        workdir: the job's working directory (default: the current one).
    """

    nodes: int
    gpus_per_node: int
    partition: Optional[str] = None
    time: Optional[str] = None
    account: Optional[str] = None
    container_image: Optional[str] = None
    container_mounts: Optional[str] = None
    job_name: Optional[str] = None
    torchrun: Optional[str] = None
    cpus_per_node: Optional[int] = None
    env: list[str] = field(default_factory=list)
    sbatch_args: list[str] = field(default_factory=list)
    grace_s: Optional[int] = None
    max_requeues: int = 20
    workdir: Optional[str] = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def validate(self) -> None:
        """Raise :class:`LaunchError` for options that cannot produce a working job."""
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise LaunchError(f"--nodes and --gpus-per-node must be >= 1, got {self.nodes} and "
                              f"{self.gpus_per_node}")
        if (self.grace_s is not None and self.grace_s < 1) or self.max_requeues < 0:
            raise LaunchError("--grace must be >= 1 s and --max-requeues >= 0")
        if self.container_mounts and not self.container_image:
            raise LaunchError("--container-mounts needs --container-image")
        for item in self.env:
            name = item.split("=", 1)[0]
            if "=" not in item or not _ENV_NAME.match(name):
                raise LaunchError(f"--env {item!r}: expected KEY=VALUE with a shell variable name")
        for arg in self.sbatch_args:
            if not arg.startswith("-"):
                raise LaunchError(f"--sbatch-arg {arg!r}: expected an sbatch option such as --qos=high")


def sbatch_quote(value: str) -> str:
    """Quote a value for an ``#SBATCH`` line (Slurm's own parser: quotes and backslashes)."""
    if "\n" in value or "\r" in value:
        raise LaunchError(f"value {value!r} for an #SBATCH line contains a newline")
    if _SAFE_DIRECTIVE.match(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


#: Stands for ``<python on the node> -m hyflow.launch.torchrun``, resolved by the script on
#: each compute node (a login node's absolute path may not exist there).
NODE_TORCHRUN = "hyflow-torchrun"


def torchrun_argv(opts: SlurmOptions) -> list[str]:
    """The torchrun command compute nodes run (see :class:`SlurmOptions`); ``--torchrun`` is
    split like a shell would (``--torchrun "python -m torch.distributed.run"``)."""
    if opts.torchrun:
        return shlex.split(opts.torchrun)
    return [NODE_TORCHRUN]


#: File systems a run directory shared by the nodes is typically on.
SHARED_FS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "glusterfs", "panfs", "wekafs",
             "cifs", "smb3", "smbfs", "afs", "orangefs", "pvfs2", "fuse.juicefs", "fuse.weka", "9p", "virtiofs",
             "quobyte", "vast", "fuse.ceph-fuse", "fuse.glusterfs", "fuse.s3fs", "fuse.gcsfuse")


def filesystem_type(path: str, mounts: str = "/proc/mounts") -> Optional[str]:
    """The type of the file system ``path`` is on, from ``/proc/mounts`` (None when unknown)."""
    path = os.path.realpath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    best, kind = "", None
    try:
        with open(mounts) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                point = parts[1].replace("\\040", " ")
                if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                    best, kind = point, parts[2]
    except OSError:
        return None
    return kind


def shared_fs_warning(run_dir: str, nodes: int, mounts: str = "/proc/mounts") -> Optional[str]:
    """A warning when a multi-node job's run directory is on a node-local file system."""
    kind = filesystem_type(run_dir, mounts)
    if nodes < 2 or kind is None or kind in SHARED_FS or kind.startswith("fuse."):
        return None
    return (f"the run directory {run_dir} is on a {kind} file system, usually local to this machine: the "
            f"{nodes} nodes must all read and write it (checkpoints, logs, resume). Put trainer.output_dir on "
            "shared storage (NFS, Lustre, GPFS, ...); the job checks this when it starts")


def _needs_resume(target: Target) -> list[str]:
    """``trainer.resume=auto`` when the job schema has that key and the user did not set it."""
    if target.command != "train" or any(a.startswith("trainer.resume=") for a in target.args):
        return []
    schema, _ = job_schema(target.config, target.args)
    return ["trainer.resume=auto"] if "trainer.resume" in config_keys(schema) else []


def run_dir_for(target: Target, workdir: str) -> str:
    """The run directory: ``trainer.output_dir`` of a job, ``runs/doctor`` for doctor."""
    if target.output_dir:
        return target.output_dir
    return os.path.join(workdir, "runs", target.command)


def grace_for(target: Target, opts: SlurmOptions) -> tuple[int, str]:
    """(seconds, how they were derived): ``--grace``, else the run's grace period."""
    if opts.grace_s is not None:
        return opts.grace_s, "--grace"
    if target.cfg is not None and hasattr(target.cfg, "trainer"):
        grace = preemption_grace(target.cfg, opts.world_size)
        return grace.seconds, grace.describe()
    return 120, "default for jobs without checkpoints"


@dataclass(frozen=True)
class PoolNodes:
    """A rank pool of a pooled placement on its nodes: torchrun's node ``i`` runs ranks
    ``i*g .. i*g+g-1`` (``g`` = ``--gpus-per-node``)."""

    name: str
    first_rank: int
    last_rank: int
    first_node: int
    last_node: int
    roles: tuple[str, ...]

    def describe(self) -> str:
        nodes = (f"node {self.first_node}" if self.first_node == self.last_node
                 else f"nodes {self.first_node}-{self.last_node}")
        return (f"pool {self.name} ({', '.join(self.roles)}): ranks {self.first_rank}-{self.last_rank} on {nodes} "
                f"(node_rank {self.first_node}..{self.last_node})")


def pool_nodes(target: Target, opts: SlurmOptions) -> list[PoolNodes]:
    """The node range of each pool of ``target``'s placement (``placement.pools``, or the half /
    half split of ``trainer.mode: one_step_off``); empty for a colocated job. A pool that does not
    start and end on a node boundary is a :class:`LaunchError` naming it: a node's GPUs would be
    shared by two pools, which the pools' layouts and the generation / training overlap assume
    they are not."""
    cfg = target.cfg
    if cfg is None or not hasattr(cfg, "resolved_placement"):
        return []
    placement = cfg.resolved_placement(opts.world_size)
    if placement.colocated:
        return []
    g = opts.gpus_per_node
    out = []
    for pool in placement.pools:
        roles = tuple(role for role, rp in placement.roles.items() if rp.pool.name == pool.name)
        if pool.start % g or pool.stop % g:
            raise LaunchError(
                f"placement pool {pool.name!r} (ranks {pool.start}-{pool.stop - 1}: {', '.join(roles)}) does not start "
                f"and end on a node boundary with --gpus-per-node {g} (node i runs ranks i*{g}..i*{g}+{g - 1}): give "
                f"every pool a multiple of {g} ranks starting at a multiple of {g} (placement.pools)")
        out.append(PoolNodes(pool.name, pool.start, pool.stop - 1, pool.start // g, pool.stop // g - 1, roles))
    return out


def expert_notes(target: Target, opts: SlurmOptions) -> list[str]:
    """For a mixture-of-experts actor trained with expert parallelism: where its all-to-all groups
    fall on the nodes (an EP group is ``ep`` ranks ``etp`` apart inside a pipeline stage's block of
    ``tp * cp * dp`` ranks, Megatron-Core's expert grid), as comment lines for the script."""
    cfg = target.cfg
    if cfg is None or getattr(getattr(cfg, "model", None), "moe", None) is None or not hasattr(cfg, "actor_layout"):
        return []
    layout = cfg.actor_layout(opts.world_size)
    if layout.ep == 1:
        return []
    group = layout.expert_groups("ep")[0]
    g = opts.gpus_per_node
    nodes = group[-1] // g - group[0] // g + 1
    return [f"actor experts: ep={layout.ep} x etp={layout.expert_tp} (expert dp {layout.expert_dp}), "
            f"{cfg.model.moe.num_experts // layout.ep} of {cfg.model.moe.num_experts} experts per rank and layer; "
            f"an expert all-to-all group (e.g. ranks {group[0]}, {group[1]}, ... {group[-1]}) spans {nodes} node(s)"
            + (" (inter-node all-to-all: keep ep * etp within a node where the experts fit)" if nodes > 1 else "")]


def render_sbatch(target: Target, opts: SlurmOptions, script_path: Optional[str] = None) -> str:
    """The sbatch script for ``target`` under ``opts`` (pure: writes nothing)."""
    opts.validate()
    pools = pool_nodes(target, opts)
    grace, grace_how = grace_for(target, opts)
    workdir = os.path.abspath(opts.workdir or os.getcwd())
    run_dir = run_dir_for(target, workdir)
    script_path = script_path or os.path.join(run_dir, "hyflow.sbatch")
    job_name = opts.job_name or f"hyflow-{os.path.basename(run_dir.rstrip(os.sep)) or 'run'}"
    args = list(target.args) + _needs_resume(target)
    hyflow_cmd = ["-m", "hyflow.cli", target.command] + ([target.config] if target.config else [])
    hyflow_cmd += args

    directives = []
    for flag, value in (("partition", opts.partition), ("time", opts.time),
                        ("account", opts.account)):
        if value:
            directives.append(f"#SBATCH --{flag}={sbatch_quote(value)}")
    for arg in opts.sbatch_args:
        name, eq, value = arg.partition("=")
        directives.append(f"#SBATCH {name}={sbatch_quote(value)}" if eq else f"#SBATCH {name}")

    cpus = str(opts.cpus_per_node) if opts.cpus_per_node else '"${SLURM_CPUS_ON_NODE:-1}"'
    srun = [f"--nodes={opts.nodes}", f"--ntasks={opts.nodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=1", f"--cpus-per-task={cpus}",
            '--output="$LOG_DIR/node-%n.out"']
    if opts.container_image:
        srun.append("--container-image=" + shlex.quote(opts.container_image))
        if opts.container_mounts:
            srun.append("--container-mounts=" + shlex.quote(opts.container_mounts))
        srun.append("--container-workdir=" + shlex.quote(workdir))

    defaults = [f'export {k}="${{{k}:-{v}}}"  # {why}' for k, (v, why) in ENV_DEFAULTS.items()]
    forced = [f"export {k}={shlex.quote(v)}" for k, _, v in (e.partition("=") for e in opts.env)]
    world = opts.world_size
    title = (f"hyflow {target.command}"
             + (f" {os.path.basename(target.config)}" if target.config else "")
             + f" on Slurm: {opts.nodes} node(s) x {opts.gpus_per_node} GPU(s) = {world} ranks"
             + f" (rendered {datetime.datetime.now().isoformat(timespec='seconds')})")
    output = os.path.join(run_dir, "logs").replace("%", "%%") + "/slurm-%j.out"
    values = {
        "TITLE": title.replace("\n", " "),
        "SCRIPT": shlex.quote(script_path),
        "JOB_NAME": sbatch_quote(job_name),
        "NODES": str(opts.nodes),
        "GPUS": str(opts.gpus_per_node),
        "WORKDIR_DIRECTIVE": sbatch_quote(workdir),
        "OUTPUT_DIRECTIVE": sbatch_quote(output),
        "GRACE": str(grace),
        "GRACE_HOW": grace_how.replace("\n", " "),
        "REQUIRE_PROGRESS": "1" if target.command == "train" else "0",
        "EXTRA_DIRECTIVES": "".join(d + "\n" for d in directives),
        "RUN_DIR": shlex.quote(run_dir),
        "MAX_REQUEUES": str(opts.max_requeues),
        "HYFLOW_CMD": "\n".join("    " + shlex.quote(a) for a in hyflow_cmd),
        "ENV_DEFAULTS": "\n".join(defaults),
        "ENV_FORCED": "\n".join(forced) or "# (none)",
        "SRUN_ARGS": " \\\n    ".join(srun),
        "TORCHRUN": " ".join(shlex.quote(p) for p in torchrun_argv(opts)),
        "POOLS": ("".join(f"# {p.describe()}\n".replace("@@", "@") for p in pools)
                  or "# every role on every rank (placement: colocated)\n")
        + "".join(f"# {line}\n".replace("@@", "@") for line in expert_notes(target, opts)),
    }
    text = TEMPLATE
    for key, value in values.items():
        text = text.replace(f"@@{key}@@", value)
    if "@@" in text.replace("USR1@", ""):
        raise AssertionError("unfilled placeholder in the sbatch template")
    return text


def write_sbatch(text: str, target: Target, opts: SlurmOptions) -> str:
    """Write the script into the run directory (and create ``logs/``); returns its path."""
    workdir = os.path.abspath(opts.workdir or os.getcwd())
    run_dir = run_dir_for(target, workdir)
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    path = os.path.join(run_dir, "hyflow.sbatch")
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)
    return path


def submit(path: str) -> str:
    """``sbatch --parsable PATH``; returns the job id."""
    sbatch = shutil.which("sbatch")
    if not sbatch:
        raise LaunchError("sbatch is not on PATH (not a Slurm login node?); use --dry-run to "
                          f"print the script, or submit {path} from a machine that has Slurm")
    out = subprocess.run([sbatch, "--parsable", path], capture_output=True, text=True)
    if out.returncode != 0:
        raise LaunchError(f"sbatch failed (exit {out.returncode}): {out.stderr.strip()}")
    return out.stdout.strip().split(";")[0]
