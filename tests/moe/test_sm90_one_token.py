"""The sm90 backend's one-token decode op (moe.fused_decode): which kernels it runs (CuTeDSL gate/up and
down, or Triton's), the argument contract of the CuTeDSL exports (checked on CPU against torch stand-ins
with the same signatures), and on a Hopper GPU the compiled kernels against the fp32 reference and
Triton's kernels."""
import logging
from types import SimpleNamespace

import pytest
import torch

from moe import fused_decode
from tests.moe.test_triton_fused_decode import DEV, _case, _rel, _want

tfd = pytest.importorskip("moe.kernels.triton_fused_decode")


def _torch_gate_up(x, ids, w13, s13, act, offset, num_local, inter, k, pdl, *, calls):
    """The gate/up export's semantics in torch (flat views as FusedDecode passes them; x 8-byte aligned,
    as the kernel reads it)."""
    assert x.data_ptr() % 8 == 0
    calls.append(("gate_up", pdl))
    h = x.numel()
    w = w13.view(torch.float8_e4m3fn).view(num_local, 2 * inter, h).float()
    s = s13.view(num_local, 2 * inter // 128, h // 128).repeat_interleave(128, 1).repeat_interleave(128, 2)
    a = act.view(k, inter)
    for j in range(k):
        e = int(ids[j]) - offset
        if 0 <= e < num_local:
            gu = (w[e] * s[e]) @ x.float()
            a[j] = torch.nn.functional.silu(gu[:inter]) * gu[inter:]


def _torch_down(act, ids, tw, w2, s2, out, offset, num_local, h, pdl, *, inter, calls):
    """The down export's semantics in torch."""
    calls.append(("down", pdl))
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


def _op(inter, calls, variants=("gate_up_h256", "down_k4_i256")):
    fns = {"gate_up": lambda *a: _torch_gate_up(*a, calls=calls),
           "down": lambda *a: _torch_down(*a, inter=inter, calls=calls)}
    return fused_decode.FusedDecode(SimpleNamespace(**{n: fns["down" if n.startswith("down") else "gate_up"]
                                                       for n in variants}))


def test_one_token_runs_the_exports_with_their_contract(monkeypatch, caplog):
    """One token: the exports (whose torch stand-ins reproduce the fp32 reference, so the flat views,
    offset and counts are what the kernels document); a shared expert: CuTeDSL gate/up, Triton's down;
    two tokens, the switch at 0 or no module: Triton's; a missing variant: Triton's for that kernel.
    Each choice logged once per shape."""
    monkeypatch.delenv(fused_decode.ENV, raising=False)
    c = _case(2, 4, 16, 8, 8, 256, 256, seed=3)
    one = (c.x[:1], c.tw[:1], c.ids[:1], *c.w, 8)
    want = _want(c.x[:1], c.tw[:1], c.ids[:1], c.d13, c.d2, 8)
    calls = []
    op = _op(256, calls)
    with caplog.at_level(logging.INFO, logger="moe.backend"):
        out = torch.full((1, 256), float("nan"), dtype=torch.bfloat16, device=DEV)
        got = op(*one, out=out)
        assert got is out and calls == [("gate_up", 0), ("down", 0)]
        assert _rel(got, want) < 1e-2
        op(*one)
        two = op(c.x, c.tw, c.ids, *c.w, 8)
        assert len(calls) == 4 and _rel(two, _want(c.x, c.tw, c.ids, c.d13, c.d2, 8)) < 1e-2
        sh = torch.randn(1, 256, generator=c.gen).to(torch.bfloat16).to(DEV)
        g = torch.randn(1, 1, generator=c.gen).to(torch.bfloat16).to(DEV)
        got = op(*one, sh, g)
        assert calls[4:] == [("gate_up", 0)]
        assert _rel(got, _want(c.x[:1], c.tw[:1], c.ids[:1], c.d13, c.d2, 8, sh, g)) < 1e-2
        del calls[:]
        got = _op(256, calls, ("gate_up_h256",))(*one)  # no down variant: Triton's down
        assert calls == [("gate_up", 0)] and _rel(got, want) < 1e-2
        del calls[:]
        got = _op(256, calls, ("down_k4_i256",))(*one)  # no gate/up variant: Triton's gate/up
        assert calls == [("down", 0)] and _rel(got, want) < 1e-2
        del calls[:]
        monkeypatch.setenv(fused_decode.ENV, "0")  # read when the op is made (the backend's selection)
        _op(256, calls)(*one)
        assert calls == []
    text = caplog.text
    assert text.count("gate/up in CuTeDSL (gate_up_h256), down in CuTeDSL (down_k4_i256)") == 1
    assert "gate/up in Triton (2 tokens), down in Triton (2 tokens)" in text
    assert "gate/up in CuTeDSL (gate_up_h256), down in Triton (a shared expert)" in text
    assert "down in Triton (no variant down_k4_i256)" in text
    assert "gate/up in Triton (no variant gate_up_h256), down in CuTeDSL (down_k4_i256)" in text
    assert f"gate/up in Triton (${fused_decode.ENV}=0)" in text
    monkeypatch.delenv(fused_decode.ENV)
    assert fused_decode.FusedDecode(None).variants(c.x[:1], c.ids[:1], c.w[2], None) == (None, None)
    monkeypatch.setenv(fused_decode.ENV, "2")
    with pytest.raises(ValueError, match="NVL72_MOE_SM90_ONE_TOKEN='2'"):
        _op(256, calls)


def test_gate_up_leaves_other_ranks_rows_and_checks_its_input():
    """act rows of slots whose expert is another rank's stay as they were (NaN here); the local rows
    match Triton's gate_up; a wrong x shape is named."""
    c = _case(1, 4, 16, 8, 8, 256, 256, seed=5)
    op = _op(256, [])
    act = torch.full((4, 256), float("nan"), device=DEV)
    got = op.gate_up(c.x, c.ids, c.w[0], c.w[1], 8, "gate_up_h256", act)
    local = (c.ids[0] >= 8) & (c.ids[0] < 16)
    assert got is act and 0 < int(local.sum()) < 4
    assert act[~local].isnan().all() and torch.isfinite(act[local]).all()
    assert _rel(act[local], tfd.gate_up(c.x, c.ids, c.w[0], c.w[1], 8)[local]) < 1e-5
    with pytest.raises(ValueError, match="x.shape"):
        op.gate_up(c.x[:, :128], c.ids, c.w[0], c.w[1], 8, "gate_up_h256")
    wide = torch.empty(1, 257, dtype=c.x.dtype, device=DEV)
    wide[:, 1:] = c.x
    odd = wide[:, 1:]  # contiguous, 2 bytes past an aligned start: passed on as an aligned copy
    assert odd.is_contiguous() and odd.data_ptr() % 8
    again = op.gate_up(odd, c.ids, c.w[0], c.w[1], 8, "gate_up_h256")
    assert torch.equal(again[local], act[local])


@pytest.mark.gpu
@pytest.mark.parametrize("k,inter", [(8, 768), (11, 512)])
def test_gpu_kernels_match_reference_in_a_graph(k, inter):
    """The compiled gate/up and down (from the bundle, or JIT with CuTeDSL) at the Qwen3-30B-A3B shape
    and Qwen3-Next's (10 experts + the shared one held as an expert: k x I not a whole number of act
    staging steps) (16 experts, 8 of them on this rank: remote slots skipped): gate/up's act against
    Triton's (other ranks' rows left NaN), the op against the fp32 reference and Triton's kernels,
    NaN-poisoned outputs overwritten, PDL launches in a CUDA graph replaying bit for bit."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("sm_90")
    from moe.backend import load_sm90_module

    op = fused_decode.FusedDecode(load_sm90_module(fused_decode.MODULE))
    for offset, num_local in ((0, 16), (8, 8)):
        c = _case(1, k, 16, num_local, offset, 2048, inter, seed=offset + 1)
        assert op.variants(c.x, c.ids, c.w[2], None) == ("gate_up_h2048", f"down_k{k}_i{inter}")
        act = torch.full((k, inter), float("nan"), device="cuda")
        op.gate_up(c.x, c.ids, c.w[0], c.w[1], offset, "gate_up_h2048", act)
        local = (c.ids[0] >= offset) & (c.ids[0] < offset + num_local)
        assert torch.isfinite(act[local]).all() and act[~local].isnan().all()
        assert _rel(act[local], tfd.gate_up(c.x, c.ids, c.w[0], c.w[1], offset)[local]) < 1e-5
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
