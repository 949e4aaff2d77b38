"""Disaggregated serving: prefill and decode role bodies, and the front's `EngineClient` over them.

Data plane (beside the launcher's control plane): the front rank binds a ZeroMQ ROUTER, every
prefill/decode rank connects a DEALER (identity `data<rank>`); msgpack messages with a version field,
the engine protocol's (`AddRequest` inside, `RequestOutput`, `OutputBatch`, `LoadReport`, `AbortRequest`) plus the
kinds below. One request's path:

  front   --PrefillRequest(request, seq, decode rank)-->   prefill leader (TP rank 0)
  prefill: prefills (prefill-only: the engine parks it after its first token), starts the
           transfer (`nvl72.disagg.transport.Sender`: KV pages, GDN state, first token) to the
           decode rank over the `transfer` group, and tells the front:
  prefill --Handoff(first output, seq, prefill ranks)-->   front  (streams the first token)
  front   --ExpectTransfer(request, seq, prefill ranks)--> decode rank
  decode:  reserves pages/slot, receives (`Receiver`, completion rule), commits, decodes;
  decode  --OutputBatch (one per step) ...-->             front  (streams the rest)
Decode ranks send a `LoadReport` every report interval; one silent for `lost_timeout` is dead: its
requests end with `EngineDeadError` (HTTP 503) and new requests go to the others (a prefill leader
likewise; none left -> 503 at once). The front picks
the decode rank with the fewest requests in flight under its batch threshold.

A prefill instance may span TP ranks (TP = EP over the instance, `ParallelLayout.from_group`): its
ranks run one schedule in lockstep (the leader broadcasts the front's messages before each step) and
each sends its shard. A decode instance is one rank (DP1/EP1) or DP attention + EP ranks (TP 1): the
front routes requests to each of its ranks, which decode in lockstep (`nvl72.model.dp_ep.PassSync`).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import ClassVar

import msgpack

from nvl72.engine import protocol
from nvl72.engine.client import EngineDeadError, OutputStreams
from nvl72.engine.engine import InvalidRequest, validate_request
from nvl72.engine.protocol import (AbortRequest, AddRequest, EngineClient, LoadReport, Message, OutputBatch,
                                   ProtocolError, RequestOutput)

log = logging.getLogger("nvl72.disagg")


class ServingError(RuntimeError):
    """A deployment the disaggregated roles cannot serve (prefill TP > 1, no decode rank ...)."""


# ---------------------------------------------------------------------------------------------
# Data-plane messages (nested engine messages travel in their own protocol encoding)
# ---------------------------------------------------------------------------------------------
@dataclass
class PrefillRequest(Message):
    KIND: ClassVar[str] = "disagg_prefill"
    request: AddRequest
    seq: int
    decode_rank: int


@dataclass
class Handoff(Message):
    KIND: ClassVar[str] = "disagg_handoff"
    output: RequestOutput  # the first token (finish_reason None: the request continues on decode)
    seq: int
    num_tokens: int  # tokens of KV being transferred
    prefill_ranks: list[int]  # the sending instance's ranks, in TP order


@dataclass
class ExpectTransfer(Message):
    KIND: ClassVar[str] = "disagg_expect"
    request: AddRequest
    seq: int
    prefill_ranks: list[int]
    num_tokens: int


_NESTED = {"request", "output"}
_KINDS = {c.KIND: c for c in (PrefillRequest, Handoff, ExpectTransfer)}


def encode(msg: Message) -> bytes:
    if msg.KIND not in _KINDS:
        return protocol.encode(msg)
    body = {k: (protocol.encode(v) if k in _NESTED else v) for k, v in vars(msg).items()}
    return msgpack.packb({"v": protocol.PROTOCOL_VERSION, "kind": msg.KIND, "body": body}, use_bin_type=True)


def decode(data: bytes) -> Message:
    try:
        raw = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable data-plane message: {e}") from e
    if not (isinstance(raw, dict) and raw.get("kind") in _KINDS):
        return protocol.decode(data)
    if raw.get("v") != protocol.PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {raw.get('v')!r}")
    try:
        body = {k: (protocol.decode(v) if k in _NESTED else v) for k, v in raw["body"].items()}
        return _KINDS[raw["kind"]](**body)
    except (TypeError, KeyError, AttributeError) as e:
        raise ProtocolError(f"bad fields for {raw['kind']!r}: {e}") from e


def _identity(rank: int) -> bytes:
    return f"data{rank}".encode()


class FrontHub:
    """The front rank's ROUTER socket, bound before the roles start (its address is broadcast)."""

    def __init__(self, host: str):
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://*")
        self.address = f"tcp://{host}:{port}"


