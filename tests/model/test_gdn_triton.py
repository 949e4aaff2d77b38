"""Triton GDN decode kernels against the torch references of gdn_ops (fresh random inputs, all slots
compared). Runs on a CUDA GPU, or on CPU in Triton's interpreter when TRITON_INTERPRET=1."""
import os

import pytest
import torch

from nvl72.model import gdn_ops
from tests.runner.ptx import COMPILES, compile_pdl

triton_mod = pytest.importorskip("nvl72.model.gdn_triton", exc_type=ImportError)

DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu),
           pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                        reason="CPU runs need TRITON_INTERPRET=1"))]


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _batch(lens, read, write, device):
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32).to(device)
    return qsl, torch.tensor(read, device=device), torch.tensor(write, device=device)


# Decode tokens, a 4-token verify writing every position (first into its read slot), a prefill chunk.
LENS, READ = [1, 4, 1, 9], [3, 0, 5, 6]
WRITE = [3] + [0, 7, 2, 1] + [-1] + [-1] * 8 + [4]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 32, 48), (4, 8, 128, 128)])
def test_recurrent_kernel_matches_reference(device, dtype, hk, hv, dk, dv):
    if device == "cpu" and dk == 128:
        pytest.skip("interpreter: small shape only")
    gen = torch.Generator().manual_seed(dk + hv)
    q, k, v, g, beta = _delta_inputs(sum(LENS), hk, hv, dk, dv, dtype, gen)
    state = torch.randn(8, hv, dk, dv, generator=gen)
    qsl, read, write = _batch(LENS, READ, WRITE, "cpu")
    ref_state = state.clone()
    ref = gdn_ops.recurrent_gated_delta_rule(q, k, v, g, beta, ref_state, qsl, read, write)
    dev = [t.to(device) for t in (q, k, v, g, beta, state, qsl, read, write)]
    out = triton_mod.recurrent_gated_delta_rule(*dev)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(out.cpu(), ref) < tol
    assert rel_err(dev[5].cpu(), ref_state) < 1e-5  # every slot, fp32 in both: written and untouched


def _delta_inputs(T, hk, hv, dk, dv, dtype, gen):
    q, k = (torch.randn(T, hk, dk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(T, hv, dv, generator=gen).to(dtype)
    g, beta = gdn_ops.gdn_gating(torch.empty(hv).uniform_(0.01, 4, generator=gen).log(),
                                 torch.randn(T, hv, generator=gen), torch.randn(hv, generator=gen),
                                 torch.randn(T, hv, generator=gen).to(dtype))
    return q, k, v, g, beta


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 32, 48), (4, 8, 128, 128)])
def test_chunk_kernel_matches_reference(device, dtype, hk, hv, dk, dv):
    """Prefill-length sequences, states written at the end, mid-chunk, at chunk edges and into the
    read slot."""
    if device == "cpu" and dk == 128:
        pytest.skip("interpreter: small shape only")
    gen = torch.Generator().manual_seed(dk + hv + 1)
    lens, read = [70, 1, 130, 20], [0, 1, 2, 3]
    T = sum(lens)
    q, k, v, g, beta = _delta_inputs(T, hk, hv, dk, dv, dtype, gen)
    write = torch.full((T,), -1)
    write[[69, 70, 71 + 5, 71 + 63, 71 + 64, 71 + 129, T - 1]] = torch.tensor([0, 4, 5, 6, 7, 2, 8])
    state = torch.randn(9, hv, dk, dv, generator=gen)
    qsl, read, _ = _batch(lens, read, [], "cpu")
    ref_state = state.clone()
    ref = gdn_ops.chunk_gated_delta_rule(q, k, v, g, beta, ref_state, qsl, read, write)
    dev = [t.to(device) for t in (q, k, v, g, beta, state, qsl, read, write)]
    out = triton_mod.chunk_gated_delta_rule(*dev)
    assert rel_err(out.cpu(), ref) < (1e-4 if dtype == torch.float32 else 1e-2)
    assert rel_err(dev[5].cpu(), ref_state) < 1e-4


