"""GPU: the CuTeDSL grouped GEMMs and the Triton data-path kernels against fp32 torch references."""
import pytest
import torch

from moe import MoE, backend, reference
from moe.routing import permute_contiguous, permute_masked

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gemm():
    """Both kernel modules; a warp-specialized module that fails to load fails only the ws_* tests."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma grouped GEMM needs sm_90")
    try:
        ws, ws_error = backend.load_sm90_module(backend.SM90_WS_MODULE), None
    except Exception as e:  # noqa: BLE001 - reported by each ws_* test
        ws, ws_error = None, e
    g = backend.Sm90Gemm(backend.load_sm90_module(), ws)
    g.ws_error = ws_error
    return g


def _need(gemm, variant):
    if variant.startswith("ws_") and gemm.ws is None:
        pytest.fail(f"{backend.SM90_WS_MODULE} did not load: {gemm.ws_error!r}")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _operands(fp8, rows_shape, n, k, e, gen):
    a = torch.randn(*rows_shape, k, device="cuda", generator=gen)
    b = torch.randn(e, n, k, device="cuda", generator=gen)
    if not fp8:
        return a.bfloat16(), b.bfloat16(), None, None
    lead = rows_shape[0] if len(rows_shape) == 2 else 1
    rows = rows_shape[-1]
    sa = torch.exp2(torch.randint(-3, 3, (lead, k // 128, rows), device="cuda", generator=gen).float())
    sb = torch.exp2(torch.randint(-3, 3, (e, n // 128, k // 128), device="cuda", generator=gen).float())
    return (a * 8).to(torch.float8_e4m3fn), (b * 8).to(torch.float8_e4m3fn), sa, sb


CONTIG = backend.Sm90Gemm.WS_CONTIG + [
    "grouped_gemm_fp8_contig",
    "grouped_gemm_fp8_contig_serial",
    "grouped_gemm_bf16_contig",
]
MASKED = backend.Sm90Gemm.WS_MASKED + [
    "grouped_gemm_fp8_masked_swapab",
    "grouped_gemm_fp8_masked",
    "grouped_gemm_fp8_masked_serial",
    "grouped_gemm_bf16_masked",
]


@pytest.mark.parametrize("variant", CONTIG)
@pytest.mark.parametrize(
    "e,n,k,t,topk", [(4, 256, 512, 300, 2), (8, 384, 256, 33, 3), (5, 128, 384, 77, 2), (128, 3072, 4096, 2048, 8)]
)
def test_grouped_gemm_contiguous(gemm, variant, e, n, k, t, topk):
    """Random routing (odd group sizes, expert 1 empty), NaN-poisoned output, every row of a token checked."""
    _need(gemm, variant)
    fp8 = "fp8" in variant
    gen = torch.Generator(device="cuda").manual_seed(e + n + t)
    ids = torch.rand(t, e, device="cuda", generator=gen).argsort(1)[:, :topk]
    ids[ids == 1] = 0  # expert 1 stays empty
    p = permute_contiguous(ids, e, 0, 128)
    a, b, sa, sb = _operands(fp8, (p.num_rows,), n, k, e, gen)
    out = torch.full((p.num_rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm(a, b, out, sa, sb, p.tile_expert, False, variant=variant)
    ref = reference.grouped_gemm(a, b, torch.zeros(p.num_rows, n, device="cuda"), sa, sb, p.tile_expert, False)
    valid = p.token_of >= 0
    assert _rel(out[valid], ref[valid]) < 1e-2


@pytest.mark.parametrize("variant", [v for v in backend.Sm90Gemm.WS_CONTIG if "n256" in v or "pingpong" in v])
@pytest.mark.parametrize("tile_expert", [[0, 0, 1, 2, 2, 2, 3], [0, -1, 1, 1, -1, 2, 2, 3, 3], [-1, 2, 2, -1]])
def test_grouped_gemm_contiguous_tile_walk_edges(gemm, variant, tile_expert):
    """128 x 256 (and 2-CTA cluster) walk: odd counts of m tiles, expert boundaries inside a pair of
    m tiles, unused (-1) tiles at either position of a pair, 3 n tiles (a pair with one half):
    used tiles match the fp32 product of the dequantized operands, unused tiles stay NaN."""
    _need(gemm, variant)
    gen = torch.Generator(device="cuda").manual_seed(len(tile_expert))
    te = torch.tensor(tile_expert, dtype=torch.int32, device="cuda")
    m, n, k, e = 128 * len(tile_expert), 384, 640, 4
    a, b, sa, sb = _operands(True, (m,), n, k, e, gen)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm(a, b, out, sa, sb, te, False, variant=variant)
    ref = reference.grouped_gemm(a, b, torch.zeros(m, n, device="cuda"), sa, sb, te, False)
    used = (te >= 0).repeat_interleave(128)
    assert _rel(out[used], ref[used]) < 1e-2
    assert torch.isnan(out[~used]).all()


@pytest.mark.parametrize("role", backend.GEMM_ROLES)
def test_contig_table_choice(gemm, role, monkeypatch):
    """A call that names its GEMM runs the table's variant for its row count (each size band of
    Sm90Gemm.CONTIG_TABLE, clusters passed where needed): bitwise the output of that variant named
    explicitly, and the fp32 product of the dequantized operands; rows of unused (-1) tiles stay NaN."""
    monkeypatch.delenv(backend.ENV_CONTIG_VARIANT, raising=False)
    g = backend.Sm90Gemm(gemm.mod, gemm.ws, "auto")
    gen = torch.Generator(device="cuda").manual_seed(len(role))
    n, k, e = 384, 256, 8
    for lo, _ in g.contig_table[role]:
        tiles = max(lo // 128, 3) + 5
        te = torch.sort(torch.randint(0, e, (tiles,), device="cuda", generator=gen)).values.int()
        te[torch.rand(tiles, device="cuda", generator=gen) < 0.05] = -1
        variant = g.contig_variant(role, 128 * tiles)
        _need(gemm, variant)
        a, b, sa, sb = _operands(True, (128 * tiles,), n, k, e, gen)
        out = torch.full((128 * tiles, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        g(a, b, out, sa, sb, te, False, role=role)
        named = torch.full_like(out, float("nan"))
        g(a, b, named, sa, sb, te, False, variant=variant)
        assert torch.equal(out.isnan(), named.isnan()) and torch.equal(out.nan_to_num(), named.nan_to_num()), variant
        ref = reference.grouped_gemm(a, b, torch.zeros(128 * tiles, n, device="cuda"), sa, sb, te, False)
        used = (te >= 0).repeat_interleave(128)
        assert _rel(out[used], ref[used]) < 1e-2, variant
        assert torch.isnan(out[~used]).all(), variant


@pytest.mark.parametrize("variant", list(backend.Sm90Gemm.CLUSTERED))
@pytest.mark.parametrize("clusters", [1, 3])
def test_cluster_grid_gives_identical_output(gemm, variant, clusters, monkeypatch):
    """Fewer clusters than units (each cluster strides over several units by the count launched) give
    the bitwise output of the default grid (the driver's co-resident count)."""
    _need(gemm, variant)
    gen = torch.Generator(device="cuda").manual_seed(clusters)
    te = torch.tensor([0, 0, 1, 2, 2, 2, 3, -1, 3, 3, 1], dtype=torch.int32, device="cuda")
    m, n, k, e = 128 * te.numel(), 640, 512, 4
    a, b, sa, sb = _operands(True, (m,), n, k, e, gen)
    want = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm(a, b, want, sa, sb, te, False, variant=variant)
    monkeypatch.setenv(backend.ENV_MAX_CLUSTERS, str(clusters))
    few = backend.Sm90Gemm(gemm.mod, gemm.ws)
    assert few.clusters(a.device, variant) == clusters
    out = torch.full_like(want, float("nan"))
    few(a, b, out, sa, sb, te, False, variant=variant)
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("variant", MASKED)
@pytest.mark.parametrize(
    "e,n,k,t,topk",
    [
        (8, 256, 512, 100, 2),
        (4, 128, 384, 40, 2),
        (16, 512, 1024, 256, 4),
        (128, 1536, 4096, 128, 8),
        (40, 384, 640, 3, 2),  # few active experts of many (decode), E not a multiple of 32, odd K steps
        (128, 4096, 1536, 1, 8),  # Qwen3-235B w2 at one token
    ],
)
def test_grouped_gemm_masked(gemm, variant, e, n, k, t, topk):
    """Random routing (odd counts, several token tiles per expert, expert 1 empty), NaN-poisoned output."""
    _need(gemm, variant)
    fp8 = "fp8" in variant
    gen = torch.Generator(device="cuda").manual_seed(e + n + t + 1)
    ids = torch.rand(t, e - 1, device="cuda", generator=gen).argsort(1)[:, :topk]
    ids += (ids >= 1).long()  # distinct experts per token, expert 1 stays empty
    cap = -(-t // 128) * 128
    p = permute_masked(ids, e, cap)
    a, b, sa, sb = _operands(fp8, (e, cap), n, k, e, gen)
    out = torch.full((e, cap, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm(a, b, out, sa, sb, p.counts, True, variant=variant)
    ref = reference.grouped_gemm(a, b, torch.zeros(e, cap, n, device="cuda"), sa, sb, p.counts, True)
    valid = (p.token_of >= 0).view(e, cap)
    assert _rel(out[valid], ref[valid]) < 1e-2


def test_triton_route_and_quant_ops():
    from moe.kernels import triton_moe

    gen = torch.Generator(device="cuda").manual_seed(7)
    logits = torch.randn(257, 128, device="cuda", generator=gen)  # fp32: no ties in the top-k
    w, ids = triton_moe.route(logits, 8, True)
    rw, rids = reference.route(logits, 8, True)
    assert torch.equal(ids, rids) and torch.allclose(w, rw, rtol=1e-5, atol=1e-6)

    x = torch.randn(257, 512, device="cuda", generator=gen, dtype=torch.bfloat16) * 3
    p = permute_contiguous(ids[:, :2] % 16, 16, 0, 128)
    q, s = triton_moe.gather_quant(x, p.row_of, p.num_rows, p.num_rows)
    rq, rs = reference.gather_quant(x, p.row_of, p.num_rows, p.num_rows)
    valid = p.token_of >= 0
    assert torch.equal(q[valid].view(torch.uint8), rq[valid].view(torch.uint8))
    assert torch.equal(s[:, :, valid], rs[:, :, valid])

    h = torch.randn(300, 512, device="cuda", generator=gen, dtype=torch.bfloat16) * 2
    q2, s2 = triton_moe.silu_mul_quant(h, 300)
    rq2, rs2 = reference.silu_mul_quant(h, 300)
    deq = q2.float() * s2[0].t().repeat_interleave(128, 1)
    rdeq = rq2.float() * rs2[0].t().repeat_interleave(128, 1)
    assert _rel(deq, rdeq) < 1e-2

    y = torch.randn(p.num_rows, 512, device="cuda", generator=gen, dtype=torch.bfloat16)
    sh = torch.randn(257, 512, device="cuda", generator=gen, dtype=torch.bfloat16)
    g = torch.randn(257, 1, device="cuda", generator=gen, dtype=torch.bfloat16)
    got = triton_moe.unpermute(y, p.row_of, w[:, :2], sh, g)
    want = reference.unpermute(y, p.row_of, w[:, :2], sh, g)
    assert _rel(got, want) < 1e-2


@pytest.mark.parametrize("kernels", ["classic", "ws", "auto"])
@pytest.mark.parametrize("tokens", [5, 200, 300])
def test_moe_layer_sm90_matches_reference(tokens, kernels, monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("sm90 backend")
    monkeypatch.setenv(backend.ENV_SM90_KERNELS, kernels)
    monkeypatch.setattr(backend, "_chosen", {})  # build the backend again under this env
    torch.manual_seed(0)
    kw = dict(shared_intermediate=256, dtype=torch.bfloat16, device="cuda")
    fast = MoE(512, 16, 4, 256, backend="sm90-fp8", **kw)
    for prm in fast.parameters():
        prm.data.normal_(0, 0.05)
    ref = MoE(512, 16, 4, 256, backend="reference", **kw)
    ref.load_state_dict(fast.state_dict())
    emulated = MoE(512, 16, 4, 256, backend="mxfp8-emulated", **kw)  # the same quantization in torch
    emulated.load_state_dict(fast.state_dict())
    x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
    got, want, same_fp8 = fast(x), ref(x), emulated(x)
    assert fast._backend.name == "sm90-fp8" and fast.num_shared == 1  # the shared expert in FP8 too
    masked_default = fast._backend.ops.grouped_gemm.defaults[(True, True)]
    assert masked_default.startswith("ws_") == (kernels != "classic")
    assert _rel(got, same_fp8) < 2e-2
    # against bf16 weights: every expert's e4m3 rounding (0.064-0.066 on these Gaussian weights since the
    # shared expert is FP8 too, H200 2026-11-29; the CPU emulation test allows 0.08 as well)
    assert _rel(got, want) < 8e-2


def test_triton_gather_quant_mx_matches_reference():
    """Blackwell's activation quantization (1 x 32 E8M0, swizzled), checked on any GPU with Triton."""
    from moe import mxfp8
    from moe.kernels import triton_moe

    gen = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(200, 640, device="cuda", generator=gen, dtype=torch.bfloat16) * 4
    ids = torch.rand(200, 16, device="cuda", generator=gen).argsort(1)[:, :2]
    cap = 256
    from moe.routing import permute_masked

    p = permute_masked(ids, 16, cap)
    q, sf = triton_moe.gather_quant_mx(x, p.row_of, p.num_rows, cap)
    rq, rsf = reference.gather_quant_mx(x, p.row_of, p.num_rows, cap)
    valid = p.token_of >= 0
    assert torch.equal(q[valid].view(torch.uint8), rq[valid].view(torch.uint8))
    per = sf.numel() // 16
    got = torch.cat([mxfp8.unswizzle_scales(sf[i * per : (i + 1) * per], cap, 20) for i in range(16)])
    want = torch.cat([mxfp8.unswizzle_scales(rsf[i * per : (i + 1) * per], cap, 20) for i in range(16)])
    assert torch.equal(got[valid], want[valid])


FEW_ROWS = [v for v in backend.Sm90Gemm.WS_MASKED if v.endswith("_cps")] + [backend.Sm90Gemm.WS_DEFAULTS[(True, True)]]


@pytest.mark.parametrize("variant", FEW_ROWS)
@pytest.mark.parametrize("n,k", [(1536, 2048), (2048, 768)])  # Qwen3-30B-A3B w13 and w2 (E=128, top-8)
def test_grouped_gemm_masked_few_rows(gemm, variant, n, k):
    """Decode at 1-8 tokens: 128 experts, capacity 32, a few experts holding 1, 3 or 8 rows and the
    rest 0; rows past each count are NaN in A (must not leak), the output is NaN-poisoned; the valid
    rows match the fp32 product of the dequantized operands."""
    _need(gemm, variant)
    e, cap = 128, 32
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    counts = torch.zeros(e, dtype=torch.int32, device="cuda")
    for expert, rows in ((0, 1), (5, 3), (17, 8), (64, 1), (127, 3), (90, 8)):
        counts[expert] = rows
    a, b, sa, sb = _operands(True, (e, cap), n, k, e, gen)
    valid = torch.arange(cap, device="cuda")[None, :] < counts[:, None]
    a.view(torch.uint8)[~valid] = 0x7F  # e4m3 NaN
    out = torch.full((e, cap, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm(a, b, out, sa, sb, counts, True, variant=variant)
    ref = reference.grouped_gemm(a, b, torch.zeros(e, cap, n, device="cuda"), sa, sb, counts, True)
    assert not torch.isnan(out[valid]).any()
    assert _rel(out[valid], ref[valid]) < 1e-2
