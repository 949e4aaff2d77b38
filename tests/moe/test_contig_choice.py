"""Sm90Gemm's per-GEMM choice of the contiguous FP8 ws variant (table by rows, env override), the FP8
pipeline naming its GEMMs, and perf.moe's --variants filter (CPU: fake kernel modules record calls)."""
from types import SimpleNamespace

import pytest
import torch

from moe import backend
from moe.routing import permute_contiguous


def _gemm(monkeypatch, env=None, kernels="ws"):
    calls = []
    if env is None:
        monkeypatch.delenv(backend.ENV_CONTIG_VARIANT, raising=False)
    else:
        monkeypatch.setenv(backend.ENV_CONTIG_VARIANT, env)
    names = backend.Sm90Gemm.WS_CONTIG + backend.Sm90Gemm.WS_MASKED
    ws = SimpleNamespace(**{v: (lambda v: lambda *a: calls.append((v, len(a))))(v) for v in names})
    classic = SimpleNamespace(**{v: (lambda v: lambda *a: calls.append((v, len(a))))(v) for v in backend.Sm90Gemm.DEFAULTS.values()})
    g = backend.Sm90Gemm(classic, ws, kernels)
    g.clusters = lambda device, variant: 7  # the driver query needs a GPU
    return g, calls


def _call(g, rows, role, k=256, n=128, e=4):
    a = torch.zeros(rows, k, dtype=torch.float8_e4m3fn)
    b = torch.zeros(e, n, k, dtype=torch.float8_e4m3fn)
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    sa, sb = torch.ones(1, k // 128, rows), torch.ones(e, n // 128, k // 128)
    g(a, b, out, sa, sb, torch.zeros(rows // 128, dtype=torch.int32), False, role=role)


def _expect(role, rows):
    return next(v for m, v in backend.Sm90Gemm.CONTIG_TABLE[role] if rows >= m)


def test_table_is_well_formed():
    for role in backend.GEMM_ROLES:
        table = backend.Sm90Gemm.CONTIG_TABLE[role]
        mins = [m for m, _ in table]
        assert mins == sorted(mins, reverse=True) and mins[-1] == 0  # every size has an entry
        assert all(v in backend.Sm90Gemm.WS_CONTIG for _, v in table)


@pytest.mark.parametrize("kernels", ["ws", "auto"])
def test_table_by_role_and_rows(monkeypatch, kernels):
    g, calls = _gemm(monkeypatch, kernels=kernels)
    rows = [128 * int(r) for r in torch.randint(1, 2048, (6,))] + [128, 24576, 98304, 131072]
    want = []
    for r in rows:
        for role in backend.GEMM_ROLES:
            _call(g, r, role)
            v = _expect(role, r)
            want.append((v, 8 if v in backend.Sm90Gemm.CLUSTERED else 7))  # clusters after aux, then pdl
    assert calls == want
    assert {v for v, _ in calls} == {v for role in backend.GEMM_ROLES for _, v in backend.Sm90Gemm.CONTIG_TABLE[role]}


def test_no_role_or_classic_keeps_the_fixed_default(monkeypatch):
    g, calls = _gemm(monkeypatch)
    _call(g, 131072 // 8, None)
    classic, ccalls = _gemm(monkeypatch, kernels="classic")
    _call(classic, 131072, "w13")
    assert [v for v, _ in calls] == [backend.Sm90Gemm.WS_DEFAULTS[(True, False)]]
    assert [v for v, _ in ccalls] == [backend.Sm90Gemm.DEFAULTS[(True, False)]]


def test_env_override(monkeypatch):
    g, calls = _gemm(monkeypatch, "ws_fp8_contig_pingpong")
    _call(g, 128, "w13")
    _call(g, 131072, "w2")
    assert [v for v, _ in calls] == ["ws_fp8_contig_pingpong"] * 2
    g, calls = _gemm(monkeypatch, "w2=ws_fp8_contig_serial")
    _call(g, 131072, "w13")
    _call(g, 131072, "w2")
    assert [v for v, _ in calls] == [_expect("w13", 131072), "ws_fp8_contig_serial"]
    g, calls = _gemm(monkeypatch, "w13=ws_fp8_contig_n256_e4, w2=ws_fp8_contig")
    _call(g, 256, "w13")
    _call(g, 256, "w2")
    assert [v for v, _ in calls] == ["ws_fp8_contig_n256_e4", "ws_fp8_contig"]
    g, calls = _gemm(monkeypatch, "")
    assert g.contig_table == backend.Sm90Gemm.CONTIG_TABLE
    for bad in ("ws_fp8_nope", "w3=ws_fp8_contig", "w13=ws_fp8_masked_swapab"):
        with pytest.raises(ValueError, match="NVL72_MOE_CONTIG_VARIANT"):
            _gemm(monkeypatch, bad)
    with pytest.raises(ValueError, match="role='w4'"):
        g.contig_variant("w4", 128)


def test_pipeline_names_its_gemms():
    """The FP8 pipeline passes role w13 then w2 to its grouped GEMM (reference ops on CPU)."""
    ops = backend._reference_ops()
    roles, ref = [], ops.grouped_gemm
    ops.grouped_gemm = lambda *a, role=None, **kw: (roles.append(role), ref(*a, **kw))[1]
    be = backend.Fp8PipelineBackend("t", ops)
    gen = torch.Generator().manual_seed(3)
    e, hid, inter, t, k = 4, 256, 128, backend.DECODE_MAX_TOKENS + 5, 2  # contiguous layout
    w = be.prepare(torch.randn(e, 2 * inter, hid, generator=gen) * 0.05, torch.randn(e, hid, inter, generator=gen) * 0.05)
    ids = torch.rand(t, e, generator=gen).argsort(1)[:, :k]
    out = be.run(torch.randn(t, hid, generator=gen).bfloat16(), torch.rand(t, k, generator=gen), ids, w, 0)
    assert roles == ["w13", "w2"] and out.shape == (t, hid) and torch.isfinite(out.float()).all()
    assert permute_contiguous(ids, e, 0, 128).num_rows > 0


def test_perf_variants_filter():
    from perf.moe import parse_variants

    assert parse_variants(None) is None
    assert parse_variants("contig_n256,ws_fp8_contig_n256_mc") == {"ws_fp8_contig_n256", "ws_fp8_contig_n256_mc"}
    with pytest.raises(SystemExit, match="nope"):
        parse_variants("contig_n256,nope")
