"""All-reduce kernels over the symmetric heap (CuTeDSL; sm_90a and sm_100a).

Every kernel takes the heap's peer pointer table and byte offsets into the heap, so one compiled
function serves any heap, any world size (<= MAX_WORLD) and any length (a multiple of 16 bytes;
`comms.allreduce` pads odd lengths).

Heap regions (offsets chosen by `comms.allreduce.AllReduce`, identical on every rank):
  ws     data:  [2 parity][W src][cap] bytes (one-shot: each rank's copy of x; two-shot: the
                reduce-scatter inputs), then for two-shot [2 parity][cap] (the all-gather results)
  flags  int32: [2 phase][MAX_WORLD src][MAX_BLOCKS]; flags[p][s][b] on rank r = the last epoch
                at which rank s's block b finished phase p towards rank r (monotonic, never reset)
  state  int32: [epoch, ticket] (this rank only)
  lam    Lamport buffers [3][W src][lcap] of sentinel words, and their own state
                [dirty vectors of buffer 0, 1, 2, -, epoch copy of block 0 .. MAX_BLOCKS-1]

Flag synchronisation (oneshot, twoshot, multimem, rmsnorm), no separate barrier: every call has
an epoch (state[0] + 1) read from device memory, so CUDA-graph replays advance it; senders
publish `flags = epoch` with a system-scope release after their data stores and a bar.sync,
receivers spin with an acquire until `flags - epoch >= 0` (a peer at most one call ahead already
wrote this call's data). Data slots alternate by epoch parity: a peer cannot finish a call before
receiving ours, so it never overwrites a slot we still read. The last block to finish (a ticket
counter) advances the epoch.

Lamport (lamport, lamport_rmsnorm): the data is its own flag. Slots hold the sentinel word
0xFFFFFFFF; senders replace that word in their data by another NaN, receivers poll each 16-byte
vector (volatile loads) until none of its words is the sentinel: no flag, no fence, one NVLink
trip. Buffers rotate by epoch % 3 and each call re-fills the one used two calls back. Each
block keeps its own copy of the epoch, so no block waits for another (no ticket, no atomic), and
the kernels are launched with programmatic dependent launch (PDL: `griddepcontrol.wait` first,
then `launch_dependents`), so the next kernel's blocks are resident before this one ends.

Every wait is bounded by `timeout_ns` of %globaltimer; on expiry the kernel writes `1 + peer` to
the error word (pinned host memory) and carries on, so the host raises instead of the GPU hanging.

Algorithms (exported as allreduce_<algo>_<bf16|fp32>):
  lamport          one-shot push with Lamport polling (small messages; measured best to 4 MiB)
  oneshot          each rank pushes x to every peer, flag per block, reduces the W copies
  twoshot          reduce-scatter (push each chunk to its owner; owner reduces) + all-gather
  twoshot_symm     two-shot for x/out in the heap: owners read x and write out over NVLink
  twoshot_push     two-shot for x/out in the heap (in place allowed, as torch's two_shot_all_reduce_),
                   writes only over NVLink: chunks pushed to their owner's scratch, the owner's
                   sum stored straight into every rank's out; no gather slot, no copy-out; each
                   block's slice goes in PUSH_PARTS parts flagged one by one (no drain between phases)
  twoshot_pipe     two-shot in 32 KiB tiles with per-tile flags: a block pushes reduce-scatter
                   tile k+1, reduces tile k (straight into the peers' gather slots) and copies
                   the peers' tile k-1 out, so the phases overlap (flags in their own region)
  multimem         the two-shot structure with NVLink SHARP: the owner's reduce is one
                   multimem.ld_reduce through the multicast mapping and its all-gather one
                   multimem.st (compiled; never launched on hosts that must not use multicast)
  rmsnorm, lamport_rmsnorm   one-shot + residual add + RMSNorm (standard or zero-centred), a row
                   per block
Sums are in fp32 in rank order, so every rank gets bitwise the same result. Bandwidth loops keep
UNROLL 16-byte vectors in flight per thread and use up to MAX_BLOCKS blocks of THREADS threads.
Measured on 2 x H200 (graph replay, bf16): lamport 3.67 us at 1 KiB, 5.01 us at 128 KiB (before the
per-block epochs, PDL and the all-peer poll); twoshot 398.9 us at 128 MiB (perf/RESULTS.md).
"""
import cutlass
import cutlass.cute as cute

from comms.kernels import ptx

ARCHS = ("sm_90a", "sm_100a")
THREADS = 512
MAX_BLOCKS = 256
MAX_WORLD = 8
VEC_BYTES = 16
PUSH_PARTS = 4      # parts per block slice of the push two-shot (flag arrays: 1 + PUSH_PARTS)
UNROLL = 4          # 16-byte vectors in flight per thread in the bandwidth loops
LAMPORT_SENTINEL = -1  # 0xFFFFFFFF: an empty Lamport slot word
LAMPORT_EPOCHS = 4     # Lamport state words: [3 dirty counts, -, MAX_BLOCKS per-block epoch copies]


def _i64(v):
    return cutlass.Int64(v)


def _accumulate(acc, d, is_bf16: bool, base: int = 0):
    """acc[base:base+epv] += the elements of one 16-byte vector `d` (4 x Int32)."""
    if is_bf16:  # plain Python at trace time: unrolled
        for j in range(4):
            lo, hi = ptx.bf16x2_to_f32(d[j])
            acc[base + 2 * j] = acc[base + 2 * j] + lo
            acc[base + 2 * j + 1] = acc[base + 2 * j + 1] + hi
    else:
        for j in range(4):
            acc[base + j] = acc[base + j] + ptx.i32_as_f32(d[j])


def _pack(acc, is_bf16: bool, base: int = 0):
    """The fp32 accumulators acc[base:base+epv] of one vector -> 4 x Int32 in the data dtype."""
    if is_bf16:
        return [ptx.f32_to_bf16x2(acc[base + 2 * j], acc[base + 2 * j + 1]) for j in range(4)]
    return [ptx.f32_as_i32(acc[base + j]) for j in range(4)]


@cute.jit
def _copy(src, dst, v, vend, cg: cutlass.Constexpr):
    """Vectors v, v + THREADS, ... < vend of src -> dst (byte bases), UNROLL loads in flight;
    cg: read past L1 (data that peers wrote during this kernel)."""
    buf = cute.make_rmem_tensor(cute.make_layout(UNROLL * 4), cutlass.Int32)
    while v < vend:
        for u in cutlass.range_constexpr(UNROLL):
            vv = v + u * THREADS
            if vv < vend:
                if cutlass.const_expr(cg):
                    d = ptx.ld_v4_cg(src + _i64(vv) * VEC_BYTES)
                else:
                    d = ptx.ld_v4(src + _i64(vv) * VEC_BYTES)
                for j in cutlass.range_constexpr(4):
                    buf[u * 4 + j] = d[j]
        for u in cutlass.range_constexpr(UNROLL):
            vv = v + u * THREADS
            if vv < vend:
                ptx.st_v4(dst + _i64(vv) * VEC_BYTES, [buf[u * 4 + j] for j in range(4)])
        v += UNROLL * THREADS


