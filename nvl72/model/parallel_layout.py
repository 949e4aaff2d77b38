"""How one rank's model is cut: tensor parallelism over a TP group, experts over EP ranks.

`ParallelLayout` is what `build_model(..., parallel=...)` takes. The default is one rank (no
communication, the full model). With `tp_size > 1` (the prefill instance: TP attention and EP
experts over the same ranks, inputs replicated on every rank):

- attention: q heads split across the TP ranks (column-parallel q/k/v, the gate rows of gated
  attention travel with their heads), `o_proj` row-parallel. KV heads are split when
  `tp_size <= num_key_value_heads`, else replicated: each rank keeps the one KV head its q heads
  use (`kv_heads`), and its KV cache holds only that rank's heads.
- Gated DeltaNet: key heads (and their value-head groups) split; row-parallel `out_proj`.
- dense MLP and shared expert: intermediate split (column gate/up, row down), on every TP rank.
- routed experts: by expert id over `ep_size` ranks, and each expert's intermediate over the
  `tp_size // ep_size` ranks that share an expert slice (`expert_tp_rank/size`).
- embedding, router, norms and lm_head replicated (no vocab-parallel head).
The decoder layer sums the partial outputs with `reduce` right after the token mixer and after the
MLP/MoE (two all-reduces per layer, visible in `DecoderLayer.forward`).

With `tp_size == 1` and `ep_size > 1` (DP attention, EP experts) the MoE returns only its experts'
contribution and the caller combines (dispatch/combine); `reduce` is then the identity. With
`dispatch` set (a dp_ep `comms.DispatchCombine` over the EP group, see `nvl72.model.dp_ep`) the
decoder layers do that themselves: each rank's own tokens go to the experts' owners and back.
"""
from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nvl72.parallel import CollectiveTimeout


class LayoutError(ValueError):
    """A layout that cannot cut this model (head counts not divisible, bad ranks ...)."""


class GroupAllReduce:
    """Sum over a torch.distributed group (gloo on CPU, NCCL on GPU) in fp32, rounded once to the
    input dtype (the semantics of `comms.AllReduce`), bounded by `timeout` seconds."""

    def __init__(self, group: dist.ProcessGroup | None, timeout: float):
        if timeout <= 0:
            raise LayoutError(f"timeout={timeout}: must be positive seconds")
        self.group, self.timeout = group, timeout

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(torch.float32, copy=True)
        work = dist.all_reduce(y, group=self.group, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as e:
            raise CollectiveTimeout(f"TP all-reduce of {tuple(x.shape)} did not complete within "
                                    f"{self.timeout:g} s: {e}") from e
        return y.to(x.dtype)


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in the TP group and among the EP ranks, and the TP group's all-reduce.

    all_reduce: x [...] -> sum of x over the TP group (same shape and dtype), e.g.
    `GroupAllReduce(group, timeout)` or a `comms.AllReduce`; required when tp_size > 1.
    dispatch: a `comms.DispatchCombine` in dp_ep mode over the EP group (DP attention + EP; TP 1):
    MoE layers route, dispatch, run local experts and combine (`nvl72.model.dp_ep`)."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    dispatch: object | None = None

    def __post_init__(self):
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise LayoutError(f"tp_rank={self.tp_rank}, tp_size={self.tp_size}: need 0 <= tp_rank < tp_size")
        if self.ep_size < 1 or not 0 <= self.ep_rank < self.ep_size:
            raise LayoutError(f"ep_rank={self.ep_rank}, ep_size={self.ep_size}: need 0 <= ep_rank < ep_size")
        if self.dispatch is not None:
            d = self.dispatch
            if self.tp_size != 1:
                raise LayoutError(f"tp_size={self.tp_size} with dispatch: DP+EP decode ranks run TP 1")
            if getattr(d, "mode", None) != "dp_ep" or (d.rank, d.world) != (self.ep_rank, self.ep_size):
                raise LayoutError(f"dispatch (mode={getattr(d, 'mode', None)!r}, rank {getattr(d, 'rank', None)} of "
                                  f"{getattr(d, 'world', None)}) must be dp_ep over the EP group "
                                  f"(ep_rank={self.ep_rank}, ep_size={self.ep_size})")
        if self.tp_size > 1:
            if self.all_reduce is None:
                raise LayoutError(f"tp_size={self.tp_size} needs an all_reduce over the TP group")
            if self.tp_size % self.ep_size:
                raise LayoutError(f"ep_size={self.ep_size} must divide tp_size={self.tp_size} (experts are "
                                  "split over the TP group; DP-EP decode with TP goes through dispatch/combine)")
            if self.ep_rank != self.tp_rank // self.expert_tp_size:
                raise LayoutError(f"ep_rank={self.ep_rank} != tp_rank // (tp_size // ep_size) = "
                                  f"{self.tp_rank // self.expert_tp_size}")

    @classmethod
    def from_group(cls, group: dist.ProcessGroup, *, ep_size: int | None = None,
                   timeout: float = 60.0) -> "ParallelLayout":
        """TP over `group` (this rank's place in it), experts over `ep_size` ranks of it (default:
        all of them, the prefill instance's TP = EP)."""
        tp_size, tp_rank = dist.get_world_size(group), dist.get_rank(group)
        ep_size = tp_size if ep_size is None else ep_size
        if ep_size < 1 or tp_size % ep_size:
            raise LayoutError(f"ep_size={ep_size} must divide the group size {tp_size}")
        return cls(tp_rank, tp_size, tp_rank // (tp_size // ep_size), ep_size,
                   GroupAllReduce(group, timeout) if tp_size > 1 else None)

    @property
    def expert_tp_size(self) -> int:
        """Ranks that split each routed expert's intermediate (1 when EP covers the TP group)."""
        return self.tp_size // self.ep_size if self.tp_size > 1 else 1

    @property
    def expert_tp_rank(self) -> int:
        return self.tp_rank % self.expert_tp_size

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the TP ranks' partial outputs (identity on one rank)."""
        return x if self.tp_size == 1 else self.all_reduce(x)

    def split(self, total: int, what: str, size: int | None = None, rank: int | None = None) -> tuple[int, int]:
        """(offset, count) of this rank's contiguous share of `total` items over `size` ranks
        (default: the TP group)."""
        size = self.tp_size if size is None else size
        rank = self.tp_rank if rank is None else rank
        if total % size:
            raise LayoutError(f"{what}={total} is not divisible by {size} ranks")
        n = total // size
        return rank * n, n

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank keeps: a split when tp_size <= num_kv_heads,
        else the single head its q heads read (replicated on tp_size // num_kv_heads ranks)."""
        if self.tp_size <= num_kv_heads:
            return self.split(num_kv_heads, "num_key_value_heads")
        if self.tp_size % num_kv_heads:
            raise LayoutError(f"tp_size={self.tp_size} is neither a divisor nor a multiple of "
                              f"num_key_value_heads={num_kv_heads}")
        return self.tp_rank // (self.tp_size // num_kv_heads), 1


SINGLE = ParallelLayout()
