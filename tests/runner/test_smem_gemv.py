"""One-token projections through nvl72.kernels.sm90_gemv and the batch-1 attention through
nvl72.kernels.sm90_attn (nvl72.model.smem_gemv): which shapes take the kernels and the exports' argument
contract (on CPU, against torch stand-ins with the same signatures), the kernels compiled for sm_90a,
and on a Hopper GPU the compiled kernels against fp32 and Triton's GEMVs and attention, in a CUDA graph."""
import importlib
import logging
import os
from types import SimpleNamespace

import pytest
import torch

from nvl72.model import ops, smem_gemv
from tests.runner.paged import active_splits, combine_partials, random_batch

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


def _attn_stand_in(name, calls):
    """A torch attn export with the kernel's signature: x from the combine of the partials where 2 to
    LEAVE splits hold the keys (tests.runner.paged.combine_partials), from x otherwise."""
    d = int(name.rsplit("_d", 1)[1])

    def run(x, acc, ml, seq_lens, w, out, n, splits, block_n, pdl):
        calls.append((name, n, splits, block_n, pdl))
        hq = x.numel() // d
        parts = ft.SplitPartials(x.view(1, hq, d), acc.view(1, hq, splits, d), ml.view(1, hq, splits, 2), seq_lens,
                                 splits, block_n, smem_gemv.LEAVE)
        xv = combine_partials(parts).to(x.dtype).float().view(-1)
        out.copy_((w.view(n, -1).float() @ xv).to(out.dtype))
    return run


def _op(calls, names=("gemv_k256", "norm_gemv_k128", "norm_gemv_k128_d", "norm_gemv_k128_zc_d"), attn=()):
    fns = {n: _stand_in(n, calls) for n in names} | {n: _attn_stand_in(n, calls) for n in attn}
    return smem_gemv.SmemGemv(SimpleNamespace(**fns))


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


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU runs need TRITON_INTERPRET=1")
def test_attn_gemv_contract(caplog):
    """attn_leave gives LEAVE where an attn export has the shape (0, logged, for a bias, fp32, a missing
    head_dim); attn_gemv passes (N, splits, block_n) and flat partials a split attention left with that
    leave (Triton's interpreter, fp32; 16 splits of 64 keys: 150 keys fill 3 of them, 40 one, 600 ten) and
    returns o_proj of the attention (one split: through `gemv`, Triton's for fp32); two tokens raise."""
    calls = []
    hq, hkv, d, ps = 8, 2, 32, 4
    op = _op(calls, names=(f"gemv_k{hq * d}",), attn=(f"attn_gemv_k{hq * d}_d{d}",))
    w = torch.randn(48, hq * d) * 0.1
    with caplog.at_level(logging.INFO, logger="nvl72.model.smem_gemv"):
        assert op.attn_leave(torch.bfloat16, w.bfloat16(), None, d) == smem_gemv.LEAVE
        assert op.attn_leave(torch.bfloat16, w.bfloat16(), torch.zeros(48), d) == 0
        assert op.attn_leave(torch.float32, w, None, d) == 0
        assert op.attn_leave(torch.bfloat16, w.bfloat16(), None, 64) == 0
    assert "a bias" in caplog.text and "not bf16" in caplog.text and f"no variant attn_gemv_k{hq * d}_d64" in caplog.text
    for ctx, splits in ((149, 16), (39, 16), (599, 16), (149, 1)):
        batch, kv, q, k, v = random_batch([1], [ctx], ps, hq, hkv, d, torch.float32, "cpu", seed=ctx)
        meta = ops.AttentionMetadata.build(batch, ps)
        ft.store_kv(kv, k, v, meta.slot_mapping)
        ref = ops.paged_attention(q, kv, meta, d**-0.5).view(1, -1) @ w.T
        parts = ft.paged_attention_partials(q, kv, batch.query_start_loc, batch.seq_lens, batch.page_table, 1,
                                            d**-0.5, splits=splits, leave=smem_gemv.LEAVE)
        del calls[:]
        got = op.attn_gemv(parts, w)
        assert got.shape == (1, 48) and _rel(got, ref) < 1e-5, ctx
        assert calls == ([(f"attn_gemv_k{hq * d}_d{d}", 48, 16, 64, 0)] if splits > 1 else [])  # (fp32: Triton's)
    with pytest.raises(ValueError, match="one contiguous token"):
        op.attn_gemv(parts._replace(out=torch.zeros(2, hq, d)), w)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU runs need TRITON_INTERPRET=1")
