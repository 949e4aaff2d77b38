#!/usr/bin/env bash
# Batch-1 decode kernels (issue #4), one call on the GPU host (repository root, $OUT set), <= 200 s:
#   bash tests/runner/gpu_decode_b1.sh      carry: [".gpucarry-all"] (the CuTeDSL bundle)
# 1) the @gpu tests of tests/runner (fused residual add + RMSNorm, RoPE table and slot-mapping
#    kernels, split-key decode attention, packed q/k/v GEMM; greedy tokens equal to the torch
#    reference, graphs on == off, the sm90 FP8 MoE in graphs) and of the async engine;
# 2) perf.serve (Qwen3-30B-A3B shape, 8 layers, triton + CUDA graphs, async) with --profile.
# Logs under $OUT; the SERVE table, then the PROFILE tables (kernels by GPU time, b=1 and b=64) last.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/decode-b1-out}
mkdir -p "$OUT"
source .gpucarry-all/sm_90a/setup_device.sh || exit 1
export NVL72_KERNEL_BUNDLE=$PWD/.gpucarry-all
nvidia-smi -L
timeout -k 5 90 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/runner tests/engine/test_engine_async.py \
  2>&1 | tee "$OUT/pytest.log" | tail -15
echo "pytest rc=${PIPESTATUS[0]}"
timeout -k 5 95 python3 -m perf.serve --layers 8 --modes graphs --no-ttft --decode-out 64 --profile /tmp/prof \
  --json "$OUT/serve.json" > "$OUT/serve.log" 2>&1
echo "perf.serve rc=$?"
gzip -c /tmp/prof/decode_b1.json > "$OUT/decode_b1.json.gz" 2>/dev/null
grep -E "Error|error" "$OUT/serve.log" | head -4
grep -A4 "^SERVE" "$OUT/serve.log" || tail -15 "$OUT/serve.log"
awk '/^PROFILE/{p=1} /^SERVE/{p=0} p' "$OUT/serve.log" | cut -c1-200
