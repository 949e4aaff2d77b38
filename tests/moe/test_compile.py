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


def test_sm90_ws_grouped_gemm_compiles():
    mod = importlib.import_module("moe.kernels.sm90_grouped_gemm_ws")
    fns = mod.compile_for_export("sm_90a")
    assert sorted(fns) == sorted(mod.VARIANTS) and all(name.startswith("ws_") for name in fns)
    assert {"ws_fp8_contig", "ws_fp8_masked_swapab"} <= set(fns)
    with pytest.raises(ValueError, match="sm_100a"):
        mod.compile_for_export("sm_100a")
    with pytest.raises(ValueError, match="tile_n=64"):
        mod.GroupedGemmSm90WS(masked=False, tile_n=64)
    assert {"ws_fp8_masked_swapab_cp", "ws_fp8_masked_swapab_m64n32_cp"} <= set(fns)
    with pytest.raises(ValueError, match="compact=True"):
        mod.GroupedGemmSm90WS(masked=False, compact=True)
    with pytest.raises(ValueError, match="prefetch=True needs"):
        mod.GroupedGemmSm90WS(masked=True, tile_n=32, compact=True, overlap=True, prefetch=True)
    assert "ws_fp8_contig_pingpong" in fns
    with pytest.raises(ValueError, match="masked=True"):
        mod.GroupedGemmSm90WSPingPong(masked=True)
    assert {"ws_fp8_contig_n256_e4", "ws_fp8_contig_n256_mc", "ws_fp8_contig_n256_mc_e2", "ws_fp8_contig_n256_sp",
            "ws_fp8_contig_n256_mc_e2_sp"} <= set(fns)
    assert {"ws_fp8_masked_swapab_cpo_kg2", "ws_fp8_masked_swapab_cpo_kg4"} <= set(fns)
    with pytest.raises(ValueError, match="masked=True"):
        mod.GroupedGemmSm90WSCluster(masked=True)
    with pytest.raises(ValueError, match="k_group=3"):
        mod.GroupedGemmSm90WS(masked=True, tile_n=32, k_group=3)


def test_ws_contig_variants_listed_for_the_backend():
    """Every contiguous ws export is timed (perf.moe) and tested on GPU through Sm90Gemm.WS_CONTIG."""
    from moe.backend import Sm90Gemm

    mod = importlib.import_module("moe.kernels.sm90_grouped_gemm_ws")
    contig = sorted(name for name, kw in mod.VARIANTS.items() if not kw["masked"])
    assert sorted(Sm90Gemm.WS_CONTIG) == contig and "ws_fp8_contig_pingpong" in contig


def test_cluster_variants_listed_for_the_backend():
    """Sm90Gemm passes the cluster count to exactly the cluster exports, with their launch shape."""
    from moe.backend import Sm90Gemm

    mod = importlib.import_module("moe.kernels.sm90_grouped_gemm_ws")
    shapes = {}
    for name, kw in mod.VARIANTS.items():
        kw = dict(kw)
        cls = kw.pop("cls", mod.GroupedGemmSm90WS)
        if issubclass(cls, mod.GroupedGemmSm90WSCluster):
            k = cls(**kw)
            shapes[name] = (k.cluster, k.threads)
    assert shapes == Sm90Gemm.CLUSTERED and shapes["ws_fp8_contig_n256_mc"] == shapes["ws_fp8_contig_n256_mc_e2"] == (2, 384)


def test_scale_prefetch_row_slots():
    """prefetch_scales (_n256_sp) keeps one A-row scale per distinct row of a thread's accumulator
    fragment: two rows (r, r + 8) of the 64 x 128 wgmma slice, read from the fragment's static layout."""
    mod = importlib.import_module("moe.kernels.sm90_grouped_gemm_ws")
    k = mod.GroupedGemmSm90WSPingPong(ordered=False, prefetch_scales=True)
    seen = {}

    @cute.jit
    def probe():
        k._setup()
        tCcC = k.tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor((k.tile_m, k.tile_n)))
        reps, slot = k._row_slots(tCcC)
        seen["rows"] = [cute.get(tCcC.layout(i), mode=[0]) for i in reps]
        seen["slot"] = slot
        seen["want"] = [[cute.get(tCcC.layout(i), mode=[0]) for i in range(cute.size(tCcC))]]

    cute.compile(probe, options="--gpu-arch sm_90a")
    assert seen["rows"] == [0, 8] and len(seen["slot"]) == 64
    assert [seen["rows"][s] for s in seen["slot"]] == seen["want"][0]


def test_sm100_mxfp8_grouped_gemm_compiles():
    mod = importlib.import_module("moe.kernels.sm100_grouped_gemm")
    fns = mod.compile_for_export("sm_100a")
    assert sorted(fns) == ["mxfp8_grouped_gemm_contig", "mxfp8_grouped_gemm_masked"]
    with pytest.raises(ValueError, match="sm_90a"):
        mod.compile_for_export("sm_90a")


def test_sm90_one_token_compiles(tmp_path):
    """The one-token gate/up (also its timeline form) and down link into a bundle module."""
    from aot import build

    from moe import fused_decode
    from tests.moe import gpu_gate_up_timeline

    mod = importlib.import_module("moe.kernels.sm90_one_token")
    assert (fused_decode.ROWS, fused_decode.GU_ROWS) == (mod.ROWS, mod.GU_ROWS)  # the host side's copies
    assert (gpu_gate_up_timeline.FIELDS, gpu_gate_up_timeline.CTAS) == (mod.TIMELINE_FIELDS, 8 * 768 // mod.GU_ROWS)
    names = sorted({**mod.DOWN_VARIANTS, **mod.GATE_UP_VARIANTS, **mod.TIMELINE_VARIANTS})
    assert sorted(mod.compile_for_export("sm_90a")) == names
    with pytest.raises(ValueError, match="sm_100a"):
        mod.compile_for_export("sm_100a")
    with pytest.raises(ValueError, match="I=200"):
        mod.DownOneToken(8, 200)
    with pytest.raises(ValueError, match="H=1000"):
        mod.GateUpOneToken(1000)
    for bad in (lambda: mod.DownOneToken(64, 768), lambda: mod.DownOneToken(8, 768, rows_per_warp=3),
                lambda: mod.GateUpOneToken(32768), lambda: mod.GateUpOneToken(2048, rows_per_warp=3)):
        with pytest.raises(ValueError, match="rows_per_warp="):  # too many block scales, rows not split evenly
            bad()
    assert sorted(build.compile_module("moe.kernels.sm90_one_token", "sm_90a", str(tmp_path))) == names
    assert (tmp_path / "moe.kernels.sm90_one_token.so").stat().st_size > 10_000


def test_exports_listed():
    assert EXPORTS == ["moe.kernels.sm90_grouped_gemm", "moe.kernels.sm90_grouped_gemm_ws",
                       "moe.kernels.sm100_grouped_gemm", "moe.kernels.sm90_one_token"]
    for name in EXPORTS:
        mod = importlib.import_module(name)
        assert callable(mod.compile_for_export) and mod.ARCHS
