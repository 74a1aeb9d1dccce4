"""``make gpu-check``: verify the GPU path in minutes on a GPU node, without network.

Two halves (``make wheelhouse`` where PyPI is reachable, ``make gpu-check`` on the node):

* ``python tools/gpu_check.py wheelhouse --python-version 3.12 --dest wheelhouse`` downloads every
  wheel hyflow needs beyond a stock CUDA PyTorch image (:data:`WHEELS`; torch, triton, numpy,
  pyyaml, safetensors and transformers come from the image) for that Python, tagged for
  ``manylinux_2_28`` (megatron-core 0.16.1 has no older tag), and refuses a wheelhouse over
  :data:`WHEELHOUSE_LIMIT_MIB`;
* ``python -m hyflow.tools.gpu_check --log FILE`` (the node: a venv with ``--system-site-packages``
  over the image's interpreter, the wheels installed with ``--no-index``) runs the checks of
  :func:`checks`, each in its own process with its own timeout (:data:`CHECK_TIMEOUT_S`) inside a
  total budget (:data:`BUDGET_S`), prints one line per check as it finishes and appends one JSON
  object per check to FILE.

On one GPU: the GPU-marked tests, a bf16 quickstart, the fused output head, rollout decode speed
against the HBM roofline, GRPO steps on Qwen2.5-0.5B's architecture (random weights; tokens/s/GPU,
update MFU, transition seconds, peak memory against ``hyflow plan``). With 2+ GPUs also a pooled
``one_step_off`` run (1 training + 1 generation rank) and ``bench reshard`` at TP=2; with 4, the
pooled run with a training pool of 2 ranks (NCCL communicator creation on groups only some ranks
use). Without CUDA every GPU check is reported as skipped and the exit code is 0. Exit code: the
number of failed checks.

This module imports nothing of hyflow at its top, so ``make wheelhouse`` runs it before hyflow is
installed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Optional
import shlex

import torch

from hyflow.models.builder import fusion_backends

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: What hyflow needs beyond a CUDA PyTorch image (torch, triton, numpy, pyyaml, safetensors,
#: transformers): megatron-core (install_requires), psutil (install_requires; bench reshard),
#: packaging (megatron-core needs >= 24.2, pytest >= 24), pytest and its dependencies (the
#: GPU-marked tests), setuptools (the editable install of hyflow without build isolation).
WHEELS = ("megatron-core==0.16.1", "psutil", "packaging>=24.2", "pytest", "pluggy", "iniconfig", "pygments",
          "setuptools")
#: install_requires the node goes without (installed with --no-deps): imported lazily, never by a check
LAZY_REQUIREMENTS = {"omegaconf": "imported only for a config with ${...} interpolation; the check's configs have none"}
#: pytest's dependencies on Pythons before 3.11
WHEELS_BEFORE_311 = ("exceptiongroup", "tomli")
#: megatron-core 0.16.1 is tagged manylinux_2_24/2_28 only; pure wheels match any platform
PLATFORM = "manylinux_2_28_x86_64"
WHEELHOUSE_LIMIT_MIB = 20
#: the modules the checks import from the image (missing: one line naming them)
IMAGE_MODULES = ("torch", "numpy", "yaml", "safetensors", "transformers")
CHECK_TIMEOUT_S = 150.0
#: all checks together, install excluded (the install takes ~30 s of the 6 minutes)
BUDGET_S = 320.0
#: HBM bandwidth (bytes/s) by device name fragment, for the decode roofline (datasheets)
HBM_BYTES_PER_S = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100-SXM4-80GB", 2.04e12),
                   ("A100", 1.56e12), ("L40S", 0.864e12), ("B200", 8.0e12))
QWEN_CONFIG = "configs/qwen2_0.5b_gpu_check.yaml"


# ----------------------------------------------------------------------------- wheelhouse


def wheel_requirements(python_version: str) -> list[str]:
    """The wheels to download for ``python_version`` (``3.12``)."""
    major, minor = (int(x) for x in python_version.split(".")[:2])
    return list(WHEELS) + (list(WHEELS_BEFORE_311) if (major, minor) < (3, 11) else [])


def download_command(python_version: str, dest: str, python: str = sys.executable) -> list[str]:
    """``pip download`` of :func:`wheel_requirements`: binary wheels only, no dependency resolution
    (the image provides torch & co; resolving them would download torch), for that Python and
    :data:`PLATFORM`."""
    return [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
            "--implementation", "cp", "--platform", PLATFORM, "--dest", dest, *wheel_requirements(python_version)]


def wheelhouse_bytes(dest: str) -> int:
    return sum(os.path.getsize(os.path.join(dest, f)) for f in os.listdir(dest) if f.endswith(".whl"))


def make_wheelhouse(python_version: str, dest: str) -> int:
    os.makedirs(dest, exist_ok=True)
    for name in os.listdir(dest):  # a wheelhouse holds one Python version's wheels
        if name.endswith(".whl"):
            os.remove(os.path.join(dest, name))
    rc = subprocess.call(download_command(python_version, dest))
    if rc:
        print(f"gpu-check: pip download failed (exit {rc}); `make wheelhouse` needs PyPI", file=sys.stderr)
        return rc
    with open(os.path.join(dest, "PYTHON_VERSION"), "w") as f:
        f.write(python_version + "\n")
    size = wheelhouse_bytes(dest)
    print(f"gpu-check: {dest}/ holds {len(os.listdir(dest)) - 1} wheels for Python {python_version}, "
          f"{size / 2 ** 20:.1f} MiB")
    if size > WHEELHOUSE_LIMIT_MIB * 2 ** 20:
        print(f"gpu-check: the wheelhouse exceeds {WHEELHOUSE_LIMIT_MIB} MiB", file=sys.stderr)
        return 1
    return 0


def check_wheelhouse(dest: str) -> Optional[str]:
    """Why ``dest`` cannot serve this interpreter (None: it can)."""
    marker = os.path.join(dest, "PYTHON_VERSION")
    if not os.path.exists(marker):
        return f"{dest}/ has no wheelhouse: run `make wheelhouse PYVER=<the node's Python>` where PyPI is reachable"
    want = open(marker).read().strip()
    have = f"{sys.version_info.major}.{sys.version_info.minor}"
    if want != have:
        return f"{dest}/ holds wheels for Python {want}, this interpreter is {have}: run `make wheelhouse PYVER={have}`"
    return None


# ----------------------------------------------------------------------------- running checks


@dataclass
class Outcome:
    """What one check did: ``status`` is ok | failed | timeout | skipped."""

    name: str
    status: str
    seconds: float = 0.0
    detail: str = ""
    figures: dict = field(default_factory=dict)

    def line(self) -> str:
        figures = ", ".join(f"{k} {_fmt(v)}" for k, v in self.figures.items())
        text = f"gpu-check: {self.name}: {self.status}"
        if self.status != "skipped":
            text += f" ({self.seconds:.0f}s)"
        return text + "".join(f"; {x}" for x in (figures, self.detail) if x)

    def record(self) -> dict:
        return {"check": self.name, "status": self.status, "seconds": round(self.seconds, 2),
                "detail": self.detail, **self.figures}


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


@dataclass
class Check:
    """One check: a command run in its own session (its process group is killed at the timeout),
    and ``parse`` turning a successful run's output into figures (raise to fail the check)."""

    name: str
    argv: list
    gpus: int = 1
    timeout: float = CHECK_TIMEOUT_S
    parse: Optional[Callable[[str], dict]] = None
    env: dict = field(default_factory=dict)


