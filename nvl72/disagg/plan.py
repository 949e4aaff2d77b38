"""Transfer plans: which slices of a prefill instance's caches go where on the decode side.

Caches (per layer, `nvl72.model.batch.ModelCaches`):
  kv        [pages, 2, kv_heads, page_size, head_dim]   HND pages, sharded on the head axis (2)
  conv      [slots, conv_dim, kernel - 1]               GDN conv tail; channels are [q | k | v],
                                                        each segment head-sharded on its own
  recurrent [slots, v_heads, k_dim, v_dim]              GDN state, sharded on the head axis (1)

Sharding rule (vLLM's): with TP `t` over `n` heads, rank r holds heads [r*n/t, (r+1)*n/t) when
t <= n, and head r // (t/n) (a replica) when t > n. A plan copies every head a decode rank needs
exactly once, from one holder (replicas are spread over the decode ranks), so TP4 -> TP1, TP2 -> TP1
and TP4 -> TP2 (and replicated KV heads) all reduce to ranges along one axis of one page or slot.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

KINDS = ("kv", "conv", "recurrent")
AXIS = {"kv": 2, "conv": 1, "recurrent": 1}  # sharded axis of each per-layer cache tensor


class TransferPlanError(ValueError):
    """A transfer that cannot be planned (TP does not divide heads, page lists differ ...)."""


@dataclass(frozen=True)
class Segment:
    units: int  # heads in this segment
    unit_size: int  # elements along the sharded axis per head


@dataclass(frozen=True)
class CacheLayout:
    """The full (unsharded) model's cache heads, enough to shard and to plan transfers."""

    kv_heads: int
    gdn_k_heads: int = 0
    gdn_v_heads: int = 0
    gdn_k_dim: int = 0
    gdn_v_dim: int = 0

    @classmethod
    def from_config(cls, cfg) -> CacheLayout:
        """From anything with the Hugging Face field names (`nvl72.config.ModelConfig`, `plan.ModelSpec`)."""
        if not cfg.linear_num_value_heads:
            return cls(cfg.num_key_value_heads)
        return cls(cfg.num_key_value_heads, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                   cfg.linear_key_head_dim, cfg.linear_value_head_dim)

    @property
    def hybrid(self) -> bool:
        return self.gdn_v_heads > 0

    def segments(self, kind: str) -> list[Segment]:
        if kind == "kv":
            return [Segment(self.kv_heads, 1)]
        if kind == "recurrent":
            return [Segment(self.gdn_v_heads, 1)]
        if kind == "conv":
            return [Segment(self.gdn_k_heads, self.gdn_k_dim), Segment(self.gdn_k_heads, self.gdn_k_dim),
                    Segment(self.gdn_v_heads, self.gdn_v_dim)]
        raise TransferPlanError(f"unknown cache kind {kind!r}; expected one of {KINDS}")

    def kinds(self) -> tuple[str, ...]:
        return KINDS if self.hybrid else ("kv",)


def head_range(units: int, tp: int, rank: int) -> tuple[int, int]:
    """Heads [lo, hi) that TP rank `rank` of `tp` holds."""
    if tp <= 0 or not 0 <= rank < tp:
        raise TransferPlanError(f"TP rank {rank} is outside TP size {tp}")
    if tp <= units:
        if units % tp:
            raise TransferPlanError(f"TP {tp} does not divide {units} heads")
        per = units // tp
        return rank * per, (rank + 1) * per
    if tp % units:
        raise TransferPlanError(f"TP {tp} is larger than {units} heads and not a multiple of it")
    u = rank // (tp // units)
    return u, u + 1


def _holders(units: int, tp: int, head: int) -> list[int]:
    """TP ranks holding `head` (more than one when heads are replicated)."""
    return [r for r in range(tp) if head_range(units, tp, r)[0] <= head < head_range(units, tp, r)[1]]


def local_map(segments: Sequence[Segment], tp: int, rank: int) -> list[tuple[int, int, int]]:
    """(global_lo, global_hi, local_lo) element ranges of the sharded axis held by `rank`."""
    out, g0, l0 = [], 0, 0
    for s in segments:
        lo, hi = head_range(s.units, tp, rank)
        out.append((g0 + lo * s.unit_size, g0 + hi * s.unit_size, l0))
        g0 += s.units * s.unit_size
        l0 += (hi - lo) * s.unit_size
    return out


