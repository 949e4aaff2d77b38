"""nvl72.model.decode_layer (a one-token Qwen3-MoE decoder layer in one Triton kernel) against the
torch reference model: final hidden states and the K/V it stores, several decode steps over a
prefilled context, on FP8 experts whose dequantized weights the reference uses.

CPU: Triton's interpreter runs the six phases as separate launches ("phased"; it runs programs
one after another, so the grid barriers of "fused" would never open), in fp32 and fp16 (it has no
faithful bf16). GPU: "fused" and "phased" in bf16, eager and in a CUDA graph. The same harness checks
the per-op kernels of these steps (mode None: the default serving path) on CPU."""
import os

import pytest
import torch

from nvl72.config import ModelConfig
from nvl72.model import attn_backends
from nvl72.model.batch import ForwardBatch
from nvl72.model.loader import build_model, init_dummy_weights
from tests.runner.paged import rel_err
from tests.runner.ptx import COMPILES, compile_pdl
from tests.runner.test_runner_engine import CONFIGS

ft = pytest.importorskip("nvl72.model.fused_triton", exc_type=ImportError)
dl = pytest.importorskip("nvl72.model.decode_layer", exc_type=ImportError)

CPU = pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                   reason="CPU runs need TRITON_INTERPRET=1"))
GPU = pytest.param("cuda", marks=pytest.mark.gpu)
PAGE = 16


def models(device, dtype):
    """(reference: fp32, MoE `reference` backend on the dequantized FP8 experts; kernel model: `dtype`,
    experts kept in FP8 by `mxfp8-emulated`), the reference's weights those of the kernel model."""
    cfg = ModelConfig.from_dict(dict(CONFIGS["qwen3_moe_fp8"], num_hidden_layers=2))
    ker = build_model(cfg, dtype, "cpu")
    init_dummy_weights(ker, seed=11, std=0.3)
    ref = build_model(cfg, torch.float32, "cpu")
    ref.load_state_dict({n: t.float() for n, t in ker.state_dict().items()})
    for lr, lk in zip(ref.model.layers, ker.model.layers):
        lk.mlp.backend_name, lr.mlp.backend_name = "mxfp8-emulated", "reference"
        w = lk.mlp.fp8_weights()
        for p, q, s in ((lr.mlp.w13, w.w13, w.w13_scale), (lr.mlp.w2, w.w2, w.w2_scale)):
            p.data = q.float() * s.repeat_interleave(128, 1).repeat_interleave(128, 2)
    ref, ker = ref.to(device), ker.to(device)
    for lk in ker.model.layers:
        lk.mlp.prepare()
    return ref, ker


def batch(tokens, start, pages, device):
    """One sequence: `tokens` at positions start.. (a prefill chunk or one decode token)."""
    n = len(tokens)
    return ForwardBatch(input_ids=torch.tensor(tokens, device=device),
                        positions=torch.arange(start, start + n, device=device),
                        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
                        seq_lens=torch.tensor([start + n], dtype=torch.int32, device=device),
                        page_table=pages, max_query_len=n)


def fused_experts(model):
    """Give the model's MoE layers the FP8 pipeline with the fused decode kernels (reference ops
    otherwise): one-token steps then compute experts in fp32 on the FP8 weights, as the reference and
    decode_layer do (the emulated pipeline quantizes activations to FP8 as well)."""
    from types import SimpleNamespace

    from moe import backend
    from moe.kernels import triton_fused_decode

    ops = SimpleNamespace(**vars(backend._reference_ops()), fused_decode=triton_fused_decode.fused_decode)
    be = backend.Fp8PipelineBackend("test-fused-decode", ops, fused_decode_tokens=1)
    for layer in model.model.layers:
        layer.mlp._backend = be
        layer.mlp.prepare()


