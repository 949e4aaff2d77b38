"""The one-token MoE expert kernels for Hopper in CuTeDSL (gate/up, then down): each CTA's whole
weight slice arrives by bulk copies (`cp.async.bulk`, issued by one thread, completing on an
mbarrier) into shared memory, so every byte of the layer's expert weights is in flight from the
moment the CTAs may ask for it; the dot products then read shared memory, two rows a warp.

Why (perf/RESULTS.md, 2026-11-28, H200): Triton's one-token kernels (moe.kernels.triton_fused_decode)
hold their bytes in flight in registers, one tile ahead: gate/up streamed at 68% of copy bandwidth
and `down` walked six dependent 16 KB steps per program, ending ~8 us after gate/up for 12.6 MB
(Qwen3-30B-A3B, FP8). 48-layer batch-1 step: 2.313-2.318 ms with both in Triton, 2.229-2.237 with
this down, 2.141-2.156 with this gate/up too, 2.130-2.134 with down's act staged in one L2 round trip
(`stage_f32`) and its routing read once, 2.023-2.027 with two rows a warp in down (conflict-free lanes),
2.013-2.020 in gate/up too. Measured slower (perf/RESULTS.md): one kernel for both (a grid barrier between
gate/up and down, w2 bulk-copied during gate/up), 2.257-2.263; the rows arriving in parts on their own
mbarriers (gate/up in four, down a slot each), no faster; the kernels ranking the router logits
themselves instead of a top-k kernel, 2.037-2.047 (the ranking lands on both kernels' critical paths);
tensor-core dot products (mma.sync m16n8k16 on f16 rows and the vector split into f16 hi + lo, rows copied
one by one into a padded pitch: b0bb3f3), 2.059-2.081 for either kernel against 2.005-2.012.

`GateUpOneToken` (exports gate_up_h{H}, GATE_UP_VARIANTS): CTA (slot p, block of GU_ROWS rows of I).
After the PDL wait (the routing is the previous kernel) every thread asks for its part of x beside
ids[p]; then the block's two block-scale rows are asked for, one thread asks for the block's gate rows
and up rows of expert ids[p] (two contiguous GU_ROWS x H byte runs), and x goes to shared memory (bf16
-> fp32); warp w takes gate and up rows 2w, 2w + 1, lane l reading columns q * 128 + 4 l (a 128-byte
shared segment per warp and step: no bank conflicts, the step's scale uniform; each x value read serves
four dot products); act[p, row] = silu(g) * u in fp32. A slot of another rank's expert does nothing (its row
is never read). Arguments (flat torch views): (x [H] bf16, ids [k] int64, w13 [E * 2I * H] uint8
(the e4m3 bits), s13 [E * 2I/128 * H/128] fp32, act [k * I] fp32, expert_offset, num_local, I, k, pdl).

`DownOneToken` (exports down_k{k}_i{I}, DOWN_VARIANTS): CTA of ROWS output rows. One thread asks for
all k slots' rows w2[e_slot, rows, :] (one contiguous ROWS x I run each: 12 KB at I = 768) and the
row block's block scales go to shared memory, both before the PDL wait: the routing was written two
kernels back (the routing kernel, then gate/up, which lets this kernel launch only after its own
wait), aot.pdl's rule: each slot's expert and weight are read once, into registers. Then the wait
(gate/up's act), act [k, I] fp32 staged into shared memory, the mbarrier wait; warp w takes rows 2w,
2w + 1, lane l columns q * 128 + 4 l (conflict-free, each act value read serving both rows), over the
local slots weighted by topk_weight, the lanes summed by butterfly shuffles, out[row] in bf16. (A warp
per row with lanes on contiguous column runs read act with 4-way bank conflicts: 4 us of a layer's
dot products after w2 had arrived, by a %globaltimer timeline.) Arguments: (act
[k * I] fp32, ids [k] int64, tw [k] fp32, w2 [E * H * I] uint8, s2 [E * H/128 * I/128] fp32, out [H]
bf16, expert_offset, num_local, H, pdl).

Both: FP8 four at a time (one 32-bit shared load, `cvt.rn.f16x2.e4m3x2`, exact), fp32 accumulation
on the FP8 weights and their 128 x 128 block scales, as triton_fused_decode (the summation order
differs). Shared memory is sized at compile time: one variant per H (gate/up) and per (k, I) (down).
"""
import cutlass
import cutlass.cute as cute
from cutlass.cutlass_dsl import dsl_user_op

