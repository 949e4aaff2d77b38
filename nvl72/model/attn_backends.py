"""Attention backends: one contract, chosen once at start-up by capability and logged.

  torch       the references in `nvl72.model.ops` (CPU default; the ground truth of the tests)
  triton      our Triton kernels (`nvl72.model.fused_triton`): KV store + paged GQA attention,
              decode and prefill in one kernel; plan and forward need no host sync, so it is the
              backend CUDA-graph decode captures. It also brings the decoder's fused residual
              add + RMSNorm, q/k norm + RoPE and RoPE-table kernels (`fused_ops`)
  flashinfer  triton's backend with the attention of every batch that has prefill rows in
              FlashInfer's paged prefill wrapper on the HND cache (FA3 on sm_90 hosts where
              `flashinfer` imports; planned once per forward on the host, shared by every layer).
              One-token steps keep triton's fused, graph-safe decode kernels, or (with
              $NVL72_FLASHINFER_DECODE=1) go to FlashInfer's decode wrapper, eager only

A backend turns a `ForwardBatch` into its metadata once per forward (`plan`) and then, per layer,
stores the new K/V and attends (`forward`). Every backend reads the same HND cache
[num_pages, 2, kv_heads, page_size, head_dim], so they can be swapped under one engine.
`$NVL72_ATTN_BACKEND` or an explicit name overrides the choice; a named backend that cannot run
raises `BackendUnavailable` at selection, never in the hot path.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from nvl72.model import ops
from nvl72.model.batch import ForwardBatch

log = logging.getLogger(__name__)

ENV = "NVL72_ATTN_BACKEND"
GEMV_ENV = "NVL72_TRITON_GEMV"
NORM_GEMV_ENV = "NVL72_NORM_GEMV"  # the input norm inside the q/k/v GEMV (one-token steps)
QK_ATTN_ENV = "NVL72_QK_NORM_ATTN"  # the q/k norm, RoPE and K/V store inside decode attention
ATTN_O_PROJ_ENV = "NVL72_ATTN_O_PROJ"  # batch-1 steps: the attention's split combine inside o_proj's kernel
DECODE_LAYER_ENV = "NVL72_DECODE_LAYER"
DECODE_LAYER_DEFAULT = "0"
FLASHINFER_DECODE_ENV = "NVL72_FLASHINFER_DECODE"  # flashinfer backend: one-token steps in FlashInfer's decode
FLASHINFER_HEAD_DIMS = (64, 128, 256)  # FlashInfer's FA3 (sm_90) prefill


def _flag(env: str, default: str = "1") -> bool:
    """A 0/1 switch from the environment; anything else is an error naming the variable."""
    flag = os.environ.get(env, default)
    if flag not in ("0", "1"):
        raise ValueError(f"${env}={flag!r}: expected 0 or 1")
    return flag == "1"


class BackendUnavailable(RuntimeError):
    """The named attention backend cannot run here (device, missing package)."""


@dataclass(frozen=True)
class AttentionShape:
    """What a backend must know of the model's attention layers (all share it)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model) -> "AttentionShape":
        """This rank's heads (under TP a layer holds its share of them, which FlashInfer's plans must
        see), from the first attention layer; the config's where the model has none."""
        c = model.config
        for layer in model.model.layers:
            a = getattr(layer, "self_attn", None)
            if a is not None:
                return cls(a.num_heads, a.num_kv_heads, a.head_dim, model.dtype)
        return cls(c.num_attention_heads, c.num_key_value_heads, c.head_dim, model.dtype)


