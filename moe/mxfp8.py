"""MXFP8: E4M3 values with one power-of-two (E8M0) scale per block along K, in pure torch.

Conventions (OCP MX v1.0, with the "round the scale up" rule so no value saturates):
  scale exponent  s = ceil(log2(amax / 448)), clamped to [-127, 127]   (448 = E4M3 max)
  value           q = e4m3(x / 2^s)                                     (round to nearest even)
  dequantized     x' = q * 2^s
Error bound per element (checked in tests/moe/test_mxfp8.py): |x - x'| <= 2^-4 |x| while
|x / 2^s| is in E4M3's normal range (>= 2^-6), else <= 2^(s-10) (half the subnormal step 2^-9).

Two scale granularities are used:
  * 1 x 32 (MXFP8 proper): what Blackwell's block-scaled tcgen05 MMA reads, with the scale
    factors stored in the 128 x 4 swizzled layout (`swizzle_scales`).
  * coarser power-of-two blocks for Hopper, whose wgmma has no block scales: scales are applied in
    the GEMM's main loop once per 128-wide K tile (`regroup_pow2`). Regrouping MXFP8 data into the
    coarser block is exact (a multiplication by 2^-d) except for values that fall into E4M3's
    subnormal range or below it after the shift; those lose their low mantissa bits
    (absolute error <= 2^(s_max - 10)).
"""
from __future__ import annotations

import torch

E4M3_MAX = 448.0
MX_BLOCK = 32
SF_TILE_ROWS, SF_TILE_COLS = 128, 4  # the swizzled scale-factor tile: 128 rows x 4 scale columns


def _check_blocks(x: torch.Tensor, block: int, name: str = "x") -> None:
    if x.dim() < 1 or x.shape[-1] % block:
        raise ValueError(f"{name}.shape={tuple(x.shape)}: last dim must be a multiple of block={block}")


def scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """int32 exponents s = ceil(log2(amax / 448)), clamped to [-127, 127].

    Computed from the bits of amax = 1.f * 2^e (no division, so the GPU kernels get the identical
    integer): amax <= 1.75 * 2^(s+8) holds for s = e - 8 when 1.f <= 1.75, else for s = e - 7."""
    bits = amax.float().view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127
    s = e - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    s = torch.where(amax > 0, s, torch.full_like(s, -127))
    return s.clamp(-127, 127)


