#!/usr/bin/env bash
# One-call (<= 150 s) probe of the combine fault (issue #7) on ONE GPU (nvidia-h200; world 1 reproduces):
#   bash tests/comms/gpu_combine_probe.sh        carry: .gpucarry-all
# Known from earlier probes: every warp finishes phase A, none passes the ccnt flag wait, the fault comes
# ~0.9 s after the launch, compute-sanitizer runs clean. Each run below is config 0 in a fresh process,
# with the counters (dcnt, ccnt) printed before combine:
# 1) baseline (kernel timeout 5 s);  2) timeout 0.05 s and 3) 30 s: does the fault follow the timeout?
# 4) 1 block and 5) 8 blocks: does it need many co-resident blocks?  6) torch symmetric memory instead
# of the cuMem heap: is it the heap's mapping?
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/combine-probe}
mkdir -p "$OUT"
source .gpucarry-all/sm_90a/setup_device.sh || exit 1
export NVL72_KERNEL_BUNDLE=$PWD/.gpucarry-all PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} CUDA_LAUNCH_BLOCKING=1
run() {  # name, env..., -- args
  local name=$1; shift
  env "$@" timeout -k 5 40 python3 tests/comms/dispatch_gpu_debug.py 1 config 0 ${BLOCKS:-} > "$OUT/$name.log" 2>&1
  echo "== $name rc=$?"; grep -hE "^(FAULT|PASS|FAIL|INFO)" "$OUT/$name.log" | cut -c1-220 | head -4
}
run base NVL72_DISPATCH_DEBUG_KERNEL_TIMEOUT_S=5
run t005 NVL72_DISPATCH_DEBUG_KERNEL_TIMEOUT_S=0.05
run t30 NVL72_DISPATCH_DEBUG_KERNEL_TIMEOUT_S=30
BLOCKS=1 run blocks1 NVL72_DISPATCH_DEBUG_KERNEL_TIMEOUT_S=5
BLOCKS=8 run blocks8 NVL72_DISPATCH_DEBUG_KERNEL_TIMEOUT_S=5
run torchheap NVL72_DISPATCH_DEBUG_HEAP=torch