class AttentionBackend:
    """plan once per forward, forward once per attention layer."""

    name = "base"
    graph_safe = False  # plan() and forward() can be captured in a CUDA graph
    fused_qk_norm_rope = False  # layers call norm_rope_attend() instead of the reference norm + RoPE
    # the decoder's residual add + RMSNorm and the RoPE table as Triton kernels (add_rms_norm(),
    # rope_cos_sin()) instead of the torch references
    fused_ops = False
    decode_layer = None  # "fused" / "phased": one-token layers in nvl72.model.decode_layer's kernel

    def qk_norm_rope(self, q_raw, k_raw, q_weight, k_weight, cos, sin, num_heads, num_kv_heads, head_dim, eps,
                     zero_centered, gated, v=None, kv_cache=None, meta=None):
        """`fused_triton.qk_norm_rope`'s contract: (q [T, Hq, D], k [T, Hkv, D], gate [T, Hq*D] | None);
        with v, kv_cache and this backend's `plan` result it also stores K/V (then call `forward`
        with stored=True)."""
        from nvl72.model import fused_triton

        return fused_triton.qk_norm_rope(q_raw, k_raw, q_weight, k_weight, cos, sin, num_heads, num_kv_heads,
                                         head_dim, eps, zero_centered, gated, v, kv_cache,
                                         None if meta is None else meta.slot_mapping)

    def norm_rope_attend(self, q_raw, k_raw, v, q_weight, k_weight, cos, sin, num_heads, num_kv_heads, head_dim,
                         eps, zero_centered, gated, kv_cache, meta, scale):
        """`qk_norm_rope` with the K/V store, then `forward`: (out [T, Hq, D], gate [T, Hq, D] or None)."""
        q, k, gate = self.qk_norm_rope(q_raw, k_raw, q_weight, k_weight, cos, sin, num_heads, num_kv_heads, head_dim,
                                       eps, zero_centered, gated, v, kv_cache, meta)
        attend = meta.attend if isinstance(meta, SplitMeta) else self.forward
        out = attend(q, k, v, kv_cache, meta, scale, stored=True)
        return out, (None if gate is None else gate.view(out.shape))

    def norm_rope_attend_linear(self, q_raw, k_raw, v, q_weight, k_weight, cos, sin, num_heads, num_kv_heads,
                                head_dim, eps, zero_centered, gated, kv_cache, meta, scale, weight, bias=None):
        """`norm_rope_attend`, out * sigmoid(gate) where gated, then `linear` (o_proj): [T, N]. The triton
        backend's batch-1 steps leave the attention's split combine to o_proj's kernel."""
        out, gate = self.norm_rope_attend(q_raw, k_raw, v, q_weight, k_weight, cos, sin, num_heads, num_kv_heads,
                                          head_dim, eps, zero_centered, gated, kv_cache, meta, scale)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.linear(out.reshape(out.shape[0], num_heads * head_dim), weight, bias)

    def add_rms_norm(self, x, delta, weight, eps, zero_centered, router=None):
        """`fused_triton.add_rms_norm`'s contract: (x + delta, its RMSNorm[, router logits]); delta
        None: (x, RMSNorm(x)[, router logits])."""
        from nvl72.model import fused_triton

        return fused_triton.add_rms_norm(x, delta, weight, eps, zero_centered, router)

    def linear(self, x, weight, bias=None):
        """F.linear; the triton backend may run single-token steps through its GEMV kernel."""
        return torch.nn.functional.linear(x, weight, bias)

    def norm_linear(self, x, delta, norm_weight, eps, zero_centered, weight, bias=None):
        """(s, linear(RMSNorm(s), weight, bias)) with s = x + delta (x when delta is None):
        `add_rms_norm` then `linear`; the triton backend runs one-token steps in one kernel."""
        s, h = self.add_rms_norm(x, delta, norm_weight, eps, zero_centered)
        return s, self.linear(h, weight, bias)

    def rope_cos_sin(self, positions, inv_freq, dtype):
        """`ops.rope_cos_sin`'s contract (one kernel where `fused_ops`, else the reference)."""
        if not self.fused_ops:
            return ops.rope_cos_sin(positions, inv_freq, dtype)
        from nvl72.model import fused_triton

        return fused_triton.rope_cos_sin(positions, inv_freq, dtype)

    def plan(self, batch: ForwardBatch, page_size: int):
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta,
                scale: float, stored: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """Store k, v [T, Hkv, D] in their pages (unless `stored`: qk_norm_rope did), then attend:
        q [T, Hq, D] -> [T, Hq, D] (written into `out` when given)."""
        raise NotImplementedError


