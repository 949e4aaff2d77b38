"""The contract between the engine and the model forward.

The engine (scheduler + runner) decides which sequences run together and fills a `ForwardBatch`;
the model computes it and knows nothing of why the sequences were grouped. Prefill chunks and
decode tokens are mixed freely in one flattened batch: sequence `i` contributes tokens
`query_start_loc[i]:query_start_loc[i+1]`, which are the last `query_len` tokens of a context of
`seq_lens[i]` tokens whose KV lives in the pages `page_table[i]`.

Caches are owned by the engine (`nvl72.cache`) and passed in as `ModelCaches`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, flattened new tokens of all sequences
    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    query_start_loc: torch.Tensor  # [B+1] int32, cumulative new-token counts (cu_seqlens)
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new)
    page_table: torch.Tensor  # [B, max_pages] int32, KV page ids per sequence (-1 padding)
    # Gated DeltaNet state indirection (hybrid models; None for pure-attention models).
    state_read_slots: torch.Tensor | None = None  # [B] int64, slot holding the state to start from
    # [T] int64, slot to write the state *after* each token into, -1 = do not write. A prefill
    # chunk writes only its last token; a speculative verify step writes every draft position
    # into its own row so acceptance can move a pointer instead of copying state back.
    state_write_slots: torch.Tensor | None = None
    # Rows of the hidden states whose logits are wanted (e.g. the last token of each sequence).
    logits_indices: torch.Tensor | None = None  # [N] int64
    # Host-side max of the query lengths, if the engine knows it: lets layers pick kernels (e.g. GDN
    # recurrent vs chunked rule) without a device sync, as CUDA-graph decode needs.
    max_query_len: int | None = None
    # Every sequence feeds its next token and its drafts only (a decode or verify step, as the decode
    # graphs run it; the engine knows it on the host). Layers take their few-token paths, whose rounding
    # differs from prefill's (the fused GDN mixer is fp32 throughout), only for such steps, so a prompt's
    # states do not depend on whether its prefill ran eagerly or in prefill graphs' pieces.
    decode: bool = False

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]


@dataclass
class ModelCaches:
    """Per-layer cache tensors, indexed by the model's layer index (None where a layer has none).

    kv[l]:        [num_pages, 2, kv_heads, page_size, head_dim]  (HND pages, K then V)
    conv[l]:      [num_slots, conv_dim, conv_kernel - 1]          (GDN causal-conv tail)
    recurrent[l]: [num_slots, v_heads, k_head_dim, v_head_dim]    (GDN state, fp32)
    """

    kv: list[torch.Tensor | None] = field(default_factory=list)
    conv: list[torch.Tensor | None] = field(default_factory=list)
    recurrent: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def page_size(self) -> int:
        for t in self.kv:
            if t is not None:
                return t.shape[3]
        raise ValueError("ModelCaches holds no KV layer")
