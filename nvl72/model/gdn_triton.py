"""Triton kernels of the Gated DeltaNet layer, reading and writing state slots in place.

Same signatures and semantics as the references in `gdn_ops.py` (which the tests compare them with):
- `causal_conv1d`: parallel over (tokens, channels) after gathering the start tails;
- `recurrent_gated_delta_rule` (decode, verify): one program per (sequence, value head, Dv tile)
  walks the sequence's tokens with its [Dk, BV] state tile in registers;
- `chunk_gated_delta_rule` (prefill): the intra-chunk part stays in torch (`prepare_chunks`, batched
  over all chunks); the carry across chunks is a kernel laid out like the recurrent one.
A delta-rule program reads its state tile once before writing anything, so a sequence may write its
own read slot; unlike the references, different sequences are not ordered: a slot one sequence writes
must not be another's read slot in the same call (the engine never schedules that).
Every kernel takes `PDL` (programmatic dependent launch, `aot.pdl`): with it, it waits for the
previous kernel first thing and then lets the next one launch.

Verified in Triton's interpreter (TRITON_INTERPRET=1) on CPU and compiled for sm_90 / sm_100 with
Triton 3.9; not yet run or timed on a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from aot.pdl import launch_args, wait_prior
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
