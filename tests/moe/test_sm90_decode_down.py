"""The sm90 backend's one-token decode op (moe.fused_decode): which `down` it runs, the argument contract
of the CuTeDSL export (checked on CPU against a torch stand-in with the same signature), and on a
Hopper GPU the compiled kernel against the fp32 reference and Triton's down."""
import logging
from types import SimpleNamespace

import pytest
import torch

from moe import fused_decode
from tests.moe.test_triton_fused_decode import DEV, _case, _rel, _want

tfd = pytest.importorskip("moe.kernels.triton_fused_decode")


def _torch_down(act, ids, tw, w2, s2, out, offset, num_local, h, pdl, *, inter, calls):
    """The export's semantics in torch (flat views as FusedDecode passes them)."""
    calls.append(pdl)
    k = ids.numel()
    a = act.view(k, inter)
    w = w2.view(torch.float8_e4m3fn).view(num_local, h, inter).float()
    s = s2.view(num_local, h // 128, inter // 128).repeat_interleave(128, 1).repeat_interleave(128, 2)
    y = torch.zeros(h, device=act.device)
    for j in range(k):
        e = int(ids[j]) - offset
        if 0 <= e < num_local:
            y += tw[j] * ((w[e] * s[e]) @ a[j])
    out.copy_(y.to(out.dtype))


def _op(inter, calls, variants=("down_k4_i256",)):
    mod = SimpleNamespace(**{n: (lambda *a, **kw: _torch_down(*a, inter=inter, calls=calls)) for n in variants})
    return fused_decode.FusedDecode(mod)


def test_one_token_runs_the_export_with_its_contract(monkeypatch, caplog):
    """One token: gate/up then the export (whose torch stand-in reproduces the fp32 reference, so the
    flat views, offset and counts are what the kernel documents); two tokens, a shared expert,
    a missing variant or the switch at 0: Triton's down. Each choice logged once."""
    monkeypatch.delenv(fused_decode.ENV, raising=False)
    c = _case(2, 4, 16, 8, 8, 256, 256, seed=3)
    calls = []
    op = _op(256, calls)
    with caplog.at_level(logging.INFO, logger="moe.backend"):
        out = torch.full((1, 256), float("nan"), dtype=torch.bfloat16, device=DEV)
        got = op(c.x[:1], c.tw[:1], c.ids[:1], *c.w, 8, out=out)
        assert got is out and calls == [0]
        assert _rel(got, _want(c.x[:1], c.tw[:1], c.ids[:1], c.d13, c.d2, 8)) < 1e-2
        op(c.x[:1], c.tw[:1], c.ids[:1], *c.w, 8)
        two = op(c.x, c.tw, c.ids, *c.w, 8)
        assert calls == [0, 0] and _rel(two, _want(c.x, c.tw, c.ids, c.d13, c.d2, 8)) < 1e-2
        sh = torch.randn(1, 256, generator=c.gen).to(torch.bfloat16).to(DEV)
        g = torch.randn(1, 1, generator=c.gen).to(torch.bfloat16).to(DEV)
        op(c.x[:1], c.tw[:1], c.ids[:1], *c.w, 8, sh, g)
        monkeypatch.setenv(fused_decode.ENV, "0")  # read when the op is made (the backend's selection)
        _op(256, calls)(c.x[:1], c.tw[:1], c.ids[:1], *c.w, 8)
    assert calls == [0, 0]
    assert caplog.text.count("down in CuTeDSL (down_k4_i256)") == 1
    for why in ("2 tokens", "a shared expert", f"${fused_decode.ENV}=0"):
        assert f"down in Triton ({why})" in caplog.text
    monkeypatch.delenv(fused_decode.ENV)  # the cases below: on, but no variant / no module
    d = _case(1, 8, 16, 16, 0, 256, 256, seed=4)  # k = 8: no such variant
    _op(256, calls)(d.x, d.tw, d.ids, *d.w)
    assert calls == [0, 0]
    assert fused_decode.FusedDecode(None)._variant(d.x, d.ids, d.w[2], None) is None
    monkeypatch.setenv(fused_decode.ENV, "2")
    with pytest.raises(ValueError, match="NVL72_MOE_SM90_DOWN='2'"):
        _op(256, calls)


@pytest.mark.gpu
def test_gpu_kernel_matches_reference_in_a_graph():
    """The compiled down (from the bundle, or JIT with CuTeDSL) at the Qwen3-30B-A3B shape (16 of its
    experts, 8 of them on this rank: remote slots skipped): fp32 reference, Triton's down, NaN-poisoned
    output overwritten, PDL launches in a CUDA graph replaying bit for bit."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("sm_90")
    from moe.backend import load_sm90_module

    op = fused_decode.FusedDecode(load_sm90_module(fused_decode.MODULE))
    for offset, num_local in ((0, 16), (8, 8)):
        c = _case(1, 8, 16, num_local, offset, 2048, 768, seed=offset + 1)
        assert op._variant(c.x, c.ids, c.w[2], None) == "down_k8_i768"
        out = torch.full((1, 2048), float("nan"), dtype=torch.bfloat16, device="cuda")
        got = op(c.x, c.tw, c.ids, *c.w, offset, out=out)
        torch.cuda.synchronize()
        assert torch.isfinite(got).all()
        assert _rel(got, _want(c.x, c.tw, c.ids, c.d13, c.d2, offset)) < 1e-2
        assert _rel(got, tfd.fused_decode(c.x, c.tw, c.ids, *c.w, offset)) < 2e-3
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(c.x, c.tw, c.ids, *c.w, offset)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replay = op(c.x, c.tw, c.ids, *c.w, offset)
    for _ in range(3):
        replay.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replay, got)
