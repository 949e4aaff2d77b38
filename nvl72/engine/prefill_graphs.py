"""Prefill and mixed steps replayed from piecewise CUDA graphs, one set per token count.

A step with prefill rows launches ~16 kernels a layer, and below ~2K tokens the host paces it (H200,
48-layer Qwen3-30B-A3B shape: a 1K-token prefill is 18.6 ms of kernels under 60-160 us of Python a
launch, perf/RESULTS.md). All of such a forward but its sequence mixing (the attention over each
sequence's pages, a Gated DeltaNet's conv and delta rule from each sequence's state slots) depends on
the token count alone, so (as vLLM's piecewise graphs) for each captured size of N tokens the forward
is captured as one graph per stretch between two mixers — embedding, RoPE table, layer 0's norm,
projections, q/k norm and K/V store | layer 0's o_proj, MoE, layer 1's ... | ... | the last
out-projection, MoE and final norm — and a step of n <= N tokens replays them with each mixer run
eagerly in between on the step's own rows and plan (FlashInfer's prefill planned once a forward on
the host, or triton's kernel; the GDN layer's `mix`).

The graphs read the step's token ids, positions and K/V slots from static buffers; rows n..N are
padding: slot -1 (nothing stored), mixer output rows left as the last step wrote them, outputs
ignored. All pieces of all sizes share one memory pool, as replays never overlap. A mixer's inputs
are outputs of the piece before it: kept as aliases that do not hold their memory (`alias`), so the
pool hands that memory on to later pieces, which run after the mixer read it (held, each size would
keep every layer's q). Capture is tried once at start-up; where it cannot be used the reason is
logged and those steps run eagerly. The static buffers, padding and cuts are tested on CPU (pieces
run eagerly), capture and replay by the `gpu` tests.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nvl72.engine.cuda_graphs import GraphUnavailable, end_failed_capture
from nvl72.engine.sizes import parse_sizes
from nvl72.model.attn_backends import AttentionShape, SplitMeta
from nvl72.model.batch import ForwardBatch, ModelCaches
from nvl72.model.layers import ForwardContext

log = logging.getLogger(__name__)

ENV = "NVL72_PREFILL_GRAPHS"


def default_sizes(max_num_batched_tokens: int) -> tuple[int, ...]:
    """16 .. 256 by doubling, then every 256 to 2048 and every 1024 beyond, and the largest step
    (`max_num_batched_tokens`): a step pads to the next size, so the gaps bound the padded rows (up to
    as many as the step's own below 512 tokens, where a forward is short; a quarter at most past 1024)."""
    m = max_num_batched_tokens
    sizes = [s for s in (16, 32, 64, 128) if s < m]
    sizes += list(range(256, min(m, 2048) + 1, 256)) + list(range(3072, m + 1, 1024))
    return tuple(sorted(set(sizes) | {m}))


def sizes_from_env() -> tuple[int, ...] | None:
    """$NVL72_PREFILL_GRAPHS: token counts, comma-separated, or 0 for none; None when unset."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    return () if text == "0" else parse_sizes(text, f"${ENV}", "token counts")


def alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over t's memory that does not keep it allocated: built from t's CUDA array interface,
    it holds that interface object, not t's storage (as an integer type of t's width, then viewed as
    t's dtype: the interface has no bfloat16)."""
    size = t.element_size()

    class Interface:
        __cuda_array_interface__ = {"shape": tuple(t.shape), "strides": tuple(s * size for s in t.stride()),
                                    "typestr": f"<i{size}" if size > 1 else "|i1", "data": (t.data_ptr(), False),
                                    "version": 3}

    return torch.as_tensor(Interface(), device=t.device).view(t.dtype)


@dataclass
class _Pieces:
    """One captured size: graphs[i] replays, then between[i](t, meta, batch) runs what the capture cut out
    there (an attention or a GDN mixing, on the step's own rows and plan), then graphs[i + 1]; hidden:
    the final hidden states [N, H]."""

    graphs: list = field(default_factory=list)
    between: list[Callable] = field(default_factory=list)
    hidden: torch.Tensor | None = None


class PrefillGraphs:
    """Piecewise CUDA graphs of `model.forward_context` for steps of up to `sizes[-1]` tokens."""

    def __init__(self, model, caches: ModelCaches, page_size: int, sizes):
        self.model, self.caches, self.page_size = model, caches, page_size
        self.backend = getattr(model, "attn_backend", None)
        if not sizes or min(sizes) < 1:
            raise ValueError(f"prefill graph sizes {sizes} must be >= 1")
        self.sizes = sorted(set(int(s) for s in sizes))
        self._check()
        device, n, dtype = model.device, self.sizes[-1], model.dtype
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.long, device=device)
        # every attention's (GDN mixing's) output, read by the piece after it: one buffer, as they run in turn
        a = AttentionShape.of(model)
        self.out = torch.zeros(n, a.num_heads, a.head_dim, dtype=dtype, device=device)
        gdn = next((layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn")), None)
        self.mixed = None if gdn is None else torch.zeros(n, gdn.num_v_heads, gdn.head_v_dim, dtype=dtype,
                                                          device=device)
        self.batches = {s: self._batch(s) for s in self.sizes}  # made here: a capture cannot copy from the host
        self.pieces: dict[int, _Pieces] = {}
        self.pool = None
        self.replays = 0
        self._capture_all()

    def _check(self) -> None:
        """Raise GraphUnavailable naming what this model / device / backend lacks."""
        m, b = self.model, self.backend
        if b is None or not (b.fused_qk_norm_rope and b.fused_ops):
            raise GraphUnavailable(f"attention backend {getattr(b, 'name', 'torch')!r} does not split at the "
                                   "attention (triton, flashinfer do)")
        p = m.parallel
        if p.tp_size > 1 or p.ep_size > 1:
            raise GraphUnavailable(f"not verified across ranks (TP {p.tp_size}, EP {p.ep_size})")
        if m.device.type != "cuda":
            raise GraphUnavailable(f"CUDA graphs need a CUDA device (model on {m.device})")

    def fits(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.sizes[-1]

    def _batch(self, n: int) -> ForwardBatch:
        """The static buffers as the forward's batch of n rows. Only the token ids and positions are
        read inside the pieces (the K/V slots come in the metadata); the rest describes one sequence."""
        dev = self.input_ids.device
        return ForwardBatch(input_ids=self.input_ids[:n], positions=self.positions[:n],
                            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
                            seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
                            page_table=torch.full((1, 1), -1, dtype=torch.int32, device=dev), max_query_len=n)

    def _forward(self, n: int, cut: Callable, keep: Callable = lambda x: x) -> torch.Tensor:
        """The forward over the first n rows of the static buffers. At each attention and GDN mixing,
        `cut(run)` with what runs in its place, `run(t, meta, batch)`, holding its inputs through `keep`
        (`alias` while capturing)."""
        m, b, batch = self.model, self.backend, self.batches[n]

        def attend(q, k, v, kv_cache, meta, scale, stored=True):
            q = keep(q)
            cut(lambda t, meta, batch: b.forward(q[:t], None, None, kv_cache, meta, scale, stored=True,
                                                 out=self.out[:t]))
            return self.out[:n]

        def mix(fn, mixed_qkv, g, beta, batch, conv_state, recurrent_state):
            mixed_qkv, g, beta = keep(mixed_qkv), keep(g), keep(beta)
            cut(lambda t, meta, batch: self.mixed[:t].copy_(fn(mixed_qkv[:t], g[:t], beta[:t], batch, conv_state,
                                                                recurrent_state)))
            return self.mixed[:n]

        cos, sin = b.rope_cos_sin(batch.positions, m.inv_freq, m.dtype)
        meta = SplitMeta(batch, self.slots[:n], n, attend, mix)
        return m.forward_context(ForwardContext(batch, self.caches, meta, cos, sin, b))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        t0, reserved = time.perf_counter(), torch.cuda.memory_reserved()
        # every size is captured on one side stream (as torch.cuda.graph's default capture stream): the
        # allocator hands a pool's freed blocks only to the stream that allocated them, so a stream a size
        # gave every size memory of its own (the 30B shape's 12 sizes to 2048 tokens held 3.3 GiB; with one
        # stream its 18 sizes to 8192 hold 1340 MiB, H200, perf/RESULTS.md)
        side = torch.cuda.Stream()
        for n in reversed(self.sizes):  # largest first: the smaller sizes fit in the memory it pooled
            self._forward(n, lambda run: None)  # warm-up: lazy inits, compiles, allocations
            self.pieces[n] = self._capture(n, side)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # what the warm-ups cached outside the pool goes back
        self.capture_seconds = time.perf_counter() - t0
        self.reserved_bytes = torch.cuda.memory_reserved() - reserved  # the pool and the static buffers
        log.info("CUDA graphs: prefill / mixed steps captured in %d pieces for %s tokens (%.1f s, %.0f MiB)",
                 len(self.pieces[self.sizes[-1]].graphs), self.sizes, self.capture_seconds,
                 self.reserved_bytes / 2**20)

    def _capture(self, n: int, side: torch.cuda.Stream) -> _Pieces:
        pieces = _Pieces()
        graph = torch.cuda.CUDAGraph()

        def end_piece():
            graph.capture_end()
            pieces.graphs.append(graph)
            self.pool = self.pool or graph.pool()  # the first capture's pool serves every later one

        def cut(run):
            nonlocal graph
            end_piece()
            pieces.between.append(run)
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)

        # as torch.cuda.graph does: garbage collected now, not inside the capture (a pinned host tensor's
        # free there, e.g. one a FlashInfer plan left behind, breaks it)
        torch.cuda.synchronize()
        gc.collect()
        stream = torch.cuda.current_stream()
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            try:
                graph.capture_begin(pool=self.pool)
                pieces.hidden = self._forward(n, cut, alias)
                end_piece()
            except RuntimeError as e:
                with contextlib.suppress(RuntimeError):  # a capture left open would swallow every later launch
                    graph.capture_end()
                torch.cuda.set_stream(stream)
                end_failed_capture()
                raise GraphUnavailable(f"capturing {n} tokens failed: {str(e).splitlines()[0]}") from e
        stream.wait_stream(side)
        return pieces

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's final hidden states [n, H] (a view of a static buffer, valid until the next run)."""
        t = batch.num_tokens
        if not self.fits(t):
            raise ValueError(f"a step of {t} tokens does not fit the prefill graphs (up to {self.sizes[-1]})")
        n = next(s for s in self.sizes if s >= t)
        meta = self.backend.plan(batch, self.page_size)
        self.input_ids[:t].copy_(batch.input_ids)
        self.positions[:t].copy_(batch.positions)
        self.slots[:t].copy_(meta.slot_mapping)
        self.slots[t:n].fill_(-1)
        hidden = self._replay(n, t, meta, batch)
        self.replays += 1
        return hidden[:t]

    def _replay(self, n: int, t: int, meta, batch: ForwardBatch) -> torch.Tensor:
        pieces = self.pieces[n]
        for graph, run in zip(pieces.graphs, pieces.between):
            graph.replay()
            run(t, meta, batch)
        pieces.graphs[-1].replay()
        return pieces.hidden


def build_prefill_graphs(model, caches: ModelCaches, page_size: int, sizes) -> PrefillGraphs | None:
    """`PrefillGraphs`, or None with the reason logged once (those steps then run eagerly)."""
    try:
        return PrefillGraphs(model, caches, page_size, sizes)
    except GraphUnavailable as e:
        log.warning("prefill CUDA graphs off: %s", e)
        return None
