"""MoE dispatch / combine: `comms.DispatchCombine` (DeepEP's Buffer is the anchor).

Two modes:

* ``dp_ep`` (decode): every rank owns its tokens. `dispatch` sends each token once per destination
  rank (not once per expert) with its top-k ids and weights; the receiver packs the rows it got
  into per-local-expert inputs for the grouped GEMM. `combine` reduces each received row over this
  rank's experts (fp32, top-k slot order), sends one partial per (token, rank) back, and the owner
  sums the partials in fp32 in rank order.
* ``replicated`` (prefill): the inputs are identical on every rank (they follow the attention
  all-reduce); `dispatch` selects the local tokens of each local expert without any traffic,
  `combine` sums locally (fp32) and all-reduces.

The semantics, fixed here and matched bit for bit by the fused kernels (`comms.dispatch_fused`):

* received rows are ordered by (source rank, source token); a local expert's packed entries are
  its received rows in that order; in the ``masked`` layout entry p of local expert e is row
  ``e * cap + p`` of ``recv.x`` ([E_local, cap, H]); in the ``contiguous`` layout it is row
  ``offsets[e] + p`` of ``recv.x`` ([rows, H], offsets = exclusive cumsum of counts);
* payload ``"mxfp8"`` (dispatch only): each token is quantized once on its source rank
  (`comms.mxfp8.quantize`: E4M3 values, one E8M0 scale per 32 along hidden) and travels as its
  H + H/32 bytes; ``recv.x`` holds the float8_e4m3fn values and ``recv.scales`` the uint8 scales
  ([E_local, cap, H/32] or [rows, H/32]) in the same packed order. Combine stays in the input dtype
  (expert outputs);
* combine: ``partial[row] = sum_{j local, ascending} w_j * y_j`` in fp32 (mul then add, no FMA),
  rounded to the payload dtype; ``out[t] = sum_{rank ascending, t sent there} partial`` in fp32,
  rounded to the input dtype.

This module holds the API, the pure routing/packing helpers and the torch.distributed reference
(all_to_all_single over gloo or NCCL; any EP size). The kernel path is chosen once, at
construction, from the heap's device; see `DispatchCombine.__init__`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

MODES = ("dp_ep", "replicated")
LAYOUTS = ("masked", "contiguous")
PAYLOADS = ("bf16", "mxfp8")


class DispatchError(RuntimeError):
    """A dispatch/combine kernel reported a failure (peer timeout, capacity overflow)."""


class DispatchTimeoutError(DispatchError):
    """A bounded wait on a peer flag expired: a peer did not arrive in time."""


class CapacityError(DispatchError):
    """More entries reached one local expert than the configured expert capacity."""


# ----------------------------------------------------------------------------- data carriers
@dataclass
class DispatchRecv:
    """What `dispatch` hands to the expert GEMMs.

    x        [E_local, cap, H] (masked) or [rows, H] (contiguous; rows = min(E_local * cap,
             received tokens * min(top_k, E_local))): packed expert inputs; rows past a local
             expert's count hold stale data.
    counts   [E_local] int32: entries per local expert.
    offsets  [E_local + 1] int32: first row of each expert in the flattened rows (masked: e * cap;
             contiguous: exclusive cumsum of counts).
    src_rank [rows] int32: source rank of each packed row (flattened like x's leading dims).
    src_token[rows] int32: token index on the source rank.
    weights  [rows] fp32: the router weight of this (token, expert) pair.
    scales   payload "mxfp8" only: uint8 E8M0 scales, x's leading dims + [H/32] (x is then
             float8_e4m3fn); None for bf16.
    """

    x: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor
    weights: torch.Tensor
    scales: torch.Tensor | None = None


@dataclass
class ReferenceHandle:
    """State `combine` needs from the torch.distributed reference `dispatch`.

    send_counts / recv_counts: rows sent to / received from each rank (dp_ep; host ints).
    recv_ids [N, k] int64 global expert ids of the received rows; recv_weights [N, k] fp32.
    entry_row / entry_slot [M]: received row and top-k slot of each packed entry, in packed order;
    entry_index [M]: the flattened row of recv.x holding that entry.
    """

    num_tokens: int
    send_counts: list[int]
    recv_counts: list[int]
    send_rows: torch.Tensor
    recv_ids: torch.Tensor
    recv_weights: torch.Tensor
    entry_row: torch.Tensor
    entry_slot: torch.Tensor
    entry_index: torch.Tensor


# ----------------------------------------------------------------------------- pure helpers
def check_routing(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, hidden: int,
                  top_k: int, num_experts: int, max_tokens: int) -> None:
    """Raise ValueError naming the bad value when the inputs do not fit the buffer's shape."""
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected [T, hidden={hidden}]")
    if x.shape[0] > max_tokens:
        raise ValueError(f"x has {x.shape[0]} tokens, more than max_tokens_per_rank={max_tokens}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if tuple(t.shape) != (x.shape[0], top_k):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [{x.shape[0]}, top_k={top_k}]")
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_experts):
        bad = int(topk_ids.min()) if int(topk_ids.min()) < 0 else int(topk_ids.max())
        raise ValueError(f"topk_ids holds expert id {bad}, outside [0, num_experts={num_experts})")


