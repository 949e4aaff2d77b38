"""The fused DP-EP dispatch/combine path: host side of `comms.kernels.dispatch` on a CUDA heap.

`DispatchCombine` builds a `FusedDispatch` when it is given a `comms.SymmetricHeap` on a CUDA
device in ``dp_ep`` mode. Everything is allocated here, once: heap regions (sized for
`max_tokens_per_rank`), the packed expert inputs and their metadata, and a pinned error word.
`dispatch` and `combine` launch one kernel each on the current stream with no host sync, so both
can be captured in a CUDA graph; results live in the pre-allocated buffers and stay valid until
the next `dispatch`. The grid is chosen per call (`blocks_for`): every block arrives by itself and
each source adds ARRIVAL_STEP per epoch whatever its block count, so ranks need not agree on it.
Errors (a peer past `timeout_s`, expert capacity overflow) are recorded by the kernels in the error
word; `check()` synchronises and raises them. After a timeout the protocol state in the heap (epochs,
counters, partials left in combine's buffer) no longer matches the peers': build a new one.

Kernels come from the ahead-of-time bundle (`aot.function`, `nvl72 kernels build`); without one,
aot JIT-compiles them with CuTeDSL as its logged development path.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

import aot
from aot.launch import pdl_enabled
from comms.dispatch import CapacityError, DispatchError, DispatchRecv, DispatchTimeoutError

log = logging.getLogger(__name__)

# mirrors of comms.kernels.dispatch (that module imports CuTeDSL, absent on bundle-only hosts)
CHUNK_BYTES = 2048
MAX_WORLD, MAX_LOCAL, MAX_PAIRS = 128, 512, 1024
COUNT_MASK = 0xFFFF  # table counts share a word with the epoch tag: max_tokens at most this
TOPK_VARIANTS = (1, 2, 4, 6, 8, 10)
THREADS, PROBE_PHASES = 256, 8
ARRIVAL_STEP = 1024  # arrival counter units per source and epoch: bounds the grid
PIPE_MAX = 8  # pipelined dispatch: phases at most
PIPE_MIN_TOKENS = 512  # pipelined dispatch: calls with fewer tokens send in one phase (latency)
PIPE_SEND_WARPS = 2  # pipelined dispatch: warps per block sending while the others pack (a guess until timed)
# unpipelined dispatch: from this many tokens the tables go first and own rows are packed while the
# sends are on the wire (one more arrival and wait, a few us); below it one arrival and wait (latency)
OVERLAP_MIN_TOKENS = 512
# programmatic dependent launch per kernel (where aot.launch.pdl_enabled allows it). The combine
# waits for the dispatch but does not let the next kernel launch early: a dispatch launched early
# behind a combine cost ~30 us a pair at 4096 tokens on 2 x H200 (not explained); with the combine's
# trigger at its end both kernels gain from PDL (128 tokens: dispatch 11.8-13.0 us against 12.2-13.7
# launched plainly; perf/RESULTS.md)
DISPATCH_PDL, COMBINE_PDL = True, True
DISPATCH_PHASES = ("start", "tables sent", "tables waited", "tables built", "rows sent", "rows waited", "packed")
COMBINE_PHASES = ("start", "done")
_ERR_KINDS = {1: "dispatch wait", 2: "combine wait", 3: "capacity"}
SENTINEL = -1  # an empty rx / cx word (comms.kernels.dispatch.SENTINEL)
REGION_ALIGN = 256


@dataclass
class FusedHandle:
    """What `combine` needs from the fused `dispatch`: the token count and this rank's routing
    (int32 [T, K]; the kernels keep the rest in the heap and in `row_pos`)."""

    num_tokens: int
    topk_ids: torch.Tensor


def staged_row_bytes(hidden: int, payload: str) -> int:
    """Bytes one token row takes in flight (rx): bf16 values, or MXFP8 values then scales."""
    return hidden * 2 if payload == "bf16" else hidden + hidden // 32


def heap_regions(world: int, num_experts: int, top_k: int, hidden: int, max_tokens: int,
                 payload: str = "bf16", phases: int = 1) -> list[tuple[str, int]]:
    """(name, bytes) of the kernels' heap regions in allocation order (see comms.kernels.dispatch);
    `phases`: the pipelined dispatch's send phases at most (1: not pipelined). dcnt holds 1 + phases
    counters per source: the tables arrival, then the rows arrival of each send phase."""
    rows, L = world * max_tokens, num_experts // world
    return [("rx", rows * staged_row_bytes(hidden, payload)), ("rid", rows * top_k * 4), ("rw", rows * top_k * 4),
            ("rslot", rows * top_k * 4), ("rstamp", rows * 4), ("rntok", 2 * world * 4),
            ("recnt", 2 * world * L * 4),
            ("dcnt", (1 + phases) * world * 4), ("cx", rows * hidden * 2), ("state", 16),
            ("rnph", world * 4)]


def heap_bytes(world: int, num_experts: int, top_k: int, hidden: int, max_tokens: int,
               payload: str = "bf16", phases: int = 1) -> int:
    """Symmetric-heap bytes one fused DispatchCombine takes (with REGION_ALIGN-byte region alignment)."""
    return sum(-(-n // REGION_ALIGN) * REGION_ALIGN
               for _, n in heap_regions(world, num_experts, top_k, hidden, max_tokens, payload, phases))


def auto_blocks(world: int, num_experts: int, hidden: int, tokens: int, sms: int) -> int:
    """Grid for `tokens` tokens on this rank: one 2 KiB work unit per warp in the receive phases
    (about world * tokens rows arrive), at least one warp per global expert for the slot scan, at
    most one block per SM. Small batches get small grids: fewer blocks to launch, fence and count."""
    warps = THREADS // 32
    units = world * tokens * (hidden * 2 // CHUNK_BYTES)
    return max(1, min(sms, max(-(-units // warps), -(-num_experts // warps))))


class FusedDispatch:
    def __init__(self, heap, cfg, timeout_s: float, nblocks: int | None = None):
        R, M, K, H, L = cfg.world, cfg.max_tokens, cfg.top_k, cfg.hidden, cfg.num_local
        if cfg.dtype != torch.bfloat16:
            raise ValueError(f"dtype={cfg.dtype}: the fused kernels move bf16")
        if H % (CHUNK_BYTES // 2):
            raise ValueError(f"hidden={H} must be a multiple of {CHUNK_BYTES // 2} for the fused kernels")
        if K not in TOPK_VARIANTS:
            raise ValueError(f"top_k={K} has no compiled kernel (compiled: {TOPK_VARIANTS})")
        if R > MAX_WORLD or L > MAX_LOCAL or R * L > MAX_PAIRS:
            raise ValueError(f"world={R}, local experts={L} exceed the kernel tables "
                             f"(<= {MAX_WORLD} ranks, {MAX_LOCAL} local experts, {MAX_PAIRS} pairs)")
        if M > COUNT_MASK:
            raise ValueError(f"max_tokens={M} exceeds the kernel tables' counts (<= {COUNT_MASK})")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be positive")
        if not 1 <= cfg.pipeline_phases <= PIPE_MAX:
            raise ValueError(f"pipeline_phases={cfg.pipeline_phases} must be in [1, {PIPE_MAX}]")
        if cfg.pipeline_phases > 1 and cfg.payload != "bf16":
            # the pipelined MXFP8 kernel packed rows of the wrong tokens on 2 x H200 (2026-11-22T06:30Z,
            # tests/comms/test_dispatch_gpu.py) while the bf16 one is exact: off until that is found
            raise ValueError(f"pipeline_phases={cfg.pipeline_phases} with payload={cfg.payload!r}: the pipelined "
                             "dispatch is bf16 only for now")
        self.cfg, self.heap, self.device = cfg, heap, torch.device(heap.device)
        self.timeout_ns = int(timeout_s * 1e9)
        rows = R * M
        self.off = {name: heap.alloc(nbytes, align=REGION_ALIGN)
                    for name, nbytes in heap_regions(R, cfg.num_experts, K, H, M, cfg.payload, cfg.pipeline_phases)}
        # combine's cx and the bf16 staged rows rx start empty (every word the sentinel; their readers empty
        # what they read), before any peer can write them: peers write only after a dispatch that needs
        # this rank's arrival (the tables' for rx, the rows' for cx)
        heap.buffer(self.off["cx"], (rows * H // 2,), torch.int32).fill_(SENTINEL)
        if cfg.payload == "bf16":
            heap.buffer(self.off["rx"], (rows * H // 2,), torch.int32).fill_(SENTINEL)
        torch.cuda.synchronize(self.device)
        heap.barrier()
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.set_blocks(nblocks)
        nrows = cfg.packed_rows
        kw = dict(device=self.device)
        fp8 = cfg.payload == "mxfp8"
        self.out_x = torch.empty(nrows, H, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, **kw)
        self.out_s = torch.empty(nrows, H // 32, dtype=torch.uint8, **kw) if fp8 else None
        self.counts = torch.zeros(L, dtype=torch.int32, **kw)
        self.offsets = torch.zeros(L + 1, dtype=torch.int32, **kw)
        self.o_rank = torch.full((nrows,), -1, dtype=torch.int32, **kw)
        self.o_tok = torch.full((nrows,), -1, dtype=torch.int32, **kw)
        self.o_w = torch.zeros(nrows, dtype=torch.float32, **kw)
        self.row_pos = torch.zeros(rows * K, dtype=torch.int32, **kw)
        self.rstart = torch.zeros(R + 1, dtype=torch.int32, **kw)  # received rows' starts per source
        self.err = torch.zeros(1, dtype=torch.int32).pin_memory()  # written by the kernels (UVA)
        lead = (L, cfg.cap) if cfg.layout == "masked" else (nrows,)
        self.recv_x = self.out_x.view(*lead, H)
        self.recv_s = self.out_s.view(*lead, H // 32) if fp8 else None
        # the kernel takes the E4M3 bits as uint8 (its export has no float8 tensor type)
        self._outs = ((self.out_x.view(torch.uint8), self.out_s) if fp8 else (self.out_x, self.out_x)) + (self.rstart,)
        # From the ahead-of-time bundle (NVL72_KERNEL_BUNDLE); JIT only as aot's logged development path.
        self.maxp = cfg.pipeline_phases
        self.phases = None  # send phases of later calls: None = phases_for(tokens); see set_phases
        self.overlap = None  # tables first, own rows packed while sending; see set_overlap
        self.send_warps = PIPE_SEND_WARPS
        self.pdl = (None, None)  # (dispatch, combine) launch with PDL; None: DISPATCH_PDL / COMBINE_PDL
        name = "dispatch_" + ("mxfp8_" if fp8 else "") + ("pipe_" if self.maxp > 1 else "") + f"k{K}"
        self._dispatch = aot.function("comms.kernels.dispatch", name)
        self._combine = aot.function("comms.kernels.dispatch", f"combine_k{K}")
        o = self.off
        self._dargs = (heap.peer_ptrs, cfg.rank, R, L, M, cfg.cap, int(cfg.layout == "contiguous"), o["rx"],
                       o["rid"], o["rw"], o["rslot"], o["rstamp"], o["rntok"], o["recnt"], o["dcnt"], o["state"],
                       self.err.data_ptr(), self.timeout_ns)
        self._cargs = (heap.peer_ptrs, cfg.rank, R, L, M, o["rid"], o["rw"], o["rstamp"], o["cx"], o["state"],
                       self.err.data_ptr(), self.timeout_ns)
        self.probes = None  # (dispatch, combine) int64 [SMs, PROBE_PHASES] stamp buffers, see enable_probes
        log.info("fused dispatch: %s blocks, heap used %.1f MiB, packed rows %d", self.nblocks or "auto",
                 heap.used / 2**20, nrows)

    def set_blocks(self, nblocks: int | None) -> None:
        """Grid of later calls: a fixed block count, or None to size it per call (`auto_blocks`).
        Takes effect at the next launch (a captured graph keeps the grid it was captured with)."""
        if nblocks is not None and not 1 <= nblocks <= min(self.sms, ARRIVAL_STEP):
            raise ValueError(f"nblocks={nblocks} must be in [1, {min(self.sms, ARRIVAL_STEP)}] "
                             "(one co-resident block per SM)")
        self.nblocks = nblocks

    def set_phases(self, phases: int | None, send_warps: int | None = None) -> None:
        """Send phases of later calls (pipelined buffers only): a fixed count in [1, pipeline_phases],
        or None for `phases_for`. Ranks may differ; each tells its receivers. `send_warps`: warps per
        block that send the next phase while the others pack (0: all send, then all pack)."""
        if phases is not None and not 1 <= phases <= self.maxp:
            raise ValueError(f"phases={phases} must be in [1, pipeline_phases={self.maxp}]")
        if send_warps is not None and not 0 <= send_warps < THREADS // 32:
            raise ValueError(f"send_warps={send_warps} must be in [0, {THREADS // 32 - 1}]")
        self.phases = phases
        if send_warps is not None:
            self.send_warps = send_warps

    def phases_for(self, tokens: int) -> int:
        """Send phases of a call: one below PIPE_MIN_TOKENS tokens (a phase costs an arrival and a
        wait), else pipeline_phases."""
        if self.phases is not None:
            return self.phases
        return self.maxp if tokens >= PIPE_MIN_TOKENS else 1

    def set_overlap(self, overlap: bool | None) -> None:
        """Dispatch of later calls: True exchanges the tables first and packs own rows while the sends
        are on the wire (pipelined: each send phase packs its own rows), False sends before the first
        wait (unpipelined: one arrival and one wait), None picks by `overlap_for`. Ranks may differ
        (the kernels' protocol allows any mix, with any send phase counts)."""
        if overlap not in (None, True, False):
            raise ValueError(f"overlap={overlap!r} must be True, False or None")
        self.overlap = overlap

    def set_pdl(self, dispatch: bool | None = None, combine: bool | None = None) -> None:
        """Programmatic dependent launch of later dispatch / combine launches: False launches plainly,
        True with PDL where `aot.launch.pdl_enabled` allows it (True cannot force PDL where the stream
        or device has none), None as DISPATCH_PDL / COMBINE_PDL. For measuring what PDL does to each
        kernel."""
        for v in (dispatch, combine):
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"pdl={v!r} must be True, False or None")
        self.pdl = (dispatch, combine)

    def _pdl(self, which: int) -> int:
        on = (DISPATCH_PDL, COMBINE_PDL)[which] if self.pdl[which] is None else self.pdl[which]
        return int(on and pdl_enabled(self.device))

    def overlap_for(self, tokens: int) -> bool:
        """Overlap from OVERLAP_MIN_TOKENS tokens (the extra arrival and wait cost a few us)."""
        if self.overlap is not None:
            return self.overlap
        return tokens >= OVERLAP_MIN_TOKENS

    def blocks_for(self, tokens: int) -> int:
        c = self.cfg
        return self.nblocks or auto_blocks(c.world, c.num_experts, c.hidden, tokens, self.sms)

    def enable_probes(self, on: bool = True) -> None:
        """Phase stamps (%globaltimer per block and phase boundary) of later launches; see phase_times."""
        self.probes = tuple(torch.zeros(self.sms, PROBE_PHASES, dtype=torch.int64, device=self.device)
                            for _ in range(2)) if on else None

    def phase_times(self) -> dict[str, list[tuple[str, float]]]:
        """Per kernel of the last probed dispatch and combine: (phase, us after the dispatch's first
        block started), the latest block's time at each boundary ("start": the last block's start,
        i.e. launch spread); the combine also has "first", its first block's start, so the gap
        between the kernels shows."""
        torch.cuda.synchronize(self.device)
        out, t0 = {}, None
        for kind, names, buf in (("dispatch", DISPATCH_PHASES, self.probes[0]),
                                 ("combine", COMBINE_PHASES, self.probes[1])):
            st = buf[buf[:, 0] != 0, :len(names)].cpu()  # blocks of the last launch (zeroed before it)
            if not st.numel():
                out[kind] = [(n, float("nan")) for n in names]
                continue
            t0 = int(st[:, 0].min()) if t0 is None else t0
            first = [("first", (int(st[:, 0].min()) - t0) / 1e3)] if kind == "combine" else []
            out[kind] = first + [(n, (int(st[:, i].max()) - t0) / 1e3) for i, n in enumerate(names)]
        return out

    def _probe(self, i: int) -> int:
        if self.probes is None:
            return 0
        self.probes[i].zero_()
        return self.probes[i].data_ptr()

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        cfg = self.cfg
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != cfg.hidden or not x.is_contiguous():
            raise ValueError(f"x must be a contiguous bf16 [T, {cfg.hidden}] tensor, got {x.dtype} {tuple(x.shape)}")
        if x.shape[0] > cfg.max_tokens:
            raise ValueError(f"x has {x.shape[0]} tokens, more than max_tokens_per_rank={cfg.max_tokens}")
        if tuple(topk_ids.shape) != (x.shape[0], cfg.top_k) or tuple(topk_weights.shape) != tuple(topk_ids.shape):
            raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} "
                             f"must be [{x.shape[0]}, top_k={cfg.top_k}]")
        ids = topk_ids.to(torch.int32).contiguous()
        w = topk_weights.to(torch.float32).contiguous()
        T = x.shape[0]
        self._dispatch(x, ids, w, *self._outs, self.counts, self.offsets, self.o_rank, self.o_tok, self.o_w,
                       self.row_pos, *self._dargs, self._probe(0), self.off["rnph"], self.maxp, self.phases_for(T),
                       self.send_warps, int(self.overlap_for(T)), self.blocks_for(T), self._pdl(0))
        recv = DispatchRecv(self.recv_x, self.counts, self.offsets, self.o_rank, self.o_tok, self.o_w, self.recv_s)
        return recv, FusedHandle(x.shape[0], ids)

    def combine(self, expert_out: torch.Tensor, handle: FusedHandle) -> torch.Tensor:
        if not isinstance(handle, FusedHandle):
            raise TypeError(f"handle is a {type(handle).__name__}, expected FusedHandle")
        H = self.cfg.hidden
        if expert_out.dtype != torch.bfloat16 or expert_out.numel() != self.out_x.numel():  # bf16 either payload
            raise ValueError(f"expert_out must be bf16 shaped like recv.x {tuple(self.recv_x.shape)}, "
                             f"got {expert_out.dtype} {tuple(expert_out.shape)}")
        y = expert_out.reshape(-1, H)  # [rows, H]
        out = torch.empty(handle.num_tokens, H, dtype=torch.bfloat16, device=self.device)
        self._combine(y, handle.topk_ids, out, self.row_pos, self.rstart, *self._cargs, self._probe(1),
                      self.blocks_for(handle.num_tokens), self._pdl(1))
        return out

    def check(self) -> None:
        torch.cuda.synchronize(self.device)
        code = int(self.err[0])
        if code == 0:
            return
        kind, detail = code >> 16, code & 0xFFFF
        what = _ERR_KINDS.get(kind, f"unknown error {code}")
        if kind == 3:
            raise CapacityError(f"local expert {detail} got more entries than expert capacity {self.cfg.cap}")
        if kind in (1, 2):
            raise DispatchTimeoutError(f"{what}: rank {detail} did not arrive within "
                                       f"{self.timeout_ns / 1e9:.3g} s (rank {self.cfg.rank})")
        raise DispatchError(what)

    def destroy(self) -> None:
        """Drop the buffers; the heap regions stay with the heap (freed by heap.destroy())."""
        self.out_x = self.recv_x = self.out_s = self.recv_s = None
        self._outs = ()
        self._dispatch = self._combine = None