from aot.build import fake_args
from aot.ptx import (bulk_g2s, globaltimer, i32, ld_global_bf16x4, ld_global_v4f, ld_shared_v4f, smid, st_shared_v4f,
                     v4f)
from aot.rows import shared_storage_type, shared_views, warp_sum

ARCHS = ("sm_90a",)
ROWS = 16  # down: output rows per CTA (the grid is H / ROWS)
# rows a warp takes: each shared vector value read (act, x) serves them all. Step times, H200 (RESULTS):
# down a row a warp (its lanes then 4-way bank-conflicted) 2.134 ms, two 2.027, four 2.097-2.105;
# gate/up a row a warp 2.023-2.030, two 2.013-2.020, four 2.068-2.075
DOWN_ROWS_PER_WARP = 2
# Qwen3-30B-A3B; Qwen3-Next-80B-A3B (10 experts + its shared expert held as one more: moe.MoE)
DOWN_VARIANTS = {"down_k8_i768": dict(k=8, inter=768), "down_k11_i512": dict(k=11, inter=512)}
# gate/up: rows of gate (and of up) per CTA. 16 rows (8 warps) 2.007 ms a step, 8 rows (4 warps, twice the CTAs)
# 1.991-1.992; 8 rows with x kept in bf16 in shared memory (6 CTAs an SM: one wave) 2.023-2.025 (H200, RESULTS)
GU_ROWS = 8
GU_ROWS_PER_WARP = 2
GATE_UP_VARIANTS = {"gate_up_h2048": dict(hidden=2048)}  # Qwen3-30B-A3B, Qwen3-Next-80B-A3B
# gate/up with a timeline: the default kernel plus, per CTA, TIMELINE_FIELDS int64 stamps (tests/moe/
# gpu_gate_up_timeline.py); arguments (x, ids, w13, s13, act, stamps [grid * TIMELINE_FIELDS] int64), then as gate/up's
TIMELINE_VARIANTS = {"gate_up_h2048_timeline": dict(hidden=2048)}
TIMELINE_FIELDS = 5


@dsl_user_op
def ld_shared_e4m3x4(addr, *, loc=None, ip=None):
    """Four e4m3 bytes at shared address `addr` (Int32) -> 4 x Float32 (exact: e4m3 -> f16 -> f32)."""
    return v4f(i32(addr, loc, ip),
               "{\n .reg .b32 w, a, b;\n .reg .b16 lo, hi, h0, h1, h2, h3;\n ld.shared.b32 w, [$4];\n"
               " mov.b32 {lo, hi}, w;\n cvt.rn.f16x2.e4m3x2 a, lo;\n cvt.rn.f16x2.e4m3x2 b, hi;\n"
               " mov.b32 {h0, h1}, a;\n mov.b32 {h2, h3}, b;\n cvt.f32.f16 $0, h0;\n cvt.f32.f16 $1, h1;\n"
               " cvt.f32.f16 $2, h2;\n cvt.f32.f16 $3, h3;\n}",
               "=f,=f,=f,=f,r,~{memory}", loc, ip)


