"""Executing a transfer plan between processes with torch.distributed point-to-point (gloo on CPU,
NCCL on GPU), layer group by layer group, every wait bounded.

Wire format, per (prefill rank, decode rank) pair and request `seq`:
  header   int64 [MAGIC, seq, layer groups, elements to come, kv/conv/recurrent item sizes]
  part     one flat buffer per (layer group, cache kind): for each layer of the group that has the
           cache, for each plan copy of that pair and kind (plan order), the copied slice, flattened
  token    int64 [seq, first token id], from prefill TP rank 0 to every decode rank, sent last
Both sides derive the same parts from the plan and their caches' shapes, so nothing but raw tensors
travels. Tags keep requests and parts apart on gloo; NCCL matches in posting order, which both sides
share.

Use a group of its own for transfers (`ProcessGroups.transfer`): NCCL runs a group's point-to-point
ops in issue order together with its collectives, so receives posted on a model group would hold
back its collectives. On one group, requests also complete in the order their receives were posted.

The receiver's completion rule (DESIGN.md): a request may decode only once every part from every
source and the first token have arrived (`TransferReceipt.complete`). The receiver also measures
what it moved (`Receiver.measured`): payload bytes per cache kind, and the time from posting its
receives to the last arrival (CUDA events around the receives on GPU: no host sync on the way; host
clock on CPU).
"""
from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nvl72.disagg.plan import AXIS, KINDS, TransferPlan
from nvl72.model.batch import ModelCaches

log = logging.getLogger("nvl72.disagg")

MAGIC = 0x6E766C3732  # "nvl72"
MAX_GROUPS = 80
Caches = dict[str, list[torch.Tensor | None]]  # kind -> per-layer cache tensor (None: layer has none)


class TransferError(RuntimeError):
    """A transfer whose two sides disagree (sequence, sizes, dtypes) or that is used before it completed."""


class TransferTimeout(TransferError, TimeoutError):
    """A part of a transfer did not arrive (or leave) within its timeout."""


def caches_of(mc: ModelCaches) -> Caches:
    """The transport's view of the engine's caches (the same tensors, no copy)."""
    return {"kv": mc.kv, "conv": mc.conv, "recurrent": mc.recurrent}


def layer_groups(num_layers: int, per_group: int) -> list[list[int]]:
    """Consecutive layer groups: the unit in which prefill hands finished layers to the transport."""
    if per_group <= 0:
        raise ValueError(f"layers per group must be positive, got {per_group}")
    return [list(range(i, min(i + per_group, num_layers))) for i in range(0, num_layers, per_group)]


def _tag(seq: int, slot: int) -> int:
    return (seq % 65536) * 256 + slot


def _part_slot(group: int, kind: str) -> int:
    return 2 + group * len(KINDS) + KINDS.index(kind)


@dataclass
class _Piece:
    """Pages (or state slots) of one layer's cache that share one range of the sharded axis: moved
    with one gather on the sender and one scatter on the receiver, not one copy per page (the
    per-page copies held an 8K-token KV transfer to 4 GB/s on NVLink)."""

    cache: torch.Tensor  # one layer's cache, [pages or slots, ...]
    index: torch.Tensor  # int64 rows of `cache`, in wire order
    axis: int
    lo: int
    length: int

    def numel(self) -> int:
        return self.index.numel() * self.cache[0].numel() // self.cache.shape[self.axis] * self.length

    def gather(self) -> torch.Tensor:
        return self.cache.narrow(self.axis, self.lo, self.length).index_select(0, self.index).reshape(-1)

    def scatter(self, flat: torch.Tensor) -> None:
        dst = self.cache.narrow(self.axis, self.lo, self.length)
        dst.index_copy_(0, self.index, flat.view((self.index.numel(),) + tuple(dst.shape[1:])))


def _views(plan: TransferPlan, caches: Caches, group: Sequence[int], kind: str, src: int, dst: int,
           side: str) -> list[_Piece]:
    """The pieces of one part, in wire order (layers outer, then runs of copies with one axis range,
    in the plan's order)."""
    runs: dict[tuple[int, int], list[int]] = {}
    for c in plan.between(src, dst, kind):
        idx, lo = (c.src_index, c.src_lo) if side == "src" else (c.dst_index, c.dst_lo)
        runs.setdefault((lo, c.length), []).append(idx)
    out = []
    per_layer = caches.get(kind)
    for layer in group:
        t = per_layer[layer] if per_layer else None
        if t is None:
            continue
        for (lo, length), rows in runs.items():
            out.append(_Piece(t, torch.tensor(rows, dtype=torch.int64, device=t.device), AXIS[kind], lo, length))
    return out