def exp_to_e8m0(s: torch.Tensor) -> torch.Tensor:
    """int exponents -> torch.float8_e8m0fnu (biased by 127)."""
    return (s + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def e8m0_to_exp(scale: torch.Tensor) -> torch.Tensor:
    """torch.float8_e8m0fnu -> int32 exponents."""
    return scale.view(torch.uint8).to(torch.int32) - 127


def quantize(x: torch.Tensor, block: int = MX_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q [..., K] float8_e4m3fn, scale [..., K/block] float8_e8m0fnu)."""
    _check_blocks(x, block)
    xb = x.float().unflatten(-1, (-1, block))  # [..., K/block, block]
    s = scale_exponent(xb.abs().amax(dim=-1))  # [..., K/block]
    q = (xb * torch.exp2(-s.float())[..., None]).to(torch.float8_e4m3fn)
    return q.flatten(-2), exp_to_e8m0(s)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q [..., K] e4m3, scale [..., K/block] e8m0 or fp32 powers of two) -> [..., K] in dtype."""
    block = q.shape[-1] // scale.shape[-1]
    if scale.shape[:-1] != q.shape[:-1] or block * scale.shape[-1] != q.shape[-1]:
        raise ValueError(f"scale.shape={tuple(scale.shape)} does not tile q.shape={tuple(q.shape)}")
    f = torch.exp2(e8m0_to_exp(scale).float()) if scale.dtype == torch.float8_e8m0fnu else scale.float()
    out = q.float().unflatten(-1, (-1, block)) * f[..., None]  # [..., K/block, block]
    return out.flatten(-2).to(dtype)


def regroup_pow2(
    q: torch.Tensor, scale: torch.Tensor, block_rows: int, block_k: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-express MXFP8 (1 x 32 blocks) data with one scale per block_rows x block_k block.

    q [..., R, K] e4m3, scale [..., R, K/32] e8m0 -> (q2 [..., R, K] e4m3, scale2 [..., R/block_rows,
    K/block_k] fp32 powers of two). Each new scale is the largest of the scales it covers; values
    from a block with a smaller scale are shifted down by 2^-(s_max - s): exact while they stay E4M3
    normals, rounded (to nearest even) once they become subnormal."""
    *lead, rows, k = q.shape
    if rows % block_rows or k % block_k or block_k % MX_BLOCK:
        raise ValueError(f"q.shape={tuple(q.shape)} is not tiled by blocks {block_rows} x {block_k}")
    s = e8m0_to_exp(scale)  # [..., R, K/32]
    sub = block_k // MX_BLOCK
    s_blk = s.unflatten(-2, (-1, block_rows)).unflatten(-1, (-1, sub))  # [..., R/br, br, K/bk, sub]
    s_max = s_blk.amax(dim=(-3, -1))  # [..., R/br, K/bk]
    shift = (s_max[..., :, None, :, None] - s_blk).flatten(-4, -3).flatten(-2)  # [..., R, K/32]
    q2 = q.float().unflatten(-1, (-1, MX_BLOCK)) * torch.exp2(-shift.float())[..., None]
    return q2.flatten(-2).to(torch.float8_e4m3fn), torch.exp2(s_max.float())


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """[R, K/32] scales -> the flat byte layout Blackwell's block-scaled MMA reads (cuBLAS/CUTLASS).

    Rows are padded to a multiple of 128 and scale columns to a multiple of 4 (padding = 0 bytes,
    i.e. 2^-127 in E8M0). The padded matrix is cut into 128 x 4 tiles stored one after another,
    tile (i, j) at byte ((i * (Kp/4)) + j) * 512 (row-block major); inside a tile, the scale of
    row r, column c sits at byte (r % 32) * 16 + (r // 32) * 4 + c."""
    if scale.dim() != 2:
        raise ValueError(f"scale.shape={tuple(scale.shape)}: expected [rows, K/32]")
    rows, cols = scale.shape
    rp = -(-rows // SF_TILE_ROWS) * SF_TILE_ROWS
    cp = -(-cols // SF_TILE_COLS) * SF_TILE_COLS
    raw = scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale
    padded = torch.zeros(rp, cp, dtype=raw.dtype, device=raw.device)
    padded[:rows, :cols] = raw
    t = padded.view(rp // 128, 4, 32, cp // 4, 4)  # [i, r//32, r%32, j, c]
    out = t.permute(0, 3, 2, 1, 4).reshape(-1)  # [i, j, r%32, r//32, c]
    return out.view(scale.dtype) if scale.dtype == torch.float8_e8m0fnu else out


def unswizzle_scales(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `swizzle_scales` (drops the padding): flat -> [rows, cols]."""
    rp = -(-rows // SF_TILE_ROWS) * SF_TILE_ROWS
    cp = -(-cols // SF_TILE_COLS) * SF_TILE_COLS
    if flat.numel() != rp * cp:
        raise ValueError(f"flat.numel()={flat.numel()} != {rp}*{cp} for rows={rows}, cols={cols}")
    t = flat.view(rp // 128, cp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)  # [i, r//32, r%32, j, c]
    return t.reshape(rp, cp)[:rows, :cols]


def quantize_experts(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Static conversion of expert weights [E, N, K] at load time, for both GPU generations.

    Returns q [E, N, K] e4m3 and scale [E, N, K/32] e8m0 (MXFP8, Blackwell; swizzled per expert with
    `swizzle_scales` by the sm_100 backend), plus the Hopper form q_sm90 [E, N, K] and scale_sm90
    [E, N/128, K/128] fp32 (128 x 128 power-of-two blocks, see `regroup_pow2`)."""
    if w.dim() != 3:
        raise ValueError(f"w.shape={tuple(w.shape)}: expected [E, N, K]")
    q, s = quantize(w)
    q90, s90 = regroup_pow2(q, s, block_rows=128, block_k=128)
    return {"q": q, "scale": s, "q_sm90": q90, "scale_sm90": s90}
