"""Localise a fault in the fused dispatch/combine kernels (>= 2 GPUs; run with CUDA_LAUNCH_BLOCKING=1).

Per config of tests/comms/test_dispatch_gpu.py (fresh processes each, so one fault does not hide
the next config): dispatch alone then synchronize, then the heap's bookkeeping and the packed
metadata are read back and checked against the inputs (rntok, recnt, epoch, row_pos range,
counts), then combine alone then synchronize. Every step prints one line naming the kernel and
the rank, so a fault reads as "FAULT dispatch" or "FAULT combine".

    CUDA_LAUNCH_BLOCKING=1 python3 tests/comms/dispatch_gpu_debug.py [world] [num_blocks]
    CUDA_LAUNCH_BLOCKING=1 python3 tests/comms/dispatch_gpu_debug.py [world] config N [num_blocks]

`inproc N`: config N on one GPU in this process, so `cuda-gdb --args python3 ...` stops at the faulting
instruction (tests/comms/gpu_combine_gdb.sh).
`config N`: that config alone (short enough to run under compute-sanitizer, which names the
faulting instruction's offset and address).
"""
from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.comms.test_dispatch_gpu import CONFIGS, _inputs

TIMEOUT_S = float(os.environ.get("NVL72_DISPATCH_DEBUG_TIMEOUT_S", "60"))  # per config (raise it under a sanitizer)
# Fault-isolation knobs: the kernels' flag-wait bound, the heap ("comms" cuMem heap or "torch" symmetric
# memory).
KERNEL_TIMEOUT_S = float(os.environ.get("NVL72_DISPATCH_DEBUG_KERNEL_TIMEOUT_S", "5"))
HEAP_KIND = os.environ.get("NVL72_DISPATCH_DEBUG_HEAP", "comms")


def _step(rank, tag, name, fn):
    """Run fn and synchronize; print OK or FAULT with the kernel's name. Returns fn's result."""
    t0 = time.perf_counter()
    try:
        out = fn()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001  (printed with the kernel's name, then re-raised)
        # the elapsed time tells a fast fault from one at the end of a wait (timeout_s = 5 s below)
        print(f"FAULT {name:8s} rank {rank} {tag} after {(time.perf_counter() - t0) * 1e3:.1f} ms: "
              f"{type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
        raise
    print(f"OK    {name:8s} rank {rank} {tag} ({(time.perf_counter() - t0) * 1e3:.1f} ms)", flush=True)
    return out


def _inspect(rank, world, fused, x, M, tag):
    """Heap bookkeeping after one dispatch: what every later phase indexes with."""
    f = fused._fused
    heap, L = f.heap, fused.num_local
    state = heap.buffer(f.off["state"], 4, torch.int32).cpu()
    # the tables of the last epoch: its parity's buffer, counts below the epoch tag
    parity, mask = int(state[0]) & 1, 0xFFFF
    rntok = heap.buffer(f.off["rntok"], (2, world), torch.int32).cpu()[parity] & mask
    recnt = heap.buffer(f.off["recnt"], (2, world, L), torch.int32).cpu()[parity] & mask
    dcnt = heap.buffer(f.off["dcnt"], (max(f.maxp, 2), world), torch.int32).cpu()  # tables, rows (or phases)
    toks = torch.tensor([x.shape[0]], device=x.device)
    allt = [torch.zeros_like(toks) for _ in range(world)]
    dist.all_gather(allt, toks)
    allt = torch.cat(allt).cpu()
    problems = []
    if not torch.equal(rntok.long(), allt.long()):
        problems.append(f"rntok {rntok.tolist()} != tokens per rank {allt.tolist()}")
    if int(rntok.max()) > M or int(rntok.min()) < 0:
        problems.append(f"rntok {rntok.tolist()} outside [0, max_tokens={M}]")
    counts = f.counts.cpu()
    rp = f.row_pos.cpu()
    nrows = f.out_x.shape[0]
    if int(rp.min()) < 0 or int(rp.max()) >= nrows:
        problems.append(f"row_pos range [{int(rp.min())}, {int(rp.max())}] outside [0, {nrows})")
    print(f"INFO  rank {rank} {tag}: epoch state {state.tolist()} dcnt {dcnt.tolist()} "
          f"rntok {rntok.tolist()} "
          f"recnt row sums {recnt.sum(1).tolist()} counts sum {int(counts.sum())} "
          f"row_pos [{int(rp.min())}, {int(rp.max())}] of {nrows} rows", flush=True)
    for p in problems:
        print(f"BAD   rank {rank} {tag}: {p}", flush=True)
    return problems


def _worker(rank, world, store, cfg_index, num_blocks):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S), device_id=dev)
    from comms.dispatch import DispatchCombine
    from perf.comms.dispatch import make_heap

    E, K, H, M, toks, cases, layouts, _ = CONFIGS[cfg_index]  # bf16 payload (combine is bf16 either way)
    T = toks[rank % len(toks)]
    gen = torch.Generator().manual_seed(11 + rank)
    bad = []
    try:
        for layout in layouts:
            heap = make_heap(HEAP_KIND, dist.group.WORLD, DispatchCombine.heap_size_hint(world, E, K, H, M), dev)
            fused = DispatchCombine(heap, E, K, H, M, mode="dp_ep", layout=layout, timeout_s=KERNEL_TIMEOUT_S,
                                    num_blocks=num_blocks)
            for it in range(2):
                tag = f"E={E} K={K} H={H} M={M} T={T} {layout} blocks={fused._fused.blocks_for(T)} epoch {it + 1}"
                x, ids, w = _inputs(cases[0], rank, world, T, E, K, H, gen, dev)
                dist.barrier()
                recv, h = _step(rank, tag, "dispatch", lambda: fused.dispatch(x, ids, w))
                _step(rank, tag, "check", fused.check)
                bad += _inspect(rank, world, fused, x, M, tag)
                dist.barrier()
                _step(rank, tag, "combine", lambda: fused.combine(recv.x, h))
                _step(rank, tag, "check", fused.check)
            fused.destroy()
            heap.destroy()
    finally:
        dist.destroy_process_group()
    if bad:
        raise AssertionError(f"rank {rank}: {bad[0]}")


