"""Reference-counted pools of integer ids (KV pages, GDN state slots).

An id is free when its count is 0. Owners (a running sequence, the prefix tree, one step's
transient write rows) each hold one reference; the id returns to the free list when the last
owner lets go. Pools hold no tensors: the tensors live in `ModelCaches`.
"""
from __future__ import annotations

from collections import deque


class OutOfCapacity(RuntimeError):
    """A pool cannot satisfy an allocation (the scheduler evicts, preempts or waits)."""


class RefPool:
    def __init__(self, name: str, size: int):
        if size < 0:
            raise ValueError(f"{name} pool size must be >= 0, got {size}")
        self.name = name
        self.size = size
        self._ref = [0] * size
        self._free: deque[int] = deque(range(size))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.size - len(self._free)

    def refcount(self, i: int) -> int:
        return self._ref[i]

    def alloc(self, n: int = 1) -> list[int]:
        """Take `n` free ids, each with one reference."""
        if n > len(self._free):
            raise OutOfCapacity(f"{self.name}: asked for {n}, {len(self._free)} free of {self.size}")
        out = [self._free.popleft() for _ in range(n)]
        for i in out:
            self._ref[i] = 1
        return out

    def incref(self, i: int) -> None:
        if self._ref[i] <= 0:
            raise ValueError(f"{self.name}: incref of free id {i}")
        self._ref[i] += 1

    def decref(self, i: int) -> None:
        if self._ref[i] <= 0:
            raise ValueError(f"{self.name}: decref of free id {i}")
        self._ref[i] -= 1
        if self._ref[i] == 0:
            self._free.append(i)
