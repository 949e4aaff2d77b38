"""Inline PTX for the CuTeDSL kernels of `comms`, `moe` and `nvl72` (all may import `aot`): the asm builder
and value converters their raw-address helpers share, and the bulk copy and 16- / 8-byte loads and
stores of the one-token row kernels (moe.kernels.sm90_one_token, nvl72.kernels.sm90_gemv) and the batch-1
attention (nvl72.kernels.sm90_attn: also its arrival atomic and proxy fence), the grid counter's add and
polls of the layer-stream measurement (nvl72.kernels.sm90_layer_stream). Imports
CuTeDSL, so only kernel modules (compiled where CuTeDSL is installed, never imported on a GPU host)
import it."""
import cutlass
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def asm(ret, args, text, cons, loc, ip):
    """One inline-asm op with side effects (never dropped or merged): `ret` its result type (None:
    none), `args` MLIR values, `cons` the LLVM constraint string."""
    return llvm.inline_asm(ret, args, text, cons, has_side_effects=True, asm_dialect=0, loc=loc, ip=ip)


def i32(x, loc, ip):
    return cutlass.Int32(x).ir_value(loc=loc, ip=ip)


def i64(x, loc, ip):
    return cutlass.Int64(x).ir_value(loc=loc, ip=ip)


def f32(x, loc, ip):
    return cutlass.Float32(x).ir_value(loc=loc, ip=ip)


def v4f(addr, text, cons, loc, ip):
    """Inline asm returning four f32 ($0-$3) from one address operand ($4)."""
    r = asm(ir.Type.parse("!llvm.struct<(f32,f32,f32,f32)>"), [addr], text, cons, loc, ip)
    return [cutlass.Float32(llvm.extractvalue(T.f32(), r, [i])) for i in range(4)]


@dsl_user_op
def bulk_g2s(dst, src, nbytes, mbar, *, loc=None, ip=None):
    """cp.async.bulk of `nbytes` (a multiple of 16) from global address `src` (Int64) to shared address
    `dst` (Int32), completing on the mbarrier at shared address `mbar` (Int32)."""
    asm(None, [i32(dst, loc, ip), i64(src, loc, ip), i32(nbytes, loc, ip), i32(mbar, loc, ip)],
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
        "r,l,r,r,~{memory}", loc, ip)


@dsl_user_op
def l2_policy(evict_last, *, loc=None, ip=None):
    """A `createpolicy` L2 cache policy for all of an access's lines: evict_last (Python True) or
    evict_first (False), as the Int64 operand of the `...L2::cache_hint` forms below."""
    kind = "evict_last" if evict_last else "evict_first"
    return cutlass.Int64(asm(T.i64(), [], f"createpolicy.fractional.L2::{kind}.b64 $0, 1.0;", "=l", loc, ip))


@dsl_user_op
def bulk_g2s_hint(dst, src, nbytes, mbar, policy, *, loc=None, ip=None):
    """`bulk_g2s` with an L2 cache policy (`l2_policy`)."""
    asm(None, [i32(dst, loc, ip), i64(src, loc, ip), i32(nbytes, loc, ip), i32(mbar, loc, ip), i64(policy, loc, ip)],
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [$0], [$1], $2, [$3], $4;",
        "r,l,r,r,l,~{memory}", loc, ip)


@dsl_user_op
def bulk_prefetch_l2(src, nbytes, policy, *, loc=None, ip=None):
    """`cp.async.bulk.prefetch.L2` of `nbytes` (a multiple of 16) at global address `src` (Int64) into L2
    under an L2 cache policy (`l2_policy`); nothing to wait for."""
    asm(None, [i64(src, loc, ip), i32(nbytes, loc, ip), i64(policy, loc, ip)],
        "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$0], $1, $2;", "l,r,l,~{memory}", loc, ip)


@dsl_user_op
def cp_async_16(dst, src, src_bytes, *, loc=None, ip=None):
    """cp.async of 16 bytes from global `src` (Int64) to shared `dst` (Int32), past L1; the bytes past
    `src_bytes` (0 or 16) are zero-filled, not read. Complete after `cp_async_wait_all`."""
    asm(None, [i32(dst, loc, ip), i64(src, loc, ip), i32(src_bytes, loc, ip)],
        "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}", loc, ip)


