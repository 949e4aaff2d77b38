"""AllReduce on CPU: algorithm selection, the torch.distributed (gloo) reference against an
independent fp32 sum on random data of odd sizes, add_rmsnorm semantics, typed input errors."""
import pytest
import torch
import torch.distributed as dist

from comms.allreduce import (LAMPORT_MAX_BYTES, MAX_BLOCKS, ONESHOT_MAX_BYTES, PIPE_TILE, PUSH_PARTS, THREADS,
                             AllReduce, AllReduceError, buffers_in_heap, check_blocks, heap_bytes, heap_kernel,
                             heap_regions, pipe_blocks,
                             pipe_schedule, pipe_tiles, rmsnorm_reference, select_algo, twoshot_blocks, twoshot_grid,
                             twoshot_slices)
from tests.comms.test_heap import run_ranks


def test_select_algo_by_size_and_capability():
    kw = dict(device="cuda", multicast=False, max_bytes=64 << 20)
    assert select_algo(0, 2, **kw) == "lamport"
    assert select_algo(LAMPORT_MAX_BYTES, 2, **kw) == "lamport"
    assert select_algo(LAMPORT_MAX_BYTES + 16, 2, **kw) == "oneshot"
    assert select_algo(ONESHOT_MAX_BYTES, 8, **kw) == "oneshot"
    assert select_algo(ONESHOT_MAX_BYTES + 16, 2, **kw) == "twoshot"
    assert select_algo(64 << 20, 8, **kw) == "twoshot"
    assert select_algo((64 << 20) + 16, 2, **kw) == "nccl"
    assert select_algo(1 << 20, 9, **kw) == "nccl"
    # a small workspace caps the Lamport range too
    assert select_algo(2 << 20, 2, device="cuda", multicast=False, max_bytes=1 << 20) == "nccl"
    assert select_algo(1 << 20, 2, device="cuda", multicast=False, max_bytes=1 << 20) == "lamport"
    assert select_algo(32 << 20, 4, device="cuda", multicast=True, max_bytes=64 << 20) == "multimem"
    assert select_algo(1 << 10, 4, device="cuda", multicast=True, max_bytes=64 << 20) == "lamport"
    assert select_algo(1 << 30, 4, device="cpu", multicast=False, max_bytes=1) == "reference"
    with pytest.raises(AllReduceError, match="nbytes=-1"):
        select_algo(-1, 2, **kw)


def test_select_algo_takes_twoshot_push_for_heap_buffers_in_the_twoshot_range_only():
    kw = dict(device="cuda", multicast=False, max_bytes=128 << 20, in_heap=True)
    for nbytes in (ONESHOT_MAX_BYTES + 16, 32 << 20, 128 << 20):
        assert select_algo(nbytes, 2, **kw) == "twoshot_push", nbytes
        assert select_algo(nbytes, 2, **{**kw, "in_heap": False}) == "twoshot", nbytes
    assert select_algo(LAMPORT_MAX_BYTES, 2, **kw) == "lamport"
    assert select_algo(ONESHOT_MAX_BYTES, 2, **kw) == "oneshot"
    assert select_algo((128 << 20) + 16, 2, **kw) == "nccl"
    assert select_algo(1 << 20, 9, **kw) == "nccl"
    assert select_algo(32 << 20, 2, **{**kw, "multicast": True}) == "multimem"
    assert select_algo(32 << 20, 2, **{**kw, "device": "cpu"}) == "reference"


def test_buffers_in_heap_needs_both_aligned_and_whole_vectors():
    assert buffers_in_heap(0, 0, 32) and buffers_in_heap(4096, 1 << 20, 1 << 20)
    for xo, oo, nbytes in ((None, 0, 32), (0, None, 32), (0, 0, 8194), (8, 0, 32), (0, 24, 32)):
        assert not buffers_in_heap(xo, oo, nbytes), (xo, oo, nbytes)