def _parts(plan: TransferPlan, caches: Caches, groups: Sequence[Sequence[int]], src: int, dst: int,
           side: str) -> list[tuple[int, str, list[_Piece]]]:
    out = []
    for g, group in enumerate(groups):
        for kind in KINDS:
            views = _views(plan, caches, group, kind, src, dst, side)
            if views:
                out.append((g, kind, views))
    return out


def _header(seq: int, groups: int, parts, device) -> torch.Tensor:
    sizes = {k: 0 for k in KINDS}
    for _, kind, views in parts:
        sizes[kind] = views[0].cache.element_size()
    elems = sum(v.numel() for _, _, views in parts for v in views)
    return torch.tensor([MAGIC, seq, groups, elems, sizes["kv"], sizes["conv"], sizes["recurrent"]],
                        dtype=torch.int64, device=device)


def caches_device(caches: Caches) -> torch.device:
    for ts in caches.values():
        for t in ts:
            if t is not None:
                return t.device
    raise TransferError("caches hold no tensor")


def _wait(work, deadline: float, what: str) -> None:
    """Block until `work` completed, by the deadline. NCCL's wait() only orders the current stream
    after the transfer, so the host also polls is_completed(): a sender that returns must be done
    (it may free its buffers or tear the group down)."""
    left = max(deadline - time.monotonic(), 0.001)
    try:
        work.wait(timeout=datetime.timedelta(seconds=left))
    except RuntimeError as e:
        raise TransferTimeout(f"{what}: not completed within the transfer timeout ({e})") from e
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TransferTimeout(f"{what}: not completed within the transfer timeout")
        time.sleep(0.0002)


def connect_pairs(group, rank: int, prefill_ranks: Sequence[int], decode_ranks: Sequence[int],
                  device: torch.device, timeout: float) -> None:
    """One small message from every prefill rank to every decode rank, before serving.

    NCCL sets up a point-to-point connection on its first use, inside the send, and that set-up
    needs the peer inside NCCL too: a prefill rank's first KV send would block its host until the
    decode rank posts a receive, which it does only after the front relays the prefill's hand-off,
    sent after the send (the first disaggregated request on 2xH200 hung so). Every rank calls this
    at start-up; ranks of neither list return at once."""
    ops = []
    if rank in prefill_ranks:
        ops = [dist.P2POp(dist.isend, torch.full((1,), rank, dtype=torch.int64, device=device), d, group)
               for d in decode_ranks]
    elif rank in decode_ranks:
        bufs = {p: torch.full((1,), -1, dtype=torch.int64, device=device) for p in prefill_ranks}
        ops = [dist.P2POp(dist.irecv, bufs[p], p, group) for p in prefill_ranks]
    if not ops:
        return
    deadline = time.monotonic() + timeout
    for work in dist.batch_isend_irecv(ops):
        _wait(work, deadline, f"rank {rank}: connecting the KV transfer pairs")
    if rank in decode_ranks:
        got = {p: int(b.item()) for p, b in bufs.items()}
        if any(p != v for p, v in got.items()):
            raise TransferError(f"rank {rank}: pair warm-up received {got}, expected each prefill rank's own id")


@dataclass
class Sender:
    """One prefill TP rank's side of one request's transfer.

    Call `send_group(g)` as each layer group's caches are final (or `send_all`), then
    `send_first_token`, then `wait`."""

    seq: int
    plan: TransferPlan
    tp_rank: int
    src_ranks: Sequence[int]  # global rank of each prefill TP rank
    dst_ranks: Sequence[int]  # global rank of each decode TP rank
    caches: Caches
    groups: Sequence[Sequence[int]]
    group: dist.ProcessGroup | None = None
    _work: list = field(default_factory=list)
    _parts: dict = field(default_factory=dict)

    def __post_init__(self):
        if len(self.groups) > MAX_GROUPS:
            raise TransferError(f"{len(self.groups)} layer groups exceed the transport's {MAX_GROUPS}")
        dev = caches_device(self.caches)
        for d, dst in enumerate(self.dst_ranks):
            parts = _parts(self.plan, self.caches, self.groups, self.tp_rank, d, "src")
            self._parts[d] = {(g, k): views for g, k, views in parts}
            if parts:
                self._isend(_header(self.seq, len(self.groups), parts, dev), dst, 0, f"header to rank {dst}")

    def _isend(self, t: torch.Tensor, dst: int, slot: int, what: str) -> None:
        self._work.append((dist.isend(t, dst, group=self.group, tag=_tag(self.seq, slot)), t, what))

    def send_group(self, g: int) -> None:
        for d, dst in enumerate(self.dst_ranks):
            for kind in KINDS:
                views = self._parts[d].get((g, kind))
                if views:
                    buf = torch.cat([v.gather() for v in views])
                    self._isend(buf, dst, _part_slot(g, kind), f"request {self.seq} layer group {g} {kind} to rank {dst}")

    def send_all(self) -> None:
        for g in range(len(self.groups)):
            self.send_group(g)

    def send_first_token(self, token_id: int) -> None:
        """Prefill TP rank 0 sends the first generated token after all its parts."""
        if self.tp_rank != 0:
            return
        dev = caches_device(self.caches)
        for dst in self.dst_ranks:
            t = torch.tensor([self.seq, token_id], dtype=torch.int64, device=dev)
            self._isend(t, dst, 1, f"request {self.seq} first token to rank {dst}")

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for work, _, what in self._work:
            _wait(work, deadline, what)
        self._work.clear()


