"""AllReduce on 2+ GPUs (NCCL group, cuMem heap, kernels from the aot bundle or JIT), multicast off:
every algorithm against an fp32 torch reference on random bf16/fp32 data of odd sizes, eager and
under CUDA-graph replay; fused add+RMSNorm; a peer that never arrives makes the host raise."""
import pytest
import torch
import torch.distributed as dist

from comms.allreduce import heap_bytes
from tests.comms.test_heap import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu, pytest.mark.mp]

SIZES = [1, 7, 1000, 4097, 65537, 1_000_003]
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-6}


def _inputs(rank_of, n, dtype, case, dev):
    g = torch.Generator().manual_seed(1000 * case + rank_of)
    return torch.randn(n, generator=g).to(dtype).to(dev)


def _ref(world, n, dtype, case, dev):
    acc = torch.zeros(n, dtype=torch.float32, device=dev)
    for r in range(world):
        acc += _inputs(r, n, dtype, case, dev).float()
    return acc


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _same_on_all_ranks(y):
    ys = [torch.empty_like(y) for _ in range(dist.get_world_size())]
    dist.all_gather(ys, y)
    return all(torch.equal(ys[0], t) for t in ys[1:])


def _check_graph_replays(ar, rank, world, dev, n, reps, case, label, static_x=None) -> int:
    """Capture `ar` on a static bf16 buffer of n elements (after one eager call outside the capture:
    it loads the kernel), replay it `reps` times on fresh inputs, each against the fp32 sum (the
    epoch lives on the device, so replays keep synchronising). static_x: that buffer, reduced in
    place (e.g. one in the heap); default a new tensor, summed into a new one. Returns the last
    input case used."""
    in_place = static_x is not None
    if not in_place:
        static_x = torch.empty(n, dtype=torch.bfloat16, device=dev)
    static_x.copy_(_inputs(rank, n, torch.bfloat16, case, dev))
    ar(static_x, out=static_x if in_place else None)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = ar(static_x, out=static_x if in_place else None)
    for rep in range(reps):
        case += 1
        static_x.copy_(_inputs(rank, n, torch.bfloat16, case, dev))
        g.replay()
        torch.cuda.synchronize()
        ar.check()
        err = _rel(static_y, _ref(world, n, torch.bfloat16, case, dev))
        assert err <= TOL[torch.bfloat16], f"{label} graph replay n={n} {rep}: rel err {err:.3g}"
    return case


