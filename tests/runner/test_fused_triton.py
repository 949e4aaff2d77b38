"""Triton attention-path kernels vs the torch references (ops.py), on random ragged paged batches.

Runs on a CUDA GPU, or on CPU in Triton's interpreter when TRITON_INTERPRET=1; skipped where
triton is not importable (the CPU CI venv)."""
import os

import pytest
import torch

from nvl72.model import ops
from tests.runner.paged import active_splits, combine_partials, random_batch, rel_err
from tests.runner.ptx import COMPILES, compile_pdl

ft = pytest.importorskip("nvl72.model.fused_triton", exc_type=ImportError)

DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu),
           pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                        reason="CPU runs need TRITON_INTERPRET=1"))]
TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
LOW = [torch.float32, torch.float16, torch.bfloat16]


def skip_interpreted_bf16(device, dtype):
    """Triton's interpreter computes through numpy, which has no bf16: its bf16 tl.dot is garbage and
    its bf16 casts truncate. fp16 covers the low-precision path there; bf16 runs on the GPU."""
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("bf16 is not emulated faithfully by Triton's interpreter")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("case", [
    # (qlens, ctx, page_size, hq, hkv, d)
    ([1, 1, 1], [0, 17, 40], 4, 8, 2, 16),       # decode, GQA 4
    ([5, 1, 9, 2], [3, 30, 0, 15], 4, 4, 4, 32),  # mixed prefill/decode, MHA
    ([20, 3], [6, 0], 16, 6, 2, 16),              # group 3 (padded to 4), several q blocks
])
def test_paged_attention_matches_reference(device, dtype, case):
    skip_interpreted_bf16(device, dtype)
    qlens, ctx, ps, hq, hkv, d = case
    batch, kv, q, k, v = random_batch(qlens, ctx, ps, hq, hkv, d, dtype, device, seed=len(qlens) + d)
    meta = ops.AttentionMetadata.build(batch, ps)
    ref_kv = kv.float().clone()
    ops.write_kv(ref_kv, k.float(), v.float(), meta.slot_mapping)
    ref = ops.paged_attention(q.float(), ref_kv, meta, d**-0.5)
    ft.store_kv(kv, k, v, meta.slot_mapping)
    assert torch.equal(kv.float(), ref_kv.to(dtype).float())
    out = ft.paged_attention(q, kv, batch.query_start_loc, batch.seq_lens, batch.page_table, max(qlens), d**-0.5)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [2, 4, 16])
def test_decode_split_keys_match_reference(device, dtype, splits):
    """Single-token queries with the keys split over programs (splits past the keys included: 16
    splits of a 140-key context, 3 of them active; of a 601-key one, 10: the combine's loop past its
    first four partials) and combined by the last active program of each (sequence, KV head);
    contexts within one split (1, 18 keys) written by that program: the reference's result, twice
    (the arrival counters are back at 0 after each launch)."""
    hq, hkv, d, ps = 8, 2, 16, 4
    batch, kv, q, k, v = random_batch([1, 1, 1, 1], [0, 17, 139, 600], ps, hq, hkv, d, dtype, device, seed=splits)
    meta = ops.AttentionMetadata.build(batch, ps)
    ft.store_kv(kv, k, v, meta.slot_mapping)
    ref = ops.paged_attention(q.float(), kv.float(), meta, d**-0.5)
    for _ in range(2):
        out = ft.paged_attention(q, kv, batch.query_start_loc, batch.seq_lens, batch.page_table, 1, d**-0.5,
                                 splits=splits)
        assert rel_err(out, ref) < TOL[dtype]
        assert not ft._SPLIT_COUNTERS[q.device].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_left_partials_combine_to_the_reference(device, dtype):
    """paged_attention_partials with leave=4 over 16 splits of 64-key blocks: the sequences whose keys
    fill 2-4 splits (100, 139, 250 keys) leave their output rows unwritten (NaN-poisoned) and their
    partials combine (tests.runner.paged.combine_partials) to the reference; one split (40 keys) and
    ten (600) are written as paged_attention writes them, through the arrival counters (back at 0)."""
    skip_interpreted_bf16(device, dtype)
    hq, hkv, d, ps = 8, 2, 16, 4
    ctx = [39, 99, 138, 249, 599]
    batch, kv, q, k, v = random_batch([1] * 5, ctx, ps, hq, hkv, d, dtype, device, seed=7)
    meta = ops.AttentionMetadata.build(batch, ps)
    ft.store_kv(kv, k, v, meta.slot_mapping)
    ref = ops.paged_attention(q.float(), kv.float(), meta, d**-0.5)
    args = (q, kv, batch.query_start_loc, batch.seq_lens, batch.page_table, 1, d**-0.5)
    assert active_splits(batch.seq_lens, 16, 64).tolist() == [1, 2, 3, 4, 10]
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        p = ft.paged_attention_partials(*args, out=out, splits=16, leave=4)
        assert p.out is out and (p.splits, p.block_n, p.leave) == (16, 64, 4)
        left = torch.tensor([False, True, True, True, False])
        assert out[left.to(device)].isnan().all() and not out[~left.to(device)].isnan().any()
        assert rel_err(combine_partials(p), ref) < TOL[dtype]
        assert not ft._SPLIT_COUNTERS[q.device].any()
    with pytest.raises(ValueError, match="leave=2"):
        ft.paged_attention_partials(q, kv, batch.query_start_loc, batch.seq_lens, batch.page_table, 2, d**-0.5,
                                    leave=2)


