"""EngineClient implementations: in-process thread and separate process over ZeroMQ."""
import asyncio

import pytest

from nvl72.engine.client import EngineDeadError, ProcessEngineClient, ThreadEngineClient, start_local_engine
from nvl72.engine.engine import InvalidRequest
from nvl72.engine.protocol import AddRequest, SamplingParams
from tests.engine.tiny import make_engine, prompts, run_all

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


async def collect(client, req):
    toks, last = [], None
    async for out in client.generate(req):
        toks.extend(out.new_token_ids)
        last = out
    return toks, last


def test_thread_client_streams_equal_engine():
    ps = prompts(4, seed=6)
    want = run_all(make_engine("qwen3_next"), ps, GREEDY)

    async def main():
        client = ThreadEngineClient(make_engine("qwen3_next"))
        try:
            got = await asyncio.wait_for(asyncio.gather(
                *[collect(client, AddRequest(f"r{i}", p, GREEDY)) for i, p in enumerate(ps)]), 60)
            with pytest.raises(InvalidRequest, match="temperature=-1.0"):
                await collect(client, AddRequest("bad", [1], SamplingParams(temperature=-1.0)))
            st = client.stats()
        finally:
            await client.shutdown()
        return got, st
    got, st = asyncio.run(main())
    for i, (toks, last) in enumerate(got):
        assert toks == list(want[f"r{i}"][0]) and last.finish_reason == "length"
        assert last.num_prompt_tokens == len(ps[i])
    assert st["generation_tokens"] == 4 * 8 and st["prompt_tokens"] == sum(map(len, ps))
    assert st["running"] == 0 and st["waiting"] == 0


def test_thread_client_abort_and_early_close_free_everything():
    async def main():
        engine = make_engine("qwen3_moe")
        client = ThreadEngineClient(engine)
        try:
            long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
            gen = client.generate(AddRequest("a", [5, 6, 7], long))
            first = await asyncio.wait_for(gen.__anext__(), 30)
            assert first.finish_reason is None
            await client.abort("a")
            rest = [o async for o in gen]
            assert rest[-1].finish_reason == "abort"
            # Closing a stream early (client disconnect) aborts its request.
            gen2 = client.generate(AddRequest("b", [8, 9], long))
            await asyncio.wait_for(gen2.__anext__(), 30)
            await gen2.aclose()
            for _ in range(100):
                if not engine.seqs:
                    break
                await asyncio.sleep(0.05)
            assert not engine.seqs
        finally:
            await client.shutdown()
        assert engine.pages.num_free == engine.pages.size
        with pytest.raises(EngineDeadError):
            await collect(client, AddRequest("c", [1], GREEDY))
    asyncio.run(main())


@pytest.mark.mp
def test_process_client_roundtrip_and_shutdown(capfd):
    args = dict(max_model_len=64, max_num_seqs=4, page_size=4, num_pages=64, max_num_batched_tokens=32,
                num_speculative_tokens=2, dtype="float32", device="cpu")

    async def main():
        client = await asyncio.to_thread(start_local_engine, None, process=True, **args)
        assert isinstance(client, ProcessEngineClient)
        try:
            ps = [[3, 4, 5, 6, 7], [9, 8, 7]]
            got = await asyncio.wait_for(asyncio.gather(
                *[collect(client, AddRequest(f"p{i}", p, GREEDY)) for i, p in enumerate(ps)]), 120)
            # no heartbeat wait: the engine reports when it goes idle, before the last outputs
            st = client.stats()
            with pytest.raises(InvalidRequest, match="max_model_len=64"):
                await collect(client, AddRequest("long", [1] * 64, GREEDY))
            proc = client._proc
        finally:
            await asyncio.wait_for(client.shutdown(), 60)
        return got, st, proc
    got, st, proc = asyncio.run(main())
    thread = start_local_engine(None, **args)
    want = asyncio.run(_run_thread(thread, [[3, 4, 5, 6, 7], [9, 8, 7]]))
    for (toks, last), w in zip(got, want):
        assert toks == w and last.finish_reason in ("length", "stop")
    assert st["generation_tokens"] == sum(len(t) for t, _ in got)
    assert st["spec_decode_num_draft_tokens"] > 0
    assert proc.poll() == 0, "engine process did not exit cleanly"
    # the engine's start-up choices reach the server's stderr (its log), not only a temporary file
    err = capfd.readouterr().err
    assert "engine[0] INFO" in err and "attention backend: torch" in err


async def _run_thread(client, ps):
    try:
        return [(await collect(client, AddRequest(f"p{i}", p, GREEDY)))[0] for i, p in enumerate(ps)]
    finally:
        await client.shutdown()


async def _process_engine() -> ProcessEngineClient:
    return await asyncio.to_thread(start_local_engine, None, dtype="float32", device="cpu", max_model_len=4000,
                                   max_num_seqs=2, page_size=16, num_pages=260, process=True)


async def _long_stream(client, rid: str):
    """(the stream, its first output) of a request that would run for minutes."""
    gen = client.generate(AddRequest(rid, [5, 6, 7], SamplingParams(max_tokens=3900, temperature=0.0, ignore_eos=True)))
    return gen, await asyncio.wait_for(gen.__anext__(), 60)


@pytest.mark.mp
def test_process_client_detects_dead_engine():
    """A killed engine process ends in-flight streams with 'error'; later calls fail fast."""
    async def main():
        client = await _process_engine()
        try:
            gen, first = await _long_stream(client, "k")
            assert first.finish_reason is None
            client._proc.kill()
            last = first
            async for out in gen:
                last = out
            assert last.finish_reason == "error" and "exited" in last.error
            with pytest.raises(EngineDeadError, match="exited"):
                await collect(client, AddRequest("after", [1], GREEDY))
        finally:
            await asyncio.wait_for(client.shutdown(), 30)
    asyncio.run(asyncio.wait_for(main(), 120))


@pytest.mark.mp
def test_process_engine_stops_cleanly_on_sigterm(caplog):
    """srun / mpirun / Ctrl-C signal the front and the engine process together: the engine ends its
    serving loop after the step, aborts what is open (the stream ends 'abort'), exits 0, and the
    client logs no error; later calls fail fast."""
    import logging
    import signal

    async def main():
        client = await _process_engine()
        try:
            gen, last = await _long_stream(client, "t")
            client._proc.send_signal(signal.SIGTERM)
            async for out in gen:
                last = out
            assert last.finish_reason == "abort", last
            assert await asyncio.to_thread(client._proc.wait, 30) == 0
            for _ in range(100):  # the reader notices the exit within its 0.1 s poll
                if client._dead:
                    break
                await asyncio.sleep(0.05)
            with pytest.raises(EngineDeadError, match="exited with code 0"):
                await collect(client, AddRequest("after", [1], GREEDY))
        finally:
            await asyncio.wait_for(client.shutdown(), 30)
    with caplog.at_level(logging.INFO, logger="nvl72.engine.client"):
        asyncio.run(asyncio.wait_for(main(), 120))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
