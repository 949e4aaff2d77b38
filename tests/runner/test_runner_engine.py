"""The engine with the attention backends and CUDA-graph decode: greedy tokens identical to the
torch-reference engine, graphs on vs off. GPU tests need CUDA; the triton backend also runs on
CPU in Triton's interpreter (TRITON_INTERPRET=1); the CPU-only parts check the start-up choices."""
import logging
import os

import pytest
import torch

from nvl72.config import ModelConfig
from nvl72.engine.cuda_graphs import DecodeGraphs, GraphUnavailable, Replay, Staging, build_decode_graphs
from nvl72.engine.engine import EngineConfig, LLMEngine
from nvl72.engine.protocol import AddRequest, SamplingParams
from nvl72.model import attn_backends
from nvl72.model.loader import build_model, init_dummy_weights

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
_BASE = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
             rms_norm_eps=1e-6, max_position_embeddings=512, eos_token_id=[0])
CONFIGS = {
    # Dense MLPs everywhere: graph capture here tests the runner, not the MoE backends' host syncs.
    "qwen3_moe": dict(_BASE, model_type="qwen3_moe", mlp_only_layers=[0, 1]),
    "qwen3_next": dict(_BASE, model_type="qwen3_next", num_hidden_layers=4, mlp_only_layers=[0, 1, 2, 3],
                       shared_expert_intermediate_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                       full_attention_interval=2, mtp_num_hidden_layers=0, partial_rotary_factor=0.25),
    "qwen3_moe_sparse": dict(_BASE, model_type="qwen3_moe"),
    "qwen3_next_mtp": dict(_BASE, model_type="qwen3_next", num_hidden_layers=4, mlp_only_layers=[0, 1, 2, 3],
                           shared_expert_intermediate_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                           linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                           full_attention_interval=2, mtp_num_hidden_layers=1, partial_rotary_factor=0.25),
    # head_dim 128 in bf16: the FlashInfer prefill module the GPU hosts carry
    "qwen3_moe_hd128": dict(_BASE, model_type="qwen3_moe", mlp_only_layers=[0, 1], hidden_size=256, head_dim=128),
    "qwen3_moe_hd128_sparse": dict(_BASE, model_type="qwen3_moe", hidden_size=256, head_dim=128,
                                   moe_intermediate_size=128),
    # Gated DeltaNet + gated attention (head_dim 128: FlashInfer's), routed and shared experts
    "qwen3_next_hd128": dict(_BASE, model_type="qwen3_next", num_hidden_layers=4, hidden_size=256, head_dim=128,
                             moe_intermediate_size=128, shared_expert_intermediate_size=128, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                             linear_conv_kernel_dim=4, full_attention_interval=2, mtp_num_hidden_layers=0,
                             partial_rotary_factor=0.25),
    # FP8 expert path (sm90): N and K multiples of 128.
    "qwen3_moe_fp8": dict(_BASE, model_type="qwen3_moe", hidden_size=256, moe_intermediate_size=128, num_experts=8,
                          head_dim=64),
}


def tiny(name: str, device, dtype=torch.float32):
    model = build_model(ModelConfig.from_dict(CONFIGS[name]), dtype, "cpu")
    init_dummy_weights(model, seed=3, std=0.3)
    return model.to(device)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 96, (int(m),), generator=g).tolist() for m in torch.randint(3, 40, (n,), generator=g)]


def greedy(model, attention: str, graphs=None, setup=None, drafter=None, num_prompts: int = 7,
           **kw) -> tuple[dict[str, list[int]], LLMEngine]:
    """`num_prompts` prompts to 10 greedy tokens each; `setup(engine)` before the first request."""
    cfg = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, page_size=16, num_pages=80,
               attention_backend=attention, cuda_graph_batch_sizes=graphs)
    cfg.update(kw)
    engine = LLMEngine(model, EngineConfig(**cfg), drafter=drafter, eos_token_ids=[])
    if setup is not None:
        setup(engine)
    for i, p in enumerate(prompts(num_prompts, seed=5)):
        engine.add_request(AddRequest(f"r{i}", p, GREEDY))
    out: dict[str, list[int]] = {}
    for _ in range(500):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert all(len(v) == GREEDY.max_tokens for v in out.values()) and len(out) == num_prompts
    return out, engine


def test_cpu_engine_default_is_torch_backend_and_logged(caplog, monkeypatch):
    monkeypatch.delenv(attn_backends.ENV, raising=False)
    with caplog.at_level(logging.INFO):
        _, engine = greedy(tiny("qwen3_moe", "cpu"), None)
    assert engine.model.attn_backend.name == "torch" and engine.runner.graphs is None
    assert "attention backend: torch" in caplog.text


