"""One-token projections through nvl72.kernels.sm90_gemv (nvl72.model.smem_gemv): which shapes take the
kernels and the exports' argument contract (on CPU, against torch stand-ins with the same signatures),
the kernels compiled for sm_90a, and on a Hopper GPU the compiled kernels against fp32 and Triton's
GEMVs, in a CUDA graph."""
import importlib
import logging
from types import SimpleNamespace

import pytest
import torch

from nvl72.model import smem_gemv

ft = pytest.importorskip("nvl72.model.fused_triton", exc_type=ImportError)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _bf16(v):
    return v.to(torch.bfloat16).float()


def _stand_in(name, calls):
    """A torch export with the kernel's signature and rounding (module docstring of sm90_gemv)."""
    norm, zc, has_delta = name.startswith("norm"), "_zc" in name, name.endswith("_d")

    def run(x, delta, norm_w, sum_out, w, out, n, eps, pdl):
        calls.append((name, n, pdl))
        v = x.float()
        if norm:
            if has_delta:
                v = _bf16(v + delta.float())
                sum_out.copy_(v.to(sum_out.dtype))
            rstd = torch.rsqrt(v.pow(2).mean() + eps)
            v = _bf16(v * rstd * (1 + norm_w.float())) if zc else _bf16(_bf16(v * rstd) * norm_w.float())
        out.copy_((w.view(n, -1).float() @ v).to(out.dtype))
    return run


def _op(calls, names=("gemv_k256", "norm_gemv_k128", "norm_gemv_k128_d", "norm_gemv_k128_zc_d")):
    return smem_gemv.SmemGemv(SimpleNamespace(**{n: _stand_in(n, calls) for n in names}))


def test_gemv_takes_the_exports_where_they_apply(caplog):
    """The shapes with an export run it (N passed, out [1, N] as fused_triton.gemv); a bias, fp32, N not a
    multiple of ROWS, a missing K variant or a weight with padded rows return None (Triton then runs),
    each logged once; two rows or a column-major weight raise as Triton's GEMV does."""
    torch.manual_seed(0)
    calls = []
    op = _op(calls)
    x, w = torch.randn(1, 256, dtype=torch.bfloat16), torch.randn(64, 256, dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="nvl72.model.smem_gemv"):
        got = op.gemv(x, w)
        op.gemv(x, w)
    assert calls == [("gemv_k256", 64, 0)] * 2 and got.shape == (1, 64)
    assert _rel(got, x.float() @ w.float().T) < 1e-2
    assert caplog.text.count("one-token projection [64, 256]: gemv_k256") == 1
    for why, args in (("a bias", (x, w, torch.zeros(64, dtype=torch.bfloat16))),
                      ("torch.float32", (x.float(), w.float())),
                      ("N=72: not a multiple of 16", (x, torch.randn(72, 256, dtype=torch.bfloat16))),
                      ("no variant gemv_k128", (x[:, :128], w[:, :128].contiguous())),
                      ("a weight not contiguous", (x[:, :128], w[:, :128]))):
        with caplog.at_level(logging.INFO, logger="nvl72.model.smem_gemv"):
            assert op.gemv(*args) is None, why
        assert why in caplog.text
    assert len(calls) == 2
    for bad_x, bad_w in ((torch.randn(2, 256, dtype=torch.bfloat16), w), (x, w.T.contiguous().T)):
        with pytest.raises(ValueError, match="row of weight's K"):  # two rows; a column-major weight
            op.gemv(bad_x, bad_w)


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("with_delta", [False, True])
def test_norm_gemv_contract(with_delta, zero_centered):
    """norm_gemv's (s, out) through the export named for (zero-centred, delta), equal to the residual add,
    ops.rms_norm and the GEMV; s is x itself without delta; a variant not compiled (plain zero-centred
    here) returns None; a bad delta raises before any launch."""
    from nvl72.model import ops

    torch.manual_seed(1)
    calls = []
    op = _op(calls)
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    delta = torch.randn(1, 128, dtype=torch.bfloat16) if with_delta else None
    nw = (0.1 * torch.randn(128) + (0.0 if zero_centered else 1.0)).to(torch.bfloat16)
    w = torch.randn(32, 128, dtype=torch.bfloat16)
    got = op.norm_gemv(x, delta, nw, 1e-6, zero_centered, w)
    name = f"norm_gemv_k128{'_zc' if zero_centered else ''}{'_d' if with_delta else ''}"
    if name == "norm_gemv_k128_zc":
        assert got is None and calls == []
        return
    s, out = got
    assert calls == [(name, 32, 0)]
    s_ref = x if delta is None else x + delta
    h = ops.rms_norm(s_ref, nw, 1e-6, zero_centered)
    assert torch.equal(s, s_ref) and (delta is not None or s is x)
    assert _rel(out, h.float() @ w.float().T) < 1e-2
    with pytest.raises(ValueError, match="norm weight"):
        op.norm_gemv(x, delta, nw[:-1], 1e-6, zero_centered, w)
    assert len(calls) == 1


