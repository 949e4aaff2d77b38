"""Disaggregated serving under `mpiexec -n 3` on CPU (gloo): prefill TP1 on rank 0 (beside the HTTP
front), decode on ranks 1 and 2. Streamed greedy completions through the openai client equal the same
front over one single-process engine; killing a decode rank mid-stream ends its requests with an
error while the other rank's finish and later requests succeed."""
import asyncio
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest

from nvl72.commands.launch import request_shutdown
from nvl72.disagg.serving import (DisaggClient, ExpectTransfer, FrontHub, Handoff, PrefillRequest, _RankLink, decode,
                                  encode)
from nvl72.engine.client import EngineDeadError
from nvl72.engine.protocol import AddRequest, LoadReport, ProtocolError, RequestOutput, SamplingParams
from nvl72.parallel import free_port
from tests.dist.test_launch_mp import _env, _mpiexec

VOCAB = 151936  # the shipped Qwen vocabulary's size: the front's tokenizer needs it
_BASE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, rms_norm_eps=1e-6,
             max_position_embeddings=512, eos_token_id=[0], tie_word_embeddings=False)
CONFIGS = {
    "qwen3_moe": dict(_BASE, model_type="qwen3_moe"),
    "qwen3_next": dict(_BASE, model_type="qwen3_next", num_hidden_layers=4, shared_expert_intermediate_size=32,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                       linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=2, head_dim=16),
}
PLAN = ["--rack", "cpu:3", "--model", "Qwen3-30B-A3B", "--prefill-tp", "1", "--decode-size", "1",
        "--prefill-instances", "1", "--decode-instances", "2"]
MODEL = "tiny"


def _engine_args(model_dir: pathlib.Path, **kw) -> dict:
    return dict(model=str(model_dir), load_format="dummy", dtype="float32", device="cpu", max_model_len=256,
                max_num_seqs=8, max_num_batched_tokens=64, page_size=4, num_pages=400, seed=3) | kw



def _prompts(n: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, 3000, (int(m),), generator=g).tolist() for m in torch.randint(3, 30, (n,), generator=g)]


