"""Data-parallel routing: one front over several engines (one per GPU / decode rank).

Each new request goes to the engine with the fewest requests this router has in flight there
(exact and immediate, unlike engine load reports, which lag by a report interval), among those under
`max_inflight_per_engine`; ties go to the lowest index. Aborts follow the request to its engine.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from nvl72.engine.protocol import AddRequest, EngineClient, RequestOutput

# stats() keys summed over engines; every other numeric key is averaged (usage fractions, rates).
_SUMMED = ("running", "waiting", "num_requests_running", "num_requests_waiting", "num_running", "num_waiting",
           "kv_pages_total", "kv_pages_used", "state_slots_used", "prefix_cache_queries", "prefix_cache_hits",
           "num_preemptions", "prompt_tokens", "generation_tokens", "spec_decode_num_drafts",
           "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


class RouterFull(RuntimeError):
    """Every engine already holds `max_inflight_per_engine` requests from this router."""


class LeastLoadedRouter(EngineClient):
    def __init__(self, engines: Sequence[EngineClient], max_inflight_per_engine: int | None = None):
        if not engines:
            raise ValueError("LeastLoadedRouter needs at least one engine")
        if max_inflight_per_engine is not None and max_inflight_per_engine < 1:
            raise ValueError(f"max_inflight_per_engine={max_inflight_per_engine} must be >= 1")
        self.engines = list(engines)
        self.max_model_len = min(e.max_model_len for e in self.engines)
        self.max_inflight = max_inflight_per_engine
        self.inflight = [0] * len(self.engines)
        self._owner: dict[str, int] = {}

    def pick(self) -> int:
        """Index of the engine the next request goes to."""
        i = min(range(len(self.engines)), key=lambda k: (self.inflight[k], k))
        if self.max_inflight is not None and self.inflight[i] >= self.max_inflight:
            raise RouterFull(f"all {len(self.engines)} engines hold {self.max_inflight} requests")
        return i

    async def generate(self, request: AddRequest) -> AsyncIterator[RequestOutput]:
        i = self.pick()
        self.inflight[i] += 1
        self._owner[request.request_id] = i
        it = self.engines[i].generate(request)
        try:
            async for out in it:
                yield out
        finally:
            await it.aclose()
            self.inflight[i] -= 1
            self._owner.pop(request.request_id, None)

    async def abort(self, request_id: str) -> None:
        i = self._owner.get(request_id)
        if i is not None:
            await self.engines[i].abort(request_id)

    def stats(self) -> dict[str, float]:
        per = [e.stats() for e in self.engines]
        keys = {k for s in per for k in s}
        out = {}
        for k in keys:
            vals = [float(s[k]) for s in per if k in s]
            out[k] = sum(vals) if k in _SUMMED else sum(vals) / len(vals)
        if out.get("spec_decode_num_draft_tokens"):
            out["spec_decode_acceptance_rate"] = out["spec_decode_num_accepted_tokens"] / out["spec_decode_num_draft_tokens"]
        return out

    async def shutdown(self) -> None:
        for e in self.engines:
            await e.shutdown()
