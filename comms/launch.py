"""Launch policy shared by the host sides of the comms kernels."""
from __future__ import annotations

import torch


def pdl_allowed(device: torch.device) -> bool:
    """Whether a kernel launched now on `device` may use programmatic dependent launch: only on a
    real stream (graph capture and side streams), never on the legacy default stream, whose
    implicit synchronisation PDL is not defined against."""
    return torch.cuda.current_stream(device).cuda_stream != 0
