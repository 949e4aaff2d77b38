"""Triton kernels of the attention path, twins of the torch references in `nvl72.model.ops`.

- `slot_mapping` and `rope_cos_sin`: the per-forward indexing of the attention layers, one kernel
  each (their torch forms were some twenty small kernels per step);
- `gemv`: x [1, K] @ W.T (+ bias) for single-token steps, row blocks of W per program, the
  weight tile of the next K step loaded one step ahead (the triton backend's default for
  single-token projections, $NVL72_TRITON_GEMV=0 for cuBLAS: with PDL its first weight tile streams
  in before x is written); `norm_gemv` the same of add_rms_norm's output, the add and norm done by
  every program itself (the decoder's input norm and q/k/v projection in one launch). On Hopper the
  attention backend runs both through nvl72.model.smem_gemv where the kernel bundle has the shape;
- `add_rms_norm`: the decoder's residual add and RMSNorm in one pass (x + delta rounded to the
  activation dtype, then normed as `ops.rms_norm` rounds); without delta a plain RMSNorm; with
  the MoE gate's weight also the router logits (the router GEMV folded into the same launch);
- `qk_norm_rope`: after the q/k projections, one pass does the gate split (gated attention), the
  per-head q/k RMSNorm and the (partial) neox RoPE, rounding where the reference rounds (bf16
  products and sums are emulated exactly: a product of two bf16 values is exact in fp32);
- `store_kv`: the new tokens' K/V into their HND pages (also done by `qk_norm_rope` when given the
  cache, saving the launch on the decode path); slot -1 skips a row (padded rows of a
  CUDA-graph batch);
- `paged_attention`: causal GQA over the pages, one program per (sequence, KV head, block of
  query tokens) holding all the group's query heads as rows, so decode (one token) and prefill
  chunks share the kernel; online softmax in fp32. Its launch needs no host sync (the grid's
  query-block count comes from `max_query_len`, known on the host), so it runs inside CUDA graphs;
- `norm_rope_paged_attention`: `qk_norm_rope` with the K/V store and `paged_attention` in one launch
  for one-token queries (the attention programs norm and rope their own q rows and the new key, and
  take the new K/V from registers): at batch 1 one dependent launch fewer a layer (H200, 48 layers:
  1.806-1.812 -> 1.746-1.749 ms a step, perf/RESULTS.md).

Size arguments that change from step to step (sequence count, page-table width) are not
specialised on (`do_not_specialize`), nor is the alignment of the per-step index arrays (query
starts, sequence lengths, page table, positions, slots: `do_not_specialize_on_alignment`; views
into the staging buffers, read a word at a time): Triton would otherwise compile a variant per
divisibility class while serving (`nvl72.engine.jit_watch` counts any that still do).

Every kernel takes `PDL` (programmatic dependent launch, `aot.pdl`: on sm_90+ streams, so inside
the decode graphs): launched while the previous kernel drains, it reads only weights before
waiting for it (the GEMV's first weight tile, the norm and router weights) and lets the next
kernel launch right after the wait.

The shared-expert gate `sigmoid(x . w) * shared` is not here: `moe` adds it in its un-permute
kernel already.

Verified in Triton's interpreter (TRITON_INTERPRET=1) against the references, and on H100 / H200
(tests/runner/test_fused_triton.py -m gpu; timings in perf/RESULTS.md).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from aot.pdl import launch_args, wait_prior

SLOT_BLOCK = 64  # sequence ends per step of the slot-mapping kernel's search
# Warps of `paged_attention`'s split-key decode programs: with 4 their registers spilled (ptxas: 1376 B
# of stack at the Qwen3-30B-A3B shape, none at 8; H100, 48 layers, batch 1: 2.679-2.686 -> 2.662-2.663
# ms a step, perf/RESULTS.md)
SPLIT_DECODE_WARPS = 8


@triton.jit
def _round(x, DT: tl.constexpr):
    """Round fp32 to the activation dtype and back (emulates one torch op in that dtype)."""
    return x.to(DT).to(tl.float32)


@triton.jit(do_not_specialize=["num_seqs", "width", "stride_pt"],
            do_not_specialize_on_alignment=["positions", "qsl", "page_table", "slots"])  # scalar accesses
def _slot_mapping_kernel(positions, qsl, page_table, slots, num_seqs, width, stride_pt, PAGE_SIZE: tl.constexpr,
                         BLOCK_B: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    t = tl.program_id(0)
    # searchsorted(right) over the sequence ends, BLOCK_B at a time (one compiled variant for any
    # batch: a block sized by the batch compiled a new variant per power of two while serving)
    before = 0
    for b0 in range(0, num_seqs, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        ends = tl.load(qsl + 1 + b, mask=b < num_seqs, other=2147483647)
        before += tl.sum((ends <= t).to(tl.int32), 0)
    seq = tl.minimum(before, num_seqs - 1)
    pos = tl.load(positions + t).to(tl.int64)
    col = pos // PAGE_SIZE
    page = tl.load(page_table + seq.to(tl.int64) * stride_pt + col, mask=col < width, other=-1).to(tl.int64)
    tl.store(slots + t, tl.where(page >= 0, page * PAGE_SIZE + pos % PAGE_SIZE, -1))


def slot_mapping(positions: torch.Tensor, query_start_loc: torch.Tensor, page_table: torch.Tensor,
                 page_size: int) -> torch.Tensor:
    """[T] int64 page * page_size + offset of each new token, -1 where its sequence has no page there
    (padded graph rows), in one kernel and without a host sync."""
    t, (b, width) = positions.shape[0], page_table.shape
    slots = torch.empty(t, dtype=torch.int64, device=positions.device)
    if t:
        if not b:
            raise ValueError(f"slot_mapping: {t} tokens but no sequence")
        _slot_mapping_kernel[(t,)](positions, query_start_loc, page_table, slots, b, width, page_table.stride(0),
                                   PAGE_SIZE=page_size, BLOCK_B=SLOT_BLOCK,
                                   **launch_args(positions.device))
    return slots


@triton.jit(do_not_specialize_on_alignment=["positions"])
def _rope_cos_sin_kernel(positions, inv_freq, cos, sin, HALF: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    wait_prior(PDL)  # (inv_freq.float() may be a copy made by the previous kernel)
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    ok = j < HALF
    f = tl.load(positions + t).to(tl.float32) * tl.load(inv_freq + j, mask=ok, other=0.0)
    DT = cos.dtype.element_ty
    for half in tl.static_range(2):  # the table repeats its halves
        tl.store(cos + t * 2 * HALF + half * HALF + j, tl.cos(f).to(DT), mask=ok)
        tl.store(sin + t * 2 * HALF + half * HALF + j, tl.sin(f).to(DT), mask=ok)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of `ops.rope_cos_sin` in one kernel: (cos, sin) [T, R] in `dtype`, computed in fp32."""
    t, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty(t, 2 * half, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if t:
        _rope_cos_sin_kernel[(t,)](positions, inv_freq.float(), cos, sin, HALF=half,
                                   BLOCK=triton.next_power_of_2(half), **launch_args(positions.device))
    return cos, sin


@triton.jit
def _gemv_kernel(x, w, bias, out, N, K, stride_w, delta, norm_w, sum_out, rms_eps, HAS_BIAS: tl.constexpr,
                 NORM: tl.constexpr, ZC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """Program i: rows [i * BLOCK_N, +BLOCK_N). The weight tile of the next K step is loaded one
    step ahead, and the first one (with the bias) before waiting for the previous kernel: weights
    are constant, so with PDL their stream starts while the kernel that writes x drains.
    NORM 1: of RMSNorm(x) (weight norm_w), 2: of RMSNorm(x + delta), the sum (rounded) stored by
    program 0 into sum_out: every program norms the row itself (its whole row, BLOCK_H, for the
    rstd, then each K step's slice again), rounded as `add_rms_norm`."""
    DT = out.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows[:, None] < N
    w_rows = w + rows[:, None].to(tl.int64) * stride_w
    k = tl.arange(0, BLOCK_K)
    wv = tl.load(w_rows + k[None, :], mask=r_ok & (k[None, :] < K), other=0.0)  # [BLOCK_N, BLOCK_K]
    if HAS_BIAS:
        b = tl.load(bias + rows, mask=rows < N, other=0.0).to(tl.float32)
    wait_prior(PDL)
    if NORM > 0:
        c = tl.arange(0, BLOCK_H)
        v = tl.load(x + c, mask=c < K, other=0.0).to(tl.float32)
        if NORM == 2:
            v = _round(v + tl.load(delta + c, mask=c < K, other=0.0).to(tl.float32), DT)
            if tl.program_id(0) == 0:
                tl.store(sum_out + c, v.to(DT), mask=c < K)
        rstd = _rstd(v, rms_eps, K)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xv = tl.load(x + k0 + k, mask=k0 + k < K, other=0.0).to(tl.float32)
        if NORM > 0:
            if NORM == 2:
                xv = _round(xv + tl.load(delta + k0 + k, mask=k0 + k < K, other=0.0).to(tl.float32), DT)
            xv = _norm_scale(xv, rstd, tl.load(norm_w + k0 + k, mask=k0 + k < K, other=0.0).to(tl.float32), ZC, DT)
        nk = k0 + BLOCK_K + k  # the next step's columns (all masked after the last step)
        w_next = tl.load(w_rows + nk[None, :], mask=r_ok & (nk[None, :] < K), other=0.0)
        acc += tl.sum(wv.to(tl.float32) * xv[None, :], 1)
        wv = w_next
    if HAS_BIAS:
        acc += b
    tl.store(out + rows, acc.to(out.dtype.element_ty), mask=rows < N)


def gemv_blocks(n: int, k: int) -> tuple[int, int]:
    """(rows per program, K step) of `gemv` for an [n, k] weight: the fastest or within noise of it for
    the decode projections in tests/runner/gpu_gemv_sweep.py (perf/RESULTS.md, one H200)."""
    block_n = 4 if n <= 2048 else 8
    return block_n, min(triton.next_power_of_2(k), 8192 // block_n)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for one row: x [1, K], weight [N, K] (row-contiguous), bias [N] -> [1, N] in x.dtype,
    accumulated in fp32."""
    return _gemv(x, weight, bias)


def norm_gemv(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              zero_centered: bool, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """(s, gemv(RMSNorm(s), weight, bias)) for one row, s = x + delta (x itself when delta is None),
    in one kernel: `add_rms_norm` then `gemv` without the norm's launch (at batch 1 one more
    dependent kernel per layer); rounded as the two kernels round."""
    check_norm(x, delta, norm_weight)
    s = x if delta is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    return s, _gemv(x, weight, bias, (delta, norm_weight, s, eps, zero_centered))


def check_row(x: torch.Tensor, weight: torch.Tensor) -> None:
    """`gemv`'s argument contract (shared with nvl72.model.smem_gemv)."""
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != weight.shape[1] or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"gemv: x {tuple(x.shape)} must be one row-contiguous row of weight's K "
                         f"(weight {tuple(weight.shape)})")


def check_norm(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor) -> None:
    """`norm_gemv`'s contract for the norm's inputs (shared with nvl72.model.smem_gemv)."""
    if delta is not None and (delta.shape != x.shape or delta.stride(-1) != 1):
        raise ValueError(f"norm_gemv: delta {tuple(delta.shape)} must be a row-contiguous {tuple(x.shape)}")
    if norm_weight.shape != (x.shape[-1],) or not norm_weight.is_contiguous():
        raise ValueError(f"norm_gemv: norm weight {tuple(norm_weight.shape)} must be a contiguous [{x.shape[-1]}]")


def _gemv(x, weight, bias, norm=None):
    """gemv, of the normed row when `norm` = (delta or None, norm weight, sum out, eps, zero_centered)."""
    check_row(x, weight)
    k, n = x.shape[1], weight.shape[0]
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_n, block_k = gemv_blocks(n, k)
    delta, norm_w, sum_out, eps, zc = norm if norm is not None else (None, x, x, 0.0, False)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, weight, weight if bias is None else bias, out, n, k,
                                             weight.stride(0), x if delta is None else delta, norm_w, sum_out, eps,
                                             HAS_BIAS=bias is not None,
                                             NORM=0 if norm is None else 1 + (delta is not None), ZC=zc,
                                             BLOCK_N=block_n, BLOCK_K=block_k,
                                             BLOCK_H=triton.next_power_of_2(k) if norm is not None else 1,
                                             **launch_args(x.device))
    return out