@dataclass
class TransferReceipt:
    """The receiver's completion rule: pages, states and the first token all arrived."""

    seq: int
    expected: set[tuple[int, int, str]]  # (prefill TP rank, layer group, kind)
    arrived: set[tuple[int, int, str]] = field(default_factory=set)
    first_token: int | None = None

    @property
    def complete(self) -> bool:
        return self.arrived >= self.expected and self.first_token is not None

    def missing(self) -> list[str]:
        out = [f"rank {s} group {g} {k}" for s, g, k in sorted(self.expected - self.arrived)]
        return out + ([] if self.first_token is not None else ["first token"])

    def require_complete(self) -> int:
        """The first token, once everything arrived; decode must not start before."""
        if not self.complete:
            raise TransferError(f"request {self.seq} is not complete: missing {', '.join(self.missing())}")
        return self.first_token


@dataclass
class Receiver:
    """One decode TP rank's side of one request's transfer: posts every receive at once, then
    unpacks parts as they arrive (`poll`, non-blocking) or blocks until complete (`wait`); either way
    all of it must arrive within `timeout` seconds of construction.

    Gloo's receive work reports completion only through wait(), so on gloo one waiter thread per
    request waits on the receives in order and hands finished buffers to the caller's thread, which
    alone writes the caches."""

    seq: int
    plan: TransferPlan
    tp_rank: int
    src_ranks: Sequence[int]
    dst_ranks: Sequence[int]
    caches: Caches
    groups: Sequence[Sequence[int]]
    timeout: float
    group: dist.ProcessGroup | None = None
    receipt: TransferReceipt = field(init=False)
    _pending: list = field(default_factory=list)

    def __post_init__(self):
        dev = caches_device(self.caches)
        self._bytes = {k: 0 for k in KINDS}
        self._events = None
        if dev.type == "cuda":  # the receives run on NCCL's stream, after what the current stream holds
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._posted_at = time.monotonic()
        self._done_at: float | None = None
        expected = set()
        for s, src in enumerate(self.src_ranks):
            parts = _parts(self.plan, self.caches, self.groups, s, self.tp_rank, "dst")
            if not parts:
                continue
            want = _header(self.seq, len(self.groups), parts, dev)
            self._irecv(torch.empty_like(want), src, 0, ("header", s, want))
            for g, kind, views in parts:
                expected.add((s, g, kind))
                buf = torch.empty(sum(v.numel() for v in views), dtype=views[0].cache.dtype, device=dev)
                self._bytes[kind] += buf.numel() * buf.element_size()
                self._irecv(buf, src, _part_slot(g, kind), ("part", s, (g, kind, views)))
        self._irecv(torch.empty(2, dtype=torch.int64, device=dev), self.src_ranks[0], 1, ("token", 0, None))
        if self._events is not None:  # a side stream waits on every receive, then marks the end
            side = torch.cuda.Stream(device=dev)
            with torch.cuda.stream(side):
                for work, _, _ in self._pending:
                    work.wait()
                self._events[1].record()
        self.receipt = TransferReceipt(self.seq, expected)
        self._deadline = time.monotonic() + self.timeout
        self._arrived: queue.Queue = queue.Queue()
        self._next = 0  # first pending receive not yet handed over (is_completed backends)
        self._threaded = dist.get_backend(self.group) == "gloo"
        if self._threaded:
            threading.Thread(target=self._waiter, name=f"kv-recv-{self.seq}", daemon=True).start()

    def _irecv(self, t: torch.Tensor, src: int, slot: int, what) -> None:
        self._pending.append((dist.irecv(t, src, group=self.group, tag=_tag(self.seq, slot)), t, what))

    def _waiter(self) -> None:
        for work, buf, what in self._pending:
            try:
                _wait(work, self._deadline, f"request {self.seq}: {what[0]} from prefill rank {what[1]}")
            except TransferTimeout as e:
                self._arrived.put(e)
                return
            self._arrived.put((buf, what))

    def _take(self, block: bool):
        """The next arrived (buffer, what), None if nothing arrived yet (non-blocking)."""
        if self._threaded:
            try:
                item = self._arrived.get(timeout=max(self._deadline - time.monotonic(), 0) + 1) if block \
                    else self._arrived.get_nowait()
            except queue.Empty:
                if block:
                    raise TransferTimeout(f"request {self.seq}: missing {', '.join(self.receipt.missing())}") from None
                return None
            if isinstance(item, TransferTimeout):
                raise item
            return item
        work, buf, what = self._pending[self._next]
        if block:
            _wait(work, self._deadline, f"request {self.seq}: {what[0]} from prefill rank {what[1]}")
        elif not work.is_completed():
            if time.monotonic() > self._deadline:
                raise TransferTimeout(f"request {self.seq}: missing {', '.join(self.receipt.missing())}")
            return None
        self._next += 1
        return buf, what

    def _finish(self, buf: torch.Tensor, what) -> None:
        kind_of, s, info = what
        if kind_of == "header":
            if not torch.equal(buf, info):
                raise TransferError(f"request {self.seq}: header from prefill rank {s} is {buf.tolist()}, this decode "
                                    f"rank expects {info.tolist()} (seq, groups, elements, item sizes)")
        elif kind_of == "part":
            g, kind, views = info
            off = 0
            for v in views:
                n = v.numel()
                v.scatter(buf[off:off + n])
                off += n
            self.receipt.arrived.add((s, g, kind))
        else:
            if int(buf[0]) != self.seq:
                raise TransferError(f"first token for request {int(buf[0])} arrived on request {self.seq}'s channel")
            self.receipt.first_token = int(buf[1])
        if self.receipt.complete and self._done_at is None:
            self._done_at = time.monotonic()

    def poll(self) -> bool:
        """Unpack whatever arrived; True once the receipt is complete. Raises past the deadline."""
        while not self.receipt.complete:
            item = self._take(block=False)
            if item is None:
                break
            self._finish(*item)
        return self.receipt.complete

    def wait(self) -> TransferReceipt:
        """Block until complete (or raise TransferTimeout at the deadline)."""
        while not self.receipt.complete:
            self._finish(*self._take(block=True))
        return self.receipt

    def close(self) -> None:
        """Give the request up (nothing to release: late parts land in its buffers, then time out)."""

    def measured(self) -> tuple[dict[str, int], float]:
        """(payload bytes per cache kind, seconds from posting the receives to the last arrival) of a
        complete transfer."""
        self.receipt.require_complete()
        if self._events is None:
            return dict(self._bytes), self._done_at - self._posted_at
        start, end = self._events
        end.synchronize()  # every receive completed already: nothing left to wait for but the marker
        return dict(self._bytes), start.elapsed_time(end) / 1e3


