"""MoE expert GEMM benchmark: our grouped GEMMs beside torch's, against the hardware floor.

    python -m perf.moe [--models qwen3-235b,qwen3.5-397b,qwen3-30b-a3b] [--tokens 1,2,...,16384] [--json out.json]
                       [--no-ws | --variants contig_n256,contig_n256_mc,...]

For each model's expert shape (E experts, hidden H, intermediate I, top-k) and token count T, with
uniformly random routing, it times the two expert GEMMs of one MoE layer (w13: [T*k, H] x [2I, H]^T,
then w2: [T*k, I] x [H, I]^T) done by
  ours-fp8        the CuTeDSL wgmma grouped GEMM (the backend's choice per GEMM), MXFP8 weights
                  (regrouped 128 x 128 pow2 scales), 1 x 128 activation scales; masked layout
                  (swap-AB kernel) for T <= 256, contiguous above
  torch-bf16      torch._grouped_mm (bf16)
  torch-fp8-row   torch._scaled_grouped_mm (FP8, row-wise scales)
ours-bf16 (the same kernel on bf16 operands) and the alternative FP8 variants (`alt`: BM=128
masked kernel for decode, overlapped promotion for prefill), the warp-specialized persistent
variants of moe.kernels.sm90_grouped_gemm_ws (`ws`: each checked against the default variant's
output first, rel err < 1e-2, then timed; `ws ms` is the fastest that matched; a variant that fails
to load, raises or mismatches is reported in the JSON and left out; `--variants` keeps only the named
ones), and our whole layer (`layer-fp8`:
permute + quantize + GEMM + SiLU-and-mul + quantize + GEMM + weighted un-permute; no routing).
TFLOP/s counts 6 * T * k * H * I; bandwidth counts the bytes of the active experts' weights plus
activations in and out, against a device-to-device copy measured in the same run (read + write).
Each ws variant, torch-bf16 and torch-fp8-row are also timed per GEMM (`<name>_w13_ms`, `<name>_w2_ms`
in the JSON): w13 (K = H, long main loop) and w2 (K = I, short) may favour different variants, so
`ws split ms` is the fastest w13 plus the fastest w2 (what Sm90Gemm's per-GEMM table can reach).
Needs a CUDA GPU (sm_90 for ours); prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from moe import backend as backends
from moe.routing import permute_contiguous, permute_masked
from nvl72.cuda_timing import hbm_copy_bandwidth, time_cuda

MODELS = {
    "qwen3-235b": dict(E=128, H=4096, I=1536, k=8),
    "qwen3.5-397b": dict(E=512, H=4096, I=1024, k=10),
    "qwen3-30b-a3b": dict(E=128, H=2048, I=768, k=8),  # the engine's single-GPU decode model
}
DEFAULT_MODELS = ["qwen3-235b", "qwen3.5-397b"]
DEFAULT_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
WS_MAX_REL_ERR = 1e-2


def timed(fn, iters: int) -> float:
    """Mean milliseconds per call (CUDA events, after warm-up)."""
    return 1e3 * time_cuda(fn, iters)


def _fp8_weights(e: int, n: int, k: int, gen: torch.Generator):
    """Random FP8 expert weights [E, N, K] with 128 x 128 power-of-two scales, built in chunks."""
    q = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device="cuda")
    for i in range(0, e, 16):
        q[i : i + 16] = (torch.randn(min(16, e - i), n, k, device="cuda", generator=gen) * 64).to(torch.float8_e4m3fn)
    s = torch.exp2(torch.randint(-12, -8, (e, n // 128, k // 128), device="cuda", generator=gen).float())
    return q, s


def bench_model(name: str, tokens: list[int], iters: int, gemm, bw_copy: float, variants=None) -> list[dict]:
    """One row per token count; `variants` (a set of ws export names) limits the ws variants timed."""
    cfg = MODELS[name]
    e, h, inter, k = cfg["E"], cfg["H"], cfg["I"], cfg["k"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13_q, w13_s = _fp8_weights(e, 2 * inter, h, gen)
    w2_q, w2_s = _fp8_weights(e, h, inter, gen)
    w13_bf = torch.empty(e, 2 * inter, h, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02, generator=gen)
    w2_bf = torch.empty(e, h, inter, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02, generator=gen)
    rows = []
    for t in tokens:
        ids = torch.rand(t, e, device="cuda", generator=gen).argsort(dim=1)[:, :k]  # [T, k] distinct experts
        wts = torch.rand(t, k, device="cuda", generator=gen)
        x = torch.randn(t, h, device="cuda", generator=gen, dtype=torch.bfloat16)
        active = int((torch.bincount(ids.flatten(), minlength=e) > 0).sum())
        flops = 6.0 * t * k * h * inter
        act_bytes_fp8 = t * k * (h + 2 * inter * 2 + inter + h * 2)  # a, h (bf16), a2, y (bf16)
        wbytes_fp8 = active * 3 * h * inter
        row = dict(model=name, tokens=t, active_experts=active, gflop=flops / 1e9)

        # ---- ours: GEMMs only, on pre-permuted / pre-quantized operands
        masked = t <= backends.DECODE_MAX_TOKENS
        if masked:
            cap = -(-t // 128) * 128
            perm = permute_masked(ids, e, cap)
            aux, rpb, shape = perm.counts, cap, (e, cap)
        else:
            perm = permute_contiguous(ids, e, 0, 128)
            aux, rpb, shape = perm.tile_expert, perm.num_rows, (perm.num_rows,)
        a = torch.randn(*shape, h, device="cuda", generator=gen).to(torch.float8_e4m3fn)
        sa = torch.ones(perm.num_rows // rpb, h // 128, rpb, device="cuda")
        a2 = torch.randn(*shape, inter, device="cuda", generator=gen).to(torch.float8_e4m3fn)
        sa2 = torch.ones(perm.num_rows // rpb, inter // 128, rpb, device="cuda")
        hbuf = torch.empty(*shape, 2 * inter, dtype=torch.bfloat16, device="cuda")
        ybuf = torch.empty(*shape, h, dtype=torch.bfloat16, device="cuda")

        def w13(variant=None, out=hbuf):  # variant None: the backend's choice for this GEMM
            gemm(a, w13_q, out, sa, w13_s, aux, masked, variant=variant, role="w13")

        def w2(variant=None, out=ybuf):
            gemm(a2, w2_q, out, sa2, w2_s, aux, masked, variant=variant, role="w2")

        def ours(variant=None):
            w13(variant)
            w2(variant)

        row["ours_fp8_ms"] = timed(ours, iters)
        alts = ["grouped_gemm_fp8_masked", "grouped_gemm_fp8_masked_serial"] if masked else ["grouped_gemm_fp8_contig"]
        for v in alts:
            row[f"{v}_ms"] = timed(lambda: ours(v), iters)
        if gemm.ws is not None:
            ws_variants = backends.Sm90Gemm.WS_MASKED if masked else backends.Sm90Gemm.WS_CONTIG
            ws_variants = [v for v in ws_variants if variants is None or v in variants]
            _bench_ws(row, {"w13": (w13, hbuf), "w2": (w2, ybuf)}, (perm.token_of >= 0).view(*shape), ws_variants, iters)
        a_bf, a2_bf = a.to(torch.bfloat16), a2.to(torch.bfloat16)

        def ours_bf16():
            gemm(a_bf, w13_bf, hbuf, None, None, aux, masked)
            gemm(a2_bf, w2_bf, ybuf, None, None, aux, masked)

        row["ours_bf16_ms"] = timed(ours_bf16, iters)
        del a_bf, a2_bf

        # ---- whole layer through the sm90-fp8 backend (routing excluded)
        be = backends.select("cuda", "sm90-fp8")
        wts_obj = backends.ExpertWeights(w13_q, w2_q, w13_s, w2_s)
        row["layer_fp8_ms"] = timed(lambda: be.run(x, wts, ids, wts_obj, 0), iters)

        # ---- torch peers on the same routing (groups padded to 16 rows, as _scaled_grouped_mm wants)
        p16 = permute_contiguous(ids, e, 0, 16)
        ends = torch.cumsum((p16.counts + 15) // 16 * 16, 0).to(torch.int32)
        m16 = p16.num_rows
        xa = torch.randn(m16, h, device="cuda", dtype=torch.bfloat16, generator=gen)
        xh = torch.randn(m16, inter, device="cuda", dtype=torch.bfloat16, generator=gen)

        xa8, xh8 = xa.to(torch.float8_e4m3fn), xh.to(torch.float8_e4m3fn)
        sxa, sxh = torch.ones(m16, device="cuda"), torch.ones(m16, device="cuda")
        s13, s2 = torch.ones(e, 2 * inter, device="cuda"), torch.ones(e, h, device="cuda")
        peers = {
            "torch_bf16": (
                lambda: torch._grouped_mm(xa, w13_bf.transpose(1, 2), offs=ends),
                lambda: torch._grouped_mm(xh, w2_bf.transpose(1, 2), offs=ends),
            ),
            "torch_fp8_row": (
                lambda: torch._scaled_grouped_mm(xa8, w13_q.transpose(1, 2), sxa, s13, offs=ends, out_dtype=torch.bfloat16),
                lambda: torch._scaled_grouped_mm(xh8, w2_q.transpose(1, 2), sxh, s2, offs=ends, out_dtype=torch.bfloat16),
            ),
        }
        for key, (p13, p2) in peers.items():
            try:
                row[f"{key}_ms"] = timed(lambda: (p13(), p2()), iters)
                row[f"{key}_w13_ms"], row[f"{key}_w2_ms"] = timed(p13, iters), timed(p2, iters)
            except RuntimeError as err:
                row[f"{key}_ms"], row[f"{key}_error"] = None, str(err).splitlines()[0][:200]
        for key in ("ours_fp8", "ours_bf16", "layer_fp8", "torch_bf16", "torch_fp8_row"):
            ms = row.get(f"{key}_ms")
            row[f"{key}_tflops"] = flops / ms / 1e9 if ms else None
        row["ours_fp8_gbps"] = (wbytes_fp8 + act_bytes_fp8) / row["ours_fp8_ms"] / 1e6
        row["ours_fp8_bw_frac"] = row["ours_fp8_gbps"] / bw_copy
        if row.get("torch_fp8_row_ms"):
            row["speedup_vs_fp8_row"] = row["torch_fp8_row_ms"] / row["ours_fp8_ms"]
        if row.get("torch_bf16_ms"):
            row["speedup_vs_bf16"] = row["torch_bf16_ms"] / row["ours_fp8_ms"]
        if row.get("ws_split_ms") and row.get("torch_bf16_ms"):
            row["ws_split_speedup_vs_bf16"] = row["torch_bf16_ms"] / row["ws_split_ms"]
        if row.get("ws_best_ms"):
            row["ws_bw_frac"] = (wbytes_fp8 + act_bytes_fp8) / row["ws_best_ms"] / 1e6 / bw_copy
            for ref, key in (("torch_fp8_row_ms", "ws_speedup_vs_fp8_row"), ("torch_bf16_ms", "ws_speedup_vs_bf16")):
                if row.get(ref):
                    row[key] = row[ref] / row["ws_best_ms"]
        rows.append(row)
        print(_fmt(row), flush=True)
        del a, a2, hbuf, ybuf, xa, xh, xa8, xh8
    return rows


def _bench_ws(row: dict, gemms: dict, valid, variants: list[str], iters: int) -> None:
    """Check each warp-specialized variant's output of every GEMM (w13, w2: (fn(variant, out), default
    output)) against the default variant's, then time the ones that match, per GEMM and both in a row;
    one that fails to load, raises or mismatches is recorded and skipped. Sets ws_best (both GEMMs by one
    variant) and ws_best_<gemm> (per GEMM), ws_split_ms = the sum of the per-GEMM bests."""
    torch.cuda.synchronize()
    wants = {g: out[valid].float() for g, (_, out) in gemms.items()}
    best = {}
    for v in variants:
        try:
            errs = []
            for g, (fn, out) in gemms.items():
                got = torch.full_like(out, float("nan"))
                fn(v, got)
                torch.cuda.synchronize()
                errs.append(((got[valid].float() - wants[g]).norm() / wants[g].norm()).item())
            row[f"{v}_err"] = err = max(errs, key=lambda x: x if x == x else float("inf"))
            if not err < WS_MAX_REL_ERR:  # NaN (unwritten rows) fails too
                row[f"{v}_error"] = f"rel err {err:.3g} vs the default variant"
                continue
            for g, (fn, _) in gemms.items():
                row[f"{v}_{g}_ms"] = timed(lambda: fn(v), iters)
            row[f"{v}_ms"] = timed(lambda: [fn(v) for fn, _ in gemms.values()], iters)
            for key in ["", *(f"_{g}" for g in gemms)]:
                if key not in best or row[f"{v}{key}_ms"] < row[f"{best[key]}{key}_ms"]:
                    best[key] = v
        except Exception as err:  # noqa: BLE001 - a broken new variant must not stop the table
            row[f"{v}_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
            torch.cuda.synchronize()
    if best:
        row["ws_best"], row["ws_best_ms"] = best[""], row[f"{best['']}_ms"]
        for g in gemms:
            row[f"ws_best_{g}"] = best[f"_{g}"]
        row["ws_split_ms"] = sum(row[f"{best['_' + g]}_{g}_ms"] for g in gemms)


HEADER = (
    f"{'model':>13} {'T':>6} {'act':>4} {'ours ms':>8} {'TF/s':>6} {'GB/s':>6} {'%cp':>5} {'alt ms':>7} {'obf16':>7} "
    f"{'layer ms':>8} {'bf16 ms':>8} {'TF/s':>6} {'fp8row ms':>9} {'TF/s':>6} {'x fp8row':>8} {'x bf16':>6} "
    f"{'ws ms':>7} {'ws var':>14} {'ws %cp':>6} {'ws xf8r':>7} {'ws xbf':>6} {'split ms':>8} {'xbf':>5}"
)


def _fmt(r: dict) -> str:
    def f(v, w, p=3):
        return f"{v:>{w}.{p}f}" if isinstance(v, (int, float)) and v is not None else f"{'-':>{w}}"

    return (
        f"{r['model']:>13} {r['tokens']:>6} {r['active_experts']:>4} {f(r['ours_fp8_ms'], 8)} "
        f"{f(r['ours_fp8_tflops'], 6, 0)} {f(r['ours_fp8_gbps'], 6, 0)} {f(100 * r['ours_fp8_bw_frac'], 5, 1)} "
        f"{f(r.get('grouped_gemm_fp8_masked_ms', r.get('grouped_gemm_fp8_contig_ms')), 7)} {f(r['ours_bf16_ms'], 7)} "
        f"{f(r['layer_fp8_ms'], 8)} {f(r.get('torch_bf16_ms'), 8)} {f(r.get('torch_bf16_tflops'), 6, 0)} "
        f"{f(r.get('torch_fp8_row_ms'), 9)} {f(r.get('torch_fp8_row_tflops'), 6, 0)} "
        f"{f(r.get('speedup_vs_fp8_row'), 8, 2)} {f(r.get('speedup_vs_bf16'), 6, 2)} "
        f"{f(r.get('ws_best_ms'), 7)} {r.get('ws_best', '-').replace('ws_fp8_', ''):>14} "
        f"{f(100 * r['ws_bw_frac'] if r.get('ws_bw_frac') else None, 6, 1)} "
        f"{f(r.get('ws_speedup_vs_fp8_row'), 7, 2)} {f(r.get('ws_speedup_vs_bf16'), 6, 2)} "
        f"{f(r.get('ws_split_ms'), 8)} {f(r.get('ws_split_speedup_vs_bf16'), 5, 2)}"
    )


def parse_variants(spec: str | None) -> set[str] | None:
    """--variants: names of ws exports (the ws_fp8_ prefix optional) -> a set of export names; None: all."""
    if spec is None:
        return None
    known = backends.Sm90Gemm.WS_CONTIG + backends.Sm90Gemm.WS_MASKED
    names = {n if n.startswith("ws_") else f"ws_fp8_{n}" for n in spec.split(",") if n}
    bad = sorted(names - set(known))
    if bad or not names:
        raise SystemExit(f"--variants {spec!r}: unknown {bad}; known: {known}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.moe", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"any of {','.join(MODELS)}")
    ap.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default="perf/out/moe.json")
    ap.add_argument("--no-ws", action="store_true", help="leave out the warp-specialized variants (ws columns)")
    ap.add_argument("--variants", default=None,
                    help="only these ws variants, comma-separated, with or without the ws_fp8_ prefix")
    args = ap.parse_args(argv)
    variants = parse_variants(args.variants)
    models = args.models.split(",")
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"unknown model {m!r}; known: {sorted(MODELS)}")
    tokens = [int(t) for t in args.tokens.split(",")]
    if not torch.cuda.is_available():
        raise SystemExit("perf.moe needs a CUDA GPU")
    ws = None
    if not args.no_ws:
        try:
            ws = backends.load_sm90_module(backends.SM90_WS_MODULE)
        except Exception as err:  # noqa: BLE001 - the classic columns are still measured
            print(f"# {backends.SM90_WS_MODULE} did not load ({type(err).__name__}: {err}); no ws columns", flush=True)
    gemm = backends.Sm90Gemm(backends.load_sm90_module(), ws, "classic" if ws is None else "auto")  # the layer's choice
    bw = hbm_copy_bandwidth(1 << 30) / 1e9  # GB/s
    dev = torch.cuda.get_device_name()
    print(f"# {dev}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s (read + write)")
    print(HEADER)
    rows = []
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out = dict(device=dev, torch=torch.__version__, copy_gbps=bw, date=date,
               command=" ".join(["python -m perf.moe"] + (argv if argv is not None else sys.argv[1:])), rows=rows)
    for m in models:
        new = bench_model(m, tokens, args.iters, gemm, bw, variants)
        rows += new
        for r in new:
            for key in sorted(k for k in r if k.endswith("_error") and k.startswith("ws_")):
                print(f"# {r['model']} T={r['tokens']}: {key[:-6]}: {r[key]}", flush=True)
        torch.cuda.empty_cache()
        if args.json:  # rewritten after each model, so a cut-short run keeps what it measured
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
