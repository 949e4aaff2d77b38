"""When the one-token gate/up's CTAs start, pass their PDL wait, get their rows and end (issue #4: it
adds ~9.3 us to a batch-1 layer for 5.9 us of bytes at copy bandwidth, and every persistent or
one-wave form measured slower; perf/RESULTS.md).

    python3 tests/moe/gpu_gate_up_timeline.py [--layers 8] [--replays 20]

A CUDA graph of `--layers` layers of [top-k of fixed router logits (the engine's Triton kernel) ->
gate/up (the bundle's gate_up_h2048_timeline: the default kernel plus per-CTA %globaltimer stamps) ->
down (the bundle's down_k8_i768)], Qwen3-30B-A3B shapes (E=128, k=8, H=2048, I=768, FP8 experts, each
layer its own weights), launched with PDL as the engine launches them. Per layer, from the first CTA
to pass its wait: when the CTAs passed it, how many started after that (CTAs that found no room: a
second wave), when their rows arrived, when the last ended, how long a CTA ran after its rows arrived;
medians over layers and replays. Also
checks the timeline kernel's act against the default kernel's (bit for bit).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from aot.launch import pdl_enabled  # noqa: E402
from moe.backend import load_sm90_module  # noqa: E402
from moe.kernels.triton_moe import route  # noqa: E402
from tests.moe.gpu_layer_profile import capture, median_us  # noqa: E402

E, K, H, I = 128, 8, 2048, 768
FIELDS = 5  # moe.kernels.sm90_one_token.TIMELINE_FIELDS (that module needs CuTeDSL, which GPU hosts lack)
CTAS = K * I // 8  # GU_ROWS = 8


def layer_weights(gen: torch.Generator):
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) * 0.5).to(torch.float8_e4m3fn)
    s13 = torch.rand(E, 2 * I // 128, H // 128, device="cuda", generator=gen) * 0.01 + 0.001
    w2 = (torch.randn(E, H, I, device="cuda", generator=gen) * 0.5).to(torch.float8_e4m3fn)
    s2 = torch.rand(E, H // 128, I // 128, device="cuda", generator=gen) * 0.01 + 0.001
    logits = torch.randn(1, E, device="cuda", generator=gen)
    return w13, s13, w2, s2, logits


def summarize(st: torch.Tensor) -> dict[str, float]:
    """One layer's [CTAS, FIELDS] stamps (ns) -> microseconds from the first CTA to pass its wait."""
    start, wait, data, end, sm = (st[:, f].double() for f in range(FIELDS))
    t0 = wait.min()
    late = start > t0 + 500  # started half a microsecond after the wait was first passed
    arrived = data[data > 0] - t0
    busy = end[data > 0] - data[data > 0]  # a CTA's rows arrived -> its end: its dot products
    q = lambda v, p: float(torch.quantile(v, p)) / 1e3  # noqa: E731
    return {"first start": float(start.min() - t0) / 1e3, "wait p50": q(wait - t0, 0.5), "wait max": q(wait - t0, 1),
            "late CTAs": float(late.sum()), "late start p50": q(start[late] - t0, 0.5) if late.any() else 0.0,
            "rows first": q(arrived, 0), "rows p50": q(arrived, 0.5), "rows p90": q(arrived, 0.9),
            "rows last": q(arrived, 1), "end last": q(end - t0, 1),
            "rows->end p50": q(busy, 0.5), "rows->end max": q(busy, 1),
            "CTAs an SM max": float(torch.bincount(sm.long()).max())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--replays", type=int, default=20)
    a = ap.parse_args(argv)
    mod = load_sm90_module("moe.kernels.sm90_one_token")
    pdl = int(pdl_enabled(torch.device("cuda")))
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [layer_weights(gen) for _ in range(a.layers)]
    x = torch.randn(1, H, device="cuda", generator=gen).to(torch.bfloat16)
    act = torch.empty(a.layers, K, I, device="cuda")
    out = torch.empty(a.layers, 1, H, dtype=torch.bfloat16, device="cuda")
    stamps = torch.zeros(a.layers, CTAS * FIELDS, dtype=torch.int64, device="cuda")

    def step():
        for i, (w13, s13, w2, s2, logits) in enumerate(layers):
            tw, ids = route(logits, K, True)
            mod.gate_up_h2048_timeline(x.view(-1), ids.view(-1), w13.view(torch.uint8).view(-1), s13.view(-1),
                                       act[i].view(-1), stamps[i], 0, E, I, K, pdl)
            mod.down_k8_i768(act[i].view(-1), ids.view(-1), tw.view(-1), w2.view(torch.uint8).view(-1),
                             s2.view(-1), out[i].view(-1), 0, E, H, pdl)

    g = capture(step)
    us = median_us(g, a.replays)
    w13, s13, _, _, logits = layers[0]
    _, ids = route(logits, K, True)
    want = torch.full((K, I), float("nan"), device="cuda")
    mod.gate_up_h2048(x.view(-1), ids.view(-1), w13.view(torch.uint8).view(-1), s13.view(-1), want.view(-1), 0, E,
                      I, K, pdl)
    torch.cuda.synchronize()
    if not torch.equal(act[0], want):
        print("# MISMATCH: the timeline kernel's act differs from gate_up_h2048's")
        return 1
    rows = []
    for _ in range(a.replays):
        stamps.zero_()
        g.replay()
        torch.cuda.synchronize()
        rows += [summarize(stamps[i].view(CTAS, FIELDS)) for i in range(a.layers)]
    print(f"# {torch.cuda.get_device_name()}: {a.layers} layers of top-k -> gate/up -> down in a graph: "
          f"{us / a.layers:.2f} us a layer (median replay / layers); gate/up CTAs {CTAS}")
    print(f"# us from the first CTA past its PDL wait; medians over {len(rows)} layer runs")
    for key in rows[0]:
        print(f"{key:>16} {statistics.median(r[key] for r in rows):>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
