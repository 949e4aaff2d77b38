"""Least-loaded routing over several engines, alone and behind the HTTP front."""
import asyncio
import concurrent.futures

import httpx
import openai
import pytest

from nvl72.engine.protocol import AddRequest, SamplingParams
from nvl72.server.app import ServerConfig, build_app
from nvl72.server.router import LeastLoadedRouter, RouterFull
from nvl72.server.runner import ServerThread
from nvl72.tokenizer import Tokenizer
from tests.server.fake_engine import FakeEngine


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.qwen(151936)


def _req(i, n=50):
    return AddRequest(f"r{i}", [1, 2, 3, i], SamplingParams(max_tokens=n, temperature=1.0, seed=i))


def test_spreads_aborts_and_bounds(tok):
    engines = [FakeEngine(tok, token_delay=0.005) for _ in range(3)]
    router = LeastLoadedRouter(engines, max_inflight_per_engine=2)

    async def main():
        its = [router.generate(_req(i)) for i in range(6)]
        firsts = [await it.__anext__() for it in its]  # each request placed and producing
        assert all(f.new_token_ids for f in firsts)
        assert router.inflight == [2, 2, 2] and [len(e.requests) for e in engines] == [2, 2, 2]
        with pytest.raises(RouterFull):
            await router.generate(_req(9)).__anext__()
        owner = next(k for k, e in enumerate(engines) if any(r.request_id == "r4" for r in e.requests))
        await router.abort("r4")
        assert "r4" in engines[owner].aborted and all("r4" not in e.aborted for k, e in enumerate(engines) if k != owner)
        for it in its:
            await it.aclose()
        assert router.inflight == [0, 0, 0]

    asyncio.run(asyncio.wait_for(main(), 30))
    s = router.stats()
    assert s["num_requests_running"] == 0 and s["kv_cache_usage_perc"] == 0.125  # summed / averaged
    assert s["spec_decode_num_draft_tokens"] == sum(e.spec_draft for e in engines)


def test_rejects_bad_construction(tok):
    with pytest.raises(ValueError, match="at least one"):
        LeastLoadedRouter([])
    with pytest.raises(ValueError, match="max_inflight_per_engine=0"):
        LeastLoadedRouter([FakeEngine(tok)], max_inflight_per_engine=0)


def test_front_over_router(tok):
    engines = [FakeEngine(tok, max_model_len=1024, token_delay=0.002), FakeEngine(tok, max_model_len=2048)]
    router = LeastLoadedRouter(engines, max_inflight_per_engine=4)
    assert router.max_model_len == 1024
    with ServerThread(build_app(router, tok, ServerConfig(served_model_name="m"))) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", timeout=30, max_retries=0)

        def one(i):
            return c.chat.completions.create(model="m", messages=[{"role": "user", "content": f"say: hello {i}"}])

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(one, range(6)))
        assert [r.choices[0].message.content for r in replies] == [f" hello {i}" for i in range(6)]
        assert sum(len(e.requests) for e in engines) == 6  # placement itself: test_spreads_aborts_and_bounds
        metrics = httpx.get(s.url + "/metrics", timeout=10).text
        assert 'nvl72:kv_cache_usage_perc{model_name="m"} 0.125' in metrics