def test_backend_leaves_the_combine_to_o_proj(monkeypatch):
    """TritonBackend.norm_rope_attend_linear: a one-token, one-sequence, ungated step whose o_proj has an
    attn export runs the attention with its leave and the export (here a torch stand-in; 150 keys in 2
    splits of 128), equal to the attention combining itself + o_proj; a gated
    step, two sequences or $NVL72_ATTN_O_PROJ=0 take that path without the export."""
    from nvl72.model import attn_backends as ab

    hq, hkv, d, ps = 8, 2, 32, 4
    calls = []
    op = _op(calls, names=(), attn=(f"attn_gemv_k{hq * d}_d{d}",))
    monkeypatch.setattr(op, "attn_leave", lambda dtype, weight, bias, head_dim: smem_gemv.LEAVE)
    monkeypatch.setattr(smem_gemv, "load", lambda: op)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, hq * d, generator=g) * 0.1
    qw, kw = (torch.randn(d, generator=g) * 0.3 + 1 for _ in range(2))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))

    def run(backend, ctx, gated):
        t = len(ctx)
        batch, kv, _, _, _ = random_batch([1] * t, ctx, ps, hq, hkv, d, torch.float32, "cpu", seed=sum(ctx))
        qkv = torch.randn(t, hq * d * (2 if gated else 1) + 2 * hkv * d, generator=torch.Generator().manual_seed(t))
        q_raw, k_raw, v = qkv.split([hq * d * (2 if gated else 1), hkv * d, hkv * d], dim=1)
        cos, sin = ops.rope_cos_sin(batch.positions, inv_freq, torch.float32)
        return backend.norm_rope_attend_linear(q_raw, k_raw, v.view(t, hkv, d), qw, kw, cos, sin, hq, hkv, d, 1e-6,
                                               False, gated, kv, backend.plan(batch, ps), d**-0.5, w)

    monkeypatch.setenv(ab.ATTN_O_PROJ_ENV, "0")
    plain = ab.TritonBackend()
    monkeypatch.delenv(ab.ATTN_O_PROJ_ENV)
    backend = ab.TritonBackend()
    assert backend.attn_o_proj and not plain.attn_o_proj
    assert _rel(run(backend, [149], False), run(plain, [149], False)) < 1e-5
    assert [c[:4] for c in calls] == [(f"attn_gemv_k{hq * d}_d{d}", 40, 2, 64)]
    for ctx, gated in (([149], True), ([149, 20], False)):
        assert _rel(run(backend, ctx, gated), run(plain, ctx, gated)) < 1e-6
    assert len(calls) == 1