def test_blocks_override_is_clamped_and_replaces_the_default_grid():
    assert check_blocks(None) is None
    assert check_blocks(1) == 1 and check_blocks(132) == 132 and check_blocks(MAX_BLOCKS + 1) == MAX_BLOCKS
    for bad in (0, -3, 1.5, True, "132"):
        with pytest.raises(AllReduceError, match="blocks="):
            check_blocks(bad)
    nvec = (128 << 20) // 16
    assert twoshot_grid("twoshot_push", nvec, 2, None) == twoshot_blocks(nvec, 2) == MAX_BLOCKS
    assert twoshot_grid("twoshot_push", nvec, 2, None, sms=132) == 132  # one wave
    assert twoshot_grid("twoshot_push", 4097, 2, None, sms=132) == twoshot_blocks(4097, 2) == 5
    assert twoshot_grid("twoshot", nvec, 2, None, sms=132) == MAX_BLOCKS
    assert twoshot_grid("twoshot_pipe", 4097, 2, None) == pipe_blocks(4097, 2)
    assert twoshot_grid("twoshot_push", nvec, 2, 132) == 132 and twoshot_grid("twoshot_pipe", 1, 2, 7) == 7
    assert pipe_tiles(nvec, 2, 1) == nvec // 2 // PIPE_TILE
    with pytest.raises(AllReduceError, match="exceed"):
        pipe_tiles(PIPE_TILE * (1 << 16) + 1, 1, 1)


@pytest.mark.parametrize("nblocks", [1, 7, 132, 176, 220, MAX_BLOCKS])
def test_twoshot_slices_cover_128MiB_once_for_any_block_count(nblocks):
    nvec, world = (128 << 20) // 16 + 3, 2  # a short last chunk
    for parts in (1, PUSH_PARTS):
        assert _coverage(twoshot_slices(nvec, world, nblocks, parts), nvec) == 1, f"{nblocks} blocks, {parts} parts"


def _coverage(slices, nvec):
    """How many times the [block][part][owner] spans cover each vector: 1 when all cover it once."""
    seen = torch.zeros(nvec, dtype=torch.int32)
    for block in slices:
        for spans in block:
            for a, e in spans:
                assert a <= e
                seen[a:e] += 1
    return int(seen.min()) if int(seen.min()) == int(seen.max()) else -1


def test_heap_kernel_runs_twoshot_push_only_for_aligned_heap_buffers():
    assert heap_kernel("twoshot_push", 4096, 4096, 1 << 20) == "twoshot_push"  # in place
    assert heap_kernel("twoshot_push", 0, 1 << 20, 32) == "twoshot_push"
    assert heap_kernel("twoshot", 0, 1 << 20, 32) == "twoshot_symm"
    for xo, oo, nbytes in ((None, 0, 32), (0, None, 32), (None, None, 32), (0, 0, 8194), (8, 0, 32), (0, 24, 32)):
        assert heap_kernel("twoshot_push", xo, oo, nbytes) == "twoshot", (xo, oo, nbytes)  # staged
        assert heap_kernel("twoshot", xo, oo, nbytes) == "twoshot", (xo, oo, nbytes)
    assert heap_kernel("oneshot", 0, 0, 32) == "oneshot" and heap_kernel("twoshot_pipe", 0, 0, 32) == "twoshot_pipe"


def _run_push_model(bufs, nblocks, order):
    """Execute twoshot_push on CPU part by part of every block, (block, part) units in `order`
    (each unit's whole protocol before the next one's, the worst case for in place): every rank
    pushes its part of the chunks it does not own into the owner's scratch, then every owner sums
    its part (fp32, rank order: its own x, the peers' scratch) and stores the sum into every rank's
    buffer, its own included. bufs: each rank's [nvec, epv] x, reduced in place."""
    world, nvec = len(bufs), bufs[0].shape[0]
    slices = twoshot_slices(nvec, world, nblocks, PUSH_PARTS)
    scratch = [[torch.full_like(x, float("nan")) for _ in range(world)] for x in bufs]  # [owner][src]
    for b, j in order:
        for r in range(world):
            for c, (a, e) in enumerate(slices[b][j]):
                if c != r:
                    scratch[c][r][a:e] = bufs[r][a:e]
        for r in range(world):
            a, e = slices[b][j][r]
            acc = torch.zeros_like(bufs[r][a:e], dtype=torch.float32)
            for s in range(world):
                acc += (bufs[r] if s == r else scratch[r][s])[a:e].float()
            res = acc.to(bufs[r].dtype)
            for p in range(world):
                bufs[p][a:e] = res


