"""Triton kernels of the Gated DeltaNet decode path, reading and writing state slots in place.

Same signatures and semantics as the references in `gdn_ops.py` (which the tests compare them with):
`causal_conv1d` and `recurrent_gated_delta_rule`. One program owns one sequence and one tile of
channels (conv) or of one value head's Dv columns (delta rule) and walks that sequence's tokens,
keeping the conv window / the [Dk, BV] state tile in registers: each slot tile is read once before
the program writes anything, so a write slot may equal the read slot. Unlike the references, reads
and writes of *different* sequences are not ordered: a slot one sequence writes must not be another
sequence's read slot in the same call (the engine never schedules that).

Verified so far in Triton's interpreter (TRITON_INTERPRET=1) on CPU; GPU timings: none yet.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _causal_conv1d_kernel(x, w, conv_state, out, qsl, read_slots, write_slots, D, stride_x, stride_o,
                          K: tl.constexpr, KP: tl.constexpr, BD: tl.constexpr):
    i_d, i_b = tl.program_id(0), tl.program_id(1)
    od = i_d * BD + tl.arange(0, BD)  # [BD] channels
    oc = tl.arange(0, KP)  # [KP] window columns, K used
    md = od < D
    start = tl.load(qsl + i_b).to(tl.int64)
    end = tl.load(qsl + i_b + 1).to(tl.int64)
    slot = tl.load(read_slots + i_b).to(tl.int64)
    tail_off = od[:, None] * (K - 1) + oc[None, :]  # [BD, KP] inside one slot [D, K-1]
    tail_mask = md[:, None] & (oc[None, :] < K - 1)
    # Columns 0..K-2: the last K-1 inputs; column K-1 takes the current token.
    win = tl.load(conv_state + slot * D * (K - 1) + tail_off, mask=tail_mask, other=0.0).to(tl.float32)
    wt = tl.load(w + od[:, None] * K + oc[None, :], mask=md[:, None] & (oc[None, :] < K), other=0.0).to(tl.float32)
    # shift[c, c'] = 1 where c' == c + 1: moves every column one to the left.
    shift = (oc[None, :] == oc[:, None] + 1).to(tl.float32)  # [KP, KP]
    for t in range(start, end):
        xt = tl.load(x + t * stride_x + od, mask=md, other=0.0).to(tl.float32)
        win = tl.where(oc[None, :] == K - 1, xt[:, None], win)
        acc = tl.sum(win * wt, 1)
        tl.store(out + t * stride_o + od, (acc * tl.sigmoid(acc)).to(out.dtype.element_ty), mask=md)
        win = tl.sum(win[:, None, :] * shift[None, :, :], 2)  # [BD, KP]
        ws = tl.load(write_slots + t).to(tl.int64)
        if ws >= 0:
            tl.store(conv_state + ws * D * (K - 1) + tail_off, win.to(conv_state.dtype.element_ty), mask=tail_mask)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                  query_start_loc: torch.Tensor, read_slots: torch.Tensor,
                  write_slots: torch.Tensor) -> torch.Tensor:
    """Triton twin of `gdn_ops.causal_conv1d`.  x: [T, D]; weight: [D, K]; conv_state: [S, D, K-1]."""
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
    BD = 128
    if B and T:
        _causal_conv1d_kernel[(triton.cdiv(D, BD), B)](
            x, weight, conv_state, out, query_start_loc, read_slots, write_slots, D, x.stride(0), out.stride(0),
            K=K, KP=triton.next_power_of_2(K), BD=BD)
    return out


@triton.jit
def _recurrent_gdn_kernel(q, k, v, g, beta, o, state, qsl, read_slots, write_slots, scale,
                          stride_q, stride_k, stride_v, HK, HV, DK, DV,
                          BK: tl.constexpr, BV: tl.constexpr, USE_QK_L2NORM: tl.constexpr):
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
    T, HK, DK = q.shape
    HV, DV = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != T or HV % HK:
        raise ValueError(f"q, k must be [T, Hk, Dk] and v [T, Hv, Dv] with Hv a multiple of Hk; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    for name, t, inner in (("q", q, DK), ("k", k, DK), ("v", v, DV)):
        if t.stride(2) != 1 or t.stride(1) != inner:
            raise ValueError(f"{name} needs contiguous heads within a token, got strides {t.stride()}")
    if state.dtype != torch.float32 or not state.is_contiguous() or state.shape[1:] != (HV, DK, DV):
        raise ValueError(f"state must be contiguous float32 [slots, {HV}, {DK}, {DV}], got "
                         f"{state.dtype} {tuple(state.shape)} strides {state.stride()}")
    g, beta = g.float().contiguous(), beta.contiguous()
    o = torch.empty((T, HV, DV), dtype=v.dtype, device=v.device)
    B = read_slots.shape[0]
    BV = min(32, triton.next_power_of_2(DV))
    if B and T:
        _recurrent_gdn_kernel[(triton.cdiv(DV, BV), B * HV)](
            q, k, v, g, beta, o, state, query_start_loc, read_slots, write_slots, DK ** -0.5,
            q.stride(0), k.stride(0), v.stride(0), HK, HV, DK, DV,
            BK=triton.next_power_of_2(DK), BV=BV, USE_QK_L2NORM=use_qk_l2norm)
    return o
