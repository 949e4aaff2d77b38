"""Async scheduling (step n+1 launched before step n's tokens are read back) on the CPU: the same
streams as the synchronous engine, stop conditions at the same token, nothing leaked."""
import random
import warnings

import pytest
import torch

from nvl72.engine.engine import EngineConfig, LLMEngine
from nvl72.engine.protocol import AddRequest, SamplingParams
from nvl72.engine.runner import PriorTokens, fill_run, patch_placeholders, placeholder_fill
from nvl72.engine.scheduler import ScheduledSeq
from nvl72.engine.sequence import PENDING_TOKEN, Sequence
from tests.engine.test_handoff import copy_cache
from tests.engine.tiny import prompts, tiny_model

FAMILIES = ["qwen3_moe", "qwen3_next"]


def engine(fam, overlap, eos=(), model=None, **kw):
    cfg = dict(max_model_len=48, max_num_seqs=6, max_num_batched_tokens=16, page_size=4, num_pages=96)
    cfg.update(kw)
    e = LLMEngine(model or tiny_model(fam), EngineConfig(async_scheduling=overlap, **cfg), eos_token_ids=list(eos))
    assert e.overlap == overlap
    e.patched = 0  # steps that fed a token straight from the step before (never read back first)
    run = e.runner.run

    def counting_run(scheduled, prior=None, readback=True):
        e.patched += bool(placeholder_fill(scheduled, prior)[0])
        return run(scheduled, prior, readback)
    e.runner.run = counting_run
    return e


def stream(e, reqs, abort_after=None):
    """Step to the end; {rid: (tokens, finish_reason, logprobs)}. `abort_after`: {rid: n} aborts rid
    once it has streamed n tokens."""
    for rid, p, sp in reqs:
        e.add_request(AddRequest(rid, p, sp))
    res = {}
    for _ in range(5000):
        if not e.has_unfinished():
            break
        outs = e.step()
        for rid, n in (abort_after or {}).items():
            if rid in e.seqs and len(res.get(rid, [[]])[0]) >= n:
                outs.append(e.abort_request(rid))
        for o in outs:
            r = res.setdefault(o.request_id, [[], None, []])
            assert r[1] is None, f"{o.request_id}: output after finishing ({r[1]})"
            assert PENDING_TOKEN not in o.new_token_ids
            r[0].extend(o.new_token_ids)
            r[1] = o.finish_reason
            r[2].extend(o.logprobs or [])
    else:
        raise TimeoutError("engine did not drain")
    assert e._inflight is None and not e.seqs
    e.prefix.clear()
    scratch = e.runner.graphs is not None  # a graph replay's padding rows hold a page and a slot for good
    assert e.pages.num_free == e.pages.size - scratch
    assert e.slots is None or e.slots.num_free == e.slots.size - scratch
    return {k: tuple(v) for k, v in res.items()}


def both(fam, reqs, eos=(), **kw):
    """The streams of a synchronous and an async engine (same config)."""
    sync, fast = engine(fam, False, eos, **kw), engine(fam, True, eos, **kw)
    a, b = stream(sync, reqs), stream(fast, reqs)
    assert fast.patched > 0 and sync.patched == 0
    assert fast.counters["generation_tokens"] == sync.counters["generation_tokens"]
    return a, b


@pytest.mark.parametrize("fam", FAMILIES)
def test_greedy_stops_at_the_same_token(fam, **kw):
    """EOS, stop token ids, max_tokens and max_model_len end both engines' streams at the same token."""
    rnd = random.Random(3)
    ps = prompts(10, seed=4, lo=3, hi=30)
    free = [(f"r{i}", p, SamplingParams(max_tokens=40, temperature=0.0)) for i, p in enumerate(ps)]
    ref, _ = both(fam, free, **kw)
    eos = ref["r0"][0][3]
    reqs = []
    for i, p in enumerate(ps):
        out = ref[f"r{i}"][0]
        stop = [out[rnd.randrange(len(out))]] if i % 3 == 1 else []
        reqs.append((f"r{i}", p, SamplingParams(max_tokens=rnd.choice([1, 2, 5, 17, 40]), temperature=0.0,
                                                stop_token_ids=stop, ignore_eos=i % 4 == 3)))
    reqs.append(("long", ps[0], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)))
    a, b = both(fam, reqs, eos=[eos], **kw)
    assert a == b
    reasons = {v[1] for v in a.values()}
    assert {"stop", "length"} <= reasons, reasons
    assert len(ps[0]) + len(a["long"][0]) == 48  # max_model_len


