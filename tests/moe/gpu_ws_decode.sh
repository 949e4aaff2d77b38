#!/usr/bin/env bash
# One-call GPU check of the warp-specialized decode (masked) variants (compact walk, scale prefetch, the
# k_group producers _cpo_kg2 / _cpo_kg4, the staged-scales _cps kernels for 1-8 tokens), <= 150 s
# (45 s tests + 60 s + 35 s perf, each under `timeout`) on an H200 (repository root, $OUT set):
#   bash tests/moe/gpu_ws_decode.sh
# Carry: .gpucarry-moe4 (`nvl72 kernels build --arch sm_90a --out .gpucarry-moe4 --module
# moe.kernels.sm90_grouped_gemm --module moe.kernels.sm90_grouped_gemm_ws`).
# 1) the @gpu tests of every masked ws_* variant (test_gpu_kernels.py, fp32 reference, poisoned outputs,
#    odd per-expert counts, an empty expert; experts with 0, 1, 3, 8 rows at the Qwen3-30B-A3B shapes);
# 2) perf.moe at the decode sizes of the 235B / 397B shapes, then the Qwen3-30B-A3B expert shape
#    (E=128, H=2048, I=768, top-8) at 1, 2, 4, 8 tokens (each ws variant checked against the default's
#    output, then timed; the fastest that matched is the `ws` column). Logs under $OUT; the table of
#    every ws variant's time comes last.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/moe-out}
mkdir -p "$OUT"
source .gpucarry-moe4/sm_90a/setup_device.sh || exit 1
export NVL72_KERNEL_BUNDLE=$PWD/.gpucarry-moe4
timeout 45 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/moe/test_gpu_kernels.py -k "ws_fp8_masked" \
  > "$OUT/pytest_ws.log" 2>&1
rc=$?; echo "pytest (ws kernels) rc=$rc"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_ws.log" | head -12; tail -2 "$OUT/pytest_ws.log"
WS=""
if [ "$rc" = 124 ]; then  # a hung ws kernel would hang perf.moe too: keep the rest of the table
  WS="--no-ws"; echo "pytest timed out (a ws kernel may hang): perf.moe $WS"; tail -5 "$OUT/pytest_ws.log"
fi
timeout 60 python3 -m perf.moe --iters 10 --models qwen3-235b,qwen3.5-397b --tokens 1,8,128 $WS \
  --json "$OUT/moe_decode.json" > "$OUT/perf.log" 2>&1
echo "perf.moe (235b, 397b) rc=$?"
timeout 35 python3 -m perf.moe --iters 20 --models qwen3-30b-a3b --tokens 1,2,4,8 $WS \
  --json "$OUT/moe_decode_30b.json" > "$OUT/perf_30b.log" 2>&1
echo "perf.moe (30b-a3b) rc=$?"
grep -hE "^# " "$OUT/perf.log" "$OUT/perf_30b.log" | head -24
grep -hE "^ +model|^ +qwen" "$OUT/perf.log" "$OUT/perf_30b.log" || tail -20 "$OUT/perf.log" "$OUT/perf_30b.log"
python3 - "$OUT/moe_decode.json" "$OUT/moe_decode_30b.json" <<'PY'
import json, sys
rows = []
for path in sys.argv[1:]:
    try:
        rows += json.load(open(path))["rows"]
    except (OSError, ValueError) as err:
        print(f"# {path}: {err}")
names = sorted({k[:-3] for r in rows for k in r if k.startswith("ws_fp8_masked") and k.endswith("_ms")})
print(f"{'model':>13} {'T':>4} " + " ".join(f"{n.replace('ws_fp8_masked_', ''):>12}" for n in names)
      + f" {'best %cp':>8}   (ms, ws variants; best %cp: the fastest one's share of the copy bandwidth)")
for r in rows:
    cp = 100 * r["ws_bw_frac"] if r.get("ws_bw_frac") else float("nan")
    print(f"{r['model']:>13} {r['tokens']:>4} " + " ".join(f"{r.get(n + '_ms', float('nan')):>12.3f}" for n in names)
          + f" {cp:>8.1f}")
PY
