"""CuTeDSL pieces of the one-token row kernels (moe.kernels.sm90_one_token's expert kernels,
nvl72.kernels.sm90_gemv's projections): each CTA bulk-copies its weight rows into shared memory,
stages one fp32 vector beside them and sums rows in warps. Imports CuTeDSL (kernel modules only)."""
import cutlass
import cutlass.cute as cute


def shared_storage_type(weight_bytes: int, vec: int, scales: int):
    """A row kernel's shared memory: the mbarrier of the bulk copies, the CTA's weight rows, the
    staged fp32 vector (gate/up's x, down's act, a GEMV's x) and `scales` fp32 (the rows' block
    scales; the GEMV's warp partial sums). (The struct needs its annotations evaluated: this module
    has no `from __future__ import annotations`.)"""
    @cute.struct
    class SharedStorage:
        bar: cute.struct.MemRange[cutlass.Int64, 1]
        w: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, weight_bytes], 128]
        v: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, vec], 128]
        sc: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, scales], 16]

    return SharedStorage


@cute.jit
def allocate_with_bar(storage_type, tidx):
    """A shared-memory struct whose field `bar` is the weight rows' mbarrier, allocated, the mbarrier
    initialised for one arrival and visible to the CTA."""
    storage = cutlass.utils.SmemAllocator().allocate(storage_type)
    if tidx == 0:
        cute.arch.mbarrier_init(storage.bar.data_ptr(), 1)
        cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()
    return storage


@cute.jit
def shared_views(storage_type, scales: cutlass.Constexpr, tidx):
    """A `shared_storage_type` allocated (`allocate_with_bar`): (the mbarrier; the weight rows' and the
    vector's shared addresses; the block scales as a tensor of `scales`)."""
    storage = allocate_with_bar(storage_type, tidx)
    return storage.bar.data_ptr(), storage.w.data_ptr().toint(), storage.v.data_ptr().toint(), storage.sc.get_tensor(
        cute.make_layout(scales))


def lanes_reduce(v, lanes: int, op):
    """`v` reduced by `op` over each aligned group of `lanes` lanes (a power of 2; butterfly shuffles:
    every lane of the group gets the result)."""
    off = lanes // 2
    while off:
        v = op(v, cute.arch.shuffle_sync_bfly(v, offset=off))
        off //= 2
    return v


def bf16_round(v):
    """fp32 `v` rounded to bf16 and back (one torch op in bf16)."""
    return v.to(cutlass.BFloat16).to(cutlass.Float32)


def warp_sum(v):
    """`v` summed over the warp's 32 lanes (butterfly shuffles: every lane gets the sum)."""
    return lanes_reduce(v, 32, lambda a, b: a + b)