def test_decode_splits_choice():
    cpu = torch.device("cpu")
    assert ft.decode_splits(cpu, 1, 2, 4096, 64) == 4  # 8 "SMs" / 2 programs
    assert ft.decode_splits(cpu, 1, 1, 100, 64) == 2  # the page table holds two key blocks
    assert ft.decode_splits(cpu, 8, 4, 4096, 64) == 1  # enough programs already
    with pytest.raises(ValueError, match="splits=2"):
        ft.paged_attention(torch.zeros(2, 2, 16), torch.zeros(3, 2, 2, 4, 16), torch.tensor([0, 2]),
                           torch.tensor([2]), torch.zeros(1, 1, dtype=torch.int32), 2, 1.0, splits=2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("gated,zero_centered,rot,splits", [
    (False, False, 16, None), (True, True, 8, 1), (False, False, 16, 2), (True, False, 4, 16)])
def test_norm_rope_paged_attention_equals_two_kernels(device, dtype, gated, zero_centered, rot, splits):
    """The q/k norm, RoPE and K/V store inside the attention kernel give qk_norm_rope + paged_attention's
    output and cache bit for bit (fp32 within rounding: the compiler may contract the norm's and
    RoPE's products differently in the two kernels): one split, 2 splits of a 600-key context (the new
    key in the fifth block of the second split), 16 (10 active) and the default; q/k/v as column
    slices of one packed projection; a padded row (slot -1) stores nothing."""
    skip_interpreted_bf16(device, dtype)
    hq, hkv, d, ps = 8, 2, 16, 4
    batch, kv, _, _, _ = random_batch([1, 1, 1, 1, 1], [0, 17, 139, 600, 5], ps, hq, hkv, d, dtype, device, seed=rot)
    t = 5
    g = torch.Generator().manual_seed(splits or 0)
    qw_rows = hq * d * (2 if gated else 1)
    qkv = torch.randn(t, qw_rows + 2 * hkv * d, generator=g).to(dtype).to(device)
    q_raw, k_raw, v = qkv.split([qw_rows, hkv * d, hkv * d], dim=1)
    v = v.view(t, hkv, d)
    qw, kw = (torch.randn(d, generator=g).to(dtype).to(device) * 0.3 + (0 if zero_centered else 1) for _ in range(2))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    cos, sin = (x.to(device) for x in ops.rope_cos_sin(batch.positions.cpu(), inv_freq, dtype))
    slots = ops.AttentionMetadata.build(batch, ps).slot_mapping.clone()
    slots[4] = -1  # a padded graph row: its key goes nowhere
    kv_ref = kv.clone()
    q, _, gate_ref = ft.qk_norm_rope(q_raw, k_raw, qw, kw, cos, sin, hq, hkv, d, 1e-6, zero_centered, gated, v,
                                     kv_ref, slots)
    args = (batch.query_start_loc, batch.seq_lens, batch.page_table)
    ref = ft.paged_attention(q, kv_ref, *args, 1, d**-0.5, splits=splits)
    out, gate = ft.norm_rope_paged_attention(q_raw, k_raw, v, qw, kw, cos, sin, hq, d, 1e-6, zero_centered, gated,
                                             kv, slots, *args, d**-0.5, splits=splits)
    same = torch.equal if dtype != torch.float32 else lambda a, b: rel_err(a, b) < 1e-6
    assert same(kv, kv_ref)
    assert same(out[:4], ref[:4])  # (row 4 read its stale slot in the two-kernel path)
    if gated:
        assert torch.equal(gate.reshape(t, hq * d), gate_ref)
    else:
        assert gate is None
    with pytest.raises(ValueError, match="max_query_len=2"):
        ft.paged_attention(q, kv, *args, 2, d**-0.5, norm=ft.QKNorm(k_raw, v, qw, kw, cos, sin, slots, 1e-6, False))


@pytest.mark.parametrize("device", DEVICES)
def test_store_kv_skips_negative_slots(device):
    batch, kv, q, k, v = random_batch([3], [2], 4, 2, 2, 16, torch.float32, device, seed=3)
    before = kv.clone()
    ft.store_kv(kv, k, v, torch.full((3,), -1, dtype=torch.long, device=device))
    assert torch.equal(kv, before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("gated,zero_centered,rot,t", [(False, False, 16, 7), (True, True, 8, 7), (True, False, 4, 7),
                                                        (True, False, 8, ft.QK_ROWS_FROM + 19)])
def test_qk_norm_rope_matches_layer_math(device, dtype, gated, zero_centered, rot, t):
    """Same math as layers.Attention with the references: gate split, q/k RMSNorm, partial RoPE; past
    ft.QK_ROWS_FROM tokens (prefill) ft.QK_ROWS tokens a program, the last block partial."""
    skip_interpreted_bf16(device, dtype)
    g = torch.Generator().manual_seed(rot + gated)
    hq, hkv, d = 4, 2, 16
    q_raw = torch.randn(t, hq * d * (2 if gated else 1), generator=g).to(dtype)
    k_raw = torch.randn(t, hkv * d, generator=g).to(dtype)
    qw, kw = (torch.randn(d, generator=g).to(dtype) * 0.3 + (0 if zero_centered else 1) for _ in range(2))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    cos, sin = ops.rope_cos_sin(torch.randint(0, 500, (t,), generator=g), inv_freq, dtype)
    if gated:
        q_ref, gate_ref = q_raw.view(t, hq, 2 * d).chunk(2, dim=-1)
        gate_ref = gate_ref.reshape(t, hq * d)
    else:
        q_ref, gate_ref = q_raw.view(t, hq, d), None
    q_ref = ops.apply_rope(ops.rms_norm(q_ref, qw, 1e-6, zero_centered), cos, sin)
    k_ref = ops.apply_rope(ops.rms_norm(k_raw.view(t, hkv, d), kw, 1e-6, zero_centered), cos, sin)
    dev = [x.to(device) for x in (q_raw, k_raw, qw, kw, cos, sin)]
    q, k, gate = ft.qk_norm_rope(*dev, hq, hkv, d, 1e-6, zero_centered, gated)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(q.cpu(), q_ref) < tol and rel_err(k.cpu(), k_ref) < tol
    # with the cache: the same outputs, and store_kv's writes (slot -1: none)
    v = torch.randn(t, hkv, d, generator=g).to(dtype).to(device)
    pages = -(-(t + 1) // 4)
    kv, kv_ref = (torch.zeros(pages, 2, hkv, 4, d, dtype=dtype, device=device) for _ in range(2))
    slots = torch.randperm(pages * 4, generator=g)[:t].to(device)
    slots[2] = -1
    q2, k2, gate2 = ft.qk_norm_rope(*dev, hq, hkv, d, 1e-6, zero_centered, gated, v, kv, slots)
    assert torch.equal(q2, q) and torch.equal(k2, k)
    ft.store_kv(kv_ref, k, v, slots)
    assert torch.equal(kv, kv_ref) and int(kv.ne(0).sum()) == 2 * (t - 1) * hkv * d
    if gated:
        assert torch.equal(gate.cpu(), gate_ref)
    else:
        assert gate is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("k,zero_centered,with_delta", [(300, False, True), (2048, True, True), (96, False, False)])
def test_norm_gemv_matches_add_rms_norm_then_gemv(device, dtype, k, zero_centered, with_delta):
    """The residual add + RMSNorm inside the GEMV: the sum bit-exact, the output as add_rms_norm then
    gemv give it (K not a power of two: masked columns; 2048: two K steps)."""
    skip_interpreted_bf16(device, dtype)
    g = torch.Generator().manual_seed(k + zero_centered)
    x = (torch.randn(1, k, generator=g) * 3).to(dtype).to(device)
    delta = torch.randn(1, k, generator=g).to(dtype).to(device) if with_delta else None
    nw = (torch.randn(k, generator=g) * 0.3 + (0 if zero_centered else 1)).to(dtype).to(device)
    w = (torch.randn(40, k, generator=g) * k**-0.5).to(dtype).to(device)
    b = torch.randn(40, generator=g).to(dtype).to(device)
    s_ref, h = ft.add_rms_norm(x, delta, nw, 1e-6, zero_centered)
    want = ft.gemv(h, w, b)
    s, got = ft.norm_gemv(x, delta, nw, 1e-6, zero_centered, w, b)
    assert torch.equal(s, s_ref) and (s is x) == (delta is None)
    assert got.dtype == dtype and rel_err(got, want) < (1e-6 if dtype == torch.float32 else 1e-3)
    ref = torch.nn.functional.linear(ops.rms_norm(s_ref.cpu().double(), nw.cpu().double(), 1e-6, zero_centered),
                                     w.cpu().double(), b.cpu().double())
    assert rel_err(got.cpu(), ref) < TOL[dtype]
    with pytest.raises(ValueError, match="norm weight"):
        ft.norm_gemv(x, delta, nw[:-1], 1e-6, zero_centered, w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_reference(device, dtype, zero_centered, with_delta):
    """The decoder's residual add + RMSNorm: the sum bit-exact, the norm as ops.rms_norm rounds it."""
    skip_interpreted_bf16(device, dtype)
    g = torch.Generator().manual_seed(7 + zero_centered + 2 * with_delta)
    t, h = 5, 80  # h not a power of two: masked columns
    x = (torch.randn(t, h, generator=g) * 3).to(dtype)
    delta = torch.randn(t, h, generator=g).to(dtype) if with_delta else None
    w = (torch.randn(h, generator=g) * 0.3 + (0 if zero_centered else 1)).to(dtype)
    router = (torch.randn(10, h, generator=g) * h**-0.5).to(dtype)  # 10 experts: a partial last block
    ref_sum = x if delta is None else x + delta
    ref = ops.rms_norm(ref_sum, w, 1e-6, zero_centered)
    dev = (x.to(device), None if delta is None else delta.to(device), w.to(device), 1e-6, zero_centered)
    s, out = ft.add_rms_norm(*dev)
    assert torch.equal(s.cpu(), ref_sum)
    assert out.dtype == dtype and rel_err(out.cpu(), ref) < (1e-6 if dtype == torch.float32 else 1e-2)
    s2, out2, logits = ft.add_rms_norm(*dev, router=router.to(device))  # the MoE router's GEMV folded in
    assert torch.equal(s2, s) and torch.equal(out2, out)
    ref_logits = torch.nn.functional.linear(out.cpu().double(), router.double())
    assert logits.dtype == dtype and rel_err(logits.cpu(), ref_logits) < (1e-5 if dtype == torch.float32 else 1e-2)


def slot_mapping_on_device(batch, page_size: int) -> torch.Tensor:
    """ft.slot_mapping in torch ops: each token's sequence by a search over query_start_loc, -1 where
    the page table has none."""
    tok = torch.arange(batch.num_tokens, device=batch.positions.device)
    seq_of_token = torch.searchsorted(batch.query_start_loc[1:].long(), tok, right=True)
    seq_of_token = seq_of_token.clamp_max(max(batch.num_seqs - 1, 0))
    pos = batch.positions.long()
    pages = batch.page_table.long()[seq_of_token, pos // page_size]
    return torch.where(pages >= 0, pages * page_size + pos % page_size, torch.full_like(pages, -1))


@pytest.mark.parametrize("device", DEVICES)
def test_slot_mapping_matches_torch_form(device):
    batch, *_ = random_batch([3, 1, 6, 1], [5, 9, 0, 30], 4, 4, 2, 16, torch.float32, device, seed=1)
    assert torch.equal(slot_mapping_on_device(batch, 4), ops.AttentionMetadata.build(batch, 4).slot_mapping.to(device))
    assert torch.equal(ft.slot_mapping(batch.positions, batch.query_start_loc, batch.page_table, 4),
                       slot_mapping_on_device(batch, 4))
    batch.page_table[1, :] = -1  # a padded row: no pages at all
    slots = ft.slot_mapping(batch.positions, batch.query_start_loc, batch.page_table, 4)
    assert torch.equal(slots, slot_mapping_on_device(batch, 4)) and int(slots[3]) == -1
    # more sequences than one step of the kernel's search (ft.SLOT_BLOCK): the search loops
    g = torch.Generator().manual_seed(2)
    n = ft.SLOT_BLOCK + 7
    qlens = torch.randint(1, 3, (n,), generator=g).tolist()
    ctxs = torch.randint(0, 12, (n,), generator=g).tolist()
    batch, *_ = random_batch(qlens, ctxs, 4, 4, 2, 16, torch.float32, device, seed=3)
    assert torch.equal(ft.slot_mapping(batch.positions, batch.query_start_loc, batch.page_table, 4),
                       slot_mapping_on_device(batch, 4))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("rot", [8, 64])
def test_rope_cos_sin_matches_reference(device, dtype, rot):
    skip_interpreted_bf16(device, dtype)
    positions = torch.randint(0, 40000, (9,), generator=torch.Generator().manual_seed(rot))
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, rot, 2).float() / rot))
    ref = ops.rope_cos_sin(positions, inv_freq, dtype)
    got = ft.rope_cos_sin(positions.to(device), inv_freq.to(device), dtype)
    for r, x in zip(ref, got):
        assert x.dtype == dtype and rel_err(x.cpu(), r) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("n,k,bias", [(4100, 96, False), (40, 2048, True), (2048, 300, True), (300, 5000, True)])
def test_gemv_matches_linear(device, dtype, n, k, bias):
    """One K step, and (300 x 5000) three steps of 2048 columns, the last partial: the kernel loads
    each step's weight tile one step ahead."""
    skip_interpreted_bf16(device, dtype)
    g = torch.Generator().manual_seed(n + k)
    x, w = torch.randn(1, k, generator=g).to(dtype), (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    got = ft.gemv(x.to(device), w.to(device), None if b is None else b.to(device))
    assert got.shape == (1, n) and got.dtype == dtype
    assert rel_err(got.cpu(), ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_bad_shapes_name_the_value():
    q = torch.zeros(2, 4, 24)
    kv = torch.zeros(3, 2, 2, 4, 24)
    with pytest.raises(ValueError, match="head_dim 24"):
        ft.paged_attention(q, kv, torch.tensor([0, 2]), torch.tensor([2]), torch.zeros(1, 1), 2, 1.0)
    with pytest.raises(ValueError, match="head_dim=12"):
        ft.qk_norm_rope(torch.zeros(1, 12), torch.zeros(1, 12), torch.ones(12), torch.ones(12), torch.zeros(1, 12),
                        torch.zeros(1, 12), 1, 1, 12, 1e-6, False, False)


@COMPILES
@pytest.mark.parametrize("pdl", [True, False])
def test_kernels_compile_for_hopper(pdl):
    """The kernels lower to a cubin for sm_90 on a machine without a GPU (bf16, Qwen3-30B-A3B shape),
    with programmatic dependent launch (griddepcontrol in the PTX) and without."""
    i32, i64 = "i32", "i64"
    attn_sig = {"q": "*bf16", "kv_cache": "*bf16", "out": "*bf16", "part_acc": "*fp32", "part_ml": "*fp32",
                "counters": "*i32", "qsl": "*i32", "seq_lens": "*i32",
                "page_table": "*i32", "scale": "fp32", **{n: i64 for n in (
                    "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_page", "stride_kind", "stride_head",
                    "stride_tok", "stride_pt")},
                "k_raw": "*bf16", "v_raw": "*bf16", "qw": "*bf16", "kw": "*bf16", "cos": "*bf16", "sin": "*bf16",
                "slots": "*i64", "rms_eps": "fp32", "stride_kr": i64, "stride_vr": i64, "stride_cs": i64}
    for bm, nsplit, norm in ((2, 1, False), (2, 32, False), (8, 1, False), (2, 1, True), (2, 32, True)):
        # as paged_attention launches it: without splits the output stands in for the counters
        sig = {**attn_sig, "counters": "*i32" if nsplit > 1 else "*bf16"}
        ptx = compile_pdl(ft._paged_attention_kernel, sig, {
            "GROUP": 8, "GROUP_PAD": 8, "BLOCK_M": bm, "BLOCK_N": 64, "D": 128, "PAGE_SIZE": 16, "IEEE": False,
            "NSPLIT": nsplit, "EARLY": pdl and nsplit > 1, "NORM": norm, "R": 128 if norm else 0, "ZC": False,
            "LEAVE": 4 if nsplit > 1 else 0}, pdl)
        if pdl and nsplit > 1:  # page ids and earlier keys requested before the wait; this step's K/V, q after it
            before, after = ptx[:ptx.index("griddepcontrol.wait")], ptx[ptx.index("griddepcontrol.wait"):]
            assert before.count("ld.global") >= 4 and "ld.global" in after
            if norm:  # the new K/V stored after the wait only
                assert "st.global" not in before and "st.global" in after
    for norm in (0, 1, 2):  # plain, RMSNorm(x), RMSNorm(x + delta) (norm_gemv)
        ptx = compile_pdl(ft._gemv_kernel, {"x": "*bf16", "w": "*bf16", "bias": "*bf16", "out": "*bf16", "N": i32,
                                            "K": i32, "stride_w": i32, "delta": "*bf16", "norm_w": "*bf16",
                                            "sum_out": "*bf16", "rms_eps": "fp32"},
                          {"HAS_BIAS": False, "NORM": norm, "ZC": False, "BLOCK_N": 8, "BLOCK_K": 1024,
                           "BLOCK_H": 2048 if norm else 1}, pdl)
        if pdl:  # the first weight tile is requested before the wait (its load overlaps the previous kernel)
            assert "ld.global" in ptx[:ptx.index("griddepcontrol.wait")]
    compile_pdl(ft._slot_mapping_kernel, {"positions": "*i64", "qsl": "*i32", "page_table": "*i32", "slots": "*i64",
                                          "num_seqs": i32, "width": i32, "stride_pt": i32},
                {"PAGE_SIZE": 16, "BLOCK_B": 64}, pdl)
    compile_pdl(ft._rope_cos_sin_kernel, {"positions": "*i64", "inv_freq": "*fp32", "cos": "*bf16", "sin": "*bf16"},
                {"HALF": 64, "BLOCK": 64}, pdl)
    for block_e in (0, ft.ROUTER_BLOCK_E):
        compile_pdl(ft._add_rms_norm_kernel, {
            "x": "*bf16", "delta": "*bf16", "w": "*bf16", "sum_out": "*bf16", "norm_out": "*bf16", "router": "*bf16",
            "logits": "*bf16", "rms_eps": "fp32", "stride_x": i32, "stride_d": i32, "E": i32},
            {"H": 2048, "BLOCK": 2048, "HAS_DELTA": True, "ZC": False, "BLOCK_E": block_e}, pdl)
    norm_sig = {"q_raw": "*bf16", "k_raw": "*bf16", "qw": "*bf16", "kw": "*bf16", "cos": "*bf16", "sin": "*bf16",
                "q_out": "*bf16", "k_out": "*bf16", "gate_out": "*bf16", "rms_eps": "fp32", "T": i32, "stride_q": i32,
                "stride_k": i32, "stride_cs": i32, "v": "*bf16", "kv_cache": "*bf16", "slots": "*i64",
                **{n: i64 for n in ("stride_v", "stride_page", "stride_kind", "stride_head", "stride_tok")}}
    compile_pdl(ft._qk_norm_rope_kernel, norm_sig, {
        "HQ": 32, "HKV": 4, "D": 128, "R": 128, "GATED": False, "ZC": False, "STORE": True, "PAGE_SIZE": 16,
        "BLOCK_T": 1}, pdl)
    compile_pdl(ft._store_kv_kernel, {"k": "*bf16", "v": "*bf16", "kv_cache": "*bf16", "slots": "*i64",
                                      **{n: i64 for n in ("stride_kt", "stride_vt", "stride_page", "stride_kind",
                                                          "stride_head", "stride_tok")}},
                {"PAGE_SIZE": 16, "D": 128}, pdl)


def test_split_counters_keep_outgrown_buffers_alive():
    """A larger request gets a new zeroed buffer; the old one stays referenced (CUDA graphs captured with
    it keep using it: freed, its memory could be handed to another tensor under a replay)."""
    dev = torch.device("cpu")
    ft._SPLIT_COUNTERS.pop(dev, None)
    small = ft.split_counters(dev, 10)
    assert ft.split_counters(dev, small.numel()) is small
    big = ft.split_counters(dev, small.numel() + 1)
    assert big is not small and big.numel() > small.numel() and not big.any()
    assert any(c is small for c in ft._RETIRED_COUNTERS)
