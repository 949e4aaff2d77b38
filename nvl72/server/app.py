"""The OpenAI-compatible HTTP front (FastAPI): /v1/chat/completions, /v1/completions, /v1/models,
/health, /metrics.

The front tokenizes (chat template included), hands token ids to an `EngineClient`, and turns the
streamed ids back into text: incremental detokenization -> stop strings -> `<think>` reasoning ->
`<tool_call>` parsing. Every bad input is answered 4xx with OpenAI's error body; a client that goes
away aborts its request in the engine.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import json.encoder
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from nvl72.engine.protocol import AddRequest, EngineClient, RequestOutput, SamplingParams, TokenLogprob
from nvl72.server.metrics import Metrics
from nvl72.server.openai_protocol import FIELD_NAMES, APIError, ChatCompletionRequest, CompletionRequest
from nvl72.server.parsers import THINK_START, ParsedToolCall, ReasoningParser, StopStrings, ToolCallParser
from nvl72.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

log = logging.getLogger(__name__)
_encode_str = json.encoder.encode_basestring  # json.dumps(s, ensure_ascii=False) of one str, without an encoder


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = 8 << 20  # larger bodies get 413
    output_timeout_s: float = 600.0  # longest wait for the engine's next output of one request


# ---- one request's output pipeline ------------------------------------------------------------
@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls or self.logprobs)


class OutputPipeline:
    """Engine token ids -> text deltas: detokenize, cut at stop strings, split reasoning, parse tools."""

    def __init__(self, tok: Tokenizer, stops: list[str], skip_special_tokens: bool,
                 reasoning: ReasoningParser | None, tools: ToolCallParser | None):
        self._detok = IncrementalDetokenizer(tok, skip_special_tokens)
        self._stops = StopStrings(stops)
        self._reasoning = reasoning
        self.tools = tools
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.first_output_time: float | None = None
        self.queue_time: float | None = None
        self.last_output_time: float | None = None

    @property
    def stopped(self) -> bool:
        """A stop string was generated: the engine request must be cut short."""
        return self._stops.stopped

    def step(self, out: RequestOutput) -> Delta:
        now = time.monotonic()
        self.first_output_time = self.first_output_time or now
        self.last_output_time = now
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.queue_time is not None:
            self.queue_time = out.queue_time
        ids = out.new_token_ids
        if self._stops.stops and len(ids) > 1:
            # Several tokens at once (a merged output): one by one, so that usage and logprobs end
            # at the token completing a stop string.
            text, used = "", 0
            for t in ids:
                used += 1
                text += self._stops.feed(self._detok.add((t,)))
                if self._stops.stopped:
                    break
        else:
            text, used = self._stops.feed(self._detok.add(ids)), len(ids)
        self.num_output_tokens += used
        d = self._route(text)
        d.logprobs = out.logprobs[:used] if out.logprobs else []
        return d

    def finish(self) -> Delta:
        d = self._route(self._stops.feed(self._detok.flush()) + self._stops.finish())
        if self._reasoning is not None:
            r, c = self._reasoning.finish()
            d.reasoning += r
            d = _add(d, self._tools(c))
        if self.tools is not None:
            c, calls = self.tools.finish()
            d.content += c
            d.tool_calls += calls
        return d

    def _route(self, text: str) -> Delta:
        if self._reasoning is None:
            return self._tools(text)
        r, c = self._reasoning.feed(text)
        d = self._tools(c)
        d.reasoning = r
        return d

    def _tools(self, text: str) -> Delta:
        if self.tools is None or not text:
            return Delta(content=text)
        c, calls = self.tools.feed(text)
        return Delta(content=c, tool_calls=calls)


@dataclass
class Prepared:
    """A validated request, ready for the engine."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stops: list[str]
    skip_special_tokens: bool
    stream: bool
    include_usage: bool
    reasoning_started: bool | None  # None: no reasoning parsing
    parse_tools: bool
    arrival: float


