#!/usr/bin/env bash
# One-call GPU check of the contiguous (prefill) ws variants, the 128 x 256 ones included (_n256_e4: 4
# epilogue buffers, _n256_mc: 2-CTA clusters with multicast B), <= 155 s (30 s cluster query + 45 s tests + 80 s perf, each
# under `timeout`) on one H200 (repository root, $OUT set):
#   bash tests/moe/gpu_ws_prefill.sh
# Carry: .gpucarry-moe4 (`nvl72 kernels build --arch sm_90a --out .gpucarry-moe4 --module
# moe.kernels.sm90_grouped_gemm --module moe.kernels.sm90_grouped_gemm_ws`).
# 1) the @gpu tests of the contiguous ws_* variants (Sm90Gemm.WS_CONTIG; test_gpu_kernels.py: fp32
#    reference, NaN-poisoned outputs, odd counts of 128-column tiles; the tile-walk edge test: odd m-tile
#    counts, expert boundaries inside a cluster's pair of m tiles, unused -1 tiles left unwritten);
# 2) perf.moe at 4096 and 16384 tokens (each ws variant checked against the default's output, then
#    timed). Logs under $OUT; the table of the contiguous ws variants comes last.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/moe-out}
mkdir -p "$OUT"
source .gpucarry-moe4/sm_90a/setup_device.sh || exit 1
export NVL72_KERNEL_BUNDLE=$PWD/.gpucarry-moe4
# the grid of _n256_mc: 2-CTA clusters the driver says fit at once (moe.occupancy; the kernel launches that many)
timeout 30 python3 -c "import torch; from moe import occupancy; torch.zeros(1, device='cuda'); \
print('co-resident 2-CTA clusters (cuOccupancyMaxActiveClusters):', occupancy.query_max_active_clusters(0, 2, 384), \
'of SMs/2 =', torch.cuda.get_device_properties(0).multi_processor_count // 2)" > "$OUT/clusters.log" 2>&1
echo "cluster query rc=$?"; tail -3 "$OUT/clusters.log"
timeout 45 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/moe/test_gpu_kernels.py -k "ws_fp8_contig" \
  > "$OUT/pytest_ws.log" 2>&1
rc=$?; echo "pytest (ws kernels) rc=$rc"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_ws.log" | head -12; tail -2 "$OUT/pytest_ws.log"
WS=""
if [ "$rc" = 124 ]; then  # a hung ws kernel would hang perf.moe too: keep the rest of the table
  WS="--no-ws"; echo "pytest timed out (a ws kernel may hang): perf.moe $WS"; tail -5 "$OUT/pytest_ws.log"
fi
timeout 80 python3 -m perf.moe --iters 10 --tokens 4096,16384 $WS --json "$OUT/moe_prefill.json" > "$OUT/perf.log" 2>&1
echo "perf.moe rc=$?"
grep -E "^# " "$OUT/perf.log" | head -20
grep -E "^ +model|^ +qwen" "$OUT/perf.log" || tail -20 "$OUT/perf.log"
python3 - "$OUT/moe_prefill.json" <<'PY' 2>&1
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
names = sorted({k[:-3] for r in rows for k in r  # w13 + w2 per variant (per-GEMM times: gpu_prefill_sweep.sh)
                if k.startswith("ws_fp8_contig") and k.endswith("_ms") and not k.endswith(("_w13_ms", "_w2_ms"))})
print(f"{'model':>13} {'T':>6} " + " ".join(f"{n.replace('ws_fp8_', ''):>16}" for n in names)
      + f" {'bf16 ms':>8} {'best TF/s':>9} {'x bf16':>6}   (ms, w13 + w2)")
for r in rows:
    best = r.get("ws_best_ms")
    tf = r["gflop"] / best if best else float("nan")
    xbf = r["torch_bf16_ms"] / best if best and r.get("torch_bf16_ms") else float("nan")
    print(f"{r['model']:>13} {r['tokens']:>6} " + " ".join(f"{r.get(n + '_ms', float('nan')):>16.3f}" for n in names)
          + f" {r.get('torch_bf16_ms') or float('nan'):>8.3f} {tf:>9.0f} {xbf:>6.2f}")
PY
