"""Model runner: turns a scheduler step into one `ForwardBatch`, runs the model, samples.

Prefill chunks, decode tokens and speculative verify rows are flattened into one batch; logits are
computed only for the rows that sample (the last token of a finishing prefill chunk, every
position of a decode step with drafts).
"""
from __future__ import annotations

import array
import functools
from dataclasses import dataclass

import torch

from nvl72.engine.sampler import DeviceSample, SampleResult, SampleRow, Sampler
from nvl72.engine.scheduler import ScheduledSeq
from nvl72.engine.sequence import Sequence
from nvl72.engine.staging import HostRing, StepArrays, pack, page_rows, unpack
from nvl72.model.batch import ForwardBatch, ModelCaches
from nvl72.model.dp_ep import MAIN_PASS


@dataclass
class StepResult:
    hidden: torch.Tensor  # [T, H] the model's output for every fed token
    batch: ForwardBatch
    sample_rows: list[tuple[int, int]]  # (index into scheduled, query offset) per sampled row
    sampled: SampleResult | None  # read back (None without sampled rows or when `readback=False`)
    pending: DeviceSample | None = None  # `readback=False`: the tokens, being copied to the host
    graphed: bool = False  # the forward replayed captured CUDA graphs, decode's or prefill's pieces (False: eager)


@dataclass
class PriorTokens:
    """Async scheduling: the tokens of the step still in flight, on the device, and the row of
    each sequence whose last token (a placeholder in `all_ids`) is one of them."""

    token_ids: torch.Tensor
    rows: dict[Sequence, int]


def placeholder_fill(scheduled: list[ScheduledSeq], prior: PriorTokens | None) -> list[list[int]]:
    """[[input position...], [row of `prior`...]]: where the step feeds a token not yet read back."""
    dst: list[int] = []
    src: list[int] = []
    start = 0
    for s in scheduled:
        if s.seq.pending and s.samples:  # the fed range reaches the placeholder, the last known token
            if prior is None or s.seq not in prior.rows:
                raise RuntimeError(f"{s.seq.request_id}: placeholder token with no step in flight sampling it")
            dst.append(start + s.num_new - len(s.drafts) - 1)
            src.append(prior.rows[s.seq])
        start += s.num_new
    return [dst, src]


def fill_run(fill: list[list[int]]) -> tuple[int, int, int] | None:
    """(first input position, first prior row, count) when `placeholder_fill`'s positions and rows
    are both consecutive (steady decode: every row's placeholder, in the prior step's order), so the
    patch is one slice copy instead of an index_select + index_copy_ (two launches, more host time)."""
    dst, src = fill
    if not dst:
        return None
    d0, s0, n = dst[0], src[0], len(dst)
    return (d0, s0, n) if dst == list(range(d0, d0 + n)) and src == list(range(s0, s0 + n)) else None


