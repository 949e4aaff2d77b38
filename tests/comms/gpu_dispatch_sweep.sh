#!/usr/bin/env bash
# Fused DP-EP dispatch/combine: bitwise check (bf16 and MXFP8 payloads), then the latency /
# bandwidth sweep with phase stamps; one call on nvidia-h200-x2 (repository root, $OUT set), <= 300 s:
#   bash tests/comms/gpu_dispatch_sweep.sh
# Carry: .gpucarry-disp (`nvl72 kernels build --arch sm_90a --out .gpucarry-disp --module comms.kernels.dispatch`).
# 1) tests/comms/test_dispatch_gpu.py against the NCCL reference (exact, both payloads); on a failure:
#    print them, stop;
# 2) perf.comms dispatch at 1, 128, 4096 tokens/rank, hidden 4096, 128 experts, top-8, grids auto
#    (sized per call) and 132, payloads bf16 and mxfp8, each row followed by its phase stamps
#    (`#   phases`). Logs under $OUT; a short table (from the JSON) comes last.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/dispatch-sweep-out}
mkdir -p "$OUT"
source .gpucarry-disp/sm_90a/setup_device.sh || exit 1
export NVL72_KERNEL_BUNDLE=$PWD/.gpucarry-disp
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
timeout 20 nvidia-smi -L
timeout -k 5 140 python3 tests/comms/test_dispatch_gpu.py 2 "$OUT/test_summary.log" > "$OUT/test.log" 2>&1
rc=$?
echo "correctness test rc=$rc"
grep -E "^(PASS|FAIL)" "$OUT/test.log" | head -40
if [ "$rc" -ne 0 ]; then
  grep -E "Error|error" "$OUT/test.log" | grep -v "^FAIL" | tail -6
  exit 1
fi
timeout -k 5 120 python3 -m perf.comms dispatch --tokens 1,128,4096 --hidden 4096 --experts 128 \
  --blocks auto,132 --phases --skip-nccl --payload bf16,mxfp8 --iters 20 --timeout 110 \
  --json "$OUT/dispatch_sweep.json" > "$OUT/perf.log" 2>&1
echo "perf.comms dispatch rc=$?"
grep -E "Error|error" "$OUT/perf.log" | tail -3
grep -E "^#   phases" "$OUT/perf.log" | head -16
timeout 20 python3 - "$OUT/dispatch_sweep.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"no sweep JSON: {e}")
print(f"\n{d['gpu']} x{d['world']}, NCCL send/recv {d['sendrecv_GBps']:.0f} GB/s (targets: 128 tok <= 12 us each; "
      f"4096 tok dispatch >= 80% send/recv)")
print(f"{'tokens':>6} {'payload':>7} {'blocks':>6} {'disp us':>8} {'comb us':>8} {'pair us':>8} {'disp GB/s':>9} {'%s/r':>5}")
for r in d["rows"]:
    blocks = f"a{r['blocks']}" if r["blocks_auto"] else str(r["blocks"])
    print(f"{r['tokens']:6d} {r['payload']:>7} {blocks:>6} {r['fused_dispatch_us']:8.1f} {r['fused_combine_us']:8.1f} "
          f"{r['fused_pair_us']:8.1f} {r['dispatch_GBps']:9.1f} {100 * r['dispatch_GBps'] / r['sendrecv_GBps']:5.0f}")
PY