TRANSPORTS = ("auto", "p2p", "sendrecv")
RING_SLOTS = 4


class SendRecvTransport:
    """`Sender`/`Receiver` over the transfer group's point-to-point ops (the pairs connected)."""

    name = describe = "sendrecv"

    def __init__(self, group):
        self.group = group

    def sender(self, seq, plan, tp_rank, src_ranks, dst_ranks, caches, groups) -> Sender:
        return Sender(seq, plan, tp_rank, src_ranks, dst_ranks, caches, groups, self.group)

    def receiver(self, seq, plan, tp_rank, src_ranks, dst_ranks, caches, groups, timeout) -> Receiver:
        return Receiver(seq, plan, tp_rank, src_ranks, dst_ranks, caches, groups, timeout, self.group)

    def close(self) -> None:
        pass


def open_transport(kind: str, group, rank: int, prefill_ranks: Sequence[int], decode_ranks: Sequence[int],
                   caches: Caches, timeout: float, ring_bytes: int):
    """The KV transport of this prefill or decode rank, chosen the same on every one of them (every
    prefill and decode rank calls this at start-up; it is collective over them):
      p2p       staging rings in a symmetric heap (`nvl72.disagg.ring`), `ring_bytes` per
                (prefill rank, decode rank) link; fails if the heap cannot be made or a row of
                `caches` (one page or state slot of one layer) does not fit a slot
      sendrecv  torch.distributed point-to-point over `group` (NCCL on GPU, gloo on CPU)
      auto      p2p on CUDA when every rank's heap maps its peers, else sendrecv."""
    if kind not in TRANSPORTS:
        raise ValueError(f"KV transport {kind!r} is not one of {TRANSPORTS}")
    device = caches_device(caches)
    chosen, why = None, "chosen" if kind == "sendrecv" else "auto on cpu"
    if kind == "p2p" or (kind == "auto" and device.type == "cuda"):
        from nvl72.disagg.ring import open_rings

        chosen, why = open_rings(group, rank, prefill_ranks, decode_ranks, caches, timeout, ring_bytes, RING_SLOTS,
                                 required=kind == "p2p")
    if chosen is None:
        connect_pairs(group, rank, prefill_ranks, decode_ranks, device, timeout)
        chosen = SendRecvTransport(group)
    log.info("rank %d: KV transport %s (--kv-transport %s: %s)", rank, chosen.describe,
                                           kind, why)
    return chosen