@pytest.mark.parametrize("fam", FAMILIES)
def test_sampling_logprobs_and_penalties_equal_sync(fam):
    """Seeded sampling and logprobs read back one step late; penalty rows (host history) fall back
    to scheduling after the read-back, mixed in the same batches."""
    ps = prompts(6, seed=9)
    reqs = []
    for i, p in enumerate(ps):
        kw = dict(temperature=0.9, top_p=0.95, seed=i, logprobs=2) if i % 2 else dict(temperature=0.0)
        if i % 3 == 2:
            kw.update(repetition_penalty=1.3, frequency_penalty=0.5)
        reqs.append((f"r{i}", p, SamplingParams(max_tokens=14, **kw)))
    a, b = both(fam, reqs)
    for rid in a:
        assert a[rid][:2] == b[rid][:2], rid
        assert [(x.token_id, [t for t, _ in x.top]) for x in a[rid][2]] == \
               [(x.token_id, [t for t, _ in x.top]) for x in b[rid][2]]
        assert all(abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(a[rid][2], b[rid][2]))
    assert sum(len(v[2]) for v in b.values()) == 3 * 14


@pytest.mark.parametrize("fam", FAMILIES)
def test_abort_mid_stream(fam):
    ps = prompts(6, seed=5)
    reqs = [(f"r{i}", p, SamplingParams(max_tokens=20, temperature=0.0)) for i, p in enumerate(ps)]
    ref = stream(engine(fam, False), reqs)
    got = stream(engine(fam, True), reqs, abort_after={"r1": 1, "r3": 6, "r4": 0})
    for rid, (toks, why, _) in got.items():
        if rid in ("r1", "r3", "r4"):
            assert why == "abort" and toks == ref[rid][0][:len(toks)], rid
        else:
            assert (toks, why) == ref[rid][:2], rid
    assert len(got["r3"][0]) >= 6


def test_prefix_cache_second_round_hybrid():
    """Pages and GDN checkpoints inserted while tokens are in flight hold the real tokens: a second
    round of the same prompts hits the cache and continues identically."""
    ps = prompts(4, seed=6, lo=9, hi=30)
    sp = SamplingParams(max_tokens=10, temperature=0.0)
    for overlap in (False, True):
        e = engine("qwen3_next", overlap, num_state_slots=64)
        first = [(f"a{i}", p, sp) for i, p in enumerate(ps)]
        for rid, p, s in first:
            e.add_request(AddRequest(rid, p, s))
        outs = {}
        while e.has_unfinished():
            for o in e.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        again = [(f"b{i}", p + outs[f"a{i}"], sp) for i, p in enumerate(ps)]
        res = stream(e, again)
        if not overlap:
            ref = res
    assert res == ref
    assert e.scheduler.prefix_hits > 0


@pytest.mark.parametrize("fam", FAMILIES)
def test_pressure_preemption_and_forced_preempt(fam):
    """Few pages: natural preemption of sequences whose token is in flight, plus forced ones
    between steps (the preempted sequence may be readmitted before its token is read back)."""
    ps = prompts(14, seed=7, lo=4, hi=20)
    reqs = [(f"r{i}", p, SamplingParams(max_tokens=24, temperature=0.0)) for i, p in enumerate(ps)]
    ref = stream(engine(fam, False, num_pages=200, max_num_batched_tokens=64), reqs)
    e = engine(fam, True, num_pages=20, max_num_seqs=10, max_num_batched_tokens=12, num_state_slots=40)
    rnd = random.Random(1)
    step = e.step

    def step_and_preempt():
        outs = step()
        if e.scheduler.running and rnd.random() < 0.15:
            e.scheduler.preempt(rnd.choice(e.scheduler.running))
        return outs
    e.step = step_and_preempt
    got = stream(e, reqs)
    assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in ref.items()}
    assert e.scheduler.num_preemptions > 0 and e.patched > 0


@pytest.mark.parametrize("fam", FAMILIES)
def test_prefill_only_parks_after_read_back(fam):
    """Disaggregated prefill with async scheduling: parked with its first token, then decoded by
    an async decode engine: the colocated stream."""
    ps = prompts(4, seed=8)
    sp = SamplingParams(max_tokens=9, temperature=0.0)
    want = stream(engine(fam, False), [(f"r{i}", p, sp) for i, p in enumerate(ps)])
    pre, dec = engine(fam, True), engine(fam, True)
    for i, p in enumerate(ps):
        pre.add_request(AddRequest(f"r{i}", p, sp), prefill_only=True)
    first = {}
    while pre.has_unfinished():
        for o in pre.step():
            first.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert all(len(v) == 1 for v in first.values())
    for i, p in enumerate(ps):
        rid = f"r{i}"
        src = pre.handoff(rid)
        assert src.token_ids == p + first[rid]
        dst = dec.reserve_transfer(AddRequest(rid, p, sp), src.num_tokens)
        copy_cache(pre, src, dec, dst)
        pre.release(rid)
        dec.commit_transfer(rid, first[rid])
    rest = stream(dec, [])
    assert {rid: first[rid] + list(rest[rid][0]) for rid in first} == {rid: list(v[0]) for rid, v in want.items()}


