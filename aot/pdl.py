"""Programmatic dependent launch (PDL) for the Triton kernels of `nvl72` and `moe`: one switch.

A decode step is a chain of kernels of a few microseconds each, where the gap between dependent
kernels (launch, block scheduling, the first loads) costs about as much as the work. With PDL
(sm_90+) a kernel launched with Triton's `launch_pdl=True` may start while the previous kernel in
the stream drains: it loads what the previous kernels cannot change (weights) and then waits in
`gdc_wait()`, PTX `griddepcontrol.wait`, which returns once the prerequisite grids have COMPLETED
and their memory operations are visible. Right after the wait it lets its own successor launch
(`gdc_launch_dependents()`): the successor still waits for this grid's completion, so that is
always safe, and launching only after the wait keeps at most one waiting grid beside a running
one. CUDA-graph capture keeps these programmatic edges, which is where this pays.

The rules for a kernel with `PDL: tl.constexpr` (see `wait_prior`): no store and no load of data
written by an earlier kernel before `wait_prior(PDL)`; only weights may be read before it (a
weight made on first use, e.g. the packed q/k/v of `layers.Attention._qkv`, is written by the
kernel just before on that first call, which may then read it early: in the engine that call is
a CUDA-graph warm-up forward, whose output is dropped). `launch_args` sets the constexpr and the
launch option together, so a kernel is never launched early without waiting. Shared by `nvl72`
and `moe` (both may import `aot`).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENV = "NVL72_PDL"  # "0": launch every Triton kernel plainly; "1" (default): PDL where `enabled`

_SM90: dict[int, bool] = {}  # device index -> capability >= 9.0


def enabled(device: torch.device) -> bool:
    """Whether a Triton kernel launched now on `device` uses PDL: a CUDA device of sm_90 or newer,
    not switched off by $NVL72_PDL=0, not under Triton's CPU interpreter (TRITON_INTERPRET=1, which
    has no grid dependency control), and a real stream: never the legacy default stream, whose
    implicit synchronisation PDL is not defined against (graph capture never runs on it)."""
    flag = os.environ.get(ENV, "1")
    if flag not in ("0", "1"):
        raise ValueError(f"${ENV}={flag!r}: expected 0 or 1")
    if device.type != "cuda" or flag == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    sm90 = _SM90.get(idx)
    if sm90 is None:
        sm90 = _SM90[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return sm90 and torch._C._cuda_getCurrentRawStream(idx) != 0


def launch_args(device: torch.device) -> dict:
    """Keyword arguments of a launch of a kernel with a `PDL` constexpr: the constexpr and Triton's
    `launch_pdl` option, always equal (a kernel launched early must wait)."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """With PDL: wait for the previous grids to complete (their writes visible), then let the next
    kernel launch. Nothing without PDL (the interpreter never sees the gdc calls)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
