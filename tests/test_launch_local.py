"""``hyflow launch local``: argument handling, offline validation, the torchrun command."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from hyflow.launch.args import IntermixedParser, format_bytes, parse_size
from hyflow.launch.local import LaunchError, resolve_target, torchrun_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "configs", "quickstart.yaml")


def hyflow(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "hyflow.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def test_dry_run_shows_torchrun_with_intermixed_overrides():
    out = hyflow("launch", "local", "configs/quickstart.yaml", "trainer.total_steps=1", "--nproc",
                 "2", "--dry-run", "trainer.log_every=1")
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert "-m torch.distributed.run --standalone --nproc-per-node=2 -m hyflow.cli train" in line
    assert line.endswith(f"{QUICKSTART} trainer.total_steps=1 trainer.log_every=1 trainer.nproc=2")


def test_config_errors_stop_before_any_process():
    out = hyflow("launch", "local", "configs/quickstart.yaml", "--nproc", "3")
    assert out.returncode == 2
    assert "world size 3 is not divisible by tp*pp*cp = 2*1*1 = 2" in out.stderr
    assert "launching" not in out.stdout
    out = hyflow("launch", "local", "no/such.yaml")
    assert out.returncode == 2 and "config file 'no/such.yaml' does not exist" in out.stderr
    out = hyflow("launch", "local", "doctr", "--nproc", "2")
    assert out.returncode == 2 and "neither a config file nor one of doctor" in out.stderr


def test_resolve_target():
    t = resolve_target(QUICKSTART, ["trainer.nproc=8", "trainer.total_steps=2"], 4)
    assert (t.command, t.job, t.config) == ("train", "rl", QUICKSTART)
    assert t.args == ["trainer.total_steps=2", "trainer.nproc=4"]
    assert t.output_dir == os.path.abspath("runs/quickstart")
    d = resolve_target("doctor", ["--max-size", "4MB"], 2)
    assert d.hyflow_argv() == ["doctor", "--max-size", "4MB"]
    assert torchrun_command(d, 2, python="py")[-4:] == ["hyflow.cli", "doctor", "--max-size", "4MB"]
    with pytest.raises(LaunchError):
        resolve_target("doctor", [], 0)


def test_intermixed_parser_and_sizes():
    p = IntermixedParser(prog="x")
    p.add_argument("target")
    p.add_argument("rest", nargs="*")
    p.add_argument("--n", type=int)
    ns = p.parse_args(["c.yaml", "a=1", "--n", "2", "b=2", "--", "--max-size", "1"])
    assert (ns.target, ns.rest, ns.n) == ("c.yaml", ["a=1", "b=2", "--max-size", "1"], 2)
    assert parse_size("64MB") == 64 << 20 and parse_size("1GiB") == 1 << 30
    assert parse_size("4096") == 4096 and parse_size("1.5k") == 1536
    for bad in ("", "MB", "-1", "3 parsecs"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)
    assert format_bytes(64 << 20) == "64 MiB" and format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3) == "3 B"


def test_launcher_passes_sigterm_to_its_child(tmp_path):
    """SIGTERM to the launcher reaches torchrun (here: a stand-in child that traps it and
    exits 7) instead of killing the launcher and orphaning the ranks."""
    import signal
    import subprocess
    import sys
    import time

    marker = tmp_path / "got"
    child = ("import signal,sys,time,pathlib\n"
             f"def h(s,f): pathlib.Path({str(marker)!r}).write_text(str(s)); sys.exit(7)\n"
             "signal.signal(signal.SIGTERM,h)\n"
             f"pathlib.Path({str(marker)!r} + '.ready').write_text('1')\n"
             "time.sleep(60)\n")
    launcher = ("import sys\nfrom hyflow.launch.local import run_forwarding_signals\n"
                f"sys.exit(run_forwarding_signals([sys.executable, '-c', {child!r}]))\n")
    proc = subprocess.Popen([sys.executable, "-c", launcher])
    deadline = time.time() + 60
    while not (tmp_path / "got.ready").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 7
    assert marker.read_text() == str(int(signal.SIGTERM))
