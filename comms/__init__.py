"""comms: symmetric memory, all-reduce and MoE dispatch/combine (a library: never imports nvl72)."""
from comms.allreduce import AllReduce, AllReduceError, AllReduceTimeoutError
from comms.heap import HeapCapabilities, HeapError, SymmetricHeap

__all__ = ["AllReduce", "AllReduceError", "AllReduceTimeoutError", "HeapCapabilities", "HeapError",
           "SymmetricHeap"]
