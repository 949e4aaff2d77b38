#!/usr/bin/env bash
# The model runner's GPU check, one call on the GPU host (repository root, $OUT set):
#   bash tests/runner/gpu_run.sh
# Carries: .gpucarry-runner (`nvl72 kernels build --out .gpucarry-runner --module
# moe.kernels.sm90_grouped_gemm`: the FP8 expert GEMMs + CuTeDSL runtime) and .ficarry-runner
# (FlashInfer 0.7.2.post1 with the prebuilt dec128 decode module; FA3 prefill not carried).
# 1) the @gpu tests of tests/runner (backends vs the torch reference, graphs on vs off);
# 2) perf.serve on a Qwen3-30B-A3B-shaped dummy model. Logs under $OUT; the table comes last.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/runner-out}
mkdir -p "$OUT"
source .gpucarry-runner/sm_90a/setup_device.sh || exit 1
if [ -d .ficarry-runner ]; then
  source .ficarry-runner/fi_setup.sh .ficarry-runner || echo "FLASHINFER SETUP FAILED"
  export FLASHINFER_DISABLE_JIT=1  # only the prebuilt modules; anything else fails instead of compiling
fi
nvidia-smi -L
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
timeout 170 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/runner 2>&1 | tee "$OUT/pytest.log" | tail -25
echo "pytest rc=${PIPESTATUS[0]}"
timeout 160 python3 -m perf.serve --layers 8 --decode-out 64 --json "$OUT/serve.json" > "$OUT/serve.log" 2>&1
echo "perf.serve rc=$?"
grep -E "attention backend|CUDA graphs|MoE expert backend|Error|error" "$OUT/serve.log" | head -8
grep -A12 "^SERVE" "$OUT/serve.log" || tail -30 "$OUT/serve.log"
