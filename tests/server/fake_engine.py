"""A deterministic in-process EngineClient for the front's tests.

The "model" replies with the text after the last `say:` in the prompt (then EOS); without `say:` it
samples word tokens from an RNG seeded by `SamplingParams.seed` (greedy: a fixed sentence). It
emits one token per output with `token_delay` between them, honours max_tokens, stop_token_ids and
abort, and reports a prefix cache (longest common prefix with earlier prompts, 16-token pages).
"""
from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

from nvl72.engine.protocol import AddRequest, EngineClient, RequestOutput, TokenLogprob
from nvl72.tokenizer import Tokenizer

WORDS = " alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"


class FakeEngine(EngineClient):
    def __init__(self, tokenizer: Tokenizer, max_model_len: int = 2048, token_delay: float = 0.0):
        self.tok = tokenizer
        self.max_model_len = max_model_len
        self.token_delay = token_delay
        self.words = tokenizer.encode(WORDS)
        self.requests: list[AddRequest] = []
        self.aborted: list[str] = []
        self.running: set[str] = set()
        self._abort_flags: set[str] = set()
        self._prompts: list[list[int]] = []
        self.spec_draft = self.spec_accepted = 0

    def _reply(self, req: AddRequest) -> list[int]:
        text = self.tok.decode(req.prompt_token_ids)
        i = text.rfind("say:")
        if i >= 0:
            said = text[i + 4:].split("<|im_end|>")[0]
            return self.tok.encode(said)
        s = req.sampling
        if s.greedy:
            return (self.words * (s.max_tokens // len(self.words) + 1))[:s.max_tokens]
        rng = random.Random(s.seed)
        return [rng.choice(self.words) for _ in range(s.max_tokens)]

    def _cached(self, prompt: list[int]) -> int:
        best = 0
        for old in self._prompts:
            n = 0
            while n < min(len(old), len(prompt)) and old[n] == prompt[n]:
                n += 1
            best = max(best, n)
        self._prompts.append(prompt)
        return min(best, len(prompt) - 1) // 16 * 16

    async def generate(self, request: AddRequest) -> AsyncIterator[RequestOutput]:
        rid, s = request.request_id, request.sampling
        self.requests.append(request)
        self.running.add(rid)
        reply = self._reply(request)
        if not s.ignore_eos and s.stop_token_ids:
            reply = reply + [s.stop_token_ids[0]]
        meta = dict(num_prompt_tokens=len(request.prompt_token_ids),
                    num_cached_tokens=self._cached(request.prompt_token_ids))
        finished = False
        try:
            for n, tid in enumerate(reply[:s.max_tokens], start=1):
                await asyncio.sleep(self.token_delay)
                if rid in self._abort_flags:
                    finished = True
                    yield RequestOutput(rid, [], "abort", **meta)
                    return
                self.spec_draft += 2
                self.spec_accepted += 1
                lps = None
                if s.logprobs is not None:
                    top = [(tid, -0.25)] + [(w, -3.0 - k) for k, w in enumerate(self.words[:s.logprobs])]
                    lps = [TokenLogprob(tid, -0.25, top[:s.logprobs + 1])]
                reason = "stop" if tid in s.stop_token_ids else ("length" if n == s.max_tokens else None)
                finished = reason is not None
                yield RequestOutput(rid, [tid], reason, logprobs=lps, **meta)
                if finished:
                    return
            finished = True
            yield RequestOutput(rid, [], "stop", **meta)
        finally:
            self.running.discard(rid)
            if not finished and rid not in self.aborted:
                self.aborted.append(rid)

    async def abort(self, request_id: str) -> None:
        self._abort_flags.add(request_id)
        if request_id not in self.aborted:
            self.aborted.append(request_id)

    def stats(self) -> dict[str, float]:
        return {"num_requests_running": len(self.running), "num_requests_waiting": 0,
                "kv_cache_usage_perc": 0.125, "spec_decode_num_draft_tokens": self.spec_draft,
                "spec_decode_num_accepted_tokens": self.spec_accepted}