# Sequences spanning several 16-token blocks, one ending mid-block, a 2-token one writing both states.
LONG = ([20, 2, 37], [1, 2, 0], [-1] * 19 + [1] + [3, 2] + [-1] * 36 + [0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,K,case", [(200, 4, "short"), (96, 3, "short"), (200, 4, "long")])
def test_conv_kernel_matches_reference(device, dtype, D, K, case):
    lens, read, write = (LENS, READ, WRITE) if case == "short" else LONG
    gen = torch.Generator().manual_seed(D + K + len(lens))
    T = sum(lens)
    x = torch.randn(T, D, generator=gen).to(dtype)
    w = torch.randn(D, K, generator=gen).to(dtype)
    conv_state = torch.randn(8, D, K - 1, generator=gen).to(dtype)
    qsl, read, write = _batch(lens, read, write, "cpu")
    ref_state = conv_state.clone()
    ref = gdn_ops.causal_conv1d(x, w, ref_state, qsl, read, write)
    dev = [t.to(device) for t in (x, w, conv_state, qsl, read, write)]
    out = triton_mod.causal_conv1d(*dev)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(out.cpu(), ref) < tol
    assert torch.equal(dev[2].cpu(), ref_state)  # tails are copies of inputs: exact


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefill", [0, 40])
def test_layer_with_triton_ops_matches_reference(device, prefill, monkeypatch):
    """The whole layer on the Triton ops equals it on the torch references, for a decode/verify batch
    (one recurrent call on strided q/k/v views) and with a prefill sequence added (chunked rule)."""
    from transformers import Qwen3NextConfig

    from nvl72.model import gdn
    from nvl72.model.batch import ForwardBatch

    if device == "cpu":  # interpreter: send the CPU layer through the Triton ops
        ops = gdn.GdnOps(triton_mod.causal_conv1d, triton_mod.recurrent_gated_delta_rule,
                         triton_mod.chunk_gated_delta_rule)
        reference = gdn.gdn_ops_for("cpu")
        monkeypatch.setattr(gdn, "gdn_ops_for", lambda t: ops if t == "cpu" and triton_on else reference)
    torch.manual_seed(0)
    config = Qwen3NextConfig(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                             num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    layer = gdn.GatedDeltaNet(config, 0).eval()
    conv_shape, rec_shape = gdn.GatedDeltaNet.state_shapes(config)
    lens, read, write = LENS + [prefill], READ + [8], WRITE + [-1] * (prefill - 1) + [8]  # slot 8: its own
    if not prefill:
        lens, read, write = LENS, READ, WRITE
    T = sum(lens)
    qsl, read, write = _batch(lens, read, write, "cpu")
    fields = (torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long), qsl,
              torch.tensor(lens, dtype=torch.int32), torch.zeros(len(lens), 0, dtype=torch.int32), read, write)
    h, conv, rec = torch.randn(T, 64), torch.randn(9, *conv_shape), torch.randn(9, *rec_shape)
    dev_conv, dev_rec = conv.clone().to(device), rec.clone().to(device)
    with torch.no_grad():
        triton_on = False
        ref = layer(h, ForwardBatch(*fields), conv, rec)
        triton_on = True
        out = layer.to(device)(h.to(device), ForwardBatch(*(t.to(device) for t in fields)), dev_conv, dev_rec)
    assert rel_err(out.cpu(), ref) < 1e-4
    assert rel_err(dev_rec.cpu(), rec) < 1e-4 and rel_err(dev_conv.cpu(), conv) < 1e-5


@COMPILES
@pytest.mark.parametrize("arch,pdl", [(90, True), (90, False), (100, True)])
def test_kernels_compile_for_hopper_and_blackwell(arch, pdl):
    """Ahead-of-time compile to cubin (no GPU needed) with the bf16 / fp32 signatures the layer uses,
    with programmatic dependent launch (griddepcontrol in the PTX) and without."""

    ints = {"i32": ("T", "D", "stride_x", "stride_o", "stride_q", "stride_k", "stride_v", "HK", "HV", "DK", "DV")}
    kernels = [
        (triton_mod._causal_conv1d_kernel, {"x": "*bf16", "w": "*bf16", "tails": "*bf16", "conv_state": "*bf16",
                                            "out": "*bf16", "tok_seq": "*i64", "qsl": "*i32", "write_slots": "*i64"},
         {"K": 4, "BT": 16, "BD": 128}),
        (triton_mod._recurrent_gdn_kernel, {"q": "*bf16", "k": "*bf16", "v": "*bf16", "g": "*fp32", "beta": "*bf16",
                                            "o": "*bf16", "state": "*fp32", "qsl": "*i32", "read_slots": "*i64",
                                            "write_slots": "*i64", "scale": "fp32"},
         {"BK": 128, "BV": 32, "USE_QK_L2NORM": True}),
        (triton_mod._chunk_scan_kernel, {**{n: "*fp32" for n in ("u", "w", "q_dec", "k", "k_dec", "attn", "decay",
                                                                  "gam", "o", "state")},
                                         "seq_chunks": "*i64", "read_slots": "*i64", "wslots": "*i64"},
         {"C": 64, "BK": 128, "BV": 32}),
    ]
    for fn, sig, constexprs in kernels:
        compile_pdl(fn, {**sig, **{n: "i32" for n in ints["i32"] if n in fn.arg_names}}, constexprs, pdl, arch)
