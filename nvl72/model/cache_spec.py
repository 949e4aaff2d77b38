"""What the model needs the engine to allocate: per-layer KV pages and GDN state slots.

Layer indices are `ModelCaches` indices: decoder layers `0..num_hidden_layers-1`, then the MTP
layers. The engine owns the tensors (`nvl72.cache`); `CacheSpec.allocate` is the plain allocation
the tests (and a simple engine) use.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nvl72.model.batch import ModelCaches


@dataclass(frozen=True)
class KVLayerSpec:
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def page_shape(self, page_size: int) -> tuple[int, ...]:
        """One page: [2, kv_heads, page_size, head_dim] (HND, K then V)."""
        return (2, self.num_kv_heads, page_size, self.head_dim)

    def page_bytes(self, page_size: int) -> int:
        return 2 * self.num_kv_heads * page_size * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True)
class StateLayerSpec:
    conv_shape: tuple[int, ...]  # per slot: (conv_dim, conv_kernel - 1)
    conv_dtype: torch.dtype
    recurrent_shape: tuple[int, ...]  # per slot: (v_heads, k_head_dim, v_head_dim)
    recurrent_dtype: torch.dtype

    def slot_bytes(self) -> int:
        conv = self.conv_dtype.itemsize
        rec = self.recurrent_dtype.itemsize
        n_conv = n_rec = 1
        for s in self.conv_shape:
            n_conv *= s
        for s in self.recurrent_shape:
            n_rec *= s
        return n_conv * conv + n_rec * rec


@dataclass(frozen=True)
class CacheSpec:
    num_layers: int  # length of each ModelCaches list (decoder layers + MTP layers)
    kv: dict[int, KVLayerSpec] = field(default_factory=dict)  # full-attention (and MTP) layers
    state: dict[int, StateLayerSpec] = field(default_factory=dict)  # Gated DeltaNet layers

    def kv_bytes_per_page(self, page_size: int) -> int:
        """Bytes one page id costs across all KV layers (a page id indexes every layer's pool)."""
        return sum(s.page_bytes(page_size) for s in self.kv.values())

    def state_bytes_per_slot(self) -> int:
        """Bytes one state slot id costs across all GDN layers."""
        return sum(s.slot_bytes() for s in self.state.values())

    def allocate(self, num_pages: int, page_size: int, num_slots: int, device=None) -> ModelCaches:
        """Zero-filled caches: kv[l] [num_pages, 2, Hkv, page_size, D]; conv/recurrent [num_slots, ...]."""
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages={num_pages} and page_size={page_size} must be positive")
        if self.state and num_slots <= 0:
            raise ValueError(f"num_slots={num_slots} must be positive for a model with GDN layers")
        caches = ModelCaches(kv=[None] * self.num_layers, conv=[None] * self.num_layers, recurrent=[None] * self.num_layers)
        for i, s in self.kv.items():
            caches.kv[i] = torch.zeros((num_pages, *s.page_shape(page_size)), dtype=s.dtype, device=device)
        for i, s in self.state.items():
            caches.conv[i] = torch.zeros((num_slots, *s.conv_shape), dtype=s.conv_dtype, device=device)
            caches.recurrent[i] = torch.zeros((num_slots, *s.recurrent_shape), dtype=s.recurrent_dtype, device=device)
        return caches
