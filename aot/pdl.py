"""Programmatic dependent launch (PDL) for the Triton kernels of `nvl72` and `moe` (the switch:
`aot.launch.pdl_enabled`).

A decode step is a chain of kernels of a few microseconds each, where the gap between dependent
kernels (launch, block scheduling, the first loads) costs about as much as the work. With PDL
(sm_90+) a kernel launched with Triton's `launch_pdl=True` may start while the previous kernel in
the stream drains: it loads what the previous kernels cannot change (weights) and then waits in
`gdc_wait()`, PTX `griddepcontrol.wait`, which returns once the prerequisite grids have COMPLETED
and their memory operations are visible. Right after the wait it lets its own successor launch
(`gdc_launch_dependents()`): the successor still waits for this grid's completion, so that is
always safe, and launching only after the wait keeps at most one waiting grid beside a running
one. CUDA-graph capture keeps these programmatic edges, which is where this pays.

The rules for a kernel with `PDL: tl.constexpr` (see `wait_prior`): no store before
`wait_prior(PDL)`, and no load there of data the previous kernel in the stream writes. Weights may
be read before it (a weight made on first use, e.g. the packed q/k/v of `layers.Attention.packed_qkv`,
is written by the kernel just before on that first call, which may then read it early: in the
engine that call is a CUDA-graph warm-up forward, whose output is dropped). So may data written
before the previous kernel started, where that kernel follows these rules or was launched plainly
(it lets this kernel start only after its own wait or its end, when every kernel before it has
completed): the step's staging copy, the routing under the experts, earlier steps' K/V (paged
attention and `down(early=True)` read them early). `launch_args` sets the constexpr and the launch
option together, so a kernel is never launched early without waiting. Shared by `nvl72`
and `moe` (both may import `aot`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from aot.launch import pdl_enabled


def launch_args(device: torch.device) -> dict:
    """Keyword arguments of a launch of a kernel with a `PDL` constexpr: the constexpr and Triton's
    `launch_pdl` option, always equal (a kernel launched early must wait)."""
    on = pdl_enabled(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """With PDL: wait for the previous grids to complete (their writes visible), then let the next
    kernel launch. Nothing without PDL (the interpreter never sees the gdc calls)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