def patch_placeholders(input_ids: torch.Tensor, prior: PriorTokens, run: tuple[int, int, int] | None,
                       fill: torch.Tensor | None) -> None:
    """input_ids[dst] = prior tokens[src], on the device: one slice copy for a `fill_run`, else
    through `fill` [2, n] (dst, src, already there) by index_select + index_copy_ (less host time
    per step than an advanced-indexing put)."""
    if run is not None:
        d0, s0, n = run
        input_ids[d0:d0 + n].copy_(prior.token_ids[s0:s0 + n])
    elif fill is not None:
        input_ids.index_copy_(0, fill[0], prior.token_ids.index_select(0, fill[1]).to(input_ids.dtype))


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU through pinned memory, non-blocking (a pageable copy
    would wait for the work in flight: async scheduling's previous step)."""
    device = torch.device(device)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def ship(buf: torch.Tensor, device: torch.device, ring: HostRing | None) -> torch.Tensor:
    """A packed host buffer on `device`: through `ring` (reused pinned buffers) when given."""
    if device.type != "cuda":
        return buf
    return ring.to_device(buf, device) if ring is not None else to_device(buf, device)


def flatten(scheduled: list[ScheduledSeq], hybrid: bool) -> StepArrays:
    """The step's sequences flattened into host arrays (one pass, no tensors)."""
    ids: list[int] = []
    pos: list[int] = []
    cu = [0]
    seq_lens: list[int] = []
    write: list[int] = []
    logits_idx: list[int] = []
    rows: list[tuple[int, int]] = []
    max_q = 0
    decode = bool(scheduled)
    t = 0
    for i, s in enumerate(scheduled):
        seq = s.seq
        n, drafts, start = s.num_new, s.drafts, seq.num_computed
        known = n - len(drafts)
        decode = decode and known == 1
        all_ids = seq.all_ids
        if n == 1:  # a plain decode token
            ids.append(all_ids[start])
            pos.append(start)
        else:
            ids += all_ids[start:start + known]
            ids += drafts
            pos += range(start, start + n)
        seq_lens.append(start + n)
        if n > max_q:
            max_q = n
        if hybrid:
            w = [-1] * n
            for off, slot in zip(s.write_offsets, s.write_slots):
                w[off] = slot
            write += w
        if start + known == len(all_ids):  # s.samples
            for off in range(known - 1, n):
                logits_idx.append(t + off)
                rows.append((i, off))
        t += n
        cu.append(t)
    return StepArrays(
        array.array("q", ids), array.array("q", pos), array.array("i", cu), array.array("i", seq_lens),
        [s.seq.pages for s in scheduled], array.array("q", logits_idx), rows, max_q, decode,
        array.array("q", [s.seq.state_slot for s in scheduled]) if hybrid else None,
        array.array("q", write) if hybrid else None)


def build_batch(scheduled: list[ScheduledSeq], page_size: int, hybrid: bool, device,
                fill: list[list[int]] | None = None, ring: HostRing | None = None
                ) -> tuple[ForwardBatch, list[tuple[int, int]], torch.Tensor | None]:
    """Flatten the step's sequences into a `ForwardBatch`: built on the host in one packed buffer,
    moved in one copy (through `ring`'s pinned buffers on a GPU). `fill` (`placeholder_fill`)
    travels in the same copy: returned as a [2, n] tensor, or None when empty."""
    device = torch.device(device)
    a = flatten(scheduled, hybrid)
    max_pages = max([1] + [len(p) for p in a.pages])
    table = page_rows(a.pages, max_pages)  # [B, max_pages]
    int64 = [a.input_ids, a.positions, a.logits_indices]
    if hybrid:
        int64 += [a.state_read_slots, a.state_write_slots]
    has_fill = bool(fill and fill[0])
    if has_fill:
        int64.append(array.array("q", fill[0] + fill[1]))
    host, layout = pack(int64, [a.query_start_loc, a.seq_lens, table])
    f = unpack(ship(host, device, ring), layout, len(int64))
    batch = ForwardBatch(
        input_ids=f[0], positions=f[1], logits_indices=f[2],
        query_start_loc=f[-3], seq_lens=f[-2], page_table=f[-1].view(len(scheduled), max_pages),
        state_read_slots=f[3] if hybrid else None, state_write_slots=f[4] if hybrid else None,
        max_query_len=a.max_query_len, decode=a.decode)
    return batch, a.rows, f[-4].view(2, -1) if has_fill else None


class ModelRunner:
    def __init__(self, model, caches: ModelCaches, page_size: int, hybrid: bool, device):
        self.model = model
        self.caches = caches
        self.page_size = page_size
        self.hybrid = hybrid
        self.device = torch.device(device)
        self.sampler = Sampler()
        # Reused pinned buffers for the step's host->device inputs and for async scheduling's
        # read-backs (None off a GPU: nothing to stage).
        cuda = self.device.type == "cuda"
        self.ring = HostRing() if cuda else None
        self.readback = HostRing() if cuda else None
        self.graphs = None  # nvl72.engine.cuda_graphs.DecodeGraphs when the engine captured them
        self.prefill_graphs = None  # nvl72.engine.prefill_graphs.PrefillGraphs: the other steps, piecewise
        self.sync = None  # a DP+EP rank's nvl72.model.dp_ep.PassSync: its forwards in lockstep with the EP group

    def _graph_fits(self, scheduled: list[ScheduledSeq]) -> bool:
        g = self.graphs
        return (g is not None and all(s.num_new == g.query_len for s in scheduled)
                and g.fits(len(scheduled), len(scheduled) * g.query_len, max(len(s.seq.pages) for s in scheduled)))

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq], prior: PriorTokens | None = None, readback: bool = True) -> StepResult:
        """One forward + sampling. `prior`: the step in flight whose tokens this one feeds (async
        scheduling); `readback=False`: the sampled tokens stay on the device (`StepResult.pending`)."""
        fill = placeholder_fill(scheduled, prior)
        run = fill_run(fill)
        if run is not None:
            fill = None  # patched by a slice copy: no indices to ship
        graphed = self._graph_fits(scheduled)
        replay = None
        if graphed:  # decode step: replay, inputs written into the graphs' pinned staging
            arrays = flatten(scheduled, self.hybrid)
            rows = arrays.rows
            # The logits rows and placeholder indices go to the device in one copy of their own.
            has_fill = bool(fill and fill[0])
            small = array.array("q", arrays.logits_indices)
            if has_fill:
                small.extend(fill[0])
                small.extend(fill[1])
            dev = ship(torch.frombuffer(bytearray(small.tobytes() or bytes(8)), dtype=torch.uint8), self.device,
                       self.ring).view(torch.int64)
            n_li = len(arrays.logits_indices)
            fill_t = dev[n_li:n_li + 2 * len(fill[0])].view(2, -1) if has_fill else None
            patch = None
            if run is not None or fill_t is not None:
                patch = functools.partial(patch_placeholders, prior=prior, run=run, fill=fill_t)
            replay = self.graphs.run(arrays, dev[:n_li], patch)
            hidden, batch = replay.hidden, replay.batch
        else:
            batch, rows, fill_t = build_batch(scheduled, self.page_size, self.hybrid, self.device, fill, self.ring)
            patch_placeholders(batch.input_ids, prior, run, fill_t)
            if self.sync is not None:
                self.sync.before(MAIN_PASS)
            pieces = self.prefill_graphs
            if pieces is not None and pieces.fits(batch.num_tokens):
                hidden, graphed = pieces.run(batch), True
            else:
                hidden = self.model(batch, self.caches)
        if not rows:
            return StepResult(hidden, batch, rows, None, graphed=graphed)
        greedy = None
        if replay is not None and len(rows) == hidden.shape[0]:  # the graph computed every row's logits
            logits, greedy = replay.logits, replay.tokens
        else:  # every token row samples (plain decode): the indices are 0..T-1, no gather needed
            logits = self.model.compute_logits(hidden if len(rows) == hidden.shape[0] else hidden[batch.logits_indices])
        sample_rows = []
        for i, off in rows:
            s = scheduled[i]
            first = s.num_new - 1 - len(s.drafts)
            seq = s.seq
            # Penalties at draft position j see the drafts before it as already generated.
            sample_rows.append(SampleRow(seq.params, seq.all_ids, seq.num_prompt, seq.generator,
                                         s.drafts[:off - first]))
        if readback:
            return StepResult(hidden, batch, rows, self.sampler(logits, sample_rows, greedy), graphed=graphed)
        sample = self.sampler.sample(logits, sample_rows, greedy)
        return StepResult(hidden, batch, rows, None, sample, graphed=graphed)
