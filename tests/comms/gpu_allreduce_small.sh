#!/usr/bin/env bash
# The small-message all-reduce GPU check (issue #6), one call on nvidia-h200-x2 (repository root, $OUT set):
#   bash tests/comms/gpu_allreduce_small.sh
# Carry: .gpucarry-all (`nvl72 kernels build --arch sm_90a --out .gpucarry-all`).
# 1) tests/comms/test_allreduce_gpu.py (every algorithm, graph replay, Lamport with and without PDL, the
#    two-shot blocks override and auto on heap buffers,
#    fused add+RMSNorm, the peer timeout);
# 2) perf.comms allreduce from 1 KiB to 1 MiB: lamport (PDL), lamport_nopdl, oneshot, NCCL, torch
#    symmetric memory, plus the fused add+RMSNorm rows. Logs under $OUT (test.log, perf.log,
#    allreduce.json); the graph-replay table comes last.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/allreduce-small-out}
mkdir -p "$OUT"
source .gpucarry-all/sm_90a/setup_device.sh || exit 1
export NVL72_KERNEL_BUNDLE=$PWD/.gpucarry-all
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
timeout 20 nvidia-smi -L
timeout -k 5 125 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/comms/test_allreduce_gpu.py \
  > "$OUT/test.log" 2>&1
echo "pytest tests/comms/test_allreduce_gpu.py rc=$?"
grep -E "^(FAILED|ERROR)|Error" "$OUT/test.log" | head -8
tail -2 "$OUT/test.log"
timeout -k 5 45 python3 -m perf.comms allreduce --nproc 2 --min-bytes 1K --max-bytes 1M --timeout-s 42 \
  --algos lamport,lamport_nopdl,oneshot,nccl,torch_one_shot,torch_two_shot --no-eager \
  --json "$OUT/allreduce.json" > "$OUT/perf.log" 2>&1
echo "perf.comms allreduce rc=$?"
grep -E "Error|error" "$OUT/perf.log" | grep -v "^ " | tail -4
grep -vE "^(Traceback|  |W[0-9]|\[W|[0-9-]+ [0-9:,]+ INFO)" "$OUT/perf.log" | tail -60
