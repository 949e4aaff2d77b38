#!/usr/bin/env bash
# Start nvl72 under MPI (MPICH/Hydra `mpiexec`, or Open MPI `mpirun`): one process per GPU (or per
# CPU worker), every rank runs `python -m launch "$@"`. Ranks find each other through MPI (rank 0
# picks the rendezvous and broadcasts it) unless MASTER_ADDR and MASTER_PORT are set.
#
#   NP=3 launch/mpirun.sh --rack cpu:3 --model Qwen3-30B-A3B --prefill-tp 2 --decode-size 1 \
#       --prefill-instances 1 --decode-instances 1 --run-seconds 5          # CPU, one host
#   NP=8 PPN=8 HOSTS=node0 launch/mpirun.sh --plan plan.json                 # one HGX node
#
# NP: total ranks (default 1). PPN: ranks per node (placed in blocks per node). HOSTS: comma-separated
# hosts. MPIRUN: the launcher (default: mpiexec next to $PYTHON, else on PATH). MPIRUN_ARGS: extra
# launcher options. PYTHON: the interpreter (default python).
set -euo pipefail
PYTHON="${PYTHON:-python}"
NP="${NP:-1}"
if [ -z "${MPIRUN:-}" ]; then
    MPIRUN="$(dirname "$(command -v "$PYTHON")")/mpiexec"
    [ -x "$MPIRUN" ] || MPIRUN="$(command -v mpiexec || command -v mpirun)"
fi
args=(-n "$NP")
if "$MPIRUN" --version 2>&1 | grep -qi "open mpi"; then
    [ -n "${PPN:-}" ] && args+=(--map-by "ppr:${PPN}:node")
    [ -n "${HOSTS:-}" ] && args+=(--host "$HOSTS")
else  # MPICH / Hydra
    [ -n "${PPN:-}" ] && args+=(-ppn "$PPN")
    [ -n "${HOSTS:-}" ] && args+=(-hosts "$HOSTS")
fi
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
# shellcheck disable=SC2086
exec "$MPIRUN" "${args[@]}" ${MPIRUN_ARGS:-} "$PYTHON" -m launch "$@"