@cute.jit
def _reduce_group(acc, stage, xa, slots, cap, rank, world, v, vend, is_bf16: cutlass.Constexpr):
    """acc[u*epv:(u+1)*epv] = sum over ranks (in rank order) of vector v + u*THREADS, for the
    UNROLL vectors below vend; rank r's copy at slots + r*cap, ours at xa."""
    epv = 8 if is_bf16 else 4
    for e in cutlass.range_constexpr(UNROLL * epv):
        acc[e] = cutlass.Float32(0.0)
    for r in cutlass.range_constexpr(MAX_WORLD):
        if r < world:
            base = slots + r * cap
            if r == rank:
                base = xa
            for u in cutlass.range_constexpr(UNROLL):
                vv = v + u * THREADS
                if vv < vend:
                    d = ptx.ld_v4_cg(base + _i64(vv) * VEC_BYTES)
                    for j in cutlass.range_constexpr(4):
                        stage[u * 4 + j] = d[j]
            for u in cutlass.range_constexpr(UNROLL):
                if v + u * THREADS < vend:
                    _accumulate(acc, [stage[u * 4 + j] for j in range(4)], is_bf16, u * epv)


@cute.jit
def _reduce_to_all(acc, stage, xa, slots, cap, rank, world, v, vend, pr, gather, oa, is_bf16: cutlass.Constexpr):
    """Two-shot's middle: reduce this thread's vectors from v (stride THREADS, UNROLL at a time, see
    _reduce_group) below vend, and store each sum to `oa` and into every peer's gather slot."""
    epv = 8 if is_bf16 else 4
    while v < vend:
        _reduce_group(acc, stage, xa, slots, cap, rank, world, v, vend, is_bf16)
        for u in cutlass.range_constexpr(UNROLL):
            if v + u * THREADS < vend:
                off = _i64(v + u * THREADS) * VEC_BYTES
                res = _pack(acc, is_bf16, u * epv)
                for r in cutlass.range_constexpr(MAX_WORLD):
                    if r < world:
                        if r != rank:
                            ptx.st_v4(pr[r] + gather + off, res)
                ptx.st_v4(oa + off, res)
        v += UNROLL * THREADS


@cute.jit
def _part_range(b0, b1, j, parts: cutlass.Constexpr):
    """Part j of `parts` equal parts of the block slice [b0, b1) (the last ones shorter or empty;
    an empty slice, b1 <= b0, gives empty parts)."""
    n = b1 - b0
    if n < 0:
        n = 0
    per = (n + parts - 1) // parts
    s0 = b0 + j * per
    s1 = s0 + per
    if s1 > b0 + n:
        s1 = b0 + n
    return s0, s1


def _part_flags(flag_off, j: int):
    """The phase-1 flag array of part j of the push two-shot: part 0 uses the ordinary phase-1
    array, part j >= 1 array 1 + j (after phase 2's), written by the push kernels only, so every
    array keeps the one-value-per-epoch scale of the other kernels' flags."""
    return flag_off if j == 0 else flag_off + _i64((1 + j) * MAX_WORLD * MAX_BLOCKS * 4)


@cute.jit
def _load_peers(peers: cute.Tensor, world):
    """The peer table in registers (unrolled over MAX_WORLD; entries past `world` are 0)."""
    pr = cute.make_rmem_tensor(cute.make_layout(MAX_WORLD), cutlass.Int64)
    for r in cutlass.range_constexpr(MAX_WORLD):
        pr[r] = cutlass.Int64(0)
        if r < world:
            pr[r] = peers[r]
    return pr


@cute.jit
def _grid():
    """(thread, block, blocks in the grid) of the calling thread: every kernel's first line."""
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nb, _, _ = cute.arch.grid_dim()
    return tid, bid, nb


@cute.jit
def _flag_epoch(peers: cute.Tensor, rank, state_off):
    """This rank's heap base and the call's epoch (state[0], read relaxed): the flagged kernels'
    prologue. Their flags for this call are published as epoch + 1."""
    my_base = peers[rank]
    return my_base, ptx.ld_relaxed_gpu(my_base + state_off)


@cute.jit
def _block_range(n, bid, nb):
    """Block bid's share [b0, b1) of n items split into nb equal runs of ceil(n / nb) (the last
    ones shorter or empty): the same split for any nb >= 1."""
    per = (n + nb - 1) // nb
    b0 = bid * per
    b1 = b0 + per
    if b1 > n:
        b1 = n
    return b0, b1


@cute.jit
def _chunk_span(c, chunk, b0, b1, nvec, tid):
    """Thread tid's first vector of the block slice [b0, b1) of owner c's chunk, and the slice's
    end (exclusive, clamped to nvec: the last chunk may be short)."""
    v = c * chunk + b0 + tid
    vend = c * chunk + b1
    if vend > nvec:
        vend = nvec
    return v, vend


@cute.jit
def _signal(peers: cute.Tensor, tid, rank, world, flag_addr_off, target):
    """Threads 0..W-1 (not ours) publish `target` into their peer's flag (release, sys scope);
    the caller has made the block's data stores visible to them with a bar.sync."""
    if tid < world:
        if tid != rank:
            ptx.st_release_sys(peers[tid] + flag_addr_off, target)


@cute.jit
def _wait(my_base, tid, rank, world, flags_src0, target, err_addr, timeout_ns, t0=None):
    """Threads 0..W-1 (not ours) spin (acquire, sys scope) until flag[tid] - target >= 0 or the
    timeout; on expiry the error word gets 1 + peer. `flags_src0`: offset of flag[src=0] for this
    block; consecutive sources are MAX_BLOCKS int32 apart. t0: start of the timeout (%globaltimer;
    default now): a kernel with many waits passes its start, so all of them share one bound."""
    if cutlass.const_expr(t0 is None):
        t0 = ptx.globaltimer()
    if tid < world:
        if tid != rank:
            faddr = my_base + flags_src0 + _i64(tid) * (MAX_BLOCKS * 4)
            f = ptx.ld_acquire_sys(faddr)
            late = cutlass.Int32(0)
            while ((f - target) < 0) & (late == 0):
                if ptx.globaltimer() - t0 > timeout_ns:
                    late = cutlass.Int32(1)
                    ptx.st_release_sys(err_addr, tid + 1)
                f = ptx.ld_acquire_sys(faddr)


@cute.jit
def _handshake(peers: cute.Tensor, my_base, tid, bid, rank, world, flags, target, err_addr, timeout_ns):
    """Block bid's exchange over the phase flags at `flags`: publish `target` to every peer
    (_signal), then wait until every peer published it to us (_wait)."""
    _signal(peers, tid, rank, world, flags + _i64(rank * MAX_BLOCKS + bid) * 4, target)
    _wait(my_base, tid, rank, world, flags + _i64(bid) * 4, target, err_addr, timeout_ns)


