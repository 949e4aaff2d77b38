"""Queue time (arrival -> first scheduling) reaches the front once per request, for /metrics."""
from nvl72.engine.protocol import AddRequest, SamplingParams
from tests.engine.tiny import make_engine, prompts


def test_queue_time_sent_once_and_waiting_requests_wait_longer():
    engine = make_engine("qwen3_moe", max_num_seqs=1)  # one at a time: the second request queues
    for i, p in enumerate(prompts(2, seed=3)):
        engine.add_request(AddRequest(f"r{i}", p, SamplingParams(max_tokens=3, temperature=0.0)))
    seen: dict[str, list[float]] = {"r0": [], "r1": []}
    firsts: dict[str, bool] = {}
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            if o.request_id not in firsts:
                firsts[o.request_id] = o.queue_time is not None
            if o.queue_time is not None:
                seen[o.request_id].append(o.queue_time)
    assert firsts == {"r0": True, "r1": True}, "queue time must ride on the first output"
    assert all(len(v) == 1 for v in seen.values()), seen
    assert 0.0 <= seen["r0"][0] < seen["r1"][0], seen
