"""What ``hyflow doctor`` reports about one machine: versions, GPUs and their topology,
and the environment variables that change how the job communicates."""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import shutil
import subprocess
from typing import Any, Optional

import psutil
import torch

PACKAGES = ("hyflow", "torch", "megatron-core", "transformer-engine", "triton", "numpy")
#: Environment prefixes / names worth showing (never anything that looks like a secret).
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED", "CUDA_", "OMP_", "MKL_", "GLOO_",
                "SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NODELIST", "SLURM_JOB_NODELIST",
                "SLURM_PROCID", "SLURM_NODEID", "HYFLOW_", "PYTORCH_CUDA_ALLOC_CONF",
                "TORCHELASTIC_", "NVIDIA_VISIBLE_DEVICES")
ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
             "MASTER_PORT", "PYTHONUNBUFFERED")
_SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL")


def versions() -> dict[str, str]:
    """Installed versions of hyflow's main dependencies plus CUDA / NCCL / cuDNN."""
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in PACKAGES:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    try:
        # torch loads only when the command runs: `hyflow --help` imports this module
        import torch

        out["cuda (torch build)"] = torch.version.cuda or "none (CPU build)"
        out["cuda available"] = str(torch.cuda.is_available())
        if torch.cuda.is_available():
            nccl = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
            out["cudnn"] = str(torch.backends.cudnn.version())
        else:
            out["nccl"] = "n/a (no CUDA)"
    except ImportError:  # pragma: no cover - torch is a hard dependency
        out["torch"] = "not importable"
    return out


def gpus() -> list[dict[str, Any]]:
    """One entry per visible GPU (empty without CUDA)."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                    "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count})
    return out


def topology() -> Optional[str]:
    """``nvidia-smi topo -m`` (the GPU/NIC interconnect matrix) when the driver is present."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def relevant_env(environ: Optional[dict[str, str]] = None) -> dict[str, str]:
    """Communication-relevant environment variables, secrets excluded."""
    environ = dict(os.environ if environ is None else environ)
    out = {}
    for name in sorted(environ):
        if any(word in name.upper() for word in _SECRET_WORDS):
            continue
        if name in ENV_NAMES or name.startswith(ENV_PREFIXES):
            out[name] = environ[name]
    return out


def cpu_info() -> dict[str, Any]:
    """CPU count and memory of this machine."""
    info: dict[str, Any] = {"cpus": os.cpu_count()}
    try:
        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
        info["affinity"] = len(psutil.Process().cpu_affinity() or [])
    except AttributeError:  # cpu_affinity: not on every platform
        pass
    return info


def network_interfaces() -> list[str]:
    """Names of this host's network interfaces."""
    try:
        return sorted(os.listdir("/sys/class/net"))
    except OSError:
        return sorted(psutil.net_if_addrs())


def _ifname_matches(spec: str, interfaces: list[str]) -> list[str]:
    """Interfaces NCCL_SOCKET_IFNAME selects: comma list of prefixes, ``=`` exact, ``^`` exclude."""
    spec = spec.strip()
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    names = [s for s in spec.lstrip("=").split(",") if s]
    hit = [i for i in interfaces if any(i == n if exact else i.startswith(n) for n in names)]
    return [i for i in interfaces if i not in hit] if exclude else hit


def nccl_env_verdicts(environ: Optional[dict[str, str]] = None, *, multi_node: bool = False,
                      on_gpu: bool = False, interfaces: Optional[list[str]] = None) -> list[dict[str, Any]]:
    """One verdict per NCCL variable that decides how a large job fails or communicates:
    ``{"name", "value", "status": ok|warn|info, "message"}``."""
    env = dict(os.environ if environ is None else environ)
    out: list[dict[str, Any]] = []

    def add(name: str, status: str, message: str) -> None:
        out.append({"name": name, "value": env.get(name), "status": status, "message": message})

    torch_name, old_name = "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"
    value = env.get(torch_name, env.get(old_name))
    if value is None:
        add(torch_name, "ok", "unset: torch's default tears a rank down when a collective fails or times "
                              "out, so the job stops instead of hanging")
    elif value.strip() == "0":
        add(torch_name, "warn", "0: a failed or timed-out collective leaves the job hanging until the "
                                "time limit; set 1 (hyflow launch slurm does)")
    else:
        add(torch_name, "ok", f"{value}: a failed or timed-out collective stops the job")
    if old_name in env and torch_name not in env:
        add(old_name, "warn", f"deprecated name; torch reads {torch_name} (set that instead)")
    ib = env.get("NCCL_IB_DISABLE")
    if ib is not None and ib.strip() == "1":
        add("NCCL_IB_DISABLE", "warn" if multi_node and on_gpu else "info",
            "1: InfiniBand is off, traffic between nodes goes over TCP sockets (several times slower)"
            + ("" if multi_node else "; no effect on one node"))
    else:
        add("NCCL_IB_DISABLE", "ok", "InfiniBand / RoCE used between nodes when present")
    ifname = env.get("NCCL_SOCKET_IFNAME")
    interfaces = network_interfaces() if interfaces is None else interfaces
    if ifname:
        hit = _ifname_matches(ifname, interfaces)
        if hit:
            add("NCCL_SOCKET_IFNAME", "ok", f"selects {', '.join(hit)} on this host")
        else:
            add("NCCL_SOCKET_IFNAME", "warn", f"{ifname!r} matches none of this host's interfaces "
                                              f"({', '.join(interfaces) or 'none found'}): NCCL cannot start")
    else:
        add("NCCL_SOCKET_IFNAME", "info" if multi_node else "ok",
            "unset: NCCL picks the interface for its bootstrap and socket traffic"
            + ("; set it when the nodes have several networks" if multi_node else ""))
    return out
