"""Host<->device transfers of a step without per-step pinned allocations.

A step's integer inputs are packed into one host byte buffer (`pack`) and cross to the device in
one copy (`HostRing.to_device`); its sampled tokens come back into a reused pinned buffer
(`HostRing.take`). On a GPU the host buffers are pinned and reused round-robin: a buffer is
handed out again only after the event recorded behind its last copy has completed (a non-blocking
copy reads or writes it until then). On a CPU nothing is staged: `pack` tensors are used as they
are.
"""
from __future__ import annotations

import array
import ctypes
from dataclasses import dataclass

import torch


@dataclass
class StepArrays:
    """A step's flattened inputs as host arrays (`nvl72.engine.runner.flatten`): the eager path packs
    them into one copy (`build_batch`), the decode graphs write them straight into their pinned
    staging (`nvl72.engine.cuda_graphs.Staging.write`), with no tensor op per field."""

    input_ids: array.array  # "q" [T]
    positions: array.array  # "q" [T]
    query_start_loc: array.array  # "i" [B + 1]
    seq_lens: array.array  # "i" [B]
    pages: list[list[int]]  # per sequence
    logits_indices: array.array  # "q" [N]
    rows: list[tuple[int, int]]  # (index into scheduled, query offset) per sampled row
    max_query_len: int
    decode: bool  # every sequence feeds its next token and its drafts only (ForwardBatch.decode)
    state_read_slots: array.array | None = None  # "q" [B] (hybrid models)
    state_write_slots: array.array | None = None  # "q" [T]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def page_rows(pages: list[list[int]], width: int) -> array.array:
    """The sequences' page ids as one int32 array of rows `width` wide, -1 padded (a page table)."""
    table = array.array("i")
    pad = array.array("i", [-1]) * width
    for p in pages:
        table.extend(p)
        table.extend(pad[:width - len(p)])
    return table


def writable_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 host tensor as a writable memoryview: slice assignment from
    `array.tobytes()` costs no tensor op (each is a few us of host time per step)."""
    if t.device.type != "cpu" or t.dtype != torch.uint8 or not t.is_contiguous():
        raise ValueError(f"writable_bytes: {t.dtype} on {t.device}: expected a contiguous uint8 host tensor")
    return memoryview((ctypes.c_char * t.numel()).from_address(t.data_ptr())).cast("B")


def pack(int64: list[array.array], int32: list[array.array]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The arrays back to back in one fresh uint8 host tensor (int64 ones first, so every field is
    aligned; padded to 8 bytes) and the layout `unpack` reads: (element offset, length) per array."""
    q = array.array("q")
    layout = []
    for a in int64:
        layout.append((len(q), len(a)))
        q.extend(a)
    off = 2 * len(q)
    for a in int32:
        layout.append((off, len(a)))
        off += len(a)
    raw = q.tobytes() + b"".join(a.tobytes() for a in int32)
    raw += bytes(-len(raw) % 8) if raw else bytes(8)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8), layout


def unpack(buf: torch.Tensor, layout: list[tuple[int, int]], num_int64: int) -> list[torch.Tensor]:
    """The fields of a `pack`ed buffer (host or its device copy) as views: the first `num_int64`
    int64, the rest int32."""
    b64, b32 = buf.view(torch.int64), buf.view(torch.int32)
    return [(b64 if i < num_int64 else b32).as_strided((n,), (1,), off) for i, (off, n) in enumerate(layout)]


class HostRing:
    """`depth` reusable host buffers (pinned on a GPU); `take(n)` hands out the next one (grown to
    at least n bytes) once the event of its previous use has completed; `fence()` records that
    event after the copies that use it were queued. `event` makes the events (CUDA events by
    default; tests pass a host emulation)."""

    def __init__(self, depth: int = 3, pin: bool = True, event=None):
        if depth < 2:
            raise ValueError(f"HostRing depth={depth}: needs >= 2 to overlap one copy with the next fill")
        self.pin = pin
        self.event = event or torch.cuda.Event
        self.bufs: list[torch.Tensor | None] = [None] * depth
        self.events: list[object | None] = [None] * depth
        self.uses = [0] * depth  # times each buffer was handed out (a reader's ticket)
        self.next = 0
        self.current = -1

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer of >= nbytes no copy is using any more."""
        i = self.next
        self.next = (i + 1) % len(self.bufs)
        if self.events[i] is not None:
            self.events[i].synchronize()
            self.events[i] = None
        buf = self.bufs[i]
        if buf is None or buf.numel() < nbytes:
            size = max(4096, 1 << max(nbytes - 1, 1).bit_length())
            buf = self.bufs[i] = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        self.current = i
        self.uses[i] += 1
        return buf

    def ticket(self) -> tuple[int, int]:
        """(buffer, use) of the buffer last taken: `valid(ticket)` while it has not been handed out again."""
        return self.current, self.uses[self.current]

    def valid(self, ticket: tuple[int, int]) -> bool:
        return self.uses[ticket[0]] == ticket[1]

    def fence(self):
        """The copies using the buffer last taken are queued: record (and return) the event guarding it."""
        if self.current < 0:
            raise RuntimeError("HostRing.fence() without a buffer taken")
        ev = self.event()
        ev.record()
        self.events[self.current] = ev
        self.current = -1
        return ev

    def to_device(self, host: torch.Tensor, device) -> torch.Tensor:
        """`host` (uint8) on `device` through the next buffer: one non-blocking copy."""
        n = host.numel()
        buf = self.take(n)[:n]
        buf.copy_(host)
        out = buf.to(device, non_blocking=True)
        self.fence()
        return out