@dsl_user_op
def cp_async_wait_all(*, loc=None, ip=None):
    """Wait for this thread's cp.async copies (their data then visible to the thread; a CTA barrier
    after it shares them)."""
    asm(None, [], "cp.async.wait_all;", "~{memory}", loc, ip)


@dsl_user_op
def ld_global_v4f(addr, *, loc=None, ip=None):
    """16-byte global load past L1 (data the previous kernel wrote) -> 4 x Float32."""
    return v4f(i64(addr, loc, ip), "ld.global.cg.v4.f32 {$0, $1, $2, $3}, [$4];",
               "=f,=f,=f,=f,l,~{memory}", loc, ip)


@dsl_user_op
def st_shared_v4f(addr, v, *, loc=None, ip=None):
    """16-byte shared store of 4 x Float32 at shared address `addr` (Int32)."""
    asm(None, [i32(addr, loc, ip)] + [f32(x, loc, ip) for x in v],
        "st.shared.v4.f32 [$0], {$1, $2, $3, $4};", "r,f,f,f,f,~{memory}", loc, ip)


@dsl_user_op
def ld_shared_f32(addr, *, loc=None, ip=None):
    """4-byte shared load -> Float32."""
    return cutlass.Float32(asm(T.f32(), [i32(addr, loc, ip)], "ld.shared.f32 $0, [$1];", "=f,r,~{memory}", loc, ip))


@dsl_user_op
def ld_shared_v4f(addr, *, loc=None, ip=None):
    """16-byte shared load -> 4 x Float32."""
    return v4f(i32(addr, loc, ip), "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];",
               "=f,=f,=f,=f,r,~{memory}", loc, ip)


def _bf16x4(addr, load: str, cons: str, loc, ip):
    """Four bf16 (8 bytes) by the 2 x b32 load `load` at $4 -> 4 x Float32 (exact: the bf16 bits in the high half)."""
    return v4f(addr, "{\n .reg .b32 a, b;\n " + load + " {a, b}, [$4];\n shl.b32 $0, a, 16;\n"
               " and.b32 $1, a, 0xFFFF0000;\n shl.b32 $2, b, 16;\n and.b32 $3, b, 0xFFFF0000;\n}",
               "=f,=f,=f,=f," + cons + ",~{memory}", loc, ip)


@dsl_user_op
def ld_global_bf16x4(addr, *, loc=None, ip=None):
    """Four bf16 (8 bytes, global, past L1) -> 4 x Float32."""
    return _bf16x4(i64(addr, loc, ip), "ld.global.cg.v2.b32", "l", loc, ip)


@dsl_user_op
def ld_shared_bf16x4(addr, *, loc=None, ip=None):
    """Four bf16 (8 bytes, shared) -> 4 x Float32."""
    return _bf16x4(i32(addr, loc, ip), "ld.shared.v2.b32", "r", loc, ip)


@dsl_user_op
def ld_shared_bf16x8(addr, *, loc=None, ip=None):
    """Eight bf16 (16 bytes, shared) -> 8 x Float32 (exact)."""
    r = asm(ir.Type.parse("!llvm.struct<(f32,f32,f32,f32,f32,f32,f32,f32)>"), [i32(addr, loc, ip)],
            "{\n .reg .b32 a, b, c, d;\n ld.shared.v4.b32 {a, b, c, d}, [$8];\n shl.b32 $0, a, 16;\n"
            " and.b32 $1, a, 0xFFFF0000;\n shl.b32 $2, b, 16;\n and.b32 $3, b, 0xFFFF0000;\n shl.b32 $4, c, 16;\n"
            " and.b32 $5, c, 0xFFFF0000;\n shl.b32 $6, d, 16;\n and.b32 $7, d, 0xFFFF0000;\n}",
            "=f,=f,=f,=f,=f,=f,=f,=f,r,~{memory}", loc, ip)
    return [cutlass.Float32(llvm.extractvalue(T.f32(), r, [i])) for i in range(8)]