# ------------------------------------------------------------------------------------------ one-shot
def _make_oneshot(is_bf16: bool):
    epv = 8 if is_bf16 else 4

    @cute.kernel
    def kernel(x: cute.Tensor, out: cute.Tensor, peers: cute.Tensor, rank: cutlass.Int32,
               world: cutlass.Int32, ws_off: cutlass.Int64, cap: cutlass.Int64, flag_off: cutlass.Int64,
               state_off: cutlass.Int64, err_addr: cutlass.Int64, timeout_ns: cutlass.Int64,
               nvec: cutlass.Int32):
        tid, bid, nb = _grid()
        my_base, epoch = _flag_epoch(peers, rank, state_off)
        target = epoch + 1
        par = _i64(epoch & 1)
        xa = x.iterator.toint()
        oa = out.iterator.toint()
        v0, v1 = _block_range(nvec, bid, nb)
        # push x[v0:v1] into my slot on every peer
        slot = ws_off + (par * _i64(world) + _i64(rank)) * cap
        v = v0 + tid
        pr = _load_peers(peers, world)
        buf = cute.make_rmem_tensor(cute.make_layout(UNROLL * 4), cutlass.Int32)
        while v < v1:
            for u in cutlass.range_constexpr(UNROLL):
                if v + u * THREADS < v1:
                    d = ptx.ld_v4(xa + _i64(v + u * THREADS) * VEC_BYTES)
                    for j in cutlass.range_constexpr(4):
                        buf[u * 4 + j] = d[j]
            for r in cutlass.range_constexpr(MAX_WORLD):
                if r < world:
                    if r != rank:
                        for u in cutlass.range_constexpr(UNROLL):
                            if v + u * THREADS < v1:
                                ptx.st_v4(pr[r] + slot + _i64(v + u * THREADS) * VEC_BYTES,
                                          [buf[u * 4 + j] for j in range(4)])
            v += UNROLL * THREADS
        cute.arch.sync_threads()
        _handshake(peers, my_base, tid, bid, rank, world, flag_off, target, err_addr, timeout_ns)
        cute.arch.sync_threads()
        # reduce the W copies in rank order
        acc = cute.make_rmem_tensor(cute.make_layout(UNROLL * epv), cutlass.Float32)
        stage = cute.make_rmem_tensor(cute.make_layout(UNROLL * 4), cutlass.Int32)
        slots = my_base + ws_off + par * _i64(world) * cap
        v = v0 + tid
        while v < v1:
            _reduce_group(acc, stage, xa, slots, cap, rank, world, v, v1, is_bf16)
            for u in cutlass.range_constexpr(UNROLL):
                if v + u * THREADS < v1:
                    ptx.st_v4(oa + _i64(v + u * THREADS) * VEC_BYTES, _pack(acc, is_bf16, u * epv))
            v += UNROLL * THREADS
        ptx.advance_epoch(my_base, state_off, tid, nb, target)

    @cute.jit
    def launch(x: cute.Tensor, out: cute.Tensor, peers: cute.Tensor, rank: cutlass.Int32,
               world: cutlass.Int32, ws_off: cutlass.Int64, cap: cutlass.Int64, flag_off: cutlass.Int64,
               state_off: cutlass.Int64, err_addr: cutlass.Int64, timeout_ns: cutlass.Int64,
               nblocks: cutlass.Int32, stream):
        nvec = x.shape[0] // epv
        kernel(x, out, peers, rank, world, ws_off, cap, flag_off, state_off, err_addr, timeout_ns,
               nvec).launch(grid=(nblocks, 1, 1), block=(THREADS, 1, 1), stream=stream)

    return launch


# ------------------------------------------------------------------------------------------ Lamport one-shot
@cute.jit
def _has_sentinel(stage, base: int):
    """1 if a word of the vector stage[base:base+4] is the Lamport sentinel, else 0 (no branch)."""
    S = cutlass.Int32(LAMPORT_SENTINEL)
    return cutlass.Int32((stage[base] == S) | (stage[base + 1] == S) | (stage[base + 2] == S) | (stage[base + 3] == S))


@cute.jit
def _lamport_gather(stage, slots, lcap, off, rank, world, err_addr, timeout_ns):
    """stage[4r:4r+4] = the vector at `off` of every peer's slot r (slots + r * lcap), polled until
    none of its words is the sentinel. All W-1 volatile loads are issued before the first check,
    so ranks that already arrived cost one memory trip in all, not one each; the retry loop
    re-polls only the vectors still empty. On timeout the error word gets 1 + a missing peer."""
    for r in cutlass.range_constexpr(MAX_WORLD):
        if r < world:
            if r != rank:
                d = ptx.ld_volatile_v4(slots + r * lcap + off)
                for j in cutlass.range_constexpr(4):
                    stage[r * 4 + j] = d[j]
    pend = cutlass.Int32(0)
    for r in cutlass.range_constexpr(MAX_WORLD):
        if r < world:
            if r != rank:
                pend = pend | _has_sentinel(stage, r * 4)
    if pend != 0:
        t0 = ptx.globaltimer()
        late = cutlass.Int32(0)
        while (pend != 0) & (late == 0):
            pend = cutlass.Int32(0)
            who = cutlass.Int32(0)
            for r in cutlass.range_constexpr(MAX_WORLD):
                if r < world:
                    if r != rank:
                        if _has_sentinel(stage, r * 4) != 0:
                            d = ptx.ld_volatile_v4(slots + r * lcap + off)
                            for j in cutlass.range_constexpr(4):
                                stage[r * 4 + j] = d[j]
                            if _has_sentinel(stage, r * 4) != 0:
                                pend = cutlass.Int32(1)
                                who = cutlass.Int32(r)
            if pend != 0:
                if ptx.globaltimer() - t0 > timeout_ns:
                    late = cutlass.Int32(1)
                    ptx.st_release_sys(err_addr, who + 1)


@cute.jit
def _lamport_sum(acc, stage, own, rank, world, is_bf16: cutlass.Constexpr):
    """acc[0:epv] += every rank's vector in rank order: ours from `own` (4 words, sentinel words
    canonicalised as the peers' copies are), the peers' from `stage` (see _lamport_gather)."""
    for r in cutlass.range_constexpr(MAX_WORLD):
        if r < world:
            if r == rank:
                _accumulate(acc, [ptx.canon_word(own[j]) for j in range(4)], is_bf16)
            else:
                _accumulate(acc, [stage[r * 4 + j] for j in range(4)], is_bf16)


@cute.jit
def _lamport_clear(my_base, lam_off, lcap, clr, dirty, rank, world, tid, bid, nb):
    """Refill this block's share of buffer `clr` (its first `dirty` vectors of every source slot
    but ours) with the sentinel."""
    c0, c1 = _block_range(dirty, bid, nb)
    S = cutlass.Int32(LAMPORT_SENTINEL)
    for r in cutlass.range_constexpr(MAX_WORLD):
        if r < world:
            if r != rank:
                slot = my_base + lam_off + (_i64(clr) * _i64(world) + r) * lcap
                v = c0 + tid
                while v < c1:
                    ptx.st_v4(slot + _i64(v) * VEC_BYTES, [S, S, S, S])
                    v += THREADS


