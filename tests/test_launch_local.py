"""``hyflow launch local``: argument handling, offline validation, the torchrun command."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from hyflow.cli_support import IntermixedParser
from hyflow.config.units import format_bytes, parse_size
from hyflow.launch.local import LaunchError, resolve_target, torchrun_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "configs", "quickstart.yaml")


def hyflow(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "hyflow.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def test_dry_run_shows_torchrun_with_intermixed_overrides(tmp_path):
    run = f"trainer.output_dir={tmp_path}"  # not the tree's runs/quickstart (a finished run may be there)
    out = hyflow("launch", "local", "configs/quickstart.yaml", "trainer.total_steps=1", "--nproc",
                 "2", "--dry-run", "trainer.log_every=1", run)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("[hyflow] launching 2 ranks: "))
    assert "-m hyflow.launch.torchrun --standalone --nproc-per-node=2 --shutdown-timeout=" in line
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 -m hyflow.cli train" in line
    assert line.endswith(f"{QUICKSTART} trainer.total_steps=1 trainer.log_every=1 {run} trainer.nproc=2")
    assert "on a stop signal (SIGTERM, SIGUSR1) the ranks get " in out.stdout


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
    assert torchrun_command(d, 2, python="py")[:3] == ["py", "-m", "hyflow.launch.torchrun"]
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


def test_grace_period_comes_from_measured_save_and_step_times(tmp_path):
    from hyflow.jobs.registry import load_job_config
    from hyflow.launch.grace import preemption_grace

    cfg = load_job_config(QUICKSTART, [f"trainer.output_dir={tmp_path}"])
    estimated = preemption_grace(cfg, 2)
    assert not estimated.measured and estimated.seconds >= 60 and "estimated save" in estimated.describe()
    step = tmp_path / "checkpoints" / "step_000004"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text("{}")
    (step / "COMPLETE").write_text('{"step": 4, "save_seconds": 100.0}')
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {i}, "time/step": {t}}}\n'
                                                     for i, t in enumerate((500.0, 20.0, 30.0, 25.0))))
    grace = preemption_grace(cfg, 2)  # 1.5 * (100 + 500) + 30
    assert (grace.seconds, grace.measured) == (930, True)
    assert grace.describe() == "930 s (measured save 100 s, step 500 s)"


def test_failure_summary_names_the_root_cause_in_three_lines(tmp_path):
    import json as _json
    import time as _time

    from hyflow.launch.rank_report import Death, read_records, run_reporting, summarize_failure

    logs = str(tmp_path / "logs")

    def peer():
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")

    def hyflow_error():
        raise ValueError("data.jsonl: row 7, key 'prompt': is an empty string\n  and more")

    assert run_reporting(peer, 0, logs) == 1  # the peer error happens first...
    _time.sleep(0.01)
    assert run_reporting(hyflow_error, 3, logs) == 1  # ...but the hyflow error is the cause
    assert run_reporting(lambda: None, 1, logs) == 0
    exits = {r["rank"]: r["status"] for r in read_records(logs, "exit")}
    assert exits == {0: "error", 1: "ok", 3: "error"}
    lines = summarize_failure(logs, [Death(0, 1), Death(3, 1)], "[hyflow] resume hint")
    assert lines[0] == "[hyflow] rank 3 failed: ValueError: data.jsonl: row 7, key 'prompt': is an empty string | and more"
    assert lines[1] == (f"[hyflow] the job stopped (1 other rank(s) stopped with it); traceback: {logs}/rank_00003.log "
                        f"(every rank's log in {logs})")
    assert lines[2] == "[hyflow] resume hint" and len(lines) == 3
    assert "ValueError: data.jsonl" in open(f"{logs}/rank_00003.log").read()  # the whole traceback
    # a rank killed by a signal outranks the errors it caused elsewhere
    killed = summarize_failure(logs, [Death(5, -9, pid=77, time=1.0), Death(3, 1)], "")
    assert killed[0] == "[hyflow] rank 5 (pid 77) was killed by SIGKILL (out of memory? kill -9?)"
    assert len(killed) == 2
    assert _json.load(open(f"{logs}/rank_00000.error.json"))["peer"] is True


@pytest.mark.multirank
def test_a_rank_error_is_reported_first_in_three_lines(tmp_path):
    """2 ranks whose reward function raises at step 1: the launcher's output ends with the
    rank, the hyflow error (file and row), the rank's log, and no traceback on the console."""
    (tmp_path / "reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    return 1 / 0\n")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "job: rl\n"
        "model: {family: llama, vocab_size: 128, hidden_size: 32, num_layers: 1, num_attention_heads: 4,\n"
        "        num_query_groups: 2, ffn_hidden_size: 64, max_position_embeddings: 32}\n"
        "actor: {layout: {tp: 2, pp: 1}, micro_batch_size: 4, mini_batch_size: 8}\n"
        "rollout: {layout: {tp: 1, pp: 1}, n: 2, max_prompt_length: 16, max_new_tokens: 2}\n"
        f"reward: {{kind: function, function_path: {tmp_path / 'reward.py'}}}\n"
        "data: {task: digit_add, task_size: 8, train_batch_size: 4}\n"
        f"trainer: {{total_steps: 1, nproc: 2, loggers: [console], output_dir: {tmp_path / 'run'}}}\n")
    out = hyflow("train", str(cfg), timeout=600)
    assert out.returncode == 1
    console = (out.stdout + out.stderr).splitlines()
    assert not any("Traceback" in line for line in console), "\n".join(console[-30:])
    first = next(i for i, line in enumerate(console) if " failed: " in line)
    report = console[first:]
    assert report[0].startswith("[hyflow] rank ") and ": RewardError: reward function compute_score() from " \
        f"{tmp_path / 'reward.py'} raised ZeroDivisionError: division by zero on task:digit_add row " in report[0]
    assert len(report) == 3 and "traceback: " in report[1] and "no checkpoint was saved yet" in report[2]
    log = report[1].split("traceback: ")[1].split(" (every")[0]
    assert "ZeroDivisionError" in open(log).read()