class _RankLink:
    """A role's DEALER to the front's hub."""

    def __init__(self, rank: int, address: str):
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, _identity(rank))
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.SNDTIMEO, 10_000)
        self.sock.connect(address)

    def send(self, msg: Message) -> None:
        self.sock.send(encode(msg))

    def send_outputs(self, outs: list[RequestOutput]) -> None:
        """One message for all of a step's outputs (one send here, one wake-up of the front)."""
        if outs:
            self.send(OutputBatch(outs))

    def recv_all(self, timeout_ms: int) -> list[Message]:
        import zmq

        out = []
        if self.sock.poll(timeout_ms, zmq.POLLIN):
            while True:
                try:
                    raw = self.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    out.append(decode(raw))
                except ProtocolError as e:
                    log.error("dropping a bad data-plane message: %s", e)
        return out

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------------------------------------
# Role bodies
# ---------------------------------------------------------------------------------------------
@dataclass
class ServingOptions:
    engine_args: dict
    transfer_timeout: float = 60.0
    report_interval: float = 0.2
    kv_transport: str = "sendrecv"  # transport.TRANSPORTS
    kv_ring_bytes: int = 256 << 20  # p2p: staging ring per (prefill rank, decode rank) link


def _engine(opts: ServingOptions, parallel=None):
    from nvl72.engine.core import EngineCore, build_engine

    return EngineCore(build_engine(**opts.engine_args, parallel=parallel))


def _transfer_plan(engine, h, src_tp: int = 1):
    """One request's plan over its first ceil(num_tokens / page_size) pages. Each side fills in only
    its own page/slot indices; the other side's are never read (same copies, same order)."""
    from nvl72.disagg.plan import CacheLayout, build_transfer_plan

    n = math.ceil(h.num_tokens / engine.config.page_size)
    layout = CacheLayout.from_config(engine.model.config)
    slot = h.state_slot if engine.hybrid else None
    return build_transfer_plan(layout, src_tp, 1, h.pages[:n], h.pages[:n], slot, slot)


def _layer_groups(engine):
    from nvl72.disagg.transport import layer_groups

    c = engine.caches
    return layer_groups(max(len(c.kv), len(c.conv), len(c.recurrent)), 4)


class _Lockstep:
    """The TP ranks of one prefill instance run one engine schedule: before every step the leader
    (TP rank 0, the only rank the front talks to) broadcasts the messages it took in (and whether to
    stop) over the instance group; a parked request is released once every rank's send finished
    (all-reduce MIN of per-rank done flags, over the parked list all ranks share)."""

    def __init__(self, group, leader: int, device: str, timeout: float):
        self.group, self.leader, self.timeout = group, leader, timeout
        self.device = "cuda" if device == "cuda" else "cpu"

    def tick(self, msgs: list[Message], stop: bool) -> tuple[list[Message], bool]:
        import torch
        import torch.distributed as dist

        from nvl72.parallel import wait

        if self.group is None:
            return msgs, stop
        leads = dist.get_rank() == self.leader
        data = msgpack.packb([stop, [encode(m) for m in msgs]], use_bin_type=True) if leads else b""
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        wait(dist.broadcast(n, self.leader, group=self.group, async_op=True), self.timeout, "prefill tick length")
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device) if leads
               else torch.empty(int(n), dtype=torch.uint8, device=self.device))
        wait(dist.broadcast(buf, self.leader, group=self.group, async_op=True), self.timeout, "prefill tick")
        if leads:
            return msgs, stop
        stop, raw = msgpack.unpackb(bytes(buf.cpu().tolist()), raw=False)
        return [decode(m) for m in raw], stop

    def all_done(self, flags: list[bool]) -> list[bool]:
        import torch
        import torch.distributed as dist

        from nvl72.parallel import wait

        if self.group is None or not flags:
            return flags
        t = torch.tensor(flags, dtype=torch.int32, device=self.device)
        wait(dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group, async_op=True), self.timeout,
             "prefill transfer completion")
        return [bool(x) for x in t.tolist()]


