"""Raw-address PTX helpers for the comms kernels (CuTeDSL inline asm).

The comms kernels address peer memory through the symmetric heap's pointer table, i.e. through
64-bit integers, so these helpers take an `Int64` address rather than a CuTe pointer. Memory
ordering follows the PTX memory model at system scope (peers are other GPUs): a producer's data
stores, `bar.sync`, then one thread's `st.release.sys` of the flag; the consumer's
`ld.acquire.sys` of the flag, then `bar.sync`, then plain loads of the data
(/work/shared/gpu/examples/sys_order.py verified that pattern on an H100).
"""
import cutlass
import cutlass.cute as cute
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from aot.ptx import asm, f32, i32, i64


def _struct(n, ty="i32"):
    return ir.Type.parse("!llvm.struct<(" + ",".join([ty] * n) + ")>")


def _unpack(res, n, ty):
    return [llvm.extractvalue(ty, res, [i]) for i in range(n)]


# ---------------------------------------------------------------------------- 16-byte data moves
@dsl_user_op
def ld_v4(addr, *, loc=None, ip=None):
    """16-byte load (L1-cached) -> 4 x Int32."""
    r = asm(_struct(4), [i64(addr, loc, ip)], "ld.global.v4.b32 {$0, $1, $2, $3}, [$4];",
            "=r,=r,=r,=r,l,~{memory}", loc, ip)
    return [cutlass.Int32(v) for v in _unpack(r, 4, T.i32())]


@dsl_user_op
def ld_v4_cg(addr, *, loc=None, ip=None):
    """16-byte load that bypasses L1 (data written by peers during this kernel)."""
    r = asm(_struct(4), [i64(addr, loc, ip)], "ld.global.cg.v4.b32 {$0, $1, $2, $3}, [$4];",
            "=r,=r,=r,=r,l,~{memory}", loc, ip)
    return [cutlass.Int32(v) for v in _unpack(r, 4, T.i32())]


@dsl_user_op
def ld_volatile_v4(addr, *, loc=None, ip=None):
    """16-byte volatile load (never served from L1): polls data that peers write (Lamport)."""
    r = asm(_struct(4), [i64(addr, loc, ip)], "ld.volatile.global.v4.b32 {$0, $1, $2, $3}, [$4];",
            "=r,=r,=r,=r,l,~{memory}", loc, ip)
    return [cutlass.Int32(v) for v in _unpack(r, 4, T.i32())]


@dsl_user_op
def canon_word(w, *, loc=None, ip=None) -> cutlass.Int32:
    """Replace the Lamport sentinel word 0xFFFFFFFF (a NaN in fp32 and in both bf16 halves) by
    another NaN (0x7FC07FC0), so data never looks like an empty slot; every other word passes."""
    return cutlass.Int32(asm(T.i32(), [i32(w, loc, ip)],
                             "{ .reg .pred p; setp.eq.s32 p, $1, -1; selp.b32 $0, 0x7FC07FC0, $1, p; }",
                             "=r,r", loc, ip))


@dsl_user_op
def st_v4(addr, v, *, loc=None, ip=None):
    """16-byte store of 4 x Int32 (local or peer address)."""
    asm(None, [i64(addr, loc, ip)] + [i32(x, loc, ip) for x in v],
        "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r,~{memory}", loc, ip)


# ---------------------------------------------------------------------------- flags and counters
@dsl_user_op
def ld_acquire_sys(addr, *, loc=None, ip=None) -> cutlass.Int32:
    return cutlass.Int32(asm(T.i32(), [i64(addr, loc, ip)], "ld.acquire.sys.global.b32 $0, [$1];",
                             "=r,l,~{memory}", loc, ip))


@dsl_user_op
def ld_relaxed_sys(addr, *, loc=None, ip=None) -> cutlass.Int32:
    return cutlass.Int32(asm(T.i32(), [i64(addr, loc, ip)], "ld.relaxed.sys.global.b32 $0, [$1];",
                             "=r,l,~{memory}", loc, ip))


@dsl_user_op
def ld_relaxed_gpu(addr, *, loc=None, ip=None) -> cutlass.Int32:
    return cutlass.Int32(asm(T.i32(), [i64(addr, loc, ip)], "ld.relaxed.gpu.global.b32 $0, [$1];",
                             "=r,l,~{memory}", loc, ip))


@dsl_user_op
def st_release_sys(addr, val, *, loc=None, ip=None) -> None:
    asm(None, [i64(addr, loc, ip), i32(val, loc, ip)], "st.release.sys.global.b32 [$0], $1;",
        "l,r,~{memory}", loc, ip)


@dsl_user_op
def st_release_gpu(addr, val, *, loc=None, ip=None) -> None:
    asm(None, [i64(addr, loc, ip), i32(val, loc, ip)], "st.release.gpu.global.b32 [$0], $1;",
        "l,r,~{memory}", loc, ip)


@dsl_user_op
def st_relaxed_gpu(addr, val, *, loc=None, ip=None) -> None:
    asm(None, [i64(addr, loc, ip), i32(val, loc, ip)], "st.relaxed.gpu.global.b32 [$0], $1;",
        "l,r,~{memory}", loc, ip)


