#!/usr/bin/env bash
# Fused DP-EP dispatch/combine: bitwise check, then a grid-size sweep with phase stamps; one call on
# nvidia-h200-x2 (repository root, $OUT set), <= 120 s:
#   bash tests/comms/gpu_dispatch_sweep.sh
# Carry: .gpucarry-disp (`nvl72 kernels build --arch sm_90a --out .gpucarry-disp --module comms.kernels.dispatch`).
# 1) tests/comms/test_dispatch_gpu.py against the NCCL reference (exact); on a failure: print them, stop;
# 2) perf.comms dispatch at 1, 128, 4096 tokens/rank, hidden 4096, 128 experts, top-8, per grid size
#    (auto = sized per call), each row followed by its phase stamps (`#   phases`). Logs under $OUT;
#    the table comes last.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/dispatch-sweep-out}
mkdir -p "$OUT"
source .gpucarry-disp/sm_90a/setup_device.sh || exit 1
export NVL72_KERNEL_BUNDLE=$PWD/.gpucarry-disp
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
timeout 20 nvidia-smi -L
timeout -k 5 65 python3 tests/comms/test_dispatch_gpu.py 2 "$OUT/test_summary.log" > "$OUT/test.log" 2>&1
rc=$?
echo "correctness test rc=$rc"
grep -E "^(PASS|FAIL)" "$OUT/test.log" | head -30
if [ "$rc" -ne 0 ]; then
  grep -E "Error|error" "$OUT/test.log" | grep -v "^FAIL" | tail -6
  exit 1
fi
timeout -k 5 45 python3 -m perf.comms dispatch --tokens 1,128,4096 --hidden 4096 --experts 128 \
  --blocks auto,16,66,132 --phases --skip-nccl --iters 20 --timeout 40 --json "$OUT/dispatch_sweep.json" \
  > "$OUT/perf.log" 2>&1
echo "perf.comms dispatch rc=$?"
grep -E "Error|error" "$OUT/perf.log" | tail -3
grep -vE "^(Traceback|  |W[0-9]|\[W)" "$OUT/perf.log" | head -60
