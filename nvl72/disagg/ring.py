"""The peer-memory KV transport: prefill ranks write each request's pages and states straight into a
staging ring in the decode rank's symmetric heap (`comms.SymmetricHeap`: NVLink peer memory on GPU,
shared memory on CPU), the decode rank scatters them into its pages and hands the slot back.

One heap over the prefill and decode ranks (collective, at start-up), the same layout on every rank:
  consumed  int64 [decode ranks]            in a prefill rank's heap: how many of its messages each
                                            decode rank consumed (the sender's credits)
  headers   int64 [prefill ranks, slots, 4] in a decode rank's heap: per slot [n, seq, chunk, value]
  data      [prefill ranks, slots, slot bytes]
(each rank holds both; a rank uses the half of its role).

Messages of one (prefill rank, decode rank) link are numbered n = 1, 2, ... in the sender's order
across requests; message n goes to slot (n - 1) % slots, and the sender writes it only once the
receiver consumed message n - slots (credits: no slot is overwritten before it was read). A message
is one chunk of a part (`transport._parts`: one layer group and cache kind): whole rows (pages or
state slots) of its pieces, at most a slot's bytes, gathered into one buffer by the sender and put
into the slot with one copy (on GPU a peer copy over NVLink: gathers storing element-wise into peer
memory would cross NVLink in small writes); both sides cut the same chunks from the plan. A request's
first token travels as a last message with chunk -1 and the token id as its value; data messages carry
their element count as the value (a check).

Ordering: the sender writes the data, then the header fields, then the flag n (on GPU on one stream,
in that order, so the flag lands after the data; on CPU, plain stores in program order). The
receiver reads the flags (GPU: a copy of the header table on a side stream, checked with an event
query, never blocking its compute stream), scatters a ready slot on its current stream and then
writes its consumed count into the sender's heap on that stream (after the scatter read the slot).

Bounds: a sender waits for credits and for the receiver's consumption of its messages at most the
transfer timeout (a dead decode rank fails the send); a receiver's parts must arrive within its
timeout; a message whose request the decode rank never expects (aborted before it got there) is
dropped once it sat at the head of its ring for the transfer timeout, so one lost request cannot
block the link for the requests behind it.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nvl72.disagg.plan import TransferPlan
from nvl72.disagg.transport import (Caches, TransferError, TransferReceipt, TransferTimeout, _parts, _Piece,
                                    caches_device)

log = logging.getLogger("nvl72.disagg")

TOKEN = -1  # the chunk index of a request's first-token message
HEADER = 4  # int64 fields per slot: n (the flag, written last), seq, chunk, value


class RingError(TransferError):
    """A ring that cannot carry a transfer (a row larger than a slot, a bad size)."""


@dataclass
class _Chunk:
    """One message: rows [r0, r1) of some pieces of one part, back to back in a slot."""

    part: tuple[int, str]  # (layer group, kind)
    pieces: list[_Piece]
    dtype: torch.dtype

    def numel(self) -> int:
        return sum(p.numel() for p in self.pieces)


def chunks(parts, slot_bytes: int) -> list[_Chunk]:
    """Cut each part into slot-sized chunks of whole rows, in wire order (parts, pieces, rows)."""
    out = []
    for g, kind, views in parts:
        cur: list[_Piece] = []
        used = 0
        dtype = views[0].cache.dtype
        for v in views:
            rows = v.index.numel()
            row_bytes = v.numel() // rows * v.cache.element_size()
            if row_bytes > slot_bytes:
                raise RingError(f"a {kind} row of {row_bytes} bytes does not fit a ring slot of {slot_bytes} bytes; "
                                "give the ring more bytes (--kv-transport-ring)")
            r = 0
            while r < rows:
                take = min(rows - r, (slot_bytes - used) // row_bytes)
                if take == 0:
                    out.append(_Chunk((g, kind), cur, dtype))
                    cur, used = [], 0
                    continue
                cur.append(_Piece(v.cache, v.index[r:r + take], v.axis, v.lo, v.length))
                used += take * row_bytes
                r += take
        if cur:
            out.append(_Chunk((g, kind), cur, dtype))
    return out


class _Poller:
    """Reads small int64 heap regions from the host without blocking the compute stream: on GPU a
    copy on a side stream into pinned memory, checked with an event query (a snapshot may be stale,
    which the monotonic counters make harmless); on CPU the memory itself."""

    def __init__(self, src: torch.Tensor):
        self.src = src
        self.cuda = src.device.type == "cuda"
        if self.cuda:
            self.host = torch.zeros(src.shape, dtype=src.dtype, pin_memory=True)
            self.stream = torch.cuda.Stream(device=src.device)
            self.event: torch.cuda.Event | None = None
            self._launch()

    def _launch(self) -> None:
        with torch.cuda.stream(self.stream):
            self.host.copy_(self.src, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def read(self, block: bool = False) -> torch.Tensor | None:
        """The latest snapshot (None: the copy in flight has not finished and block is False)."""
        if not self.cuda:
            return self.src
        if not block and not self.event.query():
            return None
        self.event.synchronize()
        snap = self.host.clone()
        self._launch()
        return snap


class PeerTransport:
    """Staging rings between every prefill rank and every decode rank in one symmetric heap.

    Create it on every prefill and decode rank (collective over `group`, whose ranks are exactly
    those), then make `sender(...)`/`receiver(...)` per request as with send/recv."""

    name = "p2p"

    def __init__(self, heap, prefill_ranks: Sequence[int], decode_ranks: Sequence[int], rank: int, slots: int,
                 slot_bytes: int, timeout: float):
        self.heap, self.rank, self.timeout = heap, rank, timeout
        self.prefill, self.decode = list(prefill_ranks), list(decode_ranks)
        self.slots, self.slot_bytes = slots, slot_bytes
        self.group_rank = {r: dist.get_group_rank(heap.group, r) for r in self.prefill + self.decode}
        P, D = len(self.prefill), len(self.decode)
        self.consumed_off = heap.alloc(8 * D)
        self.headers_off = heap.alloc(8 * HEADER * P * slots)
        self.data_off = heap.alloc(P * slots * slot_bytes)
        heap.barrier()  # regions zeroed everywhere before anyone writes into a peer's
        self._outboxes: dict[int, _Outbox] = {}
        self.closed = False
        if rank in self.decode:
            self._headers = heap.buffer(self.headers_off, (P, slots, HEADER), torch.int64)
            self._poller = _Poller(self._headers)
            self._next = [1] * P  # the next message number expected from each prefill rank
            self._head_since: list[float | None] = [None] * P
            self._receivers: dict[int, PeerReceiver] = {}
            self._dropped: set[int] = set()
        self.describe = (f"p2p (symmetric heap, {heap.capabilities.backend}: {P} prefill x {D} decode ranks, "
                         f"{slots} slots x {slot_bytes} bytes per link, {heap.nbytes} bytes per rank)")

    @staticmethod
    def heap_bytes(num_prefill: int, num_decode: int, slots: int, slot_bytes: int) -> int:
        pad = 256  # the heap's default alignment between the three regions
        return 8 * num_decode + pad + 8 * HEADER * num_prefill * slots + pad + num_prefill * slots * slot_bytes

    # ---- the prefill side
    def _outbox(self, dst: int) -> "_Outbox":
        if dst not in self._outboxes:
            if self.closed or self.rank not in self.prefill or dst not in self.decode:
                raise TransferError(f"rank {self.rank} has no ring to rank {dst} (prefill {self.prefill}, "
                                    f"decode {self.decode})")
            self._outboxes[dst] = _Outbox(self, dst)
        return self._outboxes[dst]

    def sender(self, seq, plan, tp_rank, src_ranks, dst_ranks, caches, groups) -> "PeerSender":
        return PeerSender(self, seq, plan, tp_rank, list(src_ranks), list(dst_ranks), caches, groups)

    # ---- the decode side
    def receiver(self, seq, plan, tp_rank, src_ranks, dst_ranks, caches, groups, timeout) -> "PeerReceiver":
        if self.rank not in self.decode:
            raise TransferError(f"rank {self.rank} is no decode rank of this transport ({self.decode})")
        if seq in self._receivers:
            raise TransferError(f"request {seq} is already being received")
        rcv = PeerReceiver(self, seq, plan, tp_rank, list(src_ranks), caches, groups, timeout)
        self._receivers[seq] = rcv
        return rcv

    def _forget(self, seq: int, drop: bool) -> None:
        self._receivers.pop(seq, None)
        if drop:
            self._dropped.add(seq)

    def _pump(self, block: bool = False) -> None:
        """Consume every ready head message of every link whose request is expected here (or dropped)."""
        if self.closed:
            raise TransferError("the KV transport is closed")
        snap = self._poller.read(block)
        if snap is None:
            return
        now = time.monotonic()
        for i, src in enumerate(self.prefill):
            while True:
                n = self._next[i]
                slot = (n - 1) % self.slots
                if int(snap[i, slot, 0]) != n:
                    break
                seq, chunk, value = (int(x) for x in snap[i, slot, 1:])
                rcv = self._receivers.get(seq)
                if rcv is None and seq not in self._dropped:
                    if self._head_since[i] is None:
                        self._head_since[i] = now
                    if now - self._head_since[i] < self.timeout:
                        break  # its receiver may not be posted yet
                    log.warning("rank %d: dropping message %d of request %d from rank %d: not expected within %g s",
                                self.rank, n, seq, src, self.timeout)
                    self._dropped.add(seq)
                if rcv is not None:
                    data = self.heap.buffer(self.data_off + (i * self.slots + slot) * self.slot_bytes,
                                            (self.slot_bytes,), torch.uint8)
                    try:
                        rcv._deliver(src, chunk, value, data)
                    except Exception as e:  # that request fails (its poll raises), the link goes on
                        rcv.error = e if isinstance(e, TransferError) else TransferError(f"request {seq}: {e}")
                        self._forget(seq, drop=True)
                self.heap.peer_buffer(self.group_rank[src], self.consumed_off + 8 * self.decode.index(self.rank),
                                      (1,), torch.int64).fill_(n)  # on the stream of the scatter: after it
                self._next[i] = n + 1
                self._head_since[i] = None

    def close(self) -> None:
        """Stop the links' threads (a send waiting for credits fails), then free the heap."""
        for box in self._outboxes.values():
            box.close()
        self._outboxes.clear()
        self.closed = True
        self.heap.destroy()


