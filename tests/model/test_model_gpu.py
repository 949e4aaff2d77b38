"""The same model on a CUDA device (GDN then takes its GPU kernels): fp32 logits equal transformers'
CPU fp32 reference for prefill, a mixed chunk + decode batch and decode; bf16 strays from it no
more than transformers' own bf16 model does. Every expert is routed (top-k = E) so that a
routing flip between devices or dtypes cannot dominate the comparison."""
import pytest
import torch

from nvl72.model.loader import load_model
from tests.model.tiny import PagedRunner, hf_logits, rel_err, save_tiny

pytestmark = pytest.mark.gpu


@pytest.fixture
def no_tf32():
    """cuDNN convolutions (the GDN causal conv) default to TF32; keep fp32 exact."""
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


def _run(model, a, b):
    """Two sequences: prefill chunks side by side, then a chunk beside a decode, then a decode."""
    run = PagedRunner(model, seed=33)
    out = run.step([(0, a[:40]), (1, b[:8])])
    out += run.step([(0, a[40:69]), (1, b[8:])])
    out += run.step([(0, a[69:])])
    return torch.cat([out[0], out[2], out[4]]), torch.cat([out[1], out[3]])


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "qwen3_5_moe"])
def test_cuda_logits_equal_transformers(family, tmp_path, no_tf32):
    ref = save_tiny(family, tmp_path, seed=31, num_experts_per_tok=8)
    g = torch.Generator().manual_seed(32)
    a, b = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (70, 9))
    want_a, want_b = hf_logits(ref, a), hf_logits(ref, b)
    got_a, got_b = _run(load_model(tmp_path, dtype=torch.float32, device="cuda"), a, b)
    print(f"{family} fp32 cuda: rel err {rel_err(got_a, want_a):.2e} / {rel_err(got_b, want_b):.2e}")
    assert rel_err(got_a, want_a) < 1e-3 and rel_err(got_b, want_b) < 1e-3  # GPU kernels may reorder sums
    hf_err = rel_err(hf_logits(ref.to(torch.bfloat16), a), want_a)
    got_a, _ = _run(load_model(tmp_path, dtype=torch.bfloat16, device="cuda"), a, b)
    print(f"{family} bf16 cuda: rel err {rel_err(got_a, want_a):.2e} (transformers bf16 on CPU: {hf_err:.2e})")
    assert rel_err(got_a, want_a) < 1.25 * hf_err + 1e-3
