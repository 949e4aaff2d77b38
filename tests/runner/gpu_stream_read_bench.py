"""How fast one kernel of a decode chain can stream N bytes: the ceiling of a per-kernel batch-1 step
(issue #4), where each kernel reads a layer's weight matrix (4-40 MB) once.

    python3 tests/runner/gpu_stream_read_bench.py [--sizes-mb 4,8.4,12.6,16.8,21,25.2,37.7,256] [--chain 8]

A CUDA graph of `--chain` kernels back to back, each reading its own N-byte buffer (distinct buffers,
so replays find them in L2 only when the chain's bytes fit there) and writing one value per program.
Each program streams one contiguous share, its next step (`--step-kb`, 8) loaded while the current one is
summed (as the decode GEMVs and expert kernels stream), `--per-sm` (4) programs per SM. `pdl`: launched with PDL, the
first step loaded before waiting for the previous kernel (as the GEMVs' first weight tiles); `plain`:
ordinary launches; `pdl_wait_first`: PDL, nothing loaded before the wait; `gate_up`: PDL, waiting
first, in the fused MoE gate/up kernel's pattern (`_rows_kernel`, the same bytes up to a whole number of
its 64 KB programs). Time per kernel = median replay / chain; % = N / time against the copy bandwidth
(read + write over 1 GiB, as perf.serve's bound). Prints a table.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from aot.pdl import wait_prior  # noqa: E402
from nvl72.cuda_timing import hbm_copy_bandwidth  # noqa: E402
from tests.moe.gpu_layer_profile import capture, median_us  # noqa: E402

# gate/up's pattern: a program reads R gate and R up rows of ROW int32 words (2 KB), STEP words (256 B) each a step
R, ROW, STEP = 16, 512, 64
PAIR_WORDS = 2 * R * ROW  # one program's words (64 KB)


@triton.jit
def _read_kernel(x, out, words, BLOCK: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
    """Program p: the sum of its `words` int32 words from x + p * words; EARLY: the first step loaded
    before the PDL wait."""
    if not EARLY:
        wait_prior(PDL)
    base = x + tl.program_id(0).to(tl.int64) * words
    c = tl.arange(0, BLOCK)
    v = tl.load(base + c)
    if EARLY:
        wait_prior(PDL)
    acc = tl.zeros([BLOCK], tl.int32)
    for k0 in range(BLOCK, words + BLOCK, BLOCK):
        nv = tl.load(base + k0 + c, mask=k0 + c < words, other=0)
        acc += v
        v = nv
    tl.store(out + tl.program_id(0), tl.sum(acc, 0))


@triton.jit
def _rows_kernel(x, out, ROW: tl.constexpr, R: tl.constexpr, STEP: tl.constexpr, PDL: tl.constexpr):
    """Program p: the sum of two [R, ROW]-word row blocks (x + 2p R ROW and the next), read [R, STEP]
    words of each per step: the fused MoE gate/up kernel's pattern (16 gate and 16 up rows of 2048
    bytes, 256 bytes of each row a step)."""
    wait_prior(PDL)
    g = x + tl.program_id(0).to(tl.int64) * 2 * R * ROW + tl.arange(0, R)[:, None] * ROW
    u = g + R * ROW
    c = tl.arange(0, STEP)[None, :]
    gv = tl.load(g + c)
    uv = tl.load(u + c)
    acc = tl.zeros([R, STEP], tl.int32)
    for k0 in range(STEP, ROW + STEP, STEP):
        gn = tl.load(g + k0 + c, mask=k0 + c < ROW, other=0)
        un = tl.load(u + k0 + c, mask=k0 + c < ROW, other=0)
        acc += gv + uv
        gv, uv = gn, un
    tl.store(out + tl.program_id(0), tl.sum(tl.sum(acc, 1), 0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="4,8.4,12.6,16.8,21,25.2,37.7,256")
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--per-sm", type=int, default=4, help="programs per SM of the contiguous reads")
    ap.add_argument("--step-kb", type=int, default=8, help="KB a program loads per step (a power of two)")
    a = ap.parse_args(argv)
    BLOCK = a.step_kb * 256  # int32 words a step
    progs = torch.cuda.get_device_properties(0).multi_processor_count * a.per_sm
    bw = hbm_copy_bandwidth(1 << 30) / 1e9
    print(f"# {torch.cuda.get_device_name()}: copy bandwidth {bw:.0f} GB/s; {progs} programs of {a.step_kb} KB steps, "
          f"chain of {a.chain}")
    rows = []
    for mb in (float(v) for v in a.sizes_mb.split(",")):
        words = triton.cdiv(int(mb * 1e6) // 4, progs * BLOCK) * BLOCK  # whole steps per program
        nbytes = words * 4 * progs
        bufs = [torch.randint(-1000, 1000, (progs * words,), dtype=torch.int32, device="cuda")
                for _ in range(a.chain)]
        want = torch.stack([b.view(progs, words).sum(1, dtype=torch.int32) for b in bufs])
        blocks = progs * words // PAIR_WORDS  # gate/up pattern: its programs in the same bytes
        out = torch.empty(a.chain, max(progs, blocks), dtype=torch.int32, device="cuda")
        for mode in ("plain", "pdl", "pdl_wait_first", "gate_up"):
            pdl = mode.startswith("pdl")

            def chain():
                for i, b in enumerate(bufs):
                    if mode == "gate_up":  # waits first, as gate/up does (its rows come from the routing)
                        _rows_kernel[(blocks,)](b, out[i], ROW=ROW, R=R, STEP=STEP, PDL=True, launch_pdl=True,
                                                num_warps=8)
                    else:
                        _read_kernel[(progs,)](b, out[i], words, BLOCK=BLOCK, EARLY=mode == "pdl", PDL=pdl,
                                               launch_pdl=pdl, num_warps=8)
            out.fill_(-1)
            g = capture(chain)
            us = median_us(g, a.replays) / a.chain
            if mode == "gate_up":
                read = blocks * PAIR_WORDS * 4
                ok = torch.equal(out[:, :blocks], torch.stack(
                    [b[:blocks * PAIR_WORDS].view(blocks, -1).sum(1, dtype=torch.int32) for b in bufs]))
            else:
                read, ok = nbytes, torch.equal(out[:, :progs], want)
            if not ok:
                print(f"# MISMATCH at {mb} MB ({mode})")
            rows.append((read / 1e6, mode, us, read / us / 1e3))
            print("row", *rows[-1], flush=True)
    print(f"{'MB':>7} {'launch':>14} {'us/kernel':>10} {'GB/s':>7} {'% copy':>7}")
    for mb, mode, us, gbps in rows:
        print(f"{mb:>7.1f} {mode:>14} {us:>10.2f} {gbps:>7.0f} {100 * gbps / bw:>6.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
