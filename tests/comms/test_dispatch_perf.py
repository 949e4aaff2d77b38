"""`python -m perf.comms dispatch` argument surface and the fused path's input checks (the
benchmark and the kernels themselves need >= 2 GPUs)."""
import argparse

import pytest
import torch

from perf.comms import dispatch as bench


def test_arguments_and_gpu_requirement():
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--tokens", "1,128", "--hidden", "4096", "--experts", "128", "--nprocs", "1"])
    assert bench._ints(args.tokens) == [1, 128] and args.topk == 8 and args.layout == "contiguous"
    if torch.cuda.device_count() < 2:
        with pytest.raises(RuntimeError, match="found 1"):
            bench.run(args)


def test_fused_path_rejects_unsupported_shapes_by_name():
    """The fused path's limits are checked before anything is allocated (no GPU needed)."""
    from types import SimpleNamespace

    from comms.dispatch_fused import FusedDispatch, heap_bytes

    cfg = dict(world=2, max_tokens=8, top_k=8, hidden=4096, num_local=64, dtype=torch.bfloat16, payload="bf16",
               pipeline_phases=1)
    for bad, msg in ((dict(hidden=1000), "hidden=1000"), (dict(top_k=3), "top_k=3"),
                     (dict(dtype=torch.float16), "dtype=torch.float16"), (dict(world=200), "world=200"),
                     (dict(pipeline_phases=9), "pipeline_phases=9"),
                     (dict(pipeline_phases=2, payload="mxfp8"), "bf16 only")):
        with pytest.raises(ValueError, match=msg):
            FusedDispatch(None, SimpleNamespace(**{**cfg, **bad}), timeout_s=1.0)
    # the size hint covers every region, rounded to 256 bytes each
    assert heap_bytes(2, 128, 8, 4096, 128) >= 2 * (2 * 128 * 4096 * 2)
    # mxfp8 stages H + H/32 bytes per row (the combine partials stay bf16)
    assert heap_bytes(2, 128, 8, 4096, 128, "mxfp8") >= 2 * 128 * (4096 + 128) + 2 * 128 * 4096 * 2


def test_blocks_and_phase_arguments():
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--blocks", "auto,16,132", "--phases", "--payload", "bf16,mxfp8", "--pipeline", "1,4"])
    assert bench._ints(args.pipeline) == [1, 4] and bench._ints(args.send_warps) == [2]
    assert bench._blocks(args.blocks) == [None, 16, 132] and args.phases
    assert bench._payloads(args.payload) == ["bf16", "mxfp8"]
    assert bench._overlaps(args.overlap) == [None] and bench._overlaps("auto,0,1") == [None, False, True]
    with pytest.raises(ValueError, match="'2'"):
        bench._overlaps("0,2")
    assert bench._pdls(args.pdl) == ["auto"] and bench._pdls("none,dispatch,combine") == ["none", "dispatch", "combine"]
    with pytest.raises(ValueError, match="'all'"):
        bench._pdls("auto,all")
    with pytest.raises(ValueError, match="'0'"):
        bench._blocks("0")
    with pytest.raises(ValueError, match="'fp4'"):
        bench._payloads("bf16,fp4")
    line = bench._phase_line(8, "auto(16)", {"dispatch": [("start", 0.5), ("exit", 9.25)],
                                             "combine": [("start", 0.25), ("exit", 8.0)]})
    assert line == "#   phases T=8 blocks=auto(16): dispatch: start 0.5 exit 9.2 | combine: start 0.2 exit 8.0"


def test_pdl_choice_per_kernel():
    """set_pdl overrides DISPATCH_PDL / COMBINE_PDL per kernel and names a bad value; without a CUDA
    device nothing launches with PDL whatever is asked."""
    from comms import dispatch_fused as fd

    f = fd.FusedDispatch.__new__(fd.FusedDispatch)
    f.device, f.pdl = torch.device("cpu"), (None, None)
    f.set_pdl(True, False)
    assert f.pdl == (True, False) and (f._pdl(0), f._pdl(1)) == (0, 0)
    with pytest.raises(ValueError, match="pdl=1"):
        f.set_pdl(1, None)