def _open_transport(ctx, opts: ServingOptions, caches):
    """This rank's KV transport (`--kv-transport`), opened on every prefill and decode rank at start-up:
    p2p rings in a symmetric heap, or send/recv over the transfer group with its pairs connected."""
    from nvl72.disagg.transport import open_transport

    ranks = {role: [x for i in ctx.plan.of_role(role) for x in i.ranks] for role in ("prefill", "decode")}
    return open_transport(opts.kv_transport, ctx.groups.transfer, ctx.groups.role.rank, ranks["prefill"],
                          ranks["decode"], caches, ctx.timeout, opts.kv_ring_bytes)


def prefill_role(ctx, opts: ServingOptions, ready) -> int:
    """A prefill instance (TP ranks in lockstep): prefill-only requests, then every TP rank sends its
    shard to the front's chosen decode rank, then the request is released once all sends completed
    (or failed). Only the leader talks to the front."""
    from nvl72.disagg.transport import caches_of
    from nvl72.engine.sequence import Status
    from nvl72.model.parallel_layout import ParallelLayout

    r = ctx.groups.role
    inst = ctx.plan.instance_of(r.rank)
    leader, leads = inst.ranks[0], r.rank == inst.ranks[0]
    parallel = ParallelLayout.from_group(ctx.groups.tp, timeout=ctx.timeout) if r.tp_size > 1 else None
    core = _engine(opts, parallel)
    eng = core.engine
    step = _Lockstep(ctx.groups.instance if r.tp_size > 1 else None, leader, ctx.device, ctx.timeout)
    link = _RankLink(r.rank, ctx.data_address) if leads else None
    caches, groups = caches_of(eng.caches), _layer_groups(eng)
    meta: dict[str, PrefillRequest] = {}
    parked: dict[str, threading.Event | None] = {}  # in park order (the same on every TP rank)
    failed: dict[str, str] = {}

    def finish(rid: str, sender, done: threading.Event) -> None:
        try:
            sender.wait(opts.transfer_timeout)
        except Exception as e:  # a dead decode rank, a timeout: the request is released either way
            failed[rid] = str(e)
        done.set()

    def send(msg: Message) -> None:
        if link is not None:
            link.send(msg)

    transport = _open_transport(ctx, opts, caches)
    ready()
    last, handed = 0.0, 0
    while True:
        if leads:
            ctx.agent.beat(poll_s=0.0)
            msgs = link.recv_all(0 if core.busy else (2 if parked else 5))
            stop = ctx.agent.stop_reason is not None or ctx.stop.is_set()
        else:  # heartbeats only: the leader decides when the instance stops
            ctx.agent.beat(poll_s=0.0)
            msgs, stop = [], False
        msgs, stop = step.tick(msgs, stop)
        if stop:
            break
        for msg in msgs:
            if isinstance(msg, PrefillRequest):
                try:
                    eng.add_request(msg.request, prefill_only=True)
                except InvalidRequest as e:
                    send(RequestOutput(msg.request.request_id, [], "error", error=str(e)))
                    continue
                meta[msg.request.request_id] = msg
            elif isinstance(msg, AbortRequest):
                seq = eng.seqs.get(msg.request_id)
                if seq is not None and seq.status != Status.PARKED:  # a parked one is released after its transfer
                    meta.pop(msg.request_id, None)
                    out = eng.abort_request(msg.request_id)
                    if out is not None:
                        send(out)
        for o in core.step():
            m = meta.pop(o.request_id, None)
            if m is None or o.finish_reason is not None:
                send(o)
                continue
            h = eng.handoff(o.request_id)
            done = threading.Event()
            parked[o.request_id] = done
            try:
                sender = transport.sender(m.seq, _transfer_plan(eng, h, r.tp_size), r.tp_rank, inst.ranks,
                                          [m.decode_rank], caches, groups)
                sender.send_all()
                sender.send_first_token(o.new_token_ids[0])
            except Exception as e:  # the decode rank is gone (gloo refuses the send)
                failed[o.request_id] = str(e)
                done.set()
                send(RequestOutput(o.request_id, [], "error", error=f"KV transfer failed: {e}"))
                continue
            threading.Thread(target=finish, args=(o.request_id, sender, done), daemon=True,
                             name=f"kv-send-{m.seq}").start()
            send(Handoff(o, m.seq, h.num_tokens, list(inst.ranks)))
            handed += 1
        ids = list(parked)
        for rid, ok in zip(ids, step.all_done([parked[rid].is_set() for rid in ids])):
            if ok:
                del parked[rid]
                if rid in failed:
                    log.error("prefill rank %d: transfer of %s failed: %s", r.rank, rid, failed.pop(rid))
                eng.release(rid)
        now = time.monotonic()
        if leads and now - last >= opts.report_interval:
            rep = core.load_report()
            rep.rank = r.rank
            send(rep)
            last = now
    core.close()
    transport.close()
    if link is not None:
        link.close()
    log.info("prefill rank %d: %d requests handed off to decode ranks", r.rank, handed)
    return 0