def test_load_reads_the_switch(monkeypatch):
    monkeypatch.setenv(smem_gemv.ENV, "2")
    with pytest.raises(ValueError, match=r"\$NVL72_SMEM_GEMV='2'"):
        smem_gemv.load()
    monkeypatch.setenv(smem_gemv.ENV, "0")
    assert smem_gemv.load() is None
    if not torch.cuda.is_available():
        monkeypatch.setenv(smem_gemv.ENV, "1")
        assert smem_gemv.load() is None  # no GPU: the references run


def test_kernels_compile_for_sm90a(tmp_path):
    """Every variant compiles for sm_90a and links into a bundle module; sm_100a and shapes the kernel
    cannot split are refused by name; the host's ROWS is the module's."""
    pytest.importorskip("cutlass.cute")
    from aot import build

    mod = importlib.import_module("nvl72.kernels.sm90_gemv")
    assert smem_gemv.ROWS == mod.ROWS
    assert {"gemv_k4096", "norm_gemv_k2048_d", "norm_gemv_k2048_zc_d"} <= set(mod.VARIANTS)
    with pytest.raises(ValueError, match="sm_100a"):
        mod.compile_for_export("sm_100a")
    for bad in (dict(k=1000), dict(k=2048, rows=6), dict(k=2048, norm="layer")):
        with pytest.raises(ValueError, match="K="):
            mod.GemvSmem(**bad)
    assert build.compile_module("nvl72.kernels.sm90_gemv", "sm_90a", str(tmp_path)) == list(mod.VARIANTS)


@pytest.mark.gpu
@pytest.mark.parametrize("zero_centered", [False, True])
def test_gpu_kernels_match_reference_in_a_graph(zero_centered):
    """The bundle's kernels at the Qwen3-30B-A3B shapes (o_proj [2048, 4096]; q/k/v [5120, 2048] with the
    input norm, with and without the residual add): outputs NaN-poisoned first, against the fp32
    reference and Triton's GEMVs (the sum bit-equal), then replayed in a CUDA graph on fresh inputs."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("sm_90")
    op = smem_gemv.load()
    assert op is not None, "no nvl72.kernels.sm90_gemv in the kernel bundle ($NVL72_KERNEL_BUNDLE)"
    torch.manual_seed(2)
    dev = "cuda"
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2048, 4096, device=dev, dtype=torch.bfloat16) * 0.02
    got = op.gemv(x, w)
    assert _rel(got, x.float() @ w.float().T) < 1e-2 and _rel(got, ft.gemv(x, w)) < 2e-3
    for with_delta in (False, True):
        h = torch.randn(1, 2048, device=dev, dtype=torch.bfloat16)
        delta = torch.randn(1, 2048, device=dev, dtype=torch.bfloat16) if with_delta else None
        nw = (0.1 * torch.randn(2048, device=dev) + (0.0 if zero_centered else 1.0)).to(torch.bfloat16)
        wq = torch.randn(5120, 2048, device=dev, dtype=torch.bfloat16) * 0.02
        s, out = op.norm_gemv(h, delta, nw, 1e-6, zero_centered, wq)
        s_t, out_t = ft.norm_gemv(h, delta, nw, 1e-6, zero_centered, wq)
        v = h.float() + (delta.float() if with_delta else 0)
        normed = v * torch.rsqrt(v.pow(2).mean() + 1e-6) * (1 + nw.float() if zero_centered else nw.float())
        assert torch.equal(s, s_t)
        assert _rel(out, normed @ wq.float().T) < 1e-2 and _rel(out, out_t) < 2e-3
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                o_proj = op.gemv(x, w)
                s_g, out_g = op.norm_gemv(h, delta, nw, 1e-6, zero_centered, wq)
        torch.cuda.current_stream().wait_stream(side)
        for _ in range(2):
            for t in (x, h) + ((delta,) if with_delta else ()):
                t.copy_(torch.randn_like(t))
            for t in (o_proj, out_g) + ((s_g,) if with_delta else ()):
                t.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            s_t, out_t = ft.norm_gemv(h, delta, nw, 1e-6, zero_centered, wq)
            assert _rel(o_proj, ft.gemv(x, w)) < 2e-3 and _rel(out_g, out_t) < 2e-3
            assert torch.equal(s_g, s_t)
