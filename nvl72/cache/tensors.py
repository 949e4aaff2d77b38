"""Cache tensor helpers the engine needs beyond the model's `CacheSpec.allocate`: zeroing GDN
slots before a fresh sequence starts from them, and sizing the pools from a byte budget."""
from __future__ import annotations

import torch

from nvl72.model.batch import ModelCaches
from nvl72.model.cache_spec import CacheSpec


def zero_slots(caches: ModelCaches, slots: list[int]) -> None:
    """Zero GDN conv and recurrent state slots (a working slot is never started from dirty)."""
    if not slots:
        return
    for t in (*caches.conv, *caches.recurrent):
        if t is not None:
            t.index_fill_(0, torch.tensor(slots, dtype=torch.long, device=t.device), 0)


def num_pages_for_budget(spec: CacheSpec, page_size: int, budget_bytes: int) -> int:
    """How many pages (each a page id across every KV layer) fit in `budget_bytes`."""
    per_page = spec.kv_bytes_per_page(page_size)
    if per_page == 0:
        raise ValueError("the model caches no KV (cache_spec().kv is empty)")
    return budget_bytes // per_page
