"""MXFP8 dispatch payload: the quantization rule (comms.mxfp8 == moe.mxfp8, bit for bit; the
kernel's integer amax) and the torch.distributed reference over gloo with several ranks: every
packed row is the exact MXFP8 quantization of the source token it names (values and scales), and
combine (bf16, unchanged) of the dequantized rows is exact."""
from __future__ import annotations

import datetime
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from comms import mxfp8
from comms.dispatch import DispatchCombine
from tests.comms.test_dispatch_inputs import CASES, TOPK, routing, tagged_tokens
from tests.comms.test_dispatch_reference import _expected

TIMEOUT_S = 60
HIDDEN = 64  # two 32-value blocks per row


def _hard_rows(gen, n=64, H=256):
    """bf16 rows whose 32-value blocks hit every branch of the scale rule: zeros, mantissas just
    above / below 1.75, subnormal and huge magnitudes, single outliers, negative maxima."""
    x = torch.randn(n, H, generator=gen) * torch.exp2(torch.randint(-30, 30, (n, 1), generator=gen).float())
    x = x.to(torch.bfloat16)
    x[0] = 0
    x[1, :32] = 1.75
    x[1, 32:64] = 1.7578125  # 1.75 + 2^-7: the next bf16 up, scale rounds up
    x[2, :32] = -448.0
    x[2, 32:64] = torch.tensor(1e-39).to(torch.bfloat16)  # bf16 subnormal: clamps at s = -127
    x[3] = torch.tensor(3.0e38).to(torch.bfloat16)
    x[4, 5] = -1e4
    return x


def test_rule_matches_moe_bit_for_bit():
    from moe import mxfp8 as moe_mx

    gen = torch.Generator().manual_seed(0)
    for x in (_hard_rows(gen), torch.randn(33, 4096, generator=gen).to(torch.bfloat16)):
        q, s = mxfp8.quantize(x)
        mq, ms = moe_mx.quantize(x)
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8 and s.shape == (x.shape[0], x.shape[1] // 32)
        assert torch.equal(q.view(torch.uint8), mq.view(torch.uint8))
        assert torch.equal(s, ms.view(torch.uint8))
        assert torch.isfinite(mxfp8.dequantize(q, s)).all(), "a finite input saturated to NaN"


def test_kernel_amax_from_bf16_bits_equals_the_float_amax():
    """The kernel reduces max(bits & 0x7fff) over bf16 halves (max.u16x2) and shifts it to fp32
    bits: the same integer as the reference's fp32 amax bits, for every finite input."""
    gen = torch.Generator().manual_seed(1)
    x = _hard_rows(gen).unflatten(-1, (-1, 32))
    ref = x.float().abs().amax(-1).view(torch.int32)
    kern = ((x.view(torch.int16).to(torch.int32) & 0x7FFF).amax(-1)) << 16
    assert torch.equal(ref, kern)


def test_quantize_names_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp8.quantize(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="does not tile"):
        mxfp8.dequantize(torch.zeros(2, 64).to(torch.float8_e4m3fn), torch.zeros(2, 3, dtype=torch.uint8))


def _check(rank, world, E, T, case, layout, gen):
    per_rank = E // world
    ep = DispatchCombine(dist.group.WORLD, E, TOPK, HIDDEN, max_tokens_per_rank=16, mode="dp_ep", layout=layout,
                         payload="mxfp8")
    x = tagged_tokens(rank, T, gen, HIDDEN)
    ids, w = routing(case, rank, world, T, E, gen)
    recv, handle = ep.dispatch(x, ids, w)
    lead = (per_rank, ep.cap) if layout == "masked" else (ep.packed_rows,)
    assert recv.x.dtype == torch.float8_e4m3fn and tuple(recv.x.shape) == (*lead, HIDDEN)
    assert recv.scales.dtype == torch.uint8 and tuple(recv.scales.shape) == (*lead, HIDDEN // 32)
    pad = lambda t: torch.cat([t, t.new_zeros(16 - T, *t.shape[1:])])  # noqa: E731
    all_x = [torch.empty(16, HIDDEN, dtype=torch.bfloat16) for _ in range(world)]
    all_ids = [torch.empty(16, TOPK, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(all_x, pad(x))
    dist.all_gather(all_ids, pad(ids))
    fq = recv.x.reshape(-1, HIDDEN)
    fs = recv.scales.reshape(-1, HIDDEN // 32)
    for e in range(per_rank):
        g = rank * per_rank + e
        rows = range(int(recv.offsets[e]), int(recv.offsets[e]) + int(recv.counts[e]))
        want = [(r, t) for r in range(world) for t in range(T) if g in all_ids[r][t].tolist()]
        assert [(int(recv.src_rank[i]), int(recv.src_token[i])) for i in rows] == want
        for i, (r, t) in zip(rows, want):
            q, s = mxfp8.quantize(all_x[r][t:t + 1])
            assert torch.equal(fq[i:i + 1].view(torch.uint8), q.view(torch.uint8)), f"row {i}: values"
            assert torch.equal(fs[i:i + 1], s), f"row {i}: scales"
            deq = mxfp8.dequantize(fq[i], fs[i])
            assert float(deq[0]) == r, f"row {i} carries rank tag {float(deq[0])}, expected {r}"
            assert torch.equal(deq, mxfp8.dequantize(q, s)[0])
    # identity experts on the dequantized rows: combine (bf16) sums exactly those values
    y = mxfp8.dequantize(recv.x, recv.scales).to(torch.bfloat16)
    out = ep.combine(y, handle)
    xq = mxfp8.dequantize(*mxfp8.quantize(x)).to(torch.bfloat16)
    assert torch.equal(out, _expected(xq, ids, w, per_rank, world))


def _worker(rank, world, path):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        gen = torch.Generator().manual_seed(200 + rank)
        E = 8 * world
        for layout in ("masked", "contiguous"):
            for case in CASES:
                _check(rank, world, E, 13, case, layout, gen)
        _check(rank, world, E, 0, "random", "masked", gen)
        # replicated mode packs the quantized rows locally
        gen.manual_seed(7)
        x = tagged_tokens(0, 9, gen, HIDDEN)
        ids, w = routing("random", 0, world, 9, E, gen)
        ep = DispatchCombine(dist.group.WORLD, E, TOPK, HIDDEN, 16, mode="replicated", payload="mxfp8")
        recv, _ = ep.dispatch(x, ids, w)
        q, s = mxfp8.quantize(x)
        for e in range(E // world):
            for i in range(int(recv.offsets[e]), int(recv.offsets[e]) + int(recv.counts[e])):
                t = int(recv.src_token[i])
                assert torch.equal(recv.x.reshape(-1, HIDDEN)[i].view(torch.uint8), q[t].view(torch.uint8))
                assert torch.equal(recv.scales.reshape(-1, HIDDEN // 32)[i], s[t])
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.mp
@pytest.mark.parametrize("world", [2, 3])
def test_mxfp8_dispatch_gloo(world):
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.spawn(_worker, args=(world, os.path.join(d, "store")), nprocs=world, join=False)
        t0 = time.monotonic()
        while not ctx.join(timeout=5):
            if time.monotonic() - t0 > TIMEOUT_S * 2:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"mxfp8 dispatch workers did not finish within {TIMEOUT_S * 2} s")


def test_payload_arguments_name_the_value():
    with pytest.raises(ValueError, match="payload='fp4'"):
        DispatchCombine(None, 8, 2, 64, 4, payload="fp4")
    with pytest.raises(ValueError, match="hidden=48"):
        DispatchCombine(None, 8, 2, 48, 4, payload="mxfp8")