def shard(full: torch.Tensor, kind: str, layout: CacheLayout, tp: int, rank: int) -> torch.Tensor:
    """The part of a full per-layer cache tensor that TP rank `rank` holds (a copy)."""
    axis = AXIS[kind]
    parts = [full.narrow(axis, g_lo, g_hi - g_lo) for g_lo, g_hi, _ in local_map(layout.segments(kind), tp, rank)]
    return torch.cat(parts, dim=axis).contiguous()


@dataclass(frozen=True)
class Copy:
    """Copy `length` elements of the sharded axis of one page/slot from a prefill TP rank to a decode
    TP rank (offsets are local to each rank's shard)."""

    kind: str
    src_rank: int
    src_index: int  # page (kv) or state slot (conv, recurrent) on the prefill rank
    src_lo: int
    dst_rank: int
    dst_index: int
    dst_lo: int
    length: int


def axis_copies(segments: Sequence[Segment], src_tp: int, dst_tp: int) -> list[tuple[int, int, int, int, int]]:
    """(src_rank, src_lo, dst_rank, dst_lo, length) covering every decode rank's shard once; runs of
    heads from one source are merged into one range."""
    out: list[list[int]] = []
    src_base = [0] * src_tp
    dst_base = [0] * dst_tp
    for s in segments:
        for d in range(dst_tp):
            lo, hi = head_range(s.units, dst_tp, d)
            for h in range(lo, hi):
                holders = _holders(s.units, src_tp, h)
                src = holders[d % len(holders)]  # spread replicas over the decode ranks
                s_lo = src_base[src] + (h - head_range(s.units, src_tp, src)[0]) * s.unit_size
                d_lo = dst_base[d] + (h - lo) * s.unit_size
                last = out[-1] if out else None
                if last and last[0] == src and last[2] == d and last[1] + last[4] == s_lo and last[3] + last[4] == d_lo:
                    last[4] += s.unit_size
                else:
                    out.append([src, s_lo, d, d_lo, s.unit_size])
            dst_base[d] += (hi - lo) * s.unit_size
        for r in range(src_tp):
            lo, hi = head_range(s.units, src_tp, r)
            src_base[r] += (hi - lo) * s.unit_size
    return [tuple(c) for c in out]


@dataclass(frozen=True)
class TransferPlan:
    """All copies of one request's caches; the same copies apply to every layer of a kind."""

    src_tp: int
    dst_tp: int
    copies: tuple[Copy, ...]

    def pairs(self) -> list[tuple[int, int]]:
        return sorted({(c.src_rank, c.dst_rank) for c in self.copies})

    def between(self, src: int, dst: int, kind: str) -> list[Copy]:
        return [c for c in self.copies if c.src_rank == src and c.dst_rank == dst and c.kind == kind]

    def apply_local(self, src: Sequence[dict[str, list[torch.Tensor | None]]],
                    dst: Sequence[dict[str, list[torch.Tensor | None]]]) -> None:
        """Execute in one process: src[r][kind][layer] are prefill rank r's caches, dst likewise.
        The reference semantics of every transport."""
        for c in self.copies:
            axis = AXIS[c.kind] - 1  # the page/slot dimension is indexed away
            for s_t, d_t in zip(src[c.src_rank][c.kind], dst[c.dst_rank][c.kind], strict=True):
                if s_t is None:
                    continue
                d_t[c.dst_index].narrow(axis, c.dst_lo, c.length).copy_(s_t[c.src_index].narrow(axis, c.src_lo, c.length))


def build_transfer_plan(layout: CacheLayout, src_tp: int, dst_tp: int, src_pages: Sequence[int],
                        dst_pages: Sequence[int], src_slot: int | None = None, dst_slot: int | None = None) -> TransferPlan:
    """Plan one request: its KV pages (same count and page size on both sides) and, for hybrid models,
    its GDN state slot."""
    if len(src_pages) != len(dst_pages):
        raise TransferPlanError(f"prefill sends {len(src_pages)} pages but decode allocated {len(dst_pages)}")
    if layout.hybrid and (src_slot is None or dst_slot is None):
        raise TransferPlanError(f"hybrid model: state slots are required (src_slot={src_slot}, dst_slot={dst_slot})")
    copies: list[Copy] = []
    for kind in layout.kinds():
        ax = axis_copies(layout.segments(kind), src_tp, dst_tp)
        index_pairs = list(zip(src_pages, dst_pages)) if kind == "kv" else [(src_slot, dst_slot)]
        for si, di in index_pairs:
            copies += [Copy(kind, s, si, s_lo, d, di, d_lo, n) for s, s_lo, d, d_lo, n in ax]
    return TransferPlan(src_tp, dst_tp, tuple(copies))
