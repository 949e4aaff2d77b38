"""Programmatic dependent launch of the Triton kernels (`aot.pdl`): the switch, the compiled form
(griddepcontrol in the PTX), and on a GPU a decode layer's kernels launched with PDL inside a
CUDA graph giving the same bits as launched plainly."""
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from aot import launch

pdl = pytest.importorskip("aot.pdl", exc_type=ImportError)  # needs triton
ROOT = Path(__file__).resolve().parents[2]


def _fake_cuda(monkeypatch, major: int, stream: int):
    """A CUDA device of compute capability `major`.0 whose current stream is `stream` (0: the
    legacy default stream), without a GPU: the two queries `pdl_enabled` makes of torch."""
    monkeypatch.setattr(launch, "_SM90", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx: (major, 0))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda idx: stream, raising=False)


@pytest.mark.parametrize("env,interp,major,stream,want", [
    (None, "0", 9, 7, True),     # the default: sm_90, a real stream
    ("1", "0", 10, 7, True),     # sm_100 too
    ("0", "0", 9, 7, False),     # switched off
    (None, "0", 8, 7, False),    # sm_80 has no griddepcontrol
    (None, "0", 9, 0, False),    # the legacy default stream
    (None, "1", 9, 7, False),    # Triton's CPU interpreter
])
def test_switch_on_cuda(monkeypatch, env, interp, major, stream, want):
    if env is None:
        monkeypatch.delenv(launch.ENV, raising=False)
    else:
        monkeypatch.setenv(launch.ENV, env)
    monkeypatch.setenv("TRITON_INTERPRET", interp)
    _fake_cuda(monkeypatch, major, stream)
    dev = torch.device("cuda", 0)
    assert launch.pdl_enabled(dev) is want and launch.stream_allows_pdl(dev) is (stream != 0)
    assert pdl.launch_args(dev) == {"PDL": want, "launch_pdl": want}


def test_switch_off_on_cpu_and_bad_values_named(monkeypatch):
    monkeypatch.setenv(launch.ENV, "1")
    assert pdl.launch_args(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setenv(launch.ENV, "yes")
    with pytest.raises(ValueError, match="NVL72_PDL='yes'"):
        launch.pdl_enabled(torch.device("cpu"))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="without the interpreter the compile tests "
                    "run in this process")
def test_kernels_compile_with_griddepcontrol():
    """The compile tests of the attention-path, MoE (pipeline and fused decode), GDN and one-token layer kernels (PDL on: griddepcontrol.wait and
    .launch_dependents in the PTX, and the GEMV's first weight load before the wait; PDL off: none),
    run in a subprocess without the interpreter, which this process has on (triton.jit reads it
    when a kernel module is imported)."""
    tests = ["tests/runner/test_fused_triton.py::test_kernels_compile_for_hopper",
             "tests/moe/test_triton_moe.py::test_kernels_compile_for_hopper",
             "tests/moe/test_triton_fused_decode.py::test_kernels_compile_for_hopper",
             "tests/model/test_gdn_triton.py::test_kernels_compile_for_hopper_and_blackwell",
             "tests/runner/test_decode_layer.py::test_kernel_compiles_for_hopper"]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "13 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