class TorchBackend(AttentionBackend):
    name = "torch"

    def plan(self, batch: ForwardBatch, page_size: int) -> ops.AttentionMetadata:
        return ops.AttentionMetadata.build(batch, page_size)

    def forward(self, q, k, v, kv_cache, meta, scale, stored=False, out=None):
        if not stored:
            ops.write_kv(kv_cache, k, v, meta.slot_mapping)
        got = ops.paged_attention(q, kv_cache, meta, scale)
        return got if out is None else out.copy_(got)


@dataclass
class PagedMeta:
    """Device-side indexing of one forward (no per-sequence host objects)."""

    batch: ForwardBatch
    slot_mapping: torch.Tensor  # [T] int64, -1 where a token has no page (padded graph rows)
    max_query_len: int


@dataclass
class SplitMeta(PagedMeta):
    """The metadata of a forward captured in pieces (`nvl72.engine.prefill_graphs`): each attention is
    handed to `attend` (`forward`'s arguments), each Gated DeltaNet's sequence mixing to `mix`
    (`GatedDeltaNet.forward`'s `split`), which end one captured piece and begin the next; those run
    between replays, planned for the step being served."""

    attend: Callable | None = None
    mix: Callable | None = None


def capturing(batch: ForwardBatch) -> bool:
    """Whether this forward is being captured into a CUDA graph: its plan may not read device values back."""
    return batch.input_ids.is_cuda and torch.cuda.is_current_stream_capturing()


