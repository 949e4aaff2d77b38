"""Rank-tagged inputs and routing patterns shared by the dispatch tests (no pytest import: the
GPU hosts run test_dispatch_gpu.py as a script)."""
from __future__ import annotations

import torch

HIDDEN, TOPK = 32, 4
CASES = ("random", "empty_experts", "one_rank", "same_rank_slots")


def tagged_tokens(rank: int, T: int, gen: torch.Generator, hidden: int = HIDDEN) -> torch.Tensor:
    """[T, H] bf16 random rows whose channels 0/1 hold the source rank and token index (exact in bf16)."""
    x = torch.randn(T, hidden, generator=gen).to(torch.bfloat16)
    x[:, 0] = rank
    x[:, 1] = torch.arange(T, dtype=torch.float32)
    return x


def routing(case: str, rank: int, world: int, T: int, E: int, gen: torch.Generator, topk: int = TOPK):
    """[T, k] distinct expert ids and positive weights for one named routing pattern."""
    per_rank = E // world
    if T == 0:
        return torch.empty(0, topk, dtype=torch.long), torch.empty(0, topk)
    if case == "random":
        ids = torch.stack([torch.randperm(E, generator=gen)[:topk] for _ in range(T)])
    elif case == "empty_experts":  # only experts 0, 2, 4, ... of each rank's first half get tokens
        pool = torch.tensor([r * per_rank + e for r in range(world) for e in range(0, per_rank // 2, 2)])
        ids = torch.stack([pool[torch.randperm(pool.numel(), generator=gen)[:topk]] for _ in range(T)])
    elif case == "one_rank":  # every token's experts all on rank 1
        ids = torch.stack([per_rank + torch.randperm(per_rank, generator=gen)[:topk] for _ in range(T)])
    elif case == "same_rank_slots":  # slots 0..k-2 on the next rank, slot k-1 on this one
        dst = (rank + 1) % world
        ids = torch.stack([torch.cat([dst * per_rank + torch.randperm(per_rank, generator=gen)[:topk - 1],
                                      torch.tensor([rank * per_rank + int(torch.randint(per_rank, (1,), generator=gen))])])
                           for _ in range(T)])
    else:
        raise ValueError(f"routing case {case!r}")
    w = torch.rand(T, topk, generator=gen) + 0.1
    return ids.long(), w / w.sum(1, keepdim=True)



def test_routing_cases_are_valid_topk():
    gen = torch.Generator().manual_seed(0)
    for case in CASES:
        for rank in range(4):
            ids, w = routing(case, rank, 4, 9, 32, gen)
            assert ids.shape == (9, TOPK) and ((ids >= 0) & (ids < 32)).all(), case
            assert all(len(set(r)) == TOPK for r in ids.tolist()), f"{case}: repeated expert in a row"
            assert torch.allclose(w.sum(1), torch.ones(9)) and (w > 0).all(), case
    x = tagged_tokens(3, 5, gen)
    assert x[:, 0].eq(3).all() and x[:, 1].tolist() == [0, 1, 2, 3, 4]
