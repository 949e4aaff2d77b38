"""Radix tree over pages: matching, hybrid cut-back to checkpoints, LRU eviction, references."""
import pytest

from nvl72.cache import OutOfCapacity, PrefixCache, RefPool

P = 4


def make(hybrid=False, pages=16, slots=8):
    pp = RefPool("pages", pages)
    sp = RefPool("slots", slots) if hybrid else None
    return PrefixCache(P, pp, sp, hybrid=hybrid), pp, sp


def release(cache, m):
    for p in m.pages:
        cache.pages.decref(p)
    if m.slot >= 0:
        cache.slots.decref(m.slot)


def test_pool_refcounts_and_errors():
    pool = RefPool("pages", 3)
    a = pool.alloc(2)
    pool.incref(a[0])
    pool.decref(a[0])
    assert pool.num_free == 1
    with pytest.raises(OutOfCapacity, match="asked for 2, 1 free of 3"):
        pool.alloc(2)
    pool.decref(a[0])
    with pytest.raises(ValueError, match=f"decref of free id {a[0]}"):
        pool.decref(a[0])


def test_match_whole_pages_and_share():
    cache, pp, _ = make()
    toks = list(range(10, 21))  # 11 tokens -> 2 full pages
    pages = pp.alloc(3)
    cache.insert(toks, pages)
    assert [pp.refcount(p) for p in pages] == [2, 2, 1]  # the tree holds the two full pages
    m = cache.match(toks[:9] + [99, 98])
    assert m.pages == pages[:2] and m.num_tokens == 8
    assert cache.match(toks[:3]).num_tokens == 0  # less than a page
    assert cache.match([1] + toks[1:]).num_tokens == 0
    release(cache, m)


def test_hybrid_hit_cut_to_checkpoint():
    cache, pp, sp = make(hybrid=True)
    toks = list(range(100, 116))  # 4 pages
    pages = pp.alloc(4)
    ckpt = sp.alloc(2)
    cache.insert(toks, pages, {0: ckpt[0], 2: ckpt[1]})
    m = cache.match(toks)
    assert m.num_tokens == 12 and m.slot == ckpt[1] and m.pages == pages[:3]
    assert sp.refcount(ckpt[1]) == 3  # caller, tree, the test's own reference
    release(cache, m)
    m = cache.match(toks[:11] + [0])  # diverges inside page 2: back to the checkpoint of page 0
    assert m.num_tokens == 4 and m.slot == ckpt[0]
    release(cache, m)


def test_lru_eviction_spares_pages_in_use():
    cache, pp, _ = make(pages=8)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]
    pa, pb = pp.alloc(2), pp.alloc(2)
    cache.insert(a, pa)
    cache.insert(b, pb)
    for p in pa + pb:
        pp.decref(p)  # the sequences finished: only the tree holds them
    m = cache.match(a)  # a is now more recent, and in use
    assert cache.num_evictable_pages() == 2
    assert cache.evict_pages(3) == 2  # b's two pages (leaf first, then its parent); a is pinned
    assert cache.match(b).num_tokens == 0
    release(cache, m)
    assert cache.evict_pages(10) == 2
    assert pp.num_free == 8 and cache.num_nodes == 0


def test_checkpoint_eviction_keeps_kv_and_clear_frees_all():
    cache, pp, sp = make(hybrid=True)
    toks = list(range(30, 42))
    pages, slots = pp.alloc(3), sp.alloc(3)
    cache.insert(toks, pages, {0: slots[0], 1: slots[1], 2: slots[2]})
    for x in pages:
        pp.decref(x)
    for x in slots:
        sp.decref(x)
    assert cache.evict_slots(1) == 1  # equally recent: the shallowest goes first
    m = cache.match(toks + [1])
    assert m.num_tokens == 12 and m.slot == slots[2]
    release(cache, m)
    cache.clear()
    assert pp.num_free == pp.size and sp.num_free == sp.size
