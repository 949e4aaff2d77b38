"""Weights read into L2 by a kernel on a side stream, ahead of the kernel that needs them.

At batch 1 a decoder layer alternates kernels bound by HBM bandwidth (the weight GEMVs, the
experts) with kernels bound by latency (q/k norm + RoPE, paged attention, norms, routing) during
which HBM idles. A prefetch forked onto a second stream at the start of such a stretch moves the
next GEMV's weight into L2 (50 MB on H100 / H200), so that GEMV reads it from there. It reads
weights only, which no kernel of a forward writes: the side kernels cannot race with the main
chain whatever their timing, and their one obligation is to be joined before the forward ends
(graph capture requires every forked stream to rejoin).

Two ways to pull the lines in (`METHODS`):
- "hint": `prefetch.global.L2::evict_last` per 128-byte line: no data comes back to the SM, the line
  is kept in L2 ahead of lines read normally (the expert weights streaming by);
- "load": plain loads reduced into a value that is never stored unless it equals an improbable
  constant (so the compiler keeps them), lines at normal priority.
Shared by `nvl72` and `moe` (both may import `aot`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

METHODS = ("hint", "load")
LINE = 128  # bytes per L2 line
SINK_MAGIC = tl.constexpr(0x5EED5EED)  # `load` stores its reduction only when it equals this (never, in practice)


@triton.jit
def _prefetch_hint_kernel(addr, n_lines, LINES: tl.constexpr):
    """Program p: lines p*LINES.., stepping by the grid, of the bytes at address `addr` (an int64)."""
    pid, step = tl.program_id(0), tl.num_programs(0) * LINES
    offs = tl.arange(0, LINES)
    for start in range(pid * LINES, n_lines, step):
        line = start + offs
        a = addr + tl.where(line < n_lines, line, 0).to(tl.int64) * 128
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [a],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_load_kernel(words, n_words, sink, BLOCK: tl.constexpr):
    """Program p: int32 words p*BLOCK.., stepping by the grid, xor-reduced into `sink[p]` only when
    the reduction equals SINK_MAGIC (the store exists so the loads are kept)."""
    pid, step = tl.program_id(0), tl.num_programs(0) * BLOCK
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for start in range(pid * BLOCK, n_words, step):
        acc ^= tl.load(words + start + offs, mask=start + offs < n_words, other=0)
    r = tl.xor_sum(acc, 0)
    tl.store(sink + pid, r, mask=r == SINK_MAGIC)


class L2Prefetcher:
    """Forks prefetch kernels onto one side stream of `device` and joins it back.

    `programs`: the side kernel's grid (small: it runs beside the main chain's kernels). `fork(t)`
    queues a prefetch of tensor t (contiguous) after all work queued so far on the current
    stream; `join()` makes the current stream wait for every fork. Under CUDA-graph capture the
    fork and join become graph edges."""

    def __init__(self, device: torch.device, method: str = "hint", programs: int = 32, block: int = 4096):
        if method not in METHODS:
            raise ValueError(f"L2 prefetch method {method!r}: expected one of {', '.join(METHODS)}")
        if programs < 1:
            raise ValueError(f"L2 prefetch programs={programs}: expected >= 1")
        self.method, self.programs, self.block = method, programs, block
        self.stream = torch.cuda.Stream(device)
        self.sink = torch.zeros(programs, dtype=torch.int32, device=device)
        self.pending = False

    def launch(self, t: torch.Tensor) -> None:
        """The prefetch kernel of tensor t on the current stream."""
        if not t.is_contiguous():
            raise ValueError(f"L2 prefetch of a non-contiguous tensor {tuple(t.shape)} / {t.stride()}")
        flat = t.reshape(-1).view(torch.uint8)
        nbytes = flat.numel()
        if self.method == "hint":
            lines = -(-nbytes // LINE)
            grid = min(self.programs, -(-lines // 128))
            _prefetch_hint_kernel[(grid,)](flat.data_ptr(), lines, LINES=128, num_warps=4)
        else:
            words = nbytes // 4
            grid = min(self.programs, -(-words // self.block))
            _prefetch_load_kernel[(grid,)](flat[: words * 4].view(torch.int32), words, self.sink, BLOCK=self.block, num_warps=4)

    def fork(self, t: torch.Tensor) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self.launch(t)
        self.pending = True

    def join(self) -> None:
        if self.pending:
            torch.cuda.current_stream().wait_stream(self.stream)
            self.pending = False
