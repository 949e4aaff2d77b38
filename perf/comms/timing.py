"""CUDA timing shared by the comms benchmarks: warm-up on a side stream, one CUDA graph of `iters`
calls, event timing of one run after a barrier, and the max over ranks (the collective's time is
its slowest rank's)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def warm_on_side_stream(fn) -> None:
    """One call of fn on a side stream (what graph capture needs first), ordered with the current one."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)


def capture_loop(fn, iters: int) -> torch.cuda.CUDAGraph:
    """`iters` back-to-back calls of fn captured in one graph (call warm_on_side_stream first)."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    return g


def events_time(run) -> float:
    """Seconds of one run() on this rank, timed with events after every rank reached the barrier."""
    torch.cuda.synchronize()
    dist.barrier()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    run()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / 1e3


def loop(fn, iters: int):
    """A callable making `iters` back-to-back eager calls of fn."""
    def run():
        for _ in range(iters):
            fn()
    return run


def max_over_ranks(v: float, device="cuda") -> float:
    t = torch.tensor([v], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
