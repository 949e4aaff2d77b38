"""One-GPU check of `aot.l2_prefetch`: does a weight prefetched on a side stream while the main
stream is busy with latency-bound work make the decode GEMV that follows faster (issue #4)?

    python3 tests/runner/gpu_l2_prefetch_bench.py [--out DIR]

For the single-token projections of the Qwen3-30B-A3B shape (q/k/v 5120 x 2048, o_proj 2048 x 4096,
bf16), `--weights` distinct weights in turn (none still in L2 from its last use), all as CUDA-graph
replays with PDL as the decode graphs launch:
  - gemv: the GEMVs back to back (cold weights);
  - idle+gemv: each GEMV after a spin kernel of `--idle-us` (the stand-in for attention);
  - pf+idle+gemv: the same with the GEMV's weight prefetched on a side stream forked before the spin,
    per method and grid;
  - prefetch: the prefetch kernels alone, back to back (GB/s of the method).
Every GEMV output is checked against an fp32 reference (rel. error). Prints one table per shape
and writes l2_prefetch.json under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from aot.l2_prefetch import L2Prefetcher  # noqa: E402
from nvl72.cuda_timing import hbm_copy_bandwidth, time_cuda  # noqa: E402
from nvl72.model import fused_triton as ft  # noqa: E402
from tests.moe.gpu_layer_profile import capture  # noqa: E402

SHAPES = {"qkv": (5120, 2048), "o_proj": (2048, 4096)}


def per_call(fn, calls: int, reps: int = 20) -> float:
    """Microseconds per call of `calls` calls of fn(i) in one graph."""
    g = capture(lambda: [fn(i) for i in range(calls)])
    return time_cuda(g.replay, reps) / calls * 1e6


def spin_cycles_per_us() -> float:
    g = capture(lambda: torch.cuda._sleep(200_000))
    return 200_000 / (time_cuda(g.replay, 10) * 1e6)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--weights", type=int, default=8)
    ap.add_argument("--idle-us", type=float, default=10.0)
    ap.add_argument("--programs", default="16,32,66,132")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    bw = hbm_copy_bandwidth()
    cycles = int(spin_cycles_per_us() * args.idle_us)
    res = {"gpu": props.name, "l2_bytes": props.L2_cache_size, "hbm_copy_GBps": bw / 1e9,
           "idle_us": args.idle_us, "rows": []}
    n_w = args.weights
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(n_w)]
        xs = [torch.randn(1, k, device=dev, dtype=torch.bfloat16) for _ in range(n_w)]
        refs = [(x.float() @ w.float().t()) for x, w in zip(xs, ws)]
        outs = [None] * n_w
        nbytes = n * k * 2

        def gemv(i):
            outs[i % n_w] = ft.gemv(xs[i % n_w], ws[i % n_w])

        def idle_gemv(i):
            torch.cuda._sleep(cycles)
            gemv(i)

        rows = [dict(what="gemv", us=per_call(gemv, 2 * n_w)), dict(what="idle+gemv", us=per_call(idle_gemv, 2 * n_w))]
        for method in ("hint", "load"):
            for programs in (int(p) for p in args.programs.split(",")):
                pf = L2Prefetcher(dev, method, programs)

                def pf_idle_gemv(i, pf=pf):
                    pf.fork(ws[i % n_w])
                    idle_gemv(i)
                    if i % n_w == n_w - 1:
                        pf.join()

                for o in outs:
                    if o is not None:
                        o.fill_(float("nan"))
                us = per_call(pf_idle_gemv, 2 * n_w)
                torch.cuda.synchronize()
                err = max(float((o.float() - r).norm() / r.norm()) for o, r in zip(outs, refs))
                alone = per_call(lambda i, pf=pf: pf.launch(ws[i % n_w]), 2 * n_w)
                rows.append(dict(what=f"pf+idle+gemv {method} x{programs}", us=us, rel_err=err,
                                 prefetch_us=alone, prefetch_GBps=nbytes / alone / 1e3))
        base = rows[1]["us"]
        print(f"\n{name} [{n} x {k}] bf16, {nbytes / 1e6:.1f} MB; HBM copy {bw / 1e9:.0f} GB/s; L2 "
              f"{props.L2_cache_size / 2**20:.0f} MiB; idle {args.idle_us:.0f} us")
        print(f"{'what':>26} {'us/call':>8} {'saved us':>9} {'rel err':>9} {'pf alone us':>12} {'pf GB/s':>8}")
        for r in rows:
            r["shape"] = name
            saved = base - r["us"] if r["what"].startswith("pf") else float("nan")
            print(f"{r['what']:>26} {r['us']:8.2f} {saved:9.2f} {r.get('rel_err', float('nan')):9.2e} "
                  f"{r.get('prefetch_us', float('nan')):12.2f} {r.get('prefetch_GBps', float('nan')):8.0f}")
        res["rows"] += rows
    with open(os.path.join(args.out, "l2_prefetch.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
