"""``make gpu-check``: verify the GPU path in minutes on the first machine with CUDA.

Runs, each reported as one summary line (``gpu-check: <name>: ok|FAILED ...``):

1. the GPU-marked tests (``pytest -m gpu``);
2. a 3-step quickstart (GRPO, hybrid engine, SFT warm-up) on 1 GPU, then on 2 GPUs with NCCL
   when the machine has two;
3. ``hyflow bench reshard`` and ``hyflow bench rollout`` (small shapes; their JSON line is kept).

Without CUDA it says so and exits 0, so CI and CPU boxes can call it. Exit code: the number of
failed checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(name: str, cmd: list[str], timeout: float = 1800) -> tuple[bool, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - start
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    if proc.returncode:
        log = os.path.join(tempfile.gettempdir(), f"hyflow-gpu-check-{name.replace(' ', '-')}.log")
        with open(log, "w") as f:
            f.write(proc.stdout + proc.stderr)
        return False, f"FAILED (exit {proc.returncode}, {seconds:.0f}s): {tail[-1] if tail else ''} (log {log})"
    return True, f"ok ({seconds:.0f}s)"


def _quickstart(gpus: int) -> tuple[bool, str]:
    out = tempfile.mkdtemp(prefix=f"hyflow-gpu-quickstart{gpus}-")
    layout = ["actor.layout.tp=2"] if gpus == 2 else ["actor.layout.tp=1"]
    ok, line = _run(f"quickstart {gpus} GPU", [
        sys.executable, "-m", "hyflow.cli", "train", "configs/quickstart.yaml", f"trainer.nproc={gpus}",
        "trainer.total_steps=3", "actor.sft_warmup_steps=5", f"trainer.output_dir={out}", "trainer.resume=never",
        "actor.dtype=bf16", *layout])
    if not ok:
        return ok, line
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(r) for r in f if r.strip()]
    last = rows[-1]
    return True, (f"{line}, {len(rows)} steps, step {last.get('timing_s/step', float('nan')):.2f}s, "
                  f"reward {last.get('critic/score/mean')}, reshard {last.get('timing_s/reshard', 0):.3f}s")


def _bench(name: str, args: list[str]) -> tuple[bool, str]:
    cmd = [sys.executable, "-m", "hyflow.cli", "bench", name, *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        return False, f"FAILED (exit {proc.returncode}): {(proc.stderr.strip().splitlines() or [''])[-1]}"
    return True, "ok " + lines[-1]


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine; nothing to check (run `make gpu-check` on a GPU machine)")
        return 0
    gpus = torch.cuda.device_count()
    print(f"gpu-check: {gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    checks = [("gpu tests", lambda: _run("gpu tests", [sys.executable, "-m", "pytest", "tests", "-m", "gpu", "-q"])),
              ("quickstart 1 GPU", lambda: _quickstart(1))]
    if gpus >= 2:
        checks.append(("quickstart 2 GPUs (NCCL)", lambda: _quickstart(2)))
    checks += [("bench reshard", lambda: _bench("reshard", ["--layers", "8", "--hidden", "1024", "--tp", str(min(gpus, 2)),
                                                            "--repeats", "3"])),
               ("bench rollout", lambda: _bench("rollout", []))]
    failed = 0
    for name, check in checks:
        try:
            ok, line = check()
        except Exception as e:  # a check that cannot even start is reported like a failed one
            ok, line = False, f"FAILED: {type(e).__name__}: {e}"
        failed += not ok
        print(f"gpu-check: {name}: {line}", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