# ---- the app ---------------------------------------------------------------------------------
class OpenAIServer:
    """Holds the engine, tokenizer and metrics; builds the FastAPI app."""

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, config: ServerConfig):
        self.engine, self.tok, self.cfg = engine, tokenizer, config
        self.metrics = Metrics(config.served_model_name, engine.stats)
        self.app = self._build()

    # ---- request parsing and validation -------------------------------------------------
    async def _read_json(self, request: Request) -> dict[str, Any]:
        limit = self.cfg.max_body_bytes
        cl = request.headers.get("content-length")
        if cl is not None and (not cl.isdigit() or int(cl) > limit):
            raise APIError(413, f"request body of {cl} bytes exceeds the limit of {limit} bytes",
                           code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}")
        return data

    @staticmethod
    def _validate(model: type, data: dict[str, Any]):
        try:
            return model.model_validate(data)
        except ValidationError as e:
            # Union members add their type names to the location: keep only field names and indices,
            # and report the most specific error.
            def path(err) -> list[str]:
                return [str(x) for x in err["loc"] if isinstance(x, int) or x in FIELD_NAMES]
            err = max(e.errors(), key=lambda x: len(path(x)))
            param = ".".join(path(err)) or None
            raise APIError(400, f"{param}: {err['msg']} (got {err.get('input')!r:.200})" if param
                           else err["msg"], param=param) from e

    def _check_model(self, name: str) -> None:
        if name != self.cfg.served_model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves "
                                f"{self.cfg.served_model_name!r}", param="model", code="model_not_found")

    def _sampling(self, req: ChatCompletionRequest | CompletionRequest, prompt_len: int) -> SamplingParams:
        max_len = self.engine.max_model_len
        if prompt_len >= max_len:
            raise APIError(400, f"this model's maximum context length is {max_len} tokens, but the prompt has "
                                f"{prompt_len} tokens", param="messages" if isinstance(req, ChatCompletionRequest)
                           else "prompt", code="context_length_exceeded")
        wanted = req.wanted_tokens
        if wanted is not None and prompt_len + wanted > max_len:
            raise APIError(400, f"max_tokens={wanted} plus the {prompt_len} prompt tokens exceeds the maximum "
                                f"context length of {max_len} tokens", param="max_tokens",
                           code="context_length_exceeded")
        stop_ids = list(req.stop_token_ids or [])
        for t in stop_ids:
            if not 0 <= t < self.tok.vocab_size:
                raise APIError(400, f"stop_token_ids: {t} is outside the vocabulary [0, {self.tok.vocab_size})",
                               param="stop_token_ids")
        if not req.ignore_eos:
            stop_ids += [t for t in self.tok.eos_token_ids if t not in stop_ids]
        return SamplingParams(
            max_tokens=wanted if wanted is not None else max_len - prompt_len,
            temperature=req.temperature, top_p=req.top_p, top_k=-1 if req.top_k == 0 else req.top_k,
            min_p=req.min_p, seed=req.seed, repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            stop_token_ids=stop_ids, ignore_eos=req.ignore_eos, logprobs=req.num_logprobs)

    def _prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        self._check_model(req.model)
        if isinstance(req.tool_choice, dict) or req.tool_choice == "required":
            raise APIError(400, f"tool_choice={req.tool_choice!r} is not supported; use 'auto' or 'none'",
                           param="tool_choice")
        messages = []
        for m in req.messages:
            d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text() or ""}
            if m.tool_calls:
                d["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
            if m.reasoning_content is not None:
                d["reasoning_content"] = m.reasoning_content
            messages.append(d)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        kwargs = dict(req.chat_template_kwargs or {})
        try:
            prompt = self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, **kwargs)
        except (TokenizerError, TypeError) as e:
            raise APIError(400, f"messages cannot be rendered with the chat template: {e}", param="messages") from e
        ids = self.tok.encode(prompt)
        return Prepared(f"chatcmpl-{uuid.uuid4().hex}", ids, self._sampling(req, len(ids)), req.stop,
                        req.skip_special_tokens, req.stream,
                        bool(req.stream_options and req.stream_options.include_usage),
                        reasoning_started=prompt.rstrip("\n").endswith(THINK_START),
                        parse_tools=bool(req.tools) and req.tool_choice != "none", arrival=time.monotonic())

    def _prepare_completion(self, req: CompletionRequest) -> Prepared:
        self._check_model(req.model)
        if req.echo:
            raise APIError(400, "echo=true is not supported", param="echo")
        if isinstance(req.prompt, str):
            ids = self.tok.encode(req.prompt)
        else:
            ids = list(req.prompt)
            bad = next((t for t in ids if not 0 <= t < self.tok.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"prompt token id {bad} is outside the vocabulary [0, {self.tok.vocab_size})",
                               param="prompt")
        return Prepared(f"cmpl-{uuid.uuid4().hex}", ids, self._sampling(req, len(ids)), req.stop,
                        req.skip_special_tokens, req.stream,
                        bool(req.stream_options and req.stream_options.include_usage),
                        reasoning_started=None, parse_tools=False, arrival=time.monotonic())

    # ---- running a request ----------------------------------------------------------------
    def _pipeline(self, p: Prepared) -> OutputPipeline:
        reasoning = ReasoningParser(p.reasoning_started) if p.reasoning_started is not None else None
        return OutputPipeline(self.tok, p.stops, p.skip_special_tokens, reasoning,
                              ToolCallParser() if p.parse_tools else None)

    async def _outputs(self, p: Prepared, pipe: OutputPipeline) -> AsyncIterator[tuple[Delta, str | None]]:
        """Run the request in the engine; yield (delta, finish_reason) per output. Leaving early
        (stop string, client gone, timeout) aborts the engine request."""
        it = self.engine.generate(AddRequest(p.request_id, p.prompt_ids, p.sampling))
        finished = False
        try:
            while True:
                try:
                    async with asyncio.timeout(self.cfg.output_timeout_s):  # no task per output, unlike wait_for
                        out = await it.__anext__()
                except StopAsyncIteration:
                    raise APIError(500, f"engine stream of {p.request_id} ended without a finish reason",
                                   type="internal_server_error") from None
                except (asyncio.TimeoutError, TimeoutError):
                    raise APIError(504, f"engine produced no output for {p.request_id} within "
                                        f"{self.cfg.output_timeout_s} s", type="timeout") from None
                except ValueError as e:  # the engine rejected the request (nvl72.engine InvalidRequest)
                    finished = True
                    raise APIError(400, str(e)) from e
                except RuntimeError as e:  # engine dead or shut down (nvl72.engine EngineDeadError)
                    finished = True
                    raise APIError(503, f"engine unavailable: {e}", type="service_unavailable") from e
                if out.finish_reason == "error":
                    finished = True
                    raise APIError(500, f"engine failed on {p.request_id}: {out.error}", type="internal_server_error")
                d = pipe.step(out)
                if pipe.stopped:
                    yield d, "stop"
                    return
                if out.finish_reason is not None:
                    finished = True
                    yield d, out.finish_reason
                    return
                yield d, None
        finally:
            # Shielded: a disconnect cancels this task, and the abort must still reach the engine.
            with anyio.CancelScope(shield=True):
                if not finished:
                    try:
                        await self.engine.abort(p.request_id)
                    except Exception as e:  # the request may be gone already; never mask the original exit
                        log.warning("abort of %s failed: %s", p.request_id, e)
                await it.aclose()
            self._record(p, pipe, finished)

    def _record(self, p: Prepared, pipe: OutputPipeline, finished: bool) -> None:
        m, now = self.metrics, time.monotonic()
        m.prompt_tokens.inc(len(p.prompt_ids))
        m.generation_tokens.inc(pipe.num_output_tokens)
        m.prefix_queries.inc(len(p.prompt_ids))
        m.prefix_hits.inc(pipe.num_cached_tokens)
        m.e2e.observe(now - p.arrival)
        if pipe.queue_time is not None:
            m.queue_time.observe(pipe.queue_time)
        if pipe.first_output_time is not None:
            m.ttft.observe(pipe.first_output_time - p.arrival)
            if pipe.num_output_tokens > 1:
                m.tpot.observe((pipe.last_output_time - pipe.first_output_time) / (pipe.num_output_tokens - 1))
        m.finished("stop" if pipe.stopped else ("finished" if finished else "abort"))

    async def _collect(self, request: Request, p: Prepared) -> tuple[Delta, str, OutputPipeline]:
        """Non-streaming: gather the whole output, aborting if the client disconnects meanwhile."""
        pipe = self._pipeline(p)

        async def run() -> tuple[Delta, str]:
            total, reason, last = Delta(), "abort", None
            async with aclosing(self._outputs(p, pipe)) as outs:
                async for d, r in outs:
                    total = _add(total, d)
                    last = self._tick(last)
                    reason = r or reason
            return _add(total, pipe.finish()), reason

        async def client_gone() -> None:
            # As Starlette's StreamingResponse: the next ASGI message after the body is the disconnect.
            while (await request.receive())["type"] != "http.disconnect":
                pass

        task, watch = asyncio.ensure_future(run()), asyncio.ensure_future(client_gone())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            task.cancel()  # no-op when it is done; else the client is gone (or this handler was cancelled)
            await asyncio.gather(watch, task, return_exceptions=True)
        if task.cancelled():
            raise APIError(499, "client disconnected", code="client_closed_request")
        total, reason = task.result()
        return total, reason, pipe

    def _tick(self, last: float | None) -> float:
        """Observe the inter-output latency since `last`; return now."""
        now = time.monotonic()
        if last is not None:
            self.metrics.itl.observe(now - last)
        return now

    def _usage(self, p: Prepared, pipe: OutputPipeline) -> dict[str, Any]:
        n_in, n_out = len(p.prompt_ids), pipe.num_output_tokens
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out,
                "prompt_tokens_details": {"cached_tokens": pipe.num_cached_tokens}}

    def _chat_logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        def entry(tid: int, lp: float) -> dict[str, Any]:
            s = self.tok.decode([tid])
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}
        return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, l) for t, l in x.top]}
                            for x in lps]}

    def _completion_logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        return {"tokens": [self.tok.decode([x.token_id]) for x in lps],
                "token_logprobs": [x.logprob for x in lps],
                "top_logprobs": [{self.tok.decode([t]): l for t, l in x.top} for x in lps]}

    # ---- endpoints ---------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        req = self._validate(ChatCompletionRequest, await self._read_json(request))
        p = self._prepare_chat(req)
        base = {"id": p.request_id, "created": int(time.time()), "model": self.cfg.served_model_name}
        if p.stream:
            return self._sse(self._chat_stream(p, base, req.logprobs))
        total, reason, pipe = await self._collect(request, p)
        msg: dict[str, Any] = {"role": "assistant", "content": total.content or None}
        if p.reasoning_started is not None:
            msg["reasoning_content"] = total.reasoning or None
        if total.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in total.tool_calls]
            reason = "tool_calls" if reason == "stop" else reason
        elif msg["content"] is None:
            msg["content"] = ""
        choice = {"index": 0, "message": msg, "finish_reason": reason,
                  "logprobs": self._chat_logprobs(total.logprobs) if req.logprobs else None}
        return JSONResponse({**base, "object": "chat.completion", "choices": [choice], "usage": self._usage(p, pipe)})

    async def _chat_stream(self, p: Prepared, base: dict[str, Any], want_logprobs: bool) -> AsyncIterator[str]:
        pipe = self._pipeline(p)
        chunk = {**base, "object": "chat.completion.chunk"}
        content_event = _TextEvent(chunk, 'choices": [{"index": 0, "delta": {"content": ',
                                   '}, "finish_reason": null, "logprobs": null}]}')
        logprobs_event = _TextEvent(chunk, 'choices": [{"index": 0, "delta": {"content": ',
                                    '}, "finish_reason": null, "logprobs": ', '}]}')

        def event(delta: dict[str, Any], reason: str | None = None, lps: list[TokenLogprob] | None = None) -> str:
            c = {"index": 0, "delta": delta, "finish_reason": reason,
                 "logprobs": self._chat_logprobs(lps) if want_logprobs and lps else None}
            return _sse({**chunk, "choices": [c]})

        def fields(d: Delta) -> dict[str, Any]:
            out: dict[str, Any] = {}
            if d.reasoning:
                out["reasoning_content"] = d.reasoning
            if d.content:
                out["content"] = d.content
            if d.tool_calls:
                n = len(pipe.tools.calls) - len(d.tool_calls)
                out["tool_calls"] = [c.to_openai(n + i) for i, c in enumerate(d.tool_calls)]
            return out

        yield event({"role": "assistant", "content": ""})
        reason, last, d = None, None, Delta()
        try:
            async with aclosing(self._outputs(p, pipe)) as outs:
                async for d, r in outs:
                    last = self._tick(last)
                    if r is not None:
                        reason = r
                        break
                    if d.content and not (d.reasoning or d.tool_calls):
                        if want_logprobs and d.logprobs:
                            yield logprobs_event(d.content, self._chat_logprobs(d.logprobs))
                        else:
                            yield content_event(d.content)
                    elif d:
                        yield event(fields(d), None, d.logprobs)
            tail = pipe.finish()
            if reason is not None:
                tail = _add(d, tail)
            if pipe.tools is not None and pipe.tools.calls and reason == "stop":
                reason = "tool_calls"
            yield event(fields(tail), reason, tail.logprobs)
            if p.include_usage:
                yield _sse({**chunk, "choices": [], "usage": self._usage(p, pipe)})
        except APIError as e:
            yield _sse(e.body())
        yield "data: [DONE]\n\n"

    async def completion(self, request: Request) -> Response:
        req = self._validate(CompletionRequest, await self._read_json(request))
        p = self._prepare_completion(req)
        base = {"id": p.request_id, "created": int(time.time()), "model": self.cfg.served_model_name}
        want_lps = req.logprobs is not None
        if p.stream:
            return self._sse(self._completion_stream(p, base, want_lps))
        total, reason, pipe = await self._collect(request, p)
        choice = {"index": 0, "text": total.content, "finish_reason": reason,
                  "logprobs": self._completion_logprobs(total.logprobs) if want_lps else None}
        return JSONResponse({**base, "object": "text_completion", "choices": [choice], "usage": self._usage(p, pipe)})

    async def _completion_stream(self, p: Prepared, base: dict[str, Any], want_lps: bool) -> AsyncIterator[str]:
        pipe = self._pipeline(p)
        chunk = {**base, "object": "text_completion"}
        text_event = _TextEvent(chunk, 'choices": [{"index": 0, "text": ', ', "finish_reason": null, "logprobs": null}]}')
        logprobs_event = _TextEvent(chunk, 'choices": [{"index": 0, "text": ', ', "finish_reason": null, "logprobs": ',
                                    '}]}')

        def event(d: Delta, reason: str | None) -> str:
            lps = self._completion_logprobs(d.logprobs) if want_lps and d.logprobs else None
            return _sse({**chunk, "choices": [{"index": 0, "text": d.content, "finish_reason": reason,
                                               "logprobs": lps}]})

        try:
            last = None
            async with aclosing(self._outputs(p, pipe)) as outs:
                async for d, r in outs:
                    last = self._tick(last)
                    if r is not None:
                        tail = pipe.finish()
                        yield event(Delta(d.content + tail.content, logprobs=d.logprobs), r)
                        break
                    if want_lps and d.logprobs:
                        yield logprobs_event(d.content, self._completion_logprobs(d.logprobs))
                    elif d.content:
                        yield text_event(d.content)
                    elif d:
                        yield event(d, None)
            if p.include_usage:
                yield _sse({**chunk, "choices": [], "usage": self._usage(p, pipe)})
        except APIError as e:
            yield _sse(e.body())
        yield "data: [DONE]\n\n"

    @staticmethod
    def _sse(gen: AsyncIterator[str]) -> StreamingResponse:
        return _ClosingStreamingResponse(gen, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.cfg.served_model_name, "object": "model", "created": 0,
                                            "owned_by": "nvl72", "max_model_len": self.engine.max_model_len}]}

    def health(self) -> Response:
        try:
            self.engine.stats()
        except Exception as e:  # an unreachable engine is exactly what /health must report
            return JSONResponse({"status": "unhealthy", "error": str(e)}, status_code=503)
        return JSONResponse({"status": "ok"})

    def _auth(self, request: Request) -> None:
        key = self.cfg.api_key
        if key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                               type="authentication_error", code="invalid_api_key")

    # ---- wiring ----------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_: FastAPI):
            yield
            await self.engine.shutdown()

        app = FastAPI(title="nvl72", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
        # Auth is a dependency of the /v1 routes, not an http middleware: Starlette's
        # BaseHTTPMiddleware wraps `receive` and would hide client disconnects from the handlers.
        deps = [Depends(self._auth)]
        @app.exception_handler(APIError)
        async def api_error(_: Request, e: APIError):
            return _error(e)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, e: StarletteHTTPException):
            return _error(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                   type="not_found_error" if e.status_code == 404 else "invalid_request_error"))

        @app.exception_handler(RequestValidationError)
        async def validation_error(_: Request, e: RequestValidationError):
            return _error(APIError(400, str(e.errors()[0].get("msg", e))))

        @app.exception_handler(Exception)
        async def internal_error(request: Request, e: Exception):
            log.exception("internal error on %s", request.url.path)
            return _error(APIError(500, f"internal error: {type(e).__name__}", type="internal_server_error"))

        app.add_api_route("/v1/chat/completions", self.chat, methods=["POST"], dependencies=deps)
        app.add_api_route("/v1/completions", self.completion, methods=["POST"], dependencies=deps)
        app.add_api_route("/v1/models", self.models, methods=["GET"], dependencies=deps)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", lambda: Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST),
                          methods=["GET"])
        return app


