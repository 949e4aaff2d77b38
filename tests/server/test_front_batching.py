"""The front's batched output path: one message per engine step, merged outputs for a consumer that
fell behind, exact usage at stop strings, SSE chunks built from templates, and the perf.front harness."""
import asyncio
import json
import random
import socket
import threading

import pytest

from nvl72.engine.client import OutputStreams
from nvl72.engine.protocol import OutputBatch, RequestOutput, TokenLogprob, decode, encode, merge_outputs
from nvl72.server.app import OutputPipeline, _sse, _TextEvent
from nvl72.tokenizer import Tokenizer
from perf.front_source import PacedTokenSource


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.qwen(151936)


def _lps(ids, rng):
    return [TokenLogprob(t, -rng.random(), [(t, -0.5), (rng.randrange(1000), -2.0)]) for t in ids]


def test_output_batch_round_trip():
    rng = random.Random(3)
    outs = [RequestOutput(f"r{i}", [rng.randrange(1 << 17) for _ in range(rng.randrange(0, 4))],
                          rng.choice([None, "stop", "length"]), rng.randrange(100), rng.randrange(50),
                          _lps([5, 6], rng) if i % 2 else None, None, rng.choice([None, 0.25]))
            for i in range(7)]
    got = decode(encode(OutputBatch(outs)))
    assert isinstance(got, OutputBatch) and got.outputs == outs
    assert decode(encode(outs[1])) == outs[1]  # single outputs still decode (disagg ranks send them)


def test_merge_outputs_stops_at_finish():
    rng = random.Random(5)
    a = RequestOutput("r", [1, 2], None, 9, 0, _lps([1, 2], rng), queue_time=0.5)
    b = RequestOutput("r", [3], None, 9, 16)
    c = RequestOutput("r", [4], "length", 9, 16, _lps([4], rng))
    d = RequestOutput("r", [], "error", error="late")
    m = merge_outputs([a, b, c, d])
    assert m.new_token_ids == [1, 2, 3, 4] and m.finish_reason == "length" and m.error is None
    assert m.queue_time == 0.5 and m.num_cached_tokens == 16 and m.logprobs == a.logprobs + c.logprobs
    assert merge_outputs([b]) is b


def test_streams_merge_pending_outputs():
    async def run():
        streams = OutputStreams()
        s = streams.open("r")
        other = streams.open("q")
        outs = [RequestOutput("r", [i]) for i in range(5)] + [RequestOutput("q", [9], "stop")]
        t = threading.Thread(target=streams.deliver, args=(outs,))
        t.start()
        t.join()
        got = await s.take(5.0)
        assert [o.new_token_ids for o in got] == [[i] for i in range(5)]
        assert (await other.take(5.0))[0].finish_reason == "stop"
        with pytest.raises(TimeoutError):
            await s.take(0.05)
        streams.fail_all("gone")
        assert (await s.take(5.0))[0].finish_reason == "error"

    asyncio.run(run())


@pytest.mark.parametrize("chunked", [False, True])
def test_stop_string_usage_exact_with_merged_outputs(tok, chunked):
    ids = tok.encode(" one two three four five")
    rng = random.Random(1)
    lps = _lps(ids, rng)
    pipe = OutputPipeline(tok, ["three", "xyz"], True, None, None)
    if chunked:  # one output per token, as a consumer that keeps up sees them
        text = ""
        for i, t in enumerate(ids):
            text += pipe.step(RequestOutput("r", [t], logprobs=lps[i:i + 1])).content
            if pipe.stopped:
                break
    else:
        d = pipe.step(RequestOutput("r", ids, logprobs=lps))
        text = d.content
        assert d.logprobs == lps[:pipe.num_output_tokens]
    three = next(n for n in range(1, len(ids) + 1) if "three" in tok.decode(ids[:n]))
    assert text + pipe.finish().content == " one two " and pipe.stopped
    assert pipe.num_output_tokens == three


def test_text_event_equals_sse():
    rng = random.Random(7)
    chunk = {"id": "chatcmpl-1", "created": 17, "model": "m\u00e9 \"x\"", "object": "chat.completion.chunk"}
    chat = _TextEvent(chunk, 'choices": [{"index": 0, "delta": {"content": ',
                      '}, "finish_reason": null, "logprobs": null}]}')
    cmpl = _TextEvent(chunk, 'choices": [{"index": 0, "text": ', ', "finish_reason": null, "logprobs": null}]}')
    for _ in range(500):
        s = "".join(chr(rng.choice([rng.randrange(0, 128), rng.randrange(128, 0xD7FF), 0x1F600, 0x2028]))
                    for _ in range(rng.randrange(1, 10)))
        assert chat(s) == _sse({**chunk, "choices": [{"index": 0, "delta": {"content": s}, "finish_reason": None,
                                                      "logprobs": None}]})
        assert cmpl(s) == _sse({**chunk, "choices": [{"index": 0, "text": s, "finish_reason": None,
                                                      "logprobs": None}]})
        assert json.loads(cmpl(s)[6:])["choices"][0]["text"] == s


def test_paced_token_source():
    from nvl72.engine.protocol import AbortRequest, AddRequest, SamplingParams, Shutdown

    src = PacedTokenSource(100, 4096, 151936, (1000, 30000))
    src.handle(AddRequest("a", [1, 2], SamplingParams(max_tokens=3)))
    src.handle(AddRequest("b", [1], SamplingParams(max_tokens=5)))
    steps = [src.step() for _ in range(3)]
    assert [len(s) for s in steps] == [2, 2, 2] and steps[0][0].queue_time == 0.0 and steps[1][0].queue_time is None
    assert steps[2][0].finish_reason == "length" and steps[2][1].finish_reason is None
    assert all(1000 <= o.new_token_ids[0] < 30000 for s in steps for o in s)
    assert src.handle(AbortRequest("b"))[0].finish_reason == "abort" and not src.busy
    assert src.handle(AbortRequest("b")) == []
    src.handle(Shutdown())
    assert src.stopped


@pytest.mark.mp
@pytest.mark.timeout(240)
def test_perf_front_runs(capsys):
    from perf import front

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert front.main(["--concurrency", "1,4", "--out-len", "12", "--rounds", "1", "--step-us", "300",
                       "--port", str(port)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("| 1 |") and lines[-1].startswith("| 4 |")