def token_rank_mask(topk_ids: torch.Tensor, experts_per_rank: int, world: int) -> torch.Tensor:
    """[T, k] expert ids -> [T, world] bool: does token t have at least one expert on rank r."""
    mask = torch.zeros(topk_ids.shape[0], world, dtype=torch.bool, device=topk_ids.device)
    mask.scatter_(1, topk_ids.long() // experts_per_rank, True)
    return mask


def pack_entries(ids: torch.Tensor, expert_offset: int, num_local: int, cap: int, contiguous: bool):
    """Group the local (row, slot) pairs of `ids` [N, k] by local expert, rows ascending.

    Returns (entry_row [M], entry_slot [M], entry_index [M] flattened destination row,
    counts [E_local] int32, offsets [E_local + 1] int32). Raises CapacityError past `cap`."""
    local = ids.long() - expert_offset  # [N, k]
    is_local = (local >= 0) & (local < num_local)
    row, slot = torch.nonzero(is_local, as_tuple=True)  # row-major: rows ascending
    expert = local[row, slot]
    order = torch.sort(expert, stable=True).indices
    row, slot, expert = row[order], slot[order], expert[order]
    counts = torch.bincount(expert, minlength=num_local).to(torch.int32)
    if counts.numel() and int(counts.max()) > cap:
        e = int(counts.argmax())
        raise CapacityError(f"local expert {e} received {int(counts[e])} entries, more than expert capacity {cap}")
    starts = torch.zeros(num_local + 1, dtype=torch.int64, device=ids.device)
    starts[1:] = torch.cumsum(counts.long(), 0)
    pos = torch.arange(expert.numel(), device=ids.device) - starts[expert]
    if contiguous:
        offsets = starts.to(torch.int32)
    else:
        offsets = (torch.arange(num_local + 1, device=ids.device) * cap).to(torch.int32)
    index = offsets[expert].long() + pos
    return row, slot, index, counts, offsets


def local_partials(expert_out: torch.Tensor, weights: torch.Tensor, entry_row: torch.Tensor,
                   entry_slot: torch.Tensor, entry_index: torch.Tensor, num_rows: int, top_k: int) -> torch.Tensor:
    """sum over the local top-k slots (ascending) of w * y, fp32, mul then add: [num_rows, H] fp32."""
    hidden = expert_out.shape[-1]
    flat = expert_out.reshape(-1, hidden)  # [rows, H]
    acc = torch.zeros(num_rows, hidden, dtype=torch.float32, device=expert_out.device)
    for j in range(top_k):  # slot order, as the kernel adds
        sel = entry_slot == j
        rows, idx = entry_row[sel], entry_index[sel]
        prod = flat[idx].float() * weights[rows, j].float()[:, None]
        acc[rows] = acc[rows] + prod
    return acc


# ----------------------------------------------------------------------------- the API
class DispatchCombine:
    """Pre-sized MoE dispatch/combine for one EP group.

    heap_or_group: a `comms.SymmetricHeap` on CUDA selects the fused CuTeDSL kernels; a
    torch.distributed ProcessGroup (gloo or NCCL), or a heap on CPU, selects the all_to_all
    reference. The choice is made here, once, and logged.
    layout: "masked" ([E_local, cap, H], for decode graphs) or "contiguous" (expert after expert).
    expert_capacity: rows per local expert (default: every token of every rank fits).
    all_reduce: replicated mode's sum (default: comms.AllReduce on a heap, torch.distributed else).
    timeout_s: bound on every wait for a peer inside a kernel.
    pipeline_phases: fused dispatch only; > 1 compiles in the pipelined kernel, which at
        >= `comms.dispatch_fused.PIPE_MIN_TOKENS` tokens sends in that many phases and packs each
        phase while the next one is on the wire (the same results; same value on every rank).
    num_blocks: fused kernels' grid (default: sized per call from the token count,
        `comms.dispatch_fused.auto_blocks`; ranks need not agree). Every block must be resident at
        once; leave SMs free with a smaller grid if other kernels run concurrently.
    """

    def __init__(self, heap_or_group, num_experts: int, top_k: int, hidden: int, max_tokens_per_rank: int,
                 mode: str = "dp_ep", dtype: torch.dtype = torch.bfloat16, payload: str = "bf16", *,
                 layout: str = "masked", expert_capacity: int | None = None, all_reduce=None,
                 timeout_s: float = 10.0, num_blocks: int | None = None, pipeline_phases: int = 1):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}, expected one of {MODES}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r}, expected one of {LAYOUTS}")
        if payload not in PAYLOADS:
            raise ValueError(f"payload={payload!r} is not supported (supported: {PAYLOADS})")
        if payload == "mxfp8" and (hidden % 32 or dtype != torch.bfloat16):
            raise ValueError(f"payload='mxfp8' needs bf16 inputs and hidden % 32 == 0 (hidden={hidden}, "
                             f"dtype={dtype})")
        group = getattr(heap_or_group, "group", heap_or_group)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if num_experts % self.world:
            raise ValueError(f"num_experts={num_experts} is not divisible by the EP size {self.world}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        if hidden <= 0 or hidden % 8:
            raise ValueError(f"hidden={hidden} must be a positive multiple of 8 (16-byte rows)")
        if max_tokens_per_rank <= 0:
            raise ValueError(f"max_tokens_per_rank={max_tokens_per_rank} must be positive")
        self.group, self.mode, self.layout = group, mode, layout
        self.num_experts, self.top_k, self.hidden = num_experts, top_k, hidden
        self.max_tokens, self.dtype, self.payload = max_tokens_per_rank, dtype, payload
        self.pipeline_phases = pipeline_phases
        self.num_local = num_experts // self.world
        self.expert_offset = self.rank * self.num_local
        rows_in = max_tokens_per_rank * (self.world if mode == "dp_ep" else 1)
        self.cap = rows_in if expert_capacity is None else int(expert_capacity)
        if not 1 <= self.cap:
            raise ValueError(f"expert_capacity={expert_capacity} must be positive")
        # packed rows: masked E_local * cap; contiguous at most one row per (received token, local slot)
        self.packed_rows = self.num_local * self.cap
        if layout == "contiguous":
            self.packed_rows = min(self.packed_rows, rows_in * min(top_k, self.num_local))
        self._all_reduce = all_reduce
        self._fused = None
        device = getattr(heap_or_group, "device", None)
        if mode == "replicated" and all_reduce is None and hasattr(heap_or_group, "peer_ptrs"):
            from comms.allreduce import AllReduce  # a heap: sum the partials through comms.AllReduce

            itemsize = torch.empty((), dtype=dtype).element_size()
            self._all_reduce = AllReduce(heap_or_group, max_bytes=max_tokens_per_rank * hidden * itemsize,
                                         timeout_s=timeout_s)
        if mode == "dp_ep" and device is not None and torch.device(device).type == "cuda":
            from comms.dispatch_fused import FusedDispatch

            self._fused = FusedDispatch(heap_or_group, self, timeout_s, num_blocks)
        backend = "fused-cutedsl" if self._fused else (
            "local+" + ("comms.AllReduce" if self._all_reduce is not None else "torch.distributed.all_reduce")
            if mode == "replicated" else "torch.distributed.all_to_all")
        log.info("DispatchCombine: mode=%s layout=%s payload=%s backend=%s world=%d experts=%d top_k=%d "
                 "hidden=%d max_tokens=%d cap=%d", mode, layout, payload, backend, self.world, num_experts, top_k,
                 hidden, max_tokens_per_rank, self.cap)

    @staticmethod
    def heap_size_hint(world: int, num_experts: int, top_k: int, hidden: int, max_tokens_per_rank: int,
                       payload: str = "bf16", pipeline_phases: int = 1) -> int:
        """Bytes of symmetric heap the fused dp_ep path allocates (size the heap with this)."""
        from comms.dispatch_fused import heap_bytes

        return heap_bytes(world, num_experts, top_k, hidden, max_tokens_per_rank, payload, pipeline_phases)

    # ------------------------------------------------------------------ public
    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        """x [T, H], topk_ids [T, k] (global expert ids), topk_weights [T, k] -> (DispatchRecv, handle)."""
        if self._fused is not None:
            return self._fused.dispatch(x, topk_ids, topk_weights)
        check_routing(x, topk_ids, topk_weights, self.hidden, self.top_k, self.num_experts, self.max_tokens)
        if self.mode == "replicated":
            return self._dispatch_replicated(x, topk_ids, topk_weights)
        return self._dispatch_a2a(x, topk_ids, topk_weights)

    def combine(self, expert_out: torch.Tensor, handle) -> torch.Tensor:
        """expert_out shaped like recv.x -> [T, H] on the owning rank: sum_k w_k * expert_k(x)."""
        if self._fused is not None:
            return self._fused.combine(expert_out, handle)
        if not isinstance(handle, ReferenceHandle):
            raise TypeError(f"handle is a {type(handle).__name__}, expected ReferenceHandle")
        if expert_out.shape[-1] != self.hidden:
            raise ValueError(f"expert_out has shape {tuple(expert_out.shape)}, expected [..., hidden={self.hidden}]")
        if self.mode == "replicated":
            return self._combine_replicated(expert_out, handle)
        return self._combine_a2a(expert_out, handle)

    def destroy(self) -> None:
        """Free the kernel buffers (the heap itself belongs to the caller)."""
        if hasattr(self._all_reduce, "destroy"):
            self._all_reduce.destroy()
        if self._fused is not None:
            self._fused.destroy()
            self._fused = None

    def check(self) -> None:
        """Raise the error a fused kernel recorded (timeout, capacity); synchronises the device."""
        if self._fused is not None:
            self._fused.check()

    # ------------------------------------------------------------------ reference: dp_ep
    def _alloc_recv(self, device, width: int, dtype: torch.dtype) -> torch.Tensor:
        lead = (self.num_local, self.cap) if self.layout == "masked" else (self.packed_rows,)
        return torch.empty(*lead, width, dtype=dtype, device=device)

    def _payload_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Token rows as they travel: x itself (bf16), or the MXFP8 bytes [T, H + H/32] uint8."""
        if self.payload == "bf16":
            return x
        from comms import mxfp8

        q, scale = mxfp8.quantize(x)
        return torch.cat([q.view(torch.uint8), scale], dim=1)

    def _pack(self, rows_x, ids, weights, src_rank, src_token):
        """rows_x: received rows as `_payload_rows` made them."""
        row, slot, index, counts, offsets = pack_entries(
            ids, self.expert_offset, self.num_local, self.cap, self.layout == "contiguous")
        nrows, H = self.packed_rows, self.hidden
        scales = None
        if self.payload == "bf16":
            x = self._alloc_recv(rows_x.device, H, self.dtype)
            x.view(nrows, H)[index] = rows_x[row].to(self.dtype)
        else:  # index assignment on uint8 views (float8 lacks it on some CPU builds)
            x = self._alloc_recv(rows_x.device, H, torch.float8_e4m3fn)
            scales = self._alloc_recv(rows_x.device, H // 32, torch.uint8)
            x.view(torch.uint8).view(nrows, H)[index] = rows_x[row, :H]
            scales.view(nrows, H // 32)[index] = rows_x[row, H:]
        meta_rank = torch.full((nrows,), -1, dtype=torch.int32, device=rows_x.device)
        meta_token = torch.full((nrows,), -1, dtype=torch.int32, device=rows_x.device)
        meta_w = torch.zeros(nrows, dtype=torch.float32, device=rows_x.device)
        meta_rank[index] = src_rank[row].to(torch.int32)
        meta_token[index] = src_token[row].to(torch.int32)
        meta_w[index] = weights[row, slot].float()
        recv = DispatchRecv(x, counts, offsets, meta_rank, meta_token, meta_w, scales)
        return recv, row, slot, index

    def _dispatch_a2a(self, x, topk_ids, topk_weights):
        T, R = x.shape[0], self.world
        mask = token_rank_mask(topk_ids, self.num_local, R)  # [T, R]
        dest, tok = torch.nonzero(mask.t(), as_tuple=True)  # ordered by dest rank, then token
        send_counts = torch.bincount(dest, minlength=R)
        recv_counts_t = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts_t, send_counts, group=self.group)
        send_counts, recv_counts = send_counts.tolist(), recv_counts_t.tolist()
        n = sum(recv_counts)
        k = self.top_k
        meta = torch.empty(tok.numel(), 2 * k + 1, dtype=torch.float64, device=x.device)
        meta[:, :k] = topk_ids[tok].double()  # exact for ids < 2**53
        meta[:, k:2 * k] = topk_weights[tok].double()  # fp32 -> fp64 exact
        meta[:, 2 * k] = tok.double()
        rows = self._payload_rows(x)  # quantized once per token, sent once per destination rank
        recv_x = torch.empty(n, rows.shape[1], dtype=rows.dtype, device=x.device)
        recv_meta = torch.empty(n, 2 * k + 1, dtype=torch.float64, device=x.device)
        dist.all_to_all_single(recv_x, rows[tok].contiguous(), recv_counts, send_counts, group=self.group)
        dist.all_to_all_single(recv_meta, meta, recv_counts, send_counts, group=self.group)
        ids = recv_meta[:, :k].long()
        weights = recv_meta[:, k:2 * k].float()
        src_token = recv_meta[:, 2 * k].long()
        src_rank = torch.repeat_interleave(torch.arange(R, device=x.device), recv_counts_t.to(x.device))
        recv, row, slot, index = self._pack(recv_x, ids, weights, src_rank, src_token)
        handle = ReferenceHandle(T, send_counts, recv_counts, tok, ids, weights, row, slot, index)
        return recv, handle

    def _combine_a2a(self, expert_out, h: ReferenceHandle):
        n = sum(h.recv_counts)
        partial = local_partials(expert_out, h.recv_weights, h.entry_row, h.entry_slot, h.entry_index,
                                 n, self.top_k).to(self.dtype)  # [N, H]: payload rounding
        back = torch.empty(sum(h.send_counts), self.hidden, dtype=self.dtype, device=expert_out.device)
        dist.all_to_all_single(back, partial, h.send_counts, h.recv_counts, group=self.group)
        out = torch.zeros(h.num_tokens, self.hidden, dtype=torch.float32, device=expert_out.device)
        start = 0
        for r, c in enumerate(h.send_counts):  # rank order, as the kernel sums
            rows = h.send_rows[start:start + c]
            out[rows] = out[rows] + back[start:start + c].float()
            start += c
        return out.to(self.dtype)

    # ------------------------------------------------------------------ reference: replicated
    def _dispatch_replicated(self, x, topk_ids, topk_weights):
        T = x.shape[0]
        src_token = torch.arange(T, device=x.device)
        src_rank = torch.full((T,), self.rank, device=x.device)
        recv, row, slot, index = self._pack(self._payload_rows(x), topk_ids, topk_weights, src_rank, src_token)
        handle = ReferenceHandle(T, [T], [T], src_token, topk_ids.long(), topk_weights.float(), row, slot, index)
        return recv, handle

    def _combine_replicated(self, expert_out, h: ReferenceHandle):
        partial = local_partials(expert_out, h.recv_weights, h.entry_row, h.entry_slot, h.entry_index,
                                 h.num_tokens, self.top_k)  # [T, H] fp32
        if self._all_reduce is not None:
            return self._all_reduce(partial.to(self.dtype))
        dist.all_reduce(partial, group=self.group)
        return partial.to(self.dtype)
