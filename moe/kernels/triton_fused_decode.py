"""Few-token decode path of the FP8 MoE layer in two Triton kernels that read the FP8 expert
weights directly (no permutation, no activation quantization, no grouped GEMM).

At one to a few tokens the pipeline of moe/backend.py (permute, gather + quantize, grouped GEMM,
SiLU-and-mul + quantize, grouped GEMM, un-permute: 6 launches after routing) is bound by launch
and dependency latency, not by the ~38 MB of active expert weights per Qwen3-30B-A3B layer. Here:

  `gate_up`  program (pair p = (t, slot), block of BLOCK_N rows of I): silu(x[t] . gate) * (x[t] . up)
             over K = H, in fp32, into a scratch act [T * k, I] fp32; a pair whose expert belongs to
             another EP rank does nothing (its row stays unwritten and is never read).
  `down`     program (token t, block of BLOCK_N2 rows of H): sum over the token's local slots of
             topk_weight * (act[p] . w2[e] rows), all k slots' weight tiles loaded together (one
             [k, BLOCK_N2, BLOCK_K2] tile per K step, so a one-token launch of H / BLOCK_N2 programs
             still has enough bytes in flight), then + sigmoid(shared_gate[t]) * shared[t] (the
             semantics of triton_moe.unpermute); out [T, H] in x's dtype. No atomics: deterministic.

Weights as `Fp8PipelineBackend.prepare` makes them (moe.mxfp8.quantize_experts' q_sm90 / scale_sm90):
w13 e4m3 [E_local, 2I, H] (rows [0, I) gate, [I, 2I) up), w2 e4m3 [E_local, H, I], and one fp32
power-of-two scale per 128 x 128 block. A row block of BLOCK_N (a divisor of 128) lies in one scale
row, so a K tile's scales are a [BLOCK_K] vector (one value per 128 columns) folded into the
activation before the dot, not a multiply per weight element.

The scratch is fp32: [T * k, I] is 24 KB at one token (nothing beside the weights), and keeping it
unrounded makes the path's only quantization the weights' own (the pipeline rounds activations to
FP8 with 1 x 128 scales twice).

PDL (`aot.pdl`): which expert's weights to read comes from topk_ids, which the routing kernel
writes just before `gate_up`, so `gate_up` waits first (aot.pdl's rule: nothing the previous kernel
writes is read before `wait_prior`); after it, each K step's tile is loaded one step ahead, as
nvl72.model.fused_triton's GEMV does, and so are the step's activations and block scales (loaded in the
step that used them they were one dependent L2 round trip a step: H100, 48 layers, batch 1: 2.621-2.634
-> 2.591-2.594 ms a step, perf/RESULTS.md). The early launch still hides launch and block scheduling.
For `down` the routing is two kernels back: `down(early=True)` (fused_decode's default, EARLY_W2)
reads it and its first w2 tiles before its wait, while gate_up runs; see `down` for why that holds.
Grids depend on T only (no size argument changes per step) and the per-step tensors are not
specialised on alignment, so serving compiles nothing new; no host sync (CUDA-graph safe).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from aot.pdl import launch_args, wait_prior

SCALE_BLOCK = 128  # the weights' scale block (rows and columns)
# defaults for Qwen3-30B-A3B (H=2048, I=768, k=8) at one token: gate_up 8 pairs x 48 row blocks
# = 384 programs of 8 warps with a [16, 256] gate and up tile per K step (the fastest of the sweeps on
# an H200, 2026-11-22, and an H100, 2026-11-28: perf/RESULTS.md); down 128 programs, each with a
# [k, 16, 128] fp8 tile (16 KB) per K step
BLOCK_N, BLOCK_K, NUM_WARPS = 16, 256, 8
BLOCK_N2, BLOCK_K2, NUM_WARPS2 = 16, 128, 8
# `down(early=True)`: its routing and first w2 tiles read before the PDL wait (H100, Qwen3-30B-A3B shape,
# 48 layers: batch-1 step 2.739-2.747 vs 2.813-2.824 ms; perf/RESULTS.md)
EARLY_W2 = True


@triton.jit(do_not_specialize_on_alignment=["x_ptr", "ids_ptr", "act_ptr"])
def _gate_up_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, act_ptr, H, I, num_local, expert_offset, K: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Program (p, j): rows [j * BLOCK_N, +BLOCK_N) of pair p's act = silu(gate) * up."""
    wait_prior(PDL)
    p = tl.program_id(0)
    e = tl.load(ids_ptr + p) - expert_offset
    if (e >= 0) & (e < num_local):
        n0 = tl.program_id(1) * BLOCK_N
        act = gate_up_rows(x_ptr + (p // K).to(tl.int64) * H, e.to(tl.int64), w_ptr, s_ptr, H, I, n0, BLOCK_N, BLOCK_K)
        tl.store(act_ptr + p.to(tl.int64) * I + n0 + tl.arange(0, BLOCK_N), act)


@triton.jit
def gate_up_rows(xr, e64, w_ptr, s_ptr, H, I, n0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """silu(x . gate) * (x . up) [BLOCK_N] fp32 for rows [n0, n0 + BLOCK_N) of local expert e64,
    x the row at `xr` (H values). Shared with the batch-1 decode-layer kernel (nvl72.model.decode_layer)."""
    rows = n0 + tl.arange(0, BLOCK_N)
    kc = tl.arange(0, BLOCK_K)
    nkb = H // 128
    g_rows = w_ptr + (e64 * 2 * I + rows[:, None]) * H
    u_rows = g_rows + I * H
    sg = s_ptr + (e64 * (2 * I // 128) + n0 // 128) * nkb  # this row block's scales along K
    su = s_ptr + (e64 * (2 * I // 128) + (I + n0) // 128) * nkb
    m = kc[None, :] < H
    gv = tl.load(g_rows + kc[None, :], mask=m, other=0.0)
    uv = tl.load(u_rows + kc[None, :], mask=m, other=0.0)
    xv, s_g, s_u = _x_and_scales(xr, sg, su, kc, H)
    acc_g = tl.zeros([BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        nc = k0 + kc + BLOCK_K  # the next step's columns (all masked after the last step)
        nm = nc[None, :] < H
        g_next = tl.load(g_rows + nc[None, :], mask=nm, other=0.0)
        u_next = tl.load(u_rows + nc[None, :], mask=nm, other=0.0)
        x_next, sg_next, su_next = _x_and_scales(xr, sg, su, nc, H)
        acc_g += tl.sum(gv.to(tl.float32) * (xv * s_g)[None, :], 1)
        acc_u += tl.sum(uv.to(tl.float32) * (xv * s_u)[None, :], 1)
        gv, uv, xv, s_g, s_u = g_next, u_next, x_next, sg_next, su_next
    return acc_g / (1.0 + tl.exp(-acc_g)) * acc_u


@triton.jit
def _x_and_scales(xr, sg, su, c, H):
    """x at columns c (fp32) and the gate / up scales of their 128-blocks, zeros past H: loaded a step
    ahead of their use, as the weight tiles are (in the step that used them they were a dependent
    L2 round trip each)."""
    cm = c < H
    return (tl.load(xr + c, mask=cm, other=0.0).to(tl.float32), tl.load(sg + c // 128, mask=cm, other=0.0),
            tl.load(su + c // 128, mask=cm, other=0.0))


@triton.jit(do_not_specialize_on_alignment=["act_ptr", "ids_ptr", "tw_ptr", "out_ptr", "sh_ptr", "g_ptr"])
def _down_kernel(act_ptr, ids_ptr, tw_ptr, w_ptr, s_ptr, out_ptr, sh_ptr, g_ptr, H, I, num_local, expert_offset,
                 K: tl.constexpr, KP: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
    """Program (t, j): out[t, rows [j * BLOCK_N, +BLOCK_N)]. EARLY: the routing and the first weight
    tile are read before waiting (see `down`)."""
    if not EARLY:
        wait_prior(PDL)
    t = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    y = down_rows(act_ptr, ids_ptr, tw_ptr, w_ptr, s_ptr, t, n0, H, I, num_local, expert_offset, K, KP, BLOCK_N,
                  BLOCK_K, EARLY, PDL)
    rows = n0 + tl.arange(0, BLOCK_N)
    if HAS_SHARED:
        g = tl.load(g_ptr + t).to(tl.float32)
        sv = tl.load(sh_ptr + t.to(tl.int64) * H + rows).to(tl.float32)
        y += sv / (1.0 + tl.exp(-g))
    tl.store(out_ptr + t.to(tl.int64) * H + rows, y.to(out_ptr.dtype.element_ty))


@triton.jit
def down_rows(act_ptr, ids_ptr, tw_ptr, w_ptr, s_ptr, t, n0, H, I, num_local, expert_offset, K: tl.constexpr,
              KP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WAIT_AFTER_FIRST: tl.constexpr,
              PDL: tl.constexpr):
    """sum over token t's local slots of topk_weight * (act[pair] . w2[e] rows [n0, +BLOCK_N)) [BLOCK_N]
    fp32. The k slots are the leading axis of one tile (slots of other ranks' experts, and the
    KP - K padding, masked: no bytes read, weight 0). WAIT_AFTER_FIRST: `wait_prior(PDL)` after
    the routing and the first weight tile are read. Shared with nvl72.model.decode_layer."""
    rows = n0 + tl.arange(0, BLOCK_N)
    kc = tl.arange(0, BLOCK_K)
    slot = tl.arange(0, KP)
    pair = t * K + slot
    e = tl.load(ids_ptr + pair, mask=slot < K, other=-1, cache_modifier=".cg") - expert_offset  # past L1
    ok = (slot < K) & (e >= 0) & (e < num_local)
    e64 = tl.where(ok, e, 0).to(tl.int64)
    nkb = I // 128
    w_rows = w_ptr + ((e64 * H)[:, None, None] + rows[None, :, None]) * I  # [KP, BLOCK_N, 1]
    s_row = s_ptr + (e64 * (H // 128) + n0 // 128) * nkb  # [KP]: this row block's scales along K
    a_row = act_ptr + pair.to(tl.int64) * I
    ok3 = ok[:, None, None]
    wv = tl.load(w_rows + kc[None, None, :], mask=ok3 & (kc[None, None, :] < I), other=0.0)
    m2 = ok[:, None] & (kc[None, :] < I)
    sv = tl.load(s_row[:, None] + kc[None, :] // 128, mask=m2, other=0.0)  # [KP, BLOCK_K] (weights': early)
    if WAIT_AFTER_FIRST:
        wait_prior(PDL)
    av = tl.load(a_row[:, None] + kc[None, :], mask=m2, other=0.0)
    acc = tl.zeros([KP, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        nc = k0 + kc + BLOCK_K  # the next step's: weights, act and scales a step ahead of their use
        w_next = tl.load(w_rows + nc[None, None, :], mask=ok3 & (nc[None, None, :] < I), other=0.0)
        m2 = ok[:, None] & (nc[None, :] < I)
        a_next = tl.load(a_row[:, None] + nc[None, :], mask=m2, other=0.0)
        s_next = tl.load(s_row[:, None] + nc[None, :] // 128, mask=m2, other=0.0)
        acc += tl.sum(wv.to(tl.float32) * (av * sv)[:, None, :], 2)
        wv, av, sv = w_next, a_next, s_next
    tw = tl.load(tw_ptr + pair, mask=ok, other=0.0)
    return tl.sum(acc * tw[:, None], 0)


def check_weights(w: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int, name: str) -> None:
    """`w` e4m3 [E, N, K] (N, K multiples of 128) with its fp32 block scales, and a valid tile; errors
    name `name`. Shared with moe.fused_decode (its CuTeDSL kernels take the same weights)."""
    e, n, k = w.shape
    if w.dtype != torch.float8_e4m3fn or n % SCALE_BLOCK or k % SCALE_BLOCK:
        raise ValueError(f"{name}: {w.dtype} {tuple(w.shape)}: expected e4m3 [E, N, K] with N, K multiples of 128")
    if tuple(scale.shape) != (e, n // SCALE_BLOCK, k // SCALE_BLOCK) or scale.dtype != torch.float32:
        raise ValueError(f"{name}_scale: {scale.dtype} {tuple(scale.shape)}: expected fp32 "
                         f"{(e, n // SCALE_BLOCK, k // SCALE_BLOCK)}")
    if block_n < 1 or SCALE_BLOCK % block_n or block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"{name}: block_n={block_n} must divide 128, block_k={block_k} a power of two >= 16")


def out_buffer(buf, shape, dtype, device, name):
    """`buf` checked as a contiguous `dtype` tensor of `shape` (the error names `name`), or a new one."""
    if buf is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if buf.shape != shape or buf.dtype != dtype or not buf.is_contiguous():
        raise ValueError(f"{name}: {buf.dtype} {tuple(buf.shape)}: expected a contiguous {dtype} {shape}")
    return buf


def check_gate_up(x, topk_ids, w13, w13_scale, act, block_n=BLOCK_N, block_k=BLOCK_K):
    """The inputs of a gate/up (this module's or moe.fused_decode's CuTeDSL one) checked ->
    (T, k, E_local, H, I, act [T * k, I] fp32: `act` checked, or a new one)."""
    check_weights(w13, w13_scale, block_n, block_k, "w13")
    (t, k), (num_local, two_i, h) = topk_ids.shape, w13.shape
    if x.shape != (t, h):
        raise ValueError(f"x.shape={tuple(x.shape)}: expected {(t, h)}")
    inter = two_i // 2
    if inter % SCALE_BLOCK:
        raise ValueError(f"w13.shape={tuple(w13.shape)}: I={inter} must be a multiple of 128 (gate / up scale rows)")
    return t, k, num_local, h, inter, out_buffer(act, (t * k, inter), torch.float32, x.device, "act")


def gate_up(x: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
            expert_offset: int = 0, act: torch.Tensor | None = None, *, block_n: int = BLOCK_N,
            block_k: int = BLOCK_K, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """x [T, H], topk_ids [T, k] -> act [T * k, I] fp32 (given or new) = silu(x . gate[e]) * (x . up[e])
    per pair; rows of pairs whose expert is not in [expert_offset, + E_local) are left unwritten."""
    t, k, num_local, h, inter, act = check_gate_up(x, topk_ids, w13, w13_scale, act, block_n, block_k)
    if t:
        _gate_up_kernel[(t * k, inter // block_n)](
            x.contiguous(), topk_ids.contiguous(), w13, w13_scale, act, h, inter, num_local, expert_offset, K=k,
            BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, **launch_args(x.device))
    return act


def down(act: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w2: torch.Tensor,
         w2_scale: torch.Tensor, expert_offset: int = 0, shared: torch.Tensor | None = None,
         shared_gate: torch.Tensor | None = None, out: torch.Tensor | None = None, *,
         dtype: torch.dtype = torch.bfloat16, block_n: int = BLOCK_N2, block_k: int = BLOCK_K2,
         num_warps: int = NUM_WARPS2, early: bool = False) -> torch.Tensor:
    """act [T * k, I] (gate_up's) -> out [T, H] (given, or new in `dtype`) = sum over local slots of
    topk_weight * (act . w2[e]^T) [+ sigmoid(shared_gate) * shared (shared [T, H], shared_gate [T, 1])],
    in fp32.

    early=True (only right after the `gate_up` of the same routing, as `fused_decode` launches it):
    topk_ids and the first w2 tiles are read before the PDL wait. gate_up lets this kernel launch only
    once all its programs have passed their own wait, i.e. once the routing kernel has completed, so
    the ids are final by then (read past L1, `.cg`): aot.pdl's rule for data of the kernels before
    the previous one. `fused_decode` launches it so by default (EARLY_W2)."""
    check_weights(w2, w2_scale, block_n, block_k, "w2")
    (t, k), (num_local, h, inter) = topk_ids.shape, w2.shape
    if act.shape != (t * k, inter) or act.dtype != torch.float32 or not act.is_contiguous():
        raise ValueError(f"act: {act.dtype} {tuple(act.shape)}: expected gate_up's contiguous fp32 {(t * k, inter)}")
    out = out_buffer(out, (t, h), dtype, act.device, "out")
    has_shared = shared is not None
    if t:
        _down_kernel[(t, h // block_n)](
            act, topk_ids.contiguous(), topk_weights.float().contiguous(), w2, w2_scale, out,
            shared.contiguous() if has_shared else out, shared_gate.contiguous() if has_shared else out,
            h, inter, num_local, expert_offset, K=k, KP=triton.next_power_of_2(k), HAS_SHARED=has_shared,
            BLOCK_N=block_n, BLOCK_K=block_k, EARLY=early, num_warps=num_warps, **launch_args(act.device))
    return out


def fused_decode(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, expert_offset=0, shared=None,
                 shared_gate=None, shared_ready=None, out=None, *, act=None, block_n=BLOCK_N, block_k=BLOCK_K,
                 num_warps=NUM_WARPS, block_n2=BLOCK_N2, block_k2=BLOCK_K2, num_warps2=NUM_WARPS2,
                 early=EARLY_W2) -> torch.Tensor:
    """This rank's experts (and the gated shared expert) for a few tokens: `gate_up` (unless `act`, its
    output, is given: moe.fused_decode's CuTeDSL gate/up) then `down`, the second after waiting on
    `shared_ready` (the event of the stream that computed `shared`)."""
    if act is None:
        act = gate_up(x, topk_ids, w13, w13_scale, expert_offset, block_n=block_n, block_k=block_k,
                      num_warps=num_warps)
    if shared_ready is not None:
        torch.cuda.current_stream(x.device).wait_event(shared_ready)
    return down(act, topk_weights, topk_ids, w2, w2_scale, expert_offset, shared, shared_gate, out, dtype=x.dtype,
                block_n=block_n2, block_k=block_k2, num_warps=num_warps2, early=early)
