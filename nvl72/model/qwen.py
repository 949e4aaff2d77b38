"""One causal LM for the three Qwen MoE families (qwen3_moe, qwen3_next, qwen3_5_moe).

embed -> decoder layers (full attention or Gated DeltaNet by `config.layer_types`) -> final norm
-> lm_head (or the tied embedding). `forward(batch, caches)` returns the final hidden states
[T, H]; `compute_logits` turns the rows the engine wants into logits. The optional MTP head
(`mtp.*` weights, Qwen3-Next / Qwen3.5) drafts the token after next from those hidden states.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from nvl72.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from nvl72.model import ops
from nvl72.model.batch import ForwardBatch, ModelCaches
from nvl72.model.cache_spec import CacheSpec, KVLayerSpec, StateLayerSpec
from nvl72.model.gdn import GatedDeltaNet
from nvl72.model.layers import DecoderLayer, ForwardContext, RMSNorm, add_norm, rope_inv_freq
from nvl72.model.parallel_layout import SINGLE, LayoutError, ParallelLayout
from nvl72.model.weights import attach_default_loaders

log = logging.getLogger(__name__)


class QwenModel(nn.Module):
    """The decoder stack (checkpoint prefix `model.`)."""

    def __init__(self, config: ModelConfig, parallel: ParallelLayout, dtype=None, device=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, t, config.is_moe_layer(i), parallel, dtype=dtype, device=device)
            for i, t in enumerate(config.layer_types)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.zero_centered_norm, dtype=dtype, device=device)


class MTPHead(nn.Module):
    """Multi-token prediction (checkpoint prefix `mtp.`), as vLLM's qwen3_next_mtp / qwen3_5_mtp:

    h = fc(cat[pre_fc_norm_embedding(embed(next_token)), pre_fc_norm_hidden(hidden)]);
    h = layers[step](h)  (a full-attention MoE decoder layer with its own KV, cache index
    num_hidden_layers + step); out = norm(h). Embedding and lm_head are the main model's."""

    def __init__(self, config: ModelConfig, parallel: ParallelLayout, dtype=None, device=None):
        super().__init__()
        h, eps, zc = config.hidden_size, config.rms_norm_eps, config.zero_centered_norm
        kw = dict(dtype=dtype, device=device)
        self.fc = nn.Linear(2 * h, h, bias=False, **kw)
        self.pre_fc_norm_embedding = RMSNorm(h, eps, zc, **kw)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, zc, **kw)
        self.layers = nn.ModuleList(
            DecoderLayer(config, config.num_hidden_layers + j, FULL_ATTENTION, config.num_experts > 0, parallel, **kw)
            for j in range(config.mtp_num_hidden_layers)
        )
        self.norm = RMSNorm(h, eps, zc, **kw)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext, step: int) -> torch.Tensor:
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)  # [T, 2H]
        x = self.layers[step % len(self.layers)](self.fc(x), ctx)
        return self.norm(x)


class QwenMoeForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        *,
        enable_mtp: bool | None = None,
        parallel: ParallelLayout = SINGLE,
    ):
        super().__init__()
        if enable_mtp and not config.has_mtp:
            raise ValueError(f"enable_mtp=True but {config.model_type} config has mtp_num_hidden_layers=0")
        self.config, self.dtype = config, dtype
        self.parallel = parallel
        self.model = QwenModel(config, parallel, dtype=dtype, device=device)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device)
        )
        use_mtp = config.has_mtp if enable_mtp is None else enable_mtp
        self.mtp = MTPHead(config, parallel, dtype=dtype, device=device) if use_mtp else None
        # nvl72.model.attn_backends backend, chosen by the engine at start-up; None: the ops references.
        self.attn_backend = None
        # fp32 RoPE table input; built at model dtype, so never `.to(dtype)` the model afterwards.
        self.register_buffer("inv_freq", rope_inv_freq(config).to(device), persistent=False)
        attach_default_loaders(self)
        self._cache_spec = self._make_cache_spec()

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    # ---- forward -------------------------------------------------------------------------------
    def _context(self, batch: ForwardBatch, caches: ModelCaches, with_attention: bool) -> ForwardContext:
        if not with_attention:
            return ForwardContext(batch, caches, None, None, None)
        backend = self.attn_backend
        if backend is None:
            meta = ops.AttentionMetadata.build(batch, caches.page_size)
        else:
            meta = backend.plan(batch, caches.page_size)
        cos, sin = (ops if backend is None else backend).rope_cos_sin(batch.positions, self.inv_freq, self.dtype)
        return ForwardContext(batch, caches, meta, cos, sin, backend)

    def forward(self, batch: ForwardBatch, caches: ModelCaches, check: bool = True) -> torch.Tensor:
        """Run the flattened batch; returns final-norm hidden states [T, H]. `check=False` skips the
        input checks, which read device values back (CUDA-graph capture cannot)."""
        if check:
            self._check(batch, caches)
        return self.forward_context(self._context(batch, caches, FULL_ATTENTION in self.config.layer_types))

    def forward_context(self, ctx: ForwardContext) -> torch.Tensor:
        """`forward` of a context the caller built (piecewise prefill graphs bring their own metadata)."""
        x, delta = self.model.embed_tokens(ctx.batch.input_ids), None  # [T, H]
        for layer in self.model.layers:
            x, delta = layer.forward_residual(x, delta, ctx)
        return add_norm(self.model.norm, x, delta, ctx)[1]

    def forward_mtp(self, batch: ForwardBatch, caches: ModelCaches, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        """MTP draft step. `batch.input_ids[t]` is the token *after* the one at `batch.positions[t]`
        (the main model's next token), `hidden` [T, H] the main model's output at that position;
        the MTP layer's KV goes to caches.kv[num_hidden_layers + step % mtp_num_hidden_layers] under the
        same page table.
        Returns normed hidden [T, H] for `compute_logits`."""
        if self.mtp is None:
            raise ValueError("this model was built without its MTP head (enable_mtp)")
        if hidden.shape != (batch.num_tokens, self.config.hidden_size):
            raise ValueError(f"hidden shape {tuple(hidden.shape)} != ({batch.num_tokens}, {self.config.hidden_size})")
        self._check(batch, caches)
        ctx = self._context(batch, caches, True)
        return self.mtp(self.model.embed_tokens(batch.input_ids), hidden, ctx, step)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V], fp32 (`fp32=False`: the model's dtype, as the decode graphs
        keep them: their argmax is the fp32 upcast's, and the sampler upcasts only when it needs to)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight)
        return logits.float() if fp32 else logits

    def _check(self, batch: ForwardBatch, caches: ModelCaches) -> None:
        n = self._cache_spec.num_layers
        if len(caches.kv) != n:
            raise ValueError(f"ModelCaches has {len(caches.kv)} layers, the model needs {n} (see cache_spec())")
        if batch.positions.shape != batch.input_ids.shape:
            raise ValueError(f"positions shape {tuple(batch.positions.shape)} != input_ids shape {tuple(batch.input_ids.shape)}")
        if int(batch.query_start_loc[-1]) != batch.num_tokens:
            raise ValueError(f"query_start_loc[-1]={int(batch.query_start_loc[-1])} != num_tokens={batch.num_tokens}")

    # ---- caches --------------------------------------------------------------------------------
    def cache_spec(self) -> CacheSpec:
        """Per-layer KV page and GDN state-slot shapes/dtypes this rank's engine must allocate
        (under TP: only this rank's KV heads and GDN heads)."""
        return self._cache_spec

    def _make_cache_spec(self) -> CacheSpec:
        cfg = self.config
        kv_spec = KVLayerSpec(self.parallel.kv_heads(cfg.num_key_value_heads)[1], cfg.head_dim, self.dtype)
        num_mtp = 0 if self.mtp is None else len(self.mtp.layers)
        kv = {i: kv_spec for i, t in enumerate(cfg.layer_types) if t == FULL_ATTENTION}
        kv.update({cfg.num_hidden_layers + j: kv_spec for j in range(num_mtp)})
        state = {}
        if LINEAR_ATTENTION in cfg.layer_types:
            conv_shape, rec_shape = GatedDeltaNet.state_shapes(cfg, self.parallel.tp_size)
            s = StateLayerSpec(tuple(conv_shape), self.dtype, tuple(rec_shape), torch.float32)
            state = {i: s for i, t in enumerate(cfg.layer_types) if t == LINEAR_ATTENTION}
        return CacheSpec(num_layers=cfg.num_hidden_layers + num_mtp, kv=kv, state=state)

    def allocate_caches(self, num_pages: int, page_size: int, num_slots: int = 0) -> ModelCaches:
        """Zeroed caches on the model's device (tests and simple engines)."""
        return self.cache_spec().allocate(num_pages, page_size, num_slots, device=self.device)


def build_model(
    config: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    *,
    enable_mtp: bool | None = None,
    ep_rank: int = 0,
    ep_size: int = 1,
    parallel: ParallelLayout | None = None,
) -> QwenMoeForCausalLM:
    """An unloaded model (parameters uninitialised); fill it with `nvl72.model.loader.load_weights`.

    `parallel` cuts it for one rank (TP/EP, see `ParallelLayout`); `ep_rank`/`ep_size` alone mean
    experts split without TP (the caller combines)."""
    parallel = resolve_layout(parallel, ep_rank, ep_size)
    model = QwenMoeForCausalLM(config, dtype, device, enable_mtp=enable_mtp, parallel=parallel)
    spec = model.cache_spec()
    log.info(
        "model %s: %d layers (%d full attention, %d GDN), MTP layers %d, %s on %s, TP %d/%d (%d KV heads), "
        "EP %d/%d, attention: torch reference",
        config.model_type, config.num_hidden_layers, config.layer_types.count(FULL_ATTENTION),
        config.layer_types.count(LINEAR_ATTENTION), spec.num_layers - config.num_hidden_layers, dtype, model.device,
        parallel.tp_rank, parallel.tp_size, parallel.kv_heads(config.num_key_value_heads)[1],
        parallel.ep_rank, parallel.ep_size,
    )
    return model.eval().requires_grad_(False)


def resolve_layout(parallel: ParallelLayout | None, ep_rank: int, ep_size: int) -> ParallelLayout:
    """`parallel`, or the EP-only layout of the legacy `ep_rank`/`ep_size` arguments (not both)."""
    if parallel is None:
        return ParallelLayout(ep_rank=ep_rank, ep_size=ep_size) if (ep_rank, ep_size) != (0, 1) else SINGLE
    if (ep_rank, ep_size) != (0, 1):
        raise LayoutError(f"ep_rank={ep_rank}, ep_size={ep_size} given beside parallel={parallel}: "
                          "put them in the ParallelLayout")
    return parallel