class _SendState:
    """One request's sending, shared by its jobs: the credit deadline and the first error."""

    def __init__(self, seq: int, deadline: float):
        self.seq, self.deadline = seq, deadline
        self.error: Exception | None = None


@dataclass
class _Job:
    """One sender's messages to one decode rank, written in order by the link's thread."""

    state: _SendState
    event: object  # CUDA event after the caches are final (None on CPU)
    items: list  # (_Chunk | None for the token, chunk index, value)
    last_n: int = 0  # the link's number of the job's last message, once written
    done: threading.Event = field(default_factory=threading.Event)


class _Outbox:
    """A prefill rank's link to one decode rank: a thread that writes queued messages into the
    decode rank's ring as credits allow."""

    def __init__(self, t: PeerTransport, dst: int):
        self.t, self.dst = t, dst
        h = t.heap
        self.peer = t.group_rank[dst]
        i = t.prefill.index(t.rank)
        self.headers = h.peer_buffer(self.peer, t.headers_off + 8 * HEADER * i * t.slots, (t.slots, HEADER),
                                     torch.int64)
        self.data_off = t.data_off + i * t.slots * t.slot_bytes
        self.credits = _Poller(h.buffer(t.consumed_off + 8 * t.decode.index(dst), (1,), torch.int64))
        self.lock = threading.Lock()  # the credit poller is shared with the senders' wait(), and close()
        self.n = 0  # messages written
        self.acked = 0  # the receiver's consumed count, last seen
        self.cuda = h.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=h.device) if self.cuda else None
        self.jobs: queue.Queue = queue.Queue()
        self.closing = False
        self.thread = threading.Thread(target=self._run, name=f"kv-ring-{dst}", daemon=True)
        self.thread.start()

    def consumed(self, block: bool) -> int:
        with self.lock:
            if self.closing:  # the heap may be gone
                raise TransferError(f"KV ring to rank {self.dst}: the transport closed")
            snap = self.credits.read(block)
            if snap is not None:
                self.acked = max(self.acked, int(snap[0]))
            return self.acked

    def _run(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.t.heap.device)
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                self._write(job)
            except Exception as e:  # the job's sender reports it from wait()
                log.error("rank %d: KV ring to rank %d, request %d: %s", self.t.rank, self.dst, job.state.seq, e)
                job.state.error = e
            job.done.set()

    def _write(self, job: _Job) -> None:
        st, t = job.state, self.t
        if st.error is not None:
            return
        if self.cuda:
            self.stream.wait_event(job.event)
        for chunk, index, value in job.items:
            n = self.n + 1
            while n - self.consumed(block=False) > t.slots:  # credits: slot (n-1) % slots still unread
                if time.monotonic() > st.deadline:
                    raise TransferTimeout(f"KV ring to rank {self.dst}: no free slot within the transfer timeout "
                                          f"(message {n}, {self.acked} consumed)")
                time.sleep(0.0002)
            slot = (n - 1) % t.slots
            with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
                if chunk is not None:  # gathered here, then one copy into the peer's slot (copy engine on GPU)
                    flat = self.t.heap.peer_buffer(self.peer, self.data_off + slot * t.slot_bytes, (chunk.numel(),),
                                                   chunk.dtype)
                    flat.copy_(torch.cat([p.gather() for p in chunk.pieces]))
                hdr = self.headers[slot]
                hdr[1].fill_(st.seq)
                hdr[2].fill_(index)
                hdr[3].fill_(value)
                hdr[0].fill_(n)  # the flag, last
            self.n = n
            job.last_n = n

    def close(self) -> None:
        with self.lock:  # no credit read after this (a sender's wait fails instead)
            self.closing = True
        self.jobs.put(None)
        self.thread.join(5)
        if self.thread.is_alive():
            raise TransferError(f"KV ring to rank {self.dst}: its thread did not stop within 5 s")


