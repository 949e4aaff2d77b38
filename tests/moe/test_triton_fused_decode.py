"""The few-token fused decode kernels (moe.kernels.triton_fused_decode) against an fp32 torch reference on
the dequantized FP8 weights, and the backend's choice between them and the FP8 pipeline. On a GPU, or
through Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA)."""
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from moe import backend, mxfp8, reference
from tests.runner.ptx import COMPILES, compile_pdl

fd = pytest.importorskip("moe.kernels.triton_fused_decode")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(e, inter, h, gen):
    """FP8 w13 [E, 2I, H] and w2 [E, H, I] as Fp8PipelineBackend.prepare makes them, and their
    dequantized fp32 forms; magnitudes vary by 2^-3..2^3 between 128 x 128 blocks, so a block's
    scale taken from the wrong block shows."""
    out = []
    for n, k in ((2 * inter, h), (h, inter)):
        mag = torch.exp2(torch.randint(-3, 4, (e, n // 128, k // 128), generator=gen).float())
        w = torch.randn(e, n, k, generator=gen) * 0.02 * mag.repeat_interleave(128, 1).repeat_interleave(128, 2)
        c = mxfp8.quantize_experts(w)
        q, s = c["q_sm90"], c["scale_sm90"]
        deq = q.float() * s.repeat_interleave(128, 1).repeat_interleave(128, 2)
        out += [q.to(DEV), s.to(DEV), deq.to(DEV)]
    return out


def _want(x, tw, ids, d13, d2, offset, shared=None, gate=None):
    """fp32 reference, pair by pair (duplicates and other ranks' experts as reference.experts)."""
    t, k = ids.shape
    inter = d13.shape[1] // 2
    out = torch.zeros(t, d2.shape[1], dtype=torch.float32, device=x.device)
    for i in range(t):
        for j in range(k):
            e = int(ids[i, j]) - offset
            if 0 <= e < d13.shape[0]:
                h = d13[e] @ x[i].float()
                out[i] += tw[i, j] * (d2[e] @ (F.silu(h[:inter]) * h[inter:]))
    if shared is not None:
        out += torch.sigmoid(gate.float()) * shared.float()
    return out


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _case(t, k, e, num_local, offset, h, inter, seed):
    gen = torch.Generator().manual_seed(seed)
    q13, s13, d13, q2, s2, d2 = _weights(num_local, inter, h, gen)
    x = (torch.randn(t, h, generator=gen)).to(torch.bfloat16).to(DEV)
    ids = torch.rand(t, e, generator=gen).argsort(1)[:, :k]
    ids[0, 0] = offset  # at least one local pair
    ids[-1, -1] = offset + num_local - 1  # and the last local expert (maybe twice in a token)
    tw = torch.rand(t, k, generator=gen)
    return SimpleNamespace(x=x, ids=ids.to(DEV), tw=tw.to(DEV), w=(q13, s13, q2, s2), d13=d13, d2=d2, gen=gen)


@pytest.mark.parametrize("t,k,e,num_local,offset,h,inter,blocks", [
    (1, 8, 16, 16, 0, 256, 128, {}),
    (3, 4, 16, 8, 8, 384, 256, dict(block_n=32, block_k=256, block_n2=8, block_k2=256)),  # partial K tiles
    (3, 6, 12, 4, 4, 256, 128,  # KP 8 > k
     dict(block_n=128, block_k=128, num_warps=8, block_n2=32, block_k2=64, num_warps2=4)),
    (1, 4, 8, 4, 0, 256, 128, dict(block_n=8, block_k=64, block_n2=16, block_k2=512, early=True)),
])
@pytest.mark.parametrize("with_shared", [False, True])
def test_fused_decode_matches_fp32_reference(t, k, e, num_local, offset, h, inter, blocks, with_shared):
    """Experts of other EP ranks (E_local < E, offset), several tokens sharing experts, block shapes
    that leave partial K tiles and slot padding; the output starts as NaN."""
    c = _case(t, k, e, num_local, offset, h, inter, seed=t * 100 + k + h + with_shared)
    shared = gate = None
    if with_shared:
        shared = torch.randn(t, h, generator=c.gen).to(torch.bfloat16).to(DEV)
        gate = torch.randn(t, 1, generator=c.gen).to(torch.bfloat16).to(DEV)
    out = torch.full((t, h), float("nan"), dtype=torch.bfloat16, device=DEV)
    got = fd.fused_decode(c.x, c.tw, c.ids, *c.w, offset, shared, gate, out=out, **blocks)
    want = _want(c.x, c.tw, c.ids, c.d13, c.d2, offset, shared, gate)
    assert got is out
    assert torch.isfinite(got).all()
    assert _rel(got, want) < 1e-2
    if not with_shared:  # tokens whose experts are all elsewhere get exact zeros
        remote = ((c.ids - offset < 0) | (c.ids - offset >= num_local)).all(1)
        assert not got[remote].any()


def test_gate_up_and_down_write_what_they_own():
    """gate_up writes the rows of local pairs only (NaN-poisoned scratch keeps NaN elsewhere) and down
    reads no other row; a duplicated expert in one token's slots counts twice."""
    c = _case(2, 4, 8, 4, 4, 256, 128, seed=7)
    c.ids[1] = torch.tensor([5, 5, 1, 6])  # slot 0 and 1 the same local expert, slot 2 remote
    act = torch.full((8, 128), float("nan"), device=DEV)
    fd.gate_up(c.x, c.ids, c.w[0], c.w[1], 4, act)
    local = ((c.ids - 4 >= 0) & (c.ids - 4 < 4)).flatten()
    assert torch.isfinite(act[local]).all() and act[~local].isnan().all()
    out = fd.down(act, c.tw, c.ids, c.w[2], c.w[3], 4)
    assert torch.isfinite(out).all()
    assert _rel(out, _want(c.x, c.tw, c.ids, c.d13, c.d2, 4)) < 1e-2


def test_shapes_and_blocks_checked():
    c = _case(1, 2, 4, 4, 0, 256, 128, seed=1)
    q13, s13, q2, s2 = c.w
    with pytest.raises(ValueError, match="block_n=48 must divide 128"):
        fd.gate_up(c.x, c.ids, q13, s13, block_n=48)
    with pytest.raises(ValueError, match="block_k=96"):
        fd.down(torch.zeros(2, 128, device=DEV), c.tw, c.ids, q2, s2, block_k=96)
    with pytest.raises(ValueError, match="act: torch.bfloat16"):
        fd.down(torch.zeros(2, 128, device=DEV, dtype=torch.bfloat16), c.tw, c.ids, q2, s2)
    with pytest.raises(ValueError, match="out: torch.float32"):
        fd.down(torch.zeros(2, 128, device=DEV), c.tw, c.ids, q2, s2, out=torch.zeros(1, 256, device=DEV))
    with pytest.raises(ValueError, match="w13_scale"):
        fd.gate_up(c.x, c.ids, q13, s13[:, :1])
    with pytest.raises(ValueError, match=r"x.shape=\(1, 128\)"):
        fd.gate_up(c.x[:, :128], c.ids, q13, s13)


def _backend(threshold, calls):
    """The FP8 pipeline on the torch reference ops plus the fused kernels, recording which ran."""
    ops = vars(backend._reference_ops()).copy()

    def spy(name, fn):
        def wrapped(*a, **kw):
            calls.append(name)
            return fn(*a, **kw)
        return wrapped

    ops["fused_decode"] = spy("fused", fd.fused_decode)
    ops["permute_masked"] = spy("pipeline", ops["permute_masked"])
    return backend.Fp8PipelineBackend("test-fused", SimpleNamespace(**ops), fused_decode_tokens=threshold)


@pytest.mark.parametrize("threshold", [0, 2])
def test_backend_uses_fused_path_up_to_threshold(threshold):
    """T <= threshold: the fused kernels; above it (or threshold 0): the pipeline. Both agree."""
    gen = torch.Generator().manual_seed(threshold)
    w13, w2 = torch.randn(8, 256, 256, generator=gen) * 0.05, torch.randn(8, 256, 128, generator=gen) * 0.05
    calls = []
    be = _backend(threshold, calls)
    pipe = backend.Fp8PipelineBackend("test-pipe", backend._reference_ops())
    w = be.prepare(w13.to(DEV), w2.to(DEV))
    for t in (1, 2, 3):
        x = torch.randn(t, 256, generator=gen).to(torch.bfloat16).to(DEV)
        # all experts local: reference.unpermute multiplies the (unwritten) row 0 by 0 for other ranks' slots
        tw, ids = reference.route(torch.randn(t, 8, generator=gen).to(DEV), 4, True)
        calls.clear()
        got = be.run(x, tw, ids, w, 0)
        assert calls == ["fused" if t <= threshold else "pipeline"]
        want = pipe.run(x, tw, ids, w, 0)
        assert _rel(got, want) < 0.05  # the pipeline quantizes activations to FP8, the fused path does not


def test_threshold_env(monkeypatch, caplog):
    monkeypatch.setenv(backend.ENV_FUSED_DECODE_TOKENS, "3")
    with caplog.at_level(logging.INFO, logger="moe.backend"):
        assert _backend(None, []).fused_tokens == 3
    assert "fused decode path at 1..3 tokens" in caplog.text
    monkeypatch.setenv(backend.ENV_FUSED_DECODE_TOKENS, "0")
    assert _backend(None, []).fused_tokens == 0
    monkeypatch.delenv(backend.ENV_FUSED_DECODE_TOKENS)
    assert _backend(None, []).fused_tokens == backend.FUSED_DECODE_TOKENS
    for bad in ("-1", "four", "2.5"):
        monkeypatch.setenv(backend.ENV_FUSED_DECODE_TOKENS, bad)
        with pytest.raises(ValueError, match=f"NVL72_MOE_FUSED_DECODE_TOKENS={bad!r}"):
            _backend(None, [])
    monkeypatch.setenv(backend.ENV_FUSED_DECODE_TOKENS, str(backend.DECODE_MAX_TOKENS + 1))
    with pytest.raises(ValueError, match=r"from 0 \(off\) to 256"):
        _backend(None, [])
    with pytest.raises(ValueError, match="fused_decode_tokens=-2"):
        _backend(-2, [])
    # the emulated backend has no fused op: the threshold does not apply (and is not read)
    assert backend.Fp8PipelineBackend("x", backend._reference_ops()).fused_tokens == 0


@COMPILES
@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("early", [True, False])
def test_kernels_compile_for_hopper(pdl, early):
    """Both kernels lower for sm_90 at the Qwen3-30B-A3B defaults, with the griddepcontrol pair exactly
    when PDL is on; global loads before the wait only in down's early form."""
    i32 = "i32"
    k1 = compile_pdl(fd._gate_up_kernel, {
        "x_ptr": "*bf16", "ids_ptr": "*i64", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "act_ptr": "*fp32", "H": i32,
        "I": i32, "num_local": i32, "expert_offset": i32}, {"K": 8, "BLOCK_N": fd.BLOCK_N, "BLOCK_K": fd.BLOCK_K}, pdl)
    k2 = compile_pdl(fd._down_kernel, {
        "act_ptr": "*fp32", "ids_ptr": "*i64", "tw_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32",
        "out_ptr": "*bf16", "sh_ptr": "*bf16", "g_ptr": "*bf16", "H": i32, "I": i32, "num_local": i32,
        "expert_offset": i32}, {"K": 8, "KP": 8, "HAS_SHARED": True, "BLOCK_N": fd.BLOCK_N2, "BLOCK_K": fd.BLOCK_K2,
                                "EARLY": early}, pdl)
    if pdl:
        assert "ld.global" not in k1[:k1.index("griddepcontrol.wait")]
        assert ("ld.global" in k2[:k2.index("griddepcontrol.wait")]) == early

@pytest.mark.gpu
def test_sm90_backend_fused_path_in_a_graph():
    """On the GPU, at the Qwen3-30B-A3B expert shape (16 of its experts): the sm90 backend at T=1 runs
    the fused kernels, replayable in a CUDA graph (bit-identical), matching the fp32 reference on the
    dequantized weights and, within the FP8 activations' error, its own pipeline (threshold 0)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("sm90 backend")
    be = backend.select("cuda", "sm90-fp8")
    assert hasattr(be.ops, "fused_decode") and be.fused_tokens >= 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = be.prepare(torch.randn(16, 1536, 2048, device="cuda", generator=gen) * 0.02,
                   torch.randn(16, 2048, 768, device="cuda", generator=gen) * 0.02)
    x = torch.randn(1, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    tw, ids = be.route(torch.randn(1, 16, device="cuda", generator=gen), 8, True)
    out = be.run(x, tw, ids, w, 0)
    d13, d2 = (q.float() * s.repeat_interleave(128, 1).repeat_interleave(128, 2)
               for q, s in ((w.w13, w.w13_scale), (w.w2, w.w2_scale)))
    assert _rel(out, _want(x, tw, ids, d13, d2, 0)) < 1e-2
    pipe = backend.Fp8PipelineBackend("sm90-pipe", be.ops, fused_decode_tokens=0)
    assert _rel(out, pipe.run(x, tw, ids, w, 0)) < 0.1
    side = torch.cuda.Stream()  # warm-up where the capture launches (PDL on: a side stream)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        be.run(x, tw, ids, w, 0)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        replay = be.run(x, tw, ids, w, 0)
    replay.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(replay, out)