def _dp_ep_engine(ctx, opts: ServingOptions):
    """This rank's engine of a DP+EP decode instance (TP 1, experts over the EP group) and the
    `PassSync` that keeps its model passes in lockstep with the group's."""
    import torch

    from nvl72.config import ModelConfig
    from nvl72.engine.core import _DTYPES
    from nvl72.model.dp_ep import PassSync, serving_dp_ep_layout

    args = opts.engine_args
    if args.get("model") is None:
        raise ServingError("a DP+EP decode instance needs engine_args['model'] (a checkpoint or config directory)")
    device, dtype = args.get("device", "auto"), args.get("dtype", "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":  # as build_engine resolves it
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    if dtype not in _DTYPES:
        raise ServingError(f"dtype={dtype!r} is not one of {sorted(_DTYPES)}")
    # Per rank and step: the scheduler's token budget (verify rows included), as build_engine sizes it.
    max_tokens = max(args.get("max_num_batched_tokens", 2048), 1 + args.get("num_speculative_tokens", 0))
    layout = serving_dp_ep_layout(ctx.groups.ep, ModelConfig.from_pretrained(args["model"]), max_tokens,
                                  _DTYPES[dtype], device, ctx.timeout)
    core = _engine(opts, layout)
    sync = PassSync(core.engine.model, ctx.groups.ep, ctx.timeout, "cuda" if device.startswith("cuda") else "cpu")
    core.engine.set_pass_sync(sync)
    return core, sync


class _InstanceStop:
    """The ranks of a DP+EP decode instance stop together: before every step they all-reduce (MAX)
    their stop flags over the instance group, so none leaves while the others are in a collective."""

    def __init__(self, group, device: str, timeout: float):
        self.group, self.timeout = group, timeout
        self.device = "cuda" if device == "cuda" else "cpu"

    def __call__(self, stop: bool) -> bool:
        import torch
        import torch.distributed as dist

        from nvl72.parallel import wait

        t = torch.tensor([int(stop)], dtype=torch.int32, device=self.device)
        wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True), self.timeout,
             "decode instance stop decision")
        return bool(t.item())