def stage_f32(dst, src, count, tidx, threads):
    """Copy `count` fp32 (a multiple of 4) from global `src` (past L1) to shared `dst`, 16 bytes a thread
    a step: all loads issued before the first store (the inline asm's memory clobbers would otherwise
    make each load wait for the previous store, one L2 round trip a step). In a last, partial step the
    threads past its pieces copy one of them again (index modulo its size: the same bytes to the same
    place, no branch)."""
    pieces = count // 4
    steps = -(-pieces // threads)
    last = pieces - (steps - 1) * threads  # pieces in the last step
    idx = [i * threads + tidx for i in range(steps - 1)] + [(steps - 1) * threads + tidx % last]
    vals = [ld_global_v4f(src + cutlass.Int64(i) * 16) for i in idx]
    for i, v in zip(idx, vals):
        st_shared_v4f(dst + i * 16, v)


class GateUpOneToken:
    """One compiled gate/up variant: H (sizes the shared memory) and the rows a warp takes; I, the
    expert count and k are runtime (the grid is k x I / GU_ROWS; I a multiple of 128). See the module
    docstring."""

    def __init__(self, hidden: int, rows_per_warp: int = GU_ROWS_PER_WARP, timeline: bool = False):
        self.timeline = timeline
        self.threads = 32 * GU_ROWS // rows_per_warp
        if hidden % 128 or hidden % (4 * self.threads) or GU_ROWS % rows_per_warp or hidden // 64 > self.threads:
            raise ValueError(f"H={hidden}, rows_per_warp={rows_per_warp}: H must be a multiple of 128 and of "
                             f"{4 * self.threads}, H / 64 (the block scales, a thread each) at most "
                             f"{self.threads}, rows_per_warp divide {GU_ROWS}")
        self.hidden, self.rpw = hidden, rows_per_warp
        self.rows_bytes = GU_ROWS * hidden  # one block's gate (or up) rows: contiguous

    @cute.jit
    def __call__(self, x: cute.Tensor, ids: cute.Tensor, w13: cute.Tensor, s13: cute.Tensor, act: cute.Tensor,
                 expert_offset: cutlass.Int32, num_local: cutlass.Int32, inter: cutlass.Int32, k: cutlass.Int32,
                 pdl: cutlass.Int32, stream):
        self.launch(x, ids, w13, s13, act, act, expert_offset, num_local, inter, k, pdl, stream)

    @cute.jit
    def launch(self, x, ids, w13, s13, act, stamps, expert_offset, num_local, inter, k, pdl, stream):
        self.shared_storage = shared_storage_type(2 * self.rows_bytes, self.hidden, 2 * (self.hidden // 128))
        self.kernel(x, ids, w13, s13, act, stamps, expert_offset, num_local, inter).launch(
            grid=[k, inter // GU_ROWS, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=pdl)

    @cute.kernel
    def kernel(self, x: cute.Tensor, ids: cute.Tensor, w13: cute.Tensor, s13: cute.Tensor, act: cute.Tensor,
               stamps: cute.Tensor, expert_offset: cutlass.Int32, num_local: cutlass.Int32, inter: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        p, j, _ = cute.arch.block_idx()
        t_start = globaltimer() if cutlass.const_expr(self.timeline) else cutlass.Int64(0)
        bar, w_s, x_s, sc = shared_views(self.shared_storage, 2 * (self.hidden // 128), tidx)
        hidden, threads, rpw = self.hidden, self.threads, self.rpw
        nkb = hidden // 128
        n0 = j * GU_ROWS
        cute.arch.griddepcontrol_wait()  # the routing (the previous kernel) is complete and visible
        cute.arch.griddepcontrol_launch_dependents()
        t_wait = globaltimer() if cutlass.const_expr(self.timeline) else cutlass.Int64(0)
        # x is asked for beside the routing (not after it); its stores to shared memory come last
        x_base = x.iterator.toint()
        xv = [ld_global_bf16x4(x_base + cutlass.Int64((i * threads + tidx) * 4) * 2)
              for i in range(hidden // (4 * threads))]
        e = cutlass.Int32(ids[p]) - expert_offset
        if e >= 0 and e < num_local:
            g_row = cutlass.Int64(e) * 2 * inter + n0  # first gate row; its up rows start I rows later
            scale = cutlass.Float32(0.0)
            if tidx < 2 * nkb:  # gate's then up's block scales of this row block, along K: asked for
                half = tidx // nkb  # before the weights, so they do not queue behind them
                scale = s13[((cutlass.Int64(e) * 2 * inter + half * inter + n0) // 128) * nkb + tidx % nkb]
            if tidx == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(bar, 2 * self.rows_bytes)
                w_base = w13.iterator.toint()
                bulk_g2s(w_s, w_base + g_row * hidden, self.rows_bytes, bar.toint())
                bulk_g2s(w_s + self.rows_bytes, w_base + (g_row + inter) * hidden, self.rows_bytes, bar.toint())
            if tidx < 2 * nkb:
                sc[tidx] = scale
        for i in cutlass.range_constexpr(hidden // (4 * threads)):  # (in every CTA: a store only where
            st_shared_v4f(x_s + (i * threads + tidx) * 16, xv[i])  # x is used lets ptxas sink its load)
        cute.arch.sync_threads()
        t_data = cutlass.Int64(0)
        if e >= 0 and e < num_local:
            cute.arch.mbarrier_wait(bar, 0)
            if cutlass.const_expr(self.timeline):
                t_data = globaltimer()
            r0 = (tidx // 32) * rpw
            lane = tidx % 32
            acc_g = [cutlass.Float32(0.0) for _ in range(rpw)]
            acc_u = [cutlass.Float32(0.0) for _ in range(rpw)]
            for q in cutlass.range_constexpr(nkb):
                col = q * 128 + lane * 4
                xq = ld_shared_v4f(x_s + col * 4)
                for i in cutlass.range_constexpr(rpw):
                    gv = ld_shared_e4m3x4(w_s + (r0 + i) * hidden + col)
                    uv = ld_shared_e4m3x4(w_s + self.rows_bytes + (r0 + i) * hidden + col)
                    acc_g[i] += (gv[0] * xq[0] + gv[1] * xq[1] + gv[2] * xq[2] + gv[3] * xq[3]) * sc[q]
                    acc_u[i] += (uv[0] * xq[0] + uv[1] * xq[1] + uv[2] * xq[2] + uv[3] * xq[3]) * sc[nkb + q]
            for i in cutlass.range_constexpr(rpw):
                g, u = warp_sum(acc_g[i]), warp_sum(acc_u[i])
                if lane == 0:
                    act[cutlass.Int64(p) * inter + n0 + r0 + i] = g / (1.0 + cute.math.exp(-g)) * u
        if cutlass.const_expr(self.timeline):
            if tidx == 0:  # (start, wait passed, rows arrived (0: a remote slot), end, SM) of this CTA
                base = (cutlass.Int64(p) * (inter // GU_ROWS) + j) * TIMELINE_FIELDS
                stamps[base] = t_start
                stamps[base + 1] = t_wait
                stamps[base + 2] = t_data
                stamps[base + 3] = globaltimer()
                stamps[base + 4] = cutlass.Int64(smid())


class DownOneToken:
    """One compiled variant: k slots, I columns (both fixed: they size the shared memory) and the rows a
    warp takes."""

    def __init__(self, k: int, inter: int, rows_per_warp: int = DOWN_ROWS_PER_WARP):
        self.threads = 32 * ROWS // rows_per_warp
        if inter % 128 or ROWS % rows_per_warp or k * (inter // 128) > self.threads:
            raise ValueError(f"I={inter}, k={k}, rows_per_warp={rows_per_warp}: I must be a multiple of 128, k x I "
                             f"/ 128 (the block scales, a thread each) at most {self.threads}, rows_per_warp "
                             f"divide {ROWS}")
        self.k, self.inter, self.rpw = k, inter, rows_per_warp
        self.slot_bytes = ROWS * inter  # one slot's rows of w2: contiguous

    @cute.jit
    def __call__(self, act: cute.Tensor, ids: cute.Tensor, tw: cute.Tensor, w2: cute.Tensor, s2: cute.Tensor,
                 out: cute.Tensor, expert_offset: cutlass.Int32, num_local: cutlass.Int32, hidden: cutlass.Int32,
                 pdl: cutlass.Int32, stream):
        self.shared_storage = shared_storage_type(self.k * self.slot_bytes, self.k * self.inter,
                                                  self.k * (self.inter // 128))
        self.kernel(act, ids, tw, w2, s2, out, expert_offset, num_local, hidden).launch(
            grid=[hidden // ROWS, 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=pdl)

    @cute.kernel
    def kernel(self, act: cute.Tensor, ids: cute.Tensor, tw: cute.Tensor, w2: cute.Tensor, s2: cute.Tensor,
               out: cute.Tensor, expert_offset: cutlass.Int32, num_local: cutlass.Int32, hidden: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        bar, w_s, a_s, sc = shared_views(self.shared_storage, self.k * (self.inter // 128), tidx)
        inter = self.inter
        n0 = bidx * ROWS
        # the routing is final (two kernels back): each slot's expert and weight, read once, and
        # every local slot's rows asked for now
        es = [cutlass.Int32(ids[s]) - expert_offset for s in range(self.k)]
        tws = [cutlass.Float32(tw[s]) for s in range(self.k)]
        if tidx == 0:
            total = cutlass.Int32(0)
            for s in cutlass.range_constexpr(self.k):
                if es[s] >= 0 and es[s] < num_local:
                    total += self.slot_bytes
            cute.arch.mbarrier_arrive_and_expect_tx(bar, total)
            w_base = w2.iterator.toint()
            for s in cutlass.range_constexpr(self.k):
                e = es[s]
                if e >= 0 and e < num_local:
                    src = w_base + (cutlass.Int64(e) * hidden + n0) * inter
                    bulk_g2s(w_s + s * self.slot_bytes, src, self.slot_bytes, bar.toint())
        nkb = inter // 128
        if tidx < self.k * nkb:  # this row block's scales of every local slot, before the wait (weights)
            s = tidx // nkb
            e = cutlass.Int32(ids[s]) - expert_offset
            if e >= 0 and e < num_local:
                sc[tidx] = s2[(e * (hidden // 128) + n0 // 128) * nkb + tidx % nkb]
        cute.arch.griddepcontrol_wait()  # gate/up's act is complete and visible
        cute.arch.griddepcontrol_launch_dependents()
        a_base = act.iterator.toint()
        stage_f32(a_s, a_base, self.k * inter, tidx, self.threads)
        cute.arch.sync_threads()
        cute.arch.mbarrier_wait(bar, 0)
        rpw = self.rpw
        r0 = (tidx // 32) * rpw  # this warp's rows r0, r0 + 1, ...
        lane = tidx % 32
        acc = [cutlass.Float32(0.0) for _ in range(rpw)]
        for s in cutlass.range_constexpr(self.k):
            if es[s] >= 0 and es[s] < num_local:
                part = [cutlass.Float32(0.0) for _ in range(rpw)]
                row0 = w_s + s * self.slot_bytes + r0 * inter
                for q in cutlass.range_constexpr(nkb):
                    col = q * 128 + lane * 4
                    av = ld_shared_v4f(a_s + (s * inter + col) * 4)
                    scale = sc[s * nkb + q]
                    for i in cutlass.range_constexpr(rpw):
                        wv = ld_shared_e4m3x4(row0 + i * inter + col)
                        part[i] += (wv[0] * av[0] + wv[1] * av[1] + wv[2] * av[2] + wv[3] * av[3]) * scale
                for i in cutlass.range_constexpr(rpw):
                    acc[i] += part[i] * tws[s]
        for i in cutlass.range_constexpr(rpw):
            y = warp_sum(acc[i])
            if lane == 0:
                out[n0 + r0 + i] = y.to(cutlass.BFloat16)


# (act, ids, tw, w2, s2, out), then expert_offset, num_local, H, pdl
_DOWN_ARGS = ([(cutlass.Float32, 16), (cutlass.Int64, 8), (cutlass.Float32, 4), (cutlass.Uint8, 16),
               (cutlass.Float32, 4), (cutlass.BFloat16, 2)], 4)
# (x, ids, w13, s13, act), then expert_offset, num_local, I, k, pdl
_GATE_UP_ARGS = ([(cutlass.BFloat16, 8), (cutlass.Int64, 8), (cutlass.Uint8, 16), (cutlass.Float32, 4),
                  (cutlass.Float32, 4)], 5)


# (x, ids, w13, s13, act, stamps), then as gate/up's
_TIMELINE_ARGS = ([(cutlass.BFloat16, 8), (cutlass.Int64, 8), (cutlass.Uint8, 16), (cutlass.Float32, 4),
                   (cutlass.Float32, 4), (cutlass.Int64, 8)], 5)


def compile_for_export(arch: str = "sm_90a") -> dict:
    """{export name: compiled fn} for every entry of DOWN_VARIANTS, GATE_UP_VARIANTS (arguments: module
    docstring) and TIMELINE_VARIANTS."""
    if not arch.startswith("sm_90"):
        raise ValueError(f"arch={arch!r}: the decode kernels are built for sm_90a")
    opts = f"--gpu-arch {arch} --enable-tvm-ffi"
    out = {name: cute.compile(DownOneToken(**kw), *fake_args(*_DOWN_ARGS), options=opts)
           for name, kw in DOWN_VARIANTS.items()}
    out.update({name: cute.compile(GateUpOneToken(**kw), *fake_args(*_GATE_UP_ARGS), options=opts)
                for name, kw in GATE_UP_VARIANTS.items()})
    out.update({name: cute.compile(GateUpOneToken(**kw, timeline=True).launch, *fake_args(*_TIMELINE_ARGS),
                                   options=opts)
                for name, kw in TIMELINE_VARIANTS.items()})
    return out
