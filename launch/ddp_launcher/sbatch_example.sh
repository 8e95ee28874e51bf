#!/bin/bash
# Multi-node DDP with srun + an app's script, no torchrun: every SLURM task is one rank.
#
#   APP=my_app.py sbatch launch/ddp_launcher/sbatch_example.sh [the app's overrides ...]
#   APP=my_app.py sbatch --nodes=4 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=8 \
#       launch/ddp_launcher/sbatch_example.sh lr=0.1
#   RUN_DIR=outputs/my-run APP=my_app.py sbatch launch/ddp_launcher/sbatch_example.sh ...
#
# APP is the app's script (default my_app.py, a placeholder: set yours, or edit it here),
# submitted from its folder; RUN_DIR its run dir (default outputs/slurm-<job id>). The
# experiment this package came with shows its own use of this script in docs/slurm.md.
#
# Each task maps SLURM's variables to torch's (the mapping of hydra/launcher=slurm, see
# launch/ddp_launcher/slurm.py; `srun python -m ddp_launcher.ranks.slurm_task env` prints it): RANK=SLURM_PROCID,
# LOCAL_RANK=SLURM_LOCALID, WORLD_SIZE=SLURM_NTASKS, LOCAL_WORLD_SIZE=tasks per node,
# MASTER_ADDR=the job's first node, MASTER_PORT from the job id. The app then runs as a rank
# of an env:// process group; with `dist.nproc_per_node`/`dist.nnodes` left at auto it takes
# the world from these variables (an explicit value that disagrees is an error).
#
# One run dir for all tasks: hydra.run.dir=$RUN_DIR (a concrete path: `${now:}` would resolve
# per task). Rank 0 writes it (.hydra/, its log, the app's records, W&B); the other ranks
# write nothing and print only errors (an app run through the package's entry point).
#
# Preemption and time limits: SLURM sends USR1 120 s before the time limit (--signal) and TERM
# on preemption. The ranks stop at an agreed step, rank 0 writes a checkpoint and requeues the
# job (--requeue); the requeued job has the same job id, hence the same RUN_DIR, and
# SLURM_RESTART_COUNT > 0 tells the app to resume from that checkpoint (in the same W&B run,
# where the app keeps its run id with it).
#
#SBATCH --job-name=hydra-ddp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=4
#SBATCH --time=04:00:00
#SBATCH --signal=USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%j.out
# GPU nodes: one task per GPU, every rank sees the node's GPUs and takes GPU LOCAL_RANK:
#   --ntasks-per-node=<GPUs per node> --gpus-per-node=<GPUs per node> (not --gpus-per-task).

set -euo pipefail
# The signals are for the ranks (the app's preemption handling); this shell waits for srun to finish.
trap ':' TERM USR1

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# A different port per job and per requeue: a requeued job never meets the old store.
MASTER_PORT=${MASTER_PORT:-$((20000 + (SLURM_JOB_ID + 7919 * ${SLURM_RESTART_COUNT:-0}) % 40000))}
export MASTER_ADDR MASTER_PORT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
# Since SLURM 22.05 srun does not inherit --cpus-per-task (`man srun`): without this, a cluster
# that binds tasks to cores runs each rank, its threads and DataLoader workers on one CPU.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"; fi
export RUN_DIR=${RUN_DIR:-outputs/slurm-$SLURM_JOB_ID}
export PYTHON=${PYTHON:-python}
export APP=${APP:-my_app.py}

echo "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $SLURM_NTASKS rank(s) on" \
     "$SLURM_JOB_NUM_NODES node(s), rendezvous $MASTER_ADDR:$MASTER_PORT, run dir $RUN_DIR," \
     "$APP"

# --kill-on-bad-exit: one rank failing ends the job at once (no agent: the others would
# otherwise wait for the collective timeout, dist.step_timeout_s).
srun --kill-on-bad-exit=1 bash -c '
    trap ":" TERM USR1  # (as above: python handles them)
    export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS
    export LOCAL_WORLD_SIZE=${SLURM_NTASKS_PER_NODE:-$((SLURM_NTASKS / SLURM_JOB_NUM_NODES))}
    "$PYTHON" "$APP" "hydra.run.dir=$RUN_DIR" "$@"
    code=$?
    # Preempted (75): rank 0 requeues the job once its checkpoint and W&B are done; the other
    # ranks end quietly so that --kill-on-bad-exit does not cut rank 0 short.
    if [ "$code" = 75 ] && [ "$RANK" != 0 ]; then exit 0; fi
    exit "$code"
' bash "$@"
