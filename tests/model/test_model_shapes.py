"""Full-size configs (transformers' defaults are the released models' shapes) built on the meta
device: every parameter has transformers' name and shape (its in-memory fused experts are our
`w13`/`w2`), so the loader's one-to-one mapping holds beyond the tiny test checkpoints."""
import pytest
import torch
import transformers

from nvl72.config import ModelConfig
from nvl72.model.qwen import build_model

CASES = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(mlp_only_layers=[0, 5])),
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM, {}),
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM, {}),
}


@pytest.mark.parametrize("family", list(CASES))
def test_full_size_parameter_names_and_shapes_equal_transformers(family):
    cfg_cls, model_cls, kw = CASES[family]
    hf_cfg = cfg_cls(**kw)
    with torch.device("meta"):
        hf = model_cls(hf_cfg)
    want = {
        k.replace(".experts.gate_up_proj", ".w13").replace(".experts.down_proj", ".w2"): tuple(v.shape)
        for k, v in hf.state_dict().items()
    }
    ours = build_model(ModelConfig.from_dict(hf_cfg.to_dict()), torch.bfloat16, "meta")
    got = {k: tuple(v.shape) for k, v in ours.named_parameters()}
    assert got.keys() == want.keys(), (sorted(got.keys() - want.keys())[:5], sorted(want.keys() - got.keys())[:5])
    bad = {k: (got[k], want[k]) for k in got if got[k] != want[k]}
    assert not bad
    # KV pages exactly for transformers' full-attention layers, GDN state for the others
    types = getattr(hf_cfg, "layer_types", None) or ["full_attention"] * hf_cfg.num_hidden_layers
    spec = ours.cache_spec()
    assert sorted(spec.kv) == [i for i, t in enumerate(types) if t == "full_attention"]
    assert sorted(spec.state) == [i for i, t in enumerate(types) if t == "linear_attention"]
