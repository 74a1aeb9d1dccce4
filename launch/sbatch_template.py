"""The sbatch script ``hyflow launch slurm`` renders (kept as a Python string so it ships
with the package). ``@@NAME@@`` placeholders are filled by :mod:`hyflow.launch.slurm`, which
quotes every value; everything else is literal bash (checked with ``bash -n`` and
``shellcheck`` in the tests).
"""

TEMPLATE = r"""#!/bin/bash
# @@TITLE@@
# Rendered by `hyflow launch slurm`; submit it again with: sbatch @@SCRIPT@@
#SBATCH --job-name=@@JOB_NAME@@
#SBATCH --nodes=@@NODES@@
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=@@GPUS@@
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --chdir=@@WORKDIR_DIRECTIVE@@
#SBATCH --output=@@OUTPUT_DIRECTIVE@@
#SBATCH --open-mode=append
#SBATCH --signal=USR1@@@GRACE@@
#SBATCH --requeue
@@EXTRA_DIRECTIVES@@#
# One srun task per node runs torchrun (hyflow.launch.torchrun, found on the node), which starts
# @@GPUS@@ rank(s) there and meets the other nodes at a c10d rendezvous hosted on the first node.
# @@GRACE@@ s before the time limit (@@GRACE_HOW@@) Slurm sends SIGUSR1: the ranks
# finish their step, save a checkpoint and exit 0, then this script requeues the job, which
# resumes from that checkpoint (trainer.resume=auto). SIGTERM (preemption, scancel) makes the
# ranks save and exit 0 as well; Slurm itself requeues preempted jobs where it is configured to
# (PreemptMode=REQUEUE). Each rank's output goes to $LOG_DIR/ranks-<restart>/.
#
# Rank pools (node i runs ranks i*@@GPUS@@ .. i*@@GPUS@@+@@GPUS@@-1 under torchrun's node_rank):
@@POOLS@@
set -euo pipefail

RUN_DIR=@@RUN_DIR@@
SCRIPT=@@SCRIPT@@
NNODES=@@NODES@@
GPUS_PER_NODE=@@GPUS@@
MAX_REQUEUES="${HYFLOW_MAX_REQUEUES:-@@MAX_REQUEUES@@}"
REQUIRE_PROGRESS=@@REQUIRE_PROGRESS@@
# What every rank runs, after `torchrun <rendezvous options>`.
HYFLOW_CMD=(
@@HYFLOW_CMD@@
)

# Communication defaults; a variable already set where sbatch ran wins (--export=ALL).
@@ENV_DEFAULTS@@
# Set with `hyflow launch slurm --env KEY=VALUE`.
@@ENV_FORCED@@

JOB_ID="${SLURM_JOB_ID:?this script runs under Slurm: submit it with sbatch}"
RESTART="${SLURM_RESTART_COUNT:-0}"
LOG_DIR="$RUN_DIR/logs/$JOB_ID"
RANK_LOGS="$LOG_DIR/ranks-$RESTART"
mkdir -p "$RANK_LOGS"
if (( RESTART > MAX_REQUEUES )); then
    echo "[hyflow] job $JOB_ID was requeued $RESTART times, more than the $MAX_REQUEUES allowed (--max-requeues):" \
         "not starting again" >&2
    exit 1
fi
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if (( ${#NODES[@]} != NNODES )); then
    echo "[hyflow] expected $NNODES node(s) but Slurm allocated ${#NODES[@]}: ${NODES[*]}" >&2
    exit 1
fi
MASTER_ADDR="${NODES[0]}"
MASTER_PORT="${HYFLOW_MASTER_PORT:-$(( 20000 + JOB_ID % 20000 ))}"
PREEMPT_MARK="$LOG_DIR/preempted-$RESTART"
SHARED_MARK="$LOG_DIR/.shared-$RESTART"
echo "$JOB_ID" > "$SHARED_MARK"  # every node must see it: the run directory is shared storage
LATEST_BEFORE="$(cat "$RUN_DIR/checkpoints/latest" 2>/dev/null || true)"
export HYFLOW_LOG_DIR="$RANK_LOGS" HYFLOW_RUN_DIR="$RUN_DIR"
echo "[hyflow] job $JOB_ID (restart $RESTART): $NNODES node(s) x $GPUS_PER_NODE rank(s)," \
     "rendezvous $MASTER_ADDR:$MASTER_PORT, logs in $LOG_DIR"

# Runs once per node (through srun). The launcher is resolved here, on the compute node (inside
# the container, if any): the python on PATH that imports hyflow, unless --torchrun named one.
# torchrun starts with SIGUSR1 ignored (it would die of it and take the ranks along); the ranks
# install their own handler. SIGUSR1 and SIGTERM are marked for this script and forwarded to
# the ranks (torchrun's children), which save and exit.
# shellcheck disable=SC2317  # invoked through srun, via declare -f
hyflow_node() {
    local mark=$1 shared=$2 pid rc py
    shift 2
    if [[ ! -e $shared ]]; then
        echo "[hyflow] node $(hostname) does not see $shared: the run directory must be on a file system" \
             "every node shares (NFS, Lustre, GPFS, ...)" >&2
        return 3
    fi
    if [[ $1 == hyflow-torchrun ]]; then
        shift
        py="${HYFLOW_PYTHON:-$(command -v python3 || command -v python || true)}"
        if [[ -z $py ]] || ! "$py" -c 'import importlib.util as u, sys; sys.exit(not (u.find_spec("hyflow") and u.find_spec("torch")))' 2>/dev/null; then
            echo "[hyflow] node $(hostname): no python that imports hyflow and torch (found '${py:-none}');" \
                 "activate hyflow's environment before sbatch (the job inherits PATH) or set HYFLOW_PYTHON" >&2
            return 2
        fi
        set -- "$py" -m hyflow.launch.torchrun "$@"
    fi
    trap '' USR1
    "$@" &
    pid=$!
    trap 'touch "$mark.${SLURM_NODEID:-0}"; pkill -USR1 -P "$pid" || true' USR1
    trap 'touch "$mark.term.${SLURM_NODEID:-0}"; pkill -TERM -P "$pid" || true' TERM
    while true; do
        rc=0
        wait "$pid" || rc=$?
        if ! kill -0 "$pid" 2>/dev/null; then
            return "$rc"
        fi
    done
}

set +e
srun @@SRUN_ARGS@@ \
    bash -c "$(declare -f hyflow_node); hyflow_node \"\$@\"" hyflow-node "$PREEMPT_MARK" "$SHARED_MARK" \
    @@TORCHRUN@@ --nnodes=@@NODES@@ --nproc-per-node=@@GPUS@@ \
        --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="hyflow-$JOB_ID" \
        --max-restarts=0 --shutdown-timeout=@@GRACE@@ \
        --log-dir="$RANK_LOGS/torchrun" --redirects=3 --tee=3 --local-ranks-filter=0 \
        "${HYFLOW_CMD[@]}"
rc=$?
set -e

LATEST_AFTER="$(cat "$RUN_DIR/checkpoints/latest" 2>/dev/null || true)"
if compgen -G "$PREEMPT_MARK.term.*" >/dev/null; then
    echo "[hyflow] stopped by SIGTERM (preemption or scancel), exit code $rc; not requeueing: Slurm requeues" \
         "preempted jobs itself where configured (PreemptMode=REQUEUE); to continue: sbatch $SCRIPT"
    exit "$rc"
fi
if compgen -G "$PREEMPT_MARK.*" >/dev/null; then
    if (( REQUIRE_PROGRESS )) && [[ -z $LATEST_AFTER || $LATEST_AFTER == "$LATEST_BEFORE" ]]; then
        echo "[hyflow] preempted (SIGUSR1) without saving a new checkpoint since this attempt started" \
             "(latest: ${LATEST_AFTER:-none}): not requeueing, it would repeat the same work; a longer" \
             "--grace gives the save more time" >&2
    elif (( RESTART < MAX_REQUEUES )); then
        echo "[hyflow] preempted (SIGUSR1, exit code $rc): requeueing job $JOB_ID"
        scontrol requeue "$JOB_ID"
        exit 0
    else
        echo "[hyflow] preempted, but all $MAX_REQUEUES requeue(s) are used up" >&2
    fi
fi
echo "[hyflow] job $JOB_ID finished with exit code $rc"
exit "$rc"
"""
