"""The layer-stream measurement kernel (nvl72.kernels.sm90_layer_stream) refuses what it cannot hold and
sm_100a, and its GPU bench (tests/runner/gpu_layer_stream_bench.py,
which runs where CuTeDSL is absent) agrees with it on the layout constants."""
import importlib
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_layer_stream_matches_its_bench():
    """(tests/comms/test_aot.py compiles every variant into a bundle.)"""
    pytest.importorskip("cutlass.cute")
    mod = importlib.import_module("nvl72.kernels.sm90_layer_stream")
    bench = importlib.import_module("tests.runner.gpu_layer_stream_bench")
    assert (bench.PAGE, bench.BARRIERS, bench.TRACE) == (mod.PAGE, mod.BARRIERS, mod.TRACE)
    assert set(bench.SPLITS) <= set(mod.VARIANTS)
    with pytest.raises(ValueError, match="sm_100a"):
        mod.compile_for_export("sm_100a")
    for bad in ((0, 4), (8, 0), (12, 3)):  # an empty ring; 240 KB of pages
        with pytest.raises(ValueError, match="pages_a="):
            mod.LayerStream(*bad)
    with pytest.raises(ValueError, match="inflight=4"):  # ring B's 4 slots: page n - 4's may be reused
        mod.LayerStream(8, 4, inflight=4)
