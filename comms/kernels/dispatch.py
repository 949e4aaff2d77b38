"""Fused DP-EP MoE dispatch and combine kernels over the symmetric heap (CuTeDSL; sm_90a / sm_100a).

One kernel each; both are CUDA-graph safe (every epoch and counter lives in device memory, no host
round trip) and every wait on a peer is bounded by `timeout_ns` of %globaltimer (on expiry the
error word gets a code and the kernel carries on, so the host raises instead of the GPU hanging).
All blocks of a launch must be co-resident (grid <= SM count, one block per SM): every block
arrives on every rank by itself (`_arrive`: one red.release.sys per destination, no ticket chain,
no fence, no last block) and every block waits for every block of every launch of the epoch. One
source adds exactly ARRIVAL_STEP per epoch to each counter whatever its grid (block 0 adds the
correction ARRIVAL_STEP + 1 - nb, the others 1), so the grid is any 1..SM count, chosen per call
and per rank (`comms.dispatch_fused.auto_blocks`).

Heap regions (byte offsets chosen by `comms.dispatch_fused`, identical on every rank; R ranks,
M = max tokens per rank, K = top-k, L = local experts):
  rx    bf16  [R, M, H]  token rows, rank-major: row (s, t) = token t of source rank s (unpipelined:
                         peers only, own rows are packed from x). bf16: the sentinel 0xFFFFFFFF in
                         every word not yet delivered (filled by the host; the pack empties what it
                         read; senders never store it: ptx.canon_word)
  rid   int32 [R, M, K]  its top-k global expert ids;  rw fp32 [R, M, K] its weights
  rslot int32 [R, M, K]  for slots on this rank: index of the token among source s's tokens of
                         that expert (so packing needs no cross-block scan on the receiver)
  rstamp int32 [R, M]    dispatch epoch of row (s, t)'s metadata (rid, rw; written in A1 with the
                         tables with overlap, else with the rows): the row comes this epoch iff it
                         equals the epoch
  rntok int32 [2, R]     tokens of source s this epoch;  recnt int32 [2, R, L] entries per (s, expert).
                         Both tables alternate by epoch parity and each word is count | tag, the tag the
                         epoch's low 16 bits above the count (so counts < 2**16): a receiver polls them
                         until they carry its epoch's tag, with no arrival counter (_load_tables)
  dcnt  int32 [1 + P, R] dispatch arrival counters (source s adds ARRIVAL_STEP per epoch to each;
                         a rank at epoch e waits for cnt - e * ARRIVAL_STEP >= 0 modulo 2**32:
                         wrap-safe). dcnt[0] the tables arrival (rslot, recnt, rntok, rnph written;
                         with overlap rid, rw, rstamp too), dcnt[1 + q] the rows arrival of send
                         phase q (rx written, without overlap rid, rw, rstamp; it follows the tables
                         arrival in program order, so it covers the tables too). Unpipelined P = 1;
                         pipelined P = maxp
  cx    bf16  [R, M, H]  combine partials: row (s, t) = rank s's partial for my token t (the
                         sentinel 0xFFFFFFFF in every word not yet delivered; see combine)
  state int32 [4]        dispatch epoch (block 0 stores the new one after its wait), 3 unused
  rnph  int32 [R]        pipelined dispatch: send phases of source s this epoch

dispatch (one launch; `overlap` chosen per call and per rank, ranks may differ):
  A1. slot scan: per global expert, each hit's index among this rank's tokens of that expert
     (rslot) and the per-(rank, expert) count (recnt, tagged) go to the expert's owner (ballot + popc); with
     overlap the scan of a token's first expert on an owner also writes the row's ids, weights and
     stamp there (to this rank too: combine reads them); block 0 also stores rntok[me] on every rank
     with its arrival.
  A2. rows: all warps copy 2 KiB chunks of own token rows (16-byte vectors, 4 per lane) to every
     distinct peer rank of the token (once per rank, not per expert); without overlap with ids,
     weights and stamp on chunk 0 (to this rank too). No row goes to this rank's own rx: own rows
     are packed straight from x (MXFP8: quantized in registers the same way).
  C. pack: tables first -- polled from the tagged words into shared memory (all loads in flight at
     once), then per local expert the exclusive prefix of recnt over sources, the expert
     bases, the sources' row starts in shared memory (block 0 writes the row starts to `rstart` for
     combine) -- then each (row, chunk) unit is loaded once and stored to every local expert slot of
     the row at base[e] + prefix[s, e] + rslot. Output order (per expert: source rank, then token)
     equals the torch reference's.
  overlap = 0 (latency; small batches): A1 runs on the last E warps (one global expert each) while
     A2 starts at warp 0; block barrier; lane d of warp 0 releases the block's arrival into dcnt[0]
     and dcnt[1] (rank me) on rank d (`_arrive`); tables (polled: no wait); own tokens packed from x
     while the peers' rows are still arriving; wait for dcnt[1] of every source (acquire, bounded;
     warp 0, convergent: `_wait_all`); barrier; block 0 stores the epoch (`_store_epoch`); C over
     the peers' received rows (the units continue the own rows' round robin over the warps).
  overlap = 1 (large batches): A1 with a block per expert (8 warps split the tokens: count, block
     prefix, write) so it is short; arrive on dcnt[0]; wait for dcnt[0] of every source; tables
     (which now say which rows will arrive). bf16: epoch; then one key-major loop (_send_and_pack)
     of A2 with the own-row pack fused in (each unit loaded once, sent to the peers and stored to its
     own local slots) and C over the peers' rows, each received chunk polled until its data is in
     (the data is its own flag, as in combine), so the peers' rows are packed while later rows are
     still on the wire; arrive on dcnt[1] (for peers without overlap, which wait on it). MXFP8 (its
     scale bytes are stored a byte at a time, so a word can be half delivered): A2 with the own-row
     pack; arrive on dcnt[1]; wait for it; epoch; C over the peers' rows. No deadlock in mixed calls:
     every wait on dcnt[0] needs only tables arrivals, which no rank makes after a wait; a wait on
     dcnt[1] needs rows arrivals, made after at most a dcnt[0] wait and the polls, which need only
     sends (made after at most a dcnt[0] wait; see _send_and_pack for the loop's order).
pipelined dispatch (dispatch_pipe_kK; host: pipeline_phases > 1): unpipelined, C runs after A
at large token counts, so the wire and the peers' pack take turns. Here a source sends its tokens
in nphase <= maxp phases of ch = ceil(ntok / nphase) tokens (A1 and rntok / rnph go with the
tables arrival); "phase counter q" is dcnt[1 + q].
  overlap = 0: own rows go through rx as the peers' do. A block sends phase 0, arrives on the
     tables counter and phase counter 0 (one release, `_arrive`'s consecutive counters), waits for
     phase counter 0 of every source, builds the tables (with each source's phase sizes:
     `_phase_tables`), then the loop below.
  overlap = 1: A1 a block per expert, arrive on the tables counter, wait for it, build the tables,
     send phase 0 with its own rows packed from x in the same loop (as unpipelined overlap: no own
     rows in rx, the pack skips them), arrive on phase counter 0, wait for it, then the loop.
  loop, for q = 0, 1, ... < max over sources of nphase: send own phase q + 1 (with overlap its own
     rows packed in the same units) and pack every source's phase-q rows (with swarps > 0, swarps
     warps per block send while the rest pack, so the NVLink stores and the local copy run at once),
     then arrive on phase counter q + 1 and wait for it.
A source's last phase also arrives on every later phase counter, so each counter gets ARRIVAL_STEP
per source and epoch whatever the phase counts and modes (ranks may differ: every mode's first
arrival covers the tables counter). Separate counters per phase are needed: with one counter a
block's phase q + 1 add could overtake another block's phase q add to a third rank. No deadlock in
any mix: the tables counter's arrivals come before any wait; a block arrives on phase counter
q + 1 only after its wait on phase counter q (and on phase counter 0 after at most the tables
wait), so every wait depends only on arrivals that come before an equal-or-lower wait
(tests/comms/test_dispatch_protocol.py models it). The arrival's release covers the block's pack
stores too; each phase costs one more arrival and wait (a few us), hence one phase below
`comms.dispatch_fused.PIPE_MIN_TOKENS`.
combine (one launch, no arrival counter: the data is its own flag, as in the Lamport all-reduce):
  cx holds the sentinel word 0xFFFFFFFF wherever no partial is pending (filled once by the host; each
  reader empties what it read). Work units are (key t, position j, chunk) in t-major order; per key,
  positions 0..R-2 are the sends of the other sources' token t and position R-1 is own token t's sum
  (rotated by t when the grid has a warp per unit of a key, so every warp mixes sends and sums).
  send (source s != me, its token t routed here): the partial over this rank's local slots of the
  row, ascending slot order, w * y in fp32 (mul.rn then add.rn: no FMA, bitwise the reference's
  arithmetic), rounded to bf16 (a sentinel word would be replaced by another NaN; rounding makes
  none) and stored into s's cx[me, t] over NVLink.
  sum (own token t): the partials of the token's distinct ranks in ascending rank order, fp32 from
  0.0: this rank's computed here from y (never stored), a peer's read from cx[peer, t] with volatile
  loads, re-polled until no word is the sentinel (bounded: ERR_COMBINE_TIMEOUT | peer), then emptied
  for the next epoch. The first peer's loads are issued before this rank's partial is computed.
  Why it cannot deadlock: a sum of key t waits only for sends of key t, every warp takes its units
  in increasing key order with a key's sends before its sum (or holds one unit per key: rotated),
  and sends wait for nothing; so by induction on t every unit completes (all blocks co-resident). Why one cx buffer suffices: a
  peer writes cx[s, t] of epoch e + 1 only after its next dispatch saw this rank's next dispatch
  arrive, which is after this combine (and its emptying stores) in stream order.
Phase probe: a non-zero `probe` address makes thread 0 of every block store %globaltimer (int64) at
each phase boundary into probe[block, phase] (PROBE_PHASES per block; DISPATCH_PHASES /
COMBINE_PHASES name them), for `perf.comms dispatch --phases`; off (0) it costs one uniform branch.
Dispatch with overlap = 0 (and the pipelined one) has one arrival and one wait: it stamps "tables
sent" and "rows sent" together after A, "tables waited" and "rows waited" after its wait (unpipelined
that wait comes after "tables built" and the own rows' pack).
K is a compile-time constant (one export per top-k in TOPK_VARIANTS) so the per-slot loads are
unrolled and in flight together.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.memory import SmemAllocator

from comms.kernels import ptx

THREADS = 256
WARPS = THREADS // 32
# combine has no shared tables or block-wide phases: more warps per block keep more loads in flight
COMBINE_WARPS = 16
CHUNK_VEC = 128      # 16-byte vectors per work unit: 4 per lane, 2 KiB of a row (H % 1024 == 0)
MAX_WORLD = 128      # shared-memory table bounds (checked on the host)
MAX_LOCAL = 512
MAX_PAIRS = 1024     # R * L (source rank, local expert) pairs
TABLE_LOADS = MAX_PAIRS // THREADS  # recnt words per thread, loaded together (_load_tables)
POLL_BACKOFF_NS = 200  # table poll: pause between rounds
TAG_SHIFT = 16       # rntok / recnt words: the epoch's low bits above the count
COUNT_MASK = (1 << TAG_SHIFT) - 1  # so a count (tokens per rank) is at most this (checked on the host)
TOPK_VARIANTS = (1, 2, 4, 6, 8, 10)
SCAN_UNROLL = 4      # slot scan: 32-token groups whose id loads are issued together
PIPE_MAX = 8         # pipelined dispatch: phase counters per source at most
ARRIVAL_STEP = 1024  # counter units one source adds per epoch (>= any grid: see _arrive)
PROBE_PHASES = 8     # int64 stamps per block in the probe buffer
SENTINEL = -1        # 0xFFFFFFFF: an empty rx / cx word (a NaN senders never store: ptx.canon_word)
DISPATCH_PHASES = ("start", "tables sent", "tables waited", "tables built", "rows sent", "rows waited", "packed")
(PH_START, PH_TABLES_SENT, PH_TABLES_WAITED, PH_TABLES_BUILT, PH_ROWS_SENT, PH_ROWS_WAITED,
 PH_PACKED) = range(len(DISPATCH_PHASES))
COMBINE_PHASES = ("start", "done")
ERR_DISPATCH_TIMEOUT = 1 << 16   # error word = kind | detail (source rank or local expert)
ERR_COMBINE_TIMEOUT = 2 << 16
ERR_CAPACITY = 3 << 16


# ------------------------------------------------------------------------------- PTX helpers
@dsl_user_op
def st_b32(addr, val, *, loc=None, ip=None) -> None:
    ptx.asm(None, [ptx.i64(addr, loc, ip), ptx.i32(val, loc, ip)], "st.global.b32 [$0], $1;",
            "l,r,~{memory}", loc, ip)


@dsl_user_op
def st_b64(addr, val, *, loc=None, ip=None) -> None:
    ptx.asm(None, [ptx.i64(addr, loc, ip), ptx.i64(val, loc, ip)], "st.global.b64 [$0], $1;",
            "l,l,~{memory}", loc, ip)


@dsl_user_op
def ld_b32_cg(addr, *, loc=None, ip=None) -> Int32:
    """4-byte load that bypasses L1 (heap data written by peers)."""
    return Int32(ptx.asm(T.i32(), [ptx.i64(addr, loc, ip)], "ld.global.cg.b32 $0, [$1];",
                         "=r,l,~{memory}", loc, ip))


@dsl_user_op
def red_add_sys(addr, val, release: bool, *, loc=None, ip=None) -> None:
    """Atomic add at system scope, a release (a fence, then the add) or relaxed (a strong add: after
    a release by the same thread it is itself a release pattern, PTX memory model, without a second
    fence)."""
    ptx.asm(None, [ptx.i64(addr, loc, ip), ptx.i32(val, loc, ip)],
            f"red.{'release' if release else 'relaxed'}.sys.global.add.u32 [$0], $1;", "l,r,~{memory}", loc, ip)


@dsl_user_op
def lanemask_lt(*, loc=None, ip=None) -> Int32:
    """Bits of the lanes below this one (%lanemask_lt)."""
    return Int32(ptx.asm(T.i32(), [], "mov.u32 $0, %lanemask_lt;", "=r", loc, ip))


@dsl_user_op
def lowest_lane(m, *, loc=None, ip=None) -> Int32:
    """Index of the lowest set bit of a ballot (32 when none)."""
    return Int32(ptx.asm(T.i32(), [ptx.i32(m, loc, ip)], "{ .reg .b32 r; brev.b32 r, $1; clz.b32 $0, r; }",
                         "=r,r", loc, ip))


@dsl_user_op
def warp_min(v, *, loc=None, ip=None) -> Int32:
    """Minimum of v over the 32 lanes, as unsigned (redux.sync, sm_80+: one instruction; -1 is the
    largest value, so lanes holding -1 never win unless every lane does)."""
    return Int32(ptx.asm(T.i32(), [ptx.i32(v, loc, ip)], "redux.sync.min.u32 $0, $1, 0xffffffff;", "=r,r",
                         loc, ip))


@dsl_user_op
def warp_max(v, *, loc=None, ip=None) -> Int32:
    """Maximum of v (>= 0) over the 32 lanes (redux.sync.max.u32)."""
    return Int32(ptx.asm(T.i32(), [ptx.i32(v, loc, ip)], "redux.sync.max.u32 $0, $1, 0xffffffff;", "=r,r",
                         loc, ip))


@dsl_user_op
def wrap_sub(a, b, *, loc=None, ip=None) -> Int32:
    """a - b modulo 2**32 (counters wrap; plain Int32 arithmetic may assume no signed overflow)."""
    return Int32(ptx.asm(T.i32(), [ptx.i32(a, loc, ip), ptx.i32(b, loc, ip)], "sub.s32 $0, $1, $2;",
                         "=r,r,r", loc, ip))


@dsl_user_op
def wrap_mul(a, b, *, loc=None, ip=None) -> Int32:
    """a * b modulo 2**32 (the arrival target epoch * ARRIVAL_STEP wraps with the epoch)."""
    return Int32(ptx.asm(T.i32(), [ptx.i32(a, loc, ip), ptx.i32(b, loc, ip)], "mul.lo.s32 $0, $1, $2;",
                         "=r,r,r", loc, ip))


@dsl_user_op
def st_b8(addr, val, *, loc=None, ip=None) -> None:
    ptx.asm(None, [ptx.i64(addr, loc, ip), ptx.i32(val, loc, ip)], "st.global.b8 [$0], $1;",
            "l,r,~{memory}", loc, ip)


@dsl_user_op
def st_v2(addr, v, *, loc=None, ip=None) -> None:
    """8-byte store of 2 x Int32 (local or peer address)."""
    ptx.asm(None, [ptx.i64(addr, loc, ip)] + [ptx.i32(x, loc, ip) for x in v],
            "st.global.v2.b32 [$0], {$1, $2};", "l,r,r,~{memory}", loc, ip)


@dsl_user_op
def absmax_bits_bf16x8(v, *, loc=None, ip=None) -> Int32:
    """max |x| over the 8 bf16 of 4 words, as the bits of the fp32 (bf16 bits << 16). Exact: for
    finite values |x|'s bit pattern orders like |x| (max.u16x2 of the sign-cleared halves)."""
    return Int32(ptx.asm(T.i32(), [ptx.i32(w, loc, ip) for w in v],
                         "{ .reg .b32 a, b, c, d; and.b32 a, $1, 0x7fff7fff; and.b32 b, $2, 0x7fff7fff; "
                         "and.b32 c, $3, 0x7fff7fff; and.b32 d, $4, 0x7fff7fff; max.u16x2 a, a, b; "
                         "max.u16x2 c, c, d; max.u16x2 a, a, c; shr.b32 b, a, 16; and.b32 c, a, 0xffff; "
                         "max.u32 a, b, c; shl.b32 $0, a, 16; }", "=r,r,r,r,r", loc, ip))


