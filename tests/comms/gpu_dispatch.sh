#!/usr/bin/env bash
# The fused DP-EP dispatch/combine GPU check, one call on nvidia-h200-x2 (repository root, $OUT set):
#   bash tests/comms/gpu_dispatch.sh
# Carry: .gpucarry-all (`nvl72 kernels build --arch sm_90a --out .gpucarry-all`).
# 1) tests/comms/dispatch_gpu_debug.py with CUDA_LAUNCH_BLOCKING=1: per config, dispatch alone +
#    synchronize, heap bookkeeping read back, combine alone + synchronize -> names the faulting kernel;
#    on a failure: compute-sanitizer memcheck on config 0 (the faulting instruction's offset and
#    address), then stop;
# 2) the bitwise correctness test against the NCCL reference;
# 3) perf.comms dispatch. Logs under $OUT; the perf table comes last.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/dispatch-out}
mkdir -p "$OUT"
source .gpucarry-all/sm_90a/setup_device.sh || exit 1
export NVL72_KERNEL_BUNDLE=$PWD/.gpucarry-all
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
timeout 20 nvidia-smi -L
CUDA_LAUNCH_BLOCKING=1 timeout -k 5 120 python3 tests/comms/dispatch_gpu_debug.py 2 > "$OUT/debug.log" 2>&1
debug_rc=$?
echo "debug (dispatch / combine alone, CUDA_LAUNCH_BLOCKING=1) rc=$debug_rc"
grep -E "^(FAULT|BAD|FAIL|PASS)" "$OUT/debug.log" | head -30
grep -E "^INFO" "$OUT/debug.log" | head -4
if [ "$debug_rc" -ne 0 ]; then
  # the faulting instruction: memcheck on config 0, combine_k4 only (offsets map to the sm_90a SASS)
  if command -v compute-sanitizer > /dev/null; then
    NVL72_DISPATCH_DEBUG_TIMEOUT_S=240 timeout -k 5 270 compute-sanitizer --tool memcheck --target-processes all \
      --kernel-name kns=gmemo441_tensorptrbf16 --print-limit 12 --show-backtrace no \
      python3 tests/comms/dispatch_gpu_debug.py 2 config 0 > "$OUT/sanitizer.log" 2>&1
    echo "compute-sanitizer memcheck (config 0) rc=$?"
    grep -E "^========= (Invalid|Program hit|  +at|  +by|  +Address|ERROR SUMMARY)" "$OUT/sanitizer.log" | head -24
  else
    echo "compute-sanitizer not on PATH"
  fi
  exit 1  # the correctness test and the benchmark would fault the same way
fi
timeout -k 5 150 python3 tests/comms/test_dispatch_gpu.py 2 "$OUT/test_summary.log" > "$OUT/test.log" 2>&1
echo "correctness test rc=$?"
grep -E "^(PASS|FAIL)" "$OUT/test.log" | head -30
grep -E "Error|error" "$OUT/test.log" | grep -v "^FAIL" | tail -4
timeout -k 5 150 python3 -m perf.comms dispatch --tokens 1,8,32,128,512,1024,4096 --hidden 4096,7168 \
  --experts 128,256 --timeout 140 --json "$OUT/dispatch.json" > "$OUT/perf.log" 2>&1
echo "perf.comms dispatch rc=$?"
grep -E "Error|error" "$OUT/perf.log" | tail -3
grep -vE "^(Traceback|  |W[0-9]|\[W)" "$OUT/perf.log" | head -40
