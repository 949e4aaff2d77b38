"""One-GPU sweep of the decode GEMV's tile (rows per program, K step, warps) at the single-token
projections of the Qwen3-30B-A3B shape (q/k/v 5120 x 2048, o_proj 2048 x 4096), beside the
default `fused_triton.gemv` choice and cuBLAS, as CUDA-graph replays with PDL as the decode
graphs launch (issue #4).

    python3 tests/runner/gpu_gemv_sweep.py [--out DIR]

Each timed call reads a different weight of `--weights` (so the weight is not still in L2), the
x of each call is new; every config is first checked against an fp32 reference (rel. error of
the output). Prints one table per shape, fastest first, with GB/s against the HBM copy bandwidth
of the same run; writes gemv_sweep.json under --out.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import triton  # noqa: E402

from aot.pdl import launch_args  # noqa: E402
from nvl72.cuda_timing import hbm_copy_bandwidth, time_cuda  # noqa: E402
from nvl72.model import fused_triton as ft  # noqa: E402
from tests.moe.gpu_layer_profile import capture  # noqa: E402

SHAPES = {"qkv": (5120, 2048), "o_proj": (2048, 4096)}


def launch(x, w, out, block_n, block_k, warps):
    n, k = w.shape
    ft._gemv_kernel[(-(-n // block_n),)](x, w, w, out, n, k, w.stride(0), x, x, x, 0.0, HAS_BIAS=False, NORM=0,
                                          ZC=False, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_H=1, num_warps=warps,
                                          **launch_args(x.device))


def graph_time(fn, calls: int, reps: int = 20) -> float:
    """Seconds per call of `calls` calls of fn(i) captured in one graph (side stream: PDL allowed)."""
    g = capture(lambda: [fn(i) for i in range(calls)])
    return time_cuda(g.replay, reps) / calls


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--weights", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = hbm_copy_bandwidth()
    res = {"gpu": torch.cuda.get_device_name(), "hbm_copy_GBps": bw / 1e9, "rows": []}
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(args.weights)]
        xs = [torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _ in range(args.weights)]
        outs = [torch.full((1, n), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(args.weights)]
        ref = xs[0].float() @ ws[0].float().t()
        nbytes = n * k * 2
        default = (*ft.gemv_blocks(n, k), 4)
        configs = sorted(set(itertools.product((2, 4, 8, 16, 32), (256, 512, 1024, 2048), (4, 8))) | {default})
        rows = []
        for bn, bk, nw in configs:
            if bn * bk > 32768 or bk > triton.next_power_of_2(k):
                continue
            outs[0].fill_(float("nan"))
            launch(xs[0], ws[0], outs[0], bn, bk, nw)
            torch.cuda.synchronize()
            err = float((outs[0].float() - ref).norm() / ref.norm())
            t = graph_time(lambda i: launch(xs[i % len(xs)], ws[i % len(ws)], outs[i % len(outs)], bn, bk, nw),
                           4 * args.weights)
            rows.append(dict(shape=name, n=n, k=k, block_n=bn, block_k=bk, warps=nw, us=t * 1e6,
                             GBps=nbytes / t / 1e9, rel_err=err, default=(bn, bk, nw) == default))
        t = graph_time(lambda i: torch.matmul(xs[i % len(xs)], ws[i % len(ws)].t(), out=outs[i % len(outs)]),
                       4 * args.weights)
        rows.append(dict(shape=name, n=n, k=k, block_n=0, block_k=0, warps=0, us=t * 1e6, GBps=nbytes / t / 1e9,
                         rel_err=0.0, default=False, cublas=True))
        rows.sort(key=lambda r: r["us"])
        print(f"\n{name} [{n} x {k}] bf16, {nbytes / 1e6:.1f} MB; HBM copy {bw / 1e9:.0f} GB/s")
        print(f"{'config':>22} {'us':>7} {'GB/s':>7} {'% copy':>7} {'rel err':>9}")
        for r in rows[:12] + [r for r in rows[12:] if r["default"] or r.get("cublas")]:
            label = "cuBLAS" if r.get("cublas") else f"{r['block_n']}x{r['block_k']} w{r['warps']}"
            label += " (default)" if r["default"] else ""
            print(f"{label:>22} {r['us']:7.2f} {r['GBps']:7.0f} {100 * r['GBps'] * 1e9 / bw:6.1f}% {r['rel_err']:9.2e}")
        res["rows"] += rows
    with open(os.path.join(args.out, "gemv_sweep.json"), "w") as f:
        json.dump(res, f, indent=1)
    bad = [r for r in res["rows"] if not r.get("cublas") and not r["rel_err"] < 1e-2]
    if bad:
        print(f"MISMATCH: {len(bad)} configs, e.g. {bad[0]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