@dsl_user_op
def e4m3x4_bf16(a, b, inv, *, loc=None, ip=None) -> Int32:
    """Four bf16 (two words, low element first) times `inv` in fp32 (mul.rn: exact for a power of
    two short of underflow), rounded to E4M3 (cvt.rn.satfinite: nearest even) -> 4 bytes in order."""
    return Int32(ptx.asm(T.i32(), [ptx.i32(a, loc, ip), ptx.i32(b, loc, ip), ptx.f32(inv, loc, ip)],
                         "{ .reg .b32 t; .reg .f32 a0, a1, b0, b1; .reg .b16 l, h; "
                         "shl.b32 t, $1, 16; mov.b32 a0, t; and.b32 t, $1, 0xffff0000; mov.b32 a1, t; "
                         "shl.b32 t, $2, 16; mov.b32 b0, t; and.b32 t, $2, 0xffff0000; mov.b32 b1, t; "
                         "mul.rn.f32 a0, a0, $3; mul.rn.f32 a1, a1, $3; mul.rn.f32 b0, b0, $3; "
                         "mul.rn.f32 b1, b1, $3; cvt.rn.satfinite.e4m3x2.f32 l, a1, a0; "
                         "cvt.rn.satfinite.e4m3x2.f32 h, b1, b0; mov.b32 $0, {l, h}; }",
                         "=r,r,r,f", loc, ip))


@dsl_user_op
def fma_bf16x2_sel(lo, hi, v, w, ok, *, loc=None, ip=None):
    """(lo, hi) + w * bf16x2(v) in fp32 (mul.rn, add.rn: never fused) where ok != 0, else (lo, hi)."""
    r = ptx.asm(ptx._struct(2, "f32"),
                [ptx.f32(lo, loc, ip), ptx.f32(hi, loc, ip), ptx.i32(v, loc, ip), ptx.f32(w, loc, ip),
                 ptx.i32(ok, loc, ip)],
                "{ .reg .b32 t; .reg .f32 l, h; .reg .pred q; shl.b32 t, $4, 16; mov.b32 l, t; "
                "and.b32 t, $4, 0xffff0000; mov.b32 h, t; mul.rn.f32 l, l, $5; mul.rn.f32 h, h, $5; "
                "add.rn.f32 l, $2, l; add.rn.f32 h, $3, h; setp.ne.s32 q, $6, 0; "
                "selp.f32 $0, l, $2, q; selp.f32 $1, h, $3, q; }",
                "=f,=f,f,f,r,f,r", loc, ip)
    return [cutlass.Float32(x) for x in ptx._unpack(r, 2, T.f32())]


@dsl_user_op
def add_bf16x2(lo, hi, v, *, loc=None, ip=None):
    """(lo, hi) + bf16x2(v) in fp32 (add.rn)."""
    r = ptx.asm(ptx._struct(2, "f32"), [ptx.f32(lo, loc, ip), ptx.f32(hi, loc, ip), ptx.i32(v, loc, ip)],
                "{ .reg .b32 t; .reg .f32 l, h; shl.b32 t, $4, 16; mov.b32 l, t; and.b32 t, $4, 0xffff0000; "
                "mov.b32 h, t; add.rn.f32 $0, $2, l; add.rn.f32 $1, $3, h; }",
                "=f,=f,f,f,r", loc, ip)
    return [cutlass.Float32(x) for x in ptx._unpack(r, 2, T.f32())]


# ------------------------------------------------------------------------------- shared pieces
def _i64(v):
    return Int64(v)


@cute.jit
def _arrive(peers: cute.Tensor, tid, bid, nb, world, cnt_off, rank, ntok_off, ntok, with_ntok: cutlass.Constexpr,
            ncnt=1, nph_off=0, nph=1):
    """After a bar.sync: this block's arrival on every rank d, released by lane d % 32 of warp 0 with
    one red.release.sys.add into cnt[rank] on d. Block 0 adds ARRIVAL_STEP + 1 - nb, the others 1,
    so one source adds exactly ARRIVAL_STEP per epoch whatever its grid (ranks and calls may differ).
    `with_ntok`: block 0's lane d first stores this launch's token count into rntok[rank] on d (the
    same thread's release covers it: no extra barrier). Pipelined dispatch: the arrival goes to
    `ncnt` consecutive counters [ncnt, R] from cnt_off (a last send phase also arrives on the phase
    counters it will not use, so each counter still gets ARRIVAL_STEP per source and epoch), and
    with `with_ntok` also stores the source's phase count `nph` into rnph[rank] (nph_off != 0).

    Why the release covers the whole block: every write of the block is ordered before the bar.sync,
    which synchronises the block's threads (PTX memory model: bar.sync synchronizes-with bar.sync);
    the red is a release pattern of the lane, and causality order is transitive, so every write
    the block made before the barrier happens-before any acquire that observes the red -- or a later
    red of the same counter (atomic adds form a release sequence). A waiter that sees
    cnt >= epoch * ARRIVAL_STEP (wrap_sub, see _wait_all) has observed every add of the epoch: the
    adds are positive, sum to ARRIVAL_STEP, and a source issues its next epoch's adds only in its next
    launch, after this one completed (stream order). A source is never two epochs ahead of a waiter
    (its next wait needs the waiter's arrival), so cnt - target stays within +-ARRIVAL_STEP: wrap-safe.
    No loop here spins; the destination loop is warp-uniform."""
    if tid < 32:
        inc = Int32(1)
        if bid == 0:
            inc = ARRIVAL_STEP + 1 - nb
        d0 = Int32(0)
        while d0 < world:
            d = d0 + tid
            if d < world:
                db = peers[d]
                if cutlass.const_expr(with_ntok):
                    if bid == 0:
                        st_b32(db + ntok_off + _i64(rank) * 4, ntok)
                        if nph_off != 0:
                            st_b32(db + nph_off + _i64(rank) * 4, nph)
                # the first counter's add is a release; the others follow it in program order, which
                # makes each of them a release pattern too (PTX: a release operation followed by a
                # strong write) without another sys-scope fence, i.e. another NVLink round trip
                red_add_sys(db + cnt_off + _i64(rank) * 4, inc, True)
                k = Int32(1)
                while k < ncnt:
                    red_add_sys(db + cnt_off + (_i64(k) * world + rank) * 4, inc, False)
                    k += 1
            d0 += 32


