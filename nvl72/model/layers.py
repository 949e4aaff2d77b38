"""Building blocks of the Qwen MoE decoders: RMSNorm, gated GQA attention over paged KV, decoder layer.

Parameter names mirror the Hugging Face checkpoints (`self_attn.q_proj`, `mlp.gate`, ...) so the
loader maps keys one to one; only routed experts differ (`mlp.w13` / `mlp.w2`, see `moe.MoE`).
Under tensor parallelism (`ParallelLayout`) every layer holds its rank's heads / intermediate
slice, each sharded parameter carries a loader that reads its slice from the full checkpoint
tensor, and `DecoderLayer.forward` makes the two all-reduces of the layer explicitly.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from moe import MoE, SharedExpert
from nvl72.config import FULL_ATTENTION, ModelConfig
from nvl72.model import dp_ep, ops
from nvl72.model.attn_backends import SplitMeta
from nvl72.model.batch import ForwardBatch, ModelCaches
from nvl72.model.gdn import GatedDeltaNet
from nvl72.model.parallel_layout import SINGLE, ParallelLayout
from nvl72.model.weights import PackedRows, expert_weight_loader, first_rank_loader, shard_loader

log = logging.getLogger(__name__)


@dataclass
class ForwardContext:
    """What every layer of one forward shares: the batch, its caches and precomputed indexing."""

    batch: ForwardBatch
    caches: ModelCaches
    attn: ops.AttentionMetadata | None  # None when the model has no attention layer in this pass
    cos: torch.Tensor | None  # [T, rotary_dim]
    sin: torch.Tensor | None
    # nvl72.model.attn_backends.AttentionBackend that planned `attn`; None: the ops references.
    backend: object | None = None


class RMSNorm(nn.Module):
    """RMSNorm; `zero_centered` stores w around 0 and scales by (1 + w) (Qwen3-Next / Qwen3.5)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool, dtype=None, device=None):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        init = torch.zeros if zero_centered else torch.ones
        self.weight = nn.Parameter(init(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, self.zero_centered)


def add_norm(norm: RMSNorm, x: torch.Tensor, delta: torch.Tensor | None, ctx: ForwardContext,
             moe: MoE | None = None):
    """(x + delta, norm(x + delta)); delta None: (x, norm(x)); with `moe` also its routing of the
    normed rows, (topk_weights, topk_ids), as a third element. One kernel where the attention backend
    fuses them (`fused_ops`: a decode layer's torch add, casts, square, mean, rsqrt and products were
    a dozen small kernels, the router a GEMV), else the reference add, `ops.rms_norm` and F.linear;
    then the MoE's own routing of the logits."""
    b = ctx.backend
    if b is not None and b.fused_ops and x.dim() == 2:
        if moe is None:
            return b.add_rms_norm(x, delta, norm.weight, norm.eps, norm.zero_centered)
        s, h, logits = b.add_rms_norm(x, delta, norm.weight, norm.eps, norm.zero_centered,
                                          moe.router_weight())
        return s, h, moe.route(h, logits)
    s = x if delta is None else x + delta
    h = norm(s)
    return (s, h) if moe is None else (s, h, moe.route(h))


# At or below this many tokens the MoE router's GEMV runs inside the post-attention norm kernel
# (each token's programs read the whole gate weight: fine for decode batches, not for prefill).
FUSED_ROUTER_TOKENS = 8


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[rotary_dim / 2] fp32 inverse frequencies (transformers' default RoPE, computed on CPU)."""
    dim = config.rotary_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


class Attention(nn.Module):
    """GQA with per-head q/k RMSNorm and (hybrid families) a sigmoid output gate.

    With the gate, `q_proj` emits per head [query (D) | gate (D)] interleaved head by head, as
    transformers' `view(T, heads, 2D).chunk(2)` reads it. Under TP this rank holds q heads
    `[q0, q0 + num_heads)` and KV heads `[kv0, kv0 + num_kv_heads)` (see `ParallelLayout.kv_heads`);
    `o_proj` returns the rank's partial sum."""

    def __init__(self, config: ModelConfig, cache_idx: int, parallel: ParallelLayout = SINGLE, dtype=None, device=None):
        super().__init__()
        self.cache_idx = cache_idx
        q0, self.num_heads = parallel.split(config.num_attention_heads, "num_attention_heads")
        kv0, self.num_kv_heads = parallel.kv_heads(config.num_key_value_heads)
        self.head_dim = config.head_dim
        self.gated = config.attn_output_gate
        self.scale = self.head_dim**-0.5
        h, d = config.hidden_size, self.head_dim
        q_rows = d * (2 if self.gated else 1)  # q_proj rows per head
        kw = dict(bias=config.attention_bias, dtype=dtype, device=device)
        self.q_proj = nn.Linear(h, self.num_heads * q_rows, **kw)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, **kw)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, **kw)
        self.o_proj = nn.Linear(self.num_heads * d, h, **kw)
        zc = config.zero_centered_norm
        self.q_norm = RMSNorm(d, config.rms_norm_eps, zc, dtype=dtype, device=device)
        self.k_norm = RMSNorm(d, config.rms_norm_eps, zc, dtype=dtype, device=device)
        self.packed_qkv = PackedRows(self.q_proj, self.k_proj, self.v_proj)  # at batch 1: one GEMV, not three
        if parallel.tp_size > 1:
            hq, hkv = config.num_attention_heads, config.num_key_value_heads
            columns = [(self.q_proj, q0 * q_rows, self.num_heads * q_rows, hq * q_rows)]
            columns += [(p, kv0 * d, self.num_kv_heads * d, hkv * d) for p in (self.k_proj, self.v_proj)]
            for lin, start, n, full in columns:
                for p in lin.parameters():
                    p.weight_loader = shard_loader(0, [(start, n)], full)
            self.o_proj.weight.weight_loader = shard_loader(1, [(q0 * d, self.num_heads * d)], hq * d)
            if self.o_proj.bias is not None:
                self.o_proj.bias.weight_loader = first_rank_loader(parallel.tp_rank)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        backend = ctx.backend
        if backend is not None and backend.fused_qk_norm_rope:
            return self._attend_packed(backend.linear(x, *self.packed_qkv()), ctx)
        t, d = x.shape[0], self.head_dim
        kv_cache = ctx.caches.kv[self.cache_idx]
        q = self.q_proj(x)
        gate = None
        if self.gated:
            q, gate = q.view(t, self.num_heads, 2 * d).chunk(2, dim=-1)  # [T, Hq, D] each
        else:
            q = q.view(t, self.num_heads, d)
        q = ops.apply_rope(self.q_norm(q), ctx.cos, ctx.sin)  # [T, Hq, D]
        k = ops.apply_rope(self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, d)), ctx.cos, ctx.sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, d)  # [T, Hkv, D]
        if backend is None:
            ops.write_kv(kv_cache, k, v, ctx.attn.slot_mapping)
            out = ops.paged_attention(q, kv_cache, ctx.attn, self.scale)
        else:
            out = backend.forward(q, k, v, kv_cache, ctx.attn, self.scale)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        out = out.reshape(t, self.num_heads * d)  # [T, Hq*D]
        if backend is not None:
            return backend.linear(out, self.o_proj.weight, self.o_proj.bias)
        return self.o_proj(out)

    def forward_block(self, x: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm,
                      ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, self(norm(s))) with s = x + delta (x when delta is None): the layer's input norm and the
        attention, the norm inside the q/k/v projection's kernel where the backend fuses them
        (`norm_linear`: at batch 1 one dependent launch fewer)."""
        b = ctx.backend
        if b is not None and b.fused_qk_norm_rope and b.fused_ops and x.dim() == 2:
            s, qkv = b.norm_linear(x, delta, norm.weight, norm.eps, norm.zero_centered, *self.packed_qkv())
            return s, self._attend_packed(qkv, ctx)
        s, h = add_norm(norm, x, delta, ctx)
        return s, self(h, ctx)

    def _attend_packed(self, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """o_proj of the attention from the packed q/k/v projection [T, rows]: the gate split, q/k norm,
        RoPE and the K/V store, then the attention and o_proj (`norm_rope_attend_linear`: one kernel for
        the first four, or for all but o_proj on one-token steps of the triton backend)."""
        t, d, backend = qkv.shape[0], self.head_dim, ctx.backend
        kv_cache = ctx.caches.kv[self.cache_idx]
        q_raw, k_raw, v = qkv.split([lin.out_features for lin in (self.q_proj, self.k_proj, self.v_proj)], dim=1)
        v = v.view(t, self.num_kv_heads, d)  # column slice of the packed output: strided rows
        return backend.norm_rope_attend_linear(q_raw, k_raw, v, self.q_norm.weight, self.k_norm.weight, ctx.cos,
                                               ctx.sin, self.num_heads, self.num_kv_heads, d, self.q_norm.eps,
                                               self.q_norm.zero_centered, self.gated, kv_cache, ctx.attn, self.scale,
                                               self.o_proj.weight, self.o_proj.bias)


def shard_swiglu_(mlp: SharedExpert, full: int, parallel: ParallelLayout) -> None:
    """Loaders for a SwiGLU MLP built with this rank's `full // tp_size` intermediate rows:
    gate/up column-parallel, down row-parallel."""
    i0, n = parallel.split(full, "intermediate size")
    mlp.gate_proj.weight.weight_loader = shard_loader(0, [(i0, n)], full)
    mlp.up_proj.weight.weight_loader = shard_loader(0, [(i0, n)], full)
    mlp.down_proj.weight.weight_loader = shard_loader(1, [(i0, n)], full)


def make_mlp(config: ModelConfig, sparse: bool, parallel: ParallelLayout = SINGLE, dtype=None,
             device=None) -> nn.Module:
    """`moe.MoE` for sparse layers (routed experts carry the expert loader), else a dense SwiGLU MLP.

    Under TP the dense MLP and the shared expert are split over all TP ranks (each adds its part);
    routed experts by id over the EP ranks and by intermediate over `expert_tp_size` ranks."""
    tp = parallel.tp_size
    if not sparse:
        _, n = parallel.split(config.intermediate_size, "intermediate_size")
        mlp = SharedExpert(config.hidden_size, n, dtype=dtype, device=device)
        if tp > 1:
            shard_swiglu_(mlp, config.intermediate_size, parallel)
        return mlp
    full_i, shared_i = config.moe_intermediate_size, config.shared_expert_intermediate_size
    i0, inter = parallel.split(full_i, "moe_intermediate_size", parallel.expert_tp_size, parallel.expert_tp_rank)
    mlp = MoE(
        config.hidden_size,
        config.num_experts,
        config.num_experts_per_tok,
        inter,
        norm_topk_prob=config.norm_topk_prob,
        shared_intermediate=parallel.split(shared_i, "shared_expert_intermediate_size")[1] if shared_i else 0,
        ep_rank=parallel.ep_rank,
        ep_size=parallel.ep_size,
        add_shared=True if tp > 1 else None,
        dtype=dtype,
        device=device,
    )
    for p, is_w13 in ((mlp.w13, True), (mlp.w2, False)):
        p.weight_loader = expert_weight_loader
        p.expert_offset, p.num_experts = mlp.expert_offset, mlp.num_experts
        p.inter_offset, p.inter_full, p.is_w13 = i0, full_i, is_w13
    if tp > 1 and mlp.shared_expert is not None:
        shard_swiglu_(mlp.shared_expert, shared_i, parallel)
    return mlp


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (full attention or Gated DeltaNet), then MLP/MoE.

    `cache_idx` is this layer's index in `ModelCaches` (the MTP layers come after the decoder's).
    Under TP both halves return partial sums; `parallel.reduce` (the TP all-reduce) completes
    them before each residual add. Under DP+EP (`parallel.dispatch`) the MoE exchanges this
    rank's tokens with the expert owners (`dp_ep.moe_forward`)."""

    def __init__(
        self,
        config: ModelConfig,
        cache_idx: int,
        layer_type: str,
        sparse: bool,
        parallel: ParallelLayout = SINGLE,
        dtype=None,
        device=None,
    ):
        super().__init__()
        self.cache_idx, self.layer_type = cache_idx, layer_type
        self.parallel = parallel
        eps, zc = config.rms_norm_eps, config.zero_centered_norm
        self.input_layernorm = RMSNorm(config.hidden_size, eps, zc, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, zc, dtype=dtype, device=device)
        if layer_type == FULL_ATTENTION:
            self.self_attn = Attention(config, cache_idx, parallel, dtype=dtype, device=device)
        else:
            self.linear_attn = GatedDeltaNet(config, cache_idx, parallel, dtype=dtype, device=device)
        self.mlp = make_mlp(config, sparse, parallel, dtype=dtype, device=device)
        self._one_kernel_reason: str | None = None  # see _one_kernel

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, delta = self.forward_residual(x, None, ctx)
        return x + delta

    def _one_kernel(self, ctx: ForwardContext) -> bool:
        """Whether a one-token step of this layer runs as `nvl72.model.decode_layer`'s single kernel:
        the attention backend enables it and the layer is one it serves (checked once, the reason
        logged when not)."""
        if getattr(ctx.backend, "decode_layer", None) is None:
            return False
        if self._one_kernel_reason is None:
            from nvl72.model import decode_layer

            self._one_kernel_reason = decode_layer.unsupported(self) or ""
            if self._one_kernel_reason:
                log.info("layer %d: one-token steps not in one kernel: %s", self.cache_idx, self._one_kernel_reason)
        return not self._one_kernel_reason

    def _gdn_block(self, x: torch.Tensor, delta: torch.Tensor | None,
                   ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, linear_attn(norm(s))) with s = x + delta. Decode and verify steps (`ForwardBatch.decode`,
        their `max_query_len` known and short) on a backend with the fused ops run three kernels at
        batch 1: the input norm inside the packed projections' GEMV, `mix_packed`, out_proj's GEMV."""
        gdn, b, i = self.linear_attn, ctx.backend, self.cache_idx
        conv, rec = ctx.caches.conv[i], ctx.caches.recurrent[i]
        short = (ctx.batch.decode and ctx.batch.max_query_len is not None
                 and ctx.batch.max_query_len <= gdn.RECURRENT_MAX_TOKENS)
        if b is not None and b.fused_ops and short and not isinstance(ctx.attn, SplitMeta) and x.dim() == 2:
            norm = self.input_layernorm
            s, proj = b.norm_linear(x, delta, norm.weight, norm.eps, norm.zero_centered, *gdn.packed_in_proj())
            return s, b.linear(gdn.mix_packed(proj, ctx.batch, conv, rec), gdn.out_proj.weight)
        s, h = add_norm(self.input_layernorm, x, delta, ctx)
        split = ctx.attn.mix if isinstance(ctx.attn, SplitMeta) else None  # piecewise prefill graphs
        return s, gdn(h, ctx.batch, conv, rec, split)

    def forward_residual(self, x: torch.Tensor, delta: torch.Tensor | None,
                         ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on x + delta, where delta (or None) is the previous layer's MLP output not yet
        added, so that the add runs in this layer's input-norm kernel. Returns (residual, this
        layer's MLP output): their sum is the layer's output."""
        if x.shape[0] == 1 and self._one_kernel(ctx):
            from nvl72.model import decode_layer

            return decode_layer.run(self, x, delta, ctx, ctx.backend.decode_layer)
        if self.layer_type == FULL_ATTENTION:
            x, h = self.self_attn.forward_block(x, delta, self.input_layernorm, ctx)
        else:
            x, h = self._gdn_block(x, delta, ctx)
        # all-reduce of the row-parallel o_proj / out_proj, then the residual add and the second norm
        delta, norm = self.parallel.reduce(h), self.post_attention_layernorm
        moe = self.mlp if isinstance(self.mlp, MoE) else None
        if moe is not None and self.parallel.dispatch is not None:  # DP+EP: dispatch/combine
            x, h = add_norm(norm, x, delta, ctx)
            return x, dp_ep.moe_forward(moe, h, self.parallel.dispatch)
        if moe is not None and x.shape[0] <= FUSED_ROUTER_TOKENS:
            x, h, routing = add_norm(norm, x, delta, ctx, moe)
            return x, self.parallel.reduce(moe(h, routing=routing))  # all-reduce of the experts
        x, h = add_norm(norm, x, delta, ctx)
        return x, self.parallel.reduce(self.mlp(h))  # all-reduce of the MLP / experts
