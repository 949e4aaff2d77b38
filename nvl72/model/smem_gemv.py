"""One-token projections through nvl72.kernels.sm90_gemv, whose CTAs bulk-copy their whole weight slice
into shared memory before their PDL wait (the module docstring says why and what it measured), where
the kernel bundle has a variant for the shape; the caller runs Triton's GEMV otherwise.

Batch-1 attention through nvl72.kernels.sm90_attn (a warp per query head; its docstring says why) where
the bundle has it and the step's shape fits, leaving its split partials to the attn GEMV as
fused_triton's attention does.

$NVL72_SMEM_GEMV: "1" (default) uses the kernels where they apply, "0" keeps Triton's; read once, when
the attention backend is made; $NVL72_SMEM_ATTN likewise for the attention. The choice is logged once
per (kind, shape).
"""
from __future__ import annotations

import logging
import os

import torch

from aot.launch import pdl_enabled
from nvl72.model.fused_triton import (SplitPartials, check_norm, check_row, gemv as triton_gemv, key_block,
                                      split_counters)

log = logging.getLogger(__name__)

ENV = "NVL72_SMEM_GEMV"
MODULE = "nvl72.kernels.sm90_gemv"
ATTN_ENV = "NVL72_SMEM_ATTN"
ATTN_MODULE = "nvl72.kernels.sm90_attn"
ROWS = 16  # the module's rows per CTA (not imported from it: it needs CuTeDSL, which GPU hosts lack)
LEAVE = 8  # the module's LEAVE: the most key splits whose partials its attn variants combine


def load() -> SmemGemv | None:
    """The kernels for this process's GPU, or None (switched off, no sm_90 GPU, no bundle module): logged."""
    flag, attn_flag = os.environ.get(ENV, "1"), os.environ.get(ATTN_ENV, "1")
    for var, value in ((ENV, flag), (ATTN_ENV, attn_flag)):
        if value not in ("0", "1"):
            raise ValueError(f"${var}={value!r}: expected 0 or 1")
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
    attn = None
    if attn_flag == "1":
        try:
            attn = aot.load(ATTN_MODULE, "sm_90a")
        except (aot.BundleError, OSError) as e:
            log.info("batch-1 attention: Triton's (no %s: %s)", ATTN_MODULE, e)
    else:
        log.info("batch-1 attention: Triton's ($%s=0)", ATTN_ENV)
    return SmemGemv(module, attn)


class SmemGemv:
    """`gemv` and `norm_gemv` of fused_triton's contracts (one row, bf16) through `module`'s exports, and
    the batch-1 attention's partials through `attn_module`'s; each returns None where no export applies
    (the caller then runs Triton's)."""

    def __init__(self, module, attn_module=None):
        self.module, self.attn_module = module, attn_module
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

    def attn_partials(self, q_raw, k_raw, v, q_weight, k_weight, cos, sin, num_heads: int, head_dim: int, eps: float,
                      zero_centered: bool, kv_cache, slot_mapping, seq_lens, page_table, scale: float, splits: int,
                      leave: int) -> SplitPartials | None:
        """fused_triton.norm_rope_paged_attention_partials's SplitPartials for an ungated one-token step of one
        sequence (`splits` > 1, `leave` = `attn_leave(...)`), or None where no export applies (logged once)."""
        hkv, page_size = kv_cache.shape[2], kv_cache.shape[3]
        name = f"attn_one_token_g{num_heads // hkv}_d{head_dim}"
        rows = (q_raw, k_raw, v, q_weight, k_weight, cos, sin)
        why = (f"no {ATTN_MODULE} in the kernel bundle" if self.attn_module is None
               else f"no variant {name}" if num_heads % hkv or not hasattr(self.attn_module, name)
               else f"{q_raw.shape[0]} tokens, {seq_lens.numel()} sequences"
               if q_raw.shape[0] != 1 or seq_lens.numel() != 1
               else f"leave {leave}, splits {splits}" if leave != LEAVE or splits < 2
               else "zero-centred norm weights" if zero_centered
               else f"RoPE on {cos.shape[-1]} of {head_dim} dims" if cos.shape[-1] != head_dim
               else "not all bf16" if any(t.dtype != torch.bfloat16 for t in (*rows, kv_cache))
               else f"page_size {page_size}: not a power of 2" if page_size & (page_size - 1)
               else "a KV cache not contiguous" if not kv_cache.is_contiguous()
               else "rows not 8-byte aligned" if any(t.data_ptr() % 8 for t in rows) else None)
        key = (name, why)
        if key not in self._logged:
            self._logged.add(key)
            log.info("batch-1 attention, %d heads over %d KV heads of %d: %s", num_heads, hkv, head_dim,
                     f"Triton's ({why})" if why else name)
        if why:
            return None
        dev = q_raw.device
        out = torch.empty(1, num_heads, head_dim, dtype=q_raw.dtype, device=dev)
        acc = torch.empty(1, num_heads, splits, head_dim, dtype=q_raw.dtype, device=dev)
        ml = torch.empty(1, num_heads, splits, 2, dtype=torch.float32, device=dev)
        getattr(self.attn_module, name)(
            *(t.reshape(-1) for t in rows), slot_mapping, seq_lens, page_table[0], kv_cache.view(-1), out.view(-1),
            acc.view(-1), ml.view(-1), split_counters(dev, num_heads), splits, page_size, hkv, float(scale), float(eps),
            int(pdl_enabled(dev)))
        return SplitPartials(out, acc, ml, seq_lens, splits, key_block(head_dim), leave)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` flat and contiguous at an 8-byte boundary (the kernels read it 8 bytes a thread)."""
    t = t.contiguous().view(-1)
    return t.clone() if t.data_ptr() % 8 else t
