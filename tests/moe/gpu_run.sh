#!/usr/bin/env bash
# The MoE expert GEMMs' GPU check, one call on an H200 (repository root, $OUT set):
#   bash tests/moe/gpu_run.sh
# Carry: .gpucarry-moe2 (`nvl72 kernels build --arch sm_90a --out .gpucarry-moe2 --module
# moe.kernels.sm90_grouped_gemm --module moe.kernels.sm90_grouped_gemm_ws`).
# 1) the @gpu tests of tests/moe without the warp-specialized ("ws") variants, then those alone,
#    each in its own process (a faulting new kernel cannot take the others' results with it);
# 2) perf.moe on both models at 1..16384 tokens with the ws columns, only if the ws tests passed;
#    if that run fails (or the ws tests did), perf.moe again without them.
# Logs under $OUT; the perf table comes last.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/moe-out}
mkdir -p "$OUT"
source .gpucarry-moe2/sm_90a/setup_device.sh || exit 1
timeout 20 nvidia-smi -L
timeout 60 python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
PYTEST="python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/moe/test_gpu_kernels.py"
timeout 100 $PYTEST -k "not ws" > "$OUT/pytest_classic.log" 2>&1
echo "pytest (classic kernels) rc=$?"; tail -4 "$OUT/pytest_classic.log"
timeout 80 $PYTEST -k "ws" > "$OUT/pytest_ws.log" 2>&1
ws_rc=$?
echo "pytest (ws kernels) rc=$ws_rc"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_ws.log" | head -12; tail -3 "$OUT/pytest_ws.log"
PERF="python3 -m perf.moe --iters 10 --tokens 1,8,128,256,1024,4096,16384"
perf_rc=1
if [ "$ws_rc" -eq 0 ]; then
  timeout 170 $PERF --json "$OUT/moe.json" > "$OUT/perf.log" 2>&1
  perf_rc=$?
  echo "perf.moe (with ws) rc=$perf_rc"
fi
if [ "$perf_rc" -ne 0 ]; then
  [ -f "$OUT/perf.log" ] && mv "$OUT/perf.log" "$OUT/perf_ws_failed.log" && grep -Ev "^ +qwen" "$OUT/perf_ws_failed.log" | tail -5
  timeout 150 $PERF --no-ws --json "$OUT/moe.json" > "$OUT/perf.log" 2>&1
  echo "perf.moe (without ws) rc=$?"
fi
if [ -f "$OUT/perf_ws_failed.log" ]; then
  echo "## rows measured by the failed run with ws columns"
  grep -E "^ +qwen" "$OUT/perf_ws_failed.log"
fi
grep -E "^# " "$OUT/perf.log" | head -20
grep -E "^ +model|^ +qwen" "$OUT/perf.log" || tail -30 "$OUT/perf.log"
