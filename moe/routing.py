"""Permutation of routed (token, slot) pairs into expert-major order, and back.

Two layouts for the grouped GEMMs:
  * contiguous (prefill): the rows of each local expert are consecutive, each expert's segment
    padded to a multiple of `align` (the GEMM's M tile) so that every M tile belongs to one expert;
    `tile_expert[i]` names the expert of tile i (-1: an unused tile, skipped by the GEMM).
  * masked (decode): a fixed-capacity [E_local, cap, H] buffer; expert e's rows are
    [e*cap, e*cap + counts[e]); the GEMM skips tiles past counts[e].
Pairs routed to experts held by another EP rank get row -1 and contribute nothing here.

Index arithmetic here is plain torch (a stable sort), the same on CPU and GPU; the FP8 decode path
uses the one-kernel equivalent of `permute_masked` (moe.kernels.triton_moe). The data movement
(gather + quantize, weighted un-permute) is in the backends' ops (moe/backend.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Permutation:
    """Where each routed pair lives in the grouped buffer.

    row_of [T, k] int64: row of pair (t, j) in the grouped buffer, -1 if not a local expert.
    token_of [M] int64: source token of each grouped row, -1 for padding rows (None from the
      kernel permutation of moe.kernels.triton_moe, whose users never read it).
    counts [E_local] int64 (int32 from the kernel permutation): pairs per local expert.
    tile_expert [M / align] int32 (contiguous) or None (masked).
    """

    layout: str
    row_of: torch.Tensor
    token_of: torch.Tensor | None
    counts: torch.Tensor
    num_rows: int
    align: int
    tile_expert: torch.Tensor | None = None
    capacity: int = 0


def _ranks(topk_ids: torch.Tensor, num_local: int, expert_offset: int):
    """Local expert of every flat pair (num_local = not here), its rank inside its expert, counts."""
    local = topk_ids.reshape(-1) - expert_offset  # [T*k]
    local = torch.where((local >= 0) & (local < num_local), local, torch.full_like(local, num_local))
    order = torch.argsort(local, stable=True)  # pairs in expert-major order
    counts_all = torch.zeros(num_local + 1, dtype=local.dtype, device=local.device)  # [E_local + 1]
    counts_all.scatter_add_(0, local, torch.ones_like(local))  # bincount without its host sync on CUDA
    starts = torch.cumsum(counts_all, 0) - counts_all
    rank = torch.empty_like(local)
    rank[order] = torch.arange(local.numel(), device=local.device) - starts[local[order]]
    return local, rank, counts_all[:num_local]


def permute_contiguous(topk_ids: torch.Tensor, num_local: int, expert_offset: int = 0, align: int = 128) -> Permutation:
    """topk_ids [T, k] -> Permutation in the contiguous layout; M = sum_e roundup(counts[e], align)."""
    if align <= 0:
        raise ValueError(f"align={align} must be positive")
    t, k = topk_ids.shape
    local, rank, counts = _ranks(topk_ids, num_local, expert_offset)
    padded = (counts + align - 1) // align * align  # [E_local]
    pstart = torch.cumsum(padded, 0) - padded
    num_rows = int(padded.sum())
    valid = local < num_local
    row = torch.where(valid, pstart[local.clamp(max=num_local - 1)] + rank, torch.full_like(rank, -1))
    token_of = torch.full((num_rows,), -1, dtype=torch.int64, device=topk_ids.device)
    pair_token = torch.arange(t * k, device=topk_ids.device) // k
    token_of[row[valid]] = pair_token[valid]
    tiles = padded // align  # [E_local]
    tile_expert = torch.repeat_interleave(torch.arange(num_local, device=topk_ids.device), tiles).to(torch.int32)
    return Permutation("contiguous", row.view(t, k), token_of, counts, num_rows, align, tile_expert=tile_expert)


def permute_masked(topk_ids: torch.Tensor, num_local: int, capacity: int, expert_offset: int = 0) -> Permutation:
    """topk_ids [T, k] -> Permutation in the masked layout [E_local, capacity] (rows e*cap + rank).

    Raises ValueError when an expert receives more than `capacity` pairs. With capacity >= T no
    expert can (a token's k experts are distinct) and the check, a host sync, is skipped."""
    t, k = topk_ids.shape
    local, rank, counts = _ranks(topk_ids, num_local, expert_offset)
    if capacity < t:
        worst = int(counts.max()) if counts.numel() else 0
        if worst > capacity:
            raise ValueError(f"capacity={capacity} is below the busiest expert's count {worst}")
    valid = local < num_local
    row = torch.where(valid, local * capacity + rank, torch.full_like(rank, -1))
    # Pairs held elsewhere write one spare row, cut off after: no boolean-mask indexing, hence no
    # host sync (decode steps run inside CUDA graphs).
    spare = num_local * capacity
    token_of = torch.full((spare + 1,), -1, dtype=torch.int64, device=topk_ids.device)
    pair_token = torch.arange(t * k, device=topk_ids.device) // k
    token_of[torch.where(valid, row, spare)] = pair_token
    token_of = token_of[:spare]
    return Permutation("masked", row.view(t, k), token_of, counts, num_local * capacity, 1, capacity=capacity)
