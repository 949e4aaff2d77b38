"""Transfer plans reproduce the decode side's shards of KV pages and GDN states bit-exactly.

Each case builds a full unsharded cache with random data, shards it as the prefill TP ranks hold it,
runs the plan into decode caches filled with other random data, and compares with the full cache
sharded as the decode ranks hold it."""
import pytest
import torch

from nvl72.disagg.plan import (CacheLayout, TransferPlanError, axis_copies, build_transfer_plan, head_range,
                               local_map, shard)

PAGE, HEAD_DIM, KERNEL = 4, 8, 4
LAYERS = 3  # layer 0 attention, layers 1-2 GDN (None where a layer has no such cache)


def _full_caches(layout: CacheLayout, pages: int, slots: int, gen: torch.Generator) -> dict[str, list]:
    kv = torch.randn(pages, 2, layout.kv_heads, PAGE, HEAD_DIM, generator=gen).to(torch.bfloat16)
    out = {"kv": [kv, None, None]}
    if layout.hybrid:
        conv_dim = 2 * layout.gdn_k_heads * layout.gdn_k_dim + layout.gdn_v_heads * layout.gdn_v_dim
        out["conv"] = [None] + [torch.randn(slots, conv_dim, KERNEL - 1, generator=gen).to(torch.bfloat16)
                                for _ in range(2)]
        out["recurrent"] = [None] + [torch.randn(slots, layout.gdn_v_heads, layout.gdn_k_dim, layout.gdn_v_dim,
                                                 generator=gen) for _ in range(2)]
    return out


def _shard_all(full: dict, layout: CacheLayout, tp: int, rank: int) -> dict:
    return {k: [None if t is None else shard(t, k, layout, tp, rank) for t in ts] for k, ts in full.items()}


def _garbage_like(caches: dict, gen: torch.Generator) -> dict:
    return {k: [None if t is None else torch.randn(t.shape, generator=gen).to(t.dtype) for t in ts]
            for k, ts in caches.items()}


LAYOUTS = {
    "kv4-gdn": CacheLayout(kv_heads=4, gdn_k_heads=4, gdn_v_heads=8, gdn_k_dim=6, gdn_v_dim=5),
    "kv2-replicated": CacheLayout(kv_heads=2, gdn_k_heads=2, gdn_v_heads=4, gdn_k_dim=6, gdn_v_dim=5),
    "kv8-attention-only": CacheLayout(kv_heads=8),
}


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("src_tp,dst_tp", [(4, 1), (2, 1), (4, 2), (1, 1)])
def test_plan_reproduces_decode_shards_bit_exactly(layout_name, src_tp, dst_tp):
    layout = LAYOUTS[layout_name]
    gen = torch.Generator().manual_seed(1000 * src_tp + dst_tp)
    src_pages_n, dst_pages_n = 7, 9
    full = _full_caches(layout, src_pages_n, slots=3, gen=gen)
    src = [_shard_all(full, layout, src_tp, r) for r in range(src_tp)]
    # The decode side's pools are larger and hold unrelated data; the request gets other page ids.
    dst_full = _full_caches(layout, dst_pages_n, slots=5, gen=gen)
    dst = [_garbage_like(_shard_all(dst_full, layout, dst_tp, r), gen) for r in range(dst_tp)]
    untouched = [{k: [None if t is None else t.clone() for t in ts] for k, ts in d.items()} for d in dst]
    src_pages, dst_pages = [5, 0, 3], [8, 2, 6]
    plan = build_transfer_plan(layout, src_tp, dst_tp, src_pages, dst_pages,
                               src_slot=1 if layout.hybrid else None, dst_slot=4 if layout.hybrid else None)
    plan.apply_local(src, dst)

    for d in range(dst_tp):
        want = _shard_all(full, layout, dst_tp, d)
        for sp, dp in zip(src_pages, dst_pages):
            assert torch.equal(dst[d]["kv"][0][dp], want["kv"][0][sp])
        other = [p for p in range(dst_pages_n) if p not in dst_pages]
        assert torch.equal(dst[d]["kv"][0][other], untouched[d]["kv"][0][other])
        if layout.hybrid:
            for kind in ("conv", "recurrent"):
                for layer in (1, 2):
                    assert torch.equal(dst[d][kind][layer][4], want[kind][layer][1])
                    assert torch.equal(dst[d][kind][layer][:4], untouched[d][kind][layer][:4])


@pytest.mark.parametrize("src_tp,dst_tp", [(4, 1), (2, 1), (4, 2), (8, 1), (8, 2)])
def test_each_head_is_sent_once_per_decode_rank(src_tp, dst_tp):
    layout = LAYOUTS["kv2-replicated"]
    for kind in layout.kinds():
        segs = layout.segments(kind)
        copies = axis_copies(segs, src_tp, dst_tp)
        for d in range(dst_tp):
            need = sum((hi - lo) for lo, hi, _ in local_map(segs, dst_tp, d))
            got = sorted((lo, lo + n) for _, _, dd, lo, n in copies if dd == d)
            assert sum(b - a for a, b in got) == need  # nothing sent twice ...
            assert all(got[i][1] <= got[i + 1][0] for i in range(len(got) - 1))  # ... and no overlap


def test_replicated_kv_heads_spread_sources():
    # TP4 over 2 KV heads: ranks (0,1) hold head 0, (2,3) head 1. Decode rank d takes its heads from
    # replica d % 2, so TP4 -> TP2 sends head 0 from rank 0 and head 1 from rank 3; TP4 -> TP1 sends
    # each head once, from ranks 0 and 2.
    segs = CacheLayout(kv_heads=2).segments("kv")
    assert [(s, d) for s, _, d, _, _ in axis_copies(segs, 4, 2)] == [(0, 0), (3, 1)]
    assert [(s, s_lo, d, d_lo, n) for s, s_lo, d, d_lo, n in axis_copies(segs, 4, 1)] == [(0, 0, 0, 0, 1), (2, 0, 0, 1, 1)]


def test_conv_segments_are_sliced_separately():
    # TP2 over [q|k|v] with 2 k-heads (dim 3) and 4 v-heads (dim 2): rank 1 holds q head 1, k head 1,
    # v heads 2-3, i.e. channels [3,6), [9,12), [16,20) of the full 20.
    layout = CacheLayout(kv_heads=2, gdn_k_heads=2, gdn_v_heads=4, gdn_k_dim=3, gdn_v_dim=2)
    assert local_map(layout.segments("conv"), 2, 1) == [(3, 6, 0), (9, 12, 3), (16, 20, 6)]
    full = torch.arange(20.0).reshape(1, 20, 1)
    assert shard(full, "conv", layout, 2, 1).flatten().tolist() == [3, 4, 5, 9, 10, 11, 16, 17, 18, 19]


def test_bad_inputs_name_the_value():
    with pytest.raises(TransferPlanError, match="TP 3"):
        head_range(4, 3, 0)
    with pytest.raises(TransferPlanError, match="TP 6"):
        head_range(4, 6, 0)
    with pytest.raises(TransferPlanError, match="3 pages.*2"):
        build_transfer_plan(CacheLayout(kv_heads=4), 2, 1, [0, 1, 2], [0, 1])
    with pytest.raises(TransferPlanError, match="state slots"):
        build_transfer_plan(LAYOUTS["kv4-gdn"], 2, 1, [0], [0])