def test_placeholder_without_step_in_flight_is_refused():
    seq = Sequence("x", [5, 6, PENDING_TOKEN], 2, SamplingParams(), 0, num_computed=2, pending=True)
    sched = [ScheduledSeq(seq, 1, [])]
    with pytest.raises(RuntimeError, match="'x'|x: placeholder"):
        placeholder_fill(sched, None)
    assert placeholder_fill(sched, PriorTokens(None, {seq: 4})) == [[0], [4]]


def test_patch_by_slice_or_by_indices():
    """fill_run: consecutive positions and rows become one slice copy; anything else goes through the
    index tensors; both give input_ids[dst] = prior tokens[src]."""
    assert fill_run([[], []]) is None
    assert fill_run([[0, 1, 2], [3, 4, 5]]) == (0, 3, 3)
    assert fill_run([[0, 2], [0, 1]]) is None and fill_run([[0, 1], [1, 0]]) is None
    prior = PriorTokens(torch.tensor([10, 11, 12, 13, 14, 15]), {})
    for dst, src in ([[1, 2, 3], [2, 3, 4]], [[0, 3], [5, 1]]):
        ids = torch.zeros(5, dtype=torch.long)
        run = fill_run([dst, src])
        patch_placeholders(ids, prior, run, None if run else torch.tensor([dst, src]))
        want = torch.zeros(5, dtype=torch.long)
        want[dst] = prior.token_ids[src]
        assert torch.equal(ids, want) and (run is None) == (dst == [0, 3])


@pytest.fixture
def gpu_tiny(monkeypatch):
    """The runner tests' graph-capturable tiny models (dense MLPs, reference MoE) on CUDA."""
    from tests.runner.test_runner_engine import tiny

    monkeypatch.setenv("NVL72_MOE_BACKEND", "reference")
    return lambda name: tiny(name, "cuda")


GRAPHS = dict(attention_backend="triton", cuda_graph_batch_sizes=(1, 2, 4, 8), num_pages=160)


@pytest.mark.gpu
@pytest.mark.parametrize("fam", FAMILIES)
def test_gpu_graphs_async_stops_equal_sync(fam, gpu_tiny):
    test_greedy_stops_at_the_same_token(fam, model=gpu_tiny(fam), **GRAPHS)


@pytest.mark.gpu
def test_gpu_graphs_async_default_on_and_abort(gpu_tiny):
    model = gpu_tiny("qwen3_next")
    e = LLMEngine(model, EngineConfig(max_model_len=64, max_num_seqs=6, page_size=4, **GRAPHS), eos_token_ids=[])
    assert e.runner.graphs is not None and e.overlap, "async scheduling is the default with CUDA graphs"
    ps = prompts(6, seed=5)
    reqs = [(f"r{i}", p, SamplingParams(max_tokens=20, temperature=0.0)) for i, p in enumerate(ps)]
    ref = stream(engine("qwen3_next", False, model=model, **GRAPHS), reqs)
    got = stream(engine("qwen3_next", True, model=model, **GRAPHS), reqs, abort_after={"r1": 1, "r3": 6})
    for rid, (toks, why, _) in got.items():
        assert toks == ref[rid][0][:len(toks)] and why == ("abort" if rid in ("r1", "r3") else ref[rid][1]), rid


@pytest.mark.gpu
@pytest.mark.parametrize("fam", FAMILIES)
def test_gpu_decode_steps_never_sync(fam, gpu_tiny):
    """Steady-state decode (graph replays fed from the device) makes no synchronizing CUDA call
    (torch's sync debug mode: no .item(), no blocking device-to-host copy); the host waits on the
    previous step's event only."""
    e = engine(fam, True, model=gpu_tiny(fam), max_num_batched_tokens=256, **GRAPHS)
    for i, p in enumerate(prompts(4, seed=2)):
        e.add_request(AddRequest(f"r{i}", p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)))
    for _ in range(4):  # prefills (eager) and the first decode steps
        e.step()
    replays = e.runner.graphs.replays
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(10):
                assert all(o.error is None for o in e.step())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    assert not syncs, syncs[:3]
    assert e.runner.graphs.replays == replays + 10 and e.patched >= 10
    stream(e, [])
