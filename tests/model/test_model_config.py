"""ModelConfig reads the config.json transformers writes (and the official nested / legacy shapes)
to the same model transformers builds; bad configs raise ConfigError naming the offender."""
import json

import pytest
import transformers

from nvl72.config import FULL_ATTENTION, LINEAR_ATTENTION, ConfigError, ModelConfig
from tests.model.tiny import hf_config


def _roundtrip(hf_cfg, tmp_path) -> ModelConfig:
    hf_cfg.save_pretrained(tmp_path)
    return ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "qwen3_5_moe"])
def test_fields_match_transformers(family, tmp_path):
    hf = hf_config(family)
    cfg = _roundtrip(hf, tmp_path)
    assert cfg.model_type == family
    for name in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "num_experts",
        "num_experts_per_tok", "moe_intermediate_size",
    ):
        assert getattr(cfg, name) == getattr(hf, name), name
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
    assert cfg.partial_rotary_factor == hf.rope_parameters.get("partial_rotary_factor", 1.0)
    hybrid = family != "qwen3_moe"
    assert cfg.is_hybrid == hybrid and cfg.zero_centered_norm == hybrid and cfg.attn_output_gate == hybrid
    if hybrid:
        assert cfg.layer_types == hf.layer_types
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim", "shared_expert_intermediate_size"):
            assert getattr(cfg, name) == getattr(hf, name), name
        assert cfg.rotary_dim == int(hf.head_dim * 0.25)
    else:
        assert cfg.layer_types == [FULL_ATTENTION] * hf.num_hidden_layers
        assert cfg.shared_expert_intermediate_size == 0
    if family == "qwen3_5_moe":
        assert cfg.norm_topk_prob  # the Qwen3.5 router always renormalises
    else:
        assert cfg.norm_topk_prob == hf.norm_topk_prob
        # dense layers exactly where transformers puts them
        assert [cfg.is_moe_layer(i) for i in range(hf.num_hidden_layers)] == [
            i not in hf.mlp_only_layers and (i + 1) % hf.decoder_sparse_step == 0 for i in range(hf.num_hidden_layers)
        ]


def test_default_layer_types_from_interval(tmp_path):
    hf = transformers.Qwen3NextConfig(num_hidden_layers=8, full_attention_interval=4)
    cfg = ModelConfig.from_dict(hf.to_dict())
    assert cfg.layer_types == hf.layer_types
    d = hf.to_dict()
    del d["layer_types"]
    d["full_attention_interval"] = 2
    cfg = ModelConfig.from_dict(d)
    assert cfg.layer_types == [LINEAR_ATTENTION, FULL_ATTENTION] * 4
    assert cfg.num_kv_layers == 4


def test_nested_multimodal_qwen3_5_config():
    """The official Qwen3.5 config.json: text model under text_config, tying flag on the wrapper."""
    mm = transformers.Qwen3_5MoeConfig(text_config=hf_config("qwen3_5_moe").to_dict(), tie_word_embeddings=True)
    d = mm.to_dict()
    d["text_config"]["mtp_num_hidden_layers"] = 1
    del d["text_config"]["tie_word_embeddings"]
    cfg = ModelConfig.from_dict(d)
    assert cfg.model_type == "qwen3_5_moe" and cfg.hidden_size == 64 and cfg.tie_word_embeddings
    assert cfg.has_mtp and cfg.mtp_num_hidden_layers == 1
    assert cfg.num_kv_layers == cfg.layer_types.count(FULL_ATTENTION) + 1


def test_legacy_rope_keys_and_eos_list():
    """Qwen3-Next's released config.json: top-level rope_theta / partial_rotary_factor, eos list."""
    d = transformers.Qwen3NextConfig().to_dict()
    del d["rope_parameters"]
    d.update(rope_theta=10_000_000, partial_rotary_factor=0.5, rope_scaling=None, eos_token_id=[1, 2])
    cfg = ModelConfig.from_dict(d)
    assert cfg.rope_theta == 10_000_000 and cfg.partial_rotary_factor == 0.5
    assert cfg.eos_token_id == [1, 2]
    hf = transformers.Qwen3NextConfig(**{k: v for k, v in d.items() if k != "model_type"})
    assert hf.rope_parameters["rope_theta"] == cfg.rope_theta
    assert hf.rope_parameters["partial_rotary_factor"] == cfg.partial_rotary_factor


def test_unknown_model_type_is_named():
    with pytest.raises(ConfigError, match="'llama'"):
        ModelConfig.from_dict({"model_type": "llama", "hidden_size": 8})
    with pytest.raises(ConfigError, match="model_type"):
        ModelConfig.from_dict({"hidden_size": 8})


@pytest.mark.parametrize("field", ["hidden_size", "num_experts", "linear_num_value_heads"])
def test_missing_field_is_named(field):
    d = hf_config("qwen3_next").to_dict()
    d.pop(field)
    with pytest.raises(ConfigError, match=f"'{field}'"):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize(
    "change, offender",
    [
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "'yarn'"),
        (dict(hidden_act="gelu"), "'gelu'"),
        (dict(layer_types=["full_attention", "sliding"] * 2), "'sliding'"),
        (dict(num_key_value_heads=3), "num_key_value_heads=3"),
    ],
)
def test_unsupported_values_are_named(change, offender):
    d = hf_config("qwen3_next").to_dict()
    d.update(change)
    with pytest.raises(ConfigError, match=offender):
        ModelConfig.from_dict(d)


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_config("qwen3_moe").to_dict()))
    assert ModelConfig.from_pretrained(tmp_path / "config.json").model_type == "qwen3_moe"
