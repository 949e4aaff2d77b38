"""KV pressure: random aborts, forced and natural preemption; nothing dropped, nothing leaked."""
import collections
import random

import pytest

from nvl72.engine.protocol import AddRequest, SamplingParams
from nvl72.engine.spec import HistoryDrafter
from tests.engine.tiny import drain, make_engine, prompts

PAGE = 4


def check_refcounts(e):
    """Every page/slot reference is owned by a live sequence or a tree node, and vice versa."""
    pages, slots = collections.Counter(), collections.Counter()
    for seq in e.scheduler.running:
        pages.update(seq.pages)
        if seq.state_slot >= 0:
            slots[seq.state_slot] += 1
    for seq in e.scheduler.waiting:
        assert not seq.pages and seq.state_slot < 0, seq.request_id
    for n in e.prefix._nodes():
        pages[n.page] += 1
        if n.slot >= 0:
            slots[n.slot] += 1
    assert all(e.pages.refcount(p) == pages[p] for p in range(e.pages.size))
    assert e.prefix.num_evictable_pages() == sum(1 for n in e.prefix._nodes() if pages[n.page] == 1)
    if e.slots is not None:
        assert all(e.slots.refcount(s) == slots[s] for s in range(e.slots.size))


def reference(fam, reqs):
    e = make_engine(fam, num_pages=256, max_num_batched_tokens=128, enable_prefix_caching=False)
    for rid, p, sp in reqs:
        e.add_request(AddRequest(rid, p, sp))
    return drain(e)


@pytest.mark.parametrize("fam", ["qwen3_moe", "qwen3_next"])
@pytest.mark.parametrize("fill,spec,overlap", [(0.7, 0, False), (0.9, 0, False), (0.98, 0, False), (0.9, 2, False),
                                               (0.9, 0, True), (0.98, 0, True)])
def test_pressure(fam, fill, spec, overlap):
    """`overlap`: async scheduling (aborts and preemptions hit sequences whose token is in flight)."""
    rnd = random.Random(int(fill * 100))
    num_pages = 40
    capacity = num_pages * PAGE
    # Prompts filling `fill` of the KV capacity, all submitted at once; their answers would need
    # more than the rest, so decoding sequences outgrow the cache and get preempted.
    reqs, budget = [], int(fill * capacity)
    for p in prompts(60, seed=int(fill * 100), lo=4, hi=24):
        if len(p) > budget:
            continue
        budget -= len(p)
        stop = [rnd.randrange(1, 96)] if rnd.random() < 0.3 else []
        # A third sample (seeded, with penalties): recompute after preemption must not change them.
        sampled = dict(temperature=0.8, top_p=0.9, seed=len(reqs), repetition_penalty=1.2,
                       frequency_penalty=0.3) if len(reqs) % 3 == 2 and not spec else dict(temperature=0.0)
        reqs.append((f"r{len(reqs)}", p, SamplingParams(max_tokens=rnd.randint(16, 36), stop_token_ids=stop,
                                                        **sampled)))
    assert budget < 4
    ref = reference(fam, reqs)
    drafter = None
    if spec:  # drafts the reference continuation: verify steps need pages for k more tokens
        full = [p + list(ref[rid][0]) for rid, p, _ in reqs]
        drafter = HistoryDrafter(spec, lambda toks, k: next((f[len(toks):len(toks) + k] for f in full
                                                             if f[:len(toks)] == toks), []))
    e = make_engine(fam, drafter=drafter, num_speculative_tokens=spec, num_pages=num_pages, max_model_len=64,
                    max_num_seqs=32, max_num_batched_tokens=24, num_state_slots=48, async_scheduling=overlap)
    for rid, p, sp in reqs:
        e.add_request(AddRequest(rid, p, sp))
    res, aborted, forced = {}, set(), 0
    for step in range(3000):
        if not e.has_unfinished():
            break
        outs = e.step()
        if step % 15 == 7 and e.seqs:
            rid = rnd.choice(sorted(e.seqs))
            outs.append(e.abort_request(rid))
            aborted.add(rid)
        if step % 11 == 5 and e.scheduler.running:
            e.scheduler.preempt(rnd.choice(e.scheduler.running))
            forced += 1
        for o in outs:
            r = res.setdefault(o.request_id, [[], None])
            assert r[1] is None, f"{o.request_id} output after finishing"
            r[0].extend(o.new_token_ids)
            r[1] = o.finish_reason
        check_refcounts(e)
    else:
        raise TimeoutError("engine did not drain")
    assert set(res) == {rid for rid, _, _ in reqs}, "a request was dropped"
    for rid, (toks, why) in res.items():
        assert why in ("stop", "length", "abort"), (rid, why)
        if why != "abort":
            assert toks == list(ref[rid][0]) and why == ref[rid][1], rid
        else:
            assert toks == list(ref[rid][0][:len(toks)]), rid
    assert forced > 0 and e.scheduler.num_preemptions > forced, "no natural preemption happened"
    assert aborted
    assert not e.seqs
    if spec:
        assert e.stats()["spec_decode_num_accepted_tokens"] > 0
    e.prefix.clear()
    assert e.pages.num_free == e.pages.size
    assert e.slots is None or e.slots.num_free == e.slots.size
