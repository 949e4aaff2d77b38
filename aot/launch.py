"""When a kernel may use programmatic dependent launch (PDL): the one policy of every package.

Triton-free, so the CuTeDSL hosts (comms, moe's grouped GEMMs) import it as well as `aot.pdl`,
which adds the Triton side (the `PDL` constexpr and `launch_pdl`).
"""
from __future__ import annotations

import os

import torch

ENV = "NVL72_PDL"  # "0": launch every kernel of the decode chain plainly; "1" (default): PDL where `pdl_enabled`

_SM90: dict[int, bool] = {}  # device index -> capability >= 9.0


def stream_allows_pdl(device: torch.device) -> bool:
    """A launch on `device` now is on a real stream (graph capture and side streams), not the legacy
    default stream, whose implicit synchronisation PDL is not defined against."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return torch._C._cuda_getCurrentRawStream(idx) != 0


def pdl_enabled(device: torch.device) -> bool:
    """Whether a decode-chain kernel (Triton, the MoE grouped GEMMs) launched now on `device` uses
    PDL: a CUDA device of sm_90 or newer, not switched off by $NVL72_PDL=0, not under Triton's CPU
    interpreter (TRITON_INTERPRET=1, which has no grid dependency control), and `stream_allows_pdl`."""
    flag = os.environ.get(ENV, "1")
    if flag not in ("0", "1"):
        raise ValueError(f"${ENV}={flag!r}: expected 0 or 1")
    if device.type != "cuda" or flag == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    sm90 = _SM90.get(idx)
    if sm90 is None:
        sm90 = _SM90[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return sm90 and stream_allows_pdl(device)