@cute.jit
def _store_epoch(my_base, state_off, tid, bid, epoch):
    """After the wait and its bar.sync: block 0 stores `epoch` for the next launch. Every block of
    this launch read the old value at its start, before its arrival on this rank, and the wait
    acquired all of those arrivals, so each read happens-before this store and cannot see it."""
    if (bid == 0) & (tid == 0):
        ptx.st_relaxed_gpu(my_base + state_off, epoch)


@cute.jit
def _pdl_start():
    """Programmatic dependent launch: wait for the previous kernel of the stream (its writes are then
    visible; a no-op when not launched with PDL), then let the next one launch, so its blocks are
    resident and waiting here instead of being launched after this kernel ends (~1 us a kernel in
    graph replays). Every block of this launch is resident by the time the next one's blocks arrive
    (the trigger needs all of them), so the co-residency the arrival counters rely on holds."""
    cute.arch.griddepcontrol_wait()
    cute.arch.griddepcontrol_launch_dependents()


@cute.jit
def _pdl_wait():
    """The wait of _pdl_start without its early trigger: the next kernel launches when this one
    ends. The combine's: a dispatch launched early behind it made each dispatch + combine pair ~30
    us slower at 4096 tokens on 2 x H200 (the time lay between the combine's end and the dispatch's
    start), while a dispatch launched early behind any other kernel is what PDL is for."""
    cute.arch.griddepcontrol_wait()


@cute.jit
def _stamp(probe, tid, bid, phase):
    """Phase probe: thread 0 stores %globaltimer into probe[bid, phase] when probe != 0."""
    if probe != 0:
        if tid == 0:
            st_b64(probe + (_i64(bid) * PROBE_PHASES + phase) * 8, ptx.globaltimer())


@cute.jit
def _wait_all(my_base, tid, world, cnt_off, target, err_addr, timeout_ns, code):
    """Warp 0 waits until cnt[s] - target >= 0 for every source s, without diverging: lane l polls
    sources l, l + 32, ... (one coalesced load per round, addresses clamped into the array) and every
    loop condition is a warp vote, so no lane ever spins alone. On expiry the lanes still waiting write
    code | source to the error word. (A lane spinning alone in a divergent loop -- the previous form,
    thread s polling source s -- made combine fault on H200: the warp's memory-descriptor uniform
    register read as 0 at the next load, a Warp Illegal Address on a valid address; cuda-gdb,
    tests/comms/gpu_combine_gdb.sh.) The caller's bar.sync releases the other warps."""
    if tid < 32:
        t0 = ptx.globaltimer()
        s0 = Int32(0)
        while s0 < world:
            s = s0 + tid
            need = s < world
            a = my_base + cnt_off + _i64(cutlass.min(s, world - 1)) * 4
            f = ptx.ld_acquire_sys(a)
            pending = cute.arch.vote_ballot_sync(need & (wrap_sub(f, target) < 0))
            late = Int32(0)
            while (pending != 0) & (late == 0):
                if cute.arch.vote_ballot_sync(ptx.globaltimer() - t0 > timeout_ns) != 0:
                    late = Int32(1)
                    if need & (wrap_sub(f, target) < 0):
                        ptx.st_release_sys(err_addr, code | s)
                f = ptx.ld_acquire_sys(a)
                pending = cute.arch.vote_ballot_sync(need & (wrap_sub(f, target) < 0))
            s0 += 32


@cute.jit
def _warp_inclusive_scan(v, lane):
    """Inclusive prefix sum of v over the 32 lanes (shfl.up)."""
    for k in cutlass.range_constexpr(5):
        y = cute.arch.shuffle_sync_up(v, 1 << k)
        if lane >= (1 << k):
            v = v + y
    return v


def _tag(epoch):
    """This launch's tag of the rntok / recnt words: the epoch's low bits above the count."""
    return (epoch & COUNT_MASK) << TAG_SHIFT


@cute.jit
def _store_count(addr, word, own):
    """A tagged table word (A1's recnt). To this rank itself (`own`) a release at GPU scope after the
    caller's warp or block barrier: the own rows' pack reads the rslot words stored before it with no
    arrival counter in between, ordered by the table poll alone (relaxed reads that see the tag, then a
    fence: an acquire pattern, _load_tables). To a peer
    a plain store: it reads only the count before the rows arrival, which covers the rslot words."""
    if own:
        ptx.st_release_gpu(addr, word)
    else:
        st_b32(addr, word)


@cute.jit
def _load_tagged(vals: cute.Tensor, my_base, rntok_off, recnt_off, tid, npairs, world, tag, stale_only):
    """vals[k] = recnt word tid + THREADS k (pairs s * L + e, clamped), vals[TABLE_LOADS] = rntok word
    tid (clamped): relaxed loads, all in flight at once (acquire loads would each wait for the last);
    with `stale_only` only the words still without `tag` are reloaded."""
    for k in cutlass.range_constexpr(TABLE_LOADS):
        if (stale_only == 0) | (((vals[k] ^ tag) >> TAG_SHIFT) != 0):
            vals[k] = ptx.ld_relaxed_sys(my_base + recnt_off + _i64(cutlass.min(tid + k * THREADS, npairs - 1)) * 4)
    if (stale_only == 0) | (((vals[TABLE_LOADS] ^ tag) >> TAG_SHIFT) != 0):
        vals[TABLE_LOADS] = ptx.ld_relaxed_sys(my_base + rntok_off + _i64(cutlass.min(tid, world - 1)) * 4)


@cute.jit
def _stale_source(vals: cute.Tensor, tag, tid, nlocal, npairs, world):
    """1 + the source rank of a word of vals this thread needs that lacks `tag` (0: none)."""
    src = Int32(0)
    for k in cutlass.range_constexpr(TABLE_LOADS):
        i = tid + k * THREADS
        if (i < npairs) & (((vals[k] ^ tag) >> TAG_SHIFT) != 0):
            src = i // nlocal + 1
    if (tid < world) & (((vals[TABLE_LOADS] ^ tag) >> TAG_SHIFT) != 0):
        src = tid + 1
    return src


@cute.jit
def _load_tables(my_base, rntok_off, recnt_off, tag, tid, world, nlocal, pre: cute.Tensor, rstart: cute.Tensor,
                 err_addr, timeout_ns):
    """Every thread of the block: poll this launch's recnt words (pair s * L + e) and rntok words
    (source s) until each carries `tag`, then the counts go to pre[s * L + e] and rstart[s + 1]; the
    caller's bar.sync publishes them (and the fence, with it, the own rank's rslot words to every
    thread of the block). Needs no arrival counter (data as its own flag): a source stores
    its tables before its arrivals and rewrites this parity's buffer only two epochs later, after
    this launch ended (its next dispatch waits for ours). Bounded, and warp-convergent as _wait_all
    (every loop condition a warp vote); on expiry the error word names a late source."""
    npairs = world * nlocal
    vals = cute.make_rmem_tensor(cute.make_layout(TABLE_LOADS + 1), Int32)
    _load_tagged(vals, my_base, rntok_off, recnt_off, tid, npairs, world, tag, Int32(0))
    src = _stale_source(vals, tag, tid, nlocal, npairs, world)
    if cute.arch.vote_ballot_sync(src != 0) != 0:
        t0 = ptx.globaltimer()
        late = Int32(0)
        while (cute.arch.vote_ballot_sync(src != 0) != 0) & (late == 0):
            if cute.arch.vote_ballot_sync(ptx.globaltimer() - t0 > timeout_ns) != 0:
                late = Int32(1)
                if src != 0:
                    ptx.st_release_sys(err_addr, ERR_DISPATCH_TIMEOUT | (src - 1))
            ptx.nanosleep(POLL_BACKOFF_NS)  # every block polls: back off, or the polls crowd the rows arriving
            _load_tagged(vals, my_base, rntok_off, recnt_off, tid, npairs, world, tag, Int32(1))
            src = _stale_source(vals, tag, tid, nlocal, npairs, world)
    # the relaxed reads that saw the tags + this fence: an acquire of the own rank's release (_store_count)
    cute.arch.fence_acq_rel_gpu()
    for k in cutlass.range_constexpr(TABLE_LOADS):
        if tid + k * THREADS < npairs:
            pre[tid + k * THREADS] = vals[k] & COUNT_MASK
    if tid < world:
        rstart[tid + 1] = vals[TABLE_LOADS] & COUNT_MASK


@cute.jit
def _row_starts(lane, active, world, rstart: cute.Tensor):
    """rstart[1 + s] (source s's received rows, from _load_tables) becomes the sum over sources <= s,
    rstart[0] = 0 (so rstart[world] = total). The warp with `active` set scans 32 sources per step;
    the caller's bar.sync publishes it."""
    if active:
        carry = Int32(0)
        s0 = Int32(0)
        while s0 < world:
            s = s0 + lane
            n = Int32(0)
            if s < world:
                n = rstart[s + 1]
            incl = _warp_inclusive_scan(n, lane)
            if s < world:
                rstart[s + 1] = carry + incl
            carry = carry + cute.arch.shuffle_sync(incl, 31)
            s0 = s0 + 32
        if lane == 0:
            rstart[0] = Int32(0)


@cute.jit
def _phase_tables(my_base, rntok_off, rnph_off, lane, active, world, rstq: cute.Tensor, chs: cute.Tensor,
                  qmax: cute.Tensor):
    """Pipelined dispatch: source s sends its tokens in P_s = rnph[s] phases of chs[s] =
    ceil(rntok[s] / P_s) tokens; rstq[q * (MAX_WORLD + 1) + s] = first row of source s among the
    rows of receive phase q (rstq[.. + world]: their count); qmax[0] = max P_s. The warp with
    `active` set computes them; the caller's bar.sync publishes them."""
    if active:
        pm = Int32(1)
        s0 = Int32(0)
        while s0 < world:
            s = s0 + lane
            if s < world:
                n = ld_b32_cg(my_base + rntok_off + _i64(s) * 4) & COUNT_MASK
                ps = cutlass.max(cutlass.min(ld_b32_cg(my_base + rnph_off + _i64(s) * 4), Int32(PIPE_MAX)), Int32(1))
                chs[s] = (n + ps - 1) // ps
                pm = cutlass.max(pm, ps)
            s0 = s0 + 32
        for k in cutlass.range_constexpr(5):
            pm = cutlass.max(pm, cute.arch.shuffle_sync_bfly(pm, 1 << k))
        q = Int32(0)
        while q < pm:
            carry = Int32(0)
            s0 = Int32(0)
            while s0 < world:
                s = s0 + lane
                n = Int32(0)
                if s < world:
                    ntot = ld_b32_cg(my_base + rntok_off + _i64(s) * 4) & COUNT_MASK
                    n = cutlass.max(cutlass.min(ntot - q * chs[s], chs[s]), Int32(0))
                incl = _warp_inclusive_scan(n, lane)
                if s < world:
                    rstq[q * (MAX_WORLD + 1) + s + 1] = carry + incl
                carry = carry + cute.arch.shuffle_sync(incl, 31)
                s0 = s0 + 32
            if lane == 0:
                rstq[q * (MAX_WORLD + 1)] = Int32(0)
            q = q + 1
        if lane == 0:
            qmax[0] = pm


@cute.jit
def _token_dest(ids: cute.Tensor, t, lane, nlocal, K: cutlass.Constexpr):
    """Combine's sum: lane j < K holds the rank of own token t's slot j, the others -1 (so warp_min
    over `dv` > the last rank taken walks the token's distinct ranks in ascending order)."""
    dv = Int32(-1)
    if lane < K:
        dv = ids[t, lane] // nlocal
    return dv


@cute.jit
def _next_rank(dv, after):
    """The smallest rank in dv above `after` (-1: none left; after = -1 gives the smallest)."""
    return warp_min(cutlass.select_(dv > after, dv, Int32(-1)))


@cute.jit
def _store_chunk(dst, v0, v1, v2, v3):
    """A lane's 4 vectors of a 2 KiB chunk (CHUNK_VEC vectors, lane-interleaved) from dst on."""
    ptx.st_v4(dst, v0)
    ptx.st_v4(dst + 512, v1)
    ptx.st_v4(dst + 1024, v2)
    ptx.st_v4(dst + 1536, v3)


