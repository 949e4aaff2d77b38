"""DP-attention + EP model layers on 2+ GPUs: the fused NVLink dispatch/combine of a serving rank
(`serving_dp_ep_layout`: CuTeDSL kernels over a SymmetricHeap, bf16) gives the same logits, bit for
bit, as the torch.distributed reference (NCCL all_to_all), on each rank's own batches with idle
steps and mixed prefill + decode (the step script of tests/dist/test_dp_ep_model.py), on dummy
weights (one model in every layout). Also checks that the fused path really ran.

Runs under pytest (skipped without 2 GPUs) or directly on a GPU host (carry the kernel bundle):
    python tests/dist/test_dp_ep_gpu.py [WORLD]"""
from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pytest

TIMEOUT_S = 120
# a qwen3_moe shape the fused kernels take: hidden a multiple of 1024, top-k with a compiled kernel
SHAPE = dict(hidden_size=1024, head_dim=128, num_attention_heads=8, num_key_value_heads=2, num_experts=16,
             num_experts_per_tok=4, moe_intermediate_size=256, intermediate_size=512, vocab_size=512)


def _worker(rank: int, world: int, store: str) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S), device_id=dev)
    from nvl72.config import ModelConfig
    from nvl72.model.dp_ep import dp_ep_layout, serving_dp_ep_layout
    from nvl72.model.loader import load_model
    from tests.dist.dp_ep_worker import dp_script
    from tests.dist.test_dp_ep_model import make_steps
    from tests.model.tiny import hf_config

    try:
        cfg = ModelConfig.from_dict(hf_config("qwen3_moe", **SHAPE).to_dict())
        steps = make_steps(world, mtp=False, seed=11)
        group = dist.group.WORLD
        logits = {}
        for name, layout in (("fused", serving_dp_ep_layout(group, cfg, 64, torch.bfloat16, "cuda", 30.0)),
                             ("reference", dp_ep_layout(group, cfg, 64, torch.bfloat16, 30.0))):
            fused = layout.dispatch._fused is not None
            assert fused == (name == "fused"), f"{name}: fused kernels {'used' if fused else 'not used'}"
            model = load_model(None, config=cfg, dtype=torch.bfloat16, device=dev, load_format="dummy", seed=4,
                               parallel=layout)
            with torch.no_grad():
                logits[name] = dp_script(model, steps, rank)
            torch.cuda.synchronize()
            layout.dispatch.check()  # no kernel error word set (timeouts, capacity)
            layout.dispatch.destroy()
        same = torch.equal(logits["fused"], logits["reference"])
        diff = (logits["fused"].float() - logits["reference"].float()).abs().max().item()
        print(f"{'PASS' if same else 'FAIL'} rank {rank}: {tuple(logits['fused'].shape)} logits, fused == reference "
              f"(max |diff| {diff:.3g})", flush=True)
        assert same
    finally:
        dist.destroy_process_group()


def run(world: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.spawn(_worker, args=(world, os.path.join(d, "store")), nprocs=world, join=False)
        t0 = time.monotonic()
        while not ctx.join(timeout=5):
            if time.monotonic() - t0 > TIMEOUT_S * 2:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"DP+EP GPU workers did not finish within {TIMEOUT_S * 2} s")


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.mp
def test_fused_dp_ep_logits_equal_reference():
    run(2)


if __name__ == "__main__":
    run(int(sys.argv[1]) if len(sys.argv) > 1 else torch.cuda.device_count())