class TritonBackend(AttentionBackend):
    name = "triton"
    graph_safe = True
    fused_qk_norm_rope = True
    fused_ops = True

    def __init__(self):
        from nvl72.model import fused_triton

        self.kernels = fused_triton
        # Single-token attention projections through fused_triton.gemv instead of cuBLAS: with PDL it
        # streams its weights while the previous kernel drains (H200, 8-layer 30B-A3B shape, batch 1:
        # 0.688 -> 0.650 ms/step; `tests/runner/gpu_decode_b1.sh --pdl`). $NVL72_TRITON_GEMV=0: cuBLAS.
        self.gemv = _flag(GEMV_ENV)
        log.info("attention projections: %s for single-token steps ($%s)",
                 "Triton GEMV" if self.gemv else "cuBLAS", GEMV_ENV)
        # One-token steps with the input norm inside the q/k/v GEMV (`fused_triton.norm_gemv`): one
        # dependent launch fewer a layer (H100, 48 layers, batch 1: 2.748 -> 2.679-2.686 ms a step,
        # perf/RESULTS.md); $NVL72_NORM_GEMV=0: add_rms_norm, then the GEMV.
        self.norm_gemv = self.gemv and _flag(NORM_GEMV_ENV)
        # Where the kernel bundle has the shape, those GEMVs run nvl72.kernels.sm90_gemv (each CTA's weight
        # slice in shared memory, asked for before its PDL wait; $NVL72_SMEM_GEMV=0: Triton's everywhere)
        from nvl72.model import smem_gemv

        self.smem_gemv = smem_gemv.load() if self.gemv else None
        log.info("one-token steps: the input norm %s the q/k/v GEMV ($%s)", "inside" if self.norm_gemv else "before",
                 NORM_GEMV_ENV)
        # One-token steps whose attention splits keys (small batches) with the q/k norm, RoPE and K/V store
        # inside the attention kernel (`fused_triton.norm_rope_paged_attention`): one dependent launch fewer a
        # layer (H200, 48 layers, batch 1: 1.806 -> 1.748 ms a step; at batch 64, one program a sequence,
        # 1.0% slower, so not there); $NVL72_QK_NORM_ATTN=0: qk_norm_rope, then the attention
        self.qk_attn = _flag(QK_ATTN_ENV)
        log.info("one-token steps: the q/k norm %s the attention kernel ($%s)", "inside" if self.qk_attn else "before",
                 QK_ATTN_ENV)
        # Batch-1 steps whose attention fills 2 to smem_gemv.LEAVE key splits: o_proj's kernel combines
        # the splits' partials while staging its x, the attention skips its arrival atomic and partial
        # reload (H200, 48 layers: 1.727 -> 1.669 ms a step at contexts to 192 keys, 2-4 splits; up to 8 splits
        # since: 1.746 -> 1.698 at 128-512 keys); $NVL72_ATTN_O_PROJ=0: the attention combines
        self.attn_o_proj = self.qk_attn and self.smem_gemv is not None and _flag(ATTN_O_PROJ_ENV)
        log.info("batch-1 steps: the attention's split combine %s ($%s)",
                 "inside o_proj's kernel where it has the shape" if self.attn_o_proj else "in the attention",
                 ATTN_O_PROJ_ENV)
        # One-token steps of the layers nvl72.model.decode_layer serves in one persistent kernel
        # ("fused"), or in its six phases as separate launches ("phased"); "0": the per-op kernels.
        from nvl72.model.decode_layer import MODES

        mode = os.environ.get(DECODE_LAYER_ENV, DECODE_LAYER_DEFAULT)
        if mode != "0" and mode not in MODES:
            raise ValueError(f"${DECODE_LAYER_ENV}={mode!r}: expected 0 or one of {', '.join(MODES)}")
        self.decode_layer = None if mode == "0" else mode
        log.info("one-token decoder layers: %s ($%s=%s)",
                 "per-op kernels" if mode == "0" else f"one kernel a layer ({mode})", DECODE_LAYER_ENV, mode)

    def linear(self, x, weight, bias=None):
        if self.gemv and x.shape[0] == 1:
            out = self.smem_gemv.gemv(x, weight, bias) if self.smem_gemv else None
            return self.kernels.gemv(x, weight, bias) if out is None else out
        return torch.nn.functional.linear(x, weight, bias)

    def norm_linear(self, x, delta, norm_weight, eps, zero_centered, weight, bias=None):
        if self.norm_gemv and x.shape[0] == 1:
            got = (self.smem_gemv.norm_gemv(x, delta, norm_weight, eps, zero_centered, weight, bias)
                   if self.smem_gemv else None)
            if got is None:
                got = self.kernels.norm_gemv(x, delta, norm_weight, eps, zero_centered, weight, bias)
            return got
        return super().norm_linear(x, delta, norm_weight, eps, zero_centered, weight, bias)

    def norm_rope_attend(self, q_raw, k_raw, v, q_weight, k_weight, cos, sin, num_heads, num_kv_heads, head_dim,
                         eps, zero_centered, gated, kv_cache, meta: PagedMeta, scale):
        splits = self._fused_splits(meta, num_kv_heads, head_dim, kv_cache)
        if not splits:
            return super().norm_rope_attend(q_raw, k_raw, v, q_weight, k_weight, cos, sin, num_heads, num_kv_heads,
                                            head_dim, eps, zero_centered, gated, kv_cache, meta, scale)
        b = meta.batch
        return self.kernels.norm_rope_paged_attention(q_raw, k_raw, v, q_weight, k_weight, cos, sin, num_heads,
                                                      head_dim, eps, zero_centered, gated, kv_cache, meta.slot_mapping,
                                                      b.query_start_loc, b.seq_lens, b.page_table, scale, splits)

    def norm_rope_attend_linear(self, q_raw, k_raw, v, q_weight, k_weight, cos, sin, num_heads, num_kv_heads,
                                head_dim, eps, zero_centered, gated, kv_cache, meta, scale, weight, bias=None):
        leave = 0
        splits = self._fused_splits(meta, num_kv_heads, head_dim, kv_cache)
        if self.attn_o_proj and q_raw.shape[0] == 1 and not gated and splits:
            leave = self.smem_gemv.attn_leave(q_raw.dtype, weight, bias, head_dim)
        if not leave:
            return super().norm_rope_attend_linear(q_raw, k_raw, v, q_weight, k_weight, cos, sin, num_heads,
                                                   num_kv_heads, head_dim, eps, zero_centered, gated, kv_cache, meta,
                                                   scale, weight, bias)
        b = meta.batch
        parts = self.smem_gemv.attn_partials(q_raw, k_raw, v, q_weight, k_weight, cos, sin, num_heads, head_dim, eps,
                                             zero_centered, kv_cache, meta.slot_mapping, b.seq_lens, b.page_table,
                                             scale, splits, leave)
        if parts is None:
            parts, _ = self.kernels.norm_rope_paged_attention_partials(
                q_raw, k_raw, v, q_weight, k_weight, cos, sin, num_heads, head_dim, eps, zero_centered, False,
                kv_cache, meta.slot_mapping, b.query_start_loc, b.seq_lens, b.page_table, scale, splits, leave)
        return self.smem_gemv.attn_gemv(parts, weight)

    def _fused_splits(self, meta: PagedMeta, num_kv_heads: int, head_dim: int, kv_cache) -> int:
        """The key splits of a step whose q/k norm runs inside the attention (one-token steps whose
        launch splits keys), passed on to its launch; 0 for the others."""
        if not (self.qk_attn and meta.max_query_len == 1):
            return 0
        b = meta.batch
        splits = self.kernels.decode_splits(kv_cache.device, b.seq_lens.shape[0], num_kv_heads,
                                            b.page_table.shape[1] * kv_cache.shape[3], self.kernels.key_block(head_dim))
        return splits if splits > 1 else 0

    def plan(self, batch: ForwardBatch, page_size: int) -> PagedMeta:
        in_capture = capturing(batch)
        max_q = batch.max_query_len
        if max_q is None:
            if in_capture:
                raise ValueError("a captured forward needs batch.max_query_len set on the host")
            max_q = int(batch.query_lens().max()) if batch.num_seqs else 0
        slots = self.kernels.slot_mapping(batch.positions, batch.query_start_loc, batch.page_table, page_size)
        if not in_capture and bool((slots < 0).any()):  # the references' check; graphs pad on purpose
            bad = int(torch.nonzero(slots < 0)[0, 0])
            raise ValueError(f"token {bad} at position {int(batch.positions[bad])} has no KV page "
                             "(page_table entry -1) in its sequence")
        return PagedMeta(batch, slots, max_q)

    def forward(self, q, k, v, kv_cache, meta: PagedMeta, scale, stored=False, out=None):
        if not stored:
            self.kernels.store_kv(kv_cache, k, v, meta.slot_mapping)
        b = meta.batch
        return self.kernels.paged_attention(q, kv_cache, b.query_start_loc, b.seq_lens, b.page_table,
                                            meta.max_query_len, scale, out)


