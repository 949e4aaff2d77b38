#!/usr/bin/env bash
# The combine fault (issue #7) under cuda-gdb on ONE GPU (<= 200 s): the faulting SASS instruction, its
# registers and the kernel, for config 0 (T=37) and config 1 (T=0, no rows to combine). carry: .gpucarry-all
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/combine-gdb}
mkdir -p "$OUT"
source .gpucarry-all/sm_90a/setup_device.sh || exit 1
export NVL72_KERNEL_BUNDLE=$PWD/.gpucarry-all PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
for cfg in ${CFGS:-0 1}; do
  timeout -k 5 90 cuda-gdb -batch -ex "set pagination off" -ex "set cuda break_on_launch none" -ex run \
    -ex "info cuda kernels" -ex "x/12i \$pc-0xb0" -ex "x/2i \$pc" -ex "info registers" -ex "info cuda lanes" \
    -ex 'print/x *(@global unsigned int *)((((unsigned long long)$R9) << 32) | (unsigned long long)(unsigned)$R8)' \
    -ex 'print/x *(@global unsigned int *)((((unsigned long long)$UR17) << 32) | ((unsigned long long)(unsigned)$UR16 + 0x41100))' \
    -ex 'print/x *(@global unsigned int *)((((unsigned long long)$UR17) << 32) | ((unsigned long long)(unsigned)$UR16 + 0x20000))' \
    --args python3 tests/comms/dispatch_gpu_debug.py 1 inproc $cfg > "$OUT/gdb_cfg$cfg.log" 2>&1
  echo "== config $cfg rc=$?"
  grep -v -E "^\[(New|Thread|Detaching)|^warning" "$OUT/gdb_cfg$cfg.log" | grep -E -A40 "CUDA Exception|signal CUDA" | head -30
  grep -E "^INFO|^\$[0-9]|Cannot|cannot|Error" "$OUT/gdb_cfg$cfg.log" | cut -c1-250 | head -12
done
