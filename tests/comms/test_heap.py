"""SymmetricHeap on CPU (memfd shared memory, fds exchanged over a Unix socket with SCM_RIGHTS):
layout bookkeeping, peer views that really alias the peer's memory, the fd exchange itself,
barrier and destroy; all multi-process over gloo with bounded waits."""
import datetime
import os
import tempfile
import time
import uuid

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from comms.heap import HeapError, SymmetricHeap, exchange_fds

JOIN_TIMEOUT_S = 90


def _entry(rank, world, init_file, fn, args, backend):
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60),
                            device_id=torch.device("cuda", rank) if backend == "nccl" else None)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout_s: float = JOIN_TIMEOUT_S, backend: str = "gloo"):
    """Run fn(rank, world, *args) in `world` spawned processes over a gloo (or NCCL: one GPU per
    rank) group; raise on any failure or when they are not all done within timeout_s."""
    init_file = os.path.join(tempfile.mkdtemp(), "rdzv")
    ctx = mp.start_processes(_entry, args=(world, init_file, fn, args, backend), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"ranks not done within {timeout_s} s")


def _heap_body(rank, world, nbytes):
    g = dist.group.WORLD
    heap = SymmetricHeap(g, nbytes, timeout_s=30)
    assert heap.capabilities.backend == "cpu" and heap.capabilities.p2p
    assert not heap.capabilities.multicast_enabled
    assert heap.peer_ptrs.shape == (world,) and heap.peer_ptrs.dtype == torch.int64
    assert len(set(heap.peer_ptrs.tolist())) == world
    a = heap.alloc(1000)
    b = heap.alloc(64, align=1024)
    assert a == 0 and b == 1024 and heap.used == 1088
    with pytest.raises(HeapError, match="nbytes=999999"):
        heap.alloc(999999)
    with pytest.raises(HeapError, match="align=3"):
        heap.alloc(8, align=3)
    with pytest.raises(HeapError, match="rank=7"):
        heap.peer_buffer(7, 0, (4,), torch.float32)
    with pytest.raises(HeapError, match="offset=2"):
        heap.buffer(2, (4,), torch.float32)
    # each rank writes random data into its own region, then reads every peer's through its mapping
    gen = torch.Generator().manual_seed(1234 + rank)
    mine = torch.randn(250, generator=gen)
    heap.buffer(a, (250,), torch.float32).copy_(mine)
    heap.barrier()
    for r in range(world):
        expect = torch.randn(250, generator=torch.Generator().manual_seed(1234 + r))
        assert torch.equal(heap.peer_buffer(r, a, (250,), torch.float32), expect), f"rank {r}'s data"
    heap.barrier()
    # a write into a peer's heap shows up in the peer's own view (real aliasing, not a copy)
    peer = (rank + 1) % world
    heap.peer_buffer(peer, b, (world,), torch.int32)[rank] = 100 + rank
    heap.barrier()
    got = heap.buffer(b, (world,), torch.int32)
    assert got.tolist() == [100 + r if (r + 1) % world == rank else 0 for r in range(world)]
    heap.destroy()
    heap.destroy()  # idempotent
    with pytest.raises(HeapError, match="after destroy"):
        heap.buffer(0, (1,), torch.uint8)


@pytest.mark.mp
@pytest.mark.parametrize("world", [2, 3])
def test_heap_cpu_multiprocess(world):
    run_ranks(_heap_body, world, 1 << 16)


def _fd_body(rank, world, tag):
    # a memfd per rank with rank-tagged contents: after the exchange each rank reads the peer files
    fds = []
    for k in range(2):
        fd = os.memfd_create(f"t{rank}{k}")
        os.write(fd, f"rank{rank}-file{k}".encode())
        fds.append(fd)
    got = exchange_fds(rank, world, fds, tag, timeout_s=30)
    assert len(got) == world and got[rank] == fds
    for r, fl in enumerate(got):
        assert len(fl) == 2
        for k, fd in enumerate(fl):
            assert os.pread(fd, 64, 0) == f"rank{r}-file{k}".encode()
            os.close(fd)


@pytest.mark.mp
def test_exchange_fds_scm_rights():
    tag = uuid.uuid4().hex[:8]
    run_ranks(_fd_body, 3, tag)


def test_exchange_fds_times_out_naming_the_missing_peer():
    fd = os.memfd_create("lonely")
    t0 = time.monotonic()
    with pytest.raises(HeapError, match="rank 1"):
        exchange_fds(0, 2, [fd], uuid.uuid4().hex[:8], timeout_s=0.5)
    assert time.monotonic() - t0 < 5
    os.close(fd)


def test_exchange_fds_rejects_bad_rank():
    with pytest.raises(HeapError, match="rank=2"):
        exchange_fds(2, 2, [], "x", timeout_s=1)