def _canon(v):
    """A vector's 4 words with the sentinel word replaced by another NaN (ptx.canon_word)."""
    return [ptx.canon_word(w) for w in v]


@cute.jit
def _empty(buf: cute.Tensor):
    """1 if a word of buf (16 words) is the sentinel: part of the chunk has not arrived."""
    S = Int32(SENTINEL)
    e = Int32(0)
    for i in cutlass.range_constexpr(16):
        e = e | Int32(buf[i] == S)
    return e


@cute.jit
def _load_chunk(buf: cute.Tensor, src):
    """buf = this lane's 4 vectors of the chunk at `src` (volatile loads: peers write it)."""
    for q in cutlass.range_constexpr(4):
        d = ptx.ld_volatile_v4(src + q * 512)
        for h in cutlass.range_constexpr(4):
            buf[4 * q + h] = d[h]


@cute.jit
def _poll_chunk(buf: cute.Tensor, src, err_addr, timeout_ns, code):
    """Reload buf from `src` until none of its words is the sentinel (buf holds a first load already);
    on timeout the error word gets `code` (kind | peer) and the data is used as it is."""
    if _empty(buf) != 0:
        t0 = ptx.globaltimer()
        pend = Int32(1)
        while pend != 0:
            _load_chunk(buf, src)
            pend = _empty(buf)
            if pend != 0:
                if ptx.globaltimer() - t0 > timeout_ns:
                    ptx.st_release_sys(err_addr, code)
                    pend = Int32(0)


@cute.jit
def _slot_row(idv, sl, s, rank, nlocal, pre: cute.Tensor, base: cute.Tensor, cap, nrows, lane, K: cutlass.Constexpr):
    """Lane j < K of a row from source s (slot j: global expert idv, index sl among source s's
    tokens of that expert): its packed output row base[e] + pre[s, e] + sl when the expert e is
    local and the slot within capacity, else -1 (also for a row past nrows: never with consistent
    tables, it keeps stray rows in bounds)."""
    posv = Int32(-1)
    lid = idv - rank * nlocal
    if (lane < K) & (lid >= 0) & (lid < nlocal):
        p = pre[s * nlocal + lid] + sl
        if p < cap:
            posv = base[lid] + p
        if posv >= nrows:
            posv = Int32(-1)
    return posv


@cute.jit
def _find_source(rstart: cute.Tensor, off, world, rr):
    """Largest s with rstart[off + s] <= rr (binary search)."""
    lo = Int32(0)
    hi = world
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if rstart[off + mid] <= rr:
            lo = mid
        else:
            hi = mid
    return lo


@cute.jit
def _mx_exponent(amax_bits):
    """Scale exponent of a 32-value block from its amax's fp32 bits, moe.mxfp8.scale_exponent's
    rule (comms.mxfp8): s = e - 8, + 1 when the mantissa exceeds 1.75 (so amax / 2^s <= 448 never
    saturates), -127 for an all-zero block, clamped to [-127, 127]."""
    s = ((amax_bits >> 23) & 0xFF) - 135
    if (amax_bits & 0x7FFFFF) > 0x600000:
        s = s + 1
    if amax_bits == 0:
        s = Int32(-127)
    return cutlass.max(cutlass.min(s, Int32(127)), Int32(-127))


@cute.jit
def _quantize_mx(v, lane):
    """One lane's 8 bf16 (4 words) of a 32-value block spread over 4 neighbouring lanes -> (2 words
    of E4M3, the block's biased E8M0 scale byte). The amax is reduced over the 4 lanes (bfly 1, 2)."""
    a = absmax_bits_bf16x8(v)
    a = cutlass.max(a, cute.arch.shuffle_sync_bfly(a, 1))
    a = cutlass.max(a, cute.arch.shuffle_sync_bfly(a, 2))
    s = _mx_exponent(a)
    inv = ptx.i32_as_f32((127 - s) << 23)  # 2^-s: a normal fp32 for s in [-127, 126]
    return e4m3x4_bf16(v[0], v[1], inv), e4m3x4_bf16(v[2], v[3], inv), s + 127