@cute.jit
def _lamport_epoch(state, bid):
    """This call's epoch: block `bid`'s own copy (word LAMPORT_EPOCHS + bid of the Lamport state
    at address `state`)."""
    return ptx.ld_relaxed_gpu(state + _i64(LAMPORT_EPOCHS + bid) * 4)


@cute.jit
def _lamport_finish(state, tid, bid, nb, cur, nvec, target):
    """Advance the epoch without a grid-wide hand-off (no ticket, no atomic, no wait on other
    blocks): every block keeps its own copy, and block b, once all its threads have read copy b,
    writes `target` into copies b, b + nb, b + 2nb, ... so all MAX_BLOCKS copies advance whatever
    the next grid's size. Block 0 records that buffer `cur` now holds nvec vectors per slot (the
    next call clears it; this call reads only the count of buffer (cur + 2) % 3)."""
    cute.arch.sync_threads()
    s = bid + tid * nb
    if s < MAX_BLOCKS:
        ptx.st_relaxed_gpu(state + _i64(LAMPORT_EPOCHS + s) * 4, target)
    if (bid == 0) & (tid == 0):
        ptx.st_relaxed_gpu(state + _i64(cur) * 4, nvec)


@cute.jit
def _load_group(buf, xa, v, vend):
    """buf[4u:4u+4] = vector v + u * THREADS of xa for the UNROLL of them below vend."""
    for u in cutlass.range_constexpr(UNROLL):
        if v + u * THREADS < vend:
            d = ptx.ld_v4(xa + _i64(v + u * THREADS) * VEC_BYTES)
            for j in cutlass.range_constexpr(4):
                buf[u * 4 + j] = d[j]


