"""Where the one-token MoE's time goes inside its two kernels: each program's start, a middle point and
end (%globaltimer, ns) and SM, for gate/up (middle: its PDL-wait return) and down (middle: the end of its
math; its wait is inside down_rows), moe.kernels.triton_fused_decode's code paths launched as
`fused_decode` launches them, in a CUDA graph of `--layers` layers (routing, gate/up, down each) at the
Qwen3-30B-A3B expert shape.

    python3 tests/moe/gpu_moe_timeline.py [--layers 8] [--replays 20]

Times are relative to the layer's first gate/up wait return (= the routing kernel's end). Per kernel:
first / median / last of each point; the last column counts the down programs that started before
gate/up's last program ended (down reads its first tile before its wait: only resident programs do).
Prints one line per layer, then the median over the middle layers.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from aot.pdl import launch_args, wait_prior  # noqa: E402
from moe.kernels import triton_fused_decode as fd  # noqa: E402
from moe.kernels import triton_moe  # noqa: E402

E, H, I, K = 128, 2048, 768, 8
NUM_E = tl.constexpr(E)


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _smid():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _record(ts_ptr, prog, t0, t1):
    t2 = _now()
    base = ts_ptr + prog * 4
    tl.store(base, t0)
    tl.store(base + 1, t1)
    tl.store(base + 2, t2)
    tl.store(base + 3, _smid().to(tl.int64))


@triton.jit
def _gate_up_timed(x_ptr, ids_ptr, w_ptr, s_ptr, act_ptr, ts_ptr, H, I, K: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """triton_fused_decode._gate_up_kernel (all experts local) with its times recorded."""
    t0 = _now()
    wait_prior(PDL)
    t1 = _now()
    p = tl.program_id(0)
    e = tl.load(ids_ptr + p)
    n0 = tl.program_id(1) * BLOCK_N
    act = fd.gate_up_rows(x_ptr + (p // K).to(tl.int64) * H, e.to(tl.int64), w_ptr, s_ptr, H, I, n0, BLOCK_N, BLOCK_K)
    tl.store(act_ptr + p.to(tl.int64) * I + n0 + tl.arange(0, BLOCK_N), act)
    _record(ts_ptr, p * tl.num_programs(1) + tl.program_id(1), t0, t1)


@triton.jit
def _down_timed(act_ptr, ids_ptr, tw_ptr, w_ptr, s_ptr, out_ptr, ts_ptr, H, I, K: tl.constexpr, KP: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """triton_fused_decode._down_kernel (EARLY, one token, no shared expert) with its start, the end of
    its math and its end recorded."""
    t0 = _now()
    n0 = tl.program_id(1) * BLOCK_N
    y = fd.down_rows(act_ptr, ids_ptr, tw_ptr, w_ptr, s_ptr, 0, n0, H, I, NUM_E, 0, K, KP, BLOCK_N, BLOCK_K, True, PDL)
    t1 = _now()
    tl.store(out_ptr + n0 + tl.arange(0, BLOCK_N), y.to(out_ptr.dtype.element_ty))
    _record(ts_ptr, tl.program_id(1), t0, t1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--replays", type=int, default=20)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for _ in range(a.layers):  # random FP8 weights and power-of-two block scales: timing only
        w13 = (torch.randn(E, 2 * I, H, device=dev, generator=gen) * 0.1).to(torch.float8_e4m3fn)
        w2 = (torch.randn(E, H, I, device=dev, generator=gen) * 0.1).to(torch.float8_e4m3fn)
        s13 = torch.exp2(torch.randint(-8, -4, (E, 2 * I // 128, H // 128), device=dev, generator=gen).float())
        s2 = torch.exp2(torch.randint(-8, -4, (E, H // 128, I // 128), device=dev, generator=gen).float())
        logits = torch.randn(1, E, device=dev, generator=gen).to(torch.bfloat16)
        layers.append((w13, s13, w2, s2, logits))
    x = torch.randn(1, H, device=dev, generator=gen).to(torch.bfloat16)
    act = torch.empty(K, I, device=dev)
    out = torch.empty(1, H, device=dev, dtype=torch.bfloat16)
    grid1, grid2 = (K, I // fd.BLOCK_N), (1, H // fd.BLOCK_N2)
    ts = [(torch.zeros(grid1[0] * grid1[1], 4, dtype=torch.int64, device=dev),
           torch.zeros(grid2[1], 4, dtype=torch.int64, device=dev)) for _ in layers]

    def step():
        for (w13, s13, w2, s2, logits), (ts1, ts2) in zip(layers, ts):
            tw, ids = triton_moe.route(logits, K, True)
            _gate_up_timed[grid1](x, ids, w13, s13, act, ts1, H, I, K=K, BLOCK_N=fd.BLOCK_N, BLOCK_K=fd.BLOCK_K,
                                  num_warps=fd.NUM_WARPS, **launch_args(dev))
            _down_timed[grid2](act, ids, tw, w2, s2, out, ts2, H, I, K=K, KP=K, BLOCK_N=fd.BLOCK_N2,
                               BLOCK_K=fd.BLOCK_K2, num_warps=fd.NUM_WARPS2, **launch_args(dev))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(a.replays):
        g.replay()
    torch.cuda.synchronize()
    print(f"# {torch.cuda.get_device_name()}; gate/up {grid1[0] * grid1[1]} programs, down {grid2[1]}; us from "
          "the layer's first gate/up wait return; first / median / last")
    hdr = ("layer  gu start            gu wait             gu end              dn start            "
           "dn math end         dn end              dn started before gu end")
    print(hdr)
    summary = []
    for i, (ts1, ts2) in enumerate(ts):
        a1, a2 = ts1.double().cpu(), ts2.double().cpu()
        t0 = a1[:, 1].min()

        def q(col):
            v = ((col - t0) / 1e3).sort().values
            return v[0].item(), v[len(v) // 2].item(), v[-1].item()

        cols = [q(a1[:, 0]), q(a1[:, 1]), q(a1[:, 2]), q(a2[:, 0]), q(a2[:, 1]), q(a2[:, 2])]
        early = int((a2[:, 0] < a1[:, 2].max()).sum())
        print(f"{i:5d}  " + "  ".join(f"{c[0]:5.1f}/{c[1]:5.1f}/{c[2]:5.1f}" for c in cols) + f"  {early:4d}")
        if 0 < i < len(ts) - 1:
            summary.append([v for c in cols for v in c] + [early])
    med = torch.tensor(summary).median(0).values.tolist()
    print("median " + "  ".join(f"{med[3 * j]:5.1f}/{med[3 * j + 1]:5.1f}/{med[3 * j + 2]:5.1f}" for j in range(6))
          + f"  {med[-1]:4.0f}")
    return 0


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    sys.exit(main())