@triton.jit
def _add_rms_norm_kernel(x, delta, w, sum_out, norm_out, router, logits, rms_eps, stride_x, stride_d, E,
                         H: tl.constexpr, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr, ZC: tl.constexpr,
                         BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    """Program (t, j): token t's sum and norm (stored by j == 0); with a router (BLOCK_E > 0) also
    logits rows [j * BLOCK_E, (j + 1) * BLOCK_E) of the normed row, so the norm is recomputed by
    every program (a 2-row read) instead of a second launch for the router's GEMV. The weights
    (norm, router rows) are read before waiting for the previous kernel (PDL)."""
    DT = norm_out.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    c = tl.arange(0, BLOCK)
    ok = c < H
    wv = tl.load(w + c, mask=ok, other=0.0).to(tl.float32)
    if BLOCK_E > 0:
        e = j * BLOCK_E + tl.arange(0, BLOCK_E)
        e_ok = e < E
        r = tl.load(router + e[:, None].to(tl.int64) * H + c[None, :], mask=e_ok[:, None] & ok[None, :], other=0.0)
    wait_prior(PDL)
    v = tl.load(x + t * stride_x + c, mask=ok, other=0.0).to(tl.float32)
    if HAS_DELTA:
        v = _round(v + tl.load(delta + t * stride_d + c, mask=ok, other=0.0).to(tl.float32), DT)
        if j == 0:
            tl.store(sum_out + t * H + c, v.to(DT), mask=ok)
    y = rms_norm_row(v, wv, rms_eps, H, ZC, DT)
    if j == 0:
        tl.store(norm_out + t * H + c, y.to(DT), mask=ok)
    if BLOCK_E > 0:  # logits = normed @ router.T, rounded to the activation dtype as nn.Linear's output
        tl.store(logits + t * E + e, tl.sum(r.to(tl.float32) * y[None, :], 1).to(DT), mask=e_ok)


@triton.jit
def rms_norm_row(v, wv, rms_eps, H, ZC: tl.constexpr, DT: tl.constexpr):
    """RMSNorm of the fp32 row v (zeros past H) with weight wv, rounded as `ops.rms_norm` rounds in
    the activation dtype DT; fp32 result. Shared with nvl72.model.decode_layer."""
    return _norm_scale(v, _rstd(v, rms_eps, H), wv, ZC, DT)


@triton.jit
def _rstd(v, rms_eps, H, AXIS: tl.constexpr = 0):
    """1 / RMS of the fp32 rows of v along AXIS (zeros past H): a row [BLOCK] -> scalar, rows [M, BLOCK]
    along 1 -> [M]."""
    return tl.rsqrt(tl.sum(v * v, AXIS) / H + rms_eps)


@triton.jit
def _norm_scale(v, rstd, wv, ZC: tl.constexpr, DT: tl.constexpr):
    """v * rstd times the norm weight (1 + wv when zero-centred), rounded as `ops.rms_norm` rounds in DT."""
    if ZC:
        return _round(v * rstd * (1.0 + wv), DT)
    return _round(_round(v * rstd, DT) * wv, DT)


ROUTER_BLOCK_E = 4  # router rows per program of the fused norm + router kernel


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 zero_centered: bool, router: torch.Tensor | None = None):
    """(s, ops.rms_norm(s, weight, eps, zero_centered)) with s = x + delta (x itself when delta is
    None, returned as is); with `router` [E, H] (the MoE gate's weight) also the router logits
    F.linear(normed, router) [T, E] as a third element. x, delta [T, H] row-contiguous; returns
    new tensors in x.dtype."""
    if x.dim() != 2 or x.stride(1) != 1 or (delta is not None and (delta.shape != x.shape or delta.stride(1) != 1)):
        raise ValueError(f"add_rms_norm needs row-contiguous [T, H] x (got {tuple(x.shape)}) and delta of its shape "
                         f"(got {None if delta is None else tuple(delta.shape)})")
    t, h = x.shape
    if router is not None and (router.dim() != 2 or router.shape[1] != h or not router.is_contiguous()):
        raise ValueError(f"router weight {tuple(router.shape)} must be a contiguous [E, {h}]")
    s = x if delta is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    e = 0 if router is None else router.shape[0]
    logits = torch.empty(t, e, dtype=x.dtype, device=x.device) if router is not None else out
    if t:
        d = x if delta is None else delta
        _add_rms_norm_kernel[(t, triton.cdiv(e, ROUTER_BLOCK_E) if e else 1)](
            x, d, weight, s, out, out if router is None else router, logits, eps, x.stride(0), d.stride(0), e, H=h,
            BLOCK=triton.next_power_of_2(h), HAS_DELTA=delta is not None, ZC=zero_centered,
            BLOCK_E=ROUTER_BLOCK_E if e else 0, num_warps=4 if h <= 4096 else 8, **launch_args(x.device))
    return (s, out) if router is None else (s, out, logits)


