#!/usr/bin/env bash
# One-call GPU check + per-GEMM sweep of the contiguous (prefill) ws variants, <= 300 s on one H200
# (repository root, $OUT set; every step under `timeout`: 70 s tests + 2 x 105 s perf):
#   bash tests/moe/gpu_prefill_sweep.sh
# Carry: .gpucarry-moe5 (`nvl72 kernels build --arch sm_90a --out .gpucarry-moe5 --module
# moe.kernels.sm90_grouped_gemm --module moe.kernels.sm90_grouped_gemm_ws`).
# 1) the @gpu tests of the new contiguous variants (_n256_sp: scales prefetched one K step ahead,
#    _n256_mc_e2: the cluster kernel with 2 epilogue buffers, _n256_mc_e2_sp: both; fp32 reference,
#    NaN-poisoned outputs, odd tile counts, an empty expert, the tile-walk edges, the cluster grid) and
#    of Sm90Gemm's per-GEMM table (role w13 / w2: the table's variant for each size band, bitwise the
#    named variant's output);
# 2) perf.moe at 4096 and 16384 tokens, Qwen3-235B then Qwen3.5-397B (one call each), with each ws
#    variant, torch bf16 and torch FP8 row-wise timed per GEMM (w13, w2) in the same run.
# Logs and JSON under $OUT; last, a table per model and T: each variant's w13 / w2 ms, the fastest w13 +
# the fastest w2 against torch bf16 and FP8 row-wise (target at 16384 on 235B: >= 1.5x bf16, >= 1.0x fp8 row).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/moe-out}
mkdir -p "$OUT"
source .gpucarry-moe5/sm_90a/setup_device.sh || exit 1
export NVL72_KERNEL_BUNDLE=$PWD/.gpucarry-moe5
timeout 70 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/moe/test_gpu_kernels.py \
  -k "n256_sp or n256_mc_e2 or contig_table" > "$OUT/pytest_prefill.log" 2>&1
rc=$?; echo "pytest (new contiguous variants, per-GEMM table) rc=$rc"
grep -E "^(FAILED|ERROR)" "$OUT/pytest_prefill.log" | head -12; tail -2 "$OUT/pytest_prefill.log"
VARIANTS=contig,contig_n256,contig_n256_e4,contig_n256_mc,contig_n256_mc_e2,contig_n256_sp,contig_n256_mc_e2_sp
if [ "$rc" = 124 ]; then  # a hung new kernel would hang perf.moe too: time the measured ones only
  VARIANTS=contig,contig_n256,contig_n256_e4,contig_n256_mc; echo "pytest timed out: perf.moe without the new variants"
fi
for m in qwen3-235b qwen3.5-397b; do
  timeout 105 python3 -m perf.moe --models "$m" --iters 20 --tokens 4096,16384 --variants "$VARIANTS" \
    --json "$OUT/moe_prefill_$m.json" > "$OUT/perf_$m.log" 2>&1
  echo "perf.moe $m rc=$?"
  grep -E "^# " "$OUT/perf_$m.log" | head -8
done
python3 - "$OUT"/moe_prefill_*.json <<'PY' 2>&1
import json, sys
rows = [r for f in sys.argv[1:] for r in json.load(open(f))["rows"]]
if not rows:
    sys.exit("no perf.moe rows")
names = sorted({k[:-7] for r in rows for k in r if k.startswith("ws_fp8_contig") and k.endswith("_w13_ms")})
nan = float("nan")
print("per GEMM ms (w13 / w2); torch bf16 and FP8 row-wise in the same run")
print(f"{'model':>13} {'T':>6} " + " ".join(f"{n.replace('ws_fp8_', ''):>17}" for n in names)
      + f" {'bf16':>13} {'fp8row':>13}")
for r in rows:
    cell = lambda p: f"{r.get(p + '_w13_ms') or nan:>8.3f}/{r.get(p + '_w2_ms') or nan:<8.3f}"
    print(f"{r['model']:>13} {r['tokens']:>6} " + " ".join(cell(n) for n in names)
          + f" {cell('torch_bf16'):>13} {cell('torch_fp8_row'):>13}")
print("\nbest per GEMM vs torch (ms; split = best w13 + best w2; table = the backend's per-GEMM choice)")
print(f"{'model':>13} {'T':>6} {'best w13':>22} {'best w2':>22} {'split':>7} {'one var':>7} {'table':>7} "
      f"{'bf16':>7} {'fp8row':>7} {'split x bf16':>12} {'x fp8row':>8}")
for r in rows:
    b13, b2, split = r.get("ws_best_w13"), r.get("ws_best_w2"), r.get("ws_split_ms")
    bf, f8 = r.get("torch_bf16_ms"), r.get("torch_fp8_row_ms")
    short = lambda v: (v or "-").replace("ws_fp8_", "")
    print(f"{r['model']:>13} {r['tokens']:>6} "
          f"{short(b13) + ' ' + format(r.get(str(b13) + '_w13_ms') or nan, '.3f'):>22} "
          f"{short(b2) + ' ' + format(r.get(str(b2) + '_w2_ms') or nan, '.3f'):>22} "
          f"{split or nan:>7.3f} {r.get('ws_best_ms') or nan:>7.3f} {r.get('ours_fp8_ms') or nan:>7.3f} "
          f"{bf or nan:>7.3f} {f8 or nan:>7.3f} {(bf / split) if bf and split else nan:>12.2f} "
          f"{(f8 / split) if f8 and split else nan:>8.2f}")
PY
