"""One-GPU timing of the few-token fused decode path (moe.kernels.triton_fused_decode) against the FP8
pipeline of the sm90-fp8 backend, at the Qwen3-30B-A3B expert shape (E=128 local, H=2048, I=768, k=8).

    python3 tests/moe/gpu_fused_decode_bench.py --out $OUT [--tokens 1,2,4] [--layers 8] [--replays 200]
        [--k1 16/256/8,...] [--k2 16/128/8/early,...]

Every timed call is a CUDA graph of `--layers` distinct layers back to back (their active experts,
~38 MB each, do not stay in the 50 MB L2 between replays), each layer routing (triton_moe.route) then
running its experts: `pipeline` = Fp8PipelineBackend.run with the fused path off, `fused` = the two
fused kernels with the given block sizes (k1: BLOCK_N/BLOCK_K/warps of gate_up, k2: of down, plain or
`early` = down(early=True); each swept with the other at its default), `route` = the routing alone.
Time = median over replays of one replay / layers. GB/s = active expert bytes (fp8 w13 + w2 of the
distinct experts routed) / time; %cp = that against a device-to-device copy (read + write). Each fused
variant is checked against an fp32 reference on the dequantized weights first (rel err < 1e-2), and its
graph's last replay against that eager output (bit for bit). Writes fused_decode.json under --out and prints
the table last.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from moe import backend  # noqa: E402
from moe.kernels import triton_fused_decode as fd  # noqa: E402
from nvl72.cuda_timing import hbm_copy_bandwidth  # noqa: E402
from tests.moe.gpu_layer_profile import capture, median_us  # noqa: E402

E, H, I, K = 128, 2048, 768, 8
K1 = [dict(block_n=bn, block_k=bk, num_warps=w) for bn, bk, w in itertools.product([16, 32], [256, 512], [4, 8])]
K2 = [dict(block_n2=bn, block_k2=bk, num_warps2=w, early=early)
      for early, bn, bk, w in itertools.product([False, True], [8, 16], [128, 256], [4, 8])]


def dequant(q, s):
    return q.float() * s.repeat_interleave(128, 1).repeat_interleave(128, 2)


def reference(x, tw, ids, w) -> torch.Tensor:
    """fp32 experts on the dequantized weights of the routed experts only."""
    out = torch.zeros(x.shape[0], H, device="cuda")
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(ids[t, j])
            h = dequant(w.w13[e : e + 1], w.w13_scale[e : e + 1])[0] @ x[t].float()
            a = torch.nn.functional.silu(h[:I]) * h[I:]
            out[t] += tw[t, j] * (dequant(w.w2[e : e + 1], w.w2_scale[e : e + 1])[0] @ a)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/fused-decode"))
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--k1", help="gate_up configs instead of the sweep: bn/bk/warps,... (e.g. 16/256/8)")
    ap.add_argument("--k2", help="down configs instead of the sweep: bn/bk/warps[/early],... (e.g. 16/1024/8/early)")
    a = ap.parse_args(argv)
    k1 = K1 if a.k1 is None else [dict(zip(("block_n", "block_k", "num_warps"), map(int, c.split("/"))))
                                  for c in a.k1.split(",") if c]
    k2 = K2 if a.k2 is None else [dict(zip(("block_n2", "block_k2", "num_warps2"), map(int, c.split("/")[:3])),
                                       early=c.endswith("/early")) for c in a.k2.split(",") if c]
    os.makedirs(a.out, exist_ok=True)
    be = backend.select("cuda", "sm90-fp8")
    pipe = backend.Fp8PipelineBackend("sm90-pipeline", be.ops, fused_decode_tokens=0)
    bw = hbm_copy_bandwidth(1 << 30) / 1e9
    print(f"# {torch.cuda.get_device_name()}: copy bandwidth {bw:.0f} GB/s (read + write); torch {torch.__version__}; "
          f"defaults k1 {fd.BLOCK_N}/{fd.BLOCK_K}/{fd.NUM_WARPS} k2 {fd.BLOCK_N2}/{fd.BLOCK_K2}/{fd.NUM_WARPS2}",
          flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = []
    for _ in range(a.layers):
        w13 = torch.randn(E, 2 * I, H, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(E, H, I, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        weights.append(be.prepare(w13, w2))
        del w13, w2
    torch.cuda.empty_cache()
    rows = []
    side = torch.cuda.Stream()
    for t in [int(v) for v in a.tokens.split(",")]:
        x = torch.randn(t, H, device="cuda", generator=gen).to(torch.bfloat16)
        logits = [torch.randn(t, E, device="cuda", generator=gen).to(torch.bfloat16) for _ in weights]
        active = sum(int(torch.unique(be.route(lg, K, True)[1]).numel()) for lg in logits) / len(weights)
        nbytes = active * 3 * H * I

        def layers(expert_fn, keep):
            def step():
                for i, (lg, w) in enumerate(zip(logits, weights)):
                    tw, ids = be.route(lg, K, True)
                    if expert_fn is not None:
                        out = expert_fn(tw, ids, w)
                        if i == 0:
                            keep[:] = [out]  # the first layer's output (in the graph: its static buffer)
            return step

        def fused(cfg):
            return lambda tw, ids, w: fd.fused_decode(x, tw, ids, w.w13, w.w13_scale, w.w2, w.w2_scale, **cfg)

        def timed(name, expert_fn, cfg=None):
            keep = []
            us = median_us(capture(layers(expert_fn, keep)), a.replays) / len(weights)
            if name == "fused" and not torch.equal(keep[0], eager[json.dumps(cfg or {})]):
                print(f"# T={t}: MISMATCH graph replay != eager for {_cfg(cfg or {})}", flush=True)
            row = dict(tokens=t, path=name, cfg=cfg or {}, us=us, active=active, gbps=nbytes / us / 1e3)
            rows.append(row)
            print("row", _fmt(row, bw), flush=True)
            return us

        tw, ids = be.route(logits[0], K, True)
        want = reference(x, tw, ids, weights[0])
        errs, eager = {}, {}
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # launched as in the graphs (PDL on a side stream): one compile each
            for cfg in [{}] + k1 + k2:
                got = eager[json.dumps(cfg)] = fd.fused_decode(x, tw, ids, weights[0].w13, weights[0].w13_scale,
                                                               weights[0].w2, weights[0].w2_scale, **cfg)
                errs[json.dumps(cfg)] = ((got.float() - want).norm() / want.norm()).item()
            got = pipe.run(x, tw, ids, weights[0], 0)
        torch.cuda.current_stream().wait_stream(side)
        pipe_err = ((got.float() - want).norm() / want.norm()).item()
        print(f"# T={t}: fused rel err vs fp32 max {max(errs.values()):.2e}; pipeline {pipe_err:.2e}", flush=True)
        bad = {c: e for c, e in errs.items() if not e < 1e-2}
        if bad:
            print(f"# T={t}: MISMATCH {bad}", flush=True)
        timed("route", None)
        timed("pipeline", lambda tw, ids, w: pipe.run(x, tw, ids, w, 0))
        timed("fused", fused({}))
        for cfg in k1 + k2:
            if json.dumps(cfg) not in bad:
                timed("fused", fused(cfg), cfg)
    with open(os.path.join(a.out, "fused_decode.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), copy_gbps=bw, rows=rows), f, indent=1)
    print("# per layer, route included (route row: routing alone); median of CUDA-graph replays of "
          f"{a.layers} layers; per T the best k1, k2 and k2 early configs of the sweeps")
    print(HEADER)
    for t in sorted({r["tokens"] for r in rows}):
        rt = [r for r in rows if r["tokens"] == t]
        fz = [r for r in rt if r["path"] == "fused"]
        best = min(fz, key=lambda r: r["us"])
        best1 = min((r for r in fz if "block_n" in r["cfg"]), key=lambda r: r["us"], default=best)
        best2 = [min((r for r in fz if r["cfg"].get("early") is early), key=lambda r: r["us"], default=best)
                 for early in (False, True)]
        for r in [r2 for r2 in rt if r2["path"] != "fused" or not r2["cfg"]] + [best1, *best2]:
            print(_fmt(r, bw))
        pipe_us = next(r["us"] for r in rt if r["path"] == "pipeline")
        print(f"# T={t}: best fused {best['us']:.1f} us ({_cfg(best['cfg'])}) vs pipeline {pipe_us:.1f} us: "
              f"{pipe_us / best['us']:.2f}x")
    return 0


HEADER = f"{'T':>3} {'path':>9} {'config':>24} {'us/layer':>9} {'act':>5} {'GB/s':>6} {'%cp':>5}"


def _cfg(c: dict) -> str:
    if not c:
        return "default"
    if "block_n" in c:
        return f"k1 {c['block_n']}/{c['block_k']}/{c['num_warps']}"
    return f"k2 {c['block_n2']}/{c['block_k2']}/{c['num_warps2']}" + (" early" if c["early"] else "")


def _fmt(r: dict, bw: float) -> str:
    gbps = f"{r['gbps']:6.0f} {100 * r['gbps'] / bw:5.1f}" if r["path"] != "route" else f"{'-':>6} {'-':>5}"
    return (f"{r['tokens']:>3} {r['path']:>9} {_cfg(r['cfg']) if r['path'] == 'fused' else '':>24} {r['us']:9.2f} "
            f"{r['active']:5.1f} {gbps}")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    sys.exit(main())
