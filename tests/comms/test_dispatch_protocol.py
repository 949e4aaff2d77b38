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


def _block_program(P, nq, maxp, overlap):
    """Arrivals and waits of one block of the dispatch (comms/kernels/dispatch.py) sending in P of at
    most maxp phases (unpipelined: P = nq = maxp = 1) while the most phases of any source is nq: a
    list of ("arrive", first counter, count) / ("wait", counter) / ("tables",) in program order. Counter
    0 is the tables arrival, 1 + q the rows of send phase q. Without overlap the first arrival (after
    phase 0's sends) covers the tables counter and phase counter 0 (every phase counter if P == 1); with
    overlap the tables go alone and are waited for before phase 0 is sent (its own rows packed
    meanwhile). Every block's first step (A1) stores its share of the tagged tables; ("tables",) polls
    every source's (_load_tables): unpipelined without overlap right after the arrival, before any
    wait, else after the first wait."""
    if overlap:
        prog = [("arrive", 0, 1), ("wait", 0), ("tables",), ("arrive", 1, maxp if P == 1 else 1), ("wait", 1)]
    elif maxp == 1:
        prog = [("arrive", 0, 2), ("tables",), ("wait", 1)]
    else:
        prog = [("arrive", 0, 1 + (maxp if P == 1 else 1)), ("wait", 1), ("tables",)]
    for q in range(nq):
        if q + 1 < P:
            prog.append(("arrive", q + 2, maxp - q - 1 if q + 2 == P else 1))
        if q + 1 < nq:
            prog.append(("wait", q + 2))
    return prog


