#!/usr/bin/env bash
# Start nvl72 under Slurm: one process per GPU, every rank runs `python -m launch "$@"`.
#
#   sbatch -N 18 --ntasks-per-node=4 --gpus-per-node=4 launch/srun.sh --plan plan.json
#   salloc -N 4 ... launch/srun.sh --model Qwen3-235B-A22B --input-tps 2e5 --output-tps 5e4
#
# The rendezvous is the first node of the allocation (MASTER_ADDR) on a port derived from the job id
# (MASTER_PORT), unless both are already set. GPUS_PER_NODE overrides the tasks per node (default:
# SLURM_GPUS_ON_NODE, else 4). PYTHON overrides the interpreter; SRUN_ARGS adds srun options.
set -euo pipefail
: "${SLURM_JOB_ID:?launch/srun.sh must run inside a Slurm allocation (sbatch or salloc)}"
: "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set}"
GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-4}}"
NODES="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}"
if [ -z "${MASTER_ADDR:-}" ]; then
    MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
fi
MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
export MASTER_ADDR MASTER_PORT
# Multicast objects need the IMEX channel on GB200; NCCL's NVLS stays off unless asked for.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
echo "launch/srun.sh: ${NODES} nodes x ${GPUS_PER_NODE} ranks, rendezvous ${MASTER_ADDR}:${MASTER_PORT}" >&2
# shellcheck disable=SC2086
exec srun --nodes="$NODES" --ntasks-per-node="$GPUS_PER_NODE" --kill-on-bad-exit=1 ${SRUN_ARGS:-} \
    "${PYTHON:-python}" -m launch "$@"
