"""Device ops of the attention path, as pure-torch references.

Each function here is the semantics a GPU kernel must reproduce, with the signature that kernel
will share (CPU runs these; tests compare kernels against them on random data). Numerics follow
transformers: norms reduce in fp32, RoPE tables are built in fp32 then cast to the activation
dtype, attention softmax runs in fp32.

KV pages are HND: `kv_cache` [num_pages, 2, kv_heads, page_size, head_dim] (K then V), so one
page of one head is a contiguous [page_size, head_dim] tile that KV transfer can slice by head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nvl72.model.batch import ForwardBatch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """RMSNorm over the last dim. x [..., D], weight [D] -> [..., D] in x.dtype.

    Standard (Qwen3-MoE): `w * x_hat.to(dtype)`. Zero-centred (Qwen3-Next/3.5): `(x_hat * (1 + w)).to(dtype)`
    with the product in fp32 (the two families round at different points; this keeps both exact)."""
    xf = x.float()
    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (x_hat * (1.0 + weight.float())).to(x.dtype)
    return weight * x_hat.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int64, inv_freq [R/2] fp32 -> (cos, sin) [T, R] in `dtype` (halves repeated)."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, R/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, R]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style (rotate-half) RoPE on the first R dims of each head; the rest pass through.

    x [T, heads, D], cos/sin [T, R] with R <= D -> [T, heads, D]."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    out = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((out, x_pass), dim=-1) if rot < x.shape[-1] else out


@dataclass
class SeqAttention:
    """One sequence's share of a forward: its query rows, context pages and causal mask."""

    start: int  # rows start:end of q are this sequence's new tokens
    end: int
    pages: torch.Tensor  # [ceil(n / page_size)] int64 page ids holding its n context tokens
    masked: torch.Tensor  # [L, n] bool, True where key position > query position


@dataclass
class DecodeGroup:
    """All single-token queries of a forward, attended in one padded batch (no per-sequence loop)."""

    rows: torch.Tensor  # [Bd] int64 rows of q
    pages: torch.Tensor  # [Bd, P] int64 page ids (padding points at page 0 and is masked)
    masked: torch.Tensor  # [Bd, P * page_size] bool, True where key position > query position


@dataclass
class AttentionMetadata:
    """Per-forward attention indexing, built once (one host sync) and shared by every layer."""

    batch: ForwardBatch
    page_size: int
    slot_mapping: torch.Tensor  # [T] int64: page_id * page_size + offset of each new token
    seqs: list[SeqAttention]  # sequences with two or more new tokens (prefill chunks, verify steps)
    decode: DecodeGroup | None  # sequences with exactly one new token

    @classmethod
    def build(cls, batch: ForwardBatch, page_size: int) -> "AttentionMetadata":
        qsl, seq_lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
        width = batch.page_table.shape[1] * page_size
        if seq_lens and max(seq_lens) > width:
            raise ValueError(
                f"seq_len {max(seq_lens)} needs more pages than page_table holds ({batch.page_table.shape[1]} x {page_size})"
            )
        qlens = batch.query_lens().long()  # [B]
        seq_of_token = torch.repeat_interleave(torch.arange(batch.num_seqs, device=qlens.device), qlens)  # [T]
        pos = batch.positions.long()
        pages = batch.page_table.long()[seq_of_token, pos // page_size]  # [T]
        if bool((pages < 0).any()):
            bad = int(torch.nonzero(pages < 0)[0, 0])
            raise ValueError(
                f"token {bad} at position {int(pos[bad])} has no KV page (page_table entry -1) in its sequence"
            )
        seqs, single = [], []
        for i, n in enumerate(seq_lens):
            s, e = qsl[i], qsl[i + 1]
            if e - s == 1:
                single.append(i)
            elif e > s:
                key_pos = torch.arange(n, device=pos.device)
                seqs.append(SeqAttention(
                    s, e, batch.page_table[i, : (n + page_size - 1) // page_size].long(),
                    key_pos[None, :] > pos[s:e, None],  # [L, n]
                ))
        decode = None
        if single:
            idx = torch.tensor(single, device=pos.device)
            rows = batch.query_start_loc.long()[idx]  # [Bd]
            width = (max(seq_lens[i] for i in single) + page_size - 1) // page_size
            key_pos = torch.arange(width * page_size, device=pos.device)
            decode = DecodeGroup(
                rows=rows,
                pages=batch.page_table[idx, :width].long().clamp(min=0),  # [Bd, P]
                masked=key_pos[None, :] > pos[rows, None],  # [Bd, P * ps]
            )
        return cls(batch=batch, page_size=page_size, slot_mapping=pages * page_size + pos % page_size,
                   seqs=seqs, decode=decode)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V in their pages, in place.

    kv_cache [P, 2, Hkv, page_size, D]; k, v [T, Hkv, D]; slot_mapping [T] (page * page_size + offset)."""
    page_size = kv_cache.shape[3]
    pages, offs = slot_mapping // page_size, slot_mapping % page_size
    kv_cache[pages, 0, :, offs] = k.to(kv_cache.dtype)  # advanced dims first: [T, Hkv, D]
    kv_cache[pages, 1, :, offs] = v.to(kv_cache.dtype)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal GQA attention of each sequence's new tokens over its whole context in the pages.

    q [T, Hq, D] -> [T, Hq, D]. A query at position p sees keys 0..p of its own sequence (cached
    prefix and this step's tokens, which `write_kv` has already stored)."""
    num_kv_heads = kv_cache.shape[2]
    groups = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    d = meta.decode
    if d is not None:
        bd, hd = d.rows.shape[0], q.shape[2]
        kv = kv_cache[d.pages]  # [Bd, P, 2, Hkv, ps, D]
        kv = kv.permute(2, 0, 3, 1, 4, 5).flatten(3, 4)  # [2, Bd, Hkv, N, D]
        qd = q[d.rows].view(bd, num_kv_heads, groups, hd)  # query head h reads kv head h // groups
        scores = torch.matmul(qd, kv[0].transpose(-1, -2)) * scale  # [Bd, Hkv, G, N]
        scores = scores.masked_fill(d.masked[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[d.rows] = torch.matmul(probs, kv[1]).view(bd, -1, hd)  # [Bd, Hq, D]
    for sq in meta.seqs:
        n = sq.masked.shape[1]
        kv = kv_cache[sq.pages]  # [np, 2, Hkv, ps, D]
        kv = kv.permute(1, 2, 0, 3, 4).flatten(2, 3)[:, :, :n]  # [2, Hkv, n, D]
        k = kv[0].repeat_interleave(groups, dim=0)  # [Hq, n, D]
        v = kv[1].repeat_interleave(groups, dim=0)
        qi = q[sq.start : sq.end].transpose(0, 1)  # [Hq, L, D]
        scores = torch.matmul(qi, k.transpose(1, 2)) * scale  # [Hq, L, n]
        scores = scores.masked_fill(sq.masked[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[sq.start : sq.end] = torch.matmul(probs, v).transpose(0, 1)  # [L, Hq, D]
    return out