def _algos_body(rank, world):
    from comms import AllReduce, AllReduceError, SymmetricHeap

    dev = torch.device("cuda", rank)
    # 6 AllReduce + the pdl=False one + the symmetric in-heap buffers
    heap = SymmetricHeap(dist.group.WORLD, 6 * heap_bytes(world, 8 << 20) + heap_bytes(world, 4 << 20) + (8 << 20),
                         dev, timeout_s=60)
    assert heap.capabilities.p2p and not heap.capabilities.multicast_enabled
    case = 0
    for algo in ("lamport", "oneshot", "twoshot", "twoshot_pipe", "nccl", "auto"):
        used = heap.used
        ar = AllReduce(heap, algo, max_bytes=8 << 20, timeout_s=5)
        assert heap.used - used <= heap_bytes(world, 8 << 20), "AllReduce took more heap than heap_bytes says"
        for dtype in (torch.bfloat16, torch.float32):
            for n in SIZES:
                case += 1
                x = _inputs(rank, n, dtype, case, dev)
                if algo == "lamport" and n * x.element_size() > ar.lam_cap:
                    with pytest.raises(AllReduceError, match="limit"):
                        ar(x)
                    continue
                ref = _ref(world, n, dtype, case, dev)
                y = ar(x)
                torch.cuda.synchronize()
                ar.check()
                err = _rel(y, ref)
                assert err <= TOL[dtype], f"{algo} {dtype} n={n}: rel err {err:.3g}"
                assert _same_on_all_ranks(y), f"{algo} {dtype} n={n}: ranks differ"
                if algo in ("lamport", "oneshot", "twoshot", "twoshot_pipe") and n == 4097:  # in place
                    ar(x, out=x)
                    assert torch.equal(x, y), f"{algo} in-place differs"
                if algo == "twoshot" and n in (1000, 65537):
                    # x and out in the heap: the staging-free kernel (65537: odd bytes, the padded path)
                    xs, os_ = ar.symmetric_empty(n, dtype), ar.symmetric_empty(n, dtype)
                    xs.copy_(x)
                    ar(xs, out=os_)
                    torch.cuda.synchronize()
                    assert torch.equal(os_, y), f"twoshot in-heap {dtype} n={n} differs from staged"
                    ar(xs, out=xs)  # in place on the symmetric buffer, as torch's two_shot_all_reduce_
                    torch.cuda.synchronize()
                    assert torch.equal(xs, y), f"twoshot in-heap in-place {dtype} n={n}"
        if algo in ("lamport", "oneshot", "twoshot", "twoshot_pipe"):
            # 4 > 3: the Lamport buffers rotate through all three
            case = _check_graph_replays(ar, rank, world, dev, 12345, 4, case, algo)
        ar.destroy()
    # pdl=False (graph replays of the default AllReduce above launch with PDL): mixed grid sizes
    # (1 to 123 blocks: the per-block epoch copies must stay equal), then graph replays through all
    # three buffers
    ar = AllReduce(heap, "lamport", max_bytes=4 << 20, timeout_s=5, pdl=False)
    for n in (7, 1_000_003, 4097, 65537, 1000):
        case += 1
        x = _inputs(rank, n, torch.bfloat16, case, dev)
        y = ar(x)
        torch.cuda.synchronize()
        ar.check()
        assert _rel(y, _ref(world, n, torch.bfloat16, case, dev)) <= TOL[torch.bfloat16], f"lamport pdl=False n={n}"
    _check_graph_replays(ar, rank, world, dev, 5000, 4, case, "lamport pdl=False")
    ar.destroy()
    heap.destroy()


