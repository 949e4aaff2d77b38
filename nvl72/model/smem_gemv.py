"""One-token projections through nvl72.kernels.sm90_gemv, whose CTAs bulk-copy their whole weight slice
into shared memory before their PDL wait (the module docstring says why and what it measured), where
the kernel bundle has a variant for the shape; the caller runs Triton's GEMV otherwise.

$NVL72_SMEM_GEMV: "1" (default) uses the kernels where they apply, "0" keeps Triton's; read once, when
the attention backend is made. The choice is logged once per (kind, shape).
"""
from __future__ import annotations

import logging
import os

import torch

from aot.launch import pdl_enabled
from nvl72.model.fused_triton import SplitPartials, check_norm, check_row, gemv as triton_gemv

log = logging.getLogger(__name__)

ENV = "NVL72_SMEM_GEMV"
MODULE = "nvl72.kernels.sm90_gemv"
ROWS = 16  # the module's rows per CTA (not imported from it: it needs CuTeDSL, which GPU hosts lack)
LEAVE = 8  # the module's LEAVE: the most key splits whose partials its attn variants combine


def load() -> SmemGemv | None:
    """The kernels for this process's GPU, or None (switched off, no sm_90 GPU, no bundle module): logged."""
    flag = os.environ.get(ENV, "1")
    if flag not in ("0", "1"):
        raise ValueError(f"${ENV}={flag!r}: expected 0 or 1")
    if flag == "0":
        log.info("one-token projections: Triton's GEMV ($%s=0)", ENV)
        return None
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return None  # (sm_90a only; CPU hosts run the references)
    import aot

    try:
        module = aot.load(MODULE, "sm_90a")
    except (aot.BundleError, OSError) as e:
        log.info("one-token projections: Triton's GEMV (no %s: %s)", MODULE, e)
        return None
    log.info("one-token projections: %s from the kernel bundle where it has the shape", MODULE)
    return SmemGemv(module)


class SmemGemv:
    """`gemv` and `norm_gemv` of fused_triton's contracts (one row, bf16) through `module`'s exports;
    each returns None where no export applies (the caller then runs Triton's)."""

    def __init__(self, module):
        self.module = module
        self._logged: set[tuple] = set()

    def _export(self, name: str, dtype: torch.dtype, weight: torch.Tensor, bias):
        n, k = weight.shape
        why = ("a bias" if bias is not None
               else f"{dtype}, not bf16" if dtype != torch.bfloat16 or weight.dtype != dtype
               else f"N={n}: not a multiple of {ROWS}" if n % ROWS
               else "a weight not contiguous, 16-byte aligned" if not weight.is_contiguous() or weight.data_ptr() % 16
               else f"no variant {name}" if not hasattr(self.module, name) else None)
        key = (name, n, why)
        if key not in self._logged:
            self._logged.add(key)
            log.info("one-token projection [%d, %d]: %s", n, k, f"Triton's GEMV ({why})" if why else name)
        return None if why else getattr(self.module, name)

    def gemv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """x [1, K] @ weight.T -> [1, N], or None (no export for it)."""
        check_row(x, weight)
        fn = self._export(f"gemv_k{weight.shape[1]}", x.dtype, weight, bias)
        if fn is None:
            return None
        xf = _aligned(x)
        out = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)
        fn(xf, xf, xf, xf, weight.view(-1), out.view(-1), weight.shape[0], 0.0, int(pdl_enabled(x.device)))
        return out

    def norm_gemv(self, x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  zero_centered: bool, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """fused_triton.norm_gemv's (s, out), or None (no export for it)."""
        check_norm(x, delta, norm_weight)
        check_row(x, weight)
        name = f"norm_gemv_k{weight.shape[1]}{'_zc' if zero_centered else ''}{'' if delta is None else '_d'}"
        fn = self._export(name, x.dtype, weight, bias)
        if fn is None:
            return None
        xf = _aligned(x)
        d = xf if delta is None else _aligned(delta)
        s = x if delta is None else torch.empty_like(x, memory_format=torch.contiguous_format)
        out = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)
        fn(xf, d, _aligned(norm_weight), s.view(-1), weight.view(-1), out.view(-1), weight.shape[0], float(eps),
           int(pdl_enabled(x.device)))
        return s, out

    def attn_leave(self, dtype: torch.dtype, weight: torch.Tensor, bias: torch.Tensor | None, head_dim: int) -> int:
        """LEAVE where an attn export serves o_proj `weight` after heads of `head_dim` (pass it to
        fused_triton's attention as `leave`, then run `attn_gemv`), else 0 (logged once)."""
        name = f"attn_gemv_k{weight.shape[1]}_d{head_dim}"
        return LEAVE if self._export(name, dtype, weight, bias) is not None else 0

    def attn_gemv(self, parts: SplitPartials, weight: torch.Tensor) -> torch.Tensor:
        """o_proj [1, N] of a one-token, one-sequence attention run with leave=`attn_leave(...)`: the
        kernel stages x from `parts.out`, or from the combine of the partials where 2 to LEAVE splits
        hold the keys."""
        t, hq, d = parts.out.shape
        if t != 1 or parts.seq_lens.numel() != 1 or parts.leave not in (0, LEAVE) or not parts.out.is_contiguous():
            raise ValueError(f"attn_gemv: one contiguous token of one sequence, leave 0 or {LEAVE} (got out "
                             f"{tuple(parts.out.shape)}, {parts.seq_lens.numel()} sequences, leave {parts.leave})")
        if parts.splits == 1:  # no partials: the attention wrote out
            x = parts.out.view(1, hq * d)
            out = self.gemv(x, weight)
            return triton_gemv(x, weight) if out is None else out
        fn = getattr(self.module, f"attn_gemv_k{hq * d}_d{d}")
        out = torch.empty(1, weight.shape[0], dtype=parts.out.dtype, device=parts.out.device)
        fn(parts.out.view(-1), parts.acc.view(-1), parts.ml.view(-1), parts.seq_lens, weight.view(-1), out.view(-1),
           weight.shape[0], parts.splits, parts.block_n, int(pdl_enabled(out.device)))
        return out


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` flat and contiguous at an 8-byte boundary (the kernels read it 8 bytes a thread)."""
    t = t.contiguous().view(-1)
    return t.clone() if t.data_ptr() % 8 else t