def _decode_layers(x, w, batch, kvs, n_layers):
    """A decode step's Triton kernels over `n_layers` layers, back to back on the current stream:
    residual add + norm, q/k/v GEMV, RoPE table, q/k norm + RoPE + K/V store, split-key attention,
    o_proj GEMV, add + norm + router logits, top-k, masked permutation, quantizing gather,
    un-permute. Returns every output worth comparing."""
    from moe.kernels import triton_moe
    from nvl72.model import fused_triton as ft

    hq, hkv, d = w.heads
    slots = ft.slot_mapping(batch.positions, batch.query_start_loc, batch.page_table, w.page_size)
    cos, sin = ft.rope_cos_sin(batch.positions, w.inv_freq, x.dtype)
    delta, outs = None, []
    for i in range(n_layers):
        s, h = ft.add_rms_norm(x, delta, w.norm1[i], 1e-6, False)
        q_raw, k_raw, v = ft.gemv(h, w.qkv[i]).split([hq * d, hkv * d, hkv * d], dim=1)
        q, k, _ = ft.qk_norm_rope(q_raw, k_raw, w.qn[i], w.kn[i], cos, sin, hq, hkv, d, 1e-6, False, False,
                                  v.view(1, hkv, d), kvs[i], slots)
        a = ft.paged_attention(q, kvs[i], batch.query_start_loc, batch.seq_lens, batch.page_table, 1, d**-0.5)
        o = ft.gemv(a.reshape(1, hq * d), w.o[i])
        x, h, logits = ft.add_rms_norm(s, o, w.norm2[i], 1e-6, False, w.router[i])
        tw, ids = triton_moe.route(logits, w.top_k, True)
        perm = triton_moe.permute_masked(ids, w.router[i].shape[0], 128)
        qh, sc = triton_moe.gather_quant(h, perm.row_of, perm.num_rows, 128)
        y = w.expert_out[i].index_select(0, ids.flatten()).view(-1, h.shape[1])  # [k, H] per pair, pair order
        rows = torch.arange(w.top_k, device=x.device).view(1, -1)
        delta = triton_moe.unpermute(y, rows, tw)
        r = perm.row_of.flatten()  # the routed rows: the only ones the gather writes
        outs += [q, k, a, o, logits, tw, ids, perm.row_of, qh.view(torch.uint8)[r], sc[r // 128, :, r % 128], delta]
    return outs + [x, *kvs]


@pytest.mark.gpu
def test_decode_chain_with_pdl_in_a_graph_equals_plain_launches():
    """On sm_90+: the chain launched plainly on the default stream, with PDL on a side stream, and
    captured with PDL in a CUDA graph (replayed three times) gives the same bits."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90 or newer")
    from tests.runner.paged import random_batch

    dev, dt = torch.device("cuda"), torch.bfloat16
    hq, hkv, d, hid, e, layers = 32, 4, 128, 2048, 128, 4
    batch, kv, _, _, _ = random_batch([1], [300], 16, hq, hkv, d, dt, dev, seed=3)
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dt).to(dev)

    w = SimpleNamespace(
        heads=(hq, hkv, d), page_size=16, top_k=8, inv_freq=1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d)).to(dev),
        norm1=[1 + rnd(hid, scale=0.1) for _ in range(layers)], norm2=[1 + rnd(hid, scale=0.1) for _ in range(layers)],
        qkv=[rnd((hq + 2 * hkv) * d, hid, scale=hid**-0.5) for _ in range(layers)],
        o=[rnd(hid, hq * d, scale=(hq * d) ** -0.5) for _ in range(layers)],
        qn=[1 + rnd(d, scale=0.1) for _ in range(layers)], kn=[1 + rnd(d, scale=0.1) for _ in range(layers)],
        router=[rnd(e, hid, scale=hid**-0.5) for _ in range(layers)],
        expert_out=[rnd(e, hid) for _ in range(layers)])
    x = rnd(1, hid)
    kv0 = [kv.clone() for _ in range(layers)]

    assert not launch.pdl_enabled(dev)  # the default stream: plain launches
    want = _decode_layers(x, w, batch, [c.clone() for c in kv0], layers)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assert launch.pdl_enabled(dev)
        eager = _decode_layers(x, w, batch, [c.clone() for c in kv0], layers)  # also compiles the PDL variants
    torch.cuda.current_stream().wait_stream(side)
    kvs = [c.clone() for c in kv0]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert launch.pdl_enabled(dev)
        got = _decode_layers(x, w, batch, kvs, layers)
    for name, outs in (("side stream", eager), ("graph", got)):
        for _ in range(3 if name == "graph" else 1):
            if name == "graph":
                graph.replay()
            torch.cuda.synchronize()
            for i, (a, b) in enumerate(zip(outs, want)):
                assert torch.equal(a, b), f"{name}: output {i} differs from the plain launches"
