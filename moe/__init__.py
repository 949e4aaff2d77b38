"""moe: MXFP8, grouped GEMM, routing and the MoE layer's compute (a library: never imports nvl72)."""
from moe.layer import MoE, SharedExpert

__all__ = ["MoE", "SharedExpert"]
