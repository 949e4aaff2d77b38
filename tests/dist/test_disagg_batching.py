"""A disaggregated decode rank's step reaches the front as one `OutputBatch` message, and the front's
per-request streams show the client the same thing as when every output travelled alone: tokens,
finish reasons, usage and stop-string cuts (a real tiny engine on CPU, the front's real sockets)."""
import asyncio
import json
import random
import threading
import time

import zmq

from nvl72.disagg.serving import DisaggClient, ExpectTransfer, FrontHub, Handoff, PrefillRequest, _RankLink, decode
from nvl72.engine.core import EngineCore, build_engine
from nvl72.engine.protocol import AbortRequest, AddRequest, LoadReport, OutputBatch, SamplingParams
from nvl72.server.app import OutputPipeline
from nvl72.tokenizer import Tokenizer
from tests.dist.test_disagg_serving import CONFIGS, _engine_args


def _core(tmp_path) -> EngineCore:
    model_dir = tmp_path / "qwen3_moe"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(CONFIGS["qwen3_moe"]))
    return EngineCore(build_engine(**_engine_args(model_dir)))


def _requests(rng: random.Random) -> list[AddRequest]:
    """Two that finish at the second decode step, two that run on (greedy, no early eos)."""
    lens = [2, 2, 6, 6]
    return [AddRequest(f"r{i}", [rng.randrange(1, 3000) for _ in range(rng.randrange(3, 20))],
                       SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)) for i, n in enumerate(lens)]


def test_decode_step_is_one_message(tmp_path):
    core = _core(tmp_path)
    for r in _requests(random.Random(1)):
        core.handle(r)
    core.step()  # first tokens
    outs = core.step()
    assert sum(o.finish_reason is not None for o in outs) == 2 and sum(o.finish_reason is None for o in outs) == 2
    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    link = _RankLink(1, f"tcp://127.0.0.1:{port}")
    try:
        link.send_outputs(outs)
        link.send_outputs([])  # a step with no outputs sends nothing
        assert router.poll(5000)
        ident, raw = router.recv_multipart()
        assert ident == b"data1" and decode(raw) == OutputBatch(outs)
        assert not router.poll(200)
    finally:
        link.close()
        router.close(linger=0)


class _Ranks(threading.Thread):
    """Prefill rank 0 and decode rank 1 over one real engine: rank 0 answers a PrefillRequest with
    the request's first output (a Handoff), rank 1 sends each later step's outputs once the front
    said ExpectTransfer for all of them, batched (as `decode_role`) or one message per output."""

    def __init__(self, address: str, core: EngineCore, batched: bool, n: int):
        super().__init__(daemon=True)
        self.links = {r: _RankLink(r, address) for r in (0, 1)}
        self.core, self.batched, self.n = core, batched, n
        self.sent: list[int] = []  # outputs per message from rank 1
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self):
        try:
            self._run()
        except BaseException as e:  # reported by the test
            self.error = e
        finally:
            for link in self.links.values():
                link.close()

    def _run(self):
        prefill, dec = self.links[0], self.links[1]
        requests, expected = {}, set()
        while not self.stop.is_set():
            for r, link in self.links.items():
                link.send(LoadReport(r, 0, 0, 0.0, time.time(), {"max_model_len": 256.0, "vocab_size": 151936.0}))
            for m in prefill.recv_all(0):
                # a client that stopped early (stop string) makes the front abort its request on both ranks;
                # here every step has run by then (the decode loop below runs them all at once): nothing to do
                if isinstance(m, AbortRequest):
                    continue
                assert isinstance(m, PrefillRequest)
                requests[m.request.request_id] = m
                self.core.handle(m.request)
            if len(requests) == self.n and not expected and self.core.busy and not self.sent:
                for o in self.core.step():  # the prefill step: every request's first token
                    m = requests[o.request_id]
                    prefill.send(Handoff(o, m.seq, len(m.request.prompt_token_ids), [0]))
                self.sent.append(0)
            for m in dec.recv_all(0):
                if isinstance(m, AbortRequest):
                    continue
                assert isinstance(m, ExpectTransfer)
                expected.add(m.request.request_id)
            if len(expected) == self.n:
                while self.core.busy:
                    outs = self.core.step()
                    if self.batched:
                        dec.send_outputs(outs)
                        self.sent.append(len(outs))
                    else:
                        for o in outs:
                            dec.send(o)
                            self.sent.append(1)
                expected.clear()
            time.sleep(0.005)


def _client_view(tmp_path, batched: bool, stops: dict[str, list[str]], tok: Tokenizer):
    """What each request's client sees: text, completion tokens, finish reason."""
    hub = FrontHub("127.0.0.1")
    reqs = _requests(random.Random(1))
    ranks = _Ranks(hub.address, _core(tmp_path), batched, len(reqs))
    ranks.start()
    client = DisaggClient(hub, [0], [1], lost_timeout=30, output_timeout=30)

    async def one(req: AddRequest, lag: float):
        pipe = OutputPipeline(tok, stops.get(req.request_id, []), True, None, None)
        text, reason = "", None
        gen = client.generate(req)
        async for out in gen:
            text += pipe.step(out).content
            if pipe.stopped:
                reason = "stop"
                await gen.aclose()
                break
            reason = out.finish_reason
            await asyncio.sleep(lag)  # a consumer that falls behind gets merged outputs
        return text + pipe.finish().content, pipe.num_output_tokens, reason

    async def main():
        return await asyncio.gather(*(one(r, 0.05 * (i % 2)) for i, r in enumerate(reqs)))

    try:
        client.wait_ready(20)
        views = asyncio.run(main())
    finally:
        ranks.stop.set()
        ranks.join(10)
        asyncio.run(client.shutdown())
    assert ranks.error is None, ranks.error
    return views, ranks.sent


def test_batched_decode_steps_give_the_same_client_stream(tmp_path):
    tok = Tokenizer.qwen(151936)
    # Reference: every output in its own message (the shape before batching), no stop strings.
    plain, sent = _client_view(tmp_path / "a", False, {}, tok)
    assert set(sent[1:]) == {1}
    assert [(n, r) for _, n, r in plain] == [(2, "length"), (2, "length"), (6, "length"), (6, "length")]
    # A stop string inside a long request's text (its usage must end at the token completing it).
    stop_text = plain[3][0][len(plain[3][0]) // 2:][:3]
    stops = {"r3": [stop_text]} if stop_text.strip() else {}
    views = {}
    for batched in (False, True):
        views[batched], sent = _client_view(tmp_path / f"b{batched}", batched, stops, tok)
        if batched:  # one message per decode step: the first carries 2 finished and 2 running requests
            assert sent[1:] == [4, 2, 2, 2, 2], sent
    assert views[True] == views[False]
    assert views[True][:3] == plain[:3]
    if stops:
        text, n, reason = views[True][3]
        assert reason == "stop" and text == plain[3][0][:plain[3][0].index(stop_text)] and 1 <= n <= 6
    else:
        assert views[True][3] == plain[3]