@pytest.mark.parametrize("world,nvec", [(2, 1), (2, 4097), (3, 3 * THREADS + 5), (2, 600 * THREADS + 1), (8, 70001)])
def test_twoshot_push_slices_cover_every_vector_once_and_sum_in_place(world, nvec):
    nb = twoshot_blocks(nvec, world)
    for nblocks in {nb, 1, 3}:
        for parts in (1, PUSH_PARTS):
            assert _coverage(twoshot_slices(nvec, world, nblocks, parts), nvec) == 1, (nblocks, parts)
    g = torch.Generator().manual_seed(world * 1000 + nvec)
    for dtype in (torch.bfloat16, torch.float32):
        xs = [torch.randn(nvec, 4, generator=g).to(dtype) for _ in range(world)]
        ref = sum(x.float() for x in xs).to(dtype)
        for nblocks in {nb, 3}:
            units = [(b, j) for b in range(nblocks) for j in range(PUSH_PARTS)]
            for order in (units, units[::-1], units[1::2] + units[::2]):
                bufs = [x.clone() for x in xs]
                _run_push_model(bufs, nblocks, order)
                for r, y in enumerate(bufs):
                    assert torch.equal(y, ref), f"world={world} nvec={nvec} nblocks={nblocks} {dtype} rank {r}"


