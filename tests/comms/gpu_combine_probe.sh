#!/usr/bin/env bash
# One-call (<= 150 s) probe of the combine fault (issue #7) on ONE GPU (nvidia-h200; world 1 reproduces):
#   bash tests/comms/gpu_combine_probe.sh        carry: .gpucarry-all (built with NVL72_DISPATCH_DEBUG_VARIANTS=1)
# 1) config 0 with combine_k4: the FAULT line now gives the elapsed ms (~5000 ms = the wait ran to its
#    timeout_s and the fault is on/after the timeout path; a few ms = a fast fault);
# 2) trace mode on world 1: where every warp stopped without any peer;
# 3) the skip variants on world 1 (skip2 and skip3 have the same memory accesses in SASS: ptxas drops
#    phase A's dead loads, so a different outcome means timing/layout, not an address).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/combine-probe}
mkdir -p "$OUT"
source .gpucarry-all/sm_90a/setup_device.sh || exit 1
export NVL72_KERNEL_BUNDLE=$PWD/.gpucarry-all PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} CUDA_LAUNCH_BLOCKING=1
timeout 20 nvidia-smi -L
timeout -k 5 35 python3 tests/comms/dispatch_gpu_debug.py 1 config 0 > "$OUT/config0.log" 2>&1; echo "config0 rc=$?"
timeout -k 5 45 python3 tests/comms/dispatch_gpu_debug.py 1 trace > "$OUT/trace.log" 2>&1; echo "trace rc=$?"
timeout -k 5 60 python3 tests/comms/dispatch_gpu_debug.py 1 skips > "$OUT/skips.log" 2>&1; echo "skips rc=$?"
echo "== summary"
grep -hE "^(FAULT|TRACE|PASS|FAIL)" "$OUT/config0.log" "$OUT/trace.log" "$OUT/skips.log" | cut -c1-200 | head -40
