#!/usr/bin/env bash
# Batch-1 decode kernels (issue #4), one call on the GPU host (repository root, $OUT set), <= 200 s:
#   bash tests/runner/gpu_decode_b1.sh           carry: [".gpucarry-all"] (the CuTeDSL bundle)
#   bash tests/runner/gpu_decode_b1.sh --gemv    (no tests: perf.serve with cuBLAS, then Triton GEMV)
# 1) the @gpu tests of tests/runner (fused residual add + RMSNorm [+ MoE router logits], RoPE
#    table and slot-mapping kernels, K/V store inside q/k norm + RoPE, split-key decode attention,
#    packed q/k/v GEMM, Triton GEMV; greedy tokens equal to the torch reference, graphs on == off,
#    the sm90 FP8 MoE in graphs), of the async engine and the MoE Triton data-path kernels (route,
#    quantize, un-permute) against their references;
# 2) perf.serve (Qwen3-30B-A3B shape, 8 layers, triton + CUDA graphs, async) with --profile; with
#    --gemv twice: as is (cuBLAS projections) and with NVL72_TRITON_GEMV=1 (Triton GEMV for the
#    q/k/v and o_proj projections of single-token steps).
# Logs under $OUT; the SERVE table(s), then the PROFILE tables (kernels by GPU time) come last.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/decode-b1-out}
mkdir -p "$OUT"
source .gpucarry-all/sm_90a/setup_device.sh || exit 1
export NVL72_KERNEL_BUNDLE=$PWD/.gpucarry-all
nvidia-smi -L
if [ "${1:-}" = "--gemv" ]; then
  runs="cublas:0 gemv:1"
else
  runs="cublas:0"
  timeout -k 5 100 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/runner \
    tests/engine/test_engine_async.py "tests/moe/test_gpu_kernels.py::test_triton_route_and_quant_ops" 2>&1 | tee "$OUT/pytest.log" | tail -15
  echo "pytest rc=${PIPESTATUS[0]}"
fi
for run in $runs; do
  name=${run%:*}
  NVL72_TRITON_GEMV=${run#*:} timeout -k 5 85 python3 -m perf.serve --layers 8 --modes graphs --no-ttft \
    --decode-out 64 --profile "/tmp/prof_$name" --json "$OUT/serve_$name.json" > "$OUT/serve_$name.log" 2>&1
  echo "perf.serve $name rc=$?"
  gzip -c "/tmp/prof_$name/decode_b1.json" > "$OUT/decode_b1_$name.json.gz" 2>/dev/null
done
for run in $runs; do
  name=${run%:*}
  echo "== $name"
  grep -E "Error|error" "$OUT/serve_$name.log" | head -4
  grep -A4 "^SERVE" "$OUT/serve_$name.log" || tail -15 "$OUT/serve_$name.log"
done
for run in $runs; do
  name=${run%:*}
  echo "== $name"
  awk '/^PROFILE/{p=1} /^SERVE/{p=0} p' "$OUT/serve_$name.log" | cut -c1-160
done