def decode_role(ctx, opts: ServingOptions, ready) -> int:
    """A decode rank: reserve, receive, commit, decode; stream outputs and load reports to the front.

    One rank (DP1/EP1), or one DP rank of a DP+EP instance (TP 1, EP > 1): each rank owns the
    requests the front routes to it, every rank steps every loop pass (idle passes join the
    others' MoE collectives, `PassSync.finish`), and the ranks decide together when to stop. A
    collective that fails or times out (a lost rank) or a model error is fatal to the instance: its
    streams end with an error and the rank stops serving (the front then marks it dead) but stays
    on the control plane until the deployment shuts down."""
    from nvl72.cache.pool import OutOfCapacity
    from nvl72.disagg.plan import TransferPlanError
    from nvl72.disagg.transport import TransferError, caches_of

    r = ctx.groups.role
    if r.tp_size != 1:
        raise ServingError(f"{r.name} has TP {r.tp_size} / EP {r.ep_size}; disaggregated decode runs TP 1 instances "
                           "only (one rank, or DP attention + EP)")
    if r.ep_size > 1:
        core, sync = _dp_ep_engine(ctx, opts)
        agree_stop = _InstanceStop(ctx.groups.instance, ctx.device, ctx.timeout)
    else:
        core, sync, agree_stop = _engine(opts), None, bool  # a lone rank's stop flag is the decision
    eng = core.engine
    link = _RankLink(r.rank, ctx.data_address)
    caches, groups = caches_of(eng.caches), _layer_groups(eng)
    receiving: dict = {}  # request id -> its transport's receiver
    tokens: dict[str, int] = {}  # KV tokens of each transfer in flight (for its log line)
    transport = _open_transport(ctx, opts, caches)
    ready()
    last, received, others_busy = 0.0, 0, False
    outs: list[RequestOutput] = []  # this pass's outputs, sent as one OutputBatch after its step
    try:
        while not agree_stop(ctx.agent.stop_reason is not None or ctx.stop.is_set()):
            ctx.agent.beat(poll_s=0.0)
            # No waiting for messages while a peer DP rank is decoding: it waits on this rank's passes; nor
            # while p2p parts are due: this rank's polls free the ring slots the senders wait for.
            spin = core.busy or others_busy or (receiving and transport.name == "p2p")
            for msg in link.recv_all(0 if spin else (1 if receiving else 5)):
                if isinstance(msg, ExpectTransfer):
                    rid = msg.request.request_id
                    try:
                        h = eng.reserve_transfer(msg.request, msg.num_tokens)
                    except (OutOfCapacity, InvalidRequest) as e:
                        outs.append(RequestOutput(rid, [], "error", error=str(e)))
                        continue
                    try:
                        plan = _transfer_plan(eng, h, len(msg.prefill_ranks))
                        receiving[rid] = transport.receiver(msg.seq, plan, 0, msg.prefill_ranks, [r.rank], caches,
                                                            groups, opts.transfer_timeout)
                        tokens[rid] = msg.num_tokens
                    except (TransferPlanError, RuntimeError) as e:
                        eng.abort_request(rid)
                        outs.append(RequestOutput(rid, [], "error", error=f"KV transfer failed: {e}"))
                elif isinstance(msg, AbortRequest):
                    rcv = receiving.pop(msg.request_id, None)
                    if rcv is not None:  # its late parts are dropped (send/recv: land in its buffers, time out)
                        rcv.close()
                    tokens.pop(msg.request_id, None)
                    out = eng.abort_request(msg.request_id)
                    if out is not None:
                        outs.append(out)
            for rid, rcv in list(receiving.items()):
                try:
                    if not rcv.poll():
                        continue
                    eng.commit_transfer(rid, [rcv.receipt.require_complete()])
                    received += 1
                    nbytes, secs = rcv.measured()
                    total = sum(nbytes.values())
                    log.info("decode rank %d: KV transfer of %s: %d tokens, %d bytes (%s) in %.3f ms = %.2f GB/s",
                             r.rank, rid, tokens[rid], total, ", ".join(f"{k} {n}" for k, n in nbytes.items() if n),
                             secs * 1e3, total / max(secs, 1e-9) / 1e9)
                except (TransferError, InvalidRequest) as e:
                    log.error("decode rank %d: transfer of %s failed: %s", r.rank, rid, e)
                    rcv.close()
                    eng.abort_request(rid)
                    outs.append(RequestOutput(rid, [], "error", error=f"KV transfer failed: {e}"))
                del receiving[rid], tokens[rid]
            if sync is None:
                outs += core.step()
            else:  # a model error raises here (the group's collectives are out of step): fatal
                idle = sync.idle_passes
                if eng.has_unfinished():
                    outs += eng.step()
                sync.finish()
                others_busy = sync.idle_passes > idle
            link.send_outputs(outs)
            outs = []
            now = time.monotonic()
            if now - last >= opts.report_interval:
                rep = core.load_report()
                rep.rank = r.rank
                link.send(rep)
                last = now
    except Exception as e:  # DP+EP: a collective failed (a lost rank) or the model did; a lone rank re-raises
        if sync is None:
            link.send_outputs(outs)  # what the pass produced before the failure
            raise
        why = f"decode instance {r.name} failed on rank {r.rank}: {type(e).__name__}: {e}"
        log.exception("%s; failing its %d requests", why, len(eng.seqs))
        link.send_outputs(outs + [RequestOutput(rid, [], "error", error=why) for rid in eng.seqs])
        link.close()
        # Out of the data plane (no load reports: the front marks this rank dead and routes around
        # the instance), still on the control plane: leaving would stop the whole deployment.
        while ctx.agent.stop_reason is None and not ctx.stop.is_set():
            ctx.agent.beat()
        return 1
    generated = int(eng.counters["generation_tokens"])
    link.send_outputs(core.close())
    transport.close()
    link.close()
    log.info("decode rank %d: %d requests received, %d tokens decoded", r.rank, received, generated)
    if sync is not None:
        log.info("decode rank %d: DP+EP, %d idle passes", r.rank, sync.idle_passes)
    return 0


