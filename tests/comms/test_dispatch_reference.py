"""DispatchCombine reference (torch.distributed over gloo): multi-process, rank-tagged tokens.

Each token's row is tagged with its source rank and index (in its first two channels) so receivers
check where every packed row came from; experts are the identity, so combine must return
sum_k w_k x for every token."""
from __future__ import annotations

import datetime
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from comms.dispatch import CapacityError, DispatchCombine, pack_entries, token_rank_mask
from tests.comms.test_dispatch_inputs import CASES, HIDDEN, TOPK, routing, tagged_tokens

TIMEOUT_S = 60


def _expected(x, ids, w, per_rank, world):
    """sum_k w_k x in fp32, with the kernel's rounding: per-rank fp32 partial -> bf16 -> fp32 sum."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for r in range(world):
        part = torch.zeros(x.shape, dtype=torch.float32)
        for j in range(TOPK):
            on_r = (ids[:, j] // per_rank == r)[:, None]
            part = part + torch.where(on_r, x.float() * w[:, j:j + 1], 0.0)
        out = out + part.to(torch.bfloat16).float()
    return out.to(torch.bfloat16)


def _check_dp_ep(rank, world, E, T, case, layout, gen):
    per_rank = E // world
    ep = DispatchCombine(dist.group.WORLD, E, TOPK, HIDDEN, max_tokens_per_rank=16,
                         mode="dp_ep", layout=layout)
    x = tagged_tokens(rank, T, gen)
    ids, w = routing(case, rank, world, T, E, gen)
    recv, handle = ep.dispatch(x, ids, w)
    # every packed row came from the rank/token its tag says and holds that token's routed expert
    all_x = [torch.empty(16, HIDDEN, dtype=torch.bfloat16) for _ in range(world)]
    all_ids = [torch.empty(16, TOPK, dtype=torch.int64) for _ in range(world)]
    all_w = [torch.empty(16, TOPK) for _ in range(world)]
    pad = lambda t: torch.cat([t, t.new_zeros(16 - T, *t.shape[1:])])  # noqa: E731
    dist.all_gather(all_x, pad(x)); dist.all_gather(all_ids, pad(ids)); dist.all_gather(all_w, pad(w))
    flat = recv.x.reshape(-1, HIDDEN)  # [E_local * cap, H]
    total = 0
    for e in range(per_rank):
        g = rank * per_rank + e
        rows = range(int(recv.offsets[e]), int(recv.offsets[e]) + int(recv.counts[e]))
        want = [(r, t) for r in range(world) for t in range(T) if g in all_ids[r][t].tolist()]
        got = [(int(recv.src_rank[i]), int(recv.src_token[i])) for i in rows]
        assert got == want, f"rank {rank} expert {g}: rows from {got}, expected {want}"
        for i, (r, t) in zip(rows, want):
            assert int(flat[i, 0]) == r and int(flat[i, 1]) == t, f"tag mismatch at row {i}: {flat[i, :2]}"
            assert torch.equal(flat[i], all_x[r][t])
            slot = all_ids[r][t].tolist().index(g)
            assert float(recv.weights[i]) == float(all_w[r][t, slot])
        total += len(want)
    if case == "empty_experts":
        assert (recv.counts[1::2] == 0).all(), recv.counts
    if case == "one_rank" and rank != 1:
        assert total == 0
    out = ep.combine(recv.x, handle)  # identity experts
    assert out.dtype == torch.bfloat16 and out.shape == (T, HIDDEN)
    exp = _expected(x, ids, w, per_rank, world)
    assert torch.equal(out, exp), f"combine mismatch: max err {(out.float() - exp.float()).abs().max()}"
    ref = (x.float()[:, None, :] * w[:, :, None]).sum(1)  # plain fp32 sum_k w_k x
    rel = (out.float() - ref).norm() / ref.norm().clamp_min(1e-30)
    assert rel < 1e-2, rel


def _check_replicated(rank, world, E, T, gen, heap=None):
    """Replicated inputs; partials summed by torch.distributed (group) or comms.AllReduce (heap)."""
    gen.manual_seed(1234)  # same inputs on every rank
    x = tagged_tokens(0, T, gen)
    ids, w = routing("random", 0, world, T, E, gen)
    ep = DispatchCombine(heap if heap is not None else dist.group.WORLD, E, TOPK, HIDDEN, max_tokens_per_rank=16,
                         mode="replicated")
    assert (ep._all_reduce is not None) == (heap is not None)
    recv, handle = ep.dispatch(x, ids, w)
    per_rank = E // world
    for e in range(per_rank):
        g = rank * per_rank + e
        rows = range(int(recv.offsets[e]), int(recv.offsets[e]) + int(recv.counts[e]))
        assert [int(recv.src_token[i]) for i in rows] == [t for t in range(T) if g in ids[t].tolist()]
    out = ep.combine(recv.x, handle)
    ref = (x.float()[:, None, :] * w[:, :, None]).sum(1)
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < 1e-2, rel


def _worker(rank, world, path):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        gen = torch.Generator().manual_seed(100 + rank)
        E = 8 * world
        for layout in ("masked", "contiguous"):
            for case in CASES:
                for T in (1, 13):
                    _check_dp_ep(rank, world, E, T, case, layout, gen)
        _check_dp_ep(rank, world, E, 0, "random", "masked", gen)  # a rank with no tokens
        _check_replicated(rank, world, E, 13, gen)
        from comms.heap import SymmetricHeap

        with SymmetricHeap(dist.group.WORLD, 1 << 20, device="cpu", timeout_s=TIMEOUT_S) as heap:
            _check_replicated(rank, world, E, 13, gen, heap)
            # a CPU heap in dp_ep mode runs the reference all_to_all over the heap's group
            ep = DispatchCombine(heap, E, TOPK, HIDDEN, 16, mode="dp_ep")
            assert ep._fused is None
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(world):
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.spawn(_worker, args=(world, os.path.join(d, "store")), nprocs=world, join=False)
        deadline = TIMEOUT_S * 2
        t0 = time.monotonic()
        while not ctx.join(timeout=5):
            if time.monotonic() - t0 > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"dispatch workers did not finish within {deadline} s")


@pytest.mark.mp
@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_combine_gloo(world):
    _spawn(world)


def test_pack_entries_order_and_capacity():
    ids = torch.tensor([[5, 1], [1, 4], [4, 6]])
    row, slot, index, counts, offsets = pack_entries(ids, expert_offset=4, num_local=4, cap=3, contiguous=True)
    assert counts.tolist() == [2, 1, 1, 0]
    assert list(zip(row.tolist(), slot.tolist())) == [(1, 1), (2, 0), (0, 0), (2, 1)]
    assert index.tolist() == [0, 1, 2, 3] and offsets.tolist() == [0, 2, 3, 4, 4]
    *_, offsets_m = pack_entries(ids, 4, 4, 3, contiguous=False)
    assert offsets_m.tolist() == [0, 3, 6, 9, 12]
    with pytest.raises(CapacityError, match="expert capacity 1"):
        pack_entries(ids, 4, 4, 1, contiguous=True)


def test_token_rank_mask_dedups_slots():
    mask = token_rank_mask(torch.tensor([[0, 1, 7], [6, 7, 5]]), experts_per_rank=2, world=4)
    assert mask.tolist() == [[True, False, False, True], [False, False, True, True]]


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="mode='tp'"):
        DispatchCombine(None, 8, 2, 16, 4, mode="tp")
    with pytest.raises(ValueError, match="payload='fp8'"):
        DispatchCombine(None, 8, 2, 16, 4, payload="fp8")
