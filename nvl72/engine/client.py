"""`EngineClient` implementations: the engine in a background thread, or in its own process.

Both deliver outputs from a non-asyncio thread (the engine thread, or the ZeroMQ reader thread)
into one stream per request (one `loop.call_soon_threadsafe` per batch of outputs); a consumer that
fell behind gets its pending outputs merged into one. `generate` validates what it can
locally (raising `InvalidRequest` before anything is sent), streams outputs until one carries a
finish_reason, and aborts the request if the consumer stops early.

`start_local_engine(...)` builds either kind from plain arguments.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator

import torch

from nvl72.engine.core import EngineCore, build_engine
from nvl72.engine.engine import InvalidRequest, LLMEngine, validate_request
from nvl72.engine.protocol import (AbortRequest, AddRequest, EngineClient, LoadReport, Message, OutputBatch,
                                   ProtocolError, RequestOutput, Shutdown, merge_outputs)

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread or process is gone (shut down, crashed, or stopped answering)."""


class _Stream:
    """One request's undelivered outputs, appended on its event loop; the consumer takes all of them
    at once (a consumer that fell behind then handles several steps' tokens in one go). An error
    (`fail`) is raised once the outputs before it were taken."""

    __slots__ = ("request_id", "loop", "pending", "error", "waiter")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self.pending: list[RequestOutput] = []
        self.error: Exception | None = None
        self.waiter: asyncio.Future | None = None

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def push(self, out: RequestOutput) -> None:
        self.pending.append(out)
        self._wake()

    def fail(self, error: Exception) -> None:
        self.error = self.error or error
        self._wake()

    async def take(self, timeout: float) -> list[RequestOutput]:
        if not self.pending:  # no timer armed while outputs are waiting
            async with asyncio.timeout(timeout):
                while not self.pending and self.error is None:
                    self.waiter = self.loop.create_future()
                    try:
                        await self.waiter
                    finally:
                        self.waiter = None
            if not self.pending:
                raise self.error
        outs, self.pending = self.pending, []
        return outs

    async def next(self, timeout: float) -> RequestOutput:
        """The request's outputs since the last call, merged into one; TimeoutError naming the
        request when none came within `timeout` seconds."""
        try:
            outs = await self.take(timeout)
        except TimeoutError:
            raise TimeoutError(f"request {self.request_id!r}: no output from the engine in {timeout} s") from None
        return merge_outputs(outs)


def _push_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.push(out)


def _fail_all(items: list[tuple[_Stream, Exception]]) -> None:
    for stream, error in items:
        stream.fail(error)


