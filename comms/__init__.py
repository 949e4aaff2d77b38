"""comms: symmetric memory, all-reduce and MoE dispatch/combine (a library: never imports nvl72)."""
from comms.allreduce import AllReduce, AllReduceError, AllReduceTimeoutError
from comms.dispatch import CapacityError, DispatchCombine, DispatchError, DispatchRecv, DispatchTimeoutError
from comms.heap import HeapCapabilities, HeapError, SymmetricHeap

__all__ = ["AllReduce", "AllReduceError", "AllReduceTimeoutError", "CapacityError", "DispatchCombine",
           "DispatchError", "DispatchRecv", "DispatchTimeoutError", "HeapCapabilities", "HeapError",
           "SymmetricHeap"]
