"""Disaggregated serving at engine level: a prefill-only engine parks each request after its first
token; its pages and GDN state are copied into pages a decode engine reserved; the decode engine's
greedy tokens equal colocated serving (MTP speculation on both sides for the hybrid model)."""
import pytest

from nvl72.cache import OutOfCapacity
from nvl72.engine.engine import InvalidRequest
from nvl72.engine.protocol import AddRequest
from nvl72.engine.spec import MTPDrafter
from tests.engine.test_engine_exact import GREEDY, tokens
from tests.engine.tiny import drain, make_engine, prompts, run_all


def copy_cache(src, s, dst, d):
    """What a transport does: the source pages and state slot into the destination's."""
    n = -(-s.num_tokens // src.config.page_size)
    for a, b in zip(src.caches.kv, dst.caches.kv):
        if a is not None:
            b[d.pages[:n]] = a[s.pages[:n]]
    if s.state_slot >= 0:
        for kind in ("conv", "recurrent"):
            for a, b in zip(getattr(src.caches, kind), getattr(dst.caches, kind)):
                if a is not None:
                    b[d.state_slot] = a[s.state_slot]


@pytest.mark.parametrize("fam,k", [("qwen3_moe", 0), ("qwen3_next", 0), ("qwen3_next", 2)])
def test_disaggregated_equals_colocated(fam, k):
    ps = prompts(5, seed=8)
    want = tokens(run_all(make_engine(fam), ps, GREEDY))

    def engine(**kw):
        return make_engine(fam, drafter=MTPDrafter(k) if k else None, num_speculative_tokens=k, **kw)
    pre, dec = engine(max_num_batched_tokens=10), engine(page_size=4, num_pages=120)
    for i, p in enumerate(ps):
        pre.add_request(AddRequest(f"r{i}", p, GREEDY), prefill_only=True)
    first = drain(pre)
    assert all(v[1] is None and len(v[0]) == 1 for v in first.values())
    for i, p in enumerate(ps):
        rid = f"r{i}"
        src = pre.handoff(rid)
        assert src.num_tokens == len(p) and src.token_ids == p + first[rid][0]
        dst = dec.reserve_transfer(AddRequest(rid, p, GREEDY), src.num_tokens)
        copy_cache(pre, src, dec, dst)
        pre.release(rid)
        dec.commit_transfer(rid, first[rid][0])
    assert pre.pages.num_free + pre.prefix.num_evictable_pages() == pre.pages.size
    rest = drain(dec)
    got = {rid: first[rid][0] + list(rest[rid][0]) for rid in first}
    assert got == want
    if k:
        assert dec.stats()["spec_decode_num_draft_tokens"] > 0


def test_handoff_errors_named():
    e = make_engine("qwen3_next", num_pages=40, max_model_len=128)
    with pytest.raises(InvalidRequest, match="'x' is not parked"):
        e.handoff("x")
    with pytest.raises(InvalidRequest, match="num_tokens=9"):
        e.reserve_transfer(AddRequest("a", [1, 2, 3], GREEDY), 9)
    e.reserve_transfer(AddRequest("big", [7] * 100, GREEDY), 100)
    with pytest.raises(OutOfCapacity, match="'big2'"):
        e.reserve_transfer(AddRequest("big2", [7] * 100, GREEDY), 100)
    with pytest.raises(InvalidRequest, match="need exactly one"):
        e.commit_transfer("big", [5, 6])
    e.abort_request("big")
    assert e.pages.num_free == e.pages.size and e.slots.num_free == e.slots.size
