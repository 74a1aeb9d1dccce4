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
# One srun task per node runs torchrun, which starts @@GPUS@@ rank(s) there and meets the
# other nodes at a c10d rendezvous hosted on the first node. @@GRACE@@ s before the time
# limit Slurm sends SIGUSR1: the ranks save a checkpoint and exit, then this script
# requeues the job, which resumes from that checkpoint (trainer.resume=auto).

set -euo pipefail

RUN_DIR=@@RUN_DIR@@
NNODES=@@NODES@@
GPUS_PER_NODE=@@GPUS@@
MAX_REQUEUES="${HYFLOW_MAX_REQUEUES:-@@MAX_REQUEUES@@}"
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
mkdir -p "$LOG_DIR"
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if (( ${#NODES[@]} != NNODES )); then
    echo "[hyflow] expected $NNODES node(s) but Slurm allocated ${#NODES[@]}: ${NODES[*]}" >&2
    exit 1
fi
MASTER_ADDR="${NODES[0]}"
MASTER_PORT="${HYFLOW_MASTER_PORT:-$(( 20000 + JOB_ID % 20000 ))}"
PREEMPT_MARK="$LOG_DIR/preempted-$RESTART"
echo "[hyflow] job $JOB_ID (restart $RESTART): $NNODES node(s) x $GPUS_PER_NODE rank(s)," \
     "rendezvous $MASTER_ADDR:$MASTER_PORT, logs in $LOG_DIR"

# Runs once per node (through srun): torchrun starts with SIGUSR1 ignored, since it would
# die of it and take the ranks along; the ranks install their own handler. The wrapper
# marks the signal for this script and forwards it to the ranks (torchrun's children).
# shellcheck disable=SC2317  # invoked through srun, via declare -f
hyflow_node() {
    local mark=$1 pid rc
    shift
    trap '' USR1
    "$@" &
    pid=$!
    trap 'touch "$mark.${SLURM_NODEID:-0}"; pkill -USR1 -P "$pid" || true' USR1
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
    bash -c "$(declare -f hyflow_node); hyflow_node \"\$@\"" hyflow-node "$PREEMPT_MARK" \
    @@TORCHRUN@@ --nnodes=@@NODES@@ --nproc-per-node=@@GPUS@@ \
        --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="hyflow-$JOB_ID" \
        --max-restarts=0 \
        "${HYFLOW_CMD[@]}"
rc=$?
set -e

if compgen -G "$PREEMPT_MARK.*" >/dev/null; then
    if (( RESTART < MAX_REQUEUES )); then
        echo "[hyflow] preempted (SIGUSR1, exit code $rc): requeueing job $JOB_ID"
        scontrol requeue "$JOB_ID"
        exit 0
    fi
    echo "[hyflow] preempted, but all $MAX_REQUEUES requeue(s) are used up" >&2
fi
echo "[hyflow] job $JOB_ID finished with exit code $rc"
exit "$rc"
"""
