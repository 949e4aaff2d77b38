#!/usr/bin/env bash
# The few-token fused decode path of the sm90-fp8 MoE backend (issue #4), one call on an H200 / H100
# (repository root, $OUT set):
#   bash tests/moe/gpu_fused_decode.sh        (about 5-9 minutes: fits one 600 s call)
# Carry: .gpucarry-all (the CuTeDSL grouped-GEMM bundle: the pipeline it is compared with).
# 1) tests/moe/test_triton_fused_decode.py on the GPU (kernels vs an fp32 reference, the backend's
#    choice, the sm90 backend's fused path in a CUDA graph); 2) tests/moe/gpu_fused_decode_bench.py:
#    Qwen3-30B-A3B expert shape, T = 1, 2, 4, fused (block-size sweep) vs pipeline, CUDA-graph replays. Logs under $OUT; the table last.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/fused-decode}
mkdir -p "$OUT"
source .gpucarry-all/sm_90a/setup_device.sh || exit 1
export NVL72_KERNEL_BUNDLE=$PWD/.gpucarry-all PYTHONPATH=$PWD:${PYTHONPATH:-}
timeout 20 nvidia-smi -L
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/moe/test_triton_fused_decode.py > "$OUT/pytest.log" 2>&1
echo "pytest (fused decode) rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -12; tail -2 "$OUT/pytest.log"
timeout 380 python3 tests/moe/gpu_fused_decode_bench.py --out "$OUT" > "$OUT/bench.log" 2>&1
echo "gpu_fused_decode_bench rc=$?"
grep -E "^# T=.*(MISMATCH|rel err)" "$OUT/bench.log"
if grep -q "^# per layer" "$OUT/bench.log"; then sed -n '/^# per layer/,$p' "$OUT/bench.log"
else tail -30 "$OUT/bench.log"; fi
