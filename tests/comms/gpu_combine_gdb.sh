#!/usr/bin/env bash
# A fused dispatch/combine fault under cuda-gdb on ONE GPU (<= 200 s): the faulting SASS instruction, its
# registers (uniform ones too) and every lane's PC, for config 0 (T=37) and config 1 (T=0, no rows to
# combine) of tests/comms/test_dispatch_gpu.py; the heap's mapping is printed by dispatch_gpu_debug.py.
# How the divergent-spin fault of issue #7 was found (comms.kernels.dispatch._wait_all). carry: .gpucarry-all
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/combine-gdb}
mkdir -p "$OUT"
source .gpucarry-all/sm_90a/setup_device.sh || exit 1
export NVL72_KERNEL_BUNDLE=$PWD/.gpucarry-all PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
for cfg in ${CFGS:-0 1}; do
  timeout -k 5 90 cuda-gdb -batch -ex "set pagination off" -ex "set cuda break_on_launch none" -ex run \
    -ex "info cuda kernels" -ex "x/12i \$pc-0xb0" -ex "x/2i \$pc" -ex "info registers" -ex "info cuda lanes" \
    --args python3 tests/comms/dispatch_gpu_debug.py 1 inproc $cfg > "$OUT/gdb_cfg$cfg.log" 2>&1
  echo "== config $cfg rc=$?"
  grep -v -E "^\[(New|Thread|Detaching)|^warning" "$OUT/gdb_cfg$cfg.log" | grep -E -A40 "CUDA Exception|signal CUDA" | head -30
  grep -E "^INFO|Cannot|cannot|Error" "$OUT/gdb_cfg$cfg.log" | cut -c1-250 | head -12
done
