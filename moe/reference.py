"""Pure-torch reference ops for the MoE layer (the semantics every kernel must match)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router in fp32, top-k, optional renormalisation.

    router_logits [T, E] -> (topk_weights [T, k] fp32, topk_ids [T, k] int64). With `num_shared` > 0
    the logits are [T, E + 1], the last column a shared expert's gate logit, and the shared expert is
    held as experts E .. E + num_shared - 1 (`moe.MoE`'s fused shared expert): every token also picks
    those, each with weight sigmoid(gate logit), in columns k .. k + num_shared - 1."""
    routed = router_logits[:, : router_logits.shape[1] - 1] if num_shared else router_logits
    probs = torch.softmax(routed, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if num_shared:
        t, e = routed.shape
        shared_w = torch.sigmoid(router_logits[:, e:].float()).expand(t, num_shared)
        shared_ids = torch.arange(e, e + num_shared, device=routed.device).expand(t, num_shared)
        topk_weights = torch.cat([topk_weights, shared_w], dim=1)
        topk_ids = torch.cat([topk_ids, shared_ids], dim=1)
    return topk_weights, topk_ids


def experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """sum_k w_k * down(silu(gate(x)) * up(x)) over the experts held here.

    x [T, H]; topk_* [T, k]; w13 [E_local, 2I, H]; w2 [E_local, H, I]. Experts outside
    [expert_offset, expert_offset + E_local) contribute nothing (another rank holds them)."""
    num_local, two_i, _ = w13.shape
    inter = two_i // 2
    out = torch.zeros_like(x)
    local_ids = topk_ids - expert_offset
    for e in range(num_local):
        tok, slot = torch.nonzero(local_ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w13[e].t()  # [n, 2I]
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = h @ w2[e].t()  # [n, H]
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].to(y.dtype))
    return out


# ---- references of the fused-pipeline ops (moe.ops); every GPU kernel has the same signature

ACT_BLOCK = 128  # activation scale block along K for the Hopper FP8 path (one wgmma K tile)


def _quant_rows(v: torch.Tensor, rows_per_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """v [M, K] fp32 -> (q [M, K] e4m3, scale [M / rows_per_batch, K/128, rows_per_batch] fp32)."""
    from moe import mxfp8

    q, s = mxfp8.quantize(v, ACT_BLOCK)
    scale = torch.exp2(mxfp8.e8m0_to_exp(s).float())  # [M, K/128]
    return q, scale.view(-1, rows_per_batch, scale.shape[-1]).transpose(1, 2).contiguous()


def gather_quant(
    x: torch.Tensor, row_of: torch.Tensor, num_rows: int, rows_per_batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter tokens into the grouped order, quantized (power-of-two scale per 1 x 128).

    x [T, H]; row_of [T, k] (-1: not here) -> (q [num_rows, H] e4m3, scale [num_rows /
    rows_per_batch, H/128, rows_per_batch] fp32: the GEMM's a_scale layout). Rows no pair maps to
    are unspecified (zeros here; the kernel leaves them unwritten)."""
    rows = torch.zeros(num_rows, x.shape[1], dtype=torch.float32, device=x.device)
    valid = row_of >= 0
    tok = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(row_of)
    rows[row_of[valid]] = x[tok[valid]].float()
    return _quant_rows(rows, rows_per_batch)


def silu_mul_quant(
    h: torch.Tensor, rows_per_batch: int, row_of: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [M, 2I] (gate | up) -> quantized silu(gate) * up: (q [M, I] e4m3, scale as gather_quant).

    row_of [T, k], when given, names the rows that matter (those >= 0: the routed pairs); the
    others are unspecified (computed here, left unwritten by the kernel)."""
    inter = h.shape[-1] // 2
    hf = h.float()
    return _quant_rows(F.silu(hf[:, :inter]) * hf[:, inter:], rows_per_batch)


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    a_scale: torch.Tensor | None,
    b_scale: torch.Tensor | None,
    aux: torch.Tensor,
    masked: bool,
    tile_m: int = 128,
    role: str | None = None,
) -> torch.Tensor:
    """out = dequant(a) @ dequant(b[e])^T per expert, in fp32, stored in out's dtype.
    (`role`, "w13" or "w2", picks a kernel in moe.backend.Sm90Gemm; the reference has one.)

    contiguous (masked=False): a [M, K], out [M, N], aux = tile_expert [M / tile_m];
    masked: a [E, cap, K], out [E, cap, N], aux = counts [E] (rows past counts[e] untouched).
    b [E, N, K]; fp8 operands take a_scale [L, K/128, rows] and b_scale [E, N/128, K/128]."""
    def deq_a(rows_a, l, lo, hi):
        v = rows_a.float()
        if a_scale is None:
            return v
        return v * a_scale[l, :, lo:hi].t().repeat_interleave(ACT_BLOCK, dim=1)

    def deq_b(e):
        v = b[e].float()
        if b_scale is None:
            return v
        return v * b_scale[e].repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)

    if masked:
        for e in range(a.shape[0]):
            n = int(aux[e])
            if n:
                out[e, :n] = (deq_a(a[e, :n], e, 0, n) @ deq_b(e).t()).to(out.dtype)
    else:
        for i, e in enumerate(aux.tolist()):
            if e >= 0:
                lo, hi = i * tile_m, (i + 1) * tile_m
                out[lo:hi] = (deq_a(a[lo:hi], 0, lo, hi) @ deq_b(e).t()).to(out.dtype)
    return out


def unpermute(
    y: torch.Tensor,
    row_of: torch.Tensor,
    topk_weights: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * y[row_of[t, j]] (rows -1 skipped) [+ sigmoid(shared_gate[t]) * shared[t]].

    y [M, H] (masked layouts flattened to [E * cap, H]); row_of, topk_weights [T, k];
    shared [T, H], shared_gate [T, 1] -> out [T, H] in y's dtype (sums in fp32)."""
    valid = row_of >= 0
    g = y[row_of.clamp(min=0)].float() * topk_weights.float()[..., None]  # [T, k, H]
    # a skipped slot reads some row that may never have been written (NaN in an empty buffer):
    # select zero instead of multiplying by it
    out = torch.where(valid[..., None], g, 0.0).sum(dim=1)
    if shared is not None:
        out = out + torch.sigmoid(shared_gate.float()) * shared.float()
    return out.to(y.dtype)


def gather_quant_mx(
    x: torch.Tensor, row_of: torch.Tensor, num_rows: int, rows_per_batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter + MXFP8 quantization for Blackwell: 1 x 32 E8M0 scales in the swizzled layout.

    x [T, H]; row_of [T, k] -> (q [num_rows, H] e4m3, sf flat uint8: for each batch of
    rows_per_batch rows, mxfp8.swizzle_scales of its [rows_per_batch, H/32] scales, concatenated)."""
    from moe import mxfp8

    rows = torch.zeros(num_rows, x.shape[1], dtype=torch.float32, device=x.device)
    valid = row_of >= 0
    tok = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(row_of)
    rows[row_of[valid]] = x[tok[valid]].float()
    q, s = mxfp8.quantize(rows)
    sf = [mxfp8.swizzle_scales(b).view(torch.uint8) for b in s.view(-1, rows_per_batch, s.shape[-1])]
    return q, torch.cat(sf) if sf else torch.empty(0, dtype=torch.uint8, device=x.device)