@dataclass
class FlashInferMeta(PagedMeta):
    """PagedMeta (so triton's fused ops see the step's shape) and the FlashInfer wrapper planned for it."""

    wrapper: object = None


class FlashInferBackend(TritonBackend):
    """triton's backend with FlashInfer's paged prefill (FA3 on Hopper) for every batch with prefill
    rows: the q/k norm, RoPE and K/V store stay triton's, the attention is FlashInfer's (bottom-right
    causal: a chunk's queries see the cached prefix). One-token steps, and whatever a CUDA graph
    captures (speculative decoding's 1 + k-token rows), keep triton's kernels, whose plan needs no host
    sync; `decode=True` ($NVL72_FLASHINFER_DECODE=1) sends all-decode batches to FlashInfer's decode
    wrapper instead (planned on the host: eager steps only)."""

    name = "flashinfer"
    WORKSPACE_BYTES = 256 << 20

    def __init__(self, shape: AttentionShape, device: torch.device, decode: bool | None = None):
        import flashinfer

        super().__init__()
        self.shape, self.device = shape, device
        self.flashinfer_decode = _flag(FLASHINFER_DECODE_ENV, "0") if decode is None else decode
        self.graph_safe = not self.flashinfer_decode
        self.workspace = torch.zeros(self.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="HND")
        self.decode = (flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, kv_layout="HND")
                       if self.flashinfer_decode else None)
        self._probe()
        log.info("flashinfer backend: prefill batches in FlashInfer's paged prefill, one-token steps in %s ($%s)",
                 "FlashInfer's decode wrapper (eager)" if self.flashinfer_decode else "triton's decode kernels",
                 FLASHINFER_DECODE_ENV)

    def _probe(self) -> None:
        """Plan and run a two-token prefill (and decode, where asked for) on one scratch page, so that a
        FlashInfer module that neither is prebuilt nor compiles here fails at selection, not in the
        first request (and a JIT compile happens now)."""
        s = self.shape
        cache = torch.zeros(1, 2, s.num_kv_heads, 16, s.head_dim, dtype=s.dtype, device=self.device)
        indptr, indices = (torch.tensor(x, dtype=torch.int32, device=self.device) for x in ([0, 1], [0]))
        try:
            self._plan(indptr * 2, indptr, indices, indptr[1:] * 2, 16).run(
                cache.new_zeros(2, s.num_heads, s.head_dim), cache)
            if self.decode is not None:
                self._plan(None, indptr, indices, indptr[1:], 16).run(cache.new_zeros(1, s.num_heads, s.head_dim),
                                                                      cache)
        except Exception as e:  # whatever FlashInfer raises for a module it cannot load or build
            raise BackendUnavailable(f"FlashInfer could not run {s.dtype} head_dim {s.head_dim}: "
                                     f"{type(e).__name__}: {e}") from e

    def _plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, page_size: int):
        """The decode wrapper (qo_indptr None) or the prefill wrapper (bottom-right causal), planned for
        this shape and these page lists; returned."""
        s = self.shape
        common = dict(q_data_type=s.dtype, kv_data_type=s.dtype, sm_scale=s.head_dim**-0.5)
        if qo_indptr is None:
            self.decode.plan(kv_indptr, kv_indices, last_page_len, s.num_heads, s.num_kv_heads, s.head_dim, page_size,
                             **common)
            return self.decode
        self.prefill.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, s.num_heads, s.num_kv_heads, s.head_dim,
                          page_size, causal=True, **common)
        return self.prefill

    @staticmethod
    def page_lists(batch: ForwardBatch, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kv_indptr [B+1], kv_indices [sum pages], last_page_len [B]) int32 on the host (one sync)."""
        seq_lens = batch.seq_lens.cpu().long()
        table = batch.page_table.cpu()
        npages = (seq_lens + page_size - 1) // page_size  # [B]
        width = torch.arange(table.shape[1])
        indices = table[width[None, :] < npages[:, None]]  # [sum npages], row by row
        if bool((indices < 0).any()):
            raise ValueError("page_table has -1 inside a sequence's context (seq_lens exceed its pages)")
        indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        indptr[1:] = npages.cumsum(0)
        last = (seq_lens - (npages - 1) * page_size).to(torch.int32)
        return indptr, indices.to(torch.int32), last

    def plan(self, batch: ForwardBatch, page_size: int) -> PagedMeta:
        meta = super().plan(batch, page_size)
        decode = meta.max_query_len <= 1
        if (decode and not self.flashinfer_decode) or capturing(batch):  # (graphs: MTP's 1 + k-token rows)
            return meta
        indptr, indices, last = (x.to(self.device) for x in self.page_lists(batch, page_size))
        wrapper = self._plan(None if decode else batch.query_start_loc.to(torch.int32), indptr, indices, last,
                             page_size)
        return FlashInferMeta(meta.batch, meta.slot_mapping, meta.max_query_len, wrapper)

    def _fused_splits(self, meta: PagedMeta, num_kv_heads: int, head_dim: int, kv_cache) -> int:
        return 0 if isinstance(meta, FlashInferMeta) else super()._fused_splits(meta, num_kv_heads, head_dim, kv_cache)

    def forward(self, q, k, v, kv_cache, meta: PagedMeta, scale, stored=False, out=None):
        if not isinstance(meta, FlashInferMeta):
            return super().forward(q, k, v, kv_cache, meta, scale, stored, out)
        if abs(scale - self.shape.head_dim**-0.5) > 1e-12:
            raise ValueError(f"scale {scale} differs from the planned head_dim**-0.5")
        if not stored:
            self.kernels.store_kv(kv_cache, k, v, meta.slot_mapping)
        return meta.wrapper.run(q, kv_cache, out=out)


NAMES = ("torch", "triton", "flashinfer")


def available(name: str, device: torch.device, shape: AttentionShape | None = None) -> str | None:
    """None when backend `name` can run on `device` (for `shape`, when given), else the reason it cannot."""
    if name not in NAMES:
        return f"unknown attention backend {name!r}; known: {', '.join(NAMES)}"
    if name == "torch":
        return None
    if importlib.util.find_spec("triton") is None and name in ("triton", "flashinfer"):
        return "the triton package is not importable"
    if device.type != "cuda" and not (name == "triton" and os.environ.get("TRITON_INTERPRET") == "1"):
        return f"needs a CUDA device (got {device})"
    if name in ("triton", "flashinfer") and shape is not None:  # flashinfer keeps triton's decode and fused ops
        from nvl72.model import fused_triton

        if not fused_triton.attention_shape_ok(shape.num_heads, shape.num_kv_heads, shape.head_dim):
            return (f"its kernels need a whole query group per KV head and a power-of-two head_dim >= 16 "
                    f"({shape.num_heads}/{shape.num_kv_heads} heads x {shape.head_dim})")
    if name == "flashinfer":
        if importlib.util.find_spec("flashinfer") is None:
            return "the flashinfer package is not importable"
        major = torch.cuda.get_device_capability(device)[0]
        if major != 9:
            return f"its prefill runs FlashInfer's FA3 modules, built for sm_90a (device is sm_{major}x)"
        if shape is not None and (shape.dtype not in (torch.bfloat16, torch.float16) or
                                  shape.head_dim not in FLASHINFER_HEAD_DIMS):
            return (f"FlashInfer's FA3 prefill takes bf16 / fp16 with head_dim in {FLASHINFER_HEAD_DIMS} "
                    f"({shape.dtype}, head_dim {shape.head_dim})")
    return None


def default_name(device: torch.device, shape: AttentionShape | None = None) -> str:
    """flashinfer on CUDA (triton's graph-safe decode, FlashInfer's FA3 prefill: H200, 48-layer
    Qwen3-30B-A3B shape, TTFT of an 8K prompt 211 -> 137 ms, perf/RESULTS.md), else triton (decode and
    prefill in its own kernels), else the torch reference (also for shapes the others do not serve,
    e.g. the tiny test models' head_dim 8)."""
    for name in ("flashinfer", "triton"):
        if device.type == "cuda" and available(name, device, shape) is None:
            return name
    return "torch"


def select(shape: AttentionShape, device: torch.device | str, name: str | None = None) -> AttentionBackend:
    """The backend for `device`: `name`, else $NVL72_ATTN_BACKEND, else `default_name`; logged."""
    device = torch.device(device)
    requested = name or os.environ.get(ENV) or None
    if requested == "auto":
        requested = None
    chosen = requested or default_name(device, shape)
    reason = available(chosen, device, shape)
    if reason is not None:
        raise BackendUnavailable(f"attention backend {chosen!r}: {reason}")
    try:
        backend = {"torch": TorchBackend, "triton": TritonBackend}[chosen]() if chosen != "flashinfer" \
            else FlashInferBackend(shape, device)
    except BackendUnavailable as e:
        if requested:
            raise
        log.warning("attention backend: %s; falling back to triton", e)
        chosen, backend = "triton", TritonBackend()
    log.info("attention backend: %s (%s; device %s, %d/%d heads x %d, %s)", chosen,
             "requested" if requested else "by capability", device, shape.num_heads, shape.num_kv_heads,
             shape.head_dim, shape.dtype)
    return backend
