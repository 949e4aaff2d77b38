"""Sm90Gemm's few-token routing of the FP8 masked default (off unless set) and the staged-scales K limit."""
from types import SimpleNamespace

import pytest
import torch

from moe import backend


def _gemm(monkeypatch, env=None, kernels="ws"):
    calls = []
    if env is None:
        monkeypatch.delenv(backend.ENV_SMALL_CAP_VARIANT, raising=False)
    else:
        monkeypatch.setenv(backend.ENV_SMALL_CAP_VARIANT, env)
    ws = SimpleNamespace(**{v: (lambda v: lambda *a: calls.append(v))(v) for v in backend.Sm90Gemm.WS_MASKED})
    classic = SimpleNamespace(grouped_gemm_fp8_masked_swapab=lambda *a: calls.append("classic"))
    return backend.Sm90Gemm(classic, ws, kernels), calls


def _call(g, cap, k=256, e=4, n=128):
    a = torch.zeros(e, cap, k, dtype=torch.float8_e4m3fn)
    b = torch.zeros(e, n, k, dtype=torch.float8_e4m3fn)
    out = torch.empty(e, cap, n, dtype=torch.bfloat16)
    sa, sb = torch.ones(e, k // 128, cap), torch.ones(e, n // 128, k // 128)
    g(a, b, out, sa, sb, torch.zeros(e, dtype=torch.int32), True)


def test_small_cap_routing_is_off_by_default(monkeypatch):
    g, calls = _gemm(monkeypatch)
    assert backend.Sm90Gemm.SMALL_CAP_VARIANT is None and g.small_cap_variant is None
    _call(g, 32)
    assert calls == [backend.Sm90Gemm.WS_DEFAULTS[(True, True)]]


def test_small_cap_routing_by_env(monkeypatch):
    g, calls = _gemm(monkeypatch, "ws_fp8_masked_swapab_m64n16_cps")
    _call(g, 32)
    _call(g, 64)  # above SMALL_CAP_MAX: the default
    assert calls == ["ws_fp8_masked_swapab_m64n16_cps", backend.Sm90Gemm.WS_DEFAULTS[(True, True)]]
    classic, calls = _gemm(monkeypatch, "ws_fp8_masked_swapab_m64n16_cps", kernels="classic")
    _call(classic, 32)
    assert calls == ["classic"]
    off, calls = _gemm(monkeypatch, "")
    _call(off, 32)
    assert calls == [backend.Sm90Gemm.WS_DEFAULTS[(True, True)]]
    with pytest.raises(ValueError, match="ws_fp8_nope"):
        _gemm(monkeypatch, "ws_fp8_nope")


def test_staged_scales_k_limit(monkeypatch):
    g, calls = _gemm(monkeypatch, "ws_fp8_masked_swapab_m64n16_cps")
    _call(g, 32, k=8192)
    with pytest.raises(ValueError, match="K=8320"):
        _call(g, 32, k=8320)
    assert calls == ["ws_fp8_masked_swapab_m64n16_cps"]


def test_default_past_the_staged_k_limit_falls_back(monkeypatch):
    """The masked default stages its scales (K <= its limit); a larger K runs the unstaged kernel."""
    g, calls = _gemm(monkeypatch)
    default = backend.Sm90Gemm.WS_DEFAULTS[(True, True)]
    limit = backend.Sm90Gemm.STAGED_MAX_K[default]
    _call(g, 32, k=limit)
    _call(g, 32, k=limit + 128)
    assert calls == [default, backend.Sm90Gemm.STAGED_FALLBACK]
