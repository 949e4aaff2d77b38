"""Where a one-token decoder layer's time goes in nvl72.model.decode_layer (GPU host, repo root).

    python3 tests/runner/gpu_decode_layer_phases.py [--layers 8] [--context 160] [--configs 4x4,8x1]

Qwen3-30B-A3B shape, `--layers` layers, dummy weights, bf16, sm90-fp8 experts. One decode token at
position `--context` (the KV before it random) through the decoder layers (no embedding, final
norm or lm_head), each variant captured in a CUDA graph and replayed (median of 200 replays
after 20): the per-op kernels (NVL72_DECODE_LAYER=0's path), the one-kernel layer ("fused"), its
six phases as separate launches ("phased"), and each phase alone (`run(..., phases=(k,))`; its
inputs are whatever the scratch holds, so only its time means something), for each `--configs`
entry WARPSxCTAS (decode_layer.NUM_WARPS, decode_layer.CTAS_PER_SM). Prints a table with the bytes
each layer must read and the HBM copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import logging
import statistics

import torch

from nvl72.config import ModelConfig
from nvl72.cuda_timing import hbm_copy_bandwidth
from nvl72.model import attn_backends, decode_layer
from nvl72.model.batch import ForwardBatch
from nvl72.model.loader import load_model
from perf.serve import QWEN3_30B_A3B
from tests.moe.gpu_layer_profile import capture

PAGE = 16


def graph_ms(fn, replays: int = 200) -> float:
    """Median ms of one replay of `fn` captured in a CUDA graph (after warm-up runs)."""
    g = capture(fn)
    for _ in range(20):
        g.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--configs", default="8x4,4x4", help="WARPSxCTAS_PER_SM, comma-separated")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    cfg = ModelConfig.from_dict(dict(QWEN3_30B_A3B, num_hidden_layers=args.layers))
    model = load_model(None, config=cfg, dtype=torch.bfloat16, device="cuda", load_format="dummy")
    backend = model.attn_backend = attn_backends.TritonBackend()
    pages_per_seq = (args.context + PAGE) // PAGE + 1
    caches = model.allocate_caches(pages_per_seq + 4, PAGE)
    for kv in caches.kv:
        if kv is not None:
            kv.normal_(0, 1)
    pages = torch.arange(pages_per_seq, dtype=torch.int32, device="cuda").view(1, -1)
    batch = ForwardBatch(input_ids=torch.tensor([17], device="cuda"),
                         positions=torch.tensor([args.context], device="cuda"),
                         query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
                         seq_lens=torch.tensor([args.context + 1], dtype=torch.int32, device="cuda"),
                         page_table=pages, max_query_len=1)
    x0 = model.model.embed_tokens(batch.input_ids)
    layers = model.model.layers
    for layer in layers:
        layer.mlp.prepare()

    def layers_fwd(mode, phases=None):
        def fn():
            ctx = model._context(batch, caches, True)
            x, delta = x0, None
            for layer in layers:
                if mode is None:
                    backend.decode_layer = None
                    x, delta = layer.forward_residual(x, delta, ctx)
                else:
                    x, delta = decode_layer.run(layer, x, delta, ctx, mode, phases=phases)
            return x, delta
        return fn

    def out(mode):
        x, delta = layers_fwd(mode)()
        return x.float() + delta.float()

    rows = []
    with torch.inference_mode():
        ref = out(None)
        rows.append(("per-op kernels", "", graph_ms(layers_fwd(None))))
        experts = layers[0].mlp._backend  # one backend object serves every layer
        experts.fused_tokens = 1  # the per-op path with W8A16 experts, as the one-kernel layer computes them
        ref_w8 = out(None)
        rows.append(("per-op, W8A16 experts", f"vs per-op: rel err {((ref_w8 - ref).norm() / ref.norm()).item():.1e}",
                     graph_ms(layers_fwd(None))))
        experts.fused_tokens = 0
        for config in args.configs.split(","):
            decode_layer.NUM_WARPS, decode_layer.CTAS_PER_SM = (int(v) for v in config.split("x"))
            fused, phased = out("fused"), out("phased")
            err = ((fused - ref_w8).norm() / ref_w8.norm()).item()
            note = f"rel err {err:.1e} vs W8A16 per-op, fused {'==' if torch.equal(fused, phased) else '!='} phased"
            rows.append(("one kernel (fused)", f"{config}: {note}", graph_ms(layers_fwd("fused"))))
            rows.append(("six launches (phased)", config, graph_ms(layers_fwd("phased"))))
            for k in range(1, decode_layer.NUM_PHASES + 1):
                rows.append((f"phase {k} alone", config, graph_ms(layers_fwd("phased", phases=(k,)))))
            decode_layer.check_errors()
    bw = hbm_copy_bandwidth()
    a = layers[0].self_attn
    w = layers[0].mlp.fp8_weights()
    k = cfg.num_experts_per_tok
    nbytes = (a.packed_qkv()[0].numel() + a.o_proj.weight.numel() + layers[0].mlp.gate.weight.numel()) * 2
    nbytes += k * (w.w13[0].numel() + w.w2[0].numel())  # FP8: one byte each
    bound_us = nbytes / bw * 1e6
    print(f"\nDECODE LAYER {torch.cuda.get_device_name()}: Qwen3-30B-A3B shape, {args.layers} layers, context "
          f"{args.context}, bf16, FP8 experts; {nbytes / 1e6:.1f} MB per layer, HBM copy {bw / 1e9:.0f} GB/s -> "
          f"{bound_us:.2f} us per layer bound")
    print(f"| {'what':<22} | {'warps x CTAs/SM':<56} | {'us / layer':>10} | {'% of bound':>10} |")
    for name, config, ms in rows:
        us = ms * 1e3 / args.layers
        print(f"| {name:<22} | {config:<56} | {us:10.2f} | {100 * bound_us / us:9.1f}% |")


if __name__ == "__main__":
    main()
