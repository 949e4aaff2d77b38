"""MXFP8 quantization: error bounds, E8M0 exponents, the 128 x 4 swizzled scale layout, regrouping."""
import pytest
import torch

from moe import mxfp8


def _rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    # a wide dynamic range across rows, so blocks get different scales
    return torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape[:-1] + (1,), generator=g).float())


def test_scale_exponent_is_ceil_log2():
    amax = torch.rand(20000) * torch.exp2(torch.randint(-40, 40, (20000,)).float())
    s = mxfp8.scale_exponent(amax)
    m, e = torch.frexp(amax / 448)
    assert torch.equal(s, torch.where(m == 0.5, e - 1, e).to(torch.int32))
    r = amax / torch.exp2(s.float())
    assert float(r.max()) <= 448 and float(r.min()) > 224


@pytest.mark.parametrize("block", [32, 128])
def test_quant_dequant_error_bound(block):
    x = _rand(64, 256, seed=block)
    q, s = mxfp8.quantize(x, block)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert s.shape == (64, 256 // block)
    xd = mxfp8.dequantize(q, s)
    step = torch.exp2(mxfp8.e8m0_to_exp(s).float()).repeat_interleave(block, dim=1)
    bound = torch.maximum(x.abs() * 2.0**-4, step * 2.0**-10) * (1 + 1e-6)
    assert bool(((x - xd).abs() <= bound).all())
    rel = ((x - xd).norm() / x.norm()).item()
    assert 0 < rel < 0.04


def test_zero_block_and_bad_shape():
    x = torch.zeros(2, 64)
    x[1, 40] = 3.0
    q, s = mxfp8.quantize(x)
    assert torch.equal(mxfp8.dequantize(q, s), x)
    with pytest.raises(ValueError, match="shape=\\(2, 40\\)"):
        mxfp8.quantize(torch.randn(2, 40))


def _swizzle_by_formula(scale):
    rows, cols = scale.shape
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    out = torch.zeros(rp * cp, dtype=torch.uint8)
    raw = scale.view(torch.uint8)
    for r in range(rows):
        for c in range(cols):
            i, j = r // 128, c // 4
            off = (i * (cp // 4) + j) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)
            out[off] = raw[r, c]
    return out


@pytest.mark.parametrize("rows,cols", [(128, 4), (200, 9), (7, 3), (256, 8)])
def test_swizzle_matches_documented_layout(rows, cols):
    _, s = mxfp8.quantize(_rand(rows, cols * 32, seed=rows + cols))
    sw = mxfp8.swizzle_scales(s)
    assert sw.dtype == torch.float8_e8m0fnu
    assert torch.equal(sw.view(torch.uint8), _swizzle_by_formula(s))
    assert torch.equal(mxfp8.unswizzle_scales(sw, rows, cols).view(torch.uint8), s.view(torch.uint8))
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    assert sw.numel() == rp * cp  # padding included


def test_regroup_pow2_exact_for_normals():
    x = _rand(256, 512, seed=3) * (1 + torch.rand(256, 1))
    q, s = mxfp8.quantize(x)
    q2, s2 = mxfp8.regroup_pow2(q, s, block_rows=128, block_k=128)
    assert s2.shape == (2, 4)
    deq1 = mxfp8.dequantize(q, s)
    deq2 = q2.float() * s2.repeat_interleave(128, 0).repeat_interleave(128, 1)
    smax = s2.repeat_interleave(128, 0).repeat_interleave(128, 1)
    exact = deq1.abs() >= smax * 2.0**-6  # still an E4M3 normal after the shift
    assert bool(exact.any()) and torch.equal(deq1[exact], deq2[exact])
    assert bool(((deq1 - deq2).abs() <= smax * 2.0**-10).all())


def test_quantize_experts_shapes():
    w = torch.randn(3, 256, 128)
    c = mxfp8.quantize_experts(w)
    assert c["q"].shape == (3, 256, 128) and c["scale"].shape == (3, 256, 4)
    assert c["scale_sm90"].shape == (3, 2, 1)
    deq = c["q_sm90"].float() * c["scale_sm90"].repeat_interleave(128, 1).repeat_interleave(128, 2)
    assert (deq - w).norm() / w.norm() < 0.04


def test_gather_quant_mx_reference_layout():
    """The Blackwell activation path: scattered rows, 1 x 32 scales, swizzled per batch of rows."""
    from moe import reference

    x = torch.randn(10, 64) * 5
    row_of = torch.tensor([[3, -1]] * 5 + [[-1, 130]] * 5)
    row_of[1, 0], row_of[2, 0], row_of[3, 0], row_of[4, 0] = 0, 1, 2, 4
    row_of[6, 1], row_of[7, 1], row_of[8, 1], row_of[9, 1] = 129, 200, 255, 128
    q, sf = reference.gather_quant_mx(x, row_of, 256, 128)
    assert sf.numel() == 2 * 128 * 4  # two batches, each padded to 128 rows x 4 scale columns
    s0 = mxfp8.unswizzle_scales(sf[:512], 128, 2)
    s1 = mxfp8.unswizzle_scales(sf[512:], 128, 2)
    want_q, want_s = mxfp8.quantize(x[5])
    assert torch.equal(q[130].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s1[2], want_s.view(torch.uint8))
    assert torch.equal(s0[3], mxfp8.quantize(x[0])[1].view(torch.uint8))
