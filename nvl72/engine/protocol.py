"""Typed messages between the HTTP front and the engine ranks.

They travel over ZeroMQ as msgpack maps carrying a version field (vLLM engine-core convention);
no pickle, no tensors. Token ids only: the front tokenizes and detokenizes (stop strings too).
"""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

PROTOCOL_VERSION = 1


class ProtocolError(ValueError):
    """A message that cannot be decoded: wrong version, unknown kind or bad fields."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; n >= 0: chosen token's logprob plus n top logprobs

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Message:
    KIND: ClassVar[str] = ""


@dataclass
class AddRequest(Message):
    KIND: ClassVar[str] = "add"
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams


@dataclass
class AbortRequest(Message):
    KIND: ClassVar[str] = "abort"
    request_id: str


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput(Message):
    """New tokens of one request since its previous output; finish_reason set on the last."""

    KIND: ClassVar[str] = "output"
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # None | "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    # Seconds the request waited in the engine's queue before its first scheduling; sent once,
    # on the first output after admission (None on every other output).
    queue_time: float | None = None


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """Several consecutive outputs of one request as one (a consumer that fell behind takes all it
    has at once); nothing after a finished output is kept."""
    if len(outs) == 1:
        return outs[0]
    ids: list[int] = []
    lps: list[TokenLogprob] | None = None
    queue_time, cached = None, 0
    for o in outs:
        ids += o.new_token_ids
        if o.logprobs is not None:
            lps = (lps or []) + o.logprobs
        if queue_time is None:
            queue_time = o.queue_time
        cached = max(cached, o.num_cached_tokens)
        last = o
        if o.finish_reason is not None:
            break
    return RequestOutput(last.request_id, ids, last.finish_reason, last.num_prompt_tokens, cached, lps, last.error,
                         queue_time)


@dataclass
class OutputBatch(Message):
    """All `RequestOutput`s of one engine step, sent as one message (one ZeroMQ send and one
    wake-up of the front per step instead of one per request)."""

    KIND: ClassVar[str] = "outputs"
    outputs: list[RequestOutput]


@dataclass
class LoadReport(Message):
    """Periodic load and health report of one engine rank (doubles as its heartbeat)."""

    KIND: ClassVar[str] = "load"
    rank: int
    num_running: int
    num_waiting: int
    kv_usage: float
    time: float
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class Shutdown(Message):
    """Asks an engine process to abort everything, release its caches and exit."""

    KIND: ClassVar[str] = "shutdown"
    reason: str = ""


_KINDS: dict[str, type[Message]] = {c.KIND: c for c in (AddRequest, AbortRequest, RequestOutput, OutputBatch, LoadReport,
                                                         Shutdown)}


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(x) for x in obj]
    return obj


def _output_plain(o: RequestOutput) -> dict[str, Any]:
    """`_to_plain` of a RequestOutput without the generic dataclass walk (it runs per request per step)."""
    return {"request_id": o.request_id, "new_token_ids": o.new_token_ids, "finish_reason": o.finish_reason,
            "num_prompt_tokens": o.num_prompt_tokens, "num_cached_tokens": o.num_cached_tokens,
            "logprobs": None if o.logprobs is None else _to_plain(o.logprobs), "error": o.error,
            "queue_time": o.queue_time}


def encode(msg: Message) -> bytes:
    if isinstance(msg, OutputBatch):
        body: Any = {"outputs": [_output_plain(o) for o in msg.outputs]}
    elif isinstance(msg, RequestOutput):
        body = _output_plain(msg)
    else:
        body = _to_plain(msg)
    return msgpack.packb({"v": PROTOCOL_VERSION, "kind": msg.KIND, "body": body}, use_bin_type=True)


def _output(body: dict[str, Any]) -> RequestOutput:
    if body.get("logprobs") is not None:
        body["logprobs"] = [
            TokenLogprob(lp["token_id"], lp["logprob"], [tuple(t) for t in lp["top"]]) for lp in body["logprobs"]
        ]
    return RequestOutput(**body)


def decode(data: bytes) -> Message:
    try:
        raw = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable message: {e}") from e
    if not isinstance(raw, dict) or raw.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {raw.get('v') if isinstance(raw, dict) else raw!r}")
    cls = _KINDS.get(raw.get("kind"))
    if cls is None:
        raise ProtocolError(f"unknown message kind {raw.get('kind')!r}")
    body = dict(raw["body"])
    try:
        if cls is AddRequest:
            body["sampling"] = SamplingParams(**body["sampling"])
        if cls is RequestOutput:
            return _output(body)
        if cls is OutputBatch:
            return OutputBatch([_output(dict(o)) for o in body["outputs"]])
        return cls(**body)
    except (TypeError, KeyError, ValueError) as e:
        raise ProtocolError(f"bad fields for {cls.KIND!r}: {e}") from e


class EngineClient(abc.ABC):
    """What the HTTP front needs of an engine (in-process, or ranks reached over ZeroMQ)."""

    max_model_len: int

    @abc.abstractmethod
    def generate(self, request: AddRequest) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs until one carries a finish_reason.

        Closing the iterator early (client disconnect) aborts the request."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Abort a running or waiting request; its stream ends with finish_reason 'abort'."""

    @abc.abstractmethod
    def stats(self) -> dict[str, float]:
        """Current engine gauges and counters (running, waiting, kv_usage, prefix hits, spec-decode
        acceptance ...), read by /metrics and the router."""

    async def shutdown(self) -> None:
        """Stop the engine and release its resources."""
