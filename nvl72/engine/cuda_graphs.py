"""Decode steps replayed from CUDA graphs, one graph per batch size.

A decode step feeds every sequence the same number of tokens (`query_len`: 1, or 1 + k drafts
when speculating), so its shapes depend on the batch size alone. For each captured size the model
forward runs once under `torch.cuda.graph` over static device buffers; a step of B sequences
replays the smallest captured size >= B with the rows past B padded as dummy sequences of
`query_len` tokens at positions 0.. whose KV lives in one scratch page and whose GDN state is read
from one scratch slot and never written (the engine reserves both), so every kernel sees a
well-formed batch; their outputs are ignored.

Per step the host fills pinned staging buffers and moves them with one non_blocking H2D copy; the
attention metadata of the graph path is computed inside the graph from those buffers (the backend
must be `graph_safe`, i.e. need no host sync: the Triton backend). Nothing in a replay reads back
to the host. Every row of a decode step samples, so the graph also computes the logits of every
row (in the model's dtype) and their argmax: a greedy step launches nothing after the replay but
the copy of its tokens (lm_head and argmax outside the graph cost more host time per step than
their GPU time at batch 1); other sampling runs on the replay's logits.

Capture is tried once at start-up; when it cannot be used (CPU, a backend that plans on the host,
an op with a host sync inside the forward) the reason is logged and the engine runs eagerly.
The staging and padding are tested on CPU (replay run eagerly), capture and replay by the `gpu` tests.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import torch

from nvl72.engine.staging import StepArrays, page_rows, writable_bytes
from nvl72.model.batch import ForwardBatch, ModelCaches

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


class GraphUnavailable(RuntimeError):
    """CUDA graphs cannot be used for this model / device / backend (the message says why)."""


class _Buffers:
    """One set of [max_bs]-sized batch tensors (device, or pinned host staging), all views of one flat
    byte buffer with the page table last: a step's inputs move host -> device as one copy of its
    prefix (`prefix_bytes`) instead of one copy per tensor (each a few us of host time at batch 1)."""

    def __init__(self, max_bs: int, query_len: int, max_pages: int, hybrid: bool, device, pin: bool):
        t = max_bs * query_len
        specs = [("input_ids", (t,), torch.long, 0), ("positions", (t,), torch.long, 0),
                 ("query_start_loc", (max_bs + 1,), torch.int32, 0), ("seq_lens", (max_bs,), torch.int32, 0)]
        if hybrid:
            specs += [("state_read_slots", (max_bs,), torch.long, 0), ("state_write_slots", (t,), torch.long, -1)]
        specs.append(("page_table", (max_bs, max_pages), torch.int32, -1))
        offs, n = [], 0
        for _, shape, dtype, _ in specs:
            offs.append(n)
            n += -(-math.prod(shape) * dtype.itemsize // 16) * 16  # 16-byte aligned views
        self.flat = torch.zeros(n, dtype=torch.uint8, device=device, pin_memory=pin)
        self.state_read_slots = self.state_write_slots = None
        for (name, shape, dtype, init), off in zip(specs, offs):
            v = self.flat[off:off + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            if init:
                v.fill_(init)
            setattr(self, name, v)
        self._names = [name for name, *_ in specs]
        self.offsets = {name: off for (name, *_), off in zip(specs, offs)}  # bytes into `flat`
        self.itemsize = {name: dtype.itemsize for name, _, dtype, _ in specs}
        self._page_table_off, self._row_bytes = offs[-1], max_pages * 4

    def prefix_bytes(self, bs: int) -> int:
        """Bytes of `flat` that hold everything a graph of bs sequences reads (every buffer before the
        page table whole, then its first bs rows)."""
        return self._page_table_off + bs * self._row_bytes

    def names(self) -> list[str]:
        return self._names

    def view(self, bs: int, query_len: int) -> ForwardBatch:
        t = bs * query_len
        return ForwardBatch(
            input_ids=self.input_ids[:t], positions=self.positions[:t], query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], page_table=self.page_table[:bs],
            state_read_slots=None if self.state_read_slots is None else self.state_read_slots[:bs],
            state_write_slots=None if self.state_write_slots is None else self.state_write_slots[:t],
            max_query_len=query_len, decode=True)


class Staging:
    """Host-side batch of a replay: the step's rows, then dummy rows up to the graph's size."""

    def __init__(self, max_bs: int, query_len: int, max_pages: int, hybrid: bool, scratch_page: int,
                 scratch_slot: int, pin: bool):
        self.query_len, self.max_pages = query_len, max_pages
        self.host = _Buffers(max_bs, query_len, max_pages, hybrid, "cpu", pin=pin)
        self.pad = _Buffers(max_bs, query_len, max_pages, hybrid, "cpu", pin=False)  # every row a dummy
        self.pad.positions.copy_(torch.arange(query_len).repeat(max_bs))
        self.pad.query_start_loc.copy_(torch.arange(max_bs + 1) * query_len)
        self.pad.seq_lens.fill_(query_len)
        self.pad.page_table[:, 0] = scratch_page
        if hybrid:
            self.pad.state_read_slots.fill_(scratch_slot)
        # every row of a replayed step has query_len tokens: its query_start_loc is the dummies' for good
        self.host.query_start_loc.copy_(self.pad.query_start_loc)
        self._host, self._pad = writable_bytes(self.host.flat), writable_bytes(self.pad.flat)

    def write(self, a: StepArrays, bs: int) -> None:
        """Write the step's b <= bs sequences (query_len tokens each, `flatten`'s arrays) into the host
        buffers, rows b..bs as dummies: byte copies, no tensor op."""
        h, host, pad, q, b = self.host, self._host, self._pad, self.query_len, a.num_seqs
        fields = [("input_ids", a.input_ids, b * q, bs * q), ("positions", a.positions, b * q, bs * q),
                  ("seq_lens", a.seq_lens, b, bs)]
        if a.state_read_slots is not None:
            fields += [("state_read_slots", a.state_read_slots, b, bs),
                       ("state_write_slots", a.state_write_slots, b * q, bs * q)]
        fields.append(("page_table", page_rows(a.pages, self.max_pages), b * self.max_pages, bs * self.max_pages))
        for name, values, n, m in fields:
            off, size = h.offsets[name], h.itemsize[name]
            host[off:off + n * size] = values.tobytes()
            host[off + n * size:off + m * size] = pad[off + n * size:off + m * size]


@dataclass
class Replay:
    """A step's outputs, views of static buffers (valid until the next `DecodeGraphs.run`): hidden
    [T, H], the batch on the device, logits [T, V] in the model's dtype, their argmax [T]."""

    hidden: torch.Tensor
    batch: ForwardBatch
    logits: torch.Tensor
    tokens: torch.Tensor


