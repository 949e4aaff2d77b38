"""moe.MoE against a dense per-expert loop: random routing, empty experts, EP slices, FP8 path."""
import pytest
import torch

from moe import MoE, backend, reference


def _dense(x, gate_w, w13, w2, k, shared=None):
    """Independent per-token loop: softmax top-k renormalised, SwiGLU experts, gated shared."""
    out = torch.zeros_like(x, dtype=torch.float32)
    p = torch.softmax(x.float() @ gate_w.float().t(), -1)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        w, ids = p[t].topk(k)
        w = w / w.sum()
        for wj, e in zip(w, ids):
            h = w13[e].float() @ x[t].float()
            out[t] += wj * (w2[e].float() @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
        if shared is not None:
            out[t] += shared[t].float()
    return out


def _init(m, seed):
    g = torch.Generator().manual_seed(seed)
    for p in m.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.1


def test_reference_layer_matches_dense_loop_and_ep_slices():
    torch.manual_seed(0)
    full = MoE(32, 8, 2, 16, shared_intermediate=24)
    _init(full, 1)
    x = torch.randn(20, 32)
    sh = full.shared(x)
    want = _dense(x, full.gate.weight, full.w13, full.w2, 2, sh)
    assert torch.allclose(full(x), want, rtol=1e-4, atol=1e-5)
    # EP=2: each rank holds half the experts; rank 0 adds the shared expert; the sum is the layer
    parts = []
    for r in range(2):
        m = MoE(32, 8, 2, 16, shared_intermediate=24, ep_rank=r, ep_size=2)
        sd = {k: (v[4 * r : 4 * r + 4] if k in ("w13", "w2") else v) for k, v in full.state_dict().items()}
        m.load_state_dict(sd)
        parts.append(m(x))
    assert torch.allclose(parts[0] + parts[1], want, rtol=1e-4, atol=1e-5)


def test_empty_experts_contribute_nothing():
    m = MoE(16, 4, 1, 8, backend="reference")
    _init(m, 2)
    x = torch.randn(6, 16)
    ids = torch.zeros(6, 1, dtype=torch.long)  # experts 1..3 get nothing
    w = torch.ones(6, 1)
    m.w13.data[1:] = float("nan")  # never read
    m.w2.data[1:] = float("nan")
    out = m.run_experts(x, w, ids)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, reference.experts(x, w, ids, m.w13[:1], m.w2[:1]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens", [5, 300])  # masked (decode) and contiguous (prefill) layouts
def test_fp8_pipeline_emulated_matches_dense(tokens):
    m = MoE(256, 8, 2, 128, shared_intermediate=128, backend="mxfp8-emulated")
    _init(m, 3)
    x = torch.randn(tokens, 256)
    want = _dense(x, m.gate.weight, m.w13, m.w2, 2, m.shared(x))
    got = m(x)
    rel = ((got.float() - want).norm() / want.norm()).item()
    assert rel < 0.08, rel
    assert m._backend.name == "mxfp8-emulated"


def test_fp8_pipeline_ep_slice():
    m = MoE(128, 8, 2, 128, ep_rank=1, ep_size=2, backend="mxfp8-emulated")
    _init(m, 4)
    x = torch.randn(40, 128)
    w, ids = m.route(x)
    ref = reference.experts(x, w, ids, m.w13, m.w2, m.expert_offset)
    rel = ((m.run_experts(x, w, ids) - ref).norm() / ref.norm()).item()
    assert rel < 0.08, rel


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="ep_size=3"):
        MoE(16, 8, 2, 8, ep_size=3)
    with pytest.raises(ValueError, match="unknown MoE backend 'nope'"):
        backend.select("cpu", "nope")
    m = MoE(16, 4, 2, 8)
    _init(m, 5)
    with pytest.raises(ValueError, match="x.shape=\\(3, 15\\)"):
        m.run_experts(torch.randn(3, 15), torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="multiples of 128"):
        MoE(16, 4, 2, 8, backend="mxfp8-emulated").prepare()


def test_cpu_selects_reference():
    assert backend.select("cpu").name == "reference"
    # on a GPU too when the experts' H or I is not a multiple of 128 (the FP8 blocks): the tiny default model
    assert backend.select("cuda", fp8_shape=False).name == "reference"


def test_backend_choice_is_logged(caplog):
    backend._chosen.pop("mxfp8-emulated", None)
    with caplog.at_level("INFO", logger="moe.backend"):
        backend.select("cpu", "mxfp8-emulated")
    assert "MoE expert backend: mxfp8-emulated" in caplog.text


def test_sm90_gemm_variant_dispatch():
    """'ws_*' variants come from the warp-specialized module; kernels='ws' swaps only the FP8 defaults."""
    from types import SimpleNamespace

    classic = SimpleNamespace(grouped_gemm_fp8_masked_swapab="classic-masked", grouped_gemm_bf16_contig="bf16")
    ws = SimpleNamespace(ws_fp8_masked_swapab_cps="ws-masked", ws_fp8_contig="ws-contig")
    g = backend.Sm90Gemm(classic, ws, "ws")
    assert g.kernel(g.defaults[(True, True)]) == "ws-masked"
    assert g.kernel(g.defaults[(True, False)]) == "ws-contig"
    assert g.kernel(g.defaults[(False, False)]) == "bf16"
    plain = backend.Sm90Gemm(classic)
    assert plain.kernel(plain.defaults[(True, True)]) == "classic-masked"
    with pytest.raises(ValueError, match="ws_fp8_contig"):
        plain.kernel("ws_fp8_contig")
    with pytest.raises(ValueError, match="kernels='fast'"):
        backend.Sm90Gemm(classic, ws, "fast")
    with pytest.raises(ValueError, match="needs the module"):
        backend.Sm90Gemm(classic, None, "ws")
    # auto (the default set) is the ws set: measured fastest for every FP8 call
    auto = backend.Sm90Gemm(classic, ws, "auto")
    assert auto.defaults == g.defaults
    assert plain.defaults[(True, False)] == "grouped_gemm_fp8_contig_serial"


def test_sm90_gemm_passes_cluster_count(monkeypatch):
    """Cluster variants get the co-resident cluster count after aux (queried once per device;
    $NVL72_MOE_MAX_CLUSTERS overrides it, capped at SMs / 2); the other variants get no extra argument."""
    from types import SimpleNamespace

    import moe.occupancy

    calls, queries = [], []

    def query(idx, size, threads, sms):
        queries.append((idx, size, threads, sms))
        return 62

    monkeypatch.setattr(moe.occupancy, "max_active_clusters", query)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda idx: SimpleNamespace(multi_processor_count=132))
    ws = SimpleNamespace(ws_fp8_contig_n256_mc=lambda *a: calls.append(a), ws_fp8_contig_n256=lambda *a: calls.append(a))
    g = backend.Sm90Gemm(SimpleNamespace(), ws, "ws")
    a = torch.zeros(256, 128, dtype=torch.float8_e4m3fn)
    b = torch.zeros(2, 256, 128, dtype=torch.float8_e4m3fn)
    out = torch.empty(256, 256, dtype=torch.bfloat16)
    sa, sb = torch.ones(1, 1, 256), torch.ones(2, 2, 1)
    aux = torch.tensor([0, 1], dtype=torch.int32)
    for variant in ("ws_fp8_contig_n256_mc", "ws_fp8_contig_n256", "ws_fp8_contig_n256_mc"):
        g(a, b, out, sa, sb, aux, False, variant=variant)
    assert [len(c) for c in calls] == [8, 7, 8] and calls[0][6] == calls[2][6] == 62
    assert all(c[-1] == 0 for c in calls)  # pdl: off for tensors on the CPU
    assert queries == [(0, 2, 384, 132)]  # once per device
    for env, want in (("60", 60), ("500", 66)):
        monkeypatch.setenv(backend.ENV_MAX_CLUSTERS, env)
        assert backend.Sm90Gemm(SimpleNamespace(), ws, "ws").clusters(torch.device("cuda", 0), "ws_fp8_contig_n256_mc") == want
    monkeypatch.setenv(backend.ENV_MAX_CLUSTERS, "0")
    with pytest.raises(ValueError, match="NVL72_MOE_MAX_CLUSTERS"):
        backend.Sm90Gemm(SimpleNamespace(), ws, "ws")