def test_graphs_refused_on_cpu_with_reason(caplog):
    model = tiny("qwen3_moe", "cpu")
    caches = model.allocate_caches(8, 16)
    with caplog.at_level(logging.WARNING):
        assert build_decode_graphs(model, caches, 16, 64, (1, 2), scratch_page=0) is None
    assert "CUDA graphs off: CUDA graphs need a CUDA device" in caplog.text
    with pytest.raises(GraphUnavailable, match="cpu"):
        DecodeGraphs(model, caches, 16, 64, (1,), scratch_page=0)


class EagerReplay:
    """DecodeGraphs' host path (staging, dummy padding rows) with the replay run eagerly on the CPU:
    the padded batch must give the real rows exactly what the unpadded one gives."""

    fits = DecodeGraphs.fits

    def __init__(self, engine: LLMEngine, sizes: tuple[int, ...]):
        self.model, self.caches = engine.model, engine.caches
        self.batch_sizes, self.query_len, self.max_pages, self.replays = sorted(sizes), 1, 16, 0
        slot = engine.slots.alloc(1)[0] if engine.hybrid else 0
        self.staging = Staging(max(sizes), 1, self.max_pages, engine.hybrid, engine.pages.alloc(1)[0], slot,
                               pin=False)

    def run(self, arrays, logits_indices=None, patch=None):
        b, t = arrays.num_seqs, arrays.num_tokens
        bs = next(s for s in self.batch_sizes if s >= b)
        self.staging.write(arrays, bs)
        if patch is not None:
            patch(self.staging.host.input_ids)
        hidden = self.model(self.staging.host.view(bs, 1), self.caches, check=False)
        logits = self.model.compute_logits(hidden, fp32=False)
        self.replays += 1
        view = self.staging.host.view(b, 1)
        view.logits_indices = logits_indices
        return Replay(hidden[:t], view, logits[:t], logits.argmax(-1)[:t])


INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU runs of triton need TRITON_INTERPRET=1")


# every model x backend x async scheduling but the hybrid on triton with async scheduling: its interpreted
# GDN kernels take ~50 s a run, and the staged-id patching it would add is the code the other cases run
@pytest.mark.parametrize("name, attention, overlap", [
    pytest.param(name, attention, overlap, marks=INTERPRETED if attention == "triton" else ())
    for name in ("qwen3_moe_sparse", "qwen3_next") for attention in ("torch", "triton") for overlap in (False, True)
    if (name, attention, overlap) != ("qwen3_next", "triton", True)])
def test_padded_replay_rows_match_eager_cpu(name, attention, overlap):
    """`overlap`: async scheduling, the previous step's tokens patched into the staged input ids."""
    model = tiny(name, "cpu")
    ref, _ = greedy(model, "torch")
    cfg = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, page_size=16, num_pages=80,
               attention_backend=attention, async_scheduling=overlap)
    engine = LLMEngine(model, EngineConfig(**cfg), eos_token_ids=[])
    engine.runner.graphs = replay = EagerReplay(engine, (2, 4, 8))
    for i, p in enumerate(prompts(7, seed=5)):
        engine.add_request(AddRequest(f"r{i}", p, GREEDY))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert replay.replays > 0 and out == ref
    c = engine.counters  # the steps that did not replay ran eagerly (the prefills at least)
    assert 0 < c["num_eager_steps"] == c["num_steps"] - replay.replays and c["eager_step_seconds"] > 0
    # every step() call but the first follows one that left requests in flight: a period each (async
    # scheduling ends with one more call, which only resolves the last step: not counted in num_steps)
    assert c["num_step_periods"] == c["num_steps"] - (0 if overlap else 1) and c["step_period_seconds"] > 0


@INTERPRETED
def test_triton_engine_matches_reference_interpreted():
    pytest.importorskip("triton")
    model = tiny("qwen3_next", "cpu")
    ref, _ = greedy(model, "torch")
    got, engine = greedy(model, "triton")
    assert engine.model.attn_backend.name == "triton" and got == ref


@pytest.fixture
def reference_moe(monkeypatch):
    monkeypatch.setenv("NVL72_MOE_BACKEND", "reference")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_next", "qwen3_moe_sparse"])
def test_triton_engine_matches_reference_gpu(name, reference_moe):
    model = tiny(name, "cuda")
    ref, _ = greedy(model, "torch")
    got, engine = greedy(model, "triton")
    assert engine.model.attn_backend.name == "triton" and got == ref


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_next"])
def test_graphs_on_equal_graphs_off(name, reference_moe):
    model = tiny(name, "cuda")
    ref, _ = greedy(model, "torch")
    eager, _ = greedy(model, "triton")
    got, engine = greedy(model, "triton", graphs=(1, 2, 4, 8))
    assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    assert got == eager == ref


