#!/usr/bin/env bash
# One-call GPU check of the warp-specialized decode variants (compact walk, scale prefetch), <= 90 s (25 s tests + 58 s perf, each under `timeout`)
# on an H200 (repository root, $OUT set):
#   bash tests/moe/gpu_ws_decode.sh
# Carry: .gpucarry-moe3 (`nvl72 kernels build --arch sm_90a --out .gpucarry-moe3 --module
# moe.kernels.sm90_grouped_gemm --module moe.kernels.sm90_grouped_gemm_ws`).
# 1) the @gpu tests of every ws_* variant (test_gpu_kernels.py, fp32 reference, poisoned outputs);
# 2) perf.moe at the decode sizes (each ws variant checked against the default's output, then timed;
#    the fastest that matched is the `ws` column). Logs under $OUT; the perf table comes last.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/moe-out}
mkdir -p "$OUT"
source .gpucarry-moe3/sm_90a/setup_device.sh || exit 1
export NVL72_KERNEL_BUNDLE=$PWD/.gpucarry-moe3
timeout 25 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/moe/test_gpu_kernels.py -k "ws_" \
  > "$OUT/pytest_ws.log" 2>&1
echo "pytest (ws kernels) rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_ws.log" | head -12; tail -2 "$OUT/pytest_ws.log"
timeout 58 python3 -m perf.moe --iters 10 --tokens 1,8,128,256 --json "$OUT/moe_decode.json" > "$OUT/perf.log" 2>&1
echo "perf.moe rc=$?"
grep -E "^# " "$OUT/perf.log" | head -20
grep -E "^ +model|^ +qwen" "$OUT/perf.log" || tail -20 "$OUT/perf.log"
python3 - "$OUT/moe_decode.json" <<'PY' 2>/dev/null
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
names = sorted({k[:-3] for r in rows for k in r if k.startswith("ws_fp8_masked") and k.endswith("_ms")})
print(f"{'model':>13} {'T':>4} " + " ".join(f"{n.replace('ws_fp8_masked_', ''):>12}" for n in names) + "   (ms, ws variants)")
for r in rows:
    print(f"{r['model']:>13} {r['tokens']:>4} " + " ".join(f"{r.get(n + '_ms', float('nan')):>12.3f}" for n in names))
PY
