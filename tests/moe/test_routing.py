"""Routing and permutation: top-k semantics, contiguous/masked layouts, round trips."""
import pytest
import torch

from moe import reference
from moe.routing import permute_contiguous, permute_masked


def _ids(t, e, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])


def test_route_matches_softmax_topk():
    logits = torch.randn(33, 16)
    w, ids = reference.route(logits, 4, True)
    p = torch.softmax(logits, -1)
    assert torch.allclose(w.sum(-1), torch.ones(33))
    assert torch.allclose(w * p.gather(1, ids).sum(-1, keepdim=True), p.gather(1, ids))
    assert bool((p.gather(1, ids)[:, -1:] >= p.topk(5, -1).values[:, -1:]).all())


@pytest.mark.parametrize("offset,num_local", [(0, 8), (4, 4), (6, 2)])
def test_contiguous_layout(offset, num_local):
    ids = _ids(50, 8, 3)
    p = permute_contiguous(ids, num_local, offset, align=16)
    local = (ids >= offset) & (ids < offset + num_local)
    assert torch.equal(p.row_of >= 0, local)
    assert p.num_rows % 16 == 0 and p.tile_expert.numel() == p.num_rows // 16
    rows = p.row_of[local]
    assert rows.unique().numel() == rows.numel()  # each pair gets its own row
    # every pair sits in a tile of its own expert, and token_of points back to it
    assert torch.equal(p.tile_expert[rows // 16].long() + offset, ids[local])
    tok = torch.arange(50)[:, None].expand_as(ids)
    assert torch.equal(p.token_of[rows], tok[local])
    assert int((p.token_of >= 0).sum()) == int(local.sum())
    assert torch.equal(p.counts, torch.bincount(ids[local] - offset, minlength=num_local))


def test_masked_layout_and_overflow():
    ids = _ids(40, 6, 2, seed=1)
    p = permute_masked(ids, 6, capacity=40)
    e = p.row_of // 40
    assert torch.equal(e, ids)
    assert bool(((p.row_of % 40) < p.counts[ids]).all())
    with pytest.raises(ValueError, match="capacity=3"):
        permute_masked(ids, 6, capacity=3)


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_permute_unpermute_round_trip(layout):
    x = torch.randn(30, 64)
    ids = _ids(30, 8, 2, seed=2)
    w = torch.rand(30, 2)
    p = permute_contiguous(ids, 8, 0, 8) if layout == "contiguous" else permute_masked(ids, 8, 30)
    grouped = torch.zeros(p.num_rows, 64)
    valid = p.token_of >= 0
    grouped[valid] = x[p.token_of[valid]]
    out = reference.unpermute(grouped, p.row_of, w)
    assert torch.allclose(out, x * w.sum(-1, keepdim=True), rtol=1e-5, atol=1e-6)


def test_unpermute_skips_other_ranks_slots_even_over_nan_rows():
    """Slots of experts on other EP ranks (row -1) contribute nothing, even where the row they would
    clamp to was never written (NaN, as in an empty buffer)."""
    y = torch.randn(6, 16)
    y[0] = float("nan")
    row_of = torch.tensor([[-1, 2], [3, -1], [-1, -1]])
    w = torch.rand(3, 2)
    out = reference.unpermute(y, row_of, w)
    assert torch.isfinite(out).all()
    assert torch.allclose(out[0], w[0, 1] * y[2]) and torch.allclose(out[1], w[1, 0] * y[3])
    assert torch.equal(out[2], torch.zeros(16))


def test_empty_experts_and_no_tokens():
    ids = torch.zeros(5, 1, dtype=torch.long)  # everything to expert 0
    p = permute_contiguous(ids, 4, 0, 8)
    assert p.counts.tolist() == [5, 0, 0, 0] and p.tile_expert.tolist() == [0]
    p0 = permute_contiguous(torch.zeros(0, 2, dtype=torch.long), 4, 0, 8)
    assert p0.num_rows == 0 and p0.tile_expert.numel() == 0
