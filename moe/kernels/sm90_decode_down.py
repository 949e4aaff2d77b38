"""One-token MoE down projection for Hopper in CuTeDSL: each CTA's whole w2 slice arrives by bulk
copies into shared memory, issued before the PDL wait.

Why (perf/RESULTS.md, 2026-11-28, H200): Triton's `down` (moe.kernels.triton_fused_decode) walks
six dependent 16 KB steps per program, its only buffer for bytes in flight being registers, and
ends ~8 us after gate/up for 12.6 MB (Qwen3-30B-A3B, FP8). Here a CTA of ROWS output rows asks at
once, from one thread, for all k slots' rows w2[e_slot, rows, :] (one contiguous ROWS x I bytes
each: 12 KB at I = 768) with `cp.async.bulk` into shared memory completing on an mbarrier: no
registers held, the whole 12.6 MB in flight from the moment the CTAs are resident; the row block's
block scales go to shared memory too. Then the PDL wait (gate/up's act), act [k, I] fp32 staged
into shared memory by all threads, the mbarrier wait, and the dot products from shared memory.
H200, 48-layer batch-1 step: 2.229-2.237 ms against 2.313-2.318 with Triton's down; with 256
threads and the scales read from global memory after the wait it was 2.436 (slower).

Thread t of THREADS: row t // PARTS (a warp per row), columns [p * I / PARTS, +I / PARTS) with
p = t % PARTS, four FP8 at a time (one 32-bit shared load, converted by `cvt.rn.f16x2.e4m3x2`,
exact), times act and the block scale of their 128-column block, over the local slots weighted by
topk_weight; the row's lanes sum by butterfly shuffles and its first lane stores out[row] in bf16.
Numerics: fp32 accumulation on the FP8 weights and their 128 x 128 block scales, as
triton_fused_decode (the summation order differs).

The routing (ids, weights) is read before the PDL wait: it was written two kernels back (the
routing kernel, then gate/up, which lets this kernel launch only after its own wait), aot.pdl's
rule. Arguments of the export (flat torch views): (act [k * I] fp32, ids [k] int64, tw [k] fp32,
w2 [E * H * I] uint8 (the e4m3 bits), s2 [E * H/128 * I/128] fp32, out [H] bf16, expert_offset,
num_local, H, pdl). One variant per (k, I) in VARIANTS (shared memory is sized at compile time).
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

ARCHS = ("sm_90a",)
ROWS = 16  # output rows per CTA: the grid is H / ROWS
THREADS = 512  # a warp per row: the dot products after the wait are its critical path
PARTS = THREADS // ROWS  # lanes per row, each a 1/PARTS of the columns
VARIANTS = {"down_k8_i768": dict(k=8, inter=768)}  # Qwen3-30B-A3B


def _asm(ret, args, text, cons, loc, ip):
    return llvm.inline_asm(ret, args, text, cons, has_side_effects=True, asm_dialect=0, loc=loc, ip=ip)


@dsl_user_op
def bulk_g2s(dst, src, nbytes, mbar, *, loc=None, ip=None):
    """cp.async.bulk of `nbytes` (a multiple of 16) from global address `src` (Int64) to shared address
    `dst` (Int32), completing on the mbarrier at shared address `mbar` (Int32)."""
    _asm(None, [cutlass.Int32(dst).ir_value(loc=loc, ip=ip), cutlass.Int64(src).ir_value(loc=loc, ip=ip),
                cutlass.Int32(nbytes).ir_value(loc=loc, ip=ip), cutlass.Int32(mbar).ir_value(loc=loc, ip=ip)],
         "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
         "r,l,r,r,~{memory}", loc, ip)


def _v4f(addr, text, cons, loc, ip):
    """Inline asm returning four f32 ($0-$3) from one address operand ($4)."""
    r = _asm(ir.Type.parse("!llvm.struct<(f32,f32,f32,f32)>"), [addr], text, cons, loc, ip)
    return [cutlass.Float32(llvm.extractvalue(T.f32(), r, [i])) for i in range(4)]


@dsl_user_op
def ld_global_v4f(addr, *, loc=None, ip=None):
    """16-byte global load past L1 (act: written by the previous kernel) -> 4 x Float32."""
    return _v4f(cutlass.Int64(addr).ir_value(loc=loc, ip=ip), "ld.global.cg.v4.f32 {$0, $1, $2, $3}, [$4];",
                "=f,=f,=f,=f,l,~{memory}", loc, ip)


@dsl_user_op
def st_shared_v4f(addr, v, *, loc=None, ip=None):
    """16-byte shared store of 4 x Float32 at shared address `addr` (Int32)."""
    _asm(None, [cutlass.Int32(addr).ir_value(loc=loc, ip=ip)] + [cutlass.Float32(x).ir_value(loc=loc, ip=ip)
                                                                  for x in v],
         "st.shared.v4.f32 [$0], {$1, $2, $3, $4};", "r,f,f,f,f,~{memory}", loc, ip)


@dsl_user_op
def ld_shared_v4f(addr, *, loc=None, ip=None):
    """16-byte shared load -> 4 x Float32."""
    return _v4f(cutlass.Int32(addr).ir_value(loc=loc, ip=ip), "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];",
                "=f,=f,=f,=f,r,~{memory}", loc, ip)


@dsl_user_op
def ld_shared_e4m3x4(addr, *, loc=None, ip=None):
    """Four e4m3 bytes at shared address `addr` (Int32) -> 4 x Float32 (exact: e4m3 -> f16 -> f32)."""
    return _v4f(cutlass.Int32(addr).ir_value(loc=loc, ip=ip),
                "{\n .reg .b32 w, a, b;\n .reg .b16 lo, hi, h0, h1, h2, h3;\n ld.shared.b32 w, [$4];\n"
                " mov.b32 {lo, hi}, w;\n cvt.rn.f16x2.e4m3x2 a, lo;\n cvt.rn.f16x2.e4m3x2 b, hi;\n"
                " mov.b32 {h0, h1}, a;\n mov.b32 {h2, h3}, b;\n cvt.f32.f16 $0, h0;\n cvt.f32.f16 $1, h1;\n"
                " cvt.f32.f16 $2, h2;\n cvt.f32.f16 $3, h3;\n}",
                "=f,=f,=f,=f,r,~{memory}", loc, ip)


class DownOneToken:
    """One compiled variant: k slots, I columns (both fixed: they size the shared memory)."""

    def __init__(self, k: int, inter: int):
        step = math.lcm(PARTS * 4, 128)  # four columns a lane, whole scale blocks
        if inter % step or k * inter % (4 * THREADS):
            raise ValueError(f"I={inter}, k={k}: I must be a multiple of {step} and k x I of {4 * THREADS} "
                             "(act is staged 16 bytes a thread)")
        self.k, self.inter = k, inter
        self.slot_bytes = ROWS * inter  # one slot's rows of w2: contiguous

    @cute.jit
    def __call__(self, act: cute.Tensor, ids: cute.Tensor, tw: cute.Tensor, w2: cute.Tensor, s2: cute.Tensor,
                 out: cute.Tensor, expert_offset: cutlass.Int32, num_local: cutlass.Int32, hidden: cutlass.Int32,
                 pdl: cutlass.Int32, stream):
        @cute.struct
        class SharedStorage:
            bar: cute.struct.MemRange[cutlass.Int64, 1]
            w: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.k * self.slot_bytes], 128]
            a: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.k * self.inter], 128]
            sc: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.k * (self.inter // 128)], 16]

        self.shared_storage = SharedStorage
        self.kernel(act, ids, tw, w2, s2, out, expert_offset, num_local, hidden).launch(
            grid=[hidden // ROWS, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=pdl)

    @cute.kernel
    def kernel(self, act: cute.Tensor, ids: cute.Tensor, tw: cute.Tensor, w2: cute.Tensor, s2: cute.Tensor,
               out: cute.Tensor, expert_offset: cutlass.Int32, num_local: cutlass.Int32, hidden: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        bar = storage.bar.data_ptr()
        w_s = storage.w.data_ptr().toint()
        a_s = storage.a.data_ptr().toint()
        sc = storage.sc.get_tensor(cute.make_layout(self.k * (self.inter // 128)))
        inter = self.inter
        n0 = bidx * ROWS
        if tidx == 0:
            cute.arch.mbarrier_init(bar, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if tidx == 0:  # the routing is final (two kernels back): ask for every local slot's rows now
            total = cutlass.Int32(0)
            for s in cutlass.range_constexpr(self.k):
                e = cutlass.Int32(ids[s]) - expert_offset
                if e >= 0 and e < num_local:
                    total += self.slot_bytes
            cute.arch.mbarrier_arrive_and_expect_tx(bar, total)
            w_base = w2.iterator.toint()
            for s in cutlass.range_constexpr(self.k):
                e = cutlass.Int32(ids[s]) - expert_offset
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
        for i in cutlass.range_constexpr(self.k * inter // (4 * THREADS)):  # stage act in shared memory
            j = (i * THREADS + tidx) * 4
            st_shared_v4f(a_s + j * 4, ld_global_v4f(a_base + cutlass.Int64(j) * 4))
        cute.arch.sync_threads()
        cute.arch.mbarrier_wait(bar, 0)
        r = tidx // PARTS
        cw = inter // PARTS
        c0 = (tidx % PARTS) * cw
        acc = cutlass.Float32(0.0)
        for s in cutlass.range_constexpr(self.k):
            e = cutlass.Int32(ids[s]) - expert_offset
            if e >= 0 and e < num_local:
                part = cutlass.Float32(0.0)
                for q in cutlass.range_constexpr(cw // 4):
                    col = c0 + q * 4
                    wv = ld_shared_e4m3x4(w_s + s * self.slot_bytes + r * inter + col)
                    av = ld_shared_v4f(a_s + (s * inter + col) * 4)
                    dot = wv[0] * av[0] + wv[1] * av[1] + wv[2] * av[2] + wv[3] * av[3]
                    part += dot * sc[s * nkb + col // 128]
                acc += part * tw[s]
        for off in cutlass.range_constexpr(PARTS.bit_length() - 1):
            acc += cute.arch.shuffle_sync_bfly(acc, offset=PARTS >> (off + 1))
        if tidx % PARTS == 0:
            out[n0 + r] = acc.to(cutlass.BFloat16)


def _fake_args():
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cutlass.runtime import make_fake_stream

    n = [cute.sym_int() for _ in range(6)]
    return (make_fake_compact_tensor(cutlass.Float32, (n[0],), assumed_align=16),
            make_fake_compact_tensor(cutlass.Int64, (n[1],), assumed_align=8),
            make_fake_compact_tensor(cutlass.Float32, (n[2],), assumed_align=4),
            make_fake_compact_tensor(cutlass.Uint8, (n[3],), assumed_align=16),
            make_fake_compact_tensor(cutlass.Float32, (n[4],), assumed_align=4),
            make_fake_compact_tensor(cutlass.BFloat16, (n[5],), assumed_align=2),
            cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(0),
            make_fake_stream(use_tvm_ffi_env_stream=True))


def compile_for_export(arch: str = "sm_90a") -> dict:
    """{export name: compiled fn} for every entry of VARIANTS (arguments: module docstring)."""
    if not arch.startswith("sm_90"):
        raise ValueError(f"arch={arch!r}: the down kernel is built for sm_90a")
    return {name: cute.compile(DownOneToken(**kw), *_fake_args(), options=f"--gpu-arch {arch} --enable-tvm-ffi")
            for name, kw in VARIANTS.items()}
