"""Tiny random Qwen MoE checkpoints written by transformers, and a paged-cache driver for our model.

`save_tiny(family, path)` builds transformers' own CausalLM for a tiny config, gives every weight
a random value (norm weights included, so a wrong norm convention shows), saves it with
`save_pretrained` and returns the HF model as the reference. `PagedRunner` plays the engine:
shuffled page ids per sequence, GDN state slots, mixed prefill/decode batches.
"""
from __future__ import annotations

import random

import torch
import transformers

from nvl72.model.batch import ForwardBatch

PAGE_SIZE = 4

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
_HYBRID = dict(
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    shared_expert_intermediate_size=48,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
)
CONFIGS = {
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(_COMMON, num_hidden_layers=3, head_dim=16, norm_topk_prob=True, mlp_only_layers=[1], intermediate_size=96),
    ),
    "qwen3_next": (
        transformers.Qwen3NextConfig,
        transformers.Qwen3NextForCausalLM,
        dict(_COMMON, **_HYBRID, num_hidden_layers=4, mlp_only_layers=[2], intermediate_size=96),
    ),
    "qwen3_5_moe": (
        transformers.Qwen3_5MoeTextConfig,
        transformers.Qwen3_5MoeForCausalLM,
        dict(_COMMON, **_HYBRID, num_hidden_layers=4),
    ),
}


def hf_config(family: str, **overrides):
    cfg_cls, _, kw = CONFIGS[family]
    return cfg_cls(**{**kw, **overrides})


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Random weights with O(1) activations: matrices N(0, 0.08), norms around their identity."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(1.0, 8.0, generator=g).log())
            elif leaf == "dt_bias":
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                # zero-centred norms are stored around 0, the plain ones around 1
                base = 0.0 if float(p.mean()) < 0.5 else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


def save_tiny(family: str, path, seed: int = 0, **overrides):
    """Write a random tiny checkpoint of `family` to `path`; returns the fp32 HF reference model."""
    _, model_cls, _ = CONFIGS[family]
    cfg = hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg).float().eval()
    randomize_(model, seed)
    model.save_pretrained(path)
    return model


@torch.no_grad()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """Full-sequence logits [L, V] of the transformers reference."""
    return model(torch.tensor([tokens])).logits[0].float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


class PagedRunner:
    """Drives our model like the engine: page tables over shuffled page ids, one GDN slot per sequence."""

    def __init__(self, model, num_pages: int = 128, num_slots: int = 8, seed: int = 0):
        self.model = model
        self.caches = model.allocate_caches(num_pages, PAGE_SIZE, num_slots)
        rng = random.Random(seed)
        self.free_pages = list(range(num_pages))
        rng.shuffle(self.free_pages)
        self.free_slots = list(range(num_slots))
        rng.shuffle(self.free_slots)
        self.pages: dict[int, list[int]] = {}
        self.cached: dict[int, int] = {}
        self.slot: dict[int, int] = {}

    def batch(self, chunks: list[tuple[int, list[int]]]) -> ForwardBatch:
        """chunks: (seq_id, new token ids); a new seq_id starts a sequence."""
        ids, pos, qsl, lens, tables, read, write = [], [], [0], [], [], [], []
        for sid, toks in chunks:
            if sid not in self.cached:
                self.cached[sid], self.pages[sid], self.slot[sid] = 0, [], self.free_slots.pop()
            start = self.cached[sid]
            n = start + len(toks)
            while len(self.pages[sid]) * PAGE_SIZE < n:
                self.pages[sid].append(self.free_pages.pop())
            ids += toks
            pos += range(start, n)
            qsl.append(qsl[-1] + len(toks))
            lens.append(n)
            tables.append(list(self.pages[sid]))
            read.append(self.slot[sid])
            write += [-1] * (len(toks) - 1) + [self.slot[sid]]
            self.cached[sid] = n
        width = max(len(t) for t in tables)
        dev = self.model.device
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            page_table=torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            state_read_slots=torch.tensor(read, dtype=torch.int64, device=dev),
            state_write_slots=torch.tensor(write, dtype=torch.int64, device=dev),
        )

    @torch.no_grad()
    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """One forward; returns each chunk's logits [len, V] (on the CPU)."""
        b = self.batch(chunks)
        logits = self.model.compute_logits(self.model(b, self.caches)).cpu()
        qsl = b.query_start_loc.tolist()
        return [logits[qsl[i] : qsl[i + 1]] for i in range(len(chunks))]
