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
    """Ids with reference counts. One owner (the prefix tree) may also *tag* the ids it holds, so
    that `num_tagged_only` (ids only that owner references: evictable cache) is known in O(1)."""

    def __init__(self, name: str, size: int):
        if size < 0:
            raise ValueError(f"{name} pool size must be >= 0, got {size}")
        self.name = name
        self.size = size
        self._ref = [0] * size
        self._tagged = bytearray(size)
        self._free: deque[int] = deque(range(size))
        self.num_tagged_only = 0

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
        if self._tagged[i] and self._ref[i] == 1:
            self.num_tagged_only -= 1
        self._ref[i] += 1

    def decref(self, i: int) -> None:
        if self._ref[i] <= 0:
            raise ValueError(f"{self.name}: decref of free id {i}")
        if self._tagged[i] and self._ref[i] == 1:
            raise ValueError(f"{self.name}: decref would free tagged id {i} (untag it first)")
        self._ref[i] -= 1
        if self._tagged[i] and self._ref[i] == 1:
            self.num_tagged_only += 1
        if self._ref[i] == 0:
            self._free.append(i)

    def tag(self, i: int) -> None:
        """Mark a held id as the tagging owner's (call after taking that owner's reference)."""
        if self._ref[i] <= 0 or self._tagged[i]:
            raise ValueError(f"{self.name}: tag of free or tagged id {i}")
        self._tagged[i] = 1
        if self._ref[i] == 1:
            self.num_tagged_only += 1

    def untag(self, i: int) -> None:
        """Unmark (before the tagging owner drops its reference)."""
        if not self._tagged[i]:
            raise ValueError(f"{self.name}: untag of untagged id {i}")
        if self._ref[i] == 1:
            self.num_tagged_only -= 1
        self._tagged[i] = 0