def test_release_masters_frees_the_loaded_experts_only_when_converted():
    """FP8 (mxfp8-emulated on CPU): the converted layer gives the same output after its loaded
    w13 / w2 are freed, and converting again raises; reference: the masters are the weights, kept."""
    x = torch.randn(5, 128)
    m = MoE(128, 4, 2, 128, backend="mxfp8-emulated")
    _init(m, 7)
    before = m.prepare()(x)
    assert not m.masters_released and m.w13.numel() > 0
    m.prepare(release_masters=True)
    assert m.masters_released and m.w13.numel() == 0 and m.w2.numel() == 0
    assert torch.equal(m(x), before)
    with pytest.raises(RuntimeError, match="release_masters=True"):
        m.prepare()
    ref = MoE(16, 4, 2, 8)
    _init(ref, 8)
    want = ref(torch.ones(2, 16))
    ref.prepare(release_masters=True)
    assert not ref.masters_released and ref.w13.shape == (4, 16, 16)
    assert torch.equal(ref(torch.ones(2, 16)), want)


@pytest.mark.parametrize("shared_i", [16, 32])  # one I-slice, two
def test_shared_expert_held_as_experts(shared_i):
    """The shared expert held as num_shared more experts (an I-slice each, weight sigmoid(gate logit))
    gives the layer it gave beside them; every route names them last; the packed router's logits (what
    the service's norm kernel computes) route the same; released masters include it."""
    m = MoE(32, 8, 2, 16, shared_intermediate=shared_i, backend="reference")
    _init(m, 3)
    x = torch.randn(12, 32)
    want = _dense(x, m.gate.weight, m.w13, m.w2, 2, m.shared(x))
    m.prepare()
    n = shared_i // 16
    assert m.num_shared == n and m._weights.w13.shape[0] == m._weights.w2.shape[0] == 8 + n
    w, ids = m.route(x)
    assert ids.shape == (12, 2 + n)
    assert torch.equal(ids[:, 2:], torch.arange(8, 8 + n).expand(12, n))
    assert torch.allclose(w[:, 2:], torch.sigmoid(x @ m.shared_expert_gate.weight.t()).expand(12, n))
    router = m.router_weight()
    assert router.shape == (9, 32) and router[8].data_ptr() == m.shared_expert_gate.weight.data_ptr()
    w2_, ids2 = m.route(x, x @ router.t())
    assert torch.equal(ids2, ids) and torch.allclose(w2_, w)
    assert torch.allclose(m(x), want, rtol=1e-4, atol=1e-5)
    m.prepare(release_masters=True)
    assert m.masters_released and m.shared_expert.down_proj.weight.numel() == 0
    assert torch.allclose(m(x), want, rtol=1e-4, atol=1e-5)


def test_shared_expert_stays_beside_when_it_cannot_be_experts(monkeypatch):
    """Not an I multiple, under EP, or $NVL72_MOE_FUSE_SHARED=0: beside the experts, the same layer;
    a bad value of the variable is named."""
    x = torch.randn(6, 32)
    for kw, env in ((dict(shared_intermediate=24), "1"), (dict(shared_intermediate=16, ep_size=2), "1"),
                    (dict(shared_intermediate=16), "0")):
        monkeypatch.setenv("NVL72_MOE_FUSE_SHARED", env)
        m = MoE(32, 8, 2, 16, backend="reference", **kw)
        _init(m, 4)
        want = m.shared(x) + reference.experts(x, *m.route(x), m.w13, m.w2, m.expert_offset)
        assert torch.allclose(m(x), want, rtol=1e-4, atol=1e-5)
        assert m.num_shared == 0 and m.route(x)[1].shape == (6, 2) and m.router_weight() is m.gate.weight
    monkeypatch.setenv("NVL72_MOE_FUSE_SHARED", "yes")
    with pytest.raises(ValueError, match="NVL72_MOE_FUSE_SHARED='yes'"):
        MoE(32, 8, 2, 16, shared_intermediate=16).prepare()