@pytest.mark.multirank
def test_ranks_stop_within_30_s_of_the_launcher_being_killed(tmp_path):
    """Issue #39 point 3: kill -9 of `hyflow train` used to leave both ranks running to the end (torchrun
    starts them in sessions of their own). They now notice, save after their step and exit."""
    import signal
    import time

    from hyflow.testing.resume import process_descendants

    out = tmp_path / "run"
    log = open(tmp_path / "launch.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "hyflow.cli", "train", QUICKSTART, "trainer.total_steps=500",
                             "actor.sft_warmup_steps=0", "trainer.loggers=[console]", f"trainer.output_dir={out}"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    ranks: list = []
    try:
        deadline = time.time() + 600
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").stat().st_size:
            assert proc.poll() is None and time.time() < deadline, open(tmp_path / "launch.log").read()[-3000:]
            time.sleep(0.2)
        ranks = process_descendants(proc.pid)
        assert len(ranks) >= 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = time.time()
        while any(os.path.exists(f"/proc/{pid}") for pid in ranks) and time.time() - killed < 30:
            time.sleep(0.5)
        alive = [pid for pid in ranks if os.path.exists(f"/proc/{pid}")]
        assert not alive, f"still running 30 s after the launcher died: {alive}"
    finally:
        _kill(proc.pid, *ranks)
        log.close()
    text = open(tmp_path / "launch.log").read()
    assert "the launcher (pid" in text and "is gone; stopping" in text


def test_a_full_log_directory_still_gives_a_short_report(tmp_path, monkeypatch):
    """Issue #39 point 4: on a full disk the error record could not be written, the rank printed
    200-330 lines of tracebacks and the summary said "without a hyflow error record". Now the records
    go to the in-memory fallback directory and the summary has one line per distinct cause."""
    from hyflow.launch.rank_report import (FALLBACK_DIR_ENV, make_fallback_dir, remove_fallback_dir, run_reporting,
                                           summarize_failure)

    blocked = tmp_path / "full"
    blocked.write_text("")  # a file: nothing can be created below it, as on a full disk
    logs = str(blocked / "logs")
    monkeypatch.delenv(FALLBACK_DIR_ENV, raising=False)
    fallback = make_fallback_dir()
    try:
        def full(rank):
            def fail():
                raise OSError(28, "No space left on device", f"/run/checkpoints/step_000002/actor/__{rank}_0.distcp")
            return fail

        assert run_reporting(full(0), 0, logs) == 1 and run_reporting(full(1), 1, logs) == 1
        assert run_reporting(lambda: (_ for _ in ()).throw(KeyError("other")), 2, logs) == 1
        lines = summarize_failure(logs, (), "[hyflow] hint")
        assert lines[0].startswith("[hyflow] rank 0 failed: OSError: [Errno 28] No space left on device")
        assert lines[1] == "[hyflow] rank 2 also failed: KeyError: 'other'"  # rank 1's is the same cause
        assert lines[2].startswith(f"[hyflow] the job stopped (2 other rank(s) stopped with it); traceback: "
                                   f"{fallback}/rank_00000.log")
        assert len(lines) == 4 and "No space left" in open(f"{fallback}/rank_00000.log").read()
    finally:
        monkeypatch.delenv(FALLBACK_DIR_ENV, raising=False)
        remove_fallback_dir(fallback)
    assert os.path.isdir(fallback)  # kept: it holds the only tracebacks
    import shutil

    shutil.rmtree(fallback)
    monkeypatch.setenv(FALLBACK_DIR_ENV, str(blocked / "nowhere"))
    assert run_reporting(full(3), 3, logs) == 1  # nowhere to write: still one exit code, no second failure


def test_ranks_reporting_one_full_disk_in_other_words_are_one_cause(tmp_path):
    """Probe of issue #39 point 4 (2 MiB tmpfs): one rank saw the ENOSPC, the other found the disk
    full from its free space and named the directory; the summary said the same thing twice."""
    from hyflow.launch.rank_report import record_failure, summarize_failure

    logs = str(tmp_path / "logs")
    os.makedirs(logs)
    message = ("checkpoint step 4 was not saved: no space left on the device while writing the actor weights to "
               "/run/checkpoints/step_000004/actor{}: free space there or point the run elsewhere")
    record_failure(ValueError(message.format(" (/run/checkpoints)")), 1, logs)
    record_failure(ValueError(message.format("")), 0, logs)
    lines = summarize_failure(logs, (), "")
    assert len(lines) == 2 and "also failed" not in lines[1], lines


def test_a_failed_save_on_a_nearly_full_file_system_is_disk_full(tmp_path, monkeypatch):
    import errno
    from types import SimpleNamespace

    from hyflow.checkpoint.files import full_disk_error

    assert full_disk_error(str(tmp_path)) is None or os.statvfs(str(tmp_path)).f_bavail * 4096 < 64 << 20
    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(f_bavail=10, f_frsize=4096))
    error = full_disk_error(str(tmp_path))
    assert error.errno == errno.ENOSPC and error.filename == str(tmp_path)


