"""A paced token source standing in for the engine process, to measure the HTTP front alone (perf.front).

    python -m perf.front_source --input ipc://... --output ipc://... --engine-args '{"step_us": 500}'

Not an engine: it runs no model. It speaks the engine process's protocol through the real engine
output path (`nvl72.engine.core.serve_zmq`: ZeroMQ, msgpack) and, every `step_us` microseconds,
emits one step: one new token for each running request (ids drawn from ordinary text tokens), a
request finishing with "length" at its max_tokens. Aborts and shutdown behave as in `EngineCore`.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time

from nvl72.engine.core import serve_zmq
from nvl72.engine.protocol import AbortRequest, AddRequest, LoadReport, Message, RequestOutput, Shutdown


class PacedTokenSource:
    """The `EngineCore` interface `serve_zmq` drives, with a fixed step period instead of a model."""

    def __init__(self, step_us: float, max_model_len: int, vocab_size: int, token_range: tuple[int, int],
                 seed: int = 0):
        if step_us < 0:
            raise ValueError(f"step_us={step_us} is negative")
        self.step_s = step_us * 1e-6
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.lo, self.hi = token_range
        self._rng = random.Random(seed)
        self._left: dict[str, int] = {}  # request id -> tokens still to emit
        self._first: set[str] = set()
        self._next = time.perf_counter()
        self.stopped = False

    @property
    def busy(self) -> bool:
        return bool(self._left)

    def handle(self, msg: Message) -> list[RequestOutput]:
        if isinstance(msg, AddRequest):
            if not self._left:
                self._next = time.perf_counter() + self.step_s
            self._left[msg.request_id] = msg.sampling.max_tokens
            self._first.add(msg.request_id)
            return []
        if isinstance(msg, AbortRequest):
            self._first.discard(msg.request_id)
            return [RequestOutput(msg.request_id, [], "abort")] if self._left.pop(msg.request_id, None) else []
        if isinstance(msg, Shutdown):
            self.stopped = True
            return []
        raise ValueError(f"token source cannot handle a {msg.KIND!r} message")

    def step(self) -> list[RequestOutput]:
        if not self._left:
            return []
        wait = self._next - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        self._next = max(self._next + self.step_s, time.perf_counter())
        outs, rand = [], self._rng.randrange
        for rid, left in list(self._left.items()):
            out = RequestOutput(rid, [rand(self.lo, self.hi)], None)
            if rid in self._first:
                self._first.discard(rid)
                out.queue_time = 0.0
            if left == 1:
                out.finish_reason = "length"
                del self._left[rid]
            else:
                self._left[rid] = left - 1
            outs.append(out)
        return outs

    def load_report(self) -> LoadReport:
        n = len(self._left)
        st = {"running": float(n), "waiting": 0.0, "kv_usage": 0.0, "max_model_len": float(self.max_model_len),
              "vocab_size": float(self.vocab_size)}
        return LoadReport(0, n, 0, 0.0, time.time(), st)

    def close(self) -> list[RequestOutput]:
        outs = [RequestOutput(rid, [], "abort") for rid in self._left]
        self._left.clear()
        return outs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.front_source", description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--engine-args", default="{}", help='JSON: step_us, max_model_len, vocab_size, token_range, seed')
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--report-interval", type=float, default=0.5)
    args = ap.parse_args(argv)
    kw = json.loads(args.engine_args)
    src = PacedTokenSource(float(kw.get("step_us", 500)), int(kw.get("max_model_len", 8192)),
                           int(kw["vocab_size"]), tuple(kw.get("token_range", (1000, 30000))), int(kw.get("seed", 0)))
    serve_zmq(src, args.input, args.output, args.report_interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