class DecodeGraphs:
    """CUDA graphs of `model.forward` for decode batches of `batch_sizes` sequences x `query_len` tokens."""

    def __init__(self, model, caches: ModelCaches, page_size: int, max_model_len: int,
                 batch_sizes=DEFAULT_BATCH_SIZES, query_len: int = 1, hybrid: bool = False, *,
                 scratch_page: int, scratch_slot: int = 0):
        device = model.device
        if device.type != "cuda":
            raise GraphUnavailable(f"CUDA graphs need a CUDA device (model on {device})")
        backend = getattr(model, "attn_backend", None)
        if backend is None or not backend.graph_safe:
            raise GraphUnavailable(f"attention backend {getattr(backend, 'name', 'torch')!r} plans on the host "
                                   "(graph-safe: triton)")
        if not batch_sizes or min(batch_sizes) < 1 or not 1 <= query_len <= page_size:
            raise ValueError(f"batch_sizes={batch_sizes} must be >= 1 and query_len={query_len} in [1, "
                             f"page_size={page_size}]")
        self.model, self.caches, self.query_len = model, caches, query_len
        self.batch_sizes = sorted(set(int(b) for b in batch_sizes))
        self.max_pages = math.ceil((max_model_len + query_len) / page_size) + 1
        max_bs = self.batch_sizes[-1]
        self.dev = _Buffers(max_bs, query_len, self.max_pages, hybrid, device, pin=False)
        self.staging = Staging(max_bs, query_len, self.max_pages, hybrid, scratch_page, scratch_slot, pin=True)
        for name in self.dev.names():  # the capture runs on dummy rows only
            getattr(self.dev, name).copy_(getattr(self.staging.pad, name))
        self.copied = torch.cuda.Event()
        self._views: dict[tuple[int, int], tuple] = {}  # (graph size, sequences) -> run's output views
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # hidden, logits, tokens
        self.replays = 0
        self._capture_all()

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for bs in reversed(self.batch_sizes):  # largest first: smaller graphs reuse its memory pool
            batch = self.dev.view(bs, self.query_len)  # every row a dummy sequence on the scratch page
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: lazy inits, autotuning and allocations outside the capture
                    self._step(batch)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.current_stream()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs] = self._step(batch)
            except RuntimeError as e:
                # torch.cuda.graph's exit raised before restoring the stream: its capture stream is still
                # current, and every later launch would go there (PDL included: aot.launch)
                torch.cuda.set_stream(stream)
                end_failed_capture()
                raise GraphUnavailable(f"capturing batch size {bs} failed: {str(e).splitlines()[0]}") from e
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        log.info("CUDA graphs: decode captured for batch sizes %s x %d token(s), %d pages per sequence",
                 self.batch_sizes, self.query_len, self.max_pages)

    def _step(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a replay runs: the forward, every row's logits (model dtype) and their argmax."""
        hidden = self.model(batch, self.caches, check=False)
        logits = self.model.compute_logits(hidden, fp32=False)
        return hidden, logits, logits.argmax(-1)

    def fits(self, num_seqs: int, num_tokens: int, max_pages: int) -> bool:
        """Whether a step of `num_seqs` sequences x query_len tokens can replay a graph."""
        return (0 < num_seqs <= self.batch_sizes[-1] and num_tokens == num_seqs * self.query_len
                and max_pages <= self.max_pages)

    def run(self, arrays: StepArrays, logits_indices: torch.Tensor | None = None, patch=None) -> Replay:
        """Replay for a step's host arrays (`nvl72.engine.runner.flatten`); `logits_indices` (already on
        the device) rides along in the returned batch. `patch(input_ids)` edits the device input ids
        before the replay (async scheduling writes the previous step's sampled tokens there, never
        read back to the host)."""
        b, t = arrays.num_seqs, arrays.num_tokens
        pages = max([0] + [len(p) for p in arrays.pages])
        if not self.fits(b, t, pages):
            raise ValueError(f"batch of {b} sequences / {t} tokens / {pages} pages does not fit "
                             f"the graphs (sizes {self.batch_sizes} x {self.query_len}, {self.max_pages} pages)")
        bs = next(s for s in self.batch_sizes if s >= b)
        st = self.staging
        self.copied.synchronize()  # the previous step's copies have left the staging buffers
        st.write(arrays, bs)
        n = self.dev.prefix_bytes(bs)
        self.dev.flat[:n].copy_(st.host.flat[:n], non_blocking=True)
        self.copied.record()
        if patch is not None:
            patch(self.dev.input_ids)
        self.graphs[bs].replay()
        self.replays += 1
        key = (bs, b)
        views = self._views.get(key)
        if views is None:  # the slices of a (graph, step size): made once, not per step
            view = self.dev.view(b, self.query_len)
            hidden, logits, tokens = self.outputs[bs]
            t = b * self.query_len
            views = self._views[key] = (view, hidden[:t], logits[:t], tokens[:t])
        view, hidden, logits, tokens = views
        batch = replace(view, logits_indices=logits_indices)
        return Replay(hidden, batch, logits, tokens)


def end_failed_capture() -> None:
    """After a capture that raised: a capture of one small op on the current device, so the default
    CUDA generator, left "capturing" by the failed capture's missing epilogue, is released (torch
    otherwise refuses every later random op on the device: "Offset increment outside graph capture
    encountered unexpectedly")."""
    x = torch.zeros(1, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def build_decode_graphs(model, caches: ModelCaches, page_size: int, max_model_len: int, batch_sizes,
                        query_len: int = 1, hybrid: bool = False, *, scratch_page: int,
                        scratch_slot: int = 0) -> DecodeGraphs | None:
    """`DecodeGraphs`, or None with the reason logged once (the engine then runs eagerly)."""
    try:
        return DecodeGraphs(model, caches, page_size, max_model_len, batch_sizes, query_len, hybrid,
                            scratch_page=scratch_page, scratch_slot=scratch_slot)
    except GraphUnavailable as e:
        log.warning("CUDA graphs off: %s", e)
        return None