def _st_bf16x4(addr, v, store: str, cons: str, loc, ip):
    """Four Float32 rounded to bf16 (round to nearest even), stored as 2 x b32 by `store` at $0."""
    asm(None, [addr] + [f32(x, loc, ip) for x in v],
        "{\n .reg .b32 a, b;\n cvt.rn.bf16x2.f32 a, $2, $1;\n cvt.rn.bf16x2.f32 b, $4, $3;\n " + store
        + " [$0], {a, b};\n}", cons + ",f,f,f,f,~{memory}", loc, ip)


@dsl_user_op
def st_global_bf16x4(addr, v, *, loc=None, ip=None):
    """Four Float32 -> bf16 at global address `addr` (Int64, 8-byte aligned)."""
    _st_bf16x4(i64(addr, loc, ip), v, "st.global.v2.b32", "l", loc, ip)


@dsl_user_op
def st_shared_bf16x4(addr, v, *, loc=None, ip=None):
    """Four Float32 -> bf16 at shared address `addr` (Int32, 8-byte aligned)."""
    _st_bf16x4(i32(addr, loc, ip), v, "st.shared.v2.b32", "r", loc, ip)


@dsl_user_op
def ld_global_f32(addr, *, loc=None, ip=None):
    """4-byte global load past L1 (data another CTA of this kernel wrote) -> Float32."""
    return cutlass.Float32(asm(T.f32(), [i64(addr, loc, ip)], "ld.global.cg.f32 $0, [$1];", "=f,l,~{memory}", loc,
                               ip))


@dsl_user_op
def atomic_add_acq_rel(addr, v, *, loc=None, ip=None):
    """`atom.add.acq_rel.gpu` of Int32 `v` at global address `addr` (Int64): the old value. With a CTA
    barrier before it, it publishes the CTA's earlier stores to the thread that reads the last count."""
    return cutlass.Int32(asm(T.i32(), [i64(addr, loc, ip), i32(v, loc, ip)], "atom.add.acq_rel.gpu.s32 $0, [$1], $2;",
                             "=r,l,r,~{memory}", loc, ip))


@dsl_user_op
def ld_acquire_gpu_i32(addr, *, loc=None, ip=None):
    """`ld.acquire.gpu` of the Int32 at global address `addr` (Int64): a grid-wide counter's poll."""
    return cutlass.Int32(asm(T.i32(), [i64(addr, loc, ip)], "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l,~{memory}",
                             loc, ip))


@dsl_user_op
def ld_relaxed_gpu_i32(addr, *, loc=None, ip=None):
    """`ld.relaxed.gpu` of the Int32 at global address `addr` (Int64)."""
    return cutlass.Int32(asm(T.i32(), [i64(addr, loc, ip)], "ld.relaxed.gpu.global.b32 $0, [$1];", "=r,l,~{memory}",
                             loc, ip))


@dsl_user_op
def red_add_relaxed_gpu(addr, v, *, loc=None, ip=None):
    """`red.relaxed.gpu.add` of Int32 `v` at global address `addr` (Int64): no ordering, no result."""
    asm(None, [i64(addr, loc, ip), i32(v, loc, ip)], "red.relaxed.gpu.global.add.s32 [$0], $1;", "l,r,~{memory}", loc,
        ip)


@dsl_user_op
def st_global_relaxed_i32(addr, v, *, loc=None, ip=None):
    """`st.relaxed.gpu` of Int32 `v` at global address `addr` (Int64)."""
    asm(None, [i64(addr, loc, ip), i32(v, loc, ip)], "st.relaxed.gpu.global.s32 [$0], $1;", "l,r,~{memory}", loc, ip)


@dsl_user_op
def fence_proxy_async_shared(*, loc=None, ip=None):
    """Order this thread's generic-proxy shared memory accesses before its later bulk copies into them."""
    asm(None, [], "fence.proxy.async.shared::cta;", "~{memory}", loc, ip)


@dsl_user_op
def globaltimer(*, loc=None, ip=None):
    """The GPU's global nanosecond timer (%globaltimer, shared by every SM): for timelines of a kernel's
    CTAs (when each passed its PDL wait, when its bytes arrived)."""
    return cutlass.Int64(asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l", loc, ip))


@dsl_user_op
def smid(*, loc=None, ip=None):
    """The SM this thread runs on (%smid)."""
    return cutlass.Int32(asm(T.i32(), [], "mov.u32 $0, %smid;", "=r", loc, ip))