@dsl_user_op
def atom_add_acq_rel_gpu(addr, val, *, loc=None, ip=None) -> cutlass.Int32:
    return cutlass.Int32(asm(T.i32(), [i64(addr, loc, ip), i32(val, loc, ip)],
                             "atom.acq_rel.gpu.global.add.u32 $0, [$1], $2;", "=r,l,r,~{memory}", loc, ip))


@dsl_user_op
def fence_acq_rel_sys(*, loc=None, ip=None) -> None:
    asm(None, [], "fence.acq_rel.sys;", "~{memory}", loc, ip)


@dsl_user_op
def nanosleep(ns: int, *, loc=None, ip=None) -> None:
    """Suspend the thread about `ns` nanoseconds (a poll's back-off: fewer loads on the memory system
    it waits on)."""
    asm(None, [], f"nanosleep.u32 {int(ns)};", "~{memory}", loc, ip)


@dsl_user_op
def globaltimer(*, loc=None, ip=None) -> cutlass.Int64:
    """Nanoseconds (the GPU's global timer): bounds every flag wait by wall time."""
    return cutlass.Int64(asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l", loc, ip))


# ---------------------------------------------------------------------------- conversions
@dsl_user_op
def bf16x2_to_f32(v, *, loc=None, ip=None):
    """Int32 holding two bf16 (low element first) -> (Float32 low, Float32 high)."""
    r = asm(_struct(2, "f32"), [i32(v, loc, ip)],
            "{ .reg .b32 t; shl.b32 t, $2, 16; mov.b32 $0, t; and.b32 t, $2, 0xffff0000; mov.b32 $1, t; }",
            "=f,=f,r", loc, ip)
    return [cutlass.Float32(x) for x in _unpack(r, 2, T.f32())]


@dsl_user_op
def f32_to_bf16x2(lo, hi, *, loc=None, ip=None) -> cutlass.Int32:
    """Round two Float32 to bf16 (nearest-even) and pack them, low element first."""
    return cutlass.Int32(asm(T.i32(), [f32(hi, loc, ip), f32(lo, loc, ip)],
                             "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", loc, ip))


@dsl_user_op
def i32_as_f32(v, *, loc=None, ip=None) -> cutlass.Float32:
    return cutlass.Float32(asm(T.f32(), [i32(v, loc, ip)], "mov.b32 $0, $1;", "=f,r", loc, ip))


@dsl_user_op
def f32_as_i32(v, *, loc=None, ip=None) -> cutlass.Int32:
    return cutlass.Int32(asm(T.i32(), [f32(v, loc, ip)], "mov.b32 $0, $1;", "=r,f", loc, ip))


@dsl_user_op
def rsqrt(v, *, loc=None, ip=None) -> cutlass.Float32:
    """1/sqrt(v), rounded (rsqrt.approx is off by up to 2 ulp; sqrt.rn + div.rn is exact-rounded)."""
    return cutlass.Float32(asm(T.f32(), [f32(v, loc, ip)],
                               "{ .reg .f32 t; sqrt.rn.f32 t, $1; rcp.rn.f32 $0, t; }", "=f,f", loc, ip))


@dsl_user_op
def shfl_bfly_f32(v, lane_mask, *, loc=None, ip=None) -> cutlass.Float32:
    return cutlass.Float32(asm(T.f32(), [f32(v, loc, ip), i32(lane_mask, loc, ip)],
                               "shfl.sync.bfly.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=f,f,r", loc, ip))


# ---------------------------------------------------------------------------- NVLink SHARP (multimem)
# Only reached through a multicast address, which exists only when the heap was created with
# enable_multicast=True on a device that reports multicast. Never launched on the shared test hosts.
@dsl_user_op
def multimem_ld_reduce_v4(addr, is_bf16: bool, *, loc=None, ip=None):
    """16-byte load-reduce (sum over every GPU bound to the multicast object) -> 4 x Int32."""
    op = ("multimem.ld_reduce.weak.global.add.acc::f32.v4.bf16x2" if is_bf16
          else "multimem.ld_reduce.weak.global.add.v4.f32")
    r = asm(_struct(4), [i64(addr, loc, ip)], op + " {$0, $1, $2, $3}, [$4];",
            "=r,=r,=r,=r,l,~{memory}", loc, ip)
    return [cutlass.Int32(v) for v in _unpack(r, 4, T.i32())]


@dsl_user_op
def multimem_st_v4(addr, v, *, loc=None, ip=None):
    """16-byte store broadcast to every GPU bound to the multicast object (bits, any dtype)."""
    asm(None, [i64(addr, loc, ip)] + [i32(x, loc, ip) for x in v],
        "multimem.st.weak.global.v4.f32 [$0], {$1, $2, $3, $4};",
        "l,r,r,r,r,~{memory}", loc, ip)


@cute.jit
def advance_epoch(my_base, state_off, tid, nb, target):
    """Grid-wide epoch hand-off: the last of `nb` blocks to arrive sets the state word at
    `my_base + state_off` to `target` (read by the next launch) and resets the ticket beside it."""
    cute.arch.sync_threads()
    if tid == 0:
        t = atom_add_acq_rel_gpu(my_base + state_off + 4, 1)
        if t == nb - 1:
            st_relaxed_gpu(my_base + state_off + 4, 0)
            st_relaxed_gpu(my_base + state_off, target)
