"""One-GPU timing of the split-key decode attention (`fused_triton.paged_attention`, one query token)
at the Qwen3-30B-A3B attention shape (32 query heads over 4 KV heads, head_dim 128, bf16, pages of
16), batch 1, over context lengths, as the decode graphs launch it (CUDA graph, PDL), optionally
beside another copy of the module (an older commit's file: the A/B of a kernel change).

    python3 tests/runner/gpu_attn_decode_bench.py [--old PATH/fused_triton.py] [--contexts 192,2048,16384]

Each timed graph launches `--layers` attentions back to back, each on its own cache (so the keys are
not in L2 from the previous launch), with the split count the engine's wide page tables give
(`decode_splits`: 32 on an H100); time = median replay / layers. Every module's output is first
checked against the fp32 reference (`ops.paged_attention`). Prints the table last.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from nvl72.model import fused_triton, ops  # noqa: E402
from tests.moe.gpu_layer_profile import capture, median_us  # noqa: E402
from tests.runner.paged import random_batch, rel_err  # noqa: E402

HQ, HKV, D, PAGE = 32, 4, 128, 16


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("fused_triton_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default=None, help="another fused_triton.py to time beside this checkout's")
    ap.add_argument("--contexts", default="192,2048,16384")
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    mods = [("new", fused_triton)] + ([("old", load_module(args.old))] if args.old else [])
    # the engine's page tables are as wide as the longest context it serves: its split count
    splits = fused_triton.decode_splits(torch.device("cuda"), 1, HKV, 1 << 20, 64)
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        runs = [random_batch([1], [ctx - 1], PAGE, HQ, HKV, D, torch.bfloat16, "cuda", seed=ctx + i)
                for i in range(args.layers)]
        for batch, kv, q, k, v in runs:
            fused_triton.store_kv(kv, k, v, ops.AttentionMetadata.build(batch, PAGE).slot_mapping)
        batch, kv, q = runs[0][:3]
        ref = ops.paged_attention(q.float(), kv.float(), ops.AttentionMetadata.build(batch, PAGE), D**-0.5)
        row = {"context": ctx, "splits": splits}
        for name, mod in mods:
            def step(m=mod):
                for b, kv_, q_ in (r[:3] for r in runs):
                    m.paged_attention(q_, kv_, b.query_start_loc, b.seq_lens, b.page_table, 1, D**-0.5, splits=splits)

            err = rel_err(mod.paged_attention(q, kv, batch.query_start_loc, batch.seq_lens, batch.page_table, 1,
                                              D**-0.5, splits=splits), ref)
            assert err < 2e-2, (name, ctx, err)
            row[name] = median_us(capture(step)) / args.layers
        rows.append(row)
        print(row, flush=True)
    print(f"\nATTN decode b=1 ({torch.cuda.get_device_name()}, {HQ}/{HKV} heads x {D}, bf16, CUDA graph of "
          f"{args.layers} launches, us per launch)")
    print("%8s %7s %9s %9s" % ("context", "splits", "new us", "old us"))
    for r in rows:
        print("%8d %7d %9.2f %9s" % (r["context"], r["splits"], r["new"], "%.2f" % r["old"] if "old" in r else "-"))


if __name__ == "__main__":
    main()
