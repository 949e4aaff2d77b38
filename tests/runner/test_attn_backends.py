"""Attention backend registry: selection by capability / name / env, and every backend that can run
here against the torch reference on random ragged paged batches."""
import importlib.util
import logging
import os

import pytest
import torch

from nvl72.model import attn_backends as ab
from nvl72.model import ops
from tests.runner.paged import random_batch, rel_err

SHAPE = ab.AttentionShape(8, 2, 16, torch.float32)


def test_cpu_default_is_torch_and_logged(caplog, monkeypatch):
    monkeypatch.delenv(ab.ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="nvl72.model.attn_backends"):
        b = ab.select(SHAPE, "cpu")
    assert b.name == "torch" and not b.graph_safe
    assert "attention backend: torch (by capability" in caplog.text


def test_unknown_and_unavailable_names_raise(monkeypatch):
    with pytest.raises(ab.BackendUnavailable, match="'nope'"):
        ab.select(SHAPE, "cpu", "nope")
    with pytest.raises(ab.BackendUnavailable, match="flashinfer.*(CUDA|importable)"):
        ab.select(SHAPE, "cpu", "flashinfer")
    monkeypatch.setenv(ab.ENV, "bogus")
    with pytest.raises(ab.BackendUnavailable, match="'bogus'"):
        ab.select(SHAPE, "cpu")


def test_triton_needs_the_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "triton" else real(n, *a))
    assert "not importable" in ab.available("triton", torch.device("cpu"))
    assert ab.default_name(torch.device("cpu")) == "torch"


