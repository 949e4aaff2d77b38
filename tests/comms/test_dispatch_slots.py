"""The fused kernels' packing arithmetic (comms/kernels/dispatch.py, phases A1 and C) in plain
torch: sender-side slot indices per (source rank, expert), receiver-side prefix over sources and
expert bases. It must place every entry where the reference's `pack_entries` does."""
import pytest
import torch

from comms.dispatch import pack_entries, token_rank_mask


def _kernel_positions(ids_per_rank, rank, world, num_local, cap, contiguous):
    """{(source rank, token, slot): packed row} as the dispatch kernel computes it for `rank`."""
    E = num_local * world
    recnt = torch.zeros(world, num_local, dtype=torch.long)  # [source, local expert]
    slot = {}
    for s, ids in enumerate(ids_per_rank):  # A1 on every sender: warp g scans tokens in order
        for g in range(rank * num_local, (rank + 1) * num_local):
            running = 0
            for t in range(ids.shape[0]):
                hits = (ids[t] == g).nonzero().flatten().tolist()
                if hits:
                    slot[(s, t, hits[0])] = running
                    running += 1
            recnt[s, g - rank * num_local] = running
    assert E == num_local * world
    pre = torch.cumsum(recnt, 0) - recnt  # exclusive over sources
    totals = recnt.sum(0)
    base = (torch.cumsum(totals, 0) - totals) if contiguous else torch.arange(num_local) * cap
    return {(s, t, j): int(base[g - rank * num_local] + pre[s, g - rank * num_local] + i)
            for (s, t, j), i in slot.items()
            for g in [int(ids_per_rank[s][t, j])]}


@pytest.mark.parametrize("world,num_local,contiguous", [(2, 4, True), (3, 2, False), (4, 3, True)])
def test_kernel_slot_arithmetic_equals_reference_packing(world, num_local, contiguous):
    gen = torch.Generator().manual_seed(world * 10 + num_local)
    E, K = world * num_local, min(3, world * num_local)
    ids_per_rank = [torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(int(n))])
                    for n in torch.randint(0, 9, (world,), generator=gen)]
    for rank in range(world):
        # the reference's received rows: (source, token) ascending over tokens sent to `rank`
        rows = [(s, t) for s, ids in enumerate(ids_per_rank) if ids.numel()
                for t in torch.nonzero(token_rank_mask(ids, num_local, world)[:, rank]).flatten().tolist()]
        recv_ids = torch.stack([ids_per_rank[s][t] for s, t in rows]) if rows else torch.empty(0, K, dtype=torch.long)
        cap = sum(ids.shape[0] for ids in ids_per_rank)
        row, slot, index, counts, offsets = pack_entries(recv_ids, rank * num_local, num_local, cap, contiguous)
        want = {(rows[r][0], rows[r][1], j): i for r, j, i in zip(row.tolist(), slot.tolist(), index.tolist())}
        assert _kernel_positions(ids_per_rank, rank, world, num_local, cap, contiguous) == want


def _segmented_slots(ids, g, warps=8, lanes=32):
    """The overlap dispatch's A1 for expert g (comms/kernels/dispatch.py): warp w of the block scans
    tokens [w * seg, (w + 1) * seg) with seg = ceil(T / (32 * warps)) * 32, counts its hits, then
    writes running indices from the count of the warps before it. Returns ({(token, slot): index}, total)."""
    T = ids.shape[0]
    seg = -(-T // (lanes * warps)) * lanes
    bounds = [(min(w * seg, T), min(min(w * seg, T) + seg, T)) for w in range(warps)]
    counts = [int((ids[tb:te] == g).any(1).sum()) for tb, te in bounds]
    out = {}
    for w, (tb, te) in enumerate(bounds):
        running = sum(counts[:w])
        for t in range(tb, te):
            hits = (ids[t] == g).nonzero().flatten().tolist()
            if hits:
                out[(t, hits[0])] = running
                running += 1
    return out, sum(counts)


@pytest.mark.parametrize("T", [0, 1, 31, 255, 256, 257, 1000, 4096])
def test_block_parallel_slot_scan_equals_the_single_warp_scan(T):
    """Same indices and count as one warp scanning every token in order (the overlap=0 path), for
    token counts that leave segments partial or empty."""
    gen = torch.Generator().manual_seed(T)
    E, K = 16, 4
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) if T else torch.empty(0, K)
    for g in range(E):
        want, running = {}, 0
        for t in range(T):
            hits = (ids[t] == g).nonzero().flatten().tolist()
            if hits:
                want[(t, hits[0])] = running
                running += 1
        assert _segmented_slots(ids, g) == (want, running)