@triton.jit
def _norm_rope_rows(src, ok, w, cos, sin, rms_eps, D: tl.constexpr, R: tl.constexpr, ZC: tl.constexpr,
                    DT: tl.constexpr):
    """RMSNorm (weight w) then RoPE on the first R dims of the rows at src [M, 1] (row pointers; rows
    where ok [M, 1], zeros elsewhere), each row's cos/sin at cos/sin [M, 1]: [M, D] fp32, rounded
    in DT as `layers.Attention` rounds with the references."""
    d = tl.arange(0, D)[None, :]
    x = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
    rstd = _rstd(x, rms_eps, D, 1)[:, None]
    y = _norm_scale(x, rstd, tl.load(w + d).to(tl.float32), ZC, DT)
    if R > 0:
        rot = d < R
        partner = tl.where(d < R // 2, d + R // 2, d - R // 2)
        xp = tl.load(src + partner, mask=ok & rot, other=0.0).to(tl.float32)
        yp = _norm_scale(xp, rstd, tl.load(w + partner, mask=rot, other=0.0).to(tl.float32), ZC, DT)
        yp = tl.where(d < R // 2, -yp, yp)
        c = tl.load(cos + d, mask=ok & rot, other=1.0).to(tl.float32)
        s = tl.load(sin + d, mask=ok & rot, other=0.0).to(tl.float32)
        roped = _round(_round(y * c, DT) + _round(yp * s, DT), DT)
        y = tl.where(rot, roped, y)
    return y


@triton.jit(do_not_specialize=["T"])
def _qk_norm_rope_kernel(q_raw, k_raw, qw, kw, cos, sin, q_out, k_out, gate_out, rms_eps, T,
                         stride_q, stride_k, stride_cs, v, kv_cache, slots, stride_v, stride_page, stride_kind,
                         stride_head, stride_tok, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                         R: tl.constexpr, GATED: tl.constexpr, ZC: tl.constexpr, STORE: tl.constexpr,
                         PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    """Program (block of BLOCK_T tokens, head): a q head's or a KV head's rows."""
    wait_prior(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]  # [M, 1]
    h = tl.program_id(1)
    ok = rows < T
    r64 = rows.to(tl.int64)
    cs = cos + r64 * stride_cs
    sn = sin + r64 * stride_cs
    d = tl.arange(0, D)[None, :]
    if h < HQ:
        if GATED:  # q_proj emits per head [query (D) | gate (D)]
            src = q_raw + r64 * stride_q + h * 2 * D
            tl.store(gate_out + (r64 * HQ + h) * D + d, tl.load(src + D + d, mask=ok), mask=ok)
        else:
            src = q_raw + r64 * stride_q + h * D
        y = _norm_rope_rows(src, ok, qw, cs, sn, rms_eps, D, R, ZC, q_out.dtype.element_ty)
        tl.store(q_out + (r64 * HQ + h) * D + d, y.to(q_out.dtype.element_ty), mask=ok)
    else:
        hk = h - HQ
        y = _norm_rope_rows(k_raw + r64 * stride_k + hk * D, ok, kw, cs, sn, rms_eps, D, R, ZC,
                            k_out.dtype.element_ty)
        tl.store(k_out + (r64 * HKV + hk) * D + d, y.to(k_out.dtype.element_ty), mask=ok)
        if STORE:  # store_kv's work for these (token, KV head) rows: K and V into each token's page slot
            slot = tl.load(slots + rows, mask=ok, other=-1).to(tl.int64)
            put = ok & (slot >= 0)
            dst = kv_cache + (slot // PAGE_SIZE) * stride_page + hk * stride_head + (slot % PAGE_SIZE) * stride_tok + d
            tl.store(dst, y.to(kv_cache.dtype.element_ty), mask=put)
            tl.store(dst + stride_kind, tl.load(v + r64 * stride_v + hk * D + d, mask=put).to(kv_cache.dtype.element_ty),
                     mask=put)


# qk_norm_rope: tokens a program past QK_ROWS_FROM tokens (prefill chunks); one below, as decode steps
# always ran (H200, 48-layer Qwen3-30B-A3B shape, 8K-token prefill: 205 us a layer at a token a program, 55 at 16)
QK_ROWS, QK_ROWS_FROM = 16, 256


def qk_norm_rope(q_raw: torch.Tensor, k_raw: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float, zero_centered: bool, gated: bool, v: torch.Tensor | None = None,
                 kv_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None):
    """Gate split + q/k RMSNorm + RoPE in one pass, as `layers.Attention` does it with the references.
    With v [T, Hkv, D], kv_cache and slot_mapping it also does `store_kv(kv_cache, k, v, slot_mapping)`.

    q_raw [T, Hq * D * (2 if gated else 1)], k_raw [T, Hkv * D], cos/sin [T, R] ->
    (q [T, Hq, D], k [T, Hkv, D], gate [T, Hq * D] or None)."""
    t = q_raw.shape[0]
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim} must be a power of two for the fused kernel")
    if q_raw.shape[1] != num_heads * head_dim * (2 if gated else 1) or k_raw.shape[1] != num_kv_heads * head_dim:
        raise ValueError(f"q_raw {tuple(q_raw.shape)} / k_raw {tuple(k_raw.shape)} do not match "
                         f"heads {num_heads}/{num_kv_heads} x head_dim {head_dim} (gated={gated})")
    if q_raw.stride(1) != 1 or k_raw.stride(1) != 1 or cos.stride(1) != 1 or cos.stride() != sin.stride():
        raise ValueError("qk_norm_rope needs row-contiguous q_raw, k_raw, cos and sin")
    rot = cos.shape[1]
    q = torch.empty(t, num_heads, head_dim, dtype=q_raw.dtype, device=q_raw.device)
    k = torch.empty(t, num_kv_heads, head_dim, dtype=k_raw.dtype, device=k_raw.device)
    gate = torch.empty(t, num_heads * head_dim, dtype=q_raw.dtype, device=q_raw.device) if gated else q
    if t:
        store = kv_cache is not None
        if store:
            _check_store(kv_cache, k, v)
            cache_args = (v, kv_cache, slot_mapping, v.stride(0), *kv_cache.stride()[:4])
        else:
            cache_args = (q, q, q, 0, 0, 0, 0, 0)  # unread
        rows = QK_ROWS if t > QK_ROWS_FROM else 1
        _qk_norm_rope_kernel[(triton.cdiv(t, rows), num_heads + num_kv_heads)](
            q_raw, k_raw, q_weight, k_weight, cos, sin, q, k, gate, eps, t, q_raw.stride(0), k_raw.stride(0),
            cos.stride(0), *cache_args, HQ=num_heads, HKV=num_kv_heads, D=head_dim, R=rot, GATED=gated,
            ZC=zero_centered, STORE=store, PAGE_SIZE=kv_cache.shape[3] if store else 1, BLOCK_T=rows,
            **launch_args(q_raw.device))
    return q, k, (gate if gated else None)


@triton.jit(do_not_specialize_on_alignment=["slots"])
def _store_kv_kernel(k, v, kv_cache, slots, stride_kt, stride_vt, stride_page, stride_kind, stride_head, stride_tok,
                     PAGE_SIZE: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    t, h = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots + t).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, D)
        dst = kv_cache + (slot // PAGE_SIZE) * stride_page + h * stride_head + (slot % PAGE_SIZE) * stride_tok + d
        tl.store(dst, tl.load(k + t.to(tl.int64) * stride_kt + h * D + d).to(kv_cache.dtype.element_ty))
        tl.store(dst + stride_kind, tl.load(v + t.to(tl.int64) * stride_vt + h * D + d).to(kv_cache.dtype.element_ty))


def _check_store(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    d = k.shape[2]
    if v.shape != k.shape:
        raise ValueError(f"v {tuple(v.shape)} must have k's shape {tuple(k.shape)}")
    if k.stride(1) != d or v.stride(1) != d or k.stride(2) != 1 or v.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("storing K/V needs heads-contiguous k/v rows and a contiguous head_dim in the cache")


def store_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Twin of `ops.write_kv`; a slot of -1 writes nothing. kv_cache [P, 2, Hkv, ps, D]; k, v [T, Hkv, D]."""
    t, hkv, d = k.shape
    _check_store(kv_cache, k, v)
    if t:
        _store_kv_kernel[(t, hkv)](k, v, kv_cache, slot_mapping, k.stride(0), v.stride(0), kv_cache.stride(0),
                                   kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
                                   PAGE_SIZE=kv_cache.shape[3], D=d, **launch_args(k.device))


@triton.jit(do_not_specialize=["stride_pt"], do_not_specialize_on_alignment=["qsl", "seq_lens", "page_table"])
def _paged_attention_kernel(q, kv_cache, out, part_acc, part_ml, counters, qsl, seq_lens, page_table, scale,
                            stride_qt, stride_qh, stride_ot, stride_oh, stride_page, stride_kind, stride_head,
                            stride_tok, stride_pt, k_raw, v_raw, qw, kw, cos, sin, slots, rms_eps, stride_kr,
                            stride_vr, stride_cs, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                            PAGE_SIZE: tl.constexpr, IEEE: tl.constexpr, NSPLIT: tl.constexpr,
                            EARLY: tl.constexpr, NORM: tl.constexpr, R: tl.constexpr, ZC: tl.constexpr,
                            LEAVE: tl.constexpr, PDL: tl.constexpr):
    """Split decode launches (NSPLIT > 1) with PDL (EARLY) read the batch tensors (the step's staging, copied
    before the forward), the page ids and the keys of earlier steps before waiting for the previous
    kernel, which writes only this step's K/V (see attend_block's EARLY). Other launches wait first
    (at batch 64 the early reads measured 0.3% slower). NORM: attend_block's (k_raw, v_raw, cos, sin,
    slots: rows by token; unread otherwise); LEAVE: attend_block's."""
    if not EARLY:
        wait_prior(PDL)
    seq, kvh = tl.program_id(0), tl.program_id(1)
    mblk, split = tl.program_id(2) // NSPLIT, tl.program_id(2) % NSPLIT
    q_start = tl.load(qsl + seq)
    qlen = tl.load(qsl + seq + 1) - q_start
    seq_len = tl.load(seq_lens + seq)
    if mblk * BLOCK_M < qlen:
        t64 = q_start.to(tl.int64)  # NORM's token rows (the pointers are unread without NORM)
        attend_block(q, kv_cache, out, part_acc, part_ml, counters + seq * tl.num_programs(1) + kvh, q_start, qlen,
                     seq_len, page_table + seq.to(tl.int64) * stride_pt, kvh, tl.num_programs(1), mblk, split, scale,
                     stride_qt, stride_qh, stride_ot, stride_oh, stride_page, stride_kind, stride_head, stride_tok,
                     GROUP, GROUP_PAD, BLOCK_M, BLOCK_N, D, PAGE_SIZE, IEEE, NSPLIT, EARLY, NORM,
                     k_raw + t64 * stride_kr, v_raw + t64 * stride_vr, qw, kw, cos + t64 * stride_cs,
                     sin + t64 * stride_cs, slots + t64, rms_eps, R, ZC, LEAVE)
    elif EARLY:
        wait_prior(PDL)


@triton.jit
def split_chunk(kv_end, NSPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys per split of `kv_end` keys: an equal share in whole BLOCK_N blocks (at least one)."""
    return tl.maximum(tl.cdiv(tl.cdiv(kv_end, NSPLIT), BLOCK_N) * BLOCK_N, BLOCK_N)


@triton.jit
def _attend_keys(qv, kt, vt, n, n_ok, qpos, m_i, l_i, acc, scale, IEEE: tl.constexpr):
    """One block of keys n [N] (K^T kt [D, N], V vt [N, D]) into the online softmax (m_i, l_i, acc)
    of the query rows qv [R, D] at positions qpos [R] (causal)."""
    if IEEE:
        s = tl.dot(qv, kt, input_precision="ieee")
    else:
        s = tl.dot(qv, kt)
    s = s * scale  # [R, N] fp32
    s = tl.where(n_ok[None, :] & (n[None, :] <= qpos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet (split > 0)
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
    return m_new, l_i, acc


@triton.jit
def _kv_base(pt_row, n, mask, kvh, stride_page, stride_head, stride_tok, PAGE_SIZE: tl.constexpr):
    """[N] offsets of keys n's K rows in the cache (their page ids read where `mask`)."""
    page = tl.load(pt_row + n // PAGE_SIZE, mask=mask, other=0).to(tl.int64)
    return page * stride_page + kvh * stride_head + (n % PAGE_SIZE) * stride_tok


@triton.jit
def _kv_tile(kv_cache, base, mask, d, stride_kind):
    """K^T [D, N] and V [N, D] at `base` where `mask` (zeros elsewhere): V beside K, both waiting
    on the page ids only (V loaded after the softmax was one more round trip)."""
    kt = tl.load(kv_cache + base[None, :] + d[:, None], mask=mask[None, :], other=0.0)
    vt = tl.load(kv_cache + stride_kind + base[:, None] + d[None, :], mask=mask[:, None], other=0.0)
    return kt, vt


@triton.jit
def _fresh_token(q_rows, q_ok, k_row, v_row, qw, kw, cos, sin, slot_ptr, kvh, rms_eps, store, kv_cache, stride_page,
                 stride_kind, stride_head, stride_tok, D: tl.constexpr, PAGE_SIZE: tl.constexpr, R: tl.constexpr,
                 ZC: tl.constexpr, DT: tl.constexpr):
    """attend_block's NORM inputs of a one-token query and KV head kvh (k_row, v_row, cos, sin: the
    token's rows): (q rows [M, D] normed and roped, in DT; the new key [1, D] and value [1, D] in the
    cache dtype), the key and value also stored in page slot *slot_ptr where `store` and it is not -1."""
    one = tl.zeros([1, 1], tl.int32)
    qv = _norm_rope_rows(q_rows, q_ok, qw, cos + one, sin + one, rms_eps, D, R, ZC, DT).to(DT)
    KT = kv_cache.dtype.element_ty
    d = tl.arange(0, D)[None, :]
    k_new = _norm_rope_rows(k_row + kvh * D + one, one == 0, kw, cos + one, sin + one, rms_eps, D, R, ZC, DT).to(KT)
    v_new = tl.load(v_row + kvh * D + d).to(KT)
    slot = tl.load(slot_ptr).to(tl.int64)
    if store and slot >= 0:
        dst = kv_cache + (slot // PAGE_SIZE) * stride_page + kvh * stride_head + (slot % PAGE_SIZE) * stride_tok + d
        tl.store(dst, k_new)
        tl.store(dst + stride_kind, v_new)
    return qv, k_new, v_new


@triton.jit
def attend_block(q, kv_cache, out, part_acc, part_ml, cnt, q_start, qlen, seq_len, pt_row, kvh, num_kv_heads, mblk,
                 split, scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_page, stride_kind, stride_head,
                 stride_tok, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr, IEEE: tl.constexpr,
                 NSPLIT: tl.constexpr, EARLY: tl.constexpr = False, NORM: tl.constexpr = False, k_row=None,
                 v_row=None, qw=None, kw=None, cos=None, sin=None, slot_ptr=None, rms_eps=0.0, R: tl.constexpr = 0,
                 ZC: tl.constexpr = False, LEAVE: tl.constexpr = 0):
    """One (sequence, KV head, query block, key split) of `paged_attention`: the sequence's query
    tokens start at row `q_start` of q/out, `qlen` of them, `seq_len` keys, page-table row `pt_row`;
    `cnt` is the (sequence, KV head)'s arrival counter of the splits (unused when NSPLIT is 1).
    EARLY (the PDL flag of a kernel that has not waited yet): the split's first key block is read
    before `wait_prior` except this step's keys (positions >= seq_len - qlen), which the previous
    kernel stores and which are read after it; q is read after it too. Before an EARLY call the
    caller may have read the batch tensors (written before the forward) only.
    NORM (one query token a sequence, `norm_rope_paged_attention`): q holds the q/k/v projection's q
    rows (a head's at q + token * stride_qt + head * stride_qh), k_row / v_row / cos / sin the token's
    rows of k, v and the RoPE table; q and k are normed and roped here (weights qw, kw) as
    `qk_norm_rope` does, the new key and value enter the key blocks from registers, and the split that
    holds them stores them in the token's page slot (*slot_ptr; none where -1).
    LEAVE (split one-token launches): where 2 to LEAVE splits hold keys, their partials are left for
    the consumer to combine (`SplitPartials`) instead of the last of them combining (an arrival
    atomic and a reload of the partials: 2.0 us of a batch-1 layer on an H200 when skipped).
    Shared with the batch-1 decode-layer kernel (`nvl72.model.decode_layer`)."""
    rows = tl.arange(0, BLOCK_M * GROUP_PAD)  # row r: query token r // GROUP_PAD, head r % GROUP_PAD
    m = mblk * BLOCK_M + rows // GROUP_PAD
    g = rows % GROUP_PAD
    row_ok = (m < qlen) & (g < GROUP)
    qpos = seq_len - qlen + m  # [R] position of each row's token
    d = tl.arange(0, D)
    tok = (q_start + m).to(tl.int64)
    head = kvh * GROUP + g
    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, D], tl.float32)
    kv_end = tl.minimum(seq_len, seq_len - qlen + (mblk + 1) * BLOCK_M)  # keys the block's last token sees
    # split `split` takes whole BLOCK_N blocks [lo, hi) of the keys: the `active` first splits hold
    # keys, the others return at once (no partial, no arrival)
    chunk = split_chunk(kv_end, NSPLIT, BLOCK_N)
    active = tl.maximum(tl.cdiv(kv_end, chunk), 1)
    lo = split * chunk
    hi = tl.minimum(kv_end, lo + chunk)
    n = lo + tl.arange(0, BLOCK_N)  # the first block (none of it in a split past the keys)
    n_ok = n < tl.where(split < active, hi, lo)
    base = _kv_base(pt_row, n, n_ok, kvh, stride_page, stride_head, stride_tok, PAGE_SIZE)
    new = n_ok & (n >= seq_len - qlen)  # this step's keys (stored by the previous kernel, or NORM's)
    if EARLY:  # keys of earlier steps (complete before the previous kernel started) before the wait
        kt, vt = _kv_tile(kv_cache, base, n_ok & (n < seq_len - qlen), d, stride_kind)
        wait_prior(EARLY)
        if not NORM:
            kn, vn = _kv_tile(kv_cache, base, new, d, stride_kind)
            kt = tl.where(new[None, :], kn, kt)
            vt = tl.where(new[:, None], vn, vt)
    elif NORM:
        kt, vt = _kv_tile(kv_cache, base, n_ok & ~new, d, stride_kind)
    else:
        kt, vt = _kv_tile(kv_cache, base, n_ok, d, stride_kind)
    q_rows = q + tok[:, None] * stride_qt + head[:, None] * stride_qh  # [R, 1]
    if NORM:
        qv, k_new, v_new = _fresh_token(q_rows, row_ok[:, None], k_row, v_row, qw, kw, cos, sin, slot_ptr, kvh, rms_eps,
                                        split == active - 1, kv_cache, stride_page, stride_kind, stride_head,
                                        stride_tok, D, PAGE_SIZE, R, ZC, q.dtype.element_ty)
        kt = tl.where(new[None, :], tl.trans(k_new), kt)
        vt = tl.where(new[:, None], v_new, vt)
    else:
        qv = tl.load(q_rows + d[None, :], mask=row_ok[:, None], other=0.0)  # [R, D]
    if split < active:
        m_i, l_i, acc = _attend_keys(qv, kt, vt, n, n_ok, qpos, m_i, l_i, acc, scale, IEEE)
        for start in range(lo + BLOCK_N, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            base = _kv_base(pt_row, n, n_ok, kvh, stride_page, stride_head, stride_tok, PAGE_SIZE)
            kt, vt = _kv_tile(kv_cache, base, n_ok, d, stride_kind)
            if NORM:  # the new key in a later block of the split (contexts past NSPLIT x BLOCK_N keys)
                new = n == seq_len - 1
                kt = tl.where(new[None, :], tl.trans(k_new), kt)
                vt = tl.where(new[:, None], v_new, vt)
            m_i, l_i, acc = _attend_keys(qv, kt, vt, n, n_ok, qpos, m_i, l_i, acc, scale, IEEE)
        o_ptr = out + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # the rows' output over this program's keys
        if NSPLIT == 1:  # (constexpr: the atomics below need an int32 counter, which prefill does not pass)
            tl.store(o_ptr, o.to(out.dtype.element_ty), mask=row_ok[:, None])
        elif active == 1:  # the whole context in this program: no partials
            tl.store(o_ptr, o.to(out.dtype.element_ty), mask=row_ok[:, None])
        else:  # partial (max, sum, the split's output in part_acc's dtype) per row and split
            prow = (tok * (num_kv_heads * GROUP) + head) * NSPLIT  # [R] the row's split 0
            tl.store(part_ml + (prow + split) * 2, m_i, mask=row_ok)
            tl.store(part_ml + (prow + split) * 2 + 1, l_i, mask=row_ok)
            tl.store(part_acc + (prow + split)[:, None] * D + d[None, :], o, mask=row_ok[:, None])
            # the last of the active programs of (sequence, KV head) to finish combines the partials
            # (up to LEAVE of them: the consumer does): every thread's stores precede the barrier, the
            # counter's acq_rel add publishes them
            if active > LEAVE:
                _combine_last(out, part_acc, part_ml, cnt, o_ptr, prow, active, row_ok, BLOCK_M * GROUP_PAD, D)


@triton.jit
def _combine_last(out, part_acc, part_ml, cnt, o_ptr, prow, active, row_ok, R: tl.constexpr, D: tl.constexpr):
    """attend_block's combine of a split program whose partials are stored: the last of the `active`
    programs to arrive at counter `cnt` folds them into the rows' output (then zeroes the counter)."""
    d = tl.arange(0, D)
    tl.debug_barrier()
    if tl.atomic_add(cnt, 1) == active - 1:
        o = tl.zeros([R, D], tl.float32)
        den = tl.zeros([R], tl.float32)
        mx = tl.full([R], float("-inf"), tl.float32)
        for j0 in range(0, active, 4):  # four splits' partials per round trip (was one)
            o, den, mx = _combine4(part_acc + prow[:, None] * D + d[None, :], part_ml + prow * 2, j0, active, row_ok,
                                   o, den, mx, D)
        o = o / tl.where(den > 0.0, den, 1.0)[:, None]
        tl.store(o_ptr, o.to(out.dtype.element_ty), mask=row_ok[:, None])
        tl.atomic_xchg(cnt, 0)  # ready for the next launch (graph replays included)


@triton.jit
def _split_partial(acc_rows, ml_rows, j, active, row_ok, D: tl.constexpr):
    """Split j's partial of the rows: (unnormalised acc [R, D] fp32: the stored output times its sum,
    sum [R], max [R]); zeros and -inf for a split from `active` on or whose rows saw no key (sum 0).
    acc_rows / ml_rows: the rows' split 0."""
    ok = row_ok.to(tl.int32) * (j < active) > 0  # (bool tensor & bool scalar fails in the interpreter)
    out_j = tl.load(acc_rows + j * D, mask=ok[:, None], other=0.0, cache_modifier=".cg")
    l_j = tl.load(ml_rows + j * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
    m_j = tl.load(ml_rows + j * 2, mask=ok, other=0.0, cache_modifier=".cg")
    return out_j.to(tl.float32) * l_j[:, None], l_j, tl.where(l_j > 0.0, m_j, float("-inf"))


@triton.jit
def _combine4(acc_rows, ml_rows, j0, active, row_ok, o, den, mx, D: tl.constexpr):
    """Splits j0 .. j0 + 3's partials (`_split_partial`) folded into the rows' running (o, den, max)
    of the combine, their loads issued together (none depends on another)."""
    a0, l0, m0 = _split_partial(acc_rows, ml_rows, j0, active, row_ok, D)
    a1, l1, m1 = _split_partial(acc_rows, ml_rows, j0 + 1, active, row_ok, D)
    a2, l2, m2 = _split_partial(acc_rows, ml_rows, j0 + 2, active, row_ok, D)
    a3, l3, m3 = _split_partial(acc_rows, ml_rows, j0 + 3, active, row_ok, D)
    new = tl.maximum(tl.maximum(mx, tl.maximum(m0, m1)), tl.maximum(m2, m3))
    ref = tl.where(new == float("-inf"), 0.0, new)  # no key yet: every weight below is 0
    keep = tl.exp(mx - ref)
    w0, w1, w2, w3 = tl.exp(m0 - ref), tl.exp(m1 - ref), tl.exp(m2 - ref), tl.exp(m3 - ref)
    o = o * keep[:, None] + a0 * w0[:, None] + a1 * w1[:, None] + a2 * w2[:, None] + a3 * w3[:, None]
    return o, den * keep + l0 * w0 + l1 * w1 + l2 * w2 + l3 * w3, new


_SM_COUNT: dict[int, int] = {}
_SPLIT_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED_COUNTERS: list[torch.Tensor] = []  # outgrown buffers: CUDA graphs captured with them still use them


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """[>= n] int32 zeros kept per device: the arrival counters of the split programs, reset by
    the program that combines (so one zeroing at allocation serves every later launch; launches
    on one device must not overlap, as the decoder's layers on one stream do not). A larger n later
    gets a new buffer; the old one is kept alive, not freed, for the graphs that captured it."""
    c = _SPLIT_COUNTERS.get(device)
    if c is None or c.numel() < n:
        if c is not None:
            _RETIRED_COUNTERS.append(c)
        c = _SPLIT_COUNTERS[device] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return c


def decode_splits(device: torch.device, num_seqs: int, num_kv_heads: int, max_keys: int, block_n: int) -> int:
    """Splits of the key range per (sequence, KV head) for single-token queries: a power of two
    that brings the programs to about one per SM (at batch 1, 4 KV heads were 4 programs walking
    the whole context), no more than the page table's width holds key blocks. Host-only inputs:
    the launch stays graph-safe."""
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in _SM_COUNT:
            _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        sms = _SM_COUNT[idx]
    else:
        sms = 8  # the interpreter: exercise the split path on small batches
    want = min(sms // max(num_seqs * num_kv_heads, 1), triton.cdiv(max_keys, block_n), 64)
    return 1 if want < 2 else 1 << (want.bit_length() - 1)


def key_block(head_dim: int) -> int:
    """Keys a `paged_attention` program takes per block (its K/V tile's rows)."""
    return 64 if head_dim <= 128 else 32


def attention_shape_ok(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether `paged_attention` serves these heads: a whole query group per KV head and a
    power-of-two head_dim >= 16 (tl.dot and the head-dim arange)."""
    return num_heads % num_kv_heads == 0 and head_dim & (head_dim - 1) == 0 and head_dim >= 16


class QKNorm(NamedTuple):
    """`paged_attention`'s q/k RMSNorm + RoPE + K/V store of one-token queries, done in the attention
    kernel (`attend_block`'s NORM) instead of `qk_norm_rope`: k_raw [T, Hkv * D] and v [T, Hkv, D]
    rows of the q/k/v projection, the norm weights [D], cos/sin [T, R], slot_mapping [T]."""
    k_raw: torch.Tensor
    v: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    eps: float
    zero_centered: bool


class SplitPartials(NamedTuple):
    """A one-token `paged_attention_partials` launch's results: where 2 to `leave` of a sequence's
    `splits` hold keys (attend_block's `active`: whole `block_n`-key blocks, `split_chunk`), its rows
    of `out` are NOT written and the consumer combines acc / ml instead (the o_proj GEMV's x staging,
    nvl72.kernels.sm90_gemv: the attention then skips an arrival atomic and a reload of the partials);
    other sequences have `out` as `paged_attention`'s.
    acc [T, Hq, splits, D] in q's dtype (half fp32's bytes to read): split j's output of the row,
    sum(p * v) / sum(p); ml [T, Hq, splits, 2] fp32: its (max of the scaled scores, sum of p)."""
    out: torch.Tensor
    acc: torch.Tensor
    ml: torch.Tensor
    seq_lens: torch.Tensor
    splits: int
    block_n: int
    leave: int


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    page_table: torch.Tensor, max_query_len: int, scale: float,
                    out: torch.Tensor | None = None, splits: int | None = None,
                    norm: QKNorm | None = None) -> torch.Tensor:
    """Twin of `ops.paged_attention` from raw batch tensors (no metadata object, no host sync).

    q [T, Hq, D]; kv_cache [P, 2, Hkv, ps, D]; query_start_loc [B+1]; seq_lens [B]; page_table
    [B, max_pages] -> [T, Hq, D]. A sequence with no query tokens is skipped. Decode batches
    (max_query_len 1) split each sequence's keys over `splits` programs (default
    `decode_splits`): the splits past the keys do nothing, the last of a (sequence, KV head)'s others
    to finish combines them (a context within one split: that program writes the output).
    With `norm` (max_query_len 1 only) q is the projection's q before its norm and RoPE, and this
    step's K/V are not in the cache yet: the kernel norms, ropes and stores them (`QKNorm`)."""
    return paged_attention_partials(q, kv_cache, query_start_loc, seq_lens, page_table, max_query_len, scale, out,
                                    splits, norm).out


def paged_attention_partials(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                             seq_lens: torch.Tensor, page_table: torch.Tensor, max_query_len: int, scale: float,
                             out: torch.Tensor | None = None, splits: int | None = None, norm: QKNorm | None = None,
                             leave: int = 0) -> SplitPartials:
    """`paged_attention`, leaving the combine of up to `leave` splits to the consumer (`SplitPartials`;
    leave 0: none, the result's `out` is paged_attention's)."""
    t, hq, d = q.shape
    hkv, page_size = kv_cache.shape[2], kv_cache.shape[3]
    if not attention_shape_ok(hq, hkv, d):
        raise ValueError(f"paged_attention: {hq} query heads over {hkv} KV heads, head_dim {d} "
                         "(needs a whole group and a power-of-two head_dim >= 16)")
    if q.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("paged_attention needs a contiguous head_dim in q and the cache")
    if norm is not None:
        if max_query_len != 1:
            raise ValueError(f"paged_attention with the q/k norm inside: one query token a sequence "
                             f"(max_query_len={max_query_len})")
        if norm.k_raw.stride(1) != 1 or norm.v.stride(2) != 1 or norm.cos.stride(1) != 1 \
                or norm.cos.stride() != norm.sin.stride():
            raise ValueError("paged_attention with the q/k norm inside needs row-contiguous k, v, cos and sin")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    group = hq // hkv
    group_pad = triton.next_power_of_2(group)
    rows = 16 if max_query_len * group_pad <= 16 else 64  # tl.dot wants >= 16 rows
    block_m = max(rows // group_pad, 1)
    block_n = key_block(d)
    b = seq_lens.shape[0]
    if splits is None:
        splits = 1 if max_query_len != 1 else decode_splits(q.device, b, hkv, page_table.shape[1] * page_size,
                                                            block_n)
    if splits < 1 or splits & (splits - 1) or (splits > 1 and max_query_len != 1):
        raise ValueError(f"splits={splits}: a power of two, above 1 only for single-token queries "
                         f"(max_query_len={max_query_len})")
    if leave < 0 or (leave and max_query_len != 1):
        raise ValueError(f"leave={leave}: >= 0, above 0 only for single-token queries (max_query_len={max_query_len})")
    part_acc = part_ml = out  # unread without splits
    if t and b and max_query_len > 0:
        counters = out
        if splits > 1:
            part_acc = torch.empty(t, hq, splits, d, dtype=q.dtype, device=q.device)  # (vLLM's split decode too)
            part_ml = torch.empty(t, hq, splits, 2, dtype=torch.float32, device=q.device)
            counters = split_counters(q.device, b * hkv)
        if norm is None:
            norm_args = (q, q, q, q, q, q, q, 0.0, 0, 0, 0)  # unread
            rot, zc = 0, False
        else:
            norm_args = (norm.k_raw, norm.v, norm.q_weight, norm.k_weight, norm.cos, norm.sin, norm.slot_mapping,
                         norm.eps, norm.k_raw.stride(0), norm.v.stride(0), norm.cos.stride(0))
            rot, zc = norm.cos.shape[1], norm.zero_centered
        grid = (b, hkv, triton.cdiv(max_query_len, block_m) * splits)
        pdl = launch_args(q.device)
        _paged_attention_kernel[grid](
            q, kv_cache, out, part_acc, part_ml, counters, query_start_loc, seq_lens, page_table, scale, q.stride(0),
            q.stride(1), out.stride(0), out.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
            kv_cache.stride(3), page_table.stride(0), *norm_args, GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m,
            BLOCK_N=block_n, D=d, PAGE_SIZE=page_size, IEEE=q.dtype == torch.float32, NSPLIT=splits,
            EARLY=pdl["PDL"] and splits > 1, NORM=norm is not None, R=rot, ZC=zc, LEAVE=leave if splits > 1 else 0,
            num_warps=SPLIT_DECODE_WARPS if splits > 1 else 4, **pdl)
    return SplitPartials(out, part_acc, part_ml, seq_lens, splits, block_n, leave if splits > 1 else 0)


def norm_rope_paged_attention(q_raw: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                              k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                              head_dim: int, eps: float, zero_centered: bool, gated: bool, kv_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                              page_table: torch.Tensor, scale: float,
                              splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`qk_norm_rope` (with the K/V store) then `paged_attention` in one kernel, for one query token a
    sequence: at batch 1 one dependent launch fewer a layer. q_raw [T, Hq * D * (2 if gated else 1)],
    k_raw [T, Hkv * D], v [T, Hkv, D] -> (out [T, Hq, D], gate [T, Hq, D] view of q_raw or None)."""
    parts, gate = norm_rope_paged_attention_partials(q_raw, k_raw, v, q_weight, k_weight, cos, sin, num_heads,
                                                     head_dim, eps, zero_centered, gated, kv_cache, slot_mapping,
                                                     query_start_loc, seq_lens, page_table, scale, splits)
    return parts.out, gate


def norm_rope_paged_attention_partials(q_raw: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor,
                                       q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                                       sin: torch.Tensor, num_heads: int, head_dim: int, eps: float,
                                       zero_centered: bool, gated: bool, kv_cache: torch.Tensor,
                                       slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                                       seq_lens: torch.Tensor, page_table: torch.Tensor, scale: float,
                                       splits: int | None = None,
                                       leave: int = 0) -> tuple[SplitPartials, torch.Tensor | None]:
    """`norm_rope_paged_attention` as `paged_attention_partials`: (SplitPartials, gate or None)."""
    t = q_raw.shape[0]
    if q_raw.shape[1] != num_heads * head_dim * (2 if gated else 1) or q_raw.stride(1) != 1:
        raise ValueError(f"q_raw {tuple(q_raw.shape)} is not row-contiguous {num_heads} heads x head_dim "
                         f"{head_dim} (gated={gated})")
    if k_raw.shape[1] != v.shape[1] * head_dim:
        raise ValueError(f"k_raw {tuple(k_raw.shape)} does not match v {tuple(v.shape)}")
    heads = q_raw.view(t, num_heads, head_dim * (2 if gated else 1))
    norm = QKNorm(k_raw, v, q_weight, k_weight, cos, sin, slot_mapping, eps, zero_centered)
    parts = paged_attention_partials(heads[..., :head_dim], kv_cache, query_start_loc, seq_lens, page_table, 1, scale,
                                     splits=splits, norm=norm, leave=leave)
    return parts, (heads[..., head_dim:] if gated else None)
