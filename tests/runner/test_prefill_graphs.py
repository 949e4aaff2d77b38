"""Piecewise CUDA graphs of prefill / mixed steps (nvl72.engine.prefill_graphs).

On CPU the pieces run eagerly (Triton's interpreter) through the same static buffers, padding and per-step
plan, the attention between them where a replay runs it: the padded steps must give the engine the
tokens of the torch reference. On a GPU: capture and replay against the eager forward (hidden states and
K/V pages of a ragged batch over cached prefixes) and greedy engines with the graphs on and off."""
import logging

import pytest
import torch

from nvl72.engine import prefill_graphs as pg
from nvl72.engine.engine import EngineConfig
from nvl72.engine.prefill_graphs import PrefillGraphs, build_prefill_graphs
from nvl72.model import attn_backends
from tests.runner.paged import random_batch, rel_err
from tests.runner.test_runner_engine import INTERPRETED, greedy, tiny


def test_default_sizes_bound_the_padding():
    assert pg.default_sizes(2048) == (16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048)
    assert pg.default_sizes(100) == (16, 32, 64, 100)
    assert pg.default_sizes(8192)[-7:] == (2048, 3072, 4096, 5120, 6144, 7168, 8192)


def test_sizes_from_env(monkeypatch):
    monkeypatch.delenv(pg.ENV, raising=False)
    assert pg.sizes_from_env() is None
    monkeypatch.setenv(pg.ENV, "0")
    assert pg.sizes_from_env() == () and EngineConfig().prefill_sizes(torch.device("cuda")) == ()
    monkeypatch.setenv(pg.ENV, "64, 16")
    assert pg.sizes_from_env() == (16, 64)
    assert EngineConfig(enforce_eager=True).prefill_sizes(torch.device("cuda")) == ()
    for bad in ("16,x", "-4"):
        monkeypatch.setenv(pg.ENV, bad)
        with pytest.raises(ValueError, match=pg.ENV):
            pg.sizes_from_env()


@pytest.mark.parametrize("name, attention, reason", [
    ("qwen3_moe", "torch", "does not split at the attention"),
    pytest.param("qwen3_next", "triton", "CUDA device", marks=INTERPRETED),
])
def test_refused_with_reason(name, attention, reason, caplog):
    model = tiny(name, "cpu")
    model.attn_backend = attn_backends.select(attn_backends.AttentionShape.of(model), "cpu", attention)
    with caplog.at_level(logging.WARNING):
        assert build_prefill_graphs(model, model.allocate_caches(8, 16, 2), 16, (16, 32)) is None
    assert "prefill CUDA graphs off: " in caplog.text and reason in caplog.text


class EagerPieces(PrefillGraphs):
    """PrefillGraphs' static buffers, padding rows and per-step plan with its pieces run eagerly, what a
    replay runs between them run where it was cut out; before each, the attention / GDN output rows
    are NaN (a real row that read a padding row, or a stale output, would show)."""

    cuts = 0

    def _check(self):
        pass

    def _capture_all(self):
        pass

    def _replay(self, n, t, meta, batch):
        def cut(run):
            self.cuts += 1
            for buf in (self.out, self.mixed):
                if buf is not None:
                    buf[:n].fill_(float("nan"))
            run(t, meta, batch)

        return self._forward(n, cut)


@INTERPRETED
@pytest.mark.parametrize("name, cuts, spec", [("qwen3_moe_sparse", 2, 0), ("qwen3_next_mtp", 4, 2)])
def test_padded_pieces_match_reference_cpu(name, cuts, spec):
    """Every step (prefill chunks of up to 64 tokens, mixed and decode steps of a few rows) runs through
    the pieces, padded to 16, 32 or 64 rows: the tokens of the torch-reference engine. qwen3_next_mtp: two
    Gated DeltaNet layers, their sequence mixing cut out as the attention is, and MTP speculation (2
    drafts): drafting reads the step's hidden states, a view of the pieces' static buffer, after the
    step, and every verify step (1 + 2 tokens a sequence) runs through the pieces too."""
    from nvl72.engine.spec import MTPDrafter

    model = tiny(name, "cpu")
    ref, _ = greedy(model, "torch", num_prompts=4)
    steps = []

    def setup(engine):
        engine.runner.prefill_graphs = pieces = EagerPieces(engine.model, engine.caches, 16, (16, 32, 64))
        real = pieces.run
        pieces.run = lambda batch: steps.append(batch.num_tokens) or real(batch)

    got, engine = greedy(model, "triton", setup=setup, num_prompts=4, num_speculative_tokens=spec,
                         drafter=MTPDrafter(spec) if spec else None)
    assert got == ref and engine.runner.prefill_graphs.replays == len(steps) == engine.counters["num_steps"]
    assert any(t > 16 for t in steps) and any(t < 16 for t in steps)
    assert engine.runner.prefill_graphs.cuts == cuts * len(steps)  # every layer's mixer between pieces
    assert not spec or engine.stats()["spec_decode_num_draft_tokens"] > 0


