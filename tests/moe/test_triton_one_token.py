"""The one-token MoE kernel (moe.kernels.triton_one_token) against the fp32 reference on the dequantized
FP8 weights and against the two-kernel path, its support rules and the backend op's choice. On a GPU
(one launch with the grid barrier) or through Triton's CPU interpreter (two launches, no barrier)."""
import logging

import pytest
import torch

from tests.moe.test_triton_fused_decode import DEV, _case, _rel, _want
from tests.runner.ptx import COMPILES, compile_pdl

ot = pytest.importorskip("moe.kernels.triton_one_token")
fd = pytest.importorskip("moe.kernels.triton_fused_decode")


@pytest.mark.parametrize("k,e,num_local,offset,h,inter", [
    (8, 16, 16, 0, 256, 256),  # one chunk: no combine
    (4, 16, 8, 8, 256, 512),  # other ranks' experts, two chunks
    (6, 12, 4, 4, 384, 768),  # KP 8 > k, three chunks (NCHP 4), H not a power of two
])
def test_one_token_matches_fp32_reference(k, e, num_local, offset, h, inter):
    c = _case(1, k, e, num_local, offset, h, inter, seed=k + h + inter)
    out = torch.full((1, h), float("nan"), dtype=torch.bfloat16, device=DEV)
    got = ot.one_token(c.x, c.tw, c.ids, *c.w, offset, out=out)
    assert got is out and torch.isfinite(got).all()
    assert _rel(got, _want(c.x, c.tw, c.ids, c.d13, c.d2, offset)) < 1e-2
    two = fd.fused_decode(c.x, c.tw, c.ids, *c.w, offset)
    assert _rel(got, two) < 2e-3  # the same fp32 arithmetic, summed in another order
    assert not ot._barrier(c.x.device, h // ot.BLOCK_N2).any()  # the combine counters are reset


def test_duplicate_and_remote_slots():
    """A local expert in two slots counts twice; a token whose experts are all remote gets zeros."""
    c = _case(1, 4, 8, 4, 4, 256, 256, seed=3)
    c.ids[0] = torch.tensor([5, 5, 1, 6])
    got = ot.one_token(c.x, c.tw, c.ids, *c.w, 4)
    assert _rel(got, _want(c.x, c.tw, c.ids, c.d13, c.d2, 4)) < 1e-2
    c.ids[0] = torch.tensor([0, 1, 2, 3])
    assert not ot.one_token(c.x, c.tw, c.ids, *c.w, 4).any()


def test_supported_names_why_not():
    c = _case(2, 4, 8, 8, 0, 256, 256, seed=1)
    args = (c.w[0], c.w[1], c.w[2], c.w[3])
    assert ot.supported(c.x[:1], c.ids[:1], *args) is None
    assert ot.supported(c.x, c.ids, *args) == "2 tokens"
    assert "shared expert" in ot.supported(c.x[:1], c.ids[:1], *args, shared=c.x[:1])
    d = _case(1, 2, 4, 4, 0, 256, 384, seed=2)
    assert "I=384" in ot.supported(d.x, d.ids, *d.w)
    with pytest.raises(ValueError, match="triton_one_token: 2 tokens"):
        ot.one_token(c.x, c.tw, c.ids, *args)


def test_backend_op_chooses_and_logs(monkeypatch, caplog):
    """The backend's op with $NVL72_MOE_ONE_KERNEL=1: one kernel at one token, two kernels with a
    shared expert, more tokens or the switch at 0, each choice logged once; a bad value is named."""
    calls = []
    monkeypatch.setattr(ot, "one_token", lambda *a, **kw: calls.append("one") or fd.fused_decode(*a[:8]))
    monkeypatch.setattr(ot, "two_kernels", lambda *a, **kw: calls.append("two") or fd.fused_decode(*a))
    monkeypatch.setattr(ot, "_LOGGED", set())
    monkeypatch.setenv(ot.ENV, "1")
    c = _case(2, 4, 8, 8, 0, 256, 256, seed=5)
    shared = torch.randn(1, 256, generator=c.gen).to(torch.bfloat16).to(DEV)
    gate = torch.randn(1, 1, generator=c.gen).to(torch.bfloat16).to(DEV)
    with caplog.at_level(logging.INFO, logger=ot.__name__):
        ot.fused_decode(c.x[:1], c.tw[:1], c.ids[:1], *c.w)
        ot.fused_decode(c.x[:1], c.tw[:1], c.ids[:1], *c.w)
        ot.fused_decode(c.x[:1], c.tw[:1], c.ids[:1], *c.w, 0, shared, gate)
        ot.fused_decode(c.x, c.tw, c.ids, *c.w)
        monkeypatch.setenv(ot.ENV, "0")
        ot.fused_decode(c.x[:1], c.tw[:1], c.ids[:1], *c.w)
    assert calls == ["one", "one", "two", "two", "two"]
    assert caplog.text.count("one kernel (gate/up, grid barrier, down)") == 1
    assert "two kernels (a shared expert" in caplog.text and "two kernels (2 tokens)" in caplog.text
    monkeypatch.setenv(ot.ENV, "yes")
    with pytest.raises(ValueError, match="NVL72_MOE_ONE_KERNEL='yes'"):
        ot.fused_decode(c.x[:1], c.tw[:1], c.ids[:1], *c.w)


@COMPILES
def test_kernel_compiles_for_hopper():
    """Phase 0 at the Qwen3-30B-A3B shape lowers for sm_90 with PDL, nothing read before the wait,
    held to MAX_REGS registers (three programs of 8 warps per SM)."""
    const = {"K": 8, "KP": 8, "BLOCK_N": ot.BLOCK_N, "BLOCK_K": ot.BLOCK_K, "BLOCK_N2": ot.BLOCK_N2,
             "CHUNK": ot.CHUNK, "NCH": 3, "NCHP": 4, "PREFETCH": True, "PHASE": 0}
    sig = {"x_ptr": "*bf16", "ids_ptr": "*i64", "tw_ptr": "*fp32", "w13_ptr": "*fp8e4nv", "s13_ptr": "*fp32",
           "w2_ptr": "*fp8e4nv", "s2_ptr": "*fp32", "act_ptr": "*fp32", "part_ptr": "*fp32", "out_ptr": "*bf16",
           "bar_ptr": "*i32",
           "H": "i32", "I": "i32", "num_local": "i32", "expert_offset": "i32"}
    ptx = compile_pdl(ot._one_token_kernel, sig, const, True, options={"num_warps": ot.NUM_WARPS,
                                                                          "maxnreg": ot.MAX_REGS})
    assert "ld.global" not in ptx[:ptx.index("griddepcontrol.wait")]
    assert f".maxnreg {ot.MAX_REGS}" in ptx and "atom.global" in ptx and "prefetch.global.L1" in ptx


@pytest.mark.gpu
def test_gpu_one_launch_equals_phases_in_a_graph():
    """On the GPU at the Qwen3-30B-A3B expert shape (16 of its experts): one launch with the barrier
    equals two launches without it bit for bit, matches the fp32 reference, replays in a CUDA graph,
    and leaves the barrier at zero with no timeout flag."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("sm_90+")
    c = _case(1, 8, 16, 16, 0, 2048, 768, seed=11)
    assert ot.supported(c.x, c.ids, *c.w) is None
    one = ot.one_token(c.x, c.tw, c.ids, *c.w, 0, phases=False)
    two = ot.one_token(c.x, c.tw, c.ids, *c.w, 0, phases=True)
    torch.cuda.synchronize()
    assert torch.equal(one, two)
    assert _rel(one, _want(c.x, c.tw, c.ids, c.d13, c.d2, 0)) < 1e-2
    side = torch.cuda.Stream()  # PDL needs a real stream, as in capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ot.one_token(c.x, c.tw, c.ids, *c.w, 0)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        replay = ot.one_token(c.x, c.tw, c.ids, *c.w, 0)
    for _ in range(3):
        replay.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(replay, one)
    ot.check_errors()
    assert not ot._barrier(c.x.device, 2048 // ot.BLOCK_N2).any()