# ---------------------------------------------------------------------------------------------
# Front: an EngineClient over the prefill and decode ranks
# ---------------------------------------------------------------------------------------------
@dataclass
class _Flight:
    request: AddRequest
    seq: int
    prefill_rank: int
    decode_rank: int


_SUMMED = ("running", "waiting", "kv_pages_total", "kv_pages_used", "state_slots_used", "prefix_cache_queries",
           "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens", "spec_decode_num_drafts",
           "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


class DisaggClient(EngineClient):
    """Routes each request to a prefill rank, then to the live decode rank with the fewest requests
    in flight (under `batch_threshold`); streams its tokens back. One I/O thread owns the socket and
    delivers each message's outputs (a decode rank's step: one `OutputBatch`) into the requests'
    streams with one event-loop wake-up (`nvl72.engine.client.OutputStreams`)."""

    def __init__(self, hub: FrontHub, prefill_ranks: list[int], decode_ranks: list[int], *, batch_threshold: int = 128,
                 lost_timeout: float = 5.0, output_timeout: float = 600.0):
        if not prefill_ranks or not decode_ranks:
            raise ServingError(f"need prefill and decode ranks, got prefill {prefill_ranks}, decode {decode_ranks}")
        if batch_threshold < 1:
            raise ServingError(f"batch_threshold={batch_threshold} must be >= 1")
        self.hub, self.prefill_ranks, self.decode_ranks = hub, list(prefill_ranks), list(decode_ranks)
        self.batch_threshold, self.lost_timeout, self.output_timeout = batch_threshold, lost_timeout, output_timeout
        self.max_model_len = 0
        self.vocab_size: int | None = None
        self.dead: dict[int, str] = {}
        self.inflight = {r: 0 for r in self.prefill_ranks + self.decode_ranks}
        self._reports: dict[int, LoadReport] = {}
        self._last_seen: dict[int, float] = {}
        self._flights: dict[str, _Flight] = {}
        self._streams = OutputStreams()
        self._lock = threading.Lock()
        self._outbox: queue.Queue = queue.Queue()
        self._seq = itertools.count(1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._io, name="nvl72-disagg-front", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float) -> None:
        """Until every prefill and decode rank reported once (the engines are built)."""
        deadline = time.monotonic() + timeout
        want = set(self.prefill_ranks + self.decode_ranks)
        while not want <= set(self._reports):
            if self._stop.is_set():
                raise ServingError("front shut down before every rank reported")
            if time.monotonic() > deadline:
                missing = sorted(want - set(self._reports))
                raise ServingError(f"ranks {missing} sent no load report within {timeout:g} s")
            time.sleep(0.02)
        first = self._reports[self.decode_ranks[0]].stats
        self.max_model_len = min(int(self._reports[r].stats["max_model_len"]) for r in want)
        self.vocab_size = int(first["vocab_size"]) or None

    # ---- I/O thread
    def _send(self, rank: int, msg: Message) -> None:
        self._outbox.put((rank, msg))

    def _io(self) -> None:
        import zmq

        sock = self.hub.sock
        while not self._stop.is_set():
            if sock.poll(2, zmq.POLLIN):
                while True:
                    try:
                        ident, raw = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self._on_message(int(ident.decode()[4:]), decode(raw))
                    except (ProtocolError, ValueError) as e:
                        log.error("front: dropped a bad data-plane message from %r: %s", ident, e)
                    except Exception:  # a bug in handling one message must not stop every stream
                        log.exception("front: failed to handle a data-plane message from %r", ident)
            while True:
                try:
                    rank, msg = self._outbox.get_nowait()
                except queue.Empty:
                    break
                sock.send_multipart([_identity(rank), encode(msg)])
            self._check_lost()
        sock.close()

    def _on_message(self, rank: int, msg: Message) -> None:
        if isinstance(msg, LoadReport):
            self._reports[rank] = msg
            self._last_seen[rank] = time.monotonic()
        elif isinstance(msg, Handoff):
            with self._lock:
                f = self._flights.get(msg.output.request_id)
            if f is None:
                return  # aborted meanwhile: the decode rank never reserves; the sender times out
            self._streams.deliver([msg.output])
            self._send(f.decode_rank, ExpectTransfer(f.request, f.seq, msg.prefill_ranks, msg.num_tokens))
        elif isinstance(msg, OutputBatch):
            self._streams.deliver(msg.outputs)
        elif isinstance(msg, RequestOutput):
            self._streams.deliver([msg])

    def _check_lost(self) -> None:
        now = time.monotonic()
        for rank in self.decode_ranks + self.prefill_ranks:
            seen = self._last_seen.get(rank)
            if rank in self.dead or seen is None or now - seen <= self.lost_timeout:
                continue
            why = f"rank {rank} lost (no load report for {self.lost_timeout:g} s)"
            log.error("front: %s; failing its requests, routing around it", why)
            self.dead[rank] = why
            with self._lock:
                lost = [rid for rid, f in self._flights.items() if rank in (f.decode_rank, f.prefill_rank)]
            self._streams.fail(lost, EngineDeadError(why))

    # ---- EngineClient
    def _pick(self, ranks: list[int], limit: int | None) -> int:
        live = [r for r in ranks if r not in self.dead]
        if not live:
            raise EngineDeadError(f"no live rank among {ranks}: " + "; ".join(self.dead[r] for r in ranks))
        r = min(live, key=lambda k: (self.inflight[k], k))
        if limit is not None and self.inflight[r] >= limit:
            raise EngineDeadError(f"every live decode rank holds {limit} requests (the batch threshold)")
        return r

    async def generate(self, request: AddRequest) -> AsyncIterator[RequestOutput]:
        validate_request(request, self.max_model_len, self.vocab_size)
        rid = request.request_id
        stream = self._streams.open(rid)  # InvalidRequest on a duplicate id
        try:
            with self._lock:
                p, d = self._pick(self.prefill_ranks, None), self._pick(self.decode_ranks, self.batch_threshold)
                f = _Flight(request, next(self._seq), p, d)
                self._flights[rid] = f
                self.inflight[p] += 1
                self.inflight[d] += 1
        except BaseException:
            self._streams.close(rid)
            raise
        finished = False
        try:
            self._send(p, PrefillRequest(request, f.seq, d))
            while True:
                try:
                    out = await stream.next(self.output_timeout)
                except EngineDeadError:  # its rank is lost or the front shuts down: nothing to abort
                    finished = True
                    raise
                finished = out.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            with self._lock:
                self._flights.pop(rid, None)
                self.inflight[p] -= 1
                self.inflight[d] -= 1
            self._streams.close(rid)
            if not finished:
                for rank in (p, d):
                    self._send(rank, AbortRequest(rid))

    async def abort(self, request_id: str) -> None:
        with self._lock:
            f = self._flights.get(request_id)
        if f is not None:
            self._send(f.prefill_rank, AbortRequest(request_id))
            self._send(f.decode_rank, AbortRequest(request_id))

    def stats(self) -> dict[str, float]:
        per = [self._reports[r].stats for r in self.decode_ranks if r in self._reports and r not in self.dead]
        out: dict[str, float] = {}
        for k in {k for s in per for k in s}:
            vals = [float(s[k]) for s in per if k in s]
            out[k] = sum(vals) if k in _SUMMED else sum(vals) / len(vals)
        out["decode_ranks_live"] = float(len(self.decode_ranks) - len([r for r in self.dead if r in self.decode_ranks]))
        return out

    async def shutdown(self) -> None:
        """Stop the I/O thread; requests still in flight end with EngineDeadError (503)."""
        self._stop.set()
        await asyncio.to_thread(self._thread.join, 5)
        with self._lock:
            ids = list(self._flights)
        self._streams.fail(ids, EngineDeadError("the front is shutting down"))
