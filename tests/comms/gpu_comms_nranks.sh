#!/usr/bin/env bash
# The comms kernels at every visible GPU (4 or 8 ranks: nvidia-h200-x4 / -x8), one call (repository root,
# $OUT set; every step has a timeout, their sum 580 s, each step prints its elapsed time):
#   bash tests/comms/gpu_comms_nranks.sh
# Carry: .gpucarry-all (`nvl72 kernels build --arch sm_90a --out .gpucarry-all`).
# 1) tests/comms/test_dispatch_gpu.py at N ranks: fused dispatch/combine == the NCCL reference, bit for bit;
# 2) tests/comms/test_allreduce_gpu.py at N ranks (every algorithm, graph replay, fused add+RMSNorm, timeout);
# 3) perf.comms dispatch at N ranks: 1, 128, 4096 tokens/rank, hidden 4096 / 7168, 128 / 256 experts,
#    bf16 / MXFP8, beside the NCCL path and the floor (NCCL send/recv measured in the same run);
# 4) perf.comms allreduce at N ranks, 1 KiB .. 256 MiB, graph replay: ours beside NCCL and torch
#    symmetric memory (multicast off everywhere).
# Logs and JSONs under $OUT; the tables come last.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/comms-nranks-out}
mkdir -p "$OUT"
source .gpucarry-all/sm_90a/setup_device.sh || exit 1
export NVL72_KERNEL_BUNDLE=$PWD/.gpucarry-all
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
N=$(python3 -c "import torch; print(torch.cuda.device_count())")
timeout 20 nvidia-smi topo -m | head -$((N + 1))
timeout -k 5 120 python3 tests/comms/test_dispatch_gpu.py "$N" "$OUT/dispatch_test_summary.log" > "$OUT/dispatch_test.log" 2>&1
echo "dispatch test at $N ranks rc=$? (${SECONDS}s): $(grep -c '^PASS' "$OUT/dispatch_test.log") PASS, $(grep -c '^FAIL' "$OUT/dispatch_test.log") FAIL"
grep -E "^FAIL|Error" "$OUT/dispatch_test.log" | head -6
timeout -k 5 260 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/comms/test_allreduce_gpu.py \
  > "$OUT/allreduce_test.log" 2>&1
echo "allreduce test at $N ranks rc=$? (${SECONDS}s): $(tail -1 "$OUT/allreduce_test.log")"
grep -E "^(FAILED|ERROR)" "$OUT/allreduce_test.log" | head -6
timeout -k 5 110 python3 -m perf.comms dispatch --tokens 1,128,4096 --hidden 4096,7168 --experts 128,256 \
  --payload bf16,mxfp8 --iters 20 --timeout 105 --json "$OUT/dispatch.json" > "$OUT/dispatch_perf.log" 2>&1
echo "perf.comms dispatch rc=$? (${SECONDS}s)"
grep -E "Error|error" "$OUT/dispatch_perf.log" | grep -v "^ " | tail -4
timeout -k 5 90 python3 -m perf.comms allreduce --min-bytes 1K --max-bytes 256M --timeout-s 85 \
  --algos lamport,oneshot,twoshot,nccl,torch_one_shot,torch_two_shot --no-eager --repeat 3 \
  --json "$OUT/allreduce.json" > "$OUT/allreduce_perf.log" 2>&1
echo "perf.comms allreduce rc=$? (${SECONDS}s)"
grep -E "Error|error" "$OUT/allreduce_perf.log" | grep -v "^ " | tail -4
grep -vE "^(Traceback|  |W[0-9]|\[W|[0-9-]+ [0-9:,]+ INFO)" "$OUT/dispatch_perf.log" | tail -30
grep -vE "^(Traceback|  |W[0-9]|\[W|[0-9-]+ [0-9:,]+ INFO)" "$OUT/allreduce_perf.log" | tail -40