_STUBBORN_RANK = """
import os, signal, sys, time
def stop(signum, frame):  # like a rank: the first SIGINT means "save after this step", which takes long
    print(f"rank {os.environ['RANK']} saving", flush=True)
    time.sleep(120)
signal.signal(signal.SIGINT, stop)
open(os.path.join(sys.argv[1], f"ready.{os.environ['RANK']}.{os.getpid()}"), "w").close()
time.sleep(600)
"""


def test_a_second_ctrl_c_kills_the_ranks_at_once(tmp_path):
    """Issue #39 point 7: the first Ctrl-C lets the ranks save and stop; a second one aborts them now
    (torchrun's agent would wait for them once more)."""
    import signal
    import time

    (tmp_path / "rank.py").write_text(_STUBBORN_RANK)
    launcher = ("import sys\nfrom hyflow.launch.torchrun import run\n"
                f"sys.exit(run(['--standalone', '--nproc-per-node=2', '--shutdown-timeout=300', "
                f"'--signals-to-handle=SIGTERM,SIGINT', {str(tmp_path / 'rank.py')!r}, {str(tmp_path)!r}], "
                f"log_dir={str(tmp_path / 'logs')!r}))\n")
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    ranks: list = []
    try:
        deadline = time.time() + 120
        while len(ranks) < 2:
            assert time.time() < deadline and proc.poll() is None
            ranks = [int(p.name.split(".")[2]) for p in tmp_path.glob("ready.*")]
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        time.sleep(2)
        assert proc.poll() is None  # the ranks are "saving": the launcher waits for them
        proc.send_signal(signal.SIGINT)
        start = time.time()
        assert proc.wait(timeout=60) == 130 and time.time() - start < 30
        time.sleep(0.5)
        assert not [pid for pid in ranks if os.path.exists(f"/proc/{pid}")]
        assert "second SIGINT: the ranks were killed without saving" in proc.stdout.read()
    finally:
        _kill(proc.pid, *ranks)


def test_the_resume_hint_never_points_back_at_a_refused_checkpoint(tmp_path):
    from hyflow.launch.rank_report import record_failure, resume_hint

    step = tmp_path / "run" / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text("{}")
    (step / "COMPLETE").write_text('{"step": 2}')
    logs = str(tmp_path / "logs")
    os.makedirs(logs)
    assert "resumes from step 2" in resume_hint(str(tmp_path / "run"), logs)
    # a failed save names the previous checkpoint as intact: resuming from it is right (probe: disk full)
    record_failure(ValueError(f"checkpoint step 4 was not saved: no space left ...; the previous checkpoint {step} "
                              "(step 2) is intact and `trainer.resume=auto` continues from it"), 1, logs)
    assert "resumes from step 2" in resume_hint(str(tmp_path / "run"), logs)
    record_failure(ValueError(f"actor/x holds NaN or inf while loading checkpoint {step}"), 0, logs)
    hint = resume_hint(str(tmp_path / "run"), logs)
    assert "was refused" in hint and "resumes from" not in hint and "earlier step_* directory" in hint
    from hyflow.checkpoint.run_lock import RunDirInUse

    record_failure(RunDirInUse(f"trainer.output_dir {tmp_path / 'run'} is in use by another run"), 0, logs)
    assert resume_hint(str(tmp_path / "run"), logs) == ""  # another run's directory: nothing to continue here


@pytest.mark.multirank
def test_generate_on_two_ranks_reports_a_bad_model_directory_in_two_lines(tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n')
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    out = hyflow("generate", "--hf", str(tmp_path / "model"), "--prompts", str(tmp_path / "prompts.jsonl"),
                 "--tp", "2", timeout=600)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert out.returncode == 1 and len(lines) == 2, lines  # was torchrun's 36-line ChildFailedError dump
    assert lines[0].startswith("[hyflow] rank ") and "failed: ValueError:" in lines[0] and "Traceback" not in out.stderr


def _kill(*pids: int) -> None:
    import signal

    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
