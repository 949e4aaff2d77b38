#!/usr/bin/env bash
# The large-message all-reduce GPU check (issue #6: 128 MiB <= 0.9x torch two_shot_all_reduce_), one call
# on nvidia-h200-x2 (repository root, $OUT set), <= 150 s:
#   bash tests/comms/gpu_allreduce_large.sh
# Carry: .gpucarry-arlarge (`nvl72 kernels build --arch sm_90a --out .gpucarry-arlarge --module comms.kernels.allreduce`).
# 1) the twoshot_push GPU test (heap buffers to 64 MiB, in place and not, bf16 and fp32 vs an fp32 sum and
#    bitwise vs the staged twoshot, in-place graph replay, timeout);
# 2) perf.comms allreduce from 16 MiB to 128 MiB: twoshot, twoshot_push (in place on a heap buffer, as torch's
#    op), twoshot_symm, twoshot_pipe, torch two_shot, NCCL.
# Writes $OUT/test.log, $OUT/perf.log, $OUT/allreduce_large.json; the graph-replay table comes last.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/allreduce-large-out}
mkdir -p "$OUT"
source .gpucarry-arlarge/sm_90a/setup_device.sh || exit 1
export NVL72_KERNEL_BUNDLE=$PWD/.gpucarry-arlarge
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
timeout 10 nvidia-smi -L
timeout -k 5 60 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/comms/test_allreduce_gpu.py \
  -k twoshot_push > "$OUT/test.log" 2>&1
echo "pytest test_allreduce_gpu.py -k twoshot_push rc=$?"
grep -E "^(FAILED|ERROR)|Error" "$OUT/test.log" | head -8
tail -2 "$OUT/test.log"
timeout -k 5 65 python3 -m perf.comms allreduce --nproc 2 --min-bytes 16M --max-bytes 128M --timeout-s 62 \
  --algos twoshot,twoshot_push,twoshot_symm,twoshot_pipe,torch_two_shot,nccl --json "$OUT/allreduce_large.json" \
  > "$OUT/perf.log" 2>&1
echo "perf.comms allreduce rc=$?"
grep -E "Error|error" "$OUT/perf.log" | grep -v "^ " | tail -4
grep -vE "^(Traceback|  |W[0-9]|\[W|[0-9-]+ [0-9:,]+ INFO)" "$OUT/perf.log" | tail -40