@cute.jit
def _store_words(addr, words, K: cutlass.Constexpr):
    """K consecutive words at addr (a row of a [rows, K] int32 table: aligned to 4 K bytes), in 16-byte
    stores when K % 4 == 0, 8-byte ones when K is even."""
    if cutlass.const_expr(K % 4 == 0):
        for i in cutlass.range_constexpr(K // 4):
            ptx.st_v4(addr + 16 * i, words[4 * i:4 * i + 4])
    elif cutlass.const_expr(K % 2 == 0):
        for i in cutlass.range_constexpr(K // 2):
            st_v2(addr + 8 * i, words[2 * i:2 * i + 2])
    else:
        for i in cutlass.range_constexpr(K):
            st_b32(addr + 4 * i, words[i])


@cute.jit
def _scan_expert(ids: cute.Tensor, wts: cute.Tensor, g, tb, te, running, dbase, row0, lane, nlocal, epoch, off_rslot,
                 off_rid, off_rw, off_rstamp, K: cutlass.Constexpr, write: cutlass.Constexpr, meta: cutlass.Constexpr):
    """Slot scan of own tokens [tb, te) for global expert g, SCAN_UNROLL x 32 tokens per step (every
    id load in flight at once; clamped, no branch: lanes past te never hit). Returns running + the
    hits; `write`: also stores each hit's index (running + hits before it) into rslot on the owner
    (dbase), row row0 + t, and with `meta`, when g is the token's first expert on that owner (lowest
    slot), the row's metadata there: all K ids and weights and the epoch stamp. So each (token, owner)
    pair writes its metadata exactly once, with the tables: a receiver knows after the tables wait
    which rows will arrive and where they go, before their data does (overlap; without it A2 sends
    the metadata with chunk 0 of the row, before the one arrival that covers tables and rows)."""
    d = g // nlocal
    t0 = tb
    while t0 < te:
        hits = []
        firsts = []
        idvs = []
        for r in cutlass.range_constexpr(SCAN_UNROLL):
            t = t0 + 32 * r + lane
            tc = cutlass.min(t, te - 1)
            hit = Int32(-1)
            first = Int32(0)
            seen = Int32(0)
            idv = []
            for j in cutlass.range_constexpr(K):
                idj = ids[tc, j]
                idv.append(idj)
                if (idj == g) & (t < te):
                    hit = Int32(j)
                    first = 1 - seen
                if idj // nlocal == d:
                    seen = Int32(1)
            hits.append(hit)
            firsts.append(first)
            idvs.append(idv)
        if cutlass.const_expr(write and meta):
            # the first hits' weights, loaded (predicated) before any store: the stores' memory
            # clobbers would otherwise serialise each load behind the previous store
            wvs = []
            for r in cutlass.range_constexpr(SCAN_UNROLL):
                tc = cutlass.min(t0 + 32 * r + lane, te - 1)
                wv = []
                for j in cutlass.range_constexpr(K):
                    wj = Int32(0)
                    if firsts[r] != 0:
                        wj = ptx.f32_as_i32(wts[tc, j])
                    wv.append(wj)
                wvs.append(wv)
        for r in cutlass.range_constexpr(SCAN_UNROLL):
            m = cute.arch.vote_ballot_sync(hits[r] >= 0)
            if cutlass.const_expr(write):
                if hits[r] >= 0:
                    i = running + cute.arch.popc(m & lanemask_lt())
                    row = row0 + t0 + 32 * r + lane
                    st_b32(dbase + off_rslot + (row * K + hits[r]) * 4, i)
                    if cutlass.const_expr(meta):
                        if firsts[r] != 0:
                            _store_words(dbase + off_rid + row * (K * 4), idvs[r], K)
                            _store_words(dbase + off_rw + row * (K * 4), wvs[r], K)
                            st_b32(dbase + off_rstamp + row * 4, epoch)
            running = running + cute.arch.popc(m)
        t0 = t0 + 32 * SCAN_UNROLL
    return running


@cute.jit
def _token_unit(x: cute.Tensor, ids: cute.Tensor, wts: cute.Tensor, peers: cute.Tensor, me, rank, maxt, nlocal, t,
                c, nvec, epoch, lane, send, pack, pre: cute.Tensor, base: cute.Tensor, cap, nrows, oxa, osa,
                o_rank: cute.Tensor, o_tok: cute.Tensor, o_w: cute.Tensor, row_pos: cute.Tensor, off_rx, off_rid,
                off_rw, off_rslot, off_rstamp, K: cutlass.Constexpr, fp8: cutlass.Constexpr, self_copy, meta):
    """One (own token t, 2 KiB of its bf16 row: chunk c) unit, loaded once (fp8: quantized once,
    1 KiB of E4M3 + 32 scale bytes). `send` != 0: sent once per distinct destination rank of the
    token, with `meta` != 0 (no overlap: A1 did not write them) ids, weights and the epoch stamp on
    chunk 0 (to this rank too: combine reads them); the payload to this rank itself only
    with `self_copy` != 0 (the pipelined kernel without overlap packs own rows from rx). `pack` != 0: stored to every
    local expert slot of the token, exactly the bytes C would copy from the staged row (needs the
    tables and this rank's rslot rows), plus the packed rows' metadata on chunk 0."""
    xa = x.iterator.toint()
    row_bytes = _i64(nvec) * 16
    lane_off = _i64(lane) * 16
    rx_row = row_bytes
    if cutlass.const_expr(fp8):
        rx_row = _i64(nvec) * 8 + _i64(nvec // 4)
    idv = Int32(0)
    wv = Int32(0)
    dv = Int32(-1)
    if lane < K:
        idv = ids[t, lane]
        wv = ptx.f32_as_i32(wts[t, lane])
        dv = idv // nlocal
    row = _i64(rank) * maxt + t
    sl = Int32(0)
    if pack != 0:  # issued with the row loads
        if lane < K:
            sl = ld_b32_cg(me + off_rslot + (row * K + lane) * 4)
    src = xa + _i64(t) * row_bytes + _i64(c * CHUNK_VEC) * 16 + lane_off
    v0 = ptx.ld_v4(src)
    v1 = ptx.ld_v4(src + 512)
    v2 = ptx.ld_v4(src + 1024)
    v3 = ptx.ld_v4(src + 1536)
    if cutlass.const_expr(fp8):
        q0, q1, s0 = _quantize_mx(v0, lane)
        q2, q3, s1 = _quantize_mx(v1, lane)
        q4, q5, s2 = _quantize_mx(v2, lane)
        q6, q7, s3 = _quantize_mx(v3, lane)
    if send != 0:
        dup = Int32(0)
        for j in cutlass.range_constexpr(K):
            o = cute.arch.shuffle_sync(dv, j)
            if (j < lane) & (o == dv):
                dup = Int32(1)
        m = cute.arch.vote_ballot_sync((lane < K) & (dup == 0))
        for j in cutlass.range_constexpr(K):
            if ((m >> j) & 1) != 0:
                d = cute.arch.shuffle_sync(dv, j)
                db = peers[d]
                if (d != rank) | (self_copy != 0):
                    if cutlass.const_expr(fp8):
                        dst = db + off_rx + row * rx_row + _i64(c) * 1024 + _i64(lane) * 8
                        st_v2(dst, [q0, q1])
                        st_v2(dst + 256, [q2, q3])
                        st_v2(dst + 512, [q4, q5])
                        st_v2(dst + 768, [q6, q7])
                        if lane % 4 == 0:  # block lane // 4 of each 256-value quarter
                            sc = db + off_rx + row * rx_row + _i64(nvec) * 8 + _i64(c) * 32 + lane // 4
                            st_b8(sc, s0)
                            st_b8(sc + 8, s1)
                            st_b8(sc + 16, s2)
                            st_b8(sc + 24, s3)
                    else:  # no word is the sentinel: a receiver polls for it (_pack_unit)
                        _store_chunk(db + off_rx + row * row_bytes + _i64(c * CHUNK_VEC) * 16 + lane_off,
                                     _canon(v0), _canon(v1), _canon(v2), _canon(v3))
                if (c == 0) & (meta != 0):
                    if lane < K:
                        st_b32(db + off_rid + (row * K + lane) * 4, idv)
                        st_b32(db + off_rw + (row * K + lane) * 4, wv)
                    if lane == 0:
                        st_b32(db + off_rstamp + row * 4, epoch)
    if pack != 0:
        posv = _slot_row(idv, sl, rank, rank, nlocal, pre, base, cap, nrows, lane, K)
        mp = cute.arch.vote_ballot_sync(posv >= 0)
        for j in cutlass.range_constexpr(K):
            if ((mp >> j) & 1) != 0:
                pj = _i64(cute.arch.shuffle_sync(posv, j))
                if cutlass.const_expr(fp8):  # out_x rows of H = 8 nvec bytes, out_s rows of H / 32
                    dst = oxa + pj * (_i64(nvec) * 8) + _i64(c) * 1024 + _i64(lane) * 8
                    st_v2(dst, [q0, q1])
                    st_v2(dst + 256, [q2, q3])
                    st_v2(dst + 512, [q4, q5])
                    st_v2(dst + 768, [q6, q7])
                    if lane % 4 == 0:
                        sc = osa + pj * _i64(nvec // 4) + _i64(c) * 32 + lane // 4
                        st_b8(sc, s0)
                        st_b8(sc + 8, s1)
                        st_b8(sc + 16, s2)
                        st_b8(sc + 24, s3)
                else:
                    _store_chunk(oxa + pj * row_bytes + _i64(c * CHUNK_VEC) * 16 + lane_off, v0, v1, v2, v3)
        if c == 0:
            if posv >= 0:
                o_rank[posv] = rank
                o_tok[posv] = t
                o_w[posv] = ptx.i32_as_f32(wv)
                row_pos[row * K + lane] = posv


@cute.jit
def _send_rows(x: cute.Tensor, ids: cute.Tensor, wts: cute.Tensor, peers: cute.Tensor, me, rank, maxt, nlocal, tb,
               te, nvec, epoch, lane, gw, nw, send, pack, pre: cute.Tensor, base: cute.Tensor, cap, nrows, oxa, osa,
               o_rank: cute.Tensor, o_tok: cute.Tensor, o_w: cute.Tensor, row_pos: cute.Tensor, off_rx, off_rid,
               off_rw, off_rslot, off_rstamp, K: cutlass.Constexpr, fp8: cutlass.Constexpr, self_copy, meta):
    """Dispatch A2 (and with `pack` the own rows' C) for own tokens [tb, te): warp gw takes units
    gw, gw + nw, ... of (token, 2 KiB chunk); see _token_unit."""
    nchunk = nvec // CHUNK_VEC
    u = gw
    while u < (te - tb) * nchunk:
        t = tb + u // nchunk
        c = u - (t - tb) * nchunk
        _token_unit(x, ids, wts, peers, me, rank, maxt, nlocal, t, c, nvec, epoch, lane, send, pack, pre, base, cap,
                    nrows, oxa, osa, o_rank, o_tok, o_w, row_pos, off_rx, off_rid, off_rw, off_rslot, off_rstamp, K,
                    fp8, self_copy, meta)
        u = u + nw


@cute.jit
def _pack_unit(me, s, t, c, rank, nlocal, maxt, nvec, epoch, lane, pre: cute.Tensor, base: cute.Tensor, cap, nrows,
               oxa, osa, o_rank: cute.Tensor, o_tok: cute.Tensor, o_w: cute.Tensor, row_pos: cute.Tensor, off_rx,
               off_rid, off_rw, off_rslot, off_rstamp, err_addr, timeout_ns, K: cutlass.Constexpr,
               fp8: cutlass.Constexpr, poll: cutlass.Constexpr):
    """Dispatch C for one unit: 2 KiB chunk c of the staged row of source s's token t, if the row came
    this epoch (stamp, from the tables), stored to every local expert slot of the row (metadata on
    chunk 0). bf16: afterwards the chunk is emptied again (the sentinel in every word); with `poll`
    (bf16 only: overlap's interleaved loop, before the row's data may have arrived) it is read with
    volatile loads and re-polled until none of its words is the sentinel (bounded; senders never
    store it), else (after a rows wait) read once."""
    row_bytes = _i64(nvec) * 16
    rx_row = row_bytes
    hvec = nvec
    if cutlass.const_expr(fp8):
        rx_row = _i64(nvec) * 8 + _i64(nvec // 4)
        hvec = nvec // 2
    rvec = Int32(rx_row // 16)
    row = _i64(s) * maxt + t
    # every load of the unit is issued before the first use (stale rows are valid memory)
    stamp = ld_b32_cg(me + off_rstamp + row * 4)
    idl = Int32(-1)
    sl = Int32(0)
    wl = Int32(0)
    if lane < K:
        idl = ld_b32_cg(me + off_rid + (row * K + lane) * 4)
        sl = ld_b32_cg(me + off_rslot + (row * K + lane) * 4)
        wl = ld_b32_cg(me + off_rw + (row * K + lane) * 4)
    vbase = c * CHUNK_VEC + lane  # this lane's vectors: vbase + 32 q
    src = me + off_rx + row * rx_row
    if cutlass.const_expr(fp8):  # the last chunk is partial: lanes past the row load its last vector
        v0 = ptx.ld_v4_cg(src + _i64(cutlass.min(vbase, rvec - 1)) * 16)
        v1 = ptx.ld_v4_cg(src + _i64(cutlass.min(vbase + 32, rvec - 1)) * 16)
        v2 = ptx.ld_v4_cg(src + _i64(cutlass.min(vbase + 64, rvec - 1)) * 16)
        v3 = ptx.ld_v4_cg(src + _i64(cutlass.min(vbase + 96, rvec - 1)) * 16)
    elif cutlass.const_expr(poll):
        words = cute.make_rmem_tensor(cute.make_layout(16), Int32)
        _load_chunk(words, src + _i64(vbase) * 16)
        v0, v1, v2, v3 = [[words[4 * q + h] for h in range(4)] for q in range(4)]
    else:
        v0 = ptx.ld_v4_cg(src + _i64(vbase) * 16)
        v1 = ptx.ld_v4_cg(src + _i64(vbase) * 16 + 512)
        v2 = ptx.ld_v4_cg(src + _i64(vbase) * 16 + 1024)
        v3 = ptx.ld_v4_cg(src + _i64(vbase) * 16 + 1536)
    if stamp == epoch:
        if cutlass.const_expr(poll):
            _poll_chunk(words, src + _i64(vbase) * 16, err_addr, timeout_ns, ERR_DISPATCH_TIMEOUT | s)
            v0, v1, v2, v3 = [[words[4 * q + h] for h in range(4)] for q in range(4)]
        posv = _slot_row(idl, sl, s, rank, nlocal, pre, base, cap, nrows, lane, K)
        m = cute.arch.vote_ballot_sync(posv >= 0)
        for j in cutlass.range_constexpr(K):
            if ((m >> j) & 1) != 0:
                pj = _i64(cute.arch.shuffle_sync(posv, j))
                if cutlass.const_expr(fp8):
                    vs = [v0, v1, v2, v3]
                    for qq in cutlass.range_constexpr(4):
                        v = vbase + 32 * qq
                        if v < hvec:
                            ptx.st_v4(oxa + pj * (_i64(hvec) * 16) + _i64(v) * 16, vs[qq])
                        elif v < rvec:
                            ptx.st_v4(osa + pj * (_i64(rvec - hvec) * 16) + _i64(v - hvec) * 16, vs[qq])
                else:
                    _store_chunk(oxa + pj * row_bytes + _i64(vbase) * 16, v0, v1, v2, v3)
        if cutlass.const_expr(not fp8):  # empty again for the next epoch's sender
            S = Int32(SENTINEL)
            _store_chunk(src + _i64(vbase) * 16, *[[S, S, S, S]] * 4)
        if c == 0:
            if posv >= 0:
                o_rank[posv] = s
                o_tok[posv] = t
                o_w[posv] = ptx.i32_as_f32(wl)
                row_pos[row * K + lane] = posv


@cute.jit
def _pack_rows(me, tab: cute.Tensor, tab_off, chs: cute.Tensor, q, world, pre: cute.Tensor, base: cute.Tensor, cap,
               nrows, rank, nlocal, maxt, nvec, epoch, lane, gw, nw, oxa, osa, o_rank: cute.Tensor,
               o_tok: cute.Tensor, o_w: cute.Tensor, row_pos: cute.Tensor, off_rx, off_rid, off_rw, off_rslot,
               off_rstamp, skip_own, err_addr, timeout_ns, K: cutlass.Constexpr, fp8: cutlass.Constexpr,
               pipe: cutlass.Constexpr):
    """Dispatch C over received rows: tab[tab_off + s] = first row of source s among them,
    tab[tab_off + world] = their count (pipe: phase q's rows, token t = q * chs[s] + index; else
    every row, t = index). Each (row, 2 KiB of the staged row) unit is loaded once and stored to
    every local expert slot of the row. `skip_own` != 0 (unpipelined, and pipelined with overlap):
    this rank's own rows are not in rx (packed from x: _token_unit); they are skipped here."""
    rx_row = _i64(nvec) * 16
    if cutlass.const_expr(fp8):
        rx_row = _i64(nvec) * 8 + _i64(nvec // 4)
    rvec = Int32(rx_row // 16)
    rchunk = (rvec + CHUNK_VEC - 1) // CHUNK_VEC
    total = tab[tab_off + world]
    sk0 = Int32(0)
    nskip = Int32(0)
    if skip_own != 0:
        sk0 = tab[tab_off + rank]
        nskip = tab[tab_off + rank + 1] - sk0
    u = gw
    while u < (total - nskip) * rchunk:
        rr = u // rchunk
        c = u - rr * rchunk
        if rr >= sk0:  # past this rank's own rows (none skipped without skip_own)
            rr = rr + nskip
        s = _find_source(tab, tab_off, world, rr)
        t = rr - tab[tab_off + s]
        if cutlass.const_expr(pipe):
            t = t + q * chs[s]
        _pack_unit(me, s, t, c, rank, nlocal, maxt, nvec, epoch, lane, pre, base, cap, nrows, oxa, osa, o_rank, o_tok,
                   o_w, row_pos, off_rx, off_rid, off_rw, off_rslot, off_rstamp, err_addr, timeout_ns, K, fp8, False)
        u = u + nw


@cute.jit
def _key_count(rstart: cute.Tensor, world, ntok, lane):
    """Keys of a key-major loop: token indices up to the most tokens this rank or any source has
    (rstart: the received rows' starts per source)."""
    nkeys = ntok
    s0 = Int32(0)
    while s0 < world:
        s = s0 + lane
        if s < world:
            nkeys = cutlass.max(nkeys, rstart[s + 1] - rstart[s])
        s0 = s0 + 32
    return warp_max(nkeys)


@cute.jit
def _key_unit(u, per_key, nw):
    """(key t, position within the key) of unit u of a key-major loop over nw warps. With at least one
    warp per unit of a key a warp holds at most one unit per key, so positions rotate by key: each
    warp then mixes the key's roles (nw % per_key == 0 would otherwise give every warp one role for
    the whole launch). With fewer warps no rotation: a warp's units of one key keep their order."""
    t = u // per_key
    v = u - t * per_key
    if nw >= per_key:
        v = (v + t % per_key) % per_key
    return t, v


@cute.jit
def _send_and_pack(x: cute.Tensor, ids: cute.Tensor, wts: cute.Tensor, peers: cute.Tensor, me, rank, world, maxt,
                   nlocal, ntok, rstart: cute.Tensor, nvec, epoch, lane, gw, nw, pre: cute.Tensor, base: cute.Tensor,
                   cap, nrows, oxa, osa, o_rank: cute.Tensor, o_tok: cute.Tensor, o_w: cute.Tensor,
                   row_pos: cute.Tensor, off_rx, off_rid, off_rw, off_rslot, off_rstamp, err_addr, timeout_ns,
                   K: cutlass.Constexpr):
    """bf16 dispatch with overlap, after the tables: units (key t, position j, chunk) in t-major order;
    position 0 sends own token t (and packs it into its local slots: _token_unit), position 1 + i
    packs the i-th other source's token t if it was routed here (_pack_unit, which polls the chunk
    until it has arrived). So the peers' rows are packed while later rows are still on the wire,
    with no rows counter to wait for. Positions rotate by key when the grid has a warp per unit of a
    key (every warp mixes sends and packs). No deadlock, as combine: a pack of key t waits only for
    a send of key t, which waits for nothing, and a warp takes its keys in increasing order with a
    key's send first (or holds one unit per key); rows are addressed by the tables' row starts."""
    nchunk = nvec // CHUNK_VEC
    nkeys = _key_count(rstart, world, ntok, lane)
    per_key = world * nchunk
    u = gw
    while u < nkeys * per_key:
        t, v = _key_unit(u, per_key, nw)
        j = v // nchunk
        c = v - j * nchunk
        if j == 0:
            if t < ntok:
                _token_unit(x, ids, wts, peers, me, rank, maxt, nlocal, t, c, nvec, epoch, lane, Int32(1), Int32(1),
                            pre, base, cap, nrows, oxa, osa, o_rank, o_tok, o_w, row_pos, off_rx, off_rid, off_rw,
                            off_rslot, off_rstamp, K, False, Int32(0), Int32(0))
        else:
            s = j - 1
            if s >= rank:
                s = j
            if t < rstart[s + 1] - rstart[s]:
                _pack_unit(me, s, t, c, rank, nlocal, maxt, nvec, epoch, lane, pre, base, cap, nrows, oxa, osa, o_rank,
                           o_tok, o_w, row_pos, off_rx, off_rid, off_rw, off_rslot, off_rstamp, err_addr, timeout_ns,
                           K, False, True)
        u = u + nw


# ------------------------------------------------------------------------------- dispatch
def _make_dispatch(K: int, fp8: bool = False, pipe: bool = False):
    """`fp8`: the MXFP8 payload. Each A2 unit (token, 1024 bf16) is quantized once in registers
    (_quantize_mx: 4 lanes per 32-value block) and sent as 1 KiB of E4M3 plus 32 scale bytes into
    the staged row (s, t) = [H E4M3 | H/32 E8M0]; C copies staged rows in 2 KiB chunks (the last
    one partial), values to out_x [rows, H] and scales to out_s [rows, H/32]; own rows are quantized
    the same way and stored straight to out_x / out_s.
    `pipe`: send and pack overlap in phases (see the module docstring, "pipelined dispatch")."""
    @cute.kernel
    def kernel(x: cute.Tensor, ids: cute.Tensor, wts: cute.Tensor, out_x: cute.Tensor, out_s: cute.Tensor,
               rstart_out: cute.Tensor, counts: cute.Tensor,
               offsets: cute.Tensor, o_rank: cute.Tensor, o_tok: cute.Tensor, o_w: cute.Tensor,
               row_pos: cute.Tensor, peers: cute.Tensor, rank: Int32, world: Int32, ntok: Int32, nvec: Int32,
               nlocal: Int32, maxt: Int32, cap: Int32, contiguous: Int32, off_rx: Int64, off_rid: Int64,
               off_rw: Int64, off_rslot: Int64, off_rstamp: Int64, off_rntok: Int64, off_recnt: Int64,
               off_dcnt: Int64, off_state: Int64, err_addr: Int64, timeout_ns: Int64, probe: Int64,
               off_rnph: Int64, maxp: Int32, nphase: Int32, swarps: Int32, overlap: Int32):
        _pdl_start()
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nb, _, _ = cute.arch.grid_dim()
        lane = tid % 32
        w = tid // 32
        gw = bid * WARPS + w
        nw = nb * WARPS
        _stamp(probe, tid, bid, PH_START)
        me = peers[rank]
        epoch = ptx.ld_relaxed_gpu(me + off_state) + 1
        tag = _tag(epoch)
        # the tables (rntok, recnt) alternate between two buffers by epoch parity (see _load_tables)
        off_rntok = off_rntok + _i64(epoch & 1) * world * 4
        off_recnt = off_recnt + _i64(epoch & 1) * world * nlocal * 4
        oxa = out_x.iterator.toint()
        osa = out_s.iterator.toint()
        nrows = out_x.shape[0]
        row0 = _i64(rank) * maxt
        ch = ntok  # own tokens per send phase (pipe: ceil(ntok / nphase))
        # overlap: tables exchanged before A2, own rows packed during the sends
        early = Int32(cutlass.select_(overlap != 0, 1, 0))
        if cutlass.const_expr(pipe):
            ch = (ntok + nphase - 1) // nphase
        rows_cnt = off_dcnt + _i64(world) * 4  # dcnt[1]: the rows arrival (pipe: send phase 0's)
        smem = SmemAllocator()
        pre = smem.allocate_tensor(Int32, cute.make_layout(MAX_PAIRS))
        base = smem.allocate_tensor(Int32, cute.make_layout(MAX_LOCAL + 1))
        rstart = smem.allocate_tensor(Int32, cute.make_layout(MAX_WORLD + 1))
        segcnt = smem.allocate_tensor(Int32, cute.make_layout(WARPS))
        rstq = rstart  # pipe: per receive phase q, the row starts of phase q's rows
        chs = rstart  # pipe: per source, its tokens per send phase
        qmax = smem.allocate_tensor(Int32, cute.make_layout(1))
        if cutlass.const_expr(pipe):
            rstq = smem.allocate_tensor(Int32, cute.make_layout(PIPE_MAX * (MAX_WORLD + 1)))
            chs = smem.allocate_tensor(Int32, cute.make_layout(MAX_WORLD))

        # ---- A1. per-expert slot indices of this rank's tokens
        nexp = nlocal * world
        if early != 0:
            # a block per global expert: warp w scans its share [tb, te) of the tokens twice (count,
            # then write after the block's prefix of the counts), so a 4096-token scan takes 512
            # tokens per warp instead of 4096 on one warp before the sends can start
            seg = (ntok + 32 * WARPS - 1) // (32 * WARPS) * 32
            tb = cutlass.min(w * seg, ntok)
            te = cutlass.min(tb + seg, ntok)
            g = bid
            while g < nexp:  # uniform per block: the barriers below are reached by every thread
                d = g // nlocal
                dbase = peers[d]
                n = _scan_expert(ids, wts, g, tb, te, Int32(0), dbase, row0, lane, nlocal, epoch, off_rslot, off_rid,
                                 off_rw, off_rstamp, K, False, True)
                if lane == 0:
                    segcnt[w] = n
                cute.arch.sync_threads()
                before = Int32(0)
                tot = Int32(0)
                for i in cutlass.range_constexpr(WARPS):
                    ci = segcnt[i]
                    if w > i:
                        before = before + ci
                    tot = tot + ci
                _scan_expert(ids, wts, g, tb, te, before, dbase, row0, lane, nlocal, epoch, off_rslot, off_rid, off_rw,
                             off_rstamp, K, True, True)
                cute.arch.sync_threads()  # the block's rslot stores before the count; segcnt is rewritten next
                if tid == 0:
                    _store_count(dbase + off_recnt + (_i64(rank) * nlocal + (g - d * nlocal)) * 4, tot | tag, d == rank)
                g = g + nb
        else:
            # the last warps, one global expert each, so they overlap the row copies of A2, which
            # start at warp 0
            g = nw - 1 - gw
            while g < nexp:
                d = g // nlocal
                running = _scan_expert(ids, wts, g, Int32(0), ntok, Int32(0), peers[d], row0, lane, nlocal, epoch,
                                       off_rslot, off_rid, off_rw, off_rstamp, K, True, False)
                cute.arch.sync_warp()  # the warp's rslot stores before the count
                if lane == 0:
                    _store_count(peers[d] + off_recnt + (_i64(rank) * nlocal + (g - d * nlocal)) * 4, running | tag,
                                 d == rank)
                g = g + nw
            # ---- A2. token rows (pipe: the first send phase's), once per destination rank
            _send_rows(x, ids, wts, peers, me, rank, maxt, nlocal, 0, cutlass.min(ch, ntok), nvec, epoch, lane, gw, nw,
                       Int32(1), Int32(0), pre, base, cap, nrows, oxa, osa, o_rank, o_tok, o_w, row_pos, off_rx,
                       off_rid, off_rw, off_rslot, off_rstamp, K, fp8, Int32(1 if pipe else 0), Int32(1))
        cute.arch.sync_threads()
        if cutlass.const_expr(pipe):
            # the tables counter; without overlap phase 0's too, and every later one if that is the last
            ncnt0 = Int32(1)
            if early == 0:
                ncnt0 = cutlass.select_(nphase == 1, maxp + 1, Int32(2))
            _arrive(peers, tid, bid, nb, world, off_dcnt, rank, off_rntok, ntok | tag, True, ncnt0, off_rnph, nphase)
        else:  # the tables counter; without overlap the rows counter too (A2 is done)
            _arrive(peers, tid, bid, nb, world, off_dcnt, rank, off_rntok, ntok | tag, True, Int32(2 - early))
        _stamp(probe, tid, bid, PH_TABLES_SENT)
        if early == 0:
            _stamp(probe, tid, bid, PH_ROWS_SENT)

        # ---- B. wait for every block of every source (ARRIVAL_STEP per source and epoch): the tables
        # with overlap, else the rows (their arrival follows the tables', so it covers them). Unpipelined
        # without overlap the wait comes after the tables and the own rows' pack (below).
        late_wait = Int32(0)
        if cutlass.const_expr(not pipe):
            late_wait = 1 - early
        if late_wait == 0:
            wait_off = off_dcnt
            if early == 0:
                wait_off = rows_cnt
            _wait_all(me, tid, world, wait_off, wrap_mul(epoch, ARRIVAL_STEP), err_addr, timeout_ns,
                      ERR_DISPATCH_TIMEOUT)
            cute.arch.sync_threads()
            if early == 0:
                _store_epoch(me, off_state, tid, bid, epoch)
                _stamp(probe, tid, bid, PH_ROWS_WAITED)
            _stamp(probe, tid, bid, PH_TABLES_WAITED)

        # ---- C. pack into per-local-expert rows. Tables first: every thread polls its share of the
        # tagged counts into shared memory (_load_tables); then per local expert (one thread each)
        # the exclusive prefix of recnt over sources and the total, while the last warp scans the
        # sources' row starts. Masked: bases e * cap are known, one barrier; contiguous: warp 0 then
        # scans the totals into bases (second barrier).
        _load_tables(me, off_rntok, off_recnt, tag, tid, world, nlocal, pre, rstart, err_addr, timeout_ns)
        cute.arch.sync_threads()
        _row_starts(lane, w == WARPS - 1, world, rstart)
        if cutlass.const_expr(pipe):
            _phase_tables(me, off_rntok, off_rnph, lane, w == WARPS - 1, world, rstq, chs, qmax)
        e = tid
        while e < nlocal:
            acc = Int32(0)
            for s in cutlass.range(world):
                cnt = pre[s * nlocal + e]
                pre[s * nlocal + e] = acc
                acc = acc + cnt
            if contiguous != 0:
                base[e] = acc  # the total, scanned into the base below
            else:
                base[e] = e * cap
                if bid == 0:
                    counts[e] = acc
                    offsets[e] = e * cap
                if acc > cap:
                    ptx.st_release_sys(err_addr, ERR_CAPACITY | e)
            e += THREADS
        if (contiguous == 0) & (bid == 0) & (tid == 0):
            offsets[nlocal] = nlocal * cap
        cute.arch.sync_threads()
        if bid == 0:  # for combine, which then needs no scan of its own
            i = tid
            while i <= world:
                rstart_out[i] = rstart[i]
                i += THREADS
        if contiguous != 0:
            if tid < 32:  # warp 0: bases = exclusive scan of the totals; counts, offsets
                carry = Int32(0)
                e0 = Int32(0)
                while e0 < nlocal:
                    e2 = e0 + tid
                    cnt = Int32(0)
                    if e2 < nlocal:
                        cnt = base[e2]
                    incl = _warp_inclusive_scan(cnt, tid)
                    if e2 < nlocal:
                        b = carry + incl - cnt
                        base[e2] = b
                        if bid == 0:
                            counts[e2] = cnt
                            offsets[e2] = b
                        if cnt > cap:
                            ptx.st_release_sys(err_addr, ERR_CAPACITY | e2)
                    carry = carry + cute.arch.shuffle_sync(incl, 31)
                    e0 = e0 + 32
                if (tid == 0) & (bid == 0):
                    offsets[nlocal] = carry
            cute.arch.sync_threads()
        _stamp(probe, tid, bid, PH_TABLES_BUILT)

        if cutlass.const_expr(not pipe):
            if cutlass.const_expr(not fp8):
                if early != 0:
                    # ---- bf16 overlap: sends (with the own rows' pack) and the peers' rows' pack in one
                    # key-major loop, each received chunk polled (see _send_and_pack); the rows counter
                    # only for peers that wait on it (overlap off there). The tables wait acquired every
                    # own block's arrival, so every block has read the old epoch.
                    _store_epoch(me, off_state, tid, bid, epoch)
                    _send_and_pack(x, ids, wts, peers, me, rank, world, maxt, nlocal, ntok, rstart, nvec, epoch, lane,
                                   gw, nw, pre, base, cap, nrows, oxa, osa, o_rank, o_tok, o_w, row_pos, off_rx,
                                   off_rid, off_rw, off_rslot, off_rstamp, err_addr, timeout_ns, K)
                    cute.arch.sync_threads()
                    _arrive(peers, tid, bid, nb, world, rows_cnt, rank, off_rntok, ntok, False)
                    _stamp(probe, tid, bid, PH_ROWS_SENT)
                    _stamp(probe, tid, bid, PH_ROWS_WAITED)
            if cutlass.const_expr(fp8):
                if early != 0:
                    # ---- A2 with the own rows' pack: each unit goes to the peers and to its local slots
                    _send_rows(x, ids, wts, peers, me, rank, maxt, nlocal, 0, ntok, nvec, epoch, lane, gw, nw, Int32(1),
                               Int32(1), pre, base, cap, nrows, oxa, osa, o_rank, o_tok, o_w, row_pos, off_rx, off_rid,
                               off_rw, off_rslot, off_rstamp, K, fp8, Int32(0), Int32(0))
                    cute.arch.sync_threads()
                    _arrive(peers, tid, bid, nb, world, rows_cnt, rank, off_rntok, ntok, False)
                    _stamp(probe, tid, bid, PH_ROWS_SENT)
                    _wait_all(me, tid, world, rows_cnt, wrap_mul(epoch, ARRIVAL_STEP), err_addr, timeout_ns,
                              ERR_DISPATCH_TIMEOUT)
                    cute.arch.sync_threads()
                    _store_epoch(me, off_state, tid, bid, epoch)
                    _stamp(probe, tid, bid, PH_ROWS_WAITED)
            gwp = gw
            if late_wait != 0:
                # ---- without overlap: the own rows (from x) while the peers' rows are still arriving,
                # then the rows wait; the peers' pack below takes its units on from where this loop
                # left off, so every warp's share of both loops together stays even
                _send_rows(x, ids, wts, peers, me, rank, maxt, nlocal, 0, ntok, nvec, epoch, lane, gw, nw, Int32(0),
                           Int32(1), pre, base, cap, nrows, oxa, osa, o_rank, o_tok, o_w, row_pos, off_rx, off_rid,
                           off_rw, off_rslot, off_rstamp, K, fp8, Int32(0), Int32(0))
                _wait_all(me, tid, world, rows_cnt, wrap_mul(epoch, ARRIVAL_STEP), err_addr, timeout_ns,
                          ERR_DISPATCH_TIMEOUT)
                cute.arch.sync_threads()
                _store_epoch(me, off_state, tid, bid, epoch)
                _stamp(probe, tid, bid, PH_ROWS_WAITED)
                _stamp(probe, tid, bid, PH_TABLES_WAITED)
                gwp = (gw + nw - (ntok * (nvec // CHUNK_VEC)) % nw) % nw
            # the peers' received rows after the wait (bf16 with overlap: packed in the loop above)
            pack_after = Int32(1)
            if cutlass.const_expr(not fp8):
                pack_after = 1 - early
            if pack_after != 0:
                _pack_rows(me, rstart, 0, chs, 0, world, pre, base, cap, nrows, rank, nlocal, maxt, nvec, epoch, lane,
                           gwp, nw, oxa, osa, o_rank, o_tok, o_w, row_pos, off_rx, off_rid, off_rw, off_rslot, off_rstamp,
                           Int32(1), err_addr, timeout_ns, K, fp8, False)
        else:
            if early != 0:
                # ---- send phase 0 with the own rows' pack fused (as unpipelined A2 with overlap), arrive
                # on its counter (every later one too if it is the last phase) and wait for it
                _send_rows(x, ids, wts, peers, me, rank, maxt, nlocal, 0, cutlass.min(ch, ntok), nvec, epoch, lane,
                           gw, nw, Int32(1), Int32(1), pre, base, cap, nrows, oxa, osa, o_rank, o_tok, o_w, row_pos,
                           off_rx, off_rid, off_rw, off_rslot, off_rstamp, K, fp8, Int32(0), Int32(0))
                cute.arch.sync_threads()
                _arrive(peers, tid, bid, nb, world, rows_cnt, rank, off_rntok, ntok, False,
                        Int32(cutlass.select_(nphase == 1, maxp, 1)))
                _stamp(probe, tid, bid, PH_ROWS_SENT)
                _wait_all(me, tid, world, rows_cnt, wrap_mul(epoch, ARRIVAL_STEP), err_addr, timeout_ns,
                          ERR_DISPATCH_TIMEOUT)
                cute.arch.sync_threads()
                _store_epoch(me, off_state, tid, bid, epoch)
                _stamp(probe, tid, bid, PH_ROWS_WAITED)
            # phase q: send own phase q + 1 and pack every source's phase q -- with swarps > 0 the
            # first swarps warps of each block send while the others pack, so the NVLink stores and the
            # local copy run at once; swarps == 0: every warp sends, then packs -- then arrive on
            # phase counter q + 1 (dcnt[q + 2]; its release waits for this block's stores) and wait for
            # it. Arrival q + 1 follows wait q, so the protocol cannot deadlock. With overlap the sends
            # also pack the own rows (from x, during the NVLink stores) and the pack skips them in rx.
            nq = qmax[0]
            own_copy = 1 - early
            q = Int32(0)
            while q < nq:
                tb = (q + 1) * ch
                te = cutlass.min((q + 2) * ch, ntok)
                tq = q * (MAX_WORLD + 1)
                if (q + 1 < nphase) & (swarps > 0):
                    if w < swarps:
                        _send_rows(x, ids, wts, peers, me, rank, maxt, nlocal, tb, te, nvec, epoch, lane,
                                   bid * swarps + w, nb * swarps, Int32(1), early, pre, base, cap, nrows, oxa, osa,
                                   o_rank, o_tok, o_w, row_pos, off_rx, off_rid, off_rw, off_rslot, off_rstamp, K,
                                   fp8, own_copy, own_copy)
                    else:
                        _pack_rows(me, rstq, tq, chs, q, world, pre, base, cap, nrows, rank, nlocal, maxt, nvec, epoch,
                                   lane, bid * (WARPS - swarps) + w - swarps, nb * (WARPS - swarps), oxa, osa, o_rank,
                                   o_tok, o_w, row_pos, off_rx, off_rid, off_rw, off_rslot, off_rstamp, early,
                                   err_addr, timeout_ns, K, fp8, True)
                else:
                    if q + 1 < nphase:
                        _send_rows(x, ids, wts, peers, me, rank, maxt, nlocal, tb, te, nvec, epoch, lane, gw, nw,
                                   Int32(1), early, pre, base, cap, nrows, oxa, osa, o_rank, o_tok, o_w, row_pos,
                                   off_rx, off_rid, off_rw, off_rslot, off_rstamp, K, fp8, own_copy, own_copy)
                    _pack_rows(me, rstq, tq, chs, q, world, pre, base, cap, nrows, rank, nlocal, maxt, nvec, epoch,
                               lane, gw, nw, oxa, osa, o_rank, o_tok, o_w, row_pos, off_rx, off_rid, off_rw, off_rslot,
                               off_rstamp, early, err_addr, timeout_ns, K, fp8, True)
                cute.arch.sync_threads()
                if q + 1 < nphase:
                    _arrive(peers, tid, bid, nb, world, off_dcnt + _i64(q + 2) * world * 4, rank, off_rntok, ntok,
                            False, Int32(cutlass.select_(q + 2 == nphase, maxp - q - 1, 1)), off_rnph, nphase)
                if q + 1 < nq:
                    _wait_all(me, tid, world, off_dcnt + _i64(q + 2) * world * 4, wrap_mul(epoch, ARRIVAL_STEP),
                              err_addr, timeout_ns, ERR_DISPATCH_TIMEOUT)
                    cute.arch.sync_threads()
                q = q + 1
        _stamp(probe, tid, bid, PH_PACKED)

    @cute.jit
    def launch(x: cute.Tensor, ids: cute.Tensor, wts: cute.Tensor, out_x: cute.Tensor, out_s: cute.Tensor,
               rstart: cute.Tensor, counts: cute.Tensor, offsets: cute.Tensor, o_rank: cute.Tensor, o_tok: cute.Tensor,
               o_w: cute.Tensor, row_pos: cute.Tensor, peers: cute.Tensor, rank: Int32, world: Int32, nlocal: Int32,
               maxt: Int32, cap: Int32, contiguous: Int32, off_rx: Int64, off_rid: Int64, off_rw: Int64,
               off_rslot: Int64, off_rstamp: Int64, off_rntok: Int64, off_recnt: Int64, off_dcnt: Int64,
               off_state: Int64, err_addr: Int64, timeout_ns: Int64, probe: Int64, off_rnph: Int64, maxp: Int32,
               nphase: Int32, swarps: Int32, overlap: Int32, nblocks: Int32, pdl: Int32, stream):
        kernel(x, ids, wts, out_x, out_s, rstart, counts, offsets, o_rank, o_tok, o_w, row_pos, peers, rank, world,
               x.shape[0], x.shape[1] // 8, nlocal, maxt, cap, contiguous, off_rx, off_rid, off_rw, off_rslot,
               off_rstamp, off_rntok, off_recnt, off_dcnt, off_state, err_addr, timeout_ns, probe, off_rnph, maxp,
               nphase, swarps, overlap).launch(grid=(nblocks, 1, 1), block=(THREADS, 1, 1), stream=stream,
                                               use_pdl=pdl)

    return launch


# ------------------------------------------------------------------------------- combine


@cute.jit
def _add_words(acc: cute.Tensor, buf: cute.Tensor):
    """acc[2 i (+1)] += the bf16 pair of word i of buf (16 words: a lane's 4 vectors of a chunk), fp32 add.rn."""
    for i in cutlass.range_constexpr(16):
        lo, hi = add_bf16x2(acc[2 * i], acc[2 * i + 1], buf[i])
        acc[2 * i] = lo
        acc[2 * i + 1] = hi


@cute.jit
def _round_words(buf: cute.Tensor, acc: cute.Tensor):
    """buf[i] = acc[2 i], acc[2 i + 1] rounded to a bf16 pair (rn)."""
    for i in cutlass.range_constexpr(16):
        buf[i] = ptx.f32_to_bf16x2(acc[2 * i], acc[2 * i + 1])


@cute.jit
def _row_partial(acc: cute.Tensor, ya, row_bytes, coff, posv, wv, ok, K: cutlass.Constexpr):
    """acc = sum over the slots j < K with ok (lane j's flag) of w_j * y[pos_j] (this lane's 32 values of
    the chunk at byte `coff` of the row), in ascending j: fp32 mul.rn then add.rn from 0.0, the
    reference's arithmetic. All K slots' loads are issued unconditionally (a slot held elsewhere
    re-reads the first local slot's row and is not added), so they are in flight together."""
    m = cute.arch.vote_ballot_sync(ok != 0)
    pfirst = cute.arch.shuffle_sync(posv, lowest_lane(m))
    for i in cutlass.range_constexpr(32):
        acc[i] = cutlass.Float32(0.0)
    for j in cutlass.range_constexpr(K):
        okj = (m >> j) & 1
        pj = cute.arch.shuffle_sync(posv, j)
        if okj == 0:
            pj = pfirst
        wj = ptx.i32_as_f32(cute.arch.shuffle_sync(wv, j))
        a = ya + _i64(pj) * row_bytes + coff
        for q in cutlass.range_constexpr(4):
            dq = ptx.ld_v4(a + q * 512)
            for h in cutlass.range_constexpr(4):
                lo, hi = fma_bf16x2_sel(acc[8 * q + 2 * h], acc[8 * q + 2 * h + 1], dq[h], wj, okj)
                acc[8 * q + 2 * h] = lo
                acc[8 * q + 2 * h + 1] = hi


def _make_combine(K: int):
    @cute.kernel
    def kernel(y: cute.Tensor, ids: cute.Tensor, out: cute.Tensor, row_pos: cute.Tensor, rstart: cute.Tensor,
               peers: cute.Tensor, rank: Int32, world: Int32, ntok: Int32, nvec: Int32, nlocal: Int32, maxt: Int32,
               off_rid: Int64, off_rw: Int64, off_rstamp: Int64, off_cx: Int64, off_state: Int64, err_addr: Int64,
               timeout_ns: Int64, probe: Int64):
        _pdl_wait()
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nb, _, _ = cute.arch.grid_dim()
        lane = tid % 32
        gw = bid * COMBINE_WARPS + tid // 32
        nw = nb * COMBINE_WARPS
        _stamp(probe, tid, bid, 0)
        me = peers[rank]
        d_epoch = ptx.ld_relaxed_gpu(me + off_state)  # the last dispatch's epoch: its rows' stamps
        ya = y.iterator.toint()
        oa = out.iterator.toint()
        row_bytes = _i64(nvec) * 16
        nchunk = nvec // CHUNK_VEC
        lane_off = _i64(lane) * 16
        acc = cute.make_rmem_tensor(cute.make_layout(32), cutlass.Float32)
        words = cute.make_rmem_tensor(cute.make_layout(16), Int32)  # a partial's bf16 pairs, this lane's part
        own = cute.make_rmem_tensor(cute.make_layout(16), Int32)
        S = Int32(SENTINEL)
        nkeys = _key_count(rstart, world, ntok, lane)  # rstart from dispatch (L1-cached)
        per_key = world * nchunk
        u = gw
        while u < nkeys * per_key:
            t, v = _key_unit(u, per_key, nw)  # rotated: every warp mixes sends and sums
            j = v // nchunk
            coff = _i64((v - j * nchunk) * CHUNK_VEC) * 16 + lane_off
            if j < world - 1:
                # ---- send: source s's token t, if routed here: its partial over this rank's slots
                s = j
                if j >= rank:
                    s = j + 1
                if t < rstart[s + 1] - rstart[s]:
                    row = _i64(s) * maxt + t
                    stamp = ld_b32_cg(me + off_rstamp + row * 4)
                    idl = Int32(-1)
                    pl = Int32(0)
                    wl = Int32(0)
                    if lane < K:  # issued together, used after the stamp check
                        idl = ld_b32_cg(me + off_rid + (row * K + lane) * 4)
                        pl = row_pos[row * K + lane]
                        wl = ld_b32_cg(me + off_rw + (row * K + lane) * 4)
                    if stamp == d_epoch:
                        lid = idl - rank * nlocal
                        ok = Int32(0)
                        if (lane < K) & (lid >= 0) & (lid < nlocal):
                            ok = Int32(1)
                        _row_partial(acc, ya, row_bytes, coff, pl, wl, ok, K)
                        _round_words(words, acc)
                        _store_chunk(peers[s] + off_cx + (_i64(rank) * maxt + t) * row_bytes + coff,
                                     *[_canon([words[4 * q + h] for h in range(4)]) for q in range(4)])
            elif t < ntok:
                # ---- reduce: own token t over its distinct ranks in ascending order (fp32 from 0.0,
                # add.rn of each rank's bf16 partial: the reference's order); ours computed here
                dv = _token_dest(ids, t, lane, nlocal, K)
                row = _i64(rank) * maxt + t
                pl = Int32(0)
                wl = Int32(0)
                mine = Int32(0)
                if lane < K:
                    pl = row_pos[row * K + lane]
                    wl = ld_b32_cg(me + off_rw + (row * K + lane) * 4)
                    if dv == rank:
                        mine = Int32(1)
                ra = _next_rank(cutlass.select_(dv == rank, Int32(-1), dv), Int32(-1))  # first peer, or -1
                cx_t = me + off_cx + _i64(t) * row_bytes + coff
                if ra >= 0:  # in flight while our partial is computed
                    _load_chunk(words, cx_t + _i64(ra) * maxt * row_bytes)
                if warp_max(mine) != 0:
                    _row_partial(acc, ya, row_bytes, coff, pl, wl, mine, K)
                    _round_words(own, acc)
                for i in cutlass.range_constexpr(32):
                    acc[i] = cutlass.Float32(0.0)
                r = _next_rank(dv, Int32(-1))  # K >= 1: every token has a rank
                while r >= 0:
                    if r == rank:
                        _add_words(acc, own)
                    else:
                        src = cx_t + _i64(r) * maxt * row_bytes
                        if r != ra:
                            _load_chunk(words, src)
                        _poll_chunk(words, src, err_addr, timeout_ns, ERR_COMBINE_TIMEOUT | r)
                        _add_words(acc, words)
                        _store_chunk(src, *[[S, S, S, S]] * 4)  # empty again for the next epoch's sender
                    r = _next_rank(dv, r)
                _round_words(words, acc)
                _store_chunk(oa + _i64(t) * row_bytes + coff, *[[words[4 * q + h] for h in range(4)] for q in range(4)])
            u = u + nw
        if probe != 0:
            cute.arch.sync_threads()  # "done" is the block's last warp
        _stamp(probe, tid, bid, 1)

    @cute.jit
    def launch(y: cute.Tensor, ids: cute.Tensor, out: cute.Tensor, row_pos: cute.Tensor, rstart: cute.Tensor,
               peers: cute.Tensor, rank: Int32, world: Int32, nlocal: Int32, maxt: Int32, off_rid: Int64,
               off_rw: Int64, off_rstamp: Int64, off_cx: Int64, off_state: Int64, err_addr: Int64, timeout_ns: Int64,
               probe: Int64, nblocks: Int32, pdl: Int32, stream):
        ntok = out.shape[0]
        nvec = out.shape[1] // 8
        kernel(y, ids, out, row_pos, rstart, peers, rank, world, ntok, nvec, nlocal, maxt, off_rid, off_rw,
               off_rstamp, off_cx, off_state, err_addr, timeout_ns, probe).launch(
            grid=(nblocks, 1, 1), block=(COMBINE_WARPS * 32, 1, 1), stream=stream, use_pdl=pdl)

    return launch


# ------------------------------------------------------------------------------- export
def fake_row_major(dt, shape, align=4):
    """A fake tensor laid out as torch lays out a contiguous tensor (last mode stride 1).

    CuTeDSL's compact default is column-major; an export compiled that way rejects every
    contiguous torch tensor of more than one row at call time."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    return make_fake_compact_tensor(dt, shape, stride_order=tuple(reversed(range(len(shape)))),
                                    assumed_align=align)


def compile_for_export(arch: str, topks=TOPK_VARIANTS) -> dict:
    """Compile dispatch_k{K} and combine_k{K} for each K in `topks` against fake tensors (no GPU).

    Call signatures (torch tensors; ints for scalars; the current torch stream):
      dispatch_kK(x [T,H] bf16, ids [T,K] i32, wts [T,K] f32, out_x [rows,H] bf16, out_s (= out_x),
                  rstart [R+1] i32 (out: received rows' starts per source, for combine), counts [L] i32,
                  offsets [L+1] i32, o_rank [rows] i32, o_tok [rows] i32, o_w [rows] f32,
                  row_pos [R*M*K] i32, peers [R] i64, rank, world, nlocal, maxt, cap, contiguous,
                  off_rx, off_rid, off_rw, off_rslot, off_rstamp, off_rntok, off_recnt, off_dcnt,
                  off_state, err_addr, timeout_ns, probe, off_rnph, maxp, nphase, swarps, overlap, nblocks, pdl)
      dispatch_mxfp8_kK: the same with out_x [rows,H] uint8 (E4M3 bits) and out_s [rows,H/32]
                  uint8 (E8M0); off_rx's region holds staged rows of H + H/32 bytes
      dispatch_pipe_kK, dispatch_mxfp8_pipe_kK: pipelined (maxp phase counters per source after the
                  tables counter in off_dcnt; nphase <= maxp send phases of this call; off_rnph [R];
                  swarps: warps per block that send while the others pack, 0..WARPS-1);
                  the others ignore off_rnph / maxp / nphase / swarps
      overlap:    1: exchange the tables first and pack own rows while sending (large batches), 0:
                  send before the first wait (latency); see the module docstring. Ranks may differ.
      off_dcnt:   [1 + P, R] counters (tables, then the rows of each send phase; P = 1 unpipelined,
                  maxp pipelined)
      combine_kK(y [rows,H] bf16, ids [T,K] i32, out [T,H] bf16, row_pos, rstart (the last dispatch's),
                 peers, rank, world, nlocal, maxt, off_rid, off_rw, off_rstamp, off_cx, off_state,
                 err_addr, timeout_ns, probe, nblocks, pdl)
                 (off_cx's region must hold the sentinel 0xFFFFFFFF in every word before the first call)
    probe: 0, or the address of an int64 [nblocks, PROBE_PHASES] device buffer (phase stamps);
    nblocks: any grid of 1..SM count (co-resident); ranks and calls may differ.
    pdl: 1 launches with programmatic dependent launch (not on the legacy default stream), 0 plainly.
    """
    from cutlass.runtime import make_fake_stream

    ten = fake_row_major
    opts = f"--gpu-arch {arch} --enable-tvm-ffi"
    i32, i64 = Int32(0), Int64(0)
    out = {}
    for K in topks:
        ntok, hid, rows = cute.sym_int(), cute.sym_int(), cute.sym_int()

        x = ten(cutlass.BFloat16, (ntok, hid), 16)
        ids = ten(Int32, (ntok, K))
        wts = ten(cutlass.Float32, (ntok, K))
        out_x = ten(cutlass.BFloat16, (rows, hid), 16)
        counts, offsets = ten(Int32, (cute.sym_int(),)), ten(Int32, (cute.sym_int(),))
        o_rank, o_tok, o_w = ten(Int32, (rows,)), ten(Int32, (rows,)), ten(cutlass.Float32, (rows,))
        row_pos = ten(Int32, (cute.sym_int(),))
        rstart = ten(Int32, (cute.sym_int(),))
        peers = ten(Int64, (cute.sym_int(),), 8)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        scalars = (i32, i32, i32, i32, i32, i32, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64,
                   i64, i32, i32, i32, i32, i32, i32)
        meta = (counts, offsets, o_rank, o_tok, o_w, row_pos, peers)
        q_x = ten(cutlass.Uint8, (rows, hid), 16)
        q_s = ten(cutlass.Uint8, (rows, cute.sym_int()), 16)
        for fp8, outs in ((False, (out_x, out_x)), (True, (q_x, q_s))):
            for pipe in (False, True):
                name = "dispatch_" + ("mxfp8_" if fp8 else "") + ("pipe_" if pipe else "") + f"k{K}"
                out[name] = cute.compile(_make_dispatch(K, fp8, pipe), x, ids, wts, *outs, rstart, *meta, *scalars,
                                         stream, options=opts)
        y = ten(cutlass.BFloat16, (cute.sym_int(), hid), 16)
        o = ten(cutlass.BFloat16, (ntok, hid), 16)
        out[f"combine_k{K}"] = cute.compile(_make_combine(K), y, ids, o, row_pos, rstart, peers, i32, i32, i32,
                                            i32, i64, i64, i64, i64, i64, i64, i64, i64, i32, i32, stream,
                                            options=opts)
    return out
