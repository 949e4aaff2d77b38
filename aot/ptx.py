"""Inline PTX for the CuTeDSL kernels of `comms`, `moe` and `nvl72` (all may import `aot`): the asm builder
and value converters their raw-address helpers share. Imports CuTeDSL, so only kernel modules
(compiled where CuTeDSL is installed, never imported on a GPU host) import it."""
import cutlass
from cutlass._mlir.dialects import llvm


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
