"""The fused kernels' arrival protocol (comms/kernels/dispatch.py `_signal_all` / `_wait_all`) and
the per-call grid rule (`comms.dispatch_fused.auto_blocks`), modelled on a CPU.

Every block of a launch takes a ticket (atom.add returns the old value); the block that draws
nb - 1 resets the ticket and adds 1 to cnt[source] on every rank; a rank at epoch e proceeds once
cnt[s] - e >= 0 (mod 2**32) for every s. The model interleaves blocks of all ranks at random, with a
different grid per rank and per epoch, and checks that a wait passes exactly when every block of
every source's launch of that epoch has signalled -- including across the int32 wrap."""
import random

import pytest

from comms import dispatch_fused as host


def _wrap_sub(a, b):
    """int32 a - b modulo 2**32, as the kernels' sub.s32."""
    d = (a - b) & 0xFFFFFFFF
    return d - (1 << 32) if d >= 1 << 31 else d


def _i32(v):
    return _wrap_sub(v, 0)


@pytest.mark.parametrize("world,start", [(2, 0), (3, 0), (4, 2**31 - 3), (8, 2**32 - 2)])
def test_one_arrival_per_source_and_epoch_whatever_the_grids(world, start):
    rng = random.Random(world)
    cnt = [[_i32(start)] * world for _ in range(world)]   # cnt[receiver][source], as left by `start` epochs
    ticket = [0] * world
    for e in range(start + 1, start + 6):
        epoch = _i32(e)
        grids = [rng.randint(1, 132) for _ in range(world)]   # ranks need not agree
        pending = [(r, b) for r in range(world) for b in range(grids[r])]
        rng.shuffle(pending)
        arrived = [0] * world
        for r, _ in pending:
            t = ticket[r]
            ticket[r] += 1
            if t == grids[r] - 1:
                ticket[r] = 0
                for d in range(world):
                    cnt[d][r] = _i32(cnt[d][r] + 1)
            arrived[r] += 1
            for me in range(world):  # the wait of every rank passes iff all blocks of all sources arrived
                passes = all(_wrap_sub(cnt[me][s], epoch) >= 0 for s in range(world))
                assert passes == all(arrived[s] == grids[s] for s in range(world)), (e, me, arrived, grids)
        assert ticket == [0] * world, "tickets are reset for the next launch"


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
