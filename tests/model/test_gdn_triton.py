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


# Ragged decode/verify batch: a decode token writing its read slot, a verify writing its read slot first
# and skipping one position, sequences writing nothing; slots 5, 6, 8 are only read.
MIX_LENS, MIX_READ = [1, 4, 2, 3, 1], [3, 0, 5, 6, 8]
MIX_WRITE = [3] + [0, -1, 7, 2] + [-1, 1] + [9, -1, 4] + [-1]


def _mix_views(layout, q, k, v, z, b, a, hk):
    """The logical q [T, Hk, Dk], k, v [T, Hv, Dv], z, b [T, Hv], a laid out as a checkpoint's projections
    put them, inside wider rows (as column slices of a packed output) -> the kernel's grouped views."""
    T, _, dk = q.shape
    hv, dv = v.shape[1:]
    r = hv // hk
    grp = lambda x: x.reshape(T, hk, -1)  # noqa: E731  [T, Hk, r*...] per key-head group
    if layout == "qwen3_next":
        qkvz = torch.cat([q, k, grp(v), grp(z)], -1).reshape(T, -1)  # in_proj_qkvz rows
        ba = torch.cat([grp(b), grp(a)], -1).reshape(T, -1)  # in_proj_ba rows
        row = torch.cat([qkvz, ba, torch.randn(T, 3).to(q.dtype)], 1)  # both in one row, then padding
        g = row[:, :qkvz.shape[1]].unflatten(1, (hk, -1))
        ba = row[:, qkvz.shape[1]:qkvz.shape[1] + ba.shape[1]].unflatten(1, (hk, 2 * r))
        return (g[..., :dk], g[..., dk:2 * dk], g[..., 2 * dk:2 * dk + r * dv].unflatten(-1, (r, dv)),
                g[..., 2 * dk + r * dv:].unflatten(-1, (r, dv)), ba[..., :r], ba[..., r:])
    qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1), torch.randn(T, 5).to(q.dtype)], 1)
    n = hk * dk
    return (qkv[:, :n].unflatten(1, (hk, dk)), qkv[:, n:2 * n].unflatten(1, (hk, dk)),
            qkv[:, 2 * n:2 * n + hv * dv].unflatten(1, (hk, r, dv)), z.reshape(T, hk, r, dv), b.reshape(T, hk, r),
            a.reshape(T, hk, r))


