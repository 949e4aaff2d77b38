"""The same model on a CUDA device (GDN then takes its GPU kernels): logits equal transformers'
CPU fp32 reference for prefill, a mixed chunk + decode batch and decode; bf16 stays close."""
import pytest
import torch

from nvl72.model.loader import load_model
from tests.model.tiny import PagedRunner, hf_logits, rel_err, save_tiny

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "qwen3_5_moe"])
def test_cuda_logits_equal_transformers(family, tmp_path):
    ref = save_tiny(family, tmp_path, seed=31)
    g = torch.Generator().manual_seed(32)
    a, b = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (70, 9))
    want_a, want_b = hf_logits(ref, a), hf_logits(ref, b)
    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 5e-2)):
        model = load_model(tmp_path, dtype=dtype, device="cuda")
        run = PagedRunner(model, seed=33)
        out = run.step([(0, a[:40]), (1, b[:8])])
        out += run.step([(0, a[40:69]), (1, b[8:])])
        out += run.step([(0, a[69:])])
        got_a = torch.cat([out[0], out[2], out[4]])
        got_b = torch.cat([out[1], out[3]])
        print(f"{family} {dtype}: rel err {rel_err(got_a, want_a):.2e} / {rel_err(got_b, want_b):.2e}")
        assert rel_err(got_a, want_a) < tol and rel_err(got_b, want_b) < tol
