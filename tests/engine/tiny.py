"""Tiny dummy-weight models and helpers shared by the engine tests."""
from __future__ import annotations

import functools

import torch

from nvl72.config import ModelConfig
from nvl72.engine.engine import EngineConfig, LLMEngine
from nvl72.engine.protocol import AddRequest, SamplingParams
from nvl72.model.loader import build_model, init_dummy_weights

VOCAB = 96
_BASE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, rms_norm_eps=1e-6,
             max_position_embeddings=512, eos_token_id=[0])
CONFIGS = {
    "qwen3_moe": dict(_BASE, model_type="qwen3_moe"),
    "qwen3_next": dict(_BASE, model_type="qwen3_next", num_hidden_layers=4, shared_expert_intermediate_size=32,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                       linear_value_head_dim=8, linear_conv_kernel_dim=4, mtp_num_hidden_layers=1,
                       full_attention_interval=2, head_dim=16),
}


def build_tiny(family: str, device="cpu"):
    """fp32 model with random weights large enough that greedy continuations vary; the same
    weights on every device (drawn on the CPU, then moved before any forward)."""
    model = build_model(ModelConfig.from_dict(CONFIGS[family]), torch.float32, "cpu")
    init_dummy_weights(model, seed=1, std=0.3)
    return model.to(device)


@functools.cache
def tiny_model(family: str):
    return build_tiny(family)


def make_engine(family: str, drafter=None, model=None, **kw) -> LLMEngine:
    cfg = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, page_size=4, num_pages=96)
    cfg.update(kw)
    return LLMEngine(model or tiny_model(family), EngineConfig(**cfg), drafter=drafter, eos_token_ids=[])


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 30) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(1, VOCAB, (m,), generator=g).tolist() for m in lens]


def run_all(engine: LLMEngine, reqs: list[list[int]], params: SamplingParams | None = None, *, max_steps=10_000):
    """Submit every prompt, step to completion; returns {request_id: (tokens, finish_reason, cached)}."""
    params = params or SamplingParams(max_tokens=12, temperature=0.0)
    for i, p in enumerate(reqs):
        engine.add_request(AddRequest(f"r{i}", p, params))
    return drain(engine, max_steps=max_steps)


def drain(engine: LLMEngine, *, max_steps=10_000):
    res: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            r = res.setdefault(o.request_id, [[], None, 0])
            r[0].extend(o.new_token_ids)
            r[1], r[2] = o.finish_reason, o.num_cached_tokens
    else:
        raise TimeoutError(f"engine still busy after {max_steps} steps")
    return {k: tuple(v) for k, v in res.items()}
