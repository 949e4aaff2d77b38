"""Triton kernels of the Gated DeltaNet layer, reading and writing state slots in place.

Same signatures and semantics as the references in `gdn_ops.py` (which the tests compare them with):
- `causal_conv1d`: parallel over (tokens, channels) after gathering the start tails;
- `recurrent_gated_delta_rule` (decode, verify): one program per (sequence, value head, Dv tile)
  walks the sequence's tokens with its [Dk, BV] state tile in registers;
- `chunk_gated_delta_rule` (prefill): the intra-chunk part stays in torch (`prepare_chunks`, batched
  over all chunks); the carry across chunks is a kernel laid out like the recurrent one;
- `fused_recurrent_mix` (decode, verify: `GatedDeltaNet.mix_packed` on the fused backends): conv, gating,
  the recurrent rule and the gated RMSNorm in one launch laid out like the recurrent kernel, reading
  q/k/v/z/b/a in place from the packed projections' output.
A delta-rule program reads its state tile once before writing anything, so a sequence may write its
own read slot; unlike the references, different sequences are not ordered: a slot one sequence writes
must not be another's read slot in the same call (the engine never schedules that).
Every kernel takes `PDL` (programmatic dependent launch, `aot.pdl`): with it, it waits for the
previous kernel first thing and then lets the next one launch (`fused_recurrent_mix` first reads what
earlier steps wrote: its slots, state tile and conv tails).

Verified in Triton's interpreter (TRITON_INTERPRET=1) on CPU and compiled for sm_90 / sm_100 with
Triton 3.9; the cuda cases of tests/model/test_gdn_triton.py pass on an H200 (Triton 3.6, torch 2.11).
`fused_recurrent_mix` alone (a graph of launches, bf16, 16 key / 32 value heads of 128, every token
writing a state): 7.7 us at batch 1, 196 us at 128 decodes, against 61 and 301 us for the op chain it
replaced; in a Qwen3-Next-shaped batch-1 decode step it exposed ~12 us a layer before its first reads
moved ahead of the PDL wait (the step 1.354 -> 1.326 ms then; perf/RESULTS.md).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from aot.pdl import launch_args, wait_prior
from nvl72.model.fused_triton import split_counters
from nvl72.model.gdn_ops import check_heads, plan_chunks, prepare_chunks, unchunk


@triton.jit(do_not_specialize=["T"], do_not_specialize_on_alignment=["tok_seq", "qsl", "write_slots"])
def _causal_conv1d_kernel(x, w, tails, conv_state, out, tok_seq, qsl, write_slots, T, D, stride_x, stride_o,
                          K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    i_d, i_t = tl.program_id(0), tl.program_id(1)
    od = i_d * BD + tl.arange(0, BD)  # [BD] channels
    ot = i_t * BT + tl.arange(0, BT)  # [BT] tokens
    md, mt = od < D, ot < T
    m2 = mt[:, None] & md[None, :]
    seq = tl.load(tok_seq + ot, mask=mt, other=0).to(tl.int64)  # [BT]
    j = ot - tl.load(qsl + seq, mask=mt, other=0).to(tl.int64)  # [BT] position in its sequence
    ws = tl.load(write_slots + ot, mask=mt, other=-1).to(tl.int64)
    wmask = m2 & (ws >= 0)[:, None]
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for m in tl.static_range(K):
        # Input at position j + m - (K-1): a token of x, or before the sequence, its start tail.
        idx = j + (m - (K - 1))  # [BT]
        xv = tl.load(x + (ot + (m - (K - 1)))[:, None] * stride_x + od[None, :], mask=m2 & (idx >= 0)[:, None],
                     other=0.0)
        tv = tl.load(tails + (seq[:, None] * D + od[None, :]) * (K - 1) + (idx + (K - 1))[:, None],
                     mask=m2 & (idx < 0)[:, None], other=0.0)
        val = tl.where((idx >= 0)[:, None], xv.to(tl.float32), tv.to(tl.float32))  # [BT, BD]
        acc += val * tl.load(w + od * K + m, mask=md, other=0.0).to(tl.float32)[None, :]
        if m >= 1:  # the tail after token t is the inputs at j-K+2..j
            tl.store(conv_state + (ws[:, None] * D + od[None, :]) * (K - 1) + (m - 1),
                     val.to(conv_state.dtype.element_ty), mask=wmask)
    tl.store(out + ot[:, None] * stride_o + od[None, :], (acc * tl.sigmoid(acc)).to(out.dtype.element_ty), mask=m2)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                  query_start_loc: torch.Tensor, read_slots: torch.Tensor,
                  write_slots: torch.Tensor) -> torch.Tensor:
    """Twin of `gdn_ops.causal_conv1d`, parallel over tokens and channels. The start tails are first
    gathered (a [B, D, K-1] copy, small next to the recurrent state), so the kernel only writes
    conv_state and read/write order cannot matter.  x: [T, D]; weight: [D, K]; conv_state: [S, D, K-1]."""
    T, D = x.shape
    K = weight.shape[1]
    if x.stride(1) != 1 or not weight.is_contiguous() or not conv_state.is_contiguous():
        raise ValueError(f"causal_conv1d needs unit-stride channels and contiguous weight/conv_state; got "
                         f"x strides {x.stride()}, weight strides {weight.stride()}, "
                         f"conv_state strides {conv_state.stride()}")
    if conv_state.shape[1:] != (D, K - 1):
        raise ValueError(f"conv_state must be [slots, {D}, {K - 1}], got {tuple(conv_state.shape)}")
    out = torch.empty((T, D), dtype=x.dtype, device=x.device)
    B = read_slots.shape[0]
    if B and T:
        tails = conv_state[read_slots]  # [B, D, K-1]
        lens = query_start_loc[1:] - query_start_loc[:-1]
        tok_seq = torch.repeat_interleave(torch.arange(B, device=x.device), lens, output_size=T)  # [T]
        BT, BD = 16, 128
        _causal_conv1d_kernel[(triton.cdiv(D, BD), triton.cdiv(T, BT))](
            x, weight, tails, conv_state, out, tok_seq, query_start_loc, write_slots, T, D, x.stride(0),
            out.stride(0), K=K, BT=BT, BD=BD, **launch_args(x.device))
    return out


def _check_state(state: torch.Tensor, HV: int, DK: int, DV: int) -> None:
    if state.dtype != torch.float32 or not state.is_contiguous() or state.shape[1:] != (HV, DK, DV):
        raise ValueError(f"state must be contiguous float32 [slots, {HV}, {DK}, {DV}], got "
                         f"{state.dtype} {tuple(state.shape)} strides {state.stride()}")


@triton.jit(do_not_specialize_on_alignment=["qsl", "read_slots", "write_slots"])
def _recurrent_gdn_kernel(q, k, v, g, beta, o, state, qsl, read_slots, write_slots, scale,
                          stride_q, stride_k, stride_v, HK, HV, DK, DV,
                          BK: tl.constexpr, BV: tl.constexpr, USE_QK_L2NORM: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // HV, i_bh % HV
    i_hk = i_h // (HV // HK)
    ok = tl.arange(0, BK)  # [BK]
    ov = i_v * BV + tl.arange(0, BV)  # [BV]
    mk, mv = ok < DK, ov < DV
    start = tl.load(qsl + i_b).to(tl.int64)
    end = tl.load(qsl + i_b + 1).to(tl.int64)
    slot = tl.load(read_slots + i_b).to(tl.int64)
    slot_size = HV * DK * DV
    s_off = (i_h * DK + ok[:, None]) * DV + ov[None, :]  # [BK, BV] inside one slot [HV, DK, DV]
    s_mask = mk[:, None] & mv[None, :]
    S = tl.load(state + slot * slot_size + s_off, mask=s_mask, other=0.0)
    for t in range(start, end):
        qt = tl.load(q + t * stride_q + i_hk * DK + ok, mask=mk, other=0.0).to(tl.float32)
        kt = tl.load(k + t * stride_k + i_hk * DK + ok, mask=mk, other=0.0).to(tl.float32)
        vt = tl.load(v + t * stride_v + i_h * DV + ov, mask=mv, other=0.0).to(tl.float32)
        gt = tl.load(g + t * HV + i_h).to(tl.float32)
        bt = tl.load(beta + t * HV + i_h).to(tl.float32)
        if USE_QK_L2NORM:
            qt = qt * tl.rsqrt(tl.sum(qt * qt) + 1e-6)
            kt = kt * tl.rsqrt(tl.sum(kt * kt) + 1e-6)
        qt = qt * scale
        S = S * tl.exp(gt)
        delta = (vt - tl.sum(S * kt[:, None], 0)) * bt  # [BV]
        S = S + kt[:, None] * delta[None, :]
        ot = tl.sum(S * qt[:, None], 0)  # [BV]
        tl.store(o + (t * HV + i_h) * DV + ov, ot.to(o.dtype.element_ty), mask=mv)
        ws = tl.load(write_slots + t).to(tl.int64)
        if ws >= 0:
            tl.store(state + ws * slot_size + s_off, S, mask=s_mask)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor, query_start_loc: torch.Tensor,
                               read_slots: torch.Tensor, write_slots: torch.Tensor,
                               use_qk_l2norm: bool = True) -> torch.Tensor:
    """Triton twin of `gdn_ops.recurrent_gated_delta_rule`.
    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta: [T, Hv]; state: [S, Hv, Dk, Dv] fp32."""
    check_heads(q, k, v)
    T, HK, DK = q.shape
    HV, DV = v.shape[1:]
    for name, t, inner in (("q", q, DK), ("k", k, DK), ("v", v, DV)):
        if t.stride(2) != 1 or t.stride(1) != inner:
            raise ValueError(f"{name} needs contiguous heads within a token, got strides {t.stride()}")
    _check_state(state, HV, DK, DV)
    g, beta = g.float().contiguous(), beta.contiguous()
    o = torch.empty((T, HV, DV), dtype=v.dtype, device=v.device)
    B = read_slots.shape[0]
    BV = min(32, triton.next_power_of_2(DV))
    if B and T:
        _recurrent_gdn_kernel[(triton.cdiv(DV, BV), B * HV)](
            q, k, v, g, beta, o, state, query_start_loc, read_slots, write_slots, DK ** -0.5,
            q.stride(0), k.stride(0), v.stride(0), HK, HV, DK, DV,
            BK=triton.next_power_of_2(DK), BV=BV, USE_QK_L2NORM=use_qk_l2norm, **launch_args(v.device))
    return o


@triton.jit
def _conv_tail(conv_state, slot, CD, ch, mc, K: tl.constexpr, BC: tl.constexpr):
    """Channels `ch`'s K-1 inputs before a sequence (its read slot's tail), fp32 [len(ch), BC]."""
    cols = tl.arange(0, BC)
    return tl.load(conv_state + (slot * CD + ch[:, None]) * (K - 1) + cols[None, :],
                   mask=mc[:, None] & (cols < K - 1)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _conv_silu(x, stride_x, row0, j, tail, w, conv_state, ws, CD, ch, oc, mc, K: tl.constexpr, BC: tl.constexpr):
    """Causal conv + SiLU of channels `ch` at position j of a sequence whose first token is row `row0`
    (input `x + row * stride_x + oc`; before the sequence, `tail`); writes the K-1 inputs ending at j
    into conv_state slot `ws` if >= 0. fp32 [len(ch)]."""
    cols = tl.arange(0, BC)
    acc = tl.zeros(oc.shape, tl.float32)
    # (masks combine through tl.where: a scalar & a vector is no bool mask in the interpreter)
    for m in tl.static_range(K):
        idx = j + (m - (K - 1))  # position of tap m's input in the sequence
        xv = tl.load(x + (row0 + idx) * stride_x + oc, mask=tl.where(idx >= 0, mc, False), other=0.0).to(tl.float32)
        tv = tl.sum(tl.where(cols[None, :] == idx + (K - 1), tail, 0.0), 1)
        val = tl.where(idx >= 0, xv, tv)
        acc += val * tl.load(w + ch * K + m, mask=mc, other=0.0).to(tl.float32)
        if m >= 1:
            tl.store(conv_state + (ws * CD + ch) * (K - 1) + (m - 1), val.to(conv_state.dtype.element_ty),
                     mask=tl.where(ws >= 0, mc, False))
    return acc * tl.sigmoid(acc)


@triton.jit(do_not_specialize_on_alignment=["qsl", "read_slots", "write_slots"])
def _fused_recurrent_mix_kernel(q, k, v, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_state, state, o_raw, out,
                                counters, qsl, read_slots, write_slots, scale, eps,
                                sq_t, sq_g, sk_t, sk_g, sv_t, sv_g, sv_r, sz_t, sz_g, sz_r,
                                sb_t, sb_g, sb_r, sa_t, sa_g, sa_r, stride_o, HK, R, DK, DV,
                                K: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr,
                                BC: tl.constexpr, PDL: tl.constexpr):
    # Before the PDL wait, everything the projections (the previous kernel) do not write: the step's slots
    # and the state tile and conv tails of the last step (aot.pdl's rule: written two kernels back or more)
    i_v, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // R
    HV = HK * R
    CD = 2 * HK * DK + HV * DV  # conv channels: q heads | k heads | v heads
    ok, ov = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    mk, mv = ok < DK, ov < DV
    start = tl.load(qsl + i_b).to(tl.int64)
    end = tl.load(qsl + i_b + 1).to(tl.int64)
    rs = tl.load(read_slots + i_b).to(tl.int64)
    q, k = q + i_hk * sq_g, k + i_hk * sk_g
    vh, zh = v + i_hk * sv_g + (i_h % R) * sv_r, z + i_hk * sz_g
    cq, ck, cv = i_hk * DK + ok, (HK + i_hk) * DK + ok, 2 * HK * DK + i_h * DV + ov  # conv channels
    # Start tails in registers before any write (a token may write the read slot). A program's v channels
    # are its own; the q/k ones, which all the key head's programs read, the last of them writes (below).
    q_tail = _conv_tail(conv_state, rs, CD, cq, mk, K, BC)
    k_tail = _conv_tail(conv_state, rs, CD, ck, mk, K, BC)
    v_tail = _conv_tail(conv_state, rs, CD, cv, mv, K, BC)
    neg_a = -tl.exp(tl.load(A_log + i_h).to(tl.float32))
    dtb = tl.load(dt_bias + i_h).to(tl.float32)
    slot_size = HV * DK * DV
    s_off = (i_h * DK + ok[:, None]) * DV + ov[None, :]  # [BK, BV] inside one slot [HV, DK, DV]
    s_mask = mk[:, None] & mv[None, :]
    S = tl.load(state + rs * slot_size + s_off, mask=s_mask, other=0.0)
    wait_prior(PDL)
    for t in range(start, end):
        j = t - start
        ws = tl.load(write_slots + t).to(tl.int64)
        qt = _conv_silu(q, sq_t, start, j, q_tail, conv_w, conv_state, -1, CD, cq, ok, mk, K, BC)
        kt = _conv_silu(k, sk_t, start, j, k_tail, conv_w, conv_state, -1, CD, ck, ok, mk, K, BC)
        vt = _conv_silu(vh, sv_t, start, j, v_tail, conv_w, conv_state, ws, CD, cv, ov, mv, K, BC)
        qt = qt * (tl.rsqrt(tl.sum(qt * qt) + 1e-6) * scale)
        kt = kt * tl.rsqrt(tl.sum(kt * kt) + 1e-6)
        at = tl.load(a + t * sa_t + i_hk * sa_g + (i_h % R) * sa_r).to(tl.float32) + dtb
        gt = neg_a * tl.where(at > 20.0, at, tl.log(1.0 + tl.exp(at)))  # softplus, torch's threshold
        bt = tl.sigmoid(tl.load(b + t * sb_t + i_hk * sb_g + (i_h % R) * sb_r).to(tl.float32))
        S = S * tl.exp(gt)
        delta = (vt - tl.sum(S * kt[:, None], 0)) * bt  # [BV]
        S = S + kt[:, None] * delta[None, :]
        tl.store(o_raw + (t * HV + i_h) * DV + ov, tl.sum(S * qt[:, None], 0), mask=mv)
        if ws >= 0:
            tl.store(state + ws * slot_size + s_off, S, mask=s_mask)
    # The norm needs whole heads: the last program of the key head to arrive (after every other one
    # stored its o tiles and read the q/k tails) norms the group's rows and writes the q/k tails.
    cnt = counters + i_b * HK + i_hk
    tl.debug_barrier()
    if tl.atomic_add(cnt, 1) == tl.num_programs(0) * R - 1:
        od = tl.arange(0, BD)
        md = od < DV
        nw = tl.load(norm_w + od, mask=md, other=0.0).to(tl.float32)
        for t in range(start, end):
            ws = tl.load(write_slots + t).to(tl.int64)
            _conv_silu(q, sq_t, start, t - start, q_tail, conv_w, conv_state, ws, CD, cq, ok, mk, K, BC)
            _conv_silu(k, sk_t, start, t - start, k_tail, conv_w, conv_state, ws, CD, ck, ok, mk, K, BC)
            for i in range(R):
                ot = tl.load(o_raw + (t * HV + i_hk * R + i) * DV + od, mask=md, other=0.0, cache_modifier=".cg")
                zt = tl.load(zh + t * sz_t + i * sz_r + od, mask=md, other=0.0).to(tl.float32)
                y = ot * tl.rsqrt(tl.sum(ot * ot) / DV + eps) * nw * (zt * tl.sigmoid(zt))
                tl.store(out + t * stride_o + (i_hk * R + i) * DV + od, y.to(out.dtype.element_ty), mask=md)
        tl.atomic_xchg(cnt, 0)  # ready for the next launch (graph replays included)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 1 elsewhere (the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def fused_recurrent_mix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, z: torch.Tensor, b: torch.Tensor,
                        a: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                        norm_weight: torch.Tensor, eps: float, conv_state: torch.Tensor, state: torch.Tensor,
                        query_start_loc: torch.Tensor, read_slots: torch.Tensor, write_slots: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """Everything between the input projections and out_proj for sequences of few tokens (decode, verify),
    in one launch: `gated_rmsnorm(recurrent_gated_delta_rule(causal_conv1d(q|k|v), gdn_gating(...)), z)`
    of `gdn_ops` (fp32 throughout, where the layer rounds the conv and core outputs to the activation
    dtype), conv and recurrent state slots read and written as there. Graph-safe: no host reads.

    q, k, v, z, b, a are strided views of the projection outputs, grouped per key head, so either
    checkpoint layout (or column slices of one packed GEMM output) is read in place: q, k [T, Hk, Dk];
    v, z [T, Hk, r, Dv] (value head g*r + i at [:, g, i]); b, a [T, Hk, r]; every Dk / Dv unit-stride.
    conv_weight [conv_dim, K] and conv_state [S, conv_dim, K-1] in the q | k | v head order of `mixed_qkv`;
    state [S, Hv, Dk, Dv] fp32; A_log, dt_bias [Hv]; norm_weight [Dv].  ->  out [T, Hv*Dv] in v's dtype.
    One program per (Dv tile, value head, sequence); the last of a key head's programs to finish (an
    arrival counter, `split_counters`: launches on one device must not overlap) norms its whole value
    heads and writes the q/k conv tails, which all of them read first."""
    T, HK, DK = q.shape
    R, DV = v.shape[2:]
    HV, K = HK * R, conv_weight.shape[1]
    CD = 2 * HK * DK + HV * DV
    if (k.shape != q.shape or v.dim() != 4 or v.shape[:2] != (T, HK) or z.shape != v.shape
            or b.shape != (T, HK, R) or a.shape != b.shape):
        raise ValueError(f"fused_recurrent_mix needs q, k [T, Hk, Dk], v, z [T, Hk, r, Dv], b, a [T, Hk, r]; got "
                         f"{[tuple(t.shape) for t in (q, k, v, z, b, a)]}")
    if any(t.stride(-1) != 1 for t in (q, k, v, z)):
        raise ValueError("fused_recurrent_mix needs unit-stride head dims in q, k, v, z; got strides "
                         f"{[t.stride() for t in (q, k, v, z)]}")
    if (conv_weight.shape != (CD, K) or not conv_weight.is_contiguous() or not conv_state.is_contiguous()
            or conv_state.shape[1:] != (CD, K - 1)):
        raise ValueError(f"conv_weight must be contiguous [{CD}, K] and conv_state [slots, {CD}, K-1]; got "
                         f"{tuple(conv_weight.shape)} and {tuple(conv_state.shape)} strides {conv_state.stride()}")
    if any(p.shape != (n,) or not p.is_contiguous() for p, n in ((A_log, HV), (dt_bias, HV), (norm_weight, DV))):
        raise ValueError(f"A_log, dt_bias must be [{HV}] and norm_weight [{DV}], contiguous")
    _check_state(state, HV, DK, DV)
    if out is None:
        out = torch.empty((T, HV * DV), dtype=v.dtype, device=v.device)
    elif out.shape != (T, HV * DV) or out.stride(1) != 1:
        raise ValueError(f"out must be [{T}, {HV * DV}] with unit column stride, got {tuple(out.shape)}")
    B = read_slots.shape[0]
    if B and T:
        # Whole heads once the batch fills the SMs (fewer programs redoing the q/k conv), 32-wide Dv tiles
        # below that to spread it (H200, 32 heads of 128: batch 1 7.7 vs 9.6 us, batch 128 196 vs 286 us).
        BD = triton.next_power_of_2(DV)
        BV = BD if B * HV >= _num_sms(v.device) else min(32, BD)
        o_raw = torch.empty((T, HV, DV), dtype=torch.float32, device=v.device)  # before the norm
        _fused_recurrent_mix_kernel[(triton.cdiv(DV, BV), HV, B)](
            q, k, v, z, b, a, conv_weight, A_log, dt_bias, norm_weight, conv_state, state, o_raw, out,
            split_counters(v.device, B * HK), query_start_loc, read_slots, write_slots, DK ** -0.5, eps,
            *q.stride()[:2], *k.stride()[:2], *v.stride()[:3], *z.stride()[:3], *b.stride(), *a.stride(),
            out.stride(0), HK, R, DK, DV, K=K, BK=triton.next_power_of_2(DK), BV=BV, BD=BD,
            BC=triton.next_power_of_2(K - 1), **launch_args(v.device))
    return out


@triton.jit(do_not_specialize_on_alignment=["seq_chunks", "read_slots", "wslots"])
def _chunk_scan_kernel(u, w, q_dec, k, k_dec, attn, decay, gam, o, state, seq_chunks, read_slots, wslots,
                       HV, DK, DV, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // HV, i_bh % HV
    oc = tl.arange(0, C)  # [C] chunk positions
    ok = tl.arange(0, BK)
    ov = i_v * BV + tl.arange(0, BV)
    mk, mv = ok < DK, ov < DV
    slot_size = HV * DK * DV
    s_off = (i_h * DK + ok[:, None]) * DV + ov[None, :]  # [BK, BV] inside one slot
    s_mask = mk[:, None] & mv[None, :]
    S = tl.load(state + tl.load(read_slots + i_b).to(tl.int64) * slot_size + s_off, mask=s_mask, other=0.0)
    c0 = tl.load(seq_chunks + i_b)
    c1 = tl.load(seq_chunks + i_b + 1)
    ck_off = oc[:, None] * DK + ok[None, :]  # [C, BK] inside one (chunk, head)
    ck_mask = mk[None, :]
    cv_off = oc[:, None] * DV + ov[None, :]  # [C, BV]
    cv_mask = mv[None, :]
    for c in range(c0, c1):
        ch = c * HV + i_h  # (chunk, head) index
        W = tl.load(w + ch * C * DK + ck_off, mask=ck_mask, other=0.0)
        v_new = tl.load(u + ch * C * DV + cv_off, mask=cv_mask, other=0.0) \
            - tl.dot(W, S, input_precision="ieee")  # [C, BV]
        Qd = tl.load(q_dec + ch * C * DK + ck_off, mask=ck_mask, other=0.0)
        At = tl.load(attn + ch * C * C + oc[:, None] * C + oc[None, :])
        out = tl.dot(Qd, S, input_precision="ieee") + tl.dot(At, v_new, input_precision="ieee")
        tl.store(o + ch * C * DV + cv_off, out, mask=cv_mask)
        for p in range(C):
            ws = tl.load(wslots + c * C + p)
            if ws >= 0:
                # State after position p: exp(gam_p) S + sum_{j <= p} exp(gam_p - gam_j) k_j v_new_j^T.
                drow = tl.load(decay + (ch * C + p) * C + oc)  # [C]
                Kp = tl.load(k + ch * C * DK + ck_off, mask=ck_mask, other=0.0) * drow[:, None]
                S_p = S * tl.exp(tl.load(gam + ch * C + p)) + tl.dot(tl.trans(Kp), v_new, input_precision="ieee")
                tl.store(state + ws * slot_size + s_off, S_p, mask=s_mask)
        Kd = tl.load(k_dec + ch * C * DK + ck_off, mask=ck_mask, other=0.0)
        S = S * tl.exp(tl.load(gam + ch * C + C - 1)) + tl.dot(tl.trans(Kd), v_new, input_precision="ieee")


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor, query_start_loc: torch.Tensor,
                           read_slots: torch.Tensor, write_slots: torch.Tensor, chunk_size: int = 64,
                           use_qk_l2norm: bool = True) -> torch.Tensor:
    """Twin of `gdn_ops.chunk_gated_delta_rule`: the intra-chunk part stays in torch (batched over all
    chunks), the carry across chunks is this kernel (one program per sequence, value head, Dv tile),
    so a prefill costs a fixed number of launches instead of one loop step per chunk."""
    check_heads(q, k, v)
    HV, DV = v.shape[1:]
    DK = q.shape[2]
    _check_state(state, HV, DK, DV)
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16 for tl.dot, got {chunk_size}")
    plan = plan_chunks(query_start_loc, write_slots, chunk_size)
    ct = prepare_chunks(q, k, v, g, beta, plan, use_qk_l2norm)
    o = torch.empty_like(ct.u)  # [N, H, C, Dv]
    B = read_slots.shape[0]
    # 16-wide Dv tiles on 8 warps: twice the programs of 32-wide ones on 4, each with half the state
    # (H200, a 1K-token prefill, 16 / 32 heads of 128: 8.95 -> 3.34 ms for this function, same numerics)
    BV = 16
    if B and o.numel():
        _chunk_scan_kernel[(triton.cdiv(DV, BV), B * HV)](
            ct.u, ct.w, ct.q_dec, ct.k, ct.k_dec, ct.attn, ct.decay, ct.gam, o, state, plan.seq_chunks,
            read_slots, plan.write_slots, HV, DK, DV,
            C=chunk_size, BK=max(16, triton.next_power_of_2(DK)), BV=BV, num_warps=8, **launch_args(o.device))
    return unchunk(o, plan, v.shape[0]).to(v.dtype)
