#!/usr/bin/env bash
# The MoE layer's one-GPU decode-path check, one call on an H100/H200 (repository root, $OUT set):
#   bash tests/moe/gpu_layer_profile.sh
# Carry: .gpucarry-moeprof (`nvl72 kernels build --arch sm_90a --out .gpucarry-moeprof --module
# moe.kernels.sm90_grouped_gemm --module moe.kernels.sm90_grouped_gemm_ws`).
# 1) the Triton data-path tests (test_triton_moe.py on the GPU) and the sm90 layer / Triton tests
#    of test_gpu_kernels.py; 2) tests/moe/gpu_layer_profile.py: the whole MoE layer at T = 1, 8,
#    64, 256 for the Qwen3-30B-A3B and Qwen3-235B expert shapes, eager and CUDA-graph replay, and
#    the T=1 kernel tables. Logs under $OUT; the T=1 graph kernel table, then the timing table last.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/moe-layer-profile}
mkdir -p "$OUT"
source .gpucarry-moeprof/sm_90a/setup_device.sh || exit 1
timeout 20 nvidia-smi -L
timeout 100 python3 -m pytest -q -rs -p no:cacheprovider tests/moe/test_triton_moe.py \
  tests/moe/test_gpu_kernels.py -k "triton or layer" > "$OUT/pytest.log" 2>&1
echo "pytest (Triton kernels, sm90 layer) rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -12; tail -2 "$OUT/pytest.log"
timeout 150 python3 tests/moe/gpu_layer_profile.py --out "$OUT" > "$OUT/profile.log" 2>&1
echo "gpu_layer_profile rc=$?"
[ -f "$OUT/profile_t1_qwen3-30b-a3b_graph.txt" ] && head -24 "$OUT/profile_t1_qwen3-30b-a3b_graph.txt"
if grep -qE "^ +model" "$OUT/profile.log"; then grep -E "^#|^ +(model|qwen)" "$OUT/profile.log" | tail -14
else tail -30 "$OUT/profile.log"; fi