def _make_lamport(is_bf16: bool):
    """One-shot without flags: the data is its own flag. Slots start as the sentinel word
    0xFFFFFFFF; senders replace that word in their data by another NaN (`ptx.canon_word`), so a
    receiver polls each vector until no word is the sentinel. Three buffers rotate by epoch: call
    e writes buffer e%3 and clears buffer (e+2)%3 (read in call e-1; no peer writes it before call
    e+2, which needs this call finished), over the vector count recorded for it in state[b].
    `state` is the absolute address of this rank's Lamport state (not an offset: the epoch load
    need not wait for the peer table). Critical path: griddepcontrol.wait (PDL), x loads issued
    together with the epoch load, the
    peer stores, the clear (local, while the peers' stores travel), one poll per vector over
    all peers, the reduce; no grid-wide synchronisation."""
    epv = 8 if is_bf16 else 4

    @cute.kernel
    def kernel(x: cute.Tensor, out: cute.Tensor, peers: cute.Tensor, rank: cutlass.Int32,
               world: cutlass.Int32, lam_off: cutlass.Int64, lcap: cutlass.Int64, state: cutlass.Int64,
               err_addr: cutlass.Int64, timeout_ns: cutlass.Int64, nvec: cutlass.Int32):
        tid, bid, nb = _grid()
        cute.arch.griddepcontrol_wait()  # PDL: the previous kernel's writes (x, our state) are visible
        cute.arch.griddepcontrol_launch_dependents()
        my_base = peers[rank]
        xa = x.iterator.toint()
        oa = out.iterator.toint()
        v0, v1 = _block_range(nvec, bid, nb)
        # the first x vectors are in flight while the epoch (needed for the slot address) loads
        buf = cute.make_rmem_tensor(cute.make_layout(UNROLL * 4), cutlass.Int32)
        v = v0 + tid
        _load_group(buf, xa, v, v1)
        epoch = _lamport_epoch(state, bid)
        target = epoch + 1
        cur = (epoch & 0x3FFFFFFF) % 3
        clr = (cur + 2) % 3
        dirty = ptx.ld_relaxed_gpu(state + _i64(clr) * 4)  # vectors per slot
        pr = _load_peers(peers, world)
        buf_cur = lam_off + _i64(cur) * _i64(world) * lcap
        # push x (sentinel words replaced) into my slot of buffer `cur` on every peer
        while v < v1:
            for u in cutlass.range_constexpr(UNROLL):
                vv = v + u * THREADS
                if vv < v1:
                    c = [ptx.canon_word(buf[u * 4 + j]) for j in range(4)]
                    for r in cutlass.range_constexpr(MAX_WORLD):
                        if r < world:
                            if r != rank:
                                ptx.st_v4(pr[r] + buf_cur + _i64(rank) * lcap + _i64(vv) * VEC_BYTES, c)
            v += UNROLL * THREADS
            _load_group(buf, xa, v, v1)
        _lamport_clear(my_base, lam_off, lcap, clr, dirty, rank, world, tid, bid, nb)
        # reduce in rank order, polling the peers' slots
        acc = cute.make_rmem_tensor(cute.make_layout(epv), cutlass.Float32)
        stage = cute.make_rmem_tensor(cute.make_layout(MAX_WORLD * 4), cutlass.Int32)
        v = v0 + tid
        while v < v1:
            off = _i64(v) * VEC_BYTES
            own = ptx.ld_v4(xa + off)  # issued before the polls, not after them
            _lamport_gather(stage, my_base + buf_cur, lcap, off, rank, world, err_addr, timeout_ns)
            for e in cutlass.range_constexpr(epv):
                acc[e] = cutlass.Float32(0.0)
            _lamport_sum(acc, stage, own, rank, world, is_bf16)
            ptx.st_v4(oa + off, _pack(acc, is_bf16))
            v += THREADS
        _lamport_finish(state, tid, bid, nb, cur, nvec, target)

    @cute.jit
    def launch(x: cute.Tensor, out: cute.Tensor, peers: cute.Tensor, rank: cutlass.Int32,
               world: cutlass.Int32, lam_off: cutlass.Int64, lcap: cutlass.Int64, state: cutlass.Int64,
               err_addr: cutlass.Int64, timeout_ns: cutlass.Int64, nblocks: cutlass.Int32, pdl: cutlass.Int32,
               stream):
        nvec = x.shape[0] // epv
        kernel(x, out, peers, rank, world, lam_off, lcap, state, err_addr, timeout_ns, nvec).launch(
            grid=(nblocks, 1, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=pdl)

    return launch


# ------------------------------------------------------------------------------------------ two-shot
def _make_twoshot(is_bf16: bool, variant: str):
    """Two-shot, by `variant`:
      "unicast"   reduce-scatter into the owners' scratch, all-gather into the gather slots, then
                  each rank copies the peers' chunks from its gather slot to out;
      "multimem"  the same structure with the owner's reduce and all-gather done by NVLink SHARP
                  through the multicast mapping at `mc_base`;
      "push"      x and out in the heap at the same offsets on every rank (out may be x): the
                  owner stores its reduced chunk straight into every rank's out (in the peers'
                  heaps at out's offset), so NVLink carries writes only and there is no copy-out;
                  the last flag wait keeps a rank from returning before its out is complete.
    A block only ever touches its own slice of every chunk, and an owner writes a peer's slice
    only after that peer's flag says it pushed (read) that slice, so in place is safe.
    push sends a block's slice in PUSH_PARTS parts, each flagged to its owner as soon as it is
    pushed (phase-1 flag array j for part j), so the block reduces part j while its later parts
    are still on the wire and NVLink does not drain at the phase boundary (measured: 128 MiB
    384.5 -> 378.5 us on 132 blocks, perf/RESULTS.md)."""
    if variant not in ("unicast", "multimem", "push"):
        raise ValueError(f"variant={variant!r}: expected 'unicast', 'multimem' or 'push'")
    multimem = variant == "multimem"
    push = variant == "push"
    parts = PUSH_PARTS if push else 1
    epv = 8 if is_bf16 else 4

    @cute.kernel
    def kernel(x: cute.Tensor, out: cute.Tensor, peers: cute.Tensor, rank: cutlass.Int32,
               world: cutlass.Int32, ws_off: cutlass.Int64, cap: cutlass.Int64, flag_off: cutlass.Int64,
               state_off: cutlass.Int64, err_addr: cutlass.Int64, timeout_ns: cutlass.Int64,
               mc_base: cutlass.Int64, nvec: cutlass.Int32):
        tid, bid, nb = _grid()
        my_base, epoch = _flag_epoch(peers, rank, state_off)
        target = epoch + 1
        par = _i64(epoch & 1)
        xa = x.iterator.toint()
        oa = out.iterator.toint()
        chunk = (nvec + world - 1) // world          # vectors owned per rank
        b0, b1 = _block_range(chunk, bid, nb)        # this block's slice of every chunk
        scatter = ws_off + (par * _i64(world)) * cap       # + src * cap + v * 16
        gather = ws_off + (2 * _i64(world) + par) * cap    # + v * 16
        flags1 = flag_off
        flags2 = flag_off + _i64(MAX_WORLD * MAX_BLOCKS * 4)
        pr = _load_peers(peers, world)
        # phase 1: my slice of every owner's chunk -> that owner (multimem: -> my own heap), part by part
        for j in cutlass.range_constexpr(parts):
            s0, s1 = _part_range(b0, b1, j, parts)
            for c in cutlass.range(world):
                if cutlass.const_expr(multimem) or c != rank:
                    v, vend = _chunk_span(c, chunk, s0, s1, nvec, tid)
                    dst = pr[0] + scatter + _i64(rank) * cap
                    for r in cutlass.range_constexpr(1, MAX_WORLD):
                        if r == c:
                            dst = pr[r] + scatter + _i64(rank) * cap
                    if cutlass.const_expr(multimem):
                        dst = my_base + scatter
                    _copy(xa, dst, v, vend, False)
            if cutlass.const_expr(parts > 1):
                cute.arch.sync_threads()
                _signal(peers, tid, rank, world, _part_flags(flag_off, j) + _i64(rank * MAX_BLOCKS + bid) * 4, target)
        if cutlass.const_expr(parts == 1):
            cute.arch.sync_threads()
            _handshake(peers, my_base, tid, bid, rank, world, flags1, target, err_addr, timeout_ns)
            cute.arch.sync_threads()
        # reduce my chunk's slice, keep it, and push it to every peer's gather slot (push: their out)
        acc = cute.make_rmem_tensor(cute.make_layout(UNROLL * epv), cutlass.Float32)
        stage = cute.make_rmem_tensor(cute.make_layout(UNROLL * 4), cutlass.Int32)
        ag = gather  # where the sums go in the peers' heaps
        if cutlass.const_expr(push):
            ag = oa - my_base  # out's heap offset, the same on every rank
        t0 = ptx.globaltimer()
        for j in cutlass.range_constexpr(parts):
            if cutlass.const_expr(parts > 1):  # every owner pushed part j to me: reduce it
                _wait(my_base, tid, rank, world, _part_flags(flag_off, j) + _i64(bid) * 4, target, err_addr,
                      timeout_ns, t0)
                cute.arch.sync_threads()
            s0, s1 = _part_range(b0, b1, j, parts)
            v, vend = _chunk_span(rank, chunk, s0, s1, nvec, tid)
            if cutlass.const_expr(multimem):
                while v < vend:
                    off = _i64(v) * VEC_BYTES
                    ptx.multimem_st_v4(mc_base + gather + off,
                                       ptx.multimem_ld_reduce_v4(mc_base + scatter + off, is_bf16))
                    v += THREADS
            else:
                _reduce_to_all(acc, stage, xa, my_base + scatter, cap, rank, world, v, vend, pr, ag, oa, is_bf16)
        cute.arch.sync_threads()
        if cutlass.const_expr(multimem):
            ptx.fence_acq_rel_sys()
        _handshake(peers, my_base, tid, bid, rank, world, flags2, target, err_addr, timeout_ns)
        cute.arch.sync_threads()
        # copy the other owners' reduced slices out of my gather slot (push: they are in out already)
        if cutlass.const_expr(not push):
            for c in cutlass.range(world):
                if cutlass.const_expr(multimem) or c != rank:
                    v, vend = _chunk_span(c, chunk, b0, b1, nvec, tid)
                    _copy(my_base + gather, oa, v, vend, True)
        ptx.advance_epoch(my_base, state_off, tid, nb, target)

    @cute.jit
    def launch(x: cute.Tensor, out: cute.Tensor, peers: cute.Tensor, rank: cutlass.Int32,
               world: cutlass.Int32, ws_off: cutlass.Int64, cap: cutlass.Int64, flag_off: cutlass.Int64,
               state_off: cutlass.Int64, err_addr: cutlass.Int64, timeout_ns: cutlass.Int64,
               mc_base: cutlass.Int64, nblocks: cutlass.Int32, stream):
        nvec = x.shape[0] // epv
        kernel(x, out, peers, rank, world, ws_off, cap, flag_off, state_off, err_addr, timeout_ns,
               mc_base, nvec).launch(grid=(nblocks, 1, 1), block=(THREADS, 1, 1), stream=stream)

    return launch


# ------------------------------------------------------------------------------------------ in-heap two-shot
def _make_twoshot_symm(is_bf16: bool):
    """Two-shot for x and out that live in the heap at the same offsets on every rank (as torch's
    two_shot_all_reduce_ on a symmetric buffer): no staging copies. A start handshake (phase-0
    flags: each peer's x is final, its earlier kernels are done), then each owner reads its chunk
    of every rank's x over NVLink, reduces it and writes the result into every rank's out, then a
    done handshake (phase-1 flags) so no rank reuses x or out while a peer still touches them."""
    epv = 8 if is_bf16 else 4

    @cute.kernel
    def kernel(x: cute.Tensor, out: cute.Tensor, peers: cute.Tensor, rank: cutlass.Int32,
               world: cutlass.Int32, x_off: cutlass.Int64, o_off: cutlass.Int64, flag_off: cutlass.Int64,
               state_off: cutlass.Int64, err_addr: cutlass.Int64, timeout_ns: cutlass.Int64,
               nvec: cutlass.Int32):
        tid, bid, nb = _grid()
        my_base, epoch = _flag_epoch(peers, rank, state_off)
        target = epoch + 1
        flags0 = flag_off
        flags1 = flag_off + _i64(MAX_WORLD * MAX_BLOCKS * 4)
        pr = _load_peers(peers, world)
        _handshake(peers, my_base, tid, bid, rank, world, flags0, target, err_addr, timeout_ns)
        cute.arch.sync_threads()
        chunk = (nvec + world - 1) // world
        b0, b1 = _block_range(chunk, bid, nb)
        v, vend = _chunk_span(rank, chunk, b0, b1, nvec, tid)
        acc = cute.make_rmem_tensor(cute.make_layout(UNROLL * epv), cutlass.Float32)
        stage = cute.make_rmem_tensor(cute.make_layout(UNROLL * 4), cutlass.Int32)
        while v < vend:
            for e in cutlass.range_constexpr(UNROLL * epv):
                acc[e] = cutlass.Float32(0.0)
            for r in cutlass.range_constexpr(MAX_WORLD):
                if r < world:
                    for u in cutlass.range_constexpr(UNROLL):
                        if v + u * THREADS < vend:
                            d = ptx.ld_v4_cg(pr[r] + x_off + _i64(v + u * THREADS) * VEC_BYTES)
                            for j in cutlass.range_constexpr(4):
                                stage[u * 4 + j] = d[j]
                    for u in cutlass.range_constexpr(UNROLL):
                        if v + u * THREADS < vend:
                            _accumulate(acc, [stage[u * 4 + j] for j in range(4)], is_bf16, u * epv)
            for u in cutlass.range_constexpr(UNROLL):
                if v + u * THREADS < vend:
                    res = _pack(acc, is_bf16, u * epv)
                    for r in cutlass.range_constexpr(MAX_WORLD):
                        if r < world:
                            ptx.st_v4(pr[r] + o_off + _i64(v + u * THREADS) * VEC_BYTES, res)
            v += UNROLL * THREADS
        cute.arch.sync_threads()
        _handshake(peers, my_base, tid, bid, rank, world, flags1, target, err_addr, timeout_ns)
        ptx.advance_epoch(my_base, state_off, tid, nb, target)

    @cute.jit
    def launch(x: cute.Tensor, out: cute.Tensor, peers: cute.Tensor, rank: cutlass.Int32,
               world: cutlass.Int32, x_off: cutlass.Int64, o_off: cutlass.Int64, flag_off: cutlass.Int64,
               state_off: cutlass.Int64, err_addr: cutlass.Int64, timeout_ns: cutlass.Int64,
               nblocks: cutlass.Int32, stream):
        nvec = x.shape[0] // epv
        kernel(x, out, peers, rank, world, x_off, o_off, flag_off, state_off, err_addr, timeout_ns, nvec).launch(
            grid=(nblocks, 1, 1), block=(THREADS, 1, 1), stream=stream)

    return launch


# ------------------------------------------------------------------------------------------ pipelined two-shot
PIPE_TILE = UNROLL * THREADS   # vectors of one chunk per pipeline step (32 KiB)
PIPE_STEP = 1 << 16            # flag value = (epoch + 1) * PIPE_STEP + tiles done (< PIPE_STEP per block)


@cute.jit
def _tile_span(c, t, chunk, nvec, tid):
    """Thread tid's first vector of tile t of owner c's chunk, and that tile's end (exclusive)."""
    start = c * chunk + t * PIPE_TILE
    end = start + PIPE_TILE
    if end > (c + 1) * chunk:
        end = (c + 1) * chunk
    if end > nvec:
        end = nvec
    return start + tid, end


@cute.jit
def _pipe_push(xa, pr, scatter, cap, rank, world, t, chunk, nvec, tid):
    """Reduce-scatter step: tile t of every peer's chunk of x -> my slot in that peer's scatter area."""
    for r in cutlass.range_constexpr(MAX_WORLD):
        if r < world:
            if r != rank:
                v, vend = _tile_span(r, t, chunk, nvec, tid)
                _copy(xa, pr[r] + scatter + _i64(rank) * cap, v, vend, False)


@cute.jit
def _pipe_gather(gather, oa, my_base, tid, rank, world, flags_src0, target, err_addr, timeout_ns, t0, t, chunk,
                 nvec):
    """All-gather step: once every peer's flag reaches `target`, copy tile t of the peers' chunks
    from my gather slot (written over NVLink by their owners) into out."""
    _wait(my_base, tid, rank, world, flags_src0, target, err_addr, timeout_ns, t0)
    cute.arch.sync_threads()
    for r in cutlass.range_constexpr(MAX_WORLD):
        if r < world:
            if r != rank:
                v, vend = _tile_span(r, t, chunk, nvec, tid)
                _copy(gather, oa, v, vend, True)


def _make_twoshot_pipe(is_bf16: bool):
    """Two-shot whose phases overlap: each block walks its tiles t = bid, bid + nb, ... of the
    chunks and, per step k, pushes reduce-scatter tile k+1, reduces tile k of its own chunk (x
    plus the peers' scatter slots; the result goes to out and straight into every peer's gather
    slot), then copies the peers' reduced tile k-1 from its gather slot into out. Per-tile flags
    (their own region, value (epoch + 1) * PIPE_STEP + tiles done, monotonic; signed-difference
    waits) replace the phase-wide hand-offs, so NVLink pushes of later tiles run while the local
    gather -> out copies of earlier ones do, and no phase of the GPU waits with NVLink idle."""
    epv = 8 if is_bf16 else 4

    @cute.kernel
    def kernel(x: cute.Tensor, out: cute.Tensor, peers: cute.Tensor, rank: cutlass.Int32,
               world: cutlass.Int32, ws_off: cutlass.Int64, cap: cutlass.Int64, flag_off: cutlass.Int64,
               state_off: cutlass.Int64, err_addr: cutlass.Int64, timeout_ns: cutlass.Int64,
               nvec: cutlass.Int32):
        tid, bid, nb = _grid()
        t0 = ptx.globaltimer()  # every wait of this call is bounded by timeout_ns from here
        my_base, epoch = _flag_epoch(peers, rank, state_off)
        base = (epoch + 1) * PIPE_STEP
        par = _i64(epoch & 1)
        xa = x.iterator.toint()
        oa = out.iterator.toint()
        chunk = (nvec + world - 1) // world
        ntiles = (chunk + PIPE_TILE - 1) // PIPE_TILE
        steps = cutlass.Int32(0)
        if bid < ntiles:
            steps = (ntiles - bid + nb - 1) // nb
        scatter = ws_off + (par * _i64(world)) * cap
        gather = ws_off + (2 * _i64(world) + par) * cap
        rs_flags = flag_off
        ag_flags = flag_off + _i64(MAX_WORLD * MAX_BLOCKS * 4)
        pr = _load_peers(peers, world)
        acc = cute.make_rmem_tensor(cute.make_layout(UNROLL * epv), cutlass.Float32)
        stage = cute.make_rmem_tensor(cute.make_layout(UNROLL * 4), cutlass.Int32)
        if steps > 0:
            _pipe_push(xa, pr, scatter, cap, rank, world, bid, chunk, nvec, tid)
            cute.arch.sync_threads()
            _signal(peers, tid, rank, world, rs_flags + _i64(rank * MAX_BLOCKS + bid) * 4, base + 1)
        k = cutlass.Int32(0)
        while k < steps:
            t = bid + k * nb
            if k + 1 < steps:  # the next tile's reduce-scatter is in flight while this one reduces
                _pipe_push(xa, pr, scatter, cap, rank, world, t + nb, chunk, nvec, tid)
                cute.arch.sync_threads()
                _signal(peers, tid, rank, world, rs_flags + _i64(rank * MAX_BLOCKS + bid) * 4, base + k + 2)
            _wait(my_base, tid, rank, world, rs_flags + _i64(bid) * 4, base + k + 1, err_addr, timeout_ns, t0)
            cute.arch.sync_threads()
            v, vend = _tile_span(rank, t, chunk, nvec, tid)
            _reduce_to_all(acc, stage, xa, my_base + scatter, cap, rank, world, v, vend, pr, gather, oa, is_bf16)
            cute.arch.sync_threads()
            _signal(peers, tid, rank, world, ag_flags + _i64(rank * MAX_BLOCKS + bid) * 4, base + k + 1)
            if k > 0:  # the peers' reduced tile k-1 has had a whole step to arrive
                _pipe_gather(my_base + gather, oa, my_base, tid, rank, world, ag_flags + _i64(bid) * 4, base + k,
                             err_addr, timeout_ns, t0, t - nb, chunk, nvec)
            k += 1
        if steps > 0:
            _pipe_gather(my_base + gather, oa, my_base, tid, rank, world, ag_flags + _i64(bid) * 4, base + steps,
                         err_addr, timeout_ns, t0, bid + (steps - 1) * nb, chunk, nvec)
        ptx.advance_epoch(my_base, state_off, tid, nb, epoch + 1)

    @cute.jit
    def launch(x: cute.Tensor, out: cute.Tensor, peers: cute.Tensor, rank: cutlass.Int32,
               world: cutlass.Int32, ws_off: cutlass.Int64, cap: cutlass.Int64, flag_off: cutlass.Int64,
               state_off: cutlass.Int64, err_addr: cutlass.Int64, timeout_ns: cutlass.Int64,
               nblocks: cutlass.Int32, stream):
        nvec = x.shape[0] // epv
        kernel(x, out, peers, rank, world, ws_off, cap, flag_off, state_off, err_addr, timeout_ns, nvec).launch(
            grid=(nblocks, 1, 1), block=(THREADS, 1, 1), stream=stream)

    return launch


# ------------------------------------------------------------------------------------------ fused RMSNorm
@cute.jit
def _block_sum(v, smem, tid):
    """Sum of one Float32 per thread over the block (warp shuffles, then smem[warp])."""
    for k in cutlass.range_constexpr(5):
        v = v + ptx.shfl_bfly_f32(v, 16 >> k)
    if tid % 32 == 0:
        smem[tid // 32] = v
    cute.arch.sync_threads()
    total = cutlass.Float32(0.0)
    for w in cutlass.range_constexpr(THREADS // 32):
        total = total + smem[w]
    cute.arch.sync_threads()
    return total


def _make_oneshot_rmsnorm(is_bf16: bool, lamport: bool):
    """One-shot all-reduce of x [R, H] fused with `res = sum + residual` and RMSNorm of res;
    lamport=True: the Lamport exchange (ws_off/cap/state_off name the Lamport buffers and
    state, flag_off is unused), else the flagged one."""
    epv = 8 if is_bf16 else 4

    @cute.kernel
    def kernel(x: cute.Tensor, residual: cute.Tensor, weight: cute.Tensor, out: cute.Tensor,
               res_out: cute.Tensor, peers: cute.Tensor, rank: cutlass.Int32, world: cutlass.Int32,
               ws_off: cutlass.Int64, cap: cutlass.Int64, flag_off: cutlass.Int64, state_off: cutlass.Int64,
               err_addr: cutlass.Int64, timeout_ns: cutlass.Int64, eps: cutlass.Float32,
               w_shift: cutlass.Float32, hvec: cutlass.Int32, rows: cutlass.Int32):
        tid, bid, nb = _grid()
        smem_alloc = cutlass.utils.SmemAllocator()
        smem = smem_alloc.allocate_tensor(cutlass.Float32, cute.make_layout(THREADS // 32), byte_alignment=16)
        cute.arch.griddepcontrol_wait()  # PDL launch: the previous kernel's writes are visible
        cute.arch.griddepcontrol_launch_dependents()
        my_base = peers[rank]
        epoch = cutlass.Int32(0)
        if cutlass.const_expr(lamport):
            epoch = _lamport_epoch(my_base + state_off, bid)
        else:
            epoch = ptx.ld_relaxed_gpu(my_base + state_off)
        target = epoch + 1
        cur = epoch & 1  # flagged: parity; Lamport: buffer epoch % 3
        clr = cur
        if cutlass.const_expr(lamport):
            cur = (epoch & 0x3FFFFFFF) % 3
            clr = (cur + 2) % 3
        xa = x.iterator.toint()
        ra = residual.iterator.toint()
        wa = weight.iterator.toint()
        oa = out.iterator.toint()
        qa = res_out.iterator.toint()
        slots = ws_off + _i64(cur) * _i64(world) * cap  # + r * cap: rank r's copy
        pr = _load_peers(peers, world)
        # push my rows to every peer
        row = bid
        while row < rows:
            j = tid
            while j < hvec:
                off = (_i64(row) * _i64(hvec) + _i64(j)) * VEC_BYTES
                d = ptx.ld_v4(xa + off)
                if cutlass.const_expr(lamport):
                    d = [ptx.canon_word(d[k]) for k in range(4)]
                for r in cutlass.range_constexpr(MAX_WORLD):
                    if r < world:
                        if r != rank:
                            ptx.st_v4(pr[r] + slots + _i64(rank) * cap + off, d)
                j += THREADS
            row += nb
        if cutlass.const_expr(lamport):
            dirty = ptx.ld_relaxed_gpu(my_base + state_off + _i64(clr) * 4)
            _lamport_clear(my_base, ws_off, cap, clr, dirty, rank, world, tid, bid, nb)
        else:
            cute.arch.sync_threads()
            _handshake(peers, my_base, tid, bid, rank, world, flag_off, target, err_addr, timeout_ns)
            cute.arch.sync_threads()
        acc = cute.make_rmem_tensor(cute.make_layout(epv), cutlass.Float32)
        stage = cute.make_rmem_tensor(cute.make_layout(MAX_WORLD * 4), cutlass.Int32)
        inv_h = cutlass.Float32(1.0) / cutlass.Float32(hvec * epv)
        row = bid
        while row < rows:
            # pass 1: res = sum_r x_r + residual (rounded to the dtype) -> res_out; sum of squares
            sq = cutlass.Float32(0.0)
            j = tid
            while j < hvec:
                off = (_i64(row) * _i64(hvec) + _i64(j)) * VEC_BYTES
                for e in cutlass.range_constexpr(epv):
                    acc[e] = cutlass.Float32(0.0)
                if cutlass.const_expr(lamport):
                    own = ptx.ld_v4(xa + off)
                    _lamport_gather(stage, my_base + slots, cap, off, rank, world, err_addr, timeout_ns)
                    _lamport_sum(acc, stage, own, rank, world, is_bf16)
                else:
                    for r in cutlass.range_constexpr(MAX_WORLD):
                        if r < world:
                            a = my_base + slots + r * cap + off
                            if r == rank:
                                a = xa + off
                            _accumulate(acc, ptx.ld_v4_cg(a), is_bf16)
                _accumulate(acc, ptx.ld_v4(ra + off), is_bf16)
                packed = _pack(acc, is_bf16)
                ptx.st_v4(qa + off, packed)
                for e in cutlass.range_constexpr(epv):
                    acc[e] = cutlass.Float32(0.0)
                _accumulate(acc, packed, is_bf16)  # the rounded values, as a separate add would see
                for e in cutlass.range_constexpr(epv):
                    sq = sq + acc[e] * acc[e]
                j += THREADS
            rstd = ptx.rsqrt(_block_sum(sq, smem, tid) * inv_h + eps)
            # pass 2: out = res * rstd * (w + w_shift); each thread re-reads its own res_out stores
            j = tid
            while j < hvec:
                off = (_i64(row) * _i64(hvec) + _i64(j)) * VEC_BYTES
                for e in cutlass.range_constexpr(epv):
                    acc[e] = cutlass.Float32(0.0)
                _accumulate(acc, ptx.ld_v4(qa + off), is_bf16)
                wv = cute.make_rmem_tensor(cute.make_layout(epv), cutlass.Float32)
                for e in cutlass.range_constexpr(epv):
                    wv[e] = w_shift
                _accumulate(wv, ptx.ld_v4(wa + _i64(j) * VEC_BYTES), is_bf16)
                for e in cutlass.range_constexpr(epv):
                    acc[e] = acc[e] * rstd * wv[e]
                ptx.st_v4(oa + off, _pack(acc, is_bf16))
                j += THREADS
            row += nb
        if cutlass.const_expr(lamport):
            _lamport_finish(my_base + state_off, tid, bid, nb, cur, rows * hvec, target)
        else:
            ptx.advance_epoch(my_base, state_off, tid, nb, target)

    @cute.jit
    def launch(x: cute.Tensor, residual: cute.Tensor, weight: cute.Tensor, out: cute.Tensor,
               res_out: cute.Tensor, peers: cute.Tensor, rank: cutlass.Int32, world: cutlass.Int32,
               ws_off: cutlass.Int64, cap: cutlass.Int64, flag_off: cutlass.Int64, state_off: cutlass.Int64,
               err_addr: cutlass.Int64, timeout_ns: cutlass.Int64, eps: cutlass.Float32,
               w_shift: cutlass.Float32, nblocks: cutlass.Int32, pdl: cutlass.Int32, stream):
        hvec = weight.shape[0] // epv
        rows = x.shape[0] // weight.shape[0]
        kernel(x, residual, weight, out, res_out, peers, rank, world, ws_off, cap, flag_off, state_off,
               err_addr, timeout_ns, eps, w_shift, hvec, rows).launch(
            grid=(nblocks, 1, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=pdl)

    return launch


# ------------------------------------------------------------------------------------------ export
def _dtypes():
    return {"bf16": cutlass.BFloat16, "fp32": cutlass.Float32}


def compile_for_export(arch: str) -> dict:
    """Compile every all-reduce kernel for `arch` against fake tensors (no GPU needed).

    Exported names: allreduce_{lamport,oneshot,twoshot,twoshot_symm,twoshot_push,twoshot_pipe,multimem}_{bf16,
    fp32},
    allreduce_{rmsnorm,lamport_rmsnorm}_{bf16,fp32}.
    """
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cutlass.runtime import make_fake_stream

    opts = f"--gpu-arch {arch} --enable-tvm-ffi"
    i32, i64 = cutlass.Int32(0), cutlass.Int64(0)
    out = {}
    for name, dt in _dtypes().items():
        n = cute.sym_int()
        x = make_fake_compact_tensor(dt, (n,), assumed_align=16)
        y = make_fake_compact_tensor(dt, (n,), assumed_align=16)
        peers = make_fake_compact_tensor(cutlass.Int64, (cute.sym_int(),), assumed_align=8)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        common = (x, y, peers, i32, i32, i64, i64, i64, i64, i64, i64)
        out[f"allreduce_lamport_{name}"] = cute.compile(_make_lamport(dt is cutlass.BFloat16), x, y, peers, i32, i32,
                                                        i64, i64, i64, i64, i64, i32, i32, stream, options=opts)
        out[f"allreduce_twoshot_symm_{name}"] = cute.compile(_make_twoshot_symm(dt is cutlass.BFloat16), *common,
                                                             i32, stream, options=opts)
        out[f"allreduce_twoshot_pipe_{name}"] = cute.compile(_make_twoshot_pipe(dt is cutlass.BFloat16), *common,
                                                             i32, stream, options=opts)
        out[f"allreduce_oneshot_{name}"] = cute.compile(_make_oneshot(dt is cutlass.BFloat16), *common, i32,
                                                        stream, options=opts)
        for algo, variant in (("twoshot", "unicast"), ("twoshot_push", "push"), ("multimem", "multimem")):
            out[f"allreduce_{algo}_{name}"] = cute.compile(_make_twoshot(dt is cutlass.BFloat16, variant), *common,
                                                           i64, i32, stream, options=opts)
        h = cute.sym_int()
        rows_h = [make_fake_compact_tensor(dt, (n,), assumed_align=16) for _ in range(4)]
        w = make_fake_compact_tensor(dt, (h,), assumed_align=16)
        f32 = cutlass.Float32(0.0)
        for tag, lam in (("rmsnorm", False), ("lamport_rmsnorm", True)):
            out[f"allreduce_{tag}_{name}"] = cute.compile(
                _make_oneshot_rmsnorm(dt is cutlass.BFloat16, lam), rows_h[0], rows_h[1], w, rows_h[2], rows_h[3],
                peers, i32, i32, i64, i64, i64, i64, i64, i64, f32, f32, i32, i32, stream, options=opts)
    return out
