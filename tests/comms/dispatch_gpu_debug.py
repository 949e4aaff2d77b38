"""Localise a fault in the fused dispatch/combine kernels (>= 2 GPUs; run with CUDA_LAUNCH_BLOCKING=1).

Per config of tests/comms/test_dispatch_gpu.py (fresh processes each, so one fault does not hide
the next config): dispatch alone then synchronize, then the heap's bookkeeping and the packed
metadata are read back and checked against the inputs (rntok, recnt, epoch, row_pos range,
counts), then combine alone then synchronize. Every step prints one line naming the kernel and
the rank, so a fault reads as "FAULT dispatch" or "FAULT combine".

    CUDA_LAUNCH_BLOCKING=1 python3 tests/comms/dispatch_gpu_debug.py [world] [num_blocks]
    CUDA_LAUNCH_BLOCKING=1 python3 tests/comms/dispatch_gpu_debug.py [world] skips
    CUDA_LAUNCH_BLOCKING=1 python3 tests/comms/dispatch_gpu_debug.py [world] checked
    CUDA_LAUNCH_BLOCKING=1 python3 tests/comms/dispatch_gpu_debug.py [world] trace
    CUDA_LAUNCH_BLOCKING=1 python3 tests/comms/dispatch_gpu_debug.py [world] config N [num_blocks]

`inproc N`: config N on one GPU in this process, so `cuda-gdb --args python3 ...` stops at the faulting
instruction (tests/comms/gpu_combine_gdb.sh).
`config N`: that config alone (short enough to run under compute-sanitizer, which names the
faulting instruction's offset and address).

`checked`: configs 0 and 1 with combine_k4_checked (every computed index tested on the device; a
violation is recorded in the error word as comms.kernels.dispatch.CHECK_* << 16 | index, reported as
"unknown error", and the access skipped).
`trace`: configs 0 and 1 with combine_k4_trace: every warp records (phase, work unit, next address)
in pinned host memory before each group of accesses, so after a fault the host prints how many warps
stopped in each phase and, for the unfinished ones, the address and the buffer it falls in.
`skips`: config 0 with each fault-isolation variant of combine (combine_k4_skip{bits}, in a bundle
built with NVL72_DISPATCH_DEBUG_VARIANTS=1; bits in comms.kernels.dispatch): which group of
accesses faults ("OK combine" with the A-loads removed and FAULT otherwise names the y reads).
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
    rntok = heap.buffer(f.off["rntok"], world, torch.int32).cpu()
    recnt = heap.buffer(f.off["recnt"], (world, L), torch.int32).cpu()
    state = heap.buffer(f.off["state"], 4, torch.int32).cpu()
    dcnt = heap.buffer(f.off["dcnt"], (max(f.maxp, 2), world), torch.int32).cpu()  # tables, rows (or phases)
    ccnt = heap.buffer(f.off["ccnt"], world, torch.int32).cpu()
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
    b = getattr(heap, "_b", None)
    if b is not None and hasattr(b, "va"):  # the cuMem heap: its reservation and what the driver says of ccnt
        from cuda.bindings import driver as drv

        addr = int(heap.peer_ptrs[rank]) + f.off["ccnt"]
        err, base, size = drv.cuMemGetAddressRange(addr)
        print(f"INFO  rank {rank} heap va {b.va:#x} size {b.size:#x} mapped {[hex(p) for p in b.mapped]}; "
              f"ccnt at {addr:#x}: cuMemGetAddressRange {err.name} base {int(base):#x} size {int(size):#x}",
              flush=True)
    print(f"INFO  rank {rank} {tag}: epoch state {state.tolist()} dcnt {dcnt.tolist()} ccnt {ccnt.tolist()} "
          f"rntok {rntok.tolist()} "
          f"recnt row sums {recnt.sum(1).tolist()} counts sum {int(counts.sum())} "
          f"row_pos [{int(rp.min())}, {int(rp.max())}] of {nrows} rows", flush=True)
    for p in problems:
        print(f"BAD   rank {rank} {tag}: {p}", flush=True)
    return problems


TRACE_WORDS = 4  # comms.kernels.dispatch.TRACE_WORDS (that module needs CuTeDSL, absent on GPU hosts)
TRACE_PHASES = ("-", "start", "A meta", "A y-load", "A cx-store", "A done", "waited", "B cx-load", "B out-store",
                "B done", "exit")


def _where(addr, ranges):
    """Name of the buffer holding `addr` (and the offset), from (name, base, bytes) ranges."""
    for name, base, n in ranges:
        if base <= addr < base + n:
            return f"{name}+{addr - base}"
    return "OUTSIDE every buffer"


def _combine_traced(rank, fused, recv, h, tag):
    """combine_k4_trace launched by hand: a pinned trace buffer after the error word, then every
    warp's last (phase, unit, address) printed whatever happened (host memory outlives a fault)."""
    f = fused._fused
    nb = f.blocks_for(h.num_tokens)
    warps = nb * 8
    buf = torch.zeros((1 + warps) * TRACE_WORDS, dtype=torch.int32).pin_memory()
    cargs = list(f._cargs)
    cargs[cargs.index(f.err.data_ptr())] = buf.data_ptr()
    f.err = buf
    H = f.cfg.hidden
    y = recv.x.reshape(-1, H)
    out = torch.empty(h.num_tokens, H, dtype=torch.bfloat16, device=y.device)
    size = f.heap._b.size
    ranges = [(f"heap[rank {r}]", int(p), size) for r, p in enumerate(f.heap.peer_ptrs.cpu().tolist())]
    ranges += [(n, t.data_ptr(), t.numel() * t.element_size()) for n, t in
               (("y", y), ("out", out), ("row_pos", f.row_pos), ("ids", h.topk_ids), ("peers", f.heap.peer_ptrs))]
    ranges.append(("trace(host)", buf.data_ptr(), buf.numel() * 4))
    fault = None
    try:
        f._combine(y, h.topk_ids, out, f.row_pos, f.rstart, *cargs, 0, nb, 0)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001  (the trace is printed, then the fault re-raised)
        fault = e
    rec = buf[TRACE_WORDS:].view(warps, TRACE_WORDS).tolist()
    hist: dict[str, int] = {}
    for r in rec:
        hist[TRACE_PHASES[r[0]]] = hist.get(TRACE_PHASES[r[0]], 0) + 1
    print(f"TRACE rank {rank} {tag}: {'FAULT' if fault else 'ok'}; warps by last phase {hist}; error word {int(buf[0]):#x}",
          flush=True)
    stuck = [(w, r) for w, r in enumerate(rec) if TRACE_PHASES[r[0]] not in ("exit", "-")]
    for w, (ph, unit, lo, hi) in stuck[:12]:
        addr = (hi & 0xFFFFFFFF) << 32 | (lo & 0xFFFFFFFF)
        print(f"TRACE rank {rank} warp {w} (block {w // 8}): {TRACE_PHASES[ph]} unit {unit} addr {addr:#x} "
              f"= {_where(addr, ranges)}", flush=True)
    if fault:
        print(f"FAULT combine  rank {rank} {tag}: {type(fault).__name__}: {str(fault).splitlines()[0]}", flush=True)
        raise fault
    return out