def _mix_reference(q, k, v, z, b, a, w, A_log, dt_bias, norm_w, eps, conv_state, state, qsl, read, write):
    """The layer's torch ops composed, all fp32 (states updated in place)."""
    T = q.shape[0]
    f = [x.float() for x in (q, k, v, z, b, a, w, A_log, dt_bias, norm_w)]
    q, k, v, z, b, a, w, A_log, dt_bias, norm_w = f
    x = gdn_ops.causal_conv1d(torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], 1), w, conv_state,
                              qsl, read, write)
    qc, kc, vc = x.split([q[0].numel(), k[0].numel(), v[0].numel()], 1)
    g, beta = gdn_ops.gdn_gating(A_log, a, dt_bias, b)
    o = gdn_ops.recurrent_gated_delta_rule(qc.view(q.shape), kc.view(k.shape), vc.view(v.shape), g, beta, state,
                                           qsl, read, write)
    return gdn_ops.gated_rmsnorm(o, z, norm_w, eps).reshape(T, -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("hk,hv,dk,dv,K,sms,dtype", [(2, 4, 16, 64, 4, 1, torch.bfloat16),  # (each ~2-4 s interpreted)
                                                      (2, 4, 16, 64, 4, 10**6, torch.float32),
                                                      (1, 3, 24, 48, 3, 10**6, torch.bfloat16)])
def test_fused_recurrent_mix_matches_reference(device, layout, hk, hv, dk, dv, K, sms, dtype, monkeypatch):
    """conv + gating + delta rule + gated norm in one kernel against the torch ops composed in fp32, reading
    q/k/v/z/b/a in place from either layout, ragged 1-4-token sequences, the output NaN-poisoned first;
    written state slots compared, the others untouched. `sms`: whole heads a program, or (more SMs than
    programs) 32-wide Dv tiles; the last shape: a masked second tile, masked head dims, 3 value heads a
    key head, a 3-tap conv."""
    monkeypatch.setattr(triton_mod, "_num_sms", lambda dev: sms)
    gen = torch.Generator().manual_seed(hv * dk + K)
    T, cd, eps = sum(MIX_LENS), 2 * hk * dk + hv * dv, 1e-6
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    q, k, v, z, b, a = rnd(T, hk, dk), rnd(T, hk, dk), rnd(T, hv, dv), rnd(T, hv, dv), rnd(T, hv), rnd(T, hv)
    w, dt_bias, norm_w = rnd(cd, K), rnd(hv), (1 + 0.3 * torch.randn(dv, generator=gen)).to(dtype)
    A_log = torch.empty(hv).uniform_(0.01, 4, generator=gen).log()
    conv_state, state = rnd(10, cd, K - 1), torch.randn(10, hv, dk, dv, generator=gen)
    qsl, read, write = _batch(MIX_LENS, MIX_READ, MIX_WRITE, "cpu")
    ref_conv, ref_state = conv_state.to(torch.float32, copy=True), state.clone()
    ref = _mix_reference(q, k, v, z, b, a, w, A_log, dt_bias, norm_w, eps, ref_conv, ref_state, qsl, read, write)

    views = [x.to(device) for x in _mix_views(layout, q, k, v, z, b, a, hk)]  # .to keeps the strides
    dev = [x.to(device) for x in (w, A_log, dt_bias, norm_w, conv_state, state, qsl, read, write)]
    out = torch.full((T, hv * dv), float("nan"), dtype=dtype, device=device)
    assert triton_mod.fused_recurrent_mix(*views, *dev[:4], eps, *dev[4:], out=out) is out
    assert rel_err(out.cpu(), ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    written = torch.tensor(sorted({s for s in MIX_WRITE if s >= 0}))
    kept = torch.tensor([s for s in range(10) if s not in written])
    got_conv, got_state = dev[4].cpu(), dev[5].cpu()
    assert torch.equal(got_conv.float()[written], ref_conv[written])  # tails are copies of inputs: exact
    assert rel_err(got_state[written], ref_state[written]) < 1e-5
    assert torch.equal(got_conv[kept], conv_state[kept]) and torch.equal(got_state[kept], state[kept])
    assert not triton_mod.split_counters(out.device, 0).any()  # the arrival counters are reset


def test_fused_recurrent_mix_rejects_bad_state():
    q = torch.randn(1, 1, 16)
    v = torch.randn(1, 1, 2, 16)
    ab = torch.randn(1, 1, 2)
    qsl, read, write = _batch([1], [0], [0], "cpu")
    with pytest.raises(ValueError, match="float32"):
        triton_mod.fused_recurrent_mix(q, q, v, v, ab, ab, torch.randn(64, 4), torch.zeros(2), torch.zeros(2),
                                       torch.ones(16), 1e-6, torch.zeros(1, 64, 3),
                                       torch.zeros(1, 2, 16, 16, dtype=torch.bfloat16), qsl, read, write)


@COMPILES
@pytest.mark.parametrize("arch,pdl", [(90, True), (90, False), (100, True)])
def test_kernels_compile_for_hopper_and_blackwell(arch, pdl):
    """Ahead-of-time compile to cubin (no GPU needed) with the bf16 / fp32 signatures the layer uses,
    with programmatic dependent launch (griddepcontrol in the PTX) and without."""

    ints = {"i32": ("T", "D", "stride_x", "stride_o", "stride_q", "stride_k", "stride_v", "HK", "HV", "DK", "DV", "R",
                    *(f"s{x}_{d}" for x in "qkvzba" for d in "tgr"))}
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
        (triton_mod._fused_recurrent_mix_kernel,
         {**{n: "*bf16" for n in ("q", "k", "v", "z", "b", "a", "conv_w", "dt_bias", "norm_w", "conv_state", "out")},
          "A_log": "*fp32", "state": "*fp32", "o_raw": "*fp32", "counters": "*i32", "qsl": "*i32",
          "read_slots": "*i64", "write_slots": "*i64", "scale": "fp32", "eps": "fp32"},
         {"K": 4, "BK": 128, "BV": 32, "BD": 128, "BC": 4}),
    ]
    for fn, sig, constexprs in kernels:
        compile_pdl(fn, {**sig, **{n: "i32" for n in ints["i32"] if n in fn.arg_names}}, constexprs, pdl, arch)