class Launch:
    """`mpiexec -n 3 python -m launch ... --engine-args`; the HTTP front on a known port."""

    def __init__(self, tmp: pathlib.Path, family: str, lost_timeout: float = 2.0, plan_args=PLAN,
                 model_dir: pathlib.Path | None = None, kv_transport: str = "auto", **engine_kw):
        if model_dir is None:  # dummy weights from a config alone
            model_dir = tmp / family
            model_dir.mkdir()
            (model_dir / "config.json").write_text(json.dumps(CONFIGS[family]))
        self.model_dir = model_dir
        plan = tmp / "plan.json"
        subprocess.run([sys.executable, "-m", "nvl72", "plan", *plan_args, "--out", str(plan)], check=True,
                       timeout=60, capture_output=True)
        self.ready, self.port = tmp / "ready.json", free_port("127.0.0.1")
        self.log = open(tmp / "launch.log", "w+")
        # MASTER_ADDR/PORT: the ranks rendezvous without MPI_Init (with MPI initialised, mpich took
        # a second rank down with the killed one); mpiexec only starts the processes.
        env = {**_env(), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port("127.0.0.1"))}
        self.proc = subprocess.Popen(
            [_mpiexec(), "-disable-auto-cleanup", "-n", "3", *self._keep_going(), sys.executable, "-m", "launch",
             "--plan", str(plan),
             "--ready-file", str(self.ready), "--heartbeat", "0.2", "--heartbeat-timeout", "3", "--timeout", "20",
             "--engine-args", json.dumps(_engine_args(self.model_dir, **engine_kw)), "--http-host", "127.0.0.1",
             "--http-port", str(self.port), "--served-model-name", MODEL, "--transfer-timeout", "10",
             "--rank-lost-timeout", str(lost_timeout), "--shutdown-timeout", "10", "--kv-transport", kv_transport,
             "--kv-transport-ring", "16KiB"],
            stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", timeout=30,
                                    max_retries=0)
        self.info = self._wait_up(60)

    @staticmethod
    def _keep_going() -> list[str]:
        """Hydra kills every rank once one dies by a signal (even with -disable-auto-cleanup); a shell
        around each rank that exits 0 when its rank was killed lets the others serve on (what srun's
        --kill-on-bad-exit=0 does on a cluster)."""
        return ["sh", "-c", '"$@"; echo "rank exit $?" >&2; exit 0', "rank"]

    def tail(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-6000:]

    def _wait_up(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.ready.exists():
                try:
                    self.client.models.list()
                    return json.loads(self.ready.read_text())
                except openai.APIConnectionError:
                    pass
            time.sleep(0.2)
        tail = self.tail()
        self.close()
        pytest.fail(f"disaggregated launch not serving within {timeout} s:\n{tail}")

    def complete(self, prompt: list[int], max_tokens: int) -> tuple[str, int]:
        return stream_completion(self.client, prompt, max_tokens)

    def kill_rank_mid_streams(self, rank: int, prompts: list[list[int]], *, after_chunks: int,
                              join_s: float) -> tuple[list, float]:
        """Two long greedy streams (900 tokens, one per prompt, both in flight: least-loaded routing puts
        them on different decode ranks); once each has `after_chunks` chunks, SIGKILL `rank`. Returns
        ([("ok", completion tokens) | ("error", message)] per stream, seconds from the kill until both ended)."""
        pids = {r["rank"]: r["pid"] for r in self.info["ranks"]}
        started = [threading.Event() for _ in prompts]
        results: list = [None] * len(prompts)

        def run(i):
            try:
                n = chunks = 0
                for c in self.client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=900,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True},
                                                        extra_body={"ignore_eos": True}):
                    chunks += 1
                    if chunks >= after_chunks:
                        started[i].set()
                    n = c.usage.completion_tokens if c.usage else n
                results[i] = ("ok", n)
            except openai.APIError as e:
                results[i] = ("error", str(e))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        assert all(e.wait(20) for e in started), self.tail()
        t0 = time.monotonic()
        os.kill(pids[rank], signal.SIGKILL)
        for t in threads:
            t.join(join_s)
        return results, time.monotonic() - t0

    def complete_concurrently(self, prompts: list[list[int]], max_tokens: int, timeout: float = 40) -> list:
        """One streaming completion per prompt, all in flight together; asserts each finished."""
        got: list = [None] * len(prompts)

        def run(i):
            got[i] = self.complete(prompts[i], max_tokens)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        assert all(g is not None for g in got), self.tail()
        return got

    def close(self) -> None:
        if self.proc.poll() is None and getattr(self, "info", None):
            try:
                request_shutdown(self.info["front"], reason="test")
                self.proc.wait(40)
            except (subprocess.TimeoutExpired, OSError):
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # mpiexec and every rank it started
            self.proc.wait(10)
        self.log.seek(0)
        self.log_text = self.log.read()
        self.log.close()


def stream_completion(client: openai.OpenAI, prompt: list[int], max_tokens: int) -> tuple[str, int]:
    text, n = "", 0
    for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True}):
        if c.choices:
            text += c.choices[0].text
        if c.usage:
            n = c.usage.completion_tokens
    return text, n