def _pipe_body(rank, world):
    """twoshot_pipe alone, up to 64 MiB: odd sizes (1 to 4 pipeline steps per block), bf16 and fp32
    against an fp32 sum, in place, graph replays, then a peer that never arrives (one timeout
    bound for the whole call, however many steps)."""
    from comms import AllReduce, SymmetricHeap
    from comms.allreduce import AllReduceTimeoutError, pipe_blocks, pipe_schedule

    dev = torch.device("cuda", rank)
    heap = SymmetricHeap(dist.group.WORLD, heap_bytes(world, 64 << 20) + heap_bytes(world, 1 << 20) + (4 << 20), dev,
                         timeout_s=60)
    ar = AllReduce(heap, "twoshot_pipe", max_bytes=64 << 20, timeout_s=5)
    case = 0
    for dtype in (torch.bfloat16, torch.float32):
        large = (64 << 20) // torch.empty((), dtype=dtype).element_size() - 3
        nvec = -(-large * torch.empty((), dtype=dtype).element_size() // 16)
        assert len(pipe_schedule(nvec, world, pipe_blocks(nvec, world))[0]) >= 2
        for n in SIZES + [large]:
            case += 1
            x = _inputs(rank, n, dtype, case, dev)
            ref = _ref(world, n, dtype, case, dev)
            y = ar(x)
            torch.cuda.synchronize()
            ar.check()
            err = _rel(y, ref)
            assert err <= TOL[dtype], f"twoshot_pipe {dtype} n={n}: rel err {err:.3g}"
            assert _same_on_all_ranks(y), f"twoshot_pipe {dtype} n={n}: ranks differ"
            if n in (4097, large):
                ar(x, out=x)
                torch.cuda.synchronize()
                assert torch.equal(x, y), f"twoshot_pipe in-place {dtype} n={n} differs"
    for n in (12345, (48 << 20) // 2 + 1):
        case = _check_graph_replays(ar, rank, world, dev, n, 3, case, "twoshot_pipe")
    ar.destroy()
    ar = AllReduce(heap, "twoshot_pipe", max_bytes=1 << 20, timeout_s=0.2)
    x = torch.randn(200_000, device=dev)  # several steps per block, each with its waits
    if rank == 0:  # rank 1 never joins this call
        ar(x)
        torch.cuda.synchronize()
        with pytest.raises(AllReduceTimeoutError, match="rank 1"):
            ar.check()
    dist.barrier()
    heap.destroy()


def _push_body(rank, world):
    """twoshot_push up to 64 MiB on heap buffers (symmetric_empty): in place and into a second heap
    buffer, bf16 and fp32 against an fp32 sum, bitwise equal to the staged twoshot on ordinary
    tensors (odd lengths and ordinary tensors take that staged path), in-place graph replays,
    then a peer that never arrives: the call times out and the owner's sum still lands in the
    absent peer's buffer (the write-only path, not the gather slot)."""
    from comms import AllReduce, SymmetricHeap
    from comms.allreduce import AllReduceTimeoutError

    dev = torch.device("cuda", rank)
    # 64 MiB AllReduce, its 2 x 64 MiB buffers, the 1 MiB one and its buffer
    heap = SymmetricHeap(dist.group.WORLD, heap_bytes(world, 64 << 20) + (128 << 20) + heap_bytes(world, 1 << 20)
                         + (4 << 20), dev, timeout_s=60)
    ar = AllReduce(heap, "twoshot_push", max_bytes=64 << 20, timeout_s=5)
    xbuf, obuf = ar.symmetric_empty(64 << 20, torch.uint8), ar.symmetric_empty(64 << 20, torch.uint8)
    case = 0
    for dtype in (torch.bfloat16, torch.float32):
        es = torch.empty((), dtype=dtype).element_size()
        large = (64 << 20) // es - 8  # whole 16-byte vectors (bf16: an odd count, unequal chunks)
        for n in (8, 1000, 7, 4097, 8 * 12345, large):
            case += 1
            x = _inputs(rank, n, dtype, case, dev)
            ref = _ref(world, n, dtype, case, dev)
            y = ar(x)  # ordinary tensors: the staged twoshot
            xs, os_ = xbuf[:n * es].view(dtype), obuf[:n * es].view(dtype)
            xs.copy_(x)
            ar(xs, out=os_)
            ar(xs, out=xs)
            torch.cuda.synchronize()
            ar.check()
            err = _rel(xs, ref)
            assert err <= TOL[dtype], f"twoshot_push {dtype} n={n}: rel err {err:.3g}"
            assert _same_on_all_ranks(xs), f"twoshot_push {dtype} n={n}: ranks differ"
            assert torch.equal(xs, y) and torch.equal(os_, y), f"twoshot_push {dtype} n={n} differs from staged"
    for n in (12345 * 8, (48 << 20) // 2):
        case = _check_graph_replays(ar, rank, world, dev, n, 3, case, "twoshot_push",
                                    static_x=xbuf[:2 * n].view(torch.bfloat16))
    ar.destroy()
    ar = AllReduce(heap, "twoshot_push", max_bytes=1 << 20, timeout_s=0.2)
    n = 200_000  # fp32: 50000 vectors; rank 0 owns the first c elements
    c = -(-n // 4 // world) * 4
    xs = ar.symmetric_empty(n, torch.float32)
    if rank == 0:
        xs.fill_(1.0)
    heap.barrier()
    if rank == 0:  # rank 1 never joins this call
        ar(xs, out=xs)
        torch.cuda.synchronize()
        with pytest.raises(AllReduceTimeoutError, match="rank 1"):
            ar.check()
    heap.barrier()
    if rank > 0:  # rank 0's chunk (its x plus the never-written scratch: 1 + 0) was stored here
        assert torch.equal(xs[:c], torch.ones(c, device=dev)), "owner's sum not in the peer's buffer"
        assert torch.equal(xs[c:], torch.zeros(n - c, device=dev)), "the rest of the peer's buffer was written"
    heap.destroy()


def _blocks_body(rank, world):
    """The `blocks` override (1, 7, 132, 256 blocks) of twoshot, twoshot_push and twoshot_pipe, on
    ordinary tensors and on heap buffers (twoshot -> twoshot_symm; twoshot_push in place too),
    bf16 and fp32: bitwise equal to the staged twoshot on its default grid and within tolerance
    of the fp32 sum; then `auto` (with blocks=132) past the one-shot range: twoshot_push for heap
    x and out, the staged twoshot for an ordinary out, the same bits."""
    from comms import AllReduce, SymmetricHeap

    dev = torch.device("cuda", rank)
    heap = SymmetricHeap(dist.group.WORLD, (5 * world + 2) * (30 << 20) + (64 << 20), dev, timeout_s=60)
    base = AllReduce(heap, "twoshot", max_bytes=1 << 20, timeout_s=5)
    ars = {(a, b): AllReduce(heap, a, max_bytes=1 << 20, timeout_s=5, blocks=b)
           for b in (1, 7, 132, 256) for a in ("twoshot", "twoshot_push", "twoshot_pipe")}
    xbuf, obuf = base.symmetric_empty(1 << 20, torch.uint8), base.symmetric_empty(1 << 20, torch.uint8)
    case = 0
    for dtype in (torch.bfloat16, torch.float32):
        es = torch.empty((), dtype=dtype).element_size()
        n = 65533 * 16 // es  # an odd number of vectors: unequal chunks
        xs, os_ = xbuf[:n * es].view(dtype), obuf[:n * es].view(dtype)
        for (algo, b), ar in ars.items():
            case += 1
            x = _inputs(rank, n, dtype, case, dev)
            y = base(x)
            got = ar(x)
            xs.copy_(x)
            ar(xs, out=os_)
            torch.cuda.synchronize()
            ar.check()
            err = _rel(y, _ref(world, n, dtype, case, dev))
            assert err <= TOL[dtype], f"twoshot {dtype}: rel err {err:.3g}"
            assert torch.equal(got, y), f"{algo} blocks={b} {dtype}: ordinary tensors differ from the default grid"
            assert torch.equal(os_, y), f"{algo} blocks={b} {dtype}: heap buffers differ from the default grid"
            if algo == "twoshot_push":
                ar(xs, out=xs)
                torch.cuda.synchronize()
                assert torch.equal(xs, y), f"twoshot_push blocks={b} {dtype}: in place differs"
    nbig = ((16 << 20) + 4096) // 2  # bf16 elements just past the one-shot range
    auto = AllReduce(heap, "auto", max_bytes=nbig * 2, timeout_s=5, blocks=132)
    xb = auto.symmetric_empty(nbig, torch.bfloat16)
    assert auto.algo_for(xb, xb) == "twoshot_push" and auto.algo_for(xb) == "twoshot"
    assert auto.algo_for(xb, torch.empty_like(xb)) == "twoshot" and auto.algo_for(xb[:4096], xb[:4096]) == "lamport"
    case += 1
    x = _inputs(rank, nbig, torch.bfloat16, case, dev)
    y = auto(x)
    xb.copy_(x)
    auto(xb, out=xb)
    torch.cuda.synchronize()
    auto.check()
    assert _rel(y, _ref(world, nbig, torch.bfloat16, case, dev)) <= TOL[torch.bfloat16]
    assert torch.equal(xb, y), "auto on heap buffers (twoshot_push) differs from auto on tensors (twoshot)"
    heap.destroy()


def _rmsnorm_body(rank, world):
    from comms import AllReduce, SymmetricHeap
    from comms.allreduce import rmsnorm_reference

    dev = torch.device("cuda", rank)
    heap = SymmetricHeap(dist.group.WORLD, 3 * heap_bytes(world, 4 << 20) + (4 << 20), dev, timeout_s=60)
    case = 0
    for algo, dtype in [(a, d) for a in ("lamport", "oneshot", "auto") for d in (torch.bfloat16, torch.float32)]:
        if dtype == torch.bfloat16:
            ar = AllReduce(heap, algo, max_bytes=4 << 20, timeout_s=5)
        for t, h in ((1, 2048), (7, 4096), (33, 1000)):
            for zc in (False, True):
                case += 1
                x = _inputs(rank, t * h, dtype, case, dev).view(t, h)  # [T, H]
                g = torch.Generator().manual_seed(77 + case)
                res = torch.randn(t, h, generator=g).to(dtype).to(dev)
                w = (torch.rand(h, generator=g) * 0.5).to(dtype).to(dev)
                out, res_out = ar.add_rmsnorm(x, res, w, 1e-6, zero_centered=zc)
                torch.cuda.synchronize()
                ref_res = (_ref(world, t * h, dtype, case, dev).view(t, h) + res.float())
                ref_out = rmsnorm_reference(ref_res.to(dtype), w, 1e-6, zc)
                assert _rel(res_out, ref_res) <= TOL[dtype], (algo, dtype, t, h, zc, "residual")
                assert _rel(out, ref_out.float()) <= 2 * TOL[dtype], (algo, dtype, t, h, zc, "normed")
    heap.destroy()


def _timeout_body(rank, world):
    from comms import AllReduce, SymmetricHeap
    from comms.allreduce import AllReduceTimeoutError

    dev = torch.device("cuda", rank)
    heap = SymmetricHeap(dist.group.WORLD, 4 * heap_bytes(world, 1 << 20) + (4 << 20), dev, timeout_s=60)
    for algo in ("oneshot", "lamport", "twoshot", "twoshot_pipe"):
        ar = AllReduce(heap, algo, max_bytes=1 << 20, timeout_s=0.2)
        x = torch.randn(4096, device=dev)
        if rank == 0:  # rank 1 never joins this call
            ar(x)
            torch.cuda.synchronize()  # returns: the kernel gave up waiting instead of hanging
            with pytest.raises(AllReduceTimeoutError, match="rank 1"):
                ar.check()
        dist.barrier()
    heap.destroy()


def _heap_lifecycle_body(rank, world):
    """Peer writes land in the peer's memory; create/destroy leaks neither GPU memory nor fds."""
    import os

    from comms import SymmetricHeap

    dev = torch.device("cuda", rank)
    free0 = fds0 = None
    for i in range(5):
        if i == 1:  # after one full cycle: NCCL's communicator and the CUDA context are set up
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            free0 = torch.cuda.mem_get_info(dev)[0]
            fds0 = len(os.listdir("/proc/self/fd"))
        heap = SymmetricHeap(dist.group.WORLD, 256 << 20, dev, timeout_s=60)
        off = heap.alloc(4096)
        heap.barrier()  # the contract: peers write into a region only after its zeroing
        peer = (rank + 1) % world
        heap.peer_buffer(peer, off, (world,), torch.int32)[rank] = 10 * i + rank + 1
        heap.barrier()
        got = heap.buffer(off, (world,), torch.int32).tolist()
        assert got == [10 * i + r + 1 if (r + 1) % world == rank else 0 for r in range(world)], got
        heap.barrier()
        heap.destroy()
    # A heap's pages go back only when every peer has released its import of them too.
    dist.barrier()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free1 = torch.cuda.mem_get_info(dev)[0]
    assert free1 >= free0 - (64 << 20), f"GPU memory not returned: {free0 - free1} bytes short"
    assert len(os.listdir("/proc/self/fd")) <= fds0, "fds leaked"


@pytest.fixture(scope="module")
def ngpu():
    return min(torch.cuda.device_count(), 8)


def test_heap_gpu_peer_writes_and_no_leaks(ngpu):
    run_ranks(_heap_lifecycle_body, ngpu, backend="nccl", timeout_s=120)


def test_allreduce_gpu_algorithms(ngpu):
    run_ranks(_algos_body, ngpu, backend="nccl", timeout_s=240)


def test_allreduce_gpu_twoshot_pipe(ngpu):
    run_ranks(_pipe_body, ngpu, backend="nccl", timeout_s=100)


def test_allreduce_gpu_twoshot_push(ngpu):
    run_ranks(_push_body, ngpu, backend="nccl", timeout_s=100)


def test_allreduce_gpu_blocks_override_and_auto_on_heap_buffers(ngpu):
    run_ranks(_blocks_body, ngpu, backend="nccl", timeout_s=100)


def test_allreduce_gpu_add_rmsnorm(ngpu):
    run_ranks(_rmsnorm_body, ngpu, backend="nccl", timeout_s=120)


def test_allreduce_gpu_peer_timeout_raises(ngpu):
    run_ranks(_timeout_body, ngpu, backend="nccl", timeout_s=120)
