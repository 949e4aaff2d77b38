"""The front over the real engine (embedded tiny Qwen3.5-MoE preset, dummy weights, CPU thread
engine), driven by the official openai client; and `nvl72 serve` as a subprocess."""
import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from nvl72.commands.serve import load_tokenizer
from nvl72.engine.client import start_local_engine
from nvl72.parallel import free_port
from nvl72.presets import DEFAULT_MODEL_NAME
from nvl72.server.app import ServerConfig, build_app
from nvl72.server.runner import ServerThread

MODEL = DEFAULT_MODEL_NAME


@pytest.fixture(scope="module", params=["cpu", "cpu-async", pytest.param("cuda", marks=pytest.mark.gpu)])
def engine(request):
    """cpu-async: async scheduling forced on (stop strings, streams, disconnects one step late);
    on CUDA it is on by default (CUDA graphs)."""
    device, _, mode = request.param.partition("-")
    eng = start_local_engine(device=device, max_model_len=512, max_num_seqs=8,
                             async_scheduling=True if mode == "async" else None)
    yield eng
    asyncio.run(eng.shutdown())


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(build_app(engine, load_tokenizer(None), ServerConfig(served_model_name=MODEL))) as s:
        yield s


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


PROMPT = [{"role": "user", "content": "Tell me a long story about a dragon who learns to read books."}]


def test_greedy_chat_stream_equals_nonstream_and_prefix_cache_hits(client):
    a = client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=12, temperature=0)
    assert a.choices[0].finish_reason in ("length", "stop") and 1 <= a.usage.completion_tokens <= 12
    chunks = list(client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join((c.choices[0].delta.content or "") + (getattr(c.choices[0].delta, "reasoning_content", None) or "")
                   for c in chunks if c.choices)
    msg = a.choices[0].message
    assert text == (msg.reasoning_content or "") + (msg.content or "")
    usage = chunks[-1].usage
    assert usage.completion_tokens == a.usage.completion_tokens and usage.prompt_tokens == a.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 16  # same prompt again: whole pages from the prefix cache


def test_seeded_sampling_reproducible(client):
    def sample(seed):
        r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0,
                                      seed=seed, extra_body={"ignore_eos": True})
        return r.choices[0].text, r.usage.completion_tokens

    first = sample(11)
    assert first == sample(11) and first[1] == 10


def test_stop_string_cuts_real_output(client, engine):
    full = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    k = len(full) // 2
    stop = full[k:k + 2]
    assert stop.strip(), f"greedy output {full!r} gives no usable stop string"
    r = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=16, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:full.find(stop)] and r.choices[0].finish_reason == "stop"


def test_bad_input_and_disconnect(server, client, engine):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "word " * 600}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(server.url + "/v1/completions", timeout=30, json={"model": MODEL, "prompt": "x", "top_p": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    body = {"model": MODEL, "prompt": "go", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        assert any(next(lines).startswith("data: ") for _ in range(4))
    deadline = time.monotonic() + 20
    while engine.stats().get("running", 1) > 0 or engine.stats().get("waiting", 1) > 0:
        assert time.monotonic() < deadline, f"engine still busy after disconnect: {engine.stats()}"
        time.sleep(0.05)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert "nvl72:kv_cache_usage_perc{" in metrics and "nvl72:num_requests_running{" in metrics
    queued = re.search(r'^nvl72:request_queue_time_seconds_count\{[^}]*\} (\S+)$', metrics, re.M)
    assert queued and float(queued.group(1)) >= 1, "queue time of finished requests must be observed"



@pytest.mark.mp
def test_nvl72_serve_subprocess_starts_fast_and_answers():
    port = free_port("127.0.0.1")
    env = {**os.environ, "NVL72_API_KEY": "sk-sub"}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "nvl72", "--log-level", "WARNING", "serve", "--port", str(port),
                             "--device", "cpu"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() - t0 < 60, "nvl72 serve did not come up in 60 s"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        startup = time.monotonic() - t0
        assert startup < 30, f"startup took {startup:.1f} s"
        c = openai.OpenAI(base_url=url + "/v1", api_key="sk-sub", timeout=60, max_retries=0)
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert r.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, proc.stdout.read()
