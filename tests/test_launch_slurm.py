"""``hyflow launch slurm``: the rendered sbatch script, checked statically (bash -n,
shellcheck when installed) and run under a faked Slurm (stub ``scontrol`` / ``srun`` on PATH,
``SLURM_*`` variables) on this machine: argument quoting, preemption + requeue, and one real
training step of the quickstart on 2 "nodes" x 1 rank meeting at a c10d rendezvous."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from hyflow.launch.local import LaunchError, Target, resolve_target
from hyflow.launch.slurm import SlurmOptions, render_sbatch, sbatch_quote

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "configs", "quickstart.yaml")

SCONTROL = """#!/bin/bash
# stub: `scontrol show hostnames LIST` prints one host per line; anything else is logged.
if [[ $1 == show && $2 == hostnames ]]; then tr ',' '\\n' <<<"$3"; exit 0; fi
echo "$*" >> "$FAKE_SLURM_DIR/scontrol.log"
"""
SRUN = """#!/bin/bash
# stub: run the per-node command once per node, locally, with SLURM_NODEID / SLURM_PROCID.
nodes=1 out=
while [[ $# -gt 0 && $1 == -* ]]; do
    case $1 in --nodes=*) nodes=${1#--nodes=};; --output=*) out=${1#--output=};; esac
    shift
done
pids=()
for ((i = 0; i < nodes; i++)); do
    f=${out//%n/$i}
    SLURM_NODEID=$i SLURM_PROCID=$i "$@" >"${f:-/dev/stderr}" 2>&1 &
    pids+=($!)
    echo $! >> "$FAKE_SLURM_DIR/node-pids"
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""
ARGV_TORCHRUN = """#!/bin/bash
# fake torchrun: record argv (NUL-separated), one file per node
printf '%s\\0' "$@" > "$FAKE_SLURM_DIR/argv.$SLURM_NODEID"
exit "${FAKE_RC:-0}"
"""
PREEMPT_TORCHRUN = """#!/bin/bash
# fake torchrun: one "rank" that saves and exits 0 when SIGUSR1 reaches it
"$FAKE_PYTHON" -c '
import os, sys, time
from hyflow.launch.preemption import PreemptionFlag
flag = PreemptionFlag.install()
d = os.environ["FAKE_SLURM_DIR"]; node = os.environ["SLURM_NODEID"]
open(os.path.join(d, "ready." + node), "w").close()
deadline = time.time() + 60
while not flag.requested and time.time() < deadline:
    time.sleep(0.02)
open(os.path.join(d, "saved." + node), "w").write(str(flag.signum))
' &
wait $!
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_exe(path, text):
    """Write an executable; returns its path quoted for ``--torchrun`` (a shell-split command)."""
    path.write_text(text)
    path.chmod(0o755)
    return shlex.quote(str(path))


@pytest.fixture
def fake_slurm(tmp_path):
    """PATH with stub scontrol/srun and a SLURM-like environment; returns (env, dir)."""
    d = tmp_path / "fake slurm"
    (d / "bin").mkdir(parents=True)
    _write_exe(d / "bin" / "scontrol", SCONTROL)
    _write_exe(d / "bin" / "srun", SRUN)
    env = dict(os.environ, PATH=f"{d / 'bin'}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID="4242",
               SLURM_NNODES="2", SLURM_CPUS_ON_NODE="2", FAKE_SLURM_DIR=str(d),
               HYFLOW_MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1",
               FAKE_PYTHON=sys.executable, HYFLOW_PYTHON=sys.executable)
    env.pop("SLURM_RESTART_COUNT", None)
    return env, d


def _render(tmp_path, nodes, gpus, overrides=(), config=QUICKSTART, **kw):
    run_dir = tmp_path / "my runs" / "run 1"
    target = resolve_target(config, [f"trainer.output_dir={run_dir}", *overrides], nodes * gpus)
    opts = SlurmOptions(nodes=nodes, gpus_per_node=gpus, workdir=str(tmp_path), **kw)
    return render_sbatch(target, opts), run_dir


def _bash_ok(path):
    out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    if shutil.which("shellcheck"):
        out = subprocess.run(["shellcheck", "-S", "info", str(path)], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout


@pytest.mark.parametrize("nodes, config", [(1, "llama3_8b_8gpu"), (2, "llama3_8b_8gpu"),
                                           (128, "qwen2_72b_1024gpu")])
def test_rendered_script_is_valid_bash_with_the_right_lines(tmp_path, nodes, config):
    text, run_dir = _render(tmp_path, nodes, 8, config=os.path.join(REPO, "configs", config + ".yaml"),
                            partition="batch", time="04:00:00",
                            account="proj x", container_image="nvcr.io/nvidia/pytorch:25.01-py3",
                            container_mounts="/data:/data", env=["NCCL_SOCKET_IFNAME=ib0"],
                            sbatch_args=["--qos=high"])
    path = tmp_path / f"job{nodes}.sbatch"
    path.write_text(text)
    _bash_ok(path)
    grace = re.search(r"^#SBATCH --signal=USR1@(\d+)$", text, re.M)
    assert grace and int(grace.group(1)) >= 60  # estimated from the model: no checkpoint yet
    assert f"--shutdown-timeout={grace.group(1)}" in text  # torchrun waits as long for stopping ranks
    for line in (f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --requeue",
                 "#SBATCH --partition=batch", "#SBATCH --time=04:00:00",
                 '#SBATCH --account="proj x"', "#SBATCH --qos=high",
                 f'#SBATCH --output="{run_dir}/logs/slurm-%j.out"',
                 f"srun --nodes={nodes} \\", "    --ntasks-per-node=1 \\",
                 "    --container-image=nvcr.io/nvidia/pytorch:25.01-py3 \\",
                 "    --container-mounts=/data:/data \\",
                 f"    hyflow-torchrun --nnodes={nodes} --nproc-per-node=8 \\",
                 '        --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" '
                 '--rdzv-id="hyflow-$JOB_ID" \\',
                 'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
                 'MASTER_ADDR="${NODES[0]}"', "export NCCL_SOCKET_IFNAME=ib0",
                 f"    trainer.nproc={nodes * 8}", "    trainer.resume=auto"):
        assert line in text.splitlines(), line
    assert '\nexport NCCL_DEBUG="${NCCL_DEBUG:-WARN}"  # ' in text
    assert "'trainer.output_dir=" in text  # the override with spaces is quoted


def test_pools_are_placed_on_node_ranges(tmp_path):
    """one_step_off's automatic half / half split and explicit placement.pools: each pool's node
    range is listed in the script; a pool that splits a node is refused, naming the pool."""
    text, _ = _render(tmp_path, 4, 2, ["trainer.mode=one_step_off"])
    path = tmp_path / "pools.sbatch"
    path.write_text(text)
    _bash_ok(path)
    lines = text.splitlines()
    assert "# Rank pools (node i runs ranks i*2 .. i*2+2-1 under torchrun's node_rank):" in lines
    train = next(line for line in lines if line.startswith("# pool train"))
    gen = next(line for line in lines if line.startswith("# pool gen"))
    assert train.endswith("ranks 0-3 on nodes 0-1 (node_rank 0..1)"), train
    assert gen.endswith("ranks 4-7 on nodes 2-3 (node_rank 2..3)"), gen
    assert "actor" in train and "rollout" in gen
    pools = ["trainer.mode=one_step_off", "placement.pools={learn: [0, 2], sample: [2, 4]}",
             "placement.actor=learn", "placement.rollout=sample", "actor.layout.tp=1"]
    target = resolve_target(QUICKSTART, [f"trainer.output_dir={tmp_path / 'r'}", *pools], 4)
    fits = render_sbatch(target, SlurmOptions(nodes=4, gpus_per_node=1, workdir=str(tmp_path)))
    assert "# pool sample (rollout): ranks 2-3 on nodes 2-3 (node_rank 2..3)" in fits.splitlines()
    with pytest.raises(LaunchError, match=r"placement pool 'learn' \(ranks 0-1: actor.*node boundary "
                                          r"with --gpus-per-node 4"):
        render_sbatch(target, SlurmOptions(nodes=1, gpus_per_node=4, workdir=str(tmp_path)))
    colocated, _ = _render(tmp_path, 1, 2)
    assert "# every role on every rank (placement: colocated)" in colocated.splitlines()


def test_sbatch_quote_and_option_errors(tmp_path):
    assert sbatch_quote("batch") == "batch"
    assert sbatch_quote('a "b" c\\d') == '"a \\"b\\" c\\\\d"'
    with pytest.raises(LaunchError, match="newline"):
        sbatch_quote("a\nb")
    for bad, msg in ((dict(nodes=0), "must be >= 1"), (dict(env=["1X=2"]), "KEY=VALUE"),
                     (dict(container_mounts="/a:/a"), "needs --container-image"),
                     (dict(sbatch_args=["qos=high"]), "expected an sbatch option")):
        opts = SlurmOptions(**{"nodes": 1, "gpus_per_node": 1, **bad})
        with pytest.raises(LaunchError, match=msg):
            render_sbatch(Target("doctor"), opts)


def test_rank_argv_survives_spaces_and_quotes(tmp_path, fake_slurm):
    env, d = fake_slurm
    torchrun = _write_exe(d / "fake torchrun", ARGV_TORCHRUN)
    weird = "trainer.output_dir=" + str(tmp_path / "it's a \"run\" $HOME")
    target = resolve_target(QUICKSTART, [weird, "actor.optim.lr=0.001"], 2)
    text = render_sbatch(target, SlurmOptions(nodes=2, gpus_per_node=1, torchrun=torchrun,
                                              workdir=str(tmp_path)))
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env["SLURM_JOB_NODELIST"] = "localhost,localhost"
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    for node in (0, 1):
        argv = (d / f"argv.{node}").read_text().split("\0")[:-1]
        assert argv[:2] == ["--nnodes=2", "--nproc-per-node=1"]
        assert f"--rdzv-endpoint=localhost:{env['HYFLOW_MASTER_PORT']}" in argv
        i = argv.index("-m")
        assert argv[i:i + 4] == ["-m", "hyflow.cli", "train", QUICKSTART]
        # the rl job resumes after a requeue: trainer.resume=auto is appended
        assert argv[i + 4:] == [weird, "actor.optim.lr=0.001", "trainer.nproc=2", "trainer.resume=auto"]
    assert not (d / "scontrol.log").exists()  # no preemption, no requeue


def test_exit_code_passes_through(tmp_path, fake_slurm):
    env, d = fake_slurm
    torchrun = _write_exe(d / "torchrun", ARGV_TORCHRUN)
    text = render_sbatch(Target("doctor"), SlurmOptions(nodes=1, gpus_per_node=2, torchrun=torchrun,
                                                        workdir=str(tmp_path)))
    (tmp_path / "job.sbatch").write_text(text)
    env.update(SLURM_JOB_NODELIST="localhost", FAKE_RC="3")
    out = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 3, out.stdout + out.stderr
    assert (tmp_path / "runs" / "doctor" / "logs" / "4242" / "node-0.out").exists()


def test_sigusr1_reaches_the_ranks_and_the_job_requeues(tmp_path, fake_slurm):
    env, d = fake_slurm
    torchrun = _write_exe(d / "torchrun", PREEMPT_TORCHRUN)
    text = render_sbatch(Target("doctor"), SlurmOptions(nodes=2, gpus_per_node=1, torchrun=torchrun,
                                                        workdir=str(tmp_path)))
    (tmp_path / "job.sbatch").write_text(text)
    env["SLURM_JOB_NODELIST"] = "localhost,localhost"
    proc = subprocess.Popen(["bash", str(tmp_path / "job.sbatch")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 60
        while not all((d / f"ready.{n}").exists() for n in (0, 1)):
            assert time.time() < deadline and proc.poll() is None, "fake ranks did not start"
            time.sleep(0.05)
        for pid in (d / "node-pids").read_text().split():  # Slurm signals the job step
            os.kill(int(pid), signal.SIGUSR1)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    for node in (0, 1):
        assert (d / f"saved.{node}").read_text() == str(int(signal.SIGUSR1))
    assert (d / "scontrol.log").read_text().split() == ["requeue", "4242"]
    assert "requeueing job 4242" in out
    marks = os.listdir(tmp_path / "runs" / "doctor" / "logs" / "4242")
    assert {"preempted-0.0", "preempted-0.1"} <= set(marks)


def test_dry_run_prints_and_submit_writes_into_the_run_dir(tmp_path, fake_slurm):
    env, d = fake_slurm
    run_dir = tmp_path / "run dir"
    args = [sys.executable, "-m", "hyflow.cli", "launch", "slurm", QUICKSTART, "--nodes", "2",
            "--gpus-per-node", "1", f"trainer.output_dir={run_dir}", "trainer.total_steps=1"]
    out = subprocess.run(args + ["--dry-run"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("#!/bin/bash") and not run_dir.exists()
    _write_exe(d / "bin" / "sbatch", "#!/bin/bash\nprintf '%s\\0' \"$@\" > \"$FAKE_SLURM_DIR/sbatch.args\"\necho 777\n")
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "submitted job 777" in out.stdout
    assert (d / "sbatch.args").read_text().split("\0")[:-1] == ["--parsable", str(run_dir / "hyflow.sbatch")]
    _bash_ok(run_dir / "hyflow.sbatch")
    bad = subprocess.run(args[:-1] + ["actor.layout.tp=3"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "tp*pp*cp = 3*1*1 = 3" in bad.stderr, bad.stderr
    huge = ["model.hidden_size=65536", "model.ffn_hidden_size=262144"]
    out = subprocess.run(args[:-1] + huge, env=env, capture_output=True, text=True, timeout=120)  # its own run dir
    assert out.returncode == 2 and "`hyflow plan` rejects this job at 2 ranks" in out.stderr
    assert "memory: phase '" in out.stderr and "--no-plan-check" in out.stderr


@pytest.mark.multirank
def test_quickstart_step_under_fake_slurm_two_nodes(tmp_path, fake_slurm):
    env, d = fake_slurm
    text, run_dir = _render(tmp_path, 2, 1, overrides=["trainer.total_steps=1", "actor.sft_warmup_steps=0",
                                                   "trainer.loggers=[console]"])
    (tmp_path / "job.sbatch").write_text(text)
    env["SLURM_JOB_NODELIST"] = "localhost,localhost"
    out = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, capture_output=True,
                         text=True, timeout=900)
    logs = run_dir / "logs" / "4242"
    detail = out.stdout + out.stderr + "".join(
        p.read_text()[-3000:] for p in sorted(logs.glob("node-*.out"))) if logs.exists() else ""
    assert out.returncode == 0, detail
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    # rank 0 sits on whichever "node" the rendezvous made group rank 0
    assert "step 1/1" in "".join(p.read_text() for p in logs.glob("node-*.out"))
    assert (run_dir / "checkpoints").is_dir()  # what a requeued job resumes from
    assert "finished with exit code 0" in out.stdout
    ranks = logs / "ranks-0"  # one log per rank, and their exit records
    assert len(list(ranks.glob("torchrun/*/attempt_0/*/stdout.log"))) == 2
    assert {p.name for p in ranks.glob("*.exit.json")} == {"rank_00000.exit.json", "rank_00001.exit.json"}


STOP_TORCHRUN = """#!/bin/bash
# fake torchrun: one "rank" that saves (moves checkpoints/latest when FAKE_SAVE=1) and exits 0 on
# SIGUSR1 or SIGTERM
"$FAKE_PYTHON" -c '
import os, signal, time
from hyflow.launch.preemption import PreemptionFlag
flag = PreemptionFlag.install((signal.SIGUSR1, signal.SIGTERM))
d = os.environ["FAKE_SLURM_DIR"]; node = os.environ["SLURM_NODEID"]
open(os.path.join(d, "ready." + node), "w").close()
deadline = time.time() + 60
while not flag.requested and time.time() < deadline:
    time.sleep(0.02)
if os.environ.get("FAKE_SAVE") == "1" and node == "0":
    ckpt = os.path.join(os.environ["HYFLOW_RUN_DIR"], "checkpoints")
    os.makedirs(ckpt, exist_ok=True)
    open(os.path.join(ckpt, "latest"), "w").write("step_000007\\n")
open(os.path.join(d, "saved." + node), "w").write(str(flag.signum))
' &
wait $!
"""


def _run_until_ready_then(script, env, d, sig, nodes=2):
    for stale in [*d.glob("ready.*"), *d.glob("node-pids")]:
        stale.unlink()
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 60
        while not all((d / f"ready.{n}").exists() for n in range(nodes)):
            assert time.time() < deadline and proc.poll() is None, "fake ranks did not start"
            time.sleep(0.05)
        for pid in (d / "node-pids").read_text().split():  # Slurm signals the job step
            os.kill(int(pid), sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out


def test_sigterm_is_handled_like_sigusr1_but_not_requeued(tmp_path, fake_slurm):
    env, d = fake_slurm
    torchrun = _write_exe(d / "torchrun", STOP_TORCHRUN)
    text = render_sbatch(Target("doctor"), SlurmOptions(nodes=2, gpus_per_node=1, torchrun=torchrun,
                                                        workdir=str(tmp_path)))
    (tmp_path / "job.sbatch").write_text(text)
    env["SLURM_JOB_NODELIST"] = "localhost,localhost"
    code, out = _run_until_ready_then(tmp_path / "job.sbatch", env, d, signal.SIGTERM)
    assert code == 0, out
    for node in (0, 1):  # the ranks got SIGTERM, saved and exited 0
        assert (d / f"saved.{node}").read_text() == str(int(signal.SIGTERM))
    assert "stopped by SIGTERM (preemption or scancel), exit code 0; not requeueing" in out
    assert not (d / "scontrol.log").exists()


def test_requeue_needs_a_new_checkpoint_and_is_bounded(tmp_path, fake_slurm):
    env, d = fake_slurm
    torchrun = _write_exe(d / "torchrun", STOP_TORCHRUN)
    target = resolve_target(QUICKSTART, [f"trainer.output_dir={tmp_path / 'run'}"], 2)
    text = render_sbatch(target, SlurmOptions(nodes=2, gpus_per_node=1, torchrun=torchrun, workdir=str(tmp_path)))
    (tmp_path / "job.sbatch").write_text(text)
    env["SLURM_JOB_NODELIST"] = "localhost,localhost"
    code, out = _run_until_ready_then(tmp_path / "job.sbatch", env, d, signal.SIGUSR1)  # nothing saved
    assert code == 0 and "without saving a new checkpoint" in out and not (d / "scontrol.log").exists(), out
    env["FAKE_SAVE"] = "1"
    code, out = _run_until_ready_then(tmp_path / "job.sbatch", env, d, signal.SIGUSR1)
    assert code == 0 and "requeueing job 4242" in out, out
    assert (d / "scontrol.log").read_text().split() == ["requeue", "4242"]
    env["SLURM_RESTART_COUNT"] = "21"  # beyond --max-requeues (20): whoever requeued it
    out = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "requeued 21 times, more than the 20 allowed" in out.stderr


def test_node_without_hyflow_says_so(tmp_path, fake_slurm):
    env, d = fake_slurm
    text = render_sbatch(Target("doctor"), SlurmOptions(nodes=1, gpus_per_node=1, workdir=str(tmp_path)))
    (tmp_path / "job.sbatch").write_text(text)
    env.update(SLURM_JOB_NODELIST="localhost", HYFLOW_PYTHON="/bin/false")
    out = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    node = (tmp_path / "runs" / "doctor" / "logs" / "4242" / "node-0.out").read_text()
    assert "no python that imports hyflow and torch (found '/bin/false')" in node


def test_shared_filesystem_warning(tmp_path):
    from hyflow.launch.slurm import filesystem_type, shared_fs_warning

    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nserver:/home {tmp_path} nfs4 rw 0 0\n"
                      f"tmpfs {tmp_path}/scratch tmpfs rw 0 0\n")
    (tmp_path / "scratch").mkdir()
    assert filesystem_type(str(tmp_path / "run"), str(mounts)) == "nfs4"
    assert shared_fs_warning(str(tmp_path / "run"), 4, str(mounts)) is None
    warning = shared_fs_warning(str(tmp_path / "scratch" / "run"), 4, str(mounts))
    assert "is on a tmpfs file system" in warning and "shared storage" in warning
    assert shared_fs_warning(str(tmp_path / "scratch" / "run"), 1, str(mounts)) is None  # one node: fine