def _running(launch: Launch) -> float:
    """Requests running on the live decode ranks, from the front's /metrics."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{launch.port}/metrics", timeout=10).text
    return float(re.search(r"^nvl72:num_requests_running\{[^}]*\} (\S+)$", text, re.M).group(1))


def _wait_running(launch: Launch, value: int, within: float) -> None:
    t0 = time.monotonic()
    while _running(launch) != value:
        assert time.monotonic() - t0 < within, f"decode ranks do not report {value} running within {within} s"
        time.sleep(0.05)


def _reference(model_dir: pathlib.Path, prompts: list[list[int]], max_tokens: int,
               **engine_kw) -> list[tuple[str, int]]:
    """The same front over one single-process engine with the same arguments."""
    from nvl72.commands.serve import load_tokenizer
    from nvl72.engine.client import ThreadEngineClient
    from nvl72.engine.core import build_engine
    from nvl72.server.app import ServerConfig, build_app
    from nvl72.server.runner import ServerThread

    eng = ThreadEngineClient(build_engine(**_engine_args(model_dir, **engine_kw)))
    try:
        with ServerThread(build_app(eng, load_tokenizer(str(model_dir)), ServerConfig(MODEL))) as s:
            client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", timeout=30, max_retries=0)
            return [stream_completion(client, p, max_tokens) for p in prompts]
    finally:
        asyncio.run(eng.shutdown())


def test_data_plane_messages_round_trip_and_reject_bad_input():
    req = AddRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
    for msg in (PrefillRequest(req, 7, 2), ExpectTransfer(req, 7, [0, 1], 3),
                Handoff(RequestOutput("r1", [5], None, 3), 7, 3, [0, 1])):
        assert decode(encode(msg)) == msg
    import msgpack

    bad = msgpack.packb({"v": 99, "kind": "disagg_prefill", "body": {}})
    with pytest.raises(ProtocolError, match="version 99"):
        decode(bad)
    with pytest.raises(ProtocolError, match="disagg_expect"):
        decode(msgpack.packb({"v": 1, "kind": "disagg_expect", "body": {"seq": 1}}))


class FakeRanks(threading.Thread):
    """Rank 0 answers a PrefillRequest with a first token; decode ranks answer ExpectTransfer with
    the rest unless held; ranks in `silent` stop their load reports (a dead rank)."""

    def __init__(self, address: str):
        super().__init__(daemon=True)
        self.links = {r: _RankLink(r, address) for r in (0, 1, 2)}
        self.hold: set[int] = set()
        self.silent: set[int] = set()
        self.expected: dict[int, list[str]] = {1: [], 2: []}
        self._pending: dict[int, list[str]] = {1: [], 2: []}
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            for r, link in self.links.items():
                if r in self.silent:
                    continue
                link.send(LoadReport(r, 0, 0, 0.0, time.time(), {"max_model_len": 64.0, "vocab_size": 100.0}))
                for m in link.recv_all(0):
                    if isinstance(m, PrefillRequest):
                        link.send(Handoff(RequestOutput(m.request.request_id, [7], None, 3), m.seq, 3, [0]))
                    elif isinstance(m, ExpectTransfer):
                        self.expected[r].append(m.request.request_id)
                        self._pending[r].append(m.request.request_id)
                if r not in self.hold:
                    for rid in self._pending.get(r, []):
                        link.send(RequestOutput(rid, [8, 9], "length", 3))
                    self._pending[r] = []
            time.sleep(0.01)
        for link in self.links.values():
            link.close()


def test_front_routes_least_loaded_under_threshold_and_around_a_dead_rank():
    hub = FrontHub("127.0.0.1")
    ranks = FakeRanks(hub.address)
    ranks.start()
    client = DisaggClient(hub, [0], [1, 2], batch_threshold=1, lost_timeout=0.5, output_timeout=10)

    def req(rid):
        return AddRequest(rid, [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))

    async def rest(gen):
        return [o async for o in gen]

    async def main():
        ranks.hold = {1, 2}
        gens = [client.generate(req(f"r{i}")) for i in range(2)]
        firsts = [await g.__anext__() for g in gens]
        assert [f.new_token_ids for f in firsts] == [[7], [7]]  # first tokens come from the prefill rank
        t0 = time.monotonic()
        while len(ranks.expected[1]) + len(ranks.expected[2]) < 2 and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.01)
        assert ranks.expected == {1: ["r0"], 2: ["r1"]}  # least loaded: one each
        with pytest.raises(EngineDeadError, match="batch threshold"):
            await client.generate(req("r2")).__anext__()
        ranks.silent.add(2)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="rank 2 lost"):
            await rest(gens[1])
        assert time.monotonic() - t0 < 3
        ranks.hold = set()
        assert [(o.new_token_ids, o.finish_reason) for o in await rest(gens[0])] == [([8, 9], "length")]
        outs = await rest(client.generate(req("r3")))  # rank 2 is dead: rank 1 takes it
        assert [o.new_token_ids for o in outs] == [[7], [8, 9]] and ranks.expected[1] == ["r0", "r3"]
        ranks.silent.add(1)
        t0 = time.monotonic()
        while 1 not in client.dead and time.monotonic() - t0 < 3:
            await asyncio.sleep(0.05)
        with pytest.raises(EngineDeadError, match="no live rank"):
            await client.generate(req("r4")).__anext__()

    try:
        client.wait_ready(10)
        assert client.max_model_len == 64 and client.vocab_size == 100
        asyncio.run(main())
    finally:
        ranks.stop.set()
        ranks.join(5)
        asyncio.run(client.shutdown())


@pytest.mark.mp
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_disaggregated_http_stream_equals_single_process(tmp_path, family):
    prompts, max_tokens = _prompts(6), 10
    launch = Launch(tmp_path, family)
    try:
        got = launch.complete_concurrently(prompts, max_tokens)
        one = launch.complete(prompts[0], 1)  # finishes on the prefill rank: no transfer
    finally:
        launch.close()
    log = launch.log_text
    want = _reference(launch.model_dir, prompts, max_tokens)
    assert got == want
    assert one == (want[0][0][:len(one[0])], 1) and one[0]
    assert all(n == max_tokens and text for text, n in got)  # ignore_eos off, but no early stop here
    # Every request went prefill -> transfer -> decode, over both decode ranks.
    assert "prefill rank 0: 6 requests handed off" in log, log
    received = [int(n) for n in re.findall(r"decode rank [12]: (\d+) requests received", log)]
    assert sum(received) == 6 and min(received) >= 1 and len(received) == 2, log
    assert "KV transfer failed" not in log and "did not complete" not in log


@pytest.mark.mp
def test_killed_decode_rank_fails_its_requests_and_others_go_on(tmp_path):
    # Long streams (about 3 s of decoding) so both are mid-decode when rank 2 dies.
    launch = Launch(tmp_path, "qwen3_moe", lost_timeout=1.5, max_model_len=1024, page_size=16, num_pages=200)
    try:
        # Least-loaded routing: two requests at once go to decode ranks 1 and 2, one each.
        results, took = launch.kill_rank_mid_streams(2, _prompts(2), after_chunks=1, join_s=30)
        assert sorted(r[0] for r in results) == ["error", "ok"], (results, launch.tail())
        ok, err = sorted(results)[::-1]
        assert ok[1] == 900
        assert "engine unavailable" in err[1] and "rank 2 lost" in err[1], err  # the front's 503
        assert took < 20
        for p in _prompts(3):  # later requests all go to the live decode rank
            text, n = launch.complete(p, 8)
            assert n >= 1 and text
        # A client that goes away aborts its request on the decode rank (900 tokens take > 3 s).
        stream = launch.client.completions.create(model=MODEL, prompt=_prompts(1)[0], max_tokens=900,
                                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
        for _, _c in zip(range(3), stream):
            pass
        _wait_running(launch, 1, within=1.0)  # load reports lag by up to one report interval
        stream.close()
        _wait_running(launch, 0, within=1.5)
    finally:
        launch.close()


@pytest.mark.mp
@pytest.mark.parametrize("transport", ["auto", "p2p"])
def test_tp2_prefill_instance_http_stream_equals_single_process(tmp_path, transport):
    """Prefill TP2/EP2 (ranks 0, 1 in lockstep, each sending its KV/GDN shard) -> one decode rank,
    a transformers checkpoint (dummy weights differ per TP slice), hybrid GDN model; the KV transport
    as on CPU by default (send/recv) or forced to the peer-memory rings (a 16 KiB ring per link, 4 KiB slots: the
    parts are chunked and the ring wraps)."""
    from tests.model.tiny import save_tiny

    ckpt = tmp_path / "ckpt"
    save_tiny("qwen3_next", ckpt, seed=4, vocab_size=VOCAB)
    prompts, max_tokens = _prompts(4), 8
    tp2 = ["--rack", "cpu:3", "--model", "Qwen3-30B-A3B", "--prefill-tp", "2", "--decode-size", "1",
           "--prefill-instances", "1", "--decode-instances", "1"]
    launch = Launch(tmp_path, "qwen3_next", plan_args=tp2, model_dir=ckpt, load_format="auto", kv_transport=transport)
    try:
        got = [launch.complete(p, max_tokens) for p in prompts]
    finally:
        launch.close()
    assert got == _reference(ckpt, prompts, max_tokens, load_format="auto")
    assert all(n == max_tokens and text for text, n in got)
    log = launch.log_text
    assert "prefill rank 0: 4 requests handed off" in log and "prefill rank 1: 4 requests handed off" in log, log
    assert "decode rank 2: 4 requests received" in log, log
    want = "p2p (symmetric heap, cpu" if transport == "p2p" else "sendrecv (--kv-transport auto: auto on cpu)"
    assert log.count(f"KV transport {want}") == 3, log  # logged once on each prefill and decode rank
