"""The CuTeDSL kernels compile for their targets on a CPU-only machine (no GPU needed)."""
import importlib

import pytest

cute = pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl is not installed")

from moe.kernels import EXPORTS  # noqa: E402


def test_sm90_grouped_gemm_compiles():
    mod = importlib.import_module("moe.kernels.sm90_grouped_gemm")
    fns = mod.compile_for_export("sm_90a")
    assert sorted(fns) == sorted(mod.VARIANTS)
    assert {"grouped_gemm_fp8_contig", "grouped_gemm_fp8_masked_swapab", "grouped_gemm_bf16_contig"} <= set(fns)
    with pytest.raises(ValueError, match="sm_100a"):
        mod.compile_for_export("sm_100a")


def test_exports_listed():
    assert "moe.kernels.sm90_grouped_gemm" in EXPORTS
    for name in EXPORTS:
        assert callable(importlib.import_module(name).compile_for_export)
