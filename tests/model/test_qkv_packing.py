"""Attention.packed_qkv (weights.PackedRows): the q/k/v projections as one GEMM over weights packed into one tensor."""
import torch

from nvl72.config import ModelConfig
from nvl72.model.attn_backends import AttentionBackend
from nvl72.model.loader import build_model, init_dummy_weights
from tests.runner.test_runner_engine import CONFIGS


def test_packed_qkv_equals_the_three_projections_and_follows_weight_changes():
    model = build_model(ModelConfig.from_dict(CONFIGS["qwen3_next"]), torch.float32, "cpu")
    init_dummy_weights(model, seed=1, std=0.3)
    att = model.model.layers[1].self_attn  # gated: q_proj emits [query | gate] per head
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))

    def check():
        sizes = [lin.out_features for lin in (att.q_proj, att.k_proj, att.v_proj)]
        packed = AttentionBackend().linear(x, *att.packed_qkv())
        for ref, got in zip((att.q_proj(x), att.k_proj(x), att.v_proj(x)), packed.split(sizes, dim=1)):
            assert got.shape == ref.shape and torch.allclose(got, ref, atol=1e-5, rtol=1e-5)

    with torch.inference_mode():
        check()
    w = att.packed_qkv.weight
    assert att.q_proj.weight.data_ptr() == w.data_ptr() and att.v_proj.weight.untyped_storage().data_ptr() == \
        w.untyped_storage().data_ptr()
    init_dummy_weights(model, seed=2, std=0.3)  # loaders write the parameters in place: through the views
    check()
    assert att.packed_qkv.weight is w
    model.to(torch.float64)  # own storage again: packed anew
    x = x.double()
    check()
    assert att.packed_qkv.weight.dtype == torch.float64 and att.packed_qkv.weight is not w
