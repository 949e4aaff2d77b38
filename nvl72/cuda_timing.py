"""CUDA-event timing and the HBM copy-bandwidth floor, shared by `nvl72 plan --measure-constants`
and the perf/ benchmarks (one definition of "time per call" and "copy bandwidth" everywhere)."""
from __future__ import annotations

import torch


def time_cuda(fn, iters: int = 10, warmup: int = 3) -> float:
    """Mean seconds per call: CUDA events around `iters` back-to-back calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def hbm_copy_bandwidth(nbytes: int = 4 << 30, iters: int = 20) -> float:
    """Device-to-device copy of `nbytes`, bytes/s counting bytes read + written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    bw = 2 * nbytes / time_cuda(lambda: dst.copy_(src), iters)
    del src, dst
    torch.cuda.empty_cache()
    return bw
