#!/usr/bin/env bash
# Async scheduling's GPU check, one call on the GPU host (repository root, $OUT set), <= 200 s:
#   bash tests/runner/gpu_async.sh        carry: [".gpucarry-all"] (the CuTeDSL bundle)
# 1) the @gpu tests of the async engine (graphs: async == sync streams, aborts, no synchronizing
#    CUDA call in steady-state decode) and of tests/runner (graphs now run async by default);
# 2) perf.serve (Qwen3-30B-A3B shape, 8 layers, triton + CUDA graphs) with and without async
#    scheduling. Logs under $OUT; both tables come last.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/async-out}
mkdir -p "$OUT"
source .gpucarry-all/sm_90a/setup_device.sh || exit 1
export NVL72_KERNEL_BUNDLE=$PWD/.gpucarry-all
nvidia-smi -L
timeout -k 5 70 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/engine/test_engine_async.py \
  tests/runner/test_runner_engine.py 2>&1 | tee "$OUT/pytest.log" | tail -15
echo "pytest rc=${PIPESTATUS[0]}"
for run in "async 60" "sync 55 --no-async"; do
  set -- $run
  timeout -k 5 "$2" python3 -m perf.serve --layers 8 --modes graphs --no-ttft --decode-out 64 ${3:-} \
    --json "$OUT/serve_$1.json" > "$OUT/serve_$1.log" 2>&1
  echo "perf.serve $1 rc=$?"
done
for mode in async sync; do
  grep -E "Error|error" "$OUT/serve_$mode.log" | head -4
  grep -A6 "^SERVE" "$OUT/serve_$mode.log" || tail -15 "$OUT/serve_$mode.log"
done
