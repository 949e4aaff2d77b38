"""The fused kernels' arrival protocol (comms/kernels/dispatch.py `_arrive` / `_wait_all` /
`_store_epoch`) and the per-call grid rule (`comms.dispatch_fused.auto_blocks`), modelled on a CPU.

Every block of a launch adds to cnt[source] on every rank by itself: block 0 adds
ARRIVAL_STEP + 1 - nb, the others 1; a rank at epoch e proceeds once cnt[s] - e * ARRIVAL_STEP >= 0
(int32 arithmetic modulo 2**32: the kernels' mul.lo / sub.s32) for every s. The model runs ranks
asynchronously -- a rank starts its next launch as soon as its own wait passed, so a fast source's
next-epoch blocks land while slower ranks still wait -- with blocks of all ranks interleaved at
random and a different grid per rank and per epoch, and checks that a wait passes exactly when every
block of every source's launch of that epoch has arrived, including across the int32 wrap."""
import random

import pytest

from comms import dispatch_fused as host

STEP = host.ARRIVAL_STEP


def _i32(v):
    """v modulo 2**32 as a signed int32 (the kernels' wrapping arithmetic)."""
    d = v & 0xFFFFFFFF
    return d - (1 << 32) if d >= 1 << 31 else d


def _wrap_sub(a, b):
    return _i32(a - b)


@pytest.mark.parametrize("world,start", [(2, 0), (3, 0), (4, 2**31 // STEP - 2), (5, 2**32 // STEP - 2),
                                         (8, 2**32 - 3)])
def test_each_block_arrives_and_a_source_adds_one_step_per_epoch(world, start):
    rng = random.Random(world * 7919 + start)
    epochs = 6
    # counters as left by `start` completed epochs; cnt[receiver][source]
    cnt = [[_i32(start * STEP)] * world for _ in range(world)]
    grids = [[rng.randint(1, 132) for _ in range(world)] for _ in range(epochs)]  # per epoch, per rank
    launched = [0] * world          # epochs (after start) whose launch this rank has begun
    todo = [[] for _ in range(world)]  # blocks of the current launch not yet arrived
    arrived = [[0] * world for _ in range(epochs)]  # [epoch][source] blocks arrived
    waiting = [False] * world
    done = [0] * world
    for r in range(world):
        todo[r], waiting[r], launched[r] = list(range(grids[0][r])), True, 1
    while min(done) < epochs:
        r = rng.randrange(world)
        e = launched[r] - 1
        if done[r] == epochs:
            continue
        if todo[r]:  # a random block of r's current launch arrives on every rank
            b = todo[r].pop(rng.randrange(len(todo[r])))
            inc = STEP + 1 - grids[e][r] if b == 0 else 1
            assert inc >= 1
            for d in range(world):
                cnt[d][r] = _i32(cnt[d][r] + inc)
            arrived[e][r] += 1
        target = _i32((start + e + 1) * STEP)  # the kernel: wrap_mul(epoch, ARRIVAL_STEP)
        for s in range(world):
            assert -STEP <= _wrap_sub(cnt[r][s], target) <= STEP, "a source ran two epochs ahead"
        passes = all(_wrap_sub(cnt[r][s], target) >= 0 for s in range(world))
        complete = all(arrived[e][s] == grids[e][s] for s in range(world))
        assert passes == complete, (e, r, arrived[e], grids[e])
        if passes and not todo[r]:  # r's wait passed and its blocks are in: its next launch may start
            done[r] += 1
            if done[r] < epochs:
                launched[r] += 1
                todo[r] = list(range(grids[e + 1][r]))
    for d in range(world):
        assert cnt[d] == [_i32((start + epochs) * STEP)] * world


def test_any_grid_fits_one_step():
    """Block 0's correction stays positive for every grid the host allows (<= SM count)."""
    assert host.ARRIVAL_STEP >= 1024 > 148  # B200 has 148 SMs, H200 132


def test_auto_grid_fits_the_work():
    """One 2 KiB unit per warp of the receive phases, >= one warp per expert, <= one block per SM."""
    assert host.auto_blocks(2, 128, 4096, 1, 132) == 16          # the expert scan's floor: 128 warps
    assert host.auto_blocks(2, 128, 4096, 32, 132) == 32         # 2 * 32 rows * 4 chunks / 8 warps
    assert host.auto_blocks(2, 128, 4096, 128, 132) == 128
    assert host.auto_blocks(2, 128, 4096, 4096, 132) == 132
    assert host.auto_blocks(2, 16, 1024, 0, 132) == 2
    for world, E, H, T in ((2, 256, 7168, 7), (8, 256, 1024, 3), (72, 576, 7168, 4096)):
        nb = host.auto_blocks(world, E, H, T, 132)
        assert 1 <= nb <= 132
        assert nb == 132 or nb * host.THREADS // 32 >= max(E, world * T * H * 2 // host.CHUNK_BYTES)