def test_twoshot_grid():
    assert twoshot_blocks((128 << 20) // 16, 2) == MAX_BLOCKS  # 4 Mi vectors per chunk
    assert twoshot_blocks(2 * THREADS * 10, 2) == 10 and twoshot_blocks(2 * THREADS * 10 + 1, 2) == 11
    assert twoshot_blocks(1, 2) == 1 and twoshot_blocks(1, 8) == 1


def _run_pipe_model(xs, nblocks):
    """Execute twoshot_pipe's tile walk on CPU as the kernel does, step by step: reduce-scatter
    push, owner reduce (fp32, rank order) into out and every peer's gather slot, copy-out of the
    peers' tiles. xs: each rank's [nvec, epv] vectors; returns each rank's out."""
    world, nvec = len(xs), xs[0].shape[0]
    walk = pipe_schedule(nvec, world, nblocks)
    outs = [torch.full_like(x, float("nan")) for x in xs]
    scatter = [[torch.full_like(x, float("nan")) for _ in range(world)] for x in xs]  # [dst][src]
    gather = [torch.full_like(x, float("nan")) for x in xs]
    for steps in walk:
        for spans in steps:
            for r in range(world):
                for c, (a, b) in enumerate(spans):
                    if c != r:
                        scatter[c][r][a:b] = xs[r][a:b]
            for r in range(world):
                a, b = spans[r]
                acc = torch.zeros_like(xs[r][a:b], dtype=torch.float32)
                for s in range(world):
                    acc += (xs[r] if s == r else scatter[r][s])[a:b].float()
                res = acc.to(xs[r].dtype)
                outs[r][a:b] = res
                for p in range(world):
                    if p != r:
                        gather[p][a:b] = res
            for r in range(world):
                for c, (a, b) in enumerate(spans):
                    if c != r:
                        outs[r][a:b] = gather[r][a:b]
    return outs


@pytest.mark.parametrize("world,nvec", [(2, 1), (2, 4097), (3, 3 * PIPE_TILE + 5), (2, 9 * PIPE_TILE), (8, 70001)])
def test_twoshot_pipe_walk_covers_every_vector_once_and_sums(world, nvec):
    nb = pipe_blocks(nvec, world)
    walk = pipe_schedule(nvec, world, nb)
    seen = torch.zeros(nvec, dtype=torch.int32)
    for steps in walk:
        for spans in steps:
            for a, b in spans:
                seen[a:b] += 1
    assert torch.equal(seen, torch.ones_like(seen)), "every vector in exactly one tile of one owner"
    g = torch.Generator().manual_seed(world * 1000 + nvec)
    for dtype in (torch.bfloat16, torch.float32):
        xs = [torch.randn(nvec, 4, generator=g).to(dtype) for _ in range(world)]
        ref = sum(x.float() for x in xs).to(dtype)
        for nblocks in {nb, 1, 3}:
            for y in _run_pipe_model(xs, nblocks):
                assert torch.equal(y, ref), f"world={world} nvec={nvec} nblocks={nblocks} {dtype}"


def test_twoshot_pipe_grid_pipelines_large_messages():
    # 128 MiB over 2 ranks: 2048 tiles per chunk, 256 blocks of 8 steps each
    nvec = (128 << 20) // 16
    assert pipe_blocks(nvec, 2) == MAX_BLOCKS and len(pipe_schedule(nvec, 2, MAX_BLOCKS)[0]) == 8
    # 16 MiB: 256 tiles -> 128 blocks of two steps; tiny messages get one block
    assert pipe_blocks((16 << 20) // 16, 2) == 128
    assert pipe_blocks(1, 2) == 1 and pipe_blocks(1, 8) == 1
    with pytest.raises(AllReduceError, match="exceed"):
        pipe_schedule(PIPE_TILE * (1 << 16) + 1, 1, 1)


def test_rmsnorm_reference_formulas():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 33, generator=g)
    w = torch.randn(33, generator=g)
    rms = x.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
    torch.testing.assert_close(rmsnorm_reference(x, w, 1e-5, False), x / rms * w)
    torch.testing.assert_close(rmsnorm_reference(x, w, 1e-5, True), x / rms * (1 + w))


def _inputs(r, n, dtype, case):
    return torch.randn(n, generator=torch.Generator().manual_seed(100 * case + r)).to(dtype)


def _body(rank, world):
    from comms import SymmetricHeap

    heap = SymmetricHeap(dist.group.WORLD, 1 << 16, timeout_s=30)
    ar = AllReduce(heap)
    assert ar.algo == "reference"
    case = 0
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 7, 1000, 4097):
            case += 1
            ref = sum(_inputs(r, n, dtype, case).float() for r in range(world))
            y = ar(_inputs(rank, n, dtype, case))
            assert y.dtype == dtype and y.shape == (n,)
            tol = 1e-6 if dtype == torch.float32 else 8e-3
            assert ((y.float() - ref).norm() / ref.norm()).item() <= tol
            out = torch.empty(n, dtype=dtype)
            assert ar(_inputs(rank, n, dtype, case), out=out) is out and torch.equal(out, y)
    # add_rmsnorm: residual = sum + residual, then RMSNorm (both weight conventions)
    for zc in (False, True):
        case += 1
        t, h = 3, 37
        x = _inputs(rank, t * h, torch.float32, case).view(t, h)  # [T, H]
        res = torch.randn(t, h, generator=torch.Generator().manual_seed(case))
        w = torch.randn(h, generator=torch.Generator().manual_seed(case + 1))
        out, res_out = ar.add_rmsnorm(x, res, w, 1e-6, zero_centered=zc)
        ref_res = sum(_inputs(r, t * h, torch.float32, case) for r in range(world)).view(t, h) + res
        torch.testing.assert_close(res_out, ref_res, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, rmsnorm_reference(ref_res, w, 1e-6, zc), rtol=1e-5, atol=1e-5)
    # typed errors naming the bad value
    with pytest.raises(AllReduceError, match="int64"):
        ar(torch.ones(4, dtype=torch.int64))
    with pytest.raises(AllReduceError, match="contiguous"):
        ar(torch.ones(4, 4).t())
    with pytest.raises(AllReduceError, match="weight shape"):
        ar.add_rmsnorm(torch.ones(2, 8), torch.ones(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(AllReduceError, match="eps=0"):
        ar.add_rmsnorm(torch.ones(2, 8), torch.ones(2, 8), torch.ones(8), 0)
    for algo in ("oneshot", "twoshot_pipe", "twoshot_push"):
        with pytest.raises(AllReduceError, match=f"'{algo}' needs a CUDA heap"):
            AllReduce(heap, algo)
    with pytest.raises(AllReduceError, match="algo='fastest'"):
        AllReduce(heap, "fastest")
    with pytest.raises(AllReduceError, match="blocks=0"):
        AllReduce(heap, blocks=0)
    assert AllReduce(heap, blocks=MAX_BLOCKS + 1).blocks == MAX_BLOCKS
    heap.destroy()


@pytest.mark.mp
@pytest.mark.parametrize("world", [2, 3])
def test_allreduce_reference_matches_fp32_sum(world):
    run_ranks(_body, world)


def _heap_bytes_body(rank, world):
    from comms import SymmetricHeap

    cases = ((2, 1 << 20), (4, 4096), (8, 3 << 20))
    heap = SymmetricHeap(dist.group.WORLD, 3 * sum(heap_bytes(*c) + 4097 for c in cases), timeout_s=30)
    for ranks, max_bytes in cases:
        for start in (1, 255, 4097):  # whatever earlier allocations left, aligned or not
            heap.alloc(start, align=1)
            used = heap.used
            for _, n in heap_regions(ranks, max_bytes):  # what AllReduce.__init__ allocates
                heap.alloc(n)
            assert used < heap.used <= used + heap_bytes(ranks, max_bytes), (ranks, max_bytes, start)
    heap.destroy()


@pytest.mark.mp
def test_heap_bytes_holds_an_allreduce_after_any_earlier_allocation():
    """Heaps are sized with heap_bytes for any world size (the 4-GPU tests outgrew fixed sizes)."""
    assert heap_bytes(4, 1 << 20) > heap_bytes(2, 1 << 20)
    run_ranks(_heap_bytes_body, 1)


def test_perf_graph_pivot_has_a_row_per_size_and_a_column_per_algo():
    from perf.comms.allreduce import _fmt_graph_pivot

    rows = [{"bytes": 2048, "algo": "lamport", "graph_us": 4.25}, {"bytes": 1024, "algo": "lamport", "graph_us": 3.5},
            {"bytes": 1024, "algo": "lamport_nopdl", "graph_us": None}, {"bytes": 1024, "algo": "nccl", "graph_us": 9.0}]
    lines = _fmt_graph_pivot({"allreduce": rows}).splitlines()
    assert lines[1].split() == ["bytes", "lamport", "lamport_nopdl", "nccl"]
    assert lines[2].split() == ["1024", "3.50", "-", "9.00"]
    assert lines[3].split() == ["2048", "4.25", "-", "-"]


def test_perf_blocks_variants_and_ratio_table():
    from perf.comms.allreduce import _fmt_vs, _median, parse_blocks, variants

    assert parse_blocks("auto, 132,256,132") == [None, 132, 256]
    for bad in ("0", "x", "auto,-1", ""):
        with pytest.raises(SystemExit, match="--blocks"):
            parse_blocks(bad)
    assert variants(["twoshot_push", "nccl", "oneshot"], [None, 132]) == [
        ("twoshot_push", "twoshot_push", None), ("twoshot_push@132", "twoshot_push", 132),
        ("nccl", "nccl", None), ("oneshot", "oneshot", None)]
    assert _median([3.0, 1.0, 2.0]) == 2.0 and _median([4.0, 1.0, 2.0, 3.0]) == 2.5
    rows = [{"bytes": 1 << 27, "algo": "twoshot_push", "graph_us": 380.0, "graph_samples_us": [379.0, 380.0, 390.0]},
            {"bytes": 1 << 27, "algo": "twoshot_push@132", "graph_us": 400.0},
            {"bytes": 1 << 27, "algo": "nccl", "graph_us": 470.0},
            {"bytes": 1 << 27, "algo": "torch_two_shot", "graph_us": 425.0},
            {"bytes": 1 << 26, "algo": "twoshot_push", "graph_us": 200.0}]  # no torch row at 64 MiB
    lines = _fmt_vs({"allreduce": rows, "repeat": 3}).splitlines()
    assert "median of 3" in lines[0] and len(lines) == 4
    assert lines[2].split() == ["134217728", "twoshot_push", "380.00", "379.0..390.0", "425.00", "0.894"]
    assert lines[3].split()[1] == "twoshot_push@132" and lines[3].split()[-1] == "0.941"
    assert _fmt_vs({"allreduce": rows[:3]}) == ""