def run_case(device, dtype, mode, graph=False):
    ref, ker = models(device, dtype)
    if mode is None:
        fused_experts(ker)
    ker.attn_backend = attn_backends.TritonBackend()
    ker.attn_backend.decode_layer = mode
    caches_r = ref.allocate_caches(12, PAGE)
    caches_k = ker.allocate_caches(12, PAGE)
    pages = torch.tensor([[7, 2, 9, 4, 0, 11, -1, -1]], dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(1, 96, (75,), generator=gen).tolist()  # > 64 keys: two key splits
    with torch.inference_mode():
        ref.forward(batch(prompt, 0, pages, device), caches_r)
        for a, b in zip(caches_k.kv, caches_r.kv):
            a.copy_(b)
        pos = len(prompt)
        for tok in torch.randint(1, 96, (4,), generator=gen).tolist():
            b = batch([tok], pos, pages, device)
            want = ref.forward(b, caches_r)
            if graph:
                ker.forward(b, caches_k, check=False)  # warm-up: compiles, scratch
                for a, r in zip(caches_k.kv, caches_r.kv):
                    a.copy_(r)  # (the warm-up stored this token's K/V already)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    got = ker.forward(b, caches_k, check=False)
                got.fill_(float("nan"))
                g.replay()
            else:
                got = ker.forward(b, caches_k)
            assert torch.isfinite(got).all()
            assert rel_err(got, want) < (2e-5 if dtype == torch.float32 else 2e-2), pos
            for a, r in zip(caches_k.kv, caches_r.kv):
                assert rel_err(a, r) < (1e-6 if dtype == torch.float32 else 1e-2), pos
                a.copy_(r)  # the next step from the reference's K/V: each step's error alone
            pos += 1
    return ker


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_phased_matches_reference_cpu(dtype):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU runs need TRITON_INTERPRET=1")
    ker = run_case("cpu", dtype, "phased")
    assert all(lk._one_kernel_reason == "" for lk in ker.model.layers)  # both layers ran the kernel
    buf = next(iter(dl._SCRATCH.values()))
    assert not buf["cnt"].any() and not buf["bar"].any()  # counters left at zero
    dl.check_errors()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fused", ["1", "0"])
def test_per_op_steps_match_reference_cpu(dtype, fused, monkeypatch):
    """The per-op kernels of the same steps (mode None; experts by the fused decode kernels), with the
    input norm inside the q/k/v GEMV ("1", the default) and in add_rms_norm before it ("0")."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU runs need TRITON_INTERPRET=1")
    monkeypatch.setenv(attn_backends.NORM_GEMV_ENV, fused)
    calls = []
    for name in ("norm_gemv", "gemv", "add_rms_norm"):
        real = getattr(ft, name)
        monkeypatch.setattr(ft, name, lambda *a, _f=real, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    run_case("cpu", dtype, None)
    # 2 layers x 4 steps: norm_gemv (q/k/v) + gemv (o_proj) + add_rms_norm (post-attention, router), or
    # add_rms_norm + gemv twice each; and the final norm once a step
    assert {n: calls.count(n) for n in set(calls)} == (
        {"norm_gemv": 8, "gemv": 8, "add_rms_norm": 12} if fused == "1" else {"gemv": 16, "add_rms_norm": 20})


@pytest.mark.gpu
@pytest.mark.parametrize("mode,graph", [("phased", False), ("fused", False), ("fused", True)])
def test_matches_reference_gpu(mode, graph):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    run_case("cuda", torch.bfloat16, mode, graph)
    dl.check_errors()
    for buf in dl._SCRATCH.values():
        assert not buf["cnt"].any() and not buf["bar"].any()


def test_unsupported_layers_are_named():
    cfg = ModelConfig.from_dict(CONFIGS["qwen3_moe"])  # dense MLPs
    m = build_model(cfg, torch.float32, "cpu")
    assert dl.unsupported(m.model.layers[0]) == "dense MLP"
    cfg = ModelConfig.from_dict(CONFIGS["qwen3_moe_sparse"])  # experts in bf16 (reference backend)
    m = build_model(cfg, torch.float32, "cpu")
    init_dummy_weights(m, seed=1)
    for layer in m.model.layers:
        layer.mlp.backend_name = "reference"
    assert "does not keep FP8 expert weights" in dl.unsupported(m.model.layers[0])
    cfg = ModelConfig.from_dict(CONFIGS["qwen3_next"])
    m = build_model(cfg, torch.float32, "cpu")
    assert dl.unsupported(m.model.layers[0]) == "not a full-attention layer"


def test_norm_gemv_flag_from_env(monkeypatch):
    monkeypatch.setenv(attn_backends.NORM_GEMV_ENV, "2")
    with pytest.raises(ValueError, match="NVL72_NORM_GEMV='2'"):
        attn_backends.TritonBackend()
    monkeypatch.delenv(attn_backends.NORM_GEMV_ENV)
    assert attn_backends.TritonBackend().norm_gemv  # the default
    monkeypatch.setenv(attn_backends.GEMV_ENV, "0")  # cuBLAS projections: no GEMV to norm inside
    assert not attn_backends.TritonBackend().norm_gemv


def test_mode_from_env(monkeypatch):
    monkeypatch.setenv(attn_backends.DECODE_LAYER_ENV, "maybe")
    with pytest.raises(ValueError, match="NVL72_DECODE_LAYER='maybe'"):
        attn_backends.TritonBackend()
    monkeypatch.setenv(attn_backends.DECODE_LAYER_ENV, "phased")
    assert attn_backends.TritonBackend().decode_layer == "phased"
    with pytest.raises(ValueError, match="mode 'both'"):
        dl.run(None, torch.zeros(1, 4), None, None, mode="both")


@COMPILES
@pytest.mark.parametrize("phase", [0, 5])
def test_kernel_compiles_for_hopper(phase):
    """The kernel lowers to a cubin for sm_90 without a GPU (Qwen3-30B-A3B shape, bf16, FP8 experts),
    all phases with barriers (0) and one alone, with PDL."""
    bf, f32, i32, i64, f8 = "*bf16", "*fp32", "*i32", "*i64", "*fp8e4nv"
    sig = dict(x=bf, delta=bf, res_out=bf, mlp_out=bf, ln1=bf, wqkv=bf, qn=bf, kn=bf, wo=bf, ln2=bf, wr=bf,
               w13=f8, s13=f32, w2=f8, s2=f32, cos=bf, sin=bf, kv_cache=bf, slots=i64, seq_lens=i32,
               page_table=i32, hrows=bf, qkv=bf, attn=bf, part_acc=f32, part_ml=f32, o=bf, res1=bf, h2=bf,
               logits=bf, act=f32, tw=f32, tid=i64, cnt=i32, bar=i32, eps="fp32", scale="fp32",
               stride_page="i64", stride_kind="i64", stride_head="i64", stride_tok="i64")
    bn_qkv, bk_qkv = dl.gemv_blocks(5120, 2048)
    bn_o, bk_o = dl.gemv_blocks(2048, 4096)
    const = dict(H=2048, BLOCK_H=2048, HQ=32, HKV=4, D=128, R=128, E=128, BLOCK_E=128, I=768, K=8, KP=8,
                 RENORM=True, HAS_DELTA=True, ZC=False, PAGE_SIZE=16, NSPLIT=32, GROUP_PAD=8, BLOCK_M=2,
                 BLOCK_KV=dl.BLOCK_KV, IEEE=False, BN_QKV=bn_qkv, BK_QKV=bk_qkv, BN_O=bn_o, BK_O=bk_o, BN_R=1,
                 BK_R=dl.gemv_blocks(128, 2048)[1], BN_UP=dl.BN_UP, BK_UP=dl.BK_UP, BN_DN=dl.BN_DN, BK_DN=dl.BK_DN,
                 PHASE=phase)
    ptx = compile_pdl(dl._decode_layer_kernel, sig, const, True)
    # the five grid barriers poll with gpu-scope acquire loads (LLVM's form of the add-0 polls); none alone
    assert ptx.count("ld.global.gpu.acquire.b32") == (5 if phase == 0 else 0)


@pytest.mark.gpu
def test_fused_equals_phased_gpu():
    """The barriers change nothing: one launch == six launches, bit for bit (output and K/V)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _, ker = models("cuda", torch.bfloat16)
    ker.attn_backend = attn_backends.TritonBackend()
    pages = torch.tensor([[3, 1, 5, 0, 2, 4, -1]], dtype=torch.int32, device="cuda")
    results = []
    for mode in ("fused", "phased"):
        ker.attn_backend.decode_layer = mode
        caches = ker.allocate_caches(8, PAGE)
        for kv in caches.kv:
            kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(2)))
        with torch.inference_mode():
            out = ker.forward(batch([42], 70, pages, "cuda"), caches)
        results.append((out, [kv.clone() for kv in caches.kv]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
    dl.check_errors()