@pytest.mark.parametrize("world,maxp,start", [(2, 2, 0), (2, 4, 2**32 // STEP - 1), (3, 4, 0), (4, 8, 5)])
def test_pipelined_phases_never_pass_early_nor_deadlock(world, maxp, start):
    """Per-phase counters after the tables counter, a last phase that also arrives on the later
    counters, phase counts, overlap (tables first, own rows packed with each phase's sends) and grids
    that differ per rank and per epoch: a wait on a counter passes only once every block of every
    source has made that arrival (its tables, or its phase-q rows, are out; a rows wait also covers
    every source's tables), every counter ends each epoch at ARRIVAL_STEP per source, and the ranks
    never deadlock."""
    rng = random.Random(world * 31 + maxp)
    epochs = 5
    cnt = [[[_i32(start * STEP)] * world for _ in range(1 + maxp)] for _ in range(world)]  # [dest][counter][src]
    for e in range(epochs):
        target = _i32((start + e + 1) * STEP)
        P = [rng.randint(1, maxp) for _ in range(world)]
        ov = [rng.random() < 0.5 for _ in range(world)]
        nq = max(P)
        grids = [rng.randint(1, 40) for _ in range(world)]
        progs = {(r, b): _block_program(P[r], nq, maxp, ov[r]) for r in range(world) for b in range(grids[r])}
        pc = {k: 0 for k in progs}
        covered = [[0] * world for _ in range(1 + maxp)]  # [counter][source] blocks whose arrival covers it
        live = list(progs)
        while live:
            runnable = []
            for r, b in live:
                op = progs[r, b][pc[r, b]]
                if op[0] == "tables":  # the poll passes once every block of every source has stored its share
                    ok = covered[0] == grids
                else:
                    ok = op[0] == "arrive" or all(_wrap_sub(cnt[r][op[1]][s], target) >= 0 for s in range(world))
                if ok:
                    runnable.append((r, b))
            assert runnable, f"deadlock in epoch {e}: P={P}, overlap={ov}, blocks at {[(k, progs[k][pc[k]]) for k in live]}"
            r, b = rng.choice(runnable)
            op = progs[r, b][pc[r, b]]
            if op[0] == "arrive":
                _, first, n = op
                inc = STEP + 1 - grids[r] if b == 0 else 1
                for p in range(first, first + n):
                    for d in range(world):
                        cnt[d][p][r] = _i32(cnt[d][p][r] + inc)
                    covered[p][r] += 1
            elif op[0] == "wait":  # the wait passed: every block of every source has arrived on this counter
                q = op[1]
                assert all(covered[q][s] == grids[s] for s in range(world)), (e, r, q, covered[q], grids)
                assert covered[0] == grids, "a rows wait passed before every source's tables were out"
            pc[r, b] += 1
            if pc[r, b] == len(progs[r, b]):
                live.remove((r, b))
        assert all(covered[p] == grids for p in range(1 + maxp))
        for d in range(world):
            assert cnt[d] == [[target] * world for _ in range(1 + maxp)], "a counter off ARRIVAL_STEP per epoch"


@pytest.mark.parametrize("world,maxp,start", [(1, 1, 0), (2, 1, 0), (3, 1, 2**32 // STEP - 2), (5, 1, 7),
                                              (2, 4, 0), (3, 4, 2**32 // STEP - 2), (4, 8, 5)])
def test_tables_and_rows_counters_in_mixed_modes(world, maxp, start):
    """Overlap and (maxp > 1: pipelined) send phase counts chosen per rank and per epoch, grids per
    rank, ranks running ahead into their next
    launch as soon as their own blocks are done: a wait on the tables counter passes only once every
    block of every source has arrived there (its rslot / recnt / rntok are out), one on the rows
    counter only once every block has made its rows arrival (rows, ids, weights, stamps out; the
    tables arrival precedes it in each block); no deadlock; each counter gets ARRIVAL_STEP per source
    and epoch, and a counter a rank does not wait on in an epoch never drifts more than one step
    from its target (wrap-safe when it is waited on later). The table poll (tagged words, two buffers
    by epoch parity) passes only once every source's tables of its epoch are out, and before any
    source rewrites that buffer."""
    _mixed_modes(world, maxp, start)


def test_single_table_buffer_would_be_overwritten():
    """The model catches a source rewriting the tables before a late poll when they had one buffer
    (hence two, by epoch parity)."""
    with pytest.raises(AssertionError, match="rewrote the tables"):
        _mixed_modes(2, 4, 0, buffers=1)


def _mixed_modes(world, maxp, start, buffers=2):
    rng = random.Random(world * 131 + maxp * 17 + start)
    epochs = 6
    nc = 1 + maxp  # counters: tables, then one per send phase
    cnt = [[[_i32(start * STEP)] * world for _ in range(nc)] for _ in range(world)]  # [dest][counter][src]
    modes = [[rng.random() < 0.5 for _ in range(world)] for _ in range(epochs)]
    phases = [[rng.randint(1, maxp) for _ in range(world)] for _ in range(epochs)]
    grids = [[rng.randint(1, 40) for _ in range(world)] for _ in range(epochs)]
    covered = [[[0] * world for _ in range(nc)] for _ in range(epochs)]  # [epoch][counter][source]
    epoch = [0] * world  # the launch each rank runs now (ranks drift apart)
    progs, pc = {}, {}

    def launch(r):
        e = epoch[r]
        for b in range(grids[e][r]):
            progs[r, b] = _block_program(phases[e][r], max(phases[e]), maxp, modes[e][r])
            pc[r, b] = 0

    for r in range(world):
        launch(r)
    while min(epoch) < epochs:
        runnable = []
        for (r, b), prog in progs.items():
            if pc[r, b] == len(prog):
                continue
            op = prog[pc[r, b]]
            target = _i32((start + epoch[r] + 1) * STEP)
            if op[0] == "tables":  # every block of every source has stored its share (with its first arrival)
                ok = covered[epoch[r]][0] == grids[epoch[r]]
            else:
                ok = op[0] == "arrive" or all(_wrap_sub(cnt[r][op[1]][s], target) >= 0 for s in range(world))
            if ok:
                runnable.append((r, b))
        assert runnable, (f"deadlock: epochs {epoch}, modes {[modes[min(e, epochs - 1)] for e in epoch]}, "
                          f"phases {[phases[min(e, epochs - 1)] for e in epoch]}")
        r, b = rng.choice(runnable)
        e = epoch[r]
        op = progs[r, b][pc[r, b]]
        target = _i32((start + e + 1) * STEP)
        if op[0] == "arrive":
            _, first, n = op
            inc = STEP + 1 - grids[e][r] if b == 0 else 1
            for k in range(first, first + n):
                for d in range(world):
                    cnt[d][k][r] = _i32(cnt[d][k][r] + inc)
                covered[e][k][r] += 1
        elif op[0] == "tables":  # this epoch's buffer is rewritten from epoch e + buffers on: not yet
            assert e + buffers >= epochs or not any(covered[e + buffers][0]), \
                "a source rewrote the tables before the poll"
        else:
            k = op[1]
            assert all(covered[e][k][s] == grids[e][s] for s in range(world)), (e, r, k, covered[e][k], grids[e])
            if k >= 1:  # a rows wait also covers every source's tables
                assert covered[e][0] == grids[e]
        for k in range(nc):
            for s in range(world):
                assert -STEP <= _wrap_sub(cnt[r][k][s], target) <= STEP, "a counter drifted past one step"
        pc[r, b] += 1
        if all(pc[rr, bb] == len(p) for (rr, bb), p in progs.items() if rr == r):  # r's launch is done
            for key in [k for k in progs if k[0] == r]:
                del progs[key], pc[key]
            epoch[r] += 1
            if epoch[r] < epochs:
                launch(r)
    for d in range(world):
        assert cnt[d] == [[_i32((start + epochs) * STEP)] * world] * nc, "a counter off ARRIVAL_STEP per epoch"


def _combine_units(rank, world, nkeys, nchunk, nw, sum_last=True, always_rotate=False):
    """combine's work units of `rank` in the kernel's order (comms/kernels/dispatch.py `_make_combine`):
    key t major, then position j (the other sources' sends in ascending source order, then own token
    t's sum at position world - 1), then chunk; positions rotated by t when the nw warps are at least
    the units of a key. Wrong orders, for the negative test: `sum_last=False` puts the sum first,
    `always_rotate` rotates with fewer warps too."""
    units = []
    per_key = world * nchunk
    for t in range(nkeys):
        key = []
        for j in range(world):
            kind_pos = world - 1 if sum_last else 0
            if j == kind_pos:
                key += [("sum", t, None, c) for c in range(nchunk)]
            else:
                k = j if sum_last else j - 1
                s = k + (k >= rank)
                key += [("send", t, s, c) for c in range(nchunk)]
        rot = t % per_key if nw >= per_key or always_rotate else 0
        units += key[rot:] + key[:rot]
    return units


def _run_combine(world, toks, dest, grids, sum_last, rng, nchunk=2, always_rotate=False):
    """Every rank's warps take units grid-stride (warp w: units w, w + nw, ...), in order, interleaved at
    random across ranks; a send of (source s, token t) to this rank happens iff s's token t has a slot
    here; a sum of own token t waits for the partials of the token's other ranks. Returns True when
    every unit completed, False on a deadlock (no warp can move)."""
    nkeys = max(toks)
    cx = set()  # (owner, sender, t, c) partials delivered
    queues = []
    for r in range(world):
        nw = grids[r] * 8
        units = _combine_units(r, world, nkeys, nchunk, nw, sum_last, always_rotate)
        queues += [(r, units[w::nw]) for w in range(nw)]
    pos = [0] * len(queues)
    while True:
        ready = []
        for i, (r, units) in enumerate(queues):
            if pos[i] == len(units):
                continue
            kind, t, s, c = units[pos[i]]
            if kind == "sum" and t < toks[r]:
                if any((r, d, t, c) not in cx for d in dest[r][t] if d != r):
                    continue
            ready.append(i)
        if not ready:
            return all(pos[i] == len(u) for i, (_, u) in enumerate(queues))
        i = rng.choice(ready)
        r, units = queues[i]
        kind, t, s, c = units[pos[i]]
        if kind == "send" and t < toks[s] and r in dest[s][t]:
            cx.add((s, r, t, c))
        pos[i] += 1


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_combine_key_order_never_deadlocks(world):
    """With the kernel's order every unit completes: random routing, token counts and grids (1 block per
    rank included: one warp's units span every key; 3 blocks: rotated positions), and every token on
    every rank."""
    rng = random.Random(world)
    for trial in range(20):
        toks = [rng.randint(0, 6) for _ in range(world)]
        dest = [[set(rng.sample(range(world), rng.randint(1, world))) for _ in range(n)] for n in toks]
        grids = [rng.choice([1, 2, 3]) for _ in range(world)]
        nchunk = rng.choice([1, 4, 7])
        assert _run_combine(world, toks, dest, grids, True, rng, nchunk), f"deadlock: toks={toks} grids={grids}"
    for nchunk in (1, 4, 7):
        dest = [[set(range(world))] * 12 for _ in range(world)]
        assert _run_combine(world, [12] * world, dest, [1] * world, True, rng, nchunk), f"deadlock: nchunk={nchunk}"


def test_combine_wrong_orders_can_deadlock():
    """The model detects a deadlock: five ranks whose tokens need each other's partials, one block each
    (8 warps over 20 units a key), stall for good with each key's sum first, and with positions
    rotated although a warp holds several units of a key (a sum can then precede a send of its key in
    one warp); the kernel's order completes the same case."""
    dest = [[set(range(5))] * 12 for _ in range(5)]
    assert not _run_combine(5, [12] * 5, dest, [1] * 5, False, random.Random(0), nchunk=4)
    assert not _run_combine(5, [12] * 5, dest, [1] * 5, True, random.Random(0), nchunk=4, always_rotate=True)
    assert _run_combine(5, [12] * 5, dest, [1] * 5, True, random.Random(0), nchunk=4)