@pytest.mark.gpu
def test_graphs_with_sm90_fp8_moe(monkeypatch):
    """The real decode path: FP8 expert kernels inside the captured graph (bf16)."""
    from moe import backend as moe_backends

    monkeypatch.setenv("NVL72_MOE_BACKEND", "sm90-fp8")
    try:
        moe_backends.select("cuda")
    except moe_backends.BackendUnavailable as e:
        pytest.skip(f"sm90-fp8 MoE backend unavailable here: {e}")
    model = tiny("qwen3_moe_fp8", "cuda", torch.bfloat16)
    eager, _ = greedy(model, "triton")
    got, engine = greedy(model, "triton", graphs=(1, 2, 4, 8))
    assert engine.runner.graphs is not None, "capture failed (see the 'CUDA graphs off' log line)"
    assert engine.runner.graphs.replays > 0 and got == eager


@pytest.mark.gpu
def test_flashinfer_prefill_engine_matches_triton(monkeypatch, reference_moe):
    """The flashinfer backend: prefill and mixed chunks (max_num_batched_tokens 64) attended by
    FlashInfer's paged prefill, one-token steps by triton's kernels in CUDA graphs; greedy tokens equal
    to the triton backend's (bf16, the same decode kernels)."""
    if attn_backends.available("flashinfer", torch.device("cuda")) is not None:
        pytest.skip(attn_backends.available("flashinfer", torch.device("cuda")))
    planned = []
    real = attn_backends.FlashInferBackend.forward

    def counting(self, q, k, v, kv_cache, meta, scale, stored=False, out=None):
        planned.append(isinstance(meta, attn_backends.FlashInferMeta))
        return real(self, q, k, v, kv_cache, meta, scale, stored, out)

    monkeypatch.setattr(attn_backends.FlashInferBackend, "forward", counting)
    model = tiny("qwen3_moe_hd128", "cuda", torch.bfloat16)
    ref, _ = greedy(model, "triton", graphs=(1, 2, 4, 8))
    got, engine = greedy(model, "flashinfer", graphs=(1, 2, 4, 8))
    assert engine.model.attn_backend.name == "flashinfer" and engine.runner.graphs.replays > 0
    assert any(planned) and got == ref


def test_graph_sizes_from_env(monkeypatch, caplog):
    monkeypatch.setenv("NVL72_CUDA_GRAPHS", "1,x")
    with pytest.raises(ValueError, match="NVL72_CUDA_GRAPHS='1,x'"):
        greedy(tiny("qwen3_moe", "cpu"), "torch")
    monkeypatch.setenv("NVL72_CUDA_GRAPHS", "1,2")
    with caplog.at_level(logging.WARNING):
        _, engine = greedy(tiny("qwen3_moe", "cpu"), "torch")
    assert engine.runner.graphs is None and "CUDA graphs off" in caplog.text
    assert engine.pages.num_used == engine.prefix.num_evictable_pages()  # the scratch page went back


@pytest.mark.gpu
def test_random_ops_work_after_a_failed_capture():
    """A capture that raises (a host sync inside it) leaves torch's default CUDA generator
    "capturing"; `end_failed_capture` (run by DecodeGraphs before it reports GraphUnavailable)
    releases it, so the next random op on the device works (a later model's dummy init did not)."""
    from nvl72.engine.cuda_graphs import end_failed_capture

    x = torch.ones(1, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with pytest.raises(RuntimeError):
        with torch.cuda.stream(side):
            with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=side):
                torch.randn(4, device="cuda")
                x.item()
    torch.cuda.current_stream().wait_stream(side)
    end_failed_capture()
    assert torch.randn(1000, device="cuda").std().item() > 0.5


@pytest.mark.parametrize("hybrid", [False, True])
def test_staging_write_pads_past_the_step(hybrid):
    """Staging.write: the step's rows from `flatten`'s arrays, every row after them up to the graph
    size a dummy's (rows an earlier, larger step wrote included), query_start_loc the dummies'."""
    import array

    from nvl72.engine.staging import StepArrays

    q, pages = 2, 5
    st = Staging(8, q, pages, hybrid, scratch_page=7, scratch_slot=9, pin=False)

    def step(b, base):
        cols = [[base + 10 * i + j for j in range(i % pages + 1)] for i in range(b)]
        return StepArrays(
            array.array("q", range(base, base + b * q)), array.array("q", range(base + 1, base + 1 + b * q)),
            array.array("i", range(0, (b + 1) * q, q)), array.array("i", range(base, base + b)), cols,
            array.array("q"), [], q, True, array.array("q", range(b)) if hybrid else None,
            array.array("q", range(b * q)) if hybrid else None)

    st.write(step(6, 100), 8)
    a = step(3, 200)
    st.write(a, 4)
    h, pad = st.host, st.pad
    assert h.input_ids[:6].tolist() == list(a.input_ids) and torch.equal(h.input_ids[6:8], pad.input_ids[6:8])
    assert h.positions[:6].tolist() == list(a.positions) and torch.equal(h.positions[6:8], pad.positions[6:8])
    assert h.seq_lens[:4].tolist() == list(a.seq_lens) + [q]
    assert h.query_start_loc.tolist() == list(range(0, 9 * q, q))
    for i, cols in enumerate(a.pages):
        assert h.page_table[i].tolist() == cols + [-1] * (pages - len(cols))
    assert h.page_table[3].tolist() == [7] + [-1] * (pages - 1)
    if hybrid:
        assert h.state_read_slots[:4].tolist() == [0, 1, 2, 9]
        assert h.state_write_slots[:8].tolist() == list(range(6)) + [-1, -1]


