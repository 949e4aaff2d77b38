"""The ceiling of a one-kernel batch-1 decode step on the Qwen3-30B-A3B shape (issue #4): the bundle's
nvl72.kernels.sm90_layer_stream streams a step's weight bytes through its two shared-memory rings with
the layer's grid barriers and spins in place of the latency-bound ops, no math.

    python3 tests/runner/gpu_layer_stream_bench.py [--layers 48] [--reps 5] [--attn-ns 3000 --route-ns 1500]
        [--rows 'VARIANT:qkv,o,r,gu,dn,attn_ns,route_ns;...']

Per layer (bf16 dense, FP8 experts, 16 KB pages): q/k/v 5120 x 2048 (1280 pages), o_proj 2048 x 4096
(1024), router 128 x 2048 (32), and k = 8 of 128 experts (random per layer) of gate/up 2 x 768 x 2048
(192 pages) and down 2048 x 768 (96): 76.0 MB, the engine's 17.7 us at 4.3 TB/s. Rows (default): each
of SPLITS at the given spins and at none, and the pieces alone (barriers only; dense only; experts only);
`--rows` instead: the given variants, page counts and spins. Per row: us a layer (median launch / layers)
beside the bytes at the copy bandwidth measured here, CTA 0's phase times (barrier to barrier, medians
over layers); then per row the traced pages of CTA 0 (copy latency, consumer waits) and the barriers'
arrivals (first to last CTA, last arrival to release, the CTAs most often last). Every launch is
checked: no wait timed out (the kernel's error count) and every page was read once (the weights are
fp32 ones; the consumers' sums).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import aot  # noqa: E402
from nvl72.cuda_timing import hbm_copy_bandwidth  # noqa: E402

PAGE = 16384  # nvl72.kernels.sm90_layer_stream.PAGE (that module needs CuTeDSL, which GPU hosts lack)
BARRIERS = 6
TRACE = 1024  # sm90_layer_stream.TRACE
SPLITS = ("stream_a8_b4", "stream_a4_b8", "stream_a8_b4_gated", "stream_a8_b4_d3")
QKV, O, R, GU, DN, E, K = 1280, 1024, 32, 192, 96, 128, 8
PHASES = ("q/k/v", "attention", "o_proj", "routing", "gate/up", "down")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--attn-ns", type=int, default=3000)
    ap.add_argument("--route-ns", type=int, default=1500)
    ap.add_argument("--timeout-ms", type=int, default=2000)
    ap.add_argument("--rows", default="", help="instead of the default rows: ';'-separated 'SPLIT:qkv,o,r,gu,dn,"
                    "attn_ns,route_ns' settings (pages a layer / an expert, spins)")
    a = ap.parse_args(argv)
    mod = aot.load("nvl72.kernels.sm90_layer_stream", "sm_90a")
    dev = torch.device("cuda")
    ctas = torch.cuda.get_device_properties(dev).multi_processor_count
    L = a.layers
    one = torch.tensor(1.0).view(torch.int32).item()  # fp32 1.0's bits, as every weight word
    dense = torch.full((L * (QKV + O + R) * PAGE // 4,), one, dtype=torch.int32, device=dev).view(torch.uint8)
    experts = torch.full((L * E * (GU + DN) * PAGE // 4,), one, dtype=torch.int32, device=dev).view(torch.uint8)
    gen = torch.Generator(device=dev).manual_seed(0)
    ids = torch.stack([torch.randperm(E, device=dev, generator=gen)[:K] for _ in range(L)]).int().view(-1)
    ctr = torch.zeros(2, dtype=torch.int32, device=dev)
    out = torch.empty(ctas * 256, dtype=torch.float32, device=dev)
    stamps = torch.zeros((ctas + 1) * L * BARRIERS, dtype=torch.int64, device=dev)
    trace = torch.zeros(2 * TRACE * 4, dtype=torch.int64, device=dev)
    bw = hbm_copy_bandwidth(1 << 30)
    bound_us = (QKV + O + R + K * (GU + DN)) * PAGE / bw * 1e6

    def run(name, qkv, o, r, gu, dn, attn_ns, route_ns):
        fn = getattr(mod, name)
        times, phases = [], []
        for i in range(a.reps + 2):
            ctr.zero_()
            out.fill_(float("nan"))
            b, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            b.record()
            trace.zero_()
            fn(dense[:PAGE], experts[:PAGE], ids, ctr, out, stamps, trace, L, qkv, o, r, gu, dn, attn_ns, route_ns, E, K, ctas,
               a.timeout_ms)
            e.record()
            torch.cuda.synchronize()
            if int(ctr[1]):
                raise RuntimeError(f"{name}: a wait timed out ({int(ctr[1])} waiters past {a.timeout_ms} ms)")
            want = L * (qkv + o + r + K * (gu + dn)) * PAGE // 4
            if float(out.double().sum()) != want:
                raise RuntimeError(f"{name}: the consumers summed {float(out.double().sum())}, want {want}")
            if i >= 2:
                times.append(b.elapsed_time(e) * 1e3 / L)
                st = stamps[:L * BARRIERS].view(L, BARRIERS).double()
                d = torch.diff(st.view(-1)).view(-1)  # barrier b of layer l minus the one before it
                d = torch.cat([d[:1] * 0, d]).view(L, BARRIERS)[1:]  # layer 0 has no barrier before it
                phases.append([float(d[:, j].median()) / 1e3 for j in range(BARRIERS)])
        traces.append((name, qkv, o, r, gu, dn, attn_ns, route_ns, trace_summary(), arrival_summary()))
        return statistics.median(times), [statistics.median(p[j] for p in phases) for j in range(BARRIERS)]

    def arrival_summary():
        """Per barrier kind, medians over layers (us): the first to the last CTA's arrival, the last arrival
        to CTA 0's release; and the CTAs most often last."""
        st = stamps.view(ctas + 1, L, BARRIERS).double() / 1e3
        arr, rel = st[1:, 1:], st[0, 1:]  # layer 0 left out (start-up)
        last, first = arr.max(dim=0), arr.min(dim=0).values
        spread = [float((last.values - first)[:, j].median()) for j in range(BARRIERS)]
        after = [float((rel - last.values)[:, j].median()) for j in range(BARRIERS)]
        late = torch.bincount(last.indices.view(-1), minlength=ctas).topk(4)
        return (" ".join(f"{x:.2f}" for x in spread), " ".join(f"{x:.2f}" for x in after),
                ", ".join(f"{int(i)}:{int(v)}" for v, i in zip(late.values, late.indices)))

    def trace_summary():
        """CTA 0's traced pages of the last launch, per ring: medians (us) of issue -> there (the copy's
        latency), consumer's wait start -> there (> 0: it waited), there -> freed (reading it)."""
        t = trace.view(2, TRACE, 4).double() / 1e3
        out = []
        for ring in range(2):
            ok = (t[ring] > 0).all(dim=1)
            w, there, freed, issue = (t[ring][ok][:, i] for i in range(4))
            if not ok.any():
                out.append("-")
                continue
            med = lambda v: float(v.median())  # noqa: E731
            out.append(f"{int(ok.sum())} pages: copy {med(there - issue):.2f}, waited {med((there - w).clamp(min=0)):.2f}"
                       f" (mean {float((there - w).clamp(min=0).mean()):.2f}), read {med(freed - there):.2f}")
        return out

    print(f"# {torch.cuda.get_device_name()}: {ctas} CTAs, {L} layers, copy bandwidth {bw / 1e9:.0f} GB/s: a layer's "
          f"76.0 MB = {bound_us:.2f} us; spins attention {a.attn_ns} ns, routing {a.route_ns} ns")
    rows, traces = [], []
    if a.rows:
        for spec in a.rows.split(";"):
            name, vals = spec.split(":")
            rows.append((name, vals, *run(name, *(int(v) for v in vals.split(",")))))
    full = (QKV, O, R, GU, DN)
    for name in SPLITS if not a.rows else ():
        rows.append((name, "all, spins", *run(name, *full, a.attn_ns, a.route_ns)))
        rows.append((name, "all, no spins", *run(name, *full, 0, 0)))
    first = SPLITS[0]
    if not a.rows:
        rows.append((first, "barriers only", *run(first, 0, 0, 0, 0, 0, 0, 0)))
        rows.append((first, "dense only", *run(first, QKV, O, R, 0, 0, 0, 0)))
        rows.append((first, "experts only", *run(first, 0, 0, 0, GU, DN, 0, 0)))
    print("| kernel | what | us a layer | % of bytes at copy bw | " + " | ".join(PHASES) + " |")
    print("|---|---|---|---|" + "---|" * BARRIERS)
    for name, what, us, ph in rows:
        pct = f"{100 * bound_us / us:.1f}%" if what.startswith("all") else "-"
        print(f"| {name} | {what} | {us:.2f} | {pct} | " + " | ".join(f"{p:.2f}" for p in ph) + " |")
    print("| kernel | pages, spins | ring A (dense): us | ring B (experts): us | arrivals first -> last, per barrier |"
          " last arrival -> release | CTA:times last |\n|---|---|---|---|---|---|---|")
    for name, *vals, (ta, tb), (spread, after, late) in traces:
        print(f"| {name} | {','.join(map(str, vals))} | {ta} | {tb} | {spread} | {after} | {late} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