class PeerSender:
    """One prefill TP rank's side of one request's transfer through the rings; the interface of
    `transport.Sender`: `send_group(g)` / `send_all`, `send_first_token`, `wait`."""

    def __init__(self, t: PeerTransport, seq, plan: TransferPlan, tp_rank, src_ranks, dst_ranks, caches: Caches,
                 groups):
        self.t, self.seq, self.tp_rank, self.dst_ranks = t, seq, tp_rank, dst_ranks
        self.cuda = caches_device(caches).type == "cuda"
        self.state = _SendState(seq, time.monotonic() + t.timeout)
        self._jobs: list[tuple[_Outbox, _Job]] = []
        self._chunks: dict[int, dict[int, list[tuple[int, _Chunk]]]] = {}  # dst -> group -> [(index, chunk)]
        self._boxes = []
        for d, dst in enumerate(dst_ranks):
            per: dict[int, list] = {}
            for i, c in enumerate(chunks(_parts(plan, caches, groups, tp_rank, d, "src"), t.slot_bytes)):
                per.setdefault(c.part[0], []).append((i, c))
            self._chunks[d] = per
            self._boxes.append(t._outbox(dst))

    def _queue(self, d: int, items: list) -> None:
        if not items:
            return
        ev = None
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record()  # the caches as the current stream leaves them
        job = _Job(self.state, ev, items)
        self._jobs.append((self._boxes[d], job))
        self._boxes[d].jobs.put(job)

    def send_group(self, g: int) -> None:
        for d in range(len(self.dst_ranks)):
            self._queue(d, [(c, i, c.numel()) for i, c in self._chunks[d].get(g, [])])

    def send_all(self) -> None:
        for g in sorted({g for per in self._chunks.values() for g in per}):
            self.send_group(g)

    def send_first_token(self, token_id: int) -> None:
        if self.tp_rank != 0:
            return
        for d in range(len(self.dst_ranks)):
            self._queue(d, [(None, TOKEN, token_id)])

    def wait(self, timeout: float) -> None:
        """Until every message was written and consumed by its decode rank (whose scatter then read
        it, so the caches may be freed), by the deadline."""
        deadline = time.monotonic() + timeout
        for box, job in self._jobs:
            if not job.done.wait(max(deadline - time.monotonic(), 0)):
                raise TransferTimeout(f"request {self.seq}: messages to rank {box.dst} not written within the "
                                      f"transfer timeout")
            if self.state.error is not None:
                raise self.state.error
            while box.consumed(block=True) < job.last_n:
                if time.monotonic() > deadline:
                    raise TransferTimeout(f"request {self.seq}: rank {box.dst} consumed {box.acked} messages of the "
                                          f"{job.last_n} written to it within the transfer timeout")
                time.sleep(0.0002)
        self._jobs.clear()


