"""Grid-wide barriers for Triton kernels whose programs are all resident at once, and the host check
that they are. Shared by `nvl72` (the one-kernel decode layer) and `moe` (the one-token MoE kernel).

A barrier is an arrival counter in global memory (int32, zero between launches) followed by an
error flag. It only opens if every program of the grid is resident: `programs_per_sm` says how
many programs of a compiled variant an SM holds, and a kernel using the barrier launches no more
than that times the SMs. It never waits forever: after SPIN_LIMIT polls a program goes on and sets
the flag (a wrong result the caller can detect, not a GPU hung until reset).
"""
from __future__ import annotations

import triton
import triton.language as tl

SPIN_LIMIT = tl.constexpr(1 << 24)  # polls of a grid barrier before giving up (seconds; a barrier takes us)


@triton.jit
def grid_sync(bar, target):
    """Arrive at the barrier `bar` and wait until `target` arrivals: all programs' earlier stores are
    visible to this program's later loads (release add, acquire polls). On timeout the program goes
    on and sets the error flag at bar + 1."""
    tl.debug_barrier()
    cur = tl.atomic_add(bar, 1, sem="acq_rel", scope="gpu") + 1
    polls = 0
    while (cur < target) & (polls < SPIN_LIMIT):
        cur = tl.atomic_add(bar, 0, sem="acquire", scope="gpu")
        polls += 1
    if cur < target:
        tl.atomic_xchg(bar + 1, 1)
    tl.debug_barrier()


@triton.jit
def grid_leave(bar, total):
    """The launch's last arrival at `bar` (the `total`-th: barriers' arrivals plus this one per
    program) resets the counter for the next launch, which the stream orders after this one."""
    if tl.atomic_add(bar, 1, sem="acq_rel", scope="gpu") == total - 1:
        tl.atomic_xchg(bar, 0)


def programs_per_sm(kernel, num_warps: int, props) -> int:
    """How many programs of a compiled Triton kernel (`kernel._init_handles()` done: n_regs) one SM
    of a device (`torch.cuda.get_device_properties`) holds at once: registers (allocated per warp,
    256 at a time), threads, shared memory, and the 32-block limit."""
    warp_regs = -(-kernel.n_regs * 32 // 256) * 256
    return min(getattr(props, "regs_per_multiprocessor", 65536) // (warp_regs * num_warps),
               props.max_threads_per_multi_processor // (32 * num_warps),
               getattr(props, "shared_memory_per_multiprocessor", 233472) // (kernel.metadata.shared + 1024), 32)
