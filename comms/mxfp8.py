"""MXFP8 rows of the dispatch payload: E4M3 values with one E8M0 (power-of-two) scale per 32 values
along hidden, in pure torch: the reference the fused dispatch kernel matches bit for bit.

The rule is moe.mxfp8's (its docstring gives the error bounds): scale exponent s = ceil(log2(amax /
448)) computed from the bits of amax = 1.f * 2^e (s = e - 8, + 1 when 1.f > 1.75), -127 for a zero
block, clamped to [-127, 127]; value q = e4m3(x * 2^-s), nearest even, never saturating (|x * 2^-s|
<= 448). So a dispatched row is exactly what the MoE layer would quantize from the bf16 row. comms
may not import moe (tests/test_boundaries.py), so the five lines of the rule are restated here and
tests/comms/test_dispatch_mxfp8.py checks them against moe.mxfp8.quantize bit for bit.

Scales are uint8 E8M0 bits (biased by 127; `.view(torch.float8_e8m0fnu)` where torch has it).
"""
from __future__ import annotations

import torch

BLOCK = 32


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] (H % 32 == 0) -> (q [..., H] float8_e4m3fn, scale [..., H/32] uint8 E8M0)."""
    if x.dim() < 1 or x.shape[-1] % BLOCK:
        raise ValueError(f"x.shape={tuple(x.shape)}: hidden must be a multiple of {BLOCK}")
    xb = x.float().unflatten(-1, (-1, BLOCK))  # [..., H/32, 32]
    bits = xb.abs().amax(dim=-1).view(torch.int32)
    s = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    s = torch.where(bits == 0, torch.full_like(s, -127), s).clamp(-127, 127)
    q = (xb * torch.exp2(-s.float())[..., None]).to(torch.float8_e4m3fn)
    return q.flatten(-2), (s + 127).to(torch.uint8)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q [..., H] E4M3, scale [..., H/32] uint8 E8M0) -> fp32 [..., H]."""
    if scale.shape[:-1] != q.shape[:-1] or scale.shape[-1] * BLOCK != q.shape[-1]:
        raise ValueError(f"scale.shape={tuple(scale.shape)} does not tile q.shape={tuple(q.shape)} by {BLOCK}")
    f = torch.exp2(scale.to(torch.int32).float() - 127)
    return (q.float().unflatten(-1, (-1, BLOCK)) * f[..., None]).flatten(-2)
