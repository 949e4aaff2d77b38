#!/usr/bin/env bash
# Batch-1 decode kernels (issue #4), one call on the GPU host (repository root, $OUT set):
#   bash tests/runner/gpu_decode_b1.sh           carry: [".gpucarry-all"] (the CuTeDSL bundle), <= 200 s
#   bash tests/runner/gpu_decode_b1.sh --gemv    (no tests: perf.serve with cuBLAS, then Triton GEMV, the default)
#   bash tests/runner/gpu_decode_b1.sh --pdl     (<= 300 s: tests, then perf.serve with PDL off / on / on +
#                                                 Triton GEMV)
#   bash tests/runner/gpu_decode_b1.sh --layer   (<= 460 s: tests, then perf.serve with NVL72_DECODE_LAYER=0,
#                                                 fused, phased: one-token layers in one kernel, see
#                                                 nvl72/model/decode_layer.py)
#   bash tests/runner/gpu_decode_b1.sh --moe     (<= 500 s: tests, then perf.serve with the one-token MoE on
#                                                 the FP8 pipeline / the fused decode kernels, twice each,
#                                                 alternating: NVL72_MOE_FUSED_DECODE_TOKENS=0 / 1)
#   bash tests/runner/gpu_decode_b1.sh --fuse    (<= 400 s: tests, then perf.serve with the input norm before
#                                                 / inside the q/k/v GEMV, NVL72_NORM_GEMV=0 / 1, twice each,
#                                                 alternating)
# 1) the @gpu tests of tests/runner (fused residual add + RMSNorm [+ MoE router logits], RoPE
#    table and slot-mapping kernels, K/V store inside q/k norm + RoPE, split-key decode attention,
#    packed q/k/v GEMM, Triton GEMV; greedy tokens equal to the torch reference, graphs on == off,
#    the sm90 FP8 MoE in graphs; a decode layer's Triton kernels launched with programmatic
#    dependent launch in a CUDA graph == launched plainly), of the async engine and the MoE Triton
#    data-path kernels (route, quantize, un-permute) against their references (with --pdl: the
#    tests of tests/runner and the MoE data-path test only);
# 2) perf.serve (Qwen3-30B-A3B shape, $LAYERS layers (default 48), triton + CUDA graphs, async, PDL and the Triton GEMV as
#    by default) with --profile; with
#    --gemv twice: with NVL72_TRITON_GEMV=0 (cuBLAS projections) and =1 (Triton GEMV for the
#    q/k/v and o_proj projections of single-token steps); with --pdl three times: NVL72_PDL=0 (every
#    Triton kernel launched plainly), NVL72_PDL=1 (the default: PDL on sm_90+ streams, so inside
#    the graphs), NVL72_PDL=1 with the Triton GEMV; graphs for batch 1 and 64 only (the two measured:
#    shorter capture). Compare the decode step ms (no profiler): under PDL a kernel's profiled GPU
#    time includes its wait for the previous one.
# Logs under $OUT; the SERVE table(s), the PROFILE tables (kernels by GPU time), then (--pdl) a
# one-line-per-run table come last.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/decode-b1-out}
mkdir -p "$OUT"
source .gpucarry-all/sm_90a/setup_device.sh || exit 1
export NVL72_KERNEL_BUNDLE=$PWD/.gpucarry-all
nvidia-smi -L
mode=${1:-}
budget=${BUDGET:-300}  # seconds for the whole call; a run gets what is left, at most $per_run
case "$mode" in
  --gemv) runs="cublas:1:0 gemv:1:1"; per_run=85; sizes="" ;;  # name:NVL72_PDL:NVL72_TRITON_GEMV[:NVL72_DECODE_LAYER]
  --pdl) runs="plain:0:0 pdl:1:0 pdl_gemv:1:1"; per_run=80; sizes="--graph-batch-sizes 1,64"
    timeout -k 5 80 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/runner \
      "tests/moe/test_gpu_kernels.py::test_triton_route_and_quant_ops" 2>&1 | tee "$OUT/pytest.log" | tail -15
    echo "pytest rc=${PIPESTATUS[0]}" ;;
  --moe) runs="pipe:1:1:0:0 fdec:1:1:0:1 pipe2:1:1:0:0 fdec2:1:1:0:1"; per_run=90; budget=${BUDGET:-500}
    sizes="--graph-batch-sizes 1,64"
    timeout -k 5 90 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/moe/test_triton_fused_decode.py \
      tests/runner/test_runner_engine.py 2>&1 | tee "$OUT/pytest.log" | tail -15
    echo "pytest rc=${PIPESTATUS[0]}" ;;
  --fuse) runs="off:1:1:0:1:0 on:1:1:0:1:1 off2:1:1:0:1:0 on2:1:1:0:1:1"; profiled="on"; per_run=75
    budget=${BUDGET:-400}
    sizes="--graph-batch-sizes 1,64"
    timeout -k 5 100 python3 -m pytest -q -m gpu -rs --tb=short -p no:cacheprovider tests/runner/test_decode_layer.py \
      tests/runner/test_fused_triton.py tests/runner/test_attn_backends.py 2>&1 | tee "$OUT/pytest.log" | tail -15
    echo "pytest rc=${PIPESTATUS[0]}" ;;
  --layer) runs="ops:1:1:0 fused:1:1:fused phased:1:1:phased"; per_run=110; budget=${BUDGET:-460}; sizes="--graph-batch-sizes 1,64"
    timeout -k 5 120 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/runner/test_decode_layer.py \
      tests/runner/test_pdl.py tests/runner/test_runner_engine.py tests/runner/test_fused_triton.py 2>&1 | tee "$OUT/pytest.log" | tail -15
    echo "pytest rc=${PIPESTATUS[0]}" ;;
  "") runs="default:1:1"; per_run=85; sizes=""
    timeout -k 5 100 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/runner \
      tests/engine/test_engine_async.py "tests/moe/test_gpu_kernels.py::test_triton_route_and_quant_ops" 2>&1 | tee "$OUT/pytest.log" | tail -15
    echo "pytest rc=${PIPESTATUS[0]}" ;;
  *) echo "unknown option $mode (expected --gemv, --pdl, --layer, --moe, --fuse or nothing)"; exit 2 ;;
