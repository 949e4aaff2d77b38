#!/usr/bin/env bash
# The large-message all-reduce GPU check (issue #6: 128 MiB <= 0.9x torch two_shot_all_reduce_), one call
# on nvidia-h200-x2 (repository root, $OUT set), <= 300 s:
#   bash tests/comms/gpu_allreduce_large.sh
# Carry: .gpucarry-arlarge (`nvl72 kernels build --arch sm_90a --out .gpucarry-arlarge --module comms.kernels.allreduce`).
# 1) all of tests/comms/test_allreduce_gpu.py (every kernel: the shared prologue/span helpers touch them all;
#    the blocks override 1/7/132/256 and auto on heap buffers; twoshot_push in place; graph replays; timeouts);
# 2) perf.comms allreduce from 16 MiB to 128 MiB, graph replay, 9 interleaved samples per size (medians):
#    twoshot_push (in place on a heap buffer, as torch's op) on its default grid (one block per SM) and on
#    256 blocks (two waves), torch two_shot_all_reduce_, NCCL.
# Writes $OUT/test.log, $OUT/perf.log, $OUT/allreduce_large.json; the last table is every twoshot_push grid's
# median / torch's median in the same run, then the 128 MiB rows alone.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/allreduce-large-out}
mkdir -p "$OUT"
source .gpucarry-arlarge/sm_90a/setup_device.sh || exit 1
export NVL72_KERNEL_BUNDLE=$PWD/.gpucarry-arlarge
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
timeout 10 nvidia-smi -L
timeout -k 5 200 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/comms/test_allreduce_gpu.py \
  > "$OUT/test.log" 2>&1
echo "pytest tests/comms/test_allreduce_gpu.py rc=$?"
grep -E "^(FAILED|ERROR)|Error" "$OUT/test.log" | head -8
tail -2 "$OUT/test.log"
timeout -k 5 110 python3 -m perf.comms allreduce --nproc 2 --min-bytes 16M --max-bytes 128M --timeout-s 105 \
  --algos twoshot_push,torch_two_shot,nccl --blocks auto,256 --repeat 9 --no-eager \
  --json "$OUT/allreduce_large.json" > "$OUT/perf.log" 2>&1
echo "perf.comms allreduce rc=$?"
grep -E "Error|error" "$OUT/perf.log" | grep -v "^ " | tail -4
grep -vE "^(Traceback|  |W[0-9]|\[W|[0-9-]+ [0-9:,]+ INFO)" "$OUT/perf.log" | sed -n '/^# graph replay, us/,$p'
echo "# 128 MiB: twoshot_push grids vs torch_two_shot (median us, ratio; target <= 0.900)"
sed -n '/^# graph replay vs/,$p' "$OUT/perf.log" | grep -E "^ *134217728 "