@pytest.mark.parametrize("hybrid", [False, True])
def test_staging_moves_as_one_prefix_copy(hybrid):
    """Every batch tensor is a disjoint view of one flat buffer with the page table last, so the
    first `prefix_bytes(bs)` bytes carry all a graph of bs sequences reads (what DecodeGraphs.run
    copies to the device in one go) and no page-table row past bs."""
    from nvl72.engine.cuda_graphs import _Buffers

    src, dst = (_Buffers(8, 2, 5, hybrid, "cpu", pin=False) for _ in range(2))
    assert src.page_table.eq(-1).all() and (not hybrid or src.state_write_slots.eq(-1).all())
    g = torch.Generator().manual_seed(3)
    for name in src.names():
        t = getattr(src, name)
        t.copy_(torch.randint(0, 1000, t.shape, generator=g))
    for bs in (1, 3, 8):
        dst.flat.zero_()
        n = src.prefix_bytes(bs)
        dst.flat[:n].copy_(src.flat[:n])
        a, b = src.view(bs, 2), dst.view(bs, 2)
        for name in src.names():
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert dst.page_table[bs:].eq(0).all()
    # disjoint views: writing one buffer leaves the others as they were
    before = {name: getattr(src, name).clone() for name in src.names()}
    src.seq_lens.fill_(-7)
    assert all(torch.equal(getattr(src, name), before[name]) for name in src.names() if name != "seq_lens")


def test_flatten_marks_decode_steps():
    """ForwardBatch.decode (the few-token layer paths) is set for decode and verify steps only: a step
    holding a prefill chunk runs the prefill paths, as the prefill graphs' pieces would."""
    from types import SimpleNamespace

    from nvl72.engine.runner import flatten
    from nvl72.engine.scheduler import ScheduledSeq

    def seq(n_ids, computed):
        return SimpleNamespace(all_ids=list(range(n_ids)), num_computed=computed, pages=[0], state_slot=3)

    decode = ScheduledSeq(seq(10, 9), 1, [])
    verify = ScheduledSeq(seq(10, 9), 3, [7, 8])
    chunk = ScheduledSeq(seq(10, 2), 5, [])
    assert flatten([decode, verify], True).decode
    assert not flatten([decode, chunk], True).decode and not flatten([chunk], True).decode
    assert not flatten([], True).decode


@pytest.mark.parametrize("decode", [False, True])
def test_gdn_layer_takes_the_fused_path_only_for_decode_steps(monkeypatch, decode):
    """A short step on a backend with the fused ops: the fused GDN block (norm inside the packed GEMV)
    only when the batch says decode / verify; a short prefill takes the layer's prefill ops, as the
    prefill graphs' pieces do (else greedy outputs depended on the prefill graphs, GPU-measured)."""
    from types import SimpleNamespace

    from nvl72.model import layers
    from nvl72.model.batch import ForwardBatch

    class Took(Exception):
        pass

    def took(path):
        def raise_(*args, **kwargs):
            raise Took(path)
        return raise_

    model = tiny("qwen3_next", "cpu")
    layer = next(m for m in model.modules() if isinstance(m, layers.DecoderLayer) and hasattr(m, "linear_attn"))
    monkeypatch.setattr(layers, "add_norm", took("prefill ops"))
    t = 3
    batch = ForwardBatch(torch.zeros(t, dtype=torch.long), torch.zeros(t, dtype=torch.long),
                         torch.tensor([0, t], dtype=torch.int32), torch.tensor([t], dtype=torch.int32),
                         torch.zeros(1, 1, dtype=torch.int32), max_query_len=t, decode=decode)
    ctx = layers.ForwardContext(batch, SimpleNamespace(conv=[None] * 8, recurrent=[None] * 8), None, None, None,
                                backend=SimpleNamespace(fused_ops=True, norm_linear=took("fused")))
    with pytest.raises(Took, match="fused" if decode else "prefill ops"):
        layer._gdn_block(torch.zeros(t, model.config.hidden_size), None, ctx)
