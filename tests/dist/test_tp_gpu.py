"""Tensor/expert-parallel model on two GPUs (NCCL, torchrun) == the single-GPU model: fp32 logits
within GPU reordering error, and bf16 logits no further from the fp32 ones than the single-GPU bf16
model is (MTP drafts included for the hybrid models). Every expert is routed (top-k = E) so that a
bf16 routing flip cannot dominate."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from nvl72.model.loader import load_model
from tests.dist.test_tp_model import write_checkpoint
from tests.dist.tp_worker import tp_script
from tests.dist.workers import ROOT
from tests.model.tiny import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu, pytest.mark.mp]

# name -> (family, checkpoint overrides, ep_size, fused expert layout)
CASES = {
    "qwen3_moe-kv1-ep2": ("qwen3_moe", dict(num_key_value_heads=1), 2, False),
    "qwen3_next-kv2-ep1": ("qwen3_next", dict(num_key_value_heads=2), 1, False),
    "qwen3_5_moe-kv1-ep2-fused": ("qwen3_5_moe", dict(num_key_value_heads=1), 2, True),
}
BACKEND = {"float32": "reference", "bfloat16": "torch-grouped"}


def test_tp2_on_two_gpus_equals_one_gpu(tmp_path):
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (70, 9)]
    decode = torch.randint(0, 256, (3, 2), generator=g).tolist()
    paths = {n: write_checkpoint(tmp_path, n, f, {**o, "num_experts_per_tok": 8}, fused, mtp=f != "qwen3_moe")
             for n, (f, o, _, fused) in CASES.items()}
    cases = [dict(name=f"{n}.{dt}", path=str(paths[n]), ep_size=CASES[n][2], dtype=dt, moe_backend=be)
             for n in CASES for dt, be in BACKEND.items()]
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(dict(device="cuda", cases=cases, prompts=prompts, decode=decode)))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          str(ROOT / "tests/dist/tp_worker.py"), str(spec), str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    for n in CASES:
        single = {}
        for dt, be in BACKEND.items():
            os.environ["NVL72_MOE_BACKEND"] = be
            with torch.no_grad():
                model = load_model(paths[n], dtype=getattr(torch, dt), device="cuda")
                single[dt] = tp_script(model, prompts, decode)
        tp = {dt: [load_file(str(tmp_path / f"{n}.{dt}.rank{r}.safetensors"))["logits"] for r in range(2)]
              for dt in BACKEND}
        assert torch.equal(tp["float32"][0], tp["float32"][1]) and torch.equal(tp["bfloat16"][0], tp["bfloat16"][1])
        fp32_err = rel_err(tp["float32"][0], single["float32"])
        bf16_single = rel_err(single["bfloat16"], single["float32"])
        bf16_tp = rel_err(tp["bfloat16"][0], single["float32"])
        print(f"{n}: TP2 fp32 vs 1 GPU fp32 rel err {fp32_err:.2e}; bf16 vs 1 GPU fp32: TP2 {bf16_tp:.2e}, "
              f"1 GPU {bf16_single:.2e}")
        assert fp32_err < 1e-4
        assert bf16_tp < 1.5 * bf16_single + 1e-3
