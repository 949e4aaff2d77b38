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
from nvl72.model.fused_triton import check_norm, check_row

log = logging.getLogger(__name__)

ENV = "NVL72_SMEM_GEMV"
MODULE = "nvl72.kernels.sm90_gemv"
ROWS = 16  # the module's rows per CTA (not imported from it: it needs CuTeDSL, which GPU hosts lack)


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

    def _export(self, name: str, x: torch.Tensor, weight: torch.Tensor, bias):
        check_row(x, weight)
        n, k = weight.shape
        why = ("a bias" if bias is not None
               else f"{x.dtype}, not bf16" if x.dtype != torch.bfloat16 or weight.dtype != x.dtype
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
        fn = self._export(f"gemv_k{weight.shape[1]}", x, weight, bias)
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
        name = f"norm_gemv_k{weight.shape[1]}{'_zc' if zero_centered else ''}{'' if delta is None else '_d'}"
        fn = self._export(name, x, weight, bias)
        if fn is None:
            return None
        xf = _aligned(x)
        d = xf if delta is None else _aligned(delta)
        s = x if delta is None else torch.empty_like(x, memory_format=torch.contiguous_format)
        out = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)
        fn(xf, d, _aligned(norm_weight), s.view(-1), weight.view(-1), out.view(-1), weight.shape[0], float(eps),
           int(pdl_enabled(x.device)))
        return s, out


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` flat and contiguous at an 8-byte boundary (the kernels read it 8 bytes a thread)."""
    t = t.contiguous().view(-1)
    return t.clone() if t.data_ptr() % 8 else t
