"""Greedy tokens must not depend on how the engine groups, chunks, caches or speculates."""
import pytest

from nvl72.engine.protocol import AddRequest, SamplingParams
from nvl72.engine.spec import HistoryDrafter
from tests.engine.tiny import VOCAB, drain, make_engine, prompts, run_all

FAMILIES = ["qwen3_moe", "qwen3_next"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def tokens(res):
    return {k: v[0] for k, v in res.items()}


@pytest.fixture(scope="module", params=FAMILIES)
def reference(request):
    """Each prompt alone, whole prefill, no prefix cache, no speculation."""
    fam = request.param
    ps = prompts(6, seed=1)
    ref = {}
    for i, p in enumerate(ps):
        e = make_engine(fam, enable_prefix_caching=False, max_num_batched_tokens=128)
        ref[f"r{i}"] = run_all(e, [p], GREEDY)["r0"][0]
    assert len({tuple(v) for v in ref.values()}) == len(ref), "degenerate model: prompts give identical outputs"
    return fam, ps, ref


def test_batch_equals_single(reference):
    fam, ps, ref = reference
    e = make_engine(fam, max_num_batched_tokens=256)
    assert tokens(run_all(e, ps, GREEDY)) == ref


def test_chunked_equals_whole_prefill(reference):
    fam, ps, ref = reference
    for budget in (5, 8, 13):
        e = make_engine(fam, max_num_batched_tokens=budget, enable_prefix_caching=False)
        assert tokens(run_all(e, ps, GREEDY)) == ref, f"budget {budget}"


def test_prefix_cache_on_equals_off(reference):
    """Second turn of a conversation: its prompt extends the first turn's prompt and answer."""
    fam, ps, ref = reference
    e = make_engine(fam, max_num_batched_tokens=16, num_state_slots=64)
    first = tokens(run_all(e, ps, GREEDY))
    assert first == ref
    turn2 = [ps[i] + ref[f"r{i}"] + [7, 8, 9] for i in range(len(ps))]
    for i, p in enumerate(turn2):
        e.add_request(AddRequest(f"t{i}", p, GREEDY))
    got = drain(e)
    cached = {k: v[2] for k, v in got.items()}
    off = make_engine(fam, enable_prefix_caching=False)
    for i, p in enumerate(turn2):
        off.add_request(AddRequest(f"t{i}", p, GREEDY))
    want = drain(off)
    assert tokens(got) == tokens(want)
    assert all(v[2] == 0 for v in want.values())
    # The cached part covers at least the first prompt's full pages, cut to the page size (4).
    for i, p in enumerate(ps):
        assert cached[f"t{i}"] >= len(p) // 4 * 4 > 0 or len(p) < 4, (i, cached[f"t{i}"], len(p))
    st = e.stats()
    assert st["prefix_cache_hits"] == sum(cached.values()) > 0


def _oracle(ref_full):
    """Drafts the target's own greedy continuation (looked up in a reference run)."""
    def fn(tokens, k):
        for full in ref_full:
            if full[:len(tokens)] == tokens:
                return full[len(tokens):len(tokens) + k]
        return []
    return fn


@pytest.mark.parametrize("k", [1, 3])
def test_spec_oracle_drafter(reference, k):
    fam, ps, ref = reference
    full = [ps[i] + ref[f"r{i}"] for i in range(len(ps))]
    e = make_engine(fam, drafter=HistoryDrafter(k, _oracle(full)), num_speculative_tokens=k)
    assert tokens(run_all(e, ps, GREEDY)) == ref
    st = e.stats()
    assert st["spec_decode_num_draft_tokens"] > 0
    assert st["spec_decode_acceptance_rate"] == 1.0
    # Every verify step emits all drafts plus a bonus token (bar the clipped last steps).
    assert st["spec_decode_tokens_per_step"] > 1 + 0.7 * k


def test_spec_partly_right_drafter(reference):
    """First draft right, second wrong, third right: exactly one accepted per full verify step."""
    fam, ps, ref = reference
    full = [ps[i] + ref[f"r{i}"] for i in range(len(ps))]
    right = _oracle(full)

    def partly(tokens, k):
        d = right(tokens, k)
        return d[:1] + [(t + 1) % VOCAB for t in d[1:2]] + d[2:]
    e = make_engine(fam, drafter=HistoryDrafter(3, partly), num_speculative_tokens=3)
    assert tokens(run_all(e, ps, GREEDY)) == ref
    st = e.stats()
    assert st["spec_decode_num_accepted_tokens"] == st["spec_decode_num_drafts"]
    assert st["spec_decode_tokens_per_step"] == 2.0


@pytest.mark.parametrize("k", [2, 4])
def test_spec_wrong_drafter(reference, k):
    fam, ps, ref = reference
    full = [ps[i] + ref[f"r{i}"] for i in range(len(ps))]
    right = _oracle(full)

    def wrong(tokens, kk):
        return [(t + 1) % VOCAB for t in right(tokens, kk)] or [1] * kk
    e = make_engine(fam, drafter=HistoryDrafter(k, wrong), num_speculative_tokens=k)
    assert tokens(run_all(e, ps, GREEDY)) == ref
    st = e.stats()
    assert st["spec_decode_num_draft_tokens"] > 0
    assert st["spec_decode_acceptance_rate"] < 0.1


def test_eos_and_ignore_eos(reference):
    fam, ps, ref = reference
    from nvl72.engine.engine import LLMEngine
    from tests.engine.tiny import tiny_model
    eng = make_engine(fam)
    eos = ref["r0"][3]
    stop_at = ref["r0"].index(eos)
    e = LLMEngine(tiny_model(fam), eng.config, eos_token_ids=[eos])
    got = run_all(e, [ps[0]], GREEDY)["r0"]
    assert got[0] == ref["r0"][:stop_at + 1] and got[1] == "stop"
    e.add_request(AddRequest("i", ps[0], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
    got = drain(e)["i"]
    assert got[0] == ref["r0"] and got[1] == "length"


def test_logprobs_same_with_speculation(reference):
    fam, ps, ref = reference
    sp = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)

    def run(engine):
        for i, p in enumerate(ps):
            engine.add_request(AddRequest(f"r{i}", p, sp))
        lps = {}
        while engine.has_unfinished():
            for o in engine.step():
                lps.setdefault(o.request_id, []).extend(o.logprobs)
        return lps
    plain = run(make_engine(fam))
    full = [ps[i] + ref[f"r{i}"] for i in range(len(ps))]
    spec = run(make_engine(fam, drafter=HistoryDrafter(3, _oracle(full)), num_speculative_tokens=3))
    for rid, want in plain.items():
        assert [lp.token_id for lp in want] == ref[rid]
        got = spec[rid]
        assert [lp.token_id for lp in got] == ref[rid]
        for a, b in zip(got, want):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(a.top) == 2


def test_ngram_proposal():
    from nvl72.engine.spec import ngram_proposal
    assert ngram_proposal([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]  # longest tail match (3 tokens)
    assert ngram_proposal([5, 1, 7, 7, 1], 2) == [7, 7]  # falls back to a 1-token match
    assert ngram_proposal([1, 2, 3], 2) == []


def test_ngram_drafter_exact(reference):
    """Prompt-lookup drafting on repetitive prompts: same tokens."""
    from nvl72.engine.spec import ngram_proposal
    fam, ps, ref = reference
    reps = [(p[:5] * 6)[:28] for p in ps]
    want = tokens(run_all(make_engine(fam, enable_prefix_caching=False), reps, GREEDY))
    e = make_engine(fam, drafter=HistoryDrafter(3, ngram_proposal), num_speculative_tokens=3)
    assert tokens(run_all(e, reps, GREEDY)) == want
    assert e.stats()["spec_decode_num_draft_tokens"] > 0


@pytest.mark.parametrize("fam", ["qwen3_moe", "qwen3_next"])
def test_warmup_leaves_no_trace(fam):
    """After warmup(): no pages or slots held, prefix cache and counters empty, and the same greedy
    tokens as an engine that never warmed up (prefix cache on: no stale hit from the dummy)."""
    ps = prompts(3, seed=5)
    cold = make_engine(fam)
    want = run_all(cold, ps, GREEDY)
    warm = make_engine(fam)
    warm.warmup(num_tokens=40)
    assert warm.pages.num_used == 0 and (warm.slots is None or warm.slots.num_used == 0)
    assert warm.stats()["prefix_cache_queries"] == 0 and warm.counters["num_steps"] == 0
    assert run_all(warm, ps, GREEDY) == want
    with pytest.raises(RuntimeError, match="requests in the engine"):
        warm.add_request(AddRequest("x", [1, 2, 3], GREEDY))
        warm.warmup()
