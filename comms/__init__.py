"""comms: symmetric memory, all-reduce and MoE dispatch/combine (a library: never imports nvl72)."""
from comms.heap import HeapCapabilities, HeapError, SymmetricHeap

__all__ = ["HeapCapabilities", "HeapError", "SymmetricHeap"]
