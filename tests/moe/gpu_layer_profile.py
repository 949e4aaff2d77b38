"""One-GPU timing of the whole MoE layer (router GEMM, routing, permutation, quantization, both
grouped GEMMs, SiLU-and-mul, un-permute) on the sm90-fp8 backend, eager and as CUDA-graph replay,
beside the decode bound (active expert bytes / measured HBM copy bandwidth), plus the
torch.profiler kernel table of one T=1 layer call (what a decode step pays per MoE layer).

    python3 tests/moe/gpu_layer_profile.py --out $OUT [--models qwen3-30b-a3b,qwen3-235b] [--tokens 1,8,64,256]

`--layers` distinct layers (default 4) run back to back per timed call, so the active experts
of one layer are not still in L2 when it runs again (a model's layers never share weights);
times are per layer. Writes layer_profile.json and profile_t1_<model>_{eager,graph}.txt under
--out; prints the table last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from moe import MoE  # noqa: E402
from nvl72.cuda_timing import hbm_copy_bandwidth, time_cuda  # noqa: E402

MODELS = {  # expert shapes: hidden, experts, top-k, moe_intermediate
    "qwen3-30b-a3b": dict(H=2048, E=128, k=8, I=768),
    "qwen3-235b": dict(H=4096, E=128, k=8, I=1536),
}


def build_layers(cfg: dict, n: int, seed: int) -> list[MoE]:
    """n prepared sm90-fp8 layers with random weights; the bf16 originals are dropped after the FP8
    conversion (forward reads only the converted weights) to fit several 235B layers."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(n):
        m = MoE(cfg["H"], cfg["E"], cfg["k"], cfg["I"], dtype=torch.bfloat16, device="cuda", backend="sm90-fp8")
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.02)
        m.prepare()
        m.w13.data, m.w2.data = torch.empty(0, device="cuda"), torch.empty(0, device="cuda")
        layers.append(m)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return layers


def median_us(g, replays: int = 50) -> float:
    """Median microseconds of one replay of graph g (CUDA events around each)."""
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    return 1e3 * sorted(a.elapsed_time(b) for a, b in ev)[replays // 2]


def capture(fn):
    """A CUDA graph of fn() after warm-up on a side stream (as the engine captures decode steps)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def kernel_table(fn, calls: int, path: str, title: str) -> tuple[float, float]:
    """Profile `calls` runs of fn; write the kernel table; return (kernels, GPU kernel us) per run."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]  # kernels, memcpy, memset
    n = len(kernels) / calls
    us = sum(e.time_range.elapsed_us() for e in kernels) / calls
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
    with open(path, "w") as f:
        f.write(f"{title}: {calls} calls, {n:.1f} kernels and {us:.1f} us GPU time per call\n{table}\n")
    return n, us


def run_model(name: str, tokens: list[int], n_layers: int, iters: int, bw: float, out: str) -> list[dict]:
    cfg = MODELS[name]
    t0 = time.time()
    layers = build_layers(cfg, n_layers, seed=len(name))
    print(f"# {name}: {n_layers} layers built and converted in {time.time() - t0:.1f} s", flush=True)
    expert_bytes = 3 * cfg["H"] * cfg["I"]  # fp8 w13 + w2 of one expert (scales: < 0.1%)
    rows = []
    for t in tokens:
        x = torch.randn(t, cfg["H"], device="cuda", dtype=torch.bfloat16)

        def step():
            for m in layers:
                m(x)

        with torch.no_grad():
            active = sum(int(torch.unique(m.route(x)[1]).numel()) for m in layers) / n_layers
            eager = time_cuda(step, iters) * 1e3 / n_layers
            g = capture(step)
            graph = time_cuda(g.replay, iters) * 1e3 / n_layers
            row = dict(model=name, tokens=t, active_experts=active, eager_ms=eager, graph_ms=graph)
            row["bound_ms"] = (active * expert_bytes + cfg["H"] * cfg["E"] * 2) / bw * 1e3  # bw: bytes moved per s
            if t == 1:
                for mode, fn in (("eager", layers[0].__call__), ("graph", g.replay)):
                    path = os.path.join(out, f"profile_t1_{name}_{mode}.txt")
                    args = (x,) if mode == "eager" else ()
                    n, us = kernel_table(lambda: fn(*args), 20, path, f"{name} T=1 {mode}")
                    per = 1 if mode == "eager" else n_layers
                    row[f"{mode}_kernels_per_layer"], row[f"{mode}_kernel_us_per_layer"] = n / per, us / per
            del g
        rows.append(row)
        print("row", _fmt(row), flush=True)
    layers.clear()  # free this model's weights before the next one
    torch.cuda.empty_cache()
    return rows


HEADER = f"{'model':>14} {'T':>4} {'act':>6} {'eager ms':>9} {'graph ms':>9} {'bound ms':>9} {'x bound':>7} {'kern/layer':>10} {'kern us':>8}"


def _fmt(r: dict) -> str:
    kern = f"{r['graph_kernels_per_layer']:10.1f} {r['graph_kernel_us_per_layer']:8.1f}" if "graph_kernels_per_layer" in r else ""
    return (
        f"{r['model']:>14} {r['tokens']:4d} {r['active_experts']:6.1f} {r['eager_ms']:9.4f} {r['graph_ms']:9.4f} "
        f"{r['bound_ms']:9.4f} {r['graph_ms'] / r['bound_ms']:7.2f} {kern}"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/moe-layer-profile"))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default="1,8,64,256")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    unknown = [m for m in a.models.split(",") if m not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}; known: {sorted(MODELS)}")
    os.makedirs(a.out, exist_ok=True)
    bw = hbm_copy_bandwidth(1 << 30)
    print(f"# {torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s (read + write); "
          f"torch {torch.__version__}; NVL72_MOE_SM90_KERNELS={os.environ.get('NVL72_MOE_SM90_KERNELS', 'auto')}",
          flush=True)
    rows = []
    for name in a.models.split(","):
        rows += run_model(name, [int(t) for t in a.tokens.split(",")], a.layers, a.iters, bw, a.out)
    with open(os.path.join(a.out, "layer_profile.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), copy_bw=bw, rows=rows), f, indent=1)
    print("# per MoE layer; graph = CUDA-graph replay; bound = active expert bytes + router / copy bandwidth;"
          " kern = kernels and GPU kernel time per layer in the T=1 graph profile")
    print(HEADER)
    for r in rows:
        print(_fmt(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