esac
for run in $runs; do
  IFS=: read -r name pdl gemv layer fdec fuse <<< "$run"
  prof=""
  case " ${profiled:-$name} " in *" $name "*) prof="--profile /tmp/prof_$name" ;; esac
  left=$((budget - 10 - SECONDS))
  limit=$((left < per_run ? left : per_run))
  if [ "$limit" -lt 20 ]; then echo "perf.serve $name skipped: ${left} s left"; continue; fi
  NVL72_MOE_FUSED_DECODE_TOKENS=${fdec:-1} NVL72_PDL=$pdl NVL72_TRITON_GEMV=$gemv NVL72_DECODE_LAYER=${layer:-0} \
    NVL72_NORM_GEMV=${fuse:-1} timeout -k 5 "$limit" python3 -m perf.serve --layers "${LAYERS:-48}" --modes graphs \
    --no-ttft --decode-out 64 $sizes $prof --json "$OUT/serve_$name.json" > "$OUT/serve_$name.log" 2>&1
  echo "perf.serve $name (NVL72_PDL=$pdl NVL72_TRITON_GEMV=$gemv NVL72_DECODE_LAYER=${layer:-0}" \
    "NVL72_MOE_FUSED_DECODE_TOKENS=${fdec:-1} NVL72_NORM_GEMV=${fuse:-1}, limit ${limit} s) rc=$?"
  gzip -c "/tmp/prof_$name/decode_b1.json" > "$OUT/decode_b1_$name.json.gz" 2>/dev/null
done
for run in $runs; do
  name=${run%%:*}
  echo "== $name"
  grep -E "Error|error" "$OUT/serve_$name.log" | head -4
  grep -A4 "^SERVE" "$OUT/serve_$name.log" || tail -15 "$OUT/serve_$name.log"
done
for run in $runs; do
  name=${run%%:*}
  echo "== $name"
  awk '/^PROFILE/{p=1} /^SERVE/{p=0} p' "$OUT/serve_$name.log" | cut -c1-160 | if [ -n "$sizes" ]; then
    awk '/^PROFILE decode b=1/{p=1} /^PROFILE decode b=64/{p=0} p' | head -32; else cat; fi
done
if [ -n "$sizes" ]; then
  echo "== decode step (perf.serve, graphs, no profiler) and profiled GPU ops per step, by run"
  printf "%-9s %-5s %-5s %-7s %-5s %10s %7s %11s %9s\n" run PDL GEMV LAYER NORM "b=1 ms" "% bound" "b=64 ms" \
    "b=1 ops"
  for run in $runs; do
    IFS=: read -r name pdl gemv layer fdec fuse <<< "$run"
    python3 - "$OUT/serve_$name.json" "$OUT/serve_$name.log" "$name" "$pdl" "$gemv" "${layer:-0}" "${fuse:-1}" <<'EOF'
import json, re, sys
path, log, name, pdl, gemv, layer, fuse = sys.argv[1:]
try:
    rows = {r["what"]: r for r in json.load(open(path))["rows"]}
except (OSError, ValueError, KeyError):
    rows = {}
b1, b64 = rows.get("decode b=1"), rows.get("decode b=64")
ops = re.search(r"PROFILE decode b=1: .*?(\d+) GPU ops", open(log).read()) if b1 else None
ms1 = "%.3f" % b1["step_ms"] if b1 else "-"
pct = "%.1f%%" % (100 * b1["bound_step_ms"] / b1["step_ms"]) if b1 else "-"
ms64 = "%.3f" % b64["step_ms"] if b64 else "-"
print("%-9s %-5s %-5s %-7s %-5s %10s %7s %11s %9s" % (name, pdl, gemv, layer, fuse, ms1, pct, ms64,
                                                     ops.group(1) if ops else "-"))
EOF
  done
fi