class PeerReceiver:
    """One decode TP rank's side of one request's transfer through the rings; the interface of
    `transport.Receiver`: `poll`, `wait`, `receipt`, `measured`, and `close` (an abandoned request:
    its late messages are dropped)."""

    def __init__(self, t: PeerTransport, seq, plan: TransferPlan, tp_rank, src_ranks, caches: Caches, groups, timeout):
        self.t, self.seq, self.timeout = t, seq, timeout
        self.src_ranks = src_ranks
        dev = caches_device(caches)
        self._events = None
        if dev.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._posted_at = time.monotonic()
        self._done_at: float | None = None
        self._deadline = self._posted_at + timeout
        self._bytes = {"kv": 0, "conv": 0, "recurrent": 0}
        self._chunks: dict[int, list[_Chunk]] = {}
        self._left: dict[tuple[int, int, str], int] = {}
        expected = set()
        for s, src in enumerate(src_ranks):
            if src not in t.prefill:
                raise TransferError(f"request {seq}: rank {src} is no prefill rank of this transport ({t.prefill})")
            cs = chunks(_parts(plan, caches, groups, s, tp_rank, "dst"), t.slot_bytes)
            self._chunks[src] = cs
            for c in cs:
                key = (s, *c.part)
                expected.add(key)
                self._left[key] = self._left.get(key, 0) + 1
                self._bytes[c.part[1]] += c.numel() * c.pieces[0].cache.element_size()
        self._first = src_ranks[0]
        self.error: TransferError | None = None
        self.receipt = TransferReceipt(seq, expected)

    def _deliver(self, src: int, index: int, value: int, data: torch.Tensor) -> None:
        """Message `index` of this request from `src`, in `data` (the slot); called by the pump."""
        if index == TOKEN:
            if src != self._first:
                raise TransferError(f"request {self.seq}: first token from rank {src}, expected rank {self._first}")
            self.receipt.first_token = value
        else:
            cs = self._chunks[src]
            if not 0 <= index < len(cs) or cs[index].numel() != value:
                raise TransferError(f"request {self.seq}: chunk {index} of {value} elements from rank {src}; this "
                                    f"decode rank expects {len(cs)} chunks ({[c.numel() for c in cs][:8]}...)")
            c = cs[index]
            flat = data[:c.numel() * c.pieces[0].cache.element_size()].view(c.dtype)
            off = 0
            for p in c.pieces:
                k = p.numel()
                p.scatter(flat[off:off + k])
                off += k
            key = (self.src_ranks.index(src), *c.part)
            self._left[key] -= 1
            if self._left[key] == 0:
                self.receipt.arrived.add(key)
        if self.receipt.complete and self._done_at is None:
            self._done_at = time.monotonic()
            if self._events is not None:
                self._events[1].record()
            self.t._forget(self.seq, drop=False)

    def poll(self) -> bool:
        """Unpack whatever arrived; True once the receipt is complete. Raises past the deadline."""
        if not self.receipt.complete:
            self.t._pump()
        if self.error is not None:
            raise self.error
        if self.receipt.complete:
            return True
        if time.monotonic() > self._deadline:
            self.close()
            raise TransferTimeout(f"request {self.seq}: missing {', '.join(self.receipt.missing())}")
        return False

    def wait(self) -> TransferReceipt:
        while not self.poll():
            time.sleep(0.0002)
        return self.receipt

    def close(self) -> None:
        """Give the request up: messages of it still to come are dropped."""
        if not self.receipt.complete:
            self.t._forget(self.seq, drop=True)

    def measured(self) -> tuple[dict[str, int], float]:
        """(payload bytes per kind, seconds from posting this receiver to the last scatter). Parts can
        land in the ring before the receiver is posted: this is the decode rank's wait, not the link's
        bandwidth."""
        self.receipt.require_complete()
        if self._events is None:
            return dict(self._bytes), self._done_at - self._posted_at
        start, end = self._events
        end.synchronize()
        return dict(self._bytes), start.elapsed_time(end) / 1e3


