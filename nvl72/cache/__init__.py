"""KV pages, GDN state slots and the prefix tree (owned by the engine, read by the model)."""
from nvl72.cache.pool import OutOfCapacity, RefPool
from nvl72.cache.prefix import PrefixCache, PrefixMatch
from nvl72.cache.tensors import num_pages_for_budget, zero_slots

__all__ = ["OutOfCapacity", "RefPool", "PrefixCache", "PrefixMatch", "num_pages_for_budget", "zero_slots"]