def main(world: int, num_blocks: int | None, configs: list[int] | None = None) -> int:
    """`configs`: indices into CONFIGS (default: all)."""
    if os.environ.get("CUDA_LAUNCH_BLOCKING") != "1":
        print("note: CUDA_LAUNCH_BLOCKING is not 1; faults may be reported one kernel late", flush=True)
    failed = 0
    for i in configs or range(len(CONFIGS)):
        label = f"config {i}: {CONFIGS[i][:5]}"
        with tempfile.TemporaryDirectory() as d:
            ctx = mp.spawn(_worker, args=(world, os.path.join(d, "store"), i, num_blocks), nprocs=world,
                           join=False)
            t0 = time.monotonic()
            try:
                while not ctx.join(timeout=2):
                    if time.monotonic() - t0 > TIMEOUT_S:
                        for p in ctx.processes:
                            p.kill()
                        raise TimeoutError(f"config {i} did not finish within {TIMEOUT_S} s")
                print(f"PASS  {label}", flush=True)
            except Exception as e:  # noqa: BLE001  (next config in fresh processes)
                failed += 1
                print(f"FAIL  {label}: {type(e).__name__}: {str(e).strip().splitlines()[-1]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else torch.cuda.device_count()
    mode = sys.argv[2] if len(sys.argv) > 2 else ""
    if mode == "inproc":  # inproc N: config N on one GPU in this process (for cuda-gdb, which stops at the fault)
        with tempfile.TemporaryDirectory() as d:
            _worker(0, 1, os.path.join(d, "store"), int(sys.argv[3]), None)
        sys.exit(0)
    if mode == "config":  # config N [num_blocks]
        sys.exit(main(n, int(sys.argv[4]) if len(sys.argv) > 4 else None, [int(sys.argv[3])]))
    sys.exit(main(n, int(mode) if mode else None))
