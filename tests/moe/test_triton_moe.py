"""The Triton data-path kernels of the FP8 decode path against the torch references: on a GPU, or
through Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA).

The interpreter's fp32 -> e4m3 cast does not round as the hardware does, so quantized values are
compared exactly only kernel against kernel; scales (from the block amax) exactly against the
reference; dequantized values against the reference within the interpreter's cast error."""
from types import SimpleNamespace

import pytest
import torch

from moe import backend, reference
from moe.routing import permute_contiguous, permute_masked
from tests.runner.ptx import COMPILES, compile_pdl

triton_moe = pytest.importorskip("moe.kernels.triton_moe")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DEQ_TOL = 1e-2 if DEV == "cuda" else 0.1


def _ids(t, e, k, gen):
    """[T, k] distinct experts per token, random."""
    return torch.rand(t, e, generator=gen).argsort(1)[:, :k].to(DEV)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize(
    "t,e,k,num_local,offset",
    [(1, 128, 8, 128, 0), (5, 8, 2, 8, 0), (64, 128, 8, 128, 0), (300, 16, 4, 8, 8), (257, 32, 4, 16, 0)],
)
def test_permute_masked_kernel_matches_torch(t, e, k, num_local, offset):
    """Rows (stable rank inside each expert), counts and -1 for other ranks' experts, bit for bit;
    300 x 4 pairs span two of the kernel's 1024-pair chunks."""
    gen = torch.Generator().manual_seed(t + e)
    ids = _ids(t, e, k, gen)
    cap = -(-t // backend.DECODE_ALIGN) * backend.DECODE_ALIGN
    got = triton_moe.permute_masked(ids, num_local, cap, offset)
    want = permute_masked(ids, num_local, cap, offset)
    assert torch.equal(got.row_of, want.row_of)
    assert got.counts.dtype == torch.int32 and torch.equal(got.counts.long(), want.counts)
    assert (got.num_rows, got.capacity, got.layout) == (want.num_rows, want.capacity, "masked")
    if offset or num_local < e:
        assert bool((got.row_of == -1).any())


@pytest.mark.parametrize("t,e,k,num_local,offset,align", [(1, 128, 8, 128, 0, 128), (300, 16, 4, 8, 8, 128),
                                                         (257, 32, 4, 16, 0, 64), (40, 64, 8, 64, 0, 16),
                                                         (3, 8, 2, 4, 4, 128)])
def test_permute_contiguous_kernel_matches_torch(t, e, k, num_local, offset, align):
    """Rows and counts bit for bit; tile_expert equal on the reference's tiles and -1 on the spare
    tiles up to the host-side bound; every tile's rows are its expert's (so the GEMM sees them)."""
    gen = torch.Generator().manual_seed(t * 3 + e + align)
    ids = _ids(t, e, k, gen)
    ids[0, 0] = offset  # the first local expert is never empty, the others may be
    got = triton_moe.permute_contiguous(ids, num_local, offset, align)
    want = permute_contiguous(ids, num_local, offset, align)
    assert torch.equal(got.row_of, want.row_of)
    assert torch.equal(got.counts.long(), want.counts)
    assert got.num_rows == triton_moe.contiguous_rows_bound(t * k, num_local, align) >= want.num_rows
    nt = want.num_rows // align
    assert torch.equal(got.tile_expert[:nt], want.tile_expert)
    assert bool((got.tile_expert[nt:] == -1).all())
    rows = got.row_of[got.row_of >= 0]
    local = (ids[got.row_of >= 0] - offset).to(torch.int32)
    assert torch.equal(got.tile_expert[rows // align], local)


def test_quant_kernels_row_split_equals_one_block_programs(monkeypatch):
    """Prefill-sized launches (several K-blocks per program, a partial last group: 3 blocks of 128
    under a 4-block program) write the same bytes and scales as the one-block-per-program launch."""
    gen = torch.Generator().manual_seed(5)
    t, k, e, h = 6, 4, 8, 384
    p = permute_contiguous(_ids(t, e, k, gen), e, 0, 128)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(DEV) * 3
    hh = torch.randn(p.num_rows, 2 * h, generator=gen).to(torch.bfloat16).to(DEV)
    assert triton_moe._row_split(triton_moe.ROW_SPLIT_MIN_ROWS, h // 128) == (4, 4)
    monkeypatch.setattr(triton_moe, "ROW_SPLIT_MIN_ROWS", 1)  # the prefill launch at a size the interpreter runs fast
    q, s = triton_moe.gather_quant(x, p.row_of, p.num_rows, p.num_rows)
    q2, s2 = triton_moe.silu_mul_quant(hh, p.num_rows, p.row_of)
    monkeypatch.setattr(triton_moe, "ROW_SPLIT_MIN_ROWS", 1 << 30)
    q1, s1 = triton_moe.gather_quant(x, p.row_of, p.num_rows, p.num_rows)
    q21, s21 = triton_moe.silu_mul_quant(hh, p.num_rows, p.row_of)
    rows = p.row_of[p.row_of >= 0]
    assert torch.equal(q[rows].view(torch.uint8), q1[rows].view(torch.uint8))
    assert torch.equal(s[0][:, rows], s1[0][:, rows])
    assert torch.equal(q2[rows].view(torch.uint8), q21[rows].view(torch.uint8))
    assert torch.equal(s2[0][:, rows], s21[0][:, rows])
    assert torch.equal(s[0][:, rows], reference.gather_quant(x, p.row_of, p.num_rows, p.num_rows)[1][0][:, rows])


def test_permute_masked_kernel_refuses_small_capacity():
    ids = _ids(40, 8, 2, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="capacity=32 < T=40"):
        triton_moe.permute_masked(ids, 8, 32)


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the all-rows launch reads the NaN rows
@pytest.mark.parametrize("t,e,k,inter", [(1, 16, 4, 256), (20, 8, 2, 384)])
def test_silu_mul_quant_routed_rows(t, e, k, inter):
    """By-pair launch (routed rows only) == the all-rows launch on every routed row; scales == the
    reference; rows nobody routed to are NaN in h and must not leak into routed rows."""
    gen = torch.Generator().manual_seed(t * 7 + inter)
    ids = _ids(t, e, k, gen)
    cap = -(-t // backend.DECODE_ALIGN) * backend.DECODE_ALIGN
    p = permute_masked(ids, e, cap)
    h = torch.randn(e * cap, 2 * inter, generator=gen).to(DEV) * 2
    rows = p.row_of[p.row_of >= 0]
    unrouted = torch.ones(e * cap, dtype=torch.bool, device=DEV)
    unrouted[rows] = False
    h[unrouted] = float("nan")
    q, s = triton_moe.silu_mul_quant(h, cap, p.row_of)
    q_all, s_all = triton_moe.silu_mul_quant(h, cap)
    rq, rs = reference.silu_mul_quant(h, cap, p.row_of)

    def per_row(sc):  # [E, K/128, cap] -> [E * cap, K/128]
        return sc.permute(0, 2, 1).reshape(-1, sc.shape[1])

    assert torch.equal(q[rows].view(torch.uint8), q_all[rows].view(torch.uint8))
    assert torch.equal(per_row(s)[rows], per_row(rs)[rows])
    deq = q[rows].float() * per_row(s)[rows].repeat_interleave(128, 1)
    rdeq = rq[rows].float() * per_row(rs)[rows].repeat_interleave(128, 1)
    assert torch.isfinite(deq).all() and _rel(deq, rdeq) < DEQ_TOL


@pytest.mark.parametrize("tokens,ep", [(1, False), (6, False), (9, True), (300, True)])
def test_fp8_pipeline_with_triton_ops_matches_emulated(tokens, ep):
    """The decode (masked; the prefill contiguous layout at 300 tokens) FP8 pipeline with every Triton data-path kernel (route, permute, gather
    + quantize, SiLU-and-mul + quantize on routed rows, un-permute with the shared expert) and the
    reference grouped GEMM == the all-reference pipeline (mxfp8-emulated), EP slice included."""
    torch.manual_seed(tokens)
    hidden, e, k, inter, num_local = 256, 16, 4, 128, 8 if ep else 16
    offset = 8 if ep else 0
    w13 = torch.randn(num_local, 2 * inter, hidden, device=DEV) * 0.05
    w2 = torch.randn(num_local, hidden, inter, device=DEV) * 0.05
    x = torch.randn(tokens, hidden, device=DEV)
    logits = torch.randn(tokens, e, device=DEV)
    shared, gate = torch.randn(tokens, hidden, device=DEV), torch.randn(tokens, 1, device=DEV)
    emulated = backend.Fp8PipelineBackend("mxfp8-emulated", backend._reference_ops())
    ops = SimpleNamespace(
        route=triton_moe.route,
        permute_masked=triton_moe.permute_masked,
        permute_contiguous=triton_moe.permute_contiguous,
        gather_quant=triton_moe.gather_quant,
        silu_mul_quant=triton_moe.silu_mul_quant,
        grouped_gemm=reference.grouped_gemm,
        unpermute=triton_moe.unpermute,
    )
    kernels = backend.Fp8PipelineBackend("triton-ops", ops)
    wts = emulated.prepare(w13, w2)
    w, ids = kernels.route(logits, k, True)
    rw, rids = emulated.route(logits, k, True)
    assert torch.equal(ids, rids) and torch.allclose(w, rw, rtol=1e-5, atol=1e-6)
    got = kernels.run(x, w, ids, wts, offset, shared, gate)
    want = emulated.run(x, rw, rids, wts, offset, shared, gate)
    assert torch.isfinite(got).all() and _rel(got, want) < DEQ_TOL


@pytest.mark.parametrize("num_shared", [1, 2])
def test_route_kernel_with_shared_experts_matches_reference(num_shared):
    """Rows of E + 1 logits (the last a shared expert's gate): the routed columns as without it, then
    experts E .. E + num_shared - 1 with weight sigmoid(last logit) in every row."""
    gen = torch.Generator().manual_seed(num_shared)
    logits = (torch.randn(5, 61, generator=gen) * 2).to(DEV)
    w, ids = triton_moe.route(logits, 7, True, num_shared)
    rw, rids = reference.route(logits, 7, True, num_shared)
    assert w.shape == ids.shape == (5, 7 + num_shared)
    assert torch.equal(ids, rids) and torch.allclose(w, rw, rtol=1e-6, atol=1e-7)
    pw, pids = reference.route(logits[:, :60], 7, True)
    assert torch.equal(ids[:, :7], pids) and torch.allclose(w[:, :7], pw, rtol=1e-6, atol=1e-7)
    assert torch.equal(ids[:, 7:].cpu(), torch.arange(60, 60 + num_shared).expand(5, num_shared))
    assert torch.allclose(w[:, 7:], torch.sigmoid(logits[:, 60:]).expand(5, num_shared), rtol=1e-6)


@pytest.mark.parametrize("t,e,k,renorm", [(1, 128, 8, True), (7, 512, 10, True), (3, 8, 1, False), (2, 60, 3, True)])
def test_route_kernel_matches_reference(t, e, k, renorm):
    """Ids equal to torch.topk on the fp32 softmax, weights within fp32 rounding; non-power-of-two
    E and k. Token 0 ties at the top (up to 4 ways, inside the top k): torch's order among ties is
    unspecified (CPU), the kernel's is the lowest index first, so both are compared in that order."""
    gen = torch.Generator().manual_seed(t * e + k)
    logits = torch.randn(t, e, generator=gen) * 2
    ties = min(k, 4)
    logits[0, 5:5 + ties] = logits[0].max() + 1
    logits = logits.to(DEV)
    w, ids = triton_moe.route(logits, k, renorm)
    rw, rids = reference.route(logits, k, renorm)

    def canonical(w, ids):  # descending weight, ascending id among equal weights
        by_id = ids.sort(dim=1, stable=True)
        order = w.gather(1, by_id.indices).sort(dim=1, descending=True, stable=True).indices
        return by_id.values.gather(1, order)

    assert torch.equal(ids, canonical(w, ids)) and torch.equal(ids, canonical(rw, rids))
    assert torch.equal(ids[0, :ties], torch.arange(5, 5 + ties, device=DEV))
    assert torch.allclose(w, rw, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("t,h,shared", [(1, 2048, True), (3, 320, False), (70, 512, True)])
def test_unpermute_kernel_matches_reference(t, h, shared):
    """Weighted sum of each token's k rows (rows of other EP ranks, -1, skipped) plus the gated
    shared expert; decode (T < 64, 256-column programs) and prefill block sizes."""
    gen = torch.Generator().manual_seed(t + h)
    k, m = 4, 64
    row_of = torch.randint(0, m, (t, k), generator=gen)
    row_of[0, 1] = -1
    y = torch.randn(m, h, generator=gen).to(torch.bfloat16).to(DEV)
    w = torch.rand(t, k, generator=gen).to(DEV)
    sh = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(DEV) if shared else None
    g = torch.randn(t, 1, generator=gen).to(torch.bfloat16).to(DEV) if shared else None
    got = triton_moe.unpermute(y, row_of.to(DEV), w, sh, g)
    want = reference.unpermute(y, row_of.to(DEV), w, sh, g)
    assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@COMPILES
@pytest.mark.parametrize("pdl", [True, False])
def test_kernels_compile_for_hopper(pdl):
    """Every data-path kernel lowers to a cubin for sm_90 without a GPU (Qwen3-30B-A3B decode shapes),
    with programmatic dependent launch (griddepcontrol in the PTX) and without."""
    i32 = "i32"
    quant = {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "nkb": i32, "rows_per_batch": i32}
    compile_pdl(triton_moe._gather_quant_kernel, {"x_ptr": "*bf16", "row_ptr": "*i64", "H": i32, **quant},
                {"K": 8, "KBP": 1, "BLOCK": triton_moe.BLOCK_K}, pdl)
    compile_pdl(triton_moe._silu_mul_quant_kernel, {"h_ptr": "*bf16", "row_ptr": "*i64", "inter": i32, **quant},
                {"BY_PAIR": True, "KBP": 1, "BLOCK": triton_moe.BLOCK_K}, pdl)
    compile_pdl(triton_moe._gather_quant_mx_kernel, {
        "x_ptr": "*bf16", "row_ptr": "*i64", "q_ptr": "*fp8e4nv", "sf_ptr": "*u8", "H": i32, "rows_per_batch": i32,
        "rows_pad": i32, "cols_pad": i32}, {"K": 8, "BLOCK": triton_moe.BLOCK_K}, pdl)
    compile_pdl(triton_moe._permute_masked_kernel, {
        "ids_ptr": "*i64", "row_ptr": "*i64", "count_ptr": "*i32", "n_pairs": i32, "num_local": i32,
        "expert_offset": i32, "capacity": i32}, {"BLOCK": 16}, pdl)
    compile_pdl(triton_moe._contig_rows_kernel, {
        "ids_ptr": "*i64", "row_ptr": "*i64", "count_ptr": "*i32", "pstart_ptr": "*i32", "tile_ptr": "*i32",
        "n_pairs": i32, "num_local": i32, "expert_offset": i32, "num_tiles": i32},
        {"ALIGN": 128, "BLOCK": 256, "BLOCK_E": 128, "BLOCK_T": 16}, pdl)
    compile_pdl(triton_moe._unpermute_kernel, {
        "y_ptr": "*bf16", "row_ptr": "*i64", "w_ptr": "*fp32", "out_ptr": "*bf16", "sh_ptr": "*bf16", "g_ptr": "*bf16",
        "H": i32}, {"K": 8, "HAS_SHARED": True, "BLOCK": 256}, pdl)
    compile_pdl(triton_moe._topk_softmax_kernel, {"logit_ptr": "*bf16", "w_ptr": "*fp32", "id_ptr": "*i64", "E": i32},
                {"K": 8, "KP": 8, "RENORM": True, "NS": 1, "BLOCK_E": 128}, pdl)