def run_command(argv: list, timeout: float, env: Optional[dict] = None) -> tuple[Optional[int], str, float]:
    """``(exit code or None on timeout, stdout+stderr, seconds)``; a timed-out command's whole
    process group (torchrun and its ranks) is killed."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})})
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out, time.perf_counter() - start
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out, time.perf_counter() - start


def command_line(argv: list) -> str:
    """``argv`` as a user types it (``hyflow ...`` for this interpreter's ``-m hyflow.cli``)."""
    if argv[:3] == [sys.executable, "-m", "hyflow.cli"]:
        argv = ["hyflow", *argv[3:]]
    return shlex.join(str(a) for a in argv)


def run_check(check: Check, gpus: int, remaining: float, logs: Callable[[], str]) -> Outcome:
    if gpus < check.gpus:
        why = "no CUDA device" if gpus == 0 else f"needs {check.gpus} GPUs, this machine has {gpus}"
        if check.gpus > 1:  # where to run it instead
            why += f"; on {check.gpus}+ GPUs: {command_line(check.argv)}"
        return Outcome(check.name, "skipped", detail=why)
    if remaining < 10:
        return Outcome(check.name, "skipped", detail="the checks' time budget is spent")
    timeout = min(check.timeout, remaining)
    rc, out, seconds = run_command(check.argv, timeout, check.env)
    log = os.path.join(logs(), check.name.replace(" ", "-").replace("/", "-") + ".log")
    with open(log, "w") as f:
        f.write(out)
    lines = out.strip().splitlines()
    if rc is None:
        return Outcome(check.name, "timeout", seconds, f"killed after {timeout:.0f} s (log {log})")
    if rc:
        return Outcome(check.name, "failed", seconds, f"exit {rc}: {lines[-1] if lines else ''} (log {log})")
    try:
        figures = check.parse(out) if check.parse else {}
    except Exception as e:  # noqa: BLE001 - a run whose output does not hold its figures failed
        return Outcome(check.name, "failed", seconds, f"{type(e).__name__}: {e} (log {log})")
    return Outcome(check.name, "ok", seconds, figures=figures)


def run_checks(checks: list[Check], gpus: int, log_path: str, budget: float = BUDGET_S,
               echo: Callable[[str], None] = print, logs_dir: Optional[str] = None) -> list[Outcome]:
    """Every check in order, one line each as it finishes, one JSON line each appended to ``log_path``;
    each check's output goes to ``logs_dir`` (default: a temporary folder made when a check runs)."""
    made: list[str] = [logs_dir] if logs_dir else []

    def logs() -> str:  # each check's output, in a folder made when a check first runs
        if not made:
            made.append(tempfile.mkdtemp(prefix="hyflow-gpu-check-"))
        return made[0]

    start = time.perf_counter()
    outcomes = []
    for check in checks:
        outcome = run_check(check, gpus, budget - (time.perf_counter() - start), logs)
        outcomes.append(outcome)
        echo(outcome.line())
        with open(log_path, "a") as f:
            f.write(json.dumps(outcome.record()) + "\n")
    return outcomes


# ----------------------------------------------------------------------------- the checks


def last_json(out: str) -> dict:
    """The last line of ``out`` that is a JSON object (the benches' result line)."""
    for line in reversed(out.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON result line")


def hbm_bytes_per_s(device_name: str) -> Optional[float]:
    for fragment, bw in HBM_BYTES_PER_S:
        if fragment.lower() in device_name.lower():
            return bw
    return None


def _pytest_summary(out: str) -> dict:
    line = out.strip().splitlines()[-1] if out.strip() else ""
    return {"pytest": line.strip("= ")}


def _rollout_figures(device_name: str) -> Callable[[str], dict]:
    def parse(out: str) -> dict:
        row = last_json(out)
        tok_s = row["tokens_per_s"]
        figures = {"decode_tok_s": tok_s}
        bw = hbm_bytes_per_s(device_name)
        if bw and row.get("param_bytes"):  # every decode step reads the weights once for the whole batch
            roofline = row["batch"] * bw / row["param_bytes"]
            figures.update(roofline_tok_s=round(roofline), of_roofline=round(tok_s / roofline, 4))
        return figures
    return parse


def _head_figures(out: str) -> dict:
    row = last_json(out)
    return {"fused_s": row["fused_s"], "full_s": row["full_s"], "speedup": row["speedup"],
            "logp_max_diff": row["logp_max_diff"]}


def _rl_figures(plan_peak_bytes: Callable[[], Optional[float]]) -> Callable[[str], dict]:
    def parse(out: str) -> dict:
        r = last_json(out)
        figures = {"tok_s_per_gpu": round(r["tokens_per_s_per_rank"], 1), "step_s": round(r["step_s"], 3),
                   "transition_s": round(r["phases_s"]["reshard"], 4)}
        if r.get("mfu_update") is not None:
            figures["update_mfu"] = round(r["mfu_update"], 4)
        if r.get("gen_tokens_per_s"):
            figures["gen_tok_s"] = round(r["gen_tokens_per_s"], 1)
        measured = r.get("max_memory_allocated_gb")
        if measured is not None:
            figures["peak_gib"] = round(measured, 2)
            planned = plan_peak_bytes()
            if planned:
                figures["plan_peak_gib"] = round(planned / 2 ** 30, 2)
                figures["peak_vs_plan"] = round(measured * 2 ** 30 / planned, 3)
        return figures
    return parse


def plan_peak(config: str, overrides: list[str]) -> Optional[float]:
    """``hyflow plan``'s predicted peak bytes per GPU for ``config`` (None if it cannot say)."""
    rc, out, _ = run_command([sys.executable, "-m", "hyflow.cli", "plan", config, *overrides, "--json"], 60)
    try:
        return float(json.loads(out.strip().splitlines()[-1])["memory"]["peak_bytes"])
    except (ValueError, KeyError, IndexError):
        return None


def _quickstart_figures(out_dir: str) -> Callable[[str], dict]:
    def parse(out: str) -> dict:
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            rows = [json.loads(r) for r in f if r.strip()]
        last = rows[-1]
        return {"steps": len(rows), "step_s": round(last["timing_s/step"], 3),
                "reward": last.get("critic/score/mean"), "transition_s": round(last.get("timing_s/reshard", 0.0), 4)}
    return parse


def gpu_test_files() -> list[str]:
    """The test files holding GPU-marked tests (collecting only them keeps pytest's start short)."""
    tests = os.path.join(REPO, "tests")
    out = []
    for name in sorted(os.listdir(tests)):
        if name.startswith("test_") and name.endswith(".py"):
            with open(os.path.join(tests, name)) as f:
                if "mark.gpu" in f.read():
                    out.append(os.path.join("tests", name))
    return out


def checks(gpus: int, device_name: str = "") -> list[Check]:
    """The checks, in order; each says how many GPUs it needs."""
    py = [sys.executable, "-m", "hyflow.cli"]
    scratch = os.path.join(tempfile.gettempdir(), f"hyflow-gpu-runs-{os.getpid()}")  # the runs make it
    quick = os.path.join(scratch, "quickstart")
    common = ["trainer.resume=never", "trainer.loggers=[]", "actor.dtype=bf16"]
    out = [
        # the quickstart GPU test is the next check (one quickstart, not two)
        Check("gpu tests", [sys.executable, "-m", "pytest", *gpu_test_files(), "-m", "gpu", "-q", "-p",
                            "no:cacheprovider", "-k", "not quickstart_steps_on_one_gpu"], parse=_pytest_summary),
        Check("quickstart bf16 1 GPU", [*py, "train", "configs/quickstart.yaml", "trainer.nproc=1",
                                        "actor.layout.tp=1", "trainer.total_steps=3", "actor.sft_warmup_steps=5",
                                        f"trainer.output_dir={quick}", *common], parse=_quickstart_figures(quick)),
        Check("fused head", [*py, "bench", "head", "--device", "cuda", "--rows", "8", "--prompt", "256",
                             "--response", "768", "--hidden", "896", "--vocab", "151936", "--repeats", "3"],
              parse=_head_figures),
        Check("rollout decode", [*py, "bench", "rollout", "--model", "qwen2.5-0.5b", "--dtype", "bf16", "--batch", "64",
                                 "--new-tokens", "128", "--repeats", "2", "--no-hf"],
              parse=_rollout_figures(device_name)),
        Check("grpo qwen2.5-0.5b arch", [*py, "bench", "rl", QWEN_CONFIG, "--steps", "2", "--warmup", "1", "--quiet",
                                          "--output-dir", os.path.join(scratch, "qwen")],
              parse=_rl_figures(lambda: plan_peak(QWEN_CONFIG, []))),
        Check("one_step_off pools 1+1 (NCCL)", [*py, "train", "configs/quickstart.yaml", "trainer.nproc=2",
                                                "trainer.mode=one_step_off", "actor.layout.tp=1", "trainer.total_steps=3",
                                                "actor.sft_warmup_steps=2", "trainer.save_every=0",
                                                f"trainer.output_dir={os.path.join(scratch, 'off2')}", *common],
              gpus=2),
        Check("bench reshard TP2->1", [*py, "bench", "reshard", "--layers", "8", "--hidden", "1024", "--tp", "2",
                                       "--repeats", "3"], gpus=2, parse=lambda out: {
                                           k: v for k, v in last_json(out).items() if "speedup" in k or "gbps" in k}),
        # a training pool of 2 ranks: the pools' groups see operations only some members enter
        Check("one_step_off pools 2+2 (NCCL)", [*py, "train", "configs/quickstart.yaml", "trainer.nproc=4",
                                                "trainer.mode=one_step_off", "trainer.total_steps=3",
                                                "actor.sft_warmup_steps=2", "trainer.save_every=0",
                                                f"trainer.output_dir={os.path.join(scratch, 'off4')}", *common],
              gpus=4),
    ]
    return out


def environment() -> Outcome:
    """The image's modules, hyflow and Megatron-Core import; what the GPU path will use."""
    start = time.perf_counter()
    missing = []
    for name in (*IMAGE_MODULES, "megatron.core", "psutil", "pytest", "hyflow.cli"):
        try:
            __import__(name)
        except ImportError as e:
            missing.append(f"{name} ({e})")
    if missing:
        return Outcome("environment", "failed", time.perf_counter() - start,
                       "cannot import " + "; ".join(missing) + " (the image lacks it, or the wheelhouse)")

    figures = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda or "none",
               "fusions": ",".join(fusion_backends()) or "none"}
    return Outcome("environment", "ok", time.perf_counter() - start, figures=figures)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    wh = sub.add_parser("wheelhouse", help="download the wheels for an offline node")
    wh.add_argument("--python-version", default="3.12")
    wh.add_argument("--dest", default="wheelhouse")
    chk = sub.add_parser("check-wheelhouse", help="exit 2 with one line if the wheelhouse cannot serve this Python")
    chk.add_argument("--dest", default="wheelhouse")
    parser.add_argument("--log", default="gpu-check.jsonl", help="JSON lines, one per check (appended)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all checks together")
    args = parser.parse_args(argv)
    if args.command == "wheelhouse":
        return make_wheelhouse(args.python_version, args.dest)
    if args.command == "check-wheelhouse":
        why = check_wheelhouse(args.dest)
        if why:
            print(f"gpu-check: {why}", file=sys.stderr)
        return 2 if why else 0

    env = environment()
    print(env.line(), flush=True)
    with open(args.log, "a") as f:
        f.write(json.dumps(env.record()) + "\n")
    if env.status != "ok":
        return 1

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    name = torch.cuda.get_device_name(0) if gpus else ""
    print(f"gpu-check: {gpus} x {name or 'no CUDA device'}; one line per check, JSON lines in {args.log}", flush=True)
    outcomes = run_checks(checks(gpus, name), gpus, args.log, args.budget, lambda s: print(s, flush=True))
    return sum(o.status in ("failed", "timeout") for o in outcomes)


if __name__ == "__main__":
    sys.exit(main())