def test_attn_partials_contract(caplog):
    """attn_partials passes flat rows, the cache, fresh out / acc / ml and (splits, page_size, Hkv, scale,
    eps, pdl) to attn_one_token_g{G}_d{D} for an ungated bf16 step of one token; other steps get None,
    logged with the reason (no module, two tokens, another leave, a zero-centred norm, partial RoPE, fp32,
    a page size not a power of 2)."""
    calls = []
    hq, hkv, d, ps, splits = 8, 2, 32, 4, 16

    def export(*a):
        calls.append(a)

    op = smem_gemv.SmemGemv(SimpleNamespace(), SimpleNamespace(**{f"attn_one_token_g4_d{d}": export}))
    bf = torch.bfloat16
    batch, kv, _, _, _ = random_batch([1], [40], ps, hq, hkv, d, bf, "cpu")
    qkv = torch.randn(1, (hq + 2 * hkv) * d).to(bf)
    q_raw, k_raw, v = qkv.split([hq * d, hkv * d, hkv * d], 1)
    rows = [q_raw, k_raw, v.view(1, hkv, d), torch.ones(d, dtype=bf), torch.ones(d, dtype=bf),
            torch.ones(1, d, dtype=bf), torch.zeros(1, d, dtype=bf)]
    slots = torch.tensor([40])

    def call(rows=rows, zc=False, cache=kv, leave=smem_gemv.LEAVE, seq_lens=batch.seq_lens, heads=hq):
        return op.attn_partials(*rows, heads, d, 1e-6, zc, cache, slots, seq_lens, batch.page_table, 0.5, splits,
                                leave)

    parts = call()
    assert (parts.out.shape, parts.acc.shape, parts.ml.shape) == ((1, hq, d), (1, hq, splits, d), (1, hq, splits, 2))
    assert (parts.splits, parts.block_n, parts.leave) == (splits, ft.key_block(d), smem_gemv.LEAVE)
    (a,) = calls
    assert [t.data_ptr() for t in a[:7]] == [t.data_ptr() for t in rows] and all(t.dim() == 1 for t in a[:7])
    assert a[7] is slots and a[8] is batch.seq_lens and a[9].data_ptr() == batch.page_table.data_ptr()
    assert a[10].data_ptr() == kv.data_ptr() and a[11].data_ptr() == parts.out.data_ptr()
    assert a[12].data_ptr() == parts.acc.data_ptr() and a[13].data_ptr() == parts.ml.data_ptr()
    assert a[14].dtype == torch.int32 and a[15:] == (splits, ps, hkv, 0.5, 1e-6, 0)
    with caplog.at_level(logging.INFO, logger="nvl72.model.smem_gemv"):
        assert call(zc=True) is None and call(leave=4) is None and call(heads=16) is None
        assert call(rows=rows[:5] + [torch.ones(1, d // 2, dtype=bf)] * 2) is None
        assert call(rows=[t.float() for t in rows], cache=kv.float()) is None
        assert call(seq_lens=torch.tensor([41, 41], dtype=torch.int32)) is None
        assert call(cache=torch.zeros(kv.shape[:3] + (3, d), dtype=bf)) is None
        assert smem_gemv.SmemGemv(SimpleNamespace()).attn_partials(*rows, hq, d, 1e-6, False, kv, slots,
                                                                   batch.seq_lens, batch.page_table, 0.5, splits,
                                                                   smem_gemv.LEAVE) is None
    for why in ("zero-centred", "leave 4", "no variant attn_one_token_g8_d32", "RoPE on 16 of 32", "not all bf16",
                "2 sequences", "page_size 3", "no nvl72.kernels.sm90_attn"):
        assert why in caplog.text, why
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
    assert (smem_gemv.ROWS, smem_gemv.LEAVE) == (mod.ROWS, mod.LEAVE)
    assert {"gemv_k4096", "norm_gemv_k2048_d", "norm_gemv_k2048_zc_d"} <= set(mod.VARIANTS)
    assert "attn_gemv_k4096_d128" in mod.ATTN_VARIANTS
    with pytest.raises(ValueError, match="sm_100a"):
        mod.compile_for_export("sm_100a")
    for bad in (dict(k=1000), dict(k=2048, rows=6), dict(k=2048, norm="layer")):
        with pytest.raises(ValueError, match="K="):
            mod.GemvSmem(**bad)
    for bad in (dict(k=4096, head_dim=96), dict(k=4096, head_dim=128, leave=3), dict(k=4096, head_dim=128, leave=1),
                dict(k=4096, head_dim=128, leave=6), dict(k=4096, head_dim=128, leave=16)):
        with pytest.raises(ValueError, match="head_dim"):
            mod.AttnGemvSmem(**bad)
    assert build.compile_module("nvl72.kernels.sm90_gemv", "sm_90a", str(tmp_path)) == [*mod.VARIANTS,
                                                                                       *mod.ATTN_VARIANTS]
    attn = importlib.import_module("nvl72.kernels.sm90_attn")
    assert attn.LEAVE == smem_gemv.LEAVE and attn.BLOCK_N == ft.key_block(attn.D)
    with pytest.raises(ValueError, match="sm_100a"):
        attn.compile_for_export("sm_100a")
    for bad in (dict(group=8, heads_per_cta=3), dict(group=8, heads_per_cta=0),
                dict(group=8, heads_per_cta=2, leave=1)):
        with pytest.raises(ValueError, match="heads_per_cta="):
            attn.AttnOneToken(**bad)
    assert build.compile_module("nvl72.kernels.sm90_attn", "sm_90a", str(tmp_path)) == [*attn.VARIANTS]


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


@pytest.mark.gpu
def test_gpu_attn_gemv_matches_reference_in_a_graph():
    """The bundle's attn_gemv_k4096_d128 after the Triton attention left its partials (Qwen3-30B-A3B
    heads, 32 x 128 over 4 KV heads, decode_splits' split count): contexts whose keys fill 1 to 6, 8 and
    10 splits (2-8 combined by the kernel, in two rounds past 4, the others by the attention), output
    NaN-poisoned, against o_proj of the fp32 reference attention and of the attention combining itself;
    then attention + o_proj captured in a CUDA graph at the longest context and replayed at each length
    on fresh q."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("sm_90")
    op = smem_gemv.load()
    assert op is not None, "no nvl72.kernels.sm90_gemv in the kernel bundle ($NVL72_KERNEL_BUNDLE)"
    hq, hkv, d, ps, dev = 32, 4, 128, 16, "cuda"
    w = (torch.randn(2048, hq * d, device=dev) * 0.02).to(torch.bfloat16)
    assert op.attn_leave(torch.bfloat16, w, None, d) == smem_gemv.LEAVE
    lens = (40, 100, 150, 256, 300, 380, 500, 512, 600)
    batch, kv, q, k, v = random_batch([1], [lens[-1] - 1], ps, hq, hkv, d, torch.bfloat16, dev, seed=3)
    ft.store_kv(kv, k, v, ops.AttentionMetadata.build(batch, ps).slot_mapping)
    args = (kv, batch.query_start_loc, batch.seq_lens, batch.page_table, 1, d**-0.5)

    def o_proj():
        parts = ft.paged_attention_partials(q, *args, out=out_attn, leave=smem_gemv.LEAVE)
        return parts, op.attn_gemv(parts, w)

    def reference():
        meta = ops.AttentionMetadata.build(batch, ps)
        x = ops.paged_attention(q.float(), kv.float(), meta, d**-0.5).to(torch.bfloat16).float().view(1, -1)
        own = op.gemv(ft.paged_attention(q, *args).view(1, -1), w)
        return x @ w.float().T, own

    out_attn = torch.empty_like(q)
    for n in lens:
        batch.seq_lens.fill_(n)
        batch.positions.fill_(n - 1)
        q.copy_(torch.randn_like(q))
        out_attn.fill_(float("nan"))
        parts, got = o_proj()
        active = int(active_splits(batch.seq_lens, parts.splits, parts.block_n))
        assert out_attn.isnan().any() == (1 < active <= smem_gemv.LEAVE), (n, active)
        ref, own = reference()
        assert _rel(got, ref) < 1e-2 and _rel(got, own) < 3e-3, (n, active, _rel(got, ref), _rel(got, own))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _, got = o_proj()
    torch.cuda.current_stream().wait_stream(side)
    for n in lens:
        batch.seq_lens.fill_(n)
        batch.positions.fill_(n - 1)
        q.copy_(torch.randn_like(q))
        got.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, own = reference()
        assert _rel(got, ref) < 1e-2 and _rel(got, own) < 3e-3, n


def _norm_rope_ref(x, w, cos, sin, eps):
    """fp32 rows x [H, D] RMSNorm'd (weight w) and roped over all D dims, rounded to bf16 where
    fused_triton's _norm_rope_rows rounds."""
    half = x.shape[1] // 2
    y = _bf16(_bf16(x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + eps)) * w.float())
    partner = torch.cat([-y[:, half:], y[:, :half]], 1)
    return _bf16(_bf16(y * cos.float()) + _bf16(partner * sin.float()))


@pytest.mark.gpu
def test_gpu_attn_partials_match_triton_in_a_graph():
    """The bundle's attn_one_token_g8_d128 (Qwen3-30B-A3B heads: 32 x 128 over 4 KV heads, page size 16,
    decode_splits' split count) against Triton's attention with the q/k norm inside, each on its own
    copy of the cache: contexts whose keys fill 1 split, 2-8 (left to o_proj), 10 and 32 (combined by
    the last split to arrive) and two blocks a split; the outputs (combined as o_proj combines) against
    Triton's and the fp32 reference over the normed, roped q, the stored key and value against
    Triton's, the rest of the cache untouched; then captured in a CUDA graph at the longest context and
    replayed at each length on fresh q/k/v, outputs NaN-poisoned first."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("sm_90")
    op = smem_gemv.load()
    assert op is not None and op.attn_module is not None, "no nvl72.kernels.sm90_attn in the kernel bundle"
    hq, hkv, d, ps, dev, eps = 32, 4, 128, 16, "cuda", 1e-6
    lens = (40, 100, 150, 300, 500, 512, 600, 2100, 3000)
    batch, kv, _, _, _ = random_batch([1], [lens[-1] - 1], ps, hq, hkv, d, torch.bfloat16, dev, seed=4)
    qkv = torch.empty(1, (hq + 2 * hkv) * d, device=dev, dtype=torch.bfloat16)
    q_raw, k_raw, v = qkv.split([hq * d, hkv * d, hkv * d], 1)
    v = v.view(1, hkv, d)
    qw, kw = ((torch.randn(d, device=dev) * 0.3 + 1).to(torch.bfloat16) for _ in range(2))
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev).float() / d))
    cos, sin = (torch.empty(1, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    slots = torch.empty(1, dtype=torch.int64, device=dev)
    splits = ft.decode_splits(kv.device, 1, hkv, batch.page_table.shape[1] * ps, ft.key_block(d))
    args = (q_raw, k_raw, v, qw, kw, cos, sin, hq, d, eps, False)

    def state(n):
        batch.seq_lens.fill_(n)
        batch.positions.fill_(n - 1)
        qkv.copy_(torch.randn_like(qkv))
        c, s = ft.rope_cos_sin(batch.positions, inv_freq, torch.bfloat16)
        cos.copy_(c)
        sin.copy_(s)
        slots.copy_(ft.slot_mapping(batch.positions, batch.query_start_loc, batch.page_table, ps))

    def ours(cache):
        return op.attn_partials(*args, cache, slots, batch.seq_lens, batch.page_table, d**-0.5, splits, smem_gemv.LEAVE)

    def check(n, got, cache, before):
        theirs = before.clone()
        want, _ = ft.norm_rope_paged_attention_partials(*args, False, theirs, slots, batch.query_start_loc,
                                                        batch.seq_lens, batch.page_table, d**-0.5, splits,
                                                        smem_gemv.LEAVE)
        q = _norm_rope_ref(q_raw.float().view(hq, d), qw, cos, sin, eps)
        ref = ops.paged_attention(q.view(1, hq, d), theirs.float(), ops.AttentionMetadata.build(batch, ps), d**-0.5)
        mine, triton = combine_partials(got), combine_partials(want)
        assert _rel(mine, triton) < 5e-3 and _rel(mine, ref) < 1e-2, (n, _rel(mine, triton), _rel(mine, ref))
        page, off = divmod(int(slots), ps)
        assert _rel(cache[page, :, :, off], theirs[page, :, :, off]) < 1e-2, n
        cache[page, :, :, off] = theirs[page, :, :, off]
        assert torch.equal(cache, theirs), n

    for n in lens:
        state(n)
        before = kv.clone()
        parts = ours(kv)
        assert parts is not None and parts.splits == splits
        check(n, parts, kv, before)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            parts = ours(kv)
    torch.cuda.current_stream().wait_stream(side)
    for n in lens:
        state(n)
        before = kv.clone()
        for t in (parts.out, parts.acc, parts.ml):
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(n, parts, kv, before)
