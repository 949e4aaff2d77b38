"""Random paged-attention batches for the backend tests: ragged query/context lengths, shuffled pages."""
from __future__ import annotations

import torch

from nvl72.model.batch import ForwardBatch


def random_batch(qlens: list[int], ctx: list[int], page_size: int, hq: int, hkv: int, d: int, dtype, device,
                 seed: int = 0, spare_pages: int = 3):
    """(batch, kv_cache, q, k, v): sequence i has ctx[i] cached tokens and qlens[i] new ones.

    The cache holds random values everywhere (the new tokens' slots too, so a missing write shows)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx, qlens)]
    need = [-(-s // page_size) for s in seq_lens]
    total = sum(need) + spare_pages
    perm = torch.randperm(total, generator=g).tolist()
    width = max(need + [1])
    table = torch.full((len(qlens), width), -1, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        at += n
    pos = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx, qlens)]) if qlens else torch.zeros(0)
    cu = torch.tensor([0] + qlens).cumsum(0).to(torch.int32)
    t = int(cu[-1])
    batch = ForwardBatch(
        input_ids=torch.zeros(t, dtype=torch.long).to(device),
        positions=pos.long().to(device),
        query_start_loc=cu.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        page_table=table.to(device),
        max_query_len=max(qlens, default=0),
    )
    kv = torch.randn(total, 2, hkv, page_size, d, generator=g).to(dtype).to(device)
    q = torch.randn(t, hq, d, generator=g).to(dtype).to(device)
    k = torch.randn(t, hkv, d, generator=g).to(dtype).to(device)
    v = torch.randn(t, hkv, d, generator=g).to(dtype).to(device)
    return batch, kv, q, k, v


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def active_splits(seq_lens: torch.Tensor, splits: int, block_n: int) -> torch.Tensor:
    """The splits holding keys of one-token sequences of `seq_lens` keys, as attend_block counts them
    (`active`, from fused_triton.split_chunk) and the consumer of its SplitPartials must."""
    chunk = (((seq_lens + splits - 1) // splits + block_n - 1) // block_n * block_n).clamp_min(block_n)
    return ((seq_lens + chunk - 1) // chunk).clamp_min(1)


def combine_partials(p) -> torch.Tensor:
    """fp32 [T, Hq, D] of a one-token `fused_triton.SplitPartials` (one sequence a token): each row's
    output from its sequence's active splits (exp(m_j - max m) weights), `out` where the attention
    wrote it (one active split, or more than `leave`). The reference of the consumer's combine."""
    active = active_splits(p.seq_lens.long(), p.splits, p.block_n)  # [T]
    res = p.out.float().clone()
    for t, a in enumerate(active.tolist()):
        if 1 < a <= p.leave:
            m, l, o = p.ml[t, :, :a, 0], p.ml[t, :, :a, 1], p.acc[t, :, :a].float()  # [Hq, a] / [Hq, a, D]
            w = torch.exp(m - m.max(1, keepdim=True).values) * l
            res[t] = (o * w[..., None]).sum(1) / w.sum(1)[:, None]
    return res
