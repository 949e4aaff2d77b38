"""Pure-torch reference ops for the MoE layer (the semantics every kernel must match)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router in fp32, top-k, optional renormalisation.

    router_logits [T, E] -> (topk_weights [T, k] fp32, topk_ids [T, k] int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """sum_k w_k * down(silu(gate(x)) * up(x)) over the experts held here.

    x [T, H]; topk_* [T, k]; w13 [E_local, 2I, H]; w2 [E_local, H, I]. Experts outside
    [expert_offset, expert_offset + E_local) contribute nothing (another rank holds them)."""
    num_local, two_i, _ = w13.shape
    inter = two_i // 2
    out = torch.zeros_like(x)
    local_ids = topk_ids - expert_offset
    for e in range(num_local):
        tok, slot = torch.nonzero(local_ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w13[e].t()  # [n, 2I]
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = h @ w2[e].t()  # [n, H]
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].to(y.dtype))
    return out