@pytest.mark.gpu
def test_alias_shares_memory_without_holding_it():
    t = torch.randn(4, 3, 8, device="cuda", dtype=torch.bfloat16)[:, 1]  # strided
    a = pg.alias(t)
    assert a.dtype == t.dtype and a.shape == t.shape and a.stride() == t.stride() and torch.equal(a, t)
    t.add_(1)
    assert torch.equal(a, t)
    free = torch.cuda.memory_allocated()
    big = torch.empty(1 << 26, dtype=torch.uint8, device="cuda")
    alias_big = pg.alias(big)
    del big
    assert torch.cuda.memory_allocated() == free and alias_big.numel() == 1 << 26


def _forward_pair(model, qlens, ctx, sizes, seed):
    """(eager hidden, caches) and (pieces' hidden, caches) of one random ragged batch over random cached
    prefixes (and random GDN states: sequence i reads slot i, its last token writes slot B + i)."""
    a = attn_backends.AttentionShape.of(model)
    batch, kv, *_ = random_batch(qlens, ctx, 16, a.num_heads, a.num_kv_heads, a.head_dim, model.dtype, "cuda",
                                 seed=seed)
    g = torch.Generator().manual_seed(seed)
    batch.input_ids = torch.randint(1, 96, (batch.num_tokens,), generator=g).cuda()
    b, hybrid = len(qlens), bool(model.cache_spec().state)
    if hybrid:
        batch.state_read_slots = torch.arange(b, device="cuda")
        write = torch.full((batch.num_tokens,), -1, dtype=torch.long)
        write[torch.tensor(qlens).cumsum(0) - 1] = torch.arange(b, 2 * b)
        batch.state_write_slots = write.cuda()
    start = model.allocate_caches(kv.shape[0], 16, 2 * b if hybrid else 0)
    for c in start.kv:
        if c is not None:
            c.copy_(kv)
    for c in start.conv + start.recurrent:
        if c is not None:
            c.copy_(torch.randn(c.shape, generator=g))
    outs = []
    for pieces in (None, PrefillGraphs):
        caches = model.allocate_caches(kv.shape[0], 16, 2 * b if hybrid else 0)
        for dst, src in zip(caches.kv + caches.conv + caches.recurrent, start.kv + start.conv + start.recurrent):
            if dst is not None:
                dst.copy_(src)
        with torch.inference_mode():
            if pieces is None:
                hidden = model(batch, caches).clone()
            else:
                graphs = pieces(model, caches, 16, sizes)
                hidden = graphs.run(batch).clone()
                assert graphs.replays == 1
        torch.cuda.synchronize()
        outs.append((hidden, caches))
    return outs


MODELS = [("qwen3_moe_hd128_sparse", "triton"), ("qwen3_moe_hd128_sparse", "flashinfer"),
          ("qwen3_next_hd128", "triton"), ("qwen3_next_hd128", "flashinfer")]


def _skip_unless(attention):
    why = attn_backends.available(attention, torch.device("cuda"))
    if why is not None:
        pytest.skip(why)


@pytest.mark.gpu
@pytest.mark.parametrize("name, attention", MODELS)
def test_replay_matches_eager_forward(name, attention):
    """Hidden states, stored K/V and GDN states of a replayed ragged prefill over cached prefixes against
    the eager forward (bf16, head_dim 128, the GPU's default MoE backend inside the pieces)."""
    _skip_unless(attention)
    model = tiny(name, "cuda", torch.bfloat16)
    model.attn_backend = attn_backends.select(attn_backends.AttentionShape.of(model), "cuda", attention)
    for qlens, ctx in (([7, 1, 33], [9, 40, 0]), ([20, 3], [0, 70])):
        (ref, ref_caches), (got, caches) = _forward_pair(model, qlens, ctx, (16, 48, 64), seed=sum(ctx))
        assert got.shape == ref.shape and rel_err(got, ref) < 2e-2, (qlens, rel_err(got, ref))
        for a, b in zip(caches.kv + caches.conv + caches.recurrent,
                        ref_caches.kv + ref_caches.conv + ref_caches.recurrent):
            if a is not None:
                assert rel_err(a, b) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("name, attention", MODELS)
def test_engine_with_prefill_graphs_equals_eager(name, attention):
    _skip_unless(attention)
    model = tiny(name, "cuda", torch.bfloat16)
    eager, _ = greedy(model, attention, graphs=(1, 2, 4, 8), prefill_graph_sizes=())
    got, engine = greedy(model, attention, graphs=(1, 2, 4, 8), prefill_graph_sizes=(16, 32, 64))
    pieces = engine.runner.prefill_graphs
    assert pieces is not None, "capture failed (see the 'prefill CUDA graphs off' log line)"
    assert pieces.replays > 0 and got == eager


@pytest.mark.gpu
def test_capture_that_fails_falls_back_eagerly(monkeypatch, caplog):
    """The reference MoE reads routing back to the host: capture fails, the engine says why and serves eagerly."""
    monkeypatch.setenv("NVL72_MOE_BACKEND", "reference")
    model = tiny("qwen3_moe_sparse", "cuda")
    with caplog.at_level(logging.WARNING):
        got, engine = greedy(model, "triton", prefill_graph_sizes=(16, 64))
    assert engine.runner.prefill_graphs is None and "prefill CUDA graphs off: capturing" in caplog.text
    ref, _ = greedy(model, "torch", prefill_graph_sizes=())
    assert got == ref