def open_rings(group, rank: int, prefill_ranks: Sequence[int], decode_ranks: Sequence[int], caches: Caches,
               timeout: float, ring_bytes: int, slots: int, required: bool) -> tuple[PeerTransport | None, str]:
    """(the rings, why) on every prefill and decode rank, or (None, why not) on all of them when the
    heap cannot be made or does not map every peer here (`required`: raise instead). Collective over
    the prefill and decode ranks (a group of just them, from `group`'s backend). A slot must hold one
    row (a page or state slot of one layer) of every cache here: else RingError, at start-up."""
    from comms.heap import HeapError, SymmetricHeap

    device = caches_device(caches)
    slot_bytes = ring_bytes // slots // 256 * 256
    members = sorted(set(prefill_ranks) | set(decode_ranks))
    if rank not in members:
        raise TransferError(f"rank {rank} is neither a prefill nor a decode rank ({members})")
    pg = dist.new_group(members, timeout=datetime.timedelta(seconds=timeout), backend=dist.get_backend(group),
                        use_local_synchronization=True)
    flag_device = device if device.type == "cuda" else torch.device("cpu")

    def everywhere(ok: bool) -> bool:
        t = torch.tensor([int(ok)], dtype=torch.int32, device=flag_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=pg, async_op=True).wait(
            timeout=datetime.timedelta(seconds=timeout))
        return bool(t.item())

    row = max((t[0].numel() * t.element_size() for ts in caches.values() for t in ts if t is not None), default=0)
    if not everywhere(slot_bytes >= max(row, 1)):
        why = (f"a ring of {ring_bytes} bytes has {slots} slots of {slot_bytes} bytes, less than a cache row "
               f"(rank {rank}'s largest: {row} bytes, so at least {slots * -(-row // 256) * 256} bytes here)")
        if required:
            raise RingError(f"--kv-transport p2p: {why}; give it more (--kv-transport-ring)")
        return None, why
    nbytes = PeerTransport.heap_bytes(len(prefill_ranks), len(decode_ranks), slots, slot_bytes)
    heap, err = None, ""
    try:
        heap = SymmetricHeap(pg, nbytes, device, timeout_s=timeout)
        if not heap.capabilities.p2p:
            raise HeapError(f"the heap does not map its peers ({heap.capabilities})")
        for r in range(heap.world_size):
            heap.peer_buffer(r, 0, (1,), torch.int64)  # refuses where torch would copy instead of alias
    except (HeapError, ImportError) as e:  # ImportError: no cuda-python here
        err = f"{type(e).__name__}: {e}"
    if everywhere(not err):
        t = PeerTransport(heap, prefill_ranks, decode_ranks, rank, slots, slot_bytes, timeout)
        return t, f"the {heap.capabilities.backend} heap maps every peer"
    if heap is not None:
        heap.destroy()
    why = f"no peer-memory heap on every rank ({err or 'another rank failed'})"
    if required:
        raise TransferError(f"--kv-transport p2p: {why}")
    return None, why