class _ClosingStreamingResponse(StreamingResponse):
    """Closes the body generator however the response ends (a disconnect may leave it suspended at a
    yield), so the request's abort runs now rather than at garbage collection."""

    async def stream_response(self, send) -> None:
        async with aclosing(self.body_iterator):
            await super().stream_response(send)


def _add(total: Delta, d: Delta) -> Delta:
    return Delta(total.content + d.content, total.reasoning + d.reasoning, total.tool_calls + d.tool_calls,
                 total.logprobs + d.logprobs)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _TextEvent:
    """`_sse` of `{**chunk, "choices": [...]}` whose varying values are one string and, optionally,
    JSON values after it (a chunk's logprobs), built from fixed text around them (the chunk's
    invariant parts are serialised once, not per token); the same bytes as `_sse`. `after` holds
    the fixed text after the string and after each further value."""

    def __init__(self, chunk: dict[str, Any], before: str, *after: str):
        self._head = f'data: {json.dumps(chunk, ensure_ascii=False)[:-1]}, "{before}'
        self._mids = after[:-1]
        self._tail = after[-1] + "\n\n"

    def __call__(self, text: str, *values: Any) -> str:
        if len(values) != len(self._mids):
            raise ValueError(f"this chunk template takes {len(self._mids)} values after the text, got {len(values)}")
        out = self._head + _encode_str(text)
        for mid, v in zip(self._mids, values):
            out += mid + json.dumps(v, ensure_ascii=False)
        return out + self._tail


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def build_app(engine: EngineClient, tokenizer: Tokenizer, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving `engine` under `config.served_model_name`."""
    return OpenAIServer(engine, tokenizer, config).app