def test_triton_refuses_shapes_its_kernels_do_not_serve(monkeypatch):
    """head_dim 8 (the tiny test models) or a partial query group: triton is unavailable with the
    reason, the capability default on a GPU falls to the next backend, and asking for it raises."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(ab.ENV, raising=False)
    cpu = torch.device("cpu")
    for bad in (ab.AttentionShape(4, 2, 8, torch.float32), ab.AttentionShape(6, 4, 16, torch.float32),
                ab.AttentionShape(4, 2, 48, torch.float32)):
        assert "head_dim" in ab.available("triton", cpu, bad)
        with pytest.raises(ab.BackendUnavailable, match=f"x {bad.head_dim}"):
            ab.select(bad, cpu, "triton")
    assert ab.available("triton", cpu, SHAPE) is None
    monkeypatch.setattr(ab, "available", lambda name, device, shape=None: None if name == "torch" or (
        name == "triton" and shape.head_dim >= 16) else "no")
    gpu = torch.device("cuda")
    assert ab.default_name(gpu, SHAPE) == "triton"
    assert ab.default_name(gpu, ab.AttentionShape(4, 2, 8, torch.float32)) == "torch"


def test_device_slot_mapping_matches_reference_and_marks_missing_pages():
    batch, *_ = random_batch([3, 1, 6], [5, 9, 0], 4, 4, 2, 16, torch.float32, "cpu", seed=1)
    meta = ops.AttentionMetadata.build(batch, 4)
    assert torch.equal(ab.slot_mapping_on_device(batch, 4), meta.slot_mapping)
    batch.page_table[1, :] = -1  # a padded row: no pages at all
    slots = ab.slot_mapping_on_device(batch, 4)
    assert int(slots[3]) == -1 and bool((slots[:3] >= 0).all())


def test_flashinfer_page_lists():
    batch, *_ = random_batch([1, 2, 1], [4, 7, 31], 4, 4, 2, 16, torch.float32, "cpu", seed=2)
    indptr, indices, last = ab.FlashInferBackend.page_lists(batch, 4)
    lens = [5, 9, 32]
    assert indptr.tolist() == [0, 2, 5, 13]
    assert last.tolist() == [1, 1, 4]
    for i, n in enumerate(lens):
        assert indices[indptr[i]:indptr[i + 1]].tolist() == batch.page_table[i, : -(-n // 4)].tolist()


def runnable(name, device):
    return ab.available(name, torch.device(device)) is None


BACKENDS = [("torch", "cpu"), ("triton", "cpu"), pytest.param("triton", "cuda", marks=pytest.mark.gpu),
            pytest.param("flashinfer", "cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("name,device", BACKENDS)
def test_backend_matches_reference(name, device, monkeypatch):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not runnable(name, device):
        pytest.skip(ab.available(name, torch.device(device)))
    if name == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU runs need TRITON_INTERPRET=1")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hq, hkv, d, ps = (32, 4, 128, 16) if device == "cuda" else (8, 2, 16, 4)
    backend = ab.select(ab.AttentionShape(hq, hkv, d, dtype), device, name)
    for qlens, ctx in (([1, 1, 1, 1], [0, 15, 16, 70]), ([7, 1, 33], [9, 40, 0])):  # decode, then mixed
        batch, kv, q, k, v = random_batch(qlens, ctx, ps, hq, hkv, d, dtype, device, seed=sum(ctx))
        ref_meta = ops.AttentionMetadata.build(batch, ps)
        ref_kv = kv.float().clone()
        ops.write_kv(ref_kv, k.float(), v.float(), ref_meta.slot_mapping)
        ref = ops.paged_attention(q.float(), ref_kv, ref_meta, d**-0.5)
        out = backend.forward(q, k, v, kv, backend.plan(batch, ps), d**-0.5)
        assert torch.equal(kv.float(), ref_kv.to(dtype).float())
        assert rel_err(out, ref) < (2e-5 if dtype == torch.float32 else 2e-2), (name, qlens)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs a GPU or Triton's interpreter")
def test_triton_gemv_is_default_switchable_and_single_token_only(monkeypatch):
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(24, 64, generator=g).to(device), torch.randn(24, generator=g).to(device)
    monkeypatch.setenv(ab.GEMV_ENV, "0")
    assert not ab.TritonBackend().gemv
    monkeypatch.setenv(ab.GEMV_ENV, "yes")
    with pytest.raises(ValueError, match="NVL72_TRITON_GEMV='yes'"):
        ab.TritonBackend()
    monkeypatch.delenv(ab.GEMV_ENV, raising=False)
    backend = ab.TritonBackend()
    assert backend.gemv
    for t in (1, 3):
        x = torch.randn(t, 64, generator=g).to(device)
        assert torch.allclose(backend.linear(x, w, b), torch.nn.functional.linear(x, w, b), atol=1e-4)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU runs need TRITON_INTERPRET=1")
def test_triton_norm_rope_attend_fuses_split_launches_only(monkeypatch):
    """One-token steps whose attention splits keys (one sequence of 300 keys: 4 splits on the
    interpreter's 8 "SMs") run the q/k norm inside the attention kernel; a batch of 8 (one program a
    sequence) runs qk_norm_rope then the attention, as does $NVL72_QK_NORM_ATTN=0: each equal to the
    layer's reference math (ops.rms_norm, apply_rope, paged_attention)."""
    backend = ab.TritonBackend()
    used = []
    real = backend.kernels.norm_rope_paged_attention
    monkeypatch.setattr(backend.kernels, "norm_rope_paged_attention", lambda *a, **k: used.append(1) or real(*a, **k))
    hq, hkv, d, ps, eps = 8, 2, 16, 4, 1e-6
    g = torch.Generator().manual_seed(4)
    qw, kw = (torch.randn(d, generator=g) * 0.2 + 1 for _ in range(2))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    for ctx, fused in (([299], True), ([5, 40, 17, 90, 3, 60, 22, 8], False)):
        t = len(ctx)
        batch, kv, _, _, _ = random_batch([1] * t, ctx, ps, hq, hkv, d, torch.float32, "cpu", seed=t)
        q_raw, k_raw, v = torch.randn(t, (hq + 2 * hkv) * d, generator=g).split([hq * d, hkv * d, hkv * d], dim=1)
        v = v.view(t, hkv, d)
        cos, sin = ops.rope_cos_sin(batch.positions, inv_freq, torch.float32)
        meta = ops.AttentionMetadata.build(batch, ps)
        q = ops.apply_rope(ops.rms_norm(q_raw.reshape(t, hq, d), qw, eps, False), cos, sin)
        k = ops.apply_rope(ops.rms_norm(k_raw.reshape(t, hkv, d), kw, eps, False), cos, sin)
        ref_kv = kv.clone()
        ops.write_kv(ref_kv, k, v, meta.slot_mapping)
        ref = ops.paged_attention(q, ref_kv, meta, d**-0.5)
        del used[:]
        out, gate = backend.norm_rope_attend(q_raw, k_raw, v, qw, kw, cos, sin, hq, hkv, d, eps, False, False, kv,
                                             backend.plan(batch, ps), d**-0.5)
        assert gate is None and used == ([1] if fused else []), ctx
        assert rel_err(out, ref) < 1e-5 and rel_err(kv, ref_kv) < 1e-6
    monkeypatch.setenv(ab.QK_ATTN_ENV, "0")
    assert not ab.TritonBackend().qk_attn