class OutputStreams:
    """request_id -> _Stream, fed from any thread: one `call_soon_threadsafe` per event loop per
    batch of outputs (an engine step), not per output. Public: nvl72.disagg.serving uses it too."""

    def __init__(self):
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}

    def open(self, request_id: str) -> _Stream:
        s = _Stream(request_id, asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequest(f"duplicate request_id {request_id!r}")
            self._streams[request_id] = s
        return s

    def close(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def deliver(self, outs: list[RequestOutput]) -> None:
        self._dispatch(_push_all, [(o.request_id, o) for o in outs])

    def fail(self, request_ids: list[str], error: Exception) -> None:
        """End these requests' streams with `error` raised to their consumers (after the outputs
        delivered before it)."""
        self._dispatch(_fail_all, [(rid, error) for rid in request_ids])

    def _dispatch(self, apply, items: list[tuple[str, object]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, object]]] = {}
        with self._lock:
            for rid, x in items:
                s = self._streams.get(rid)
                if s is not None:
                    by_loop.setdefault(s.loop, []).append((s, x))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(apply, batch)
            except RuntimeError:  # the consumers' loop is closed
                for s, _ in batch:
                    self.close(s.request_id)

    def fail_all(self, error: str) -> None:
        with self._lock:
            ids = list(self._streams)
        self.deliver([RequestOutput(rid, [], "error", error=error) for rid in ids])


class _StreamingClient(EngineClient):
    def __init__(self, max_model_len: int, vocab_size: int | None, output_timeout: float):
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.output_timeout = output_timeout
        self._streams = OutputStreams()
        self._stats: dict[str, float] = {}
        self._dead: str | None = None

    def _submit(self, msg: Message) -> None:
        raise NotImplementedError

    async def generate(self, request: AddRequest) -> AsyncIterator[RequestOutput]:
        if self._dead:
            raise EngineDeadError(self._dead)
        validate_request(request, self.max_model_len, self.vocab_size)
        rid = request.request_id
        stream = self._streams.open(rid)
        finished = False
        try:
            self._submit(request)
            while True:
                out = await stream.next(self.output_timeout)
                finished = out.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            self._streams.close(rid)
            if not finished and not self._dead:
                try:
                    self._submit(AbortRequest(rid))
                except EngineDeadError:
                    pass  # died meanwhile: nothing left to abort

    async def abort(self, request_id: str) -> None:
        if not self._dead:
            self._submit(AbortRequest(request_id))

    def stats(self) -> dict[str, float]:
        return dict(self._stats)


class ThreadEngineClient(_StreamingClient):
    """The engine loop in a daemon thread of this process (tests, the zero-setup demo)."""

    def __init__(self, engine: LLMEngine, *, report_interval: float = 0.2, output_timeout: float = 600.0):
        super().__init__(engine.config.max_model_len, engine.vocab_size, output_timeout)
        self._core = EngineCore(engine)
        self._inbox: queue.Queue[Message] = queue.Queue()
        self._report_interval = report_interval
        self._stats = self._core.load_report().stats
        self._thread = threading.Thread(target=self._loop, name="nvl72-engine", daemon=True)
        self._thread.start()

    def _submit(self, msg: Message) -> None:
        if self._dead:
            raise EngineDeadError(self._dead)
        self._inbox.put(msg)

    def _loop(self) -> None:
        core, last, dirty = self._core, 0.0, False
        try:
            while not core.stopped:
                try:
                    msg = self._inbox.get_nowait() if core.busy else self._inbox.get(timeout=0.1)
                except queue.Empty:
                    msg = None
                if msg is not None:
                    self._streams.deliver(core.handle(msg))
                    dirty = True
                    continue  # drain the inbox before stepping
                outs = core.step()
                now = time.monotonic()
                # Gauges are refreshed before outputs go out, so a consumer that saw its request
                # finish never reads older counters; while busy at most every report_interval.
                if dirty and (not core.busy or now - last >= self._report_interval):
                    self._stats = core.load_report().stats
                    last, dirty = now, core.busy
                if outs:
                    self._streams.deliver(outs)
                dirty = dirty or bool(outs)
            self._streams.deliver(core.close())
            self._stats = core.load_report().stats
        except Exception as e:  # pragma: no cover - a bug in the loop itself
            log.exception("engine thread died")
            self._dead = f"engine thread died: {type(e).__name__}: {e}"
            self._streams.fail_all(self._dead)
            return
        self._dead = "engine shut down"
        self._streams.fail_all(self._dead)

    async def shutdown(self, timeout: float = 30.0) -> None:
        if self._thread.is_alive():
            self._inbox.put(Shutdown("client shutdown"))
            await asyncio.to_thread(self._thread.join, timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"engine thread did not stop within {timeout} s")


class EngineStartError(RuntimeError):
    """The engine process exited or stayed silent during start-up."""


class ProcessEngineClient(_StreamingClient):
    """The engine core in a child process (`python -m nvl72.engine.core`), over ZeroMQ ipc
    sockets this client binds, msgpack messages (`nvl72.engine.protocol`). `engine_module` is the
    child's entry point (its `main` takes `nvl72.engine.core`'s arguments; perf.front swaps in a
    paced token source to measure the front alone). The child's log (its start-up choices: attention
    backend, CUDA graphs, warm-up; its warnings) is relayed line by line to this process's stderr, where
    the server's own log goes, and kept in a file for the error messages' tails."""

    def __init__(self, engine_args: dict, *, startup_timeout: float = 300.0, heartbeat_timeout: float = 30.0,
                 output_timeout: float = 600.0, report_interval: float = 0.25, engine_module: str = "nvl72.engine.core"):
        import zmq

        from nvl72.engine.protocol import decode

        super().__init__(1, None, output_timeout)
        self._decode = decode
        self._dir = tempfile.mkdtemp(prefix="nvl72-engine-")
        self._ctx = zmq.Context()
        self._push, self._pull = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        self._push.setsockopt(zmq.SNDTIMEO, 5_000)
        self._push.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.LINGER, 0)
        inp, outp = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._push.bind(inp)
        self._pull.bind(outp)
        self._send_lock = threading.Lock()
        self._log_path = os.path.join(self._dir, "engine.log")
        self._log = open(self._log_path, "wb")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", engine_module, "--input", inp, "--output", outp,
             "--engine-args", json.dumps(engine_args), "--report-interval", str(report_interval)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self._relay = threading.Thread(target=self._relay_log, name="nvl72-engine-log", daemon=True)
        self._relay.start()
        self.heartbeat_timeout = heartbeat_timeout
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self._kill()
            self._close()
            raise
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name="nvl72-engine-reader", daemon=True)
        self._reader.start()

    def _relay_log(self) -> None:
        """Until the child closes its output: each line to the log file and to this process's stderr.
        It must keep draining whatever stderr does (a full pipe would block the engine's next log line)."""
        for line in self._proc.stdout:
            self._log.write(line)
            self._log.flush()
            try:
                sys.stderr.write(line.decode(errors="replace"))
                sys.stderr.flush()
            except (OSError, ValueError):  # stderr closed or replaced by something that refuses
                pass

    def _log_tail(self, n: int = 2000) -> str:
        if self._proc.poll() is not None:
            self._relay.join(10)  # an exited child's last lines (its traceback) first
        with open(self._log_path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise EngineStartError(f"engine process exited with code {self._proc.returncode}:\n{self._log_tail()}")
            if self._pull.poll(100):
                msg = self._decode(self._pull.recv())
                if isinstance(msg, LoadReport):
                    self._on_report(msg)
                    log.info("engine process %d ready (max_model_len %d)", self._proc.pid, self.max_model_len)
                    return
        raise EngineStartError(f"engine process sent nothing within {timeout} s:\n{self._log_tail()}")

    def _on_report(self, msg: LoadReport) -> None:
        self._stats = dict(msg.stats)
        self.max_model_len = int(msg.stats.get("max_model_len", self.max_model_len))
        self.vocab_size = int(msg.stats["vocab_size"]) if msg.stats.get("vocab_size") else None
        self._last_beat = time.monotonic()

    def _read_loop(self) -> None:
        while not self._stop.is_set():
            if self._pull.poll(100):
                try:
                    msg = self._decode(self._pull.recv())
                except ProtocolError as e:
                    log.error("dropping undecodable message from the engine: %s", e)
                    continue
                if isinstance(msg, OutputBatch):
                    self._streams.deliver(msg.outputs)
                elif isinstance(msg, RequestOutput):
                    self._streams.deliver([msg])
                elif isinstance(msg, LoadReport):
                    self._on_report(msg)
                continue
            why = None
            if self._proc.poll() is not None:
                why = f"engine process exited with code {self._proc.returncode}"
            elif time.monotonic() - self._last_beat > self.heartbeat_timeout:
                why = f"engine process silent for {self.heartbeat_timeout} s"
            if why:
                if self._proc.returncode == 0:  # a Shutdown or a signal (see nvl72.engine.core.stop_on_signals)
                    log.info("%s", why)
                else:
                    log.error("%s:\n%s", why, self._log_tail())
                self._dead = why
                self._streams.fail_all(why)
                return

    def _submit(self, msg: Message) -> None:
        import zmq

        from nvl72.engine.protocol import encode

        if self._dead:
            raise EngineDeadError(self._dead)
        try:
            with self._send_lock:
                self._push.send(encode(msg))
        except zmq.Again:
            raise EngineDeadError("engine process is not taking messages (send timed out)") from None

    def _kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)

    async def shutdown(self, timeout: float = 30.0) -> None:
        if self._proc.poll() is None and not self._dead:
            try:
                self._submit(Shutdown("client shutdown"))
            except EngineDeadError:
                pass
            try:
                await asyncio.to_thread(self._proc.wait, timeout)
            except subprocess.TimeoutExpired:
                log.error("engine process %d ignored shutdown for %s s; killing it", self._proc.pid, timeout)
        self._kill()
        self._stop.set()
        await asyncio.to_thread(self._reader.join, 5)
        self._dead = self._dead or "engine shut down"
        self._streams.fail_all(self._dead)
        self._close()

    def _close(self) -> None:
        """Close the sockets and the log (once the exited child's last lines are relayed), remove the
        socket folder."""
        self._push.close()
        self._pull.close()
        self._ctx.term()
        self._relay.join(10)
        self._proc.stdout.close()
        self._log.close()
        for name in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, name))
        os.rmdir(self._dir)


def start_local_engine(model: str | None = None, load_format: str = "auto", dtype: str | torch.dtype = "auto",
                       device: str = "auto", max_model_len: int | None = None, num_speculative_tokens: int = 0,
                       max_num_seqs: int = 64, *, process: bool = False, **kv_options) -> EngineClient:
    """An engine on this machine. `model=None` -> the embedded default config with dummy weights.
    `process=True` runs the engine core in a child process over ZeroMQ, else in a thread.
    `kv_options`: the rest of `nvl72.engine.core.build_engine`'s keywords (page_size, num_pages,
    kv_cache_bytes, num_state_slots, max_num_batched_tokens, enable_prefix_caching, ...)."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    args = dict(model=model, load_format=load_format, dtype=dtype, device=device, max_model_len=max_model_len,
                num_speculative_tokens=num_speculative_tokens, max_num_seqs=max_num_seqs, **kv_options)
    if process:
        return ProcessEngineClient(args)
    return ThreadEngineClient(build_engine(**args))