def _worker(rank, world, store, cfg_index, num_blocks, variant=""):
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
            if variant:  # a debug export of combine (see main; the trace variant is launched by hand)
                import aot

                fused._fused._combine = aot.function("comms.kernels.dispatch", f"combine_k{K}{variant}")
            for it in range(2):
                tag = (f"E={E} K={K} H={H} M={M} T={T} {layout} blocks={fused._fused.blocks_for(T)} epoch {it + 1}"
                       + (f" {variant[1:]}" if variant else ""))
                x, ids, w = _inputs(cases[0], rank, world, T, E, K, H, gen, dev)
                dist.barrier()
                recv, h = _step(rank, tag, "dispatch", lambda: fused.dispatch(x, ids, w))
                _step(rank, tag, "check", fused.check)
                bad += _inspect(rank, world, fused, x, M, tag)
                dist.barrier()
                if variant == "_trace":
                    _combine_traced(rank, fused, recv, h, tag)
                else:
                    _step(rank, tag, "combine", lambda: fused.combine(recv.x, h))
                _step(rank, tag, "check", fused.check)
            fused.destroy()
            heap.destroy()
    finally:
        dist.destroy_process_group()
    if bad:
        raise AssertionError(f"rank {rank}: {bad[0]}")


def main(world: int, num_blocks: int | None, runs: list[tuple[int, str]] | None = None) -> int:
    """`runs`: (config index, combine export suffix) pairs; default every config with combine_kK."""
    if os.environ.get("CUDA_LAUNCH_BLOCKING") != "1":
        print("note: CUDA_LAUNCH_BLOCKING is not 1; faults may be reported one kernel late", flush=True)
    failed = 0
    for i, variant in runs or [(i, "") for i in range(len(CONFIGS))]:
        label = f"config {i}: {CONFIGS[i][:5]}" + (f" {variant[1:]}" if variant else "")
        with tempfile.TemporaryDirectory() as d:
            ctx = mp.spawn(_worker, args=(world, os.path.join(d, "store"), i, num_blocks, variant), nprocs=world,
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


def _bundle_variants(prefix: str) -> list[str]:
    """Suffixes of the bundle's combine exports starting with `prefix` (no CuTeDSL import here)."""
    import aot

    names = aot.read_manifest(aot.bundle_dir(aot.device_arch(0)))["modules"]["comms.kernels.dispatch"]["exports"]
    found = [e[len("combine_k4"):] for e in names if e.startswith(prefix)]
    if not found:
        sys.exit(f"the bundle has no {prefix}* exports: build it with NVL72_DISPATCH_DEBUG_VARIANTS=1")
    return found


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else torch.cuda.device_count()
    mode = sys.argv[2] if len(sys.argv) > 2 else ""
    if mode == "skips":
        sys.exit(main(n, None, [(0, v) for v in _bundle_variants("combine_k4_skip")]))
    if mode == "checked":  # the K=4 configs with every index checked on the device
        sys.exit(main(n, None, [(i, v) for i in (0, 1) for v in _bundle_variants("combine_k4_checked")]))
    if mode == "trace":  # configs 0 and 1: where every warp of combine_k4_trace stopped
        sys.exit(main(n, None, [(i, v) for i in (0, 1) for v in _bundle_variants("combine_k4_trace")]))
    if mode == "inproc":  # inproc N: config N on one GPU in this process (for cuda-gdb, which stops at the fault)
        with tempfile.TemporaryDirectory() as d:
            _worker(0, 1, os.path.join(d, "store"), int(sys.argv[3]), None)
        sys.exit(0)
    if mode == "config":  # config N [num_blocks]
        sys.exit(main(n, int(sys.argv[4]) if len(sys.argv) > 4 else None, [(int(sys.argv[3]), "")]))
    sys.exit(main(n, int(mode) if mode else None))
