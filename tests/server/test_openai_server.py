"""The official `openai` client (and raw HTTP) against a live server over the fake engine."""
import json
import time

import httpx
import openai
import pytest

from nvl72.server.app import ServerConfig, build_app
from nvl72.server.runner import ServerThread
from nvl72.tokenizer import Tokenizer
from tests.server.fake_engine import FakeEngine

MODEL, KEY = "nvl72-test", "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.qwen(151936)


@pytest.fixture(scope="module")
def engine(tok):
    return FakeEngine(tok, max_model_len=2048)


@pytest.fixture(scope="module")
def server(engine, tok):
    cfg = ServerConfig(served_model_name=MODEL, api_key=KEY, max_body_bytes=64 << 10)
    with ServerThread(build_app(engine, tok, cfg)) as s:
        yield s


@pytest.fixture()
def client(server, engine):
    engine.token_delay = 0.0
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=30, max_retries=0)


def chat(client, text, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], **kw)


def stream_chat(client, text, **kw):
    chunks = list(chat(client, text, stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    return chunks, content, reasoning


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = httpx.get(server.url + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_chat_completion(client, tok):
    r = chat(client, "say: Hello there, wörld 🫠!")
    assert r.choices[0].message.content == " Hello there, wörld 🫠!"
    assert r.choices[0].finish_reason == "stop" and r.object == "chat.completion"
    assert r.usage.completion_tokens == len(tok.encode(" Hello there, wörld 🫠!")) + 1  # + EOS
    prompt = tok.apply_chat_template([{"role": "user", "content": "say: Hello there, wörld 🫠!"}])
    assert r.usage.prompt_tokens == len(tok.encode(prompt))


def test_completion(client, engine):
    r = client.completions.create(model=MODEL, prompt="Repeat after me. say: the quick fox", max_tokens=50)
    assert r.choices[0].text == " the quick fox" and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="no instruction", max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    assert r.choices[0].text == "".join(engine.tok.decode(engine.words[:5]))


def test_streaming_with_usage_and_cached_tokens(client, tok):
    text = "say: " + "streamed words with ünïcode 東京 " * 8
    full = chat(client, text).choices[0].message.content
    chunks, content, _ = stream_chat(client, text, stream_options={"include_usage": True})
    assert content == full and len(chunks) > 10
    assert chunks[-2].choices[0].finish_reason == "stop"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens > 10
    assert usage.prompt_tokens_details.cached_tokens >= 16  # same prompt seen just before
    c = client.completions.create(model=MODEL, prompt="say: abc def", stream=True, max_tokens=20,
                                  stream_options={"include_usage": True})
    parts = list(c)
    assert "".join(p.choices[0].text for p in parts if p.choices) == " abc def"
    assert parts[-1].usage.completion_tokens == len(tok.encode(" abc def")) + 1  # + EOS


def test_tool_calls(client):
    said = ('say: I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    r = chat(client, said, tools=TOOLS)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert m.content == " I will check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    chunks, content, _ = stream_chat(client, said, tools=TOOLS)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, "get_weather", {"city": "Paris"}), (1, "get_weather", {"city": "Oslo"})]
    assert content == " I will check." and chunks[-1].choices[0].finish_reason == "tool_calls"
    # Without tools in the request, the same text stays content.
    assert "<tool_call>" in chat(client, said).choices[0].message.content
    # The tool round trip renders: assistant tool_calls + tool result.
    r = client.chat.completions.create(model=MODEL, tools=TOOLS, messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [m.tool_calls[0].model_dump()]},
        {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "21 C"},
        {"role": "user", "content": "say: done"}])
    assert r.choices[0].message.content == " done"


def test_stop_strings(client, engine):
    r = chat(client, "say: one two three four five", stop=["three", "xyz"])
    assert r.choices[0].message.content == " one two " and r.choices[0].finish_reason == "stop"
    assert engine.requests[-1].request_id in engine.aborted  # the engine request was cut short
    _, content, _ = stream_chat(client, "say: one two three four five", stop="thr")
    assert content == " one two "
    r = client.completions.create(model=MODEL, prompt="say: a-b-c-d", stop=["-c"], max_tokens=20)
    assert r.choices[0].text == " a-b"


def test_seeded_sampling_reproducible(client):
    def sample(seed):
        return chat(client, "tell me something", seed=seed, temperature=1.0, max_tokens=24).choices[0].message.content

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_reasoning_separation(client):
    said = "say: <think>\nfirst I plan\n</think>\n\nthe answer"
    m = chat(client, said).choices[0].message
    assert m.content == "the answer" and m.reasoning_content.strip() == "first I plan"
    _, content, reasoning = stream_chat(client, said)
    assert content == "the answer" and reasoning.strip() == "first I plan"
    # thinking off: the template closes the think block, the reply is plain content.
    r = chat(client, "say: plain", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == " plain" and r.choices[0].message.reasoning_content is None


def test_logprobs(client):
    r = chat(client, "say: a b c", logprobs=True, top_logprobs=2)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in lp)
    assert "".join(e.token for e in lp[:-1]) == " a b c"


def test_streaming_logprobs_and_completion_logprobs(client):
    chunks = list(chat(client, "say: x y", logprobs=True, top_logprobs=1, stream=True))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 3 and all(len(e.top_logprobs) == 2 for e in entries)  # " x", " y", EOS
    r = client.completions.create(model=MODEL, prompt="say: p q", logprobs=2, max_tokens=10)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    assert all(len(t) == 3 for t in lp.top_logprobs) and "".join(lp.tokens[:-1]) == " p q"


def test_developer_role_and_max_completion_tokens(client, tok):
    r = client.chat.completions.create(model=MODEL, max_completion_tokens=3, temperature=0, messages=[
        {"role": "developer", "content": "be terse"}, {"role": "user", "content": "count"}])
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    prompt = tok.apply_chat_template([{"role": "system", "content": "be terse"}, {"role": "user", "content": "count"}])
    assert r.usage.prompt_tokens == len(tok.encode(prompt))


def _raw(server, body, path="/v1/chat/completions", headers=AUTH):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, headers={**headers, "Content-Type": "application/json"},
                      timeout=30)


MSG = [{"role": "user", "content": "hi"}]
BAD = {
    "malformed_json": (b'{"model": "nvl72-test", "messages": [', 400, None),
    "not_an_object": (b"[1, 2]", 400, None),
    "unknown_model": ({"model": "gpt-9", "messages": MSG}, 404, "model"),
    "missing_messages": ({"model": MODEL}, 400, "messages"),
    "empty_messages": ({"model": MODEL, "messages": []}, 400, "messages"),
    "unknown_role": ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    "content_not_text": ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    "max_tokens_zero": ({"model": MODEL, "messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens_negative": ({"model": MODEL, "messages": MSG, "max_tokens": -5}, 400, "max_tokens"),
    "max_tokens_absurd": ({"model": MODEL, "messages": MSG, "max_tokens": 10**15}, 400, "max_tokens"),
    "max_tokens_string": ({"model": MODEL, "messages": MSG, "max_tokens": "many"}, 400, "max_tokens"),
    "prompt_too_long": ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}]}, 400, "messages"),
    "temperature_negative": ({"model": MODEL, "messages": MSG, "temperature": -0.1}, 400, "temperature"),
    "temperature_high": ({"model": MODEL, "messages": MSG, "temperature": 2.5}, 400, "temperature"),
    "top_p_zero": ({"model": MODEL, "messages": MSG, "top_p": 0}, 400, "top_p"),
    "top_p_high": ({"model": MODEL, "messages": MSG, "top_p": 1.5}, 400, "top_p"),
    "top_k_bad": ({"model": MODEL, "messages": MSG, "top_k": -7}, 400, "top_k"),
    "min_p_bad": ({"model": MODEL, "messages": MSG, "min_p": 1.5}, 400, "min_p"),
    "presence_penalty_bad": ({"model": MODEL, "messages": MSG, "presence_penalty": 3}, 400, "presence_penalty"),
    "repetition_penalty_bad": ({"model": MODEL, "messages": MSG, "repetition_penalty": 0}, 400,
                               "repetition_penalty"),
    "n_two": ({"model": MODEL, "messages": MSG, "n": 2}, 400, "n"),
    "seed_huge": ({"model": MODEL, "messages": MSG, "seed": 2**70}, 400, "seed"),
    "top_logprobs_bad": ({"model": MODEL, "messages": MSG, "logprobs": True, "top_logprobs": 50}, 400,
                         "top_logprobs"),
    "stop_empty": ({"model": MODEL, "messages": MSG, "stop": [""]}, 400, "stop"),
    "stop_token_out_of_vocab": ({"model": MODEL, "messages": MSG, "stop_token_ids": [10**9]}, 400,
                                "stop_token_ids"),
    "tool_choice_required": ({"model": MODEL, "messages": MSG, "tools": TOOLS, "tool_choice": "required"}, 400,
                             "tool_choice"),
    "image_part": ({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages.0.content.0"),
    "oversized_body": ({"model": MODEL, "messages": [{"role": "user", "content": "x" * (80 << 10)}]}, 413, None),
}
BAD_COMPLETION = {
    "prompt_ids_out_of_vocab": ({"model": MODEL, "prompt": [1, 2, 999999999]}, 400, "prompt"),
    "prompt_empty": ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    "prompt_batch": ({"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    "missing_prompt": ({"model": MODEL}, 400, "prompt"),
    "completion_max_tokens_negative": ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
}


def _check_error(r, status, param):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_chat_input(server, name):
    body, status, param = BAD[name]
    _check_error(_raw(server, body), status, param)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("name", sorted(BAD_COMPLETION))
def test_bad_completion_input(server, name):
    body, status, param = BAD_COMPLETION[name]
    _check_error(_raw(server, body, "/v1/completions"), status, param)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_auth_and_unknown_routes(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        _check_error(_raw(server, {"model": MODEL, "messages": MSG}, headers=headers), 401, None)
    _check_error(httpx.get(server.url + "/v1/nothing", headers=AUTH, timeout=10), 404, None)
    _check_error(httpx.get(server.url + "/v1/chat/completions", headers=AUTH, timeout=10), 405, None)
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=MSG)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        chat(client, "hi", temperature=-1)
    assert chat(client, "say: still up").choices[0].message.content == " still up"


def _wait(cond, timeout=10.0, what=lambda: ""):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"condition not met in time {what()}"
        time.sleep(0.02)


def test_stream_disconnect_aborts(server, engine):
    engine.token_delay = 0.01
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 1000,
            "temperature": 1.0, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
    rid = engine.requests[-1].request_id
    _wait(lambda: rid in engine.aborted and rid not in engine.running)


def test_nonstream_disconnect_aborts(server, engine):
    engine.token_delay = 0.01
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 1000}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=0.5)
    rid = engine.requests[-1].request_id
    _wait(lambda: rid in engine.aborted and rid not in engine.running,
          what=lambda: (rid, engine.aborted[-3:], engine.running, len(engine.requests)))


def test_metrics(client, server):
    for _ in range(2):  # the second hits the first's whole prompt pages (whatever ran before this test)
        chat(client, "say: metrics please " + "and more metrics " * 20)
    text = httpx.get(server.url + "/metrics", timeout=10).text

    def value(name):
        line = next(x for x in text.splitlines() if x.startswith(name + "{") or x.startswith(name + " "))
        return float(line.rsplit(" ", 1)[1])

    assert value("nvl72:time_to_first_token_seconds_count") >= 1
    assert value("nvl72:e2e_request_latency_seconds_count") >= 1
    assert value("nvl72:inter_token_latency_seconds_count") >= 1
    assert value("nvl72:prompt_tokens_total") > 0 and value("nvl72:generation_tokens_total") > 0
    assert value("nvl72:prefix_cache_queries_total") >= value("nvl72:prefix_cache_hits_total") > 0
    assert value("nvl72:kv_cache_usage_perc") == 0.125
    assert value("nvl72:num_requests_running") == 0 and value("nvl72:num_requests_waiting") == 0
    assert value("nvl72:spec_decode_num_draft_tokens_total") > value("nvl72:spec_decode_num_accepted_tokens_total") > 0
