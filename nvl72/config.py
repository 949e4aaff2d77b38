"""`ModelConfig`: the text-model part of a Hugging Face Qwen MoE config.json, with HF attribute names.

Supported `model_type`s: `qwen3_moe` (Qwen3-30B-A3B, Qwen3-235B-A22B), `qwen3_next` (Qwen3-Next-80B-A3B)
and `qwen3_5_moe` (Qwen3.5 MoE; the multimodal config nests the text model under `text_config`,
whose own type is `qwen3_5_moe_text`). Defaults are those of transformers' own config classes
(`Qwen3MoeConfig`, `Qwen3NextConfig`, `Qwen3_5MoeTextConfig`) so that a config.json that leaves a
field out means the same model here as in transformers. RoPE settings live in `rope_parameters`
(transformers 5); the legacy top-level `rope_theta` / `partial_rotary_factor` / `rope_scaling` are
folded into it the way transformers does.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from safetensors import safe_open

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

# text model_type -> canonical family name
_FAMILIES = {
    "qwen3_moe": "qwen3_moe",
    "qwen3_next": "qwen3_next",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
}
_HYBRID = ("qwen3_next", "qwen3_5_moe")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")

# Fields without which the model is not defined (no transformers default is meaningful for them).
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)
_REQUIRED_HYBRID = (
    "head_dim",
    "shared_expert_intermediate_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
)

# Per-family defaults, copied from the transformers config classes (5.x).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        intermediate_size=6144, norm_topk_prob=False, decoder_sparse_step=1,
        shared_expert_intermediate_size=0,
    ),
    "qwen3_next": dict(
        intermediate_size=5632, norm_topk_prob=True, decoder_sparse_step=1, partial_rotary_factor=0.25,
        full_attention_interval=4,
    ),
    "qwen3_5_moe": dict(
        # Qwen3.5's router always renormalises its top-k and every layer is sparse.
        intermediate_size=None, norm_topk_prob=True, decoder_sparse_step=1, partial_rotary_factor=0.25,
        full_attention_interval=4,
    ),
}


class ConfigError(ValueError):
    """A config.json that does not describe a model this service can run."""


@dataclass
class ModelConfig:
    model_type: str  # canonical family: qwen3_moe | qwen3_next | qwen3_5_moe
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    rope_parameters: dict[str, Any]
    layer_types: list[str]
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    attn_output_gate: bool = False
    intermediate_size: int | None = None  # dense-MLP layers (mlp_only_layers / decoder_sparse_step)
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    mtp_num_hidden_layers: int = 0
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    dtype: str | None = None  # checkpoint dtype as written in config.json ("bfloat16", ...)

    # ---- derived -------------------------------------------------------------------------------
    @property
    def is_hybrid(self) -> bool:
        """Qwen3-Next / Qwen3.5: Gated DeltaNet layers beside full attention, zero-centred norms."""
        return self.model_type in _HYBRID

    @property
    def zero_centered_norm(self) -> bool:
        """The hybrid families' RMSNorm computes `x_hat * (1 + w)` (weights stored around 0)."""
        return self.is_hybrid

    @property
    def has_mtp(self) -> bool:
        return self.mtp_num_hidden_layers > 0

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters["rope_theta"])

    @property
    def partial_rotary_factor(self) -> float:
        return float(self.rope_parameters.get("partial_rotary_factor", 1.0))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_kv_layers(self) -> int:
        """Layers holding a KV cache: the full-attention decoder layers plus the MTP layers."""
        return self.layer_types.count(FULL_ATTENTION) + self.mtp_num_hidden_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        """transformers' rule: sparse unless listed in mlp_only_layers or off the sparse step."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read `<path>/config.json` (or `path` itself when it is a file).

        A hybrid config.json that does not declare its MTP layers (Qwen3-Next's does not; vLLM then
        assumes one) gets them from the `mtp.layers.{j}.*` tensors of the checkpoint beside it."""
        p = os.fspath(path)
        if os.path.isdir(p):
            p = os.path.join(p, "config.json")
        try:
            with open(p) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {p!r}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p!r} is not valid JSON: {e}") from None
        cfg = cls.from_dict(d)
        text = d.get("text_config") or d
        if cfg.is_hybrid and "mtp_num_hidden_layers" not in text and "num_nextn_predict_layers" not in text:
            cfg.mtp_num_hidden_layers = _mtp_layers_on_disk(os.path.dirname(p))
        return cfg

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"config must be a dict, got {type(d).__name__}")
        outer_type = d.get("model_type")
        if outer_type == "qwen3_5_moe" and "text_config" in d:
            text = dict(d["text_config"] or {})
            text.setdefault("model_type", "qwen3_5_moe_text")
            # The multimodal wrapper holds the tying flag (and sometimes the token ids).
            for k in ("tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id"):
                if k in d and k not in text:
                    text[k] = d[k]
            d = text
        mtype = d.get("model_type")
        if mtype is None:
            raise ConfigError("config has no 'model_type'")
        family = _FAMILIES.get(mtype)
        if family is None:
            raise ConfigError(f"unsupported model_type {mtype!r} (supported: {sorted(_FAMILIES)})")
        d = dict(d)
        if "num_experts" not in d and "num_local_experts" in d:  # Qwen3MoeConfig's attribute_map
            d["num_experts"] = d["num_local_experts"]
        for k in _REQUIRED + (_REQUIRED_HYBRID if family in _HYBRID else ()):
            if d.get(k) is None:
                raise ConfigError(f"{mtype} config is missing required field {k!r}")
        defaults = _DEFAULTS[family]

        def get(key: str, default: Any = None) -> Any:
            v = d.get(key)
            return defaults.get(key, default) if v is None else v

        if get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act={d['hidden_act']!r} is not supported (only 'silu')")
        if d.get("use_sliding_window"):
            raise ConfigError("use_sliding_window=True is not supported")
        gate = d.get("attn_output_gate")
        if gate is not None and bool(gate) != (family in _HYBRID):
            # transformers hard-wires the gate per family (always on for the hybrids, off for Qwen3-MoE)
            raise ConfigError(f"attn_output_gate={gate!r} is not supported for {mtype}")
        num_layers = int(d["num_hidden_layers"])
        num_heads = int(d["num_attention_heads"])
        head_dim = int(get("head_dim") or d["hidden_size"] // num_heads)
        if num_heads % int(d["num_key_value_heads"]):
            raise ConfigError(
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={d['num_key_value_heads']}"
            )
        rope = _rope_parameters(d, family)
        if family in _HYBRID:
            layer_types = d.get("layer_types")
            if layer_types is None:
                interval = int(get("full_attention_interval"))
                layer_types = [
                    LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)
                ]
        else:
            layer_types = [FULL_ATTENTION] * num_layers
        layer_types = list(layer_types)
        if len(layer_types) != num_layers:
            raise ConfigError(f"layer_types has {len(layer_types)} entries for num_hidden_layers={num_layers}")
        for t in layer_types:
            if t not in (FULL_ATTENTION, LINEAR_ATTENTION):
                raise ConfigError(f"unknown layer type {t!r} in layer_types")
        eos = d.get("eos_token_id")
        eos = [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
        mtp = d.get("mtp_num_hidden_layers", d.get("num_nextn_predict_layers", 0)) or 0
        if d.get("mtp_use_dedicated_embeddings"):
            raise ConfigError("mtp_use_dedicated_embeddings=True is not supported (the MTP head shares the embedding)")
        if mtp and family not in _HYBRID:
            raise ConfigError(f"mtp_num_hidden_layers={mtp} but {mtype} has no MTP head")
        cfg = cls(
            model_type=family,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(d["num_key_value_heads"]),
            head_dim=head_dim,
            num_experts=int(d["num_experts"]),
            num_experts_per_tok=int(d["num_experts_per_tok"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            rope_parameters=rope,
            layer_types=layer_types,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=bool(get("attention_bias", False)),
            attn_output_gate=family in _HYBRID,
            intermediate_size=None if get("intermediate_size") is None else int(get("intermediate_size")),
            shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", 0)),
            # qwen3_5_moe has no norm_topk_prob switch: its router always renormalises.
            norm_topk_prob=True if family == "qwen3_5_moe" else bool(get("norm_topk_prob")),
            decoder_sparse_step=int(get("decoder_sparse_step", 1)),
            mlp_only_layers=[int(i) for i in (d.get("mlp_only_layers") or [])],
            linear_num_key_heads=int(get("linear_num_key_heads", 0)),
            linear_num_value_heads=int(get("linear_num_value_heads", 0)),
            linear_key_head_dim=int(get("linear_key_head_dim", 0)),
            linear_value_head_dim=int(get("linear_value_head_dim", 0)),
            linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)),
            mtp_num_hidden_layers=int(mtp),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=d.get("pad_token_id"),
            dtype=d.get("dtype", d.get("torch_dtype")),
        )
        if family == "qwen3_5_moe" and (cfg.mlp_only_layers or cfg.decoder_sparse_step != 1):
            raise ConfigError("qwen3_5_moe has no dense layers: mlp_only_layers/decoder_sparse_step must be unset")
        if any(not cfg.is_moe_layer(i) for i in range(num_layers)) and not cfg.intermediate_size:
            raise ConfigError(f"{mtype} config has dense layers but no 'intermediate_size'")
        return cfg


def _mtp_layers_on_disk(directory: str) -> int:
    """Number of distinct `mtp.layers.{j}` in the safetensors checkpoint of `directory` (0 if none)."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            keys = list(json.load(f).get("weight_map", {}))
    else:
        keys = []
        for name in sorted(os.listdir(directory)):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(directory, name), framework="pt") as sf:
                    keys.extend(sf.keys())
    return len({m[1] for k in keys if (m := _MTP_LAYER.match(k))})


def _rope_parameters(d: dict[str, Any], family: str) -> dict[str, Any]:
    """transformers 5's standardisation: `rope_parameters` wins, then legacy top-level keys.

    Qwen3-MoE's rotary embedding ignores `partial_rotary_factor` (always full head_dim)."""
    rope = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.pop("type", None)
    rope.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    if family in _HYBRID:
        partial = d.get("partial_rotary_factor")
        default = _DEFAULTS[family]["partial_rotary_factor"]
        rope.setdefault("partial_rotary_factor", default if partial is None else partial)
    else:
        rope["partial_rotary_factor"] = 1.0
    if rope["rope_type"] != "default":
        raise ConfigError(f"rope_type={rope['rope_type']!r} is not supported (only 'default')")
    # Qwen3.5 declares interleaved multimodal RoPE; for text (all three position rows equal) it
    # reduces exactly to plain RoPE, which is what this service computes.
    return rope
