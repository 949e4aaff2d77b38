"""Attention backend registry: selection by capability / name / env, and every backend that can run
here against the torch reference on random ragged paged batches."""
import importlib.util
import logging
import os
import sys

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


def test_flashinfer_page_lists():
    batch, *_ = random_batch([1, 2, 1], [4, 7, 31], 4, 4, 2, 16, torch.float32, "cpu", seed=2)
    indptr, indices, last = ab.FlashInferBackend.page_lists(batch, 4)
    lens = [5, 9, 32]
    assert indptr.tolist() == [0, 2, 5, 13]
    assert last.tolist() == [1, 1, 4]
    for i, n in enumerate(lens):
        assert indices[indptr[i]:indptr[i + 1]].tolist() == batch.page_table[i, : -(-n // 4)].tolist()


def test_attention_shape_is_this_ranks_heads():
    """Under TP a rank's attention layers hold their share of the heads: the backends (FlashInfer's
    plans) must see those, not the config's totals."""
    from nvl72.config import ModelConfig
    from nvl72.model.parallel_layout import ParallelLayout
    from nvl72.model.qwen import build_model

    cfg = ModelConfig.from_dict(dict(model_type="qwen3_moe", vocab_size=96, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=8, num_key_value_heads=4, head_dim=16, num_experts=4,
                                     num_experts_per_tok=2, moe_intermediate_size=32, rms_norm_eps=1e-6))
    assert ab.AttentionShape.of(build_model(cfg, torch.float32, "meta")) == ab.AttentionShape(8, 4, 16, torch.float32)
    tp = ParallelLayout(1, 2, all_reduce=lambda x: x)
    assert ab.AttentionShape.of(build_model(cfg, torch.float32, "meta", parallel=tp)) == \
        ab.AttentionShape(4, 2, 16, torch.float32)


def test_flashinfer_needs_hopper_and_a_shape_fa3_serves(monkeypatch):
    """Where flashinfer imports: sm_90 only, bf16 / fp16 and head_dim 64 / 128 / 256 (FA3's prefill),
    and then it is the capability default on a GPU; other shapes fall back to triton with the reason."""
    monkeypatch.delenv(ab.ENV, raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "flashinfer" else real(n, *a))
    cap = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap[0])
    gpu = torch.device("cuda")
    good = ab.AttentionShape(32, 4, 128, torch.bfloat16)
    assert ab.available("flashinfer", gpu, good) is None and ab.default_name(gpu, good) == "flashinfer"
    assert "head_dim 16" in ab.available("flashinfer", gpu, ab.AttentionShape(8, 2, 16, torch.bfloat16))
    assert "torch.float32" in ab.available("flashinfer", gpu, SHAPE)
    assert ab.default_name(gpu, SHAPE) == "triton"
    cap[0] = (10, 0)
    assert "sm_90a" in ab.available("flashinfer", gpu, good) and ab.default_name(gpu, good) == "triton"


class _FakeFlashInfer:
    """FlashInfer's paged wrappers as documented (HND pages [P, 2, Hkv, page, D]; kv_indptr / kv_indices /
    last_page_len; causal bottom-right), computed in torch: a CPU stand-in that checks what our backend
    plans and hands over, page list by page list."""

    class _Wrapper:
        def __init__(self, workspace, kv_layout):
            assert kv_layout == "HND"
            self.planned = None

        def _plan(self, qo_indptr, indptr, indices, last, hq, hkv, d, page_size, causal, **kw):
            self.planned = dict(qo=qo_indptr.tolist(), indptr=indptr.tolist(), indices=indices.tolist(),
                                last=last.tolist(), heads=(hq, hkv, d), page=page_size, causal=causal, **kw)

        def run(self, q, kv_cache, out=None):
            p = self.planned
            hq, hkv, d = p["heads"]
            out = torch.empty_like(q) if out is None else out
            for b in range(len(p["indptr"]) - 1):
                pages = p["indices"][p["indptr"][b]:p["indptr"][b + 1]]
                n_kv = (len(pages) - 1) * p["page"] + p["last"][b]
                kv = kv_cache[pages].float()  # [n, 2, Hkv, page, D]
                k, v = (kv[:, i].permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :n_kv] for i in (0, 1))
                q0, q1 = p["qo"][b], p["qo"][b + 1]
                qs = q[q0:q1].float().transpose(0, 1)  # [Hq, n_q, D]
                k, v = (x.repeat_interleave(hq // hkv, 0) for x in (k, v))
                s = qs @ k.transpose(1, 2) * p["sm_scale"]
                if p["causal"]:  # query i of n_q sits at key n_kv - n_q + i
                    iq = torch.arange(q1 - q0)[:, None] + n_kv - (q1 - q0)
                    s = s.masked_fill(torch.arange(n_kv)[None, :] > iq, float("-inf"))
                out[q0:q1] = (s.softmax(-1) @ v).transpose(0, 1).to(q.dtype)
            return out

    class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
        def plan(self, qo_indptr, indptr, indices, last, hq, hkv, d, page_size, causal=False, **kw):
            self._plan(qo_indptr, indptr, indices, last, hq, hkv, d, page_size, causal, **kw)

    class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
        def plan(self, indptr, indices, last, hq, hkv, d, page_size, **kw):
            qo = torch.arange(len(indptr), dtype=torch.int32)
            self._plan(qo, indptr, indices, last, hq, hkv, d, page_size, False, **kw)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU runs need TRITON_INTERPRET=1")
@pytest.mark.parametrize("flashinfer_decode", [False, True])
def test_flashinfer_backend_hands_prefill_batches_to_flashinfer(monkeypatch, flashinfer_decode):
    """Batches with prefill rows: triton's K/V store, then FlashInfer's prefill wrapper planned with
    our page lists (causal, the model's scale); one-token batches: triton's graph-safe decode unless
    FlashInfer's decode is asked for. Each output equals the torch reference."""
    monkeypatch.setitem(sys.modules, "flashinfer", _FakeFlashInfer)
    hq, hkv, d, ps = 8, 2, 16, 4
    backend = ab.FlashInferBackend(ab.AttentionShape(hq, hkv, d, torch.float32), torch.device("cpu"),
                                   decode=flashinfer_decode)
    assert backend.graph_safe is not flashinfer_decode
    for qlens, ctx in (([7, 1, 33], [9, 40, 0]), ([1, 1, 1], [0, 15, 70])):
        batch, kv, q, k, v = random_batch(qlens, ctx, ps, hq, hkv, d, torch.float32, "cpu", seed=sum(ctx))
        ref_meta = ops.AttentionMetadata.build(batch, ps)
        ref_kv = kv.clone()
        ops.write_kv(ref_kv, k, v, ref_meta.slot_mapping)
        ref = ops.paged_attention(q, ref_kv, ref_meta, d**-0.5)
        meta = backend.plan(batch, ps)
        prefill = max(qlens) > 1
        assert isinstance(meta, ab.FlashInferMeta) == (prefill or flashinfer_decode)
        if isinstance(meta, ab.FlashInferMeta):
            planned = meta.wrapper.planned
            assert meta.wrapper is (backend.prefill if prefill else backend.decode)
            assert planned["causal"] == prefill and planned["sm_scale"] == d**-0.5
            assert planned["indptr"][-1] == sum(-(-(c + n) // ps) for c, n in zip(ctx, qlens))
        given = torch.full_like(q, float("nan"))  # piecewise prefill graphs hand their own output buffer
        out = backend.forward(q, k, v, kv, meta, d**-0.5, out=given)
        assert out.data_ptr() == given.data_ptr() and torch.equal(kv, ref_kv) and rel_err(given, ref) < 1e-5, qlens
    batch, kv, q, k, v = random_batch([2], [3], ps, hq, hkv, d, torch.float32, "cpu")
    with pytest.raises(ValueError, match="scale"):  # FlashInfer's is planned: another one is an error
        backend.forward(q, k, v, kv, backend.plan(batch, ps), 0.5)
    # what a CUDA graph captures (speculative decoding's 1 + k-token rows) stays on triton: no host plan
    monkeypatch.setattr(ab, "capturing", lambda b: True)
    batch, kv, q, k, v = random_batch([3, 3, 3], [5, 20, 0], ps, hq, hkv, d, torch.float32, "cpu", seed=7)
    meta = backend.plan(batch, ps)
    assert not isinstance(meta, ab.FlashInferMeta)
    ref_meta = ops.AttentionMetadata.build(batch, ps)
    ref_kv = kv.clone()
    ops.write_kv(ref_kv, k, v, ref_meta.slot_mapping)
    assert rel_err(backend.forward(q, k, v, kv, meta, d**-0.5), ops.paged_attention(q, ref_kv, ref_meta, d**-0.5)) < 1e-5


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU runs need TRITON_INTERPRET=1")
def test_flashinfer_that_cannot_run_is_refused_at_selection(monkeypatch, caplog):
    """A FlashInfer whose prefill module neither loads nor builds fails its start-up probe: the
    capability default falls back to triton with the reason logged; asking for it by name raises."""
    class Broken(_FakeFlashInfer.BatchPrefillWithPagedKVCacheWrapper):
        def run(self, q, kv_cache, out=None):
            raise RuntimeError("no module batch_prefill_..._head_dim_qk_16 (FLASHINFER_DISABLE_JIT)")

    fake = type("FakeFlashInfer", (), {"BatchPrefillWithPagedKVCacheWrapper": Broken,
                                       "BatchDecodeWithPagedKVCacheWrapper": _FakeFlashInfer._Wrapper})
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.delenv(ab.ENV, raising=False)
    monkeypatch.setattr(ab, "available", lambda name, device, shape=None: None)
    monkeypatch.setattr(ab, "default_name", lambda device, shape=None: "flashinfer")
    with caplog.at_level(logging.WARNING, logger="nvl72.model.attn_backends"):
        assert ab.select(SHAPE, "cpu").name == "triton"
    assert "head_dim 16" in caplog.text and "falling back to triton" in caplog.text
    with pytest.raises(ab.BackendUnavailable, match="FLASHINFER_DISABLE_JIT"):
        ab.select(SHAPE, "cpu", "flashinfer")


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
