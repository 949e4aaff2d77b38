"""Triton kernels for the MoE data path (routing, masked permutation, permute + quantize,
SiLU-and-mul + quantize, weighted un-permute with the gated shared expert added in place).

Each function has the signature of its reference in moe/reference.py. The power-of-two scale
exponent is computed from the bits of the block's amax exactly as moe.mxfp8.scale_exponent does,
so quantized values match the reference bit for bit (up to the fp32 rounding of SiLU's exp).
Size arguments that change from step to step are not specialised on (`do_not_specialize`), so
serving does not compile a variant per divisibility class mid-run. Every kernel takes `PDL`
(programmatic dependent launch, `aot.pdl`): with it, it waits for the previous kernel first thing
and then lets the next one launch (none of their inputs is a weight). Imported only where Triton and
a CUDA device exist (the GPU backends in moe/backend.py), and by the tests under Triton's CPU
interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from aot.pdl import launch_args, wait_prior

BLOCK_K = 128


@triton.jit
def _pow2_scale(amax):
    """(2^s, 2^-s) for s = ceil(log2(amax / 448)) clamped to [-126, 126] (bit formula)."""
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    s = e - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    s = tl.where(amax > 0, s, -126)
    s = tl.minimum(tl.maximum(s, -126), 126)
    scale = ((s + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - s) << 23).to(tl.float32, bitcast=True)
    return scale, inv


@triton.jit
def _quant_store(v, q_ptr, s_ptr, row, kb0, ncols, nkb, rows_per_batch, KBP: tl.constexpr, BLOCK: tl.constexpr):
    """Quantize K-blocks kb0 .. kb0 + KBP - 1 of one row (v [KBP, BLOCK] fp32), one scale per block
    at [row // R, kb, row % R]; blocks past nkb are masked."""
    kb = kb0 + tl.arange(0, KBP)
    cols = kb[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    amax = tl.max(tl.abs(v), axis=1)
    scale, inv = _pow2_scale(amax)
    q = (v * inv[:, None]).to(tl.float8e4nv)
    tl.store(q_ptr + row.to(tl.int64) * ncols + cols, q, mask=cols < ncols)
    batch = row // rows_per_batch
    r = row % rows_per_batch
    tl.store(s_ptr + (batch.to(tl.int64) * nkb + kb) * rows_per_batch + r, scale, mask=kb < nkb)


@triton.jit(do_not_specialize=["rows_per_batch"])
def _gather_quant_kernel(x_ptr, row_ptr, q_ptr, s_ptr, H, nkb, rows_per_batch, K: tl.constexpr, KBP: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (pair, j): K-blocks j * KBP .. of the pair's token row, into its grouped row."""
    wait_prior(PDL)
    pair = tl.program_id(0)
    kb0 = tl.program_id(1) * KBP
    row = tl.load(row_ptr + pair)
    if row >= 0:
        tok = pair // K
        cols = (kb0 + tl.arange(0, KBP))[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        v = tl.load(x_ptr + tok.to(tl.int64) * H + cols, mask=cols < H, other=0.0)
        _quant_store(v.to(tl.float32), q_ptr, s_ptr, row, kb0, H, nkb, rows_per_batch, KBP, BLOCK)


@triton.jit
def _gather_quant_mx_kernel(
    x_ptr, row_ptr, q_ptr, sf_ptr, H, rows_per_batch, rows_pad, cols_pad, K: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr
):
    """MXFP8 for Blackwell: 4 blocks of 32 per program, scales written in the 128 x 4 swizzle."""
    wait_prior(PDL)
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    row = tl.load(row_ptr + pair)
    if row >= 0:
        tok = pair // K
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + tok.to(tl.int64) * H + cols, mask=cols < H, other=0.0).to(tl.float32)
        v2 = tl.reshape(v, (BLOCK // 32, 32))
        amax = tl.max(tl.abs(v2), axis=1)  # [BLOCK / 32]
        bits = amax.to(tl.int32, bitcast=True)
        s = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        s = tl.minimum(tl.maximum(s, -127), 127)
        byte = tl.where(amax > 0, s + 127, 0)
        sc = tl.minimum(tl.maximum(s, -126), 126)
        inv = ((127 - sc) << 23).to(tl.float32, bitcast=True)
        q = tl.reshape(v2 * inv[:, None], (BLOCK,)).to(tl.float8e4nv)
        tl.store(q_ptr + row.to(tl.int64) * H + cols, q, mask=cols < H)
        b = row // rows_per_batch
        r = row % rows_per_batch
        c = chunk * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
        off = (
            b.to(tl.int64) * rows_pad * cols_pad
            + ((r // 128) * (cols_pad // 4) + c // 4) * 512
            + (r % 32) * 16
            + ((r % 128) // 32) * 4
            + c % 4
        )
        tl.store(sf_ptr + off, byte.to(tl.uint8), mask=c < H // 32)


@triton.jit(do_not_specialize=["rows_per_batch"])
def _silu_mul_quant_kernel(
    h_ptr, row_ptr, q_ptr, s_ptr, inter, nkb, rows_per_batch, BY_PAIR: tl.constexpr, KBP: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """Program (i, j): K-blocks j * KBP .. of row i, or with BY_PAIR of the row of routed pair i (-1:
    none here), so that a masked layout's work is the routed rows, not E x capacity."""
    wait_prior(PDL)
    if BY_PAIR:
        row = tl.load(row_ptr + tl.program_id(0))
    else:
        row = tl.program_id(0).to(tl.int64)
    kb0 = tl.program_id(1) * KBP
    if row >= 0:
        cols = (kb0 + tl.arange(0, KBP))[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        base = h_ptr + row * (2 * inter)
        g = tl.load(base + cols, mask=cols < inter, other=0.0).to(tl.float32)
        u = tl.load(base + inter + cols, mask=cols < inter, other=0.0).to(tl.float32)
        v = g / (1.0 + tl.exp(-g)) * u
        _quant_store(v, q_ptr, s_ptr, row, kb0, inter, nkb, rows_per_batch, KBP, BLOCK)


@triton.jit(do_not_specialize=["n_pairs", "capacity"])
def _permute_masked_kernel(ids_ptr, row_ptr, count_ptr, n_pairs, num_local, expert_offset, capacity,
                           BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program e < num_local: the pairs routed to local expert e get rows e * capacity + rank, rank
    in pair order (what the torch path's stable sort gives), and counts[e] their number. Program
    num_local writes -1 for the pairs of experts held elsewhere. One pass over the ids per
    program, no atomics: deterministic, and no zeroed buffer to launch first."""
    wait_prior(PDL)
    e = tl.program_id(0)
    seen = 0
    for start in range(0, n_pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n_pairs
        local = tl.load(ids_ptr + offs, mask=m, other=0) - expert_offset
        here = (local >= 0) & (local < num_local)
        mine = m & tl.where(e < num_local, local == e, here == 0)
        rank = seen + tl.cumsum(mine.to(tl.int32), axis=0) - 1
        row = tl.where(e < num_local, e.to(tl.int64) * capacity + rank, -1)
        tl.store(row_ptr + offs, row, mask=mine)
        seen += tl.sum(mine.to(tl.int32), axis=0)
    if e < num_local:
        tl.store(count_ptr + e, seen)


@triton.jit(do_not_specialize=["n_pairs", "num_tiles"])
def _contig_rows_kernel(ids_ptr, row_ptr, count_ptr, pstart_ptr, tile_ptr, n_pairs, num_local, expert_offset,
                        num_tiles, ALIGN: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    """Program p, after _permute_masked_kernel with capacity 0 left each local pair's rank inside its
    expert in row_ptr (-1: another rank's expert): rows of pairs [p * BLOCK, +BLOCK) = the padded start
    of their expert + rank, and tile_expert of tiles [p * BLOCK_T, +BLOCK_T) (-1 past the last
    expert's padded end). Every program computes the same padded starts from the counts and stores
    them to pstart_ptr (identical values, so the overlapping stores agree) to gather them per pair."""
    wait_prior(PDL)
    p = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    cnt = tl.load(count_ptr + e, mask=e < num_local, other=0)
    padded = (cnt + ALIGN - 1) // ALIGN * ALIGN
    pend = tl.cumsum(padded, axis=0)
    tl.store(pstart_ptr + e, pend - padded, mask=e < num_local)
    tl.debug_barrier()
    offs = p * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_pairs
    rank = tl.load(row_ptr + offs, mask=m, other=-1)
    local = tl.load(ids_ptr + offs, mask=m, other=0) - expert_offset
    ok = m & (rank >= 0)
    start = tl.load(pstart_ptr + local, mask=ok, other=0)
    tl.store(row_ptr + offs, tl.where(ok, start + rank, -1), mask=m)
    tiles = p * BLOCK_T + tl.arange(0, BLOCK_T)
    first = tiles * ALIGN  # first row of each tile; its expert: the experts ending at or before it
    owner = tl.sum(((pend[None, :] <= first[:, None]) & (e[None, :] < num_local)).to(tl.int32), axis=1)
    tl.store(tile_ptr + tiles, tl.where(first < tl.sum(padded, axis=0), owner, -1), mask=tiles < num_tiles)


@triton.jit
def _unpermute_kernel(
    y_ptr, row_ptr, w_ptr, out_ptr, sh_ptr, g_ptr, H, K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr
):
    """Sums the k rows in pair order; a row of -1 (an expert of another EP rank) loads as 0, so the
    k loads carry no branch and are all in flight at once."""
    wait_prior(PDL)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        r = tl.load(row_ptr + t * K + j)
        w = tl.load(w_ptr + t * K + j)
        ok = m & (tl.zeros([BLOCK], tl.int64) + r >= 0)
        v = tl.load(y_ptr + tl.maximum(r, 0).to(tl.int64) * H + cols, mask=ok, other=0.0)
        acc += v.to(tl.float32) * w
    if HAS_SHARED:
        g = tl.load(g_ptr + t).to(tl.float32)
        sv = tl.load(sh_ptr + t.to(tl.int64) * H + cols, mask=m, other=0.0).to(tl.float32)
        acc += sv / (1.0 + tl.exp(-g))
    tl.store(out_ptr + t.to(tl.int64) * H + cols, acc.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _topk_softmax_kernel(logit_ptr, w_ptr, id_ptr, E, K: tl.constexpr, KP: tl.constexpr, RENORM: tl.constexpr,
                         NS: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    """One token per program; NS > 0: rows of E + 1 logits, the last a shared expert's gate, the shared
    expert held as experts E .. E + NS - 1 (reference.route's `num_shared`)."""
    wait_prior(PDL)
    t = tl.program_id(0).to(tl.int64)
    stride = E
    if NS > 0:
        stride = E + 1
    wv, iv = topk_softmax(logit_ptr + t * stride, E, K, KP, BLOCK_E, RENORM)
    kk = tl.arange(0, KP)
    out = t * (K + NS)
    tl.store(w_ptr + out + kk, wv, mask=kk < K)
    tl.store(id_ptr + out + kk, iv, mask=kk < K)
    if NS > 0:
        sw = tl.sigmoid(tl.load(logit_ptr + t * stride + E).to(tl.float32))
        for j in tl.static_range(NS):
            tl.store(w_ptr + out + K + j, sw)
            tl.store(id_ptr + out + K + j, (E + j).to(tl.int64))


@triton.jit
def topk_softmax(row, E, K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr):
    """(weights [KP] fp32, expert ids [KP] int64; entries past K are 0) of one token's E logits at
    `row`: softmax in fp32, top k, optional renormalisation. Each top-k step is two 32-bit warp
    maxima (`redux.sync`): of p's bits, then of the reversed index among the entries equal to it, so
    the lowest index wins ties, as torch.topk. (One int64 max of p << 32 | the reversed index a
    step, the same picks: H200, 48-layer batch-1 step 1.745-1.754 -> 1.717-1.725 ms, perf/RESULTS.md.)
    Shared with nvl72.model.decode_layer."""
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(row + offs, mask=offs < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    kk = tl.arange(0, KP)
    wv = tl.zeros([KP], tl.float32)
    iv = tl.zeros([KP], tl.int64)
    total = 0.0
    hi = tl.where(offs < E, p.to(tl.int32, bitcast=True), -1)  # p >= 0: its bits order as p does
    rev = BLOCK_E - 1 - offs  # the max of rev among equal p is the lowest index (torch.topk's tie order)
    for j in tl.static_range(K):
        top = tl.max(hi, axis=0)
        b = tl.max(tl.where(hi == top, rev, -1), axis=0)
        w = top.to(tl.float32, bitcast=True)
        wv = tl.where(kk == j, w, wv)
        iv = tl.where(kk == j, (BLOCK_E - 1 - b).to(tl.int64), iv)
        total += w
        hi = tl.where(rev == b, -1, hi)
    if RENORM:
        wv = wv / total
    return wv, iv


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of reference.route (`num_shared` included), one token per program."""
    t, e = router_logits.shape
    e -= 1 if num_shared else 0
    w = torch.empty(t, top_k + num_shared, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k + num_shared, dtype=torch.int64, device=router_logits.device)
    if t:
        block_e = triton.next_power_of_2(e)
        _topk_softmax_kernel[(t,)](  # one warp: the reductions stay in shuffles (no shared memory)
            router_logits.contiguous(), w, ids, e, K=top_k, KP=triton.next_power_of_2(top_k), RENORM=renormalize,
            NS=num_shared, BLOCK_E=block_e, num_warps=1 if block_e <= 1024 else 4,
            **launch_args(router_logits.device)
        )
    return w, ids


ROW_SPLIT_MIN_ROWS = 1024  # from here on a program quantizes up to 8 K-blocks of a row (prefill)


def _row_split(rows: int, nkb: int) -> tuple[int, int]:
    """(K-blocks per program, warps) of the quantizing kernels: one 128-block per one-warp program
    while rows are few (decode: more programs in flight); for prefill-sized launches up to 8 blocks
    per four-warp program (a million one-warp programs of 128 values made 8K-token prefills spend
    more time in launch overhead than in bytes)."""
    if rows < ROW_SPLIT_MIN_ROWS:
        return 1, 1
    return min(8, triton.next_power_of_2(nkb)), 4


def gather_quant(x: torch.Tensor, row_of: torch.Tensor, num_rows: int, rows_per_batch: int):
    (t, k), h = row_of.shape, x.shape[1]
    nkb = triton.cdiv(h, BLOCK_K)
    q = torch.empty(num_rows, h, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(num_rows // rows_per_batch, nkb, rows_per_batch, dtype=torch.float32, device=x.device)
    if t:
        kbp, warps = _row_split(t * k, nkb)
        _gather_quant_kernel[(t * k, triton.cdiv(nkb, kbp))](
            x.contiguous(), row_of.contiguous(), q, s, h, nkb, rows_per_batch, K=k, KBP=kbp, BLOCK=BLOCK_K,
            num_warps=warps, **launch_args(x.device)
        )
    return q, s


def gather_quant_mx(x: torch.Tensor, row_of: torch.Tensor, num_rows: int, rows_per_batch: int):
    (t, k), h = row_of.shape, x.shape[1]
    if h % 32:
        raise ValueError(f"hidden={h} must be a multiple of 32 for MXFP8")
    rows_pad, cols_pad = triton.cdiv(rows_per_batch, 128) * 128, triton.cdiv(h // 32, 4) * 4
    q = torch.empty(num_rows, h, dtype=torch.float8_e4m3fn, device=x.device)
    sf = torch.zeros(num_rows // rows_per_batch * rows_pad * cols_pad, dtype=torch.uint8, device=x.device)
    if t:
        _gather_quant_mx_kernel[(t * k, triton.cdiv(h, BLOCK_K))](
            x.contiguous(), row_of.contiguous(), q, sf, h, rows_per_batch, rows_pad, cols_pad, K=k, BLOCK=BLOCK_K,
            **launch_args(x.device)
        )
    return q, sf


def silu_mul_quant(h: torch.Tensor, rows_per_batch: int, row_of: torch.Tensor | None = None):
    m, inter = h.shape[0], h.shape[1] // 2
    nkb = triton.cdiv(inter, BLOCK_K)
    q = torch.empty(m, inter, dtype=torch.float8_e4m3fn, device=h.device)
    s = torch.empty(m // rows_per_batch, nkb, rows_per_batch, dtype=torch.float32, device=h.device)
    n = m if row_of is None else row_of.numel()
    if m and n:
        rows = h if row_of is None else row_of.contiguous()  # any pointer when unread
        kbp, warps = _row_split(n, nkb)
        _silu_mul_quant_kernel[(n, triton.cdiv(nkb, kbp))](
            h.contiguous(), rows, q, s, inter, nkb, rows_per_batch, BY_PAIR=row_of is not None, KBP=kbp,
            BLOCK=BLOCK_K, num_warps=warps, **launch_args(h.device),
        )
    return q, s


def permute_masked(topk_ids: torch.Tensor, num_local: int, capacity: int, expert_offset: int = 0):
    """moe.routing.permute_masked in one kernel, for capacity >= T (no expert can overflow: a
    token's k experts are distinct), so no check and no host sync; counts come as int32 (the
    GEMMs' aux). token_of is not built (the FP8 decode pipeline never reads it)."""
    from moe.routing import Permutation

    t = topk_ids.shape[0]
    if capacity < t:
        raise ValueError(f"capacity={capacity} < T={t}: the kernel path needs capacity >= T")
    row, counts = _expert_rows(topk_ids, num_local, expert_offset, capacity)
    return Permutation("masked", row, None, counts, num_local * capacity, 1, capacity=capacity)


def _expert_rows(topk_ids: torch.Tensor, num_local: int, expert_offset: int, capacity: int):
    """_permute_masked_kernel's launch: (row [T, k] int64 = e * capacity + the pair's rank inside its
    local expert e, -1 for other ranks' experts; counts [E_local] int32)."""
    t, k = topk_ids.shape
    row = torch.empty(t, k, dtype=torch.int64, device=topk_ids.device)
    counts = torch.empty(num_local, dtype=torch.int32, device=topk_ids.device)
    n = t * k
    block = min(1024, max(16, triton.next_power_of_2(max(n, 1))))
    _permute_masked_kernel[(num_local + 1,)](
        topk_ids.contiguous(), row, counts, n, num_local, expert_offset, capacity, BLOCK=block,
        num_warps=1 if block <= 256 else 4, **launch_args(topk_ids.device),
    )
    return row, counts


def contiguous_rows_bound(pairs: int, num_local: int, align: int) -> int:
    """Rows of the contiguous layout that no routing can exceed: every pair, plus at most align - 1
    padding rows per expert that has pairs; a multiple of align."""
    return -(-(pairs + min(num_local, pairs) * (align - 1)) // align) * align


def permute_contiguous(topk_ids: torch.Tensor, num_local: int, expert_offset: int = 0, align: int = 128):
    """moe.routing.permute_contiguous without a host sync (two kernels instead of a dozen torch ops
    and three device-to-host reads per prefill layer): rows and counts are the reference's;
    num_rows is `contiguous_rows_bound` (known on the host before the routing is), tile_expert
    equals the reference's on its tiles and is -1 on the spare ones after, which the grouped GEMMs
    skip. token_of is not built (the FP8 pipeline never reads it)."""
    from moe.routing import Permutation

    if align <= 0:
        raise ValueError(f"align={align} must be positive")
    n = topk_ids.numel()
    num_rows = contiguous_rows_bound(n, num_local, align)
    row, counts = _expert_rows(topk_ids, num_local, expert_offset, 0)  # rank inside the expert
    tiles = torch.empty(num_rows // align, dtype=torch.int32, device=topk_ids.device)
    if n:  # (no pairs: no rows, no tiles)
        pstart = torch.empty(num_local, dtype=torch.int32, device=topk_ids.device)
        nt, bt = tiles.numel(), 16
        _contig_rows_kernel[(max(triton.cdiv(n, 256), triton.cdiv(nt, bt)),)](
            topk_ids.contiguous(), row, counts, pstart, tiles, n, num_local, expert_offset, nt, ALIGN=align,
            BLOCK=256, BLOCK_E=triton.next_power_of_2(num_local), BLOCK_T=bt, num_warps=4,
            **launch_args(topk_ids.device))
    return Permutation("contiguous", row, None, counts, num_rows, align, tile_expert=tiles)


def unpermute(y, row_of, topk_weights, shared=None, shared_gate=None):
    t, k = row_of.shape
    h = y.shape[-1]
    out = torch.empty(t, h, dtype=y.dtype, device=y.device)
    has_shared = shared is not None
    if t:
        block = 256 if t < 64 else 1024  # decode: more programs over the row (latency, not bandwidth)
        _unpermute_kernel[(t, triton.cdiv(h, block))](
            y.reshape(-1, h),
            row_of.contiguous(),
            topk_weights.float().contiguous(),
            out,
            shared.contiguous() if has_shared else out,
            shared_gate.contiguous() if has_shared else out,
            h,
            K=k,
            HAS_SHARED=has_shared,
            BLOCK=block,
            num_warps=2 if block == 256 else 4,
            **launch_args(y.device),
        )
    return out
